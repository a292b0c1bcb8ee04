//! Fixture tables for IPv6 ClusterIP Services through BPF_PROG_TEST_RUN:
//! `vm_service6` (translation on the client's port) and `vm_service_in`
//! (reverse translation right before delivery), with IPv6 Service ports
//! and backends written into `vmp_svc6` and `vmp_svc6_backend` by hand,
//! as the agent would. The rows of `service_fixtures` (IPv4) with
//! 16-byte addresses: DNAT to a backend (and on to it), a flow sticking
//! to its backend, the reverse NAT of the reply, a hairpin both ways, a
//! reject for TCP (reset) and for UDP (ICMPv6 port unreachable), frames
//! that are no Service's business passing unchanged, the translated
//! frame delivered past the client's egress policy (allowed, denied),
//! and `sessionAffinity: ClientIP`. Transport checksums of every
//! rewritten frame are verified (IPv6 has no header checksum).
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^service6_fixtures::/)'

use aya::maps::lpm_trie::Key;
use etherparse::PacketBuilder;
use vmpath::apply::dataplane::Dataplane;
use vmpath_common::{
    ENDPOINT_LOCAL, Endpoint, EndpointKey, IdentityPrefix, NetworkInfo, POL_F_EGRESS,
    POLICY_LEN_FULL, PolicyEndpoint, PolicyRuleKey, PortInfo, PortStats, SERVICE_CB_DELIVER,
    SVC_F_AFFINITY, Service, ServiceBackend6, ServiceBackendKey, ServiceKey6, default_gateway_mac,
    drop_reason, policy_dir, prog_names,
};
use vmpath_tests::{
    prog_fixture::{
        BpffsRoot, SKB_CB, SKB_CTX_LEN, TC_ACT_REDIRECT, TC_ACT_SHOT, in_fresh_netns,
        run_classifier, skb_ctx,
    },
    run,
};

const NET: u32 = 721;
const A_ID: u32 = 1;
const B_ID: u32 = 2;
const C_ID: u32 = 3;
const GW_MAC: [u8; 6] = default_gateway_mac(NET);
const A_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0f, 1];
const B_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0f, 2];
const C_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0f, 3];

/// fd00:72::`last`.
const fn on_net(last: u8) -> [u8; 16] {
    [0xfd, 0, 0, 0x72, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last]
}
/// fd00:96::7:`last` (the Service range).
const fn vip(last: u8) -> [u8; 16] {
    [0xfd, 0, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, last]
}
const A: [u8; 16] = on_net(1);
const B: [u8; 16] = on_net(2);
const C: [u8; 16] = on_net(3);
/// TCP 80 and UDP 53 -> B:8080 (one backend).
const VIP: [u8; 16] = vip(1);
/// TCP 80 -> B:8080, C:8080 (two backends).
const VIP2: [u8; 16] = vip(2);
/// TCP 80 -> A:8080 (the client itself).
const VIP_SELF: [u8; 16] = vip(3);
/// TCP 80, UDP 53: no ready backend.
const VIP_EMPTY: [u8; 16] = vip(4);
/// TCP 80 -> C:8080, which A's egress policy does not allow.
const VIP_C: [u8; 16] = vip(5);
/// TCP 80 -> B:8080, C:8080 with `sessionAffinity: ClientIP`.
const VIP_STICKY: [u8; 16] = vip(6);
/// No Service.
const ELSEWHERE: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];

struct Fx {
    dp: Dataplane,
    a: u32,
    _root: BpffsRoot,
}

