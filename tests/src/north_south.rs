//! North-south across nodes, shared by the imported-VM test
//! (`tests/tests/north_south_imported.rs`) and the bench's external
//! loss-window figure (`vmpath-bench --only migration`).
//!
//! Two nodes (or three) and a top-of-rack router (BIRD) on one underlay
//! segment, an external host behind the ToR. The network `imported` is IPAM-less with
//! spoof filtering off, `egress: SNAT` and `advertise: {subnet: true,
//! learned: true}`: its VMs reach the outside NAT'd to their node's
//! address and are reached from outside by their own addresses. VM `imp`
//! (node a) is an imported VM: its old MAC, IP and gateway, written down
//! in its Attachment, nothing assigned by vmpath; its target pod waits on
//! node b. VM `lrn` (node b) has only its MAC written down: vmpath learns
//! its address from its traffic. With three nodes, VM `cvm` (node c,
//! address written down) makes node c a host of the network too.
//!
//! Addresses (all inside namespaces made here):
//!   underlay 192.0.2.0/24: node a .1, node b .2, node c .3, ToR .254
//!   ToR 198.51.100.1/24 <-> external host 198.51.100.10/24
//!   network 10.40.0.0/16, gateway 10.40.0.1; imp 10.40.0.50, lrn 10.40.0.60,
//!   cvm 10.40.0.70

use std::{
    path::{Path, PathBuf},
    process::Child,
    time::Duration,
};

use crate::{
    Bird, Netns, Node, SCAPY_PYTHON, Underlay, Vm, bird_node_config, enable_forwarding, link,
    migration::{
        longest_gap, longest_loss, monotonic_ns, received, sent_times, signalled_receiver,
        with_suffix,
    },
    vmpath::common,
    wait_for, yaml, yaml_overlay,
};

pub const NET: &str = "imported";
pub const NET_ID: u32 = 700;
pub const NODE_A: &str = "192.0.2.1";
pub const NODE_B: &str = "192.0.2.2";
pub const NODE_C: &str = "192.0.2.3";
pub const TOR_IP: &str = "192.0.2.254";
pub const EXT_IP: &str = "198.51.100.10";
pub const GATEWAY: &str = "10.40.0.1";
pub const IMP_MAC: &str = "52:54:00:40:00:50";
pub const IMP_IP: &str = "10.40.0.50";
pub const LRN_MAC: &str = "52:54:00:40:00:60";
pub const LRN_IP: &str = "10.40.0.60";
pub const CVM_MAC: &str = "52:54:00:40:00:70";
pub const CVM_IP: &str = "10.40.0.70";
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
    /// The third node and its VM, when the bed has three nodes.
    pub c: Option<(Node, Vm)>,
    pub tor_bird: Bird,
    _node_birds: Vec<Bird>,
    _underlay: Underlay,
}

pub fn network_doc() -> String {
    yaml::network(NET, NET_ID, &["10.40.0.0/16"], &[GATEWAY], false)
        + "  egress: SNAT\n  advertise: {subnet: true, learned: true}\n"
}

/// The network with an IPv6 subnet and gateway as well.
pub fn network_doc_dual_stack() -> String {
    yaml::network(
        NET,
        NET_ID,
        &["10.40.0.0/16", SUBNET6],
        &[GATEWAY, GATEWAY6],
        false,
    ) + "  egress: SNAT\n  advertise: {subnet: true, learned: true}\n"
}

/// The network's IPv6 subnet and gateway (`network_doc_dual_stack`).
pub const SUBNET6: &str = "fd40::/64";
pub const GATEWAY6: &str = "fd40::1";

/// Every node's config: `imp` on a, migrating to b (`Some(ready)`) or not.
pub fn write_config(bed: &Bed, migration: Option<bool>) {
    write_config_with(bed, migration, network_doc());
}

