//! Derives vmpath Attachments from Kubernetes-shaped objects: a VM
//! interface from its virt-launcher pod (Multus selection element, node,
//! the port the CNI plugin created) and its VirtualMachineInstance
//! (identity, MAC, networks, migration state); a plain pod's interface
//! from the pod alone. What comes out is an Attachment document like any
//! other, so validation, IPAM, planning and the data path are shared with
//! the config files and CNI endpoints. Every refusal names the object.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

pub use crate::config::Translated;
use crate::config::kube_objects::ledger::{self, Shards};
use crate::config::kube_objects::prune::{ClusterObject, cluster_object, group_kind};
use crate::config::kube_objects::{
    self as objects, CREATED_BY_LABEL, DEFAULT_NETWORK_ANNOTATION, DEFAULT_NETWORK_IFNAME,
    IpamClaim, K8sNode, MIGRATION_JOB_LABEL, NETWORKS_ANNOTATION, Nad, NadConfig, NetworkSelection,
    ObjectMeta, Pod, TARGET_READY_ANNOTATION, VM_NAME_LABEL, Vmi, Vmim,
};
use crate::config::{
    AttachmentKey, ConfigError, DocOrigin,
    model::API_VERSION,
    source::{ClusterDocument, RawDocument, SourceFile, SourceObject},
};
use crate::sys::hash::{HashMap, HashSet};
use vmpath_api::types::{ObjectRef, RefusalReason};

/// Errors about CNI endpoints name them as `cni:<container id>/<ifname>`
/// (so the plugin's ADD can answer with the refusal).
pub const CNI_SOURCE_PREFIX: &str = "cni:";

/// Whether a vmpath Network document has IPAM (its default).
fn has_ipam(raw: &RawDocument) -> bool {
    raw.value.pointer("/spec/ipam/mode").and_then(Value::as_str) != Some("Disabled")
}

/// A port the CNI plugin handed over, as its Attachment document says.
#[derive(Debug, Clone)]
struct CniPort {
    file: SourceFile,
    port: String,
    network: String,
    mac: Option<String>,
}

/// A typed object with where it came from.
struct Object<'a, T> {
    /// Shared by the documents derived from it.
    file: &'a SourceFile,
    index: usize,
    value: &'a T,
}

/// One interface of a pod on a vmpath network.
#[derive(Debug, Clone)]
struct PodInterface {
    selection: NetworkSelection,
    /// The NAD as `namespace/name`.
    nad: String,
    ifname: String,
    network: String,
}

/// `meta`'s object as a derived document's origin names it.
fn source(kind: &'static str, meta: &ObjectMeta) -> SourceObject {
    SourceObject {
        kind,
        namespace: meta.namespace().into(),
        name: meta.name.clone(),
    }
}

fn object(kind: &str, meta: &ObjectMeta) -> ObjectRef {
    ObjectRef {
        kind: kind.to_string(),
        namespace: meta.namespace().to_string(),
        name: meta.name.to_string(),
    }
}

/// A refusal about a Kubernetes object: named by it, its Event on it.
fn error(file: &Path, about: ObjectRef, field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        file: file.to_path_buf(),
        document: about.to_string(),
        field: field.to_string(),
        message: message.into(),
        about: Some(Box::new(about)),
        reason: None,
    }
}

/// `kubectl get -o yaml` of several objects is one `v1 List`: its items
/// are documents of their own.
fn flatten(documents: &[RawDocument]) -> Vec<RawDocument> {
    let mut out = Vec::with_capacity(documents.len());
    for raw in documents {
        match (group_kind(&raw.value), raw.value.get("items")) {
            (Some(("", "List")), Some(Value::Array(items))) => {
                out.extend(items.iter().map(|item| RawDocument {
                    file: raw.file.clone(),
                    index: raw.index,
                    origin: raw.origin.clone(),
                    value: item.clone().into(),
                }))
            }
            _ => out.push(raw.clone()),
        }
    }
    out
}

/// The hook for the namespace rule (a Network's `namespaceSelector`
/// decides which namespaces a NAD may bind to it). Every namespace may
/// until that rule lands.
fn namespace_may_attach(_nad_namespace: &str, _network: &str) -> Result<(), String> {
    Ok(())
}

/// A host-side port name that exists nowhere, for an endpoint whose port
/// the CNI plugin has not handed over on this node (yet, or because the
/// pod runs elsewhere): the endpoint is known (claims, overlay) and waits
/// for its port.
pub fn placeholder_port(namespace: &str, pod: &str, ifname: &str) -> String {
    let h = crate::sys::hash::fnv1a(&[namespace.as_bytes(), pod.as_bytes(), ifname.as_bytes()]);
    format!("vmpw{:011x}", h & 0xfff_ffff_ffff)
}

