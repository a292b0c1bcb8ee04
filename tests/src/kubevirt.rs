//! KubeVirt's side of a live migration, as the objects in the test API
//! server (`kube_api`) and the CNI calls Multus makes show it. Shared by
//! `tests/tests/kubernetes_migration.rs` (namespace VMs) and the real-guest
//! migration (`qemu::migration`).

use serde_json::{Value, json};

use crate::{Netns, Node, kube_api::ApiServer, multus};

/// The pod collection in the API server.
pub fn pods() -> String {
    crate::kube_api::collection("v1", "Pod")
}

/// The VirtualMachineInstance collection in the API server.
pub fn vmis() -> String {
    crate::kube_api::collection("kubevirt.io/v1", "VirtualMachineInstance")
}

/// One live migration of VMI `namespace/vmi`: the VMIM's name and uid,
/// the nodes and virt-launcher pods it goes between.
pub struct Migration<'a> {
    pub namespace: &'a str,
    pub vmi: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    pub source_node: &'a str,
    pub target_node: &'a str,
    pub source_pod: &'a str,
    pub target_pod: &'a str,
}

impl Migration<'_> {
    /// The VirtualMachineInstanceMigration in `phase`.
    pub fn vmim(&self, phase: &str) -> Value {
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
            "spec": {"vmiName": self.vmi},
            "status": {"phase": phase},
        })
    }

    /// KubeVirt's target virt-launcher pod: the source pod's copy on the
    /// target node (its network selection element, so the VM's MAC),
    /// labelled with the migration's uid.
    pub fn target_pod(&self, server: &ApiServer, pod_uid: &str) -> Value {
        let mut pod = server
            .get(&pods(), self.namespace, self.source_pod)
            .expect("the source pod");
        pod["metadata"]["name"] = self.target_pod.into();
        pod["metadata"]["uid"] = pod_uid.into();
        pod["metadata"]["labels"]["kubevirt.io/migrationJobUID"] = self.uid.into();
        pod["metadata"]["labels"]["kubevirt.io/nodeName"] = self.target_node.into();
        pod["spec"]["nodeName"] = self.target_node.into();
        for key in ["resourceVersion", "creationTimestamp"] {
            if let Some(m) = pod["metadata"].as_object_mut() {
                m.remove(key);
            }
        }
        pod
    }

    /// Writes the VMI's `status.migrationState` (KubeVirt's fields) with
    /// `extra` merged in, and the VMI's node (`status.nodeName` and its
    /// label).
    pub fn set_state(&self, server: &ApiServer, node: &str, extra: Value) {
        let mut v = server
            .get(&vmis(), self.namespace, self.vmi)
            .expect("the VMI");
        let mut state = json!({
            "migrationUid": self.uid,
            "sourceNode": self.source_node,
            "targetNode": self.target_node,
            "sourcePod": self.source_pod,
            "targetPod": self.target_pod,
            "startTimestamp": "2026-12-01T10:00:00Z",
            "mode": "PreCopy",
        });
        for (k, val) in extra.as_object().expect("extra fields") {
            state[k] = val.clone();
        }
        v["status"]["migrationState"] = state;
        v["status"]["nodeName"] = node.into();
        v["metadata"]["labels"]["kubevirt.io/nodeName"] = node.into();
        server.put(v);
    }
}

/// The CNI ADD of a pod's interface with the VM's MAC, as Multus makes it
/// for a network selection element with `"mac"`: `MAC=` in `CNI_ARGS` and
/// `runtimeConfig.mac`. Whether it succeeded, and the result.
pub fn cni_add_with_mac(node: &Node, c: &multus::Call, mac: &str) -> (bool, Value) {
    let mut conf: Value = serde_json::from_str(c.conf).expect("the NAD's config");
    conf["runtimeConfig"] = json!({"mac": mac});
    let cni_args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};MAC={mac}",
        c.pod_namespace, c.pod
    );
    multus::call_with(node, "ADD", c, &cni_args, &conf.to_string())
}

/// The host port in a CNI ADD's result.
pub fn host_port(result: &Value) -> String {
    result["interfaces"][0]["name"]
        .as_str()
        .unwrap_or_else(|| panic!("no host port in the CNI result: {result}"))
        .to_string()
}

/// A new pod namespace as the runtime makes it, with the kernel's default
/// sysctls (IPv6 on, addresses generated for every interface that comes
/// up): what vmpath-cni must cope with.
pub fn fresh_pod_netns(name: String) -> Netns {
    let ns = Netns::new(name);
    for (key, want) in [("disable_ipv6", "0"), ("addr_gen_mode", "0")] {
        assert_eq!(
            ns.run(&["sysctl", "-n", &format!("net.ipv6.conf.default.{key}")])
                .trim(),
            want,
            "a new namespace's default {key}"
        );
    }
    ns
}

/// True when `ifname` in `ns` holds no IPv6 address (not even a
/// link-local one): its kernel has nothing to speak from.
pub fn no_ipv6_address(ns: &Netns, ifname: &str) -> bool {
    let out = ns.run(&["ip", "-j", "-6", "addr", "show", "dev", ifname]);
    let link: Value = serde_json::from_str(&out).expect("ip -j output");
    link.as_array()
        .expect("ip -j output")
        .iter()
        .all(|l| l["addr_info"].as_array().is_none_or(Vec::is_empty))
}

/// `vmpath vm show namespace/name` against `node`'s agent.
pub fn vm_show(node: &Node, vm: &str) -> String {
    crate::run(&[
        crate::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        vm,
        "--api-socket",
        node.api_socket().to_str().unwrap(),
    ])
}
