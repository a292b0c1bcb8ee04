//! `cargo xtask test`: setup, build the agent, run every test crate with
//! VMPATH_BIN pointing at the agent binary the integration tests start.

use anyhow::Result;

use crate::{cargo, cmd, setup};

const PACKAGES: [&str; 3] = ["vmpath-common", "vmpath", "vmpath-tests"];
const DEFAULT_ARGS: [&str; 1] = ["--test-threads=2"];

pub fn run(args: Vec<String>) -> Result<()> {
    cmd::require_root("cargo xtask test")?;
    setup::run()?;
    let bin = cargo::build_agent()?;
    let args = if args.is_empty() {
        DEFAULT_ARGS.iter().map(|s| s.to_string()).collect()
    } else {
        args
    };
    let mut c = cargo::cargo();
    c.arg("test");
    for p in PACKAGES {
        c.args(["-p", p]);
    }
    c.arg("--").args(&args).env("VMPATH_BIN", &bin);
    println!("$ VMPATH_BIN={} {}", bin.display(), cmd::display(&c));
    cmd::run("running the tests", &mut c)
}
