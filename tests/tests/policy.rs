//! NetworkPolicy reachability matrices, in the style of Kubernetes'
//! netpol e2e: namespaces x, y, z with endpoints a, b, c in each, TCP and
//! UDP on ports 80 and 81. For each policy case every endpoint tries every
//! other on every port with a real connection, and the whole matrix is
//! compared with the one the case expects. One bed for all cases; the
//! probes of a case run at once.

use std::{
    collections::BTreeMap,
    process::{Child, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use vmpath_tests::{Netns, Node, SCAPY_PYTHON, Vm, multus, vmpath::common::drop_reason, wait_for};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const PODS: [&str; 3] = ["a", "b", "c"];
const PROBES: [(&str, u16); 4] = [("tcp", 80), ("tcp", 81), ("udp", 80), ("udp", 81)];

/// Echo servers on TCP and UDP 80, 81 and 53, one thread each.
const SERVER: &str = r#"
import socket, threading
def serve(c):
    try:
        while True:
            d = c.recv(100)
            if not d: break
            c.sendall(d)
    except OSError: pass
    c.close()
def tcp(p):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", p)); s.listen(256)
    while True:
        c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
def udp(p):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", p))
    while True:
        d, a = s.recvfrom(100); s.sendto(d, a)
for p in (80, 81, 53):
    threading.Thread(target=tcp, args=(p,), daemon=True).start()
    threading.Thread(target=udp, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// The source port of the next matrix probe: each its own, below the
/// kernel's ephemeral range (32768 and up).
static NEXT_SOURCE_PORT: AtomicU32 = AtomicU32::new(20000);

/// Tries every probe of argv (ip,proto,port[,source port] ...) at once;
/// prints one line per probe: ok or no.
const CLIENT: &str = r#"
import socket, sys, threading
probes = [a.split(",") for a in sys.argv[1:]]
out = [None] * len(probes)
def probe(i, ip, proto, port, sport="0"):
    ok = False
    try:
        src = ("0.0.0.0", int(sport))
        if proto == "tcp":
            s = socket.create_connection((ip, int(port)), timeout=1.5, source_address=src)
            s.settimeout(1.5); s.sendall(b"x"); ok = s.recv(10) == b"x"; s.close()
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.7)
            s.bind(src)
            for _ in range(2):
                s.sendto(b"x", (ip, int(port)))
                try:
                    ok = s.recvfrom(10)[0] == b"x"; break
                except socket.timeout: pass
            s.close()
    except OSError: pass
    out[i] = ok
ts = [threading.Thread(target=probe, args=(i, *p)) for i, p in enumerate(probes)]
for t in ts: t.start()
for t in ts: t.join()
for o in out: print("ok" if o else "no")
"#;

/// Holds a TCP connection to argv[1]:argv[2] open; on each line of stdin
/// sends a byte and prints whether it came back.
const HOLDER: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
print("open", flush=True)
for line in sys.stdin:
    try:
        s.sendall(b"y"); ok = s.recv(10) == b"y"
    except OSError: ok = False
    print("ok" if ok else "no", flush=True)
"#;

struct Endpoint {
    ns: &'static str,
    pod: &'static str,
    /// A VM's namespace and port; for a pod, its network namespace and
    /// the port `vmpath-cni` made for it.
    vm: Vm,
    ip: String,
    /// A plain pod whose interface the runtime created through vmpath-cni
    /// (its labels and named ports from its Pod object), not a VM.
    is_pod: bool,
}

impl Endpoint {
    fn name(&self) -> String {
        format!("{}/{}", self.ns, self.pod)
    }
}

struct Bed {
    node: Node,
    endpoints: Vec<Endpoint>,
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

fn ip_of(n: usize, p: usize) -> String {
    format!("10.51.{n}.{}", p + 10)
}

/// One of each namespace's endpoints is a pod, the others VMs.
fn is_pod(n: usize, p: usize) -> bool {
    (n + p) % 3 == 1
}

/// The NetworkAttachmentDefinition of network pol in `ns`.
fn nad(ns: &str) -> String {
    format!(
        "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {{name: pol, namespace: {ns}}}\nspec:\n  config: '{{\"cniVersion\": \"1.1.0\", \"name\": \"pol\", \"type\": \"vmpath-cni\", \"network\": \"pol\"}}'\n"
    )
}

/// A plain pod on network pol with its address (a Multus selection's
/// `ips`), its labels and the named port its container declares.
fn pod_doc(ns: &str, pod: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod}\n  namespace: {ns}\n  labels: {{pod: {pod}}}\n  annotations: {{k8s.v1.cni.cncf.io/networks: '[{{\"name\": \"pol\", \"interface\": \"eth0\", \"ips\": [\"{ip}/16\"]}}]'}}\nspec:\n  nodeName: a\n  containers: [{{name: serve, image: busybox, ports: [{{name: serve-81-udp, containerPort: 81, protocol: UDP}}]}}]\nstatus: {{phase: Running}}\n"
    )
}

fn base_config(endpoints: &[Endpoint]) -> String {
    let mut docs = vec![
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: pol}\nspec: {id: 510, subnets: [10.51.0.0/16], defaultGatewayIPs: [10.51.255.1], ipam: {mode: Disabled}}\n".to_string(),
    ];
    for ns in NAMESPACES {
        docs.push(format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}, labels: {{ns: {ns}}}}}\n"
        ));
        docs.push(nad(ns));
    }
    for e in endpoints {
        if e.is_pod {
            docs.push(pod_doc(e.ns, e.pod, &e.ip));
            continue;
        }
        docs.push(format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {pod}, namespace: {ns}, labels: {{pod: {pod}}}}}\nspec:\n  vm: {pod}\n  interface: eth0\n  network: pol\n  node: a\n  port: {port}\n  mac: \"{mac}\"\n  ips: [\"{ip}/16\"]\n  ports: [{{name: serve-81-udp, port: 81, protocol: UDP}}]\n",
            pod = e.pod,
            ns = e.ns,
            port = e.vm.port,
            mac = e.vm.mac,
            ip = e.ip,
        ));
    }
    docs.join("---\n")
}

