//! Figure group 1: what each path of the VM-port program costs, by
//! BPF_PROG_TEST_RUN (kernel-reported ns per packet), against a no-op tc
//! program and a bare `bpf_redirect_peer` program loaded from the same
//! object, run with the same frame and `__sk_buff` on the same hook.
//!
//! The frames run in a private network namespace on a thread of their own
//! with real veth ports (the program looks its port up by ifindex).

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    process::Command,
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    maps::PerCpuValues,
    programs::{TestRun, TestRunOptions},
};
use vmpath::{apply::dataplane::Dataplane, plan::addr_key};
use vmpath_common::{
    ADDR_STATIC, AddrInfo, ENDPOINT_LOCAL, Endpoint, EndpointKey, FloodList, NET_F_GW4,
    NetworkInfo, PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PortInfo, PortStats,
    default_gateway_mac, link_local_from_mac,
};

use crate::{
    report::{Bar, Section},
    util::{self, Mac, fmt, fmt_summary, summary},
};

pub(crate) const SKB_CTX_LEN: usize = 192;
pub(crate) const SKB_INGRESS_IFINDEX: usize = 36;
pub(crate) const SKB_IFINDEX: usize = 40;
pub(crate) const TC_ACT_OK: u32 = 0;
pub(crate) const TC_ACT_SHOT: u32 = 2;
pub(crate) const TC_ACT_REDIRECT: u32 = 7;

const NET: u32 = 100;
const GW_IP: [u8; 4] = [10, 0, 0, 1];
const A_MAC: Mac = [0x52, 0x54, 0, 0, 0, 0x0a];
const B_MAC: Mac = [0x52, 0x54, 0, 0, 0, 0x0b];
const A_IP: [u8; 4] = [10, 0, 0, 10];
const B_IP: [u8; 4] = [10, 0, 0, 11];

pub struct Options {
    pub runs: usize,
    pub repeat: u32,
    pub single_shots: usize,
}

struct Case {
    name: &'static str,
    prog: &'static str,
    frame: Vec<u8>,
    verdict: u32,
    /// Does the program leave the frame as it found it? Only then can one
    /// test run repeat it (test_run reuses the skb between repetitions).
    idempotent: bool,
}

pub fn run(opts: &Options) -> Result<Section> {
    in_private_netns(|| run_in_netns(opts))
}

/// Runs `f` on a thread of its own in a fresh network namespace.
pub(crate) fn in_private_netns<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: affects only this thread (and its children).
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                bail!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .map_err(|_| anyhow!("the bench thread panicked"))?
    })
}

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn ifindex_of(name: &str) -> Result<u32> {
    vmpath::sys::netif::ifindex_of(name).ok_or_else(|| anyhow!("no interface {name}"))
}

/// A bpffs root for a private data path, cleaned up on drop.
pub(crate) struct Root(pub(crate) PathBuf);
impl Drop for Root {
    fn drop(&mut self) {
        let _ = vmpath::apply::dataplane::cleanup(&self.0);
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn run_in_netns(opts: &Options) -> Result<Section> {
    for p in ["bpa", "bpb"] {
        ip(&[
            "link",
            "add",
            p,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{p}-vm"),
        ])?;
        ip(&["link", "set", p, "up"])?;
        ip(&["link", "set", &format!("{p}-vm"), "up"])?;
    }
    let (a, b) = (ifindex_of("bpa")?, ifindex_of("bpb")?);
    let root = Root(PathBuf::from(format!(
        "/sys/fs/bpf/vmpath-bench-{}",
        std::process::id()
    )));
    let mut dp = Dataplane::open(&root.0).context("loading the data path")?;
    program_maps(&mut dp, a, b)?;
    load_baselines(&mut dp, b)?;

    let gw_mac = default_gateway_mac(NET);
    let l2 = util::udp4_min(B_MAC, A_MAC, A_IP, B_IP);
    let cases = vec![
        Case {
            name: "baseline: no-op tc program",
            prog: "bench_noop",
            frame: l2.clone(),
            verdict: TC_ACT_OK,
            idempotent: true,
        },
        Case {
            name: "baseline: bare bpf_redirect_peer",
            prog: "bench_redirect_peer",
            frame: l2.clone(),
            verdict: TC_ACT_REDIRECT,
            idempotent: true,
        },
        Case {
            name: "L2 local forward (UDP, 60 B)",
            prog: "vm_port",
            frame: l2.clone(),
            verdict: TC_ACT_REDIRECT,
            idempotent: true,
        },
        Case {
            name: "spoof drop (foreign source IP)",
            prog: "vm_port",
            frame: util::udp4_min(B_MAC, A_MAC, [10, 0, 0, 99], B_IP),
            verdict: TC_ACT_SHOT,
            idempotent: true,
        },
        Case {
            name: "gateway ARP reply",
            prog: "vm_port",
            frame: util::arp_request(A_MAC, A_IP, GW_IP),
            verdict: TC_ACT_REDIRECT,
            idempotent: false,
        },
        Case {
            name: "ARP answered for a known VM (vm_port → vm_neigh tail call)",
            prog: "vm_port",
            frame: util::arp_request(A_MAC, A_IP, B_IP),
            verdict: TC_ACT_REDIRECT,
            idempotent: false,
        },
        Case {
            name: "gateway ICMP echo reply",
            prog: "vm_port",
            frame: util::echo4(gw_mac, A_MAC, A_IP, GW_IP),
            verdict: TC_ACT_REDIRECT,
            idempotent: false,
        },
    ];

    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&a.to_ne_bytes());
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&a.to_ne_bytes());

