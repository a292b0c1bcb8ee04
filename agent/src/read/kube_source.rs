//! `--source kubernetes`: the same objects the config dir can hold, from
//! the API server. One kube-rs watcher per kind (this node's pods only, by
//! field selector) keeps an in-memory copy, each object stored once as a
//! round reads it (the cluster kinds typed, pruned to the fields read:
//! [`crate::config::kube_objects::prune`]); each reconcile round reads the copies exactly as
//! it reads files.
//!
//! Losing the API server never withdraws anything: a watch error leaves
//! every copy as it was (the watcher retries with backoff, resumes from
//! its last resourceVersion and relists on 410 Gone); a relist replaces a
//! kind's copy only once complete, and one that comes back empty is held
//! back (see [`Relists`]); until every kind has been listed once, or when
//! all copies are empty, the round is told the source is empty, which
//! leaves the data path as it is.

use crate::sys::intern::Name;
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use anyhow::{Context as _, Result};
use futures_util::StreamExt as _;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt as _, watcher},
};
use serde_json::Value;
use tracing::{info, warn};

use super::rbac;
use crate::{
    config::kube_objects::ledger,
    config::{
        ConfigError,
        source::{ClusterDocument, RawDocument, Snapshot, SourceFile},
    },
    publish::view::SharedView,
    sys::events::Wake,
};
use crate::{config::kube_objects::prune::Kept, publish::writeback};

/// Every kind the agent watches: group, version, kind, plural, and
/// whether only this node's objects are wanted.
const KINDS: &[(&str, &str, &str, &str, bool)] = &[
    ("vmpath.dev", "v1alpha1", "Network", "networks", false),
    ("", "v1", "Node", "nodes", false),
    ("", "v1", "Pod", "pods", true),
    ("", "v1", "Namespace", "namespaces", false),
    (
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
        "networkpolicies",
        false,
    ),
    ("", "v1", "Service", "services", false),
    (
        "discovery.k8s.io",
        "v1",
        "EndpointSlice",
        "endpointslices",
        false,
    ),
    (
        "k8s.cni.cncf.io",
        "v1",
        "NetworkAttachmentDefinition",
        "network-attachment-definitions",
        false,
    ),
    (
        "k8s.cni.cncf.io",
        "v1alpha1",
        "IPAMClaim",
        "ipamclaims",
        false,
    ),
    (
        "kubevirt.io",
        "v1",
        "VirtualMachineInstance",
        "virtualmachineinstances",
        false,
    ),
    (
        "kubevirt.io",
        "v1",
        "VirtualMachineInstanceMigration",
        "virtualmachineinstancemigrations",
        false,
    ),
];

struct Kind {
    store: Arc<Mutex<Store<Kept>>>,
    /// Listed once: the copy stands for the cluster.
    listed: Arc<AtomicBool>,
    /// What a relist that came back empty replaced (see [`Relists`]).
    held: Arc<Mutex<Relists<Kept>>>,
    /// The kind's objects as the last round read them, and the keys its
    /// watch applied since (marked after `store` and `held`): a round
    /// reads again only the chunks those keys fall in.
    read: Arc<Mutex<KindRead>>,
    /// `kubernetes:<plural>`: the file every object of the kind names.
    file: SourceFile,
}

/// What a round reads of a kind: the last read, and what changed since.
#[derive(Default)]
struct KindRead {
    /// `None`: read it all (first, or after a relist).
    last: Option<ReadKind>,
    /// Objects applied or deleted since `last`, by key.
    changed: BTreeSet<ObjectKey>,
    /// A relist began or ended since `last`: every chunk again.
    whole: bool,
}

impl KindRead {
    /// What `event` changed, for the next read.
    fn mark(&mut self, event: &watcher::Event<DynamicObject>) {
        match event {
            watcher::Event::Apply(o) | watcher::Event::Delete(o) => {
                self.changed.insert(key_of(o));
            }
            _ => self.whole = true,
        }
    }
}

/// One kind's part of a snapshot, in chunks of consecutive keys shared
/// between rounds: a change reads its chunk again, not the kind (at
/// 100,000 VMs a kind read whole was 10-30 ms of every round that a VMI,
/// pod or claim changed, most of it a cache miss per object).
#[derive(Clone, Default)]
struct ReadKind {
    /// Shared: an unchanged kind's read is the last one, not a copy of
    /// every chunk's first key.
    chunks: Arc<Vec<ReadChunk>>,
}

