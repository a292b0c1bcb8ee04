//! `vm_policy_out` and `vm_policy_in`: a NetworkPolicy's egress check of a
//! VM's frame and ingress check of a delivery, each a tail call of its own
//! (`policy` has the lookups, the flow cache and the verdicts).

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use vmpath_common::{
    NO_PORT_ID, POLICY_CB_DELIVER, POLICY_CB_EGRESS_DONE, drop_reason, policy_dir, skb_cb,
    tail_call,
};

use crate::{
    counters, fwd,
    maps::PORTS,
    policy::{check, untracked},
    verdict::PROGS,
};

/// Tail-called from `vm_port`: the egress policy of the port's endpoint.
#[classifier]
pub fn vm_policy_out(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    let port_id = port.port_id;
    let untracked = untracked(&ctx);
    if let Err(reason) = check(
        &ctx,
        port_id,
        ifindex,
        port.network,
        policy_dir::EGRESS,
        untracked,
    ) {
        counters::dropped(&ctx, ifindex, port_id, reason);
        return TC_ACT_SHOT;
    }
    // SAFETY: as above; cb is scratch space for the programs that see it.
    unsafe {
        let cb = &mut (*ctx.skb.skb).cb;
        cb[skb_cb::MARKER] = POLICY_CB_EGRESS_DONE;
        cb[skb_cb::PORT] = port_id;
    }
    // SAFETY: `ctx` is this program's own context; on success the tail
    // call does not return.
    unsafe { PROGS.tail_call(&ctx, tail_call::VM_PORT) };
    counters::dropped(&ctx, ifindex, port_id, drop_reason::HELPER_FAILED);
    TC_ACT_SHOT
}

/// Tail-called where a frame is delivered to a local port a policy
/// selects (`cb`: port id, ifindex): its ingress policy, then delivery.
#[classifier]
pub fn vm_policy_in(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let (magic, port_id, target) = unsafe {
        let cb = &(*ctx.skb.skb).cb;
        (cb[skb_cb::MARKER], cb[skb_cb::PORT], cb[skb_cb::IFINDEX])
    };
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    if magic != POLICY_CB_DELIVER {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::HELPER_FAILED);
        return TC_ACT_SHOT;
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&target) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    let untracked = untracked(&ctx);
    let verdict = check(
        &ctx,
        port_id,
        target,
        port.network,
        policy_dir::INGRESS,
        untracked,
    )
    .and_then(|()| fwd::deliver_checked(&ctx, target, port_id));
    match verdict {
        Ok(action) => action,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port_id, reason);
            TC_ACT_SHOT
        }
    }
}