/// Derives Attachment and Node documents from the cluster objects (kept
/// typed in `cluster`, or given as documents among `documents`).
/// `pod_claims`: a plain pod's interface on an IPAM network takes its
/// addresses from the IPAMClaim `vmpath controller` makes for it
/// ([`objects::pod_claim_name`]) and waits for it (the Kubernetes source);
/// else the agent's IPAM allocates them (config files, no controller).
pub fn translate(
    documents: &[RawDocument],
    cluster: &crate::config::source::Chunked<ClusterDocument>,
    node: &str,
    pod_claims: bool,
    ledger: Option<&Shards>,
) -> Translated {
    let mut t = Translated::default();
    let mut pods: Vec<Object<Pod>> = Vec::new();
    let mut vmis: Vec<Object<Vmi>> = Vec::new();
    let mut vmims: Vec<Object<Vmim>> = Vec::new();
    let mut nads: Vec<Object<Nad>> = Vec::new();
    let mut claims: Vec<Object<IpamClaim>> = Vec::new();
    let mut k8s_nodes: Vec<Object<K8sNode>> = Vec::new();
    let mut cni: BTreeMap<(String, String, String), CniPort> = BTreeMap::new();
    let mut vmpath_nodes: BTreeSet<String> = BTreeSet::new();

    // Cluster kinds given as documents are read as a source keeps them.
    let mut given: Vec<ClusterDocument> = Vec::new();
    let flat = flatten(documents);
    for raw in flat {
        if let Some(object) = cluster_object(&raw.value) {
            given.push(ClusterDocument {
                file: raw.file,
                index: crate::config::source::doc_index(raw.index),
                object: std::sync::Arc::new(object),
            });
            continue;
        }
        let is_attachment = raw.value.get("kind").and_then(Value::as_str) == Some("Attachment");
        let is_node = raw.value.get("kind").and_then(Value::as_str) == Some("Node");
        if is_node && let Some(name) = raw.value.pointer("/metadata/name").and_then(Value::as_str) {
            vmpath_nodes.insert(name.to_string());
        }
        if is_attachment && raw.origin == DocOrigin::CniPort {
            let s = |p: &str| {
                raw.value
                    .pointer(p)
                    .and_then(Value::as_str)
                    .map(str::to_string)
            };
            if let (Some(ns), Some(pod), Some(ifname), Some(port), Some(network)) = (
                s("/metadata/namespace"),
                s("/spec/vm"),
                s("/spec/interface"),
                s("/spec/port"),
                s("/spec/network"),
            ) {
                cni.insert(
                    (ns, pod, ifname),
                    CniPort {
                        file: raw.file.clone(),
                        port,
                        network,
                        mac: s("/spec/mac"),
                    },
                );
            }
        }
        t.documents.push(raw);
    }
    for doc in cluster.iter().chain(&given) {
        let (file, index) = (&doc.file, doc.index as usize);
        match &*doc.object {
            ClusterObject::Pod(value) => pods.push(Object { file, index, value }),
            ClusterObject::Vmi(value) => vmis.push(Object { file, index, value }),
            ClusterObject::Vmim(value) => vmims.push(Object { file, index, value }),
            ClusterObject::Nad(value) => nads.push(Object { file, index, value }),
            ClusterObject::IpamClaim(value) => claims.push(Object { file, index, value }),
            ClusterObject::Node(value) => k8s_nodes.push(Object { file, index, value }),
            ClusterObject::Refused(r) => {
                t.errors.push(if r.name.is_empty() {
                    ConfigError {
                        file: file.to_path_buf(),
                        document: format!("{} (document {index})", r.kind),
                        field: r.field.clone(),
                        message: r.message.clone(),
                        about: None,
                        reason: None,
                    }
                } else {
                    let about = ObjectRef {
                        kind: r.kind.to_string(),
                        namespace: r.namespace.as_deref().unwrap_or("default").to_string(),
                        name: r.name.clone(),
                    };
                    error(file, about, &r.field, r.message.clone())
                });
            }
        }
    }

    // v1 Nodes' pod CIDRs are the cluster's pod address space.
    for n in &k8s_nodes {
        for (i, text) in n.value.spec.pod_cidrs.iter().enumerate() {
            match text.parse::<ipnet::IpNet>() {
                Ok(cidr) => t.cluster_cidrs.push(crate::config::ClusterCidr {
                    cidr: cidr.trunc(),
                    kind: crate::config::ClusterCidrKind::Pod,
                    source: format!("v1 Node {}'s spec.podCIDRs", n.value.metadata.name),
                    node: Some(n.value.metadata.name.to_string()),
                }),
                Err(e) => t.errors.push(error(
                    n.file,
                    ObjectRef {
                        kind: "Node".into(),
                        namespace: String::new(),
                        name: n.value.metadata.name.to_string(),
                    },
                    &format!("spec.podCIDRs[{i}]"),
                    format!("{text:?}: {e}"),
                )),
            }
        }
    }
    // v1 Nodes give the underlay address where no vmpath Node is written.
    for n in &k8s_nodes {
        if vmpath_nodes.contains(n.value.metadata.name.as_str()) {
            continue;
        }
        let Some(ip) = n.value.internal_ip() else {
            continue;
        };
        t.documents.push(RawDocument {
            file: n.file.clone(),
            index: n.index,
            origin: DocOrigin::Object(Box::new(object("Node", &n.value.metadata))),
            value: std::sync::Arc::new(json!({
                "apiVersion": API_VERSION,
                "kind": "Node",
                "metadata": {"name": n.value.metadata.name},
                "spec": {"address": ip},
            })),
        });
    }

    // NADs by namespace/name, with what their config says.
    let mut nad_index: BTreeMap<String, Result<NadConfig, String>> = BTreeMap::new();
    for n in &nads {
        let key = format!("{}/{}", n.value.metadata.namespace(), n.value.metadata.name);
        let cni = n.value.cni();
        if let Err(msg) = &cni {
            t.errors.push(error(
                n.file,
                object("NetworkAttachmentDefinition", &n.value.metadata),
                "spec.config",
                msg.clone(),
            ));
        }
        nad_index.insert(key, cni);
    }
    // A claim that exists but holds no address yet: its VM waits for the
    // controller rather than take an address of its own.
    // Claims by namespace and name (the first of a name holds the
    // addresses), so a round stays linear.
    let mut claim_index: BTreeMap<(&str, &str), &IpamClaim> = BTreeMap::new();
    for c in &claims {
        let key = (c.value.metadata.namespace(), c.value.metadata.name.as_str());
        claim_index.entry(key).or_insert(c.value);
    }
    let ipam_networks: BTreeSet<String> = flatten(documents)
        .iter()
        .filter(|raw| {
            matches!(group_kind(&raw.value), Some((g, "Network")) if g.starts_with("vmpath"))
                && has_ipam(raw)
        })
        .filter_map(|raw| raw.value.pointer("/metadata/name").and_then(Value::as_str))
        .map(str::to_string)
        .collect();
    // What a claim gives an interface on `network`: its `status.ips`, or
    // why it waits (none yet; with the Kubernetes source, on an IPAM
    // network, ones the controller's ledger does not vouch for: a tenant
    // that may write its claim's status must not pick itself an address).
    let claim_state = |c: &IpamClaim, network: &str| -> ClaimState {
        let ns = c.metadata.namespace();
        let name = &c.metadata.name;
        let ipam = ipam_networks.contains(network);
        if c.status.ips.is_empty() {
            return if ipam {
                ClaimState::Waits(format!(
                    "waits for IPAMClaim {ns}/{name}'s status.ips: addresses on network {network:?} are allocated by vmpath controller"
                ))
            } else {
                ClaimState::Empty
            };
        }
        if let Some(ledger) = ledger.filter(|_| ipam) {
            let uid = c.metadata.uid.clone().unwrap_or_default();
            if let Some(why) = ledger::unvouched(
                ledger,
                network,
                &format!("{ns}/{name}"),
                &uid,
                &c.status.ips,
            ) {
                return ClaimState::Waits(format!(
                    "waits for IPAMClaim {ns}/{name}'s status.ips: {:?} was not written by vmpath controller ({why} in the ledger on network {network:?}): not trusted until vmpath controller writes it",
                    c.status.ips
                ));
            }
        }
        ClaimState::Ips(c.status.ips.iter().map(|ip| ip.to_string()).collect())
    };
    let claim_of = |namespace: &str, name: &str, network: &str| -> ClaimState {
        claim_index
            .get(&(namespace, name))
            .map_or(ClaimState::Empty, |c| claim_state(c, network))
    };

    // Networks a pod's eth0 may not be on: those written with another role
    // than Primary (an unknown one is refused by validation, naming it).
    let not_primary: BTreeSet<String> = flatten(documents)
        .iter()
        .filter(|raw| {
            matches!(group_kind(&raw.value), Some((g, "Network")) if g.starts_with("vmpath"))
                && raw.value.pointer("/spec/role").and_then(Value::as_str) != Some("Primary")
        })
        .filter_map(|raw| raw.value.pointer("/metadata/name").and_then(Value::as_str))
        .map(str::to_string)
        .collect();

    let mut tr = Translator {
        node,
        nad_index: &nad_index,
        not_primary: &not_primary,
        cni: &mut cni,
        out: &mut t,
    };

    // Pods: their vmpath interfaces; plain pods are derived here, VM pods
    // wait for their VMI, found by uid or name through these indexes (a
    // search of every VMI per pod made a round quadratic in the cluster's
    // VMs). The first VMI of a key wins, as the search's did.
    let mut vmi_by_uid: HashMap<&objects::Uid, usize> = HashMap::default();
    let mut vmi_by_name: HashMap<(&str, &str), usize> = HashMap::default();
    for (i, v) in vmis.iter().enumerate() {
        let meta = &v.value.metadata;
        if let Some(uid) = &meta.uid {
            vmi_by_uid.entry(uid).or_insert(i);
        }
        vmi_by_name
            .entry((meta.namespace(), meta.name.as_str()))
            .or_insert(i);
    }
    let mut vm_pods: BTreeMap<usize, Vec<(usize, Vec<PodInterface>)>> = BTreeMap::new();
    for (pi, p) in pods.iter().enumerate() {
        let pod = &p.value;
        if pod.finished() {
            continue;
        }
        let Some(ifaces) = tr.pod_interfaces(p) else {
            continue;
        };
        if !pod.is_virt_launcher() {
            let ns = pod.metadata.namespace();
            for i in &ifaces {
                // The claim that decides the addresses: the one referenced,
                // else (Kubernetes source, IPAM network) the one vmpath
                // controller makes for this pod, which counts only if made
                // for this pod's uid.
                let ipam = ipam_networks.contains(&i.network);
                let state = match &i.selection.ipam_claim_reference {
                    Some(c) => claim_of(ns, c, &i.network),
                    None if pod_claims && ipam => {
                        let name = objects::pod_claim_name(&pod.metadata.name, &i.ifname);
                        let made = claim_index.get(&(ns, name.as_str())).filter(|c| {
                            pod.metadata.uid.is_some()
                                && pod.metadata.uid_is(
                                    c.metadata
                                        .labels
                                        .get(objects::POD_UID_LABEL)
                                        .map(|v| v.as_str()),
                                )
                        });
                        match made.map(|c| claim_state(c, &i.network)) {
                            Some(ClaimState::Ips(ips)) => ClaimState::Ips(ips),
                            Some(ClaimState::Waits(why)) => ClaimState::Waits(why),
                            _ => ClaimState::Waits(format!(
                                "waits for IPAMClaim {ns}/{name}'s status.ips: addresses on network {:?} are allocated by vmpath controller",
                                i.network
                            )),
                        }
                    }
                    None => ClaimState::Empty,
                };
                if let ClaimState::Waits(why) = &state {
                    let file = tr
                        .take_cni(pod, &i.ifname)
                        .map(|c| c.file)
                        .unwrap_or_else(|| p.file.clone());
                    tr.out.waiting.push(error(
                        &file,
                        object("Pod", &pod.metadata),
                        &format!("metadata.annotations[{NETWORKS_ANNOTATION:?}]"),
                        why.clone(),
                    ));
                    continue;
                }
                let ips = match state {
                    ClaimState::Ips(ips) => ips,
                    _ => i.selection.ips.clone(),
                };
                let key = AttachmentKey::new(
                    ns.into(),
                    pod.metadata.name.clone(),
                    i.ifname.as_str().into(),
                );
                let cni_port = tr.take_cni(pod, &i.ifname);
                let Some(pod_node) = pod
                    .spec
                    .node_name
                    .as_ref()
                    .map(|n| n.to_string())
                    .or_else(|| cni_port.as_ref().map(|_| node.to_string()))
                else {
                    continue;
                };
                let mac = i
                    .selection
                    .mac
                    .clone()
                    .or_else(|| cni_port.as_ref().and_then(|c| c.mac.clone()));
                let port = cni_port
                    .as_ref()
                    .map(|c| c.port.clone())
                    .unwrap_or_else(|| placeholder_port(&key.namespace, &key.vm, &i.ifname));
                let file = cni_port
                    .as_ref()
                    .map(|c| c.file.clone())
                    .unwrap_or_else(|| p.file.clone());
                tr.derive(Derived {
                    file,
                    name: format!("{}-{}", pod.metadata.name, i.ifname),
                    from: vec![source("Pod", &pod.metadata)],
                    key,
                    network: i.network.clone(),
                    node: pod_node,
                    port,
                    mac,
                    ips,
                    migration: None,
                    labels: pod.metadata.labels.clone(),
                    ports: pod.named_ports(),
                });
            }
            continue;
        }
        let vmi = match pod.metadata.labels.get(CREATED_BY_LABEL) {
            // The label is the pod's author's word: a uid names a VMI of
            // the pod's own namespace only (a tenant's pod naming another
            // namespace's VMI is not its launcher).
            Some(uid) => vmi_by_uid
                .get(&objects::Uid::new(uid))
                .copied()
                .filter(|&i| vmis[i].value.metadata.namespace() == pod.metadata.namespace()),
            None => pod.metadata.labels.get(VM_NAME_LABEL).and_then(|name| {
                vmi_by_name
                    .get(&(pod.metadata.namespace(), name.as_str()))
                    .copied()
            }),
        };
        match vmi {
            Some(v) => vm_pods.entry(v).or_default().push((pi, ifaces)),
            None => {
                let which = match (
                    pod.metadata.labels.get(VM_NAME_LABEL),
                    pod.metadata.labels.get(CREATED_BY_LABEL),
                ) {
                    (Some(name), Some(uid)) => {
                        format!("{}/{name} (uid {uid})", pod.metadata.namespace())
                    }
                    (Some(name), None) => format!("{}/{name}", pod.metadata.namespace()),
                    (None, Some(uid)) => format!("with uid {uid}"),
                    (None, None) => "(none named)".into(),
                };
                let files = tr.take_all_cni(pod);
                tr.refuse_pod_for(
                    p,
                    files,
                    format!(
                        "virt-launcher pod of VirtualMachineInstance {which}, which is not known"
                    ),
                    Some(RefusalReason::VmiNotKnown),
                );
            }
        }
    }

    // Each VMI's migrations, in order (one pass, not one per VMI: completed
    // VMIMs pile up cluster-wide).
    let mut vmims_of: HashMap<(&str, &str), Vec<&Object<Vmim>>> = HashMap::default();
    for m in &vmims {
        vmims_of
            .entry((m.value.metadata.namespace(), m.value.spec.vmi_name.as_str()))
            .or_default()
            .push(m);
    }

    // VMs: one Attachment per VMI interface on a vmpath network.
    for (vi, v) in vmis.iter().enumerate() {
        let vmi = &v.value;
        let ns = vmi.metadata.namespace();
        let my_pods = vm_pods.remove(&vi).unwrap_or_default();
        let target_pods: Vec<(crate::sys::intern::Name, &str, Option<&str>)> = my_pods
            .iter()
            .filter_map(|(pi, _)| {
                let pod = &pods[*pi].value;
                let uid = pod.metadata.labels.get(MIGRATION_JOB_LABEL)?;
                Some((
                    uid.clone(),
                    pod.metadata.name.as_str(),
                    pod.spec.node_name.as_deref(),
                ))
            })
            .collect();
        let my_vmims = vmims_of
            .get(&(vmi.metadata.namespace(), vmi.metadata.name.as_str()))
            .map_or(&[][..], Vec::as_slice);
        let (migration, finished_on) = migration_of(vmi, my_vmims, &target_pods);
        // The pod the VM runs in now, and the pod it is migrating to.
        let target_pod = migration.as_ref().and_then(|m| {
            my_pods.iter().find(|(pi, _)| {
                let pod = &pods[*pi].value;
                m.uid.is_some()
                    && pod
                        .metadata
                        .labels
                        .get(MIGRATION_JOB_LABEL)
                        .map(|v| v.as_str())
                        == m.uid.as_deref()
                    || m.target_pod.as_deref() == Some(pod.metadata.name.as_str())
            })
        });
        let running_node = match &migration {
            Some(m) => Some(m.source_node.clone()),
            None => finished_on
                .or_else(|| vmi.status.node_name.as_ref().map(|n| n.to_string()))
                // KubeVirt writes status.nodeName once the pod runs, after
                // its CNI ADD: till then the VMI's one pod says where.
                .or_else(|| {
                    let mut launchers = my_pods.iter().filter(|(pi, _)| {
                        !pods[*pi]
                            .value
                            .metadata
                            .labels
                            .contains_key(MIGRATION_JOB_LABEL)
                    });
                    match (launchers.next(), launchers.next()) {
                        (Some((pi, _)), None) => pods[*pi]
                            .value
                            .spec
                            .node_name
                            .as_ref()
                            .map(|n| n.to_string()),
                        _ => None,
                    }
                }),
        };
        let running_pod = my_pods.iter().find(|(pi, _)| {
            let pod = &pods[*pi].value;
            target_pod.is_none_or(|(t, _)| t != pi)
                && match &migration {
                    Some(m) if m.source_pod.is_some() => {
                        m.source_pod.as_deref() == Some(pod.metadata.name.as_str())
                    }
                    _ => {
                        pod.spec.node_name.is_some()
                            && pod.spec.node_name.as_deref() == running_node.as_deref()
                    }
                }
        });
        // Pods the VM left (a migration's source after it, a target after
        // a rollback): their ports are not served, nor refused; their DEL
        // releases nothing (the claims are the VMI's).
        for (pi, _) in &my_pods {
            let pod = &pods[*pi].value;
            let left = running_node.is_some()
                && pod.spec.node_name.is_some()
                && pod.spec.node_name.as_deref() != running_node.as_deref()
                && target_pod.is_none_or(|(t, _)| t != pi);
            if left {
                tr.take_all_cni(pod);
            }
        }
        for net in &vmi.spec.networks {
            let Some(multus) = &net.multus else { continue };
            let nad = match multus.network_name.split_once('/') {
                Some((n, name)) => format!("{n}/{name}"),
                None => format!("{ns}/{}", multus.network_name),
            };
            let network = match nad_index.get(&nad) {
                Some(Ok(NadConfig::Vmpath { network })) => network.clone(),
                Some(Ok(NadConfig::Other { .. })) => continue,
                Some(Err(_)) => continue, // the NAD's refusal says why
                None => {
                    tr.out.errors.push(error(
                        v.file,
                        object("VirtualMachineInstance", &vmi.metadata),
                        &format!("spec.networks[{}].multus.networkName", net.name),
                        format!("NetworkAttachmentDefinition {nad} is not known"),
                    ));
                    continue;
                }
            };
            let key = AttachmentKey::new(ns.into(), vmi.metadata.name.clone(), net.name.clone());
            tr.out.keep.insert(key.clone());
            let mac = vmi
                .spec
                .domain
                .devices
                .interfaces
                .iter()
                .find(|i| i.name == net.name)
                .and_then(|i| i.mac_address.as_deref().map(String::from));
            // The pod's interface for this network: by the NAD it selects.
            let iface_of =
                |pod: &(usize, Vec<PodInterface>)| pod.1.iter().find(|i| i.nad == nad).cloned();
            let mut missing = Vec::new();
            for pod in running_pod.iter().chain(target_pod.iter()) {
                if iface_of(pod).is_none() {
                    missing.push(pod.0);
                }
            }
            if !missing.is_empty() {
                for pi in missing {
                    let files = tr.take_all_cni(pods[pi].value);
                    // KubeVirt's pod network on Multus is the pod's
                    // default network, named in its own annotation.
                    let annotation = if multus.default {
                        DEFAULT_NETWORK_ANNOTATION
                    } else {
                        NETWORKS_ANNOTATION
                    };
                    tr.refuse_pod(&pods[pi], files, format!(
                        "selects no network for VirtualMachineInstance {}/{}'s network {:?} (NetworkAttachmentDefinition {nad}) in {annotation}",
                        ns, vmi.metadata.name, net.name
                    ));
                }
                continue;
            }
            let running = running_pod.map(|p| (p, iface_of(p).expect("checked above")));
            let selection = running
                .as_ref()
                .map(|(_, i)| i.selection.clone())
                .unwrap_or_default();
            // Addresses: the IPAMClaim the selection references (or
            // ipam-extensions' `<vm>.<network>`), else static requests.
            let claim_name = selection
                .ipam_claim_reference
                .clone()
                .unwrap_or_else(|| format!("{}.{}", vmi.metadata.name, net.name));
            let state = claim_of(ns, &claim_name, &network);
            // A claim is the one place addresses are decided: the
            // selection's `ips` are its static request, which the
            // controller grants or refuses (naming the conflict).
            if let ClaimState::Waits(why) = state {
                let cni_file = running.as_ref().and_then(|((pi, _), iface)| {
                    tr.take_cni(pods[*pi].value, &iface.ifname).map(|c| c.file)
                });
                tr.out.waiting.push(error(
                    cni_file.as_deref().unwrap_or(v.file),
                    object("VirtualMachineInstance", &vmi.metadata),
                    &format!("spec.networks[{}]", net.name),
                    why,
                ));
                continue;
            }
            let ips = match state {
                ClaimState::Ips(ips) => ips,
                _ => selection.ips.clone(),
            };
            let mac = mac.or_else(|| selection.mac.clone());
            let Some(vm_node) = running_node.clone() else {
                continue; // not scheduled yet
            };
            let mut labels = vmi.metadata.labels.clone();
            let mut named_ports = Vec::new();
            if let Some(((pi, _), _)) = &running {
                labels.extend(pods[*pi].value.metadata.labels.clone());
                named_ports = pods[*pi].value.named_ports();
            }
            let (port, file, from) = match &running {
                Some(((pi, _), iface)) => {
                    let pod = &pods[*pi];
                    let cni_port = tr.take_cni(pod.value, &iface.ifname);
                    (
                        cni_port
                            .as_ref()
                            .map(|c| c.port.clone())
                            .unwrap_or_else(|| {
                                placeholder_port(
                                    pod.value.metadata.namespace(),
                                    &pod.value.metadata.name,
                                    &iface.ifname,
                                )
                            }),
                        cni_port.map(|c| c.file).unwrap_or_else(|| pod.file.clone()),
                        vec![
                            source("VirtualMachineInstance", &vmi.metadata),
                            source("Pod", &pod.value.metadata),
                        ],
                    )
                }
                // No pod seen: a VM on another node (an agent reads only
                // its own node's pods), known from its VMI.
                None if vm_node != node => (
                    placeholder_port(ns, &vmi.metadata.name, &net.name),
                    v.file.clone(),
                    vec![source("VirtualMachineInstance", &vmi.metadata)],
                ),
                None => continue, // its pod is not there yet
            };
            let migration_doc = migration.as_ref().map(|m| {
                let (target_port, ready_annotation) = match target_pod {
                    Some(tp) => {
                        let pod = &pods[tp.0].value;
                        let ifname = iface_of(tp).expect("checked above").ifname;
                        let port = tr
                            .take_cni(pod, &ifname)
                            .map(|c| c.port)
                            .unwrap_or_else(|| {
                                placeholder_port(
                                    pod.metadata.namespace(),
                                    &pod.metadata.name,
                                    &ifname,
                                )
                            });
                        (
                            port,
                            pod.metadata
                                .annotations
                                .contains_key(TARGET_READY_ANNOTATION),
                        )
                    }
                    None => (
                        placeholder_port(
                            ns,
                            &vmi.metadata.name,
                            &format!("{}@{}", net.name, m.target_node),
                        ),
                        false,
                    ),
                };
                json!({
                    "targetNode": m.target_node,
                    "targetPort": target_port,
                    "ready": m.ready || ready_annotation,
                })
            });
            tr.derive(Derived {
                file,
                name: format!("{}-{}", vmi.metadata.name, net.name),
                from,
                key,
                network,
                node: vm_node,
                port,
                mac,
                ips,
                migration: migration_doc,
                labels,
                ports: named_ports,
            });
        }
    }

    // CNI ports of pods with a Pod object that nothing above took.
    let pod_names: HashSet<(&str, &str)> = pods
        .iter()
        .map(|p| (p.value.metadata.namespace(), p.value.metadata.name.as_str()))
        .collect();
    let leftover: Vec<((String, String, String), CniPort)> = tr
        .cni
        .iter()
        .filter(|((ns, pod, _), _)| pod_names.contains(&(ns.as_str(), pod.as_str())))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for ((ns, pod, ifname), port) in leftover {
        tr.cni.remove(&(ns.clone(), pod.clone(), ifname.clone()));
        // eth0 is the default network's: its annotation is the one to name.
        let annotation = if ifname == DEFAULT_NETWORK_IFNAME {
            DEFAULT_NETWORK_ANNOTATION
        } else {
            NETWORKS_ANNOTATION
        };
        tr.out.errors.push(error(
            &port.file,
            ObjectRef {
                kind: "Pod".into(),
                namespace: ns.clone(),
                name: pod.clone(),
            },
            &format!("metadata.annotations[{annotation:?}]"),
            format!("no vmpath network of the pod is its interface {ifname:?} (the CNI plugin was called for it on network {:?})", port.network),
        ));
    }
    // A port whose Pod is not read (yet, or any more): with the
    // Kubernetes source its addresses on an IPAM network come from a
    // claim too, never from the agent's IPAM. It waits.
    if pod_claims {
        let held: Vec<(String, String, String)> = cni
            .iter()
            .filter(|(_, c)| ipam_networks.contains(&c.network))
            .map(|(k, _)| k.clone())
            .collect();
        for k in held {
            let port = cni.remove(&k).expect("listed above");
            let (ns, pod, _) = k;
            t.waiting.push(error(
                &port.file,
                ObjectRef {
                    kind: "Pod".into(),
                    namespace: ns.clone(),
                    name: pod.clone(),
                },
                "",
                format!(
                    "waits for Pod {ns}/{pod} to be read, and for its IPAMClaim's status.ips: addresses on network {:?} are allocated by vmpath controller",
                    port.network
                ),
            ));
        }
    }
    // CNI ports taken above stand for their pod's interface: their own
    // Attachment documents go.
    let remaining: BTreeSet<SourceFile> = cni.values().map(|c| c.file.clone()).collect();
    t.documents.retain(|d| {
        d.origin != DocOrigin::CniPort
            || d.value.get("kind").and_then(Value::as_str) != Some("Attachment")
            || remaining.contains(&*d.file)
    });
    t
}

