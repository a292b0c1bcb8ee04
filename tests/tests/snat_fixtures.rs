//! Fixture tests for the north-south programs through BPF_PROG_TEST_RUN:
//! `vm_egress` (tail-called from `vm_port` for frames to the gateway MAC)
//! translating TCP, UDP and ICMP echo to the node's SNAT address, and
//! `uplink` translating the replies back; every output frame's IPv4 and
//! transport checksums are verified from scratch. Port exhaustion, the
//! per-VM quota and the routed source check are counted under their drop
//! reasons. The IPv6 rows do the same with the node's IPv6 SNAT address
//! (TCP, UDP, ICMPv6 echo, ICMPv6 errors, inbound flows' replies).
//!
//! test_run hands the program an skb without checksum offload state
//! (CHECKSUM_NONE), so these cover the full-checksum branch of the
//! helpers; frames with CHECKSUM_PARTIAL as a veth delivers them are
//! covered by the live TCP/UDP runs in `north_south.rs`.
//!
//! The uplink's XDP program (`uplink_xdp`) gets the same routed ingress and
//! SNAT return frames: what it takes it must rewrite byte for byte as the
//! tc program does; what it must not take it passes untouched.
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^snat_fixtures::/)'

use aya::{
    maps::lpm_trie::Key,
    programs::{TestRun, TestRunOptions},
};
use etherparse::PacketBuilder;
use vmpath::apply::dataplane::Dataplane;
use vmpath_common::{
    NAT_ST_CLOSING, NAT_ST_OPEN, NET_F_GW4, NET_F_ROUTED, NET_F_SNAT, NatKey, NetworkInfo,
    PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PortInfo, PortStats, SnatConfig,
    Subnet4, default_gateway_mac, drop_reason, prog_names,
};
use vmpath_tests::{
    prog_fixture::{
        BpffsRoot, SKB_CTX_LEN, TC_ACT_REDIRECT, TC_ACT_SHOT, ifindex_of, in_fresh_netns,
        run_classifier, skb_ctx,
    },
    run,
};

const NET: u32 = 600;
const GW_MAC: [u8; 6] = default_gateway_mac(NET);
const VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0c, 1];
const VM_IP: [u8; 4] = [10, 30, 0, 21];
const NODE_IP: [u8; 4] = [192, 0, 2, 1];
const EXT_IP: [u8; 4] = [198, 51, 100, 10];
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const TOR_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
/// The node's IPv6 SNAT address, 2001:db8:2::1.
const NODE6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const PORT_MIN: u16 = 40000;
const PORT_MAX: u16 = 40003;

struct Fx {
    dp: Dataplane,
    port: u32,
    uplink: u32,
    _root: BpffsRoot,
}

impl Fx {
    /// A VM port and an uplink with a route to the external host; the
    /// data path loaded with one SNAT network.
    fn new(egress_flag: u16) -> Fx {
        run(&[
            "ip", "link", "add", "sf-port", "type", "veth", "peer", "name", "sf-vm",
        ]);
        run(&[
            "ip", "link", "add", "sf-up", "type", "veth", "peer", "name", "sf-tor",
        ]);
        for i in ["sf-port", "sf-vm", "sf-up", "sf-tor", "lo"] {
            run(&["ip", "link", "set", i, "up"]);
        }
        run(&["ip", "addr", "add", "192.0.2.1/24", "dev", "sf-up"]);
        run(&["ip", "link", "set", "sf-up", "address", "02:00:00:00:00:01"]);
        run(&[
            "ip",
            "neigh",
            "add",
            "192.0.2.2",
            "lladdr",
            "02:00:00:00:00:02",
            "dev",
            "sf-up",
        ]);
        run(&["ip", "route", "add", "198.51.100.0/24", "via", "192.0.2.2"]);
        run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        // IPv6: the node's address on the uplink (NODE6), the ToR as the
        // next hop to the external host's prefix.
        run(&[
            "ip",
            "-6",
            "addr",
            "add",
            "2001:db8:2::1/64",
            "dev",
            "sf-up",
            "nodad",
        ]);
        run(&[
            "ip",
            "-6",
            "neigh",
            "add",
            "2001:db8:2::2",
            "lladdr",
            "02:00:00:00:00:02",
            "dev",
            "sf-up",
        ]);
        run(&[
            "ip",
            "-6",
            "route",
            "add",
            "2001:db8::/64",
            "via",
            "2001:db8:2::2",
        ]);
        run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        let root = BpffsRoot::new("snatfx");
        let mut dp = Dataplane::open(&root.0).expect("loading the data path");
        let port = ifindex_of("sf-port");
        let uplink = ifindex_of("sf-up");
        let maps = dp.maps_mut();
        maps.ports
            .insert(
                port,
                PortInfo {
                    port_id: 1,
                    network: NET,
                    mac: VM_MAC,
                    flags: PORT_F_MAC_FILTER | PORT_F_MAC_KNOWN | PORT_F_IP_FILTER,
                    gw_mac: GW_MAC,
                    _pad: 0,
                    ip4: VM_IP,
                    ip6: [0; 16],
                },
                0,
            )
            .unwrap();
        let nr = aya::util::nr_cpus().unwrap();
        maps.port_stats
            .set(
                1,
                aya::maps::PerCpuValues::try_from(vec![PortStats::default(); nr]).unwrap(),
                0,
            )
            .unwrap();
        maps.networks
            .insert(
                NET,
                NetworkInfo {
                    gw_mac: GW_MAC,
                    flags: NET_F_GW4 | egress_flag,
                    gw_ip4: [10, 30, 0, 1],
                    mtu: 1500,
                    ..Default::default()
                },
                0,
            )
            .unwrap();
        maps.subnets4
            .insert(
                &Key::new(
                    32 + 16,
                    Subnet4 {
                        network: NET.to_be_bytes(),
                        addr: [10, 30, 0, 0],
                    },
                ),
                1,
                0,
            )
            .unwrap();
        maps.snat_config
            .set(
                0,
                SnatConfig {
                    addr4: NODE_IP,
                    uplink,
                    port_min: PORT_MIN,
                    port_max: PORT_MAX,
                    quota: 100,
                    tcp_timeout: 7440,
                    tcp_closing_timeout: 240,
                    udp_timeout: 300,
                    icmp_timeout: 60,
                    addr6: NODE6,
                },
                0,
            )
            .unwrap();
        maps.subnets6
            .insert(
                &Key::new(
                    32 + 64,
                    vmpath_common::Subnet6 {
                        network: NET.to_be_bytes(),
                        addr: [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    },
                ),
                1,
                0,
            )
            .unwrap();
        Fx {
            dp,
            port,
            uplink,
            _root: root,
        }
    }

    fn run(&self, prog: &str, ifindex: u32, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run_with(prog, &skb_ctx(ifindex), frame)
    }

    /// test_run of `prog` with the `__sk_buff` `ctx`.
    fn run_with(&self, prog: &str, ctx: &[u8; SKB_CTX_LEN], frame: &[u8]) -> (u32, Vec<u8>) {
        run_classifier(&self.dp, prog, ctx, frame)
    }

    fn egress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::VM_EGRESS, self.port, frame)
    }

    fn ingress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::UPLINK, self.uplink, frame)
    }

    fn drops(&self, reason: u32) -> u64 {
        self.dp.maps().drop_counts().unwrap()[reason as usize]
    }
}

// --- frames ------------------------------------------------------------------

fn udp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath snat fixture")
        .unwrap();
    v
}

fn tcp(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .tcp(sp, dp, 1000, 64240)
        .syn()
        .write(&mut v, b"")
        .unwrap();
    v
}

fn echo(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    id: u16,
    reply: bool,
) -> Vec<u8> {
    let mut v = Vec::new();
    let b = PacketBuilder::ethernet2(src_mac, dst_mac).ipv4(src, dst, 64);
    if reply {
        b.icmpv4_echo_reply(id, 1)
            .write(&mut v, b"pingpong")
            .unwrap();
    } else {
        b.icmpv4_echo_request(id, 1)
            .write(&mut v, b"pingpong")
            .unwrap();
    }
    v
}

// --- checks ------------------------------------------------------------------

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for c in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The fields of an IPv4 or IPv6 frame, after checking every checksum in
/// it.
struct Seen {
    src: Vec<u8>,
    dst: Vec<u8>,
    /// TTL or hop limit.
    ttl: u8,
    sport: u16,
    dport: u16,
    eth_src: [u8; 6],
    eth_dst: [u8; 6],
}

fn checked(frame: &[u8]) -> Seen {
    if frame[12..14] == [0x86, 0xdd] {
        return checked6(frame);
    }
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    assert_eq!(fold(sum16(&ip[..ihl], 0)), 0xffff, "IPv4 header checksum");
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let l4 = &ip[ihl..total];
    let proto = ip[9];
    if proto == 1 {
        assert_eq!(fold(sum16(l4, 0)), 0xffff, "ICMP checksum");
    } else {
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&ip[12..20]);
        pseudo.extend_from_slice(&[0, proto]);
        pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        assert_eq!(
            fold(sum16(l4, sum16(&pseudo, 0))),
            0xffff,
            "transport checksum (proto {proto})"
        );
    }
    let (sport, dport) = if proto == 1 {
        let id = u16::from_be_bytes([l4[4], l4[5]]);
        (id, id)
    } else {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    };
    Seen {
        src: ip[12..16].to_vec(),
        dst: ip[16..20].to_vec(),
        ttl: ip[8],
        sport,
        dport,
        eth_src: frame[6..12].try_into().unwrap(),
        eth_dst: frame[0..6].try_into().unwrap(),
    }
}

/// `checked` for IPv6: the transport checksum, ICMPv6's too, over the
/// pseudo header, past hop-by-hop, destination options and fragment
/// headers (a first fragment here carries its whole datagram).
fn checked6(frame: &[u8]) -> Seen {
    let ip = &frame[14..];
    let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let (mut proto, mut off) = (ip[6], 40);
    while matches!(proto, 0 | 60 | 44) {
        let len = if proto == 44 {
            8
        } else {
            (usize::from(ip[off + 1]) + 1) * 8
        };
        proto = ip[off];
        off += len;
    }
    let l4 = &ip[off..40 + plen];
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[8..40]);
    pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, proto]);
    assert_eq!(
        fold(sum16(l4, sum16(&pseudo, 0))),
        0xffff,
        "IPv6 transport checksum (next header {proto})"
    );
    let (sport, dport) = if proto == 58 {
        let id = u16::from_be_bytes([l4[4], l4[5]]);
        (id, id)
    } else {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    };
    Seen {
        src: ip[8..24].to_vec(),
        dst: ip[24..40].to_vec(),
        ttl: ip[7],
        sport,
        dport,
        eth_src: frame[6..12].try_into().unwrap(),
        eth_dst: frame[0..6].try_into().unwrap(),
    }
}

/// One flow out and its reply back: translated both ways, checksums right.
fn round_trip(fx: &Fx, out_frame: Vec<u8>, reply: impl Fn(u16) -> Vec<u8>, vm_port: u16) -> u16 {
    let (verdict, out) = fx.egress(&out_frame);
    assert_eq!(verdict, TC_ACT_REDIRECT, "egress verdict");
    let seen = checked(&out);
    assert_eq!(seen.src, NODE_IP, "translated source");
    assert_eq!(seen.dst, EXT_IP);
    assert_eq!(seen.ttl, 63, "TTL decremented");
    assert!(
        (PORT_MIN..=PORT_MAX).contains(&seen.sport),
        "port {} outside the range",
        seen.sport
    );
    assert_eq!(seen.eth_src, UPLINK_MAC, "next hop by fib lookup");
    assert_eq!(seen.eth_dst, TOR_MAC);

    let (verdict, back) = fx.ingress(&reply(seen.sport));
    assert_eq!(
        verdict, TC_ACT_REDIRECT,
        "return traffic redirected into the VM"
    );
    let b = checked(&back);
    assert_eq!(b.dst, VM_IP, "reverse-translated destination");
    assert_eq!(b.src, EXT_IP);
    assert_eq!(b.dport, vm_port, "the VM's own port back");
    assert_eq!(b.eth_src, GW_MAC);
    assert_eq!(b.eth_dst, VM_MAC);
    seen.sport
}

#[test]
fn snat_translates_udp_tcp_icmp_both_ways_with_valid_checksums() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let p1 = round_trip(
            &fx,
            udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53),
            |p| udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, p),
            5555,
        );
        // The same flow keeps its port.
        let (_, again) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53));
        assert_eq!(checked(&again).sport, p1, "an existing flow keeps its port");
        round_trip(
            &fx,
            tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443),
            |p| tcp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 443, p),
            33000,
        );
        round_trip(
            &fx,
            echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 0x1234, false),
            |p| echo(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, p, true),
            0x1234,
        );
        // Traffic to the node address that is no reply passes to the host.
        let (verdict, _) = fx.ingress(&udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, 9));
        assert_eq!(verdict, 0, "unknown flow: TC_ACT_OK to the host stack");
    });
}

