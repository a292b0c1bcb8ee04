//! The agent's one netlink stack: rtnetlink on one tokio runtime (a single
//! worker thread), one request connection per network namespace and the
//! link notifications that wake the reconcile loop.
//!
//! A netlink socket belongs to the namespace it was opened in, so the
//! connection is chosen by the calling thread's namespace (the agent has
//! one; the bench drives several from threads).

use std::{
    collections::HashMap,
    future::Future,
    io,
    os::unix::fs::MetadataExt as _,
    sync::{Mutex, OnceLock},
};

use futures_util::StreamExt as _;
use rtnetlink::{
    Handle, MulticastGroup,
    packet_core::NetlinkPayload,
    packet_route::{RouteNetlinkMessage, link::LinkAttribute},
};
use tokio::runtime::Runtime;

/// The rtnetlink protocol number on every route vmpath installs (exports
/// in table 100, node routes in main): how it finds its own routes again
/// and leaves everyone else's alone.
pub const ROUTE_PROTOCOL: u8 = 250;

fn runtime() -> io::Result<&'static Runtime> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("vmpath-netlink")
            .enable_io()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| io::Error::other(format!("netlink runtime: {e}")))
}

/// The calling thread's network namespace (its nsfs inode).
fn netns_id() -> io::Result<u64> {
    Ok(std::fs::metadata("/proc/thread-self/ns/net")?.ino())
}

/// One namespace's request connection, and the lock that gives it to one
/// exchange at a time.
#[derive(Clone)]
struct Connection {
    handle: Handle,
    /// The kernel runs one dump per netlink socket at a time and answers a
    /// second with EBUSY: the status API's filter listing beside the
    /// round's link dump (at 513 ports) failed every round that way. Each
    /// exchange holds this for its whole run; its callers are a few
    /// threads (the round, the API, the slow path), never one inside
    /// another (an exchange is a `block_on`, which cannot nest).
    exclusive: std::sync::Arc<Mutex<()>>,
}

/// The request connection for the calling thread's namespace.
fn connection() -> io::Result<Connection> {
    static CONNECTIONS: OnceLock<Mutex<HashMap<u64, Connection>>> = OnceLock::new();
    let rt = runtime()?;
    let ns = netns_id()?;
    let mut connections = CONNECTIONS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = connections.get(&ns) {
        return Ok(c.clone());
    }
    // The socket is opened here, in this thread's namespace; the runtime
    // only drives it.
    let _ctx = rt.enter();
    let (conn, handle, _) = rtnetlink::new_connection()?;
    rt.spawn(conn);
    let c = Connection {
        handle,
        exclusive: Default::default(),
    };
    connections.insert(ns, c.clone());
    Ok(c)
}

/// Runs one netlink exchange to completion on the shared runtime, alone on
/// its namespace's connection.
pub fn run<T, F: Future<Output = T>>(f: impl FnOnce(Handle) -> F) -> io::Result<T> {
    let c = connection()?;
    let _alone = c.exclusive.lock().unwrap_or_else(|e| e.into_inner());
    Ok(runtime()?.block_on(f(c.handle)))
}

/// What a link notification said, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    New(String),
    Gone(String),
}

/// Calls `on_event` for every link added, changed or removed in the calling
/// thread's namespace, from the runtime's thread, until `on_event` returns
/// false.
pub fn watch_links(mut on_event: impl FnMut(LinkEvent) -> bool + Send + 'static) -> io::Result<()> {
    let rt = runtime()?;
    let _ctx = rt.enter();
    let (conn, _handle, mut messages) =
        rtnetlink::new_multicast_connection(&[MulticastGroup::Link])?;
    rt.spawn(conn);
    rt.spawn(async move {
        while let Some((msg, _)) = messages.next().await {
            let event = match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                    LinkEvent::New(link_name(&l.attributes))
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(l)) => {
                    LinkEvent::Gone(link_name(&l.attributes))
                }
                _ => continue,
            };
            if !on_event(event) {
                break;
            }
        }
    });
    Ok(())
}

fn link_name(attrs: &[LinkAttribute]) -> String {
    attrs
        .iter()
        .find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })
        .unwrap_or_default()
}
