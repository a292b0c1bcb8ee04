//! Figure group 1c: what the overlay's programs cost. VXLAN encap is the
//! VM-port program (`vm_port`) sending a frame to a MAC on another node:
//! tail call to `vm_remote`, `bpf_skb_set_tunnel_key`, `bpf_redirect` to
//! the collect-metadata vxlan device. Decap is `vxlan_rx` at tcx ingress of
//! that device, reading the tunnel key the kernel's vxlan driver attached.
//!
//! The data path is set up as the agent does it (config documents ->
//! validate -> IPAM -> plan -> `Dataplane::apply`, then the agent's
//! `overlay::ensure_device` makes `vmp-vxlan` and `Dataplane::attach_vxlan`
//! attaches `vxlan_rx`) in
//! namespaces of its own: a node, a VM behind a real veth port, and a
//! "remote node" at the other end of an underlay veth.
//!
//! Two methods:
//!   test_run  BPF_PROG_TEST_RUN as in sections 1 and 1b, baselines
//!             `bench_noop` and `bench_redirect_peer` on the same hook.
//!             test_run builds a bare skb: no tunnel metadata, so
//!             `vxlan_rx` cannot get past `bpf_skb_get_tunnel_key`; its
//!             verdict and drop reason are reported instead of a figure.
//!   live      real frames through both hooks (a raw socket in the VM for
//!             encap, VXLAN frames from the remote node for decap) with
//!             the kernel's BPF run-time statistics on (BPF_ENABLE_STATS:
//!             `run_time_ns` / `run_cnt` of each program), the baselines
//!             attached first on the same hook in their own slices.

