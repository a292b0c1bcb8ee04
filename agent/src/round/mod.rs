//! The agent's round: a chain of named stages, each a module with typed
//! input and output, run in this order by [`Round::run`]:
//!
//! | stage | module | takes | gives |
//! |---|---|---|---|
//! | read | [`read`] | the config dir or the API server, the CNI ports | [`Snapshot`] |
//! | derive | [`derive`] | [`Snapshot`] | [`Translated`] (vmpath's own documents) |
//! | validate | [`mod@validate`] | [`Translated`], who holds what ([`Held`]) | [`Config`] (valid and refused documents) |
//! | resolve | [`resolve`] | [`Config`] | [`Resolved`](crate::resolve::resolved::Resolved) (to be enriched) |
//! | IPAM | [`ipam`] | [`Resolved`](crate::resolve::resolved::Resolved), the claims store, MACs the data path saw | [`Resolved`](crate::resolve::resolved::Resolved) with addresses and MACs, MAC refusals |
//! | observe | [`observe`] | [`Resolved`](crate::resolve::resolved::Resolved), the data path's findings | [`Resolved`](crate::resolve::resolved::Resolved) with learned addresses and cut-overs |
//! | plan | [`plan`] | [`Resolved`](crate::resolve::resolved::Resolved), the last ids ([`plan::Previous`]) | [`Plan`] (every map's desired content) |
//! | apply | [`apply`] | [`Plan`] | the data path programmed (the only stage that writes it) |
//! | publish | [`publish`] | [`Resolved`](crate::resolve::resolved::Resolved), the applied [`Plan`] | the log, Events, the view (API, CLI, metrics), `status.json` |
//!
//! Each driver here runs the substance of its stage, which lives in a
//! folder of its own beside `round/` (docs/architecture.md, "The agent's
//! folders"): read: `config::source`, `crate::read`, `api::endpoints`;
//! derive: `crate::derive`; validate: `crate::config`; resolve and IPAM:
//! `crate::resolve`; observe: `crate::observe`; plan: `crate::plan`;
//! apply: `crate::apply`; publish: `crate::publish`.
//!
//! Every stage but observe and apply runs without a data path (their
//! unit tests show how); read and publish touch it only for what a
//! restarted agent finds pinned. `agent::run` owns the data path and the
//! pacing; a `Round` owns what one round hands the next.

pub mod apply;
pub mod derive;
#[cfg(test)]
mod equivalence;
pub mod groups;
pub mod ipam;
pub mod membership;
pub mod observe;
pub mod plan;
pub mod publish;
pub mod read;
pub mod resolve;
pub mod validate;

use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Instant};

use tracing::{error, info, warn};

use crate::{
    apply::dataplane::Dataplane,
    config::{
        AcceptedKeys, AttachmentKey, Config, ConfigError, Held, KeepFirst, Translated,
        source::{Reader, Snapshot},
        validate_documents,
    },
    observe::learned,
    observe::migration::Migrations,
    plan::Plan,
    publish::view::SharedView,
    read::kube_source::KubeSource,
    resolve::store::Store,
    slowpath,
    sys::clock::unix_now,
    sys::drop_later::drop_later,
    sys::latest::Latest,
    sys::netif::ifindex_of,
};

/// Derives and validates every document of `snapshot` for `node_name`
/// (the derive and validate stages, as tests use them).
/// `keep_first`: attachments accepted by the previous round (they win a
/// conflict).
pub fn validate(snapshot: &Snapshot, node_name: &str, keep_first: &dyn KeepFirst) -> Config {
    validate_held(snapshot, node_name, keep_first, &Held::default())
}

/// As [`validate`]; an address or MAC `held` records (the claims store)
/// stays with its VM interface whatever order the documents come in.
pub fn validate_held(
    snapshot: &Snapshot,
    node_name: &str,
    keep_first: &dyn KeepFirst,
    held: &Held,
) -> Config {
    let derived: Translated = derive::derive(snapshot, node_name);
    validate_documents(&snapshot.errors, derived, node_name, keep_first, held)
}

/// What the stages need of the agent's options.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub node: String,
    pub config_dir: PathBuf,
    pub state_dir: PathBuf,
    pub bpffs: PathBuf,
    /// The node's uplink (north-south).
    pub uplink: String,
    /// Expiry and per-port cap of learned addresses.
    pub learned: learned::Limits,
    /// The cluster's pod and Service CIDRs as the flags give them.
    pub cluster_cidrs: Vec<crate::config::ClusterCidr>,
}

/// How a round ended, for the loop's pacing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing to work from (no documents yet): the data path is left as
    /// it is.
    Empty,
    /// The claims store failed: the round stopped before planning; try
    /// again soon.
    Retry,
    /// The round ran to the end. `retry`: applying the plan failed and is
    /// tried again soon; `migrating`: a migration is under way (its data
    /// path side is followed on every tick).
    Done { retry: bool, migrating: bool },
    /// Woken by cluster objects alone, none of which any VM interface or
    /// the context reads (a claim before its VM, an object of a kind no
    /// group takes): the validated config is the last round's, so is the
    /// rest of the round, and it stopped after validation.
    Unchanged,
}

