//! Two nodes, one Layer2 network: VMs on different nodes reach each other
//! over VXLAN (VNI = network id) built by the kernel's own vxlan driver,
//! networks stay apart across nodes, and a plain Linux VXLAN device (a
//! foreign VTEP) speaks the same wire format. The key tests run over an
//! IPv4 and over an IPv6 underlay (`UnderlayFamily`).

use std::time::Duration;

use vmpath_tests::{
    Netns, Node, Underlay, UnderlayFamily, Vm, iperf3, qemu::Guest as _, vmpath::common, wait_for,
    yaml, yaml_overlay,
};

const BLUE: &str = "blue";
const RED: &str = "red";
const NODE_A_IP: &str = "192.0.2.1";
const NODE_B_IP: &str = "192.0.2.2";
const FOREIGN_IP: &str = "192.0.2.3";
/// Jumbo underlay: the VMs keep MTU 1500 and the 50 (70 over IPv6) bytes
/// of VXLAN fit.
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
    family: UnderlayFamily,
    /// The underlay addresses of a, b and the foreign VTEP c.
    a_ip: String,
    b_ip: String,
    c_ip: String,
}

fn two_nodes() -> Bed {
    two_nodes_over(UnderlayFamily::V4)
}

fn two_nodes_over(family: UnderlayFamily) -> Bed {
    let (a_ip, b_ip, c_ip) = (family.node_ip(1), family.node_ip(2), family.node_ip(3));
    let underlay = Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    underlay.plug(&a.ns, "ul0", &family.node_cidr(1), UNDERLAY_MTU);
    underlay.plug(&b.ns, "ul0", &family.node_cidr(2), UNDERLAY_MTU);
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
        yaml_overlay::node("a", &a_ip),
        yaml_overlay::node("b", &b_ip),
        yaml_overlay::node("c", &c_ip),
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
        node.wait_log("overlay ready", Duration::from_secs(10));
    }
    Bed {
        a,
        b,
        vm1,
        vm2,
        vm3,
        underlay,
        family,
        a_ip,
        b_ip,
        c_ip,
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
    vms_ping_v4_and_v6_over(UnderlayFamily::V4);
}

/// The same over an IPv6 underlay: VXLAN in IPv6 between the node
/// addresses, no IPv4 on the underlay at all.
#[test]
fn vms_on_two_nodes_ping_v4_and_v6_over_an_ipv6_underlay() {
    vms_ping_v4_and_v6_over(UnderlayFamily::V6);
}

fn vms_ping_v4_and_v6_over(family: UnderlayFamily) {
    let bed = two_nodes_over(family);
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
        wire.contains(&format!("{}.", bed.a_ip)) && wire.contains(&format!("{}.4789", bed.b_ip)),
        "not between the node addresses: {wire}"
    );
    if family == UnderlayFamily::V6 {
        // IPv6 with the outer UDP checksum (RFC 8200), as Linux sends it.
        // Computed in software (no offload to the veth), so the capture
        // shows the checksum the wire would carry.
        for node in [&bed.a, &bed.b] {
            node.ns.run(&["ethtool", "-K", "ul0", "tx", "off"]);
        }
        let wire = capture(&bed.a.ns, "ul0", "-vv udp port 4789", || {
            assert!(bed.vm1.ping("fd20::12"));
        });
        assert!(
            wire.contains("[udp sum ok]") && !wire.contains("bad udp cksum"),
            "outer UDP checksum over IPv6: {wire}"
        );
    }

    for node in [&bed.a, &bed.b] {
        let s = node.maps().overlay_stats().unwrap();
        assert!(
            s.tx_packets >= 3 && s.rx_packets >= 3,
            "node {}: {s:?}",
            node.name
        );
    }
    // ...and /metrics shows them (the agent's default address, in its netns).
    let n = metric(&bed.a.ns, "vmpath_overlay_packets_total{direction=\"tx\"}");
    assert!(n >= 3, "overlay tx packets: {n}");
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
    let mtu = UNDERLAY_MTU - family.vxlan_overhead();
    assert!(
        dev.contains(&format!("mtu {mtu} ")),
        "vxlan MTU = underlay - {}: {dev}",
        family.vxlan_overhead()
    );
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
    let rcvbuf_before = bed.vm2.ns.udp_rcvbuf_errors();
    let udp = iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", true, 2);
    let rcvbuf = bed.vm2.ns.udp_rcvbuf_errors() - rcvbuf_before;
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

