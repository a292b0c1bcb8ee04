//! The BIRD sidecar's image, built by `cargo xtask image` next to vmpath's
//! and assembled the same way: one layer, no base image, no registry.
//!
//! BIRD comes from the build machine's Debian `bird2` package (which
//! `cargo xtask setup` installs): `bird`, `birdc` and `birdcl`, the shared
//! libraries they load (their `ldd` closure, dynamic loader included) and
//! the Debian copyright file of every package those files come from (BIRD
//! is GPL). No shell, no package manager. Entries are sorted, owned by root
//! and stamped with vmpath's image time, so the same packages and commit
//! give the same digest. The tag is vmpath's (`<version>-<revision>`), so
//! deploy/ names both images with one tag.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::json;

use super::{Assembly, Image, Tar};
use crate::{cmd, image};

/// The repository part of the BIRD image's reference.
pub const DEFAULT_NAME: &str = "localhost/vmpath-bird";
/// The Debian package BIRD comes from.
const PACKAGE: &str = "bird2";
/// The daemon and both clients (`birdc` for the DaemonSet's probe and
/// operators, `birdcl` without readline), where Debian installs them.
const BINARIES: [&str; 3] = ["/usr/sbin/bird", "/usr/sbin/birdc", "/usr/sbin/birdcl"];
/// The image's PATH.
const PATH: &str = "/usr/sbin";
/// What the image runs by default: what deploy/daemonset.yaml runs.
const CMD: [&str; 6] = [
    "bird",
    "-f",
    "-c",
    "/etc/bird/bird.conf",
    "-s",
    "/run/bird/bird.ctl",
];

/// Builds the BIRD image tagged like `vmpath` (the image built from the
/// same commit), into vmpath's image directory.
pub fn build(vmpath: &Image) -> Result<Image> {
    let tag = vmpath
        .reference
        .rsplit_once(':')
        .map(|(_, t)| t)
        .context("the vmpath image's reference has no tag")?;
    let dir = image::image_dir()?;
    let image = assemble(
        DEFAULT_NAME,
        tag,
        &vmpath.version,
        &vmpath.revision,
        image::source_date_epoch()?,
        &dir,
    )?;
    image::prune_other_revisions(&dir, "vmpath-bird-", &vmpath.revision);
    Ok(image)
}

/// The image of the installed BIRD, written to `dir`.
pub fn assemble(
    name: &str,
    tag: &str,
    version: &str,
    revision: &str,
    epoch: u64,
    dir: &Path,
) -> Result<Image> {
    let bird_version = cmd::output(
        "reading the bird2 package's version",
        Command::new("dpkg-query").args(["-W", "-f", "${Version}", PACKAGE]),
    )
    .with_context(|| format!("is {PACKAGE} installed? (cargo xtask setup installs it)"))?;

    // Image path -> (mode, host file whose content it gets).
    let mut files: BTreeMap<String, (u32, PathBuf)> = BTreeMap::new();
    for bin in BINARIES {
        let path = Path::new(bin);
        ensure!(
            path.is_file(),
            "{bin} missing: the {PACKAGE} package provides it (cargo xtask setup)"
        );
        files.insert(relative(path), (0o755, path.to_path_buf()));
        for (at, from) in shared_libraries(path)? {
            files.insert(at, (0o755, from));
        }
    }
    let packages = owning_packages(files.values().map(|(_, from)| from.as_path()))?;
    for p in &packages {
        let copyright = PathBuf::from(format!("/usr/share/doc/{p}/copyright"));
        ensure!(
            copyright.is_file(),
            "{} missing: the image must carry the license of {p}, whose files it ships",
            copyright.display()
        );
        files.insert(relative(&copyright), (0o644, copyright));
    }

    // Every parent directory gets an entry of its own; mount points for the
    // config (read-only ConfigMap) and the control socket (shared volume).
    let mut dirs: BTreeMap<String, u32> = BTreeMap::new();
    for d in ["etc/bird/", "run/bird/"] {
        dirs.insert(d.to_string(), 0o755);
    }
    dirs.insert("tmp/".to_string(), 0o1777);
    for at in files
        .keys()
        .cloned()
        .chain(dirs.keys().cloned().collect::<Vec<_>>())
    {
        let mut parent = Path::new(at.trim_end_matches('/')).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            dirs.entry(format!("{}/", p.display())).or_insert(0o755);
            parent = p.parent();
        }
    }
    // One map, so the entries come out sorted by path.
    let mut entries: BTreeMap<String, Entry> = dirs
        .into_iter()
        .map(|(d, mode)| (d, Entry::Dir(mode)))
        .collect();
    entries.extend(
        files
            .into_iter()
            .map(|(f, (mode, from))| (f, Entry::File(mode, from))),
    );
    let mut layer = Tar::default();
    for (at, entry) in entries {
        match entry {
            Entry::Dir(mode) => layer.dir(&at, mode, epoch),
            Entry::File(mode, from) => {
                let data =
                    fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
                layer.file(&at, mode, epoch, &data);
            }
        }
    }

    let labels = json!({
        "org.opencontainers.image.title": "vmpath-bird",
        "org.opencontainers.image.description":
            "BIRD 2 (Debian bird2), the vmpath DaemonSet's route export sidecar",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.licenses": "GPL-2.0-or-later",
        "dev.vmpath.bird.package": format!("{PACKAGE} {}", bird_version.trim()),
    });
    let written = image::write_archive(&Assembly {
        dir: dir.to_path_buf(),
        file_prefix: "vmpath-bird-",
        reference: format!("{name}:{tag}"),
        tag,
        epoch,
        layer: layer.finish(),
        labels,
        env: vec![format!("PATH={PATH}")],
        cmd: CMD.iter().map(|s| s.to_string()).collect(),
    })?;
    Ok(Image {
        archive: written.archive,
        reference: written.reference,
        version: version.to_string(),
        revision: revision.to_string(),
        digest: written.digest,
        layer_size: written.layer_size,
    })
}

