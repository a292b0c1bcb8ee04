//! ClusterIP Services, at the client's port: a VM has its own kernel, so
//! no socket-level load balancer sees its connections; every packet is
//! translated here instead, after Cilium.
//!
//! A frame a port sends to the gateway MAC (TCP or UDP over IPv4) goes
//! through `vm_service` first, before egress policy, so policy sees the
//! real backend. A new flow to a ClusterIP port (`vmp_svc`) gets one of
//! its ready backends (`vmp_svc_backends`): at random, or the one its
//! client had (`sessionAffinity: ClientIP`, `vmp_svc_affinity`). Both
//! directions go into `vmp_svc_flows` (LRU), so the flow sticks: the
//! forward entry on the client's port (destination rewritten to the
//! backend, then switched to the backend's MAC), the reverse one right
//! before delivery to the client (source rewritten to the ClusterIP).
//! A client that is its own backend (hairpin) gets its packets back into
//! its own port with the ClusterIP as their source, and its replies,
//! which it sends to the ClusterIP, are turned around the same way.
//!
//! No ready backend: a TCP segment is answered with a reset, a UDP
//! datagram with an ICMP port unreachable, from the ClusterIP, as
//! kube-proxy rejects; counted as `service_no_backend`.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT},
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray},
    helpers::{bpf_get_prandom_u32, generated::bpf_skb_change_tail},
    macros::btf_map,
    programs::TcContext,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, tcp::TcpHdr, udp::UdpHdr};
use vmpath_common::{
    POLICY_CB_EGRESS_DONE, PortInfo, SERVICE_CB_DELIVER, SERVICE_CB_PASSED,
    SERVICE_FLOW_UDP_TIMEOUT_NS, SVC_F_AFFINITY, Service, ServiceAffinity, ServiceAffinityKey,
    ServiceBackend, ServiceBackendKey, ServiceFlow, ServiceFlowKey, ServiceKey, ServiceStats,
    drop_reason, maps, skb_cb, svc_flow, tail_call,
};

use crate::{
    counters, csum,
    maps::PORTS,
    parse::{ETH_LEN, ETH_P_IP, IPPROTO_TCP, IPPROTO_UDP, hdr, hdr_mut},
    verdict::{self, PROGS, Verdict},
};

/// (network, ClusterIP, port, protocol) -> Service port.
#[btf_map(name = "vmp_svc")]
pub static SERVICES: HashMap<ServiceKey, Service, { maps::SERVICES.max_entries as usize }> =
    HashMap::new();

/// (Service port id, slot) -> ready backend.
#[btf_map(name = "vmp_svc_backends")]
pub static SERVICE_BACKENDS: HashMap<
    ServiceBackendKey,
    ServiceBackend,
    { maps::SERVICE_BACKENDS.max_entries as usize },
> = HashMap::new();

/// Translated flows, keyed by the tuple as it is looked up.
#[btf_map(name = "vmp_svc_flows")]
pub static SERVICE_FLOWS: LruHashMap<
    ServiceFlowKey,
    ServiceFlow,
    { maps::SERVICE_FLOWS.max_entries as usize },
> = LruHashMap::new();

/// (Service port id, client) -> the backend slot it sticks to.
#[btf_map(name = "vmp_svc_affinity")]
pub static SERVICE_AFFINITY: LruHashMap<
    ServiceAffinityKey,
    ServiceAffinity,
    { maps::SERVICE_AFFINITY.max_entries as usize },
> = LruHashMap::new();

/// Slot 0: how many Service ports there are (0: nothing is looked up).
#[btf_map(name = "vmp_svc_cfg")]
pub static SERVICE_CONFIG: Array<u32, { maps::SERVICE_CONFIG.max_entries as usize }> = Array::new();

/// Port id -> new flows and rejects of its clients, per CPU.
#[btf_map(name = "vmp_svc_stats")]
pub static SERVICE_STATS: PerCpuArray<ServiceStats, { maps::SERVICE_STATS.max_entries as usize }> =
    PerCpuArray::new();

const IP_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, src_addr);
const IP_DST_OFF: usize = ETH_LEN + offset_of!(Ipv4Hdr, dst_addr);
pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;
const IP_DF: u16 = 0x4000;
pub(crate) const RESET_TTL: u8 = 64;
const IP4_HDR: usize = 20;
pub(crate) const TCP_HDR: usize = 20;

/// Whether any Service port is programmed.
#[inline(always)]
fn active() -> bool {
    SERVICE_CONFIG.get(0).is_some_and(|n| *n != 0)
}

