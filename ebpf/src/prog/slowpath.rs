//! `slow_rx` and `slow_return`: the slow path's two ends on vmpath's own
//! interfaces, into the agent's AF_XDP socket and back out of the VM's
//! port (`slowpath` has the way there from `vm_port`).

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, xdp_action},
    helpers::generated::bpf_skb_vlan_pop,
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use vmpath_common::{NO_PORT_ID, drop_reason};

use crate::{
    counters,
    maps::{PORT_IDS, XSKS},
    parse::{ETH_LEN, ETH_P_8021Q, hdr_mut},
    slowpath::{VID_MASK, VLAN_LEN},
    verdict::{self, Verdict},
};

/// XDP on `vmp-slow1`: into the agent's socket, or dropped (and counted)
/// when no agent listens. Never XDP_ABORTED.
#[xdp]
pub fn slow_rx(ctx: XdpContext) -> u32 {
    let queue = ctx.rx_queue_index();
    if XSKS.get(queue).is_none() {
        counters::count_drop(NO_PORT_ID, drop_reason::SLOWPATH_NO_LISTENER);
        return xdp_action::XDP_DROP;
    }
    match XSKS.redirect(queue, u64::from(xdp_action::XDP_DROP)) {
        Ok(action) => action,
        Err(_) => {
            counters::count_drop(NO_PORT_ID, drop_reason::SLOWPATH_NO_LISTENER);
            xdp_action::XDP_DROP
        }
    }
}

/// tcx ingress on `vmp-slow0`: the agent's replies, out of the VM's port.
#[classifier]
pub fn slow_return(ctx: TcContext) -> i32 {
    match try_slow_return(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(NO_PORT_ID, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_slow_return(ctx: &TcContext) -> Verdict {
    let skb = ctx.skb.skb;
    // The stack moves a received 802.1Q tag out of the frame before tc.
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let port_id = if unsafe { (*skb).vlan_present } != 0 {
        // SAFETY: the skb pointer is the program's own context, valid for this run.
        let vid = unsafe { (*skb).vlan_tci } & u32::from(VID_MASK);
        // SAFETY: the helper takes only our own skb; no packet pointer is held across
        // it (it may move packet data).
        if unsafe { bpf_skb_vlan_pop(skb) } != 0 {
            return Err(drop_reason::HELPER_FAILED);
        }
        vid
    } else {
        let h = hdr_mut::<[u8; ETH_LEN + 4]>(ctx, 0)?;
        if u16::from_be_bytes([h[12], h[13]]) != ETH_P_8021Q {
            return Err(drop_reason::SLOWPATH_BAD_TAG);
        }
        let vid = u32::from(u16::from_be_bytes([h[14], h[15]]) & VID_MASK);
        // [8100][tci][type] -> [type] (the 4 bytes after the MAC header go)
        h[12] = h[16];
        h[13] = h[17];
        if ctx
            .adjust_room(-(VLAN_LEN as i32), BPF_ADJ_ROOM_MAC, 0)
            .is_err()
        {
            return Err(drop_reason::HELPER_FAILED);
        }
        vid
    };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(ifindex) = (unsafe { PORT_IDS.get(&port_id) }) else {
        return Err(drop_reason::SLOWPATH_BAD_TAG);
    };
    let ifindex = *ifindex;
    counters::count_tx(port_id, ctx.len());
    verdict::to_port(ctx, ifindex)
}
