//! Config: source (files) -> model (serde) -> validated [`Config`].
//!
//! Every document is checked before any is applied. A bad or conflicting
//! document is refused on its own, together with what depends on it; the
//! rest applies.
//!
//! The validate stage's substance (`crate::round::validate` runs it), and
//! the documents every later stage reads: vmpath's own ([`source`] reads
//! the config dir, [`model`]) and the Kubernetes objects they are derived
//! from ([`kube_objects`]: minimal serde types, pruned copies, the ledger).

pub mod kube_objects;
pub mod label_selector;
pub mod model;
pub mod network_policy;
pub mod reserved;
pub mod service;
pub mod source;
mod validate;

use std::{fmt, net::IpAddr};

use ipnet::IpNet;

use crate::sys::intern::Name;
use serde::Serialize;

pub use source::DocOrigin;
pub use validate::{Held, Translated, validate_documents};

use model::{Advertise, Dhcp, Egress, MacPolicy, Migration, Role};

/// A refused document: which file, which document, which field, and why
/// (the API shows it as is).
pub use vmpath_api::types::ConfigError;

/// Where a valid document came from, for messages.
///
/// Its label (`Attachment prod/vm1-blue (derived from ...)`) is printed
/// from its parts when asked for ([`document`](Self::document)): every VM
/// interface of the cluster holds one, and the text was about 80 bytes
/// of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocRef {
    /// Shared with every document of the file.
    pub file: crate::config::source::SourceFile,
    pub kind: DocKind,
    /// A name: a namespace's documents share it.
    pub namespace: Option<Name>,
    /// `metadata.name`. Boxed: every Attachment holds one.
    pub name: Box<str>,
    /// Who made the document (typed: what write-back and Events act on).
    pub origin: DocOrigin,
}

/// The kinds whose valid documents are kept with their [`DocRef`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocKind {
    Network,
    Attachment,
}

impl DocKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DocKind::Network => "Network",
            DocKind::Attachment => "Attachment",
        }
    }
}

impl DocRef {
    /// The document as messages name it ([`document_label`]).
    pub fn document(&self) -> String {
        document_label(
            self.kind.as_str(),
            self.namespace.as_deref(),
            &self.name,
            &self.origin,
        )
    }
}

/// A document as messages name it: kind, namespace and name, and for a
/// derived one the objects it was derived from. Refusals and kept
/// documents alike.
pub fn document_label(
    kind: &str,
    namespace: Option<&str>,
    name: &str,
    origin: &DocOrigin,
) -> String {
    let label = match namespace {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    };
    match origin.derived_from() {
        Some(from) => format!("{label} ({from})"),
        None => label,
    }
}

