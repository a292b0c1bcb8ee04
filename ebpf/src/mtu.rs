//! ICMP errors from the gateway on the routed path. A frame larger than
//! the network MTU is answered with ICMP fragmentation-needed (IPv4 with
//! DF) / ICMPv6 packet-too-big, and one whose TTL / hop limit runs out
//! with time-exceeded (so traceroute shows the gateway as a hop), rather
//! than dropped silently. The error is built in place from the
//! offending frame: trimmed to its IP header + 8 bytes (the quote), a new
//! IP + ICMP header pushed in front, and sent back out of the interface it
//! came in by, to its sender.
//!
//! IPv4 without DF is dropped and counted (`MTU_EXCEEDED_NO_DF`): the data
//! path never fragments, and a redirected frame never passes the kernel's
//! forwarding path that would. Senders that clear DF are rare (Linux sets
//! DF on TCP and UDP by default and fragments locally to its path MTU).
//!
//! GSO packets are larger than the MTU by design: for them the size of one
//! segment (IP and transport headers + `gso_size`) is compared.
//!
//! The quote is the IP header + 8 bytes (IPv6 too: Linux needs no more to
//! find the socket, and a longer quote would need a checksum over data the
//! program cannot bound cheaply). A frame with a partial TCP checksum
//! (CHECKSUM_PARTIAL, from a local veth sender) cannot be trimmed below its
//! checksum field: it quotes 20 bytes of transport header instead. The
//! error frame keeps the skb's checksum offload state; it is delivered to
//! a VM or to the fabric, where nothing recomputes it.

use aya_ebpf::{
    bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, helpers::generated::bpf_skb_change_tail,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::drop_reason;

use crate::{
    counters, csum,
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, hdr,
        hdr_mut,
    },
    verdict::{Verdict, reply_out},
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_FRAG_NEEDED: u8 = 4;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMPV6_PKT_TOOBIG: u8 = 2;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMPV6_TIME_EXCEEDED: u8 = 3;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const ICMP_ECHO_REQUEST: u8 = 8;
/// ICMPv6 types below this are errors.
const ICMPV6_INFO_MIN: u8 = 128;
const ERROR_TTL: u8 = 64;
/// IP precedence "internetwork control", as Linux sends its ICMP errors.
const ERROR_TOS: u8 = 0xc0;
const IP_DF: u16 = 0x4000;
/// Bytes of the offending packet's transport header quoted.
const QUOTE_L4: usize = 8;
/// ... or, when the skb cannot be trimmed that short (a partial TCP
/// checksum lies beyond it), this many.
const QUOTE_L4_PARTIAL: usize = 20;
const ICMP_HDR: usize = 8;
const IP4_HDR: usize = 20;
const IP6_HDR: usize = 40;

/// Is this packet larger than `mtu` on the wire? `ip_len` is its IP
/// length, `l4_off` the offset of its transport header of protocol
/// `proto`. A GSO packet is judged by one segment.
#[inline(always)]
pub fn too_big(ctx: &TcContext, mtu: u16, ip_len: u16, l4_off: usize, proto: u8) -> bool {
    if mtu == 0 || ip_len <= mtu {
        return false;
    }
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let gso = unsafe { (*ctx.skb.skb).gso_size };
    if gso == 0 {
        return true;
    }
    let l4_hdr = match proto {
        IPPROTO_TCP => match hdr::<[u8; 13]>(ctx, l4_off) {
            // The data offset, in the high nibble of byte 12.
            Ok(t) => u32::from(t[12] >> 4) * 4,
            Err(_) => 20,
        },
        IPPROTO_UDP => 8,
        _ => 0,
    };
    (l4_off - ETH_LEN) as u32 + l4_hdr + gso > u32::from(mtu)
}

/// The IPv4 frame at hand is too big for `mtu`: with DF, it becomes an
/// ICMP fragmentation-needed from `from` to its sender (Ethernet source
/// `eth_src`), sent back out of `ifindex` (port id `port_id`, or
/// `NO_PORT_ID` for the uplink); without DF, it is dropped.
#[inline(always)]
pub fn frag_needed4(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: [u8; 4],
    mtu: u16,
    eth_src: [u8; 6],
) -> Verdict {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, frags, to) = (ip.vihl, ip.frags, ip.src_addr);
    if u16::from_be_bytes(frags) & IP_DF == 0 {
        return Err(drop_reason::MTU_EXCEEDED_NO_DF);
    }
    if from == [0; 4] {
        return Err(drop_reason::MTU_EXCEEDED);
    }
    let m = mtu.to_be_bytes();
    let error = Icmp {
        kind: ICMP_DEST_UNREACH,
        code: ICMP_FRAG_NEEDED,
        rest: [0, 0, m[0], m[1]],
        reason: drop_reason::MTU_EXCEEDED,
    };
    error4(ctx, ifindex, port_id, from, eth_src, to, vihl, error)
}

