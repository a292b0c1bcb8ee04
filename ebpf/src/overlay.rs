//! The overlay between nodes: VXLAN through vmpath's collect-metadata
//! vxlan device. The data path only sets the tunnel key (VNI = network id,
//! remote = the node's VTEP address) and redirects; the kernel's vxlan
//! driver builds the outer headers, so the wire format is Linux's own.
//!
//! The underlay is IPv4 or IPv6 (`OverlayConfig::underlay`, one family
//! per cluster). Everything but the tunnel key handles a node by its
//! 4-byte VTEP value: the IPv4 address, or on an IPv6 underlay the
//! agent's handle for the node (`vmp_vtep6` gives the address to send to,
//! `vmp_vtep6_ids` names the node a frame came from: `received_from`).
//!
//! `vm_remote` is a tail call from `vm_port`: `bpf_tunnel_key` would not
//! fit on the VM-port program's nearly full stack.
//!
//! VXLAN source learning: a MAC the config does not give to other nodes
//! (detected from traffic on its hosting node) is learned from the frames
//! it sends over the overlay, as a Linux bridge's FDB learns, into
//! `vmp_remote_learned`: (network, MAC) -> the sending node. Unicast to it
//! then goes to that node only rather than flooded to every node of the
//! network. `vmp_endpoints` always wins: a local VM's MAC or a configured
//! remote one is never learned, and every lookup tries it first.

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_TUNINFO_IPV6, BPF_F_ZERO_CSUM_TX, bpf_tunnel_key},
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    cty::c_void,
    helpers::generated::{
        bpf_clone_redirect, bpf_loop, bpf_skb_get_tunnel_key, bpf_skb_set_tunnel_key,
    },
    macros::btf_map,
    programs::TcContext,
};
use vmpath_common::{
    ENDPOINT_REMOTE, EndpointKey, MAX_FLOOD_NODES, OverlayConfig, PortStats,
    REMOTE_LEARNED_TOUCH_NS, RemoteFloodList, RemoteLearned, drop_reason, identity, maps, skb_cb,
    tail_call,
};

use crate::{
    maps::ENDPOINTS,
    parse::zeroed,
    verdict::{self, PROGS, Verdict},
};

/// Outer TTL of encapsulated frames.
const TUNNEL_TTL: u8 = 64;

/// `bpf_skb_get_tunnel_key`'s answer for a frame whose outer header is
/// of the other family (-EPROTO).
const EPROTO: i64 = 71;

/// IPv6 underlay: a node's VTEP handle -> its IPv6 address.
#[btf_map(name = "vmp_vtep6")]
pub static VTEP6: HashMap<[u8; 4], [u8; 16], { maps::VTEP6.max_entries as usize }> = HashMap::new();

/// IPv6 underlay: a node's IPv6 address -> its VTEP handle.
#[btf_map(name = "vmp_vtep6_ids")]
pub static VTEP6_IDS: HashMap<[u8; 16], [u8; 4], { maps::VTEP6_IDS.max_entries as usize }> =
    HashMap::new();

/// network id -> remote nodes hosting it.
#[btf_map(name = "vmp_flood_remote")]
pub static FLOOD_REMOTE: HashMap<
    u32,
    RemoteFloodList,
    { maps::FLOOD_REMOTE.max_entries as usize },
    { vmpath_common::FLOOD_MAP_FLAGS },
> = HashMap::new();

/// Slot 0: the vxlan device; ifindex 0 while it is not set up.
#[btf_map(name = "vmp_overlay")]
pub static OVERLAY: Array<OverlayConfig, { maps::OVERLAY.max_entries as usize }> = Array::new();

/// Slot 0: `tx` = frames sent to remote nodes, `rx` = frames received from
/// them, `drops` = overlay drops (also counted by reason in `vmp_drops`).
#[btf_map(name = "vmp_overlay_stats")]
pub static OVERLAY_STATS: PerCpuArray<PortStats, { maps::OVERLAY_STATS.max_entries as usize }> =
    PerCpuArray::new();