/// The egress path trusts an outbound flow's pair of entries between
/// refreshes and checks the return entry when a refresh is due; a FIN
/// still moves both entries to closing.
#[test]
fn snat_flows_are_confirmed_when_a_refresh_is_due_and_fin_closes_both_entries() {
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT);
        let frame = udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53);
        let (_, out) = fx.egress(&frame);
        let p1 = checked(&out).sport;
        let key = NatKey::new(VM_IP, EXT_IP, 5555, 53, 17);
        let rkey = NatKey::reply(EXT_IP, NODE_IP, 53, p1, 17);

        // The return entry went to another flow (another VM's, after an
        // expiry), but the pair counts as confirmed just now (its last
        // refresh set ahead of the data path's clock, so no test-machine
        // stall makes it due): the next frame keeps its port unlooked.
        let mut e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
        e.last_seen = u64::MAX / 2;
        fx.dp.maps_mut().snat_out.insert(key, e, 0).unwrap();
        let mut other = fx.dp.maps().snat_in.get(&rkey, 0).unwrap();
        other.addr = [10, 30, 0, 99];
        fx.dp.maps_mut().snat_in.insert(rkey, other, 0).unwrap();
        let (_, out) = fx.egress(&frame);
        assert_eq!(
            checked(&out).sport,
            p1,
            "confirmed within the refresh interval"
        );

        // Once the out entry's refresh is due, the egress path looks: the
        // return entry is not the flow's any more, so it gets a new port
        // and the other flow keeps its own.
        let mut e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
        e.last_seen = 0;
        fx.dp.maps_mut().snat_out.insert(key, e, 0).unwrap();
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        let p2 = checked(&out).sport;
        assert_ne!(
            p2, p1,
            "a port whose return entry is another flow's is not reused"
        );
        assert_eq!(
            fx.dp.maps().snat_in.get(&rkey, 0).unwrap().addr,
            [10, 30, 0, 99],
            "the other flow's return entry untouched"
        );
        assert_eq!(fx.dp.maps().snat_out.get(&key, 0).unwrap().port, p2);

        // TCP: a FIN from the VM right after the SYN (no refresh due by
        // time) moves both entries to the closing timeout.
        let syn = tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443);
        let (_, out) = fx.egress(&syn);
        let tp = checked(&out).sport;
        let tkey = NatKey::new(VM_IP, EXT_IP, 33000, 443, 6);
        let trkey = NatKey::reply(EXT_IP, NODE_IP, 443, tp, 6);
        assert_eq!(
            fx.dp.maps().snat_out.get(&tkey, 0).unwrap().state,
            NAT_ST_OPEN
        );
        let mut fin = Vec::new();
        PacketBuilder::ethernet2(VM_MAC, GW_MAC)
            .ipv4(VM_IP, EXT_IP, 64)
            .tcp(33000, 443, 1001, 64240)
            .fin()
            .ack(1)
            .write(&mut fin, b"")
            .unwrap();
        let (_, out) = fx.egress(&fin);
        assert_eq!(checked(&out).sport, tp, "the FIN leaves on the flow's port");
        assert_eq!(
            fx.dp.maps().snat_out.get(&tkey, 0).unwrap().state,
            NAT_ST_CLOSING,
            "out entry closing"
        );
        assert_eq!(
            fx.dp.maps().snat_in.get(&trkey, 0).unwrap().state,
            NAT_ST_CLOSING,
            "return entry closing"
        );
    });
}

#[test]
fn snat_port_exhaustion_and_quota_are_counted() {
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT);
        // Four ports in the range: four flows to one destination fit.
        let mut ports = std::collections::BTreeSet::new();
        for sp in 0..4u16 {
            let (v, out) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 6000 + sp, 53));
            assert_eq!(v, TC_ACT_REDIRECT, "flow {sp}");
            ports.insert(checked(&out).sport);
        }
        assert_eq!(ports.len(), 4, "distinct ports {ports:?}");
        let before = fx.drops(drop_reason::SNAT_PORTS_EXHAUSTED);
        let (v, _) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 6100, 53));
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_PORTS_EXHAUSTED), before + 1);

        // A quota of 4: the VM holds 4 flows, a fifth (another destination,
        // where ports are free) is refused.
        let mut cfg = fx.dp.maps().snat_config.get(&0, 0).unwrap();
        cfg.quota = 4;
        fx.dp.maps_mut().snat_config.set(0, cfg, 0).unwrap();
        let before = fx.drops(drop_reason::SNAT_QUOTA);
        let (v, _) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, [198, 51, 100, 11], 6200, 53));
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_QUOTA), before + 1);
    });
}

#[test]
fn routed_egress_only_from_inside_the_subnets_and_unnated() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_ROUTED);
        let (v, out) = fx.egress(&tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443));
        assert_eq!(v, TC_ACT_REDIRECT);
        let seen = checked(&out);
        assert_eq!(seen.src, VM_IP, "routed: never NATed");
        assert_eq!(seen.sport, 33000);
        assert_eq!(seen.ttl, 63);
        // A source outside the subnets: with the IP filter on, `vm_port`
        // refuses it before routing (IP_SPOOF); a port without the filter
        // gets it refused here.
        let outside = tcp(VM_MAC, GW_MAC, [10, 99, 0, 5], EXT_IP, 33000, 443);
        let before = fx.drops(drop_reason::IP_SPOOF);
        let (v, _) = fx.run(prog_names::VM_PORT, fx.port, &outside);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::IP_SPOOF), before + 1);
        let mut port = fx.dp.maps().ports.get(&fx.port, 0).unwrap();
        port.flags &= !PORT_F_IP_FILTER;
        let mut fx = fx;
        fx.dp.maps_mut().ports.insert(fx.port, port, 0).unwrap();
        let before = fx.drops(drop_reason::ROUTE_SRC_OUTSIDE);
        let (v, _) = fx.egress(&outside);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::ROUTE_SRC_OUTSIDE), before + 1);
        // TTL 1: the VM hears time-exceeded from its gateway (traceroute's
        // first hop); the frame is consumed and counted.
        let before = fx.drops(drop_reason::ROUTE_TTL_EXCEEDED);
        let f = with_ttl(tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443), 1);
        let (v, out) = fx.egress(&f);
        assert_eq!(v, TC_ACT_REDIRECT, "error sent back out of the port");
        check_icmp_error4(&out, &f, (VM_MAC, GW_MAC), GW_IP, VM_IP, (11, 0), [0; 4]);
        assert_eq!(fx.drops(drop_reason::ROUTE_TTL_EXCEEDED), before + 1);
    });
}

// --- MTU: fragmentation-needed / packet-too-big ------------------------------

const SKB_GSO_SIZE: usize = 176;
const SKB_GSO_SEGS: usize = 164;
const GW_IP: [u8; 4] = [10, 30, 0, 1];
const GW6: [u8; 16] = [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const VM6: [u8; 16] = [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x21];
const EXT6: [u8; 16] = [
    0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
];

impl Fx {
    /// The network's MTU set to `mtu`, with an IPv6 gateway and subnet, and
    /// the VM's addresses routed to its port (routed ingress).
    fn with_mtu(egress_flag: u16, mtu: u16) -> Fx {
        use vmpath_common::{AddrKey, NET_F_GW6, RoutedAddr, Subnet6};
        let mut fx = Fx::new(egress_flag);
        let port = fx.port;
        let maps = fx.dp.maps_mut();
        let mut net = maps.networks.get(&NET, 0).unwrap();
        net.mtu = mtu;
        net.flags |= NET_F_GW6;
        net.gw_ip6 = GW6;
        maps.networks.insert(NET, net, 0).unwrap();
        maps.subnets6
            .insert(
                &Key::new(
                    32 + 64,
                    Subnet6 {
                        network: NET.to_be_bytes(),
                        addr: [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    },
                ),
                1,
                0,
            )
            .unwrap();
        for key in [AddrKey::v4(0, VM_IP), AddrKey::v6(0, &VM6)] {
            let r = RoutedAddr {
                ifindex: port,
                network: NET,
                vm_mac: VM_MAC,
                gw_mac: GW_MAC,
                mtu,
                port_id: 1,
            };
            maps.routed.insert(key, r, 0).unwrap();
        }
        fx
    }

    /// test_run with the skb marked GSO (`gso_size` bytes per segment).
    fn run_gso(&self, prog: &str, ifindex: u32, frame: &[u8], gso_size: u32) -> (u32, Vec<u8>) {
        let mut ctx = skb_ctx(ifindex);
        ctx[SKB_GSO_SIZE..SKB_GSO_SIZE + 4].copy_from_slice(&gso_size.to_ne_bytes());
        let segs = (frame.len() as u32).div_ceil(gso_size);
        ctx[SKB_GSO_SEGS..SKB_GSO_SEGS + 4].copy_from_slice(&segs.to_ne_bytes());
        self.run_with(prog, &ctx, frame)
    }
}

/// An IPv4 UDP frame of `ip_len` bytes (IP length), DF set or not.
fn big4(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    ip_len: usize,
    df: bool,
) -> Vec<u8> {
    let mut v = Vec::new();
    let payload = vec![0xabu8; ip_len - 28];
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .udp(5555, 53)
        .write(&mut v, &payload)
        .unwrap();
    v[14 + 6] = if df { 0x40 } else { 0 };
    v[14 + 7] = 0;
    v[14 + 10] = 0;
    v[14 + 11] = 0;
    let c = !fold(sum16(&v[14..34], 0));
    v[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    v
}

fn big_tcp4(src_mac: [u8; 6], dst_mac: [u8; 6], src: [u8; 4], dst: [u8; 4], len: usize) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .tcp(33000, 443, 1000, 64240)
        .ack(1)
        .write(&mut v, &vec![0x5au8; len])
        .unwrap();
    v[14 + 6] = 0x40;
    v[14 + 10] = 0;
    v[14 + 11] = 0;
    let c = !fold(sum16(&v[14..34], 0));
    v[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    v
}

fn big6(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 16],
    dst: [u8; 16],
    ip_len: usize,
) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv6(src, dst, 64)
        .udp(5555, 53)
        .write(&mut v, &vec![0xcdu8; ip_len - 48])
        .unwrap();
    v
}

/// Checks an ICMP fragmentation-needed frame exactly: addressing, every
/// field, both checksums and the quote (the offending IP header + 8 bytes,
/// as it was sent).
fn check_frag_needed(
    out: &[u8],
    orig: &[u8],
    eth: ([u8; 6], [u8; 6]),
    from: [u8; 4],
    to: [u8; 4],
    mtu: u16,
) {
    let m = mtu.to_be_bytes();
    check_icmp_error4(out, orig, eth, from, to, (3, 4), [0, 0, m[0], m[1]]);
}

/// Checks an ICMP error frame exactly: addressing, every field, both
/// checksums, type and code, the header's second word and the quote (the
/// offending IP header + 8 bytes, as it was sent).
fn check_icmp_error4(
    out: &[u8],
    orig: &[u8],
    eth: ([u8; 6], [u8; 6]),
    from: [u8; 4],
    to: [u8; 4],
    type_code: (u8, u8),
    rest: [u8; 4],
) {
    assert_eq!(out.len(), 14 + 20 + 8 + 28, "frame length: {out:02x?}");
    assert_eq!(&out[0..6], &eth.0, "Ethernet destination");
    assert_eq!(&out[6..12], &eth.1, "Ethernet source");
    assert_eq!(&out[12..14], &[0x08, 0x00]);
    let ip = &out[14..34];
    assert_eq!(ip[0], 0x45);
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 56, "IP total length");
    assert_eq!(ip[8], 64, "TTL");
    assert_eq!(ip[9], 1, "protocol ICMP");
    assert_eq!(&ip[12..16], &from, "from the gateway");
    assert_eq!(&ip[16..20], &to, "to the sender");
    assert_eq!(fold(sum16(ip, 0)), 0xffff, "IPv4 header checksum");
    let icmp = &out[34..];
    assert_eq!((icmp[0], icmp[1]), type_code, "type and code");
    assert_eq!(&icmp[4..8], &rest, "second word (next-hop MTU or unused)");
    assert_eq!(fold(sum16(icmp, 0)), 0xffff, "ICMP checksum");
    assert_eq!(&icmp[8..], &orig[14..14 + 28], "quote: IP header + 8 bytes");
}

#[test]
fn mtu_routed_and_snat_egress_answer_frag_needed_ipv4() {
    for flag in [NET_F_ROUTED, NET_F_SNAT] {
        in_fresh_netns(|| {
            let fx = Fx::with_mtu(flag, 1400);
            // At the MTU: forwarded.
            let (v, out) = fx.egress(&big4(VM_MAC, GW_MAC, VM_IP, EXT_IP, 1400, true));
            assert_eq!(v, TC_ACT_REDIRECT);
            assert_eq!(out.len(), 14 + 1400, "forwarded whole");
            // Over it with DF: the VM hears fragmentation-needed from its gateway.
            let before = fx.drops(drop_reason::MTU_EXCEEDED);
            let f = big4(VM_MAC, GW_MAC, VM_IP, EXT_IP, 1450, true);
            let (v, out) = fx.egress(&f);
            assert_eq!(v, TC_ACT_REDIRECT, "error sent back out of the port");
            check_frag_needed(&out, &f, (VM_MAC, GW_MAC), GW_IP, VM_IP, 1400);
            assert_eq!(fx.drops(drop_reason::MTU_EXCEEDED), before + 1);
            // Without DF: dropped and counted (the data path never fragments).
            let before = fx.drops(drop_reason::MTU_EXCEEDED_NO_DF);
            let (v, _) = fx.egress(&big4(VM_MAC, GW_MAC, VM_IP, EXT_IP, 1450, false));
            assert_eq!(v, TC_ACT_SHOT);
            assert_eq!(fx.drops(drop_reason::MTU_EXCEEDED_NO_DF), before + 1);
        });
    }
}

#[test]
fn mtu_gso_packets_are_judged_by_their_segment_size() {
    in_fresh_netns(|| {
        let fx = Fx::with_mtu(NET_F_ROUTED, 1400);
        // 3000 bytes of TCP in 1348-byte segments: each segment is 20 + 20
        // + 1348 = 1388 bytes on the wire, under the MTU: forwarded whole.
        let f = big_tcp4(VM_MAC, GW_MAC, VM_IP, EXT_IP, 3000);
        let (v, out) = fx.run_gso(prog_names::VM_EGRESS, fx.port, &f, 1348);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(out.len(), f.len(), "GSO packet forwarded, not answered");
        // 1448-byte segments (a 1500-MTU sender): 1488 > 1400.
        let (v, out) = fx.run_gso(prog_names::VM_EGRESS, fx.port, &f, 1448);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(out[34], 3, "ICMP destination unreachable");
        assert_eq!(u16::from_be_bytes([out[40], out[41]]), 1400);
        assert_eq!(&out[42..42 + 20], &f[14..34], "quoted IP header");
    });
}

