//! A real live migration driven as KubeVirt drives it: three nodes with
//! their agents on `--source kubernetes` against the test API server; a
//! QEMU guest (bridge binding, IPv4 by DHCP, IPv6 by DHCPv6 and the RA's
//! prefix) runs on node a from its VMI, virt-launcher pod and NAD; a peer
//! VM on node c reaches it over both families. A migration is what KubeVirt does: the
//! VMIM and the target virt-launcher pod (labelled with the VMIM's uid),
//! the CNI ADD of that pod as Multus makes it (the VM's MAC from the
//! network selection element, a fresh namespace with the kernel's default
//! sysctls: IPv6 on), virt-launcher's bridge and tap in it and QEMU
//! `-incoming`, the VMI's `migrationState`, then QMP `migrate`. QEMU's own
//! RARP self-announce (its `announce-*` parameters set on the target) is
//! the only announcement; `migrationState.completed` comes after the
//! guest resumed, then the source pod's deletion and DEL.
//!
//! Under TCG the source is paused before the copy (stop-and-copy). QEMU
//! 7.2's TCG precopy, copying while the guest runs, left the target's memory
//! corrupt in roughly one migration in five to twenty under a 1 ms packet
//! stream: reproduced with two QEMUs on a plain Linux bridge, no vmpath, the
//! target's kernel dying in its page allocator or virtio_net seconds after
//! it resumed. The data path sees the same move either way (the guest stops
//! on the source, resumes on the target, QEMU's RARP announces it); only the
//! pause is longer. With KVM the copy runs live.
//!
//! Shared by `tests/tests/real_migration.rs` and the bench's
//! `realmigration` section; on the pod network ([`BedNetwork::Pod`]: each
//! virt-launcher pod's `eth0`, Multus's default-network ADD) by
//! `tests/tests/pod_network_guest.rs`.

use std::{
    path::{Path, PathBuf},
    process::Child,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use super::{Accel, Guest, GuestNet, Pod, QemuVm};
use crate::{
    Netns, Node, Underlay,
    kube_api::ApiServer,
    kubevirt::{self, Migration, pods},
    migration::{NODE_IPS, UNDERLAY_MTU, port_flags},
    multus, unique_tag,
    vmpath::common::{PORT_F_PENDING, drop_reason::MIGRATION_NOT_RESUMED},
    wait_for,
};

const NETWORK: &str = include_str!("../../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../../agent/src/derive/fixtures/vm.yaml");
const VM_POD_NETWORK: &str = include_str!("../../../agent/src/derive/fixtures/vm-pod-network.yaml");
/// KubeVirt's name for the pod interface of network `blue`.
const IFNAME: &str = "pod16477688c0e";
/// The virt-launcher pods' uid in both fixtures.
const POD_UID: &str = "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b";
const NAMESPACE: &str = "prod";
pub const VM1_MAC: &str = "02:00:00:31:00:0b";
pub const VM1_IP: &str = "10.31.0.11";
pub const VM1_IP6: &str = "fd31::b";
const VM1_POD: &str = "virt-launcher-vm1-x7k2p";
const PEER_MAC: &str = "02:00:00:31:00:0c";
pub const PEER_IP: &str = "10.31.0.12";
pub const PEER_IP6: &str = "fd31::c";
const PEER_POD: &str = "virt-launcher-peer-z3m4n";
pub const GATEWAY: &str = "10.31.0.1";
pub const GATEWAY6: &str = "fd31::1";
const SUBNET6: &str = "fd31::/64";

/// Echo requests in each stream, one per millisecond: 12 s, for a TCG
/// guest's stop-and-copy pause of 1-4 s on a busy machine and the streams
/// running on past KubeVirt's word.
pub const STREAM_COUNT: u64 = 12000;

/// The copy's bandwidth cap, bytes/s: far above what a unix socket
/// between two local QEMUs reaches.
const MIGRATION_BANDWIDTH: u64 = 8 << 30;

/// TCP ports of the guest's echo servers (busybox nc serves one
/// connection each): IPv4 and IPv6.
const ECHO_PORT: u16 = 7000;
const ECHO_PORT6: u16 = 7006;

/// Echo requests (200 ms apart) the peer sends the guest on the source
/// while the target pod's interface is up and nothing has moved: the pod
/// kernel's own frames (DAD, MLD, router solicitation) come within about
/// 2 s of the link coming up.
const WINDOW_PINGS: u32 = 15;

/// The vmpath network the guests' interface is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BedNetwork {
    /// A Multus secondary network beside KubeVirt's own pod network: blue,
    /// routed with a /32 and a /128 advertised per VM, on the interface
    /// KubeVirt names `pod16477688c0e`, the VM's MAC in its network
    /// selection element.
    Secondary,
    /// The pod network (docs/kubernetes.md): blue with `role: Primary`,
    /// the VMs' `multus: {networkName: prod/blue, default: true}` network,
    /// so each virt-launcher pod's `eth0` (Multus's ADD for
    /// `v1.multus-cni.io/default-network`: no selection element, no MAC).
    /// The agents know the cluster's pod and Service CIDRs (those of
    /// [`crate::cluster_net`]), and DHCP hands out the DNS Service's
    /// ClusterIP as resolver with the cluster's search domains.
    Pod,
}

