//! `cargo xtask setup`: everything the build and the tests need, installed
//! only when missing, so a second run is quick. One line per step.

use std::{io::Write as _, process::Command, process::Stdio};

use anyhow::{Context as _, Result, bail};

use crate::{cargo, cmd, cmd::is_root, guest, toolchain};

/// Debian packages: LLVM for bpf-linker, the data-path and traffic tools the
/// tests and the demo drive.
const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "bpftool",
    "iproute2",
    "iperf3",
    "tcpdump",
    "python3-scapy",
    "udhcpc",
    "isc-dhcp-client",
    "ndisc6",
    "bird2",
    "arping",
    "iputils-ping",
    "iputils-tracepath",
    "curl",
    "ethtool",
    "tshark",
    // The bench: chart labels (BENCHMARKS.png), the masquerade baseline.
    "fonts-dejavu-core",
    "nftables",
    // The CNI plugin's tests: podman's CNI backend runs busybox containers.
    "podman",
    "containernetworking-plugins",
    "runc",
    "busybox-static",
    // The cluster-network stand-in's DNS server (tests/src/cluster_net.rs).
    "dnsmasq-base",
];

const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const BPFFS: &str = "/sys/fs/bpf";

pub fn run() -> Result<()> {
    report("apt packages", apt_packages()?);
    report(
        "eBPF toolchain (ebpf/rust-toolchain.toml)",
        ebpf_toolchain()?,
    );
    report("bpf-linker 0.13", bpf_linker()?);
    report("cargo-nextest (the test runner)", nextest()?);
    report("bpffs on /sys/fs/bpf", bpffs()?);
    report("guest artefacts (QEMU, kernel, initramfs)", guest::setup()?);
    Ok(())
}

/// What a step did: `None` when there was nothing to do.
type Done = Option<String>;

fn report(step: &str, done: Done) {
    match done {
        None => println!("setup: {step}: ok (already)"),
        Some(what) => println!("setup: {step}: {what}"),
    }
}

fn apt_packages() -> Result<Done> {
    let step = "setup: apt packages";
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(None);
    }
    if !is_root() {
        bail!(
            "{step}: missing {}; run setup as root to install them",
            missing.join(" ")
        );
    }
    cmd::run(step, Command::new("apt-get").arg("update"))?;
    if missing.contains(&"tshark") {
        // Keep wireshark's debconf question (setuid dumpcap) from prompting.
        preseed("wireshark-common wireshark-common/install-setuid boolean false\n")
            .context(step)?;
    }
    cmd::run(
        step,
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing),
    )?;
    Ok(Some(format!("installed {}", missing.join(" "))))
}

fn dpkg_installed(package: &str) -> bool {
    cmd::probe(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]))
        .is_some_and(|s| s.trim() == "install ok installed")
}

fn preseed(selection: &str) -> Result<()> {
    let mut child = Command::new("debconf-set-selections")
        .stdin(Stdio::piped())
        .spawn()
        .context("starting debconf-set-selections")?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(selection.as_bytes())?;
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "debconf-set-selections failed ({status})");
    Ok(())
}

/// The components the eBPF crate's pinned nightly needs: rust-src for
/// `-Z build-std=core`, clippy for `cargo xtask clippy-ebpf`.
const EBPF_COMPONENTS: [&str; 2] = ["rust-src", "clippy"];

