//! North-south egress from a VM port: frames the VM sends to the gateway
//! MAC that the gateway does not answer itself. Routed networks forward
//! them un-NATed through the node (next hop by `bpf_fib_lookup`, neighbour
//! by `bpf_redirect_neigh`); SNAT networks translate them first (`snat`).
//! What the FIB gave is kept for 100 ms, per SNAT flow or per routed
//! source, destination and port (`next_hop`). Only source addresses inside
//! the network's subnets leave.

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_SHOT, bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    btf_maps::{HashMap, LpmTrie, ProgramArray, lpm_trie::Key},
    helpers::generated::{bpf_fib_lookup, bpf_redirect_neigh},
    macros::{btf_map, classifier},
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::{
    AddrKey, CLUSTER_NETWORK, HopKey4, HopKey6, L2Hop, NET_F_GW4, NET_F_GW6, NET_F_HOST_REACH,
    NET_F_ROUTED, NET_F_SNAT, NO_PORT_ID, NetworkInfo, PortInfo, RoutedAddr, Subnet4, Subnet6,
    drop_reason, kernel_af, maps, tail_call,
};

use crate::{
    clock, counters, csum,
    fwd::{self, Verdict},
    host,
    maps::{NETWORKS, PORTS},
    mtu,
    next_hop::{self, NextHop},
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, hdr, hdr_mut, words16, write_mac, zeroed},
    snat, snat6, spoof,
};

/// VM address (network 0) -> the port that hosts it, for routed ingress.
#[btf_map(name = "vmp_routed")]
pub static ROUTED: HashMap<AddrKey, RoutedAddr, { maps::ROUTED.max_entries as usize }> =
    HashMap::new();

/// (network, IPv4 subnet) -> 1.
#[btf_map(name = "vmp_subnets4")]
pub static SUBNETS4: LpmTrie<Subnet4, u32, { maps::SUBNETS4.max_entries as usize }> =
    LpmTrie::new();

/// (network, IPv6 subnet) -> 1.
#[btf_map(name = "vmp_subnets6")]
pub static SUBNETS6: LpmTrie<Subnet6, u32, { maps::SUBNETS6.max_entries as usize }> =
    LpmTrie::new();

#[inline(always)]
pub fn in_subnet4(network: u32, addr: [u8; 4]) -> bool {
    let key = Key::new(
        64,
        Subnet4 {
            network: network.to_be_bytes(),
            addr,
        },
    );
    SUBNETS4.get(&key).is_some()
}

#[inline(always)]
fn in_subnet6(network: u32, addr: &[u8; 16]) -> bool {
    let key = Key::new(
        160,
        Subnet6 {
            network: network.to_be_bytes(),
            addr: *addr,
        },
    );
    SUBNETS6.get(&key).is_some()
}

/// IPv4 or IPv6 to the gateway MAC, not for the gateway itself: on to the
/// `vm_egress` program (a tail call, so the routed and SNAT paths get a
/// stack of their own; the VM-port program's frame is nearly full).
#[inline(always)]
pub fn egress(ctx: &TcContext, net: &NetworkInfo) -> Verdict {
    if net.flags & (NET_F_ROUTED | NET_F_SNAT) == 0 {
        return Err(drop_reason::GATEWAY_UNROUTED);
    }
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return, otherwise execution falls through to the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::VM_EGRESS) };
    // Only reached when the slot is empty (agent still starting).
    Err(drop_reason::HELPER_FAILED)
}

/// Tail-call targets (`vmpath_common::maps::PROGS`); slots in `tail_call`.
#[btf_map(name = "vmp_progs")]
pub static PROGS: ProgramArray<{ maps::PROGS.max_entries as usize }> = ProgramArray::new();

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
    // The node's own addresses, and the cluster's (Services, pods, other
    // nodes): up the node's stack, where kube-proxy's translation and the
    // node's routes apply; a redirect here would pass them by.
    if net.flags & NET_F_HOST_REACH != 0
        && (in_subnet4(CLUSTER_NETWORK, ip.dst_addr)
            || host::to_node4(ctx, ifindex, src, ip.dst_addr))
    {
        return host::deliver(ctx);
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
        snat::egress4(ctx, ifindex, port, net, l4_off)?
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

/// Decrements the TTL (fixing the header checksum) and sends the frame to
/// the next hop the node's routing table picks (or a flow kept,
/// `next_hop`; `net_mtu`: the network's MTU, which decides whether a
/// lookup's result may be kept).
#[inline(always)]
pub fn forward4(ctx: &TcContext, in_ifindex: u32, next: NextHop, net_mtu: u16) -> Verdict {
    if let Some(hop) = next.kept() {
        let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
        ip.check = csum::dec_ttl4(ip, u16::from_be_bytes(ip.check)).to_be_bytes();
        return to_kept_hop(ctx, &hop);
    }
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let mut p_slot = MaybeUninit::<FibParams>::uninit();
    let p = zeroed(&mut p_slot);
    p.family = kernel_af::AF_INET;
    p.l4_protocol = ip.proto;
    p.ifindex = in_ifindex;
    // Writing a union field is safe; these are plain integers.
    p.__bindgen_anon_2.tos = ip.tos;
    p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(ip.src_addr);
    p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(ip.dst_addr);
    // SAFETY: `p` is our zeroed `FibParams` on the stack and the size passed is its
    // own; the skb is the program's own context.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &raw mut *p,
            size_of::<FibParams>() as i32,
            0,
        )
    };
    let rc = rc as u32;
    forwardable(rc)?;
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        next_hop::keep(&next, p, net_mtu);
    }
    // Taken again after the helper.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = csum::dec_ttl4(ip, u16::from_be_bytes(ip.check)).to_be_bytes();
    to_next_hop(ctx, p, rc)
}

