//! Stage 8, **apply**: the data path made to match the plan
//! (`Dataplane::apply`, only when the plan changed; then the slow path's
//! per-port answers), and the features that keep state of their own
//! brought up to date (the overlay's device and remote-MAC ageing, the
//! uplink, SNAT sweeps and the route table for BGP). The one stage that
//! needs a data path.

use std::collections::BTreeMap;

use anyhow::Result;
use tracing::{debug, info};
use vmpath_common::{AddrKey, LearnedIp};

use crate::{
    apply::dataplane::Dataplane, apply::overlay::Overlay, apply::routes::NorthSouth, plan::Plan,
    resolve::resolved::Resolved, slowpath,
};

/// Writes `plan` into the data path, then rebuilds the slow path's
/// answers from it.
pub fn apply(
    dp: &mut Dataplane,
    plan: &Plan,
    cfg: &Resolved,
    services: &slowpath::Services,
) -> Result<()> {
    dp.apply(plan)?;
    // Every round while it lasts (at debug): the status lists them, and
    // a node whose pods are not started yet would log each every event.
    for (key, port) in &plan.missing_ports {
        debug!(vm = %key, port = %port, "port not present yet");
    }
    info!(ports = plan.ports.len(), "data path programmed");
    *services.write().unwrap() = slowpath::service::build(cfg, plan);
    Ok(())
}

/// The features' own upkeep, every round, after the plan (`applied`: the
/// last plan the data path took).
#[derive(Default)]
pub struct Features {
    pub overlay: Overlay,
    pub north_south: NorthSouth,
}

impl Features {
    pub fn tick(
        &mut self,
        dp: &mut Dataplane,
        uplink: &str,
        cfg: &Resolved,
        applied: Option<&Plan>,
        learned: &BTreeMap<AddrKey, LearnedIp>,
    ) {
        self.overlay.tick(dp, cfg, applied);
        self.north_south.tick(dp, uplink, cfg, applied, learned);
    }
}
