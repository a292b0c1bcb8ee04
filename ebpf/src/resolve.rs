//! Neighbour resolution over the overlay, for endpoints no config places.
//!
//! An address a VM only uses (learned, on an IPAM-less network) is known
//! on its own node alone. When the fabric delivers traffic for it to
//! another node of the network (every node advertises the subnet), that
//! node's uplink finds no `vmp_routed` entry. For an address inside the
//! subnet of a learning ingress network (`vmp_resolve_prefixes`) it does
//! what a router on the segment does: it asks, with an ARP request (IPv4)
//! or a neighbour solicitation (IPv6) from the gateway, sent over the
//! overlay to the network's other nodes, and drops the frame meanwhile
//! (`ingress_unresolved`). The node that serves the address (its own
//! `vmp_routed` entry, where only what its learned-address stage accepted
//! is) answers in `vxlan_rx` with the endpoint's MAC; every other node
//! drops the request (`overlay_resolve_not_here`). The answer is kept in
//! `vmp_resolved` with the node that gave it, and later frames are relayed
//! there like any routed ingress for a VM on another node.
//!
//! Safety rules: only answers to requests this node sent in the last
//! `RESOLVE_ANSWER_WINDOW_NS` count; an answer never names a MAC this node
//! places elsewhere or an address it routes itself (a configured address
//! wins); the first node to answer keeps the address until its answer
//! expires (`RESOLVED_TTL_NS`), others are refused
//! (`overlay_resolve_refused`). One address is asked for at most once a
//! second, and the node's requests share a token bucket per CPU
//! (`RESOLVE_RATE`, `RESOLVE_BURST`; over it: `ingress_resolve_limited`):
//! a scan of the subnet from the fabric costs the overlay at most that.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    btf_maps::{LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    helpers::generated::bpf_skb_change_tail,
    macros::btf_map,
    programs::TcContext,
};
use network_types::{arp::ArpHdr, eth::EthHdr, ip::Ipv6Hdr};
use vmpath_common::{
    AddrKey, ENDPOINT_LOCAL, EndpointKey, MeterBucket, MeterLimit, NET_F_GW4, NET_F_ROUTED,
    NetworkInfo, RESOLVE_ANSWER_WINDOW_NS, RESOLVE_BURST, RESOLVE_RATE, RESOLVE_RETRY_NS,
    RESOLVED_REFRESH_NS, RESOLVED_TTL_NS, ROUTED_F_INBOUND, ResolvePrefix, ResolvedAddr,
    RoutedAddr, drop_reason, maps,
};

use crate::{
    clock, counters, csum,
    maps::{ENDPOINTS, NETWORKS},
    meter, nd, overlay,
    parse::{ETH_LEN, ETH_P_ARP, ETH_P_IPV6, IPPROTO_ICMPV6, hdr, hdr_mut, is_multicast, mac_eq},
    route::ROUTED,
    verdict::Verdict,
};

/// Subnets of this node's learning ingress networks -> network id.
#[btf_map(name = "vmp_resolve_prefixes")]
static RESOLVE_PREFIXES: LpmTrie<
    ResolvePrefix,
    u32,
    { maps::RESOLVE_PREFIXES.max_entries as usize },
> = LpmTrie::new();

/// (network, IP) -> when asked, and the node and MAC that answered.
#[btf_map(name = "vmp_resolved")]
static RESOLVED: LruHashMap<AddrKey, ResolvedAddr, { maps::RESOLVED.max_entries as usize }> =
    LruHashMap::new();

/// Slot 0: the node's budget of requests, per CPU.
#[btf_map(name = "vmp_resolve_meter")]
static RESOLVE_METER: PerCpuArray<MeterBucket, { maps::RESOLVE_METER.max_entries as usize }> =
    PerCpuArray::new();

const ARP_REQUEST: u16 = 1;
const ARP_REPLY: u16 = 2;
const ARP_FRAME_LEN: usize = ETH_LEN + 28;
const IPV6_LEN: usize = 40;
const L4_OFF: usize = ETH_LEN + IPV6_LEN;
/// type, code, checksum, reserved, target, one link-layer address option.
const ND_MSG_LEN: usize = 4 + 4 + 16 + 8;
const NS_FRAME_LEN: usize = L4_OFF + ND_MSG_LEN;
const ND_NEIGHBOR_SOLICIT: u8 = 135;
const ND_HOP_LIMIT: u8 = 255;
const OPT_SOURCE_LLA: u8 = 1;
const OPT_TARGET_LLA: u8 = 2;

