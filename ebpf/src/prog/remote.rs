//! `vm_remote`: a VM's frame (or a flood's copies) over the overlay to the
//! node(s) that host its destination (`overlay` has the tunnel, the
//! lists and the learning it shares with `vxlan_rx` and the floods).

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, bpf_tunnel_key},
    macros::classifier,
    programs::TcContext,
};
use network_types::eth::EthHdr;
use vmpath_common::{ENDPOINT_REMOTE, EndpointKey, NO_PORT_ID, PortInfo, drop_reason};

use crate::{
    counters,
    maps::{ENDPOINTS, PORTS},
    overlay::{REMOTE_LEARNED, count_drop, count_tx, flood, set_tunnel_key, tunnel},
    parse::{hdr, is_multicast, zeroed},
    verdict::{self, Verdict},
};

/// tcx ingress on a VM port, reached by tail call from `vm_port` once it
/// decided the frame (or a copy of it) goes to other nodes. Port security
/// and local delivery have run already.
#[classifier]
pub fn vm_remote(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        count_drop();
        return TC_ACT_SHOT;
    };
    match try_vm_remote(&ctx, port) {
        Ok(action) => action,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port.port_id, reason);
            count_drop();
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vm_remote(ctx: &TcContext, port: &PortInfo) -> Verdict {
    let network = port.network;
    let dst = hdr::<EthHdr>(ctx, 0)?.dst_addr;
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let (vxlan, v6) = tunnel(key, network)?;

    if !is_multicast(&dst) {
        let ep_key = EndpointKey::new(network, dst);
        // SAFETY: a map lookup; the value stays valid for this program run.
        let to = match unsafe { ENDPOINTS.get(&ep_key) } {
            Some(ep) if ep.kind == ENDPOINT_REMOTE => Some(ep.node_ip4),
            Some(_) => None,
            // Not configured anywhere: learned from its own frames?
            // SAFETY: a map lookup; the value stays valid for this program run.
            None => unsafe { REMOTE_LEARNED.get(&ep_key) }.map(|l| l.node_ip4),
        };
        if let Some(to) = to {
            set_tunnel_key(ctx.skb.skb, key, to, v6)?;
            count_tx(ctx.len());
            return verdict::redirect(vxlan);
        }
    }

    // Broadcast, multicast, unknown unicast: one copy per remote node.
    flood(ctx, key, network, vxlan, v6)
}