fn bed() -> Bed {
    let mut node = Node::new("a");
    let mut endpoints = Vec::new();
    let mut pods = Vec::new();
    for (n, ns) in NAMESPACES.iter().enumerate() {
        for (p, pod) in PODS.iter().enumerate() {
            let ip = ip_of(n, p);
            if is_pod(n, p) {
                pods.push((*ns, *pod, ip));
                continue;
            }
            let vm = node.add_vm(
                &format!("{ns}{pod}"),
                &format!("52:54:00:51:{n:02x}:{p:02x}"),
                &[&format!("{ip}/16")],
                None,
            );
            endpoints.push(Endpoint {
                ns,
                pod,
                vm,
                ip,
                is_pod: false,
            });
        }
    }
    // The pods' documents go in with the rest: their ports come below.
    let pod_endpoints: Vec<Endpoint> = pods
        .iter()
        .map(|(ns, pod, ip)| Endpoint {
            ns,
            pod,
            vm: Vm {
                ns: Netns::new(format!("vt{}-{ns}{pod}", node.tag)),
                port: String::new(),
                mac: String::new(),
            },
            ip: ip.clone(),
            is_pod: true,
        })
        .collect();
    endpoints.extend(pod_endpoints);
    node.write_config("base.yaml", &base_config(&endpoints));
    node.start_agent();
    let ports: Vec<&str> = endpoints
        .iter()
        .filter(|e| !e.is_pod)
        .map(|e| e.vm.port.as_str())
        .collect();
    node.wait_ports(&ports);
    // The runtime creates each pod's interface through vmpath-cni, with
    // the NAD's config, as Multus does.
    let conf = multus::nad_conf(&nad("x"), &node);
    for e in endpoints.iter_mut().filter(|e| e.is_pod) {
        let container = format!("c{}{}{}", node.tag, e.ns, e.pod);
        let (ok, result) = multus::call(
            &node,
            "ADD",
            &multus::Call {
                conf: &conf,
                pod_namespace: e.ns,
                pod: e.pod,
                ifname: "eth0",
                netns: &e.vm.ns,
                container: &container,
            },
        );
        assert!(ok, "CNI ADD of pod {}/{}: {result}", e.ns, e.pod);
        assert_eq!(
            result["ips"][0]["address"],
            format!("{}/16", e.ip),
            "pod {}/{} has the address its Multus selection asks for: {result}",
            e.ns,
            e.pod
        );
        e.vm.port = result["interfaces"][0]["name"]
            .as_str()
            .unwrap()
            .to_string();
    }
    let mut servers = Vec::new();
    for e in &endpoints {
        let mut child = e.vm.ns.spawn(&[SCAPY_PYTHON, "-u", "-c", SERVER]);
        let mut line = String::new();
        use std::io::BufRead as _;
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "server in {}", e.name());
        servers.push(child);
    }
    Bed {
        node,
        endpoints,
        servers,
    }
}

/// The probes one endpoint runs: their keys and the client process.
type Run<'a> = (&'a Endpoint, Vec<(String, String, String)>, Child);

/// (from, to, "tcp/80") -> reached.
type Matrix = BTreeMap<(String, String, String), bool>;

impl Bed {
    /// Every endpoint to every other on every probe, measured.
    fn measure(&self) -> Matrix {
        let runs: Vec<Run> = self
            .endpoints
            .iter()
            .map(|from| {
                let mut keys = Vec::new();
                let mut args = vec![SCAPY_PYTHON.to_string(), "-c".into(), CLIENT.into()];
                for to in self.endpoints.iter().filter(|t| t.name() != from.name()) {
                    for (proto, port) in PROBES {
                        keys.push((from.name(), to.name(), format!("{proto}/{port}")));
                        // A source port no earlier probe used: a policy
                        // change keeps established flows, so a probe that
                        // happened to reuse an earlier allowed flow's
                        // ports would pass as established.
                        let sport = NEXT_SOURCE_PORT.fetch_add(1, Ordering::Relaxed);
                        args.push(format!("{},{proto},{port},{sport}", to.ip));
                    }
                }
                let argv: Vec<&str> = args.iter().map(String::as_str).collect();
                let child = from.vm.ns.spawn(&argv);
                (from, keys, child)
            })
            .collect();
        let mut m = Matrix::new();
        for (from, keys, child) in runs {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(
                lines.len(),
                keys.len(),
                "probes from {}: {text}",
                from.name()
            );
            for (k, l) in keys.into_iter().zip(lines) {
                m.insert(k, l == "ok");
            }
        }
        m
    }

