//! One node, several VMs: the agent forwards real traffic between VM
//! namespaces, answers for the gateway, isolates networks and filters
//! spoofed sources.

use std::time::Duration;

use vmpath_tests::{Node, Vm, iperf3, vmpath::common, wait_for, yaml};

const BLUE: &str = "blue";
const RED: &str = "red";

/// vm1 and vm2 on `blue` (IPAM Enabled: IP filter on), vm3 on `red`
/// (IPAM Disabled) with an address inside blue's subnet, so only the
/// network boundary can keep it apart.
struct Bed {
    node: Node,
    vm1: Vm,
    vm2: Vm,
    vm3: Vm,
}

fn blue_and_red() -> Bed {
    let mut node = Node::new("a");
    let vm1 = node.add_vm(
        "vm1",
        "52:54:00:00:01:01",
        &["10.20.0.11/16", "fd20::11/64"],
        Some("10.20.0.1"),
    );
    let vm2 = node.add_vm(
        "vm2",
        "52:54:00:00:02:01",
        &["10.20.0.12/16", "fd20::12/64"],
        Some("10.20.0.1"),
    );
    let vm3 = node.add_vm("vm3", "52:54:00:00:03:01", &["10.20.0.13/16"], None);
    node.write_config(
        "config.yaml",
        &yaml::docs(&[
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
                "a",
                &vm2.port,
                &vm2.mac,
                &["10.20.0.12/16", "fd20::12/64"],
            ),
            yaml::attachment("vm3", RED, "a", &vm3.port, &vm3.mac, &[]),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port, &vm3.port]);
    Bed {
        node,
        vm1,
        vm2,
        vm3,
    }
}

#[test]
fn vms_ping_each_other_and_the_gateway_v4_and_v6() {
    let bed = blue_and_red();
    assert!(bed.vm1.ping("10.20.0.12"), "vm1 -> vm2 IPv4");
    assert!(bed.vm2.ping("10.20.0.11"), "vm2 -> vm1 IPv4");
    assert!(bed.vm1.ping("fd20::12"), "vm1 -> vm2 IPv6");
    assert!(bed.vm1.ping("10.20.0.1"), "vm1 -> gateway IPv4");
    assert!(bed.vm2.ping("fd20::1"), "vm2 -> gateway IPv6");

    // The gateway answers with the network's MAC (derived from id 100), the
    // same on every node, for ARP, ND and the link-local gateway address.
    let gw_mac = "0a:76:70:00:00:64";
    let neigh = bed.vm1.ns.run(&["ip", "neigh", "show", "dev", "eth0"]);
    assert!(
        neigh.contains(&format!("10.20.0.1 lladdr {gw_mac}")),
        "ARP for the gateway: {neigh}"
    );
    let neigh = bed
        .vm2
        .ns
        .run(&["ip", "-6", "neigh", "show", "dev", "eth0"]);
    assert!(
        neigh.contains(&format!("fd20::1 lladdr {gw_mac} router")),
        "ND for the gateway: {neigh}"
    );
    let ll = "fe80::876:70ff:fe00:64%eth0";
    assert!(bed.vm1.ping(ll), "vm1 -> gateway link-local");

    // The default route via the gateway resolves: the kernel sends there.
    let route = bed.vm1.ns.run(&["ip", "route", "get", "192.0.2.1"]);
    assert!(route.contains("via 10.20.0.1"), "{route}");

    let ifindex = bed.node.ns.ifindex(&bed.vm1.port);
    let stats = bed
        .node
        .maps()
        .port_stats(ifindex)
        .unwrap()
        .expect("vm1's port has counters");
    assert!(
        stats.gw_replies >= 3,
        "gateway replies not counted on vm1's port: {stats:?}"
    );
}

