//! NetworkPolicy, after Cilium: no rule list is walked per packet. The
//! agent gives every label set (and every ipBlock region) an identity,
//! `vmp_pol_ipcache` maps (network, address) to the peer's identity, and
//! `vmp_pol_rules` holds what each endpoint allows keyed by (endpoint,
//! direction, peer identity, protocol, port) with wildcards as shorter
//! prefixes. A new flow is checked once, on the sender's port (egress)
//! and right before delivery to a local port (ingress); what it allowed
//! goes into `vmp_pol_flows`, so its later packets and its replies pass
//! on one lookup, and so do ICMP errors about it.
//!
//! Endpoints no policy selects cost one array lookup. ARP, neighbour
//! discovery, MLD and DHCP always pass: the gateway answers them.
//! A full flow table forgets its oldest flows (LRU); their next packet is
//! checked against policy again, never let through unchecked.
//!
//! IPv6 is judged by what it carries past hop-by-hop, routing,
//! destination-options and fragment headers (`spoof::walk6`, the bounded
//! walk the guards and SNAT use). A fragmented datagram is judged by its
//! first fragment, whose ports `vmp_pol_frags` keeps (keyed as the
//! kernel keys reassembly) for its later fragments, which carry none:
//! they take its verdict. A later fragment whose first policy did not see
//! is denied where the direction is isolated (`policy_fragment`).

use core::mem::MaybeUninit;

use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    macros::btf_map,
    programs::TcContext,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr};
use vmpath_common::{
    DatagramKey, EndpointKey, FloodList, IdentityPrefix, POL_F_EGRESS, POL_F_INGRESS,
    POLICY_CB_DELIVER, POLICY_CB_EGRESS_DONE, POLICY_CB_UNTRACKED, POLICY_FLOW_OTHER_TIMEOUT_NS,
    POLICY_FLOW_REFRESH_NS, POLICY_FLOW_TCP_TIMEOUT_NS, POLICY_LEN_FULL, POLICY_NONE,
    PolicyEndpoint, PolicyFlow, PolicyFlowKey, PolicyFrag, PolicyRuleKey, PolicyStats, PortInfo,
    addr_family, drop_reason, identity, maps, policy_dir, skb_cb, tail_call,
};

use crate::{
    clock::flow_now,
    counters,
    frag::{self, Noted6, Piece},
    maps::{ENDPOINTS, PORTS},
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, hdr,
    },
    spoof::{IPPROTO_FRAGMENT, walk6},
    verdict::{PROGS, Verdict},
};

/// Port id -> isolation flags and identity of the endpoint.
#[btf_map(name = "vmp_pol_ep")]
pub static POLICY_ENDPOINTS: Array<
    PolicyEndpoint,
    { maps::POLICY_ENDPOINTS.max_entries as usize },
> = Array::new();

/// (network, address prefix) -> identity.
#[btf_map(name = "vmp_pol_ipcache")]
pub static POLICY_IPCACHE: LpmTrie<
    IdentityPrefix,
    u32,
    { maps::POLICY_IPCACHE.max_entries as usize },
> = LpmTrie::new();

/// (endpoint, direction, identity, protocol, port prefix) -> policy index.
#[btf_map(name = "vmp_pol_rules")]
pub static POLICY_RULES: LpmTrie<PolicyRuleKey, u32, { maps::POLICY_RULES.max_entries as usize }> =
    LpmTrie::new();

/// Flows policy allowed, keyed as first seen by the endpoint.
#[btf_map(name = "vmp_pol_flows")]
pub static POLICY_FLOWS: LruHashMap<
    PolicyFlowKey,
    PolicyFlow,
    { maps::POLICY_FLOWS.max_entries as usize },
> = LruHashMap::new();

/// Port id -> allowed flows and denied packets, per CPU.
#[btf_map(name = "vmp_pol_stats")]
pub static POLICY_STATS: PerCpuArray<PolicyStats, { maps::POLICY_STATS.max_entries as usize }> =
    PerCpuArray::new();

/// Slot 0: the packet's flow key, per CPU: built here rather than on the
/// stack, which the VM port's program has little of left.
#[btf_map(name = "vmp_pol_scratch")]
pub static POLICY_SCRATCH: PerCpuArray<
    PolicyFlowKey,
    { maps::POLICY_SCRATCH.max_entries as usize },
> = PerCpuArray::new();

/// Datagrams whose first fragment policy saw -> its protocol and ports,
/// for its later fragments (`frag`).
#[btf_map(name = "vmp_pol_frags")]
pub static POLICY_FRAGS: LruHashMap<
    DatagramKey,
    PolicyFrag,
    { maps::POLICY_FRAGS.max_entries as usize },
> = LruHashMap::new();

/// Policy index -> flows it allowed, per CPU.
#[btf_map(name = "vmp_pol_hits")]
pub static POLICY_HITS: PerCpuArray<u64, { maps::POLICY_HITS.max_entries as usize }> =
    PerCpuArray::new();

const IPPROTO_SCTP: u8 = 132;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_ECHO: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
const ICMPV6_ERROR_MAX: u8 = 4;
const ICMPV6_ECHO_REQUEST: u8 = 128;
const ICMPV6_ECHO_REPLY: u8 = 129;

/// What `parse` found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Not policy's business: no IP, or ND, MLD, DHCP.
    Exempt,
    /// A packet that may open a flow.
    Opens,
    /// An ICMP error: the key is that of a reply to the packet it quotes;
    /// it never opens a flow.
    Related,
    /// A later fragment whose first fragment policy did not see (or saw
    /// over `FRAG_TIMEOUT_NS` ago): no ports to judge it by.
    Unplaced,
}

