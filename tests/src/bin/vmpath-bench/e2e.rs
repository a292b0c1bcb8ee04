//! Figure group 2: end to end between two VM namespaces on one node, three
//! ways, built side by side and measured interleaved so machine noise hits
//! all three alike:
//!   vmpath    the real agent (release build) programs two ports of one
//!             network, port security on; the VM-port program forwards
//!   bridge    the two host-side veths in a Linux bridge (the bridge CNI)
//!   redirect  `bench_redirect_peer` (ebpf/src/prog/bench.rs) at tcx ingress of
//!             each host-side veth, sending every frame into the other VM:
//!             the floor for any tc forwarder here
//! TCP: iperf3, VM1 -> VM2, one run of each setup per round. Packet rate:
//! 60-byte (64 on the wire) UDP frames from a raw AF_PACKET socket with
//! sendmmsg in VM1, counted as IP packets received in VM2 (`Ip: InReceives`
//! of VM2's /proc/net/snmp), in many short slices: each round runs one
//! slice of every setup, in an order rotated per round. Ratios are the
//! median of the per-round paired ratios (setup ÷ baseline of the same
//! round), which cancels the host noise that moves whole rounds.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow};
use aya::{
    Ebpf,
    maps::Array,
    programs::{LinkOrder, SchedClassifier, TcAttachType, tc::TcAttachOptions},
};
use vmpath::{apply::dataplane::Dataplane, config::parse_mac};
use vmpath_tests::{Netns, Node, Vm, yaml};

use crate::{
    report::{Bar, Section},
    util::{self, RawSock, fmt_summary, summary},
};

pub struct Options {
    /// TCP rounds (one iperf3 run of each setup per round).
    pub runs: usize,
    pub tcp_seconds: u32,
    /// Packet-rate rounds (one slice of each setup per round).
    pub pps_rounds: usize,
    pub pps_slice: Duration,
}

const VM1_MAC: &str = "52:54:00:00:b1:01";
const VM2_MAC: &str = "52:54:00:00:b2:01";
const VM1_IP: [u8; 4] = [10, 20, 0, 11];
const VM2_IP: [u8; 4] = [10, 20, 0, 12];

pub struct Bed {
    pub name: &'static str,
    // Field order: the baseline programs go before the namespaces.
    _progs: Vec<Ebpf>,
    pub vm1: Vm,
    pub vm2: Vm,
    pub node: Node,
}

fn vms(node: &Node) -> (Vm, Vm) {
    let vm1 = node.add_vm("vm1", VM1_MAC, &["10.20.0.11/16"], None);
    let vm2 = node.add_vm("vm2", VM2_MAC, &["10.20.0.12/16"], None);
    (vm1, vm2)
}

