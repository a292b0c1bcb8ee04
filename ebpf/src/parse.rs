//! Bounds-checked access to packet bytes. Every pointer is checked against
//! `data_end` at the time it is taken; callers take them again after any
//! helper that may move packet data.

use aya_ebpf::programs::TcContext;
use core::mem::size_of;

use network_types::eth::{EthHdr, EtherType};
use vmpath_common::drop_reason;

pub const ETH_LEN: usize = EthHdr::LEN;
// network-types' `EtherType` holds network-order values; the data path
// compares host-order ones (`u16::from_be` of the header field).
pub const ETH_P_IP: u16 = u16::from_be(EtherType::Ipv4 as u16);
pub const ETH_P_ARP: u16 = u16::from_be(EtherType::Arp as u16);
pub const ETH_P_IPV6: u16 = u16::from_be(EtherType::Ipv6 as u16);
pub const ETH_P_8021Q: u16 = u16::from_be(EtherType::Ieee8021q as u16);
/// Reverse ARP (QEMU's announcement of a migrated VM): not in
/// network-types' `EtherType`.
pub const ETH_P_RARP: u16 = 0x8035;

pub use vmpath_common::ip_proto::{
    HOPOPTS as IPPROTO_HOPOPTS, ICMP as IPPROTO_ICMP, ICMPV6 as IPPROTO_ICMPV6, TCP as IPPROTO_TCP,
    UDP as IPPROTO_UDP,
};

/// A pointer to a `T` at `offset` bytes into the frame, or a malformed drop.
/// Only `hdr_mut` turns it into something usable.
#[inline(always)]
fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Result<*mut T, u32> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return Err(drop_reason::MALFORMED);
    }
    Ok((start + offset) as *mut T)
}

/// The header `T` at `offset` bytes into the frame, or a malformed drop:
/// the one place packet memory becomes a reference. Take it again after
/// any helper that may move packet data (the reference would dangle), and
/// hold one mutable reference per header at a time.
#[inline(always)]
#[allow(
    clippy::mut_from_ref,
    reason = "the reference is into packet memory, not into `ctx`"
)]
pub fn hdr_mut<T>(ctx: &TcContext, offset: usize) -> Result<&mut T, u32> {
    let p = ptr_at::<T>(ctx, offset)?;
    // SAFETY: `ptr_at` checked that the `size_of::<T>()` bytes at `offset`
    // lie within data..data_end, which the kernel keeps valid and writable
    // for this program run until a packet-moving helper runs (see above).
    // The `T`s used are packet headers and byte arrays: alignment 1, every
    // bit pattern valid.
    Ok(unsafe { &mut *p })
}

/// Writes `bytes` at `offset` in place, by direct packet access: cheaper
/// than `bpf_skb_store_bytes`, and the same for the checksum state (which
/// that helper, without flags, leaves alone too). The frame is writable:
/// the verifier unclones it before a program that writes packet data.
#[inline(always)]
pub fn write_at<const N: usize>(
    ctx: &TcContext,
    offset: usize,
    bytes: &[u8; N],
) -> Result<(), u32> {
    *hdr_mut::<[u8; N]>(ctx, offset)? = *bytes;
    Ok(())
}

/// `hdr_mut`, read-only.
#[inline(always)]
pub fn hdr<T>(ctx: &TcContext, offset: usize) -> Result<&T, u32> {
    hdr_mut(ctx, offset).map(|h| &*h)
}

#[inline(always)]
pub fn mac_eq(a: &[u8; 6], b: &[u8; 6]) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] && a[5] == b[5]
}

/// 16-byte compare (IPv6 addresses) as words: no byte loop, no `bcmp`
/// call (none exists in BPF), no branch per word.
#[inline(always)]
pub fn addr16_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let (a, b) = (words16(a), words16(b));
    (a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3]) == 0
}

/// A 16-byte address as four native-order words.
#[inline(always)]
pub fn words16(a: &[u8; 16]) -> [u32; 4] {
    // SAFETY: same size; every bit pattern is a valid `[u32; 4]`.
    unsafe { core::mem::transmute::<[u8; 16], [u32; 4]>(*a) }
}

#[inline(always)]
pub fn is_multicast(mac: &[u8; 6]) -> bool {
    mac[0] & 1 != 0
}

#[inline(always)]
pub fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// Writes a MAC address into the frame one byte at a time. A plain
/// `[u8; 6]` assignment there can compile to a call of the byte-looping
/// `memmove` (a bpf-to-bpf call on the hot path); volatile stores cannot.
#[inline(always)]
pub fn write_mac(dst: &mut [u8; 6], mac: [u8; 6]) {
    let p = dst.as_mut_ptr();
    let mut i = 0;
    while i < 6 {
        // SAFETY: `p` comes from `dst`, a live exclusive reference to 6
        // bytes (a header field from `hdr_mut`), and `i < 6`.
        unsafe { core::ptr::write_volatile(p.add(i), mac[i]) };
        i += 1;
    }
}

/// Zeroes `slot` in place with word stores and hands it out as a `T`
/// (plain bytes, 4-byte aligned). `mem::zeroed` of a large struct, or
/// moving a zeroed value into place, compiles to a call of the
/// byte-looping `memset`; volatile stores where it lives cannot.
#[inline(always)]
pub fn zeroed<T: Copy>(slot: &mut core::mem::MaybeUninit<T>) -> &mut T {
    let words = size_of::<T>() / 4;
    let p = slot.as_mut_ptr() as *mut u32;
    let mut i = 0;
    while i < words {
        // SAFETY: within `slot`; the kernel structs used here are 4-byte
        // aligned.
        unsafe { core::ptr::write_volatile(p.add(i), 0) };
        i += 1;
    }
    let b = slot.as_mut_ptr() as *mut u8;
    let mut j = words * 4;
    while j < size_of::<T>() {
        // SAFETY: within `slot` (j < size_of::<T>()); bytes need no alignment.
        unsafe { core::ptr::write_volatile(b.add(j), 0) };
        j += 1;
    }
    // SAFETY: every byte written; all-zero is a valid value of the plain
    // kernel structs this is used for.
    unsafe { slot.assume_init_mut() }
}
