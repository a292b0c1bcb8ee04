//! Live migration over the overlay, shared by the migration tests
//! (`tests/tests/migration.rs`) and the bench's loss-window figure
//! (`vmpath-bench --only migration`).
//!
//! vm1 moves from node a to node b while a client on node c streams UDP to
//! it. The migration is simulated as KubeVirt runs one: a second VM
//! namespace with the same MAC and IPs on node b (the target pod),
//! `migration: {targetNode: b, ready: false}` in every node's config, then
//! the cut-over: the source stops, the target resumes and announces itself
//! (GARP, QEMU's RARP, or an unsolicited neighbour advertisement), and
//! later the config says `ready: true`. The network is dual-stack: the
//! client streams to vm1's IPv4 and IPv6 addresses at once, and the loss
//! window is measured at the receivers for each family.

use std::{
    path::{Path, PathBuf},
    process::Child,
    time::Duration,
};

use crate::{
    Netns, Node, SCAPY_PYTHON, Underlay, UnderlayFamily, Vm, cluster_net, vmpath::common, wait_for,
    yaml, yaml_overlay,
};

pub const NET: &str = "blue";
pub const NET_ID: u32 = 100;
/// The nodes, each with its underlay address number (`UnderlayFamily::node_ip`).
pub const NODES: [(&str, u8); 3] = [("a", 1), ("b", 2), ("c", 3)];
/// Their addresses on an IPv4 underlay (`UnderlayFamily::V4.node_ip`).
pub const NODE_IPS: [(&str, &str); 3] =
    [("a", "192.0.2.1"), ("b", "192.0.2.2"), ("c", "192.0.2.3")];
pub const UNDERLAY_MTU: u32 = 9000;
pub const VM1_MAC: &str = "52:54:00:00:01:01";
pub const VM1_IP: &str = "10.20.0.11";
pub const VM1_IP6: &str = "fd20::11";
pub const CLIENT_MAC: &str = "52:54:00:00:03:01";
pub const CLIENT_IP: &str = "10.20.0.31";
pub const CLIENT_IP6: &str = "fd20::31";
pub const GATEWAY: &str = "10.20.0.1";
pub const GATEWAY6: &str = "fd20::1";
const SUBNET6: &str = "fd20::/64";
pub const UDP_PORT: u16 = 7001;
/// The stream: one datagram per millisecond.
pub const INTERVAL_MS: u64 = 1;
/// Datagrams in each family's stream of [`loss_window`] (5 s at one per
/// ms).
pub const STREAM_COUNT: u64 = 5000;

/// What the migrating VM's network is to its pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A Multus secondary network (the default).
    Secondary,
    /// The pod network (`role: Primary`): the agents are given the
    /// cluster's pod and Service CIDRs (`cluster_net`'s), as a pod
    /// network's agents are.
    Primary,
}

/// Three nodes on one underlay: vm1 on a, its (paused) target on b, the
/// client on c.
pub struct Bed {
    /// The underlay's family (the overlay tests run over both).
    pub family: UnderlayFamily,
    /// The network's role.
    pub role: Role,
    pub a: Node,
    pub b: Node,
    pub c: Node,
    pub vm1: Vm,
    /// The target pod's VM on node b: same MAC and IPs, not running yet.
    pub vm1t: Vm,
    pub client: Vm,
    _underlay: Underlay,
}

pub fn network_doc() -> String {
    network_doc_for(Role::Secondary)
}

/// [`network_doc`] with the network's `role`.
pub fn network_doc_for(role: Role) -> String {
    // Advertised per VM, so the /32 and /128 are in table 100 and move
    // with the VM.
    let role = match role {
        Role::Secondary => "",
        Role::Primary => "  role: Primary\n",
    };
    yaml::network(
        NET,
        NET_ID,
        &["10.20.0.0/16", SUBNET6],
        &[GATEWAY, GATEWAY6],
        false,
    ) + "  egress: Routed\n  advertise: {perVM: true}\n"
        + role
}

fn vm1_doc(port: &str, migration: Option<(&str, bool)>) -> String {
    let mut doc = yaml::attachment(
        "vm1",
        NET,
        "a",
        port,
        VM1_MAC,
        &[&format!("{VM1_IP}/16"), &format!("{VM1_IP6}/64")],
    );
    if let Some((target_port, ready)) = migration {
        doc +=
            &format!("  migration: {{targetNode: b, targetPort: {target_port}, ready: {ready}}}\n");
    }
    doc
}

