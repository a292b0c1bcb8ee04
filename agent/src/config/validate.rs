//! Turns raw documents into a [`Config`], refusing bad ones one by one.

use crate::sys::intern::Name;
use crate::sys::ip_map::IpMap;
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use serde::de::DeserializeOwned;
use vmpath_common::{default_gateway_mac, slow_class};

use super::{
    Attachment, AttachmentKey, Config, ConfigError, DocRef, KeepFirst, Network, Node,
    label_selector::Labels,
    model::{
        API_VERSION, AttachmentSpec, CORE_API_VERSION, IpamMode, Metadata, NetworkSpec, NodeSpec,
        RateLimit, SlowPathLimitsSpec,
    },
    parse_mac,
    source::RawDocument,
};
use crate::sys::hash::HashMap;

const MAX_NETWORK_ID: u32 = (1 << 24) - 1;
const DEFAULT_MTU: u16 = 1500;
/// Linux's ifname limit (IFNAMSIZ - 1).
const MAX_IFNAME: usize = 15;

struct Doc<'a> {
    raw: &'a RawDocument,
    kind: String,
    meta: Metadata,
}

impl Doc<'_> {
    fn label(&self) -> String {
        super::document_label(
            &self.kind,
            self.meta.namespace.as_deref(),
            &self.meta.name,
            &self.raw.origin,
        )
    }
    fn error(&self, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.raw.file.to_path_buf(),
            document: self.label(),
            field: field.to_string(),
            message: message.into(),
            about: self.raw.origin.about(),
            reason: None,
        }
    }
    /// The document's reference, for one of the kinds kept with it.
    fn source(&self, kind: super::DocKind) -> DocRef {
        debug_assert_eq!(self.kind, kind.as_str());
        DocRef {
            file: self.raw.file.clone(),
            kind,
            namespace: self.meta.namespace.as_deref().map(Name::new),
            name: self.meta.name.as_str().into(),
            origin: self.raw.origin.clone(),
        }
    }
    /// Deserializes `spec`, naming the failing field by its path.
    fn spec<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        let spec = self
            .raw
            .value
            .get("spec")
            .cloned()
            .ok_or_else(|| self.error("spec", "missing"))?;
        serde_path_to_error::deserialize(spec).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                "spec".to_string()
            } else {
                format!("spec.{path}")
            };
            self.error(&field, e.into_inner().to_string())
        })
    }
}

/// The documents validation reads, and what translation found.
#[derive(Debug, Default)]
pub struct Translated {
    /// vmpath documents as given, then the derived ones.
    pub documents: Vec<RawDocument>,
    /// Every VM interface a VMI names on a vmpath network: its claim stays
    /// while the VMI exists, with or without a pod.
    pub keep: BTreeSet<AttachmentKey>,
    pub errors: Vec<ConfigError>,
    /// VM interfaces held back until their IPAMClaim has addresses (the
    /// controller writes them): reported as warnings, on the CNI port's
    /// source where there is one, so the plugin's ADD names the wait.
    pub waiting: Vec<ConfigError>,
    /// The cluster's pod and Service CIDRs: the agent's flags and what v1
    /// Nodes report (`spec.podCIDRs`). A Primary network may not overlap
    /// any.
    pub cluster_cidrs: Vec<super::ClusterCidr>,
}

/// Who holds an address or MAC on a network, as recorded outside the
/// documents, in order of evidence: the claims store (by network name,
/// the VM interface `namespace/vm/interface`), then the ports the data
/// path serves on this node now (by network id, the port's name; after a
/// restart, what the previous agent programmed).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Held {
    /// The claims store's part, shared: rounds whose ports changed but
    /// not the store's claims take it as it was (10,000 claims were a
    /// map of 10,000 built again on every CNI ADD).
    /// (network, address) -> the claim's key (`namespace/vm/interface`);
    /// names, shared with the claims and each other.
    pub ips: std::sync::Arc<IpMap<Name, Name>>,
    pub macs: std::sync::Arc<HashMap<(Name, [u8; 6]), Name>>,
    /// Claims the store recorded since `ips` and `macs` were built, kept
    /// beside them (pairs neither has), so a new claim does not copy the
    /// map of every claim of the cluster (`Round::held`).
    pub ips_added: IpMap<Name, Name>,
    pub macs_added: HashMap<(Name, [u8; 6]), Name>,
    pub port_ips: HashMap<(u32, IpAddr), String>,
    pub port_macs: HashMap<(u32, [u8; 6]), String>,
}

impl Held {
    /// The VM interface the claims store gives `ip` on network `net`.
    /// (`net` a name: the key is made without a look in the names' table.)
    pub fn stored_ip(&self, net: &Name, ip: IpAddr) -> Option<&Name> {
        self.ips_added
            .get(net, &ip)
            .or_else(|| self.ips.get(net, &ip))
    }

    /// The VM interface the claims store gives `mac` on network `net`.
    pub fn stored_mac(&self, net: &Name, mac: [u8; 6]) -> Option<&Name> {
        let key = (net.clone(), mac);
        self.macs_added.get(&key).or_else(|| self.macs.get(&key))
    }
}