/// (network, MAC) -> the node a remote VM's frames came from (VXLAN
/// source learning; written by `vxlan_rx`, aged and pruned by the agent).
#[btf_map(name = "vmp_remote_learned")]
pub static REMOTE_LEARNED: LruHashMap<
    EndpointKey,
    RemoteLearned,
    { maps::REMOTE_LEARNED.max_entries as usize },
> = LruHashMap::new();

/// Was `key`'s MAC learned behind another node? (`fwd::switch`, on a
/// `vmp_endpoints` miss: such unicast goes to `vm_remote`, not flooded.)
#[inline(always)]
pub fn is_learned(key: &EndpointKey) -> bool {
    // SAFETY: a map lookup (only its presence is used); valid for this program run.
    unsafe { REMOTE_LEARNED.get(key) }.is_some()
}

/// From `vxlan_rx`, after the VNI and the sending node were checked: a
/// frame from `src`, which `vmp_endpoints` does not hold (neither a local
/// port nor a configured remote VM), came from the node `from`. Records or
/// moves the MAC there (a VM that moved announces itself from its new
/// node); an unchanged entry is only touched now and then, so steady
/// traffic does not write the map on every frame.
#[inline(always)]
pub fn learn_source(network: u32, src: [u8; 6], from: [u8; 4]) {
    let key = EndpointKey::new(network, src);
    let now = crate::clock::flow_now();
    if let Some(seen) = REMOTE_LEARNED.get_ptr_mut(&key) {
        // SAFETY: `seen` is from `get_ptr_mut` (bpf_map_lookup_elem), valid until the
        // program returns. Another CPU may write the same entry at the same time;
        // the fields are plain integers, so a race can only leave a stale
        // timestamp (a whole new value is inserted when the node changes).
        unsafe {
            if (*seen).node_ip4 == from {
                if now.wrapping_sub((*seen).last_seen_ns) > REMOTE_LEARNED_TOUCH_NS {
                    (*seen).last_seen_ns = now;
                }
                return;
            }
        }
    }
    // New, or moved: a whole new value (readers see the old node or the
    // new one, never a mix).
    let learned = RemoteLearned {
        node_ip4: from,
        _pad: 0,
        last_seen_ns: now,
    };
    let _ = REMOTE_LEARNED.insert(&key, &learned, 0);
}

/// From `vxlan_rx`, before any delivery: the policy identity of the
/// frame's sender, kept in the skb's `cb[4]` (`sender_identity` reads it)
/// for the ingress checks of this run and of the programs it tail-calls.
/// The sender is the remote endpoint its inner source MAC `src` names,
/// and only from the node that endpoint lives on (`from`; a frame another
/// node relayed, during a migration, is not: the relaying node vouches
/// for no sender): that endpoint's identity, whatever source address the
/// frame claims, as for a local sender. A MAC no entry places there
/// (detected on its node only, or claimed by another VM) is
/// `identity::WORLD`: a frame never gains permissions by what it claims.
/// Routed ingress another node's uplink relays (from the gateway MAC) is
/// outside traffic, judged by its address (0 here).
#[inline(always)]
pub fn mark_sender(ctx: &TcContext, network: u32, src: [u8; 6], from: [u8; 4], from_gateway: bool) {
    let id = if from_gateway {
        identity::ANY
    } else {
        // SAFETY: a map lookup; the value stays valid for this program run.
        match unsafe { ENDPOINTS.get(&EndpointKey::new(network, src)) } {
            Some(ep)
                if ep.kind == ENDPOINT_REMOTE
                    && ep.node_ip4 == from
                    && ep.identity != identity::ANY =>
            {
                ep.identity
            }
            _ => identity::WORLD,
        }
    };
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame.
    unsafe { (*ctx.skb.skb).cb[skb_cb::SCRATCH] = id };
}

