//! The workspace: where it is, where cargo puts its output, and building the
//! agent binary.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use anyhow::{Context as _, Result};

use crate::cmd;

/// The workspace root (the parent of this crate).
pub fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `cargo` of the toolchain that runs xtask (set by `cargo run`).
pub fn cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root());
    c
}

/// The workspace's target directory, as cargo reports it (honours
/// CARGO_TARGET_DIR and config).
pub fn target_dir() -> Result<&'static Path> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if let Some(d) = DIR.get() {
        return Ok(d);
    }
    let step = "locating the target directory";
    let out = cmd::output(
        step,
        cargo().args(["metadata", "--format-version", "1", "--no-deps"]),
    )?;
    let meta: serde_json::Value = serde_json::from_str(&out).context(step)?;
    let dir = meta["target_directory"]
        .as_str()
        .with_context(|| format!("{step}: no target_directory in `cargo metadata`"))?;
    Ok(DIR.get_or_init(|| PathBuf::from(dir)))
}

/// Builds the agent (`cargo build -p vmpath`, debug) and returns the
/// absolute path of the `vmpath` binary.
pub fn build_agent() -> Result<PathBuf> {
    let mut c = cargo();
    c.args(["build", "-p", "vmpath"]);
    println!("$ {}", cmd::display(&c));
    cmd::run("building the agent", &mut c)?;
    let bin = target_dir()?.join("debug").join("vmpath");
    anyhow::ensure!(
        bin.is_file(),
        "building the agent: {} missing after the build",
        bin.display()
    );
    Ok(bin)
}
