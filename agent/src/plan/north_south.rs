//! Desired north-south state: network egress flags, subnets for the egress
//! source check, routed VM addresses for the uplink, and the node's SNAT
//! settings.

use std::net::IpAddr;

use vmpath_common::{
    NET_F_ROUTED, NET_F_SNAT, RoutedAddr, SNAT_DEFAULT_PORT_MAX, SNAT_DEFAULT_PORT_MIN,
    SNAT_DEFAULT_QUOTA, SnatConfig, Subnet4, Subnet6,
};

use super::{Plan, addr_key};
use crate::{config::model::Egress, resolved::Resolved};

pub const SNAT_TCP_TIMEOUT: u32 = 7440;
pub const SNAT_TCP_CLOSING_TIMEOUT: u32 = 240;
pub const SNAT_UDP_TIMEOUT: u32 = 300;
pub const SNAT_ICMP_TIMEOUT: u32 = 60;

/// Is this network's egress routed (un-NATed)? An advertised network is
/// never SNATed.
pub fn routed(net: &crate::config::Network) -> bool {
    net.egress == Egress::Routed || net.advertise.per_vm || net.advertise.subnet
}

pub fn north_south(cfg: &Resolved, plan: &mut Plan) {
    for net in &cfg.config.networks {
        if let Some(info) = plan.networks.get_mut(&net.id) {
            info.flags |= if routed(net) {
                NET_F_ROUTED
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
    let by_key: std::collections::HashMap<
        &crate::config::AttachmentKey,
        &crate::resolved::Attachment,
    > = cfg.attachments.iter().map(|a| (&a.key, a)).collect();
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
        if !routed(net) {
            continue;
        }
        for (ip, _) in &att.addresses {
            plan.routed.insert(
                addr_key(0, ip.addr()),
                RoutedAddr {
                    ifindex: port.ifindex,
                    network: net.id,
                    vm_mac: mac,
                    gw_mac: net.gateway_mac,
                    mtu: net.mtu,
                    // Port ids are at most MAX_PORT_ID (12 bits).
                    port_id: port.info.port_id as u16,
                },
            );
        }
    }
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