/// The IPv4 datagram at hand found nothing to serve it (a Service
/// without a ready backend): it becomes an ICMP port unreachable from
/// `from` to its sender, sent back out of `ifindex` (port id `port_id`).
#[inline(always)]
pub fn port_unreachable4(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: [u8; 4],
    eth_src: [u8; 6],
) -> Verdict {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, to) = (ip.vihl, ip.src_addr);
    let error = Icmp {
        kind: ICMP_DEST_UNREACH,
        code: ICMP_PORT_UNREACH,
        rest: [0; 4],
        reason: drop_reason::SERVICE_NO_BACKEND,
    };
    error4(ctx, ifindex, port_id, from, eth_src, to, vihl, error)
}

/// What an ICMP error carries besides its quote, and what the offending
/// frame is counted as.
struct Icmp {
    kind: u8,
    code: u8,
    /// The header's second word (unused, or the next-hop MTU).
    rest: [u8; 4],
    reason: u32,
}

/// The IPv4 frame at hand whose TTL runs out here: it becomes an ICMP
/// time-exceeded from `from` to its sender, sent back out of `ifindex`
/// (port id `port_id`). Never about an ICMP error or a later fragment
/// (RFC 1812 4.3.2.7): those are only dropped, as without a `from`.
#[inline(always)]
pub fn time_exceeded4(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: [u8; 4],
    eth_src: [u8; 6],
) -> Verdict {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, frags, to, proto) = (ip.vihl, ip.frags, ip.src_addr, ip.proto);
    if from == [0; 4] || u16::from_be_bytes(frags) & 0x1fff != 0 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    if proto == IPPROTO_ICMP {
        let l4 = ETH_LEN + usize::from(vihl & 0x0f) * 4;
        let kind: u8 = ctx.load(l4).map_err(|_| drop_reason::MALFORMED)?;
        // Queries (echo, timestamp, ...) are answered; errors never.
        if !matches!(kind, 0 | ICMP_ECHO_REQUEST | 13 | 14) {
            return Err(drop_reason::ROUTE_TTL_EXCEEDED);
        }
    }
    let error = Icmp {
        kind: ICMP_TIME_EXCEEDED,
        code: 0,
        rest: [0; 4],
        reason: drop_reason::ROUTE_TTL_EXCEEDED,
    };
    error4(ctx, ifindex, port_id, from, eth_src, to, vihl, error)
}

/// Builds `error` in place from the IPv4 frame at hand (from `from` to
/// `to`, its sender) and sends it back out of `ifindex`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn error4(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: [u8; 4],
    eth_src: [u8; 6],
    to: [u8; 4],
    vihl: u8,
    error: Icmp,
) -> Verdict {
    let ihl = usize::from(vihl & 0x0f) * 4;
    if !(IP4_HDR..=60).contains(&ihl) {
        return Err(drop_reason::MALFORMED);
    }
    let quote = trim(ctx, ihl)?;
    push(ctx, IP4_HDR + ICMP_HDR)?;
    write_eth(ctx, eth_src, ETH_P_IP)?;

    let tot = (IP4_HDR + ICMP_HDR + quote) as u16;
    let ip_sum = 0x4500
        + u32::from(ERROR_TOS)
        + u32::from(tot)
        + (u32::from(ERROR_TTL) << 8)
        + u32::from(IPPROTO_ICMP)
        + sum_addr4(from)
        + sum_addr4(to);
    // Taken after `trim`/`push`/`write_eth`, the helpers that move packet data.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.vihl = 0x45;
    ip.tos = ERROR_TOS;
    ip.tot_len = tot.to_be_bytes();
    ip.id = [0; 2];
    ip.frags = [0; 2];
    ip.ttl = ERROR_TTL;
    ip.proto = IPPROTO_ICMP;
    ip.check = (!csum::fold(ip_sum)).to_be_bytes();
    ip.src_addr = from;
    ip.dst_addr = to;
    let icmp_off = ETH_LEN + IP4_HDR;
    let r = error.rest;
    let sum = (u32::from(error.kind) << 8)
        + u32::from(error.code)
        + (u32::from(r[0]) << 8)
        + u32::from(r[1])
        + (u32::from(r[2]) << 8)
        + u32::from(r[3]);
    let check = !csum::fold(sum + sum_packet(ctx, icmp_off + ICMP_HDR, quote)?);
    let c = check.to_be_bytes();
    *hdr_mut::<[u8; ICMP_HDR]>(ctx, icmp_off)? =
        [error.kind, error.code, c[0], c[1], r[0], r[1], r[2], r[3]];
    sent(ctx, ifindex, port_id, error.reason)
}

