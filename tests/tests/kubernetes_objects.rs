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

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{Netns, Node, multus, unique_tag, wait_for, yaml};

const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/derive/fixtures/vm.yaml");
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

/// A VM's VirtualMachineInstance, virt-launcher pod and IPAMClaim on the
/// network green, as KubeVirt and ipam-extensions write them: `uid` its
/// VMI's, `mac` the VMI's macAddress, `ip` the claim's status.ips.
fn green_vm(ns: &str, vm: &str, uid: &str, mac: &str, ip: &str, node: &str) -> String {
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {vm}, namespace: {ns}, uid: {uid}}}
spec:
  domain:
    devices:
      interfaces:
      - {{name: green, bridge: {{}}, macAddress: "{mac}"}}
  networks:
  - name: green
    multus: {{networkName: {ns}/green}}
status: {{nodeName: {node}, phase: Running}}
---
apiVersion: v1
kind: Pod
metadata:
  name: virt-launcher-{vm}-x
  namespace: {ns}
  labels: {{kubevirt.io: virt-launcher, kubevirt.io/created-by: {uid}, vm.kubevirt.io/name: {vm}}}
  annotations:
    k8s.v1.cni.cncf.io/networks: '[{{"name":"green","namespace":"{ns}","mac":"{mac}","interface":"{GREEN_IFNAME}","ipam-claim-reference":"{vm}.green"}}]'
spec: {{nodeName: {node}}}
status: {{phase: Running}}
---
apiVersion: k8s.cni.cncf.io/v1alpha1
kind: IPAMClaim
metadata: {{name: {vm}.green, namespace: {ns}}}
spec: {{network: green, interface: {GREEN_IFNAME}}}
status: {{ips: [{ip}]}}
"#
    )
}

/// The pod interface of the VMI network green.
const GREEN_IFNAME: &str = "pod0green";

/// The network green and its NAD in each namespace.
fn green(namespaces: &[&str]) -> String {
    let mut docs = vec![
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: green}\nspec:\n  id: 64\n  subnets: [10.64.0.0/16]\n  defaultGatewayIPs: [10.64.0.1]\n  ipam: {mode: Enabled}\n".to_string(),
    ];
    for ns in namespaces {
        docs.push(format!(
            "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {{name: green, namespace: {ns}}}\nspec:\n  config: '{{\"cniVersion\": \"1.1.0\", \"name\": \"green\", \"type\": \"vmpath-cni\", \"network\": \"green\", \"socket\": \"/run/vmpath/api.sock\"}}'\n"
        ));
    }
    docs.join("---\n")
}

/// The refusal of the Attachment derived from `ns/vm`'s VMI, as status
/// lists it: (field, message).
fn refusal_of(node: &Node, ns: &str, vm: &str) -> Option<(String, String)> {
    let document = format!(
        "Attachment {ns}/{vm}-green (derived from VirtualMachineInstance {ns}/{vm} and Pod {ns}/virt-launcher-{vm}-x)"
    );
    node.status()?["config_errors"]
        .as_array()?
        .iter()
        .find(|e| e["document"] == document.as_str())
        .map(|e| {
            (
                e["field"].as_str().unwrap_or("").to_string(),
                e["message"].as_str().unwrap_or("").to_string(),
            )
        })
}