    /// The matrix `allowed` (from, to, proto, port) says.
    fn expected(&self, allowed: impl Fn(&str, &str, &str, u16) -> bool) -> Matrix {
        let mut m = Matrix::new();
        for from in &self.endpoints {
            for to in self.endpoints.iter().filter(|t| t.name() != from.name()) {
                for (proto, port) in PROBES {
                    m.insert(
                        (from.name(), to.name(), format!("{proto}/{port}")),
                        allowed(&from.name(), &to.name(), proto, port),
                    );
                }
            }
        }
        m
    }

    /// Applies `policies` (replacing the previous case's) and waits until
    /// the agent programmed exactly the NetworkPolicies named `names`.
    fn policies(&self, policies: &[String], names: &[&str]) {
        if policies.is_empty() {
            self.node.remove_config("policies.yaml");
        } else {
            self.node
                .write_config("policies.yaml", &policies.join("---\n"));
        }
        let want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        wait_for(
            "the policies to be programmed",
            Duration::from_secs(10),
            || {
                self.node.status().is_some_and(|s| {
                    let have: Vec<String> = s["policies"]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|v| v.as_str().map(String::from))
                                .collect()
                        })
                        .unwrap_or_default();
                    have == want && s["config_errors"].as_array().is_some_and(|e| e.is_empty())
                })
            },
        );
    }

    /// Measures and compares with `allowed`, listing every difference.
    fn check(&self, case: &str, allowed: impl Fn(&str, &str, &str, u16) -> bool) {
        let want = self.expected(allowed);
        let have = self.measure();
        let wrong: Vec<String> = want
            .iter()
            .filter(|(k, v)| have.get(*k) != Some(v))
            .map(|((f, t, p), v)| {
                format!(
                    "{f} -> {t} {p}: expected {}",
                    if *v { "reach" } else { "blocked" }
                )
            })
            .collect();
        assert!(
            wrong.is_empty(),
            "case {case}: {} of {} probes differ:\n{}",
            wrong.len(),
            want.len(),
            wrong.join("\n")
        );
    }

    fn endpoint(&self, name: &str) -> &Endpoint {
        self.endpoints.iter().find(|e| e.name() == name).unwrap()
    }
}

fn policy(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
    )
}

fn in_ns(endpoint: &str, ns: &str) -> bool {
    endpoint.starts_with(&format!("{ns}/"))
}

#[test]
fn reachability_matrices_follow_network_policy() {
    let bed = bed();
    let started = Instant::now();

    bed.check("no policy", |_, _, _, _| true);

    bed.policies(
        &[policy(
            "x",
            "deny-in",
            "{podSelector: {}, policyTypes: [Ingress]}",
        )],
        &["x/deny-in"],
    );
    bed.check("default deny ingress", |_, to, _, _| !in_ns(to, "x"));
    assert!(
        bed.node.drops(drop_reason::POLICY_DENIED_INGRESS) > 0,
        "denied probes are counted as policy_denied_ingress"
    );

    bed.policies(
        &[policy(
            "x",
            "deny-out",
            "{podSelector: {}, policyTypes: [Egress]}",
        )],
        &["x/deny-out"],
    );
    bed.check("default deny egress", |from, _, _, _| !in_ns(from, "x"));
    assert!(bed.node.drops(drop_reason::POLICY_DENIED_EGRESS) > 0);

    bed.policies(
        &[policy(
            "x",
            "a-from-b",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}]}]}",
        )],
        &["x/a-from-b"],
    );
    bed.check("allow from one podSelector", |from, to, _, _| {
        to != "x/a" || from == "x/b"
    });

    bed.policies(
        &[policy(
            "x",
            "a-from-y-b",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}]}]}",
        )],
        &["x/a-from-y-b"],
    );
    bed.check("namespaceSelector AND podSelector", |from, to, _, _| {
        to != "x/a" || from == "y/b"
    });

    // y's addresses are 10.51.1.0/24; y/b (10.51.1.11) is excepted.
    bed.policies(
        &[policy(
            "x",
            "a-from-cidr",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{ipBlock: {cidr: 10.51.1.0/24, except: [10.51.1.11/32]}}]}]}",
        )],
        &["x/a-from-cidr"],
    );
    bed.check("ipBlock with except", |from, to, _, _| {
        to != "x/a" || from == "y/a" || from == "y/c"
    });

    bed.policies(
        &[policy(
            "x",
            "a-tcp-range",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{ports: [{protocol: TCP, port: 81, endPort: 90}]}]}",
        )],
        &["x/a-tcp-range"],
    );
    bed.check("endPort range", |_, to, proto, port| {
        to != "x/a" || (proto == "tcp" && (81..=90).contains(&port))
    });

    bed.policies(
        &[policy(
            "x",
            "a-named",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{ports: [{protocol: UDP, port: serve-81-udp}]}]}",
        )],
        &["x/a-named"],
    );
    bed.check("named port", |_, to, proto, port| {
        to != "x/a" || (proto == "udp" && port == 81)
    });

    bed.policies(
        &[
            policy(
                "x",
                "one",
                "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}], ports: [{port: 80}]}]}",
            ),
            policy(
                "x",
                "two",
                "{podSelector: {}, ingress: [{from: [{namespaceSelector: {matchLabels: {ns: z}}}], ports: [{protocol: UDP, port: 81}]}]}",
            ),
        ],
        &["x/one", "x/two"],
    );
    bed.check("two policies unioned", |from, to, proto, port| {
        if !in_ns(to, "x") {
            return true;
        }
        let two = in_ns(from, "z") && proto == "udp" && port == 81;
        let one = to == "x/a" && from == "x/b" && proto == "tcp" && port == 80;
        one || two
    });

    bed.policies(
        &[policy(
            "x",
            "dns-only",
            "{podSelector: {}, policyTypes: [Egress], egress: [{ports: [{protocol: UDP, port: 53}, {protocol: TCP, port: 53}]}]}",
        )],
        &["x/dns-only"],
    );
    bed.check("egress to DNS only", |from, _, _, _| !in_ns(from, "x"));
    // ... and DNS itself goes through, to any peer.
    let xa = bed.endpoint("x/a");
    let dns = xa.vm.ns.run(&[
        SCAPY_PYTHON,
        "-c",
        CLIENT,
        &format!("{},udp,53", bed.endpoint("z/c").ip),
        &format!("{},tcp,53", bed.endpoint("y/b").ip),
    ]);
    assert_eq!(
        dns.lines().collect::<Vec<_>>(),
        ["ok", "ok"],
        "DNS from x/a"
    );

    eprintln!("policy cases measured in {:?}", started.elapsed());
}