/// A frame's tuple left in this CPU's scratch slot by the egress check in
/// this same program run, with the time it read: the ingress check before
/// a local delivery of the same, unchanged frame reuses both instead of
/// reading the headers and the clock again.
#[derive(Clone, Copy)]
pub struct Parsed {
    now: u64,
    exempt: bool,
    /// The port whose ingress a shared (`policy_dir::PAIR`) entry of the
    /// flow vouches for, with the sender's egress (0: none): the delivery
    /// to that port looks nothing up.
    pair_to: u32,
    /// The sender's port id when its egress passed on its own entry and
    /// the frame may be switched locally on `network`: a delivery whose
    /// ingress passes on its own entry too records a shared one, which
    /// the flow's later frames look up instead of the two (0: no).
    from_port: u32,
    network: u32,
}

impl Parsed {
    #[inline(always)]
    fn new(now: u64, exempt: bool) -> Parsed {
        Parsed {
            now,
            exempt,
            pair_to: 0,
            from_port: 0,
            network: 0,
        }
    }
}

/// What `egress` decided.
pub enum Egress {
    /// The frame may go on; `Some`: what the delivery's check may reuse
    /// (only until the frame changes or another frame is checked).
    Pass(Option<Parsed>),
    /// The frame went to `vm_policy_out` (or that tail call failed).
    Verdict(Verdict),
}

/// From `vm_port`, after its filters: `Egress::Verdict` when the frame
/// must first pass the endpoint's egress policy (`vm_policy_out`, which
/// hands it back to `vm_port` when allowed); `Pass` when it may go on: no
/// policy selects the endpoint, or the frame belongs to a flow already
/// allowed (checked here, without a tail call: most frames are).
/// `local`: the frame's network when it is unicast switched on it (not
/// to the gateway), so it may be delivered to a local port: its flow may
/// have a shared entry for both ends.
#[inline(always)]
pub fn egress(ctx: &TcContext, port_id: u32, local: Option<u32>) -> Egress {
    let Some(ep) = POLICY_ENDPOINTS.get(port_id) else {
        return Egress::Pass(None);
    };
    if ep.flags == 0 {
        return Egress::Pass(None);
    }
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let cb = unsafe { &mut (*ctx.skb.skb).cb };
    if cb[skb_cb::MARKER] == POLICY_CB_EGRESS_DONE && cb[skb_cb::PORT] == port_id {
        return Egress::Pass(None);
    }
    let (passes, parsed, looked_up) = egress_tracked(ctx, port_id, local);
    if passes {
        return Egress::Pass(parsed);
    }
    if looked_up {
        cb[skb_cb::FLAGS] = POLICY_CB_UNTRACKED;
    }
    // SAFETY: `ctx` is this program's own context; on success the tail
    // call does not return, otherwise the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::POLICY_EGRESS) };
    Egress::Verdict(Err(drop_reason::HELPER_FAILED))
}

/// `passes_tracked` for the sender's egress, which first looks for a
/// shared entry when the frame may be delivered locally (`local`: its
/// network): found, the delivery it names needs no lookup of its own.
#[inline(always)]
fn egress_tracked(
    ctx: &TcContext,
    port_id: u32,
    local: Option<u32>,
) -> (bool, Option<Parsed>, bool) {
    let Some(k) = POLICY_SCRATCH.get_ptr_mut(0) else {
        return (false, None, false);
    };
    // SAFETY: this CPU's scratch slot, valid for this run; nothing else
    // uses it while this packet is checked.
    let k = unsafe { &mut *k };
    let Some(mut parsed) = parse_fresh(ctx, k) else {
        return (false, None, false);
    };
    if parsed.exempt {
        return (true, Some(parsed), false);
    }
    if let Some(network) = local {
        let to = pair_other(k, network, port_id, policy_dir::EGRESS, parsed.now);
        if to != 0 {
            parsed.pair_to = to;
            return (true, Some(parsed), true);
        }
        parsed.from_port = port_id;
        parsed.network = network;
    }
    k.port_id = port_id;
    k.direction = policy_dir::EGRESS;
    k._pad = 0;
    (tracked(k, parsed.now).is_some(), Some(parsed), true)
}

/// The frame's tuple read into `k` by `parse_plain`, with the time;
/// `None`: `check` must decide.
#[inline(always)]
fn parse_fresh(ctx: &TcContext, k: &mut PolicyFlowKey) -> Option<Parsed> {
    match parse_plain(ctx, k)? {
        Seen::Exempt => Some(Parsed::new(0, true)),
        _ => Some(Parsed::new(flow_now(), false)),
    }
}

/// Whether the frame passes the ingress policy of `port_id` (at
/// `ifindex`) without a policy lookup: it is none of policy's business
/// (ARP, ND, DHCP...), or its flow (or the one it answers) is in the flow
/// table with the frame's sender as its peer. What `check` does first, so
/// the verdict is the same; anything else (a new flow, another sender
/// using the flow's tuple, a malformed frame) goes to `check`. `known`:
/// the scratch slot holds the frame's tuple already. `FROM_PORT`: the
/// frame comes from a local VM port (switched by `vm_port` or
/// `vm_service`), whose program need not carry the other senders' code
/// (the VM port's verifier budget is tight). Also returns whether the
/// flow table was looked up (the frame could be parsed here).
#[inline(always)]
fn passes_tracked<const FROM_PORT: bool>(
    ctx: &TcContext,
    port_id: u32,
    ifindex: u32,
    known: Option<Parsed>,
) -> (bool, bool) {
    let Some(k) = POLICY_SCRATCH.get_ptr_mut(0) else {
        return (false, false);
    };
    // SAFETY: this CPU's scratch slot, valid for this run; nothing else
    // uses it while this packet is checked.
    let k = unsafe { &mut *k };
    let parsed = match known {
        Some(p) => p,
        None => match parse_fresh(ctx, k) {
            Some(p) => p,
            None => return (false, false),
        },
    };
    if parsed.exempt {
        return (true, false);
    }
    k.port_id = port_id;
    k.direction = policy_dir::INGRESS;
    k._pad = 0;
    let Some(flow) = tracked(k, parsed.now) else {
        return (false, true);
    };
    // The flow's peer only: from a local port, the port it was checked
    // from (`check` records it); from elsewhere, by identity.
    let from_port = sender_port(ctx);
    // SAFETY: from `tracked` (bpf_map_lookup_elem), valid for this run.
    let (peer, peer_port) = unsafe { ((*flow).peer, u32::from((*flow).peer_port)) };
    let same = if FROM_PORT || from_port != 0 {
        from_port != 0 && peer_port == from_port
    } else {
        peer == remote_identity(ctx, k, || receiver_network(ifindex))
    };
    if !same {
        // Not looked up as far as `check` is concerned: it looks again
        // and compares the sender itself (a reply to a flow this endpoint
        // opened has no peer port yet; it learns it there).
        return (false, false);
    }
    // The sender's egress and this port's ingress each passed on their own
    // entry: one shared entry stands for both from now on. (`parsed`, not
    // `known`: a frame parsed here has no sender's port, and the Option's
    // payload is not read on the path where it is empty, which the
    // verifier would refuse.)
    let p = parsed;
    if p.from_port != 0 {
        let flow = PolicyFlow {
            last_seen: p.now,
            policy: POLICY_NONE,
            from_port: p.from_port as u16,
            to_port: port_id as u16,
            peer: 0,
            peer_port: 0,
            peer_by_address: 0,
        };
        k.port_id = p.network;
        k.direction = policy_dir::PAIR;
        // Should the insert fail, the two entries go on serving.
        let _ = POLICY_FLOWS.insert(&*k, &flow, 0);
    }
    (true, true)
}

