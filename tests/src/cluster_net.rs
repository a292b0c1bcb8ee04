//! A stand-in for the cluster's own network (its CNI, kube-proxy, DNS),
//! beside vmpath on the test nodes, made of the real parts:
//!
//! - on each node, pods of the reference `bridge` CNI plugin with
//!   `host-local` IPAM (Debian's containernetworking-plugins), a bridge
//!   `cni0` with the node's pod CIDR, as flannel's or kindnet's nodes have;
//! - the nodes joined on an underlay link and routing each other's pod
//!   CIDRs (static routes, what a routed CNI's agent installs); dual-stack:
//!   every node and pod has an IPv4 and an IPv6 address;
//! - kube-proxy's iptables rules for ClusterIP and NodePort Services (and
//!   ip6tables' for IPv6 Services: kube-proxy keeps one table per family),
//!   written the way kube-proxy (iptables mode) writes them: `KUBE-SERVICES`
//!   jumps from PREROUTING and OUTPUT, a `KUBE-SVC-*` chain per Service
//!   port picking a `KUBE-SEP-*` chain per endpoint that DNATs to it,
//!   `KUBE-NODEPORTS` for the node's local addresses, `KUBE-MARK-MASQ` and
//!   `KUBE-POSTROUTING`'s masquerade of what they mark. As a kube-proxy
//!   without `--cluster-cidr`, it does not mark traffic from outside the
//!   cluster's pods for masquerade (so what translates a vmpath endpoint's
//!   source is vmpath, not kube-proxy);
//! - a DNS server (dnsmasq) in a cluster-network pod behind a DNS
//!   ClusterIP, answering for the cluster's Service names.

use std::{
    fs,
    io::Write as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use crate::{Netns, link, run_status, unique_tag};

/// Where Debian's containernetworking-plugins installs the plugins.
pub const CNI_PLUGINS: &str = "/usr/lib/cni";

/// The cluster's pod CIDR (every node's pod CIDR is a /24 of it).
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The cluster's IPv6 pod CIDR (every node's is a /64 of it).
pub const POD_CIDR6: &str = "fd00:10:244::/56";
/// The cluster's Service CIDR.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// The cluster's IPv6 Service CIDR.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
/// The underlay's router, every node's default route.
pub const ROUTER: &str = "192.168.90.254";
/// The underlay's IPv6 router.
pub const ROUTER6: &str = "fd00:90::fe";
/// The DNS Service's ClusterIP (kube-system/kube-dns).
pub const DNS_IP: &str = "10.96.0.10";
/// The DNS Service's IPv6 ClusterIP (a dual-stack Service's second).
pub const DNS_IP6: &str = "fd00:10:96::a";
/// The cluster's DNS domain.
pub const DOMAIN: &str = "cluster.local";

/// One node of the cluster's network: its namespace (shared with a vmpath
/// `Node` when there is one), its underlay address, its pod CIDR.
pub struct ClusterNode {
    pub ns_name: String,
    pub index: u8,
    /// The node's address on the underlay (its InternalIP).
    pub address: String,
    /// This node's pod CIDR, a /24 of [`POD_CIDR`].
    pub pod_cidr: String,
    /// The node's IPv6 address on the underlay.
    pub address6: String,
    /// This node's IPv6 pod CIDR, a /64 of [`POD_CIDR6`].
    pub pod_cidr6: String,
    dir: PathBuf,
}

impl ClusterNode {
    /// Runs a command in the node's namespace.
    pub fn run(&self, args: &[&str]) -> String {
        let mut full = vec![
            "nsenter".to_string(),
            format!("--net=/run/netns/{}", self.ns_name),
        ];
        full.extend(args.iter().map(|a| a.to_string()));
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        crate::run(&refs)
    }

    /// A pod of the cluster's own network on this node: a namespace whose
    /// `eth0` the `bridge` plugin makes (host-local picks the addresses),
    /// with the default routes to the node's bridge. Returns the pod and
    /// its IPv4 address.
    pub fn pod(&self, name: &str) -> (Netns, String) {
        let (pod, ip, _) = self.pod_dual(name);
        (pod, ip)
    }

