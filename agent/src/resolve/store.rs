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

/// A VM interface as [`Store::accepted`] keeps it.
pub type InterfaceKey = (String, String, String);

impl crate::config::Held {
    /// What the claims store records. Beside the store, not in `config`:
    /// validation takes a [`Held`](crate::config::Held) and knows no store.
    pub fn from_claims(claims: &BTreeMap<String, Claim>) -> Self {
        let mut ips = crate::sys::hash::HashMap::default();
        let mut macs = crate::sys::hash::HashMap::default();
        for (key, c) in claims {
            for ip in &c.ips {
                ips.insert((c.network.clone(), ip.addr()), key.clone());
            }
            if let Some(mac) = c
                .mac
                .as_deref()
                .and_then(|m| crate::config::parse_mac(m).ok())
            {
                macs.insert((c.network.clone(), mac), key.clone());
            }
        }
        Self {
            ips: ips.into(),
            macs: macs.into(),
            ..Self::default()
        }
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
    pub network: String,
    /// Addresses allocated by IPAM or requested in `spec.ips`.
    pub ips: Vec<IpNet>,
    /// The MAC detected in the VM's traffic or generated for it.
    pub mac: Option<String>,
    pub mac_origin: Option<Origin>,
}

pub struct Store {
    db: Database,
    /// Every claim as last read or written: a round reads them all, and
    /// parsing the database's JSON again each time grew with the cluster.
    cache: std::sync::Mutex<Option<std::sync::Arc<BTreeMap<String, Claim>>>>,
    /// Counts writes: what was built from the claims stays valid while
    /// it is the same.
    generation: std::sync::atomic::AtomicU64,
}

impl Store {
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(state_dir).map_err(db_err)?;
        let path = state_dir.join("claims.redb");
        let db = Database::create(&path).map_err(|source| StoreError::Open {
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
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The number of writes so far.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every claim, keyed by `namespace/vm/interface`, shared with the
    /// store's cache (the same `Arc` until a write).
    pub fn shared(&self) -> Result<std::sync::Arc<BTreeMap<String, Claim>>, StoreError> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(all) = &*cache {
            return Ok(all.clone());
        }
        let all = std::sync::Arc::new(self.read_all()?);
        *cache = Some(all.clone());
        Ok(all)
    }

    /// Every claim, keyed by `namespace/vm/interface`.
    pub fn all(&self) -> Result<BTreeMap<String, Claim>, StoreError> {
        Ok((*self.shared()?).clone())
    }

    fn read_all(&self) -> Result<BTreeMap<String, Claim>, StoreError> {
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
            out.insert(key, claim);
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
        let committed = tx.commit().map_err(db_err);
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match (&committed, cache.as_mut()) {
            (Ok(()), Some(all)) => {
                let all = std::sync::Arc::make_mut(all);
                for (key, change) in changes {
                    match change {
                        Some(c) => {
                            all.insert(key.clone(), c.clone());
                        }
                        None => {
                            all.remove(key);
                        }
                    }
                }
            }
            // Whatever the database holds now is read again.
            _ => *cache = None,
        }
        committed
    }
}
