//! Fixture tables for the Service programs through BPF_PROG_TEST_RUN:
//! `vm_service` (ClusterIP translation on the client's port) and
//! `vm_service_in` (reverse translation right before delivery), with
//! Service ports and backends written into the maps by hand, as the
//! agent would. Every verdict path: DNAT to a backend (and on to it),
//! a flow sticking to its backend, the reverse NAT of
//! the reply, a hairpin both ways, a reject for TCP (reset) and for UDP
//! (ICMP port unreachable), frames that are no Service's business
//! passing unchanged, and the translated frame delivered by `vm_service`
//! itself past the client's egress policy (allowed, denied, to a backend
//! on another node). Checksums of every rewritten frame are verified.
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^service_fixtures::/)'

use aya::maps::lpm_trie::Key;
use etherparse::PacketBuilder;
use vmpath::apply::dataplane::Dataplane;
use vmpath_common::{
    ENDPOINT_LOCAL, ENDPOINT_REMOTE, Endpoint, EndpointKey, IdentityPrefix, NetworkInfo,
    POL_F_EGRESS, POLICY_LEN_FULL, PolicyEndpoint, PolicyRuleKey, PortInfo, PortStats,
    SERVICE_CB_DELIVER, Service, ServiceBackend, ServiceBackendKey, ServiceKey,
    default_gateway_mac, drop_reason, policy_dir, prog_names,
};
use vmpath_tests::{
    prog_fixture::{
        BpffsRoot, SKB_CB, SKB_CTX_LEN, TC_ACT_REDIRECT, TC_ACT_SHOT, in_fresh_netns,
        run_classifier, skb_ctx,
    },
    run,
};

const NET: u32 = 720;
const A_ID: u32 = 1;
const B_ID: u32 = 2;
const GW_MAC: [u8; 6] = default_gateway_mac(NET);
const A_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0e, 1];
const B_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0e, 2];
const C_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0e, 3];
const A: [u8; 4] = [10, 72, 0, 1];
const B: [u8; 4] = [10, 72, 0, 2];
const C: [u8; 4] = [10, 72, 0, 3];
/// TCP 80 and UDP 53 -> B:8080 (one backend).
const VIP: [u8; 4] = [10, 96, 7, 1];
/// TCP 80 -> B:8080, C:8080 (two backends).
const VIP2: [u8; 4] = [10, 96, 7, 2];
/// TCP 80 -> A:8080 (the client itself).
const VIP_SELF: [u8; 4] = [10, 96, 7, 3];
/// TCP 80, UDP 53: no ready backend.
const VIP_EMPTY: [u8; 4] = [10, 96, 7, 4];
/// No Service.
const ELSEWHERE: [u8; 4] = [198, 51, 100, 7];

struct Fx {
    dp: Dataplane,
    a: u32,
    _root: BpffsRoot,
}

