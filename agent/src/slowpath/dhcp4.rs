//! DHCPv4 server for one port (dhcproto): the lease is always the VM's
//! claimed or static address, the same across restarts and migrations.

use std::net::Ipv4Addr;

use dhcproto::{
    Encodable, Encoder, Name,
    v4::{DhcpOption, HType, Message, MessageType, Opcode, OptionCode},
};
use etherparse::PacketBuilder;
use ipnet::Ipv4Net;

use super::{Handled, service::PortService};

const SERVER_PORT: u16 = 67;
const CLIENT_PORT: u16 = 68;
const BROADCAST_MAC: [u8; 6] = [0xff; 6];

fn kind_name(t: MessageType) -> String {
    format!("{t:?}").to_lowercase()
}

/// Answers `payload` (the UDP payload of a frame from `src_mac`).
pub fn handle(svc: &PortService, src_mac: [u8; 6], payload: &[u8]) -> Handled {
    let Some(msg) = super::decode_guarded::<Message>(payload) else {
        return Handled::malformed("undecodable DHCPv4 message");
    };
    let Some(mtype) = msg.opts().msg_type() else {
        return Handled::malformed("no message type option");
    };
    let kind = kind_name(mtype);
    let reply = answer(svc, src_mac, &msg, mtype);
    Handled { kind, reply }
}

fn answer(
    svc: &PortService,
    src_mac: [u8; 6],
    msg: &Message,
    mtype: MessageType,
) -> Result<Vec<u8>, &'static str> {
    // Check hlen before chaddr(): dhcproto slices chaddr by it and a
    // VM-supplied hlen above 16 would panic there.
    if msg.opcode() != Opcode::BootRequest || msg.htype() != HType::Eth || msg.hlen() != 6 {
        return Err("not an Ethernet BOOTREQUEST");
    }
    let chaddr: [u8; 6] = msg.chaddr()[..6].try_into().unwrap();
    if chaddr != src_mac || svc.mac.is_some_and(|m| m != chaddr) {
        return Err("client hardware address is not the VM's");
    }
    if !msg.giaddr().is_unspecified() {
        return Err("relayed requests are not served");
    }
    let Some(server_id) = svc.net.gw4 else {
        return Err("the network has no IPv4 gateway");
    };
    let Some(lease) = svc.v4 else {
        return Err("the VM has no IPv4 address");
    };
    let asked_server = match msg.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(id)) => Some(*id),
        _ => None,
    };

    let (reply_type, yiaddr) = match mtype {
        MessageType::Discover => (MessageType::Offer, lease.addr()),
        MessageType::Request => {
            if asked_server.is_some_and(|s| s != server_id) {
                return Err("the client chose another server");
            }
            let requested = match msg.opts().get(OptionCode::RequestedIpAddress) {
                Some(DhcpOption::RequestedIpAddress(ip)) => *ip,
                _ => msg.ciaddr(),
            };
            if requested == lease.addr() {
                (MessageType::Ack, lease.addr())
            } else {
                (MessageType::Nak, Ipv4Addr::UNSPECIFIED)
            }
        }
        MessageType::Inform => (MessageType::Ack, Ipv4Addr::UNSPECIFIED),
        MessageType::Release => return Err("release noted (the claim is kept)"),
        MessageType::Decline => {
            tracing::warn!(vm = %svc.key, address = %lease.addr(), "DHCP DECLINE: the VM reports its address in use");
            return Err("decline noted");
        }
        _ => return Err("not a client message"),
    };

    let mut reply = Message::default();
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_xid(msg.xid())
        .set_flags(msg.flags())
        .set_chaddr(&chaddr)
        .set_yiaddr(yiaddr)
        .set_siaddr(Ipv4Addr::UNSPECIFIED);
    if mtype == MessageType::Inform
        || (mtype == MessageType::Request && reply_type == MessageType::Ack)
    {
        reply.set_ciaddr(msg.ciaddr());
    }
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::MessageType(reply_type));
    opts.insert(DhcpOption::ServerIdentifier(server_id));
    if reply_type != MessageType::Nak {
        add_config_options(svc, lease, server_id, mtype != MessageType::Inform, opts);
    }

    let mut payload = Vec::new();
    reply
        .encode(&mut Encoder::new(&mut payload))
        .map_err(|_| "encoding the reply failed")?;

    // RFC 2131 4.1: NAKs are broadcast; a renewing client (ciaddr set) gets
    // unicast to ciaddr; otherwise the broadcast bit decides.
    let (dst_mac, dst_ip) = if reply_type == MessageType::Nak {
        (BROADCAST_MAC, Ipv4Addr::BROADCAST)
    } else if !msg.ciaddr().is_unspecified() {
        (chaddr, msg.ciaddr())
    } else if msg.flags().broadcast() {
        (BROADCAST_MAC, Ipv4Addr::BROADCAST)
    } else {
        (chaddr, yiaddr)
    };
    let builder = PacketBuilder::ethernet2(svc.net.gw_mac, dst_mac)
        .ipv4(server_id.octets(), dst_ip.octets(), 64)
        .udp(SERVER_PORT, CLIENT_PORT);
    let mut frame = Vec::with_capacity(builder.size(payload.len()));
    builder
        .write(&mut frame, &payload)
        .map_err(|_| "building the reply frame failed")?;
    Ok(frame)
}

fn add_config_options(
    svc: &PortService,
    lease: Ipv4Net,
    server_id: Ipv4Addr,
    with_lease: bool,
    opts: &mut dhcproto::v4::DhcpOptions,
) {
    let net = &svc.net;
    opts.insert(DhcpOption::SubnetMask(lease.netmask()));
    if with_lease {
        opts.insert(DhcpOption::AddressLeaseTime(net.lease_seconds));
        opts.insert(DhcpOption::Renewal(net.lease_seconds / 2));
        opts.insert(DhcpOption::Rebinding(net.lease_seconds / 8 * 7));
    }
    if net.default_route {
        opts.insert(DhcpOption::Router(vec![server_id]));
    }
    if !net.dns4.is_empty() {
        opts.insert(DhcpOption::DomainNameServer(net.dns4.clone()));
    }
    if let Some(first) = net.search.first() {
        opts.insert(DhcpOption::DomainName(first.clone()));
        let names: Vec<Name> = net
            .search
            .iter()
            .filter_map(|s| Name::from_ascii(s).ok())
            .collect();
        if !names.is_empty() {
            opts.insert(DhcpOption::DomainSearch(names));
        }
    }
    opts.insert(DhcpOption::Hostname(svc.hostname.clone()));
    opts.insert(DhcpOption::InterfaceMtu(net.mtu));
    if !net.routes4.is_empty() {
        // Clients that take option 121 ignore the router option (RFC 3442):
        // the default route must be in it.
        let mut routes = net.routes4.clone();
        if net.default_route {
            routes.push((Ipv4Net::new(Ipv4Addr::UNSPECIFIED, 0).unwrap(), server_id));
        }
        opts.insert(DhcpOption::ClasslessStaticRoute(routes));
    }
}
