//! Fragmented datagrams, either family: where a packet stands in its
//! datagram, and the records kept at a datagram's first fragment for its
//! later ones, which carry no transport header. SNAT keeps what it did
//! (`vmp_snat_frags`, `vmp_snat6_frags`), NetworkPolicy the ports it
//! judged (`vmp_pol_frags`); each record in a bounded LRU map, stamped at
//! the first fragment and trusted for `FRAG_TIMEOUT_NS` (Linux's
//! reassembly timeout), keyed as the kernel keys reassembly.

use core::mem::MaybeUninit;

use aya_ebpf::{bindings::BPF_ANY, btf_maps::LruHashMap, programs::TcContext};
use vmpath_common::{
    DatagramKey, FRAG_TIMEOUT_NS, NatEntry, NatEntry6, PolicyFrag, addr_family, drop_reason,
};

use crate::{parse::zeroed, spoof::FragNote};

/// IPv4 fragment offset and more-fragments bits (host order).
pub const IP_OFFSET: u16 = 0x1fff;
pub const IP_MF: u16 = 0x2000;

/// Where a packet stands in its datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// Not fragmented (or an atomic fragment: offset 0, no more to come).
    Whole,
    /// Offset 0, more to come: it carries the transport header.
    First,
    /// Any later fragment: no transport header.
    Later,
}

/// An IPv4 packet's place, from its flags-and-offset field (host order).
#[inline(always)]
pub fn piece4(frags: u16) -> Piece {
    if frags & IP_OFFSET != 0 {
        Piece::Later
    } else if frags & IP_MF != 0 {
        Piece::First
    } else {
        Piece::Whole
    }
}

/// A later IPv6 fragment's identification, from its fragment header at
/// `off` (where `spoof::walk6` stopped).
#[inline(always)]
pub fn later_id6(ctx: &TcContext, off: usize) -> Result<[u8; 4], u32> {
    ctx.load(off + 4).map_err(|_| drop_reason::MALFORMED)
}

/// A first fragment's place and identification, as `spoof::walk6` tells
/// it (a whole datagram when it tells nothing).
#[derive(Clone, Copy)]
pub struct Noted6 {
    pub piece: Piece,
    pub id: [u8; 4],
}

impl Noted6 {
    #[inline(always)]
    pub fn new() -> Noted6 {
        Noted6 {
            piece: Piece::Whole,
            id: [0; 4],
        }
    }
}

impl FragNote for Noted6 {
    #[inline(always)]
    fn first_fragment(&mut self, ctx: &TcContext, off: usize, more: u8) {
        // A header too short for its identification: as a whole datagram
        // (its later fragments, if any, find no record).
        if let Ok(id) = ctx.load::<[u8; 4]>(off + 4) {
            if more != 0 {
                self.piece = Piece::First;
            }
            self.id = id;
        }
    }
}

/// An IPv6 datagram's key in `slot`, built field by field (no second
/// copy on the stack). No protocol: IPv6 reassembly keys none.
#[inline(always)]
pub fn key6<'a>(
    slot: &'a mut MaybeUninit<DatagramKey>,
    src: &[u8; 16],
    dst: &[u8; 16],
    id: [u8; 4],
    dir: u8,
) -> &'a DatagramKey {
    let k = zeroed(slot);
    k.src = *src;
    k.dst = *dst;
    k.id = id;
    k.family = addr_family::IPV6;
    k.dir = dir;
    k
}

/// An IPv4 datagram's key in `slot`: (source, destination, IP ID,
/// protocol), as `ip_fragment` keys it.
#[inline(always)]
pub fn key4(
    slot: &mut MaybeUninit<DatagramKey>,
    src: [u8; 4],
    dst: [u8; 4],
    id: [u8; 2],
    proto: u8,
) -> &DatagramKey {
    let k = zeroed(slot);
    let mut i = 0;
    while i < 4 {
        k.src[i] = src[i];
        k.dst[i] = dst[i];
        i += 1;
    }
    k.id[0] = id[0];
    k.id[1] = id[1];
    k.proto = proto;
    k.family = addr_family::IPV4;
    k
}

/// A record stamped with its first fragment's time.
pub trait Stamped {
    fn stamp(&self) -> u64;
}

impl Stamped for NatEntry {
    #[inline(always)]
    fn stamp(&self) -> u64 {
        self.last_seen
    }
}

impl Stamped for NatEntry6 {
    #[inline(always)]
    fn stamp(&self) -> u64 {
        self.last_seen
    }
}

impl Stamped for PolicyFrag {
    #[inline(always)]
    fn stamp(&self) -> u64 {
        self.last_seen
    }
}

/// Records `value` (stamped by the caller) for `key`'s later fragments.
/// A full map evicts its least recently used datagram; a failure leaves
/// the later fragments unplaced (each user says what becomes of them).
#[inline(always)]
pub fn keep<K, V, const N: usize>(map: &LruHashMap<K, V, N>, key: &K, value: &V) {
    let _ = map.insert(key, value, u64::from(BPF_ANY));
}

/// The record `key`'s first fragment left, if under `FRAG_TIMEOUT_NS`
/// old, in place in the map (valid until the program returns; the IPv6
/// records are too large to copy onto the stack).
#[inline(always)]
pub fn first<'a, K, V: Stamped, const N: usize>(
    map: &'a LruHashMap<K, V, N>,
    key: &K,
    now: u64,
) -> Option<&'a V> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let e = unsafe { map.get(key)? };
    (now.saturating_sub(e.stamp()) <= FRAG_TIMEOUT_NS).then_some(e)
}