/// What the uplink does with a frame no `vmp_routed` entry names.
pub enum Lookup {
    /// Not inside a learning ingress network's subnet: the host's.
    Host,
    /// Answered: routed like a `vmp_routed` entry of a VM on `node`;
    /// `refresh`: the answer is getting old, ask again as well.
    Route {
        r: RoutedAddr,
        node: [u8; 4],
        refresh: bool,
    },
    /// The frame became the request (already sent on).
    Sent(i32),
}

#[inline(always)]
pub fn lookup4(ctx: &TcContext, dst: [u8; 4]) -> Result<Lookup, u32> {
    let (len, prefix) = ResolvePrefix::v4(dst, 32);
    let Some(network) = RESOLVE_PREFIXES.get(&Key::new(len, prefix)).copied() else {
        return Ok(Lookup::Host);
    };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&network) }) else {
        return Ok(Lookup::Host);
    };
    match decide(network, net, &AddrKey::v4(network, dst))? {
        Some(route) => Ok(route),
        None => ask4(ctx, network, net, dst).map(Lookup::Sent),
    }
}

#[inline(always)]
pub fn lookup6(ctx: &TcContext, dst: &[u8; 16]) -> Result<Lookup, u32> {
    let Some(network) = RESOLVE_PREFIXES
        .get(&Key::new(128, ResolvePrefix { addr: *dst }))
        .copied()
    else {
        return Ok(Lookup::Host);
    };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&network) }) else {
        return Ok(Lookup::Host);
    };
    match decide(network, net, &AddrKey::v6(network, dst))? {
        Some(route) => Ok(route),
        None => ask6(ctx, network, net, dst).map(Lookup::Sent),
    }
}

/// A fresh answer: the route (and whether to ask again as well). None:
/// ask now (the budget is taken and the request recorded). Err: dropped
/// without asking (asked within the last second, or over budget).
#[inline(always)]
fn decide(network: u32, net: &NetworkInfo, key: &AddrKey) -> Result<Option<Lookup>, u32> {
    let now = clock::flow_now();
    // SAFETY: a map lookup; copied out at once.
    let held = unsafe { RESOLVED.get(key) }.copied();
    if let Some(e) = held
        && e.answered_ns != 0
        && now.wrapping_sub(e.answered_ns) < RESOLVED_TTL_NS
    {
        let refresh = now.wrapping_sub(e.answered_ns) > RESOLVED_REFRESH_NS
            && now.wrapping_sub(e.asked_ns) > RESOLVE_RETRY_NS
            && admit();
        if refresh {
            asked(key, held, now);
        }
        let r = RoutedAddr {
            ifindex: 0,
            network,
            vm_mac: e.mac,
            gw_mac: net.gw_mac,
            mtu: net.mtu,
            port_id: if net.flags & NET_F_ROUTED != 0 {
                0
            } else {
                ROUTED_F_INBOUND
            },
        };
        return Ok(Some(Lookup::Route {
            r,
            node: e.node_ip4,
            refresh,
        }));
    }
    if held.is_some_and(|e| now.wrapping_sub(e.asked_ns) < RESOLVE_RETRY_NS) {
        return Err(drop_reason::INGRESS_UNRESOLVED);
    }
    if !admit() {
        return Err(drop_reason::INGRESS_RESOLVE_LIMITED);
    }
    asked(key, held, now);
    // The frame that starts the resolution is lost, as at a router.
    counters::count_drop(vmpath_common::NO_PORT_ID, drop_reason::INGRESS_UNRESOLVED);
    Ok(None)
}

/// Takes one request's worth of the node's budget.
#[inline(always)]
fn admit() -> bool {
    const LIMIT: MeterLimit = MeterLimit::new(RESOLVE_RATE, RESOLVE_BURST);
    let Some(bucket) = RESOLVE_METER.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array, valid for this run; no
    // other writer.
    meter::spend(unsafe { &mut *bucket }, &LIMIT)
}

/// Records that the address was asked for now (keeping any answer).
#[inline(always)]
fn asked(key: &AddrKey, held: Option<ResolvedAddr>, now: u64) {
    let mut e = held.unwrap_or_default();
    e.asked_ns = now;
    let _ = RESOLVED.insert(key, &e, 0);
}

