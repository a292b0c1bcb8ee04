//! A small Kubernetes API server for tests, in memory, over real HTTP/1.1
//! (plain TCP on 127.0.0.1): enough of the API for kube-rs watchers and
//! reflectors. Collections are cluster-wide (`/api/v1/pods`,
//! `/apis/GROUP/VERSION/PLURAL`); `GET` lists (with `fieldSelector` on one
//! field, `field=value`; in pages of `limit` items with a `continue`
//! token, each page from the first page's snapshot, as kube-rs' watchers
//! ask with 500) or, with `watch=true`, streams events after the
//! given `resourceVersion` as chunked JSON lines, with `BOOKMARK` events
//! while idle when `allowWatchBookmarks=true`. A watch from a
//! resourceVersion older than the kept history gets a 410 `Expired`
//! ERROR event, as from a real API server after compaction.
//!
//! Writes as kube-rs sends them, cluster-scoped or under
//! `namespaces/NS/`: `POST` creates (409 `AlreadyExists`), `PUT` replaces
//! (409 `Conflict` when `metadata.resourceVersion` is given and stale),
//! `PATCH` merges (`application/merge-patch+json`, and apply or strategic
//! patches read as a merge), `.../status` writes only `status`, `DELETE`
//! removes (409 `Conflict` when DeleteOptions' `preconditions.uid` is
//! another object's); `GET` of one object; every write is a watch event. Any kind is
//! served the same way, `coordination.k8s.io/v1` Leases and `v1` Events
//! included. No authentication.

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{Shutdown, TcpListener, TcpStream},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

/// The collection path of an object's kind, as the API server serves it.
pub fn collection(api_version: &str, kind: &str) -> String {
    let plural = match kind {
        "NetworkAttachmentDefinition" => "network-attachment-definitions".to_string(),
        "IPAMClaim" => "ipamclaims".to_string(),
        k => match k.to_lowercase() {
            // NetworkPolicy -> networkpolicies, as the API server names it.
            lower if lower.ends_with('y') => format!("{}ies", &lower[..lower.len() - 1]),
            lower => format!("{lower}s"),
        },
    };
    if api_version.contains('/') {
        format!("/apis/{api_version}/{plural}")
    } else {
        format!("/api/{api_version}/{plural}")
    }
}

