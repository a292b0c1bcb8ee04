//! Fixture tables for the NetworkPolicy programs through BPF_PROG_TEST_RUN:
//! `vm_policy_in` (ingress policy before delivery) and `vm_policy_out`
//! (egress policy on the sender's port), with identities, rules and
//! flows written into the maps by hand, as the agent would. Every verdict
//! path: allowed by identity and port, by port range, by any-protocol
//! rule, by any-peer rule; denied; a reply of an allowed flow; an ICMP
//! error for an allowed flow and for none; ARP; random frames from
//! outside that must never pass a deny; and a local delivery, where the
//! sender's tracked egress never stands in for the receiver's ingress,
//! and the shared entry a tracked local flow gets for both ends (both
//! allow, sender denied, receiver denied, the reply, another receiver,
//! ICMP errors, the entry evicted, a policy change).
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^policy_fixtures::/)'

use aya::maps::lpm_trie::Key;
use etherparse::PacketBuilder;
use vmpath::apply::dataplane::Dataplane;
use vmpath_common::{
    ENDPOINT_LOCAL, Endpoint, EndpointKey, FloodList, IdentityPrefix, NetworkInfo, POL_F_EGRESS,
    POL_F_INGRESS, POLICY_CB_DELIVER, POLICY_LEN_FULL, POLICY_LEN_IDENTITY, POLICY_LEN_PROTO,
    PolicyEndpoint, PolicyRuleKey, PortInfo, PortStats, default_gateway_mac, drop_reason, identity,
    policy_dir, prog_names,
};
use vmpath_tests::{
    prog_fixture::{
        BpffsRoot, SKB_CB, SKB_CTX_LEN, TC_ACT_REDIRECT, TC_ACT_SHOT, in_fresh_netns,
        run_classifier, skb_ctx,
    },
    run,
};

const NET: u32 = 700;
const PORT_ID: u32 = 1;
const GW_MAC: [u8; 6] = default_gateway_mac(NET);
const A_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0d, 1];
const PEER_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0d, 2];
const A: [u8; 4] = [10, 40, 0, 1];
/// Identity 301: allowed TCP 80 in, UDP 81 out.
const B: [u8; 4] = [10, 40, 0, 2];
/// Identity 302: allowed TCP 8000-8015 in.
const C: [u8; 4] = [10, 40, 0, 3];
/// Inside the ipBlock 10.40.1.0/24 (identity 303): anything in.
const CIDR_HOST: [u8; 4] = [10, 40, 1, 77];
const WORLD: [u8; 4] = [192, 0, 2, 9];

const ID_B: u32 = 301;
const ID_C: u32 = 302;
const ID_CIDR: u32 = 303;

struct Fx {
    dp: Dataplane,
    port: u32,
    peer_port: u32,
    _root: BpffsRoot,
}

fn rule(dir: u8, id: u32, proto: u8, port: u16, len: u32) -> Key<PolicyRuleKey> {
    Key::new(len, PolicyRuleKey::new(PORT_ID, dir, id, proto, port))
}

impl Fx {
    fn new() -> Fx {
        run(&[
            "ip", "link", "add", "pf-a", "type", "veth", "peer", "name", "pf-va",
        ]);
        run(&[
            "ip", "link", "add", "pf-b", "type", "veth", "peer", "name", "pf-vb",
        ]);
        for i in ["pf-a", "pf-va", "pf-b", "pf-vb", "lo"] {
            run(&["ip", "link", "set", i, "up"]);
        }
        let root = BpffsRoot::new("polfx");
        let mut dp = Dataplane::open(&root.0).expect("loading the data path");
        let port = vmpath::sys::netif::ifindex_of("pf-a").unwrap();
        let peer_port = vmpath::sys::netif::ifindex_of("pf-b").unwrap();
        let maps = dp.maps_mut();
        maps.ports
            .insert(
                port,
                PortInfo {
                    port_id: PORT_ID,
                    network: NET,
                    mac: A_MAC,
                    flags: 0,
                    gw_mac: GW_MAC,
                    _pad: 0,
                    ip4: A,
                    ip6: [0; 16],
                },
                0,
            )
            .unwrap();
        let nr = aya::util::nr_cpus().unwrap();
        maps.port_stats
            .set(
                PORT_ID,
                aya::maps::PerCpuValues::try_from(vec![PortStats::default(); nr]).unwrap(),
                0,
            )
            .unwrap();
        maps.policy_endpoints
            .set(
                PORT_ID,
                PolicyEndpoint {
                    flags: POL_F_INGRESS | POL_F_EGRESS,
                    identity: 300,
                },
                0,
            )
            .unwrap();
        for (addr, len, id) in [(B, 32, ID_B), (C, 32, ID_C), ([10, 40, 1, 0], 24, ID_CIDR)] {
            maps.policy_ipcache
                .insert(
                    &Key::new(IdentityPrefix::v4_len(len), IdentityPrefix::v4(NET, addr)),
                    id,
                    0,
                )
                .unwrap();
        }
        let (i, e) = (policy_dir::INGRESS, policy_dir::EGRESS);
        for (key, policy) in [
            (rule(i, ID_B, 6, 80, POLICY_LEN_FULL), 0),
            // 8000-8015: one prefix of 12 bits.
            (rule(i, ID_C, 6, 8000, POLICY_LEN_PROTO + 12), 1),
            (rule(i, ID_CIDR, 0, 0, POLICY_LEN_IDENTITY), 2),
            (rule(i, identity::ANY, 17, 53, POLICY_LEN_FULL), 3),
            (rule(e, ID_B, 17, 81, POLICY_LEN_FULL), 4),
        ] {
            maps.policy_rules.insert(&key, policy, 0).unwrap();
        }
        Fx {
            dp,
            port,
            peer_port,
            _root: root,
        }
    }

    fn run(&self, prog: &str, ctx: &[u8; SKB_CTX_LEN], frame: &[u8]) -> u32 {
        run_classifier(&self.dp, prog, ctx, frame).0
    }

    /// `vm_policy_in` delivering `frame` (arriving on the peer's port) to A.
    fn deliver(&self, frame: &[u8]) -> u32 {
        self.deliver_from(self.peer_port, frame)
    }

    /// `vm_policy_in` delivering `frame`, arriving on `ifindex`, to A.
    fn deliver_from(&self, ifindex: u32, frame: &[u8]) -> u32 {
        let mut ctx = skb_ctx(ifindex);
        for (i, v) in [POLICY_CB_DELIVER, PORT_ID, self.port].iter().enumerate() {
            ctx[SKB_CB + 4 * i..SKB_CB + 4 * i + 4].copy_from_slice(&v.to_ne_bytes());
        }
        self.run(prog_names::VM_POLICY_IN, &ctx, frame)
    }

    /// `vm_policy_out` on A's port: SHOT when denied; when allowed the
    /// frame goes back to `vm_port` (and on, here to no destination: the
    /// drop counters tell the verdicts apart).
    fn send(&self, frame: &[u8]) -> u32 {
        self.run(prog_names::VM_POLICY_OUT, &skb_ctx(self.port), frame)
    }