impl Fx {
    fn new() -> Fx {
        for (x, y) in [("sf-a", "sf-va"), ("sf-b", "sf-vb"), ("sf-c", "sf-vc")] {
            run(&["ip", "link", "add", x, "type", "veth", "peer", "name", y]);
            run(&["ip", "link", "set", x, "up"]);
            run(&["ip", "link", "set", y, "up"]);
        }
        let root = BpffsRoot::new("svcfx");
        let mut dp = Dataplane::open(&root.0).expect("loading the data path");
        let ifx = |n: &str| vmpath::sys::netif::ifindex_of(n).unwrap();
        let (a, b, c) = (ifx("sf-a"), ifx("sf-b"), ifx("sf-c"));
        let maps = dp.maps_mut();
        let nr = aya::util::nr_cpus().unwrap();
        let net = NetworkInfo {
            gw_mac: GW_MAC,
            ..Default::default()
        };
        maps.networks.insert(NET, net, 0).unwrap();
        for (ifindex, id, mac, ip) in [(a, A_ID, A_MAC, A), (b, B_ID, B_MAC, B), (c, 3, C_MAC, C)] {
            let info = PortInfo {
                port_id: id,
                network: NET,
                mac,
                flags: 0,
                gw_mac: GW_MAC,
                _pad: 0,
                ip4: ip,
                ip6: [0; 16],
            };
            maps.ports.insert(ifindex, info, 0).unwrap();
            maps.port_stats
                .set(
                    id,
                    aya::maps::PerCpuValues::try_from(vec![PortStats::default(); nr]).unwrap(),
                    0,
                )
                .unwrap();
            let ep = Endpoint {
                kind: ENDPOINT_LOCAL,
                ifindex,
                port_id: id,
                ..Default::default()
            };
            maps.endpoints
                .insert(EndpointKey::new(NET, mac), ep, 0)
                .unwrap();
        }
        let backend = |addr, mac| ServiceBackend {
            addr,
            port: 8080,
            mac,
        };
        let services: [(ServiceKey, u32, Vec<ServiceBackend>); 6] = [
            (ServiceKey::new(NET, VIP, 80, 6), 1, vec![backend(B, B_MAC)]),
            (
                ServiceKey::new(NET, VIP, 53, 17),
                2,
                vec![backend(B, B_MAC)],
            ),
            (
                ServiceKey::new(NET, VIP2, 80, 6),
                3,
                vec![backend(B, B_MAC), backend(C, C_MAC)],
            ),
            (
                ServiceKey::new(NET, VIP_SELF, 80, 6),
                4,
                vec![backend(A, A_MAC)],
            ),
            (ServiceKey::new(NET, VIP_EMPTY, 80, 6), 5, vec![]),
            (ServiceKey::new(NET, VIP_EMPTY, 53, 17), 6, vec![]),
        ];
        for (key, id, backends) in &services {
            for (slot, b) in backends.iter().enumerate() {
                let k = ServiceBackendKey {
                    service: *id,
                    slot: slot as u32,
                };
                maps.service_backends.insert(k, *b, 0).unwrap();
            }
            let svc = Service {
                id: *id,
                count: backends.len() as u32,
                ..Default::default()
            };
            maps.services.insert(*key, svc, 0).unwrap();
        }
        maps.service_config
            .set(0, services.len() as u32, 0)
            .unwrap();
        Fx { dp, a, _root: root }
    }

    fn run(&self, prog: &str, ctx: &[u8; SKB_CTX_LEN], frame: &[u8]) -> (u32, Vec<u8>) {
        run_classifier(&self.dp, prog, ctx, frame)
    }

    /// `vm_service` on A's port.
    fn send(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::VM_SERVICE, &skb_ctx(self.a), frame)
    }

    /// `vm_service_in` delivering `frame` to A.
    fn deliver(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let mut ctx = skb_ctx(self.a);
        for (i, v) in [SERVICE_CB_DELIVER, A_ID, self.a].iter().enumerate() {
            ctx[SKB_CB + 4 * i..SKB_CB + 4 * i + 4].copy_from_slice(&v.to_ne_bytes());
        }
        self.run(prog_names::VM_SERVICE_IN, &ctx, frame)
    }

    fn drops(&self, reason: u32) -> u64 {
        self.dp.maps().drop_counts().unwrap()[reason as usize]
    }

    fn tx(&self, port_id: u32) -> u64 {
        self.dp
            .maps()
            .port_stats
            .get(&port_id, 0)
            .unwrap()
            .iter()
            .map(|s| s.tx_packets)
            .sum()
    }
}

const TCP_ACK: u8 = 0x10;
const TCP_RST: u8 = 0x04;

fn tcp(
    macs: ([u8; 6], [u8; 6]),
    src: [u8; 4],
    dst: [u8; 4],
    sp: u16,
    dp: u16,
    syn: bool,
) -> Vec<u8> {
    let mut v = Vec::new();
    let b = PacketBuilder::ethernet2(macs.0, macs.1)
        .ipv4(src, dst, 64)
        .tcp(sp, dp, 1000, 64240);
    let b = if syn { b.syn() } else { b.ack(1) };
    b.write(&mut v, b"").unwrap();
    v
}

