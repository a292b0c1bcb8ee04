//! NetworkPolicy, after Cilium: no rule list is walked per packet. The
//! agent gives every label set (and every ipBlock region) an identity,
//! `vmp_pol_ipcache` maps (network, address) to the peer's identity, and
//! `vmp_pol_rules` holds what each endpoint allows keyed by (endpoint,
//! direction, peer identity, protocol, port) with wildcards as shorter
//! prefixes. A new flow is checked once, on the sender's port (egress)
//! and right before delivery to a local port (ingress); what it allowed
//! goes into `vmp_pol_flows`, so its later packets and its replies pass
//! on one lookup, and so do ICMP errors about it.
//!
//! Endpoints no policy selects cost one array lookup. ARP, neighbour
//! discovery, MLD and DHCP always pass: the gateway answers them.
//! A full flow table forgets its oldest flows (LRU); their next packet is
//! checked against policy again, never let through unchecked.

use aya_ebpf::{
    btf_maps::{Array, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    helpers::bpf_ktime_get_ns,
    macros::btf_map,
    programs::TcContext,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr};
use vmpath_common::{
    IdentityPrefix, POL_F_EGRESS, POL_F_INGRESS, POLICY_FLOW_OTHER_TIMEOUT_NS,
    POLICY_FLOW_TCP_TIMEOUT_NS, POLICY_LEN_FULL, POLICY_NONE, PolicyEndpoint, PolicyFlow,
    PolicyFlowKey, PolicyRuleKey, PolicyStats, addr_family, drop_reason, identity, maps,
    policy_dir,
};

use crate::{
    maps::PORTS,
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, hdr,
    },
    spoof,
};

/// Port id -> isolation flags and identity of the endpoint.
#[btf_map(name = "vmp_pol_ep")]
pub static POLICY_ENDPOINTS: Array<
    PolicyEndpoint,
    { maps::POLICY_ENDPOINTS.max_entries as usize },
> = Array::new();

/// (network, address prefix) -> identity.
#[btf_map(name = "vmp_pol_ipcache")]
pub static POLICY_IPCACHE: LpmTrie<
    IdentityPrefix,
    u32,
    { maps::POLICY_IPCACHE.max_entries as usize },
> = LpmTrie::new();

/// (endpoint, direction, identity, protocol, port prefix) -> policy index.
#[btf_map(name = "vmp_pol_rules")]
pub static POLICY_RULES: LpmTrie<PolicyRuleKey, u32, { maps::POLICY_RULES.max_entries as usize }> =
    LpmTrie::new();

/// Flows policy allowed, keyed as first seen by the endpoint.
#[btf_map(name = "vmp_pol_flows")]
pub static POLICY_FLOWS: LruHashMap<
    PolicyFlowKey,
    PolicyFlow,
    { maps::POLICY_FLOWS.max_entries as usize },
> = LruHashMap::new();

/// Port id -> allowed flows and denied packets, per CPU.
#[btf_map(name = "vmp_pol_stats")]
pub static POLICY_STATS: PerCpuArray<PolicyStats, { maps::POLICY_STATS.max_entries as usize }> =
    PerCpuArray::new();

/// Policy index -> flows it allowed, per CPU.
#[btf_map(name = "vmp_pol_hits")]
pub static POLICY_HITS: PerCpuArray<u64, { maps::POLICY_HITS.max_entries as usize }> =
    PerCpuArray::new();

const IPPROTO_SCTP: u8 = 132;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_ECHO: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const ICMPV6_ERROR_MAX: u8 = 4;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// What policy looks at in a packet: its 5-tuple as the endpoint sees it.
/// For an ICMP error, the tuple of a reply to the packet it quotes, and
/// `opens: false`: an error never opens a flow.
struct Tuple {
    family: u8,
    proto: u8,
    sport: u16,
    dport: u16,
    src: [u8; 16],
    dst: [u8; 16],
    opens: bool,
}

/// Checks a packet the endpoint with `port_id` on `network` sends:
/// `Err(POLICY_DENIED_EGRESS)` when its policy denies it.
#[inline(never)]
pub fn egress(ctx: &TcContext, port_id: u32, network: u32) -> Result<(), u32> {
    check(ctx, port_id, network, policy_dir::EGRESS)
}