/// How long the `status.json` writer rests after a write, in writes.
const STATUS_REST: u32 = 4;

/// How many claim pairs `Round::held` keeps beside the claims' part
/// before it builds the whole again (a lookup checks both).
const HELD_ADDED_CAP: usize = 1024;

/// What one round hands the next.
pub struct Round {
    settings: Settings,
    cluster: Option<KubeSource>,
    store: Arc<Store>,
    reader: Reader,
    last_fingerprint: Option<u64>,
    /// The last plan the data path took.
    last_plan: Option<Plan>,
    /// Attachments the last round accepted (they win a conflict). Shared
    /// with the validated config kept for the next round and with the
    /// record's writer (a persistent set: changed, not copied).
    accepted: AcceptedKeys,
    /// Records `accepted` in the claims store, off the loop's path: after
    /// a restart the previous agent's last round still wins a conflict no
    /// claim or port here decides (an IPAM-less address or a given MAC of
    /// a VM on another node), not file order.
    accepted_record: Latest<AcceptedKeys>,
    /// The last round's kept claims (`Round::kept_claims`).
    kept_claims: crate::resolve::resolved::KeptClaims,
    /// What the last round served on this node's ports.
    running: Held,
    warned_empty: bool,
    last_errors: Vec<ConfigError>,
    learned: learned::Outcome,
    refused_macs: BTreeSet<(AttachmentKey, [u8; 6])>,
    features: apply::Features,
    migrations: Migrations,
    /// The last validated config and what it was validated against.
    validated: Option<Validated>,
    /// What the last round's IPAM left, for deciding only what changed.
    ipam_memo: Option<crate::resolve::ipam_memo::Memo>,
    /// Other nodes' part of the last plan, for the next while it holds.
    overlay: crate::plan::overlay::Cache,
    /// Who holds what, as last built from the claims store's copy and the
    /// running ports: built again only when either changed.
    held: Option<(u64, Arc<Held>)>,
    /// How derive and validate ran, round by round (the equivalence test
    /// asserts the partial passes are taken).
    pub passes: Passes,
    /// When the heap was last trimmed.
    last_trim: Option<Instant>,
    /// The resolved VM interfaces the last round ended with, carried over
    /// into the next (`Resolved::carrying`): in key order, and one for
    /// one the entries of the published view.
    last_resolved: Vec<crate::resolve::resolved::Entry>,
    /// Which of them may have a port here, and which migrate.
    last_indexes: crate::resolve::resolved::Indexes,
    /// The keys of the last round's entries this round did not carry
    /// over (their documents changed or went): what leaves the accepted
    /// set before this round's changed entries join it.
    dropped_keys: Vec<AttachmentKey>,
    /// This round's validation kept the last validated config as it was.
    kept_as_is: bool,
    /// Writes `status.json` (its thread keeps the entries as text for the
    /// next write), off the loop's path.
    status_record: Latest<(std::path::PathBuf, Arc<crate::publish::view::View>)>,
}

/// How the derive and validate stages ran, round by round.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Passes {
    /// Nothing changed: the last config as it was.
    pub skipped: u64,
    /// Only some VMs' objects changed: those VMs alone.
    pub partial: u64,
    /// Every object.
    pub full: u64,
    /// IPAM decided only the VM interfaces that changed
    /// (`resolve::ipam_memo`).
    pub ipam_increments: u64,
}

/// A validated config and the inputs it came from besides the objects:
/// while neither the objects nor these change, derive and validate would
/// give it again, so they are skipped (a port appearing, the data path's
/// findings, a resync with nothing new); when only some VMs' objects
/// changed, they run on those VMs alone ([`groups`]).
struct Validated {
    /// The validated documents (the CNI plugin's kept claims are IPAM's
    /// input, `Resolved::kept_claims`).
    config: Arc<Config>,
    held: Arc<Held>,
    accepted: AcceptedKeys,
    cluster_cidrs: Vec<crate::config::ClusterCidr>,
    /// Where each object went, and who holds what, for the next partial
    /// pass.
    membership: groups::Membership,
    holdings: groups::Holdings,
}

