//! IPv6 and dual-stack ClusterIP Services with real connections: three
//! dual-stack backends and a dual-stack client (each a namespace with
//! its own kernel stack behind its port) on a network with an IPv4 and
//! an IPv6 subnet. A `RequireDualStack` Service has a ClusterIP of each
//! family and an EndpointSlice of each family; the client reaches it
//! over TCP and UDP through both ClusterIPs, and every backend answers
//! with its name and the family it was reached over, so the test sees
//! that each ClusterIP went to that family's backends, spread over all
//! three, answered from the ClusterIP. Also for IPv6: sessionAffinity
//! ClientIP, a backend reaching itself through its own Service
//! (hairpin), and a Service without backends (connection refused by a
//! TCP reset, and by an ICMPv6 port unreachable for UDP).

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    process::Child,
    time::Duration,
};

use vmpath_tests::{Node, SCAPY_PYTHON, Vm, vmpath::common::drop_reason, wait_for};

const NET: u32 = 530;
const VIP4: &str = "10.96.5.10";
const VIP6: &str = "fd00:96::5:10";
const VIP6_STICKY: &str = "fd00:96::5:11";
const VIP6_SELF: &str = "fd00:96::5:12";
const VIP6_EMPTY: &str = "fd00:96::5:13";
const GW4: &str = "10.53.255.1";
const GW6: &str = "fd53::ffff:1";
/// (name, IPv4, IPv6).
const BACKENDS: [(&str, &str, &str); 3] = [
    ("b1", "10.53.0.11", "fd53::11"),
    ("b2", "10.53.0.12", "fd53::12"),
    ("b3", "10.53.0.13", "fd53::13"),
];
/// Connections (and datagrams) per family and protocol.
const ROUNDS: usize = 45;

/// On TCP 8080 and UDP 8080 of both families: answers with its name and
/// the family it was reached over ("b1 v6"), then (TCP) echoes.
const SERVER: &str = r#"
import socket, sys, threading
name = sys.argv[1].encode()
def serve(c, fam):
    try:
        c.sendall(name + b" " + fam + b"\n")
        while True:
            d = c.recv(100)
            if not d: break
            c.sendall(d)
    except OSError: pass
    c.close()
def tcp(af, host, fam):
    s = socket.socket(af); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if af == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((host, 8080)); s.listen(512)
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c, fam), daemon=True).start()
def udp(af, host, fam):
    s = socket.socket(af, socket.SOCK_DGRAM)
    if af == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((host, 8080))
    while True:
        d, a = s.recvfrom(100); s.sendto(name + b" " + fam, a)
for f in (tcp, udp):
    threading.Thread(target=f, args=(socket.AF_INET, "0.0.0.0", b"v4"), daemon=True).start()
    threading.Thread(target=f, args=(socket.AF_INET6, "::", b"v6"), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// argv: ip proto port count. One new connection (or a new socket's
/// datagram) per round; prints per round the backend's name, the family
/// it answered over and the address the answer came from, or the error
/// (`refused`, `timeout`).
const CLIENT: &str = r#"
import socket, sys
ip, proto, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
af = socket.AF_INET6 if ":" in ip else socket.AF_INET
for _ in range(n):
    try:
        if proto == "tcp":
            s = socket.socket(af); s.settimeout(2)
            s.connect((ip, port))
            name = s.makefile().readline().strip()
            peer = s.getpeername()
        else:
            s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(1)
            s.connect((ip, port))
            got = None
            for _ in range(3):
                s.send(b"q")
                try:
                    got = s.recvfrom(100); break
                except socket.timeout: pass
            if got is None: print("timeout", flush=True); continue
            name, peer = got[0].decode(), got[1]
        print(name, "%s/%d" % (peer[0], peer[1]))
        s.close()
    except ConnectionRefusedError: print("refused")
    except socket.timeout: print("timeout")
    except OSError as e: print("error", e)
    sys.stdout.flush()
"#;

struct Bed {
    node: Node,
    backends: Vec<Vm>,
    client: Vm,
    servers: Vec<Child>,
}

impl Drop for Bed {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

fn attachment(name: &str, vm: &Vm, ip4: &str, ip6: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: dual\n  node: a\n  port: {port}\n  mac: \"{mac}\"\n  ips: [\"{ip4}/16\", \"{ip6}/64\"]\n",
        port = vm.port,
        mac = vm.mac,
    )
}

/// A Service on `vips` (its ClusterIPs, in order) with TCP 80 and UDP 53
/// to 8080.
fn service(name: &str, vips: &[&str], extra: &str) -> String {
    let families: Vec<&str> = vips
        .iter()
        .map(|v| if v.contains(':') { "IPv6" } else { "IPv4" })
        .collect();
    let policy = if vips.len() == 2 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    let quoted: Vec<String> = vips.iter().map(|v| format!("\"{v}\"")).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: ClusterIP\n  clusterIP: \"{}\"\n  clusterIPs: [{}]\n  ipFamilies: [{}]\n  ipFamilyPolicy: {policy}\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: 8080, protocol: UDP}}\n{extra}",
        vips[0],
        quoted.join(", "),
        families.join(", ")
    )
}

