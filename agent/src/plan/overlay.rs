//! Desired overlay state: where the VMs of other nodes live, and which
//! nodes host each network. Every node reads the same documents, so every
//! node computes the same picture of the others.
//!
//! A remote VM has an endpoint entry only when every node knows its MAC:
//! given in the Attachment, or generated (deterministic from the VM's
//! identity). A MAC detected from traffic is known only on the hosting
//! node (it lives in that node's claims). Other nodes learn where it lives
//! from the frames it sends over the overlay (VXLAN source learning, in
//! the data path: `vmp_remote_learned`); until it has spoken, unicast to
//! it is flooded (to every node of the network, and the hosting node
//! delivers it).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv6Addr},
};

use vmpath_common::{
    ADDR_STATIC, AddrInfo, AddrKey, ENDPOINT_REMOTE, Endpoint, EndpointKey, MAX_FLOOD_NODES,
};

use super::Plan;
use crate::sys::hash::{HashMap, HashSet};
use crate::{
    config::model::MacPolicy,
    resolve::resolved::{Attachment, Resolved},
};

/// Another node as the overlay reaches it: its address, and its VTEP
/// value when this node has one for it.
type NodeReach = (IpAddr, Option<[u8; 4]>);

pub fn overlay(cfg: &Resolved, node: &str, plan: &mut Plan) {
    let own = cfg.config.nodes.get(node).map(|n| n.address);
    // Reach: a frame with `REACH_VNI` reaches an endpoint or this node's
    // stack, so only another node may send one (not a pod or a VM that
    // writes VXLAN itself).
    for name in cfg.config.nodes.keys().filter(|n| n.as_str() != node) {
        if let Some(v) = vtep(cfg, &plan.vteps6, name) {
            plan.reach_nodes.insert(v, 1);
        }
    }
    // Looked up once per network and per node, not per VM interface: at
    // 10,000 VM interfaces over 200 nodes the lookups and the flood
    // lists' scans were most of this stage.
    let networks: HashMap<&str, &crate::config::Network> = cfg
        .config
        .networks
        .iter()
        .map(|n| (n.name.as_str(), n))
        .collect();
    let mut hosts: HashMap<&str, Option<NodeReach>> = HashMap::default();
    let mut flooded: HashSet<(u32, [u8; 4])> = HashSet::default();
    let mut flood = |plan: &mut Plan, net: &crate::config::Network, host: &str, ip4: [u8; 4]| {
        if flooded.insert((net.id, ip4)) {
            add_flood_node(plan, net, host, ip4);
        }
    };
    // Every other node's entries, in the VM interfaces' order, merged into
    // the plan's maps once at the end: inserted one by one, at 10,000 VM
    // interfaces the trees' random inserts were most of this stage.
    let mut remote_addresses: Vec<(AddrKey, AddrInfo)> = Vec::with_capacity(cfg.attachments.len());
    let mut remote_endpoints: Vec<(EndpointKey, Endpoint)> =
        Vec::with_capacity(cfg.attachments.len());
    for att in &cfg.attachments {
        let Some(&net) = networks.get(att.network.as_str()) else {
            continue;
        };
        // Both ends of a migration host the network while it runs: the
        // source relays to the target and the target sends from there.
        if let Some(m) = &att.migration {
            for host in [att.node.as_str(), m.target_node.as_str()] {
                if host != node
                    && host != att.active_node()
                    && let Some(ip4) = vtep(cfg, &plan.vteps6, host)
                {
                    flood(plan, net, host, ip4);
                }
            }
        }
        let host = att.active_node();
        if host == node {
            continue;
        }
        let remote = *hosts.entry(host).or_insert_with(|| {
            cfg.config
                .nodes
                .get(host)
                .map(|n| (n.address, vtep(cfg, &plan.vteps6, host)))
        });
        let Some((remote_address, vtep4)) = remote else {
            plan.problems.push(format!(
                "attachment {} on node {host:?}: no Node document for that node, so it is not reachable over the overlay",
                att.key
            ));
            continue;
        };
        if Some(remote_address) == own {
            plan.problems.push(format!(
                "node {host:?} has this node's address {remote_address}: attachment {} is not reachable over the overlay",
                att.key
            ));
            continue;
        }
        let Some(ip4) = vtep4 else {
            // Only without a Node of its own (validation refuses a Node of
            // the other underlay family): nothing to send from.
            plan.problems.push(format!(
                "node {host:?}: this node has no Node document with an underlay address; attachment {} is not reachable over the overlay",
                att.key
            ));
            continue;
        };

        flood(plan, net, host, ip4);

        // Detected MACs are only known on the hosting node; the others
        // learn them from the overlay (see above).
        let known = match att.mac_resolved {
            Some((mac, _)) if att.mac.is_some() || att.mac_policy == MacPolicy::Generate => {
                Some(mac)
            }
            _ => None,
        };
        // Its addresses, for the overlay's neighbour discovery check: an
        // NA from that node may advertise them (and only with this MAC,
        // where known). A local owner wins.
        for (ip, _) in &att.addresses {
            remote_addresses.push((
                super::addr_key(net.id, ip.addr()),
                AddrInfo {
                    ifindex: 0,
                    origin: ADDR_STATIC,
                    mac: known.unwrap_or([0; 6]),
                    _pad: [0; 2],
                    port_id: 0,
                    node_ip4: ip4,
                },
            ));
        }
        if let Some(mac) = known {
            // A local port with the same MAC wins (validation refuses such
            // collisions; this only keeps a local VM reachable meanwhile).
            remote_endpoints.push((
                EndpointKey::new(net.id, mac),
                Endpoint {
                    kind: ENDPOINT_REMOTE,
                    ifindex: 0,
                    node_ip4: ip4,
                    migrate_to: migrate_to(cfg, &plan.vteps6, att, node),
                    port_id: 0,
                    // Set once policy is compiled (`remote_identities`).
                    identity: 0,
                },
            ));
        }
    }
    merge_first_wins(&mut plan.addresses, remote_addresses);
    merge_first_wins(&mut plan.endpoints, remote_endpoints);
    // Keep the lists in a stable order, whatever the document order.
    for list in plan.flood_remote.values_mut() {
        list.node_ip4[..list.count as usize].sort_unstable();
    }
}

