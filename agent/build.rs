use anyhow::Context as _;
use aya_build::{Package, Toolchain};

#[path = "build/git_revision.rs"]
mod git_revision;

/// The eBPF crate's toolchain file: the one place its nightly is pinned.
const TOOLCHAIN_FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../ebpf/rust-toolchain.toml");

/// Builds the eBPF objects (crate `vmpath-ebpf`: `vmpath`, the data path,
/// and `vmpath-bench`, the bench's baselines) into OUT_DIR, where
/// `dataplane` embeds them, with the nightly `ebpf/rust-toolchain.toml` pins;
/// and the git revision for `vmpath --version`.
fn main() -> anyhow::Result<()> {
    git_revision::emit(env!("CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-changed={TOOLCHAIN_FILE}");
    // The object's types and contracts come from `common`: a change there
    // must rebuild it (aya-build watches only the eBPF crate's directory).
    println!(
        "cargo:rerun-if-changed={}",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../common")
    );
    let toml = std::fs::read_to_string(TOOLCHAIN_FILE)
        .with_context(|| format!("reading {TOOLCHAIN_FILE}"))?;
    let channel = toml
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once('=')?;
            (key.trim() == "channel").then(|| value.trim().trim_matches('"'))
        })
        .with_context(|| format!("{TOOLCHAIN_FILE}: no `channel = \"...\"` line"))?;
    let ebpf = Package {
        name: "vmpath-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], Toolchain::Custom(channel)).context("building the eBPF object")
}