/// Writes every node's config: no migration (`None`), or the migration of
/// vm1 to b, pending (`Some(false)`) or ready (`Some(true)`).
pub fn write_config(bed: &Bed, migration: Option<bool>) {
    let mut docs: Vec<String> = NODES
        .iter()
        .map(|(n, i)| yaml_overlay::node(n, &bed.family.node_ip(*i)))
        .collect();
    docs.push(network_doc_for(bed.role));
    docs.push(vm1_doc(
        &bed.vm1.port,
        migration.map(|ready| (bed.vm1t.port.as_str(), ready)),
    ));
    docs.push(yaml::attachment(
        "client",
        NET,
        "c",
        &bed.client.port,
        CLIENT_MAC,
        &[&format!("{CLIENT_IP}/16"), &format!("{CLIENT_IP6}/64")],
    ));
    let config = yaml::docs(&docs);
    for node in [&bed.a, &bed.b, &bed.c] {
        node.write_config("config.yaml", &config);
    }
}

/// Builds the three nodes, starts their agents and waits until the client
/// reaches vm1 over the overlay (an IPv4 underlay).
pub fn three_nodes() -> Bed {
    three_nodes_over(UnderlayFamily::V4)
}

/// [`three_nodes`] over an underlay of `family`.
pub fn three_nodes_over(family: UnderlayFamily) -> Bed {
    three_nodes_with(family, Role::Secondary)
}

/// [`three_nodes`] with vm1 and the client on the pod network (`role:
/// Primary`), the agents given the cluster's pod and Service CIDRs.
pub fn three_nodes_on_pod_network() -> Bed {
    three_nodes_with(UnderlayFamily::V4, Role::Primary)
}

/// [`three_nodes`] over an underlay of `family`, the network's role `role`.
pub fn three_nodes_with(family: UnderlayFamily, role: Role) -> Bed {
    let underlay = Underlay::new();
    let a = Node::new("a");
    let b = Node::new("b");
    let c = Node::new("c");
    for (node, (_, i)) in [&a, &b, &c].into_iter().zip(NODES) {
        underlay.plug(&node.ns, "ul0", &family.node_cidr(i), UNDERLAY_MTU);
    }
    let vm1_addrs = [format!("{VM1_IP}/16"), format!("{VM1_IP6}/64")];
    let vm1_addrs: Vec<&str> = vm1_addrs.iter().map(String::as_str).collect();
    let vm1 = a.add_vm("vm1", VM1_MAC, &vm1_addrs, Some(GATEWAY));
    let vm1t = b.add_vm("vm1t", VM1_MAC, &vm1_addrs, Some(GATEWAY));
    // The target VM is paused until the cut-over: it sends nothing. Its
    // IPv6 address stays through the link's down and up, as a paused
    // guest's would (the kernel flushes it on down otherwise).
    vm1t.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.eth0.keep_addr_on_down=1"]);
    vm1t.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let client = c.add_vm(
        "cli",
        CLIENT_MAC,
        &[&format!("{CLIENT_IP}/16"), &format!("{CLIENT_IP6}/64")],
        Some(GATEWAY),
    );
    let mut bed = Bed {
        family,
        role,
        a,
        b,
        c,
        vm1,
        vm1t,
        client,
        _underlay: underlay,
    };
    write_config(&bed, None);
    let cidrs = [
        format!("{},{}", cluster_net::POD_CIDR, cluster_net::POD_CIDR6),
        format!(
            "{},{}",
            cluster_net::SERVICE_CIDR,
            cluster_net::SERVICE_CIDR6
        ),
    ];
    for node in [&mut bed.a, &mut bed.b, &mut bed.c] {
        if role == Role::Primary {
            node.set_agent_args(&[
                "--cluster-pod-cidrs",
                &cidrs[0],
                "--cluster-service-cidrs",
                &cidrs[1],
            ]);
        }
        node.start_agent();
    }
    bed.a.wait_ports(&[&bed.vm1.port]);
    bed.b.wait_ports(&[]);
    bed.c.wait_ports(&[&bed.client.port]);
    for node in [&bed.a, &bed.b, &bed.c] {
        wait_for(
            &format!("the overlay on node {}", node.name),
            Duration::from_secs(10),
            || node.agent_log().contains("overlay ready"),
        );
    }
    for dst in [VM1_IP, VM1_IP6] {
        assert!(
            bed.client.ping(dst),
            "client (c) -> vm1 (a) at {dst} before migrating"
        );
    }
    for gw in [GATEWAY, GATEWAY6] {
        assert!(bed.vm1.ping(gw), "vm1 -> its gateway {gw} on a");
    }
    bed
}