/// `write_config` with another document for the network.
pub fn write_config_with(bed: &Bed, migration: Option<bool>, network: String) {
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
    let mut docs = vec![
        yaml_overlay::node("a", NODE_A),
        yaml_overlay::node("b", NODE_B),
        network,
        imp,
        // Only the MAC: the address is learned from the VM's traffic.
        yaml::attachment("lrn", NET, "b", &bed.lrn.port, LRN_MAC, &[]),
    ];
    if let Some((_, cvm)) = &bed.c {
        docs.push(yaml_overlay::node("c", NODE_C));
        docs.push(yaml::attachment(
            "cvm",
            NET,
            "c",
            &cvm.port,
            CVM_MAC,
            &[&format!("{CVM_IP}/16")],
        ));
    }
    let config = yaml::docs(&docs);
    for node in bed.nodes() {
        node.write_config("config.yaml", &config);
    }
}

impl Bed {
    pub fn nodes(&self) -> Vec<&Node> {
        let mut v = vec![&self.a, &self.b];
        v.extend(self.c.as_ref().map(|(n, _)| n));
        v
    }
}

/// The nodes' underlay addresses and AS numbers.
const NODES: [(&str, &str, u32); 3] = [
    ("a", NODE_A, 65001),
    ("b", NODE_B, 65002),
    ("c", NODE_C, 65003),
];

/// BIRD on the ToR: one eBGP session per node, every route learned goes
/// into the ToR's kernel table.
fn bird_tor_config(nodes: usize) -> String {
    let mut conf = format!(
        "router id {TOR_IP};
protocol device {{ scan time 1; }}
protocol kernel {{ scan time 1; ipv4 {{ import none; export all; }}; }}
"
    );
    for (name, ip, asn) in &NODES[..nodes] {
        conf.push_str(&format!(
            "protocol bgp node_{name} {{ local {TOR_IP} as 65000; neighbor {ip} as {asn};
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import all; export none; }}; }}
"
        ));
    }
    conf
}

