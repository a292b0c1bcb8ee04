//! ICMP errors for SNAT flows (destination unreachable, time exceeded,
//! parameter problem; for IPv6 also packet too big), arriving on the
//! uplink addressed to the node's SNAT address and quoting the translated
//! packet: translated back and delivered to the VM. The outer destination,
//! the quoted source address and source port (or ICMP echo id) go back to
//! the VM's; the outer and quoted IPv4 header checksums, the quoted
//! transport checksum (when quoted) and the ICMP checksum over all of it
//! (for ICMPv6 its pseudo header too) are fixed incrementally.

use core::mem::{MaybeUninit, offset_of};

use aya_ebpf::programs::TcContext;
use network_types::{
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use vmpath_common::{NatKey, SnatConfig, drop_reason};

use crate::{
    csum,
    parse::{
        ETH_LEN, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, addr16_eq, be16, hdr,
        hdr_mut,
    },
};

use super::{
    flow::{expired, reply6, to_port, to_vm},
    maps::{SNAT_IN, SNAT6_IN},
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROB: u8 = 12;
const ICMP_ECHO_REQUEST: u8 = 8;
/// ICMPv6 errors: destination unreachable (1), packet too big (2), time
/// exceeded (3), parameter problem (4).
const ICMPV6_ERRORS: core::ops::RangeInclusive<u8> = 1..=4;
const ICMPV6_ECHO_REQUEST: u8 = 128;

/// The ICMP error at `l4_off` (outer destination the SNAT address), or
/// `Ok(None)` when it is not one for a SNAT flow of this node.
#[inline(always)]
pub fn ingress4(ctx: &TcContext, cfg: &SnatConfig, l4_off: usize) -> Result<Option<i32>, u32> {
    let icmp_type = hdr::<Icmpv4Hdr>(ctx, l4_off)?.type_;
    if icmp_type != ICMP_DEST_UNREACH
        && icmp_type != ICMP_TIME_EXCEEDED
        && icmp_type != ICMP_PARAMETER_PROB
    {
        return Ok(None);
    }
    let in_ip = l4_off + Icmpv4Hdr::LEN;
    let Ok(iip) = hdr::<Ipv4Hdr>(ctx, in_ip) else {
        return Ok(None);
    };
    let (ivihl, isrc, idst, iproto) = (iip.vihl, iip.src_addr, iip.dst_addr, iip.proto);
    let ihl = usize::from(ivihl & 0x0f) * 4;
    if isrc != cfg.addr4 || !(Ipv4Hdr::LEN..=60).contains(&ihl) {
        return Ok(None);
    }
    let in_l4 = in_ip + ihl;
    // An error quotes at least 8 bytes of the transport header: the ports
    // (or the echo header) and, but for TCP, its checksum.
    let Ok(q) = hdr::<[u8; 8]>(ctx, in_l4) else {
        return Ok(None);
    };
    let q = *q;
    // The quoted packet left from (SNAT address, NAT port) to (remote,
    // remote port): its reply would carry the key SNAT_IN holds.
    let (nat_port, remote_port, port_off, check_off) = match iproto {
        IPPROTO_TCP => (
            be(q[0], q[1]),
            be(q[2], q[3]),
            in_l4 + offset_of!(TcpHdr, source),
            in_l4 + offset_of!(TcpHdr, check),
        ),
        IPPROTO_UDP => (
            be(q[0], q[1]),
            be(q[2], q[3]),
            in_l4 + offset_of!(UdpHdr, src),
            in_l4 + offset_of!(UdpHdr, check),
        ),
        IPPROTO_ICMP if q[0] == ICMP_ECHO_REQUEST => {
            let id = be(q[4], q[5]);
            (
                id,
                id,
                in_l4 + offset_of!(Icmpv4Hdr, data),
                in_l4 + offset_of!(Icmpv4Hdr, check),
            )
        }
        _ => return Ok(None),
    };
    let key: NatKey = NatKey::reply(idst, cfg.addr4, remote_port, nat_port, iproto);
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(e) = (unsafe { SNAT_IN.get(&key) }) else {
        return Ok(None);
    };
    let e = *e;
    let now = crate::clock::flow_now();
    if expired(cfg, &e, iproto, now) {
        return Ok(None);
    }

    // Outer header: destination back to the VM, TTL down by one.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    if ip.ttl <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    let mut c = be16(ip.check);
    c = replace_addr(c, ip.dst_addr, e.addr);
    c = csum::dec_ttl4(ip, c);
    ip.check = c.to_be_bytes();
    ip.dst_addr = e.addr;

    // Quoted packet, then the ICMP checksum over every change in it.
    let mut icmp_check = be16(hdr::<Icmpv4Hdr>(ctx, l4_off)?.check);
    let iip = hdr_mut::<Ipv4Hdr>(ctx, in_ip)?;
    let old_c = be16(iip.check);
    let new_c = replace_addr(old_c, isrc, e.addr);
    icmp_check = replace_addr(icmp_check, isrc, e.addr);
    icmp_check = csum::replace16(icmp_check, old_c, new_c);
    iip.check = new_c.to_be_bytes();
    iip.src_addr = e.addr;
    // The quoted transport checksum, when quoted (UDP 0 means none): TCP
    // and UDP cover the pseudo header (address) and the port, ICMP echo
    // only its id.
    if let Ok(tc) = hdr_mut::<[u8; 2]>(ctx, check_off) {
        let old_t = be16(*tc);
        if !(iproto == IPPROTO_UDP && old_t == 0) {
            let mut new_t = csum::replace16(old_t, nat_port, e.port);
            if iproto != IPPROTO_ICMP {
                new_t = replace_addr(new_t, isrc, e.addr);
            }
            if iproto == IPPROTO_UDP && new_t == 0 {
                new_t = 0xffff;
            }
            icmp_check = csum::replace16(icmp_check, old_t, new_t);
            *tc = new_t.to_be_bytes();
        }
    }
    *hdr_mut::<[u8; 2]>(ctx, port_off)? = e.port.to_be_bytes();
    icmp_check = csum::replace16(icmp_check, nat_port, e.port);
    hdr_mut::<Icmpv4Hdr>(ctx, l4_off)?.check = icmp_check.to_be_bytes();
    to_vm(ctx, &e)
}

/// The ICMPv6 error at `l4_off` (outer destination the IPv6 SNAT address),
/// or `Ok(None)` when it is not one for a SNAT flow of this node.
#[inline(always)]
pub fn ingress6(ctx: &TcContext, cfg: &SnatConfig, l4_off: usize) -> Result<Option<i32>, u32> {
    if !ICMPV6_ERRORS.contains(&hdr::<Icmpv6Hdr>(ctx, l4_off)?.type_) {
        return Ok(None);
    }
    let in_ip = l4_off + Icmpv6Hdr::LEN;
    let Ok(iip) = hdr::<Ipv6Hdr>(ctx, in_ip) else {
        return Ok(None);
    };
    // Addresses compared and keyed in place (copies are spilled byte by
    // byte); the quoted source is the SNAT address from here on.
    let iproto = iip.next_hdr;
    if !addr16_eq(&iip.src_addr, &cfg.addr6) {
        return Ok(None);
    }
    let in_l4 = in_ip + Ipv6Hdr::LEN;
    let Ok(q) = hdr::<[u8; 8]>(ctx, in_l4) else {
        return Ok(None);
    };
    let q = *q;
    let (nat_port, remote_port, port_off, check_off) = match iproto {
        IPPROTO_TCP => (
            be(q[0], q[1]),
            be(q[2], q[3]),
            in_l4 + offset_of!(TcpHdr, source),
            in_l4 + offset_of!(TcpHdr, check),
        ),
        IPPROTO_UDP => (
            be(q[0], q[1]),
            be(q[2], q[3]),
            in_l4 + offset_of!(UdpHdr, src),
            in_l4 + offset_of!(UdpHdr, check),
        ),
        IPPROTO_ICMPV6 if q[0] == ICMPV6_ECHO_REQUEST => {
            let id = be(q[4], q[5]);
            (
                id,
                id,
                in_l4 + offset_of!(Icmpv6Hdr, data),
                in_l4 + offset_of!(Icmpv6Hdr, check),
            )
        }
        _ => return Ok(None),
    };
    let mut slot = MaybeUninit::uninit();
    let key = reply6(
        &mut slot,
        &hdr::<Ipv6Hdr>(ctx, in_ip)?.dst_addr,
        &cfg.addr6,
        remote_port,
        nat_port,
        iproto,
    );
    // SAFETY: a map lookup; the value stays valid for this program run (read
    // in place: a copy would cost stack the uplink program has not).
    let Some(e) = (unsafe { SNAT6_IN.get(key) }) else {
        return Ok(None);
    };
    let now = crate::clock::flow_now();
    if expired(cfg, e, iproto, now) {
        return Ok(None);
    }

    // Outer header: destination back to the VM (in the ICMPv6 pseudo
    // header), hop limit down by one (in no checksum).
    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    if ip.hop_limit <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    ip.hop_limit -= 1;
    ip.dst_addr = e.addr;
    let mut icmp_check = be16(hdr::<Icmpv6Hdr>(ctx, l4_off)?.check);
    icmp_check = csum::replace_addr16(icmp_check, &cfg.addr6, &e.addr);

    // Quoted packet: source address, transport checksum, port.
    hdr_mut::<Ipv6Hdr>(ctx, in_ip)?.src_addr = e.addr;
    icmp_check = csum::replace_addr16(icmp_check, &cfg.addr6, &e.addr);
    // TCP, UDP and ICMPv6 all cover the pseudo header (address) and the
    // port or id.
    if let Ok(tc) = hdr_mut::<[u8; 2]>(ctx, check_off) {
        let old_t = be16(*tc);
        if !(iproto == IPPROTO_UDP && old_t == 0) {
            let mut new_t = csum::replace16(old_t, nat_port, e.port);
            new_t = csum::replace_addr16(new_t, &cfg.addr6, &e.addr);
            if iproto == IPPROTO_UDP && new_t == 0 {
                new_t = 0xffff;
            }
            icmp_check = csum::replace16(icmp_check, old_t, new_t);
            *tc = new_t.to_be_bytes();
        }
    }
    *hdr_mut::<[u8; 2]>(ctx, port_off)? = e.port.to_be_bytes();
    icmp_check = csum::replace16(icmp_check, nat_port, e.port);
    hdr_mut::<Icmpv6Hdr>(ctx, l4_off)?.check = icmp_check.to_be_bytes();
    to_port(ctx, &e.hop, e.port_id)
}

#[inline(always)]
fn be(a: u8, b: u8) -> u16 {
    u16::from_be_bytes([a, b])
}

/// A checksum after a 4-byte address it covers changed.
#[inline(always)]
fn replace_addr(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let c = csum::replace16(check, be(old[0], old[1]), be(new[0], new[1]));
    csum::replace16(c, be(old[2], old[3]), be(new[2], new[3]))
}
