//! Kubernetes `v1 Service` and `discovery.k8s.io/v1 EndpointSlice`: the
//! documents as serde reads them, and the checked forms `service`
//! compiles. Only what ClusterIP load balancing needs is read; the other
//! fields `kubectl get -o yaml` prints are accepted and ignored.

use std::net::IpAddr;

use serde::Deserialize;

use super::network_policy::{IntOrString, Protocol};

pub const SERVICE_API_VERSION: &str = "v1";
pub const SERVICE_KIND: &str = "Service";
pub const SLICE_API_VERSION: &str = "discovery.k8s.io/v1";
pub const SLICE_KIND: &str = "EndpointSlice";
/// The label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// Kubernetes' bound on it (one day).
const MAX_AFFINITY_TIMEOUT: u32 = 86400;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    #[serde(default, rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(default, rename = "clusterIPs")]
    pub cluster_ips: Option<Vec<String>>,
    #[serde(default)]
    pub ports: Vec<ServicePortSpec>,
    #[serde(default)]
    pub session_affinity: Option<String>,
    #[serde(default)]
    pub session_affinity_config: Option<AffinityConfigSpec>,
    /// `SingleStack` (default), `PreferDualStack` or `RequireDualStack`.
    #[serde(default)]
    pub ip_family_policy: Option<String>,
    /// `IPv4` and/or `IPv6`, in the order of `clusterIPs`.
    #[serde(default)]
    pub ip_families: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ServicePortSpec {
    #[serde(default)]
    pub name: Option<String>,
    pub port: u32,
    #[serde(default)]
    pub target_port: Option<IntOrString>,
    #[serde(default)]
    pub protocol: Option<Protocol>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct AffinityConfigSpec {
    #[serde(default, rename = "clientIP")]
    pub client_ip: Option<ClientIpSpec>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClientIpSpec {
    #[serde(default)]
    pub timeout_seconds: Option<u32>,
}

/// A checked ClusterIP Service.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// Its ClusterIPs (`None` / headless and ExternalName Services are
    /// not kept: nothing to translate).
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `sessionAffinity: ClientIP`: seconds a client sticks to a backend.
    pub affinity_timeout: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ServicePort {
    /// The port's name (empty for the one unnamed port a Service may have):
    /// EndpointSlice ports carry it.
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    /// The backend port when no EndpointSlice port names it: a number
    /// given as `targetPort` (default: `port`). A named `targetPort` is
    /// what the EndpointSlice resolves; without it, no backend.
    pub target_port: Option<u16>,
}

/// Checks a Service as the API server would, naming the field (relative
/// to `spec`). `Ok(None)`: a valid Service with nothing to load balance
/// (headless, ExternalName).
pub fn check_service(
    namespace: &str,
    name: &str,
    spec: ServiceSpec,
) -> Result<Option<Service>, (String, String)> {
    let kind = spec.type_.as_deref().unwrap_or("ClusterIP");
    if !matches!(
        kind,
        "ClusterIP" | "NodePort" | "LoadBalancer" | "ExternalName"
    ) {
        return Err((
            "type".into(),
            format!("{kind:?} is not ClusterIP, NodePort, LoadBalancer or ExternalName"),
        ));
    }
    if kind == "ExternalName" {
        return Ok(None);
    }
    let mut texts: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if texts.is_empty()
        && let Some(ip) = &spec.cluster_ip
    {
        texts.push(ip.clone());
    }
    let field = if spec.cluster_ips.is_some() {
        "clusterIPs"
    } else {
        "clusterIP"
    };
    let mut cluster_ips = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        if t.is_empty() || t == "None" {
            continue;
        }
        let ip: IpAddr = t.parse().map_err(|_| {
            (
                format!("{field}[{i}]"),
                format!("{t:?} is not an IP address"),
            )
        })?;
        cluster_ips.push(ip);
    }
    if cluster_ips.is_empty() {
        return Ok(None);
    }
    check_families(&spec, field, &cluster_ips)?;
    let mut ports: Vec<ServicePort> = Vec::new();
    let mut names = crate::sys::hash::HashSet::default();
    let mut numbers = crate::sys::hash::HashSet::default();
    for (i, p) in spec.ports.iter().enumerate() {
        let at = |f: &str| format!("ports[{i}].{f}");
        let port = u16::try_from(p.port)
            .ok()
            .filter(|n| *n != 0)
            .ok_or_else(|| (at("port"), format!("{} is outside 1..=65535", p.port)))?;
        let protocol = p.protocol.unwrap_or(Protocol::Tcp);
        let target_port = match &p.target_port {
            None => Some(port),
            Some(IntOrString::Int(0)) => Some(port),
            Some(IntOrString::Int(n)) => Some(
                u16::try_from(*n)
                    .map_err(|_| (at("targetPort"), format!("{n} is outside 1..=65535")))?,
            ),
            Some(IntOrString::String(s)) if s.is_empty() => Some(port),
            Some(IntOrString::String(_)) => None,
        };
        let name = p.name.clone().unwrap_or_default();
        if name.is_empty() && spec.ports.len() > 1 {
            return Err((
                at("name"),
                "missing (a Service with several ports names each)".into(),
            ));
        }
        // Sets, not a scan of the ports so far: a Service may list
        // thousands.
        if !names.insert(name.clone()) {
            return Err((at("name"), format!("{name:?} is used by another port")));
        }
        if !numbers.insert((port, protocol)) {
            return Err((
                at("port"),
                format!("{port}/{protocol:?} is used by another port"),
            ));
        }
        ports.push(ServicePort {
            name,
            port,
            protocol,
            target_port,
        });
    }
    let affinity_timeout = match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT);
            if t == 0 || t > MAX_AFFINITY_TIMEOUT {
                return Err((
                    "sessionAffinityConfig.clientIP.timeoutSeconds".into(),
                    format!("{t} is outside 1..={MAX_AFFINITY_TIMEOUT}"),
                ));
            }
            Some(t)
        }
        Some(other) => {
            return Err((
                "sessionAffinity".into(),
                format!("{other:?} is not None or ClientIP"),
            ));
        }
    };
    Ok(Some(Service {
        namespace: namespace.to_string(),
        name: name.to_string(),
        cluster_ips,
        ports,
        affinity_timeout,
    }))
}