impl Serialize for DocRef {
    /// As it always read: the file and the document's label.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = s.serialize_struct("DocRef", 2)?;
        out.serialize_field("file", &self.file)?;
        out.serialize_field("document", &self.document())?;
        out.end()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Node {
    pub name: String,
    pub address: IpAddr,
    pub snat_address: Option<IpAddr>,
    /// IPv6 SNAT egress leaves with this (else `snat_address` or
    /// `address`, whichever is IPv6).
    pub snat_address6: Option<std::net::Ipv6Addr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Network {
    pub name: String,
    pub id: u32,
    pub role: Role,
    pub subnets: Vec<IpNet>,
    pub gateway_ips: Vec<IpAddr>,
    pub gateway_mac: [u8; 6],
    pub exclude_subnets: Vec<IpNet>,
    pub ipam: bool,
    pub mac_filter: bool,
    pub ip_filter: bool,
    /// DHCP server traffic from the network's VMs is dropped.
    pub dhcp_guard: bool,
    pub egress: Egress,
    pub advertise: Advertise,
    pub mtu: u16,
    pub dhcp: Dhcp,
    /// Slow-path limits per `vmpath_common::slow_class`, defaults filled in.
    pub slow_path_limits: [model::RateLimit; vmpath_common::slow_class::COUNT],
    /// Which namespaces may attach (`None`: all).
    pub namespace_selector: Option<label_selector::LabelSelector>,
    pub source: DocRef,
}

impl Network {
    /// Does the fabric reach this network's VMs by their own addresses?
    /// Routed networks always; SNAT networks when they advertise anything.
    /// Such networks share one address space (the uplink's `vmp_routed`
    /// is keyed by address alone), so validation keeps their subnets and
    /// addresses apart.
    pub fn ingress_routed(&self) -> bool {
        self.egress == Egress::Routed
            || self.advertise.per_vm
            || self.advertise.subnet
            || self.advertise.learned
    }
    /// The limits as the data path keeps them (`vmp_slow_limits`).
    pub fn slow_limits(&self) -> vmpath_common::SlowLimits {
        vmpath_common::SlowLimits {
            class: self
                .slow_path_limits
                .map(|l| vmpath_common::MeterLimit::new(l.rate, l.burst)),
        }
    }
    /// Whether an endpoint in `namespace` may attach; `Err` names the
    /// network, the namespace, the rule and the labels it was checked on.
    pub fn admits(&self, namespace: &str, config: &Config) -> Result<(), String> {
        let Some(selector) = &self.namespace_selector else {
            return Ok(());
        };
        let labels = config.namespace_labels(namespace);
        if selector.matches(&labels) {
            return Ok(());
        }
        Err(format!(
            "namespace {namespace:?} may not use network {:?}: its namespaceSelector {selector} does not match the namespace's labels {}",
            self.name,
            label_selector::show_labels(&labels)
        ))
    }

    pub fn gateway4(&self) -> Option<std::net::Ipv4Addr> {
        self.gateway_ips.iter().find_map(|ip| match ip {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
    }
    pub fn gateway6(&self) -> Option<std::net::Ipv6Addr> {
        self.gateway_ips.iter().find_map(|ip| match ip {
            IpAddr::V6(v6) => Some(*v6),
            IpAddr::V4(_) => None,
        })
    }
}

/// Which of the cluster's own address spaces a [`ClusterCidr`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum ClusterCidrKind {
    Pod,
    Service,
}

/// One of the cluster's own address ranges (its pods' or its Services'),
/// with where the agent learnt it: a Primary network may not overlap one,
/// or a pod on it could not reach that part of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterCidr {
    pub cidr: IpNet,
    pub kind: ClusterCidrKind,
    /// For messages: `--cluster-pod-cidrs`, `v1 Node a's spec.podCIDRs`.
    pub source: String,
    /// The Node whose `spec.podCIDRs` it is (none for a flag's): this
    /// node's own pod CIDRs need no masquerade in the hand-off.
    pub node: Option<String>,
}

impl fmt::Display for ClusterCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            ClusterCidrKind::Pod => "pod",
            ClusterCidrKind::Service => "Service",
        };
        write!(
            f,
            "the cluster's {kind} CIDR {} ({})",
            self.cidr, self.source
        )
    }
}

/// Whether two prefixes share an address (one contains the other).
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The identity of a VM interface: what survives pods and migrations.
///
/// One shared copy however many hold it: the stages keep the key of
/// every VM interface of the cluster several times (the Attachment, the
/// documents' key set, the accepted set), and three names in each was
/// 48 bytes a copy, in persistent sets that hold room for more. Compared
/// by its parts (a clone is the same key, and found so by pointer first).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttachmentKey(std::sync::Arc<KeyParts>);

/// What an [`AttachmentKey`] names.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct KeyParts {
    /// Names: shared with the objects it came from.
    pub namespace: Name,
    pub vm: Name,
    pub interface: Name,
}

impl std::ops::Deref for AttachmentKey {
    type Target = KeyParts;
    fn deref(&self) -> &KeyParts {
        &self.0
    }
}

impl fmt::Debug for AttachmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for AttachmentKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// The VM interfaces the last round accepted: they win a conflict
/// (`validate`). A persistent set: the round, the pass it keeps for the
/// next and the thread that records it share one set, and a VM interface
/// coming or going copies a path of it, not every key (a copy of the
/// `BTreeSet` the writer still held was 15 ms of the round a VM came in
/// at 100,000 VMs).
pub type AcceptedKeys = imbl::OrdSet<AttachmentKey>;

/// What validation asks of the VM interfaces accepted before.
pub trait KeepFirst {
    fn keeps(&self, key: &AttachmentKey) -> bool;

