//! What this build is: its version and the git revision it was built from,
//! as `vmpath --version`, `vmpath status` and the node lock report them.

use std::sync::OnceLock;

/// The git revision of the sources (agent/build.rs): 12 hex digits, or
/// `unknown` for sources without git metadata (a tarball).
pub const REVISION: &str = env!("VMPATH_GIT_REVISION");

static VERSION: OnceLock<String> = OnceLock::new();

/// Records the version the binary reports: the crate version plus the
/// suffix a special build was stamped with (`vmpath_common::version_stamp`,
/// read by the binary). First call wins; call before anything reports the
/// build.
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
