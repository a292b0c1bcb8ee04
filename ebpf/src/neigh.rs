//! The way from `vm_port` to `vm_neigh` (`prog/neigh.rs`), which answers
//! ARP requests and neighbour solicitations for addresses vmpath knows.

use aya_ebpf::programs::TcContext;
use vmpath_common::tail_call;

use crate::{parse::is_multicast, verdict::PROGS};

/// From `vm_port`, for a broadcast or multicast ARP frame or neighbour
/// solicitation that passed the port's checks and is not the gateway's:
/// on to `vm_neigh`. Returns only when the slot is empty (the agent still
/// starting); the caller then switches the frame itself.
#[inline(always)]
pub fn to_vm_neigh(ctx: &TcContext, dst: &[u8; 6]) {
    if is_multicast(dst) {
        // SAFETY: `ctx` is this program's own context; on success the tail
        // call does not return.
        unsafe { PROGS.tail_call(ctx, tail_call::VM_NEIGH) };
    }
}
