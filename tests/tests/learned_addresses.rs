//! A tenant's VM on an IPAM-less network (IP filter off by design) tries
//! to teach vmpath addresses that are not its to take: the node's, the
//! ToR's, another node's VTEP, its gateway, another VM's, the subnet's own,
//! special and outside addresses. Checked where an operator looks: `vm
//! show`, the node's routes (main table and the BGP export table), the
//! ToR's routes, and the node's reach to its ToR and its peers. Then the
//! per-port cap, a conflict between two VMs (the first holder keeps the
//! address, both are told) and expiry. Then a VM whose addresses only its
//! own node learned, reached from the fabric through the other node of
//! its network (which resolves it over the overlay), IPv4 and IPv6, and
//! what a scan of the subnet costs the overlay.
//!
//! Needs root. Run with:
//!   cargo xtask test -- learned_addresses

use std::time::{Duration, Instant};

use serde_json::Value;
use vmpath_common::drop_reason;
use vmpath_tests::{
    Netns, Node, Vm, iperf3,
    north_south::{
        EXT_IP, GATEWAY, GATEWAY6, IMP_IP, LRN_IP, LRN_MAC, NET_ID, NODE_A, NODE_B, NODE_C, TOR_IP,
        bed, network_doc_dual_stack, overlay_tx, tor_route, write_config_with,
    },
    wait_for, yaml,
};

/// The gateway's MAC as `vm` resolved it (it pinged its gateway first).
fn gateway_mac(vm: &Vm, gateway: &str) -> String {
    let neigh = vm.ns.run(&["ip", "neigh", "show", gateway]);
    neigh
        .split_whitespace()
        .skip_while(|w| *w != "lladdr")
        .nth(1)
        .unwrap_or_else(|| panic!("no neighbour entry for {gateway}: {neigh}"))
        .to_string()
}

/// One UDP datagram to `dst` through the gateway from each source.
fn send_from(vm: &Vm, gw_mac: &str, dst: &str, sources: &[&str]) {
    let v4: Vec<String> = sources
        .iter()
        .filter(|s| !s.contains(':'))
        .map(|s| format!("'{s}'"))
        .collect();
    let v6: Vec<String> = sources
        .iter()
        .filter(|s| s.contains(':'))
        .map(|s| format!("'{s}'"))
        .collect();
    vm.ns.scapy(&format!(
        "for s in [{}]:\n    sendp(Ether(src='{mac}', dst='{gw_mac}')/IP(src=s, dst='{dst}')/UDP(sport=4000, dport=9)/b'x', iface='eth0')\n\
         for s in [{}]:\n    sendp(Ether(src='{mac}', dst='{gw_mac}')/IPv6(src=s, dst='fd40::99')/UDP(sport=4000, dport=9)/b'x', iface='eth0')\n",
        v4.join(", "),
        v6.join(", "),
        mac = vm.mac,
    ));
}

fn learned_of(view: &Value) -> Vec<String> {
    view["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|ip| ip["origin"] == "learned")
        .filter_map(|ip| ip["address"].as_str().map(str::to_string))
        .collect()
}

fn refused_of(view: &Value, field: &str) -> Vec<(String, String)> {
    view[field]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["address"].as_str().unwrap_or_default().to_string(),
                r["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn vm_show(node: &Node, vm: &str) -> String {
    vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        &format!("prod/{vm}"),
        "--api-socket",
        node.api_socket().to_str().unwrap(),
    ])
}

