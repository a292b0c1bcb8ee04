//! The learned-addresses stage: what of the addresses the data path saw a
//! guest use (`vmp_learned_ips`) becomes vmpath's. A learned address is a
//! claim made by a guest, so untrusted input: it is routed, exported and
//! shown only when it is a unicast address inside one of its network's
//! subnets, not a subnet's own address or a gateway, not another
//! endpoint's (configured, claimed, or learned first: the data path keeps
//! the first holder and records the newcomer in `vmp_learn_conflicts`),
//! not a node's, and within the port's cap. A network without subnets
//! learns for display only. An address unheard for the expiry is dropped
//! from the map, and so from routes and exports.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    time::Duration,
};

use vmpath_common::{AddrKey, LearnedIp};

use crate::{
    config::{AttachmentKey, reserved::reserved_reason},
    resolve::resolved::Resolved,
};

/// Default time an address may go unheard before it is forgotten.
pub const DEFAULT_EXPIRY: Duration = Duration::from_secs(300);
/// Default number of learned addresses one port may hold.
pub const DEFAULT_PER_PORT: u64 = 16;

/// Limits of the stage (`--learned-expiry-seconds`, `--learned-per-port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub expiry: Duration,
    pub per_port: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            expiry: DEFAULT_EXPIRY,
            per_port: DEFAULT_PER_PORT as usize,
        }
    }
}

/// Why a learned address was refused; `kind` is the metric's label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub ip: IpAddr,
    pub kind: &'static str,
    pub reason: String,
}

/// Every refusal kind, for the metric.
pub const REFUSAL_KINDS: [&str; 6] = [
    "outside_subnets",
    "reserved",
    "held",
    "node_address",
    "over_cap",
    "no_port",
];

/// What this round accepts and refuses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Accepted on networks with subnets: routed, exported, shown. `seen`
    /// is zeroed so that a renewal is not a change.
    pub routable: BTreeMap<AddrKey, LearnedIp>,
    /// Accepted, shown only (the network has no subnets).
    pub display_only: BTreeMap<AddrKey, LearnedIp>,
    /// Refused, by the port (ifindex) that used them.
    pub refused: BTreeMap<u32, Vec<Refusal>>,
    /// Addresses a port keeps that another port also used, by the holder's
    /// ifindex: (address, the other endpoint).
    pub contested: BTreeMap<u32, Vec<(IpAddr, String)>>,
    /// Map entries unheard for the expiry (or of ports that are gone): the
    /// agent removes them.
    pub expired: Vec<AddrKey>,
}

impl Outcome {
    /// Accepted addresses of every kind, for the view.
    pub fn shown(&self) -> impl Iterator<Item = (&AddrKey, &LearnedIp)> {
        self.routable.iter().chain(&self.display_only)
    }

    /// Refusals counted by kind.
    pub fn refused_by_kind(&self) -> BTreeMap<&'static str, usize> {
        let mut out: BTreeMap<&'static str, usize> =
            REFUSAL_KINDS.iter().map(|k| (*k, 0)).collect();
        for r in self.refused.values().flatten() {
            *out.entry(r.kind).or_default() += 1;
        }
        out
    }
}

/// The stage's inputs besides the maps.
pub struct Inputs<'a> {
    pub cfg: &'a Resolved,
    /// This node's VM ports: ifindex -> the attachment served there.
    pub ports: &'a HashMap<u32, AttachmentKey>,
    /// Addresses of this node's own interfaces.
    pub local_addresses: &'a BTreeSet<IpAddr>,
    /// Now on the data path's flow clock (ns since boot).
    pub now_ns: u64,
    pub limits: Limits,
}

