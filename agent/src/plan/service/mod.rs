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
    ServiceBackend6, ServiceBackendKey, ServiceKey, ServiceKey6,
};

use crate::config::{
    Config,
    network_policy::Protocol,
    service::{EndpointSlice, ServicePort},
};

/// One Service port on one network, of either family: its key in
/// `vmp_svc` (IPv4) or `vmp_svc6` (IPv6). Ids are one space over both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PortKey {
    V4(ServiceKey),
    V6(ServiceKey6),
}

impl PortKey {
    fn new(net: u32, vip: IpAddr, port: u16, proto: u8) -> Self {
        match vip {
            IpAddr::V4(a) => PortKey::V4(ServiceKey::new(net, a.octets(), port, proto)),
            IpAddr::V6(a) => PortKey::V6(ServiceKey6::new(net, a.octets(), port, proto)),
        }
    }
}

/// What the Service maps must hold on this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Compiled {
    pub services: BTreeMap<ServiceKey, Service>,
    pub backends: BTreeMap<ServiceBackendKey, ServiceBackend>,
    /// IPv6 ClusterIPs (`vmp_svc6`) and their backends (`vmp_svc6_backend`).
    pub services6: BTreeMap<ServiceKey6, Service>,
    pub backends6: BTreeMap<ServiceBackendKey, ServiceBackend6>,
    /// Service port id -> (`namespace/name:port/PROTO`, network id).
    pub names: BTreeMap<u32, (String, u32)>,
    /// Limits hit, and what is not translated: one line per Service.
    pub problems: Vec<String>,
}

/// The ports of a Service left out, and which share they did not fit.
type Cut = (BTreeSet<(u16, Protocol)>, &'static str);

/// One (network, ClusterIP, port, protocol) a Service wants programmed.
struct Wanted<'a> {
    svc: &'a crate::config::service::Service,
    sp: &'a ServicePort,
    net: u32,
    key: PortKey,
    /// Of the ClusterIP's family.
    backends: Vec<(IpAddr, u16, [u8; 6])>,
}

/// Max-min fair shares of `capacity` among `demands`: a namespace asking
/// for no more than an equal part of what is left gets all it asks; the
/// rest is split evenly among the larger ones. So however much one
/// namespace asks for, every other keeps at least `capacity / namespaces`.
pub fn fair_shares(demands: &BTreeMap<&str, usize>, capacity: usize) -> BTreeMap<String, usize> {
    let mut by_demand: Vec<(&str, usize)> = demands.iter().map(|(k, d)| (*k, *d)).collect();
    by_demand.sort_by_key(|(_, d)| *d);
    let mut left = capacity;
    let mut open = by_demand.len();
    let mut out = BTreeMap::new();
    for (ns, demand) in by_demand {
        let got = demand.min(left / open);
        out.insert(ns.to_string(), got);
        left -= got;
        open -= 1;
    }
    out
}

