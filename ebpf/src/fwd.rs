//! L2 switching inside one network: known unicast to its port, everything
//! else (broadcast, multicast, unknown unicast) flooded to the network's
//! other local ports. Lookups are keyed by network, so no frame crosses
//! into another network.

use aya_ebpf::{
    bindings::TC_ACT_REDIRECT,
    helpers::generated::{bpf_redirect, bpf_redirect_peer},
    programs::TcContext,
};
use vmpath_common::{ENDPOINT_LOCAL, EndpointKey, MAX_FLOOD_PORTS, drop_reason};

use crate::{
    counters::count_tx,
    maps::{ENDPOINTS, FLOOD},
    parse::is_multicast,
};

/// Verdict of a frame that leaves the data path (a redirect) or a drop reason.
pub type Verdict = Result<i32, u32>;

#[inline(always)]
pub fn switch(ctx: &TcContext, ifindex: u32, network: u32, dst: [u8; 6]) -> Verdict {
    if !is_multicast(&dst) {
        let key = EndpointKey {
            network,
            mac: dst,
            _pad: [0; 2],
        };
        if let Some(ep) = unsafe { ENDPOINTS.get(&key) } {
            if ep.kind == ENDPOINT_LOCAL {
                if ep.ifindex == ifindex {
                    // Addressed to itself: the VM's own stack has it already.
                    return Err(drop_reason::NO_DESTINATION);
                }
                return deliver_local(ctx, ep.ifindex);
            }
        }
    }
    flood(ctx, ifindex, network)
}

/// Straight into the VM's namespace: the peer of its host-side veth.
#[inline(always)]
pub fn deliver_local(ctx: &TcContext, port_ifindex: u32) -> Verdict {
    count_tx(port_ifindex, ctx.len());
    let rc = unsafe { bpf_redirect_peer(port_ifindex, 0) };
    if rc == i64::from(TC_ACT_REDIRECT) {
        Ok(TC_ACT_REDIRECT)
    } else {
        Err(drop_reason::HELPER_FAILED)
    }
}

/// Back out of the port it came in by (a gateway reply to the VM).
#[inline(always)]
pub fn reply_out(port_ifindex: u32) -> Verdict {
    let rc = unsafe { bpf_redirect(port_ifindex, 0) };
    if rc == i64::from(TC_ACT_REDIRECT) {
        Ok(TC_ACT_REDIRECT)
    } else {
        Err(drop_reason::HELPER_FAILED)
    }
}

#[inline(always)]
fn flood(ctx: &TcContext, ifindex: u32, network: u32) -> Verdict {
    let Some(list) = (unsafe { FLOOD.get(&network) }) else {
        return Err(drop_reason::NO_DESTINATION);
    };
    let count = list.count as usize;
    let len = ctx.len();
    // Clone to every port but the last; the last takes the original.
    let mut last = 0u32;
    let mut i = 0usize;
    while i < MAX_FLOOD_PORTS {
        if i >= count {
            break;
        }
        let target = list.ifindex[i];
        i += 1;
        if target == 0 || target == ifindex {
            continue;
        }
        if last != 0 && ctx.clone_redirect(last, 0).is_ok() {
            count_tx(last, len);
        }
        last = target;
    }
    if last == 0 {
        return Err(drop_reason::NO_DESTINATION);
    }
    deliver_local(ctx, last)
}