/// Flags of `ifname`'s port entry on `node`, if programmed.
pub fn port_flags(node: &Node, ifname: &str) -> Option<u16> {
    let ifindex = node.ns.ifindex(ifname);
    node.maps().ports.get(&ifindex, 0).ok().map(|p| p.flags)
}

/// Writes the migration as pending everywhere and waits until node b
/// serves the target port as pending and nothing else moved.
pub fn start_migration(bed: &Bed) {
    write_config(bed, Some(false));
    wait_for(
        "the pending target port on b",
        Duration::from_secs(10),
        || port_flags(&bed.b, &bed.vm1t.port).is_some_and(|f| f & common::PORT_F_PENDING != 0),
    );
    // Still served by a: its port, its route.
    assert!(port_flags(&bed.a, &bed.vm1.port).is_some());
    wait_for("a advertises vm1", Duration::from_secs(5), || {
        table100(&bed.a.ns).contains(VM1_IP) && table100_v6(&bed.a.ns).contains(VM1_IP6)
    });
    assert!(
        !table100(&bed.b.ns).contains(VM1_IP) && !table100_v6(&bed.b.ns).contains(VM1_IP6),
        "b advertised a pending VM"
    );
}

/// The 4-byte VTEP value `on` knows node `to` (1: a, 2: b, 3: c) by in its
/// maps: the IPv4 address, or on an IPv6 underlay the handle its agent
/// gave the node's address (`vmp_vtep6_ids`).
pub fn vtep_on(bed: &Bed, on: &Node, to: u8) -> [u8; 4] {
    let ip: std::net::IpAddr = bed.family.node_ip(to).parse().unwrap();
    match ip {
        std::net::IpAddr::V4(a) => a.octets(),
        std::net::IpAddr::V6(a) => on
            .maps()
            .vtep6_ids
            .get(&a.octets(), 0)
            .unwrap_or_else(|e| panic!("no VTEP handle for {a} on node {}: {e}", on.name)),
    }
}

/// vm1's endpoint entry on `node`, if any.
pub fn vm1_endpoint(node: &Node) -> Option<common::Endpoint> {
    let key = common::EndpointKey {
        network: NET_ID,
        mac: [0x52, 0x54, 0, 0, 1, 1],
        _pad: [0; 2],
    };
    node.maps().endpoints.get(&key, 0).ok()
}

