//! `vxlan_from_stack` and `vxlan_reach`: a node's own stack and the
//! endpoints of Primary networks on other nodes, over the overlay
//! (`reach` has the lookups and the flow table).

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use vmpath_common::NO_PORT_ID;

use crate::{counters, overlay, reach};

/// tcx egress on the vxlan device: what the node's stack routes to a
/// Primary network's subnet goes to the node hosting the address.
#[classifier]
pub fn vxlan_from_stack(ctx: TcContext) -> i32 {
    match reach::from_stack(&ctx) {
        Ok(action) => action,
        Err(reason) => dropped(&ctx, reason),
    }
}

/// Tail call from `vxlan_rx` for `REACH_VNI`: another node's stack to a
/// local endpoint, or an endpoint's answer to this node's stack.
#[classifier]
pub fn vxlan_reach(ctx: TcContext) -> i32 {
    match reach::received(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            overlay::count_drop();
            dropped(&ctx, reason)
        }
    }
}

#[inline(always)]
fn dropped(ctx: &TcContext, reason: u32) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    counters::dropped(ctx, ifindex, NO_PORT_ID, reason);
    TC_ACT_SHOT
}
