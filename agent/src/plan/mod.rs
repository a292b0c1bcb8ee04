//! Desired map contents for this node, computed from the resolved config
//! and the interfaces that exist now. `dataplane` diffs it against the
//! pinned maps.
//!
//! The plan stage's substance, with what it compiles: [`policy`]
//! (NetworkPolicy), [`service`] (ClusterIP Services), [`handoff`] (the
//! hand-off to the node's stack: its nftables table, which the plan asks
//! about and apply's `routes` keeps), [`north_south`] and [`overlay`].

use std::{collections::BTreeMap, net::IpAddr};

use vmpath_common::{
    ADDR_CLAIMED, ADDR_STATIC, AddrInfo, AddrKey, ENDPOINT_LOCAL, Endpoint, EndpointKey, FloodList,
    MAX_FLOOD_PORTS, MAX_PORT_ID, NET_F_DHCP, NET_F_GW4, NET_F_GW6, NET_F_IP_FILTER, NetworkInfo,
    PORT_F_DHCP, PORT_F_DHCP_GUARD, PORT_F_IP_FILTER, PORT_F_MAC_FILTER, PORT_F_MAC_KNOWN,
    PORT_F_PENDING, PortInfo, link_local_from_mac,
};

pub mod handoff;
pub mod layered;
pub mod north_south;
pub mod overlay;
pub mod policy;
pub mod service;

use crate::{
    config::AttachmentKey,
    resolve::resolved::{Attachment, Origin, Resolved},
};

/// A port this node should serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedPort {
    pub ifname: String,
    pub ifindex: u32,
    pub attachment: AttachmentKey,
    pub info: PortInfo,
    /// Its network's slow-path limits (`vmp_slow_limits`).
    pub slow_limits: vmpath_common::SlowLimits,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub ports: BTreeMap<u32, PlannedPort>,
    /// This node's endpoints over other nodes' (`layered`).
    pub endpoints: layered::Layered<EndpointKey, Endpoint>,
    /// This node's VMs' addresses over other nodes'.
    pub addresses: layered::Layered<AddrKey, AddrInfo>,
    pub networks: BTreeMap<u32, NetworkInfo>,
    pub flood: BTreeMap<u32, FloodList>,
    /// Attachments active here whose port does not exist (yet).
    pub missing_ports: Vec<(AttachmentKey, String)>,
    /// Attachments not served because a limit was hit.
    pub problems: Vec<String>,
    /// North-south (`north_south`): routed VM addresses by (0, IP); other
    /// nodes' VMs' in the shared layer (`overlay::Cache`).
    pub routed: layered::Layered<AddrKey, vmpath_common::RoutedAddr>,
    /// (LPM prefix length, subnet) of every network -> 1; under
    /// `PRIMARY_SUBNETS`, the Primary networks' subnets -> their network's id.
    pub subnets4: BTreeMap<(u32, vmpath_common::Subnet4), u32>,
    pub subnets6: BTreeMap<(u32, vmpath_common::Subnet6), u32>,
    pub snat: vmpath_common::SnatConfig,
    /// Subnets of the learning ingress networks this node hosts, (LPM
    /// prefix length, prefix) -> network id: the uplink resolves an
    /// address there that nothing places over the overlay.
    pub resolve_prefixes: BTreeMap<(u32, vmpath_common::ResolvePrefix), u32>,
    /// Overlay (`overlay`): per network, the remote nodes hosting it.
    pub flood_remote: BTreeMap<u32, vmpath_common::RemoteFloodList>,
    /// Overlay on an IPv6 underlay: each other node's IPv6 address -> the
    /// 4-byte VTEP handle the data path knows it by (`vmp_vtep6`,
    /// `vmp_vtep6_ids`; `overlay::vtep_handles`). Empty on IPv4.
    pub vteps6: BTreeMap<std::net::Ipv6Addr, [u8; 4]>,
    /// Reach (`vmp_reach_nodes`): every other node's VTEP value, the only
    /// senders of `REACH_VNI` frames taken.
    pub reach_nodes: BTreeMap<[u8; 4], u32>,
    /// Networks with routed ingress this node hosts (a VM of it is served
    /// here, or a migration on it starts or ends here): it routes their
    /// VMs' addresses and advertises their subnets (`advertise.subnet`).
    pub ingress_hosted: std::collections::BTreeSet<u32>,
    /// NetworkPolicy (`policy`): identities, rules, isolated endpoints.
    pub policy: crate::plan::policy::Compiled,
    /// ClusterIP Services (`service`): Service ports and their backends.
    pub services: crate::plan::service::Compiled,
}