#[test]
fn mtu_routed_ingress_answers_the_external_sender_from_the_gateway() {
    in_fresh_netns(|| {
        let fx = Fx::with_mtu(NET_F_ROUTED, 1400);
        let f = big4(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 1450, true);
        let (v, out) = fx.ingress(&f);
        assert_eq!(v, TC_ACT_REDIRECT, "error sent back out of the uplink");
        check_frag_needed(&out, &f, (TOR_MAC, UPLINK_MAC), GW_IP, EXT_IP, 1400);
        // At the MTU it goes on into the VM.
        let (v, out) = fx.ingress(&big4(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 1400, true));
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(&out[0..6], &VM_MAC);
    });
}

/// The ICMPv6 message `icmp` after the IPv6 header `ip` has a valid
/// checksum (pseudo header included).
fn check_icmp6_sum(ip: &[u8], icmp: &[u8]) {
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[8..40]);
    pseudo.extend_from_slice(&(icmp.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 58]);
    assert_eq!(
        fold(sum16(icmp, sum16(&pseudo, 0))),
        0xffff,
        "ICMPv6 checksum"
    );
}

#[test]
fn mtu_ipv6_packet_too_big_both_ways() {
    in_fresh_netns(|| {
        let fx = Fx::with_mtu(NET_F_ROUTED, 1400);
        for (f, eth, from, to, ingress) in [
            (
                big6(VM_MAC, GW_MAC, VM6, EXT6, 1450),
                (VM_MAC, GW_MAC),
                GW6,
                VM6,
                false,
            ),
            (
                big6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 1450),
                (TOR_MAC, UPLINK_MAC),
                GW6,
                EXT6,
                true,
            ),
        ] {
            let before = fx.drops(drop_reason::MTU_EXCEEDED);
            let (v, out) = if ingress {
                fx.ingress(&f)
            } else {
                fx.egress(&f)
            };
            assert_eq!(v, TC_ACT_REDIRECT);
            assert_eq!(fx.drops(drop_reason::MTU_EXCEEDED), before + 1);
            assert_eq!(out.len(), 14 + 40 + 8 + 48, "frame length");
            assert_eq!(&out[0..6], &eth.0);
            assert_eq!(&out[6..12], &eth.1);
            assert_eq!(&out[12..14], &[0x86, 0xdd]);
            let ip = &out[14..54];
            assert_eq!(ip[0] >> 4, 6);
            assert_eq!(u16::from_be_bytes([ip[4], ip[5]]), 56, "payload length");
            assert_eq!(ip[6], 58, "next header ICMPv6");
            assert_eq!(ip[7], 64, "hop limit");
            assert_eq!(&ip[8..24], &from, "from the gateway");
            assert_eq!(&ip[24..40], &to, "to the sender");
            let icmp = &out[54..];
            assert_eq!((icmp[0], icmp[1]), (2, 0), "packet too big");
            assert_eq!(
                u32::from_be_bytes([icmp[4], icmp[5], icmp[6], icmp[7]]),
                1400
            );
            check_icmp6_sum(ip, icmp);
            assert_eq!(&icmp[8..], &f[14..14 + 48], "quote: IPv6 header + 8 bytes");
        }
    });
}

// --- SNAT: ICMP errors back to the VM -----------------------------------------

/// An ICMP error of `icmp_type`/`code` from `from` to the node, quoting
/// the IP header + 8 bytes of the translated frame `sent`.
fn icmp_error(from: [u8; 4], icmp_type: u8, code: u8, sent: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(TOR_MAC, UPLINK_MAC)
        .ipv4(from, NODE_IP, 64)
        .icmpv4_raw(icmp_type, code, [0; 4])
        .write(&mut v, &sent[14..14 + 28])
        .unwrap();
    v
}

/// The error translated back: outer to the VM, quoted source the VM's
/// address and port, every checksum right, the quoted transport header
/// exactly as the VM sent it.
fn check_error_back(back: &[u8], vm_frame: &[u8], from: [u8; 4], icmp_type: u8) {
    let b = checked(back);
    assert_eq!(b.dst, VM_IP, "outer destination back to the VM");
    assert_eq!(b.src, from, "outer source untouched");
    assert_eq!(b.ttl, 63);
    assert_eq!(b.eth_src, GW_MAC);
    assert_eq!(b.eth_dst, VM_MAC);
    let icmp = &back[34..];
    assert_eq!(icmp[0], icmp_type);
    let inner = &icmp[8..28];
    assert_eq!(fold(sum16(inner, 0)), 0xffff, "quoted IPv4 header checksum");
    assert_eq!(&inner[12..16], &VM_IP, "quoted source: the VM");
    assert_eq!(&inner[16..20], &EXT_IP);
    assert_eq!(
        &icmp[28..36],
        &vm_frame[34..42],
        "quoted transport header as the VM sent it (ports, checksum)"
    );
}

#[test]
fn snat_icmp_errors_are_translated_back_to_the_vm() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let router = [192, 0, 2, 2];
        // UDP to a closed port: port unreachable from the external host.
        let vm_udp = udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 9);
        let (v, sent) = fx.egress(&vm_udp);
        assert_eq!(v, TC_ACT_REDIRECT);
        let (v, back) = fx.ingress(&icmp_error(EXT_IP, 3, 3, &sent));
        assert_eq!(v, TC_ACT_REDIRECT, "port unreachable delivered to the VM");
        check_error_back(&back, &vm_udp, EXT_IP, 3);

        // TCP: host unreachable from a router on the way.
        let vm_tcp = tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443);
        let (_, sent) = fx.egress(&vm_tcp);
        let (v, back) = fx.ingress(&icmp_error(router, 3, 1, &sent));
        assert_eq!(v, TC_ACT_REDIRECT);
        check_error_back(&back, &vm_tcp, router, 3);

        // ICMP echo (traceroute by ping): TTL exceeded from a router.
        let vm_echo = echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 0x4242, false);
        let (_, sent) = fx.egress(&vm_echo);
        let (v, back) = fx.ingress(&icmp_error(router, 11, 0, &sent));
        assert_eq!(v, TC_ACT_REDIRECT);
        check_error_back(&back, &vm_echo, router, 11);

        // An error about a flow this node never translated goes to the host.
        let mut stranger = sent.clone();
        stranger[14 + 20 + 4] ^= 0xff;
        let (v, _) = fx.ingress(&icmp_error(router, 11, 0, &stranger));
        assert_eq!(v, 0, "unknown flow: TC_ACT_OK to the host stack");
    });
}

/// An `__sk_buff` for a frame arriving on `ifindex`.
/// `frame` (IPv4) with its TTL set to `ttl` and the header checksum fixed.
fn with_ttl(mut frame: Vec<u8>, ttl: u8) -> Vec<u8> {
    frame[14 + 8] = ttl;
    frame[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let c = !fold(sum16(&frame[14..34], 0));
    frame[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    frame
}

#[test]
fn ttl_expiry_is_answered_with_time_exceeded_but_never_about_an_icmp_error() {
    in_fresh_netns(|| {
        // With the routed addresses, the IPv6 gateway (and MTU 1500).
        let fx = Fx::with_mtu(NET_F_ROUTED, 1500);
        // An echo request (ping -t 1) is answered like any datagram.
        let f = with_ttl(echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 7, false), 1);
        let (v, out) = fx.egress(&f);
        assert_eq!(v, TC_ACT_REDIRECT);
        check_icmp_error4(&out, &f, (VM_MAC, GW_MAC), GW_IP, VM_IP, (11, 0), [0; 4]);
        // An ICMP error whose TTL runs out is dropped, never answered.
        let before = fx.drops(drop_reason::ROUTE_TTL_EXCEEDED);
        let sent = udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5000, 53);
        let mut err = Vec::new();
        PacketBuilder::ethernet2(VM_MAC, GW_MAC)
            .ipv4(VM_IP, EXT_IP, 1)
            .icmpv4_raw(3, 3, [0; 4])
            .write(&mut err, &sent[14..14 + 28])
            .unwrap();
        let (v, _) = fx.egress(&err);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::ROUTE_TTL_EXCEEDED), before + 1);
        // Routed ingress whose TTL runs out here: the external sender hears
        // it from the VM network's gateway, out of the uplink.
        let f = with_ttl(udp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 5000, 53), 1);
        let (v, out) = fx.ingress(&f);
        assert_eq!(v, TC_ACT_REDIRECT);
        check_icmp_error4(
            &out,
            &f,
            (TOR_MAC, UPLINK_MAC),
            GW_IP,
            EXT_IP,
            (11, 0),
            [0; 4],
        );
        // IPv6, hop limit 1: ICMPv6 time-exceeded (type 3) from the gateway.
        let mut f = big6(VM_MAC, GW_MAC, VM6, EXT6, 100);
        f[14 + 7] = 1;
        let (v, out) = fx.egress(&f);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(&out[0..6], &VM_MAC);
        assert_eq!(&out[14 + 8..14 + 24], &GW6, "from the gateway");
        assert_eq!(&out[14 + 24..14 + 40], &VM6, "to the sender");
        let icmp = &out[54..];
        assert_eq!((icmp[0], icmp[1]), (3, 0), "ICMPv6 time exceeded");
        check_icmp6_sum(&out[14..54], icmp);
        assert_eq!(&icmp[8..], &f[14..14 + 48], "quote: IPv6 header + 8 bytes");
    });
}

// --- SNAT egress with routed ingress on one network ---------------------------

/// A VM on another node (node `REMOTE_NODE`), reached by relaying over
/// the overlay.
const REMOTE_VM_IP: [u8; 4] = [10, 30, 0, 22];
const REMOTE_VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0c, 2];
const REMOTE_NODE: [u8; 4] = [192, 0, 2, 9];
/// A VM whose routed entry follows `vmp_endpoints` and whose endpoint is
/// local (a migration's source before the cut-over, its target after).
const MOVING_VM_IP: [u8; 4] = [10, 30, 0, 23];
const MOVING_VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0c, 3];
/// A VM whose routed entry follows `vmp_endpoints` but whose place is not
/// known here.
const LOST_VM_IP: [u8; 4] = [10, 30, 0, 24];
const LOST_VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0c, 4];
/// A VM placed only by VXLAN source learning (its MAC detected on its node).
const LEARNED_VM_IP: [u8; 4] = [10, 30, 0, 25];
const LEARNED_VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0c, 5];
const LEARNED_NODE: [u8; 4] = [192, 0, 2, 10];

/// The addresses rows of one family see.
struct Addrs {
    vm: &'static [u8],
    node: &'static [u8],
    ext: &'static [u8],
}

const V4: Addrs = Addrs {
    vm: &VM_IP,
    node: &NODE_IP,
    ext: &EXT_IP,
};

/// Which program a row runs: `vm_egress` on the VM's port (a frame the VM
/// sends to its gateway) or `uplink` (a frame from the fabric).
#[derive(Clone, Copy, Debug)]
enum Hook {
    Egress,
    Uplink,
}

/// What a row must see.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Out of the uplink with the VM's own address and port (never NATed).
    Unnated { sport: u16 },
    /// Out of the uplink translated to the node's SNAT address; the port
    /// is remembered under the given slot for later rows.
    Snated { slot: usize },
    /// Into a VM on this node, un-NATed (from the gateway MAC to the VM's),
    /// to `dst`:`dport`.
    Delivered {
        dst: &'static [u8],
        dport: u16,
        mac: [u8; 6],
    },
    /// Onto the overlay: one frame more sent to other nodes, rewritten for
    /// the VM (from the gateway MAC to `mac`, TTL 63).
    Relayed { mac: [u8; 6] },
    /// A later fragment (no transport header) out of the uplink with the
    /// node's SNAT address as its source, hop limit (TTL) 63.
    LaterSnated,
    /// Dropped and counted under the reason.
    Dropped(u32),
    /// Passed to the host stack untouched (TC_ACT_OK).
    Host,
}

struct Row {
    name: &'static str,
    hook: Hook,
    /// The frame; `Some(slot)` to send to the SNAT port a `Snated` row
    /// remembered (the reply of a translated flow).
    frame: fn(u16) -> Vec<u8>,
    reply_to: Option<usize>,
    expect: Expect,
}

fn row(name: &'static str, hook: Hook, frame: fn(u16) -> Vec<u8>, expect: Expect) -> Row {
    Row {
        name,
        hook,
        frame,
        reply_to: None,
        expect,
    }
}

/// The frame an external host sends to the VM's own address.
fn ext_tcp_to_vm(_: u16) -> Vec<u8> {
    tcp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 5000, 22)
}