/// What an IPAMClaim gives an interface.
enum ClaimState {
    /// No claim, or none on an IPAM network and no addresses: the
    /// selection's `ips` (if any) are the interface's.
    Empty,
    /// Its `status.ips`, trusted.
    Ips(Vec<String>),
    /// Nothing yet: the interface waits, for this reason.
    Waits(String),
}

/// A migration in progress, as the VMI and its VMIM say.
struct MigrationNow {
    uid: Option<String>,
    source_node: String,
    target_node: String,
    source_pod: Option<String>,
    target_pod: Option<String>,
    /// The domain runs on the target: cut over.
    ready: bool,
}

/// The VMI's migration in progress, and the node a migration that
/// succeeded left the VM on (KubeVirt may write `completed` before
/// `status.nodeName`).
///
/// KubeVirt's order: the VMIM (`Pending`, `Scheduling`) gets a target
/// virt-launcher pod labelled with its uid; the pod runs (its CNI ADD
/// returned) before `status.migrationState` is written (`PreparingTarget`,
/// `TargetReady`, `Running`). So a VMIM that is neither `Failed` nor
/// `Succeeded` with its target pod on another node than the VMI's is a
/// migration already, known to the target node (the only agent that sees
/// the pod): its target port is programmed pending. `migrationState`
/// outlives its migration (`completed`/`failed` stay until the next one);
/// a VMIM of another uid is a newer migration.
fn migration_of(
    vmi: &Vmi,
    vmims: &[&Object<Vmim>],
    target_pods: &[(crate::sys::intern::Name, &str, Option<&str>)],
) -> (Option<MigrationNow>, Option<String>) {
    let mine = |m: &&&Object<Vmim>| {
        m.value.metadata.namespace() == vmi.metadata.namespace()
            && m.value.spec.vmi_name == vmi.metadata.name
    };
    let ended = |m: &Object<Vmim>| {
        matches!(
            m.value.status.phase.as_deref(),
            Some("Failed") | Some("Succeeded")
        )
    };
    let ms = vmi.status.migration_state.as_ref();
    // The VMIM migrationState speaks of, when it names one.
    let current = ms.and_then(|ms| {
        vmims.iter().filter(mine).find(|m| {
            ms.migration_uid.is_none() || m.value.metadata.uid_is(ms.migration_uid.as_deref())
        })
    });
    // A newer migration than the one migrationState records.
    let newer = vmims.iter().filter(mine).find(|m| {
        !ended(m)
            && m.value.metadata.uid.is_some()
            && ms.is_none_or(|ms| {
                ms.migration_uid.is_some() && !m.value.metadata.uid_is(ms.migration_uid.as_deref())
            })
    });
    if let Some(ms) = ms.filter(|_| newer.is_none()) {
        let succeeded = ms.completed && !ms.failed
            || current.is_some_and(|m| m.value.status.phase.as_deref() == Some("Succeeded"));
        if succeeded {
            return (None, ms.target_node.as_ref().map(|n| n.to_string()));
        }
        if ms.failed || current.is_some_and(|m| ended(m)) {
            return (None, None);
        }
        let Some((source_node, target_node)) = ms
            .source_node
            .clone()
            .or_else(|| vmi.status.node_name.clone())
            .zip(ms.target_node.clone())
        else {
            return (None, None);
        };
        return (
            Some(MigrationNow {
                uid: ms.migration_uid.clone(),
                source_node: source_node.to_string(),
                target_node: target_node.to_string(),
                source_pod: ms.source_pod.clone(),
                target_pod: ms.target_pod.clone(),
                ready: ms.target_node_domain_ready_timestamp.is_some(),
            }),
            None,
        );
    }
    // No migrationState for it yet: the VMIM and its target pod.
    let Some(vmim) = newer else {
        return (None, None);
    };
    let Some(source_node) = vmi.status.node_name.clone() else {
        return (None, None);
    };
    let uid = vmim.value.metadata.uid.as_ref().map(ToString::to_string);
    let target = target_pods.iter().find(|(pod_uid, _, node)| {
        Some(pod_uid.as_str()) == uid.as_deref() && node.is_some_and(|n| n != source_node)
    });
    match target {
        Some((_, pod, Some(target_node))) => (
            Some(MigrationNow {
                uid,
                source_node: source_node.to_string(),
                target_node: target_node.to_string(),
                source_pod: None,
                target_pod: Some(pod.to_string()),
                ready: false,
            }),
            None,
        ),
        _ => (None, None),
    }
}

