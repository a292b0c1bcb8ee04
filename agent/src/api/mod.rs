//! The local admin API: JSON over HTTP on a unix socket that only root can
//! open (mode 0600). `vmpath status|net|vm` (see `cli`) and the DaemonSet's
//! probes talk to it.
//!
//! The node service beside the round, with what it serves from:
//!
//! | module | what |
//! |---|---|
//! | [`endpoints`] | the CNI plugin's hand-off: its ports, which the read stage takes in, and the ADD's answer |
//! | [`snapshot`] | what the API and metrics read: the published view and the data path's counters |
//! | [`forwarding`] | forwarding off in the node's namespace: watched, logged, reported in the status |
//!
//! Endpoints (GET only; `/v1/endpoints`, the CNI plugin's, is in
//! `endpoints`):
//!   /healthz                  200 while the agent loop is alive
//!   /readyz                   200 once the data path is programmed
//!   /v1/status                node, readiness, counts, config errors,
//!                             reconcile stats, drops by reason
//!   /v1/networks              every valid network
//!   /v1/networks/{name}       one network and its attachments
//!   /v1/vms                   one row per VM interface
//!   /v1/vms/{namespace}/{vm}  every interface of one VM, with counters
//! Unknown paths and names answer 404 with `{"error": "..."}`.

pub mod endpoints;
pub mod forwarding;
pub mod snapshot;

