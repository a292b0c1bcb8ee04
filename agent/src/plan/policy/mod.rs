//! NetworkPolicy compiled into what the data path looks up (after
//! Cilium): an identity per label set, an address -> identity LPM cache
//! per network, and per local endpoint the (direction, peer identity,
//! protocol, port) entries its policies allow. Nothing here is walked per
//! packet.
//!
//! ipBlocks become identities too: every ipBlock CIDR and except is a
//! prefix of the cache, and the identity of an address says, besides its
//! endpoint's labels, which ipBlocks (CIDR minus excepts) contain it. The
//! longest cached prefix holding an address always gives that set right:
//! every boundary of every ipBlock is itself a cached prefix.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;
use vmpath_common::{
    IdentityPrefix, MAX_POLICIES, MAX_POLICY_PREFIXES, MAX_POLICY_RULES, POL_F_EGRESS,
    POL_F_INGRESS, POLICY_LEN_IDENTITY, POLICY_LEN_PROTO, PolicyEndpoint, PolicyRuleKey, identity,
    policy_dir,
};

use crate::{
    config::{
        AttachmentKey, NamedPort,
        label_selector::Labels,
        network_policy::{NetworkPolicy, Peer, PortRef, Rule},
    },
    resolve::resolved::Resolved,
};

/// What the policy maps must hold on this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// Port id -> isolation (0: no policy selects it) and identity, for
    /// every local endpoint.
    pub endpoints: BTreeMap<u32, PolicyEndpoint>,
    /// (LPM length, prefix) -> identity (`vmp_pol_ipcache`).
    pub ipcache: BTreeMap<(u32, IdentityPrefix), u32>,
    /// (LPM length, rule key) -> policy index (`vmp_pol_rules`).
    pub rules: BTreeMap<(u32, PolicyRuleKey), u32>,
    /// Policy index -> `namespace/name`.
    pub policies: Vec<String>,
    /// Local endpoint -> the policies selecting it.
    pub selected_by: BTreeMap<AttachmentKey, Vec<u32>>,
    /// Every endpoint (local or not) -> the identity of what it sends
    /// from an address other than its first (its first address's, or its
    /// labels' alone without one): what its frames carry on the node that
    /// receives them over the overlay (`Endpoint::identity`).
    pub senders: BTreeMap<AttachmentKey, u32>,
    /// Per network with a port isolated for ingress, its flood list less
    /// those ports (`vmp_pol_flood`; filled by `plan`, which knows the
    /// flood lists).
    pub flood: BTreeMap<u32, vmpath_common::FloodList>,
    /// Limits hit (what was left out denies, never allows).
    pub problems: Vec<String>,
}

impl Compiled {
    /// The flood lists IP floods use: `flood` less the ports isolated for
    /// ingress, for the networks that have such ports.
    pub fn guard_floods(&mut self, flood: &BTreeMap<u32, vmpath_common::FloodList>) {
        let isolated = |id: u32| {
            self.endpoints
                .get(&id)
                .is_some_and(|e| e.flags & POL_F_INGRESS != 0)
        };
        let mut out = BTreeMap::new();
        for (net, list) in flood {
            let n = list.count as usize;
            if !list.port_id[..n].iter().any(|id| isolated(*id)) {
                continue;
            }
            let mut guarded = vmpath_common::FloodList::default();
            for i in 0..n {
                if isolated(list.port_id[i]) {
                    guarded.withheld += 1;
                } else {
                    let j = guarded.count as usize;
                    guarded.ifindex[j] = list.ifindex[i];
                    guarded.port_id[j] = list.port_id[i];
                    guarded.count += 1;
                }
            }
            out.insert(*net, guarded);
        }
        self.flood = out;
    }
}

/// What an identity stands for: an endpoint's (namespace, labels), or
/// none (an address outside every endpoint), and the ipBlocks holding it.
type IdentityKey = (Option<(String, Labels)>, BTreeSet<usize>);