/// The real agent, one network with IPAM (so port security is fully on),
/// both VMs with static addresses.
pub fn vmpath_bed() -> Result<Bed> {
    let mut node = Node::new("a");
    let (vm1, vm2) = vms(&node);
    node.write_config(
        "config.yaml",
        &yaml::docs(&[
            yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
            yaml::attachment("vm1", "blue", "a", &vm1.port, VM1_MAC, &["10.20.0.11/16"]),
            yaml::attachment("vm2", "blue", "a", &vm2.port, VM2_MAC, &["10.20.0.12/16"]),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    Ok(Bed {
        name: "vmpath",
        _progs: Vec::new(),
        vm1,
        vm2,
        node,
    })
}

pub fn bridge_bed() -> Result<Bed> {
    let node = Node::new("b");
    let (vm1, vm2) = vms(&node);
    node.ns.run(&["ip", "link", "add", "br0", "type", "bridge"]);
    node.ns.run(&["ip", "link", "set", "br0", "up"]);
    for p in [&vm1.port, &vm2.port] {
        node.ns.run(&["ip", "link", "set", p, "master", "br0"]);
    }
    Ok(Bed {
        name: "Linux bridge",
        _progs: Vec::new(),
        vm1,
        vm2,
        node,
    })
}

/// Loads `bench_redirect_peer` from the bench's object (a private instance,
/// so its one-slot map is its own) and attaches it at tcx ingress of
/// `port`, sending everything into the peer of `target`.
fn attach_redirect(ns: &Netns, port: &str, target: &str) -> Result<Ebpf> {
    let ns_path = ns.path();
    let (port, target) = (port.to_string(), target.to_string());
    util::in_netns(&ns_path, move || -> Result<Ebpf> {
        let target_ifx =
            vmpath::sys::netif::ifindex_of(&target).ok_or_else(|| anyhow!("no {target}"))?;
        let mut ebpf = Ebpf::load(Dataplane::bench_object()).context("loading the bench object")?;
        {
            let mut peer: Array<_, u32> = Array::try_from(
                ebpf.map_mut("vmpb_peer")
                    .ok_or_else(|| anyhow!("vmpb_peer missing"))?,
            )?;
            peer.set(0, target_ifx, 0)?;
        }
        let prog: &mut SchedClassifier = ebpf
            .program_mut("bench_redirect_peer")
            .ok_or_else(|| anyhow!("bench_redirect_peer missing"))?
            .try_into()?;
        prog.load()?;
        prog.attach_with_options(
            &port,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .with_context(|| format!("attaching bench_redirect_peer on {port}"))?;
        Ok(ebpf)
    })?
}

pub fn redirect_bed() -> Result<Bed> {
    let node = Node::new("r");
    let (vm1, vm2) = vms(&node);
    let p1 = attach_redirect(&node.ns, &vm1.port, &vm2.port)?;
    let p2 = attach_redirect(&node.ns, &vm2.port, &vm1.port)?;
    Ok(Bed {
        name: "bare redirect_peer",
        _progs: vec![p1, p2],
        vm1,
        vm2,
        node,
    })
}

fn tcp_gbps(bed: &Bed, seconds: u32) -> f64 {
    let report = vmpath_tests::iperf3(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", false, seconds);
    report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(f64::NAN)
        / 1e9
}

/// `Ip: InReceives` of a namespace.
pub fn ip_in_receives(ns: &Netns) -> Result<u64> {
    let snmp = ns.run(&["cat", "/proc/net/snmp"]);
    let mut lines = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (
        lines.next().ok_or_else(|| anyhow!("no Ip: header"))?,
        lines.next().ok_or_else(|| anyhow!("no Ip: values"))?,
    );
    let i = names
        .split_whitespace()
        .position(|n| n == "InReceives")
        .ok_or_else(|| anyhow!("no InReceives"))?;
    Ok(values
        .split_whitespace()
        .nth(i)
        .ok_or_else(|| anyhow!("short Ip: line"))?
        .parse()?)
}

/// Blasts 64-byte UDP from VM1 to VM2 for `slice`: packets per second
/// sent, received, and received per second of CPU actually run.
pub fn udp_pps(bed: &Bed, slice: Duration) -> Result<Rate> {
    let frame = util::udp4_min(
        parse_mac(VM2_MAC).map_err(|e| anyhow!(e))?,
        parse_mac(VM1_MAC).map_err(|e| anyhow!(e))?,
        VM1_IP,
        VM2_IP,
    );
    pps(&bed.vm1.ns, &frame, slice, &[&bed.vm2.ns])
}

/// One slice of the packet-rate measurement.
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    pub sent_pps: f64,
    pub received_pps: f64,
    /// Received packets per second of CPU the machine ran (user, system,
    /// irq, softirq over all CPUs; not idle, not stolen by the host): the
    /// rate with the host's CPU theft taken out.
    pub received_per_cpu_s: f64,
    /// The share of the slice the CPU `pps_counted` was asked to watch
    /// ran (NaN when none was): `received_pps / watched_cpu_busy` is the
    /// received packets per second that CPU ran.
    pub watched_cpu_busy: f64,
}

/// Jiffies the machine's CPUs ran (user + nice + system + irq + softirq,
/// from the `cpu` line of /proc/stat); idle, iowait and steal excluded.
pub fn cpu_busy_jiffies() -> Result<u64> {
    busy_jiffies_of("cpu ")
}

/// `cpu_busy_jiffies` of one CPU.
fn cpu_busy_jiffies_of(cpu: usize) -> Result<u64> {
    busy_jiffies_of(&format!("cpu{cpu} "))
}

/// The busy jiffies of the /proc/stat line starting with `prefix`.
fn busy_jiffies_of(prefix: &str) -> Result<u64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .find(|l| l.starts_with(prefix))
        .ok_or_else(|| anyhow!("no {prefix:?} line in /proc/stat"))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal ...
    Ok(f.iter()
        .take(7)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, v)| v)
        .sum())
}

/// Sends `frame` from `eth0` of `sender` for `slice` (raw socket,
/// sendmmsg); rates of what was sent and what the `receivers`' IP layers
/// took in, together.
pub fn pps(sender: &Netns, frame: &[u8], slice: Duration, receivers: &[&Netns]) -> Result<Rate> {
    pps_counted(sender, frame, slice, None, || {
        receivers.iter().map(|ns| ip_in_receives(ns)).sum()
    })
}

/// Where `pps_counted` runs the sender and which CPU it watches.
#[derive(Clone, Copy)]
pub struct Cpus {
    pub sender: usize,
    pub watched: usize,
}

/// `pps` with the sending thread pinned (and one CPU's busy time taken)
/// when `cpus` says so, and what arrived read by `count` (a running
/// total).
pub fn pps_counted(
    sender: &Netns,
    frame: &[u8],
    slice: Duration,
    cpus: Option<Cpus>,
    count: impl Fn() -> Result<u64>,
) -> Result<Rate> {
    let sender_cpu = cpus.map(|c| c.sender);
    let watched = || cpus.map_or(Ok(0), |c| cpu_busy_jiffies_of(c.watched));
    let before = count()?;
    let busy_before = cpu_busy_jiffies()?;
    let watched_before = watched()?;
    let stop = AtomicBool::new(false);
    let ns_path = sender.path();
    let (sent, elapsed) = std::thread::scope(|s| -> Result<(u64, f64)> {
        let h = s.spawn(|| -> Result<u64> {
            util::enter_netns(&ns_path)?;
            if let Some(cpu) = sender_cpu {
                util::pin_to_cpu(cpu)?;
            }
            let sock = RawSock::open("eth0")?;
            sock.qdisc_bypass();
            Ok(sock.blast(frame, 64, &stop))
        });
        let t = Instant::now();
        sleep(slice);
        stop.store(true, Ordering::Relaxed);
        let sent = h.join().map_err(|_| anyhow!("sender panicked"))??;
        Ok((sent, t.elapsed().as_secs_f64()))
    })?;
    let busy_after = cpu_busy_jiffies()?;
    let watched_after = watched()?;
    // What is still queued reaches the receivers within milliseconds.
    sleep(Duration::from_millis(30));
    let received = (count()? - before) as f64;
    // SAFETY: sysconf reads a constant of the system; no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let cpu_s = busy_after.saturating_sub(busy_before) as f64 / hz;
    let watched_s = watched_after.saturating_sub(watched_before) as f64 / hz;
    Ok(Rate {
        sent_pps: sent as f64 / elapsed,
        received_pps: received / elapsed,
        received_per_cpu_s: if cpu_s > 0.0 {
            received / cpu_s
        } else {
            f64::NAN
        },
        watched_cpu_busy: match cpus {
            Some(_) => watched_s / elapsed,
            None => f64::NAN,
        },
    })
}

/// `rounds` rounds of one `measure(setup)` slice per setup, the order
/// rotated each round; the rates by setup, then round.
pub fn rate_rounds(
    names: &[&str],
    rounds: usize,
    mut measure: impl FnMut(usize) -> Result<Rate>,
) -> Result<Vec<Vec<Rate>>> {
    let mut out: Vec<Vec<Rate>> = vec![Vec::new(); names.len()];
    for r in 0..rounds {
        let mut row = vec![None; names.len()];
        for i in util::rotated(names.len(), r) {
            row[i] = Some(measure(i)?);
        }
        let row: Vec<Rate> = row.into_iter().flatten().collect();
        eprintln!(
            "bench:   round {r} UDP received Mpps (per CPU-second): {}",
            names
                .iter()
                .zip(&row)
                .map(|(n, x)| format!(
                    "{n} {:.3} ({:.3})",
                    x.received_pps / 1e6,
                    x.received_per_cpu_s / 1e6
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (i, x) in row.into_iter().enumerate() {
            out[i].push(x);
        }
    }
    Ok(out)
}

pub fn run(opts: &Options) -> Result<Section> {
    let beds = vec![vmpath_bed()?, bridge_bed()?, redirect_bed()?];
    // Warm up: neighbours resolved, agent settled.
    for b in &beds {
        if !b.vm1.ns.ping("10.20.0.12", 2) {
            return Err(anyhow!("{}: VM1 cannot ping VM2", b.name));
        }
    }
    // [setup][round]
    let mut tcp: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut pps: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut sent: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut per_cpu: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    for r in 0..opts.runs {
        let mut row = vec![f64::NAN; beds.len()];
        for i in util::rotated(beds.len(), r) {
            row[i] = tcp_gbps(&beds[i], opts.tcp_seconds);
            eprintln!(
                "bench:   round {r} {}: TCP {:.2} Gbit/s",
                beds[i].name, row[i]
            );
        }
        for (i, g) in row.into_iter().enumerate() {
            tcp[i].push(g);
        }
    }
    let names: Vec<&str> = beds.iter().map(|b| b.name).collect();
    let rates = rate_rounds(&names, opts.pps_rounds, |i| {
        udp_pps(&beds[i], opts.pps_slice)
    })?;
    for (i, setup) in rates.iter().enumerate() {
        for x in setup {
            sent[i].push(x.sent_pps / 1e6);
            pps[i].push(x.received_pps / 1e6);
            per_cpu[i].push(x.received_per_cpu_s / 1e6);
        }
    }
    let drops = beds[0].node.maps().drop_counts()?;
    let agent_drops: u64 = drops.iter().sum();
    let drop_names = util::nonzero_drops(&drops);
    let drop_names = if drop_names.is_empty() {
        vec!["none".to_string()]
    } else {
        drop_names
    };

    let mut md = String::new();
    md.push_str(&format!(
        "Two VM namespaces on one node namespace, joined three ways, built side by \
         side and measured interleaved:\n\n\
         - **vmpath**: the agent (release build) running in the node namespace, one \
         network with IPAM Enabled (MAC and IP port security on), the VM-port program \
         at tcx ingress of each host-side veth.\n\
         - **Linux bridge**: both host-side veths in a bridge (what the bridge CNI \
         builds).\n\
         - **bare redirect_peer**: `bench_redirect_peer` at tcx ingress of each \
         host-side veth, redirecting every frame into the other VM (one array lookup, \
         no checks): the floor for a tc forwarder on this machine.\n\n\
         TCP: `iperf3 -t {}` VM1 → VM2, one stream, received bit rate; {} rounds, one \
         run of each setup per round. Packet rate: a raw AF_PACKET socket in VM1 \
         sending the same 60-byte UDP frame (64 bytes on the wire) with `sendmmsg` (64 \
         per call, qdisc bypass); received = IPv4 packets VM2's stack took in (`Ip: \
         InReceives`). The sender and the forwarding share the sender's CPU (veth \
         transmit runs the receive path inline).\n\n\
         **Method.** This is a shared 2-core VM: the packet rate of one setup moves by \
         up to 2x from one second to the next with the host's load, so long runs of \
         one setup after the other compare different moments. The packet rate is \
         therefore measured in {} rounds of short slices ({} ms of sending per setup), \
         each round one slice of every setup back to back, the order rotated by one \
         setup each round. Throughput columns are each setup's median (min–max) over \
         the rounds. Every ratio column (÷ bridge, ÷ redirect_peer) is the median \
         (min–max) of the per-round paired ratios, this setup's slice ÷ the \
         baseline's slice of the same round (TCP likewise, per round), not a ratio \
         of medians: a round the host slowed down slows both sides of its ratio.\n\n",
        opts.tcp_seconds,
        opts.runs,
        opts.pps_rounds,
        opts.pps_slice.as_millis()
    ));
    md.push_str("| setup | TCP Gbit/s | ÷ bridge | ÷ redirect_peer | UDP 64 B received Mpps | ÷ bridge | ÷ redirect_peer | sent Mpps |\n|---|---|---|---|---|---|---|---|\n");
    let ratio = |v: &[Vec<f64>], i: usize, base: usize| -> String {
        if i == base {
            "1.000".into()
        } else {
            fmt_summary(&util::paired_ratio(&v[i], &v[base]))
        }
    };
    for (i, b) in beds.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            b.name,
            fmt_summary(&summary(&tcp[i])),
            ratio(&tcp, i, 1),
            ratio(&tcp, i, 2),
            fmt_summary(&summary(&pps[i])),
            ratio(&pps, i, 1),
            ratio(&pps, i, 2),
            fmt_summary(&summary(&sent[i])),
        ));
    }
    md.push_str(&format!(
        "\nPer CPU-second (the packets received divided by the CPU time the machine ran \
         in the slice, from /proc/stat, time the host stole excluded), vmpath ÷ \
         redirect_peer is {} and vmpath ÷ bridge {}: the same as the wall-clock rates, so \
         the spread is this host running faster or slower, not time taken away from \
         the VM.\n",
        fmt_summary(&util::paired_ratio(&per_cpu[0], &per_cpu[2])),
        fmt_summary(&util::paired_ratio(&per_cpu[0], &per_cpu[1])),
    ));
    md.push_str(&format!(
        "\nDrops counted by the vmpath data path during these runs: {agent_drops} ({}).\n\n\
         VM to external: section 2b.\n",
        drop_names.join(", ")
    ));
    let paired = |v: &[Vec<f64>], i: usize, base: usize| util::paired_ratio(&v[i], &v[base]).median;
    let bars = vec![
        Bar {
            label: "TCP VM-to-VM: vmpath".into(),
            ratio: paired(&tcp, 0, 1),
            baseline: "Linux bridge".into(),
        },
        Bar {
            label: "TCP VM-to-VM: vmpath".into(),
            ratio: paired(&tcp, 0, 2),
            baseline: "bare redirect_peer".into(),
        },
        Bar {
            label: "UDP 64 B pps: vmpath".into(),
            ratio: paired(&pps, 0, 1),
            baseline: "Linux bridge".into(),
        },
        Bar {
            label: "UDP 64 B pps: vmpath".into(),
            ratio: paired(&pps, 0, 2),
            baseline: "bare redirect_peer".into(),
        },
        Bar {
            label: "UDP 64 B pps: bare redirect_peer".into(),
            ratio: paired(&pps, 2, 1),
            baseline: "Linux bridge".into(),
        },
    ];
    drop(beds);
    Ok(Section {
        title: "2. End to end between VM namespaces".into(),
        markdown: md,
        bars,
    })
}