#[test]
fn tcp_and_udp_cross_at_full_offload_with_valid_checksums() {
    let bed = blue_and_red();
    // TCP: the receiver's stack verifies every segment; a broken checksum or
    // GSO segment shows up as a stalled or failed transfer.
    let tcp = iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", false, 2);
    let bytes = tcp["end"]["sum_received"]["bytes"]
        .as_f64()
        .unwrap_or_else(|| panic!("no TCP summary: {tcp}"));
    assert!(bytes > 10e6, "TCP moved only {bytes} bytes");
    let tcp6 = iperf3(&bed.vm1.ns, &bed.vm2.ns, "fd20::11", false, 1);
    let bytes6 = tcp6["end"]["sum_received"]["bytes"]
        .as_f64()
        .unwrap_or_else(|| panic!("no TCP summary: {tcp6}"));
    assert!(bytes6 > 10e6, "TCP over IPv6 moved only {bytes6} bytes");

    // UDP: datagrams with bad checksums would be dropped by the receiver,
    // which counts them (`Udp: InCsumErrors` of its namespace).
    let csum_errors_before = udp_in_csum_errors(&bed.vm2.ns);
    let udp = iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", true, 2);
    let sum = &udp["end"]["sum"];
    let packets = sum["packets"]
        .as_f64()
        .unwrap_or_else(|| panic!("no UDP summary: {udp}"));
    let lost = sum["lost_packets"]
        .as_f64()
        .unwrap_or_else(|| panic!("no UDP summary: {udp}"));
    // What arrived was checked by the receiver's stack and none failed. How
    // many are lost besides is the machine's load (an unpaced stream into a
    // starved receiver overflows its socket buffer), not the data path's.
    assert!(
        packets - lost > 1000.0,
        "UDP: {lost} of {packets} datagrams lost, too few to judge"
    );
    assert_eq!(
        udp_in_csum_errors(&bed.vm2.ns),
        csum_errors_before,
        "UDP datagrams with bad checksums reached the receiver"
    );

    // tcx keeps the VM side's offloads (XDP on a veth would switch TSO off).
    let offload = bed.vm1.ns.run(&["ethtool", "-k", "eth0"]);
    assert!(
        offload.contains("tcp-segmentation-offload: on"),
        "{offload}"
    );
}

#[test]
fn a_vm_on_another_network_cannot_reach_them() {
    let bed = blue_and_red();
    assert!(!bed.vm3.ping("10.20.0.11"), "vm3 (red) reached vm1 (blue)");
    assert!(!bed.vm1.ping("10.20.0.13"), "vm1 (blue) reached vm3 (red)");
    // Not even a broadcast crosses: vm1 never learns vm3's MAC.
    let neigh = bed.vm1.ns.run(&["ip", "neigh", "show", "10.20.0.13"]);
    assert!(!neigh.contains("lladdr"), "vm1 resolved vm3: {neigh}");
    // vm3's own gateway still answers it.
    assert!(bed.vm3.ping("10.20.0.1"));
}

#[test]
fn foreign_source_ip_is_dropped_with_ipam_and_forwarded_without() {
    let bed = blue_and_red();
    let node = &bed.node;
    // blue (IPAM Enabled): vm1 tries an address it was not given (after a
    // real ping, so vm2's MAC is cached and the spoofed IP packet is sent).
    assert!(bed.vm1.ping("10.20.0.12"));
    bed.vm1
        .ns
        .run(&["ip", "addr", "add", "10.20.0.99/16", "dev", "eth0"]);
    let before = node.drops(common::drop_reason::IP_SPOOF);
    assert!(
        !bed.vm1.ns.ping_from("10.20.0.99", "10.20.0.12", 2),
        "spoofed source reached vm2"
    );
    assert!(
        node.drops(common::drop_reason::IP_SPOOF) >= before + 2,
        "ip_spoof drops not counted"
    );

    // red (IPAM Disabled: filter off): any source the VM uses is forwarded.
    let mut node = bed.node;
    let vm4 = node.add_vm("vm4", "52:54:00:00:04:01", &["10.20.0.14/16"], None);
    let mut cfg = std::fs::read_to_string(node.config_dir.join("config.yaml")).unwrap();
    cfg.push_str("---\n");
    cfg.push_str(&yaml::attachment("vm4", RED, "a", &vm4.port, &vm4.mac, &[]));
    node.write_config("config.yaml", &cfg);
    node.wait_ports(&[&bed.vm1.port, &bed.vm2.port, &bed.vm3.port, &vm4.port]);
    bed.vm3
        .ns
        .run(&["ip", "addr", "add", "10.20.0.98/16", "dev", "eth0"]);
    let ok = bed.vm3.ns.run_status(&[
        "ping",
        "-c",
        "2",
        "-i",
        "0.2",
        "-W",
        "1",
        "-I",
        "10.20.0.98",
        "10.20.0.14",
    ]);
    assert!(
        ok.status.success(),
        "IPAM-less network dropped a VM's own address"
    );
}