impl BedNetwork {
    /// The virt-launcher pod's interface for blue.
    pub fn ifname(self) -> &'static str {
        match self {
            BedNetwork::Secondary => IFNAME,
            BedNetwork::Pod => "eth0",
        }
    }
}

/// The CNI ADD of a virt-launcher pod's interface (pod uid `uid`) as
/// Multus makes it on `net`; the host port.
fn launcher_add(net: BedNetwork, node: &Node, c: &multus::Call, mac: &str, uid: &str) -> String {
    let (ok, result) = match net {
        BedNetwork::Secondary => kubevirt::cni_add_with_mac(node, c, mac),
        BedNetwork::Pod => multus::add_default_network(node, c, uid),
    };
    assert!(ok, "ADD of {} on {}: {result}", c.pod, node.name);
    kubevirt::host_port(&result)
}

fn parse(text: &str) -> Vec<Value> {
    vmpath::config::source::parse(text.as_bytes()).expect("a fixture")
}

/// The VMI, virt-launcher pod and IPAMClaim of a VM from the fixture
/// for `net`, renamed, on `node`, with `ips` in its claim.
fn vm_objects(
    net: BedNetwork,
    name: &str,
    pod: &str,
    uid_tail: &str,
    node: &str,
    mac: &str,
    ips: &[String],
) -> Vec<Value> {
    let fixture = match net {
        BedNetwork::Secondary => VM,
        BedNetwork::Pod => VM_POD_NETWORK,
    };
    let text = fixture
        .replace("node-a", node)
        .replace("virt-launcher-vm1-x7k2p", pod)
        .replace("vm1", name)
        .replace("3f2e1d0c9b8a", uid_tail)
        .replace(VM1_MAC, mac);
    let mut out = parse(&text);
    for o in &mut out {
        if o["kind"] == "IPAMClaim" {
            o["status"]["ips"] = json!(ips);
        }
    }
    out
}

/// The cluster: the vmpath Network as `net` has it, dual-stack, its NAD,
/// three v1 Nodes, vm1 on a and the peer on c.
fn cluster(net: BedNetwork) -> Vec<Value> {
    let mut out = parse(NETWORK);
    for o in &mut out {
        if o["kind"] == "Network" {
            o["spec"]["subnets"] = json!(["10.31.0.0/24", SUBNET6]);
            o["spec"]["defaultGatewayIPs"] = json!([GATEWAY, GATEWAY6]);
            match net {
                BedNetwork::Secondary => {
                    o["spec"]["egress"] = "Routed".into();
                    o["spec"]["advertise"] = json!({"perVM": true});
                }
                BedNetwork::Pod => {
                    let domain = crate::cluster_net::DOMAIN;
                    o["spec"]["role"] = "Primary".into();
                    o["spec"]["dhcp"] = json!({
                        "dnsServers": [crate::cluster_net::DNS_IP],
                        "searchDomains": [
                            format!("{NAMESPACE}.svc.{domain}"),
                            format!("svc.{domain}"),
                            domain,
                        ],
                    });
                }
            }
        }
    }
    out.retain(|o| o["kind"] != "Node");
    for (name, ip) in NODE_IPS {
        out.push(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
        }));
    }
    out.extend(vm_objects(
        net,
        "vm1",
        VM1_POD,
        "3f2e1d0c9b8a",
        "a",
        VM1_MAC,
        &[format!("{VM1_IP}/24"), format!("{VM1_IP6}/64")],
    ));
    out.extend(vm_objects(
        net,
        "peer",
        PEER_POD,
        "3f2e1d0c9b8c",
        "c",
        PEER_MAC,
        &[format!("{PEER_IP}/24"), format!("{PEER_IP6}/64")],
    ));
    out
}

/// Three nodes on one underlay, their agents on the one API server: the
/// guest (vm1) on a, the peer on c; b takes the guest on the first
/// migration, and the guest moves back and forth from there.
pub struct RealBed {
    pub nodes: [Node; 3],
    pub server: ApiServer,
    /// The guest and the index of the node it runs on.
    pub vm1: QemuVm,
    pub at: usize,
    /// The peer VM on c (its pod's namespace, the VM's addresses on the
    /// pod interface).
    pub peer: Netns,
    /// The network the guest's interface is on.
    pub net: BedNetwork,
    /// The guest's current virt-launcher pod.
    pod: String,
    /// Each node's NAD config, as Multus passes it there.
    conf: [String; 3],
    tag: String,
    rounds: usize,
    _underlay: Underlay,
}

