//! ClusterIP Services with real connections: a pod-like client (a plain
//! network namespace, as a pod's sandbox) and a VM-like client (another
//! endpoint with its own kernel stack behind its port) reach a Service
//! of three backends on the network over TCP and UDP, through the
//! ClusterIP; every backend answers with its name, so the client sees
//! where each connection went. Also: sessionAffinity ClientIP, a client
//! reaching itself through its own Service, a backend becoming not ready
//! (no new flows, its established one goes on), and a Service without
//! backends (connection refused, ICMP port unreachable).

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    process::{Child, ChildStdin, ChildStdout, Stdio},
    time::Duration,
};

use vmpath_tests::{Node, SCAPY_PYTHON, Vm, vmpath::common::drop_reason, wait_for};

const NET: u32 = 520;
const VIP: &str = "10.96.0.10";
const VIP_STICKY: &str = "10.96.0.11";
const VIP_SELF: &str = "10.96.0.12";
const VIP_EMPTY: &str = "10.96.0.13";
const GW: &str = "10.52.255.1";
const BACKENDS: [(&str, &str); 3] = [
    ("b1", "10.52.0.11"),
    ("b2", "10.52.0.12"),
    ("b3", "10.52.0.13"),
];
/// Connections (and datagrams) per client and protocol.
const ROUNDS: usize = 90;

/// Answers on TCP 8080 with its name then echoes; on UDP 8080 with its
/// name.
const SERVER: &str = r#"
import socket, sys, threading
name = sys.argv[1].encode()
def serve(c):
    try:
        c.sendall(name + b"\n")
        while True:
            d = c.recv(100)
            if not d: break
            c.sendall(d)
    except OSError: pass
    c.close()
def tcp():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8080)); s.listen(512)
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 8080))
    while True:
        d, a = s.recvfrom(100); s.sendto(name, a)
threading.Thread(target=tcp, daemon=True).start()
threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// argv: ip proto port count. One new connection (or a new socket's
/// datagram) per round; prints per round the backend's name and the
/// address the answer came from, or the error (`refused`, `timeout`).
const CLIENT: &str = r#"
import socket, sys
ip, proto, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for _ in range(n):
    try:
        if proto == "tcp":
            s = socket.create_connection((ip, port), timeout=2)
            s.settimeout(2)
            name = s.makefile().readline().strip()
            peer = s.getpeername()
            print(name, "%s:%d" % peer)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)
            s.connect((ip, port))
            got = None
            for _ in range(3):
                s.send(b"q")
                try:
                    got = s.recvfrom(100); break
                except socket.timeout: pass
            if got is None: print("timeout", flush=True); continue
            print(got[0].decode(), "%s:%d" % got[1])
        s.close()
    except ConnectionRefusedError: print("refused")
    except socket.timeout: print("timeout")
    except OSError as e: print("error", e)
    sys.stdout.flush()
"#;

/// Holds one TCP connection to argv[1]:argv[2]: prints the backend's
/// name, then on each line of stdin sends a byte and prints whether it
/// came back.
const HOLDER: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
f = s.makefile()
print(f.readline().strip(), flush=True)
for line in sys.stdin:
    try:
        s.sendall(b"y"); ok = s.recv(10) == b"y"
    except OSError: ok = False
    print("ok" if ok else "no", flush=True)
"#;

struct Bed {
    node: Node,
    backends: Vec<(String, String, Vm)>,
    pod: Vm,
    vm: Vm,
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

fn attachment(name: &str, vm: &Vm, ip: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: default, labels: {{app: {name}}}}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: svc\n  node: a\n  port: {port}\n  mac: \"{mac}\"\n  ips: [\"{ip}/16\"]\n",
        port = vm.port,
        mac = vm.mac,
    )
}

fn service(name: &str, vip: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: ClusterIP\n  clusterIP: {vip}\n  clusterIPs: [{vip}]\n  ports:\n  - {{name: http, port: 80, targetPort: http, protocol: TCP}}\n  - {{name: dns, port: 53, targetPort: 8080, protocol: UDP}}\n{extra}"
    )
}

