//! Reads the config dir: every `*.yaml`/`*.yml` file, each holding one or
//! more documents. Follows Kubernetes ConfigMap mounts, whose files are
//! symlinks through `..data` that the kubelet swaps atomically.
//!
//! Every file is read under hard limits ([`limits`]): its size is checked
//! before a byte is read, and the parser (serde-saphyr) stops at the first
//! breach of its budget (nesting, aliases, nodes, documents), so a hostile
//! file costs bounded work and is refused whole with a message naming the
//! limit. A [`Reader`] keeps each file's outcome until the file changes
//! (device, inode, size, mtime, ctime), so a refused file is parsed, and
//! reported, once.

use std::{
    fs,
    io::Read as _,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use super::ConfigError;
use crate::sys::hash::HashMap;
use vmpath_api::types::ObjectRef;

pub use crate::sys::limits;

/// Where a document came from, as the reader or stage that made it knows
/// it. Never taken from the document's own text: a file cannot pass for a
/// CNI port or say it was derived from another namespace's VM (whose
/// Events its refusals would then be posted on).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DocOrigin {
    /// A config file, or a vmpath object the API server holds.
    #[default]
    Given,
    /// A port vmpath-cni handed over (its file reads
    /// `cni:<container>/<interface>`, for messages only).
    CniPort,
    /// Made by translation from Kubernetes objects: the VMI first where
    /// there is one, then the pod (shared by every copy: the derived
    /// document, its membership entry, its Attachment's source).
    Derived(Sources),
    /// Made from a Kubernetes object read as it is (a v1 Node's address).
    /// Boxed: the origin is in every Attachment's source, and this
    /// variant would make each three times its size.
    Object(Box<ObjectRef>),
}

/// The objects a derived document came from, in order: one word (their
/// count lives in the shared copy), so an Attachment's source fits its
/// allocator class.
pub type Sources = crate::sys::thin_slice::ThinSlice<SourceObject>;

/// A Kubernetes object a derived document came from, as every VM
/// interface's Attachment keeps it: its names shared, its kind one of
/// the kinds translation reads (an `ObjectRef` was three copies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceObject {
    pub kind: &'static str,
    pub namespace: crate::sys::intern::Name,
    pub name: crate::sys::intern::Name,
}

impl SourceObject {
    /// As the API and Events name it.
    pub fn to_ref(&self) -> ObjectRef {
        ObjectRef {
            kind: self.kind.to_string(),
            namespace: self.namespace.to_string(),
            name: self.name.to_string(),
        }
    }
}

impl std::fmt::Display for SourceObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        vmpath_api::types::write_object(f, self.kind, &self.namespace, &self.name)
    }
}

impl DocOrigin {
    /// The Kubernetes object a refusal of this document is about (where
    /// its Event goes).
    pub fn about(&self) -> Option<Box<ObjectRef>> {
        match self {
            DocOrigin::Derived(from) => from.first().map(|o| Box::new(o.to_ref())),
            DocOrigin::Object(o) => Some(o.clone()),
            DocOrigin::Given | DocOrigin::CniPort => None,
        }
    }

    /// A VM interface translation made from a VMI.
    pub fn is_from_vmi(&self) -> bool {
        matches!(self, DocOrigin::Derived(from)
            if from.first().is_some_and(|o| o.kind == "VirtualMachineInstance"))
    }

    /// `derived from VirtualMachineInstance prod/vm1 and Pod prod/...`,
    /// for a derived document's label.
    pub fn derived_from(&self) -> Option<String> {
        let DocOrigin::Derived(from) = self else {
            return None;
        };
        let names: Vec<String> = from.iter().map(ToString::to_string).collect();
        Some(format!("derived from {}", names.join(" and ")))
    }
}

/// The file a document came from, shared by every document of it: one
/// word (the path behind a second pointer, one per file), as every object
/// of the cluster and every Attachment carries its file.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceFile(std::sync::Arc<std::path::PathBuf>);

impl SourceFile {
    pub fn new(path: impl Into<std::path::PathBuf>) -> SourceFile {
        SourceFile(std::sync::Arc::new(path.into()))
    }
}

impl std::ops::Deref for SourceFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for SourceFile {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl std::borrow::Borrow<Path> for SourceFile {
    fn borrow(&self) -> &Path {
        &self.0
    }
}

impl std::fmt::Debug for SourceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self.0, f)
    }
}

impl From<&Path> for SourceFile {
    fn from(path: &Path) -> Self {
        SourceFile::new(path)
    }
}