/// The routes the agent exports in table 100 ("" while the table has none).
pub fn table100(ns: &Netns) -> String {
    let out = ns.run_status(&["ip", "route", "show", "table", "100", "proto", "250"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The IPv6 routes the agent exports in table 100 ("" while none).
pub fn table100_v6(ns: &Netns) -> String {
    let out = ns.run_status(&["ip", "-6", "route", "show", "table", "100", "proto", "250"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A UDP receiver in `ns` writing "seq monotonic_ns" lines to `out` for
/// `seconds`.
pub fn receiver(ns: &Netns, out: &Path, seconds: u32) -> Child {
    udp_receiver(ns, out, seconds, false, false)
}

/// A receiver for [`loss_window`], IPv4 or IPv6 (`::`): it creates
/// `<out>.ready` once bound and ends when `<out>.stop` exists (or after
/// `seconds`), so a slow start on a busy machine shifts nothing.
pub fn signalled_receiver(ns: &Netns, out: &Path, seconds: u32, v6: bool) -> Child {
    udp_receiver(ns, out, seconds, v6, true)
}

pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    PathBuf::from(p)
}

fn udp_receiver(ns: &Netns, out: &Path, seconds: u32, v6: bool, signals: bool) -> Child {
    // The IPv6 socket takes IPv6 only: the IPv4 receiver has the port.
    let (family, any, v6only) = if v6 {
        (
            "AF_INET6",
            "::",
            "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)",
        )
    } else {
        ("AF_INET", "0.0.0.0", "")
    };
    let script = format!(
        "import os, socket, time
s = socket.socket(socket.{family}, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
{v6only}
s.bind(('{any}', {UDP_PORT}))
s.settimeout(0.2)
out = open('{out}', 'w')
if {signals}:
    open('{out}.ready', 'w').close()
end = time.monotonic() + {seconds}
while time.monotonic() < end and not ({signals} and os.path.exists('{out}.stop')):
    try:
        d, _ = s.recvfrom(128)
    except socket.timeout:
        continue
    out.write('%d %d\\n' % (int.from_bytes(d[:8], 'big'), time.monotonic_ns()))
out.close()
",
        out = out.display(),
        signals = if signals { "True" } else { "False" },
    );
    ns.spawn(&["python3", "-c", &script])
}

/// Sends `count` sequence-numbered datagrams to each of vm1's addresses
/// (IPv4 and IPv6, the same sequence number at once), one per interval;
/// creates `started` after the first and writes each sequence number's
/// send time to `sent_log` at the end ([`sent_times`]).
pub fn sender(ns: &Netns, count: u64, started: &Path, sent_log: &Path) -> Child {
    let script = format!(
        "import socket, time
s4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
sent = []
t0 = time.monotonic()
for seq in range({count}):
    d = seq.to_bytes(8, 'big') + b'x' * 56
    sent.append(time.monotonic_ns())
    s4.sendto(d, ('{VM1_IP}', {UDP_PORT}))
    s6.sendto(d, ('{VM1_IP6}', {UDP_PORT}))
    if seq == 0:
        open('{}', 'w').close()
    wait = t0 + (seq + 1) * {INTERVAL_MS} / 1000.0 - time.monotonic()
    if wait > 0:
        time.sleep(wait)
open('{}', 'w').write('\\n'.join(map(str, sent)))
",
        started.display(),
        sent_log.display()
    );
    ns.spawn(&["python3", "-c", &script])
}

/// The send time (monotonic ns) of each sequence number, by sequence
/// number, from a sender's log.
pub fn sent_times(log: &Path) -> Vec<u64> {
    std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("the sender's log {}: {e}", log.display()))
        .lines()
        .map(|l| {
            l.trim()
                .parse()
                .unwrap_or_else(|e| panic!("the sender's log {}: {l:?}: {e}", log.display()))
        })
        .collect()
}

/// The longest run of consecutive datagrams no receiver got.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossRun {
    /// The first lost datagram's send time to the last's, plus one
    /// interval, ms: how long the path was broken at least. Measured on
    /// the sender's clock, so neither a receiver nor the sender starved
    /// of CPU on a busy machine stretches it (a receiver's silence does:
    /// its datagrams wait in its socket buffer, and a sender that stalls
    /// sends nothing to lose).
    pub ms: f64,
    /// The first and last sequence numbers lost.
    pub seqs: (u64, u64),
}

/// The longest run of lost datagrams (sequence numbers `sent` has and
/// `got` lacks) whose first was sent in `[from, to)` (monotonic ns); a run
/// `to` cuts goes on to its end.
pub fn longest_loss(sent: &[u64], got: &[u64], from: u64, to: u64) -> LossRun {
    let got: std::collections::HashSet<u64> = got.iter().copied().collect();
    let mut best = LossRun::default();
    let mut seq = 0;
    while seq < sent.len() {
        if got.contains(&(seq as u64)) {
            seq += 1;
            continue;
        }
        let first = seq;
        while seq + 1 < sent.len() && !got.contains(&(seq as u64 + 1)) {
            seq += 1;
        }
        let ms = (sent[seq] - sent[first]) as f64 / 1e6 + INTERVAL_MS as f64;
        if (from..to).contains(&sent[first]) && ms > best.ms {
            best = LossRun {
                ms,
                seqs: (first as u64, seq as u64),
            };
        }
        seq += 1;
    }
    best
}

/// (seq, receive time in ns) from every receiver, by receive time.
pub fn received(files: &[PathBuf]) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut it = l.split_whitespace();
                    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
                })
                .collect::<Vec<(u64, u64)>>()
        })
        .collect();
    all.sort_by_key(|&(_, t)| t);
    all
}

