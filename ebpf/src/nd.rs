//! IPv6 for the gateway: neighbour solicitations for its addresses answered
//! with a neighbour advertisement, and ICMPv6 echo answered, in place.

use aya_ebpf::{helpers::generated::bpf_skb_change_tail, programs::TcContext};
use network_types::{eth::EthHdr, ip::Ipv6Hdr};
use vmpath_common::{NET_F_GW6, NetworkInfo, drop_reason};

use crate::{
    csum,
    parse::{ETH_LEN, ETH_P_IPV6, IPPROTO_ICMPV6, addr16_eq, hdr, hdr_mut},
};

pub const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
pub const ND_ROUTER_SOLICIT: u8 = 133;
pub const ND_NEIGHBOR_SOLICIT: u8 = 135;
pub const ND_ROUTER_ADVERT: u8 = 134;
const ND_NEIGHBOR_ADVERT_TYPE: u8 = 136;
const ND_REDIRECT: u8 = 137;
const ND_NEIGHBOR_ADVERT: u8 = 136;
const IPV6_LEN: usize = 40;
const L4_OFF: usize = ETH_LEN + IPV6_LEN;
/// type, code, checksum, flags+reserved, target, target link-layer option.
const NA_LEN: usize = 4 + 4 + 16 + 8;
const NA_FRAME_LEN: usize = L4_OFF + NA_LEN;
/// Router, Solicited, Override.
const NA_FLAGS_RSO: u8 = 0xe0;
/// Solicited, Override: a host's answer (an endpoint another node serves).
pub const NA_FLAGS_SO: u8 = 0x60;
pub const ND_NEIGHBOR_ADVERT_MSG: u8 = ND_NEIGHBOR_ADVERT;
const ND_HOP_LIMIT: u8 = 255;
const REPLY_HOP_LIMIT: u8 = 64;

/// The start of an ICMPv6 message.
#[repr(C)]
pub struct Icmp6Hdr {
    pub type_: u8,
    pub code: u8,
    pub check: [u8; 2],
}

/// A neighbour solicitation without its options.
#[repr(C)]
struct NsMsg {
    hdr: Icmp6Hdr,
    _reserved: [u8; 4],
    target: [u8; 16],
}

/// Is `addr` one of the network's gateway addresses (global or link-local)?
#[inline(always)]
pub fn is_gateway6(net: &NetworkInfo, addr: &[u8; 16]) -> bool {
    net.flags & NET_F_GW6 != 0 && (addr16_eq(addr, &net.gw_ip6) || addr16_eq(addr, &net.gw_ll6))
}

/// Link-layer address options (RFC 4861 4.6.1).
const OPT_SOURCE_LLA: u8 = 1;
const OPT_TARGET_LLA: u8 = 2;
/// NS/NA: ICMPv6 header, reserved/flags, target; then options.
const ND_FIXED_LEN: usize = 4 + 4 + 16;
/// Options walked per message. An honest NS/NA carries one or two; one
/// with more is refused rather than letting a forged address hide past
/// the walk.
const MAX_ND_OPTIONS: usize = 6;

