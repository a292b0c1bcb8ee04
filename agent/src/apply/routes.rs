//! Routes for the node's BGP speaker (docs/operations.md, "Route export").
//!
//! The agent does not speak BGP. It writes what it wants advertised into a
//! dedicated kernel table (default 100) with its own protocol number
//! (default 250): per-VM /32 and /128 as `dev lo` routes, whole subnets as
//! blackhole routes. Nothing points an `ip rule` at that table, so
//! forwarding is unaffected; BIRD learns the table and exports only routes
//! whose `krt_source` is our protocol.
//!
//! Only routes in our table with our protocol are ever touched: each sync
//! dumps them, adds what is missing and withdraws what is no longer wanted.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt, io,
    net::IpAddr,
};

use futures_util::TryStreamExt as _;
use ipnet::IpNet;
use netlink_packet_route::{
    AddressFamily,
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
        RouteType,
    },
};
use tracing::info;

use crate::{
    common::{AddrKey, LearnedIp},
    plan::Plan,
    resolve::resolved::Resolved,
};

pub const DEFAULT_TABLE: u32 = 100;
pub use crate::sys::netlink::ROUTE_PROTOCOL as DEFAULT_PROTOCOL;
/// `RT_TABLE_COMPAT`: the header's table byte when the id needs the attribute.
const RT_TABLE_COMPAT: u8 = 252;

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("netlink socket: {0}")]
    Io(#[from] io::Error),
    #[error("kernel refused to {op} route {route}: {err}")]
    Refused {
        op: &'static str,
        route: ExportRoute,
        err: io::Error,
    },
    #[error("route dump failed: {0}")]
    Dump(io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RouteKind {
    /// A VM's address: `dev lo`.
    Host,
    /// A whole subnet: blackhole.
    Blackhole,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExportRoute {
    pub dest: IpNet,
    pub kind: RouteKind,
}

impl fmt::Display for ExportRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            RouteKind::Host => write!(f, "{} dev lo", self.dest),
            RouteKind::Blackhole => write!(f, "blackhole {}", self.dest),
        }
    }
}

fn host(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

/// What this node should advertise: the configured (given or claimed)
/// addresses of attachments served here on `advertise.perVM` networks,
/// the addresses learned from their traffic here on `advertise.learned`
/// networks, and the subnets of `advertise.subnet` networks this node
/// hosts (`Plan::ingress_hosted`: ingress for VMs elsewhere goes on over
/// the overlay). SNAT networks advertise both families, as routed ones.
pub fn desired(
    cfg: &Resolved,
    plan: &Plan,
    learned: &BTreeMap<AddrKey, LearnedIp>,
) -> BTreeSet<ExportRoute> {
    use crate::plan::north_south::ingress_family;
    let mut out = BTreeSet::new();
    for net in &cfg.config.networks {
        if net.advertise.subnet && plan.ingress_hosted.contains(&net.id) {
            for s in &net.subnets {
                if ingress_family(net, s.addr()) {
                    out.insert(ExportRoute {
                        dest: s.trunc(),
                        kind: RouteKind::Blackhole,
                    });
                }
            }
        }
    }
    // A pending migration target is not advertised: the source still is.
    for port in plan.ports.values().filter(|p| !p.pending()) {
        // A lookup (in key order), not a pass over every VM interface.
        let Some(att) = cfg.attachment(&port.attachment) else {
            continue;
        };
        let Some(net) = cfg.network(&att.network) else {
            continue;
        };
        if net.advertise.per_vm {
            for (ip, _) in &att.addresses {
                if ingress_family(net, ip.addr()) {
                    out.insert(ExportRoute {
                        dest: host(ip.addr()),
                        kind: RouteKind::Host,
                    });
                }
            }
        }
        if net.advertise.learned {
            for (key, seen) in learned {
                if key.network != net.id || seen.ifindex != port.ifindex {
                    continue;
                }
                let ip = key.ip();
                if ingress_family(net, ip) {
                    out.insert(ExportRoute {
                        dest: host(ip),
                        kind: RouteKind::Host,
                    });
                }
            }
        }
    }
    out
}

/// Owns the routes of one (table, protocol), over the agent's netlink
/// stack ([`crate::sys::netlink`]).
pub struct RouteExporter {
    table: u32,
    protocol: u8,
    lo_ifindex: u32,
}

/// A kernel refusal as the errno it carries.
fn to_io(e: rtnetlink::Error) -> io::Error {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io(),
        other => io::Error::other(other.to_string()),
    }
}

