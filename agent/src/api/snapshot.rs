//! What the API and metrics read: one [`Snapshot`] per request, made of the
//! view the reconcile loop published and the data path's own counters,
//! read through the pinned maps held open (opened once per data path, not
//! per request), and the slow path's message counters.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use tracing::warn;
use vmpath_common::{PortStats, slow_class};

use crate::{
    apply::dataplane::Maps,
    publish::view::{Published, View},
    slowpath::{SharedStats, SlowStats},
};

/// The data path's counters at one moment, summed over CPUs.
#[derive(Debug, Clone)]
pub struct DataplaneCounters {
    /// Drops by reason, in `drop_reason` order, or why they could not be read.
    pub drops: Result<Vec<u64>, String>,
    /// Counters of the ports the view shows programmed here, by ifindex.
    pub ports: BTreeMap<u32, PortStats>,
    /// Slow-path frames each port sent over its rate, by `slow_class`.
    pub rate_limited: BTreeMap<u32, [u64; slow_class::COUNT]>,
    /// The overlay's counters and the number of remote MACs it learned;
    /// `None` when the overlay's maps cannot be read.
    pub overlay: Option<(PortStats, usize)>,
    /// NetworkPolicy counters of the ports shown programmed here, by ifindex.
    pub policy: BTreeMap<u32, vmpath_common::PolicyStats>,
    /// New flows each policy allowed, by the view's policy index.
    pub policy_hits: Vec<u64>,
    /// Service counters of the ports shown programmed here, by ifindex.
    pub service: BTreeMap<u32, vmpath_common::ServiceStats>,
    /// The uplink XDP program's frames, in `xdp_stat` order (empty when
    /// its map cannot be read).
    pub uplink_xdp: Vec<u64>,
}

/// Everything one request reads.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub view: std::sync::Arc<View>,
    /// Why the pinned maps could not be opened, when they could not.
    pub dataplane: Result<DataplaneCounters, String>,
    pub slow: SlowStats,
}

/// The pinned maps as last opened, and for which data path generation.
struct Held {
    generation: u64,
    maps: Maps,
}

/// The one reader of the agent's state for the API and metrics.
pub struct Observer {
    published: Arc<Published>,
    slow: SharedStats,
    bpffs: PathBuf,
    held: Mutex<Option<Held>>,
}

impl Observer {
    pub fn new(published: Arc<Published>, slow: SharedStats, bpffs: PathBuf) -> Self {
        Observer {
            published,
            slow,
            bpffs,
            held: Mutex::new(None),
        }
    }

    pub fn published(&self) -> &Published {
        &self.published
    }

    /// The bpffs the agent pins under.
    pub fn bpffs(&self) -> &std::path::Path {
        &self.bpffs
    }

    /// The published view alone (no kernel reads).
    pub fn view(&self) -> std::sync::Arc<View> {
        self.published.view()
    }

    /// The slow path's counters.
    pub fn slow(&self) -> SlowStats {
        match self.slow.lock() {
            Ok(s) => s.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The view, the data path's counters and the slow path's, now.
    pub fn snapshot(&self) -> Snapshot {
        let view = self.view();
        let dataplane = self.read_dataplane(&view);
        Snapshot {
            view,
            dataplane,
            slow: self.slow(),
        }
    }

    fn read_dataplane(&self, view: &View) -> Result<DataplaneCounters, String> {
        let generation = self.published.dataplane_generation();
        let mut held = match self.held.lock() {
            Ok(h) => h,
            Err(poisoned) => poisoned.into_inner(),
        };
        if held.as_ref().is_none_or(|h| h.generation != generation) {
            *held = None;
            let maps = Maps::open(&self.bpffs).map_err(|e| format!("{e:#}"))?;
            // Before the loop opened the data path, maps left by an earlier
            // agent may yet be replaced: read them, but do not hold them.
            if generation == 0 {
                return Ok(counters(&maps, view));
            }
            *held = Some(Held { generation, maps });
        }
        let maps = &held.as_ref().expect("opened above").maps;
        let counters = counters(maps, view);
        if counters.drops.is_err() {
            // A map that cannot be read now: open them anew next time.
            *held = None;
        }
        Ok(counters)
    }
}

fn counters(maps: &Maps, view: &View) -> DataplaneCounters {
    let drops = maps.drop_counts().map_err(|e| {
        warn!("reading drop counters: {e:#}");
        format!("{e:#}")
    });
    let mut ports = BTreeMap::new();
    let mut rate_limited = BTreeMap::new();
    let mut policy = BTreeMap::new();
    let mut service = BTreeMap::new();
    for (a, ifindex) in view.local_ports() {
        match maps.service_stats(ifindex) {
            Ok(Some(s)) => {
                service.insert(ifindex, s);
            }
            Ok(None) => {}
            Err(e) => warn!(port = %a.port, "reading Service counters: {e:#}"),
        }
        match maps.slow_rate_limited(ifindex) {
            Ok(Some(by_class)) => {
                rate_limited.insert(ifindex, by_class);
            }
            Ok(None) => {}
            Err(e) => warn!(port = %a.port, "reading slow-path meters: {e:#}"),
        }
        match maps.policy_stats(ifindex) {
            Ok(Some(s)) => {
                policy.insert(ifindex, s);
            }
            Ok(None) => {}
            Err(e) => warn!(port = %a.port, "reading policy counters: {e:#}"),
        }
        match maps.port_stats(ifindex) {
            Ok(Some(s)) => {
                ports.insert(ifindex, s);
            }
            Ok(None) => {}
            Err(e) => warn!(port = %a.port, "reading port counters: {e:#}"),
        }
    }
    let overlay = maps
        .overlay_stats()
        .ok()
        .map(|o| (o, maps.remote_learned.keys().filter(|k| k.is_ok()).count()));
    let policy_hits = maps.policy_hits(view.policies.len()).unwrap_or_else(|e| {
        warn!("reading policy counters: {e:#}");
        Vec::new()
    });
    let uplink_xdp = maps.uplink_xdp_counts().unwrap_or_else(|e| {
        warn!("reading uplink XDP counters: {e:#}");
        Vec::new()
    });
    DataplaneCounters {
        drops,
        ports,
        rate_limited,
        overlay,
        policy,
        policy_hits,
        service,
        uplink_xdp,
    }
}