/// Neighbour discovery a VM may not send, for `vm_port` and `vxlan_rx`
/// alike. `l4` is the ICMPv6 message's offset, `mac` the sender's own MAC,
/// `filter` whether the sender's network filters source IPs. Drops router
/// advertisements and redirects (where vmpath is the gateway or the filter
/// is on), a neighbour advertisement for a gateway address, and, with the
/// filter on, an NS or NA whose link-layer option is not `mac`. Returns the
/// target of an NA the filter must still check (is it the sender's?).
#[inline(always)]
pub fn guard(
    ctx: &TcContext,
    l4: usize,
    net: &NetworkInfo,
    mac: &[u8; 6],
    filter: bool,
) -> Result<Option<[u8; 16]>, u32> {
    let hdr: [u8; 4] = ctx.load(l4).map_err(|_| drop_reason::MALFORMED)?;
    let icmp_type = hdr[0];
    if icmp_type == ND_ROUTER_ADVERT || icmp_type == ND_REDIRECT {
        if filter || net.flags & NET_F_GW6 != 0 {
            return Err(drop_reason::ND_SPOOF);
        }
        return Ok(None);
    }
    if icmp_type != ND_NEIGHBOR_SOLICIT && icmp_type != ND_NEIGHBOR_ADVERT_TYPE {
        return Ok(None);
    }
    let target: [u8; 16] = ctx.load(l4 + 8).map_err(|_| drop_reason::MALFORMED)?;
    let advert = icmp_type == ND_NEIGHBOR_ADVERT_TYPE;
    // Only the gateway speaks for its addresses.
    if advert && is_gateway6(net, &target) {
        return Err(drop_reason::ND_SPOOF);
    }
    if !filter {
        return Ok(None);
    }
    let option = if advert {
        OPT_TARGET_LLA
    } else {
        OPT_SOURCE_LLA
    };
    lla_options_are(ctx, l4 + ND_FIXED_LEN, option, mac)?;
    Ok(if advert { Some(target) } else { None })
}

/// Every link-layer address option of `kind` from `off` to the end of the
/// IPv6 payload names `mac` (a receiver may take the first or the last).
#[inline(always)]
fn lla_options_are(ctx: &TcContext, mut off: usize, kind: u8, mac: &[u8; 6]) -> Result<(), u32> {
    let payload_len: [u8; 2] = ctx.load(ETH_LEN + 4).map_err(|_| drop_reason::MALFORMED)?;
    let end = L4_OFF + usize::from(u16::from_be_bytes(payload_len));
    let mut i = 0;
    while i < MAX_ND_OPTIONS {
        if off >= end {
            return Ok(());
        }
        let opt: [u8; 8] = ctx.load(off).map_err(|_| drop_reason::MALFORMED)?;
        if opt[1] == 0 {
            // RFC 4861 4.6: a zero-length option invalidates the message.
            return Err(drop_reason::MALFORMED);
        }
        if opt[0] == kind
            && (opt[1] != 1
                || opt[2] != mac[0]
                || opt[3] != mac[1]
                || opt[4] != mac[2]
                || opt[5] != mac[3]
                || opt[6] != mac[4]
                || opt[7] != mac[5])
        {
            return Err(drop_reason::ND_SPOOF_LLADDR);
        }
        off += usize::from(opt[1]) * 8;
        i += 1;
    }
    if off >= end {
        Ok(())
    } else {
        Err(drop_reason::ND_SPOOF_LLADDR)
    }
}

/// If the NS at L4 asks for a gateway address, the address it asks for.
#[inline(always)]
pub fn ns_gateway_target(ctx: &TcContext, net: &NetworkInfo) -> Result<Option<[u8; 16]>, u32> {
    let ns = hdr::<NsMsg>(ctx, L4_OFF)?;
    if ns.hdr.code != 0 {
        return Err(drop_reason::MALFORMED);
    }
    if hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.hop_limit != ND_HOP_LIMIT {
        // RFC 4861 7.1.1: not a valid solicitation.
        return Err(drop_reason::MALFORMED);
    }
    let target = ns.target;
    Ok(if is_gateway6(net, &target) {
        Some(target)
    } else {
        None
    })
}

/// The target of the NS at L4 (a valid one: `ns_gateway_target` checked it).
#[inline(always)]
pub fn ns_target(ctx: &TcContext) -> Result<[u8; 16], u32> {
    Ok(hdr::<NsMsg>(ctx, L4_OFF)?.target)
}

/// Rewrites the frame into the gateway's solicited NA for `target`, sent to
/// the soliciting VM.
#[inline(always)]
pub fn neighbor_advert(ctx: &TcContext, net: &NetworkInfo, target: [u8; 16]) -> Result<(), u32> {
    neighbor_advert_as(ctx, target, net.gw_mac, NA_FLAGS_RSO)
}

