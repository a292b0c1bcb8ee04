//! The node reaches the endpoints of its Primary networks (kubelet probes,
//! NodePort through kube-proxy), as it reaches pods on any cluster network.
//!
//! For each address of a local endpoint on a `role: Primary` network the
//! agent keeps, in the node's main table, a route `<ip>/32 dev <port> scope
//! link` with its own protocol, and a permanent neighbour entry for it with
//! the endpoint's MAC: the node's frames go straight down the port's veth
//! to the VM, with no ARP or ND the VM would answer into the data path. The
//! VM answers through its gateway; `vm_egress` hands frames for the node's
//! own addresses to the node's stack (`NET_F_HOST_REACH`), and the route
//! here is what makes them pass the node's reverse-path filter.
//!
//! Reach (other nodes' endpoints, `ebpf/src/reach.rs`): with the overlay
//! up, each Primary network's subnets are routed `dev vmp-vxlan` (a NOARP
//! device: no neighbour needed), where `vxlan_from_stack` sends the
//! stack's frames to the node hosting the address. The node's own
//! endpoints' host routes are longer and win.
//!
//! Only routes in the main table with vmpath's protocol are ever touched.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::IpAddr,
};

use futures_util::TryStreamExt as _;
use netlink_packet_route::{
    AddressFamily,
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
        RouteType,
    },
};
use tracing::{info, warn};

use crate::{
    common::{AddrKey, LearnedIp},
    config::model::Role,
    plan::Plan,
    resolve::resolved::Resolved,
    sys::netlink::ROUTE_PROTOCOL as DEFAULT_PROTOCOL,
};

/// The kernel's main routing table.
const MAIN_TABLE: u8 = 254;

/// A prefix the node reaches through an interface: an endpoint's address
/// (full length) down its port, or a Primary network's subnet into the
/// vxlan device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HostRoute {
    pub ip: IpAddr,
    pub len: u8,
    pub ifindex: u32,
}

impl HostRoute {
    /// An endpoint's address down its port.
    fn host(ip: IpAddr, ifindex: u32) -> HostRoute {
        let len = if ip.is_ipv4() { 32 } else { 128 };
        HostRoute { ip, len, ifindex }
    }

    /// A host route (with a permanent neighbour entry), not a subnet's.
    fn is_host(&self) -> bool {
        self.len == if self.ip.is_ipv4() { 32 } else { 128 }
    }
}

/// The addresses of this node's endpoints on Primary networks, with the
/// MAC each is reached at: configured (given or claimed) ones, and on
/// IPAM-less networks the ones learned from the endpoint's traffic. A
/// pending migration target is not reached yet: its source still is.
/// With `reach_dev` (the vxlan device's ifindex, the overlay up), every
/// Primary network's subnets into it, without a neighbour.
pub fn desired(
    cfg: &Resolved,
    plan: &Plan,
    learned: &BTreeMap<AddrKey, LearnedIp>,
    reach_dev: Option<u32>,
) -> BTreeMap<HostRoute, Option<[u8; 6]>> {
    let mut out = BTreeMap::new();
    if let Some(dev) = reach_dev {
        for net in cfg
            .config
            .networks
            .iter()
            .filter(|n| n.role == Role::Primary)
        {
            for s in &net.subnets {
                let s = s.trunc();
                out.insert(
                    HostRoute {
                        ip: s.addr(),
                        len: s.prefix_len(),
                        ifindex: dev,
                    },
                    None,
                );
            }
        }
    }
    for port in plan.ports.values().filter(|p| !p.pending()) {
        // A lookup (in key order), not a pass over every VM interface.
        let Some(att) = cfg.attachment(&port.attachment) else {
            continue;
        };
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        if net.role != Role::Primary {
            continue;
        }
        let mac = port.info.mac;
        for (ip, _) in &att.addresses {
            out.insert(HostRoute::host(ip.addr(), port.ifindex), Some(mac));
        }
        for (key, seen) in learned {
            let link_local = matches!(key.ip(), IpAddr::V6(a) if a.is_unicast_link_local());
            if key.network == net.id && seen.ifindex == port.ifindex && !link_local {
                out.insert(HostRoute::host(key.ip(), port.ifindex), Some(seen.mac));
            }
        }
    }
    out
}

/// Keeps the main table's vmpath routes (and their neighbours) equal to
/// [`desired`].
#[derive(Default)]
pub struct HostReach {
    synced: Option<BTreeMap<HostRoute, Option<[u8; 6]>>>,
}

impl HostReach {
    pub fn tick(&mut self, cfg: &Resolved, plan: &Plan, learned: &BTreeMap<AddrKey, LearnedIp>) {
        let reach_dev = crate::sys::netif::ifindex_of(vmpath_common::VXLAN_IFNAME);
        let want = desired(cfg, plan, learned, reach_dev);
        if self.synced.as_ref() == Some(&want) {
            return;
        }
        match sync(&want) {
            Ok(()) => self.synced = Some(want),
            // Retried next round: `synced` stays as it was.
            Err(e) => warn!("routes from the node to its endpoints: {e} (will retry)"),
        }
    }
}