fn udp(macs: ([u8; 6], [u8; 6]), src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(macs.0, macs.1)
        .ipv4(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath service fixture")
        .unwrap();
    v
}

/// From A to the gateway MAC (where a ClusterIP is routed).
const OUT: ([u8; 6], [u8; 6]) = (A_MAC, GW_MAC);

/// What a frame carries: (src MAC, dst MAC, src, dst, sport, dport,
/// protocol), with its IP and transport checksums verified.
type Seen = ([u8; 6], [u8; 6], [u8; 4], [u8; 4], u16, u16, u8);

fn seen(f: &[u8]) -> Seen {
    let mac = |o: usize| <[u8; 6]>::try_from(&f[o..o + 6]).unwrap();
    let ip4 = |o: usize| <[u8; 4]>::try_from(&f[o..o + 4]).unwrap();
    let be16 = |o: usize| u16::from_be_bytes([f[o], f[o + 1]]);
    let ihl = usize::from(f[14] & 0x0f) * 4;
    let tot = usize::from(be16(16));
    assert_eq!(sum(&f[14..14 + ihl], 0), 0xffff, "IP checksum of {f:02x?}");
    let proto = f[23];
    let l4 = &f[14 + ihl..14 + tot];
    let pseudo = sum(&f[26..34], u32::from(proto) + l4.len() as u32);
    if proto != 1 {
        assert_eq!(
            sum(l4, u32::from(pseudo)),
            0xffff,
            "transport checksum of {f:02x?}"
        );
    } else {
        assert_eq!(sum(l4, 0), 0xffff, "ICMP checksum of {f:02x?}");
    }
    (
        mac(6),
        mac(0),
        ip4(26),
        ip4(30),
        be16(14 + ihl),
        be16(16 + ihl),
        proto,
    )
}

/// The one's-complement sum of `b` folded, starting from `start`.
fn sum(b: &[u8], start: u32) -> u16 {
    let mut s = start;
    for c in b.chunks(2) {
        s += (u32::from(c[0]) << 8) | u32::from(*c.get(1).unwrap_or(&0));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

#[test]
fn a_new_flow_is_translated_to_its_backend_and_its_reply_back() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let table: Vec<(&str, Vec<u8>, Seen)> = vec![
            (
                "TCP SYN to the ClusterIP: to B:8080, switched to B's MAC",
                tcp(OUT, A, VIP, 40000, 80, true),
                (A_MAC, B_MAC, A, B, 40000, 8080, 6),
            ),
            (
                "a later segment of that flow: the same",
                tcp(OUT, A, VIP, 40000, 80, false),
                (A_MAC, B_MAC, A, B, 40000, 8080, 6),
            ),
            (
                "UDP to the ClusterIP's port 53",
                udp(OUT, A, VIP, 5353, 53),
                (A_MAC, B_MAC, A, B, 5353, 8080, 17),
            ),
        ];
        for (name, frame, want) in &table {
            let before = fx.tx(B_ID);
            let (verdict, out) = fx.send(frame);
            assert_eq!(verdict, TC_ACT_REDIRECT, "{name}");
            assert_eq!(seen(&out), *want, "{name}");
            assert_eq!(fx.tx(B_ID), before + 1, "{name}: not delivered to B");
        }
        // B's replies, delivered to A: from the ClusterIP, via the gateway.
        let replies: Vec<(&str, Vec<u8>, Seen)> = vec![
            (
                "TCP reply",
                tcp((B_MAC, A_MAC), B, A, 8080, 40000, false),
                (GW_MAC, A_MAC, VIP, A, 80, 40000, 6),
            ),
            (
                "UDP reply",
                udp((B_MAC, A_MAC), B, A, 8080, 5353),
                (GW_MAC, A_MAC, VIP, A, 53, 5353, 17),
            ),
            (
                "B talking to A on its own: untouched",
                tcp((B_MAC, A_MAC), B, A, 8080, 40001, false),
                (B_MAC, A_MAC, B, A, 8080, 40001, 6),
            ),
        ];
        for (name, frame, want) in &replies {
            let (verdict, out) = fx.deliver(frame);
            assert_eq!(verdict, TC_ACT_REDIRECT, "{name}");
            assert_eq!(seen(&out), *want, "{name}");
        }
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 0);
    });
}

#[test]
fn a_flow_sticks_to_its_backend_and_new_flows_spread() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let mut by_backend = [0u32; 2];
        for sport in 41000..41040u16 {
            let (v, out) = fx.send(&tcp(OUT, A, VIP2, sport, 80, true));
            assert_eq!(v, TC_ACT_REDIRECT);
            let first = seen(&out).3;
            by_backend[usize::from(first == C)] += 1;
            for _ in 0..3 {
                let (_, out) = fx.send(&tcp(OUT, A, VIP2, sport, 80, false));
                assert_eq!(seen(&out).3, first, "flow {sport} changed backend");
            }
        }
        // 40 random picks of two: each backend has some (p of none ~ 1e-12).
        assert!(by_backend.iter().all(|n| *n > 0), "{by_backend:?}");
    });
}

