//! Figure group 2b: VM to an external host behind the node's uplink, four
//! ways, measured interleaved, in two pairs:
//!   vmpath SNAT    the real agent, a network with `egress: SNAT`: the
//!                  VM-port program translates to the node address and sends
//!                  the frame out of the uplink (fib lookup, redirect_neigh);
//!                  replies come back through the uplink program
//!   Linux + masq   the host-side veth is the gateway (10.30.0.1), the node
//!                  forwards and nftables masquerades out of the uplink
//!   vmpath Routed  `egress: Routed`: un-NATed out (fib lookup), replies to
//!                  the VM's own address in through the uplink program
//!   Linux routing  as Linux + masq without the masquerade rule
//! The "external host" is a namespace at the other end of the uplink veth;
//! for the routed pair it routes 10.30.0.0/16 back via the node (what BGP
//! would teach it). Rounds and paired ratios as in section 2 (`e2e`).
//! The packet rate is measured twice: with everything on the sender's
//! CPU (as in section 2), and with the forwarding on a CPU of its own
//! (`forwarding_capacity`: sender pinned, RPS to the other CPU, the
//! external host discarding at its ingress), whose busy time gives what
//! the node forwards per CPU-second.

use anyhow::{Result, anyhow};
use vmpath::config::parse_mac;
use vmpath_common::default_gateway_mac;
use vmpath_tests::{Netns, Node, Vm, enable_forwarding, link};

use crate::{
    e2e,
    report::{Bar, Section},
    util::{self, Mac, fmt_summary, summary},
};

const VM_MAC: &str = "52:54:00:00:0e:01";
const VM_IP: [u8; 4] = [10, 30, 0, 21];
const EXT_IP: &str = "192.0.2.2";
const NET_ID: u32 = 501;

struct Bed {
    name: &'static str,
    /// Index of the bed this one is compared with (None: a baseline).
    baseline: Option<usize>,
    vm: Vm,
    ext: Netns,
    gw_mac: Mac,
    node: Node,
}

/// The node, the external namespace (its end of the uplink named
/// `ext_if`) and the VM.
fn base(tag: &str, ext_if: &str) -> (Node, Netns, Vm) {
    let node = Node::new(tag);
    let ext = Netns::new(format!("vt{}-ext", node.tag));
    link(
        &node.ns,
        "up0",
        "192.0.2.1/30",
        &ext,
        ext_if,
        "192.0.2.2/30",
    );
    enable_forwarding(&node.ns);
    node.ns
        .run(&["ip", "route", "add", "default", "via", EXT_IP]);
    let vm = node.add_vm("o1", VM_MAC, &["10.30.0.21/16"], Some("10.30.0.1"));
    // Replies to the VM's own address (used by the routed pair only).
    ext.run(&["ip", "route", "add", "10.30.0.0/16", "via", "192.0.2.1"]);
    (node, ext, vm)
}

fn vmpath_bed(tag: &str, egress: &str, baseline: usize) -> Result<Bed> {
    let (mut node, ext, vm) = base(tag, "ext0");
    node.write_config(
        "config.yaml",
        &format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: {tag}}}\nspec:\n  address: 192.0.2.1\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: orange}}\nspec:\n  id: {NET_ID}\n  subnets: [\"10.30.0.0/16\"]\n  defaultGatewayIPs: [\"10.30.0.1\"]\n  ipam: {{mode: Enabled}}\n  egress: {egress}\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: o1-eth0, namespace: prod}}\nspec:\n  vm: o1\n  interface: eth0\n  network: orange\n  node: {tag}\n  port: {}\n  mac: \"{VM_MAC}\"\n  ips: [\"10.30.0.21/16\"]\n",
            vm.port
        ),
    );
    node.set_agent_args(&["--uplink", "up0", "--metrics-addr", "off"]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    Ok(Bed {
        name: if egress == "SNAT" {
            "vmpath SNAT"
        } else {
            "vmpath Routed"
        },
        baseline: Some(baseline),
        vm,
        ext,
        gw_mac: default_gateway_mac(NET_ID),
        node,
    })
}

