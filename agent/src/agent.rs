//! The agent's main loop: opens the data path and the node services (slow
//! path, monitor), then runs a [`Round`] (the stage chain of
//! `crate::round`) whenever the config, the node's interfaces or the data
//! path's own findings change, and at least every resync interval.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tracing::{error, info, warn};

use crate::{
    apply::dataplane::Dataplane,
    publish::view::{Published, SharedView},
    resolve::store::Store,
    round::{self, Round},
    slowpath,
};

#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub config_dir: PathBuf,
    pub node: String,
    pub bpffs: PathBuf,
    pub state_dir: PathBuf,
    /// How often the data path's own findings (learned MACs and
    /// addresses, migration cut-overs) are checked for a change.
    pub interval: Duration,
    /// The full reconcile's safety net, whatever the events say.
    pub resync: Duration,
    /// React to config-dir and link notifications (off: timers only, the
    /// old polling behaviour).
    pub events: bool,
    /// The node's uplink: routed ingress and SNAT return traffic.
    pub uplink: String,
    /// Native XDP on the uplink for the common cases (`--uplink-xdp`).
    pub uplink_xdp: crate::apply::dataplane::UplinkXdp,
    /// Slow-path frames served per second, all ports together.
    pub slowpath_serve_rate: u64,
    /// Expiry and per-port cap of learned addresses.
    pub learned: crate::observe::learned::Limits,
    /// The data path's debug events at start.
    pub datapath_debug: crate::apply::dataplane::debug_log::Switches,
    /// Where the documents come from.
    pub source: Source,
    /// Sizes of the cluster-sized maps (`--max-endpoints`, `--max-addresses`).
    pub map_sizes: crate::apply::dataplane::MapSizes,
    /// The cluster's pod and Service CIDRs as the flags give them.
    pub cluster_cidrs: Vec<crate::config::ClusterCidr>,
}

/// Where the documents come from: the config dir, or the API server
/// (the same kinds, docs/kubernetes.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Files,
    Kubernetes {
        kubeconfig: Option<PathBuf>,
        /// `vmpath controller`'s ledger: a claim's `status.ips` counts
        /// only where it vouches for them.
        ledger: crate::read::kube_source::LedgerRef,
    },
}

/// Runs the agent: publishes what it knows into `shared` after each round;
/// `slow_stats` receives the slow path's message counters.
pub fn run(
    opts: &AgentOptions,
    shared: SharedView,
    slow_stats: slowpath::SharedStats,
    monitor: Arc<crate::monitor::Hub>,
) -> Result<()> {
    let mut dp =
        Dataplane::open_sized(&opts.bpffs, &opts.map_sizes).context("opening the data path")?;
    dp.set_uplink_xdp(opts.uplink_xdp);
    if let Err(e) = monitor.start_reader(shared.clone()) {
        error!("vmpath monitor will show nothing: {e:#}");
    }
    // What a previous agent switched on does not outlive it.
    if let Err(e) = crate::apply::dataplane::debug_log::set(&opts.bpffs, opts.datapath_debug) {
        warn!("setting the data path's debug events: {e:#}");
    }
    shared.dataplane_opened();
    crate::apply::node_lock::record_programs(&opts.state_dir, dp.program_ids());
    if let Some(policy) = crate::resolve::port_eligibility::policy() {
        crate::resolve::port_eligibility::repair(policy);
    }
    let services = slowpath::Services::default();
    if let Err(e) = slowpath::start(
        &mut dp,
        &opts.bpffs,
        services.clone(),
        slow_stats,
        opts.slowpath_serve_rate,
    ) {
        error!("slow path (DHCP, DHCPv6, RA) not available: {e:#}");
    }
    info!(node = %opts.node, bpffs = %opts.bpffs.display(), config = %opts.config_dir.display(), "agent started");
    let store = Store::open(&opts.state_dir).context("opening the claims store")?;
    let mut pacer = Pacer::new(opts);
    shared.set_waker(pacer.events.sender());
    let cluster = match &opts.source {
        Source::Files => None,
        Source::Kubernetes { kubeconfig, ledger } => Some(
            crate::read::kube_source::KubeSource::start(
                kubeconfig.clone(),
                &opts.node,
                ledger,
                shared.clone(),
            )
            .context("starting the Kubernetes source")?,
        ),
    };
    if let Some(cluster) = &cluster {
        // Forwarding off is said on the Node too.
        let node = cluster.node_reporter();
        crate::api::forwarding::report_to(Box::new(move |problems| {
            node.report(crate::publish::writeback::REASON_FORWARDING_OFF, problems)
        }));
    }
    let settings = round::Settings {
        node: opts.node.clone(),
        config_dir: opts.config_dir.clone(),
        state_dir: opts.state_dir.clone(),
        bpffs: opts.bpffs.clone(),
        uplink: opts.uplink.clone(),
        learned: opts.learned,
        cluster_cidrs: opts.cluster_cidrs.clone(),
    };
    let mut round = Round::new(settings, cluster, store);
    let mut first = true;
    // The first round is a full one: its time is the net's first cost.
    let mut net = SafetyNet::new(opts.resync);
    loop {
        let mut full = first;
        let wake = match first {
            true => Wake::Event,
            false => pacer.wait(&dp, &shared, |name| round.link_matters(name)),
        };
        if wake == Wake::Resync && net.due() {
            // The safety net: every object derived again and every map
            // read back, whatever the increments kept.
            round.forget_increments();
            dp.forget_written();
            full = true;
        }
        first = false;
        shared.heartbeat();
        let started = Instant::now();
        // What the data path had found when the round began: a finding made
        // while it ran (a guest heard again once the round had published
        // its address expired) differs from it and wakes the next round.
        // Taken after the round, it hid such a finding until the resync.
        let findings = data_path_fingerprint(&dp);
        let outcome = round.run(&mut dp, &shared, &services, wake == Wake::Objects);
        if full {
            net.ran(started.elapsed());
        }
        match outcome {
            round::Outcome::Empty => pacer.passed(findings),
            // The data path's findings are left for the next round that
            // reads them (its fingerprint stays the last such round's).
            round::Outcome::Unchanged => {}
            round::Outcome::Retry => pacer.retry_soon(),
            round::Outcome::Done { retry, migrating } => {
                if retry {
                    pacer.retry_soon();
                }
                // Until a migration is over, the data path's side of it is
                // followed on every tick.
                pacer.migrating = migrating;
                pacer.passed(findings);
            }
        }
    }
}