impl Fx {
    /// A SNAT network with routed ingress: the VM's address routed to its
    /// port with the inbound flag; a VM on another node (endpoint remote),
    /// one whose entry follows a local endpoint, one whose place is not
    /// known, one placed by VXLAN source learning; the overlay up.
    fn with_ingress() -> Fx {
        use vmpath_common::{
            AddrKey, ENDPOINT_LOCAL, ENDPOINT_REMOTE, Endpoint, EndpointKey, NET_F_INGRESS,
            OverlayConfig, ROUTED_F_INBOUND, RemoteLearned, RoutedAddr,
        };
        let mut fx = Fx::new(NET_F_SNAT | NET_F_INGRESS);
        let (port, uplink) = (fx.port, fx.uplink);
        // test_run does not execute redirects: any device stands in for
        // the vxlan device.
        fx.dp
            .set_overlay(OverlayConfig {
                vxlan_ifindex: uplink,
                local_ip4: NODE_IP,
                ..Default::default()
            })
            .unwrap();
        let maps = fx.dp.maps_mut();
        let routed = |ifindex: u32, mac: [u8; 6], port_id: u16| RoutedAddr {
            ifindex,
            network: NET,
            vm_mac: mac,
            gw_mac: GW_MAC,
            mtu: 1500,
            port_id: port_id | ROUTED_F_INBOUND,
        };
        for (ip, r) in [
            (VM_IP, routed(port, VM_MAC, 1)),
            (REMOTE_VM_IP, routed(0, REMOTE_VM_MAC, 0)),
            (MOVING_VM_IP, routed(0, MOVING_VM_MAC, 0)),
            (LOST_VM_IP, routed(0, LOST_VM_MAC, 0)),
            (LEARNED_VM_IP, routed(0, LEARNED_VM_MAC, 0)),
        ] {
            maps.routed.insert(AddrKey::v4(0, ip), r, 0).unwrap();
        }
        let ep = |kind, ifindex, node_ip4, port_id| Endpoint {
            kind,
            ifindex,
            node_ip4,
            migrate_to: [0; 4],
            port_id,
            identity: 0,
        };
        maps.endpoints
            .insert(
                EndpointKey::new(NET, REMOTE_VM_MAC),
                ep(ENDPOINT_REMOTE, 0, REMOTE_NODE, 0),
                0,
            )
            .unwrap();
        maps.endpoints
            .insert(
                EndpointKey::new(NET, MOVING_VM_MAC),
                ep(ENDPOINT_LOCAL, port, [0; 4], 1),
                0,
            )
            .unwrap();
        maps.remote_learned
            .insert(
                EndpointKey::new(NET, LEARNED_VM_MAC),
                RemoteLearned {
                    node_ip4: LEARNED_NODE,
                    _pad: 0,
                    last_seen_ns: 0,
                },
                0,
            )
            .unwrap();
        fx
    }

    /// Runs the rows in order (they share flow state) and reports every
    /// row that failed.
    fn run_rows(&self, rows: &[Row]) {
        self.run_rows_in(rows, &V4)
    }

    /// `run_rows` with the addresses of one family.
    fn run_rows_in(&self, rows: &[Row], a: &Addrs) {
        let mut ports = [0u16; 4];
        let mut failures = Vec::new();
        for r in rows {
            let port = r.reply_to.map_or(0, |s| ports[s]);
            let frame = (r.frame)(port);
            let drops_before = self.dp.maps().drop_counts().unwrap();
            let tx_before = self.dp.maps().overlay_stats().unwrap().tx_packets;
            let (verdict, out) = match r.hook {
                Hook::Egress => self.egress(&frame),
                Hook::Uplink => self.ingress(&frame),
            };
            let drops_after = self.dp.maps().drop_counts().unwrap();
            let relayed = self.dp.maps().overlay_stats().unwrap().tx_packets - tx_before;
            let mut errs = Vec::new();
            let new_drops: Vec<String> = drops_after
                .iter()
                .zip(&drops_before)
                .enumerate()
                .filter(|(_, (a, b))| a > b)
                .map(|(i, _)| drop_reason::NAMES[i].to_string())
                .collect();
            match r.expect {
                Expect::Dropped(reason) => {
                    if verdict != TC_ACT_SHOT {
                        errs.push(format!("verdict {verdict}, want TC_ACT_SHOT"));
                    }
                    if new_drops != [drop_reason::NAMES[reason as usize]] {
                        errs.push(format!(
                            "drops counted {new_drops:?}, want [{}]",
                            drop_reason::NAMES[reason as usize]
                        ));
                    }
                }
                Expect::LaterSnated => {
                    if verdict != TC_ACT_REDIRECT {
                        errs.push(format!(
                            "verdict {verdict}, want TC_ACT_REDIRECT (drops {new_drops:?})"
                        ));
                    } else {
                        let (src, ttl) = if out[12..14] == [0x86, 0xdd] {
                            (&out[14 + 8..14 + 24], out[14 + 7])
                        } else {
                            (&out[14 + 12..14 + 16], out[14 + 8])
                        };
                        if src != a.node || ttl != 63 {
                            errs.push(format!(
                                "left from {src:?} hop limit {ttl}, want the SNAT address, 63"
                            ));
                        }
                        if (&out[6..12], &out[0..6]) != (&UPLINK_MAC[..], &TOR_MAC[..]) {
                            errs.push("not routed to the next hop".into());
                        }
                    }
                }
                Expect::Host => {
                    if verdict != 0 || !new_drops.is_empty() {
                        errs.push(format!(
                            "verdict {verdict} (drops {new_drops:?}), want TC_ACT_OK"
                        ));
                    }
                }
                expect => {
                    if verdict != TC_ACT_REDIRECT {
                        errs.push(format!(
                            "verdict {verdict}, want TC_ACT_REDIRECT (drops {new_drops:?})"
                        ));
                    } else {
                        let seen = checked(&out);
                        let want_relay = matches!(expect, Expect::Relayed { .. }) as u64;
                        if relayed != want_relay {
                            errs.push(format!(
                                "{relayed} frames onto the overlay, want {want_relay}"
                            ));
                        }
                        match expect {
                            Expect::Unnated { sport } => {
                                if seen.src != a.vm || seen.sport != sport {
                                    errs.push(format!(
                                        "left as {:?}:{}, want the VM's own {:?}:{sport}",
                                        seen.src, seen.sport, a.vm
                                    ));
                                }
                                if (seen.eth_src, seen.eth_dst) != (UPLINK_MAC, TOR_MAC) {
                                    errs.push("not routed to the next hop".into());
                                }
                            }
                            Expect::Snated { slot } => {
                                if seen.src != a.node
                                    || !(PORT_MIN..=PORT_MAX).contains(&seen.sport)
                                {
                                    errs.push(format!(
                                        "left as {:?}:{}, want the SNAT address and a port of the range",
                                        seen.src, seen.sport
                                    ));
                                }
                                ports[slot] = seen.sport;
                            }
                            Expect::Delivered { dst, dport, mac } => {
                                if seen.dst != dst || seen.dport != dport || seen.src != a.ext {
                                    errs.push(format!(
                                        "delivered to {:?}:{} from {:?}, want {dst:?}:{dport} from the external host",
                                        seen.dst, seen.dport, seen.src
                                    ));
                                }
                                if (seen.eth_src, seen.eth_dst) != (GW_MAC, mac) {
                                    errs.push("MACs not gateway -> VM".into());
                                }
                            }
                            Expect::Relayed { mac } => {
                                if (seen.eth_src, seen.eth_dst, seen.ttl) != (GW_MAC, mac, 63) {
                                    errs.push(format!(
                                        "relayed as {:02x?} -> {:02x?} TTL {}, want gateway -> VM, TTL 63",
                                        seen.eth_src, seen.eth_dst, seen.ttl
                                    ));
                                }
                            }
                            Expect::Dropped(_) | Expect::Host | Expect::LaterSnated => {
                                unreachable!()
                            }
                        }
                    }
                }
            }
            if !errs.is_empty() {
                failures.push(format!("  {}:\n    {}", r.name, errs.join("\n    ")));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} rows failed:\n{}",
            failures.len(),
            rows.len(),
            failures.join("\n")
        );
    }
}

#[test]
fn snat_with_routed_ingress_replies_of_inbound_flows_leave_unnated() {
    use Hook::*;
    let rows = [
        row(
            "external host opens TCP to the VM's own address -> delivered un-NATed",
            Uplink,
            ext_tcp_to_vm,
            Expect::Delivered {
                dst: &VM_IP,
                dport: 22,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's reply of that inbound flow -> leaves with the VM's address, not SNATed",
            Egress,
            |_| tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 22, 5000),
            Expect::Unnated { sport: 22 },
        ),
        row(
            "external host pings the VM -> delivered",
            Uplink,
            |_| echo(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 0x77, false),
            Expect::Delivered {
                dst: &VM_IP,
                dport: 0x77,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's echo reply -> un-NATed",
            Egress,
            |_| echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 0x77, true),
            Expect::Unnated { sport: 0x77 },
        ),
        row(
            "an echo reply nobody asked for -> dropped",
            Egress,
            |_| echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 0x78, true),
            Expect::Dropped(drop_reason::SNAT_UNSUPPORTED),
        ),
        row(
            "external host sends UDP to the VM -> delivered",
            Uplink,
            |_| udp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 7000, 53),
            Expect::Delivered {
                dst: &VM_IP,
                dport: 53,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's UDP answer -> un-NATed",
            Egress,
            |_| udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 53, 7000),
            Expect::Unnated { sport: 53 },
        ),
        row(
            "the VM opens TCP to the outside -> SNATed",
            Egress,
            |_| tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443),
            Expect::Snated { slot: 0 },
        ),
        Row {
            reply_to: Some(0),
            ..row(
                "the reply of that outbound flow -> de-NATed into the VM",
                Uplink,
                |p| tcp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 443, p),
                Expect::Delivered {
                    dst: &VM_IP,
                    dport: 33000,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "a frame from outside with the outbound flow's tuple, to the VM's own address -> delivered",
            Uplink,
            |_| tcp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 443, 33000),
            Expect::Delivered {
                dst: &VM_IP,
                dport: 33000,
                mac: VM_MAC,
            },
        ),
        row(
            "... but the outbound flow keeps its translation",
            Egress,
            |_| tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443),
            Expect::Snated { slot: 1 },
        ),
        row(
            "routed ingress for a VM on another node -> relayed over the overlay",
            Uplink,
            |_| udp(TOR_MAC, UPLINK_MAC, EXT_IP, REMOTE_VM_IP, 7000, 53),
            Expect::Relayed { mac: REMOTE_VM_MAC },
        ),
        row(
            "routed ingress for a VM whose endpoint is local now -> delivered here",
            Uplink,
            |_| udp(TOR_MAC, UPLINK_MAC, EXT_IP, MOVING_VM_IP, 7000, 53),
            Expect::Delivered {
                dst: &MOVING_VM_IP,
                dport: 53,
                mac: MOVING_VM_MAC,
            },
        ),
        row(
            "routed ingress for a VM placed by source learning -> relayed to that node",
            Uplink,
            |_| udp(TOR_MAC, UPLINK_MAC, EXT_IP, LEARNED_VM_IP, 7000, 53),
            Expect::Relayed {
                mac: LEARNED_VM_MAC,
            },
        ),
        row(
            "routed ingress for a VM whose place is unknown -> dropped, never back to the fabric",
            Uplink,
            |_| udp(TOR_MAC, UPLINK_MAC, EXT_IP, LOST_VM_IP, 7000, 53),
            Expect::Dropped(drop_reason::INGRESS_NO_ENDPOINT),
        ),
    ];
    in_fresh_netns(|| {
        let fx = Fx::with_ingress();
        fx.run_rows(&rows);
        // The inbound flows are recorded under the tuples the VM's replies
        // carry; the relayed one is left to the node that delivers it.
        let keys: std::collections::BTreeSet<_> =
            fx.dp.maps().inbound.keys().filter_map(|k| k.ok()).collect();
        use vmpath_common::NatKey;
        for want in [
            NatKey::new(VM_IP, EXT_IP, 22, 5000, 6),
            NatKey::new(VM_IP, EXT_IP, 0x77, 0x77, 1),
            NatKey::new(VM_IP, EXT_IP, 53, 7000, 17),
            NatKey::new(MOVING_VM_IP, EXT_IP, 53, 7000, 17),
        ] {
            assert!(keys.contains(&want), "{want:?} not recorded: {keys:?}");
        }
        assert!(
            !keys.contains(&NatKey::new(REMOTE_VM_IP, EXT_IP, 53, 7000, 17)),
            "a relayed flow recorded on the relaying node"
        );
    });
}

#[test]
fn snat_without_routed_ingress_translates_every_frame() {
    use Hook::*;
    // The same frames on a plain SNAT network: the VM's address is not
    // routed to, so the "reply" is a new outbound flow and is SNATed, and
    // an echo reply never leaves.
    let rows = [
        row(
            "the VM sends with the tuple of an inbound reply -> SNATed",
            Egress,
            |_| tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 22, 5000),
            Expect::Snated { slot: 0 },
        ),
        row(
            "an echo reply -> dropped",
            Egress,
            |_| echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 0x77, true),
            Expect::Dropped(drop_reason::SNAT_UNSUPPORTED),
        ),
    ];
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        // A frame from outside to the VM's address is not routed to it:
        // it passes to the host stack, and nothing is recorded.
        let (v, _) = fx.ingress(&ext_tcp_to_vm(0));
        assert_eq!(v, 0, "TC_ACT_OK: no routed ingress");
        fx.run_rows(&rows);
        assert_eq!(fx.dp.maps().inbound.keys().count(), 0, "nothing recorded");
    });
}

#[test]
fn routed_ipv6_ingress_for_a_vm_elsewhere_is_relayed_over_the_overlay() {
    use vmpath_common::{
        AddrKey, ENDPOINT_REMOTE, Endpoint, EndpointKey, OverlayConfig, RoutedAddr,
    };
    const REMOTE6: [u8; 16] = [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x22];
    const LOST6: [u8; 16] = [0xfd, 0x30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x24];
    in_fresh_netns(|| {
        let mut fx = Fx::with_mtu(NET_F_ROUTED, 1500);
        let uplink = fx.uplink;
        fx.dp
            .set_overlay(OverlayConfig {
                vxlan_ifindex: uplink,
                local_ip4: NODE_IP,
                ..Default::default()
            })
            .unwrap();
        let maps = fx.dp.maps_mut();
        for (ip, mac) in [(REMOTE6, REMOTE_VM_MAC), (LOST6, LOST_VM_MAC)] {
            let r = RoutedAddr {
                ifindex: 0,
                network: NET,
                vm_mac: mac,
                gw_mac: GW_MAC,
                mtu: 1500,
                port_id: 0,
            };
            maps.routed.insert(AddrKey::v6(0, &ip), r, 0).unwrap();
        }
        maps.endpoints
            .insert(
                EndpointKey::new(NET, REMOTE_VM_MAC),
                Endpoint {
                    kind: ENDPOINT_REMOTE,
                    ifindex: 0,
                    node_ip4: REMOTE_NODE,
                    migrate_to: [0; 4],
                    port_id: 0,
                    identity: 0,
                },
                0,
            )
            .unwrap();
        let before = fx.dp.maps().overlay_stats().unwrap().tx_packets;
        let f = big6(TOR_MAC, UPLINK_MAC, EXT6, REMOTE6, 100);
        let (v, out) = fx.ingress(&f);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(
            fx.dp.maps().overlay_stats().unwrap().tx_packets,
            before + 1,
            "onto the overlay"
        );
        assert_eq!(&out[0..6], &REMOTE_VM_MAC, "to the VM's MAC");
        assert_eq!(&out[6..12], &GW_MAC, "from the gateway");
        assert_eq!(out[14 + 7], 63, "hop limit decremented");
        assert_eq!(&out[14 + 24..14 + 40], &REMOTE6, "destination untouched");
        // A VM whose place is not known: dropped and counted.
        let before = fx.drops(drop_reason::INGRESS_NO_ENDPOINT);
        let (v, _) = fx.ingress(&big6(TOR_MAC, UPLINK_MAC, EXT6, LOST6, 100));
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::INGRESS_NO_ENDPOINT), before + 1);
    });
}