/// From `vm_port`, for a frame to the gateway MAC: `Some` when the
/// Service program in tail-call slot `slot` (`vm_service` for IPv4,
/// `vm_service6` for IPv6) must look at it first (it hands frames that
/// are no Service's business back to `vm_port`).
#[inline(always)]
pub fn egress(ctx: &TcContext, port_id: u32, proto: u8, slot: u32) -> Option<Verdict> {
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return None;
    }
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let cb = unsafe { &(*ctx.skb.skb).cb };
    if (cb[skb_cb::MARKER] == SERVICE_CB_PASSED || cb[skb_cb::MARKER] == POLICY_CB_EGRESS_DONE)
        && cb[skb_cb::PORT] == port_id
    {
        return None;
    }
    if !active() {
        return None;
    }
    // SAFETY: `ctx` is this program's own context; on success the tail
    // call does not return, otherwise the error below.
    unsafe { PROGS.tail_call(ctx, slot) };
    Some(Err(drop_reason::HELPER_FAILED))
}

/// Whether `vm_port` runs again for a frame `vm_service` handed back
/// (its counters already have it).
#[inline(always)]
pub fn passed(ctx: &TcContext, port_id: u32) -> bool {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let cb = unsafe { &(*ctx.skb.skb).cb };
    cb[skb_cb::MARKER] == SERVICE_CB_PASSED && cb[skb_cb::PORT] == port_id
}

/// What `vm_service` and `vm_service6` do with their verdict: `None`
/// (no Service's business) goes back to `vm_port`, marked.
#[inline(always)]
pub(crate) fn service_verdict(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    verdict: Result<Option<i32>, u32>,
) -> i32 {
    let reason = match verdict {
        Ok(Some(action)) => return action,
        Ok(None) => {
            // SAFETY: as above; cb is scratch space for the programs that see it.
            unsafe {
                let cb = &mut (*ctx.skb.skb).cb;
                cb[skb_cb::MARKER] = SERVICE_CB_PASSED;
                cb[skb_cb::PORT] = port_id;
            }
            // SAFETY: `ctx` is this program's own context; on success the
            // tail call does not return.
            unsafe { PROGS.tail_call(ctx, tail_call::VM_PORT) };
            drop_reason::HELPER_FAILED
        }
        Err(reason) => reason,
    };
    counters::dropped(ctx, ifindex, port_id, reason);
    TC_ACT_SHOT
}

/// A packet's transport tuple and where its checksum is.
pub struct Tuple {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub l4_off: usize,
    pub tcp_flags: u8,
}

/// The IPv4 TCP/UDP tuple of the frame, `None` for anything else (other
/// protocols, later fragments).
#[inline(always)]
pub fn tuple(ctx: &TcContext) -> Result<Option<Tuple>, u32> {
    let eth = hdr::<EthHdr>(ctx, 0)?;
    if u16::from_be(eth.ether_type) != ETH_P_IP {
        return Ok(None);
    }
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (vihl, proto, frags, src, dst) = (ip.vihl, ip.proto, ip.frags, ip.src_addr, ip.dst_addr);
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(None);
    }
    if u16::from_be_bytes(frags) & 0x1fff != 0 {
        return Ok(None);
    }
    let l4_off = ETH_LEN + usize::from(vihl & 0x0f) * 4;
    let p = hdr::<[u8; 4]>(ctx, l4_off)?;
    let (sport, dport) = (
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    );
    let tcp_flags = if proto == IPPROTO_TCP {
        hdr::<[u8; 14]>(ctx, l4_off)?[13]
    } else {
        0
    };
    Ok(Some(Tuple {
        src,
        dst,
        sport,
        dport,
        proto,
        l4_off,
        tcp_flags,
    }))
}

/// Whether a tracked flow still stands for this packet: a TCP SYN opens
/// a new connection (a reused tuple picks again), a UDP flow idle too
/// long picks again.
#[inline(always)]
pub(crate) fn still_open(last_seen: u64, proto: u8, tcp_flags: u8, now: u64) -> bool {
    if proto == IPPROTO_TCP {
        return !(tcp_flags & TCP_SYN != 0 && tcp_flags & TCP_ACK == 0);
    }
    now.saturating_sub(last_seen) < SERVICE_FLOW_UDP_TIMEOUT_NS
}