    fn drops(&self, reason: u32) -> u64 {
        self.dp.maps().drop_counts().unwrap()[reason as usize]
    }
}

fn tcp(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv4(src, dst, 64)
        .tcp(sp, dp, 1000, 64240)
        .syn()
        .write(&mut v, b"")
        .unwrap();
    v
}

fn udp(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv4(src, dst, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath policy fixture")
        .unwrap();
    v
}

fn echo(src: [u8; 4], dst: [u8; 4], id: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv4(src, dst, 64)
        .icmpv4_echo_request(id, 1)
        .write(&mut v, b"ping")
        .unwrap();
    v
}

/// An ICMP destination-unreachable from `from` to A quoting `sent` (a
/// frame A sent).
fn unreachable(from: [u8; 4], sent: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv4(from, A, 64)
        .icmpv4_raw(3, 3, [0; 4])
        .write(&mut v, &sent[14..14 + 28])
        .unwrap();
    v
}

fn arp_request() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&[0xff; 6]);
    v.extend_from_slice(&PEER_MAC);
    v.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    v.extend_from_slice(&PEER_MAC);
    v.extend_from_slice(&B);
    v.extend_from_slice(&[0; 6]);
    v.extend_from_slice(&A);
    v
}

#[test]
fn ingress_verdicts() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let table: Vec<(&str, Vec<u8>, u32)> = vec![
            (
                "B to TCP 80: rule for B's identity",
                tcp(B, A, 40000, 80),
                TC_ACT_REDIRECT,
            ),
            ("B to TCP 81: no rule", tcp(B, A, 40000, 81), TC_ACT_SHOT),
            ("B UDP 80: TCP only", udp(B, A, 40000, 80), TC_ACT_SHOT),
            ("C to TCP 8000", tcp(C, A, 40000, 8000), TC_ACT_REDIRECT),
            ("C to TCP 8015", tcp(C, A, 40000, 8015), TC_ACT_REDIRECT),
            (
                "C to TCP 8016: past the range",
                tcp(C, A, 40000, 8016),
                TC_ACT_SHOT,
            ),
            (
                "C to TCP 7999: before the range",
                tcp(C, A, 40000, 7999),
                TC_ACT_SHOT,
            ),
            ("C to TCP 80: B's rule", tcp(C, A, 40000, 80), TC_ACT_SHOT),
            (
                "ipBlock host, any TCP",
                tcp(CIDR_HOST, A, 1234, 9999),
                TC_ACT_REDIRECT,
            ),
            ("ipBlock host, ping", echo(CIDR_HOST, A, 7), TC_ACT_REDIRECT),
            (
                "world to UDP 53: any peer",
                udp(WORLD, A, 5353, 53),
                TC_ACT_REDIRECT,
            ),
            (
                "world to TCP 53: UDP only",
                tcp(WORLD, A, 5353, 53),
                TC_ACT_SHOT,
            ),
            ("world ping", echo(WORLD, A, 9), TC_ACT_SHOT),
            ("ARP: never policy's", arp_request(), TC_ACT_REDIRECT),
            (
                "DHCP offer: never policy's",
                udp(WORLD, A, 67, 68),
                TC_ACT_REDIRECT,
            ),
        ];
        let mut wrong = Vec::new();
        let mut denied = 0;
        for (name, frame, want) in &table {
            let got = fx.deliver(frame);
            if got != *want {
                wrong.push(format!("{name}: got {got}, want {want}"));
            }
            denied += u64::from(*want == TC_ACT_SHOT);
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_INGRESS), denied);
    });
}

#[test]
fn replies_and_icmp_errors_of_allowed_flows_pass_others_do_not() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        // A -> B UDP 81: egress rule. A -> C UDP 81: denied.
        let out = udp(A, B, 5000, 81);
        fx.send(&out);
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_EGRESS), 0, "allowed");
        fx.send(&udp(A, C, 5000, 81));
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_EGRESS), 1, "denied");
        // B's reply: no ingress rule allows UDP from B, the flow does.
        assert_eq!(fx.deliver(&udp(B, A, 81, 5000)), TC_ACT_REDIRECT);
        // Not the flow: another port of B.
        assert_eq!(fx.deliver(&udp(B, A, 82, 5000)), TC_ACT_SHOT);
        // The same tuple from another sender is no reply.
        assert_eq!(fx.deliver(&udp(C, A, 81, 5000)), TC_ACT_SHOT);
        // An ICMP error about the allowed flow, from a router: passes.
        assert_eq!(fx.deliver(&unreachable(WORLD, &out)), TC_ACT_REDIRECT);
        // About a flow that never was: denied.
        let never = udp(A, C, 5001, 81);
        assert_eq!(fx.deliver(&unreachable(WORLD, &never)), TC_ACT_SHOT);
        // Later packets of the flow A opened pass on the flow, both ways.
        fx.send(&out);
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_EGRESS), 1);
        assert_eq!(fx.deliver(&udp(B, A, 81, 5000)), TC_ACT_REDIRECT);
        // A flow allowed in (B -> A TCP 80): A's replies go out although
        // no egress rule allows TCP to B.
        assert_eq!(fx.deliver(&tcp(B, A, 41000, 80)), TC_ACT_REDIRECT);
        fx.send(&tcp(A, B, 80, 41000));
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_EGRESS), 1, "reply out");
        fx.send(&tcp(A, B, 80, 41001));
        assert_eq!(
            fx.drops(drop_reason::POLICY_DENIED_EGRESS),
            2,
            "not a reply"
        );
    });
}

#[test]
fn random_frames_from_outside_never_pass_a_deny() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        // A fixed linear congruential sequence: the same frames each run.
        let mut x: u64 = 0x5eed_1234_abcd_0001;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u32
        };
        let mut passed = Vec::new();
        for _ in 0..300 {
            let src = [192, 0, 2, (next() % 250) as u8 + 1];
            let (sp, dp) = ((next() % 65535) as u16 + 1, (next() % 65535) as u16 + 1);
            let (frame, allowed) = match next() % 4 {
                0 => (tcp(src, A, sp, dp), false),
                // UDP 53 from anyone is allowed; DHCP is never policy's.
                1 => (udp(src, A, sp, dp), dp == 53 || (sp, dp) == (67, 68)),
                2 => (echo(src, A, sp), false),
                _ => {
                    // Another IP protocol, a raw payload.
                    let mut v = Vec::new();
                    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
                        .ipv4(src, A, 64)
                        .write(
                            &mut v,
                            etherparse::IpNumber((next() % 200) as u8 + 50),
                            &dp.to_be_bytes(),
                        )
                        .unwrap();
                    (v, false)
                }
            };
            let got = fx.deliver(&frame);
            if got != TC_ACT_SHOT && !allowed {
                passed.push(format!("{frame:02x?}"));
            }
        }
        assert!(passed.is_empty(), "passed a deny:\n{}", passed.join("\n"));
    });
}