/// The policy identity `mark_sender` gave a frame that came over the
/// overlay (this run started on the vxlan device); `None`: the frame did
/// not, or it is judged by its source address.
#[inline(always)]
pub fn sender_identity(ctx: &TcContext) -> Option<u32> {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let (ifindex, id) = unsafe { ((*ctx.skb.skb).ifindex, (*ctx.skb.skb).cb[skb_cb::SCRATCH]) };
    let cfg = OVERLAY.get(0)?;
    if cfg.vxlan_ifindex == 0 || ifindex != cfg.vxlan_ifindex || id == identity::ANY {
        return None;
    }
    Some(id)
}

/// Does any other node host `network`?
#[inline(always)]
pub fn has_remote(network: u32) -> bool {
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { FLOOD_REMOTE.get(&network) }.is_some_and(|l| l.count != 0)
}

/// Is `ip` one of the nodes hosting `network`? A binary search of the
/// sorted list: every frame from the overlay asks, and a network may span
/// thousands of nodes. Each halving is a `bpf_loop` step: inline, the
/// verifier would walk every path of the search through the rest of
/// `vxlan_rx`.
#[inline(always)]
pub fn is_remote_node(network: u32, ip: [u8; 4]) -> bool {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(list) = (unsafe { FLOOD_REMOTE.get(&network) }) else {
        return false;
    };
    let mut search = NodeSearch {
        list,
        want: u32::from_be_bytes(ip),
        lo: 0,
        hi: list.count.min(MAX_FLOOD_NODES as u32),
        found: 0,
    };
    // Halving from MAX_FLOOD_NODES ends within its bit length of steps.
    // SAFETY: the callback is a function of this object taking the
    // context's type; `search` outlives the call.
    unsafe {
        bpf_loop(
            MAX_FLOOD_NODES.ilog2() + 1,
            node_search_step as *mut c_void,
            (&raw mut search).cast(),
            0,
        )
    };
    search.found != 0
}

/// `is_remote_node`'s state across its `bpf_loop`: the half-open range
/// `lo..hi` of the list still to search.
#[repr(C)]
struct NodeSearch {
    list: *const RemoteFloodList,
    want: u32,
    lo: u32,
    hi: u32,
    found: u32,
}

/// One halving (`bpf_loop` callback: 0 goes on, 1 stops).
#[inline(never)]
extern "C" fn node_search_step(_: u32, search: *mut c_void) -> i64 {
    // SAFETY: `search` is the `NodeSearch` `is_remote_node` handed over.
    let search = unsafe { &mut *search.cast::<NodeSearch>() };
    if search.lo >= search.hi {
        return 1;
    }
    let mid = search.lo + (search.hi - search.lo) / 2;
    // SAFETY: the map value `is_remote_node` found, valid for this run.
    let list = unsafe { &*search.list };
    // Masked, not only checked: the verifier then needs no precise bounds
    // of `lo` and `hi`, and the steps' states converge.
    let Some(node) = list.node_ip4.get(mid as usize & (MAX_FLOOD_NODES - 1)) else {
        return 1;
    };
    let at = u32::from_be_bytes(*node);
    if at == search.want {
        search.found = 1;
        return 1;
    }
    if at < search.want {
        search.lo = mid + 1;
    } else {
        search.hi = mid;
    }
    0
}

/// On to `vm_remote` (unicast to a remote MAC, or the remote copies of a
/// flood).
#[inline(always)]
pub fn to_remote(ctx: &TcContext) -> Verdict {
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return, otherwise execution falls through to the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::VM_REMOTE) };
    // Only reached when the slot is empty (agent still starting).
    Err(drop_reason::OVERLAY_DOWN)
}

#[inline(always)]
pub fn count_rx(bytes: u32) {
    if let Some(s) = OVERLAY_STATS.get_ptr_mut(0) {
        // SAFETY: a pointer into this CPU's slot of a per-CPU array, valid for this
        // run; no other writer (per-CPU, no preemption in BPF).
        unsafe {
            (*s).rx_packets += 1;
            (*s).rx_bytes += u64::from(bytes);
        }
    }
}

#[inline(always)]
pub fn count_tx(bytes: u32) {
    if let Some(s) = OVERLAY_STATS.get_ptr_mut(0) {
        // SAFETY: as in `count_rx`: this CPU's slot of a per-CPU array, no other writer.
        unsafe {
            (*s).tx_packets += 1;
            (*s).tx_bytes += u64::from(bytes);
        }
    }
}

