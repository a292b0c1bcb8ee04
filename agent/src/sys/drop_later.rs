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
    mpsc::{Sender, channel},
};

type Garbage = Box<dyn Send>;

/// Drops `value` on the dropping thread (started at first use); on this
/// thread when that thread cannot be started.
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
                }
            })
            .ok()
            .map(|_| tx)
    });
    let garbage: Garbage = Box::new(value);
    match dropper {
        Some(tx) => {
            // Only a dead dropping thread refuses it; then drop it here.
            if let Err(refused) = tx.send(garbage) {
                drop(refused.0);
            }
        }
        None => drop(garbage),
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
