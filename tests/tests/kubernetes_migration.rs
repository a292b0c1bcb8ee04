//! KubeVirt drives a live migration through the Kubernetes objects alone:
//! two nodes joined by the overlay, both agents on `--source kubernetes`
//! against one API server (the test bed's, on node a's underlay address).
//! vm1 runs on node a (its VMI, virt-launcher pod and IPAMClaim), vm2 on
//! node b pings it all along. The objects appear in KubeVirt's order: the
//! VMIM and the target virt-launcher pod (label `kubevirt.io/migrationJobUID`)
//! on b, whose CNI ADD returns once its port is programmed pending (made by
//! vmpath-cni as Multus calls it: the VM's MAC from the network selection
//! element, the pod namespace's default sysctls, IPv6 on; its kernel says
//! nothing from the VM's MAC, and vm1 stays on a); then the
//! VMI's `status.migrationState`; the VM resumes on the target and announces
//! itself (QEMU's RARP), which cuts over in the data path; then
//! `migrationState.completed`, the VMIM `Succeeded`, and the source pod is
//! deleted (its DEL releases nothing). A failed migration rolls back.
//! Nobody writes an Attachment.
//!
//! The network is dual-stack (a /32 and a /128 per VM): vm2 streams pings
//! to vm1's IPv4 and IPv6 addresses through the move, both routes move,
//! and the gateway keeps its MAC in both families.

use std::{
    path::PathBuf,
    process::Child,
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use vmpath_tests::{
    Netns, Node, SCAPY_PYTHON, Underlay,
    kube_api::ApiServer,
    kubevirt::{self, Migration, pods, vmis},
    migration::{port_flags, table100, table100_v6},
    multus, unique_tag,
    vmpath::common,
    wait_for,
};

const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/derive/fixtures/vm.yaml");
const SOURCE_POD: &str = "virt-launcher-vm1-x7k2p";
const TARGET_POD: &str = "virt-launcher-vm1-q9w8e";
const VM2_POD: &str = "virt-launcher-vm2-z3m4n";
const IFNAME: &str = "pod16477688c0e";
const VM1_MAC: &str = "02:00:00:31:00:0b";
const VM1_IP: &str = "10.31.0.11";
const VM1_IP6: &str = "fd31::b";
const VM2_MAC: &str = "02:00:00:31:00:0c";
const VM2_IP: &str = "10.31.0.12";
const VM2_IP6: &str = "fd31::c";
const GATEWAY: &str = "10.31.0.1";
const GATEWAY6: &str = "fd31::1";
const MIGRATION_UID: &str = "7c6b5a49-3827-4160-9f5e-4d3c2b1a0f9e";
const NODE_IPS: [(&str, &str); 2] = [("a", "192.0.2.1"), ("b", "192.0.2.2")];
/// The ping stream from vm2 to vm1: one echo request every 20 ms.
const PING_INTERVAL: &str = "0.02";
/// Echo replies the cut-over may cost (25 x 20 ms = 500 ms): the data
/// path moves the VM at its first frame on the target; the rest is the
/// test's own commands on a shared machine.
const MAX_LOST_PINGS: u64 = 25;

fn parse(text: &str) -> Vec<Value> {
    vmpath::config::source::parse(text.as_bytes()).unwrap()
}

/// The cluster before the migration: the vmpath Network (dual-stack,
/// routed, a /32 and a /128 per VM), its NAD, both v1 Nodes, vm1 on a and
/// vm2 on b.
fn cluster() -> Vec<Value> {
    let mut out = parse(NETWORK);
    for o in &mut out {
        if o["kind"] == "Network" {
            o["spec"]["subnets"] = json!(["10.31.0.0/24", "fd31::/64"]);
            o["spec"]["defaultGatewayIPs"] = json!([GATEWAY, GATEWAY6]);
            o["spec"]["egress"] = "Routed".into();
            o["spec"]["advertise"] = json!({"perVM": true});
        }
    }
    out.retain(|o| o["kind"] != "Node");
    for (name, ip) in NODE_IPS {
        out.push(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
        }));
    }
    out.extend(parse(&VM.replace("node-a", "a")));
    let vm2 = VM
        .replace("node-a", "b")
        .replace("vm1", "vm2")
        .replace("x7k2p", "z3m4n")
        .replace(
            "5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8a",
            "5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8b",
        )
        .replace(VM1_MAC, VM2_MAC)
        .replace(VM1_IP, VM2_IP);
    out.extend(parse(&vm2));
    // Each claim holds both families, as the controller allocates them.
    for o in &mut out {
        if o["kind"] == "IPAMClaim" {
            o["status"]["ips"] = if o["metadata"]["name"] == "vm1.blue" {
                json!([format!("{VM1_IP}/24"), format!("{VM1_IP6}/64")])
            } else {
                json!([format!("{VM2_IP}/24"), format!("{VM2_IP6}/64")])
            };
        }
    }
    out
}

