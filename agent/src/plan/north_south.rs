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
    CLUSTER_NETWORK, NET_F_INGRESS, NET_F_IP_FILTER, NET_F_ROUTED, NET_F_SNAT, PRIMARY_SUBNETS,
    ROUTED_F_INBOUND, ResolvePrefix, RoutedAddr, SNAT_DEFAULT_PORT_MAX, SNAT_DEFAULT_PORT_MIN,
    SNAT_DEFAULT_QUOTA, SnatConfig, Subnet4, Subnet6,
};

use super::{Plan, addr_key};
use crate::{
    config::{Network, model::Egress},
    resolve::resolved::Resolved,
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
/// (`Network::ingress_routed`, the one home of the rule.)
pub fn ingress(net: &Network) -> bool {
    net.ingress_routed()
}

/// Does routed ingress on this network carry `ip`'s family? Both: a SNAT
/// network's VMs answer inbound flows un-NATed over IPv4 and IPv6 alike
/// (the data path records them in `vmp_inbound` / `vmp_inbound6`).
pub fn ingress_family(net: &Network, _ip: IpAddr) -> bool {
    ingress(net)
}

pub fn north_south(cfg: &Resolved, node: &str, plan: &mut Plan, cache: &mut super::overlay::Cache) {
    for net in &cfg.config.networks {
        if let Some(info) = plan.networks.get_mut(&net.id) {
            info.flags |= if routed(net) {
                NET_F_ROUTED
            } else if ingress(net) {
                NET_F_SNAT | NET_F_INGRESS
            } else {
                NET_F_SNAT
            };
            if net.role == crate::config::model::Role::Primary {
                info.flags |= vmpath_common::NET_F_HOST_REACH;
            }
        }
        for s in &net.subnets {
            insert_subnet(plan, net.id, *s, 1);
            // Reach: an address's Primary network, for the stack's frames
            // to it and from it over the overlay (`ebpf/src/reach.rs`).
            if net.role == crate::config::model::Role::Primary {
                insert_subnet(plan, PRIMARY_SUBNETS, *s, net.id);
            }
        }
    }
    cluster_destinations(cfg, plan);
    for net in cfg.config.networks.iter().filter(|n| ingress(n)) {
        // Only entries whose documents name a migration are read
        // (`Resolved::moving`: not every VM interface).
        let migration_end = cfg
            .moving
            .iter()
            .map(|&j| &cfg.attachments[j as usize])
            .any(|a| {
                a.network == net.name
                    && a.migration
                        .as_ref()
                        .is_some_and(|m| a.node == node || m.target_node == node)
            });
        if plan.flood.contains_key(&net.id) || migration_end {
            plan.ingress_hosted.insert(net.id);
        }
    }
    resolve_prefixes(cfg, plan);
    routed_addresses(cfg, plan, cache);
    let node_cfg = cfg.config.node.as_ref();
    let snat_addr = node_cfg.and_then(|n| match n.snat_address.unwrap_or(n.address) {
        IpAddr::V4(a) => Some(a.octets()),
        IpAddr::V6(_) => None,
    });
    // IPv6: `snatAddress6`, else whichever of `snatAddress` and `address`
    // is IPv6.
    let snat_addr6 = node_cfg.and_then(|n| {
        n.snat_address6.or_else(|| {
            [n.snat_address, Some(n.address)]
                .into_iter()
                .flatten()
                .find_map(|a| match a {
                    IpAddr::V6(a) => Some(a),
                    IpAddr::V4(_) => None,
                })
        })
    });
    plan.snat = SnatConfig {
        addr4: snat_addr.unwrap_or([0; 4]),
        addr6: snat_addr6.map_or([0; 16], |a| a.octets()),
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

/// `(network, subnet) -> value` into `vmp_subnets4` or `vmp_subnets6`.
fn insert_subnet(plan: &mut Plan, network: u32, s: ipnet::IpNet, value: u32) {
    let s = s.trunc();
    match s.addr() {
        IpAddr::V4(a) => {
            plan.subnets4.insert(
                (
                    32 + u32::from(s.prefix_len()),
                    Subnet4 {
                        network: network.to_be_bytes(),
                        addr: a.octets(),
                    },
                ),
                value,
            );
        }
        IpAddr::V6(a) => {
            plan.subnets6.insert(
                (
                    32 + u32::from(s.prefix_len()),
                    Subnet6 {
                        network: network.to_be_bytes(),
                        addr: a.octets(),
                    },
                ),
                value,
            );
        }
    }
}

/// The cluster's own address spaces under [`CLUSTER_NETWORK`]: its pod and
/// Service CIDRs and every node's address. An endpoint of a Primary
/// network hands its traffic to these to the node's stack, where
/// kube-proxy translates Services and the node routes to other nodes'
/// pods. Written only when a Primary network exists (nothing else asks)
/// and the hand-off's nftables table is in place (`handoff::written`):
/// without its rules the hand-off would open a way past policy.
fn cluster_destinations(cfg: &Resolved, plan: &mut Plan) {
    let primary = cfg
        .config
        .networks
        .iter()
        .any(|n| n.role == crate::config::model::Role::Primary);
    if !primary || !crate::plan::handoff::written() {
        return;
    }
    for c in &cfg.config.cluster_cidrs {
        insert_subnet(plan, CLUSTER_NETWORK, c.cidr, 1);
    }
    for n in cfg.config.nodes.values() {
        insert_subnet(plan, CLUSTER_NETWORK, ipnet::IpNet::from(n.address), 1);
    }
}

/// `vmp_resolve_prefixes`: the subnets of the ingress networks this node
/// hosts whose ports do not filter source addresses (so learn them): an
/// address there that no entry places may be a VM's on another node,
/// known only there, and is resolved over the overlay.
fn resolve_prefixes(cfg: &Resolved, plan: &mut Plan) {
    for net in &cfg.config.networks {
        let learns = plan
            .networks
            .get(&net.id)
            .is_some_and(|i| i.flags & NET_F_IP_FILTER == 0);
        if !plan.ingress_hosted.contains(&net.id) || !learns {
            continue;
        }
        for s in &net.subnets {
            let s = s.trunc();
            let key = match s.addr() {
                IpAddr::V4(a) => ResolvePrefix::v4(a.octets(), u32::from(s.prefix_len())),
                IpAddr::V6(a) => (
                    u32::from(s.prefix_len()),
                    ResolvePrefix { addr: a.octets() },
                ),
            };
            plan.resolve_prefixes.insert(key, net.id);
        }
    }
}

/// The routed entry of a VM on `net` with MAC `mac` behind `ifindex`
/// (0: on another node, over the overlay) and `port_id`.
fn routed_entry(net: &Network, mac: [u8; 6], ifindex: u32, port_id: u32) -> RoutedAddr {
    RoutedAddr {
        ifindex,
        network: net.id,
        vm_mac: mac,
        gw_mac: net.gateway_mac,
        mtu: net.mtu,
        // Port ids are at most MAX_PORT_ID (12 bits): room for the flag.
        port_id: port_id as u16 | if routed(net) { 0 } else { ROUTED_F_INBOUND },
    }
}

/// The MAC every node knows `att` by (given or generated; see `overlay`),
/// on a network whose ingress this node hosts.
fn routed_remotely<'a>(
    cfg: &'a Resolved,
    plan: &Plan,
    att: &crate::resolve::resolved::Attachment,
) -> Option<(&'a Network, [u8; 6])> {
    let net = cfg.network(&att.network)?;
    if !plan.ingress_hosted.contains(&net.id) {
        return None;
    }
    match att.mac_resolved {
        Some((mac, _))
            if att.mac.is_some() || att.mac_policy == crate::config::model::MacPolicy::Generate =>
        {
            Some((net, mac))
        }
        _ => None,
    }
}

/// `vmp_routed`: the addresses of the ingress networks' VMs (configured,
/// and learned from their traffic here), on every node hosting the
/// network. This node's (its ports', and those of its VM interfaces
/// without a port yet) are planned each round; other nodes' VMs' are
/// the layer kept in `cache` while nothing they come from changed.
fn routed_addresses(cfg: &Resolved, plan: &mut Plan, cache: &mut super::overlay::Cache) {
    let mut local = std::collections::BTreeMap::new();
    for port in plan.ports.values().filter(|p| !p.pending()) {
        // Looked up per port (the attachments are in key order), not a
        // map of every VM interface of the cluster built each round.
        let Some(att) = cfg.attachment(&port.attachment) else {
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
        let r = routed_entry(net, mac, ifindex, port.info.port_id);
        for (ip, _) in &att.addresses {
            if ingress_family(net, ip.addr()) {
                local.insert(addr_key(0, ip.addr()), r);
            }
        }
        // Addresses the VM uses that no document gives (a network without
        // IPAM): known from its traffic, here only. A configured one wins.
        for (key, seen) in &cfg.learned_ips {
            if key.network == net.id
                && seen.ifindex == port.ifindex
                && ingress_family(net, key.ip())
            {
                local.entry(addr_key(0, key.ip())).or_insert(r);
            }
        }
    }
    // VMs not served here, where this node hosts their network too: the
    // fabric may send their traffic here (the subnet route of every
    // hosting node, or the per-VM route of a migration's source before
    // the fabric converges); it goes on over the overlay. Only where every
    // node knows the VM's MAC (given or generated; see `overlay`). Those
    // of other nodes are the kept layer; this node's without a port (a
    // few) are planned here.
    let served: crate::sys::hash::HashSet<&crate::config::AttachmentKey> = plan
        .ports
        .values()
        .filter(|p| !p.pending())
        .map(|p| &p.attachment)
        .collect();
    let remote = cache.routed(&plan.ingress_hosted, || {
        let mut out = super::overlay::RemoteRouted::default();
        let mut entries = std::collections::BTreeMap::new();
        for att in cfg.attachments.iter().filter(|a| a.elsewhere) {
            let Some((net, mac)) = routed_remotely(cfg, plan, att) else {
                continue;
            };
            let r = routed_entry(net, mac, 0, 0);
            for (ip, _) in &att.addresses {
                if ingress_family(net, ip.addr()) {
                    entries.entry(addr_key(0, ip.addr())).or_insert(r);
                }
            }
            out.by_mac.entry((net.id, mac)).or_insert(r);
        }
        out.entries = std::sync::Arc::new(entries);
        out
    });
    let mut here_unserved: std::collections::BTreeMap<(u32, [u8; 6]), RoutedAddr> =
        std::collections::BTreeMap::new();
    for att in cfg
        .local_entries()
        .filter(|a| !a.elsewhere && !served.contains(&a.key))
    {
        let Some((net, mac)) = routed_remotely(cfg, plan, att) else {
            continue;
        };
        let r = routed_entry(net, mac, 0, 0);
        for (ip, _) in &att.addresses {
            let key = addr_key(0, ip.addr());
            if ingress_family(net, ip.addr()) && !remote.entries.contains_key(&key) {
                local.entry(key).or_insert(r);
            }
        }
        here_unserved.entry((net.id, mac)).or_insert(r);
    }
    // Addresses this node learned from such a VM while it was here (a
    // migration's source after the cut-over): the fabric may still send
    // them here until its route moves. Kept while so routed
    // (`Dataplane::apply` keeps such learned entries). A configured one
    // wins.
    for (key, seen) in &cfg.learned_ips {
        let k = addr_key(0, key.ip());
        let Some(r) = here_unserved
            .get(&(key.network, seen.mac))
            .or_else(|| remote.by_mac.get(&(key.network, seen.mac)))
        else {
            continue;
        };
        let Some(net) = cfg.config.networks.iter().find(|n| n.id == key.network) else {
            continue;
        };
        if ingress_family(net, key.ip()) && !remote.entries.contains_key(&k) {
            local.entry(k).or_insert(*r);
        }
    }
    plan.routed = super::layered::Layered {
        local,
        remote: remote.entries.clone(),
    };
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv6Addr};

    use vmpath_common::{AddrKey, LEARNED_FROM_ARP, LearnedIp, ROUTED_PORT_ID};

    use super::*;
    use crate::{config, plan::plan};

    /// Node a with vm1 (port p-vm1, given 10.40.0.50 and fd40::50) on an
    /// IPAM-less SNAT network with `advertise`, vm2 on node b (given
    /// 10.40.0.51), vm3 on node b with a detected MAC; `extra` is added to
    /// vm1's spec.
    fn cfg(tag: &str, advertise: &str, vm1_extra: &str) -> Resolved {
        let docs = format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: imp}}\nspec: {{id: 700, subnets: [10.40.0.0/16, fd40::/64], defaultGatewayIPs: [10.40.0.1], ipam: {{mode: Disabled}}, egress: SNAT, advertise: {advertise}}}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm1, namespace: prod}}\nspec: {{vm: vm1, interface: eth0, network: imp, node: a, port: p-vm1, mac: '52:54:00:00:00:01', ips: [10.40.0.50/16, fd40::50/64]{vm1_extra}}}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm2, namespace: prod}}\nspec: {{vm: vm2, interface: eth0, network: imp, node: b, port: p-vm2, mac: '52:54:00:00:00:02', ips: [10.40.0.51/16]}}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm3, namespace: prod}}\nspec: {{vm: vm3, interface: eth0, network: imp, node: b, port: p-vm3, ips: [10.40.0.52/16]}}\n"
        );
        let dir = std::env::temp_dir().join(format!("vmpath-ns-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ));
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        cfg
    }

    fn v4(a: [u8; 4]) -> AddrKey {
        AddrKey::v4(0, a)
    }

    /// The cluster's address spaces (its CIDRs, every Node's address) are
    /// written under `CLUSTER_NETWORK` once a Primary network exists, and
    /// not before: a node without one hands nothing off.
    #[test]
    fn the_clusters_address_spaces_are_kept_for_the_hand_off_of_primary_networks() {
        crate::plan::handoff::set_written_for_tests();
        let docs = |role: &str| {
            format!(
                "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: a}}\nspec: {{address: 192.168.50.1}}\n\
                 ---\napiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: b}}\nspec: {{address: 192.168.50.2}}\n\
                 ---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: pods}}\nspec: {{id: 31, role: {role}, subnets: [10.31.0.0/24], defaultGatewayIPs: [10.31.0.1], ipam: {{mode: Enabled}}}}\n"
            )
        };
        let planned = |role: &str| {
            let dir = std::env::temp_dir()
                .join(format!("vmpath-ns-handoff-{role}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("c.yaml"), docs(role)).unwrap();
            let mut snap = config::source::read_dir(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            snap.cluster_cidrs = vec![config::ClusterCidr {
                cidr: "10.96.0.0/12".parse().unwrap(),
                kind: config::ClusterCidrKind::Service,
                source: "--cluster-service-cidrs".into(),
                node: None,
            }];
            let c = Resolved::new(crate::round::validate(
                &snap,
                "a",
                &crate::config::AcceptedKeys::new(),
            ));
            assert!(c.errors.is_empty(), "{:?}", c.errors);
            plan(&c, "a", |_| None)
                .subnets4
                .keys()
                .filter(|(_, s)| s.network == CLUSTER_NETWORK.to_be_bytes())
                .map(|(len, s)| format!("{}/{}", std::net::Ipv4Addr::from(s.addr), len - 32))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            planned("Primary"),
            ["10.96.0.0/12", "192.168.50.1/32", "192.168.50.2/32"]
        );
        assert!(planned("Secondary").is_empty());
    }

    #[test]
    fn snat_with_advertise_routes_ingress_and_keeps_snat_egress() {
        let mut c = cfg("ingress", "{subnet: true, learned: true}", "");
        // An address vm1 uses that no document gives, learned here.
        c.learned_ips.insert(
            AddrKey::v4(700, [10, 40, 0, 99]),
            LearnedIp {
                ifindex: 7,
                how: LEARNED_FROM_ARP,
                mac: [0x52, 0x54, 0, 0, 0, 1],
                _pad: [0; 2],
                seen: 0,
            },
        );
        let p = plan(&c, "a", |n| (n == "p-vm1").then_some(7));
        assert_eq!(
            p.networks[&700].flags & (NET_F_SNAT | NET_F_INGRESS | NET_F_ROUTED),
            NET_F_SNAT | NET_F_INGRESS
        );
        assert!(p.ingress_hosted.contains(&700));
        // vm1 is served here: straight to its port, flows recorded.
        let r = p.routed[&v4([10, 40, 0, 50])];
        assert_eq!((r.ifindex, r.port_id & ROUTED_PORT_ID), (7, 1));
        assert_ne!(r.port_id & ROUTED_F_INBOUND, 0);
        assert_eq!(p.routed[&v4([10, 40, 0, 99])], r, "the learned address");
        // IPv6 alike: routed in, flows recorded.
        let r6 = p.routed[&AddrKey::v6(0, &"fd40::50".parse::<Ipv6Addr>().unwrap().octets())];
        assert_eq!(r6, r);
        // vm2 is on node b: its entry follows the endpoint (overlay).
        let r = p.routed[&v4([10, 40, 0, 51])];
        assert_eq!((r.ifindex, r.vm_mac), (0, [0x52, 0x54, 0, 0, 0, 2]));
        // vm3's MAC is known only on b: no entry.
        assert!(!p.routed.contains_key(&v4([10, 40, 0, 52])));

        // The routes for BGP: the IPv4 subnet (hosted here) and the learned
        // addresses (without perVM), IPv6 as IPv4.
        let want: Vec<String> = crate::apply::routes::desired(&c, &p, &c.learned_ips)
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(
            want,
            [
                "blackhole 10.40.0.0/16",
                "10.40.0.99/32 dev lo",
                "blackhole fd40::/64"
            ]
        );

        // Node c hosts nothing of the network: no subnet, no entries.
        let p = plan(&c, "c", |_| None);
        assert!(p.routed.is_empty() && p.ingress_hosted.is_empty());
        assert!(crate::apply::routes::desired(&c, &p, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn a_migrations_source_follows_the_endpoint_and_its_target_relays_until_cut_over() {
        let c = cfg(
            "migrating",
            "{perVM: true}",
            ", migration: {targetNode: c, targetPort: p-vm1c}",
        );
        // The source: vm1's entry follows the endpoint (local until the
        // data path repoints it at the cut-over).
        let p = plan(&c, "a", |n| (n == "p-vm1").then_some(7));
        assert_eq!(p.routed[&v4([10, 40, 0, 50])].ifindex, 0);
        // The target hosts the network through the migration alone.
        let p = plan(&c, "c", |n| (n == "p-vm1c").then_some(9));
        assert!(p.ingress_hosted.contains(&700));
        assert_eq!(p.routed[&v4([10, 40, 0, 50])].ifindex, 0);
        // Once cut over, the target routes straight to the VM's port, and
        // the source keeps an entry that follows the endpoint (relay).
        let mut c = c;
        std::sync::Arc::make_mut(&mut c.attachments[0]).cut_over = true;
        let p = plan(&c, "c", |n| (n == "p-vm1c").then_some(9));
        assert_eq!(p.routed[&v4([10, 40, 0, 50])].ifindex, 9);
        // An address vm1 used on a that no document gives: still routed
        // (on to the endpoint) by the source after the cut-over.
        c.learned_ips.insert(
            AddrKey::v4(700, [10, 40, 0, 98]),
            LearnedIp {
                ifindex: 7,
                how: LEARNED_FROM_ARP,
                mac: [0x52, 0x54, 0, 0, 0, 1],
                _pad: [0; 2],
                seen: 0,
            },
        );
        let p = plan(&c, "a", |_| None);
        assert_eq!(p.routed[&v4([10, 40, 0, 50])].ifindex, 0);
        let r = p.routed[&v4([10, 40, 0, 98])];
        assert_eq!((r.ifindex, r.vm_mac), (0, [0x52, 0x54, 0, 0, 0, 1]));
        // Not advertised from there: only a hosting node exports it.
        let routes = crate::apply::routes::desired(&c, &p, &c.learned_ips);
        assert!(
            routes
                .iter()
                .all(|r| r.dest.addr() != IpAddr::from([10, 40, 0, 98]))
        );
    }

    #[test]
    fn plain_snat_and_routed_networks_keep_their_meaning() {
        let c = cfg("plain", "{}", "");
        let p = plan(&c, "a", |n| (n == "p-vm1").then_some(7));
        assert_eq!(p.networks[&700].flags & (NET_F_INGRESS | NET_F_ROUTED), 0);
        assert!(p.routed.is_empty(), "plain SNAT: nothing routed in");
        assert!(
            p.resolve_prefixes.is_empty(),
            "plain SNAT: nothing resolved"
        );
    }

    /// Where an address nothing places may be a learned one on another
    /// node: the subnets of the learning ingress networks hosted here.
    #[test]
    fn a_learning_ingress_network_hosted_here_resolves_its_subnets() {
        let c = cfg("resolve", "{subnet: true, learned: true}", "");
        let p = plan(&c, "a", |n| (n == "p-vm1").then_some(7));
        let v6 = |a: &str| ResolvePrefix {
            addr: a.parse::<Ipv6Addr>().unwrap().octets(),
        };
        let want = BTreeMap::from([
            (ResolvePrefix::v4([10, 40, 0, 0], 16), 700),
            ((64, v6("fd40::")), 700),
        ]);
        assert_eq!(p.resolve_prefixes, want);
        // Not hosted on a node without a VM of it.
        let p = plan(&c, "z", |_| None);
        assert!(p.resolve_prefixes.is_empty());
        // Not where the ports filter source addresses (nothing is learned).
        let c = cfg(
            "resolve-filter",
            "{subnet: true}, portSecurity: {ip: true}",
            "",
        );
        let p = plan(&c, "a", |n| (n == "p-vm1").then_some(7));
        assert!(p.resolve_prefixes.is_empty(), "{:?}", p.resolve_prefixes);
    }
}