#[test]
fn a_policy_added_under_an_established_allowed_flow_keeps_it() {
    use std::io::{BufRead as _, BufReader, Write as _};

    let bed = bed();
    let (client, server) = (bed.endpoint("y/b"), bed.endpoint("x/a"));
    let mut holder =
        client
            .vm
            .ns
            .command_piped(&[SCAPY_PYTHON, "-u", "-c", HOLDER, &server.ip, "80"]);
    let mut stdin = holder.stdin.take().unwrap();
    let mut lines = BufReader::new(holder.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "open");
    let mut round = |stdin: &mut std::process::ChildStdin| {
        writeln!(stdin).unwrap();
        lines.next().unwrap().unwrap()
    };
    assert_eq!(round(&mut stdin), "ok", "before any policy");

    bed.policies(
        &[policy(
            "x",
            "a-from-y-b",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}], ports: [{port: 80}]}]}",
        )],
        &["x/a-from-y-b"],
    );
    assert_eq!(
        round(&mut stdin),
        "ok",
        "the established flow, still allowed"
    );
    bed.check(
        "policy added under an established flow",
        |from, to, proto, port| to != "x/a" || (from == "y/b" && proto == "tcp" && port == 80),
    );
    assert_eq!(
        round(&mut stdin),
        "ok",
        "the established flow after the matrix"
    );

    // `vmpath monitor --type policy` names the verdicts on new flows.
    let (mut monitor, events) = policy_monitor(&bed.node);
    let probe = |from: &str, to: &str| {
        bed.endpoint(from).vm.ns.run(&[
            SCAPY_PYTHON,
            "-c",
            CLIENT,
            &format!("{},tcp,80", bed.endpoint(to).ip),
        ])
    };
    assert_eq!(probe("y/c", "x/a").trim(), "no");
    assert_eq!(probe("y/b", "x/a").trim(), "ok");
    // The denied SYN is retried (one event each); then the allowed flow.
    let (yc, yb) = (
        bed.endpoint("y/c").ip.clone(),
        bed.endpoint("y/b").ip.clone(),
    );
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|e: &serde_json::Value| e["src"] == yb.as_str())
    {
        let line = events
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("policy events {seen:?}; log:\n{}", bed.node.agent_log()));
        let e: serde_json::Value = serde_json::from_str(&line).expect("a JSON event");
        if e["endpoint"] == "x/a/eth0" && e["dport"] == 80 {
            seen.push(e);
        }
    }
    let denied = &seen[0];
    assert_eq!(denied["type"], "policy", "{denied}");
    assert_eq!(denied["reason"], "policy_denied_ingress", "{denied}");
    assert_eq!(denied["direction"], "ingress", "{denied}");
    assert_eq!(denied["src"], yc.as_str(), "{denied}");
    assert_eq!(denied["proto"], "tcp", "{denied}");
    assert!(
        seen[..seen.len() - 1]
            .iter()
            .all(|e| e["src"] == yc.as_str() && e["reason"] == "policy_denied_ingress"),
        "{seen:?}"
    );
    let allowed = seen.last().unwrap();
    assert_eq!(allowed["reason"], "allowed", "{allowed}");
    assert_eq!(allowed["policy"], "x/a-from-y-b", "{allowed}");
    assert_eq!(allowed["src"], yb.as_str(), "{allowed}");
    let _ = monitor.kill();
    let _ = monitor.wait();
    drop(stdin);
    let _ = holder.kill();
    let _ = holder.wait();
}