/// When the resync's full recompute runs: every resync interval, but no
/// more than [`SafetyNet::DUTY`] of the loop's time. At 100,000 VMs a full
/// pass is seconds, during which no CNI ADD is answered: every 5 s it was
/// most of the agent's time and most of an ADD's wait. A resync wake in
/// between is an incremental round (it still paces the ageing).
struct SafetyNet {
    interval: Duration,
    last: Instant,
    cost: Duration,
}

impl SafetyNet {
    /// A full pass waits at least this many times its last duration.
    const DUTY: u32 = 20;

    fn new(interval: Duration) -> Self {
        SafetyNet {
            interval,
            last: Instant::now(),
            cost: Duration::ZERO,
        }
    }

    /// Whether a full recompute is due.
    fn due(&self) -> bool {
        self.due_at(Instant::now())
    }

    fn due_at(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last) >= self.interval.max(self.cost * Self::DUTY)
    }

    /// A full recompute took `cost`, ending now.
    fn ran(&mut self, cost: Duration) {
        self.cost = cost;
        self.last = Instant::now();
    }
}

/// Why the loop woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A config or link event, the data path's findings, a retry.
    Event,
    /// Watched cluster objects changed, and nothing else (no migration
    /// under way, nothing new in the data path).
    Objects,
    /// The resync interval passed with nothing else.
    Resync,
}

/// Decides when the loop runs a reconcile pass: at once on a config or
/// link event, on a data-path tick that found something new (or while a
/// migration is under way), on a retry after an error, and at the latest
/// every resync interval.
struct Pacer {
    events: crate::sys::events::Events,
    interval: Duration,
    resync: Duration,
    last_pass: Instant,
    data_path: u64,
    migrating: bool,
    retry: bool,
}

impl Pacer {
    fn new(opts: &AgentOptions) -> Self {
        let events = if opts.events {
            crate::sys::events::Events::start(&opts.config_dir)
        } else {
            crate::sys::events::Events::none()
        };
        Pacer {
            events,
            interval: opts.interval,
            resync: opts.resync,
            last_pass: Instant::now(),
            data_path: 0,
            migrating: false,
            retry: false,
        }
    }

    /// Called after every pass, with the data path's findings as the
    /// pass began (what the round's own deletions change since then wakes
    /// one more round, which finds nothing new).
    fn passed(&mut self, findings: u64) {
        self.last_pass = Instant::now();
        self.data_path = findings;
    }