#[derive(Default)]
struct State {
    resource_version: u64,
    /// (collection, namespace, name) -> object.
    objects: BTreeMap<(String, String, String), Value>,
    /// (resourceVersion, collection, event type, object), in
    /// resourceVersion order (only appended to, or cleared).
    history: Vec<(u64, String, &'static str, Value)>,
    /// Watches from before this resourceVersion get 410 Gone.
    oldest: u64,
    /// Open watches end when this changes.
    epoch: u64,
    /// List requests served (first pages), by collection.
    lists: BTreeMap<String, u64>,
    /// What is left of paged lists, by continue token: the list's
    /// resourceVersion and its remaining items.
    pages: BTreeMap<String, (u64, Vec<Value>)>,
    /// Continue tokens handed out.
    tokens: u64,
    /// Watch requests answered with 410, by collection.
    gone: BTreeMap<String, u64>,
    /// Writes answered with 409 Conflict, by collection.
    conflicts: BTreeMap<String, u64>,
    /// Writes served (2xx), by collection.
    writes: BTreeMap<String, u64>,
    /// Another writer that gets in first: before the next PUT to the
    /// collection, the objects it returns (given the PUT's body) are put.
    race: Option<(String, Racer)>,
}

/// See [`ApiServer::race_next_write`].
pub type Racer = Box<dyn FnOnce(&Value) -> Vec<Value> + Send>;

impl State {
    /// Stores `object` under its key with the next resourceVersion, and
    /// records the watch event.
    fn store(&mut self, coll: &str, ns: &str, name: &str, mut object: Value) -> Value {
        self.resource_version += 1;
        let rv = self.resource_version;
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        let kind = if self
            .objects
            .insert(
                (coll.to_string(), ns.to_string(), name.to_string()),
                object.clone(),
            )
            .is_some()
        {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.history
            .push((rv, coll.to_string(), kind, object.clone()));
        object
    }

    fn remove(&mut self, coll: &str, ns: &str, name: &str) -> Option<Value> {
        let mut object =
            self.objects
                .remove(&(coll.to_string(), ns.to_string(), name.to_string()))?;
        self.resource_version += 1;
        object["metadata"]["resourceVersion"] = self.resource_version.to_string().into();
        self.history.push((
            self.resource_version,
            coll.to_string(),
            "DELETED",
            object.clone(),
        ));
        Some(object)
    }

    fn put(&mut self, object: Value) {
        let coll = collection(
            object["apiVersion"].as_str().unwrap(),
            object["kind"].as_str().unwrap(),
        );
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        self.store(&coll, &ns, &name, object);
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stopped: AtomicBool,
    connections: Mutex<Vec<TcpStream>>,
}

pub struct ApiServer {
    pub url: String,
    netns: String,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Serves on 127.0.0.1 of the network namespace at `netns` (a path
    /// such as `/run/netns/NAME`): where the agent under test runs.
    pub fn start(netns: &str) -> ApiServer {
        Self::start_at(netns, "127.0.0.1")
    }

    /// Serves on `ip` of the network namespace at `netns`: an underlay
    /// address, for agents on several nodes.
    pub fn start_at(netns: &str, ip: &str) -> ApiServer {
        let netns = netns.to_string();
        let bind = format!("{ip}:0");
        let netns_path = netns.clone();
        // The socket belongs to the namespace of the thread that makes it.
        let listener = std::thread::spawn(move || {
            let ns = std::fs::File::open(&netns).expect("opening the netns");
            // SAFETY: setns on a valid netns fd; it affects this thread only.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {netns}: {}", std::io::Error::last_os_error());
            TcpListener::bind(&bind).unwrap()
        })
        .join()
        .unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stopped: AtomicBool::new(false),
            connections: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let acceptor = std::thread::spawn(move || {
            while !s.stopped.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        // As Go's net/http (a kube-apiserver) does: without it a
                        // response's last segment waits out the client's delayed
                        // ACK (Nagle), about 40 ms a request.
                        stream.set_nodelay(true).unwrap();
                        s.connections
                            .lock()
                            .unwrap()
                            .push(stream.try_clone().unwrap());
                        let s = s.clone();
                        std::thread::spawn(move || serve(&s, stream));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        ApiServer {
            url,
            netns: netns_path,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// Creates or replaces an object (its collection from apiVersion and
    /// kind), with a new resourceVersion.
    pub fn put(&self, object: Value) {
        let mut st = self.shared.state.lock().unwrap();
        st.put(object);
        self.shared.changed.notify_all();
    }

    /// Puts `objects` while forgetting the event history up to them (as
    /// etcd compaction does) and ends every open watch: watchers resume
    /// from a resourceVersion that is gone, get 410 and must relist to see
    /// them.
    pub fn compact_with(&self, objects: Vec<Value>) {
        let mut st = self.shared.state.lock().unwrap();
        for o in objects {
            st.put(o);
        }
        st.history.clear();
        st.oldest = st.resource_version;
        st.epoch += 1;
        self.shared.changed.notify_all();
    }

    /// Writes `vmpath controller`'s ledger as the controller would hold it
    /// for the IPAMClaims stored now, for tests that put claims already
    /// allocated with no controller running (an agent on `--source
    /// kubernetes` trusts a claim's `status.ips` only where the ledger
    /// vouches for them): each address of each claim's `status.ips`, held
    /// by that claim (its uid), on the vmpath network its `spec.network`
    /// names (a vmpath NAD's network in its namespace with that name, else
    /// the Network of that name). Sharded as the controller writes it
    /// (`vmpath-system/vmpath-ipam-ledger` and `...-<k>`, an address in
    /// the shard its hash names), and, as the controller does, only the
    /// shards whose content changed are written: each allocation is one
    /// shard's new resourceVersion, not the whole ledger's. Call it again
    /// after putting more claims.
    pub fn vouch_for_claims(&self) {
        let nads = self.objects(&collection(
            "k8s.cni.cncf.io/v1",
            "NetworkAttachmentDefinition",
        ));
        let mut ledger = serde_json::Map::new();
        for c in self.objects(&collection("k8s.cni.cncf.io/v1alpha1", "IPAMClaim")) {
            let ns = c["metadata"]["namespace"].as_str().unwrap_or("default");
            let spec_network = c["spec"]["network"].as_str().unwrap_or("");
            let network = nads
                .iter()
                .filter(|n| n["metadata"]["namespace"] == ns)
                .filter_map(|n| serde_json::from_str::<Value>(n["spec"]["config"].as_str()?).ok())
                .find(|conf| conf["name"] == spec_network && conf["type"] == "vmpath-cni")
                .and_then(|conf| conf["network"].as_str().map(str::to_string))
                .unwrap_or_else(|| spec_network.to_string());
            let held = ledger.entry(network).or_insert_with(|| json!({}));
            for ip in c["status"]["ips"].as_array().into_iter().flatten() {
                let ip = ip.as_str().unwrap();
                held[ip.split('/').next().unwrap()] = json!({
                    "claim": format!("{ns}/{}", c["metadata"]["name"].as_str().unwrap()),
                    "uid": c["metadata"]["uid"].as_str().unwrap_or(""),
                    "ip": ip,
                });
            }
        }
        use vmpath::config::kube_objects::ledger;
        const NAME: &str = "vmpath-ipam-ledger";
        let write = |name: &str, text: String| {
            let stored = self.get("/api/v1/configmaps", "vmpath-system", name);
            if stored.is_some_and(|o| o["data"][ledger::LEDGER_KEY] == text.as_str()) {
                return;
            }
            self.put(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "vmpath-system"},
                "data": {ledger::LEDGER_KEY: text},
            }));
        };
        let text = Value::Object(ledger).to_string();
        match serde_json::from_str::<ledger::Ledger>(&text) {
            Ok(whole) => {
                let mut shards = ledger::split(&whole);
                for k in 0..ledger::SHARDS {
                    let shard = shards.remove(&k).unwrap_or_default();
                    // Shard 0 always exists (the controller's first round
                    // makes it); the others once they hold an address (and
                    // then are emptied, not removed, when none is left).
                    let name = ledger::shard_name(NAME, k);
                    if k == 0
                        || !shard.is_empty()
                        || self
                            .get("/api/v1/configmaps", "vmpath-system", &name)
                            .is_some()
                    {
                        write(&name, serde_json::to_string(&shard).unwrap());
                    }
                }
            }
            // A status that is no address (a test of that): the ledger
            // unsharded, as an older controller wrote it.
            Err(_) => write(NAME, text),
        }
    }

    /// The object `name` in `namespace` (`""`: cluster-scoped) of
    /// `collection` (as [`collection`] names it), as stored.
    pub fn get(&self, collection: &str, namespace: &str, name: &str) -> Option<Value> {
        let st = self.shared.state.lock().unwrap();
        st.objects
            .get(&(
                collection.to_string(),
                namespace.to_string(),
                name.to_string(),
            ))
            .cloned()
    }

    /// Every object of `collection`, in every namespace.
    pub fn objects(&self, collection: &str) -> Vec<Value> {
        let st = self.shared.state.lock().unwrap();
        st.objects
            .iter()
            .filter(|((c, _, _), _)| c == collection)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// Deletes an object, as `kubectl delete` would (a watch event).
    pub fn delete(&self, collection: &str, namespace: &str, name: &str) -> Option<Value> {
        let mut st = self.shared.state.lock().unwrap();
        let gone = st.remove(collection, namespace, name);
        self.shared.changed.notify_all();
        gone
    }

    /// Lets another writer get in first, once: when the next PUT or POST
    /// to `collection` arrives, `racer` is given its body and the objects it
    /// returns are stored (new resourceVersions) before the write is served,
    /// as if they had been written a moment earlier by someone else.
    pub fn race_next_write(&self, collection: &str, racer: Racer) {
        let mut st = self.shared.state.lock().unwrap();
        st.race = Some((collection.to_string(), racer));
    }

    /// Whether the racer set by [`ApiServer::race_next_write`] has run.
    pub fn raced(&self) -> bool {
        self.shared.state.lock().unwrap().race.is_none()
    }

    /// Writes to `collection` answered 409 Conflict so far.
    pub fn conflicts(&self, collection: &str) -> u64 {
        let st = self.shared.state.lock().unwrap();
        st.conflicts.get(collection).copied().unwrap_or(0)
    }

    /// Writes to `collection` served so far.
    pub fn writes(&self, collection: &str) -> u64 {
        let st = self.shared.state.lock().unwrap();
        st.writes.get(collection).copied().unwrap_or(0)
    }

    /// A restart that keeps the stored objects (etcd survives): every open
    /// connection is cut, watches end, the event history is forgotten
    /// (watchers must relist, 410), and requests are answered again at
    /// once on the same address.
    pub fn restart(&self) {
        {
            let mut st = self.shared.state.lock().unwrap();
            st.history.clear();
            st.oldest = st.resource_version;
            st.epoch += 1;
        }
        self.shared.changed.notify_all();
        for c in self.shared.connections.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// One request from a client in the server's namespace, as a test
    /// would send it with curl: the status code and the JSON body.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &Value,
    ) -> (u16, Value) {
        let (netns, addr) = (
            self.netns.clone(),
            self.url.trim_start_matches("http://").to_string(),
        );
        let (method, path, content_type) = (
            method.to_string(),
            path.to_string(),
            content_type.to_string(),
        );
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&netns).expect("opening the netns");
            // SAFETY: setns on a valid netns fd; it affects this thread only.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {netns}");
            let mut s = TcpStream::connect(&addr).unwrap();
            write!(
                s,
                "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut reader = BufReader::new(s);
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let code: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            let mut length = 0;
            loop {
                let mut h = String::new();
                reader.read_line(&mut h).unwrap();
                if h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("content-length")
                {
                    length = v.trim().parse().unwrap();
                }
            }
            let mut buf = vec![0u8; length];
            std::io::Read::read_exact(&mut reader, &mut buf).unwrap();
            (code, serde_json::from_slice(&buf).unwrap_or(Value::Null))
        })
        .join()
        .unwrap()
    }

    /// List requests served for `collection` so far.
    pub fn lists(&self, collection: &str) -> u64 {
        let st = self.shared.state.lock().unwrap();
        st.lists.get(collection).copied().unwrap_or(0)
    }

    /// Watches of `collection` answered with 410 Gone so far.
    pub fn gone(&self, collection: &str) -> u64 {
        let st = self.shared.state.lock().unwrap();
        st.gone.get(collection).copied().unwrap_or(0)
    }

    /// Stops serving: every connection is closed, nothing is accepted.
    pub fn stop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        for c in self.shared.connections.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }

    /// Makes `node`'s agent read the cluster from this server
    /// (`--source kubernetes`, a kubeconfig in its state dir); returns the
    /// kubeconfig's path, for other clients (a controller).
    pub fn serve_agent_of(&self, node: &mut crate::Node) -> String {
        let path = node.state_dir.join("kubeconfig");
        std::fs::write(&path, self.kubeconfig()).unwrap();
        let path = path.to_str().unwrap().to_string();
        node.set_agent_args(&["--source", "kubernetes", "--kubeconfig", &path]);
        path
    }

    /// A kubeconfig that points kube-rs at this server.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{}\"}}\nusers:\n- name: test\n  user: {{}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: test}}\ncurrent-context: test\n",
            self.url
        )
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One request's target: its path and query parameters.
fn parse_target(target: &str) -> (String, BTreeMap<String, String>) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let params = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), decode(v)))
        .collect();
    (path.to_string(), params)
}