/// Validates every document: vmpath's own and those derived from
/// Kubernetes objects (`translated`, the derive stage's output; the
/// `round` module chains the two). `read_errors`: what reading found.
/// `keep_first` lists attachments accepted by the previous round: in a
/// conflict they win, so a running VM is never the one refused; an address
/// or MAC `held` records for one VM interface stays with it whatever order
/// the documents come in (after a restart `keep_first` is empty): another
/// Attachment asking for it is refused.
pub fn validate_documents(
    read_errors: &[ConfigError],
    translated: Translated,
    node_name: &str,
    keep_first: &dyn KeepFirst,
    held: &Held,
) -> Config {
    let mut cfg = Config {
        node_name: node_name.to_string(),
        errors: read_errors.to_vec(),
        ..Default::default()
    };
    cfg.errors.extend(translated.errors);
    cfg.keys_in_documents
        .extend(translated.keep.into_iter().map(|k| keep_first.shared(k)));
    let waiting = translated.waiting;
    let cluster_cidrs = translated.cluster_cidrs;
    let mut nodes = Vec::new();
    let mut networks = Vec::new();
    let mut attachments = Vec::new();
    let mut namespaces = Vec::new();
    let mut policies = Vec::new();
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for raw in &translated.documents {
        match header(raw) {
            Ok(doc) => match doc.kind.as_str() {
                "Node" => nodes.push(doc),
                "Network" => networks.push(doc),
                "Attachment" => attachments.push(doc),
                "Namespace" => namespaces.push(doc),
                super::network_policy::KIND => policies.push(doc),
                super::service::SERVICE_KIND => services.push(doc),
                super::service::SLICE_KIND => slices.push(doc),
                other => cfg.errors.push(doc.error(
                    "kind",
                    format!(
                        "unknown kind {other:?} (expected Node, Network or Attachment, or a \
                         Kubernetes kind: v1 Pod, Node, Namespace, Service or List, \
                         discovery.k8s.io EndpointSlice, networking.k8s.io NetworkPolicy, kubevirt.io \
                         VirtualMachineInstance or VirtualMachineInstanceMigration, \
                         k8s.cni.cncf.io NetworkAttachmentDefinition or IPAMClaim)"
                    ),
                )),
            },
            Err(e) => cfg.errors.push(e),
        }
    }

    let parsed: Vec<(&Doc, Result<Node, ConfigError>)> =
        nodes.iter().map(|doc| (doc, node(doc))).collect();
    // The overlay runs over one underlay family: this node's. A Node of
    // the other family could neither send to this one nor be sent to.
    let own = parsed
        .iter()
        .find_map(|(_, n)| n.as_ref().ok().filter(|n| n.name == node_name))
        .map(|n| n.address);
    for (doc, n) in parsed {
        match n {
            Ok(n) => {
                if let Some(own) = own
                    && n.name != node_name
                    && own.is_ipv6() != n.address.is_ipv6()
                {
                    cfg.errors.push(doc.error(
                        "spec.address",
                        format!(
                            "node {:?} has an {} underlay address ({}), but this node {node_name:?} has an {} one ({own}): \
                             the overlay runs over one family, so nodes {:?} and {node_name:?} cannot reach each other; \
                             give every node an address of the same family",
                            n.name,
                            family_name(n.address),
                            n.address,
                            family_name(own),
                            n.name,
                        ),
                    ));
                    continue;
                }
                if n.name == node_name {
                    cfg.node = Some(n.clone());
                }
                cfg.nodes.insert(n.name.clone(), n);
            }
            Err(e) => cfg.errors.push(e),
        }
    }

    for doc in &namespaces {
        match namespace_labels(doc) {
            Ok(_) if cfg.namespaces.contains_key(&doc.meta.name) => {
                cfg.errors.push(doc.error(
                    "metadata.name",
                    format!("namespace {:?} is defined twice", doc.meta.name),
                ));
            }
            Ok(labels) => {
                cfg.namespaces.insert(doc.meta.name.clone(), labels);
            }
            Err(e) => cfg.errors.push(e),
        }
    }

    // Each kind's (namespace, name)s accepted so far: a document defined
    // twice is refused (a set, not a search of the accepted per document).
    let mut seen_policies = crate::sys::hash::HashSet::default();
    let mut seen_endpoint_slices = crate::sys::hash::HashSet::default();
    let mut seen_services = crate::sys::hash::HashSet::default();
    for doc in &policies {
        match network_policy(doc) {
            Ok(p) if !seen_policies.insert((p.namespace.clone(), p.name.clone())) => {
                cfg.errors.push(doc.error(
                    "metadata.name",
                    format!("NetworkPolicy {}/{} is defined twice", p.namespace, p.name),
                ));
            }
            Ok(p) => cfg.policies.push(p),
            Err(e) => cfg.errors.push(e),
        }
    }
    cfg.policies
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));

    for doc in &slices {
        match endpoint_slice(doc) {
            Ok(Some(s)) if !seen_endpoint_slices.insert((s.namespace.clone(), s.name.clone())) => {
                cfg.errors.push(doc.error(
                    "metadata.name",
                    format!("EndpointSlice {}/{} is defined twice", s.namespace, s.name),
                ));
            }
            Ok(Some(s)) => cfg.endpoint_slices.push(s),
            Ok(None) => {}
            Err(e) => cfg.errors.push(e),
        }
    }
    cfg.endpoint_slices
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));

    let mut ids: HashMap<u32, String> = HashMap::default();
    let mut names: BTreeSet<String> = BTreeSet::new();
    for doc in &networks {
        match network(doc) {
            Ok(n) => {
                if !names.insert(n.name.clone()) {
                    cfg.errors.push(doc.error(
                        "metadata.name",
                        format!("network {:?} is defined twice", n.name),
                    ));
                } else if let Some(other) = ids.get(&n.id) {
                    cfg.errors.push(doc.error(
                        "spec.id",
                        format!("id {} is already used by network {other:?}", n.id),
                    ));
                } else if let Some((field, message)) =
                    primary_overlap(&n, &cfg, &cluster_cidrs).or_else(|| ingress_overlap(&n, &cfg))
                {
                    cfg.errors.push(doc.error(&field, message));
                } else {
                    ids.insert(n.id, n.name.clone());
                    cfg.networks.push(n);
                }
            }
            Err(e) => cfg.errors.push(e),
        }
    }

    for doc in &attachments {
        if let Some(key) = document_key(doc) {
            cfg.keys_in_documents.insert(keep_first.shared(key));
        }
    }
    cfg.index_networks();
    let mut parsed: Vec<(Attachment, &Doc)> = Vec::new();
    for doc in &attachments {
        match attachment(doc, &cfg) {
            Ok(a) => parsed.push((a, doc)),
            Err(e) => cfg.errors.push(e),
        }
    }
    // An address or MAC the claims store gives to one of these attachments
    // stays with it (unless its document now asks for other ones): every
    // other asking for it is refused, before document order can decide.
    let by_key: HashMap<String, &Attachment> =
        parsed.iter().map(|(a, _)| (a.key.to_string(), a)).collect();
    let keeps_ip = |holder: &str, net: &str, ip: IpAddr| {
        by_key.get(holder).is_some_and(|o| {
            o.network == net && (o.ips.is_empty() || o.ips.iter().any(|n| n.addr() == ip))
        })
    };
    let keeps_mac = |holder: &str, net: &str, mac: [u8; 6]| {
        by_key
            .get(holder)
            .is_some_and(|o| o.network == net && o.mac.is_none_or(|m| m == mac))
    };
    // A running port names its VM interface through the documents: the
    // Attachment on this node with that port (or migrating to it).
    let on_port: HashMap<&str, String> = parsed
        .iter()
        .flat_map(|(a, _)| {
            let here = (a.node == node_name).then_some(a.port.as_str());
            let target = a.migration.as_ref().and_then(|m| {
                (m.target_node == node_name)
                    .then_some(m.target_port.as_deref())
                    .flatten()
            });
            here.into_iter()
                .chain(target)
                .map(|port| (port, a.key.to_string()))
        })
        .collect();
    let network_id: HashMap<&str, u32> = cfg
        .networks
        .iter()
        .map(|n| (n.name.as_str(), n.id))
        .collect();
    // The holder the first evidence names that still asks for it.
    let ip_holder_of = |net: &Name, ip: IpAddr| -> Option<String> {
        let stored = held.stored_ip(net, ip).map(|n| n.to_string());
        let running = network_id
            .get(net.as_str())
            .and_then(|id| held.port_ips.get(&(*id, ip)))
            .and_then(|port| on_port.get(port.as_str()).cloned());
        [stored, running]
            .into_iter()
            .flatten()
            .find(|h| keeps_ip(h, net, ip))
    };
    let mac_holder_of = |net: &Name, mac: [u8; 6]| -> Option<String> {
        let stored = held.stored_mac(net, mac).map(|n| n.to_string());
        let running = network_id
            .get(net.as_str())
            .and_then(|id| held.port_macs.get(&(*id, mac)))
            .and_then(|port| on_port.get(port.as_str()).cloned());
        [stored, running]
            .into_iter()
            .flatten()
            .find(|h| keeps_mac(h, net, mac))
    };
    let mut taken: BTreeSet<usize> = BTreeSet::new();
    for (i, (a, doc)) in parsed.iter().enumerate() {
        let me = a.key.to_string();
        let ip_holder = a.ips.iter().find_map(|ip| {
            ip_holder_of(&a.network, ip.addr())
                .filter(|h| *h != me)
                .map(|h| (ip.addr(), h))
        });
        let error = if let Some((ip, holder)) = ip_holder {
            doc.error(
                "spec.ips",
                format!(
                    "IP {ip} is already held by VM interface {holder} on network {:?}",
                    a.network
                ),
            )
        } else if let Some(mac) = a.mac
            && let Some(holder) = mac_holder_of(&a.network, mac).filter(|h| *h != me)
        {
            doc.error(
                "spec.mac",
                format!(
                    "MAC {} is already held by VM interface {holder} on network {:?}",
                    super::format_mac(&mac),
                    a.network
                ),
            )
        } else {
            continue;
        };
        cfg.errors.push(error);
        taken.insert(i);
    }
    drop((by_key, on_port));
    let mut i = 0;
    parsed.retain(|_| {
        i += 1;
        !taken.contains(&(i - 1))
    });
    // Attachments that were running go first, so they keep what they hold.
    parsed.sort_by_key(|(a, _)| !keep_first.keeps(&a.key));
    let mut seen_keys: BTreeMap<AttachmentKey, String> = BTreeMap::new();
    let mut macs: HashMap<(String, [u8; 6]), String> = HashMap::default();
    let mut ips: HashMap<(String, IpAddr), String> = HashMap::default();
    let mut ports: HashMap<(String, String), String> = HashMap::default();
    for (a, doc) in parsed {
        let me = format!("Attachment {}/{}", a.key.namespace, a.name());
        if let Some(other) = seen_keys.get(&a.key) {
            cfg.errors.push(doc.error(
                "spec.interface",
                format!("VM interface {} is already attached by {other}", a.key),
            ));
            continue;
        }
        if let Some(mac) = a.mac
            && let Some(other) = macs.get(&(a.network.to_string(), mac))
        {
            cfg.errors.push(doc.error(
                "spec.mac",
                format!(
                    "MAC {} collides with {other} on network {:?}",
                    super::format_mac(&mac),
                    a.network
                ),
            ));
            continue;
        }
        if let Some((ip, other)) = a.ips.iter().find_map(|ip| {
            ips.get(&(a.network.to_string(), ip.addr()))
                .map(|o| (ip.addr(), o))
        }) {
            cfg.errors.push(doc.error(
                "spec.ips",
                format!(
                    "IP {ip} is already used by {other} on network {:?}",
                    a.network
                ),
            ));
            continue;
        }
        if let Some(other) = ports.get(&(
            a.signalled_node().to_string(),
            a.signalled_port().to_string(),
        )) {
            cfg.errors.push(doc.error(
                "spec.port",
                format!(
                    "port {:?} on node {:?} is already used by {other}",
                    a.signalled_port(),
                    a.signalled_node()
                ),
            ));
            continue;
        }
        seen_keys.insert(a.key.clone(), me.clone());
        if let Some(mac) = a.mac {
            macs.insert((a.network.to_string(), mac), me.clone());
        }
        for ip in &a.ips {
            ips.insert((a.network.to_string(), ip.addr()), me.clone());
        }
        ports.insert(
            (
                a.signalled_node().to_string(),
                a.signalled_port().to_string(),
            ),
            me,
        );
        cfg.attachments.push(std::sync::Arc::new(a));
    }
    // After the attachments and networks: a ClusterIP must not be an
    // address a VM has or may get (a guest routing it through its gateway
    // would reach the Service's backend instead of the VM).
    // Every attachment's addresses, to the first attachment holding each.
    let mut attachment_by_ip: crate::sys::hash::HashMap<std::net::IpAddr, usize> =
        crate::sys::hash::HashMap::default();
    for (i, a) in cfg.attachments.iter().enumerate() {
        for n in &a.ips {
            attachment_by_ip.entry(n.addr()).or_insert(i);
        }
    }
    for doc in &services {
        match service(doc).and_then(|s| match s {
            Some(s) => clusterip_taken(doc, &s, &cfg, &attachment_by_ip).map(|()| Some(s)),
            None => Ok(None),
        }) {
            Ok(Some(s)) if !seen_services.insert((s.namespace.clone(), s.name.clone())) => {
                cfg.errors.push(doc.error(
                    "metadata.name",
                    format!("Service {}/{} is defined twice", s.namespace, s.name),
                ));
            }
            Ok(Some(s)) => cfg.services.push(s),
            Ok(None) => {}
            Err(e) => cfg.errors.push(e),
        }
    }
    cfg.services
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    cfg.attachments.sort_by(|x, y| x.key.cmp(&y.key));
    cfg.warnings = super::reserved::warnings(&cfg);
    cfg.warnings.extend(waiting);
    cfg.cluster_cidrs = cluster_cidrs;
    cfg
}

