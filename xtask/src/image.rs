//! `cargo xtask image`: vmpath's OCI image, assembled here with no base
//! image and no registry. Statically linked release binaries (`vmpath`:
//! agent and CLI, with the eBPF object embedded; `vmpath-cni`: the plugin
//! and its `install` for the init container) in one layer; no shell, no
//! package manager; beside them the build machine's `nft` (Debian's
//! nftables, with its libraries and their copyright files: the pod
//! network's hand-off writes an nftables table). Entries are sorted,
//! owned by root and stamped with one fixed time (SOURCE_DATE_EPOCH, else the commit's time), and every JSON
//! document is written the same way, so the same sources and toolchain give
//! the same digest. The result is an OCI archive that `podman load`,
//! `ctr images import` and `skopeo copy oci-archive:` take. The BIRD
//! sidecar's image is built next to it, with the same tag (`image::bird`).

use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use crate::{cargo, cmd};

pub mod bird;
mod host;

/// The repository part of the image reference; `--name` changes it.
pub const DEFAULT_NAME: &str = "localhost/vmpath";
/// Where the binaries live in the image (also its PATH).
const BIN_DIR: &str = "usr/bin";
const BINARIES: [&str; 2] = ["vmpath", "vmpath-cni"];
/// nftables' CLI, where Debian installs it: the agent runs it for the pod
/// network's hand-off table (agent/src/plan/handoff.rs).
const NFT: &str = "/usr/sbin/nft";

#[derive(clap::Args)]
pub struct Options {
    /// Repository part of the image reference (the tag is
    /// `<version>-<git revision>`).
    #[arg(long, default_value = DEFAULT_NAME)]
    pub name: String,
    /// Appended to the version the binaries report (e.g. `-rc1`): a build
    /// of the same sources that must not pass for the release.
    #[arg(long, allow_hyphen_values = true)]
    pub version_suffix: Option<String>,
    /// Print the result as one JSON object (for scripts and the tests).
    #[arg(long)]
    pub json: bool,
}

/// A built image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The OCI archive.
    pub archive: PathBuf,
    /// `<name>:<tag>`, as the archive names it.
    pub reference: String,
    pub version: String,
    pub revision: String,
    /// The manifest's digest (`sha256:...`): the image's identity.
    pub digest: String,
    /// Bytes of the one layer (uncompressed): what the image adds to a node.
    pub layer_size: u64,
}

impl Image {
    pub fn to_json(&self) -> Value {
        json!({
            "archive": self.archive,
            "reference": self.reference,
            "version": self.version,
            "revision": self.revision,
            "digest": self.digest,
            "layerSize": self.layer_size,
        })
    }

    fn from_json(v: &Value) -> Option<Image> {
        Some(Image {
            archive: PathBuf::from(v["archive"].as_str()?),
            reference: v["reference"].as_str()?.to_string(),
            version: v["version"].as_str()?.to_string(),
            revision: v["revision"].as_str()?.to_string(),
            digest: v["digest"].as_str()?.to_string(),
            layer_size: v["layerSize"].as_u64()?,
        })
    }
}

pub fn run(opts: &Options) -> Result<()> {
    let start = Instant::now();
    let image = build(&opts.name, opts.version_suffix.as_deref(), Profile::Release)?;
    let bird = bird::build(&image)?;
    if opts.json {
        let mut v = image.to_json();
        v["bird"] = bird.to_json();
        println!("{v}");
        return Ok(());
    }
    for i in [&image, &bird] {
        let archive_size = fs::metadata(&i.archive).map(|m| m.len()).unwrap_or(0);
        println!("image:    {}", i.reference);
        println!("digest:   {}", i.digest);
        println!(
            "size:     {:.1} MiB (one layer), archive {:.1} MiB",
            mib(i.layer_size),
            mib(archive_size)
        );
        println!("archive:  {}", i.archive.display());
    }
    println!("built in  {:.0?}", start.elapsed());
    println!(
        "load them: podman load -i ARCHIVE   or on a node: ctr -n k8s.io images import ARCHIVE"
    );
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// How the image's binaries are compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `cargo xtask image`: what is shipped: cargo's `release` profile,
    /// statically linked (checked: no ELF interpreter).
    Release,
    /// The image tests' images: the test suite's own debug build of the
    /// same sources, stripped, with the libraries it loads beside it. A
    /// second, static build of the whole dependency tree was the longest
    /// part of a cold CI run on two cores; what the image tests check (the
    /// image's assembly, init steps, upgrade, cleanup, the BIRD sidecar)
    /// does not depend on how the binaries were linked or optimised, and
    /// the data path is the same eBPF object either way. The static link
    /// is checked where it is made, by `cargo xtask image`.
    Test,
}