fn decode(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `field=value` on one dotted field of the object.
fn selected(object: &Value, selector: Option<&String>) -> bool {
    let Some(sel) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    let Some((field, want)) = sel.split_once('=') else {
        return true;
    };
    let pointer = format!("/{}", field.replace('.', "/"));
    object.pointer(&pointer).and_then(Value::as_str) == Some(want)
}

/// Serves requests on one connection until it closes.
fn serve(shared: &Shared, stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let mut length = 0usize;
        let mut content_type = String::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                } else if k.eq_ignore_ascii_case("content-type") {
                    content_type = v.trim().to_string();
                }
            }
        }
        let mut body = vec![0u8; length];
        if std::io::Read::read_exact(&mut reader, &mut body).is_err() {
            return;
        }
        let (path, params) = parse_target(target);
        let Some(target) = Target::parse(&path) else {
            let body = status(404, "NotFound", &format!("no such path {path}"));
            if !respond(&mut out, 404, &body) {
                return;
            }
            continue;
        };
        let ok = match (method, &target.name) {
            ("GET", None) if params.get("watch").map(String::as_str) == Some("true") => {
                watch(shared, &mut out, &target, &params)
            }
            ("GET", None) => list(shared, &mut out, &target, &params),
            _ => {
                let (code, body) = write(shared, method, &target, &content_type, &body);
                respond(&mut out, code, &body)
            }
        };
        if !ok || shared.stopped.load(Ordering::SeqCst) {
            return;
        }
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn respond(out: &mut TcpStream, code: u16, body: &Value) -> bool {
    let body = body.to_string();
    // One write: the head and the body in one segment.
    let response = format!(
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    out.write_all(response.as_bytes())
        .and_then(|()| out.flush())
        .is_ok()
}

fn list(
    shared: &Shared,
    out: &mut TcpStream,
    target: &Target,
    params: &BTreeMap<String, String>,
) -> bool {
    let path = target.collection.as_str();
    let mut st = shared.state.lock().unwrap();
    let (rv, mut items) = match params.get("continue") {
        Some(token) => match st.pages.remove(token) {
            Some(page) => page,
            None => {
                drop(st);
                let body = status(
                    410,
                    "Expired",
                    &format!("continue token {token} is unknown or used"),
                );
                return respond(out, 410, &body);
            }
        },
        None => {
            *st.lists.entry(path.to_string()).or_default() += 1;
            let items = st
                .objects
                .iter()
                .filter(|((c, ns, _), o)| {
                    c == path && target.in_namespace(ns) && selected(o, params.get("fieldSelector"))
                })
                .map(|(_, o)| o.clone())
                .collect::<Vec<Value>>();
            (st.resource_version, items)
        }
    };
    let limit = params
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|&l| l > 0);
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some(limit) = limit.filter(|&l| items.len() > l) {
        let rest = items.split_off(limit);
        st.tokens += 1;
        let token = format!("{path}#{}", st.tokens);
        metadata["continue"] = token.clone().into();
        metadata["remainingItemCount"] = rest.len().into();
        st.pages.insert(token, (rv, rest));
    }
    drop(st);
    let body = json!({
        "kind": "List", "apiVersion": "v1",
        "metadata": metadata,
        "items": items,
    });
    respond(out, 200, &body)
}

