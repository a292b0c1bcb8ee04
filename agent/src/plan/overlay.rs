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
    sync::Arc,
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

/// Other nodes' part of the plan: where their VMs live, which nodes
/// host each network, what may send this node overlay frames. Built from
/// the VM interfaces active elsewhere (or migrating), the networks and the
/// Nodes alone, so it is shared between rounds while those stay
/// ([`Cache`]).
#[derive(Debug, Clone, Default)]
pub struct Remote {
    /// Other nodes' VMs' addresses (`vmp_addresses`).
    pub addresses: Arc<BTreeMap<AddrKey, AddrInfo>>,
    /// Other nodes' VMs' endpoints, without identities.
    endpoints: SharedEndpoints,
    /// Each endpoint entry's holder (the first VM interface with that
    /// MAC), as an index into the inputs: whose identity it carries.
    holders: Vec<(EndpointKey, usize)>,
    flood_remote: BTreeMap<u32, vmpath_common::RemoteFloodList>,
    reach_nodes: BTreeMap<[u8; 4], u32>,
    problems: Vec<String>,
}

/// Other nodes' endpoint entries, shared between plans.
type SharedEndpoints = Arc<BTreeMap<EndpointKey, Endpoint>>;

/// Whether the overlay reads `att`: it is active on another node, or it
/// migrates (both ends host its network meanwhile).
fn overlay_reads(att: &Attachment, node: &str) -> bool {
    att.elsewhere || att.migrates || att.active_node() != node
}

/// What of a VM interface the overlay reads besides its document (shared,
/// compared by identity): its addresses, MAC and cut-over, hashed with
/// `seeds` (the cache's, random: the addresses are a tenant's, and a
/// collision it could aim at would keep its last entries standing).
fn resolved_digest(seeds: &ahash::RandomState, att: &Attachment) -> u64 {
    use std::hash::{BuildHasher as _, Hash as _, Hasher as _};
    let mut h = seeds.build_hasher();
    for (ip, _) in &att.addresses {
        ip.hash(&mut h);
    }
    att.mac_resolved.map(|(m, _)| m).hash(&mut h);
    att.cut_over.hash(&mut h);
    h.finish()
}

/// [`overlay`] as the last round left it, and what it was built from:
/// built again only when a VM interface the overlay reads, a network or a
/// Node changed. A VM's ADD on this node then costs the overlay a
/// comparison per other node's VM interface, not its entries' sort and
/// the maps built again. The resync starts from an empty cache.
#[derive(Debug, Default)]
pub struct Cache {
    /// Each VM interface the overlay read, in order: its document (kept,
    /// so an address is never reused for another) and its digest.
    inputs: Vec<(Arc<crate::config::Attachment>, u64)>,
    networks: Vec<crate::config::Network>,
    nodes: BTreeMap<String, crate::config::Node>,
    vteps6: BTreeMap<Ipv6Addr, [u8; 4]>,
    node: String,
    remote: Option<Remote>,
    /// The endpoints with identities, and the identities they were given.
    identified: Option<(SharedEndpoints, Vec<u32>)>,
    /// The digests' seeds, drawn at random once per cache.
    seeds: ahash::RandomState,
    /// Bumped whenever `remote` is built again: what is kept beside it
    /// from the same inputs holds while this does.
    builds: u64,
    /// Other nodes' VMs' routed entries (`north_south`), with the build
    /// and the ingress networks hosted here they were made for.
    routed: Option<(u64, BTreeSet<u32>, Arc<RemoteRouted>)>,
    /// Of the list it was last found to hold for, or built from, the
    /// entries the overlay reads; `None` when that list was not carried
    /// over (a plan of its own leaves nothing the next round's marks
    /// could be read against).
    read: Option<Vec<bool>>,
}

