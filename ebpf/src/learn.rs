//! Learning from the VM's own traffic: its MAC when the Attachment gives
//! none, and the IPs it uses on networks without IP filtering. Only frames
//! that are clearly the VM's (ARP whose sender is the frame's source, IP
//! from a real address, a DHCP request naming its own hardware address)
//! teach anything: the pod's bridge also sends frames (link-local ND/MLD).

use aya_ebpf::bindings::BPF_NOEXIST;
use vmpath_common::{
    AddrKey, LEARN_HOLD_NS, LEARN_TOUCH_NS, LearnedIp, LearnedMac, PORT_F_MAC_KNOWN, PortInfo,
};

use crate::{
    clock,
    maps::{LEARN_CONFLICTS, LEARNED_IPS, LEARNED_MACS},
    parse::mac_eq,
    spoof,
};

#[inline(always)]
pub fn mac(ifindex: u32, port: &PortInfo, src: &[u8; 6], how: u32) {
    if port.flags & PORT_F_MAC_KNOWN != 0 {
        return;
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    if unsafe { LEARNED_MACS.get(&ifindex) }.is_some() {
        return;
    }
    let learned = LearnedMac {
        mac: *src,
        _pad: [0; 2],
        how,
        _pad2: 0,
    };
    // First one wins; the agent decides from there.
    if LEARNED_MACS
        .insert(&ifindex, &learned, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        crate::debug::mac_learned(ifindex, src);
    }
}

#[inline(always)]
fn ip(ifindex: u32, port: &PortInfo, key: &AddrKey, src: &[u8; 6], how: u32) {
    if spoof::ip_filter_on(port) {
        // Filtered networks only use the addresses they were given.
        return;
    }
    let now = clock::flow_now();
    let learned = LearnedIp {
        ifindex,
        how,
        mac: *src,
        _pad: [0; 2],
        seen: now,
    };
    // SAFETY: a map lookup; the value stays valid for this program run.
    if let Some(seen) = unsafe { LEARNED_IPS.get(key) } {
        if seen.ifindex == ifindex && mac_eq(&seen.mac, src) {
            if now.wrapping_sub(seen.seen) < LEARN_TOUCH_NS {
                return;
            }
        } else if now.wrapping_sub(seen.seen) < LEARN_HOLD_NS {
            // The first holder keeps it: another port (or MAC) using it is
            // a conflict the agent reports, never a move.
            let _ = LEARN_CONFLICTS.insert(key, &learned, 0);
            return;
        }
    }
    let _ = LEARNED_IPS.insert(key, &learned, 0);
}

/// Addresses no guest can hold: unspecified, loopback, link-local,
/// multicast and the class E / limited broadcast range. Screened here so
/// a guest cannot fill the shared table with them; the agent applies the
/// network's own rules (subnets, gateways, other holders) to the rest.
#[inline(always)]
fn plausible4(a: [u8; 4]) -> bool {
    !(a[0] == 0 || a[0] == 127 || a[0] >= 224 || (a[0] == 169 && a[1] == 254))
}

#[inline(always)]
fn plausible6(a: &[u8; 16]) -> bool {
    // Two words, not a byte loop: the verifier walks every iteration.
    let hi = u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
    let lo = u64::from_be_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
    let loopback_or_unspecified = hi == 0 && lo <= 1;
    !(a[0] == 0xff || (a[0] == 0xfe && a[1] & 0xc0 == 0x80) || loopback_or_unspecified)
}

#[inline(always)]
pub fn ip4(ifindex: u32, port: &PortInfo, addr: [u8; 4], src: &[u8; 6], how: u32) {
    if !plausible4(addr) {
        return;
    }
    ip(ifindex, port, &AddrKey::v4(port.network, addr), src, how);
}

#[inline(always)]
pub fn ip6(ifindex: u32, port: &PortInfo, addr: &[u8; 16], src: &[u8; 6], how: u32) {
    if !plausible6(addr) {
        return;
    }
    ip(ifindex, port, &AddrKey::v6(port.network, addr), src, how);
}