/// One derived Attachment, before it becomes a document.
struct Derived {
    file: SourceFile,
    name: String,
    from: Vec<SourceObject>,
    key: AttachmentKey,
    network: String,
    node: String,
    port: String,
    mac: Option<String>,
    ips: Vec<String>,
    migration: Option<Value>,
    /// The endpoint's labels, for NetworkPolicy and Services: a pod's own;
    /// a VM's, its VMI's with its virt-launcher pod's over them (KubeVirt
    /// copies the VMI's onto the pod and adds its own).
    labels: crate::config::label_selector::Labels,
    /// Named ports its pod declares (a VM's: its virt-launcher pod's).
    ports: Vec<Value>,
}

struct Translator<'a> {
    node: &'a str,
    nad_index: &'a BTreeMap<String, Result<NadConfig, String>>,
    not_primary: &'a BTreeSet<String>,
    cni: &'a mut BTreeMap<(String, String, String), CniPort>,
    out: &'a mut Translated,
}

impl Translator<'_> {
    /// The CNI port of one pod interface, taken: its own document goes.
    fn take_cni(&mut self, pod: &Pod, ifname: &str) -> Option<CniPort> {
        if pod
            .spec
            .node_name
            .as_deref()
            .is_some_and(|n| n != self.node)
        {
            return None;
        }
        self.cni.remove(&(
            pod.metadata.namespace().to_string(),
            pod.metadata.name.to_string(),
            ifname.to_string(),
        ))
    }

    /// Every CNI port of a pod, taken.
    fn take_all_cni(&mut self, pod: &Pod) -> Vec<PathBuf> {
        let ns = pod.metadata.namespace().to_string();
        let keys: Vec<_> = self
            .cni
            .keys()
            .filter(|(n, p, _)| *n == ns && *p == pod.metadata.name)
            .cloned()
            .collect();
        keys.into_iter()
            .filter_map(|k| self.cni.remove(&k))
            .map(|c| c.file.to_path_buf())
            .collect()
    }

    /// A refusal of a pod: on its CNI ports (so their ADD fails naming
    /// it), else on its file.
    fn refuse_pod(&mut self, p: &Object<Pod>, cni_files: Vec<PathBuf>, message: String) {
        self.refuse_pod_for(p, cni_files, message, None);
    }

    /// [`Self::refuse_pod`], with a reason a program acts on.
    fn refuse_pod_for(
        &mut self,
        p: &Object<Pod>,
        cni_files: Vec<PathBuf>,
        message: String,
        reason: Option<RefusalReason>,
    ) {
        let document = object("Pod", &p.value.metadata);
        let files = if cni_files.is_empty() {
            vec![p.file.to_path_buf()]
        } else {
            cni_files
        };
        for f in files {
            let mut e = error(&f, document.clone(), "", message.clone());
            e.reason = reason;
            self.out.errors.push(e);
        }
    }

    /// The pod's interfaces on vmpath networks: its default network
    /// (`eth0`, Multus's default-network annotation) and its selection
    /// annotation's; `None` once the pod is refused.
    fn pod_interfaces(&mut self, p: &Object<Pod>) -> Option<Vec<PodInterface>> {
        let pod = &p.value;
        let ns = pod.metadata.namespace();
        let field = format!("metadata.annotations[{NETWORKS_ANNOTATION:?}]");
        let default_field = format!("metadata.annotations[{DEFAULT_NETWORK_ANNOTATION:?}]");
        // (where a refusal points, the element, the pod's interface, eth0?)
        let mut elements: Vec<(String, NetworkSelection, String, bool)> = Vec::new();
        if let Some(text) = pod.metadata.annotations.get(DEFAULT_NETWORK_ANNOTATION) {
            // Multus reads it as a selection and takes its first element,
            // always as eth0.
            match objects::parse_selection(text) {
                Ok(s) if s.len() == 1 => {
                    let sel = s.into_iter().next().expect("one element");
                    let ifname = DEFAULT_NETWORK_IFNAME.to_string();
                    elements.push((default_field.clone(), sel, ifname, true));
                }
                Ok(s) => {
                    let files = self.take_all_cni(pod);
                    self.refuse_field(
                        p,
                        files,
                        &default_field,
                        format!("names {} networks: a pod has one default network", s.len()),
                    );
                    return None;
                }
                Err(msg) => {
                    let files = self.take_all_cni(pod);
                    self.refuse_field(p, files, &default_field, msg);
                    return None;
                }
            }
        }
        let selection = match pod.metadata.annotations.get(NETWORKS_ANNOTATION) {
            Some(text) => match objects::parse_selection(text) {
                Ok(s) => s,
                Err(msg) => {
                    let files = self.take_all_cni(pod);
                    self.refuse_field(p, files, &field, msg);
                    return None;
                }
            },
            None => Vec::new(),
        };
        for (i, sel) in selection.into_iter().enumerate() {
            let ifname = sel.interface_name(i);
            elements.push((format!("{field}[{i}]"), sel, ifname, false));
        }
        let mut out = Vec::new();
        for (at, sel, ifname, default) in elements {
            let nad = format!("{}/{}", sel.namespace.as_deref().unwrap_or(ns), sel.name);
            let here = self
                .cni
                .get(&(
                    ns.to_string(),
                    pod.metadata.name.to_string(),
                    ifname.clone(),
                ))
                .cloned();
            let refuse = |me: &mut Self, msg: String| {
                let files = match &here {
                    Some(c) => {
                        me.cni.remove(&(
                            ns.to_string(),
                            pod.metadata.name.to_string(),
                            ifname.clone(),
                        ));
                        vec![c.file.to_path_buf()]
                    }
                    None => Vec::new(),
                };
                me.refuse_field(p, files, &at, msg);
            };
            let network = match self.nad_index.get(&nad) {
                None => {
                    refuse(
                        self,
                        format!("NetworkAttachmentDefinition {nad} is not known"),
                    );
                    continue;
                }
                Some(Err(msg)) => {
                    refuse(
                        self,
                        format!("NetworkAttachmentDefinition {nad} is refused: {msg}"),
                    );
                    continue;
                }
                Some(Ok(NadConfig::Other { plugin_type })) => {
                    if here.is_some() {
                        refuse(
                            self,
                            format!(
                                "NetworkAttachmentDefinition {nad} is not a vmpath network (its plugin is {plugin_type:?}), yet vmpath-cni was called for interface {ifname:?}"
                            ),
                        );
                    }
                    continue;
                }
                Some(Ok(NadConfig::Vmpath { network })) => network.clone(),
            };
            if default && self.not_primary.contains(&network) {
                refuse(
                    self,
                    format!(
                        "NetworkAttachmentDefinition {nad} binds network {network:?}, which is not role: Primary: a pod's default network ({DEFAULT_NETWORK_IFNAME}, its default route) must be"
                    ),
                );
                continue;
            }
            let nad_namespace = nad.split_once('/').map(|(n, _)| n).unwrap_or(ns);
            if let Err(msg) = namespace_may_attach(nad_namespace, &network) {
                refuse(self, msg);
                continue;
            }
            if let Some(c) = &here
                && c.network != network
            {
                refuse(
                    self,
                    format!(
                        "NetworkAttachmentDefinition {nad} binds network {network:?}, but vmpath-cni was called for interface {ifname:?} on network {:?}",
                        c.network
                    ),
                );
                continue;
            }
            out.push(PodInterface {
                selection: sel,
                nad,
                ifname,
                network,
            });
        }
        Some(out)
    }

    fn refuse_field(&mut self, p: &Object<Pod>, files: Vec<PathBuf>, field: &str, message: String) {
        let document = object("Pod", &p.value.metadata);
        let files = if files.is_empty() {
            vec![p.file.to_path_buf()]
        } else {
            files
        };
        for f in files {
            self.out
                .errors
                .push(error(&f, document.clone(), field, message.clone()));
        }
    }

    fn derive(&mut self, d: Derived) {
        let mut spec = json!({
            "vm": d.key.vm,
            "interface": d.key.interface,
            "network": d.network,
            "node": d.node,
            "port": d.port,
            "ips": d.ips,
        });
        if let Some(mac) = d.mac {
            spec["mac"] = mac.into();
        }
        if let Some(m) = d.migration {
            spec["migration"] = m;
        }
        if !d.ports.is_empty() {
            spec["ports"] = d.ports.into();
        }
        self.out.documents.push(RawDocument {
            file: d.file,
            index: 1,
            origin: DocOrigin::Derived(d.from.into()),
            value: std::sync::Arc::new(json!({
                "apiVersion": API_VERSION,
                "kind": "Attachment",
                "metadata": {
                    "name": d.name,
                    "namespace": d.key.namespace,
                    "labels": d.labels,
                },
                "spec": spec,
            })),
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::config::{self, Config, source::Snapshot};

    const NETWORK: &str = include_str!("fixtures/network.yaml");
    const VM: &str = include_str!("fixtures/vm.yaml");
    const POD: &str = "virt-launcher-vm1-x7k2p";
    const VMI_UID: &str = "5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8a";

    fn docs(file: &str, yaml: &str) -> Vec<RawDocument> {
        config::source::parse(yaml.as_bytes())
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, value)| RawDocument {
                file: std::path::Path::new(file).into(),
                index: i + 1,
                origin: crate::config::DocOrigin::Given,
                value: value.into(),
            })
            .collect()
    }

    /// A port the CNI plugin handed over, as `endpoints` turns it into a
    /// document.
    fn cni_port(pod: &str, ifname: &str, port: &str) -> RawDocument {
        cni_port_in("prod", pod, ifname, port)
    }

    fn cni_port_in(namespace: &str, pod: &str, ifname: &str, port: &str) -> RawDocument {
        RawDocument {
            file: std::path::Path::new(&format!("{CNI_SOURCE_PREFIX}c0ffee{pod}/{ifname}")).into(),
            index: 1,
            origin: crate::config::DocOrigin::CniPort,
            value: json!({
                "apiVersion": API_VERSION,
                "kind": "Attachment",
                "metadata": {"name": format!("{pod}-{ifname}"), "namespace": namespace},
                "spec": {"vm": pod, "interface": ifname, "network": "blue", "node": "node-a", "port": port},
            }).into(),
        }
    }

    fn validate(files: &[(&str, &str)], cni: Vec<RawDocument>, node: &str) -> Config {
        let mut snap = Snapshot::default();
        for (file, yaml) in files {
            snap.documents.extend(docs(file, yaml));
        }
        snap.documents.extend(cni);
        let cfg = crate::round::validate(&snap, node, &BTreeSet::new());
        // Every scenario here also runs on the objects as they are stored
        // (typed, pruned to the fields read): the outcome must be the same.
        let mut stored = Snapshot::default();
        for d in &snap.documents {
            let (objects, document) =
                crate::config::kube_objects::prune::keep_all((*d.value).clone());
            stored
                .cluster
                .extend(objects.into_iter().map(|object| ClusterDocument {
                    file: d.file.clone(),
                    index: crate::config::source::doc_index(d.index),
                    object,
                }));
            stored
                .documents
                .extend(document.map(|value| RawDocument { value, ..d.clone() }));
        }
        assert_eq!(
            format!(
                "{:?}",
                crate::round::validate(&stored, node, &BTreeSet::new())
            ),
            format!("{cfg:?}"),
            "keeping the objects typed changed the outcome"
        );
        cfg
    }

    fn key(ns: &str, vm: &str, interface: &str) -> AttachmentKey {
        AttachmentKey::new(ns.into(), vm.into(), interface.into())
    }

    #[test]
    fn a_vm_interface_is_derived_from_its_pod_vmi_nad_and_claim() {
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(
            cfg.attachments.len(),
            1,
            "the CNI port's own document is gone"
        );
        let a = &cfg.attachments[0];
        assert_eq!(a.key, key("prod", "vm1", "blue"), "the VMI's identity");
        assert_eq!(a.network, "blue", "from the NAD's config");
        assert_eq!(a.node, "node-a");
        assert_eq!(a.port, "vmp0a1b2c3d4e", "the port CNI created for the pod");
        assert_eq!(
            a.mac,
            Some([2, 0, 0, 0x31, 0, 0x0b]),
            "the VMI's macAddress"
        );
        assert_eq!(
            a.ips[..],
            ["10.31.0.11/24".parse().unwrap()],
            "the IPAMClaim's status.ips"
        );
        assert!(a.migration.is_none());
        // NetworkPolicy selects the VM by its labels: the VMI's, and what
        // KubeVirt put on its virt-launcher pod.
        assert_eq!(
            a.labels.get("kubevirt.io/vm").map(|v| v.as_str()),
            Some("vm1")
        );
        assert_eq!(
            a.labels.get("kubevirt.io").map(|v| v.as_str()),
            Some("virt-launcher")
        );
        assert!(
            a.source.document().contains(
                "derived from VirtualMachineInstance prod/vm1 and Pod prod/virt-launcher-vm1-x7k2p"
            ),
            "{}",
            a.source.document()
        );
        assert!(cfg.keys_in_documents.contains(&a.key));
        // The v1 Node gives the underlay address.
        assert_eq!(cfg.nodes["node-a"].address.to_string(), "192.0.2.10");
    }

    /// An IPv6-only cluster: the v1 Nodes' InternalIPs are IPv6, and so is
    /// the underlay (a dual-stack Node gives its first InternalIP, the
    /// cluster's primary family, as kubelet lists it).
    #[test]
    fn a_v1_nodes_ipv6_internal_ip_is_its_underlay_address() {
        let v6 = NETWORK.replace(
            "  - {type: InternalIP, address: 192.0.2.10}\n",
            "  - {type: InternalIP, address: 'fd00:192::10'}\n  - {type: InternalIP, address: 192.0.2.10}\n",
        );
        assert_ne!(v6, NETWORK, "the fixture's Node");
        let cfg = validate(&[("network.yaml", &v6)], vec![], "node-a");
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(cfg.nodes["node-a"].address.to_string(), "fd00:192::10");
    }

    #[test]
    fn a_claim_without_addresses_holds_the_vm_back_and_says_so_on_its_port() {
        // The claim exists (KubeVirt made it) but the controller has not
        // written status.ips yet: no address of the agent's own.
        let pending = VM.replace("status:\n  ips: [10.31.0.11/24]", "");
        assert_ne!(pending, VM, "the fixture's claim status");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &pending)],
            vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert!(cfg.attachments.is_empty(), "{:#?}", cfg.attachments);
        assert!(cfg.keys_in_documents.contains(&key("prod", "vm1", "blue")));
        let w = cfg
            .warnings
            .iter()
            .find(|w| {
                w.message
                    .contains("waits for IPAMClaim prod/vm1.blue's status.ips")
            })
            .unwrap_or_else(|| panic!("{:#?}", cfg.warnings));
        assert!(
            w.file.to_string_lossy().starts_with(CNI_SOURCE_PREFIX),
            "on the CNI port, for the plugin's ADD: {w:?}"
        );
    }

    /// The fixture with `ips` in the pod's selection element.
    fn asking(vm: &str, ip: &str) -> String {
        let out = vm.replace(
            r#"[{"name":"blue","#,
            &format!(r#"[{{"name":"blue","ips":["{ip}"],"#),
        );
        assert_ne!(out, vm, "the fixture's selection");
        out
    }

    #[test]
    fn a_selections_ips_are_its_claims_request_the_controller_decides() {
        // The claim pending: the VM waits for the controller even though
        // its selection names an address (the controller grants it).
        let pending = asking(VM, "10.31.0.150/24").replace("status:\n  ips: [10.31.0.11/24]", "");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &pending)],
            vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")],
            "node-a",
        );
        assert!(cfg.attachments.is_empty(), "{:#?}", cfg.attachments);
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.message.contains("waits for IPAMClaim prod/vm1.blue")),
            "{:#?}",
            cfg.warnings
        );
        // Once written, the claim's addresses are the VM's.
        let cfg = validate(
            &[
                ("network.yaml", NETWORK),
                ("vm.yaml", &asking(VM, "10.31.0.150/24")),
            ],
            vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(
            cfg.attachments[0].ips[..],
            ["10.31.0.11/24".parse::<ipnet::IpNet>().unwrap()]
        );
    }

    #[test]
    fn without_a_claim_a_selections_ips_are_a_static_request_conflicts_named() {
        // No IPAMClaim at all: the selection's `ips` are the interface's
        // static request, checked by the agent's IPAM like any other.
        let no_claim = |vm: &str| -> String {
            vm.split("\n---\n")
                .filter(|d| !d.contains("kind: IPAMClaim"))
                .collect::<Vec<_>>()
                .join("\n---\n")
        };
        let vm1 = no_claim(&asking(VM, "10.31.0.150/24"));
        let vm2 = no_claim(&asking(VM, "10.31.0.150/24"))
            .replace("vm1", "vm2")
            .replace("5d1c5a3e", "6d1c5a3e")
            .replace("02:00:00:31:00:0b", "02:00:00:31:00:0c");
        let cfg = validate(
            &[
                ("network.yaml", NETWORK),
                ("vm1.yaml", &vm1),
                ("vm2.yaml", &vm2),
            ],
            vec![],
            "node-a",
        );
        let vm1_ifaces: Vec<_> = cfg
            .attachments
            .iter()
            .filter(|a| a.key.vm == "vm1")
            .collect();
        assert_eq!(
            vm1_ifaces[0].ips[..],
            ["10.31.0.150/24".parse::<ipnet::IpNet>().unwrap()],
            "{:#?}",
            cfg.attachments
        );
        assert!(
            !cfg.attachments.iter().any(|a| a.key.vm == "vm2"),
            "{:#?}",
            cfg.attachments
        );
        assert!(
            cfg.errors.iter().any(|e| e.document.contains("vm2")
                && e.message
                    .contains("10.31.0.150 is already used by Attachment prod/vm1-blue")),
            "{:#?}",
            cfg.errors
        );
    }

    #[test]
    fn without_its_cni_port_the_vm_waits_for_it_and_keeps_its_claim() {
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(a.port, placeholder_port("prod", POD, "pod16477688c0e"));
        // No VMI, no pod: the claim is released; a VMI alone keeps it.
        let vmi_only: String = VM
            .split("\n---\n")
            .next()
            .unwrap()
            .replace("  nodeName: node-a\n  phase", "  phase");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vmi_only)],
            vec![],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert!(
            cfg.attachments.is_empty(),
            "not scheduled: nothing to program"
        );
        assert!(cfg.keys_in_documents.contains(&key("prod", "vm1", "blue")));
    }

    #[test]
    fn a_vm_on_another_node_is_known_from_its_vmi() {
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![],
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(
            (a.node.as_str(), a.mac),
            ("node-a", Some([2, 0, 0, 0x31, 0, 0x0b]))
        );
        // The node's own pods only: without the pod, the VMI and the
        // claim named after ipam-extensions' convention give it.
        let no_pod: Vec<&str> = VM
            .split("\n---\n")
            .filter(|d| !d.contains("kind: Pod"))
            .collect();
        let cfg = validate(
            &[
                ("network.yaml", NETWORK),
                ("vm.yaml", &no_pod.join("\n---\n")),
            ],
            vec![],
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(a.node, "node-a");
        assert_eq!(a.ips[..], ["10.31.0.11/24".parse().unwrap()]);
        assert!(
            a.source
                .document()
                .ends_with("(derived from VirtualMachineInstance prod/vm1)")
        );
    }

    /// One refusal, naming `document` and saying `says`, on `file`.
    fn refused(cfg: &Config, file: &str, document: &str, says: &str) {
        assert!(
            cfg.errors.iter().any(|e| e.file.to_string_lossy() == file
                && e.document.contains(document)
                && e.message.contains(says)),
            "no refusal of {document} in {file} saying {says:?}: {:#?}",
            cfg.errors
        );
    }

    /// Where a document came from is its reader's word, not the
    /// document's: a tenant's Attachment that says it was derived from
    /// another namespace's VMI (the annotation translation once wrote and
    /// validation believed) is a file's document, and its refusal is
    /// posted on no object; a derived one's is about its VMI.
    #[test]
    fn a_files_document_cannot_claim_to_be_derived_from_another_tenants_vm() {
        let forged = r#"
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata:
  name: thief
  namespace: tenant
  annotations: {"vmpath.dev/derived-from": "VirtualMachineInstance prod/vm1"}
spec: {vm: thief, interface: eth0, network: nowhere, node: node-a, port: p0}
"#;
        let cfg = validate(
            &[("network.yaml", NETWORK), ("thief.yaml", forged)],
            vec![],
            "node-a",
        );
        let e = cfg
            .errors
            .iter()
            .find(|e| e.file.to_str() == Some("thief.yaml"))
            .expect("the forged document is refused (no such network)");
        assert_eq!(e.document, "Attachment tenant/thief", "{e}");
        assert_eq!(e.about, None, "{e}");
        assert!(
            crate::publish::writeback::events_of(&cfg.errors, &[]).is_empty(),
            "no Event for a file's document"
        );

        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")],
            "node-a",
        );
        let a = cfg.attachments.first().expect("the VM's interface");
        assert!(a.source.origin.is_from_vmi(), "{:?}", a.source);
        assert_eq!(
            a.source.origin.about().map(|o| o.to_string()).as_deref(),
            Some("VirtualMachineInstance prod/vm1")
        );
    }

    /// A tenant's pod that names another namespace's VMI in its
    /// created-by label (the label is the pod's author's word) is not
    /// that VM's launcher: it is refused, and the VM keeps its own pod's
    /// port.
    #[test]
    fn a_pod_cannot_name_another_namespaces_vmi_as_its_creator() {
        let theirs = VM
            .split("\n---\n")
            .find(|d| d.contains("kind: Pod"))
            .expect("the launcher pod")
            .replace(POD, "virt-launcher-thief-aaaaa")
            .replace("namespace: prod", "namespace: tenant");
        let cfg = validate(
            &[
                ("network.yaml", NETWORK),
                ("vm.yaml", VM),
                ("thief.yaml", &theirs),
            ],
            vec![
                cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e"),
                cni_port_in(
                    "tenant",
                    "virt-launcher-thief-aaaaa",
                    "pod16477688c0e",
                    "vmp0thief000",
                ),
            ],
            "node-a",
        );
        let vm1: Vec<_> = cfg
            .attachments
            .iter()
            .filter(|a| a.key.vm == "vm1")
            .collect();
        assert_eq!(vm1.len(), 1, "{:?}", cfg.attachments);
        assert_eq!(vm1[0].port, "vmp0a1b2c3d4e", "vm1 keeps its own pod's port");
        assert!(
            cfg.attachments.iter().all(|a| a.key.namespace != "tenant"),
            "{:?}",
            cfg.attachments
        );
        let file = format!("{CNI_SOURCE_PREFIX}c0ffeevirt-launcher-thief-aaaaa/pod16477688c0e");
        refused(
            &cfg,
            &file,
            "Pod tenant/virt-launcher-thief-aaaaa",
            "which is not known",
        );
        // The CNI ADD waits a moment on this reason, not on the words.
        assert!(
            cfg.errors.iter().any(|e| e.file.to_string_lossy() == file
                && e.reason == Some(RefusalReason::VmiNotKnown)),
            "{:#?}",
            cfg.errors
        );
    }

    #[test]
    fn every_refusal_names_the_object_and_reaches_the_cni_add() {
        let port = || vec![cni_port(POD, "pod16477688c0e", "vmp0a1b2c3d4e")];
        let cni_file = format!("{CNI_SOURCE_PREFIX}c0ffee{POD}/pod16477688c0e");

        // The VMI the pod was created by is not there.
        let vm = VM.replace(
            &format!("created-by: {VMI_UID}"),
            "created-by: 00000000-dead",
        );
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            port(),
            "node-a",
        );
        refused(
            &cfg,
            &cni_file,
            &format!("Pod prod/{POD}"),
            "VirtualMachineInstance prod/vm1 (uid 00000000-dead), which is not known",
        );
        assert!(
            cfg.attachments.is_empty(),
            "nothing programmed for it: {:?}",
            cfg.attachments
        );
        // Without a CNI port the refusal names the pod's file.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            vec![],
            "node-a",
        );
        refused(
            &cfg,
            "vm.yaml",
            &format!("Pod prod/{POD}"),
            "which is not known",
        );

        // The selection names a NAD nobody defined.
        let vm = VM.replace(
            r#""name":"blue","namespace":"prod""#,
            r#""name":"bleu","namespace":"prod""#,
        );
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            port(),
            "node-a",
        );
        refused(
            &cfg,
            &cni_file,
            &format!("Pod prod/{POD}"),
            "NetworkAttachmentDefinition prod/bleu is not known",
        );

        // The NAD is another plugin's, yet vmpath-cni was called.
        let net = NETWORK.replace(r#""type": "vmpath-cni""#, r#""type": "bridge""#);
        let cfg = validate(&[("network.yaml", &net), ("vm.yaml", VM)], port(), "node-a");
        refused(
            &cfg,
            &cni_file,
            &format!("Pod prod/{POD}"),
            "is not a vmpath network (its plugin is \"bridge\")",
        );
        assert!(cfg.attachments.is_empty());
        // ... and without vmpath-cni involved it is simply not vmpath's.
        let cfg = validate(&[("network.yaml", &net), ("vm.yaml", VM)], vec![], "node-a");
        assert!(
            cfg.errors.is_empty() && cfg.attachments.is_empty(),
            "{:#?}",
            cfg.errors
        );

        // A vmpath NAD that names no network.
        let net = NETWORK.replace(r#", "network": "blue""#, "");
        let cfg = validate(&[("network.yaml", &net), ("vm.yaml", VM)], port(), "node-a");
        refused(
            &cfg,
            "network.yaml",
            "NetworkAttachmentDefinition prod/blue",
            "names no \"network\"",
        );
        refused(
            &cfg,
            &cni_file,
            &format!("Pod prod/{POD}"),
            "NetworkAttachmentDefinition prod/blue is refused",
        );

        // The NAD binds a Network that does not exist: the derived
        // Attachment is refused by the same validation as any other.
        let net = NETWORK.replace(r#""network": "blue""#, r#""network": "green""#);
        let cfg = validate(&[("network.yaml", &net), ("vm.yaml", VM)], vec![], "node-a");
        refused(
            &cfg,
            "vm.yaml",
            "Attachment prod/vm1-blue (derived from VirtualMachineInstance prod/vm1 and Pod prod/virt-launcher-vm1-x7k2p)",
            "unknown network \"green\"",
        );

        // The pod does not select the VMI's network.
        let vm = VM.replace(r#"networkName: prod/blue"#, "networkName: prod/red")
            + "---\napiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {name: red, namespace: prod}\nspec: {config: '{\"type\": \"vmpath-cni\", \"network\": \"blue\"}'}\n";
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            port(),
            "node-a",
        );
        refused(
            &cfg,
            &cni_file,
            &format!("Pod prod/{POD}"),
            "selects no network for VirtualMachineInstance prod/vm1's network \"blue\" (NetworkAttachmentDefinition prod/red)",
        );

        // CNI was called for an interface the pod does not select.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![cni_port(POD, "net9", "vmp99")],
            "node-a",
        );
        refused(
            &cfg,
            &format!("{CNI_SOURCE_PREFIX}c0ffee{POD}/net9"),
            &format!("Pod prod/{POD}"),
            "no vmpath network of the pod is its interface \"net9\"",
        );

        // A Pod object with a broken field names it.
        let vm = VM.replace("phase: Running\n  podIP", "phase: [Running]\n  podIP");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            vec![],
            "node-a",
        );
        refused(
            &cfg,
            "vm.yaml",
            &format!("Pod prod/{POD}"),
            "expected a string",
        );
    }

    const MIGRATING: &str = "  migrationState:
    migrationUid: 7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e
    sourceNode: node-a
    targetNode: node-b
    sourcePod: virt-launcher-vm1-x7k2p
    targetPod: virt-launcher-vm1-q9w8e
    startTimestamp: \"2026-11-30T10:00:00Z\"
    mode: PreCopy
