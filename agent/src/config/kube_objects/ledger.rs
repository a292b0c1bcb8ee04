//! Where the ledger lives: ConfigMaps in the controller's namespace, the
//! addresses spread over [`SHARDS`] of them by a hash of (network,
//! address). One ConfigMap cannot hold it: the API server refuses a
//! ConfigMap whose data passes 1 MiB, about 8,000 addresses with
//! KubeVirt's uids and names.
//!
//! Shard 0 is the ConfigMap named as the ledger (the whole ledger, before
//! it was sharded, lived there), shard k the one named `<ledger>-<k>`. An
//! address belongs to one shard forever, and every shard is written
//! conditionally on its resourceVersion, so the guarantee stays as it was:
//! two writers that planned from the same ledger cannot both write the
//! shard that decides an address.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::ConfigMap;
use serde::{Deserialize, Serialize};

use super::Uid;
use crate::sys::{hash::fnv1a, intern::Name};

/// Who holds an address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The IPAMClaim, written `namespace/name`.
    pub claim: ClaimRef,
    /// Its uid: a claim deleted and made again is another claim. As
    /// bytes: every agent keeps an entry for every address of the cluster.
    #[serde(default)]
    pub uid: Uid,
    /// The address with its subnet's prefix, as `status.ips` has it.
    pub ip: IpNet,
}

// Every agent keeps one per address of the cluster.
const _: () = assert!(std::mem::size_of::<Holder>() <= 64);

/// An IPAMClaim's namespace and name, written `namespace/name` (the
/// ledger's form): as names, which the claim's own object shares, not a
/// string of its own per address.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    pub namespace: Name,
    pub name: Name,
}

impl ClaimRef {
    /// Reads `namespace/name` (a text without `/` is a name in no
    /// namespace, as the controller splits one).
    pub fn new(text: &str) -> ClaimRef {
        let (namespace, name) = text.split_once('/').unwrap_or(("", text));
        ClaimRef {
            namespace: Name::new(namespace),
            name: Name::new(name),
        }
    }

    /// Whether it is written `text` (as it prints).
    pub fn is(&self, text: &str) -> bool {
        if self.namespace.is_empty() {
            return text == &*self.name;
        }
        text.split_once('/') == Some((&*self.namespace, &*self.name))
    }
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            f.write_str(&self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

impl std::fmt::Debug for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.to_string(), f)
    }
}

crate::sys::text::text_value!(ClaimRef);

impl Serialize for ClaimRef {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ClaimRef {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::sys::text::deserialize(deserializer, ClaimRef::new)
    }
}

/// A parsed shard with its trees full: the controller writes it in key
/// order, and a tree grown in that order is half empty (the agent keeps
/// every shard, an entry for every address of the cluster).
fn packed(ledger: Ledger) -> Ledger {
    use crate::sys::sorted::packed;
    packed(
        ledger
            .into_iter()
            .map(|(network, held)| (network, packed(held)))
            .collect(),
    )
}

/// Network name -> address -> holder.
pub type Ledger = BTreeMap<String, BTreeMap<IpAddr, Holder>>;

/// Who the ledger says holds an address: the controller's whole
/// [`Ledger`], or the agent's [`Shards`].
pub trait Vouches {
    fn holder(&self, network: &str, ip: &IpAddr) -> Option<&Holder>;
}

impl Vouches for Ledger {
    fn holder(&self, network: &str, ip: &IpAddr) -> Option<&Holder> {
        self.get(network)?.get(ip)
    }
}

/// The ledger as the agent reads it: each shard as parsed, shared until
/// its ConfigMap changes, never merged into a copy of the whole (at
/// 100,000 VMs a copy is tens of MB, and a walk of it on every
/// allocation was what an allocation cost the agent).
#[derive(Debug, Clone, Default)]
pub struct Shards {
    shards: BTreeMap<u64, Arc<Ledger>>,
}

