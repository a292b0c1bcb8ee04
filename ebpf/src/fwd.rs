//! L2 switching inside one network: known unicast to its port (or, for a
//! MAC on another node, configured or learned from the overlay, over the
//! overlay to that node), everything else (broadcast, multicast, unknown
//! unicast) flooded to the network's other local ports
//! and once to each remote node hosting the network. Lookups are keyed by
//! network, so no frame crosses into another network. Unknown unicast goes
//! only to the local ports that could hold its MAC: those whose own MAC
//! is not known yet (detection pending) or whose MAC filter is off; a VM
//! cannot sniff traffic for an absent MAC just by sharing its network.

use aya_ebpf::{
    bindings::__sk_buff,
    cty::c_void,
    helpers::generated::{bpf_clone_redirect, bpf_loop, bpf_redirect_peer},
    programs::TcContext,
};
use vmpath_common::{
    ENDPOINT_LOCAL, ENDPOINT_REMOTE, EndpointKey, FLOOD_CB, FLOOD_F_FROM_PORT,
    FLOOD_F_UNKNOWN_UNICAST, FloodList, MAX_FLOOD_PORTS, drop_reason, skb_cb, tail_call,
};

use crate::{
    counters::count_tx,
    maps::{ENDPOINTS, FLOOD, PORTS},
    overlay,
    parse::is_multicast,
    policy::Parsed,
    spoof,
    verdict::{PROGS, Verdict, mark_for_port, redirected, restore_mark},
};

#[inline(always)]
pub fn switch(ctx: &TcContext, ifindex: u32, network: u32, dst: [u8; 6]) -> Verdict {
    switch_parsed(ctx, ifindex, network, dst, None)
}

/// `switch` for a frame whose egress policy check left its tuple for the
/// delivery's (`parsed`).
#[inline(always)]
pub fn switch_parsed(
    ctx: &TcContext,
    ifindex: u32,
    network: u32,
    dst: [u8; 6],
    parsed: Option<Parsed>,
) -> Verdict {
    if !is_multicast(&dst) {
        let key = EndpointKey::new(network, dst);
        // SAFETY: a map lookup; the value stays valid for this program run.
        if let Some(ep) = unsafe { ENDPOINTS.get(&key) } {
            if ep.kind == ENDPOINT_LOCAL {
                if ep.ifindex == ifindex {
                    // Addressed to itself: the VM's own stack has it already.
                    return Err(drop_reason::NO_DESTINATION);
                }
                return deliver_local_parsed::<true>(ctx, ep.ifindex, ep.port_id, parsed);
            }
            if ep.kind == ENDPOINT_REMOTE {
                return overlay::to_remote(ctx);
            }
        } else if overlay::is_learned(&key) {
            // A remote VM the config does not place (its MAC was detected
            // on its node), learned from its frames: `vm_remote` sends it
            // to that node only; no local port has it.
            return overlay::to_remote(ctx);
        }
    }
    flood(ctx, ifindex, network, !is_multicast(&dst))
}

/// Straight into the VM's namespace: the peer of its host-side veth
/// (`port_id` is that port's counters' slot), if its ingress policy lets
/// the frame in.
#[inline(always)]
pub fn deliver_local(ctx: &TcContext, port_ifindex: u32, port_id: u32) -> Verdict {
    deliver_local_parsed::<false>(ctx, port_ifindex, port_id, None)
}

/// `deliver_local`; `parsed`: from the egress policy check of the same
/// frame in this program run; `FROM_PORT`: switched from a local VM port.
#[inline(always)]
fn deliver_local_parsed<const FROM_PORT: bool>(
    ctx: &TcContext,
    port_ifindex: u32,
    port_id: u32,
    parsed: Option<Parsed>,
) -> Verdict {
    // The last check before the VM: whatever way the frame came (another
    // port, the overlay, the uplink, a SNAT reply).
    if let Some(verdict) = crate::policy::deliver::<FROM_PORT>(ctx, port_ifindex, port_id, parsed) {
        return verdict;
    }
    deliver_checked(ctx, port_ifindex, port_id)
}

