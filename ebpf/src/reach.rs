//! Reach: a node's own stack and the endpoints of Primary networks on
//! other nodes (docs/kubernetes.md, "In, from any other node"), so
//! kube-proxy's NodePort on any node reaches a backend on any other, and
//! cluster pods reach an endpoint by address wherever it runs.
//!
//! Every node routes each Primary network's subnets into the vxlan device
//! (the agent's routes; its own endpoints have host routes down their
//! ports, which win). `vxlan_from_stack`, at the device's egress, sends
//! what the stack routes there to the node hosting the address
//! (`vmp_endpoints`, which a migration's cut-over repoints) with
//! `REACH_VNI`. That node's `vxlan_reach` delivers it to the endpoint as
//! routed ingress (its ingress policy judges the sender by address) and
//! keeps the flow (`vmp_reach_flows`, keyed as the endpoint answers);
//! `vm_egress` sends the endpoint's answers on such a flow back the same
//! way, where `vxlan_reach` hands them to that node's stack, which saw
//! the flow leave: its conntrack (kube-proxy's NodePort translation)
//! recognises them, and its reverse-path filter accepts them on the
//! device its route to the subnet names. Nothing is masqueraded on the
//! way: the endpoint sees the address the request came from.

use core::mem::MaybeUninit;

use aya_ebpf::btf_maps::lpm_trie::Key;
use aya_ebpf::{
    bindings::{TC_ACT_OK, bpf_tunnel_key},
    btf_maps::{HashMap, LruHashMap},
    helpers::generated::bpf_skb_get_tunnel_key,
    macros::btf_map,
    programs::TcContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
};
use vmpath_common::{
    AddrKey, ENDPOINT_REMOTE, EndpointKey, POLICY_FLOW_REFRESH_NS, PRIMARY_SUBNETS,
    REACH_FLOW_TIMEOUT_NS, REACH_VNI, ReachFlow, ReachFlowKey, Subnet4, Subnet6, VXLAN_PORT,
    addr_family, drop_reason, identity, maps, skb_cb,
};

use crate::{
    clock::flow_now,
    fwd, host,
    maps::{ADDRESSES, ENDPOINTS, NETWORKS},
    overlay,
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, hdr, hdr_mut, write_mac, zeroed,
    },
    route::{SUBNETS4, SUBNETS6},
    verdict::Verdict,
};

const IPPROTO_SCTP: u8 = 132;
const IP_MF_OFFSET: u16 = 0x3fff;

/// Every other node's VTEP value: the only senders of `REACH_VNI`.
#[btf_map(name = "vmp_reach_nodes")]
pub static REACH_NODES: HashMap<[u8; 4], u32, { maps::REACH_NODES.max_entries as usize }> =
    HashMap::new();

/// Flows other nodes' stacks opened to local endpoints, keyed as the
/// endpoint answers them.
#[btf_map(name = "vmp_reach_flows")]
pub static REACH_FLOWS: LruHashMap<
    ReachFlowKey,
    ReachFlow,
    { maps::REACH_FLOWS.max_entries as usize },
> = LruHashMap::new();

/// The Primary network whose subnets hold `addr` (`vmp_subnets*` under
/// `PRIMARY_SUBNETS`).
#[inline(always)]
fn network_of(family: u8, addr: &[u8; 16]) -> Option<u32> {
    let network = PRIMARY_SUBNETS.to_be_bytes();
    let id = if family == addr_family::IPV4 {
        let addr = [addr[0], addr[1], addr[2], addr[3]];
        SUBNETS4.get(&Key::new(64, Subnet4 { network, addr }))
    } else {
        SUBNETS6.get(&Key::new(
            160,
            Subnet6 {
                network,
                addr: *addr,
            },
        ))
    };
    id.copied()
}

