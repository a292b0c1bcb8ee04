//! SNAT for IPv6, as `ipv4` does it for IPv4: TCP, UDP and ICMPv6 echo
//! from a VM on a network with `egress: SNAT` leave with the node's IPv6
//! SNAT address (`SnatConfig::addr6`) and a port (or echo identifier) from
//! the same reserved range; replies on the uplink are translated back.
//! The flow tables, quota and inbound-flow record are the IPv4 ones'
//! twins, keyed by `NatKey6`. The transport header is found past up to
//! four extension headers (`spoof::walk6`, the walker the guards and
//! NetworkPolicy use): hop-by-hop, routing and destination options are
//! carried through untouched (none is covered by the transport checksum),
//! a first fragment is translated by its ports. Its later fragments, which
//! carry none, follow it as IPv4's do (`frag`, `vmp_snat6_frags`, keyed
//! by source, destination and fragment identification, as IPv6
//! reassembly keys them, and the direction). Out: they take the source
//! the first took (the SNAT address, or the VM's own for the reply of an
//! inbound flow, `FRAG_OUT`); one whose first was not seen is dropped
//! (`snat_fragment`). Back: to the VM the first went to (`FRAG_IN`); one
//! whose first was not seen goes to the host stack (the SNAT address is
//! the node's own).
//!
//! `vm_egress` translates a frame whose transport header follows the
//! fixed header (`egress6`); one with extension headers, every fragment
//! among them, goes by tail call to a program of its own, `vm_snat6_ext`,
//! which walks the chain, translates (recording a first fragment's
//! outcome) and routes on as `vm_egress` does. Inline, the walk's paths
//! through the translation and the fragments' records took `vm_egress`
//! over the verifier's million instructions.
//!
//! IPv6 has no header checksum; the transport checksum (ICMPv6's too)
//! covers the pseudo header, so an address change is four 32-bit
//! `bpf_l4_csum_replace` steps with `BPF_F_PSEUDO_HDR`.

use core::mem::{MaybeUninit, offset_of};

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST},
    programs::TcContext,
};
use network_types::ip::Ipv6Hdr;
use vmpath_common::{
    FRAG_IN, FRAG_OUT, InboundFlow, L2Hop, NAT_ST_OPEN, NET_F_INGRESS, NatEntry6, NatKey6,
    NetworkInfo, PortInfo, SnatConfig, drop_reason, skb_cb, tail_call,
};

use crate::{
    frag::{self, Noted6, Piece},
    next_hop::NextHop,
    parse::{ETH_LEN, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, addr16_eq, hdr, hdr_mut, words16},
    spoof::{FragNote, IPPROTO_FRAGMENT, upper_layer6, walk6},
    verdict::PROGS,
};

use super::{
    flow::{
        Family, L4, allocate, established, expired, inbound_ports, inbound_reply, key6, l4,
        new_inbound, refresh_due, refresh_inbound, rewrite_port, to_port, touch,
    },
    icmp,
    maps::{INBOUND6, SNAT_CONFIG, SNAT6_FRAGS, SNAT6_IN, SNAT6_OUT, SNAT6_QUOTA},
};

const IP6_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv6Hdr, src_addr);
const IP6_DST_OFF: usize = ETH_LEN + offset_of!(Ipv6Hdr, dst_addr);
const NO_ADDR: [u8; 16] = [0; 16];

/// Records (or refreshes) the IPv6 flow of a frame routed in from outside
/// to a VM on a SNAT network with routed ingress (`ipv4::track_inbound4`'s
/// twin).
#[inline(always)]
pub fn track_inbound6(ctx: &TcContext) -> Result<(), u32> {
    // A chain too long to walk is delivered untracked: its reply is judged
    // (and dropped) on the way out.
    let Ok((proto, l4_off)) = upper_layer6(ctx, hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr) else {
        return Ok(());
    };
    let Some((vm_port, remote_port, tcp_flags)) = inbound_ports(ctx, proto, l4_off)? else {
        return Ok(());
    };
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut slot = MaybeUninit::uninit();
    // Straight from the header: addresses held in locals are spilled byte
    // by byte (alignment 1), beyond the stack the programs have.
    let key = key6(
        &mut slot,
        &ip.dst_addr,
        &ip.src_addr,
        vm_port,
        remote_port,
        proto,
    );
    let now = crate::clock::flow_now();
    if let Some(flow) = INBOUND6.get_ptr_mut(key) {
        refresh_inbound(flow, now, tcp_flags);
        return Ok(());
    }
    // A full table evicts the least recently used flow (LRU).
    let _ = INBOUND6.insert(key, &new_inbound(now), u64::from(BPF_ANY));
    Ok(())
}