/// Makes the main table's vmpath routes exactly `want`, each host route
/// with its permanent neighbour entry.
fn sync(want: &BTreeMap<HostRoute, Option<[u8; 6]>>) -> io::Result<()> {
    let have = dump()?;
    for r in have.difference(&want.keys().copied().collect()) {
        let mut del = message(r);
        del.header.scope = RouteScope::NoWhere;
        crate::sys::netlink::run(|h| async move { h.route().del(del).execute().await })?
            .map_err(to_io)?;
        // The neighbour entry goes with it; the port may be gone already.
        let ip = r.ip;
        let ifindex = r.ifindex;
        let _ = r.is_host().then(|| {
            crate::sys::netlink::run(|h| async move {
                let mut msg = netlink_packet_route::neighbour::NeighbourMessage::default();
                msg.header.family = family(ip);
                msg.header.ifindex = ifindex;
                msg.attributes.push(
                    netlink_packet_route::neighbour::NeighbourAttribute::Destination(match ip {
                        IpAddr::V4(a) => a.into(),
                        IpAddr::V6(a) => a.into(),
                    }),
                );
                h.neighbours().del(msg).execute().await
            })
        });
        info!(ip = %r.ip, len = r.len, ifindex = r.ifindex, "route from the node to an endpoint withdrawn");
    }
    for (r, mac) in want {
        if let Some(mac) = *mac {
            let (ip, ifindex) = (r.ip, r.ifindex);
            crate::sys::netlink::run(|h| async move {
                h.neighbours()
                    .add(ifindex, ip)
                    .link_layer_address(&mac)
                    .replace()
                    .execute()
                    .await
            })?
            .map_err(to_io)?;
        }
        if !have.contains(r) {
            let msg = message(r);
            crate::sys::netlink::run(
                |h| async move { h.route().add(msg).replace().execute().await },
            )?
            .map_err(to_io)?;
            info!(ip = %r.ip, len = r.len, ifindex = r.ifindex, "route from the node to an endpoint added");
        }
    }
    Ok(())
}

/// Withdraws every vmpath route from the main table: `vmpath agent
/// --cleanup`. Returns how many.
pub fn withdraw_all() -> io::Result<usize> {
    let have = dump()?;
    sync(&BTreeMap::new())?;
    Ok(have.len())
}

fn family(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn message(r: &HostRoute) -> RouteMessage {
    let (dest, len) = match r.ip {
        IpAddr::V4(a) => (RouteAddress::Inet(a), r.len),
        IpAddr::V6(a) => (RouteAddress::Inet6(a), r.len),
    };
    let mut msg = RouteMessage::default();
    msg.header = RouteHeader {
        address_family: family(r.ip),
        destination_prefix_length: len,
        table: MAIN_TABLE,
        protocol: RouteProtocol::from(DEFAULT_PROTOCOL),
        scope: RouteScope::Link,
        kind: RouteType::Unicast,
        ..Default::default()
    };
    msg.attributes.push(RouteAttribute::Destination(dest));
    msg.attributes.push(RouteAttribute::Oif(r.ifindex));
    msg
}

/// Our routes in the main table.
fn dump() -> io::Result<BTreeSet<HostRoute>> {
    let all: Vec<RouteMessage> = crate::sys::netlink::run(|h| async move {
        h.route()
            .get(RouteMessage::default())
            .execute()
            .try_collect()
            .await
    })?
    .map_err(to_io)?;
    // A dump of every family (the default message's is unspecified).
    Ok(all.iter().filter_map(ours).collect())
}

fn ours(m: &RouteMessage) -> Option<HostRoute> {
    if u8::from(m.header.protocol) != DEFAULT_PROTOCOL || m.header.table != MAIN_TABLE {
        return None;
    }
    let mut ip = None;
    let mut ifindex = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(RouteAddress::Inet(a)) => ip = Some(IpAddr::V4(*a)),
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => ip = Some(IpAddr::V6(*a)),
            RouteAttribute::Oif(i) => ifindex = Some(*i),
            _ => {}
        }
    }
    Some(HostRoute {
        ip: ip?,
        len: m.header.destination_prefix_length,
        ifindex: ifindex?,
    })
}

fn to_io(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io(),
        other => io::Error::other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reach: with the overlay's device, every Primary network's subnets
    /// (both families) are routed into it, no neighbour; a Secondary
    /// network's are not, and without the device nothing is.
    #[test]
    fn the_primary_networks_subnets_go_into_the_vxlan_device_and_nothing_else() {
        let docs = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\n\
             spec: {id: 310, role: Primary, subnets: [10.31.0.0/24, 'fd31::/64'], defaultGatewayIPs: [10.31.0.1, 'fd31::1'], ipam: {mode: Enabled}}\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: red}\n\
             spec: {id: 320, subnets: [10.32.0.0/24], defaultGatewayIPs: [10.32.0.1], ipam: {mode: Enabled}}\n";
        let snap = crate::round::tests::snapshot_of(docs);
        let cfg = Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ));
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        let plan = Plan::default();
        let want = desired(&cfg, &plan, &BTreeMap::new(), Some(7));
        let routes: Vec<String> = want
            .iter()
            .map(|(r, mac)| format!("{}/{} dev {} {mac:?}", r.ip, r.len, r.ifindex))
            .collect();
        assert_eq!(
            routes,
            ["10.31.0.0/24 dev 7 None", "fd31::/64 dev 7 None"],
            "{want:?}"
        );
        assert!(desired(&cfg, &plan, &BTreeMap::new(), None).is_empty());
    }
}