/// Refuses a Service whose ClusterIP is a VM's address or inside a
/// network's subnet, naming which.
fn clusterip_taken(
    doc: &Doc,
    s: &super::service::Service,
    cfg: &Config,
    attachment_by_ip: &crate::sys::hash::HashMap<std::net::IpAddr, usize>,
) -> Result<(), ConfigError> {
    let field = if doc
        .raw
        .value
        .get("spec")
        .and_then(|v| v.get("clusterIPs"))
        .is_some()
    {
        "spec.clusterIPs"
    } else {
        "spec.clusterIP"
    };
    for (i, ip) in s.cluster_ips.iter().enumerate() {
        let me = format!("Service {}/{}: ClusterIP {ip}", s.namespace, s.name);
        if let Some(a) = attachment_by_ip.get(ip).map(|&i| &cfg.attachments[i]) {
            return Err(doc.error(
                &format!("{field}[{i}]"),
                format!(
                    "{me} is the address of Attachment {}/{} (VM {}) on network {:?}",
                    a.key.namespace,
                    a.name(),
                    a.key.vm,
                    a.network
                ),
            ));
        }
        if let Some((net, subnet)) = cfg.networks.iter().find_map(|n| {
            n.subnets
                .iter()
                .find(|sub| sub.contains(ip))
                .map(|sub| (n, sub))
        }) {
            return Err(doc.error(
                &format!("{field}[{i}]"),
                format!(
                    "{me} is inside subnet {subnet} of network {:?}, where VMs have their addresses",
                    net.name
                ),
            ));
        }
    }
    Ok(())
}

/// The VM interface an Attachment document names, read leniently so that
/// a document refused for another reason still protects its claim.
fn document_key(doc: &Doc) -> Option<AttachmentKey> {
    let spec = doc.raw.value.get("spec")?;
    Some(AttachmentKey::new(
        doc.meta.namespace.clone()?.into(),
        spec.get("vm")?.as_str()?.into(),
        spec.get("interface")?.as_str()?.into(),
    ))
}

fn header(raw: &RawDocument) -> Result<Doc<'_>, ConfigError> {
    let anonymous = |field: &str, message: String| ConfigError {
        file: raw.file.to_path_buf(),
        document: format!("document {}", raw.index),
        field: field.to_string(),
        message,
        about: raw.origin.about(),
        reason: None,
    };
    if !raw.value.is_object() {
        return Err(anonymous(
            "",
            "a document must be a mapping with apiVersion, kind, metadata and spec".into(),
        ));
    }
    let kind = raw
        .value
        .get("kind")
        .and_then(|k| k.as_str())
        .ok_or_else(|| anonymous("kind", "missing".into()))?
        .to_string();
    let meta: Metadata = match raw.value.get("metadata") {
        Some(m) => serde_path_to_error::deserialize(m.clone()).map_err(|e| {
            anonymous(
                &format!("metadata.{}", e.path()),
                e.into_inner().to_string(),
            )
        })?,
        None => return Err(anonymous("metadata", "missing".into())),
    };
    let doc = Doc { raw, kind, meta };
    match raw.value.get("apiVersion").and_then(|v| v.as_str()) {
        Some(super::network_policy::API_VERSION) if doc.kind == super::network_policy::KIND => {}
        Some(other) if doc.kind == super::network_policy::KIND => {
            return Err(doc.error(
                "apiVersion",
                format!(
                    "{other:?} is not {:?} (a Kubernetes NetworkPolicy)",
                    super::network_policy::API_VERSION
                ),
            ));
        }
        Some(super::service::SERVICE_API_VERSION) if doc.kind == super::service::SERVICE_KIND => {}
        Some(super::service::SLICE_API_VERSION) if doc.kind == super::service::SLICE_KIND => {}
        Some(other)
            if doc.kind == super::service::SERVICE_KIND
                || doc.kind == super::service::SLICE_KIND =>
        {
            let want = if doc.kind == super::service::SERVICE_KIND {
                super::service::SERVICE_API_VERSION
            } else {
                super::service::SLICE_API_VERSION
            };
            return Err(doc.error(
                "apiVersion",
                format!("{other:?} is not {want:?} (a Kubernetes {})", doc.kind),
            ));
        }
        Some(API_VERSION) if doc.kind != "Namespace" => {}
        Some(CORE_API_VERSION) if doc.kind == "Namespace" => {}
        Some(other) if doc.kind == "Namespace" => {
            return Err(doc.error(
                "apiVersion",
                format!("{other:?} is not {CORE_API_VERSION:?} (a Kubernetes Namespace)"),
            ));
        }
        Some(other) => {
            return Err(doc.error("apiVersion", format!("{other:?} is not {API_VERSION:?}")));
        }
        None => return Err(doc.error("apiVersion", "missing")),
    }
    if let Some(m) = raw.value.as_object() {
        for k in m.keys() {
            let k = k.as_str();
            let slice_field = doc.kind == super::service::SLICE_KIND
                && matches!(k, "addressType" | "endpoints" | "ports");
            if !slice_field && !matches!(k, "apiVersion" | "kind" | "metadata" | "spec" | "status")
            {
                return Err(doc.error(k, "unknown top-level field"));
            }
        }
    }
    if doc.meta.name.is_empty() {
        return Err(doc.error("metadata.name", "missing"));
    }
    Ok(doc)
}

fn family_name(a: std::net::IpAddr) -> &'static str {
    if a.is_ipv6() { "IPv6" } else { "IPv4" }
}

fn node(doc: &Doc) -> Result<Node, ConfigError> {
    let spec: NodeSpec = doc.spec()?;
    Ok(Node {
        name: doc.meta.name.clone(),
        address: spec.address,
        snat_address: spec.snat_address,
        snat_address6: spec.snat_address6,
    })
}