/// Sends a frame ready for the VM (TTL decremented) to the node that
/// answered for it, from the gateway MAC to the VM's; with `refresh`, a
/// copy goes there and the original becomes a new request for `dst`.
#[inline(always)]
pub fn forward4(
    ctx: &TcContext,
    r: &RoutedAddr,
    node: [u8; 4],
    refresh: bool,
    dst: [u8; 4],
) -> Verdict {
    if !to_node(ctx, r, node, refresh)? {
        return overlay::send_to_node(ctx, r.network, node);
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&r.network) }) else {
        return Err(drop_reason::NO_NETWORK);
    };
    ask4(ctx, r.network, net, dst)
}

/// `forward4` for IPv6.
#[inline(always)]
pub fn forward6(
    ctx: &TcContext,
    r: &RoutedAddr,
    node: [u8; 4],
    refresh: bool,
    dst: &[u8; 16],
) -> Verdict {
    if !to_node(ctx, r, node, refresh)? {
        return overlay::send_to_node(ctx, r.network, node);
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&r.network) }) else {
        return Err(drop_reason::NO_NETWORK);
    };
    ask6(ctx, r.network, net, dst)
}

/// Sets the frame's MACs; with `refresh` sends a copy to `node` now and
/// returns true (the original is then the caller's to turn into a
/// request).
#[inline(always)]
fn to_node(ctx: &TcContext, r: &RoutedAddr, node: [u8; 4], refresh: bool) -> Result<bool, u32> {
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.src_addr = r.gw_mac;
    eth.dst_addr = r.vm_mac;
    if refresh {
        overlay::copy_to_node(ctx, r.network, node)?;
    }
    Ok(refresh)
}

/// Turns the frame into the gateway's ARP request for `target` and sends
/// it to every other node of `network`.
#[inline(always)]
fn ask4(ctx: &TcContext, network: u32, net: &NetworkInfo, target: [u8; 4]) -> Verdict {
    resize(ctx, ARP_FRAME_LEN)?;
    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = [0xff; 6];
    e.src_addr = net.gw_mac;
    e.ether_type = ETH_P_ARP.to_be();
    let a = hdr_mut::<ArpHdr>(ctx, ETH_LEN)?;
    a.htype = 1u16.to_be_bytes();
    a.ptype = 0x0800u16.to_be_bytes();
    a.hlen = 6;
    a.plen = 4;
    a.oper = ARP_REQUEST.to_be_bytes();
    a.sha = net.gw_mac;
    a.spa = if net.flags & NET_F_GW4 != 0 {
        net.gw_ip4
    } else {
        [0; 4]
    };
    a.tha = [0; 6];
    a.tpa = target;
    overlay::flood_nodes(ctx, network)
}

/// Turns the frame into the gateway's neighbour solicitation for `target`
/// (from its link-local address, to the target's solicited-node group)
/// and sends it to every other node of `network`.
#[inline(always)]
fn ask6(ctx: &TcContext, network: u32, net: &NetworkInfo, target: &[u8; 16]) -> Verdict {
    // The target's checksum words and its last three bytes (the
    // solicited-node group), before the frame is rewritten.
    let target_sum = csum::sum_addr16(target);
    let (t13, t14, t15) = (target[13], target[14], target[15]);
    let target_words = crate::parse::words16(target);
    resize(ctx, NS_FRAME_LEN)?;
    let m = net.gw_mac;
    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = [0x33, 0x33, 0xff, t13, t14, t15];
    e.src_addr = m;
    e.ether_type = ETH_P_IPV6.to_be();
    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    ip.vcf = [0x60, 0, 0, 0];
    ip.payload_len = (ND_MSG_LEN as u16).to_be_bytes();
    ip.next_hdr = IPPROTO_ICMPV6;
    ip.hop_limit = ND_HOP_LIMIT;
    ip.src_addr = net.gw_ll6;
    ip.dst_addr = [
        0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, t13, t14, t15,
    ];
    let ns = hdr_mut::<[u32; ND_MSG_LEN / 4]>(ctx, L4_OFF)?;
    ns[0] = u32::from_ne_bytes([ND_NEIGHBOR_SOLICIT, 0, 0, 0]);
    ns[1] = 0;
    ns[2] = target_words[0];
    ns[3] = target_words[1];
    ns[4] = target_words[2];
    ns[5] = target_words[3];
    ns[6] = u32::from_ne_bytes([OPT_SOURCE_LLA, 1, m[0], m[1]]);
    ns[7] = u32::from_ne_bytes([m[2], m[3], m[4], m[5]]);
    let group_sum =
        0xff02 + 1 + (0xff00 | u32::from(t13)) + ((u32::from(t14) << 8) | u32::from(t15));
    let sum = csum::sum_addr16(&net.gw_ll6)
        + group_sum
        + target_sum
        + ND_MSG_LEN as u32
        + u32::from(IPPROTO_ICMPV6)
        + (u32::from(ND_NEIGHBOR_SOLICIT) << 8)
        + ((u32::from(OPT_SOURCE_LLA) << 8) | 1)
        + ((u32::from(m[0]) << 8) | u32::from(m[1]))
        + ((u32::from(m[2]) << 8) | u32::from(m[3]))
        + ((u32::from(m[4]) << 8) | u32::from(m[5]));
    let check = (!csum::fold(sum)).to_be_bytes();
    ns[0] = u32::from_ne_bytes([ND_NEIGHBOR_SOLICIT, 0, check[0], check[1]]);
    overlay::flood_nodes(ctx, network)
}