/// A backend for a new flow of Service port `id`: the client's sticky
/// one while it is still among the `count` ready ones, else one at random.
#[inline(always)]
pub fn pick(
    id: u32,
    count: u32,
    flags: u8,
    affinity_timeout: u32,
    client: [u8; 4],
    now: u64,
) -> Option<ServiceBackend> {
    let sticky = flags & SVC_F_AFFINITY != 0;
    let akey = ServiceAffinityKey {
        service: id,
        client,
    };
    if sticky && let Some(a) = SERVICE_AFFINITY.get_ptr_mut(&akey) {
        // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem), valid for this
        // run; a racing writer only writes a time.
        let a_now = unsafe { *a };
        let timeout = u64::from(affinity_timeout) * 1_000_000_000;
        if a_now.slot < count && now.saturating_sub(a_now.last_seen) < timeout {
            let bkey = ServiceBackendKey {
                service: id,
                slot: a_now.slot,
            };
            // SAFETY: a map lookup; the value stays valid for this run.
            if let Some(b) = unsafe { SERVICE_BACKENDS.get(&bkey) }
                && b.addr == a_now.addr
            {
                // SAFETY: as above.
                unsafe { (*a).last_seen = now };
                return Some(*b);
            }
        }
    }
    // SAFETY: a helper call without arguments.
    let slot = unsafe { bpf_get_prandom_u32() } % count;
    let bkey = ServiceBackendKey { service: id, slot };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let b = *unsafe { SERVICE_BACKENDS.get(&bkey) }?;
    if sticky {
        let a = ServiceAffinity {
            last_seen: now,
            slot,
            addr: b.addr,
        };
        let _ = SERVICE_AFFINITY.insert(&akey, &a, 0);
    }
    Some(b)
}

/// Before delivery to the local port `ifindex` (`port_id`): `Some` while
/// Services exist (`vm_service_in` translates a reply back and delivers).
#[inline(always)]
pub fn deliver(ctx: &TcContext, ifindex: u32, port_id: u32) -> Option<Verdict> {
    if !active() {
        return None;
    }
    Some(crate::verdict::deliver_through(
        ctx,
        SERVICE_CB_DELIVER,
        port_id,
        ifindex,
        tail_call::SERVICE_DELIVER,
    ))
}

/// A reply of a flow the endpoint at `port_ifindex` opened to a
/// ClusterIP: from the ClusterIP.
#[inline(always)]
pub fn reverse(ctx: &TcContext, port_ifindex: u32) -> Result<(), u32> {
    let Some(t) = tuple(ctx)? else {
        return Ok(());
    };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&port_ifindex) }) else {
        return Ok(());
    };
    let key = ServiceFlowKey::new(port.network, t.src, t.dst, t.sport, t.dport, t.proto);
    let Some(flow) = SERVICE_FLOWS.get_ptr_mut(&key) else {
        return Ok(());
    };
    // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above, valid
    // for this run; a racing writer only writes a time.
    let f = unsafe { *flow };
    if f.flags != svc_flow::REVERSE {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe { (*flow).last_seen = crate::clock::flow_now() };
    rewrite(ctx, &t, &f)?;
    hdr_mut::<EthHdr>(ctx, 0)?.src_addr = f.mac;
    Ok(())
}

/// The tuple `t` of the frame becomes `f`'s, checksums fixed.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, t: &Tuple, f: &ServiceFlow) -> Result<(), u32> {
    let csum_off = t.l4_off
        + if t.proto == IPPROTO_TCP {
            offset_of!(TcpHdr, check)
        } else {
            offset_of!(UdpHdr, check)
        };
    let udp = t.proto == IPPROTO_UDP;
    if t.src != f.src {
        rewrite_addr(ctx, csum_off, udp, IP_SRC_OFF, t.src, f.src)?;
    }
    if t.dst != f.dst {
        rewrite_addr(ctx, csum_off, udp, IP_DST_OFF, t.dst, f.dst)?;
    }
    if t.sport != f.sport {
        rewrite_port(ctx, csum_off, udp, t.l4_off, t.sport, f.sport)?;
    }
    if t.dport != f.dport {
        rewrite_port(ctx, csum_off, udp, t.l4_off + 2, t.dport, f.dport)?;
    }
    Ok(())
}

#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    csum_off: usize,
    udp: bool,
    off: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), u32> {
    let old_a = u64::from(u32::from_ne_bytes(old));
    let new_a = u64::from(u32::from_ne_bytes(new));
    let mut flags = u64::from(BPF_F_PSEUDO_HDR) | 4;
    if udp {
        flags |= u64::from(BPF_F_MARK_MANGLED_0);
    }
    ctx.l4_csum_replace(csum_off, old_a, new_a, flags)
        .map_err(|_| drop_reason::HELPER_FAILED)?;
    // The IPv4 header checksum in place (as `snat::ipv4::rewrite_addr`), after
    // the helper, which may move packet data.
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.check = crate::csum::replace_addr4(u16::from_be_bytes(ip.check), old, new).to_be_bytes();
    crate::parse::write_at(ctx, off, &new)
}

#[inline(always)]
pub(crate) fn rewrite_port(
    ctx: &TcContext,
    csum_off: usize,
    udp: bool,
    off: usize,
    old: u16,
    new: u16,
) -> Result<(), u32> {
    let old_p = u64::from(u16::from_ne_bytes(old.to_be_bytes()));
    let new_p = u64::from(u16::from_ne_bytes(new.to_be_bytes()));
    let mut flags = 2u64;
    if udp {
        flags |= u64::from(BPF_F_MARK_MANGLED_0);
    }
    ctx.l4_csum_replace(csum_off, old_p, new_p, flags)
        .map_err(|_| drop_reason::HELPER_FAILED)?;
    crate::parse::write_at(ctx, off, &new.to_be_bytes())
}