/// A `v1 Namespace`: its labels (string values, as Kubernetes has them).
fn namespace_labels(doc: &Doc) -> Result<Labels, ConfigError> {
    string_labels(doc)
}

/// A document's `metadata.labels`, every value a string.
fn string_labels(doc: &Doc) -> Result<Labels, ConfigError> {
    // Collected whole: inserted one by one, the list kept the room its
    // growth left (every VM interface of the cluster holds its labels).
    doc.meta
        .labels
        .iter()
        .flatten()
        .map(|(k, v)| match v.as_str() {
            Some(v) => Ok((k.as_str(), v)),
            None => Err(doc.error(
                &format!("metadata.labels.{k}"),
                format!("{v} is not a string (label values are strings)"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|pairs| pairs.into_iter().collect())
}

fn network_policy(doc: &Doc) -> Result<super::network_policy::NetworkPolicy, ConfigError> {
    let Some(namespace) = doc.meta.namespace.as_deref() else {
        return Err(doc.error(
            "metadata.namespace",
            "missing (a NetworkPolicy is namespaced)",
        ));
    };
    let spec: super::network_policy::NetworkPolicySpec = doc.spec()?;
    super::network_policy::check(namespace, &doc.meta.name, spec)
        .map_err(|(field, m)| doc.error(&format!("spec.{field}"), m))
}

fn service(doc: &Doc) -> Result<Option<super::service::Service>, ConfigError> {
    let Some(namespace) = doc.meta.namespace.as_deref() else {
        return Err(doc.error("metadata.namespace", "missing (a Service is namespaced)"));
    };
    let spec: super::service::ServiceSpec = doc.spec()?;
    super::service::check_service(namespace, &doc.meta.name, spec)
        .map_err(|(field, m)| doc.error(&format!("spec.{field}"), m))
}

fn endpoint_slice(doc: &Doc) -> Result<Option<super::service::EndpointSlice>, ConfigError> {
    let Some(namespace) = doc.meta.namespace.as_deref() else {
        return Err(doc.error(
            "metadata.namespace",
            "missing (an EndpointSlice is namespaced)",
        ));
    };
    let labels = string_labels(doc)?;
    let spec: super::service::SliceSpec =
        serde_path_to_error::deserialize((*doc.raw.value).clone())
            .map_err(|e| doc.error(&e.path().to_string(), e.into_inner().to_string()))?;
    let service = labels.get(super::service::SERVICE_NAME_LABEL);
    super::service::check_slice(namespace, &doc.meta.name, service.map(|s| s.as_str()), spec)
        .map_err(|(field, m)| doc.error(&field, m))
}

fn network(doc: &Doc) -> Result<Network, ConfigError> {
    let spec: NetworkSpec = doc.spec()?;
    if spec.id == 0 || spec.id > MAX_NETWORK_ID {
        return Err(doc.error(
            "spec.id",
            format!("{} is outside 1..={MAX_NETWORK_ID}", spec.id),
        ));
    }
    for (i, s) in spec.subnets.iter().enumerate() {
        if s.trunc() != *s {
            return Err(doc.error(
                &format!("spec.subnets[{i}]"),
                format!("{s} has host bits set (did you mean {}?)", s.trunc()),
            ));
        }
    }
    let mut seen_family = [false; 2];
    for (i, gw) in spec.default_gateway_ips.iter().enumerate() {
        let field = format!("spec.defaultGatewayIPs[{i}]");
        let fam = usize::from(gw.is_ipv6());
        if seen_family[fam] {
            return Err(doc.error(&field, "at most one gateway per address family"));
        }
        seen_family[fam] = true;
        let Some(subnet) = spec.subnets.iter().find(|s| s.contains(gw)) else {
            return Err(doc.error(
                &field,
                format!("{gw} is outside every subnet of the network"),
            ));
        };
        if gw == &subnet.network()
            || (gw.is_ipv4() && gw == &subnet.broadcast() && subnet.prefix_len() < 31)
        {
            return Err(doc.error(
                &field,
                format!("{gw} is the network or broadcast address of {subnet}"),
            ));
        }
    }
    for (i, ex) in spec.exclude_subnets.iter().enumerate() {
        if !spec.subnets.iter().any(|s| s.contains(ex)) {
            return Err(doc.error(
                &format!("spec.excludeSubnets[{i}]"),
                format!("{ex} is outside every subnet of the network"),
            ));
        }
    }
    let ipam = spec.ipam.mode == IpamMode::Enabled;
    if ipam && spec.subnets.is_empty() {
        return Err(doc.error(
            "spec.subnets",
            "ipam.mode Enabled needs at least one subnet",
        ));
    }
    let gateway_mac = match &spec.gateway_mac {
        Some(s) => {
            let mac = parse_mac(s).map_err(|m| doc.error("spec.gatewayMAC", m))?;
            if mac[0] & 1 != 0 || mac == [0; 6] {
                return Err(doc.error("spec.gatewayMAC", format!("{s} is not a unicast MAC")));
            }
            mac
        }
        None => default_gateway_mac(spec.id),
    };
    let mtu = spec.mtu.unwrap_or(DEFAULT_MTU);
    if !(576..=9000).contains(&mtu) {
        return Err(doc.error("spec.mtu", format!("{mtu} is outside 576..=9000")));
    }
    for (i, r) in spec.dhcp.routes.iter().enumerate() {
        if r.destination.trunc() != r.destination {
            return Err(doc.error(
                &format!("spec.dhcp.routes[{i}].destination"),
                format!("{} has host bits set", r.destination),
            ));
        }
        if r.destination.addr().is_ipv4() != r.next_hop.is_ipv4() {
            return Err(doc.error(
                &format!("spec.dhcp.routes[{i}].nextHop"),
                "address family differs from the destination",
            ));
        }
    }
    if ipam && spec.port_security.dhcp_guard == Some(false) {
        return Err(doc.error(
            "spec.portSecurity.dhcpGuard",
            "false is refused where vmpath serves DHCP (ipam.mode Enabled): a VM's DHCP server would race vmpath's",
        ));
    }
    let slow_path_limits = slow_path_limits(doc, &spec.slow_path_limits)?;
    if let Some(selector) = &spec.namespace_selector {
        selector
            .check()
            .map_err(|(field, msg)| doc.error(&format!("spec.namespaceSelector.{field}"), msg))?;
    }
    Ok(Network {
        name: doc.meta.name.clone(),
        id: spec.id,
        role: spec.role,
        subnets: spec.subnets,
        gateway_ips: spec.default_gateway_ips,
        gateway_mac,
        exclude_subnets: spec.exclude_subnets,
        ipam,
        mac_filter: spec.port_security.mac.unwrap_or(true),
        ip_filter: spec.port_security.ip.unwrap_or(ipam),
        dhcp_guard: spec.port_security.dhcp_guard.unwrap_or(ipam),
        egress: spec.egress,
        advertise: spec.advertise,
        mtu,
        dhcp: spec.dhcp,
        slow_path_limits,
        namespace_selector: spec.namespace_selector,
        source: doc.source(super::DocKind::Network),
    })
}

/// A Primary network is a pod's own network (its eth0, its default
/// route): its subnets may not overlap the cluster's pod or Service CIDRs
/// (the pod could not reach those), nor those of another Primary network
/// a namespace may also use (its pods' addresses would be ambiguous).
/// `Some((field, message))` names both; the network is refused, the rest
/// applies.
fn primary_overlap(
    n: &Network,
    cfg: &Config,
    cluster_cidrs: &[super::ClusterCidr],
) -> Option<(String, String)> {
    if n.role != super::model::Role::Primary {
        return None;
    }
    for (i, subnet) in n.subnets.iter().enumerate() {
        if let Some(c) = cluster_cidrs
            .iter()
            .find(|c| super::overlaps(subnet, &c.cidr))
        {
            return Some((
                format!("spec.subnets[{i}]"),
                format!(
                    "{subnet} of Primary network {:?} overlaps {c}: pods on it could not reach that part of the cluster",
                    n.name
                ),
            ));
        }
    }
    for other in cfg
        .networks
        .iter()
        .filter(|o| o.role == super::model::Role::Primary)
    {
        let Some((i, subnet, theirs)) = n.subnets.iter().enumerate().find_map(|(i, s)| {
            other
                .subnets
                .iter()
                .find(|o| super::overlaps(s, o))
                .map(|o| (i, s, o))
        }) else {
            continue;
        };
        let Some(namespace) = shared_namespace(n, other, cfg) else {
            continue;
        };
        return Some((
            format!("spec.subnets[{i}]"),
            format!(
                "{subnet} of Primary network {:?} overlaps {theirs} of Primary network {:?} ({}), and both may be selected in {namespace}",
                n.name,
                other.name,
                other.source.document()
            ),
        ));
    }
    None
}

/// Networks the fabric reaches by VM address (`Network::ingress_routed`)
/// share one address space: the uplink finds a VM by its address alone
/// (`vmp_routed`), and BGP advertises the addresses without a network.
/// Two such networks whose subnets overlap would let one tenant's VM give
/// another's address and take its inbound traffic, so the later network
/// (in document order, as with Primary networks) is refused. Such a
/// network needs subnets: they are what bounds its VMs' addresses.
fn ingress_overlap(n: &Network, cfg: &Config) -> Option<(String, String)> {
    if !n.ingress_routed() {
        return None;
    }
    if n.subnets.is_empty() {
        return Some((
            "spec.subnets".to_string(),
            format!(
                "network {:?} is reached from the fabric by VM address (egress Routed or advertise) and needs subnets: they bound the addresses its VMs may take",
                n.name
            ),
        ));
    }
    cfg.networks
        .iter()
        .filter(|o| o.ingress_routed())
        .find_map(|other| {
            n.subnets.iter().enumerate().find_map(|(i, s)| {
                let theirs = other.subnets.iter().find(|o| super::overlaps(s, o))?;
                Some((
                    format!("spec.subnets[{i}]"),
                    format!(
                        "{s} of network {:?} overlaps {theirs} of network {:?} ({}); both are reached from the fabric by VM address (egress Routed or advertise), so one's VMs could take the other's inbound traffic",
                        n.name, other.name, other.source.document()
                    ),
                ))
            })
        })
}

/// A namespace both networks' `namespaceSelector`s admit, for messages:
/// a `v1 Namespace` the documents describe, else, when both admit a
/// namespace that has only its name label, "every namespace".
fn shared_namespace(a: &Network, b: &Network, cfg: &Config) -> Option<String> {
    if let Some(ns) = cfg
        .namespaces
        .keys()
        .find(|ns| a.admits(ns, cfg).is_ok() && b.admits(ns, cfg).is_ok())
    {
        return Some(format!("namespace {ns:?}"));
    }
    // A namespace not described: it has only the name label, which no
    // selector can know in advance (a fresh name stands for any).
    let fresh = "\u{0}any";
    (a.admits(fresh, cfg).is_ok() && b.admits(fresh, cfg).is_ok())
        .then(|| "every namespace".to_string())
}

/// Default slow-path limits per port, by `slow_class`: far above what a
/// booting or renewing client sends (a DHCP exchange is 2 frames, with
/// retries a handful; RS 3 in 12 s), far below a flood.
pub const DEFAULT_SLOW_PATH_LIMITS: [RateLimit; slow_class::COUNT] = [
    RateLimit {
        rate: 20,
        burst: 40,
    },
    RateLimit {
        rate: 20,
        burst: 40,
    },
    RateLimit {
        rate: 10,
        burst: 20,
    },
];
/// Upper bound of `rate` and `burst`: beyond it the limit protects nothing.
const MAX_SLOW_PATH_LIMIT: u32 = 100_000;

fn slow_path_limits(
    doc: &Doc,
    spec: &SlowPathLimitsSpec,
) -> Result<[RateLimit; slow_class::COUNT], ConfigError> {
    let mut out = DEFAULT_SLOW_PATH_LIMITS;
    for (class, field, given) in [
        (slow_class::DHCP4, "dhcp4", spec.dhcp4),
        (slow_class::DHCP6, "dhcp6", spec.dhcp6),
        (slow_class::RS, "routerSolicit", spec.router_solicit),
    ] {
        let Some(limit) = given else { continue };
        for (name, v) in [("rate", limit.rate), ("burst", limit.burst)] {
            if !(1..=MAX_SLOW_PATH_LIMIT).contains(&v) {
                return Err(doc.error(
                    &format!("spec.slowPathLimits.{field}.{name}"),
                    format!("{v} is outside 1..={MAX_SLOW_PATH_LIMIT}"),
                ));
            }
        }
        out[class] = limit;
    }
    Ok(out)
}

fn attachment(doc: &Doc, cfg: &Config) -> Result<Attachment, ConfigError> {
    let spec: AttachmentSpec = doc.spec()?;
    let Some(namespace) = doc.meta.namespace.clone() else {
        return Err(doc.error("metadata.namespace", "missing (the VM's namespace)"));
    };
    for (field, v) in [
        ("spec.vm", &spec.vm),
        ("spec.interface", &spec.interface),
        ("spec.node", &spec.node),
    ] {
        if v.is_empty() {
            return Err(doc.error(field, "must not be empty"));
        }
    }
    check_ifname(doc, "spec.port", &spec.port)?;
    let Some(net) = cfg.network(&spec.network) else {
        return Err(doc.error(
            "spec.network",
            format!("unknown network {:?} (missing or refused)", spec.network),
        ));
    };
    net.admits(&namespace, cfg)
        .map_err(|m| doc.error("metadata.namespace", m))?;
    let mac = match &spec.mac {
        Some(s) => {
            let mac = parse_mac(s).map_err(|m| doc.error("spec.mac", m))?;
            if mac[0] & 1 != 0 || mac == [0; 6] {
                return Err(doc.error("spec.mac", format!("{s} is not a unicast MAC")));
            }
            if mac == net.gateway_mac {
                return Err(doc.error(
                    "spec.mac",
                    format!("{s} is the gateway MAC of network {:?}", net.name),
                ));
            }
            Some(mac)
        }
        None => None,
    };
    let mut families = [0usize; 2];
    for (i, ip) in spec.ips.iter().enumerate() {
        let field = format!("spec.ips[{i}]");
        let addr = ip.addr();
        families[usize::from(addr.is_ipv6())] += 1;
        if !net.subnets.is_empty() && !net.subnets.iter().any(|s: &IpNet| s.contains(&addr)) {
            return Err(doc.error(
                &field,
                format!("{addr} is outside the subnets of network {:?}", net.name),
            ));
        }
        // The gateway is the data path's own address on every network; the
        // rest of a subnet's reserved addresses only on IPAM networks
        // (`reserved::warnings` reports them on IPAM-less ones).
        if let Some(why) = super::reserved::reserved_reason(net, addr)
            .filter(|_| net.ipam || net.gateway_ips.contains(&addr))
        {
            return Err(doc.error(&field, why));
        }
        if addr.is_unspecified() || addr.is_multicast() || addr.is_loopback() {
            return Err(doc.error(&field, format!("{addr} is not a unicast host address")));
        }
        if spec.ips[..i].iter().any(|o| o.addr() == addr) {
            return Err(doc.error(&field, format!("{addr} is listed twice")));
        }
    }
    if let Some(m) = &spec.migration {
        if m.target_node.is_empty() {
            return Err(doc.error("spec.migration.targetNode", "must not be empty"));
        }
        if let Some(p) = &m.target_port {
            check_ifname(doc, "spec.migration.targetPort", p)?;
        }
    }
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().enumerate() {
        let at = |f: &str| format!("spec.ports[{i}].{f}");
        super::network_policy::check_port_name(&p.name).map_err(|m| doc.error(&at("name"), m))?;
        if p.port == 0 {
            return Err(doc.error(&at("port"), "0 is not a port"));
        }
        if spec.ports[..i].iter().any(|o| o.name == p.name) {
            return Err(doc.error(&at("name"), format!("{:?} is declared twice", p.name)));
        }
        ports.push(super::NamedPort {
            name: p.name.clone(),
            port: p.port,
            protocol: p
                .protocol
                .unwrap_or(super::network_policy::Protocol::Tcp)
                .number(),
        });
    }
    Ok(Attachment {
        labels: string_labels(doc)?,
        ports: ports.into(),
        key: cfg.keys_in_documents.shared(AttachmentKey::new(
            namespace.into(),
            spec.vm.into(),
            spec.interface.into(),
        )),
        network: spec.network.into(),
        node: spec.node.into(),
        port: spec.port.into(),
        mac,
        mac_policy: spec.mac_policy,
        migration: spec.migration.map(Box::new),
        source: doc.source(super::DocKind::Attachment),
        ips: spec.ips.into(),
    })
}

fn check_ifname(doc: &Doc, field: &str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_IFNAME || name.contains(['/', ' ', ':']) {
        return Err(doc.error(field, format!("{name:?} is not a valid interface name (1-{MAX_IFNAME} characters, no '/', ':' or space)")));
    }
    Ok(())
}

#[cfg(test)]
mod slow_path_limit_tests {
    use super::*;

    fn network_with(limits: &str) -> Config {
        let dir = std::env::temp_dir().join(format!(
            "vmpath-slow-limits-{}-{}",
            std::process::id(),
            limits.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("n.yaml"),
            format!(
                "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: blue}}\n\
                 spec:\n  id: 100\n  subnets: [10.20.0.0/24]\n{limits}"
            ),
        )
        .unwrap();
        let cfg =
            crate::round::validate(&super::super::source::read_dir(&dir), "a", &BTreeSet::new());
        std::fs::remove_dir_all(&dir).unwrap();
        cfg
    }

    #[test]
    fn defaults_apply_where_nothing_is_given() {
        let cfg = network_with("");
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        assert_eq!(cfg.networks[0].slow_path_limits, DEFAULT_SLOW_PATH_LIMITS);
    }

    #[test]
    fn a_given_class_overrides_only_itself() {
        let cfg = network_with("  slowPathLimits:\n    dhcp6: {rate: 5, burst: 7}\n");
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        let l = cfg.networks[0].slow_path_limits;
        assert_eq!(l[slow_class::DHCP6], RateLimit { rate: 5, burst: 7 });
        assert_eq!(
            l[slow_class::DHCP4],
            DEFAULT_SLOW_PATH_LIMITS[slow_class::DHCP4]
        );
        assert_eq!(l[slow_class::RS], DEFAULT_SLOW_PATH_LIMITS[slow_class::RS]);
        let data = cfg.networks[0].slow_limits();
        assert_eq!(data.class[slow_class::DHCP6].cost_ns, 200_000_000);
        assert_eq!(data.class[slow_class::DHCP6].cap_ns, 7 * 200_000_000);
    }

    #[test]
    fn zero_or_huge_limits_are_refused_naming_the_field() {
        for (limits, field) in [
            (
                "  slowPathLimits:\n    routerSolicit: {rate: 0, burst: 3}\n",
                "spec.slowPathLimits.routerSolicit.rate",
            ),
            (
                "  slowPathLimits:\n    dhcp4: {rate: 10, burst: 1000000}\n",
                "spec.slowPathLimits.dhcp4.burst",
            ),
        ] {
            let cfg = network_with(limits);
            assert!(cfg.networks.is_empty(), "{limits} accepted");
            assert_eq!(cfg.errors.len(), 1, "{:?}", cfg.errors);
            assert_eq!(cfg.errors[0].field, field);
        }
        let cfg = network_with("  slowPathLimits:\n    dhcp4: {rate: 10}\n");
        assert!(cfg.networks.is_empty(), "a limit without burst accepted");
    }
}

#[cfg(test)]
mod namespace_rule_tests {
    use super::*;
    use crate::config::source::Snapshot;
    use crate::round::validate;

    fn validate_docs(docs: &[serde_json::Value]) -> Config {
        let snap = Snapshot {
            documents: docs
                .iter()
                .enumerate()
                .map(|(i, v)| RawDocument {
                    file: std::path::Path::new("ns.yaml").into(),
                    index: i + 1,
                    origin: crate::config::DocOrigin::Given,
                    value: v.clone().into(),
                })
                .collect(),
            ..Default::default()
        };
        validate(&snap, "a", &BTreeSet::new())
    }

    fn blue(selector: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Network", "metadata": {"name": "blue"},
            "spec": {"id": 7, "subnets": ["10.9.0.0/24"], "namespaceSelector": selector},
        })
    }

    fn namespace(name: &str, labels: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels},
        })
    }

    fn attachment(namespace: &str, vm: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": API_VERSION, "kind": "Attachment",
            "metadata": {"name": format!("{vm}-eth0"), "namespace": namespace},
            "spec": {"vm": vm, "interface": "eth0", "network": "blue", "node": "a", "port": format!("p-{vm}")},
        })
    }

    #[test]
    fn only_namespaces_the_selector_admits_may_attach() {
        let cfg = validate_docs(&[
            blue(serde_json::json!({"matchLabels": {"team": "blue"}})),
            namespace("prod", serde_json::json!({"team": "blue"})),
            namespace("lab", serde_json::json!({"team": "red"})),
            attachment("prod", "web"),
            attachment("lab", "db"),
            // No Namespace document: only its name label is known.
            attachment("default", "x"),
        ]);
        let accepted: Vec<String> = cfg.attachments.iter().map(|a| a.key.to_string()).collect();
        assert_eq!(accepted, ["prod/web/eth0"]);
        assert_eq!(cfg.errors.len(), 2, "{:?}", cfg.errors);
        let lab = &cfg.errors[0];
        assert_eq!(lab.document, "Attachment lab/db-eth0");
        assert_eq!(lab.field, "metadata.namespace");
        assert_eq!(
            lab.message,
            "namespace \"lab\" may not use network \"blue\": its namespaceSelector \
             {matchLabels: {team: blue}} does not match the namespace's labels \
             {kubernetes.io/metadata.name: lab, team: red}"
        );
        assert!(cfg.errors[1].message.starts_with("namespace \"default\""));
        // A refused attachment still protects its claim.
        assert!(cfg.keys_in_documents.iter().any(|k| k.namespace == "lab"));
    }

    #[test]
    fn no_selector_admits_every_namespace_and_the_name_label_selects_by_name() {
        let cfg = validate_docs(&[
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Network", "metadata": {"name": "blue"},
                "spec": {"id": 7, "subnets": ["10.9.0.0/24"]},
            }),
            attachment("anything", "web"),
        ]);
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        let cfg = validate_docs(&[
            blue(serde_json::json!({"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["default"]}
            ]})),
            attachment("prod", "web"),
            attachment("default", "db"),
        ]);
        assert_eq!(cfg.attachments.len(), 1);
        assert_eq!(cfg.attachments[0].key.namespace, "prod");
        assert_eq!(cfg.errors[0].document, "Attachment default/db-eth0");
    }

    #[test]
    fn bad_namespaces_and_selectors_are_refused_naming_the_field() {
        let cfg = validate_docs(&[
            blue(serde_json::json!({"matchExpressions": [{"key": "env", "operator": "In"}]})),
            namespace("prod", serde_json::json!({"tier": 1})),
            serde_json::json!({"apiVersion": API_VERSION, "kind": "Namespace", "metadata": {"name": "x"}}),
            namespace("dup", serde_json::json!({})),
            namespace("dup", serde_json::json!({})),
        ]);
        let fields: Vec<(&str, &str)> = cfg
            .errors
            .iter()
            .map(|e| (e.document.as_str(), e.field.as_str()))
            .collect();
        assert_eq!(
            fields,
            [
                ("Namespace x", "apiVersion"),
                ("Namespace prod", "metadata.labels.tier"),
                ("Namespace dup", "metadata.name"),
                (
                    "Network blue",
                    "spec.namespaceSelector.matchExpressions[0].values"
                ),
            ],
            "{:?}",
            cfg.errors
        );
        assert!(cfg.networks.is_empty());
    }
}

