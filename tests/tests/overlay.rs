//! Two nodes, one Layer2 network: VMs on different nodes reach each other
//! over VXLAN (VNI = network id) built by the kernel's own vxlan driver,
//! networks stay apart across nodes, and a plain Linux VXLAN device (a
//! foreign VTEP) speaks the same wire format.

use std::time::Duration;

use vmpath_tests::{
    Netns, Node, Underlay, Vm, iperf3, vmpath::common, wait_for, yaml, yaml_overlay,
};

const BLUE: &str = "blue";
const RED: &str = "red";
const NODE_A_IP: &str = "192.0.2.1";
const NODE_B_IP: &str = "192.0.2.2";
const FOREIGN_IP: &str = "192.0.2.3";
/// Jumbo underlay: the VMs keep MTU 1500 and the 50 bytes of VXLAN fit.
const UNDERLAY_MTU: u32 = 9000;
const FOREIGN_MAC: &str = "52:54:00:00:09:01";

/// Nodes a and b on one underlay, each with its own agent and the same
/// config: vm1 (blue) on a; vm2 (blue) and vm3 (red, inside blue's subnet,
/// so only the network boundary keeps it apart) on b. The Node document of
/// `c` (the foreign VTEP) and an Attachment for its host are there too.
struct Bed {
    a: Node,
    b: Node,
    vm1: Vm,
    vm2: Vm,
    vm3: Vm,
    underlay: Underlay,
}

fn two_nodes() -> Bed {
    let underlay = Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    underlay.plug(&a.ns, "ul0", &format!("{NODE_A_IP}/24"), UNDERLAY_MTU);
    underlay.plug(&b.ns, "ul0", &format!("{NODE_B_IP}/24"), UNDERLAY_MTU);
    let vm1 = a.add_vm(
        "vm1",
        "52:54:00:00:01:01",
        &["10.20.0.11/16", "fd20::11/64"],
        Some("10.20.0.1"),
    );
    let vm2 = b.add_vm(
        "vm2",
        "52:54:00:00:02:01",
        &["10.20.0.12/16", "fd20::12/64"],
        Some("10.20.0.1"),
    );
    let vm3 = b.add_vm("vm3", "52:54:00:00:03:01", &["10.20.0.13/16"], None);
    let config = yaml::docs(&[
        yaml_overlay::node("a", NODE_A_IP),
        yaml_overlay::node("b", NODE_B_IP),
        yaml_overlay::node("c", FOREIGN_IP),
        yaml::network(
            BLUE,
            100,
            &["10.20.0.0/16", "fd20::/64"],
            &["10.20.0.1", "fd20::1"],
            true,
        ),
        yaml::network(RED, 200, &["10.20.0.0/16"], &["10.20.0.1"], false),
        yaml::attachment(
            "vm1",
            BLUE,
            "a",
            &vm1.port,
            &vm1.mac,
            &["10.20.0.11/16", "fd20::11/64"],
        ),
        yaml::attachment(
            "vm2",
            BLUE,
            "b",
            &vm2.port,
            &vm2.mac,
            &["10.20.0.12/16", "fd20::12/64"],
        ),
        yaml::attachment("vm3", RED, "b", &vm3.port, &vm3.mac, &[]),
        // The foreign VTEP's host: a Linux vxlan device on "node" c.
        yaml::attachment(
            "fhost",
            BLUE,
            "c",
            "vx",
            FOREIGN_MAC,
            &["10.20.0.50/16", "fd20::50/64"],
        ),
    ]);
    for node in [&a, &b] {
        node.write_config("config.yaml", &config);
    }
    a.start_agent();
    b.start_agent();
    a.wait_ports(&[&vm1.port]);
    b.wait_ports(&[&vm2.port, &vm3.port]);
    for node in [&a, &b] {
        wait_for(
            &format!("the overlay on node {}", node.name),
            Duration::from_secs(10),
            || node.agent_log().contains("overlay ready"),
        );
    }
    Bed {
        a,
        b,
        vm1,
        vm2,
        vm3,
        underlay,
    }
}

