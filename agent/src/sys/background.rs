//! Threads that do the agent's housekeeping (writing `status.json` and the
//! accepted interfaces, freeing what a round replaced) run at a lower
//! priority than the reconcile loop and the API: on a small node (two
//! CPUs) a megabyte-sized status file being written right after a round
//! held a CNI ADD's answer back by milliseconds. They still get the CPU
//! whenever nothing more urgent wants it.

/// The nice value a housekeeping thread runs at.
pub const NICE: i32 = 10;

/// Lowers the calling thread's priority to [`NICE`]. A failure only
/// leaves it where it was (logged): the work is the same either way.
pub fn lower_this_thread() {
    // Linux applies a nice value per thread when given the thread's id.
    // SAFETY: plain syscalls on this thread's own id.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE)
    };
    if rc != 0 {
        tracing::debug!(
            "lowering a housekeeping thread's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_housekeeping_thread_runs_at_a_lower_priority_and_no_other_does() {
        let nice = || {
            // SAFETY: plain syscalls on this thread's own id.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
        };
        let before = nice();
        let lowered = std::thread::spawn(move || {
            lower_this_thread();
            nice()
        })
        .join()
        .unwrap();
        assert_eq!(lowered, NICE.max(before));
        assert_eq!(nice(), before, "the calling thread only");
    }
}