/// Whether `vm_port` runs again for a frame `vm_policy_out` let through
/// (its counters already have it).
#[inline(always)]
pub fn reentered(ctx: &TcContext, port_id: u32) -> bool {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let cb = unsafe { &(*ctx.skb.skb).cb };
    cb[skb_cb::MARKER] == POLICY_CB_EGRESS_DONE && cb[skb_cb::PORT] == port_id
}

/// Before delivery to the local port `ifindex` (`port_id`): `Some` when
/// the port's ingress policy must decide (`vm_policy_in` delivers).
/// `known`: from `egress` on the same frame in this run. `FROM_PORT`: the
/// frame comes from a local VM port (`passes_tracked`).
#[inline(always)]
pub fn deliver<const FROM_PORT: bool>(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    known: Option<Parsed>,
) -> Option<Verdict> {
    // The flow's shared entry holds this port's own verdict (it was made
    // from this port's entry), not the sender's.
    if let Some(p) = known
        && p.pair_to == port_id
    {
        return None;
    }
    let ep = POLICY_ENDPOINTS.get(port_id)?;
    if ep.flags == 0 {
        return None;
    }
    let (passes, looked_up) = passes_tracked::<FROM_PORT>(ctx, port_id, ifindex, known);
    if passes {
        return None;
    }
    if looked_up {
        // SAFETY: the skb pointer is the program's own context, valid for
        // this run; cb is scratch space for the programs that see the frame.
        unsafe { (*ctx.skb.skb).cb[skb_cb::FLAGS] = POLICY_CB_UNTRACKED };
    }
    Some(crate::verdict::deliver_through(
        ctx,
        POLICY_CB_DELIVER,
        port_id,
        ifindex,
        tail_call::POLICY_DELIVER,
    ))
}

/// Whether a flooded frame is one ingress policy guards: any IP but
/// neighbour discovery and MLD (which flood to every port). Such a frame
/// floods only to the ports of `POLICY_FLOOD`, those not isolated for
/// ingress; unicast IP reaches an isolated port through `ingress`. Only
/// the exempt ICMPv6 types pass: an echo or an ICMPv6 error in a
/// multicast frame (to an isolated endpoint's unicast address) would
/// otherwise reach it unchecked.
#[inline(always)]
pub fn flood_guarded(ctx: &TcContext) -> bool {
    let Ok(eth) = hdr::<EthHdr>(ctx, 0) else {
        return true;
    };
    match u16::from_be(eth.ether_type) {
        ETH_P_IP => true,
        ETH_P_IPV6 => match hdr::<Ipv6Hdr>(ctx, ETH_LEN) {
            Ok(ip) if ip.next_hdr == IPPROTO_ICMPV6 => {
                match hdr::<[u8; 1]>(ctx, ETH_LEN + Ipv6Hdr::LEN) {
                    Ok(t) => !nd_or_mld(t[0]),
                    Err(_) => true,
                }
            }
            _ => true,
        },
        _ => false,
    }
}

/// A flood withheld from the `withheld` ports of its network isolated
/// for ingress (`FloodList::withheld`), sent from the local port at
/// `sender` (0: from the overlay): a `policy_denied_ingress` drop for
/// each, but the sender's own port, which a flood never goes back to.
#[inline(always)]
pub fn count_withheld(withheld: u32, sender: u32) {
    if withheld == 0 {
        return;
    }
    // SAFETY: a map lookup; the value stays valid for this program run.
    let own = match unsafe { PORTS.get(&sender) } {
        Some(port) => POLICY_ENDPOINTS
            .get(port.port_id)
            .is_some_and(|ep| ep.flags & POL_F_INGRESS != 0),
        None => false,
    };
    let n = withheld - u32::from(own && withheld > 0);
    counters::count_drops(drop_reason::POLICY_DENIED_INGRESS, n);
}

/// ICMPv6 types that are the gateway's business, never policy's:
/// neighbour discovery, MLD and router messages.
#[inline(always)]
fn nd_or_mld(icmp_type: u8) -> bool {
    matches!(icmp_type, 130..=137 | 143)
}

/// Per network, its flood list less the ports isolated for ingress.
#[btf_map(name = "vmp_pol_flood")]
pub static POLICY_FLOOD: HashMap<
    u32,
    FloodList,
    { maps::POLICY_FLOOD.max_entries as usize },
    { vmpath_common::FLOOD_MAP_FLAGS },
> = HashMap::new();

