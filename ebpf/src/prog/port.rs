//! `vm_port`: tcx ingress on a VM port (host side of the VM pod's veth),
//! every frame the VM sends. Its way through reads top to bottom here:
//! port security, learning, the gateway's own answers, then on to
//! switching, a Service, policy or routing.

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr, udp::UdpHdr};
use vmpath_common::{
    LEARNED_FROM_DHCP, LEARNED_FROM_IPV4, LEARNED_FROM_IPV6, NET_F_GW4, NO_PORT_ID, NetworkInfo,
    PORT_F_DHCP, PORT_F_DHCP_GUARD, PORT_F_PENDING, PortInfo, drop_reason, slow_class, tail_call,
};

use crate::{
    arp::{self, ArpVerdict},
    counters, fwd, icmp, learn,
    maps::{NETWORKS, PORTS},
    migrate, nd, neigh,
    parse::*,
    policy, route, service, slowpath, spoof,
    verdict::{self, Verdict},
};

const DHCP4_SERVER_PORT: u16 = 67;
const DHCP4_CLIENT_PORT: u16 = 68;
const DHCP6_SERVER_PORT: u16 = 547;
const DHCP6_CLIENT_PORT: u16 = 546;
const ICMP_REDIRECT: u8 = 5;

/// tcx ingress on a VM port (host side of the VM pod's veth): every frame
/// the VM sends.
#[classifier]
pub fn vm_port(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for
    // this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    match try_vm_port(&ctx, ifindex, port) {
        Ok(action) => action,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port.port_id, reason);
            TC_ACT_SHOT
        }
    }
}

/// The port's network, looked up only by the paths that need more of it
/// than the gateway MAC the port entry carries (switched unicast does not).
#[inline(always)]
fn network_of(port: &PortInfo) -> Result<&NetworkInfo, u32> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { NETWORKS.get(&port.network) }.ok_or(drop_reason::NO_NETWORK)
}