impl Vouches for Shards {
    /// As [`merge`] decides: from the address's own shard, else from the
    /// first shard holding it.
    fn holder(&self, network: &str, ip: &IpAddr) -> Option<&Holder> {
        self.shards
            .get(&shard_of(network, ip))
            .and_then(|l| l.holder(network, ip))
            .or_else(|| self.shards.values().find_map(|l| l.holder(network, ip)))
    }
}

impl Shards {
    /// A whole ledger, split as the controller stores it (the tests'
    /// ledgers; the agent reads its shards, [`ShardRead`]).
    #[cfg(test)]
    pub fn of(ledger: &Ledger) -> Self {
        Shards {
            shards: split(ledger)
                .into_iter()
                .map(|(k, l)| (k, Arc::new(l)))
                .collect(),
        }
    }

    /// The shards that differ between `self` and `new` (one side empty
    /// where it has no such shard): a shard read again is compared, one
    /// shared by both is not.
    pub fn differing<'a>(&'a self, new: &'a Shards) -> Vec<(&'a Ledger, &'a Ledger)> {
        static EMPTY: std::sync::LazyLock<Ledger> = std::sync::LazyLock::new(Ledger::new);
        let keys: std::collections::BTreeSet<&u64> =
            self.shards.keys().chain(new.shards.keys()).collect();
        keys.into_iter()
            .filter_map(|k| match (self.shards.get(k), new.shards.get(k)) {
                (Some(a), Some(b)) if Arc::ptr_eq(a, b) => None,
                (a, b) => Some((a.map_or(&*EMPTY, |l| &**l), b.map_or(&*EMPTY, |l| &**l))),
            })
            .collect()
    }

    /// The whole ledger these shards make ([`merge`]): what the tests
    /// compare; the agent never builds it.
    #[cfg(test)]
    pub fn merged(&self) -> Ledger {
        merge(self.shards.iter().map(|(k, l)| (*k, &**l)))
    }
}

/// Why the ledger does not vouch for a claim's `status.ips` on `network`
/// (the claim `key`, `namespace/name`, of that `uid`), or `None` when it
/// names that claim as the holder of every address, each with its
/// prefix. Only `vmpath controller` writes addresses, ledger first: a
/// status it does not vouch for was written by someone else. The
/// controller and the agents judge a status by this one rule.
pub fn unvouched<L: Vouches + ?Sized>(
    ledger: &L,
    network: &str,
    key: &str,
    uid: &Uid,
    ips: &[impl AsRef<str>],
) -> Option<String> {
    ips.iter().map(AsRef::as_ref).find_map(|text| {
        let Ok(ip) = text.parse::<IpNet>() else {
            return Some(format!("{text:?} is not a CIDR"));
        };
        match ledger.holder(network, &ip.addr()) {
            Some(h) if h.claim == key && h.uid == *uid && h.ip == ip => None,
            Some(h) if h.claim == key && h.uid == *uid => {
                Some(format!("{text} is recorded in the ledger as {}", h.ip))
            }
            Some(h) if h.claim == key => Some(format!(
                "{text} is held by an earlier IPAMClaim of that name (uid {})",
                h.uid
            )),
            Some(h) => Some(format!("{text} is held by IPAMClaim {}", h.claim)),
            None => Some(format!("{text} is given to no claim")),
        }
    })
}

/// How many ConfigMaps the ledger is spread over: at most 1 MiB each,
/// room for about half a million addresses. Fixed: an address's shard
/// must never change.
pub const SHARDS: u64 = 64;

/// The key in each shard's data holding its part of the ledger (JSON).
pub const LEDGER_KEY: &str = "allocations";

/// The shard an address of a network belongs to.
pub fn shard_of(network: &str, ip: &std::net::IpAddr) -> u64 {
    fnv1a(&[network.as_bytes(), ip.to_string().as_bytes()]) % SHARDS
}