/// `vmpath monitor --type policy -o json`, its lines on a channel, once
/// the agent counts it as a listener.
fn policy_monitor(node: &Node) -> (Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(vmpath_tests::vmpath_bin())
        .args(["monitor", "--type", "policy", "-o", "json", "--api-socket"])
        .arg(node.api_socket())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting vmpath monitor");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let cfg = vmpath_tests::vmpath::apply::dataplane::maps_dir(&node.bpffs)
        .join(vmpath_tests::vmpath::common::map_names::MONITOR_CFG);
    wait_for("the monitor to listen", Duration::from_secs(5), || {
        let map: aya::maps::Array<aya::maps::MapData, vmpath_tests::vmpath::common::MonitorConfig> =
            aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(&cfg).unwrap())
                .unwrap()
                .try_into()
                .unwrap();
        map.get(&0, 0).unwrap().listeners == 1
    });
    (child, rx)
}

trait Piped {
    fn command_piped(&self, args: &[&str]) -> Child;
}

impl Piped for vmpath_tests::Netns {
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

/// Across the overlay: x/a on node a, y/b and y/c on node b. Ingress
/// policy is enforced where the destination is delivered (node a), egress
/// policy on the sender's port (node b); replies cross back.
#[test]
fn policies_apply_across_the_overlay() {
    let underlay = vmpath_tests::Underlay::new();
    let mut a = Node::new("a");
    let mut b = Node::new("b");
    underlay.plug(&a.ns, "ul0", "192.0.2.1/24", 1600);
    underlay.plug(&b.ns, "ul0", "192.0.2.2/24", 1600);
    let place = [("x", "a", 0, 0), ("y", "b", 1, 1), ("y", "c", 1, 2)];
    let mut endpoints = Vec::new();
    for (ns, pod, n, p) in place {
        let node = if ns == "x" { &a } else { &b };
        let ip = ip_of(n, p);
        let vm = node.add_vm(
            &format!("{ns}{pod}"),
            &format!("52:54:00:52:{n:02x}:{p:02x}"),
            &[&format!("{ip}/16")],
            None,
        );
        let ns = NAMESPACES.iter().find(|x| **x == ns).unwrap();
        let pod = PODS.iter().find(|x| **x == pod).unwrap();
        endpoints.push(Endpoint {
            ns,
            pod,
            vm,
            ip,
            is_pod: false,
        });
    }
    let mut config = base_config(&endpoints);
    // Each endpoint on its own node.
    for e in &endpoints {
        if e.ns != "x" {
            config = config.replace(
                &format!("  node: a\n  port: {}", e.vm.port),
                &format!("  node: b\n  port: {}", e.vm.port),
            );
        }
    }
    config.push_str("---\n");
    config.push_str(&vmpath_tests::yaml_overlay::node("a", "192.0.2.1"));
    config.push_str("---\n");
    config.push_str(&vmpath_tests::yaml_overlay::node("b", "192.0.2.2"));
    for node in [&a, &b] {
        node.write_config("base.yaml", &config);
    }
    a.start_agent();
    b.start_agent();
    a.wait_ports(&[&endpoints[0].vm.port]);
    b.wait_ports(&[&endpoints[1].vm.port, &endpoints[2].vm.port]);
    let mut servers = Vec::new();
    for e in &endpoints {
        let mut child = e.vm.ns.spawn(&[SCAPY_PYTHON, "-u", "-c", SERVER]);
        let mut line = String::new();
        use std::io::BufRead as _;
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        servers.push(child);
    }
    let probe = |from: usize, to: usize, proto: &str, port: u16| {
        endpoints[from].vm.ns.run(&[
            SCAPY_PYTHON,
            "-c",
            CLIENT,
            &format!("{},{proto},{port}", endpoints[to].ip),
        ]) == "ok\n"
    };
    let (xa, yb, yc) = (0, 1, 2);
    assert!(probe(yc, xa, "tcp", 80), "no policy yet");

    let policies = [
        policy(
            "x",
            "a-from-y-b",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}, podSelector: {matchLabels: {pod: b}}}], ports: [{port: 80}]}]}",
        ),
        policy(
            "y",
            "c-out-udp",
            "{podSelector: {matchLabels: {pod: c}}, policyTypes: [Egress], egress: [{ports: [{protocol: UDP, port: 81}]}]}",
        ),
    ]
    .join("---\n");
    for node in [&a, &b] {
        node.write_config("policies.yaml", &policies);
    }
    for node in [&a, &b] {
        wait_for("the policies", Duration::from_secs(10), || {
            node.status()
                .is_some_and(|s| s["policies"].as_array().is_some_and(|p| p.len() == 2))
        });
    }
    assert!(probe(yb, xa, "tcp", 80), "allowed across the overlay");
    assert!(!probe(yb, xa, "tcp", 81), "another port");
    assert!(!probe(yc, xa, "tcp", 80), "y/c denied: egress on node b");
    assert!(
        b.drops(drop_reason::POLICY_DENIED_EGRESS) > 0,
        "denied on the sender's node"
    );
    assert!(
        !probe(yc, xa, "udp", 81),
        "y/c may send UDP 81, x/a denies it"
    );
    assert!(
        a.drops(drop_reason::POLICY_DENIED_INGRESS) > 0,
        "denied on the receiver's node"
    );
    assert!(
        probe(xa, yc, "tcp", 80),
        "x/a's egress is not isolated: replies cross back"
    );
    assert!(probe(xa, yb, "udp", 80));
    for mut s in servers {
        let _ = s.kill();
        let _ = s.wait();
    }
}

