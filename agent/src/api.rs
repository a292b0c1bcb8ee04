//! The local admin API: JSON over HTTP on a unix socket that only root can
//! open (mode 0600). `vmpath status|net|vm` (see `cli`) and the DaemonSet's
//! probes talk to it.
//!
//! Endpoints (GET only):
//!   /healthz                  200 while the agent loop is alive
//!   /readyz                   200 once the data path is programmed
//!   /v1/status                node, readiness, counts, config errors,
//!                             reconcile stats, drops by reason
//!   /v1/networks              every valid network
//!   /v1/networks/{name}       one network and its attachments
//!   /v1/vms                   one row per VM interface
//!   /v1/vms/{namespace}/{vm}  every interface of one VM, with counters
//! Unknown paths and names answer 404 with `{"error": "..."}`.

use std::{
    collections::BTreeMap,
    fs, io,
    os::unix::{
        fs::{FileTypeExt as _, PermissionsExt as _},
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use vmpath_common::{PortStats, drop_reason};

use crate::{
    clock,
    config::ConfigError,
    dataplane::Maps,
    view::{AttachmentView, NetworkView, SharedView, View},
};

/// Where an attachment stands as seen from this node.
pub mod state {
    /// Runs here and its port is programmed.
    pub const LOCAL: &str = "local";
    /// Runs on another node.
    pub const REMOTE: &str = "remote";
    /// Should run here, but its port does not exist (yet).
    pub const MISSING_PORT: &str = "missing_port";
    /// A migration is pending (target known, cut-over not signalled).
    pub const MIGRATING: &str = "migrating";
    pub const ALL: [&str; 4] = [LOCAL, REMOTE, MISSING_PORT, MIGRATING];
}

/// The state of `a` on the node of `view`. Exclusive: a pending migration
/// counts as `migrating` whichever side this node is.
pub fn state_of(view: &View, a: &AttachmentView) -> &'static str {
    if a.migration == "pending" {
        state::MIGRATING
    } else if a.node != view.node {
        state::REMOTE
    } else if a.ifindex.is_some() {
        state::LOCAL
    } else {
        state::MISSING_PORT
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub networks: usize,
    pub attachments: usize,
    pub local: usize,
    pub remote: usize,
    pub missing_ports: usize,
    pub migrating: usize,
    pub config_errors: usize,
}

impl Counts {
    pub fn of(view: &View) -> Self {
        let mut c = Counts {
            networks: view.networks.len(),
            attachments: view.attachments.len(),
            config_errors: view.config_errors.len(),
            ..Default::default()
        };
        for a in &view.attachments {
            match state_of(view, a) {
                state::LOCAL => c.local += 1,
                state::REMOTE => c.remote += 1,
                state::MISSING_PORT => c.missing_ports += 1,
                _ => c.migrating += 1,
            }
        }
        c
    }
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    pub ready: bool,
    pub bpffs: String,
    pub config_dir: String,
    pub counts: Counts,
    pub config_errors: Vec<ConfigError>,
    /// Accepted documents with something to look at (a reserved address
    /// used on an IPAM-less network).
    #[serde(default)]
    pub config_warnings: Vec<ConfigError>,
    pub missing_ports: Vec<String>,
    pub problems: Vec<String>,
    pub reconciles: u64,
    pub last_reconcile_seconds: f64,
    pub last_reconcile_unix: u64,
    /// Data-path drops by reason name, summed over CPUs; absent when the
    /// pinned maps cannot be read.
    pub drops: Option<BTreeMap<String, u64>>,
    /// Why the pinned maps could not be read.
    pub dataplane_error: Option<String>,
    /// Attachments refused because their port is not a VM port.
    #[serde(default)]
    pub ineligible_ports: usize,
    /// The running build, its programs and what the pinned links run.
    #[serde(default)]
    pub programs: crate::node_lock::ProgramsStatus,
}

/// `GET /v1/networks`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetworkList {
    pub networks: Vec<NetworkView>,
}

/// `GET /v1/networks/{name}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetworkDetail {
    #[serde(flatten)]
    pub network: NetworkView,
    pub interfaces: Vec<VmRow>,
}

/// One VM interface, as `GET /v1/vms` lists it: the attachment and its
/// state from this node's point of view.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRow {
    #[serde(flatten)]
    pub attachment: AttachmentView,
    /// One of [`state::ALL`].
    pub state: String,
}

impl VmRow {
    fn of(view: &View, a: &AttachmentView) -> Self {
        VmRow {
            attachment: a.clone(),
            state: state_of(view, a).to_string(),
        }
    }
}

/// `GET /v1/vms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmList {
    pub interfaces: Vec<VmRow>,
}

/// A port's counters, summed over CPUs. `rx` is what the VM sent, `tx` what
/// was delivered to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortCounters {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub drops: u64,
    pub gateway_replies: u64,
}