/// An EndpointSlice of Service `svc` with `endpoints` (address, ready).
fn slice(svc: &str, endpoints: &[(&str, bool)]) -> String {
    let mut eps = String::new();
    for (ip, ready) in endpoints {
        eps.push_str(&format!(
            "- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}, serving: {ready}, terminating: false}}\n"
        ));
    }
    let eps = if endpoints.is_empty() {
        "endpoints: []\n".to_string()
    } else {
        format!("endpoints:\n{eps}")
    };
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-abcde\n  namespace: default\n  labels: {{kubernetes.io/service-name: {svc}}}\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 8080, protocol: UDP}}\n{eps}"
    )
}

fn bed() -> Bed {
    let mut node = Node::new("a");
    let mut backends = Vec::new();
    let mut docs = vec![
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: svc}\nspec: {id: 520, subnets: [10.52.0.0/16], defaultGatewayIPs: [10.52.255.1], ipam: {mode: Disabled}}\n".to_string(),
    ];
    for (i, (name, ip)) in BACKENDS.iter().enumerate() {
        let vm = node.add_vm(
            name,
            &format!("52:54:00:52:00:{:02x}", i + 1),
            &[&format!("{ip}/16")],
            Some(GW),
        );
        docs.push(attachment(name, &vm, ip));
        backends.push((name.to_string(), ip.to_string(), vm));
    }
    let pod = node.add_vm("pod", "52:54:00:52:01:01", &["10.52.0.21/16"], Some(GW));
    let vm = node.add_vm("vm", "52:54:00:52:01:02", &["10.52.0.22/16"], Some(GW));
    docs.push(attachment("pod", &pod, "10.52.0.21"));
    docs.push(attachment("vm", &vm, "10.52.0.22"));
    node.write_config("base.yaml", &docs.join("---\n"));
    node.start_agent();
    let mut ports: Vec<&str> = backends.iter().map(|(_, _, v)| v.port.as_str()).collect();
    ports.push(&pod.port);
    ports.push(&vm.port);
    node.wait_ports(&ports);
    let mut servers = Vec::new();
    for (name, _, vm) in &backends {
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
        pod,
        vm,
        servers,
    }
}

impl Bed {
    /// Writes the Services file and waits until the data path has
    /// `want` (ClusterIP, port, protocol number, ready backends).
    fn services(&self, yaml: &str, want: &[(&str, u16, u8, u32)]) {
        self.node.write_config("services.yaml", yaml);
        wait_for(
            "the Services to be programmed",
            Duration::from_secs(10),
            || {
                want.iter()
                    .all(|w| self.programmed(w.0, w.1, w.2) == Some(w.3))
            },
        );
    }

    /// The ready backends the data path has for a Service port.
    fn programmed(&self, vip: &str, port: u16, proto: u8) -> Option<u32> {
        let ip: std::net::Ipv4Addr = vip.parse().unwrap();
        let key = vmpath_tests::vmpath::common::ServiceKey::new(NET, ip.octets(), port, proto);
        let maps = self.node.maps();
        maps.services
            .iter()
            .filter_map(|r| r.ok())
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.count)
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

    fn ip_of(&self, name: &str) -> &str {
        &self.backends.iter().find(|b| b.0 == name).unwrap().1
    }
}

/// Backend name -> answers, checking every answer came from `vip`:`port`.
fn tally(lines: &[String], vip: &str, port: u16) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for l in lines {
        let mut parts = l.split_whitespace();
        let name = parts.next().unwrap_or_default().to_string();
        let from = parts.next().unwrap_or_default();
        assert!(
            BACKENDS.iter().any(|(b, _)| *b == name),
            "an answer that names no backend: {l:?}"
        );
        assert_eq!(
            from,
            format!("{vip}:{port}"),
            "answer not from the ClusterIP: {l:?}"
        );
        *by.entry(name).or_insert(0) += 1;
    }
    by
}

