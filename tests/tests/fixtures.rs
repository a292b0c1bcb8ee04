//! Fixture tests for the `vm_port` tc program, Katran style: each table row
//! is an input frame sent from one port, the verdict the program must give,
//! and either the exact output frame or the drop reason it must count.
//!
//! Frames run through BPF_PROG_TEST_RUN. Each test builds a fresh network
//! namespace on its own thread with real veth ports (the program looks the
//! port up by `__sk_buff.ifindex`, which test_run takes from `ctx_in`, and
//! flooding clones to real devices), loads the data path with its maps
//! pinned under a private bpffs directory, and programs the maps by hand.
//!
//! Redirects are not executed by test_run (`bpf_redirect*` only return
//! TC_ACT_REDIRECT), so where a frame went is read from the per-port `tx`
//! counters the program bumps before redirecting; gateway answers are
//! counted in `gw_replies` of the port they go back out of.
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^fixtures::/)'

#[path = "fixtures/frames.rs"]
mod frames;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    process::Command,
};

use aya::{
    maps::PerCpuValues,
    programs::{ProgramError, TestRun, TestRunOptions},
};
use etherparse::{ArpOperation, Icmpv4Type, Icmpv6Type};
use frames::*;
use vmpath::{apply::dataplane::Dataplane, plan::addr_key};
use vmpath_common::{
    ADDR_STATIC, AddrInfo, ENDPOINT_LOCAL, Endpoint, EndpointKey, FloodList, LearnedIp,
    MAX_FLOOD_NODES, MAX_FLOOD_PORTS, NET_F_GW4, NET_F_GW6, NetworkInfo, OverlayConfig,
    PORT_F_DHCP_GUARD, PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PortInfo, PortStats,
    RemoteFloodList, RemoteLearned, default_gateway_mac,
    drop_reason::{self, *},
    link_local_from_mac,
};
use vmpath_tests::prog_fixture::{
    BpffsRoot, SKB_CTX_LEN, SKB_IFINDEX, SKB_INGRESS_IFINDEX, TC_ACT_OK, TC_ACT_REDIRECT,
    TC_ACT_SHOT, ifindex_of, in_fresh_netns,
};

// ===========================================================================
// Fixture harness
// ===========================================================================

/// Network 1: gateway with IPv4 and IPv6; ports A, B and C.
const NET1: u32 = 100;
/// Network 2: gateway MAC and addresses programmed but both gateway flags
/// off; port D, alone.
const NET2: u32 = 200;
/// The network of port E, never programmed.
const NET_MISSING: u32 = 300;

const GW1_MAC: Mac = default_gateway_mac(NET1);
const GW1_IP4: Ip4 = [10, 0, 0, 1];
const GW1_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1).octets();
const GW1_LL6: Ip6 = link_local_from_mac(GW1_MAC);
const GW2_MAC: Mac = default_gateway_mac(NET2);
const GW2_IP4: Ip4 = [10, 1, 0, 1];
const GW2_IP6: Ip6 = Ipv6Addr::new(0xfd01, 0, 0, 0, 0, 0, 0, 1).octets();

const FOREIGN_MAC: Mac = [0x52, 0x54, 0x00, 0x00, 0x00, 0x99];
const MCAST_MAC: Mac = [0x01, 0x00, 0x5e, 0x00, 0x00, 0x01];
const FOREIGN_IP4: Ip4 = [10, 0, 0, 99];
const FOREIGN_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x99).octets();
const UNSPEC6: Ip6 = [0; 16];
/// A VM of network 1 on another node: its addresses and MAC are known.
const REMOTE_MAC: Mac = [0x52, 0x54, 0x00, 0x00, 0x01, 0x77];
const REMOTE_IP4: Ip4 = [10, 0, 0, 77];
const REMOTE_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x77).octets();
/// A VM of network 1 on another node whose MAC is only known there
/// (detected): its addresses are known, not who answers for them.
const REMOTE_NO_MAC_IP4: Ip4 = [10, 0, 0, 78];
const REMOTE_NO_MAC_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x78).octets();
/// An address of network 1 port B uses, not accepted by the agent.
const LEARNED_IP4: Ip4 = [10, 0, 0, 79];
const LEARNED_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x79).octets();
/// An address of network 1 nobody holds.
const UNKNOWN_IP4: Ip4 = [10, 0, 0, 98];
const UNKNOWN_IP6: Ip6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x98).octets();

/// Port flag sets a row can give its ingress port.
const FILTERS: u16 = PORT_F_MAC_FILTER | PORT_F_IP_FILTER | PORT_F_MAC_KNOWN;
const NO_IP_FILTER: u16 = PORT_F_MAC_FILTER | PORT_F_MAC_KNOWN;
const NO_MAC_FILTER: u16 = PORT_F_IP_FILTER | PORT_F_MAC_KNOWN;
/// MAC filtering configured, but the port's MAC is not known yet.
const MAC_UNKNOWN: u16 = PORT_F_MAC_FILTER | PORT_F_IP_FILTER;
const NO_FILTERS: u16 = PORT_F_MAC_KNOWN;

/// The ports of the fixture. A, B, C: network 1 (flood order A, B, C).
/// D: network 2. E: a port whose network is missing. X: a veth that is not
/// a port at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum P {
    A,
    B,
    C,
    D,
    E,
    X,
}

const ALL_PORTS: [P; 6] = [P::A, P::B, P::C, P::D, P::E, P::X];

