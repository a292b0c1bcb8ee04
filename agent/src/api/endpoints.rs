//! Endpoints handed over by the `vmpath-cni` plugin: a port the container
//! runtime created, turned into the same Attachment a config document would
//! give (identity: pod namespace/name + interface; network from the plugin's
//! config; addresses from the IPAM claim; MAC from the pod side).
//!
//! The plugin is stateless; the agent keeps the endpoints in its state dir
//! (`cni-endpoints.json`) so they survive agent restarts. API:
//!   POST   /v1/endpoints                      hand over a port; answers once
//!                                             it is programmed (or refused)
//!   GET    /v1/endpoints                      every endpoint, with its state
//!   GET    /v1/endpoints/{container}/{ifname} one endpoint (CHECK)
//!   DELETE /v1/endpoints/{container}/{ifname} forget it (idempotent)
//!
//! A VM interface (a virt-launcher pod's) an endpoint once programmed keeps
//! its claim after DEL: a persistent address outlives the pod. A plain
//! pod's claim goes with its last endpoint (DEL, GC), as a pod's address
//! does in any cluster: a node running jobs would run out of addresses.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Read as _,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};
pub use vmpath_api::cni::{Dns, EndpointList, EndpointReply, EndpointRequest, Removed};
use vmpath_api::types::Reply;

use crate::{
    config::{AttachmentKey, source::RawDocument, source::Snapshot},
    publish::view::{Published, View, state},
    resolve::resolved::Origin,
};

/// How long an ADD waits for the agent to program the port.
pub use vmpath_api::cni::PROGRAM_TIMEOUT;

/// How long an ADD refused because its launcher pod's VMI is not known
/// waits before the refusal is answered: the agent's watches deliver the
/// pod and its VMI in either order, and the runtime calls ADD as soon as
/// the pod is scheduled. Past it the VMI is taken as absent (a pod naming
/// a VMI nobody has).
pub const UNSEEN_VMI_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The largest request body accepted (an endpoint is a few hundred bytes).
const MAX_BODY: u64 = 64 * 1024;
const STATE_FILE: &str = "cni-endpoints.json";

/// The agent's side of an endpoint the plugin handed over.
trait EndpointExt {
    fn id(&self) -> String;
    /// The identity in `Stored::kept`.
    fn kept_key(&self) -> (String, String, String);
    fn key(&self) -> AttachmentKey;
    /// Where errors about this endpoint point (config errors name a file).
    fn source(&self) -> PathBuf;
    fn validate(&self) -> Result<(), String>;
    /// The Attachment document this endpoint stands for.
    fn document(&self, node: &str) -> serde_json::Value;
}

impl EndpointExt for EndpointRequest {
    fn id(&self) -> String {
        endpoint_id(&self.container_id, &self.ifname)
    }

    /// The identity in `Stored::kept`.
    fn kept_key(&self) -> (String, String, String) {
        (
            self.pod_namespace.clone(),
            self.pod_name.clone(),
            self.ifname.clone(),
        )
    }

    fn key(&self) -> AttachmentKey {
        AttachmentKey::new(
            self.pod_namespace.as_str().into(),
            self.pod_name.as_str().into(),
            self.ifname.as_str().into(),
        )
    }

    /// Where errors about this endpoint point (config errors name a file).
    fn source(&self) -> PathBuf {
        PathBuf::from(format!(
            "{}{}",
            crate::derive::translate::CNI_SOURCE_PREFIX,
            self.id()
        ))
    }

    fn validate(&self) -> Result<(), String> {
        for (field, v) in [
            ("container_id", &self.container_id),
            ("ifname", &self.ifname),
            ("netns", &self.netns),
            ("network", &self.network),
            ("port", &self.port),
            ("pod_namespace", &self.pod_namespace),
            ("pod_name", &self.pod_name),
        ] {
            if v.is_empty() {
                return Err(format!("{field} is empty"));
            }
            if v.contains('/') && field != "netns" {
                return Err(format!("{field} {v:?} contains '/'"));
            }
        }
        if self.port.len() > 15 || self.ifname.len() > 15 {
            return Err("interface names are at most 15 characters".into());
        }
        Ok(())
    }