/// A frame relayed to a migrated VM's new node counts as sent.
#[inline(always)]
pub fn count_relay(bytes: u32) {
    count_tx(bytes);
}

#[inline(always)]
pub fn count_drop() {
    if let Some(s) = OVERLAY_STATS.get_ptr_mut(0) {
        // SAFETY: as in `count_rx`: this CPU's slot of a per-CPU array, no other writer.
        unsafe { (*s).drops += 1 };
    }
}

/// One copy of the frame to each remote node hosting `network`, the
/// original to the last one. The copies are made by a `bpf_loop` over the
/// list: the verifier checks one node's step once, whatever the count.
#[inline(always)]
pub fn flood(
    ctx: &TcContext,
    key: &mut bpf_tunnel_key,
    network: u32,
    vxlan: u32,
    v6: bool,
) -> Verdict {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(list) = (unsafe { FLOOD_REMOTE.get(&network) }) else {
        return Err(drop_reason::NO_DESTINATION);
    };
    let count = list.count as usize;
    if count == 0 || count > MAX_FLOOD_NODES {
        return Err(drop_reason::NO_DESTINATION);
    }
    let mut walk = RemoteFlood {
        skb: ctx.skb.skb,
        list,
        key,
        vxlan,
        len: ctx.len(),
        v6: u32::from(v6),
        failed: 0,
    };
    // SAFETY: the callback is a function of this object taking the
    // context's type; `walk` outlives the call.
    unsafe {
        bpf_loop(
            (count - 1) as u32,
            clone_remote_member as *mut c_void,
            (&raw mut walk).cast(),
            0,
        )
    };
    if walk.failed != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    let Some(&last) = list.node_ip4.get(count - 1) else {
        return Err(drop_reason::NO_DESTINATION);
    };
    set_tunnel_key(ctx.skb.skb, key, last, v6)?;
    count_tx(walk.len);
    verdict::redirect(vxlan)
}

/// `flood`'s state across its `bpf_loop`.
#[repr(C)]
struct RemoteFlood {
    skb: *mut __sk_buff,
    list: *const RemoteFloodList,
    key: *mut bpf_tunnel_key,
    vxlan: u32,
    len: u32,
    /// 1 on an IPv6 underlay.
    v6: u32,
    /// Set when a tunnel key could not be set: the flood stops there.
    failed: u32,
}

/// A copy of the frame to node `i` of the list (`bpf_loop` callback: 0
/// goes on, 1 stops).
#[inline(never)]
extern "C" fn clone_remote_member(i: u32, walk: *mut c_void) -> i64 {
    // SAFETY: `walk` is the `RemoteFlood` `flood` handed to `bpf_loop`.
    let walk = unsafe { &mut *walk.cast::<RemoteFlood>() };
    // SAFETY: the map value `flood` found, valid for this run.
    let list = unsafe { &*walk.list };
    let Some(&node) = list.node_ip4.get(i as usize) else {
        return 1;
    };
    // SAFETY: `key` points at `flood`'s tunnel key, alive for the call.
    let key = unsafe { &mut *walk.key };
    if set_tunnel_key(walk.skb, key, node, walk.v6 != 0).is_err() {
        walk.failed = 1;
        return 1;
    }
    // SAFETY: the skb is the program's own context and the other arguments are
    // integers; no packet pointer is held across the call.
    if unsafe { bpf_clone_redirect(walk.skb, walk.vxlan, 0) } == 0 {
        count_tx(walk.len);
    }
    0
}

/// Sends the frame as it is to the node `node_ip4` over the overlay (VNI =
/// `network`): routed ingress for a VM that node hosts (`uplink`). The
/// receiving node's `vxlan_rx` delivers it to the VM's local port, or
/// relays it once more if the VM has just moved on.
#[inline(always)]
pub fn send_to_node(ctx: &TcContext, network: u32, node_ip4: [u8; 4]) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let (vxlan, v6) = tunnel(key, network)?;
    set_tunnel_key(ctx.skb.skb, key, node_ip4, v6)?;
    count_tx(ctx.len());
    verdict::redirect(vxlan)
}