#[cfg(test)]
mod node_spec_tests {
    use super::*;
    use crate::config::source::Snapshot;
    use crate::round::validate;

    fn node_with(spec: serde_json::Value) -> Config {
        let snap = Snapshot {
            documents: vec![RawDocument {
                file: std::path::Path::new("node.yaml").into(),
                index: 1,
                origin: crate::config::DocOrigin::Given,
                value: serde_json::json!({
                    "apiVersion": API_VERSION, "kind": "Node", "metadata": {"name": "a"},
                    "spec": spec,
                })
                .into(),
            }],
            ..Default::default()
        };
        validate(&snap, "a", &BTreeSet::new())
    }

    #[test]
    fn an_ipv6_snat_address_is_taken_and_an_ipv4_one_refused_naming_the_field() {
        let cfg =
            node_with(serde_json::json!({"address": "192.0.2.1", "snatAddress6": "fd00:2::1"}));
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        assert_eq!(
            cfg.node.unwrap().snat_address6,
            Some("fd00:2::1".parse().unwrap())
        );
        let cfg =
            node_with(serde_json::json!({"address": "192.0.2.1", "snatAddress6": "192.0.2.9"}));
        assert!(cfg.node.is_none(), "an IPv4 snatAddress6 accepted");
        assert_eq!(cfg.errors.len(), 1, "{:?}", cfg.errors);
        assert_eq!(cfg.errors[0].field, "spec.snatAddress6");
    }

