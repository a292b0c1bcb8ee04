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

use std::{collections::BTreeMap, path::Path, process::Command};

use anyhow::{Context as _, Result, ensure};
use serde_json::json;

use super::{Assembly, Image, host};
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

    let paths: Vec<&Path> = BINARIES.iter().map(Path::new).collect();
    for path in &paths {
        ensure!(
            path.is_file(),
            "{} missing: the {PACKAGE} package provides it (cargo xtask setup)",
            path.display()
        );
    }
    let files = host::binaries_with_libraries(&paths)?;
    // Mount points for the config (read-only ConfigMap) and the control
    // socket (shared volume).
    let dirs = BTreeMap::from([
        ("etc/bird/".to_string(), 0o755),
        ("run/bird/".to_string(), 0o755),
        ("tmp/".to_string(), 0o1777),
    ]);
    let layer = host::layer(dirs, files, epoch)?;

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
        layer,
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

#[cfg(test)]
mod tests {
    use std::{fs, path::PathBuf};

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