#[derive(Clone)]
struct ReadChunk {
    /// Its first key when read (the first chunk stands for every key
    /// before the second's).
    first: ObjectKey,
    cluster: Arc<[ClusterDocument]>,
    documents: Arc<[RawDocument]>,
    /// The document index (`#N` in messages) of its first object.
    base: usize,
}

/// A chunk is read as this many objects; one grown past twice as many
/// is split.
const READ_CHUNK: usize = 128;

/// A kind's objects by namespace and name: what kube-rs's reflector
/// keeps, but each object once, in the form its reader keeps (here the
/// cluster kinds typed and pruned to the fields read, other kinds as
/// documents; the controller's pods as theirs): a reflector's copy would
/// An object's namespace and name: names, one copy with the object's own
/// (a `String` pair was two more copies per object of the cluster).
pub(crate) type ObjectKey = (Name, Name);

/// be a second one.
pub(crate) struct Store<T> {
    objects: BTreeMap<ObjectKey, T>,
    /// A relist in progress, swapped in once complete.
    relist: Option<BTreeMap<ObjectKey, T>>,
}

impl<T> Default for Store<T> {
    fn default() -> Self {
        Self {
            objects: BTreeMap::new(),
            relist: None,
        }
    }
}

impl<T: Clone> Store<T> {
    /// Applies a watch event as kube-rs's reflector does, each object
    /// kept as `read` makes it.
    pub(crate) fn apply(
        &mut self,
        event: &watcher::Event<DynamicObject>,
        read: impl Fn(&DynamicObject) -> T,
    ) {
        match event {
            watcher::Event::Init => self.relist = Some(BTreeMap::new()),
            watcher::Event::InitApply(o) => {
                self.relist
                    .get_or_insert_default()
                    .insert(key_of(o), read(o));
            }
            watcher::Event::InitDone => {
                if let Some(relist) = self.relist.take() {
                    // A list arrives in key order: its tree was grown half
                    // full, and it is kept for as long as the objects are.
                    self.objects = crate::sys::sorted::packed(relist);
                }
            }
            watcher::Event::Apply(o) => {
                self.objects.insert(key_of(o), read(o));
            }
            watcher::Event::Delete(o) => {
                self.objects.remove(&key_of(o));
            }
        }
    }

    pub(crate) fn state(&self) -> Vec<T> {
        self.objects.values().cloned().collect()
    }
}

fn key_of(o: &DynamicObject) -> ObjectKey {
    (
        Name::new(o.metadata.namespace.as_deref().unwrap_or_default()),
        Name::new(o.metadata.name.as_deref().unwrap_or_default()),
    )
}

/// An object as a round reads it (list items may come without their
/// apiVersion and kind): the cluster kinds typed and pruned.
fn document(resource: &ApiResource, o: &DynamicObject) -> Kept {
    let mut value = serde_json::to_value(o).unwrap_or(Value::Null);
    value["apiVersion"] = resource.api_version.clone().into();
    value["kind"] = resource.kind.clone().into();
    crate::config::kube_objects::prune::keep(value)
}

/// A kind's relists. The store swaps a relist in only once it is
/// complete (`InitDone`), so a relist in progress or cut short leaves the
/// last good copy. A relist that comes back with nothing where there were
/// objects (an API server that lost its data, a storage glitch) is not
/// applied as deletions: the objects read before are held until the kind
/// shows life again (any object added, changed or deleted, or a relist
/// with objects).
struct Relists<T> {
    /// The copy when the relist began.
    before: Vec<T>,
    held: Option<Vec<T>>,
}

impl<T> Default for Relists<T> {
    fn default() -> Self {
        Relists {
            before: Vec::new(),
            held: None,
        }
    }
}

impl<T: Clone> Relists<T> {
    /// `state` is the store's copy after it applied the event.
    /// Returns how many objects an empty relist held back, when it did.
    fn on_event<K>(
        &mut self,
        event: &watcher::Event<K>,
        first_list: bool,
        state: impl FnOnce() -> Vec<T>,
    ) -> Option<usize> {
        match event {
            watcher::Event::Init => {
                // The store still holds the last good copy.
                self.before = if first_list { Vec::new() } else { state() };
                None
            }
            watcher::Event::InitApply(_) => None,
            watcher::Event::InitDone => {
                let before = std::mem::take(&mut self.before);
                if state().is_empty() && !before.is_empty() {
                    let n = before.len();
                    self.held = Some(before);
                    Some(n)
                } else {
                    self.held = None;
                    None
                }
            }
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => {
                self.held = None;
                None
            }
        }
    }