/// Other nodes' VMs' routed entries (`vmp_routed`, planned by
/// `north_south`), kept between rounds beside the overlay's part
/// ([`Cache::routed`]): they come from the same VM interfaces.
#[derive(Debug, Default)]
pub struct RemoteRouted {
    /// By address, in the VM interfaces' key order (the first one's
    /// entry where two give one address).
    pub entries: Arc<BTreeMap<AddrKey, vmpath_common::RoutedAddr>>,
    /// Each routed VM's entry by (network id, MAC): for the addresses this
    /// node learned from it while it was here.
    pub by_mac: BTreeMap<(u32, [u8; 6]), vmpath_common::RoutedAddr>,
}

impl Cache {
    /// Whether the last build was made for what `cfg` has besides its VM
    /// interfaces.
    fn same_context(
        &self,
        cfg: &Resolved,
        node: &str,
        vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>,
    ) -> bool {
        self.remote.is_some()
            && self.node == node
            && self.networks == cfg.config.networks
            && self.nodes == cfg.config.nodes
            && self.vteps6 == *vteps6
    }

    /// Which of `cfg`'s entries the overlay reads, when its marks show the
    /// entries read are the ones the cache holds for: the list the cache
    /// last held for (the last round's) carried over, with no migration
    /// in it (a cut-over is found again every round, outside the marks),
    /// every entry it read carried over unchanged and no changed one read.
    /// Read from the marks and the changed entries alone: a look at every
    /// entry was 1.5 ms of each round at 100,000 VMs.
    fn held_by_marks(&self, cfg: &Resolved, node: &str) -> Option<Vec<bool>> {
        let last = self.read.as_ref().filter(|_| !cfg.migrating())?;
        let marks = cfg.carried_for(last.len())?;
        let mut read = Vec::with_capacity(marks.len());
        let mut kept = 0;
        for (a, &mark) in cfg.attachments.iter().zip(marks) {
            if mark == crate::resolve::resolved::CHANGED {
                if overlay_reads(a, node) {
                    return None;
                }
                read.push(false);
            } else {
                let was = *last.get(mark as usize)?;
                kept += usize::from(was);
                read.push(was);
            }
        }
        (kept == self.inputs.len()).then_some(read)
    }

    /// Whether the last build still holds for `cfg`, entry by entry.
    fn holds(&self, cfg: &Resolved, node: &str) -> bool {
        let mut inputs = self.inputs.iter();
        for att in cfg.attachments.iter().filter(|a| overlay_reads(a, node)) {
            match inputs.next() {
                Some((spec, digest))
                    if Arc::ptr_eq(spec, &att.spec)
                        && *digest == resolved_digest(&self.seeds, att) => {}
                _ => return false,
            }
        }
        inputs.next().is_none()
    }

    /// Other nodes' part of the plan for `cfg`: the last one when it holds.
    fn remote(
        &mut self,
        cfg: &Resolved,
        node: &str,
        vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>,
    ) -> &Remote {
        let context = self.same_context(cfg, node, vteps6);
        let by_marks = context.then(|| self.held_by_marks(cfg, node)).flatten();
        let holds = by_marks.is_some() || (context && self.holds(cfg, node));
        self.read = cfg.carried.is_some().then(|| {
            by_marks.unwrap_or_else(|| {
                cfg.attachments
                    .iter()
                    .map(|a| overlay_reads(a, node))
                    .collect()
            })
        });
        if !holds {
            let read: Vec<&Attachment> = cfg
                .attachments
                .iter()
                .filter(|a| overlay_reads(a, node))
                .map(|a| &**a)
                .collect();
            self.remote = Some(remote(cfg, node, vteps6, &read));
            self.inputs = read
                .iter()
                .map(|a| (a.spec.clone(), resolved_digest(&self.seeds, a)))
                .collect();
            self.networks.clone_from(&cfg.config.networks);
            self.nodes.clone_from(&cfg.config.nodes);
            self.vteps6.clone_from(vteps6);
            self.node = node.to_string();
            self.identified = None;
            self.builds += 1;
        }
        self.remote.as_ref().expect("built above")
    }