/// Whether the caller already found the frame's flow missing from the
/// flow table (`passes_tracked`); clears the mark.
#[inline(always)]
pub fn untracked(ctx: &TcContext) -> bool {
    // SAFETY: the skb pointer is the program's own context, valid for this
    // run; cb is scratch space for the programs that see the frame.
    let cb = unsafe { &mut (*ctx.skb.skb).cb };
    let marked = cb[skb_cb::FLAGS] == POLICY_CB_UNTRACKED;
    cb[skb_cb::FLAGS] = 0;
    marked
}

/// The endpoint's policy for the frame in direction `dir`; `untracked`:
/// the flow table was looked up for it already (and missed).
#[inline(always)]
pub fn check(
    ctx: &TcContext,
    port_id: u32,
    ifindex: u32,
    network: u32,
    dir: u8,
    untracked: bool,
) -> Result<(), u32> {
    let Some(ep) = POLICY_ENDPOINTS.get(port_id) else {
        return Ok(());
    };
    let flags = ep.flags;
    if flags == 0 {
        return Ok(());
    }
    let Some(k) = POLICY_SCRATCH.get_ptr_mut(0) else {
        return Ok(());
    };
    // SAFETY: this CPU's scratch slot, valid for this run; nothing else
    // uses it while this packet is checked.
    let k = unsafe { &mut *k };
    let now = flow_now();
    let seen = parse(ctx, k, now)?;
    if seen == Seen::Exempt {
        return Ok(());
    }
    // An ICMP error about a flow a shared entry holds: the only frames of
    // such a flow that come here (its others pass on the entry before).
    if !untracked && seen == Seen::Related && pair_other(k, network, port_id, dir, now) != 0 {
        return Ok(());
    }
    k.port_id = port_id;
    k.direction = dir;
    k._pad = 0;
    // An unplaced fragment's ports (0) are none of a flow's.
    // Who the frame comes from (ingress), or goes to (egress), as a flow
    // entry records its other end: by endpoint (`flow_sender`,
    // `flow_receiver`), so a reply is compared with the endpoint the flow
    // went to, like with like. On ingress a tracked flow passes only for
    // that peer; an ICMP error comes from whatever router on the way, and
    // passes for any flow it quotes.
    let (peer, peer_by_address) = if dir == policy_dir::INGRESS {
        (flow_sender(ctx, k, network, false), false)
    } else {
        flow_receiver(ctx, network, k)
    };
    let from_port = if dir == policy_dir::INGRESS {
        sender_port(ctx)
    } else {
        0
    };
    if !untracked
        && seen != Seen::Unplaced
        && let Some(flow) = tracked(k, now)
    {
        if dir == policy_dir::EGRESS || seen == Seen::Related {
            return Ok(());
        }
        // SAFETY: from `tracked` (bpf_map_lookup_elem), valid for this
        // run; a racing writer writes the same port.
        unsafe {
            let sender = if (*flow).peer_by_address != 0 {
                flow_sender(ctx, k, network, true)
            } else {
                peer
            };
            if (*flow).peer == sender {
                // The peer's port, for `passes_tracked` (a reply to a flow
                // this endpoint opened learns it here).
                (*flow).peer_port = from_port as u16;
                return Ok(());
            }
        }
    }
    // The identity policy rules are written for: the source's (ingress),
    // the destination address's (egress).
    let rules_peer = if dir == policy_dir::INGRESS {
        source_identity(ctx, k, || network)
    } else {
        identity_of(network, k.family, &k.dst)
    };
    let isolated = if dir == policy_dir::INGRESS {
        flags & POL_F_INGRESS != 0
    } else {
        flags & POL_F_EGRESS != 0
    };
    let mut policy = POLICY_NONE;
    let mut reason = 0;
    if seen == Seen::Unplaced {
        if !isolated {
            return Ok(());
        }
        reason = drop_reason::POLICY_FRAGMENT;
    } else if isolated {
        match allowed_by(port_id, dir, rules_peer, k) {
            Some(p) if seen == Seen::Opens => policy = p,
            _ if dir == policy_dir::INGRESS => reason = drop_reason::POLICY_DENIED_INGRESS,
            // The node reaches its endpoints whatever their policy: their
            // answers to it pass (not tracked: the node's flows are not seen).
            _ if reaches_node(ctx, ifindex, network, k) => {
                count(port_id, dir, true);
                return Ok(());
            }
            _ => reason = drop_reason::POLICY_DENIED_EGRESS,
        }
    } else if seen == Seen::Related {
        // An ICMP error for no flow of ours, where nothing is isolated.
        return Ok(());
    }
    let flow = PolicyFlow {
        last_seen: now,
        policy,
        from_port: 0,
        to_port: 0,
        peer,
        peer_port: from_port as u16,
        peer_by_address: u16::from(peer_by_address),
    };
    conclude(ctx, k, port_id, dir, ifindex, reason, &flow)
}

/// The end of a new flow's check (`check`, `from_stack`): allowed
/// (`reason` 0), `flow` is entered and its policy's hit counted; either
/// way the verdict is counted and reported.
#[inline(always)]
fn conclude(
    ctx: &TcContext,
    k: &PolicyFlowKey,
    port_id: u32,
    dir: u8,
    ifindex: u32,
    reason: u32,
    flow: &PolicyFlow,
) -> Result<(), u32> {
    if reason == 0 {
        // A full table evicts its oldest flow (LRU); should the insert
        // still fail, the flow's next packet is checked again.
        let _ = POLICY_FLOWS.insert(k, flow, 0);
        if let Some(hits) = POLICY_HITS.get_ptr_mut(flow.policy) {
            // SAFETY: this CPU's slot of a per-CPU array, no other writer.
            unsafe { *hits += 1 };
        }
    }
    count(port_id, dir, reason == 0);
    crate::monitor::policy(ctx, ifindex, k, reason, flow.policy);
    if reason == 0 { Ok(()) } else { Err(reason) }
}