impl Round {
    pub fn new(settings: Settings, cluster: Option<KubeSource>, store: Store) -> Self {
        let stored_accepted = store.accepted().unwrap_or_else(|e| {
            warn!("reading the accepted VM interfaces: {e}; document order decides this round");
            BTreeSet::new()
        });
        let accepted: AcceptedKeys = stored_accepted
            .iter()
            .map(|(namespace, vm, interface)| {
                AttachmentKey::new(
                    namespace.as_str().into(),
                    vm.as_str().into(),
                    interface.as_str().into(),
                )
            })
            .collect();
        let store = Arc::new(store);
        let record_store = store.clone();
        // The store's keys are made on the record's thread: at 10,000 VMs
        // a copy of every key was milliseconds of the round.
        let accepted_record = Latest::spawn("vmpath-accepted", move |accepted: &AcceptedKeys| {
            let keys: BTreeSet<crate::resolve::store::InterfaceKey> = accepted
                .iter()
                .map(|k| {
                    (
                        k.namespace.to_string(),
                        k.vm.to_string(),
                        k.interface.to_string(),
                    )
                })
                .collect();
            record_store.set_accepted(&keys).map_err(|e| e.to_string())
        });
        let mut status_file = publish::StatusFile::default();
        // At most a fifth of a CPU: at 10,000 VMs the file is megabytes,
        // and written after every round that changed the view it competed
        // with the rounds (and the CNI plugin) on a small node. The API and
        // the CLI answer from the view in memory; the file lags it by at
        // most four times a write.
        let status_record = Latest::spawn_paced(
            "vmpath-status",
            STATUS_REST,
            move |(dir, view): &(std::path::PathBuf, Arc<crate::publish::view::View>)| {
                status_file
                    .write(dir, view)
                    .map_err(|e| format!("{}: {e:#}", dir.join("status.json").display()))
            },
        );
        Round {
            settings,
            cluster,
            store,
            reader: Reader::default(),
            last_fingerprint: None,
            last_plan: None,
            accepted,
            accepted_record,
            kept_claims: Default::default(),
            running: Held::default(),
            warned_empty: false,
            last_errors: Vec::new(),
            learned: learned::Outcome::default(),
            refused_macs: BTreeSet::new(),
            features: apply::Features::default(),
            migrations: Migrations::default(),
            validated: None,
            ipam_memo: None,
            overlay: Default::default(),
            held: None,
            passes: Passes::default(),
            last_trim: None,
            last_resolved: Vec::new(),
            last_indexes: Default::default(),
            dropped_keys: Vec::new(),
            kept_as_is: false,
            status_record,
        }
    }

    /// Waits until the records handed to their threads (`status.json`, the
    /// accepted interfaces) are written.
    pub fn flush_records(&self) {
        self.accepted_record.flush();
        self.status_record.flush();
    }

    /// Whether a link event for interface `name` may change what a round
    /// does. Not for an interface the CNI plugin made that the last plan
    /// neither programs nor misses: the plugin hands its endpoint over
    /// after making it, and that wakes a round of its own (at 10,000 VMs
    /// a round woken by the link alone was a whole round more on every
    /// pod's ADD). Any other interface may be an uplink, an underlay or a
    /// port a document names.
    pub fn link_matters(&self, name: &str) -> bool {
        if !vmpath_api::cni::is_host_ifname(name) {
            return true;
        }
        let Some(plan) = &self.last_plan else {
            return true;
        };
        plan.ports.values().any(|p| p.ifname == name)
            || plan.missing_ports.iter().any(|(_, port)| port == name)
    }

    /// Forgets what the increments keep: the next round derives and
    /// validates every object, builds who holds what from every claim and
    /// reads back every map (the periodic resync, and what a restarted
    /// agent does).
    pub fn forget_increments(&mut self) {
        self.validated = None;
        self.ipam_memo = None;
        self.overlay = Default::default();
        // Who holds what is built from every claim again (the claims
        // added beside it folded in).
        self.held = None;
        // Every VM interface resolved again from its document.
        drop_later(std::mem::take(&mut self.last_resolved));
        self.last_indexes = Default::default();
    }

