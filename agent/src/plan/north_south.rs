//! Desired north-south state: network egress flags, subnets for the egress
//! source check, routed VM addresses for the uplink, and the node's SNAT
//! settings.
//!
//! Routed ingress (`egress: Routed`, or `egress: SNAT` with `advertise`):
//! every node hosting the network routes the VMs' addresses. Those of a
//! VM served here go straight to its port; those of a VM on another node,
//! and of a VM whose migration is under way from here, follow
//! `vmp_endpoints` in the data path (delivered locally or relayed over the
//! overlay), so ingress reaches the VM whichever node the fabric picks
//! and through a cut-over before BGP converges.

use std::net::IpAddr;

use vmpath_common::{
    NET_F_INGRESS, NET_F_ROUTED, NET_F_SNAT, ROUTED_F_INBOUND, RoutedAddr, SNAT_DEFAULT_PORT_MAX,
    SNAT_DEFAULT_PORT_MIN, SNAT_DEFAULT_QUOTA, SnatConfig, Subnet4, Subnet6,
};

use super::{Plan, addr_key};
use crate::{
    config::{Network, model::Egress},
    resolved::Resolved,
};

pub const SNAT_TCP_TIMEOUT: u32 = 7440;
pub const SNAT_TCP_CLOSING_TIMEOUT: u32 = 240;
pub const SNAT_UDP_TIMEOUT: u32 = 300;
pub const SNAT_ICMP_TIMEOUT: u32 = 60;

/// Is this network's egress routed (un-NATed)?
pub fn routed(net: &Network) -> bool {
    net.egress == Egress::Routed
}

/// Does the fabric reach this network's VMs by their own addresses?
/// Routed networks always; SNAT networks when they advertise anything.
pub fn ingress(net: &Network) -> bool {
    routed(net) || net.advertise.per_vm || net.advertise.subnet || net.advertise.learned
}

/// Does routed ingress on this network carry `ip`'s family? SNAT is IPv4
/// only, so a SNAT network's IPv6 VMs could not answer un-NATed replies'
/// peers: their IPv6 addresses are neither routed to nor advertised.
pub fn ingress_family(net: &Network, ip: IpAddr) -> bool {
    ingress(net) && (routed(net) || ip.is_ipv4())
}

pub fn north_south(cfg: &Resolved, plan: &mut Plan) {
    for net in &cfg.config.networks {
        if let Some(info) = plan.networks.get_mut(&net.id) {
            info.flags |= if routed(net) {
                NET_F_ROUTED
            } else if ingress(net) {
                NET_F_SNAT | NET_F_INGRESS
            } else {
                NET_F_SNAT
            };
        }
        for s in &net.subnets {
            let s = s.trunc();
            match s.addr() {
                IpAddr::V4(a) => {
                    plan.subnets4.insert((
                        32 + u32::from(s.prefix_len()),
                        Subnet4 {
                            network: net.id.to_be_bytes(),
                            addr: a.octets(),
                        },
                    ));
                }
                IpAddr::V6(a) => {
                    plan.subnets6.insert((
                        32 + u32::from(s.prefix_len()),
                        Subnet6 {
                            network: net.id.to_be_bytes(),
                            addr: a.octets(),
                        },
                    ));
                }
            }
        }
    }
    routed_addresses(cfg, plan);
    let snat_addr =
        cfg.config
            .node
            .as_ref()
            .and_then(|n| match n.snat_address.unwrap_or(n.address) {
                IpAddr::V4(a) => Some(a.octets()),
                IpAddr::V6(_) => None,
            });
    plan.snat = SnatConfig {
        addr4: snat_addr.unwrap_or([0; 4]),
        uplink: 0,
        port_min: SNAT_DEFAULT_PORT_MIN,
        port_max: SNAT_DEFAULT_PORT_MAX,
        quota: SNAT_DEFAULT_QUOTA,
        tcp_timeout: SNAT_TCP_TIMEOUT,
        tcp_closing_timeout: SNAT_TCP_CLOSING_TIMEOUT,
        udp_timeout: SNAT_UDP_TIMEOUT,
        icmp_timeout: SNAT_ICMP_TIMEOUT,
    };
}

/// `vmp_routed`: the addresses of the ingress networks' VMs (configured,
/// and learned from their traffic here), on every node hosting the
/// network.
fn routed_addresses(cfg: &Resolved, plan: &mut Plan) {
    let by_key: std::collections::HashMap<
        &crate::config::AttachmentKey,
        &crate::resolved::Attachment,
    > = cfg.attachments.iter().map(|a| (&a.key, a)).collect();
    let entry = |net: &Network, mac: [u8; 6], ifindex: u32, port_id: u32| RoutedAddr {
        ifindex,
        network: net.id,
        vm_mac: mac,
        gw_mac: net.gateway_mac,
        mtu: net.mtu,
        // Port ids are at most MAX_PORT_ID (12 bits): room for the flag.
        port_id: port_id as u16 | if routed(net) { 0 } else { ROUTED_F_INBOUND },
    };
    for port in plan.ports.values().filter(|p| !p.pending()) {
        let Some(att) = by_key.get(&port.attachment).copied() else {
            continue;
        };
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        let Some((mac, _)) = att.mac_resolved else {
            continue;
        };
        if !ingress(net) {
            continue;
        }
        // The source of a migration under way: where the VM is follows
        // the endpoint, which the data path repoints at the cut-over.
        let migrating = att.migration.is_some() && !att.cut_over;
        let ifindex = if migrating { 0 } else { port.ifindex };
        let r = entry(net, mac, ifindex, port.info.port_id);
        for (ip, _) in &att.addresses {
            if ingress_family(net, ip.addr()) {
                plan.routed.insert(addr_key(0, ip.addr()), r);
            }
        }
        // Addresses the VM uses that no document gives (a network without
        // IPAM): known from its traffic, here only. A configured one wins.
        for (key, seen) in &cfg.learned_ips {
            if key.network == net.id
                && seen.ifindex == port.ifindex
                && ingress_family(net, key.ip())
            {
                plan.routed.entry(addr_key(0, key.ip())).or_insert(r);
            }
        }
    }
    // VMs on other nodes, where this node hosts their network too: the
    // fabric may send their traffic here (the subnet route of every
    // hosting node); it goes on over the overlay. Only where every node
    // knows the VM's MAC (given or generated; see `overlay`).
    for att in &cfg.attachments {
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        if !ingress(net) || !plan.flood.contains_key(&net.id) {
            continue;
        }
        if plan
            .ports
            .values()
            .any(|p| p.attachment == att.key && !p.pending())
        {
            continue;
        }
        let known = match att.mac_resolved {
            Some((mac, _))
                if att.mac.is_some()
                    || att.mac_policy == crate::config::model::MacPolicy::Generate =>
            {
                mac
            }
            _ => continue,
        };
        let r = entry(net, known, 0, 0);
        for (ip, _) in &att.addresses {
            if ingress_family(net, ip.addr()) {
                plan.routed.entry(addr_key(0, ip.addr())).or_insert(r);
            }
        }
    }
}