/// `deliver_local` past ingress policy.
#[inline(always)]
pub fn deliver_checked(ctx: &TcContext, port_ifindex: u32, port_id: u32) -> Verdict {
    // A reply to a flow the endpoint opened to a ClusterIP comes from the
    // ClusterIP again (after ingress policy, which saw the backend).
    if let Some(verdict) = crate::service::deliver(ctx, port_ifindex, port_id) {
        return verdict;
    }
    deliver_now(ctx, port_ifindex, port_id)
}

/// The delivery itself, past ingress policy and Service translation.
#[inline(always)]
pub fn deliver_now(ctx: &TcContext, port_ifindex: u32, port_id: u32) -> Verdict {
    count_tx(port_id, ctx.len());
    // SAFETY: a helper call with integer arguments; it touches no memory
    // of ours.
    redirected(unsafe { bpf_redirect_peer(port_ifindex, 0) })
}

/// A flood's original frame to its last port, which `clone_local` chose
/// past ingress policy already.
#[inline(always)]
fn deliver_flooded(ctx: &TcContext, port_ifindex: u32, port_id: u32) -> Verdict {
    count_tx(port_id, ctx.len());
    // SAFETY: a helper call with integer arguments; it touches no memory
    // of ours.
    redirected(unsafe { bpf_redirect_peer(port_ifindex, 0) })
}

/// From a VM port: to the network's other local ports and, when other
/// nodes host the network, once to each of them (`vm_flood`).
#[inline(always)]
fn flood(ctx: &TcContext, ifindex: u32, network: u32, unknown_unicast: bool) -> Verdict {
    to_vm_flood(
        ctx,
        network,
        ifindex,
        FLOOD_F_FROM_PORT | unknown_flag(unknown_unicast),
    )
}

/// From the overlay: to the network's local ports only, never back to
/// another node (every node floods to all the others itself).
#[inline(always)]
pub fn flood_local(ctx: &TcContext, network: u32, unknown_unicast: bool) -> Verdict {
    to_vm_flood(ctx, network, 0, unknown_flag(unknown_unicast))
}

#[inline(always)]
fn unknown_flag(unknown_unicast: bool) -> u32 {
    if unknown_unicast {
        FLOOD_F_UNKNOWN_UNICAST
    } else {
        0
    }
}

/// On to `vm_flood` with its orders in `cb`. Returns only when the slot
/// is empty (the agent still starting).
#[inline(always)]
fn to_vm_flood(ctx: &TcContext, network: u32, skip: u32, flags: u32) -> Verdict {
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame.
    unsafe {
        let cb = &mut (*ctx.skb.skb).cb;
        cb[skb_cb::MARKER] = FLOOD_CB;
        cb[skb_cb::PORT] = network;
        cb[skb_cb::IFINDEX] = skip;
        cb[skb_cb::FLAGS] = flags;
    }
    // SAFETY: `ctx` is this program's own context; on success the tail
    // call does not return, otherwise the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::VM_FLOOD) };
    Err(drop_reason::HELPER_FAILED)
}

/// `vm_flood`, for a frame from the VM port `ifindex`: to the network's
/// other local ports and, when other nodes host the network, once to each
/// of them (the `vm_remote` tail call sends those copies; it takes the
/// original frame last).
#[inline(always)]
pub fn flood_from_port(
    ctx: &TcContext,
    ifindex: u32,
    network: u32,
    unknown_unicast: bool,
) -> Verdict {
    let (last, last_id) = clone_local(ctx, ifindex, network, unknown_unicast);
    if overlay::has_remote(network) {
        if last != 0 {
            let mark = mark_for_port(ctx.skb.skb);
            if ctx.clone_redirect(last, 0).is_ok() {
                count_tx(last_id, ctx.len());
            }
            restore_mark(ctx.skb.skb, mark);
        }
        return overlay::to_remote(ctx);
    }
    if last == 0 {
        return Err(drop_reason::NO_DESTINATION);
    }
    deliver_flooded(ctx, last, last_id)
}

/// `vm_flood`, for a frame from the overlay: to the local ports only.
#[inline(always)]
pub fn flood_from_overlay(ctx: &TcContext, network: u32, unknown_unicast: bool) -> Verdict {
    let (last, last_id) = clone_local(ctx, 0, network, unknown_unicast);
    if last == 0 {
        return Err(drop_reason::OVERLAY_NO_LOCAL_PORT);
    }
    deliver_flooded(ctx, last, last_id)
}

