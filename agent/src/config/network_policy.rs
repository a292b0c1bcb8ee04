//! Kubernetes `networking.k8s.io/v1 NetworkPolicy`: the document as serde
//! reads it, and the checked form `policy` compiles. Kubernetes' own
//! validation is repeated so a policy the API server would refuse is
//! refused here too, naming the field.

use ipnet::IpNet;
use serde::Deserialize;

use super::label_selector::LabelSelector;

pub const API_VERSION: &str = "networking.k8s.io/v1";
pub const KIND: &str = "NetworkPolicy";

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    #[serde(default)]
    pub pod_selector: LabelSelector,
    #[serde(default)]
    pub policy_types: Option<Vec<PolicyType>>,
    #[serde(default)]
    pub ingress: Option<Vec<IngressRuleSpec>>,
    #[serde(default)]
    pub egress: Option<Vec<EgressRuleSpec>>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
pub enum PolicyType {
    Ingress,
    Egress,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct IngressRuleSpec {
    #[serde(default)]
    pub from: Vec<PeerSpec>,
    #[serde(default)]
    pub ports: Vec<PortSpec>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EgressRuleSpec {
    #[serde(default)]
    pub to: Vec<PeerSpec>,
    #[serde(default)]
    pub ports: Vec<PortSpec>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PeerSpec {
    #[serde(default)]
    pub pod_selector: Option<LabelSelector>,
    #[serde(default)]
    pub namespace_selector: Option<LabelSelector>,
    #[serde(default)]
    pub ip_block: Option<IpBlockSpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IpBlockSpec {
    pub cidr: IpNet,
    #[serde(default)]
    pub except: Vec<IpNet>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PortSpec {
    #[serde(default)]
    pub protocol: Option<Protocol>,
    #[serde(default)]
    pub port: Option<IntOrString>,
    #[serde(default)]
    pub end_port: Option<u32>,
}

#[derive(
    Debug, Clone, Copy, Deserialize, serde::Serialize, PartialEq, Eq, PartialOrd, Ord, Hash,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum IntOrString {
    Int(u32),
    String(String),
}

/// A checked NetworkPolicy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NetworkPolicy {
    pub namespace: String,
    pub name: String,
    pub pod_selector: LabelSelector,
    /// `None`: the policy does not isolate ingress; `Some(rules)`: it
    /// does, and allows what any rule allows (none: nothing).
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
}

/// One ingress or egress rule: from/to any of `peers` (empty: anyone), on
/// any of `ports` (empty: every port and protocol).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Rule {
    pub peers: Vec<Peer>,
    pub ports: Vec<Port>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Peer {
    /// Endpoints whose namespace matches `namespaces` (`None`: the
    /// policy's own) and whose labels match `pods` (`None`: any).
    Endpoints {
        namespaces: Option<LabelSelector>,
        pods: Option<LabelSelector>,
    },
    IpBlock {
        cidr: IpNet,
        except: Vec<IpNet>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Port {
    pub protocol: u8,
    pub port: PortRef,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum PortRef {
    Any,
    /// A range, inclusive (a single port: both ends the same).
    Range(u16, u16),
    /// A name the endpoint declares (`spec.ports` of an Attachment).
    Named(String),
}

/// A port name as Kubernetes takes it (IANA_SVC_NAME): 1-15 lowercase
/// letters, digits and '-', at least one letter, no '-' at either end or
/// twice in a row.
pub fn check_port_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 15
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a port name (1-15 lowercase letters, digits and '-', with a letter)"
        ))
    }
}

/// Checks `spec` of the policy `namespace`/`name`; `Err` is (field under
/// `spec`, message).
pub fn check(
    namespace: &str,
    name: &str,
    spec: NetworkPolicySpec,
) -> Result<NetworkPolicy, (String, String)> {
    let sel =
        |field: String, s: &LabelSelector| s.check().map_err(|(f, m)| (format!("{field}.{f}"), m));
    sel("podSelector".into(), &spec.pod_selector)?;
    let (ingress_on, egress_on) = match &spec.policy_types {
        Some(types) => (
            types.contains(&PolicyType::Ingress),
            types.contains(&PolicyType::Egress),
        ),
        // Kubernetes' default: Ingress always, Egress when rules are given.
        None => (true, spec.egress.is_some()),
    };
    let rules = |kind: &str, list: Vec<(Vec<PeerSpec>, Vec<PortSpec>)>| {
        let mut out = Vec::new();
        for (i, (peers, ports)) in list.into_iter().enumerate() {
            let peer_field = if kind == "ingress" { "from" } else { "to" };
            let mut rule = Rule {
                peers: Vec::new(),
                ports: Vec::new(),
            };
            for (j, p) in peers.into_iter().enumerate() {
                let at = format!("{kind}[{i}].{peer_field}[{j}]");
                rule.peers.push(peer(&at, p, &sel)?);
            }
            for (j, p) in ports.into_iter().enumerate() {
                rule.ports
                    .push(port(&format!("{kind}[{i}].ports[{j}]"), p)?);
            }
            out.push(rule);
        }
        Ok::<_, (String, String)>(out)
    };
    let ingress = spec
        .ingress
        .unwrap_or_default()
        .into_iter()
        .map(|r| (r.from, r.ports))
        .collect();
    let egress = spec
        .egress
        .unwrap_or_default()
        .into_iter()
        .map(|r| (r.to, r.ports))
        .collect();
    let ingress = rules("ingress", ingress)?;
    let egress = rules("egress", egress)?;
    Ok(NetworkPolicy {
        namespace: namespace.to_string(),
        name: name.to_string(),
        pod_selector: spec.pod_selector,
        ingress: ingress_on.then_some(ingress),
        egress: egress_on.then_some(egress),
    })
}

fn peer(
    at: &str,
    p: PeerSpec,
    sel: &impl Fn(String, &LabelSelector) -> Result<(), (String, String)>,
) -> Result<Peer, (String, String)> {
    match (p.ip_block, p.pod_selector, p.namespace_selector) {
        (Some(b), None, None) => {
            let cidr = b.cidr.trunc();
            for (k, e) in b.except.iter().enumerate() {
                if !cidr.contains(e) || e.prefix_len() <= cidr.prefix_len() {
                    return Err((
                        format!("{at}.ipBlock.except[{k}]"),
                        format!("{e} is not a part of {cidr} narrower than it"),
                    ));
                }
            }
            Ok(Peer::IpBlock {
                cidr,
                except: b.except.iter().map(IpNet::trunc).collect(),
            })
        }
        (Some(_), _, _) => Err((
            format!("{at}.ipBlock"),
            "an ipBlock peer may not also have a podSelector or namespaceSelector".into(),
        )),
        (None, None, None) => Err((
            at.to_string(),
            "a peer needs a podSelector, a namespaceSelector or an ipBlock".into(),
        )),
        (None, pods, namespaces) => {
            if let Some(s) = &pods {
                sel(format!("{at}.podSelector"), s)?;
            }
            if let Some(s) = &namespaces {
                sel(format!("{at}.namespaceSelector"), s)?;
            }
            Ok(Peer::Endpoints { namespaces, pods })
        }
    }
}

fn port(at: &str, p: PortSpec) -> Result<Port, (String, String)> {
    let protocol = p.protocol.unwrap_or(Protocol::Tcp).number();
    let in_range = |field: &str, n: u32| {
        if (1..=65535).contains(&n) {
            Ok(n as u16)
        } else {
            Err((format!("{at}.{field}"), format!("{n} is outside 1..=65535")))
        }
    };
    let port = match (p.port, p.end_port) {
        (None, None) => PortRef::Any,
        (None, Some(_)) => {
            return Err((format!("{at}.endPort"), "needs a numeric port".into()));
        }
        (Some(IntOrString::Int(n)), end) => {
            let start = in_range("port", n)?;
            let end = match end {
                Some(e) => in_range("endPort", e)?,
                None => start,
            };
            if end < start {
                return Err((
                    format!("{at}.endPort"),
                    format!("{end} is below port {start}"),
                ));
            }
            PortRef::Range(start, end)
        }
        (Some(IntOrString::String(_)), Some(_)) => {
            return Err((format!("{at}.endPort"), "needs a numeric port".into()));
        }
        (Some(IntOrString::String(s)), None) => {
            check_port_name(&s).map_err(|m| (format!("{at}.port"), m))?;
            PortRef::Named(s)
        }
    };
    Ok(Port { protocol, port })
}
