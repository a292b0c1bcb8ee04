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
use serde::Serialize;
use tracing::{error, info, warn};

use crate::{
    config::{self, AttachmentKey, ConfigError},
    dataplane::Dataplane,
    plan::{self, Plan},
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

/// What the agent last applied, for `vmpath status` and tests.
#[derive(Debug, Serialize)]
pub struct Status<'a> {
    pub node: &'a str,
    pub config_errors: &'a [ConfigError],
    pub networks: Vec<&'a str>,
    pub attachments: Vec<String>,
    pub ports: Vec<(String, u32, String)>,
    pub missing_ports: Vec<(String, String)>,
    pub problems: &'a [String],
}

fn write_status(dir: &Path, status: &Status) -> Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(".status.json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(status)?)?;
    fs::rename(&tmp, dir.join("status.json"))?;
    Ok(())
}

pub fn run(opts: &AgentOptions) -> Result<()> {
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
            let status = Status {
                node: &opts.node,
                config_errors: &cfg.errors,
                networks: cfg.networks.iter().map(|n| n.name.as_str()).collect(),
                attachments: cfg.attachments.iter().map(|a| a.key.to_string()).collect(),
                ports: plan
                    .ports
                    .values()
                    .map(|p| (p.ifname.clone(), p.ifindex, p.attachment.to_string()))
                    .collect(),
                missing_ports: plan
                    .missing_ports
                    .iter()
                    .map(|(k, p)| (k.to_string(), p.clone()))
                    .collect(),
                problems: &plan.problems,
            };
            if let Err(e) = write_status(&opts.state_dir, &status) {
                warn!("writing status: {e:#}");
            }
        }
        accepted = cfg.attachments.iter().map(|a| a.key.clone()).collect();
        std::thread::sleep(opts.interval);
    }
}