/// A Linux VXLAN device in a third namespace ("node" c, 192.0.2.3 or
/// fd00:192::3): VNI 100, UDP 4789, static FDB entries toward the nodes.
fn foreign_vtep(bed: &Bed) -> Netns {
    let ns = Netns::new(format!("vt{}-fv", bed.a.tag));
    bed.underlay
        .plug(&ns, "ul0", &bed.family.node_cidr(3), UNDERLAY_MTU);
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
        &bed.c_ip,
        "nolearning",
    ]);
    ns.run(&["ip", "link", "set", "vx", "address", FOREIGN_MAC]);
    ns.run(&["ip", "addr", "add", "10.20.0.50/16", "dev", "vx"]);
    ns.run(&["ip", "addr", "add", "fd20::50/64", "dev", "vx", "nodad"]);
    ns.run(&["ip", "link", "set", "vx", "mtu", "1500", "up"]);
    // Broadcast and multicast to both nodes; vm1's MAC straight to a.
    for dst in [&bed.a_ip, &bed.b_ip] {
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
        &bed.a_ip,
    ]);
    ns
}

#[test]
fn a_linux_vxlan_device_interoperates() {
    linux_vxlan_interoperates_over(UnderlayFamily::V4);
}

#[test]
fn a_linux_vxlan_device_interoperates_over_an_ipv6_underlay() {
    linux_vxlan_interoperates_over(UnderlayFamily::V6);
}

fn linux_vxlan_interoperates_over(family: UnderlayFamily) {
    let bed = two_nodes_over(family);
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
    unknown_vni_and_vtep_dropped_over(UnderlayFamily::V4);
}

/// The tenant's attack over an IPv6 underlay: frames for blue's VM from
/// an IPv6 address that is no node (a host on the underlay that learned
/// the VNI) are dropped and counted, and the VM never sees them.
#[test]
fn unknown_vni_and_unknown_vtep_are_dropped_and_counted_over_an_ipv6_underlay() {
    unknown_vni_and_vtep_dropped_over(UnderlayFamily::V6);
}

fn unknown_vni_and_vtep_dropped_over(family: UnderlayFamily) {
    let bed = two_nodes_over(family);
    let fv = foreign_vtep(&bed);
    // Resolve node a's underlay MAC once with a real ping.
    assert!(fv.ping(&bed.a_ip, 1));
    let before_vni = bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VNI);
    let before_vtep = bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP);
    // scapy builds the VXLAN frames by hand (flags = I only: scapy's default
    // on port 4789 is VXLAN-GPE, which Linux refuses): VNI 999 (no such network) from
    // the known VTEP, and VNI 100 from an address that is no node.
    let rogue = family.node_ip(99);
    let rogue_cidr = family.node_cidr(99);
    let mut add = vec!["ip", "addr", "add", &rogue_cidr, "dev", "ul0"];
    if family == UnderlayFamily::V6 {
        add.push("nodad");
    }
    fv.run(&add);
    let outer = |src: &str| family.scapy_ip(src, &bed.a_ip);
    // What reaches vm1 meanwhile (an AF_PACKET capture sees the frames the
    // data path delivers with bpf_redirect_peer).
    let seen = capture(&bed.vm1.ns, "eth0", "icmp and src host 10.20.0.50", || {
        fv.scapy(&format!(
            "inner = Ether(src='{FOREIGN_MAC}', dst='52:54:00:00:01:01')/IP(src='10.20.0.50', dst='10.20.0.11')/ICMP()
send({}/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni=999)/inner, count=3)
send({}/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni=100)/inner, count=3)
",
            outer(&bed.c_ip),
            outer(&rogue),
        ));
    });
    wait_for("overlay drops counted", Duration::from_secs(5), || {
        bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VNI) >= before_vni + 3
            && bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP) >= before_vtep + 3
    });
    assert!(
        !seen.contains("ICMP echo request"),
        "a refused frame reached vm1: {seen}"
    );
    if family == UnderlayFamily::V6 {
        // VXLAN of the other family: node a's vxlan device takes IPv4 too
        // (a collect-metadata device opens both sockets), but no node of
        // an IPv6 underlay sends it. Even from an IPv4 address that would
        // be a node's on an IPv4 underlay, it names no node here.
        bed.a
            .ns
            .run(&["ip", "addr", "add", "192.0.2.1/24", "dev", "ul0"]);
        fv.run(&["ip", "addr", "add", "192.0.2.3/24", "dev", "ul0"]);
        assert!(fv.ping("192.0.2.1", 1));
        let before = bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP);
        fv.scapy(&format!(
            "inner = Ether(src='{FOREIGN_MAC}', dst='52:54:00:00:01:01')/IP(src='10.20.0.50', dst='10.20.0.11')/ICMP()
send(IP(src='192.0.2.3', dst='192.0.2.1')/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni=100)/inner, count=3)
"
        ));
        wait_for(
            "IPv4 VXLAN to an IPv6-underlay node counted",
            Duration::from_secs(5),
            || bed.a.drops(common::drop_reason::OVERLAY_UNKNOWN_VTEP) >= before + 3,
        );
    }
}