#[test]
fn a_guest_cannot_teach_vmpath_the_nodes_the_fabrics_or_its_neighbours_addresses() {
    // lrn on node b: its address only learned; imp on node a (10.40.0.50
    // given); advertise {subnet, learned} through BIRD to the ToR.
    let bed = bed(2);
    let gw_mac = gateway_mac(&bed.lrn, GATEWAY);
    let hostile = [
        NODE_B,            // its own node
        TOR_IP,            // the ToR
        NODE_A,            // another node's VTEP
        GATEWAY,           // its gateway
        IMP_IP,            // another VM's (configured) address
        "10.99.0.5",       // another network's
        "127.0.0.1",       // loopback
        "224.0.0.5",       // multicast
        "255.255.255.255", // broadcast
        "240.0.0.1",       // class E
        "10.40.0.0",       // the subnet's network address
        "10.40.255.255",   // the subnet's broadcast address
        "169.254.169.254", // link-local (metadata)
        "8.8.8.8",         // outside
        "198.51.100.77",   // a spoofed outside source
        "::1",
        "ff02::1",
    ];
    send_from(&bed.lrn, &gw_mac, EXT_IP, &hostile);
    // A gratuitous ARP claiming the gateway, and one claiming imp's address.
    bed.lrn.ns.scapy(&format!(
        "for a in ['{GATEWAY}', '{IMP_IP}']:\n    sendp(Ether(src='{LRN_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=2, hwsrc='{LRN_MAC}', psrc=a, pdst=a), iface='eth0')\n"
    ));
    // The agent's view settles: what was refused is listed, with why. The
    // data path reports each source as the frames come (the last of them
    // a moment after the first ten on a loaded machine): wait for every
    // refusal the test names, not for a count.
    let expected = [
        (NODE_B, "node's address"),
        (NODE_A, "node's address"),
        (TOR_IP, "outside"),
        (GATEWAY, "gateway"),
        (IMP_IP, "held by"),
        ("10.99.0.5", "outside"),
        ("10.40.0.0", "network address"),
        ("10.40.255.255", "broadcast address"),
        ("8.8.8.8", "outside"),
        ("198.51.100.77", "outside"),
    ];
    let all_refused = |refused: &[(String, String)]| {
        expected
            .iter()
            .all(|(ip, why)| refused.iter().any(|(a, r)| a == ip && r.contains(why)))
    };
    // Past the deadline the assertions below say which one is missing.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline
        && !bed
            .b
            .attachment_view("lrn")
            .is_some_and(|v| all_refused(&refused_of(&v, "learned_refused")))
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let view = bed.b.attachment_view("lrn").unwrap();
    assert_eq!(
        learned_of(&view),
        [LRN_IP],
        "only lrn's own address: {view:#}"
    );
    let refused = refused_of(&view, "learned_refused");
    for (ip, why) in expected {
        assert!(
            refused.iter().any(|(a, r)| a == ip && r.contains(why)),
            "{ip} not refused as {why:?}: {refused:?}"
        );
    }
    // Addresses no guest can hold never even reach the table.
    for ip in [
        "127.0.0.1",
        "224.0.0.5",
        "255.255.255.255",
        "240.0.0.1",
        "169.254.169.254",
        "::1",
        "ff02::1",
    ] {
        assert!(
            !refused.iter().any(|(a, _)| a == ip) && !learned_of(&view).iter().any(|a| a == ip),
            "{ip} was taken in at all: {view:#}"
        );
    }
    let text = vm_show(&bed.b, "lrn");
    assert!(
        text.contains("refused:") && text.contains("8.8.8.8"),
        "vm show lists no refusal:\n{text}"
    );

    // The node's own routes: none of them points into the VM.
    let main = bed.b.ns.run(&["ip", "-4", "route", "show", "proto", "250"]);
    for ip in hostile.iter().filter(|ip| !ip.contains(':')) {
        assert!(
            !main
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ip)),
            "{ip} routed into the VM: {main}"
        );
    }
    let vtep = bed.b.ns.run(&["ip", "route", "get", NODE_A]);
    assert!(
        vtep.contains("dev ul0"),
        "node b's way to node a's VTEP: {vtep}"
    );
    assert!(bed.b.ns.ping(TOR_IP, 2), "node b lost its ToR");
    assert!(bed.a.ns.ping(NODE_B, 2), "node a lost node b");
    let exports = bed.b.ns.run(&["ip", "-4", "route", "show", "table", "100"]);
    for ip in ["8.8.8.8", "198.51.100.77", GATEWAY, IMP_IP, NODE_A] {
        assert!(
            !exports.lines().any(|l| l.starts_with(&format!("{ip} "))),
            "{ip} exported for BGP: {exports}"
        );
    }
    // The fabric was told nothing: the ToR's way to 8.8.8.8 and to the
    // spoofed source is not node b (the ToR's BIRD scans every second).
    std::thread::sleep(Duration::from_secs(3));
    for ip in ["8.8.8.8", "198.51.100.77", GATEWAY] {
        let r = tor_route(&bed, ip);
        assert!(
            !r.contains(&format!("via {NODE_B}")),
            "ToR routes {ip} to node b: {r}"
        );
    }
    assert!(tor_route(&bed, LRN_IP).contains(&format!("via {NODE_B}")));
    // imp keeps its traffic: the ToR still reaches it through node a.
    assert!(tor_route(&bed, IMP_IP).contains(&format!("via {NODE_A}")));
    assert!(bed.ext.ping(IMP_IP, 3), "external host -> imp");
}

