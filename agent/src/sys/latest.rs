//! Records written off the reconcile loop's path, the latest only.
//!
//! `status.json` (megabytes at 10,000 VMs, ~12 ms a write) and the record
//! of accepted VM interfaces (every key, fsynced) were written at the end
//! of each round that changed them: the next event's round waited for
//! them. Nobody waits for either (the API answers from memory; the record
//! only matters at the next start), and only their last state counts. So a
//! thread of its own writes them: a value handed over while a write runs
//! replaces the one still waiting, and a failed write is retried (after
//! [`RETRY`]) until it succeeds or a newer value comes.

use std::{
    sync::{Arc, Condvar, Mutex},
    thread::JoinHandle,
    time::Duration,
};

use tracing::warn;

/// How long a failed write waits before it is tried again.
pub const RETRY: Duration = Duration::from_secs(1);

struct Slot<T> {
    pending: Option<T>,
    /// A value is being written.
    busy: bool,
    closed: bool,
}

type Shared<T> = Arc<(Mutex<Slot<T>>, Condvar)>;

/// A writer thread for the latest `T`.
pub struct Latest<T: Send + 'static> {
    shared: Shared<T>,
    thread: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Latest<T> {
    /// Starts the thread `name`, which runs `write` on each value handed
    /// over (the latest when several came during a write). Without a
    /// thread (it could not be started), `submit` writes on the caller's.
    pub fn spawn(name: &str, write: impl FnMut(&T) -> Result<(), String> + Send + 'static) -> Self {
        Self::spawn_paced(name, 0, write)
    }

    /// As [`spawn`](Self::spawn), resting `rest` times as long as each
    /// write took before the next: the thread writes at most a
    /// `1 / (1 + rest)` share of one CPU, whatever the record's size and
    /// however often it changes (the latest is still written, later).
    pub fn spawn_paced(
        name: &str,
        rest: u32,
        write: impl FnMut(&T) -> Result<(), String> + Send + 'static,
    ) -> Self {
        let shared: Shared<T> = Arc::new((
            Mutex::new(Slot {
                pending: None,
                busy: false,
                closed: false,
            }),
            Condvar::new(),
        ));
        let worker = shared.clone();
        let what = name.to_string();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                crate::sys::background::idle_this_thread();
                run(&worker, &what, rest, write)
            })
            .map_err(|e| warn!(thread = name, "cannot start: {e}; writing on the loop"))
            .ok();
        Latest { shared, thread }
    }

    /// Hands `value` over; one still waiting is replaced.
    pub fn submit(&self, value: T) {
        let (lock, wake) = &*self.shared;
        let mut slot = lock.lock().unwrap_or_else(|e| e.into_inner());
        slot.pending = Some(value);
        // All: `flush` waits on the same condition.
        wake.notify_all();
    }

    /// Waits until what was handed over so far is written (or its write
    /// failed once).
    pub fn flush(&self) {
        let (lock, wake) = &*self.shared;
        let mut slot = lock.lock().unwrap_or_else(|e| e.into_inner());
        while (slot.pending.is_some() || slot.busy) && self.thread.is_some() {
            slot = wake.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn run<T>(
    shared: &Shared<T>,
    what: &str,
    rest: u32,
    mut write: impl FnMut(&T) -> Result<(), String>,
) {
    let (lock, wake) = &**shared;
    let mut failed: Option<T> = None;
    loop {
        let value = {
            let mut slot = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(v) = slot.pending.take() {
                    slot.busy = true;
                    break v;
                }
                if slot.closed {
                    return;
                }
                match failed.take() {
                    // Tried again unless a newer value comes first.
                    Some(f) => {
                        let (s, timeout) = wake
                            .wait_timeout(slot, RETRY)
                            .unwrap_or_else(|e| e.into_inner());
                        slot = s;
                        if slot.pending.is_none() && !slot.closed {
                            if timeout.timed_out() {
                                slot.busy = true;
                                break f;
                            }
                            failed = Some(f);
                        }
                    }
                    None => slot = wake.wait(slot).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        let started = std::time::Instant::now();
        let result = write(&value);
        if let Err(e) = &result {
            warn!(record = what, "writing: {e}; trying again");
        }
        let mut slot = lock.lock().unwrap_or_else(|e| e.into_inner());
        slot.busy = false;
        if result.is_err() {
            failed = Some(value);
        }
        // For `flush`.
        wake.notify_all();
        // The rest: values handed over meanwhile replace one another; the
        // thread's end does not wait for it.
        let until = std::time::Instant::now() + started.elapsed() * rest;
        while !slot.closed {
            let now = std::time::Instant::now();
            if now >= until {
                break;
            }
            slot = wake
                .wait_timeout(slot, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl<T: Send + 'static> Drop for Latest<T> {
    /// What is still waiting is written before the thread ends.
    fn drop(&mut self) {
        {
            let (lock, wake) = &*self.shared;
            let mut slot = lock.lock().unwrap_or_else(|e| e.into_inner());
            slot.closed = true;
            wake.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_last_value_is_written_and_a_waiting_one_is_replaced() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let w = written.clone();
        let gate = Arc::new(Mutex::new(()));
        let g = gate.clone();
        let latest = Latest::spawn("test-latest", move |v: &u32| {
            let _held = g.lock().unwrap();
            w.lock().unwrap().push(*v);
            Ok(())
        });
        // While the first write is held up, two more come: only the last
        // of them is written.
        let held = gate.lock().unwrap();
        latest.submit(1);
        std::thread::sleep(Duration::from_millis(50));
        latest.submit(2);
        latest.submit(3);
        drop(held);
        latest.flush();
        drop(latest);
        assert_eq!(*written.lock().unwrap(), vec![1, 3]);
    }

    #[test]
    fn a_failed_write_is_tried_again() {
        let tries = Arc::new(AtomicUsize::new(0));
        let t = tries.clone();
        let latest = Latest::spawn("test-latest-retry", move |_: &u32| {
            if t.fetch_add(1, Ordering::SeqCst) == 0 {
                Err("disk full".into())
            } else {
                Ok(())
            }
        });
        latest.submit(7);
        let waited = std::time::Instant::now();
        while tries.load(Ordering::SeqCst) < 2 && waited.elapsed() < RETRY * 5 {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(tries.load(Ordering::SeqCst), 2);
    }

    /// A paced writer rests after each write: values handed over during
    /// the write and its rest replace one another, and the last is
    /// written once the rest is over.
    #[test]
    fn a_paced_writer_rests_and_then_writes_the_latest() {
        let written = Arc::new(Mutex::new(Vec::new()));
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        let w = written.clone();
        let latest = Latest::spawn_paced("test-latest-paced", 9, move |v: &u32| {
            if *v == 1 {
                // The first write lasts until the others are handed over.
                let _ = wait.lock().unwrap().recv();
            }
            std::thread::sleep(Duration::from_millis(20));
            w.lock().unwrap().push((*v, std::time::Instant::now()));
            Ok(())
        });
        latest.submit(1);
        while !latest.shared.0.lock().unwrap().busy {
            std::thread::yield_now();
        }
        for v in 2..=5 {
            latest.submit(v);
        }
        go.send(()).unwrap();
        latest.flush();
        let written = written.lock().unwrap();
        assert_eq!(written.iter().map(|(v, _)| *v).collect::<Vec<_>>(), [1, 5]);
        // The second began at least nine first writes (of 20 ms or more)
        // after the first ended, and took 20 ms.
        assert!(written[1].1 - written[0].1 >= Duration::from_millis(200));
    }
}
