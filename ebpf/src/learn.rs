//! Learning from the VM's own traffic: its MAC when the Attachment gives
//! none, and the IPs it uses on networks without IP filtering. Only frames
//! that are clearly the VM's (ARP whose sender is the frame's source, IP
//! from a real address, a DHCP request naming its own hardware address)
//! teach anything: the pod's bridge also sends frames (link-local ND/MLD).

use aya_ebpf::bindings::BPF_NOEXIST;
use vmpath_common::{AddrKey, LearnedIp, LearnedMac, PORT_F_MAC_KNOWN, PortInfo};

use crate::{
    maps::{LEARNED_IPS, LEARNED_MACS},
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
    // SAFETY: a map lookup; the value stays valid for this program run.
    if let Some(seen) = unsafe { LEARNED_IPS.get(key) } {
        if seen.ifindex == ifindex && mac_eq(&seen.mac, src) {
            return;
        }
    }
    let learned = LearnedIp {
        ifindex,
        how,
        mac: *src,
        _pad: [0; 2],
    };
    let _ = LEARNED_IPS.insert(key, &learned, 0);
}

#[inline(always)]
pub fn ip4(ifindex: u32, port: &PortInfo, addr: [u8; 4], src: &[u8; 6], how: u32) {
    ip(ifindex, port, &AddrKey::v4(port.network, addr), src, how);
}

#[inline(always)]
pub fn ip6(ifindex: u32, port: &PortInfo, addr: &[u8; 16], src: &[u8; 6], how: u32) {
    ip(ifindex, port, &AddrKey::v6(port.network, addr), src, how);
}
