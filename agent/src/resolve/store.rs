//! Persistent claims: the addresses and MAC a VM interface holds, kept in an
//! embedded database (redb) under the state dir. A claim belongs to the VM
//! interface (namespace/vm/interface), not to a port or a node, so it
//! survives agent restarts, port re-creation and migration. Every change is
//! one atomic write transaction.

use std::{collections::BTreeMap, path::Path};

use ipnet::IpNet;
use redb::{Database, ReadableDatabase as _, ReadableTable as _, TableDefinition};
use serde::{Deserialize, Serialize};

/// Where a MAC or an IP of an attachment came from: recorded with each
/// claim, and shown by the API (so defined with the API's types).
pub use vmpath_api::types::Origin;

const CLAIMS: TableDefinition<&str, &[u8]> = TableDefinition::new("claims");
/// The VM interfaces (`[namespace, vm, interface]`) the last round
/// accepted, on any node: after a restart the previous round still wins a
/// conflict no claim decides (an address on an IPAM-less network, a given
/// MAC, of a VM on another node), not document order. One row.
const ACCEPTED: TableDefinition<&str, &[u8]> = TableDefinition::new("accepted");
const ACCEPTED_ROW: &str = "keys";
/// What redb may keep of the file in memory (see `Store::open`).
const CACHE_BYTES: usize = 4 << 20;

/// A VM interface as [`Store::accepted`] keeps it.
pub type InterfaceKey = (String, String, String);

impl crate::config::Held {
    /// What the claims store records. Beside the store, not in `config`:
    /// validation takes a [`Held`](crate::config::Held) and knows no store.
    pub fn from_claims(claims: &Claims) -> Self {
        let mut ips = crate::sys::ip_map::IpMap::default();
        let mut macs = crate::sys::hash::HashMap::default();
        for (key, c) in claims {
            for ip in &c.ips {
                ips.insert(c.network.clone(), ip.addr(), key.clone());
            }
            if let Some(mac) = c.mac {
                macs.insert((c.network.clone(), mac), key.clone());
            }
        }
        Self {
            ips: ips.into(),
            macs: macs.into(),
            ..Self::default()
        }
    }