    /// The Attachment document this endpoint stands for.
    fn document(&self, node: &str) -> serde_json::Value {
        let mut spec = serde_json::json!({
            "vm": self.pod_name,
            "interface": self.ifname,
            "network": self.network,
            "node": node,
            "port": self.port,
        });
        if let Some(mac) = &self.mac {
            spec["mac"] = mac.as_str().into();
        }
        serde_json::json!({
            "apiVersion": crate::config::model::API_VERSION,
            "kind": "Attachment",
            "metadata": {
                "name": format!("{}-{}", self.pod_name, self.ifname),
                "namespace": self.pod_namespace,
            },
            "spec": spec,
        })
    }
}

pub fn endpoint_id(container_id: &str, ifname: &str) -> String {
    format!("{container_id}/{ifname}")
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Stored {
    endpoints: BTreeMap<String, EndpointRequest>,
    /// VM interfaces whose claims stay although no endpoint names them now.
    kept: BTreeSet<(String, String, String)>,
}

impl Stored {
    /// Removes endpoint `id` (DEL, GC). A plain pod's identity leaves
    /// `kept` with its last endpoint, so its claim is released (state files
    /// written before plain pods were told apart list them there too).
    fn remove(&mut self, id: &str) -> Option<EndpointRequest> {
        let removed = self.endpoints.remove(id)?;
        let key = removed.key();
        if !removed.vm && !self.endpoints.values().any(|e| e.key() == key) {
            self.kept.remove(&removed.kept_key());
        }
        Some(removed)
    }
}

struct Registry {
    path: PathBuf,
    stored: Mutex<Stored>,
    /// Bumped on every change, mixed into the config fingerprint so the
    /// reconcile loop notices.
    generation: AtomicU64,
    /// The generation the last reconcile round started with.
    seen: AtomicU64,
    /// The generation the last finished round read (its view published);
    /// ADDs wait on `round_finished` for it to reach theirs.
    done: Mutex<u64>,
    round_finished: Condvar,
    /// Each endpoint's Attachment document as the last round read it: an
    /// unchanged endpoint hands every round the same `Arc`, so the round
    /// sees by identity that it did not change (`round::membership`).
    documents: Mutex<crate::sys::hash::HashMap<String, (EndpointRequest, Arc<serde_json::Value>)>>,
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

fn load(state_dir: &Path) -> Registry {
    let path = state_dir.join(STATE_FILE);
    let stored = match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            warn!(file = %path.display(), "unreadable CNI endpoints, starting with none: {e}");
            Stored::default()
        }),
        Err(_) => Stored::default(),
    };
    info!(endpoints = stored.endpoints.len(), "CNI endpoints loaded");
    Registry {
        path,
        stored: Mutex::new(stored),
        generation: AtomicU64::new(1),
        seen: AtomicU64::new(0),
        done: Mutex::new(0),
        round_finished: Condvar::new(),
        documents: Mutex::default(),
    }
}

impl Registry {
    fn save(&self, stored: &Stored) -> Result<(), String> {
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(stored).map_err(|e| e.to_string())?;
        fs::write(&tmp, bytes)
            .and_then(|()| fs::rename(&tmp, &self.path))
            .map_err(|e| format!("writing {}: {e}", self.path.display()))
    }

    /// Applies `change` and persists it; returns the new generation.
    /// The generation moves under the same lock as the endpoints (see
    /// [`all`](Self::all)).
    fn update<T>(&self, change: impl FnOnce(&mut Stored) -> T) -> Result<(T, u64), String> {
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        let out = change(&mut stored);
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        self.save(&stored)?;
        Ok((out, generation))
    }

    fn get(&self, id: &str) -> Option<EndpointRequest> {
        let stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        stored.endpoints.get(id).cloned()
    }

    fn all(&self) -> Vec<EndpointRequest> {
        self.all_at().0
    }

    /// Every endpoint and the generation they are: read under one lock,
    /// so a round that reads an endpoint counts as having read its
    /// generation. (Bumped after the lock, a round that read the endpoint
    /// while its ADD saved it recorded the generation before, and the ADD
    /// waited a round more: at 100,000 VMs, 10 ms.)
    fn all_at(&self) -> (Vec<EndpointRequest>, u64) {
        let stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        (
            stored.endpoints.values().cloned().collect(),
            self.generation.load(Ordering::SeqCst),
        )
    }
}

// --- reconcile-loop hooks ---------------------------------------------------

