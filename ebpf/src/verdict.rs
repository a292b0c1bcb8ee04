//! How a program's run ends: its verdict, a redirect out of an interface,
//! or a tail call through the one program array every program shares
//! (`vmp_progs`, slots in `vmpath_common::tail_call`). The bottom of the
//! library: every module that ends a run uses it, it uses none of theirs.

use aya_ebpf::{
    bindings::{__sk_buff, TC_ACT_REDIRECT},
    btf_maps::ProgramArray,
    helpers::generated::bpf_redirect,
    macros::btf_map,
    programs::TcContext,
};
use vmpath_common::{DATA_PATH_MARK, drop_reason, maps, skb_cb};

/// Verdict of a frame that leaves the data path (a redirect) or a drop reason.
pub type Verdict = Result<i32, u32>;

/// Tail-call targets (`vmpath_common::maps::PROGS`); slots in `tail_call`.
#[btf_map(name = "vmp_progs")]
pub static PROGS: ProgramArray<{ maps::PROGS.max_entries as usize }> = ProgramArray::new();

/// Hands a frame for the local port `ifindex` to the program in tail-call
/// `slot`, which checks or rewrites it and then delivers it; `cb` carries
/// (`magic`, port id, ifindex) to it.
#[inline(always)]
pub fn deliver_through(
    ctx: &TcContext,
    magic: u32,
    port_id: u32,
    ifindex: u32,
    slot: u32,
) -> Verdict {
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame.
    unsafe {
        let cb = &mut (*ctx.skb.skb).cb;
        cb[skb_cb::MARKER] = magic;
        cb[skb_cb::PORT] = port_id;
        cb[skb_cb::IFINDEX] = ifindex;
    }
    // SAFETY: `ctx` is this program's own context; on success the tail
    // call does not return, otherwise the error below.
    unsafe { PROGS.tail_call(ctx, slot) };
    Err(drop_reason::HELPER_FAILED)
}

/// Back out of the port it came in by (a gateway reply to the VM).
#[inline(always)]
pub fn reply_out(ctx: &TcContext, port_ifindex: u32) -> Verdict {
    to_port(ctx, port_ifindex)
}

/// Out of the VM port `port_ifindex`'s host side (its egress), as the
/// data path's own frame: `vm_from_stack` there lets it by.
#[inline(always)]
pub fn to_port(ctx: &TcContext, port_ifindex: u32) -> Verdict {
    mark_for_port(ctx.skb.skb);
    redirect(port_ifindex)
}

/// Marks the frame as the data path's (`DATA_PATH_MARK`) before it is
/// sent or cloned out of a VM port's host side; returns the mark it had,
/// which a clone's original gets back (`restore_mark`).
#[inline(always)]
pub fn mark_for_port(skb: *mut __sk_buff) -> u32 {
    // SAFETY: the program's own context, valid for this run; `mark` is a
    // field tc programs may write.
    unsafe {
        let old = (*skb).mark;
        (*skb).mark = DATA_PATH_MARK;
        old
    }
}

/// Gives the frame back the mark `mark_for_port` replaced.
#[inline(always)]
pub fn restore_mark(skb: *mut __sk_buff, mark: u32) {
    // SAFETY: as in `mark_for_port`.
    unsafe { (*skb).mark = mark };
}

/// Out of `ifindex` (its egress).
#[inline(always)]
pub fn redirect(ifindex: u32) -> Verdict {
    // SAFETY: a helper call with integer arguments; it touches no memory
    // of ours.
    redirected(unsafe { bpf_redirect(ifindex, 0) })
}

/// The verdict of a redirect helper's return value: every redirect of the
/// data path is checked here.
#[inline(always)]
pub fn redirected(rc: i64) -> Verdict {
    if rc == i64::from(TC_ACT_REDIRECT) {
        Ok(TC_ACT_REDIRECT)
    } else {
        Err(drop_reason::HELPER_FAILED)
    }
}