    /// The derive and validate stages, for the objects that changed since
    /// the last round: none changed (and neither did what validation
    /// weighs them against), the last validated config; only some VMs'
    /// objects, those VMs' (with the context they are read against), their
    /// output spliced into the last config ([`groups::splice`]); else
    /// every object. Returns the config (shared with the next round's
    /// partial pass) and how many groups changed (`None`: the context, so
    /// everything).
    pub fn derive_and_validate(
        &mut self,
        snap: &Snapshot,
        held: impl Into<Arc<Held>>,
    ) -> (Arc<Config>, Option<usize>) {
        let held: Arc<Held> = held.into();
        let mut phases = crate::sys::phases::Phases::start("derive and validate");
        let node = self.settings.node.clone();
        // Where the last round's refusals were, before the membership
        // reads this snapshot; then the groups this snapshot changed.
        let (attribution, touched, membership) = match &mut self.validated {
            Some(v) => {
                let attribution = groups::Attribution::of(&v.config, &v.membership);
                let mut membership = std::mem::take(&mut v.membership);
                let touched = membership
                    .update(snap)
                    .filter(|_| v.cluster_cidrs == snap.cluster_cidrs);
                (Some(attribution), touched, membership)
            }
            None => (None, None, groups::Membership::of(snap)),
        };
        phases.mark("membership");
        if let Some(v) = &mut self.validated
            && touched.as_ref().is_some_and(BTreeSet::is_empty)
            && (v.accepted.ptr_eq(&self.accepted) || v.accepted == self.accepted)
            && v.held == held
        {
            self.passes.skipped += 1;
            self.kept_as_is = true;
            v.membership = membership;
            return (v.config.clone(), Some(0));
        }
        if let Some(mut v) = self.validated.take()
            && let Some(touched) = &touched
            && let Some(attribution) = &attribution
        {
            let partial_snap = membership.partial(snap, touched);
            phases.mark("partial snapshot");
            let mut derived = derive::derive(&partial_snap, &node);
            // The Nodes' pod CIDRs as the last full pass found them (the
            // partial snapshot leaves the Nodes out, and the context has
            // not changed since): what Primary networks are weighed
            // against.
            derived.cluster_cidrs.clone_from(&v.config.cluster_cidrs);
            phases.mark("partial derive");
            let partial = validate::documents(&partial_snap, derived, &node, &self.accepted, &held);
            phases.mark("partial validate");
            let store = &self.store;
            let stored = |key: &str| store.get(key).ok().flatten();
            let evidence = groups::Evidence {
                held: &held,
                stored: &stored,
            };
            // What the last pass was weighed against goes off the loop's
            // path (the accepted set it kept may be the last one of a
            // cluster's keys).
            drop_later((std::mem::take(&mut v.accepted), std::mem::take(&mut v.held)));
            // The round's own copy (the last round gave its reference up
            // at its end), or a clone when something still shares it.
            let previous = Arc::try_unwrap(v.config).unwrap_or_else(|shared| (*shared).clone());
            match groups::splice(
                previous,
                &mut v.holdings,
                attribution,
                &membership,
                touched,
                partial,
                &evidence,
            ) {
                Ok(config) => {
                    phases.mark("splice");
                    phases.log();
                    tracing::debug!(groups = touched.len(), "derived and validated in part");
                    self.passes.partial += 1;
                    let config = self.keep_validated(snap, config, held, membership, v.holdings);
                    return (config, Some(touched.len()));
                }
                Err(why) => {
                    tracing::debug!(groups = touched.len(), "derived and validated whole: {why}")
                }
            }
        }
        self.passes.full += 1;
        let derived = derive::derive(snap, &node);
        let config = validate::documents(snap, derived, &node, &self.accepted, &held);
        let holdings = groups::Holdings::of(&config, &membership);
        (
            self.keep_validated(snap, config, held, membership, holdings),
            None,
        )
    }

    /// Keeps `config` and what it was validated against for the next
    /// round; returns it with the CNI plugin's kept claims.
    fn keep_validated(
        &mut self,
        snap: &Snapshot,
        config: Config,
        held: Arc<Held>,
        membership: groups::Membership,
        holdings: groups::Holdings,
    ) -> Arc<Config> {
        let mut config = config;
        if config.lineage.version == 0 {
            config.lineage = crate::config::Lineage::fresh();
        }
        let config = Arc::new(config);
        let previous = self.validated.replace(Validated {
            config: config.clone(),
            held,
            accepted: self.accepted.clone(),
            cluster_cidrs: snap.cluster_cidrs.clone(),
            membership,
            holdings,
        });
        if let Some(previous) = previous {
            drop_later(previous);
        }
        config
    }

    /// The VM interfaces whose claims the CNI plugin keeps, with the
    /// file source (`Resolved::kept_claims`). With the Kubernetes source
    /// the objects keep addresses (a VMI's interfaces while it exists, a
    /// pod's IPAMClaim while the pod does): a CNI port kept past its pod
    /// would hold an address the controller released and gave to another
    /// pod. The last set is shared while it is the same.
    fn kept_claims(&mut self, snap: &Snapshot) -> crate::resolve::resolved::KeptClaims {
        if snap.pod_claims {
            return Default::default();
        }
        let now = crate::api::endpoints::kept_claims();
        if *self.kept_claims != now {
            self.kept_claims = Arc::new(now);
        }
        self.kept_claims.clone()
    }

    /// Who holds what ([`validate::held`]), built again only when the
    /// claims store or the running ports changed.
    fn held(&mut self) -> Arc<Held> {
        let generation = self.store.generation();
        match &self.held {
            Some((g, held)) if *g == generation => {
                if held.port_ips == self.running.port_ips
                    && held.port_macs == self.running.port_macs
                {
                    return held.clone();
                }
                // The ports changed, not the claims: the claims' part as
                // it was (shared), the ports' as they are.
                let held = Arc::new(Held {
                    ips: held.ips.clone(),
                    macs: held.macs.clone(),
                    ips_added: held.ips_added.clone(),
                    macs_added: held.macs_added.clone(),
                    port_ips: self.running.port_ips.clone(),
                    port_macs: self.running.port_macs.clone(),
                });
                self.held = Some((generation, held.clone()));
                return held;
            }
            // New claims since (a VM's first address): added beside the
            // claims' part, not built again from every claim (every node
            // keeps every VM's claim: 10,000 at 10,000 VMs).
            Some((g, held)) => {
                if let Some(mut next) = self
                    .store
                    .changes_since(*g)
                    .and_then(|changes| held.with_added(&changes, HELD_ADDED_CAP))
                {
                    next.port_ips.clone_from(&self.running.port_ips);
                    next.port_macs.clone_from(&self.running.port_macs);
                    let held = Arc::new(next);
                    self.held = Some((generation, held.clone()));
                    return held;
                }
            }
            _ => {}
        }
        let Ok(claims) = self.store.shared() else {
            self.held = None;
            return Arc::new(validate::held(None, &self.running));
        };
        let held = Arc::new(validate::held(Some(&claims), &self.running));
        self.held = Some((generation, held.clone()));
        held
    }