    /// `self` (the claims' part) with the claims `changes` wrote since it
    /// was built, when they only add pairs no claim has (a new claim, an
    /// address added to one): what [`from_claims`](Self::from_claims)
    /// would give, without a pass over every claim. `None` when a pair
    /// goes away, changes hands or is held twice (those are decided by
    /// the order of every claim: the caller builds it whole), or when the
    /// additions grow past `cap`.
    pub fn with_added(&self, changes: &[ClaimChange], cap: usize) -> Option<Self> {
        /// A claim's (network, address) pairs and its (network, MAC).
        type Pairs = (
            Vec<(crate::sys::intern::Name, std::net::IpAddr)>,
            Option<(crate::sys::intern::Name, [u8; 6])>,
        );
        fn pairs(c: &Claim) -> Pairs {
            let ips = c
                .ips
                .iter()
                .map(|ip| (c.network.clone(), ip.addr()))
                .collect();
            let mac = c.mac.map(|mac| (c.network.clone(), mac));
            (ips, mac)
        }
        let mut next = Self {
            ips: self.ips.clone(),
            macs: self.macs.clone(),
            ips_added: self.ips_added.clone(),
            macs_added: self.macs_added.clone(),
            ..Self::default()
        };
        for change in changes {
            let (was_ips, was_mac) = change.was.as_ref().map(pairs).unwrap_or_default();
            let (now_ips, now_mac) = change.now.as_ref().map(pairs).unwrap_or_default();
            if was_ips.iter().any(|p| !now_ips.contains(p))
                || (was_mac.is_some() && was_mac != now_mac)
            {
                return None;
            }
            for pair in now_ips.into_iter().filter(|p| !was_ips.contains(p)) {
                if next.stored_ip(&pair.0, pair.1).is_some() {
                    return None;
                }
                next.ips_added
                    .insert(pair.0, pair.1, change.key.as_str().into());
            }
            if let Some(pair) = now_mac.filter(|p| was_mac.as_ref() != Some(p)) {
                if next.stored_mac(&pair.0, pair.1).is_some() {
                    return None;
                }
                next.macs_added.insert(pair, change.key.as_str().into());
            }
        }
        (next.ips_added.len() + next.macs_added.len() <= cap).then_some(next)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("claims database {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: redb::DatabaseError,
    },
    #[error("claims database: {0}")]
    Db(String),
    #[error("claims database holds a record it cannot read ({key}): {source}")]
    Decode {
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

fn db_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Db(e.to_string())
}

/// What one VM interface holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// A name: every claim of the network shares it.
    pub network: crate::sys::intern::Name,
    /// Addresses allocated by IPAM or requested in `spec.ips`.
    pub ips: Vec<IpNet>,
    /// The MAC detected in the VM's traffic or generated for it. As its
    /// bytes (written as its text): every agent keeps a claim for every
    /// VM interface of the cluster.
    #[serde(with = "mac_text")]
    pub mac: Option<[u8; 6]>,
    pub mac_origin: Option<Origin>,
}

// Every VM interface of the cluster has a claim in a tree's entry.
const _: () = assert!(std::mem::size_of::<Claim>() <= 40);

/// A claim's MAC as the store writes it: `02:00:00:31:00:0b`.
mod mac_text {
    use serde::{Deserialize as _, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(mac: &Option<[u8; 6]>, s: S) -> Result<S::Ok, S::Error> {
        match mac {
            Some(mac) => s.serialize_some(&crate::config::format_mac(mac)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[u8; 6]>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|text| crate::config::parse_mac(&text).map_err(D::Error::custom))
            .transpose()
    }
}

/// Every claim by its key. Keys as names: validation's and IPAM's maps of
/// who holds what name the same claims.
pub type Claims = BTreeMap<crate::sys::intern::Name, Claim>;

/// One claim written: its key, and the claim before and after (`None`:
/// none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimChange {
    pub key: String,
    pub was: Option<Claim>,
    pub now: Option<Claim>,
}

/// How many writes the store's log keeps: a round reads the writes since
/// the last (one or two); further back, it reads every claim.
const LOG_WRITES: usize = 64;

/// How many claim changes the log keeps in all: a reader of more builds
/// what it keeps from every claim anyway (`Held::with_added` declines
/// past 1,024), and a first write of every claim of a cluster kept as
/// its changes was 250 bytes per VM interface for as long as the agent ran.
const LOG_CHANGES: usize = 1024;

/// A write of at least this many claims (and a quarter of them all)
/// packs the cached claims' tree ([`crate::sys::sorted::packed`]).
const PACK_AFTER: usize = 1024;

pub struct Store {
    db: Database,
    /// Every claim as last read or written: a round reads them all, and
    /// parsing the database's JSON again each time grew with the cluster.
    cache: std::sync::Mutex<Option<std::sync::Arc<Claims>>>,
    /// The last writes, each as the generation it made and its claims
    /// before and after (`changes_since`); emptied when a write leaves
    /// them unknown (no cache to compare with, a failed commit).
    log: std::sync::Mutex<std::collections::VecDeque<(u64, Vec<ClaimChange>)>>,
    /// Counts writes: what was built from the claims stays valid while
    /// it is the same.
    generation: std::sync::atomic::AtomicU64,
}

impl Store {
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(state_dir).map_err(db_err)?;
        let path = state_dir.join("claims.redb");
        // redb caches up to 1 GiB of pages by default: every page it wrote
        // stays in memory (about 100 bytes per VM interface of the
        // cluster). The claims are read once into `cache` and the store is
        // written a few claims at a time, so a small cache costs a write a
        // few reads of pages the kernel's page cache holds anyway.
        let db = redb::Builder::new()
            .set_cache_size(CACHE_BYTES)
            .create(&path)
            .map_err(|source| StoreError::Open {
                path: path.display().to_string(),
                source,
            })?;
        // Make sure the table exists so readers never see "no such table".
        let tx = db.begin_write().map_err(db_err)?;
        tx.open_table(CLAIMS).map_err(db_err)?;
        tx.open_table(ACCEPTED).map_err(db_err)?;
        tx.commit().map_err(db_err)?;
        Ok(Store {
            db,
            cache: std::sync::Mutex::new(None),
            log: std::sync::Mutex::default(),
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The number of writes so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The claims written since generation `from`, in order, when the
    /// log still holds every write since (`None`: read them all).
    pub fn changes_since(&self, from: u64) -> Option<Vec<ClaimChange>> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.generation();
        let mut next = from + 1;
        let mut out = Vec::new();
        for (generation, changes) in log.iter().filter(|(g, _)| *g > from) {
            if *generation != next {
                return None;
            }
            next += 1;
            out.extend(changes.iter().cloned());
        }
        (next == now + 1).then_some(out)
    }

    /// Every claim, keyed by `namespace/vm/interface`, shared with the
    /// store's cache (the same `Arc` until a write).
    pub fn shared(&self) -> Result<std::sync::Arc<Claims>, StoreError> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(all) = &*cache {
            return Ok(all.clone());
        }
        let all = std::sync::Arc::new(self.read_all()?);
        *cache = Some(all.clone());
        Ok(all)
    }