";

    /// The VM mid-migration from node-a to node-b, with its target pod.
    fn migrating(extra_status: &str) -> String {
        let target_pod = VM
            .split("\n---\n")
            .find(|d| d.contains("kind: Pod"))
            .unwrap()
            .replace("virt-launcher-vm1-x7k2p", "virt-launcher-vm1-q9w8e")
            .replace("nodeName: node-a", "nodeName: node-b")
            .replace(
                "    kubevirt.io: virt-launcher\n",
                "    kubevirt.io: virt-launcher\n    kubevirt.io/migrationJobUID: 7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e\n",
            );
        let vm = VM.replace(
            "  migrationMethod: LiveMigration\n",
            &format!("  migrationMethod: LiveMigration\n{MIGRATING}{extra_status}"),
        );
        format!(
            "{vm}---\n{target_pod}\n---\napiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: mig1, namespace: prod, uid: 7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e}}\nspec: {{vmiName: vm1}}\nstatus: {{phase: Running}}\n"
        )
    }

    #[test]
    fn a_migration_is_derived_from_the_vmi_and_its_target_pod() {
        let target_port = "vmp5566778899";
        let cni = |pod: &str, port: &str| vec![cni_port(pod, "pod16477688c0e", port)];
        let vm = migrating("");
        // On the target node: the target pod's port, pending.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni("virt-launcher-vm1-q9w8e", target_port),
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(a.node, "node-a");
        let m = a.migration.as_ref().expect("a migration");
        assert_eq!(
            (m.target_node.as_str(), m.target_port.as_deref(), m.ready),
            ("node-b", Some(target_port), false)
        );
        assert_eq!(
            a.ips[..],
            ["10.31.0.11/24".parse().unwrap()],
            "same addresses on both sides"
        );
        // On the source node: its own pod's port.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(POD, "vmp0a1b2c3d4e"),
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(cfg.attachments[0].port, "vmp0a1b2c3d4e");
        assert!(!cfg.attachments[0].migration.as_ref().unwrap().ready);

        // The domain runs on the target: cut over.
        let vm = migrating("    targetNodeDomainReadyTimestamp: \"2026-11-30T10:00:07Z\"\n");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni("virt-launcher-vm1-q9w8e", target_port),
            "node-b",
        );
        assert!(cfg.attachments[0].migration.as_ref().unwrap().ready);

        // The VMIM failed: rolled back, no migration, the source's pod.
        let vm = migrating("").replace("status: {phase: Running}", "status: {phase: Failed}");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(POD, "vmp0a1b2c3d4e"),
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert!(cfg.attachments[0].migration.is_none());
        assert_eq!(
            (
                cfg.attachments[0].node.as_str(),
                cfg.attachments[0].port.as_str()
            ),
            ("node-a", "vmp0a1b2c3d4e")
        );

        // Completed: the VMI's node is the target's, its pod runs the VM.
        let vm = migrating("    completed: true\n").replace(
            "  nodeName: node-a\n  phase: Running",
            "  nodeName: node-b\n  phase: Running",
        );
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni("virt-launcher-vm1-q9w8e", target_port),
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert!(a.migration.is_none());
        assert_eq!((a.node.as_str(), a.port.as_str()), ("node-b", target_port));
    }

    #[test]
    fn a_migration_follows_kubevirts_order_of_writes() {
        let target_port = "vmp5566778899";
        let target_pod = "virt-launcher-vm1-q9w8e";
        let cni = |pod: &str, port: &str| vec![cni_port(pod, "pod16477688c0e", port)];
        let without_state = |phase: &str| {
            migrating("").replace(MIGRATING, "").replace(
                "status: {phase: Running}",
                &format!("status: {{phase: {phase}}}"),
            )
        };
        // Scheduling: the target pod exists, migrationState does not yet.
        // The target node programs its port pending (the ADD returns).
        let vm = without_state("Scheduling");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(target_pod, target_port),
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(a.node, "node-a");
        let m = a
            .migration
            .as_ref()
            .expect("a migration before migrationState");
        assert_eq!(
            (m.target_node.as_str(), m.target_port.as_deref(), m.ready),
            ("node-b", Some(target_port), false)
        );
        // The source node keeps serving the VM on its own port.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(POD, "vmp0a1b2c3d4e"),
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(
            (a.node.as_str(), a.port.as_str()),
            ("node-a", "vmp0a1b2c3d4e")
        );
        assert!(!a.migration.as_ref().is_some_and(|m| m.ready));
        // Failed before migrationState: the target's port is not served,
        // nor refused.
        let vm = without_state("Failed");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(target_pod, target_port),
            "node-b",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert!(a.migration.is_none());
        assert_eq!(a.node, "node-a");
        assert_ne!(a.port, target_port);

        // Completed while status.nodeName still says the source: the
        // target runs the VM; the source's pod is left, its port unserved
        // and not refused.
        let vm = migrating("    completed: true\n");
        for (node, pod, port) in [
            ("node-b", target_pod, target_port),
            ("node-a", POD, "vmp0a1b2c3d4e"),
        ] {
            let cfg = validate(
                &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
                cni(pod, port),
                node,
            );
            assert!(cfg.errors.is_empty(), "{node}: {:#?}", cfg.errors);
            let a = &cfg.attachments[0];
            assert!(a.migration.is_none());
            assert_eq!(a.node, "node-b", "{node}");
            if node == "node-b" {
                assert_eq!(a.port, target_port);
            } else {
                assert_ne!(a.port, port, "the source's port is not served");
            }
        }

        // A VM starting: KubeVirt writes status.nodeName only once the pod
        // runs, after its ADD; the VMI's one pod says where.
        let vm = VM.replace("  nodeName: node-a\n  phase: Running", "  phase: Scheduled");
        assert!(!vm.contains("  nodeName: node-a\n  phase"));
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(POD, "vmp0a1b2c3d4e"),
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(
            (a.node.as_str(), a.port.as_str()),
            ("node-a", "vmp0a1b2c3d4e")
        );

        // A newer VMIM while migrationState still records the last one
        // (completed): the new one, from its target pod.
        let vm = migrating("    completed: true\n")
            .replace("nodeName: node-b", "nodeName: node-c")
            .replace(
                "  nodeName: node-a\n  phase: Running",
                "  nodeName: node-b\n  phase: Running",
            )
            .replace(
                "kubevirt.io/migrationJobUID: 7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e",
                "kubevirt.io/migrationJobUID: 11111111-2222-3333-4444-555555555555",
            )
            .replace(
                "metadata: {name: mig1, namespace: prod, uid: 7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e}",
                "metadata: {name: mig2, namespace: prod, uid: 11111111-2222-3333-4444-555555555555}",
            )
            .replace("status: {phase: Running}", "status: {phase: Scheduled}");
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", &vm)],
            cni(target_pod, target_port),
            "node-c",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let m = cfg.attachments[0]
            .migration
            .as_ref()
            .expect("the newer migration");
        assert_eq!(m.target_node, "node-c");
        assert_eq!(m.target_port.as_deref(), Some(target_port));
    }

    #[test]
    fn a_plain_pod_and_a_kubectl_list_read_too() {
        let list = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata:
    name: web-0
    namespace: prod
    labels: {app: web}
    annotations: {k8s.v1.cni.cncf.io/networks: 'blue'}
  spec:
    nodeName: node-a
    containers:
    - name: web
      ports:
      - {name: http, containerPort: 8080}
      - {name: dns, containerPort: 53, protocol: UDP}
      - {containerPort: 9000}
  status: {phase: Running}
";
        let cni = cni_port("web-0", "net1", "vmp77");
        let mut cni_with_mac = cni.clone();
        std::sync::Arc::make_mut(&mut cni_with_mac.value)["spec"]["mac"] =
            "02:00:00:00:77:01".into();
        let cfg = validate(
            &[("network.yaml", NETWORK), ("pods.yaml", list)],
            vec![cni_with_mac],
            "node-a",
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(
            a.key,
            key("prod", "web-0", "net1"),
            "Multus's default interface name"
        );
        assert_eq!(
            (a.port.as_str(), a.mac),
            ("vmp77", Some([2, 0, 0, 0, 0x77, 1]))
        );
        assert_eq!(
            a.labels.get("app").map(|v| v.as_str()),
            Some("web"),
            "the pod's labels"
        );
        let ports: Vec<(&str, u16, u8)> = a
            .ports
            .iter()
            .map(|p| (p.name.as_str(), p.port, p.protocol))
            .collect();
        assert_eq!(
            ports,
            [("http", 8080, 6), ("dns", 53, 17)],
            "the pod's named container ports (TCP unless said), for NetworkPolicies naming them"
        );
        // A CNI port of a pod without a Pod object is as before.
        let cfg = validate(&[("network.yaml", NETWORK)], vec![cni], "node-a");
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(cfg.attachments[0].key, key("prod", "web-0", "net1"));
    }
    #[test]
    fn with_the_kubernetes_source_a_plain_pod_waits_for_the_claim_made_for_its_uid() {
        let pod = "apiVersion: v1
kind: Pod
metadata:
  name: web-0
  namespace: prod
  uid: pod-uid-2
  annotations: {k8s.v1.cni.cncf.io/networks: '[{\"name\":\"blue\",\"ips\":[\"10.31.0.7/24\"]}]'}
spec: {nodeName: node-a}
status: {phase: Running}
";
        let claim = |uid: &str, ips: &str| {
            format!(
                "apiVersion: k8s.cni.cncf.io/v1alpha1
kind: IPAMClaim
metadata:
  name: web-0.net1
  namespace: prod
  labels: {{vmpath.dev/pod-uid: {uid}}}
spec: {{network: blue, interface: net1}}
status: {{ips: [{ips}]}}
"
            )
        };
        let run = |pod_claims: bool, claim: Option<String>| {
            let mut snap = Snapshot {
                pod_claims,
                ..Default::default()
            };
            snap.documents.extend(docs("network.yaml", NETWORK));
            snap.documents.extend(docs("pod.yaml", pod));
            if let Some(c) = &claim {
                snap.documents.extend(docs("claim.yaml", c));
            }
            snap.documents.push(cni_port("web-0", "net1", "vmp77"));
            let cfg = crate::round::validate(&snap, "node-a", &BTreeSet::new());
            assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
            cfg
        };
        let waits = |cfg: &Config| {
            cfg.attachments.is_empty()
                && cfg.warnings.iter().any(|w| {
                    w.message.starts_with(
                        "waits for IPAMClaim prod/web-0.net1's status.ips: addresses on network \"blue\" are allocated by vmpath controller",
                    ) && w.document == "Pod prod/web-0"
                        && w.file.to_string_lossy().starts_with(CNI_SOURCE_PREFIX)
                })
        };
        // No claim yet, one not allocated yet, or one made for an earlier
        // pod of that name: the interface waits (on its CNI port, for the
        // plugin's ADD), with no address of the agent's own.
        for c in [
            None,
            Some(claim("pod-uid-2", "")),
            Some(claim("pod-uid-1", "10.31.0.9/24")),
        ] {
            let cfg = run(true, c.clone());
            assert!(
                waits(&cfg),
                "{c:?}: {:#?} {:#?}",
                cfg.attachments,
                cfg.warnings
            );
        }
        // Its own claim's addresses, not the selection's request.
        let cfg = run(true, Some(claim("pod-uid-2", "10.31.0.9/24")));
        assert_eq!(
            cfg.attachments[0].ips[..],
            ["10.31.0.9/24".parse::<ipnet::IpNet>().unwrap()]
        );
        // A port whose Pod is not read: it waits too.
        let mut snap = Snapshot {
            pod_claims: true,
            ..Default::default()
        };
        snap.documents.extend(docs("network.yaml", NETWORK));
        snap.documents.push(cni_port("web-9", "net1", "vmp79"));
        let cfg = crate::round::validate(&snap, "node-a", &BTreeSet::new());
        assert!(cfg.attachments.is_empty(), "{:#?}", cfg.attachments);
        assert!(
            cfg.warnings
                .iter()
                .any(|w| w.message.starts_with("waits for Pod prod/web-9 to be read")),
            "{:#?}",
            cfg.warnings
        );
        // Config files (no controller): the agent serves it as before.
        let cfg = run(false, None);
        assert_eq!(cfg.attachments[0].key, key("prod", "web-0", "net1"));
        assert!(!waits(&cfg));
    }
}

