//! The test guests' artefacts, built by `cargo xtask setup`: QEMU (Debian's
//! qemu-system-x86 and the libraries it lacks, unpacked, not installed: the
//! package conflicts with a backported qemu-utils on the CI machines), a
//! Debian cloud kernel taken from its package, and an initramfs with a
//! static busybox, ISC dhclient for DHCPv6 (busybox-static has no
//! udhcpc6) with the C library it links, the virtio NIC's modules and a
//! small init.
//!
//! Everything lands in one cache directory (`VMPATH_GUEST_DIR`, default
//! [`DEFAULT_DIR`]) with a stamp: a hash of the inputs (the package lists,
//! the init and DHCP hooks, the layout version). A second run with the same
//! inputs does nothing.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::cmd;

/// Where the tests look for the guest artefacts unless `VMPATH_GUEST_DIR`
/// says otherwise (the tests crate uses the same default).
pub const DEFAULT_DIR: &str = "/var/cache/vmpath/guest";

/// Bump when the layout of the cache changes.
const LAYOUT: &str = "guest-layout-1";

/// QEMU and what it needs beyond a Debian bookworm base system.
const QEMU_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "qemu-system-common",
    "qemu-system-data",
    "seabios",
    "libbrlapi0.8",
    "libcacard0",
    "libcapstone4",
    "libdaxctl1",
    "libepoxy0",
    "libexecs0",
    "libfdt1",
    "libgstreamer-plugins-base1.0-0",
    "libibverbs1",
    "libndctl6",
    "libnl-route-3-200",
    "libopus0",
    "liborc-0.4-0",
    "libpmem1",
    "librdmacm1",
    "libslirp0",
    "libsndio7.0",
    "libspice-server1",
    "libusb-1.0-0",
    "libusbredirparser1",
    "libvdeplug2",
];

/// The metapackage naming the current cloud kernel.
const KERNEL_META: &str = "linux-image-cloud-amd64";
const BUSYBOX: &str = "busybox-static";
/// DHCPv6 in the guest: ISC dhclient (`dhclient -6`), dynamically linked
/// against the C library only, which comes from its own package so that
/// the two match.
const DHCLIENT: &str = "isc-dhcp-client";
const LIBC: &str = "libc6";
/// Files of those packages the initramfs takes, at the same paths: the
/// binary, the C library and the dynamic loader (its PT_INTERP path).
const DHCLIENT_FILES: &[&str] = &[
    "sbin/dhclient",
    "lib/x86_64-linux-gnu/libc.so.6",
    "lib64/ld-linux-x86-64.so.2",
];

/// The virtio NIC's modules; the initramfs loads them in the order their
/// `depends=` fields give.
const MODULES: &[&str] = &[
    "virtio",
    "virtio_ring",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
];

const INIT: &str = include_str!("guest/init");
const UDHCPC_HOOK: &str = include_str!("guest/udhcpc.sh");
const DHCLIENT6_HOOK: &str = include_str!("guest/dhclient6.sh");