    /// [`ClusterNode::pod`], returning its IPv4 and IPv6 addresses.
    pub fn pod_dual(&self, name: &str) -> (Netns, String, String) {
        let pod = Netns::new(format!("vt{}-cp{name}", unique_tag()));
        let conf = format!(
            r#"{{"cniVersion": "1.0.0", "name": "cluster", "type": "bridge", "bridge": "cni0",
                "isGateway": true, "ipMasq": false,
                "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{}"}}], [{{"subnet": "{}"}}]],
                          "routes": [{{"dst": "0.0.0.0/0"}}, {{"dst": "::/0"}}], "dataDir": "{}"}}}}"#,
            self.pod_cidr,
            self.pod_cidr6,
            self.dir.join("ipam").display()
        );
        let mut child = Command::new(crate::on_path("nsenter"))
            .arg(format!("--net=/run/netns/{}", self.ns_name))
            .arg(format!("{CNI_PLUGINS}/bridge"))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("CNI_COMMAND", "ADD")
            .env("CNI_CONTAINERID", format!("c{}", pod.name))
            .env("CNI_NETNS", pod.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI_PLUGINS)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running the bridge CNI plugin");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert!(
            out.status.success(),
            "bridge ADD: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let (ip, ip6) = (address_of(&result, false), address_of(&result, true));
        // The address is usable once DAD is done (a test's first packet
        // must not be lost to a tentative address).
        crate::wait_for(
            "the pod's and its gateway's IPv6 addresses past DAD",
            std::time::Duration::from_secs(10),
            || {
                !pod.run(&["ip", "-6", "addr", "show", "dev", "eth0", "tentative"])
                    .contains("inet6")
                    && !self
                        .run(&["ip", "-6", "addr", "show", "dev", "cni0", "tentative"])
                        .contains("inet6")
            },
        );
        (pod, ip, ip6)
    }
}

/// The cluster's network over a set of node namespaces.
pub struct ClusterNet {
    pub nodes: Vec<ClusterNode>,
    /// The underlay's namespace (a bridge joining the nodes).
    underlay: Netns,
    dir: PathBuf,
}

