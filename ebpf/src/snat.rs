//! SNAT for networks with `egress: SNAT` (IPv4): TCP, UDP and ICMP echo
//! leave with the node's SNAT address and a port (or ICMP identifier) from
//! the node's reserved range; return traffic on the uplink is translated
//! back. Per-flow state lives in two LRU maps, one per direction, each
//! entry refreshed by traffic either way and judged against a
//! protocol-appropriate idle timeout; the agent sweeps expired flows and
//! recounts each VM's ports (the quota).
//!
//! On a SNAT network with routed ingress (`NET_F_INGRESS`), flows opened
//! from outside to a VM's own address are recorded where they are
//! delivered (`track_inbound4`, from `uplink` and `vxlan_rx`) in
//! `vmp_inbound`, keyed by the tuple the VM's replies carry; the egress
//! path sends a frame that matches one un-NATed, unless the tuple is an
//! outbound SNAT flow already (that one keeps its translation).
//!
//! The transport checksum is fixed with `bpf_l4_csum_replace` (the IPv4
//! header's in place, `csum::replace_addr4`); address changes use
//! `BPF_F_PSEUDO_HDR`, so a frame a veth hands over
//! with CHECKSUM_PARTIAL (only the pseudo-header sum filled in) stays
//! right, and a full checksum is updated incrementally.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    btf_maps::{Array, HashMap, LruHashMap},
    helpers::generated::bpf_get_prandom_u32,
    macros::btf_map,
    programs::TcContext,
};
use core::mem::offset_of;

use network_types::{
    eth::EthHdr,
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::Ipv4Hdr,
    tcp::TcpHdr,
    udp::UdpHdr,
};
use vmpath_common::{
    FRAG_IN, FRAG_OUT, FRAG_TIMEOUT_NS, FragKey, InboundFlow, L2Hop, NAT_ST_CLOSING, NAT_ST_OPEN,
    NET_F_INGRESS, NatEntry, NatKey, NetworkInfo, PortInfo, SnatConfig, drop_reason, maps,
};

