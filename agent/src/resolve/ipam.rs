//! IPAM with persistent claims, and MAC resolution.
//!
//! Every node computes the claims of every attachment in the config, not
//! only its own, in the same deterministic way (existing claims first, then
//! new ones by a probe that starts at a hash of the VM interface), so all
//! nodes agree on a VM's address and a migrated VM finds its claim already
//! there.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

use crate::sys::hash::{HashMap, HashSet};
use crate::sys::ip_map::IpSet;
use crate::{
    config::{AttachmentKey, Network, format_mac, model::MacPolicy},
    resolve::resolved::{Origin, Resolved},
    resolve::store::{Claim, Claims},
    sys::hash::fnv1a,
};

/// The addresses IPAM may hand out from one subnet.
#[derive(Debug, Clone)]
pub struct Pool {
    subnet: IpNet,
    excluded: Vec<IpNet>,
    reserved: HashSet<IpAddr>,
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn from_u128(v: u128, v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(v))
    } else {
        IpAddr::V4(Ipv4Addr::from(v as u32))
    }
}

impl Pool {
    /// `excluded` subnets and `reserved` addresses (the gateways) are never
    /// handed out.
    pub fn new(subnet: IpNet, excluded: &[IpNet], reserved: &[IpAddr]) -> Self {
        Pool {
            subnet,
            excluded: excluded
                .iter()
                .copied()
                .filter(|e| subnet.contains(e) || e.contains(&subnet))
                .collect(),
            reserved: reserved
                .iter()
                .copied()
                .filter(|r| subnet.contains(r))
                .collect(),
        }
    }

    pub fn subnet(&self) -> IpNet {
        self.subnet
    }

    /// First and last address a host may have: IPv4 skips the network and
    /// broadcast addresses (except /31 and /32), IPv6 the subnet-router
    /// anycast address.
    fn range(&self) -> (u128, u128) {
        let first = to_u128(self.subnet.network());
        let last = to_u128(self.subnet.broadcast());
        match self.subnet {
            IpNet::V4(n) if n.prefix_len() >= 31 => (first, last),
            IpNet::V4(_) => (first + 1, last - 1),
            IpNet::V6(n) if n.prefix_len() == 128 => (first, last),
            IpNet::V6(_) => (first + 1, last),
        }
    }

    fn excluded_range(&self, v: u128, v6: bool) -> Option<u128> {
        let ip = from_u128(v, v6);
        self.excluded
            .iter()
            .find(|e| e.contains(&ip))
            .map(|e| to_u128(e.broadcast()))
    }

    /// May IPAM hand `ip` out at all (ignoring who holds what)?
    pub fn allocatable(&self, ip: IpAddr) -> bool {
        let (first, last) = self.range();
        let v = to_u128(ip);
        self.subnet.contains(&ip)
            && (first..=last).contains(&v)
            && !self.reserved.contains(&ip)
            && !self.excluded.iter().any(|e| e.contains(&ip))
    }

    /// How many addresses the pool can hand out in all.
    pub fn capacity(&self) -> u128 {
        let (first, last) = self.range();
        let v6 = self.subnet.addr().is_ipv6();
        let mut excluded = 0u128;
        // Excluded subnets may overlap each other: count each address once.
        let mut spans: Vec<(u128, u128)> = self
            .excluded
            .iter()
            .map(|e| {
                (
                    to_u128(e.network()).max(first),
                    to_u128(e.broadcast()).min(last),
                )
            })
            .filter(|(a, b)| a <= b)
            .collect();
        spans.sort();
        let mut end: Option<u128> = None;
        for (a, b) in spans {
            let a = match end {
                Some(e) if a <= e => e + 1,
                _ => a,
            };
            if a <= b {
                excluded += b - a + 1;
            }
            end = Some(end.map_or(b, |e| e.max(b)));
        }
        let reserved = self
            .reserved
            .iter()
            .filter(|r| {
                let v = to_u128(**r);
                (first..=last).contains(&v) && self.excluded_range(v, v6).is_none()
            })
            .count() as u128;
        (last - first + 1) - excluded - reserved
    }

