//! What one allocation round writes, computed from what was read: the
//! ledger (every address handed out, by network, and the claim holding
//! it) and the IPAMClaims. Pure: the caller reads and writes.
//!
//! The ledger is what makes two writers safe. An address goes into a
//! claim's `status.ips` only after the ledger, written conditionally on
//! its resourceVersion, names that claim (by uid) as its holder: two
//! controllers that planned from the same ledger cannot both write it, so
//! one address never lands in two claims, whoever leads, however a round
//! is cut short. The claims themselves keep the addresses too: a lost
//! ledger is rebuilt from them.

use std::collections::BTreeMap;

use ipnet::IpNet;

use crate::{
    config::Network,
    resolve::ipam::Pool,
    sys::hash::{HashSet, fnv1a},
};

use crate::config::kube_objects::Uid;
pub use crate::config::kube_objects::ledger::{ClaimRef, Holder, Ledger};

/// An IPAMClaim as the round sees it.
#[derive(Debug, Clone)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    pub uid: Uid,
    /// The vmpath network its `spec.network` resolves to, or why none.
    pub network: Result<String, String>,
    /// `status.ips` as read.
    pub ips: Vec<String>,
    /// Addresses asked for ([`REQUESTED_IPS_ANNOTATION`], else the `ips`
    /// of the Multus selection element that references the claim).
    pub requested: Vec<String>,
    /// Where `requested` comes from, for messages.
    pub requested_from: String,
}

/// On an IPAMClaim: a static request, comma-separated CIDRs
/// (`10.31.0.50/24`), honoured while the claim has no `status.ips`.
pub const REQUESTED_IPS_ANNOTATION: &str = "vmpath.dev/requested-ips";