use std::{
    collections::BTreeSet,
    sync::atomic::{AtomicBool, Ordering},
    thread::sleep,
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::programs::{LinkOrder, SchedClassifier, TcAttachType, TestRun, TestRunOptions, tc};
use vmpath::{
    apply::dataplane::Dataplane, config, plan, resolve::ipam, resolve::resolved::Resolved,
};
use vmpath_common::{VXLAN_IFNAME, VXLAN_OVERHEAD, VXLAN_PORT, drop_reason, prog_names};
use vmpath_tests::{Netns, link, unique_tag, yaml, yaml_overlay};

use crate::{
    e2e::ip_in_receives,
    progcost::{
        Root, SKB_CTX_LEN, SKB_IFINDEX, SKB_INGRESS_IFINDEX, TC_ACT_OK, TC_ACT_REDIRECT,
        TC_ACT_SHOT,
    },
    report::{Bar, Section},
    util::{self, Mac, RawSock, fmt, fmt_summary, summary},
};

pub struct Options {
    pub runs: usize,
    pub repeat: u32,
    pub single_shots: usize,
    /// Live: rounds, and the length of one slice (one program on one hook).
    pub live_rounds: usize,
    pub slice_ms: u64,
}

const NET_ID: u32 = 700;
const LOCAL_IP: [u8; 4] = [192, 0, 2, 1];
const REMOTE_IP: [u8; 4] = [192, 0, 2, 2];
const VM1_MAC: Mac = [0x52, 0x54, 0, 0, 0x0d, 0x01];
const VM2_MAC: Mac = [0x52, 0x54, 0, 0, 0x0d, 0x02];
const VM1_IP: [u8; 4] = [10, 40, 0, 11];
const VM2_IP: [u8; 4] = [10, 40, 0, 12];
const UL_MAC: Mac = [0x02, 0, 0, 0, 0x0d, 0x01];
const REMOTE_UL_MAC: Mac = [0x02, 0, 0, 0, 0x0d, 0x02];
const PORT: &str = "ov-port";
const UNDERLAY: &str = "ov-ul";
const UNDERLAY_MTU: u32 = 9000;

/// The namespaces: the VM and the remote node are named (sender threads
/// enter them); the node is where the data path runs.
struct Beds {
    node: Netns,
    vm: Netns,
    remote: Netns,
}

fn beds() -> Result<Beds> {
    let tag = unique_tag();
    let node = Netns::new(format!("vb{tag}-ovn"));
    let vm = Netns::new(format!("vb{tag}-ovv"));
    let remote = Netns::new(format!("vb{tag}-ovr"));
    // No IPv6 chatter (DAD, router solicitations) crossing the overlay
    // while the counters are checked.
    for ns in [&node, &vm, &remote] {
        for k in ["all", "default"] {
            ns.run(&[
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{k}.disable_ipv6=1"),
            ]);
        }
    }
    link(&node, PORT, "", &vm, "eth0", "10.40.0.11/16");
    vm.run(&[
        "ip",
        "link",
        "set",
        "eth0",
        "address",
        &util::mac_str(&VM1_MAC),
    ]);
    link(
        &node,
        UNDERLAY,
        "192.0.2.1/24",
        &remote,
        "ul0",
        "192.0.2.2/24",
    );
    node.run(&[
        "ip",
        "link",
        "set",
        UNDERLAY,
        "address",
        &util::mac_str(&UL_MAC),
    ]);
    remote.run(&[
        "ip",
        "link",
        "set",
        "ul0",
        "address",
        &util::mac_str(&REMOTE_UL_MAC),
    ]);
    let mtu = UNDERLAY_MTU.to_string();
    node.run(&["ip", "link", "set", UNDERLAY, "mtu", &mtu]);
    remote.run(&["ip", "link", "set", "ul0", "mtu", &mtu]);
    Ok(Beds { node, vm, remote })
}

fn config_text(port: &str) -> String {
    let ip = |a: [u8; 4]| format!("{}.{}.{}.{}", a[0], a[1], a[2], a[3]);
    yaml::docs(&[
        yaml_overlay::node("a", &ip(LOCAL_IP)),
        yaml_overlay::node("b", &ip(REMOTE_IP)),
        yaml::network("ovbench", NET_ID, &["10.40.0.0/16"], &["10.40.0.1"], true),
        yaml::attachment(
            "vm1",
            "ovbench",
            "a",
            port,
            &util::mac_str(&VM1_MAC),
            &["10.40.0.11/16"],
        ),
        yaml::attachment(
            "vm2",
            "ovbench",
            "b",
            "eth9",
            &util::mac_str(&VM2_MAC),
            &["10.40.0.12/16"],
        ),
    ])
}

/// Config -> plan -> `Dataplane::apply`, then the overlay's device and
/// receive program as the agent's overlay tick makes them, for node a (in
/// the calling thread's namespace).
fn program(dp: &mut Dataplane, dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.yaml"), config_text(PORT))?;
    let snap = config::source::read_dir(dir);
    let validated = vmpath::round::validate(&snap, "a", &BTreeSet::new());
    if !validated.errors.is_empty() {
        bail!("config refused: {}", validated.errors[0]);
    }
    let mut cfg = Resolved::new(validated);
    ipam::assign(&mut cfg, &Default::default());
    let p = plan::plan(&cfg, "a", vmpath::sys::netif::ifindex_of);
    if !p.problems.is_empty() || p.ports.len() != 1 {
        bail!("plan: {} ports, problems {:?}", p.ports.len(), p.problems);
    }
    dp.apply(&p).context("applying the plan")?;
    let ifindex = vmpath::apply::overlay::ensure_device(
        Some(std::net::Ipv4Addr::from(LOCAL_IP).into()),
        UNDERLAY_MTU - VXLAN_OVERHEAD,
    )?;
    dp.attach_vxlan(
        VXLAN_IFNAME,
        vmpath_common::OverlayConfig {
            vxlan_ifindex: ifindex,
            local_ip4: LOCAL_IP,
            ..Default::default()
        },
    )?;
    let cfg0 = dp
        .maps()
        .overlay
        .get(&0, 0)
        .context("reading the overlay slot")?;
    if cfg0.vxlan_ifindex == 0 || cfg0.local_ip4 != LOCAL_IP {
        bail!("the overlay did not come up (slot {cfg0:?})");
    }
    Ok(())
}

fn ctx_for(ifx: u32) -> [u8; SKB_CTX_LEN] {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
    ctx
}

/// An outer Ethernet/IPv4/UDP/VXLAN frame from the remote node carrying
/// `inner` with VNI `vni` (outer UDP checksum 0, as Linux sends).
fn vxlan_frame(vni: u32, inner: &[u8]) -> Vec<u8> {
    let mut payload = vec![0x08, 0, 0, 0];
    payload.extend_from_slice(&(vni << 8).to_be_bytes());
    payload.extend_from_slice(inner);
    util::udp4(
        UL_MAC,
        REMOTE_UL_MAC,
        REMOTE_IP,
        LOCAL_IP,
        49152,
        VXLAN_PORT,
        &payload,
    )
}

/// Drop counters by name that moved between two readings.
fn drops_between(before: &[u64], after: &[u64]) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .enumerate()
        .filter(|(_, (b, a))| a > b)
        .map(|(i, (b, a))| format!("{} {}", drop_reason::NAMES[i], a - b))
        .collect()
}