/// Adds one Attachment document per CNI endpoint to what the config dir
/// gave (loading the endpoints from `state_dir` on first use).
pub fn add_documents(state_dir: &Path, node: &str, snap: &mut Snapshot) {
    let registry = REGISTRY.get_or_init(|| load(state_dir));
    let (endpoints, generation) = registry.all_at();
    let mut documents = registry.documents.lock().unwrap_or_else(|p| p.into_inner());
    let mut kept = crate::sys::hash::HashMap::default();
    for e in endpoints {
        let id = e.id();
        let value = match documents.remove(&id) {
            Some((was, value)) if was == e => value,
            _ => Arc::new(e.document(node)),
        };
        snap.documents.push(RawDocument {
            file: e.source().into(),
            index: 1,
            origin: crate::config::DocOrigin::CniPort,
            value: value.clone(),
        });
        kept.insert(id, (e, value));
    }
    *documents = kept;
    drop(documents);
    snap.fingerprint =
        crate::sys::hash::fnv1a(&[&snap.fingerprint.to_be_bytes(), &generation.to_be_bytes()]);
    registry.seen.store(generation, Ordering::SeqCst);
}

/// Called by the reconcile loop once a round's view is published: wakes
/// the ADDs waiting for their endpoint to be programmed (or refused).
pub fn round_done() {
    let Some(registry) = REGISTRY.get() else {
        return;
    };
    let mut done = registry.done.lock().unwrap_or_else(|p| p.into_inner());
    *done = registry.seen.load(Ordering::SeqCst);
    registry.round_finished.notify_all();
}

/// The VM interfaces CNI programmed once, whose claims are kept (DEL
/// never releases a persistent address).
pub fn kept_claims() -> std::collections::BTreeSet<AttachmentKey> {
    let Some(registry) = REGISTRY.get() else {
        return Default::default();
    };
    let stored = registry.stored.lock().unwrap_or_else(|p| p.into_inner());
    stored
        .kept
        .iter()
        .map(|(namespace, vm, interface)| {
            AttachmentKey::new(
                namespace.as_str().into(),
                vm.as_str().into(),
                interface.as_str().into(),
            )
        })
        .collect()
}

// --- API --------------------------------------------------------------------

fn reply<T: Serialize>(code: u16, value: &T) -> Reply {
    Reply {
        code,
        body: serde_json::to_string_pretty(value).unwrap_or_else(|_| "{}".into()),
    }
}

fn error(code: u16, message: String) -> Reply {
    reply(code, &vmpath_api::types::ApiError { error: message })
}

/// The endpoint as the view shows it.
fn describe(view: &View, e: &EndpointRequest) -> EndpointReply {
    // By port: a port is one endpoint's on this node, whether the
    // endpoint is the pod's own or derived from a Pod object (a VM's
    // identity is its VMI's, not the pod's).
    // Among the entries that may have a port here: a few, not every VM
    // interface of the cluster.
    let active = view
        .maybe_on_node()
        .find(|a| a.namespace == e.pod_namespace && a.node == view.node && a.port == e.port);
    // A migration target pod's port: programmed pending is as far as it
    // goes before the VM moves, and KubeVirt starts the migration only once
    // the target pod runs (its ADD returned).
    let target = || {
        view.maybe_on_node().find(|a| {
            a.namespace == e.pod_namespace
                && a.pending_port
                    .as_ref()
                    .is_some_and(|(port, _)| *port == e.port)
        })
    };
    let (a, state) = match active {
        Some(a) => (Some(a), view.state_of(a)),
        None => match target() {
            Some(a) => (Some(a), state::MIGRATION_TARGET),
            None => (None, "unknown"),
        },
    };
    let net = view.networks.iter().find(|n| n.name == e.network);
    EndpointReply {
        endpoint: e.clone(),
        state: state.to_string(),
        mac: a.and_then(|a| a.mac.clone()),
        ips: a
            .map(|a| {
                a.ips
                    .iter()
                    .filter(|ip| ip.origin != Origin::Learned)
                    .map(|ip| ip.address.clone())
                    .collect()
            })
            .unwrap_or_default(),
        gateways: net.map(|n| n.gateway_ips.clone()).unwrap_or_default(),
        mtu: net.map(|n| n.mtu),
        dns: net
            .map(|n| Dns {
                nameservers: n.dns_servers.clone(),
                search: n.search_domains.clone(),
            })
            .unwrap_or_default(),
    }
}