    /// Whether an empty relist's objects are held back now.
    fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// The copy a round reads: the held objects, else the store's.
    fn read(&self, state: impl FnOnce() -> Vec<T>) -> Vec<T> {
        match &self.held {
            Some(held) => held.clone(),
            None => state(),
        }
    }
}

/// `vmpath controller`'s ledger, watched in its namespace: its shards'
/// ConfigMaps as read, and the ledger they make (parsed once per change,
/// not per round: it may hold hundreds of thousands of addresses).
struct LedgerWatch {
    /// `namespace/name`, for messages.
    name: String,
    listed: Arc<AtomicBool>,
    ledger: Arc<Mutex<Arc<ledger::Shards>>>,
}

/// Where the agent reads the controller's ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRef {
    pub namespace: String,
    pub name: String,
}

pub struct KubeSource {
    kinds: Vec<Kind>,
    ledger: LedgerWatch,
    /// Bumped on every watch event, for the round's fingerprint.
    generation: Arc<AtomicU64>,
    client: Client,
    runtime: tokio::runtime::Handle,
    node: String,
    /// What was written back already: Events (object, message) and the
    /// detected MACs per VMI. Forgotten on restart: written again then.
    reported: Mutex<Reported>,
}

/// Posts problems of the node itself as Warning Events on its Node.
pub struct NodeReporter {
    client: Client,
    runtime: tokio::runtime::Handle,
    node: String,
    reported: Mutex<BTreeSet<String>>,
}

impl NodeReporter {
    /// `problems` are what holds now: each new one is posted (with
    /// `reason`), without waiting for the API server; one that went away
    /// and comes back is posted again.
    pub fn report(&self, reason: &'static str, problems: &[String]) {
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        for p in problems.iter().filter(|p| !reported.contains(*p)) {
            let event = writeback::node_event(&self.node, reason, p, "vmpath-agent");
            let api: Api<k8s_openapi::api::core::v1::Event> =
                Api::namespaced(self.client.clone(), "default");
            let node = self.node.clone();
            self.runtime.spawn(async move {
                if let Err(e) = api.create(&PostParams::default(), &event).await {
                    warn!("posting an Event on Node {node}: {e}");
                }
            });
        }
        *reported = problems.iter().cloned().collect();
    }
}

#[derive(Default)]
struct Reported {
    events: BTreeSet<(writeback::Involved, String)>,
    macs: writeback::DetectedMacs,
}

/// Where the client's config comes from.
pub fn client_config(kubeconfig: Option<&Path>) -> Result<kube::Config> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                    .await
                    .with_context(|| format!("using kubeconfig {}", path.display()))
            }
            None => kube::Config::incluster().context(
                "no --kubeconfig and not in a cluster (KUBERNETES_SERVICE_HOST unset or no service account)",
            ),
        }
    })
}

