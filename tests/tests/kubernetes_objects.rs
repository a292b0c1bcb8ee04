//! Kubernetes and KubeVirt objects through the file source, with real
//! traffic: a VirtualMachineInstance, its virt-launcher pod (Multus
//! selection with KubeVirt's hashed interface name and an IPAMClaim
//! reference), the NetworkAttachmentDefinition and the IPAMClaim, shaped
//! as KubeVirt, Multus and ipam-extensions write them, are written to the
//! config dir as `kubectl get -o yaml` gives them. The runtime calls
//! `vmpath-cni` for the pod's interface with the NAD's own config; the
//! agent derives the VM interface (identity, MAC and address from the
//! VMI and the claim, port from the CNI handover) and forwards its
//! traffic.

use serde_json::Value;
use vmpath_tests::{Netns, Node, multus, unique_tag, yaml};

const NETWORK: &str = include_str!("../../agent/src/cluster/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/cluster/fixtures/vm.yaml");
const POD: &str = "virt-launcher-vm1-x7k2p";
/// KubeVirt's name for the pod interface of the VMI network `blue`.
const POD_IFNAME: &str = "pod16477688c0e";
const VM_MAC: &str = "02:00:00:31:00:0b";
const VM_IP: &str = "10.31.0.11/24";

/// Calls the plugin for the pod's interface as Multus would.
fn cni_add(node: &Node, conf: &str, pod: &str, netns: &Netns, container: &str) -> (bool, Value) {
    multus::call(
        node,
        "ADD",
        &multus::Call {
            conf,
            pod_namespace: "prod",
            pod,
            ifname: POD_IFNAME,
            netns,
            container,
        },
    )
}

/// The documents of `text` that `keep` accepts, with the node renamed.
fn documents(text: &str, node: &str, keep: impl Fn(&str) -> bool) -> String {
    text.split("\n---\n")
        .filter(|d| keep(d))
        .map(|d| d.replace("node-a", node))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

#[test]
fn a_vm_derived_from_its_vmi_and_virt_launcher_pod_reaches_another_vm() {
    let mut node = Node::new("k");
    let peer = node.add_vm(
        "vm2",
        "52:54:00:00:31:0c",
        &["10.31.0.12/24"],
        Some("10.31.0.1"),
    );
    // The cluster's objects (the v1 Node left out: its InternalIP is not
    // in the test bed), a namespace VM beside them, and a virt-launcher
    // pod whose VMI is not there.
    let orphan = documents(VM, &node.name, |d| d.contains("kind: Pod"))
        .replace(POD, "virt-launcher-vm9-aaaaa")
        .replace("vm.kubevirt.io/name: vm1", "vm.kubevirt.io/name: vm9")
        .replace(
            "created-by: 5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8a",
            "created-by: 11111111-2222-3333-4444-555555555555",
        );
    node.write_config(
        "cluster.yaml",
        &[
            documents(NETWORK, &node.name, |d| !d.contains("kind: Node")),
            documents(VM, &node.name, |_| true),
            orphan,
        ]
        .join("\n---\n"),
    );
    node.write_config(
        "vm2.yaml",
        &yaml::attachment(
            "vm2",
            "blue",
            &node.name,
            &peer.port,
            &peer.mac,
            &["10.31.0.12/24"],
        ),
    );
    node.start_agent();
    node.wait_ports(&[&peer.port]);

    // The CNI config is the NAD's own, as Multus hands it to the plugin.
    let conf = multus::nad_conf(NETWORK, &node);

    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let (ok, result) = cni_add(&node, &conf, POD, &launcher, &format!("c{tag}vm1"));
    assert!(ok, "ADD of the virt-launcher pod's interface: {result}");

    // What the agent derived: the VMI's identity, MAC and the claim's
    // address, on the port CNI created.
    let status = node.status().expect("status");
    let a = status["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["vm"] == "vm1")
        .unwrap_or_else(|| panic!("no attachment of VM vm1: {status}"))
        .clone();
    assert_eq!(
        (&a["namespace"], &a["interface"], &a["network"]),
        (&"prod".into(), &"blue".into(), &"blue".into()),
        "{a}"
    );
    assert_eq!(a["mac"], VM_MAC, "the VMI's macAddress: {a}");
    assert_eq!(
        a["ips"][0]["address"], VM_IP,
        "the IPAMClaim's address: {a}"
    );
    assert_eq!(a["port"], result["interfaces"][0]["name"], "{a}\n{result}");

    // The guest: the VMI's MAC and the claimed address (a VM takes them
    // itself; the plugin configures nothing in a virt-launcher pod).
    let vm = &launcher;
    let set_mac = |mac: &str| {
        vm.run(&["ip", "link", "set", POD_IFNAME, "down"]);
        vm.run(&["ip", "link", "set", POD_IFNAME, "address", mac]);
        vm.run(&["ip", "link", "set", POD_IFNAME, "up"]);
    };
    set_mac(VM_MAC);
    vm.run(&["ip", "addr", "add", VM_IP, "dev", POD_IFNAME]);
    assert!(vm.ping("10.31.0.12", 3), "VM vm1 -> VM vm2");
    assert!(peer.ns.ping("10.31.0.11", 3), "VM vm2 -> VM vm1");
    assert!(vm.ping("10.31.0.1", 2), "VM vm1 -> the gateway");

    // Port security follows the VMI: another MAC is dropped.
    let spoofed = node.drops(vmpath_common::drop_reason::MAC_SPOOF);
    set_mac("02:00:00:31:00:99");
    assert!(!vm.ping("10.31.0.12", 2), "a MAC the VMI does not give");
    assert!(
        node.drops(vmpath_common::drop_reason::MAC_SPOOF) > spoofed,
        "counted as mac_spoof"
    );

    // A virt-launcher pod without its VMI: the ADD fails naming it.
    let orphan_ns = Netns::new(format!("vt{tag}-orphan"));
    let (ok, error) = cni_add(
        &node,
        &conf,
        "virt-launcher-vm9-aaaaa",
        &orphan_ns,
        &format!("c{tag}vm9"),
    );
    assert!(!ok, "ADD of a pod whose VMI is unknown: {error}");
    let msg = format!("{} {}", error["msg"], error["details"]);
    assert!(
        msg.contains("VirtualMachineInstance prod/vm9")
            && msg.contains("11111111-2222-3333-4444-555555555555"),
        "{msg}"
    );
}