#[inline(always)]
pub(crate) fn count_stats(port_id: u32, sent: bool) {
    if let Some(s) = SERVICE_STATS.get_ptr_mut(port_id) {
        // SAFETY: this CPU's slot of a per-CPU array, no other writer.
        unsafe {
            if sent {
                (*s).flows += 1;
            } else {
                (*s).rejected += 1;
            }
        }
    }
}

/// No ready backend: the client hears so at once, as from kube-proxy.
#[inline(always)]
pub fn reject(ctx: &TcContext, ifindex: u32, port: &PortInfo, t: &Tuple) -> Verdict {
    if t.proto == IPPROTO_UDP {
        return crate::mtu::port_unreachable4(ctx, ifindex, port.port_id, t.dst, port.gw_mac);
    }
    tcp_reset(ctx, ifindex, port, t)
}

/// The TCP segment at hand becomes a reset from the ClusterIP (RFC 9293
/// 3.10.7.1: a segment with ACK is answered with seq = its ack; one
/// without, with ack = its seq + its length), sent back to the client.
#[inline(always)]
fn tcp_reset(ctx: &TcContext, ifindex: u32, port: &PortInfo, t: &Tuple) -> Verdict {
    if t.tcp_flags & TCP_RST != 0 || t.l4_off != ETH_LEN + IP4_HDR {
        // Never answer a reset; IP options: dropped without an answer.
        return Err(drop_reason::SERVICE_NO_BACKEND);
    }
    let ip = hdr::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let tot_len = usize::from(u16::from_be_bytes(ip.tot_len));
    let tcp = hdr::<[u8; TCP_HDR]>(ctx, t.l4_off)?;
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let doff = usize::from(tcp[12] >> 4) * 4;
    let payload = tot_len.saturating_sub(IP4_HDR + doff) as u32;
    let (r_seq, r_ack, r_flags) = if t.tcp_flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let mut len = payload;
        if t.tcp_flags & TCP_SYN != 0 {
            len += 1;
        }
        if t.tcp_flags & TCP_FIN != 0 {
            len += 1;
        }
        (0, seq.wrapping_add(len), TCP_RST | TCP_ACK)
    };
    // SAFETY: the helper takes only our own skb; no packet pointer is
    // held across it (all are taken again below).
    let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (ETH_LEN + IP4_HDR + TCP_HDR) as u32, 0) };
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.dst_addr = eth.src_addr;
    eth.src_addr = port.gw_mac;
    let (from, to) = (t.dst, t.src);
    let tot = (IP4_HDR + TCP_HDR) as u16;
    let ip_sum = 0x4500
        + u32::from(tot)
        + u32::from(IP_DF)
        + (u32::from(RESET_TTL) << 8)
        + u32::from(IPPROTO_TCP)
        + sum_addr4(from)
        + sum_addr4(to);
    let ip = hdr_mut::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.vihl = 0x45;
    ip.tos = 0;
    ip.tot_len = tot.to_be_bytes();
    ip.id = [0; 2];
    ip.frags = IP_DF.to_be_bytes();
    ip.ttl = RESET_TTL;
    ip.proto = IPPROTO_TCP;
    ip.check = (!csum::fold(ip_sum)).to_be_bytes();
    ip.src_addr = from;
    ip.dst_addr = to;
    let (sp, dp) = (t.dport.to_be_bytes(), t.sport.to_be_bytes());
    let (s, a) = (r_seq.to_be_bytes(), r_ack.to_be_bytes());
    let h = hdr_mut::<[u8; TCP_HDR]>(ctx, ETH_LEN + IP4_HDR)?;
    *h = [
        sp[0], sp[1], dp[0], dp[1], s[0], s[1], s[2], s[3], a[0], a[1], a[2], a[3], 0x50, r_flags,
        0, 0, 0, 0, 0, 0,
    ];
    let mut sum = sum_addr4(from) + sum_addr4(to) + u32::from(IPPROTO_TCP) + TCP_HDR as u32;
    let mut i = 0;
    while i < TCP_HDR {
        sum += (u32::from(h[i]) << 8) | u32::from(h[i + 1]);
        i += 2;
    }
    let c = (!csum::fold(sum)).to_be_bytes();
    h[16] = c[0];
    h[17] = c[1];
    counters::count_drop(port.port_id, drop_reason::SERVICE_NO_BACKEND);
    verdict::reply_out(ctx, ifindex)
}

#[inline(always)]
fn sum_addr4(a: [u8; 4]) -> u32 {
    (u32::from(a[0]) << 8) + u32::from(a[1]) + (u32::from(a[2]) << 8) + u32::from(a[3])
}
