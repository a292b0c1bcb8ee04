//! `vm_egress` and `vm_snat6_ext`: north-south egress from a VM port,
//! frames to the gateway MAC that leave the network, routed or through
//! SNAT (`route` has the subnets and the forwarding, `snat` the
//! translation, `host` the node's own addresses, `mtu` the ICMP errors).

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::{
    CLUSTER_NETWORK, HopKey4, HopKey6, NET_F_GW4, NET_F_GW6, NET_F_HOST_REACH, NET_F_ROUTED,
    NET_F_SNAT, NO_PORT_ID, NetworkInfo, PortInfo, addr_family, drop_reason,
};

use crate::{
    clock, counters, frag, host,
    maps::{NETWORKS, PORTS},
    mtu, next_hop,
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, hdr},
    reach,
    route::{self, forward4, forward6, in_subnet4, in_subnet6},
    snat::{
        self,
        ipv6::{FirstAt, later_fragment_out6, through_cb, translate6},
    },
    spoof::{self, IPPROTO_FRAGMENT, walk6},
    verdict::Verdict,
};

/// tcx ingress on a VM port, reached by tail call from `vm_port` for
/// frames to the gateway MAC that leave the network (routed or SNAT).
/// Port security and gateway answers have run already.
#[classifier]
pub fn vm_egress(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::count_drop(NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    match try_vm_egress(&ctx, ifindex, port) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(port.port_id, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vm_egress(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Verdict {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&port.network) }) else {
        return Err(drop_reason::NO_NETWORK);
    };
    match u16::from_be(hdr::<EthHdr>(ctx, 0)?.ether_type) {
        ETH_P_IP => {
            let ihl = usize::from(hdr::<Ipv4Hdr>(ctx, ETH_LEN)?.vihl & 0x0f) * 4;
            if !(Ipv4Hdr::LEN..=60).contains(&ihl) {
                return Err(drop_reason::MALFORMED);
            }
            egress4_inner(ctx, ifindex, port, net, ETH_LEN + ihl)
        }
        ETH_P_IPV6 => egress6_inner(ctx, ifindex, port, net),
        _ => Err(drop_reason::GATEWAY_UNROUTED),
    }
}

#[inline(always)]
fn egress4_inner(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
    l4_off: usize,
) -> Verdict {
    if net.flags & (NET_F_ROUTED | NET_F_SNAT) == 0 {
        return Err(drop_reason::GATEWAY_UNROUTED);
    }
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (src, ttl, tot_len, proto) = (ip.src_addr, ip.ttl, ip.tot_len, ip.proto);
    // With the IP filter on, `vm_port` let only the port's own addresses
    // through, and those lie inside the subnets (validated): no LPM walk.
    if !spoof::ip_filter_on(port) && !in_subnet4(port.network, src) {
        return Err(drop_reason::ROUTE_SRC_OUTSIDE);
    }
    // Only nodes speak the overlay: a VM's VXLAN to one would arrive as
    // this node's own frame (`reach::to_overlay_port`).
    let mut dst16 = [0u8; 16];
    dst16[..4].copy_from_slice(&ip.dst_addr);
    if reach::to_overlay_port(ctx, addr_family::IPV4, &dst16, proto, l4_off) {
        return Err(drop_reason::OVERLAY_INJECTION);
    }
    if net.flags & NET_F_HOST_REACH != 0 {
        // An answer to another node's stack goes back the way it came.
        if let Some(node) = reach::answered_node(ctx) {
            return reach::to_node(ctx, node);
        }
        // The node's own addresses, and the cluster's (Services, pods,
        // other nodes): up the node's stack, where kube-proxy's
        // translation and the node's routes apply; a redirect here would
        // pass them by.
        let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
        if in_subnet4(CLUSTER_NETWORK, ip.dst_addr)
            || host::to_node4(ctx, ifindex, src, ip.dst_addr)
        {
            return host::deliver(ctx);
        }
    }
    let from = if net.flags & NET_F_GW4 != 0 {
        net.gw_ip4
    } else {
        [0; 4]
    };
    if ttl <= 1 {
        // traceroute's first hop: the gateway answers.
        return mtu::time_exceeded4(ctx, ifindex, port.port_id, from, net.gw_mac);
    }
    if mtu::too_big(ctx, net.mtu, u16::from_be_bytes(tot_len), l4_off, proto) {
        return mtu::frag_needed4(ctx, ifindex, port.port_id, from, net.mtu, net.gw_mac);
    }
    let next = if net.flags & NET_F_ROUTED == 0 {
        snat::ipv4::egress4(ctx, ifindex, port, net, l4_off)?
    } else {
        let key = HopKey4 {
            ifindex,
            src,
            dst: ip.dst_addr,
            tos: ip.tos,
            proto,
            _pad: [0; 2],
        };
        next_hop::routed4(&key, clock::flow_now())
    };
    forward4(ctx, ifindex, next, net.mtu)
}

#[inline(always)]
fn egress6_inner(ctx: &TcContext, ifindex: u32, port: &PortInfo, net: &NetworkInfo) -> Verdict {
    if net.flags & (NET_F_ROUTED | NET_F_SNAT) == 0 {
        return Err(drop_reason::GATEWAY_UNROUTED);
    }
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let src = &ip.src_addr;
    // `::` and link-local sources pass the IP filter but never leave the
    // network: only those still need the LPM walk when the filter is on.
    let own =
        spoof::ip_filter_on(port) && !spoof::is_link_local6(src) && !spoof::is_unspecified6(src);
    if !own && !in_subnet6(port.network, src) {
        return Err(drop_reason::ROUTE_SRC_OUTSIDE);
    }
    if reach::to_overlay_port(
        ctx,
        addr_family::IPV6,
        &ip.dst_addr,
        ip.next_hdr,
        ETH_LEN + Ipv6Hdr::LEN,
    ) {
        return Err(drop_reason::OVERLAY_INJECTION);
    }
    if net.flags & NET_F_HOST_REACH != 0 {
        if let Some(node) = reach::answered_node(ctx) {
            return reach::to_node(ctx, node);
        }
        let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
        if in_subnet6(CLUSTER_NETWORK, &ip.dst_addr)
            || host::to_node6(ctx, ifindex, &ip.src_addr, &ip.dst_addr)
        {
            return host::deliver(ctx);
        }
    }
    let (hop, payload_len, next_hdr) = (ip.hop_limit, ip.payload_len, ip.next_hdr);
    let from = if net.flags & NET_F_GW6 != 0 {
        net.gw_ip6
    } else {
        [0; 16]
    };
    if hop <= 1 {
        return mtu::time_exceeded6(ctx, ifindex, port.port_id, &from, net.gw_mac);
    }
    let ip_len = 40u16.saturating_add(u16::from_be_bytes(payload_len));
    if mtu::too_big(ctx, net.mtu, ip_len, ETH_LEN + 40, next_hdr) {
        return mtu::packet_too_big6(ctx, ifindex, port.port_id, &from, net.mtu, net.gw_mac);
    }
    let next = if net.flags & NET_F_ROUTED == 0 {
        snat::ipv6::egress6(ctx, ifindex, port, net)?
    } else {
        let key = HopKey6 {
            ifindex,
            src: ip.src_addr,
            dst: ip.dst_addr,
            proto: next_hdr,
            _pad: [0; 3],
        };
        next_hop::routed6(&key, clock::flow_now())
    };
    forward6(ctx, ifindex, next, net.mtu)
}

/// tcx ingress on a VM port, reached by tail call from `vm_egress`
/// (`egress6`) for an IPv6 frame a VM sends through SNAT with extension
/// headers: the transport header found past them (`walk6`) and the frame
/// translated by its ports; a first fragment's outcome recorded for its
/// later fragments (`vmp_snat6_frags`, `FRAG_OUT`: the SNAT address, or
/// none for the reply of an inbound flow); a later fragment given its
/// first's source. Then routed on as `vm_egress` routes
/// (`route::forward6`): `vm_egress` has checked the source, the hop limit
/// and the MTU already.
#[classifier]
pub fn vm_snat6_ext(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::count_drop(NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    match try_vm_snat6_ext(&ctx, ifindex, port) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(port.port_id, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vm_snat6_ext(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Verdict {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { NETWORKS.get(&port.network) }) else {
        return Err(drop_reason::NO_NETWORK);
    };
    let mut first = FirstAt(0);
    let (proto, l4_off) = walk6(ctx, hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr, &mut first)?;
    let next = if proto == IPPROTO_FRAGMENT {
        later_fragment_out6(ctx, frag::later_id6(ctx, l4_off)?)?
    } else {
        let l4_off = through_cb(ctx, first.0, l4_off)?;
        translate6(ctx, ifindex, port, net, proto, l4_off, true)?
    };
    route::forward6(ctx, ifindex, next, net.mtu)
}