fn linux_bed(tag: &str, masquerade: bool) -> Result<Bed> {
    let (node, ext, vm) = base(tag, "ext0");
    node.ns
        .run(&["ip", "addr", "add", "10.30.0.1/16", "dev", &vm.port]);
    if masquerade {
        nft(
            &node.ns,
            &[
                "add table ip bench",
                "add chain ip bench post { type nat hook postrouting priority 100 ; }",
                "add rule ip bench post oifname up0 masquerade",
            ],
        )?;
    }
    let link = node.ns.run(&["ip", "-j", "link", "show", "dev", &vm.port]);
    let v: serde_json::Value = serde_json::from_str(&link)?;
    let gw_mac = parse_mac(v[0]["address"].as_str().unwrap_or("")).map_err(|e| anyhow!(e))?;
    Ok(Bed {
        name: if masquerade {
            "Linux routing + nftables masquerade"
        } else {
            "Linux routing"
        },
        baseline: None,
        vm,
        ext,
        gw_mac,
        node,
    })
}

/// Setup `i`'s per-round paired ratios in `v` ([setup][round]) against
/// its baseline; 1 for a baseline.
fn vs_baseline(beds: &[Bed], v: &[Vec<f64>], i: usize) -> util::Summary {
    match beds[i].baseline {
        Some(b) => util::paired_ratio(&v[i], &v[b]),
        None => summary(&[1.0]),
    }
}

/// `vs_baseline` as a table cell ("1.000" for a baseline).
fn shown_vs_baseline(beds: &[Bed], v: &[Vec<f64>], i: usize) -> String {
    match beds[i].baseline {
        Some(_) => fmt_summary(&vs_baseline(beds, v, i)),
        None => "1.000".to_string(),
    }
}

