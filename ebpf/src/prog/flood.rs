//! `vm_flood`: broadcast, multicast and unknown unicast to every member of
//! a network, however many: the local ports (`vmp_flood`, or
//! `vmp_pol_flood` for IP where ingress policy isolates ports) and, for a
//! frame from a VM port, the other nodes hosting the network
//! (`vmp_flood_remote`, through `vm_remote`). The lists are walked with
//! `bpf_loop` (`fwd::clone_local`, `overlay::flood`), so the verifier checks
//! one member's step once and a flood costs the members it reaches.
//!
//! Its own program, tail-called with its orders in `skb->cb` (`FLOOD_CB`):
//! `bpf_loop` keeps its state on the caller's stack, and `vm_port` has
//! none to spare.

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use vmpath_common::{
    FLOOD_CB, FLOOD_F_FROM_PORT, FLOOD_F_UNKNOWN_UNICAST, NO_PORT_ID, drop_reason, skb_cb,
};

use crate::{counters, fwd, maps::PORTS, overlay};

#[classifier]
pub fn vm_flood(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb carries what the caller decided.
    let (ifindex, magic, network, skip, flags) = unsafe {
        let skb = ctx.skb.skb;
        let cb = &mut (*skb).cb;
        let orders = (
            (*skb).ifindex,
            cb[skb_cb::MARKER],
            cb[skb_cb::PORT],
            cb[skb_cb::IFINDEX],
            cb[skb_cb::FLAGS],
        );
        cb[skb_cb::MARKER] = 0;
        orders
    };
    let from_port = flags & FLOOD_F_FROM_PORT != 0;
    let unknown_unicast = flags & FLOOD_F_UNKNOWN_UNICAST != 0;
    let verdict = if magic != FLOOD_CB {
        // Only ever tail-called with its orders: anything else is a bug.
        Err(drop_reason::HELPER_FAILED)
    } else if from_port {
        fwd::flood_from_port(&ctx, skip, network, unknown_unicast)
    } else {
        fwd::flood_from_overlay(&ctx, network, unknown_unicast)
    };
    match verdict {
        Ok(action) => action,
        Err(reason) => {
            // Counted as its caller counted its drops: against the port
            // it came in by, or the overlay's.
            if from_port {
                // SAFETY: a map lookup; the value stays valid for this run.
                let port_id = unsafe { PORTS.get(&ifindex) }.map_or(NO_PORT_ID, |p| p.port_id);
                counters::dropped(&ctx, ifindex, port_id, reason);
            } else {
                counters::dropped(&ctx, ifindex, NO_PORT_ID, reason);
                overlay::count_drop();
            }
            TC_ACT_SHOT
        }
    }
}