/// An EndpointSlice of Service `svc`, `family` ("IPv4" or "IPv6"), with
/// these ready addresses.
fn slice(svc: &str, family: &str, addresses: &[&str]) -> String {
    let eps: String = addresses
        .iter()
        .map(|a| format!("- addresses: [\"{a}\"]\n  conditions: {{ready: true}}\n"))
        .collect();
    let eps = if eps.is_empty() {
        "endpoints: []\n".to_string()
    } else {
        format!("endpoints:\n{eps}")
    };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-{}\n  namespace: default\n  labels: {{kubernetes.io/service-name: {svc}}}\naddressType: {family}\n{eps}",
        family.to_lowercase()
    )
}

fn bed() -> Bed {
    let mut node = Node::new("a");
    let mut docs = vec![format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: dual}}\nspec: {{id: {NET}, subnets: [10.53.0.0/16, \"fd53::/64\"], defaultGatewayIPs: [{GW4}, \"{GW6}\"], ipam: {{mode: Disabled}}}}\n"
    )];
    let mut backends = Vec::new();
    let dual = |name: &str, mac: &str, ip4: &str, ip6: &str, docs: &mut Vec<String>| {
        let vm = node.add_vm(
            name,
            mac,
            &[&format!("{ip4}/16"), &format!("{ip6}/64")],
            Some(GW4),
        );
        vm.ns
            .run(&["ip", "-6", "route", "add", "default", "via", GW6]);
        docs.push(attachment(name, &vm, ip4, ip6));
        vm
    };
    for (i, (name, ip4, ip6)) in BACKENDS.iter().enumerate() {
        let mac = format!("52:54:00:53:00:{:02x}", i + 1);
        backends.push(dual(name, &mac, ip4, ip6, &mut docs));
    }
    let client = dual(
        "c",
        "52:54:00:53:01:01",
        "10.53.0.21",
        "fd53::21",
        &mut docs,
    );
    node.write_config("base.yaml", &docs.join("---\n"));
    node.start_agent();
    let mut ports: Vec<&str> = backends.iter().map(|v| v.port.as_str()).collect();
    ports.push(&client.port);
    node.wait_ports(&ports);
    let mut servers = Vec::new();
    for (vm, (name, _, _)) in backends.iter().zip(BACKENDS) {
        let mut child = vm.ns.spawn(&[SCAPY_PYTHON, "-u", "-c", SERVER, name]);
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "server on {name}");
        servers.push(child);
    }
    Bed {
        node,
        backends,
        client,
        servers,
    }
}

impl Bed {
    /// Writes the Services file and waits (bounded: the agent may be
    /// slow to start under load) until the data path has `want`
    /// (ClusterIP, port, protocol number, ready backends).
    fn services(&self, yaml: &str, want: &[(&str, u16, u8, u32)]) {
        self.node.write_config("services.yaml", yaml);
        wait_for(
            "the Services to be programmed",
            Duration::from_secs(120),
            || {
                want.iter()
                    .all(|w| self.programmed(w.0, w.1, w.2) == Some(w.3))
            },
        );
    }

    /// The ready backends the data path has for a Service port of
    /// either family.
    fn programmed(&self, vip: &str, port: u16, proto: u8) -> Option<u32> {
        use vmpath_tests::vmpath::common::{ServiceKey, ServiceKey6};
        let maps = self.node.maps();
        match vip.parse::<std::net::IpAddr>().unwrap() {
            std::net::IpAddr::V4(ip) => {
                let key = ServiceKey::new(NET, ip.octets(), port, proto);
                maps.services
                    .iter()
                    .filter_map(|r| r.ok())
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| v.count)
            }
            std::net::IpAddr::V6(ip) => {
                let key = ServiceKey6::new(NET, ip.octets(), port, proto);
                maps.services6
                    .iter()
                    .filter_map(|r| r.ok())
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| v.count)
            }
        }
    }
}