/// Checks `ipFamilyPolicy` and `ipFamilies` against the ClusterIPs, as
/// the API server does: at most one ClusterIP per family, each family in
/// `ipFamilies` in the order of the ClusterIPs, a single one for
/// `SingleStack` and one of each for `RequireDualStack`.
fn check_families(
    spec: &ServiceSpec,
    field: &str,
    cluster_ips: &[IpAddr],
) -> Result<(), (String, String)> {
    let family = |ip: &IpAddr| if ip.is_ipv4() { "IPv4" } else { "IPv6" };
    if cluster_ips.len() > 2 {
        return Err((
            format!("{field}[2]"),
            "a Service has at most two ClusterIPs (one per family)".into(),
        ));
    }
    if cluster_ips.len() == 2 && cluster_ips[0].is_ipv4() == cluster_ips[1].is_ipv4() {
        return Err((
            format!("{field}[1]"),
            format!(
                "{} is of the same family as {} (a dual-stack Service has one ClusterIP per family)",
                cluster_ips[1], cluster_ips[0]
            ),
        ));
    }
    let families = spec.ip_families.as_deref().unwrap_or_default();
    for (i, f) in families.iter().enumerate() {
        if f != "IPv4" && f != "IPv6" {
            return Err((
                format!("ipFamilies[{i}]"),
                format!("{f:?} is not IPv4 or IPv6"),
            ));
        }
        if families[..i].contains(f) {
            return Err((format!("ipFamilies[{i}]"), format!("{f} is listed twice")));
        }
        if let Some(ip) = cluster_ips.get(i)
            && family(ip) != f
        {
            return Err((
                format!("ipFamilies[{i}]"),
                format!("{f} is not the family of {field}[{i}] {ip}"),
            ));
        }
    }
    let wanted = families.len().max(cluster_ips.len());
    match spec.ip_family_policy.as_deref() {
        None | Some("SingleStack") if wanted > 1 => Err((
            "ipFamilyPolicy".into(),
            format!(
                "{} takes one family; this Service has two (set PreferDualStack or RequireDualStack)",
                spec.ip_family_policy
                    .as_deref()
                    .unwrap_or("SingleStack (the default)")
            ),
        )),
        None | Some("SingleStack") | Some("PreferDualStack") => Ok(()),
        Some("RequireDualStack") if cluster_ips.len() < 2 => Err((
            "ipFamilyPolicy".into(),
            format!(
                "RequireDualStack needs a ClusterIP of each family; {field} has only {}",
                cluster_ips[0]
            ),
        )),
        Some("RequireDualStack") => Ok(()),
        Some(other) => Err((
            "ipFamilyPolicy".into(),
            format!("{other:?} is not SingleStack, PreferDualStack or RequireDualStack"),
        )),
    }
}