impl P {
    fn name(self) -> &'static str {
        match self {
            P::A => "vmpa",
            P::B => "vmpb",
            P::C => "vmpc",
            P::D => "vmpd",
            P::E => "vmpe",
            P::X => "vmpx",
        }
    }

    fn n(self) -> u8 {
        0x0a + self as u8
    }

    fn mac(self) -> Mac {
        [0x52, 0x54, 0x00, 0x00, 0x00, self.n()]
    }

    fn net(self) -> u32 {
        match self {
            P::A | P::B | P::C => NET1,
            P::D => NET2,
            P::E | P::X => NET_MISSING,
        }
    }

    fn ip4(self) -> Ip4 {
        match self.net() {
            NET2 => [10, 1, 0, self.n()],
            _ => [10, 0, 0, self.n()],
        }
    }

    fn ip6(self) -> Ip6 {
        let prefix = if self.net() == NET2 { 0xfd01 } else { 0xfd00 };
        Ipv6Addr::new(prefix, 0, 0, 0, 0, 0, 0, u16::from(self.n())).octets()
    }

    fn ll6(self) -> Ip6 {
        link_local_from_mac(self.mac())
    }

    /// In the ports map (X is not).
    fn programmed(self) -> bool {
        self != P::X
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What one test run gave.
struct Run {
    verdict: u32,
    out: Vec<u8>,
}

/// Counters summed over CPUs: per drop reason, and per port (None: the port
/// has no stats entry).
#[derive(Clone, Debug)]
struct Counters {
    drops: Vec<u64>,
    ports: BTreeMap<P, Option<PortStats>>,
}

/// What changed between two counter snapshots.
struct Delta {
    drops: Vec<u64>,
    ports: BTreeMap<P, PortStats>,
}

impl Delta {
    fn port(&self, p: P) -> PortStats {
        self.ports[&p]
    }

    fn tx_ports(&self) -> BTreeSet<P> {
        self.ports
            .iter()
            .filter(|(_, s)| s.tx_packets != 0)
            .map(|(p, _)| *p)
            .collect()
    }

    fn drop_total(&self) -> u64 {
        self.drops.iter().sum()
    }

    /// The one reason counted, if exactly one was.
    fn single_drop(&self) -> Option<u32> {
        let hit: Vec<usize> = (0..self.drops.len())
            .filter(|&i| self.drops[i] != 0)
            .collect();
        match (hit.as_slice(), self.drop_total()) {
            ([i], 1) => Some(*i as u32),
            _ => None,
        }
    }

    fn gw_replies(&self) -> u64 {
        self.ports.values().map(|s| s.gw_replies).sum()
    }
}

fn stats_delta(before: Option<PortStats>, after: Option<PortStats>) -> PortStats {
    let b = before.unwrap_or_default();
    let a = after.unwrap_or_default();
    PortStats {
        rx_packets: a.rx_packets - b.rx_packets,
        rx_bytes: a.rx_bytes - b.rx_bytes,
        tx_packets: a.tx_packets - b.tx_packets,
        tx_bytes: a.tx_bytes - b.tx_bytes,
        drops: a.drops - b.drops,
        gw_replies: a.gw_replies - b.gw_replies,
    }
}

/// The loaded data path in a private namespace, with every port programmed.
struct Fixture {
    // Field order matters: the data path closes before its pins go.
    dp: Dataplane,
    ifindex: BTreeMap<P, u32>,
    _root: BpffsRoot,
}

impl Fixture {
    /// Call inside `in_netns`.
    fn new() -> Self {
        let mut ifindex = BTreeMap::new();
        for p in ALL_PORTS {
            let host = p.name();
            let vm = format!("{host}-vm");
            ip(&["link", "add", host, "type", "veth", "peer", "name", &vm]);
            ip(&["link", "set", host, "up"]);
            ip(&["link", "set", &vm, "up"]);
            ifindex.insert(p, ifindex_of(host));
        }
        let root = BpffsRoot::new("fixture");
        let dp = Dataplane::open(&root.0).expect("loading the data path");
        let mut fx = Fixture {
            dp,
            ifindex,
            _root: root,
        };
        fx.program_maps();
        fx
    }

    fn ifx(&self, p: P) -> u32 {
        self.ifindex[&p]
    }

    fn port_info(&self, p: P, flags: u16) -> PortInfo {
        PortInfo {
            port_id: p as u32 + 1,
            network: p.net(),
            mac: p.mac(),
            flags,
            // As the agent plans it: the network's gateway MAC and the
            // port's first IPv4 address (E owns none).
            gw_mac: match p.net() {
                NET1 => GW1_MAC,
                NET2 => GW2_MAC,
                _ => [0; 6],
            },
            _pad: 0,
            ip4: if p == P::E { [0; 4] } else { p.ip4() },
            ip6: if p == P::E { [0; 16] } else { p.ip6() },
        }
    }

    fn program_maps(&mut self) {
        let nr_cpus = aya::util::nr_cpus().expect("nr_cpus");
        let infos: Vec<(P, u32, PortInfo)> = ALL_PORTS
            .iter()
            .filter(|p| p.programmed())
            .map(|&p| (p, self.ifx(p), self.port_info(p, FILTERS)))
            .collect();
        let mut flood1 = FloodList::default();
        for p in [P::A, P::B, P::C] {
            flood1.ifindex[flood1.count as usize] = self.ifx(p);
            flood1.port_id[flood1.count as usize] = p as u32 + 1;
            flood1.count += 1;
        }
        let mut flood2 = FloodList::default();
        flood2.ifindex[0] = self.ifx(P::D);
        flood2.port_id[0] = P::D as u32 + 1;
        flood2.count = 1;

        let maps = self.dp.maps_mut();
        maps.networks
            .insert(
                NET1,
                NetworkInfo {
                    gw_mac: GW1_MAC,
                    flags: NET_F_GW4 | NET_F_GW6,
                    gw_ip4: GW1_IP4,
                    mtu: 1500,
                    gw_ip6: GW1_IP6,
                    gw_ll6: GW1_LL6,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        maps.networks
            .insert(
                NET2,
                NetworkInfo {
                    gw_mac: GW2_MAC,
                    flags: 0,
                    gw_ip4: GW2_IP4,
                    mtu: 1500,
                    gw_ip6: GW2_IP6,
                    gw_ll6: link_local_from_mac(GW2_MAC),
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        maps.flood.insert(NET1, flood1, 0).unwrap();
        maps.flood.insert(NET2, flood2, 0).unwrap();
        // Remote VMs' addresses, as the overlay plan writes them.
        for (addr, mac) in [
            (IpAddr::V4(REMOTE_IP4.into()), REMOTE_MAC),
            (IpAddr::V6(REMOTE_IP6.into()), REMOTE_MAC),
            (IpAddr::V4(REMOTE_NO_MAC_IP4.into()), [0; 6]),
            (IpAddr::V6(REMOTE_NO_MAC_IP6.into()), [0; 6]),
        ] {
            let remote = AddrInfo {
                origin: ADDR_STATIC,
                mac,
                ..Default::default()
            };
            maps.addresses
                .insert(addr_key(NET1, addr), remote, 0)
                .unwrap();
        }
        for (p, ifx, info) in infos {
            maps.ports.insert(ifx, info, 0).unwrap();
            let zero = PerCpuValues::try_from(vec![PortStats::default(); nr_cpus]).unwrap();
            maps.port_stats.set(info.port_id, zero, 0).unwrap();
            if p == P::E {
                continue;
            }
            let key = EndpointKey {
                network: p.net(),
                mac: p.mac(),
                _pad: [0; 2],
            };
            let ep = Endpoint {
                kind: ENDPOINT_LOCAL,
                ifindex: ifx,
                port_id: info.port_id,
                ..Default::default()
            };
            maps.endpoints.insert(key, ep, 0).unwrap();
            let owner = AddrInfo {
                ifindex: ifx,
                origin: ADDR_STATIC,
                mac: p.mac(),
                _pad: [0; 2],
                port_id: info.port_id,
                node_ip4: [0; 4],
            };
            for addr in [
                IpAddr::V4(Ipv4Addr::from(p.ip4())),
                IpAddr::V6(Ipv6Addr::from(p.ip6())),
            ] {
                maps.addresses
                    .insert(addr_key(p.net(), addr), owner, 0)
                    .unwrap();
            }
        }
    }

    /// Gives a port the row's flags (X is no port and stays out of the map).
    fn set_flags(&mut self, p: P, flags: u16) {
        if !p.programmed() {
            return;
        }
        let (ifx, info) = (self.ifx(p), self.port_info(p, flags));
        self.dp.maps_mut().ports.insert(ifx, info, 0).unwrap();
    }

    /// One BPF_PROG_TEST_RUN of `vm_port` with `frame` arriving on `p`.
    fn run(&self, p: P, frame: &[u8]) -> Result<Run, ProgramError> {
        let ifx = self.ifx(p);
        let mut ctx = [0u8; SKB_CTX_LEN];
        ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
        ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifx.to_ne_bytes());
        let mut out = vec![0u8; 4096];
        let prog = self.dp.vm_port().expect("vm_port program");
        let r = prog.test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..Default::default()
        })?;
        out.truncate(r.data_size_out as usize);
        Ok(Run {
            verdict: r.return_value,
            out,
        })
    }

    fn counters(&self) -> Counters {
        let maps = self.dp.maps();
        Counters {
            drops: maps.drop_counts().unwrap(),
            ports: ALL_PORTS
                .iter()
                .map(|&p| (p, maps.port_stats(self.ifx(p)).unwrap()))
                .collect(),
        }
    }

    fn delta(before: &Counters, after: &Counters) -> Delta {
        Delta {
            drops: after
                .drops
                .iter()
                .zip(&before.drops)
                .map(|(a, b)| a - b)
                .collect(),
            ports: ALL_PORTS
                .iter()
                .map(|&p| (p, stats_delta(before.ports[&p], after.ports[&p])))
                .collect(),
        }
    }

    /// Runs `frame` on `p` and returns the result and the counter changes.
    fn run_counted(&self, p: P, frame: &[u8]) -> Result<(Run, Delta), ProgramError> {
        let before = self.counters();
        let run = self.run(p, frame)?;
        let after = self.counters();
        Ok((run, Self::delta(&before, &after)))
    }

    /// Runs one table row; `Err` says everything that differs.
    fn check(&mut self, case: &Case) -> Result<(), String> {
        self.set_flags(case.port, case.flags);
        let (run, d) = self
            .run_counted(case.port, &case.frame)
            .map_err(|e| format!("test_run failed: {e:?}"))?;
        let mut errs = Vec::new();
        let len = case.frame.len() as u64;

        // The ingress port counts what it received, whatever happens next.
        for p in ALL_PORTS {
            let s = d.port(p);
            let want = if p == case.port && p.programmed() {
                (1, len)
            } else {
                (0, 0)
            };
            if (s.rx_packets, s.rx_bytes) != want {
                errs.push(format!(
                    "{p:?} rx {}/{}B, want {}/{}B",
                    s.rx_packets, s.rx_bytes, want.0, want.1
                ));
            }
        }

        match &case.expect {
            Expect::Reply(want) => {
                if run.verdict != TC_ACT_REDIRECT {
                    errs.push(format!("verdict {}, want REDIRECT (7)", run.verdict));
                }
                if run.out != *want {
                    errs.push(format!("output differs:\n{}", hexdiff(&run.out, want)));
                }
                if let Err(e) = verify_checksums(&run.out) {
                    errs.push(format!("output checksum: {e}"));
                }
                if d.port(case.port).gw_replies != 1 || d.gw_replies() != 1 {
                    errs.push(format!("gw_replies not counted once on {:?}", case.port));
                }
                let leaked: BTreeSet<P> = d
                    .tx_ports()
                    .into_iter()
                    .filter(|p| *p != case.port)
                    .collect();
                if !leaked.is_empty() {
                    errs.push(format!("a gateway reply also counted tx on {leaked:?}"));
                }
                if d.drop_total() != 0 {
                    errs.push(format!("drop counters moved: {:?}", d.drops));
                }
            }
            Expect::Forward(to) => {
                if run.verdict != TC_ACT_REDIRECT {
                    errs.push(format!(
                        "verdict {}, want REDIRECT (7){}",
                        run.verdict,
                        reason_hint(&d)
                    ));
                }
                if run.out != case.frame {
                    errs.push(format!(
                        "forwarded frame was changed:\n{}",
                        hexdiff(&run.out, &case.frame)
                    ));
                }
                for p in ALL_PORTS {
                    let s = d.port(p);
                    let want = if to.contains(&p) { (1, len) } else { (0, 0) };
                    if (s.tx_packets, s.tx_bytes) != want {
                        errs.push(format!(
                            "{p:?} tx {}/{}B, want {}/{}B",
                            s.tx_packets, s.tx_bytes, want.0, want.1
                        ));
                    }
                }
                if d.gw_replies() != 0 {
                    errs.push("counted as a gateway reply".into());
                }
                if d.drop_total() != 0 {
                    errs.push(format!("drop counters moved: {:?}", d.drops));
                }
            }
            Expect::Dropped(reason) => {
                if run.verdict != TC_ACT_SHOT {
                    errs.push(format!("verdict {}, want SHOT (2)", run.verdict));
                }
                if d.single_drop() != Some(*reason) {
                    errs.push(format!(
                        "drops {:?}, want exactly one {}",
                        named_drops(&d),
                        drop_reason::NAMES[*reason as usize]
                    ));
                }
                let port_drops = u64::from(case.port.programmed());
                if d.port(case.port).drops != port_drops {
                    errs.push(format!(
                        "{:?} drops {}, want {port_drops}",
                        case.port,
                        d.port(case.port).drops
                    ));
                }
                if !d.tx_ports().is_empty() || d.gw_replies() != 0 {
                    errs.push(format!(
                        "dropped frame was also sent: tx on {:?}",
                        d.tx_ports()
                    ));
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("\n    "))
        }
    }
}

fn named_drops(d: &Delta) -> Vec<String> {
    (0..d.drops.len())
        .filter(|&i| d.drops[i] != 0)
        .map(|i| format!("{}x{}", drop_reason::NAMES[i], d.drops[i]))
        .collect()
}

fn reason_hint(d: &Delta) -> String {
    let named = named_drops(d);
    if named.is_empty() {
        String::new()
    } else {
        format!(" (dropped: {named:?})")
    }
}

/// Both frames in hex, 16 bytes a line, `*` marking lines that differ.
fn hexdiff(got: &[u8], want: &[u8]) -> String {
    let mut s = format!("      got {} bytes, want {} bytes\n", got.len(), want.len());
    for off in (0..got.len().max(want.len())).step_by(16) {
        let line = |b: &[u8]| {
            b.iter()
                .skip(off)
                .take(16)
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let (g, w) = (line(got), line(want));
        let mark = if g == w { ' ' } else { '*' };
        let _ = writeln!(s, "    {mark}{off:04x} got  {g}\n    {mark}     want {w}");
    }
    s
}

/// What a row expects.
enum Expect {
    /// Answered by the gateway in place: REDIRECT back out of the ingress
    /// port, rewritten into exactly this frame, counted in `gw_replies`.
    Reply(Vec<u8>),
    /// Switched unchanged: REDIRECT, counted as tx on exactly these ports.
    Forward(&'static [P]),
    /// SHOT, counted under exactly this reason.
    Dropped(u32),
}

/// One table row.
struct Case {
    name: &'static str,
    port: P,
    flags: u16,
    frame: Vec<u8>,
    expect: Expect,
}

fn case(name: &'static str, port: P, flags: u16, frame: Vec<u8>, expect: Expect) -> Case {
    Case {
        name,
        port,
        flags,
        frame,
        expect,
    }
}

/// Runs every row of a table on one fixture and reports all failing rows.
fn run_table(cases: Vec<Case>) {
    run_table_after(|_| {}, cases);
}

/// As [`run_table`], on a fixture `setup` changed first (other ports'
/// flags, say).
fn run_table_after(setup: impl FnOnce(&mut Fixture) + Send, cases: Vec<Case>) {
    assert!(!cases.is_empty());
    let names: BTreeSet<&str> = cases.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), cases.len(), "row names must be unique");
    for c in &cases {
        if let Expect::Reply(want) = &c.expect {
            // The expectation itself must be a well-formed frame.
            verify_checksums(want).unwrap_or_else(|e| panic!("{}: expected frame: {e}", c.name));
        }
    }
    in_fresh_netns(|| {
        let mut fx = Fixture::new();
        setup(&mut fx);
        let failures: Vec<String> = cases
            .iter()
            .filter_map(|c| fx.check(c).err().map(|e| format!("  {}:\n    {e}", c.name)))
            .collect();
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    });
}

/// `frame` with bytes overwritten at the given offsets.
fn patched(mut frame: Vec<u8>, patches: &[(usize, &[u8])]) -> Vec<u8> {
    for (off, bytes) in patches {
        frame[*off..*off + bytes.len()].copy_from_slice(bytes);
    }
    frame
}

fn truncated(mut frame: Vec<u8>, len: usize) -> Vec<u8> {
    assert!(len < frame.len());
    frame.truncate(len);
    frame
}

/// Zero-padded to `len` bytes (NICs pad short frames to 60).
fn padded(mut frame: Vec<u8>, len: usize) -> Vec<u8> {
    frame.resize(len, 0);
    frame
}

/// A recognisable payload.
fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}

// Offsets into frames.
const OFF_ARP: usize = 14;
const OFF_IP: usize = 14;
const OFF_L4_4: usize = 34;
const OFF_L4_6: usize = 54;

use Expect::{Dropped, Forward, Reply};

// ===========================================================================
// Tables
// ===========================================================================
//
// Rows: case(name, ingress port, ingress port flags, input frame, expected).
// The tables are laid out by hand (one row, a few lines), hence the
// rustfmt::skip on each.

use P::{A, B, C, D, E, X};

/// ARP: the gateway answers requests for its address; everything else is
/// switched; sender MAC and IP are checked.
#[test]
fn arp() {
    let reply_to = |p: P, tpa: Ip4| {
        frames::arp(
            GW1_MAC,
            p.mac(),
            ArpOperation::REPLY,
            GW1_MAC,
            GW1_IP4,
            p.mac(),
            tpa,
        )
    };
    let req = |eth_src: Mac, eth_dst: Mac, sha: Mac, spa: Ip4, tpa: Ip4| {
        frames::arp(
            eth_src,
            eth_dst,
            ArpOperation::REQUEST,
            sha,
            spa,
            [0; 6],
            tpa,
        )
    };
    let reply = |from: P, to: P| {
        frames::arp(
            from.mac(),
            to.mac(),
            ArpOperation::REPLY,
            from.mac(),
            from.ip4(),
            to.mac(),
            to.ip4(),
        )
    };
    let reply_naming_gw = frames::arp(
        A.mac(),
        BROADCAST,
        ArpOperation::REPLY,
        A.mac(),
        A.ip4(),
        [0; 6],
        GW1_IP4,
    );
    #[rustfmt::skip]
    let rows = vec![
        // Answered by the gateway.
        case("request for the gateway -> reply", A, FILTERS,
            arp_request(A.mac(), A.ip4(), GW1_IP4),
            Reply(reply_to(A, A.ip4()))),
        case("request for the gateway padded to 60 bytes -> reply, padding kept", A, FILTERS,
            padded(arp_request(A.mac(), A.ip4(), GW1_IP4), 60),
            Reply(padded(reply_to(A, A.ip4()), 60))),
        case("request for the gateway from the last port -> reply to it", C, FILTERS,
            arp_request(C.mac(), C.ip4(), GW1_IP4),
            Reply(reply_to(C, C.ip4()))),
        case("request for the gateway unicast to the gateway MAC -> reply", B, FILTERS,
            req(B.mac(), GW1_MAC, B.mac(), B.ip4(), GW1_IP4),
            Reply(reply_to(B, B.ip4()))),
        case("probe (spa 0.0.0.0) for the gateway address -> reply: in use", A, FILTERS,
            arp_request(A.mac(), [0; 4], GW1_IP4),
            Reply(reply_to(A, [0; 4]))),
        case("request for the gateway, foreign sender IP, IP filter off -> reply", A, NO_IP_FILTER,
            arp_request(A.mac(), FOREIGN_IP4, GW1_IP4),
            Reply(reply_to(A, FOREIGN_IP4))),
        // Switched.
        case("request for an unknown address -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), UNKNOWN_IP4),
            Forward(&[B, C])),
        case("request for another VM unicast to its MAC -> that port", A, FILTERS,
            req(A.mac(), B.mac(), A.mac(), A.ip4(), B.ip4()),
            Forward(&[B])),
        case("reply to another VM -> that port", B, FILTERS,
            reply(B, A),
            Forward(&[A])),
        case("gratuitous ARP for the VM's own address -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), A.ip4()),
            Forward(&[B, C])),
        case("reply (not a request) naming the gateway address -> switched", A, FILTERS,
            reply_naming_gw,
            Forward(&[B, C])),
        case("GARP for the gateway address, IP filter off -> ARP_SPOOF (only the gateway speaks for it)", C, NO_IP_FILTER,
            arp_request(C.mac(), GW1_IP4, GW1_IP4),
            Dropped(ARP_SPOOF)),
        case("request for the gateway of a network without IPv4 gateway -> nobody else", D, FILTERS,
            arp_request(D.mac(), D.ip4(), GW2_IP4),
            Dropped(NO_DESTINATION)),
        case("probe (spa 0.0.0.0) for another address -> flooded", A, FILTERS,
            arp_request(A.mac(), [0; 4], FOREIGN_IP4),
            Forward(&[B, C])),
        // Sender checks.
        case("sender MAC not the port's -> ARP_SPOOF", A, FILTERS,
            req(A.mac(), BROADCAST, FOREIGN_MAC, A.ip4(), B.ip4()),
            Dropped(ARP_SPOOF)),
        case("sender MAC of another VM, asking for the gateway -> ARP_SPOOF", A, FILTERS,
            req(A.mac(), BROADCAST, B.mac(), A.ip4(), GW1_IP4),
            Dropped(ARP_SPOOF)),
        case("sender MAC and Ethernet source foreign -> MAC_SPOOF", A, FILTERS,
            req(FOREIGN_MAC, BROADCAST, FOREIGN_MAC, A.ip4(), B.ip4()),
            Dropped(MAC_SPOOF)),
        case("sender IP foreign -> ARP_SPOOF", A, FILTERS,
            arp_request(A.mac(), FOREIGN_IP4, B.ip4()),
            Dropped(ARP_SPOOF)),
        case("sender IP of another VM -> ARP_SPOOF", A, FILTERS,
            arp_request(A.mac(), B.ip4(), C.ip4()),
            Dropped(ARP_SPOOF)),
        case("sender IP of a VM in another network -> ARP_SPOOF", A, FILTERS,
            arp_request(A.mac(), D.ip4(), B.ip4()),
            Dropped(ARP_SPOOF)),
        case("GARP for the gateway address with IP filter -> ARP_SPOOF", A, FILTERS,
            arp_request(A.mac(), GW1_IP4, GW1_IP4),
            Dropped(ARP_SPOOF)),
        case("sender IP foreign, IP filter off -> flooded", A, NO_IP_FILTER,
            arp_request(A.mac(), FOREIGN_IP4, UNKNOWN_IP4),
            Forward(&[B, C])),
        case("sender MAC foreign, MAC filter off -> flooded", A, NO_MAC_FILTER,
            req(FOREIGN_MAC, BROADCAST, FOREIGN_MAC, A.ip4(), UNKNOWN_IP4),
            Forward(&[B, C])),
        case("sender MAC foreign, port MAC not known yet -> flooded", A, MAC_UNKNOWN,
            req(FOREIGN_MAC, BROADCAST, FOREIGN_MAC, A.ip4(), UNKNOWN_IP4),
            Forward(&[B, C])),
    ];
    run_table(rows);
}

/// ICMPv4 echo requests to the gateway address are answered in place.
#[test]
fn icmp4_gateway_echo() {
    let data = payload(56);
    let fragment = |src: Ip4, dst: Ip4, more: bool, offset: u16| {
        let mut h = ipv4_hdr(src, dst, 64);
        h.dont_fragment = false;
        h.more_fragments = more;
        h.fragment_offset = etherparse::IpFragOffset::try_new(offset).unwrap();
        h
    };
    let big = payload(1401);
    let to_gw = |src: Ip4, dst: Ip4, ttl: u8, t: Icmpv4Type, data: &[u8]| {
        icmp4(A.mac(), GW1_MAC, ipv4_hdr(src, dst, ttl), t, data)
    };
    let request = |ttl: u8, id: u16, seq: u16, data: &[u8]| {
        to_gw(A.ip4(), GW1_IP4, ttl, echo4_request(id, seq), data)
    };
    // Same IP id and flags; addresses swapped, TTL 64.
    let reply = |id: u16, seq: u16, data: &[u8]| {
        icmp4(
            GW1_MAC,
            A.mac(),
            ipv4_hdr(GW1_IP4, A.ip4(), 64),
            echo4_reply(id, seq),
            data,
        )
    };
    let with_options = |src: Ip4, dst: Ip4, ttl: u8| {
        let mut h = ipv4_hdr(src, dst, ttl);
        h.options = [1, 1, 1, 0].into(); // NOP NOP NOP EOL: ihl 6
        h
    };
    #[rustfmt::skip]
    let rows = vec![
        case("echo request -> reply: swapped addresses, TTL 64, same id/seq/payload", A, FILTERS,
            request(17, 0x1234, 7, &data),
            Reply(reply(0x1234, 7, &data))),
        case("echo request with TTL 1 -> reply with TTL 64", A, FILTERS,
            request(1, 0xbeef, 0xffff, &data),
            Reply(reply(0xbeef, 0xffff, &data))),
        case("echo request with TTL 64 (no TTL change) -> reply", A, FILTERS,
            request(64, 1, 1, &data),
            Reply(reply(1, 1, &data))),
        case("echo request without payload -> reply", A, FILTERS,
            request(255, 2, 2, &[]),
            Reply(reply(2, 2, &[]))),
        case("echo request with a large odd payload -> reply", A, FILTERS,
            request(128, 0x0101, 0x8000, &big),
            Reply(reply(0x0101, 0x8000, &big))),
        case("echo request with IPv4 options (ihl 6) -> reply keeps them", A, FILTERS,
            icmp4(A.mac(), GW1_MAC, with_options(A.ip4(), GW1_IP4, 9), echo4_request(5, 6), &data),
            Reply(icmp4(GW1_MAC, A.mac(), with_options(GW1_IP4, A.ip4(), 64), echo4_reply(5, 6), &data))),
        case("echo request with code 1 -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip4(), GW1_IP4, 64, icmp4_raw(8, 1, [0, 1, 0, 1]), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("first fragment of an echo request (MF) -> not answered: GATEWAY_UNROUTED", A, FILTERS,
            icmp4(A.mac(), GW1_MAC, fragment(A.ip4(), GW1_IP4, true, 0), echo4_request(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("later fragment whose data looks like an echo request -> GATEWAY_UNROUTED", A, FILTERS,
            icmp4(A.mac(), GW1_MAC, fragment(A.ip4(), GW1_IP4, false, 185), echo4_request(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("timestamp request to the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip4(), GW1_IP4, 64, icmp4_raw(13, 0, [0, 1, 0, 1]), &[0; 12]),
            Dropped(GATEWAY_UNROUTED)),
        case("echo reply to the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip4(), GW1_IP4, 64, echo4_reply(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo request via the gateway MAC to 8.8.8.8 -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip4(), [8, 8, 8, 8], 64, echo4_request(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo request to a gateway without IPv4 -> GATEWAY_UNROUTED", D, FILTERS,
            icmp4(D.mac(), GW2_MAC, ipv4_hdr(D.ip4(), GW2_IP4, 64), echo4_request(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo request to the gateway address but another VM's MAC -> switched", A, FILTERS,
            icmp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), GW1_IP4, 64), echo4_request(1, 1), &data),
            Forward(&[B])),
        case("echo request to another VM -> switched", A, FILTERS,
            icmp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), B.ip4(), 64), echo4_request(1, 1), &data),
            Forward(&[B])),
        case("echo request to the gateway from a foreign source -> IP_SPOOF", A, FILTERS,
            to_gw(FOREIGN_IP4, GW1_IP4, 64, echo4_request(1, 1), &data),
            Dropped(IP_SPOOF)),
        case("echo request cut inside the ICMP header -> MALFORMED", A, FILTERS,
            truncated(request(64, 1, 1, &data), OFF_L4_4 + 4),
            Dropped(MALFORMED)),
    ];
    run_table(rows);
}

/// ICMPv6 echo requests to the gateway's global and link-local addresses.
#[test]
fn icmp6_gateway_echo() {
    let data = payload(56);
    let big = payload(1391);
    let to_gw = |src: Ip6, dst: Ip6, hop: u8, t: Icmpv6Type, data: &[u8]| {
        icmp6(A.mac(), GW1_MAC, src, dst, hop, t, data)
    };
    let request = |src: Ip6, dst: Ip6, hop: u8, data: &[u8]| {
        to_gw(src, dst, hop, echo6_request(0x4321, 9), data)
    };
    let reply = |src: Ip6, dst: Ip6, data: &[u8]| {
        icmp6(GW1_MAC, A.mac(), src, dst, 64, echo6_reply(0x4321, 9), data)
    };
    #[rustfmt::skip]
    let rows = vec![
        case("echo request to the gateway address but another VM's MAC -> switched", A, FILTERS,
            icmp6(A.mac(), B.mac(), A.ip6(), GW1_IP6, 64, echo6_request(0x4321, 9), &payload(8)),
            Forward(&[B])),
        case("echo request to the gateway -> reply, hop limit 64", A, FILTERS,
            request(A.ip6(), GW1_IP6, 33, &data),
            Reply(reply(GW1_IP6, A.ip6(), &data))),
        case("echo request to the gateway link-local from link-local -> reply", A, FILTERS,
            request(A.ll6(), GW1_LL6, 255, &data),
            Reply(reply(GW1_LL6, A.ll6(), &data))),
        case("echo request to the gateway link-local from the global address -> reply", A, FILTERS,
            request(A.ip6(), GW1_LL6, 1, &data),
            Reply(reply(GW1_LL6, A.ip6(), &data))),
        case("echo request without payload -> reply", A, FILTERS,
            request(A.ip6(), GW1_IP6, 64, &[]),
            Reply(reply(GW1_IP6, A.ip6(), &[]))),
        case("echo request with a large odd payload -> reply", A, FILTERS,
            request(A.ip6(), GW1_IP6, 64, &big),
            Reply(reply(GW1_IP6, A.ip6(), &big))),
        case("echo request with code 1 -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip6(), GW1_IP6, 64, icmp6_raw(128, 1, [0, 1, 0, 1]), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo reply to the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            to_gw(A.ip6(), GW1_IP6, 64, echo6_reply(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo request to a gateway without IPv6 -> GATEWAY_UNROUTED", D, FILTERS,
            icmp6(D.mac(), GW2_MAC, D.ip6(), GW2_IP6, 64, echo6_request(1, 1), &data),
            Dropped(GATEWAY_UNROUTED)),
        case("echo request to another VM -> switched", A, FILTERS,
            icmp6(A.mac(), B.mac(), A.ip6(), B.ip6(), 64, echo6_request(1, 1), &data),
            Forward(&[B])),
        case("echo request to the gateway from a foreign source -> IP_SPOOF", A, FILTERS,
            request(FOREIGN_IP6, GW1_IP6, 64, &data),
            Dropped(IP_SPOOF)),
        case("ICMPv6 with a 3-byte message -> MALFORMED", A, FILTERS,
            truncated(request(A.ip6(), GW1_IP6, 64, &data), OFF_L4_6 + 3),
            Dropped(MALFORMED)),
    ];
    run_table(rows);
}

/// Neighbour solicitations for the gateway are answered with an 86-byte NA.
const ALL_NODES: Ip6 = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const ALL_NODES_MAC: Mac = [0x33, 0x33, 0, 0, 0, 1];

#[test]
fn nd_gateway() {
    let sn_gw = solicited_node(GW1_IP6);
    let sn_mac = multicast_mac6(sn_gw);
    let sn_ll = solicited_node(GW1_LL6);
    let sn_b = solicited_node(B.ip6());
    let sn_a = solicited_node(A.ip6());
    let sn_gw2 = solicited_node(GW2_IP6);
    let slla = lla_option(1, A.mac());
    let nonce = [14, 1, 1, 2, 3, 4, 5, 6];
    let slla_nonce = [slla, nonce].concat();
    let mut long_options = slla.to_vec();
    long_options.extend_from_slice(&[0xfe, 12]);
    long_options.resize(8 + 96, 0x5a);
    let ns_code1 = icmp6(
        A.mac(),
        sn_mac,
        A.ip6(),
        sn_gw,
        255,
        icmp6_raw(135, 1, [0; 4]),
        &[GW1_IP6.as_slice(), &slla].concat(),
    );
    // What every answered NS must turn into: exactly 86 bytes.
    let na = |target: Ip6, dst: Ip6| {
        let f = na_rso(GW1_MAC, A.mac(), target, dst, GW1_MAC);
        assert_eq!(f.len(), 86, "an NA with one option is 86 bytes");
        f
    };
    #[rustfmt::skip]
    let rows = vec![
        case("a VM's router advertisement -> ND_SPOOF", A, FILTERS,
            icmp6(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, 255, icmp6_raw(134, 0, [64, 0x80, 7, 8]), &[0; 8]),
            Dropped(ND_SPOOF)),
        case("a VM's router advertisement with the IP filter off, vmpath the gateway -> ND_SPOOF", A, NO_FILTERS,
            icmp6(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, 255, icmp6_raw(134, 0, [64, 0x80, 7, 8]), &[0; 8]),
            Dropped(ND_SPOOF)),
        case("a VM's redirect -> ND_SPOOF", A, FILTERS,
            icmp6(A.mac(), B.mac(), A.ll6(), B.ip6(), 255, icmp6_raw(137, 0, [0; 4]), &[0; 32]),
            Dropped(ND_SPOOF)),
        case("a VM's unsolicited NA for the gateway address -> ND_SPOOF", A, FILTERS,
            icmp6(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, 255, icmp6_raw(136, 0, [0x20, 0, 0, 0]),
                &[GW1_IP6.as_slice(), lla_option(2, A.mac()).as_slice()].concat()),
            Dropped(ND_SPOOF)),
        case("a VM's NA for its own address -> flooded", A, FILTERS,
            na_rso(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.mac()),
            Forward(&[B, C])),
        case("NS for the gateway with SLLA (86 bytes) -> NA (R,S,O, TLLA) to the VM", A, FILTERS,
            ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &slla),
            Reply(na(GW1_IP6, A.ip6()))),
        case("NS for the gateway from link-local -> NA to link-local", A, FILTERS,
            ns(A.mac(), sn_mac, A.ll6(), sn_gw, 255, GW1_IP6, &slla),
            Reply(na(GW1_IP6, A.ll6()))),
        case("NS for the gateway link-local -> NA from the link-local", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn_ll), A.ll6(), sn_ll, 255, GW1_LL6, &slla),
            Reply(na(GW1_LL6, A.ll6()))),
        case("NS for the gateway without options (unicast NUD, 78 bytes) -> 86-byte NA", A, FILTERS,
            ns(A.mac(), GW1_MAC, A.ip6(), GW1_IP6, 255, GW1_IP6, &[]),
            Reply(na(GW1_IP6, A.ip6()))),
        case("NS for the gateway with SLLA and nonce (94 bytes) -> 86-byte NA", A, FILTERS,
            ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &slla_nonce),
            Reply(na(GW1_IP6, A.ip6()))),
        case("NS for the gateway with 104 bytes of options -> 86-byte NA", A, FILTERS,
            ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &long_options),
            Reply(na(GW1_IP6, A.ip6()))),
        case("NS for the gateway with trailing bytes after the IPv6 payload -> 86-byte NA", A, FILTERS,
            padded(ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &[]), 100),
            Reply(na(GW1_IP6, A.ip6()))),
        case("NS for the gateway with hop limit 64 -> MALFORMED", A, FILTERS,
            ns(A.mac(), sn_mac, A.ip6(), sn_gw, 64, GW1_IP6, &slla),
            Dropped(MALFORMED)),
        case("NS for another VM with hop limit 254 -> MALFORMED", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn_b), A.ip6(), sn_b, 254, B.ip6(), &slla),
            Dropped(MALFORMED)),
        case("NS for the gateway with code 1 -> MALFORMED", A, FILTERS,
            ns_code1,
            Dropped(MALFORMED)),
        case("NS for an unknown address -> flooded unchanged", A, FILTERS,
            ns(A.mac(), multicast_mac6(solicited_node(UNKNOWN_IP6)), A.ip6(), solicited_node(UNKNOWN_IP6), 255, UNKNOWN_IP6, &slla),
            Forward(&[B, C])),
        case("NS for another VM unicast -> that port", A, FILTERS,
            ns(A.mac(), B.mac(), A.ip6(), B.ip6(), 255, B.ip6(), &slla),
            Forward(&[B])),
        case("DAD NS from :: for the VM's own address -> flooded", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn_a), UNSPEC6, sn_a, 255, A.ip6(), &[]),
            Forward(&[B, C])),
        case("DAD NS from :: for the gateway address -> flooded, not answered", A, FILTERS,
            ns(A.mac(), sn_mac, UNSPEC6, sn_gw, 255, GW1_IP6, &[]),
            Forward(&[B, C])),
        case("NS for the gateway of a network without IPv6 -> nobody else", D, FILTERS,
            ns(D.mac(), multicast_mac6(sn_gw2), D.ll6(), sn_gw2, 255, GW2_IP6, &lla_option(1, D.mac())),
            Dropped(NO_DESTINATION)),
        case("NS for the gateway from a foreign source -> IP_SPOOF", A, FILTERS,
            ns(A.mac(), sn_mac, FOREIGN_IP6, sn_gw, 255, GW1_IP6, &slla),
            Dropped(IP_SPOOF)),
        case("NS cut inside the target -> MALFORMED", A, FILTERS,
            truncated(ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &slla), OFF_L4_6 + 8 + 10),
            Dropped(MALFORMED)),
        case("NS with only the ICMPv6 header -> MALFORMED", A, FILTERS,
            truncated(ns(A.mac(), sn_mac, A.ip6(), sn_gw, 255, GW1_IP6, &slla), OFF_L4_6 + 4),
            Dropped(MALFORMED)),
    ];
    run_table(rows);
}