/// Answers one `/v1/endpoints` request (any method). Runs in its own
/// thread: ADD blocks until the port is programmed.
pub fn handle(shared: &Published, request: &mut tiny_http::Request) -> Reply {
    let Some(registry) = REGISTRY.get() else {
        return error(503, "the agent is starting: no reconcile round yet".into());
    };
    let path = request.url().split(['?', '#']).next().unwrap_or("");
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match (request.method(), parts.as_slice()) {
        (tiny_http::Method::Get, ["v1", "endpoints"]) => {
            let view = shared.view();
            let list: Vec<EndpointReply> =
                registry.all().iter().map(|e| describe(&view, e)).collect();
            // Through a `Value`, as ever: its keys come out sorted.
            reply(
                200,
                &serde_json::to_value(EndpointList { endpoints: list }).unwrap_or_default(),
            )
        }
        (tiny_http::Method::Get, ["v1", "endpoints", container, ifname]) => {
            match registry.get(&endpoint_id(container, ifname)) {
                Some(e) => reply(200, &describe(&shared.view(), &e)),
                None => error(404, format!("no endpoint {container}/{ifname}")),
            }
        }
        (tiny_http::Method::Delete, ["v1", "endpoints", container, ifname]) => {
            let id = endpoint_id(container, ifname);
            let removed = registry.update(|s| s.remove(&id));
            shared.wake(crate::sys::events::Wake::Endpoint);
            match removed {
                Ok((removed, _)) => {
                    if removed.is_some() {
                        info!(endpoint = %id, "CNI endpoint removed");
                    }
                    reply(
                        200,
                        &Removed {
                            removed: removed.is_some(),
                        },
                    )
                }
                Err(e) => error(500, e),
            }
        }
        (tiny_http::Method::Post, ["v1", "endpoints"]) => {
            let mut body = String::new();
            if let Err(e) = request.as_reader().take(MAX_BODY).read_to_string(&mut body) {
                return error(400, format!("reading the request body: {e}"));
            }
            let e: EndpointRequest = match serde_json::from_str(&body) {
                Ok(e) => e,
                Err(err) => return error(400, format!("not an endpoint request: {err}")),
            };
            add(shared, registry, e)
        }
        _ => error(
            404,
            format!("no such endpoint: {} {path}", request.method()),
        ),
    }
}