pub fn dir() -> PathBuf {
    std::env::var_os("VMPATH_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR))
}

/// FNV-1a over the inputs: stable across toolchains, enough for a cache key.
fn inputs_hash() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let parts = [
        LAYOUT,
        KERNEL_META,
        BUSYBOX,
        INIT,
        UDHCPC_HOOK,
        DHCLIENT,
        LIBC,
        DHCLIENT6_HOOK,
    ]
    .into_iter()
    .chain(DHCLIENT_FILES.iter().copied())
    .chain(QEMU_PACKAGES.iter().copied())
    .chain(MODULES.iter().copied());
    for part in parts {
        for b in part.bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Builds the artefacts unless the stamp says they are current.
pub fn setup() -> Result<Option<String>> {
    let step = "setup: guest artefacts";
    let dir = dir();
    let hash = inputs_hash();
    let stamp = dir.join("stamp");
    if fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == hash) {
        return Ok(None);
    }
    if !crate::cmd::is_root() {
        bail!(
            "{step}: {} is missing or stale; run setup as root to build it",
            dir.display()
        );
    }
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).with_context(|| format!("{step}: creating {}", dir.display()))?;
    let debs = dir.join("debs");
    fs::create_dir_all(&debs)?;

    let kernel_pkg = kernel_package(step)?;
    let mut packages: Vec<&str> = QEMU_PACKAGES.to_vec();
    packages.extend([BUSYBOX, DHCLIENT, LIBC]);
    packages.push(&kernel_pkg);
    // `apt-get download` writes into the working directory; `_apt` cannot
    // write to it, hence the unsandboxed download as root.
    cmd::run(
        step,
        Command::new("apt-get")
            .args(["-q", "-o", "APT::Sandbox::User=root", "download"])
            .args(&packages)
            .current_dir(&debs),
    )?;

    let qemu_root = dir.join("qemu");
    let kernel_root = debs.join("kernel");
    for entry in fs::read_dir(&debs)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "deb") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let guest_side = ["linux-image-", "busybox", DHCLIENT, LIBC];
        let into = if guest_side.iter().any(|p| name.starts_with(p)) {
            &kernel_root
        } else {
            &qemu_root
        };
        cmd::run(
            step,
            Command::new("dpkg-deb").arg("-x").arg(&path).arg(into),
        )?;
    }
    check_qemu_libraries(step, &qemu_root)?;

    let kver = kernel_pkg
        .strip_prefix("linux-image-")
        .context("kernel package name")?
        .to_string();
    fs::copy(
        kernel_root.join(format!("boot/vmlinuz-{kver}")),
        dir.join("vmlinuz"),
    )
    .with_context(|| format!("{step}: the kernel image of {kernel_pkg}"))?;
    let initramfs = initramfs(step, &kernel_root, &kver)?;
    fs::write(dir.join("initramfs.cpio"), initramfs)?;
    fs::write(dir.join("kernel-version"), format!("{kver}\n"))?;
    fs::remove_dir_all(&debs)?;
    fs::write(&stamp, format!("{hash}\n"))?;
    Ok(Some(format!(
        "built {} (kernel {kver}, QEMU from {})",
        dir.display(),
        QEMU_PACKAGES[0]
    )))
}

/// `linux-image-6.1.0-N-cloud-amd64`, the package the metapackage points at.
fn kernel_package(step: &str) -> Result<String> {
    let out = cmd::output(
        step,
        Command::new("apt-cache").args(["depends", KERNEL_META]),
    )?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-"))
        .map(str::to_string)
        .with_context(|| format!("{step}: `apt-cache depends {KERNEL_META}` names no kernel"))
}

/// Fails naming the libraries QEMU cannot find (a base system unlike
/// Debian bookworm's would need more packages in [`QEMU_PACKAGES`]).
fn check_qemu_libraries(step: &str, root: &Path) -> Result<()> {
    let bin = root.join("usr/bin/qemu-system-x86_64");
    let out = cmd::output(
        step,
        Command::new("ldd")
            .arg(&bin)
            .env("LD_LIBRARY_PATH", root.join("usr/lib/x86_64-linux-gnu")),
    )?;
    let missing: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("not found"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{step}: {} needs libraries no downloaded package has: {}",
            bin.display(),
            missing.join(" ")
        );
    }
    Ok(())
}