impl Claim {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The round's writes.
#[derive(Debug, Default)]
pub struct Plan {
    /// The ledger to write (when it differs from the one read).
    pub ledger: Ledger,
    /// `status.ips` to write, by claim key.
    pub statuses: BTreeMap<String, Vec<String>>,
    /// Claims refused, by key, with the reason.
    pub refusals: BTreeMap<String, String>,
}

/// Claims whose `status.ips` the ledger does not vouch for: an address
/// it gives to another claim (or another uid of the name), or to none.
/// Only this controller writes addresses, ledger first: such a status was
/// written by someone else (a tenant that may write its claim's status,
/// or copied one), so it is not trusted. Those claims are read as holding
/// nothing (they are allocated as any new claim is, and their status is
/// written again); the result names each, with why. Nothing is checked
/// when `rebuild` (no ledger ConfigMap at all: it is rebuilt from the
/// claims) or on an IPAM-less network (addresses are the VM's business).
pub fn distrust_unvouched(
    networks: &[Network],
    claims: &mut [Claim],
    ledger: &Ledger,
    rebuild: bool,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if rebuild {
        return out;
    }
    for claim in claims.iter_mut().filter(|c| !c.ips.is_empty()) {
        let Ok(network) = &claim.network else {
            continue;
        };
        if !networks.iter().any(|n| &n.name == network && n.ipam) {
            continue;
        }
        let key = claim.key();
        let unvouched = crate::config::kube_objects::ledger::unvouched(
            ledger, network, &key, &claim.uid, &claim.ips,
        );
        if let Some(why) = unvouched {
            out.insert(
                key,
                format!(
                    "status.ips {:?} was not written by vmpath controller ({why} in the ledger on network {network:?}): not trusted; the claim is allocated again",
                    claim.ips
                ),
            );
            claim.ips.clear();
        }
    }
    out
}

fn pools(net: &Network) -> Vec<Pool> {
    net.subnets
        .iter()
        .map(|s| Pool::new(*s, &net.exclude_subnets, &net.gateway_ips))
        .collect()
}

/// Plans a round. `gone` are the claims (key, uid) confirmed deleted: their
/// addresses are released. Ledger entries of claims neither listed nor
/// confirmed gone are kept (a claim made after the list was taken).
pub fn plan(
    networks: &[Network],
    claims: &[Claim],
    ledger: &Ledger,
    gone: &[(ClaimRef, Uid)],
) -> Plan {
    let mut out = Plan {
        ledger: ledger.clone(),
        ..Default::default()
    };
    let gone: HashSet<&(ClaimRef, Uid)> = gone.iter().collect();
    for held in out.ledger.values_mut() {
        held.retain(|_, h| !gone.contains(&(h.claim.clone(), h.uid.clone())));
    }
    out.ledger.retain(|_, held| !held.is_empty());

    let mut claims: Vec<&Claim> = claims.iter().collect();
    claims.sort_by_key(|c| c.key());
    // Claims with addresses first: what a VM holds is never taken by a
    // claim allocated in the same round.
    claims.sort_by_key(|c| (c.ips.is_empty(), c.requested.is_empty()));
    for claim in claims {
        let key = claim.key();
        let network = match &claim.network {
            Ok(n) => n,
            Err(why) => {
                out.refusals.insert(key, why.clone());
                continue;
            }
        };
        let Some(net) = networks.iter().find(|n| &n.name == network) else {
            out.refusals.insert(
                key,
                format!("network {network:?} is not a known vmpath Network"),
            );
            continue;
        };
        if !net.ipam {
            // Addresses on an IPAM-less network are the VM's own business.
            continue;
        }
        let pools = pools(net);
        let held = out.ledger.entry(network.clone()).or_default();
        let is_mine = |h: &Holder| h.claim == key && h.uid == claim.uid;
        // What the claim holds (persistence), else what it asks for (a
        // static request): taken as is, all or nothing, unless another
        // claim holds it or IPAM may not hand it out.
        let (given, field) = if !claim.ips.is_empty() {
            (&claim.ips, "status.ips")
        } else {
            (&claim.requested, claim.requested_from.as_str())
        };
        if !given.is_empty() {
            let mut taken = Vec::new();
            let mut refused = None;
            for text in given {
                let Ok(ip) = text.parse::<IpNet>() else {
                    refused = Some(format!("{field}: {text:?} is not a CIDR"));
                    break;
                };
                match held.get(&ip.addr()) {
                    Some(h) if is_mine(h) => taken.push(ip),
                    Some(h) => {
                        refused = Some(format!(
                            "IP {} is claimed by IPAMClaim {} on network {network:?}",
                            ip.addr(),
                            h.claim
                        ));
                        break;
                    }
                    None if !pools.iter().any(|p| p.allocatable(ip.addr())) => {
                        refused = Some(format!(
                            "IP {} is not allocatable on network {network:?} (outside its subnets, excluded or a gateway)",
                            ip.addr()
                        ));
                        break;
                    }
                    None => taken.push(ip),
                }
            }
            match refused {
                // A static request says where it was asked for.
                Some(why) if field != "status.ips" && !why.starts_with(field) => {
                    out.refusals
                        .insert(key, format!("{why} (asked for in {field})"));
                }
                Some(why) => {
                    out.refusals.insert(key, why);
                }
                None => {
                    // Anything else the ledger names this claim for (two
                    // writers that each gave it an address in another
                    // shard) is released: the claim says what it has.
                    held.retain(|addr, h| !is_mine(h) || taken.iter().any(|t| t.addr() == *addr));
                    for ip in &taken {
                        held.insert(
                            ip.addr(),
                            Holder {
                                claim: key.as_str().into(),
                                uid: claim.uid.clone(),
                                ip: *ip,
                            },
                        );
                    }
                    if claim.ips.is_empty() {
                        out.statuses
                            .insert(key, taken.iter().map(ToString::to_string).collect());
                    }
                }
            }
            continue;
        }
        // A round cut short after the ledger was written: its addresses
        // are this claim's already.
        // One per family; another (two writers each gave it one, in
        // different shards) is released.
        let mut ips: Vec<IpNet> = Vec::new();
        for ip in held.values().filter(|h| is_mine(h)).map(|h| h.ip) {
            if !ips
                .iter()
                .any(|i| i.addr().is_ipv6() == ip.addr().is_ipv6())
            {
                ips.push(ip);
            }
        }
        held.retain(|addr, h| !is_mine(h) || ips.iter().any(|i| i.addr() == *addr));
        for v6 in [false, true] {
            if ips.iter().any(|ip| ip.addr().is_ipv6() == v6) {
                continue;
            }
            let Some(pool) = pools.iter().find(|p| p.subnet().addr().is_ipv6() == v6) else {
                continue;
            };
            let taken: crate::sys::ip_map::IpSet = held.keys().copied().collect();
            let seed = fnv1a(&[key.as_bytes(), &[u8::from(v6)]]);
            match pool.allocate(seed, &taken) {
                Some(addr) => {
                    let ip = IpNet::new(addr, pool.subnet().prefix_len())
                        .expect("prefix of a valid subnet");
                    held.insert(
                        addr,
                        Holder {
                            claim: key.as_str().into(),
                            uid: claim.uid.clone(),
                            ip,
                        },
                    );
                    ips.push(ip);
                }
                None => {
                    out.refusals.insert(
                        key.clone(),
                        format!("network {network:?}: subnet {} is exhausted", pool.subnet()),
                    );
                }
            }
        }
        if !ips.is_empty() {
            ips.sort_by_key(|ip| ip.addr().is_ipv6());
            out.statuses
                .insert(key, ips.iter().map(ToString::to_string).collect());
        }
    }
    out.ledger.retain(|_, held| !held.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::source::{RawDocument, Snapshot};

    fn network(yaml: &str) -> Vec<Network> {
        let snap = Snapshot {
            documents: crate::config::source::parse(yaml.as_bytes())
                .unwrap()
                .into_iter()
                .map(|value| RawDocument {
                    file: std::path::Path::new("t").into(),
                    index: 1,
                    origin: crate::config::DocOrigin::Given,
                    value: value.into(),
                })
                .collect(),
            ..Default::default()
        };
        let cfg = crate::round::validate(&snap, "", &crate::config::AcceptedKeys::new());
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        cfg.networks
    }

    const BLUE: &str = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec:\n  id: 7\n  subnets: [10.9.0.0/29]\n  excludeSubnets: [10.9.0.2/31]\n  defaultGatewayIPs: [10.9.0.1]\n  ipam: {mode: Enabled}\n";

    fn claim(name: &str, ips: &[&str]) -> Claim {
        Claim {
            namespace: "prod".into(),
            name: name.into(),
            uid: format!("u-{name}").into(),
            network: Ok("blue".into()),
            ips: ips.iter().map(|s| s.to_string()).collect(),
            requested: vec![],
            requested_from: REQUESTED_IPS_ANNOTATION.into(),
        }
    }

    #[test]
    fn allocates_around_exclusions_gateways_and_held_addresses() {
        let nets = network(BLUE);
        // 10.9.0.1 gateway, .2-.3 excluded: .4 .5 .6 are left.
        let claims = vec![
            claim("a", &["10.9.0.5/29"]),
            claim("b", &[]),
            claim("c", &[]),
            claim("d", &[]),
        ];
        let plan = plan(&nets, &claims, &Ledger::new(), &[]);
        let mut given: Vec<&String> = plan.statuses.values().flatten().collect();
        given.sort();
        assert_eq!(given, ["10.9.0.4/29", "10.9.0.6/29"], "{plan:?}");
        assert_eq!(plan.ledger["blue"].len(), 3);
        assert!(
            plan.refusals.values().any(|r| r.contains("exhausted")),
            "{plan:?}"
        );
    }

    #[test]
    fn a_conflict_is_named_and_a_cut_round_is_resumed() {
        let nets = network(BLUE);
        let first = plan(&nets, &[claim("a", &[])], &Ledger::new(), &[]);
        let ip = first.statuses["prod/a"][0].clone();
        // The status write was lost: the ledger gives the claim the same
        // address again, and another claim cannot take it.
        let again = plan(
            &nets,
            &[claim("z", &[&ip]), claim("a", &[])],
            &first.ledger,
            &[],
        );
        assert_eq!(again.statuses["prod/a"], std::slice::from_ref(&ip));
        assert!(
            again.refusals["prod/z"].contains("claimed by IPAMClaim prod/a"),
            "{again:?}"
        );
        // A static request: given when free, refused naming the holder.
        let free = ["10.9.0.4/29", "10.9.0.5/29", "10.9.0.6/29"]
            .into_iter()
            .find(|x| *x != ip)
            .unwrap();
        let mut asks = claim("s", &[]);
        asks.requested = vec![free.into()];
        let mut late = claim("t", &[]);
        late.requested = vec![ip.clone()];
        let static_plan = plan(&nets, &[asks, late], &first.ledger, &[]);
        assert_eq!(static_plan.statuses["prod/s"], [free]);
        assert!(static_plan.refusals["prod/t"].contains("claimed by IPAMClaim prod/a"));
        // A request from a pod's selection says where it was asked for.
        let mut from_pod = claim("u", &[]);
        from_pod.requested = vec![ip.clone()];
        from_pod.requested_from = "Pod prod/p's k8s.v1.cni.cncf.io/networks[0].ips".into();
        let pod_plan = plan(&nets, &[from_pod], &first.ledger, &[]);
        assert!(
            pod_plan.refusals["prod/u"].ends_with(
                "claimed by IPAMClaim prod/a on network \"blue\" (asked for in Pod prod/p's k8s.v1.cni.cncf.io/networks[0].ips)"
            ),
            "{pod_plan:?}"
        );
        // Released only once the claim is confirmed gone.
        let kept = plan(&nets, &[], &first.ledger, &[]);
        assert_eq!(kept.ledger, first.ledger);
        let released = plan(
            &nets,
            &[],
            &first.ledger,
            &[("prod/a".into(), "u-a".into())],
        );
        assert!(released.ledger.is_empty());
    }

    #[test]
    fn a_status_the_ledger_does_not_vouch_for_is_not_trusted() {
        let nets = network(BLUE);
        let first = plan(&nets, &[claim("a", &[])], &Ledger::new(), &[]);
        let a_ip = first.statuses["prod/a"][0].clone();
        // b copied a's status; c wrote itself a free address; a's own is
        // vouched for; d's is that of an earlier claim of its name.
        let free = ["10.9.0.4/29", "10.9.0.5/29", "10.9.0.6/29"]
            .into_iter()
            .find(|x| *x != a_ip)
            .unwrap();
        let mut d = claim("a", &[&a_ip]);
        d.name = "a".into();
        d.uid = "u-a-again".into();
        let mut claims = vec![
            claim("a", &[&a_ip]),
            claim("b", &[&a_ip]),
            claim("c", &[free]),
        ];
        let distrusted = distrust_unvouched(&nets, &mut claims, &first.ledger, false);
        assert_eq!(
            distrusted.keys().collect::<Vec<_>>(),
            ["prod/b", "prod/c"],
            "{distrusted:?}"
        );
        assert_eq!(
            distrusted["prod/b"],
            format!(
                "status.ips [\"{a_ip}\"] was not written by vmpath controller ({a_ip} is held by IPAMClaim prod/a in the ledger on network \"blue\"): not trusted; the claim is allocated again"
            )
        );
        assert!(distrusted["prod/c"].contains(&format!("{free} is given to no claim")));
        assert!(claims[1].ips.is_empty() && claims[2].ips.is_empty());
        assert_eq!(claims[0].ips, std::slice::from_ref(&a_ip));
        let mut again = vec![d];
        let earlier = distrust_unvouched(&nets, &mut again, &first.ledger, false);
        assert!(
            earlier["prod/a"].contains("held by an earlier IPAMClaim of that name (uid u-a)"),
            "{earlier:?}"
        );
        // Read as new claims, b and c get addresses of their own, and
        // their status is written again.
        let next = plan(&nets, &claims, &first.ledger, &[]);
        assert!(next.refusals.is_empty(), "{next:?}");
        assert_ne!(next.statuses["prod/b"], std::slice::from_ref(&a_ip));
        assert!(!next.statuses.contains_key("prod/a"));
        assert!(next.statuses.contains_key("prod/c"));
        // No ledger at all: the claims rebuild it.
        let mut lost = vec![claim("c", &[free])];
        assert!(distrust_unvouched(&nets, &mut lost, &Ledger::new(), true).is_empty());
        assert_eq!(lost[0].ips, [free]);
    }

    #[test]
    fn a_claim_the_ledger_names_twice_keeps_one_address_and_the_other_is_released() {
        let nets = network(BLUE);
        // Two writers, each in a shard of its own, gave claim a an address.
        let holder = |ip: &str| Holder {
            claim: "prod/a".into(),
            uid: "u-a".into(),
            ip: ip.parse().unwrap(),
        };
        let twice: Ledger = BTreeMap::from([(
            "blue".to_string(),
            BTreeMap::from([
                ("10.9.0.4".parse().unwrap(), holder("10.9.0.4/29")),
                ("10.9.0.6".parse().unwrap(), holder("10.9.0.6/29")),
            ]),
        )]);
        // Before its status is written: one of them, the other released.
        let unwritten = plan(&nets, &[claim("a", &[])], &twice, &[]);
        assert_eq!(unwritten.statuses["prod/a"], ["10.9.0.4/29"]);
        assert_eq!(unwritten.ledger["blue"].len(), 1, "{unwritten:?}");
        // After: what its status says, the other released.
        let written = plan(&nets, &[claim("a", &["10.9.0.6/29"])], &twice, &[]);
        let kept: Vec<_> = written.ledger["blue"]
            .keys()
            .map(ToString::to_string)
            .collect();
        assert_eq!(kept, ["10.9.0.6"], "{written:?}");
    }
}