    fn retry_soon(&mut self) {
        self.retry = true;
    }

    /// Blocks until the next pass is due; says why it is. A wake made of
    /// link events alone, none of which `link_matters`, is no reason.
    fn wait(
        &mut self,
        dp: &Dataplane,
        shared: &Published,
        link_matters: impl Fn(&str) -> bool,
    ) -> Wake {
        if std::mem::take(&mut self.retry) {
            std::thread::sleep(self.interval);
            return Wake::Event;
        }
        loop {
            let due = self.last_pass + self.resync;
            let now = Instant::now();
            if now >= due {
                return Wake::Resync;
            }
            let wakes = self.events.wait(self.interval.min(due - now));
            if wakes.iter().any(|w| wake_matters(w, &link_matters)) {
                tracing::debug!(?wakes, "woken");
                // Objects alone, unless the data path found something or a
                // migration is followed (never starved by a busy watch).
                let objects = wakes
                    .iter()
                    .all(|w| matches!(w, crate::sys::events::Wake::Cluster));
                if objects && !self.migrating && data_path_fingerprint(dp) == self.data_path {
                    return Wake::Objects;
                }
                return Wake::Event;
            }
            if !wakes.is_empty() {
                tracing::debug!(?wakes, "not woken: links no round serves yet");
            }
            shared.heartbeat();
            if self.migrating || data_path_fingerprint(dp) != self.data_path {
                return Wake::Event;
            }
        }
    }
}

/// Whether `wake` is a reason for a pass: any but a link event for an
/// interface `link_matters` says no round serves yet.
fn wake_matters(wake: &crate::sys::events::Wake, link_matters: impl Fn(&str) -> bool) -> bool {
    use crate::sys::{events::Wake as W, netlink::LinkEvent};
    match wake {
        W::Link(LinkEvent::New(name) | LinkEvent::Gone(name)) => link_matters(name),
        _ => true,
    }
}

/// What the data path learned on its own: MACs, addresses, migration
/// events. A change is worth a reconcile.
fn data_path_fingerprint(dp: &Dataplane) -> u64 {
    let maps = dp.maps();
    let mut bytes: Vec<u8> = Vec::new();
    for (ifindex, m) in maps.learned_macs.iter().filter_map(|r| r.ok()) {
        bytes.extend_from_slice(&ifindex.to_le_bytes());
        bytes.extend_from_slice(&m.mac);
    }
    bytes.push(0xff);
    for (k, v) in maps.learned_ips.iter().filter_map(|r| r.ok()) {
        bytes.extend_from_slice(&k.network.to_le_bytes());
        bytes.extend_from_slice(&k.addr);
        bytes.extend_from_slice(&v.ifindex.to_le_bytes());
        bytes.extend_from_slice(&v.mac);
    }
    bytes.push(0xff);
    // A new conflict over a learned address is said at once, not at resync.
    for (k, v) in maps.learn_conflicts.iter().filter_map(|r| r.ok()) {
        bytes.extend_from_slice(&k.addr);
        bytes.extend_from_slice(&v.ifindex.to_le_bytes());
    }
    bytes.push(0xff);
    for (ifindex, _) in maps.migrated.iter().filter_map(|r| r.ok()) {
        bytes.extend_from_slice(&ifindex.to_le_bytes());
    }
    crate::sys::hash::fnv1a(&[&bytes])
}

#[cfg(test)]
mod tests {
    use super::SafetyNet;
    use std::time::Duration;

    /// A cheap full pass runs every interval; a costly one no more than a
    /// twentieth of the time, so a large cluster's ADDs are not held up.
    #[test]
    fn the_full_recompute_runs_every_interval_or_twenty_times_its_cost_apart() {
        let mut net = SafetyNet::new(Duration::from_secs(5));
        let start = net.last;
        assert!(!net.due_at(start + Duration::from_millis(4999)));
        assert!(net.due_at(start + Duration::from_secs(5)));
        net.ran(Duration::from_millis(30));
        let after = net.last;
        assert!(
            net.due_at(after + Duration::from_secs(5)),
            "30 ms: every interval"
        );
        net.ran(Duration::from_secs(4));
        let after = net.last;
        assert!(!net.due_at(after + Duration::from_secs(5)));
        assert!(!net.due_at(after + Duration::from_secs(79)));
        assert!(
            net.due_at(after + Duration::from_secs(80)),
            "4 s: 80 s apart"
        );
    }
}