/// Compiles `cfg`'s Services for the networks in `local_networks` (those
/// with a port on this node). `addresses` is the plan's `vmp_addresses`:
/// which address is on which network, with the MAC that has it.
/// `previous` is what the data path holds (Service key -> id): those go
/// first within their namespace's share and keep their ids, so a newcomer
/// that does not fit is the one left out.
pub fn compile(
    cfg: &Config,
    addresses: &crate::plan::layered::Layered<AddrKey, AddrInfo>,
    local_networks: &BTreeSet<u32>,
    previous: &BTreeMap<PortKey, u32>,
) -> Compiled {
    let mut out = Compiled::default();
    if cfg.services.is_empty() {
        return out;
    }
    // Address -> (network, MAC) of each endpoint a slice names that has a
    // known MAC: looked up per address and network, not a walk of every
    // address of the cluster.
    let mut on_network: BTreeMap<IpAddr, Vec<(u32, [u8; 6])>> = BTreeMap::new();
    for e in cfg.endpoint_slices.iter().flat_map(|s| &s.endpoints) {
        if on_network.contains_key(&e.address) {
            continue;
        }
        let found: Vec<(u32, [u8; 6])> = cfg
            .networks
            .iter()
            .filter_map(|n| {
                addresses
                    .get(&AddrKey::from_ip(n.id, e.address))
                    .map(|i| (n.id, i.mac))
            })
            .filter(|(_, mac)| *mac != [0; 6])
            .collect();
        on_network.insert(e.address, found);
    }
    let mut wanted: Vec<Wanted> = Vec::new();
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
        // A dual-stack Service has a ClusterIP per family, each
        // translated to that family's backends.
        for vip in &svc.cluster_ips {
            for sp in &svc.ports {
                if sp.protocol == Protocol::Sctp {
                    continue;
                }
                for net in &networks {
                    wanted.push(Wanted {
                        svc,
                        sp,
                        net: *net,
                        key: PortKey::new(*net, *vip, sp.port, sp.protocol.number()),
                        backends: backends_of(&slices, sp, *net, vip.is_ipv4(), &on_network),
                    });
                }
            }
        }
    }
    // What is programmed goes first (stable: then by namespace and name).
    wanted.sort_by_key(|w| !previous.contains_key(&w.key));

    // Each namespace's share of the Service ports, then of the backends
    // among the ports it keeps.
    let mut demand: BTreeMap<&str, usize> = BTreeMap::new();
    for w in &wanted {
        *demand.entry(w.svc.namespace.as_str()).or_default() += 1;
    }
    let port_share = fair_shares(&demand, MAX_SERVICES as usize);
    let mut used: BTreeMap<&str, usize> = BTreeMap::new();
    let mut taken: BTreeSet<PortKey> = BTreeSet::new();
    let mut kept: Vec<&Wanted> = Vec::new();
    // Per Service: the ports left out, and why.
    let mut cut: BTreeMap<(&str, &str), Cut> = BTreeMap::new();
    for w in &wanted {
        let ns = w.svc.namespace.as_str();
        if !taken.insert(w.key) {
            out.problems.push(format!(
                "Service {}/{} port {}/{}: its ClusterIP and port are another Service's; not translated",
                w.svc.namespace,
                w.svc.name,
                w.sp.port,
                proto_name(w.sp.protocol)
            ));
            continue;
        }
        let n = used.entry(ns).or_default();
        if *n >= port_share[ns] {
            cut.entry((ns, w.svc.name.as_str()))
                .or_insert((BTreeSet::new(), "Service ports"))
                .0
                .insert((w.sp.port, w.sp.protocol));
            continue;
        }
        *n += 1;
        kept.push(w);
    }
    let mut demand: BTreeMap<&str, usize> = BTreeMap::new();
    for w in &kept {
        *demand.entry(w.svc.namespace.as_str()).or_default() += w.backends.len();
    }
    let backend_share = fair_shares(&demand, MAX_SERVICE_BACKENDS as usize);
    let mut used: BTreeMap<&str, usize> = BTreeMap::new();
    kept.retain(|w| {
        let ns = w.svc.namespace.as_str();
        let n = used.entry(ns).or_default();
        if *n + w.backends.len() > backend_share[ns] {
            cut.entry((ns, w.svc.name.as_str()))
                .or_insert((BTreeSet::new(), "backends"))
                .0
                .insert((w.sp.port, w.sp.protocol));
            return false;
        }
        *n += w.backends.len();
        true
    });

    // Ids: a programmed Service port keeps its own; a new one takes the
    // smallest free.
    let mut ids: Vec<u32> = vec![0; kept.len()];
    let mut in_use: BTreeSet<u32> = BTreeSet::new();
    for (i, w) in kept.iter().enumerate() {
        if let Some(&id) = previous.get(&w.key)
            && id != 0
            && in_use.insert(id)
        {
            ids[i] = id;
        }
    }
    let mut next = 1u32;
    for id in ids.iter_mut().filter(|id| **id == 0) {
        while in_use.contains(&next) {
            next += 1;
        }
        *id = next;
        in_use.insert(next);
    }
    for (w, id) in kept.iter().zip(ids) {
        out.names.insert(
            id,
            (
                format!(
                    "{}/{}:{}/{}",
                    w.svc.namespace,
                    w.svc.name,
                    w.sp.port,
                    proto_name(w.sp.protocol)
                ),
                w.net,
            ),
        );
        for (slot, &(addr, port, mac)) in w.backends.iter().enumerate() {
            let key = ServiceBackendKey {
                service: id,
                slot: slot as u32,
            };
            match addr {
                IpAddr::V4(a) => {
                    let addr = a.octets();
                    out.backends.insert(key, ServiceBackend { addr, port, mac });
                }
                IpAddr::V6(a) => {
                    let addr = a.octets();
                    out.backends6
                        .insert(key, ServiceBackend6 { addr, port, mac });
                }
            }
        }
        let service = Service {
            id,
            count: w.backends.len() as u32,
            affinity_timeout: w.svc.affinity_timeout.unwrap_or(0),
            flags: if w.svc.affinity_timeout.is_some() {
                SVC_F_AFFINITY
            } else {
                0
            },
            _pad: [0; 3],
        };
        match w.key {
            PortKey::V4(k) => out.services.insert(k, service),
            PortKey::V6(k) => out.services6.insert(k, service),
        };
    }
    // One line per Service, however many ports and networks it lost.
    for ((ns, name), (ports, what)) in cut {
        let svc = cfg
            .services
            .iter()
            .find(|s| s.namespace == ns && s.name == name)
            .expect("a cut Service is one of the config's");
        let which = if ports.len() <= 4 {
            let list: Vec<String> = ports
                .iter()
                .map(|(p, proto)| format!("{p}/{}", proto_name(*proto)))
                .collect();
            format!("port {}", list.join(", "))
        } else {
            format!("{} of its {} ports", ports.len(), svc.ports.len())
        };
        let (share, cap) = if what == "backends" {
            (backend_share[ns], MAX_SERVICE_BACKENDS)
        } else {
            (port_share[ns], MAX_SERVICES)
        };
        out.problems.push(format!(
            "Service {ns}/{name}: {which} not translated: namespace {ns:?} has its share of the data path's {what} ({share} of {cap})"
        ));
    }
    out
}

/// The backends of Service port `sp` on network `net` of one family
/// (`v4`: IPv4, else IPv6): its ready endpoints there, or, when none is ready, those still serving while
/// they terminate (as kube-proxy falls back); sorted, so slots stay put
/// while the set does.
fn backends_of(
    slices: &[&EndpointSlice],
    sp: &ServicePort,
    net: u32,
    v4: bool,
    on_network: &BTreeMap<IpAddr, Vec<(u32, [u8; 6])>>,
) -> Vec<(IpAddr, u16, [u8; 6])> {
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
            if e.address.is_ipv4() != v4 {
                continue;
            }
            let Some((_, mac)) = on_network
                .get(&e.address)
                .and_then(|v| v.iter().find(|(n, _)| *n == net))
            else {
                continue;
            };
            let b = (e.address, port, *mac);
            if e.ready {
                ready.insert(b);
            } else if e.serving && e.terminating {
                terminating.insert(b);
            }
        }
    }
    let chosen = if ready.is_empty() { terminating } else { ready };
    chosen.into_iter().collect()
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