    /// Every claim, keyed by `namespace/vm/interface`.
    pub fn all(&self) -> Result<Claims, StoreError> {
        Ok((*self.shared()?).clone())
    }

    fn read_all(&self) -> Result<Claims, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(CLAIMS).map_err(db_err)?;
        let mut out = BTreeMap::new();
        for entry in table.iter().map_err(db_err)? {
            let (k, v) = entry.map_err(db_err)?;
            let key = k.value().to_string();
            let claim = serde_json::from_slice(v.value()).map_err(|source| StoreError::Decode {
                key: key.clone(),
                source,
            })?;
            out.insert(crate::sys::intern::Name::new(&key), claim);
        }
        Ok(out)
    }

    /// One VM interface's claim (`namespace/vm/interface`), if any.
    pub fn get(&self, key: &str) -> Result<Option<Claim>, StoreError> {
        if let Some(all) = &*self.cache.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(all.get(key).cloned());
        }
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(CLAIMS).map_err(db_err)?;
        match table.get(key).map_err(db_err)? {
            Some(v) => serde_json::from_slice(v.value())
                .map(Some)
                .map_err(|source| StoreError::Decode {
                    key: key.to_string(),
                    source,
                }),
            None => Ok(None),
        }
    }

    /// The VM interfaces the last round accepted (empty before any).
    pub fn accepted(&self) -> Result<std::collections::BTreeSet<InterfaceKey>, StoreError> {
        let tx = self.db.begin_read().map_err(db_err)?;
        let table = tx.open_table(ACCEPTED).map_err(db_err)?;
        match table.get(ACCEPTED_ROW).map_err(db_err)? {
            Some(v) => serde_json::from_slice(v.value()).map_err(|source| StoreError::Decode {
                key: format!("accepted/{ACCEPTED_ROW}"),
                source,
            }),
            None => Ok(Default::default()),
        }
    }

