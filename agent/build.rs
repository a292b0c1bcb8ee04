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
    share_ebpf_target_dir()?;
    aya_build::build_ebpf([ebpf], Toolchain::Custom(channel))
        .context("building the eBPF object")?;
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    for object in ["vmpath", "vmpath-bench"] {
        strip_dwarf(&out_dir.join(object))?;
    }
    Ok(())
}

/// Removes the object's DWARF sections (and their relocations). The
/// loader reads the programs, maps, BTF and BTF.ext (CO-RE relocations
/// and the line info the verifier's log shows), never DWARF; the DWARF is
/// three quarters of the object, embedded in the agent and read whole
/// when the agent loads it, so it was some 5 MiB of every agent's
/// resident memory. The eBPF crate is still built with debug info: the
/// linker makes the BTF from it.
fn strip_dwarf(path: &std::path::Path) -> anyhow::Result<()> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut builder = object::build::elf::Builder::read(&*data)
        .with_context(|| format!("parsing {}", path.display()))?;
    for section in builder.sections.iter_mut() {
        let name = &*section.name;
        if name.starts_with(b".debug_") || name.starts_with(b".rel.debug_") {
            section.delete = true;
        }
    }
    builder.delete_orphans();
    // LLVM names the sections from the symbols' string table; the writer
    // wants a table of section names of its own.
    if !builder
        .sections
        .iter()
        .any(|s| matches!(s.data, object::build::elf::SectionData::SectionString))
    {
        let names = builder.sections.add();
        names.name = b".shstrtab".to_vec().into();
        names.sh_type = object::elf::SHT_STRTAB;
        names.sh_addralign = 1;
        names.data = object::build::elf::SectionData::SectionString;
    }
    let mut out = Vec::new();
    builder
        .write(&mut out)
        .with_context(|| format!("writing {} without DWARF", path.display()))?;
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Points the target directory aya-build gives its nested cargo (inside
/// this run's OUT_DIR) at one directory of the workspace's, so that every
/// run of this script (clippy's, the debug build's, the images' release
/// build, each with its own OUT_DIR) shares one eBPF build: otherwise each
/// builds `core` and the data path from scratch, minutes of a cold CI run on
/// two cores. Cargo's lock on that directory serialises runs at the same
/// time; the objects copied into OUT_DIR stay per run.
fn share_ebpf_target_dir() -> anyhow::Result<()> {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    // aya-build 0.2's layout: OUT_DIR/aya-build/target/<package>.
    let link_dir = out_dir.join("aya-build").join("target");
    let link = link_dir.join("vmpath-ebpf");
    let shared = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/ebpf"));
    std::fs::create_dir_all(shared).with_context(|| format!("creating {}", shared.display()))?;
    std::fs::create_dir_all(&link_dir)
        .with_context(|| format!("creating {}", link_dir.display()))?;
    match std::fs::read_link(&link) {
        Ok(to) if to == shared => return Ok(()),
        Ok(_) => std::fs::remove_file(&link)?,
        // A directory from a build before this one shared it.
        Err(_) if link.is_dir() => std::fs::remove_dir_all(&link)?,
        Err(_) => {}
    }
    std::os::unix::fs::symlink(shared, &link)
        .with_context(|| format!("linking {} to {}", link.display(), shared.display()))
}