/// ARP requests and neighbour solicitations a VM broadcasts for a known
/// endpoint, local or remote, are answered at its port with the owner's
/// MAC (`vm_neigh`); an address nobody holds, one whose owner's MAC is not
/// known here, and the asker's own are flooded as before.
#[test]
fn neighbour_answers() {
    let arp_reply = |owner: Mac, ip: Ip4, to: P| {
        frames::arp(
            owner,
            to.mac(),
            ArpOperation::REPLY,
            owner,
            ip,
            to.mac(),
            to.ip4(),
        )
    };
    let sn = |t: Ip6| solicited_node(t);
    let ns_for = |from: P, target: Ip6| {
        ns(
            from.mac(),
            multicast_mac6(sn(target)),
            from.ip6(),
            sn(target),
            255,
            target,
            &lla_option(1, from.mac()),
        )
    };
    // The owner's solicited NA (S, O; not R: a VM is no router), 86 bytes.
    let na_from = |owner: Mac, target: Ip6, to: P| {
        na(
            owner,
            to.mac(),
            target,
            to.ip6(),
            target,
            NA_SO,
            &lla_option(2, owner),
        )
    };
    #[rustfmt::skip]
    let rows = vec![
        // ARP.
        case("ARP request for a local VM -> answered with its MAC", A, FILTERS,
            arp_request(A.mac(), A.ip4(), B.ip4()),
            Reply(arp_reply(B.mac(), B.ip4(), A))),
        case("ARP request for a remote VM -> answered with its MAC", C, FILTERS,
            arp_request(C.mac(), C.ip4(), REMOTE_IP4),
            Reply(arp_reply(REMOTE_MAC, REMOTE_IP4, C))),
        case("ARP request padded to 60 bytes -> answered, padding kept", A, FILTERS,
            padded(arp_request(A.mac(), A.ip4(), REMOTE_IP4), 60),
            Reply(padded(arp_reply(REMOTE_MAC, REMOTE_IP4, A), 60))),
        case("ARP request for a remote VM whose MAC is not known here -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), REMOTE_NO_MAC_IP4),
            Forward(&[B, C])),
        case("ARP request for an unknown address -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), UNKNOWN_IP4),
            Forward(&[B, C])),
        case("ARP request for an address of another network -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), D.ip4()),
            Forward(&[B, C])),
        case("ARP request unicast to the owner's MAC (its own check) -> that port", A, FILTERS,
            frames::arp(A.mac(), B.mac(), ArpOperation::REQUEST, A.mac(), A.ip4(), [0; 6], B.ip4()),
            Forward(&[B])),
        case("ARP probe (spa 0.0.0.0) for a VM's address -> answered: in use", A, FILTERS,
            arp_request(A.mac(), [0; 4], B.ip4()),
            Reply(frames::arp(B.mac(), A.mac(), ArpOperation::REPLY, B.mac(), B.ip4(), A.mac(), [0; 4]))),
        case("ARP probe for its own address -> flooded, not answered", A, FILTERS,
            arp_request(A.mac(), [0; 4], A.ip4()),
            Forward(&[B, C])),
        case("gratuitous ARP -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), A.ip4()),
            Forward(&[B, C])),
        case("ARP request, IP filter off -> answered all the same", A, NO_FILTERS,
            arp_request(A.mac(), A.ip4(), REMOTE_IP4),
            Reply(arp_reply(REMOTE_MAC, REMOTE_IP4, A))),
        // Neighbour discovery.
        case("NS for a local VM -> its NA (S, O, TLLA)", A, FILTERS,
            ns_for(A, B.ip6()),
            Reply(na_from(B.mac(), B.ip6(), A))),
        case("NS for a remote VM -> its NA", B, FILTERS,
            ns_for(B, REMOTE_IP6),
            Reply(na_from(REMOTE_MAC, REMOTE_IP6, B))),
        case("NS from link-local for a remote VM -> NA to the link-local", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn(REMOTE_IP6)), A.ll6(), sn(REMOTE_IP6), 255, REMOTE_IP6, &lla_option(1, A.mac())),
            Reply(na(REMOTE_MAC, A.mac(), REMOTE_IP6, A.ll6(), REMOTE_IP6, NA_SO, &lla_option(2, REMOTE_MAC)))),
        case("NS with nonce (94 bytes) for a remote VM -> 86-byte NA", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn(REMOTE_IP6)), A.ip6(), sn(REMOTE_IP6), 255, REMOTE_IP6,
                &[lla_option(1, A.mac()), [14, 1, 1, 2, 3, 4, 5, 6]].concat()),
            Reply(na_from(REMOTE_MAC, REMOTE_IP6, A))),
        case("NS for a remote VM whose MAC is not known here -> flooded", A, FILTERS,
            ns_for(A, REMOTE_NO_MAC_IP6),
            Forward(&[B, C])),
        case("NS for an unknown address -> flooded", A, FILTERS,
            ns_for(A, UNKNOWN_IP6),
            Forward(&[B, C])),
        case("NS unicast to the owner's MAC (NUD) -> that port", A, FILTERS,
            ns(A.mac(), B.mac(), A.ip6(), B.ip6(), 255, B.ip6(), &lla_option(1, A.mac())),
            Forward(&[B])),
        case("DAD NS from :: for a VM's address -> flooded (its owner defends it)", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn(B.ip6())), UNSPEC6, sn(B.ip6()), 255, B.ip6(), &[]),
            Forward(&[B, C])),
        case("NS for a remote VM with hop limit 254 -> MALFORMED", A, FILTERS,
            ns(A.mac(), multicast_mac6(sn(REMOTE_IP6)), A.ip6(), sn(REMOTE_IP6), 254, REMOTE_IP6, &[]),
            Dropped(MALFORMED)),
        case("NS for an address of another network -> flooded", A, FILTERS,
            ns_for(A, D.ip6()),
            Forward(&[B, C])),
        // A guest's claim the agent has not accepted (only in
        // `vmp_learned_ips`): its owner answers, never the data path.
        case("ARP request for an address B uses, not accepted -> flooded", A, FILTERS,
            arp_request(A.mac(), A.ip4(), LEARNED_IP4),
            Forward(&[B, C])),
        case("NS for an address B uses, not accepted -> flooded", A, FILTERS,
            ns_for(A, LEARNED_IP6),
            Forward(&[B, C])),
    ];
    // B was seen using LEARNED_IP4/6: the learned-address stage has not
    // decided them (they are not in `vmp_addresses`).
    run_table_after(
        |fx| {
            let b = fx.ifx(B);
            for addr in [
                IpAddr::V4(LEARNED_IP4.into()),
                IpAddr::V6(LEARNED_IP6.into()),
            ] {
                let seen = LearnedIp {
                    ifindex: b,
                    mac: B.mac(),
                    ..Default::default()
                };
                fx.dp
                    .maps_mut()
                    .learned_ips
                    .insert(addr_key(NET1, addr), seen, 0)
                    .unwrap();
            }
        },
        rows,
    );
}