/// Checks a packet about to be delivered to the local port `ifindex`
/// (`port_id`): `Err(POLICY_DENIED_INGRESS)` when its policy denies it.
#[inline(never)]
pub fn ingress(ctx: &TcContext, ifindex: u32, port_id: u32) -> Result<(), u32> {
    let Some(ep) = POLICY_ENDPOINTS.get(port_id) else {
        return Ok(());
    };
    if ep.flags == 0 {
        return Ok(());
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        return Ok(());
    };
    check(ctx, port_id, port.network, policy_dir::INGRESS)
}

/// Whether a flooded frame may reach the port `port_id`: a port isolated
/// for ingress takes only what needs no policy (ARP, ND, MLD, DHCP) from
/// a flood; unicast IP reaches it through `ingress`.
#[inline(always)]
pub fn flood_allowed(ctx: &TcContext, port_id: u32) -> bool {
    match POLICY_ENDPOINTS.get(port_id) {
        Some(ep) if ep.flags & POL_F_INGRESS != 0 => matches!(tuple(ctx), Ok(None)),
        _ => true,
    }
}

#[inline(always)]
fn check(ctx: &TcContext, port_id: u32, network: u32, dir: u8) -> Result<(), u32> {
    let Some(ep) = POLICY_ENDPOINTS.get(port_id) else {
        return Ok(());
    };
    let flags = ep.flags;
    if flags == 0 {
        return Ok(());
    }
    let Some(t) = tuple(ctx)? else {
        return Ok(());
    };
    // SAFETY: a helper call without arguments; it touches no memory of ours.
    let now = unsafe { bpf_ktime_get_ns() };
    if tracked(port_id, dir, &t, now) {
        return Ok(());
    }
    let isolated = if dir == policy_dir::INGRESS {
        flags & POL_F_INGRESS != 0
    } else {
        flags & POL_F_EGRESS != 0
    };
    let policy = if isolated {
        let peer = if dir == policy_dir::INGRESS {
            &t.src
        } else {
            &t.dst
        };
        match allowed_by(port_id, dir, identity_of(network, t.family, peer), &t) {
            Some(p) if t.opens => p,
            _ => {
                let reason = if dir == policy_dir::INGRESS {
                    drop_reason::POLICY_DENIED_INGRESS
                } else {
                    drop_reason::POLICY_DENIED_EGRESS
                };
                count(port_id, dir, false);
                crate::monitor::policy(ctx, port_id, dir, reason, POLICY_NONE);
                return Err(reason);
            }
        }
    } else if t.opens {
        POLICY_NONE
    } else {
        return Ok(());
    };
    let key = flow_key(port_id, dir, &t, false);
    let flow = PolicyFlow {
        last_seen: now,
        policy,
        _pad: 0,
    };
    // A full table evicts its oldest flow (LRU); should the insert still
    // fail, the flow's next packet is checked again.
    let _ = POLICY_FLOWS.insert(&key, &flow, 0);
    count(port_id, dir, true);
    if policy != POLICY_NONE {
        if let Some(hits) = POLICY_HITS.get_ptr_mut(policy) {
            // SAFETY: this CPU's slot of a per-CPU array, no other writer.
            unsafe { *hits += 1 };
        }
    }
    crate::monitor::policy(ctx, port_id, dir, 0, policy);
    Ok(())
}

/// A flow this endpoint opened the same way, or a reply to one it opened
/// the other way, seen recently enough.
#[inline(always)]
fn tracked(port_id: u32, dir: u8, t: &Tuple, now: u64) -> bool {
    let timeout = if t.proto == IPPROTO_TCP {
        POLICY_FLOW_TCP_TIMEOUT_NS
    } else {
        POLICY_FLOW_OTHER_TIMEOUT_NS
    };
    for reply in [false, true] {
        let key = flow_key(port_id, dir, t, reply);
        if let Some(flow) = POLICY_FLOWS.get_ptr_mut(&key) {
            // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above,
            // valid for this run; a racing writer only writes a time.
            unsafe {
                if now.saturating_sub((*flow).last_seen) < timeout {
                    (*flow).last_seen = now;
                    return true;
                }
            }
        }
    }
    false
}

