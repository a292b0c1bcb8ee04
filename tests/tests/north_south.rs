//! North-south: a node with an uplink to a top-of-rack router (its own
//! namespace, running BIRD), an "external" host behind the ToR, and VMs on
//! a Routed network (un-NATed both ways, per-VM /32 over BGP) and on a SNAT
//! network (translated to the node's address).
//!
//! Addresses (all inside namespaces made here):
//!   node uplink 192.0.2.1/30 <-> ToR 192.0.2.2/30
//!   ToR 198.51.100.1/24 <-> external host 198.51.100.10/24
//!   routed network 10.20.0.0/16 (gateway 10.20.0.1), SNAT 10.30.0.0/16.
//!
//! Needs root. Run with:
//!   cargo build -p vmpath && VMPATH_BIN=$PWD/target/debug/vmpath \
//!     cargo nextest run -p vmpath-tests -E 'test(/^north_south::/)'

use std::time::Duration;

use vmpath_tests::{
    Bird, Netns, Node, Vm, bird_node_config_dual, bird_tor_config_dual, enable_forwarding, iperf3,
    link, vmpath::common::drop_reason, wait_for,
};

const NODE_IP: &str = "192.0.2.1";
const TOR_IP: &str = "192.0.2.2";
const EXT_IP: &str = "198.51.100.10";
const NODE_IP6: &str = "fd00:2::1/64";

struct Bed {
    node: Node,
    tor: Netns,
    ext: Netns,
    vm1: Vm,
    vm2: Vm,
    node_bird: Bird,
    tor_bird: Bird,
}

fn node_doc() -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: a}}\nspec:\n  address: {NODE_IP}\n"
    )
}

fn network_doc(name: &str, id: u32, subnet: &str, gw: &str, extra: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\nspec:\n  id: {id}\n  subnets: [\"{subnet}\"]\n  defaultGatewayIPs: [\"{gw}\"]\n  ipam: {{mode: Enabled}}\n{extra}"
    )
}

fn attachment_doc(vm: &str, network: &str, port: &str, mac: &str, ip: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}-eth0, namespace: prod}}\nspec:\n  vm: {vm}\n  interface: eth0\n  network: {network}\n  node: a\n  port: {port}\n  mac: \"{mac}\"\n  ips: [\"{ip}\"]\n"
    )
}

/// The node, its ToR and the external host; vm1 on the routed network
/// `green` (advertised per VM), vm2 on the SNAT network `orange`.
fn bed() -> Bed {
    let mut node = Node::new("a");
    let tor = Netns::new(format!("vt{}-tor", node.tag));
    let ext = Netns::new(format!("vt{}-ext", node.tag));
    link(
        &node.ns,
        "up0",
        &format!("{NODE_IP}/30"),
        &tor,
        "tor0",
        &format!("{TOR_IP}/30"),
    );
    link(
        &tor,
        "tor1",
        "198.51.100.1/24",
        &ext,
        "ext0",
        &format!("{EXT_IP}/24"),
    );
    // IPv6 on the node-ToR link: the next hop of the per-VM /128s.
    node.ns
        .run(&["ip", "addr", "add", NODE_IP6, "dev", "up0", "nodad"]);
    tor.run(&["ip", "addr", "add", "fd00:2::2/64", "dev", "tor0", "nodad"]);
    enable_forwarding(&node.ns);
    enable_forwarding(&tor);
    node.ns
        .run(&["ip", "route", "add", "default", "via", TOR_IP]);
    ext.run(&["ip", "route", "add", "default", "via", "198.51.100.1"]);

    let vm1 = node.add_vm(
        "g1",
        "52:54:00:00:0a:01",
        &["10.20.0.11/16", "fd20::11/64"],
        Some("10.20.0.1"),
    );
    let vm2 = node.add_vm(
        "o1",
        "52:54:00:00:0b:01",
        &["10.30.0.21/16"],
        Some("10.30.0.1"),
    );
    node.write_config("node.yaml", &node_doc());
    node.write_config(
        "networks.yaml",
        &[
            network_doc(
                "green",
                500,
                "10.20.0.0/16\", \"fd20::/64",
                "10.20.0.1\", \"fd20::1",
                "  egress: Routed\n  advertise: {perVM: true}\n",
            ),
            network_doc(
                "orange",
                501,
                "10.30.0.0/16",
                "10.30.0.1",
                "  egress: SNAT\n",
            ),
        ]
        .join("---\n"),
    );
    node.write_config(
        "vm1.yaml",
        &attachment_doc(
            "g1",
            "green",
            &vm1.port,
            &vm1.mac,
            "10.20.0.11/16\", \"fd20::11/64",
        ),
    );
    node.write_config(
        "vm2.yaml",
        &attachment_doc("o1", "orange", &vm2.port, &vm2.mac, "10.30.0.21/16"),
    );
    node.set_agent_args(&["--uplink", "up0", "--metrics-addr", "off"]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);

    let tor_bird = Bird::start(
        &tor,
        "tor",
        &bird_tor_config_dual(TOR_IP, TOR_IP, 65000, NODE_IP, 65001),
    );
    let node_bird = Bird::start(
        &node.ns,
        "node",
        &bird_node_config_dual(NODE_IP, NODE_IP, 65001, TOR_IP, 65000, "fd00:2::1"),
    );
    Bed {
        node,
        tor,
        ext,
        vm1,
        vm2,
        node_bird,
        tor_bird,
    }
}

