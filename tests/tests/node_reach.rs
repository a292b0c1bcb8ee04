//! The node reaches the endpoints of its Primary networks (kubelet probes,
//! NodePort through kube-proxy), and, as Kubernetes defines for traffic
//! from a pod's own node, whatever their NetworkPolicy says; the endpoints
//! themselves stay bound by their egress policy towards the node.

use std::time::Duration;

use vmpath_tests::{Node, Vm, enable_forwarding, vmpath::common::drop_reason, wait_for, yaml};

/// Denies everything, both ways, for every endpoint of namespace prod.
const DENY_ALL_PROD: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
    metadata: {name: deny-all, namespace: prod}\n\
    spec: {podSelector: {}, policyTypes: [Ingress, Egress]}\n";

/// The node's own address (its InternalIP), on a link of its own as a
/// real node has it on its NIC.
const NODE_IP: &str = "192.0.2.10";

/// A one-connection TCP echo server on `port`, printing "ready".
fn echo_server(port: u16) -> String {
    format!(
        "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('0.0.0.0', {port})); s.listen(16); print('ready', flush=True)\n\
         while True:\n    c, _ = s.accept(); c.sendall(c.recv(100)); c.close()\n"
    )
}

/// A server process, killed with the test.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether a TCP connection to `ip:port` from `ns` gets its echo back.
fn tcp_echo(ns: &vmpath_tests::Netns, ip: &str, port: u16) -> bool {
    let script = format!(
        "import socket\ntry:\n    s = socket.create_connection(('{ip}', {port}), timeout=1.5); s.settimeout(1.5)\n    \
         s.sendall(b'probe'); print('ok' if s.recv(10) == b'probe' else 'no')\nexcept OSError:\n    print('no')\n"
    );
    ns.run(&["python3", "-c", &script]).trim() == "ok"
}

fn pings(ns: &vmpath_tests::Netns, ip: &str) -> bool {
    ns.run_status(&["ping", "-c", "1", "-W", "1", ip])
        .status
        .success()
}

fn primary_network(name: &str, id: u32, subnet: &str, gw: &str) -> String {
    format!(
        "{}  role: Primary\n",
        yaml::network(name, id, &[subnet], &[gw], true)
    )
}

/// Our routes in the node's main table (`proto 250`), one per line.
fn node_routes(node: &Node) -> String {
    node.ns
        .run(&["ip", "route", "show", "table", "main", "proto", "250"])
}