#[test]
fn spoofed_arp_is_dropped() {
    let bed = blue_and_red();
    let node = &bed.node;
    assert!(bed.vm2.ping("10.20.0.11"));
    let before = node.drops(common::drop_reason::ARP_SPOOF);
    // vm1 claims vm2's address with a gratuitous ARP, and then with vm2's MAC
    // as sender hardware address.
    bed.vm1.ns.scapy(&format!(
        "sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=2, hwsrc='{m1}', psrc='10.20.0.12', hwdst='ff:ff:ff:ff:ff:ff', pdst='10.20.0.12'), iface='eth0', count=3)\n\
         sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{m2}', psrc='10.20.0.11', pdst='10.20.0.12'), iface='eth0', count=3)",
        m1 = bed.vm1.mac,
        m2 = bed.vm2.mac,
    ));
    wait_for("arp_spoof drops", Duration::from_secs(3), || {
        node.drops(common::drop_reason::ARP_SPOOF) >= before + 6
    });
    // vm2 still maps vm1's address to vm1, and nobody learned the lie.
    let neigh = bed.vm2.ns.run(&["ip", "neigh", "show", "10.20.0.11"]);
    assert!(neigh.contains(&bed.vm1.mac), "{neigh}");
    assert!(bed.vm1.ping("10.20.0.12"));
}

#[test]
fn invalid_documents_are_refused_alone_and_forwarding_continues() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:00:01:01", &["10.20.0.11/16"], None);
    let vm2 = node.add_vm("vm2", "52:54:00:00:02:01", &["10.20.0.12/16"], None);
    let dup_mac = node.add_vm("vm5", "52:54:00:00:01:01", &["10.20.0.15/16"], None);
    let dup_ip = node.add_vm("vm6", "52:54:00:00:06:01", &["10.20.0.12/16"], None);
    let good = yaml::docs(&[
        yaml::network(BLUE, 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
        yaml::attachment("vm1", BLUE, "a", &vm1.port, &vm1.mac, &["10.20.0.11/16"]),
        yaml::attachment("vm2", BLUE, "a", &vm2.port, &vm2.mac, &["10.20.0.12/16"]),
    ]);
    node.write_config("good.yaml", &good);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"));

    // Now the bad ones arrive while traffic flows.
    let bad = yaml::docs(&[
        yaml::network("badcidr", 300, &["10.40.0.0/33"], &[], true),
        yaml::network("gwout", 301, &["10.41.0.0/16"], &["10.99.0.1"], true),
        yaml::attachment("orphan", "nosuchnet", "a", "vpx", "52:54:00:00:07:01", &[]),
        yaml::attachment(
            "vm5",
            BLUE,
            "a",
            &dup_mac.port,
            &dup_mac.mac,
            &["10.20.0.15/16"],
        ),
        yaml::attachment(
            "vm6",
            BLUE,
            "a",
            &dup_ip.port,
            &dup_ip.mac,
            &["10.20.0.12/16"],
        ),
    ]);
    node.write_config("zz-bad.yaml", &bad);
    let file = node.config_dir.join("zz-bad.yaml").display().to_string();
    wait_for("five refusals in the log", Duration::from_secs(10), || {
        node.agent_log().matches("refused:").count() >= 5
    });
    let log = node.agent_log();
    for (doc, field) in [
        ("Network badcidr", "spec.subnets"),
        ("Network gwout", "spec.defaultGatewayIPs[0]"),
        ("Attachment prod/orphan-eth0", "spec.network"),
        ("Attachment prod/vm5-eth0", "spec.mac"),
        ("Attachment prod/vm6-eth0", "spec.ips"),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains("refused:") && l.contains(doc))
            .unwrap_or_else(|| panic!("no refusal for {doc} in log:\n{log}"));
        assert!(
            line.contains(&file),
            "refusal does not name the file: {line}"
        );
        assert!(
            line.contains(field),
            "refusal does not name field {field}: {line}"
        );
    }
    let dup = log
        .lines()
        .find(|l| l.contains("Attachment prod/vm5-eth0"))
        .unwrap();
    // The holder is named: by its Attachment, or (when the claims store
    // holds the MAC for it) by its VM interface.
    assert!(
        dup.contains("vm1-eth0") || dup.contains("prod/vm1/eth0"),
        "MAC conflict does not name the other attachment: {dup}"
    );

    // The running VMs are unaffected; the refused ones are not served.
    assert!(vm1.ping("10.20.0.12"));
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(
        !dup_ip.ping("10.20.0.11"),
        "refused attachment got forwarded"
    );
    let status = node.status().unwrap();
    assert_eq!(
        status["config_errors"].as_array().unwrap().len(),
        5,
        "{status}"
    );
}

