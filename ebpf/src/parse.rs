//! Bounds-checked access to packet bytes. Every pointer is checked against
//! `data_end` at the time it is taken; callers take them again after any
//! helper that may move packet data.

use aya_ebpf::programs::TcContext;
use core::mem::size_of;
use vmpath_common::drop_reason;

pub const ETH_LEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_RARP: u16 = 0x8035;
pub const ETH_P_IPV6: u16 = 0x86dd;

pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;

/// A pointer to a `T` at `offset` bytes into the frame, or a malformed drop.
#[inline(always)]
pub fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Result<*mut T, u32> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return Err(drop_reason::MALFORMED);
    }
    Ok((start + offset) as *mut T)
}

#[inline(always)]
pub fn mac_eq(a: &[u8; 6], b: &[u8; 6]) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] && a[5] == b[5]
}

/// 16-byte compare without a memcmp call (none exists in BPF).
#[inline(always)]
pub fn addr16_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let a0 = u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    let b0 = u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let a1 = u64::from_ne_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
    let b1 = u64::from_ne_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
    a0 == b0 && a1 == b1
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
pub fn write_mac(dst: *mut [u8; 6], mac: [u8; 6]) {
    let p = dst as *mut u8;
    let mut i = 0;
    while i < 6 {
        // SAFETY: `dst` was bounds-checked by the caller (`ptr_at`).
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
        unsafe { core::ptr::write_volatile(b.add(j), 0) };
        j += 1;
    }
    // SAFETY: every byte written; all-zero is a valid value of the plain
    // kernel structs this is used for.
    unsafe { slot.assume_init_mut() }
}