impl From<PortStats> for PortCounters {
    fn from(s: PortStats) -> Self {
        PortCounters {
            rx_packets: s.rx_packets,
            rx_bytes: s.rx_bytes,
            tx_packets: s.tx_packets,
            tx_bytes: s.tx_bytes,
            drops: s.drops,
            gateway_replies: s.gw_replies,
        }
    }
}

/// One interface of a VM, as `GET /v1/vms/{namespace}/{vm}` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InterfaceDetail {
    #[serde(flatten)]
    pub attachment: AttachmentView,
    /// One of [`state::ALL`].
    pub state: String,
    /// Present when the port is programmed on this node.
    pub counters: Option<PortCounters>,
    /// DHCPv4/DHCPv6/RA messages this node's slow path received, answered
    /// and dropped for this interface, by kind.
    #[serde(default)]
    pub dhcp: Option<crate::slowpath::Counters>,
}

/// `GET /v1/vms/{namespace}/{vm}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmDetail {
    pub namespace: String,
    pub vm: String,
    pub interfaces: Vec<InterfaceDetail>,
}

/// Every error body: `{"error": "..."}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

/// Drop counters by reason name.
pub fn drops_by_name(maps: &Maps) -> Result<BTreeMap<String, u64>> {
    let counts = maps.drop_counts()?;
    Ok(drop_reason::NAMES
        .iter()
        .zip(counts)
        .map(|(name, n)| (name.to_string(), n))
        .collect())
}

// --- liveness ---------------------------------------------------------------

static LOOP_EXITED: AtomicBool = AtomicBool::new(false);
static LAST_HEARTBEAT_MS: AtomicU64 = AtomicU64::new(0);

/// Called by the reconcile loop on every round (optional: without any
/// heartbeat, liveness rests on the loop thread running and the shared view
/// being lockable).
pub fn heartbeat() {
    LAST_HEARTBEAT_MS.store(clock::unix_now_ms(), Ordering::Relaxed);
}

/// Marks the reconcile loop as gone (it returned or panicked).
pub fn loop_exited() {
    LOOP_EXITED.store(true, Ordering::Relaxed);
}

/// A heartbeat older than this means the loop is stuck.
const HEARTBEAT_STALE: Duration = Duration::from_secs(60);

fn alive(shared: &SharedView) -> std::result::Result<(), String> {
    if LOOP_EXITED.load(Ordering::Relaxed) {
        return Err("the reconcile loop has exited".into());
    }
    let beat = LAST_HEARTBEAT_MS.load(Ordering::Relaxed);
    if beat != 0 {
        let now = clock::unix_now() * 1000;
        if now.saturating_sub(beat) > HEARTBEAT_STALE.as_millis() as u64 + 1000 {
            return Err(format!(
                "no reconcile round for {} s",
                now.saturating_sub(beat) / 1000
            ));
        }
    }
    // The loop holds the write lock only to swap in a new view: if it cannot
    // be had for seconds, the loop is stuck; if it is poisoned, it panicked.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match shared.try_read() {
            Ok(_) => return Ok(()),
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err("the reconcile loop panicked".into());
            }
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                return Err("the agent's state stayed locked for 2 s".into());
            }
        }
    }
}

// --- routing ----------------------------------------------------------------

/// An answer: status code and JSON body.
pub struct Reply {
    pub code: u16,
    pub body: String,
}

fn json<T: Serialize>(code: u16, value: &T) -> Reply {
    match serde_json::to_string_pretty(value) {
        Ok(body) => Reply { code, body },
        Err(e) => error(500, format!("encoding the answer: {e}")),
    }
}

fn error(code: u16, message: String) -> Reply {
    Reply {
        code,
        body: serde_json::to_string(&ApiError { error: message })
            .unwrap_or_else(|_| "{\"error\":\"?\"}".into()),
    }
}