/// Makes the frame exactly `len` bytes, all of it readable.
#[inline(always)]
fn resize(ctx: &TcContext, len: usize) -> Result<(), u32> {
    if ctx.len() as usize != len {
        // SAFETY: the helper takes only our own skb; no packet reference is
        // held across it.
        let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, len as u32, 0) };
        if rc != 0 {
            return Err(drop_reason::HELPER_FAILED);
        }
    }
    if ctx.data() + len > ctx.data_end() && ctx.pull_data(len as u32).is_err() {
        return Err(drop_reason::HELPER_FAILED);
    }
    Ok(())
}

/// The MAC of the endpoint this node serves `ip` for on `network`, from
/// its own `vmp_routed` (configured addresses, and learned ones its
/// learned-address stage accepted).
#[inline(always)]
fn served_here(network: u32, key: &AddrKey) -> Option<[u8; 6]> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let r = unsafe { ROUTED.get(key) }?;
    if r.network != network {
        return None;
    }
    if r.ifindex != 0 {
        return Some(r.vm_mac);
    }
    let ep_key = EndpointKey::new(network, r.vm_mac);
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { ENDPOINTS.get(&ep_key) } {
        Some(ep) if ep.kind == ENDPOINT_LOCAL => Some(r.vm_mac),
        _ => None,
    }
}

/// `vxlan_rx`: is this frame from `src` to `dst` a resolution request of
/// another node's gateway (ARP request or NS, to broadcast or multicast)?
#[inline(always)]
pub fn is_request(src: &[u8; 6], dst: &[u8; 6], net: &NetworkInfo) -> bool {
    is_multicast(dst) && mac_eq(src, &net.gw_mac)
}

/// `vxlan_rx`: answers another node's request (`is_request`) for an
/// address served here, back to that node; any other is dropped.
#[inline(always)]
pub fn answer(ctx: &TcContext, network: u32, ether_type: u16, from: [u8; 4]) -> Verdict {
    if ether_type == ETH_P_ARP {
        let a = hdr_mut::<ArpHdr>(ctx, ETH_LEN)?;
        if a.oper != ARP_REQUEST.to_be_bytes() {
            return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
        }
        let target = a.tpa;
        let Some(mac) = served_here(network, &AddrKey::v4(0, target)) else {
            return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
        };
        let (asker_mac, asker_ip) = (a.sha, a.spa);
        a.oper = ARP_REPLY.to_be_bytes();
        a.sha = mac;
        a.spa = target;
        a.tha = asker_mac;
        a.tpa = asker_ip;
        let e = hdr_mut::<EthHdr>(ctx, 0)?;
        e.dst_addr = asker_mac;
        e.src_addr = mac;
        return overlay::send_to_node(ctx, network, from);
    }
    if ether_type != ETH_P_IPV6 {
        return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
    }
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    if ip.next_hdr != IPPROTO_ICMPV6 {
        return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
    }
    let ns = hdr::<[u8; 24]>(ctx, L4_OFF)?;
    if ns[0] != ND_NEIGHBOR_SOLICIT {
        return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
    }
    let mut target = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        target[i] = ns[8 + i];
        i += 1;
    }
    let Some(mac) = served_here(network, &AddrKey::v6(0, &target)) else {
        return Err(drop_reason::OVERLAY_RESOLVE_NOT_HERE);
    };
    nd::neighbor_advert_as(ctx, target, mac, nd::NA_FLAGS_SO)?;
    overlay::send_to_node(ctx, network, from)
}