/// The flow key of `t` going `dir`; `reply`: the key of the flow `t`
/// answers (opened the other way, ends swapped).
#[inline(always)]
fn flow_key(port_id: u32, dir: u8, t: &Tuple, reply: bool) -> PolicyFlowKey {
    if reply {
        PolicyFlowKey {
            port_id,
            sport: t.dport,
            dport: t.sport,
            family: t.family,
            proto: t.proto,
            direction: dir ^ 1,
            _pad: 0,
            src: t.dst,
            dst: t.src,
        }
    } else {
        PolicyFlowKey {
            port_id,
            sport: t.sport,
            dport: t.dport,
            family: t.family,
            proto: t.proto,
            direction: dir,
            _pad: 0,
            src: t.src,
            dst: t.dst,
        }
    }
}

#[inline(always)]
fn identity_of(network: u32, family: u8, addr: &[u8; 16]) -> u32 {
    let (len, data) = if family == addr_family::IPV4 {
        (
            IdentityPrefix::v4_len(32),
            IdentityPrefix::v4(network, [addr[0], addr[1], addr[2], addr[3]]),
        )
    } else {
        (
            IdentityPrefix::v6_len(128),
            IdentityPrefix::v6(network, *addr),
        )
    };
    match POLICY_IPCACHE.get(&Key::new(len, data)) {
        Some(id) => *id,
        None => identity::WORLD,
    }
}

/// The policy allowing `t` from or to `peer`: a rule for that identity,
/// else one for any peer (each with its protocol and port wildcards, by
/// longest prefix).
#[inline(always)]
fn allowed_by(port_id: u32, dir: u8, peer: u32, t: &Tuple) -> Option<u32> {
    for id in [peer, identity::ANY] {
        let key = PolicyRuleKey::new(port_id, dir, id, t.proto, t.dport);
        if let Some(p) = POLICY_RULES.get(&Key::new(POLICY_LEN_FULL, key)) {
            return Some(*p);
        }
    }
    None
}

#[inline(always)]
fn count(port_id: u32, dir: u8, allowed: bool) {
    if let Some(s) = POLICY_STATS.get_ptr_mut(port_id) {
        // SAFETY: this CPU's slot of a per-CPU array, no other writer.
        unsafe {
            match (dir == policy_dir::INGRESS, allowed) {
                (true, true) => (*s).allowed_ingress += 1,
                (false, true) => (*s).allowed_egress += 1,
                (true, false) => (*s).denied_ingress += 1,
                (false, false) => (*s).denied_egress += 1,
            }
        }
    }
}

/// The packet's tuple, or `None` for what policy never looks at: no IP,
/// neighbour discovery and MLD, DHCP.
#[inline(always)]
fn tuple(ctx: &TcContext) -> Result<Option<Tuple>, u32> {
    let eth = hdr::<EthHdr>(ctx, 0)?;
    match u16::from_be(eth.ether_type) {
        ETH_P_IP => ipv4(ctx),
        ETH_P_IPV6 => ipv6(ctx),
        _ => Ok(None),
    }
}

#[inline(always)]
fn v4_addr(a: [u8; 4]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0] = a[0];
    out[1] = a[1];
    out[2] = a[2];
    out[3] = a[3];
    out
}

#[inline(always)]
fn ports_at(ctx: &TcContext, off: usize) -> Result<(u16, u16), u32> {
    let p = hdr::<[u8; 4]>(ctx, off)?;
    Ok((
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    ))
}

#[inline(always)]
fn is_dhcp(sport: u16, dport: u16) -> bool {
    matches!(
        (sport, dport),
        (68, 67) | (67, 68) | (546, 547) | (547, 546)
    )
}