impl From<std::path::PathBuf> for SourceFile {
    fn from(path: std::path::PathBuf) -> Self {
        SourceFile::new(path)
    }
}

impl serde::Serialize for SourceFile {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl From<&str> for SourceFile {
    fn from(path: &str) -> Self {
        SourceFile::new(path)
    }
}

/// One YAML document with where it came from.
#[derive(Debug, Clone)]
pub struct RawDocument {
    /// Shared with every document of the file (and its Attachments' sources).
    pub file: SourceFile,
    /// 1-based position of the document in its file (empty documents are
    /// not counted).
    pub index: usize,
    /// Who made the document (a file, a CNI port, translation).
    pub origin: DocOrigin,
    /// Shared: the reader's cache, every snapshot and the translated
    /// documents hold the same value (a cluster's worth of objects is
    /// large), so copies of a snapshot are cheap.
    pub value: std::sync::Arc<serde_json::Value>,
}

/// A Kubernetes object of a kind vmpath reads typed (Pod, VMI, ...), as
/// its source keeps it ([`crate::config::kube_objects::prune`]), with where it came
/// from.
#[derive(Debug, Clone)]
pub struct ClusterDocument {
    /// Shared by the objects of one file or kind (a round's snapshot
    /// holds one per object: a copy each was tens of thousands of
    /// allocations a round).
    pub file: SourceFile,
    /// As in [`RawDocument`] (a `v1 List`'s items share its index). A
    /// `u32`: with it the object's entry is three words.
    pub index: u32,
    /// Shared with the source's copy.
    pub object: std::sync::Arc<crate::config::kube_objects::prune::ClusterObject>,
}

/// A document's position as a [`ClusterDocument`] keeps it (a file has
/// far fewer documents than `u32` counts).
pub fn doc_index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

// One per object of the cluster, in the snapshot's parts.
const _: () = assert!(std::mem::size_of::<ClusterDocument>() <= 24);

// In every Attachment's source.
const _: () = assert!(std::mem::size_of::<DocOrigin>() <= 16);

/// A list made of shared parts, in order: a round's snapshot takes each
/// kind's objects (each file's) as its source keeps them, one `Arc` each,
/// not a copy of every object of the cluster (at 10,000 VMs, 20,000 pairs
/// of reference counts taken and dropped a round).
#[derive(Debug, Clone)]
pub struct Chunked<T> {
    parts: Vec<std::sync::Arc<[T]>>,
    /// Where each part starts (a source may give hundreds of parts a
    /// kind: `get` searches these).
    starts: Vec<usize>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Chunked {
            parts: Vec::new(),
            starts: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    /// Appends `part`, shared.
    pub fn push_part(&mut self, part: std::sync::Arc<[T]>) {
        if !part.is_empty() {
            self.starts.push(self.len);
            self.len += part.len();
            self.parts.push(part);
        }
    }

    /// Appends one item (a part of its own).
    pub fn push(&mut self, item: T) {
        self.push_part(std::sync::Arc::from(vec![item]));
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> + Clone {
        self.parts.iter().flat_map(|p| p.iter())
    }

    /// The parts, each with where it starts.
    pub fn parts(&self) -> impl Iterator<Item = (usize, &std::sync::Arc<[T]>)> {
        self.starts.iter().copied().zip(&self.parts)
    }

    /// The item at `i`.
    pub fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        let part = self.starts.partition_point(|&s| s <= i) - 1;
        self.parts[part].get(i - self.starts[part])
    }
}

impl<T> std::ops::Index<usize> for Chunked<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        self.get(i).expect("index within the list")
    }
}

impl<T> FromIterator<T> for Chunked<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut out = Chunked::default();
        out.push_part(iter.into_iter().collect::<Vec<T>>().into());
        out
    }
}

impl<T> Extend<T> for Chunked<T> {
    /// The items as one part of their own.
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        self.push_part(iter.into_iter().collect::<Vec<T>>().into());
    }
}

impl<'a, T> IntoIterator for &'a Chunked<T> {
    type Item = &'a T;
    type IntoIter = std::iter::FlatMap<
        std::slice::Iter<'a, std::sync::Arc<[T]>>,
        std::slice::Iter<'a, T>,
        fn(&'a std::sync::Arc<[T]>) -> std::slice::Iter<'a, T>,
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.parts.iter().flat_map(|p| p.iter())
    }
}