fn chunk(out: &mut TcpStream, event: &Value) -> bool {
    let line = format!("{event}\n");
    let chunk = format!("{:x}\r\n{line}\r\n", line.len());
    out.write_all(chunk.as_bytes())
        .and_then(|()| out.flush())
        .is_ok()
}

fn watch(
    shared: &Shared,
    out: &mut TcpStream,
    target: &Target,
    params: &BTreeMap<String, String>,
) -> bool {
    let path = target.collection.as_str();
    let from: u64 = params
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = params.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(300));
    if write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .is_err()
    {
        return false;
    }
    let started = Instant::now();
    let mut st = shared.state.lock().unwrap();
    let epoch = st.epoch;
    if from < st.oldest {
        *st.gone.entry(path.to_string()).or_default() += 1;
        drop(st);
        let gone = json!({"type": "ERROR", "object": status(410, "Expired", &format!("too old resource version: {from}"))});
        return chunk(out, &gone) && write!(out, "0\r\n\r\n").and_then(|()| out.flush()).is_ok();
    }
    let mut sent = from;
    loop {
        if shared.stopped.load(Ordering::SeqCst) {
            return false;
        }
        if st.epoch != epoch || started.elapsed() >= timeout {
            drop(st);
            return write!(out, "0\r\n\r\n").and_then(|()| out.flush()).is_ok();
        }
        // The history is in resourceVersion order: only what is newer is
        // looked at (a scan of every event since the start, on each wake
        // of each watch and under the lock, was the bed's own cost at
        // 100,000 VMs, not the agent's).
        let newer = st.history.partition_point(|(rv, ..)| *rv <= sent);
        let events: Vec<Value> = st.history[newer..]
            .iter()
            .filter(|(rv, c, _, o)| {
                *rv > sent
                    && c == path
                    && target.in_namespace(o["metadata"]["namespace"].as_str().unwrap_or(""))
                    && selected(o, params.get("fieldSelector"))
            })
            .map(|(_, _, kind, o)| json!({"type": kind, "object": o}))
            .collect();
        let latest = st.resource_version;
        drop(st);
        for e in &events {
            if !chunk(out, e) {
                return false;
            }
        }
        if bookmarks {
            let kind_of = path.rsplit('/').next().unwrap_or("");
            let bookmark = json!({"type": "BOOKMARK", "object": {
                "kind": kind_of, "apiVersion": "v1",
                "metadata": {"resourceVersion": latest.to_string()}}});
            if !chunk(out, &bookmark) {
                return false;
            }
        }
        sent = latest.max(sent);
        st = shared.state.lock().unwrap();
        if st.resource_version == sent
            && st.epoch == epoch
            && !shared.stopped.load(Ordering::SeqCst)
        {
            st = shared
                .changed
                .wait_timeout(st, Duration::from_millis(500))
                .unwrap()
                .0;
        }
    }
}