impl RouteExporter {
    pub fn new(table: u32, protocol: u8) -> Result<Self, RouteError> {
        let lo_ifindex = crate::sys::netif::ifindex_of("lo").unwrap_or(1);
        Ok(RouteExporter {
            table,
            protocol,
            lo_ifindex,
        })
    }

    /// Makes the table hold exactly `want`; returns (added, withdrawn).
    pub fn sync(&mut self, want: &BTreeSet<ExportRoute>) -> Result<(usize, usize), RouteError> {
        let have = self.dump()?;
        let mut added = 0;
        let mut withdrawn = 0;
        for r in have.difference(want) {
            // Scope "nowhere" matches a route of any scope (one added by
            // hand or by an older agent may not be Universe).
            let mut del = self.message(r);
            del.header.scope = RouteScope::NoWhere;
            crate::sys::netlink::run(|h| async move { h.route().del(del).execute().await })?
                .map_err(|e| RouteError::Refused {
                    op: "withdraw",
                    route: *r,
                    err: to_io(e),
                })?;
            info!(route = %r, table = self.table, "route withdrawn");
            withdrawn += 1;
        }
        for r in want.difference(&have) {
            let msg = self.message(r);
            crate::sys::netlink::run(
                |h| async move { h.route().add(msg).replace().execute().await },
            )?
            .map_err(|e| RouteError::Refused {
                op: "add",
                route: *r,
                err: to_io(e),
            })?;
            info!(route = %r, table = self.table, "route added");
            added += 1;
        }
        Ok((added, withdrawn))
    }

    /// Withdraws every route of this (table, protocol), and nothing else:
    /// `vmpath agent --cleanup`. Acts on the calling thread's network
    /// namespace, so run it in the node's own.
    pub fn withdraw_all(&mut self) -> Result<usize, RouteError> {
        self.sync(&BTreeSet::new()).map(|(_, withdrawn)| withdrawn)
    }

    fn message(&self, r: &ExportRoute) -> RouteMessage {
        let (family, dest) = match r.dest.addr() {
            IpAddr::V4(a) => (AddressFamily::Inet, RouteAddress::Inet(a)),
            IpAddr::V6(a) => (AddressFamily::Inet6, RouteAddress::Inet6(a)),
        };
        let mut msg = RouteMessage::default();
        msg.header = RouteHeader {
            address_family: family,
            destination_prefix_length: r.dest.prefix_len(),
            table: u8::try_from(self.table).unwrap_or(RT_TABLE_COMPAT),
            protocol: RouteProtocol::from(self.protocol),
            scope: RouteScope::Universe,
            kind: match r.kind {
                RouteKind::Host => RouteType::Unicast,
                RouteKind::Blackhole => RouteType::BlackHole,
            },
            ..Default::default()
        };
        msg.attributes.push(RouteAttribute::Destination(dest));
        msg.attributes.push(RouteAttribute::Table(self.table));
        if r.kind == RouteKind::Host {
            msg.attributes.push(RouteAttribute::Oif(self.lo_ifindex));
        }
        msg
    }

    /// Our routes currently in the table (a dump of every family).
    fn dump(&mut self) -> Result<BTreeSet<ExportRoute>, RouteError> {
        let all: Vec<RouteMessage> = crate::sys::netlink::run(|h| async move {
            h.route()
                .get(RouteMessage::default())
                .execute()
                .try_collect()
                .await
        })
        .map_err(RouteError::Dump)?
        .map_err(|e| RouteError::Dump(to_io(e)))?;
        Ok(all
            .iter()
            .filter_map(|m| ours(m, self.table, self.protocol))
            .collect())
    }
}