// --- IPv6 SNAT ----------------------------------------------------------------

fn udp6(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 16],
    dst: [u8; 16],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv6(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath snat6 fixture")
        .unwrap();
    v
}

fn tcp6(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 16],
    dst: [u8; 16],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv6(src, dst, 64)
        .tcp(sp, dp, 1000, 64240)
        .syn()
        .write(&mut v, b"")
        .unwrap();
    v
}

fn echo6(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 16],
    dst: [u8; 16],
    id: u16,
    reply: bool,
) -> Vec<u8> {
    let mut v = Vec::new();
    let b = PacketBuilder::ethernet2(src_mac, dst_mac).ipv6(src, dst, 64);
    if reply {
        b.icmpv6_echo_reply(id, 1)
            .write(&mut v, b"pingpong")
            .unwrap();
    } else {
        b.icmpv6_echo_request(id, 1)
            .write(&mut v, b"pingpong")
            .unwrap();
    }
    v
}

const V6: Addrs = Addrs {
    vm: &VM6,
    node: &NODE6,
    ext: &EXT6,
};

impl Fx {
    /// `with_ingress`, and the VM's IPv6 address routed to its port with
    /// the inbound flag (a SNAT network with `advertise: {subnet: true}`).
    fn with_ingress6() -> Fx {
        use vmpath_common::{AddrKey, ROUTED_F_INBOUND, RoutedAddr};
        let mut fx = Fx::with_ingress();
        let port = fx.port;
        fx.dp
            .maps_mut()
            .routed
            .insert(
                AddrKey::v6(0, &VM6),
                RoutedAddr {
                    ifindex: port,
                    network: NET,
                    vm_mac: VM_MAC,
                    gw_mac: GW_MAC,
                    mtu: 1500,
                    port_id: 1 | ROUTED_F_INBOUND,
                },
                0,
            )
            .unwrap();
        fx
    }
}

#[test]
fn snat6_translates_outbound_flows_and_leaves_replies_of_inbound_ones_unnated() {
    use Hook::*;
    let rows = [
        row(
            "external host opens TCP to the VM's own IPv6 address -> delivered un-NATed",
            Uplink,
            |_| tcp6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 5000, 22),
            Expect::Delivered {
                dst: &VM6,
                dport: 22,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's reply of that inbound flow -> leaves with the VM's address, not SNATed",
            Egress,
            |_| tcp6(VM_MAC, GW_MAC, VM6, EXT6, 22, 5000),
            Expect::Unnated { sport: 22 },
        ),
        row(
            "external host pings the VM -> delivered",
            Uplink,
            |_| echo6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 0x66, false),
            Expect::Delivered {
                dst: &VM6,
                dport: 0x66,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's ICMPv6 echo reply -> un-NATed",
            Egress,
            |_| echo6(VM_MAC, GW_MAC, VM6, EXT6, 0x66, true),
            Expect::Unnated { sport: 0x66 },
        ),
        row(
            "an ICMPv6 echo reply nobody asked for -> dropped",
            Egress,
            |_| echo6(VM_MAC, GW_MAC, VM6, EXT6, 0x67, true),
            Expect::Dropped(drop_reason::SNAT_UNSUPPORTED),
        ),
        row(
            "external host sends UDP to the VM -> delivered",
            Uplink,
            |_| udp6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 7000, 53),
            Expect::Delivered {
                dst: &VM6,
                dport: 53,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's UDP answer -> un-NATed",
            Egress,
            |_| udp6(VM_MAC, GW_MAC, VM6, EXT6, 53, 7000),
            Expect::Unnated { sport: 53 },
        ),
        row(
            "external host sends UDP with a destination options header -> delivered",
            Uplink,
            |_| {
                with_ext6(
                    &udp6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 7100, 54),
                    &[DSTOPTS],
                    0,
                )
            },
            Expect::Delivered {
                dst: &VM6,
                dport: 54,
                mac: VM_MAC,
            },
        ),
        row(
            "the VM's answer, its header too -> un-NATed (the flow was recorded past it)",
            Egress,
            |_| with_ext6(&udp6(VM_MAC, GW_MAC, VM6, EXT6, 54, 7100), &[DSTOPTS], 0),
            Expect::Unnated { sport: 54 },
        ),
        row(
            "the VM opens TCP to the outside -> SNATed to the node's IPv6 address",
            Egress,
            |_| tcp6(VM_MAC, GW_MAC, VM6, EXT6, 33000, 443),
            Expect::Snated { slot: 0 },
        ),
        Row {
            reply_to: Some(0),
            ..row(
                "the reply of that outbound flow -> de-NATed into the VM",
                Uplink,
                |p| tcp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 443, p),
                Expect::Delivered {
                    dst: &VM6,
                    dport: 33000,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "the VM's next segment of that flow -> the same translation",
            Egress,
            |_| tcp6(VM_MAC, GW_MAC, VM6, EXT6, 33000, 443),
            Expect::Snated { slot: 3 },
        ),
        row(
            "the VM sends UDP out -> SNATed",
            Egress,
            |_| udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53),
            Expect::Snated { slot: 1 },
        ),
        Row {
            reply_to: Some(1),
            ..row(
                "its answer -> de-NATed into the VM",
                Uplink,
                |p| udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, p),
                Expect::Delivered {
                    dst: &VM6,
                    dport: 5555,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "the VM pings out (ICMPv6 echo) -> SNATed identifier",
            Egress,
            |_| echo6(VM_MAC, GW_MAC, VM6, EXT6, 0x4242, false),
            Expect::Snated { slot: 2 },
        ),
        Row {
            reply_to: Some(2),
            ..row(
                "the echo reply -> de-NATed into the VM with its identifier",
                Uplink,
                |p| echo6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, p, true),
                Expect::Delivered {
                    dst: &VM6,
                    dport: 0x4242,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "a reply to the node's address for no flow -> to the host stack",
            Uplink,
            |_| udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 9999, 40003),
            Expect::Host,
        ),
    ];
    in_fresh_netns(|| {
        let fx = Fx::with_ingress6();
        fx.run_rows_in(&rows, &V6);
        let keys: std::collections::BTreeSet<_> = fx
            .dp
            .maps()
            .inbound6
            .keys()
            .filter_map(|k| k.ok())
            .collect();
        use vmpath_common::NatKey6;
        for want in [
            NatKey6::new(&VM6, &EXT6, 22, 5000, 6),
            NatKey6::new(&VM6, &EXT6, 0x66, 0x66, 58),
            NatKey6::new(&VM6, &EXT6, 53, 7000, 17),
            NatKey6::new(&VM6, &EXT6, 54, 7100, 17),
        ] {
            assert!(keys.contains(&want), "{want:?} not recorded: {keys:?}");
        }
        assert_eq!(
            fx.dp.maps().snat6_quota.get(&VM6, 0).unwrap(),
            3,
            "three outbound flows held by the VM"
        );
    });
}

#[test]
fn snat6_without_an_ipv6_snat_address_drops_and_counts() {
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT);
        let maps = fx.dp.maps_mut();
        let mut cfg = maps.snat_config.get(&0, 0).unwrap();
        cfg.addr6 = [0; 16];
        maps.snat_config.set(0, cfg, 0).unwrap();
        let before = fx.drops(drop_reason::SNAT_NO_ADDRESS);
        let (v, _) = fx.egress(&udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53));
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_NO_ADDRESS), before + 1);
    });
}

/// An ICMPv6 error from `from` to the node's SNAT address quoting the
/// first 48 bytes (IPv6 header and 8 of transport) of what left, or
/// `quote` bytes of it.
fn icmp6_error(from: [u8; 16], icmp_type: u8, code: u8, sent: &[u8], quote: usize) -> Vec<u8> {
    let mut v = Vec::new();
    // Packet too big carries the MTU in the rest of the header.
    let rest = if icmp_type == 2 {
        1280u32.to_be_bytes()
    } else {
        [0; 4]
    };
    let quoted = &sent[14..(14 + quote).min(sent.len())];
    let mut icmp = vec![icmp_type, code, 0, 0];
    icmp.extend_from_slice(&rest);
    icmp.extend_from_slice(quoted);
    let mut ip = vec![0x60, 0, 0, 0];
    ip.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    ip.extend_from_slice(&[58, 64]);
    ip.extend_from_slice(&from);
    ip.extend_from_slice(&NODE6);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&ip[8..40]);
    pseudo.extend_from_slice(&(icmp.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 58]);
    let c = !fold(sum16(&icmp, sum16(&pseudo, 0)));
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    v.extend_from_slice(&UPLINK_MAC);
    v.extend_from_slice(&TOR_MAC);
    v.extend_from_slice(&[0x86, 0xdd]);
    v.extend_from_slice(&ip);
    v.extend_from_slice(&icmp);
    v
}

/// The error translated back: outer to the VM, ICMPv6 checksum right, the
/// quoted packet as the VM sent it (source address, ports or identifier,
/// transport checksum) but for the hop limit the node decremented.
fn check_error6_back(back: &[u8], vm_frame: &[u8], from: [u8; 16], icmp_type: u8) {
    assert_eq!(&back[12..14], &[0x86, 0xdd]);
    let ip = &back[14..54];
    let icmp = &back[54..];
    assert_eq!(&ip[8..24], &from, "outer source untouched");
    assert_eq!(&ip[24..40], &VM6, "outer destination back to the VM");
    assert_eq!(ip[7], 63, "hop limit decremented");
    assert_eq!((&back[6..12], &back[0..6]), (&GW_MAC[..], &VM_MAC[..]));
    assert_eq!(icmp[0], icmp_type);
    check_icmp6_sum(ip, icmp);
    let inner = &icmp[8..];
    assert_eq!(&inner[8..24], &VM6, "quoted source: the VM");
    assert_eq!(&inner[24..40], &EXT6);
    let n = inner.len() - 40;
    assert_eq!(
        &inner[40..],
        &vm_frame[54..54 + n],
        "quoted transport header as the VM sent it (ports, checksum)"
    );
}

#[test]
fn snat6_icmpv6_errors_are_translated_back_to_the_vm() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let router: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
        // UDP to a closed port: port unreachable (1/4) from the host.
        let vm_udp = udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 9);
        let (v, sent) = fx.egress(&vm_udp);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(&sent[14 + 8..14 + 24], &NODE6, "left SNATed");
        let (v, back) = fx.ingress(&icmp6_error(EXT6, 1, 4, &sent, 48));
        assert_eq!(v, TC_ACT_REDIRECT, "port unreachable delivered to the VM");
        check_error6_back(&back, &vm_udp, EXT6, 1);

        // TCP: packet too big from a router, quoting the whole segment
        // (its checksum included).
        let vm_tcp = tcp6(VM_MAC, GW_MAC, VM6, EXT6, 33000, 443);
        let (_, sent) = fx.egress(&vm_tcp);
        let (v, back) = fx.ingress(&icmp6_error(router, 2, 0, &sent, 60));
        assert_eq!(v, TC_ACT_REDIRECT, "packet too big delivered to the VM");
        check_error6_back(&back, &vm_tcp, router, 2);
        assert_eq!(&back[54 + 4..54 + 8], &1280u32.to_be_bytes(), "MTU kept");

        // ICMPv6 echo: hop limit exceeded (3) from a router.
        let vm_echo = echo6(VM_MAC, GW_MAC, VM6, EXT6, 0x4242, false);
        let (_, sent) = fx.egress(&vm_echo);
        let (v, back) = fx.ingress(&icmp6_error(router, 3, 0, &sent, 48));
        assert_eq!(v, TC_ACT_REDIRECT);
        check_error6_back(&back, &vm_echo, router, 3);

        // An error about a flow this node never translated goes to the host.
        let mut stranger = sent.clone();
        stranger[14 + 40 + 4] ^= 0xff;
        let (v, _) = fx.ingress(&icmp6_error(router, 3, 0, &stranger, 48));
        assert_eq!(v, 0, "unknown flow: TC_ACT_OK to the host stack");
    });
}

// --- IPv6 extension headers on SNAT -----------------------------------------

const HOPOPTS: u8 = 0;
const FRAGMENT: u8 = 44;
const DSTOPTS: u8 = 60;

/// `frame` (Ethernet + IPv6 + transport) with `exts` inserted after the
/// fixed header, in order: hop-by-hop and destination options as 8 bytes
/// (a PadN option), a fragment header with `frag` (offset in 8-byte
/// units << 3 | M) and identification 0x1234. None is covered by the
/// transport checksum, which stays valid.
fn with_ext6(frame: &[u8], exts: &[u8], frag: u16) -> Vec<u8> {
    with_ext6_id(frame, exts, frag, 0x1234)
}