fn all_services(extra_empty: bool) -> String {
    let ready: Vec<(&str, bool)> = BACKENDS.iter().map(|(_, ip)| (*ip, true)).collect();
    let mut docs = vec![
        service("web", VIP, ""),
        slice("web", &ready),
        service(
            "sticky",
            VIP_STICKY,
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}\n",
        ),
        slice("sticky", &ready),
        service("self", VIP_SELF, ""),
        slice("self", &[("10.52.0.11", true)]),
    ];
    if extra_empty {
        docs.push(service("empty", VIP_EMPTY, ""));
        docs.push(slice("empty", &[]));
    }
    docs.join("---\n")
}

#[test]
fn clients_reach_a_three_backend_service_evenly_sticky_and_hairpinned() {
    let bed = bed();
    bed.services(
        &all_services(false),
        &[
            (VIP, 80, 6, 3),
            (VIP, 53, 17, 3),
            (VIP_STICKY, 80, 6, 3),
            (VIP_SELF, 80, 6, 1),
        ],
    );
    for (client, label) in [(&bed.pod, "pod"), (&bed.vm, "vm")] {
        for (proto, port) in [("tcp", 80), ("udp", 53)] {
            let lines = Bed::rounds(client, VIP, proto, port, ROUNDS);
            let by = tally(&lines, VIP, port);
            // A fair share is 30 each; a backend with fewer than 12 of 90
            // random picks is as good as never (p < 1e-4).
            for (b, _) in BACKENDS {
                let got = by.get(b).copied().unwrap_or(0);
                assert!(
                    got >= 12,
                    "{label} over {proto}: backend {b} got {got} of {ROUNDS}: {by:?}"
                );
            }
        }
        // sessionAffinity ClientIP: every connection to one backend.
        let lines = Bed::rounds(client, VIP_STICKY, "tcp", 80, 30);
        let by = tally(&lines, VIP_STICKY, 80);
        assert_eq!(by.len(), 1, "{label}: affinity did not hold: {by:?}");
    }
    // The two clients are two clients: their sticky backends are chosen
    // independently, and each keeps its own (checked above).

    // A backend reaching itself through its own Service (hairpin).
    let b1 = &bed.backends[0].2;
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        let lines = Bed::rounds(b1, VIP_SELF, proto, port, 5);
        let by = tally(&lines, VIP_SELF, port);
        assert_eq!(by.get("b1"), Some(&5), "hairpin over {proto}: {lines:?}");
    }
}

struct Holder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    backend: String,
}

impl Holder {
    fn open(from: &Vm, ip: &str, port: u16) -> Holder {
        let mut child =
            from.ns
                .command_piped(&[SCAPY_PYTHON, "-u", "-c", HOLDER, ip, &port.to_string()]);
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        Holder {
            child,
            stdin,
            stdout,
            backend: line.trim().to_string(),
        }
    }