impl KubeSource {
    /// Starts the watchers on a thread of their own; they wake the
    /// reconcile loop through `shared` on every event.
    pub fn start(
        kubeconfig: Option<PathBuf>,
        node: &str,
        ledger: &LedgerRef,
        shared: SharedView,
    ) -> Result<Self> {
        let config = client_config(kubeconfig.as_deref())?;
        let generation = Arc::new(AtomicU64::new(0));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .thread_name("vmpath-kube")
            .build()?;
        let client = {
            let _guard = runtime.enter();
            Client::try_from(config).context("building the Kubernetes client")?
        };
        let mut kinds = Vec::new();
        for (group, version, kind, plural, on_node) in KINDS {
            debug_assert!(
                rbac::allows(rbac::AGENT, group, plural, "watch"),
                "{plural} is watched: the RBAC table must say so"
            );
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, kind),
                plural,
            );
            let store = Arc::new(Mutex::new(Store::<Kept>::default()));
            let listed = Arc::new(AtomicBool::new(false));
            let held = Arc::new(Mutex::new(Relists::default()));
            let read = Arc::new(Mutex::new(KindRead::default()));
            let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
            let mut wc = watcher::Config::default();
            if *on_node {
                wc = wc.fields(&format!("spec.nodeName={node}"));
            }
            let stream = watcher(api, wc).default_backoff();
            let resource2 = resource.clone();
            let (listed2, generation2, shared2, held2, store2, read2) = (
                listed.clone(),
                generation.clone(),
                shared.clone(),
                held.clone(),
                store.clone(),
                read.clone(),
            );
            let kind_name = kind.to_string();
            runtime.spawn(async move {
                let mut stream = std::pin::pin!(stream);
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(event) => {
                            let first_list = !listed2.load(Ordering::SeqCst);
                            store2
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .apply(&event, |o| document(&resource2, o));
                            // Locks in the order a round takes them: the
                            // relists, then the store.
                            let held_back = held2
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .on_event(&event, first_list, || {
                                    store2.lock().unwrap_or_else(|p| p.into_inner()).state()
                                });
                            if let Some(n) = held_back {
                                warn!(kind = %kind_name, objects = n, "relist came back empty; keeping what was read until the kind changes");
                            }
                            // After the store and the relists: what a round
                            // read before this is read again.
                            read2.lock().unwrap_or_else(|p| p.into_inner()).mark(&event);
                            if matches!(event, watcher::Event::InitDone)
                                && !listed2.swap(true, Ordering::SeqCst)
                            {
                                info!(kind = %kind_name, "listed from the API server");
                            }
                            generation2.fetch_add(1, Ordering::SeqCst);
                            shared2.wake(Wake::Cluster);
                        }
                        // The copy stays as it was; the watcher retries.
                        Err(e) => warn!(kind = %kind_name, "watch: {e}; keeping what was read"),
                    }
                }
            });
            kinds.push(Kind {
                file: PathBuf::from(format!("kubernetes:{plural}")).into(),
                store,
                listed,
                held,
                read,
            });
        }
        let ledger = watch_ledger(&runtime, &client, ledger, &generation, &shared);
        let handle = runtime.handle().clone();
        // The runtime lives as long as the process.
        std::thread::Builder::new()
            .name("vmpath-kube".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
        Ok(KubeSource {
            kinds,
            ledger,
            generation,
            client,
            runtime: handle,
            node: node.to_string(),
            reported: Mutex::new(Reported::default()),
        })
    }

    /// What posts this node's own problems (forwarding off) as Events on
    /// its Node, each once while it lasts.
    pub fn node_reporter(&self) -> NodeReporter {
        NodeReporter {
            client: self.client.clone(),
            runtime: self.runtime.clone(),
            node: self.node.clone(),
            reported: Mutex::new(BTreeSet::new()),
        }
    }

    /// Writes back what a round found, without waiting for the API server:
    /// an Event for each refusal and wait not reported yet, and the VMIs'
    /// detected MACs where they changed. A write that fails is logged and
    /// tried again after the next change.
    pub fn report(
        &self,
        errors: &[ConfigError],
        warnings: &[ConfigError],
        macs: writeback::DetectedMacs,
    ) {
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        let current: BTreeSet<(writeback::Involved, String)> =
            writeback::events_of(errors, warnings)
                .into_iter()
                .map(|(inv, reason, message)| {
                    if !reported.events.contains(&(inv.clone(), message.clone())) {
                        let event =
                            writeback::event(&inv, reason, &message, "vmpath-agent", &self.node);
                        let api: Api<k8s_openapi::api::core::v1::Event> =
                            Api::namespaced(self.client.clone(), &inv.namespace);
                        let what = format!("{} {}/{}", inv.kind, inv.namespace, inv.name);
                        self.runtime.spawn(async move {
                            if let Err(e) = api.create(&PostParams::default(), &event).await {
                                warn!("posting an Event on {what}: {e}");
                            }
                        });
                    }
                    (inv, message)
                })
                .collect();
        // A refusal that went away and comes back is reported again.
        reported.events = current;
        for (vmi, by_iface) in &macs {
            if reported.macs.get(vmi) == Some(by_iface) {
                continue;
            }
            let resource = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
                "virtualmachineinstances",
            );
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &vmi.0, &resource);
            let value = serde_json::to_string(by_iface).expect("a map serializes");
            let patch = serde_json::json!({"metadata": {"annotations": {
                writeback::DETECTED_MAC_ANNOTATION: value}}});
            let name = vmi.1.clone();
            self.runtime.spawn(async move {
                match api
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => info!(vmi = %name, macs = %value, "detected MACs written to the VMI"),
                    Err(e) => warn!(vmi = %name, "annotating the detected MACs: {e}"),
                }
            });
        }
        reported.macs = macs;
    }

    /// The objects as documents, as the config dir would give them.
    pub fn read(&self) -> Snapshot {
        let generation = self.generation.load(Ordering::SeqCst);
        let mut snap = Snapshot {
            pod_claims: true,
            ..Default::default()
        };
        for kind in &self.kinds {
            let part = kind.read_now();
            for chunk in part.chunks.iter() {
                snap.cluster.push_part(chunk.cluster.clone());
                snap.documents.extend(chunk.documents.iter().cloned());
            }
        }
        snap.ledger = Some(
            self.ledger
                .ledger
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        );
        // Until the ledger is listed no claim could be trusted: the round
        // waits rather than hold every VM back.
        let all_listed = self.kinds.iter().all(|k| k.listed.load(Ordering::SeqCst))
            && self.ledger.listed.load(Ordering::SeqCst);
        snap.empty = !all_listed || (snap.documents.is_empty() && snap.cluster.is_empty());
        snap.fingerprint = crate::sys::hash::fnv1a(&[b"kubernetes", &generation.to_le_bytes()]);
        snap
    }
}