/// The longest silence between two datagrams received in `[from, to)`
/// (monotonic ns), in ms, with the sequence numbers around it. A silence
/// that `to` cuts ends at the first datagram after it: a stream that
/// stopped at the cut-over and came back only after `to` shows its whole
/// silence, not the last gap before it.
pub fn longest_gap(rx: &[(u64, u64)], from: u64, to: u64) -> (f64, u64, u64) {
    // `rx` is sorted by receive time.
    let after = rx.iter().find(|(_, t)| *t >= to);
    let window: Vec<&(u64, u64)> = rx
        .iter()
        .filter(|(_, t)| *t >= from && *t < to)
        .chain(after)
        .collect();
    window
        .windows(2)
        .map(|w| ((w[1].1 - w[0].1) as f64 / 1e6, w[0].0, w[1].0))
        .fold((0.0, 0, 0), |best, g| if g.0 > best.0 { g } else { best })
}

/// CLOCK_MONOTONIC in ns, the clock the receivers stamp with.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// What one cut-over cost one family's stream, as [`loss_window`]
/// measured it.
#[derive(Clone, Debug)]
pub struct StreamWindow {
    /// The longest run of lost datagrams sent from 200 ms before the
    /// cut-over to the ready signal, ms ([`LossRun`]): the loss window.
    pub gap_ms: f64,
    /// The first and last sequence numbers of that run.
    pub gap_seqs: (u64, u64),
    /// Longest silence at the receivers over the same span, ms: the loss
    /// window plus whatever kept a receiver from the CPU (reported, not
    /// bounded).
    pub rx_silence_ms: f64,
    /// Datagrams of the [`STREAM_COUNT`] that no receiver got.
    pub lost: u64,
    /// Datagrams the target received.
    pub on_target: usize,
    /// Last datagram received on the source to first on the target, ms
    /// (NaN: one of them got none): the switch.
    pub switch_ms: f64,
    /// Sequence numbers of those two datagrams.
    pub switch_seqs: (u64, u64),
    /// The longest run of lost datagrams sent after the config said
    /// `ready: true`, ms.
    pub ready_gap_ms: f64,
    /// First datagram on the target after its link came up, ms (NaN: none).
    pub first_on_target_ms: f64,
}

/// What one cut-over cost the streams, as [`loss_window`] measured it.
#[derive(Clone, Debug)]
pub struct LossWindow {
    /// The IPv4 stream and the IPv6 stream, sent side by side.
    pub ipv4: StreamWindow,
    pub ipv6: StreamWindow,
    /// Source link down to target link up, ms: the cut-over's own `ip`
    /// commands, part of the window.
    pub commands_ms: f64,
    /// The gateway's MAC in the guest's neighbour table before the move:
    /// its IPv4 entry and its IPv6 entry.
    pub gw_lladdr: String,
    pub gw6_lladdr: String,
}

/// How the target announces the VM the moment it resumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Announce {
    /// A gratuitous ARP and QEMU's RARP.
    GarpAndRarp,
    /// Only an unsolicited neighbour advertisement for the VM's IPv6
    /// address, from that address to all nodes (what a guest kernel with
    /// `ndisc_notify` sends): the first frame the target sees from the VM.
    UnsolicitedNa,
}

/// The MAC in `ns`'s neighbour entry for `ip` on eth0.
fn lladdr(ns: &Netns, ip: &str) -> String {
    let entry = ns.run(&["ip", "neigh", "show", ip, "dev", "eth0"]);
    entry
        .split_whitespace()
        .skip_while(|w| *w != "lladdr")
        .nth(1)
        .unwrap_or_else(|| panic!("vm1 has no neighbour entry for {ip}: {entry:?}"))
        .to_string()
}

