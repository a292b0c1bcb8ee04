//! What the agent knows right now, as the API, the CLI, metrics and the
//! status file show it. The reconcile loop publishes a new [`View`] after
//! each round into [`Published`], with its heartbeat and reconcile times;
//! readers share it (`Arc`), taken under a short read lock.

use std::{
    borrow::Cow,
    sync::{
        Arc, Mutex, RwLock, TryLockError,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::Sender,
    },
    time::{Duration, Instant},
};

use prometheus::{Histogram, HistogramOpts};
use serde::{Deserialize, Serialize};

use crate::{config::ConfigError, sys::clock, sys::events::Wake};

// The parts of the view the API shows, and where an attachment stands.
pub use vmpath_api::types::{AttachmentView, IpView, LearnedRefusalView, NetworkView, state};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct View {
    pub node: String,
    pub bpffs: String,
    pub config_dir: String,
    pub config_errors: Vec<ConfigError>,
    /// Accepted documents the operator should look at.
    #[serde(default)]
    pub config_warnings: Vec<ConfigError>,
    pub networks: Vec<NetworkView>,
    /// Shared entries: a round builds again only the VM interfaces that
    /// changed or have a port here, and reuses the others' (at 10,000 VM
    /// interfaces, building every entry was a round's largest stage), a
    /// whole chunk of them at a time where none changed.
    pub attachments: Rows,
    /// Attachments active here whose port does not exist yet.
    pub missing_ports: Vec<String>,
    pub problems: Vec<String>,
    /// NetworkPolicies by the index the data path reports them with.
    #[serde(default)]
    pub policies: Vec<String>,
    /// Reconcile rounds that changed the data path, and the last one's time.
    pub reconciles: u64,
    pub last_reconcile_seconds: f64,
    pub last_reconcile_unix: u64,
    pub ready: bool,
    /// How many views this agent has published, this one included: the
    /// API's `/healthz` gives the latest, and `status.json` (written after
    /// the round answered, on a thread of its own) has caught up with the
    /// API once its number is as high.
    #[serde(default)]
    pub generation: u64,
    /// Which of `attachments` may have a port on this node (active here,
    /// or a migration's target here), by index: what a CNI ADD looks its
    /// port up in, instead of every VM interface of the cluster. `None`
    /// (a view read back from `status.json`, or made by hand): every one.
    #[serde(skip)]
    pub on_node: Option<Vec<u32>>,
}

impl View {
    /// A copy with no VM interfaces (the rest is small), for `status.json`
    /// to add the entries it kept as text. Every field named: a new one
    /// must say whether it is copied.
    pub fn clone_without_attachments(&self) -> View {
        let View {
            node,
            bpffs,
            config_dir,
            config_errors,
            config_warnings,
            networks,
            attachments: _,
            missing_ports,
            problems,
            policies,
            reconciles,
            last_reconcile_seconds,
            last_reconcile_unix,
            ready,
            generation,
            on_node: _,
        } = self;
        View {
            node: node.clone(),
            bpffs: bpffs.clone(),
            config_dir: config_dir.clone(),
            config_errors: config_errors.clone(),
            config_warnings: config_warnings.clone(),
            networks: networks.clone(),
            attachments: Rows::default(),
            missing_ports: missing_ports.clone(),
            problems: problems.clone(),
            policies: policies.clone(),
            reconciles: *reconciles,
            last_reconcile_seconds: *last_reconcile_seconds,
            last_reconcile_unix: *last_reconcile_unix,
            ready: *ready,
            generation: *generation,
            on_node: None,
        }
    }

    /// The entries that may have a port on this node ([`on_node`](Self::on_node)),
    /// or every entry when the view does not say.
    /// (Those are built rows: another node's are not listed.)
    pub fn maybe_on_node(&self) -> impl Iterator<Item = &AttachmentView> {
        let (listed, all) = match &self.on_node {
            Some(on) => (Some(on.iter()), None),
            None => (None, Some(self.attachments.rows())),
        };
        listed
            .into_iter()
            .flatten()
            .filter_map(|&i| self.attachments.get(i as usize))
            .chain(all.into_iter().flatten())
            .filter_map(Row::built)
            .map(|a| &**a)
    }

