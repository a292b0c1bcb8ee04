//! The documents users write (docs/config.md), as serde types. Unknown fields
//! are refused so a typo never silently turns a setting off.

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

pub const API_VERSION: &str = "vmpath.dev/v1alpha1";
/// Kubernetes' core group (`v1 Namespace`).
pub const CORE_API_VERSION: &str = "v1";

#[derive(Debug, Clone, Deserialize, Serialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default, deserialize_with = "bounded::map")]
    pub labels: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, deserialize_with = "bounded::map")]
    pub annotations: Option<serde_json::Map<String, serde_json::Value>>,
    /// What the API server sets on every object (uid, resourceVersion,
    /// generation, creationTimestamp, selfLink, managedFields,
    /// ownerReferences, finalizers): accepted and ignored, so
    /// `kubectl get -o yaml` output reads as written.
    #[serde(default, skip_serializing)]
    pub uid: Option<serde_json::Value>,
    #[serde(default, skip_serializing, rename = "resourceVersion")]
    pub resource_version: Option<serde_json::Value>,
    #[serde(default, skip_serializing)]
    pub generation: Option<serde_json::Value>,
    #[serde(default, skip_serializing, rename = "creationTimestamp")]
    pub creation_timestamp: Option<serde_json::Value>,
    #[serde(default, skip_serializing, rename = "selfLink")]
    pub self_link: Option<serde_json::Value>,
    #[serde(default, skip_serializing, rename = "managedFields")]
    pub managed_fields: Option<serde_json::Value>,
    #[serde(default, skip_serializing, rename = "ownerReferences")]
    pub owner_references: Option<serde_json::Value>,
    #[serde(default, skip_serializing)]
    pub finalizers: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NodeSpec {
    pub address: IpAddr,
    #[serde(default)]
    pub snat_address: Option<IpAddr>,
    #[serde(default)]
    pub snat_address6: Option<std::net::Ipv6Addr>,
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
    #[serde(default, deserialize_with = "bounded::short")]
    pub dns_servers: Vec<IpAddr>,
    #[serde(default, deserialize_with = "bounded::short")]
    pub search_domains: Vec<String>,
    #[serde(default, deserialize_with = "bounded::long")]
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
    #[serde(default, deserialize_with = "bounded::short")]
    pub subnets: Vec<IpNet>,
    #[serde(
        default,
        rename = "defaultGatewayIPs",
        deserialize_with = "bounded::short"
    )]
    pub default_gateway_ips: Vec<IpAddr>,
    #[serde(default, rename = "gatewayMAC")]
    pub gateway_mac: Option<String>,
    #[serde(default, deserialize_with = "bounded::long")]
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
    /// Which namespaces' endpoints may attach; absent: every namespace.
    #[serde(default)]
    pub namespace_selector: Option<super::label_selector::LabelSelector>,
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
    #[serde(default, deserialize_with = "bounded::short")]
    pub ips: Vec<IpNet>,
    #[serde(default)]
    pub migration: Option<Migration>,
    /// Named ports the VM serves, for NetworkPolicies that name a port.
    #[serde(default, deserialize_with = "bounded::short")]
    pub ports: Vec<AttachmentPort>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AttachmentPort {
    pub name: String,
    pub port: u16,
    #[serde(default)]
    pub protocol: Option<super::network_policy::Protocol>,
}

/// List and map fields with a bound: a longer one is refused while it is
/// read, naming the limit, before the rest of it is looked at.
mod bounded {
    use std::{fmt, marker::PhantomData};

    use serde::{
        Deserialize, Deserializer,
        de::{self, MapAccess, SeqAccess, Visitor},
    };

    use crate::config::source::limits;

    struct Seq<T>(usize, PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for Seq<T> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a list of at most {} entries", self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::new();
            while let Some(v) = seq.next_element()? {
                if out.len() == self.0 {
                    return Err(de::Error::custom(format!(
                        "more than {} entries (the limit for this list)",
                        self.0
                    )));
                }
                out.push(v);
            }
            // Kept as long as its document: without the room growth left.
            out.shrink_to_fit();
            Ok(out)
        }
    }

    pub fn short<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(Seq(limits::MAX_SHORT_LIST, PhantomData))
    }

    pub fn long<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(Seq(limits::MAX_LONG_LIST, PhantomData))
    }

    type Object = serde_json::Map<String, serde_json::Value>;

    struct Map;

    impl<'de> Visitor<'de> for Map {
        type Value = Option<Object>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "a mapping of at most {} entries", limits::MAX_LABELS)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(Map)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Object::new();
            while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                if out.len() == limits::MAX_LABELS {
                    return Err(de::Error::custom(format!(
                        "more than {} entries (the limit for this mapping)",
                        limits::MAX_LABELS
                    )));
                }
                out.insert(k, v);
            }
            Ok(Some(out))
        }
    }

    pub fn map<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Object>, D::Error> {
        d.deserialize_option(Map)
    }
}