#[test]
fn bpftool_shows_named_fields() {
    let bed = blue_and_red();
    let dump = |name: &str| bed.node.dump_map(name);
    let ports = dump("vmp_ports");
    for field in ["\"port_id\"", "\"network\"", "\"mac\"", "\"flags\""] {
        assert!(
            ports.contains(field),
            "vmp_ports dump lacks {field}: {ports}"
        );
    }
    assert!(ports.contains("\"network\": 200"), "{ports}");
    let nets = dump("vmp_networks");
    assert!(
        nets.contains("\"gw_mac\"") && nets.contains("\"gw_ip4\""),
        "{nets}"
    );
    let addrs = dump("vmp_addresses");
    assert!(
        addrs.contains("\"family\"") && addrs.contains("\"ifindex\""),
        "{addrs}"
    );
    let stats = dump("vmp_port_stats");
    assert!(stats.contains("\"rx_packets\""), "{stats}");
}

#[test]
fn agent_restart_with_empty_config_keeps_forwarding() {
    let mut bed = blue_and_red();
    assert!(bed.vm1.ping("10.20.0.12"));
    bed.node.kill_agent();
    // Data path keeps running without the agent.
    assert!(
        bed.vm1.ping("10.20.0.12"),
        "forwarding stopped when the agent died"
    );
    // A config dir that is empty at start (ConfigMap not mounted yet) never
    // wipes the data path.
    let saved = std::fs::read_to_string(bed.node.config_dir.join("config.yaml")).unwrap();
    bed.node.remove_config("config.yaml");
    bed.node.start_agent();
    // The agent says so after loading the data path, which takes tens of
    // seconds on a loaded 2-core machine (the bound other starts use).
    bed.node
        .wait_log("config dir missing or empty", Duration::from_secs(120));
    assert!(
        bed.vm1.ping("10.20.0.12"),
        "empty config wiped the data path"
    );
    bed.node.write_config("config.yaml", &saved);
    bed.node
        .wait_ports(&[&bed.vm1.port, &bed.vm2.port, &bed.vm3.port]);
    assert!(bed.vm2.ping("10.20.0.11"));
}

/// The namespace's count of UDP datagrams its stack dropped for a bad
/// checksum (`/proc/net/snmp`, read from inside the namespace).
fn udp_in_csum_errors(ns: &vmpath_tests::Netns) -> u64 {
    let snmp = ns.run(&["cat", "/proc/net/snmp"]);
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp: "));
    let (names, values) = (udp.next(), udp.next());
    let (Some(names), Some(values)) = (names, values) else {
        panic!("no Udp lines in /proc/net/snmp:\n{snmp}");
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "InCsumErrors")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no InCsumErrors in /proc/net/snmp:\n{snmp}"))
}
