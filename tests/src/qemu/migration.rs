//! A real live migration over the overlay: a QEMU guest moves between
//! virt-launcher pods on two nodes while a client on a third node pings it
//! every millisecond and holds a TCP connection to it. QEMU does it all:
//! the target runs with `-incoming`, the source gets QMP `migrate`, and the
//! target's own RARP self-announce (its `announce-*` parameters set on the
//! target) is what the data path sees; the test sends no GARP.
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
//! `realmigration` section.

use std::{
    path::PathBuf,
    process::Child,
    time::{Duration, Instant},
};

use serde_json::json;

use super::{Accel, Guest, GuestNet, QemuVm, pod_port};
use crate::{
    Node, Underlay, Vm,
    migration::{
        CLIENT_IP, CLIENT_MAC, GATEWAY, NET, NODE_IPS, UNDERLAY_MTU, VM1_IP, VM1_MAC, network_doc,
    },
    wait_for, yaml, yaml_overlay,
};

/// Echo requests in the stream, one per millisecond.
pub const STREAM_COUNT: u64 = 8000;

/// The copy's bandwidth cap, bytes/s: far above what a unix socket
/// between two local QEMUs reaches.
const MIGRATION_BANDWIDTH: u64 = 8 << 30;

/// TCP port of the guest's echo server.
const ECHO_PORT: u16 = 7000;

/// Three nodes on one underlay: the guest (vm1) on a, the client on c; b
/// takes the guest on the first migration, and the guest moves back and
/// forth from there.
pub struct RealBed {
    pub nodes: [Node; 3],
    /// The guest and the index of the node it runs on.
    pub vm1: QemuVm,
    pub at: usize,
    pub client: Vm,
    rounds: usize,
    _underlay: Underlay,
}

/// Every node's config: vm1 on node `at` (port `port`), migrating to
/// `(node, port, ready)` if given, the client on c.
fn config(
    client_port: &str,
    at: &str,
    port: &str,
    migration: Option<(&str, &str, bool)>,
) -> String {
    let mut docs: Vec<String> = NODE_IPS
        .iter()
        .map(|(n, ip)| yaml_overlay::node(n, ip))
        .collect();
    docs.push(network_doc());
    let mut vm1 = yaml::attachment("vm1", NET, at, port, VM1_MAC, &[&format!("{VM1_IP}/16")]);
    if let Some((node, target_port, ready)) = migration {
        vm1 += &format!(
            "  migration: {{targetNode: {node}, targetPort: {target_port}, ready: {ready}}}\n"
        );
    }
    docs.push(vm1);
    docs.push(yaml::attachment(
        "client",
        NET,
        "c",
        client_port,
        CLIENT_MAC,
        &[&format!("{CLIENT_IP}/16")],
    ));
    yaml::docs(&docs)
}

impl RealBed {
    /// Builds the nodes, boots the guest on a (static address, gateway
    /// route: the migration test's VM) and waits until the client reaches
    /// it over the overlay.
    pub fn boot() -> RealBed {
        let underlay = Underlay::new();
        let nodes = [Node::new("a"), Node::new("b"), Node::new("c")];
        for (node, (_, ip)) in nodes.iter().zip(NODE_IPS) {
            underlay.plug(&node.ns, "ul0", &format!("{ip}/24"), UNDERLAY_MTU);
        }
        let client = nodes[2].add_vm(
            "cli",
            CLIENT_MAC,
            &[&format!("{CLIENT_IP}/16")],
            Some(GATEWAY),
        );
        let port = pod_port(&nodes[0], "vm1");
        let text = config(&client.port, "a", &port, None);
        let [mut a, mut b, mut c] = nodes;
        for node in [&mut a, &mut b, &mut c] {
            node.write_config("config.yaml", &text);
            node.start_agent();
        }
        let vm1 = QemuVm::boot(
            &a,
            "vm1",
            VM1_MAC,
            GuestNet::Static {
                addr: format!("{VM1_IP}/16"),
                gateway: Some(GATEWAY.into()),
            },
        );
        a.wait_ports(&[&vm1.pod.port]);
        c.wait_ports(&[&client.port]);
        for node in [&a, &b, &c] {
            wait_for(
                &format!("the overlay on node {}", node.name),
                Duration::from_secs(20),
                || node.agent_log().contains("overlay ready"),
            );
        }
        let bed = RealBed {
            nodes: [a, b, c],
            vm1,
            at: 0,
            client,
            rounds: 0,
            _underlay: underlay,
        };
        assert!(bed.client.ping(VM1_IP), "client (c) -> guest (a)");
        assert!(bed.vm1.ping(GATEWAY), "guest -> its gateway on a");
        bed
    }