/// Decides the learned addresses. `previous` is what was accepted last
/// round: those keep their place under the per-port cap.
pub fn accept(
    raw: &BTreeMap<AddrKey, LearnedIp>,
    conflicts: &BTreeMap<AddrKey, LearnedIp>,
    previous: &Outcome,
    input: &Inputs,
) -> Outcome {
    let cfg = input.cfg;
    let mut out = Outcome::default();
    // Who holds what by configuration (given or claimed), on the networks
    // something was learned on: those without learning cost nothing here.
    let learning: BTreeSet<u32> = raw.keys().map(|k| k.network).collect();
    let mut configured: HashMap<(u32, IpAddr), &AttachmentKey> = HashMap::new();
    for a in &cfg.attachments {
        if let Some(net) = cfg.network(&a.network).filter(|n| learning.contains(&n.id)) {
            for (ip, _) in &a.addresses {
                configured.insert((net.id, ip.addr()), &a.key);
            }
        }
    }
    let mut node_addresses: BTreeSet<IpAddr> = input.local_addresses.clone();
    for n in cfg.config.nodes.values().chain(cfg.config.node.as_ref()) {
        node_addresses.insert(n.address);
        node_addresses.extend(n.snat_address);
        node_addresses.extend(n.snat_address6.map(IpAddr::V6));
    }
    let networks: HashMap<u32, &crate::config::Network> =
        cfg.config.networks.iter().map(|n| (n.id, n)).collect();
    let expiry_ns = input.limits.expiry.as_nanos() as u64;

    // Kept addresses first, then new ones in address order: a guest
    // cycling through addresses cannot push out what a port already has.
    let was_accepted =
        |k: &AddrKey| previous.routable.contains_key(k) || previous.display_only.contains_key(k);
    let ordered = raw
        .iter()
        .filter(|(k, _)| was_accepted(k))
        .chain(raw.iter().filter(|(k, _)| !was_accepted(k)));
    let mut per_port: HashMap<u32, usize> = HashMap::new();
    for (key, seen) in ordered {
        let ip = key.ip();
        if input.now_ns.saturating_sub(seen.seen) > expiry_ns {
            out.expired.push(*key);
            continue;
        }
        let refuse = |kind: &'static str, reason: String| Refusal { ip, kind, reason };
        let refusal = match (input.ports.get(&seen.ifindex), networks.get(&key.network)) {
            (None, _) | (_, None) => {
                // A port that is no VM's here (the data plane prunes a
                // gone port's entries) or a network that is no more.
                out.refused.entry(seen.ifindex).or_default().push(refuse(
                    "no_port",
                    format!("{ip} was used on a port that serves no VM of its network"),
                ));
                continue;
            }
            (Some(owner), Some(net)) => {
                if let Some(holder) = configured.get(&(net.id, ip)).filter(|h| **h != owner) {
                    Some(refuse(
                        "held",
                        format!("{ip} is held by {holder} (configured or claimed)"),
                    ))
                } else if configured.contains_key(&(net.id, ip)) {
                    // The port's own configured address, in use: routed
                    // and exported as learned (`advertise.learned`), not
                    // counted against the cap.
                    out.routable.insert(*key, LearnedIp { seen: 0, ..*seen });
                    continue;
                } else if node_addresses.contains(&ip) {
                    Some(refuse("node_address", format!("{ip} is a node's address")))
                } else if let Some(why) = reserved_reason(net, ip) {
                    Some(refuse("reserved", why))
                } else if !net.subnets.is_empty() && !net.subnets.iter().any(|s| s.contains(&ip)) {
                    Some(refuse(
                        "outside_subnets",
                        format!("{ip} is outside network {:?}'s subnets", net.name),
                    ))
                } else if per_port.get(&seen.ifindex).copied().unwrap_or(0) >= input.limits.per_port
                {
                    Some(refuse(
                        "over_cap",
                        format!(
                            "the port already has {} learned addresses (--learned-per-port)",
                            input.limits.per_port
                        ),
                    ))
                } else {
                    None
                }
            }
        };
        match refusal {
            Some(r) => out.refused.entry(seen.ifindex).or_default().push(r),
            None => {
                *per_port.entry(seen.ifindex).or_default() += 1;
                let kept = LearnedIp { seen: 0, ..*seen };
                if networks[&key.network].subnets.is_empty() {
                    out.display_only.insert(*key, kept);
                } else {
                    out.routable.insert(*key, kept);
                }
            }
        }
    }
    // Another port used an address its holder keeps: said on both.
    for (key, claimant) in conflicts {
        if input.now_ns.saturating_sub(claimant.seen) > expiry_ns {
            continue;
        }
        let Some(holder) = raw.get(key).filter(|h| h.ifindex != claimant.ifindex) else {
            continue;
        };
        let name = |ifindex: u32| {
            input
                .ports
                .get(&ifindex)
                .map_or_else(|| format!("port {ifindex}"), |k| k.to_string())
        };
        let ip = key.ip();
        out.refused
            .entry(claimant.ifindex)
            .or_default()
            .push(Refusal {
                ip,
                kind: "held",
                reason: format!("{ip} is held by {} (learned first)", name(holder.ifindex)),
            });
        out.contested
            .entry(holder.ifindex)
            .or_default()
            .push((ip, name(claimant.ifindex)));
    }
    out
}