/// A VM on another node is no more trusted than a local one: frames from
/// the foreign VTEP's host (a known node of blue) arriving at node a over
/// VXLAN with a forged NA for vm2's address, an NA naming another MAC, a
/// router advertisement and a VLAN-tagged NA are dropped by type and never
/// change vm1's
/// neighbour table; the host announcing its own address does.
#[test]
fn forged_neighbour_discovery_over_the_overlay_is_dropped() {
    let bed = two_nodes();
    let fv = foreign_vtep(&bed);
    assert!(fv.ping(&bed.a_ip, 1));
    assert!(
        bed.vm1.ns.ping("fd20::12", 2),
        "vm1 -> vm2 IPv6 over the overlay"
    );
    let m2 = bed.vm2.mac.clone();
    assert_eq!(bed.vm1.neighbour("fd20::12").unwrap_or_default(), m2);
    let stale = "52:54:00:00:99:99";
    bed.vm1.ns.run(&[
        "ip", "-6", "neigh", "replace", "fd20::50", "lladdr", stale, "dev", "eth0", "nud", "stale",
    ]);
    let drops = |r| bed.a.drops(r);
    let before = [
        drops(common::drop_reason::ND_SPOOF_TARGET),
        drops(common::drop_reason::ND_SPOOF_LLADDR),
        drops(common::drop_reason::ND_SPOOF),
        drops(common::drop_reason::ETHERTYPE),
    ];
    let send = |inner: &str| {
        fv.scapy(&format!(
            "inner = {inner}
send(IP(src='{FOREIGN_IP}', dst='{NODE_A_IP}')/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni=100)/inner, count=2)
"
        ))
    };
    let all_nodes = format!(
        "Ether(src='{FOREIGN_MAC}', dst='33:33:00:00:00:01')/IPv6(src='fd20::50', dst='ff02::1', hlim=255)"
    );
    send(&format!(
        "{all_nodes}/ICMPv6ND_NA(tgt='fd20::12', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{FOREIGN_MAC}')"
    ));
    send(&format!(
        "{all_nodes}/ICMPv6ND_NA(tgt='fd20::50', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{m2}')"
    ));
    send(&format!(
        "{all_nodes}/ICMPv6ND_RA()/ICMPv6NDOptPrefixInfo(prefix='fd66::', prefixlen=64)"
    ));
    // The forged NA again, behind a VLAN tag.
    send(&format!(
        "Ether(src='{FOREIGN_MAC}', dst='33:33:00:00:00:01')/Dot1Q(vlan=10)/IPv6(src='fd20::50', dst='ff02::1', hlim=255)/ICMPv6ND_NA(tgt='fd20::12', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{FOREIGN_MAC}')"
    ));
    let reasons = [
        common::drop_reason::ND_SPOOF_TARGET,
        common::drop_reason::ND_SPOOF_LLADDR,
        common::drop_reason::ND_SPOOF,
        common::drop_reason::ETHERTYPE,
    ];
    let counted = || -> Vec<u64> {
        reasons
            .iter()
            .zip(before)
            .map(|(&r, b)| drops(r) - b)
            .collect()
    };
    let want = vec![2, 2, 2, 2];
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while counted() != want && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        counted(),
        want,
        "drops on a (nd_spoof_target, nd_spoof_lladdr, nd_spoof, ethertype)"
    );
    assert_eq!(
        bed.vm1.neighbour("fd20::50").unwrap_or_default(),
        stale,
        "a forged NA got through"
    );
    // The control: the host announces its own address with its own MAC.
    send(&format!(
        "{all_nodes}/ICMPv6ND_NA(tgt='fd20::50', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{FOREIGN_MAC}')"
    ));
    wait_for(
        "vm1 takes the host's own announcement",
        Duration::from_secs(5),
        || bed.vm1.neighbour("fd20::50").unwrap_or_default() == FOREIGN_MAC,
    );
    assert_eq!(
        bed.vm1.neighbour("fd20::12").unwrap_or_default(),
        m2,
        "vm1's entry for vm2 moved"
    );
    let routes = bed.vm1.ns.run(&["ip", "-6", "route"]);
    assert!(
        !routes.contains("fd66::"),
        "the rogue RA's prefix arrived: {routes}"
    );
    assert!(bed.vm1.ns.ping("fd20::12", 2), "vm1 -> vm2 IPv6 after");
}