#[test]
fn a_client_reaching_itself_is_hairpinned_both_ways() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let before = fx.tx(A_ID);
        let (v, out) = fx.send(&tcp(OUT, A, VIP_SELF, 42000, 80, true));
        assert_eq!(v, TC_ACT_REDIRECT);
        // Back into A, from the ClusterIP (its own address would be a
        // martian), to its port 8080.
        assert_eq!(seen(&out), (GW_MAC, A_MAC, VIP_SELF, A, 42000, 8080, 6));
        assert_eq!(fx.tx(A_ID), before + 1, "not back into A's port");
        // A answers the ClusterIP; that comes back as from VIP:80.
        let (v, out) = fx.send(&tcp(OUT, A, VIP_SELF, 8080, 42000, false));
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(seen(&out), (GW_MAC, A_MAC, VIP_SELF, A, 80, 42000, 6));
        assert_eq!(fx.tx(A_ID), before + 2);
    });
}

#[test]
fn no_ready_backend_is_rejected_and_other_frames_pass_unchanged() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        // TCP: a reset from the ClusterIP, acknowledging the SYN.
        let syn = tcp(OUT, A, VIP_EMPTY, 43000, 80, true);
        let (v, out) = fx.send(&syn);
        assert_eq!(v, TC_ACT_REDIRECT, "the reset goes back out of A's port");
        assert_eq!(seen(&out), (GW_MAC, A_MAC, VIP_EMPTY, A, 80, 43000, 6));
        let flags = out[14 + 20 + 13];
        assert_eq!(flags, TCP_RST | TCP_ACK, "flags {flags:#x}");
        let ack = u32::from_be_bytes(out[14 + 28..14 + 32].try_into().unwrap());
        assert_eq!(ack, 1001, "ack = the SYN's seq + 1");
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 1);
        // A segment with ACK: a reset with its ack as seq, no ACK flag.
        let (v, out) = fx.send(&tcp(OUT, A, VIP_EMPTY, 43001, 80, false));
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(out[14 + 20 + 13], TCP_RST);
        assert_eq!(
            u32::from_be_bytes(out[14 + 24..14 + 28].try_into().unwrap()),
            1
        );
        // A reset is never answered.
        let mut rst = tcp(OUT, A, VIP_EMPTY, 43002, 80, false);
        rst[14 + 20 + 13] |= TCP_RST;
        // (checksum no longer matters: it is dropped before any answer)
        assert_eq!(fx.send(&rst).0, TC_ACT_SHOT);
        // UDP: ICMP port unreachable from the ClusterIP quoting the datagram.
        let dgram = udp(OUT, A, VIP_EMPTY, 5353, 53);
        let (v, out) = fx.send(&dgram);
        assert_eq!(v, TC_ACT_REDIRECT);
        let s = seen(&out);
        assert_eq!((s.0, s.1, s.2, s.3, s.6), (GW_MAC, A_MAC, VIP_EMPTY, A, 1));
        assert_eq!((out[34], out[35]), (3, 3), "ICMP type/code");
        assert_eq!(&out[42..62], &dgram[14..34], "quoted IP header");
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 4);

        // No Service there: handed back to `vm_port` unchanged, which
        // routes it (this bed has no routed egress: gateway_unrouted).
        let before = fx.drops(drop_reason::GATEWAY_UNROUTED);
        for frame in [
            tcp(OUT, A, ELSEWHERE, 44000, 80, true),
            tcp(OUT, A, VIP, 44000, 81, true),
            udp(OUT, A, VIP, 5353, 80),
        ] {
            assert_eq!(fx.send(&frame).0, TC_ACT_SHOT);
        }
        assert_eq!(fx.drops(drop_reason::GATEWAY_UNROUTED), before + 3);
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 4);
    });
}

/// Identities of B and C for the client's egress policy.
const ID_B: u32 = 401;
const ID_C: u32 = 402;
/// TCP 80 -> C:8080, which A's egress policy does not allow.
const VIP_C: [u8; 4] = [10, 96, 7, 5];
/// TCP 80 -> D:8080, a VM on another node.
const VIP_REMOTE: [u8; 4] = [10, 96, 7, 6];
const D_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0e, 4];
const D: [u8; 4] = [10, 72, 0, 4];