/// Runs nftables commands (words split on spaces) in `ns`, in order.
fn nft(ns: &Netns, cmds: &[&str]) -> Result<()> {
    for cmd in cmds {
        let mut args = vec!["nft"];
        args.extend(cmd.split(' '));
        let out = ns.run_status(&args);
        if !out.status.success() {
            return Err(anyhow!(
                "in {}: nft {cmd}: {} (`cargo xtask setup` installs nftables)",
                ns.name,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    Ok(())
}

pub struct Options {
    /// TCP rounds (one iperf3 run of each setup per round).
    pub runs: usize,
    pub tcp_seconds: u32,
    /// Packet-rate rounds (one slice of each setup per round).
    pub pps_rounds: usize,
    pub pps_slice: std::time::Duration,
}

pub fn run(opts: &Options) -> Result<Section> {
    let beds = [
        vmpath_bed("x", "SNAT", 1)?,
        linux_bed("m", true)?,
        vmpath_bed("y", "Routed", 3)?,
        linux_bed("r", false)?,
    ];
    for b in &beds {
        if !b.vm.ns.ping(EXT_IP, 2) {
            return Err(anyhow!("{}: VM cannot ping the external host", b.name));
        }
    }
    let vm_mac = parse_mac(VM_MAC).map_err(|e| anyhow!(e))?;
    // [setup][round]
    let mut tcp: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut pps: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut per_cpu: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut sent: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    for r in 0..opts.runs {
        let mut row = vec![f64::NAN; beds.len()];
        for i in util::rotated(beds.len(), r) {
            let b = &beds[i];
            let rep = vmpath_tests::iperf3(&b.ext, &b.vm.ns, EXT_IP, false, opts.tcp_seconds);
            row[i] = rep["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(f64::NAN)
                / 1e9;
            eprintln!("bench:   round {r} {}: TCP {:.2} Gbit/s", b.name, row[i]);
        }
        for (i, g) in row.into_iter().enumerate() {
            tcp[i].push(g);
        }
    }
    let names: Vec<&str> = beds.iter().map(|b| b.name).collect();
    let rates = e2e::rate_rounds(&names, opts.pps_rounds, |i| {
        let b = &beds[i];
        let frame = util::udp4_min(b.gw_mac, vm_mac, VM_IP, [192, 0, 2, 2]);
        e2e::pps(&b.vm.ns, &frame, opts.pps_slice, &[&b.ext])
    })?;
    for (i, setup) in rates.iter().enumerate() {
        for x in setup {
            pps[i].push(x.received_pps / 1e6);
            per_cpu[i].push(x.received_per_cpu_s / 1e6);
            sent[i].push(x.sent_pps / 1e6);
        }
    }
    let capacity = forwarding_capacity(&beds, vm_mac, opts)?;
    let mut drops = beds[0].node.maps().drop_counts()?;
    for (d, n) in drops.iter_mut().zip(beds[2].node.maps().drop_counts()?) {
        *d += n;
    }
    let drop_names = util::drops_text(&drops);
    let ratios = |v: &[Vec<f64>], i: usize| vs_baseline(&beds, v, i);
    let shown = |v: &[Vec<f64>], i: usize| shown_vs_baseline(&beds, v, i);
    let mut md = format!(
        "One VM namespace behind a node namespace whose uplink veth leads to an \
         \"external\" namespace (192.0.2.2), four ways in two pairs, all measured \
         interleaved. **vmpath SNAT** (the agent, a network with `egress: SNAT`: the \
         VM-port program translates to the node address 192.0.2.1 and sends the frame \
         out of the uplink by `bpf_fib_lookup` + `bpf_redirect_neigh`; replies come back \
         through the uplink program) against **Linux routing + nftables masquerade** \
         (the host-side veth is the VM's gateway, the node forwards, one `masquerade` \
         rule on the uplink). **vmpath Routed** (`egress: Routed`: un-NATed, the same \
         fib lookup out; replies to the VM's own address come in through the uplink \
         program with `bpf_redirect_peer`) against **Linux routing** (the same node \
         without the masquerade rule); the external namespace routes 10.30.0.0/16 back \
         via the node, as BGP would teach it. TCP: `iperf3 -t {}` VM → external, one \
         stream, {} rounds. Packet rate: the same raw-socket sender as section 2, \
         64-byte UDP to the external host, counted by the external namespace's IP \
         layer, in {} rounds of {} ms slices, one slice of each setup per round, the \
         order rotated. As in section 2, rates are each setup's median (min–max) over \
         the rounds and **÷ Linux is the median (min–max) of the per-round paired \
         ratios** against the Linux setup of its pair. **Sent Mpps** is what the \
         VM's sender put on its veth in the same slices, and **received ÷ sent** the \
         share of it that reached the external host (per-round ratios). A veth \
         transmit hands the frame to the peer's backlog and the softirq that empties \
         it runs when the sending syscall re-enables bottom halves, on the sender's \
         CPU: forwarding (vmpath's programs or Linux's forwarding and masquerade) \
         and the external host's receive run to completion inside the send. Where \
         received ÷ sent is 1, nothing queued or dropped: each setup's rate is one \
         CPU's time per packet for the send syscall, the veth hops, the forwarding \
         and the receiver's IP layer together, so a cheaper forwarding path moves \
         the ratio only by its share of that sum.\n\n\
         | setup | TCP Gbit/s | ÷ Linux | UDP 64 B received Mpps | ÷ Linux | sent Mpps | received ÷ sent |\n|---|---|---|---|---|---|---|\n",
        opts.tcp_seconds,
        opts.runs,
        opts.pps_rounds,
        opts.pps_slice.as_millis()
    );
    for (i, b) in beds.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            b.name,
            fmt_summary(&summary(&tcp[i])),
            shown(&tcp, i),
            fmt_summary(&summary(&pps[i])),
            shown(&pps, i),
            fmt_summary(&summary(&sent[i])),
            fmt_summary(&util::paired_ratio(&pps[i], &sent[i])),
        ));
    }
    md.push_str(&format!(
        "\nPer CPU-second (as in section 2), vmpath SNAT ÷ Linux + masquerade is {} and \
         vmpath Routed ÷ Linux routing {}.\n",
        fmt_summary(&ratios(&per_cpu, 0)),
        fmt_summary(&ratios(&per_cpu, 2)),
    ));
    md.push_str(&capacity.markdown(&beds));
    md.push_str(&format!(
        "\nDrops counted by the vmpath data path during these runs: {}.\n",
        drop_names
    ));
    let mut bars = Vec::new();
    for i in [0, 2] {
        let base = beds[beds[i].baseline.unwrap_or(i)].name;
        bars.push(Bar {
            label: format!("TCP VM-to-external: {}", beds[i].name),
            ratio: ratios(&tcp, i).median,
            baseline: base.into(),
        });
        bars.push(Bar {
            label: format!("UDP 64 B pps VM-to-external: {}", beds[i].name),
            ratio: ratios(&pps, i).median,
            baseline: base.into(),
        });
    }
    for i in [0, 2] {
        bars.push(Bar {
            label: format!(
                "UDP 64 B pps per forwarding CPU-second VM-to-external: {}",
                beds[i].name
            ),
            ratio: capacity.ratio(&beds, i).median,
            baseline: beds[beds[i].baseline.unwrap_or(i)].name.into(),
        });
    }
    drop(beds);
    let (ingress_md, ingress_bars) = ingress(opts)?;
    md.push_str(&ingress_md);
    bars.extend(ingress_bars);
    Ok(Section {
        title: "2b. VM to external: SNAT and routed".into(),
        markdown: md,
        bars,
    })
}

// --- the forwarding CPU saturated ----------------------------------------------

/// The sender's CPU, and the one the node's forwarding and the external
/// host's receive run on.
const SENDER_CPU: usize = 0;
const FORWARD_CPU: usize = 1;

/// Packet rates with the forwarding on a CPU of its own.
struct Capacity {
    /// [setup][round]: received Mpps, the forwarding CPU's busy share of
    /// the slice, and Mpps per second that CPU ran.
    received: Vec<Vec<f64>>,
    busy: Vec<Vec<f64>>,
    per_fwd_cpu_s: Vec<Vec<f64>>,
    rounds: usize,
    slice_ms: u128,
}

impl Capacity {
    /// The paired ratio of Mpps per forwarding-CPU-second against the
    /// setup's Linux baseline.
    fn ratio(&self, beds: &[Bed], i: usize) -> util::Summary {
        vs_baseline(beds, &self.per_fwd_cpu_s, i)
    }

    fn markdown(&self, beds: &[Bed]) -> String {
        let mut md = format!(
            "\n**The forwarding on a CPU of its own.** The same four setups and frame, \
             {} rounds of {} ms slices, with the work split between the two CPUs \
             as a router test splits it between traffic generator and device under \
             test: the sender is pinned to CPU {SENDER_CPU}, and RPS on the node's \
             end of the VM's veth hands every frame to CPU {FORWARD_CPU}, which runs \
             the node's forwarding (vmpath's programs, or Linux's forwarding with \
             conntrack and masquerade) and the external host's receive. The \
             external host counts and discards the datagrams at its ingress (an \
             nftables netdev `counter drop`), so little but the forwarding is left \
             on CPU {FORWARD_CPU}. The sender's socket buffer holds it back while \
             CPU {FORWARD_CPU} has not freed its frames, so nothing is lost and \
             received equals sent; what tells the cost is CPU {FORWARD_CPU}'s \
             busy share of the slice (from /proc/stat). **Mpps per forwarding \
             CPU-second** = received ÷ the seconds CPU {FORWARD_CPU} ran: the \
             packet rate one CPU forwards when it does nothing else, and the \
             figure the north-south goals are judged by; its ÷ Linux is the \
             median (min–max) of the per-round paired ratios.\n\n\
             | setup | UDP 64 B received Mpps | ÷ Linux | CPU {FORWARD_CPU} busy | \
             Mpps per forwarding CPU-second | ÷ Linux |\n\
             |---|---|---|---|---|---|\n",
            self.rounds, self.slice_ms
        );
        for (i, b) in beds.iter().enumerate() {
            let shown = |v: &[Vec<f64>]| shown_vs_baseline(beds, v, i);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                b.name,
                fmt_summary(&summary(&self.received[i])),
                shown(&self.received),
                fmt_summary(&summary(&self.busy[i])),
                fmt_summary(&summary(&self.per_fwd_cpu_s[i])),
                shown(&self.per_fwd_cpu_s),
            ));
        }
        md
    }
}