/// The ConfigMap name of shard `k`.
pub fn shard_name(ledger: &str, k: u64) -> String {
    if k == 0 {
        ledger.to_string()
    } else {
        format!("{ledger}-{k}")
    }
}

/// The shard a ConfigMap name is, if it is one of this ledger's.
fn shard_index(ledger: &str, name: &str) -> Option<u64> {
    if name == ledger {
        return Some(0);
    }
    let k: u64 = name.strip_prefix(ledger)?.strip_prefix('-')?.parse().ok()?;
    (1..SHARDS).contains(&k).then_some(k)
}

/// The whole ledger from its shards, in shard order. An address found in
/// two shards (a move into its own shard cut short) is taken from the
/// shard it belongs to.
pub fn merge<'a>(shards: impl Iterator<Item = (u64, &'a Ledger)>) -> Ledger {
    let mut out = Ledger::new();
    for (k, held) in shards {
        for (network, addrs) in held {
            let into = out.entry(network.clone()).or_default();
            for (ip, holder) in addrs {
                if !into.contains_key(ip) || shard_of(network, ip) == k {
                    into.insert(*ip, holder.clone());
                }
            }
        }
    }
    out
}

/// One ConfigMap of the ledger's namespace as the agent keeps it: a
/// shard's ledger, parsed once when the ConfigMap arrives (the watch
/// delivers the changed ConfigMap alone: one shard parsed per
/// allocation), never its text (at 100,000 VMs the shards' text is ten
/// MB, kept beside what it parses to).
#[derive(Debug)]
pub struct ShardRead {
    /// The ConfigMap's resourceVersion when read: a relist hands every
    /// ConfigMap again, and one at the same version is not parsed again.
    pub version: Option<String>,
    /// None: not one of the ledger's shards (another ConfigMap of its
    /// namespace).
    shard: Option<u64>,
    /// What the shard holds, or why its data is not a ledger (naming the
    /// ConfigMap).
    held: Result<Arc<Ledger>, String>,
}

impl ShardRead {
    /// ConfigMap `name` of `ledger`'s namespace at `version`, with its
    /// ledger's text.
    pub fn of(ledger: &str, name: &str, version: Option<&str>, text: Option<&str>) -> Self {
        let version = version.map(String::from);
        let Some(k) = shard_index(ledger, name) else {
            return ShardRead {
                version,
                shard: None,
                held: Ok(Arc::default()),
            };
        };
        let held = match text {
            Some(text) => serde_json::from_str::<Ledger>(text)
                .map(|ledger| Arc::new(packed(ledger)))
                .map_err(|e| format!("ConfigMap {name}: {LEDGER_KEY} is not a ledger: {e}")),
            None => Ok(Arc::default()),
        };
        ShardRead {
            version,
            shard: Some(k),
            held,
        }
    }
}

impl Shards {
    /// The shards among a namespace's ConfigMaps as read. A shard whose
    /// data is not a ledger is the error (naming it): the caller keeps the
    /// last shards that read.
    pub fn of_reads<'a>(reads: impl Iterator<Item = &'a ShardRead>) -> Result<Self, String> {
        let mut shards = BTreeMap::new();
        for read in reads {
            if let Some(k) = read.shard {
                shards.insert(k, read.held.clone()?);
            }
        }
        Ok(Shards { shards })
    }
}

/// The ledger's shards as read: each ConfigMap and what it holds.
#[derive(Debug, Default)]
pub struct Stored {
    pub shards: BTreeMap<u64, (ConfigMap, Ledger)>,
}

impl Stored {
    /// The shards among a namespace's ConfigMaps; a shard whose data is
    /// not a ledger is an error naming it.
    pub fn from_configmaps(ledger: &str, configmaps: Vec<ConfigMap>) -> Result<Self, String> {
        let mut shards = BTreeMap::new();
        for cm in configmaps {
            let name = cm.metadata.name.clone().unwrap_or_default();
            let Some(k) = shard_index(ledger, &name) else {
                continue;
            };
            let held: Ledger = match cm.data.as_ref().and_then(|d| d.get(LEDGER_KEY)) {
                Some(text) => serde_json::from_str(text)
                    .map_err(|e| format!("ConfigMap {name}: {LEDGER_KEY} is not a ledger: {e}"))?,
                None => Ledger::new(),
            };
            shards.insert(k, (cm, held));
        }
        Ok(Self { shards })
    }

