//! Objects as vmpath keeps them: only the fields it reads. A cluster's
//! objects are held for as long as they exist (the config reader's cache,
//! the watchers' stores), and a parsed object costs about ten times its
//! text, most of it in fields vmpath never reads (a VMI's disks and
//! volumes, a pod's containers, every object's managedFields). Each kind
//! in [`super::objects`] is read into its typed form and written back from
//! it, so what is kept follows those types; an object that does not read
//! is kept whole, so its refusal names the same field as before.

use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

use super::objects::{self, IpamClaim, K8sNode, Nad, ObjectMeta, Pod, READ_ANNOTATIONS, Vmi, Vmim};

/// `group` and `kind` of a document (`v1` is the core group `""`).
pub fn group_kind(value: &Value) -> Option<(&str, &str)> {
    let api = value.get("apiVersion")?.as_str()?;
    let kind = value.get("kind")?.as_str()?;
    let group = api.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
    Some((group, kind))
}

/// A kind read through a typed form.
trait Typed: DeserializeOwned + Serialize {
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

fn through<T: Typed>(value: Value) -> Value {
    let Ok(mut typed) = T::deserialize(&value) else {
        return value;
    };
    typed
        .metadata()
        .annotations
        .retain(|k, _| READ_ANNOTATIONS.contains(&k.as_str()));
    let Ok(mut out) = serde_json::to_value(&typed) else {
        return value;
    };
    out["apiVersion"] = value["apiVersion"].clone();
    out["kind"] = value["kind"].clone();
    out
}

/// `value` with only the fields vmpath reads, if it is one of the cluster
/// kinds vmpath reads through a typed form (a `v1 List`'s items each);
/// any other document as it is.
pub fn prune(value: Value) -> Value {
    match group_kind(&value) {
        Some(objects::POD) => through::<Pod>(value),
        Some(objects::VMI) => through::<Vmi>(value),
        Some(objects::VMIM) => through::<Vmim>(value),
        Some(objects::NAD) => through::<Nad>(value),
        Some(objects::IPAM_CLAIM) => through::<IpamClaim>(value),
        Some(objects::NODE) => through::<K8sNode>(value),
        Some(("", "List")) => {
            let mut value = value;
            if let Some(Value::Array(items)) = value.get_mut("items") {
                for item in items.iter_mut() {
                    *item = prune(std::mem::take(item));
                }
            }
            value
        }
        _ => value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VM: &str = include_str!("fixtures/vm.yaml");

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
    fn an_object_that_does_not_read_is_kept_whole() {
        let mut vmi = vm_objects()[0].clone();
        vmi["spec"]["networks"] = "not a list".into();
        assert_eq!(prune(vmi.clone()), vmi);
        // And other kinds are not touched.
        let network = serde_json::json!({"apiVersion": "vmpath.dev/v1alpha1", "kind": "Network", "metadata": {"name": "blue", "annotations": {"x": "y"}}, "spec": {"id": 1}});
        assert_eq!(prune(network.clone()), network);
    }

    #[test]
    fn a_list_is_pruned_item_by_item() {
        let objects = vm_objects();
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
        let p = prune(list);
        for (item, original) in p["items"].as_array().unwrap().iter().zip(&objects) {
            assert_eq!(item, &prune(original.clone()));
        }
    }
}