fn vmi(server: &ApiServer) -> Value {
    server.get(&vmis(), "prod", "vm1").expect("the VMI")
}

/// vm1's migration from a to b.
const MIGRATION: Migration = Migration {
    namespace: "prod",
    vmi: "vm1",
    name: "mig1",
    uid: MIGRATION_UID,
    source_node: "a",
    target_node: "b",
    source_pod: SOURCE_POD,
    target_pod: TARGET_POD,
};

fn vmim(phase: &str) -> Value {
    MIGRATION.vmim(phase)
}

fn set_migration_state(server: &ApiServer, node: &str, extra: Value) {
    MIGRATION.set_state(server, node, extra);
}

struct Bed {
    a: Node,
    b: Node,
    server: ApiServer,
    conf: [String; 2],
    tag: String,
    /// vm1 as it runs on a (the source virt-launcher pod's interface).
    vm1: Netns,
    vm2: Netns,
    _underlay: Underlay,
}

impl Bed {
    fn node(&self, name: &str) -> (&Node, &str) {
        match name {
            "a" => (&self.a, &self.conf[0]),
            _ => (&self.b, &self.conf[1]),
        }
    }

    /// The CNI call for `pod`'s interface on `node`, as Multus makes it.
    fn cni(&self, node: &str, pod: &str, netns: &Netns, command: &str) -> (bool, Value) {
        let (n, conf) = self.node(node);
        multus::call(
            n,
            command,
            &multus::Call {
                conf,
                pod_namespace: "prod",
                pod,
                ifname: IFNAME,
                netns,
                container: &format!("c{}{pod}", self.tag),
            },
        )
    }

    fn vm_show(&self, node: &Node) -> String {
        kubevirt::vm_show(node, "prod/vm1")
    }

    /// The CNI ADD of `pod`'s interface on `node` with the VM's MAC, as
    /// Multus makes it.
    fn cni_add_with_mac(&self, node: &str, pod: &str, netns: &Netns, mac: &str) -> (bool, Value) {
        let (n, conf) = self.node(node);
        kubevirt::cni_add_with_mac(
            n,
            &multus::Call {
                conf,
                pod_namespace: "prod",
                pod,
                ifname: IFNAME,
                netns,
                container: &format!("c{}{pod}", self.tag),
            },
            mac,
        )
    }
}

/// The guest's interface in a virt-launcher pod's namespace: its MAC and
/// addresses (IPv4, and IPv6 without a link-local address, kept while the
/// link is down as a paused guest keeps it), up or (a paused target) down.
fn guest(ns: &Netns, mac: &str, ip: &str, ip6: &str, up: bool) {
    ns.run(&["ip", "link", "set", IFNAME, "down"]);
    ns.run(&["ip", "link", "set", IFNAME, "address", mac]);
    for (key, value) in [
        ("addr_gen_mode", "1"),
        ("keep_addr_on_down", "1"),
        ("disable_ipv6", "0"),
    ] {
        ns.run(&[
            "sysctl",
            "-qw",
            &format!("net.ipv6.conf.{IFNAME}.{key}={value}"),
        ]);
    }
    ns.run(&["ip", "addr", "add", &format!("{ip}/24"), "dev", IFNAME]);
    ns.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        &format!("{ip6}/64"),
        "dev",
        IFNAME,
        "nodad",
    ]);
    if up {
        ns.run(&["ip", "link", "set", IFNAME, "up"]);
    }
}

fn attachment(node: &Node) -> Option<Value> {
    node.attachment_view("vm1")
}