pub fn run(opts: &Options) -> Result<Section> {
    let beds = beds()?;
    let root = Root(std::path::PathBuf::from(format!(
        "/sys/fs/bpf/vmpath-bench-ov-{}",
        std::process::id()
    )));
    let dir = std::env::temp_dir().join(format!("vmpath-bench-ov-{}", std::process::id()));
    let node_path = beds.node.path();
    let result = std::thread::scope(|s| {
        s.spawn(|| -> Result<Section> {
            util::enter_netns(&node_path)?;
            let mut dp = Dataplane::open(&root.0).context("loading the data path")?;
            let r = measure(opts, &mut dp, &beds, &dir);
            drop(dp);
            r
        })
        .join()
        .map_err(|_| anyhow!("overlay cost thread panicked"))?
    });
    let _ = std::fs::remove_dir_all(&dir);
    drop(root);
    drop(beds);
    result
}

/// Kernel-reported (run time ns, run count) of a loaded program.
fn stats(dp: &Dataplane, name: &str) -> Result<(u64, u64)> {
    let info = dp
        .program(name)
        .ok_or_else(|| anyhow!("program {name} not loaded"))?
        .info()?;
    Ok((info.run_time().as_nanos() as u64, info.run_count()))
}

fn measure(
    opts: &Options,
    dp: &mut Dataplane,
    beds: &Beds,
    dir: &std::path::Path,
) -> Result<Section> {
    let port = vmpath::sys::netif::ifindex_of(PORT).ok_or_else(|| anyhow!("no {PORT}"))?;
    program(dp, dir)?;
    let vxlan =
        vmpath::sys::netif::ifindex_of(VXLAN_IFNAME).ok_or_else(|| anyhow!("no {VXLAN_IFNAME}"))?;
    crate::progcost::load_baselines(dp, port)?;
    let (port_ctx, vxlan_ctx) = (ctx_for(port), ctx_for(vxlan));
    // VM1 -> VM2 (on node b): encap. VM2 -> VM1 as it comes out of the
    // kernel's vxlan driver: decap.
    let to_remote = util::udp4_min(VM2_MAC, VM1_MAC, VM1_IP, VM2_IP);
    let from_remote = util::udp4_min(VM1_MAC, VM2_MAC, VM2_IP, VM1_IP);
    let tx = |dp: &Dataplane| dp.maps().overlay_stats().map(|s| s.tx_packets);

    // --- test_run: encap (repeat and single-shot), with baselines ---
    struct Case {
        name: &'static str,
        prog: &'static str,
        verdict: u32,
        encap: bool,
    }
    let cases = [
        Case {
            name: "baseline: no-op tc program (VM port)",
            prog: "bench_noop",
            verdict: TC_ACT_OK,
            encap: false,
        },
        Case {
            name: "baseline: bare bpf_redirect_peer (VM port)",
            prog: "bench_redirect_peer",
            verdict: TC_ACT_REDIRECT,
            encap: false,
        },
        Case {
            name: "VXLAN encap (vm_port → vm_remote tail call, set_tunnel_key, redirect to vmp-vxlan)",
            prog: prog_names::VM_PORT,
            verdict: TC_ACT_REDIRECT,
            encap: true,
        },
    ];
    let mut rep: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut one: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..opts.runs {
        for (i, c) in cases.iter().enumerate() {
            let prog = dp
                .program(c.prog)
                .ok_or_else(|| anyhow!("program {} not loaded", c.prog))?;
            let before = tx(dp)?;
            let r = prog.test_run(TestRunOptions {
                data_in: Some(&to_remote),
                ctx_in: Some(&port_ctx),
                repeat: opts.repeat,
                ..Default::default()
            })?;
            if r.return_value != c.verdict {
                bail!(
                    "{}: verdict {}, expected {}",
                    c.name,
                    r.return_value,
                    c.verdict
                );
            }
            rep[i].push(r.duration.as_nanos() as f64);
            let mut total = 0u128;
            for _ in 0..opts.single_shots {
                let r = prog.test_run(TestRunOptions {
                    data_in: Some(&to_remote),
                    ctx_in: Some(&port_ctx),
                    ..Default::default()
                })?;
                if r.return_value != c.verdict {
                    bail!("{}: verdict {} (single shot)", c.name, r.return_value);
                }
                total += r.duration.as_nanos();
            }
            one[i].push(total as f64 / opts.single_shots as f64);
            // Every encap run went to the overlay (not flooded, not
            // dropped); a few frames of the VM's own may come on top.
            let sent = tx(dp)? - before;
            let want = if c.encap {
                u64::from(opts.repeat) + opts.single_shots as u64
            } else {
                0
            };
            if sent < want || sent > want + 100 {
                bail!("{}: overlay tx counted {sent}, expected {want}", c.name);
            }
        }
    }

    // --- test_run: decap, once, to see what it does ---
    let decap_note = {
        let before = dp.maps().drop_counts()?;
        let mut out = vec![0u8; 256];
        let r = dp
            .program(prog_names::VXLAN_RX)
            .ok_or_else(|| anyhow!("vxlan_rx not loaded"))?
            .test_run(TestRunOptions {
                data_in: Some(&from_remote),
                data_out: Some(&mut out),
                ctx_in: Some(&vxlan_ctx),
                ..Default::default()
            })?;
        let after = dp.maps().drop_counts()?;
        let moved = drops_between(&before, &after);
        eprintln!(
            "bench:   vxlan_rx under test_run: verdict {}, drops {moved:?}",
            r.return_value
        );
        (r.return_value, moved)
    };

    // --- live: kernel run-time statistics on real frames ---
    let live = live(opts, dp, beds, &to_remote, &from_remote)?;

    // --- report ---
    let noop_a = summary(&rep[0]).median;
    let redir_a = summary(&rep[1]).median;
    let noop_b = summary(&one[0]).median;
    let redir_b = summary(&one[1]).median;
    let mut md = format!(
        "The overlay's programs, set up as the agent does it (config documents → \
         validate → IPAM → plan → `Dataplane::apply`; then the agent's `overlay::ensure_device` \
         makes the collect-metadata `vmp-vxlan` device and `Dataplane::attach_vxlan` \
         attaches `vxlan_rx` and fills the overlay slot) in a node \
         namespace with a real VM veth port and an underlay veth to a \"remote node\" \
         namespace (192.0.2.2) hosting the network's other VM. Encap: a 60-byte UDP \
         frame from the local VM to the remote VM's MAC (its endpoint is \
         `ENDPOINT_REMOTE`): `vm_port` → tail call `vm_remote` → \
         `bpf_skb_set_tunnel_key` → `bpf_redirect` to `vmp-vxlan`; the kernel's vxlan \
         driver then builds the outer headers (not part of the program). Decap: \
         `vxlan_rx` at tcx ingress of `vmp-vxlan`, which reads the tunnel key the \
         driver attached, checks the VNI and the sending VTEP and delivers with \
         `bpf_redirect_peer`.\n\n\
         **BPF_PROG_TEST_RUN** (modes A and B of section 1: repeat = {}, and {} \
         single-shot runs, {} runs each; same frame and `__sk_buff` for the baselines \
         on the VM-port hook; every encap run checked in the overlay's tx counter, so \
         each one took the remote path):\n\n\
         | path | A: ns/pkt, repeat | A ÷ no-op | A ÷ redirect_peer | B: ns/pkt, single-shot | B ÷ no-op | B ÷ redirect_peer |\n|---|---|---|---|---|---|---|\n",
        opts.repeat, opts.single_shots, opts.runs
    );
    let mut bars = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let (a, b) = (summary(&rep[i]), summary(&one[i]));
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            c.name,
            fmt_summary(&a),
            fmt(a.median / noop_a),
            fmt(a.median / redir_a),
            fmt_summary(&b),
            fmt(b.median / noop_b),
            fmt(b.median / redir_b),
        ));
        if c.encap {
            bars.push(Bar {
                label: "VXLAN encap, test_run (A)".into(),
                ratio: a.median / redir_a,
                baseline: "bare redirect_peer".into(),
            });
        }
    }
    let (verdict, moved) = &decap_note;
    let verdict_name = match *verdict {
        TC_ACT_SHOT => "TC_ACT_SHOT".to_string(),
        TC_ACT_REDIRECT => "TC_ACT_REDIRECT".to_string(),
        TC_ACT_OK => "TC_ACT_OK".to_string(),
        v => v.to_string(),
    };
    md.push_str(&format!(
        "\n**Decap cannot be measured by BPF_PROG_TEST_RUN.** test_run hands the program \
         a freshly built skb with no tunnel metadata (no `metadata_dst`: the \
         `__sk_buff` it accepts has no tunnel fields, and only the vxlan driver's \
         receive path attaches one), so `bpf_skb_get_tunnel_key` fails and `vxlan_rx` \
         drops the frame before any decap work: with the same inner frame and \
         `__sk_buff.ifindex` = `vmp-vxlan` it returned verdict {verdict} \
         ({verdict_name}), drop counters moved: {} (`vxlan_rx` counts \
         `helper_failed` before the VNI check only when that helper fails; a key \
         read as zeroes would have counted `overlay_unknown_vni`). A ns/pkt figure for that would \
         time the failed helper call, not the decap path, so none is given; the live \
         figures below measure it instead.\n\n",
        if moved.is_empty() {
            "none".to_string()
        } else {
            moved.join(", ")
        }
    ));
    md.push_str(&format!(
        "**Live, kernel BPF statistics** (`BPF_ENABLE_STATS`: the kernel times every \
         run of a program with `sched_clock` and adds it to the program's \
         `run_time_ns` / `run_cnt`; ns/run = Δrun_time_ns ÷ Δrun_cnt, tail-called \
         `vm_remote` included in `vm_port`'s time). Real frames for {} ms per slice, \
         {} rounds, one slice per program per hook in each round: encap = a raw \
         socket in the VM sending the 60-byte frame to the remote VM (`sendmmsg`), the \
         VM-port program at tcx ingress of the port; decap = the remote node's \
         underlay end sending ready-made VXLAN frames (VNI {NET_ID}, outer UDP \
         checksum 0) to 192.0.2.1:{VXLAN_PORT}, received by the kernel's vxlan driver, \
         `vxlan_rx` at tcx ingress of `vmp-vxlan` delivering into the VM. Baselines: \
         `bench_noop` and `bench_redirect_peer` (into the VM) attached first on the \
         same hook for their slice only, so they alone run on it. This counts \
         whatever the kernel's timer adds per run (two `sched_clock` reads), for \
         baselines and paths alike; it is a different method from test_run, so \
         compare ratios within a table.\n\n\
         | hook | program | ns/run (kernel stats) | ÷ no-op | ÷ redirect_peer | runs counted | delivered |\n|---|---|---|---|---|---|---|\n",
        opts.slice_ms, opts.live_rounds
    ));
    for hook in &live {
        let noop = summary(&hook.rows[0].ns).median;
        let redir = summary(&hook.rows[1].ns).median;
        for (i, row) in hook.rows.iter().enumerate() {
            let s = summary(&row.ns);
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                hook.hook,
                row.name,
                fmt_summary(&s),
                fmt(s.median / noop),
                fmt(s.median / redir),
                row.runs,
                row.delivered
            ));
            if i == 2 {
                bars.push(Bar {
                    label: format!("{}, live kernel stats", hook.label),
                    ratio: s.median / redir,
                    baseline: "bare redirect_peer".into(),
                });
            }
        }
    }
    Ok(Section {
        title: "1c. Overlay: VXLAN encap and decap".into(),
        markdown: md,
        bars,
    })
}