impl Profile {
    /// Cargo's profile name, which is also its output folder's name.
    fn cargo_name(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Test => "dev",
        }
    }
}

/// Builds the binaries and assembles the image from them.
pub fn build(name: &str, version_suffix: Option<&str>, profile: Profile) -> Result<Image> {
    if let Some(s) = version_suffix {
        ensure!(
            !s.is_empty()
                && s.len() <= vmpath_common::version_stamp::SUFFIX_MAX
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c)),
            "--version-suffix {s:?}: use 1 to 40 of A-Z a-z 0-9 - . _ (it goes into the image tag)"
        );
    }
    let built = match profile {
        Profile::Release => static_binaries()?,
        Profile::Test => debug_binaries()?,
    };
    let bins = staged_binaries(&built, version_suffix, profile)?;
    let (version, revision) = reported_version(&bins)?;
    let tag = if revision == "unknown" {
        version.clone()
    } else {
        format!("{version}-{revision}")
    };
    let tag: String = tag
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-._".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let epoch = source_date_epoch()?;

    // The host's nft with its libraries and licenses (the pod network's
    // hand-off writes its nftables table with it), then vmpath's
    // binaries (with the libraries a test build loads).
    let nft = Path::new(NFT);
    ensure!(
        nft.is_file(),
        "{NFT} missing: the nftables package provides it (cargo xtask setup)"
    );
    let mut files = host::binaries_with_libraries(&[nft])?;
    let paths: Vec<PathBuf> = BINARIES.iter().map(|b| bins.join(b)).collect();
    if profile == Profile::Test {
        let paths: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        files.extend(host::libraries_of(&paths)?);
    }
    for (bin, path) in BINARIES.iter().zip(paths) {
        files.insert(format!("{BIN_DIR}/{bin}"), (0o755, path));
    }
    let dirs = BTreeMap::from([("etc/".to_string(), 0o755), ("tmp/".to_string(), 0o1777)]);
    let layer = host::layer(dirs, files, epoch)?;
    let labels = json!({
        "org.opencontainers.image.title": "vmpath",
        "org.opencontainers.image.description": "vmpath node agent, CLI and CNI plugin",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        // The binaries embed the eBPF object (ebpf/Cargo.toml's license);
        // nft and its libraries come with their Debian copyright files.
        "org.opencontainers.image.licenses": "(MIT OR Apache-2.0) AND (MIT OR GPL-2.0-only) AND GPL-2.0-only",
        // Which cargo profile built the binaries: a test image says so.
        "dev.vmpath.cargo-profile": profile.cargo_name(),
    });
    let written = write_archive(&Assembly {
        dir: image_dir()?,
        file_prefix: "vmpath-",
        reference: format!("{name}:{tag}"),
        tag: &tag,
        epoch,
        layer,
        labels,
        env: vec![format!("PATH=/{BIN_DIR}:/usr/sbin")],
        cmd: vec!["vmpath".into(), "agent".into()],
    })?;
    prune_other_revisions(&image_dir()?, "vmpath-", &revision);
    Ok(Image {
        archive: written.archive,
        reference: written.reference,
        version,
        revision,
        digest: written.digest,
        layer_size: written.layer_size,
    })
}