    /// A free address, probing from a position derived from `seed` so that
    /// the same VM interface lands on the same address on every node.
    pub fn allocate(&self, seed: u64, taken: &IpSet) -> Option<IpAddr> {
        let (first, last) = self.range();
        let v6 = self.subnet.addr().is_ipv6();
        let size = last - first + 1;
        let mut candidate = first + u128::from(seed) % size;
        // Every step passes over at least one address: at most `size` steps.
        let mut passed: u128 = 0;
        while passed < size {
            if let Some(end) = self.excluded_range(candidate, v6) {
                let end = end.min(last);
                passed += end - candidate + 1;
                candidate = if end >= last { first } else { end + 1 };
                continue;
            }
            let ip = from_u128(candidate, v6);
            if !self.reserved.contains(&ip) && !taken.contains(&ip) {
                return Some(ip);
            }
            passed += 1;
            candidate = if candidate >= last {
                first
            } else {
                candidate + 1
            };
        }
        None
    }
}

fn pools(net: &Network) -> Vec<Pool> {
    net.subnets
        .iter()
        .map(|s| Pool::new(*s, &net.exclude_subnets, &net.gateway_ips))
        .collect()
}

/// A MAC for `macPolicy: Generate`: locally administered, unicast, stable.
pub fn generated_mac(key: &AttachmentKey, attempt: u32) -> [u8; 6] {
    let h = fnv1a(&[b"mac", key.to_string().as_bytes(), &attempt.to_be_bytes()]).to_be_bytes();
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

/// Claims to write (`Some`) or release (`None`), by claim key.
pub type ClaimChanges = BTreeMap<String, Option<Claim>>;

/// Resolves every attachment's addresses and MAC against the claims,
/// allocating and generating what is missing, refusing what conflicts, and
/// releasing claims whose Attachment document is gone. The validated
/// config inside `cfg` is only read.
///
/// One pass per attachment over maps that borrow the claims and the
/// config (networks by index, no copy of a claim or a name per entry): at
/// 10,000 VM interfaces the copies, not the decisions, were the cost.
pub fn assign(cfg: &mut Resolved, claims: &Claims) -> ClaimChanges {
    assign_settled(cfg, claims).0
}

/// [`assign`], and whether every result stands on its own: no refusal,
/// no pool ran dry, no MAC had to give way to another's. Only then may
/// the next round decide just the VM interfaces that changed
/// (`ipam_memo`): otherwise one VM's leaving could change another's
/// result.
pub fn assign_settled(cfg: &mut Resolved, claims: &Claims) -> (ClaimChanges, bool) {
    let mut changes = ClaimChanges::new();
    let config = cfg.config.clone();
    let net_index = network_index(&config.networks);
    // Keys as their borrowed parts: nothing is printed to match a claim
    // with its VM interface.
    let kept = cfg.kept_claims.clone();
    let in_documents: HashSet<(&str, &str, &str)> = config
        .keys_in_documents
        .iter()
        .chain(kept.iter())
        .map(AttachmentKey::parts)
        .collect();
    // Addresses held per network (by index): claims first, then static
    // requests. A claim on a network the config does not have holds
    // nothing any attachment could ask for. Filled in the claims' key
    // order, so that of two claims of one address the same one wins
    // every round.
    let mut held: HashMap<(usize, IpAddr), &str> = HashMap::default();
    let mut live: HashMap<(&str, &str, &str), &Claim> =
        HashMap::with_capacity_and_hasher(claims.len(), Default::default());
    for (key, claim) in claims {
        let Some(k) = AttachmentKey::parts_of(key).filter(|k| in_documents.contains(k)) else {
            changes.insert(key.to_string(), None);
            continue;
        };
        live.insert(k, claim);
        if let Some(&n) = net_index.get(claim.network.as_str()) {
            for ip in &claim.ips {
                held.insert((n, ip.addr()), key);
            }
        }
    }
    drop(in_documents);

    // Static requests on IPAM networks must not take another VM's claim.
    let mut refusals = Vec::new();
    for a in &cfg.attachments {
        let Some(&n) = net_index.get(a.network.as_str()) else {
            continue;
        };
        if !config.networks[n].ipam || a.ips.is_empty() {
            continue;
        }
        if let Some((ip, holder)) = a.ips.iter().find_map(|ip| {
            held.get(&(n, ip.addr()))
                .filter(|h| AttachmentKey::parts_of(h) != Some(a.key.parts()))
                .map(|h| (ip.addr(), *h))
        }) {
            refusals.push((
                a.key.clone(),
                format!(
                    "IP {ip} is claimed by VM interface {holder} on network {:?}",
                    a.network
                ),
            ));
        }
    }
    let mut settled = refusals.is_empty();
    for (key, msg) in refusals {
        cfg.refuse(&key, "spec.ips", msg);
    }
    // From here on only which addresses are taken matters, not by whom.
    let mut taken: Taken = HashMap::default();
    for (n, ip) in held.keys() {
        taken.entry(*n).or_default().insert(*ip);
    }
    drop(held);
    for a in &cfg.attachments {
        if let Some(&n) = net_index.get(a.network.as_str())
            && config.networks[n].ipam
        {
            for ip in &a.ips {
                taken.entry(n).or_default().insert(ip.addr());
            }
        }
    }

    // MACs in use per network, to keep generated and detected ones unique.
    let mut macs: Macs = HashSet::default();
    for a in &cfg.attachments {
        if let (Some(m), Some(&n)) = (a.mac, net_index.get(a.network.as_str())) {
            macs.insert((n, m));
        }
    }

    for a in cfg.attachments.iter_mut() {
        let Some(&n) = net_index.get(a.network.as_str()) else {
            continue;
        };
        let old = live.get(&a.key.parts()).copied();
        let decided = decide(
            std::sync::Arc::make_mut(a),
            &config.networks[n],
            n,
            old,
            &mut taken,
            &mut macs,
            &mut changes,
        );
        settled &= decided.settled();
    }
    (changes, settled)
}

/// Networks by name -> index in the config's list.
pub(crate) fn network_index(networks: &[Network]) -> HashMap<&str, usize> {
    networks
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect()
}

/// Addresses taken, by network index.
pub(crate) type Taken = HashMap<usize, IpSet>;
/// MACs in use, by network index.
pub(crate) type Macs = HashSet<(usize, [u8; 6])>;

/// What deciding one VM interface met that ties its result to others'.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Decided {
    /// A pool had no address left for it: one freed later would be its.
    pub exhausted: bool,
    /// Its claimed or first generated MAC was another's.
    pub mac_gave_way: bool,
}