/// `with_ext6` with the fragment header's identification `id`.
fn with_ext6_id(frame: &[u8], exts: &[u8], frag: u16, id: u32) -> Vec<u8> {
    let ip = &frame[14..54];
    let upper = ip[6];
    let mut hdrs = Vec::new();
    for (i, &t) in exts.iter().enumerate() {
        let next = exts.get(i + 1).copied().unwrap_or(upper);
        if t == FRAGMENT {
            let (f, i) = (frag.to_be_bytes(), id.to_be_bytes());
            hdrs.extend_from_slice(&[next, 0, f[0], f[1], i[0], i[1], i[2], i[3]]);
        } else {
            hdrs.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
        }
    }
    let mut v = frame[..54].to_vec();
    v[14 + 6] = exts[0];
    let plen = u16::from_be_bytes([v[18], v[19]]) + hdrs.len() as u16;
    v[18..20].copy_from_slice(&plen.to_be_bytes());
    v.extend_from_slice(&hdrs);
    v.extend_from_slice(&frame[54..]);
    v
}

/// The VM's UDP 5555 -> 53 with a destination options header.
fn vm_udp6_dstopts(_: u16) -> Vec<u8> {
    with_ext6(&udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53), &[DSTOPTS], 0)
}

#[test]
fn snat6_walks_extension_headers_and_later_fragments_follow_their_first_out() {
    use Hook::*;
    let rows = [
        row(
            "the VM sends UDP with a destination options header -> SNATed, header kept",
            Egress,
            vm_udp6_dstopts,
            Expect::Snated { slot: 0 },
        ),
        Row {
            reply_to: Some(0),
            ..row(
                "its answer with a destination options header -> de-NATed into the VM",
                Uplink,
                |p| {
                    with_ext6(
                        &udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, p),
                        &[DSTOPTS],
                        0,
                    )
                },
                Expect::Delivered {
                    dst: &VM6,
                    dport: 5555,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "TCP behind hop-by-hop and destination options -> SNATed",
            Egress,
            |_| {
                with_ext6(
                    &tcp6(VM_MAC, GW_MAC, VM6, EXT6, 33000, 443),
                    &[HOPOPTS, DSTOPTS],
                    0,
                )
            },
            Expect::Snated { slot: 1 },
        ),
        row(
            "a first fragment (offset 0, more to come) -> SNATed by its ports",
            Egress,
            |_| with_ext6(&udp6(VM_MAC, GW_MAC, VM6, EXT6, 6000, 53), &[FRAGMENT], 1),
            Expect::Snated { slot: 2 },
        ),
        Row {
            reply_to: Some(2),
            ..row(
                "a first fragment of its answer -> de-NATed into the VM",
                Uplink,
                |p| {
                    with_ext6(
                        &udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, p),
                        &[FRAGMENT],
                        1,
                    )
                },
                Expect::Delivered {
                    dst: &VM6,
                    dport: 6000,
                    mac: VM_MAC,
                },
            )
        },
        row(
            "a later fragment from the VM (offset 1448) -> the first's SNAT address, routed on",
            Egress,
            |_| {
                with_ext6(
                    &udp6(VM_MAC, GW_MAC, VM6, EXT6, 6000, 53),
                    &[FRAGMENT],
                    1448 | 1,
                )
            },
            Expect::LaterSnated,
        ),
        row(
            "a later fragment from the VM whose first was not seen (another identification) -> dropped, no ports to place it by",
            Egress,
            |_| {
                with_ext6_id(
                    &udp6(VM_MAC, GW_MAC, VM6, EXT6, 6000, 53),
                    &[FRAGMENT],
                    1448,
                    0x9999,
                )
            },
            Expect::Dropped(drop_reason::SNAT_FRAGMENT),
        ),
        row(
            "a later fragment to the SNAT address whose first was not seen -> the host stack's (the node's own address)",
            Uplink,
            |_| {
                with_ext6_id(
                    &udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, 40000),
                    &[FRAGMENT],
                    1448,
                    0x9999,
                )
            },
            Expect::Host,
        ),
        row(
            "five extension headers before UDP (the walk stops at four) -> dropped",
            Egress,
            |_| {
                with_ext6(
                    &udp6(VM_MAC, GW_MAC, VM6, EXT6, 7000, 53),
                    &[HOPOPTS, DSTOPTS, DSTOPTS, DSTOPTS, DSTOPTS],
                    0,
                )
            },
            Expect::Dropped(drop_reason::EXT_HEADER_CHAIN),
        ),
        row(
            "four extension headers before UDP (the bound) -> SNATed",
            Egress,
            |_| {
                with_ext6(
                    &udp6(VM_MAC, GW_MAC, VM6, EXT6, 7001, 53),
                    &[HOPOPTS, DSTOPTS, FRAGMENT, DSTOPTS],
                    0,
                )
            },
            Expect::Snated { slot: 3 },
        ),
        row(
            "five extension headers to the SNAT address -> the host stack's",
            Uplink,
            |_| {
                with_ext6(
                    &udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, 40000),
                    &[HOPOPTS, DSTOPTS, DSTOPTS, DSTOPTS, DSTOPTS],
                    0,
                )
            },
            Expect::Host,
        ),
    ];
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        fx.run_rows_in(&rows, &V6);
    });
}

/// Katran style, byte for byte: the frame that leaves is the VM's with
/// the SNAT address and port, hop limit 63, the next hop's MACs, the
/// destination options header untouched and the checksum a fresh
/// computation gives; the reply comes back as the VM's own frame would.
#[test]
fn snat6_destination_options_frame_out_and_back_byte_for_byte() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let (v, out) = fx.egress(&vm_udp6_dstopts(0));
        assert_eq!(v, TC_ACT_REDIRECT, "egress verdict");
        let port = u16::from_be_bytes([out[62], out[63]]);
        assert!((PORT_MIN..=PORT_MAX).contains(&port), "port {port}");
        let mut want = with_ext6(
            &udp6(UPLINK_MAC, TOR_MAC, NODE6, EXT6, port, 53),
            &[DSTOPTS],
            0,
        );
        want[14 + 7] = 63;
        assert_eq!(out, want, "translated frame");

        let reply = with_ext6(
            &udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, port),
            &[DSTOPTS],
            0,
        );
        let (v, back) = fx.ingress(&reply);
        assert_eq!(v, TC_ACT_REDIRECT, "return verdict");
        let mut want = with_ext6(&udp6(GW_MAC, VM_MAC, EXT6, VM6, 53, 5555), &[DSTOPTS], 0);
        want[14 + 7] = 63;
        assert_eq!(back, want, "reverse-translated frame");
    });
}

// --- the uplink's XDP program ------------------------------------------------

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;

impl Fx {
    /// test_run of `uplink_xdp` (no `xdp_md`: it reads none).
    fn xdp(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let mut out = vec![0u8; 8192];
        let r = self
            .dp
            .xdp_program(prog_names::UPLINK_XDP)
            .unwrap()
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ..Default::default()
            })
            .expect("test_run of uplink_xdp");
        out.truncate(r.data_size_out as usize);
        (r.return_value, out)
    }

    /// The VM's port listed as one XDP_REDIRECT delivers to (the agent
    /// lists it when its device takes `ndo_xdp_xmit`).
    fn xdp_port(&mut self) {
        let port = self.port;
        self.dp.maps_mut().xdp_ports.insert(port, 1, 0).unwrap();
    }

    fn xdp_count(&self, slot: u32) -> u64 {
        self.dp.maps().uplink_xdp_counts().unwrap()[slot as usize]
    }

    fn tx_packets(&self) -> u64 {
        let v = self.dp.maps().port_stats.get(&1, 0).unwrap();
        v.iter().map(|s| s.tx_packets).sum()
    }

    /// XDP takes `frame` and rewrites it exactly as the tc program does
    /// (its counter `slot` and the port's tx counter move); returns it.
    fn xdp_takes(&self, frame: &[u8], slot: u32) -> Vec<u8> {
        let (count, tx) = (self.xdp_count(slot), self.tx_packets());
        let (v, out) = self.xdp(frame);
        assert_eq!(v, XDP_REDIRECT, "XDP verdict");
        assert_eq!(self.xdp_count(slot), count + 1, "XDP counter {slot}");
        assert_eq!(self.tx_packets(), tx + 1, "the port's tx counter");
        let (tv, tc_out) = self.ingress(frame);
        assert_eq!(tv, TC_ACT_REDIRECT, "tc verdict on the same frame");
        assert_eq!(out, tc_out, "XDP's frame differs from tc's");
        out
    }

    /// XDP passes `frame` to tc untouched (and counts it passed).
    fn xdp_passes(&self, frame: &[u8], why: &str) {
        let passed = self.xdp_count(vmpath_common::xdp_stat::PASSED);
        let (v, out) = self.xdp(frame);
        assert_eq!(v, XDP_PASS, "{why}: XDP verdict");
        assert_eq!(out, frame, "{why}: a passed frame is untouched");
        assert_eq!(
            self.xdp_count(vmpath_common::xdp_stat::PASSED),
            passed + 1,
            "{why}: counted passed"
        );
    }
}

/// `frame` (IPv4, 20-byte header) with 4 bytes of options (NOPs, end).
fn with_ip_options(frame: &[u8]) -> Vec<u8> {
    let mut v = frame[..34].to_vec();
    v.extend_from_slice(&[1, 1, 1, 0]);
    v.extend_from_slice(&frame[34..]);
    v[14] = 0x46;
    let total = u16::from_be_bytes([v[16], v[17]]) + 4;
    v[16..18].copy_from_slice(&total.to_be_bytes());
    v[24..26].copy_from_slice(&[0, 0]);
    let c = !fold(sum16(&v[14..38], 0));
    v[24..26].copy_from_slice(&c.to_be_bytes());
    v
}

#[test]
fn uplink_xdp_routed_ingress_rewritten_as_tc_does() {
    use vmpath_common::xdp_stat;
    in_fresh_netns(|| {
        let mut fx = Fx::with_mtu(NET_F_ROUTED, 1500);
        fx.xdp_port();
        for frame in [
            udp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 53, 5555),
            tcp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 443, 33000),
            big4(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 1500, true),
        ] {
            let out = fx.xdp_takes(&frame, xdp_stat::ROUTED4);
            let seen = checked(&out);
            assert_eq!((seen.dst, seen.ttl), (VM_IP.to_vec(), 63));
            assert_eq!((seen.eth_src, seen.eth_dst), (GW_MAC, VM_MAC));
        }
        let out = fx.xdp_takes(
            &udp6(TOR_MAC, UPLINK_MAC, EXT6, VM6, 53, 5555),
            xdp_stat::ROUTED6,
        );
        let seen = checked(&out);
        assert_eq!((seen.dst, seen.ttl), (VM6.to_vec(), 63));
        assert_eq!((seen.eth_src, seen.eth_dst), (GW_MAC, VM_MAC));
    });
}

#[test]
fn uplink_xdp_passes_what_tc_must_handle() {
    use vmpath_common::{AddrKey, PolicyEndpoint, ROUTED_F_INBOUND};
    in_fresh_netns(|| {
        let mut fx = Fx::with_mtu(NET_F_ROUTED, 1400);
        let frame = udp(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 53, 5555);
        fx.xdp_passes(&frame, "a port not listed for XDP delivery");
        fx.xdp_port();
        fx.xdp_passes(&with_ttl(frame.clone(), 1), "TTL 1 (time exceeded)");
        fx.xdp_passes(
            &big4(TOR_MAC, UPLINK_MAC, EXT_IP, VM_IP, 1401, true),
            "above the MTU (frag needed)",
        );
        fx.xdp_passes(&with_ip_options(&frame), "IPv4 options");
        fx.xdp_passes(
            &udp(TOR_MAC, UPLINK_MAC, EXT_IP, [10, 30, 0, 99], 53, 5555),
            "no routed entry",
        );
        let mut arp = frame.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        let (v, out) = fx.xdp(&arp);
        assert_eq!((v, out), (XDP_PASS, arp), "not IP");

        let maps = fx.dp.maps_mut();
        maps.policy_endpoints
            .set(
                1,
                PolicyEndpoint {
                    flags: 1,
                    identity: 7,
                },
                0,
            )
            .unwrap();
        fx.xdp_passes(&frame, "a port NetworkPolicy isolates");
        let maps = fx.dp.maps_mut();
        maps.policy_endpoints
            .set(1, PolicyEndpoint::default(), 0)
            .unwrap();
        maps.service_config.set(0, 1, 0).unwrap();
        fx.xdp_passes(&frame, "Services programmed");
        let maps = fx.dp.maps_mut();
        maps.service_config.set(0, 0, 0).unwrap();
        let key = AddrKey::v4(0, VM_IP);
        let mut r = maps.routed.get(&key, 0).unwrap();
        r.port_id |= ROUTED_F_INBOUND;
        maps.routed.insert(key, r, 0).unwrap();
        fx.xdp_passes(&frame, "inbound flows recorded (SNAT network)");
        let maps = fx.dp.maps_mut();
        r.port_id &= !ROUTED_F_INBOUND;
        r.ifindex = 0;
        maps.routed.insert(key, r, 0).unwrap();
        fx.xdp_passes(&frame, "a VM not (only) here");
        // Back to a plain entry: taken again.
        r.ifindex = fx.port;
        fx.dp.maps_mut().routed.insert(key, r, 0).unwrap();
        let (v, _) = fx.xdp(&frame);
        assert_eq!(
            v, XDP_REDIRECT,
            "the same frame once nothing stands in the way"
        );
    });
}