/// What a request path names: a collection (cluster-wide form, as
/// [`collection`] names it), maybe within one namespace, maybe one object
/// of it, maybe that object's status subresource.
struct Target {
    collection: String,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

impl Target {
    fn parse(path: &str) -> Option<Target> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let prefix = match segments.first() {
            Some(&"api") => 2,
            Some(&"apis") => 3,
            _ => return None,
        };
        if segments.len() <= prefix {
            return None;
        }
        let base = segments[..prefix].join("/");
        let mut rest = &segments[prefix..];
        let mut namespace = None;
        // `namespaces/NS/PLURAL...`; `namespaces[/NS]` alone is the
        // Namespace kind itself.
        if rest[0] == "namespaces" && rest.len() >= 3 {
            namespace = Some(rest[1].to_string());
            rest = &rest[2..];
        }
        let (plural, name, status) = match rest {
            [p] => (*p, None, false),
            [p, n] => (*p, Some(n.to_string()), false),
            [p, n, "status"] => (*p, Some(n.to_string()), true),
            _ => return None,
        };
        Some(Target {
            collection: format!("/{base}/{plural}"),
            namespace,
            name,
            status,
        })
    }

    fn in_namespace(&self, ns: &str) -> bool {
        self.namespace.as_deref().is_none_or(|want| want == ns)
    }

