//! What a SNAT flow of either family is and how it lives: the transport
//! fields SNAT reads, the entries' timeouts and refreshes, the inbound
//! flows' records, the port rewrite and the delivery to the VM.

use core::mem::{MaybeUninit, offset_of};

use aya_ebpf::{bindings::BPF_F_MARK_MANGLED_0, programs::TcContext};
use network_types::{
    eth::EthHdr,
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use vmpath_common::{
    InboundFlow, L2Hop, NAT_ST_CLOSING, NAT_ST_OPEN, NatEntry, NatEntry6, NatKey6, SnatConfig,
    drop_reason,
};

use crate::{
    fwd::deliver_local,
    parse::{
        IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, be16, hdr, hdr_mut, write_at,
        write_mac, zeroed,
    },
};

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_RST: u8 = 0x04;
const TCP_SYN: u8 = 0x02;
/// Candidate ports tried for a new flow before giving up.
pub const PROBES: u32 = 16;

/// The transport fields SNAT looks at.
pub struct L4 {
    pub proto: u8,
    /// Source port / ICMP identifier, as on the wire.
    pub sport: u16,
    pub dport: u16,
    /// Offset of the checksum field.
    pub csum_off: usize,
    /// Offset of the field SNAT rewrites (source port or ICMP id on the
    /// way out, destination port or ICMP id on the way back).
    pub port_off: usize,
    pub tcp_flags: u8,
    /// An ICMP echo reply the VM sends (only with `replies`): never
    /// translated, only the reply of an inbound ping.
    pub echo_reply: bool,
}

/// Reads the transport header. ICMP and ICMPv6: echo requests on the way
/// out, echo replies on the way back; with `replies`, also echo replies
/// on the way out (answers to pings from outside).
#[inline(always)]
pub fn l4(
    ctx: &TcContext,
    proto: u8,
    l4_off: usize,
    outbound: bool,
    replies: bool,
) -> Result<L4, u32> {
    match proto {
        IPPROTO_TCP => {
            let t = hdr::<TcpHdr>(ctx, l4_off)?;
            Ok(L4 {
                proto,
                sport: be16(t.source),
                dport: be16(t.dest),
                csum_off: l4_off + offset_of!(TcpHdr, check),
                port_off: l4_off
                    + if outbound {
                        offset_of!(TcpHdr, source)
                    } else {
                        offset_of!(TcpHdr, dest)
                    },
                tcp_flags: tcp_flags(t),
                echo_reply: false,
            })
        }
        IPPROTO_UDP => {
            let u = hdr::<UdpHdr>(ctx, l4_off)?;
            Ok(L4 {
                proto,
                sport: be16(u.src),
                dport: be16(u.dst),
                csum_off: l4_off + offset_of!(UdpHdr, check),
                port_off: l4_off
                    + if outbound {
                        offset_of!(UdpHdr, src)
                    } else {
                        offset_of!(UdpHdr, dst)
                    },
                tcp_flags: 0,
                echo_reply: false,
            })
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            // The two headers share a layout; only the echo types differ.
            let i = hdr::<Icmpv4Hdr>(ctx, l4_off)?;
            let (request, reply) = if proto == IPPROTO_ICMP {
                (ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY)
            } else {
                (ICMPV6_ECHO_REQUEST, ICMPV6_ECHO_REPLY)
            };
            let want = if outbound { request } else { reply };
            let echo_reply = replies && outbound && i.type_ == reply;
            if (i.type_ != want && !echo_reply) || i.code != 0 {
                return Err(drop_reason::SNAT_UNSUPPORTED);
            }
            // Echo: the identifier is the first half of the rest of the header.
            let id = be16([i.data[0], i.data[1]]);
            Ok(L4 {
                proto,
                sport: id,
                dport: id,
                csum_off: l4_off + offset_of!(Icmpv4Hdr, check),
                port_off: l4_off + offset_of!(Icmpv4Hdr, data),
                tcp_flags: 0,
                echo_reply,
            })
        }
        _ => Err(drop_reason::SNAT_UNSUPPORTED),
    }
}

/// FIN, SYN and RST of a TCP header, as `TCP_*` bits.
#[inline(always)]
pub fn tcp_flags(t: &TcpHdr) -> u8 {
    (t.fin() | (t.syn() << 1) | (t.rst() << 2)) as u8
}

const _: () = assert!(
    offset_of!(Icmpv4Hdr, check) == offset_of!(Icmpv6Hdr, check)
        && offset_of!(Icmpv4Hdr, data) == offset_of!(Icmpv6Hdr, data)
);

#[inline(always)]
pub fn expired(cfg: &SnatConfig, e: &NatEntry, proto: u8, now: u64) -> bool {
    now.saturating_sub(e.last_seen) > cfg.timeout_ns(proto, e.state)
}

/// How stale `last_seen` may get before a packet rewrites it. Timeouts
/// are whole seconds; writing the shared entry on every packet would
/// bounce its cache line between the CPUs a flow's two directions run on.
pub const TOUCH_GRANULARITY_NS: u64 = 100_000_000;

/// Was an entry last refreshed at `last_seen` refreshed longer than
/// `TOUCH_GRANULARITY_NS` ago (so a packet should write it again)?
#[inline(always)]
pub fn stale(last_seen: u64, now: u64) -> bool {
    now.saturating_sub(last_seen) > TOUCH_GRANULARITY_NS
}

/// Refreshes an entry; FIN or RST moves a TCP flow to the closing timeout.
#[inline(always)]
pub fn touch(e: *mut NatEntry, now: u64, tcp_flags: u8) {
    // SAFETY: callers pass a pointer from `get_ptr_mut` (bpf_map_lookup_elem), valid
    // until the program returns. The entry is shared by a flow's two
    // directions (possibly on two CPUs): plain integer stores, a race only
    // leaves a stale `last_seen` or a repeated state change.
    unsafe {
        if stale((*e).last_seen, now) {
            (*e).last_seen = now;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 && (*e).state != NAT_ST_CLOSING {
            (*e).state = NAT_ST_CLOSING;
        }
    }
}

/// Is a refresh of a flow entry last refreshed at `last_seen` due: stale
/// by more than `TOUCH_GRANULARITY_NS`, or a FIN or RST to record?
///
/// Between refreshes the two entries of an outbound flow are trusted as a
/// pair without looking up the other: the egress path confirms the return
/// entry is still the flow's (and refreshes both) only when the outbound
/// entry's refresh is due. Every refresh of the outbound entry follows
/// such a check or the allocation, and no timeout is shorter than a
/// second, so the return entry cannot have expired and gone to another
/// flow in between. The return path refreshes the outbound entry only when
/// the return entry's refresh is due; the agent's sweep judges a flow by
/// the later of the two. Each saves a hash lookup on all but a few packets
/// a second.
#[inline(always)]
pub fn refresh_due(last_seen: u64, now: u64, tcp_flags: u8) -> bool {
    tcp_flags & (TCP_FIN | TCP_RST) != 0 || stale(last_seen, now)
}

/// Is the inbound flow `flow` (from a `vmp_inbound` or `vmp_inbound6`
/// lookup) still live? Refreshes it when so.
#[inline(always)]
pub fn inbound_live(
    cfg: &SnatConfig,
    proto: u8,
    flow: *mut InboundFlow,
    now: u64,
    tcp_flags: u8,
) -> bool {
    // SAFETY: callers pass a pointer from `get_ptr_mut` (bpf_map_lookup_elem),
    // valid until the program returns; plain integer reads and stores (a
    // race with the other direction only leaves a stale timestamp).
    unsafe {
        if now.saturating_sub((*flow).last_seen) > cfg.timeout_ns(proto, (*flow).state) {
            return false;
        }
        if stale((*flow).last_seen, now) {
            (*flow).last_seen = now;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            (*flow).state = NAT_ST_CLOSING;
        }
    }
    true
}

/// The ports of an inbound frame's transport header as the VM's reply
/// carries them: (VM port, remote port, TCP flags); `None` for what is
/// not recorded (not TCP, UDP or an echo request of `proto`).
#[inline(always)]
pub fn inbound_ports(
    ctx: &TcContext,
    proto: u8,
    l4_off: usize,
) -> Result<Option<(u16, u16, u8)>, u32> {
    Ok(match proto {
        IPPROTO_TCP => {
            let t = hdr::<TcpHdr>(ctx, l4_off)?;
            Some((be16(t.dest), be16(t.source), tcp_flags(t)))
        }
        IPPROTO_UDP => {
            let u = hdr::<UdpHdr>(ctx, l4_off)?;
            Some((be16(u.dst), be16(u.src), 0))
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let i = hdr::<Icmpv4Hdr>(ctx, l4_off)?;
            let request = if proto == IPPROTO_ICMP {
                ICMP_ECHO_REQUEST
            } else {
                ICMPV6_ECHO_REQUEST
            };
            if i.type_ != request {
                return Ok(None);
            }
            let id = be16([i.data[0], i.data[1]]);
            Some((id, id, 0))
        }
        _ => None,
    })
}

/// A new inbound flow's record.
#[inline(always)]
pub fn new_inbound(now: u64) -> InboundFlow {
    InboundFlow {
        last_seen: now,
        state: NAT_ST_OPEN,
        _pad: [0; 7],
    }
}

/// Refreshes a recorded inbound flow with a frame from outside.
#[inline(always)]
pub fn refresh_inbound(flow: *mut InboundFlow, now: u64, tcp_flags: u8) {
    // SAFETY: callers pass a pointer from `get_ptr_mut`, valid until the
    // program returns; plain integer stores (see `inbound_live`).
    unsafe {
        if stale((*flow).last_seen, now) {
            (*flow).last_seen = now;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            (*flow).state = NAT_ST_CLOSING;
        } else if tcp_flags & TCP_SYN != 0 {
            // A new connection on an old tuple.
            (*flow).state = NAT_ST_OPEN;
        }
    }
}

/// Replaces the port (or ICMP id) at `l4.port_off`, fixing the checksum.
#[inline(always)]
pub fn rewrite_port(ctx: &TcContext, l4: &L4, old: u16, new: u16) -> Result<(), u32> {
    if old == new {
        return Ok(());
    }
    let old_p = u64::from(u16::from_ne_bytes(old.to_be_bytes()));
    let new_p = u64::from(u16::from_ne_bytes(new.to_be_bytes()));
    let mut flags = 2u64;
    if l4.proto == IPPROTO_UDP {
        flags |= u64::from(BPF_F_MARK_MANGLED_0);
    }
    ctx.l4_csum_replace(l4.csum_off, old_p, new_p, flags)
        .map_err(|_| drop_reason::HELPER_FAILED)?;
    write_at(ctx, l4.port_off, &new.to_be_bytes())
}

/// Sets the frame's MACs for the VM of a SNAT flow (from the gateway) and
/// delivers it to the VM's port.
#[inline(always)]
pub fn to_vm(ctx: &TcContext, e: &NatEntry) -> Result<Option<i32>, u32> {
    to_port(ctx, &e.hop, e.port_id)
}

/// `to_vm` by the entry's fields (either family's).
#[inline(always)]
pub fn to_port(ctx: &TcContext, hop: &L2Hop, port_id: u32) -> Result<Option<i32>, u32> {
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    write_mac(&mut eth.src_addr, hop.src_mac);
    write_mac(&mut eth.dst_addr, hop.dst_mac);
    deliver_local(ctx, hop.ifindex, port_id).map(Some)
}

/// Builds a key in `slot`, field by field: `NatKey6::new` goes through a
/// word array, a second copy on the stack, and the uplink program's
/// IPv4 and IPv6 paths together come close to the 512-byte stack.
#[inline(always)]
pub fn key6<'a>(
    slot: &'a mut MaybeUninit<NatKey6>,
    src: &[u8; 16],
    dst: &[u8; 16],
    sport: u16,
    dport: u16,
    proto: u8,
) -> &'a NatKey6 {
    let k = zeroed(slot);
    k.src = *src;
    k.dst = *dst;
    k.sport = sport;
    k.dport = dport;
    k.proto = proto;
    k
}

/// `NatKey6::reply`, built in `slot`.
#[inline(always)]
pub fn reply6<'a>(
    slot: &'a mut MaybeUninit<NatKey6>,
    remote: &[u8; 16],
    snat: &[u8; 16],
    remote_port: u16,
    port: u16,
    proto: u8,
) -> &'a NatKey6 {
    let sport = if proto == IPPROTO_ICMPV6 {
        port
    } else {
        remote_port
    };
    key6(slot, remote, snat, sport, port, proto)
}

#[inline(always)]
pub fn expired6(cfg: &SnatConfig, e: &NatEntry6, proto: u8, now: u64) -> bool {
    now.saturating_sub(e.last_seen) > cfg.timeout_ns(proto, e.state)
}