/// Runs tcpdump on `ns`'s `ifname` while `traffic` runs; returns its output.
fn capture(ns: &Netns, ifname: &str, filter: &str, traffic: impl FnOnce()) -> String {
    let mut args = vec![
        "timeout", "6", "tcpdump", "-nn", "-l", "-c", "6", "-i", ifname,
    ];
    args.extend(filter.split(' '));
    let child = ns.spawn(&args);
    std::thread::sleep(Duration::from_millis(700));
    traffic();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn vms_on_two_nodes_ping_v4_and_v6_over_vxlan() {
    let bed = two_nodes();
    assert!(bed.vm1.ping("10.20.0.12"), "vm1 (a) -> vm2 (b) IPv4");
    assert!(bed.vm2.ping("10.20.0.11"), "vm2 (b) -> vm1 (a) IPv4");
    assert!(bed.vm1.ping("fd20::12"), "vm1 (a) -> vm2 (b) IPv6");
    assert!(bed.vm2.ping("fd20::11"), "vm2 (b) -> vm1 (a) IPv6");
    // The anycast gateway still answers on each node.
    assert!(bed.vm1.ping("10.20.0.1"));
    assert!(bed.vm2.ping("fd20::1"));

    // On the wire: VXLAN to UDP 4789 between the node addresses, VNI = the
    // network id.
    let wire = capture(&bed.a.ns, "ul0", "udp port 4789", || {
        assert!(bed.vm1.ping("10.20.0.12"));
    });
    assert!(wire.contains("VXLAN"), "no VXLAN on the underlay: {wire}");
    assert!(wire.contains("vni 100"), "not VNI 100: {wire}");
    assert!(
        wire.contains(&format!("{NODE_A_IP}.")) && wire.contains(&format!("{NODE_B_IP}.4789")),
        "not between the node addresses: {wire}"
    );

    for node in [&bed.a, &bed.b] {
        let s = node.maps().overlay_stats().unwrap();
        assert!(
            s.tx_packets >= 3 && s.rx_packets >= 3,
            "node {}: {s:?}",
            node.name
        );
    }
    // ...and /metrics shows them (the agent's default address, in its netns).
    let metrics = bed.a.ns.run(&[
        "curl",
        "-sfS",
        "--max-time",
        "5",
        "http://127.0.0.1:9469/metrics",
    ]);
    let tx = metrics
        .lines()
        .find(|l| l.starts_with("vmpath_overlay_packets_total{direction=\"tx\"}"))
        .unwrap_or_else(|| panic!("no overlay tx counter:\n{metrics}"));
    let n: u64 = tx.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 3, "{tx}");
    // The device is what the agent promised: external, port 4789, no learning.
    let dev = bed
        .a
        .ns
        .run(&["ip", "-d", "link", "show", common::VXLAN_IFNAME]);
    assert!(
        dev.contains("external") && dev.contains("dstport 4789"),
        "{dev}"
    );
    assert!(dev.contains("nolearning"), "{dev}");
    assert!(dev.contains("mtu 8950"), "vxlan MTU = underlay - 50: {dev}");
}