    // Check each case takes the path it names before timing it.
    for c in &cases {
        let prog = dp
            .program(c.prog)
            .ok_or_else(|| anyhow!("program {} not loaded", c.prog))?;
        let mut out = vec![0u8; 256];
        let r = prog.test_run(TestRunOptions {
            data_in: Some(&c.frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..Default::default()
        })?;
        if r.return_value != c.verdict {
            bail!(
                "{}: verdict {}, expected {} (the path under test is not the one taken)",
                c.name,
                r.return_value,
                c.verdict
            );
        }
    }
    let gw_replies = |dp: &Dataplane| -> u64 {
        dp.maps()
            .port_stats(a)
            .ok()
            .flatten()
            .map(|s| s.gw_replies)
            .unwrap_or(0)
    };

    // Mode 1: one test run repeated `repeat` times in the kernel.
    let mut repeated: Vec<(usize, Vec<f64>)> = Vec::new();
    // Mode 2: `single_shots` test runs of one repetition each.
    let mut single: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _run in 0..opts.runs {
        for (i, c) in cases.iter().enumerate() {
            let prog = dp.program(c.prog).unwrap();
            if c.idempotent {
                let r = prog.test_run(TestRunOptions {
                    data_in: Some(&c.frame),
                    ctx_in: Some(&ctx),
                    repeat: opts.repeat,
                    ..Default::default()
                })?;
                if r.return_value != c.verdict {
                    bail!("{}: verdict {} after repeat", c.name, r.return_value);
                }
                match repeated.iter_mut().find(|(j, _)| *j == i) {
                    Some((_, v)) => v.push(r.duration.as_nanos() as f64),
                    None => repeated.push((i, vec![r.duration.as_nanos() as f64])),
                }
            }
            let before = gw_replies(&dp);
            let mut total = 0u128;
            for _ in 0..opts.single_shots {
                let r = prog.test_run(TestRunOptions {
                    data_in: Some(&c.frame),
                    ctx_in: Some(&ctx),
                    ..Default::default()
                })?;
                total += r.duration.as_nanos();
            }
            if !c.idempotent && gw_replies(&dp) - before != opts.single_shots as u64 {
                bail!("{}: not every single-shot run was answered", c.name);
            }
            single[i].push(total as f64 / opts.single_shots as f64);
        }
    }

    let noop_rep = summary(&repeated.iter().find(|(i, _)| *i == 0).unwrap().1);
    let redir_rep = summary(&repeated.iter().find(|(i, _)| *i == 1).unwrap().1);
    let noop_one = summary(&single[0]);
    let redir_one = summary(&single[1]);

    let mut md = String::new();
    md.push_str(&format!(
        "BPF_PROG_TEST_RUN of the VM-port program (`vm_port`, tcx ingress) with the \
         frame arriving on a real veth port (`__sk_buff.ifindex`), port security on \
         (MAC, IP), counters on. Baselines are two programs of the bench's own object (`vmpath-bench`) \
         (`ebpf/src/prog/bench.rs`) on the same hook with the same frame and context: \
         `bench_noop` (returns TC_ACT_OK) and `bench_redirect_peer` (one array \
         lookup, `bpf_redirect_peer`). test_run does not execute redirects; it \
         returns the verdict, so this is the program's own cost.\n\n\
         **A** = one test run with repeat = {} (the kernel's average ns per \
         repetition; {} runs). test_run reuses the same skb between repetitions, so \
         paths that rewrite the frame in place (ARP and ICMP replies) cannot be \
         repeated: their second repetition would see the reply, not the request. \
         **B** = {} test runs of one repetition each per run, {} runs ({} frames \
         per figure, kernel-measured time of each run averaged; includes one \
         `ktime_get_ns` per run, so it reads higher than A for the same path; \
         every answered frame is checked in the port's `gw_replies` counter).\n\n",
        opts.repeat,
        opts.runs,
        opts.single_shots,
        opts.runs,
        opts.single_shots * opts.runs
    ));
    md.push_str(
        "| path | A: ns/pkt, repeat | A ÷ no-op | A ÷ redirect_peer | B: ns/pkt, single-shot | B ÷ no-op | B ÷ redirect_peer |\n|---|---|---|---|---|---|---|\n",
    );
    let mut bars = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let one = summary(&single[i]);
        let (a_txt, a_noop, a_redir) = match repeated.iter().find(|(j, _)| *j == i) {
            Some((_, v)) => {
                let s = summary(v);
                if i >= 2 {
                    bars.push(Bar {
                        label: format!("{} (A)", c.name),
                        ratio: s.median / redir_rep.median,
                        baseline: "bare redirect_peer".into(),
                    });
                }
                (
                    fmt_summary(&s),
                    fmt(s.median / noop_rep.median),
                    fmt(s.median / redir_rep.median),
                )
            }
            None => ("— (rewrites the frame)".into(), "—".into(), "—".into()),
        };
        if i >= 2 && !c.idempotent {
            bars.push(Bar {
                label: format!("{} (B)", c.name),
                ratio: one.median / redir_one.median,
                baseline: "bare redirect_peer".into(),
            });
        }
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            c.name,
            a_txt,
            a_noop,
            a_redir,
            fmt_summary(&one),
            fmt(one.median / noop_one.median),
            fmt(one.median / redir_one.median),
        ));
    }
    md.push_str("\nNorth-south paths: section 1b.\n");
    Ok(Section {
        title: "1. Per-path program cost (BPF_PROG_TEST_RUN)".into(),
        markdown: md,
        bars,
    })
}

