#[path = "../agent/build/git_revision.rs"]
mod git_revision;

/// The git revision for `vmpath-cni --version`.
fn main() {
    git_revision::emit(env!("CARGO_MANIFEST_DIR"));
}