/// A neighbour advertisement for `target` with the given R/S/O flags byte
/// and options.
fn na(smac: Mac, dmac: Mac, src: Ip6, dst: Ip6, target: Ip6, flags: u8, options: &[u8]) -> Vec<u8> {
    icmp6(
        smac,
        dmac,
        src,
        dst,
        255,
        icmp6_raw(136, 0, [flags, 0, 0, 0]),
        &[target.as_slice(), options].concat(),
    )
}

/// Solicited, Override.
const NA_SO: u8 = 0x60;
const NA_S: u8 = 0x40;
const NA_O: u8 = 0x20;

/// Neighbour discovery spoofing: a VM's NA may only advertise its own
/// addresses with its own MAC, its NS only name its own MAC; DAD probes
/// pass, answering another's DAD does not.
#[test]
fn nd_spoofing() {
    let own_tlla = lla_option(2, A.mac());
    let forged_tlla = lla_option(2, B.mac());
    let own_slla = lla_option(1, A.mac());
    let forged_slla = lla_option(1, FOREIGN_MAC);
    let nonce = [14, 1, 1, 2, 3, 4, 5, 6];
    let sn_b = solicited_node(B.ip6());
    let sn_b_mac = multicast_mac6(sn_b);
    let hbh_na = icmp6_with(
        A.mac(),
        ALL_NODES_MAC,
        v6_router_alert(A.ll6(), ALL_NODES, 255),
        icmp6_raw(136, 0, [NA_O, 0, 0, 0]),
        &[B.ip6().as_slice(), &own_tlla].concat(),
    );
    let hbh_ra = icmp6_with(
        A.mac(),
        ALL_NODES_MAC,
        v6_router_alert(A.ll6(), ALL_NODES, 255),
        icmp6_raw(134, 0, [64, 0x80, 7, 8]),
        &[0; 8],
    );
    let many_options: Vec<u8> = [nonce; 6].concat().into_iter().chain(forged_tlla).collect();
    #[rustfmt::skip]
    let rows = vec![
        // Target: own, other, gateway.
        case("NA for its own address, override set, own TLLA -> flooded", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &own_tlla),
            Forward(&[B, C])),
        case("NA for its own address, override unset -> flooded", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), 0, &own_tlla),
            Forward(&[B, C])),
        case("solicited NA for its own address without TLLA -> that port", A, FILTERS,
            na(A.mac(), B.mac(), A.ip6(), B.ip6(), A.ip6(), NA_S, &[]),
            Forward(&[B])),
        case("NA for its MAC's link-local -> flooded", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, A.ll6(), NA_O, &own_tlla),
            Forward(&[B, C])),
        case("NA for another VM's address, override set -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, B.ip6(), NA_O, &own_tlla),
            Dropped(ND_SPOOF_TARGET)),
        case("NA for another VM's address, override unset -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), C.mac(), A.ip6(), C.ip6(), B.ip6(), NA_S, &own_tlla),
            Dropped(ND_SPOOF_TARGET)),
        case("NA for another VM's address without TLLA -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, B.ip6(), NA_SO, &[]),
            Dropped(ND_SPOOF_TARGET)),
        case("NA for another VM's link-local -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, B.ll6(), NA_O, &own_tlla),
            Dropped(ND_SPOOF_TARGET)),
        case("NA for an address nobody has -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, FOREIGN_IP6, NA_O, &own_tlla),
            Dropped(ND_SPOOF_TARGET)),
        case("NA answering another VM's DAD (to all-nodes, unsolicited) -> ND_SPOOF_TARGET", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, B.ip6(), NA_O, &own_tlla),
            Dropped(ND_SPOOF_TARGET)),
        case("NA for the gateway link-local -> ND_SPOOF", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, GW1_LL6, NA_O, &own_tlla),
            Dropped(ND_SPOOF)),
        case("NA for the gateway address with the IP filter off -> ND_SPOOF", A, NO_FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, GW1_IP6, NA_O, &own_tlla),
            Dropped(ND_SPOOF)),
        case("NA for another VM's address behind a hop-by-hop header -> ND_SPOOF_TARGET", A, FILTERS,
            hbh_na,
            Dropped(ND_SPOOF_TARGET)),
        case("RA behind a hop-by-hop header -> ND_SPOOF", A, FILTERS,
            hbh_ra,
            Dropped(ND_SPOOF)),
        // TLLA: own, forged.
        case("NA for its own address with a forged TLLA -> ND_SPOOF_LLADDR", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &forged_tlla),
            Dropped(ND_SPOOF_LLADDR)),
        case("NA with its own TLLA, then a forged one -> ND_SPOOF_LLADDR", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &[own_tlla, forged_tlla].concat()),
            Dropped(ND_SPOOF_LLADDR)),
        case("NA with a forged TLLA behind six other options -> ND_SPOOF_LLADDR", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &many_options),
            Dropped(ND_SPOOF_LLADDR)),
        case("NA with a zero-length option -> MALFORMED", A, FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &[2, 0, 0, 0, 0, 0, 0, 0]),
            Dropped(MALFORMED)),
        // SLLAO: own, forged; DAD.
        case("NS for an unknown address with its own SLLA -> flooded", A, FILTERS,
            ns(A.mac(), sn_b_mac, A.ip6(), sn_b, 255, UNKNOWN_IP6, &own_slla),
            Forward(&[B, C])),
        case("NS for an unknown address without SLLA -> flooded", A, FILTERS,
            ns(A.mac(), sn_b_mac, A.ip6(), sn_b, 255, UNKNOWN_IP6, &[]),
            Forward(&[B, C])),
        case("NS for another VM with a forged SLLA -> ND_SPOOF_LLADDR", A, FILTERS,
            ns(A.mac(), sn_b_mac, A.ip6(), sn_b, 255, B.ip6(), &forged_slla),
            Dropped(ND_SPOOF_LLADDR)),
        case("NS with another VM's MAC as SLLA -> ND_SPOOF_LLADDR", A, FILTERS,
            ns(A.mac(), sn_b_mac, A.ip6(), sn_b, 255, B.ip6(), &lla_option(1, C.mac())),
            Dropped(ND_SPOOF_LLADDR)),
        case("NS for the gateway with a forged SLLA -> ND_SPOOF_LLADDR, not answered", A, FILTERS,
            ns(A.mac(), multicast_mac6(solicited_node(GW1_IP6)), A.ip6(), solicited_node(GW1_IP6), 255, GW1_IP6, &forged_slla),
            Dropped(ND_SPOOF_LLADDR)),
        case("DAD probe from :: for another VM's address -> flooded", A, FILTERS,
            ns(A.mac(), sn_b_mac, UNSPEC6, sn_b, 255, B.ip6(), &[]),
            Forward(&[B, C])),
        case("DAD probe from :: with a nonce -> flooded", A, FILTERS,
            ns(A.mac(), multicast_mac6(solicited_node(A.ip6())), UNSPEC6, solicited_node(A.ip6()), 255, A.ip6(), &nonce),
            Forward(&[B, C])),
        case("DAD probe from :: with a forged SLLA -> ND_SPOOF_LLADDR", A, FILTERS,
            ns(A.mac(), sn_b_mac, UNSPEC6, sn_b, 255, B.ip6(), &forged_slla),
            Dropped(ND_SPOOF_LLADDR)),
        // No IP filter (IPAM-less default): neighbour discovery is the VMs' own.
        case("IP filter off: NA for another VM's address -> flooded", A, NO_FILTERS,
            na(A.mac(), ALL_NODES_MAC, A.ll6(), ALL_NODES, B.ip6(), NA_O, &forged_tlla),
            Forward(&[B, C])),
        case("IP filter off: NS with a forged SLLA -> flooded", A, NO_FILTERS,
            ns(A.mac(), sn_b_mac, A.ip6(), sn_b, 255, UNKNOWN_IP6, &forged_slla),
            Forward(&[B, C])),
        // MAC not known yet: held to the frame's source MAC.
        case("MAC unknown: NA for its own address with the source MAC as TLLA -> flooded", A, MAC_UNKNOWN,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &own_tlla),
            Forward(&[B, C])),
        case("MAC unknown: NA with another MAC as TLLA -> ND_SPOOF_LLADDR", A, MAC_UNKNOWN,
            na(A.mac(), ALL_NODES_MAC, A.ip6(), ALL_NODES, A.ip6(), NA_O, &forged_tlla),
            Dropped(ND_SPOOF_LLADDR)),
    ];
    run_table(rows);
}

/// Rogue services: a VM's DHCP server traffic where the guard is on, and
/// router advertisements, redirects and gateway ARP/NA where vmpath is the
/// gateway, filter or not.
#[test]
fn rogue_services() {
    const GUARD: u16 = FILTERS | PORT_F_DHCP_GUARD;
    let offer =
        |dmac: Mac, dst: Ip4| udp4(A.mac(), dmac, ipv4_hdr(A.ip4(), dst, 64), 67, 68, &bootp(2));
    let dhcp6 = |msg: u8| {
        udp6(
            A.mac(),
            B.mac(),
            A.ll6(),
            B.ll6(),
            255,
            547,
            546,
            &[msg, 1, 2, 3],
        )
    };
    let hbh_dhcp6 = udp6_with(
        A.mac(),
        B.mac(),
        v6_router_alert(A.ll6(), B.ll6(), 255),
        547,
        546,
    );
    let redirect4 = || {
        icmp4(
            A.mac(),
            B.mac(),
            ipv4_hdr(A.ip4(), B.ip4(), 64),
            icmp4_raw(5, 1, GW1_IP4),
            &[0; 28],
        )
    };
    #[rustfmt::skip]
    let rows = vec![
        case("DHCPOFFER/ACK (BOOTREPLY 67 -> 68) broadcast, guard on -> DHCP_SPOOF", A, GUARD,
            offer(BROADCAST, [255; 4]),
            Dropped(DHCP_SPOOF)),
        case("BOOTREPLY 67 -> 68 unicast to a VM, guard on -> DHCP_SPOOF", A, GUARD,
            offer(B.mac(), B.ip4()),
            Dropped(DHCP_SPOOF)),
        case("BOOTREPLY 67 -> 68, guard off (IPAM-less default) -> flooded", A, FILTERS,
            offer(BROADCAST, [255; 4]),
            Forward(&[B, C])),
        case("DHCP client request 68 -> 67, guard on -> flooded", A, NO_FILTERS | PORT_F_DHCP_GUARD,
            udp4(A.mac(), BROADCAST, ipv4_hdr([0; 4], [255; 4], 64), 68, 67, &bootp(1)),
            Forward(&[B, C])),
        case("relay-to-server 67 -> 67, guard on -> switched", A, GUARD,
            udp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), B.ip4(), 64), 67, 67, &bootp(1)),
            Forward(&[B])),
        case("DHCPv6 ADVERTISE 547 -> 546, guard on -> DHCP_SPOOF", A, GUARD,
            dhcp6(2),
            Dropped(DHCP_SPOOF)),
        case("DHCPv6 REPLY 547 -> 546, guard on -> DHCP_SPOOF", A, GUARD,
            dhcp6(7),
            Dropped(DHCP_SPOOF)),
        case("DHCPv6 RECONFIGURE 547 -> 546, guard on -> DHCP_SPOOF", A, GUARD,
            dhcp6(10),
            Dropped(DHCP_SPOOF)),
        case("DHCPv6 server traffic behind a hop-by-hop header, guard on -> DHCP_SPOOF", A, GUARD,
            hbh_dhcp6,
            Dropped(DHCP_SPOOF)),
        case("DHCPv6 REPLY 547 -> 546, guard off -> switched", A, FILTERS,
            dhcp6(7),
            Forward(&[B])),
        case("ICMPv4 redirect, IP filter on -> ICMP_REDIRECT", A, FILTERS,
            redirect4(),
            Dropped(ICMP_REDIRECT)),
        case("ICMPv4 redirect, IP filter off, vmpath the gateway -> ICMP_REDIRECT", A, NO_FILTERS,
            redirect4(),
            Dropped(ICMP_REDIRECT)),
        case("ICMPv4 echo to another VM (control) -> switched", A, FILTERS,
            icmp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), B.ip4(), 64), echo4_request(1, 1), &[0; 8]),
            Forward(&[B])),
        case("ICMPv6 redirect, IP filter off, vmpath the gateway -> ND_SPOOF", A, NO_FILTERS,
            icmp6(A.mac(), B.mac(), A.ll6(), B.ip6(), 255, icmp6_raw(137, 0, [0; 4]), &[0; 32]),
            Dropped(ND_SPOOF)),
        case("RA on a network without a vmpath IPv6 gateway, filter off -> not ND_SPOOF (D is alone)", D, NO_FILTERS,
            icmp6(D.mac(), ALL_NODES_MAC, D.ll6(), ALL_NODES, 255, icmp6_raw(134, 0, [64, 0x80, 7, 8]), &[0; 8]),
            Dropped(NO_DESTINATION)),
        case("ARP reply claiming the gateway address, IP filter on -> ARP_SPOOF", A, FILTERS,
            frames::arp(A.mac(), B.mac(), ArpOperation::REPLY, A.mac(), GW1_IP4, B.mac(), B.ip4()),
            Dropped(ARP_SPOOF)),
        case("ARP reply claiming the gateway address, IP filter off -> ARP_SPOOF", A, NO_FILTERS,
            frames::arp(A.mac(), B.mac(), ArpOperation::REPLY, A.mac(), GW1_IP4, B.mac(), B.ip4()),
            Dropped(ARP_SPOOF)),
        case("gratuitous ARP for the gateway address, IP filter off -> ARP_SPOOF", A, NO_FILTERS,
            arp_request(A.mac(), GW1_IP4, GW1_IP4),
            Dropped(ARP_SPOOF)),
        case("ARP request for an unknown address, IP filter off (control) -> flooded", A, NO_FILTERS,
            arp_request(A.mac(), A.ip4(), UNKNOWN_IP4),
            Forward(&[B, C])),
    ];
    run_table(rows);
}

