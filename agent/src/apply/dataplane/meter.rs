//! The slow path's per-port token buckets: the limits the agent writes
//! from each port's network (`vmp_slow_limits`) and the per-CPU bucket
//! state the data path keeps (`vmp_slow_meter`), whose `limited` counts
//! are the per-port `slowpath_rate_limited` drops by class.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result, anyhow};
use vmpath_common::{SlowLimits, SlowMeter, slow_class};

use super::{Dataplane, Maps, batch};
use crate::plan::Plan;

impl Dataplane {
    /// Writes each planned port's limits under its id (ids no port holds
    /// get none, i.e. zero) and empties the buckets of `reset` ids (ids
    /// that changed hands), so a new port starts with a full bucket.
    pub(super) fn apply_slow_limits(
        &mut self,
        plan: &Plan,
        reset: &std::collections::BTreeSet<u32>,
    ) -> Result<()> {
        let want: BTreeMap<u32, SlowLimits> = plan
            .ports
            .values()
            .map(|p| (p.info.port_id, p.slow_limits))
            .collect();
        let mut changed: Vec<(u32, SlowLimits)> = want
            .iter()
            .filter(|(id, l)| self.slow_limits_written.get(id) != Some(l))
            .map(|(id, l)| (*id, *l))
            .collect();
        changed.extend(
            self.slow_limits_written
                .keys()
                .filter(|id| !want.contains_key(id))
                .map(|id| (*id, SlowLimits::default())),
        );
        if !changed.is_empty() {
            use aya::maps::IterableMap as _;
            batch::update_batch(self.maps.slow_limits.map(), &changed, batch::BPF_ANY)
                .context("writing entries of vmp_slow_limits")?;
        }
        self.slow_limits_written = want;
        if !reset.is_empty() {
            use aya::maps::IterableMap as _;
            let nr_cpus = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
            let zero = vec![SlowMeter::default(); nr_cpus];
            let slots: Vec<(u32, &[SlowMeter])> = reset.iter().map(|id| (*id, &zero[..])).collect();
            batch::update_batch_per_cpu(self.maps.slow_meter.map(), &slots, batch::BPF_ANY)
                .context("emptying slow-path buckets")?;
        }
        Ok(())
    }
}

impl Maps {
    /// Slow-path frames the port at `ifindex` sent over its rate, by
    /// `slow_class`, summed over CPUs (None: no such port is programmed).
    pub fn slow_rate_limited(&self, ifindex: u32) -> Result<Option<[u64; slow_class::COUNT]>> {
        let port = match self.ports.get(&ifindex, 0) {
            Ok(p) => p,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let per_cpu = self.slow_meter.get(&port.port_id, 0)?;
        let mut out = [0u64; slow_class::COUNT];
        for m in per_cpu.iter() {
            for (sum, b) in out.iter_mut().zip(&m.class) {
                *sum += b.limited;
            }
        }
        Ok(Some(out))
    }
}