#[test]
fn a_running_vm_keeps_its_address_and_mac_whatever_order_the_files_are_read_in() {
    let mut node = Node::new("k");
    let peer = node.add_vm("peer", "52:54:00:00:64:60", &["10.64.0.60/16"], None);
    node.write_config("green.yaml", &green(&["nsa", "nsb"]));
    node.write_config(
        "peer.yaml",
        &yaml::attachment(
            "peer",
            "green",
            &node.name,
            &peer.port,
            &peer.mac,
            &["10.64.0.60/16"],
        ),
    );
    // The running VM nsa/vmv1: its claim holds 10.64.0.50.
    let vmv1_mac = "02:00:00:64:00:50";
    node.write_config(
        "nsa-vmv1.yaml",
        &green_vm(
            "nsa",
            "vmv1",
            "aaaaaaaa-0000-0000-0000-000000000001",
            vmv1_mac,
            "10.64.0.50/16",
            &node.name,
        ),
    );
    node.start_agent();
    node.wait_ports(&[&peer.port]);
    let conf = multus::nad_conf(&green(&["nsa"]), &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-vmv1"));
    let (ok, result) = multus::call(
        &node,
        "ADD",
        &multus::Call {
            conf: &conf,
            pod_namespace: "nsa",
            pod: "virt-launcher-vmv1-x",
            ifname: GREEN_IFNAME,
            netns: &launcher,
            container: &format!("c{tag}vmv1"),
        },
    );
    assert!(ok, "ADD of vmv1's pod interface: {result}");
    let port = result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    node.wait_ports(&[&peer.port, &port]);
    launcher.run(&["ip", "link", "set", GREEN_IFNAME, "down"]);
    launcher.run(&["ip", "link", "set", GREEN_IFNAME, "address", vmv1_mac]);
    launcher.run(&["ip", "link", "set", GREEN_IFNAME, "up"]);
    launcher.run(&["ip", "addr", "add", "10.64.0.50/16", "dev", GREEN_IFNAME]);
    assert!(launcher.ping("10.64.0.60", 3), "vmv1 -> peer");

    // Later: nsb/vmx1, whose claim's status.ips names vmv1's address, and
    // nsb/vmy1, whose VMI gives vmv1's MAC; both with their pods.
    let newcomers = |node: &Node, first: bool| {
        let (x, y) = if first {
            ("00-nsb-vmx1.yaml", "00-nsb-vmy1.yaml")
        } else {
            ("nsb-vmx1.yaml", "nsb-vmy1.yaml")
        };
        node.write_config(
            x,
            &green_vm(
                "nsb",
                "vmx1",
                "bbbbbbbb-0000-0000-0000-000000000001",
                "02:00:00:64:00:51",
                "10.64.0.50/16",
                &node.name,
            ),
        );
        node.write_config(
            y,
            &green_vm(
                "nsb",
                "vmy1",
                "bbbbbbbb-0000-0000-0000-000000000002",
                vmv1_mac,
                "10.64.0.52/16",
                &node.name,
            ),
        );
    };
    newcomers(&node, false);
    let refused = |node: &Node| {
        refusal_of(node, "nsb", "vmx1").is_some() && refusal_of(node, "nsb", "vmy1").is_some()
    };
    wait_for("the newcomers refused", Duration::from_secs(10), || {
        refused(&node)
    });
    assert!(launcher.ping("10.64.0.60", 3), "vmv1 -> peer");

    // Their files renamed to sort first, and the agent restarted.
    node.kill_agent();
    node.remove_config("nsb-vmx1.yaml");
    node.remove_config("nsb-vmy1.yaml");
    newcomers(&node, true);
    node.start_agent();
    node.wait_ports(&[&peer.port, &port]);
    wait_for(
        "the newcomers refused again",
        Duration::from_secs(10),
        || refused(&node),
    );
    let status = node.status().unwrap();
    let vmv1 = node
        .attachment_view("vmv1")
        .unwrap_or_else(|| panic!("vmv1 not served: {status}"));
    assert_eq!(
        (&vmv1["mac"], &vmv1["ips"][0]["address"]),
        (&vmv1_mac.into(), &"10.64.0.50/16".into()),
        "{vmv1}"
    );
    assert_eq!(
        refusal_of(&node, "nsb", "vmx1").unwrap(),
        (
            "spec.ips".to_string(),
            "IP 10.64.0.50 is already held by VM interface nsa/vmv1/green on network \"green\""
                .to_string()
        ),
        "{status}"
    );
    assert_eq!(
        refusal_of(&node, "nsb", "vmy1").unwrap(),
        (
            "spec.mac".to_string(),
            format!(
                "MAC {vmv1_mac} is already held by VM interface nsa/vmv1/green on network \"green\""
            )
        ),
        "{status}"
    );
    assert!(
        refusal_of(&node, "nsa", "vmv1").is_none(),
        "the running VM refused: {status}"
    );
    assert!(launcher.ping("10.64.0.60", 3), "vmv1 -> peer after restart");
    assert!(peer.ns.ping("10.64.0.50", 3), "peer -> vmv1 after restart");
    // `vmpath status` says it, naming the newcomer's own object.
    let text = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "status",
        "--api-socket",
        node.api_socket().to_str().unwrap(),
    ]);
    assert!(
        text.contains("VirtualMachineInstance nsb/vmx1")
            && text.contains("IP 10.64.0.50 is already held by VM interface nsa/vmv1/green"),
        "{text}"
    );
}

/// As [`green_vm`] on the IPAM-less network green: no claim; the Multus
/// selection's `ips` are the VM's configured address.
fn green_vm_static(ns: &str, vm: &str, uid: &str, mac: &str, ip: &str, node: &str) -> String {
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {vm}, namespace: {ns}, uid: {uid}}}
spec:
  domain:
    devices:
      interfaces:
      - {{name: green, bridge: {{}}, macAddress: "{mac}"}}
  networks:
  - name: green
    multus: {{networkName: {ns}/green}}