    /// The state of `a` on this view's node. Exclusive: a pending
    /// migration counts as `migrating` whichever side this node is.
    pub fn state_of(&self, a: &AttachmentView) -> &'static str {
        if a.migration == "pending" {
            state::MIGRATING
        } else if a.node != self.node {
            state::REMOTE
        } else if a.ifindex.is_some() {
            state::LOCAL
        } else {
            state::MISSING_PORT
        }
    }

    /// [`state_of`](Self::state_of) a row, without making another node's.
    pub fn state_of_row(&self, row: &Row) -> &'static str {
        match row {
            Row::Built(a) => self.state_of(a),
            Row::Elsewhere(a) if a.migration.is_some() && !a.cut_over => state::MIGRATING,
            Row::Elsewhere(a) if a.active_node() != self.node => state::REMOTE,
            // Active here yet made elsewhere: no port of this node's.
            Row::Elsewhere(_) => state::MISSING_PORT,
        }
    }

    /// Ifindexes of the attachments running here with their port programmed.
    pub fn local_ports(&self) -> impl Iterator<Item = (&AttachmentView, u32)> {
        self.maybe_on_node()
            .filter(|a| self.state_of(a) == state::LOCAL)
            .filter_map(|a| Some((a, a.ifindex?)))
    }

    pub fn attachments_of_vm<'a>(
        &'a self,
        namespace: &'a str,
        vm: &'a str,
    ) -> impl Iterator<Item = Cow<'a, AttachmentView>> {
        self.attachments
            .rows()
            .filter(move |r| match r {
                Row::Built(a) => a.namespace == namespace && a.vm == vm,
                Row::Elsewhere(a) => a.key.namespace == namespace && a.key.vm == vm,
            })
            .map(Row::view)
    }
}