fn two_nodes() -> Bed {
    let underlay = Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    for (node, (_, ip)) in [&a, &b].into_iter().zip(NODE_IPS) {
        underlay.plug(&node.ns, "ul0", &format!("{ip}/24"), 9000);
    }
    let server = ApiServer::start_at(&a.ns.path(), NODE_IPS[0].1);
    for o in cluster() {
        server.put(o);
    }
    // The claims as vmpath controller allocated them, in its ledger.
    server.vouch_for_claims();
    for node in [&mut a, &mut b] {
        let kubeconfig = node.state_dir.join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
        node.set_agent_args(&[
            "--source",
            "kubernetes",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ]);
        node.start_agent();
    }
    for node in [&a, &b] {
        wait_for(
            &format!("node {} lists the cluster and joins the overlay", node.name),
            // Loading the programs alone takes 30 s on a busy 2-core machine.
            Duration::from_secs(120),
            || {
                node.agent_log().contains("overlay ready")
                    && node.attachment_view("vm1").is_some()
                    && node.attachment_view("vm2").is_some()
            },
        );
    }
    let tag = unique_tag();
    let conf = [multus::nad_conf(NETWORK, &a), multus::nad_conf(NETWORK, &b)];
    let vm1 = Netns::new(format!("vt{tag}-vm1"));
    let vm2 = Netns::new(format!("vt{tag}-vm2"));
    let bed = Bed {
        a,
        b,
        server,
        conf,
        tag,
        vm1,
        vm2,
        _underlay: underlay,
    };
    let (ok, result) = bed.cni("a", SOURCE_POD, &bed.vm1, "ADD");
    assert!(ok, "ADD of vm1's virt-launcher pod on a: {result}");
    let (ok, result) = bed.cni("b", VM2_POD, &bed.vm2, "ADD");
    assert!(ok, "ADD of vm2's virt-launcher pod on b: {result}");
    guest(&bed.vm1, VM1_MAC, VM1_IP, VM1_IP6, true);
    guest(&bed.vm2, VM2_MAC, VM2_IP, VM2_IP6, true);
    for dst in [VM1_IP, VM1_IP6] {
        assert!(bed.vm2.ping(dst, 3), "vm2 (b) -> vm1 (a) at {dst}");
    }
    wait_for(
        "a routes vm1's /32 and /128",
        Duration::from_secs(10),
        || table100(&bed.a.ns).contains(VM1_IP) && table100_v6(&bed.a.ns).contains(VM1_IP6),
    );
    bed
}

