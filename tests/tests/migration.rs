//! Live migration over the overlay: vm1 moves from node a to node b while a
//! client on node c streams UDP to it. The migration is simulated as
//! KubeVirt runs one: a second VM namespace with the same MAC and IPs on
//! node b (the target pod), `migration: {targetNode: b, ready: false}` in
//! every node's config, then the cut-over: the source stops, the target
//! resumes and announces itself (GARP, QEMU's RARP), and later the config
//! says `ready: true`. The loss window is measured at the receivers.

use std::{
    path::{Path, PathBuf},
    process::Child,
    time::Duration,
};

use vmpath_tests::{
    Netns, Node, SCAPY_PYTHON, Underlay, Vm, vmpath::common, wait_for, yaml, yaml_overlay,
};

const NET: &str = "blue";
const NET_ID: u32 = 100;
const NODE_IPS: [(&str, &str); 3] = [("a", "192.0.2.1"), ("b", "192.0.2.2"), ("c", "192.0.2.3")];
const UNDERLAY_MTU: u32 = 9000;
const VM1_MAC: &str = "52:54:00:00:01:01";
const VM1_IP: &str = "10.20.0.11";
const CLIENT_MAC: &str = "52:54:00:00:03:01";
const CLIENT_IP: &str = "10.20.0.31";
const GATEWAY: &str = "10.20.0.1";
const UDP_PORT: u16 = 7001;
/// The stream: one datagram per millisecond.
const INTERVAL_MS: u64 = 1;
/// Under this on a shared 2-core machine; the data path alone takes a few
/// milliseconds, the rest is the test's own `ip` commands and scheduling.
const MAX_LOSS_WINDOW_MS: f64 = 500.0;

struct Bed {
    a: Node,
    b: Node,
    c: Node,
    vm1: Vm,
    /// The target pod's VM on node b: same MAC and IPs, not running yet.
    vm1t: Vm,
    client: Vm,
    _underlay: Underlay,
}

fn network_doc() -> String {
    // Advertised per VM, so the /32 is in table 100 and moves with the VM.
    yaml::network(NET, NET_ID, &["10.20.0.0/16"], &[GATEWAY], false)
        + "  egress: Routed\n  advertise: {perVM: true}\n"
}

fn vm1_doc(port: &str, migration: Option<(&str, bool)>) -> String {
    let mut doc = yaml::attachment("vm1", NET, "a", port, VM1_MAC, &[&format!("{VM1_IP}/16")]);
    if let Some((target_port, ready)) = migration {
        doc +=
            &format!("  migration: {{targetNode: b, targetPort: {target_port}, ready: {ready}}}\n");
    }
    doc
}

fn write_config(bed: &Bed, migration: Option<bool>) {
    let mut docs: Vec<String> = NODE_IPS
        .iter()
        .map(|(n, ip)| yaml_overlay::node(n, ip))
        .collect();
    docs.push(network_doc());
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
        &[&format!("{CLIENT_IP}/16")],
    ));
    let config = yaml::docs(&docs);
    for node in [&bed.a, &bed.b, &bed.c] {
        node.write_config("config.yaml", &config);
    }
}

