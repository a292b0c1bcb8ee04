//! North-south across nodes, shared by the imported-VM test
//! (`tests/tests/north_south_imported.rs`) and the bench's external
//! loss-window figure (`vmpath-bench --only migration`).
//!
//! Two nodes and a top-of-rack router (BIRD) on one underlay segment, an
//! external host behind the ToR. The network `imported` is IPAM-less with
//! spoof filtering off, `egress: SNAT` and `advertise: {subnet: true,
//! learned: true}`: its VMs reach the outside NAT'd to their node's
//! address and are reached from outside by their own addresses. VM `imp`
//! (node a) is an imported VM: its old MAC, IP and gateway, written down
//! in its Attachment, nothing assigned by vmpath; its target pod waits on
//! node b. VM `lrn` (node b) has only its MAC written down: vmpath learns
//! its address from its traffic.
//!
//! Addresses (all inside namespaces made here):
//!   underlay 192.0.2.0/24: node a .1, node b .2, ToR .254
//!   ToR 198.51.100.1/24 <-> external host 198.51.100.10/24
//!   network 10.40.0.0/16, gateway 10.40.0.1; imp 10.40.0.50, lrn 10.40.0.60

use std::{path::PathBuf, process::Child, time::Duration};

use crate::{
    Bird, Netns, Node, SCAPY_PYTHON, Underlay, Vm, bird_node_config, enable_forwarding, link,
    migration::{longest_gap, monotonic_ns, received, receiver},
    vmpath::common,
    wait_for, yaml, yaml_overlay,
};

pub const NET: &str = "imported";
pub const NET_ID: u32 = 700;
pub const NODE_A: &str = "192.0.2.1";
pub const NODE_B: &str = "192.0.2.2";
pub const TOR_IP: &str = "192.0.2.254";
pub const EXT_IP: &str = "198.51.100.10";
pub const GATEWAY: &str = "10.40.0.1";
pub const IMP_MAC: &str = "52:54:00:40:00:50";
pub const IMP_IP: &str = "10.40.0.50";
pub const LRN_MAC: &str = "52:54:00:40:00:60";
pub const LRN_IP: &str = "10.40.0.60";
/// The UDP port of the stream (`migration::receiver` listens on it).
pub const UDP_PORT: u16 = crate::migration::UDP_PORT;
/// The external host's stream: one datagram per millisecond for 5 s.
pub const STREAM_COUNT: u64 = 5000;

pub struct Bed {
    pub a: Node,
    pub b: Node,
    pub tor: Netns,
    pub ext: Netns,
    /// The imported VM on node a.
    pub imp: Vm,
    /// Its target pod on node b: same MAC and IP, paused (link down).
    pub imp_t: Vm,
    /// A VM on node b whose address vmpath only learns.
    pub lrn: Vm,
    pub tor_bird: Bird,
    _node_birds: [Bird; 2],
    _underlay: Underlay,
}

pub fn network_doc() -> String {
    yaml::network(NET, NET_ID, &["10.40.0.0/16"], &[GATEWAY], false)
        + "  egress: SNAT\n  advertise: {subnet: true, learned: true}\n"
}

/// Every node's config: `imp` on a, migrating to b (`Some(ready)`) or not.
pub fn write_config(bed: &Bed, migration: Option<bool>) {
    let mut imp = yaml::attachment(
        "imp",
        NET,
        "a",
        &bed.imp.port,
        IMP_MAC,
        &[&format!("{IMP_IP}/16")],
    );
    if let Some(ready) = migration {
        imp += &format!(
            "  migration: {{targetNode: b, targetPort: {}, ready: {ready}}}\n",
            bed.imp_t.port
        );
    }
    let docs = [
        yaml_overlay::node("a", NODE_A),
        yaml_overlay::node("b", NODE_B),
        network_doc(),
        imp,
        // Only the MAC: the address is learned from the VM's traffic.
        yaml::attachment("lrn", NET, "b", &bed.lrn.port, LRN_MAC, &[]),
    ];
    let config = yaml::docs(&docs);
    for node in [&bed.a, &bed.b] {
        node.write_config("config.yaml", &config);
    }
}

/// BIRD on the ToR: one eBGP session per node, every route learned goes
/// into the ToR's kernel table.
fn bird_tor_config() -> String {
    format!(
        "router id {TOR_IP};
protocol device {{ scan time 1; }}
protocol kernel {{ scan time 1; ipv4 {{ import none; export all; }}; }}
protocol bgp node_a {{ local {TOR_IP} as 65000; neighbor {NODE_A} as 65001;
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import all; export none; }}; }}
protocol bgp node_b {{ local {TOR_IP} as 65000; neighbor {NODE_B} as 65002;
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import all; export none; }}; }}
"
    )
}

