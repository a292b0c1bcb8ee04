//! Freeing big structures off the reconcile loop's path.
//!
//! A round replaces what the last one kept (the objects' membership, the
//! validated config): at 10,000 VMs, freeing the old one is hundreds of
//! thousands of small deallocations, about a tenth of a round's time
//! (BENCHMARKS.md section 14). It changes nothing anyone waits for, so a
//! thread of its own does it. The price: the old structures outlive the
//! round by as long as freeing them takes, while the next round builds
//! its own (the peak RSS at 10,000 VMs rose by 13 MiB, section 14).

use std::sync::{
    OnceLock,
    atomic::{AtomicUsize, Ordering},
    mpsc::{Sender, channel},
};

type Garbage = Box<dyn Send>;

/// How many handed-over values may wait for the dropping thread. It runs
/// in the idle class (`sys::background`): on a node whose CPUs the VMs
/// keep busy it may hardly run, and what waits for it is memory. Past
/// this many, the caller drops its own (a round makes a few a round).
pub const BACKLOG: usize = 64;

/// Values handed over and not yet dropped.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Values dropped on the caller's thread because [`BACKLOG`] were waiting.
static DROPPED_HERE: AtomicUsize = AtomicUsize::new(0);

/// How many values were dropped on their caller's thread because the
/// dropping thread was [`BACKLOG`] behind.
pub fn dropped_here() -> usize {
    DROPPED_HERE.load(Ordering::Relaxed)
}

/// Drops `value` on the dropping thread (started at first use); on this
/// thread when that thread cannot be started or is [`BACKLOG`] behind.
pub fn drop_later<T: Send + 'static>(value: T) {
    static DROPPER: OnceLock<Option<Sender<Garbage>>> = OnceLock::new();
    let dropper = DROPPER.get_or_init(|| {
        let (tx, rx) = channel::<Garbage>();
        std::thread::Builder::new()
            .name("vmpath-drop".into())
            .spawn(move || {
                crate::sys::background::idle_this_thread();
                for garbage in rx {
                    drop(garbage);
                    WAITING.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .ok()
            .map(|_| tx)
    });
    match dropper {
        Some(tx) if WAITING.fetch_add(1, Ordering::SeqCst) < BACKLOG => {
            // Only a dead dropping thread refuses it; then drop it here.
            if let Err(refused) = tx.send(Box::new(value)) {
                WAITING.fetch_sub(1, Ordering::SeqCst);
                drop(refused.0);
            }
        }
        Some(_) => {
            WAITING.fetch_sub(1, Ordering::SeqCst);
            DROPPED_HERE.fetch_add(1, Ordering::Relaxed);
            drop(value);
        }
        None => drop(value),
    }
}

/// Drops what it holds, then gives glibc's heap's free pages back to the
/// kernel (a full pass over a cluster's objects frees tens of MiB at once).
/// In the agent binary that heap holds what C code allocates only: its
/// own allocations are mimalloc's, which gives freed pages back itself
/// (`main.rs`).
pub struct ThenTrim<T>(Option<T>);

impl<T> ThenTrim<T> {
    pub fn new(value: T) -> Self {
        ThenTrim(Some(value))
    }
}

impl<T> Drop for ThenTrim<T> {
    fn drop(&mut self) {
        // A field is dropped after its holder's `drop`: take it out first.
        drop(self.0.take());
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free pages to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };

    struct Flag(Arc<AtomicBool>, std::thread::ThreadId);
    impl Drop for Flag {
        fn drop(&mut self) {
            assert_ne!(
                std::thread::current().id(),
                self.1,
                "dropped on the caller's thread"
            );
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// Holds the dropping thread until `release` is sent.
    struct Gate(std::sync::mpsc::Receiver<()>);
    impl Drop for Gate {
        fn drop(&mut self) {
            let _ = self.0.recv();
        }
    }

    /// Records the thread it was dropped on.
    struct Where(Arc<std::sync::Mutex<Vec<std::thread::ThreadId>>>);
    impl Drop for Where {
        fn drop(&mut self) {
            self.0.lock().unwrap().push(std::thread::current().id());
        }
    }

    #[test]
    fn a_dropping_thread_that_is_behind_leaves_the_caller_its_own() {
        let (release, gate) = std::sync::mpsc::channel();
        drop_later(Gate(gate));
        let places = Arc::new(std::sync::Mutex::new(Vec::new()));
        for _ in 0..BACKLOG + 5 {
            drop_later(Where(places.clone()));
        }
        let here = std::thread::current().id();
        // The gate and BACKLOG - 1 wait; the others were the caller's.
        let on_caller = places
            .lock()
            .unwrap()
            .iter()
            .filter(|t| **t == here)
            .count();
        assert_eq!(on_caller, 6);
        assert_eq!(dropped_here(), 6);
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while places.lock().unwrap().len() < BACKLOG + 5 {
            assert!(std::time::Instant::now() < deadline, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(
            places
                .lock()
                .unwrap()
                .iter()
                .filter(|t| **t != here)
                .count()
                == BACKLOG - 1
        );
        // Caught up: handed over again.
        while WAITING.load(Ordering::SeqCst) > 0 {
            assert!(std::time::Instant::now() < deadline, "never caught up");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop_later(Where(places.clone()));
        while places.lock().unwrap().len() < BACKLOG + 6 {
            assert!(std::time::Instant::now() < deadline, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_ne!(*places.lock().unwrap().last().unwrap(), here);
    }

    #[test]
    fn what_is_given_is_dropped_on_another_thread() {
        let dropped = Arc::new(AtomicBool::new(false));
        drop_later(Flag(dropped.clone(), std::thread::current().id()));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !dropped.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