/// Clones the frame to every local port of `network` except `skip` and
/// the last one, which it returns (ifindex 0: none) with its port id for
/// the caller to hand the original to. `unknown_unicast`: only to ports
/// that may hold an unknown MAC. The list is walked with `bpf_loop`: the
/// verifier checks one member's step once, whatever the list's length.
#[inline(always)]
fn clone_local(ctx: &TcContext, skip: u32, network: u32, unknown_unicast: bool) -> (u32, u32) {
    // IP floods skip ports isolated for ingress (their own list, where a
    // network has such ports).
    // SAFETY: map lookups; the values stay valid for this program run.
    let guarded = match crate::policy::flood_guarded(ctx) {
        true => unsafe { crate::policy::POLICY_FLOOD.get(&network) },
        false => None,
    };
    let Some(list) = guarded.or_else(|| unsafe { FLOOD.get(&network) }) else {
        return (0, 0);
    };
    let mut walk = LocalFlood {
        skb: ctx.skb.skb,
        list,
        skip,
        len: ctx.len(),
        unknown_unicast: u32::from(unknown_unicast),
        last: 0,
        last_id: 0,
    };
    // A count past the list's width (a corrupt entry) walks the width.
    let members = (list.count as usize).min(MAX_FLOOD_PORTS) as u32;
    // The copies are the data path's (`vm_from_stack` lets them by); the
    // original goes on with its own mark.
    let mark = mark_for_port(ctx.skb.skb);
    // SAFETY: the callback is a function of this object taking the
    // context's type; `walk` outlives the call.
    unsafe {
        bpf_loop(
            members,
            clone_local_member as *mut c_void,
            (&raw mut walk).cast(),
            0,
        )
    };
    restore_mark(ctx.skb.skb, mark);
    // Withheld from each port isolated for ingress: policy's drops (not
    // the sender's own port, which a flood never reaches). After the
    // loop: a branch before it would have the verifier walk it twice.
    if let Some(list) = guarded {
        crate::policy::count_withheld(list.withheld, skip);
    }
    (walk.last, walk.last_id)
}

/// `clone_local`'s state across its `bpf_loop`.
#[repr(C)]
struct LocalFlood {
    skb: *mut __sk_buff,
    list: *const FloodList,
    skip: u32,
    len: u32,
    unknown_unicast: u32,
    /// The member chosen last so far (0: none): it gets a clone when the
    /// next one is found, or the original from the caller.
    last: u32,
    last_id: u32,
}

/// One member of a local flood (`bpf_loop` callback: 0 goes on, 1 stops).
#[inline(never)]
extern "C" fn clone_local_member(i: u32, walk: *mut c_void) -> i64 {
    // SAFETY: `walk` is the `LocalFlood` `clone_local` handed to `bpf_loop`.
    let walk = unsafe { &mut *walk.cast::<LocalFlood>() };
    // SAFETY: the map value `clone_local` found, valid for this run.
    let list = unsafe { &*walk.list };
    let i = i as usize;
    // `get`, not indexing: a bounds-check panic would not verify.
    let (Some(&target), Some(&target_id)) = (list.ifindex.get(i), list.port_id.get(i)) else {
        return 1;
    };
    if target == 0 || target == walk.skip {
        return 0;
    }
    if walk.unknown_unicast != 0 && !may_hold_unknown_mac(target) {
        return 0;
    }
    // SAFETY: the program's own skb; integer arguments otherwise.
    if walk.last != 0 && unsafe { bpf_clone_redirect(walk.skb, walk.last, 0) } == 0 {
        count_tx(walk.last_id, walk.len);
    }
    walk.last = target;
    walk.last_id = target_id;
    0
}

/// Could the port at `ifindex` receive frames for a MAC the network does
/// not know? Not once its MAC is known and filtered: it sends only from
/// that MAC, so nothing behind it has another.
#[inline(always)]
fn may_hold_unknown_mac(ifindex: u32) -> bool {
    // SAFETY: a map lookup; the value stays valid for this program run.
    match unsafe { PORTS.get(&ifindex) } {
        Some(port) => !spoof::mac_filter_on(port),
        None => false,
    }
}