fn add(shared: &Published, registry: &Registry, e: EndpointRequest) -> Reply {
    if let Err(msg) = e.validate() {
        return error(400, format!("endpoint {}: {msg}", e.id()));
    }
    let view = shared.view();
    if !view.ready {
        return error(
            503,
            "the agent is not ready: data path not programmed".into(),
        );
    }
    if !view.networks.iter().any(|n| n.name == e.network) {
        return error(
            404,
            format!("no network named {:?} on this node", e.network),
        );
    }
    let id = e.id();
    let key = e.key();
    // A newer sandbox of the same pod interface supersedes the old entry.
    let generation = match registry.update(|s| {
        s.endpoints
            .retain(|_, old| old.key() != key || old.id() == id);
        s.endpoints.insert(id.clone(), e.clone());
    }) {
        Ok((_, g)) => g,
        Err(err) => return error(500, err),
    };
    shared.wake(crate::sys::events::Wake::Endpoint);
    info!(endpoint = %id, vm = %key, network = %e.network, port = %e.port, "CNI endpoint added");
    let source = e.source();
    let received = Instant::now();
    let deadline = received + PROGRAM_TIMEOUT;
    // Woken by the loop after each round; the first round that read this
    // endpoint (generation) decides a refusal. Programming may take later
    // rounds (a port that appears late).
    let mut done = registry.done.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if *done >= generation {
            let view = shared.view();
            let described = describe(&view, &e);
            let programmed =
                described.state == state::LOCAL || described.state == state::MIGRATION_TARGET;
            // Programmed without an address its network's IPAM owes it: the
            // pool has none free. A pod without its address is no use to the
            // runtime, so the ADD fails and the port goes.
            if let Some(exhausted) = programmed
                .then(|| unaddressed(&view, &e, &described))
                .flatten()
            {
                drop(done);
                forget(registry, &id);
                shared.wake(crate::sys::events::Wake::Endpoint);
                warn!(endpoint = %id, "CNI endpoint refused: {exhausted}");
                return error(409, format!("refused: {exhausted}"));
            }
            if programmed {
                drop(done);
                // Only a VM's claim outlives its pod.
                if e.vm
                    && let Err(err) = registry.update(|s| s.kept.insert(e.kept_key()))
                {
                    warn!("recording the kept claim of {key}: {err}");
                }
                // How long the runtime's ADD waited on the agent.
                info!(
                    endpoint = %id,
                    wait_ms = received.elapsed().as_secs_f64() * 1e3,
                    "CNI endpoint programmed"
                );
                return reply(200, &described);
            }
            // Refused by validation, or valid but not served (a network
            // whose local ports are at the data path's limit).
            let not_served = format!("attachment {key} not served");
            let refused = view.config_errors.iter().find(|c| c.file == source);
            let refusal = refused.map(|c| c.message.clone()).or_else(|| {
                view.problems
                    .iter()
                    .find(|p| p.starts_with(&not_served))
                    .cloned()
            });
            let waits_for_vmi = refused
                .is_some_and(|c| c.reason == Some(vmpath_api::types::RefusalReason::VmiNotKnown))
                && received.elapsed() < UNSEEN_VMI_GRACE;
            if let Some(refusal) = refusal.filter(|_| !waits_for_vmi) {
                let message = format!("refused: {refusal}");
                drop(done);
                forget(registry, &id);
                shared.wake(crate::sys::events::Wake::Endpoint);
                return error(409, message);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            drop(done);
            // What the last round said of this endpoint, read before it
            // is forgotten: a round after the forget no longer holds it
            // (two ADDs timing out together: the first one's forget
            // started a round that published, before the second read the
            // view, one without the second's wait reason).
            let view = shared.view();
            forget(registry, &id);
            shared.wake(crate::sys::events::Wake::Endpoint);
            let state = describe(&view, &e).state;
            // What it waits for, where the config says (an IPAMClaim).
            let why = view
                .config_warnings
                .iter()
                .find(|w| w.file == source)
                .map(|w| format!(": {}", w.message))
                .unwrap_or_default();
            return error(
                504,
                format!(
                    "port {} of {key} not programmed within {} s (state {state}){why}",
                    e.port,
                    PROGRAM_TIMEOUT.as_secs(),
                ),
            );
        }
        // Within the grace for an unseen VMI: look again when it ends,
        // if no round came before.
        let wake = match received + UNSEEN_VMI_GRACE {
            grace if grace > now => deadline.min(grace),
            _ => deadline,
        };
        done = registry
            .round_finished
            .wait_timeout(done, wake - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Why `got`, programmed, lacks an address its IPAM network owes it: the
/// network's pool of that family (IPAM allocates from the first subnet of
/// each family) has none free.
fn unaddressed(view: &View, e: &EndpointRequest, got: &EndpointReply) -> Option<String> {
    let net = view.networks.iter().find(|n| n.name == e.network)?;
    if !net.ipam {
        return None;
    }
    let v6 = |cidr: &str| cidr.contains(':');
    [false, true].into_iter().find_map(|family| {
        let pool = net.subnets.iter().find(|s| v6(s) == family)?;
        (!got.ips.iter().any(|ip| v6(ip) == family)).then(|| {
            format!(
                "IPAM pool exhausted: network {:?} has no free address in {pool} for {}",
                e.network,
                e.key()
            )
        })
    })
}

/// A failed ADD leaves nothing behind.
fn forget(registry: &Registry, id: &str) {
    if let Err(err) = registry.update(|s| s.endpoints.remove(id)) {
        warn!("forgetting endpoint {id}: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> EndpointRequest {
        EndpointRequest {
            container_id: "c0ffee".into(),
            ifname: "eth1".into(),
            netns: "/run/netns/x".into(),
            network: "blue".into(),
            port: "vmp0123456789".into(),
            mac: Some("02:00:00:00:00:01".into()),
            pod_namespace: "default".into(),
            pod_name: "web".into(),
            pod_uid: None,
            vm: false,
        }
    }

    #[test]
    fn an_endpoint_is_an_attachment_document() {
        let mut snap = Snapshot {
            documents: vec![RawDocument {
                file: std::path::Path::new("net.yaml").into(),
                index: 1,
                origin: crate::config::DocOrigin::Given,
                value: serde_json::json!({
                    "apiVersion": "vmpath.dev/v1alpha1",
                    "kind": "Network",
                    "metadata": {"name": "blue"},
                    "spec": {"id": 7, "subnets": ["10.9.0.0/24"], "defaultGatewayIPs": ["10.9.0.1"]},
                }).into(),
            }],
            ..Default::default()
        };
        snap.documents.push(RawDocument {
            file: request().source().into(),
            index: 1,
            origin: crate::config::DocOrigin::CniPort,
            value: request().document("n1").into(),
        });
        let cfg = crate::round::validate(&snap, "n1", &BTreeSet::new());
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        let a = &cfg.attachments[0];
        assert_eq!(a.key.to_string(), "default/web/eth1");
        assert_eq!(a.port, "vmp0123456789");
        assert_eq!(a.mac, Some([2, 0, 0, 0, 0, 1]));
    }

    /// A round that reads an endpoint has read its generation: the ADD
    /// that handed it over is answered by that round's view, not a later
    /// one's. Readers race the writer (which saves to disk while it holds
    /// the endpoints); each read must count every endpoint it sees.
    #[test]
    fn a_round_that_reads_an_endpoint_reads_its_generation() {
        let dir = std::env::temp_dir().join(format!("vmpath-endpoints-gen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let registry = load(&dir);
        let first = registry.generation.load(Ordering::SeqCst);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let mut reads = 0;
                while !done.load(Ordering::SeqCst) {
                    let (endpoints, generation) = registry.all_at();
                    // Each update below adds one endpoint and one generation.
                    assert!(
                        generation - first >= endpoints.len() as u64,
                        "{} endpoints read at generation {generation} (first {first})",
                        endpoints.len()
                    );
                    reads += 1;
                }
                reads
            });
            for i in 0..400 {
                let mut e = request();
                e.container_id = format!("c{i}");
                let (_, generation) = registry
                    .update(|s| s.endpoints.insert(e.id(), e.clone()))
                    .unwrap();
                assert_eq!(generation, first + i + 1);
            }
            done.store(true, Ordering::SeqCst);
            assert!(reader.join().unwrap() > 0);
        });
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_plain_pods_claim_goes_with_its_last_endpoint_a_vms_stays() {
        let mut stored = Stored::default();
        let plain = request();
        let mut vm = request();
        vm.container_id = "launcher".into();
        vm.pod_name = "virt-launcher-vm1".into();
        vm.vm = true;
        // A newer sandbox of the plain pod beside the older one.
        let mut newer = request();
        newer.container_id = "c0ffee2".into();
        for e in [&plain, &vm, &newer] {
            stored.endpoints.insert(e.id(), e.clone());
            // State files of older agents list plain pods too.
            stored.kept.insert(e.kept_key());
        }
        assert!(stored.remove(&plain.id()).is_some());
        assert!(
            stored.kept.contains(&plain.kept_key()),
            "the pod still has a sandbox"
        );
        assert!(stored.remove(&newer.id()).is_some());
        assert!(
            !stored.kept.contains(&plain.kept_key()),
            "{:?}",
            stored.kept
        );
        assert!(stored.remove(&vm.id()).is_some());
        assert!(stored.kept.contains(&vm.kept_key()), "a VM keeps its claim");
        assert!(stored.remove(&vm.id()).is_none(), "DEL is idempotent");
    }

    #[test]
    fn an_endpoint_without_the_address_its_ipam_owes_it_names_network_and_pool() {
        let mut view = crate::publish::view::sample::view();
        view.networks[0].subnets.push("fd00:20::/64".into());
        let mut got = describe(&view, &request());
        got.ips = vec!["10.20.0.5/16".into(), "fd00:20::5/64".into()];
        assert_eq!(unaddressed(&view, &request(), &got), None);
        got.ips.truncate(1);
        let why = unaddressed(&view, &request(), &got).unwrap();
        assert!(
            why.contains("network \"blue\"") && why.contains("fd00:20::/64"),
            "{why}"
        );
        got.ips.clear();
        let why = unaddressed(&view, &request(), &got).unwrap();
        assert!(
            why.contains("10.20.0.0/16") && why.contains("default/web/eth1"),
            "{why}"
        );
        // A network without IPAM owes no address.
        view.networks[0].ipam = false;
        assert_eq!(unaddressed(&view, &request(), &got), None);
    }

    #[test]
    fn bad_requests_are_named() {
        let mut r = request();
        r.pod_name = "a/b".into();
        assert!(r.validate().unwrap_err().contains("pod_name"));
        let mut r = request();
        r.port = "much-too-long-port".into();
        assert!(r.validate().is_err());
    }
}
