//! `vmpath monitor`: the data path's drop events, streamed to whoever
//! asks (`GET /v1/monitor`). One thread reads the `vmp_monitor` ring
//! buffer and hands each event, named (reason, endpoint, 5-tuple), to the
//! connected clients whose filter it passes. The data path emits events
//! only while a client is connected (`vmp_monitor_cfg.listeners`) and at
//! most `--monitor-rate` per second per CPU.
//!
//! What clients may cost the agent is bounded: at most [`MAX_CLIENTS`] at
//! once (the next is refused with a message saying so), each with a queue
//! of [`CLIENT_QUEUE`] lines shared with the others (an event is encoded
//! once, whoever gets it) and one thread with a small stack.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc::{Receiver, SyncSender, TrySendError, sync_channel},
    },
};

use anyhow::{Context as _, Result};
use aya::maps::{Array, Map, MapData, RingBuf};
use tracing::warn;
use vmpath_common::{
    MeterLimit, MonitorConfig, MonitorEvent, NO_PORT_ID, addr_family, drop_reason, ip_proto,
    map_names, monitor_kind,
};

use crate::publish::view::{Published, View};

/// Events one client may have queued before further ones are counted as
/// lost for it (a slow reader never slows the others or the agent). The
/// queue's slots are allocated when the client connects: 1,024 pointers
/// (24 KiB), where 4,096 whole events took 1.2 MiB a client.
pub const CLIENT_QUEUE: usize = 1024;

/// Clients connected at once; the next is refused until one leaves
/// (docs/operations.md, Monitor).
pub const MAX_CLIENTS: usize = 16;

/// The stack of a client's streaming thread: it only moves encoded lines
/// to its socket.
pub const CLIENT_STACK: usize = 128 * 1024;

/// One event encoded as a JSON line, shared by every client it goes to.
pub type Line = Arc<[u8]>;

/// Default events per second per CPU.
pub const DEFAULT_RATE: u32 = 1000;

/// One event as clients get it (a JSON line each).
pub use vmpath_api::types::MonitorEvent as Event;

/// What a client asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only events of this type (`drop` or `policy`).
    pub kind: Option<String>,
    /// Only events of this VM (`namespace/vm`).
    pub vm: Option<String>,
}

impl Filter {
    /// From the query string of `GET /v1/monitor?type=drop&vm=ns/vm`.
    pub fn from_query(query: &str) -> Result<Filter, String> {
        let mut f = Filter::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = vmpath_api::path::decode(v);
            match k {
                "type" if v == "drop" || v == "policy" => f.kind = Some(v),
                "type" => return Err(format!("type {v:?}: expected drop or policy")),
                "vm" if v.split('/').count() == 2 && !v.starts_with('/') && !v.ends_with('/') => {
                    f.vm = Some(v)
                }
                "vm" => return Err(format!("vm {v:?}: expected NAMESPACE/VM")),
                _ => return Err(format!("unknown parameter {k:?} (type, vm)")),
            }
        }
        Ok(f)
    }

    fn passes(&self, e: &Event) -> bool {
        self.kind.as_ref().is_none_or(|k| *k == e.kind)
            && self.vm.as_ref().is_none_or(|vm| {
                e.endpoint
                    .as_ref()
                    .is_some_and(|ep| ep.starts_with(&format!("{vm}/")))
            })
    }
}

struct Client {
    id: u64,
    filter: Filter,
    tx: SyncSender<Line>,
    lost: Arc<AtomicU64>,
}

/// The connected clients and the data path's switch for them.
pub struct Hub {
    bpffs: PathBuf,
    rate: u32,
    clients: Mutex<Vec<Client>>,
    next_id: AtomicU64,
}

/// A connected client's end: events arrive on `rx`; dropping it
/// disconnects (and switches the data path off with the last one).
pub struct Subscription {
    hub: Arc<Hub>,
    id: u64,
    pub rx: Receiver<Line>,
    /// Events this client missed because its queue was full.
    pub lost: Arc<AtomicU64>,
}