    /// The copy of `key` the set holds, if it holds it, else `key`.
    /// The accepted set outlives the rounds: a full pass's VM interfaces
    /// take its copies of their keys, or every VM interface of the
    /// cluster would be kept twice (the set's copy and the new one, equal,
    /// so the set keeps its own).
    fn shared(&self, key: AttachmentKey) -> AttachmentKey {
        key
    }
}

impl KeepFirst for std::collections::BTreeSet<AttachmentKey> {
    fn keeps(&self, key: &AttachmentKey) -> bool {
        self.contains(key)
    }
}

impl KeepFirst for AcceptedKeys {
    fn keeps(&self, key: &AttachmentKey) -> bool {
        self.contains(key)
    }

    fn shared(&self, key: AttachmentKey) -> AttachmentKey {
        self.get(&key).cloned().unwrap_or(key)
    }
}

impl fmt::Display for AttachmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.vm, self.interface)
    }
}

impl AttachmentKey {
    pub fn new(namespace: Name, vm: Name, interface: Name) -> Self {
        AttachmentKey(std::sync::Arc::new(KeyParts {
            namespace,
            vm,
            interface,
        }))
    }

    /// The same key for another VM (the tests' copies of a VM interface).
    #[cfg(test)]
    pub fn with_vm(&self, vm: &str) -> Self {
        Self::new(self.namespace.clone(), vm.into(), self.interface.clone())
    }