/// The ingress policy of the endpoint at port `port_id` (`ifindex`, on
/// `network`) for a frame the node's stack sends down its port
/// (`vm_from_stack`): a cluster pod's the node routes, kube-proxy's
/// translation to the endpoint, kubelet's probe. Its sender is no vmpath
/// port (the frame runs on the receiver's own hook), so it is known by
/// its source address only, as traffic from the uplink is. The node's
/// own addresses pass whatever the policy (Kubernetes: a policy never
/// cuts a pod off from its node's kubelet). What passes is tracked, as
/// `check` tracks what it allows, so the endpoint's answers pass its
/// egress policy on the entry, UDP ones included.
#[inline(always)]
pub fn from_stack(ctx: &TcContext, port_id: u32, ifindex: u32, network: u32) -> Result<(), u32> {
    let Some(ep) = POLICY_ENDPOINTS.get(port_id) else {
        return Ok(());
    };
    let flags = ep.flags;
    if flags == 0 {
        return Ok(());
    }
    let Some(k) = POLICY_SCRATCH.get_ptr_mut(0) else {
        return Err(drop_reason::HELPER_FAILED);
    };
    // SAFETY: this CPU's scratch slot, valid for this run; nothing else
    // uses it while this packet is checked.
    let k = unsafe { &mut *k };
    let now = flow_now();
    let seen = parse(ctx, k, now)?;
    if seen == Seen::Exempt {
        return Ok(());
    }
    k.port_id = port_id;
    k.direction = policy_dir::INGRESS;
    k._pad = 0;
    let sender = identity_of(network, k.family, &k.src);
    if seen != Seen::Unplaced
        && let Some(flow) = tracked(k, now)
    {
        // SAFETY: from `tracked` (bpf_map_lookup_elem), valid for this run.
        if seen == Seen::Related || unsafe { (*flow).peer } == sender {
            return Ok(());
        }
    }
    let isolated = flags & POL_F_INGRESS != 0;
    let mut policy = POLICY_NONE;
    let reason = if seen == Seen::Unplaced {
        if !isolated {
            return Ok(());
        }
        drop_reason::POLICY_FRAGMENT
    } else if seen == Seen::Related {
        // An ICMP error for no flow of the endpoint's: the node's own
        // pass, as everything of theirs does; from elsewhere as `check`.
        if !isolated || crate::host::sent_by_node(ctx, ifindex, k.family, &k.src, &k.dst) {
            return Ok(());
        }
        drop_reason::POLICY_DENIED_INGRESS
    } else if !isolated || crate::host::sent_by_node(ctx, ifindex, k.family, &k.src, &k.dst) {
        0
    } else {
        match allowed_by(port_id, policy_dir::INGRESS, sender, k) {
            Some(p) => {
                policy = p;
                0
            }
            None => drop_reason::POLICY_DENIED_INGRESS,
        }
    };
    let flow = PolicyFlow {
        last_seen: now,
        policy,
        from_port: 0,
        to_port: 0,
        peer: sender,
        peer_port: 0,
        peer_by_address: 1,
    };
    conclude(ctx, k, port_id, policy_dir::INGRESS, ifindex, reason, &flow)
}

/// An answer from an endpoint of a host-reach network to its node.
#[inline(always)]
fn reaches_node(ctx: &TcContext, ifindex: u32, network: u32, k: &PolicyFlowKey) -> bool {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(net) = (unsafe { crate::maps::NETWORKS.get(&network) }) else {
        return false;
    };
    net.flags & vmpath_common::NET_F_HOST_REACH != 0
        && crate::host::answers_node(ctx, ifindex, k.family, &k.src, &k.dst)
}

/// A flow this endpoint opened the same way (`k` as it is), or a reply to
/// one it opened the other way (`k` with its ends swapped), seen recently
/// enough: its entry (valid for this run), whose `peer` is the identity
/// its packets to this endpoint come from. Leaves `k` as it found it.
#[inline(always)]
fn tracked(k: &mut PolicyFlowKey, now: u64) -> Option<*mut PolicyFlow> {
    let timeout = timeout_of(k.proto);
    if let Some(f) = fresh_entry(k, now, timeout) {
        return Some(f);
    }
    swap_ends(k);
    let hit = fresh_entry(k, now, timeout);
    swap_ends(k);
    hit
}

/// The other end of the frame's flow when a shared entry on `network`
/// holds it with `port_id` on this end in direction `dir`: as it was
/// opened (`k` as it is: `from_port` sent) or a reply (ends swapped:
/// `to_port` sends). 0: none. Leaves `k`'s tuple as it found it, its
/// port id and direction those of the shared entry.
#[inline(always)]
fn pair_other(k: &mut PolicyFlowKey, network: u32, port_id: u32, dir: u8, now: u64) -> u32 {
    let timeout = timeout_of(k.proto);
    k.port_id = network;
    k.direction = policy_dir::PAIR;
    k._pad = 0;
    if let Some(f) = fresh(k, now, timeout) {
        let other = end_of(f.from_port, f.to_port, port_id, dir);
        if other != 0 {
            return other;
        }
    }
    swap_tuple(k);
    let other = match fresh(k, now, timeout) {
        // A reply: `to_port` sends it, `from_port` receives it.
        Some(f) => end_of(f.to_port, f.from_port, port_id, dir),
        None => 0,
    };
    swap_tuple(k);
    other
}

/// For a packet going from port `sender` to port `receiver`: the other
/// end when `port_id` is the one in direction `dir`, else 0.
#[inline(always)]
fn end_of(sender: u16, receiver: u16, port_id: u32, dir: u8) -> u32 {
    let (sender, receiver) = (u32::from(sender), u32::from(receiver));
    let (ours, theirs) = if dir == policy_dir::EGRESS {
        (sender, receiver)
    } else {
        (receiver, sender)
    };
    if ours == port_id { theirs } else { 0 }
}

#[inline(always)]
fn timeout_of(proto: u8) -> u64 {
    if proto == IPPROTO_TCP {
        POLICY_FLOW_TCP_TIMEOUT_NS
    } else {
        POLICY_FLOW_OTHER_TIMEOUT_NS
    }
}