#[test]
fn the_node_reaches_endpoints_of_a_primary_network_whatever_their_policy() {
    let mut node = Node::new("nr");
    enable_forwarding(&node.ns);
    node.ns.run(&[
        "ip",
        "link",
        "add",
        "nodeip",
        "type",
        "veth",
        "peer",
        "name",
        "nodeip-peer",
    ]);
    node.ns.run(&[
        "ip",
        "addr",
        "add",
        &format!("{NODE_IP}/32"),
        "dev",
        "nodeip",
    ]);
    node.ns.run(&["ip", "link", "set", "nodeip", "up"]);
    let vm1: Vm = node.add_vm(
        "vm1",
        "02:6e:72:00:00:01",
        &["10.20.0.11/16"],
        Some("10.20.0.1"),
    );
    let vm2: Vm = node.add_vm(
        "vm2",
        "02:6e:72:00:00:02",
        &["10.21.0.12/16"],
        Some("10.21.0.1"),
    );
    let attach = |name: &str, net: &str, vm: &Vm, ip: &str| {
        yaml::attachment(name, net, &node.name, &vm.port, &vm.mac, &[ip])
    };
    let networks = [
        primary_network("blue", 100, "10.20.0.0/16", "10.20.0.1"),
        yaml::network("green", 101, &["10.21.0.0/16"], &["10.21.0.1"], true),
    ];
    node.write_config("networks.yaml", &yaml::docs(&networks));
    node.write_config(
        "vm1.yaml",
        &yaml::docs(&[attach("vm1", "blue", &vm1, "10.20.0.11/16")]),
    );
    node.write_config(
        "vm2.yaml",
        &yaml::docs(&[attach("vm2", "green", &vm2, "10.21.0.12/16")]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);

    let _vm1_server = Server(vm1.ns.spawn(&["python3", "-c", &echo_server(8080)]));
    let _node_server = Server(node.ns.spawn(&["python3", "-c", &echo_server(8081)]));

    // The Primary network's endpoint: reached by ping and TCP from the
    // node's own address, and it reaches the node in turn.
    wait_for("the node's route to vm1", Duration::from_secs(10), || {
        node_routes(&node).contains("10.20.0.11")
    });
    let routes = node_routes(&node);
    assert!(
        routes.contains(&format!("10.20.0.11 dev {} scope link", vm1.port)),
        "the node's route to vm1 goes down its port:\n{routes}"
    );
    assert!(
        !routes.contains("10.21.0.12"),
        "the Secondary network's endpoint has no route from the node:\n{routes}"
    );
    wait_for("the node pings vm1", Duration::from_secs(10), || {
        pings(&node.ns, "10.20.0.11")
    });
    wait_for(
        "vm1's TCP server, from the node",
        Duration::from_secs(10),
        || tcp_echo(&node.ns, "10.20.0.11", 8080),
    );
    assert!(
        tcp_echo(&vm1.ns, NODE_IP, 8081),
        "vm1 opens a connection to the node while no policy isolates it"
    );
    // A Secondary network's endpoint is not the node's business.
    assert!(
        !pings(&node.ns, "10.21.0.12"),
        "the node must not reach the Secondary network's vm2"
    );

    // Deny everything, both ways, for every endpoint of namespace prod.
    node.write_config("policy.yaml", DENY_ALL_PROD);
    wait_for(
        "vm1's egress isolation towards the node",
        Duration::from_secs(10),
        || !tcp_echo(&vm1.ns, NODE_IP, 8081),
    );
    assert!(
        node.drops(drop_reason::POLICY_DENIED_EGRESS) > 0,
        "vm1's connection to the node is counted as policy_denied_egress"
    );
    // The node still reaches vm1, with replies, as Kubernetes lets a pod's
    // own node do whatever its policy.
    assert!(
        pings(&node.ns, "10.20.0.11"),
        "the node pings vm1 under deny-all"
    );
    assert!(
        tcp_echo(&node.ns, "10.20.0.11", 8080),
        "the node's TCP probe reaches vm1 under deny-all"
    );

    // vm1 gone: so is the node's route to it.
    node.remove_config("vm1.yaml");
    wait_for(
        "the node's route to vm1 withdrawn",
        Duration::from_secs(10),
        || !node_routes(&node).contains("10.20.0.11"),
    );
    assert!(!pings(&node.ns, "10.20.0.11"), "no route, no reach");
}

/// A TCP echo server on `port` of every IPv6 address, printing "ready".
fn echo_server6(port: u16) -> String {
    format!(
        "import socket\ns = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('::', {port})); s.listen(16); print('ready', flush=True)\n\
         while True:\n    c, _ = s.accept(); c.sendall(c.recv(100)); c.close()\n"
    )
}

/// Our IPv6 routes in the node's main table (`proto 250`), one per line.
fn node_routes6(node: &Node) -> String {
    node.ns
        .run(&["ip", "-6", "route", "show", "table", "main", "proto", "250"])
}

/// The same reach over IPv6: a dual-stack Primary network, the node with
/// an IPv6 address of its own. The node pings and opens TCP to the
/// endpoint's IPv6 address down its port, the endpoint answers through
/// its IPv6 gateway into the node's stack, and under deny-all the node
/// still reaches it while the endpoint's own connections to the node are
/// denied.
#[test]
fn the_node_reaches_endpoints_of_a_primary_network_over_ipv6() {
    const NODE_IP6: &str = "2001:db8:2::10";
    const VM_IP6: &str = "fd20::11";
    let mut node = Node::new("n6");
    enable_forwarding(&node.ns);
    // Both ends up: an IPv6 address needs a link with carrier, as a
    // node's NIC has.
    node.ns.run(&[
        "ip",
        "link",
        "add",
        "nodeip",
        "type",
        "veth",
        "peer",
        "name",
        "nodeip-peer",
    ]);
    node.ns.run(&["ip", "link", "set", "nodeip-peer", "up"]);
    node.ns.run(&[
        "ip",
        "addr",
        "add",
        &format!("{NODE_IP6}/128"),
        "dev",
        "nodeip",
        "nodad",
    ]);
    node.ns.run(&["ip", "link", "set", "nodeip", "up"]);
    let vm1: Vm = node.add_vm(
        "vm1",
        "02:6e:72:00:06:01",
        &["10.20.0.11/16", &format!("{VM_IP6}/64")],
        Some("10.20.0.1"),
    );
    vm1.ns
        .run(&["ip", "-6", "route", "add", "default", "via", "fd20::1"]);
    let network = format!(
        "{}  role: Primary\n",
        yaml::network(
            "blue",
            100,
            &["10.20.0.0/16", "fd20::/64"],
            &["10.20.0.1", "fd20::1"],
            true
        )
    );
    node.write_config("networks.yaml", &network);
    node.write_config(
        "vm1.yaml",
        &yaml::attachment(
            "vm1",
            "blue",
            &node.name,
            &vm1.port,
            &vm1.mac,
            &["10.20.0.11/16", &format!("{VM_IP6}/64")],
        ),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port]);

    let _vm1_server = Server(vm1.ns.spawn(&["python3", "-c", &echo_server6(8080)]));
    let _node_server = Server(node.ns.spawn(&["python3", "-c", &echo_server6(8081)]));

    wait_for(
        "the node's IPv6 route to vm1",
        Duration::from_secs(10),
        || node_routes6(&node).contains(VM_IP6),
    );
    let routes = node_routes6(&node);
    assert!(
        routes.contains(&format!("{VM_IP6} dev {} ", vm1.port)),
        "the node's IPv6 route to vm1 goes down its port:\n{routes}"
    );
    let neigh = node.ns.run(&["ip", "-6", "neigh", "show", VM_IP6]);
    assert!(
        neigh.contains(&vm1.mac) && neigh.contains("PERMANENT"),
        "a permanent neighbour entry with vm1's MAC: {neigh}"
    );
    wait_for(
        "the node pings vm1 over IPv6",
        Duration::from_secs(10),
        || pings(&node.ns, VM_IP6),
    );
    wait_for(
        "vm1's TCP server over IPv6, from the node",
        Duration::from_secs(10),
        || tcp_echo(&node.ns, VM_IP6, 8080),
    );
    assert!(
        tcp_echo(&vm1.ns, NODE_IP6, 8081),
        "vm1 opens an IPv6 connection to the node while no policy isolates it"
    );

    node.write_config("policy.yaml", DENY_ALL_PROD);
    wait_for(
        "vm1's IPv6 egress isolation towards the node",
        Duration::from_secs(10),
        || !tcp_echo(&vm1.ns, NODE_IP6, 8081),
    );
    assert!(
        node.drops(drop_reason::POLICY_DENIED_EGRESS) > 0,
        "vm1's IPv6 connection to the node is counted as policy_denied_egress"
    );
    assert!(
        pings(&node.ns, VM_IP6),
        "the node pings vm1 over IPv6 under deny-all"
    );
    assert!(
        tcp_echo(&node.ns, VM_IP6, 8080),
        "the node's IPv6 TCP probe reaches vm1 under deny-all"
    );

    node.remove_config("vm1.yaml");
    wait_for(
        "the node's IPv6 route to vm1 withdrawn",
        Duration::from_secs(10),
        || !node_routes6(&node).contains(VM_IP6),
    );
    assert!(!pings(&node.ns, VM_IP6), "no route, no reach");
}
