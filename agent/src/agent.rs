//! The reconcile loop: read the config dir, validate, plan for this node,
//! apply to the data path; again whenever the config or the node's
//! interfaces change.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tracing::{error, info, warn};

use crate::{
    clock::unix_now,
    config::{self, AttachmentKey, format_mac},
    dataplane::Dataplane,
    ipam,
    netif::ifindex_of,
    plan::{self, Plan},
    resolved::{self, Origin, Resolved},
    slowpath,
    store::{Claim, Store},
    view::{AttachmentView, IpView, NetworkView, Published, SharedView, View},
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
    pub uplink_xdp: crate::dataplane::UplinkXdp,
    /// Slow-path frames served per second, all ports together.
    pub slowpath_serve_rate: u64,
    /// Expiry and per-port cap of learned addresses.
    pub learned: crate::learned::Limits,
    /// The data path's debug events at start.
    pub datapath_debug: crate::dataplane::debug_log::Switches,
    /// Where the documents come from.
    pub source: Source,
    /// Sizes of the cluster-sized maps (`--max-endpoints`, `--max-addresses`).
    pub map_sizes: crate::dataplane::MapSizes,
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
        ledger: crate::cluster::kube_source::LedgerRef,
    },
}

fn write_status(dir: &Path, view: &View) -> Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(".status.json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(view)?)?;
    fs::rename(&tmp, dir.join("status.json"))?;
    Ok(())
}

/// Given or claimed addresses, then the ones seen in the VM's traffic.
fn view_ips(
    a: &resolved::Attachment,
    cfg: &Resolved,
    ifindex: Option<u32>,
    learned: &crate::learned::Outcome,
) -> Vec<IpView> {
    let mut ips: Vec<IpView> = a
        .addresses
        .iter()
        .map(|(ip, origin)| IpView {
            address: ip.to_string(),
            origin: *origin,
        })
        .collect();
    let (Some(ifindex), Some(net)) = (ifindex, cfg.network(&a.network)) else {
        return ips;
    };
    for (key, seen) in learned.shown() {
        if key.network != net.id || seen.ifindex != ifindex {
            continue;
        }
        let ip = key.ip();
        if !a.addresses.iter().any(|(given, _)| given.addr() == ip) {
            ips.push(IpView {
                address: ip.to_string(),
                origin: Origin::Learned,
            });
        }
    }
    ips
}

