//! ARP: sender checks, and requests for the gateway answered in place.

use aya_ebpf::programs::TcContext;
use network_types::{arp::ArpHdr, eth::EthHdr};
use vmpath_common::{LEARNED_FROM_ARP, NET_F_GW4, NetworkInfo, PortInfo, drop_reason};

use crate::{
    learn,
    parse::{ETH_LEN, be16, hdr, hdr_mut, mac_eq},
    spoof,
};

const ARP_REQUEST: u16 = 1;
const ARP_REPLY: u16 = 2;

/// What to do with an ARP frame from a VM.
pub enum ArpVerdict {
    /// Rewritten into the gateway's reply: send it back out of the port.
    Answered,
    /// Not for the gateway: switch it like any frame.
    Forward,
}

#[inline(always)]
pub fn handle(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    net: &NetworkInfo,
) -> Result<ArpVerdict, u32> {
    let a = hdr_mut::<ArpHdr>(ctx, ETH_LEN)?;
    if be16(a.htype) != 1 || be16(a.ptype) != 0x0800 || a.hlen != 6 || a.plen != 4 {
        return Err(drop_reason::MALFORMED);
    }
    if spoof::mac_filter_on(port) && !mac_eq(&a.sha, &port.mac) {
        return Err(drop_reason::ARP_SPOOF);
    }
    // Only the gateway speaks for its address, filter or not.
    if net.flags & NET_F_GW4 != 0 && a.spa == net.gw_ip4 {
        return Err(drop_reason::ARP_SPOOF);
    }
    // 0.0.0.0 is an ARP probe (RFC 5227): allowed before the VM owns an address.
    if spoof::ip_filter_on(port) && a.spa != [0; 4] && !spoof::owns_ip4(port, ifindex, a.spa) {
        return Err(drop_reason::ARP_SPOOF);
    }
    let src = hdr::<EthHdr>(ctx, 0)?.src_addr;
    if a.spa != [0; 4] && mac_eq(&a.sha, &src) {
        learn::mac(ifindex, port, &src, LEARNED_FROM_ARP);
        learn::ip4(ifindex, port, a.spa, &src, LEARNED_FROM_ARP);
    }
    let oper = be16(a.oper);
    if oper != ARP_REQUEST || net.flags & NET_F_GW4 == 0 || a.tpa != net.gw_ip4 {
        return Ok(ArpVerdict::Forward);
    }
    let requester_mac = a.sha;
    let requester_ip = a.spa;
    a.oper = ARP_REPLY.to_be_bytes();
    a.tha = requester_mac;
    a.tpa = requester_ip;
    a.sha = net.gw_mac;
    a.spa = net.gw_ip4;

    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = requester_mac;
    e.src_addr = net.gw_mac;
    Ok(ArpVerdict::Answered)
}