#[test]
fn uplink_xdp_snat_return_reverse_translated_as_tc_does() {
    use vmpath_common::xdp_stat;
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT);
        fx.xdp_port();
        // Flows out through tc; their replies in through XDP.
        let (v, out) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53));
        assert_eq!(v, TC_ACT_REDIRECT);
        let udp_port = checked(&out).sport;
        let (v, out) = fx.egress(&tcp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 33000, 443));
        assert_eq!(v, TC_ACT_REDIRECT);
        let tcp_port = checked(&out).sport;
        let (v, out) = fx.egress(&echo(VM_MAC, GW_MAC, VM_IP, EXT_IP, 77, false));
        assert_eq!(v, TC_ACT_REDIRECT);
        let echo_id = checked(&out).sport;

        let reply = udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, udp_port);
        let back = checked(&fx.xdp_takes(&reply, xdp_stat::SNAT4));
        assert_eq!((back.dst, back.dport), (VM_IP.to_vec(), 5555));
        assert_eq!((back.src, back.ttl), (EXT_IP.to_vec(), 63));
        assert_eq!((back.eth_src, back.eth_dst), (GW_MAC, VM_MAC));
        // UDP without a checksum stays without one.
        let mut no_sum = reply.clone();
        no_sum[40..42].copy_from_slice(&[0, 0]);
        let out = fx.xdp_takes(&no_sum, xdp_stat::SNAT4);
        assert_eq!(&out[40..42], &[0, 0], "no UDP checksum made up");
        let reply = tcp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 443, tcp_port);
        let back = checked(&fx.xdp_takes(&reply, xdp_stat::SNAT4));
        assert_eq!((back.dst, back.dport), (VM_IP.to_vec(), 33000));

        fx.xdp_passes(
            &echo(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, echo_id, true),
            "ICMP echo reply (tc translates it)",
        );
        fx.xdp_passes(
            &udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, PORT_MAX + 100),
            "no SNAT flow",
        );
        fx.xdp_passes(
            &with_ttl(udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, udp_port), 1),
            "TTL 1",
        );
        let mut frag = udp(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, udp_port);
        frag[14 + 6] |= 0x20;
        fx.xdp_passes(&frag, "a fragment");
    });
}

// --- next hops kept per flow ---------------------------------------------------

/// The data path's flow clock now (CLOCK_MONOTONIC_COARSE, as
/// `bpf_ktime_get_coarse_ns`), as `NatEntry::hop_checked` holds it.
fn hop_stamp_now() -> u32 {
    (coarse_now_ns() >> 20) as u32
}

/// The data path's flow clock now, in nanoseconds.
fn coarse_now_ns() -> u64 {
    vmpath_tests::prog_fixture::clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

/// The next hop the FIB gives for the external host: the ToR, out of the
/// uplink (ifindex `uplink`).
fn tor_hop(uplink: u32) -> vmpath_common::L2Hop {
    vmpath_common::L2Hop {
        ifindex: uplink,
        dst_mac: TOR_MAC,
        src_mac: UPLINK_MAC,
    }
}

/// Moves the ToR's IPv4 neighbour entry on the uplink to `mac`.
fn move_tor_to(mac: &str) {
    run(&[
        "ip",
        "neigh",
        "replace",
        "192.0.2.2",
        "lladdr",
        mac,
        "dev",
        "sf-up",
    ]);
}

/// Plants a fresh kept hop (`plant`, with the flow clock now) and sends
/// `frame` out until it leaves by it (`PLANTED_DST`): retried should this
/// machine stall past the keep time between the write and the run. The
/// frame as it left, or None when it never took the planted hop.
fn leaves_by_planted_hop(fx: &mut Fx, frame: &[u8], plant: impl Fn(&mut Fx, u32)) -> Option<Seen> {
    for _ in 0..5 {
        plant(fx, hop_stamp_now());
        let (v, out) = fx.egress(frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        let s = checked(&out);
        if s.eth_dst == PLANTED_DST {
            return Some(s);
        }
    }
    None
}

const PLANTED_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];
const PLANTED_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];

/// An established SNAT flow's frames leave by the next hop its outbound
/// entry keeps, with no FIB lookup, for 100 ms; then the FIB is asked
/// again and a changed neighbour is followed. A hop whose interface's MTU
/// is below the network's is never kept (the kept path skips the FIB's
/// MTU check). IPv4 and IPv6 alike.
#[test]
fn established_snat_flows_leave_by_their_kept_next_hop_and_follow_a_changed_neighbour() {
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT);
        let uplink = fx.uplink;
        let frame = udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53);
        let key = NatKey::new(VM_IP, EXT_IP, 5555, 53, 17);

        // The first frame allocates and looks up; the second keeps its hop.
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        let s = checked(&out);
        assert_eq!((s.eth_dst, s.eth_src), (TOR_MAC, UPLINK_MAC));
        assert_eq!(
            fx.dp.maps().snat_out.get(&key, 0).unwrap().hop.ifindex,
            0,
            "a new flow's entry keeps no hop yet"
        );
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(checked(&out).eth_dst, TOR_MAC);
        let e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
        assert_eq!(
            e.hop,
            tor_hop(uplink),
            "the FIB's answer kept in the flow's entry"
        );

        // A fresh kept hop is used as it is: plant one the FIB would never
        // give and the frame leaves with it (retried should this machine
        // stall past the keep time between the write and the run).
        let planted = |fx: &mut Fx, checked: u32| {
            let mut e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
            e.hop.dst_mac = PLANTED_DST;
            e.hop.src_mac = PLANTED_SRC;
            e.hop_checked = checked;
            fx.dp.maps_mut().snat_out.insert(key, e, 0).unwrap();
        };
        let s = leaves_by_planted_hop(&mut fx, &frame, planted)
            .expect("a fresh kept hop is used without a lookup");
        assert_eq!(s.src, NODE_IP, "translated as ever");
        assert_eq!(s.eth_src, PLANTED_SRC);
        assert_eq!(s.ttl, 63, "TTL decremented on the kept path too");

        // The neighbour changes; once the kept hop is older than 100 ms the
        // FIB is asked again and the flow follows it.
        move_tor_to("02:00:00:00:00:03");
        planted(&mut fx, hop_stamp_now().wrapping_sub(200));
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        let new_tor = [0x02, 0, 0, 0, 0, 0x03];
        assert_eq!(checked(&out).eth_dst, new_tor, "the changed neighbour");
        let e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
        assert_eq!(e.hop.dst_mac, new_tor, "and kept");
        assert!(
            hop_stamp_now().wrapping_sub(e.hop_checked) < 10_000,
            "renewed just now"
        );

        // An out interface with a smaller MTU than the network's: its
        // hop is looked up for every frame, never kept.
        run(&["ip", "link", "set", "sf-up", "mtu", "1400"]);
        let mut e = fx.dp.maps().snat_out.get(&key, 0).unwrap();
        e.hop = vmpath_common::L2Hop::default();
        fx.dp.maps_mut().snat_out.insert(key, e, 0).unwrap();
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(checked(&out).eth_dst, new_tor);
        assert_eq!(
            fx.dp.maps().snat_out.get(&key, 0).unwrap().hop.ifindex,
            0,
            "no hop kept past a smaller out MTU"
        );
        run(&["ip", "link", "set", "sf-up", "mtu", "1500"]);

        // IPv6: the same keeping in `vmp_snat6_out`.
        let frame6 = big6(VM_MAC, GW_MAC, VM6, EXT6, 100);
        let key6 = vmpath_common::NatKey6::new(&VM6, &EXT6, 5555, 53, 17);
        for _ in 0..2 {
            let (v, out) = fx.egress(&frame6);
            assert_eq!(v, TC_ACT_REDIRECT);
            assert_eq!(checked(&out).eth_dst, TOR_MAC);
        }
        assert_eq!(
            fx.dp.maps().snat6_out.get(&key6, 0).unwrap().hop,
            tor_hop(uplink),
            "IPv6: the FIB's answer kept in the flow's entry"
        );
        let s = leaves_by_planted_hop(&mut fx, &frame6, |fx, now| {
            let mut e = fx.dp.maps().snat6_out.get(&key6, 0).unwrap();
            e.hop.dst_mac = PLANTED_DST;
            e.hop_checked = now;
            fx.dp.maps_mut().snat6_out.insert(key6, e, 0).unwrap();
        })
        .expect("IPv6: a fresh kept hop is used without a lookup");
        assert_eq!(s.src, NODE6.to_vec());
        assert_eq!(s.ttl, 63, "hop limit decremented on the kept path");
    });
}

/// Routed egress keeps the FIB's answer per VM port, source and
/// destination (`vmp_hops4`, `vmp_hops6`) for 100 ms, as SNAT flows do in
/// their entries: a fresh kept hop is used without a lookup, a stale one
/// is renewed and follows a changed neighbour.
#[test]
fn routed_egress_leaves_by_the_kept_next_hop_and_follows_a_changed_neighbour() {
    use vmpath_common::{HopKey4, HopKey6};
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_ROUTED);
        let (port, uplink) = (fx.port, fx.uplink);
        let frame = udp(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53);
        let key = HopKey4 {
            ifindex: port,
            src: VM_IP,
            dst: EXT_IP,
            tos: 0,
            proto: 17,
            _pad: [0; 2],
        };
        let (v, out) = fx.egress(&frame);
        assert_eq!(v, TC_ACT_REDIRECT);
        let s = checked(&out);
        assert_eq!((s.src.as_slice(), s.eth_dst), (&VM_IP[..], TOR_MAC));
        let kept = fx.dp.maps().hops4.get(&key, 0).unwrap();
        assert_eq!(
            kept.hop,
            tor_hop(uplink),
            "the FIB's answer kept under the frame's lookup inputs"
        );

        let s = leaves_by_planted_hop(&mut fx, &frame, |fx, now| {
            let mut k = fx.dp.maps().hops4.get(&key, 0).unwrap();
            k.hop.dst_mac = PLANTED_DST;
            k.checked = now;
            fx.dp.maps_mut().hops4.insert(key, k, 0).unwrap();
        })
        .expect("a fresh kept hop is used without a lookup");
        assert_eq!(s.ttl, 63, "TTL decremented on the kept path");

        move_tor_to("02:00:00:00:00:03");
        let mut k = fx.dp.maps().hops4.get(&key, 0).unwrap();
        k.checked = hop_stamp_now().wrapping_sub(200);
        fx.dp.maps_mut().hops4.insert(key, k, 0).unwrap();
        let (_, out) = fx.egress(&frame);
        let new_tor = [0x02, 0, 0, 0, 0, 0x03];
        assert_eq!(checked(&out).eth_dst, new_tor, "the changed neighbour");
        assert_eq!(
            fx.dp.maps().hops4.get(&key, 0).unwrap().hop.dst_mac,
            new_tor
        );

        // Another destination is its own key, looked up on its own.
        let (_, out) = fx.egress(&udp(VM_MAC, GW_MAC, VM_IP, [198, 51, 100, 11], 5555, 53));
        assert_eq!(checked(&out).eth_dst, new_tor);
        assert_eq!(fx.dp.maps().hops4.iter().count(), 2);

        // IPv6.
        let frame6 = big6(VM_MAC, GW_MAC, VM6, EXT6, 100);
        let (v, out) = fx.egress(&frame6);
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(checked(&out).eth_dst, TOR_MAC);
        let key6 = HopKey6 {
            ifindex: port,
            src: VM6,
            dst: EXT6,
            proto: 17,
            _pad: [0; 3],
        };
        assert_eq!(
            fx.dp.maps().hops6.get(&key6, 0).unwrap().hop,
            tor_hop(uplink),
            "IPv6: kept under the frame's lookup inputs"
        );
    });
}

// --- IPv4 fragments --------------------------------------------------------------

/// Splits an IPv4 frame into two fragments, the first carrying `first_len`
/// bytes (a multiple of 8) of the IP payload; header checksums made anew.
fn fragment4(frame: &[u8], first_len: usize) -> (Vec<u8>, Vec<u8>) {
    let (eth, ip) = frame.split_at(14);
    let payload = &ip[20..];
    let part = |data: &[u8], offset8: u16, more: bool| {
        let mut h = ip[..20].to_vec();
        h[2..4].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
        h[4..6].copy_from_slice(&0x4242u16.to_be_bytes());
        let flags = offset8 | if more { 0x2000 } else { 0 };
        h[6..8].copy_from_slice(&flags.to_be_bytes());
        h[10..12].copy_from_slice(&[0, 0]);
        let c = !fold(sum16(&h, 0));
        h[10..12].copy_from_slice(&c.to_be_bytes());
        [eth, &h, data].concat()
    };
    (
        part(&payload[..first_len], 0, true),
        part(&payload[first_len..], (first_len / 8) as u16, false),
    )
}

/// Checks both fragments' IP header checksums and the transport checksum
/// of the datagram they make together; returns (source, destination,
/// source port, destination port) of the datagram.
fn reassembled4(a: &[u8], b: &[u8]) -> ([u8; 4], [u8; 4], u16, u16) {
    for f in [a, b] {
        assert_eq!(fold(sum16(&f[14..34], 0)), 0xffff, "IPv4 header checksum");
        assert_eq!(f[14 + 12..14 + 20], a[14 + 12..14 + 20], "same addresses");
    }
    let l4 = [&a[34..], &b[34..]].concat();
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&a[14 + 12..14 + 20]);
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    assert_eq!(
        fold(sum16(&l4, sum16(&pseudo, 0))),
        0xffff,
        "UDP checksum of the reassembled datagram"
    );
    (
        a[26..30].try_into().unwrap(),
        a[30..34].try_into().unwrap(),
        u16::from_be_bytes([l4[0], l4[1]]),
        u16::from_be_bytes([l4[2], l4[3]]),
    )
}

fn udp_sized(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    let payload: Vec<u8> = (0..200u16).map(|i| (i * 7) as u8).collect();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, &payload)
        .unwrap();
    v
}