/// `vm_port` looks a tracked flow up itself: a flow's first frame goes
/// through `vm_policy_out` (one allowed flow counted), its later frames
/// pass on the flow table alone (no new count) and go on to switching;
/// a denied flow is denied every time it is sent.
#[test]
fn vm_port_passes_tracked_flows_itself_never_a_denied_one() {
    in_fresh_netns(|| {
        let fx = Fx::new();
        let ctx = skb_ctx(fx.port);
        let allowed = udp(A, B, 6000, 81);
        let denied = udp(A, C, 6000, 81);
        for round in 1..=3u64 {
            // Allowed, then dropped for want of a destination (A's frames
            // here go to no known port): past policy either way.
            assert_eq!(fx.run(prog_names::VM_PORT, &ctx, &allowed), TC_ACT_SHOT);
            assert_eq!(fx.drops(drop_reason::NO_DESTINATION), round, "{round}");
            assert_eq!(fx.run(prog_names::VM_PORT, &ctx, &denied), TC_ACT_SHOT);
            assert_eq!(
                fx.drops(drop_reason::POLICY_DENIED_EGRESS),
                round,
                "{round}"
            );
        }
        let stats = fx.dp.maps().policy_stats(fx.port).unwrap().unwrap();
        assert_eq!(stats.allowed_egress, 1, "one flow, checked once");
        assert_eq!(stats.denied_egress, 3);
    });
}

/// B's port on this node (pf-b), isolated for ingress: UDP 81 from A only.
const B_PORT_ID: u32 = 2;
const ID_A: u32 = 300;

/// From A's port to B's MAC.
fn udp_to_b(sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(A_MAC, PEER_MAC)
        .ipv4(A, B, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath policy fixture")
        .unwrap();
    v
}

/// B's port (pf-b) on A's network: isolated for ingress, UDP 81 from A
/// allowed; A may send UDP 81 and 82 to B.
fn add_b(fx: &mut Fx) {
    let peer_port = fx.peer_port;
    let maps = fx.dp.maps_mut();
    maps.ports
        .insert(
            peer_port,
            PortInfo {
                port_id: B_PORT_ID,
                network: NET,
                mac: PEER_MAC,
                flags: 0,
                gw_mac: GW_MAC,
                _pad: 0,
                ip4: B,
                ip6: [0; 16],
            },
            0,
        )
        .unwrap();
    let ep = Endpoint {
        kind: ENDPOINT_LOCAL,
        ifindex: peer_port,
        port_id: B_PORT_ID,
        identity: ID_B,
        ..Default::default()
    };
    maps.endpoints
        .insert(EndpointKey::new(NET, PEER_MAC), ep, 0)
        .unwrap();
    maps.policy_endpoints
        .set(
            B_PORT_ID,
            PolicyEndpoint {
                flags: POL_F_INGRESS,
                identity: ID_B,
            },
            0,
        )
        .unwrap();
    maps.policy_ipcache
        .insert(
            &Key::new(IdentityPrefix::v4_len(32), IdentityPrefix::v4(NET, A)),
            ID_A,
            0,
        )
        .unwrap();
    let b_in = PolicyRuleKey::new(B_PORT_ID, policy_dir::INGRESS, ID_A, 17, 81);
    maps.policy_rules
        .insert(&Key::new(POLICY_LEN_FULL, b_in), 6, 0)
        .unwrap();
    // A may send UDP 82 to B too; B does not take it.
    let a_out = PolicyRuleKey::new(PORT_ID, policy_dir::EGRESS, ID_B, 17, 82);
    maps.policy_rules
        .insert(&Key::new(POLICY_LEN_FULL, a_out), 7, 0)
        .unwrap();
}

/// Packets delivered to the port with id `port_id`.
fn tx(fx: &Fx, port_id: u32) -> u64 {
    fx.dp
        .maps()
        .port_stats
        .get(&port_id, 0)
        .unwrap()
        .iter()
        .map(|s| s.tx_packets)
        .sum()
}

#[test]
fn a_local_delivery_checks_the_receivers_ingress_after_the_senders_tracked_egress() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        add_b(&mut fx);
        let peer_port = fx.peer_port;
        let ctx = skb_ctx(fx.port);
        let tx_b = |fx: &Fx| tx(fx, B_PORT_ID);
        // (frame, verdict, delivered to B, counted as denied at B's ingress)
        let table = [
            (
                "UDP 81: both ends allow",
                udp_to_b(6000, 81),
                TC_ACT_REDIRECT,
                true,
                false,
            ),
            (
                "UDP 82: A's egress allows, B's ingress denies",
                udp_to_b(6001, 82),
                TC_ACT_SHOT,
                false,
                true,
            ),
        ];
        // The first round opens the flows; in the later ones A's egress
        // is tracked, and B's ingress must still be B's own verdict.
        for round in 1..=3 {
            for (name, frame, verdict, delivered, denied) in &table {
                let (tx, drops) = (tx_b(&fx), fx.drops(drop_reason::POLICY_DENIED_INGRESS));
                assert_eq!(
                    fx.run(prog_names::VM_PORT, &ctx, frame),
                    *verdict,
                    "{name}, round {round}"
                );
                assert_eq!(
                    tx_b(&fx),
                    tx + u64::from(*delivered),
                    "{name}, round {round}"
                );
                assert_eq!(
                    fx.drops(drop_reason::POLICY_DENIED_INGRESS),
                    drops + u64::from(*denied),
                    "{name}, round {round}"
                );
            }
        }
        let a = fx.dp.maps().policy_stats(fx.port).unwrap().unwrap();
        assert_eq!(a.allowed_egress, 2, "two flows, each checked once at A");
        let b = fx.dp.maps().policy_stats(peer_port).unwrap().unwrap();
        assert_eq!((b.allowed_ingress, b.denied_ingress), (1, 3));
    });
}

/// C's port (pf-c) on A's network: isolated for ingress, nothing allowed.
const C_PORT_ID: u32 = 3;
const C_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0x0d, 3];

/// A frame from A's MAC to `dst_mac` with the tuple A:sp -> B:dp (UDP).
fn udp_from_a(dst_mac: [u8; 6], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(A_MAC, dst_mac)
        .ipv4(A, B, 64)
        .udp(sp, dp)
        .write(&mut v, b"vmpath policy fixture")
        .unwrap();
    v
}

/// The shared entries (`policy_dir::PAIR`) of the flow table with source
/// port `sp`, as (from port, to port).
fn pairs(fx: &Fx, sp: u16) -> Vec<(u16, u16)> {
    fx.dp
        .maps()
        .policy_flows
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(k, _)| k.direction == policy_dir::PAIR && (k.sport == sp || k.dport == sp))
        .map(|(k, f)| {
            assert_eq!(k.port_id, NET, "a shared entry is keyed by the network");
            (f.from_port, f.to_port)
        })
        .collect()
}