    /// Records the VM interfaces a round accepted (replacing the last).
    pub fn set_accepted(
        &self,
        keys: &std::collections::BTreeSet<InterfaceKey>,
    ) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(keys).map_err(db_err)?;
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut table = tx.open_table(ACCEPTED).map_err(db_err)?;
            table
                .insert(ACCEPTED_ROW, bytes.as_slice())
                .map_err(db_err)?;
        }
        tx.commit().map_err(db_err)
    }

    /// Applies puts (`Some`) and deletes (`None`) in one transaction.
    pub fn apply(&self, changes: &BTreeMap<String, Option<Claim>>) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(db_err)?;
        {
            let mut table = tx.open_table(CLAIMS).map_err(db_err)?;
            for (key, change) in changes {
                match change {
                    Some(claim) => {
                        let bytes = serde_json::to_vec(claim).map_err(db_err)?;
                        table
                            .insert(key.as_str(), bytes.as_slice())
                            .map_err(db_err)?;
                    }
                    None => {
                        table.remove(key.as_str()).map_err(db_err)?;
                    }
                }
            }
        }
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let committed = tx.commit().map_err(db_err);
        let generation = self
            .generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        match (&committed, cache.as_mut()) {
            (Ok(()), Some(all)) => {
                let all = std::sync::Arc::make_mut(all);
                let mut logged = Vec::with_capacity(changes.len());
                for (key, change) in changes {
                    let was = match change {
                        Some(c) => all.insert(crate::sys::intern::Name::new(key), c.clone()),
                        None => all.remove::<str>(key),
                    };
                    logged.push(ClaimChange {
                        key: key.clone(),
                        was,
                        now: change.clone(),
                    });
                }
                // A first round writes every claim of the cluster, in key
                // order: a tree grown so is half empty for as long as the
                // claims are kept. Built again in one run after any write
                // of many (linear, once per such write).
                if changes.len() >= PACK_AFTER && changes.len() * 4 >= all.len() {
                    *all = crate::sys::sorted::packed(std::mem::take(all));
                }
                if logged.len() > LOG_CHANGES {
                    // Unknown from here back: a reader reads every claim.
                    log.clear();
                } else {
                    log.push_back((generation, logged));
                }
                while log.len() > LOG_WRITES
                    || log.iter().map(|(_, c)| c.len()).sum::<usize>() > LOG_CHANGES
                {
                    log.pop_front();
                }
            }
            // Whatever the database holds now is read again.
            _ => {
                *cache = None;
                log.clear();
            }
        }
        committed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Held;

    #[test]
    fn a_stored_claim_reads_and_writes_its_mac_as_text() {
        // As the store has always written one: an agent upgraded in place
        // reads its claims as they are.
        let stored = r#"{"network":"blue","ips":["10.31.0.11/24"],"mac":"02:00:00:31:00:0b","mac_origin":"detected"}"#;
        let claim: Claim = serde_json::from_str(stored).unwrap();
        assert_eq!(claim.mac, Some([2, 0, 0, 0x31, 0, 0x0b]));
        assert_eq!(serde_json::to_string(&claim).unwrap(), stored);
        let none: Claim =
            serde_json::from_str(r#"{"network":"blue","ips":[],"mac":null,"mac_origin":null}"#)
                .unwrap();
        assert_eq!(none.mac, None);
        let bad = serde_json::from_str::<Claim>(
            r#"{"network":"blue","ips":[],"mac":"02:00","mac_origin":null}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("not a MAC"));
    }

    /// Every pair `held` gives, claims' part and additions together.
    fn lookups(held: &Held) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for (net, ip, key) in held.ips.iter().chain(held.ips_added.iter()) {
            assert_eq!(held.stored_ip(net, ip), Some(key));
            out.insert(format!("{net} {ip}"), key.to_string());
        }
        for ((net, mac), key) in held.macs.iter().chain(&held.macs_added) {
            assert_eq!(held.stored_mac(net, *mac), Some(key));
            out.insert(format!("{net} {mac:?}"), key.to_string());
        }
        out
    }

    /// After random writes (new claims, addresses added, moved, shared,
    /// released, MACs), the store's log turned into additions gives what
    /// a build from every claim gives, or declines; and a store whose log
    /// was emptied, or that has no cache to compare with, declines.
    #[test]
    fn added_claims_give_what_every_claim_gives_or_nothing() {
        let dir = std::env::temp_dir().join(format!("vmpath-store-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = Store::open(&dir).unwrap();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut below = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        // Before any read there is no cache: the log says nothing.
        let mut first = BTreeMap::new();
        first.insert(
            "ns/vm0/eth0".to_string(),
            Some(Claim {
                network: "blue".into(),
                ips: vec!["10.0.0.1/24".parse().unwrap()],
                mac: None,
                mac_origin: None,
            }),
        );
        store.apply(&first).unwrap();
        assert_eq!(store.changes_since(0), None);
        let mut generation = store.generation();
        let mut held = Held::from_claims(&store.shared().unwrap());
        let (mut incremental, mut whole) = (0, 0);
        for _ in 0..400 {
            let mut writes = BTreeMap::new();
            for _ in 0..=below(2) {
                let key = format!("ns/vm{}/eth0", below(12));
                let claim = match below(6) {
                    0 => None,
                    _ => Some(Claim {
                        network: ["blue", "red"][below(2) as usize].into(),
                        ips: (0..below(3))
                            .map(|_| format!("10.0.0.{}/24", below(20)).parse().unwrap())
                            .collect(),
                        mac: (below(3) == 0).then(|| [0x52, 0x54, 0, 0, 0, below(8) as u8]),
                        mac_origin: None,
                    }),
                };
                writes.insert(key, claim);
            }
            store.apply(&writes).unwrap();
            let all = store.shared().unwrap();
            let want = Held::from_claims(&all);
            let changes = store
                .changes_since(generation)
                .expect("the log has every write since");
            match held.with_added(&changes, usize::MAX) {
                Some(next) => {
                    assert_eq!(lookups(&next), lookups(&want), "after {changes:?}");
                    held = next;
                    incremental += 1;
                }
                None => {
                    held = want;
                    whole += 1;
                }
            }
            generation = store.generation();
        }
        assert!(
            incremental > 50 && whole > 50,
            "both taken: {incremental} and {whole}"
        );
        // Further back than the log keeps: nothing.
        assert_eq!(store.changes_since(0), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write of more claims than the log keeps in all (an agent's first
    /// write at cluster scale) is not kept: a reader from before it reads
    /// every claim, and the writes after it are logged again.
    #[test]
    fn the_log_keeps_at_most_its_changes_and_a_bigger_write_empties_it() {
        let dir = std::env::temp_dir().join(format!("vmpath-store-cap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(&dir).unwrap();
        let claim = |i: usize| Claim {
            network: "blue".into(),
            ips: vec![format!("10.{}.{}.1/8", i / 256, i % 256).parse().unwrap()],
            mac: None,
            mac_origin: None,
        };
        let write = |from: usize, n: usize| {
            let writes: BTreeMap<String, Option<Claim>> = (from..from + n)
                .map(|i| (format!("ns/vm{i}/eth0"), Some(claim(i))))
                .collect();
            store.apply(&writes).unwrap();
        };
        // A cache to log against.
        write(0, 1);
        let _ = store.shared().unwrap();
        let before = store.generation();
        write(1, 3);
        assert_eq!(store.changes_since(before).map(|c| c.len()), Some(3));
        write(4, LOG_CHANGES + 1);
        let after_big = store.generation();
        assert_eq!(
            store.changes_since(before),
            None,
            "the big write was not kept"
        );
        write(5000, 2);
        assert_eq!(store.changes_since(after_big).map(|c| c.len()), Some(2));
        // Small writes up to the cap in all: the oldest go first.
        for k in 0..(LOG_CHANGES / 100 + 2) {
            write(6000 + 100 * k, 100);
        }
        let logged: usize = store.log.lock().unwrap().iter().map(|(_, c)| c.len()).sum();
        assert!(logged <= LOG_CHANGES, "{logged} changes logged");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
