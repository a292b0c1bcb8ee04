//! `cargo xtask test`: setup, build the agent and the image, run every test
//! crate with VMPATH_BIN pointing at the agent binary the integration tests
//! start, VMPATH_IMAGE and VMPATH_IMAGE_NEXT at the image archives the image
//! tests run (the second reports another version: the upgrade's target),
//! VMPATH_BIRD_IMAGE at the BIRD sidecar's image. The runner is
//! cargo-nextest (`.config/nextest.toml`: how many tests at once, which
//! ones share the machine with nobody).

use anyhow::Result;

use crate::{cargo, cmd, image, setup};

/// The version suffix of the image the upgrade test moves to.
const NEXT_SUFFIX: &str = "-next";

/// Every crate with tests but the eBPF one (bpf target only: its code is
/// tested by running it: tests/tests/*fixtures.rs).
const PACKAGES: [&str; 6] = [
    "vmpath-common",
    "vmpath-api",
    "vmpath",
    "vmpath-cni",
    "vmpath-tests",
    "xtask",
];

pub fn run(args: Vec<String>) -> Result<()> {
    cmd::require_root("cargo xtask test")?;
    setup::run()?;
    let bin = cargo::build_agent()?;
    let (current, next) = image::build_with_successor(NEXT_SUFFIX)?;
    let bird = image::bird::build(&current)?;
    let mut c = cargo::cargo();
    c.args(["nextest", "run", "--no-tests=fail"]);
    for p in PACKAGES {
        c.args(["-p", p]);
    }
    // Filters and nextest's own options (`--no-capture`, `-j 1`, ...).
    c.args(&args)
        .env("VMPATH_BIN", &bin)
        .env("VMPATH_IMAGE", &current.archive)
        .env("VMPATH_IMAGE_NEXT", &next.archive)
        .env("VMPATH_BIRD_IMAGE", &bird.archive);
    println!(
        "$ VMPATH_BIN={} VMPATH_IMAGE={} VMPATH_IMAGE_NEXT={} VMPATH_BIRD_IMAGE={} {}",
        bin.display(),
        current.archive.display(),
        next.archive.display(),
        bird.archive.display(),
        cmd::display(&c)
    );
    cmd::run("running the tests", &mut c)
}