use std::{
    collections::BTreeMap,
    fs,
    io::{self, Write as _},
    os::unix::{
        fs::{FileTypeExt as _, PermissionsExt as _},
        net::{UnixListener, UnixStream},
    },
    path::Path,
    sync::Arc,
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde::Serialize;
use tracing::{info, warn};
use vmpath_common::drop_reason;

use crate::{
    api::snapshot::{Observer, Snapshot},
    publish::view::{AttachmentView, View, state},
};

/// The answers' types (one home for the agent, the CLI and the plugin).
pub use vmpath_api::types::{
    ApiError, Counts, InterfaceDetail, NetworkDetail, NetworkList, PortCounters, Status, VmDetail,
    VmList, VmRow,
};

/// How many attachments stand in each state on this view's node.
pub fn counts(view: &View) -> Counts {
    let mut c = Counts {
        networks: view.networks.len(),
        attachments: view.attachments.len(),
        config_errors: view.config_errors.len(),
        ..Default::default()
    };
    for row in view.attachments.rows() {
        match view.state_of_row(row) {
            state::LOCAL => c.local += 1,
            state::REMOTE => c.remote += 1,
            state::MISSING_PORT => c.missing_ports += 1,
            _ => c.migrating += 1,
        }
    }
    c
}

fn vm_row(view: &View, a: &AttachmentView) -> VmRow {
    VmRow {
        attachment: a.clone(),
        state: view.state_of(a).to_string(),
    }
}

/// Drop counters by reason name.
pub fn drops_by_name(counts: &[u64]) -> BTreeMap<String, u64> {
    drop_reason::NAMES
        .iter()
        .zip(counts)
        .map(|(name, n)| (name.to_string(), *n))
        .collect()
}

// --- routing ----------------------------------------------------------------

pub use vmpath_api::types::Reply;

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

/// Answers one GET. Public so it can be tested without a socket.
pub fn route(observer: &Observer, path: &str) -> Reply {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let path = path.split('#').next().unwrap_or("");
    let query = query.split('#').next().unwrap_or("");
    let path = if path.len() > 1 {
        path.trim_end_matches('/')
    } else {
        path
    };
    let decoded: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(vmpath_api::path::decode)
        .collect();
    let parts: Vec<&str> = decoded.iter().map(String::as_str).collect();
    match parts.as_slice() {
        ["healthz"] => match observer.published().alive() {
            // The published view's number: what `status.json` catches up
            // to (View::generation).
            Ok(()) => json(
                200,
                &serde_json::json!({"alive": true, "generation": observer.view().generation}),
            ),
            Err(e) => error(503, e),
        },
        ["readyz"] => {
            if observer.view().ready {
                json(200, &serde_json::json!({"ready": true}))
            } else {
                error(503, "not ready: the data path is not programmed yet".into())
            }
        }
        ["v1", "status"] => json(200, &status(&observer.snapshot())),
        ["v1", "networks"] => json(
            200,
            &NetworkList {
                networks: observer.view().networks.clone(),
            },
        ),
        ["v1", "networks", name] => {
            let view = observer.view();
            // `?interfaces=false`: the network alone. The CNI plugin asks
            // so on every ADD: the rows are every VM interface of the
            // network, cluster-wide.
            let rows = !query.split('&').any(|q| q == "interfaces=false");
            match view.networks.iter().find(|n| n.name == *name) {
                Some(n) => json(
                    200,
                    &NetworkDetail {
                        network: n.clone(),
                        // Filtered before a row is made: another node's
                        // row is made only when it is shown.
                        interfaces: view
                            .attachments
                            .rows()
                            .filter(|r| rows && r.network() == *name)
                            .map(|r| vm_row(&view, &r.view()))
                            .collect(),
                    },
                ),
                // Before the first round the agent knows no network yet:
                // "not found" would be a permanent answer (the CNI plugin
                // turns it into "invalid network config"), so ask to retry.
                None if !view.ready => error(
                    503,
                    format!(
                        "the agent is starting: no view of its networks yet, network {name:?} not known so far"
                    ),
                ),
                None => error(404, format!("no network named {name:?}")),
            }
        }
        ["v1", "vms"] => {
            let view = observer.view();
            json(
                200,
                &VmList {
                    interfaces: view.attachments.iter().map(|a| vm_row(&view, &a)).collect(),
                },
            )
        }
        ["v1", "vms", namespace, vm] => {
            let snap = observer.snapshot();
            let view = &snap.view;
            let attachments: Vec<_> = view.attachments_of_vm(namespace, vm).collect();
            if attachments.is_empty() {
                return error(404, format!("no VM {namespace}/{vm}"));
            }
            let interfaces = attachments
                .into_iter()
                .map(|a| {
                    let state = view.state_of(&a);
                    let counters = match (state, a.ifindex, &snap.dataplane) {
                        (state::LOCAL, Some(ifindex), Ok(dp)) => {
                            dp.ports.get(&ifindex).copied().map(PortCounters::from)
                        }
                        _ => None,
                    };
                    let slowpath_rate_limited = match (state, a.ifindex, &snap.dataplane) {
                        (state::LOCAL, Some(ifindex), Ok(dp)) => {
                            dp.rate_limited.get(&ifindex).map(|by_class| {
                                vmpath_common::slow_class::NAMES
                                    .iter()
                                    .zip(by_class)
                                    .map(|(name, n)| (name.to_string(), *n))
                                    .collect()
                            })
                        }
                        _ => None,
                    };
                    let key = format!("{}/{}/{}", a.namespace, a.vm, a.interface);
                    let dhcp = snap.slow.ports.get(&key).cloned();
                    InterfaceDetail {
                        attachment: a.into_owned(),
                        state: state.to_string(),
                        counters,
                        dhcp,
                        slowpath_rate_limited,
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

fn status(snap: &Snapshot) -> Status {
    let view = &snap.view;
    let (drops, dataplane_error) = match snap.dataplane.as_ref().map(|dp| &dp.drops) {
        Ok(Ok(counts)) => (Some(drops_by_name(counts)), None),
        Ok(Err(e)) | Err(e) => (None, Some(e.clone())),
    };
    Status {
        node: view.node.clone(),
        ready: view.ready,
        bpffs: view.bpffs.clone(),
        config_dir: view.config_dir.clone(),
        counts: counts(view),
        config_errors: view.config_errors.clone(),
        config_warnings: view.config_warnings.clone(),
        missing_ports: view.missing_ports.clone(),
        problems: view
            .problems
            .iter()
            .cloned()
            .chain(crate::api::forwarding::current())
            .collect(),
        reconciles: view.reconciles,
        last_reconcile_seconds: view.last_reconcile_seconds,
        last_reconcile_unix: view.last_reconcile_unix,
        drops,
        dataplane_error,
        ineligible_ports: crate::resolve::port_eligibility::refused_count(),
        programs: crate::apply::node_lock::programs_status(std::path::Path::new(&view.bpffs)),
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
    // SAFETY: umask touches no memory; it is process-wide, and no other thread runs
    // yet (see above), so nothing else creates files under the narrow mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above; this restores the mask read back by the first call.
    unsafe { libc::umask(old) };
    let listener = bound.with_context(|| format!("binding the API socket {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(listener)
}

/// Serves the API on `socket` in its own thread; `monitor` streams the
/// data path's events to `GET /v1/monitor` clients.
pub fn serve(
    socket: &Path,
    observer: Arc<Observer>,
    monitor: Arc<crate::monitor::Hub>,
) -> Result<JoinHandle<()>> {
    let listener = bind(socket)?;
    let server = tiny_http::Server::from_listener(listener, None)
        .map_err(|e| anyhow::anyhow!("starting the API server: {e}"))?;
    info!(socket = %socket.display(), "admin API listening");
    let handle = std::thread::Builder::new()
        .name("api".into())
        .spawn(move || {
            for mut request in server.incoming_requests() {
                // Monitor clients stream until they go: own thread each,
                // as many as the hub takes.
                if request.url().starts_with("/v1/monitor") {
                    start_monitor(&monitor, request);
                    continue;
                }
                // CNI endpoints (ADD waits for the port): own thread each.
                if request.url().starts_with("/v1/endpoints") {
                    let observer = observer.clone();
                    std::thread::spawn(move || {
                        let reply =
                            crate::api::endpoints::handle(observer.published(), &mut request);
                        respond(request, reply);
                    });
                    continue;
                }
                let reply = if request.url().starts_with("/v1/debug/datapath") {
                    debug_datapath(&observer, &mut request)
                } else if *request.method() == tiny_http::Method::Get {
                    route(&observer, request.url())
                } else {
                    error(405, format!("method {} not allowed", request.method()))
                };
                respond(request, reply);
            }
        })?;
    Ok(handle)
}

/// `GET /v1/debug/datapath`: which debug events the data path emits;
/// `PUT` with `{"drops": bool, "decisions": bool}` switches them.
fn debug_datapath(observer: &Observer, request: &mut tiny_http::Request) -> Reply {
    use crate::apply::dataplane::debug_log::{self, Switches};
    let bpffs = observer.bpffs();
    match request.method() {
        tiny_http::Method::Get => {}
        tiny_http::Method::Put => {
            let mut body = String::new();
            if let Err(e) = std::io::Read::read_to_string(
                &mut std::io::Read::take(request.as_reader(), 4096),
                &mut body,
            ) {
                return error(400, format!("reading the request body: {e}"));
            }
            let to: Switches = match serde_json::from_str(&body) {
                Ok(s) => s,
                Err(e) => {
                    return error(
                        400,
                        format!("body must be {{\"drops\": bool, \"decisions\": bool}}: {e}"),
                    );
                }
            };
            if let Err(e) = debug_log::set(bpffs, to) {
                return error(503, format!("{e:#}"));
            }
        }
        m => return error(405, format!("method {m} not allowed")),
    }
    match debug_log::get(bpffs) {
        Ok(s) => json(200, &s),
        Err(e) => error(503, format!("{e:#}")),
    }
}

/// `GET /v1/monitor[?type=drop|policy][&vm=NS/VM]`: one JSON object per
/// line for every event that passes the filter, until the client goes
/// (an empty line every second tells a closed connection apart). Past
/// `monitor::MAX_CLIENTS` connected, 503 and why.
fn start_monitor(monitor: &Arc<crate::monitor::Hub>, request: tiny_http::Request) {
    if *request.method() != tiny_http::Method::Get {
        let m = request.method().to_string();
        return respond(request, error(405, format!("method {m} not allowed")));
    }
    let query = request
        .url()
        .split_once('?')
        .map_or("", |(_, q)| q)
        .to_string();
    let filter = match crate::monitor::Filter::from_query(&query) {
        Ok(f) => f,
        Err(e) => return respond(request, error(400, e)),
    };
    // Registered here, in the API's thread, so the count is exact and a
    // refused client costs no thread.
    let sub = match monitor.subscribe(filter) {
        Ok(sub) => sub,
        Err(refused) => {
            warn!("vmpath monitor client refused: {}", refused.0);
            return respond(request, error(503, refused.0));
        }
    };
    // A thread that cannot start drops the request, which tiny_http
    // answers 500, and the subscription with it.
    if let Err(e) = std::thread::Builder::new()
        .name("monitor-client".into())
        .stack_size(crate::monitor::CLIENT_STACK)
        .spawn(move || stream_monitor(sub, request))
    {
        warn!("starting a vmpath monitor client's thread: {e}");
    }
}

fn stream_monitor(sub: crate::monitor::Subscription, request: tiny_http::Request) {
    // Written by hand, line by line and flushed: tiny_http would hold a
    // body of unknown length until its end.
    let mut out = request.into_writer();
    let head = "HTTP/1.0 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n";
    if out
        .write_all(head.as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
        return;
    }
    // A failed write means the client has gone: the subscription ends here.
    while let Some(line) = sub.next_line(Duration::from_secs(1)) {
        if out.write_all(&line).and_then(|()| out.flush()).is_err() {
            return;
        }
    }
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        publish::view::{Published, sample},
        slowpath::{Counters, SharedStats},
    };

    /// An observer over the sample view; its bpffs does not exist, so the
    /// pinned maps cannot be read.
    fn observer() -> Observer {
        let view = sample::view();
        let bpffs = view.bpffs.clone().into();
        let slow = SharedStats::default();
        slow.lock().unwrap().ports.insert(
            "prod/vm1/eth0".into(),
            Counters {
                received: [("discover".to_string(), 2)].into(),
                ..Default::default()
            },
        );
        Observer::new(Arc::new(Published::new(view)), slow, bpffs)
    }

    fn get(path: &str) -> (u16, serde_json::Value) {
        let reply = route(&observer(), path);
        (reply.code, serde_json::from_str(&reply.body).unwrap())
    }

    #[test]
    fn status_counts_each_state_and_says_why_drops_are_missing() {
        let (code, body) = get("/v1/status");
        assert_eq!(code, 200);
        let status: Status = serde_json::from_value(body).unwrap();
        assert_eq!(
            status.counts,
            Counts {
                networks: 1,
                attachments: 4,
                local: 1,
                remote: 1,
                missing_ports: 1,
                migrating: 1,
                config_errors: 1,
            }
        );
        assert!(status.ready);
        assert_eq!(status.drops, None);
        assert!(status.dataplane_error.is_some_and(|e| !e.is_empty()));
    }

    #[test]
    fn probes_answer_by_readiness_and_liveness() {
        let o = observer();
        let alive = route(&o, "/healthz");
        assert_eq!(alive.code, 200);
        // The published view's generation: what status.json catches up to.
        let body: serde_json::Value = serde_json::from_str(&alive.body).unwrap();
        assert_eq!(body["generation"], 4, "{}", alive.body);
        assert_eq!(route(&o, "/readyz").code, 200);
        o.published().publish(View::default());
        let reply = route(&o, "/readyz");
        assert_eq!(reply.code, 503);
        assert!(reply.body.contains("not ready"), "{}", reply.body);
        o.published().loop_exited();
        assert_eq!(route(&o, "/healthz").code, 503);
    }

    #[test]
    fn a_vm_shows_its_interfaces_state_and_slow_path_counters() {
        let (code, body) = get("/v1/vms/prod/vm1/");
        assert_eq!(code, 200);
        let d: VmDetail = serde_json::from_value(body).unwrap();
        assert_eq!((d.namespace.as_str(), d.vm.as_str()), ("prod", "vm1"));
        assert_eq!(d.interfaces.len(), 1);
        let i = &d.interfaces[0];
        assert_eq!(i.state, state::LOCAL);
        // No pinned maps here: no counters, but the slow path's are shown.
        assert_eq!(i.counters, None);
        assert_eq!(i.dhcp.as_ref().unwrap().received["discover"], 2);
    }

    #[test]
    fn lists_and_one_network_carry_each_row_state() {
        let (code, body) = get("/v1/vms");
        assert_eq!(code, 200);
        let list: VmList = serde_json::from_value(body).unwrap();
        let states: Vec<&str> = list.interfaces.iter().map(|r| r.state.as_str()).collect();
        assert_eq!(states, ["local", "remote", "missing_port", "migrating"]);
        let (code, body) = get("/v1/networks/blue?x=1");
        assert_eq!(code, 200);
        let net: NetworkDetail = serde_json::from_value(body).unwrap();
        assert_eq!(net.network.id, 100);
        assert_eq!(net.interfaces.len(), 4);
        // What the CNI plugin asks on every ADD: the network alone.
        let (code, body) = get(&vmpath_api::path::network_alone("blue"));
        assert_eq!(code, 200);
        let net: NetworkDetail = serde_json::from_value(body).unwrap();
        assert_eq!((net.network.id, net.interfaces.len()), (100, 0));
        let (_, body) = get("/v1/networks");
        assert_eq!(body["networks"][0]["name"], "blue");
    }

    #[test]
    fn unknown_names_and_paths_are_404_with_an_error_body() {
        for (path, message) in [
            ("/v1/networks/red", "no network named \"red\""),
            ("/v1/vms/prod/vm%20x", "no VM prod/vm x"),
            ("/v2/status", "no such endpoint: /v2/status"),
        ] {
            let (code, body) = get(path);
            assert_eq!(code, 404, "{path}");
            assert_eq!(body["error"], message, "{path}");
        }
    }

    #[test]
    fn a_network_asked_for_before_the_first_round_is_try_again_not_unknown() {
        let o = observer();
        // Socket up, no round published yet: the initial view.
        o.published().publish(View::default());
        let reply = route(&o, "/v1/networks/blue");
        assert_eq!(reply.code, 503, "{}", reply.body);
        assert!(reply.body.contains("starting"), "{}", reply.body);
    }

    #[test]
    fn percent_decoding_keeps_what_is_not_an_escape() {
        assert_eq!(vmpath_api::path::decode("a%2Fb"), "a/b");
        assert_eq!(vmpath_api::path::decode("100%"), "100%");
        assert_eq!(vmpath_api::path::decode("%zz"), "%zz");
    }
}