struct Endpoint<'a> {
    key: &'a AttachmentKey,
    network: u32,
    labels: &'a Labels,
    addresses: Vec<IpAddr>,
    ports: &'a [NamedPort],
}

/// Compiles `cfg`'s policies for the local endpoints `local` (VM
/// interface -> port id).
pub fn compile(cfg: &Resolved, local: &BTreeMap<AttachmentKey, u32>) -> Compiled {
    let policies = &cfg.config.policies;
    let mut out = Compiled {
        policies: policies
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect(),
        ..Default::default()
    };
    if policies.is_empty() {
        return out;
    }
    if policies.len() > MAX_POLICIES as usize {
        out.problems.push(format!(
            "{} NetworkPolicies, only the first {MAX_POLICIES} are counted per policy",
            policies.len()
        ));
    }
    let endpoints: Vec<Endpoint> = cfg
        .attachments
        .iter()
        .filter_map(|a| {
            Some(Endpoint {
                key: &a.key,
                network: cfg.network(&a.network)?.id,
                labels: &a.labels,
                addresses: a.addresses.iter().map(|(ip, _)| ip.addr()).collect(),
                ports: &a.ports,
            })
        })
        .collect();
    let blocks: Vec<(IpNet, &[IpNet])> = policies
        .iter()
        .flat_map(|p| p.ingress.iter().chain(p.egress.iter()).flatten())
        .flat_map(|r| &r.peers)
        .filter_map(|peer| match peer {
            Peer::IpBlock { cidr, except } => Some((*cidr, except.as_slice())),
            Peer::Endpoints { .. } => None,
        })
        .collect();

    // Identities: every endpoint address and every ipBlock boundary, in
    // each network with a local endpoint.
    let mut ids = Identities::new(&blocks);
    let networks: BTreeSet<u32> = endpoints
        .iter()
        .filter(|e| local.contains_key(e.key))
        .map(|e| e.network)
        .collect();
    let mut endpoint_ids: BTreeMap<&AttachmentKey, BTreeSet<u32>> = BTreeMap::new();
    // Per endpoint, the identity of what its port sends from an address
    // other than its first configured one: its first address's, or its
    // labels' alone when it has none configured.
    let mut port_ids: BTreeMap<&AttachmentKey, u32> = BTreeMap::new();
    for e in &endpoints {
        for addr in &e.addresses {
            let host = IpNet::from(*addr);
            let id = ids.intern((
                Some((e.key.namespace.to_string(), e.labels.clone())),
                holding(&blocks, &host),
            ));
            endpoint_ids.entry(e.key).or_default().insert(id);
            port_ids.entry(e.key).or_insert(id);
            if networks.contains(&e.network) {
                out.ipcache.insert(cache_key(e.network, &host), id);
            }
        }
        // An endpoint without configured addresses (IPAM-less, learned)
        // still has its labels' identity: the data path gives it to the
        // frames its port sends, whatever their source address.
        if e.addresses.is_empty() {
            let id = ids.intern((
                Some((e.key.namespace.to_string(), e.labels.clone())),
                BTreeSet::new(),
            ));
            endpoint_ids.entry(e.key).or_default().insert(id);
            port_ids.insert(e.key, id);
        }
    }
    for (cidr, except) in &blocks {
        for prefix in std::iter::once(cidr).chain(except.iter()) {
            let id = ids.intern((None, holding(&blocks, prefix)));
            for net in &networks {
                // An endpoint's own address keeps its endpoint identity.
                out.ipcache.entry(cache_key(*net, prefix)).or_insert(id);
            }
        }
    }
    if out.ipcache.len() > MAX_POLICY_PREFIXES as usize {
        out.problems.push(format!(
            "{} address prefixes for policy, more than the {MAX_POLICY_PREFIXES} the data path holds",
            out.ipcache.len()
        ));
    }

    let block_index = BlockIndex::new(&blocks, &ids);
    for e in endpoints.iter() {
        let Some(&port_id) = local.get(e.key) else {
            continue;
        };
        let mut flags = 0;
        for (index, p) in policies.iter().enumerate() {
            if p.namespace != e.key.namespace || !p.pod_selector.matches(e.labels) {
                continue;
            }
            out.selected_by
                .entry(e.key.clone())
                .or_default()
                .push(index as u32);
            for (dir, rules, bit) in [
                (policy_dir::INGRESS, &p.ingress, POL_F_INGRESS),
                (policy_dir::EGRESS, &p.egress, POL_F_EGRESS),
            ] {
                let Some(rules) = rules else { continue };
                flags |= bit;
                for rule in rules {
                    let ctx = RuleCtx {
                        cfg,
                        blocks: &block_index,
                        policy: p,
                        ids: &ids,
                        endpoints: &endpoints,
                        endpoint_ids: &endpoint_ids,
                        me: e,
                    };
                    for (peer, proto, lo, hi) in ctx.entries(dir, rule) {
                        insert(
                            &mut out.rules,
                            port_id,
                            dir,
                            peer,
                            proto,
                            lo,
                            hi,
                            index as u32,
                        );
                    }
                }
            }
        }
        // Every local endpoint, selected or not (flags 0): its identity is
        // that of the frames its port sends (`ebpf/src/policy.rs`).
        let own = port_ids.get(e.key).copied().unwrap_or(identity::WORLD);
        out.endpoints.insert(
            port_id,
            PolicyEndpoint {
                flags,
                identity: own,
            },
        );
    }
    out.senders = port_ids.iter().map(|(k, id)| ((*k).clone(), *id)).collect();
    if out.rules.len() > MAX_POLICY_RULES as usize {
        out.problems.push(format!(
            "{} policy rule entries, more than the {MAX_POLICY_RULES} the data path holds: the rest deny",
            out.rules.len()
        ));
        let keep: BTreeMap<_, _> = out
            .rules
            .iter()
            .take(MAX_POLICY_RULES as usize)
            .map(|(k, v)| (*k, *v))
            .collect();
        out.rules = keep;
    }
    out
}

