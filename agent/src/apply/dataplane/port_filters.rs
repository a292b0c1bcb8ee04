//! A VM port's programs as tc filters (cls_bpf, direct action) on the
//! port's clsact qdisc, where the node's devices (uplink, vxlan, slow
//! path) use pinned tcx links.
//!
//! Why not tcx on ports: a tcx attach waits for two RCU grace periods
//! (the bpf_mprog entry swap, then its commit) while it holds the RTNL.
//! Here that is ~24 ms per port for its two programs, every other netlink
//! user on the node (kubelet, other plugins, this agent's routes) waits
//! behind it, and a node attaches at most ~40 ports a second: a pod's
//! CNI ADD was half attach, and 100 pod creations a second could not be
//! served. A cls_bpf filter is attached in ~0.3 ms (BENCHMARKS.md,
//! "cluster scale").
//!
//! A filter belongs to the qdisc, not to a file descriptor: it outlives
//! the agent, as a pinned link did. A restarted or upgraded agent replaces
//! each filter's program in place (cls_bpf swaps it atomically: no frame
//! meets a port without a program). The kernel is the record of which
//! ports carry the programs: `sys::tc_filters` reads it back.

use anyhow::{Context as _, Result, anyhow};
use aya::programs::{
    SchedClassifier, TcAttachType,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
};

pub use crate::sys::tc_filters::{HANDLE, PRIORITY, detach_port, ports_carrying};

fn errno(e: &TcError) -> Option<i32> {
    match e {
        TcError::NetlinkError(n) => n.raw_os_error(),
        TcError::IoError(e) => e.raw_os_error(),
        _ => None,
    }
}

fn program_errno(e: &aya::programs::ProgramError) -> Option<i32> {
    match e {
        aya::programs::ProgramError::TcError(t) => errno(t),
        _ => None,
    }
}

/// Attaches `prog` at `at` of `ifname` as the port filter, or swaps it
/// into the filter an earlier agent left there. `true` when swapped.
pub fn attach(prog: &mut SchedClassifier, ifname: &str, at: TcAttachType) -> Result<bool> {
    match tc::qdisc_add_clsact(ifname) {
        Ok(()) => {}
        Err(e) if errno(&e) == Some(libc::EEXIST) => {}
        Err(e) => return Err(anyhow!(e).context(format!("adding the clsact qdisc to {ifname}"))),
    }
    let options = || {
        TcAttachOptions::Netlink(NlOptions {
            priority: PRIORITY,
            handle: TcHandle::from(HANDLE),
            classid: None,
        })
    };
    let (id, replaced) = match prog.attach_with_options(ifname, at, options()) {
        Ok(id) => (id, false),
        Err(e) if program_errno(&e) == Some(libc::EEXIST) => {
            let existing =
                SchedClassifierLink::attached(ifname, at, PRIORITY, TcHandle::from(HANDLE), None)
                    .with_context(|| format!("the filter at {at:?} of {ifname}"))?;
            let id = prog
                .attach_to_link(existing)
                .with_context(|| format!("replacing the filter at {at:?} of {ifname}"))?;
            (id, true)
        }
        Err(e) => {
            return Err(anyhow!(e).context(format!("attaching at {at:?} of {ifname}")));
        }
    };
    // aya detaches a link it manages when dropped; the filter must outlive
    // this agent (a restart must not leave the port without its program),
    // so the handle is let go. It holds no file descriptor.
    let link = prog.take_link(id)?;
    #[expect(clippy::mem_forget, reason = "the filter must outlive the agent")]
    std::mem::forget(link);
    Ok(replaced)
}