/// Translates the VM's IPv6 frame in place to the node's IPv6 SNAT
/// address; the caller routes it on. As `ipv4::egress4`: on a network with
/// routed ingress the reply of a flow opened from outside leaves as it is.
/// Only a frame whose transport header follows the fixed header: one with
/// extension headers (a fragment's among them) goes on to `vm_snat6_ext`
/// (a tail call; see the module's doc), which translates and routes it
/// itself.
#[inline(always)]
pub fn egress6(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
) -> Result<NextHop, u32> {
    let proto = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.next_hdr;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMPV6 {
        // SAFETY: `ctx` is this program's own context; on success the tail
        // call does not return, otherwise execution falls through to the
        // error below.
        unsafe { PROGS.tail_call(ctx, tail_call::VM_SNAT6_EXT) };
        // Only reached when the slot is empty (agent still starting).
        return Err(drop_reason::HELPER_FAILED);
    }
    translate6(ctx, ifindex, port, net, proto, ETH_LEN + 40, false)
}

/// Where `walk6` met the fragment header of a first fragment with more to
/// come (0: none; an atomic fragment, offset 0 and none to come, is a
/// whole datagram), as a value (see `walk6`).
pub struct FirstAt(pub usize);

impl FragNote for FirstAt {
    #[inline(always)]
    fn first_fragment(&mut self, _: &TcContext, off: usize, more: u8) {
        self.0 = off * usize::from(more);
    }
}

/// Bound of the offsets `through_cb` carries: four extension headers of
/// at most 2048 bytes each end before 8300; the verifier takes a packet
/// offset under 0x3fff plus a header's size.
const OFF_MAX: usize = 0x3fff;