fn three_nodes() -> Bed {
    let underlay = Underlay::new();
    let a = Node::new("a");
    let b = Node::new("b");
    let c = Node::new("c");
    for (node, (_, ip)) in [&a, &b, &c].into_iter().zip(NODE_IPS) {
        underlay.plug(&node.ns, "ul0", &format!("{ip}/24"), UNDERLAY_MTU);
    }
    let vm1 = a.add_vm("vm1", VM1_MAC, &[&format!("{VM1_IP}/16")], Some(GATEWAY));
    let vm1t = b.add_vm("vm1t", VM1_MAC, &[&format!("{VM1_IP}/16")], Some(GATEWAY));
    // The target VM is paused until the cut-over: it sends nothing.
    vm1t.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let client = c.add_vm(
        "cli",
        CLIENT_MAC,
        &[&format!("{CLIENT_IP}/16")],
        Some(GATEWAY),
    );
    let bed = Bed {
        a,
        b,
        c,
        vm1,
        vm1t,
        client,
        _underlay: underlay,
    };
    write_config(&bed, None);
    let Bed {
        mut a,
        mut b,
        mut c,
        vm1,
        vm1t,
        client,
        _underlay,
    } = bed;
    for node in [&mut a, &mut b, &mut c] {
        node.start_agent();
    }
    a.wait_ports(&[&vm1.port]);
    b.wait_ports(&[]);
    c.wait_ports(&[&client.port]);
    for node in [&a, &b, &c] {
        wait_for(
            &format!("the overlay on node {}", node.name),
            Duration::from_secs(10),
            || node.agent_log().contains("overlay ready"),
        );
    }
    assert!(
        client.ping(VM1_IP),
        "client (c) -> vm1 (a) before migrating"
    );
    assert!(vm1.ping(GATEWAY), "vm1 -> its gateway on a");
    Bed {
        a,
        b,
        c,
        vm1,
        vm1t,
        client,
        _underlay,
    }
}

/// Flags of `ifname`'s port entry on `node`, if programmed.
fn port_flags(node: &Node, ifname: &str) -> Option<u16> {
    let ifindex = node.ns.ifindex(ifname);
    node.maps().ports.get(&ifindex, 0).ok().map(|p| p.flags)
}

/// Writes the migration as pending everywhere and waits until node b
/// serves the target port as pending and nothing else moved.
fn start_migration(bed: &Bed) {
    write_config(bed, Some(false));
    wait_for(
        "the pending target port on b",
        Duration::from_secs(10),
        || port_flags(&bed.b, &bed.vm1t.port).is_some_and(|f| f & common::PORT_F_PENDING != 0),
    );
    // Still served by a: its port, its route.
    assert!(port_flags(&bed.a, &bed.vm1.port).is_some());
    wait_for("a advertises vm1", Duration::from_secs(5), || {
        table100(&bed.a.ns).contains(VM1_IP)
    });
    assert!(
        !table100(&bed.b.ns).contains(VM1_IP),
        "b advertised a pending VM"
    );
}

fn vm1_endpoint(node: &Node) -> Option<common::Endpoint> {
    let key = common::EndpointKey {
        network: NET_ID,
        mac: [0x52, 0x54, 0, 0, 1, 1],
        _pad: [0; 2],
    };
    node.maps().endpoints.get(&key, 0).ok()
}

