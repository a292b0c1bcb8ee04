//! Written back to the cluster, never silent: a Kubernetes Event (core/v1)
//! on the Pod, VMI, NAD or IPAMClaim for every refusal and every VM held
//! back for its claim, once per object and message; the MACs detected from
//! a VM's traffic as an annotation on its VMI.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{Event, EventSource, ObjectReference},
    apimachinery::pkg::apis::meta::v1::{MicroTime, Time},
    jiff::Timestamp,
};
use kube::api::ObjectMeta;

use crate::config::ConfigError;

/// On a VMI: the MACs vmpath detected from its traffic, by VMI network
/// name, as a JSON object (`{"blue": "02:00:00:31:00:0b"}`).
pub const DETECTED_MAC_ANNOTATION: &str = "vmpath.dev/detected-macs";

/// An Event's `reason` for a refusal.
pub const REASON_REFUSED: &str = "Refused";
/// An Event's `reason` for a VM held back until its IPAMClaim has addresses.
pub const REASON_WAITING: &str = "WaitingForIPAMClaim";

/// An Event's `reason` for an IPAMClaim whose `status.ips` the
/// controller's ledger does not vouch for.
pub const REASON_UNTRUSTED: &str = "UntrustedStatus";
/// An Event's `reason` for forwarding off on the node (on the Node).
pub const REASON_FORWARDING_OFF: &str = "ForwardingOff";

/// The object an Event is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Involved {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
}

/// The namespaced kinds a message can name, with their apiVersion.
const KINDS: &[(&str, &str)] = &[
    ("VirtualMachineInstance", "kubevirt.io/v1"),
    ("VirtualMachineInstanceMigration", "kubevirt.io/v1"),
    ("Pod", "v1"),
    ("NetworkAttachmentDefinition", "k8s.cni.cncf.io/v1"),
    ("IPAMClaim", "k8s.cni.cncf.io/v1alpha1"),
];

/// The object a refusal's Event goes on: the object its document came
/// from, as the reader or translation recorded it (`ConfigError::about`:
/// a derived Attachment's VMI, else its pod; a refused Pod, VMI, NAD or
/// IPAMClaim itself). `None` for vmpath's own documents and kinds Events
/// are not posted on.
pub fn involved_in(e: &ConfigError) -> Option<Involved> {
    let about = e.about.as_ref()?;
    let &(kind, api_version) = KINDS.iter().find(|(k, _)| *k == about.kind)?;
    (!about.namespace.is_empty()).then(|| Involved {
        api_version,
        kind,
        namespace: about.namespace.clone(),
        name: about.name.clone(),
    })
}

/// Events to post for a round's refusals and waits: (object, reason,
/// message).
pub fn events_of(
    errors: &[ConfigError],
    warnings: &[ConfigError],
) -> Vec<(Involved, &'static str, String)> {
    let mut out = Vec::new();
    for e in errors {
        if let Some(inv) = involved_in(e) {
            let message = if e.field.is_empty() {
                format!("{}: {}", e.document, e.message)
            } else {
                format!("{}: field {}: {}", e.document, e.field, e.message)
            };
            out.push((inv, REASON_REFUSED, message));
        }
    }
    for w in warnings
        .iter()
        .filter(|w| w.message.starts_with("waits for IPAMClaim"))
    {
        if let Some(inv) = involved_in(w) {
            out.push((inv, REASON_WAITING, w.message.clone()));
        }
    }
    out
}

/// A Warning Event as `kubectl describe` shows it.
pub fn event(inv: &Involved, reason: &str, message: &str, component: &str, host: &str) -> Event {
    let now = Timestamp::now();
    let hash = crate::sys::hash::fnv1a(&[message.as_bytes(), now.to_string().as_bytes()]);
    Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{hash:016x}", inv.name)),
            namespace: Some(inv.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some(inv.api_version.to_string()),
            kind: Some(inv.kind.to_string()),
            namespace: Some(inv.namespace.clone()),
            name: Some(inv.name.clone()),
            ..Default::default()
        },
        reason: Some(reason.to_string()),
        message: Some(message.chars().take(1024).collect()),
        type_: Some("Warning".to_string()),
        count: Some(1),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        event_time: Some(MicroTime(now)),
        action: Some(reason.to_string()),
        reporting_component: Some(component.to_string()),
        reporting_instance: Some(host.to_string()),
        source: Some(EventSource {
            component: Some(component.to_string()),
            host: Some(host.to_string()),
        }),
        ..Default::default()
    }
}

/// A Warning Event on the Node `node` (cluster-scoped: the Event lives
/// in `default`, as the kubelet's do), as `kubectl describe node` shows it.
pub fn node_event(node: &str, reason: &str, message: &str, component: &str) -> Event {
    let inv = Involved {
        api_version: "v1",
        kind: "Node",
        namespace: "default".to_string(),
        name: node.to_string(),
    };
    let mut e = event(&inv, reason, message, component, node);
    e.involved_object.namespace = None;
    e
}

/// Detected MACs by VMI (namespace, name): interface -> MAC.
pub type DetectedMacs = BTreeMap<(String, String), BTreeMap<String, String>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(about: Option<(&str, &str, &str)>) -> ConfigError {
        ConfigError {
            file: "f".into(),
            document: "d".into(),
            field: String::new(),
            message: "m".into(),
            about: about.map(|(kind, namespace, name)| {
                Box::new(vmpath_api::types::ObjectRef {
                    kind: kind.into(),
                    namespace: namespace.into(),
                    name: name.into(),
                })
            }),
            reason: None,
        }
    }

    #[test]
    fn a_refusal_is_about_the_vmi_a_pod_or_nothing() {
        let vmi = involved_in(&refusal(Some(("VirtualMachineInstance", "prod", "vm1")))).unwrap();
        assert_eq!(
            (
                vmi.kind,
                vmi.api_version,
                vmi.namespace.as_str(),
                vmi.name.as_str()
            ),
            ("VirtualMachineInstance", "kubevirt.io/v1", "prod", "vm1")
        );
        let pod = involved_in(&refusal(Some(("Pod", "prod", "web-0")))).unwrap();
        assert_eq!((pod.kind, pod.name.as_str()), ("Pod", "web-0"));
        let nad = involved_in(&refusal(Some((
            "NetworkAttachmentDefinition",
            "prod",
            "blue",
        ))));
        assert_eq!(nad.unwrap().api_version, "k8s.cni.cncf.io/v1");
        // vmpath's own documents, and a cluster-scoped v1 Node (its own
        // Events are posted by the forwarding check).
        assert!(involved_in(&refusal(None)).is_none());
        assert!(involved_in(&refusal(Some(("Node", "", "n1")))).is_none());
    }
}
