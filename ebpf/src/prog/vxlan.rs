//! tcx ingress on vmpath's vxlan device: frames other nodes sent over the
//! overlay, already decapsulated by the kernel. The VNI names the network;
//! the inner destination MAC picks the local port. Floods go to local
//! ports only, never back onto the overlay (the sending node reached every
//! node itself). Port security ran on the sending node. Unicast for a VM
//! that migrated away is relayed once to its new node (live migration).
//! Source MACs the config does not place are learned behind the sending
//! node (`overlay::learn_source`).

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, bpf_tunnel_key},
    macros::classifier,
    programs::TcContext,
};
use network_types::{eth::EthHdr, ip::Ipv6Hdr};
use vmpath_common::{
    ENDPOINT_LOCAL, EndpointKey, NET_F_INGRESS, NET_F_IP_FILTER, NO_PORT_ID, NetworkInfo,
    REACH_VNI, RELAY_TTL, RELAYED_TTL_MAX, drop_reason, tail_call,
};

use crate::{
    counters, fwd,
    maps::{ENDPOINTS, NETWORKS},
    migrate, nd, overlay,
    parse::{
        ETH_LEN, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, ETH_P_RARP, IPPROTO_ICMPV6, hdr, is_multicast,
        mac_eq, zeroed,
    },
    resolve, snat, spoof,
    verdict::{PROGS, Verdict},
};

#[classifier]
pub fn vxlan_rx(ctx: TcContext) -> i32 {
    overlay::count_rx(ctx.len());
    match try_vxlan_rx(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            // SAFETY: the skb pointer is the program's own context, valid for this run.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            counters::dropped(&ctx, ifindex, NO_PORT_ID, reason);
            overlay::count_drop();
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vxlan_rx(ctx: &TcContext) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    // The sending node (its VTEP value: the outer source address, or its
    // handle on an IPv6 underlay; an unknown IPv6 source is refused here).
    let from = overlay::received_from(ctx, key)?;
    let network = key.tunnel_id;
    if network == REACH_VNI {
        // SAFETY: `ctx` is this program's own context; on success the
        // tail call does not return, otherwise the error below.
        unsafe { PROGS.tail_call(ctx, tail_call::VXLAN_REACH) };
        return Err(drop_reason::HELPER_FAILED);
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&network) }) else {
        return Err(drop_reason::OVERLAY_UNKNOWN_VNI);
    };
    // Only nodes that host the network may inject frames into it.
    if !overlay::is_remote_node(network, from) {
        return Err(drop_reason::OVERLAY_UNKNOWN_VTEP);
    }

    let eth = hdr::<EthHdr>(ctx, 0)?;
    let (dst, src, ether_type) = (eth.dst_addr, eth.src_addr, u16::from_be(eth.ether_type));
    if is_multicast(&src) {
        return Err(drop_reason::SRC_MULTICAST);
    }
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    if net.flags & NET_F_IP_FILTER != 0
        && (unsafe { (*ctx.skb.skb).vlan_present } != 0
            || (ether_type != ETH_P_IP
                && ether_type != ETH_P_IPV6
                && ether_type != ETH_P_ARP
                && ether_type != ETH_P_RARP))
    {
        // As on a VM port: VLAN tags (taken off into the skb by the
        // kernel) and other ethertypes would carry frames past the checks.
        return Err(drop_reason::ETHERTYPE);
    }
    if ether_type == ETH_P_IPV6 {
        nd_guard(ctx, network, net, &src)?;
    }
    // A migrating VM speaking from its new node moves its endpoint here;
    // a MAC the config does not place is learned behind the sending node
    // (never the gateway's, which every node answers for itself).
    let from_gateway = mac_eq(&src, &net.gw_mac);
    if !migrate::learn_move(network, src, from) && !from_gateway {
        overlay::learn_source(network, src, from);
    }
    overlay::mark_sender(ctx, network, src, from, from_gateway);
    // Another node's gateway resolving an endpoint no config places (an
    // ARP request or NS from the gateway MAC, which no VM sends from),
    // and the answers to this node's own requests (to the gateway MAC).
    if (ether_type == ETH_P_ARP || ether_type == ETH_P_IPV6) && resolve::is_request(&src, &dst, net)
    {
        return to_resolve(ctx);
    }
    if !is_multicast(&dst) {
        // The gateway is anycast: every node answers its own VMs, so
        // nothing for it ever needs to cross the overlay but the answers
        // to its resolutions.
        if mac_eq(&dst, &net.gw_mac) {
            if ether_type == ETH_P_ARP || (ether_type == ETH_P_IPV6 && resolve::is_answer6(ctx)) {
                return to_resolve(ctx);
            }
            return Err(drop_reason::OVERLAY_NO_LOCAL_PORT);
        }
        let ep_key = EndpointKey::new(network, dst);
        // SAFETY: a map lookup; the value stays valid for this program run.
        if let Some(ep) = unsafe { ENDPOINTS.get(&ep_key) } {
            if ep.kind == ENDPOINT_LOCAL {
                // Routed ingress another node's uplink relayed here (from
                // the gateway MAC, which no VM sends from): on a SNAT
                // network the VM's replies must leave un-NATed.
                if net.flags & NET_F_INGRESS != 0 && mac_eq(&src, &net.gw_mac) {
                    if ether_type == ETH_P_IP {
                        snat::ipv4::track_inbound4(ctx)?;
                    } else if ether_type == ETH_P_IPV6 {
                        snat::ipv6::track_inbound6(ctx)?;
                    }
                }
                return fwd::deliver_local(ctx, ep.ifindex, ep.port_id);
            }
            // Known on another node: a VM that migrated away while the
            // sender still points here. Pass it on once (make-before-break).
            return relay(ctx, key, ep.node_ip4, from);
        }
    }
    fwd::flood_local(ctx, network, !is_multicast(&dst))
}