impl Kind {
    /// The kind's objects as a round reads them: the relists' held copy,
    /// else the store's; from the last read, with the chunks its changed
    /// keys fall in read again.
    fn read_now(&self) -> ReadKind {
        let mut read = self.read.lock().unwrap_or_else(|p| p.into_inner());
        // Locks in the watch's order: the relists, then the store.
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let file = &self.file;
        if held.holding() {
            // Until the kind shows life again: its copy, read whole (and
            // whole again after).
            read.last = None;
            let objects = held.read(Vec::new);
            let chunk = read_chunk(file, (Name::default(), Name::default()), 1, objects.iter());
            return ReadKind {
                chunks: Arc::new(vec![chunk]),
            };
        }
        if !read.whole
            && read.changed.is_empty()
            && let Some(last) = &read.last
        {
            return last.clone();
        }
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let changed = std::mem::take(&mut read.changed);
        let whole = std::mem::take(&mut read.whole);
        let mut chunks = match read.last.take() {
            // Unshared once the last round's snapshot took its parts.
            Some(last) if !whole && !last.chunks.is_empty() => Arc::unwrap_or_clone(last.chunks),
            _ => {
                let all: Vec<(&ObjectKey, &Kept)> = store.objects.iter().collect();
                let kind = ReadKind {
                    chunks: Arc::new(chunks_of(file, &all, 1)),
                };
                read.last = Some(kind.clone());
                return kind;
            }
        };
        // The chunks the changed keys fall in, read again from the back
        // (a chunk's neighbours bound its keys).
        let hit: BTreeSet<usize> = changed
            .iter()
            .map(|k| chunks.partition_point(|c| &c.first <= k).saturating_sub(1))
            .collect();
        for i in hit.into_iter().rev() {
            use std::ops::Bound::{Excluded, Included, Unbounded};
            let low = if i == 0 {
                Unbounded
            } else {
                Included(chunks[i].first.clone())
            };
            let high = chunks
                .get(i + 1)
                .map_or(Unbounded, |c| Excluded(c.first.clone()));
            let objects: Vec<(&ObjectKey, &Kept)> = store.objects.range((low, high)).collect();
            let again = if objects.len() > 2 * READ_CHUNK {
                chunks_of(file, &objects, chunks[i].base)
            } else if objects.is_empty() {
                Vec::new()
            } else {
                vec![read_chunk(
                    file,
                    objects[0].0.clone(),
                    chunks[i].base,
                    objects.iter().map(|(_, o)| *o),
                )]
            };
            chunks.splice(i..=i, again);
        }
        let kind = ReadKind {
            chunks: Arc::new(chunks),
        };
        read.last = Some(kind.clone());
        kind
    }
}

/// `objects` (in key order) in chunks of [`READ_CHUNK`], numbered from
/// `base`.
fn chunks_of(file: &SourceFile, objects: &[(&ObjectKey, &Kept)], base: usize) -> Vec<ReadChunk> {
    objects
        .chunks(READ_CHUNK)
        .enumerate()
        .map(|(k, run)| {
            read_chunk(
                file,
                run[0].0.clone(),
                base + k * READ_CHUNK,
                run.iter().map(|(_, o)| *o),
            )
        })
        .collect()
}