// ---------------------------------------------------------------------------
// VXLAN source learning: a MAC detected on its node, learned by the others
// ---------------------------------------------------------------------------

const NODE_C_IP: &str = "192.0.2.3";
const VMA_MAC: &str = "52:54:00:00:0a:01";
const VMA2_MAC: &str = "52:54:00:00:0a:02";
const VMB_MAC: &str = "52:54:00:00:0b:01";
const VMC_MAC: &str = "52:54:00:00:0c:01";
const VMA_IP: &str = "10.20.0.11";
const VMB_IP: &str = "10.20.0.12";
const VMC_IP: &str = "10.20.0.13";
const VMA2_IP: &str = "10.20.0.14";
/// A MAC no VM has: unicast to it is unknown everywhere.
const NOBODY_MAC: &str = "52:54:00:00:0f:0f";
const NET_ID: u32 = 100;

/// Three vmpath nodes on one underlay, network blue on all of them: vma
/// and vma2 on a, vmb on b, vmc on c. vmb's Attachment gives no MAC (b
/// detects it from vmb's traffic), so only b's config knows it; the
/// others' MACs are given.
struct LearnBed {
    a: Node,
    b: Node,
    c: Node,
    vma: Vm,
    vma2: Vm,
    vmb: Vm,
    vmc: Vm,
    _underlay: Underlay,
}

fn learn_config(bed: &LearnBed, vmb_mac_given: bool) -> String {
    let att = |name: &str, node: &str, vm: &Vm, ip: &str| {
        yaml::attachment(name, BLUE, node, &vm.port, &vm.mac, &[&format!("{ip}/16")])
    };
    let mut vmb = att("vmb", "b", &bed.vmb, VMB_IP);
    if !vmb_mac_given {
        vmb = vmb.replace(&format!("  mac: \"{VMB_MAC}\"\n"), "");
        assert!(!vmb.contains("mac:"), "{vmb}");
    }
    yaml::docs(&[
        yaml_overlay::node("a", NODE_A_IP),
        yaml_overlay::node("b", NODE_B_IP),
        yaml_overlay::node("c", NODE_C_IP),
        yaml::network(BLUE, NET_ID, &["10.20.0.0/16"], &["10.20.0.1"], true),
        att("vma", "a", &bed.vma, VMA_IP),
        att("vma2", "a", &bed.vma2, VMA2_IP),
        vmb,
        att("vmc", "c", &bed.vmc, VMC_IP),
    ])
}

fn three_nodes_one_detected() -> LearnBed {
    let underlay = Underlay::new();
    let a = Node::new("a");
    let b = Node::new("b");
    let c = Node::new("c");
    for (node, ip) in [(&a, NODE_A_IP), (&b, NODE_B_IP), (&c, NODE_C_IP)] {
        underlay.plug(&node.ns, "ul0", &format!("{ip}/24"), UNDERLAY_MTU);
    }
    let vm = |node: &Node, name: &str, mac: &str, ip: &str| {
        node.add_vm(name, mac, &[&format!("{ip}/16")], Some("10.20.0.1"))
    };
    let mut bed = LearnBed {
        vma: vm(&a, "vma", VMA_MAC, VMA_IP),
        vma2: vm(&a, "vma2", VMA2_MAC, VMA2_IP),
        vmb: vm(&b, "vmb", VMB_MAC, VMB_IP),
        vmc: vm(&c, "vmc", VMC_MAC, VMC_IP),
        a,
        b,
        c,
        _underlay: underlay,
    };
    let config = learn_config(&bed, false);
    for node in [&mut bed.a, &mut bed.b, &mut bed.c] {
        node.write_config("config.yaml", &config);
        node.start_agent();
    }
    bed.a.wait_ports(&[&bed.vma.port, &bed.vma2.port]);
    bed.b.wait_ports(&[&bed.vmb.port]);
    bed.c.wait_ports(&[&bed.vmc.port]);
    for node in [&bed.a, &bed.b, &bed.c] {
        node.wait_log("overlay ready", Duration::from_secs(10));
    }
    bed
}