use crate::{
    csum,
    fwd::deliver_local,
    next_hop::{self, NextHop},
    parse::{
        ETH_LEN, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, be16, hdr, hdr_mut,
        write_at, write_mac,
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

const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);

/// Slot 0: the node's SNAT address, port range, quota and timeouts.
#[btf_map(name = "vmp_snat_cfg")]
pub static SNAT_CONFIG: Array<SnatConfig, { maps::SNAT_CONFIG.max_entries as usize }> =
    Array::new();

/// The VM's tuple -> the translated source (address, port).
#[btf_map(name = "vmp_snat_out")]
pub static SNAT_OUT: LruHashMap<NatKey, NatEntry, { maps::SNAT_OUT.max_entries as usize }> =
    LruHashMap::new();

/// The reply's tuple (as it arrives on the uplink) -> the VM's address,
/// port, ifindex and MAC.
#[btf_map(name = "vmp_snat_in")]
pub static SNAT_IN: LruHashMap<NatKey, NatEntry, { maps::SNAT_IN.max_entries as usize }> =
    LruHashMap::new();

/// VM address (IPv4, as a native u32) -> SNAT flows it holds (quota). The
/// data path counts up; the agent's sweep recounts after expiring flows.
#[btf_map(name = "vmp_snat_quota")]
pub static SNAT_QUOTA: HashMap<u32, u32, { maps::SNAT_QUOTA.max_entries as usize }> =
    HashMap::new();

/// Flows opened from outside to VMs of SNAT networks with routed ingress,
/// by the tuple the VM's replies carry.
#[btf_map(name = "vmp_inbound")]
pub static INBOUND: LruHashMap<NatKey, InboundFlow, { maps::INBOUND.max_entries as usize }> =
    LruHashMap::new();

/// Fragmented datagrams whose first fragment SNAT translated (or let
/// through un-NATed), so their later fragments, which carry no ports,
/// take the same way. Both directions.
#[btf_map(name = "vmp_snat_frags")]
pub static SNAT_FRAGS: LruHashMap<FragKey, NatEntry, { maps::SNAT_FRAGS.max_entries as usize }> =
    LruHashMap::new();

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

/// Is `key` (the VM's tuple) the reply of a live flow opened from
/// outside? Refreshes it when so.
#[inline(always)]
fn inbound_reply(cfg: &SnatConfig, key: &NatKey, now: u64, tcp_flags: u8) -> bool {
    let Some(flow) = INBOUND.get_ptr_mut(key) else {
        return false;
    };
    inbound_live(cfg, key.proto, flow, now, tcp_flags)
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

/// Records (or refreshes) the IPv4 flow of a frame routed in from outside
/// to a VM on a SNAT network with routed ingress, just before it is
/// delivered: the VM's replies must leave un-NATed. TCP, UDP and ICMP echo
/// requests; anything else is delivered unrecorded.
#[inline(always)]
pub fn track_inbound4(ctx: &TcContext) -> Result<(), u32> {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, src, dst, proto, frags) = (ip.vihl, ip.src_addr, ip.dst_addr, ip.proto, ip.frags);
    let ihl = usize::from(vihl & 0x0f) * 4;
    if !(Ipv4Hdr::LEN..=60).contains(&ihl) || u16::from_be_bytes(frags) & 0x3fff != 0 {
        return Ok(());
    }
    let l4_off = ETH_LEN + ihl;
    let Some((vm_port, remote_port, tcp_flags)) = inbound_ports(ctx, proto, l4_off)? else {
        return Ok(());
    };
    let key = NatKey::new(dst, src, vm_port, remote_port, proto);
    let now = crate::clock::flow_now();
    if let Some(flow) = INBOUND.get_ptr_mut(&key) {
        refresh_inbound(flow, now, tcp_flags);
        return Ok(());
    }
    // A full table evicts the least recently used flow (LRU).
    let _ = INBOUND.insert(&key, &new_inbound(now), u64::from(BPF_ANY));
    Ok(())
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

/// Translates the VM's frame in place to the node's SNAT address; the
/// caller routes it on (`route::forward4`) by the next hop returned (an
/// established flow's kept one, `next_hop`). On a network with routed
/// ingress, the reply of a flow opened from outside is left as it is
/// (routed un-NATed), unless its tuple is an outbound SNAT flow.
#[inline(always)]
pub fn egress4(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
    l4_off: usize,
) -> Result<NextHop, u32> {
    let Some(cfg) = SNAT_CONFIG.get(0) else {
        return Err(drop_reason::SNAT_NO_ADDRESS);
    };
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (src, dst, proto, id) = (ip.src_addr, ip.dst_addr, ip.proto, ip.id);
    let frags = u16::from_be_bytes(ip.frags);
    let now = crate::clock::flow_now();
    let frag = FragKey::new(src, dst, id, proto, FRAG_OUT);
    if frags & IP_OFFSET != 0 {
        return later_fragment_out(ctx, &frag, now);
    }
    // A first fragment is translated as a whole datagram would be, and
    // what was done recorded for the fragments after it.
    let first = frags & IP_MF != 0;
    let ingress = net.flags & NET_F_INGRESS != 0;
    let l4 = l4(ctx, proto, l4_off, true, ingress)?;
    let key = NatKey::new(src, dst, l4.sport, l4.dport, proto);
    if l4.echo_reply {
        // Only ever the answer to a ping from outside.
        if inbound_reply(cfg, &key, now, 0) {
            return unnated(&frag, first, now);
        }
        return Err(drop_reason::SNAT_UNSUPPORTED);
    }
    if cfg.addr4 == [0; 4] {
        if ingress && inbound_reply(cfg, &key, now, l4.tcp_flags) {
            return unnated(&frag, first, now);
        }
        return Err(drop_reason::SNAT_NO_ADDRESS);
    }

    // An existing flow keeps its port while its return entry is still ours.
    let mut nat_port = 0u16;
    let mut next = NextHop::LOOKUP;
    if let Some(out) = SNAT_OUT.get_ptr_mut(&key) {
        // SAFETY: `out` is from `get_ptr_mut` (bpf_map_lookup_elem) just above, valid
        // until the program returns; plain integer reads.
        let (p, seen) = unsafe { ((*out).port, (*out).last_seen) };
        if !refresh_due(seen, now, l4.tcp_flags) {
            nat_port = p;
        } else if let Some(back) =
            SNAT_IN.get_ptr_mut(&NatKey::reply(dst, cfg.addr4, l4.dport, p, proto))
        {
            // SAFETY: `back` is from `get_ptr_mut` just above, valid until the program
            // returns; plain integer reads.
            let mine = unsafe { (*back).addr == src && (*back).port == l4.sport };
            if mine {
                touch(out, now, l4.tcp_flags);
                touch(back, now, l4.tcp_flags);
                nat_port = p;
            }
        }
        if nat_port != 0 {
            // SAFETY: field addresses inside the entry above; no access.
            next =
                unsafe { next_hop::of_flow(&raw mut (*out).hop, &raw mut (*out).hop_checked, now) };
        }
    }
    if nat_port == 0 {
        // Not an outbound flow of ours: the reply of an inbound one?
        if ingress && inbound_reply(cfg, &key, now, l4.tcp_flags) {
            return unnated(&frag, first, now);
        }
        nat_port = allocate(ctx, cfg, &key, &l4, ifindex, port, net, now)?;
    }
    if first {
        remember_fragment(&frag, cfg.addr4, now);
    }

    // Rewrite: source address (IP header and pseudo header), then port.
    rewrite_addr(ctx, &l4, IP_SRC_OFF, src, cfg.addr4)?;
    rewrite_port(ctx, &l4, l4.sport, nat_port)?;
    Ok(next)
}

/// IPv4 fragment offset and more-fragments bits (host order).
const IP_OFFSET: u16 = 0x1fff;
const IP_MF: u16 = 0x2000;

/// The reply of an inbound flow leaves un-NATed; a first fragment's later
/// ones are to follow it.
#[inline(always)]
fn unnated(frag: &FragKey, first: bool, now: u64) -> Result<NextHop, u32> {
    if first {
        remember_fragment(frag, [0; 4], now);
    }
    Ok(NextHop::LOOKUP)
}

/// Records what a datagram from a VM became at its first fragment:
/// `addr` the source the later ones take (0: left as they are).
#[inline(always)]
fn remember_fragment(frag: &FragKey, addr: [u8; 4], now: u64) {
    let e = NatEntry {
        addr,
        ..NatEntry::default()
    };
    keep_fragment(frag, &e, now);
}

/// Records a first fragment's `entry` for its datagram's later fragments,
/// stamped `now` (`first_fragment` judges the age).
#[inline(always)]
fn keep_fragment(frag: &FragKey, entry: &NatEntry, now: u64) {
    let e = NatEntry {
        last_seen: now,
        ..*entry
    };
    // A full table evicts its least recently used datagram; a failure
    // leaves the later fragments unplaced (dropped and counted out, the
    // host's in).
    let _ = SNAT_FRAGS.insert(frag, &e, u64::from(BPF_ANY));
}

/// The recorded first fragment of a datagram, if recent enough.
#[inline(always)]
fn first_fragment(frag: &FragKey, now: u64) -> Option<NatEntry> {
    // SAFETY: a map lookup; the value is copied out at once.
    let e = unsafe { *SNAT_FRAGS.get(frag)? };
    (now.saturating_sub(e.last_seen) <= FRAG_TIMEOUT_NS).then_some(e)
}

/// A later fragment from a VM: it takes its first fragment's source
/// address. No transport header to fix (only the first fragment has
/// one); the IP header checksum is.
#[inline(always)]
fn later_fragment_out(ctx: &TcContext, frag: &FragKey, now: u64) -> Result<NextHop, u32> {
    let Some(first) = first_fragment(frag, now) else {
        return Err(drop_reason::SNAT_FRAGMENT);
    };
    if first.addr != [0; 4] {
        rewrite_ip_addr(ctx, IP_SRC_OFF, frag.src, first.addr)?;
    }
    Ok(NextHop::LOOKUP)
}

/// Replaces the IPv4 address at `off`, fixing only the IP header
/// checksum (a later fragment's transport checksum is in its first).
#[inline(always)]
fn rewrite_ip_addr(ctx: &TcContext, off: usize, old: [u8; 4], new: [u8; 4]) -> Result<(), u32> {
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = csum::replace_addr4(be16(ip.check), old, new).to_be_bytes();
    write_at(ctx, off, &new)
}

/// Replaces the IPv4 address at `off` (source or destination), fixing the
/// IP header checksum and, but for ICMP (no pseudo header), the
/// transport checksum.
#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    l4: &L4,
    off: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), u32> {
    let old_a = u64::from(u32::from_ne_bytes(old));
    let new_a = u64::from(u32::from_ne_bytes(new));
    if l4.proto != IPPROTO_ICMP {
        let mut flags = u64::from(BPF_F_PSEUDO_HDR) | 4;
        if l4.proto == IPPROTO_UDP {
            flags |= u64::from(BPF_F_MARK_MANGLED_0);
        }
        ctx.l4_csum_replace(l4.csum_off, old_a, new_a, flags)
            .map_err(|_| drop_reason::HELPER_FAILED)?;
    }
    // Taken after the helper (it may move packet data). The IP header
    // checksum is patched here, not by `bpf_l3_csum_replace`: it is never
    // offloaded, and one helper call less is measurable.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = csum::replace_addr4(be16(ip.check), old, new).to_be_bytes();
    write_at(ctx, off, &new)
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

/// Picks a free port for a new flow (within the VM's quota) and records
/// both directions.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn allocate(
    ctx: &TcContext,
    cfg: &SnatConfig,
    key: &NatKey,
    l4: &L4,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
    now: u64,
) -> Result<u16, u32> {
    let vm = u32::from_ne_bytes(key.src);
    let held = SNAT_QUOTA.get_ptr_mut(&vm);
    if let Some(n) = held {
        // SAFETY: `n` is from `get_ptr_mut` just above, valid until the program
        // returns; a plain integer read.
        if unsafe { *n } >= cfg.quota {
            return Err(drop_reason::SNAT_QUOTA);
        }
    }
    let min = u32::from(cfg.port_min);
    let max = u32::from(cfg.port_max);
    if max < min {
        return Err(drop_reason::SNAT_PORTS_EXHAUSTED);
    }
    let range = max - min + 1;
    // SAFETY: a helper call without arguments; it touches no memory of ours.
    let start = unsafe { bpf_get_prandom_u32() } % range;
    let vm_mac = hdr::<EthHdr>(ctx, 0)?.src_addr;
    let back = NatEntry {
        addr: key.src,
        port: key.sport,
        state: NAT_ST_OPEN,
        _pad: 0,
        hop: L2Hop {
            ifindex,
            dst_mac: vm_mac,
            src_mac: net.gw_mac,
        },
        port_id: port.port_id,
        hop_checked: 0,
        last_seen: now,
    };
    let mut i = 0u32;
    let mut chosen = 0u16;
    while i < PROBES {
        let cand = (min + (start + i) % range) as u16;
        i += 1;
        let rkey = NatKey::reply(key.dst, cfg.addr4, key.dport, cand, key.proto);
        // SAFETY: a map lookup; the value stays valid for this program run.
        let flags = match unsafe { SNAT_IN.get(&rkey) } {
            None => u64::from(BPF_NOEXIST),
            Some(e) if expired(cfg, e, key.proto, now) => u64::from(BPF_ANY),
            Some(_) => continue,
        };
        if SNAT_IN.insert(&rkey, &back, flags).is_ok() {
            chosen = cand;
            break;
        }
    }
    if chosen == 0 {
        return Err(drop_reason::SNAT_PORTS_EXHAUSTED);
    }
    // No next hop kept yet: the flow's next frame looks it up and keeps it.
    let out = NatEntry {
        addr: cfg.addr4,
        port: chosen,
        state: NAT_ST_OPEN,
        _pad: 0,
        hop: L2Hop::default(),
        port_id: port.port_id,
        hop_checked: 0,
        last_seen: now,
    };
    if SNAT_OUT.insert(key, &out, u64::from(BPF_ANY)).is_err() {
        let rkey = NatKey::reply(key.dst, cfg.addr4, key.dport, chosen, key.proto);
        let _ = SNAT_IN.remove(&rkey);
        return Err(drop_reason::SNAT_TABLE_FULL);
    }
    match held {
        // Not atomic (the BPF target has no AtomicU32 here): a lost
        // increment only delays the quota until the agent's next recount.
        // SAFETY: `n` is from `get_ptr_mut` above, valid until the program returns.
        Some(n) => unsafe { *n += 1 },
        None => {
            let _ = SNAT_QUOTA.insert(&vm, &1, u64::from(BPF_NOEXIST));
        }
    }
    let _ = l4;
    Ok(chosen)
}

/// Reverse translation of return traffic on the uplink: `Ok(None)` when
/// the frame is not SNAT return traffic (it then goes to the host stack).
#[inline(always)]
#[allow(
    clippy::manual_range_contains,
    reason = "two comparisons give the verifier both bounds of `ihl`, which the \
              range check folds into one unsigned subtraction"
)]
pub fn ingress4(ctx: &TcContext) -> Result<Option<i32>, u32> {
    let Some(cfg) = SNAT_CONFIG.get(0) else {
        return Ok(None);
    };
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, src, dst, proto, id, ttl) =
        (ip.vihl, ip.src_addr, ip.dst_addr, ip.proto, ip.id, ip.ttl);
    let frags = u16::from_be_bytes(ip.frags);
    if dst != cfg.addr4 || cfg.addr4 == [0; 4] {
        return Ok(None);
    }
    let frag = FragKey::new(src, dst, id, proto, FRAG_IN);
    if frags & IP_OFFSET != 0 {
        return later_fragment_in(ctx, &frag, ttl);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    if ihl < Ipv4Hdr::LEN || ihl > 60 {
        return Ok(None);
    }
    let l4_off = ETH_LEN + ihl;
    if proto == IPPROTO_ICMP
        && let Some(action) = crate::snat_icmp::ingress4(ctx, cfg, l4_off)?
    {
        return Ok(Some(action));
    }
    let Ok(l4) = l4(ctx, proto, l4_off, false, false) else {
        return Ok(None);
    };
    let rkey = NatKey::new(src, dst, l4.sport, l4.dport, proto);
    let Some(back) = SNAT_IN.get_ptr_mut(&rkey) else {
        return Ok(None);
    };
    let now = crate::clock::flow_now();
    // SAFETY: `back` is from `get_ptr_mut` just above, valid until the program
    // returns; `NatEntry` is `Copy` plain integers.
    let e = unsafe { *back };
    if expired(cfg, &e, proto, now) {
        return Ok(None);
    }
    if ttl <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    if frags & IP_MF != 0 {
        // A first fragment: its later ones go where it goes.
        keep_fragment(&frag, &e, now);
    }
    touch(back, now, l4.tcp_flags);
    if refresh_due(e.last_seen, now, l4.tcp_flags) {
        let dport = if proto == IPPROTO_ICMP {
            e.port
        } else {
            l4.sport
        };
        let key = NatKey::new(e.addr, src, e.port, dport, proto);
        if let Some(out) = SNAT_OUT.get_ptr_mut(&key) {
            touch(out, now, l4.tcp_flags);
        }
    }

    // Destination back to the VM's address and port; TTL down by one.
    rewrite_addr(ctx, &l4, IP_DST_OFF, dst, e.addr)?;
    rewrite_port(ctx, &l4, l4.dport, e.port)?;

    // Taken again: the rewrite helpers may have moved packet data.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = csum::dec_ttl4(ip, be16(ip.check)).to_be_bytes();
    to_vm(ctx, &e)
}

/// A later fragment to the SNAT address: to the VM its first fragment
/// went to, destination address back to the VM's, TTL down by one.
/// Without a recorded first fragment it is no SNAT flow's (or came first
/// out of order): the host stack gets it, as any frame to the node.
#[inline(always)]
fn later_fragment_in(ctx: &TcContext, frag: &FragKey, ttl: u8) -> Result<Option<i32>, u32> {
    let Some(e) = first_fragment(frag, crate::clock::flow_now()) else {
        return Ok(None);
    };
    if ttl <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    rewrite_ip_addr(ctx, IP_DST_OFF, frag.dst, e.addr)?;
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = csum::dec_ttl4(ip, be16(ip.check)).to_be_bytes();
    to_vm(ctx, &e)
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