/// Adds `later` to `map` where `map` has no entry for the key, the first
/// of `later` winning among its own (as `entry().or_insert()` one by one
/// would), built as one sorted run: the tree is made in bulk.
fn merge_first_wins<K: Ord + Copy, V>(map: &mut BTreeMap<K, V>, mut later: Vec<(K, V)>) {
    if later.is_empty() {
        return;
    }
    // Stable: among equal keys the first pushed stays first.
    later.sort_by_key(|(k, _)| *k);
    later.dedup_by_key(|(k, _)| *k);
    let earlier = std::mem::take(map);
    let mut earlier = earlier.into_iter().peekable();
    let mut merged = Vec::with_capacity(earlier.len() + later.len());
    for (k, v) in later {
        while let Some((ek, _)) = earlier.peek() {
            if *ek <= k {
                merged.push(earlier.next().expect("peeked"));
            } else {
                break;
            }
        }
        if merged.last().is_none_or(|(mk, _): &(K, V)| *mk != k) {
            merged.push((k, v));
        }
    }
    merged.extend(earlier);
    *map = merged.into_iter().collect();
}

/// Once policy is compiled: every endpoint entry carries its endpoint's
/// policy identity, so a node receiving a remote endpoint's frame over the
/// overlay judges it by who sent it (its MAC, from the node it lives on),
/// never by the source address it claims. Local entries carry it too: a
/// VM migrating away turns its entry remote in the data path
/// (`migrate::learn_move`) before the next plan.
pub fn endpoint_identities(cfg: &Resolved, plan: &mut Plan) {
    for att in &cfg.attachments {
        let (Some(net), Some((mac, _))) = (cfg.network(&att.network), att.mac_resolved) else {
            continue;
        };
        let Some(&id) = plan.policy.senders.get(&att.key) else {
            continue;
        };
        // The entry's first holder keeps it (as `overlay` and `plan` insert).
        if let Some(ep) = plan.endpoints.get_mut(&EndpointKey::new(net.id, mac))
            && ep.identity == 0
        {
            ep.identity = id;
        }
    }
}