/// What goes into one image: its one layer and its config.
pub(crate) struct Assembly<'a> {
    /// Where the archive is written, as `<file_prefix><tag>.oci.tar`.
    pub dir: PathBuf,
    pub file_prefix: &'a str,
    /// `<name>:<tag>`.
    pub reference: String,
    pub tag: &'a str,
    /// The one time every entry and the config carry.
    pub epoch: u64,
    /// The layer, an uncompressed tar (see [`Tar`]).
    pub layer: Vec<u8>,
    /// OCI annotations, also the config's labels (`created` is added).
    pub labels: Value,
    pub env: Vec<String>,
    pub cmd: Vec<String>,
}

/// An archive written by [`write_archive`].
pub(crate) struct Written {
    pub archive: PathBuf,
    pub reference: String,
    pub digest: String,
    pub layer_size: u64,
}

/// Writes `a` as an OCI archive (config, layer and manifest blobs sorted,
/// index naming the reference for podman, skopeo and containerd alike).
pub(crate) fn write_archive(a: &Assembly) -> Result<Written> {
    let epoch = a.epoch;
    let layer_digest = sha256(&a.layer)?;
    let created = rfc3339(epoch)?;
    let mut labels = a.labels.clone();
    labels["org.opencontainers.image.created"] = json!(created);
    let config = json!({
        "architecture": oci_arch()?,
        "os": "linux",
        "created": created,
        "config": {
            "Env": a.env,
            "Cmd": a.cmd,
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": created, "created_by": "cargo xtask image"}],
    });
    let config = serde_json::to_vec(&config)?;
    let config_digest = sha256(&config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": a.layer.len(),
        }],
        "annotations": labels,
    }))?;
    let digest = sha256(&manifest)?;
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest,
            "size": manifest.len(),
            "annotations": {
                // containerd (`ctr images import`) names the image by this,
                // podman and skopeo by the ref name.
                "io.containerd.image.name": a.reference,
                "org.opencontainers.image.ref.name": a.reference,
            },
        }],
    }))?;

    let mut blobs = vec![
        (blob_path(&config_digest), &config),
        (blob_path(&layer_digest), &a.layer),
        (blob_path(&digest), &manifest),
    ];
    blobs.sort_by(|x, y| x.0.cmp(&y.0));
    let mut archive = Tar::default();
    archive.dir("blobs/", 0o755, epoch);
    archive.dir("blobs/sha256/", 0o755, epoch);
    for (path, data) in &blobs {
        archive.file(path, 0o644, epoch, data);
    }
    archive.file("index.json", 0o644, epoch, &index);
    archive.file(
        "oci-layout",
        0o644,
        epoch,
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    );

    fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    let name = format!("{}{}.oci.tar", a.file_prefix, a.tag);
    let path = a.dir.join(&name);
    // Each writer its own temporary file: the image tests build the same
    // image from parallel processes, and a shared one was renamed away
    // under the second writer ("writing ...: No such file or directory").
    // The archives are the same bytes; the last rename wins.
    let tmp = a.dir.join(format!(".{name}.{}.tmp", std::process::id()));
    fs::write(&tmp, archive.finish()).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(Written {
        archive: path,
        reference: a.reference.clone(),
        digest,
        layer_size: a.layer.len() as u64,
    })
}

/// The image and a second one of the same sources whose binaries report
/// another version (`suffix`): an upgrade from one to the other is a real
/// image-to-image upgrade. The second is rebuilt only when the first
/// changed (its suffix recompiles the binaries' `main.rs` alone).
pub fn build_with_successor(suffix: &str, profile: Profile) -> Result<(Image, Image)> {
    let image = build(DEFAULT_NAME, None, profile)?;
    let stamp = image_dir()?.join(format!("successor{suffix}.json"));
    let cached = fs::read_to_string(&stamp)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .filter(|v| v["base"] == image.digest.as_str())
        .and_then(|v| Image::from_json(&v["image"]))
        .filter(|i| i.archive.is_file());
    if let Some(next) = cached {
        println!("image: {} (unchanged)", next.reference);
        return Ok((image, next));
    }
    let next = build(DEFAULT_NAME, Some(suffix), profile)?;
    fs::write(
        &stamp,
        json!({"base": image.digest, "image": next.to_json()}).to_string(),
    )
    .with_context(|| format!("writing {}", stamp.display()))?;
    Ok((image, next))
}