/// `n` rounds from `from` to ip:port over `proto`: one output line each.
fn rounds(from: &Vm, ip: &str, proto: &str, port: u16, n: usize) -> Vec<String> {
    let out = from
        .ns
        .spawn(&[
            SCAPY_PYTHON,
            "-c",
            CLIENT,
            ip,
            proto,
            &port.to_string(),
            &n.to_string(),
        ])
        .wait_with_output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    assert_eq!(lines.len(), n, "rounds from {}: {text}", from.port);
    lines
}

/// Backend name -> answers, checking every answer came over `family`
/// ("v4" or "v6") from `vip`/`port`.
fn tally(lines: &[String], family: &str, vip: &str, port: u16) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for l in lines {
        let parts: Vec<&str> = l.split_whitespace().collect();
        assert!(
            parts.len() == 3 && BACKENDS.iter().any(|(b, _, _)| *b == parts[0]),
            "an answer that names no backend: {l:?}"
        );
        assert_eq!(
            parts[1], family,
            "reached a backend over the other family: {l:?}"
        );
        assert_eq!(
            parts[2],
            format!("{vip}/{port}"),
            "answer not from the ClusterIP: {l:?}"
        );
        *by.entry(parts[0].to_string()).or_insert(0) += 1;
    }
    by
}

fn addresses(v6: bool) -> Vec<&'static str> {
    BACKENDS
        .iter()
        .map(|(_, a4, a6)| if v6 { *a6 } else { *a4 })
        .collect()
}

#[test]
fn a_dual_stack_service_is_reached_over_both_families_with_tcp_and_udp() {
    let bed = bed();
    let docs = [
        service("web", &[VIP4, VIP6], ""),
        slice("web", "IPv4", &addresses(false)),
        slice("web", "IPv6", &addresses(true)),
        service(
            "sticky",
            &[VIP6_STICKY],
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n",
        ),
        slice("sticky", "IPv6", &addresses(true)),
        service("self", &[VIP6_SELF], ""),
        slice("self", "IPv6", &["fd53::11"]),
        service("empty", &[VIP6_EMPTY], ""),
        slice("empty", "IPv6", &[]),
    ];
    bed.services(
        &docs.join("---\n"),
        &[
            (VIP4, 80, 6, 3),
            (VIP4, 53, 17, 3),
            (VIP6, 80, 6, 3),
            (VIP6, 53, 17, 3),
            (VIP6_STICKY, 80, 6, 3),
            (VIP6_SELF, 80, 6, 1),
            (VIP6_EMPTY, 80, 6, 0),
        ],
    );
    // Each ClusterIP to its own family's backends, all three of them.
    for (vip, family) in [(VIP4, "v4"), (VIP6, "v6")] {
        for (proto, port) in [("tcp", 80), ("udp", 53)] {
            let lines = rounds(&bed.client, vip, proto, port, ROUNDS);
            let by = tally(&lines, family, vip, port);
            // A fair share is 15 each; fewer than 4 of 45 random picks
            // is as good as never (p < 1e-3 over the four runs).
            for (b, _, _) in BACKENDS {
                let got = by.get(b).copied().unwrap_or(0);
                assert!(
                    got >= 4,
                    "{vip} over {proto}: backend {b} got {got} of {ROUNDS}: {by:?}"
                );
            }
        }
    }
    // sessionAffinity ClientIP over IPv6: every connection to one backend.
    let by = tally(
        &rounds(&bed.client, VIP6_STICKY, "tcp", 80, 20),
        "v6",
        VIP6_STICKY,
        80,
    );
    assert_eq!(by.len(), 1, "IPv6 affinity did not hold: {by:?}");

    // A backend reaching itself through its own IPv6 Service (hairpin).
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        let lines = rounds(&bed.backends[0], VIP6_SELF, proto, port, 5);
        let by = tally(&lines, "v6", VIP6_SELF, port);
        assert_eq!(
            by.get("b1"),
            Some(&5),
            "IPv6 hairpin over {proto}: {lines:?}"
        );
    }

    // No backend: refused (a reset; an ICMPv6 port unreachable).
    let before = bed.node.drops(drop_reason::SERVICE_NO_BACKEND);
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        let lines = rounds(&bed.client, VIP6_EMPTY, proto, port, 3);
        assert!(
            lines.iter().all(|l| l == "refused"),
            "{proto} to an IPv6 Service without backends: {lines:?}"
        );
    }
    let counted = bed.node.drops(drop_reason::SERVICE_NO_BACKEND) - before;
    assert!(
        counted >= 6,
        "service_no_backend counted {counted}, want >= 6"
    );
}