/// An EndpointSlice's fields (they sit at the top level, beside
/// `metadata`, not under `spec`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct SliceSpec {
    pub address_type: String,
    #[serde(default)]
    pub endpoints: Vec<SliceEndpointSpec>,
    #[serde(default)]
    pub ports: Option<Vec<SlicePortSpec>>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpointSpec {
    #[serde(default)]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub conditions: ConditionsSpec,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConditionsSpec {
    #[serde(default)]
    pub ready: Option<bool>,
    #[serde(default)]
    pub serving: Option<bool>,
    #[serde(default)]
    pub terminating: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct SlicePortSpec {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub port: Option<u32>,
    #[serde(default)]
    pub protocol: Option<Protocol>,
}

/// A checked EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EndpointSlice {
    pub namespace: String,
    pub name: String,
    /// Its Service (`kubernetes.io/service-name`).
    pub service: String,
    pub endpoints: Vec<SliceEndpoint>,
    /// (name, port, protocol); a port without a number stands for every
    /// port and is not kept.
    pub ports: Vec<(String, u16, Protocol)>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SliceEndpoint {
    pub address: IpAddr,
    /// `conditions.ready` (absent: ready, as Kubernetes reads it).
    pub ready: bool,
    /// `conditions.serving` (absent: as ready).
    pub serving: bool,
    pub terminating: bool,
}

/// Checks an EndpointSlice, naming the field. `Ok(None)`: an FQDN slice
/// or one without a Service label (nothing to load balance).
pub fn check_slice(
    namespace: &str,
    name: &str,
    service: Option<&str>,
    spec: SliceSpec,
) -> Result<Option<EndpointSlice>, (String, String)> {
    let family_v4 = match spec.address_type.as_str() {
        "IPv4" => true,
        "IPv6" => false,
        "FQDN" => return Ok(None),
        other => {
            return Err((
                "addressType".into(),
                format!("{other:?} is not IPv4, IPv6 or FQDN"),
            ));
        }
    };
    let Some(service) = service else {
        return Ok(None);
    };
    let mut endpoints = Vec::new();
    for (i, e) in spec.endpoints.iter().enumerate() {
        for (j, a) in e.addresses.iter().enumerate() {
            let address: IpAddr = a
                .parse()
                .ok()
                .filter(|ip: &IpAddr| ip.is_ipv4() == family_v4)
                .ok_or_else(|| {
                    (
                        format!("endpoints[{i}].addresses[{j}]"),
                        format!("{a:?} is not an {} address", spec.address_type),
                    )
                })?;
            let ready = e.conditions.ready.unwrap_or(true);
            endpoints.push(SliceEndpoint {
                address,
                ready,
                serving: e.conditions.serving.unwrap_or(ready),
                terminating: e.conditions.terminating.unwrap_or(false),
            });
        }
    }
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let Some(n) = p.port else { continue };
        let port = u16::try_from(n).ok().filter(|n| *n != 0).ok_or_else(|| {
            (
                format!("ports[{i}].port"),
                format!("{n} is outside 1..=65535"),
            )
        })?;
        ports.push((
            p.name.clone().unwrap_or_default(),
            port,
            p.protocol.unwrap_or(Protocol::Tcp),
        ));
    }
    Ok(Some(EndpointSlice {
        namespace: namespace.to_string(),
        name: name.to_string(),
        service: service.to_string(),
        endpoints,
        ports,
    }))
}
