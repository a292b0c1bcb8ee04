//! The reconcile loop: read the config dir, validate, plan for this node,
//! apply to the data path; again whenever the config or the node's
//! interfaces change.

use std::{
    collections::BTreeSet,
    ffi::CString,
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result};
use tracing::{error, info, warn};

use crate::{
    config::{self, AttachmentKey, Config, format_mac},
    dataplane::Dataplane,
    plan::{self, Plan},
    view::{AttachmentView, IpView, NetworkView, Origin, SharedView, View, unix_now},
};

#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub config_dir: PathBuf,
    pub node: String,
    pub bpffs: PathBuf,
    pub state_dir: PathBuf,
    pub interval: Duration,
}

pub fn ifindex_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => None,
        i => Some(i),
    }
}

fn write_status(dir: &Path, view: &View) -> Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(".status.json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(view)?)?;
    fs::rename(&tmp, dir.join("status.json"))?;
    Ok(())
}

/// Builds what readers see from the validated config and the applied plan.
fn build_view(opts: &AgentOptions, cfg: &Config, plan: &Plan, prev: &View) -> View {
    let networks = cfg
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
            attachments: cfg
                .attachments
                .iter()
                .filter(|a| a.network == n.name)
                .count(),
        })
        .collect();
    let attachments = cfg
        .attachments
        .iter()
        .map(|a| {
            let ifindex = plan
                .ports
                .values()
                .find(|p| p.attachment == a.key)
                .map(|p| p.ifindex);
            let (migration, target) = match &a.migration {
                None => ("none".to_string(), None),
                Some(m) if m.ready => ("cut-over".to_string(), Some(m.target_node.clone())),
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
                mac: a.mac.as_ref().map(format_mac),
                mac_origin: a.mac.map(|_| Origin::Given),
                ips: a
                    .ips
                    .iter()
                    .map(|ip| IpView {
                        address: ip.to_string(),
                        origin: Origin::Given,
                    })
                    .collect(),
                migration,
                migration_target: target,
            }
        })
        .collect();
    View {
        node: opts.node.clone(),
        bpffs: opts.bpffs.display().to_string(),
        config_dir: opts.config_dir.display().to_string(),
        config_errors: cfg.errors.clone(),
        networks,
        attachments,
        missing_ports: plan
            .missing_ports
            .iter()
            .map(|(k, p)| format!("{k} (port {p})"))
            .collect(),
        problems: plan.problems.clone(),
        reconciles: prev.reconciles,
        last_reconcile_seconds: prev.last_reconcile_seconds,
        last_reconcile_unix: prev.last_reconcile_unix,
        ready: prev.ready,
    }
}

pub fn run(opts: &AgentOptions, shared: SharedView) -> Result<()> {
    let mut dp = Dataplane::open(&opts.bpffs).context("opening the data path")?;
    info!(node = %opts.node, bpffs = %opts.bpffs.display(), config = %opts.config_dir.display(), "agent started");
    let mut last_fingerprint = None;
    let mut last_plan: Option<Plan> = None;
    let mut accepted: BTreeSet<AttachmentKey> = BTreeSet::new();
    let mut warned_empty = false;
    loop {
        let snap = config::source::read_dir(&opts.config_dir);
        if snap.empty {
            // A ConfigMap not mounted yet must never wipe a running data path.
            if !warned_empty {
                warn!(dir = %opts.config_dir.display(), "config dir missing or empty: data path left as it is");
                warned_empty = true;
            }
            std::thread::sleep(opts.interval);
            continue;
        }
        warned_empty = false;
        let cfg = config::validate(&snap, &opts.node, &accepted);
        let changed = last_fingerprint != Some(snap.fingerprint);
        if changed {
            for e in &cfg.errors {
                error!(file = %e.file.display(), document = %e.document, field = %e.field, "refused: {e}");
            }
            info!(
                networks = cfg.networks.len(),
                attachments = cfg.attachments.len(),
                refused = cfg.errors.len(),
                "config read"
            );
            last_fingerprint = Some(snap.fingerprint);
        }
        let started = std::time::Instant::now();
        let plan = plan::plan(&cfg, &opts.node, ifindex_of);
        let plan_changed = last_plan.as_ref() != Some(&plan);
        if plan_changed {
            match dp.apply(&plan) {
                Ok(()) => {
                    for (key, port) in &plan.missing_ports {
                        info!(vm = %key, port = %port, "port not present yet");
                    }
                    info!(ports = plan.ports.len(), "data path programmed");
                    last_plan = Some(plan.clone());
                }
                Err(e) => error!("applying the plan failed (will retry): {e:#}"),
            }
        }
        if plan_changed || changed {
            let mut view = build_view(opts, &cfg, &plan, &shared.read().unwrap());
            if plan_changed {
                view.reconciles += 1;
                view.last_reconcile_seconds = started.elapsed().as_secs_f64();
                view.last_reconcile_unix = unix_now();
            }
            view.ready = last_plan.is_some();
            if let Err(e) = write_status(&opts.state_dir, &view) {
                warn!("writing status: {e:#}");
            }
            *shared.write().unwrap() = view;
        }
        accepted = cfg.attachments.iter().map(|a| a.key.clone()).collect();
        std::thread::sleep(opts.interval);
    }
}