/// What the config dir holds right now.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub documents: Vec<RawDocument>,
    /// The cluster kinds read typed; translation derives Attachments and
    /// Nodes from them. Shared with the source's lists.
    pub cluster: Chunked<ClusterDocument>,
    /// Files that are not YAML at all or break a limit: refused whole.
    pub errors: Vec<ConfigError>,
    /// The dir is missing or has no config file: never a reason to wipe.
    pub empty: bool,
    /// A fingerprint of everything read, to notice changes cheaply.
    pub fingerprint: u64,
    /// Plain pods' addresses on IPAM networks come from the IPAMClaims
    /// `vmpath controller` makes for them (the Kubernetes source); else
    /// the agent allocates them.
    pub pod_claims: bool,
    /// `vmpath controller`'s ledger (the Kubernetes source): an
    /// IPAMClaim's `status.ips` on an IPAM network counts only where it
    /// vouches for them. `None` (config files): a claim's file is trusted.
    pub ledger: Option<std::sync::Arc<crate::config::kube_objects::ledger::Shards>>,
    /// The cluster's pod and Service CIDRs the agent was given
    /// (`--cluster-pod-cidrs`, `--cluster-service-cidrs`); those v1 Nodes
    /// report are added by translation.
    pub cluster_cidrs: Vec<super::ClusterCidr>,
}

/// Files parsed since the agent started (cache hits are not counted):
/// `vmpath_config_files_parsed_total`.
static FILES_PARSED: AtomicU64 = AtomicU64::new(0);

pub fn files_parsed() -> u64 {
    FILES_PARSED.load(Ordering::Relaxed)
}

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stamp {
    fn of(meta: &fs::Metadata) -> Self {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
            ctime_ns: meta.ctime() as i128 * 1_000_000_000 + meta.ctime_nsec() as i128,
        }
    }
}

/// One file's outcome, kept until the file changes.
#[derive(Debug, Clone)]
struct Parsed {
    stamp: Stamp,
    documents: Vec<RawDocument>,
    cluster: std::sync::Arc<[ClusterDocument]>,
    error: Option<ConfigError>,
    hash: u64,
}

/// Reads the config dir, parsing only files that changed since last time.
#[derive(Debug, Default)]
pub struct Reader {
    cache: HashMap<PathBuf, Parsed>,
}

impl Reader {
    pub fn read(&mut self, dir: &Path) -> Snapshot {
        let files = config_files(dir);
        let mut snap = Snapshot {
            empty: files.is_empty(),
            ..Default::default()
        };
        let mut fingerprint_parts: Vec<Vec<u8>> = Vec::new();
        let mut seen = HashMap::with_capacity_and_hasher(files.len(), Default::default());
        for (file, meta) in files {
            let stamp = Stamp::of(&meta);
            let parsed = match self.cache.remove(&file) {
                Some(p) if p.stamp == stamp => p,
                _ => parse_file(&file, stamp),
            };
            fingerprint_parts.push(file.as_os_str().as_encoded_bytes().to_vec());
            fingerprint_parts.push(parsed.hash.to_le_bytes().to_vec());
            snap.documents.extend(parsed.documents.iter().cloned());
            snap.cluster.push_part(parsed.cluster.clone());
            snap.errors.extend(parsed.error.iter().cloned());
            seen.insert(file, parsed);
        }
        // Files gone from the dir are forgotten.
        self.cache = seen;
        let parts: Vec<&[u8]> = fingerprint_parts.iter().map(|p| p.as_slice()).collect();
        snap.fingerprint = crate::sys::hash::fnv1a(&parts);
        snap
    }
}

/// Reads the config dir once, without a cache.
pub fn read_dir(dir: &Path) -> Snapshot {
    Reader::default().read(dir)
}