/// A pod's default network (`eth0`) on vmpath: Multus's default-network
/// annotation, KubeVirt's `multus: {default: true}`.
#[cfg(test)]
mod default_network_tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::config::{self, Config, source::Snapshot};

    const NETWORK: &str = include_str!("fixtures/network.yaml");
    const VM: &str = include_str!("fixtures/vm-pod-network.yaml");
    const POD: &str = "virt-launcher-vm1-x7k2p";

    /// The fixtures' network blue as a pod network.
    fn primary() -> String {
        NETWORK.replace("  id: 310\n", "  id: 310\n  role: Primary\n")
    }

    fn cni_port(pod: &str, ifname: &str, port: &str) -> RawDocument {
        RawDocument {
            file: std::path::Path::new(&format!("{CNI_SOURCE_PREFIX}c0ffee{pod}/{ifname}")).into(),
            index: 1,
            origin: crate::config::DocOrigin::CniPort,
            value: json!({
                "apiVersion": API_VERSION,
                "kind": "Attachment",
                "metadata": {"name": format!("{pod}-{ifname}"), "namespace": "prod"},
                "spec": {"vm": pod, "interface": ifname, "network": "blue", "node": "node-a", "port": port},
            }).into(),
        }
    }

    fn validate(files: &[(&str, &str)], cni: Vec<RawDocument>) -> Config {
        let mut snap = Snapshot::default();
        for (file, yaml) in files {
            for (i, value) in config::source::parse(yaml.as_bytes())
                .unwrap()
                .into_iter()
                .enumerate()
            {
                snap.documents.push(RawDocument {
                    file: std::path::Path::new(*file).into(),
                    index: i + 1,
                    origin: crate::config::DocOrigin::Given,
                    value: value.into(),
                });
            }
        }
        snap.documents.extend(cni);
        let cfg = crate::round::validate(&snap, "node-a", &BTreeSet::new());
        // The same from the objects as the Kubernetes source stores them
        // (pruned: the default-network annotation must survive it).
        let mut stored = Snapshot::default();
        for d in &snap.documents {
            let (objects, document) =
                crate::config::kube_objects::prune::keep_all((*d.value).clone());
            stored
                .cluster
                .extend(objects.into_iter().map(|object| ClusterDocument {
                    file: d.file.clone(),
                    index: crate::config::source::doc_index(d.index),
                    object,
                }));
            stored
                .documents
                .extend(document.map(|value| RawDocument { value, ..d.clone() }));
        }
        // (The network index is a HashMap: its order is no outcome.)
        let unindexed = |mut c: Config| {
            c.network_index.clear();
            format!("{c:?}")
        };
        assert_eq!(
            unindexed(crate::round::validate(&stored, "node-a", &BTreeSet::new())),
            unindexed(cfg.clone()),
            "keeping the objects typed changed the outcome"
        );
        cfg
    }

    #[test]
    fn a_vms_pod_network_is_its_virt_launcher_pods_eth0() {
        let cfg = validate(
            &[("network.yaml", &primary()), ("vm.yaml", VM)],
            vec![cni_port(POD, "eth0", "vmp0a1b2c3d4e")],
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        assert_eq!(cfg.attachments.len(), 1, "{:#?}", cfg.attachments);
        let a = &cfg.attachments[0];
        assert_eq!(
            (
                a.key.to_string(),
                a.network.as_str(),
                a.port.as_str(),
                a.mac
            ),
            (
                "prod/vm1/default".to_string(),
                "blue",
                "vmp0a1b2c3d4e",
                Some([2, 0, 0, 0x31, 0, 0x0b])
            )
        );
        assert_eq!(a.ips[..], ["10.31.0.11/24".parse().unwrap()]);
        assert!(
            a.source
                .document()
                .contains("VirtualMachineInstance prod/vm1")
                && a.source.document().contains(POD),
            "{}",
            a.source.document()
        );
    }

    #[test]
    fn a_plain_pods_default_network_is_its_eth0_and_its_selection_counts_from_net1() {
        let red = "---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: red}\n\
                   spec: {id: 311, subnets: [10.32.0.0/24], defaultGatewayIPs: [10.32.0.1]}\n---\n\
                   apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\n\
                   metadata: {name: red, namespace: prod}\n\
                   spec: {config: '{\"type\": \"vmpath-cni\", \"network\": \"red\"}'}\n";
        let pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web-0\n  namespace: prod\n  \
                   annotations: {v1.multus-cni.io/default-network: blue, k8s.v1.cni.cncf.io/networks: red}\n\
                   spec: {nodeName: node-a}\nstatus: {phase: Running}\n";
        let mut red_port = cni_port("web-0", "net1", "vmp78");
        std::sync::Arc::make_mut(&mut red_port.value)["spec"]["network"] = "red".into();
        let cfg = validate(
            &[
                ("network.yaml", &format!("{}{red}", primary())),
                ("pods.yaml", pod),
            ],
            vec![cni_port("web-0", "eth0", "vmp77"), red_port],
        );
        assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
        let mut got: Vec<(String, &str, &str)> = cfg
            .attachments
            .iter()
            .map(|a| (a.key.to_string(), a.network.as_str(), a.port.as_str()))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                ("prod/web-0/eth0".to_string(), "blue", "vmp77"),
                ("prod/web-0/net1".to_string(), "red", "vmp78"),
            ]
        );
    }

    fn refused(cfg: &Config, file: &str, field: &str, says: &str) {
        assert!(
            cfg.errors.iter().any(|e| e.file.to_string_lossy() == file
                && e.field == field
                && e.message.contains(says)),
            "no refusal on {file} at {field} saying {says:?}: {:#?}",
            cfg.errors
        );
    }

    /// A tenant's pod naming another tenant's network as its default
    /// network meets the network's namespaceSelector, as a secondary
    /// interface does: refused on the ADD, nothing served.
    #[test]
    fn another_tenants_network_is_no_pods_default_network() {
        let owned = primary().replace(
            "  ipam: {mode: Enabled}\n",
            "  ipam: {mode: Enabled}\n  namespaceSelector: {matchLabels: {tenant: prod}}\n",
        );
        let lab = "apiVersion: v1\nkind: Namespace\nmetadata: {name: lab, labels: {tenant: lab}}\n---\n\
                   apiVersion: v1\nkind: Pod\nmetadata:\n  name: thief\n  namespace: lab\n  \
                   annotations: {v1.multus-cni.io/default-network: prod/blue}\n\
                   spec: {nodeName: node-a}\nstatus: {phase: Running}\n";
        let mut port = cni_port("thief", "eth0", "vmp66");
        std::sync::Arc::make_mut(&mut port.value)["metadata"]["namespace"] = "lab".into();
        let cfg = validate(&[("network.yaml", &owned), ("lab.yaml", lab)], vec![port]);
        assert!(cfg.attachments.is_empty(), "{:#?}", cfg.attachments);
        assert!(
            cfg.errors.iter().any(|e| e.file.to_string_lossy()
                == format!("{CNI_SOURCE_PREFIX}c0ffeethief/eth0")
                && e.message
                    .contains("namespace \"lab\" may not use network \"blue\"")),
            "{:#?}",
            cfg.errors
        );
    }

    #[test]
    fn what_a_pods_default_network_may_not_be() {
        let eth0 = format!("{CNI_SOURCE_PREFIX}c0ffee{POD}/eth0");
        let field = format!("metadata.annotations[{DEFAULT_NETWORK_ANNOTATION:?}]");
        // A Secondary network: no default route by DHCP, the node does not
        // reach it (kubelet probes): refused, the ADD fails naming it.
        let cfg = validate(
            &[("network.yaml", NETWORK), ("vm.yaml", VM)],
            vec![cni_port(POD, "eth0", "vmp0a1b2c3d4e")],
        );
        assert!(cfg.attachments.is_empty(), "{:#?}", cfg.attachments);
        refused(
            &cfg,
            &eth0,
            &field,
            "NetworkAttachmentDefinition prod/blue binds network \"blue\", which is not role: Primary",
        );
        // Two networks named as one pod's default.
        let vm = VM.replace(
            "default-network: prod/blue",
            "default-network: 'prod/blue, prod/red'",
        );
        let cfg = validate(
            &[("network.yaml", &primary()), ("vm.yaml", &vm)],
            vec![cni_port(POD, "eth0", "vmp0a1b2c3d4e")],
        );
        refused(
            &cfg,
            &eth0,
            &field,
            "names 2 networks: a pod has one default network",
        );
        // The plugin called for eth0 of a pod whose default network is not
        // vmpath's: the annotation that would make it so is named.
        let vm = VM.replace("    v1.multus-cni.io/default-network: prod/blue\n", "");
        let cfg = validate(
            &[("network.yaml", &primary()), ("vm.yaml", &vm)],
            vec![cni_port(POD, "eth0", "vmp0a1b2c3d4e")],
        );
        refused(
            &cfg,
            &eth0,
            "",
            "selects no network for VirtualMachineInstance prod/vm1's network \"default\" (NetworkAttachmentDefinition prod/blue) in v1.multus-cni.io/default-network",
        );
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: web-0, namespace: prod}\n\
                   spec: {nodeName: node-a}\nstatus: {phase: Running}\n";
        let cfg = validate(
            &[("network.yaml", &primary()), ("pod.yaml", pod)],
            vec![cni_port("web-0", "eth0", "vmp77")],
        );
        refused(
            &cfg,
            &format!("{CNI_SOURCE_PREFIX}c0ffeeweb-0/eth0"),
            &field,
            "no vmpath network of the pod is its interface \"eth0\"",
        );
    }
}
