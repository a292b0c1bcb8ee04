//! Threads that do the agent's housekeeping (writing `status.json` and the
//! accepted interfaces, freeing what a round replaced) run below the
//! reconcile loop and the API: on a small node (two CPUs) a megabyte-sized
//! status file being written right after a round held a CNI ADD's answer
//! back by milliseconds. They still get the CPU whenever nothing more
//! urgent wants it.

/// The nice value a housekeeping thread runs at.
pub const NICE: i32 = 10;

/// Puts the calling thread in the idle class (`SCHED_IDLE`): any other
/// thread that wakes takes the CPU from it at once (a lower nice value
/// alone still let a status write finish its slice first: milliseconds
/// of an ADD's answer). For work that may lag behind when the CPUs are
/// busy: records whose latest value is what counts.
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

/// Lowers the calling thread's priority to [`NICE`]: for work that must
/// keep up (freeing what rounds replaced). A failure only leaves it
/// where it was (logged): the work is the same either way.
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
    fn housekeeping_threads_run_below_the_others_and_no_other_does() {
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
