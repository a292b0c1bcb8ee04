//! The git revision a build comes from, for `--version` (used by the build
//! scripts of `vmpath` and `vmpath-cni`).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The variable a packager sets when the sources carry no git metadata but
/// the revision is known (e.g. a release tarball).
const OVERRIDE: &str = "VMPATH_GIT_REVISION";

/// Sets `VMPATH_GIT_REVISION` for the crate at `manifest_dir`: the override
/// when given, else HEAD of the workspace's own checkout (12 hex digits),
/// else `unknown` (a tarball without `.git`). Cargo asks again when HEAD
/// moves or the override changes.
pub fn emit(manifest_dir: &str) {
    println!("cargo:rerun-if-env-changed={OVERRIDE}");
    let revision = std::env::var(OVERRIDE)
        .ok()
        .filter(|r| !r.trim().is_empty())
        .map(|r| r.trim().to_string())
        .or_else(|| from_git(Path::new(manifest_dir)))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env={OVERRIDE}={revision}");
}

fn from_git(manifest_dir: &Path) -> Option<String> {
    let workspace = manifest_dir.parent()?.canonicalize().ok()?;
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(&workspace)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    // Only the workspace's own checkout: sources unpacked inside some other
    // repository have no revision of their own.
    let top = PathBuf::from(git(&["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != workspace {
        return None;
    }
    let revision = git(&["rev-parse", "--short=12", "HEAD"])?;
    // HEAD changes on checkout (and on commit when detached); the branch's
    // ref on commit, loose or packed. Only existing files: cargo reruns on
    // every build for a path that does not exist.
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for name in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &name]) {
            let path = workspace.join(path);
            if path.is_file() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    Some(revision)
}