/// On to `vxlan_resolve` (a tail call: `vxlan_rx`'s stack is nearly
/// full); while its slot is empty the frame has nowhere to go.
#[inline(always)]
fn to_resolve(ctx: &TcContext) -> Verdict {
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return.
    unsafe { PROGS.tail_call(ctx, tail_call::VXLAN_RESOLVE) };
    Err(drop_reason::OVERLAY_NO_LOCAL_PORT)
}

/// Tail call from `vxlan_rx` (which checked the VNI, the sending node and
/// the source MAC): another node's resolution request, answered if the
/// address is served here, or the answer to one of this node's own
/// (`resolve`).
#[classifier]
pub fn vxlan_resolve(ctx: TcContext) -> i32 {
    match try_vxlan_resolve(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            // SAFETY: the skb pointer is the program's own context, valid for this run.
            let ifindex = unsafe { (*ctx.skb.skb).ifindex };
            counters::dropped(&ctx, ifindex, NO_PORT_ID, reason);
            overlay::count_drop();
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vxlan_resolve(ctx: &TcContext) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let from = overlay::received_from(ctx, key)?;
    let network = key.tunnel_id;
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&network) }) else {
        return Err(drop_reason::OVERLAY_UNKNOWN_VNI);
    };
    let eth = hdr::<EthHdr>(ctx, 0)?;
    let (dst, src, ether_type) = (eth.dst_addr, eth.src_addr, u16::from_be(eth.ether_type));
    if resolve::is_request(&src, &dst, net) {
        return resolve::answer(ctx, network, ether_type, from);
    }
    resolve::take(ctx, network, net, ether_type, from)
}

/// A VM on another node is no more trusted than a local one: the
/// neighbour discovery it may not send from its port is dropped here too
/// (its node checked it already; this holds should that node not).
#[inline(always)]
fn nd_guard(ctx: &TcContext, network: u32, net: &NetworkInfo, src: &[u8; 6]) -> Result<(), u32> {
    let next_hdr = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr;
    let (proto, l4_off) = spoof::upper_layer6(ctx, next_hdr)?;
    if proto != IPPROTO_ICMPV6 {
        return Ok(());
    }
    let filter = net.flags & NET_F_IP_FILTER != 0;
    if let Some(target) = nd::guard(ctx, l4_off, net, src, filter)?
        && !spoof::remote_owns_nd_target(network, &target, src)
    {
        return Err(drop_reason::ND_SPOOF_TARGET);
    }
    Ok(())
}

/// Re-encapsulates a frame for a VM that lives on `to` now, with the relay
/// TTL as the once-only marker. Never back to the sender, never twice.
#[inline(always)]
fn relay(ctx: &TcContext, key: &mut bpf_tunnel_key, to: [u8; 4], from: [u8; 4]) -> Verdict {
    if key.tunnel_ttl <= RELAYED_TTL_MAX || to == from {
        return Err(drop_reason::OVERLAY_NOT_RELAYED);
    }
    overlay::relay_to(ctx, key, to, RELAY_TTL)
}