    /// Kept beside other nodes' part of the plan (built this round by
    /// [`overlay`]): `build`'s result for the VM interfaces elsewhere,
    /// made again when that part was, or `hosted` changed.
    pub(super) fn routed(
        &mut self,
        hosted: &BTreeSet<u32>,
        build: impl FnOnce() -> RemoteRouted,
    ) -> Arc<RemoteRouted> {
        match &self.routed {
            Some((b, h, routed)) if *b == self.builds && h == hosted => routed.clone(),
            _ => {
                let routed = Arc::new(build());
                self.routed = Some((self.builds, hosted.clone(), routed.clone()));
                routed
            }
        }
    }

    /// The remote endpoints with the identity of each one's holder
    /// (`senders`: the compiled policy's), shared while they stay.
    fn identified(
        &mut self,
        senders: &BTreeMap<crate::config::AttachmentKey, u32>,
    ) -> SharedEndpoints {
        let Some(remote) = &self.remote else {
            return Arc::default();
        };
        if senders.is_empty() {
            return remote.endpoints.clone();
        }
        let ids: Vec<u32> = remote
            .holders
            .iter()
            .map(|(_, i)| senders.get(&self.inputs[*i].0.key).copied().unwrap_or(0))
            .collect();
        if let Some((endpoints, was)) = &self.identified
            && *was == ids
        {
            return endpoints.clone();
        }
        let mut endpoints = (*remote.endpoints).clone();
        for ((key, _), id) in remote.holders.iter().zip(&ids) {
            if *id != 0
                && let Some(ep) = endpoints.get_mut(key)
            {
                ep.identity = *id;
            }
        }
        let endpoints = Arc::new(endpoints);
        self.identified = Some((endpoints.clone(), ids));
        endpoints
    }
}

/// Puts other nodes' part of the plan (`cache`'s, built again where it
/// no longer holds) into `plan`: its remote layers, flood lists, the
/// nodes that may send overlay frames, its problems.
pub fn overlay(cfg: &Resolved, node: &str, plan: &mut Plan, cache: &mut Cache) {
    let remote = cache.remote(cfg, node, &plan.vteps6);
    plan.addresses.remote = remote.addresses.clone();
    plan.endpoints.remote = remote.endpoints.clone();
    plan.flood_remote.clone_from(&remote.flood_remote);
    plan.reach_nodes.clone_from(&remote.reach_nodes);
    plan.problems.extend(remote.problems.iter().cloned());
}

/// Once policy is compiled: every endpoint entry carries its endpoint's
/// policy identity, so a node receiving a remote endpoint's frame over the
/// overlay judges it by who sent it (its MAC, from the node it lives on),
/// never by the source address it claims. Local entries carry it too: a
/// VM migrating away turns its entry remote in the data path
/// (`migrate::learn_move`) before the next plan. A local entry takes the
/// identity of the first VM interface served here with its MAC, a remote
/// one that of the VM interface it was made for.
pub fn endpoint_identities(cfg: &Resolved, node: &str, plan: &mut Plan, cache: &mut Cache) {
    plan.endpoints.remote = cache.identified(&plan.policy.senders);
    if plan.policy.senders.is_empty() {
        return;
    }
    for att in cfg
        .attachments
        .iter()
        .filter(|a| super::local_port(a, node).is_some())
    {
        let (Some(net), Some((mac, _))) = (cfg.network(&att.network), att.mac_resolved) else {
            continue;
        };
        let Some(&id) = plan.policy.senders.get(&att.key) else {
            continue;
        };
        // The entry's first holder keeps it (as `plan` inserts).
        if let Some(ep) = plan.endpoints.local.get_mut(&EndpointKey::new(net.id, mac))
            && ep.identity == 0
        {
            ep.identity = id;
        }
    }
}