status: {{nodeName: {node}, phase: Running}}
---
apiVersion: v1
kind: Pod
metadata:
  name: virt-launcher-{vm}-x
  namespace: {ns}
  labels: {{kubevirt.io: virt-launcher, kubevirt.io/created-by: {uid}, vm.kubevirt.io/name: {vm}}}
  annotations:
    k8s.v1.cni.cncf.io/networks: '[{{"name":"green","namespace":"{ns}","mac":"{mac}","interface":"{GREEN_IFNAME}","ips":["{ip}"]}}]'
spec: {{nodeName: {node}}}
status: {{phase: Running}}
"#
    )
}

/// A VM running on another node holds its configured address (IPAM-less
/// network: no claim records it) and its MAC. Newcomers on this node ask
/// for them; the agent restarts with the newcomers' files sorting first:
/// the previous round, recorded in the state dir, still decides, so the
/// running VM keeps both and each newcomer is refused on its own object,
/// naming the holder.
#[test]
fn a_vm_on_another_node_keeps_its_configured_address_and_mac_across_a_restart_whatever_the_file_order()
 {
    let mut node = Node::new("ko");
    let green_static = green(&["nsa", "nsb"]).replace("{mode: Enabled}", "{mode: Disabled}");
    assert!(green_static.contains("Disabled"), "{green_static}");
    node.write_config("green.yaml", &green_static);
    // The other node, as the API server lists it.
    node.write_config(
        "far.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: far}\nstatus:\n  addresses:\n  - {type: InternalIP, address: 192.0.2.99}\n",
    );
    let vmv1_mac = "02:00:00:64:00:50";
    node.write_config(
        "nsa-vmv1.yaml",
        &green_vm_static(
            "nsa",
            "vmv1",
            "aaaaaaaa-0000-0000-0000-000000000001",
            vmv1_mac,
            "10.64.0.50/16",
            "far",
        ),
    );
    node.start_agent();
    wait_for("vmv1 on far known", Duration::from_secs(120), || {
        node.attachment_view("vmv1").is_some()
    });

    // Later, on this node: nsb/vmx1 asks for vmv1's address, nsb/vmy1
    // for its MAC.
    let newcomers = |node: &Node, first: bool| {
        let (x, y) = if first {
            ("00-nsb-vmx1.yaml", "00-nsb-vmy1.yaml")
        } else {
            ("nsb-vmx1.yaml", "nsb-vmy1.yaml")
        };
        node.write_config(
            x,
            &green_vm_static(
                "nsb",
                "vmx1",
                "bbbbbbbb-0000-0000-0000-000000000001",
                "02:00:00:64:00:51",
                "10.64.0.50/16",
                &node.name,
            ),
        );
        node.write_config(
            y,
            &green_vm_static(
                "nsb",
                "vmy1",
                "bbbbbbbb-0000-0000-0000-000000000002",
                vmv1_mac,
                "10.64.0.52/16",
                &node.name,
            ),
        );
    };
    newcomers(&node, false);
    let refused = |node: &Node| {
        refusal_of(node, "nsb", "vmx1").is_some() && refusal_of(node, "nsb", "vmy1").is_some()
    };
    wait_for("the newcomers refused", Duration::from_secs(30), || {
        refused(&node)
    });

    // Their files renamed to sort first, and the agent restarted.
    node.kill_agent();
    node.remove_config("nsb-vmx1.yaml");
    node.remove_config("nsb-vmy1.yaml");
    newcomers(&node, true);
    node.start_agent();
    wait_for(
        "the newcomers refused again",
        Duration::from_secs(120),
        || refused(&node),
    );
    let status = node.status().unwrap();
    let vmv1 = node
        .attachment_view("vmv1")
        .unwrap_or_else(|| panic!("vmv1 not served: {status}"));
    assert_eq!(
        (&vmv1["node"], &vmv1["mac"], &vmv1["ips"][0]["address"]),
        (&"far".into(), &vmv1_mac.into(), &"10.64.0.50/16".into()),
        "{vmv1}"
    );
    assert!(
        refusal_of(&node, "nsa", "vmv1").is_none(),
        "the running VM refused: {status}"
    );
    let holder = "Attachment nsa/vmv1-green";
    assert_eq!(
        refusal_of(&node, "nsb", "vmx1").unwrap(),
        (
            "spec.ips".to_string(),
            format!("IP 10.64.0.50 is already used by {holder} on network \"green\"")
        ),
        "{status}"
    );
    let (field, message) = refusal_of(&node, "nsb", "vmy1").unwrap();
    assert_eq!(field, "spec.mac", "{status}");
    assert!(
        message.contains(vmv1_mac) && message.contains(holder),
        "{message}"
    );
}