/// Where the first fragment's header is (`first_at`, 0: none) for
/// `remember6`, and where the transport header is, put in `skb->cb[4]`;
/// the transport header's offset read back. From the context it is one
/// unknown value whatever way the walk went: as locals the two would keep
/// each of the walk's paths apart through the whole translation, over the
/// verifier's budget.
#[inline(always)]
pub fn through_cb(ctx: &TcContext, first_at: usize, l4_off: usize) -> Result<usize, u32> {
    if first_at > OFF_MAX || l4_off > OFF_MAX {
        return Err(drop_reason::MALFORMED);
    }
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame (cb[4]
    // is `overlay::mark_sender`'s only for frames from the vxlan device,
    // never one from a VM port). The volatile read keeps the compiler from
    // handing back the value stored.
    let v = unsafe {
        let cb = &mut (*ctx.skb.skb).cb;
        cb[skb_cb::SCRATCH] = ((first_at as u32) << 16) | l4_off as u32;
        core::ptr::read_volatile(&cb[skb_cb::SCRATCH])
    };
    Ok((v & OFF_MAX as u32) as usize)
}

/// The translation of a frame whose transport header is at `l4_off`;
/// with `frags` (`vm_snat6_ext`) what became of a first fragment is
/// recorded for its later ones (`remember6`): the SNAT address, or none
/// for the reply of an inbound flow, which leaves un-NATed.
#[inline(always)]
pub fn translate6(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
    proto: u8,
    l4_off: usize,
    frags: bool,
) -> Result<NextHop, u32> {
    let Some(cfg) = SNAT_CONFIG.get(0) else {
        return Err(drop_reason::SNAT_NO_ADDRESS);
    };
    let ingress = net.flags & NET_F_INGRESS != 0;
    let l4 = l4(ctx, proto, l4_off, true, ingress)?;
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut key_slot = MaybeUninit::uninit();
    // The addresses straight from the header into the key, and used from
    // there (see `track_inbound6`).
    let key = key6(
        &mut key_slot,
        &ip.src_addr,
        &ip.dst_addr,
        l4.sport,
        l4.dport,
        proto,
    );
    let now = crate::clock::flow_now();
    if l4.echo_reply {
        // Only ever the answer to a ping from outside.
        if inbound_reply::<V6>(cfg, key, now, 0) {
            return unnated6(ctx, key, frags, now);
        }
        return Err(drop_reason::SNAT_UNSUPPORTED);
    }
    if addr16_eq(&cfg.addr6, &NO_ADDR) {
        if ingress && inbound_reply::<V6>(cfg, key, now, l4.tcp_flags) {
            return unnated6(ctx, key, frags, now);
        }
        return Err(drop_reason::SNAT_NO_ADDRESS);
    }

    // An existing flow keeps its port while its return entry is still ours.
    let (mut nat_port, next) = established::<V6>(cfg, key, l4.tcp_flags, now);
    if nat_port == 0 {
        if ingress && inbound_reply::<V6>(cfg, key, now, l4.tcp_flags) {
            return unnated6(ctx, key, frags, now);
        }
        nat_port = allocate::<V6>(ctx, cfg, key, ifindex, port, net, now)?;
    }
    if frags {
        remember6(ctx, key, &cfg.addr6, now);
    }
    rewrite_addr6(ctx, &l4, IP6_SRC_OFF, &key.src, &cfg.addr6)?;
    rewrite_port(ctx, &l4, l4.sport, nat_port)?;
    Ok(next)
}

/// The reply of an inbound flow leaves un-NATed; a first fragment's later
/// ones are to follow it (`ipv4::unnated`'s twin).
#[inline(always)]
fn unnated6(ctx: &TcContext, key: &NatKey6, frags: bool, now: u64) -> Result<NextHop, u32> {
    if frags {
        remember6(ctx, key, &NO_ADDR, now);
    }
    Ok(NextHop::LOOKUP)
}

/// Records what a datagram from a VM became at its first fragment (where
/// `through_cb` left its header; none: not a first fragment, nothing to
/// record), keyed by the addresses as the VM sent them (`key`, before the
/// rewrite) and the fragment identification, `FRAG_OUT`: `addr` the
/// source its later fragments take (`NO_ADDR`: left as they are), stamped
/// `now`.
#[inline(always)]
fn remember6(ctx: &TcContext, key: &NatKey6, addr: &[u8; 16], now: u64) {
    // SAFETY: the skb pointer is the program's own context, valid for
    // this run; cb[4] as `through_cb` left it, cleared after.
    let at = unsafe {
        let cb = &mut (*ctx.skb.skb).cb;
        let at = cb[skb_cb::SCRATCH] >> 16;
        cb[skb_cb::SCRATCH] = 0;
        at
    };
    if at == 0 {
        return;
    }
    let Ok(id) = frag::later_id6(ctx, at as usize) else {
        return;
    };
    let mut fslot = MaybeUninit::uninit();
    let fkey = frag::key6(&mut fslot, &key.src, &key.dst, id, FRAG_OUT);
    let e = NatEntry6 {
        addr: *addr,
        last_seen: now,
        ..NatEntry6::default()
    };
    // A failure leaves the later fragments unplaced: dropped and counted
    // (`snat_fragment`).
    frag::keep(&SNAT6_FRAGS, fkey, &e);
}

/// A later fragment from a VM: it takes its first fragment's source
/// address (none recorded: the reply of an inbound flow, left as it is).
/// No transport header to fix (only the first fragment has one) and no
/// IPv6 header checksum. Without a recorded first fragment (it came first,
/// out of order, or over `FRAG_TIMEOUT_NS` after) it carries nothing to
/// place it by: `snat_fragment`.
#[inline(always)]
pub fn later_fragment_out6(ctx: &TcContext, id: [u8; 4]) -> Result<NextHop, u32> {
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut slot = MaybeUninit::uninit();
    let fkey = frag::key6(&mut slot, &ip.src_addr, &ip.dst_addr, id, FRAG_OUT);
    let Some(e) = frag::first(&SNAT6_FRAGS, fkey, crate::clock::flow_now()) else {
        return Err(drop_reason::SNAT_FRAGMENT);
    };
    if !addr16_eq(&e.addr, &NO_ADDR) {
        crate::parse::write_at(ctx, IP6_SRC_OFF, &e.addr)?;
    }
    Ok(NextHop::LOOKUP)
}

/// A later fragment to the SNAT address: to the VM its first fragment
/// went to, destination address back to the VM's, hop limit down by one.
/// Without a recorded first fragment it is no SNAT flow's (or came first
/// out of order): the host stack gets it, as any frame to the node.
#[inline(always)]
fn later_fragment_in6(ctx: &TcContext, id: [u8; 4], hop: u8) -> Result<Option<i32>, u32> {
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut slot = MaybeUninit::uninit();
    let fkey = frag::key6(&mut slot, &ip.src_addr, &ip.dst_addr, id, FRAG_IN);
    let Some(e) = frag::first(&SNAT6_FRAGS, fkey, crate::clock::flow_now()) else {
        return Ok(None);
    };
    if hop <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    crate::parse::write_at(ctx, IP6_DST_OFF, &e.addr)?;
    hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?.hop_limit -= 1;
    to_port(ctx, &e.hop, e.port_id)
}

/// Replaces the IPv6 address at `off`, fixing the transport checksum
/// (pseudo header) one 32-bit word at a time.
#[inline(always)]
fn rewrite_addr6(
    ctx: &TcContext,
    l4: &L4,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
) -> Result<(), u32> {
    let (o, n) = (words16(old), words16(new));
    let mut flags = u64::from(BPF_F_PSEUDO_HDR) | 4;
    if l4.proto == IPPROTO_UDP {
        flags |= u64::from(BPF_F_MARK_MANGLED_0);
    }
    let mut i = 0;
    while i < 4 {
        ctx.l4_csum_replace(l4.csum_off, u64::from(o[i]), u64::from(n[i]), flags)
            .map_err(|_| drop_reason::HELPER_FAILED)?;
        i += 1;
    }
    crate::parse::write_at(ctx, off, new)
}

/// IPv6's side of what the two families' SNAT shares.
pub struct V6;

impl Family for V6 {
    type Key = NatKey6;
    type Entry = NatEntry6;

    #[inline(always)]
    fn proto(key: &NatKey6) -> u8 {
        key.proto
    }

    #[inline(always)]
    fn is_flow_of(back: &NatEntry6, key: &NatKey6) -> bool {
        addr16_eq(&back.addr, &key.src) && back.port == key.sport
    }

    /// `NatKey6::reply` (`reply6`'s), as a struct literal: `reply6` into a
    /// slot, then copied out, takes `vm_egress` past the 512-byte stack.
    #[inline(always)]
    fn reply(key: &NatKey6, cfg: &SnatConfig, port: u16) -> NatKey6 {
        let sport = if key.proto == IPPROTO_ICMPV6 {
            port
        } else {
            key.dport
        };
        NatKey6 {
            src: key.dst,
            dst: cfg.addr6,
            sport,
            dport: port,
            proto: key.proto,
            _pad: [0; 3],
        }
    }

    #[inline(always)]
    fn back_entry(
        key: &NatKey6,
        ifindex: u32,
        vm_mac: [u8; 6],
        gw_mac: [u8; 6],
        port_id: u32,
        now: u64,
    ) -> NatEntry6 {
        NatEntry6 {
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
            _pad2: 0,
            last_seen: now,
        }
    }

    #[inline(always)]
    fn out_entry(back: &NatEntry6, cfg: &SnatConfig, port: u16) -> NatEntry6 {
        NatEntry6 {
            addr: cfg.addr6,
            port,
            hop: L2Hop::default(),
            ..*back
        }
    }

    #[inline(always)]
    fn out(key: &NatKey6) -> Option<*mut NatEntry6> {
        SNAT6_OUT.get_ptr_mut(key)
    }

    #[inline(always)]
    fn insert_out(key: &NatKey6, e: &NatEntry6) -> bool {
        SNAT6_OUT.insert(key, e, u64::from(BPF_ANY)).is_ok()
    }

    #[inline(always)]
    fn back(rkey: &NatKey6) -> Option<*mut NatEntry6> {
        SNAT6_IN.get_ptr_mut(rkey)
    }

    #[inline(always)]
    unsafe fn back_ref(rkey: &NatKey6) -> Option<&NatEntry6> {
        // SAFETY: the caller's (see `Family::back_ref`).
        unsafe { SNAT6_IN.get(rkey) }
    }

    #[inline(always)]
    fn insert_back(rkey: &NatKey6, e: &NatEntry6, flags: u64) -> bool {
        SNAT6_IN.insert(rkey, e, flags).is_ok()
    }

    #[inline(always)]
    fn remove_back(rkey: &NatKey6) {
        let _ = SNAT6_IN.remove(rkey);
    }

    #[inline(always)]
    fn inbound(key: &NatKey6) -> Option<*mut InboundFlow> {
        INBOUND6.get_ptr_mut(key)
    }

    /// The quota's key: the VM's address.
    #[inline(always)]
    fn held(key: &NatKey6) -> Option<*mut u32> {
        SNAT6_QUOTA.get_ptr_mut(&key.src)
    }

    #[inline(always)]
    fn count_first(key: &NatKey6) {
        let _ = SNAT6_QUOTA.insert(&key.src, &1, u64::from(BPF_NOEXIST));
    }
}

/// Reverse translation of IPv6 return traffic on the uplink: `Ok(None)`
/// when the frame is not SNAT return traffic (it then goes to the host
/// stack).
#[inline(always)]
pub fn ingress6(ctx: &TcContext) -> Result<Option<i32>, u32> {
    let Some(cfg) = SNAT_CONFIG.get(0) else {
        return Ok(None);
    };
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let (next_hdr, hop) = (ip.next_hdr, ip.hop_limit);
    if addr16_eq(&cfg.addr6, &NO_ADDR) || !addr16_eq(&ip.dst_addr, &cfg.addr6) {
        return Ok(None);
    }
    // A chain too long to walk: not ours to judge (the address is the
    // node's own), the host stack's.
    let mut noted = Noted6::new();
    let Ok((proto, l4_off)) = walk6(ctx, next_hdr, &mut noted) else {
        return Ok(None);
    };
    if proto == IPPROTO_FRAGMENT {
        return later_fragment_in6(ctx, frag::later_id6(ctx, l4_off)?, hop);
    }
    if proto == IPPROTO_ICMPV6
        && let Some(action) = icmp::ingress6(ctx, cfg, l4_off)?
    {
        return Ok(Some(action));
    }
    let Ok(l4) = l4(ctx, proto, l4_off, false, false) else {
        return Ok(None);
    };
    // Taken again after the ICMP error path's reads; the addresses go
    // straight into the key (see `track_inbound6`).
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let mut slot = MaybeUninit::uninit();
    let rkey = key6(
        &mut slot,
        &ip.src_addr,
        &ip.dst_addr,
        l4.sport,
        l4.dport,
        proto,
    );
    let Some(back) = SNAT6_IN.get_ptr_mut(rkey) else {
        return Ok(None);
    };
    let now = crate::clock::flow_now();
    // SAFETY: `back` is from `get_ptr_mut` just above, valid until the
    // program returns; the reference lives for this call only.
    if expired(cfg, unsafe { &*back }, proto, now) {
        return Ok(None);
    }
    if hop <= 1 {
        return Err(drop_reason::ROUTE_TTL_EXCEEDED);
    }
    // SAFETY: as above; a plain integer read.
    let due = refresh_due(unsafe { (*back).last_seen }, now, l4.tcp_flags);
    touch(back, now, l4.tcp_flags);
    if noted.piece == Piece::First {
        // Its later fragments go where it goes: the flow's entry as it is
        // (just refreshed: its time is the first fragment's, within
        // `TOUCH_GRANULARITY_NS`), straight from the map.
        let mut fslot = MaybeUninit::uninit();
        let fkey = frag::key6(&mut fslot, &rkey.src, &rkey.dst, noted.id, FRAG_IN);
        // SAFETY: `back` as above; the helper reads the value in place.
        frag::keep(&SNAT6_FRAGS, fkey, unsafe { &*back });
    }
    // SAFETY: as above; no store through `back` follows (read in place:
    // a copy would cost 56 bytes of stack).
    let e = unsafe { &*back };
    if due {
        let dport = if proto == IPPROTO_ICMPV6 {
            e.port
        } else {
            l4.sport
        };
        let mut out_slot = MaybeUninit::uninit();
        let key = key6(&mut out_slot, &e.addr, &rkey.src, e.port, dport, proto);
        if let Some(out) = SNAT6_OUT.get_ptr_mut(key) {
            touch(out, now, l4.tcp_flags);
        }
    }

    // Destination back to the VM's address and port; hop limit down by one.
    // The destination was the SNAT address.
    rewrite_addr6(ctx, &l4, IP6_DST_OFF, &cfg.addr6, &e.addr)?;
    rewrite_port(ctx, &l4, l4.dport, e.port)?;
    hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?.hop_limit -= 1;
    to_port(ctx, &e.hop, e.port_id)
}