/// A fragmented UDP datagram through SNAT both ways: the first fragment
/// is translated as a datagram is (address and port, the checksum fixed
/// for the whole datagram); the later one takes the same address by the
/// first's record (`vmp_snat_frags`), out and back. A later fragment whose
/// first was not seen is dropped and counted on the way out, and left to
/// the host on the way in.
#[test]
fn snat_fragments_follow_their_first_fragment_both_ways() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let frame = udp_sized(VM_MAC, GW_MAC, VM_IP, EXT_IP, 5555, 53);
        let (first, later) = fragment4(&frame, 96);

        // Out of order on the way out: no first fragment seen yet.
        let before = fx.drops(drop_reason::SNAT_FRAGMENT);
        let (v, _) = fx.egress(&later);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_FRAGMENT), before + 1);

        let (v1, out1) = fx.egress(&first);
        let (v2, out2) = fx.egress(&later);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        let (src, dst, sport, dport) = reassembled4(&out1, &out2);
        assert_eq!((src, dst, dport), (NODE_IP, EXT_IP, 53));
        assert!((PORT_MIN..=PORT_MAX).contains(&sport), "port {sport}");
        assert_eq!(out2[14 + 8], 63, "TTL decremented on the later fragment");
        assert_eq!(&out2[0..6], &TOR_MAC, "routed on to the next hop");

        // The reply, fragmented: its later fragment first goes to the host
        // (no first seen: it may be the node's own); in order, both reach
        // the VM translated back.
        let reply = udp_sized(TOR_MAC, UPLINK_MAC, EXT_IP, NODE_IP, 53, sport);
        let (rfirst, rlater) = fragment4(&reply, 96);
        let (v, _) = fx.ingress(&rlater);
        assert_eq!(v, 0, "TC_ACT_OK: to the host stack");
        let (v1, in1) = fx.ingress(&rfirst);
        let (v2, in2) = fx.ingress(&rlater);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        let (src, dst, sport, dport) = reassembled4(&in1, &in2);
        assert_eq!((src, dst, sport, dport), (EXT_IP, VM_IP, 53, 5555));
        for f in [&in1, &in2] {
            assert_eq!((&f[0..6], &f[6..12]), (&VM_MAC[..], &GW_MAC[..]));
        }
        assert_eq!(in2[14 + 8], 63);

        // Another datagram's later fragment (another IP ID) is not placed.
        let mut stray = later.clone();
        stray[14 + 4] = 0x43;
        stray[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
        let c = !fold(sum16(&stray[14..34], 0));
        stray[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
        let (v, _) = fx.egress(&stray);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_FRAGMENT), before + 2);
    });
}

/// On a network with routed ingress, the fragmented answer of a flow
/// opened from outside leaves un-NATed, its later fragment too.
#[test]
fn fragments_of_an_inbound_flows_reply_leave_unnated() {
    use vmpath_common::{InboundFlow, NET_F_INGRESS};
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT | NET_F_INGRESS);
        // The external host opened UDP 7000 -> VM:53 (as `uplink` records it).
        fx.dp
            .maps_mut()
            .inbound
            .insert(
                NatKey::new(VM_IP, EXT_IP, 53, 7000, 17),
                InboundFlow {
                    last_seen: coarse_now_ns(),
                    state: NAT_ST_OPEN,
                    _pad: [0; 7],
                },
                0,
            )
            .unwrap();
        let answer = udp_sized(VM_MAC, GW_MAC, VM_IP, EXT_IP, 53, 7000);
        let (first, later) = fragment4(&answer, 96);
        let (v1, out1) = fx.egress(&first);
        let (v2, out2) = fx.egress(&later);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        assert_eq!(
            reassembled4(&out1, &out2),
            (VM_IP, EXT_IP, 53, 7000),
            "the VM's own address and port, both fragments"
        );
        assert_eq!(out2[14 + 8], 63);
    });
}

/// IPv6 through SNAT6, fragmented on the way back (a large DNS answer):
/// the first fragment is de-NATed by its ports, its later one follows it
/// to the VM by the first's record (`vmp_snat6_frags`: source,
/// destination, identification), destination address rewritten, hop
/// limit down by one, the VM's MACs. A later fragment of another
/// datagram (another identification) is the host stack's; so is one
/// whose first came after it. A later fragment from the VM whose first
/// was not seen is dropped on the way out (`snat_fragment`).
#[test]
fn snat6_later_fragments_follow_their_first_fragment_back_to_the_vm() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        // The VM's query opens the flow.
        let (v, out) = fx.egress(&udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53));
        assert_eq!(v, TC_ACT_REDIRECT);
        let nat_port = u16::from_be_bytes([out[14 + 40], out[14 + 41]]);
        let answer = udp6(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, nat_port);
        let first = with_ext6_id(&answer, &[FRAGMENT], 1, 0xabcd);
        let later = with_ext6_id(&answer, &[FRAGMENT], 1448, 0xabcd);

        // Out of order: the later fragment first is the host's.
        let (v, _) = fx.ingress(&later);
        assert_eq!(v, 0, "TC_ACT_OK: no first seen, the host stack's");

        let (v1, in1) = fx.ingress(&first);
        assert_eq!(v1, TC_ACT_REDIRECT, "the first fragment de-NATed");
        assert_eq!(&in1[14 + 24..14 + 40], &VM6, "to the VM's address");
        let (v2, in2) = fx.ingress(&later);
        assert_eq!(v2, TC_ACT_REDIRECT, "the later fragment follows it");
        assert_eq!(&in2[14 + 24..14 + 40], &VM6, "destination back to the VM's");
        assert_eq!(&in2[14 + 8..14 + 24], &EXT6, "source untouched");
        assert_eq!(
            in2[14 + 7],
            in1[14 + 7],
            "hop limit down by one, as the first's"
        );
        assert_eq!((&in2[0..6], &in2[6..12]), (&VM_MAC[..], &GW_MAC[..]));
        assert_eq!(
            &in2[14 + 40 + 8..],
            &later[14 + 40 + 8..],
            "payload untouched"
        );

        // Another datagram's later fragment is not placed.
        let (v, _) = fx.ingress(&with_ext6_id(&answer, &[FRAGMENT], 1448, 0xabce));
        assert_eq!(v, 0, "another identification: the host stack's");
        // A later fragment from the VM without its first: dropped and counted.
        let before = fx.drops(drop_reason::SNAT_FRAGMENT);
        let vm_later = with_ext6_id(
            &udp6(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53),
            &[FRAGMENT],
            1448,
            0x77,
        );
        assert_eq!(fx.egress(&vm_later).0, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_FRAGMENT), before + 1);
    });
}

/// What the verifier processed for the north-south programs: `vm_egress`
/// (routed and SNAT egress, both families), `vm_snat6_ext` (a VM's
/// fragmented IPv6 datagrams through SNAT), `uplink` (routed ingress and
/// SNAT return), each under the kernel's 1,000,000-instruction budget
/// (they would not load otherwise; printed for the margin).
#[test]
fn the_north_south_programs_fit_the_verifier_budget() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        for name in [
            prog_names::VM_EGRESS,
            prog_names::VM_SNAT6_EXT,
            prog_names::UPLINK,
        ] {
            let n = fx
                .dp
                .classifier(name)
                .unwrap()
                .info()
                .unwrap()
                .verified_instruction_count()
                .expect("verified_insns (kernel 5.16+)");
            println!("{name}: {n} instructions verified");
            assert!(n < 1_000_000, "{name}: {n}");
        }
    });
}

// --- IPv6 fragments out ----------------------------------------------------------

/// Splits an IPv6 frame (Ethernet + fixed header + upper layer) into two
/// fragments with identification `id`, the first carrying `first_len`
/// bytes (a multiple of 8) of the upper layer, each behind a fragment
/// header.
fn fragment6(frame: &[u8], first_len: usize, id: u32) -> (Vec<u8>, Vec<u8>) {
    let (head, payload) = frame.split_at(14 + 40);
    let upper = head[14 + 6];
    let part = |data: &[u8], offset: usize, more: bool| {
        let mut h = head.to_vec();
        h[14 + 6] = FRAGMENT;
        h[18..20].copy_from_slice(&((8 + data.len()) as u16).to_be_bytes());
        let f = (offset as u16) | u16::from(more);
        let (f, i) = (f.to_be_bytes(), id.to_be_bytes());
        h.extend_from_slice(&[upper, 0, f[0], f[1], i[0], i[1], i[2], i[3]]);
        [&h[..], data].concat()
    };
    (
        part(&payload[..first_len], 0, true),
        part(&payload[first_len..], first_len, false),
    )
}

/// Checks that both fragments carry the same addresses and the UDP
/// checksum of the datagram they make together; returns (source,
/// destination, source port, destination port) of the datagram.
fn reassembled6(a: &[u8], b: &[u8]) -> ([u8; 16], [u8; 16], u16, u16) {
    assert_eq!(a[14 + 8..14 + 40], b[14 + 8..14 + 40], "same addresses");
    let l4 = [&a[14 + 48..], &b[14 + 48..]].concat();
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&a[14 + 8..14 + 40]);
    pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 17]);
    assert_eq!(
        fold(sum16(&l4, sum16(&pseudo, 0))),
        0xffff,
        "UDP checksum of the reassembled datagram"
    );
    (
        a[14 + 8..14 + 24].try_into().unwrap(),
        a[14 + 24..14 + 40].try_into().unwrap(),
        u16::from_be_bytes([l4[0], l4[1]]),
        u16::from_be_bytes([l4[2], l4[3]]),
    )
}

fn udp6_sized(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: [u8; 16],
    dst: [u8; 16],
    sp: u16,
    dp: u16,
) -> Vec<u8> {
    let mut v = Vec::new();
    let payload: Vec<u8> = (0..200u16).map(|i| (i * 7) as u8).collect();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv6(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, &payload)
        .unwrap();
    v
}

/// A fragmented IPv6 UDP datagram through SNAT both ways (IPv4's
/// `snat_fragments_follow_their_first_fragment_both_ways`): the first
/// fragment, which `vm_egress` hands to `vm_snat6_ext`, is translated by
/// its ports (the checksum fixed for the whole datagram); the later one
/// takes the same source by the first's record (`vmp_snat6_frags`,
/// `FRAG_OUT`), its hop limit down by one, routed to the next hop. A later
/// fragment whose first was not seen (out of order, or another
/// identification) is dropped and counted (`snat_fragment`). The reply's
/// fragments come back to the VM.
#[test]
fn snat6_fragments_follow_their_first_fragment_both_ways() {
    in_fresh_netns(|| {
        let fx = Fx::new(NET_F_SNAT);
        let frame = udp6_sized(VM_MAC, GW_MAC, VM6, EXT6, 5555, 53);
        let (first, later) = fragment6(&frame, 96, 0x4242);

        // Out of order on the way out: no first fragment seen yet.
        let before = fx.drops(drop_reason::SNAT_FRAGMENT);
        let (v, _) = fx.egress(&later);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_FRAGMENT), before + 1);

        let (v1, out1) = fx.egress(&first);
        let (v2, out2) = fx.egress(&later);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        let (src, dst, sport, dport) = reassembled6(&out1, &out2);
        assert_eq!((src, dst, dport), (NODE6, EXT6, 53));
        assert!((PORT_MIN..=PORT_MAX).contains(&sport), "port {sport}");
        for f in [&out1, &out2] {
            assert_eq!(f[14 + 7], 63, "hop limit decremented");
            assert_eq!((&f[0..6], &f[6..12]), (&TOR_MAC[..], &UPLINK_MAC[..]));
        }
        assert_eq!(
            &out2[14 + 40..],
            &later[14 + 40..],
            "fragment header and payload untouched"
        );

        // The reply, fragmented: both reach the VM translated back.
        let reply = udp6_sized(TOR_MAC, UPLINK_MAC, EXT6, NODE6, 53, sport);
        let (rfirst, rlater) = fragment6(&reply, 96, 0x5151);
        let (v1, in1) = fx.ingress(&rfirst);
        let (v2, in2) = fx.ingress(&rlater);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        let (src, dst, sport, dport) = reassembled6(&in1, &in2);
        assert_eq!((src, dst, sport, dport), (EXT6, VM6, 53, 5555));
        for f in [&in1, &in2] {
            assert_eq!((&f[0..6], &f[6..12]), (&VM_MAC[..], &GW_MAC[..]));
            assert_eq!(f[14 + 7], 63);
        }

        // Another datagram's later fragment (another identification) is
        // not placed.
        let (_, stray) = fragment6(&frame, 96, 0x4343);
        let (v, _) = fx.egress(&stray);
        assert_eq!(v, TC_ACT_SHOT);
        assert_eq!(fx.drops(drop_reason::SNAT_FRAGMENT), before + 2);
    });
}

/// On a network with routed ingress, the fragmented IPv6 answer of a
/// flow opened from outside leaves un-NATed, its later fragment too
/// (IPv4's `fragments_of_an_inbound_flows_reply_leave_unnated`).
#[test]
fn ipv6_fragments_of_an_inbound_flows_reply_leave_unnated() {
    use vmpath_common::{InboundFlow, NET_F_INGRESS, NatKey6};
    in_fresh_netns(|| {
        let mut fx = Fx::new(NET_F_SNAT | NET_F_INGRESS);
        // The external host opened UDP 7000 -> VM:53 (as `uplink` records it).
        fx.dp
            .maps_mut()
            .inbound6
            .insert(
                NatKey6::new(&VM6, &EXT6, 53, 7000, 17),
                InboundFlow {
                    last_seen: coarse_now_ns(),
                    state: NAT_ST_OPEN,
                    _pad: [0; 7],
                },
                0,
            )
            .unwrap();
        let answer = udp6_sized(VM_MAC, GW_MAC, VM6, EXT6, 53, 7000);
        let (first, later) = fragment6(&answer, 96, 0x6161);
        let (v1, out1) = fx.egress(&first);
        let (v2, out2) = fx.egress(&later);
        assert_eq!((v1, v2), (TC_ACT_REDIRECT, TC_ACT_REDIRECT));
        assert_eq!(
            reassembled6(&out1, &out2),
            (VM6, EXT6, 53, 7000),
            "the VM's own address and port, both fragments"
        );
        assert_eq!(out2[14 + 7], 63);
    });
}