/// Forgets tracked flows as a full table would: the shared entries
/// (`shared`) or every port's own.
fn evict(fx: &mut Fx, shared: bool) {
    let keys: Vec<_> = fx
        .dp
        .maps()
        .policy_flows
        .keys()
        .filter_map(|r| r.ok())
        .filter(|k| (k.direction == policy_dir::PAIR) == shared)
        .collect();
    for k in keys {
        fx.dp.maps_mut().policy_flows.remove(&k).unwrap();
    }
}

/// A local flow both ends allow gets one shared entry after its second
/// frame (the first is checked at each end, the second passes on the two
/// ends' own entries and records the shared one); from then on its frames
/// and replies pass on it. The entry names both ports: it never stands
/// in for another receiver, and a flow either end denies never gets one.
#[test]
fn a_shared_entry_stands_for_both_ends_of_a_local_flow_only() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        add_b(&mut fx);
        run(&[
            "ip", "link", "add", "pf-c", "type", "veth", "peer", "name", "pf-vc",
        ]);
        run(&["ip", "link", "set", "pf-c", "up"]);
        run(&["ip", "link", "set", "pf-vc", "up"]);
        let c_port = vmpath::sys::netif::ifindex_of("pf-c").unwrap();
        let (a_port, b_port) = (fx.port, fx.peer_port);
        let maps = fx.dp.maps_mut();
        for (mac, ifindex, port_id) in [(A_MAC, a_port, PORT_ID), (C_MAC, c_port, C_PORT_ID)] {
            let ep = Endpoint {
                kind: ENDPOINT_LOCAL,
                ifindex,
                port_id,
                ..Default::default()
            };
            maps.endpoints
                .insert(EndpointKey::new(NET, mac), ep, 0)
                .unwrap();
        }
        maps.ports
            .insert(
                c_port,
                PortInfo {
                    port_id: C_PORT_ID,
                    network: NET,
                    mac: C_MAC,
                    flags: 0,
                    gw_mac: GW_MAC,
                    _pad: 0,
                    ip4: C,
                    ip6: [0; 16],
                },
                0,
            )
            .unwrap();
        maps.policy_endpoints
            .set(
                C_PORT_ID,
                PolicyEndpoint {
                    flags: POL_F_INGRESS,
                    identity: ID_C,
                },
                0,
            )
            .unwrap();
        let (from_a, from_b) = (skb_ctx(a_port), skb_ctx(b_port));
        let denied_in = |fx: &Fx| fx.drops(drop_reason::POLICY_DENIED_INGRESS);
        let denied_out = |fx: &Fx| fx.drops(drop_reason::POLICY_DENIED_EGRESS);
        let both = (PORT_ID as u16, B_PORT_ID as u16);

        // Both allow: delivered every time, checked once at each end.
        for round in 1..=4u64 {
            let f = udp_from_a(PEER_MAC, 7000, 81);
            assert_eq!(
                fx.run(prog_names::VM_PORT, &from_a, &f),
                TC_ACT_REDIRECT,
                "round {round}"
            );
            assert_eq!(tx(&fx, B_PORT_ID), round, "round {round}");
            let want = if round == 1 { vec![] } else { vec![both] };
            assert_eq!(pairs(&fx, 7000), want, "round {round}");
        }
        let a = fx.dp.maps().policy_stats(a_port).unwrap().unwrap();
        let b = fx.dp.maps().policy_stats(b_port).unwrap().unwrap();
        assert_eq!((a.allowed_egress, b.allowed_ingress), (1, 1));

        // The reply, on the shared entry alone: A's ingress allows no UDP
        // from B, and the ends' own entries are gone.
        evict(&mut fx, false);
        assert_eq!(
            fx.run(prog_names::VM_PORT, &from_b, &udp(B, A, 81, 7000)),
            TC_ACT_REDIRECT,
            "the reply"
        );
        assert_eq!(tx(&fx, PORT_ID), 1);
        // Not a reply: another port of A.
        assert_eq!(
            fx.run(prog_names::VM_PORT, &from_b, &udp(B, A, 81, 7001)),
            TC_ACT_SHOT
        );
        assert_eq!(denied_in(&fx), 1);
        // An ICMP error about the flow, from B: passes on the entry.
        let sent = udp_from_a(PEER_MAC, 7000, 81);
        assert_eq!(
            fx.run(prog_names::VM_PORT, &from_b, &unreachable(B, &sent)),
            TC_ACT_REDIRECT,
            "ICMP error about the shared flow"
        );
        // The same tuple to C's MAC: the entry is B's verdict, not C's.
        assert_eq!(
            fx.run(prog_names::VM_PORT, &from_a, &udp_from_a(C_MAC, 7000, 81)),
            TC_ACT_SHOT
        );
        assert_eq!(denied_in(&fx), 2, "C's own ingress denied it");
        assert_eq!(tx(&fx, C_PORT_ID), 0);

        // Sender denied (UDP 83) and receiver denied (UDP 82): every time,
        // and never a shared entry.
        for round in 1..=3u64 {
            let f = udp_from_a(PEER_MAC, 7200, 83);
            assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &f), TC_ACT_SHOT);
            assert_eq!(denied_out(&fx), round, "sender denied, round {round}");
            let f = udp_from_a(PEER_MAC, 7300, 82);
            assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &f), TC_ACT_SHOT);
            assert_eq!(denied_in(&fx), 2 + round, "receiver denied, {round}");
        }
        assert!(pairs(&fx, 7200).is_empty() && pairs(&fx, 7300).is_empty());

        // An ICMP error from B about a flow only the ends' own entries hold
        // (one frame, no shared entry yet) passes on them too.
        let sent = udp_from_a(PEER_MAC, 7400, 81);
        assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &sent), TC_ACT_REDIRECT);
        assert_eq!(
            fx.run(prog_names::VM_PORT, &from_b, &unreachable(B, &sent)),
            TC_ACT_REDIRECT,
            "ICMP error about a flow tracked per end"
        );

        // The shared entry evicted: the ends' own entries are gone too, so
        // the next frame is checked again (allowed, counted again).
        evict(&mut fx, true);
        evict(&mut fx, false);
        let f = udp_from_a(PEER_MAC, 7000, 81);
        assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &f), TC_ACT_REDIRECT);
        let b = fx.dp.maps().policy_stats(b_port).unwrap().unwrap();
        assert_eq!(b.allowed_ingress, 3, "7000 again, 7400");

        // A policy change: B no longer takes UDP 81. The established flow
        // goes on (its entries), a new one is denied, and the established
        // one too once the table forgot it.
        let b_in = PolicyRuleKey::new(B_PORT_ID, policy_dir::INGRESS, ID_A, 17, 81);
        fx.dp
            .maps_mut()
            .policy_rules
            .remove(&Key::new(POLICY_LEN_FULL, b_in))
            .unwrap();
        for _ in 0..2 {
            assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &f), TC_ACT_REDIRECT);
        }
        assert_eq!(pairs(&fx, 7000), vec![both]);
        let before = denied_in(&fx);
        let new = udp_from_a(PEER_MAC, 7500, 81);
        assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &new), TC_ACT_SHOT);
        evict(&mut fx, true);
        evict(&mut fx, false);
        assert_eq!(fx.run(prog_names::VM_PORT, &from_a, &f), TC_ACT_SHOT);
        assert_eq!(denied_in(&fx), before + 2);
    });
}

