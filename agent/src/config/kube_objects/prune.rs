//! Objects as vmpath keeps them: only the fields it reads, typed. A
//! cluster's objects are held for as long as they exist (the config
//! reader's cache, the watchers' stores), and a parsed document costs
//! about ten times its text, most of it in fields vmpath never reads (a
//! VMI's disks and volumes, a pod's containers, every object's
//! managedFields) and in the document form itself (every map, however
//! small, is a B-tree node). So each kind in [`super`] is kept
//! as its typed form, read once when the object arrives; an object that
//! does not read is kept as its refusal (what translation says of it),
//! not as a document.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{self as objects, IpamClaim, K8sNode, Nad, ObjectMeta, Pod, Vmi, Vmim};

/// `group` and `kind` of a document (`v1` is the core group `""`).
pub fn group_kind(value: &Value) -> Option<(&str, &str)> {
    let api = value.get("apiVersion")?.as_str()?;
    let kind = value.get("kind")?.as_str()?;
    let group = api.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
    Some((group, kind))
}

/// One of the cluster kinds vmpath reads, as it is kept.
///
/// Every kind boxed: an object is kept in an `Arc` of this, and unboxed
/// each took the room of the largest kind (a VMI's `Arc` was 190 bytes
/// beside the VMI itself, for every VMI of the cluster).
#[derive(Debug)]
pub enum ClusterObject {
    Pod(Box<Pod>),
    Vmi(Box<Vmi>),
    Vmim(Box<Vmim>),
    Nad(Box<Nad>),
    IpamClaim(Box<IpamClaim>),
    Node(Box<K8sNode>),
    /// An object of one of these kinds that does not read.
    Refused(Box<Refused>),
}

/// Why an object was not read, and which one it is (its name and
/// namespace as far as they read), for translation's refusal.
#[derive(Debug)]
pub struct Refused {
    /// The kind as messages name it (`VirtualMachineInstance`).
    pub kind: &'static str,
    /// Empty when the object has none.
    pub name: String,
    pub namespace: Option<String>,
    pub field: String,
    pub message: String,
}

/// A document as a source keeps it.
#[derive(Debug, Clone)]
pub enum Kept {
    Cluster(Arc<ClusterObject>),
    /// Any other document (vmpath's own kinds, Namespaces, Services...).
    Document(Arc<Value>),
}

/// A kind read through a typed form.
trait Typed: DeserializeOwned {
    fn metadata(&mut self) -> &mut ObjectMeta;
}