    /// The same copy as `other` (not only an equal key).
    #[cfg(test)]
    pub fn same_copy(&self, other: &AttachmentKey) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }

    /// The key's (namespace, VM, interface), borrowed.
    pub fn parts(&self) -> (&str, &str, &str) {
        (&self.namespace, &self.vm, &self.interface)
    }

    /// The parts of a key as it prints (`namespace/vm/interface`, as the
    /// claims store keys its claims), borrowed: no namespace or name
    /// holds a `/`.
    pub fn parts_of(text: &str) -> Option<(&str, &str, &str)> {
        let mut it = text.splitn(3, '/');
        Some((it.next()?, it.next()?, it.next()?))
    }

    /// The key `text` prints as.
    pub fn parse(text: &str) -> Option<Self> {
        let (namespace, vm, interface) = Self::parts_of(text)?;
        Some(AttachmentKey::new(
            namespace.into(),
            vm.into(),
            interface.into(),
        ))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attachment {
    /// `metadata.labels`: what NetworkPolicy selectors match.
    pub labels: label_selector::Labels,
    /// Named ports the endpoint declares (`spec.ports`), for policies that
    /// name a port.
    pub ports: NamedPorts,
    pub key: AttachmentKey,
    /// Names: the network and node are every VM's of them, and KubeVirt
    /// names a VM's pod interface by its network alone (a hash of it), so
    /// every VM of a network has the same port name on its node.
    pub network: Name,
    pub node: Name,
    pub port: Name,
    pub mac: Option<[u8; 6]>,
    pub mac_policy: MacPolicy,
    /// A boxed slice: no capacity word.
    pub ips: Box<[IpNet]>,
    /// Boxed: few VMs migrate at a time, and every Attachment would
    /// carry its room.
    pub migration: Option<Box<Migration>>,
    pub source: DocRef,
}

// Every VM interface of the cluster is an `Arc<Attachment>`: with the
// `Arc`'s two counts it takes the allocator's 160-byte class (192 before
// its addresses, ports, file and origin were each a word thinner, 224
// before names were one word and the source's label boxed, 256 before the
// boxed fields above). A field that grows it should be boxed.
const _: () = assert!(std::mem::size_of::<Attachment>() + 16 <= 160);
const _: () = assert!(std::mem::size_of::<DocRef>() <= 56);

impl Attachment {
    /// `metadata.name` (its source's: one copy).
    pub fn name(&self) -> &str {
        &self.source.name
    }

    /// The node the VM runs on as the documents say: the target once
    /// cut-over is signalled (`migration.ready`). What this round runs is
    /// `resolved::Attachment::active_node`.
    pub fn signalled_node(&self) -> &str {
        match &self.migration {
            Some(m) if m.ready => &m.target_node,
            _ => &self.node,
        }
    }

    /// [`signalled_node`](Self::signalled_node) and
    /// [`signalled_port`](Self::signalled_port) as names: the
    /// Attachment's own where no cut-over is signalled.
    pub fn signalled_names(&self) -> (Name, Name) {
        match &self.migration {
            Some(m) if m.ready => (
                Name::new(self.signalled_node()),
                Name::new(self.signalled_port()),
            ),
            _ => (self.node.clone(), self.port.clone()),
        }
    }

    /// The host-side port on the signalled node.
    pub fn signalled_port(&self) -> &str {
        match &self.migration {
            Some(m) if m.ready => m.target_port.as_deref().unwrap_or(&self.port),
            _ => &self.port,
        }
    }
}

/// A port an endpoint declares by name (as a container port).
/// An Attachment's named ports: one word, none allocated for the many
/// that declare none.
pub type NamedPorts = crate::sys::thin_slice::ThinSlice<NamedPort>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NamedPort {
    pub name: String,
    pub port: u16,
    /// IP protocol number.
    pub protocol: u8,
}

/// A set of VM interfaces with a version that changes whenever the set
/// does (never to one it had): a reader that kept the version it last saw
/// knows the set is the same without comparing its keys (IPAM's memo, on
/// every round, at 10,000 VM interfaces).
///
/// A persistent set: IPAM's memo keeps the set of the round it decided
/// beside the config's, and a copy shares every path the two have in
/// common (a `BTreeSet` copied was 140 bytes per VM interface of the
/// cluster, for as long as the agent ran).
#[derive(Clone, Default)]
pub struct Keys {
    set: imbl::OrdSet<AttachmentKey>,
    version: u64,
    /// The last changes, oldest first: the version each started from and
    /// the key it added or removed. A reader at one of those versions
    /// reads what changed since (IPAM's memo, when a VM interface came or
    /// went) instead of comparing every key. At most [`KEYS_LOG`].
    log: std::collections::VecDeque<(u64, AttachmentKey)>,
}

/// How many changes a [`Keys`] remembers.
const KEYS_LOG: usize = 1024;

/// Versions for [`Keys`]: one counter for all, so no two changes anywhere
/// share one.
static KEYS_VERSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Keys {
    fn changed(&mut self, key: &AttachmentKey) {
        let before = self.version;
        self.version = KEYS_VERSION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.log.len() == KEYS_LOG {
            self.log.pop_front();
        }
        self.log.push_back((before, key.clone()));
    }

    /// The keys added or removed since `version` (each as often as it
    /// changed): `None` when the set does not remember back that far.
    pub fn touched_since(&self, version: u64) -> Option<impl Iterator<Item = &AttachmentKey>> {
        let from = if version == self.version {
            self.log.len()
        } else {
            self.log.iter().position(|(before, _)| *before == version)?
        };
        Some(self.log.range(from..).map(|(_, key)| key))
    }

    /// This content's version: equal versions, equal sets.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The copy of `key` the set holds, if it holds it, else `key`: an
    /// Attachment shares the key its VMI's translation put here.
    pub fn shared(&self, key: AttachmentKey) -> AttachmentKey {
        self.set.get(&key).cloned().unwrap_or(key)
    }

    pub fn insert(&mut self, key: AttachmentKey) -> bool {
        if self.set.contains(&key) {
            return false;
        }
        self.changed(&key);
        self.set.insert(key);
        true
    }

    pub fn remove(&mut self, key: &AttachmentKey) -> bool {
        let removed = self.set.remove(key).is_some();
        if removed {
            self.changed(key);
        }
        removed
    }
}

impl Serialize for Keys {
    /// As the set (the version and log are no part of what it says).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.set.iter())
    }
}

impl Keys {
    /// The same set and version without the log: what a reader keeps to
    /// compare the next version with (shares the set's paths).
    pub fn without_log(&self) -> Keys {
        Keys {
            set: self.set.clone(),
            version: self.version,
            log: Default::default(),
        }
    }
}

impl fmt::Debug for Keys {
    /// As the set (the version is no part of what it says).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.set.fmt(f)
    }
}

impl std::ops::Deref for Keys {
    type Target = imbl::OrdSet<AttachmentKey>;
    fn deref(&self) -> &Self::Target {
        &self.set
    }
}

