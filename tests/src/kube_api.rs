//! A small Kubernetes API server for tests, in memory, over real HTTP/1.1
//! (plain TCP on 127.0.0.1): enough of the API for kube-rs watchers and
//! reflectors. Collections are cluster-wide (`/api/v1/pods`,
//! `/apis/GROUP/VERSION/PLURAL`); `GET` lists (with `fieldSelector` on one
//! field, `field=value`) or, with `watch=true`, streams events after the
//! given `resourceVersion` as chunked JSON lines, with `BOOKMARK` events
//! while idle when `allowWatchBookmarks=true`. A watch from a
//! resourceVersion older than the kept history gets a 410 `Expired`
//! ERROR event, as from a real API server after compaction. No
//! authentication, no writes from clients yet (objects are put by the
//! test).

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
        k => format!("{}s", k.to_lowercase()),
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
    /// (resourceVersion, collection, event type, object).
    history: Vec<(u64, String, &'static str, Value)>,
    /// Watches from before this resourceVersion get 410 Gone.
    oldest: u64,
    /// Open watches end when this changes.
    epoch: u64,
    /// List requests served, by collection.
    lists: BTreeMap<String, u64>,
    /// Watch requests answered with 410, by collection.
    gone: BTreeMap<String, u64>,
}

impl State {
    fn put(&mut self, mut object: Value) {
        let coll = collection(
            object["apiVersion"].as_str().unwrap(),
            object["kind"].as_str().unwrap(),
        );
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        self.resource_version += 1;
        let rv = self.resource_version;
        object["metadata"]["resourceVersion"] = rv.to_string().into();
        let kind = if self
            .objects
            .insert((coll.clone(), ns, name), object.clone())
            .is_some()
        {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.history.push((rv, coll, kind, object));
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
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Serves on 127.0.0.1 of the network namespace at `netns` (a path
    /// such as `/run/netns/NAME`): where the agent under test runs.
    pub fn start(netns: &str) -> ApiServer {
        let netns = netns.to_string();
        // The socket belongs to the namespace of the thread that makes it.
        let listener = std::thread::spawn(move || {
            let ns = std::fs::File::open(&netns).expect("opening the netns");
            // SAFETY: setns on a valid netns fd; it affects this thread only.
            let rc =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {netns}: {}", std::io::Error::last_os_error());
            TcpListener::bind("127.0.0.1:0").unwrap()
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
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        if std::io::Read::read_exact(&mut reader, &mut body).is_err() {
            return;
        }
        let (path, params) = parse_target(target);
        let ok = if method != "GET" {
            respond(
                &mut out,
                405,
                &status(405, "MethodNotAllowed", "only GET is served"),
            )
        } else if params.get("watch").map(String::as_str) == Some("true") {
            watch(shared, &mut out, &path, &params)
        } else {
            list(shared, &mut out, &path, &params)
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
    write!(
        out,
        "HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .and_then(|()| out.flush())
    .is_ok()
}

fn list(
    shared: &Shared,
    out: &mut TcpStream,
    path: &str,
    params: &BTreeMap<String, String>,
) -> bool {
    let mut st = shared.state.lock().unwrap();
    *st.lists.entry(path.to_string()).or_default() += 1;
    let items: Vec<Value> = st
        .objects
        .iter()
        .filter(|((c, _, _), o)| c == path && selected(o, params.get("fieldSelector")))
        .map(|(_, o)| o.clone())
        .collect();
    let body = json!({
        "kind": "List", "apiVersion": "v1",
        "metadata": {"resourceVersion": st.resource_version.to_string()},
        "items": items,
    });
    drop(st);
    respond(out, 200, &body)
}

fn chunk(out: &mut TcpStream, event: &Value) -> bool {
    let line = format!("{event}\n");
    write!(out, "{:x}\r\n{line}\r\n", line.len())
        .and_then(|()| out.flush())
        .is_ok()
}

fn watch(
    shared: &Shared,
    out: &mut TcpStream,
    path: &str,
    params: &BTreeMap<String, String>,
) -> bool {
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
        let events: Vec<Value> = st
            .history
            .iter()
            .filter(|(rv, c, _, o)| {
                *rv > sent && c == path && selected(o, params.get("fieldSelector"))
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
