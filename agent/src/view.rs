//! What the agent knows right now, as the API, the CLI, metrics and the
//! status file show it. The reconcile loop publishes a new [`View`] after
//! each round; readers take a clone under a short read lock.

use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

use crate::{config::ConfigError, resolved::Origin};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpView {
    /// With prefix length, e.g. `10.20.0.5/16`.
    pub address: String,
    pub origin: Origin,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentView {
    pub name: String,
    pub namespace: String,
    pub vm: String,
    pub interface: String,
    pub network: String,
    /// The node the VM runs on now.
    pub node: String,
    pub port: String,
    /// Set when the port exists on this node and is programmed.
    pub ifindex: Option<u32>,
    pub mac: Option<String>,
    pub mac_origin: Option<Origin>,
    pub ips: Vec<IpView>,
    /// `none`, `pending` (target known, not ready) or `cut-over`.
    pub migration: String,
    pub migration_target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkView {
    pub name: String,
    pub id: u32,
    pub role: String,
    pub subnets: Vec<String>,
    pub exclude_subnets: Vec<String>,
    pub gateway_ips: Vec<String>,
    pub gateway_mac: String,
    pub ipam: bool,
    pub mac_filter: bool,
    pub ip_filter: bool,
    pub egress: String,
    pub mtu: u16,
    /// Attachments on this network (any node).
    pub attachments: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct View {
    pub node: String,
    pub bpffs: String,
    pub config_dir: String,
    pub config_errors: Vec<ConfigError>,
    /// Accepted documents the operator should look at.
    #[serde(default)]
    pub config_warnings: Vec<ConfigError>,
    pub networks: Vec<NetworkView>,
    pub attachments: Vec<AttachmentView>,
    /// Attachments active here whose port does not exist yet.
    pub missing_ports: Vec<String>,
    pub problems: Vec<String>,
    /// Reconcile rounds that changed the data path, and the last one's time.
    pub reconciles: u64,
    pub last_reconcile_seconds: f64,
    pub last_reconcile_unix: u64,
    pub ready: bool,
}

impl View {
    pub fn attachments_of_vm<'a>(
        &'a self,
        namespace: &'a str,
        vm: &'a str,
    ) -> impl Iterator<Item = &'a AttachmentView> {
        self.attachments
            .iter()
            .filter(move |a| a.namespace == namespace && a.vm == vm)
    }
}

pub type SharedView = Arc<RwLock<View>>;
