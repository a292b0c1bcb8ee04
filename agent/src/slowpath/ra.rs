//! Router advertisements from the gateway's link-local address (the same on
//! every node): managed flag set (addresses come from DHCPv6), the prefix
//! on-link with autonomous off (DHCPv6 hands out /128s), MTU and RDNSS.

use std::net::Ipv6Addr;

use etherparse::PacketBuilder;

use super::service::PortService;

const ICMPV6_ROUTER_ADVERT: u8 = 134;
const FLAG_MANAGED: u8 = 0x80;
const FLAG_OTHER: u8 = 0x40;
const PREFIX_ON_LINK: u8 = 0x80;
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
/// Router lifetime when the network gives the default route.
const ROUTER_LIFETIME: u16 = 1800;

/// The RA for `svc`, to `dst` (a soliciting VM) or to all nodes.
pub fn advert(svc: &PortService, dst: Option<([u8; 6], Ipv6Addr)>) -> Option<Vec<u8>> {
    let net = &svc.net;
    let prefix = net.prefix6?;
    let (dst_mac, dst_ip) = dst.unwrap_or((ALL_NODES_MAC, ALL_NODES));
    let lifetime = if net.default_route {
        ROUTER_LIFETIME
    } else {
        0
    };
    let lt = lifetime.to_be_bytes();
    // cur hop limit, flags, router lifetime
    let head = [64, FLAG_MANAGED | FLAG_OTHER, lt[0], lt[1]];

    let mut body = Vec::with_capacity(96);
    body.extend_from_slice(&0u32.to_be_bytes()); // reachable time: unspecified
    body.extend_from_slice(&0u32.to_be_bytes()); // retrans timer: unspecified
    // Source link-layer address.
    body.extend_from_slice(&[1, 1]);
    body.extend_from_slice(&net.gw_mac);
    // MTU.
    body.extend_from_slice(&[5, 1, 0, 0]);
    body.extend_from_slice(&u32::from(net.mtu).to_be_bytes());
    // Prefix information: on-link, not autonomous.
    let valid = net.lease_seconds.max(1).saturating_mul(2);
    body.extend_from_slice(&[3, 4, prefix.prefix_len(), PREFIX_ON_LINK]);
    body.extend_from_slice(&valid.to_be_bytes());
    body.extend_from_slice(&valid.to_be_bytes());
    body.extend_from_slice(&0u32.to_be_bytes());
    body.extend_from_slice(&prefix.network().octets());
    // Recursive DNS servers (RFC 8106).
    if !net.dns6.is_empty() {
        body.extend_from_slice(&[25, (1 + 2 * net.dns6.len()) as u8, 0, 0]);
        body.extend_from_slice(&valid.to_be_bytes());
        for dns in &net.dns6 {
            body.extend_from_slice(&dns.octets());
        }
    }

    let builder = PacketBuilder::ethernet2(net.gw_mac, dst_mac)
        .ipv6(net.gw_ll6.octets(), dst_ip.octets(), 255)
        .icmpv6_raw(ICMPV6_ROUTER_ADVERT, 0, head);
    let mut frame = Vec::with_capacity(builder.size(body.len()));
    builder.write(&mut frame, &body).ok()?;
    Some(frame)
}
