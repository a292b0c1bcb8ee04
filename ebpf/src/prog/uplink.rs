//! tcx ingress on the node's uplink: frames from the fabric. Routed
//! ingress to a VM address is rewritten (src = gateway MAC, dst = VM MAC,
//! TTL / hop limit decremented) and sent into the VM with
//! `bpf_redirect_peer` when it is hosted here, or over the overlay to the
//! node hosting it (an entry without a port follows `vmp_endpoints`, which
//! the data path itself repoints at a migration's cut-over); SNAT return
//! traffic is reverse-translated; an address inside a learning network's
//! subnet that nothing places is resolved over the overlay
//! (`uplink_resolve`, `resolve`); everything else passes to the host
//! stack untouched.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::{
    AddrKey, ENDPOINT_LOCAL, EndpointKey, NET_F_GW4, NET_F_GW6, NO_PORT_ID, ROUTED_F_INBOUND,
    ROUTED_PORT_ID, RoutedAddr, drop_reason, tail_call,
};

use crate::{
    counters, csum,
    fwd::deliver_local,
    maps::{ENDPOINTS, NETWORKS},
    mtu, overlay,
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, hdr, hdr_mut},
    resolve::{self, Lookup},
    route::ROUTED,
    snat,
    verdict::{PROGS, Verdict},
};