/// Reads the data path's learned addresses and conflicts, decides them
/// and forgets what expired (from the map: its route and export follow).
pub fn read(
    dp: &mut crate::apply::dataplane::Dataplane,
    cfg: &Resolved,
    node: &str,
    previous: &Outcome,
    limits: Limits,
) -> Outcome {
    let raw: BTreeMap<AddrKey, LearnedIp> = dp
        .maps()
        .learned_ips
        .iter()
        .filter_map(|r| r.ok())
        .collect();
    let conflicts: BTreeMap<AddrKey, LearnedIp> = dp
        .maps()
        .learn_conflicts
        .iter()
        .filter_map(|r| r.ok())
        .collect();
    if raw.is_empty() {
        // Nothing learned (IPAM networks only, say): nothing to decide.
        return Outcome::default();
    }
    // Ports of this node's VMs (a pending migration target is not one yet).
    let ports: HashMap<u32, AttachmentKey> = cfg
        .local_entries()
        .filter(|a| !a.elsewhere && a.active_node() == node)
        .filter_map(|a| crate::sys::netif::ifindex_of(a.active_port()).map(|i| (i, a.key.clone())))
        .collect();
    let local_addresses = crate::sys::netif::local_addresses();
    let mut out = accept(
        &raw,
        &conflicts,
        previous,
        &Inputs {
            cfg,
            ports: &ports,
            local_addresses: &local_addresses,
            now_ns: crate::sys::clock::monotonic_ns(),
            limits,
        },
    );
    for key in std::mem::take(&mut out.expired) {
        tracing::info!(ip = %key.ip(), network = key.network, "learned address expired (unheard)");
        let _ = dp.maps_mut().learned_ips.remove(&key);
    }
    for (ifindex, refusals) in &out.refused {
        for r in refusals {
            let new = previous
                .refused
                .get(ifindex)
                .is_none_or(|p| !p.iter().any(|q| q.ip == r.ip));
            if new {
                tracing::warn!(port = ifindex, ip = %r.ip, "learned address refused: {}", r.reason);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::config;

    const NOW: u64 = 1_000_000_000_000;

    /// Network "red" (id 7, 10.0.0.0/24 and fd00::/64, gateways .1 and
    /// fd00::1, IPAM off), "bare" (id 8, no subnets); vm1 on port 11 and
    /// vm2 on port 12 on red, vm2 configured with 10.0.0.20; vm3 on port
    /// 13 on bare; node b at 192.168.50.2.
    fn cfg() -> Resolved {
        let docs = "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {name: b}\nspec: {address: 192.168.50.2}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: red}\nspec: {id: 7, role: Primary, subnets: [10.0.0.0/24, 'fd00::/64'], defaultGatewayIPs: [10.0.0.1, 'fd00::1'], ipam: {mode: Disabled}}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: bare}\nspec: {id: 8, ipam: {mode: Disabled}}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: vm1, namespace: prod}\nspec: {vm: vm1, interface: eth0, network: red, node: a, port: p1, mac: '52:54:00:00:00:0b'}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: vm2, namespace: prod}\nspec: {vm: vm2, interface: eth0, network: red, node: a, port: p2, mac: '52:54:00:00:00:0c', ips: [10.0.0.20/24]}\n\
             ---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: vm3, namespace: prod}\nspec: {vm: vm3, interface: eth0, network: bare, node: a, port: p3, mac: '52:54:00:00:00:0d'}\n";
        // One dir a call: the tests run in parallel in one process.
        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vmpath-learned-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let r = Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ));
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        r
    }

    fn ports(cfg: &Resolved) -> HashMap<u32, AttachmentKey> {
        cfg.attachments
            .iter()
            .map(|a| {
                let i = match a.key.vm.as_str() {
                    "vm1" => 11,
                    "vm2" => 12,
                    _ => 13,
                };
                (i, a.key.clone())
            })
            .collect()
    }

    fn seen(ifindex: u32, age_s: u64) -> LearnedIp {
        LearnedIp {
            ifindex,
            how: vmpath_common::LEARNED_FROM_IPV4,
            mac: [0x52, 0x54, 0, 0, 0, ifindex as u8],
            _pad: [0; 2],
            seen: NOW - age_s * 1_000_000_000,
        }
    }

    fn run(
        raw: &BTreeMap<AddrKey, LearnedIp>,
        conflicts: &BTreeMap<AddrKey, LearnedIp>,
        limits: Limits,
    ) -> Outcome {
        let cfg = cfg();
        let ports = ports(&cfg);
        let local: BTreeSet<IpAddr> = [IpAddr::V4(Ipv4Addr::new(10, 0, 0, 250))].into();
        accept(
            raw,
            conflicts,
            &Outcome::default(),
            &Inputs {
                cfg: &cfg,
                ports: &ports,
                local_addresses: &local,
                now_ns: NOW,
                limits,
            },
        )
    }

    fn v4(a: [u8; 4]) -> AddrKey {
        AddrKey::from_ip(7, IpAddr::V4(a.into()))
    }

    /// Katran-style: the address a guest used, and what becomes of it.
    #[test]
    fn only_a_networks_free_unicast_addresses_are_accepted() {
        let rows: [(AddrKey, Option<&str>); 12] = [
            (v4([10, 0, 0, 77]), None),
            (AddrKey::from_ip(7, "fd00::77".parse().unwrap()), None),
            (v4([10, 0, 0, 1]), Some("reserved")),
            (v4([10, 0, 0, 0]), Some("reserved")),
            (v4([10, 0, 0, 255]), Some("reserved")),
            (
                AddrKey::from_ip(7, "fd00::1".parse().unwrap()),
                Some("reserved"),
            ),
            (
                AddrKey::from_ip(7, "fd00::".parse().unwrap()),
                Some("reserved"),
            ),
            (v4([10, 0, 0, 20]), Some("held")),
            (v4([10, 0, 0, 250]), Some("node_address")),
            (v4([192, 168, 50, 2]), Some("node_address")),
            (v4([8, 8, 8, 8]), Some("outside_subnets")),
            (v4([10, 0, 1, 5]), Some("outside_subnets")),
        ];
        for (key, want) in rows {
            let raw = BTreeMap::from([(key, seen(11, 0))]);
            let out = run(&raw, &BTreeMap::new(), Limits::default());
            let got = out.refused.get(&11).and_then(|r| r.first()).map(|r| r.kind);
            assert_eq!(got, want, "{}", key.ip());
            assert_eq!(
                out.routable.contains_key(&key),
                want.is_none(),
                "{}",
                key.ip()
            );
        }
    }

    #[test]
    fn a_ports_own_configured_address_in_use_is_routed_uncapped() {
        let key = v4([10, 0, 0, 20]);
        let raw = BTreeMap::from([(key, seen(12, 0)), (v4([10, 0, 0, 21]), seen(12, 0))]);
        let limits = Limits {
            per_port: 1,
            ..Limits::default()
        };
        let out = run(&raw, &BTreeMap::new(), limits);
        assert!(out.routable.contains_key(&key) && out.routable.contains_key(&v4([10, 0, 0, 21])));
        assert!(out.refused.is_empty(), "{:?}", out.refused);
    }

    #[test]
    fn a_network_without_subnets_learns_for_display_only() {
        let key = AddrKey::from_ip(8, IpAddr::V4(Ipv4Addr::new(172, 16, 0, 9)));
        let out = run(
            &BTreeMap::from([(key, seen(13, 0))]),
            &BTreeMap::new(),
            Limits::default(),
        );
        assert!(out.routable.is_empty());
        assert!(out.display_only.contains_key(&key));
    }

    #[test]
    fn the_cap_and_the_expiry_bound_what_a_port_holds() {
        let raw: BTreeMap<AddrKey, LearnedIp> = (10..20)
            .map(|i| (v4([10, 0, 0, i]), seen(11, 0)))
            .chain([(v4([10, 0, 0, 99]), seen(11, 400))])
            .collect();
        let out = run(
            &raw,
            &BTreeMap::new(),
            Limits {
                expiry: Duration::from_secs(300),
                per_port: 4,
            },
        );
        assert_eq!(out.routable.len(), 4);
        assert_eq!(out.refused[&11].len(), 6, "{:?}", out.refused);
        assert!(out.refused[&11].iter().all(|r| r.kind == "over_cap"));
        assert_eq!(out.expired, vec![v4([10, 0, 0, 99])]);
    }

    #[test]
    fn a_conflict_is_said_on_both_ports_and_the_first_holder_keeps_it() {
        let key = v4([10, 0, 0, 77]);
        let raw = BTreeMap::from([(key, seen(11, 0))]);
        let conflicts = BTreeMap::from([(key, seen(12, 0))]);
        let out = run(&raw, &conflicts, Limits::default());
        assert!(out.routable.contains_key(&key));
        assert_eq!(out.refused[&12][0].kind, "held");
        assert!(
            out.refused[&12][0].reason.contains("vm1"),
            "{:?}",
            out.refused
        );
        assert!(out.contested[&11][0].1.contains("vm2"));
    }
}
