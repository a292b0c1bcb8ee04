//! `vm_from_stack`: tcx egress on a VM port (host side of the VM pod's
//! veth), every frame going down to the VM that did not come by
//! `bpf_redirect_peer`. The data path's own (the gateway's replies, the
//! slow path's, flood copies) carry `DATA_PATH_MARK` and pass, their
//! policy judged where they were switched; what the node's stack sends
//! (the host-reach route to a Primary network's endpoint: kubelet,
//! kube-proxy's translations, cluster pods the node routes) meets the
//! endpoint's ingress policy here, by source address.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use vmpath_common::DATA_PATH_MARK;

use crate::{counters, maps::PORTS, policy};

/// tcx egress on a VM port: the node stack's frames to the VM.
#[classifier]
pub fn vm_from_stack(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for
    // this run; `mark` is a field tc programs may write.
    let (ifindex, mark) = unsafe { ((*ctx.skb.skb).ifindex, (*ctx.skb.skb).mark) };
    if mark == DATA_PATH_MARK {
        // SAFETY: as above.
        unsafe { (*ctx.skb.skb).mark = 0 };
        return TC_ACT_OK;
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        // No endpoint here (yet, or any more): no policy to judge by.
        return TC_ACT_OK;
    };
    match policy::from_stack(&ctx, port.port_id, ifindex, port.network) {
        Ok(()) => TC_ACT_OK,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port.port_id, reason);
            TC_ACT_SHOT
        }
    }
}