/// `k`'s entry, if seen within `timeout`; its time is moved on (only when
/// it is `POLICY_FLOW_REFRESH_NS` old: most packets leave it clean).
#[inline(always)]
fn fresh(k: &PolicyFlowKey, now: u64, timeout: u64) -> Option<PolicyFlow> {
    // SAFETY: from `fresh_entry` (bpf_map_lookup_elem), valid for this run.
    fresh_entry(k, now, timeout).map(|f| unsafe { *f })
}

/// `fresh`, the entry itself.
#[inline(always)]
fn fresh_entry(k: &PolicyFlowKey, now: u64, timeout: u64) -> Option<*mut PolicyFlow> {
    let flow = POLICY_FLOWS.get_ptr_mut(k)?;
    // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above, valid
    // for this run; a racing writer only writes a time.
    unsafe {
        let idle = now.saturating_sub((*flow).last_seen);
        if idle >= timeout {
            return None;
        }
        if idle > POLICY_FLOW_REFRESH_NS {
            (*flow).last_seen = now;
        }
        Some(flow)
    }
}

/// The key of the flow `k` answers: opened the other way, ends swapped.
#[inline(always)]
fn swap_ends(k: &mut PolicyFlowKey) {
    swap_tuple(k);
    k.direction ^= 1;
}

#[inline(always)]
fn swap_tuple(k: &mut PolicyFlowKey) {
    core::mem::swap(&mut k.src, &mut k.dst);
    core::mem::swap(&mut k.sport, &mut k.dport);
}

#[inline(always)]
fn identity_of(network: u32, family: u8, addr: &[u8; 16]) -> u32 {
    let (len, data) = if family == addr_family::IPV4 {
        (
            IdentityPrefix::v4_len(32),
            IdentityPrefix::v4(network, [addr[0], addr[1], addr[2], addr[3]]),
        )
    } else {
        (
            IdentityPrefix::v6_len(128),
            IdentityPrefix::v6(network, *addr),
        )
    };
    match POLICY_IPCACHE.get(&Key::new(len, data)) {
        Some(id) => *id,
        None => identity::WORLD,
    }
}

/// The identity the frame comes from. Sent by a local endpoint (this
/// program runs on its port's hook): that endpoint's, whatever source
/// address it wrote: its first address's identity when it wrote that one,
/// else the one the agent gave its port (`vmp_pol_ep`), so a spoofed
/// address never borrows another endpoint's rules, and an address it was
/// not configured with (learned) still has its identity. Sent by an
/// endpoint on another node: that endpoint's, by its MAC and node
/// (`overlay::sender_identity`), the same way. From elsewhere (the
/// uplink, routed): by source address, in the receiver's network
/// (`network`, asked only then).
#[inline(always)]
fn source_identity(ctx: &TcContext, k: &PolicyFlowKey, network: impl FnOnce() -> u32) -> u32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let from = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&from) }) else {
        return remote_identity(ctx, k, network);
    };
    let network = port.network;
    if writes_own_address(port, k) {
        return identity_of(network, k.family, &k.src);
    }
    match POLICY_ENDPOINTS.get(port.port_id) {
        Some(ep) if ep.identity != identity::ANY => ep.identity,
        _ => identity::WORLD,
    }
}

/// Who sent the frame, as a flow entry records its peer: a local
/// port's endpoint, its port's identity (`vmp_pol_ep`) whatever address
/// it writes; from no local port, `remote_identity`. `by_address`: the
/// entry's peer is an address's identity (`PolicyFlow::peer_by_address`):
/// a local port writing its own address has that address's identity in
/// the receiver's `network`, any other still its port's, so a spoofed
/// source never passes for the address it copies.
#[inline(always)]
fn flow_sender(ctx: &TcContext, k: &PolicyFlowKey, network: u32, by_address: bool) -> u32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let from = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&from) }) else {
        return remote_identity(ctx, k, || network);
    };
    if by_address && writes_own_address(port, k) {
        return identity_of(network, k.family, &k.src);
    }
    match POLICY_ENDPOINTS.get(port.port_id) {
        Some(ep) if ep.identity != identity::ANY => ep.identity,
        _ => identity::WORLD,
    }
}

/// Who a flow the endpoint opens goes to, as `flow_sender` will name its
/// replies: the endpoint the frame is switched to (its destination MAC,
/// local or on another node: `Endpoint::identity`); else (routed through
/// the gateway, or to a MAC no endpoint holds) the destination address's
/// identity, marked as such (`true`).
#[inline(always)]
fn flow_receiver(ctx: &TcContext, network: u32, k: &PolicyFlowKey) -> (u32, bool) {
    if let Ok(eth) = hdr::<EthHdr>(ctx, 0) {
        // SAFETY: a map lookup; the value stays valid for this program run.
        if let Some(ep) = unsafe { ENDPOINTS.get(&EndpointKey::new(network, eth.dst_addr)) }
            && ep.identity != identity::ANY
        {
            return (ep.identity, false);
        }
    }
    (identity_of(network, k.family, &k.dst), true)
}

/// Whether the frame's source address is the port's own (first
/// configured) one of its family.
#[inline(always)]
fn writes_own_address(port: &PortInfo, k: &PolicyFlowKey) -> bool {
    if k.family == addr_family::IPV4 {
        port.ip4 != [0; 4] && k.src[..4] == port.ip4
    } else {
        port.ip6 != [0; 16] && k.src == port.ip6
    }
}

/// `source_identity` of a frame from no local port: its sending
/// endpoint's when it came over the overlay (`overlay::sender_identity`),
/// else by its source address in `network`.
#[inline(always)]
fn remote_identity(ctx: &TcContext, k: &PolicyFlowKey, network: impl FnOnce() -> u32) -> u32 {
    match crate::overlay::sender_identity(ctx) {
        Some(id) => id,
        None => identity_of(network(), k.family, &k.src),
    }
}