impl Fx {
    fn new() -> Fx {
        for (x, y) in [("s6-a", "s6-va"), ("s6-b", "s6-vb"), ("s6-c", "s6-vc")] {
            run(&["ip", "link", "add", x, "type", "veth", "peer", "name", y]);
            run(&["ip", "link", "set", x, "up"]);
            run(&["ip", "link", "set", y, "up"]);
        }
        let root = BpffsRoot::new("svc6fx");
        let mut dp = Dataplane::open(&root.0).expect("loading the data path");
        let ifx = |n: &str| vmpath::sys::netif::ifindex_of(n).unwrap();
        let (a, b, c) = (ifx("s6-a"), ifx("s6-b"), ifx("s6-c"));
        let maps = dp.maps_mut();
        let nr = aya::util::nr_cpus().unwrap();
        let net = NetworkInfo {
            gw_mac: GW_MAC,
            ..Default::default()
        };
        maps.networks.insert(NET, net, 0).unwrap();
        for (ifindex, id, mac, ip) in [
            (a, A_ID, A_MAC, A),
            (b, B_ID, B_MAC, B),
            (c, C_ID, C_MAC, C),
        ] {
            let info = PortInfo {
                port_id: id,
                network: NET,
                mac,
                flags: 0,
                gw_mac: GW_MAC,
                _pad: 0,
                ip4: [0; 4],
                ip6: ip,
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
        let backend = |addr, mac| ServiceBackend6 {
            addr,
            port: 8080,
            mac,
        };
        let both = vec![backend(B, B_MAC), backend(C, C_MAC)];
        let services: [(ServiceKey6, u32, Vec<ServiceBackend6>, u8); 9] = [
            (
                ServiceKey6::new(NET, VIP, 80, 6),
                1,
                vec![backend(B, B_MAC)],
                0,
            ),
            (
                ServiceKey6::new(NET, VIP, 53, 17),
                2,
                vec![backend(B, B_MAC)],
                0,
            ),
            (ServiceKey6::new(NET, VIP2, 80, 6), 3, both.clone(), 0),
            (
                ServiceKey6::new(NET, VIP_SELF, 80, 6),
                4,
                vec![backend(A, A_MAC)],
                0,
            ),
            (ServiceKey6::new(NET, VIP_EMPTY, 80, 6), 5, vec![], 0),
            (ServiceKey6::new(NET, VIP_EMPTY, 53, 17), 6, vec![], 0),
            (
                ServiceKey6::new(NET, VIP_C, 80, 6),
                7,
                vec![backend(C, C_MAC)],
                0,
            ),
            (
                ServiceKey6::new(NET, VIP_STICKY, 80, 6),
                8,
                both,
                SVC_F_AFFINITY,
            ),
            // An IPv6 Service port of another network: never A's.
            (
                ServiceKey6::new(NET + 1, ELSEWHERE, 80, 6),
                9,
                vec![backend(B, B_MAC)],
                0,
            ),
        ];
        for (key, id, backends, flags) in &services {
            for (slot, b) in backends.iter().enumerate() {
                let k = ServiceBackendKey {
                    service: *id,
                    slot: slot as u32,
                };
                maps.service6_backends.insert(k, *b, 0).unwrap();
            }
            let svc = Service {
                id: *id,
                count: backends.len() as u32,
                flags: *flags,
                affinity_timeout: if *flags != 0 { 10800 } else { 0 },
                ..Default::default()
            };
            maps.services6.insert(*key, svc, 0).unwrap();
        }
        maps.service_config
            .set(0, services.len() as u32, 0)
            .unwrap();
        Fx { dp, a, _root: root }
    }

    fn run(&self, prog: &str, ctx: &[u8; SKB_CTX_LEN], frame: &[u8]) -> (u32, Vec<u8>) {
        run_classifier(&self.dp, prog, ctx, frame)
    }

    /// `vm_service6` on A's port.
    fn send(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::VM_SERVICE6, &skb_ctx(self.a), frame)
    }

    /// `vm_port` on A's port: the whole way from the guest.
    fn send_via_vm_port(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(prog_names::VM_PORT, &skb_ctx(self.a), frame)
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
/// Ethernet + IPv6 header: where the transport header starts.
const L4: usize = 14 + 40;

fn tcp(
    macs: ([u8; 6], [u8; 6]),
    src: [u8; 16],
    dst: [u8; 16],
    sp: u16,
    dp: u16,
    syn: bool,
) -> Vec<u8> {
    let mut v = Vec::new();
    let b = PacketBuilder::ethernet2(macs.0, macs.1)
        .ipv6(src, dst, 64)
        .tcp(sp, dp, 1000, 64240);
    let b = if syn { b.syn() } else { b.ack(1) };
    b.write(&mut v, b"").unwrap();
    v
}

fn udp(macs: ([u8; 6], [u8; 6]), src: [u8; 16], dst: [u8; 16], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(macs.0, macs.1)
        .ipv6(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath service fixture")
        .unwrap();
    v
}

/// From A to the gateway MAC (where a ClusterIP is routed).
const OUT: ([u8; 6], [u8; 6]) = (A_MAC, GW_MAC);

/// What a frame carries: (src MAC, dst MAC, src, dst, sport, dport,
/// next header), its transport checksum verified.
type Seen = ([u8; 6], [u8; 6], [u8; 16], [u8; 16], u16, u16, u8);

fn seen(f: &[u8]) -> Seen {
    let mac = |o: usize| <[u8; 6]>::try_from(&f[o..o + 6]).unwrap();
    let ip6 = |o: usize| <[u8; 16]>::try_from(&f[o..o + 16]).unwrap();
    let be16 = |o: usize| u16::from_be_bytes([f[o], f[o + 1]]);
    assert_eq!(be16(12), 0x86dd, "not IPv6: {f:02x?}");
    let plen = usize::from(be16(18));
    let proto = f[20];
    let l4 = &f[L4..L4 + plen];
    let pseudo = sum(&f[22..54], u32::from(proto) + plen as u32);
    assert_eq!(
        sum(l4, u32::from(pseudo)),
        0xffff,
        "transport checksum of {f:02x?}"
    );
    (
        mac(6),
        mac(0),
        ip6(22),
        ip6(38),
        be16(L4),
        be16(L4 + 2),
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
fn a_new_ipv6_flow_is_translated_to_its_backend_and_its_reply_back() {
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
        // The whole way from the guest: `vm_port` hands it to `vm_service6`.
        let before = fx.tx(B_ID);
        let (verdict, out) = fx.send_via_vm_port(&tcp(OUT, A, VIP, 40002, 80, true));
        assert_eq!(verdict, TC_ACT_REDIRECT, "from vm_port");
        assert_eq!(seen(&out), (A_MAC, B_MAC, A, B, 40002, 8080, 6));
        assert_eq!(fx.tx(B_ID), before + 1, "from vm_port: not delivered to B");
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
fn an_ipv6_flow_sticks_to_its_backend_and_new_flows_spread() {
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
fn an_ipv6_client_with_session_affinity_keeps_its_backend_across_flows() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let (v, out) = fx.send(&tcp(OUT, A, VIP_STICKY, 46000, 80, true));
        assert_eq!(v, TC_ACT_REDIRECT);
        let first = seen(&out).3;
        assert!(first == B || first == C);
        // 40 new connections: all to the same backend (without affinity
        // the chance of that is 2^-40).
        for sport in 46001..46041u16 {
            let (v, out) = fx.send(&tcp(OUT, A, VIP_STICKY, sport, 80, true));
            assert_eq!(v, TC_ACT_REDIRECT);
            assert_eq!(
                seen(&out).3,
                first,
                "flow {sport} left its client's backend"
            );
        }
    });
}

#[test]
fn an_ipv6_client_reaching_itself_is_hairpinned_both_ways() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let before = fx.tx(A_ID);
        let (v, out) = fx.send(&tcp(OUT, A, VIP_SELF, 42000, 80, true));
        assert_eq!(v, TC_ACT_REDIRECT);
        // Back into A, from the ClusterIP, to its port 8080.
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
fn no_ready_ipv6_backend_is_rejected_and_other_frames_pass_unchanged() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        // TCP: a reset from the ClusterIP, acknowledging the SYN.
        let (v, out) = fx.send(&tcp(OUT, A, VIP_EMPTY, 43000, 80, true));
        assert_eq!(v, TC_ACT_REDIRECT, "the reset goes back out of A's port");
        assert_eq!(seen(&out), (GW_MAC, A_MAC, VIP_EMPTY, A, 80, 43000, 6));
        assert_eq!(out.len(), L4 + 20, "a bare reset");
        let flags = out[L4 + 13];
        assert_eq!(flags, TCP_RST | TCP_ACK, "flags {flags:#x}");
        let ack = u32::from_be_bytes(out[L4 + 8..L4 + 12].try_into().unwrap());
        assert_eq!(ack, 1001, "ack = the SYN's seq + 1");
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 1);
        // A segment with ACK: a reset with its ack as seq, no ACK flag.
        let (v, out) = fx.send(&tcp(OUT, A, VIP_EMPTY, 43001, 80, false));
        assert_eq!(v, TC_ACT_REDIRECT);
        assert_eq!(out[L4 + 13], TCP_RST);
        assert_eq!(
            u32::from_be_bytes(out[L4 + 4..L4 + 8].try_into().unwrap()),
            1
        );
        // A reset is never answered.
        let mut rst = tcp(OUT, A, VIP_EMPTY, 43002, 80, false);
        rst[L4 + 13] |= TCP_RST;
        assert_eq!(fx.send(&rst).0, TC_ACT_SHOT);
        // UDP: ICMPv6 destination unreachable, port unreachable (type 1,
        // code 4), from the ClusterIP, quoting the datagram.
        let dgram = udp(OUT, A, VIP_EMPTY, 5353, 53);
        let (v, out) = fx.send(&dgram);
        assert_eq!(v, TC_ACT_REDIRECT);
        let s = seen(&out);
        assert_eq!((s.0, s.1, s.2, s.3, s.6), (GW_MAC, A_MAC, VIP_EMPTY, A, 58));
        assert_eq!((out[L4], out[L4 + 1]), (1, 4), "ICMPv6 type/code");
        assert_eq!(&out[L4 + 8..L4 + 48], &dgram[14..54], "quoted IPv6 header");
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 4);

        // No Service there (another address, another port, another
        // network's ClusterIP): handed back to `vm_port` unchanged, which
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

/// (name, frame, what leaves, verdict, drop reason counted).
type PolicyRow = (&'static str, Vec<u8>, Seen, u32, Option<u32>);

#[test]
fn vm_service6_delivers_the_translated_frame_after_the_clients_egress_policy() {
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
        for (addr, id) in [(B, ID_B), (C, ID_C)] {
            maps.policy_ipcache
                .insert(
                    &Key::new(IdentityPrefix::v6_len(128), IdentityPrefix::v6(NET, addr)),
                    id,
                    0,
                )
                .unwrap();
        }
        let rule = PolicyRuleKey::new(A_ID, policy_dir::EGRESS, ID_B, 6, 8080);
        maps.policy_rules
            .insert(&Key::new(POLICY_LEN_FULL, rule), 0, 0)
            .unwrap();
        let table: Vec<PolicyRow> = vec![
            (
                "a new flow to B's Service: egress policy allows B:8080, to B",
                tcp(OUT, A, VIP, 45000, 80, true),
                (A_MAC, B_MAC, A, B, 45000, 8080, 6),
                TC_ACT_REDIRECT,
                None,
            ),
            (
                "its next segment: the tracked flow, straight to B",
                tcp(OUT, A, VIP, 45000, 80, false),
                (A_MAC, B_MAC, A, B, 45000, 8080, 6),
                TC_ACT_REDIRECT,
                None,
            ),
            (
                "a new flow to C's Service: policy sees C, denied",
                tcp(OUT, A, VIP_C, 45001, 80, true),
                (A_MAC, C_MAC, A, C, 45001, 8080, 6),
                TC_ACT_SHOT,
                Some(drop_reason::POLICY_DENIED_EGRESS),
            ),
            (
                "its next segment (the Service flow exists): denied again",
                tcp(OUT, A, VIP_C, 45001, 80, false),
                (A_MAC, C_MAC, A, C, 45001, 8080, 6),
                TC_ACT_SHOT,
                Some(drop_reason::POLICY_DENIED_EGRESS),
            ),
        ];
        for (name, frame, want, verdict, drop) in &table {
            let tx_before = [fx.tx(B_ID), fx.tx(C_ID)];
            let drops_before = drop.map(|r| fx.drops(r));
            let (v, out) = fx.send(frame);
            assert_eq!(v, *verdict, "{name}");
            assert_eq!(seen(&out), *want, "{name}");
            let tx_want = if *verdict == TC_ACT_REDIRECT {
                [tx_before[0] + 1, tx_before[1]]
            } else {
                tx_before
            };
            assert_eq!([fx.tx(B_ID), fx.tx(C_ID)], tx_want, "{name}: delivered to");
            if let (Some(r), Some(before)) = (drop, drops_before) {
                assert_eq!(fx.drops(*r), before + 1, "{name}: drop reason");
            }
        }
        assert_eq!(fx.drops(drop_reason::SERVICE_NO_BACKEND), 0);
    });
}

/// What the verifier processed for the programs IPv6 Services touch:
/// `vm_port` (the hand-off to `vm_service6`), `vm_service6` itself and
/// `vm_service_in` (the IPv6 reverse beside IPv4's), each under the
/// kernel's 1,000,000-instruction budget (they would not load otherwise;
/// printed for the margin).
#[test]
fn the_ipv6_service_programs_fit_the_verifier_budget() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        for name in [
            prog_names::VM_PORT,
            prog_names::VM_SERVICE,
            prog_names::VM_SERVICE6,
            prog_names::VM_SERVICE_IN,
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
