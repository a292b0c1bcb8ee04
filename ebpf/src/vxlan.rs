//! tcx ingress on vmpath's vxlan device: frames other nodes sent over the
//! overlay, already decapsulated by the kernel. The VNI names the network;
//! the inner destination MAC picks the local port. Floods go to local
//! ports only, never back onto the overlay (the sending node reached every
//! node itself). Port security ran on the sending node.

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, bpf_tunnel_key},
    helpers::generated::bpf_skb_get_tunnel_key,
    macros::classifier,
    programs::TcContext,
};
use network_types::eth::EthHdr;
use vmpath_common::{ENDPOINT_LOCAL, EndpointKey, drop_reason};

use crate::{
    counters,
    fwd::{self, Verdict},
    maps::{ENDPOINTS, NETWORKS},
    overlay,
    parse::{is_multicast, mac_eq, ptr_at},
};

#[classifier]
pub fn vxlan_rx(ctx: TcContext) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    overlay::count_rx(ctx.len());
    match try_vxlan_rx(&ctx) {
        Ok(action) => action,
        Err(reason) => {
            counters::count_drop(ifindex, reason);
            overlay::count_drop();
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vxlan_rx(ctx: &TcContext) -> Verdict {
    let mut key: bpf_tunnel_key = unsafe { core::mem::zeroed() };
    let rc = unsafe {
        bpf_skb_get_tunnel_key(
            ctx.skb.skb,
            &mut key,
            core::mem::size_of::<bpf_tunnel_key>() as u32,
            0,
        )
    };
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    let network = key.tunnel_id;
    // The outer source address (host order from the helper).
    let from = unsafe { key.__bindgen_anon_1.remote_ipv4 }.to_be_bytes();
    let Some(net) = (unsafe { NETWORKS.get(&network) }) else {
        return Err(drop_reason::OVERLAY_UNKNOWN_VNI);
    };
    // Only nodes that host the network may inject frames into it.
    if !overlay::is_remote_node(network, from) {
        return Err(drop_reason::OVERLAY_UNKNOWN_VTEP);
    }

    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    let (dst, src) = unsafe { ((*eth).dst_addr, (*eth).src_addr) };
    if is_multicast(&src) {
        return Err(drop_reason::SRC_MULTICAST);
    }
    if !is_multicast(&dst) {
        // The gateway is anycast: every node answers its own VMs, so
        // nothing for it ever needs to cross the overlay.
        if mac_eq(&dst, &net.gw_mac) {
            return Err(drop_reason::OVERLAY_NO_LOCAL_PORT);
        }
        let ep_key = EndpointKey {
            network,
            mac: dst,
            _pad: [0; 2],
        };
        if let Some(ep) = unsafe { ENDPOINTS.get(&ep_key) } {
            if ep.kind == ENDPOINT_LOCAL {
                return fwd::deliver_local(ctx, ep.ifindex);
            }
            // Known on another node: not ours to deliver or relay.
            return Err(drop_reason::OVERLAY_NO_LOCAL_PORT);
        }
    }
    fwd::flood_local(ctx, network)
}
