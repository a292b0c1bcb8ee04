//! IPv4 SNAT: a VM's frame translated on its way out (`egress4`), the
//! reply translated back on the uplink (`ingress4`), and their fragments.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    programs::TcContext,
};
use network_types::ip::Ipv4Hdr;
use vmpath_common::{
    FRAG_IN, FRAG_OUT, FRAG_TIMEOUT_NS, FragKey, InboundFlow, L2Hop, NAT_ST_OPEN, NET_F_INGRESS,
    NatEntry, NatKey, NetworkInfo, PortInfo, SnatConfig, drop_reason,
};

use crate::{
    csum,
    next_hop::NextHop,
    parse::{ETH_LEN, IPPROTO_ICMP, IPPROTO_UDP, be16, hdr, hdr_mut, write_at},
};

use super::{
    flow::{
        Family, L4, allocate, established, expired, inbound_ports, inbound_reply, l4, new_inbound,
        refresh_due, refresh_inbound, rewrite_port, to_vm, touch,
    },
    icmp,
    maps::{INBOUND, SNAT_CONFIG, SNAT_FRAGS, SNAT_IN, SNAT_OUT, SNAT_QUOTA},
};

const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);

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
        if inbound_reply::<V4>(cfg, &key, now, 0) {
            return unnated(&frag, first, now);
        }
        return Err(drop_reason::SNAT_UNSUPPORTED);
    }
    if cfg.addr4 == [0; 4] {
        if ingress && inbound_reply::<V4>(cfg, &key, now, l4.tcp_flags) {
            return unnated(&frag, first, now);
        }
        return Err(drop_reason::SNAT_NO_ADDRESS);
    }

    // An existing flow keeps its port while its return entry is still ours.
    let (mut nat_port, next) = established::<V4>(cfg, &key, l4.tcp_flags, now);
    if nat_port == 0 {
        // Not an outbound flow of ours: the reply of an inbound one?
        if ingress && inbound_reply::<V4>(cfg, &key, now, l4.tcp_flags) {
            return unnated(&frag, first, now);
        }
        nat_port = allocate::<V4>(ctx, cfg, &key, ifindex, port, net, now)?;
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

/// IPv4's side of what the two families' SNAT shares.
pub struct V4;

impl Family for V4 {
    type Key = NatKey;
    type Entry = NatEntry;

    #[inline(always)]
    fn proto(key: &NatKey) -> u8 {
        key.proto
    }

    #[inline(always)]
    fn is_flow_of(back: &NatEntry, key: &NatKey) -> bool {
        back.addr == key.src && back.port == key.sport
    }

    #[inline(always)]
    fn reply(key: &NatKey, cfg: &SnatConfig, port: u16) -> NatKey {
        NatKey::reply(key.dst, cfg.addr4, key.dport, port, key.proto)
    }

    #[inline(always)]
    fn back_entry(
        key: &NatKey,
        ifindex: u32,
        vm_mac: [u8; 6],
        gw_mac: [u8; 6],
        port_id: u32,
        now: u64,
    ) -> NatEntry {
        NatEntry {
            addr: key.src,
            port: key.sport,
            state: NAT_ST_OPEN,
            _pad: 0,
            hop: L2Hop {
                ifindex,
                dst_mac: vm_mac,
                src_mac: gw_mac,
            },
            port_id,
            hop_checked: 0,
            last_seen: now,
        }
    }

    #[inline(always)]
    fn out_entry(back: &NatEntry, cfg: &SnatConfig, port: u16) -> NatEntry {
        NatEntry {
            addr: cfg.addr4,
            port,
            state: NAT_ST_OPEN,
            _pad: 0,
            hop: L2Hop::default(),
            port_id: back.port_id,
            hop_checked: 0,
            last_seen: back.last_seen,
        }
    }

    #[inline(always)]
    fn out(key: &NatKey) -> Option<*mut NatEntry> {
        SNAT_OUT.get_ptr_mut(key)
    }

    #[inline(always)]
    fn insert_out(key: &NatKey, e: &NatEntry) -> bool {
        SNAT_OUT.insert(key, e, u64::from(BPF_ANY)).is_ok()
    }

    #[inline(always)]
    fn back(rkey: &NatKey) -> Option<*mut NatEntry> {
        SNAT_IN.get_ptr_mut(rkey)
    }

    #[inline(always)]
    unsafe fn back_ref(rkey: &NatKey) -> Option<&NatEntry> {
        // SAFETY: the caller's (see `Family::back_ref`).
        unsafe { SNAT_IN.get(rkey) }
    }

    #[inline(always)]
    fn insert_back(rkey: &NatKey, e: &NatEntry, flags: u64) -> bool {
        SNAT_IN.insert(rkey, e, flags).is_ok()
    }

    #[inline(always)]
    fn remove_back(rkey: &NatKey) {
        let _ = SNAT_IN.remove(rkey);
    }

    #[inline(always)]
    fn inbound(key: &NatKey) -> Option<*mut InboundFlow> {
        INBOUND.get_ptr_mut(key)
    }

    /// The quota's key: the VM's address as a native u32.
    #[inline(always)]
    fn held(key: &NatKey) -> Option<*mut u32> {
        SNAT_QUOTA.get_ptr_mut(&u32::from_ne_bytes(key.src))
    }

    #[inline(always)]
    fn count_first(key: &NatKey) {
        let _ = SNAT_QUOTA.insert(&u32::from_ne_bytes(key.src), &1, u64::from(BPF_NOEXIST));
    }
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
        && let Some(action) = icmp::ingress4(ctx, cfg, l4_off)?
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
