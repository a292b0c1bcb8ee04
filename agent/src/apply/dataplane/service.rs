//! Service maps. Backends are written before the Service port that
//! counts them and removed after it no longer does, so no new flow picks
//! a slot that is not there.

use std::collections::BTreeMap;

use super::Dataplane;
use crate::plan::Plan;
use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData};
use vmpath_common::ServiceBackendKey;

impl Dataplane {
    pub(super) fn apply_services(&mut self, plan: &Plan) -> Result<()> {
        let want = &plan.services;
        let have4 = written_before(&mut self.maps.service_backends, &want.backends)
            .context("writing vmp_svc_backends")?;
        let have6 = written_before(&mut self.maps.service6_backends, &want.backends6)
            .context("writing vmp_svc6_backend")?;
        super::sync(&mut self.maps.services, &want.services).context("writing vmp_svc")?;
        super::sync(&mut self.maps.services6, &want.services6).context("writing vmp_svc6")?;
        pruned_after(&mut self.maps.service_backends, have4, &want.backends)
            .context("pruning vmp_svc_backends")?;
        pruned_after(&mut self.maps.service6_backends, have6, &want.backends6)
            .context("pruning vmp_svc6_backend")?;
        let count = (want.services.len() + want.services6.len()) as u32;
        if self.maps.service_config.get(&0, 0).ok() != Some(count) {
            self.maps
                .service_config
                .set(0, count, 0)
                .context("writing vmp_svc_cfg")?;
        }
        Ok(())
    }
}

/// Writes the backends `want` holds that the map does not, before the
/// Service ports that count them; returns what the map held.
fn written_before<V: aya::Pod + PartialEq>(
    map: &mut HashMap<MapData, ServiceBackendKey, V>,
    want: &BTreeMap<ServiceBackendKey, V>,
) -> Result<BTreeMap<ServiceBackendKey, V>> {
    let have: BTreeMap<ServiceBackendKey, V> = map.iter().filter_map(|r| r.ok()).collect();
    for (k, v) in want {
        if have.get(k) != Some(v) {
            map.insert(k, v, 0)?;
        }
    }
    Ok(have)
}

/// Removes the backends no Service port counts any more (after the
/// ports were written).
fn pruned_after<V: aya::Pod>(
    map: &mut HashMap<MapData, ServiceBackendKey, V>,
    have: BTreeMap<ServiceBackendKey, V>,
    want: &BTreeMap<ServiceBackendKey, V>,
) -> Result<()> {
    for k in have.keys().filter(|k| !want.contains_key(k)) {
        map.remove(k)?;
    }
    Ok(())
}

/// Per-CPU Service counters of one port id, summed.
pub fn service_stats(
    map: &aya::maps::PerCpuArray<aya::maps::MapData, vmpath_common::ServiceStats>,
    port_id: u32,
) -> Result<vmpath_common::ServiceStats> {
    Ok(map
        .get(&port_id, 0)?
        .iter()
        .fold(Default::default(), |mut acc, s| {
            acc.flows += s.flows;
            acc.rejected += s.rejected;
            acc
        }))
}