/// Prints the payload of every UDP datagram (IPv4 or IPv6) to port 7000.
const SINK: &str = r#"
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", 7000))
print("ready", flush=True)
while True:
    d, _ = s.recvfrom(100); print(d.decode(), flush=True)
"#;

/// What `SINK` in `ns` printed first ("ready" read), as lines on a channel.
fn sink(vm: &Vm) -> (Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead as _;
    let mut child = vm.ns.spawn(&[SCAPY_PYTHON, "-u", "-c", SINK]);
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Reads `rx` until every payload of `want` came; returns everything read.
fn receive(rx: &std::sync::mpsc::Receiver<String>, want: &[&str]) -> Vec<String> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !want.iter().all(|w| got.iter().any(|g: &String| g == w)) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => got.push(line),
            Err(_) => panic!("waited for {want:?}, received {got:?}"),
        }
    }
    got
}

/// `sender` sends one UDP datagram over IPv4 and one over IPv6 to
/// (`dst4`, `dst6`) port 7000 from (`src4`, `src6`) port `sport`, twice
/// each; the payload is `tag`-v4 / `tag`-v6.
fn send_pair(
    sender: &Vm,
    to_mac: &str,
    (src4, src6): (&str, &str),
    (dst4, dst6): (&str, &str),
    sport: u16,
    tag: &str,
) {
    sender.ns.scapy(&format!(
        "e = Ether(src='{}', dst='{to_mac}')
sendp(e/IP(src='{src4}', dst='{dst4}')/UDP(sport={sport}, dport=7000)/Raw(b'{tag}-v4'), iface='eth0', count=2)
sendp(e/IPv6(src='{src6}', dst='{dst6}')/UDP(sport={sport}, dport=7000)/Raw(b'{tag}-v6'), iface='eth0', count=2)
",
        sender.mac
    ));
}

/// The spoofing matrix's sends, on any bed: b's policy admits only
/// endpoints labelled `pod: a`; a (configured addresses) and d (labelled
/// `pod: a`, addresses only learned) are genuine, c is not. c writes a's
/// addresses (IPv4 and IPv6) on a new flow, then on the exact 5-tuple of
/// the flow b has just admitted from a. b receives a's and d's datagrams,
/// never c's; c's 8 are counted as `policy_denied_ingress` on b's node
/// (`denied`: that node's count) and shown by `vmpath monitor`.
fn spoofing_matrix(b_node: &Node, (a, b, c, d): (&Vm, &Vm, &Vm, &Vm), d_addrs: (&str, &str)) {
    let (a4, a6) = ("10.53.0.1", "fd53::1");
    let b_dst = ("10.53.0.2", "fd53::2");
    let (mut sink, rx) = sink(b);
    let (mut monitor, events) = policy_monitor(b_node);
    let denied = b_node.drops(drop_reason::POLICY_DENIED_INGRESS);
    send_pair(a, &b.mac, (a4, a6), b_dst, 7001, "a");
    let mut got = receive(&rx, &["a-v4", "a-v6"]);
    // A new flow as a, then a's admitted flow itself (same tuple).
    send_pair(c, &b.mac, (a4, a6), b_dst, 7002, "c-as-a");
    send_pair(c, &b.mac, (a4, a6), b_dst, 7001, "c-in-a-flow");
    wait_for(
        "c's datagrams denied at b's ingress",
        Duration::from_secs(10),
        || b_node.drops(drop_reason::POLICY_DENIED_INGRESS) >= denied + 8,
    );
    send_pair(d, &b.mac, d_addrs, b_dst, 7003, "d");
    got.extend(receive(&rx, &["d-v4", "d-v6"]));
    // Genuine again, after c's attempt on its flow.
    send_pair(a, &b.mac, (a4, a6), b_dst, 7001, "a-again");
    got.extend(receive(&rx, &["a-again-v4", "a-again-v6"]));
    let _ = sink.kill();
    let _ = sink.wait();
    assert!(
        !got.iter().any(|g| g.starts_with("c-")),
        "b received c's datagrams: {got:?}"
    );
    // The counter also counts the floods withheld from b (the VMs' own
    // kernels' router solicitations, MLD reports and DAD probes in their
    // first seconds, `policy::count_withheld`): at least c's 8; which
    // frames were denied, the monitor says one by one.
    assert!(
        b_node.drops(drop_reason::POLICY_DENIED_INGRESS) >= denied + 8,
        "c's datagrams as a, new flow and a's flow, twice each over IPv4 and IPv6, counted"
    );
    // The monitor shows each denial, from a's claimed address and c's
    // MAC, and nothing of a's or d's denied; d's flow, sent after c's,
    // ends what is read.
    let mut denied_c: Vec<(String, Option<u64>)> = Vec::new();
    let mut denied_other: Vec<String> = Vec::new();
    let mut seen_allowed = false;
    let mut d_allowed = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d_allowed.len() < 2 || !seen_allowed {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = events.recv_timeout(left).unwrap_or_else(|_| {
            panic!("monitor: c denied {denied_c:?}, others denied {denied_other:?}, a allowed {seen_allowed}, d allowed {d_allowed:?}")
        });
        let e: serde_json::Value = serde_json::from_str(&line).unwrap();
        let src = e["src"].as_str().unwrap_or_default().to_string();
        let src_mac = e["src_mac"].as_str().unwrap_or_default();
        if e["reason"] == "policy_denied_ingress" {
            if src_mac == c.mac && (src == a4 || src == a6) {
                denied_c.push((src, e["sport"].as_u64()));
            } else {
                denied_other.push(line.clone());
            }
        } else if e["reason"] == "allowed" && src == a4 {
            seen_allowed = true;
        } else if e["reason"] == "allowed" && src_mac == d.mac {
            d_allowed.insert(src);
        }
    }
    assert!(
        denied_other.is_empty(),
        "denied besides c's: {denied_other:?}"
    );
    denied_c.sort();
    let sent: Vec<(String, Option<u64>)> = [a4, a6]
        .iter()
        .flat_map(|ip| [7001, 7001, 7002, 7002].map(|sport| (ip.to_string(), Some(sport))))
        .collect();
    let mut sent = sent;
    sent.sort();
    assert_eq!(denied_c, sent, "c's 8 datagrams, each shown denied");
    let _ = monitor.kill();
    let _ = monitor.wait();
}