/// KubeVirt starts the migration: the VMIM, the target pod on b (its
/// ADD returns with the port programmed pending, the source still serves
/// the VM), then the VMI's migrationState. Returns the target pod's
/// namespace (the paused guest) and its host port.
fn start_migration(bed: &Bed) -> (Netns, String) {
    bed.server.put(vmim("Scheduling"));
    bed.server
        .put(MIGRATION.target_pod(&bed.server, "3b2a1c0d-9e8f-4a7b-8c6d-5e4f3a2b1c0d"));
    // A new pod namespace as the runtime makes it: IPv6 on for every
    // interface that appears in it.
    let target = kubevirt::fresh_pod_netns(format!("vt{}-vm1t", bed.tag));
    let (ok, result) = bed.cni_add_with_mac("b", TARGET_POD, &target, VM1_MAC);
    assert!(
        ok,
        "the target pod's ADD returns before the migration runs: {result}"
    );
    // The pod's interface is up with the VM's MAC while the VM runs on a.
    // Its kernel must not speak from that MAC (DAD, MLD, router
    // solicitation): b would take that for the VM resuming and pull vm1's
    // traffic away from a. The kernel sends those within about 2 s of the
    // link coming up; vm2 reaches vm1 on a all that time.
    assert!(
        kubevirt::no_ipv6_address(&target, IFNAME),
        "the target pod's kernel made itself an IPv6 address: {}",
        target.run(&["ip", "-6", "addr", "show", "dev", IFNAME])
    );
    let show = target.run(&["ip", "-j", "link", "show", "dev", IFNAME]);
    let show: Value = serde_json::from_str(&show).unwrap();
    assert_eq!(show[0]["address"].as_str(), Some(VM1_MAC), "{show}");
    assert_eq!(show[0]["operstate"].as_str(), Some("UP"), "{show}");
    let replies = vm2_replies(bed, 15);
    let port = result["interfaces"][0]["name"].as_str().unwrap_or_default();
    assert!(
        port_flags(&bed.b, port).is_some_and(|f| f & common::PORT_F_PENDING != 0),
        "b cut over to the target pod before the VM moved ({replies} of 15 pings to vm1 on a answered)"
    );
    assert_eq!(replies, 15, "vm2 -> vm1 on a while the target pod is up");
    assert!(
        !bed.b
            .agent_log()
            .contains("the VM spoke on the target port"),
        "b took the target pod's interface for the VM"
    );
    let port = result["interfaces"][0]["name"]
        .as_str()
        .expect("the host port in the CNI result")
        .to_string();
    assert!(
        result["ips"].to_string().contains(VM1_IP),
        "the target pod's result carries vm1's address: {result}"
    );
    guest(&target, VM1_MAC, VM1_IP, VM1_IP6, false);
    assert!(
        port_flags(&bed.b, &port).is_some_and(|f| f & common::PORT_F_PENDING != 0),
        "b programmed the target port pending"
    );
    let on_b = attachment(&bed.b).unwrap();
    assert_eq!(
        (on_b["node"].as_str(), on_b["migration"].as_str()),
        (Some("a"), Some("pending")),
        "{on_b}"
    );

    // The target pod runs: KubeVirt hands off and writes migrationState.
    bed.server.put(vmim("TargetReady"));
    set_migration_state(&bed.server, "a", json!({}));
    bed.server.put(vmim("Running"));
    wait_for("a knows the migration", Duration::from_secs(10), || {
        attachment(&bed.a).is_some_and(|v| v["migration"] == "pending")
    });
    // Still served by a: its port, its route; b advertises nothing.
    assert!(port_flags(&bed.a, &host_port(bed, "a", SOURCE_POD)).is_some());
    assert!(table100(&bed.a.ns).contains(VM1_IP));
    assert!(table100_v6(&bed.a.ns).contains(VM1_IP6));
    assert!(
        !table100(&bed.b.ns).contains(VM1_IP) && !table100_v6(&bed.b.ns).contains(VM1_IP6),
        "b routed a pending VM"
    );
    for dst in [VM1_IP, VM1_IP6] {
        assert!(
            bed.vm2.ping(dst, 2),
            "vm2 -> vm1 on a at {dst} while pending"
        );
    }
    (target, port)
}

