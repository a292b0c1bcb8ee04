use anyhow::Context as _;
use aya_build::{Package, Toolchain};

/// Builds the eBPF object (crate `vmpath-ebpf`) into OUT_DIR, where
/// `dataplane` embeds it.
fn main() -> anyhow::Result<()> {
    let ebpf = Package {
        name: "vmpath-ebpf",
        root_dir: concat!(env!("CARGO_MANIFEST_DIR"), "/../ebpf"),
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], Toolchain::Custom("nightly")).context("building the eBPF object")
}