impl Extend<AttachmentKey> for Keys {
    fn extend<I: IntoIterator<Item = AttachmentKey>>(&mut self, iter: I) {
        for key in iter {
            self.insert(key);
        }
    }
}

impl FromIterator<AttachmentKey> for Keys {
    fn from_iter<I: IntoIterator<Item = AttachmentKey>>(iter: I) -> Self {
        let mut keys = Keys::default();
        keys.extend(iter);
        keys
    }
}

impl PartialEq for Keys {
    /// The sets: the version says only whether a set changed.
    fn eq(&self, other: &Self) -> bool {
        self.set == other.set
    }
}

impl Eq for Keys {}

/// A VM's or a plain pod's group: (namespace, name). Its Attachments'
/// keys carry the same pair. Names: its objects' own, shared.
pub type GroupKey = (crate::sys::intern::Name, crate::sys::intern::Name);

/// Where the VM interfaces of VM `group` (namespace, VM) lie in `list`,
/// a list in key order: the range the incremental stages replace or
/// carry as one.
pub fn group_range<T: std::ops::Deref<Target = Attachment>>(
    list: &[T],
    group: &GroupKey,
) -> std::ops::Range<usize> {
    group_range_by(list, group, |t| &t.key)
}

/// [`group_range`] of a list of anything with a VM interface's `key`
/// (a resolved list's entries).
pub fn group_range_by<T>(
    list: &[T],
    group: &GroupKey,
    key: impl Fn(&T) -> &AttachmentKey,
) -> std::ops::Range<usize> {
    let want = (group.0.as_str(), group.1.as_str());
    let part = |t: &T| {
        let k = key(t);
        (k.namespace.as_str(), k.vm.as_str()).cmp(&want)
    };
    let start = list.partition_point(|t| part(t).is_lt());
    start..start + list[start..].partition_point(|t| part(t).is_eq())
}

/// The groups (namespace, VM) a partial pass replaced.
pub type SplicedGroups = std::sync::Arc<std::collections::BTreeSet<GroupKey>>;

/// Where a validated config came from: what lets the stages after
/// validation carry over what did not change without a look at every VM
/// interface of the cluster.
#[derive(Debug, Clone, Default)]
pub struct Lineage {
    /// Unique to each config a pass made (0: not known).
    pub version: u64,
    /// Made from config `.0` with only the VM interfaces of the groups
    /// `.1` (namespace, VM) replaced: a partial pass.
    pub spliced_from: Option<(u64, SplicedGroups)>,
}

impl Lineage {
    fn next_version() -> u64 {
        static VERSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        VERSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// A config made whole.
    pub fn fresh() -> Self {
        Lineage {
            version: Self::next_version(),
            spliced_from: None,
        }
    }

    /// A config made from config `from` (0: not known, then fresh) with
    /// the VM interfaces of `groups` replaced.
    pub fn spliced(from: u64, groups: &std::collections::BTreeSet<GroupKey>) -> Self {
        Lineage {
            version: Self::next_version(),
            spliced_from: (from != 0).then(|| (from, std::sync::Arc::new(groups.clone()))),
        }
    }
}

/// The validated configuration: only documents that passed every check.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Config {
    /// This agent's node (`--node`), whether or not a Node document names
    /// it.
    pub node_name: String,
    pub node: Option<Node>,
    /// Every valid Node document by name, this node's included: the overlay
    /// needs the other nodes' VTEP addresses.
    pub nodes: std::collections::BTreeMap<String, Node>,
    pub networks: Vec<Network>,
    pub attachments: Vec<std::sync::Arc<Attachment>>,
    pub errors: Vec<ConfigError>,
    /// Accepted documents with something the operator should know (a
    /// subnet's reserved address used on an IPAM-less network).
    pub warnings: Vec<ConfigError>,
    /// Every VM interface some Attachment document names, refused ones
    /// included: a claim is released only when its document is gone.
    pub keys_in_documents: Keys,
    /// Labels of the namespaces `v1 Namespace` documents describe.
    pub namespaces: std::collections::BTreeMap<String, label_selector::Labels>,
    /// `networking.k8s.io/v1 NetworkPolicy` documents, by namespace and name.
    pub policies: Vec<network_policy::NetworkPolicy>,
    /// `v1 Service` documents with a ClusterIP, by namespace and name.
    pub services: Vec<service::Service>,
    /// `discovery.k8s.io/v1 EndpointSlice` documents naming a Service.
    pub endpoint_slices: Vec<service::EndpointSlice>,
    /// The cluster's own pod and Service CIDRs (flags, v1 Nodes): what an
    /// endpoint of a Primary network reaches through the node's stack.
    pub cluster_cidrs: Vec<ClusterCidr>,
    #[serde(skip)]
    pub network_index: crate::sys::hash::HashMap<String, usize>,
    #[serde(skip)]
    pub lineage: Lineage,
}