    fn nodes(a: &str, b: &str, c: &str) -> Snapshot {
        let doc = |i: usize, name: &str, address: &str| RawDocument {
            file: std::path::Path::new("nodes.yaml").into(),
            index: i,
            origin: crate::config::DocOrigin::Given,
            value: serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Node", "metadata": {"name": name},
                "spec": {"address": address},
            })
            .into(),
        };
        Snapshot {
            documents: vec![doc(1, "a", a), doc(2, "b", b), doc(3, "c", c)],
            ..Default::default()
        }
    }

    #[test]
    fn an_ipv6_underlay_is_taken_and_a_node_of_the_other_family_refused_naming_both() {
        let cfg = validate(
            &nodes("fd00:1::1", "fd00:1::2", "fd00:1::3"),
            "a",
            &BTreeSet::new(),
        );
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        assert_eq!(cfg.nodes.len(), 3);

        // Mixed: seen from a (IPv6), the IPv4 node c is refused; seen from
        // c (IPv4), both IPv6 nodes are.
        let snap = nodes("fd00:1::1", "fd00:1::2", "192.0.2.3");
        let from_a = validate(&snap, "a", &BTreeSet::new());
        assert_eq!(from_a.errors.len(), 1, "{:?}", from_a.errors);
        let e = &from_a.errors[0];
        assert_eq!(
            (e.document.as_str(), e.field.as_str()),
            ("Node c", "spec.address")
        );
        assert!(
            e.message
                .contains("\"c\" has an IPv4 underlay address (192.0.2.3)")
                && e.message
                    .contains("this node \"a\" has an IPv6 one (fd00:1::1)"),
            "{}",
            e.message
        );
        assert!(from_a.nodes.contains_key("b") && !from_a.nodes.contains_key("c"));
        let from_c = validate(&snap, "c", &BTreeSet::new());
        assert_eq!(from_c.errors.len(), 2, "{:?}", from_c.errors);
        assert_eq!(from_c.nodes.keys().collect::<Vec<_>>(), ["c"]);
    }
}

