//! ICMPv4 echo requests to the gateway IP, answered in place.

use aya_ebpf::programs::TcContext;
use network_types::{eth::EthHdr, icmp::Icmpv4Hdr, ip::Ipv4Hdr};
use vmpath_common::{NetworkInfo, drop_reason};

use crate::{
    csum,
    parse::{ETH_LEN, hdr_mut},
};

const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_ECHO_REQUEST: u8 = 8;
const REPLY_TTL: u8 = 64;

/// Turns the echo request at `l4_off` into the gateway's echo reply.
#[inline(always)]
#[allow(
    clippy::manual_swap,
    reason = "`mem::swap` compiles to other byte moves; kept so the object stays as verified"
)]
pub fn echo_reply4(ctx: &TcContext, l4_off: usize, net: &NetworkInfo) -> Result<(), u32> {
    let icmp = hdr_mut::<Icmpv4Hdr>(ctx, l4_off)?;
    if icmp.type_ != ICMP_ECHO_REQUEST || icmp.code != 0 {
        return Err(drop_reason::GATEWAY_UNROUTED);
    }
    let old = u16::from(ICMP_ECHO_REQUEST) << 8;
    let new = u16::from(ICMP_ECHO_REPLY) << 8;
    icmp.type_ = ICMP_ECHO_REPLY;
    icmp.check = csum::replace16(u16::from_be_bytes(icmp.check), old, new).to_be_bytes();

    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let old_ttl_proto = (u16::from(ip.ttl) << 8) | u16::from(ip.proto);
    let requester = ip.src_addr;
    ip.src_addr = ip.dst_addr;
    ip.dst_addr = requester;
    ip.ttl = REPLY_TTL;
    let new_ttl_proto = (u16::from(ip.ttl) << 8) | u16::from(ip.proto);
    ip.check =
        csum::replace16(u16::from_be_bytes(ip.check), old_ttl_proto, new_ttl_proto).to_be_bytes();

    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = e.src_addr;
    e.src_addr = net.gw_mac;
    Ok(())
}