impl Config {
    /// The network called `name`; O(1) once `index_networks` ran (every
    /// attachment asks for its network, so a scan would be quadratic).
    pub fn network(&self, name: &str) -> Option<&Network> {
        match self.network_index.get(name) {
            Some(i) => self.networks.get(*i),
            None if self.network_index.is_empty() => self.networks.iter().find(|n| n.name == name),
            None => None,
        }
    }

    /// A namespace's labels: those of its Namespace document, and the
    /// name label Kubernetes gives every namespace.
    pub fn namespace_labels(&self, namespace: &str) -> label_selector::Labels {
        let mut labels = self.namespaces.get(namespace).cloned().unwrap_or_default();
        labels.insert(
            label_selector::NAMESPACE_NAME_LABEL.to_string(),
            namespace.to_string(),
        );
        labels
    }

    /// Rebuilds the name -> network index after `networks` changed.
    pub fn index_networks(&mut self) {
        self.network_index = self
            .networks
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i))
            .collect();
    }
}

pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    if parts.len() != 6 {
        return Err(format!("{s:?} is not a MAC address (six hex bytes)"));
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(format!("{s:?} is not a MAC address (six hex bytes)"));
        }
        mac[i] = u8::from_str_radix(p, 16)
            .map_err(|_| format!("{s:?} is not a MAC address (six hex bytes)"))?;
    }
    Ok(mac)
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(vm: &str) -> AttachmentKey {
        AttachmentKey::parse(&format!("prod/{vm}/eth0")).unwrap()
    }

    /// A change gives a version no set had; no change and a copy keep it;
    /// two sets built apart never share one.
    #[test]
    fn a_key_sets_version_changes_with_it_and_only_with_it() {
        let mut a: Keys = [key("vm1"), key("vm2")].into_iter().collect();
        let b: Keys = [key("vm1"), key("vm2")].into_iter().collect();
        assert_eq!(a, b);
        assert_ne!(a.version(), b.version(), "built apart");
        let copy = a.clone();
        assert_eq!(copy.version(), a.version());
        let v = a.version();
        assert!(!a.insert(key("vm1")));
        assert!(!a.remove(&key("vm9")));
        assert_eq!(a.version(), v, "nothing changed");
        assert!(a.insert(key("vm3")));
        let after_insert = a.version();
        assert_ne!(after_insert, v);
        assert!(a.remove(&key("vm3")));
        assert_ne!(a.version(), after_insert);
        assert_ne!(a.version(), v, "the same keys again, a new version");
        let mirror = copy;
        // What changed since the copy: vm3, twice.
        let touched: Vec<_> = a.touched_since(mirror.version()).unwrap().collect();
        assert_eq!(touched, [&key("vm3"), &key("vm3")]);
        assert_eq!(a.touched_since(a.version()).unwrap().count(), 0);
        assert!(
            a.touched_since(b.version()).is_none(),
            "another set's version"
        );
        // A reader's copy: the set and version, shared, without the log.
        let mirror = a.without_log();
        assert_eq!(mirror.version(), a.version());
        assert!(mirror == a);
        assert!(
            mirror.touched_since(v).is_none(),
            "a copy remembers no changes"
        );
        // It remembers the last changes only.
        let v = a.version();
        for i in 0..KEYS_LOG {
            a.insert(key(&format!("x{i}")));
        }
        assert_eq!(a.touched_since(v).unwrap().count(), KEYS_LOG);
        a.insert(key("one-more"));
        assert!(a.touched_since(v).is_none());
    }
}