/// Unknown unicast goes only to ports that could hold the MAC: B's MAC is
/// not known yet (detection pending), C's is known and filtered. With the
/// MAC filter off a port may bridge other MACs, so it gets them too.
#[test]
fn unknown_unicast_only_to_ports_that_may_hold_it() {
    #[rustfmt::skip]
    let rows = vec![
        case("unknown unicast -> only B, whose MAC is pending", A, NO_MAC_FILTER,
            udp_hello(A, FOREIGN_MAC, FOREIGN_IP4),
            Forward(&[B])),
        case("unknown IPv6 unicast -> only B", A, NO_MAC_FILTER,
            udp6(A.mac(), FOREIGN_MAC, A.ip6(), FOREIGN_IP6, 64, 1, 2, b"x"),
            Forward(&[B])),
        case("broadcast -> B and C", A, NO_MAC_FILTER,
            udp_hello(A, BROADCAST, [255; 4]),
            Forward(&[B, C])),
        case("known unicast to C -> C", A, NO_MAC_FILTER,
            udp_hello(A, C.mac(), C.ip4()),
            Forward(&[C])),
        case("unknown unicast from C -> A (MAC filter off) and B", C, FILTERS,
            udp_hello(C, FOREIGN_MAC, FOREIGN_IP4),
            Forward(&[A, B])),
    ];
    run_table_after(|fx| fx.set_flags(B, MAC_UNKNOWN), rows);
}

/// A BOOTP message of `op` (1 request, 2 reply) from A, with the magic
/// cookie: 240 bytes.
fn bootp(op: u8) -> Vec<u8> {
    let mut m = vec![0u8; 240];
    m[0] = op;
    m[1] = 1;
    m[2] = 6;
    m[28..34].copy_from_slice(&A.mac());
    m[236..240].copy_from_slice(&[99, 130, 83, 99]);
    m
}

/// A small UDP datagram from `from`'s port to `dmac` / `dst`.
fn udp_hello(from: P, dmac: Mac, dst: Ip4) -> Vec<u8> {
    udp4(
        from.mac(),
        dmac,
        ipv4_hdr(from.ip4(), dst, 64),
        40000,
        5000,
        b"hello",
    )
}

/// L2 switching inside a network; nothing crosses into another network.
#[test]
fn l2_switching() {
    let udp = udp_hello;
    let bcast1 = [10, 0, 0, 255];
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets();
    let mdns = [224, 0, 0, 251];
    let mdns_mac = [0x01, 0x00, 0x5e, 0x00, 0x00, 0xfb];
    // QEMU's announcement: RARP "reverse request", sender = target = the VM.
    let rarp_body = [
        &[0, 1, 8, 0, 6, 4, 0, 3][..],
        &A.mac(),
        &[0; 4],
        &A.mac(),
        &[0; 4],
    ]
    .concat();
    #[rustfmt::skip]
    let rows = vec![
        case("unicast to a local VM -> its port only", A, FILTERS,
            udp(A, B.mac(), B.ip4()),
            Forward(&[B])),
        case("unicast the other way -> its port only", C, FILTERS,
            udp(C, A.mac(), A.ip4()),
            Forward(&[A])),
        case("IPv6 unicast to a local VM -> its port only", A, FILTERS,
            udp6(A.mac(), C.mac(), A.ip6(), C.ip6(), 64, 1, 2, b"x"),
            Forward(&[C])),
        case("unknown unicast, every other port's MAC known and filtered -> NO_DESTINATION", A, FILTERS,
            udp(A, FOREIGN_MAC, FOREIGN_IP4),
            Dropped(NO_DESTINATION)),
        case("unicast to a MAC of another network -> unknown here, NO_DESTINATION", A, FILTERS,
            udp(A, D.mac(), D.ip4()),
            Dropped(NO_DESTINATION)),
        case("unicast to the port's own MAC -> NO_DESTINATION", A, FILTERS,
            udp(A, A.mac(), A.ip4()),
            Dropped(NO_DESTINATION)),
        case("broadcast from the first port of the flood list -> the others", A, FILTERS,
            udp(A, BROADCAST, bcast1),
            Forward(&[B, C])),
        case("broadcast from the middle port -> the others", B, FILTERS,
            udp(B, BROADCAST, bcast1),
            Forward(&[A, C])),
        case("broadcast from the last port -> the others", C, FILTERS,
            udp(C, BROADCAST, bcast1),
            Forward(&[A, B])),
        case("broadcast from the only port of a network -> NO_DESTINATION", D, FILTERS,
            udp(D, BROADCAST, [10, 1, 0, 255]),
            Dropped(NO_DESTINATION)),
        case("IPv6 multicast (33:33:00:00:00:01) -> flooded", A, FILTERS,
            icmp6(A.mac(), multicast_mac6(all_nodes), A.ll6(), all_nodes, 1, echo6_request(1, 1), b"ping"),
            Forward(&[B, C])),
        case("IPv4 multicast (01:00:5e:00:00:fb) -> flooded", B, FILTERS,
            udp4(B.mac(), mdns_mac, ipv4_hdr(B.ip4(), mdns, 255), 5353, 5353, b"mdns"),
            Forward(&[A, C])),
        case("RARP announcement after migration -> flooded, even with IP filter", A, FILTERS,
            eth(A.mac(), BROADCAST, ETH_P_RARP, &rarp_body),
            Forward(&[B, C])),
    ];
    run_table(rows);
}