fn add_flood_node(plan: &mut Plan, net: &crate::config::Network, host: &str, ip4: [u8; 4]) {
    let list = plan.flood_remote.entry(net.id).or_default();
    if !list.node_ip4[..list.count as usize].contains(&ip4) {
        if list.count as usize >= MAX_FLOOD_NODES {
            plan.problems.push(format!(
                "network {:?} spans more than {MAX_FLOOD_NODES} other nodes: node {host:?} gets no floods",
                net.name
            ));
        } else {
            list.node_ip4[list.count as usize] = ip4;
            list.count += 1;
        }
    }
}

/// The 4-byte VTEP value the data path knows `node` by, if it has a Node
/// document: its IPv4 address, or on an IPv6 underlay its handle in
/// `vteps6` (`vtep_handles`).
pub fn vtep(cfg: &Resolved, vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>, node: &str) -> Option<[u8; 4]> {
    match cfg.config.nodes.get(node)?.address {
        IpAddr::V4(a) => Some(a.octets()),
        IpAddr::V6(a) => vteps6.get(&a).copied(),
    }
}

/// IPv6 underlay: a 4-byte handle for each other node's IPv6 address
/// (the data path's node values are 4 bytes wide; `vmp_vtep6` maps a
/// handle to the address). A handle stays with its address across rounds
/// and restarts (`previous`: the last plan's, or the pinned map's), since
/// the data path stores handles itself (learned MACs, a migrated VM's
/// endpoint, resolution answers). A new address takes the FNV-1a hash of
/// its bytes, the next free value on a collision: the same on every
/// restart, and a node that leaves and comes back gets its handle again.
/// Empty unless this node's own address is IPv6.
pub fn vtep_handles(
    cfg: &Resolved,
    node: &str,
    previous: &BTreeMap<Ipv6Addr, [u8; 4]>,
) -> BTreeMap<Ipv6Addr, [u8; 4]> {
    let Some(IpAddr::V6(own)) = cfg.config.nodes.get(node).map(|n| n.address) else {
        return BTreeMap::new();
    };
    let others: BTreeSet<Ipv6Addr> = cfg
        .config
        .nodes
        .values()
        .filter_map(|n| match n.address {
            IpAddr::V6(a) if a != own => Some(a),
            _ => None,
        })
        .collect();
    let mut used = HashSet::default();
    let mut handles = BTreeMap::new();
    for a in &others {
        if let Some(&h) = previous.get(a)
            && h != [0; 4]
            && used.insert(h)
        {
            handles.insert(*a, h);
        }
    }
    for a in &others {
        if handles.contains_key(a) {
            continue;
        }
        let mut h = crate::sys::hash::fnv1a(&[&a.octets()]) as u32;
        while h == 0 || used.contains(&h.to_be_bytes()) {
            h = h.wrapping_add(1);
        }
        used.insert(h.to_be_bytes());
        handles.insert(*a, h.to_be_bytes());
    }
    handles
}