    fn key(&self, name: &str) -> (String, String, String) {
        (
            self.collection.clone(),
            self.namespace.clone().unwrap_or_default(),
            name.to_string(),
        )
    }
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// One write (or a `GET` of one object): the status code and the body.
/// 409 Conflict, with the API server's message.
fn conflict(message: &str) -> (u16, Value) {
    (409, status(409, "Conflict", message))
}

/// A ConfigMap's data limit (core/v1 validation, `MaxSecretSize`).
const CONFIGMAP_MAX_BYTES: usize = 1 << 20;

fn write(
    shared: &Shared,
    method: &str,
    target: &Target,
    content_type: &str,
    body: &[u8],
) -> (u16, Value) {
    let parsed: Result<Value, _> = if body.is_empty() {
        Ok(Value::Null)
    } else {
        serde_json::from_slice(body)
    };
    let Ok(body) = parsed else {
        return (400, status(400, "BadRequest", "the body is not JSON"));
    };
    // As the API server validates a ConfigMap: its data at most 1 MiB.
    if target.collection.ends_with("/configmaps") && matches!(method, "POST" | "PUT") {
        let size: usize = body["data"]
            .as_object()
            .map(|d| d.values().filter_map(Value::as_str).map(str::len).sum())
            .unwrap_or(0);
        if size > CONFIGMAP_MAX_BYTES {
            let name = body["metadata"]["name"].as_str().unwrap_or("");
            let message = format!(
                "ConfigMap {name:?} is invalid: []: Too long: must have at most {CONFIGMAP_MAX_BYTES} bytes"
            );
            return (422, status(422, "Invalid", &message));
        }
    }
    let mut st = shared.state.lock().unwrap();
    if matches!(method, "PUT" | "POST")
        && st
            .race
            .as_ref()
            .is_some_and(|(c, _)| *c == target.collection)
        && let Some((_, racer)) = st.race.take()
    {
        for o in racer(&body) {
            st.put(o);
        }
    }
    let result = write_locked(&mut st, method, target, content_type, body);
    let coll = target.collection.clone();
    match result.0 {
        409 => *st.conflicts.entry(coll).or_default() += 1,
        200..=299 if method != "GET" => *st.writes.entry(coll).or_default() += 1,
        _ => {}
    }
    drop(st);
    shared.changed.notify_all();
    result
}

fn write_locked(
    st: &mut State,
    method: &str,
    target: &Target,
    content_type: &str,
    mut body: Value,
) -> (u16, Value) {
    let ns = target.namespace.clone().unwrap_or_default();
    let not_found = |name: &str| {
        (
            404,
            status(
                404,
                "NotFound",
                &format!("{} {name:?} not found", target.collection),
            ),
        )
    };
    if method == "POST" {
        if target.name.is_some() {
            return (405, status(405, "MethodNotAllowed", "POST to a collection"));
        }
        let Some(name) = body["metadata"]["name"].as_str().map(str::to_string) else {
            return (422, status(422, "Invalid", "metadata.name: Required value"));
        };
        if st.objects.contains_key(&target.key(&name)) {
            return (
                409,
                status(409, "AlreadyExists", &format!("{name:?} already exists")),
            );
        }
        if !ns.is_empty() {
            body["metadata"]["namespace"] = ns.clone().into();
        }
        let uid = format!("uid-{}-{}", st.resource_version + 1, name);
        body["metadata"]["uid"] = uid.into();
        body["metadata"]["creationTimestamp"] = "2026-12-01T00:00:00Z".into();
        return (201, st.store(&target.collection, &ns, &name, body));
    }
    let Some(name) = target.name.clone() else {
        return (405, status(405, "MethodNotAllowed", "not on a collection"));
    };
    let Some(current) = st.objects.get(&target.key(&name)).cloned() else {
        return not_found(&name);
    };
    match method {
        "GET" => (200, current),
        "DELETE" => {
            // DeleteOptions' preconditions: only the object of that uid.
            let want = body["preconditions"]["uid"].as_str();
            if want.is_some_and(|uid| Some(uid) != current["metadata"]["uid"].as_str()) {
                return conflict(&format!(
                    "Precondition failed: UID in precondition: {}, UID in object meta: {}",
                    want.unwrap_or(""),
                    current["metadata"]["uid"].as_str().unwrap_or("")
                ));
            }
            (200, st.remove(&target.collection, &ns, &name).unwrap())
        }
        "PUT" => {
            let given = body["metadata"]["resourceVersion"].as_str();
            if given.is_some_and(|rv| Some(rv) != current["metadata"]["resourceVersion"].as_str()) {
                return conflict(&format!(
                    "Operation cannot be fulfilled on {} {name:?}: the object has been modified; please apply your changes to the latest version and try again",
                    target.collection
                ));
            }
            let next = if target.status {
                let mut next = current.clone();
                next["status"] = body["status"].clone();
                next
            } else {
                // The status subresource is written only through /status,
                // where the kind has one; a test never relies on this.
                let mut next = body;
                next["metadata"]["uid"] = current["metadata"]["uid"].clone();
                next["metadata"]["creationTimestamp"] =
                    current["metadata"]["creationTimestamp"].clone();
                next
            };
            (200, st.store(&target.collection, &ns, &name, next))
        }
        "PATCH" => {
            if content_type.starts_with("application/json-patch") {
                return (
                    415,
                    status(415, "UnsupportedMediaType", "JSON patch is not served"),
                );
            }
            let given = body["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_string);
            if given.is_some_and(|rv| {
                Some(rv.as_str()) != current["metadata"]["resourceVersion"].as_str()
            }) {
                return (409, status(409, "Conflict", "the object has been modified"));
            }
            let mut next = current.clone();
            if target.status {
                merge(&mut next["status"], &body["status"]);
            } else {
                if let Some(m) = body.as_object_mut() {
                    m.remove("status");
                }
                merge(&mut next, &body);
            }
            (200, st.store(&target.collection, &ns, &name, next))
        }
        _ => (
            405,
            status(405, "MethodNotAllowed", &format!("{method} is not served")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;
    use crate::{Netns, unique_tag};

    /// `GET path` from inside the namespace at `netns`: status and body.
    fn get(netns: &str, url: &str, path: &str) -> (u16, Value) {
        let (netns, addr, path) = (
            netns.to_string(),
            url.trim_start_matches("http://").to_string(),
            path.to_string(),
        );
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&netns).unwrap();
            // SAFETY: setns on a valid netns fd; it affects this thread only.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0);
            let mut stream = TcpStream::connect(&addr).unwrap();
            write!(stream, "GET {path} HTTP/1.1\r\nHost: api\r\n\r\n").unwrap();
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let code = line.split_whitespace().nth(1).unwrap().parse().unwrap();
            let mut length = 0;
            loop {
                line.clear();
                reader.read_line(&mut line).unwrap();
                if line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            (code, serde_json::from_slice(&body).unwrap())
        })
        .join()
        .unwrap()
    }

    fn pod(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "vms"}})
    }