impl RealBed {
    /// Builds the nodes and the cluster's objects, makes vm1's pod on a
    /// (the CNI ADD as Multus makes it, then virt-launcher's bridge and
    /// tap), boots the guest there and waits until it has its DHCP and
    /// DHCPv6 leases and the RA's prefix, and the peer reaches it over both
    /// families. Blue is a secondary network.
    pub fn boot() -> RealBed {
        RealBed::boot_on(BedNetwork::Secondary)
    }

    /// [`RealBed::boot`] with the guest's and the peer's interfaces on `net`.
    pub fn boot_on(net: BedNetwork) -> RealBed {
        let ifname = net.ifname();
        let underlay = Underlay::new();
        let mut nodes = [Node::new("a"), Node::new("b"), Node::new("c")];
        for (node, (_, ip)) in nodes.iter().zip(NODE_IPS) {
            underlay.plug(&node.ns, "ul0", &format!("{ip}/24"), UNDERLAY_MTU);
        }
        let server = ApiServer::start_at(&nodes[0].ns.path(), NODE_IPS[0].1);
        for o in cluster(net) {
            server.put(o);
        }
        // The claims as vmpath controller allocated them, in its ledger.
        server.vouch_for_claims();
        for node in &mut nodes {
            let kubeconfig = node.state_dir.join("kubeconfig");
            std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
            let mut args = vec![
                "--source".to_string(),
                "kubernetes".into(),
                "--kubeconfig".into(),
                kubeconfig.to_str().unwrap().into(),
            ];
            if net == BedNetwork::Pod {
                use crate::cluster_net::{POD_CIDR, POD_CIDR6, SERVICE_CIDR, SERVICE_CIDR6};
                args.extend([
                    "--cluster-pod-cidrs".to_string(),
                    format!("{POD_CIDR},{POD_CIDR6}"),
                    "--cluster-service-cidrs".into(),
                    format!("{SERVICE_CIDR},{SERVICE_CIDR6}"),
                ]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            node.set_agent_args(&args);
            node.start_agent();
        }
        for node in &nodes {
            wait_for(
                &format!("node {} lists the cluster and joins the overlay", node.name),
                // Loading the programs alone takes 30 s on a busy 2-core machine.
                Duration::from_secs(120),
                || {
                    node.agent_log().contains("overlay ready")
                        && node.attachment_view("vm1").is_some()
                        && node.attachment_view("peer").is_some()
                },
            );
        }
        let tag = unique_tag();
        let conf = [0, 1, 2].map(|i| multus::nad_conf(NETWORK, &nodes[i]));
        let cni_add = |node: usize, pod: &str, ns: &Netns, mac: &str| -> String {
            let call = multus::Call {
                conf: &conf[node],
                pod_namespace: NAMESPACE,
                pod,
                ifname,
                netns: ns,
                container: &format!("c{tag}{pod}"),
            };
            launcher_add(net, &nodes[node], &call, mac, POD_UID)
        };

        // The peer: a VM played by its pod's namespace, both families on
        // the pod interface (vmpath-cni switched its IPv6 off).
        let peer = kubevirt::fresh_pod_netns(format!("vt{tag}-peer"));
        cni_add(2, PEER_POD, &peer, PEER_MAC);
        // The VM's MAC (the pod network's ADD asks for none).
        peer.run(&["ip", "link", "set", ifname, "address", PEER_MAC]);
        peer.run(&[
            "sysctl",
            "-qw",
            &format!("net.ipv6.conf.{ifname}.disable_ipv6=0"),
        ]);
        peer.run(&["ip", "addr", "add", &format!("{PEER_IP}/24"), "dev", ifname]);
        peer.run(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{PEER_IP6}/64"),
            "dev",
            ifname,
            "nodad",
        ]);

        let ns = kubevirt::fresh_pod_netns(format!("vt{tag}-vm1"));
        let port = cni_add(0, VM1_POD, &ns, VM1_MAC);
        let vm1 = QemuVm::boot_in(Pod::launcher(ns, ifname, port), VM1_MAC, GuestNet::Dhcp);
        let bed = RealBed {
            nodes,
            server,
            vm1,
            at: 0,
            peer,
            net,
            pod: VM1_POD.to_string(),
            conf,
            tag,
            rounds: 0,
            _underlay: underlay,
        };
        let lease = bed.vm1.wait_lease();
        assert_eq!(
            lease.get("ip").map(String::as_str),
            Some(VM1_IP),
            "the guest's lease: {lease:?}"
        );
        // IPv6: the address by DHCPv6 (the claim's, a /128), vmpath's RA
        // gives the on-link prefix (a secondary network: no default route).
        bed.vm1.start_dhcp6();
        let lease6 = bed.vm1.wait_lease6();
        assert_eq!(
            (
                lease6.get("ip6").map(String::as_str),
                lease6.get("prefixlen").map(String::as_str)
            ),
            (Some(VM1_IP6), Some("128")),
            "the guest's DHCPv6 lease: {lease6:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(70);
        loop {
            let routes = bed.vm1.run("ip -6 route show");
            // The prefix route an RA installs expires; the /128's does not.
            if routes
                .lines()
                .any(|l| l.starts_with(SUBNET6) && l.contains("expires"))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the guest took no RA from vmpath (its on-link prefix) in 70 s: \
                 routes {routes:?}; {}; vmpath vm show on a:\n{}",
                bed.vm1.run_status("ip -6 addr show dev eth0; cat /proc/sys/net/ipv6/conf/eth0/accept_ra /proc/sys/net/ipv6/conf/eth0/forwarding").1,
                kubevirt::vm_show(&bed.nodes[0], "prod/vm1")
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        // Past DAD: usable as a source (a ping to the gateway alone
        // would pass from the link-local address meanwhile).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let addrs = bed.vm1.run("ip -6 addr show dev eth0");
            let entry = addrs
                .lines()
                .find(|l| l.contains(&format!("{VM1_IP6}/128")))
                .unwrap_or_default();
            if !entry.is_empty() && !entry.contains("tentative") {
                assert!(!entry.contains("dadfailed"), "DAD failed: {addrs}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the guest's DHCPv6 address not past DAD in 30 s: {addrs}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        assert_eq!(
            bed.vm1
                .run_status(&format!("ping6 -c 3 -i 0.2 -W 2 {GATEWAY6}"))
                .0,
            0,
            "guest -> its IPv6 gateway on a"
        );
        for dst in [VM1_IP, VM1_IP6] {
            assert!(
                bed.peer.ping(dst, 3),
                "peer (c) -> guest (a) at {dst}; the guest's addresses: {}; routes: {}",
                bed.vm1.run("ip addr show dev eth0"),
                bed.vm1.run("ip -6 route show")
            );
        }
        assert!(bed.vm1.ping(GATEWAY), "guest -> its gateway on a");
        bed
    }

    fn name(&self, i: usize) -> String {
        self.nodes[i].name.clone()
    }

    /// The CNI call for `pod` on node `i`, as Multus makes it.
    fn call<'a>(
        &'a self,
        i: usize,
        pod: &'a str,
        container: &'a str,
        netns: &'a Netns,
    ) -> multus::Call<'a> {
        multus::Call {
            conf: &self.conf[i],
            pod_namespace: NAMESPACE,
            pod,
            ifname: self.net.ifname(),
            netns,
            container,
        }
    }
}

/// One ping stream through a migration, as the peer saw it.
#[derive(Clone, Debug)]
pub struct Stream {
    pub sent: u64,
    pub answered: u64,
    /// Longest silence between replies, ms.
    pub gap_ms: f64,
    /// RESUME on the target to the first reply after it, ms.
    pub resume_to_reply_ms: f64,
}

/// One TCP echo connection through a migration.
#[derive(Clone, Debug)]
pub struct Tcp {
    /// Echoes exchanged, and how many after the migration completed.
    pub echoes: u64,
    pub echoes_after: u64,
    /// Why the client failed, if it did.
    pub error: Option<String>,
}

/// What one real migration did.
#[derive(Clone, Debug)]
pub struct RealMigration {
    /// The source was paused before the copy (TCG guests: see the module
    /// comment), not copied while it ran.
    pub stop_and_copy: bool,
    /// Longest silence in the peer's 1 ms IPv4 ping replies, ms.
    pub gap_ms: f64,
    /// QEMU's own downtime (`query-migrate` on the source), ms.
    pub downtime_ms: f64,
    /// The guest really paused: STOP on the source to RESUME on the
    /// target (QMP event times), ms.
    pub pause_ms: f64,
    /// RESUME on the target to the first IPv4 ping reply after it, ms.
    pub resume_to_reply_ms: f64,
    /// RESUME to QEMU's first RARP on the target pod's NIC, ms.
    pub resume_to_rarp_ms: f64,
    /// That RARP to the first ping arriving on the target pod's NIC: the
    /// data path's cut-over as the stream sees it, ms.
    pub rarp_to_request_ms: f64,
    /// That ping to the guest's reply on the pod's NIC, ms.
    pub request_to_reply_ms: f64,
    /// QEMU's total migration time, ms.
    pub total_ms: f64,
    /// IPv4 pings sent and answered in the stream.
    pub sent: u64,
    pub answered: u64,
    /// The IPv6 stream, beside the IPv4 one.
    pub ipv6: Stream,
    /// The IPv4 TCP connection: echoes, after the migration, error.
    pub echoes: u64,
    pub echoes_after: u64,
    pub tcp_error: Option<String>,
    /// The IPv6 TCP connection.
    pub tcp6: Tcp,
    /// The guest's neighbour entries for its gateway before and after:
    /// IPv4 and IPv6.
    pub gw_before: String,
    pub gw_after: String,
    pub gw6_before: String,
    pub gw6_after: String,
    /// A RARP from the guest's MAC seen on the target pod's NIC.
    pub rarp_seen: bool,
    /// Before QEMU's migration, with the target pod's interface up: the
    /// peer's echo replies from the guest on the source (IPv4, IPv6) of
    /// [`WINDOW_PINGS`] each, and what `vmpath vm show` said on the target
    /// node (node, migration).
    pub window_replies: (u64, u64),
    pub window_show: (String, String),
    /// Node the guest left and node it runs on now.
    pub from: String,
    pub to: String,
}

impl RealMigration {
    /// The gap beyond QEMU's own reported downtime, ms.
    pub fn added_ms(&self) -> f64 {
        self.gap_ms - self.downtime_ms
    }

    /// The gap beyond the guest's real pause (source STOP to target
    /// RESUME), ms: what the network adds.
    pub fn added_to_pause_ms(&self) -> f64 {
        self.gap_ms - self.pause_ms
    }
}

/// Sends `count` ICMP (ICMPv6 for an IPv6 `dst`) echo requests to `dst`,
/// one per millisecond whatever comes back (unlike ping, which holds back
/// when replies stop), and prints "seq wall-clock-seconds" for each reply.
/// Makes the file `ready` at the first reply.
fn pinger(ns: &Netns, dst: &str, count: u64, ready: &Path) -> Child {
    let v6 = if dst.contains(':') { "True" } else { "False" };
    ns.spawn(&[
        "python3",
        "-c",
        &format!(
            "import os, socket, struct, threading, time
v6 = {v6}
if v6:
    s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
    request, reply = 128, 129
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    request, reply = 8, 0
ident = os.getpid() & 0xffff
payload = b'x' * 56
def csum(b):
    t = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    t = (t >> 16) + (t & 0xffff)
    t += t >> 16
    return ~t & 0xffff
got = {{}}
end = time.monotonic() + {count} / 1000 + 3
def rx():
    s.settimeout(0.2)
    while time.monotonic() < end:
        try:
            d, _ = s.recvfrom(2048)
        except socket.timeout:
            continue
        # An IPv6 raw socket gets no IP header; the kernel fills in the
        # ICMPv6 checksum on sending.
        off = 0 if v6 else (d[0] & 15) * 4
        typ, _, _, i, q = struct.unpack('!BBHHH', d[off:off + 8])
        if typ == reply and i == ident and q not in got:
            got[q] = time.time()
            if len(got) == 1:
                open('{ready}', 'w').close()
th = threading.Thread(target=rx)
th.start()
t0 = time.monotonic()
for q in range({count}):
    c = 0 if v6 else csum(struct.pack('!BBHHH', request, 0, 0, ident, q) + payload)
    try:
        s.sendto(struct.pack('!BBHHH', request, 0, c, ident, q) + payload, ('{dst}', 0))
    except OSError:
        pass
    w = t0 + (q + 1) / 1000 - time.monotonic()
    if w > 0:
        time.sleep(w)
th.join()
for q in sorted(got):
    print(q, '%.6f' % got[q])
",
            ready = ready.display()
        ),
    ])
}

/// The reply times a [`pinger`] printed, sorted, and the stream's figures.
fn stream(ping: Child, resumed: Option<f64>) -> Stream {
    let ping = ping.wait_with_output().unwrap();
    assert!(
        ping.status.success(),
        "the ping stream: {}",
        String::from_utf8_lossy(&ping.stderr)
    );
    let mut stamps: Vec<f64> = String::from_utf8_lossy(&ping.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    stamps.sort_by(f64::total_cmp);
    Stream {
        sent: STREAM_COUNT,
        answered: stamps.len() as u64,
        gap_ms: stamps
            .windows(2)
            .map(|w| (w[1] - w[0]) * 1e3)
            .fold(0.0, f64::max),
        resume_to_reply_ms: resumed
            .and_then(|r| stamps.iter().find(|&&t| t > r).map(|t| (t - r) * 1e3))
            .unwrap_or(f64::NAN),
    }
}

fn ms_between(from: Option<f64>, to: Option<f64>) -> f64 {
    match (from, to) {
        (Some(a), Some(b)) => (b - a) * 1e3,
        _ => f64::NAN,
    }
}

/// A TCP client in `ns`: one connection to `dst`'s echo server on `port`
/// (connecting within 5 s), a line every 10 ms until `stop` exists; fails
/// on any error or reconnect. Prints "echoes <n> after <m>" (m: after
/// `done` appeared).
fn tcp_client(ns: &Netns, dst: &str, port: u16, stop: &Path, done: &Path) -> Child {
    ns.spawn(&[
        "python3",
        "-c",
        &format!(
            "import os, socket, time
s = socket.create_connection(('{dst}', {port}), timeout=5)
s.settimeout(10)
f = s.makefile('rb')
n = after = 0
err = None
try:
    while not os.path.exists('{stop}'):
        msg = b'%d\\n' % n
        s.sendall(msg)
        line = f.readline()
        if line != msg:
            raise RuntimeError('echo %r for %r' % (line, msg))
        n += 1
        if os.path.exists('{done}'):
            after += 1
        time.sleep(0.01)
except Exception as e:
    err = e
print('echoes', n, 'after', after, 'error', repr(err) if err else '')
raise SystemExit(1 if err else 0)
",
            stop = stop.display(),
            done = done.display()
        ),
    ])
}

fn tcp_result(tcp: Child) -> Tcp {
    let tcp = tcp.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&tcp.stdout).into_owned();
    let mut words = out.split_whitespace();
    Tcp {
        echoes: words.nth(1).and_then(|n| n.parse().ok()).unwrap_or(0),
        echoes_after: words.nth(1).and_then(|n| n.parse().ok()).unwrap_or(0),
        error: (!tcp.status.success())
            .then(|| format!("{out}{}", String::from_utf8_lossy(&tcp.stderr))),
    }
}

/// Echo replies `ns` gets from `dst` of `count` requests 200 ms apart.
fn replies(ns: &Netns, dst: &str, count: u32) -> u64 {
    let out = ns.run_status(&[
        "ping",
        "-n",
        "-c",
        &count.to_string(),
        "-i",
        "0.2",
        "-W",
        "1",
        dst,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.contains("packets transmitted"))
        .and_then(|l| {
            let words: Vec<&str> = l.split([' ', ',']).filter(|w| !w.is_empty()).collect();
            let i = words.iter().position(|w| *w == "received")?;
            words[i - 1].parse().ok()
        })
        .unwrap_or_else(|| panic!("no ping summary: {text}"))
}

/// `key:` in `vmpath vm show`'s output.
fn shown(show: &str, key: &str) -> String {
    show.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// Migrates the guest to the next node (a -> b, b -> a, ...) as KubeVirt
/// does, under a 1 ms ping stream in each family and a TCP echo
/// connection in each from the peer on c. Asserts, before QEMU migrates,
/// that the target pod's interface has no address of its own and sent
/// nothing the target node dropped as not the VM
/// (`migration_not_resumed`); what the peer saw then is in the result.
pub fn migrate(bed: &mut RealBed) -> RealMigration {
    let from = bed.at;
    let to = if from == 0 { 1 } else { 0 };
    bed.rounds += 1;
    let round = bed.rounds;
    let (from_name, to_name) = (bed.name(from), bed.name(to));
    let target_pod = format!("virt-launcher-vm1-m{round}");
    let name = format!("mig{round}");
    let uid = format!("7c6b5a49-3827-4160-9f5e-4d3c2b1a{round:04x}");
    let source_pod = bed.pod.clone();
    let m = Migration {
        namespace: NAMESPACE,
        vmi: "vm1",
        name: &name,
        uid: &uid,
        source_node: &from_name,
        target_node: &to_name,
        source_pod: &source_pod,
        target_pod: &target_pod,
    };

    // The guest knows its gateway; the migration must not change that.
    assert!(bed.vm1.ping(GATEWAY));
    assert_eq!(
        bed.vm1
            .run_status(&format!("ping6 -c 3 -i 0.2 -W 2 {GATEWAY6}"))
            .0,
        0,
        "guest -> its IPv6 gateway"
    );
    let gw_before = bed
        .vm1
        .neighbour(GATEWAY)
        .expect("guest ARP entry for the gateway");
    let gw6_before = bed
        .vm1
        .neighbour(GATEWAY6)
        .expect("guest neighbour entry for the IPv6 gateway");
    let dir = std::env::temp_dir().join(format!("vmpath-realmig-{}-{round}", bed.tag));
    std::fs::create_dir_all(&dir).unwrap();
    let (stop, done): (PathBuf, PathBuf) = (dir.join("stop"), dir.join("done"));
    for port in [ECHO_PORT, ECHO_PORT6] {
        bed.vm1.run(&format!(
            "busybox nc -l -p {port} -e cat </dev/null >/dev/null 2>&1 &"
        ));
        wait_for("the guest's echo server", Duration::from_secs(20), || {
            bed.vm1
                .run_status(&format!("netstat -ltn | grep -q ':{port} '"))
                .0
                == 0
        });
    }

    // KubeVirt: the VMIM and the target pod; Multus calls vmpath-cni for
    // it in a new namespace with the kernel's defaults.
    bed.server.put(m.vmim("Scheduling"));
    let target_uid = format!("3b2a1c0d-9e8f-4a7b-8c6d-5e4f3a2b{round:04x}");
    bed.server.put(m.target_pod(&bed.server, &target_uid));
    let target_ns = kubevirt::fresh_pod_netns(format!("vt{}-m{round}", bed.tag));
    let not_resumed_before = bed.nodes[to].drops(MIGRATION_NOT_RESUMED);
    let container = format!("c{}{target_pod}", bed.tag);
    let target_port = launcher_add(
        bed.net,
        &bed.nodes[to],
        &bed.call(to, &target_pod, &container, &target_ns),
        VM1_MAC,
        &target_uid,
    );
    let ifname = bed.net.ifname();
    let show = target_ns.run(&["ip", "-j", "link", "show", "dev", ifname]);
    let show: Value = serde_json::from_str(&show).unwrap();
    // The VM's MAC where the selection element asks for it (the pod
    // network has none).
    let mac_wanted = match bed.net {
        BedNetwork::Secondary => Some(VM1_MAC),
        BedNetwork::Pod => show[0]["address"].as_str(),
    };
    assert_eq!(
        (show[0]["address"].as_str(), show[0]["operstate"].as_str()),
        (mac_wanted, Some("UP")),
        "the target pod's interface: {show}"
    );
    // The peer connects now (both families), and pings the guest on the
    // source while the target pod's interface is up with the VM's MAC.
    let tcp4 = tcp_client(&bed.peer, VM1_IP, ECHO_PORT, &stop, &done);
    let tcp6 = tcp_client(&bed.peer, VM1_IP6, ECHO_PORT6, &stop, &done);
    let window_replies = (
        replies(&bed.peer, VM1_IP, WINDOW_PINGS),
        replies(&bed.peer, VM1_IP6, WINDOW_PINGS),
    );
    let show = kubevirt::vm_show(&bed.nodes[to], "prod/vm1");
    let window_show = (shown(&show, "node"), shown(&show, "migration"));
    // That pod's kernel kept quiet: no address to speak from, nothing
    // from the VM's MAC the target node had to refuse.
    assert!(
        kubevirt::no_ipv6_address(&target_ns, ifname),
        "the target pod's kernel made itself an IPv6 address: {}",
        target_ns.run(&["ip", "-6", "addr", "show", "dev", ifname])
    );
    let not_resumed = bed.nodes[to].drops(MIGRATION_NOT_RESUMED) - not_resumed_before;
    assert_eq!(
        not_resumed, 0,
        "the target pod's own kernel sent {not_resumed} frames from the VM's MAC (dropped as migration_not_resumed on {to_name})"
    );

    // virt-launcher: the bridge and tap, QEMU waiting for the state.
    let target = QemuVm::incoming_in(
        Pod::launcher(target_ns, ifname, target_port.clone()),
        &bed.vm1,
    );
    bed.server.put(m.vmim("TargetReady"));
    m.set_state(&bed.server, &from_name, json!({}));
    bed.server.put(m.vmim("Running"));
    wait_for(
        &format!("{from_name} knows the migration"),
        Duration::from_secs(10),
        || {
            bed.nodes[from]
                .attachment_view("vm1")
                .is_some_and(|v| v["migration"] == "pending")
        },
    );
    assert!(
        port_flags(&bed.nodes[to], &target_port).is_some_and(|f| f & PORT_F_PENDING != 0),
        "{to_name} serves the target port pending until the guest resumes"
    );

    // What crosses the target pod's NIC around the cut-over, time-stamped.
    let capture = target.pod.ns.spawn(&[
        "timeout",
        "15",
        "tcpdump",
        "-i",
        ifname,
        "-l",
        "-n",
        "-e",
        "-tt",
        "-c",
        "6000",
        "rarp or icmp or icmp6",
    ]);
    // 1 ms echo requests for 8 s in each family (a TCG guest's
    // stop-and-copy pause is 1-3 s), answered by the guest's kernel.
    let (ready4, ready6) = (dir.join("ready4"), dir.join("ready6"));
    let pinger4 = pinger(&bed.peer, VM1_IP, STREAM_COUNT, &ready4);
    let pinger6 = pinger(&bed.peer, VM1_IP6, STREAM_COUNT, &ready6);
    // Python starts slowly on a busy machine: the streams run before the
    // guest stops, or they would not see the pause.
    wait_for(
        "both ping streams answered",
        Duration::from_secs(30),
        || ready4.exists() && ready6.exists(),
    );

    let mut tq = target.qmp();
    tq.execute(
        "migrate-set-parameters",
        json!({"announce-initial": 50, "announce-max": 550, "announce-rounds": 5, "announce-step": 100}),
    );
    let mut sq = bed.vm1.qmp();
    // QEMU's default cap (128 MiB/s) would make the copy, not the data
    // path, the longest part of the move.
    sq.execute(
        "migrate-set-parameters",
        json!({"max-bandwidth": MIGRATION_BANDWIDTH}),
    );
    let stop_and_copy = bed.vm1.accel == Accel::Tcg;
    let started = Instant::now();
    if stop_and_copy {
        sq.execute("stop", json!({}));
    }
    sq.execute("migrate", json!({"uri": target.migrate_uri()}));
    let info = loop {
        let info = sq.execute("query-migrate", json!({}));
        match info["status"].as_str() {
            Some("completed") => break info,
            Some("failed") | Some("cancelled") => panic!("migration failed: {info}"),
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "migration did not complete: {info}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    if stop_and_copy {
        // A source paused before the copy leaves its target paused.
        tq.wait_status("paused");
        tq.execute("cont", json!({}));
    }
    tq.wait_status("running");
    let stopped = sq.event_time("STOP");
    let resumed = tq.event_time("RESUME");
    std::fs::write(&done, b"").unwrap();
    let source = std::mem::replace(&mut bed.vm1, target);
    bed.at = to;
    bed.pod = target_pod.clone();
    // KubeVirt's word, 2 s later (a stream that waited for it would show
    // a gap of the pause plus 2 s): the data path moved the VM already.
    std::thread::sleep(Duration::from_millis(2000));
    // Then the source pod ends; its DEL releases nothing.
    m.set_state(
        &bed.server,
        &to_name,
        json!({"completed": true, "endTimestamp": "2026-12-01T10:00:09Z",
               "targetNodeDomainReadyTimestamp": "2026-12-01T10:00:08Z",
               "targetNodeDomainDetected": true}),
    );
    bed.server.put(m.vmim("Succeeded"));
    bed.server.delete(&pods(), NAMESPACE, &source_pod);
    let container = format!("c{}{source_pod}", bed.tag);
    let (ok, result) = multus::call(
        &bed.nodes[from],
        "DEL",
        &bed.call(from, &source_pod, &container, &source.pod.ns),
    );
    assert!(ok, "DEL of the source pod: {result}");
    drop(source);
    let ipv4 = stream(pinger4, resumed);
    let ipv6 = stream(pinger6, resumed);
    std::fs::write(&stop, b"").unwrap();
    let tcp = tcp_result(tcp4);
    let tcp6 = tcp_result(tcp6);
    let capture = capture.wait_with_output().unwrap();
    let capture = String::from_utf8_lossy(&capture.stdout).into_owned();
    let first = |what: &str, after: f64| -> Option<f64> {
        capture
            .lines()
            .filter(|l| l.contains(what))
            .filter_map(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .find(|&t| t >= after)
    };
    let rarp_at = first("Reverse ARP", 0.0);
    bed.vm1.wait_resumed();
    let gw_after = bed.vm1.neighbour(GATEWAY).unwrap_or_default();
    let gw6_after = bed.vm1.neighbour(GATEWAY6).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);

    RealMigration {
        stop_and_copy,
        gap_ms: ipv4.gap_ms,
        downtime_ms: info["downtime"].as_f64().unwrap_or(f64::NAN),
        pause_ms: match (stopped, resumed) {
            (Some(s), Some(r)) => (r - s) * 1e3,
            _ => f64::NAN,
        },
        resume_to_reply_ms: ipv4.resume_to_reply_ms,
        total_ms: info["total-time"].as_f64().unwrap_or(f64::NAN),
        sent: ipv4.sent,
        answered: ipv4.answered,
        ipv6,
        echoes: tcp.echoes,
        echoes_after: tcp.echoes_after,
        tcp_error: tcp.error,
        tcp6,
        gw_before,
        gw_after,
        gw6_before,
        gw6_after,
        rarp_seen: capture.lines().any(|l| {
            l.contains("Reverse ARP") && l.starts_with(char::is_numeric) && l.contains(VM1_MAC)
        }),
        window_replies,
        window_show,
        resume_to_rarp_ms: ms_between(resumed, rarp_at),
        rarp_to_request_ms: ms_between(rarp_at, rarp_at.and_then(|r| first("echo request", r))),
        request_to_reply_ms: rarp_at
            .and_then(|r| first("echo request", r))
            .map_or(f64::NAN, |q| ms_between(Some(q), first("echo reply", q))),
        from: from_name,
        to: to_name,
    }
}
