//! What the slow path answers for each port: the VM's lease and its
//! network's options, rebuilt by the agent after every reconcile.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    sync::{Arc, Mutex, RwLock},
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Serialize;

use crate::{
    config::{AttachmentKey, model::Role},
    plan::Plan,
    resolve::resolved::Resolved,
};

/// Per-network settings DHCP, DHCPv6 and RAs hand out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetService {
    pub name: String,
    pub gw_mac: [u8; 6],
    pub gw4: Option<Ipv4Addr>,
    pub gw6: Option<Ipv6Addr>,
    /// The gateway's link-local address: RAs and DHCPv6 replies come from it.
    pub gw_ll6: Ipv6Addr,
    pub mtu: u16,
    pub lease_seconds: u32,
    /// Router option / default route: Primary networks or `dhcp.defaultRoute`.
    pub default_route: bool,
    pub dns4: Vec<Ipv4Addr>,
    pub dns6: Vec<Ipv6Addr>,
    pub search: Vec<String>,
    pub routes4: Vec<(Ipv4Net, Ipv4Addr)>,
    pub prefix6: Option<Ipv6Net>,
}

/// One VM port's lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortService {
    pub ifindex: u32,
    pub key: AttachmentKey,
    /// Handed out as the DHCP hostname.
    pub hostname: String,
    pub mac: Option<[u8; 6]>,
    pub v4: Option<Ipv4Net>,
    pub v6: Option<Ipv6Net>,
    pub net: NetService,
}

pub const DEFAULT_LEASE_SECONDS: u32 = 3600;

/// Port id (the VLAN tag) -> what to answer on that port.
pub type Services = Arc<RwLock<BTreeMap<u16, PortService>>>;

/// Services for the ports this node programmed, on networks vmpath serves.
pub fn build(cfg: &Resolved, plan: &Plan) -> BTreeMap<u16, PortService> {
    let mut out = BTreeMap::new();
    for port in plan.ports.values() {
        let Some(att) = cfg.attachment(&port.attachment) else {
            continue;
        };
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        if !net.ipam {
            // Imported VMs configure themselves: no offers on IPAM-less networks.
            continue;
        }
        let (dns4, dns6) =
            net.dhcp
                .dns_servers
                .iter()
                .fold((Vec::new(), Vec::new()), |(mut a, mut b), ip| {
                    match ip {
                        std::net::IpAddr::V4(v4) => a.push(*v4),
                        std::net::IpAddr::V6(v6) => b.push(*v6),
                    }
                    (a, b)
                });
        let service = NetService {
            name: net.name.clone(),
            gw_mac: net.gateway_mac,
            gw4: net.gateway4(),
            gw6: net.gateway6(),
            gw_ll6: Ipv6Addr::from(vmpath_common::link_local_from_mac(net.gateway_mac)),
            mtu: net.mtu,
            lease_seconds: net.dhcp.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS),
            default_route: net.dhcp.default_route.unwrap_or(net.role == Role::Primary),
            dns4,
            dns6,
            search: net.dhcp.search_domains.clone(),
            routes4: net
                .dhcp
                .routes
                .iter()
                .filter_map(|r| match (r.destination, r.next_hop) {
                    (IpNet::V4(d), std::net::IpAddr::V4(h)) => Some((d, h)),
                    _ => None,
                })
                .collect(),
            prefix6: net.subnets.iter().find_map(|s| match s {
                IpNet::V6(v6) => Some(*v6),
                IpNet::V4(_) => None,
            }),
        };
        let v4 = att.addresses.iter().find_map(|(ip, _)| match ip {
            IpNet::V4(v4) => Some(*v4),
            IpNet::V6(_) => None,
        });
        let v6 = att.addresses.iter().find_map(|(ip, _)| match ip {
            IpNet::V6(v6) => Some(*v6),
            IpNet::V4(_) => None,
        });
        out.insert(
            port.info.port_id as u16,
            PortService {
                ifindex: port.ifindex,
                key: att.key.clone(),
                hostname: att.key.vm.to_string(),
                mac: att.mac_resolved.map(|(m, _)| m),
                v4,
                v6,
                net: service,
            },
        );
    }
    out
}

/// Messages handled and dropped, by kind, for one port or network.
pub use vmpath_api::types::SlowPathCounters as Counters;

#[derive(Debug, Clone, Default, Serialize)]
pub struct SlowStats {
    /// By VM interface (`namespace/vm/interface`).
    pub ports: BTreeMap<String, Counters>,
    /// By network name.
    pub networks: BTreeMap<String, Counters>,
    /// Frames that named no known port or could not be parsed at all.
    pub unattributed_drops: BTreeMap<String, u64>,
}

pub type SharedStats = Arc<Mutex<SlowStats>>;

pub enum Outcome {
    Received,
    Replied,
    Dropped,
}

impl SlowStats {
    pub fn count(&mut self, svc: &PortService, kind: &str, outcome: Outcome) {
        for c in [
            self.ports.entry(svc.key.to_string()).or_default(),
            self.networks.entry(svc.net.name.clone()).or_default(),
        ] {
            let m = match outcome {
                Outcome::Received => &mut c.received,
                Outcome::Replied => &mut c.replied,
                Outcome::Dropped => &mut c.dropped,
            };
            *m.entry(kind.to_string()).or_default() += 1;
        }
    }
}
