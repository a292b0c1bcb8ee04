//! Port security: the source MAC and source IP a VM may use.

use crate::{maps::ADDRESSES, parse::addr16_eq};
use vmpath_common::{AddrKey, PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PortInfo};

#[inline(always)]
pub fn mac_filter_on(port: &PortInfo) -> bool {
    port.flags & (PORT_F_MAC_FILTER | PORT_F_MAC_KNOWN) == (PORT_F_MAC_FILTER | PORT_F_MAC_KNOWN)
}

#[inline(always)]
pub fn ip_filter_on(port: &PortInfo) -> bool {
    port.flags & PORT_F_IP_FILTER != 0
}

/// Is `addr` one of the addresses of the port at `ifindex`?
#[inline(always)]
pub fn owns_ip4(port: &PortInfo, ifindex: u32, addr: [u8; 4]) -> bool {
    // The port's first IPv4 address, cached in its entry: no lookup.
    let (a, mine) = (u32::from_ne_bytes(addr), u32::from_ne_bytes(port.ip4));
    if a == mine && a != 0 {
        return true;
    }
    let key = AddrKey::v4(port.network, addr);
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { ADDRESSES.get(&key) } {
        Some(info) => info.ifindex == ifindex,
        None => false,
    }
}

#[inline(always)]
pub fn owns_ip6(port: &PortInfo, ifindex: u32, addr: &[u8; 16]) -> bool {
    // The port's first IPv6 address, cached in its entry: no lookup.
    if addr16_eq(addr, &port.ip6) && !is_unspecified6(addr) {
        return true;
    }
    let key = AddrKey::v6(port.network, addr);
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { ADDRESSES.get(&key) } {
        Some(info) => info.ifindex == ifindex,
        None => false,
    }
}

/// `::`, which DAD and MLD use before the VM has an address.
#[inline(always)]
pub fn is_unspecified6(a: &[u8; 16]) -> bool {
    let mut acc = 0u8;
    let mut i = 0;
    while i < 16 {
        acc |= a[i];
        i += 1;
    }
    acc == 0
}

/// fe80::/64, which ND, RS and DHCPv6 use.
#[inline(always)]
pub fn is_link_local6(a: &[u8; 16]) -> bool {
    a[0] == 0xfe
        && a[1] == 0x80
        && a[2] == 0
        && a[3] == 0
        && a[4] == 0
        && a[5] == 0
        && a[6] == 0
        && a[7] == 0
}