/// C's address over IPv6 (identity `ID_C`, as C's IPv4 address is).
const C6: [u8; 16] = [0xfd, 0x40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3];
const A6: [u8; 16] = [0xfd, 0x40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
/// An address nobody was configured with (a learned one, or a lie).
const UNCONFIGURED: [u8; 4] = [10, 40, 0, 99];
const UNCONFIGURED6: [u8; 16] = [0xfd, 0x40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x99];

fn tcp6(src: [u8; 16], dst: [u8; 16], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv6(src, dst, 64)
        .tcp(sp, dp, 1000, 64240)
        .syn()
        .write(&mut v, b"")
        .unwrap();
    v
}

/// A frame sent by a local endpoint carries that endpoint's identity,
/// whatever source address it writes: B's port claiming C's address (v4
/// and v6) gets B's rules, not C's; an address B was not configured with
/// (learned, or a lie) still gets B's. From elsewhere than a local port
/// (here the same frames with no port behind the ifindex), the address
/// decides, as before.
#[test]
fn a_local_endpoints_frames_carry_its_own_identity_whatever_their_source_address() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        add_b(&mut fx);
        fx.dp
            .maps_mut()
            .policy_ipcache
            .insert(
                &Key::new(IdentityPrefix::v6_len(128), IdentityPrefix::v6(NET, C6)),
                ID_C,
                0,
            )
            .unwrap();
        // (name, frame from B's port, verdict at A's ingress)
        let table: Vec<(&str, Vec<u8>, u32)> = vec![
            ("B as itself, TCP 80", tcp(B, A, 40000, 80), TC_ACT_REDIRECT),
            (
                "B claiming C's address, C's TCP 8000",
                tcp(C, A, 40000, 8000),
                TC_ACT_SHOT,
            ),
            (
                "B claiming C's address, B's own TCP 80",
                tcp(C, A, 40001, 80),
                TC_ACT_REDIRECT,
            ),
            (
                "B claiming an ipBlock host's address",
                tcp(CIDR_HOST, A, 1234, 9999),
                TC_ACT_SHOT,
            ),
            (
                "B from an address it was not configured with, TCP 80",
                tcp(UNCONFIGURED, A, 40002, 80),
                TC_ACT_REDIRECT,
            ),
            (
                "B claiming C's IPv6 address, C's TCP 8000",
                tcp6(C6, A6, 40000, 8000),
                TC_ACT_SHOT,
            ),
            (
                "B from an IPv6 address it was not configured with, TCP 80",
                tcp6(UNCONFIGURED6, A6, 40003, 80),
                TC_ACT_REDIRECT,
            ),
        ];
        let mut wrong = Vec::new();
        for (name, frame, want) in &table {
            let got = fx.deliver(frame);
            if got != *want {
                wrong.push(format!("{name}: got {got}, want {want}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        // The control: from no local port, C's address is C's.
        fx.dp.maps_mut().ports.remove(&fx.peer_port).unwrap();
        assert_eq!(fx.deliver(&tcp(C, A, 40010, 8000)), TC_ACT_REDIRECT);
        assert_eq!(fx.deliver(&tcp6(C6, A6, 40010, 8000)), TC_ACT_REDIRECT);
    });
}

// --- fragments and IPv6 extension headers -------------------------------------

/// Identity 301 (B's): TCP 80 in.
const B6: [u8; 16] = [0xfd, 0x40, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
const WORLD6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];

const HOPOPTS: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const DSTOPTS: u8 = 60;

/// An IPv4 frame split in two fragments (IP ID `id`), the first carrying
/// `first_len` bytes (a multiple of 8) of the IP payload.
fn fragments4(frame: &[u8], first_len: usize, id: u16) -> (Vec<u8>, Vec<u8>) {
    let (eth, ip) = frame.split_at(14);
    let payload = &ip[20..];
    let part = |data: &[u8], offset8: u16, more: bool| {
        let mut h = ip[..20].to_vec();
        h[2..4].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
        h[4..6].copy_from_slice(&id.to_be_bytes());
        let flags = offset8 | if more { 0x2000 } else { 0 };
        h[6..8].copy_from_slice(&flags.to_be_bytes());
        [eth, &h, data].concat()
    };
    (
        part(&payload[..first_len], 0, true),
        part(&payload[first_len..], (first_len / 8) as u16, false),
    )
}

fn tcp_with_payload(src: [u8; 4], dst: [u8; 4], sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, A_MAC)
        .ipv4(src, dst, 64)
        .tcp(sp, dp, 1000, 64240)
        .write(&mut v, &[7u8; 64])
        .unwrap();
    v
}

fn ip6_frame(src: [u8; 16], dst: [u8; 16], tcp: bool, sp: u16, dp: u16) -> Vec<u8> {
    let mut v = Vec::new();
    let b = PacketBuilder::ethernet2(PEER_MAC, A_MAC).ipv6(src, dst, 64);
    if tcp {
        b.tcp(sp, dp, 1000, 64240)
            .write(&mut v, &[7u8; 64])
            .unwrap();
    } else {
        b.udp(sp, dp).write(&mut v, &[7u8; 64]).unwrap();
    }
    v
}

/// `frame` with IPv6 extension headers `exts` after the fixed header:
/// hop-by-hop, routing and destination options as 8 bytes each, a
/// fragment header with `frag` (offset << 3 | M) and identification `id`.
fn ext6(frame: &[u8], exts: &[u8], frag: u16, id: u32) -> Vec<u8> {
    let upper = frame[14 + 6];
    let mut hdrs = Vec::new();
    for (i, &t) in exts.iter().enumerate() {
        let next = exts.get(i + 1).copied().unwrap_or(upper);
        match t {
            FRAGMENT => {
                let (f, i) = (frag.to_be_bytes(), id.to_be_bytes());
                hdrs.extend_from_slice(&[next, 0, f[0], f[1], i[0], i[1], i[2], i[3]]);
            }
            // A type 0 routing header with no segments left.
            ROUTING => hdrs.extend_from_slice(&[next, 0, 0, 0, 0, 0, 0, 0]),
            _ => hdrs.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]),
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

/// NetworkPolicy on fragments and IPv6 extension headers, both families,
/// delivering to A (ingress isolated: TCP 80 from B, UDP 53 from anyone).
/// A later fragment takes its first fragment's verdict: allowed after an
/// allowed first (a fragmented TCP/80 segment, a large UDP/53 answer),
/// denied after a denied one (as the first was, `policy_denied_ingress`);
/// with no first seen it is denied with its own reason
/// (`policy_fragment`). TCP and UDP behind hop-by-hop, routing and
/// destination options are judged by their ports; past the walk's bound
/// (four headers) by the first header's protocol, without ports.
#[test]
fn fragments_and_extension_headers_are_judged_by_their_ports_both_families() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        fx.dp
            .maps_mut()
            .policy_ipcache
            .insert(
                &Key::new(IdentityPrefix::v6_len(128), IdentityPrefix::v6(NET, B6)),
                ID_B,
                0,
            )
            .unwrap();
        let (allow, deny) = (TC_ACT_REDIRECT, TC_ACT_SHOT);
        let (denied, unplaced) = (
            drop_reason::POLICY_DENIED_INGRESS,
            drop_reason::POLICY_FRAGMENT,
        );

        // IPv4: a fragmented TCP/80 segment from B, its later fragment
        // before and after the first.
        let (first80, later80) = fragments4(&tcp_with_payload(B, A, 40000, 80), 24, 0x1001);
        let (first81, later81) = fragments4(&tcp_with_payload(B, A, 40000, 81), 24, 0x1002);
        let (dns_first, dns_later) = fragments4(&udp(WORLD, A, 5353, 53), 8, 0x1003);
        let (_, stray) = fragments4(&udp(WORLD, A, 5353, 53), 8, 0x1004);
        // IPv6: the same through fragment headers (M set on the first).
        let tcp80_6 = ip6_frame(B6, A6, true, 40000, 80);
        let tcp81_6 = ip6_frame(B6, A6, true, 40000, 81);
        let dns6 = ip6_frame(WORLD6, A6, false, 5353, 53);
        let table: Vec<(&str, Vec<u8>, u32, Option<u32>)> = vec![
            (
                "v4: a later fragment before its first -> denied, no first seen",
                later80.clone(),
                deny,
                Some(unplaced),
            ),
            ("v4: first fragment of TCP/80 from B", first80, allow, None),
            (
                "v4: its later fragment -> as its first",
                later80,
                allow,
                None,
            ),
            (
                "v4: first fragment of TCP/81 from B -> denied",
                first81,
                deny,
                Some(denied),
            ),
            (
                "v4: its later fragment -> denied as its first was",
                later81,
                deny,
                Some(denied),
            ),
            ("v4: a large UDP/53 answer, first", dns_first, allow, None),
            ("v4: ... and its later fragment", dns_later, allow, None),
            (
                "v4: a later fragment of another datagram (IP ID) -> denied",
                stray,
                deny,
                Some(unplaced),
            ),
            (
                "v6: TCP/80 from B behind hop-by-hop -> by its port",
                ext6(&tcp80_6, &[HOPOPTS], 0, 0),
                allow,
                None,
            ),
            (
                "v6: TCP/81 from B behind hop-by-hop -> denied by its port",
                ext6(&tcp81_6, &[HOPOPTS], 0, 0),
                deny,
                Some(denied),
            ),
            (
                "v6: UDP/53 behind routing and destination options",
                ext6(&dns6, &[ROUTING, DSTOPTS], 0, 0),
                allow,
                None,
            ),
            (
                "v6: TCP/80 behind four headers (the walk's bound)",
                ext6(&tcp80_6, &[HOPOPTS, ROUTING, DSTOPTS, DSTOPTS], 0, 0),
                allow,
                None,
            ),
            (
                "v6: TCP/80 behind five headers -> past the walk, no ports: denied",
                ext6(
                    &tcp80_6,
                    &[HOPOPTS, ROUTING, DSTOPTS, DSTOPTS, DSTOPTS],
                    0,
                    0,
                ),
                deny,
                Some(denied),
            ),
            (
                "v6: a later fragment before its first -> denied, no first seen",
                ext6(&dns6, &[FRAGMENT], 1448, 7),
                deny,
                Some(unplaced),
            ),
            (
                "v6: first fragment of a UDP/53 answer",
                ext6(&dns6, &[FRAGMENT], 1, 7),
                allow,
                None,
            ),
            (
                "v6: its later fragment -> as its first",
                ext6(&dns6, &[FRAGMENT], 1448, 7),
                allow,
                None,
            ),
            (
                "v6: first fragment of TCP/80 from B behind hop-by-hop",
                ext6(&tcp80_6, &[HOPOPTS, FRAGMENT], 1, 8),
                allow,
                None,
            ),
            (
                "v6: its later fragment behind hop-by-hop -> as its first",
                ext6(&tcp80_6, &[HOPOPTS, FRAGMENT], 1448, 8),
                allow,
                None,
            ),
            (
                "v6: first fragment of TCP/81 from B -> denied",
                ext6(&tcp81_6, &[FRAGMENT], 1, 9),
                deny,
                Some(denied),
            ),
            (
                "v6: its later fragment -> denied as its first was",
                ext6(&tcp81_6, &[FRAGMENT], 1448, 9),
                deny,
                Some(denied),
            ),
            (
                "v6: a later fragment of another datagram (identification) -> denied",
                ext6(&dns6, &[FRAGMENT], 1448, 10),
                deny,
                Some(unplaced),
            ),
        ];
        let mut wrong = Vec::new();
        for (name, frame, want, reason) in &table {
            let before = reason.map(|r| fx.drops(r));
            let got = fx.deliver(frame);
            if got != *want {
                wrong.push(format!("{name}: got {got}, want {want}"));
            }
            if let (Some(r), Some(b)) = (reason, before)
                && fx.drops(*r) != b + 1
            {
                wrong.push(format!("{name}: not counted under reason {r}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    });
}

/// A flow's entry stands for the peer it was admitted with (or opened
/// to), not for its tuple: C's port writing B's address and the exact
/// tuple of B's admitted flow to A, or of the reply to A's flow to B, is
/// checked as a new flow and denied (C's identity has no rule); B's own
/// packets of both flows pass before and after. An ICMP error about A's
/// flow passes whoever sends it (routers on the way do).
#[test]
fn an_admitted_flows_tuple_passes_only_for_its_peer() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        add_b(&mut fx);
        run(&[
            "ip", "link", "add", "pf-c", "type", "veth", "peer", "name", "pf-vc",
        ]);
        run(&["ip", "link", "set", "pf-c", "up"]);
        let c_port = vmpath::sys::netif::ifindex_of("pf-c").unwrap();
        let maps = fx.dp.maps_mut();
        maps.ports
            .insert(
                c_port,
                PortInfo {
                    port_id: 3,
                    network: NET,
                    mac: [0x52, 0x54, 0, 0, 0x0d, 3],
                    flags: 0,
                    gw_mac: GW_MAC,
                    _pad: 0,
                    ip4: C,
                    ip6: [0; 16],
                },
                0,
            )
            .unwrap();
        maps.policy_endpoints
            .set(
                3,
                PolicyEndpoint {
                    flags: 0,
                    identity: ID_C,
                },
                0,
            )
            .unwrap();
        let b_port = fx.peer_port;
        let admitted = tcp(B, A, 40000, 80);
        let out = udp(A, B, 5000, 81);
        let reply = udp(B, A, 81, 5000);
        let error = unreachable(C, &out);
        let table: Vec<(&str, u32, &[u8], u32)> = vec![
            ("B's flow, admitted", b_port, &admitted, TC_ACT_REDIRECT),
            (
                "C's port, B's address and tuple",
                c_port,
                &admitted,
                TC_ACT_SHOT,
            ),
            ("B's flow again", b_port, &admitted, TC_ACT_REDIRECT),
            (
                "C's port, the reply to A's flow to B",
                c_port,
                &reply,
                TC_ACT_SHOT,
            ),
            ("B's reply", b_port, &reply, TC_ACT_REDIRECT),
            (
                "C's port, an ICMP error about A's flow",
                c_port,
                &error,
                TC_ACT_REDIRECT,
            ),
            (
                "B's flow after all that",
                b_port,
                &admitted,
                TC_ACT_REDIRECT,
            ),
        ];
        let mut wrong = Vec::new();
        for (name, from, frame, want) in &table {
            if name.contains("reply to A's flow") {
                fx.send(&out);
            }
            let got = fx.deliver_from(*from, frame);
            if got != *want {
                wrong.push(format!("{name}: got {got}, want {want}"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert_eq!(
            fx.drops(drop_reason::POLICY_DENIED_EGRESS),
            0,
            "A's flow out"
        );
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_INGRESS), 2);
    });
}

/// The solicited-node multicast MAC of A6 (33:33:ff + its last 3 bytes).
const A6_SOLICITED_MAC: [u8; 6] = [0x33, 0x33, 0xff, 0, 0, 1];

/// A UDP frame, IPv4 or IPv6 by the addresses' length.
fn udp_frame(macs: ([u8; 6], [u8; 6]), src: &[u8], dst: &[u8], sp: u16, dp: u16) -> Vec<u8> {
    let b = PacketBuilder::ethernet2(macs.0, macs.1);
    let b = match (src.len(), dst.len()) {
        (4, 4) => b.ipv4(src.try_into().unwrap(), dst.try_into().unwrap(), 64),
        _ => b.ipv6(src.try_into().unwrap(), dst.try_into().unwrap(), 64),
    };
    let mut v = Vec::new();
    b.udp(sp, dp)
        .write(&mut v, b"vmpath policy fixture")
        .unwrap();
    v
}

/// An ICMPv6 echo request from B6 to A6 in a frame to `dst_mac`.
fn echo6_to_a(dst_mac: [u8; 6]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, dst_mac)
        .ipv6(B6, A6, 64)
        .icmpv6_echo_request(0x77, 1)
        .write(&mut v, b"ping")
        .unwrap();
    v
}

/// An ICMPv6 destination-unreachable from `from` to A6, in a frame to
/// `dst_mac`, quoting `sent` (an IPv6 frame A sent).
fn unreachable6(dst_mac: [u8; 6], from: [u8; 16], sent: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, dst_mac)
        .ipv6(from, A6, 64)
        .icmpv6_raw(1, 4, [0; 4])
        .write(&mut v, &sent[14..14 + 48])
        .unwrap();
    v
}

/// A, B (both isolated for ingress) and C (not isolated: `c_flags`) as
/// local ports of one network, each reachable by its MAC; B's and A's
/// IPv6 addresses in the identity cache. Returns C's ifindex.
fn add_local_abc(fx: &mut Fx, c_flags: u32) -> u32 {
    add_b(fx);
    run(&[
        "ip", "link", "add", "pf-c", "type", "veth", "peer", "name", "pf-vc",
    ]);
    run(&["ip", "link", "set", "pf-c", "up"]);
    run(&["ip", "link", "set", "pf-vc", "up"]);
    let c_port = vmpath::sys::netif::ifindex_of("pf-c").unwrap();
    let a_port = fx.port;
    let maps = fx.dp.maps_mut();
    for (mac, ifindex, port_id, identity) in [
        (A_MAC, a_port, PORT_ID, ID_A),
        (C_MAC, c_port, C_PORT_ID, ID_C),
    ] {
        let ep = Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex,
            port_id,
            identity,
            ..Default::default()
        };
        maps.endpoints
            .insert(EndpointKey::new(NET, mac), ep, 0)
            .unwrap();
    }
    maps.ports
        .insert(
            c_port,
            PortInfo {
                port_id: C_PORT_ID,
                network: NET,
                mac: C_MAC,
                flags: 0,
                gw_mac: GW_MAC,
                _pad: 0,
                ip4: C,
                ip6: C6,
            },
            0,
        )
        .unwrap();
    let nr = aya::util::nr_cpus().unwrap();
    for id in [B_PORT_ID, C_PORT_ID] {
        maps.port_stats
            .set(
                id,
                aya::maps::PerCpuValues::try_from(vec![PortStats::default(); nr]).unwrap(),
                0,
            )
            .unwrap();
    }
    maps.policy_endpoints
        .set(
            C_PORT_ID,
            PolicyEndpoint {
                flags: c_flags,
                identity: ID_C,
            },
            0,
        )
        .unwrap();
    // ICMPv6 from a port needs its network (the gateway's ND).
    maps.networks
        .insert(
            NET,
            NetworkInfo {
                gw_mac: GW_MAC,
                mtu: 1500,
                ..Default::default()
            },
            0,
        )
        .unwrap();
    for (addr, id) in [(A6, ID_A), (B6, ID_B)] {
        maps.policy_ipcache
            .insert(
                &Key::new(IdentityPrefix::v6_len(128), IdentityPrefix::v6(NET, addr)),
                id,
                0,
            )
            .unwrap();
    }
    c_port
}

/// The reply to a flow an isolated endpoint opened passes from the peer
/// the flow went to, and only from it, whether the flow was switched to
/// the peer's MAC (the peer recorded by endpoint: its port's identity)
/// or routed through the gateway (by address: a local port has the
/// address's identity only when it is its own). A opens UDP 81 to B
/// (its egress allows it); A's ingress allows no UDP from B or C. B's
/// reply through `vm_port` passes (the regression the first attempt
/// had: it was denied); C's port writing B's address and the reply's
/// exact tuple is a new flow, denied; IPv4 and IPv6.
#[test]
fn a_reply_passes_only_from_the_peer_the_flow_went_to() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        let c_port = add_local_abc(&mut fx, 0);
        let (from_b, from_c) = (skb_ctx(fx.peer_port), skb_ctx(c_port));
        let denied_in = |fx: &Fx| fx.drops(drop_reason::POLICY_DENIED_INGRESS);
        // (name, A's frame out, the reply's frame, from B or C, passes)
        let mut sp = 7100u16;
        let mut wrong = Vec::new();
        for (a, b) in [(&A[..], &B[..]), (&A6[..], &B6[..])] {
            for (how, dst_mac) in [("switched", PEER_MAC), ("routed", GW_MAC)] {
                sp += 1;
                let out = udp_frame((A_MAC, dst_mac), a, b, sp, 81);
                let reply = udp_frame((PEER_MAC, A_MAC), b, a, 81, sp);
                let forged = udp_frame((C_MAC, A_MAC), b, a, 81, sp);
                let family = if a.len() == 4 { "IPv4" } else { "IPv6" };
                let drops = fx.drops(drop_reason::POLICY_DENIED_EGRESS);
                fx.send(&out);
                if fx.drops(drop_reason::POLICY_DENIED_EGRESS) != drops {
                    wrong.push(format!("{family} {how}: A's flow out denied"));
                }
                let table: [(&str, &[u8; SKB_CTX_LEN], &[u8], bool); 4] = [
                    ("B's reply", &from_b, &reply, true),
                    ("C's port, the reply's tuple", &from_c, &forged, false),
                    ("B's reply again", &from_b, &reply, true),
                    ("C's port again", &from_c, &forged, false),
                ];
                for (name, ctx, frame, passes) in table {
                    let (tx_a, denied) = (tx(&fx, PORT_ID), denied_in(&fx));
                    let got = fx.run(prog_names::VM_PORT, ctx, frame);
                    let delivered = tx(&fx, PORT_ID) > tx_a;
                    let counted = denied_in(&fx) > denied;
                    let want = if passes { TC_ACT_REDIRECT } else { TC_ACT_SHOT };
                    if got != want || delivered != passes || counted == passes {
                        wrong.push(format!(
                            "{family} {how}, {name}: got {got} (delivered {delivered}, \
                             counted as denied {counted}), want {want}"
                        ));
                    }
                }
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    });
}