/// Echo replies vm2 gets from vm1 of `count` requests 200 ms apart.
fn vm2_replies(bed: &Bed, count: u32) -> u64 {
    let out = bed.vm2.run_status(&[
        "ping",
        "-n",
        "-c",
        &count.to_string(),
        "-i",
        "0.2",
        "-W",
        "1",
        VM1_IP,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains("packets transmitted"))
        .and_then(|l| {
            let words: Vec<&str> = l.split([' ', ',']).filter(|w| !w.is_empty()).collect();
            let i = words.iter().position(|w| *w == "received")?;
            words[i - 1].parse().ok()
        })
        .unwrap_or_else(|| panic!("no ping summary: {text}"))
}

/// The host side of `pod`'s interface on `node`, from the agent's status.
fn host_port(bed: &Bed, node: &str, pod: &str) -> String {
    let (n, _) = bed.node(node);
    let status = n.status().unwrap();
    status["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["vm"] == "vm1" && a["node"] == node)
        .and_then(|a| a["port"].as_str())
        .unwrap_or_else(|| panic!("no port of {pod} on {node}: {status}"))
        .to_string()
}

/// `ping` from vm2 to vm1 until stopped: (transmitted, received).
fn stop_ping(ping: Child) -> (u64, u64) {
    // SAFETY: signalling the child this test started (nsenter exec'd ping).
    unsafe { libc::kill(ping.id() as i32, libc::SIGINT) };
    let out = ping.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| panic!("no ping summary: {text}"));
    let num = |word: &str| -> u64 {
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        let i = words.iter().position(|w| *w == word).unwrap();
        words[i - 1].parse().unwrap()
    };
    (num("packets"), num("received"))
}

#[test]
fn kubevirt_migrates_a_vm_through_its_objects_alone() {
    let bed = two_nodes();
    let source_port = host_port(&bed, "a", SOURCE_POD);
    // The gateway's MAC as vm1 knows it in each family.
    let gw_lladdr = |ns: &Netns, gw: &str| -> String {
        assert!(ns.ping(gw, 1), "-> gateway {gw}");
        let entry = ns.run(&["ip", "neigh", "show", gw, "dev", IFNAME]);
        entry
            .split_whitespace()
            .skip_while(|w| *w != "lladdr")
            .nth(1)
            .unwrap_or_else(|| panic!("no neighbour entry for {gw}: {entry:?}"))
            .to_string()
    };
    let gw_before = [GATEWAY, GATEWAY6].map(|gw| gw_lladdr(&bed.vm1, gw));
    let ping = bed.vm2.spawn(&["ping", "-n", "-i", PING_INTERVAL, VM1_IP]);
    let ping6 = bed.vm2.spawn(&["ping", "-n", "-i", PING_INTERVAL, VM1_IP6]);
    let ping_started = Instant::now();
    let (target, target_port) = start_migration(&bed);

    // The VM resumes on the target: QEMU announces it (RARP) at once.
    let trigger: PathBuf = std::env::temp_dir().join(format!("vmpath-kmig-{}", bed.tag));
    let ready: PathBuf = std::env::temp_dir().join(format!("vmpath-kmig-{}-ready", bed.tag));
    let announce = target.spawn(&[
        SCAPY_PYTHON,
        "-c",
        &format!(
            "import os, time
from scapy.all import *
conf.verb = 0
import socket
# A plain packet socket: scapy's own flushes its queue, which fails on a
# link that is down (the target's, until the VM resumes).
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('{IFNAME}', 0))
rarp = bytes(Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{VM1_MAC}', hwdst='{VM1_MAC}', psrc='0.0.0.0', pdst='0.0.0.0'))
open('{ready}', 'w').close()
while not os.path.exists('{trigger}'):
    time.sleep(0.001)
s.send(rarp)
",
            ready = ready.display(),
            trigger = trigger.display()
        ),
    ]);
    // scapy takes seconds to import on a busy machine: the source stops
    // once the announcement is ready to go.
    wait_for("the announcement ready", Duration::from_secs(60), || {
        ready.exists()
    });
    let _ = std::fs::remove_file(&ready);
    let cut = Instant::now();
    bed.vm1.run(&["ip", "link", "set", IFNAME, "down"]);
    target.run(&["ip", "link", "set", IFNAME, "up"]);
    std::fs::write(&trigger, b"").unwrap();
    let out = announce.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&trigger);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The data path cut over at that frame: no object says so yet.
    wait_for(
        "b serves vm1 on the target port",
        Duration::from_secs(10),
        || port_flags(&bed.b, &target_port).is_some_and(|f| f & common::PORT_F_PENDING == 0),
    );
    let cut_over_ms = cut.elapsed().as_secs_f64() * 1e3;
    // The data path clears the pending flag itself; the agent notices the
    // event on its next pass and says so in its log, a moment later.
    bed.b
        .wait_log("the VM spoke on the target port", Duration::from_secs(10));
    assert!(
        vmi(&bed.server)["status"]["migrationState"]["completed"].is_null(),
        "the cut-over came from the data path, before KubeVirt's word"
    );

    // KubeVirt confirms: migrationState completed, the VMI on b, the VMIM
    // Succeeded; the source pod ends and is deleted, its DEL comes.
    set_migration_state(
        &bed.server,
        "b",
        json!({"completed": true, "endTimestamp": "2026-12-01T10:00:09Z",
               "targetNodeDomainReadyTimestamp": "2026-12-01T10:00:08Z",
               "targetNodeDomainDetected": true}),
    );
    bed.server.put(vmim("Succeeded"));
    wait_for(
        "the /32 and /128 moved to b",
        Duration::from_secs(10),
        || {
            table100(&bed.b.ns).contains(VM1_IP)
                && !table100(&bed.a.ns).contains(VM1_IP)
                && table100_v6(&bed.b.ns).contains(VM1_IP6)
                && !table100_v6(&bed.a.ns).contains(VM1_IP6)
        },
    );
    wait_for("a dropped the source port", Duration::from_secs(10), || {
        port_flags(&bed.a, &source_port).is_none()
    });
    bed.server.delete(&pods(), "prod", SOURCE_POD);
    let (ok, result) = bed.cni("a", SOURCE_POD, &bed.vm1, "DEL");
    assert!(ok, "DEL of the source pod: {result}");
    // Some pings after the move, then the count. The stream runs at least
    // 1.5 s in all (a fast machine migrates sooner), so the count below
    // means something.
    for dst in [VM1_IP, VM1_IP6] {
        assert!(bed.vm2.ping(dst, 3), "vm2 -> vm1 on b at {dst}");
    }
    if let Some(rest) = Duration::from_millis(1500).checked_sub(ping_started.elapsed()) {
        std::thread::sleep(rest);
    }
    for (family, ping) in [("IPv4", ping), ("IPv6", ping6)] {
        let (sent, received) = stop_ping(ping);
        let lost = sent - received;
        eprintln!(
            "kubernetes migration {family}: {lost} of {sent} pings ({PING_INTERVAL} s apart) lost; cut-over seen on b {cut_over_ms:.0} ms after the source stopped"
        );
        assert!(sent >= 50, "{family}: only {sent} pings sent");
        assert!(
            lost <= MAX_LOST_PINGS,
            "{family}: {lost} of {sent} pings lost across the migration"
        );
    }
    // The gateway answers vm1 on b with the MAC it had on a, in both
    // families.
    let gw_after = [GATEWAY, GATEWAY6].map(|gw| gw_lladdr(&target, gw));
    assert_eq!(
        gw_after, gw_before,
        "the gateway's MAC as vm1 sees it (IPv4, IPv6)"
    );

    // What a user checks: vm1 on b with its MAC, address and claim, on
    // both nodes; the source pod's DEL released nothing.
    for node in [&bed.a, &bed.b] {
        let v = attachment(node).unwrap_or_else(|| panic!("vm1 gone on {}", node.name));
        assert_eq!(
            (
                v["node"].as_str(),
                v["migration"].as_str(),
                v["mac"].as_str()
            ),
            (Some("b"), Some("none"), Some(VM1_MAC)),
            "on {}: {v}",
            node.name
        );
        assert!(v["ips"].to_string().contains(VM1_IP), "{v}");
        assert!(v["ips"].to_string().contains(VM1_IP6), "{v}");
    }
    let show = bed.vm_show(&bed.b);
    for want in [VM1_MAC, VM1_IP, VM1_IP6, "local", "node:       b"] {
        assert!(show.contains(want), "no {want:?} in:\n{show}");
    }
    assert!(bed.vm_show(&bed.a).contains("remote"), "on a");
    assert_eq!(
        bed.server
            .get(
                &vmpath_tests::kube_api::collection("k8s.cni.cncf.io/v1alpha1", "IPAMClaim"),
                "prod",
                "vm1.blue"
            )
            .map(|c| c["status"]["ips"].clone()),
        Some(json!([format!("{VM1_IP}/24"), format!("{VM1_IP6}/64")])),
        "the claim keeps the address"
    );
    assert!(
        !bed.a.agent_log().contains("no vmpath network of the pod"),
        "the left source pod was refused"
    );
}