fn total_drops(node: &Node) -> u64 {
    node.maps().drop_counts().unwrap().iter().sum()
}

fn tor_has_route(bed: &Bed, prefix: &str) -> bool {
    bed.tor_bird.show_route().contains(prefix)
}

#[test]
fn routed_vm_reachable_from_outside_by_its_own_address_and_per_vm_route_over_bgp() {
    let bed = bed();

    // The agent writes the /32 into table 100 with protocol 250 ...
    wait_for(
        "the per-VM route in table 100",
        Duration::from_secs(10),
        || {
            let out = bed
                .node
                .ns
                .run(&["ip", "route", "show", "table", "100", "proto", "250"]);
            out.contains("10.20.0.11 dev lo")
        },
    );
    // ... the node's BIRD learns it and the ToR's BIRD receives it over BGP.
    wait_for(
        "the ToR to learn 10.20.0.11/32 over BGP",
        Duration::from_secs(30),
        || tor_has_route(&bed, "10.20.0.11/32"),
    );
    // The /128 likewise, on the session's ipv6 channel.
    wait_for(
        "the ToR to learn fd20::11/128 over BGP",
        Duration::from_secs(30),
        || tor_has_route(&bed, "fd20::11/128"),
    );
    wait_for(
        "the ToR kernel route (IPv6)",
        Duration::from_secs(10),
        || {
            bed.tor
                .run(&["ip", "-6", "route", "show", "fd20::11"])
                .contains("via fd00:2::1")
        },
    );
    let tor_routes = bed.tor_bird.show_route();
    assert!(
        !tor_routes.contains("10.30.0.21"),
        "the SNAT network's VM must not be advertised: {tor_routes}"
    );
    wait_for("the ToR kernel route", Duration::from_secs(10), || {
        bed.tor
            .run(&["ip", "route", "show", "10.20.0.11"])
            .contains("via 192.0.2.1")
    });

    // The external host reaches the VM by the VM's own address and the VM
    // sees the external host's real address.
    let dump = bed.vm1.ns.spawn(&[
        "timeout",
        "10",
        "tcpdump",
        "-n",
        "-l",
        "-c",
        "1",
        "-i",
        "eth0",
        "icmp and src host",
        EXT_IP,
    ]);
    std::thread::sleep(Duration::from_millis(700));
    assert!(bed.ext.ping("10.20.0.11", 3), "external -> routed VM");
    let out = dump.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{EXT_IP} > 10.20.0.11")),
        "the VM saw no ICMP from the external host's own address: {text}"
    );
    assert!(bed.vm1.ping(EXT_IP), "routed VM -> external");

    // TCP and UDP both ways: the VM serves, then the external host serves.
    let tcp = iperf3(&bed.vm1.ns, &bed.ext, "10.20.0.11", false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    assert!(bps > 1e8, "TCP external -> VM only {bps} bit/s");
    let remote = tcp["start"]["connected"][0]["local_host"].as_str().unwrap();
    assert_eq!(remote, EXT_IP, "client side address");
    let tcp = iperf3(&bed.ext, &bed.vm1.ns, EXT_IP, false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    assert!(bps > 1e8, "TCP VM -> external only {bps} bit/s");
    eprintln!("routed TCP VM -> external: {:.2} Gbit/s", bps / 1e9);
    // UDP at 500 Mbit/s through two forwarding hops on two cores loses a
    // little at the receivers; the data path itself must drop nothing.
    let drops_before = total_drops(&bed.node);
    let udp = iperf3(&bed.ext, &bed.vm1.ns, EXT_IP, true, 2);
    let lost = udp["end"]["sum"]["lost_percent"].as_f64().unwrap_or(100.0);
    assert!(lost < 20.0, "UDP VM -> external lost {lost}%");
    let udp = iperf3(&bed.vm1.ns, &bed.ext, "10.20.0.11", true, 2);
    let lost = udp["end"]["sum"]["lost_percent"].as_f64().unwrap_or(100.0);
    assert!(lost < 20.0, "UDP external -> VM lost {lost}%");
    assert_eq!(
        total_drops(&bed.node),
        drops_before,
        "data path drops during UDP"
    );

    // A source outside the network's subnets never leaves.
    let before = bed.node.drops(drop_reason::ROUTE_SRC_OUTSIDE);
    bed.vm1
        .ns
        .run(&["ip", "addr", "add", "10.99.0.5/32", "dev", "eth0"]);
    let _ = bed
        .vm1
        .ns
        .run_status(&["ping", "-c", "1", "-W", "1", "-I", "10.99.0.5", EXT_IP]);
    assert!(
        bed.node.drops(drop_reason::ROUTE_SRC_OUTSIDE) + bed.node.drops(drop_reason::IP_SPOOF)
            > before,
        "spoofed source not counted"
    );

    // Deleting the Attachment withdraws the route from the ToR.
    bed.node.remove_config("vm1.yaml");
    wait_for(
        "the ToR to withdraw 10.20.0.11/32",
        Duration::from_secs(30),
        || !tor_has_route(&bed, "10.20.0.11/32"),
    );
    wait_for(
        "the ToR to withdraw fd20::11/128",
        Duration::from_secs(30),
        || !tor_has_route(&bed, "fd20::11/128"),
    );
    let out = bed
        .node
        .ns
        .run(&["ip", "-6", "route", "show", "table", "100", "proto", "250"]);
    assert!(
        !out.contains("fd20::11"),
        "IPv6 route left in table 100: {out}"
    );
    let out = bed
        .node
        .ns
        .run(&["ip", "route", "show", "table", "100", "proto", "250"]);
    assert!(
        !out.contains("10.20.0.11"),
        "route left in table 100: {out}"
    );
    let _ = (&bed.node_bird, &bed.vm2);
}

/// iperf3 server in `server` (its JSON returned, with the peers it saw) and
/// a client in `client` with `extra` arguments.
fn iperf3_server_view(
    server: &Netns,
    client: &Netns,
    server_ip: &str,
    port: &str,
    extra: &[&str],
) -> (serde_json::Value, serde_json::Value) {
    let srv = server.spawn(&["iperf3", "-s", "-1", "-J", "-p", port]);
    wait_for("iperf3 server to listen", Duration::from_secs(10), || {
        let ss = server.run_status(&["ss", "-Hltn", &format!("sport = :{port}")]);
        !String::from_utf8_lossy(&ss.stdout).trim().is_empty()
    });
    let mut args = vec!["iperf3", "-c", server_ip, "-p", port, "-t", "2", "-J"];
    args.extend_from_slice(extra);
    let out = client.run_status(&args);
    let client_json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 client printed no JSON ({e})"));
    assert!(
        client_json.get("error").is_none(),
        "iperf3 client: {}",
        client_json["error"]
    );
    let out = srv.wait_with_output().unwrap();
    let server_json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 server printed no JSON ({e})"));
    (server_json, client_json)
}

#[test]
fn snat_vm_reaches_outside_as_the_node_address_tcp_udp_icmp() {
    let bed = bed();
    let reserved = bed
        .node
        .ns
        .run(&["sysctl", "-n", "net.ipv4.ip_local_reserved_ports"]);
    wait_for(
        "the SNAT port range reserved",
        Duration::from_secs(5),
        || {
            bed.node
                .ns
                .run(&["sysctl", "-n", "net.ipv4.ip_local_reserved_ports"])
                .contains("40000-59999")
        },
    );
    let _ = reserved;

    // ICMP echo: the external host sees the node's address.
    let dump = bed.ext.spawn(&[
        "timeout",
        "10",
        "tcpdump",
        "-n",
        "-l",
        "-c",
        "1",
        "-i",
        "ext0",
        "icmp[icmptype] = 8",
    ]);
    std::thread::sleep(Duration::from_millis(700));
    assert!(bed.vm2.ping(EXT_IP), "SNAT VM -> external ping");
    let out = dump.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{NODE_IP} > {EXT_IP}")),
        "the external host did not see the node address: {text}"
    );

    // TCP, 16 parallel flows: all from the node address, distinct ports
    // from the reserved range.
    let (srv, cli) = iperf3_server_view(&bed.ext, &bed.vm2.ns, EXT_IP, "5301", &["-P", "16"]);
    let conns = srv["start"]["connected"].as_array().expect("connected");
    assert_eq!(conns.len(), 16, "server saw {} streams", conns.len());
    let mut ports = std::collections::BTreeSet::new();
    for c in conns {
        assert_eq!(c["remote_host"].as_str(), Some(NODE_IP), "peer {c}");
        let p = c["remote_port"].as_u64().unwrap();
        assert!(
            (40000..=59999).contains(&p),
            "port {p} outside the SNAT range"
        );
        ports.insert(p);
    }
    assert_eq!(ports.len(), 16, "SNAT ports not distinct: {ports:?}");
    let bps = cli["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    eprintln!(
        "SNAT TCP VM -> external, 16 streams: {:.2} Gbit/s",
        bps / 1e9
    );
    assert!(bps > 1e8, "SNAT TCP only {bps} bit/s");

    // TCP with the data coming back through the reverse translation.
    let (_, cli) = iperf3_server_view(&bed.ext, &bed.vm2.ns, EXT_IP, "5302", &["-R"]);
    let bps = cli["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    eprintln!("SNAT TCP external -> VM (reverse): {:.2} Gbit/s", bps / 1e9);
    assert!(bps > 1e8, "SNAT TCP reverse only {bps} bit/s");

    // UDP, at a rate a loaded 2-core machine sustains beside other tests
    // (at 300 Mbit/s iperf3's receiver, not the data path, lost 45%).
    let drops_before = total_drops(&bed.node);
    let (_, udp) = iperf3_server_view(&bed.ext, &bed.vm2.ns, EXT_IP, "5303", &["-u", "-b", "50M"]);
    let lost = udp["end"]["sum"]["lost_percent"].as_f64().unwrap_or(100.0);
    assert!(lost < 20.0, "SNAT UDP lost {lost}%");
    assert_eq!(
        total_drops(&bed.node),
        drops_before,
        "data path drops during UDP"
    );

    // Fragmented datagrams both ways: a 3000-byte ping and 3000-byte UDP
    // leave the VM in fragments and come back in fragments; each
    // direction's later fragments follow their first one's translation.
    let frag_drops = bed.node.drops(drop_reason::SNAT_FRAGMENT);
    assert!(
        bed.vm2
            .ns
            .run_status(&[
                "ping", "-c", "3", "-i", "0.2", "-W", "2", "-s", "3000", EXT_IP
            ])
            .status
            .success(),
        "a fragmented ping through SNAT and back"
    );
    let (_, udp) = iperf3_server_view(
        &bed.ext,
        &bed.vm2.ns,
        EXT_IP,
        "5304",
        &["-u", "-b", "20M", "-l", "3000"],
    );
    let lost = udp["end"]["sum"]["lost_percent"].as_f64().unwrap_or(100.0);
    assert!(lost < 20.0, "SNAT fragmented UDP lost {lost}%");
    assert_eq!(
        bed.node.drops(drop_reason::SNAT_FRAGMENT),
        frag_drops,
        "no later fragment without its first"
    );

    // The flows are in the tables, and the VM's quota counts them.
    let maps = bed.node.maps();
    let flows = maps.snat_out.iter().filter_map(|r| r.ok()).count();
    assert!(flows >= 17, "only {flows} SNAT flows recorded");
    assert!(bed.node.drops(drop_reason::SNAT_PORTS_EXHAUSTED) == 0);
}

/// The networks of [`bed`], with `mtu: 1400` on the routed one.
fn networks_with_green_mtu() -> String {
    [
        network_doc(
            "green",
            500,
            "10.20.0.0/16\", \"fd20::/64",
            "10.20.0.1\", \"fd20::1",
            "  egress: Routed\n  advertise: {perVM: true}\n  mtu: 1400\n",
        ),
        network_doc(
            "orange",
            501,
            "10.30.0.0/16",
            "10.30.0.1",
            "  egress: SNAT\n  mtu: 1400\n",
        ),
    ]
    .join("---\n")
}

#[test]
fn mtu_frag_needed_reaches_the_sender_and_pmtu_is_learned_both_ways() {
    let bed = bed();
    bed.node
        .write_config("networks.yaml", &networks_with_green_mtu());
    wait_for(
        "the network MTU programmed",
        Duration::from_secs(10),
        || {
            bed.node
                .maps()
                .networks
                .get(&500, 0)
                .map(|n| n.mtu == 1400)
                .unwrap_or(false)
        },
    );
    wait_for("routed ingress path", Duration::from_secs(30), || {
        bed.ext.ping("10.20.0.11", 1)
    });

    // VM -> external, DF set, 1478 bytes: the VM's gateway answers with
    // fragmentation-needed and the VM's kernel learns the path MTU.
    let before = bed.node.drops(drop_reason::MTU_EXCEEDED);
    let out = bed.vm1.ns.run_status(&[
        "ping", "-M", "do", "-s", "1450", "-c", "3", "-i", "0.3", "-W", "1", EXT_IP,
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("From 10.20.0.1") && text.contains("Frag needed and DF set (mtu = 1400)"),
        "no fragmentation-needed from the gateway: {text}"
    );
    assert!(
        text.contains("message too long, mtu=1400"),
        "the VM did not learn the path MTU: {text}"
    );
    assert!(bed.node.drops(drop_reason::MTU_EXCEEDED) > before);
    let route = bed.vm1.ns.run(&["ip", "route", "get", EXT_IP]);
    assert!(
        route.contains("mtu 1400"),
        "no PMTU in the route cache: {route}"
    );
    let tp = bed
        .vm1
        .ns
        .run_status(&["tracepath", "-n", "-m", "4", "-l", "1478", EXT_IP]);
    let tp = String::from_utf8_lossy(&tp.stdout).to_string();
    assert!(tp.contains("pmtu 1400"), "tracepath: {tp}");
    // The gateway is a hop: a datagram whose TTL runs out there gets
    // time-exceeded from 10.20.0.1 (tracepath's and traceroute's first hop).
    assert!(
        tp.lines()
            .any(|l| l.trim_start().starts_with("1:") && l.contains("10.20.0.1")),
        "tracepath shows no first hop: {tp}"
    );
    let before = bed.node.drops(drop_reason::ROUTE_TTL_EXCEEDED);
    let out = bed
        .vm1
        .ns
        .run_status(&["ping", "-t", "1", "-c", "2", "-i", "0.3", "-W", "1", EXT_IP]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("From 10.20.0.1") && text.contains("Time to live exceeded"),
        "no time-exceeded from the gateway: {text}"
    );
    assert!(bed.node.drops(drop_reason::ROUTE_TTL_EXCEEDED) >= before + 2);
    // At the MTU it goes through.
    let out = bed.vm1.ns.run_status(&[
        "ping", "-M", "do", "-s", "1372", "-c", "2", "-i", "0.3", "-W", "1", EXT_IP,
    ]);
    assert!(out.status.success(), "1400-byte ping failed");

    // External -> VM (routed ingress): the external host hears it from the
    // VM network's gateway.
    let out = bed.ext.run_status(&[
        "ping",
        "-M",
        "do",
        "-s",
        "1450",
        "-c",
        "3",
        "-i",
        "0.3",
        "-W",
        "1",
        "10.20.0.11",
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("From 10.20.0.1") && text.contains("Frag needed and DF set (mtu = 1400)"),
        "external host got no fragmentation-needed: {text}"
    );
    let route = bed.ext.run(&["ip", "route", "get", "10.20.0.11"]);
    assert!(route.contains("mtu 1400"), "external PMTU: {route}");

    // IPv4 without DF is dropped and counted, never passed oversized.
    let before = bed.node.drops(drop_reason::MTU_EXCEEDED_NO_DF);
    bed.vm1.ns.run(&["ip", "route", "flush", "cache"]);
    let _ = bed.vm1.ns.run_status(&[
        "ping", "-M", "dont", "-s", "1450", "-c", "1", "-W", "1", EXT_IP,
    ]);
    assert!(bed.node.drops(drop_reason::MTU_EXCEEDED_NO_DF) > before);

    // TCP both ways over the smaller MTU: GSO packets are judged by their
    // segment size, the senders learn the path MTU, nothing stalls.
    let tcp = iperf3(&bed.ext, &bed.vm1.ns, EXT_IP, false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    assert!(bps > 1e8, "TCP VM -> external at MTU 1400 only {bps} bit/s");
    let tcp = iperf3(&bed.vm1.ns, &bed.ext, "10.20.0.11", false, 2);
    let bps = tcp["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    assert!(bps > 1e8, "TCP external -> VM at MTU 1400 only {bps} bit/s");

    // SNAT network: the VM hears fragmentation-needed from its gateway too.
    let out = bed.vm2.ns.run_status(&[
        "ping", "-M", "do", "-s", "1450", "-c", "2", "-i", "0.3", "-W", "1", EXT_IP,
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.contains("From 10.30.0.1") && text.contains("mtu = 1400"),
        "SNAT VM got no fragmentation-needed: {text}"
    );
    let _ = (&bed.node_bird, &bed.tor_bird);
}

#[test]
fn snat_icmp_port_unreachable_reaches_the_vm() {
    let bed = bed();
    wait_for(
        "the SNAT network programmed",
        Duration::from_secs(10),
        || bed.vm2.ping(EXT_IP),
    );
    // A connected UDP socket in the VM sends to a closed port on the
    // external host; the port unreachable comes back to the node address,
    // is translated back, and the VM's socket reports ECONNREFUSED.
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.settimeout(3)\n\
         s.bind(('10.30.0.21', 5577))\n\
         s.connect(('{EXT_IP}', 9))\n\
         s.send(b'anyone?')\n\
         try:\n    s.recv(100)\n    print('data')\n\
         except ConnectionRefusedError:\n    print('refused')\n\
         except socket.timeout:\n    print('timeout')\n"
    );
    let dump = bed.vm2.ns.spawn(&[
        "timeout", "10", "tcpdump", "-n", "-l", "-v", "-c", "1", "-i", "eth0", "icmp",
    ]);
    std::thread::sleep(Duration::from_millis(700));
    let out = bed.vm2.ns.run(&["python3", "-c", &script]);
    assert_eq!(out.trim(), "refused", "the VM's UDP socket: {out}");
    let dump = dump.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&dump.stdout);
    assert!(
        text.contains(&format!("{EXT_IP} > 10.30.0.21"))
            && text.contains("udp port 9 unreachable")
            && text.contains("10.30.0.21.5577 >"),
        "the VM saw no translated port unreachable: {text}"
    );
    let _ = (&bed.node_bird, &bed.tor_bird, &bed.vm1, &bed.tor);
}

/// A node whose uplink has only IPv6 towards the ToR, an IPv6 external
/// host behind it, and a VM on the dual-stack SNAT network `teal` with
/// `advertise: {subnet: true}` (its subnets routed to the node; here the
/// ToR's static route stands in for the announcement).
#[test]
fn snat6_vm_reaches_outside_as_the_node_ipv6_address_and_inbound_flows_stay_unnated() {
    const NODE6: &str = "fd00:2::1";
    const EXT6: &str = "fd00:51::10";
    const VM6: &str = "fd40::21";
    let mut node = Node::new("a");
    let tor = Netns::new(format!("vt{}-tor", node.tag));
    let ext = Netns::new(format!("vt{}-ext", node.tag));
    link(
        &node.ns,
        "up0",
        &format!("{NODE6}/64"),
        &tor,
        "tor0",
        "fd00:2::2/64",
    );
    link(
        &tor,
        "tor1",
        "fd00:51::1/64",
        &ext,
        "ext0",
        &format!("{EXT6}/64"),
    );
    node.ns
        .run(&["ip", "addr", "add", &format!("{NODE_IP}/30"), "dev", "up0"]);
    enable_forwarding(&node.ns);
    enable_forwarding(&tor);
    node.ns
        .run(&["ip", "-6", "route", "add", "default", "via", "fd00:2::2"]);
    ext.run(&["ip", "-6", "route", "add", "default", "via", "fd00:51::1"]);
    tor.run(&["ip", "-6", "route", "add", "fd40::/64", "via", NODE6]);
    let vm = node.add_vm(
        "t1",
        "52:54:00:00:0c:01",
        &["10.40.0.21/16", &format!("{VM6}/64")],
        Some("10.40.0.1"),
    );
    vm.ns
        .run(&["ip", "-6", "route", "add", "default", "via", "fd40::1"]);
    node.write_config(
        "node.yaml",
        &format!("{}  snatAddress6: {NODE6}\n", node_doc()),
    );
    node.write_config(
        "networks.yaml",
        &network_doc(
            "teal",
            502,
            "10.40.0.0/16\", \"fd40::/64",
            "10.40.0.1\", \"fd40::1",
            "  egress: SNAT\n  advertise: {subnet: true}\n",
        ),
    );
    node.write_config(
        "vm.yaml",
        &attachment_doc(
            "t1",
            "teal",
            &vm.port,
            &vm.mac,
            "10.40.0.21/16\", \"fd40::21/64",
        ),
    );
    node.set_agent_args(&["--uplink", "up0", "--metrics-addr", "off"]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);

    // ICMPv6 echo out: the external host sees the node's IPv6 address.
    let dump = ext.spawn(&[
        "timeout",
        "10",
        "tcpdump",
        "-n",
        "-l",
        "-c",
        "1",
        "-i",
        "ext0",
        "icmp6 and ip6[40] == 128",
    ]);
    std::thread::sleep(Duration::from_millis(700));
    wait_for(
        "the VM pings the external host",
        Duration::from_secs(10),
        || vm.ping(EXT6),
    );
    let out = dump.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{NODE6} > {EXT6}")),
        "the external host did not see the node's IPv6 address: {text}"
    );

    // TCP out, 4 streams: from the node's address, ports of the range;
    // then data back through the reverse translation.
    let (srv, _) = iperf3_server_view(&ext, &vm.ns, EXT6, "5311", &["-P", "4"]);
    let conns = srv["start"]["connected"].as_array().expect("connected");
    assert_eq!(conns.len(), 4, "server saw {} streams", conns.len());
    for c in conns {
        assert_eq!(c["remote_host"].as_str(), Some(NODE6), "peer {c}");
        let p = c["remote_port"].as_u64().unwrap();
        assert!((40000..=59999).contains(&p), "port {p} outside the range");
    }
    let (_, cli) = iperf3_server_view(&ext, &vm.ns, EXT6, "5312", &["-R"]);
    let bps = cli["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap();
    assert!(bps > 1e8, "IPv6 SNAT TCP reverse only {bps} bit/s");

    // UDP to a closed port: the ICMPv6 port unreachable comes back to the
    // node's address, is translated back, and the VM's socket is refused.
    let script = format!(
        "import socket\n\
         s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n\
         s.settimeout(3)\n\
         s.bind(('{VM6}', 5577))\n\
         s.connect(('{EXT6}', 9))\n\
         s.send(b'anyone?')\n\
         try:\n    s.recv(100)\n    print('data')\n\
         except ConnectionRefusedError:\n    print('refused')\n\
         except socket.timeout:\n    print('timeout')\n"
    );
    let out = vm.ns.run(&["python3", "-c", &script]);
    assert_eq!(out.trim(), "refused", "the VM's UDP socket: {out}");

    // A fragmented datagram both ways: a 3000-byte ping leaves the VM in
    // fragments (`vm_snat6_ext`) and its answer comes back in fragments;
    // each direction's later fragments follow their first's translation.
    let frag_drops = node.drops(drop_reason::SNAT_FRAGMENT);
    assert!(
        vm.ns
            .run_status(&[
                "ping", "-c", "3", "-i", "0.2", "-W", "2", "-s", "3000", EXT6
            ])
            .status
            .success(),
        "a fragmented IPv6 ping through SNAT and back"
    );
    assert_eq!(
        node.drops(drop_reason::SNAT_FRAGMENT),
        frag_drops,
        "no later IPv6 fragment without its first"
    );

    // Inbound to the VM's own address: ping and TCP from the external host
    // work (their replies leave un-NATed, else they would not match), and
    // the VM sees the external host's own address.
    assert!(ext.ping(VM6, 3), "external host -> VM's IPv6 address");
    let (srv, _) = iperf3_server_view(&vm.ns, &ext, VM6, "5313", &[]);
    let conns = srv["start"]["connected"].as_array().expect("connected");
    assert_eq!(conns[0]["remote_host"].as_str(), Some(EXT6));
    let maps = node.maps();
    assert!(
        maps.inbound6.keys().count() >= 2,
        "inbound IPv6 flows not recorded"
    );
    assert!(maps.snat6_out.keys().count() >= 5, "IPv6 SNAT flows");
    for reason in [
        drop_reason::SNAT_UNSUPPORTED,
        drop_reason::SNAT_NO_ADDRESS,
        drop_reason::SNAT_PORTS_EXHAUSTED,
    ] {
        assert_eq!(
            node.drops(reason),
            0,
            "{}",
            drop_reason::NAMES[reason as usize]
        );
    }
}