/// One family's figures from its receivers' files (source, target).
fn stream_window(
    files: &[PathBuf; 2],
    sent: &[u64],
    cut: u64,
    resumed: u64,
    ready_at: u64,
    end: u64,
) -> StreamWindow {
    let rx = received(files);
    let (rx_silence_ms, _, _) = longest_gap(&rx, cut - 200_000_000, ready_at);
    let mut seqs: Vec<u64> = rx.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let loss = longest_loss(sent, &seqs, cut - 200_000_000, ready_at);
    let ready_gap_ms = longest_loss(sent, &seqs, ready_at, end).ms;
    let on_target_rx = received(&files[1..2]);
    // The split: the source is gone from `stopped`, the target is up from
    // `resumed` (the cut-over's own `ip` commands lie between), and the
    // data path brings the stream to it by its first frames.
    let first_on_target_ms = on_target_rx
        .first()
        .map_or(f64::NAN, |(_, t)| (*t as f64 - resumed as f64) / 1e6);
    let last_on_source = received(&files[0..1]).last().copied();
    let (switch_ms, switch_seqs) = match (last_on_source, on_target_rx.first()) {
        (Some((s0, t0)), Some(&(s1, t1))) => ((t1 as f64 - t0 as f64) / 1e6, (s0, s1)),
        _ => (f64::NAN, (0, 0)),
    };
    StreamWindow {
        gap_ms: loss.ms,
        gap_seqs: loss.seqs,
        rx_silence_ms,
        switch_ms,
        switch_seqs,
        lost: STREAM_COUNT - seqs.len() as u64,
        on_target: on_target_rx.len(),
        ready_gap_ms,
        first_on_target_ms,
    }
}