/// The route as ours when it is in our table with our protocol.
fn ours(m: &RouteMessage, table: u32, protocol: u8) -> Option<ExportRoute> {
    if u8::from(m.header.protocol) != protocol {
        return None;
    }
    let mut t = u32::from(m.header.table);
    let mut dest = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(x) => t = *x,
            RouteAttribute::Destination(RouteAddress::Inet(a)) => dest = Some(IpAddr::V4(*a)),
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => dest = Some(IpAddr::V6(*a)),
            _ => {}
        }
    }
    if t != table {
        return None;
    }
    let dest = match (dest, m.header.address_family) {
        (Some(d), _) => d,
        (None, AddressFamily::Inet) => IpAddr::from([0u8; 4]),
        (None, _) => IpAddr::from([0u8; 16]),
    };
    let dest = IpNet::new(dest, m.header.destination_prefix_length).ok()?;
    Some(ExportRoute {
        dest,
        kind: if m.header.kind == RouteType::BlackHole {
            RouteKind::Blackhole
        } else {
            RouteKind::Host
        },
    })
}

/// The agent loop's north-south duties: keep the uplink program attached
/// to `--uplink` (which may appear or be re-created at any time) and the
/// route table in step with the applied plan.
#[derive(Default)]
pub struct NorthSouth {
    exporter: Option<RouteExporter>,
    exported: Option<BTreeSet<ExportRoute>>,
    host_reach: crate::apply::host_reach::HostReach,
    handoff: crate::plan::handoff::Handoff,
    uplink: Option<u32>,
    warned_uplink: bool,
    ports_reserved: bool,
    last_sweep: Option<std::time::Instant>,
    /// When the ports XDP may deliver to were last asked of the kernel.
    xdp_checked: Option<std::time::Instant>,
}

impl NorthSouth {
    pub fn tick(
        &mut self,
        dp: &mut crate::apply::dataplane::Dataplane,
        uplink: &str,
        cfg: &Resolved,
        applied: Option<&Plan>,
        learned: &BTreeMap<AddrKey, LearnedIp>,
    ) {
        let ifindex = crate::sys::netif::ifindex_of(uplink);
        if ifindex != self.uplink {
            match ifindex {
                Some(i) => match dp.attach_uplink(uplink, i) {
                    Ok(()) => {
                        self.uplink = Some(i);
                        self.warned_uplink = false;
                    }
                    Err(e) => tracing::error!("uplink {uplink}: {e:#}"),
                },
                None => {
                    if !self.warned_uplink {
                        tracing::warn!(
                            uplink,
                            "uplink interface not present: no routed ingress or SNAT return yet"
                        );
                        self.warned_uplink = true;
                    }
                    self.uplink = None;
                }
            }
        }
        let Some(plan) = applied else {
            return;
        };
        if self
            .xdp_checked
            .is_none_or(|t| t.elapsed() >= crate::apply::dataplane::XDP_PORTS_RECHECK)
        {
            if let Err(e) = dp.refresh_xdp_ports(plan) {
                tracing::warn!("listing the ports uplink XDP delivers to: {e:#}");
            }
            self.xdp_checked = Some(std::time::Instant::now());
        }
        if !self.ports_reserved {
            match crate::apply::snat::reserve_ports(plan.snat.port_min, plan.snat.port_max) {
                Ok(()) => self.ports_reserved = true,
                Err(e) => tracing::warn!("reserving the SNAT port range: {e}"),
            }
        }
        if self
            .last_sweep
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(5))
        {
            crate::apply::snat::sweep(dp.maps_mut());
            self.last_sweep = Some(std::time::Instant::now());
        }
        self.host_reach.tick(cfg, plan, learned);
        self.handoff.tick(cfg);
        let want = desired(cfg, plan, learned);
        if self.exported.as_ref() == Some(&want) {
            return;
        }
        if self.exporter.is_none() {
            match RouteExporter::new(DEFAULT_TABLE, DEFAULT_PROTOCOL) {
                Ok(e) => self.exporter = Some(e),
                Err(e) => {
                    tracing::error!("route export unavailable: {e}");
                    return;
                }
            }
        }
        let exporter = self.exporter.as_mut().expect("just set");
        match exporter.sync(&want) {
            Ok(_) => self.exported = Some(want),
            Err(e) => {
                tracing::error!("route export failed (will retry): {e}");
                // A fresh socket next time, in case this one is wedged.
                self.exporter = None;
            }
        }
    }
}
