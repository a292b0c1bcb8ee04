//! The bounds every config file and object is read under
//! (docs/parser-limits.md): the parsers of vmpath documents and of
//! Kubernetes objects share them.

/// Bytes per file, checked before reading.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// Nesting of mappings and sequences (a valid document needs 5).
pub const MAX_DEPTH: usize = 32;
/// Alias (`*name`) uses per file; configs have no need for many.
pub const MAX_ALIASES: usize = 64;
/// Anchors (`&name`) per file.
pub const MAX_ANCHORS: usize = 64;
/// Events replayed by alias expansion per file (the alias-bomb bound).
pub const MAX_ALIAS_REPLAY: usize = 10_000;
/// Documents per file.
pub const MAX_DOCUMENTS: usize = 5_000;
/// Scalars, mappings and sequences per file.
pub const MAX_NODES: usize = 100_000;
/// Entries in a list field that makes no sense beyond a few (subnets,
/// gateway addresses, an interface's addresses, DNS servers...).
pub const MAX_SHORT_LIST: usize = 16;
/// Entries in `excludeSubnets` and `dhcp.routes`.
pub const MAX_LONG_LIST: usize = 256;
/// Entries in `metadata.labels` / `metadata.annotations`.
pub const MAX_LABELS: usize = 256;