/// Rounds that stopped after validation (`round::Outcome::Unchanged`)
/// since the agent started: `vmpath_rounds_unchanged_total`. Beside the
/// view, which the metrics read, below the round that counts them.
static ROUNDS_UNCHANGED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn count_round_unchanged() {
    ROUNDS_UNCHANGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

pub fn rounds_unchanged() -> u64 {
    ROUNDS_UNCHANGED.load(std::sync::atomic::Ordering::Relaxed)
}

/// How many rows a [`Rows`] chunk made by `push` holds.
pub const ROWS_CHUNK: usize = 64;

/// One VM interface of the view.
#[derive(Debug, Clone)]
pub enum Row {
    /// Built by the round: a VM interface that may have a port here (its
    /// port, its learned addresses, a pending migration's target port).
    Built(Arc<AttachmentView>),
    /// Another node's VM interface, as the round resolved it (its
    /// document shared with the round's): made into its row only when
    /// read (the API, `status.json`). At 100,000 VM interfaces the rows
    /// kept built, with their text, were 130 MB.
    Elsewhere(Arc<crate::resolve::resolved::Attachment>),
}

impl Row {
    /// The row as the API shows it.
    pub fn view(&self) -> Cow<'_, AttachmentView> {
        match self {
            Row::Built(v) => Cow::Borrowed(&**v),
            Row::Elsewhere(a) => Cow::Owned(row_elsewhere(a)),
        }
    }

    /// The built row, if this is one.
    pub fn built(&self) -> Option<&Arc<AttachmentView>> {
        match self {
            Row::Built(v) => Some(v),
            Row::Elsewhere(_) => None,
        }
    }

    /// The same row (shared), not only an equal one.
    pub fn same(&self, other: &Row) -> bool {
        match (self, other) {
            (Row::Built(a), Row::Built(b)) => Arc::ptr_eq(a, b),
            (Row::Elsewhere(a), Row::Elsewhere(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Its network, without making the row.
    pub fn network(&self) -> &str {
        match self {
            Row::Built(v) => &v.network,
            Row::Elsewhere(a) => &a.network,
        }
    }
}

impl From<AttachmentView> for Row {
    fn from(v: AttachmentView) -> Self {
        Row::Built(Arc::new(v))
    }
}

impl From<Arc<AttachmentView>> for Row {
    fn from(v: Arc<AttachmentView>) -> Self {
        Row::Built(v)
    }
}

/// The row of a VM interface that has no port on this node: what its
/// resolved entry says, nothing of this node's (no port, no learned
/// addresses). A round builds a row with a port here from it.
pub fn row_elsewhere(a: &crate::resolve::resolved::Attachment) -> AttachmentView {
    let (migration, target) = match &a.migration {
        None => ("none".to_string(), None),
        Some(m) if a.cut_over => ("cut-over".to_string(), Some(m.target_node.clone())),
        Some(m) => ("pending".to_string(), Some(m.target_node.clone())),
    };
    AttachmentView {
        name: a.name().to_string(),
        namespace: a.key.namespace.to_string(),
        vm: a.key.vm.to_string(),
        interface: a.key.interface.to_string(),
        network: a.network.to_string(),
        node: a.active_node().to_string(),
        port: a.active_port().to_string(),
        ifindex: None,
        mac: a.mac_resolved.map(|(m, _)| crate::config::format_mac(&m)),
        mac_origin: a.mac_resolved.map(|(_, o)| o),
        ips: a
            .addresses
            .iter()
            .map(|(ip, origin)| IpView {
                address: ip.to_string(),
                origin: *origin,
            })
            .collect(),
        learned_refused: Vec::new(),
        learned_contested: Vec::new(),
        migration,
        migration_target: target,
        pending_port: None,
    }
}

/// A view's VM interface rows, in chunks of [`ROWS_CHUNK`] shared between
/// views: a chunk none of whose rows changed is the last view's, taken
/// whole (at 10,000 VM interfaces a list of every row's `Arc` made again
/// each round was most of the view's time). Reads as one list; written
/// as one in JSON.
#[derive(Debug, Clone, Default)]
pub struct Rows {
    chunks: Vec<Arc<Vec<Row>>>,
    /// Where each chunk starts: chunks taken whole from the last view
    /// keep their size, so they are of any size up to [`ROWS_CHUNK`].
    starts: Vec<usize>,
    len: usize,
    /// The last chunk is this list's own, still filled by `push` (not one
    /// taken whole from another view).
    open: bool,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, i: usize) -> Option<&Row> {
        if i >= self.len {
            return None;
        }
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        self.chunks[k].get(i - self.starts[k])
    }

    /// Every row, as the API shows it (another node's made as it is read).
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Cow<'_, AttachmentView>> + Clone {
        self.rows().map(Row::view)
    }

    /// Every row as kept.
    pub fn rows(&self) -> impl DoubleEndedIterator<Item = &Row> + Clone {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    /// Each chunk, shared, with where it starts.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, &Arc<Vec<Row>>)> {
        self.starts.iter().copied().zip(&self.chunks)
    }

    /// The `k`th chunk, shared.
    pub fn chunk(&self, k: usize) -> Option<&Arc<Vec<Row>>> {
        self.chunks.get(k)
    }

    /// How many chunks it is in.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// Adds a row at the end.
    pub fn push(&mut self, row: impl Into<Row>) {
        let row = row.into();
        match self.chunks.last_mut() {
            Some(last) if self.open && last.len() < ROWS_CHUNK => Arc::make_mut(last).push(row),
            _ => {
                let mut chunk = Vec::with_capacity(ROWS_CHUNK);
                chunk.push(row);
                self.starts.push(self.len);
                self.chunks.push(Arc::new(chunk));
                self.open = true;
            }
        }
        self.len += 1;
    }

    /// Adds a whole chunk at the end, shared.
    pub fn push_chunk(&mut self, chunk: Arc<Vec<Row>>) {
        if chunk.is_empty() {
            return;
        }
        self.starts.push(self.len);
        self.len += chunk.len();
        self.chunks.push(chunk);
        self.open = false;
    }
}

impl std::ops::Index<usize> for Rows {
    type Output = Row;
    fn index(&self, i: usize) -> &Self::Output {
        self.get(i).expect("a row within the view")
    }
}

impl FromIterator<Row> for Rows {
    fn from_iter<I: IntoIterator<Item = Row>>(iter: I) -> Self {
        let mut rows = Rows::default();
        for row in iter {
            rows.push(row);
        }
        rows
    }
}

impl FromIterator<Arc<AttachmentView>> for Rows {
    fn from_iter<I: IntoIterator<Item = Arc<AttachmentView>>>(iter: I) -> Self {
        let mut rows = Rows::default();
        for row in iter {
            rows.push(row);
        }
        rows
    }
}

impl From<Vec<Arc<AttachmentView>>> for Rows {
    fn from(rows: Vec<Arc<AttachmentView>>) -> Self {
        rows.into_iter().collect()
    }
}

impl PartialEq for Rows {
    /// Row by row, by value.
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}

impl Serialize for Rows {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for Rows {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Ok(Vec::<Arc<AttachmentView>>::deserialize(deserializer)?.into())
    }
}

/// What the reconcile loop publishes and every reader (API, metrics)
/// reads: the view, the loop's liveness, its reconcile times, and which
/// data path the pinned maps belong to.
pub struct Published {
    /// Shared: a reader (an ADD's reply, the API) takes it without a copy
    /// of every VM interface.
    view: RwLock<Arc<View>>,
    loop_exited: AtomicBool,
    last_heartbeat_ms: AtomicU64,
    /// Bumped each time the loop (re)opens the data path, so readers that
    /// hold the pinned maps open know when to reopen them.
    dataplane_generation: AtomicU64,
    reconcile_seconds: Histogram,
    /// Wakes the reconcile loop from another thread (set by the loop).
    waker: Mutex<Option<Sender<Wake>>>,
}

pub type SharedView = Arc<Published>;

/// A heartbeat older than this means the loop is stuck.
const HEARTBEAT_STALE: Duration = Duration::from_secs(60);

impl Published {
    pub fn new(view: View) -> Self {
        let reconcile_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "vmpath_reconcile_duration_seconds",
                "Time to plan and program the data path, per reconcile round that changed it.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )
        .expect("a valid histogram");
        Published {
            view: RwLock::new(Arc::new(view)),
            loop_exited: AtomicBool::new(false),
            last_heartbeat_ms: AtomicU64::new(0),
            dataplane_generation: AtomicU64::new(0),
            reconcile_seconds,
            waker: Mutex::new(None),
        }
    }

    /// Lets other threads wake the loop through `tx`.
    pub fn set_waker(&self, tx: Sender<Wake>) {
        *self.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    }

    /// Wakes the reconcile loop now (no-op before it set a waker).
    pub fn wake(&self, why: Wake) {
        if let Some(tx) = self
            .waker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let _ = tx.send(why);
        }
    }

    /// The current view (shared: the lock is held briefly, nothing is
    /// copied).
    pub fn view(&self) -> Arc<View> {
        match self.view.read() {
            Ok(v) => v.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replaces the view; readers see the new one from their next read.
    pub fn publish(&self, view: impl Into<Arc<View>>) {
        let view = view.into();
        let old = match self.view.write() {
            Ok(mut v) => std::mem::replace(&mut *v, view),
            Err(poisoned) => std::mem::replace(&mut *poisoned.into_inner(), view),
        };
        // Freed after the lock, off the loop's path: the last view's rows
        // are a cluster's VM interfaces, and an ADD waits to read the new
        // one.
        crate::sys::drop_later::drop_later(old);
    }

    /// Called by the reconcile loop on every round.
    pub fn heartbeat(&self) {
        self.last_heartbeat_ms
            .store(clock::unix_now_ms(), Ordering::Relaxed);
    }

    /// Marks the reconcile loop as gone (it returned or panicked).
    pub fn loop_exited(&self) {
        self.loop_exited.store(true, Ordering::Relaxed);
    }

    /// Records one reconcile round that changed the data path.
    pub fn observe_reconcile(&self, seconds: f64) {
        self.reconcile_seconds.observe(seconds);
    }

    /// The reconcile rounds' durations, for metrics.
    pub fn reconcile_seconds(&self) -> &Histogram {
        &self.reconcile_seconds
    }

    /// The loop opened the data path (anew): pinned maps held by readers
    /// may be stale.
    pub fn dataplane_opened(&self) {
        self.dataplane_generation.fetch_add(1, Ordering::Relaxed);
    }

    /// 0 until the loop first opened the data path.
    pub fn dataplane_generation(&self) -> u64 {
        self.dataplane_generation.load(Ordering::Relaxed)
    }

    /// Whether the reconcile loop is alive: not exited, a recent heartbeat
    /// (if it ever beat), and its view lockable.
    pub fn alive(&self) -> Result<(), String> {
        if self.loop_exited.load(Ordering::Relaxed) {
            return Err("the reconcile loop has exited".into());
        }
        let beat = self.last_heartbeat_ms.load(Ordering::Relaxed);
        if beat != 0 {
            let now = clock::unix_now() * 1000;
            if now.saturating_sub(beat) > HEARTBEAT_STALE.as_millis() as u64 + 1000 {
                return Err(format!(
                    "no reconcile round for {} s",
                    now.saturating_sub(beat) / 1000
                ));
            }
        }
        // The loop holds the write lock only to swap in a new view: if it
        // cannot be had for seconds, the loop is stuck; if it is poisoned,
        // it panicked.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match self.view.try_read() {
                Ok(_) => return Ok(()),
                Err(TryLockError::Poisoned(_)) => {
                    return Err("the reconcile loop panicked".into());
                }
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err("the agent's state stayed locked for 2 s".into());
                }
            }
        }
    }
}

