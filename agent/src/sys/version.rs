//! What this build is: its version and the git revision it was built from,
//! as `vmpath --version`, `vmpath status` and the node lock report them.

use std::sync::OnceLock;

/// The git revision of the sources (agent/build.rs): 12 hex digits, or
/// `unknown` for sources without git metadata (a tarball).
pub const REVISION: &str = env!("VMPATH_GIT_REVISION");

static VERSION: OnceLock<String> = OnceLock::new();

/// Records the version the binary was built as: the crate version plus the
/// suffix a special build adds (`VMPATH_VERSION_SUFFIX`). The binary reads
/// the suffix, not this library, so a suffixed build recompiles `main.rs`
/// alone. First call wins; call before anything reports the build.
pub fn init(version: &str) {
    let _ = VERSION.set(version.to_string());
}

/// The version: what [`init`] recorded, else the crate version.
pub fn version() -> &'static str {
    VERSION
        .get()
        .map(String::as_str)
        .unwrap_or(env!("CARGO_PKG_VERSION"))
}

/// `0.1.0 (revision 0123456789ab)`: what `--version` prints after the name.
pub fn long() -> String {
    format!("{} (revision {REVISION})", version())
}