/// The `vmp_addresses` key of `ip` in `network` (`AddrKey::from_ip`).
pub fn addr_key(network: u32, ip: IpAddr) -> AddrKey {
    AddrKey::from_ip(network, ip)
}

/// `ifindex_of` resolves an interface name in this node's namespace.
pub fn plan(cfg: &Resolved, node: &str, ifindex_of: impl Fn(&str) -> Option<u32>) -> Plan {
    plan_with_ids(cfg, node, ifindex_of, &BTreeMap::new())
}

/// The port this node serves for `att`, and whether it is a pending
/// migration target.
fn local_port<'a>(att: &'a Attachment, node: &str) -> Option<(&'a str, bool)> {
    if att.elsewhere {
        return None;
    }
    if att.active_node() == node {
        Some((att.active_port(), false))
    } else {
        pending_target_port(att, node).map(|p| (p, true))
    }
}

/// Port ids stay with their VM interface across reconciles and restarts
/// (`previous`); new ones take the smallest free id. The slow path tags
/// frames with them, so a renumbering could hand one VM's DHCP reply to
/// another; and they must fit the 12-bit tag.
fn port_ids<'a>(
    cfg: &'a Resolved,
    node: &str,
    previous: &BTreeMap<AttachmentKey, u32>,
    problems: &mut Vec<String>,
) -> crate::sys::hash::HashMap<&'a AttachmentKey, u32> {
    let local: Vec<&AttachmentKey> = cfg
        .local_entries()
        .filter(|a| local_port(a, node).is_some())
        .map(|a| &a.key)
        .collect();
    let mut used = crate::sys::hash::HashSet::default();
    let mut ids = crate::sys::hash::HashMap::default();
    for key in &local {
        if let Some(&id) = previous.get(*key)
            && (1..=MAX_PORT_ID).contains(&id)
            && used.insert(id)
        {
            ids.insert(*key, id);
        }
    }
    let mut next = 1u32;
    for key in local {
        if ids.contains_key(key) {
            continue;
        }
        while used.contains(&next) {
            next += 1;
        }
        if next > MAX_PORT_ID {
            problems.push(format!("attachment {key} not served: no free port id (at most {MAX_PORT_ID} ports per node)"));
            continue;
        }
        used.insert(next);
        ids.insert(key, next);
    }
    ids
}

/// As [`plan`], keeping the port ids of `previous` (VM interface -> id).
pub fn plan_with_ids(
    cfg: &Resolved,
    node: &str,
    ifindex_of: impl Fn(&str) -> Option<u32>,
    previous: &BTreeMap<AttachmentKey, u32>,
) -> Plan {
    plan_with_previous(
        cfg,
        node,
        ifindex_of,
        previous,
        &BTreeMap::new(),
        &BTreeMap::new(),
        &mut overlay::Cache::default(),
    )
}