struct LiveRow {
    name: String,
    ns: Vec<f64>,
    runs: u64,
    delivered: String,
}

struct LiveHook {
    hook: &'static str,
    label: &'static str,
    rows: Vec<LiveRow>,
}

/// Sends `frame` from `ifname` of `sender` for `ms` (raw socket,
/// sendmmsg).
fn blast(sender: &Netns, ifname: &str, frame: &[u8], ms: u64) -> Result<u64> {
    let stop = AtomicBool::new(false);
    let ns_path = sender.path();
    std::thread::scope(|s| -> Result<u64> {
        let h = s.spawn(|| -> Result<u64> {
            util::enter_netns(&ns_path)?;
            let sock = RawSock::open(ifname)?;
            sock.qdisc_bypass();
            Ok(sock.blast(frame, 64, &stop))
        });
        sleep(Duration::from_millis(ms));
        stop.store(true, Ordering::Relaxed);
        h.join().map_err(|_| anyhow!("sender panicked"))?
    })
}

fn live(
    opts: &Options,
    dp: &mut Dataplane,
    beds: &Beds,
    to_remote: &[u8],
    from_remote: &[u8],
) -> Result<Vec<LiveHook>> {
    let decap_frame = vxlan_frame(NET_ID, from_remote);
    // Warm up: the remote node's underlay address resolved (the VM itself
    // sends nothing but the measured frames: its ARP would cross too).
    beds.node
        .run_status(&["ping", "-c", "1", "-W", "1", "192.0.2.2"]);
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("BPF_ENABLE_STATS (kernel BPF run-time statistics)")?;
    struct Hook<'a> {
        hook: &'static str,
        label: &'static str,
        ifname: &'static str,
        path: &'static str,
        sender: &'a Netns,
        send_if: &'static str,
        frame: &'a [u8],
        receiver: &'a Netns,
    }
    let hooks = [
        Hook {
            hook: "VM port (tcx ingress)",
            label: "VXLAN encap",
            ifname: PORT,
            path: "vm_port → vm_remote (encap)",
            sender: &beds.vm,
            send_if: "eth0",
            frame: to_remote,
            receiver: &beds.remote,
        },
        Hook {
            hook: "vmp-vxlan (tcx ingress)",
            label: "VXLAN decap",
            ifname: VXLAN_IFNAME,
            path: "vxlan_rx (decap, deliver to the VM)",
            sender: &beds.remote,
            send_if: "ul0",
            frame: &decap_frame,
            receiver: &beds.vm,
        },
    ];
    let progs = ["bench_noop", "bench_redirect_peer", ""];
    let mut out = Vec::new();
    for h in &hooks {
        let real = if h.ifname == PORT {
            prog_names::VM_PORT
        } else {
            prog_names::VXLAN_RX
        };
        let mut ns: Vec<Vec<f64>> = vec![Vec::new(); 3];
        let mut runs = [0u64; 3];
        let mut sent = [0u64; 3];
        let mut recvd = [0u64; 3];
        for round in 0..opts.live_rounds {
            // Rotate the order per round so drift hits all three alike.
            for k in 0..3 {
                let i = (k + round) % 3;
                let name = if progs[i].is_empty() { real } else { progs[i] };
                let link = if progs[i].is_empty() {
                    None
                } else {
                    let p: &mut SchedClassifier = dp
                        .program_mut(name)
                        .ok_or_else(|| anyhow!("{name} missing"))?;
                    Some(
                        p.attach_with_options(
                            h.ifname,
                            TcAttachType::Ingress,
                            tc::TcAttachOptions::TcxOrder(LinkOrder::first()),
                        )
                        .with_context(|| format!("attaching {name} to {}", h.ifname))?,
                    )
                };
                let (t0, c0) = stats(dp, name)?;
                let rx0 = ip_in_receives(h.receiver)?;
                let n = blast(h.sender, h.send_if, h.frame, opts.slice_ms)?;
                sleep(Duration::from_millis(50));
                let (t1, c1) = stats(dp, name)?;
                let rx1 = ip_in_receives(h.receiver)?;
                if let Some(id) = link {
                    let p: &mut SchedClassifier = dp
                        .program_mut(name)
                        .ok_or_else(|| anyhow!("{name} missing"))?;
                    p.detach(id)?;
                }
                if c1 <= c0 {
                    bail!("{}: {name} did not run on {}", h.hook, h.ifname);
                }
                ns[i].push((t1 - t0) as f64 / (c1 - c0) as f64);
                runs[i] += c1 - c0;
                sent[i] += n;
                recvd[i] += rx1 - rx0;
                eprintln!(
                    "bench:   live {} {name}: {:.1} ns/run over {} runs",
                    h.hook,
                    (t1 - t0) as f64 / (c1 - c0) as f64,
                    c1 - c0
                );
            }
        }
        let rows = (0..3)
            .map(|i| LiveRow {
                name: match i {
                    0 => "baseline: `bench_noop`".into(),
                    1 => "baseline: `bench_redirect_peer`".into(),
                    _ => h.path.into(),
                },
                ns: ns[i].clone(),
                runs: runs[i],
                delivered: if i == 2 {
                    format!(
                        "{} received, {} sent ({})",
                        recvd[i],
                        sent[i],
                        if h.ifname == PORT {
                            "VXLAN packets counted by the remote node's IP layer"
                        } else {
                            "counted by the VM's IP layer"
                        }
                    )
                } else {
                    "—".into()
                },
            })
            .collect();
        out.push(LiveHook {
            hook: h.hook,
            label: h.label,
            rows,
        });
    }
    Ok(out)
}