/// (name, frame from B, verdict, delivered to A, delivered to C, more
/// `policy_denied_ingress`)
type FloodRow = (&'static str, Vec<u8>, u32, bool, bool, u64);

/// Every delivery path applies the receiver's ingress policy, flooding
/// included, and every withholding is a counted drop: an ICMPv6 echo (or
/// a forged ICMPv6 error) in a solicited-node multicast frame, to the
/// unicast address of A (isolated for ingress, no rule for B), reaches
/// the network's ports not isolated for ingress (C) but not A, and counts
/// one `policy_denied_ingress` (B, the sender, is isolated too but a
/// flood never goes back to it); the same echo to A's MAC is denied by
/// A's ingress policy, as before.
#[test]
fn a_multicast_frame_to_an_isolated_endpoint_is_withheld_as_policy_denied_ingress() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        let c_port = add_local_abc(&mut fx, 0);
        let (a_port, b_port) = (fx.port, fx.peer_port);
        let maps = fx.dp.maps_mut();
        let mut all = FloodList::default();
        for (i, (ifindex, id)) in [(a_port, PORT_ID), (b_port, B_PORT_ID), (c_port, C_PORT_ID)]
            .into_iter()
            .enumerate()
        {
            all.ifindex[i] = ifindex;
            all.port_id[i] = id;
        }
        all.count = 3;
        let mut guarded = FloodList::default();
        guarded.ifindex[0] = c_port;
        guarded.port_id[0] = C_PORT_ID;
        guarded.count = 1;
        guarded.withheld = 2;
        maps.flood.insert(NET, all, 0).unwrap();
        maps.policy_flood.insert(NET, guarded, 0).unwrap();
        let from_b = skb_ctx(b_port);
        let never = udp_frame((A_MAC, PEER_MAC), &A6, &B6, 7300, 81);
        let table: Vec<FloodRow> = vec![
            (
                "echo to A6 in a 33:33:ff frame",
                echo6_to_a(A6_SOLICITED_MAC),
                TC_ACT_REDIRECT,
                false,
                true,
                1,
            ),
            (
                "the same echo to A's MAC",
                echo6_to_a(A_MAC),
                TC_ACT_SHOT,
                false,
                false,
                1,
            ),
            (
                "a forged ICMPv6 error to A6 in a 33:33:ff frame",
                unreachable6(A6_SOLICITED_MAC, B6, &never),
                TC_ACT_REDIRECT,
                false,
                true,
                1,
            ),
        ];
        let mut wrong = Vec::new();
        for (name, frame, verdict, to_a, to_c, denied) in &table {
            let before = (
                tx(&fx, PORT_ID),
                tx(&fx, C_PORT_ID),
                fx.drops(drop_reason::POLICY_DENIED_INGRESS),
            );
            let got = fx.run(prog_names::VM_PORT, &from_b, frame);
            let after = (
                tx(&fx, PORT_ID),
                tx(&fx, C_PORT_ID),
                fx.drops(drop_reason::POLICY_DENIED_INGRESS),
            );
            let want = (
                before.0 + u64::from(*to_a),
                before.1 + u64::from(*to_c),
                before.2 + denied,
            );
            if got != *verdict || after != want {
                let drops: Vec<(usize, u64)> = fx
                    .dp
                    .maps()
                    .drop_counts()
                    .unwrap()
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|(_, n)| *n != 0)
                    .collect();
                wrong.push(format!(
                    "{name}: got {got} (tx A, tx C, denied) {after:?}, want {verdict} {want:?}; \
                     drops by reason so far {drops:?}"
                ));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    });
}