    fn still_up(&mut self) -> bool {
        writeln!(self.stdin, "x").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim() == "ok"
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

trait CommandPiped {
    fn command_piped(&self, args: &[&str]) -> Child;
}

impl CommandPiped for vmpath_tests::Netns {
    fn command_piped(&self, args: &[&str]) -> Child {
        std::process::Command::new("nsenter")
            .arg(format!("--net={}", self.path()))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }
}

#[test]
fn a_backend_not_ready_gets_no_new_flows_and_no_backend_rejects() {
    let bed = bed();
    bed.services(
        &all_services(true),
        &[(VIP, 80, 6, 3), (VIP, 53, 17, 3), (VIP_EMPTY, 80, 6, 0)],
    );
    // An established connection to b3, to see it outlive b3's readiness.
    let mut held = (0..60)
        .map(|_| Holder::open(&bed.vm, VIP, 80))
        .find(|h| h.backend == "b3")
        .expect("no connection of 60 landed on b3");
    assert!(held.still_up());

    // b3 turns not ready: no new flow goes to it.
    let not_ready = all_services(true).replace(
        &slice(
            "web",
            &BACKENDS
                .iter()
                .map(|(_, ip)| (*ip, true))
                .collect::<Vec<_>>(),
        ),
        &slice(
            "web",
            &[
                (bed.ip_of("b1"), true),
                (bed.ip_of("b2"), true),
                (bed.ip_of("b3"), false),
            ],
        ),
    );
    bed.services(&not_ready, &[(VIP, 80, 6, 2), (VIP, 53, 17, 2)]);
    for (proto, port) in [("tcp", 80), ("udp", 53)] {
        let lines = Bed::rounds(&bed.pod, VIP, proto, port, 45);
        let by = tally(&lines, VIP, port);
        assert_eq!(
            by.get("b3"),
            None,
            "a not-ready backend got new {proto} flows: {by:?}"
        );
        assert!(by.contains_key("b1") && by.contains_key("b2"), "{by:?}");
    }
    assert!(held.still_up(), "the established connection to b3 broke");

    // b3 removed from the slice altogether: still no new flows.
    let removed = not_ready.replace(
        &format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: false, serving: false, terminating: false}}\n",
            bed.ip_of("b3")
        ),
        "",
    );
    assert_ne!(removed, not_ready);
    bed.services(&removed, &[(VIP, 80, 6, 2)]);
    let by = tally(&Bed::rounds(&bed.vm, VIP, "tcp", 80, 30), VIP, 80);
    assert_eq!(
        by.get("b3"),
        None,
        "a removed backend got new flows: {by:?}"
    );

    // No backend at all: refused, as kube-proxy rejects.
    let before = bed.node.drops(drop_reason::SERVICE_NO_BACKEND);
    for (client, label) in [(&bed.pod, "pod"), (&bed.vm, "vm")] {
        for (proto, port) in [("tcp", 80), ("udp", 53)] {
            let lines = Bed::rounds(client, VIP_EMPTY, proto, port, 3);
            assert!(
                lines.iter().all(|l| l == "refused"),
                "{label} over {proto} to a Service without backends: {lines:?}"
            );
        }
    }
    let counted = bed.node.drops(drop_reason::SERVICE_NO_BACKEND) - before;
    assert!(
        counted >= 12,
        "service_no_backend counted {counted}, want >= 12"
    );
}