/// Builds what readers see from the resolved config and the applied plan.
fn build_view(
    opts: &AgentOptions,
    cfg: &Resolved,
    plan: &Plan,
    learned: &crate::learned::Outcome,
    prev: &View,
) -> View {
    // Indexes, so the view stays linear in the number of attachments.
    let mut per_network: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for a in &cfg.attachments {
        *per_network.entry(a.network.as_str()).or_default() += 1;
    }
    let active_port: std::collections::HashMap<&AttachmentKey, u32> = plan
        .ports
        .values()
        .filter(|p| !p.pending())
        .map(|p| (&p.attachment, p.ifindex))
        .collect();
    let pending_port: std::collections::HashMap<&AttachmentKey, (&str, u32)> = plan
        .ports
        .values()
        .filter(|p| p.pending())
        .map(|p| (&p.attachment, (p.ifname.as_str(), p.ifindex)))
        .collect();
    let networks = cfg
        .config
        .networks
        .iter()
        .map(|n| NetworkView {
            name: n.name.clone(),
            id: n.id,
            role: format!("{:?}", n.role),
            subnets: n.subnets.iter().map(|s| s.to_string()).collect(),
            exclude_subnets: n.exclude_subnets.iter().map(|s| s.to_string()).collect(),
            gateway_ips: n.gateway_ips.iter().map(|s| s.to_string()).collect(),
            gateway_mac: format_mac(&n.gateway_mac),
            ipam: n.ipam,
            mac_filter: n.mac_filter,
            ip_filter: n.ip_filter,
            egress: format!("{:?}", n.egress),
            mtu: n.mtu,
            attachments: per_network.get(n.name.as_str()).copied().unwrap_or(0),
            dns_servers: n.dhcp.dns_servers.iter().map(|s| s.to_string()).collect(),
            search_domains: n.dhcp.search_domains.clone(),
        })
        .collect();
    let attachments = cfg
        .attachments
        .iter()
        .map(|a| {
            // A pending migration target's port is not where the VM runs yet.
            let ifindex = active_port.get(&a.key).copied();
            let (migration, target) = match &a.migration {
                None => ("none".to_string(), None),
                Some(m) if a.cut_over => ("cut-over".to_string(), Some(m.target_node.clone())),
                Some(m) => ("pending".to_string(), Some(m.target_node.clone())),
            };
            AttachmentView {
                name: a.name.clone(),
                namespace: a.key.namespace.clone(),
                vm: a.key.vm.clone(),
                interface: a.key.interface.clone(),
                network: a.network.clone(),
                node: a.active_node().to_string(),
                port: a.active_port().to_string(),
                ifindex,
                mac: a.mac_resolved.map(|(m, _)| format_mac(&m)),
                mac_origin: a.mac_resolved.map(|(_, o)| o),
                ips: view_ips(a, cfg, ifindex, learned),
                learned_refused: ifindex
                    .and_then(|i| learned.refused.get(&i))
                    .map(|r| {
                        r.iter()
                            .map(|r| crate::view::LearnedRefusalView {
                                address: r.ip.to_string(),
                                kind: r.kind.to_string(),
                                reason: r.reason.clone(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                learned_contested: ifindex
                    .and_then(|i| learned.contested.get(&i))
                    .map(|c| {
                        c.iter()
                            .map(|(ip, by)| crate::view::LearnedRefusalView {
                                address: ip.to_string(),
                                kind: "contested".into(),
                                reason: format!("kept here; also used by {by} (refused there)"),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                migration,
                migration_target: target,
                pending_port: pending_port
                    .get(&a.key)
                    .map(|(name, ifindex)| (name.to_string(), *ifindex)),
            }
        })
        .collect();
    View {
        node: opts.node.clone(),
        bpffs: opts.bpffs.display().to_string(),
        config_dir: opts.config_dir.display().to_string(),
        config_errors: cfg.errors.clone(),
        config_warnings: cfg.config.warnings.clone(),
        networks,
        attachments,
        missing_ports: plan
            .missing_ports
            .iter()
            .map(|(k, p)| format!("{k} (port {p})"))
            .collect(),
        problems: plan.problems.clone(),
        policies: plan.policy.policies.clone(),
        reconciles: prev.reconciles,
        last_reconcile_seconds: prev.last_reconcile_seconds,
        last_reconcile_unix: prev.last_reconcile_unix,
        ready: prev.ready,
    }
}

/// What this round serves on this node's ports: each port's MAC and its
/// given or claimed addresses, by network id and port name (as
/// [`running_ports`] reads them after a restart).
fn served_here(cfg: &Resolved, plan: &Plan) -> config::Held {
    let programmed: BTreeSet<&AttachmentKey> = plan.ports.values().map(|p| &p.attachment).collect();
    let mut held = config::Held::default();
    for a in cfg
        .attachments
        .iter()
        .filter(|a| programmed.contains(&a.key))
    {
        let Some(net) = cfg.network(&a.network) else {
            continue;
        };
        let port = a.active_port().to_string();
        if let Some((mac, _)) = a.mac_resolved {
            held.port_macs.insert((net.id, mac), port.clone());
        }
        for (ip, _) in &a.addresses {
            held.port_ips.insert((net.id, ip.addr()), port.clone());
        }
    }
    held
}

/// What the data path serves on this node's ports now: each port's MAC
/// and its given or claimed addresses (learned ones are the learned
/// stage's), by network id and port name.
fn running_ports(dp: &Dataplane) -> config::Held {
    let mut held = config::Held::default();
    let mut names: BTreeMap<u32, Option<String>> = BTreeMap::new();
    let mut name_of = |ifindex: u32| {
        names
            .entry(ifindex)
            .or_insert_with(|| crate::netif::name_of(ifindex))
            .clone()
    };
    for (ifindex, info) in dp.maps().ports.iter().filter_map(|r| r.ok()) {
        if let Some(name) = name_of(ifindex) {
            held.port_macs.insert((info.network, info.mac), name);
        }
    }
    for (key, info) in dp.maps().addresses.iter().filter_map(|r| r.ok()) {
        if info.ifindex == 0 || info.origin == vmpath_common::ADDR_LEARNED {
            continue;
        }
        if let Some(name) = name_of(info.ifindex) {
            held.port_ips.insert((key.network, key.ip()), name);
        }
    }
    held
}

/// Writes claim changes and mirrors them into `claims`.
fn commit_claims(
    store: &Store,
    claims: &mut BTreeMap<String, Claim>,
    changes: ipam::ClaimChanges,
) -> Result<()> {
    store.apply(&changes)?;
    for (key, change) in changes {
        match change {
            Some(c) => {
                info!(vm = %key, network = %c.network, ips = ?c.ips.iter().map(|i| i.to_string()).collect::<Vec<_>>(), mac = ?c.mac, "claim recorded");
                claims.insert(key, c);
            }
            None => {
                info!(vm = %key, "claim released");
                claims.remove(&key);
            }
        }
    }
    Ok(())
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
    if let Err(e) = crate::dataplane::debug_log::set(&opts.bpffs, opts.datapath_debug) {
        warn!("setting the data path's debug events: {e:#}");
    }
    shared.dataplane_opened();
    crate::node_lock::record_programs(&opts.state_dir, dp.program_ids());
    if let Some(policy) = crate::port_eligibility::policy() {
        crate::port_eligibility::repair(&crate::dataplane::links_dir(&opts.bpffs), policy);
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
    let mut last_fingerprint = None;
    let mut last_plan: Option<Plan> = None;
    let mut running = config::Held::default();
    let mut warned_empty = false;
    let store = Store::open(&opts.state_dir).context("opening the claims store")?;
    // What the previous agent's last round accepted: after a restart it
    // still wins a conflict no claim or port here decides (an IPAM-less
    // address or a given MAC of a VM on another node), not file order.
    let mut stored_accepted = store.accepted().unwrap_or_else(|e| {
        warn!("reading the accepted VM interfaces: {e}; document order decides this round");
        BTreeSet::new()
    });
    let mut accepted: BTreeSet<AttachmentKey> = stored_accepted
        .iter()
        .map(|(namespace, vm, interface)| AttachmentKey {
            namespace: namespace.clone(),
            vm: vm.clone(),
            interface: interface.clone(),
        })
        .collect();
    let mut last_errors: Vec<config::ConfigError> = Vec::new();
    let mut learned = crate::learned::Outcome::default();
    let mut refused_macs: BTreeSet<(AttachmentKey, [u8; 6])> = BTreeSet::new();
    let mut north_south = crate::routes::NorthSouth::default();
    let mut overlay = crate::overlay::Overlay::default();
    let mut migrations = crate::migration::Migrations::default();
    let mut reader = config::source::Reader::default();
    let mut pacer = Pacer::new(opts);
    shared.set_waker(pacer.events.sender());
    let cluster = match &opts.source {
        Source::Files => None,
        Source::Kubernetes { kubeconfig, ledger } => Some(
            crate::cluster::kube_source::KubeSource::start(
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
        crate::forwarding::report_to(Box::new(move |problems| {
            node.report(crate::cluster::writeback::REASON_FORWARDING_OFF, problems)
        }));
    }
    let mut first = true;
    loop {
        if !first {
            pacer.wait(&dp, &shared);
        }
        first = false;
        shared.heartbeat();
        let mut phases = crate::phases::Phases::start("reconcile pass");
        let mut snap = match &cluster {
            Some(cluster) => cluster.read(),
            None => reader.read(&opts.config_dir),
        };
        crate::endpoints::add_documents(&opts.state_dir, &opts.node, &mut snap);
        snap.cluster_cidrs.clone_from(&opts.cluster_cidrs);
        phases.mark("read");
        if snap.empty {
            // A ConfigMap not mounted yet must never wipe a running data path.
            if !warned_empty {
                match &cluster {
                    Some(_) => {
                        warn!("Kubernetes objects not listed yet or none: data path left as it is")
                    }
                    None => {
                        warn!(dir = %opts.config_dir.display(), "config dir missing or empty: data path left as it is")
                    }
                }
                warned_empty = true;
            }
            pacer.passed(&dp);
            continue;
        }
        warned_empty = false;
        // Who holds which address and MAC (the claims store), so that
        // after a restart document order does not decide it.
        let mut held = store
            .all()
            .map(|c| config::Held::from_claims(&c))
            .unwrap_or_default();
        // Then the ports served here (an IPAM-less address, a given MAC:
        // no claim records them): until this agent programs anything,
        // what the data path holds from the previous one.
        if last_plan.is_none() {
            running = running_ports(&dp);
        }
        held.port_ips.clone_from(&running.port_ips);
        held.port_macs.clone_from(&running.port_macs);
        let mut validated = crate::round::validate_held(&snap, &opts.node, &accepted, &held);
        // With the Kubernetes source the objects keep addresses (a VMI's
        // interfaces while it exists, a pod's IPAMClaim while the pod
        // does): a CNI port kept past its pod would hold an address the
        // controller released and gave to another pod.
        if !snap.pod_claims {
            crate::endpoints::keep_claims(&mut validated);
        }
        phases.mark("validate");
        let changed = last_fingerprint != Some(snap.fingerprint);
        last_fingerprint = Some(snap.fingerprint);

        // Addresses and MACs: claims from the store, allocated, released.
        let mut claims = match store.all() {
            Ok(c) => c,
            Err(e) => {
                error!("reading claims: {e}; retrying");
                pacer.retry_soon();
                continue;
            }
        };
        // The enrichment stage: the validated config is only read from here.
        let mut cfg = Resolved::new(validated);
        // Before IPAM: nothing is claimed for a port that is no VM port.
        if let Some(policy) = crate::port_eligibility::policy() {
            crate::port_eligibility::refuse_ineligible(&mut cfg, &opts.node, policy);
        }
        let changes = ipam::assign(&mut cfg, &claims);
        if let Err(e) = commit_claims(&store, &mut claims, changes) {
            error!("writing claims: {e}; retrying");
            pacer.retry_soon();
            continue;
        }
        phases.mark("ipam");
        // MACs the data path saw on ports whose MAC was not given; one that
        // belongs to another VM on the network is refused (said on the
        // VM's VMI or pod as an Event), and nothing else changes.
        let mut mac_refusals: Vec<crate::config::ConfigError> = Vec::new();
        for (ifindex, learned) in dp.maps().learned_macs.iter().filter_map(|r| r.ok()) {
            let Some(a) = cfg.attachments.iter().find(|a| {
                a.active_node() == opts.node
                    && a.mac_resolved.is_none()
                    && ifindex_of(a.active_port()) == Some(ifindex)
            }) else {
                continue;
            };
            let key = a.key.clone();
            match ipam::detected_mac(&cfg, &claims, &key, learned.mac) {
                Ok(changes) if !changes.is_empty() => {
                    info!(vm = %key, mac = %format_mac(&learned.mac), "MAC detected from the VM's traffic");
                    if let Err(e) = commit_claims(&store, &mut claims, changes) {
                        error!("writing claims: {e}");
                        continue;
                    }
                    if let Some(a) = cfg.attachment_mut(&key) {
                        a.mac_resolved = Some((learned.mac, Origin::Detected));
                    }
                }
                Ok(_) => {}
                Err(msg) => {
                    mac_refusals.push(crate::config::ConfigError {
                        file: a.source.file.clone(),
                        document: a.source.document.clone(),
                        field: "detected MAC".into(),
                        message: msg.clone(),
                    });
                    if !refused_macs.contains(&(key.clone(), learned.mac)) {
                        error!(vm = %key, "{msg}");
                        refused_macs.insert((key.clone(), learned.mac));
                    }
                }
            }
        }

        if cfg.errors != last_errors {
            for e in cfg.errors.iter().filter(|e| !last_errors.contains(e)) {
                error!(file = %e.file.display(), document = %e.document, field = %e.field, "refused: {e}");
            }
            last_errors = cfg.errors.clone();
        }
        if let Some(cluster) = &cluster {
            // MACs seen in the traffic of this node's VMs, for their VMIs.
            let mut macs = crate::cluster::writeback::DetectedMacs::new();
            for a in cfg.attachments.iter().filter(|a| {
                a.active_node() == opts.node
                    && a.source
                        .document
                        .contains("(derived from VirtualMachineInstance ")
            }) {
                if let Some((mac, Origin::Detected)) = a.mac_resolved {
                    macs.entry((a.key.namespace.clone(), a.key.vm.clone()))
                        .or_default()
                        .insert(a.key.interface.clone(), format_mac(&mac));
                }
            }
            let refusals: Vec<crate::config::ConfigError> =
                cfg.errors.iter().chain(&mac_refusals).cloned().collect();
            cluster.report(&refusals, &cfg.config.warnings, macs);
        }
        if changed {
            info!(
                networks = cfg.config.networks.len(),
                attachments = cfg.attachments.len(),
                refused = cfg.errors.len(),
                "config read"
            );
        }
        // Addresses the guests used: only what the learned stage accepts
        // is routed, exported or shown.
        let learned_now = crate::learned::read(&mut dp, &cfg, &opts.node, &learned, opts.learned);
        let learned_changed = learned_now != learned;
        learned = learned_now;
        cfg.learned_ips = learned.routable.clone();
        // Live migrations the data path already cut over on this node.
        migrations.tick(&mut cfg, &opts.node, &mut dp);
        let started = std::time::Instant::now();
        // Port ids stay with their VM interface: from the last applied
        // plan, or after a restart from the ports the data path holds.
        let previous_ids: BTreeMap<AttachmentKey, u32> = match &last_plan {
            Some(p) => p
                .ports
                .values()
                .map(|pp| (pp.attachment.clone(), pp.info.port_id))
                .collect(),
            None => {
                let pinned: BTreeMap<u32, u32> = dp
                    .maps()
                    .ports
                    .iter()
                    .filter_map(|r| r.ok())
                    .map(|(i, info)| (i, info.port_id))
                    .collect();
                cfg.attachments
                    .iter()
                    .filter(|a| a.active_node() == opts.node)
                    .filter_map(|a| {
                        ifindex_of(a.active_port())
                            .and_then(|i| pinned.get(&i))
                            .map(|id| (a.key.clone(), *id))
                    })
                    .collect()
            }
        };
        phases.mark("learned");
        // Service ports keep their place and id the same way.
        let previous_services: BTreeMap<vmpath_common::ServiceKey, u32> = match &last_plan {
            Some(p) => p
                .services
                .services
                .iter()
                .map(|(k, s)| (*k, s.id))
                .collect(),
            None => dp
                .maps()
                .services
                .iter()
                .filter_map(|r| r.ok())
                .map(|(k, s)| (k, s.id))
                .collect(),
        };
        let plan = plan::plan_with_previous(
            &cfg,
            &opts.node,
            ifindex_of,
            &previous_ids,
            &previous_services,
        );
        let plan_changed = last_plan.as_ref() != Some(&plan);
        phases.mark("plan");
        if plan_changed {
            match dp.apply(&plan) {
                Ok(()) => {
                    for (key, port) in &plan.missing_ports {
                        info!(vm = %key, port = %port, "port not present yet");
                    }
                    info!(ports = plan.ports.len(), "data path programmed");
                    *services.write().unwrap() = slowpath::service::build(&cfg, &plan);
                    last_plan = Some(plan.clone());
                }
                Err(e) => {
                    error!("applying the plan failed (will retry): {e:#}");
                    pacer.retry_soon();
                }
            }
        }
        phases.mark("apply");
        overlay.tick(&mut dp, &cfg, last_plan.as_ref());
        north_south.tick(
            &mut dp,
            &opts.uplink,
            &cfg,
            last_plan.as_ref(),
            &learned.routable,
        );
        phases.mark("routes");
        if plan_changed || changed || learned_changed {
            // Show what is programmed, not what was attempted.
            let applied = last_plan.clone().unwrap_or_default();
            let mut view = build_view(opts, &cfg, &applied, &learned, &shared.view());
            if plan_changed {
                view.reconciles += 1;
                view.last_reconcile_seconds = started.elapsed().as_secs_f64();
                shared.observe_reconcile(view.last_reconcile_seconds);
                view.last_reconcile_unix = unix_now();
            }
            view.ready = last_plan.is_some();
            if let Err(e) = write_status(&opts.state_dir, &view) {
                warn!("writing status: {e:#}");
            }
            shared.publish(view);
        }
        crate::endpoints::round_done();
        accepted = cfg.attachments.iter().map(|a| a.key.clone()).collect();
        let keys: BTreeSet<crate::store::InterfaceKey> = accepted
            .iter()
            .map(|k| (k.namespace.clone(), k.vm.clone(), k.interface.clone()))
            .collect();
        if keys != stored_accepted {
            match store.set_accepted(&keys) {
                Ok(()) => stored_accepted = keys,
                Err(e) => warn!("recording the accepted VM interfaces: {e}"),
            }
        }
        if let Some(plan) = &last_plan {
            running = served_here(&cfg, plan);
        }
        // Until a migration is over, the data path's side of it is
        // followed on every tick.
        pacer.migrating = cfg.attachments.iter().any(|a| a.migration.is_some());
        if changed {
            // A round over a cluster's objects frees tens of MiB at once:
            // give the pages back rather than hold them until the next.
            drop(cfg);
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            // SAFETY: malloc_trim only returns free pages to the kernel.
            unsafe {
                libc::malloc_trim(0);
            }
        }
        phases.mark("publish");
        phases.log();
        pacer.passed(&dp);
    }
}

/// Decides when the loop runs a reconcile pass: at once on a config or
/// link event, on a data-path tick that found something new (or while a
/// migration is under way), on a retry after an error, and at the latest
/// every resync interval.
struct Pacer {
    events: crate::events::Events,
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
            crate::events::Events::start(&opts.config_dir)
        } else {
            crate::events::Events::none()
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

    /// Called after every pass.
    fn passed(&mut self, dp: &Dataplane) {
        self.last_pass = Instant::now();
        self.data_path = data_path_fingerprint(dp);
    }

    fn retry_soon(&mut self) {
        self.retry = true;
    }

    /// Blocks until the next pass is due.
    fn wait(&mut self, dp: &Dataplane, shared: &Published) {
        if std::mem::take(&mut self.retry) {
            std::thread::sleep(self.interval);
            return;
        }
        loop {
            let due = self.last_pass + self.resync;
            let now = Instant::now();
            if now >= due {
                return;
            }
            let wakes = self.events.wait(self.interval.min(due - now));
            if !wakes.is_empty() {
                tracing::debug!(?wakes, "woken");
                return;
            }
            shared.heartbeat();
            if self.migrating || data_path_fingerprint(dp) != self.data_path {
                return;
            }
        }
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
    crate::hash::fnv1a(&[&bytes])
}