#[classifier]
pub fn uplink(ctx: TcContext) -> i32 {
    match try_uplink(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(NO_PORT_ID, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_uplink(ctx: &TcContext) -> Verdict {
    match u16::from_be(hdr::<EthHdr>(ctx, 0)?.ether_type) {
        ETH_P_IP => ingress4(ctx),
        ETH_P_IPV6 => ingress6(ctx),
        _ => Ok(TC_ACT_OK),
    }
}

#[inline(always)]
fn ingress4(ctx: &TcContext) -> Verdict {
    let Ok(ip) = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN) else {
        return Ok(TC_ACT_OK);
    };
    let dst = ip.dst_addr;
    let key = AddrKey::v4(0, dst);
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(r) = (unsafe { ROUTED.get(&key) }) else {
        if let Some(action) = snat::ipv4::ingress4(ctx)? {
            return Ok(action);
        }
        return Ok(to_resolve(ctx));
    };
    routed4(ctx, r, None)
}

/// Routed ingress by `r`: through the node as a hop (TTL, MTU), then into
/// the VM or to the node hosting it; `via`: to the node that answered a
/// resolution instead (and whether to ask again as well).
#[inline(always)]
fn routed4(ctx: &TcContext, r: &RoutedAddr, via: Option<([u8; 4], bool)>) -> Verdict {
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let dst = ip.dst_addr;
    if ip.ttl <= 1 {
        // The node is a hop on the way to the VM: it answers from the
        // VM network's gateway address, as for oversized frames.
        let (uplink, from, own_mac) = answer_from4(ctx, r)?;
        return mtu::time_exceeded4(ctx, uplink, NO_PORT_ID, from, own_mac);
    }
    let l4_off = ETH_LEN + usize::from(ip.vihl & 0x0f) * 4;
    if mtu::too_big(ctx, r.mtu, u16::from_be_bytes(ip.tot_len), l4_off, ip.proto) {
        let (uplink, from, own_mac) = answer_from4(ctx, r)?;
        return mtu::frag_needed4(ctx, uplink, NO_PORT_ID, from, r.mtu, own_mac);
    }
    ip.check = csum::dec_ttl4(ip, u16::from_be_bytes(ip.check)).to_be_bytes();
    if r.port_id & ROUTED_F_INBOUND != 0 {
        // A SNAT network: its replies must leave un-NATed. Recorded where
        // the VM is (a relayed frame is recorded by the receiving node).
        let here = r.ifindex != 0 || is_local(r);
        if here {
            snat::ipv4::track_inbound4(ctx)?;
        }
    }
    if let Some((node, refresh)) = via {
        return resolve::forward4(ctx, r, node, refresh, dst);
    }
    to_vm(ctx, r)
}

/// An address no entry places and that is not SNAT return: on to
/// `uplink_resolve` (a tail call: its own stack), or the host's while
/// that slot is empty.
#[inline(always)]
fn to_resolve(ctx: &TcContext) -> i32 {
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return.
    unsafe { PROGS.tail_call(ctx, tail_call::UPLINK_RESOLVE) };
    TC_ACT_OK
}

/// Tail call from `uplink`: routed ingress for an address inside a
/// learning network's subnet that no entry places (an endpoint whose
/// address only its own node learned) is resolved over the overlay and
/// relayed to the node that answered (`resolve`); any other goes up the
/// host's stack as before.
#[classifier]
pub fn uplink_resolve(ctx: TcContext) -> i32 {
    match try_uplink_resolve(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(NO_PORT_ID, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_uplink_resolve(ctx: &TcContext) -> Verdict {
    let lookup = match u16::from_be(hdr::<EthHdr>(ctx, 0)?.ether_type) {
        ETH_P_IP => {
            let Ok(ip) = hdr::<Ipv4Hdr>(ctx, ETH_LEN) else {
                return Ok(TC_ACT_OK);
            };
            let dst = ip.dst_addr;
            resolve::lookup4(ctx, dst)?
        }
        ETH_P_IPV6 => {
            let Ok(ip) = hdr::<Ipv6Hdr>(ctx, ETH_LEN) else {
                return Ok(TC_ACT_OK);
            };
            let dst = ip.dst_addr;
            match resolve::lookup6(ctx, &dst)? {
                Lookup::Route { r, node, refresh } => {
                    return routed6(ctx, &r, Some((node, refresh)));
                }
                other => other,
            }
        }
        _ => return Ok(TC_ACT_OK),
    };
    match lookup {
        Lookup::Host => Ok(TC_ACT_OK),
        Lookup::Sent(action) => Ok(action),
        Lookup::Route { r, node, refresh } => routed4(ctx, &r, Some((node, refresh))),
    }
}

/// Is the VM of an entry without a port local now (a migration's source
/// before the cut-over, or its target after)?
#[inline(always)]
fn is_local(r: &RoutedAddr) -> bool {
    let key = EndpointKey::new(r.network, r.vm_mac);
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { ENDPOINTS.get(&key) }.is_some_and(|ep| ep.kind == ENDPOINT_LOCAL)
}

/// Sets the frame's MACs for the VM (from the gateway) and sends it on:
/// into the VM's port, or to the node that hosts it.
#[inline(always)]
fn to_vm(ctx: &TcContext, r: &RoutedAddr) -> Verdict {
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.src_addr = r.gw_mac;
    eth.dst_addr = r.vm_mac;
    if r.ifindex != 0 {
        return deliver_local(ctx, r.ifindex, u32::from(r.port_id & ROUTED_PORT_ID));
    }
    let key = EndpointKey::new(r.network, r.vm_mac);
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { ENDPOINTS.get(&key) } {
        Some(ep) if ep.kind == ENDPOINT_LOCAL => deliver_local(ctx, ep.ifindex, ep.port_id),
        Some(ep) => overlay::send_to_node(ctx, r.network, ep.node_ip4),
        None => match overlay::learned_node(&key) {
            Some(node) => overlay::send_to_node(ctx, r.network, node),
            None => Err(drop_reason::INGRESS_NO_ENDPOINT),
        },
    }
}

#[inline(always)]
fn ingress6(ctx: &TcContext) -> Verdict {
    let Ok(ip) = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN) else {
        return Ok(TC_ACT_OK);
    };
    let key = AddrKey::v6(0, &ip.dst_addr);
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(r) = (unsafe { ROUTED.get(&key) }) else {
        if let Some(action) = snat::ipv6::ingress6(ctx)? {
            return Ok(action);
        }
        return Ok(to_resolve(ctx));
    };
    routed6(ctx, r, None)
}

/// `routed4` for IPv6.
#[inline(always)]
fn routed6(ctx: &TcContext, r: &RoutedAddr, via: Option<([u8; 4], bool)>) -> Verdict {
    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    if ip.hop_limit <= 1 {
        let (uplink, from, own_mac) = answer_from6(ctx, r)?;
        return mtu::time_exceeded6(ctx, uplink, NO_PORT_ID, &from, own_mac);
    }
    let ip_len = 40u16.saturating_add(u16::from_be_bytes(ip.payload_len));
    if mtu::too_big(ctx, r.mtu, ip_len, ETH_LEN + 40, ip.next_hdr) {
        let (uplink, from, own_mac) = answer_from6(ctx, r)?;
        return mtu::packet_too_big6(ctx, uplink, NO_PORT_ID, &from, r.mtu, own_mac);
    }
    ip.hop_limit -= 1;
    if r.port_id & ROUTED_F_INBOUND != 0 && (r.ifindex != 0 || is_local(r)) {
        // A SNAT network: as for IPv4.
        snat::ipv6::track_inbound6(ctx)?;
    }
    if let Some((node, refresh)) = via {
        let dst = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.dst_addr;
        return resolve::forward6(ctx, r, node, refresh, &dst);
    }
    to_vm(ctx, r)
}

/// Where an ICMP error about routed ingress goes out (the uplink), from
/// which address (the VM network's gateway; zero: none, so not sent) and
/// Ethernet source (the uplink's own MAC, the frame's destination).
#[inline(always)]
fn answer_from4(ctx: &TcContext, r: &RoutedAddr) -> Result<(u32, [u8; 4], [u8; 6]), u32> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let from = match unsafe { NETWORKS.get(&r.network) } {
        Some(net) if net.flags & NET_F_GW4 != 0 => net.gw_ip4,
        _ => [0; 4],
    };
    let (uplink, own_mac) = uplink_and_mac(ctx)?;
    Ok((uplink, from, own_mac))
}

#[inline(always)]
fn answer_from6(ctx: &TcContext, r: &RoutedAddr) -> Result<(u32, [u8; 16], [u8; 6]), u32> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let from = match unsafe { NETWORKS.get(&r.network) } {
        Some(net) if net.flags & NET_F_GW6 != 0 => net.gw_ip6,
        _ => [0; 16],
    };
    let (uplink, own_mac) = uplink_and_mac(ctx)?;
    Ok((uplink, from, own_mac))
}

#[inline(always)]
fn uplink_and_mac(ctx: &TcContext) -> Result<(u32, [u8; 6]), u32> {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let uplink = unsafe { (*ctx.skb.skb).ifindex };
    Ok((uplink, hdr::<EthHdr>(ctx, 0)?.dst_addr))
}