fn mac_bytes(mac: &str) -> [u8; 6] {
    let v: Vec<u8> = mac
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).unwrap())
        .collect();
    v.try_into().unwrap()
}

fn ip4_bytes(ip: &str) -> [u8; 4] {
    ip.parse::<std::net::Ipv4Addr>().unwrap().octets()
}

fn ep_key(mac: &str) -> common::EndpointKey {
    common::EndpointKey {
        network: NET_ID,
        mac: mac_bytes(mac),
        _pad: [0; 2],
    }
}

/// The node `node` learned `mac` behind, if any.
fn learned(node: &Node, mac: &str) -> Option<[u8; 4]> {
    node.maps()
        .remote_learned
        .get(&ep_key(mac), 0)
        .ok()
        .map(|l| l.node_ip4)
}

/// Frames received over the overlay by `node` so far.
fn overlay_rx(node: &Node) -> u64 {
    node.maps().overlay_stats().unwrap().rx_packets
}

fn overlay_tx(node: &Node) -> u64 {
    node.maps().overlay_stats().unwrap().tx_packets
}

/// Frames the data path delivered to `vm`'s port on `node`.
fn port_tx(node: &Node, vm: &Vm) -> u64 {
    let ifindex = node.ns.ifindex(&vm.port);
    node.maps()
        .port_stats(ifindex)
        .unwrap()
        .map_or(0, |s| s.tx_packets)
}

/// `count` UDP datagrams from `vm` (its own MAC and `src_ip`) to `dst_mac`
/// / `dst_ip`, port 9 (discard): one-way unicast, sent by scapy so no ARP
/// or reply is involved.
fn unicast_stream(vm: &Vm, src_ip: &str, dst_mac: &str, dst_ip: &str, count: u32) {
    vm.ns.scapy(&format!(
        "sendp(Ether(src='{}', dst='{dst_mac}')/IP(src='{src_ip}', dst='{dst_ip}')/UDP(sport=40009, dport=9)/Raw(b'x' * 64), iface='eth0', count={count})",
        vm.mac
    ));
}

/// From `from`'s underlay address, a VXLAN frame (VNI 100) to node `to`
/// whose inner source is `inner_src`: an RARP broadcast, as QEMU announces
/// a VM that moved.
fn inject_rarp(from: &Node, from_ip: &str, to_ip: &str, inner_src: &str, count: u32) {
    // Resolve the target's underlay MAC once with a real ping.
    assert!(from.ns.ping(to_ip, 1));
    from.ns.scapy(&format!(
        "inner = Ether(src='{inner_src}', dst='ff:ff:ff:ff:ff:ff', type=0x8035)/ARP(op=3, hwsrc='{inner_src}', hwdst='{inner_src}', psrc='0.0.0.0', pdst='0.0.0.0')
send(IP(src='{from_ip}', dst='{to_ip}')/UDP(sport=40000, dport=4789)/VXLAN(flags=8, vni={NET_ID})/inner, count={count})
"
    ));
}

