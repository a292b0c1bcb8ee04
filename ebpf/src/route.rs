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
        bpf_fib_lookup as FibParams, bpf_redir_neigh,
    },
    btf_maps::{HashMap, LpmTrie, lpm_trie::Key},
    helpers::generated::{bpf_fib_lookup, bpf_redirect_neigh},
    macros::btf_map,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::{
    AddrKey, L2Hop, NET_F_ROUTED, NET_F_SNAT, NetworkInfo, RoutedAddr, Subnet4, Subnet6,
    drop_reason, kernel_af, maps, tail_call,
};

use crate::{
    csum,
    next_hop::{self, NextHop},
    parse::{ETH_LEN, hdr, hdr_mut, words16, write_mac, zeroed},
    verdict::{self, PROGS, Verdict},
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
pub fn in_subnet6(network: u32, addr: &[u8; 16]) -> bool {
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
    verdict::redirect(hop.ifindex)
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
        return verdict::redirect(p.ifindex);
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
    verdict::redirected(unsafe {
        bpf_redirect_neigh(p.ifindex, nh, size_of::<bpf_redir_neigh>() as i32, 0)
    })
}