/// The IPv6 frame at hand is too big for `mtu`: it becomes an ICMPv6
/// packet-too-big from `from` to its sender (Ethernet source `eth_src`),
/// sent back out of `ifindex` (port id `port_id`).
#[inline(always)]
pub fn packet_too_big6(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: &[u8; 16],
    mtu: u16,
    eth_src: [u8; 6],
) -> Verdict {
    if from[0] == 0 && from[1] == 0 {
        return Err(drop_reason::MTU_EXCEEDED);
    }
    let m = mtu.to_be_bytes();
    let error = Icmp {
        kind: ICMPV6_PKT_TOOBIG,
        code: 0,
        rest: [0, 0, m[0], m[1]],
        reason: drop_reason::MTU_EXCEEDED,
    };
    error6(ctx, ifindex, port_id, from, eth_src, error)
}

/// The IPv6 datagram at hand found nothing to serve it (a Service
/// without a ready backend): it becomes an ICMPv6 destination
/// unreachable, port unreachable, from `from` to its sender, sent back
/// out of `ifindex` (port id `port_id`).
#[inline(always)]
pub fn port_unreachable6(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: &[u8; 16],
    eth_src: [u8; 6],
) -> Verdict {
    let error = Icmp {
        kind: ICMPV6_DEST_UNREACH,
        code: ICMPV6_PORT_UNREACH,
        rest: [0; 4],
        reason: drop_reason::SERVICE_NO_BACKEND,
    };
    error6(ctx, ifindex, port_id, from, eth_src, error)
}

/// The IPv6 frame at hand whose hop limit runs out here: it becomes an
/// ICMPv6 time-exceeded from `from` to its sender, sent back out of
/// `ifindex` (port id `port_id`). Never about an ICMPv6 error.
#[inline(always)]
pub fn time_exceeded6(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: &[u8; 16],
    eth_src: [u8; 6],
) -> Verdict {
    if from[0] == 0 && from[1] == 0 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    if hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr == IPPROTO_ICMPV6 {
        let kind: u8 = ctx
            .load(ETH_LEN + IP6_HDR)
            .map_err(|_| drop_reason::MALFORMED)?;
        if kind < ICMPV6_INFO_MIN {
            return Err(drop_reason::ROUTE_TTL_EXCEEDED);
        }
    }
    let error = Icmp {
        kind: ICMPV6_TIME_EXCEEDED,
        code: 0,
        rest: [0; 4],
        reason: drop_reason::ROUTE_TTL_EXCEEDED,
    };
    error6(ctx, ifindex, port_id, from, eth_src, error)
}