/// Two VMs on one IPAM-less Primary network on one node; the agent with a
/// cap of 4 learned addresses a port and a 6 s expiry (room for
/// a loaded machine between a send and the checks that follow it).
#[test]
fn learned_addresses_are_capped_first_come_and_expire_with_their_routes() {
    let mut node = Node::new("a");
    let gw = "10.31.0.1";
    let vm1 = node.add_vm("vm1", "52:54:00:31:00:01", &["10.31.0.11/16"], Some(gw));
    let vm2 = node.add_vm("vm2", "52:54:00:31:00:02", &["10.31.0.12/16"], Some(gw));
    let net = yaml::network("red", 310, &["10.31.0.0/16"], &[gw], false) + "  role: Primary\n";
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            net,
            yaml::attachment("vm1", "red", "a", &vm1.port, &vm1.mac, &[]),
            yaml::attachment("vm2", "red", "a", &vm2.port, &vm2.mac, &[]),
        ]),
    );
    node.set_agent_args(&["--learned-per-port", "4", "--learned-expiry-seconds", "6"]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping(gw) && vm2.ping(gw));
    let gw_mac = gateway_mac(&vm1, gw);
    wait_for(
        "both VMs' own addresses learned",
        Duration::from_secs(10),
        || {
            node.attachment_view("vm1")
                .is_some_and(|v| learned_of(&v) == ["10.31.0.11"])
                && node
                    .attachment_view("vm2")
                    .is_some_and(|v| learned_of(&v) == ["10.31.0.12"])
        },
    );

    // vm1 keeps speaking (as a VM in use does) until the expiry step.
    let mut talking = vm1.ns.spawn(&["ping", "-q", "-i", "0.5", gw]);
    // vm2 tries vm1's learned address: vm1 keeps it, both are told.
    send_from(&vm2, &gw_mac, "10.31.0.99", &["10.31.0.11"]);
    wait_for("the conflict on both", Duration::from_secs(10), || {
        let v1 = node.attachment_view("vm1").unwrap();
        let v2 = node.attachment_view("vm2").unwrap();
        refused_of(&v2, "learned_refused")
            .iter()
            .any(|(a, r)| a == "10.31.0.11" && r.contains("vm1"))
            && refused_of(&v1, "learned_contested")
                .iter()
                .any(|(a, r)| a == "10.31.0.11" && r.contains("vm2"))
    });
    let route = node.ns.run(&["ip", "route", "show", "10.31.0.11"]);
    assert!(
        route.contains(&vm1.port),
        "vm1's address left vm1's port: {route}"
    );
    assert!(vm2.ping("10.31.0.11") && vm1.ping("10.31.0.12"));

    // vm1 cycles through 10 more addresses: 4 in all are its.
    let many: Vec<String> = (100..110).map(|i| format!("10.31.0.{i}")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    send_from(&vm1, &gw_mac, "10.31.0.99", &refs);
    wait_for("the cap", Duration::from_secs(10), || {
        node.attachment_view("vm1").is_some_and(|v| {
            learned_of(&v).len() == 4
                && refused_of(&v, "learned_refused")
                    .iter()
                    .filter(|(_, r)| r.contains("--learned-per-port"))
                    .count()
                    == 7
        })
    });
    let v1 = node.attachment_view("vm1").unwrap();
    assert!(
        learned_of(&v1).contains(&"10.31.0.11".to_string()),
        "the cap pushed out vm1's own address: {v1:#}"
    );
    let routes = node.ns.run(&["ip", "-4", "route", "show", "proto", "250"]);
    assert_eq!(
        routes.lines().filter(|l| l.contains(&vm1.port)).count(),
        4,
        "vm1's routes: {routes}"
    );

    // Silent for longer than the expiry: the addresses and their routes go.
    let _ = talking.kill();
    let _ = talking.wait();
    wait_for(
        "the learned addresses to expire",
        Duration::from_secs(15),
        || {
            node.attachment_view("vm1")
                .is_some_and(|v| learned_of(&v).is_empty())
                && !node
                    .ns
                    .run(&["ip", "-4", "route", "show", "proto", "250"])
                    .contains(&vm1.port)
        },
    );
    assert!(node.agent_log().contains("learned address expired"));
    // Speaking again teaches it again.
    assert!(vm1.ping(gw));
    wait_for("vm1 learned again", Duration::from_secs(10), || {
        node.attachment_view("vm1")
            .is_some_and(|v| learned_of(&v) == ["10.31.0.11"])
    });
}

