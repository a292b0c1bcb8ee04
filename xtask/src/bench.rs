//! `cargo xtask bench`: setup, build the agent and the bench (release), run
//! `vmpath-bench` (tests/src/bin/vmpath-bench) as root. It writes
//! BENCHMARKS.md and BENCHMARKS.png at the repository root.

use anyhow::Result;

use crate::{cargo, cmd, setup};

pub fn run(args: Vec<String>) -> Result<()> {
    cmd::require_root("cargo xtask bench")?;
    setup::run()?;
    let mut c = cargo::cargo();
    c.args([
        "build",
        "--release",
        "-p",
        "vmpath",
        "-p",
        "vmpath-tests",
        "-p",
        "vmpath-cni",
        "--bin",
        "vmpath",
        "--bin",
        "vmpath-bench",
        "--bin",
        "vmpath-cni",
    ]);
    println!("$ {}", cmd::display(&c));
    cmd::run("building the agent and the bench (release)", &mut c)?;
    let release = cargo::target_dir()?.join("release");
    let root = cargo::root().canonicalize()?;
    let shown = std::iter::once("cargo xtask bench".to_string())
        .chain(args.iter().map(|a| {
            if a.contains(' ') {
                format!("'{a}'")
            } else {
                a.clone()
            }
        }))
        .collect::<Vec<_>>()
        .join(" ");
    let mut b = std::process::Command::new(release.join("vmpath-bench"));
    b.arg("--out")
        .arg(&root)
        .args(&args)
        .env("VMPATH_BIN", release.join("vmpath"))
        .env("VMPATH_CNI_BIN", release.join("vmpath-cni"))
        .env("VMPATH_BENCH_COMMAND", &shown);
    println!("$ {}", cmd::display(&b));
    cmd::run("running the benchmarks", &mut b)
}