/// For a VM whose migration is pending, the target's VTEP value: the
/// endpoint entry on every node but the target carries it, so the VM's
/// first frame from the target moves the entry there in the data path
/// (`migrate::learn_move`). Zero otherwise.
pub fn migrate_to(
    cfg: &Resolved,
    vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>,
    att: &Attachment,
    node: &str,
) -> [u8; 4] {
    match &att.migration {
        Some(m) if !att.cut_over && m.target_node != node && m.target_node != att.node => {
            vtep(cfg, vteps6, &m.target_node).unwrap_or([0; 4])
        }
        _ => [0; 4],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_entries_keep_the_first_holder_as_one_by_one_inserts_do() {
        let mut map = BTreeMap::from([(2u32, "local 2"), (5, "local 5")]);
        let later = vec![
            (7, "first 7"),
            (2, "remote 2"),
            (1, "first 1"),
            (7, "second 7"),
            (5, "remote 5"),
            (1, "second 1"),
        ];
        let mut one_by_one = map.clone();
        for (k, v) in later.clone() {
            one_by_one.entry(k).or_insert(v);
        }
        merge_first_wins(&mut map, later);
        assert_eq!(map, one_by_one);
        assert_eq!(
            map.into_iter().collect::<Vec<_>>(),
            vec![
                (1, "first 1"),
                (2, "local 2"),
                (5, "local 5"),
                (7, "first 7")
            ]
        );
    }
    use crate::config;

    const DOCS: &str = "
apiVersion: vmpath.dev/v1alpha1
kind: Node
metadata: {name: a}
spec: {address: 192.0.2.1}
---
apiVersion: vmpath.dev/v1alpha1
kind: Node
metadata: {name: b}
spec: {address: 192.0.2.2}
---
apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: blue}
spec: {id: 100, subnets: [10.20.0.0/16], ipam: {mode: Disabled}}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm1, namespace: prod}
spec: {vm: vm1, interface: eth0, network: blue, node: a, port: p1, mac: '52:54:00:00:00:01'}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm2, namespace: prod}
spec: {vm: vm2, interface: eth0, network: blue, node: b, port: p2, mac: '52:54:00:00:00:02', ips: [10.20.0.12/16]}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm3, namespace: prod}
spec: {vm: vm3, interface: eth0, network: blue, node: b, port: p3, ips: [10.20.0.13/16]}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm4, namespace: prod}
spec: {vm: vm4, interface: eth0, network: blue, node: c, port: p4, mac: '52:54:00:00:00:04'}
";

    fn plan_for(node: &str) -> Plan {
        plan_of(DOCS, node, &BTreeMap::new())
    }

    fn plan_of(docs: &str, node: &str, vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>) -> Plan {
        let dir = std::env::temp_dir().join(format!(
            "vmpath-plan-overlay-{}-{node}-{}",
            std::process::id(),
            crate::sys::hash::fnv1a(&[docs.as_bytes()])
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let mut cfg = Resolved::new(crate::round::validate(&snap, node, &Default::default()));
        let _ = crate::resolve::ipam::assign(&mut cfg, &Default::default());
        super::super::plan_with_previous(
            &cfg,
            node,
            |_| Some(7),
            &BTreeMap::new(),
            &BTreeMap::new(),
            vteps6,
        )
    }

    /// The same cluster over an IPv6 underlay: other nodes are known by
    /// handles, each handle names its node's address, and a handle stays
    /// with its address when the cluster changes around it.
    #[test]
    fn an_ipv6_underlay_knows_other_nodes_by_handles_that_stay() {
        let docs = DOCS
            .replace("address: 192.0.2.1", "address: 'fd00:1::1'")
            .replace("address: 192.0.2.2", "address: 'fd00:1::2'");
        let b6: Ipv6Addr = "fd00:1::2".parse().unwrap();
        let plan = plan_of(&docs, "a", &BTreeMap::new());
        assert_eq!(plan.vteps6.len(), 1, "{:?}", plan.vteps6);
        let handle = plan.vteps6[&b6];
        assert_ne!(handle, [0; 4]);
        let ep = plan.endpoints[&EndpointKey::new(100, [0x52, 0x54, 0, 0, 0, 2])];
        assert_eq!((ep.kind, ep.node_ip4), (ENDPOINT_REMOTE, handle));
        let list = plan.flood_remote[&100];
        assert_eq!((list.count, list.node_ip4[0]), (1, handle));
        // A handle the data path already holds is kept, whatever the hash.
        let kept = plan_of(&docs, "a", &BTreeMap::from([(b6, [0, 0, 0, 9])]));
        assert_eq!(kept.vteps6[&b6], [0, 0, 0, 9]);
        assert_eq!(kept.flood_remote[&100].node_ip4[0], [0, 0, 0, 9]);
        // From b: a is known by a handle of its own; no IPv4 anywhere.
        let from_b = plan_of(&docs, "b", &BTreeMap::new());
        let a6: Ipv6Addr = "fd00:1::1".parse().unwrap();
        assert_eq!(from_b.vteps6.keys().collect::<Vec<_>>(), [&a6]);
        // An IPv4 underlay has no handles.
        assert!(plan_for("a").vteps6.is_empty());
    }

    #[test]
    fn colliding_handles_are_told_apart() {
        let docs = DOCS
            .replace("address: 192.0.2.1", "address: 'fd00:1::1'")
            .replace("address: 192.0.2.2", "address: 'fd00:1::2'")
            + "---\napiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {name: c}\nspec: {address: 'fd00:1::3'}\n";
        let (b6, c6): (Ipv6Addr, Ipv6Addr) =
            ("fd00:1::2".parse().unwrap(), "fd00:1::3".parse().unwrap());
        // b holds c's hash already: c takes the next free value.
        let c_hash = (crate::sys::hash::fnv1a(&[&c6.octets()]) as u32).to_be_bytes();
        let plan = plan_of(&docs, "a", &BTreeMap::from([(b6, c_hash)]));
        assert_eq!(plan.vteps6[&b6], c_hash);
        assert_ne!(plan.vteps6[&c6], c_hash);
        assert_eq!(plan.vteps6.len(), 2);
    }

    #[test]
    fn remote_attachments_become_remote_endpoints_and_flood_nodes() {
        let plan = plan_for("a");
        let ep = plan.endpoints[&EndpointKey {
            network: 100,
            mac: [0x52, 0x54, 0, 0, 0, 2],
            _pad: [0; 2],
        }];
        assert_eq!(ep.kind, ENDPOINT_REMOTE);
        assert_eq!(ep.node_ip4, [192, 0, 2, 2]);
        // vm3's MAC is to be detected: only node b will know it.
        assert_eq!(
            plan.endpoints
                .values()
                .filter(|e| e.kind == ENDPOINT_REMOTE)
                .count(),
            1
        );
        let list = plan.flood_remote[&100];
        assert_eq!(list.count, 1, "node b once, however many VMs it hosts");
        assert_eq!(list.node_ip4[0], [192, 0, 2, 2]);
        // Node c has no Node document.
        assert!(
            plan.problems.iter().any(|p| p.contains("vm4")),
            "{:?}",
            plan.problems
        );
    }

    /// A remote VM's addresses are in `vmp_addresses` with no local port
    /// and its MAC where this node knows it: `vxlan_rx` checks the
    /// neighbour advertisements that node sends for them.
    #[test]
    fn remote_addresses_name_their_mac_where_known() {
        let plan = plan_for("a");
        let addr = |ip: &str| plan.addresses[&crate::plan::addr_key(100, ip.parse().unwrap())];
        let vm2 = addr("10.20.0.12");
        assert_eq!((vm2.ifindex, vm2.mac), (0, [0x52, 0x54, 0, 0, 0, 2]));
        // vm3's MAC is detected on b: unknown here.
        let vm3 = addr("10.20.0.13");
        assert_eq!((vm3.ifindex, vm3.mac), (0, [0; 6]));
    }

    #[test]
    fn every_node_sees_the_others() {
        let plan = plan_for("b");
        let ep = plan.endpoints[&EndpointKey {
            network: 100,
            mac: [0x52, 0x54, 0, 0, 0, 1],
            _pad: [0; 2],
        }];
        assert_eq!((ep.kind, ep.node_ip4), (ENDPOINT_REMOTE, [192, 0, 2, 1]));
        assert_eq!(plan.flood_remote[&100].count, 1);
    }

    /// vm1 migrating from a to b, pending or cut over, as every node plans it.
    fn migration_plan(node: &str, ready: bool) -> Plan {
        let docs = format!(
            "{}---
apiVersion: vmpath.dev/v1alpha1
kind: Node
metadata: {{name: c}}
spec: {{address: 192.0.2.3}}
",
            DOCS.replace(
                "node: a, port: p1, mac: '52:54:00:00:00:01'}",
                &format!(
                    "node: a, port: p1, mac: '52:54:00:00:00:01', migration: {{targetNode: b, targetPort: p1b, ready: {ready}}}}}"
                ),
            )
        );
        let dir = std::env::temp_dir().join(format!(
            "vmpath-plan-migration-{}-{node}-{ready}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let validated = crate::round::validate(&snap, node, &Default::default());
        assert!(validated.errors.is_empty(), "{:?}", validated.errors);
        let mut cfg = Resolved::new(validated);
        let _ = crate::resolve::ipam::assign(&mut cfg, &Default::default());
        // Distinct ifindexes so the ports can be told apart.
        super::super::plan(&cfg, node, |name| {
            Some(match name {
                "p1" => 11,
                "p1b" => 12,
                _ => 7,
            })
        })
    }

    const VM1: EndpointKey = EndpointKey {
        network: 100,
        mac: [0x52, 0x54, 0, 0, 0, 1],
        _pad: [0; 2],
    };

    #[test]
    fn pending_migration_keeps_everyone_on_the_source() {
        use vmpath_common::{ENDPOINT_LOCAL, PORT_F_PENDING};
        // Source: still local, marked as moving to b.
        let a = migration_plan("a", false);
        assert_eq!(a.endpoints[&VM1].kind, ENDPOINT_LOCAL);
        assert_eq!(a.endpoints[&VM1].migrate_to, [192, 0, 2, 2]);
        // Target: a pending port, the endpoint still at a.
        let b = migration_plan("b", false);
        assert!(b.ports[&12].info.flags & PORT_F_PENDING != 0);
        assert_eq!(
            (b.endpoints[&VM1].kind, b.endpoints[&VM1].node_ip4),
            (ENDPOINT_REMOTE, [192, 0, 2, 1])
        );
        // A third node: at a, moving to b; floods reach both.
        let c = migration_plan("c", false);
        assert_eq!(
            (c.endpoints[&VM1].node_ip4, c.endpoints[&VM1].migrate_to),
            ([192, 0, 2, 1], [192, 0, 2, 2])
        );
        assert_eq!(c.flood_remote[&100].count, 2);
    }

    #[test]
    fn cut_over_moves_the_vm_to_the_target() {
        use vmpath_common::{ENDPOINT_LOCAL, PORT_F_PENDING};
        let a = migration_plan("a", true);
        assert!(!a.ports.contains_key(&11), "the source keeps its port");
        assert_eq!(
            (a.endpoints[&VM1].kind, a.endpoints[&VM1].node_ip4),
            (ENDPOINT_REMOTE, [192, 0, 2, 2])
        );
        let b = migration_plan("b", true);
        assert_eq!(b.ports[&12].info.flags & PORT_F_PENDING, 0);
        assert_eq!(
            (b.endpoints[&VM1].kind, b.endpoints[&VM1].ifindex),
            (ENDPOINT_LOCAL, 12)
        );
        // b still takes a's relayed frames.
        let list = b.flood_remote[&100];
        assert!(list.node_ip4[..list.count as usize].contains(&[192, 0, 2, 1]));
        let c = migration_plan("c", true);
        assert_eq!(
            (c.endpoints[&VM1].node_ip4, c.endpoints[&VM1].migrate_to),
            ([192, 0, 2, 2], [0; 4])
        );
    }
}