/// What `ns` sees as the source of the ICMP echo requests (IPv4 or IPv6)
/// arriving on eth0 while `ping` runs.
fn echo_seen(ns: &Netns, ping: impl FnOnce() -> bool) -> String {
    let dump = ns.spawn(&[
        "timeout",
        "10",
        "tcpdump",
        "-n",
        "-l",
        "-c",
        "1",
        "-i",
        "eth0",
        "icmp[icmptype] = 8 or icmp6[icmp6type] = 128",
    ]);
    // Listening once its packet socket exists (/proc/net/packet: a
    // header line, then one line a socket).
    wait_for("tcpdump to listen", Duration::from_secs(10), || {
        ns.run(&["cat", "/proc/net/packet"]).lines().count() > 1
    });
    assert!(ping(), "ping failed");
    let out = dump.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two nodes and a BIRD ToR (`north_south::bed`), the network dual-stack.
/// VM lrn on node b has only its MAC written down: its addresses
/// (10.40.0.60, fd40::60) are learned on node b alone. The fabric sends
/// its traffic to node a (a route on the ToR more specific than BGP's,
/// as ECMP over the subnet route every node advertises may): node a knows
/// nothing of the address, asks the network's other nodes over the
/// overlay (ARP, NS), node b answers, and node a relays. Without that,
/// node a hands the frames to its own stack, which routes them back to
/// the ToR. Then a scan of an address no one has: node a asks at most
/// once a second, whatever the fabric sends.
#[test]
fn a_learned_only_vm_is_reached_through_another_node_of_its_network_ipv4_and_ipv6() {
    let bed = bed(2);
    write_config_with(&bed, None, network_doc_dual_stack());
    let lrn6 = "fd40::60";
    let ext6 = "2001:db8:100::10";
    bed.lrn.ns.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd40::60/64",
        "dev",
        "eth0",
        "nodad",
    ]);
    bed.lrn
        .ns
        .run(&["ip", "-6", "route", "add", "default", "via", GATEWAY6]);
    // IPv6 on the fabric: the underlay, the ToR, the external host.
    for (ns, addr) in [
        (&bed.a.ns, "fd99::1/64"),
        (&bed.b.ns, "fd99::2/64"),
        (&bed.tor, "fd99::254/64"),
    ] {
        ns.run(&["ip", "-6", "addr", "add", addr, "dev", "ul0", "nodad"]);
    }
    bed.tor.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "2001:db8:100::1/64",
        "dev",
        "tor1",
        "nodad",
    ]);
    bed.ext.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "2001:db8:100::10/64",
        "dev",
        "ext0",
        "nodad",
    ]);
    bed.ext.run(&[
        "ip",
        "-6",
        "route",
        "add",
        "default",
        "via",
        "2001:db8:100::1",
    ]);
    for node in [&bed.a, &bed.b] {
        node.ns
            .run(&["ip", "-6", "route", "add", "default", "via", "fd99::254"]);
    }
    // The fabric picks node a, which does not host lrn.
    bed.tor
        .run(&["ip", "-6", "route", "add", "fd40::/64", "via", "fd99::1"]);
    bed.tor
        .run(&["ip", "route", "add", LRN_IP, "via", NODE_A, "metric", "1"]);

    // lrn speaks (its gateway), so node b learns both addresses.
    wait_for(
        "node b to learn lrn's IPv4 and IPv6 addresses",
        Duration::from_secs(20),
        || {
            bed.lrn.ns.ping(GATEWAY, 1);
            bed.lrn.ns.ping(GATEWAY6, 1);
            bed.b.attachment_view("lrn").is_some_and(|v| {
                let learned = learned_of(&v);
                learned.contains(&LRN_IP.to_string()) && learned.contains(&lrn6.to_string())
            })
        },
    );
    assert!(
        bed.a
            .attachment_view("lrn")
            .is_none_or(|v| learned_of(&v).is_empty()),
        "node a should not know lrn's addresses from its config"
    );

    let unresolved = bed.a.drops(drop_reason::INGRESS_UNRESOLVED);
    let relayed = overlay_tx(&bed.a);
    // The first datagram of each family is lost while node a asks.
    wait_for(
        "the external host to reach lrn through node a (IPv4)",
        Duration::from_secs(20),
        || bed.ext.ping(LRN_IP, 1),
    );
    wait_for(
        "the external host to reach lrn through node a (IPv6)",
        Duration::from_secs(20),
        || bed.ext.ping(lrn6, 1),
    );
    assert!(
        bed.a.drops(drop_reason::INGRESS_UNRESOLVED) > unresolved,
        "node a did not resolve lrn's addresses"
    );
    assert!(
        overlay_tx(&bed.a) > relayed,
        "node a sent nothing over the overlay"
    );
    // lrn sees the external host's own addresses (routed in, not NATed).
    let seen = echo_seen(&bed.lrn.ns, || bed.ext.ping(LRN_IP, 3));
    assert!(
        seen.contains(&format!("{EXT_IP} > {LRN_IP}")),
        "lrn did not see the external host's address: {seen}"
    );
    let seen = echo_seen(&bed.lrn.ns, || bed.ext.ping(lrn6, 3));
    assert!(
        seen.contains(&format!("{ext6} > {lrn6}")),
        "lrn did not see the external host's IPv6 address: {seen}"
    );
    // TCP and UDP both ways, through node a.
    for server_ip in [LRN_IP, lrn6] {
        let tcp = iperf3(&bed.lrn.ns, &bed.ext, server_ip, false, 1);
        let bps = tcp["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        assert!(bps > 1e6, "TCP to {server_ip} through node a: {bps} bit/s");
        let udp = iperf3(&bed.lrn.ns, &bed.ext, server_ip, true, 1);
        let sum = &udp["end"]["sum"];
        let got =
            sum["packets"].as_f64().unwrap_or(0.0) - sum["lost_packets"].as_f64().unwrap_or(0.0);
        assert!(
            got > 100.0,
            "UDP to {server_ip} through node a: {got} datagrams"
        );
    }
    assert!(
        tor_route(&bed, LRN_IP).contains(&format!("via {NODE_A}")),
        "the ToR's route moved away from node a"
    );

    // A scan of one address no node has: every frame dropped and counted
    // on node a, at most one request a second reaches node b.
    let nobody = "10.40.0.99";
    bed.tor
        .run(&["ip", "route", "add", nobody, "via", NODE_A, "metric", "1"]);
    let count = |n: &Node| {
        n.drops(drop_reason::INGRESS_UNRESOLVED) + n.drops(drop_reason::INGRESS_RESOLVE_LIMITED)
    };
    let dropped = count(&bed.a);
    let refused = bed.b.drops(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
    let frames = 300;
    let start = Instant::now();
    bed.ext.scapy(&format!(
        "send(IP(dst='{nobody}')/UDP(sport=4000, dport=9)/b'x', count={frames})"
    ));
    wait_for(
        "node a to count every frame of the scan",
        Duration::from_secs(10),
        || count(&bed.a) >= dropped + frames,
    );
    let secs = start.elapsed().as_secs() + 1;
    wait_for("node b to get a request", Duration::from_secs(10), || {
        bed.b.drops(drop_reason::OVERLAY_RESOLVE_NOT_HERE) > refused
    });
    let requests = bed.b.drops(drop_reason::OVERLAY_RESOLVE_NOT_HERE) - refused;
    // One a second, and one more where two CPUs asked at the same instant.
    assert!(
        requests <= secs + 1,
        "{frames} frames for one address in {secs} s made {requests} requests"
    );
    eprintln!("scan: {frames} frames to {nobody} in {secs} s, {requests} requests to node b");
}

/// An ARP reply to node a's gateway, over the overlay from node c (a
/// node of the network, the VXLAN datagram its underlay address sends):
/// `target`'s answer naming `mac`.
fn forged_answer(c: &Node, gw_mac: &str, target: &str, mac: &str) {
    c.ns.scapy(&format!(
        "send(IP(src='{NODE_C}', dst='{NODE_A}')/UDP(sport=40000, dport=4789)/VXLAN(vni={NET_ID}, flags=0x08)/\
         Ether(src='{mac}', dst='{gw_mac}')/ARP(op=2, psrc='{target}', hwsrc='{mac}', pdst='{GATEWAY}', hwdst='{gw_mac}'))"
    ));
}

/// Three nodes of the network (`cvm` on node c): node a resolves lrn's
/// learned-only address on node b for the fabric's traffic, as above.
/// Node c then answers what node a never asked (an address no one has):
/// refused, `overlay_resolve_refused`, and node a still does not know it
/// (the fabric's frames to it are still unresolved). Node c answers for
/// lrn's address, already resolved, with its own MAC: refused too, and
/// the address stays with node b (the external host still reaches lrn,
/// which sees its echoes).
#[test]
fn overlay_resolution_refuses_unasked_and_competing_answers() {
    let bed = bed(3);
    write_config_with(&bed, None, network_doc_dual_stack());
    let (c, _) = bed.c.as_ref().expect("a third node");
    bed.tor
        .run(&["ip", "route", "add", LRN_IP, "via", NODE_A, "metric", "1"]);
    wait_for(
        "node b to learn lrn's address",
        Duration::from_secs(20),
        || {
            bed.lrn.ns.ping(GATEWAY, 1);
            bed.b
                .attachment_view("lrn")
                .is_some_and(|v| learned_of(&v).contains(&LRN_IP.to_string()))
        },
    );
    wait_for(
        "the external host to reach lrn through node a",
        Duration::from_secs(20),
        || bed.ext.ping(LRN_IP, 1),
    );
    let gw_mac = gateway_mac(&bed.lrn, GATEWAY);
    let refused = |n: &Node| n.drops(drop_reason::OVERLAY_RESOLVE_REFUSED);

    // An answer nobody asked for.
    let unasked = "10.40.0.88";
    let before = refused(&bed.a);
    forged_answer(c, &gw_mac, unasked, "52:54:00:40:00:88");
    wait_for(
        "node a to refuse the answer it never asked for",
        Duration::from_secs(10),
        || refused(&bed.a) > before,
    );
    bed.tor
        .run(&["ip", "route", "add", unasked, "via", NODE_A, "metric", "1"]);
    let unresolved = bed.a.drops(drop_reason::INGRESS_UNRESOLVED)
        + bed.a.drops(drop_reason::INGRESS_RESOLVE_LIMITED);
    assert!(!bed.ext.ping(unasked, 1), "the unasked answer was kept");
    assert!(
        bed.a.drops(drop_reason::INGRESS_UNRESOLVED)
            + bed.a.drops(drop_reason::INGRESS_RESOLVE_LIMITED)
            > unresolved,
        "node a took the unasked answer: the frame to {unasked} was not left unresolved"
    );

    // A competing answer for an address node b's answer holds.
    let before = refused(&bed.a);
    forged_answer(c, &gw_mac, LRN_IP, "52:54:00:40:00:99");
    wait_for(
        "node a to refuse node c's answer for lrn's address",
        Duration::from_secs(10),
        || refused(&bed.a) > before,
    );
    let seen = echo_seen(&bed.lrn.ns, || bed.ext.ping(LRN_IP, 3));
    assert!(
        seen.contains(&format!("{EXT_IP} > {LRN_IP}")),
        "lrn's address moved away from node b: {seen}"
    );
}