/// VXLAN source learning, the sending side: unicast to a MAC learned
/// behind another node (`vmp_remote_learned`) goes to `vm_remote`, onto
/// the overlay only, and is not flooded to the local ports; a learned
/// entry never overrides `vmp_endpoints` and is per network.
#[test]
fn learned_remote_macs() {
    let udp = udp_hello;
    let learned_mac: Mac = [0x52, 0x54, 0x00, 0x00, 0x00, 0x77];
    // (row, frames that must go onto the overlay)
    #[rustfmt::skip]
    let rows = vec![
        (case("unicast to a learned remote MAC -> the overlay only, no local flood", A, FILTERS,
            udp(A, learned_mac, FOREIGN_IP4),
            Forward(&[])), 1),
        (case("unicast to an unknown MAC -> not to local ports whose MAC is known", A, FILTERS,
            udp(A, FOREIGN_MAC, FOREIGN_IP4),
            Dropped(NO_DESTINATION)), 0),
        (case("a learned entry for a local VM's MAC -> the local port wins", A, FILTERS,
            udp(A, B.mac(), B.ip4()),
            Forward(&[B])), 0),
        (case("broadcast -> flooded locally as before", B, FILTERS,
            udp(B, BROADCAST, [10, 0, 0, 255]),
            Forward(&[A, C])), 0),
        (case("learned in another network -> unknown here (flooded, D alone)", D, FILTERS,
            udp(D, learned_mac, [10, 1, 0, 99]),
            Dropped(NO_DESTINATION)), 0),
    ];
    in_fresh_netns(|| {
        let mut fx = Fixture::new();
        // test_run does not execute redirects: any device stands in for
        // the vxlan device.
        let vxlan = fx.ifx(X);
        fx.dp
            .set_overlay(OverlayConfig {
                vxlan_ifindex: vxlan,
                local_ip4: [192, 0, 2, 1],
                ..Default::default()
            })
            .unwrap();
        let entry = RemoteLearned {
            node_ip4: [192, 0, 2, 2],
            _pad: 0,
            last_seen_ns: 0,
        };
        for mac in [learned_mac, B.mac()] {
            let key = EndpointKey {
                network: NET1,
                mac,
                _pad: [0; 2],
            };
            fx.dp
                .maps_mut()
                .remote_learned
                .insert(key, entry, 0)
                .unwrap();
        }
        let mut failures = Vec::new();
        for (c, to_overlay) in &rows {
            let before = fx.dp.maps().overlay_stats().unwrap().tx_packets;
            let mut errs: Vec<String> = fx.check(c).err().into_iter().collect();
            let sent = fx.dp.maps().overlay_stats().unwrap().tx_packets - before;
            if sent != *to_overlay {
                errs.push(format!("{sent} frames onto the overlay, want {to_overlay}"));
            }
            if !errs.is_empty() {
                failures.push(format!("  {}:\n    {}", c.name, errs.join("\n    ")));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            rows.len(),
            failures.join("\n")
        );
    });
}

/// The flood loop's bounds: a network's local flood list walked to its
/// count, at most `MAX_FLOOD_PORTS` (a larger count, which the agent never
/// writes, walks the width), each member one copy; the remote list to
/// `MAX_FLOOD_NODES` nodes, one copy each, and refused past it. Members
/// stand in on one real device (test_run does not deliver redirects; the
/// clones do go out of it), told apart by their port ids' counters.
#[test]
fn flood_loop_bounds() {
    /// Port ids of the stand-in members: clear of A..E's.
    const FIRST_ID: u32 = 100;
    let max = MAX_FLOOD_PORTS as u32;
    // (row, count written, members in the list, the sender among them,
    //  remote nodes written (0: none), copies each member must get,
    //  frames onto the overlay, drop)
    struct Row {
        name: &'static str,
        count: u32,
        members: u32,
        sender_at: Option<u32>,
        nodes: u32,
        copies: u64,
        to_overlay: u64,
        drop: Option<u32>,
    }
    #[rustfmt::skip]
    let rows = [
        Row { name: "one member besides the sender -> one copy", count: 2, members: 2, sender_at: Some(0), nodes: 0, copies: 1, to_overlay: 0, drop: None },
        Row { name: "512 members -> one copy each", count: 513, members: 513, sender_at: Some(200), nodes: 0, copies: 1, to_overlay: 0, drop: None },
        Row { name: "MAX_FLOOD_PORTS members -> one copy each", count: max, members: max, sender_at: Some(max - 1), nodes: 0, copies: 1, to_overlay: 0, drop: None },
        Row { name: "count past the width -> the width walked, one copy each", count: max + 5000, members: max, sender_at: None, nodes: 0, copies: 1, to_overlay: 0, drop: None },
        Row { name: "the sender alone -> NO_DESTINATION", count: 1, members: 1, sender_at: Some(0), nodes: 0, copies: 0, to_overlay: 0, drop: Some(NO_DESTINATION) },
        Row { name: "empty list -> NO_DESTINATION", count: 0, members: 0, sender_at: None, nodes: 0, copies: 0, to_overlay: 0, drop: Some(NO_DESTINATION) },
        Row { name: "1,000 remote nodes -> one overlay copy each", count: 3, members: 3, sender_at: Some(1), nodes: 1000, copies: 1, to_overlay: 1000, drop: None },
        Row { name: "MAX_FLOOD_NODES remote nodes -> one overlay copy each", count: 3, members: 3, sender_at: Some(1), nodes: MAX_FLOOD_NODES as u32, copies: 1, to_overlay: MAX_FLOOD_NODES as u64, drop: None },
        Row { name: "remote count past the width -> NO_DESTINATION, no overlay copy", count: 3, members: 3, sender_at: Some(1), nodes: MAX_FLOOD_NODES as u32 + 1, copies: 1, to_overlay: 0, drop: Some(NO_DESTINATION) },
    ];
    // Every clone of one run waits on this CPU's backlog (the stand-in is
    // a veth): room for the widest list (a host-wide setting, only raised).
    let backlog = "/proc/sys/net/core/netdev_max_backlog";
    let now: usize = std::fs::read_to_string(backlog)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    if now < 2 * MAX_FLOOD_NODES {
        std::fs::write(backlog, (2 * MAX_FLOOD_NODES).to_string()).unwrap();
    }
    in_fresh_netns(|| {
        let mut fx = Fixture::new();
        let (a, stand_in) = (fx.ifx(A), fx.ifx(X));
        fx.dp
            .set_overlay(OverlayConfig {
                vxlan_ifindex: stand_in,
                local_ip4: [192, 0, 2, 1],
                ..Default::default()
            })
            .unwrap();
        let frame = udp_hello(A, BROADCAST, [10, 0, 0, 255]);
        let mut failures = Vec::new();
        for row in &rows {
            let mut list = FloodList {
                count: row.count,
                ..Default::default()
            };
            for i in 0..row.members {
                let sender = row.sender_at == Some(i);
                list.ifindex[i as usize] = if sender { a } else { stand_in };
                list.port_id[i as usize] = if sender {
                    P::A as u32 + 1
                } else {
                    FIRST_ID + i
                };
            }
            let maps = fx.dp.maps_mut();
            maps.flood.insert(NET1, list, 0).unwrap();
            let _ = maps.flood_remote.remove(&NET1);
            if row.nodes != 0 {
                let mut remote = RemoteFloodList {
                    count: row.nodes,
                    ..Default::default()
                };
                for n in 0..row.nodes.min(MAX_FLOOD_NODES as u32) {
                    // Sorted, as the agent writes it: 10.64.0.1 upwards.
                    remote.node_ip4[n as usize] = (0x0a40_0001 + n).to_be_bytes();
                }
                maps.flood_remote.insert(NET1, remote, 0).unwrap();
            }
            let tx = |fx: &Fixture| -> Vec<u64> {
                (0..row.members)
                    .map(|i| {
                        let id = if row.sender_at == Some(i) {
                            P::A as u32 + 1
                        } else {
                            FIRST_ID + i
                        };
                        let v = fx.dp.maps().port_stats.get(&id, 0).unwrap();
                        v.iter().map(|s| s.tx_packets).sum()
                    })
                    .collect()
            };
            let (before, overlay_before) =
                (tx(&fx), fx.dp.maps().overlay_stats().unwrap().tx_packets);
            let (run, d) = fx.run_counted(A, &frame).expect("test_run");
            let after = tx(&fx);
            let sent = fx.dp.maps().overlay_stats().unwrap().tx_packets - overlay_before;
            let mut errs = Vec::new();
            for i in 0..row.members as usize {
                let got = after[i] - before[i];
                let want = if row.sender_at == Some(i as u32) {
                    0
                } else {
                    row.copies
                };
                if got != want {
                    errs.push(format!("member {i}: {got} copies, want {want}"));
                    break;
                }
            }
            if sent != row.to_overlay {
                errs.push(format!(
                    "{sent} frames onto the overlay, want {}",
                    row.to_overlay
                ));
            }
            match row.drop {
                Some(reason) => {
                    if run.verdict != TC_ACT_SHOT || d.single_drop() != Some(reason) {
                        errs.push(format!(
                            "verdict {}, drops {:?}, want {reason}",
                            run.verdict, d.drops
                        ));
                    }
                }
                None => {
                    if run.verdict != TC_ACT_REDIRECT || d.drop_total() != 0 {
                        errs.push(format!(
                            "verdict {}, drops {:?}, want REDIRECT",
                            run.verdict, d.drops
                        ));
                    }
                }
            }
            if !errs.is_empty() {
                failures.push(format!("  {}:\n    {}", row.name, errs.join("\n    ")));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            rows.len(),
            failures.join("\n")
        );
    });
}

/// Port security: source MAC, source IP, ethertypes.
#[test]
fn port_security() {
    let udp_from = |smac: Mac, src: Ip4| {
        udp4(
            smac,
            B.mac(),
            ipv4_hdr(src, B.ip4(), 64),
            40000,
            5000,
            b"data",
        )
    };
    let udp6_from =
        |smac: Mac, src: Ip6, dst: Ip6| udp6(smac, B.mac(), src, dst, 64, 1, 2, b"data");
    let from_zero = |sport: u16, dport: u16| {
        udp4(
            A.mac(),
            BROADCAST,
            ipv4_hdr([0; 4], [255; 4], 64),
            sport,
            dport,
            &[0; 240],
        )
    };
    let zero_tcp = tcp4(A.mac(), BROADCAST, ipv4_hdr([0; 4], [255; 4], 64), 68, 67);
    let zero_icmp = icmp4(
        A.mac(),
        B.mac(),
        ipv4_hdr([0; 4], B.ip4(), 64),
        echo4_request(1, 1),
        b"x",
    );
    let mld_routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 0x16).octets();
    let mld_report = icmp6(
        A.mac(),
        multicast_mac6(mld_routers),
        UNSPEC6,
        mld_routers,
        1,
        icmp6_raw(143, 0, [0, 0, 0, 0]),
        &[],
    );
    let mld_hbh = icmp6_with(
        A.mac(),
        multicast_mac6(mld_routers),
        v6_router_alert(UNSPEC6, mld_routers, 1),
        icmp6_raw(143, 0, [0, 0, 0, 0]),
        &[],
    );
    let hbh_udp = |src: Ip6| udp6_with(A.mac(), B.mac(), v6_router_alert(src, B.ip6(), 64), 1, 2);
    // `hbh_udp` from A's own address with `n` destination options headers
    // (8 bytes each, PadN) between the hop-by-hop header and UDP.
    let hbh_dstopts_udp = |n: usize| {
        let f = hbh_udp(A.ip6());
        let l4 = OFF_L4_6 + 8;
        let mut v = f[..l4].to_vec();
        v[OFF_L4_6] = 60;
        let plen = u16::from_be_bytes([v[18], v[19]]) + 8 * n as u16;
        v[18..20].copy_from_slice(&plen.to_be_bytes());
        for i in 0..n {
            let next = if i + 1 == n { 17 } else { 60 };
            v.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
        }
        v.extend_from_slice(&f[l4..]);
        v
    };
    let vlan = |vid: u16, dmac: Mac, src: Ip4, dst: Ip4| {
        udp4_vlan(A.mac(), dmac, vid, ipv4_hdr(src, dst, 64), 5000)
    };
    let other_ethertype = eth(A.mac(), BROADCAST, 0x88b5, &payload(46));
    let llc = eth(A.mac(), BROADCAST, 46, &payload(46));
    #[rustfmt::skip]
    let rows = vec![
        // Source MAC.
        case("source MAC of another VM -> MAC_SPOOF", A, FILTERS,
            udp_from(B.mac(), A.ip4()),
            Dropped(MAC_SPOOF)),
        case("foreign source MAC -> MAC_SPOOF", A, FILTERS,
            udp_from(FOREIGN_MAC, A.ip4()),
            Dropped(MAC_SPOOF)),
        case("foreign source MAC on IPv6 -> MAC_SPOOF", A, FILTERS,
            udp6_from(FOREIGN_MAC, A.ip6(), B.ip6()),
            Dropped(MAC_SPOOF)),
        case("foreign source MAC on a non-IP ethertype, IP filter off -> MAC_SPOOF", A, NO_IP_FILTER,
            eth(FOREIGN_MAC, BROADCAST, 0x88b5, &payload(46)),
            Dropped(MAC_SPOOF)),
        case("multicast source MAC -> SRC_MULTICAST", A, FILTERS,
            udp_from(MCAST_MAC, A.ip4()),
            Dropped(SRC_MULTICAST)),
        case("broadcast source MAC with every filter off -> SRC_MULTICAST", A, 0,
            udp_from(BROADCAST, A.ip4()),
            Dropped(SRC_MULTICAST)),
        case("foreign source MAC, MAC filter off -> forwarded", A, NO_MAC_FILTER,
            udp_from(FOREIGN_MAC, A.ip4()),
            Forward(&[B])),
        case("foreign source MAC, port MAC not known yet -> forwarded", A, MAC_UNKNOWN,
            udp_from(FOREIGN_MAC, A.ip4()),
            Forward(&[B])),
        // IPv4 source.
        case("IPv4 foreign source -> IP_SPOOF", A, FILTERS,
            udp_from(A.mac(), FOREIGN_IP4),
            Dropped(IP_SPOOF)),
        case("IPv4 source of another VM -> IP_SPOOF", A, FILTERS,
            udp_from(A.mac(), C.ip4()),
            Dropped(IP_SPOOF)),
        case("IPv4 source of the gateway -> IP_SPOOF", A, FILTERS,
            udp_from(A.mac(), GW1_IP4),
            Dropped(IP_SPOOF)),
        case("IPv4 source of a VM in another network -> IP_SPOOF", A, FILTERS,
            udp_from(A.mac(), D.ip4()),
            Dropped(IP_SPOOF)),
        case("IPv4 foreign source, IP filter off -> forwarded", A, NO_IP_FILTER,
            udp_from(A.mac(), FOREIGN_IP4),
            Forward(&[B])),
        case("IPv4 0.0.0.0 DHCP discover (UDP 68 -> 67) -> flooded", A, FILTERS,
            from_zero(68, 67),
            Forward(&[B, C])),
        case("IPv4 0.0.0.0 UDP to port 68 -> IP_SPOOF", A, FILTERS,
            from_zero(67, 68),
            Dropped(IP_SPOOF)),
        case("IPv4 0.0.0.0 TCP to port 67 -> IP_SPOOF", A, FILTERS,
            zero_tcp,
            Dropped(IP_SPOOF)),
        case("IPv4 0.0.0.0 ICMP -> IP_SPOOF", A, FILTERS,
            zero_icmp,
            Dropped(IP_SPOOF)),
        case("IPv4 0.0.0.0 UDP cut inside the UDP header -> MALFORMED", A, FILTERS,
            truncated(from_zero(68, 67), OFF_L4_4 + 7),
            Dropped(MALFORMED)),
        // IPv6 source.
        case("IPv6 foreign source -> IP_SPOOF", A, FILTERS,
            udp6_from(A.mac(), FOREIGN_IP6, B.ip6()),
            Dropped(IP_SPOOF)),
        case("IPv6 source of another VM -> IP_SPOOF", A, FILTERS,
            udp6_from(A.mac(), C.ip6(), B.ip6()),
            Dropped(IP_SPOOF)),
        case("IPv6 source of the gateway -> IP_SPOOF", A, FILTERS,
            udp6_from(A.mac(), GW1_IP6, B.ip6()),
            Dropped(IP_SPOOF)),
        case("IPv6 foreign source, IP filter off -> forwarded", A, NO_IP_FILTER,
            udp6_from(A.mac(), FOREIGN_IP6, B.ip6()),
            Forward(&[B])),
        case("IPv6 fe80:: source -> forwarded", A, FILTERS,
            udp6_from(A.mac(), A.ll6(), B.ll6()),
            Forward(&[B])),
        case("IPv6 :: source with ICMPv6 (MLDv2 report) -> flooded", A, FILTERS,
            mld_report,
            Forward(&[B, C])),
        case("IPv6 :: source, hop-by-hop router alert, MLDv2 report -> flooded", A, FILTERS,
            mld_hbh.clone(),
            Forward(&[B, C])),
        case("IPv6 :: source, hop-by-hop then UDP -> IP_SPOOF", A, FILTERS,
            hbh_udp(UNSPEC6),
            Dropped(IP_SPOOF)),
        case("IPv6 :: source, hop-by-hop header cut short -> MALFORMED", A, FILTERS,
            truncated(mld_hbh.clone(), OFF_L4_6 + 1),
            Dropped(MALFORMED)),
        case("IPv6 foreign source, hop-by-hop then ICMPv6 -> IP_SPOOF", A, FILTERS,
            icmp6_with(A.mac(), B.mac(), v6_router_alert(FOREIGN_IP6, B.ip6(), 1), echo6_request(1, 1), b"x"),
            Dropped(IP_SPOOF)),
        case("IPv6 own source, hop-by-hop then UDP -> forwarded", A, FILTERS,
            hbh_udp(A.ip6()),
            Forward(&[B])),
        case("IPv6 own source, hop-by-hop and three destination options then UDP (4 headers) -> forwarded", A, FILTERS,
            hbh_dstopts_udp(3),
            Forward(&[B])),
        case("IPv6 own source, hop-by-hop and four destination options then UDP (5 headers) -> EXT_HEADER_CHAIN", A, FILTERS,
            hbh_dstopts_udp(4),
            Dropped(EXT_HEADER_CHAIN)),
        case("IPv6 :: source with UDP -> IP_SPOOF", A, FILTERS,
            udp6_from(A.mac(), UNSPEC6, B.ip6()),
            Dropped(IP_SPOOF)),
        case("IPv6 :: source with UDP, IP filter off -> forwarded", A, NO_IP_FILTER,
            udp6_from(A.mac(), UNSPEC6, B.ip6()),
            Forward(&[B])),
        // Ethertypes.
        case("VLAN-tagged (0x8100) with IP filter -> ETHERTYPE", A, FILTERS,
            vlan(10, B.mac(), A.ip4(), B.ip4()),
            Dropped(ETHERTYPE)),
        case("VLAN-tagged smuggling a foreign source, IP filter -> ETHERTYPE", A, FILTERS,
            vlan(0, BROADCAST, FOREIGN_IP4, [255; 4]),
            Dropped(ETHERTYPE)),
        case("VLAN-tagged with IP filter off -> forwarded", A, NO_IP_FILTER,
            vlan(10, B.mac(), A.ip4(), B.ip4()),
            Forward(&[B])),
        case("other ethertype (0x88b5) with IP filter -> ETHERTYPE", A, FILTERS,
            other_ethertype.clone(),
            Dropped(ETHERTYPE)),
        case("other ethertype (0x88b5) with IP filter off -> flooded", A, NO_IP_FILTER,
            other_ethertype,
            Forward(&[B, C])),
        case("802.3 length field instead of an ethertype, IP filter -> ETHERTYPE", A, FILTERS,
            llc,
            Dropped(ETHERTYPE)),
    ];
    run_table(rows);
}

/// Frames to the gateway MAC that the gateway does not answer: no routed
/// egress exists yet, so they are dropped and counted.
#[test]
fn gateway_unrouted() {
    let doc6 = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets();
    #[rustfmt::skip]
    let rows = vec![
        case("UDP to 8.8.8.8 via the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            udp4(A.mac(), GW1_MAC, ipv4_hdr(A.ip4(), [8, 8, 8, 8], 64), 40000, 53, &payload(30)),
            Dropped(GATEWAY_UNROUTED)),
        case("TCP SYN to 1.1.1.1 via the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            tcp4(A.mac(), GW1_MAC, ipv4_hdr(A.ip4(), [1, 1, 1, 1], 64), 40000, 443),
            Dropped(GATEWAY_UNROUTED)),
        case("UDP to the gateway address itself -> GATEWAY_UNROUTED", A, FILTERS,
            udp4(A.mac(), GW1_MAC, ipv4_hdr(A.ip4(), GW1_IP4, 64), 40000, 53, b"q"),
            Dropped(GATEWAY_UNROUTED)),
        case("DHCP from 0.0.0.0 unicast to the gateway MAC -> GATEWAY_UNROUTED", A, FILTERS,
            udp4(A.mac(), GW1_MAC, ipv4_hdr([0; 4], GW1_IP4, 64), 68, 67, &[0; 240]),
            Dropped(GATEWAY_UNROUTED)),
        case("UDP to 8.8.8.8 via the gateway, IP filter off -> GATEWAY_UNROUTED", A, NO_IP_FILTER,
            udp4(A.mac(), GW1_MAC, ipv4_hdr(FOREIGN_IP4, [8, 8, 8, 8], 64), 40000, 53, b"q"),
            Dropped(GATEWAY_UNROUTED)),
        case("IPv6 UDP to 2001:db8::1 via the gateway -> GATEWAY_UNROUTED", A, FILTERS,
            udp6(A.mac(), GW1_MAC, A.ip6(), doc6, 64, 40000, 53, b"q"),
            Dropped(GATEWAY_UNROUTED)),
        case("IPv6 UDP to the gateway address itself -> GATEWAY_UNROUTED", A, FILTERS,
            udp6(A.mac(), GW1_MAC, A.ip6(), GW1_IP6, 64, 40000, 53, b"q"),
            Dropped(GATEWAY_UNROUTED)),
        case("UDP via the gateway of a network without gateways -> GATEWAY_UNROUTED", D, FILTERS,
            udp4(D.mac(), GW2_MAC, ipv4_hdr(D.ip4(), [8, 8, 8, 8], 64), 40000, 53, b"q"),
            Dropped(GATEWAY_UNROUTED)),
    ];
    run_table(rows);
}

/// Frames on interfaces the data path does not know.
#[test]
fn unknown_port_and_network() {
    #[rustfmt::skip]
    let rows = vec![
        case("frame on an interface that is not a port -> UNKNOWN_PORT", X, FILTERS,
            udp4(X.mac(), A.mac(), ipv4_hdr(X.ip4(), A.ip4(), 64), 1, 2, b"x"),
            Dropped(UNKNOWN_PORT)),
        case("ARP for the gateway on an interface that is not a port -> UNKNOWN_PORT", X, FILTERS,
            arp_request(X.mac(), X.ip4(), GW1_IP4),
            Dropped(UNKNOWN_PORT)),
        // Switching needs no network entry (lookups are keyed by network
        // id, so nothing reaches another network): no port to go to.
        case("broadcast on a port whose network is not programmed -> NO_DESTINATION", E, NO_FILTERS,
            udp4(E.mac(), BROADCAST, ipv4_hdr(E.ip4(), [255; 4], 64), 1, 2, b"x"),
            Dropped(NO_DESTINATION)),
        case("to the gateway on a port whose network is not programmed -> NO_NETWORK", E, NO_FILTERS,
            udp4(E.mac(), [0; 6], ipv4_hdr(E.ip4(), [8, 8, 8, 8], 64), 1, 2, b"x"),
            Dropped(NO_NETWORK)),
        case("ARP for a gateway on a port whose network is not programmed -> NO_NETWORK", E, 0,
            arp_request(E.mac(), E.ip4(), GW1_IP4),
            Dropped(NO_NETWORK)),
    ];
    run_table(rows);
}

/// Truncated and malformed headers are dropped as MALFORMED, never
/// forwarded or answered. (IPv4 and IPv6 frames too short for their fixed
/// header never reach the program under test_run: see
/// `kernel_refuses_short_frames`.)
#[test]
fn malformed() {
    let arp_req = arp_request(A.mac(), A.ip4(), GW1_IP4);
    let udp = udp4(
        A.mac(),
        B.mac(),
        ipv4_hdr(A.ip4(), B.ip4(), 64),
        1,
        2,
        &payload(20),
    );
    let udp_v6 = udp6(A.mac(), B.mac(), A.ip6(), B.ip6(), 64, 1, 2, &payload(20));
    #[rustfmt::skip]
    let mut rows = vec![
        case("Ethernet-only ARP -> MALFORMED", A, FILTERS,
            eth(A.mac(), BROADCAST, ETH_P_ARP, &[]),
            Dropped(MALFORMED)),
        case("ARP with htype 6 -> MALFORMED", A, FILTERS,
            patched(arp_req.clone(), &[(OFF_ARP, &[0, 6])]),
            Dropped(MALFORMED)),
        case("ARP with ptype IPv6 -> MALFORMED", A, FILTERS,
            patched(arp_req.clone(), &[(OFF_ARP + 2, &[0x86, 0xdd])]),
            Dropped(MALFORMED)),
        case("ARP with hlen 8 -> MALFORMED", A, FILTERS,
            patched(arp_req.clone(), &[(OFF_ARP + 4, &[8])]),
            Dropped(MALFORMED)),
        case("ARP with plen 16 -> MALFORMED", A, FILTERS,
            patched(arp_req.clone(), &[(OFF_ARP + 5, &[16])]),
            Dropped(MALFORMED)),
        case("ARP with plen 16, filters off -> MALFORMED", A, NO_FILTERS,
            patched(arp_req.clone(), &[(OFF_ARP + 5, &[16])]),
            Dropped(MALFORMED)),
        case("IPv4 with ihl 4 -> MALFORMED", A, FILTERS,
            patched(udp.clone(), &[(OFF_IP, &[0x44])]),
            Dropped(MALFORMED)),
        case("IPv4 with ihl 0 -> MALFORMED", A, FILTERS,
            patched(udp.clone(), &[(OFF_IP, &[0x40])]),
            Dropped(MALFORMED)),
        case("IPv4 with ihl 15 in a frame that ends before 60 header bytes -> MALFORMED", A, FILTERS,
            truncated(patched(udp.clone(), &[(OFF_IP, &[0x4f])]), OFF_IP + 40),
            Dropped(MALFORMED)),
        case("IPv4 with ihl 15 in a frame that ends before 60 header bytes, IP filter off -> MALFORMED", A, NO_IP_FILTER,
            truncated(patched(udp.clone(), &[(OFF_IP, &[0x4f])]), OFF_IP + 40),
            Dropped(MALFORMED)),
        case("IPv4 with version 6 -> MALFORMED", A, FILTERS,
            patched(udp.clone(), &[(OFF_IP, &[0x65])]),
            Dropped(MALFORMED)),
        case("IPv4 with version 6, IP filter off -> MALFORMED", A, NO_IP_FILTER,
            patched(udp.clone(), &[(OFF_IP, &[0x65])]),
            Dropped(MALFORMED)),
        case("IPv6 with version 4 -> MALFORMED", A, FILTERS,
            patched(udp_v6.clone(), &[(OFF_IP, &[0x40])]),
            Dropped(MALFORMED)),
        case("IPv6 with version 4, IP filter off -> MALFORMED", A, NO_IP_FILTER,
            patched(udp_v6.clone(), &[(OFF_IP, &[0x40])]),
            Dropped(MALFORMED)),
    ];
    // Every cut of an ARP request for the gateway inside the ARP header.
    for len in OFF_ARP + 1..OFF_ARP + 28 {
        rows.push(case(
            leak(format!(
                "ARP request for the gateway cut at {len} bytes -> MALFORMED"
            )),
            A,
            FILTERS,
            truncated(arp_req.clone(), len),
            Dropped(MALFORMED),
        ));
    }
    run_table(rows);
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn is_einval(r: &Result<Run, ProgramError>) -> bool {
    matches!(r, Err(ProgramError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EINVAL))
}

/// test_run refuses frames shorter than an Ethernet header (the kernel's
/// `bpf_test_init` returns EINVAL), so the program never sees them; this
/// kernel also refuses IPv4 frames shorter than 14 + 20 bytes and IPv6
/// frames shorter than 14 + 40. Frames the kernel does accept must be
/// dropped as MALFORMED. Nothing refused may be counted.
#[test]
fn kernel_refuses_short_frames() {
    in_fresh_netns(|| {
        let fx = Fixture::new();
        let arp = arp_request(A.mac(), A.ip4(), GW1_IP4);
        for len in 0..14 {
            let before = fx.counters();
            let r = fx.run(A, &arp[..len]);
            assert!(
                is_einval(&r),
                "{len}-byte frame not refused with EINVAL: {:?}",
                r.map(|r| r.verdict)
            );
            let d = Fixture::delta(&before, &fx.counters());
            assert_eq!(
                (d.drop_total(), d.port(A).rx_packets),
                (0, 0),
                "{len}-byte frame counted"
            );
        }
        let udp = udp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), B.ip4(), 64), 1, 2, b"x");
        let udp_v6 = udp6(A.mac(), B.mac(), A.ip6(), B.ip6(), 64, 1, 2, b"x");
        let mut refused = 0;
        for (frame, header_end) in [(&udp, OFF_IP + 20), (&udp_v6, OFF_IP + 40)] {
            for len in 14..header_end {
                let before = fx.counters();
                let r = fx.run(A, &frame[..len]);
                let d = Fixture::delta(&before, &fx.counters());
                if is_einval(&r) {
                    refused += 1;
                    assert_eq!(
                        (d.drop_total(), d.port(A).rx_packets),
                        (0, 0),
                        "{len}: counted"
                    );
                } else {
                    let r = r.expect("test_run");
                    assert_eq!(r.verdict, TC_ACT_SHOT, "{len}-byte IP frame not dropped");
                    assert_eq!(d.single_drop(), Some(MALFORMED), "{len}-byte IP frame");
                }
            }
        }
        eprintln!(
            "short IPv4/IPv6 frames refused by the kernel: {refused} of {}",
            20 + 40
        );
        // The smallest frame always accepted: an Ethernet header alone.
        let r = fx.run(A, &arp[..14]).expect("14-byte frame");
        assert_eq!(r.verdict, TC_ACT_SHOT);
    });
}