    /// The whole ledger (see [`merge`]).
    pub fn ledger(&self) -> Ledger {
        merge(self.shards.iter().map(|(k, (_, held))| (*k, held)))
    }

    /// The writes that make the stored shards hold `ledger`: (shard, the
    /// ConfigMap read, or None to create it, and its new data). Shard 0
    /// comes last and always exists (a leader's first round creates it):
    /// entries leave it, where an unsharded ledger kept them, only after
    /// their own shards hold them.
    pub fn writes(&self, ledger: &Ledger) -> Vec<(u64, Option<&ConfigMap>, String)> {
        let split = split(ledger);
        let mut out = Vec::new();
        for k in (1..SHARDS).chain([0]) {
            let want = split.get(&k).cloned().unwrap_or_default();
            let stored = self.shards.get(&k);
            let unchanged = match stored {
                Some((_, held)) => *held == want,
                None => want.is_empty() && k != 0,
            };
            if !unchanged {
                let text = serde_json::to_string(&want).expect("a ledger serializes");
                out.push((k, stored.map(|(cm, _)| cm), text));
            }
        }
        out
    }
}

/// The ledger by shard; a shard with nothing is left out.
pub fn split(ledger: &Ledger) -> BTreeMap<u64, Ledger> {
    let mut out: BTreeMap<u64, Ledger> = BTreeMap::new();
    for (network, addrs) in ledger {
        for (ip, holder) in addrs {
            out.entry(shard_of(network, ip))
                .or_default()
                .entry(network.clone())
                .or_default()
                .insert(*ip, holder.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use kube::api::ObjectMeta;

    use super::*;

    #[test]
    fn a_holders_claim_reads_and_writes_as_namespace_slash_name() {
        let text = r#"{"claim":"prod/vm1.blue","uid":"5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8a","ip":"10.31.0.11/24"}"#;
        let holder: Holder = serde_json::from_str(text).unwrap();
        assert_eq!(&*holder.claim.namespace, "prod");
        assert_eq!(&*holder.claim.name, "vm1.blue");
        assert_eq!(serde_json::to_string(&holder).unwrap(), text);
        assert!(holder.claim == "prod/vm1.blue");
        for other in [
            "prod/vm1.blu",
            "prod/vm1.blue/x",
            "prodvm1.blue",
            "vm1.blue",
            "/vm1.blue",
        ] {
            assert!(holder.claim != other, "{other}");
        }
        // No namespace: the name alone, as the controller reads one.
        let bare = ClaimRef::new("vm1.blue");
        assert_eq!(bare.to_string(), "vm1.blue");
        assert!(bare == "vm1.blue" && bare != "/vm1.blue");
    }

    /// A ledger as KubeVirt's claims would fill it: `n` addresses, each
    /// held by a claim with a long name and a UUID.
    fn ledger(n: u32) -> Ledger {
        let mut held = BTreeMap::new();
        for i in 0..n {
            let ip: IpAddr = std::net::Ipv4Addr::from(0x0a00_0000 + i).into();
            held.insert(
                ip,
                Holder {
                    claim: format!("tenant-namespace-{}/imported-vm-{i:06}.blue", i % 50).into(),
                    uid: format!("8c5d2f3e-1b4a-4c6d-9e7f-{i:012}").into(),
                    ip: format!("{ip}/8").parse().unwrap(),
                },
            );
        }
        BTreeMap::from([("blue".to_string(), held)])
    }

    fn configmap(name: &str, text: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(LEDGER_KEY.to_string(), text.to_string())])),
            ..Default::default()
        }
    }

    #[test]
    fn a_ledger_of_200k_addresses_fits_configmaps_of_1_mib() {
        let whole = ledger(200_000);
        let text = serde_json::to_string(&whole).unwrap();
        assert!(text.len() > 20 << 20, "one ConfigMap: {} bytes", text.len());
        let split = split(&whole);
        let biggest = split
            .values()
            .map(|s| serde_json::to_string(s).unwrap().len())
            .max()
            .unwrap();
        assert!(biggest < 1 << 20, "biggest shard {biggest} bytes");
        // And nothing is lost or doubled.
        let stored = Stored {
            shards: split
                .into_iter()
                .map(|(k, l)| (k, (ConfigMap::default(), l)))
                .collect(),
        };
        assert_eq!(stored.ledger(), whole);
        assert!(stored.writes(&whole).is_empty());
    }

    #[test]
    fn the_agent_keeps_each_shard_as_parsed_and_a_changed_configmap_alone_is_read_again() {
        let whole = ledger(2_000);
        let mut texts: BTreeMap<String, String> = split(&whole)
            .into_iter()
            .map(|(k, l)| (shard_name("led", k), serde_json::to_string(&l).unwrap()))
            .collect();
        texts.insert("unrelated".into(), "not a ledger".into());
        // As the watch keeps them: each ConfigMap read when it arrives.
        let mut reads: BTreeMap<String, ShardRead> = texts
            .iter()
            .map(|(n, t)| (n.clone(), ShardRead::of("led", n, Some("1"), Some(t))))
            .collect();
        let before = Shards::of_reads(reads.values()).unwrap();
        assert_eq!(before.merged(), whole, "the same ledger as the shards make");

        // One allocation: shard k's ConfigMap rewritten, and it alone read again.
        let moved: IpAddr = "10.0.0.7".parse().unwrap();
        let mut after = whole.clone();
        let k = shard_of("blue", &moved);
        after
            .get_mut("blue")
            .unwrap()
            .get_mut(&moved)
            .unwrap()
            .claim = "prod/other.blue".into();
        let name = shard_name("led", k);
        let text = serde_json::to_string(&split(&after)[&k]).unwrap();
        reads.insert(
            name.clone(),
            ShardRead::of("led", &name, Some("2"), Some(&text)),
        );
        let now = Shards::of_reads(reads.values()).unwrap();
        assert_eq!(now.merged(), after);
        // Every other shard is the one read before: shared, not compared.
        assert_eq!(now.shards.len(), before.shards.len());
        for ((shard, l), old) in now.shards.iter().zip(before.shards.values()) {
            assert_eq!(Arc::ptr_eq(l, old), *shard != k, "shard {shard}");
        }
        assert_eq!(before.differing(&now).len(), 1);

        // A shard that is not a ledger: an error naming it.
        reads.insert(
            name.clone(),
            ShardRead::of("led", &name, Some("3"), Some("[")),
        );
        let e = Shards::of_reads(reads.values()).unwrap_err();
        assert!(e.contains(&name), "{e}");
    }

    #[test]
    fn an_unsharded_ledger_is_read_whole_and_moved_out_of_shard_0_last() {
        let whole = ledger(100);
        let legacy = configmap(
            "vmpath-ipam-ledger",
            &serde_json::to_string(&whole).unwrap(),
        );
        let other = configmap("unrelated", "{}");
        let stored = Stored::from_configmaps("vmpath-ipam-ledger", vec![legacy, other]).unwrap();
        assert_eq!(stored.shards.len(), 1);
        assert_eq!(stored.ledger(), whole);
        let writes = stored.writes(&whole);
        assert!(writes.len() > 2);
        // Created shards first, shard 0 (rewritten with its own part) last.
        let (last, read, _) = writes.last().unwrap();
        assert_eq!((*last, read.is_some()), (0, true));
        assert!(
            writes[..writes.len() - 1]
                .iter()
                .all(|(k, read, _)| *k != 0 && read.is_none())
        );
    }

    #[test]
    fn a_shard_that_is_not_a_ledger_is_named() {
        let bad = configmap("vmpath-ipam-ledger-7", "[1,2]");
        let err = Stored::from_configmaps("vmpath-ipam-ledger", vec![bad]).unwrap_err();
        assert!(err.contains("vmpath-ipam-ledger-7"), "{err}");
        assert_eq!(
            shard_index("vmpath-ipam-ledger", "vmpath-ipam-ledger-64"),
            None
        );
        assert_eq!(
            shard_index("vmpath-ipam-ledger", "vmpath-ipam-ledger-x"),
            None
        );
    }

    #[test]
    fn a_status_is_vouched_for_only_by_its_own_ledger_entry() {
        let whole = ledger(1);
        let (ip, holder) = whole["blue"].iter().next().unwrap();
        let mine =
            |ips: &[String]| unvouched(&whole, "blue", &holder.claim.to_string(), &holder.uid, ips);
        assert_eq!(mine(&[holder.ip.to_string()]), None);
        // Another prefix, another uid of the name, another claim, a free
        // address, another network, not a CIDR: each named.
        let other_prefix = format!("{ip}/24");
        assert!(
            mine(&[other_prefix])
                .unwrap()
                .contains("recorded in the ledger as")
        );
        let earlier = unvouched(
            &whole,
            "blue",
            &holder.claim.to_string(),
            &"new-uid".into(),
            &[holder.ip.to_string()],
        );
        assert!(earlier.unwrap().contains("earlier IPAMClaim of that name"));
        let thief = unvouched(
            &whole,
            "blue",
            "prod/thief",
            &"u".into(),
            &[holder.ip.to_string()],
        );
        assert_eq!(
            thief.unwrap(),
            format!("{} is held by IPAMClaim {}", holder.ip, holder.claim)
        );
        assert!(
            mine(&["10.255.0.1/8".into()])
                .unwrap()
                .contains("given to no claim")
        );
        let elsewhere = unvouched(
            &whole,
            "red",
            &holder.claim.to_string(),
            &holder.uid,
            &[holder.ip.to_string()],
        );
        assert!(elsewhere.unwrap().contains("given to no claim"));
        assert!(mine(&["nope".into()]).unwrap().contains("is not a CIDR"));
    }

    #[test]
    fn an_address_in_two_shards_is_taken_from_its_own() {
        let whole = ledger(1);
        let (ip, holder) = whole["blue"].iter().next().unwrap();
        let own = shard_of("blue", ip);
        let mut stale = holder.clone();
        stale.claim = "old/claim".into();
        let stale = BTreeMap::from([("blue".to_string(), BTreeMap::from([(*ip, stale)]))]);
        let stored = Stored {
            shards: BTreeMap::from([
                ((own + 1) % SHARDS, (ConfigMap::default(), stale)),
                (own, (ConfigMap::default(), whole.clone())),
            ]),
        };
        assert_eq!(stored.ledger(), whole);
        // The agent's shards say the same without merging them.
        let mut shards = Shards {
            shards: stored
                .shards
                .iter()
                .map(|(k, (_, l))| (*k, Arc::new(l.clone())))
                .collect(),
        };
        assert_eq!(shards.holder("blue", ip), Some(holder));
        assert_eq!(shards.merged(), whole);
        // Its own shard emptied: the other shard's entry is the holder.
        let before = shards.clone();
        shards.shards.insert(own, Arc::default());
        assert_eq!(shards.holder("blue", ip).unwrap().claim, "old/claim");
        assert_eq!(shards.holder("red", ip), None);
        // Only the shard read again is compared.
        let differing = before.differing(&shards);
        assert_eq!(differing.len(), 1);
        assert_eq!(differing[0], (&whole, &Ledger::new()));
    }
}