/// The snapshot a request works on (a clone: the lock is held briefly).
fn snapshot(shared: &SharedView) -> View {
    match shared.read() {
        Ok(v) => v.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

/// Answers one GET. Public so it can be tested without a socket.
pub fn route(shared: &SharedView, bpffs: &Path, path: &str) -> Reply {
    let path = path.split(['?', '#']).next().unwrap_or("");
    let path = if path.len() > 1 {
        path.trim_end_matches('/')
    } else {
        path
    };
    let decoded: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(decode)
        .collect();
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    match parts.as_slice() {
        ["healthz"] => match alive(shared) {
            Ok(()) => json(200, &serde_json::json!({"alive": true})),
            Err(e) => error(503, e),
        },
        ["readyz"] => {
            let view = snapshot(shared);
            if view.ready {
                json(200, &serde_json::json!({"ready": true}))
            } else {
                error(503, "not ready: the data path is not programmed yet".into())
            }
        }
        ["v1", "status"] => json(200, &status(&snapshot(shared), bpffs)),
        ["v1", "networks"] => json(
            200,
            &NetworkList {
                networks: snapshot(shared).networks,
            },
        ),
        ["v1", "networks", name] => {
            let view = snapshot(shared);
            match view.networks.iter().find(|n| n.name == *name) {
                Some(n) => json(
                    200,
                    &NetworkDetail {
                        network: n.clone(),
                        interfaces: view
                            .attachments
                            .iter()
                            .filter(|a| a.network == *name)
                            .map(|a| VmRow::of(&view, a))
                            .collect(),
                    },
                ),
                None => error(404, format!("no network named {name:?}")),
            }
        }
        ["v1", "vms"] => {
            let view = snapshot(shared);
            json(
                200,
                &VmList {
                    interfaces: view
                        .attachments
                        .iter()
                        .map(|a| VmRow::of(&view, a))
                        .collect(),
                },
            )
        }
        ["v1", "vms", namespace, vm] => {
            let view = snapshot(shared);
            let attachments: Vec<&AttachmentView> = view.attachments_of_vm(namespace, vm).collect();
            if attachments.is_empty() {
                return error(404, format!("no VM {namespace}/{vm}"));
            }
            let maps = if attachments.iter().any(|a| a.ifindex.is_some()) {
                Maps::open(bpffs).ok()
            } else {
                None
            };
            let interfaces = attachments
                .into_iter()
                .map(|a| {
                    let state = state_of(&view, a);
                    let counters = match (state, a.ifindex, &maps) {
                        (state::LOCAL, Some(ifindex), Some(maps)) => maps
                            .port_stats(ifindex)
                            .ok()
                            .flatten()
                            .map(PortCounters::from),
                        _ => None,
                    };
                    let key = format!("{}/{}/{}", a.namespace, a.vm, a.interface);
                    let dhcp = crate::slowpath::service::stats()
                        .lock()
                        .unwrap()
                        .ports
                        .get(&key)
                        .cloned();
                    InterfaceDetail {
                        attachment: a.clone(),
                        state: state.to_string(),
                        counters,
                        dhcp,
                    }
                })
                .collect();
            json(
                200,
                &VmDetail {
                    namespace: namespace.to_string(),
                    vm: vm.to_string(),
                    interfaces,
                },
            )
        }
        _ => error(404, format!("no such endpoint: {path}")),
    }
}

/// Percent-decodes one path segment.
fn decode(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status(view: &View, bpffs: &Path) -> Status {
    let (drops, dataplane_error) = match Maps::open(bpffs).and_then(|m| drops_by_name(&m)) {
        Ok(d) => (Some(d), None),
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    Status {
        node: view.node.clone(),
        ready: view.ready,
        bpffs: view.bpffs.clone(),
        config_dir: view.config_dir.clone(),
        counts: Counts::of(view),
        config_errors: view.config_errors.clone(),
        config_warnings: view.config_warnings.clone(),
        missing_ports: view.missing_ports.clone(),
        problems: view.problems.clone(),
        reconciles: view.reconciles,
        last_reconcile_seconds: view.last_reconcile_seconds,
        last_reconcile_unix: view.last_reconcile_unix,
        drops,
        dataplane_error,
        ineligible_ports: crate::port_eligibility::refused_count(),
        programs: crate::node_lock::programs_status(bpffs),
    }
}

// --- server -----------------------------------------------------------------

/// Binds the API socket: creates its directory, replaces a stale socket
/// (refusing to steal one another agent still serves), and leaves it mode
/// 0600 so only root can connect.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating the API socket's directory {}", dir.display()))?;
    }
    match fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.file_type().is_socket() {
                bail!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                );
            }
            if UnixStream::connect(path).is_ok() {
                bail!(
                    "another agent is serving the API on {}; is one already running?",
                    path.display()
                );
            }
            fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    // The socket is created under umask 0177, so it is never connectable by
    // others, not even for the moment before the chmod below. This runs
    // before the agent starts any other thread.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let listener = bound.with_context(|| format!("binding the API socket {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(listener)
}

/// Serves the API on `socket` in its own thread.
pub fn serve(socket: &Path, shared: SharedView, bpffs: PathBuf) -> Result<JoinHandle<()>> {
    let listener = bind(socket)?;
    let server = tiny_http::Server::from_listener(listener, None)
        .map_err(|e| anyhow::anyhow!("starting the API server: {e}"))?;
    info!(socket = %socket.display(), "admin API listening");
    let handle = std::thread::Builder::new()
        .name("api".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let reply = if *request.method() == tiny_http::Method::Get {
                    route(&shared, &bpffs, request.url())
                } else {
                    error(405, format!("method {} not allowed", request.method()))
                };
                respond(request, reply);
            }
        })?;
    Ok(handle)
}

pub(crate) fn respond(request: tiny_http::Request, reply: Reply) {
    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..])
        .expect("a valid header");
    let response = tiny_http::Response::from_string(reply.body)
        .with_status_code(reply.code)
        .with_header(header);
    if let Err(e) = request.respond(response) {
        warn!("answering an API request: {e}");
    }
}