/// Loads the baseline programs (`ebpf/src/prog/bench.rs`, their own object)
/// beside the data path's; `bench_redirect_peer` redirects to `peer`.
pub(crate) fn load_baselines(dp: &mut Dataplane, peer: u32) -> Result<()> {
    dp.load_bench_baselines(peer)
}

fn program_maps(dp: &mut Dataplane, a: u32, b: u32) -> Result<()> {
    let nr_cpus = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
    let gw_mac = default_gateway_mac(NET);
    let maps = dp.maps_mut();
    maps.networks.insert(
        NET,
        NetworkInfo {
            gw_mac,
            flags: NET_F_GW4,
            gw_ip4: GW_IP,
            mtu: 1500,
            gw_ll6: link_local_from_mac(gw_mac),
            ..Default::default()
        },
        0,
    )?;
    let mut flood = FloodList::default();
    flood.ifindex[0] = a;
    flood.ifindex[1] = b;
    flood.port_id[..2].copy_from_slice(&[1, 2]);
    flood.count = 2;
    maps.flood.insert(NET, flood, 0)?;
    for (i, (ifx, mac, ip4)) in [(a, A_MAC, A_IP), (b, B_MAC, B_IP)].into_iter().enumerate() {
        maps.ports.insert(
            ifx,
            PortInfo {
                port_id: i as u32 + 1,
                network: NET,
                mac,
                flags: PORT_F_MAC_FILTER | PORT_F_IP_FILTER | PORT_F_MAC_KNOWN,
                gw_mac,
                _pad: 0,
                ip4,
                ip6: [0; 16],
            },
            0,
        )?;
        let zero = PerCpuValues::try_from(vec![PortStats::default(); nr_cpus])?;
        maps.port_stats.set(i as u32 + 1, zero, 0)?;
        maps.endpoints.insert(
            EndpointKey {
                network: NET,
                mac,
                _pad: [0; 2],
            },
            Endpoint {
                kind: ENDPOINT_LOCAL,
                ifindex: ifx,
                port_id: i as u32 + 1,
                ..Default::default()
            },
            0,
        )?;
        maps.addresses.insert(
            addr_key(NET, IpAddr::V4(Ipv4Addr::from(ip4))),
            AddrInfo {
                ifindex: ifx,
                origin: ADDR_STATIC,
                mac,
                _pad: [0; 2],
                port_id: i as u32 + 1,
                node_ip4: [0; 4],
            },
            0,
        )?;
    }
    Ok(())
}