/// The config files in `dir`, sorted, with their (followed) metadata.
fn config_files(dir: &Path) -> Vec<(PathBuf, fs::Metadata)> {
    let mut files: Vec<(PathBuf, fs::Metadata)> = match fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // `..data`, `..2024_...` are the kubelet's own entries.
                !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
            })
            .filter_map(|p| {
                let meta = fs::metadata(&p).ok()?;
                meta.is_file().then_some((p, meta))
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort_by(|a, b| a.0.cmp(&b.0));
    files
}

fn parse_file(file: &Path, stamp: Stamp) -> Parsed {
    FILES_PARSED.fetch_add(1, Ordering::Relaxed);
    let refused = |message: String, hash: u64| Parsed {
        stamp,
        documents: Vec::new(),
        cluster: Vec::new().into(),
        error: Some(ConfigError::file(file, message)),
        hash,
    };
    // A file over the limit is never read: its stamp stands for its content.
    let stamp_hash = crate::sys::hash::fnv1a(&[
        &stamp.dev.to_le_bytes(),
        &stamp.ino.to_le_bytes(),
        &stamp.size.to_le_bytes(),
        &stamp.mtime_ns.to_le_bytes(),
    ]);
    if stamp.size > limits::MAX_FILE_BYTES {
        return refused(
            format!(
                "refused whole: {} bytes, over the limit of {} bytes per config file",
                stamp.size,
                limits::MAX_FILE_BYTES
            ),
            stamp_hash,
        );
    }
    let bytes = match read_bounded(file) {
        Ok(b) => b,
        Err(e) => return refused(format!("cannot read: {e}"), stamp_hash),
    };
    let hash = crate::sys::hash::fnv1a(&[&bytes]);
    match parse(&bytes) {
        Ok(values) => {
            let (mut documents, mut cluster) = (Vec::new(), Vec::new());
            let shared = SourceFile::from(file);
            for (i, value) in values.into_iter().enumerate() {
                // Only what is read is kept, typed: a cluster's objects
                // are many.
                let (objects, document) = crate::config::kube_objects::prune::keep_all(value);
                cluster.extend(objects.into_iter().map(|object| ClusterDocument {
                    file: shared.clone(),
                    index: doc_index(i + 1),
                    object,
                }));
                documents.extend(document.map(|value| RawDocument {
                    file: shared.clone(),
                    index: i + 1,
                    origin: crate::config::DocOrigin::Given,
                    value,
                }));
            }
            Parsed {
                stamp,
                documents,
                cluster: cluster.into(),
                error: None,
                hash,
            }
        }
        Err(message) => refused(format!("refused whole: {message}"), hash),
    }
}

/// Reads at most the limit (the file may grow after it was measured).
fn read_bounded(file: &Path) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    fs::File::open(file)?
        .take(limits::MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limits::MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "grew over the limit of {} bytes per config file while being read",
            limits::MAX_FILE_BYTES
        )));
    }
    Ok(bytes)
}