/// The eBPF crate's pinned nightly with [`EBPF_COMPONENTS`].
fn ebpf_toolchain() -> Result<Done> {
    let channel = toolchain::ebpf_channel();
    let step = format!("setup: {channel} {}", EBPF_COMPONENTS.join(", "));
    let step = step.as_str();
    let installed = cmd::probe(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        channel,
        "--installed",
    ]));
    match installed {
        Some(list) => {
            let missing: Vec<&str> = EBPF_COMPONENTS
                .into_iter()
                .filter(|c| !list.lines().any(|l| l.trim().starts_with(c)))
                .collect();
            if missing.is_empty() {
                return Ok(None);
            }
            cmd::run(
                step,
                Command::new("rustup")
                    .args(["component", "add"])
                    .args(&missing)
                    .args(["--toolchain", channel]),
            )?;
            Ok(Some(format!("added {} to {channel}", missing.join(", "))))
        }
        None => {
            let mut c = Command::new("rustup");
            c.args(["toolchain", "install", channel, "--profile", "minimal"]);
            for component in EBPF_COMPONENTS {
                c.args(["--component", component]);
            }
            cmd::run(step, &mut c)?;
            Ok(Some(format!(
                "installed {channel} with {}",
                EBPF_COMPONENTS.join(", ")
            )))
        }
    }
}

/// `Some("bpf-linker 0.13.0")` when a 0.13 bpf-linker runs.
fn bpf_linker_version() -> Option<String> {
    let v = cmd::probe(Command::new("bpf-linker").arg("--version"))?;
    let v = v.trim().to_string();
    let number = v.split_whitespace().nth(1)?;
    number.starts_with("0.13.").then_some(v)
}

fn bpf_linker() -> Result<Done> {
    let step = "setup: bpf-linker";
    if bpf_linker_version().is_some() {
        return Ok(None);
    }
    println!("setup: bpf-linker: building bpf-linker 0.13 against LLVM 22 (takes about 3 minutes)");
    let install = |locked: bool| {
        let mut c = cargo::cargo();
        c.args([
            "install",
            "bpf-linker",
            "--version",
            "^0.13",
            "--no-default-features",
        ])
        .args(["--features", "llvm-22"])
        .env("LLVM_PREFIX", LLVM_PREFIX)
        .env("LLVM_SYS_221_PREFIX", LLVM_PREFIX);
        if locked {
            c.arg("--locked");
        }
        cmd::run(step, &mut c)
    };
    if let Err(e) = install(true) {
        println!(
            "setup: bpf-linker: install with --locked failed ({e:#}); retrying without --locked"
        );
        install(false)?;
    }
    match bpf_linker_version() {
        Some(v) => Ok(Some(format!("installed {v}"))),
        None => bail!(
            "{step}: installed, but `bpf-linker --version` does not report 0.13.x; is ~/.cargo/bin on PATH?"
        ),
    }
}

/// Whether `cargo nextest` runs (the machine image usually has it).
pub(crate) fn nextest_version() -> Option<String> {
    cmd::probe(cargo::cargo().args(["nextest", "--version"])).map(|v| v.trim().to_string())
}

/// The suite's runner: all crates' tests in one pool of processes
/// (`.config/nextest.toml`), which `cargo test`'s one binary at a time
/// cannot do.
fn nextest() -> Result<Done> {
    let step = "setup: cargo-nextest";
    if nextest_version().is_some() {
        return Ok(None);
    }
    println!("setup: cargo-nextest: building it (takes a few minutes, once)");
    cmd::run(
        step,
        cargo::cargo().args(["install", "cargo-nextest", "--locked"]),
    )?;
    match nextest_version() {
        Some(v) => Ok(Some(format!("installed {v}"))),
        None => bail!(
            "{step}: installed, but `cargo nextest --version` fails; is ~/.cargo/bin on PATH?"
        ),
    }
}

fn bpffs() -> Result<Done> {
    let step = "setup: bpffs";
    let fs_type = |step| cmd::output(step, Command::new("stat").args(["-f", "-c", "%T", BPFFS]));
    if fs_type(step)?.trim() == "bpf_fs" {
        return Ok(None);
    }
    if !is_root() {
        bail!("{step}: {BPFFS} is not a bpffs; run setup as root to mount it");
    }
    cmd::run(
        step,
        Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]),
    )?;
    Ok(Some(format!("mounted bpffs on {BPFFS}")))
}
