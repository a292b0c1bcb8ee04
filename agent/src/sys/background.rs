//! Threads that do the agent's housekeeping (writing `status.json` and the
//! accepted interfaces, freeing what a round replaced) run in the idle
//! class, below the reconcile loop and the API: on a small node (two CPUs)
//! a megabyte-sized status file written right after a round held a CNI
//! ADD's answer back by milliseconds, and the freeing thread, woken with a
//! cluster's worth of keys to free, took the CPU from the round that woke
//! it (a lower nice value alone did not stop either). They get every CPU
//! cycle nothing else wants; on a node whose CPUs are all busy they fall
//! behind: the status file lags, and past a backlog the rounds free their
//! own garbage (`sys::drop_later::BACKLOG`, counted), so memory stays
//! bounded.

/// Puts the calling thread in the idle class (`SCHED_IDLE`): any other
/// thread that wakes takes the CPU from it at once, and it never takes
/// the CPU from another. A failure only leaves it where it was (logged):
/// the work is the same either way.
pub fn idle_this_thread() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscalls on this thread's own id, with a valid param.
    let rc = unsafe { libc::sched_setscheduler(libc::gettid(), libc::SCHED_IDLE, &param) };
    if rc != 0 {
        tracing::debug!(
            "putting a housekeeping thread in the idle class: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_housekeeping_thread_runs_in_the_idle_class_and_no_other_does() {
        // SAFETY: a plain syscall on this thread's own id.
        let policy = || unsafe { libc::sched_getscheduler(libc::gettid()) };
        let idle = std::thread::spawn(move || {
            idle_this_thread();
            policy()
        })
        .join()
        .unwrap();
        assert_eq!(idle, libc::SCHED_IDLE);
        assert_ne!(policy(), libc::SCHED_IDLE, "the calling thread only");
    }
}