/// The frame's IP tuple as `k` (ports: TCP, UDP or SCTP right after the
/// fixed header, of an unfragmented or first fragment; else 0). `false`:
/// not IP.
#[inline(always)]
fn tuple(ctx: &TcContext, k: &mut ReachFlowKey) -> Result<bool, u32> {
    let ether_type = u16::from_be(hdr::<EthHdr>(ctx, 0)?.ether_type);
    let l4_off = match ether_type {
        ETH_P_IP => {
            let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
            k.family = addr_family::IPV4;
            k.proto = ip.proto;
            k.src[..4].copy_from_slice(&ip.src_addr);
            k.dst[..4].copy_from_slice(&ip.dst_addr);
            if u16::from_be_bytes(ip.frags) & IP_MF_OFFSET != 0 {
                return Ok(true);
            }
            ETH_LEN + usize::from(ip.vihl & 0x0f) * 4
        }
        ETH_P_IPV6 => {
            let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
            k.family = addr_family::IPV6;
            k.proto = ip.next_hdr;
            k.src = ip.src_addr;
            k.dst = ip.dst_addr;
            ETH_LEN + Ipv6Hdr::LEN
        }
        _ => return Ok(false),
    };
    if matches!(k.proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        let ports = hdr::<[u8; 4]>(ctx, l4_off)?;
        k.sport = u16::from_be_bytes([ports[0], ports[1]]);
        k.dport = u16::from_be_bytes([ports[2], ports[3]]);
    }
    Ok(true)
}

/// `vxlan_from_stack`: a frame at the vxlan device's egress. The data
/// path's own carry their tunnel key and pass; the stack's, routed to a
/// Primary network's subnet, go to the node hosting the address.
#[inline(always)]
pub fn from_stack(ctx: &TcContext) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    // SAFETY: `key` is a `bpf_tunnel_key` on our stack and the size passed
    // is its own; the skb is the program's own context.
    let has_key = unsafe {
        bpf_skb_get_tunnel_key(
            ctx.skb.skb,
            key,
            core::mem::size_of::<bpf_tunnel_key>() as u32,
            0,
        )
    } == 0;
    if has_key {
        return Ok(TC_ACT_OK);
    }
    let mut k_slot = MaybeUninit::<ReachFlowKey>::uninit();
    let k = zeroed(&mut k_slot);
    // Not IP, or for no Primary network (the device's own neighbour
    // discovery): no tunnel key, so the driver drops it, as before.
    if !tuple(ctx, k)? {
        return Ok(TC_ACT_OK);
    }
    let Some(network) = network_of(k.family, &k.dst) else {
        return Ok(TC_ACT_OK);
    };
    let addr = if k.family == addr_family::IPV4 {
        AddrKey::v4(network, [k.dst[0], k.dst[1], k.dst[2], k.dst[3]])
    } else {
        AddrKey::v6(network, &k.dst)
    };
    // SAFETY: map lookups; the values stay valid for this program run.
    let Some(info) = (unsafe { ADDRESSES.get(&addr) }) else {
        return Err(drop_reason::REACH_NO_ENDPOINT);
    };
    // By its MAC where known here (a migration's cut-over repoints the
    // endpoint at once), else the node the agent placed the address on.
    // SAFETY: as above.
    let node = match unsafe { ENDPOINTS.get(&EndpointKey::new(network, info.mac)) } {
        Some(ep) if ep.kind == ENDPOINT_REMOTE => ep.node_ip4,
        None if info.ifindex == 0 && info.node_ip4 != [0; 4] => info.node_ip4,
        _ => return Err(drop_reason::REACH_NO_ENDPOINT),
    };
    let (_, v6) = overlay::tunnel(key, REACH_VNI)?;
    overlay::set_tunnel_key(ctx.skb.skb, key, node, v6)?;
    overlay::count_tx(ctx.len());
    Ok(TC_ACT_OK)
}

