//! Stateful DHCPv6 for one port (dhcproto): the VM's /128, from the
//! gateway's link-local address.

use std::net::Ipv6Addr;

use dhcproto::{
    Encodable, Encoder, Name,
    v6::{
        DhcpOption, DhcpOptions, IAAddr, IANA, Message, MessageType, OptionCode, Status, StatusCode,
    },
};
use etherparse::PacketBuilder;

use super::{Handled, service::PortService};

const SERVER_PORT: u16 = 547;
const CLIENT_PORT: u16 = 546;

/// The server's DUID: DUID-LL (type 3) of the gateway MAC, the same on
/// every node so a migrated VM renews with the server it knows.
pub fn server_duid(gw_mac: [u8; 6]) -> Vec<u8> {
    let mut d = vec![0, 3, 0, 1];
    d.extend_from_slice(&gw_mac);
    d
}

/// The addresses of every IA_NA in `msg` (what a CONFIRM asks about).
fn confirmed_addresses(msg: &Message) -> Vec<Ipv6Addr> {
    msg.opts()
        .get_all(OptionCode::IANA)
        .unwrap_or_default()
        .iter()
        .filter_map(|o| match o {
            DhcpOption::IANA(ia) => Some(ia),
            _ => None,
        })
        .flat_map(|ia| {
            ia.opts.iter().filter_map(|o| match o {
                DhcpOption::IAAddr(a) => Some(a.addr),
                _ => None,
            })
        })
        .collect()
}

/// Answers `payload` (the UDP payload of a frame from `src_mac`/`src_ip`).
pub fn handle(svc: &PortService, src_mac: [u8; 6], src_ip: Ipv6Addr, payload: &[u8]) -> Handled {
    let Some(msg) = super::decode_guarded::<Message>(payload) else {
        return Handled::malformed("undecodable DHCPv6 message");
    };
    let kind = format!("{:?}", msg.msg_type()).to_lowercase();
    Handled {
        kind,
        reply: answer(svc, src_mac, src_ip, &msg),
    }
}

fn answer(
    svc: &PortService,
    src_mac: [u8; 6],
    src_ip: Ipv6Addr,
    msg: &Message,
) -> Result<Vec<u8>, &'static str> {
    if svc.mac.is_some_and(|m| m != src_mac) {
        return Err("frame not from the VM's MAC");
    }
    let duid = server_duid(svc.net.gw_mac);
    let client_id = match msg.opts().get(OptionCode::ClientId) {
        Some(DhcpOption::ClientId(id)) => Some(id.clone()),
        _ => None,
    };
    let to_us = match msg.opts().get(OptionCode::ServerId) {
        Some(DhcpOption::ServerId(id)) => *id == duid,
        _ => true,
    };
    let mtype = msg.msg_type();
    let needs_server_id = matches!(
        mtype,
        MessageType::Request | MessageType::Renew | MessageType::Release | MessageType::Decline
    );
    if needs_server_id
        && !matches!(
            msg.opts().get(OptionCode::ServerId),
            Some(DhcpOption::ServerId(_))
        )
    {
        return Err("message lacks a server identifier");
    }
    if !to_us {
        return Err("addressed to another server");
    }
    if client_id.is_none() && mtype != MessageType::InformationRequest {
        return Err("message lacks a client identifier");
    }
    let iaid = match msg.opts().get(OptionCode::IANA) {
        Some(DhcpOption::IANA(ia)) => Some(ia.id),
        _ => None,
    };
    let rapid = matches!(
        msg.opts().get(OptionCode::RapidCommit),
        Some(DhcpOption::RapidCommit)
    );

    let mut opts = DhcpOptions::new();
    opts.insert(DhcpOption::ServerId(duid));
    if let Some(id) = client_id {
        opts.insert(DhcpOption::ClientId(id));
    }
    let reply_type = match mtype {
        MessageType::Solicit | MessageType::Request | MessageType::Renew | MessageType::Rebind => {
            let Some(lease) = svc.v6 else {
                return Err("the VM has no IPv6 address");
            };
            let Some(iaid) = iaid else {
                return Err("no IA_NA to assign into");
            };
            let life = svc.net.lease_seconds;
            let mut ia_opts = DhcpOptions::new();
            ia_opts.insert(DhcpOption::IAAddr(IAAddr {
                addr: lease.addr(),
                preferred_life: life,
                valid_life: life,
                opts: DhcpOptions::new(),
            }));
            opts.insert(DhcpOption::IANA(IANA {
                id: iaid,
                t1: life / 2,
                t2: life / 5 * 4,
                opts: ia_opts,
            }));
            if mtype == MessageType::Solicit && !rapid {
                MessageType::Advertise
            } else {
                if mtype == MessageType::Solicit {
                    opts.insert(DhcpOption::RapidCommit);
                }
                MessageType::Reply
            }
        }
        MessageType::Confirm => {
            // A client that may have moved (a migrated VM) asks whether
            // its addresses still fit the link (RFC 8415 18.3.3). Here
            // only the VM's own address fits: another VM's, or one from
            // before a re-addressing, is told NotOnLink and solicits
            // again. No address at all: no reply, as the RFC says.
            let confirmed = confirmed_addresses(msg);
            if confirmed.is_empty() {
                return Err("a CONFIRM with no address");
            }
            let on_link = svc
                .v6
                .is_some_and(|lease| confirmed.iter().all(|a| *a == lease.addr()));
            opts.insert(DhcpOption::StatusCode(StatusCode {
                status: if on_link {
                    Status::Success
                } else {
                    Status::NotOnLink
                },
                msg: String::new(),
            }));
            MessageType::Reply
        }
        MessageType::Release | MessageType::Decline => {
            if mtype == MessageType::Decline {
                tracing::warn!(vm = %svc.key, "DHCPv6 DECLINE: the VM reports its address in use");
            }
            opts.insert(DhcpOption::StatusCode(StatusCode {
                status: Status::Success,
                msg: String::new(),
            }));
            MessageType::Reply
        }
        MessageType::InformationRequest => MessageType::Reply,
        _ => return Err("not a client message"),
    };
    if !svc.net.dns6.is_empty() {
        opts.insert(DhcpOption::DomainNameServers(svc.net.dns6.clone()));
    }
    let names: Vec<Name> = svc
        .net
        .search
        .iter()
        .filter_map(|s| Name::from_ascii(s).ok())
        .collect();
    if !names.is_empty() {
        opts.insert(DhcpOption::DomainSearchList(names));
    }

    let mut reply = Message::new_with_id(reply_type, msg.xid());
    reply.set_opts(opts);
    let mut payload = Vec::new();
    reply
        .encode(&mut Encoder::new(&mut payload))
        .map_err(|_| "encoding the reply failed")?;
    let builder = PacketBuilder::ethernet2(svc.net.gw_mac, src_mac)
        .ipv6(svc.net.gw_ll6.octets(), src_ip.octets(), 255)
        .udp(SERVER_PORT, CLIENT_PORT);
    let mut frame = Vec::with_capacity(builder.size(payload.len()));
    builder
        .write(&mut frame, &payload)
        .map_err(|_| "building the reply frame failed")?;
    Ok(frame)
}