    /// The resolve and IPAM stages on `validated`.
    pub fn resolve_and_assign(
        &mut self,
        validated: Arc<Config>,
        kept_claims: crate::resolve::resolved::KeptClaims,
    ) -> anyhow::Result<(crate::resolve::resolved::Resolved, Arc<ipam::Claims>)> {
        let mut phases = crate::sys::phases::Phases::start("resolve and IPAM");
        let last = std::mem::take(&mut self.last_resolved);
        let last_indexes = std::mem::take(&mut self.last_indexes);
        let (mut cfg, carry) =
            resolve::resolve_carrying(validated, &self.settings.node, last, &last_indexes);
        cfg.kept_claims = kept_claims;
        phases.mark("resolve");
        let (claims, incremental) =
            ipam::assign_incremental(&mut cfg, &carry, &self.store, &mut self.ipam_memo)?;
        self.dropped_keys = carry.dropped.iter().map(|a| a.key.clone()).collect();
        // The entries that changed or went, freed off the loop's path.
        drop_later(carry);
        self.passes.ipam_increments += u64::from(incremental);
        phases.mark("ipam");
        phases.log();
        Ok((cfg, claims))
    }

    /// One round: every stage in order; `services` gets the slow path's
    /// answers, `shared` the view. `objects_only`: woken by cluster
    /// objects alone (no link, endpoint, config file, data path finding,
    /// retry or migration tick): when validation keeps the last config as
    /// it is, nothing after it can differ from the last round's, and the
    /// round stops there (`Outcome::Unchanged`).
    pub fn run(
        &mut self,
        dp: &mut Dataplane,
        shared: &SharedView,
        services: &slowpath::Services,
        objects_only: bool,
    ) -> Outcome {
        let s = &self.settings;
        let mut phases = crate::sys::phases::Phases::start("reconcile pass");

        // read
        let mut snap = read::read(
            self.cluster.as_ref(),
            &mut self.reader,
            &s.config_dir,
            &s.state_dir,
            &s.node,
        );
        snap.cluster_cidrs.clone_from(&s.cluster_cidrs);
        phases.mark("read");
        if snap.empty {
            // A ConfigMap not mounted yet must never wipe a running data path.
            if !self.warned_empty {
                match &self.cluster {
                    Some(_) => {
                        warn!("Kubernetes objects not listed yet or none: data path left as it is")
                    }
                    None => {
                        warn!(dir = %s.config_dir.display(), "config dir missing or empty: data path left as it is")
                    }
                }
                self.warned_empty = true;
            }
            return Outcome::Empty;
        }
        self.warned_empty = false;
        // Until this agent programs anything, what the data path holds
        // from the previous one.
        if self.last_plan.is_none() {
            self.running = read::running_ports(dp);
        }

        // derive, validate
        let held = self.held();
        phases.mark("held");
        self.kept_as_is = false;
        let (validated, changed_groups) = self.derive_and_validate(&snap, held);
        tracing::debug!(groups = ?changed_groups, "objects changed (groups; none: the context)");
        phases.mark("validate");
        // Every other input of the stages after validation is the last
        // round's: the ports, the data path's findings and the claims
        // store change only with a wake of their own (or `held`, which
        // the kept config was checked against). At 100,000 VMs the rest
        // of the round is 10 ms, and a new VM's claim made before its VM
        // was one such round between the VM's objects and its port.
        if objects_only && self.kept_as_is && self.last_plan.is_some() {
            self.last_fingerprint = Some(snap.fingerprint);
            drop_later((snap, validated));
            crate::publish::view::count_round_unchanged();
            phases.log();
            crate::api::endpoints::round_done();
            return Outcome::Unchanged;
        }
        let changed = self.last_fingerprint != Some(snap.fingerprint);
        self.last_fingerprint = Some(snap.fingerprint);
        let kept_claims = self.kept_claims(&snap);
        // Its objects live on in the reader's cache; the rest is freed
        // off the loop's path.
        drop_later(snap);

        // resolve, IPAM
        let (mut cfg, mut claims) = match self.resolve_and_assign(validated, kept_claims) {
            Ok(r) => r,
            Err(e) => {
                error!("{e:#}; retrying");
                return Outcome::Retry;
            }
        };
        let s = &self.settings;
        phases.mark("ipam");
        let seen: Vec<ipam::SeenMac> = dp
            .maps()
            .learned_macs
            .iter()
            .filter_map(|r| r.ok())
            .map(|(ifindex, m)| ipam::SeenMac {
                ifindex,
                mac: m.mac,
            })
            .collect();
        let mac_refusals = ipam::adopt_detected_macs(
            &mut cfg,
            &s.node,
            &self.store,
            &mut claims,
            seen,
            ifindex_of,
            &mut self.refused_macs,
        );
        if changed {
            info!(
                networks = cfg.config.networks.len(),
                attachments = cfg.attachments.len(),
                refused = cfg.errors.len(),
                "config read"
            );
        }

        // observe
        let learned_changed = observe::observe(
            dp,
            &mut cfg,
            &s.node,
            &mut self.learned,
            s.learned,
            &mut self.migrations,
        );
        let started = Instant::now();
        phases.mark("learned");

        // plan
        let previous = plan::Previous::of(self.last_plan.as_ref(), dp, &cfg, &s.node);
        phases.mark("previous");
        let plan = plan::plan(&cfg, &s.node, ifindex_of, &previous, &mut self.overlay);
        phases.mark("plan");
        let plan_changed = self.last_plan.as_ref() != Some(&plan);
        phases.mark("compare");

        // apply: a changed plan, or maps to read back and repair (the
        // resync forgot what was written; left to the next change, the
        // repair waited for it and fell on a CNI ADD: 150 ms at 100,000
        // VMs).
        let mut retry = false;
        if plan_changed || dp.read_back_due() {
            match apply::apply(dp, &plan, &cfg, services) {
                Ok(()) => {
                    if let Some(previous) = self.last_plan.replace(plan) {
                        drop_later(previous);
                    }
                }
                Err(e) => {
                    error!("applying the plan failed (will retry): {e:#}");
                    retry = true;
                }
            }
        }
        phases.mark("apply");
        self.features.tick(
            dp,
            &s.uplink,
            &cfg,
            self.last_plan.as_ref(),
            &self.learned.routable,
        );
        phases.mark("routes");

        // publish
        let mut published = None;
        publish::log_refusals(&cfg, &mut self.last_errors);
        if let Some(cluster) = &self.cluster {
            publish::report(cluster, &cfg, &s.node, &mac_refusals);
        }
        phases.mark("report");
        // A view whose entries are not one for one the list this round
        // carried over is built again: the next round's view shares rows
        // by where they were in it.
        let list_moved = !cfg.carried_whole();
        if plan_changed || changed || learned_changed || list_moved {
            // Show what is programmed, not what was attempted.
            // Borrowed, not copied: the plan holds every endpoint.
            let none = Plan::default();
            let applied = self.last_plan.as_ref().unwrap_or(&none);
            let mut view = publish::build_view(s, &cfg, applied, &self.learned, &shared.view());
            if plan_changed {
                view.reconciles += 1;
                view.last_reconcile_seconds = started.elapsed().as_secs_f64();
                shared.observe_reconcile(view.last_reconcile_seconds);
                view.last_reconcile_unix = unix_now();
            }
            view.ready = self.last_plan.is_some();
            phases.mark("view");
            let view = Arc::new(view);
            shared.publish(view.clone());
            published = Some(view);
        }
        // The ADDs waiting on this round are answered from the published
        // view; the status file (megabytes at 10,000 VMs) is written after.
        crate::api::endpoints::round_done();
        if let Some(view) = published {
            self.status_record.submit((s.state_dir.clone(), view));
            phases.mark("status");
        }
        // Built, and recorded, only when it changed (or the last record
        // failed): not copied again every round. It is the set of this
        // round's keys when it is as large and holds each of them; the
        // entries carried over from the last round have its keys (the set
        // was made of them, or found equal to them), so only the changed
        // ones are looked up (at 10,000 VMs a comparison of every key was a
        // tenth of the round a CNI ADD waits for).
        let marks = cfg.carried.as_deref();
        let same = cfg.attachments.len() == self.accepted.len()
            && cfg
                .attachments
                .iter()
                .enumerate()
                .filter(|(j, _)| marks.is_none_or(|m| m[*j] == crate::resolve::resolved::CHANGED))
                .all(|(_, a)| self.accepted.contains(&a.key));
        debug_assert!(
            !same
                || cfg
                    .attachments
                    .iter()
                    .all(|a| self.accepted.contains(&a.key)),
            "a carried VM interface's key not in the last round's accepted set"
        );
        let dropped = std::mem::take(&mut self.dropped_keys);
        if !same {
            // Carried from the list the set was made of (not, say, from
            // nothing after a round that ended early).
            let differs = match cfg.carried_for(self.accepted.len()) {
                // From the last set: less the entries that changed or
                // went, plus the changed ones (at 100,000 VMs the set made
                // again from every key was 20 ms of each round a VM came
                // or went in). A set its writer still holds is copied.
                Some(marks) => {
                    let set = &mut self.accepted;
                    let mut gone: BTreeSet<&AttachmentKey> = dropped
                        .iter()
                        .filter(|k| set.remove(*k).is_some())
                        .collect();
                    let mut differs = false;
                    for (a, _) in cfg
                        .attachments
                        .iter()
                        .zip(marks)
                        .filter(|(_, m)| **m == crate::resolve::resolved::CHANGED)
                    {
                        // A key that left and came back changes nothing.
                        let came_back = gone.remove(&a.key);
                        differs |= set.insert(a.key.clone()).is_none() && !came_back;
                    }
                    differs || !gone.is_empty()
                }
                None => {
                    let accepted: AcceptedKeys =
                        cfg.attachments.iter().map(|a| a.key.clone()).collect();
                    let differs = accepted != self.accepted;
                    self.accepted = accepted;
                    differs
                }
            };
            debug_assert!(
                self.accepted.len() == cfg.attachments.len()
                    && cfg
                        .attachments
                        .iter()
                        .all(|a| self.accepted.contains(&a.key)),
                "the accepted set is this round's keys"
            );
            if differs {
                // Written (and, when that fails, tried again) by its thread.
                self.accepted_record.submit(self.accepted.clone());
            }
        }
        drop_later(dropped);
        if let Some(plan) = &self.last_plan {
            self.running = publish::served_here(&cfg, plan);
        }
        let migrating = cfg.migrating();
        // Carried over into the next round (and what the published view's
        // entries were built from, one for one).
        // With the version of the config it is one for one (none refused
        // after validation): the next round may carry it by lineage.
        self.last_indexes = cfg.indexes();
        self.last_resolved = std::mem::take(&mut cfg.attachments);
        // The validated config is kept (`validated`): this round's
        // reference is given up here, not on the freeing thread, so the
        // next partial pass finds it unshared and changes it in place
        // (a clone of a cluster's config otherwise, when that thread is
        // behind).
        if self
            .validated
            .as_ref()
            .is_some_and(|v| Arc::ptr_eq(&v.config, &cfg.config))
        {
            drop(std::mem::take(&mut cfg.config));
        }
        // A full pass over a cluster's objects frees tens of MiB at once:
        // give glibc's pages back rather than hold them until the next (the
        // agent binary allocates with mimalloc, which gives its own back;
        // `ThenTrim`). A partial pass frees little, and the trim walks
        // glibc's whole heap: then at most every few seconds.
        let trim_due = self
            .last_trim
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(5));
        // Both off the loop's path, the trim after what was handed over
        // before it (the dropping thread frees in order).
        if changed && (changed_groups.is_none() || trim_due) {
            self.last_trim = Some(Instant::now());
            drop_later(crate::sys::drop_later::ThenTrim::new(cfg));
        } else {
            drop_later(cfg);
        }
        phases.mark("publish");
        phases.log();
        Outcome::Done { retry, migrating }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A network with IPAM for the stages' tests.
    pub const BLUE: &str = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec:\n  id: 7\n  subnets: [10.9.0.0/24]\n  defaultGatewayIPs: [10.9.0.1]\n  ipam: {mode: Enabled}\n";