/// Removes `prefix` archives of other revisions (one per commit would pile
/// up).
pub(crate) fn prune_other_revisions(dir: &Path, prefix: &str, revision: &str) {
    if revision == "unknown" {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        // `vmpath-` must not take `vmpath-bird-` archives for its own.
        if rest.starts_with(|c: char| c.is_ascii_digit())
            && name.ends_with(".oci.tar")
            && !name.ends_with(&format!("-{revision}.oci.tar"))
        {
            let _ = fs::remove_file(entry.path());
        }
    }
}

pub(crate) fn image_dir() -> Result<PathBuf> {
    Ok(cargo::target_dir()?.join("image"))
}

fn blob_path(digest: &str) -> String {
    format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
}

/// The host's target triple, made explicit: with `--target`, the rustflags
/// below apply to the binaries only, not to build scripts and proc macros
/// (which stay dynamic), and the output has a directory of its own.
fn target_triple() -> String {
    format!("{}-unknown-linux-gnu", std::env::consts::ARCH)
}

fn oci_arch() -> Result<&'static str> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no OCI architecture name for {other}"),
    })
}

/// `cargo build --release` of both binaries, statically linked (glibc's
/// static libc: nothing to load at run time, so the image needs no base).
/// Paths are remapped so the binaries do not carry the build machine's.
fn static_binaries() -> Result<PathBuf> {
    let profile = Profile::Release;
    let triple = target_triple();
    let root = cargo::root()
        .canonicalize()
        .context("locating the workspace")?;
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    let rustflags = [
        "-Ctarget-feature=+crt-static".to_string(),
        "-Cstrip=symbols".to_string(),
        format!("--remap-path-prefix={}=/vmpath", root.display()),
        format!("--remap-path-prefix={}=/cargo", cargo_home.display()),
    ]
    .join("\x1f");
    let mut c = cargo::cargo();
    c.args([
        "build",
        "--profile",
        profile.cargo_name(),
        "--target",
        &triple,
    ]);
    for bin in BINARIES {
        c.args(["-p", bin]);
    }
    // The only flags: none from the caller's environment, so every build
    // of these sources is the same.
    c.env("CARGO_ENCODED_RUSTFLAGS", &rustflags)
        .env_remove("RUSTFLAGS");
    println!("$ {}", cmd::display(&c));
    cmd::run("building the static binaries", &mut c)?;
    let dir = cargo::target_dir()?
        .join(&triple)
        .join(profile.cargo_name());
    for bin in BINARIES {
        let path = dir.join(bin);
        ensure!(
            path.is_file(),
            "building the static binaries: {} missing after the build",
            path.display()
        );
        // A dynamic binary would not start in an image without a libc.
        let elf = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        ensure!(
            !has_interpreter(&elf)?,
            "{} is dynamically linked (it names an ELF interpreter)",
            path.display()
        );
    }
    Ok(dir)
}

/// The test suite's debug build of both binaries (nothing to build when
/// the tests' build made them).
fn debug_binaries() -> Result<PathBuf> {
    let mut c = cargo::cargo();
    c.arg("build");
    for bin in BINARIES {
        c.args(["-p", bin]);
    }
    println!("$ {}", cmd::display(&c));
    cmd::run("building the binaries", &mut c)?;
    let dir = cargo::target_dir()?.join("debug");
    for bin in BINARIES {
        ensure!(
            dir.join(bin).is_file(),
            "building the binaries: {} missing after the build",
            dir.join(bin).display()
        );
    }
    Ok(dir)
}