impl ClusterNet {
    /// Joins the namespaces `node_ns` (e.g. vmpath `Node`s' `ns`) on an
    /// underlay (node i: 192.168.90.(i+1)/24 and fd00:90::(i+1)/64 on
    /// `cl0`, the default routes via [`ROUTER`] and [`ROUTER6`]), gives
    /// node i the pod CIDRs 10.244.i.0/24 and fd00:10:244:i::/64, routes
    /// every other node's pod CIDRs through that node, and turns
    /// forwarding on.
    pub fn new(node_ns: &[&Netns]) -> ClusterNet {
        let tag = unique_tag();
        let dir = std::env::temp_dir().join(format!("vmpath-cluster-net-{tag}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let underlay = Netns::new(format!("vt{tag}-clu"));
        underlay.run(&["ip", "link", "add", "br0", "type", "bridge"]);
        underlay.run(&["ip", "link", "set", "br0", "up"]);
        // The underlay's router: every node's default route, as a real
        // node has one (without it, an address no route covers would look
        // like the node's own to a FIB lookup).
        underlay.run(&["ip", "addr", "add", &format!("{ROUTER}/24"), "dev", "br0"]);
        underlay.run(&[
            "ip",
            "addr",
            "add",
            &format!("{ROUTER6}/64"),
            "dev",
            "br0",
            "nodad",
        ]);
        let mut nodes = Vec::new();
        for (i, ns) in node_ns.iter().enumerate() {
            let index = u8::try_from(i).expect("a few nodes");
            let node = ClusterNode {
                ns_name: ns.name.clone(),
                index,
                address: format!("192.168.90.{}", index + 1),
                pod_cidr: format!("10.244.{index}.0/24"),
                address6: format!("fd00:90::{}", index + 1),
                pod_cidr6: format!("fd00:10:244:{index}::/64"),
                dir: dir.join(format!("node{index}")),
            };
            fs::create_dir_all(&node.dir).unwrap();
            let peer = format!("u{tag}{index}");
            link(
                ns,
                "cl0",
                &format!("{}/24", node.address),
                &underlay,
                &peer,
                "",
            );
            underlay.run(&["ip", "link", "set", &peer, "master", "br0"]);
            ns.run(&[
                "ip",
                "addr",
                "add",
                &format!("{}/64", node.address6),
                "dev",
                "cl0",
                "nodad",
            ]);
            crate::enable_forwarding(ns);
            nodes.push(node);
        }
        for a in &nodes {
            let has_default = !a
                .run(&["ip", "-4", "route", "show", "default"])
                .trim()
                .is_empty();
            if !has_default {
                a.run(&["ip", "route", "add", "default", "via", ROUTER]);
            }
            let has_default6 = !a
                .run(&["ip", "-6", "route", "show", "default"])
                .trim()
                .is_empty();
            if !has_default6 {
                a.run(&["ip", "-6", "route", "add", "default", "via", ROUTER6]);
            }
            for b in nodes.iter().filter(|b| b.index != a.index) {
                a.run(&["ip", "route", "add", &b.pod_cidr, "via", &b.address]);
                a.run(&["ip", "-6", "route", "add", &b.pod_cidr6, "via", &b.address6]);
            }
        }
        ClusterNet {
            nodes,
            underlay,
            dir,
        }
    }

    /// kube-proxy's rules for `services` on every node (iptables mode,
    /// the nat table of each family replaced whole, as `iptables-restore`
    /// and `ip6tables-restore` do for it).
    pub fn kube_proxy(&self, services: &[Service]) {
        for (restore, v6) in [("iptables-restore", false), ("ip6tables-restore", true)] {
            let family: Vec<Service> = services
                .iter()
                .filter(|s| s.cluster_ip.contains(':') == v6)
                .cloned()
                .collect();
            self.restore(restore, &kube_proxy_rules(&family));
        }
    }

    fn restore(&self, restore: &str, rules: &str) {
        for n in &self.nodes {
            let mut child = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", n.ns_name))
                .arg(restore)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("iptables-restore");
            child
                .stdin
                .take()
                .unwrap()
                .write_all(rules.as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{restore} on {}: {}\n{rules}",
                n.ns_name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Where this bed keeps its files.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }
}

impl Drop for ClusterNet {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
        // The underlay namespace goes with its guard; the nodes' bridges
        // and routes go with the nodes' namespaces.
        let _ = &self.underlay;
    }
}

/// `tcp` or `udp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One Service port with its endpoints, as kube-proxy sees it from the
/// Service and its EndpointSlices.
#[derive(Debug, Clone)]
pub struct Service {
    /// `namespace/name:port-name`, kube-proxy's comment.
    pub name: String,
    pub cluster_ip: String,
    pub port: u16,
    pub proto: Proto,
    /// A NodePort, when the Service is of that type.
    pub node_port: Option<u16>,
    /// (address, port) of each ready endpoint.
    pub endpoints: Vec<(String, u16)>,
}

/// A Service port with one endpoint, as kube-proxy sees it.
pub fn one_endpoint_service(
    name: &str,
    ip: &str,
    port: u16,
    proto: Proto,
    node_port: Option<u16>,
    endpoint: (&str, u16),
) -> Service {
    Service {
        name: name.to_string(),
        cluster_ip: ip.to_string(),
        port,
        proto,
        node_port,
        endpoints: vec![(endpoint.0.to_string(), endpoint.1)],
    }
}

/// The DNS Service (kube-system/kube-dns, UDP 53) at `cluster_ip`, its
/// one endpoint the DNS server's pod at `endpoint`.
pub fn dns_service(cluster_ip: &str, endpoint: &str) -> Service {
    one_endpoint_service(
        "kube-system/kube-dns:dns",
        cluster_ip,
        53,
        Proto::Udp,
        None,
        (endpoint, 53),
    )
}

/// kube-proxy's hash for chain names: the first 16 characters of the
/// base32 of a SHA-256 (here a stable stand-in of the same shape).
fn chain_hash(prefix: &str, what: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in what.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let s: String = (0..16)
        .map(|i| ALPHABET[((h >> ((i * 4) % 60)) & 31) as usize] as char)
        .collect();
    format!("{prefix}-{s}")
}

/// The nat table kube-proxy writes for `services` (all of one family:
/// kube-proxy writes each family's to its own table).
pub fn kube_proxy_rules(services: &[Service]) -> String {
    let host = |ip: &str| {
        if ip.contains(':') {
            format!("{ip}/128")
        } else {
            format!("{ip}/32")
        }
    };
    let socket = |ip: &str, port: u16| {
        if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        }
    };
    let mut chains = vec![
        "KUBE-SERVICES".to_string(),
        "KUBE-NODEPORTS".to_string(),
        "KUBE-POSTROUTING".to_string(),
        "KUBE-MARK-MASQ".to_string(),
    ];
    let mut rules = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_string(),
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING".to_string(),
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000".to_string(),
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN".to_string(),
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0".to_string(),
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".to_string(),
    ];
    let mut tail = Vec::new();
    for s in services {
        let p = s.proto.name();
        let svc = chain_hash("KUBE-SVC", &format!("{}{p}", s.name));
        chains.push(svc.clone());
        rules.push(format!(
            "-A KUBE-SERVICES -d {} -p {p} -m comment --comment \"{} cluster IP\" -m {p} --dport {} -j {svc}",
            host(&s.cluster_ip),
            s.name,
            s.port
        ));
        if let Some(np) = s.node_port {
            let ext = chain_hash("KUBE-EXT", &format!("{}{p}", s.name));
            chains.push(ext.clone());
            rules.push(format!(
                "-A KUBE-NODEPORTS -p {p} -m comment --comment \"{}\" -m {p} --dport {np} -j {ext}",
                s.name
            ));
            rules.push(format!(
                "-A {ext} -m comment --comment \"masquerade traffic for {} external destinations\" -j KUBE-MARK-MASQ",
                s.name
            ));
            rules.push(format!("-A {ext} -j {svc}"));
        }
        let n = s.endpoints.len();
        for (i, (ip, port)) in s.endpoints.iter().enumerate() {
            let sep = chain_hash("KUBE-SEP", &format!("{}{p}{ip}:{port}", s.name));
            chains.push(sep.clone());
            let left = n - i;
            if left > 1 {
                rules.push(format!(
                    "-A {svc} -m comment --comment \"{} -> {ip}:{port}\" -m statistic --mode random --probability {:.11} -j {sep}",
                    s.name,
                    1.0 / left as f64
                ));
            } else {
                rules.push(format!(
                    "-A {svc} -m comment --comment \"{} -> {ip}:{port}\" -j {sep}",
                    s.name
                ));
            }
            rules.push(format!(
                "-A {sep} -s {} -m comment --comment \"{}\" -j KUBE-MARK-MASQ",
                host(ip),
                s.name
            ));
            rules.push(format!(
                "-A {sep} -p {p} -m comment --comment \"{}\" -m {p} -j DNAT --to-destination {}",
                s.name,
                socket(ip, *port)
            ));
        }
    }
    // Last, as kube-proxy has it: the NodePorts of the node's own addresses.
    tail.push(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
            .to_string(),
    );
    let mut out = String::from(
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n",
    );
    for c in &chains {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for r in rules.iter().chain(&tail) {
        out.push_str(r);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    out
}

/// dnsmasq in `pod` (at `pod_ip`), answering for `records` (name under
/// [`DOMAIN`], address: `a`, or `a,aaaa` for both families) and nothing
/// else; killed on drop.
pub struct Dns(Child);

impl Dns {
    pub fn start(pod: &Netns, pod_ip: &str, records: &[(&str, &str)]) -> Dns {
        Dns::start_on(pod, &[pod_ip], records)
    }

    /// [`Dns::start`], listening on each of `pod_ips`.
    pub fn start_on(pod: &Netns, pod_ips: &[&str], records: &[(&str, &str)]) -> Dns {
        let mut args = vec![
            "dnsmasq".to_string(),
            "--keep-in-foreground".into(),
            "--no-resolv".into(),
            "--no-hosts".into(),
            "--bind-interfaces".into(),
            format!("--listen-address={}", pod_ips.join(",")),
            "--user=root".into(),
            "--pid-file".into(),
            "--conf-file=/dev/null".into(),
            format!("--local=/{DOMAIN}/"),
        ];
        for (name, ip) in records {
            args.push(format!("--host-record={name}.{DOMAIN},{ip}"));
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = pod.spawn(&refs);
        let dns = Dns(child);
        crate::wait_for(
            "dnsmasq listening",
            std::time::Duration::from_secs(20),
            || {
                let listening =
                    String::from_utf8_lossy(&pod.run_status(&["ss", "-lun"]).stdout).into_owned();
                pod_ips.iter().all(|ip| {
                    let at = if ip.contains(':') {
                        format!("[{ip}]:53")
                    } else {
                        format!("{ip}:53")
                    };
                    listening.contains(&at)
                })
            },
        );
        dns
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `busybox nslookup name server` from `ns`: the first address answered.
pub fn resolve(ns: &Netns, name: &str, server: &str) -> Option<String> {
    let out = ns.run_status(&["busybox", "nslookup", name, server]);
    nslookup_answer(&String::from_utf8_lossy(&out.stdout))
}

/// The first address in busybox nslookup's output.
pub fn nslookup_answer(text: &str) -> Option<String> {
    // The answer follows the server's own lines ("Server:", "Address:").
    text.split("Name:")
        .nth(1)
        .and_then(|rest| {
            rest.lines()
                .find_map(|l| l.trim().strip_prefix("Address: "))
        })
        .map(|a| a.trim().to_string())
}

/// A TCP echo server on `port` (each connection: one read echoed back,
/// then "from <peer address>"), or the same for UDP datagrams; killed on
/// drop. The peer is how a test sees whose source arrived.
pub struct Echo(Child);

impl Echo {
    /// On IPv4 (`0.0.0.0`).
    pub fn start(ns: &Netns, proto: Proto, port: u16) -> Echo {
        Echo::start_family(ns, proto, port, false)
    }

    /// On IPv6 (`::`, IPv6 only: beside an IPv4 one on the same port).
    pub fn start6(ns: &Netns, proto: Proto, port: u16) -> Echo {
        Echo::start_family(ns, proto, port, true)
    }

    fn start_family(ns: &Netns, proto: Proto, port: u16, v6: bool) -> Echo {
        let (family, any) = if v6 {
            ("AF_INET6", "::")
        } else {
            ("AF_INET", "0.0.0.0")
        };
        let v6only = if v6 {
            "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n"
        } else {
            ""
        };
        let script = match proto {
            Proto::Tcp => format!(
                "import socket\ns = socket.socket(socket.{family}); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n{v6only}\
                 s.bind(('{any}', {port})); s.listen(16); print('ready', flush=True)\n\
                 while True:\n    c, a = s.accept()\n    try:\n        c.sendall(c.recv(100) + b' from ' + a[0].encode())\n    except OSError:\n        pass\n    c.close()\n"
            ),
            Proto::Udp => format!(
                "import socket\ns = socket.socket(socket.{family}, socket.SOCK_DGRAM)\n{v6only}\
                 s.bind(('{any}', {port})); print('ready', flush=True)\n\
                 while True:\n    d, a = s.recvfrom(100); s.sendto(d + b' from ' + a[0].encode(), a)\n"
            ),
        };
        let mut child = ns.spawn(&["python3", "-u", "-c", &script]);
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ready", "the echo server started");
        Echo(child)
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A web server (busybox httpd) in `ns` on `port`, serving `body` at `/`;
/// killed on drop.
pub struct Http {
    child: Child,
    dir: PathBuf,
}

impl Http {
    pub fn start(ns: &Netns, port: u16, body: &str) -> Http {
        let dir = std::env::temp_dir().join(format!("vmpath-http-{}-{port}", ns.name));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("index.html"), body).unwrap();
        let child = ns.spawn(&[
            "busybox",
            "httpd",
            "-f",
            "-p",
            &port.to_string(),
            "-h",
            dir.to_str().unwrap(),
        ]);
        crate::wait_for(
            "the web server listening",
            std::time::Duration::from_secs(20),
            || {
                String::from_utf8_lossy(&ns.run_status(&["ss", "-ltn"]).stdout)
                    .contains(&format!(":{port} "))
            },
        );
        Http { child, dir }
    }
}

impl Drop for Http {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Sends "probe" to `ip:port` over `proto` from `ns`; the answer ("probe
/// from <the source the server saw>"), or `None` when none came in 2 s.
pub fn ask(ns: &Netns, proto: Proto, ip: &str, port: u16) -> Option<String> {
    let family = if ip.contains(':') {
        "AF_INET6"
    } else {
        "AF_INET"
    };
    let script = match proto {
        Proto::Tcp => format!(
            "import socket\ntry:\n    s = socket.create_connection(('{ip}', {port}), timeout=2); s.settimeout(2)\n    \
             s.sendall(b'probe'); print(s.recv(100).decode())\nexcept OSError:\n    print('')\n"
        ),
        Proto::Udp => format!(
            "import socket\ns = socket.socket(socket.{family}, socket.SOCK_DGRAM); s.settimeout(2)\ntry:\n    \
             s.sendto(b'probe', ('{ip}', {port})); print(s.recv(100).decode())\nexcept OSError:\n    print('')\n"
        ),
    };
    let out = ns.run_status(&["python3", "-c", &script]);
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    answer.starts_with("probe").then_some(answer)
}

/// Whether `dnsmasq` is installed (`cargo xtask setup` installs it).
pub fn have_dnsmasq() -> bool {
    run_status(&["sh", "-c", "command -v dnsmasq"])
        .status
        .success()
}

/// A CNI ADD result's address of one family (IPv6: `v6`), without its
/// prefix length.
pub fn address_of(result: &serde_json::Value, v6: bool) -> String {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["address"].as_str()?.split_once('/'))
        .map(|(ip, _)| ip.to_string())
        .find(|ip| ip.contains(':') == v6)
        .unwrap_or_else(|| panic!("an address of that family (IPv6: {v6}): {result}"))
}