/// The port id of the local port the frame came from (0: none).
#[inline(always)]
fn sender_port(ctx: &TcContext) -> u32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let from = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { PORTS.get(&from) }.map_or(0, |p| p.port_id)
}

/// The network of the local port at `ifindex` (0: none, whose identities
/// are all `identity::WORLD`).
#[inline(always)]
fn receiver_network(ifindex: u32) -> u32 {
    // SAFETY: a map lookup; the value stays valid for this program run.
    unsafe { PORTS.get(&ifindex) }.map_or(0, |p| p.network)
}

/// The policy allowing the flow `k` from or to `peer`: a rule for that
/// identity, else one for any peer (each with its protocol and port
/// wildcards, by longest prefix).
#[inline(always)]
fn allowed_by(port_id: u32, dir: u8, peer: u32, k: &PolicyFlowKey) -> Option<u32> {
    for id in [peer, identity::ANY] {
        let key = PolicyRuleKey::new(port_id, dir, id, k.proto, k.dport);
        if let Some(p) = POLICY_RULES.get(&Key::new(POLICY_LEN_FULL, key)) {
            return Some(*p);
        }
    }
    None
}

#[inline(always)]
fn count(port_id: u32, dir: u8, allowed: bool) {
    if let Some(s) = POLICY_STATS.get_ptr_mut(port_id) {
        // SAFETY: this CPU's slot of a per-CPU array, no other writer.
        unsafe {
            match (dir == policy_dir::INGRESS, allowed) {
                (true, true) => (*s).allowed_ingress += 1,
                (false, true) => (*s).allowed_egress += 1,
                (true, false) => (*s).denied_ingress += 1,
                (false, false) => (*s).denied_egress += 1,
            }
        }
    }
}

/// `parse` for the common case only, small enough to inline into every
/// delivering program: a frame that is not IP (`Exempt`), or a whole
/// (unfragmented) TCP, UDP or SCTP packet without IPv6 extension
/// headers, read exactly as `parse` reads it. `None` for anything else
/// (ICMP, fragments, a truncated header): `parse` decides (and keeps a
/// first fragment's ports for the fragments after it).
#[inline(always)]
fn parse_plain(ctx: &TcContext, k: &mut PolicyFlowKey) -> Option<Seen> {
    let eth = hdr::<EthHdr>(ctx, 0).ok()?;
    let (family, proto, l4) = match u16::from_be(eth.ether_type) {
        ETH_P_IP => {
            let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN).ok()?;
            // Any fragment, first or later (offset or more-fragments set).
            if u16::from_be_bytes(ip.frags) & (frag::IP_OFFSET | frag::IP_MF) != 0 {
                return None;
            }
            set_v4(&mut k.src, ip.src_addr);
            set_v4(&mut k.dst, ip.dst_addr);
            (
                addr_family::IPV4,
                ip.proto,
                ETH_LEN + usize::from(ip.vihl & 0x0f) * 4,
            )
        }
        ETH_P_IPV6 => {
            let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN).ok()?;
            k.src = ip.src_addr;
            k.dst = ip.dst_addr;
            (addr_family::IPV6, ip.next_hdr, ETH_LEN + Ipv6Hdr::LEN)
        }
        _ => return Some(Seen::Exempt),
    };
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_SCTP {
        return None;
    }
    let (s, d) = ports_at(ctx, l4).ok()?;
    if proto == IPPROTO_UDP && is_dhcp(s, d) {
        return Some(Seen::Exempt);
    }
    k.family = family;
    k.proto = proto;
    k.sport = s;
    k.dport = d;
    Some(Seen::Opens)
}

/// Reads the packet's tuple, as the endpoint sees it, into `k`; a
/// fragment's by its first fragment's record (kept here, at `now`).
#[inline(always)]
fn parse(ctx: &TcContext, k: &mut PolicyFlowKey, now: u64) -> Result<Seen, u32> {
    let eth = hdr::<EthHdr>(ctx, 0)?;
    k.sport = 0;
    k.dport = 0;
    match u16::from_be(eth.ether_type) {
        ETH_P_IP => ipv4(ctx, k, now),
        ETH_P_IPV6 => ipv6(ctx, k, now),
        _ => Ok(Seen::Exempt),
    }
}

/// Keeps a first fragment's protocol and ports (read into `k`) for the
/// later fragments of its datagram (`key`).
#[inline(always)]
fn remember_first(key: &DatagramKey, k: &PolicyFlowKey, now: u64) {
    let f = PolicyFrag {
        last_seen: now,
        sport: k.sport,
        dport: k.dport,
        proto: k.proto,
        _pad: [0; 3],
    };
    frag::keep(&POLICY_FRAGS, key, &f);
}

/// A later fragment takes its first fragment's protocol and ports into
/// `k`, and so its verdict (a flow it opened, or the rules judging it
/// again); `Unplaced` without one.
#[inline(always)]
fn later_fragment(key: &DatagramKey, k: &mut PolicyFlowKey, now: u64) -> Seen {
    let Some(f) = frag::first(&POLICY_FRAGS, key, now) else {
        return Seen::Unplaced;
    };
    let (proto, s, d) = (f.proto, f.sport, f.dport);
    k.proto = proto;
    k.sport = s;
    k.dport = d;
    if proto == IPPROTO_UDP && is_dhcp(s, d) {
        return Seen::Exempt;
    }
    Seen::Opens
}

#[inline(always)]
fn set_v4(out: &mut [u8; 16], a: [u8; 4]) {
    *out = [0; 16];
    out[0] = a[0];
    out[1] = a[1];
    out[2] = a[2];
    out[3] = a[3];
}

#[inline(always)]
fn ports_at(ctx: &TcContext, off: usize) -> Result<(u16, u16), u32> {
    let p = hdr::<[u8; 4]>(ctx, off)?;
    Ok((
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    ))
}