/// ICMP errors pass only for flows that exist, IPv4 and IPv6: A (isolated
/// for ingress, no ICMP rule) opened UDP 81 to B; a destination
/// unreachable quoting that flow passes whoever sends it (a router on
/// the way); one quoting a flow that never was is denied as
/// `policy_denied_ingress`.
#[test]
fn icmp_errors_pass_only_for_flows_that_exist_ipv4_and_ipv6() {
    in_fresh_netns(|| {
        let mut fx = Fx::new();
        add_local_abc(&mut fx, 0);
        let out4 = udp_frame((A_MAC, PEER_MAC), &A, &B, 7400, 81);
        let out6 = udp_frame((A_MAC, PEER_MAC), &A6, &B6, 7400, 81);
        fx.send(&out4);
        fx.send(&out6);
        assert_eq!(
            fx.drops(drop_reason::POLICY_DENIED_EGRESS),
            0,
            "A's flows out"
        );
        let never4 = udp_frame((A_MAC, PEER_MAC), &A, &B, 7401, 81);
        let never6 = udp_frame((A_MAC, PEER_MAC), &A6, &B6, 7401, 81);
        // (name, frame delivered to A, verdict)
        let table: Vec<(&str, Vec<u8>, u32)> = vec![
            (
                "ICMPv4 unreachable quoting A's flow",
                unreachable(WORLD, &out4),
                TC_ACT_REDIRECT,
            ),
            (
                "ICMPv4 unreachable quoting no flow",
                unreachable(WORLD, &never4),
                TC_ACT_SHOT,
            ),
            (
                "ICMPv6 unreachable quoting A's flow",
                unreachable6(A_MAC, C6, &out6),
                TC_ACT_REDIRECT,
            ),
            (
                "ICMPv6 unreachable quoting no flow",
                unreachable6(A_MAC, C6, &never6),
                TC_ACT_SHOT,
            ),
        ];
        let mut wrong = Vec::new();
        let mut denied = 0;
        for (name, frame, want) in &table {
            let got = fx.deliver(frame);
            if got != *want {
                wrong.push(format!("{name}: got {got}, want {want}"));
            }
            denied += u64::from(*want == TC_ACT_SHOT);
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        assert_eq!(fx.drops(drop_reason::POLICY_DENIED_INGRESS), denied);
    });
}