/// A layer entry: a directory (mode) or a file (mode, host file whose
/// content it gets).
enum Entry {
    Dir(u32),
    File(u32, PathBuf),
}

/// `/usr/sbin/bird` -> `usr/sbin/bird`.
fn relative(path: &Path) -> String {
    path.display()
        .to_string()
        .trim_start_matches('/')
        .to_string()
}

/// The libraries `binary` loads, as `ldd` resolves them: (path in the
/// image, host file). A library goes where its directory really is (Debian
/// merged /lib into /usr/lib, a directory the loader searches) under the
/// name the binary asks for; the loader goes exactly where the binary's
/// ELF interpreter field points.
fn shared_libraries(binary: &Path) -> Result<Vec<(String, PathBuf)>> {
    let step = format!("listing the libraries of {}", binary.display());
    let out = cmd::output(&step, Command::new("ldd").arg(binary))?;
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim) {
        let line = line.split(" (0x").next().unwrap_or_default();
        if let Some((needed, path)) = line.split_once(" => ") {
            ensure!(
                path.starts_with('/'),
                "{step}: {needed} not found ({line:?})"
            );
            let path = Path::new(path);
            let dir = path
                .parent()
                .context("a library path without a directory")?
                .canonicalize()
                .with_context(|| format!("{step}: resolving {}", path.display()))?;
            libs.push((relative(&dir.join(needed)), path.to_path_buf()));
        } else if line.starts_with('/') {
            libs.push((relative(Path::new(line)), PathBuf::from(line)));
        } else if !line.starts_with("linux-vdso") && !line.is_empty() {
            bail!("{step}: unexpected ldd line {line:?}");
        }
    }
    Ok(libs)
}