#[test]
fn tcp_and_udp_cross_nodes_with_valid_checksums() {
    let bed = two_nodes();
    let tcp = iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", false, 3);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("no TCP summary: {tcp}"));
    eprintln!("cross-node TCP vm1 (a) -> vm2 (b): {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 100e6, "TCP over the overlay at {bps} bit/s");
    let tcp_back = iperf3(&bed.vm1.ns, &bed.vm2.ns, "10.20.0.11", false, 2);
    let bps = tcp_back["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    eprintln!("cross-node TCP vm2 (b) -> vm1 (a): {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 100e6, "TCP back over the overlay at {bps} bit/s");
    let tcp6 = iperf3(&bed.vm1.ns, &bed.vm2.ns, "fd20::11", false, 2);
    let bps6 = tcp6["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    eprintln!(
        "cross-node TCP/IPv6 vm2 (b) -> vm1 (a): {:.2} Gbit/s",
        bps6 / 1e9
    );
    assert!(
        bps6 > 100e6,
        "TCP over IPv6 over the overlay at {bps6} bit/s"
    );

    // A receiver that falls behind overflows its own socket buffer: that
    // is the app's loss, not the data path's, so it is counted apart.
    let rcvbuf_before = rcvbuf_errors(&bed.vm2.ns);
    let udp = iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", true, 2);
    let rcvbuf = rcvbuf_errors(&bed.vm2.ns) - rcvbuf_before;
    let sum = &udp["end"]["sum"];
    let packets = sum["packets"].as_f64().unwrap_or(0.0);
    let lost = sum["lost_packets"].as_f64().unwrap_or(f64::MAX);
    assert!(packets > 1000.0, "UDP sent {packets} datagrams: {udp}");
    let lost_in_path = lost - rcvbuf as f64;
    assert!(
        lost_in_path / packets < 0.01,
        "UDP lost {lost} of {packets} ({rcvbuf} in the receiver's socket buffer)"
    );
}

/// UdpRcvbufErrors of `ns`'s stack.
fn rcvbuf_errors(ns: &Netns) -> u64 {
    let out = ns.run(&["nstat", "-az", "UdpRcvbufErrors"]);
    out.lines()
        .find_map(|l| l.strip_prefix("UdpRcvbufErrors"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn networks_stay_apart_across_nodes() {
    let bed = two_nodes();
    assert!(
        !bed.vm1.ping("10.20.0.13"),
        "vm1 (blue, a) reached vm3 (red, b)"
    );
    assert!(
        !bed.vm3.ping("10.20.0.11"),
        "vm3 (red, b) reached vm1 (blue, a)"
    );
    // Not even vm1's broadcast ARP reached vm3, though it crossed to b.
    let neigh = bed.vm3.ns.run(&["ip", "neigh", "show", "10.20.0.11"]);
    assert!(!neigh.contains("lladdr"), "vm3 resolved vm1: {neigh}");
    // Only b hosts red: b has no other node to send red's floods to.
    assert!(bed.b.maps().flood_remote.get(&200, 0).is_err());
}

/// A Linux VXLAN device in a third namespace ("node" c, 192.0.2.3):
/// VNI 100, UDP 4789, static FDB entries toward the nodes.
fn foreign_vtep(bed: &Bed) -> Netns {
    let ns = Netns::new(format!("vt{}-fv", bed.a.tag));
    bed.underlay
        .plug(&ns, "ul0", &format!("{FOREIGN_IP}/24"), UNDERLAY_MTU);
    ns.run(&[
        "ip",
        "link",
        "add",
        "vx",
        "type",
        "vxlan",
        "id",
        "100",
        "dstport",
        "4789",
        "local",
        FOREIGN_IP,
        "nolearning",
    ]);
    ns.run(&["ip", "link", "set", "vx", "address", FOREIGN_MAC]);
    ns.run(&["ip", "addr", "add", "10.20.0.50/16", "dev", "vx"]);
    ns.run(&["ip", "addr", "add", "fd20::50/64", "dev", "vx", "nodad"]);
    ns.run(&["ip", "link", "set", "vx", "mtu", "1500", "up"]);
    // Broadcast and multicast to both nodes; vm1's MAC straight to a.
    for dst in [NODE_A_IP, NODE_B_IP] {
        ns.run(&[
            "bridge",
            "fdb",
            "append",
            "00:00:00:00:00:00",
            "dev",
            "vx",
            "dst",
            dst,
        ]);
    }
    ns.run(&[
        "bridge",
        "fdb",
        "add",
        "52:54:00:00:01:01",
        "dev",
        "vx",
        "dst",
        NODE_A_IP,
    ]);
    ns
}

#[test]
fn a_linux_vxlan_device_interoperates() {
    let bed = two_nodes();
    let fv = foreign_vtep(&bed);
    assert!(bed.vm1.ping("10.20.0.50"), "vm1 -> Linux VTEP host IPv4");
    assert!(fv.ping("10.20.0.11", 3), "Linux VTEP host -> vm1 IPv4");
    assert!(bed.vm2.ping("fd20::50"), "vm2 -> Linux VTEP host IPv6");
    let tcp = iperf3(&bed.vm1.ns, &fv, "10.20.0.11", false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    eprintln!("TCP Linux VTEP -> vm1: {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 100e6, "TCP from the Linux VTEP at {bps} bit/s");
    let tcp = iperf3(&fv, &bed.vm1.ns, "10.20.0.50", false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    eprintln!("TCP vm1 -> Linux VTEP: {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 100e6, "TCP to the Linux VTEP at {bps} bit/s");
}

#[test]
fn unknown_vni_and_unknown_vtep_are_dropped_and_counted() {
    let bed = two_nodes();
    let fv = foreign_vtep(&bed);
    // Resolve node a's underlay MAC once with a real ping.
    assert!(fv.ping(NODE_A_IP, 1));
    let before_vni = bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VNI);
    let before_vtep = bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP);
    // scapy builds the VXLAN frames by hand (flags = I only: scapy's default
    // on port 4789 is VXLAN-GPE, which Linux refuses): VNI 999 (no such network) from
    // the known VTEP, and VNI 100 from an address that is no node.
    fv.run(&["ip", "addr", "add", "192.0.2.99/24", "dev", "ul0"]);
    fv.scapy(&format!(
        "inner = Ether(src='{FOREIGN_MAC}', dst='52:54:00:00:01:01')/IP(src='10.20.0.50', dst='10.20.0.11')/ICMP()
for vni, src in ((999, '{FOREIGN_IP}'), (100, '192.0.2.99')):
    send(IP(src=src, dst='{NODE_A_IP}')/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni=vni)/inner, count=3)
"
    ));
    wait_for("overlay drops counted", Duration::from_secs(5), || {
        bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VNI) >= before_vni + 3
            && bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP) >= before_vtep + 3
    });
}
