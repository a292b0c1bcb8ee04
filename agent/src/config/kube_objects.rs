//! The Kubernetes objects vmpath reads, as minimal serde types: only the
//! fields vmpath uses, every other field ignored (a `kubectl get -o yaml`
//! dump carries many more). KubeVirt's, Multus's and ipam-extensions'
//! types are not published as Rust crates; these follow their documented
//! shapes (kubevirt.io/v1, k8s.cni.cncf.io/v1, k8s.cni.cncf.io/v1alpha1).

pub mod ledger;
pub mod prune;
pub mod uid;

use crate::sys::intern::Name;
use serde::{Deserialize, Serialize};

use crate::config::label_selector::Labels;
pub use uid::Uid;

/// The kinds the cluster source reads besides vmpath's own, by
/// `apiVersion` group (without version) and `kind`.
pub const POD: (&str, &str) = ("", "Pod");
pub const NODE: (&str, &str) = ("", "Node");
pub const VMI: (&str, &str) = ("kubevirt.io", "VirtualMachineInstance");
pub const VMIM: (&str, &str) = ("kubevirt.io", "VirtualMachineInstanceMigration");
pub const NAD: (&str, &str) = ("k8s.cni.cncf.io", "NetworkAttachmentDefinition");
pub const IPAM_CLAIM: (&str, &str) = ("k8s.cni.cncf.io", "IPAMClaim");

/// Multus's network selection annotation on a pod.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// Multus's annotation naming a pod's default network (its `eth0`) in
/// place of the cluster's: `ns/name` or `name` of a NAD (KubeVirt sets it
/// on the virt-launcher pod for a network with `multus: {default: true}`).
pub const DEFAULT_NETWORK_ANNOTATION: &str = "v1.multus-cni.io/default-network";
/// The interface Multus gives the default network in the pod.
pub const DEFAULT_NETWORK_IFNAME: &str = "eth0";
/// KubeVirt's label on a virt-launcher pod: the uid of its VMI.
pub const CREATED_BY_LABEL: &str = "kubevirt.io/created-by";
/// KubeVirt's label on a virt-launcher pod: the VMI's name.
pub const VM_NAME_LABEL: &str = "vm.kubevirt.io/name";
/// KubeVirt's label on a migration target pod: the migration's uid.
pub const MIGRATION_JOB_LABEL: &str = "kubevirt.io/migrationJobUID";
/// KubeVirt's annotation on a target pod once the domain runs there.
pub const TARGET_READY_ANNOTATION: &str = "kubevirt.io/migration-target-ready-timestamp";
/// The CNI plugin type a NAD must name for vmpath to serve it.
pub const CNI_TYPE: &str = "vmpath-cni";
/// On an IPAMClaim `vmpath controller` made for a plain pod's interface:
/// that pod's uid. Only the pod of that uid takes the claim's addresses (a
/// pod made again under the same name gets a claim of its own).
pub const POD_UID_LABEL: &str = "vmpath.dev/pod-uid";
/// Every annotation vmpath reads on these objects: the others are dropped
/// when an object is stored ([`prune`]).
pub const READ_ANNOTATIONS: &[&str] = &[
    NETWORKS_ANNOTATION,
    DEFAULT_NETWORK_ANNOTATION,
    TARGET_READY_ANNOTATION,
];

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// Names: a VM's name is also its labels' value and its VM
    /// interfaces' key, its namespace every object's of the namespace.
    /// (Not the uid: one per object, held by nothing else.)
    #[serde(default)]
    pub name: Name,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<Name>,
    /// The API server's UUID as its 16 bytes ([`Uid`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<Uid>,
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    /// Only those vmpath reads ([`READ_ANNOTATIONS`]) once stored.
    #[serde(default, skip_serializing_if = "Annotations::is_empty")]
    pub annotations: Annotations,
}

/// An object's annotations, one word: only a pod keeps any once stored
/// (every one vmpath reads is a pod's), and the uid's three words and a
/// VMI's spec fit the 112-byte class with it.
#[derive(Debug, Clone, Default)]
pub struct Annotations(Option<Box<Labels>>);

impl Annotations {
    pub fn get(&self, key: &str) -> Option<&Name> {
        self.0.as_ref()?.get(key)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// Keeps those vmpath reads ([`READ_ANNOTATIONS`]).
    pub fn keep_read(&mut self) {
        if let Some(labels) = &mut self.0 {
            labels.retain(|k, _| READ_ANNOTATIONS.contains(&k));
            if labels.is_empty() {
                self.0 = None;
            }
        }
    }
}

impl From<Labels> for Annotations {
    fn from(labels: Labels) -> Self {
        Annotations((!labels.is_empty()).then(|| Box::new(labels)))
    }
}

impl Serialize for Annotations {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Some(labels) => labels.serialize(serializer),
            None => Labels::new().serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Annotations {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Labels::deserialize(deserializer).map(Annotations::from)
    }
}

impl ObjectMeta {
    pub fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }

    /// Whether its uid is `text` (both none counts).
    pub fn uid_is(&self, text: Option<&str>) -> bool {
        match (&self.uid, text) {
            (Some(uid), Some(text)) => uid.is(text),
            (None, None) => true,
            _ => false,
        }
    }

    /// [`namespace`](Self::namespace) as the shared name the object holds.
    pub fn namespace_name(&self) -> Name {
        self.namespace
            .clone()
            .unwrap_or_else(|| Name::new("default"))
    }
}

// --- v1 Pod -----------------------------------------------------------------

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pod {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<Name>,
    #[serde(default, skip_serializing_if = "no_ports")]
    pub containers: Vec<Container>,
}

/// Containers without ports say nothing vmpath reads.
fn no_ports(containers: &[Container]) -> bool {
    containers.iter().all(|c| c.ports.is_empty())
}

/// The part of a container vmpath reads: its ports, which NetworkPolicies
/// may name (KubeVirt puts a VMI interface's `ports` on the virt-launcher
/// pod's compute container).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<ContainerPort>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub container_port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

impl Pod {
    /// The pod's named container ports, as an Attachment's `ports`.
    pub fn named_ports(&self) -> Vec<serde_json::Value> {
        self.spec
            .containers
            .iter()
            .flat_map(|c| &c.ports)
            .filter_map(|p| {
                let name = p.name.as_ref()?;
                Some(serde_json::json!({
                    "name": name,
                    "port": p.container_port,
                    "protocol": p.protocol.as_deref().unwrap_or("TCP"),
                }))
            })
            // An Attachment holds at most this many; a pod with more keeps
            // its first ones (policies naming the rest match nothing).
            .take(crate::sys::limits::MAX_SHORT_LIST)
            .collect()
    }

    /// A pod that is over holds no port.
    pub fn finished(&self) -> bool {
        matches!(
            self.status.phase.as_deref(),
            Some("Succeeded") | Some("Failed")
        )
    }

    /// A KubeVirt virt-launcher pod.
    pub fn is_virt_launcher(&self) -> bool {
        self.metadata.labels.contains_key(CREATED_BY_LABEL)
            || self.metadata.labels.get("kubevirt.io").map(|v| v.as_str()) == Some("virt-launcher")
    }
}

/// One element of Multus's selection annotation (the JSON form; the short
/// form `ns/name@ifname, ...` is read into the same shape).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSelection {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    #[serde(
        default,
        rename = "ipam-claim-reference",
        skip_serializing_if = "Option::is_none"
    )]
    pub ipam_claim_reference: Option<String>,
}

/// Reads the selection annotation: a JSON list of elements, or the short
/// form (`name`, `ns/name`, `ns/name@ifname`, comma-separated).
pub fn parse_selection(text: &str) -> Result<Vec<NetworkSelection>, String> {
    let trimmed = text.trim();
    if trimmed.starts_with('[') {
        return serde_json::from_str(trimmed).map_err(|e| format!("not a list of elements: {e}"));
    }
    trimmed
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let (path, interface) = match item.split_once('@') {
                Some((p, i)) => (p, Some(i.to_string())),
                None => (item, None),
            };
            let (namespace, name) = match path.split_once('/') {
                Some((ns, n)) => (Some(ns.to_string()), n),
                None => (None, path),
            };
            if name.is_empty() {
                return Err(format!("{item:?} names no network"));
            }
            Ok(NetworkSelection {
                name: name.to_string(),
                namespace,
                interface,
                ..Default::default()
            })
        })
        .collect()
}

impl NetworkSelection {
    /// The pod's interface for the `index`th element: as given, else as
    /// Multus names unnamed interfaces (`net1`, `net2`, ... in order).
    pub fn interface_name(&self, index: usize) -> String {
        self.interface
            .clone()
            .unwrap_or_else(|| format!("net{}", index + 1))
    }
}

/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;