/// The Debian package that installed each of `paths`, in one dpkg query
/// (dpkg knows some files by their /usr-merged path, some by the other).
fn owning_packages<'a>(paths: impl Iterator<Item = &'a Path>) -> Result<BTreeSet<String>> {
    let mut wanted: Vec<(String, Vec<String>)> = Vec::new();
    for path in paths {
        let shown = path.display().to_string();
        let real = path
            .canonicalize()
            .with_context(|| format!("resolving {shown}"))?
            .display()
            .to_string();
        let mut candidates = vec![shown.clone(), real.clone()];
        for p in [&shown, &real] {
            match p.strip_prefix("/usr") {
                Some(rest) => candidates.push(rest.to_string()),
                None => candidates.push(format!("/usr{p}")),
            }
        }
        wanted.push((shown, candidates));
    }
    // Exits 1 when any candidate is unknown: what matters is what it found.
    let out = Command::new("dpkg-query")
        .arg("-S")
        .args(wanted.iter().flat_map(|(_, c)| c))
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .context("running dpkg-query -S")?;
    // `pkg[:arch][, pkg2...]: path`
    let owners: BTreeMap<&str, &str> = std::str::from_utf8(&out.stdout)
        .context("dpkg-query -S output")?
        .lines()
        .filter_map(|l| {
            let (pkgs, path) = l.split_once(": ")?;
            let pkg = pkgs.split([',', ':']).next()?.trim();
            Some((path.trim(), pkg))
        })
        .collect();
    let mut packages = BTreeSet::new();
    for (shown, candidates) in &wanted {
        let pkg = candidates
            .iter()
            .find_map(|c| owners.get(c.as_str()))
            .with_context(|| {
                format!("{shown}: no Debian package owns it (tried {candidates:?})")
            })?;
        packages.insert(pkg.to_string());
    }
    Ok(packages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-bird-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// The same packages and time give the same digest, byte for byte the
    /// same archive; another time gives another digest (the check can
    /// fail). Needs the bird2 package (`cargo xtask setup`).
    #[test]
    fn the_bird_image_is_reproducible() {
        let (a, b) = (scratch("a"), scratch("b"));
        let build = |dir: &Path, epoch| assemble(DEFAULT_NAME, "0.0.0-t", "0.0.0", "t", epoch, dir);
        let first = build(&a, 1_700_000_000).unwrap();
        let second = build(&b, 1_700_000_000).unwrap();
        let same_bytes = fs::read(&first.archive).unwrap() == fs::read(&second.archive).unwrap();
        let other = build(&b, 1_700_000_001).unwrap();
        let _ = fs::remove_dir_all(&a);
        let _ = fs::remove_dir_all(&b);
        assert_eq!(first.digest, second.digest);
        assert!(same_bytes, "same digest, different archives");
        assert_ne!(first.digest, other.digest);
        assert_eq!(first.reference, "localhost/vmpath-bird:0.0.0-t");
    }

    /// The layer holds BIRD, its clients, the loader, libc and the
    /// licenses, sorted, and no shell.
    #[test]
    fn the_bird_image_holds_bird_and_its_libraries_only() {
        let dir = scratch("list");
        let image = assemble(DEFAULT_NAME, "0.0.0-t", "0.0.0", "t", 0, &dir).unwrap();
        let archive = fs::read(&image.archive).unwrap();
        let _ = fs::remove_dir_all(&dir);
        let blob = |digest: &str| -> Vec<u8> {
            let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
            tar_entries(&archive)
                .into_iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{name} not in the archive"))
                .1
                .to_vec()
        };
        let manifest: serde_json::Value = serde_json::from_slice(&blob(&image.digest)).unwrap();
        let layer = blob(manifest["layers"][0]["digest"].as_str().unwrap());
        let names: Vec<String> = tar_entries(&layer).into_iter().map(|(n, _)| n).collect();
        for want in [
            "usr/sbin/bird",
            "usr/sbin/birdc",
            "usr/sbin/birdcl",
            "lib64/ld-linux-x86-64.so.2",
            "usr/lib/x86_64-linux-gnu/libc.so.6",
            "usr/share/doc/bird2/copyright",
            "usr/share/doc/libc6/copyright",
            "etc/bird/",
            "run/bird/",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
        }
        assert!(
            !names
                .iter()
                .any(|n| n.ends_with("/sh") || n.ends_with("/bash") || n.ends_with("/dash")),
            "{names:?}"
        );
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "entries not sorted");
    }

    /// (name, content) of every entry of a ustar archive.
    fn tar_entries(data: &[u8]) -> Vec<(String, &[u8])> {
        let mut entries = Vec::new();
        let mut at = 0;
        while at + 512 <= data.len() && data[at] != 0 {
            let h = &data[at..at + 512];
            let name = String::from_utf8_lossy(&h[..100])
                .trim_end_matches('\0')
                .to_string();
            let size = usize::from_str_radix(
                String::from_utf8_lossy(&h[124..135]).trim_matches(['\0', ' ']),
                8,
            )
            .unwrap();
            entries.push((name, &data[at + 512..at + 512 + size]));
            at += 512 + size.div_ceil(512) * 512;
        }
        entries
    }
}
