//! Port security: the source MAC and source IP a VM may use.

use aya_ebpf::programs::TcContext;
use vmpath_common::{
    AddrKey, PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PortInfo, drop_reason,
    link_local_from_mac,
};

use crate::{
    maps::ADDRESSES,
    parse::{ETH_LEN, IPPROTO_HOPOPTS, addr16_eq, mac_eq},
};

const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_DSTOPTS: u8 = 60;
/// Extension headers walked to find what an IPv6 packet carries. More is
/// refused on guarded ports: a guard must not be hidden behind a chain.
const MAX_EXT_HEADERS: usize = 4;

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

/// The MAC a port's neighbour discovery must name: its own once known,
/// else the frame's source (what the MAC filter would hold it to).
#[inline(always)]
pub fn nd_mac(port: &PortInfo, src: &[u8; 6]) -> [u8; 6] {
    if port.flags & PORT_F_MAC_KNOWN != 0 {
        port.mac
    } else {
        *src
    }
}

/// May the port at `ifindex`, whose MAC is `mac`, advertise `target`? Its
/// own addresses (given or claimed) and the link-local of its MAC.
#[inline(always)]
pub fn owns_nd_target(port: &PortInfo, ifindex: u32, target: &[u8; 16], mac: &[u8; 6]) -> bool {
    addr16_eq(target, &link_local_from_mac(*mac)) || owns_ip6(port, ifindex, target)
}

/// May a VM on another node, whose frames carry `mac`, advertise `target`
/// into `network`? The link-local of its MAC, or an address the config
/// gives to that MAC, or to a remote VM whose MAC this node does not know
/// (detected on its own node, which checked its frames already).
#[inline(always)]
pub fn remote_owns_nd_target(network: u32, target: &[u8; 16], mac: &[u8; 6]) -> bool {
    if addr16_eq(target, &link_local_from_mac(*mac)) {
        return true;
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { ADDRESSES.get(&AddrKey::v6(network, target)) } {
        Some(info) => mac_eq(&info.mac, mac) || (info.ifindex == 0 && mac_eq(&info.mac, &[0; 6])),
        None => false,
    }
}

/// What an IPv6 packet carries and where: the upper-layer protocol and its
/// offset past hop-by-hop, routing, destination options and fragment
/// headers (a later fragment: `IPPROTO_FRAGMENT`, it carries no header;
/// a first one: what follows, its ports are there). More than
/// `MAX_EXT_HEADERS` extension headers: `EXT_HEADER_CHAIN`.
#[inline(always)]
pub fn upper_layer6(ctx: &TcContext, next_hdr: u8) -> Result<(u8, usize), u32> {
    walk6(ctx, next_hdr, &mut ())
}

/// Told by `walk6` of the fragment header of a first fragment (offset 0).
pub trait FragNote {
    /// `off`: the header's offset (its identification is at `off + 4`);
    /// `more`: its M flag (1: more fragments follow), as a value rather
    /// than a branch (see `walk6`).
    fn first_fragment(&mut self, ctx: &TcContext, off: usize, more: u8);
}

/// Nothing to note (the guards): the walk they always had, unchanged.
impl FragNote for () {
    #[inline(always)]
    fn first_fragment(&mut self, _: &TcContext, _: usize, _: u8) {}
}

/// `upper_layer6`, telling `note` of a first fragment's header on the
/// way: the one bounded walk of the guards, SNAT and NetworkPolicy. What
/// the fragment header tells goes to `note` as values, never as a branch
/// or a value returned: either would split each state the verifier walks
/// through the rest of the caller (`vm_egress` is near its budget). A
/// later fragment's identification is at `off + 4` (`frag::later_id6`).
#[inline(always)]
pub fn walk6<N: FragNote>(ctx: &TcContext, next_hdr: u8, note: &mut N) -> Result<(u8, usize), u32> {
    let mut proto = next_hdr;
    let mut off = ETH_LEN + 40;
    let mut i = 0;
    while i < MAX_EXT_HEADERS {
        if proto == IPPROTO_HOPOPTS || proto == IPPROTO_ROUTING || proto == IPPROTO_DSTOPTS {
            let h: [u8; 2] = ctx.load(off).map_err(|_| drop_reason::MALFORMED)?;
            proto = h[0];
            off += (usize::from(h[1]) + 1) * 8;
        } else if proto == IPPROTO_FRAGMENT {
            let h: [u8; 4] = ctx.load(off).map_err(|_| drop_reason::MALFORMED)?;
            if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 {
                return Ok((IPPROTO_FRAGMENT, off));
            }
            note.first_fragment(ctx, off, h[3] & 1);
            proto = h[0];
            off += 8;
        } else {
            return Ok((proto, off));
        }
        i += 1;
    }
    if proto == IPPROTO_HOPOPTS
        || proto == IPPROTO_ROUTING
        || proto == IPPROTO_DSTOPTS
        || proto == IPPROTO_FRAGMENT
    {
        return Err(drop_reason::EXT_HEADER_CHAIN);
    }
    Ok((proto, off))
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