/// One chunk of a kind's objects, as a round reads them.
fn read_chunk<'a>(
    file: &SourceFile,
    first: ObjectKey,
    base: usize,
    objects: impl Iterator<Item = &'a Kept>,
) -> ReadChunk {
    let mut cluster = Vec::new();
    let mut documents = Vec::new();
    for (i, kept) in objects.enumerate() {
        match kept {
            Kept::Cluster(object) => cluster.push(ClusterDocument {
                file: file.clone(),
                index: crate::config::source::doc_index(base + i),
                object: object.clone(),
            }),
            Kept::Document(value) if value.is_null() => {}
            Kept::Document(value) => documents.push(RawDocument {
                file: file.clone(),
                index: base + i,
                origin: crate::config::DocOrigin::Given,
                value: value.clone(),
            }),
        }
    }
    ReadChunk {
        first,
        cluster: cluster.into(),
        documents: documents.into(),
        base,
    }
}

/// Watches the ledger's ConfigMaps (its namespace only) and keeps the
/// ledger they make. A relist that comes back empty where there were
/// shards is held as for the other kinds; a shard that does not read
/// leaves the last good ledger, and says so.
fn watch_ledger(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
    at: &LedgerRef,
    generation: &Arc<AtomicU64>,
    shared: &SharedView,
) -> LedgerWatch {
    let resource = ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &at.namespace, &resource);
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let watch = LedgerWatch {
        name: format!("{}/{}", at.namespace, at.name),
        listed: Arc::new(AtomicBool::new(false)),
        ledger: Arc::new(Mutex::new(Arc::default())),
    };
    let (listed, parsed, generation, shared) = (
        watch.listed.clone(),
        watch.ledger.clone(),
        generation.clone(),
        shared.clone(),
    );
    let (ledger_name, what) = (at.name.clone(), watch.name.clone());
    runtime.spawn(async move {
        // Each ConfigMap as its shard's ledger, parsed as it arrives (the
        // watch delivers a changed ConfigMap alone), not its text.
        let mut store = Store::<Arc<ledger::ShardRead>>::default();
        let mut held = Relists::<Arc<ledger::ShardRead>>::default();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    warn!(ledger = %what, "watch: {e}; keeping what was read");
                    continue;
                }
            };
            let first_list = !listed.load(Ordering::SeqCst);
            apply_ledger_event(&mut store, &ledger_name, &event);
            if let Some(n) = held.on_event(&event, first_list, || store.state()) {
                warn!(ledger = %what, objects = n, "relist came back empty; keeping what was read until it changes");
            }
            let configmaps = held.read(|| store.state());
            match ledger::Shards::of_reads(configmaps.iter().map(|r| &**r)) {
                Ok(shards) => *parsed.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(shards),
                Err(e) => warn!(ledger = %what, "{e}; keeping the last ledger that read"),
            }
            if matches!(event, watcher::Event::InitDone) && !listed.swap(true, Ordering::SeqCst) {
                info!(ledger = %what, "ledger listed from the API server");
            }
            generation.fetch_add(1, Ordering::SeqCst);
            shared.wake(Wake::Cluster);
        }
    });
    watch
}