fn spoof_network() -> String {
    vmpath_tests::yaml::network(
        "spoof",
        530,
        &["10.53.0.0/16", "fd53::/64"],
        &["10.53.255.1", "fd53::ffff"],
        false,
    )
}

fn spoof_attachment(name: &str, label: &str, v: &Vm, node: &str, ips: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: x, labels: {{pod: {label}}}}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: spoof\n  node: {node}\n  port: {}\n  mac: \"{}\"\n{ips}",
        v.port, v.mac
    )
}

fn spoof_ips(n: u8) -> String {
    format!("  ips: [\"10.53.0.{n}/16\", \"fd53::{n}/64\"]\n")
}

const B_FROM_A: &str = "{podSelector: {matchLabels: {pod: b}}, ingress: [{from: [{podSelector: {matchLabels: {pod: a}}}]}]}";

/// On an IPAM-less network, b's policy admits only endpoints labelled
/// `pod: a`, all four endpoints on one node: `spoofing_matrix`. The
/// identity of a frame is its port's endpoint's, and a flow admitted from
/// a is a's alone.
#[test]
fn a_claimed_source_address_never_carries_another_endpoints_identity() {
    let mut node = Node::new("a");
    let vm = |name: &str, n: u8| {
        node.add_vm(
            name,
            &format!("52:54:00:53:00:{n:02x}"),
            &[&format!("10.53.0.{n}/16"), &format!("fd53::{n}/64")],
            None,
        )
    };
    let (a, b, c, d) = (vm("sa", 1), vm("sb", 2), vm("sc", 3), vm("sd", 4));
    let docs = [
        spoof_network(),
        spoof_attachment("a", "a", &a, "a", &spoof_ips(1)),
        spoof_attachment("b", "b", &b, "a", &spoof_ips(2)),
        spoof_attachment("c", "c", &c, "a", &spoof_ips(3)),
        // No addresses configured: d's are learned, if at all.
        spoof_attachment("d", "a", &d, "a", ""),
        policy("x", "b-from-a", B_FROM_A),
    ];
    node.write_config("config.yaml", &vmpath_tests::yaml::docs(&docs));
    node.start_agent();
    node.wait_ports(&[&a.port, &b.port, &c.port, &d.port]);
    wait_for("the policy", Duration::from_secs(10), || {
        node.status()
            .is_some_and(|s| s["policies"].as_array().is_some_and(|p| p.len() == 1))
    });
    spoofing_matrix(&node, (&a, &b, &c, &d), ("10.53.0.4", "fd53::4"));
}

/// The same across the overlay: b alone on node a, a, c and d on node b.
/// Node a takes a frame's identity from the remote endpoint its source MAC
/// names, on the node it came from, never from the address it claims; d,
/// whose addresses are only learned, is still `pod: a` there.
#[test]
fn a_claimed_source_address_never_carries_another_endpoints_identity_across_the_overlay() {
    let underlay = vmpath_tests::Underlay::new();
    let mut na = Node::new("a");
    let mut nb = Node::new("b");
    underlay.plug(&na.ns, "ul0", "192.0.2.1/24", 1600);
    underlay.plug(&nb.ns, "ul0", "192.0.2.2/24", 1600);
    let vm = |node: &Node, name: &str, n: u8| {
        node.add_vm(
            name,
            &format!("52:54:00:53:01:{n:02x}"),
            &[&format!("10.53.0.{n}/16"), &format!("fd53::{n}/64")],
            None,
        )
    };
    let b = vm(&na, "ob", 2);
    let (a, c, d) = (vm(&nb, "oa", 1), vm(&nb, "oc", 3), vm(&nb, "od", 4));
    let docs = [
        spoof_network(),
        spoof_attachment("a", "a", &a, "b", &spoof_ips(1)),
        spoof_attachment("b", "b", &b, "a", &spoof_ips(2)),
        spoof_attachment("c", "c", &c, "b", &spoof_ips(3)),
        spoof_attachment("d", "a", &d, "b", ""),
        policy("x", "b-from-a", B_FROM_A),
        vmpath_tests::yaml_overlay::node("a", "192.0.2.1"),
        vmpath_tests::yaml_overlay::node("b", "192.0.2.2"),
    ];
    for node in [&na, &nb] {
        node.write_config("config.yaml", &vmpath_tests::yaml::docs(&docs));
    }
    na.start_agent();
    nb.start_agent();
    na.wait_ports(&[&b.port]);
    nb.wait_ports(&[&a.port, &c.port, &d.port]);
    for node in [&na, &nb] {
        wait_for("the policy", Duration::from_secs(10), || {
            node.status()
                .is_some_and(|s| s["policies"].as_array().is_some_and(|p| p.len() == 1))
        });
    }
    spoofing_matrix(&na, (&a, &b, &c, &d), ("10.53.0.4", "fd53::4"));
}