/// `vxlan_reach`: a `REACH_VNI` frame from another node. For a local
/// endpoint's address: delivered as routed ingress (from the gateway's
/// MAC; ingress policy judges the sender by address), its flow kept for
/// the answers. From an endpoint's address to anything else: an answer
/// to this node's stack, handed to it.
#[inline(always)]
pub fn received(ctx: &TcContext) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let from = overlay::received_from(ctx, key)?;
    // Only another node: anything else writing VXLAN to this node's port
    // (a pod, a VM through its node's stack, a host on the underlay)
    // would hand a frame of any source to an endpoint or the stack.
    // SAFETY: a map lookup; the value is not kept.
    if unsafe { REACH_NODES.get(&from) }.is_none() {
        return Err(drop_reason::OVERLAY_UNKNOWN_VTEP);
    }
    let mut k_slot = MaybeUninit::<ReachFlowKey>::uninit();
    let k = zeroed(&mut k_slot);
    if !tuple(ctx, k)? {
        return Err(drop_reason::REACH_NO_ENDPOINT);
    }
    let Some(network) = network_of(k.family, &k.dst) else {
        if network_of(k.family, &k.src).is_some() {
            return host::deliver(ctx);
        }
        return Err(drop_reason::REACH_NO_ENDPOINT);
    };
    let addr = if k.family == addr_family::IPV4 {
        AddrKey::v4(network, [k.dst[0], k.dst[1], k.dst[2], k.dst[3]])
    } else {
        AddrKey::v6(network, &k.dst)
    };
    // SAFETY: map lookups; the values stay valid for this program run.
    let (Some(info), Some(net)) = (unsafe { ADDRESSES.get(&addr) }, unsafe {
        NETWORKS.get(&network)
    }) else {
        return Err(drop_reason::REACH_NO_ENDPOINT);
    };
    // Moved on (a migration) or never here: the sending node's next
    // frame follows `vmp_endpoints` there.
    if info.ifindex == 0 {
        return Err(drop_reason::REACH_NO_ENDPOINT);
    }
    let (ifindex, port_id, mac, gw_mac) = (info.ifindex, info.port_id, info.mac, net.gw_mac);
    // Keyed as the endpoint will answer.
    core::mem::swap(&mut k.src, &mut k.dst);
    core::mem::swap(&mut k.sport, &mut k.dport);
    let now = flow_now();
    match REACH_FLOWS.get_ptr_mut(&*k) {
        // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem), valid for this
        // run; a racing writer writes the same values.
        Some(f) if unsafe { (*f).node } == from => unsafe {
            if now.saturating_sub((*f).last_seen) > POLICY_FLOW_REFRESH_NS {
                (*f).last_seen = now;
            }
        },
        _ => {
            let flow = ReachFlow {
                node: from,
                _pad: 0,
                last_seen: now,
            };
            // A full table forgets its oldest flow; should the insert
            // still fail, the answers take the hand-off (masqueraded:
            // the peer refuses them) until the next frame inserts again.
            let _ = REACH_FLOWS.insert(&*k, &flow, 0);
        }
    }
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    write_mac(&mut eth.dst_addr, mac);
    write_mac(&mut eth.src_addr, gw_mac);
    // Judged by its source address: no endpoint sent it.
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame.
    unsafe { (*ctx.skb.skb).cb[skb_cb::SCRATCH] = identity::ANY };
    fwd::deliver_local(ctx, ifindex, port_id)
}

/// The node whose stack opened the flow a local endpoint's frame answers
/// (`vm_egress`, on a Primary network), if any.
#[inline(always)]
pub fn answered_node(ctx: &TcContext) -> Option<[u8; 4]> {
    let mut k_slot = MaybeUninit::<ReachFlowKey>::uninit();
    let k = zeroed(&mut k_slot);
    if !tuple(ctx, k).ok()? {
        return None;
    }
    let flow = REACH_FLOWS.get_ptr_mut(&*k)?;
    // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem), valid for this run.
    let (node, last_seen) = unsafe { ((*flow).node, (*flow).last_seen) };
    if flow_now().saturating_sub(last_seen) >= REACH_FLOW_TIMEOUT_NS {
        return None;
    }
    Some(node)
}

/// Whether a VM's frame (`vm_egress`) is UDP to another node's overlay
/// port: routed or translated to the node's address, it would reach that
/// node's vxlan device as this node's own frame (any VNI, any inner
/// source).
#[inline(always)]
pub fn to_overlay_port(
    ctx: &TcContext,
    family: u8,
    dst: &[u8; 16],
    proto: u8,
    l4_off: usize,
) -> bool {
    if proto != IPPROTO_UDP {
        return false;
    }
    let Ok(ports) = hdr::<[u8; 4]>(ctx, l4_off) else {
        return false;
    };
    if u16::from_be_bytes([ports[2], ports[3]]) != VXLAN_PORT {
        return false;
    }
    // SAFETY: map lookups; the values are not kept.
    unsafe {
        if family == addr_family::IPV4 {
            REACH_NODES.get(&[dst[0], dst[1], dst[2], dst[3]]).is_some()
        } else {
            overlay::VTEP6_IDS.get(dst).is_some()
        }
    }
}

/// Over the overlay to `node`'s stack (`REACH_VNI`).
#[inline(always)]
pub fn to_node(ctx: &TcContext, node: [u8; 4]) -> Verdict {
    overlay::send_to_node(ctx, REACH_VNI, node)
}