/// Rewrites the frame (an NS) into the solicited NA for `target` from
/// `m` (Ethernet source and target link-layer address) with `flags`,
/// sent back to the soliciting address and MAC.
#[inline(always)]
pub fn neighbor_advert_as(
    ctx: &TcContext,
    target: [u8; 16],
    m: [u8; 6],
    flags: u8,
) -> Result<(), u32> {
    // Copied out: the helper below may move packet data.
    let vm_mac = hdr::<EthHdr>(ctx, 0)?.src_addr;
    let vm_ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.src_addr;

    if ctx.len() as usize != NA_FRAME_LEN {
        // SAFETY: the helper takes only our own skb; no packet reference is
        // held across it (the fields were copied out above).
        let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, NA_FRAME_LEN as u32, 0) };
        if rc != 0 {
            return Err(drop_reason::HELPER_FAILED);
        }
    }
    if ctx.data() + NA_FRAME_LEN > ctx.data_end() && ctx.pull_data(NA_FRAME_LEN as u32).is_err() {
        return Err(drop_reason::HELPER_FAILED);
    }
    // Packet pointers are stale after the resize: take them again.
    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = vm_mac;
    e.src_addr = m;
    e.ether_type = ETH_P_IPV6.to_be();

    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    ip.vcf = [0x60, 0, 0, 0];
    ip.payload_len = (NA_LEN as u16).to_be_bytes();
    ip.next_hdr = IPPROTO_ICMPV6;
    ip.hop_limit = ND_HOP_LIMIT;
    ip.src_addr = target;
    ip.dst_addr = vm_ip;

    let na = hdr_mut::<[u8; NA_LEN]>(ctx, L4_OFF)?;
    na[0] = ND_NEIGHBOR_ADVERT;
    na[1] = 0;
    na[2] = 0;
    na[3] = 0;
    na[4] = flags;
    na[5] = 0;
    na[6] = 0;
    na[7] = 0;
    let mut i = 0;
    while i < 16 {
        na[8 + i] = target[i];
        i += 1;
    }
    // Option 2: target link-layer address, 1 unit of 8 bytes.
    na[24] = 2;
    na[25] = 1;
    na[26] = m[0];
    na[27] = m[1];
    na[28] = m[2];
    na[29] = m[3];
    na[30] = m[4];
    na[31] = m[5];

    let sum = csum::sum_addr16(&target) * 2
        + csum::sum_addr16(&vm_ip)
        + NA_LEN as u32
        + u32::from(IPPROTO_ICMPV6)
        + (u32::from(ND_NEIGHBOR_ADVERT) << 8)
        + (u32::from(flags) << 8)
        + 0x0201
        + ((u32::from(m[0]) << 8) | u32::from(m[1]))
        + ((u32::from(m[2]) << 8) | u32::from(m[3]))
        + ((u32::from(m[4]) << 8) | u32::from(m[5]));
    let check = !csum::fold(sum);
    na[2] = (check >> 8) as u8;
    na[3] = check as u8;
    Ok(())
}

/// Turns an ICMPv6 echo request to a gateway address into its reply.
#[inline(always)]
#[allow(
    clippy::manual_swap,
    reason = "`mem::swap` compiles to other byte moves; kept so the object stays as verified"
)]
pub fn echo_reply6(ctx: &TcContext, net: &NetworkInfo) -> Result<(), u32> {
    let icmp = hdr_mut::<Icmp6Hdr>(ctx, L4_OFF)?;
    if icmp.code != 0 {
        return Err(drop_reason::GATEWAY_UNROUTED);
    }
    icmp.type_ = ICMPV6_ECHO_REPLY;
    // Swapping the addresses leaves the pseudo-header sum as it was.
    icmp.check = csum::replace16(
        u16::from_be_bytes(icmp.check),
        u16::from(ICMPV6_ECHO_REQUEST) << 8,
        u16::from(ICMPV6_ECHO_REPLY) << 8,
    )
    .to_be_bytes();

    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let requester = ip.src_addr;
    ip.src_addr = ip.dst_addr;
    ip.dst_addr = requester;
    ip.hop_limit = REPLY_HOP_LIMIT;

    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = e.src_addr;
    e.src_addr = net.gw_mac;
    Ok(())
}
