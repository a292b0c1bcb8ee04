//! The wait loop of the threads that read the data path's ring buffers
//! (debug log records, monitor events): block until the ring's fd is
//! readable, drain, repeat, for the life of the process.

use std::os::fd::{AsRawFd as _, BorrowedFd};

use tracing::warn;

/// Calls `drain` each time `fd` becomes readable; returns only when poll
/// fails for a reason other than a signal (logged, naming `what`).
pub fn drain_when_readable(fd: BorrowedFd<'_>, what: &str, mut drain: impl FnMut()) {
    loop {
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on this stack frame; the fd is borrowed
        // for the whole loop, so it stays open while poll uses it.
        if unsafe { libc::poll(&mut pfd, 1, -1) } < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            warn!("{what}: poll: {e}; no more events");
            return;
        }
        drain();
    }
}