/// Receives UDP datagrams on 5353 and 5354 (IPv4 and IPv6), printing
/// each one's port, family and size.
const BIG_SINK: &str = r#"
import socket, threading
def serve(p):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", p))
    while True:
        d, a = s.recvfrom(65535)
        fam = "v4" if a[0].startswith("::ffff:") else "v6"
        print(f"{p} {fam} {len(d)}", flush=True)
for p in (5353, 5354):
    threading.Thread(target=serve, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// A UDP datagram larger than the MTU, sent by the kernel of an allowed
/// peer (a real socket: the kernel fragments it), reaches an endpoint
/// whose policy allows that UDP port, over IPv4 and IPv6: every fragment
/// after the first takes its verdict (before, they were denied as
/// `policy_denied_ingress` with ports 0, and the datagram never
/// reassembled). The same datagram to a port the policy does not allow
/// arrives in no form. b's UDP 5353 is allowed from a only.
#[test]
fn a_datagram_larger_than_the_mtu_reaches_an_endpoint_whose_policy_allows_its_port() {
    let mut node = Node::new("a");
    let vm = |name: &str, n: u8| {
        node.add_vm(
            name,
            &format!("52:54:00:54:00:{n:02x}"),
            &[&format!("10.54.0.{n}/16"), &format!("fd54::{n}/64")],
            None,
        )
    };
    let (a, b) = (vm("fa", 1), vm("fb", 2));
    let attachment = |name: &str, v: &Vm, n: u8| {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: x, labels: {{pod: {name}}}}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: frag\n  node: a\n  port: {}\n  mac: \"{}\"\n  ips: [\"10.54.0.{n}/16\", \"fd54::{n}/64\"]\n",
            v.port, v.mac
        )
    };
    let docs = [
        vmpath_tests::yaml::network(
            "frag",
            540,
            &["10.54.0.0/16", "fd54::/64"],
            &["10.54.255.1", "fd54::ffff"],
            false,
        ),
        attachment("a", &a, 1),
        attachment("b", &b, 2),
        policy(
            "x",
            "b-udp-5353-from-a",
            "{podSelector: {matchLabels: {pod: b}}, ingress: [{from: [{podSelector: {matchLabels: {pod: a}}}], ports: [{protocol: UDP, port: 5353}]}]}",
        ),
    ];
    node.write_config("config.yaml", &vmpath_tests::yaml::docs(&docs));
    node.start_agent();
    node.wait_ports(&[&a.port, &b.port]);
    wait_for("the policy", Duration::from_secs(10), || {
        node.status()
            .is_some_and(|s| s["policies"].as_array().is_some_and(|p| p.len() == 1))
    });
    for v in [&a, &b] {
        let mtu: usize =
            v.ns.run(&["cat", "/sys/class/net/eth0/mtu"])
                .trim()
                .parse()
                .unwrap();
        assert!(
            mtu < 4000 / 2,
            "the datagram below must take several fragments"
        );
    }

    let mut sink = b.ns.spawn(&[SCAPY_PYTHON, "-u", "-c", BIG_SINK]);
    let mut out = std::io::BufReader::new(sink.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::{BufRead as _, Read as _};
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let unplaced = node.drops(drop_reason::POLICY_FRAGMENT);
    // 4000 bytes: three fragments or more, both families.
    a.ns.run(&[
        SCAPY_PYTHON,
        "-c",
        "import socket, time
for fam, dst in ((socket.AF_INET, '10.54.0.2'), (socket.AF_INET6, 'fd54::2')):
    s = socket.socket(fam, socket.SOCK_DGRAM)
    for port in (5353, 5354):
        for _ in range(2):
            s.sendto(b'x' * 4000, (dst, port)); time.sleep(0.05)
",
    ]);
    std::thread::sleep(Duration::from_millis(700));
    let _ = sink.kill();
    let _ = sink.wait();
    let mut got = String::new();
    out.read_to_string(&mut got).unwrap();
    let got: std::collections::BTreeSet<&str> = got.lines().collect();
    let want: std::collections::BTreeSet<&str> = ["5353 v4 4000", "5353 v6 4000"].into();
    assert_eq!(got, want, "what b received, whole");
    assert_eq!(
        node.drops(drop_reason::POLICY_FRAGMENT),
        unplaced,
        "every later fragment found its first"
    );
}