/// The point of source learning: vmb's MAC is not in anyone's config but
/// b's, yet once vmb has spoken, unicast from a to vmb goes to b only
/// instead of being flooded to every node of the network (here: c).
#[test]
fn a_detected_mac_is_learned_and_its_unicast_goes_to_its_node_only() {
    let bed = three_nodes_one_detected();
    const N: u32 = 500;
    let (b_ip, c_ip) = (ip4_bytes(NODE_B_IP), ip4_bytes(NODE_C_IP));

    // Control: unicast to a MAC nobody has is flooded, and c receives every
    // copy (so counting at c does see floods).
    let c_before = overlay_rx(&bed.c);
    unicast_stream(&bed.vma, VMA_IP, NOBODY_MAC, "10.20.0.99", N);
    let flooded = overlay_rx(&bed.c) - c_before;
    assert!(
        flooded >= u64::from(N),
        "unknown unicast reached c {flooded} times, want at least {N}"
    );
    assert_eq!(learned(&bed.a, NOBODY_MAC), None);

    // vmb speaks: its ping reaches a, and a broadcast of its (an ARP for
    // an address nobody has) reaches every node: a and c learn that it
    // lives behind b. (Its ARP for vma does not leave b: vm_neigh answers
    // for a known endpoint at the port. c learned vmb only when vmb's
    // stack happened to send a multicast after c's agent was up: a flake
    // under load.)
    assert!(bed.vmb.ping(VMA_IP), "vmb (b, detected MAC) -> vma (a)");
    bed.vmb.ns.scapy(&format!(
        "sendp(Ether(src='{VMB_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{VMB_MAC}', psrc='{VMB_IP}', pdst='10.20.0.99'), iface='eth0')"
    ));
    wait_for("a learns vmb behind b", Duration::from_secs(5), || {
        learned(&bed.a, VMB_MAC) == Some(b_ip)
    });
    wait_for("c learns vmb behind b", Duration::from_secs(5), || {
        learned(&bed.c, VMB_MAC) == Some(b_ip)
    });
    // Configured MACs are never learned: config wins.
    assert_eq!(learned(&bed.b, VMA_MAC), None, "b learned vma's given MAC");
    assert_eq!(learned(&bed.a, VMC_MAC), None, "a learned vmc's given MAC");
    // And b, whose own VM it is, has it as a local endpoint, not learned.
    assert_eq!(learned(&bed.b, VMB_MAC), None);

    // Unicast a -> vmb now goes to b only: c sees (next to) nothing of it.
    let (c_before, vmb_before) = (overlay_rx(&bed.c), port_tx(&bed.b, &bed.vmb));
    let vma2_before = port_tx(&bed.a, &bed.vma2);
    unicast_stream(&bed.vma, VMA_IP, VMB_MAC, VMB_IP, N);
    let at_c = overlay_rx(&bed.c) - c_before;
    let at_vmb = port_tx(&bed.b, &bed.vmb) - vmb_before;
    // Nor is it flooded to a's other local port.
    let at_vma2 = port_tx(&bed.a, &bed.vma2) - vma2_before;
    assert!(
        at_vma2 <= 10,
        "vma2 (a) received {at_vma2} frames during {N} unicast frames a -> vmb"
    );
    eprintln!(
        "{N} unicast frames a -> vmb: {at_vmb} delivered, {at_c} reached c (control: {flooded})"
    );
    assert!(
        at_vmb >= u64::from(N),
        "vmb got {at_vmb} of {N} unicast frames"
    );
    assert!(
        at_c <= 10,
        "c received {at_c} frames during {N} unicast frames a -> vmb (flooded?)"
    );
    // Real traffic too: a UDP stream over iperf3, and ping.
    assert!(bed.vma.ping(VMB_IP), "vma (a) -> vmb (b)");
    let c_before = overlay_rx(&bed.c);
    let udp = iperf3(&bed.vmb.ns, &bed.vma.ns, VMB_IP, true, 1);
    let packets = udp["end"]["sum"]["packets"].as_u64().unwrap_or(0);
    let at_c = overlay_rx(&bed.c) - c_before;
    eprintln!("iperf3 UDP a -> vmb: {packets} datagrams, {at_c} frames reached c");
    assert!(packets > 1000, "UDP sent {packets} datagrams: {udp}");
    assert!(
        at_c * 100 < packets,
        "c received {at_c} frames during {packets} UDP datagrams a -> vmb"
    );

    // bpftool shows the entry with its fields by name (BTF).
    let pin = bed
        .a
        .bpffs
        .join(format!("maps/v{}", common::MAP_LAYOUT_VERSION))
        .join(common::map_names::REMOTE_LEARNED);
    let dump = vmpath_tests::run(&["bpftool", "map", "dump", "pinned", pin.to_str().unwrap()]);
    assert!(
        dump.contains("node_ip4") && dump.contains("last_seen_ns"),
        "{dump}"
    );
    // ...and /metrics counts it.
    let n = metric(&bed.a.ns, "vmpath_overlay_learned_macs ");
    assert!(n >= 1, "learned MACs: {n}");

    // vmb shows up behind another node (its RARP from c, as after a move):
    // a moves the entry there, and vmb's next frame from b moves it back.
    // Sent again should a frame vmb sends from b meanwhile (a neighbour
    // probe after the traffic above) move the entry back before it is read.
    let moved = (0..5).any(|_| {
        inject_rarp(&bed.c, NODE_C_IP, NODE_A_IP, VMB_MAC, 1);
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(2) {
            if learned(&bed.a, VMB_MAC) == Some(c_ip) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    });
    assert!(moved, "a never moved vmb to c on its RARP from c");
    assert!(bed.vmb.ping(VMA_IP));
    wait_for("a moves vmb back to b", Duration::from_secs(5), || {
        learned(&bed.a, VMB_MAC) == Some(b_ip)
    });

    // Once the config gives vmb's MAC, the configured endpoint replaces the
    // learned entry on the other nodes.
    let config = learn_config(&bed, true);
    for node in [&bed.a, &bed.b, &bed.c] {
        node.write_config("config.yaml", &config);
    }
    for node in [&bed.a, &bed.c] {
        wait_for(
            &format!("node {} replaces the learned vmb", node.name),
            Duration::from_secs(10),
            || {
                learned(node, VMB_MAC).is_none()
                    && node
                        .maps()
                        .endpoints
                        .get(&ep_key(VMB_MAC), 0)
                        .is_ok_and(|e| e.kind == common::ENDPOINT_REMOTE && e.node_ip4 == b_ip)
            },
        );
    }
    assert!(bed.vma.ping(VMB_IP));
}

/// Learning never lets a remote frame take a MAC the node already places:
/// a local VM's (its traffic stays local) or a configured remote VM's.
#[test]
fn a_remote_frame_never_takes_a_local_or_configured_mac() {
    let bed = three_nodes_one_detected();
    // A node of the network claims vma's MAC (local on a) and vmc's (given
    // in the config, on c) in frames to a.
    inject_rarp(&bed.b, NODE_B_IP, NODE_A_IP, VMA_MAC, 3);
    inject_rarp(&bed.b, NODE_B_IP, NODE_A_IP, VMC_MAC, 3);
    // ...and a MAC nobody places, which a does learn (so the frames arrived).
    inject_rarp(&bed.b, NODE_B_IP, NODE_A_IP, NOBODY_MAC, 3);
    wait_for("a learns the unplaced MAC", Duration::from_secs(5), || {
        learned(&bed.a, NOBODY_MAC) == Some(ip4_bytes(NODE_B_IP))
    });
    assert_eq!(
        learned(&bed.a, VMA_MAC),
        None,
        "a learned its local VM's MAC"
    );
    assert_eq!(learned(&bed.a, VMC_MAC), None, "a learned a configured MAC");
    let vmc = bed.a.maps().endpoints.get(&ep_key(VMC_MAC), 0).unwrap();
    assert_eq!(
        (vmc.kind, vmc.node_ip4),
        (common::ENDPOINT_REMOTE, ip4_bytes(NODE_C_IP)),
        "vmc's configured endpoint moved"
    );

    // vma2 -> vma stays on node a: delivered to vma, nothing to the overlay.
    assert!(bed.vma2.ping(VMA_IP));
    let (tx_before, vma_before) = (overlay_tx(&bed.a), port_tx(&bed.a, &bed.vma));
    unicast_stream(&bed.vma2, VMA2_IP, VMA_MAC, VMA_IP, 200);
    assert!(port_tx(&bed.a, &bed.vma) - vma_before >= 200);
    let sent = overlay_tx(&bed.a) - tx_before;
    assert!(
        sent <= 5,
        "a sent {sent} frames over the overlay for its local vma"
    );
    // vma -> vmc still goes to c.
    assert!(bed.vma.ping(VMC_IP), "vma (a) -> vmc (c)");
}

/// The value of the first sample whose line starts with `series` on the
/// agent's /metrics (its default address, in the node's namespace `ns`).
fn metric(ns: &Netns, series: &str) -> u64 {
    let metrics = ns.run(&[
        "curl",
        "-sfS",
        "--max-time",
        "5",
        "http://127.0.0.1:9469/metrics",
    ]);
    let line = metrics
        .lines()
        .find(|l| l.starts_with(series))
        .unwrap_or_else(|| panic!("no {series}:\n{metrics}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}
