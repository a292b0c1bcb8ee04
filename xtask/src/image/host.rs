//! Files from the build machine's Debian packages, for an image with no
//! base: a binary with the shared libraries it loads (its `ldd` closure,
//! dynamic loader included) and the Debian copyright file of every package
//! those files come from. Used by the BIRD image (`bird`) and vmpath's own
//! (`nft` for the pod network's hand-off).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail, ensure};

use super::Tar;
use crate::cmd;

/// Image path -> (mode, host file whose content it gets).
pub type Files = BTreeMap<String, (u32, PathBuf)>;

/// `binaries`, the libraries they load, and the copyright file of every
/// package any of them comes from (the licenses go where the files go).
pub fn binaries_with_libraries(binaries: &[&Path]) -> Result<Files> {
    let mut files = Files::new();
    for path in binaries {
        files.insert(relative(path), (0o755, path.to_path_buf()));
    }
    with_licenses(files, binaries)
}

/// The libraries `binaries` load and their packages' copyright files, not
/// the binaries themselves (ours, which no Debian package owns).
pub fn libraries_of(binaries: &[&Path]) -> Result<Files> {
    with_licenses(Files::new(), binaries)
}

/// `files` with the libraries `binaries` load, and the copyright file of
/// every package any of `files` comes from.
fn with_licenses(mut files: Files, binaries: &[&Path]) -> Result<Files> {
    for path in binaries {
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
    Ok(files)
}

/// One layer of `dirs` (path with a trailing `/` -> mode) and `files`,
/// every parent directory with an entry of its own, sorted by path,
/// stamped `epoch`.
pub fn layer(mut dirs: BTreeMap<String, u32>, files: Files, epoch: u64) -> Result<Vec<u8>> {
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
    let mut tar = Tar::default();
    for (at, entry) in entries {
        match entry {
            Entry::Dir(mode) => tar.dir(&at, mode, epoch),
            Entry::File(mode, from) => {
                let data =
                    fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
                tar.file(&at, mode, epoch, &data);
            }
        }
    }
    Ok(tar.finish())
}

/// A layer entry: a directory (mode) or a file (mode, host file whose
/// content it gets).
enum Entry {
    Dir(u32),
    File(u32, PathBuf),
}

/// `/usr/sbin/bird` -> `usr/sbin/bird`.
pub fn relative(path: &Path) -> String {
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