#[inline(always)]
fn try_vm_port(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Verdict {
    if port.flags & PORT_F_PENDING != 0 {
        // Live migration target: `vm_migrate` decides, then re-enters here.
        return migrate::to_vm_migrate(ctx);
    }
    if !policy::reentered(ctx, port.port_id) && !service::passed(ctx, port.port_id) {
        counters::count_rx(port.port_id, ctx.len());
    }

    let eth = hdr::<EthHdr>(ctx, 0)?;
    let (dst, src, ether_type) = (eth.dst_addr, eth.src_addr, u16::from_be(eth.ether_type));
    if is_multicast(&src) {
        return Err(drop_reason::SRC_MULTICAST);
    }
    if spoof::mac_filter_on(port) && !mac_eq(&src, &port.mac) {
        return Err(drop_reason::MAC_SPOOF);
    }

    // The kernel takes a VLAN tag off into the skb before tc sees the
    // frame: without this, a tagged frame would pass as its payload and
    // reach the other VMs tagged.
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    if spoof::ip_filter_on(port) && unsafe { (*ctx.skb.skb).vlan_present } != 0 {
        return Err(drop_reason::ETHERTYPE);
    }
    match ether_type {
        ETH_P_ARP => match arp::handle(ctx, ifindex, port, network_of(port)?)? {
            ArpVerdict::Answered => gateway_reply(ctx, ifindex, port),
            ArpVerdict::Forward => {
                neigh::to_vm_neigh(ctx, &dst);
                fwd::switch(ctx, ifindex, port.network, dst)
            }
        },
        ETH_P_IP => ipv4(ctx, ifindex, port, dst, src),
        ETH_P_IPV6 => ipv6(ctx, ifindex, port, dst, src),
        // QEMU announces a migrated VM with RARP: flood it like any broadcast.
        ETH_P_RARP => fwd::switch(ctx, ifindex, port.network, dst),
        // VLAN tags and other ethertypes would carry IP past the filter.
        _ if spoof::ip_filter_on(port) => Err(drop_reason::ETHERTYPE),
        _ => fwd::switch(ctx, ifindex, port.network, dst),
    }
}

#[inline(always)]
fn gateway_reply(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Verdict {
    counters::count_gw_reply(port.port_id);
    verdict::reply_out(ctx, ifindex)
}

#[inline(always)]
fn ipv4(ctx: &TcContext, ifindex: u32, port: &PortInfo, dst: [u8; 6], src: [u8; 6]) -> Verdict {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, proto, src_ip, dst_ip) = (ip.vihl, ip.proto, ip.src_addr, ip.dst_addr);
    let ihl = usize::from(vihl & 0x0f) * 4;
    if vihl >> 4 != 4 || ihl < Ipv4Hdr::LEN {
        return Err(drop_reason::MALFORMED);
    }
    let l4_off = ETH_LEN + ihl;
    if ctx.data() + l4_off > ctx.data_end() {
        return Err(drop_reason::MALFORMED);
    }

    if spoof::ip_filter_on(port) {
        if src_ip == [0; 4] {
            // Only a DHCP client may speak before it has an address.
            if proto != IPPROTO_UDP {
                return Err(drop_reason::IP_SPOOF);
            }
            if udp_dst_port(ctx, l4_off)? != DHCP4_SERVER_PORT {
                return Err(drop_reason::IP_SPOOF);
            }
        } else if !spoof::owns_ip4(port, ifindex, src_ip) {
            return Err(drop_reason::IP_SPOOF);
        }
    }
    if src_ip != [0; 4] {
        learn::mac(ifindex, port, &src, LEARNED_FROM_IPV4);
        learn::ip4(ifindex, port, src_ip, &src, LEARNED_FROM_IPV4);
    } else if proto == IPPROTO_UDP && dhcp_client_is(ctx, l4_off, &src) {
        learn::mac(ifindex, port, &src, LEARNED_FROM_DHCP);
    }
    if proto == IPPROTO_UDP
        && port.flags & PORT_F_DHCP_GUARD != 0
        && udp_ports(ctx, l4_off)? == (DHCP4_SERVER_PORT, DHCP4_CLIENT_PORT)
    {
        // A rogue DHCP server's offer or ack (server -> client).
        return Err(drop_reason::DHCP_SPOOF);
    }
    if proto == IPPROTO_UDP
        && port.flags & PORT_F_DHCP != 0
        && udp_dst_port(ctx, l4_off)? == DHCP4_SERVER_PORT
    {
        return slowpath::punt(ctx, port, slow_class::DHCP4);
    }
    if proto == IPPROTO_ICMP && !is_fragment(ctx)? {
        let icmp_type: u8 = ctx.load(l4_off).map_err(|_| drop_reason::MALFORMED)?;
        // Only the gateway redirects.
        if icmp_type == ICMP_REDIRECT
            && (spoof::ip_filter_on(port) || network_of(port)?.flags & NET_F_GW4 != 0)
        {
            return Err(drop_reason::ICMP_REDIRECT);
        }
    }

    let to_gateway = mac_eq(&dst, &port.gw_mac);
    if to_gateway {
        let net = network_of(port)?;
        if proto == IPPROTO_ICMP
            && net.flags & vmpath_common::NET_F_GW4 != 0
            && dst_ip == net.gw_ip4
            && !is_fragment(ctx)?
        {
            icmp::echo_reply4(ctx, l4_off, net)?;
            return gateway_reply(ctx, ifindex, port);
        }
        // A ClusterIP is reached through the gateway: translated before
        // egress policy, which then sees the backend.
        if let Some(verdict) = service::egress(ctx, port.port_id, proto, tail_call::VM_SERVICE) {
            return verdict;
        }
    }
    // Switched unicast may reach a local port: its flow's shared entry.
    let local = (!to_gateway && !is_multicast(&dst)).then_some(port.network);
    let parsed = match policy::egress(ctx, port.port_id, local) {
        policy::Egress::Pass(parsed) => parsed,
        policy::Egress::Verdict(verdict) => return verdict,
    };
    if to_gateway {
        return route::egress(ctx, network_of(port)?);
    }
    fwd::switch_parsed(ctx, ifindex, port.network, dst, parsed)
}

#[inline(always)]
fn ipv6(ctx: &TcContext, ifindex: u32, port: &PortInfo, dst: [u8; 6], src: [u8; 6]) -> Verdict {
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let (vcf0, next_hdr, src_ip, dst_ip) = (ip.vcf[0], ip.next_hdr, ip.src_addr, ip.dst_addr);
    if vcf0 >> 4 != 6 {
        return Err(drop_reason::MALFORMED);
    }

    if spoof::ip_filter_on(port) {
        let allowed = if spoof::is_unspecified6(&src_ip) {
            // DAD and MLD speak from :: before the VM has an address; MLD
            // reports carry a hop-by-hop header (router alert) first.
            next_hdr == IPPROTO_ICMPV6
                || (next_hdr == IPPROTO_HOPOPTS && hop_by_hop_then_icmpv6(ctx)?)
        } else {
            spoof::is_link_local6(&src_ip) || spoof::owns_ip6(port, ifindex, &src_ip)
        };
        if !allowed {
            return Err(drop_reason::IP_SPOOF);
        }
    }
    if !spoof::is_unspecified6(&src_ip) && !spoof::is_link_local6(&src_ip) {
        learn::mac(ifindex, port, &src, LEARNED_FROM_IPV6);
        learn::ip6(ifindex, port, &src_ip, &src, LEARNED_FROM_IPV6);
    }

    // What the packet carries, past any extension headers: a guard must
    // not be hidden behind them.
    let (proto, l4_off) = spoof::upper_layer6(ctx, next_hdr)?;
    if proto == IPPROTO_UDP
        && port.flags & PORT_F_DHCP_GUARD != 0
        && udp_ports(ctx, l4_off)? == (DHCP6_SERVER_PORT, DHCP6_CLIENT_PORT)
    {
        // A rogue DHCPv6 server's advertise, reply or reconfigure.
        return Err(drop_reason::DHCP_SPOOF);
    }
    if proto == IPPROTO_ICMPV6 {
        let net = network_of(port)?;
        let filter = spoof::ip_filter_on(port);
        let mac = spoof::nd_mac(port, &src);
        if let Some(target) = nd::guard(ctx, l4_off, net, &mac, filter)?
            && !spoof::owns_nd_target(port, ifindex, &target, &mac)
        {
            return Err(drop_reason::ND_SPOOF_TARGET);
        }
    }

    let dhcp = port.flags & PORT_F_DHCP != 0;
    if dhcp && next_hdr == IPPROTO_UDP && udp_dst_port(ctx, ETH_LEN + 40)? == DHCP6_SERVER_PORT {
        return slowpath::punt(ctx, port, slow_class::DHCP6);
    }
    if next_hdr == IPPROTO_ICMPV6 {
        let icmp_type = hdr::<nd::Icmp6Hdr>(ctx, ETH_LEN + 40)?.type_;
        if dhcp && icmp_type == nd::ND_ROUTER_SOLICIT {
            return slowpath::punt(ctx, port, slow_class::RS);
        }
        let net = network_of(port)?;
        if icmp_type == nd::ND_NEIGHBOR_SOLICIT && !spoof::is_unspecified6(&src_ip) {
            if let Some(target) = nd::ns_gateway_target(ctx, net)? {
                nd::neighbor_advert(ctx, net, target)?;
                return gateway_reply(ctx, ifindex, port);
            }
            // Another address: answered for a known endpoint, by `vm_neigh`.
            neigh::to_vm_neigh(ctx, &dst);
        } else if icmp_type == nd::ICMPV6_ECHO_REQUEST
            && nd::is_gateway6(net, &dst_ip)
            && mac_eq(&dst, &net.gw_mac)
        {
            nd::echo_reply6(ctx, net)?;
            return gateway_reply(ctx, ifindex, port);
        }
    }

    let to_gateway = mac_eq(&dst, &port.gw_mac);
    // An IPv6 ClusterIP is reached through the gateway too (TCP or UDP
    // right after the fixed header: `vm_service6` looks no further).
    if to_gateway
        && let Some(verdict) = service::egress(ctx, port.port_id, next_hdr, tail_call::VM_SERVICE6)
    {
        return verdict;
    }
    let local = (!to_gateway && !is_multicast(&dst)).then_some(port.network);
    let parsed = match policy::egress(ctx, port.port_id, local) {
        policy::Egress::Pass(parsed) => parsed,
        policy::Egress::Verdict(verdict) => return verdict,
    };
    if to_gateway {
        return route::egress(ctx, network_of(port)?);
    }
    fwd::switch_parsed(ctx, ifindex, port.network, dst, parsed)
}

/// Any fragment but a whole datagram (MF set or a non-zero offset).
#[inline(always)]
fn is_fragment(ctx: &TcContext) -> Result<bool, u32> {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    Ok(u16::from_be_bytes(ip.frags) & 0x3fff != 0)
}

/// (source, destination) ports of the UDP header at `l4_off`.
#[inline(always)]
fn udp_ports(ctx: &TcContext, l4_off: usize) -> Result<(u16, u16), u32> {
    let ports: [u8; 4] = ctx.load(l4_off).map_err(|_| drop_reason::MALFORMED)?;
    Ok((
        u16::from_be_bytes([ports[0], ports[1]]),
        u16::from_be_bytes([ports[2], ports[3]]),
    ))
}

#[inline(always)]
fn udp_dst_port(ctx: &TcContext, l4_off: usize) -> Result<u16, u32> {
    Ok(u16::from_be_bytes(hdr::<UdpHdr>(ctx, l4_off)?.dst))
}

/// Does the hop-by-hop options header right after the IPv6 header lead to
/// ICMPv6?
#[inline(always)]
fn hop_by_hop_then_icmpv6(ctx: &TcContext) -> Result<bool, u32> {
    Ok(hdr::<[u8; 2]>(ctx, ETH_LEN + 40)?[0] == IPPROTO_ICMPV6)
}

/// A DHCPv4 request whose client hardware address is the frame's source:
/// the VM itself asking, not something bridged on its behalf.
#[inline(always)]
fn dhcp_client_is(ctx: &TcContext, l4_off: usize, src: &[u8; 6]) -> bool {
    if udp_dst_port(ctx, l4_off) != Ok(DHCP4_SERVER_PORT) {
        return false;
    }
    // UDP header, then op, htype, hlen, hops, xid, secs, flags and four
    // addresses before chaddr.
    match hdr::<[u8; 6]>(ctx, l4_off + 8 + 28) {
        Ok(chaddr) => mac_eq(chaddr, src),
        Err(_) => false,
    }
}
