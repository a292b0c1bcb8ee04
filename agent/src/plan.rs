//! Desired map contents for this node, computed from the validated config
//! and the interfaces that exist now. `dataplane` diffs it against the
//! pinned maps.

use std::{collections::BTreeMap, net::IpAddr};

use vmpath_common::{
    ADDR_CLAIMED, ADDR_STATIC, AF_INET, AF_INET6, AddrInfo, AddrKey, ENDPOINT_LOCAL, Endpoint,
    EndpointKey, FloodList, MAX_FLOOD_PORTS, NET_F_DHCP, NET_F_GW4, NET_F_GW6, NetworkInfo,
    PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN, PORT_F_PENDING, PortInfo,
    link_local_from_mac,
};

pub mod north_south;
pub mod overlay;

use crate::{
    config::{AttachmentKey, Config},
    view::Origin,
};

/// A port this node should serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPort {
    pub ifname: String,
    pub ifindex: u32,
    pub attachment: AttachmentKey,
    pub info: PortInfo,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub ports: BTreeMap<u32, PlannedPort>,
    pub endpoints: BTreeMap<EndpointKey, Endpoint>,
    pub addresses: BTreeMap<AddrKey, AddrInfo>,
    pub networks: BTreeMap<u32, NetworkInfo>,
    pub flood: BTreeMap<u32, FloodList>,
    /// Attachments active here whose port does not exist (yet).
    pub missing_ports: Vec<(AttachmentKey, String)>,
    /// Attachments not served because a limit was hit.
    pub problems: Vec<String>,
    /// North-south (`north_south`): routed VM addresses by (0, IP).
    pub routed: BTreeMap<AddrKey, vmpath_common::RoutedAddr>,
    /// (LPM prefix length, subnet) of every network.
    pub subnets4: std::collections::BTreeSet<(u32, vmpath_common::Subnet4)>,
    pub subnets6: std::collections::BTreeSet<(u32, vmpath_common::Subnet6)>,
    pub snat: vmpath_common::SnatConfig,
    /// Overlay (`overlay`): per network, the remote nodes hosting it.
    pub flood_remote: BTreeMap<u32, vmpath_common::RemoteFloodList>,
}

pub fn addr_key(network: u32, ip: IpAddr) -> AddrKey {
    let (family, addr) = match ip {
        IpAddr::V4(v4) => {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&v4.octets());
            (AF_INET, a)
        }
        IpAddr::V6(v6) => (AF_INET6, v6.octets()),
    };
    AddrKey {
        network,
        family,
        _pad: [0; 3],
        addr,
    }
}

/// `ifindex_of` resolves an interface name in this node's namespace.
pub fn plan(cfg: &Config, node: &str, ifindex_of: impl Fn(&str) -> Option<u32>) -> Plan {
    let mut plan = Plan::default();
    for net in &cfg.networks {
        let mut info = NetworkInfo {
            gw_mac: net.gateway_mac,
            mtu: net.mtu,
            gw_ll6: link_local_from_mac(net.gateway_mac),
            ..Default::default()
        };
        if let Some(gw) = net.gateway4() {
            info.flags |= NET_F_GW4;
            info.gw_ip4 = gw.octets();
        }
        if let Some(gw) = net.gateway6() {
            info.flags |= NET_F_GW6;
            info.gw_ip6 = gw.octets();
        }
        if net.ipam {
            // Addresses come from vmpath: it serves DHCP, DHCPv6 and RAs.
            info.flags |= NET_F_DHCP;
        }
        plan.networks.insert(net.id, info);
    }

    // Port ids are small and stable for a given config (the slow path tags
    // frames with them), so number ports in attachment order.
    let mut next_port_id = 1u32;
    for att in &cfg.attachments {
        // Active here, or here as the target of a pending migration.
        let (port_name, pending) = if att.active_node() == node {
            (att.active_port(), false)
        } else if let Some(port) = pending_target_port(att, node) {
            (port, true)
        } else {
            continue;
        };
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        let port_id = next_port_id;
        next_port_id += 1;
        let Some(ifindex) = ifindex_of(port_name) else {
            plan.missing_ports
                .push((att.key.clone(), port_name.to_string()));
            continue;
        };
        let mut flags = 0u16;
        if net.mac_filter {
            flags |= PORT_F_MAC_FILTER;
        }
        if net.ip_filter {
            flags |= PORT_F_IP_FILTER;
        }
        if att.mac_resolved.is_some() {
            flags |= PORT_F_MAC_KNOWN;
        }
        if pending {
            // Not active yet: endpoints keep pointing at the source until
            // the VM speaks here or the cut-over is signalled.
            flags |= PORT_F_PENDING;
        }
        let mac = att.mac_resolved.map(|(m, _)| m).unwrap_or([0; 6]);
        let flood = plan.flood.entry(net.id).or_default();
        if flood.count as usize >= MAX_FLOOD_PORTS {
            plan.problems.push(format!(
                "attachment {} not served: network {:?} has {MAX_FLOOD_PORTS} local ports already",
                att.key, net.name
            ));
            continue;
        }
        flood.ifindex[flood.count as usize] = ifindex;
        flood.count += 1;
        plan.ports.insert(
            ifindex,
            PlannedPort {
                ifname: port_name.to_string(),
                ifindex,
                attachment: att.key.clone(),
                info: PortInfo {
                    port_id,
                    network: net.id,
                    mac,
                    flags,
                },
            },
        );
        if let Some((mac, _)) = att.mac_resolved.filter(|_| !pending) {
            plan.endpoints.insert(
                EndpointKey {
                    network: net.id,
                    mac,
                    _pad: [0; 2],
                },
                Endpoint {
                    kind: ENDPOINT_LOCAL,
                    ifindex,
                    migrate_to: overlay::migrate_to(cfg, att, node),
                    ..Default::default()
                },
            );
        }
        for (ip, origin) in &att.addresses {
            plan.addresses.insert(
                addr_key(net.id, ip.addr()),
                AddrInfo {
                    ifindex,
                    origin: match origin {
                        Origin::Claimed => ADDR_CLAIMED,
                        _ => ADDR_STATIC,
                    },
                    mac,
                    _pad: [0; 2],
                },
            );
        }
    }
    north_south::north_south(cfg, &mut plan);
    overlay::overlay(cfg, node, &mut plan);
    plan
}

/// The port of `att` on `node` when `node` is the target of its pending
/// (not yet cut-over) migration.
pub fn pending_target_port<'a>(att: &'a crate::config::Attachment, node: &str) -> Option<&'a str> {
    match &att.migration {
        Some(m) if !m.ready && m.target_node == node && att.node != node => {
            Some(m.target_port.as_deref().unwrap_or(&att.port))
        }
        _ => None,
    }
}

impl PlannedPort {
    /// The target port of a pending migration: served, but not advertised
    /// or routed to until the cut-over.
    pub fn pending(&self) -> bool {
        self.info.flags & PORT_F_PENDING != 0
    }
}