// ===========================================================================
// Random frames
// ===========================================================================

/// Deterministic xorshift64 so failures reproduce.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// Writes what fits of `bytes` at `off`.
fn put(f: &mut [u8], off: usize, bytes: &[u8]) {
    for (i, b) in bytes.iter().enumerate() {
        if let Some(slot) = f.get_mut(off + i) {
            *slot = *b;
        }
    }
}

/// A random frame of 14..=200 bytes, mostly from port A's MAC and shaped
/// enough like ARP/IPv4/IPv6/ND/echo to reach the deeper branches.
fn random_frame(rng: &mut XorShift) -> Vec<u8> {
    let len = 14 + rng.below(187);
    let mut f: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let a = P::A;
    if rng.chance(20) {
        // Random source MAC (sometimes one that is close to the port's).
        if rng.chance(30) {
            let mut m = a.mac();
            m[5] ^= 1 << rng.below(8);
            put(&mut f, 6, &m);
        }
        return f;
    }
    put(&mut f, 6, &a.mac());
    let dst = rng.pick(&[
        GW1_MAC,
        P::B.mac(),
        P::D.mac(),
        BROADCAST,
        multicast_mac6(solicited_node(GW1_IP6)),
        a.mac(),
        FOREIGN_MAC,
    ]);
    put(&mut f, 0, &dst);
    let other = rng.next() as u16;
    let ether_type = rng.pick(&[
        ETH_P_ARP,
        ETH_P_IP,
        ETH_P_IP,
        ETH_P_IPV6,
        ETH_P_IPV6,
        ETH_P_RARP,
        ETH_P_8021Q,
        other,
    ]);
    put(&mut f, 12, &ether_type.to_be_bytes());
    match ether_type {
        ETH_P_ARP => {
            if rng.chance(80) {
                put(&mut f, 14, &[0, 1, 8, 0, 6, 4]);
            }
            put(&mut f, 20, &[0, rng.pick(&[1, 1, 2, 3])]);
            if rng.chance(80) {
                put(&mut f, 22, &a.mac());
            }
            let spa = rng.pick(&[a.ip4(), a.ip4(), [0; 4], P::B.ip4(), GW1_IP4]);
            put(&mut f, 28, &spa);
            let tpa = rng.pick(&[GW1_IP4, P::B.ip4(), FOREIGN_IP4]);
            put(&mut f, 38, &tpa);
        }
        ETH_P_IP => {
            if rng.chance(80) {
                put(&mut f, 14, &[rng.pick(&[0x45, 0x45, 0x46, 0x44, 0x4f])]);
            }
            if rng.chance(70) {
                put(&mut f, 20, &[0, 0]); // not a fragment
            }
            let other = rng.next() as u8;
            let proto = rng.pick(&[1u8, 1, 17, 17, 6, other]);
            put(&mut f, 23, &[proto]);
            let src = rng.pick(&[a.ip4(), a.ip4(), [0; 4], P::B.ip4(), FOREIGN_IP4]);
            put(&mut f, 26, &src);
            let dst = rng.pick(&[GW1_IP4, P::B.ip4(), [255; 4], [8, 8, 8, 8]]);
            put(&mut f, 30, &dst);
            let ihl = usize::from(f.get(14).copied().unwrap_or(0) & 0x0f) * 4;
            let l4 = 14 + ihl.max(20);
            match proto {
                1 => put(
                    &mut f,
                    l4,
                    &[rng.pick(&[8, 8, 0, 13]), rng.pick(&[0, 0, 1])],
                ),
                17 => put(&mut f, l4 + 2, &rng.pick(&[67u16, 68, 53]).to_be_bytes()),
                _ => {}
            }
        }
        ETH_P_IPV6 => {
            if rng.chance(80) {
                put(&mut f, 14, &[0x60]);
            }
            let other = rng.next() as u8;
            let next = rng.pick(&[58u8, 58, 58, 17, 0, other]);
            put(&mut f, 20, &[next]);
            put(&mut f, 21, &[rng.pick(&[255, 255, 64, 1])]);
            let src = rng.pick(&[a.ip6(), a.ll6(), UNSPEC6, P::B.ip6(), FOREIGN_IP6]);
            put(&mut f, 22, &src);
            let dst = rng.pick(&[GW1_IP6, GW1_LL6, solicited_node(GW1_IP6), P::B.ip6()]);
            put(&mut f, 38, &dst);
            if next == 0 {
                // Hop-by-hop header: what follows it.
                put(&mut f, 54, &[rng.pick(&[58, 58, 17])]);
            }
            if next == 58 {
                put(&mut f, 54, &[rng.pick(&[135, 135, 128, 128, 136, 143])]);
                put(&mut f, 55, &[rng.pick(&[0, 0, 0, 1])]);
                let target = rng.pick(&[GW1_IP6, GW1_LL6, P::B.ip6()]);
                put(&mut f, 62, &target);
            }
        }
        _ => {}
    }
    f
}

/// An IPv4 or IPv6 frame shorter than its fixed IP header.
fn short_l3(f: &[u8]) -> bool {
    match u16::from_be_bytes([f[12], f[13]]) {
        ETH_P_IP => f.len() < OFF_IP + 20,
        ETH_P_IPV6 => f.len() < OFF_IP + 40,
        _ => false,
    }
}

/// Would port A's filters (all on) let this input through?
fn passes_filters(f: &[u8]) -> bool {
    let a = P::A;
    if f[6..12] != a.mac() {
        return false;
    }
    let ether_type = u16::from_be_bytes([f[12], f[13]]);
    match ether_type {
        ETH_P_ARP => f[22..28] == a.mac() && (f[28..32] == a.ip4() || f[28..32] == [0; 4]),
        ETH_P_IP => {
            let src = &f[26..30];
            let l4 = 14 + usize::from(f[14] & 0x0f) * 4;
            src == a.ip4()
                || (src == [0; 4]
                    && f[23] == 17
                    && f.len() >= l4 + 4
                    && f[l4 + 2..l4 + 4] == 67u16.to_be_bytes())
        }
        ETH_P_IPV6 => {
            let src = &f[22..38];
            // ::, only for ICMPv6 (DAD), directly or after a hop-by-hop
            // header (MLD).
            let icmp6 = f[20] == 58 || (f[20] == 0 && f.len() > OFF_L4_6 && f[OFF_L4_6] == 58);
            src == a.ip6() || src[..8] == a.ll6()[..8] || (src == UNSPEC6 && icmp6)
        }
        ETH_P_RARP => true,
        _ => false,
    }
}

/// 2000 random frames from port A with every filter on: the verdict is
/// always SHOT or REDIRECT (or OK), a foreign or multicast source MAC is
/// always dropped, a drop counts exactly one reason, a redirect either goes
/// to ports of A's network unchanged or is a gateway answer back to A, and
/// nothing forwarded ever got past the filters.
#[test]
fn random_frames_never_bypass_filters() {
    in_fresh_netns(|| {
        let mut fx = Fixture::new();
        fx.set_flags(P::A, FILTERS);
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let (mut forwarded, mut answered, mut refused) = (0, 0, 0);
        let mut dropped: BTreeMap<&str, usize> = BTreeMap::new();
        for i in 0..2000 {
            let frame = random_frame(&mut rng);
            let ctx = || format!("frame {i} ({} bytes): {:02x?}", frame.len(), frame);
            let (run, d) = match fx.run_counted(P::A, &frame) {
                Ok(r) => r,
                // This kernel's test_run refuses IP frames too short for
                // their fixed header (see kernel_refuses_short_frames).
                Err(ProgramError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::EINVAL) && short_l3(&frame) =>
                {
                    refused += 1;
                    continue;
                }
                Err(e) => panic!("test_run failed: {e:?}\n{}", ctx()),
            };
            assert!(
                [TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT].contains(&run.verdict),
                "verdict {}: {}",
                run.verdict,
                ctx()
            );
            for p in [P::D, P::E, P::X] {
                assert_eq!(d.port(p).tx_packets, 0, "tx leaked to {p:?}: {}", ctx());
            }
            let own_mac = frame[6..12] == P::A.mac();
            if !own_mac {
                assert_eq!(run.verdict, TC_ACT_SHOT, "foreign source MAC: {}", ctx());
                let reason = d.single_drop();
                assert!(
                    reason == Some(MAC_SPOOF) || reason == Some(SRC_MULTICAST),
                    "foreign source MAC dropped as {:?}: {}",
                    named_drops(&d),
                    ctx()
                );
            }
            match run.verdict {
                TC_ACT_SHOT => {
                    let reason = d.single_drop().unwrap_or_else(|| {
                        panic!("drop without one reason {:?}: {}", d.drops, ctx())
                    });
                    assert!(d.tx_ports().is_empty() && d.gw_replies() == 0, "{}", ctx());
                    *dropped
                        .entry(drop_reason::NAMES[reason as usize])
                        .or_default() += 1;
                }
                TC_ACT_REDIRECT => {
                    assert_eq!(d.drop_total(), 0, "{}", ctx());
                    assert!(passes_filters(&frame), "filter bypassed: {}", ctx());
                    if d.gw_replies() == 1 {
                        assert_eq!(d.port(P::A).gw_replies, 1, "{}", ctx());
                        assert!(d.tx_ports().is_empty(), "{}", ctx());
                        assert_eq!(run.out[0..6], P::A.mac(), "reply not to A: {}", ctx());
                        // The gateway, or a known endpoint (`vm_neigh`).
                        let from: Mac = run.out[6..12].try_into().unwrap();
                        assert!(
                            [GW1_MAC, P::B.mac(), P::C.mac(), REMOTE_MAC].contains(&from),
                            "reply not from the gateway or a known endpoint: {}",
                            ctx()
                        );
                        answered += 1;
                    } else {
                        let to = d.tx_ports();
                        assert!(
                            !to.is_empty() && to.iter().all(|p| [P::B, P::C].contains(p)),
                            "redirect to {to:?}: {}",
                            ctx()
                        );
                        assert_eq!(run.out, frame, "forwarded frame changed: {}", ctx());
                        forwarded += 1;
                    }
                }
                _ => {}
            }
        }
        // The generator must reach past the first checks.
        let drops: usize = dropped.values().sum();
        assert!(
            forwarded >= 100 && answered >= 10 && drops >= 500,
            "forwarded {forwarded}, answered {answered}, dropped {dropped:?}"
        );
        for reason in [
            "mac_spoof",
            "ip_spoof",
            "arp_spoof",
            "malformed",
            "ethertype",
        ] {
            assert!(
                dropped.contains_key(reason),
                "no {reason} drop: {dropped:?}"
            );
        }
        eprintln!(
            "random frames: forwarded {forwarded}, answered {answered}, refused by the kernel \
             {refused}, dropped {dropped:?}"
        );
    });
}

// ===========================================================================
// Slow-path meter: per-port token buckets before the AF_XDP hand-off
// ===========================================================================
//
// BPF_PROG_TEST_RUN cannot move time, so each row preloads the bucket:
// its credit and the time of its last frame (in the future: nothing
// refills during the row; in the past: that much refills). A frame costs
// 10 s of credit: what refills while a row runs (milliseconds) is far less
// than the half frame of slack the refill rows leave, and the longest
// "ago" (60 s) is shorter than any host's uptime by the time tests run.

/// One frame's cost in the meter rows: 10 s.
const METER_COST: u64 = 10_000_000_000;
const METER_BURST: u64 = 3;

/// When the preloaded bucket last saw a frame.
#[derive(Clone, Copy)]
enum Last {
    /// Later than now: no refill at all.
    Future,
    /// Never (0): a full bucket, however much credit is stored.
    Never,
    /// This many ns before the row starts.
    Ago(u64),
}

/// One meter row: the bucket of `class` on port A preloaded with `credit`
/// and `last`, then frames of that class sent one by one; `punted` says
/// for each whether it must reach the slow path (else: dropped as
/// `slowpath_rate_limited`).
struct MeterRow {
    name: &'static str,
    class: usize,
    limited: bool,
    credit: u64,
    last: Last,
    punted: &'static [bool],
}

fn meter_row(
    name: &'static str,
    class: usize,
    credit: u64,
    last: Last,
    punted: &'static [bool],
) -> MeterRow {
    MeterRow {
        name,
        class,
        limited: true,
        credit,
        last,
        punted,
    }
}

/// Keeps the calling thread on the CPU it runs on.
fn pin_to_current_cpu() {
    let cpu = unsafe { libc::sched_getcpu() };
    assert!(
        cpu >= 0,
        "sched_getcpu: {}",
        std::io::Error::last_os_error()
    );
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    assert_eq!(
        rc,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}

fn monotonic_ns() -> u64 {
    vmpath_tests::prog_fixture::clock_ns(libc::CLOCK_MONOTONIC)
}

/// A frame of each slow-path class from port A.
fn slow_frame(class: usize) -> Vec<u8> {
    use vmpath_common::slow_class;
    let a = A.mac();
    match class {
        slow_class::DHCP4 => {
            // BOOTP request: op, htype, hlen, hops, xid, secs, flags,
            // ciaddr..giaddr, then chaddr (the VM's MAC).
            let mut bootp = vec![1, 1, 6, 0, 0, 0, 0, 42];
            bootp.resize(28, 0);
            bootp.extend_from_slice(&a);
            bootp.resize(236, 0);
            bootp.extend_from_slice(&[99, 130, 83, 99, 53, 1, 1, 255]);
            udp4(a, [0xff; 6], ipv4_hdr([0; 4], [255; 4], 64), 68, 67, &bootp)
        }
        slow_class::DHCP6 => {
            let all_servers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2).octets();
            // SOLICIT, transaction id 42.
            udp6(
                a,
                multicast_mac6(all_servers),
                A.ll6(),
                all_servers,
                1,
                546,
                547,
                &[1, 0, 0, 42],
            )
        }
        _ => {
            let all_routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2).octets();
            icmp6(
                a,
                multicast_mac6(all_routers),
                A.ll6(),
                all_routers,
                255,
                icmp6_raw(133, 0, [0; 4]),
                &[],
            )
        }
    }
}