impl Subscription {
    /// The next event as a JSON line; an empty line when none came within
    /// `wait` (so a writer notices a client that has gone); `None` once
    /// the hub is gone.
    pub fn next_line(&self, wait: std::time::Duration) -> Option<Line> {
        match self.rx.recv_timeout(wait) {
            Ok(line) => Some(line),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Some(Arc::from(&b"\n"[..])),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => None,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        {
            // Switched under the lock: clients leaving at once would
            // otherwise write their counts out of order, the last write
            // a stale one (the data path reporting to nobody).
            let mut clients = self.hub.clients.lock().unwrap_or_else(|e| e.into_inner());
            clients.retain(|c| c.id != self.id);
            self.hub.switch(clients.len());
        }
        // The queue goes now (both ends are gone), not after this
        // returns: then its pages and lines go back to the kernel rather
        // than a crowd's worth staying after it has gone.
        let (_, none) = sync_channel(0);
        drop(std::mem::replace(&mut self.rx, none));
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free pages to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Why a client was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl Hub {
    pub fn new(bpffs: &Path, rate: u32) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            bpffs: bpffs.to_path_buf(),
            rate,
            clients: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
        });
        // A previous agent's listeners are gone with it.
        hub.switch(0);
        hub
    }

    /// Registers a client, unless [`MAX_CLIENTS`] are connected.
    pub fn subscribe(self: &Arc<Self>, filter: Filter) -> Result<Subscription, Refused> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let lost = Arc::new(AtomicU64::new(0));
        let rx = {
            let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
            if clients.len() >= MAX_CLIENTS {
                return Err(Refused(format!(
                    "too many monitor clients: {} are connected, the most this agent serves; \
                     try again when one has left",
                    clients.len()
                )));
            }
            let (tx, rx) = sync_channel(CLIENT_QUEUE);
            clients.push(Client {
                id,
                filter,
                tx,
                lost: lost.clone(),
            });
            self.switch(clients.len());
            rx
        };
        Ok(Subscription {
            hub: self.clone(),
            id,
            rx,
            lost,
        })
    }

    /// Clients connected now.
    pub fn clients(&self) -> usize {
        self.clients.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Tells the data path how many listen (0: emit nothing).
    fn switch(&self, listeners: usize) {
        let cfg = MonitorConfig {
            listeners: listeners as u32,
            _pad: 0,
            limit: MeterLimit::new(self.rate, self.rate.div_ceil(10).max(1)),
        };
        let path = crate::apply::dataplane::maps_dir(&self.bpffs).join(map_names::MONITOR_CFG);
        let write = || -> Result<()> {
            let data = MapData::from_pin(&path)?;
            let mut map: Array<MapData, MonitorConfig> = Map::from_map_data(data)?.try_into()?;
            map.set(0, cfg, 0)?;
            Ok(())
        };
        if let Err(e) = write() {
            // Before the first load there is nothing to switch.
            if listeners > 0 {
                warn!("switching the monitor on in {}: {e:#}", path.display());
            }
        }
    }

    fn publish(&self, event: &Event) {
        let clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let mut line: Option<Line> = None;
        for c in clients.iter().filter(|c| c.filter.passes(event)) {
            // Encoded once, for the first client that wants it.
            let line = match &line {
                Some(l) => l.clone(),
                None => {
                    let Ok(mut bytes) = serde_json::to_vec(event) else {
                        return;
                    };
                    bytes.push(b'\n');
                    line.insert(Line::from(bytes)).clone()
                }
            };
            if let Err(TrySendError::Full(_)) = c.tx.try_send(line) {
                c.lost.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Starts the thread that reads the ring buffer, once the data path is
    /// loaded (its pinned `vmp_monitor` exists).
    pub fn start_reader(self: &Arc<Self>, shared: Arc<Published>) -> Result<()> {
        let path = crate::apply::dataplane::maps_dir(&self.bpffs).join(map_names::MONITOR);
        let data =
            MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
        let mut ring: RingBuf<MapData> = Map::from_map_data(data)?.try_into()?;
        let hub = self.clone();
        std::thread::Builder::new()
            .name("vmpath-monitor".into())
            .spawn(move || {
                // Duplicated: draining needs `ring` mutably while the
                // loop waits on its fd.
                let fd = match ring.as_fd().try_clone_to_owned() {
                    Ok(fd) => fd,
                    Err(e) => return warn!("monitor: {e}; no monitor events"),
                };
                crate::sys::ring_wait::drain_when_readable(fd.as_fd(), "monitor", || {
                    let view = shared.view();
                    while let Some(item) = ring.next() {
                        if item.len() < size_of::<MonitorEvent>() {
                            continue;
                        }
                        // SAFETY: the record holds at least one `MonitorEvent`
                        // (checked), a plain-data type; read unaligned.
                        let raw: MonitorEvent =
                            unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) };
                        hub.publish(&describe(&raw, &view));
                    }
                });
            })
            .context("starting the monitor reader")?;
        Ok(())
    }
}

/// Names what the kernel reported.
pub fn describe(raw: &MonitorEvent, view: &View) -> Event {
    // A port here is a row that may be on this node (another node's is
    // not made to be read).
    let endpoint = view
        .maybe_on_node()
        .find(|a| a.ifindex == Some(raw.ifindex) && a.node == view.node)
        .map(|a| format!("{}/{}/{}", a.namespace, a.vm, a.interface));
    let (src, dst) = match raw.family {
        addr_family::IPV4 => {
            let v4 = |b: &[u8; 16]| Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string();
            (Some(v4(&raw.src)), Some(v4(&raw.dst)))
        }
        addr_family::IPV6 => (
            Some(Ipv6Addr::from(raw.src).to_string()),
            Some(Ipv6Addr::from(raw.dst).to_string()),
        ),
        _ => (None, None),
    };
    let has_ports = raw.family != 0
        && (raw.proto == ip_proto::TCP || raw.proto == ip_proto::UDP || raw.proto == 132);
    Event {
        kind: match raw.kind {
            monitor_kind::DROP => "drop".into(),
            monitor_kind::POLICY => "policy".into(),
            k => format!("kind{k}"),
        },
        reason: if raw.kind == monitor_kind::POLICY && raw.reason == 0 {
            "allowed".into()
        } else {
            drop_reason::NAMES
                .get(raw.reason as usize)
                .map_or_else(|| format!("reason{}", raw.reason), |n| n.to_string())
        },
        direction: (raw.kind == monitor_kind::POLICY).then(|| {
            if raw.direction == vmpath_common::policy_dir::INGRESS {
                "ingress".into()
            } else {
                "egress".into()
            }
        }),
        policy: (raw.kind == monitor_kind::POLICY)
            .then(|| view.policies.get(raw.policy as usize).cloned())
            .flatten(),
        endpoint,
        ifindex: raw.ifindex,
        port_id: (raw.port_id != NO_PORT_ID).then_some(raw.port_id),
        proto: (raw.family != 0).then(|| match raw.proto {
            ip_proto::ICMP => "icmp".into(),
            ip_proto::ICMPV6 => "icmpv6".into(),
            ip_proto::TCP => "tcp".into(),
            ip_proto::UDP => "udp".into(),
            p => p.to_string(),
        }),
        src,
        dst,
        sport: has_ports.then_some(raw.sport),
        dport: has_ports.then_some(raw.dport),
        src_mac: crate::config::format_mac(&raw.src_mac),
        dst_mac: crate::config::format_mac(&raw.dst_mac),
        ether_type: format!("{:#06x}", raw.ether_type),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw() -> MonitorEvent {
        let mut e = MonitorEvent {
            kind: monitor_kind::DROP,
            family: addr_family::IPV4,
            proto: ip_proto::UDP,
            reason: drop_reason::IP_SPOOF,
            ifindex: 7,
            port_id: 3,
            sport: 5353,
            dport: 53,
            ether_type: 0x0800,
            src_mac: [0x52, 0x54, 0, 0, 1, 1],
            ..MonitorEvent::default()
        };
        e.src[..4].copy_from_slice(&[10, 20, 0, 99]);
        e.dst[..4].copy_from_slice(&[10, 20, 0, 12]);
        e
    }

    #[test]
    fn an_event_is_named_reason_endpoint_and_five_tuple() {
        let view = crate::publish::view::sample::view();
        let a = view.attachments[0].view();
        let mut r = raw();
        r.ifindex = a.ifindex.expect("sample has an ifindex");
        let e = describe(&r, &view);
        assert_eq!(e.reason, "ip_spoof");
        assert_eq!(
            e.endpoint.as_deref(),
            Some(format!("{}/{}/{}", a.namespace, a.vm, a.interface).as_str())
        );
        assert_eq!(e.proto.as_deref(), Some("udp"));
        assert_eq!(
            (e.src.as_deref(), e.dst.as_deref()),
            (Some("10.20.0.99"), Some("10.20.0.12"))
        );
        assert_eq!((e.sport, e.dport), (Some(5353), Some(53)));
        assert_eq!(e.ether_type, "0x0800");
    }

    #[test]
    fn a_frame_without_ip_has_no_tuple_and_no_port_means_none() {
        let mut r = raw();
        r.family = 0;
        r.port_id = NO_PORT_ID;
        let e = describe(&r, &View::default());
        assert_eq!(
            (e.src, e.proto, e.sport, e.port_id, e.endpoint),
            (None, None, None, None, None)
        );
    }

    #[test]
    fn past_the_maximum_a_client_is_refused_until_one_leaves() {
        let hub = Hub::new(Path::new("/nonexistent/vmpath-test-bpffs"), DEFAULT_RATE);
        let mut subs: Vec<Subscription> = (0..MAX_CLIENTS)
            .map(|_| hub.subscribe(Filter::default()).expect("under the maximum"))
            .collect();
        let Err(Refused(why)) = hub.subscribe(Filter::default()) else {
            panic!("client {} taken", MAX_CLIENTS + 1);
        };
        assert!(why.contains("too many monitor clients"), "{why}");
        subs.pop();
        assert_eq!(hub.clients(), MAX_CLIENTS - 1);
        subs.push(hub.subscribe(Filter::default()).expect("one left"));
        // An event is encoded once and shared.
        hub.publish(&describe(&raw(), &View::default()));
        let a = subs[0].next_line(std::time::Duration::ZERO).unwrap();
        let b = subs[1].next_line(std::time::Duration::ZERO).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(a.ends_with(b"\n"));
    }

    #[test]
    fn filters_take_type_and_vm_and_refuse_the_rest() {
        let f = Filter::from_query("type=drop&vm=prod/vm1").unwrap();
        assert_eq!(f.vm.as_deref(), Some("prod/vm1"));
        let mut e = describe(&raw(), &View::default());
        assert!(!f.passes(&e), "no endpoint: not prod/vm1's");
        e.endpoint = Some("prod/vm1/eth0".into());
        assert!(f.passes(&e));
        e.endpoint = Some("prod/vm10/eth0".into());
        assert!(!f.passes(&e), "prefix of another VM's name");
        assert!(
            Filter::from_query("type=bogus")
                .unwrap_err()
                .contains("drop or policy")
        );
        assert!(
            Filter::from_query("vm=prod")
                .unwrap_err()
                .contains("NAMESPACE/VM")
        );
        assert!(
            Filter::from_query("x=1")
                .unwrap_err()
                .contains("unknown parameter")
        );
    }
}
