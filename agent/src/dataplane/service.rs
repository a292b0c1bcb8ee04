//! Service maps. Backends are written before the Service port that
//! counts them and removed after it no longer does, so no new flow picks
//! a slot that is not there.

use std::collections::BTreeMap;

use super::Dataplane;
use crate::plan::Plan;
use anyhow::{Context as _, Result};
use vmpath_common::{ServiceBackend, ServiceBackendKey};

impl Dataplane {
    pub(super) fn apply_services(&mut self, plan: &Plan) -> Result<()> {
        let want = &plan.services;
        let have: BTreeMap<ServiceBackendKey, ServiceBackend> = self
            .maps
            .service_backends
            .iter()
            .filter_map(|r| r.ok())
            .collect();
        for (k, v) in &want.backends {
            if have.get(k) != Some(v) {
                self.maps
                    .service_backends
                    .insert(k, v, 0)
                    .context("writing vmp_svc_backends")?;
            }
        }
        super::sync(&mut self.maps.services, &want.services).context("writing vmp_svc")?;
        for k in have.keys().filter(|k| !want.backends.contains_key(k)) {
            self.maps
                .service_backends
                .remove(k)
                .context("pruning vmp_svc_backends")?;
        }
        let count = want.services.len() as u32;
        if self.maps.service_config.get(&0, 0).ok() != Some(count) {
            self.maps
                .service_config
                .set(0, count, 0)
                .context("writing vmp_svc_cfg")?;
        }
        Ok(())
    }
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