/// `frame` as the slow path receives it: an 802.1Q tag with the port id
/// after the MAC addresses.
fn tagged(frame: &[u8], port_id: u16) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    out.extend_from_slice(&[0x81, 0x00]);
    out.extend_from_slice(&port_id.to_be_bytes());
    out.extend_from_slice(&frame[12..]);
    out
}

impl Fixture {
    /// Sets the slow path up (its ifindex: X's, never used by test_run) and
    /// gives every port the network's DHCP service and the meter limits.
    fn program_slow_path(&mut self) {
        let limit = vmpath_common::MeterLimit {
            cost_ns: METER_COST,
            cap_ns: METER_COST * METER_BURST,
        };
        let x = self.ifx(X);
        let maps = self.dp.maps_mut();
        maps.slow
            .set(
                0,
                vmpath_common::SlowPath {
                    ifindex: x,
                    _pad: 0,
                },
                0,
            )
            .unwrap();
        for p in [A, B] {
            maps.slow_limits
                .set(
                    p as u32 + 1,
                    vmpath_common::SlowLimits {
                        class: [limit; vmpath_common::slow_class::COUNT],
                    },
                    0,
                )
                .unwrap();
        }
        for p in [A, B] {
            self.set_flags(p, FILTERS | vmpath_common::PORT_F_DHCP);
        }
    }

    /// Every CPU's copy of a port's buckets set to `meter`.
    fn preload_meter(&mut self, p: P, meter: vmpath_common::SlowMeter) {
        let nr_cpus = aya::util::nr_cpus().expect("nr_cpus");
        let values = PerCpuValues::try_from(vec![meter; nr_cpus]).unwrap();
        self.dp
            .maps_mut()
            .slow_meter
            .set(p as u32 + 1, values, 0)
            .unwrap();
    }

    /// `limited` of each class of a port, summed over CPUs.
    fn meter_limited(&self, p: P) -> [u64; vmpath_common::slow_class::COUNT] {
        self.dp
            .maps()
            .slow_rate_limited(self.ifx(p))
            .unwrap()
            .expect("port programmed")
    }

    /// Runs one meter row; `Err` says everything that differs.
    fn check_meter(&mut self, row: &MeterRow) -> Result<(), String> {
        use vmpath_common::{MeterBucket, SlowMeter};
        let empty_future = MeterBucket {
            credit_ns: 0,
            last_ns: u64::MAX / 2,
            limited: 0,
        };
        // Every other bucket (other classes, port B) is empty and does not
        // refill: a frame metered against the wrong one would be dropped.
        let mut meter = SlowMeter {
            class: [empty_future; vmpath_common::slow_class::COUNT],
        };
        meter.class[row.class] = MeterBucket {
            credit_ns: row.credit,
            last_ns: match row.last {
                Last::Future => u64::MAX / 2,
                Last::Never => 0,
                Last::Ago(ns) => monotonic_ns() - ns,
            },
            limited: 0,
        };
        self.preload_meter(A, meter);
        self.preload_meter(
            B,
            SlowMeter {
                class: [empty_future; vmpath_common::slow_class::COUNT],
            },
        );
        if !row.limited {
            self.dp
                .maps_mut()
                .slow_limits
                .set(A as u32 + 1, vmpath_common::SlowLimits::default(), 0)
                .unwrap();
        }
        let frame = slow_frame(row.class);
        let mut errs = Vec::new();
        for (n, &punted) in row.punted.iter().enumerate() {
            let before = self.meter_limited(A);
            let (run, d) = self
                .run_counted(A, &frame)
                .map_err(|e| format!("frame {n}: test_run failed: {e:?}"))?;
            let limited: Vec<u64> = self
                .meter_limited(A)
                .iter()
                .zip(before)
                .map(|(a, b)| a - b)
                .collect();
            let mut want_limited = vec![0; vmpath_common::slow_class::COUNT];
            if punted {
                if run.verdict != TC_ACT_REDIRECT {
                    errs.push(format!(
                        "frame {n}: verdict {}, want REDIRECT to the slow path{}",
                        run.verdict,
                        reason_hint(&d)
                    ));
                }
                if run.out != tagged(&frame, A as u16 + 1) {
                    errs.push(format!(
                        "frame {n}: not tagged for the slow path:\n{}",
                        hexdiff(&run.out, &tagged(&frame, A as u16 + 1))
                    ));
                }
                if d.drop_total() != 0 {
                    errs.push(format!("frame {n}: drops {:?}", named_drops(&d)));
                }
            } else {
                want_limited[row.class] = 1;
                if run.verdict != TC_ACT_SHOT {
                    errs.push(format!("frame {n}: verdict {}, want SHOT", run.verdict));
                }
                if d.single_drop() != Some(SLOWPATH_RATE_LIMITED) || d.port(A).drops != 1 {
                    errs.push(format!(
                        "frame {n}: drops {:?} (A: {}), want one slowpath_rate_limited on A",
                        named_drops(&d),
                        d.port(A).drops
                    ));
                }
            }
            if limited != want_limited {
                errs.push(format!(
                    "frame {n}: limited per class moved by {limited:?}, want {want_limited:?}"
                ));
            }
        }
        if !row.limited {
            self.program_slow_path();
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("\n    "))
        }
    }
}

/// The slow-path token bucket: under, at and over the rate, refill, one
/// bucket per class, and no limit where none is programmed.
#[test]
#[rustfmt::skip]
fn slow_path_meter() {
    use vmpath_common::slow_class::{DHCP4, DHCP6, RS};
    const T: bool = true;
    const F: bool = false;
    let c = METER_COST;
    let rows = vec![
        meter_row("full bucket: the burst passes, then drops", DHCP4, 3 * c, Last::Future, &[T, T, T, F, F]),
        meter_row("under the rate: credit for two", DHCP4, 2 * c, Last::Future, &[T, T, F]),
        meter_row("at the rate: credit for exactly one", DHCP4, c, Last::Future, &[T, F]),
        meter_row("over the rate: one nanosecond short", DHCP4, c - 1, Last::Future, &[F, F]),
        meter_row("empty bucket", DHCP4, 0, Last::Future, &[F]),
        meter_row("refill: never metered is a full bucket", DHCP4, 0, Last::Never, &[T, T, T, F]),
        meter_row("refill: one and a half frames' time", DHCP4, 0, Last::Ago(3 * c / 2), &[T, F]),
        meter_row("refill: half a frame's time plus half a frame's credit", DHCP4, c / 2, Last::Ago(c / 2), &[T, F]),
        meter_row("refill stops at the burst", DHCP4, 0, Last::Ago(6 * c), &[T, T, T, F]),
        meter_row("dhcp6: its own bucket, at the rate", DHCP6, c, Last::Future, &[T, F]),
        meter_row("dhcp6: refill", DHCP6, 0, Last::Ago(2 * c), &[T, T, F]),
        meter_row("router solicitation: its own bucket, at the rate", RS, c, Last::Future, &[T, F]),
        meter_row("router solicitation: over the rate", RS, 0, Last::Future, &[F]),
        MeterRow { limited: false, ..meter_row("no limits programmed: unlimited", DHCP4, 0, Last::Future, &[T, T, T, T, T, T]) },
    ];
    in_fresh_netns(|| {
        // The buckets are per CPU: every row runs on one CPU, as one
        // flooding sender's frames do.
        pin_to_current_cpu();
        let mut fx = Fixture::new();
        fx.program_slow_path();
        let failures: Vec<String> = rows
            .iter()
            .filter_map(|r| fx.check_meter(r).err().map(|e| format!("  {}:\n    {e}", r.name)))
            .collect();
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            rows.len(),
            failures.join("\n")
        );
    });
}

/// Live migration, the target side (`vm_migrate`): on a pending target
/// port, only the VM itself resuming cuts over. The target pod's own
/// kernel, whose interface has the VM's MAC from its CNI ADD on, speaks
/// from that MAC too (IPv6 DAD from ::, MLD reports, router solicitations)
/// while the VM still runs on the source: those are dropped as
/// `migration_not_resumed` and move nothing. QEMU's RARP, the guest's
/// GARP, unsolicited NA, DHCP and ordinary traffic cut over.
#[test]
fn migration_target_cuts_over_only_when_the_vm_resumes() {
    use vmpath_common::{ENDPOINT_REMOTE, PORT_F_PENDING};
    /// The node the VM runs on before the move.
    const SOURCE_NODE: Ip4 = [192, 0, 2, 1];
    let pending = FILTERS | PORT_F_PENDING;
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1).octets();
    let all_routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2).octets();
    let mld_routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 0x16).octets();
    let snm = solicited_node(A.ll6());
    // MLDv2 report: one record, "change to exclude" (4) for the
    // solicited-node group, as a kernel joining it sends.
    let mld2_record = [&[4, 0, 0, 0][..], &snm].concat();
    let mld2 = |src: Ip6| {
        icmp6_with(
            A.mac(),
            multicast_mac6(mld_routers),
            v6_router_alert(src, mld_routers, 1),
            icmp6_raw(143, 0, [0, 0, 0, 1]),
            &mld2_record,
        )
    };
    let mld1 = icmp6_with(
        A.mac(),
        multicast_mac6(snm),
        v6_router_alert(A.ll6(), snm, 1),
        icmp6_raw(131, 0, [0, 0, 0, 0]),
        &[&[0u8; 4][..], &snm].concat(),
    );
    let rs = |src: Ip6, options: &[u8]| {
        icmp6(
            A.mac(),
            multicast_mac6(all_routers),
            src,
            all_routers,
            255,
            icmp6_raw(133, 0, [0; 4]),
            options,
        )
    };
    let rarp_body = [
        &[0, 1, 8, 0, 6, 4, 0, 3][..],
        &A.mac(),
        &[0; 4],
        &A.mac(),
        &[0; 4],
    ]
    .concat();
    let unsolicited_na = icmp6(
        A.mac(),
        multicast_mac6(all_nodes),
        A.ll6(),
        all_nodes,
        255,
        Icmpv6Type::NeighborAdvertisement(etherparse::icmpv6::NeighborAdvertisementHeader {
            router: false,
            solicited: false,
            r#override: true,
        }),
        &[&A.ip6()[..], &lla_option(2, A.mac())].concat(),
    );
    // (row, None: cuts over / Some(reason): dropped so, nothing moves)
    #[rustfmt::skip]
    let rows: Vec<(&str, Vec<u8>, Option<u32>)> = vec![
        // The pod's kernel bringing its interface up.
        ("DAD neighbour solicitation from :: -> no cut-over",
            ns(A.mac(), multicast_mac6(snm), UNSPEC6, snm, 255, A.ll6(), &[]),
            Some(MIGRATION_NOT_RESUMED)),
        ("MLDv2 report from :: (hop-by-hop router alert) -> no cut-over",
            mld2(UNSPEC6), Some(MIGRATION_NOT_RESUMED)),
        ("MLDv2 report from the link-local address -> no cut-over",
            mld2(A.ll6()), Some(MIGRATION_NOT_RESUMED)),
        ("MLDv1 report from the link-local address -> no cut-over",
            mld1, Some(MIGRATION_NOT_RESUMED)),
        ("router solicitation from :: -> no cut-over",
            rs(UNSPEC6, &[]), Some(MIGRATION_NOT_RESUMED)),
        ("router solicitation from the link-local address -> no cut-over",
            rs(A.ll6(), &lla_option(1, A.mac())), Some(MIGRATION_NOT_RESUMED)),
        ("ICMP echo from 0.0.0.0 -> no cut-over",
            icmp4(A.mac(), B.mac(), ipv4_hdr([0; 4], B.ip4(), 64), echo4_request(1, 1), b"x"),
            Some(MIGRATION_NOT_RESUMED)),
        ("another MAC on the pending port -> no cut-over",
            udp4(B.mac(), C.mac(), ipv4_hdr(B.ip4(), C.ip4(), 64), 1000, 2000, b"x"),
            Some(MIGRATION_PENDING)),
        // The VM resuming.
        ("QEMU's RARP announcement -> cut-over",
            eth(A.mac(), BROADCAST, ETH_P_RARP, &rarp_body), None),
        ("the guest's gratuitous ARP -> cut-over",
            frames::arp(A.mac(), BROADCAST, ArpOperation::REQUEST, A.mac(), A.ip4(), [0; 6], A.ip4()),
            None),
        ("the guest's unsolicited neighbour advertisement -> cut-over",
            unsolicited_na, None),
        ("the guest's DHCP discover from 0.0.0.0 -> cut-over",
            udp4(A.mac(), BROADCAST, ipv4_hdr([0; 4], [255; 4], 64), 68, 67, &[0; 240]), None),
        ("the guest's ordinary UDP -> cut-over",
            udp4(A.mac(), B.mac(), ipv4_hdr(A.ip4(), B.ip4(), 64), 1000, 2000, b"x"), None),
        ("the guest's IPv6 echo from its link-local address -> cut-over",
            icmp6(A.mac(), B.mac(), A.ll6(), B.ll6(), 64, echo6_request(1, 1), b"x"), None),
    ];
    in_fresh_netns(|| {
        let mut fx = Fixture::new();
        let ifx = fx.ifx(A);
        let key = EndpointKey {
            network: A.net(),
            mac: A.mac(),
            _pad: [0; 2],
        };
        let at_source = Endpoint {
            kind: ENDPOINT_REMOTE,
            node_ip4: SOURCE_NODE,
            ..Default::default()
        };
        let mut failures = Vec::new();
        for (name, frame, dropped) in &rows {
            // A migration pending on A: the VM still runs on the source node.
            fx.set_flags(A, pending);
            let maps = fx.dp.maps_mut();
            maps.endpoints.insert(key, at_source, 0).unwrap();
            let _ = maps.migrated.remove(&ifx);
            let (run, d) = fx.run_counted(A, frame).expect("test_run");
            let maps = fx.dp.maps();
            let ep = maps.endpoints.get(&key, 0).unwrap();
            let flags = maps.ports.get(&ifx, 0).unwrap().flags;
            let event = maps.migrated.get(&ifx, 0).ok();
            let mut errs = Vec::new();
            match dropped {
                Some(reason) => {
                    if run.verdict != TC_ACT_SHOT {
                        errs.push(format!("verdict {}, want SHOT (2)", run.verdict));
                    }
                    if d.single_drop() != Some(*reason) {
                        errs.push(format!(
                            "drops {:?}, want exactly one {}",
                            named_drops(&d),
                            drop_reason::NAMES[*reason as usize]
                        ));
                    }
                    if d.port(A).drops != 1 || !d.tx_ports().is_empty() {
                        errs.push(format!(
                            "A drops {}, tx on {:?}: want one drop, nothing sent",
                            d.port(A).drops,
                            d.tx_ports()
                        ));
                    }
                    if ep != at_source || flags & PORT_F_PENDING == 0 || event.is_some() {
                        errs.push(format!(
                            "cut over: endpoint {ep:?}, port flags {flags:#x}, event {event:?}"
                        ));
                    }
                }
                None => {
                    if ep.kind != ENDPOINT_LOCAL || ep.ifindex != ifx {
                        errs.push(format!("endpoint {ep:?}, want local on A ({ifx})"));
                    }
                    if flags & PORT_F_PENDING != 0 {
                        errs.push(format!("port flags {flags:#x} still pending"));
                    }
                    if event.is_none_or(|e| e.mac != A.mac() || e.network != A.net()) {
                        errs.push(format!("vmp_migrated {event:?}, want A's MAC"));
                    }
                    let migration = d.drops[MIGRATION_PENDING as usize]
                        + d.drops[MIGRATION_NOT_RESUMED as usize];
                    if migration != 0 || d.port(A).rx_packets != 1 {
                        errs.push(format!(
                            "drops {:?}, A rx {}: want no migration drop, the frame counted once",
                            named_drops(&d),
                            d.port(A).rx_packets
                        ));
                    }
                }
            }
            if !errs.is_empty() {
                failures.push(format!("  {name}:\n    {}", errs.join("\n    ")));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            rows.len(),
            failures.join("\n")
        );
    });
}