#[cfg(test)]
mod holder_tests {
    use super::*;
    use crate::config::source::Snapshot;
    use crate::round::validate_held;

    fn docs(order: &[usize]) -> Snapshot {
        let all = [
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Network", "metadata": {"name": "green"},
                "spec": {"id": 9, "subnets": ["10.64.0.0/16"], "ipam": {"mode": "Enabled"}},
            }),
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Attachment",
                "metadata": {"name": "vmv1-green", "namespace": "nsa"},
                "spec": {"vm": "vmv1", "interface": "green", "network": "green", "node": "a",
                         "port": "p-vmv1", "ips": ["10.64.0.50/16"], "mac": "02:00:00:00:00:50"},
            }),
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Attachment",
                "metadata": {"name": "vmx1-green", "namespace": "nsb"},
                "spec": {"vm": "vmx1", "interface": "green", "network": "green", "node": "a",
                         "port": "p-vmx1", "ips": ["10.64.0.50/16"], "mac": "02:00:00:00:00:51"},
            }),
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "Attachment",
                "metadata": {"name": "vmy1-green", "namespace": "nsb"},
                "spec": {"vm": "vmy1", "interface": "green", "network": "green", "node": "a",
                         "port": "p-vmy1", "ips": ["10.64.0.52/16"], "mac": "02:00:00:00:00:52"},
            }),
        ];
        Snapshot {
            documents: order
                .iter()
                .enumerate()
                .map(|(i, &d)| RawDocument {
                    file: std::path::Path::new(&format!("{i:02}.yaml")).into(),
                    index: 1,
                    origin: crate::config::DocOrigin::Given,
                    value: all[d].clone().into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// What the claims store holds while nsa/vmv1 runs: 10.64.0.50, and
    /// nsb/vmy1's detected MAC, ...:51.
    fn held() -> Held {
        let claim = |ip: &str, mac: Option<&str>| crate::resolve::store::Claim {
            network: "green".into(),
            ips: ip.parse().into_iter().collect(),
            mac: mac.map(|m| crate::config::parse_mac(m).unwrap()),
            mac_origin: None,
        };
        Held::from_claims(&BTreeMap::from([
            ("nsa/vmv1/green".into(), claim("10.64.0.50/16", None)),
            (
                "nsb/vmy1/green".into(),
                claim("10.64.0.52/16", Some("02:00:00:00:00:51")),
            ),
        ]))
    }

    #[test]
    fn the_holder_keeps_its_address_and_mac_in_every_document_order() {
        let orders = [[0, 1, 2, 3], [0, 2, 1, 3], [0, 3, 2, 1], [0, 2, 3, 1]];
        for order in orders {
            // A restart: nothing accepted before.
            let cfg = validate_held(&docs(&order), "a", &BTreeSet::new(), &held());
            let accepted: Vec<String> = cfg.attachments.iter().map(|a| a.key.to_string()).collect();
            assert_eq!(
                accepted,
                ["nsa/vmv1/green", "nsb/vmy1/green"],
                "{order:?}: {:?}",
                cfg.errors
            );
            let errors: Vec<(&str, &str, &str)> = cfg
                .errors
                .iter()
                .map(|e| (e.document.as_str(), e.field.as_str(), e.message.as_str()))
                .collect();
            assert_eq!(
                errors,
                [(
                    "Attachment nsb/vmx1-green",
                    "spec.ips",
                    "IP 10.64.0.50 is already held by VM interface nsa/vmv1/green on network \"green\""
                )],
                "{order:?}"
            );
        }
        // The MAC: vmx1 asks for vmy1's claimed one (its own IP is free).
        let mut snap = docs(&[0, 2, 3]);
        snap.documents[1].value = {
            let mut v = (*snap.documents[1].value).clone();
            v["spec"]["ips"] = serde_json::json!(["10.64.0.60/16"]);
            v.into()
        };
        // vmy1 gives no MAC: its claim holds the one seen in its traffic.
        snap.documents[2].value = {
            let mut v = (*snap.documents[2].value).clone();
            v["spec"].as_object_mut().unwrap().remove("mac");
            v.into()
        };
        let cfg = validate_held(&snap, "a", &BTreeSet::new(), &held());
        assert_eq!(cfg.errors.len(), 1, "{:?}", cfg.errors);
        assert_eq!(cfg.errors[0].field, "spec.mac");
        assert_eq!(
            cfg.errors[0].message,
            "MAC 02:00:00:00:00:51 is already held by VM interface nsb/vmy1/green on network \"green\""
        );
    }
}

#[cfg(test)]
mod primary_overlap_tests {
    use super::*;
    use crate::config::{ClusterCidr, ClusterCidrKind, source::Snapshot};
    use crate::round::validate;

    fn snapshot(yaml: &str, cidrs: &[(&str, ClusterCidrKind)]) -> Snapshot {
        Snapshot {
            documents: super::super::source::parse(yaml.as_bytes())
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(i, v)| RawDocument {
                    file: std::path::Path::new("nets.yaml").into(),
                    index: i + 1,
                    origin: crate::config::DocOrigin::Given,
                    value: v.into(),
                })
                .collect(),
            cluster_cidrs: cidrs
                .iter()
                .map(|(c, kind)| ClusterCidr {
                    cidr: c.parse().unwrap(),
                    kind: *kind,
                    source: "--flag".into(),
                    node: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn net(name: &str, id: u32, role: &str, subnet: &str, selector: &str) -> String {
        format!(
            "---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\n\
             spec: {{id: {id}, role: {role}, subnets: [{subnet}], ipam: {{mode: Disabled}}{selector}}}\n"
        )
    }

    fn names(cfg: &Config) -> Vec<&str> {
        cfg.networks.iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn a_primary_network_over_the_clusters_pod_or_service_cidrs_is_refused_naming_both() {
        let yaml = [
            net("pods", 1, "Primary", "10.244.3.0/24", ""),
            net("svcs", 2, "Primary", "10.96.0.0/16", ""),
            net("v6", 3, "Primary", "'fd00:10:244::/64'", ""),
            net("fine", 4, "Primary", "10.20.0.0/16", ""),
            // A Secondary network is no pod's own: not checked.
            net("second", 5, "Secondary", "10.244.4.0/24", ""),
        ]
        .concat();
        let cfg = validate(
            &snapshot(
                &yaml,
                &[
                    ("10.244.0.0/16", ClusterCidrKind::Pod),
                    ("fd00:10:244::/56", ClusterCidrKind::Pod),
                    ("10.96.0.0/12", ClusterCidrKind::Service),
                ],
            ),
            "a",
            &BTreeSet::new(),
        );
        assert_eq!(names(&cfg), ["fine", "second"], "{:#?}", cfg.errors);
        let msgs: Vec<String> = cfg.errors.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 3, "{msgs:#?}");
        assert!(
            msgs[0].contains("Network pods")
                && msgs[0].contains("spec.subnets[0]")
                && msgs[0].contains(
                    "10.244.3.0/24 of Primary network \"pods\" overlaps the cluster's pod CIDR 10.244.0.0/16 (--flag)"
                ),
            "{}",
            msgs[0]
        );
        assert!(
            msgs[1].contains("10.96.0.0/16 of Primary network \"svcs\" overlaps the cluster's Service CIDR 10.96.0.0/12"),
            "{}",
            msgs[1]
        );
        assert!(msgs[2].contains("fd00:10:244::/56"), "{}", msgs[2]);
    }

    #[test]
    fn two_primary_networks_one_namespace_may_use_may_not_overlap() {
        // No selectors: every namespace may use both.
        let yaml = [
            net("blue", 1, "Primary", "10.20.0.0/16", ""),
            net("red", 2, "Primary", "10.20.5.0/24", ""),
        ]
        .concat();
        let cfg = validate(&snapshot(&yaml, &[]), "a", &BTreeSet::new());
        assert_eq!(names(&cfg), ["blue"]);
        let msg = cfg.errors[0].to_string();
        assert!(
            msg.contains("Network red")
                && msg.contains(
                    "10.20.5.0/24 of Primary network \"red\" overlaps 10.20.0.0/16 of Primary network \"blue\" (Network blue), and both may be selected in every namespace"
                ),
            "{msg}"
        );

        // Selectors no namespace satisfies both of: tenants apart, the same
        // addresses in each (as OVN-Kubernetes' primary UDNs may).
        let apart = [
            net(
                "blue",
                1,
                "Primary",
                "10.20.0.0/16",
                ", namespaceSelector: {matchLabels: {team: a}}",
            ),
            net(
                "red",
                2,
                "Primary",
                "10.20.0.0/16",
                ", namespaceSelector: {matchLabels: {tier: b}}",
            ),
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a, labels: {team: a}}\n".into(),
        ]
        .concat();
        let cfg = validate(&snapshot(&apart, &[]), "a", &BTreeSet::new());
        assert_eq!(names(&cfg), ["blue", "red"], "{:#?}", cfg.errors);

        // A namespace both select: the later network is refused, naming it.
        let shared = format!(
            "{apart}---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: both, labels: {{team: a, tier: b}}}}\n"
        );
        let cfg = validate(&snapshot(&shared, &[]), "a", &BTreeSet::new());
        assert_eq!(names(&cfg), ["blue"]);
        assert!(
            cfg.errors[0]
                .to_string()
                .contains("both may be selected in namespace \"both\""),
            "{}",
            cfg.errors[0]
        );

        // Secondary networks may overlap a Primary one.
        let yaml = [
            net("blue", 1, "Primary", "10.20.0.0/16", ""),
            net("red", 2, "Secondary", "10.20.5.0/24", ""),
        ]
        .concat();
        let cfg = validate(&snapshot(&yaml, &[]), "a", &BTreeSet::new());
        assert_eq!(names(&cfg), ["blue", "red"], "{:#?}", cfg.errors);
    }

    /// A tenant's network reached from the fabric by VM address may not
    /// overlap another's: its VM would give the other's address and the
    /// uplink (`vmp_routed`, keyed by address alone) deliver the other's
    /// inbound traffic to it. NATed networks keep private, overlapping
    /// address spaces.
    #[test]
    fn networks_reached_by_vm_address_may_not_overlap_or_go_without_subnets() {
        let routed = |name: &str, id: u32, subnet: &str, extra: &str| {
            format!(
                "---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\n\
                 spec: {{id: {id}, subnets: [{subnet}], ipam: {{mode: Disabled}}{extra}}}\n"
            )
        };
        let vm = |name: &str, network: &str, ip: &str| {
            format!(
                "---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: {name}}}\n\
                 spec: {{vm: {name}, interface: eth0, network: {network}, node: a, port: p-{name}, mac: '02:00:00:00:50:0{}', ips: [{ip}/16]}}\n",
                name.len()
            )
        };
        let yaml = [
            routed("blue", 1, "10.50.0.0/16", ", egress: Routed"),
            // The attack: a network advertised from the fabric over blue's.
            routed("red", 2, "10.50.7.0/24", ", advertise: {perVM: true}"),
            routed("v6", 3, "'fd50::/64'", ", egress: Routed"),
            routed("v6b", 4, "'fd50::/48'", ", advertise: {learned: true}"),
            // No subnets: nothing would bound its VMs' addresses.
            "---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: bare}\n\
             spec: {id: 5, ipam: {mode: Disabled}, egress: Routed}\n"
                .to_string(),
            // NATed, not advertised: private, may overlap.
            routed("nat", 6, "10.50.0.0/16", ""),
            vm("victim", "blue", "10.50.7.10"),
            vm("thief", "red", "10.50.7.10"),
        ]
        .concat();
        let cfg = validate(&snapshot(&yaml, &[]), "a", &BTreeSet::new());
        assert_eq!(names(&cfg), ["blue", "v6", "nat"], "{:#?}", cfg.errors);
        let msgs: Vec<String> = cfg.errors.iter().map(ToString::to_string).collect();
        let find = |needle: &str| {
            msgs.iter()
                .find(|m| m.contains(needle))
                .unwrap_or_else(|| panic!("no error with {needle:?} in {msgs:#?}"))
        };
        let red = find("Network red");
        assert!(
            red.contains("spec.subnets[0]")
                && red.contains(
                    "10.50.7.0/24 of network \"red\" overlaps 10.50.0.0/16 of network \"blue\""
                )
                && red.contains("could take the other's inbound traffic"),
            "{red}"
        );
        assert!(
            find("Network v6b")
                .contains("fd50::/48 of network \"v6b\" overlaps fd50::/64 of network \"v6\""),
            "{msgs:#?}"
        );
        assert!(find("Network bare").contains("needs subnets"), "{msgs:#?}");
        // The thief's VM is refused with its network; the victim keeps its
        // address.
        assert!(find("Attachment thief/thief").contains("red"), "{msgs:#?}");
        let keys: Vec<String> = cfg.attachments.iter().map(|a| a.key.to_string()).collect();
        assert_eq!(keys, ["victim/victim/eth0"]);
    }

    #[test]
    fn a_v1_nodes_pod_cidrs_are_the_clusters_pod_address_space() {
        let yaml = [
            net("blue", 1, "Primary", "10.244.1.0/24", ""),
            "---\napiVersion: v1\nkind: Node\nmetadata: {name: b}\nspec: {podCIDRs: [10.244.1.0/24, 'fd00:10:244:1::/64']}\n"
                .into(),
        ]
        .concat();
        let cfg = validate(&snapshot(&yaml, &[]), "a", &BTreeSet::new());
        assert!(cfg.networks.is_empty());
        let msg = cfg.errors[0].to_string();
        assert!(
            msg.contains(
                "overlaps the cluster's pod CIDR 10.244.1.0/24 (v1 Node b's spec.podCIDRs)"
            ),
            "{msg}"
        );
    }
}