/// Out of a kept next hop's interface, with its MACs.
#[inline(always)]
fn to_kept_hop(ctx: &TcContext, hop: &L2Hop) -> Verdict {
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    write_mac(&mut eth.dst_addr, hop.dst_mac);
    write_mac(&mut eth.src_addr, hop.src_mac);
    fwd::redirect(hop.ifindex)
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
    if net.flags & NET_F_HOST_REACH != 0
        && (in_subnet6(CLUSTER_NETWORK, &ip.dst_addr)
            || host::to_node6(ctx, ifindex, src, &ip.dst_addr))
    {
        return host::deliver(ctx);
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
        snat6::egress6(ctx, ifindex, port, net)?
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

/// Decrements the hop limit and sends the frame to the next hop the
/// node's routing table picks (or a flow kept, `next_hop`), as `forward4`
/// does for IPv4. The hop limit was checked (above 1) by the caller.
#[inline(always)]
pub fn forward6(ctx: &TcContext, in_ifindex: u32, next: NextHop, net_mtu: u16) -> Verdict {
    if let Some(hop) = next.kept() {
        hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?.hop_limit -= 1;
        return to_kept_hop(ctx, &hop);
    }
    // Taken again: the translation's helpers may have moved packet data.
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut p_slot = MaybeUninit::<FibParams>::uninit();
    let p = zeroed(&mut p_slot);
    p.family = kernel_af::AF_INET6;
    p.l4_protocol = ip.next_hdr;
    p.ifindex = in_ifindex;
    p.__bindgen_anon_3.ipv6_src = words16(&ip.src_addr);
    p.__bindgen_anon_4.ipv6_dst = words16(&ip.dst_addr);
    // SAFETY: `p` is our zeroed `FibParams` on the stack and the size passed is its
    // own; the skb is the program's own context.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &raw mut *p,
            size_of::<FibParams>() as i32,
            0,
        )
    } as u32;
    forwardable(rc)?;
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        next_hop::keep(&next, p, net_mtu);
    }
    hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?.hop_limit -= 1;
    to_next_hop(ctx, p, rc)
}

/// FIB results that can be forwarded: a resolved neighbour, or one
/// `bpf_redirect_neigh` will resolve.
#[inline(always)]
fn forwardable(rc: u32) -> Result<(), u32> {
    match rc {
        BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_NO_NEIGH => Ok(()),
        BPF_FIB_LKUP_RET_FRAG_NEEDED => Err(drop_reason::MTU_EXCEEDED),
        _ => Err(drop_reason::ROUTE_NO_ROUTE),
    }
}

/// Out of the FIB's interface: straight to the neighbour it resolved, or
/// through `bpf_redirect_neigh`, which resolves the next hop itself.
#[inline(always)]
fn to_next_hop(ctx: &TcContext, p: &FibParams, rc: u32) -> Verdict {
    if rc == BPF_FIB_LKUP_RET_SUCCESS {
        let eth = hdr_mut::<EthHdr>(ctx, 0)?;
        write_mac(&mut eth.dst_addr, p.dmac);
        write_mac(&mut eth.src_addr, p.smac);
        return fwd::redirect(p.ifindex);
    }
    let mut nh_slot = MaybeUninit::<bpf_redir_neigh>::uninit();
    let nh = zeroed(&mut nh_slot);
    if p.family == kernel_af::AF_INET6 {
        nh.nh_family = u32::from(kernel_af::AF_INET6);
        // SAFETY: union of plain integers (any bit pattern valid); `family` says which
        // member `bpf_fib_lookup` filled.
        nh.__bindgen_anon_1.ipv6_nh = unsafe { p.__bindgen_anon_4.ipv6_dst };
    } else {
        nh.nh_family = u32::from(kernel_af::AF_INET);
        // SAFETY: as above: a plain-integer union member.
        nh.__bindgen_anon_1.ipv4_nh = unsafe { p.__bindgen_anon_4.ipv4_dst };
    }
    // SAFETY: `nh` lives on our stack for the call; the size is its own.
    fwd::redirected(unsafe {
        bpf_redirect_neigh(p.ifindex, nh, size_of::<bpf_redir_neigh>() as i32, 0)
    })
}