/// Runs the cut-over of a migration [`start_migration`] made pending:
/// receivers in the source and target VMs (IPv4 and IPv6), the client
/// streaming [`STREAM_COUNT`] datagrams [`INTERVAL_MS`] apart to each of
/// vm1's addresses, the source stopped and the target resumed (announcing
/// itself as `announce` says) 1.5 s into the stream, `ready: true` written
/// 1 s later. Panics when a helper process fails.
pub fn loss_window(bed: &Bed, announce: Announce) -> LossWindow {
    let gw_lladdr = lladdr(&bed.vm1.ns, GATEWAY);
    let gw6_lladdr = lladdr(&bed.vm1.ns, GATEWAY6);

    let dir = std::env::temp_dir().join(format!("vmpath-migration-{}", bed.a.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let files = [dir.join("rx-source"), dir.join("rx-target")];
    let files6 = [dir.join("rx6-source"), dir.join("rx6-target")];
    let trigger = dir.join("resume");
    // Receivers end at a stop file (60 s at most).
    let receivers = [
        signalled_receiver(&bed.vm1.ns, &files[0], 60, false),
        signalled_receiver(&bed.vm1t.ns, &files[1], 60, false),
        signalled_receiver(&bed.vm1.ns, &files6[0], 60, true),
        signalled_receiver(&bed.vm1t.ns, &files6[1], 60, true),
    ];
    let announce_ready = dir.join("announce-ready");
    let frames = match announce {
        Announce::GarpAndRarp => format!(
            "[Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{VM1_MAC}', psrc='{VM1_IP}', hwdst='00:00:00:00:00:00', pdst='{VM1_IP}'), \
             Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{VM1_MAC}', hwdst='{VM1_MAC}', psrc='0.0.0.0', pdst='0.0.0.0')]"
        ),
        Announce::UnsolicitedNa => format!(
            "[Ether(src='{VM1_MAC}', dst='33:33:00:00:00:01')/IPv6(src='{VM1_IP6}', dst='ff02::1', hlim=255)/ICMPv6ND_NA(R=0, S=0, O=1, tgt='{VM1_IP6}')/ICMPv6NDOptDstLLAddr(lladdr='{VM1_MAC}')]"
        ),
    };
    // The announcement, ready to go the moment the VM resumes (scapy
    // takes a second to import).
    let announce = bed.vm1t.ns.spawn(&[
        SCAPY_PYTHON,
        "-c",
        &format!(
            "import os, time
from scapy.all import *
conf.verb = 0
frames = {frames}
open('{}', 'w').close()
while not os.path.exists('{}'):
    time.sleep(0.001)
sendp(frames, iface='eth0')
",
            announce_ready.display(),
            trigger.display()
        ),
    ]);
    // Python and scapy start slowly on a busy machine: every helper is
    // ready before the stream starts, and the stream runs before the cut.
    wait_for(
        "the receivers bound and the announcement ready",
        Duration::from_secs(60),
        || {
            announce_ready.exists()
                && files
                    .iter()
                    .chain(&files6)
                    .all(|f| with_suffix(f, ".ready").exists())
        },
    );
    let started = dir.join("sender-started");
    let sent_log = dir.join("sent");
    let tx = sender(&bed.client.ns, STREAM_COUNT, &started, &sent_log);
    wait_for("the stream started", Duration::from_secs(60), || {
        started.exists()
    });
    std::thread::sleep(Duration::from_millis(1500));

    // Cut-over: the source stops, the target resumes with the guest's
    // memory (its neighbour entries for the gateway included) and
    // announces.
    let cut = monotonic_ns();
    bed.vm1.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let stopped = monotonic_ns();
    bed.vm1t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    let resumed = monotonic_ns();
    std::fs::write(&trigger, b"").unwrap();
    bed.vm1t
        .ns
        .run(&["ip", "route", "replace", "default", "via", GATEWAY]);
    for (gw, mac) in [(GATEWAY, &gw_lladdr), (GATEWAY6, &gw6_lladdr)] {
        bed.vm1t.ns.run(&[
            "ip", "neigh", "replace", gw, "lladdr", mac, "dev", "eth0", "nud", "stale",
        ]);
    }
    // KubeVirt's ready signal comes later: the data path alone moved it.
    std::thread::sleep(Duration::from_millis(1000));
    let ready_at = monotonic_ns();
    write_config(bed, Some(true));
    let tx = tx.wait_with_output().unwrap();
    assert!(
        tx.status.success(),
        "sender: {}",
        String::from_utf8_lossy(&tx.stderr)
    );
    let end = monotonic_ns();
    std::thread::sleep(Duration::from_millis(200));
    for f in files.iter().chain(&files6) {
        std::fs::write(with_suffix(f, ".stop"), b"").unwrap();
    }
    for child in receivers.into_iter().chain([announce]) {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let sent = sent_times(&sent_log);
    let ipv4 = stream_window(&files, &sent, cut, resumed, ready_at, end);
    let ipv6 = stream_window(&files6, &sent, cut, resumed, ready_at, end);
    let _ = std::fs::remove_dir_all(&dir);
    LossWindow {
        ipv4,
        ipv6,
        commands_ms: (resumed - stopped) as f64 / 1e6,
        gw_lladdr,
        gw6_lladdr,
    }
}

#[cfg(test)]
mod loss_tests {
    use super::*;

    /// Send times 1 ms apart, except a 600 ms stall before seq 5.
    fn sent() -> Vec<u64> {
        (0..10u64)
            .map(|s| s * 1_000_000 + if s >= 5 { 600_000_000 } else { 0 })
            .collect()
    }

    #[test]
    fn a_loss_run_is_measured_on_the_senders_clock() {
        let sent = sent();
        // Nothing lost: no window, whatever the sender's stall.
        let all: Vec<u64> = (0..10).collect();
        assert_eq!(longest_loss(&sent, &all, 0, u64::MAX), LossRun::default());
        // 2 and 3 lost: two datagrams, 2 ms of path.
        let got = [0, 1, 4, 5, 6, 7, 8, 9];
        let run = longest_loss(&sent, &got, 0, u64::MAX);
        assert_eq!(run.seqs, (2, 3));
        assert!((run.ms - 2.0).abs() < 1e-9, "{run:?}");
        // 4 and 5 lost across the stall: the path was broken across it.
        let got = [0, 1, 2, 3, 6, 7, 8, 9];
        let run = longest_loss(&sent, &got, 0, u64::MAX);
        assert_eq!(run.seqs, (4, 5));
        assert!((run.ms - 602.0).abs() < 1e-9, "{run:?}");
        // A run starting before `from` is not counted; one `to` cuts goes
        // on to its end.
        assert_eq!(
            longest_loss(&sent, &got, 4_500_000, u64::MAX),
            LossRun::default()
        );
        let got = [0, 1, 2, 9];
        assert_eq!(longest_loss(&sent, &got, 0, 3_500_000).seqs, (3, 8));
    }
}