macro_rules! typed {
    ($($t:ty),*) => {$(
        impl Typed for $t {
            fn metadata(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    )*};
}
typed!(Pod, Vmi, Vmim, Nad, IpamClaim, K8sNode);

fn read<T: Typed>(
    value: &Value,
    kind: &'static str,
    wrap: fn(Box<T>) -> ClusterObject,
) -> ClusterObject {
    // Name and namespace only, for messages: the rest may be broken.
    let text = |p: &str| value.pointer(p).and_then(Value::as_str).map(str::to_string);
    let name = text("/metadata/name").unwrap_or_default();
    let namespace = text("/metadata/namespace");
    let refused = |field: String, message: String| {
        ClusterObject::Refused(Box::new(Refused {
            kind,
            name: name.clone(),
            namespace: namespace.clone(),
            field,
            message,
        }))
    };
    if name.is_empty() {
        return refused("metadata.name".into(), "missing".into());
    }
    match serde_path_to_error::deserialize::<_, T>(value) {
        Ok(mut typed) => {
            typed.metadata().annotations.keep_read();
            wrap(Box::new(typed))
        }
        Err(e) => refused(e.path().to_string(), e.into_inner().to_string()),
    }
}

/// The typed form of `value` if it is one of the cluster kinds vmpath
/// reads through one.
pub fn cluster_object(value: &Value) -> Option<ClusterObject> {
    Some(match group_kind(value)? {
        objects::POD => read(value, "Pod", ClusterObject::Pod),
        objects::VMI => read(value, "VirtualMachineInstance", ClusterObject::Vmi),
        objects::VMIM => read(
            value,
            "VirtualMachineInstanceMigration",
            ClusterObject::Vmim,
        ),
        objects::NAD => read(value, "NetworkAttachmentDefinition", ClusterObject::Nad),
        objects::IPAM_CLAIM => read(value, "IPAMClaim", ClusterObject::IpamClaim),
        objects::NODE => read(value, "Node", ClusterObject::Node),
        _ => return None,
    })
}

/// One object as a source keeps it.
pub fn keep(value: Value) -> Kept {
    match cluster_object(&value) {
        Some(o) => Kept::Cluster(Arc::new(o)),
        None => Kept::Document(Arc::new(value)),
    }
}

/// One document of a file as the reader keeps it: the cluster objects
/// it holds (a `v1 List`'s items each), and the document itself unless
/// it was one of them (a List keeps its other items).
pub fn keep_all(value: Value) -> (Vec<Arc<ClusterObject>>, Option<Arc<Value>>) {
    let mut value = match keep(value) {
        Kept::Cluster(o) => return (vec![o], None),
        Kept::Document(v) => Arc::unwrap_or_clone(v),
    };
    let mut cluster = Vec::new();
    if group_kind(&value) == Some(("", "List"))
        && let Some(Value::Array(items)) = value.get_mut("items")
    {
        let mut rest = Vec::new();
        for item in std::mem::take(items) {
            match cluster_object(&item) {
                Some(o) => cluster.push(Arc::new(o)),
                None => rest.push(item),
            }
        }
        *items = rest;
    }
    (cluster, Some(Arc::new(value)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VM: &str = include_str!("../../derive/fixtures/vm.yaml");

    fn nodes(v: &Value) -> usize {
        1 + match v {
            Value::Array(a) => a.iter().map(nodes).sum(),
            Value::Object(o) => o.values().map(nodes).sum(),
            _ => 0,
        }
    }

    fn vm_objects() -> Vec<Value> {
        crate::config::source::parse(VM.as_bytes()).unwrap()
    }

    /// What is kept of `value`, as a document again.
    fn prune(value: Value) -> Value {
        let object = match keep(value.clone()) {
            Kept::Document(v) => return (*v).clone(),
            Kept::Cluster(o) => o,
        };
        let mut out = match &*object {
            ClusterObject::Pod(o) => serde_json::to_value(o),
            ClusterObject::Vmi(o) => serde_json::to_value(o),
            ClusterObject::Vmim(o) => serde_json::to_value(o),
            ClusterObject::Nad(o) => serde_json::to_value(o),
            ClusterObject::IpamClaim(o) => serde_json::to_value(o),
            ClusterObject::Node(o) => serde_json::to_value(o),
            ClusterObject::Refused(r) => panic!("refused: {r:?}"),
        }
        .unwrap();
        out["apiVersion"] = value["apiVersion"].clone();
        out["kind"] = value["kind"].clone();
        out
    }

    #[test]
    fn only_the_fields_read_are_kept() {
        let objects = vm_objects();
        let (vmi, pod, claim) = (&objects[0], &objects[1], &objects[2]);

        let p = prune(vmi.clone());
        assert_eq!(p["apiVersion"], "kubevirt.io/v1");
        assert_eq!(p["kind"], "VirtualMachineInstance");
        assert_eq!(p["metadata"]["uid"], vmi["metadata"]["uid"]);
        assert_eq!(p["metadata"]["labels"], vmi["metadata"]["labels"]);
        assert_eq!(
            p["spec"]["domain"]["devices"]["interfaces"][1]["macAddress"],
            "02:00:00:31:00:0b"
        );
        assert_eq!(
            p["spec"]["networks"][1]["multus"]["networkName"],
            "prod/blue"
        );
        for unread in [
            "/metadata/ownerReferences",
            "/metadata/resourceVersion",
            "/spec/volumes",
            "/spec/domain/resources",
            "/spec/domain/devices/disks",
            "/status/interfaces",
        ] {
            assert!(vmi.pointer(unread).is_some(), "{unread} in the fixture");
            assert!(p.pointer(unread).is_none(), "{unread} kept");
        }
        assert!(
            nodes(&p) * 2 < nodes(vmi),
            "{} of {} nodes kept",
            nodes(&p),
            nodes(vmi)
        );

        let p = prune(pod.clone());
        let annotations = p["metadata"]["annotations"].as_object().unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            ["k8s.v1.cni.cncf.io/networks"],
            "only the annotations read"
        );
        assert_eq!(
            p["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"],
            pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
        );
        assert_eq!(p["spec"], serde_json::json!({"nodeName": "node-a"}));
        // Named container ports are read (NetworkPolicy), the rest is not.
        let mut with_ports = pod.clone();
        with_ports["spec"]["containers"][0]["ports"] = serde_json::json!([{"name": "http", "containerPort": 80, "protocol": "TCP", "hostIP": "0.0.0.0"}]);
        assert_eq!(
            prune(with_ports)["spec"]["containers"],
            serde_json::json!([{"ports": [{"name": "http", "containerPort": 80, "protocol": "TCP"}]}])
        );
        assert_eq!(p["status"], serde_json::json!({"phase": "Running"}));

        let p = prune(claim.clone());
        assert!(p.pointer("/metadata/ownerReferences").is_none());
        assert_eq!(p["status"]["ips"], claim["status"]["ips"]);
    }

    #[test]
    fn an_object_that_does_not_read_is_kept_as_its_refusal() {
        let mut vmi = vm_objects()[0].clone();
        vmi["spec"]["networks"] = "not a list".into();
        let Kept::Cluster(o) = keep(vmi) else {
            panic!("a VMI is a cluster object")
        };
        let ClusterObject::Refused(r) = &*o else {
            panic!("kept as read: {o:?}")
        };
        assert_eq!(
            (r.kind, r.name.as_str(), r.namespace.as_deref()),
            ("VirtualMachineInstance", "vm1", Some("prod"))
        );
        assert_eq!(r.field, "spec.networks");
        assert!(r.message.contains("expected a sequence"), "{}", r.message);
        let mut nameless = vm_objects()[0].clone();
        nameless["metadata"].as_object_mut().unwrap().remove("name");
        let Kept::Cluster(o) = keep(nameless) else {
            panic!("a VMI is a cluster object")
        };
        assert!(
            matches!(&*o, ClusterObject::Refused(r) if r.field == "metadata.name" && r.message == "missing"),
            "{o:?}"
        );
        // And other kinds are not touched.
        let network = serde_json::json!({"apiVersion": "vmpath.dev/v1alpha1", "kind": "Network", "metadata": {"name": "blue", "annotations": {"x": "y"}}, "spec": {"id": 1}});
        assert_eq!(prune(network.clone()), network);
    }

    #[test]
    fn a_list_is_kept_item_by_item() {
        let network = serde_json::json!({"apiVersion": "vmpath.dev/v1alpha1", "kind": "Network", "metadata": {"name": "blue"}, "spec": {"id": 1}});
        let mut items = vm_objects();
        items.insert(1, network.clone());
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        let (cluster, rest) = keep_all(list);
        assert_eq!(cluster.len(), 3, "the VMI, pod and claim, typed");
        assert!(matches!(&*cluster[0], ClusterObject::Vmi(v) if v.metadata.name == "vm1"));
        assert!(matches!(&*cluster[1], ClusterObject::Pod(_)));
        assert!(matches!(&*cluster[2], ClusterObject::IpamClaim(_)));
        assert_eq!(
            rest.unwrap()["items"],
            serde_json::json!([network]),
            "the other items stay in the list"
        );
    }
}