/// Keeps a watch event's ConfigMap as the shard of `ledger` it reads
/// to. One at the version already read (a relist hands them all again)
/// keeps its read: not parsed again, and its shard shared, so what reads
/// the ledger compares none of it.
fn apply_ledger_event(
    store: &mut Store<Arc<ledger::ShardRead>>,
    ledger: &str,
    event: &watcher::Event<DynamicObject>,
) {
    let unchanged = match event {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => store
            .objects
            .get(&key_of(o))
            .filter(|r| r.version.is_some() && r.version == o.metadata.resource_version)
            .cloned(),
        _ => None,
    };
    store.apply(event, |o| {
        unchanged.clone().unwrap_or_else(|| {
            Arc::new(ledger::ShardRead::of(
                ledger,
                o.metadata.name.as_deref().unwrap_or_default(),
                o.metadata.resource_version.as_deref(),
                o.data
                    .get("data")
                    .and_then(|d| d.get(ledger::LEDGER_KEY))
                    .and_then(|t| t.as_str()),
            ))
        })
    });
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::{api::DynamicObject, runtime::watcher::Event};

    use super::{KINDS, Kept, Relists, Store, document, rbac};
    use crate::config::kube_objects::prune::ClusterObject;

    type Ev = Event<DynamicObject>;

    fn pod(name: &str) -> Arc<DynamicObject> {
        let mut o = DynamicObject::new(
            name,
            &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&()),
        );
        o.metadata.namespace = Some("prod".into());
        Arc::new(o)
    }

    fn names(objects: &[Arc<DynamicObject>]) -> Vec<String> {
        objects
            .iter()
            .map(|o| o.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    /// A kind read after changes is what reading it whole gives, and the
    /// chunks no change fell in are the last read's.
    #[test]
    fn a_kind_read_again_reads_the_changed_chunks_alone() {
        use super::{Kind, KindRead, READ_CHUNK};
        use std::sync::{Mutex, atomic::AtomicBool};
        let resource = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&());
        let kind = || Kind {
            file: std::path::PathBuf::from("kubernetes:pods").into(),
            store: Arc::new(Mutex::new(Store::default())),
            listed: Arc::new(AtomicBool::new(true)),
            held: Arc::new(Mutex::new(Default::default())),
            read: Arc::new(Mutex::new(KindRead::default())),
        };
        let named = |i: usize| (*pod(&format!("p{i:05}"))).clone();
        let apply = |k: &Kind, e: &Ev| {
            k.store.lock().unwrap().apply(e, |o| document(&resource, o));
            k.read.lock().unwrap().mark(e);
        };
        let keys = |read: &super::ReadKind| -> Vec<String> {
            read.chunks
                .iter()
                .flat_map(|c| c.cluster.iter())
                .map(|d| match &*d.object {
                    crate::config::kube_objects::prune::ClusterObject::Pod(p) => {
                        p.metadata.name.to_string()
                    }
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        let k = kind();
        for i in (0..2000).step_by(2) {
            apply(&k, &Ev::Apply(named(i)));
        }
        let first = k.read_now();
        assert_eq!(first.chunks.len(), 1000 / READ_CHUNK + 1);
        // New pods in one chunk (past twice its size: split), one deleted
        // in another, one changed in a third.
        for i in (1..2 * READ_CHUNK + 20).step_by(2) {
            apply(&k, &Ev::Apply(named(i + 2 * READ_CHUNK)));
        }
        apply(&k, &Ev::Delete(named(1200)));
        apply(&k, &Ev::Apply(named(1600)));
        let second = k.read_now();
        let whole = kind();
        *whole.store.lock().unwrap() = std::mem::take(&mut *k.store.lock().unwrap());
        assert_eq!(keys(&second), keys(&whole.read_now()));
        assert!(
            second
                .chunks
                .iter()
                .all(|c| c.cluster.len() <= 2 * READ_CHUNK)
        );
        let shared = second
            .chunks
            .iter()
            .filter(|c| {
                first
                    .chunks
                    .iter()
                    .any(|f| Arc::ptr_eq(&f.cluster, &c.cluster))
            })
            .count();
        // The new pods fell in two chunks, the deletion and the change in
        // one each: the other four are the first read's.
        assert_eq!(shared, first.chunks.len() - 4);
        // Nothing changed: the last read again, whole.
        let third = whole.read_now();
        assert!(Arc::ptr_eq(
            &third.chunks[0].cluster,
            &whole.read_now().chunks[0].cluster
        ));
    }

    #[test]
    fn an_empty_relist_withdraws_nothing_until_the_kind_changes() {
        let mut r = Relists::default();
        let a = vec![pod("a"), pod("b")];
        // The first list, empty: nothing to hold (and not listed before).
        r.on_event(&Ev::Init, true, Vec::new);
        assert_eq!(r.on_event(&Ev::InitDone, true, Vec::new), None);
        // A relist that brings objects applies.
        r.on_event(&Ev::Init, false, Vec::new);
        assert_eq!(r.on_event(&Ev::InitDone, false, || a.clone()), None);
        assert_eq!(names(&r.read(|| a.clone())), ["a", "b"]);
        // A relist that comes back empty: held, the round reads a and b.
        r.on_event(&Ev::Init, false, || a.clone());
        assert_eq!(r.on_event(&Ev::InitDone, false, Vec::new), Some(2));
        assert_eq!(names(&r.read(Vec::new)), ["a", "b"]);
        // The kind changes: the store stands for the cluster again.
        r.on_event(&Event::Apply((*pod("c")).clone()), false, Vec::new);
        assert_eq!(names(&r.read(|| vec![pod("c")])), ["c"]);
        // A relist with fewer objects (not none) is a deletion.
        r.on_event(&Ev::Init, false, || a.clone());
        assert_eq!(r.on_event(&Ev::InitDone, false, || vec![pod("a")]), None);
        assert_eq!(names(&r.read(|| vec![pod("a")])), ["a"]);
    }

    #[test]
    fn the_store_keeps_each_object_once_pruned_and_swaps_a_relist_in_when_complete() {
        let resource = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&());
        let with_container = |name: &str| {
            let mut o = (*pod(name)).clone();
            o.data = serde_json::json!({"spec": {"nodeName": "a", "containers": [{"name": "c"}]}});
            o
        };
        let mut store = Store::<Kept>::default();
        store.apply(&Event::Init, |o| document(&resource, o));
        store.apply(&Event::InitApply(with_container("a")), |o| {
            document(&resource, o)
        });
        assert!(
            store.state().is_empty(),
            "a relist in progress is not shown"
        );
        store.apply(&Event::InitDone, |o| document(&resource, o));
        let state = store.state();
        assert_eq!(state.len(), 1);
        let pod_of = |kept: &Kept| match kept {
            Kept::Cluster(o) => match &**o {
                ClusterObject::Pod(p) => p.clone(),
                other => panic!("not read as a pod: {other:?}"),
            },
            Kept::Document(d) => panic!("kept as a document: {d}"),
        };
        let a = pod_of(&state[0]);
        assert_eq!(
            (a.metadata.name.as_str(), a.spec.node_name.as_deref()),
            ("a", Some("a"))
        );
        assert!(a.named_ports().is_empty(), "pruned: {a:?}");
        store.apply(&Event::Apply(with_container("b")), |o| {
            document(&resource, o)
        });
        store.apply(&Event::Apply(with_container("a")), |o| {
            document(&resource, o)
        });
        assert_eq!(store.state().len(), 2, "one copy per object");
        store.apply(&Event::Delete(with_container("a")), |o| {
            document(&resource, o)
        });
        let names: Vec<_> = store
            .state()
            .iter()
            .map(|d| pod_of(d).metadata.name)
            .collect();
        assert_eq!(names, ["b"]);
        // A relist cut short (no InitDone) leaves the last good copy.
        store.apply(&Event::Init, |o| document(&resource, o));
        assert_eq!(store.state().len(), 1);
    }

    /// A relist hands every ConfigMap of the ledger's namespace again: one
    /// at the version already read keeps its read (not parsed again, its
    /// shard shared); one at a new version is read again.
    #[test]
    fn a_relisted_ledger_shard_at_its_version_is_not_read_again() {
        use crate::config::kube_objects::ledger::{LEDGER_KEY, ShardRead, Shards};
        let configmap = |version: &str, text: &str| {
            let mut o = DynamicObject::new(
                "led",
                &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            )
            .within("vmpath-system");
            o.metadata.resource_version = Some(version.into());
            o.data = serde_json::json!({ "data": { LEDGER_KEY: text } });
            o
        };
        let shard = |store: &Store<Arc<ShardRead>>| {
            Shards::of_reads(store.state().iter().map(|r| &**r)).unwrap()
        };
        let held =
            r#"{"blue":{"10.0.0.7":{"claim":"prod/vm1.blue","uid":"u1","ip":"10.0.0.7/24"}}}"#;
        let mut store = Store::<Arc<ShardRead>>::default();
        super::apply_ledger_event(&mut store, "led", &Ev::Apply(configmap("1", held)));
        let first = shard(&store);

        for e in [Ev::Init, Ev::InitApply(configmap("1", held)), Ev::InitDone] {
            super::apply_ledger_event(&mut store, "led", &e);
        }
        let relisted = shard(&store);
        assert!(
            first.differing(&relisted).is_empty(),
            "the same version: the shard read before, shared"
        );

        super::apply_ledger_event(&mut store, "led", &Ev::Apply(configmap("2", "{}")));
        assert_eq!(
            first.differing(&shard(&store)).len(),
            1,
            "a new version is read"
        );
    }

    #[test]
    fn every_watched_kind_is_in_the_rbac_table() {
        for (group, _, _, plural, _) in KINDS {
            for verb in ["list", "watch"] {
                assert!(
                    rbac::allows(rbac::AGENT, group, plural, verb),
                    "{group}/{plural} {verb}"
                );
            }
        }
    }
}