/// As [`plan_with_ids`], also keeping the Service ports the data path
/// holds (`previous_services`: key -> id) ahead of new ones, and the IPv6
/// underlay's VTEP handles (`previous_vteps6`); other nodes' part taken
/// from `cache` where it still holds (`overlay::Cache`), and left there
/// for the next plan.
pub fn plan_with_previous(
    cfg: &Resolved,
    node: &str,
    ifindex_of: impl Fn(&str) -> Option<u32>,
    previous: &BTreeMap<AttachmentKey, u32>,
    previous_services: &BTreeMap<crate::plan::service::PortKey, u32>,
    previous_vteps6: &BTreeMap<std::net::Ipv6Addr, [u8; 4]>,
    cache: &mut overlay::Cache,
) -> Plan {
    let mut phases = crate::sys::phases::Phases::start("plan");
    let mut plan = Plan {
        vteps6: overlay::vtep_handles(cfg, node, previous_vteps6),
        ..Plan::default()
    };
    for net in &cfg.config.networks {
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
        if net.ip_filter {
            info.flags |= NET_F_IP_FILTER;
        }
        plan.networks.insert(net.id, info);
    }

    let ids = port_ids(cfg, node, previous, &mut plan.problems);
    phases.mark("port_ids");
    // Ports programmed before come first: where a network's flood list is
    // full, a new port is the one refused, never a running one displaced.
    // Active here, or here as the target of a pending migration: those
    // alone are ordered (a lookup each), not every VM interface.
    let mut ordered: Vec<_> = cfg
        .local_entries()
        .filter_map(|a| local_port(a, node).map(|(port, pending)| (a, port, pending)))
        .collect();
    ordered.sort_by_key(|(a, _, _)| !previous.contains_key(&a.key));
    for (att, port_name, pending) in ordered {
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        let Some(&port_id) = ids.get(&att.key) else {
            continue;
        };
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
        if net.ipam {
            // The port-level copy of NET_F_DHCP: decided without a network lookup.
            flags |= PORT_F_DHCP;
        }
        if net.dhcp_guard {
            flags |= PORT_F_DHCP_GUARD;
        }
        if pending {
            // Not active yet: endpoints keep pointing at the source until
            // the VM speaks here or the cut-over is signalled.
            flags |= PORT_F_PENDING;
        }
        let mac = att.mac_resolved.map(|(m, _)| m).unwrap_or([0; 6]);
        let (ip4, ip6) = first_addrs(&att.addresses);
        let flood = plan.flood.entry(net.id).or_default();
        if flood.count as usize >= MAX_FLOOD_PORTS {
            plan.problems.push(format!(
                "attachment {} not served: network {:?} has {MAX_FLOOD_PORTS} local ports already",
                att.key, net.name
            ));
            continue;
        }
        flood.ifindex[flood.count as usize] = ifindex;
        flood.port_id[flood.count as usize] = port_id;
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
                    gw_mac: net.gateway_mac,
                    _pad: 0,
                    ip4,
                    ip6,
                },
                slow_limits: net.slow_limits(),
            },
        );
        if let Some((mac, _)) = att.mac_resolved.filter(|_| !pending) {
            plan.endpoints.insert(
                EndpointKey::new(net.id, mac),
                Endpoint {
                    kind: ENDPOINT_LOCAL,
                    ifindex,
                    migrate_to: overlay::migrate_to(cfg, &plan.vteps6, att, node),
                    port_id,
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
                    port_id,
                    node_ip4: [0; 4],
                },
            );
        }
    }
    phases.mark("ports");
    // The overlay first: north-south's routed entries of other nodes' VMs
    // are kept beside its part, and built again with it.
    overlay::overlay(cfg, node, &mut plan, cache);
    phases.mark("overlay");
    north_south::north_south(cfg, node, &mut plan, cache);
    phases.mark("north_south");
    let local: BTreeMap<AttachmentKey, u32> = plan
        .ports
        .values()
        .map(|p| (p.attachment.clone(), p.info.port_id))
        .collect();
    plan.policy = crate::plan::policy::compile(cfg, &local);
    plan.policy.guard_floods(&plan.flood);
    phases.mark("policy");
    overlay::endpoint_identities(cfg, node, &mut plan, cache);
    phases.mark("identities");
    plan.problems.extend(plan.policy.problems.iter().cloned());
    let local_networks: std::collections::BTreeSet<u32> =
        plan.ports.values().map(|p| p.info.network).collect();
    plan.services = crate::plan::service::compile(
        &cfg.config,
        &plan.addresses,
        &local_networks,
        previous_services,
    );
    plan.problems.extend(plan.services.problems.iter().cloned());
    phases.mark("services");
    phases.log();
    plan
}