/// `vxlan_rx`: is this IPv6 frame to the gateway MAC a neighbour
/// advertisement (the answer to a request of this node's)?
#[inline(always)]
pub fn is_answer6(ctx: &TcContext) -> bool {
    hdr::<Ipv6Hdr>(ctx, ETH_LEN).is_ok_and(|ip| ip.next_hdr == IPPROTO_ICMPV6)
        && hdr::<u8>(ctx, L4_OFF).is_ok_and(|t| *t == nd::ND_NEIGHBOR_ADVERT_MSG)
}

/// `vxlan_rx`: an ARP reply or NA to the gateway MAC: the answer to a
/// request of this node's. Kept if the screens pass, refused (counted)
/// otherwise; consumed either way.
#[inline(always)]
pub fn take(
    ctx: &TcContext,
    network: u32,
    net: &NetworkInfo,
    ether_type: u16,
    from: [u8; 4],
) -> Verdict {
    if ether_type == ETH_P_ARP {
        let a = hdr::<ArpHdr>(ctx, ETH_LEN)?;
        if a.oper != ARP_REPLY.to_be_bytes() {
            return Err(drop_reason::OVERLAY_RESOLVE_REFUSED);
        }
        let (ip, mac) = (a.spa, a.sha);
        return keep(
            network,
            net,
            &AddrKey::v4(network, ip),
            &AddrKey::v4(0, ip),
            mac,
            from,
        );
    }
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    if ip.next_hdr != IPPROTO_ICMPV6 || ip.payload_len != (ND_MSG_LEN as u16).to_be_bytes() {
        return Err(drop_reason::OVERLAY_RESOLVE_REFUSED);
    }
    let na = hdr::<[u8; ND_MSG_LEN]>(ctx, L4_OFF)?;
    if na[0] != nd::ND_NEIGHBOR_ADVERT_MSG || na[24] != OPT_TARGET_LLA || na[25] != 1 {
        return Err(drop_reason::OVERLAY_RESOLVE_REFUSED);
    }
    let mut target = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        target[i] = na[8 + i];
        i += 1;
    }
    let mac = [na[26], na[27], na[28], na[29], na[30], na[31]];
    keep(
        network,
        net,
        &AddrKey::v6(network, &target),
        &AddrKey::v6(0, &target),
        mac,
        from,
    )
}

#[inline(always)]
fn keep(
    network: u32,
    net: &NetworkInfo,
    key: &AddrKey,
    routed_key: &AddrKey,
    mac: [u8; 6],
    from: [u8; 4],
) -> Verdict {
    const REFUSED: u32 = drop_reason::OVERLAY_RESOLVE_REFUSED;
    if is_multicast(&mac) || mac_eq(&mac, &net.gw_mac) {
        return Err(REFUSED);
    }
    // An address this node routes itself (configured, or learned here)
    // is never another's.
    // SAFETY: a map lookup (only its presence is used).
    if unsafe { ROUTED.get(routed_key) }.is_some() {
        return Err(REFUSED);
    }
    // A MAC this node places: here, or on another node than the sender.
    // SAFETY: a map lookup; the value stays valid for this program run.
    if let Some(ep) = unsafe { ENDPOINTS.get(&EndpointKey::new(network, mac)) }
        && (ep.kind == ENDPOINT_LOCAL || ep.node_ip4 != from)
    {
        return Err(REFUSED);
    }
    // SAFETY: a map lookup; copied out at once.
    let Some(e) = (unsafe { RESOLVED.get(key) }).copied() else {
        return Err(REFUSED);
    };
    let now = clock::flow_now();
    if now.wrapping_sub(e.asked_ns) > RESOLVE_ANSWER_WINDOW_NS {
        return Err(REFUSED);
    }
    if e.answered_ns != 0
        && now.wrapping_sub(e.answered_ns) < RESOLVED_TTL_NS
        && (e.node_ip4 != from || !mac_eq(&e.mac, &mac))
    {
        // The first holder keeps it.
        return Err(REFUSED);
    }
    let kept = ResolvedAddr {
        asked_ns: e.asked_ns,
        answered_ns: now,
        node_ip4: from,
        mac,
        _pad: [0; 6],
    };
    // A whole new value: readers see the old answer or the new one.
    let _ = RESOLVED.insert(key, &kept, 0);
    Ok(TC_ACT_SHOT)
}
