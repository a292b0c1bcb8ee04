//! The state dir is root's alone: `status.json` and `cni-endpoints.json`
//! name every VM, namespace, MAC and address, `claims.redb` holds every
//! claim. The dir is 0700 and its files owner-only (0600), whatever an older agent
//! (which wrote them 0755/0644) left.

use std::{fs, os::unix::fs::PermissionsExt as _, path::Path};

use anyhow::{Context as _, Result};
use tracing::info;

/// The state dir's mode.
pub const DIR_MODE: u32 = 0o700;

/// Everything the agent creates from here on (state files, their
/// temporary copies, redb's database) is root's alone: umask 077.
/// Process-wide, so called before any thread starts.
pub fn restrict_new_files() {
    // SAFETY: umask touches no memory; no other thread runs yet.
    unsafe {
        libc::umask(0o077);
    }
}

/// Creates `dir` if needed and tightens it and every file in it (an
/// older agent's): the dir and its subdirs to [`DIR_MODE`], files to their
/// owner's bits alone (0644 becomes 0600). Symlinks are left
/// alone (a chmod would follow them out of the dir).
pub fn tighten(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating the state dir {}", dir.display()))?;
    let mut changed = 0;
    changed += set_mode(dir, DIR_MODE)?;
    let entries =
        fs::read_dir(dir).with_context(|| format!("reading the state dir {}", dir.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("reading the state dir {}", dir.display()))?;
        let path = entry.path();
        let kind = entry
            .file_type()
            .with_context(|| format!("checking {}", path.display()))?;
        if kind.is_symlink() {
            continue;
        }
        // A file keeps its owner's bits (an executable stays one: 0755
        // becomes 0700); nobody else gets any.
        let mode = if kind.is_dir() {
            DIR_MODE
        } else {
            current_mode(&path)? & FILE_MODE_MASK
        };
        changed += set_mode(&path, mode)?;
    }
    if changed > 0 {
        info!(dir = %dir.display(), changed, "state dir made root-only (0700, files owner-only)");
    }
    Ok(())
}

/// What [`tighten`] keeps of a file's mode: its owner's bits.
const FILE_MODE_MASK: u32 = 0o700;

fn current_mode(path: &Path) -> Result<u32> {
    let meta =
        fs::symlink_metadata(path).with_context(|| format!("checking {}", path.display()))?;
    Ok(meta.permissions().mode() & 0o7777)
}

/// Sets `path`'s permission bits to `mode`; 1 when they were different.
fn set_mode(path: &Path, mode: u32) -> Result<usize> {
    let meta =
        fs::symlink_metadata(path).with_context(|| format!("checking {}", path.display()))?;
    if meta.permissions().mode() & 0o7777 == mode {
        return Ok(0);
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))?;
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_agents_dir_and_files_are_tightened_and_symlinks_left() {
        let dir = std::env::temp_dir().join(format!("vmpath-state-dir-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("status.json"), "{}").unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(dir.join("status.json"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::write(dir.join("hook.sh"), "").unwrap();
        fs::set_permissions(dir.join("hook.sh"), fs::Permissions::from_mode(0o755)).unwrap();
        let outside = dir.with_extension("outside");
        fs::write(&outside, "").unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();

        tighten(&dir).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("status.json")), 0o600);
        assert_eq!(mode(&dir.join("hook.sh")), 0o700, "an executable stays one");
        assert_eq!(mode(&dir.join("sub")), 0o700);
        assert_eq!(
            mode(&outside),
            0o644,
            "a symlink's target is not the agent's"
        );
        fs::remove_dir_all(&dir).unwrap();
        fs::remove_file(&outside).unwrap();
    }
}