/// Identity numbers come from what an identity is (namespace, labels,
/// the ipBlocks holding it), not from the order compiling met it: a policy
/// or endpoint added elsewhere leaves every other identity's number as it
/// was, also across agent restarts. A number that changed meaning between
/// two compiles would, while the maps are rewritten one entry at a time,
/// let a new flow be checked against another identity's rules.
struct Identities<'b> {
    by_key: BTreeMap<IdentityKey, u32>,
    taken: BTreeSet<u32>,
    blocks: &'b [(IpNet, &'b [IpNet])],
}

impl<'b> Identities<'b> {
    fn new(blocks: &'b [(IpNet, &'b [IpNet])]) -> Self {
        Identities {
            by_key: BTreeMap::new(),
            taken: BTreeSet::new(),
            blocks,
        }
    }

    fn intern(&mut self, key: IdentityKey) -> u32 {
        if key.0.is_none() && key.1.is_empty() {
            return identity::WORLD;
        }
        if let Some(id) = self.by_key.get(&key) {
            return *id;
        }
        // A hash collision (rare: thousands of identities in 2^32) takes
        // the next free number; only then does the order matter.
        let mut id = stable_number(&key, self.blocks);
        while self.taken.contains(&id) {
            id = id.checked_add(1).unwrap_or(identity::FIRST);
        }
        self.taken.insert(id);
        self.by_key.insert(key, id);
        id
    }
}

/// FIRST..=u32::MAX from an FNV-1a hash of the identity's content: its
/// endpoint namespace and labels, and the ipBlocks (by value, not by
/// their index in this compile) that hold its addresses.
fn stable_number(key: &IdentityKey, blocks: &[(IpNet, &[IpNet])]) -> u32 {
    let mut text = String::new();
    if let Some((ns, labels)) = &key.0 {
        text.push_str(&format!("ns={ns}\0"));
        for (k, v) in labels {
            text.push_str(&format!("l={k}={v}\0"));
        }
    }
    let held: BTreeSet<String> = key
        .1
        .iter()
        .filter_map(|i| blocks.get(*i))
        .map(|(cidr, except)| {
            let except: Vec<String> = except.iter().map(|e| e.to_string()).collect();
            format!("b={cidr}/{}", except.join(","))
        })
        .collect();
    for b in held {
        text.push_str(&b);
        text.push('\0');
    }
    let span = u64::from(u32::MAX - identity::FIRST) + 1;
    identity::FIRST + (crate::sys::hash::fnv1a(&[text.as_bytes()]) % span) as u32
}