/// `--source kubernetes`: a Service and its EndpointSlice from the API
/// server. The KubeVirt VM of the cluster fixtures (vm1, 10.31.0.11)
/// serves it; the plain pod web-0 on the same network consumes it
/// through the ClusterIP.
#[test]
fn a_pod_reaches_a_vm_through_a_service_from_the_api_server() {
    use serde_json::json;
    use vmpath_tests::{Netns, kube_api::ApiServer, multus, unique_tag};

    const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
    const VM: &str = include_str!("../../agent/src/derive/fixtures/vm.yaml");
    const LAUNCHER: &str = "virt-launcher-vm1-x7k2p";
    const LAUNCHER_IFNAME: &str = "pod16477688c0e";
    const CLUSTER_IP: &str = "10.96.31.10";

    let mut node = Node::new("ks");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    let server = ApiServer::start(&node.ns.path());
    for text in [NETWORK, VM] {
        let text = text.replace("node-a", &node.name);
        for o in vmpath::config::source::parse(text.as_bytes()).unwrap() {
            // The v1 Node's address is not in the test bed: no overlay.
            if o["kind"] != "Node" {
                server.put(o);
            }
        }
    }
    server.put(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "prod", "uid": "uid-web-0",
                     "annotations": {"k8s.v1.cni.cncf.io/networks": "prod/blue"}},
        "spec": {"nodeName": node.name, "containers": [{"name": "web", "image": "busybox"}]},
        "status": {"phase": "Running"},
    }));
    // Its IPAMClaim as vmpath controller makes and allocates it.
    server.put(json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        "metadata": {"name": "web-0.net1", "namespace": "prod",
                     "labels": {"vmpath.dev/pod-uid": "uid-web-0"}},
        "spec": {"network": "blue", "interface": "net1"},
        "status": {"ips": ["10.31.0.20/24"]},
    }));
    // As the API server holds them (the EndpointSlice controller wrote
    // the slice from the virt-launcher pod the Service selects).
    server.put(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "vm1-http", "namespace": "prod", "uid": "5c1e0000-0000-4000-8000-000000000001"},
        "spec": {"type": "ClusterIP", "clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP],
                 "selector": {"kubevirt.io/domain": "vm1"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
                 "sessionAffinity": "None", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack"},
        "status": {"loadBalancer": {}},
    }));
    server.put(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "vm1-http-x8d2k", "namespace": "prod",
                     "labels": {"kubernetes.io/service-name": "vm1-http",
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.31.0.11"],
                       "conditions": {"ready": true, "serving": true, "terminating": false},
                       "nodeName": node.name,
                       "targetRef": {"kind": "Pod", "name": LAUNCHER, "namespace": "prod"}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }));
    server.vouch_for_claims();
    server.serve_agent_of(&mut node);
    node.start_agent();

    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let web = Netns::new(format!("vt{tag}-web"));
    wait_for(
        "the agent to list the cluster",
        // After the data path loads: a minute and more on a busy machine.
        Duration::from_secs(120),
        || {
            node.status()
                .is_some_and(|s| s["attachments"].as_array().is_some_and(|a| a.len() >= 2))
        },
    );
    for (pod, ifname, netns) in [
        (LAUNCHER, LAUNCHER_IFNAME, &launcher),
        ("web-0", "net1", &web),
    ] {
        let (ok, result) = multus::call(
            &node,
            "ADD",
            &multus::Call {
                conf: &conf,
                pod_namespace: "prod",
                pod,
                ifname,
                netns,
                container: &format!("c{tag}{pod}"),
            },
        );
        assert!(ok, "ADD of {pod}: {result}");
    }
    for cmd in [
        vec![
            "ip",
            "link",
            "set",
            LAUNCHER_IFNAME,
            "address",
            "02:00:00:31:00:0b",
        ],
        vec!["ip", "addr", "add", "10.31.0.11/24", "dev", LAUNCHER_IFNAME],
        vec!["ip", "link", "set", LAUNCHER_IFNAME, "up"],
    ] {
        launcher.run(&cmd);
    }
    // The pod routes ClusterIPs to its network's gateway.
    web.run(&["ip", "route", "add", "10.96.0.0/12", "via", "10.31.0.1"]);
    let mut server_proc = launcher.spawn(&[SCAPY_PYTHON, "-u", "-c", SERVER, "vm1"]);
    let mut line = String::new();
    BufReader::new(server_proc.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let key = vmpath_tests::vmpath::common::ServiceKey::new(310, [10, 96, 31, 10], 80, 6);
    wait_for(
        "the Service to be programmed",
        Duration::from_secs(30),
        || {
            node.maps()
                .services
                .iter()
                .filter_map(|r| r.ok())
                .any(|(k, v)| k == key && v.count == 1)
        },
    );
    let vm = Vm {
        ns: web,
        port: String::new(),
        mac: String::new(),
    };
    let lines = Bed::rounds(&vm, CLUSTER_IP, "tcp", 80, 5);
    let _ = server_proc.kill();
    let _ = server_proc.wait();
    for l in &lines {
        assert_eq!(l, &format!("vm1 {CLUSTER_IP}:80"), "{lines:?}");
    }
}

