//! NetworkPolicy maps: rules and identities are written before an
//! endpoint is isolated and removed after it no longer is, so no packet
//! meets an isolated endpoint without its rules.

use std::collections::BTreeMap;

use super::Dataplane;
use crate::plan::Plan;
use anyhow::{Context as _, Result};
use aya::maps::{
    MapData,
    lpm_trie::{Key as LpmKey, LpmTrie},
};

/// An LPM map's entries as (length, data) -> value.
type LpmEntries<K> = BTreeMap<(u32, K), u32>;

fn read_lpm<K: aya::Pod + Ord>(map: &LpmTrie<MapData, K, u32>) -> LpmEntries<K> {
    map.iter()
        .filter_map(|r| r.ok())
        .map(|(k, v)| ((k.prefix_len(), k.data()), v))
        .collect()
}

/// Writes what `want` has that differs; returns what is to go.
fn write_lpm<K: aya::Pod + Ord>(
    map: &mut LpmTrie<MapData, K, u32>,
    want: &LpmEntries<K>,
) -> Result<Vec<(u32, K)>> {
    let have = read_lpm(map);
    for ((len, data), v) in want {
        if have.get(&(*len, *data)) != Some(v) {
            map.insert(&LpmKey::new(*len, *data), *v, 0)?;
        }
    }
    Ok(have.into_keys().filter(|k| !want.contains_key(k)).collect())
}

fn remove_lpm<K: aya::Pod>(map: &mut LpmTrie<MapData, K, u32>, gone: &[(u32, K)]) -> Result<()> {
    for (len, data) in gone {
        map.remove(&LpmKey::new(*len, *data))?;
    }
    Ok(())
}

impl Dataplane {
    pub(super) fn apply_policy(&mut self, plan: &Plan) -> Result<()> {
        let p = &plan.policy;
        // Rules before the addresses that point at their identities: an
        // identity's number never changes meaning (`policy::compile`), so
        // a new identity's rules are in before any address maps to it, and
        // a gone one's stay until no address does.
        let gone_rules =
            write_lpm(&mut self.maps.policy_rules, &p.rules).context("writing vmp_pol_rules")?;
        let gone_ids = write_lpm(&mut self.maps.policy_ipcache, &p.ipcache)
            .context("writing vmp_pol_ipcache")?;
        // Before isolation takes effect: IP floods skip isolated ports.
        super::sync(&mut self.maps.policy_flood, &p.flood).context("writing vmp_pol_flood")?;
        // Every port id in use gets its entry (zero: not isolated), so an
        // id handed to a new port never inherits another's isolation.
        for port in plan.ports.values() {
            let id = port.info.port_id;
            let want = p.endpoints.get(&id).copied().unwrap_or_default();
            if self.policy_written.get(&id) != Some(&want) {
                self.maps
                    .policy_endpoints
                    .set(id, want, 0)
                    .context("writing vmp_pol_ep")?;
                self.policy_written.insert(id, want);
            }
        }
        remove_lpm(&mut self.maps.policy_rules, &gone_rules).context("pruning vmp_pol_rules")?;
        remove_lpm(&mut self.maps.policy_ipcache, &gone_ids).context("pruning vmp_pol_ipcache")?;
        Ok(())
    }
}

/// Per-CPU policy counters of one port id, summed.
pub fn policy_stats(
    map: &aya::maps::PerCpuArray<MapData, vmpath_common::PolicyStats>,
    port_id: u32,
) -> Result<vmpath_common::PolicyStats> {
    Ok(map
        .get(&port_id, 0)?
        .iter()
        .fold(Default::default(), |mut acc, s| {
            acc.add(s);
            acc
        }))
}