/// The ipBlocks (by index) that hold all of `prefix`: inside the CIDR and
/// inside none of its excepts.
fn holding(blocks: &[(IpNet, &[IpNet])], prefix: &IpNet) -> BTreeSet<usize> {
    blocks
        .iter()
        .enumerate()
        .filter(|(_, (cidr, except))| {
            cidr.contains(prefix) && !except.iter().any(|e| e.contains(prefix))
        })
        .map(|(i, _)| i)
        .collect()
}

fn cache_key(network: u32, prefix: &IpNet) -> (u32, IdentityPrefix) {
    match prefix {
        IpNet::V4(p) => (
            IdentityPrefix::v4_len(p.prefix_len()),
            IdentityPrefix::v4(network, p.network().octets()),
        ),
        IpNet::V6(p) => (
            IdentityPrefix::v6_len(p.prefix_len()),
            IdentityPrefix::v6(network, p.network().octets()),
        ),
    }
}

struct RuleCtx<'a> {
    cfg: &'a Resolved,
    blocks: &'a BlockIndex<'a>,
    policy: &'a NetworkPolicy,
    ids: &'a Identities<'a>,
    endpoints: &'a [Endpoint<'a>],
    endpoint_ids: &'a BTreeMap<&'a AttachmentKey, BTreeSet<u32>>,
    me: &'a Endpoint<'a>,
}

/// (peer identity, protocol, first port, last port); protocol 0: any
/// protocol, ports 0..=0: any port.
type Entry = (u32, u8, u16, u16);

impl RuleCtx<'_> {
    /// The entries one rule gives the endpoint going `dir`.
    fn entries(&self, dir: u8, rule: &Rule) -> Vec<Entry> {
        // Peers: identities, or any (no peers given).
        let peers: Vec<(u32, Vec<&Endpoint>)> = if rule.peers.is_empty() {
            vec![(identity::ANY, self.endpoints.iter().collect())]
        } else {
            let mut set: BTreeMap<u32, Vec<&Endpoint>> = BTreeMap::new();
            for peer in &rule.peers {
                match peer {
                    // Through the index: a walk of every identity per
                    // ipBlock is quadratic in the policies' blocks.
                    Peer::IpBlock { cidr, except } => {
                        let same = self.blocks.by_value.get(&(*cidr, except.as_slice()));
                        for i in same.into_iter().flatten() {
                            for id in self.blocks.holders.get(i).into_iter().flatten() {
                                set.entry(*id).or_default();
                            }
                        }
                    }
                    Peer::Endpoints { .. } => {
                        for (key, id) in &self.ids.by_key {
                            if self.peer_matches(peer, key) {
                                set.entry(*id).or_default();
                            }
                        }
                    }
                }
            }
            // The endpoints behind each identity, for named ports of egress.
            for e in self.endpoints {
                for id in self.endpoint_ids.get(e.key).into_iter().flatten() {
                    if let Some(list) = set.get_mut(id) {
                        list.push(e);
                    }
                }
            }
            set.into_iter().collect()
        };
        let mut out = Vec::new();
        for (peer, behind) in peers {
            if rule.ports.is_empty() {
                out.push((peer, 0, 0, 0));
                continue;
            }
            for port in &rule.ports {
                match &port.port {
                    PortRef::Any => out.push((peer, port.protocol, 0, 0)),
                    PortRef::Range(lo, hi) => out.push((peer, port.protocol, *lo, *hi)),
                    PortRef::Named(name) => {
                        // Ingress: the port the endpoint itself declares;
                        // egress: the one each peer declares.
                        let declared: Vec<&NamedPort> = if dir == policy_dir::INGRESS {
                            self.me.ports.iter().collect()
                        } else {
                            behind.iter().flat_map(|e| e.ports.iter()).collect()
                        };
                        let numbers: BTreeSet<u16> = declared
                            .iter()
                            .filter(|d| d.name == *name && d.protocol == port.protocol)
                            .map(|d| d.port)
                            .collect();
                        for n in numbers {
                            out.push((peer, port.protocol, n, n));
                        }
                    }
                }
            }
        }
        out
    }

    /// Whether an endpoint identity is one `peer` (a selector) names.
    fn peer_matches(&self, peer: &Peer, key: &IdentityKey) -> bool {
        match peer {
            Peer::IpBlock { .. } => false,
            Peer::Endpoints { namespaces, pods } => {
                let Some((ns, labels)) = &key.0 else {
                    return false;
                };
                let ns_ok = match namespaces {
                    None => *ns == self.policy.namespace,
                    Some(sel) => sel.matches(&self.cfg.config.namespace_labels(ns)),
                };
                ns_ok && pods.as_ref().is_none_or(|sel| sel.matches(labels))
            }
        }
    }
}

