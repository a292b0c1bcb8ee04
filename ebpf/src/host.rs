//! The node and the endpoints of its Primary networks (`NET_F_HOST_REACH`):
//! the node sends to them straight down their port (a route and a
//! neighbour entry the agent keeps); their answers, sent to the gateway
//! like any off-subnet frame, go up the node's own stack here instead of
//! being routed or translated. "The node's own addresses" are what its
//! routing table calls local, so nothing is configured twice.

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NOT_FWDED, TC_ACT_OK, bpf_fib_lookup as FibParams},
    helpers::generated::{bpf_fib_lookup, bpf_skb_change_type},
    programs::TcContext,
};
use network_types::ip::{Ipv4Hdr, Ipv6Hdr};
use vmpath_common::{addr_family, drop_reason, kernel_af};

use crate::{
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, hdr, words16,
        zeroed,
    },
    verdict::Verdict,
};

/// `skb->pkt_type` for a frame addressed to this host.
const PACKET_HOST: u32 = 0;
const TCP_FLAG_ACK: u8 = 0x10;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// Whether the node's routing table, asked as for a frame arriving on
/// `ifindex`, keeps `dst` for itself (a local route: not forwarded).
#[inline(always)]
fn is_node(ctx: &TcContext, ifindex: u32, family: u8, src: &[u8; 16], dst: &[u8; 16]) -> bool {
    let mut p_slot = MaybeUninit::<FibParams>::uninit();
    let p = zeroed(&mut p_slot);
    p.ifindex = ifindex;
    if family == addr_family::IPV4 {
        p.family = kernel_af::AF_INET;
        p.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes([src[0], src[1], src[2], src[3]]);
        p.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes([dst[0], dst[1], dst[2], dst[3]]);
    } else {
        p.family = kernel_af::AF_INET6;
        p.__bindgen_anon_3.ipv6_src = words16(src);
        p.__bindgen_anon_4.ipv6_dst = words16(dst);
    }
    // SAFETY: `p` is our zeroed `FibParams` on the stack and the size passed
    // is its own; the skb is the program's own context.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.skb.skb as *mut _,
            &raw mut *p,
            size_of::<FibParams>() as i32,
            0,
        )
    };
    rc as u32 == BPF_FIB_LKUP_RET_NOT_FWDED
}

/// Whether a frame the node's stack sends down the port `ifindex` comes
/// from one of the node's own addresses (kubelet, or what kube-proxy
/// translated to the node's address): `src` is the frame's source, `to`
/// the endpoint's address it goes to.
#[inline(always)]
pub fn sent_by_node(
    ctx: &TcContext,
    ifindex: u32,
    family: u8,
    src: &[u8; 16],
    to: &[u8; 16],
) -> bool {
    // Asked the other way round: would a frame from the endpoint to
    // `src`, arriving on its port, be for the node itself?
    is_node(ctx, ifindex, family, to, src)
}

/// An IPv4 frame from an endpoint of a host-reach network to one of the
/// node's own addresses.
#[inline(always)]
pub fn to_node4(ctx: &TcContext, ifindex: u32, src: [u8; 4], dst: [u8; 4]) -> bool {
    let mut s = [0u8; 16];
    let mut d = [0u8; 16];
    s[..4].copy_from_slice(&src);
    d[..4].copy_from_slice(&dst);
    is_node(ctx, ifindex, addr_family::IPV4, &s, &d)
}

/// The same for IPv6.
#[inline(always)]
pub fn to_node6(ctx: &TcContext, ifindex: u32, src: &[u8; 16], dst: &[u8; 16]) -> bool {
    is_node(ctx, ifindex, addr_family::IPV6, src, dst)
}

/// Up the node's stack as received on the port: the frame is addressed
/// to the gateway's MAC, which the stack would otherwise take for another
/// host's and drop.
#[inline(always)]
pub fn deliver(ctx: &TcContext) -> Verdict {
    // SAFETY: the skb is the program's own context.
    let rc = unsafe { bpf_skb_change_type(ctx.skb.skb, PACKET_HOST) };
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    Ok(TC_ACT_OK)
}

/// Whether an endpoint's frame can only be an answer to a flow the node
/// opened (a TCP segment past the opening SYN, an echo reply) and goes to
/// the node's own address. Kubernetes lets the node reach its pods
/// whatever their policy, replies included; the node's flows never pass
/// a vmpath program on their way in, so egress policy recognises their
/// replies by shape.
#[inline(always)]
pub fn answers_node(
    ctx: &TcContext,
    ifindex: u32,
    family: u8,
    src: &[u8; 16],
    dst: &[u8; 16],
) -> bool {
    let Ok(shaped) = reply_shaped(ctx) else {
        return false;
    };
    shaped && is_node(ctx, ifindex, family, src, dst)
}

#[inline(always)]
fn reply_shaped(ctx: &TcContext) -> Result<bool, u32> {
    let ether_type: u16 = ctx.load(12).map_err(|_| drop_reason::MALFORMED)?;
    let (proto, l4_off) = match u16::from_be(ether_type) {
        ETH_P_IP => {
            let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
            (ip.proto, ETH_LEN + usize::from(ip.vihl & 0x0f) * 4)
        }
        // Only a transport header right after the fixed header counts.
        ETH_P_IPV6 => (
            hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr,
            ETH_LEN + Ipv6Hdr::LEN,
        ),
        _ => return Ok(false),
    };
    Ok(match proto {
        IPPROTO_TCP => {
            let flags: u8 = ctx.load(l4_off + 13).map_err(|_| drop_reason::MALFORMED)?;
            flags & TCP_FLAG_ACK != 0
        }
        IPPROTO_ICMP => {
            ctx.load::<u8>(l4_off).map_err(|_| drop_reason::MALFORMED)? == ICMP_ECHO_REPLY
        }
        IPPROTO_ICMPV6 => {
            ctx.load::<u8>(l4_off).map_err(|_| drop_reason::MALFORMED)? == ICMPV6_ECHO_REPLY
        }
        _ => false,
    })
}
