//! What wakes the reconcile loop: file-system notifications on the config
//! dir (inotify; a ConfigMap's `..data` swap is a rename in that dir) and
//! link notifications (netlink: a VM's port appears or goes). Bursts are
//! coalesced: the loop drains every pending wake before one reconcile.

use std::{
    path::{Path, PathBuf},
    sync::mpsc::{self, Receiver, RecvTimeoutError, Sender},
    time::Duration,
};

use inotify::{EventMask, Inotify, WatchMask};
use tracing::{debug, warn};

use crate::sys::netlink::{self, LinkEvent};

/// Why the loop was woken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// Something in the config dir changed.
    Config,
    /// A link was added, changed or removed.
    Link(LinkEvent),
    /// The CNI plugin added or removed an endpoint (API thread).
    Endpoint,
    /// A watched Kubernetes object changed (`--source kubernetes`).
    Cluster,
}

/// How long a config wake waits for the rest of its burst (a `kubectl
/// apply` of many files) before the reconcile starts. Link and endpoint
/// wakes do not wait: a port's first frame waits on them, and a later
/// event of the same burst costs one more, cheap, pass that finds nothing
/// new.
const SETTLE: Duration = Duration::from_millis(2);

/// How often a missing config dir is looked for again.
const RETRY_WATCH: Duration = Duration::from_secs(1);

pub struct Events {
    rx: Receiver<Wake>,
    /// Kept so `rx` never disconnects when no source could start.
    _tx: Sender<Wake>,
}

impl Events {
    /// Starts the config-dir watcher and the link listener (in the calling
    /// thread's network namespace). A source that cannot start is logged;
    /// the periodic resync still covers what it would have seen.
    pub fn start(config_dir: &Path) -> Events {
        let (tx, rx) = mpsc::channel();
        let dir = config_dir.to_path_buf();
        let config_tx = tx.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("vmpath-inotify".into())
            .spawn(move || watch_dir(&dir, config_tx))
        {
            warn!("config dir watcher not started: {e}; relying on the periodic resync");
        }
        let link_tx = tx.clone();
        if let Err(e) = netlink::watch_links(move |ev| {
            debug!(?ev, "link event");
            link_tx.send(Wake::Link(ev)).is_ok()
        }) {
            warn!("link notifications not available: {e}; relying on the periodic resync");
        }
        Events { rx, _tx: tx }
    }

    /// A handle other threads use to wake the loop (e.g. a CNI ADD).
    pub fn sender(&self) -> Sender<Wake> {
        self._tx.clone()
    }

    /// Events that never fire: the loop runs on its timers alone.
    pub fn none() -> Events {
        let (tx, rx) = mpsc::channel();
        Events { rx, _tx: tx }
    }

    /// Waits up to `timeout` for a wake; then lets its burst settle and
    /// takes every pending wake with it. Returns what woke the loop, or
    /// nothing on timeout.
    pub fn wait(&self, timeout: Duration) -> Vec<Wake> {
        let first = match self.rx.recv_timeout(timeout) {
            Ok(w) => w,
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return Vec::new(),
        };
        if first == Wake::Config {
            std::thread::sleep(SETTLE);
        }
        let mut wakes = vec![first];
        wakes.extend(self.rx.try_iter());
        wakes
    }
}

/// Watches `dir` forever, sending [`Wake::Config`] for every change in it;
/// re-arms when the dir is removed or not there yet.
fn watch_dir(dir: &PathBuf, tx: Sender<Wake>) {
    let mut inotify = match Inotify::init() {
        Ok(i) => i,
        Err(e) => {
            warn!("inotify: {e}; relying on the periodic resync for config changes");
            return;
        }
    };
    let mask = WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MODIFY
        | WatchMask::CLOSE_WRITE
        | WatchMask::MOVED_TO
        | WatchMask::MOVED_FROM
        | WatchMask::ATTRIB
        | WatchMask::DELETE_SELF
        | WatchMask::MOVE_SELF;
    let mut buffer = vec![0u8; 16 * 1024];
    let mut warned = false;
    loop {
        if let Err(e) = inotify.watches().add(dir, mask) {
            if !warned {
                warn!(dir = %dir.display(), "cannot watch the config dir yet: {e}");
                warned = true;
            }
            std::thread::sleep(RETRY_WATCH);
            continue;
        }
        warned = false;
        // The dir may have been filled between two watches.
        if tx.send(Wake::Config).is_err() {
            return;
        }
        'armed: loop {
            let events = match inotify.read_events_blocking(&mut buffer) {
                Ok(ev) => ev,
                Err(e) => {
                    warn!("inotify read: {e}");
                    std::thread::sleep(RETRY_WATCH);
                    continue;
                }
            };
            let mut rearm = false;
            for ev in events {
                rearm |= ev.mask.contains(EventMask::IGNORED)
                    || ev.mask.contains(EventMask::DELETE_SELF)
                    || ev.mask.contains(EventMask::MOVE_SELF);
            }
            if tx.send(Wake::Config).is_err() {
                return;
            }
            if rearm {
                break 'armed;
            }
        }
    }
}