/// Fills `key` (every field) for `network` from this node: VNI, TTL and
/// the local VTEP of the underlay's family. Returns the vxlan device and
/// whether the underlay is IPv6; the remote is `set_tunnel_key`'s.
#[inline(always)]
pub fn tunnel(key: &mut bpf_tunnel_key, network: u32) -> Result<(u32, bool), u32> {
    let Some(cfg) = OVERLAY.get(0) else {
        return Err(drop_reason::OVERLAY_DOWN);
    };
    let vxlan = cfg.vxlan_ifindex;
    if vxlan == 0 {
        return Err(drop_reason::OVERLAY_DOWN);
    }
    let v6 = cfg.is_ipv6();
    key.tunnel_id = network;
    key.tunnel_tos = 0;
    key.tunnel_ttl = TUNNEL_TTL;
    key.__bindgen_anon_2.tunnel_ext = 0;
    key.tunnel_label = 0;
    key.__bindgen_anon_1.remote_ipv6 = [0; 4];
    if v6 {
        put_ipv6(&raw mut key.__bindgen_anon_3.local_ipv6, &cfg.local_ip6);
    } else {
        key.__bindgen_anon_3.local_ipv6 = [u32::from_be_bytes(cfg.local_ip4), 0, 0, 0];
    }
    Ok((vxlan, v6))
}

/// Writes an IPv6 address into a tunnel key's address field, as the key
/// holds it: the bytes in network order (the helper copies them as they
/// are). Straight from the map value: a copy on the stack would not fit
/// beside `vxlan_resolve`'s.
#[inline(always)]
fn put_ipv6(to: *mut [u32; 4], addr: &[u8; 16]) {
    // SAFETY: `to` is a 16-byte field of a `bpf_tunnel_key` the caller
    // holds mutably; `addr` is 16 readable bytes; they do not overlap.
    unsafe { core::ptr::copy_nonoverlapping(addr.as_ptr(), to.cast::<u8>(), 16) };
}

/// The tunnel key of a frame the vxlan device decapsulated, into `key`,
/// and the sending node's 4-byte VTEP value: its IPv4 address, or on an
/// IPv6 underlay the handle `vmp_vtep6_ids` gives its IPv6 address. A
/// frame of the other underlay family, or from an IPv6 address that is no
/// node's, is `overlay_unknown_vtep`: it names no node this one knows.
#[inline(always)]
pub fn received_from(ctx: &TcContext, key: &mut bpf_tunnel_key) -> Result<[u8; 4], u32> {
    let v6 = OVERLAY.get(0).is_some_and(|c| c.is_ipv6());
    let flags = if v6 { u64::from(BPF_F_TUNINFO_IPV6) } else { 0 };
    // SAFETY: `key` is a `bpf_tunnel_key` on the caller's stack and the size
    // passed is its own; the skb is the program's own context.
    let rc = unsafe {
        bpf_skb_get_tunnel_key(
            ctx.skb.skb,
            key,
            core::mem::size_of::<bpf_tunnel_key>() as u32,
            flags,
        )
    };
    if rc == -EPROTO {
        return Err(drop_reason::OVERLAY_UNKNOWN_VTEP);
    }
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    if !v6 {
        // SAFETY: a union of plain integers (any bit pattern is valid); without
        // BPF_F_TUNINFO_IPV6 the helper filled the IPv4 member (host order).
        return Ok(unsafe { key.__bindgen_anon_1.remote_ipv4 }.to_be_bytes());
    }
    // SAFETY: with BPF_F_TUNINFO_IPV6 the helper filled the IPv6 member,
    // the address's 16 bytes in network order: read in place as bytes (no
    // copy on the stack, which `vxlan_resolve` has no room for).
    let from = unsafe { &*(&raw const key.__bindgen_anon_1.remote_ipv6).cast::<[u8; 16]>() };
    // SAFETY: a map lookup; the value is copied out at once.
    match unsafe { VTEP6_IDS.get(from) } {
        Some(id) => Ok(*id),
        None => Err(drop_reason::OVERLAY_UNKNOWN_VTEP),
    }
}

