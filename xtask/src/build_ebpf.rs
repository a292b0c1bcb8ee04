//! `cargo xtask build-ebpf`: the eBPF object on its own, built the way
//! aya-build builds it for the agent (same target, flags and build-std).

use std::{path::PathBuf, process::Command};

use anyhow::Result;

use crate::{cargo, cmd, toolchain};

const TARGET: &str = "bpfel-unknown-none";

/// The rustflags aya-build 0.2.0 passes, separated by 0x1f as
/// CARGO_ENCODED_RUSTFLAGS requires.
fn encoded_rustflags() -> String {
    let arch = std::env::consts::ARCH;
    [
        format!("--cfg=bpf_target_arch=\"{arch}\""),
        "-Cdebuginfo=2".into(),
        "-Clink-arg=--btf".into(),
    ]
    .join("\x1f")
}

/// `cargo +<pinned nightly> <subcommand> -p vmpath-ebpf --release` for the
/// bpf target, as aya-build runs it.
fn cargo_ebpf(subcommand: &str) -> Command {
    // The rustup proxy from PATH (not $CARGO, which is stable's cargo
    // itself), so `+<channel>` selects the pinned nightly.
    let mut c = Command::new("cargo");
    c.current_dir(cargo::root())
        .arg(format!("+{}", toolchain::ebpf_channel()))
        .args([subcommand, "-p", "vmpath-ebpf", "--release"])
        .args(["--target", TARGET, "-Z", "build-std=core"])
        .env("CARGO_ENCODED_RUSTFLAGS", encoded_rustflags())
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN");
    c
}

/// `cargo xtask clippy-ebpf`: clippy over the eBPF crate (both objects),
/// warnings denied. The workspace's `cargo clippy` cannot reach it: it
/// builds only for the bpf target, with the pinned nightly.
pub fn clippy() -> Result<()> {
    let mut c = cargo_ebpf("clippy");
    c.args(["--bins", "--", "-D", "warnings"]);
    eprintln!("$ {}", cmd::display(&c));
    cmd::run("clippy on the eBPF crate", &mut c)
}

/// Builds `vmpath-ebpf` and returns the path of the object.
pub fn run() -> Result<PathBuf> {
    let mut c = cargo_ebpf("build");
    eprintln!("$ {}", cmd::display(&c));
    cmd::run("building the eBPF object", &mut c)?;
    let object = cargo::target_dir()?
        .join(TARGET)
        .join("release")
        .join("vmpath");
    anyhow::ensure!(
        object.is_file(),
        "building the eBPF object: {} missing after the build",
        object.display()
    );
    Ok(object)
}