/// Builds `error` in place from the IPv6 frame at hand (from `from` to
/// its sender) and sends it back out of `ifindex`.
#[inline(always)]
fn error6(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    from: &[u8; 16],
    eth_src: [u8; 6],
    error: Icmp,
) -> Verdict {
    let quote = trim(ctx, IP6_HDR)?;
    push(ctx, IP6_HDR + ICMP_HDR)?;
    write_eth(ctx, eth_src, ETH_P_IPV6)?;

    let plen = (ICMP_HDR + quote) as u16;
    let hdr_end = ETH_LEN + IP6_HDR + ICMP_HDR;
    // The offending packet's source, now inside the quote.
    // Taken after `push`, the helper that moved packet data.
    let to = hdr::<Ipv6Hdr>(ctx, hdr_end)?.src_addr;
    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    ip.vcf = [0x60, 0, 0, 0];
    ip.payload_len = plen.to_be_bytes();
    ip.next_hdr = IPPROTO_ICMPV6;
    ip.hop_limit = ERROR_TTL;
    ip.src_addr = *from;
    ip.dst_addr = to;
    let sum = csum::sum_addr16(from) + csum::sum_addr16(&to);
    let r = error.rest;
    let sum = sum
        + u32::from(plen)
        + u32::from(IPPROTO_ICMPV6)
        + (u32::from(error.kind) << 8)
        + u32::from(error.code)
        + (u32::from(r[0]) << 8)
        + u32::from(r[1])
        + (u32::from(r[2]) << 8)
        + u32::from(r[3]);
    let check = !csum::fold(sum + sum_packet(ctx, hdr_end, quote)?);
    let c = check.to_be_bytes();
    *hdr_mut::<[u8; ICMP_HDR]>(ctx, ETH_LEN + IP6_HDR)? =
        [error.kind, error.code, c[0], c[1], r[0], r[1], r[2], r[3]];
    sent(ctx, ifindex, port_id, error.reason)
}

/// Trims the frame to its Ethernet and IP headers (`l3_len` bytes) and
/// the quoted transport bytes; returns the quote's length (IP header
/// included).
#[inline(always)]
fn trim(ctx: &TcContext, l3_len: usize) -> Result<usize, u32> {
    let mut quote = l3_len + QUOTE_L4;
    // SAFETY: the helper takes only our own skb; the callers hold no packet pointer
    // across `trim` and take them again after it.
    let mut rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_LEN + quote) as u32, 0) };
    if rc != 0 {
        quote = l3_len + QUOTE_L4_PARTIAL;
        // SAFETY: as above: our own skb, no packet pointer held across the call.
        rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_LEN + quote) as u32, 0) };
    }
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    Ok(quote)
}

/// Makes room for `len` bytes of new headers right after the Ethernet
/// header (which stays in place, still addressed as the offending frame
/// was), and makes the whole frame directly readable.
#[inline(always)]
fn push(ctx: &TcContext, len: usize) -> Result<(), u32> {
    ctx.adjust_room(len as i32, BPF_ADJ_ROOM_MAC, 0)
        .map_err(|_| drop_reason::HELPER_FAILED)?;
    let total = ctx.len();
    if ctx.data() + total as usize > ctx.data_end() && ctx.pull_data(total).is_err() {
        return Err(drop_reason::HELPER_FAILED);
    }
    Ok(())
}

/// Addresses the frame back to the sender of the offending one.
#[inline(always)]
fn write_eth(ctx: &TcContext, eth_src: [u8; 6], ether_type: u16) -> Result<(), u32> {
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.dst_addr = eth.src_addr;
    eth.src_addr = eth_src;
    eth.ether_type = ether_type.to_be();
    Ok(())
}

#[inline(always)]
fn sum_addr4(a: [u8; 4]) -> u32 {
    (u32::from(a[0]) << 8) + u32::from(a[1]) + (u32::from(a[2]) << 8) + u32::from(a[3])
}

/// Sum of the 16-bit words of `len` (even, at most 80) packet bytes at
/// `off`, read with `bpf_skb_load_bytes` (no packet-pointer arithmetic
/// on a variable length).
#[inline(always)]
fn sum_packet(ctx: &TcContext, off: usize, len: usize) -> Result<u32, u32> {
    let mut sum = 0u32;
    let mut i = 0usize;
    while i < 40 {
        if 2 * i >= len {
            break;
        }
        let w: [u8; 2] = ctx.load(off + 2 * i).map_err(|_| drop_reason::MALFORMED)?;
        sum += (u32::from(w[0]) << 8) | u32::from(w[1]);
        i += 1;
    }
    Ok(sum)
}

/// The offending frame is consumed (counted under `reason`); its error
/// goes back out of the interface it came in by.
#[inline(always)]
fn sent(ctx: &TcContext, ifindex: u32, port_id: u32, reason: u32) -> Verdict {
    counters::count_drop(port_id, reason);
    reply_out(ctx, ifindex)
}