/// Every policy's ipBlocks, indexed both ways once per compile.
struct BlockIndex<'a> {
    /// (cidr, except) -> the indices of the blocks equal to it (equal
    /// blocks hold the same addresses).
    by_value: BTreeMap<(IpNet, &'a [IpNet]), Vec<usize>>,
    /// Block index -> the identities whose addresses it holds.
    holders: BTreeMap<usize, BTreeSet<u32>>,
}

impl<'a> BlockIndex<'a> {
    fn new(blocks: &[(IpNet, &'a [IpNet])], ids: &Identities) -> Self {
        let mut by_value: BTreeMap<(IpNet, &[IpNet]), Vec<usize>> = BTreeMap::new();
        for (i, (cidr, except)) in blocks.iter().enumerate() {
            by_value.entry((*cidr, *except)).or_default().push(i);
        }
        let mut holders: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
        for (key, id) in &ids.by_key {
            for i in &key.1 {
                holders.entry(*i).or_default().insert(*id);
            }
        }
        BlockIndex { by_value, holders }
    }
}

#[allow(clippy::too_many_arguments)]
fn insert(
    rules: &mut BTreeMap<(u32, PolicyRuleKey), u32>,
    port_id: u32,
    dir: u8,
    peer: u32,
    proto: u8,
    lo: u16,
    hi: u16,
    policy: u32,
) {
    if proto == 0 {
        let key = PolicyRuleKey::new(port_id, dir, peer, 0, 0);
        rules.entry((POLICY_LEN_IDENTITY, key)).or_insert(policy);
        return;
    }
    if lo == 0 {
        let key = PolicyRuleKey::new(port_id, dir, peer, proto, 0);
        rules.entry((POLICY_LEN_PROTO, key)).or_insert(policy);
        return;
    }
    for (port, bits) in port_prefixes(lo, hi) {
        let key = PolicyRuleKey::new(port_id, dir, peer, proto, port);
        rules
            .entry((POLICY_LEN_PROTO + bits, key))
            .or_insert(policy);
    }
}

/// The fewest (first port, prefix bits) covering `lo..=hi` exactly.
pub fn port_prefixes(lo: u16, hi: u16) -> Vec<(u16, u32)> {
    let (mut lo, hi) = (u32::from(lo), u32::from(hi));
    let mut out = Vec::new();
    while lo <= hi {
        // The largest aligned block starting at `lo` that stays in range.
        let mut size: u32 = if lo == 0 {
            1 << 16
        } else {
            lo & lo.wrapping_neg()
        };
        while lo + size - 1 > hi {
            size >>= 1;
        }
        out.push((lo as u16, 16 - size.trailing_zeros()));
        lo += size;
    }
    out
}

#[cfg(test)]
mod tests;