/// Moves each bed's forwarding to `FORWARD_CPU` and its external host's
/// receive to an ingress counter, then measures rounds of packet-rate
/// slices from a sender pinned to `SENDER_CPU`.
fn forwarding_capacity(beds: &[Bed], vm_mac: Mac, opts: &Options) -> Result<Capacity> {
    for b in beds {
        // The node namespace's sysfs: `ip netns exec` mounts it.
        util::sh(&[
            "ip",
            "netns",
            "exec",
            &b.node.ns.name,
            "sh",
            "-c",
            &format!(
                "echo {:x} > /sys/class/net/{}/queues/rx-0/rps_cpus",
                1u32 << FORWARD_CPU,
                b.vm.port
            ),
        ])?;
        nft(
            &b.ext,
            &[
                "add table netdev sink",
                "add chain netdev sink in { type filter hook ingress device ext0 priority 0 ; }",
                "add rule netdev sink in ip protocol udp counter drop",
            ],
        )
        .map_err(|e| anyhow!("{}: {e}", b.name))?;
    }
    let names: Vec<&str> = beds.iter().map(|b| b.name).collect();
    let cpus = e2e::Cpus {
        sender: SENDER_CPU,
        watched: FORWARD_CPU,
    };
    let rates = e2e::rate_rounds(&names, opts.pps_rounds, |i| {
        let b = &beds[i];
        let frame = util::udp4_min(b.gw_mac, vm_mac, VM_IP, [192, 0, 2, 2]);
        e2e::pps_counted(&b.vm.ns, &frame, opts.pps_slice, Some(cpus), || {
            sink_count(&b.ext)
        })
    })?;
    let mut cap = Capacity {
        received: vec![Vec::new(); beds.len()],
        busy: vec![Vec::new(); beds.len()],
        per_fwd_cpu_s: vec![Vec::new(); beds.len()],
        rounds: opts.pps_rounds,
        slice_ms: opts.pps_slice.as_millis(),
    };
    for (i, setup) in rates.iter().enumerate() {
        for x in setup {
            cap.received[i].push(x.received_pps / 1e6);
            cap.busy[i].push(x.watched_cpu_busy);
            cap.per_fwd_cpu_s[i].push(x.received_pps / x.watched_cpu_busy / 1e6);
        }
    }
    Ok(cap)
}