/// The `depends=` field of a kernel module's `.modinfo`.
fn module_depends(ko: &[u8]) -> Vec<String> {
    let key = b"\0depends=";
    ko.windows(key.len())
        .position(|w| w == key)
        .map(|at| {
            let rest = &ko[at + key.len()..];
            let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            String::from_utf8_lossy(&rest[..end])
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

fn initramfs(step: &str, kernel_root: &Path, kver: &str) -> Result<Vec<u8>> {
    let mut cpio = Cpio::default();
    for d in [
        "bin",
        "dev",
        "etc",
        "lib",
        "lib/modules",
        "proc",
        "sys",
        "tmp",
        "run",
    ] {
        cpio.dir(d);
    }
    let busybox = fs::read(kernel_root.join("bin/busybox"))
        .with_context(|| format!("{step}: busybox from {BUSYBOX}"))?;
    cpio.file("bin/busybox", 0o755, &busybox);
    cpio.symlink("bin/sh", "busybox");
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("etc/udhcpc.sh", 0o755, UDHCPC_HOOK.as_bytes());
    cpio.file("etc/dhclient6.sh", 0o755, DHCLIENT6_HOOK.as_bytes());
    for d in ["sbin", "lib/x86_64-linux-gnu", "lib64"] {
        cpio.dir(d);
    }
    for f in DHCLIENT_FILES {
        let data = read_in_root(kernel_root, f)
            .with_context(|| format!("{step}: {f} from {DHCLIENT} or {LIBC}"))?;
        cpio.file(f, 0o755, &data);
    }

    let modules_root = kernel_root.join(format!("lib/modules/{kver}/kernel"));
    let found = find_modules(&modules_root)?;
    let mut depends: BTreeMap<&str, (Vec<u8>, Vec<String>)> = BTreeMap::new();
    for m in MODULES {
        let path = found
            .get(*m)
            .with_context(|| format!("{step}: module {m}.ko not in the kernel package"))?;
        let ko = fs::read(path)?;
        let deps = module_depends(&ko);
        depends.insert(m, (ko, deps));
    }
    // No modules.dep is shipped: order by each module's own depends=.
    let mut order: Vec<&str> = Vec::new();
    while order.len() < MODULES.len() {
        let next = MODULES.iter().find(|m| {
            !order.contains(m) && depends[*m].1.iter().all(|d| order.contains(&d.as_str()))
        });
        match next {
            Some(m) => order.push(m),
            None => {
                let stuck: Vec<String> = MODULES
                    .iter()
                    .filter(|m| !order.contains(m))
                    .map(|m| format!("{m} (depends={})", depends[*m].1.join(",")))
                    .collect();
                bail!(
                    "{step}: modules whose dependencies are not in the list: {}",
                    stuck.join(", ")
                );
            }
        }
    }
    for m in &order {
        cpio.file(&format!("lib/modules/{m}.ko"), 0o644, &depends[m].0);
    }
    cpio.file(
        "lib/modules/order",
        0o644,
        format!("{}\n", order.join("\n")).as_bytes(),
    );
    Ok(cpio.finish())
}

/// The file at `path` in the unpacked tree `root`, following symlinks
/// inside that tree (lib64's loader is an absolute link, which read from
/// the host would be the host's loader).
fn read_in_root(root: &Path, path: &str) -> Result<Vec<u8>> {
    let mut at = root.join(path);
    for _ in 0..8 {
        if !fs::symlink_metadata(&at)?.file_type().is_symlink() {
            return Ok(fs::read(&at)?);
        }
        let target = fs::read_link(&at)?;
        at = match target.strip_prefix("/") {
            Ok(inside) => root.join(inside),
            Err(_) => at.parent().context("a link at the root")?.join(target),
        };
    }
    bail!(
        "{}: too many levels of symbolic links",
        root.join(path).display()
    )
}

/// Module name (`virtio_net`) to its path, under `root`.
fn find_modules(root: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Some(name) = path.file_name().and_then(|n| n.to_str())
                && let Some(stem) = name.strip_suffix(".ko")
            {
                found.insert(stem.to_string(), path);
            }
        }
    }
    Ok(found)
}

/// A `newc` cpio archive, the format the kernel unpacks as initramfs.
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.out.extend_from_slice(header.as_bytes());
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, data);
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120_777, target.as_bytes());
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }
}