/// North-south paths: SNAT egress (vm_port tail-calling vm_egress, fib
/// lookup, redirect_neigh), SNAT return and routed ingress (uplink), routed
/// egress. Each rewrites the frame, so single-shot runs only; baselines run
/// the same way in the same loop.
/// Clears every next hop the egress paths keep (SNAT flows' and routed),
/// so no row runs on a hop an earlier row kept.
fn forget_kept_hops(dp: &mut Dataplane) -> Result<()> {
    let maps = dp.maps_mut();
    let flows: Vec<_> = maps.snat_out.iter().filter_map(|r| r.ok()).collect();
    for (k, mut e) in flows {
        e.hop = Default::default();
        maps.snat_out.insert(k, e, 0)?;
    }
    let hops: Vec<_> = maps.hops4.keys().filter_map(|r| r.ok()).collect();
    for k in hops {
        maps.hops4.remove(&k)?;
    }
    Ok(())
}

pub fn north_south(opts: &Options) -> Result<Section> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: affects only this thread (and its children).
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                bail!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
            }
            north_south_in_netns(opts)
        })
        .join()
        .map_err(|_| anyhow!("north-south thread panicked"))?
    })
}

const NS_NET: u32 = 600;
const NS_VM_MAC: Mac = [0x52, 0x54, 0, 0, 0x0c, 1];
const NS_VM_IP: [u8; 4] = [10, 30, 0, 21];
const NODE_IP: [u8; 4] = [192, 0, 2, 1];
const EXT_IP: [u8; 4] = [198, 51, 100, 10];
const UPLINK_MAC: Mac = [0x02, 0, 0, 0, 0, 1];
const TOR_MAC: Mac = [0x02, 0, 0, 0, 0, 2];

