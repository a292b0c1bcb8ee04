//! Stage 6, **observe**: what the data path found on its own since the
//! last round, taken into the resolved config. Addresses the guests used
//! (only what the learned stage accepts is routed, exported or shown), and
//! live migrations the data path already cut over on this node.

use crate::{
    apply::dataplane::Dataplane, observe::learned, observe::migration::Migrations,
    resolve::resolved::Resolved,
};

/// Takes the data path's findings into `cfg`; `learned` is the previous
/// round's outcome, replaced by this one's. Returns whether the learned
/// addresses changed.
pub fn observe(
    dp: &mut Dataplane,
    cfg: &mut Resolved,
    node: &str,
    learned: &mut learned::Outcome,
    limits: learned::Limits,
    migrations: &mut Migrations,
) -> bool {
    let learned_now = learned::read(dp, cfg, node, learned, limits);
    let learned_changed = learned_now != *learned;
    *learned = learned_now;
    cfg.learned_ips = learned.routable.clone();
    migrations.tick(cfg, node, dp);
    learned_changed
}