    fn names(list: &Value) -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }

    /// kube-rs' watchers list in pages of 500: every page comes from the
    /// first page's snapshot, a used or unknown token is 410 Expired, and
    /// one paged list counts as one list.
    #[test]
    fn lists_come_in_pages_of_limit_from_one_snapshot() {
        let ns = Netns::new(format!("vt{}-api", unique_tag()));
        let api = ApiServer::start(&ns.path());
        for name in ["a", "b", "c", "d", "e"] {
            api.put(pod(name));
        }
        let (code, first) = get(&ns.path(), &api.url, "/api/v1/pods?limit=2");
        assert_eq!(code, 200, "{first}");
        assert_eq!(names(&first), ["a", "b"]);
        assert_eq!(first["metadata"]["remainingItemCount"], 3);
        let rv = first["metadata"]["resourceVersion"].clone();
        // Written after the first page: not in this list's pages.
        api.put(pod("f"));
        let mut seen = names(&first);
        let mut token = first["metadata"]["continue"].as_str().unwrap().to_string();
        let used = token.clone();
        loop {
            let (code, page) = get(
                &ns.path(),
                &api.url,
                &format!("/api/v1/pods?limit=2&continue={token}"),
            );
            assert_eq!(code, 200, "{page}");
            assert_eq!(page["metadata"]["resourceVersion"], rv);
            seen.extend(names(&page));
            match page["metadata"]["continue"].as_str() {
                Some(t) => token = t.to_string(),
                None => break,
            }
        }
        assert_eq!(seen, ["a", "b", "c", "d", "e"]);
        let (code, expired) = get(
            &ns.path(),
            &api.url,
            &format!("/api/v1/pods?limit=2&continue={used}"),
        );
        assert_eq!(code, 410, "{expired}");
        assert_eq!(expired["reason"], "Expired");
        // Without a limit: everything, now with f.
        let (_, all) = get(&ns.path(), &api.url, "/api/v1/pods");
        assert_eq!(names(&all), ["a", "b", "c", "d", "e", "f"]);
        assert_eq!(api.lists("/api/v1/pods"), 2);
    }
}