/// Whether `name` is a DNS subdomain (RFC 1123), as object names must be.
fn is_subdomain(name: &str) -> bool {
    name.len() <= MAX_NAME
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// The IPAMClaim `vmpath controller` makes for a plain pod's interface:
/// `<pod>.<interface>` (as ipam-extensions names a VM's `<vm>.<network>`),
/// or, where that is no valid object name (too long, an interface name
/// with characters names may not have), the pod's name cut to fit and a
/// hash of both: `<pod…>.<16 hex digits>`. Deterministic: every replica
/// and every agent computes the same name.
pub fn pod_claim_name(pod: &str, interface: &str) -> String {
    let plain = format!("{pod}.{interface}");
    if is_subdomain(&plain) {
        return plain;
    }
    let hash = crate::sys::hash::fnv1a(&[pod.as_bytes(), b"/", interface.as_bytes()]);
    format!("{}.{hash:016x}", pod_claim_prefix(pod))
}

/// What a hashed [`pod_claim_name`] of `pod` starts with, whatever the
/// interface: the pod's name as a DNS subdomain, cut to leave room for the
/// hash (`pod` when nothing of it is left). The round finds a hashed
/// claim's pods by it.
pub fn pod_claim_prefix(pod: &str) -> String {
    let mut prefix: String = pod
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-' || *c == '.')
        .take(MAX_NAME - 17)
        .collect();
    // Every label of the prefix must still be valid where it was cut.
    while !prefix.is_empty() && !is_subdomain(&prefix) {
        prefix.pop();
    }
    if prefix.is_empty() {
        "pod".to_string()
    } else {
        prefix
    }
}

// --- kubevirt.io/v1 VirtualMachineInstance and Migration ---------------------

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Vmi {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: VmiSpec,
    #[serde(default)]
    pub status: VmiStatus,
}

// Every VMI of the cluster is kept boxed: 112 bytes is the allocator's
// class it takes. A field that grows it should be boxed.
const _: () = assert!(std::mem::size_of::<Vmi>() <= 112);

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiSpec {
    #[serde(default)]
    pub domain: Domain,
    /// Boxed slices, not `Vec`s (no capacity word): every VMI of the
    /// cluster is kept, in the 112-byte class with them.
    #[serde(default, skip_serializing_if = "<[VmiNetwork]>::is_empty")]
    pub networks: Box<[VmiNetwork]>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Domain {
    #[serde(default)]
    pub devices: Devices,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Devices {
    #[serde(default, skip_serializing_if = "<[VmiInterface]>::is_empty")]
    pub interfaces: Box<[VmiInterface]>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiInterface {
    pub name: Name,
    /// Boxed: every VMI of the cluster keeps its interfaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<Box<str>>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiNetwork {
    pub name: Name,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multus: Option<MultusNetwork>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MultusNetwork {
    /// `name` or `namespace/name` of a NetworkAttachmentDefinition.
    pub network_name: Name,
    #[serde(default, skip_serializing_if = "is_false")]
    pub default: bool,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<Name>,
    /// Boxed: most VMIs have none, and every VMI of the cluster is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<Box<MigrationState>>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_node: Option<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_domain_ready_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub completed: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub failed: bool,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Vmim {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: VmimSpec,
    #[serde(default)]
    pub status: VmimStatus,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmimSpec {
    #[serde(default)]
    pub vmi_name: String,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VmimStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

// --- k8s.cni.cncf.io NetworkAttachmentDefinition and IPAMClaim ---------------

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Nad {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: NadSpec,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NadSpec {
    /// The CNI config as a JSON string (a single plugin or a conflist).
    #[serde(default)]
    pub config: String,
}

/// What a NAD's CNI config says to vmpath.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NadConfig {
    /// `"type": "vmpath-cni"` with the vmpath network it binds to.
    Vmpath { network: String },
    /// Another plugin's network: not vmpath's business.
    Other { plugin_type: String },
}

impl Nad {
    /// Reads `spec.config`: a single plugin config or a conflist whose
    /// first vmpath-cni plugin counts.
    pub fn cni(&self) -> Result<NadConfig, String> {
        let conf: serde_json::Value = serde_json::from_str(&self.spec.config)
            .map_err(|e| format!("spec.config is not JSON: {e}"))?;
        let plugins: Vec<&serde_json::Value> = match conf.get("plugins") {
            Some(serde_json::Value::Array(list)) => list.iter().collect(),
            Some(_) => return Err("spec.config: \"plugins\" is not a list".into()),
            None => vec![&conf],
        };
        let vmpath = plugins
            .iter()
            .find(|p| p.get("type").and_then(|t| t.as_str()) == Some(CNI_TYPE));
        match vmpath {
            Some(p) => match p.get("network").and_then(|n| n.as_str()) {
                Some(n) if !n.is_empty() => Ok(NadConfig::Vmpath {
                    network: n.to_string(),
                }),
                _ => Err(format!(
                    "spec.config: the {CNI_TYPE} plugin names no \"network\" (the vmpath Network)"
                )),
            },
            None => Ok(NadConfig::Other {
                plugin_type: plugins
                    .first()
                    .and_then(|p| p.get("type"))
                    .and_then(|t| t.as_str())
                    .unwrap_or("none")
                    .to_string(),
            }),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IpamClaim {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: IpamClaimSpec,
    #[serde(default)]
    pub status: IpamClaimStatus,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IpamClaimSpec {
    #[serde(default)]
    pub network: Name,
    #[serde(default)]
    pub interface: Name,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IpamClaimStatus {
    /// Boxed: with it a claim's kept form fits the allocator's 96-byte
    /// class (112 with a `Vec`); each address a boxed `str` (no capacity
    /// word: every claim of the cluster is kept).
    #[serde(default, skip_serializing_if = "<[Box<str>]>::is_empty")]
    pub ips: Box<[Box<str>]>,
}

const _: () = assert!(std::mem::size_of::<IpamClaim>() <= 96);

// --- v1 Node ----------------------------------------------------------------

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct K8sNode {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: K8sNodeSpec,
    #[serde(default)]
    pub status: K8sNodeStatus,
}

/// The pod CIDRs the cluster gave the node (kube-controller-manager's node
/// IPAM writes them): part of the cluster's pod address space.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct K8sNodeSpec {
    #[serde(default, rename = "podCIDRs", skip_serializing_if = "Vec::is_empty")]
    pub pod_cidrs: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct K8sNodeStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<NodeAddress>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct NodeAddress {
    #[serde(rename = "type")]
    pub kind: String,
    pub address: String,
}

impl K8sNode {
    /// The first InternalIP: the node's underlay address.
    pub fn internal_ip(&self) -> Option<&str> {
        self.status
            .addresses
            .iter()
            .find(|a| a.kind == "InternalIP")
            .map(|a| a.address.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_short_selection_form_reads_like_the_json_one() {
        let short = parse_selection("prod/blue@net7, red").unwrap();
        assert_eq!(short[0].namespace.as_deref(), Some("prod"));
        assert_eq!(short[0].name, "blue");
        assert_eq!(short[0].interface.as_deref(), Some("net7"));
        assert_eq!(short[1].name, "red");
        assert_eq!(short[1].namespace, None);
        let json = parse_selection(
            r#"[{"name":"blue","namespace":"prod","interface":"net7","mac":"02:00:00:00:00:01","ips":["10.0.0.5/24"],"ipam-claim-reference":"vm1.blue"}]"#,
        )
        .unwrap();
        assert_eq!(json[0].ipam_claim_reference.as_deref(), Some("vm1.blue"));
        assert!(parse_selection("[{\"namespace\": \"x\"}]").is_err());
        assert!(parse_selection("prod/").is_err());
    }

    #[test]
    fn a_pod_claim_is_named_after_the_pod_and_interface_and_always_a_valid_name() {
        assert_eq!(pod_claim_name("web-0", "net1"), "web-0.net1");
        // Not a valid name as is: cut, with a hash of both, the same each
        // time, another for another interface.
        let odd = pod_claim_name("web-0", "Net_1");
        assert!(
            odd.starts_with("web-0.") && odd.len() == "web-0.".len() + 16,
            "{odd}"
        );
        assert!(is_subdomain(&odd), "{odd}");
        assert_eq!(odd, pod_claim_name("web-0", "Net_1"));
        assert_ne!(odd, pod_claim_name("web-0", "Net_2"));
        let long = format!("{}-x", "a".repeat(250));
        let named = pod_claim_name(&long, "net1");
        assert!(named.len() <= 253 && is_subdomain(&named), "{named}");
        assert_ne!(named, pod_claim_name(&long, "net2"));
        // Cut where a label ends in '-': still valid.
        let dashed = format!("{}-{}", "b".repeat(235), "c".repeat(20));
        let named = pod_claim_name(&dashed, "net1");
        assert!(is_subdomain(&named), "{named}");
        assert!(is_subdomain(&pod_claim_name("", "Net_1")));
        // Multus's names for unnamed interfaces.
        let sel = parse_selection("prod/blue, prod/red@eth7").unwrap();
        assert_eq!(sel[0].interface_name(0), "net1");
        assert_eq!(sel[1].interface_name(1), "eth7");
    }

    #[test]
    fn a_nad_config_names_its_network_or_another_plugin() {
        let nad = |config: &str| Nad {
            spec: NadSpec {
                config: config.into(),
            },
            ..Default::default()
        };
        assert_eq!(
            nad(r#"{"cniVersion":"1.1.0","type":"vmpath-cni","network":"blue"}"#).cni(),
            Ok(NadConfig::Vmpath {
                network: "blue".into()
            })
        );
        assert_eq!(
            nad(r#"{"plugins":[{"type":"vmpath-cni","network":"blue"},{"type":"tuning"}]}"#).cni(),
            Ok(NadConfig::Vmpath {
                network: "blue".into()
            })
        );
        assert_eq!(
            nad(r#"{"type":"bridge","bridge":"br0"}"#).cni(),
            Ok(NadConfig::Other {
                plugin_type: "bridge".into()
            })
        );
        assert!(
            nad(r#"{"type":"vmpath-cni"}"#)
                .cni()
                .unwrap_err()
                .contains("network")
        );
        assert!(nad("{not json").cni().unwrap_err().contains("JSON"));
    }
}