/// Re-encapsulates the frame `vxlan_rx` received (its tunnel key in
/// `key`, reused: the receive program's stack has no room for another)
/// for the node `to`, with the relay TTL as the once-only marker.
#[inline(always)]
pub fn relay_to(ctx: &TcContext, key: &mut bpf_tunnel_key, to: [u8; 4], ttl: u8) -> Verdict {
    let network = key.tunnel_id;
    let (vxlan, v6) = tunnel(key, network)?;
    key.tunnel_ttl = ttl;
    set_tunnel_key(ctx.skb.skb, key, to, v6)?;
    count_relay(ctx.len());
    verdict::redirect(vxlan)
}

/// The frame to every other node hosting `network` (a resolution
/// request from the uplink: `resolve`).
#[inline(always)]
pub fn flood_nodes(ctx: &TcContext, network: u32) -> Verdict {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let (vxlan, v6) = tunnel(key, network)?;
    flood(ctx, key, network, vxlan, v6)
}

/// A copy of the frame as it is now to `node_ip4`, sent at once; the
/// program goes on with the original (`resolve`: the forwarded frame
/// before the original becomes a request).
#[inline(always)]
pub fn copy_to_node(ctx: &TcContext, network: u32, node_ip4: [u8; 4]) -> Result<(), u32> {
    let mut key_slot = MaybeUninit::<bpf_tunnel_key>::uninit();
    let key = zeroed(&mut key_slot);
    let (vxlan, v6) = tunnel(key, network)?;
    set_tunnel_key(ctx.skb.skb, key, node_ip4, v6)?;
    // SAFETY: the skb is the program's own context and the other arguments are
    // integers; no packet pointer is held across the call.
    if unsafe { bpf_clone_redirect(ctx.skb.skb, vxlan, 0) } != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    count_tx(ctx.len());
    Ok(())
}

/// The node a MAC the config does not place was learned behind, if any.
#[inline(always)]
pub fn learned_node(key: &EndpointKey) -> Option<[u8; 4]> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { REMOTE_LEARNED.get(key) }.map(|l| l.node_ip4)
}

/// Points the frame's tunnel key at the node `node` (its 4-byte VTEP
/// value; `v6`: a handle `vmp_vtep6` turns into its IPv6 address). Each
/// copy of a flood gets its own: the key lives in the skb's metadata, and
/// a clone is encapsulated before `bpf_clone_redirect` returns.
#[inline(always)]
pub fn set_tunnel_key(
    skb: *mut __sk_buff,
    key: &mut bpf_tunnel_key,
    node: [u8; 4],
    v6: bool,
) -> Result<(), u32> {
    let flags = if v6 {
        // SAFETY: a map lookup; the value is read at once.
        let Some(addr) = (unsafe { VTEP6.get(&node) }) else {
            // A handle the agent has not (or no longer) given an address.
            return Err(drop_reason::NO_DESTINATION);
        };
        put_ipv6(&raw mut key.__bindgen_anon_1.remote_ipv6, addr);
        // With the outer UDP checksum, as Linux vxlan devices send over
        // IPv6 by default (RFC 8200: a receiver may drop zero checksums).
        u64::from(BPF_F_TUNINFO_IPV6)
    } else {
        key.__bindgen_anon_1.remote_ipv4 = u32::from_be_bytes(node);
        // Zero outer UDP checksum, as Linux vxlan devices send by default.
        u64::from(BPF_F_ZERO_CSUM_TX)
    };
    // SAFETY: `key` is a valid `bpf_tunnel_key` for the call and the size
    // passed is its size; the skb pointer is the program's own context.
    let rc = unsafe {
        bpf_skb_set_tunnel_key(
            skb,
            key,
            core::mem::size_of::<bpf_tunnel_key>() as u32,
            flags,
        )
    };
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    Ok(())
}