/// The routes the agent exports in table 100 ("" while the table has none).
fn table100(ns: &Netns) -> String {
    let out = ns.run_status(&["ip", "route", "show", "table", "100", "proto", "250"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A UDP receiver in `ns` writing "seq monotonic_ns" lines to `out`.
fn receiver(ns: &Netns, out: &Path, seconds: u32) -> Child {
    let script = format!(
        "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.bind(('0.0.0.0', {UDP_PORT}))
s.settimeout(0.2)
out = open('{}', 'w')
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    try:
        d, _ = s.recvfrom(128)
    except socket.timeout:
        continue
    out.write('%d %d\\n' % (int.from_bytes(d[:8], 'big'), time.monotonic_ns()))
out.close()
",
        out.display()
    );
    ns.spawn(&["python3", "-c", &script])
}

/// Sends `count` sequence-numbered datagrams to vm1, one per interval.
fn sender(ns: &Netns, count: u64) -> Child {
    let script = format!(
        "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
t0 = time.monotonic()
for seq in range({count}):
    s.sendto(seq.to_bytes(8, 'big') + b'x' * 56, ('{VM1_IP}', {UDP_PORT}))
    wait = t0 + (seq + 1) * {INTERVAL_MS} / 1000.0 - time.monotonic()
    if wait > 0:
        time.sleep(wait)
"
    );
    ns.spawn(&["python3", "-c", &script])
}

/// (seq, receive time in ns) from every receiver, by receive time.
fn received(files: &[PathBuf]) -> Vec<(u64, u64)> {
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
/// (monotonic ns), in ms, with the sequence numbers around it.
fn longest_gap(rx: &[(u64, u64)], from: u64, to: u64) -> (f64, u64, u64) {
    let window: Vec<&(u64, u64)> = rx.iter().filter(|(_, t)| *t >= from && *t < to).collect();
    window
        .windows(2)
        .map(|w| ((w[1].1 - w[0].1) as f64 / 1e6, w[0].0, w[1].0))
        .fold((0.0, 0, 0), |best, g| if g.0 > best.0 { g } else { best })
}

/// CLOCK_MONOTONIC in ns, the clock the receivers stamp with.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[test]
fn live_migration_keeps_ip_mac_and_gateway_with_a_short_loss_window() {
    let bed = three_nodes();
    start_migration(&bed);
    // Pending: traffic still reaches the source.
    assert!(bed.client.ping(VM1_IP), "client -> vm1 on a while pending");
    let gw_mac = bed
        .vm1
        .ns
        .run(&["ip", "neigh", "show", GATEWAY, "dev", "eth0"]);
    assert!(
        gw_mac.contains("lladdr"),
        "vm1 has no gateway entry: {gw_mac}"
    );
    let gw_lladdr = gw_mac
        .split_whitespace()
        .skip_while(|w| *w != "lladdr")
        .nth(1)
        .unwrap()
        .to_string();

    let dir = std::env::temp_dir().join(format!("vmpath-migration-{}", bed.a.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let files = [dir.join("rx-source"), dir.join("rx-target")];
    let trigger = dir.join("resume");
    let rx_source = receiver(&bed.vm1.ns, &files[0], 8);
    let rx_target = receiver(&bed.vm1t.ns, &files[1], 8);
    // QEMU's announcements, ready to go the moment the VM resumes (scapy
    // takes a second to import).
    let announce = bed.vm1t.ns.spawn(&[
        SCAPY_PYTHON,
        "-c",
        &format!(
            "import os, time
from scapy.all import *
conf.verb = 0
while not os.path.exists('{}'):
    time.sleep(0.001)
garp = Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{VM1_MAC}', psrc='{VM1_IP}', hwdst='00:00:00:00:00:00', pdst='{VM1_IP}')
rarp = Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{VM1_MAC}', hwdst='{VM1_MAC}', psrc='0.0.0.0', pdst='0.0.0.0')
sendp([garp, rarp], iface='eth0')
",
            trigger.display()
        ),
    ]);
    std::thread::sleep(Duration::from_millis(1500));
    let tx = sender(&bed.client.ns, 5000);
    std::thread::sleep(Duration::from_millis(1500));

    // Cut-over: the source stops, the target resumes with the guest's
    // memory (its neighbour entry for the gateway included) and announces.
    let cut = monotonic_ns();
    bed.vm1.ns.run(&["ip", "link", "set", "eth0", "down"]);
    let stopped = monotonic_ns();
    bed.vm1t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    let resumed = monotonic_ns();
    std::fs::write(&trigger, b"").unwrap();
    bed.vm1t
        .ns
        .run(&["ip", "route", "replace", "default", "via", GATEWAY]);
    bed.vm1t.ns.run(&[
        "ip", "neigh", "replace", GATEWAY, "lladdr", &gw_lladdr, "dev", "eth0", "nud", "stale",
    ]);
    // KubeVirt's ready signal comes later: the data path alone moved it.
    std::thread::sleep(Duration::from_millis(1000));
    let ready_at = monotonic_ns();
    write_config(&bed, Some(true));
    let tx = tx.wait_with_output().unwrap();
    assert!(
        tx.status.success(),
        "sender: {}",
        String::from_utf8_lossy(&tx.stderr)
    );
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
    let (gap, before, after) = longest_gap(&rx, cut - 200_000_000, ready_at);
    let (ready_gap, _, _) = longest_gap(&rx, ready_at, end);
    let mut seqs: Vec<u64> = rx.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    seqs.dedup();
    let lost = 5000 - seqs.len() as u64;
    let on_target = std::fs::read_to_string(&files[1]).unwrap().lines().count();
    // The split: the source is gone from `stopped`, the target is up from
    // `resumed` (the test's own `ip` commands lie between), and the data
    // path brings the stream to it by its first frames.
    let first_on_target = received(&files[1..2])
        .first()
        .map_or(f64::NAN, |(_, t)| (*t as f64 - resumed as f64) / 1e6);
    eprintln!(
        "migration: source down -> target up took {:.1} ms (test commands); first datagram on the target {first_on_target:.1} ms after its link came up",
        (resumed - stopped) as f64 / 1e6
    );
    eprintln!(
        "migration loss window: {gap:.1} ms (seq {before} -> {after}), {lost} of 5000 datagrams lost ({INTERVAL_MS} ms apart), {on_target} received on the target; longest gap after ready: {ready_gap:.1} ms"
    );
    assert!(
        on_target > 1000,
        "the target received only {on_target} datagrams"
    );
    assert!(
        gap < MAX_LOSS_WINDOW_MS,
        "loss window {gap:.1} ms (seq {before} -> {after})"
    );
    assert!(
        ready_gap < MAX_LOSS_WINDOW_MS,
        "the ready signal cost {ready_gap:.1} ms"
    );
    let log_b = bed.b.agent_log();
    assert!(log_b.contains("the VM spoke on the target port"), "{log_b}");

    // The VM kept its identity: `vmpath vm show` on b.
    wait_for("b serves vm1 as active", Duration::from_secs(10), || {
        port_flags(&bed.b, &bed.vm1t.port).is_some_and(|f| f & common::PORT_F_PENDING == 0)
            && port_flags(&bed.a, &bed.vm1.port).is_none()
    });
    let show = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        "prod/vm1",
        "--api-socket",
        bed.b.api_socket().to_str().unwrap(),
    ]);
    assert!(show.contains(VM1_MAC) && show.contains(VM1_IP), "{show}");
    assert!(show.contains("cut-over"), "{show}");

    // The gateway answers on b with the MAC the guest already had.
    assert!(bed.vm1t.ping(GATEWAY), "vm1 (b) -> gateway");
    let neigh = bed
        .vm1t
        .ns
        .run(&["ip", "neigh", "show", GATEWAY, "dev", "eth0"]);
    assert!(
        neigh.contains(&gw_lladdr),
        "gateway MAC changed: {neigh} vs {gw_lladdr}"
    );
    assert!(bed.client.ping(VM1_IP), "client -> vm1 on b");

    // The /32 moved: b advertises it, a withdrew it.
    wait_for("the route moved to b", Duration::from_secs(10), || {
        table100(&bed.b.ns).contains(VM1_IP) && !table100(&bed.a.ns).contains(VM1_IP)
    });
    // c points at b directly; nothing needs relaying any more.
    let ep = vm1_endpoint(&bed.c).unwrap();
    assert_eq!(
        (ep.kind, ep.node_ip4),
        (common::ENDPOINT_REMOTE, [192, 0, 2, 2])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failed_migration_moves_nothing() {
    let bed = three_nodes();
    start_migration(&bed);
    // The migration is abandoned before the cut-over.
    write_config(&bed, None);
    wait_for("b drops the pending port", Duration::from_secs(10), || {
        port_flags(&bed.b, &bed.vm1t.port).is_none()
    });
    assert!(
        bed.client.ping(VM1_IP),
        "client -> vm1 on a after the failed migration"
    );
    assert!(port_flags(&bed.a, &bed.vm1.port).is_some());
    assert!(table100(&bed.a.ns).contains(VM1_IP));
    assert!(!table100(&bed.b.ns).contains(VM1_IP));
    // The client's node still points at a.
    let ep = vm1_endpoint(&bed.c).unwrap();
    assert_eq!(
        (ep.kind, ep.node_ip4, ep.migrate_to),
        (common::ENDPOINT_REMOTE, [192, 0, 2, 1], [0; 4])
    );
}

/// `count` UDP datagrams from `ns` to vm1, 2 ms apart (one way: vm1 sends
/// nothing back that would teach c where it is now).
fn send_udp(ns: &Netns, count: u32) {
    ns.run(&[
        "python3",
        "-c",
        &format!(
            "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range({count}):
    s.sendto(b'relay', ('{VM1_IP}', {UDP_PORT}))
    time.sleep(0.002)
"
        ),
    ]);
}

/// Node a relays what still arrives for the VM after it moved: frames
/// from a node that still points at a go on to b, once (the relay TTL
/// marks them), and a relayed frame is never relayed again.
#[test]
fn the_source_relays_to_the_target_after_cut_over() {
    let bed = three_nodes();
    // The client knows vm1's MAC for good (no ARP probes whose answers
    // would teach c the new place), and the target says nothing but its
    // GARP (no IPv6 chatter).
    bed.client.ns.run(&[
        "ip",
        "neigh",
        "replace",
        VM1_IP,
        "lladdr",
        VM1_MAC,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    bed.vm1t
        .ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1"]);
    start_migration(&bed);
    bed.vm1.ns.run(&["ip", "link", "set", "eth0", "down"]);
    bed.vm1t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    bed.vm1t.ns.scapy(&format!(
        "sendp(Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{VM1_MAC}', psrc='{VM1_IP}', pdst='{VM1_IP}'), iface='eth0')"
    ));
    // Every agent finishes what the data path did (a and c learned the move
    // from the GARP), so none rewrites the entries set by hand below.
    for node in [&bed.a, &bed.c] {
        wait_for(
            &format!("node {} finishes the cut-over", node.name),
            Duration::from_secs(10),
            || {
                node.agent_log()
                    .contains("the data path saw the VM on the target")
            },
        );
    }
    wait_for("a drops the source port", Duration::from_secs(10), || {
        port_flags(&bed.a, &bed.vm1.port).is_none()
    });
    // Point c back at a by hand, as a node that has not heard yet would.
    // (c's agent may put back its pending entry: also at a.)
    let key = common::EndpointKey {
        network: NET_ID,
        mac: [0x52, 0x54, 0, 0, 1, 1],
        _pad: [0; 2],
    };
    let at = |node_ip4| common::Endpoint {
        kind: common::ENDPOINT_REMOTE,
        ifindex: 0,
        node_ip4,
        migrate_to: [0; 4],
        port_id: 0,
    };
    bed.c
        .maps()
        .endpoints
        .insert(key, at([192, 0, 2, 1]), 0)
        .unwrap();
    // A listener on the target, so no port-unreachable goes back to c.
    let out = std::env::temp_dir().join(format!("vmpath-relay-{}", bed.a.tag));
    let rx = receiver(&bed.vm1t.ns, &out, 3);
    std::thread::sleep(Duration::from_millis(500));
    let sent_before = bed.a.maps().overlay_stats().unwrap().tx_packets;
    send_udp(&bed.client.ns, 20);
    let relayed = bed.a.maps().overlay_stats().unwrap().tx_packets - sent_before;
    assert!(relayed >= 20, "a sent {relayed} of 20 frames on");
    assert_eq!(
        vm1_endpoint(&bed.c).map(|e| e.node_ip4),
        Some([192, 0, 2, 1])
    );

    // Loop guard: with b wrongly pointing vm1 at c, a's relay arrives at b
    // marked (outer TTL) and b drops it instead of sending it round again.
    let before = bed.b.drops(common::drop_reason::OVERLAY_NOT_RELAYED);
    bed.b
        .maps()
        .endpoints
        .insert(key, at([192, 0, 2, 3]), 0)
        .unwrap();
    send_udp(&bed.client.ns, 20);
    let refused = bed.b.drops(common::drop_reason::OVERLAY_NOT_RELAYED) - before;
    assert!(
        refused >= 20,
        "b refused only {refused} of 20 relayed frames"
    );
    rx.wait_with_output().unwrap();
    let delivered = std::fs::read_to_string(&out)
        .unwrap_or_default()
        .lines()
        .count();
    let _ = std::fs::remove_file(&out);
    assert_eq!(
        delivered, 20,
        "the target got {delivered} of the relayed datagrams"
    );
}