    /// `vm`'s interface eth0 on network blue, on `node`, port `{vm}p`.
    pub fn attachment(vm: &str, node: &str) -> String {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}-eth0, namespace: prod}}\nspec:\n  vm: {vm}\n  interface: eth0\n  network: blue\n  node: {node}\n  port: {vm}p\n"
        )
    }

    #[test]
    fn a_link_the_cni_plugin_made_wakes_no_round_until_a_plan_names_it() {
        let dir = std::env::temp_dir().join(format!("vmpath-link-matters-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let settings = Settings {
            node: "a".into(),
            state_dir: dir.join("state"),
            ..Default::default()
        };
        let mut round = Round::new(settings, None, Store::open(&dir.join("state")).unwrap());
        let programmed = vmpath_api::cni::host_ifname("c1", "eth0");
        let missing = vmpath_api::cni::host_ifname("c2", "eth0");
        let unknown = vmpath_api::cni::host_ifname("c3", "eth0");
        // Before any plan, every link may matter.
        assert!(round.link_matters(&unknown));
        let mut plan = Plan::default();
        plan.ports.insert(
            7,
            crate::plan::PlannedPort {
                ifname: programmed.clone(),
                ifindex: 7,
                attachment: crate::config::AttachmentKey::new(
                    "prod".into(),
                    "vm1".into(),
                    "eth0".into(),
                ),
                info: Default::default(),
                slow_limits: Default::default(),
            },
        );
        plan.missing_ports
            .push((plan.ports[&7].attachment.clone(), missing.clone()));
        round.last_plan = Some(plan);
        for (name, matters) in [
            (programmed.as_str(), true),
            (missing.as_str(), true),
            (unknown.as_str(), false),
            // Not the plugin's: an uplink, an underlay, a document's port.
            ("eth5", true),
            ("vmp-vxlan", true),
            ("vm-db1b", true),
        ] {
            assert_eq!(round.link_matters(name), matters, "{name}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A partial pass leaves the Nodes out but weighs a VM's network
    /// against their pod CIDRs as the full pass did: a Primary network
    /// overlapping a v1 Node's `spec.podCIDRs` is refused, and so is a VM
    /// interface on it when only that VM's document changed.
    #[test]
    fn a_partial_pass_weighs_networks_against_the_nodes_it_leaves_out() {
        let dir = std::env::temp_dir().join(format!("vmpath-partial-nodes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = dir.join("config");
        std::fs::create_dir_all(&config).unwrap();
        let wide = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: wide}\nspec:\n  id: 8\n  role: Primary\n  subnets: [10.244.0.0/16]\n  ipam: {mode: Disabled}\n";
        let node_b = "apiVersion: v1\nkind: Node\nmetadata: {name: b}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus:\n  addresses:\n  - {type: InternalIP, address: 192.0.2.2}\n";
        std::fs::write(
            config.join("context.yaml"),
            format!("{BLUE}---\n{wide}---\n{node_b}"),
        )
        .unwrap();
        let on_wide = |label: &str| {
            format!(
                "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm1-eth0, namespace: prod, labels: {{app: {label}}}}}\nspec:\n  vm: vm1\n  interface: eth0\n  network: wide\n  node: a\n  port: vm1p\n  ips: [10.244.7.5/16]\n"
            )
        };
        std::fs::write(config.join("vm1.yaml"), on_wide("one")).unwrap();
        std::fs::write(config.join("vm2.yaml"), attachment("vm2", "a")).unwrap();
        let mut round = round_in(&dir, "a");
        let mut reader = Reader::default();
        let first = reader.read(&config);
        let (cfg, _) = round.derive_and_validate(&first, Held::default());
        assert!(
            cfg.errors.iter().any(|e| e.message.contains("overlaps")),
            "{:?}",
            cfg.errors
        );
        assert!(cfg.attachments.iter().all(|a| a.key.vm != "vm1"));
        assert_eq!(round.passes.full, 1);
        // vm1's document alone changes.
        std::fs::write(config.join("vm1.yaml"), on_wide("two")).unwrap();
        let second = reader.read(&config);
        let (cfg, _) = round.derive_and_validate(&second, Held::default());
        assert_eq!(round.passes.partial, 1, "{:?}", round.passes);
        assert!(
            cfg.attachments.iter().all(|a| a.key.vm != "vm1"),
            "vm1 accepted on a refused network"
        );
        let full = validate(&second, "a", &crate::config::AcceptedKeys::new());
        let keys = |c: &Config| {
            c.attachments
                .iter()
                .map(|a| a.key.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(&cfg), keys(&full));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The accepted set outlives the rounds: a full pass's VM interfaces
    /// take its copy of their keys, not a second one each.
    #[test]
    fn a_full_pass_shares_the_accepted_sets_copy_of_each_key() {
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm1", "a"),
            attachment("vm2", "b")
        ));
        let first = validate(&snap, "a", &crate::config::AcceptedKeys::new());
        let accepted: crate::config::AcceptedKeys =
            first.attachments.iter().map(|a| a.key.clone()).collect();
        let again = validate(&snap, "a", &accepted);
        assert_eq!(again.attachments.len(), 2);
        for a in &again.attachments {
            let kept = accepted.get(&a.key).expect("accepted before");
            assert!(a.key.same_copy(kept), "{:?}: a second copy", a.key);
        }
        // Its source is kept as parts, and reads as a refusal would name it.
        assert_eq!(
            again.attachments[0].source.document(),
            "Attachment prod/vm1-eth0"
        );
        assert_eq!(again.networks[0].source.document(), "Network blue");
        let fresh = validate(&snap, "a", &crate::config::AcceptedKeys::new());
        assert!(
            !fresh.attachments[0]
                .key
                .same_copy(&first.attachments[0].key),
            "a pass with nothing accepted makes its own"
        );
    }

    /// A round for `node` reading `dir/config`, its state in `dir/state`.
    pub fn round_in(dir: &std::path::Path, node: &str) -> Round {
        let settings = Settings {
            node: node.into(),
            config_dir: dir.join("config"),
            state_dir: dir.join("state"),
            ..Default::default()
        };
        Round::new(settings, None, Store::open(&dir.join("state")).unwrap())
    }

    /// What the read stage would give for a config dir holding `yaml`.
    pub fn snapshot_of(yaml: &str) -> Snapshot {
        let dir = std::env::temp_dir().join(format!(
            "vmpath-round-{}-{:x}",
            std::process::id(),
            crate::sys::hash::fnv1a(&[yaml.as_bytes()])
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), yaml).unwrap();
        let snap = crate::config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        snap
    }
}
