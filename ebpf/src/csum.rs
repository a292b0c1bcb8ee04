//! Internet checksum arithmetic (RFC 1071, incremental per RFC 1624).

#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Checksum field after one 16-bit word of the covered data changed from
/// `old` to `new` (all values in host order as read big-endian).
#[inline(always)]
pub fn replace16(check: u16, old: u16, new: u16) -> u16 {
    let sum = u32::from(!check) + u32::from(!old) + u32::from(new);
    !fold(sum)
}

/// Checksum field after a 4-byte address it covers changed from `old` to
/// `new` (the IPv4 header checksum, which is never offloaded).
#[inline(always)]
pub fn replace_addr4(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let words = |a: [u8; 4]| {
        u32::from(u16::from_be_bytes([a[0], a[1]])) + u32::from(u16::from_be_bytes([a[2], a[3]]))
    };
    let sum = u32::from(!check) + (2 * 0xffff - words(old)) + words(new);
    !fold(sum)
}

/// Sum of the 16-bit big-endian words of a 16-byte address.
#[inline(always)]
pub fn sum_addr16(a: &[u8; 16]) -> u32 {
    let mut sum = 0u32;
    let mut i = 0;
    while i < 16 {
        sum += (u32::from(a[i]) << 8) | u32::from(a[i + 1]);
        i += 2;
    }
    sum
}

/// Decrements an IPv4 header's TTL; returns `check` (its header checksum)
/// patched for the change. TTL and protocol share one 16-bit word.
#[inline(always)]
pub fn dec_ttl4(ip: &mut network_types::ip::Ipv4Hdr, check: u16) -> u16 {
    let old = (u16::from(ip.ttl) << 8) | u16::from(ip.proto);
    ip.ttl -= 1;
    replace16(check, old, (u16::from(ip.ttl) << 8) | u16::from(ip.proto))
}

/// Checksum field after a 16-byte address it covers changed (one's
/// complement: add the complement of each old word, then each new one).
#[inline(always)]
pub fn replace_addr16(check: u16, old: &[u8; 16], new: &[u8; 16]) -> u16 {
    let sum = u32::from(!check) + (8 * 0xffff - sum_addr16(old)) + sum_addr16(new);
    !fold(sum)
}