#[test]
fn a_failed_kubevirt_migration_rolls_back() {
    let bed = two_nodes();
    let source_port = host_port(&bed, "a", SOURCE_POD);
    let (target, target_port) = start_migration(&bed);

    // The migration fails before the VM moved: KubeVirt marks it so and
    // the target pod ends.
    set_migration_state(
        &bed.server,
        "a",
        json!({"failed": true, "endTimestamp": "2026-12-01T10:00:05Z"}),
    );
    bed.server.put(vmim("Failed"));
    wait_for("b drops the pending port", Duration::from_secs(10), || {
        port_flags(&bed.b, &target_port).is_none()
    });
    bed.server.delete(&pods(), "prod", TARGET_POD);
    let (ok, result) = bed.cni("b", TARGET_POD, &target, "DEL");
    assert!(ok, "DEL of the target pod: {result}");

    assert!(
        bed.vm2.ping(VM1_IP, 3),
        "vm2 -> vm1 on a after the rollback"
    );
    assert!(port_flags(&bed.a, &source_port).is_some());
    assert!(table100(&bed.a.ns).contains(VM1_IP));
    assert!(!table100(&bed.b.ns).contains(VM1_IP));
    for node in [&bed.a, &bed.b] {
        let v = attachment(node).unwrap();
        assert_eq!(
            (v["node"].as_str(), v["migration"].as_str()),
            (Some("a"), Some("none")),
            "on {}: {v}",
            node.name
        );
    }
    assert!(bed.vm_show(&bed.a).contains("local"));
    // The target pod's DEL released nothing either.
    assert!(bed.vm2.ping(VM1_IP, 2));
}