impl Decided {
    pub fn settled(self) -> bool {
        !self.exhausted && !self.mac_gave_way
    }
}

/// One VM interface `a` on network `net` (index `n`), whose claim was
/// `old`: its addresses and MAC, against what is `taken` and the `macs`
/// in use (both updated with what it gets), and its claim's change.
pub(crate) fn decide(
    a: &mut crate::resolve::resolved::Attachment,
    net: &Network,
    n: usize,
    old: Option<&Claim>,
    taken: &mut Taken,
    macs: &mut Macs,
    changes: &mut ClaimChanges,
) -> Decided {
    let mut decided = Decided::default();
    let previous = old.filter(|c| c.network == a.network);
    let mut mac: Option<[u8; 6]> = previous.and_then(|c| c.mac);
    let mut mac_origin = previous.and_then(|c| c.mac_origin);
    // What IPAM gave (`None`: the document's own addresses on an IPAM
    // network, or none elsewhere).
    let mut allocated: Option<Vec<IpNet>> = None;

    if net.ipam && a.ips.is_empty() {
        let pools = pools(net);
        // Keep what the VM holds while it is still inside a subnet.
        let mut kept: Vec<IpNet> = previous
            .map(|c| {
                c.ips
                    .iter()
                    .copied()
                    .filter(|ip| pools.iter().any(|p| p.subnet().contains(&ip.addr())))
                    .collect()
            })
            .unwrap_or_default();
        for v6 in [false, true] {
            if kept.iter().any(|ip| ip.addr().is_ipv6() == v6) {
                continue;
            }
            let Some(pool) = pools.iter().find(|p| p.subnet().addr().is_ipv6() == v6) else {
                continue;
            };

            let key = a.key.to_string();
            let seed = fnv1a(&[key.as_bytes(), &[u8::from(v6)]]);
            let net_taken = taken.entry(n).or_default();
            match pool.allocate(seed, net_taken) {
                Some(ip) => {
                    let net_ip = IpNet::new(ip, pool.subnet().prefix_len())
                        .expect("prefix of a valid subnet");
                    net_taken.insert(ip);
                    kept.push(net_ip);
                }
                None => {
                    decided.exhausted = true;
                    tracing::error!(vm = %a.key, network = %a.network, subnet = %pool.subnet(), "IPAM pool exhausted")
                }
            }
        }
        a.addresses = kept.iter().map(|ip| (*ip, Origin::Claimed)).collect();
        allocated = Some(kept);
    }

    if a.mac.is_none() {
        let from_claim = mac.zip(mac_origin);
        if from_claim.is_some_and(|(m, _)| macs.contains(&(n, m))) {
            decided.mac_gave_way = true;
        }
        a.mac_resolved = match from_claim {
            Some((m, origin)) if !macs.contains(&(n, m)) => Some((m, origin)),
            _ if a.mac_policy == MacPolicy::Generate => {
                let (i, m) = (0..)
                    .map(|i| (i, generated_mac(&a.key, i)))
                    .find(|(_, m)| !macs.contains(&(n, *m)))
                    .unwrap();
                decided.mac_gave_way |= i > 0;
                mac = Some(m);
                mac_origin = Some(Origin::Generated);
                Some((m, Origin::Generated))
            }
            _ => None,
        };
        if let Some((m, _)) = a.mac_resolved {
            macs.insert((n, m));
        }
    } else {
        // A given MAC overrides anything detected before.
        mac = None;
        mac_origin = None;
    }

    let ips: &[IpNet] = match &allocated {
        Some(v) => v,
        None if net.ipam => &a.spec.ips,
        None => &[],
    };
    let wanted = !(ips.is_empty() && mac.is_none());
    let unchanged = old.is_some_and(|c| {
        c.network == a.network && c.ips[..] == *ips && c.mac == mac && c.mac_origin == mac_origin
    });
    match (wanted, old) {
        (true, _) if unchanged => {}
        (true, _) => {
            changes.insert(
                a.key.to_string(),
                Some(Claim {
                    network: a.network.clone(),
                    ips: ips.to_vec(),
                    mac,
                    mac_origin,
                }),
            );
        }
        (false, Some(_)) => {
            changes.insert(a.key.to_string(), None);
        }
        (false, None) => {}
    }
    decided
}