/// The image's copies of the binaries `built` holds: stripped when they
/// are a debug build (the line tables are most of their size), stamped
/// with `version_suffix` when there is one
/// (`vmpath_common::version_stamp`), in a folder of their own per profile
/// and suffix.
fn staged_binaries(
    built: &Path,
    version_suffix: Option<&str>,
    profile: Profile,
) -> Result<PathBuf> {
    let dir = image_dir()?.join("binaries").join(format!(
        "{}{}",
        profile.cargo_name(),
        version_suffix.unwrap_or("")
    ));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for bin in BINARIES {
        let (from, to) = (built.join(bin), dir.join(bin));
        let _ = fs::remove_file(&to);
        match profile {
            Profile::Release => {
                fs::copy(&from, &to)
                    .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
            }
            Profile::Test => {
                cmd::run(
                    "stripping the binaries",
                    Command::new("strip")
                        .arg("--strip-all")
                        .arg("-o")
                        .arg(&to)
                        .arg(&from),
                )?;
            }
        }
        if let Some(suffix) = version_suffix {
            let mut bytes = fs::read(&to).with_context(|| format!("reading {}", to.display()))?;
            vmpath_common::version_stamp::stamp(&mut bytes, suffix.as_bytes()).map_err(|e| {
                anyhow::anyhow!(
                    "stamping {} with version suffix {suffix:?}: {e:?} \
                     (vmpath_common::version_stamp)",
                    to.display()
                )
            })?;
            fs::write(&to, bytes).with_context(|| format!("writing {}", to.display()))?;
        }
    }
    Ok(dir)
}

/// Whether a 64-bit little-endian ELF file has a PT_INTERP program header,
/// i.e. needs the dynamic loader (a static or static-pie binary has none).
fn has_interpreter(elf: &[u8]) -> Result<bool> {
    const PT_INTERP: u32 = 3;
    ensure!(
        elf.len() >= 64 && elf[..4] == *b"\x7fELF" && elf[4] == 2 && elf[5] == 1,
        "not a 64-bit little-endian ELF file"
    );
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let kind = elf
            .get(at..at + 4)
            .context("ELF program header out of bounds")?;
        if u32::from_le_bytes(kind.try_into()?) == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

/// (version, revision) as `vmpath --version` prints them, checked against
/// `vmpath-cni --version`: the tag is what the binaries say they are.
fn reported_version(bins: &Path) -> Result<(String, String)> {
    let line = |bin: &str| {
        cmd::output(
            "reading the binaries' version",
            Command::new(bins.join(bin)).arg("--version"),
        )
        .map(|s| s.trim().to_string())
    };
    let agent = line("vmpath")?;
    let parse = |text: &str, name: &str| -> Option<(String, String)> {
        let rest = text.strip_prefix(name)?.strip_prefix(' ')?;
        let (version, revision) = rest.split_once(" (revision ")?;
        Some((version.to_string(), revision.strip_suffix(')')?.to_string()))
    };
    let ours =
        parse(&agent, "vmpath").with_context(|| format!("`vmpath --version` printed {agent:?}"))?;
    let cni = line("vmpath-cni")?;
    ensure!(
        parse(&cni, "vmpath-cni").as_ref() == Some(&ours),
        "`vmpath-cni --version` ({cni:?}) disagrees with `vmpath --version` ({agent:?})"
    );
    Ok(ours)
}

/// SOURCE_DATE_EPOCH when set, else the time of the commit built, else 0.
pub(crate) fn source_date_epoch() -> Result<u64> {
    if let Ok(v) = std::env::var("SOURCE_DATE_EPOCH") {
        return v
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={v:?} is not a number of seconds"));
    }
    let commit = cmd::probe(Command::new("git").current_dir(cargo::root()).args([
        "log",
        "-1",
        "--format=%ct",
    ]));
    Ok(commit.and_then(|t| t.trim().parse().ok()).unwrap_or(0))
}

fn rfc3339(epoch: u64) -> Result<String> {
    Ok(cmd::output(
        "formatting the image's creation time",
        Command::new("date").args(["-u", "-d", &format!("@{epoch}"), "+%Y-%m-%dT%H:%M:%SZ"]),
    )?
    .trim()
    .to_string())
}

/// `sha256:<hex>` of `data` (coreutils' sha256sum).
fn sha256(data: &[u8]) -> Result<String> {
    let step = "hashing an image blob";
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("{step}: starting sha256sum"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(data)
        .context(step)?;
    let out = child.wait_with_output().context(step)?;
    ensure!(out.status.success(), "{step}: sha256sum failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = text.split_whitespace().next().unwrap_or_default();
    ensure!(hex.len() == 64, "{step}: sha256sum printed {text:?}");
    Ok(format!("sha256:{hex}"))
}

/// A ustar archive in memory: entries in the order given, numeric owner 0,
/// one timestamp; nothing of the build machine (user names, atimes).
#[derive(Default)]
pub(crate) struct Tar {
    data: Vec<u8>,
}

impl Tar {
    pub(crate) fn dir(&mut self, name: &str, mode: u32, mtime: u64) {
        self.entry(name, mode, mtime, b'5', &[]);
    }

    pub(crate) fn file(&mut self, name: &str, mode: u32, mtime: u64, data: &[u8]) {
        self.entry(name, mode, mtime, b'0', data);
    }

    fn entry(&mut self, name: &str, mode: u32, mtime: u64, kind: u8, data: &[u8]) {
        assert!(name.len() < 100, "tar entry name {name} too long");
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        octal(&mut h[100..108], mode as u64);
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], data.len() as u64);
        octal(&mut h[136..148], mtime);
        h[156] = kind;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        // The checksum is computed with its own field as spaces.
        h[148..156].fill(b' ');
        let sum: u64 = h.iter().map(|&b| b as u64).sum();
        octal(&mut h[148..155], sum);
        self.data.extend_from_slice(&h);
        self.data.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        let rem = self.data.len() % 512;
        if rem != 0 {
            self.data.resize(self.data.len() + 512 - rem, 0);
        }
    }

    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.data.resize(self.data.len() + 1024, 0);
        self.data
    }
}