/// Packets the external host's ingress counter has discarded so far.
fn sink_count(ext: &Netns) -> Result<u64> {
    let out = ext.run_status(&["nft", "-j", "list", "chain", "netdev", "sink", "in"]);
    if !out.status.success() {
        return Err(anyhow!(
            "nft list chain netdev sink in: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o["rule"]["expr"].as_array())
        .flatten()
        .find_map(|e| e["counter"]["packets"].as_u64())
        .ok_or_else(|| anyhow!("no counter in the external host's sink chain"))
}

// --- external -> VM: the uplink's XDP program against its tc program -------

/// The VM's UDP port of the SNAT flow the external host answers.
const VM_UDP_PORT: u16 = 4000;
const EXT_UDP_PORT: u16 = 9;

/// One external -> VM setup: the external namespace's `eth0` sends to
/// `dst` (the VM's address, or the node's SNAT address).
struct InBed {
    name: &'static str,
    /// Index of the Linux setup it is compared with (None: a baseline).
    baseline: Option<usize>,
    /// For the SNAT setups: the VM opens the flow (again before each
    /// slice, so no timeout ends it).
    snat: bool,
    vm: Vm,
    ext: Netns,
    node: Node,
}

/// The node, the external namespace (its end of the uplink named `eth0`,
/// as the raw-socket sender wants) and the VM, whose pod-side veth has
/// GRO on (so its port takes XDP frames: docs/north-south.md).
fn in_base(tag: &str) -> (Node, Netns, Vm) {
    let (node, ext, vm) = base(tag, "eth0");
    vm.ns.run(&["ethtool", "-K", "eth0", "gro", "on"]);
    (node, ext, vm)
}

fn in_vmpath(tag: &str, egress: &str, xdp: bool, baseline: usize) -> Result<InBed> {
    let (mut node, ext, vm) = in_base(tag);
    node.write_config(
        "config.yaml",
        &format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: {tag}}}\nspec:\n  address: 192.0.2.1\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: orange}}\nspec:\n  id: {NET_ID}\n  subnets: [\"10.30.0.0/16\"]\n  defaultGatewayIPs: [\"10.30.0.1\"]\n  ipam: {{mode: Enabled}}\n  egress: {egress}\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: o1-eth0, namespace: prod}}\nspec:\n  vm: o1\n  interface: eth0\n  network: orange\n  node: {tag}\n  port: {}\n  mac: \"{VM_MAC}\"\n  ips: [\"10.30.0.21/16\"]\n",
            vm.port
        ),
    );
    let mode = if xdp { "auto" } else { "off" };
    node.set_agent_args(&[
        "--uplink",
        "up0",
        "--metrics-addr",
        "off",
        "--uplink-xdp",
        mode,
    ]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    if xdp {
        // The port listed for XDP delivery (the agent asks the kernel
        // every 2 s).
        let ifindex = node.ns.ifindex(&vm.port);
        let start = std::time::Instant::now();
        while node.maps().xdp_ports.get(&ifindex, 0).is_err() {
            if start.elapsed() > std::time::Duration::from_secs(20) {
                return Err(anyhow!("{tag}: the VM port never listed for XDP delivery"));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    let snat = egress == "SNAT";
    Ok(InBed {
        name: match (snat, xdp) {
            (true, true) => "vmpath SNAT return, XDP",
            (true, false) => "vmpath SNAT return, tc",
            (false, true) => "vmpath routed ingress, XDP",
            (false, false) => "vmpath routed ingress, tc",
        },
        baseline: Some(baseline),
        snat,
        vm,
        ext,
        node,
    })
}

fn in_linux(tag: &str) -> Result<InBed> {
    let (node, ext, vm) = in_base(tag);
    node.ns
        .run(&["ip", "addr", "add", "10.30.0.1/16", "dev", &vm.port]);
    Ok(InBed {
        name: "Linux routing",
        baseline: None,
        snat: false,
        vm,
        ext,
        node,
    })
}

impl InBed {
    /// The VM's UDP datagram that opens (or refreshes) the SNAT flow the
    /// external host answers.
    fn open_flow(&self) {
        self.vm.ns.run(&[
            "python3",
            "-c",
            &format!(
                "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                 s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                 s.bind(('', {VM_UDP_PORT}))\ns.sendto(b'open', ('{EXT_IP}', {EXT_UDP_PORT}))\n"
            ),
        ]);
    }

    /// Where the external host sends: the VM's address, or the node's
    /// address and the port the flow was translated to.
    fn target(&self) -> Result<([u8; 4], u16)> {
        if !self.snat {
            return Ok((VM_IP, VM_UDP_PORT));
        }
        let maps = self.node.maps();
        maps.snat_out
            .iter()
            .filter_map(|r| r.ok())
            .find(|(k, _)| k.src == VM_IP && k.proto == 17)
            .map(|(_, e)| (e.addr, e.port))
            .ok_or_else(|| anyhow!("{}: no SNAT flow of the VM", self.name))
    }
}

/// External host -> VM, 64-byte UDP: routed ingress to the VM's address
/// and SNAT return on a flow the VM opened, each through the uplink's XDP
/// program and through its tc program (`--uplink-xdp off`), against Linux
/// routing to the VM's address.
fn ingress(opts: &Options) -> Result<(String, Vec<Bar>)> {
    let beds = [
        in_vmpath("ix", "Routed", true, 2)?,
        in_vmpath("it", "Routed", false, 2)?,
        in_linux("il")?,
        in_vmpath("sx", "SNAT", true, 2)?,
        in_vmpath("st", "SNAT", false, 2)?,
    ];
    let ext_mac = |b: &InBed| -> Result<Mac> {
        let link = b.ext.run(&["ip", "-j", "link", "show", "dev", "eth0"]);
        let v: serde_json::Value = serde_json::from_str(&link)?;
        parse_mac(v[0]["address"].as_str().unwrap_or("")).map_err(|e| anyhow!(e))
    };
    let up_mac = |b: &InBed| -> Result<Mac> {
        let link = b.node.ns.run(&["ip", "-j", "link", "show", "dev", "up0"]);
        let v: serde_json::Value = serde_json::from_str(&link)?;
        parse_mac(v[0]["address"].as_str().unwrap_or("")).map_err(|e| anyhow!(e))
    };
    let mut frames = Vec::new();
    for b in &beds {
        if b.snat {
            b.open_flow();
        } else if !b.ext.ping("10.30.0.21", 2) {
            return Err(anyhow!("{}: the external host cannot ping the VM", b.name));
        }
        let (dst, port) = b.target()?;
        let mut f = util::udp4_min(up_mac(b)?, ext_mac(b)?, [192, 0, 2, 2], dst);
        // Source and destination ports of the flow (checksum patched).
        let l4 = 14 + 20;
        let old = [
            u16::from_be_bytes([f[l4], f[l4 + 1]]),
            u16::from_be_bytes([f[l4 + 2], f[l4 + 3]]),
        ];
        f[l4..l4 + 2].copy_from_slice(&EXT_UDP_PORT.to_be_bytes());
        f[l4 + 2..l4 + 4].copy_from_slice(&port.to_be_bytes());
        let mut sum = u32::from(!u16::from_be_bytes([f[l4 + 6], f[l4 + 7]]));
        sum += u32::from(!old[0]) + u32::from(EXT_UDP_PORT);
        sum += u32::from(!old[1]) + u32::from(port);
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let mut c = !(sum as u16);
        if c == 0 {
            c = 0xffff;
        }
        f[l4 + 6..l4 + 8].copy_from_slice(&c.to_be_bytes());
        frames.push(f);
    }
    let xdp_before: Vec<u64> = [0, 3]
        .iter()
        .map(|&i| beds[i].node.maps().uplink_xdp_counts().map(|c| c[0] + c[2]))
        .collect::<Result<_>>()?;
    let names: Vec<&str> = beds.iter().map(|b| b.name).collect();
    let rates = e2e::rate_rounds(&names, opts.pps_rounds, |i| {
        let b = &beds[i];
        if b.snat {
            b.open_flow();
        }
        e2e::pps(&b.ext, &frames[i], opts.pps_slice, &[&b.vm.ns])
    })?;
    let xdp_taken: Vec<u64> = [0, 3]
        .iter()
        .zip(&xdp_before)
        .map(|(&i, before)| {
            beds[i]
                .node
                .maps()
                .uplink_xdp_counts()
                .map(|c| c[0] + c[2] - before)
        })
        .collect::<Result<_>>()?;
    let mut pps: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut per_cpu: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut sent: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    for (i, setup) in rates.iter().enumerate() {
        for x in setup {
            pps[i].push(x.received_pps / 1e6);
            per_cpu[i].push(x.received_per_cpu_s / 1e6);
            sent[i].push(x.sent_pps / 1e6);
        }
    }
    let mut drops = vec![0u64; vmpath_common::drop_reason::COUNT as usize];
    for i in [0, 1, 3, 4] {
        for (d, n) in drops.iter_mut().zip(beds[i].node.maps().drop_counts()?) {
            *d += n;
        }
    }
    let drop_names = util::drops_text(&drops);
    let ratio = |v: &[Vec<f64>], i: usize, base: usize| util::paired_ratio(&v[i], &v[base]);
    let mut md = format!(
        "\n**External → VM.** The reverse direction, 64-byte UDP sent by the same raw-socket \
         sender from the external namespace, counted by the VM namespace's IP layer, {} \
         rounds of {} ms slices, the five setups interleaved, the order rotated. **Routed \
         ingress** to the VM's own address: vmpath with the uplink's native XDP program \
         (`--uplink-xdp auto`: rewritten and redirected to the VM's port before an skb \
         exists; the VM's pod-side veth has GRO on, which is what lets its host side take \
         XDP frames), vmpath with the tc program alone (`--uplink-xdp off`: \
         `bpf_redirect_peer`), and Linux routing. **SNAT return** to the node's address \
         on a UDP flow the VM opened (refreshed before each slice): vmpath XDP and vmpath \
         tc; its ÷ Linux is against Linux routing to the VM's address (no NAT). The \
         uplink is a veth, where native XDP cannot save an skb: the sender's skb exists \
         already, the veth copies it into a page for XDP (its headroom is below \
         `XDP_PACKET_HEADROOM`) and the VM's veth builds a new skb from the XDP frame, \
         where the tc program hands the original skb on with `bpf_redirect_peer`; a \
         NIC's native XDP (which saves the driver's skb) is not measured here. XDP \
         delivered {} (routed) \
         and {} (SNAT return) frames in the XDP setups' slices.\n\n\
         | setup | UDP 64 B received Mpps | ÷ Linux | ÷ vmpath tc | sent Mpps | received ÷ sent | per CPU-second ÷ Linux |\n|---|---|---|---|---|---|---|\n",
        opts.pps_rounds,
        opts.pps_slice.as_millis(),
        xdp_taken[0],
        xdp_taken[1],
    );
    for (i, b) in beds.iter().enumerate() {
        let (vs_linux, vs_tc, cpu) = match b.baseline {
            Some(base) => (
                fmt_summary(&ratio(&pps, i, base)),
                if i == 0 || i == 3 {
                    fmt_summary(&ratio(&pps, i, i + 1))
                } else {
                    "1.000".to_string()
                },
                fmt_summary(&ratio(&per_cpu, i, base)),
            ),
            None => ("1.000".into(), "".into(), "1.000".into()),
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            b.name,
            fmt_summary(&summary(&pps[i])),
            vs_linux,
            vs_tc,
            fmt_summary(&summary(&sent[i])),
            fmt_summary(&util::paired_ratio(&pps[i], &sent[i])),
            cpu,
        ));
    }
    md.push_str(&format!(
        "\nDrops counted by the vmpath data path during the external → VM runs: {}.\n",
        drop_names
    ));
    let mut bars = Vec::new();
    for i in [0, 1, 3, 4] {
        let base = beds[i].baseline.unwrap_or(i);
        bars.push(Bar {
            label: format!("UDP 64 B pps external-to-VM: {}", beds[i].name),
            ratio: ratio(&pps, i, base).median,
            baseline: beds[base].name.into(),
        });
    }
    drop(beds);
    Ok((md, bars))
}