/// Builds the nodes, the ToR and the external host, starts the agents and
/// BIRD, and waits until both VMs have spoken (so their addresses are
/// learned) and the ToR has their routes.
pub fn bed() -> Bed {
    let underlay = Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    let tor = Netns::new(format!("vt{}-tor", a.tag));
    let ext = Netns::new(format!("vt{}-ext", a.tag));
    underlay.plug(&a.ns, "ul0", &format!("{NODE_A}/24"), 1500);
    underlay.plug(&b.ns, "ul0", &format!("{NODE_B}/24"), 1500);
    underlay.plug(&tor, "ul0", &format!("{TOR_IP}/24"), 1500);
    link(
        &tor,
        "tor1",
        "198.51.100.1/24",
        &ext,
        "ext0",
        &format!("{EXT_IP}/24"),
    );
    for ns in [&a.ns, &b.ns, &tor] {
        enable_forwarding(ns);
    }
    for node in [&a, &b] {
        node.ns
            .run(&["ip", "route", "add", "default", "via", TOR_IP]);
    }
    ext.run(&["ip", "route", "add", "default", "via", "198.51.100.1"]);

    // The imported VM: its old address and gateway, configured in the
    // guest as on its old platform.
    let imp = a.add_vm("imp", IMP_MAC, &[&format!("{IMP_IP}/16")], Some(GATEWAY));
    let imp_t = b.add_vm("impt", IMP_MAC, &[&format!("{IMP_IP}/16")], Some(GATEWAY));
    imp_t.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let lrn = b.add_vm("lrn", LRN_MAC, &[&format!("{LRN_IP}/16")], Some(GATEWAY));

    // The VXLAN overlay shares the uplink with the fabric.
    for node in [&mut a, &mut b] {
        node.set_agent_args(&["--uplink", "ul0", "--metrics-addr", "off"]);
    }
    let tor_bird = Bird::start(&tor, "tor", &bird_tor_config());
    let node_birds = [
        Bird::start(
            &a.ns,
            "node-a",
            &bird_node_config(NODE_A, NODE_A, 65001, TOR_IP, 65000),
        ),
        Bird::start(
            &b.ns,
            "node-b",
            &bird_node_config(NODE_B, NODE_B, 65002, TOR_IP, 65000),
        ),
    ];
    let mut bed = Bed {
        a,
        b,
        tor,
        ext,
        imp,
        imp_t,
        lrn,
        tor_bird,
        _node_birds: node_birds,
        _underlay: underlay,
    };
    write_config(&bed, None);
    bed.a.start_agent();
    bed.b.start_agent();
    bed.a.wait_ports(&[&bed.imp.port]);
    bed.b.wait_ports(&[&bed.lrn.port]);
    for node in [&bed.a, &bed.b] {
        wait_for(
            &format!("the overlay on node {}", node.name),
            Duration::from_secs(10),
            || node.agent_log().contains("overlay ready"),
        );
    }
    // The VMs speak (their gateway), so vmpath learns their addresses.
    assert!(bed.imp.ping(GATEWAY), "imp -> its gateway");
    assert!(bed.lrn.ping(GATEWAY), "lrn -> its gateway");
    wait_for(
        "the ToR to learn the subnet and both VMs' /32s",
        Duration::from_secs(40),
        || {
            tor_route(&bed, IMP_IP).contains(&format!("via {NODE_A}"))
                && tor_route(&bed, LRN_IP).contains(&format!("via {NODE_B}"))
                && bed.tor_bird.show_route().contains("10.40.0.0/16")
        },
    );
    bed
}