/// Parses every document of one file under the limits; any syntax error or
/// breached limit refuses the whole file (what follows a broken document
/// cannot be split from it reliably).
pub fn parse(bytes: &[u8]) -> Result<Vec<serde_json::Value>, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.valid_up_to()
        )
    })?;
    let options = serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_reader_input_bytes: Some(limits::MAX_FILE_BYTES as usize),
            max_depth: limits::MAX_DEPTH,
            flow_nesting_limit: limits::MAX_DEPTH,
            max_aliases: limits::MAX_ALIASES,
            max_anchors: limits::MAX_ANCHORS,
            max_documents: limits::MAX_DOCUMENTS,
            max_nodes: limits::MAX_NODES,
            max_events: 4 * limits::MAX_NODES,
            max_total_scalar_bytes: limits::MAX_FILE_BYTES as usize,
        },
        // YAML 1.2 core scalars, as serde_yaml read them: `y`, `on`, `0123`
        // stay strings.
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        merge_keys: serde_saphyr::MergeKeyPolicy::Error,
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: limits::MAX_ALIAS_REPLAY,
            max_replay_stack_depth: 8,
        },
        with_snippet: false,
    };
    serde_saphyr::from_multiple_with_options::<serde_json::Value>(text, options).map_err(|e| {
        format!(
            "not accepted as YAML within the limits (nesting {}, {} aliases, {} nodes, \
                 {} documents per file): {e}",
            limits::MAX_DEPTH,
            limits::MAX_ALIASES,
            limits::MAX_NODES,
            limits::MAX_DOCUMENTS
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts shared, not copied: the same items in order, found by index
    /// across parts, and the source's part is the snapshot's.
    #[test]
    fn a_chunked_list_is_its_parts_in_order() {
        let kind_a: std::sync::Arc<[u32]> = vec![1, 2, 3].into();
        let mut list = Chunked::default();
        list.push_part(kind_a.clone());
        list.push_part(Vec::new().into());
        list.push(4);
        list.extend([5, 6]);
        assert_eq!(list.len(), 6);
        assert_eq!(list.iter().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(
            (list.get(2), list.get(3), list.get(5), list.get(6)),
            (Some(&3), Some(&4), Some(&6), None)
        );
        assert!(std::ptr::eq(&list[0], &kind_a[0]), "shared, not copied");
        assert!(Chunked::<u32>::default().is_empty());
    }

    #[test]
    fn reads_documents() {
        let docs = parse(b"a: 1\n---\nb: [x, y]\n---\n").unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1]["b"][1], "y");
    }

    #[test]
    fn refuses_deep_nesting_quickly() {
        let depth = 100_000;
        let text = format!("x: {}{}\n", "[".repeat(depth), "]".repeat(depth));
        let err = parse(text.as_bytes()).unwrap_err();
        assert!(err.contains("depth") || err.contains("nest"), "{err}");
    }

    #[test]
    fn refuses_alias_bomb() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let prev = format!("*a{}", i - 1);
            text.push_str(&format!("a{i}: &a{i} [{}]\n", vec![prev; 10].join(", ")));
        }
        let err = parse(text.as_bytes()).unwrap_err();
        assert!(err.contains("alias") || err.contains("replay"), "{err}");
    }

    #[test]
    fn refuses_binary() {
        let err = parse(&[0xff, 0xfe, 0x00, 0x81, 0x9f]).unwrap_err();
        assert!(err.contains("UTF-8"), "{err}");
    }

    #[test]
    fn refuses_too_many_documents_and_nodes() {
        let text = "[1]\n---\n".repeat(limits::MAX_DOCUMENTS + 1);
        assert!(parse(text.as_bytes()).is_err());
        let text = format!("x: [{}]\n", vec!["1"; limits::MAX_NODES + 1].join(","));
        assert!(parse(text.as_bytes()).is_err());
    }

    /// A valid config of a few documents, to cut and mutate.
    const VALID: &str = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec:\n  id: 100\n  subnets: [10.20.0.0/16, fd20::/64]\n  defaultGatewayIPs: [10.20.0.1]\n---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: vm1-eth0, namespace: demo, labels: {a: b}}\nspec:\n  vm: vm1\n  interface: eth0\n  network: blue\n  node: a\n  port: vm1-port\n  mac: \"52:54:00:00:01:01\"\n  ips: [10.20.0.11/16]\n";

    /// Parses and validates `bytes` as the agent would, and says how long
    /// it took.
    fn read_and_validate(bytes: &[u8]) -> std::time::Duration {
        let started = std::time::Instant::now();
        let dir = std::env::temp_dir().join(format!(
            "vmpath-prop-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("c.yaml"), bytes).unwrap();
        let snap = read_dir(&dir);
        let _ = crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new());
        let _ = fs::remove_dir_all(&dir);
        started.elapsed()
    }

    /// Generous for a debug build on a shared machine; hostile inputs of
    /// the same size take quadratic time in an unbounded parser.
    const TIME_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

    #[test]
    fn the_valid_config_reads() {
        let docs = parse(VALID.as_bytes()).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1]["spec"]["mac"], "52:54:00:00:01:01");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        #[test]
        fn random_bytes_are_read_in_bounded_time(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096)) {
            proptest::prop_assert!(read_and_validate(&bytes) < TIME_BOUND);
        }

        #[test]
        fn truncated_documents_are_read_in_bounded_time(cut in 0..VALID.len()) {
            proptest::prop_assert!(read_and_validate(&VALID.as_bytes()[..cut]) < TIME_BOUND);
        }

        #[test]
        fn mutated_documents_are_read_in_bounded_time(
            edits in proptest::collection::vec((0..VALID.len(), proptest::sample::select(vec![b'[', b']', b'{', b'}', b'&', b'*', b':', b'-', b'\n', b' ', b'"', b'!', b'|'])), 1..16),
            repeat in 1usize..200,
        ) {
            let mut bytes = VALID.as_bytes().to_vec();
            for (at, b) in edits {
                bytes[at] = b;
            }
            // Some structure repeated many times, as a careless generator would.
            let mut text = bytes.clone();
            for _ in 1..repeat {
                text.extend_from_slice(b"---\n");
                text.extend_from_slice(&bytes);
            }
            proptest::prop_assert!(read_and_validate(&text) < TIME_BOUND);
        }

        #[test]
        fn nesting_of_any_depth_is_read_in_bounded_time(depth in 1usize..200_000, flow in proptest::prelude::any::<bool>()) {
            let text = if flow {
                format!("x: {}{}\n", "[".repeat(depth), "]".repeat(depth))
            } else {
                let mut t = String::new();
                for i in 0..depth.min(5000) {
                    t.push_str(&" ".repeat(i));
                    t.push_str("- \n");
                }
                t
            };
            proptest::prop_assert!(read_and_validate(text.as_bytes()) < TIME_BOUND);
        }
    }
}