/// The first IPv4 and the first IPv6 address of an attachment (zero:
/// none), cached in its port entry for the spoof filter.
fn first_addrs(addresses: &[(ipnet::IpNet, Origin)]) -> ([u8; 4], [u8; 16]) {
    let (mut v4, mut v6) = (None, None);
    for (ip, _) in addresses {
        match ip.addr() {
            std::net::IpAddr::V4(a) => v4 = v4.or(Some(a.octets())),
            std::net::IpAddr::V6(a) => v6 = v6.or(Some(a.octets())),
        }
    }
    (v4.unwrap_or([0; 4]), v6.unwrap_or([0; 16]))
}

/// The port of `att` on `node` when `node` is the target of its pending
/// (not yet cut-over) migration.
pub fn pending_target_port<'a>(att: &'a Attachment, node: &str) -> Option<&'a str> {
    match &att.migration {
        Some(m) if !att.cut_over && m.target_node == node && att.node != node => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn cfg_with(vms: &[&str]) -> Resolved {
        let mut docs = String::from(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec: {id: 100, subnets: [10.20.0.0/16], ipam: {mode: Disabled}}\n",
        );
        for (i, vm) in vms.iter().enumerate() {
            docs.push_str(&format!(
                "---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}, namespace: prod}}\nspec: {{vm: {vm}, interface: eth0, network: blue, node: a, port: p-{vm}, mac: '52:54:00:00:00:{i:02x}'}}\n"
            ));
        }
        let dir = std::env::temp_dir().join(format!(
            "vmpath-plan-ids-{}-{}",
            std::process::id(),
            vms.join("-")
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ))
    }

    fn ids(plan: &Plan) -> BTreeMap<String, u32> {
        plan.ports
            .values()
            .map(|p| (p.attachment.vm.to_string(), p.info.port_id))
            .collect()
    }

    /// A port keeps its id when another attachment goes away, and a new one
    /// takes the freed id: the slow path's tags never point at another VM.
    #[test]
    fn port_ids_stay_with_their_vm_interface() {
        // Interfaces' ifindexes by name (p-vm1 -> 11, ...).
        let ifindex = |name: &str| {
            name.strip_prefix("p-vm")
                .and_then(|n| n.parse::<u32>().ok())
                .map(|n| 10 + n)
        };
        let first = plan(&cfg_with(&["vm1", "vm2", "vm3"]), "a", ifindex);
        assert_eq!(
            ids(&first),
            BTreeMap::from([("vm1".into(), 1), ("vm2".into(), 2), ("vm3".into(), 3)])
        );
        let previous: BTreeMap<AttachmentKey, u32> = first
            .ports
            .values()
            .map(|p| (p.attachment.clone(), p.info.port_id))
            .collect();
        let second = plan_with_ids(&cfg_with(&["vm2", "vm3", "vm4"]), "a", ifindex, &previous);
        assert_eq!(
            ids(&second),
            BTreeMap::from([("vm2".into(), 2), ("vm3".into(), 3), ("vm4".into(), 1)])
        );
    }

    /// A network's flood list holds MAX_FLOOD_PORTS local ports: a port
    /// added to a full network is refused (named in the problems), and
    /// none of the programmed ones is displaced, whatever the names' order.
    #[test]
    fn a_new_port_never_displaces_a_programmed_one() {
        let cfg = |n: std::ops::RangeInclusive<usize>| {
            let mut snap = config::source::Snapshot::default();
            snap.documents.push(config::source::RawDocument {
                file: std::path::Path::new("c.yaml").into(),
                index: 1,
                origin: crate::config::DocOrigin::Given,
                value: serde_json::json!({"apiVersion": "vmpath.dev/v1alpha1", "kind": "Network",
                    "metadata": {"name": "blue"}, "spec": {"id": 100, "subnets": ["10.20.0.0/16"], "ipam": {"mode": "Disabled"}}}).into(),
            });
            for i in n {
                snap.documents.push(config::source::RawDocument {
                    file: std::path::Path::new("c.yaml").into(),
                    index: i + 2,
                    origin: crate::config::DocOrigin::Given,
                    value: serde_json::json!({"apiVersion": "vmpath.dev/v1alpha1", "kind": "Attachment",
                        "metadata": {"name": format!("vm{i:02}"), "namespace": "prod"},
                        "spec": {"vm": format!("vm{i:02}"), "interface": "eth0", "network": "blue", "node": "a",
                            "port": format!("p-vm{i:02}"), "mac": format!("52:54:00:00:{:02x}:{:02x}", i / 256, i % 256)}}).into(),
                });
            }
            Resolved::new(crate::round::validate(
                &snap,
                "a",
                &crate::config::AcceptedKeys::new(),
            ))
        };
        let ifindex = |name: &str| {
            name.strip_prefix("p-vm")
                .and_then(|n| n.parse::<u32>().ok())
                .map(|n| 10 + n)
        };
        let full = plan(&cfg(1..=MAX_FLOOD_PORTS), "a", ifindex);
        assert_eq!(full.ports.len(), MAX_FLOOD_PORTS);
        let previous: BTreeMap<AttachmentKey, u32> = full
            .ports
            .values()
            .map(|p| (p.attachment.clone(), p.info.port_id))
            .collect();
        // vm00 sorts before every programmed one.
        let more = plan_with_ids(&cfg(0..=MAX_FLOOD_PORTS), "a", ifindex, &previous);
        assert_eq!(
            ids(&more),
            ids(&full),
            "the programmed ports stay as they are"
        );
        assert!(
            more.problems
                .iter()
                .any(|p| p.starts_with("attachment prod/vm00/eth0 not served")),
            "{:?}",
            more.problems
        );
    }

    /// The config of `network_spec` (one Network "blue" with one VM on it).
    fn cfg_of(tag: &str, network_spec: &str) -> Resolved {
        let docs = format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: blue}}\nspec: {network_spec}\n---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm1, namespace: prod}}\nspec: {{vm: vm1, interface: eth0, network: blue, node: a, port: p-vm1, mac: '52:54:00:00:00:01'}}\n"
        );
        let dir = std::env::temp_dir().join(format!("vmpath-plan-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ))
    }

    fn port_flags(cfg: &Resolved) -> u16 {
        let plan = plan(cfg, "a", |_| Some(7));
        plan.ports[&7].info.flags
    }

    /// The DHCP guard is on where vmpath serves DHCP, off on an IPAM-less
    /// network unless `portSecurity.dhcpGuard` says so, and cannot be
    /// switched off where vmpath serves DHCP.
    #[test]
    fn dhcp_guard_follows_ipam_and_port_security() {
        let ipam = cfg_of(
            "ipam",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Enabled}}",
        );
        assert_ne!(port_flags(&ipam) & PORT_F_DHCP_GUARD, 0);
        let plain = cfg_of(
            "plain",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Disabled}}",
        );
        assert_eq!(port_flags(&plain) & PORT_F_DHCP_GUARD, 0);
        let guarded = cfg_of(
            "guarded",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Disabled}, portSecurity: {dhcpGuard: true}}",
        );
        assert_ne!(port_flags(&guarded) & PORT_F_DHCP_GUARD, 0);
        let refused = cfg_of(
            "refused",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Enabled}, portSecurity: {dhcpGuard: false}}",
        );
        assert!(
            refused.config.networks.is_empty(),
            "{:?}",
            refused.config.networks
        );
        let err = &refused.errors[0];
        assert_eq!(err.field, "spec.portSecurity.dhcpGuard", "{err:?}");
        assert!(err.message.contains("ipam.mode Enabled"), "{err:?}");
    }

    /// The network entry says whether its ports filter source IPs: frames
    /// from its VMs on other nodes get the same checks in `vxlan_rx`.
    #[test]
    fn ip_filter_reaches_the_network_entry() {
        let ipam = cfg_of(
            "netf",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Enabled}}",
        );
        let plan = plan(&ipam, "a", |_| Some(7));
        assert_ne!(plan.networks[&100].flags & NET_F_IP_FILTER, 0);
        let off = cfg_of(
            "netf-off",
            "{id: 100, subnets: [10.20.0.0/16], ipam: {mode: Enabled}, portSecurity: {ip: false}}",
        );
        let plan = super::plan(&off, "a", |_| Some(7));
        assert_eq!(plan.networks[&100].flags & NET_F_IP_FILTER, 0);
    }
}