    fn write_config(&self, at: usize, port: &str, migration: Option<(usize, &str, bool)>) {
        let name = |i: usize| self.nodes[i].name.clone();
        let m = migration.map(|(i, p, r)| (name(i), p, r));
        let text = config(
            &self.client.port,
            &name(at),
            port,
            m.as_ref().map(|(n, p, r)| (n.as_str(), *p, *r)),
        );
        for node in &self.nodes {
            node.write_config("config.yaml", &text);
        }
    }
}

/// What one real migration did.
#[derive(Clone, Debug)]
pub struct RealMigration {
    /// The source was paused before the copy (TCG guests: see the module
    /// comment), not copied while it ran.
    pub stop_and_copy: bool,
    /// Longest silence in the client's 1 ms ping replies, ms.
    pub gap_ms: f64,
    /// QEMU's own downtime (`query-migrate` on the source), ms.
    pub downtime_ms: f64,
    /// The guest really paused: STOP on the source to RESUME on the
    /// target (QMP event times), ms.
    pub pause_ms: f64,
    /// RESUME on the target to the first ping reply after it, ms.
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
    /// Pings sent and answered in the stream.
    pub sent: u64,
    pub answered: u64,
    /// TCP echoes the client exchanged, and how many of them after the
    /// migration completed, on the one connection.
    pub echoes: u64,
    pub echoes_after: u64,
    /// Why the TCP client failed, if it did.
    pub tcp_error: Option<String>,
    /// The guest's ARP entry for its gateway before and after.
    pub gw_before: String,
    pub gw_after: String,
    /// A RARP from the guest's MAC seen on the target pod's NIC.
    pub rarp_seen: bool,
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

/// Sends `count` ICMP echo requests to the guest, one per millisecond
/// whatever comes back (unlike ping, which holds back when replies stop),
/// and prints "seq wall-clock-seconds" for each reply.
fn pinger(ns: &crate::Netns, count: u64) -> Child {
    ns.spawn(&[
        "python3",
        "-c",
        &format!(
            "import os, socket, struct, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
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
        ihl = (d[0] & 15) * 4
        typ, _, _, i, q = struct.unpack('!BBHHH', d[ihl:ihl + 8])
        if typ == 0 and i == ident and q not in got:
            got[q] = time.time()
th = threading.Thread(target=rx)
th.start()
t0 = time.monotonic()
for q in range({count}):
    c = csum(struct.pack('!BBHHH', 8, 0, 0, ident, q) + payload)
    try:
        s.sendto(struct.pack('!BBHHH', 8, 0, c, ident, q) + payload, ('{VM1_IP}', 0))
    except OSError:
        pass
    w = t0 + (q + 1) / 1000 - time.monotonic()
    if w > 0:
        time.sleep(w)
th.join()
for q in sorted(got):
    print(q, '%.6f' % got[q])
"
        ),
    ])
}

fn ms_between(from: Option<f64>, to: Option<f64>) -> f64 {
    match (from, to) {
        (Some(a), Some(b)) => (b - a) * 1e3,
        _ => f64::NAN,
    }
}

/// A TCP client on the client VM: one connection to the guest's echo
/// server, a line every 10 ms until `stop` exists; fails on any error or
/// reconnect. Prints "echoes <n> after <m>" (m: after `done` appeared).
fn tcp_client(ns: &crate::Netns, stop: &std::path::Path, done: &std::path::Path) -> Child {
    ns.spawn(&[
        "python3",
        "-c",
        &format!(
            "import os, socket, time
s = socket.create_connection(('{VM1_IP}', {ECHO_PORT}), timeout=5)
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

/// Migrates the guest to the next node (a -> b, b -> a, ...): a new pod
/// with QEMU `-incoming` there, pending in the config, then QMP `migrate`
/// under a 1 ms ping stream and a TCP echo from the client on c, then the
/// config says `ready: true`.
pub fn migrate(bed: &mut RealBed) -> RealMigration {
    let from = bed.at;
    let to = if from == 0 { 1 } else { 0 };
    bed.rounds += 1;
    let target_name = format!("m{}", bed.rounds);
    let target = QemuVm::incoming(&bed.nodes[to], &target_name, &bed.vm1);
    let source_port = bed.vm1.pod.port.clone();
    bed.write_config(from, &source_port, Some((to, &target.pod.port, false)));
    wait_for("the pending target port", Duration::from_secs(20), || {
        crate::migration::port_flags(&bed.nodes[to], &target.pod.port)
            .is_some_and(|f| f & crate::vmpath::common::PORT_F_PENDING != 0)
    });

    // The guest knows its gateway; the migration must not change that.
    assert!(bed.vm1.ping(GATEWAY));
    let gw_before = bed
        .vm1
        .neighbour(GATEWAY)
        .expect("guest ARP entry for the gateway");

    let dir = std::env::temp_dir().join(format!(
        "vmpath-realmig-{}-{}",
        bed.nodes[0].tag, bed.rounds
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (stop, done): (PathBuf, PathBuf) = (dir.join("stop"), dir.join("done"));
    bed.vm1.run(&format!(
        "busybox nc -l -p {ECHO_PORT} -e cat </dev/null >/dev/null 2>&1 &"
    ));
    wait_for("the guest's echo server", Duration::from_secs(20), || {
        bed.vm1
            .run_status(&format!("netstat -ltn | grep -q ':{ECHO_PORT} '"))
            .0
            == 0
    });
    let tcp = tcp_client(&bed.client.ns, &stop, &done);
    // What crosses the target pod's NIC around the cut-over, time-stamped.
    let capture = target.pod.ns.spawn(&[
        "timeout",
        "15",
        "tcpdump",
        "-i",
        "eth0",
        "-l",
        "-n",
        "-e",
        "-tt",
        "-c",
        "3000",
        "rarp or icmp",
    ]);
    // 1 ms echo requests for 8 s (a TCG guest's stop-and-copy pause is
    // 1-3 s), answered by the guest's kernel.
    let pinger = pinger(&bed.client.ns, STREAM_COUNT);
    std::thread::sleep(Duration::from_millis(1500));

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
    drop(source);
    bed.at = to;
    std::thread::sleep(Duration::from_millis(1000));
    // KubeVirt's ready signal, later: the data path moved the VM already.
    bed.write_config(from, &source_port, Some((to, &bed.vm1.pod.port, true)));
    let ping = pinger.wait_with_output().unwrap();
    std::fs::write(&stop, b"").unwrap();
    let tcp = tcp.wait_with_output().unwrap();
    let tcp_out = String::from_utf8_lossy(&tcp.stdout).into_owned();
    let tcp_error = if tcp.status.success() {
        None
    } else {
        Some(format!("{tcp_out}{}", String::from_utf8_lossy(&tcp.stderr)))
    };
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
    // After the move the VM is plainly on its new node.
    bed.write_config(to, &bed.vm1.pod.port.clone(), None);
    bed.vm1.wait_resumed();
    let gw_after = bed.vm1.neighbour(GATEWAY).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);

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
    let gap_ms = stamps
        .windows(2)
        .map(|w| (w[1] - w[0]) * 1e3)
        .fold(0.0, f64::max);
    let pause_ms = match (stopped, resumed) {
        (Some(s), Some(r)) => (r - s) * 1e3,
        _ => f64::NAN,
    };
    let resume_to_reply_ms = resumed
        .and_then(|r| stamps.iter().find(|&&t| t > r).map(|t| (t - r) * 1e3))
        .unwrap_or(f64::NAN);
    let mut words = tcp_out.split_whitespace();
    let echoes = words.nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    let echoes_after = words.nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    RealMigration {
        stop_and_copy,
        gap_ms,
        downtime_ms: info["downtime"].as_f64().unwrap_or(f64::NAN),
        pause_ms,
        resume_to_reply_ms,
        total_ms: info["total-time"].as_f64().unwrap_or(f64::NAN),
        sent: STREAM_COUNT,
        answered: stamps.len() as u64,
        echoes,
        echoes_after,
        tcp_error,
        gw_before,
        gw_after,
        rarp_seen: capture.lines().any(|l| {
            l.contains("Reverse ARP") && l.starts_with(char::is_numeric) && l.contains(VM1_MAC)
        }),
        resume_to_rarp_ms: ms_between(resumed, rarp_at),
        rarp_to_request_ms: ms_between(rarp_at, rarp_at.and_then(|r| first("echo request", r))),
        request_to_reply_ms: rarp_at
            .and_then(|r| first("echo request", r))
            .map_or(f64::NAN, |q| ms_between(Some(q), first("echo reply", q))),
        from: bed.nodes[from].name.clone(),
        to: bed.nodes[to].name.clone(),
    }
}