#[inline(always)]
fn is_dhcp(sport: u16, dport: u16) -> bool {
    matches!(
        (sport, dport),
        (68, 67) | (67, 68) | (546, 547) | (547, 546)
    )
}

#[inline(always)]
fn ipv4(ctx: &TcContext, k: &mut PolicyFlowKey, now: u64) -> Result<Seen, u32> {
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (proto, src, dst, vihl, frags, id) =
        (ip.proto, ip.src_addr, ip.dst_addr, ip.vihl, ip.frags, ip.id);
    let l4 = ETH_LEN + usize::from(vihl & 0x0f) * 4;
    k.family = addr_family::IPV4;
    k.proto = proto;
    set_v4(&mut k.src, src);
    set_v4(&mut k.dst, dst);
    let piece = frag::piece4(u16::from_be_bytes(frags));
    let mut slot = MaybeUninit::uninit();
    if piece == Piece::Later {
        let key = frag::key4(&mut slot, src, dst, id, proto);
        return Ok(later_fragment(key, k, now));
    }
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            let (s, d) = ports_at(ctx, l4)?;
            k.sport = s;
            k.dport = d;
            if piece == Piece::First {
                remember_first(frag::key4(&mut slot, src, dst, id, proto), k, now);
            }
            if proto == IPPROTO_UDP && is_dhcp(s, d) {
                return Ok(Seen::Exempt);
            }
        }
        IPPROTO_ICMP => {
            let h = hdr::<[u8; 8]>(ctx, l4)?;
            match h[0] {
                ICMP_ECHO | ICMP_ECHO_REPLY => {
                    let echo = u16::from_be_bytes([h[4], h[5]]);
                    k.sport = echo;
                    k.dport = echo;
                    if piece == Piece::First {
                        remember_first(frag::key4(&mut slot, src, dst, id, proto), k, now);
                    }
                }
                ICMP_DEST_UNREACH | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM => {
                    let inner = hdr::<Ipv4Hdr>(ctx, l4 + 8)?;
                    let (iproto, isrc, idst, ivihl) =
                        (inner.proto, inner.src_addr, inner.dst_addr, inner.vihl);
                    let il4 = l4 + 8 + usize::from(ivihl & 0x0f) * 4;
                    let (is, id) = inner_ports(ctx, il4, iproto, IPPROTO_ICMP)?;
                    // A reply to the quoted packet: its ends swapped.
                    k.proto = iproto;
                    set_v4(&mut k.src, idst);
                    set_v4(&mut k.dst, isrc);
                    k.sport = id;
                    k.dport = is;
                    return Ok(Seen::Related);
                }
                _ => {}
            }
        }
        _ => {}
    }
    Ok(Seen::Opens)
}

/// The quoted packet's ports (an echo's identifier both ways).
#[inline(always)]
fn inner_ports(ctx: &TcContext, off: usize, proto: u8, icmp: u8) -> Result<(u16, u16), u32> {
    if proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP {
        return ports_at(ctx, off);
    }
    if proto == icmp {
        let h = hdr::<[u8; 8]>(ctx, off)?;
        let id = u16::from_be_bytes([h[4], h[5]]);
        return Ok((id, id));
    }
    Ok((0, 0))
}

#[inline(always)]
fn ipv6(ctx: &TcContext, k: &mut PolicyFlowKey, now: u64) -> Result<Seen, u32> {
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let next_hdr = ip.next_hdr;
    k.src = ip.src_addr;
    k.dst = ip.dst_addr;
    k.family = addr_family::IPV6;
    k.proto = next_hdr;
    // Past the extension headers (the walk the guards and SNAT take). A
    // chain longer than it walks is seen as of its first header's
    // protocol, without ports, which only a rule for any protocol allows.
    let mut noted = Noted6::new();
    let (proto, l4) = match walk6(ctx, next_hdr, &mut noted) {
        Ok(up) => up,
        Err(drop_reason::EXT_HEADER_CHAIN) => return Ok(Seen::Opens),
        Err(e) => return Err(e),
    };
    let (piece, id) = (noted.piece, noted.id);
    let mut slot = MaybeUninit::uninit();
    if proto == IPPROTO_FRAGMENT {
        let key = frag::key6(&mut slot, &k.src, &k.dst, frag::later_id6(ctx, l4)?, 0);
        return Ok(later_fragment(key, k, now));
    }
    k.proto = proto;
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            let (s, d) = ports_at(ctx, l4)?;
            k.sport = s;
            k.dport = d;
            if piece == Piece::First {
                remember_first(frag::key6(&mut slot, &k.src, &k.dst, id, 0), k, now);
            }
            if proto == IPPROTO_UDP && is_dhcp(s, d) {
                return Ok(Seen::Exempt);
            }
        }
        IPPROTO_ICMPV6 => {
            let h = hdr::<[u8; 8]>(ctx, l4)?;
            match h[0] {
                ICMPV6_ECHO_REQUEST | ICMPV6_ECHO_REPLY => {
                    let echo = u16::from_be_bytes([h[4], h[5]]);
                    k.sport = echo;
                    k.dport = echo;
                    if piece == Piece::First {
                        remember_first(frag::key6(&mut slot, &k.src, &k.dst, id, 0), k, now);
                    }
                }
                1..=ICMPV6_ERROR_MAX => {
                    let inner = hdr::<Ipv6Hdr>(ctx, l4 + 8)?;
                    let (inext, isrc, idst) = (inner.next_hdr, inner.src_addr, inner.dst_addr);
                    let (is, id) = inner_ports(ctx, l4 + 8 + Ipv6Hdr::LEN, inext, IPPROTO_ICMPV6)?;
                    k.proto = inext;
                    k.src = idst;
                    k.dst = isrc;
                    k.sport = id;
                    k.dport = is;
                    return Ok(Seen::Related);
                }
                t if nd_or_mld(t) => return Ok(Seen::Exempt),
                _ => {}
            }
        }
        _ => {}
    }
    Ok(Seen::Opens)
}