/// Records a MAC seen in the VM's traffic into its claim. Returns the
/// change, or an error message when the MAC is another VM's.
pub fn detected_mac(
    cfg: &Resolved,
    claims: &Claims,
    key: &AttachmentKey,
    mac: [u8; 6],
) -> Result<ClaimChanges, String> {
    let Some(a) = cfg.attachments.iter().find(|a| &a.key == key) else {
        return Ok(ClaimChanges::new());
    };
    if a.mac.is_some() || a.mac_resolved.is_some() {
        return Ok(ClaimChanges::new());
    }
    if let Some(other) = cfg
        .attachments
        .iter()
        .find(|o| o.network == a.network && o.mac_resolved.map(|(m, _)| m) == Some(mac))
    {
        return Err(format!(
            "VM interface {key} uses MAC {}, which belongs to {} on network {:?}: not adopted",
            format_mac(&mac),
            other.key,
            a.network
        ));
    }
    let mut claim = claims
        .get::<str>(&key.to_string())
        .cloned()
        .unwrap_or(Claim {
            network: a.network.clone(),
            ips: Vec::new(),
            mac: None,
            mac_origin: None,
        });
    claim.mac = Some(mac);
    claim.mac_origin = Some(Origin::Detected);
    Ok(ClaimChanges::from([(key.to_string(), Some(claim))]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn a_24_with_a_26_excluded_yields_exactly_the_rest() {
        let gw: IpAddr = "10.0.0.1".parse().unwrap();
        // .0/26 excluded: .1-.63 go (the network address was never usable),
        // and the gateway sits inside the excluded range.
        let pool = Pool::new(net("10.0.0.0/24"), &[net("10.0.0.0/26")], &[gw]);
        assert_eq!(pool.capacity(), 254 - 63);
        let mut taken = IpSet::default();
        let mut seed = 7u64;
        while let Some(ip) = pool.allocate(seed, &taken) {
            assert!(!net("10.0.0.0/26").contains(&ip), "{ip} is excluded");
            assert!(taken.insert(ip), "{ip} handed out twice");
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
        }
        assert_eq!(taken.len(), 254 - 63);
        assert!(!taken.contains(&"10.0.0.255".parse::<IpAddr>().unwrap()));
        assert!(!taken.contains(&"10.0.0.0".parse::<IpAddr>().unwrap()));
    }

    #[test]
    fn same_seed_same_address() {
        let pool = Pool::new(
            net("fd00::/64"),
            &[net("fd00::/80")],
            &["fd00::1".parse().unwrap()],
        );
        let a = pool.allocate(42, &IpSet::default()).unwrap();
        assert_eq!(a, pool.allocate(42, &IpSet::default()).unwrap());
        assert!(!net("fd00::/80").contains(&a));
    }

    #[test]
    fn excluded_at_the_end_wraps() {
        let pool = Pool::new(net("10.1.0.0/29"), &[net("10.1.0.4/30")], &[]);
        // usable .1-.6, .4-.6 excluded -> .1 .2 .3
        assert_eq!(pool.capacity(), 3);
        let mut taken = IpSet::default();
        for seed in 0..20 {
            if let Some(ip) = pool.allocate(seed, &taken) {
                taken.insert(ip);
            }
        }
        let mut got: Vec<String> = taken.iter().map(|i| i.to_string()).collect();
        got.sort();
        assert_eq!(got, ["10.1.0.1", "10.1.0.2", "10.1.0.3"]);
    }

    /// A small deterministic generator, so the property test needs no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn property_never_hands_out_excluded_gateway_or_duplicate() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        for _ in 0..300 {
            let prefix = 22 + (rng.next() % 9) as u8; // /22../30
            let subnet = IpNet::new(IpAddr::V4(Ipv4Addr::new(10, 9, 0, 0)), prefix)
                .unwrap()
                .trunc();
            let size = 1u32 << (32 - prefix);
            let mut excluded = Vec::new();
            for _ in 0..(rng.next() % 4) {
                let ex_prefix = prefix + 1 + (rng.next() % u64::from(32 - prefix)) as u8;
                let ex_prefix = ex_prefix.min(32);
                let off = (rng.next() as u32) % size;
                let base = u32::from(Ipv4Addr::new(10, 9, 0, 0)) + off;
                excluded.push(
                    IpNet::new(IpAddr::V4(Ipv4Addr::from(base)), ex_prefix)
                        .unwrap()
                        .trunc(),
                );
            }
            let gw = IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 9, 0, 0)) + 1));
            let pool = Pool::new(subnet, &excluded, &[gw]);
            let mut taken = IpSet::default();
            while let Some(ip) = pool.allocate(rng.next(), &taken) {
                assert!(
                    pool.allocatable(ip),
                    "{ip} not allocatable in {subnet} ex {excluded:?}"
                );
                assert!(!excluded.iter().any(|e| e.contains(&ip)), "{ip} excluded");
                assert_ne!(ip, gw);
                assert!(taken.insert(ip), "{ip} twice");
                assert!(taken.len() as u128 <= pool.capacity());
            }
            assert_eq!(
                taken.len() as u128,
                pool.capacity(),
                "{subnet} ex {excluded:?}: pool ran dry early"
            );
        }
    }
}