/// (name, frame, what leaves, verdict, port whose tx counts it, drop
/// reason counted).
type DeliveryRow = (&'static str, Vec<u8>, Seen, u32, Option<u32>, Option<u32>);

#[test]
fn vm_service_delivers_the_translated_frame_after_the_clients_egress_policy() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        let maps = fx.dp.maps_mut();
        // A isolated for egress: TCP 8080 to B only.
        maps.policy_endpoints
            .set(
                A_ID,
                PolicyEndpoint {
                    flags: POL_F_EGRESS,
                    identity: 400,
                },
                0,
            )
            .unwrap();
        for (addr, id) in [(B, ID_B), (C, ID_C), (D, ID_B)] {
            maps.policy_ipcache
                .insert(
                    &Key::new(IdentityPrefix::v4_len(32), IdentityPrefix::v4(NET, addr)),
                    id,
                    0,
                )
                .unwrap();
        }
        let rule = PolicyRuleKey::new(A_ID, policy_dir::EGRESS, ID_B, 6, 8080);
        maps.policy_rules
            .insert(&Key::new(POLICY_LEN_FULL, rule), 0, 0)
            .unwrap();
        for (vip, id, addr, mac) in [(VIP_C, 7, C, C_MAC), (VIP_REMOTE, 8, D, D_MAC)] {
            let k = ServiceBackendKey {
                service: id,
                slot: 0,
            };
            let b = ServiceBackend {
                addr,
                port: 8080,
                mac,
            };
            maps.service_backends.insert(k, b, 0).unwrap();
            let svc = Service {
                id,
                count: 1,
                ..Default::default()
            };
            maps.services
                .insert(ServiceKey::new(NET, vip, 80, 6), svc, 0)
                .unwrap();
        }
        let remote = Endpoint {
            kind: ENDPOINT_REMOTE,
            node_ip4: [192, 0, 2, 44],
            ..Default::default()
        };
        maps.endpoints
            .insert(EndpointKey::new(NET, D_MAC), remote, 0)
            .unwrap();

        let table: Vec<DeliveryRow> = vec![
            (
                "a new flow to B's Service: egress policy allows B:8080, to B",
                tcp(OUT, A, VIP, 45000, 80, true),
                (A_MAC, B_MAC, A, B, 45000, 8080, 6),
                TC_ACT_REDIRECT,
                Some(B_ID),
                None,
            ),
            (
                "its next segment: the tracked flow, straight from vm_service to B",
                tcp(OUT, A, VIP, 45000, 80, false),
                (A_MAC, B_MAC, A, B, 45000, 8080, 6),
                TC_ACT_REDIRECT,
                Some(B_ID),
                None,
            ),
            (
                "a new flow to C's Service: policy sees C, denied",
                tcp(OUT, A, VIP_C, 45001, 80, true),
                (A_MAC, C_MAC, A, C, 45001, 8080, 6),
                TC_ACT_SHOT,
                None,
                Some(drop_reason::POLICY_DENIED_EGRESS),
            ),
            (
                "its next segment (the Service flow exists): denied again",
                tcp(OUT, A, VIP_C, 45001, 80, false),
                (A_MAC, C_MAC, A, C, 45001, 8080, 6),
                TC_ACT_SHOT,
                None,
                Some(drop_reason::POLICY_DENIED_EGRESS),
            ),
            (
                "a backend on another node: allowed, on to the overlay (down in this bed)",
                tcp(OUT, A, VIP_REMOTE, 45002, 80, true),
                (A_MAC, D_MAC, A, D, 45002, 8080, 6),
                TC_ACT_SHOT,
                None,
                Some(drop_reason::OVERLAY_DOWN),
            ),
            (
                "its next segment: the same way, from vm_service",
                tcp(OUT, A, VIP_REMOTE, 45002, 80, false),
                (A_MAC, D_MAC, A, D, 45002, 8080, 6),
                TC_ACT_SHOT,
                None,
                Some(drop_reason::OVERLAY_DOWN),
            ),
        ];
        for (name, frame, want, verdict, tx_port, drop) in &table {
            let tx_before = [fx.tx(B_ID), fx.tx(3)];
            let drops_before = drop.map(|r| fx.drops(r));
            let (v, out) = fx.send(frame);
            assert_eq!(v, *verdict, "{name}");
            assert_eq!(seen(&out), *want, "{name}");
            let tx_want = match tx_port {
                Some(B_ID) => [tx_before[0] + 1, tx_before[1]],
                Some(_) => [tx_before[0], tx_before[1] + 1],
                None => tx_before,
            };
            assert_eq!([fx.tx(B_ID), fx.tx(3)], tx_want, "{name}: delivered to");
            if let (Some(r), Some(before)) = (drop, drops_before) {
                assert_eq!(fx.drops(*r), before + 1, "{name}: drop reason");
            }
        }
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 0);
    });
}
