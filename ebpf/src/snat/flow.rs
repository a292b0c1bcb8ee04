//! What a SNAT flow of either family is and how it lives: the transport
//! fields SNAT reads, the entries' timeouts and refreshes, the inbound
//! flows' records, the port rewrite and the delivery to the VM.

use core::mem::{MaybeUninit, offset_of};

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_NOEXIST},
    helpers::generated::bpf_get_prandom_u32,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use vmpath_common::{
    InboundFlow, L2Hop, NAT_ST_CLOSING, NAT_ST_OPEN, NatEntry, NatEntry6, NatKey6, NetworkInfo,
    PortInfo, SnatConfig, drop_reason,
};

use crate::{
    fwd::deliver_local,
    next_hop::{self, NextHop},
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

/// A flow entry of either family (`NatEntry`, `NatEntry6`: the same fields
/// but the address's width), for the code both share; each function
/// generic over it is monomorphised per family, as the family's own copy
/// was.
pub trait FlowEntry: Copy {
    fn port(&self) -> u16;
    fn state(&self) -> u8;
    fn last_seen(&self) -> u64;
    /// Where the entry's refresh stores go: (`last_seen`, `state`).
    ///
    /// # Safety
    /// `e` points to an entry valid for the call (a map value from
    /// `get_ptr_mut`); only field addresses are taken, nothing is read.
    unsafe fn refreshed(e: *mut Self) -> (*mut u64, *mut u8);
    /// Where a kept next hop lives in the entry: (`hop`, `hop_checked`).
    ///
    /// # Safety
    /// As `refreshed`.
    unsafe fn kept_hop(e: *mut Self) -> (*mut L2Hop, *mut u32);
}

/// The two entries' `FlowEntry`, field for field.
macro_rules! flow_entry {
    ($($entry:ty),*) => {$(
        impl FlowEntry for $entry {
            #[inline(always)]
            fn port(&self) -> u16 {
                self.port
            }
            #[inline(always)]
            fn state(&self) -> u8 {
                self.state
            }
            #[inline(always)]
            fn last_seen(&self) -> u64 {
                self.last_seen
            }
            #[inline(always)]
            unsafe fn refreshed(e: *mut Self) -> (*mut u64, *mut u8) {
                // SAFETY: the caller's: `e` is valid; field addresses only.
                unsafe { (&raw mut (*e).last_seen, &raw mut (*e).state) }
            }
            #[inline(always)]
            unsafe fn kept_hop(e: *mut Self) -> (*mut L2Hop, *mut u32) {
                // SAFETY: as in `refreshed`.
                unsafe { (&raw mut (*e).hop, &raw mut (*e).hop_checked) }
            }
        }
    )*};
}
flow_entry!(NatEntry, NatEntry6);

/// One address family's side of what the two SNAT paths share (`ipv4::V4`,
/// `ipv6::V6`): its flow key and entry and its tables. `established` and
/// `allocate` are generic over it, monomorphised per family.
pub trait Family {
    /// `NatKey`, `NatKey6`.
    type Key;
    /// `NatEntry`, `NatEntry6`.
    type Entry: FlowEntry;
    fn proto(key: &Self::Key) -> u8;
    /// Is the return entry `back` still the flow `key`'s (its VM's address
    /// and port)?
    fn is_flow_of(back: &Self::Entry, key: &Self::Key) -> bool;
    /// The key of the return entry of flow `key` translated to `port` (the
    /// reply's tuple as it arrives on the uplink). By value: a slot the
    /// caller keeps across `allocate`'s probes costs IPv4's `vm_egress`
    /// 9% more verified instructions.
    fn reply(key: &Self::Key, cfg: &SnatConfig, port: u16) -> Self::Key;
    /// A new flow's return entry: back to its VM's address and port, out of
    /// `ifindex` (the VM's port) from the gateway MAC to the VM's.
    fn back_entry(
        key: &Self::Key,
        ifindex: u32,
        vm_mac: [u8; 6],
        gw_mac: [u8; 6],
        port_id: u32,
        now: u64,
    ) -> Self::Entry;
    /// A new flow's outbound entry, translated to `port`, from its return
    /// entry `back`; no next hop kept yet.
    fn out_entry(back: &Self::Entry, cfg: &SnatConfig, port: u16) -> Self::Entry;
    /// The outbound table's entry of `key`.
    fn out(key: &Self::Key) -> Option<*mut Self::Entry>;
    fn insert_out(key: &Self::Key, e: &Self::Entry) -> bool;
    /// The return table's entry of `rkey`.
    fn back(rkey: &Self::Key) -> Option<*mut Self::Entry>;
    /// As `back`, by reference (`get`), for `allocate`'s probes: through
    /// `back`'s pointer the verifier walks IPv4's `vm_egress` 11% further.
    ///
    /// # Safety
    /// A map lookup (`HashMap::get`): the value stays valid for this
    /// program run, and another CPU may write it meanwhile.
    unsafe fn back_ref(rkey: &Self::Key) -> Option<&Self::Entry>;
    fn insert_back(rkey: &Self::Key, e: &Self::Entry, flags: u64) -> bool;
    fn remove_back(rkey: &Self::Key);
    /// The inbound-flow record of `key` (the VM's tuple), if any.
    fn inbound(key: &Self::Key) -> Option<*mut InboundFlow>;
    /// The count of flows the VM of `key` holds (its quota's), if any yet.
    fn held(key: &Self::Key) -> Option<*mut u32>;
    /// Counts the first flow of the VM of `key`.
    fn count_first(key: &Self::Key);
}

/// The translated port of the outbound flow `key`, and its kept next hop:
/// the port while the flow's return entry is still its own (looked up, and
/// both entries refreshed, only when a refresh is due: `refresh_due`); 0
/// and `NextHop::LOOKUP` for no such flow.
#[inline(always)]
pub fn established<F: Family>(
    cfg: &SnatConfig,
    key: &F::Key,
    tcp_flags: u8,
    now: u64,
) -> (u16, NextHop) {
    let mut nat_port = 0u16;
    let mut next = NextHop::LOOKUP;
    if let Some(out) = F::out(key) {
        // SAFETY: `out` is from `get_ptr_mut` (bpf_map_lookup_elem) just
        // above, valid until the program returns; plain integer reads.
        let (p, seen) = unsafe { ((*out).port(), (*out).last_seen()) };
        if !refresh_due(seen, now, tcp_flags) {
            nat_port = p;
        } else if let Some(back) = F::back(&F::reply(key, cfg, p)) {
            // SAFETY: `back` is from `get_ptr_mut` just above, valid until
            // the program returns; plain reads.
            if F::is_flow_of(unsafe { &*back }, key) {
                touch(out, now, tcp_flags);
                touch(back, now, tcp_flags);
                nat_port = p;
            }
        }
        if nat_port != 0 {
            // SAFETY: `out` as above; field addresses only.
            let (hop, checked) = unsafe { F::Entry::kept_hop(out) };
            next = next_hop::of_flow(hop, checked, now);
        }
    }
    (nat_port, next)
}

/// Is `key` (the VM's tuple) the reply of a live flow opened from
/// outside? Refreshes it when so.
#[inline(always)]
pub fn inbound_reply<F: Family>(cfg: &SnatConfig, key: &F::Key, now: u64, tcp_flags: u8) -> bool {
    let Some(flow) = F::inbound(key) else {
        return false;
    };
    inbound_live(cfg, F::proto(key), flow, now, tcp_flags)
}

/// Picks a free port for a new flow (within the VM's quota) and records
/// both directions.
#[inline(always)]
pub fn allocate<F: Family>(
    ctx: &TcContext,
    cfg: &SnatConfig,
    key: &F::Key,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
    now: u64,
) -> Result<u16, u32> {
    let held = F::held(key);
    if let Some(n) = held {
        // SAFETY: `n` is from `get_ptr_mut` just above, valid until the
        // program returns; a plain integer read.
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
    let back = F::back_entry(key, ifindex, vm_mac, net.gw_mac, port.port_id, now);
    let mut i = 0u32;
    let mut chosen = 0u16;
    while i < PROBES {
        let cand = (min + (start + i) % range) as u16;
        i += 1;
        let rkey = F::reply(key, cfg, cand);
        // SAFETY: a map lookup; the value stays valid for this program run.
        let flags = match unsafe { F::back_ref(&rkey) } {
            None => u64::from(BPF_NOEXIST),
            Some(e) if expired(cfg, e, F::proto(key), now) => u64::from(BPF_ANY),
            Some(_) => continue,
        };
        if F::insert_back(&rkey, &back, flags) {
            chosen = cand;
            break;
        }
    }
    if chosen == 0 {
        return Err(drop_reason::SNAT_PORTS_EXHAUSTED);
    }
    let out = F::out_entry(&back, cfg, chosen);
    if !F::insert_out(key, &out) {
        F::remove_back(&F::reply(key, cfg, chosen));
        return Err(drop_reason::SNAT_TABLE_FULL);
    }
    match held {
        // Not atomic (the BPF target has no AtomicU32 here): a lost
        // increment only delays the quota until the agent's next recount.
        // SAFETY: `n` is from `get_ptr_mut` above, valid until the program returns.
        Some(n) => unsafe { *n += 1 },
        None => F::count_first(key),
    }
    Ok(chosen)
}

/// Has the flow of entry `e` been idle past its protocol's (and state's)
/// timeout?
#[inline(always)]
pub fn expired<E: FlowEntry>(cfg: &SnatConfig, e: &E, proto: u8, now: u64) -> bool {
    now.saturating_sub(e.last_seen()) > cfg.timeout_ns(proto, e.state())
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
pub fn touch<E: FlowEntry>(e: *mut E, now: u64, tcp_flags: u8) {
    // SAFETY: callers pass a pointer from `get_ptr_mut` (bpf_map_lookup_elem), valid
    // until the program returns. The entry is shared by a flow's two
    // directions (possibly on two CPUs): plain integer stores, a race only
    // leaves a stale `last_seen` or a repeated state change.
    unsafe {
        let (last_seen, state) = E::refreshed(e);
        if stale(*last_seen, now) {
            *last_seen = now;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 && *state != NAT_ST_CLOSING {
            *state = NAT_ST_CLOSING;
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