/// Zero-padded octal, NUL-terminated, filling `field`.
fn octal(field: &mut [u8], value: u64) {
    let width = field.len() - 1;
    let text = format!("{value:0width$o}");
    assert!(text.len() == width, "{value} does not fit a tar field");
    field[..width].copy_from_slice(text.as_bytes());
    field[width] = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GNU tar reads the archive back: names, modes, owner, time, content.
    #[test]
    fn tar_is_read_back_by_gnu_tar() {
        let mut t = Tar::default();
        t.dir("usr/", 0o755, 1_700_000_000);
        t.file("usr/hello", 0o644, 1_700_000_000, b"hello\n");
        let dir = std::env::temp_dir().join(format!("xtask-tar-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.tar");
        fs::write(&path, t.finish()).unwrap();
        let list = cmd::output(
            "tar",
            Command::new("tar")
                .args(["--numeric-owner", "--utc", "-tvf"])
                .arg(&path),
        )
        .unwrap();
        let _ = fs::remove_dir_all(&dir);
        let lines: Vec<&str> = list.lines().collect();
        assert_eq!(lines.len(), 2, "{list}");
        assert!(lines[0].starts_with("drwxr-xr-x 0/0"), "{list}");
        assert!(lines[1].starts_with("-rw-r--r-- 0/0"), "{list}");
        assert!(lines[1].contains(" 6 2023-11-14") && lines[1].ends_with("usr/hello"));
    }

    /// The check that keeps a dynamic binary out of the image: this test
    /// binary (dynamic) has an interpreter.
    #[test]
    fn a_dynamic_binary_is_recognised() {
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(has_interpreter(&me).unwrap());
        assert!(has_interpreter(b"not an elf").is_err());
    }

    #[test]
    fn sha256_matches_the_known_digest() {
        assert_eq!(
            sha256(b"abc").unwrap(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