impl Default for Published {
    fn default() -> Self {
        Published::new(View::default())
    }
}

/// A view with one attachment in each state, for the readers' tests.
#[cfg(test)]
pub(crate) mod sample {
    use super::*;
    use crate::resolve::resolved::Origin;

    pub fn attachment(
        vm: &str,
        node: &str,
        ifindex: Option<u32>,
        migration: &str,
    ) -> AttachmentView {
        AttachmentView {
            name: vm.into(),
            namespace: "prod".into(),
            vm: vm.into(),
            interface: "eth0".into(),
            network: "blue".into(),
            node: node.into(),
            port: format!("p-{vm}"),
            ifindex,
            mac: Some("52:54:00:00:00:01".into()),
            mac_origin: Some(Origin::Given),
            ips: vec![IpView {
                address: "10.20.0.5/16".into(),
                origin: Origin::Claimed,
            }],
            learned_refused: Vec::new(),
            learned_contested: Vec::new(),
            migration: migration.into(),
            migration_target: (migration != "none").then(|| "b".into()),
            pending_port: None,
        }
    }

    /// On node `a`: vm1 local (ifindex 11), vm2 remote, vm3 missing its
    /// port, vm4 migrating; one refused document.
    pub fn view() -> View {
        View {
            node: "a".into(),
            bpffs: "/nonexistent/vmpath-test-bpffs".into(),
            config_dir: "/etc/vmpath".into(),
            config_errors: vec![ConfigError {
                file: "/etc/vmpath/bad.yaml".into(),
                document: "Attachment prod/vm9".into(),
                field: "spec.mac".into(),
                message: "\"zz\" is not a MAC address (six hex bytes)".into(),
                about: None,
                reason: None,
            }],
            config_warnings: vec![],
            networks: vec![NetworkView {
                name: "blue".into(),
                id: 100,
                role: "Secondary".into(),
                subnets: vec!["10.20.0.0/16".into()],
                exclude_subnets: vec![],
                gateway_ips: vec!["10.20.0.1".into()],
                gateway_mac: "02:00:00:00:00:01".into(),
                ipam: true,
                mac_filter: true,
                ip_filter: true,
                egress: "None".into(),
                mtu: 1500,
                attachments: 4,
                dns_servers: vec![],
                search_domains: vec![],
            }],
            attachments: vec![
                attachment("vm1", "a", Some(11), "none").into(),
                attachment("vm2", "b", None, "none").into(),
                attachment("vm3", "a", None, "none").into(),
                attachment("vm4", "a", Some(14), "pending").into(),
            ]
            .into(),
            missing_ports: vec!["prod/vm3/eth0 (port p-vm3)".into()],
            problems: vec![],
            policies: vec![],
            reconciles: 3,
            last_reconcile_seconds: 0.002,
            last_reconcile_unix: 1,
            ready: true,
            generation: 4,
            on_node: None,
        }
    }

    #[test]
    fn each_attachment_has_one_state() {
        let v = view();
        let states: Vec<&str> = v.attachments.iter().map(|a| v.state_of(&a)).collect();
        assert_eq!(
            states,
            [
                state::LOCAL,
                state::REMOTE,
                state::MISSING_PORT,
                state::MIGRATING
            ]
        );
        let local: Vec<u32> = v.local_ports().map(|(_, i)| i).collect();
        assert_eq!(local, [11]);
    }

    #[test]
    fn liveness_fails_once_the_loop_exits() {
        let p = Published::default();
        assert_eq!(p.alive(), Ok(()));
        p.heartbeat();
        assert_eq!(p.alive(), Ok(()));
        p.loop_exited();
        assert_eq!(p.alive(), Err("the reconcile loop has exited".into()));
    }
}