#[inline(always)]
fn ipv4(ctx: &TcContext) -> Result<Option<Tuple>, u32> {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (proto, src, dst, vihl, frags) = (ip.proto, ip.src_addr, ip.dst_addr, ip.vihl, ip.frags);
    let l4 = ETH_LEN + usize::from(vihl & 0x0f) * 4;
    let mut t = Tuple {
        family: addr_family::IPV4,
        proto,
        sport: 0,
        dport: 0,
        src: v4_addr(src),
        dst: v4_addr(dst),
        opens: true,
    };
    // A later fragment carries no transport header: only rules for any
    // port of its protocol can allow it.
    if u16::from_be_bytes(frags) & 0x1fff != 0 {
        return Ok(Some(t));
    }
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            let (s, d) = ports_at(ctx, l4)?;
            if proto == IPPROTO_UDP && is_dhcp(s, d) {
                return Ok(None);
            }
            t.sport = s;
            t.dport = d;
        }
        IPPROTO_ICMP => {
            let h = hdr::<[u8; 8]>(ctx, l4)?;
            match h[0] {
                ICMP_ECHO | ICMP_ECHO_REPLY => {
                    let id = u16::from_be_bytes([h[4], h[5]]);
                    t.sport = id;
                    t.dport = id;
                }
                ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM => {
                    let inner = hdr::<Ipv4Hdr>(ctx, l4 + 8)?;
                    let (iproto, isrc, idst, ivihl) =
                        (inner.proto, inner.src_addr, inner.dst_addr, inner.vihl);
                    let il4 = l4 + 8 + usize::from(ivihl & 0x0f) * 4;
                    let (is, id) = inner_ports4(ctx, il4, iproto)?;
                    // A reply to the quoted packet: its ends swapped.
                    t.proto = iproto;
                    t.src = v4_addr(idst);
                    t.dst = v4_addr(isrc);
                    t.sport = id;
                    t.dport = is;
                    t.opens = false;
                }
                _ => {}
            }
        }
        _ => {}
    }
    Ok(Some(t))
}

#[inline(always)]
fn inner_ports4(ctx: &TcContext, off: usize, proto: u8) -> Result<(u16, u16), u32> {
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => ports_at(ctx, off),
        IPPROTO_ICMP => {
            let h = hdr::<[u8; 8]>(ctx, off)?;
            let id = u16::from_be_bytes([h[4], h[5]]);
            Ok((id, id))
        }
        _ => Ok((0, 0)),
    }
}

#[inline(always)]
fn ipv6(ctx: &TcContext) -> Result<Option<Tuple>, u32> {
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let (next, src, dst) = (ip.next_hdr, ip.src_addr, ip.dst_addr);
    let (proto, l4) = spoof::upper_layer6(ctx, next)?;
    let mut t = Tuple {
        family: addr_family::IPV6,
        proto,
        sport: 0,
        dport: 0,
        src,
        dst,
        opens: true,
    };
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            let (s, d) = ports_at(ctx, l4)?;
            if proto == IPPROTO_UDP && is_dhcp(s, d) {
                return Ok(None);
            }
            t.sport = s;
            t.dport = d;
        }
        IPPROTO_ICMPV6 => {
            let h = hdr::<[u8; 8]>(ctx, l4)?;
            match h[0] {
                ICMPV6_ECHO_REQUEST | ICMPV6_ECHO_REPLY => {
                    let id = u16::from_be_bytes([h[4], h[5]]);
                    t.sport = id;
                    t.dport = id;
                }
                1..=ICMPV6_ERROR_MAX => {
                    let inner = hdr::<Ipv6Hdr>(ctx, l4 + 8)?;
                    let (inext, isrc, idst) = (inner.next_hdr, inner.src_addr, inner.dst_addr);
                    let (is, id) = match inext {
                        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
                            ports_at(ctx, l4 + 8 + Ipv6Hdr::LEN)?
                        }
                        IPPROTO_ICMPV6 => {
                            let h = hdr::<[u8; 8]>(ctx, l4 + 8 + Ipv6Hdr::LEN)?;
                            let id = u16::from_be_bytes([h[4], h[5]]);
                            (id, id)
                        }
                        _ => (0, 0),
                    };
                    t.proto = inext;
                    t.src = idst;
                    t.dst = isrc;
                    t.sport = id;
                    t.dport = is;
                    t.opens = false;
                }
                // Neighbour discovery, MLD and router messages: the
                // gateway's business, never policy's.
                130..=137 | 143 => return Ok(None),
                _ => {}
            }
        }
        _ => {}
    }
    Ok(Some(t))
}