/// Other nodes' part of the plan, from `read`: the VM interfaces the
/// overlay reads ([`overlay_reads`]), in key order.
fn remote(
    cfg: &Resolved,
    node: &str,
    vteps6: &BTreeMap<Ipv6Addr, [u8; 4]>,
    read: &[&Attachment],
) -> Remote {
    let mut out = Remote::default();
    let own = cfg.config.nodes.get(node).map(|n| n.address);
    // Reach: a frame with `REACH_VNI` reaches an endpoint or this node's
    // stack, so only another node may send one (not a pod or a VM that
    // writes VXLAN itself).
    for name in cfg.config.nodes.keys().filter(|n| n.as_str() != node) {
        if let Some(v) = vtep(cfg, vteps6, name) {
            out.reach_nodes.insert(v, 1);
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
    let mut flood = |out: &mut Remote, net: &crate::config::Network, host: &str, ip4: [u8; 4]| {
        if flooded.insert((net.id, ip4)) {
            add_flood_node(out, net, host, ip4);
        }
    };
    // In the VM interfaces' order, made into maps once at the end:
    // inserted one by one, at 10,000 VM interfaces the trees' random
    // inserts were most of this stage.
    let mut remote_addresses: Vec<(AddrKey, AddrInfo)> = Vec::with_capacity(read.len());
    let mut remote_endpoints: Vec<(EndpointKey, Endpoint)> = Vec::with_capacity(read.len());
    let mut holders: Vec<(EndpointKey, usize)> = Vec::with_capacity(read.len());
    for (index, att) in read.iter().enumerate() {
        let Some(&net) = networks.get(att.network.as_str()) else {
            continue;
        };
        // Both ends of a migration host the network while it runs: the
        // source relays to the target and the target sends from there.
        if let Some(m) = &att.migration {
            for host in [att.node.as_str(), m.target_node.as_str()] {
                if host != node
                    && host != att.active_node()
                    && let Some(ip4) = vtep(cfg, vteps6, host)
                {
                    flood(&mut out, net, host, ip4);
                }
            }
        }
        let host = att.active_node();
        if host == node {
            continue;
        }
        let reach = *hosts.entry(host).or_insert_with(|| {
            cfg.config
                .nodes
                .get(host)
                .map(|n| (n.address, vtep(cfg, vteps6, host)))
        });
        let Some((remote_address, vtep4)) = reach else {
            out.problems.push(format!(
                "attachment {} on node {host:?}: no Node document for that node, so it is not reachable over the overlay",
                att.key
            ));
            continue;
        };
        if Some(remote_address) == own {
            out.problems.push(format!(
                "node {host:?} has this node's address {remote_address}: attachment {} is not reachable over the overlay",
                att.key
            ));
            continue;
        }
        let Some(ip4) = vtep4 else {
            // Only without a Node of its own (validation refuses a Node of
            // the other underlay family): nothing to send from.
            out.problems.push(format!(
                "node {host:?}: this node has no Node document with an underlay address; attachment {} is not reachable over the overlay",
                att.key
            ));
            continue;
        };

        flood(&mut out, net, host, ip4);

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
        // where known). A local owner wins (`Layered`).
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
            let key = EndpointKey::new(net.id, mac);
            remote_endpoints.push((
                key,
                Endpoint {
                    kind: ENDPOINT_REMOTE,
                    ifindex: 0,
                    node_ip4: ip4,
                    migrate_to: migrate_to(cfg, vteps6, att, node),
                    port_id: 0,
                    // Set once policy is compiled (`endpoint_identities`).
                    identity: 0,
                },
            ));
            holders.push((key, index));
        }
    }
    out.addresses = Arc::new(first_wins(remote_addresses));
    out.endpoints = Arc::new(first_wins(remote_endpoints));
    // The first holder of a key is the one whose entry stands.
    holders.sort_by_key(|(k, _)| *k);
    holders.dedup_by_key(|(k, _)| *k);
    out.holders = holders;
    // Keep the lists in a stable order, whatever the document order.
    for list in out.flood_remote.values_mut() {
        list.node_ip4[..list.count as usize].sort_unstable();
    }
    out
}

/// `entries` as a map, the first of equal keys winning (as
/// `entry().or_insert()` one by one would), built as one sorted run: the
/// tree is made in bulk.
fn first_wins<K: Ord + Copy, V>(mut entries: Vec<(K, V)>) -> BTreeMap<K, V> {
    // Stable: among equal keys the first pushed stays first.
    entries.sort_by_key(|(k, _)| *k);
    entries.dedup_by_key(|(k, _)| *k);
    entries.into_iter().collect()
}

fn add_flood_node(out: &mut Remote, net: &crate::config::Network, host: &str, ip4: [u8; 4]) {
    let list = out.flood_remote.entry(net.id).or_default();
    if !list.node_ip4[..list.count as usize].contains(&ip4) {
        if list.count as usize >= MAX_FLOOD_NODES {
            out.problems.push(format!(
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
    fn remote_entries_keep_their_first_holder_and_a_local_one_wins() {
        let later = vec![
            (7, "first 7"),
            (2, "remote 2"),
            (1, "first 1"),
            (7, "second 7"),
            (5, "remote 5"),
            (1, "second 1"),
        ];
        let mut one_by_one = BTreeMap::new();
        for (k, v) in later.clone() {
            one_by_one.entry(k).or_insert(v);
        }
        let remote = first_wins(later);
        assert_eq!(remote, one_by_one);
        let layered = crate::plan::layered::Layered {
            local: BTreeMap::from([(2u32, "local 2"), (5, "local 5")]),
            remote: Arc::new(remote),
        };
        assert_eq!(
            layered.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            vec![
                (1, "first 1"),
                (2, "local 2"),
                (5, "local 5"),
                (7, "first 7")
            ]
        );
    }
    use crate::config;
    use crate::resolve::resolved::Origin;

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
        super::super::plan_with_previous(
            &resolved_of(docs, node),
            node,
            |_| Some(7),
            &BTreeMap::new(),
            &BTreeMap::new(),
            vteps6,
            &mut Cache::default(),
        )
    }

    /// `docs` validated and resolved (IPAM with no claims) for `node`.
    fn resolved_of(docs: &str, node: &str) -> Resolved {
        let snap = crate::round::tests::snapshot_of(docs);
        let mut cfg = Resolved::new(crate::round::validate(
            &snap,
            node,
            &crate::config::AcceptedKeys::new(),
        ));
        let _ = crate::resolve::ipam::assign(&mut cfg, &Default::default());
        cfg
    }

    fn cached(cfg: &Resolved, cache: &mut Cache) -> Plan {
        let (ids, services, vteps6) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        super::super::plan_with_previous(cfg, "a", |_| Some(7), &ids, &services, &vteps6, cache)
    }

    fn uncached(cfg: &Resolved) -> Plan {
        cached(cfg, &mut Cache::default())
    }

    /// A VM of this node coming takes other nodes' part of the plan as
    /// the last plan had it (the same shared maps, not built again); a
    /// VM of another node changing its address builds it again. Either way
    /// the plan is the one a plan without the cache gives.
    #[test]
    fn other_nodes_part_is_kept_until_a_vm_interface_it_reads_changes() {
        let mut cfg = resolved_of(DOCS, "a");
        let mut cache = Cache::default();
        let first = cached(&cfg, &mut cache);
        assert_eq!(first, uncached(&cfg));
        // vm2 (vm3 has no MAC to place; vm4's node c has no Node).
        assert_eq!(first.endpoints.remote.len(), 1);

        // A new VM on this node (a document of its own).
        let mut local = (*cfg.attachments[0].spec).clone();
        local.key = local.key.with_vm("vm9");
        local.source.name = "vm9".into();
        local.mac = Some([0x52, 0x54, 0, 0, 0, 9]);
        cfg.attachments
            .push(Arc::new(crate::resolve::resolved::Attachment::given(
                Arc::new(local),
            )));
        cfg.reindex();
        let second = cached(&cfg, &mut cache);
        assert!(Arc::ptr_eq(
            &first.endpoints.remote,
            &second.endpoints.remote
        ));
        assert!(Arc::ptr_eq(
            &first.addresses.remote,
            &second.addresses.remote
        ));
        assert_eq!(second, uncached(&cfg));
        assert_ne!(second, first, "vm9's endpoint is new");

        // vm2 (on b) takes another address: the same document, another
        // resolved address.
        let vm2 = cfg
            .attachments
            .iter_mut()
            .find(|a| a.key.vm == "vm2")
            .unwrap();
        Arc::make_mut(vm2).addresses =
            vec![("10.20.0.99/16".parse().unwrap(), Origin::Claimed)].into();
        let third = cached(&cfg, &mut cache);
        assert!(!Arc::ptr_eq(
            &second.addresses.remote,
            &third.addresses.remote
        ));
        assert_eq!(third, uncached(&cfg));
        assert!(
            third
                .addresses
                .contains_key(&crate::plan::addr_key(100, "10.20.0.99".parse().unwrap()))
        );
        assert!(
            !third
                .addresses
                .contains_key(&crate::plan::addr_key(100, "10.20.0.12".parse().unwrap()))
        );

        // A Node moving its address builds it again too.
        cfg.config = Arc::new({
            let mut c = (*cfg.config).clone();
            c.nodes.get_mut("b").unwrap().address = "192.0.2.22".parse().unwrap();
            c
        });
        let fourth = cached(&cfg, &mut cache);
        assert_eq!(fourth, uncached(&cfg));
        assert_eq!(
            fourth.endpoints[&EndpointKey::new(100, [0x52, 0x54, 0, 0, 0, 2])].node_ip4,
            [192, 0, 2, 22]
        );
    }

    /// Rounds carry their lists over: a list carried whole and unchanged
    /// keeps other nodes' part without a look at its entries; an entry
    /// IPAM changed, or a migration's cut-over (found again every round,
    /// outside the marks), is seen. Every plan is the one without a cache.
    #[test]
    fn a_list_carried_over_unchanged_keeps_other_nodes_part() {
        let carried = |cfg: &Resolved| {
            let (mut next, _) =
                Resolved::carrying(cfg.config.clone(), "a", cfg.attachments.clone());
            let _ = crate::resolve::ipam::assign(&mut next, &Default::default());
            next
        };
        let (mut cfg, _) = Resolved::carrying(resolved_of(DOCS, "a").config, "a", Vec::new());
        let _ = crate::resolve::ipam::assign(&mut cfg, &Default::default());
        let mut cache = Cache::default();
        let first = cached(&cfg, &mut cache);
        let builds = cache.builds;
        let cfg = carried(&cfg);
        assert!(cfg.carried_whole() && !cfg.migrating());
        let second = cached(&cfg, &mut cache);
        assert_eq!(cache.builds, builds, "held from the marks");
        assert!(Arc::ptr_eq(
            &first.endpoints.remote,
            &second.endpoints.remote
        ));
        assert_eq!(second, uncached(&cfg));
        // A VM of this node comes (a changed entry the overlay does not
        // read): still held; one of node b comes: built again.
        let with = |cfg: &Resolved, vm: &str, node: &str, mac: u8| {
            let mut config = (*cfg.config).clone();
            let mut doc = (*config.attachments[0]).clone();
            doc.key = doc.key.with_vm(vm);
            doc.source.name = vm.into();
            doc.node = node.into();
            doc.port = format!("p-{vm}").into();
            doc.mac = Some([0x52, 0x54, 0, 0, 0, mac]);
            let at = config.attachments.partition_point(|a| a.key < doc.key);
            config.attachments.insert(at, Arc::new(doc));
            let (mut next, _) = Resolved::carrying(Arc::new(config), "a", cfg.attachments.clone());
            let _ = crate::resolve::ipam::assign(&mut next, &Default::default());
            next
        };
        let cfg = with(&cfg, "vm15", "a", 0x15);
        let local = cached(&cfg, &mut cache);
        assert_eq!(cache.builds, builds, "a VM here: held from the marks");
        assert_eq!(local, uncached(&cfg));
        let cfg = with(&cfg, "vm16", "b", 0x16);
        let remote_came = cached(&cfg, &mut cache);
        assert_eq!(cache.builds, builds + 1, "a VM of node b: built again");
        assert_eq!(remote_came, uncached(&cfg));
        let builds = cache.builds;
        // vm2's address changed by IPAM (marked): built again.
        let mut cfg = carried(&cfg);
        cfg.attachment_mut(&crate::config::AttachmentKey::new(
            "prod".into(),
            "vm2".into(),
            "eth0".into(),
        ))
        .unwrap()
        .addresses = vec![("10.20.0.99/16".parse().unwrap(), Origin::Claimed)].into();
        let third = cached(&cfg, &mut cache);
        assert_eq!(cache.builds, builds + 1);
        assert_eq!(third, uncached(&cfg));

        // vm2 migrating to a: its cut-over, set as the data path's is
        // found (not through the marks), moves it here.
        let docs = DOCS.replace(
            "port: p2, mac: '52:54:00:00:00:02'",
            "port: p2, mac: '52:54:00:00:00:02', migration: {targetNode: a, targetPort: t2}",
        );
        let (mut cfg, _) = Resolved::carrying(resolved_of(&docs, "a").config, "a", Vec::new());
        let _ = crate::resolve::ipam::assign(&mut cfg, &Default::default());
        let mut cache = Cache::default();
        let pending = cached(&cfg, &mut cache);
        let mut cfg = carried(&cfg);
        assert!(cfg.carried_whole() && cfg.migrating());
        for a in cfg.attachments.iter_mut().filter(|a| a.migrates) {
            Arc::make_mut(a).cut_over = true;
        }
        let cut = cached(&cfg, &mut cache);
        assert_eq!(cut, uncached(&cfg));
        assert_ne!(
            cut.endpoints.remote, pending.endpoints.remote,
            "vm2 is here now"
        );
    }

    /// A config resolved for its node (each VM interface knowing whether it
    /// is elsewhere) plans what one resolved without a node plans, from
    /// every node's side, before and after a cut-over.
    #[test]
    fn knowing_what_is_elsewhere_plans_the_same() {
        let docs = DOCS.replace(
            "port: p1, mac: '52:54:00:00:00:01'}",
            "port: p1, mac: '52:54:00:00:00:01', migration: {targetNode: b, targetPort: t1}}",
        );
        for node in ["a", "b", "c"] {
            for cut_over in [false, true] {
                let mut unknown = resolved_of(&docs, node);
                let mut known = Resolved::for_node(unknown.config.clone(), node);
                let _ = crate::resolve::ipam::assign(&mut known, &Default::default());
                for cfg in [&mut unknown, &mut known] {
                    Arc::make_mut(&mut cfg.attachments[0]).cut_over = cut_over;
                }
                assert!(known.attachments.iter().any(|a| a.elsewhere) || node == "a");
                let plan = |cfg: &Resolved| {
                    let (ids, services, vteps6) =
                        (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
                    super::super::plan_with_previous(
                        cfg,
                        node,
                        |_| Some(7),
                        &ids,
                        &services,
                        &vteps6,
                        &mut Cache::default(),
                    )
                };
                assert_eq!(
                    plan(&known),
                    plan(&unknown),
                    "from {node}, cut over {cut_over}"
                );
            }
        }
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
                .iter()
                .filter(|(_, e)| e.kind == ENDPOINT_REMOTE)
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
        let validated = crate::round::validate(&snap, node, &crate::config::AcceptedKeys::new());
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