/// Builds the nodes (2 or 3), the ToR and the external host, starts the
/// agents and BIRD, and waits until the VMs have spoken (so their
/// addresses are learned) and the ToR has their routes.
pub fn bed(nodes: usize) -> Bed {
    assert!((2..=3).contains(&nodes), "2 or 3 nodes");
    let underlay = Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    let mut c = (nodes == 3).then(|| Node::new("c"));
    let tor = Netns::new(format!("vt{}-tor", a.tag));
    let ext = Netns::new(format!("vt{}-ext", a.tag));
    underlay.plug(&a.ns, "ul0", &format!("{NODE_A}/24"), 1500);
    underlay.plug(&b.ns, "ul0", &format!("{NODE_B}/24"), 1500);
    underlay.plug(&tor, "ul0", &format!("{TOR_IP}/24"), 1500);
    if let Some(c) = &c {
        underlay.plug(&c.ns, "ul0", &format!("{NODE_C}/24"), 1500);
    }
    link(
        &tor,
        "tor1",
        "198.51.100.1/24",
        &ext,
        "ext0",
        &format!("{EXT_IP}/24"),
    );
    for node in [Some(&a), Some(&b), c.as_ref()].into_iter().flatten() {
        enable_forwarding(&node.ns);
        node.ns
            .run(&["ip", "route", "add", "default", "via", TOR_IP]);
    }
    enable_forwarding(&tor);
    ext.run(&["ip", "route", "add", "default", "via", "198.51.100.1"]);

    // The imported VM: its old address and gateway, configured in the
    // guest as on its old platform.
    let imp = a.add_vm("imp", IMP_MAC, &[&format!("{IMP_IP}/16")], Some(GATEWAY));
    let imp_t = b.add_vm("impt", IMP_MAC, &[&format!("{IMP_IP}/16")], Some(GATEWAY));
    imp_t.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let lrn = b.add_vm("lrn", LRN_MAC, &[&format!("{LRN_IP}/16")], Some(GATEWAY));
    let cvm = c
        .as_ref()
        .map(|c| c.add_vm("cvm", CVM_MAC, &[&format!("{CVM_IP}/16")], Some(GATEWAY)));

    // The VXLAN overlay shares the uplink with the fabric.
    for node in [Some(&mut a), Some(&mut b), c.as_mut()]
        .into_iter()
        .flatten()
    {
        node.set_agent_args(&["--uplink", "ul0", "--metrics-addr", "off"]);
    }
    let tor_bird = Bird::start(&tor, "tor", &bird_tor_config(nodes));
    let node_birds: Vec<Bird> = [Some(&a), Some(&b), c.as_ref()]
        .into_iter()
        .flatten()
        .zip(NODES)
        .map(|(node, (name, ip, asn))| {
            Bird::start(
                &node.ns,
                &format!("node-{name}"),
                &bird_node_config(ip, ip, asn, TOR_IP, 65000),
            )
        })
        .collect();
    let mut bed = Bed {
        a,
        b,
        tor,
        ext,
        imp,
        imp_t,
        lrn,
        c: c.zip(cvm),
        tor_bird,
        _node_birds: node_birds,
        _underlay: underlay,
    };
    write_config(&bed, None);
    bed.a.start_agent();
    bed.b.start_agent();
    bed.a.wait_ports(&[&bed.imp.port]);
    bed.b.wait_ports(&[&bed.lrn.port]);
    if let Some((c, cvm)) = &mut bed.c {
        c.start_agent();
        c.wait_ports(&[&cvm.port]);
    }
    for node in bed.nodes() {
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
/// host to the imported VM's own address, one per millisecond, and writes
/// each one's send time to `sent_log` at the end ([`sent_times`]).
fn sender(ns: &Netns, sent_log: &Path) -> Child {
    let script = format!(
        "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = []
t0 = time.monotonic()
for seq in range({STREAM_COUNT}):
    sent.append(time.monotonic_ns())
    s.sendto(seq.to_bytes(8, 'big') + b'x' * 56, ('{IMP_IP}', {UDP_PORT}))
    wait = t0 + (seq + 1) / 1000.0 - time.monotonic()
    if wait > 0:
        time.sleep(wait)
open('{}', 'w').write('\\n'.join(map(str, sent)))
",
        sent_log.display()
    );
    ns.spawn(&["python3", "-c", &script])
}

/// What the cut-over cost the external host's stream.
#[derive(Clone, Debug)]
pub struct ExternalWindow {
    /// The longest run of lost datagrams ([`LossRun`](crate::migration::LossRun)) sent from 200 ms
    /// before the cut-over until the ToR's route to the VM moved to the
    /// target node, ms.
    pub gap_ms: f64,
    /// The same from 200 ms before the cut-over to the end of the stream,
    /// ms (whatever the ToR did).
    pub gap_to_end_ms: f64,
    /// Longest silence at the receivers from 200 ms before the cut-over
    /// to the end, ms: the loss window plus whatever kept a receiver from
    /// the CPU (reported, not bounded).
    pub rx_silence_ms: f64,
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
    /// Datagrams the target received before the ToR's route was seen to
    /// move (polled about every 10 ms, so a few may have come the new
    /// way): the fabric still sent them to the source, which relayed them.
    pub on_target_before_converged: usize,
    /// The test's own cut-over between the source's link going down and
    /// the target up and announcing (an `ip` command and the announcer's
    /// trigger), ms: the namespace migration's pause. A loaded machine
    /// stretches it; what vmpath adds is the window beyond it.
    pub commands_ms: f64,
}

impl ExternalWindow {
    /// `gap_ms` beyond the test's own cut-over commands.
    pub fn beyond_commands_ms(&self) -> f64 {
        self.gap_ms - self.commands_ms
    }

    /// `gap_to_end_ms` beyond the test's own cut-over commands.
    pub fn to_end_beyond_commands_ms(&self) -> f64 {
        self.gap_to_end_ms - self.commands_ms
    }
}

/// The cut-over of a migration [`start_migration`] made pending, while
/// the external host streams to the VM: once the stream reaches the VM on
/// the source, the source stops, the target resumes and announces itself
/// (GARP and RARP, as QEMU does); `ready: true` follows 1 s later.
pub fn external_loss_window(bed: &Bed) -> ExternalWindow {
    let dir = std::env::temp_dir().join(format!("vmpath-ns-migration-{}", bed.a.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let files: [PathBuf; 2] = [dir.join("rx-source"), dir.join("rx-target")];
    let trigger = dir.join("resume");
    // Receivers that end when told: however long the helpers took to
    // start, they hear the whole stream.
    let rx_source = signalled_receiver(&bed.imp.ns, &files[0], 60, false);
    let rx_target = signalled_receiver(&bed.imp_t.ns, &files[1], 60, false);
    // The announcement is ready to go before the stream starts: scapy
    // takes seconds to import on a busy machine, and a fixed pause here
    // once let the cut-over wait 0.8 s for it (a CI run: the "loss window"
    // was the announcer still importing). A plain packet socket, bound
    // while the target's link is down; scapy only builds the frames.
    let ready = dir.join("announce-ready");
    let announce = bed.imp_t.ns.spawn(&[
        SCAPY_PYTHON,
        "-c",
        &format!(
            "import os, socket, time
from scapy.all import *
conf.verb = 0
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
garp = bytes(Ether(src='{IMP_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{IMP_MAC}', psrc='{IMP_IP}', hwdst='00:00:00:00:00:00', pdst='{IMP_IP}'))
rarp = bytes(Ether(src='{IMP_MAC}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{IMP_MAC}', hwdst='{IMP_MAC}', psrc='0.0.0.0', pdst='0.0.0.0'))
open('{}', 'w').close()
while not os.path.exists('{}'):
    time.sleep(0.001)
s.send(garp)
s.send(rarp)
",
            ready.display(),
            trigger.display()
        ),
    ]);
    wait_for(
        "the receivers bound and the announcement ready",
        Duration::from_secs(60),
        || ready.exists() && files.iter().all(|f| with_suffix(f, ".ready").exists()),
    );
    let relayed_before = overlay_tx(&bed.a);
    let sent_log = dir.join("sent");
    let tx = sender(&bed.ext, &sent_log);
    // The stream must flow to the source before the cut-over (a loaded
    // machine may take a while to start the sender): the receiver's first
    // buffered lines reach its file after a few hundred datagrams.
    wait_for(
        "the stream to reach the VM on the source",
        Duration::from_secs(15),
        || std::fs::metadata(&files[0]).is_ok_and(|m| m.len() > 0),
    );
    std::thread::sleep(Duration::from_millis(200));

    let cut = monotonic_ns();
    bed.imp.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let stopped = monotonic_ns();
    bed.imp_t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    std::fs::write(&trigger, b"").unwrap();
    let resumed = monotonic_ns();
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
    // The last datagrams in flight, then the receivers stop.
    std::thread::sleep(Duration::from_millis(200));
    for f in &files {
        std::fs::write(with_suffix(f, ".stop"), b"").unwrap();
    }
    for child in [rx_source, rx_target, announce] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rx = received(&files);
    let (rx_silence_ms, _, _) = longest_gap(&rx, cut - 200_000_000, end);
    let mut seqs: Vec<u64> = rx.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let sent = sent_times(&sent_log);
    let from = cut - 200_000_000;
    let gap_ms = longest_loss(&sent, &seqs, from, converged.unwrap_or(end).max(cut)).ms;
    let gap_to_end_ms = longest_loss(&sent, &seqs, from, end).ms;
    let target_rx = received(&files[1..2]);
    let on_target = target_rx.len();
    let on_target_before_converged = target_rx
        .iter()
        .filter(|(_, t)| converged.is_none_or(|c| *t < c))
        .count();
    let _ = std::fs::remove_dir_all(&dir);
    ExternalWindow {
        gap_ms,
        gap_to_end_ms,
        rx_silence_ms,
        lost: STREAM_COUNT - seqs.len() as u64,
        on_target,
        relayed,
        converged_ms: converged.map_or(f64::NAN, |t| (t - cut) as f64 / 1e6),
        on_target_before_converged,
        commands_ms: (resumed - stopped) as f64 / 1e6,
    }
}