fn north_south_in_netns(opts: &Options) -> Result<Section> {
    use aya::maps::lpm_trie::Key;
    use vmpath_common::{AddrKey, NET_F_ROUTED, NET_F_SNAT, RoutedAddr, SnatConfig, Subnet4};
    ip(&[
        "link", "add", "ns-port", "type", "veth", "peer", "name", "ns-vm",
    ])?;
    ip(&[
        "link", "add", "ns-up", "type", "veth", "peer", "name", "ns-tor",
    ])?;
    for i in ["ns-port", "ns-vm", "ns-up", "ns-tor", "lo"] {
        ip(&["link", "set", i, "up"])?;
    }
    ip(&["addr", "add", "192.0.2.1/24", "dev", "ns-up"])?;
    ip(&["link", "set", "ns-up", "address", "02:00:00:00:00:01"])?;
    ip(&[
        "neigh",
        "add",
        "192.0.2.2",
        "lladdr",
        "02:00:00:00:00:02",
        "dev",
        "ns-up",
    ])?;
    ip(&["route", "add", "198.51.100.0/24", "via", "192.0.2.2"])?;
    util::sh(&["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    let (port, uplink) = (ifindex_of("ns-port")?, ifindex_of("ns-up")?);
    let root = Root(PathBuf::from(format!(
        "/sys/fs/bpf/vmpath-bench-ns-{}",
        std::process::id()
    )));
    let mut dp = Dataplane::open(&root.0).context("loading the data path")?;
    load_baselines(&mut dp, port)?;
    let gw_mac = default_gateway_mac(NS_NET);
    let nr = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
    // `mtu` above the uplink's (1500) keeps no next hop: every frame
    // looks its own up, as before next hops were kept.
    let set_net = |dp: &mut Dataplane, flag: u16, mtu: u16| -> Result<()> {
        dp.maps_mut().networks.insert(
            NS_NET,
            NetworkInfo {
                gw_mac,
                flags: NET_F_GW4 | flag,
                gw_ip4: [10, 30, 0, 1],
                mtu,
                ..Default::default()
            },
            0,
        )?;
        Ok(())
    };
    {
        let maps = dp.maps_mut();
        maps.ports.insert(
            port,
            PortInfo {
                port_id: 1,
                network: NS_NET,
                mac: NS_VM_MAC,
                flags: PORT_F_MAC_FILTER | PORT_F_MAC_KNOWN | PORT_F_IP_FILTER,
                gw_mac,
                _pad: 0,
                ip4: NS_VM_IP,
                ip6: [0; 16],
            },
            0,
        )?;
        maps.port_stats.set(
            1,
            PerCpuValues::try_from(vec![PortStats::default(); nr])?,
            0,
        )?;
        maps.addresses.insert(
            addr_key(NS_NET, IpAddr::V4(Ipv4Addr::from(NS_VM_IP))),
            AddrInfo {
                ifindex: port,
                origin: ADDR_STATIC,
                mac: NS_VM_MAC,
                _pad: [0; 2],
                port_id: 1,
                node_ip4: [0; 4],
            },
            0,
        )?;
        maps.subnets4.insert(
            &Key::new(
                32 + 16,
                Subnet4 {
                    network: NS_NET.to_be_bytes(),
                    addr: [10, 30, 0, 0],
                },
            ),
            1,
            0,
        )?;
        maps.snat_config.set(
            0,
            SnatConfig {
                addr4: NODE_IP,
                uplink,
                port_min: 40000,
                port_max: 59999,
                quota: 4096,
                tcp_timeout: 7440,
                tcp_closing_timeout: 240,
                udp_timeout: 300,
                icmp_timeout: 60,
                addr6: [0; 16],
            },
            0,
        )?;
        maps.routed.insert(
            AddrKey::v4(0, NS_VM_IP),
            RoutedAddr {
                ifindex: port,
                network: NS_NET,
                vm_mac: NS_VM_MAC,
                gw_mac,
                mtu: 1500,
                port_id: 1,
            },
            0,
        )?;
    }
    set_net(&mut dp, NET_F_SNAT, 1500)?;

    let ctx_for = |ifx: u32| {
        let mut ctx = [0u8; SKB_CTX_LEN];
        ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
        ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
        ctx
    };
    let (port_ctx, up_ctx) = (ctx_for(port), ctx_for(uplink));
    let egress = util::udp4(gw_mac, NS_VM_MAC, NS_VM_IP, EXT_IP, 5555, 53, &[0u8; 18]);
    // Establish the flow and learn its translated port.
    let mut out = vec![0u8; 256];
    let r = dp.program("vm_port").unwrap().test_run(TestRunOptions {
        data_in: Some(&egress),
        data_out: Some(&mut out),
        ctx_in: Some(&port_ctx),
        ..Default::default()
    })?;
    if r.return_value != TC_ACT_REDIRECT || out[26..30] != NODE_IP {
        bail!(
            "SNAT egress did not translate (verdict {}): north-south path not working",
            r.return_value
        );
    }
    let nat_port = u16::from_be_bytes([out[34], out[35]]);
    let ret = util::udp4(
        UPLINK_MAC, TOR_MAC, EXT_IP, NODE_IP, 53, nat_port, &[0u8; 18],
    );
    let routed_in = util::udp4(UPLINK_MAC, TOR_MAC, EXT_IP, NS_VM_IP, 53, 5555, &[0u8; 18]);

    struct Row<'a> {
        name: &'static str,
        prog: &'static str,
        frame: &'a [u8],
        ctx: &'a [u8; SKB_CTX_LEN],
        verdict: u32,
        /// Network egress flag while it runs.
        flag: u16,
        /// Network MTU while it runs (9000: no next hop kept).
        mtu: u16,
    }
    let rows = [
        Row {
            name: "baseline: no-op tc program",
            prog: "bench_noop",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_OK,
            flag: NET_F_SNAT,
            mtu: 1500,
        },
        Row {
            name: "baseline: bare bpf_redirect_peer",
            prog: "bench_redirect_peer",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_SNAT,
            mtu: 1500,
        },
        Row {
            name: "SNAT egress (UDP, flow established; vm_port → vm_egress tail call, the flow's kept next hop)",
            prog: "vm_port",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_SNAT,
            mtu: 1500,
        },
        Row {
            name: "SNAT return (uplink, reverse translation, redirect_peer)",
            prog: "uplink",
            frame: &ret,
            ctx: &up_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_SNAT,
            mtu: 1500,
        },
        Row {
            name: "routed ingress (uplink, TTL and MAC rewrite, redirect_peer)",
            prog: "uplink",
            frame: &routed_in,
            ctx: &up_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_SNAT,
            mtu: 1500,
        },
        Row {
            name: "routed egress (vm_port → vm_egress, the kept next hop, redirect)",
            prog: "vm_port",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_ROUTED,
            mtu: 1500,
        },
        Row {
            name: "SNAT egress, next hop looked up for every frame (bpf_fib_lookup; nothing kept)",
            prog: "vm_port",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_SNAT,
            mtu: 9000,
        },
        Row {
            name: "routed egress, next hop looked up for every frame (bpf_fib_lookup; nothing kept)",
            prog: "vm_port",
            frame: &egress,
            ctx: &port_ctx,
            verdict: TC_ACT_REDIRECT,
            flag: NET_F_ROUTED,
            mtu: 9000,
        },
    ];
    let mut single: Vec<Vec<f64>> = vec![Vec::new(); rows.len()];
    for _ in 0..opts.runs {
        for (i, row) in rows.iter().enumerate() {
            set_net(&mut dp, row.flag, row.mtu)?;
            forget_kept_hops(&mut dp)?;
            let prog = dp
                .program(row.prog)
                .ok_or_else(|| anyhow!("program {} not loaded", row.prog))?;
            let mut total = 0u128;
            for _ in 0..opts.single_shots {
                let r = prog.test_run(TestRunOptions {
                    data_in: Some(row.frame),
                    ctx_in: Some(row.ctx),
                    ..Default::default()
                })?;
                if r.return_value != row.verdict {
                    bail!(
                        "{}: verdict {}, expected {}",
                        row.name,
                        r.return_value,
                        row.verdict
                    );
                }
                total += r.duration.as_nanos();
            }
            single[i].push(total as f64 / opts.single_shots as f64);
        }
    }
    set_net(&mut dp, NET_F_SNAT, 1500)?;
    let noop = summary(&single[0]).median;
    let redir = summary(&single[1]).median;
    let mut md = format!(
        "The routed and SNAT paths as the tree has them now, by BPF_PROG_TEST_RUN in \
         a private namespace with a real uplink veth, a route and a resolved \
         neighbour (so `bpf_fib_lookup` succeeds). Every one of these rewrites the \
         frame in place, so only single-shot runs apply (mode B of section 1: {} \
         runs of one repetition each per run, {} runs; every verdict checked). \
         Baselines: the same two programs, run the same way in the same loop. \
         Routed egress runs with the network switched to `egress: Routed`. \
         Egress keeps the next hop `bpf_fib_lookup` gives for 100 ms (in the SNAT \
         flow's entry, in `vmp_hops4` for routed frames); the last two rows set the \
         network's MTU above the uplink's, where no hop is kept, so every frame \
         looks its own up as before hops were kept.\n\n\
         | path | B: ns/pkt, single-shot | ÷ no-op | ÷ redirect_peer |\n|---|---|---|---|\n",
        opts.single_shots, opts.runs
    );
    let mut bars = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let s = summary(&single[i]);
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            row.name,
            fmt_summary(&s),
            fmt(s.median / noop),
            fmt(s.median / redir)
        ));
        if i >= 2 {
            bars.push(Bar {
                label: row.name.split(" (").next().unwrap_or(row.name).to_string() + " (B)",
                ratio: s.median / redir,
                baseline: "bare redirect_peer".into(),
            });
        }
    }
    md.push_str("\nVXLAN encap/decap: section 1c.\n");
    Ok(Section {
        title: "1b. North-south paths (SNAT, routed)".into(),
        markdown: md,
        bars,
    })
}