/// Egress policy runs after the translation, so it sees the backend (as
/// in Cilium): a client allowed to reach only b1 reaches a Service whose
/// backend is b1 through its ClusterIP, and not one whose backend is b2.
#[test]
fn egress_policy_sees_the_backend_not_the_cluster_ip() {
    let bed = bed();
    let only = |svc: &str, vip: &str, ip: &str| {
        [service(svc, vip, ""), slice(svc, &[(ip, true)])].join("---\n")
    };
    bed.services(
        &[
            only("to-b1", VIP_SELF, bed.ip_of("b1")),
            only("to-b2", VIP_EMPTY, bed.ip_of("b2")),
        ]
        .join("---\n"),
        &[(VIP_SELF, 80, 6, 1), (VIP_EMPTY, 80, 6, 1)],
    );
    bed.node.write_config(
        "policy.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: pod-to-b1, namespace: default}\nspec:\n  podSelector: {matchLabels: {app: pod}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{podSelector: {matchLabels: {app: b1}}}]\n    ports: [{port: 8080, protocol: TCP}]\n",
    );
    wait_for(
        "the policy to be programmed",
        Duration::from_secs(10),
        || {
            bed.node.status().is_some_and(|s| {
                s["policies"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|p| p == "default/pod-to-b1"))
            })
        },
    );
    let lines = Bed::rounds(&bed.pod, VIP_SELF, "tcp", 80, 3);
    assert_eq!(
        tally(&lines, VIP_SELF, 80).get("b1"),
        Some(&3),
        "allowed backend: {lines:?}"
    );
    let denied = bed.node.drops(drop_reason::POLICY_DENIED_EGRESS);
    let lines = Bed::rounds(&bed.pod, VIP_EMPTY, "tcp", 80, 1);
    assert_eq!(lines, ["timeout"], "a backend policy does not allow");
    assert!(bed.node.drops(drop_reason::POLICY_DENIED_EGRESS) > denied);
    // The VM client, which no policy selects, reaches both.
    assert_eq!(
        Bed::rounds(&bed.vm, VIP_EMPTY, "tcp", 80, 1)[0],
        format!("b2 {VIP_EMPTY}:80")
    );
}

/// A Service of `n` TCP ports (1..=n) in namespace `ns`, without slices.
fn huge_service(ns: &str, vip: &str, n: u16) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: huge, namespace: {ns}}}\nspec:\n  clusterIP: {vip}\n  ports:\n"
    );
    for p in 1..=n {
        yaml.push_str(&format!("  - {{name: p{p}, port: {p}}}\n"));
    }
    yaml
}

#[test]
fn a_huge_service_in_another_namespace_leaves_a_working_one_translated() {
    let bed = bed();
    let want = [(VIP, 80, 6, 3), (VIP, 53, 17, 3)];
    bed.services(&all_services(false), &want);
    let by = tally(&Bed::rounds(&bed.pod, VIP, "tcp", 80, 9), VIP, 80);
    assert_eq!(by.values().sum::<usize>(), 9);
    // "aaa" sorts before "default"; 17,000 ports are more Service ports
    // than the data path holds.
    bed.node
        .write_config("huge.yaml", &huge_service("aaa", "10.96.1.1", 17_000));
    let problems = || -> Vec<String> {
        bed.node
            .status()
            .and_then(|s| s["problems"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p.as_str().map(str::to_string))
            .filter(|p| p.contains("aaa/huge"))
            .collect()
    };
    wait_for(
        "the huge Service to be reported",
        Duration::from_secs(30),
        || !problems().is_empty(),
    );
    let problems = problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("of its 17000 ports not translated"),
        "{problems:?}"
    );
    // The working Service is still programmed, and still answers.
    for (vip, port, proto, count) in want {
        assert_eq!(
            bed.programmed(vip, port, proto),
            Some(count),
            "{vip}:{port}"
        );
    }
    let lines = Bed::rounds(&bed.pod, VIP, "tcp", 80, 9);
    let by = tally(&lines, VIP, 80);
    assert_eq!(by.values().sum::<usize>(), 9, "{lines:?}");
    // The huge one got what was left.
    assert!(bed.programmed("10.96.1.1", 1, 6).is_some());
}
