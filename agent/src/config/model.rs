//! The documents users write (docs/config.md), as serde types. Unknown fields
//! are refused so a typo never silently turns a setting off.

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

pub const API_VERSION: &str = "vmpath.dev/v1alpha1";

#[derive(Debug, Clone, Deserialize, Serialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: Option<serde_yaml::Mapping>,
    #[serde(default)]
    pub annotations: Option<serde_yaml::Mapping>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeSpec {
    pub address: IpAddr,
    #[serde(default)]
    pub snat_address: Option<IpAddr>,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum Topology {
    #[default]
    Layer2,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum Role {
    Primary,
    #[default]
    Secondary,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum IpamMode {
    #[default]
    Enabled,
    Disabled,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum IpamLifecycle {
    #[default]
    Persistent,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct Ipam {
    #[serde(default)]
    pub mode: IpamMode,
    #[serde(default)]
    pub lifecycle: IpamLifecycle,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct PortSecurity {
    /// Source MAC filtering; on unless switched off.
    #[serde(default)]
    pub mac: Option<bool>,
    /// Source IP filtering; defaults to `ipam.mode == Enabled`.
    #[serde(default)]
    pub ip: Option<bool>,
    /// Drop DHCPv4/DHCPv6 server traffic (a rogue DHCP server) from the
    /// network's VMs. Defaults to `ipam.mode == Enabled`, where it cannot
    /// be switched off (vmpath is the network's DHCP server); on an
    /// IPAM-less network a VM may be the DHCP server unless this is `true`.
    #[serde(default, rename = "dhcpGuard")]
    pub dhcp_guard: Option<bool>,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum Egress {
    #[default]
    #[serde(rename = "SNAT")]
    Snat,
    Routed,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Advertise {
    #[serde(default, rename = "perVM")]
    pub per_vm: bool,
    #[serde(default)]
    pub subnet: bool,
    #[serde(default)]
    pub learned: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct StaticRoute {
    pub destination: IpNet,
    pub next_hop: IpAddr,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Dhcp {
    #[serde(default)]
    pub lease_seconds: Option<u32>,
    #[serde(default)]
    pub default_route: Option<bool>,
    #[serde(default)]
    pub dns_servers: Vec<IpAddr>,
    #[serde(default)]
    pub search_domains: Vec<String>,
    #[serde(default)]
    pub routes: Vec<StaticRoute>,
}

/// A token bucket: `rate` frames per second on average, `burst` at once.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub rate: u32,
    pub burst: u32,
}

/// What each VM port may send to the agent's slow path, per protocol;
/// frames over it are dropped in the data path (`slowpath_rate_limited`).
/// Unset classes keep their defaults.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SlowPathLimitsSpec {
    #[serde(default)]
    pub dhcp4: Option<RateLimit>,
    #[serde(default)]
    pub dhcp6: Option<RateLimit>,
    #[serde(default)]
    pub router_solicit: Option<RateLimit>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkSpec {
    pub id: u32,
    #[serde(default)]
    pub topology: Topology,
    #[serde(default)]
    pub role: Role,
    #[serde(default)]
    pub subnets: Vec<IpNet>,
    #[serde(default, rename = "defaultGatewayIPs")]
    pub default_gateway_ips: Vec<IpAddr>,
    #[serde(default, rename = "gatewayMAC")]
    pub gateway_mac: Option<String>,
    #[serde(default)]
    pub exclude_subnets: Vec<IpNet>,
    #[serde(default)]
    pub ipam: Ipam,
    #[serde(default)]
    pub port_security: PortSecurity,
    #[serde(default)]
    pub egress: Egress,
    #[serde(default)]
    pub advertise: Advertise,
    #[serde(default)]
    pub mtu: Option<u16>,
    #[serde(default)]
    pub dhcp: Dhcp,
    #[serde(default)]
    pub slow_path_limits: SlowPathLimitsSpec,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, Default)]
pub enum MacPolicy {
    #[default]
    Detect,
    Generate,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Migration {
    pub target_node: String,
    #[serde(default)]
    pub target_port: Option<String>,
    #[serde(default)]
    pub ready: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AttachmentSpec {
    pub vm: String,
    pub interface: String,
    pub network: String,
    pub node: String,
    pub port: String,
    #[serde(default)]
    pub mac: Option<String>,
    #[serde(default)]
    pub mac_policy: MacPolicy,
    #[serde(default)]
    pub ips: Vec<IpNet>,
    #[serde(default)]
    pub migration: Option<Migration>,
}