/// The ToR's kernel route to `ip`.
pub fn tor_route(bed: &Bed, ip: &str) -> String {
    let out = bed.tor.run_status(&["ip", "route", "show", ip]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Frames `node` sent onto the overlay so far.
pub fn overlay_tx(node: &Node) -> u64 {
    node.maps()
        .overlay_stats()
        .map(|s| s.tx_packets)
        .unwrap_or(0)
}

/// Writes the migration of `imp` to b as pending and waits until b serves
/// the target port as pending.
pub fn start_migration(bed: &Bed) {
    write_config(bed, Some(false));
    wait_for(
        "the pending target port on b",
        Duration::from_secs(10),
        || {
            let ifindex = bed.b.ns.ifindex(&bed.imp_t.port);
            bed.b
                .maps()
                .ports
                .get(&ifindex, 0)
                .is_ok_and(|p| p.flags & common::PORT_F_PENDING != 0)
        },
    );
}

/// Sends [`STREAM_COUNT`] sequence-numbered datagrams from the external
/// host to the imported VM's own address, one per millisecond.
fn sender(ns: &Netns) -> Child {
    let script = format!(
        "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t0 = time.monotonic()
for seq in range({STREAM_COUNT}):
    s.sendto(seq.to_bytes(8, 'big') + b'x' * 56, ('{IMP_IP}', {UDP_PORT}))
    wait = t0 + (seq + 1) / 1000.0 - time.monotonic()
    if wait > 0:
        time.sleep(wait)
"
    );
    ns.spawn(&["python3", "-c", &script])
}

/// What the cut-over cost the external host's stream.
#[derive(Clone, Debug)]
pub struct ExternalWindow {
    /// Longest silence at the receivers from 200 ms before the cut-over
    /// until the ToR's route to the VM moved to the target node, ms.
    pub gap_ms: f64,
    /// Datagrams of the stream no receiver got.
    pub lost: u64,
    /// Datagrams the target received.
    pub on_target: usize,
    /// Frames the source node relayed over the overlay during the stream
    /// (fabric traffic still arriving there after the cut-over).
    pub relayed: u64,
    /// Cut-over until the ToR's kernel route pointed at the target, ms
    /// (NaN: not within the stream): how long the relay carried the flow.
    pub converged_ms: f64,
    /// Datagrams the target received before the ToR's route moved: the
    /// fabric still sent them to the source, which relayed them.
    pub on_target_before_converged: usize,
}

/// The cut-over of a migration [`start_migration`] made pending, while
/// the external host streams to the VM: the source stops, the target
/// resumes and announces itself (GARP and RARP, as QEMU does) 1.5 s into
/// the stream, `ready: true` follows 1 s later.
pub fn external_loss_window(bed: &Bed) -> ExternalWindow {
    let dir = std::env::temp_dir().join(format!("vmpath-ns-migration-{}", bed.a.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let files: [PathBuf; 2] = [dir.join("rx-source"), dir.join("rx-target")];
    let trigger = dir.join("resume");
    let rx_source = receiver(&bed.imp.ns, &files[0], 9);
    let rx_target = receiver(&bed.imp_t.ns, &files[1], 9);
    let announce = bed.imp_t.ns.spawn(&[
        SCAPY_PYTHON,
        "-c",
        &format!(
            "import os, time
from scapy.all import *
conf.verb = 0
while not os.path.exists('{}'):
    time.sleep(0.001)
garp = Ether(src='{IMP_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{IMP_MAC}', psrc='{IMP_IP}', hwdst='00:00:00:00:00:00', pdst='{IMP_IP}')
rarp = Ether(src='{IMP_MAC}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{IMP_MAC}', hwdst='{IMP_MAC}', psrc='0.0.0.0', pdst='0.0.0.0')
sendp([garp, rarp], iface='eth0')
",
            trigger.display()
        ),
    ]);
    std::thread::sleep(Duration::from_millis(1500));
    let relayed_before = overlay_tx(&bed.a);
    let tx = sender(&bed.ext);
    std::thread::sleep(Duration::from_millis(1500));

    let cut = monotonic_ns();
    bed.imp.ns.run(&["ip", "link", "set", "eth0", "down"]);
    bed.imp_t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    std::fs::write(&trigger, b"").unwrap();
    bed.imp_t
        .ns
        .run(&["ip", "route", "replace", "default", "via", GATEWAY]);
    // The ToR still sends to the source until BGP moves the /32.
    let mut converged = None;
    let mut ready_written = false;
    while monotonic_ns() < cut + 3_300_000_000 {
        if converged.is_none() && tor_route(bed, IMP_IP).contains(&format!("via {NODE_B}")) {
            converged = Some(monotonic_ns());
        }
        if !ready_written && monotonic_ns() > cut + 1_000_000_000 {
            write_config(bed, Some(true));
            ready_written = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let tx = tx.wait_with_output().unwrap();
    assert!(
        tx.status.success(),
        "sender: {}",
        String::from_utf8_lossy(&tx.stderr)
    );
    let relayed = overlay_tx(&bed.a) - relayed_before;
    let end = monotonic_ns();
    for child in [rx_source, rx_target, announce] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rx = received(&files);
    let (gap_ms, _, _) = longest_gap(&rx, cut - 200_000_000, converged.unwrap_or(end).max(cut));
    let mut seqs: Vec<u64> = rx.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let target_rx = received(&files[1..2]);
    let on_target = target_rx.len();
    let on_target_before_converged = target_rx
        .iter()
        .filter(|(_, t)| converged.is_none_or(|c| *t < c))
        .count();
    let _ = std::fs::remove_dir_all(&dir);
    ExternalWindow {
        gap_ms,
        lost: STREAM_COUNT - seqs.len() as u64,
        on_target,
        relayed,
        converged_ms: converged.map_or(f64::NAN, |t| (t - cut) as f64 / 1e6),
        on_target_before_converged,
    }
}
