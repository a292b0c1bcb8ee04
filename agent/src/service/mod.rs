//! ClusterIP Services compiled into what the data path looks up: per
//! network with a local port, each (ClusterIP, port, protocol) of a
//! Service whose EndpointSlices hold addresses on that network, with the
//! ready backends among them in numbered slots.
//!
//! A Service is translated on a network when an address of its
//! EndpointSlices is on it (an endpoint's address of that network), or,
//! when its slices hold no address at all, on every network (the client
//! gets a reject, as kube-proxy gives). A Service whose endpoints are all
//! elsewhere is left to the node (kube-proxy), as before.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use vmpath_common::{
    AddrInfo, AddrKey, MAX_SERVICE_BACKENDS, MAX_SERVICES, SVC_F_AFFINITY, Service, ServiceBackend,
    ServiceBackendKey, ServiceKey,
};

use crate::config::{
    Config,
    network_policy::Protocol,
    service::{EndpointSlice, ServicePort},
};

/// What the Service maps must hold on this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Compiled {
    pub services: BTreeMap<ServiceKey, Service>,
    pub backends: BTreeMap<ServiceBackendKey, ServiceBackend>,
    /// Service port id - 1 -> `namespace/name:port/PROTO` on network id.
    pub names: Vec<(String, u32)>,
    /// Limits hit, and what is not translated.
    pub problems: Vec<String>,
}

/// Compiles `cfg`'s Services for the networks in `local_networks` (those
/// with a port on this node). `addresses` is the plan's `vmp_addresses`:
/// which address is on which network, with the MAC that has it.
pub fn compile(
    cfg: &Config,
    addresses: &BTreeMap<AddrKey, AddrInfo>,
    local_networks: &BTreeSet<u32>,
) -> Compiled {
    let mut out = Compiled::default();
    if cfg.services.is_empty() {
        return out;
    }
    // Address -> (network, MAC) of every endpoint with a known MAC.
    let mut on_network: BTreeMap<IpAddr, Vec<(u32, [u8; 6])>> = BTreeMap::new();
    for (k, info) in addresses {
        if info.mac != [0; 6] {
            on_network
                .entry(k.ip())
                .or_default()
                .push((k.network, info.mac));
        }
    }
    for svc in &cfg.services {
        let slices: Vec<&EndpointSlice> = cfg
            .endpoint_slices
            .iter()
            .filter(|s| s.namespace == svc.namespace && s.service == svc.name)
            .collect();
        let any_address = slices.iter().any(|s| !s.endpoints.is_empty());
        // The networks its endpoints are on, ready or not.
        let mut networks: BTreeSet<u32> = slices
            .iter()
            .flat_map(|s| &s.endpoints)
            .flat_map(|e| on_network.get(&e.address).into_iter().flatten())
            .map(|(net, _)| *net)
            .collect();
        if !any_address {
            networks = local_networks.clone();
        }
        networks.retain(|n| local_networks.contains(n));
        for vip in &svc.cluster_ips {
            let IpAddr::V4(vip4) = vip else {
                out.problems.push(format!(
                    "Service {}/{}: IPv6 ClusterIP {vip} is not translated (IPv4 only)",
                    svc.namespace, svc.name
                ));
                continue;
            };
            for sp in &svc.ports {
                if sp.protocol == Protocol::Sctp {
                    continue;
                }
                for net in &networks {
                    let backends = backends_of(&slices, sp, *net, &on_network);
                    let key = ServiceKey::new(*net, vip4.octets(), sp.port, sp.protocol.number());
                    if out.services.len() >= MAX_SERVICES as usize
                        || out.backends.len() + backends.len() > MAX_SERVICE_BACKENDS as usize
                    {
                        out.problems.push(format!(
                            "Service {}/{} port {}: more Service ports or backends than the data path holds; not translated",
                            svc.namespace, svc.name, sp.port
                        ));
                        continue;
                    }
                    let id = out.names.len() as u32 + 1;
                    out.names.push((
                        format!(
                            "{}/{}:{}/{}",
                            svc.namespace,
                            svc.name,
                            sp.port,
                            proto_name(sp.protocol)
                        ),
                        *net,
                    ));
                    for (slot, b) in backends.iter().enumerate() {
                        out.backends.insert(
                            ServiceBackendKey {
                                service: id,
                                slot: slot as u32,
                            },
                            *b,
                        );
                    }
                    out.services.insert(
                        key,
                        Service {
                            id,
                            count: backends.len() as u32,
                            affinity_timeout: svc.affinity_timeout.unwrap_or(0),
                            flags: if svc.affinity_timeout.is_some() {
                                SVC_F_AFFINITY
                            } else {
                                0
                            },
                            _pad: [0; 3],
                        },
                    );
                }
            }
        }
    }
    out
}

/// The backends of Service port `sp` on network `net`: its ready
/// endpoints there, or, when none is ready, those still serving while
/// they terminate (as kube-proxy falls back); sorted, so slots stay put
/// while the set does.
fn backends_of(
    slices: &[&EndpointSlice],
    sp: &ServicePort,
    net: u32,
    on_network: &BTreeMap<IpAddr, Vec<(u32, [u8; 6])>>,
) -> Vec<ServiceBackend> {
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    for s in slices {
        // The slice's port of that name and protocol; a slice that lists
        // no ports takes a numeric targetPort.
        let port = if s.ports.is_empty() {
            sp.target_port
        } else {
            s.ports
                .iter()
                .find(|(name, _, proto)| *name == sp.name && *proto == sp.protocol)
                .map(|(_, p, _)| *p)
        };
        let Some(port) = port else { continue };
        for e in &s.endpoints {
            let IpAddr::V4(a) = e.address else { continue };
            let Some((_, mac)) = on_network
                .get(&e.address)
                .and_then(|v| v.iter().find(|(n, _)| *n == net))
            else {
                continue;
            };
            let b = (a.octets(), port, *mac);
            if e.ready {
                ready.insert(b);
            } else if e.serving && e.terminating {
                terminating.insert(b);
            }
        }
    }
    let chosen = if ready.is_empty() { terminating } else { ready };
    chosen
        .into_iter()
        .map(|(addr, port, mac)| ServiceBackend { addr, port, mac })
        .collect()
}

fn proto_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    }
}

#[cfg(test)]
mod tests;
