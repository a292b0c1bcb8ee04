//! IPv6 ClusterIP Services: `service`'s twin for IPv6, in a program of
//! its own (`vm_service6`, tail-called from `vm_port` for TCP and UDP an
//! IPv6 frame carries right after its fixed header to the gateway MAC).
//! The same steps with 16-byte addresses and their own maps: a new flow
//! to a ClusterIP port (`vmp_svc6`) gets a ready backend
//! (`vmp_svc6_backend`), at random or the client's remembered one
//! (`vmp_svc6_sticky`); both directions go into `vmp_svc6_flows`; the
//! reply is turned back in `vm_service_in` (`reverse`). A hairpin goes
//! back into the client's port from the ClusterIP.
//!
//! No ready backend: a TCP segment is answered with a reset, a UDP
//! datagram with an ICMPv6 destination unreachable (port unreachable),
//! from the ClusterIP, as kube-proxy rejects; counted as
//! `service_no_backend`.
//!
//! IPv6 has no header checksum: only the transport checksum (its pseudo
//! header) is fixed, one 32-bit word of an address at a time.

use core::mem::offset_of;

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    btf_maps::{HashMap, LruHashMap, PerCpuArray},
    helpers::{bpf_get_prandom_u32, generated::bpf_skb_change_tail},
    macros::btf_map,
    programs::TcContext,
};
use network_types::{eth::EthHdr, ip::Ipv6Hdr, tcp::TcpHdr, udp::UdpHdr};
use vmpath_common::{
    PortInfo, SVC_F_AFFINITY, Service, ServiceAffinity6, ServiceAffinityKey6, ServiceBackend6,
    ServiceBackendKey, ServiceFlow6, ServiceFlowKey6, ServiceKey6, ServiceScratch6, drop_reason,
    maps, svc_flow,
};

use crate::{
    counters, csum,
    maps::PORTS,
    parse::{
        ETH_LEN, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, addr16_eq, hdr, hdr_mut, words16, write_at,
    },
    service::{RESET_TTL, TCP_ACK, TCP_FIN, TCP_HDR, TCP_RST, TCP_SYN, rewrite_port},
    verdict::{self, Verdict},
};

/// (network, IPv6 ClusterIP, port, protocol) -> Service port.
#[btf_map(name = "vmp_svc6")]
pub static SERVICES6: HashMap<ServiceKey6, Service, { maps::SERVICES6.max_entries as usize }> =
    HashMap::new();

/// (Service port id, slot) -> ready IPv6 backend.
#[btf_map(name = "vmp_svc6_backend")]
pub static SERVICE6_BACKENDS: HashMap<
    ServiceBackendKey,
    ServiceBackend6,
    { maps::SERVICE6_BACKENDS.max_entries as usize },
> = HashMap::new();

/// Translated IPv6 flows, keyed by the tuple as it is looked up.
#[btf_map(name = "vmp_svc6_flows")]
pub static SERVICE6_FLOWS: LruHashMap<
    ServiceFlowKey6,
    ServiceFlow6,
    { maps::SERVICE6_FLOWS.max_entries as usize },
> = LruHashMap::new();

/// Slot 0: this CPU's flow key and value being built.
#[btf_map(name = "vmp_svc6_scratch")]
pub static SERVICE6_SCRATCH: PerCpuArray<
    ServiceScratch6,
    { maps::SERVICE6_SCRATCH.max_entries as usize },
> = PerCpuArray::new();

/// (Service port id, IPv6 client) -> the backend slot it sticks to.
#[btf_map(name = "vmp_svc6_sticky")]
pub static SERVICE6_AFFINITY: LruHashMap<
    ServiceAffinityKey6,
    ServiceAffinity6,
    { maps::SERVICE6_AFFINITY.max_entries as usize },
> = LruHashMap::new();

const IP6_SRC_OFF: usize = ETH_LEN + offset_of!(Ipv6Hdr, src_addr);
const IP6_DST_OFF: usize = ETH_LEN + offset_of!(Ipv6Hdr, dst_addr);
const IP6_HDR: usize = 40;
const L4_OFF: usize = ETH_LEN + IP6_HDR;

/// The scratch slot: a packet's tuple is its flow key there (`key`),
/// built once and rebuilt after a reverse key took its place.
#[inline(always)]
pub fn scratch() -> Result<&'static mut ServiceScratch6, u32> {
    let s = SERVICE6_SCRATCH
        .get_ptr_mut(0)
        .ok_or(drop_reason::HELPER_FAILED)?;
    // SAFETY: this CPU's scratch slot, valid for this run; nothing else
    // uses it while this packet is translated.
    Ok(unsafe { &mut *s })
}

/// The tuple of an IPv6 frame carrying TCP or UDP right after its fixed
/// header, as a flow key on network `network` in `key`, and its TCP
/// flags; `None` for anything else (extension headers, fragments: left
/// to the node, as before).
#[inline(always)]
pub fn tuple(ctx: &TcContext, network: u32, key: &mut ServiceFlowKey6) -> Result<Option<u8>, u32> {
    let eth = hdr::<EthHdr>(ctx, 0)?;
    if u16::from_be(eth.ether_type) != ETH_P_IPV6 {
        return Ok(None);
    }
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let proto = ip.next_hdr;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(None);
    }
    let p = hdr::<[u8; 4]>(ctx, L4_OFF)?;
    let (sport, dport) = (
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    );
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    *key = ServiceFlowKey6::new(network, &ip.src_addr, &ip.dst_addr, sport, dport, proto);
    let tcp_flags = if proto == IPPROTO_TCP {
        hdr::<[u8; 14]>(ctx, L4_OFF)?[13]
    } else {
        0
    };
    Ok(Some(tcp_flags))
}

/// `service::pick` for IPv6 clients and backends.
#[inline(always)]
pub fn pick(
    id: u32,
    count: u32,
    flags: u8,
    affinity_timeout: u32,
    client: &[u8; 16],
    now: u64,
) -> Option<ServiceBackend6> {
    let sticky = flags & SVC_F_AFFINITY != 0;
    let akey = ServiceAffinityKey6 {
        service: id,
        client: *client,
    };
    if sticky && let Some(a) = SERVICE6_AFFINITY.get_ptr_mut(&akey) {
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
            if let Some(b) = unsafe { SERVICE6_BACKENDS.get(&bkey) }
                && addr16_eq(&b.addr, &a_now.addr)
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
    let b = *unsafe { SERVICE6_BACKENDS.get(&bkey) }?;
    if sticky {
        let a = ServiceAffinity6 {
            last_seen: now,
            slot,
            addr: b.addr,
            _pad: 0,
        };
        let _ = SERVICE6_AFFINITY.insert(&akey, &a, 0);
    }
    Some(b)
}

/// From `vm_service_in`, before delivery to the local port at
/// `port_ifindex`: a reply of an IPv6 flow its endpoint opened to a
/// ClusterIP comes from the ClusterIP. Anything else is left as it is.
#[inline(always)]
pub fn reverse(ctx: &TcContext, port_ifindex: u32) -> Result<(), u32> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&port_ifindex) }) else {
        return Ok(());
    };
    let s = scratch()?;
    if tuple(ctx, port.network, &mut s.key)?.is_none() {
        return Ok(());
    }
    let Some(flow) = SERVICE6_FLOWS.get_ptr_mut(&s.key) else {
        return Ok(());
    };
    // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above, valid
    // for this run; a racing writer only writes a time.
    s.flow = unsafe { *flow };
    if s.flow.flags != svc_flow::REVERSE {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe { (*flow).last_seen = crate::clock::flow_now() };
    rewrite(ctx, &s.key, &s.flow)?;
    hdr_mut::<EthHdr>(ctx, 0)?.src_addr = s.flow.mac;
    Ok(())
}

/// The tuple `t` of the frame becomes `f`'s, the transport checksum fixed.
#[inline(always)]
pub fn rewrite(ctx: &TcContext, t: &ServiceFlowKey6, f: &ServiceFlow6) -> Result<(), u32> {
    let csum_off = L4_OFF
        + if t.proto == IPPROTO_TCP {
            offset_of!(TcpHdr, check)
        } else {
            offset_of!(UdpHdr, check)
        };
    let udp = t.proto == IPPROTO_UDP;
    if !addr16_eq(&t.src, &f.src) {
        rewrite_addr(ctx, csum_off, udp, IP6_SRC_OFF, &t.src, &f.src)?;
    }
    if !addr16_eq(&t.dst, &f.dst) {
        rewrite_addr(ctx, csum_off, udp, IP6_DST_OFF, &t.dst, &f.dst)?;
    }
    if t.sport != f.sport {
        rewrite_port(ctx, csum_off, udp, L4_OFF, t.sport, f.sport)?;
    }
    if t.dport != f.dport {
        rewrite_port(ctx, csum_off, udp, L4_OFF + 2, t.dport, f.dport)?;
    }
    Ok(())
}

/// Replaces the IPv6 address at `off`, fixing the transport checksum
/// (pseudo header) one 32-bit word at a time (as `snat::ipv6` does).
#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    csum_off: usize,
    udp: bool,
    off: usize,
    old: &[u8; 16],
    new: &[u8; 16],
) -> Result<(), u32> {
    let (o, n) = (words16(old), words16(new));
    let mut flags = u64::from(BPF_F_PSEUDO_HDR) | 4;
    if udp {
        flags |= u64::from(BPF_F_MARK_MANGLED_0);
    }
    let mut i = 0;
    while i < 4 {
        ctx.l4_csum_replace(csum_off, u64::from(o[i]), u64::from(n[i]), flags)
            .map_err(|_| drop_reason::HELPER_FAILED)?;
        i += 1;
    }
    write_at(ctx, off, new)
}

/// No ready backend: the client hears so at once, as from kube-proxy.
#[inline(always)]
pub fn reject(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    s: &ServiceScratch6,
    tcp_flags: u8,
) -> Verdict {
    if s.key.proto == IPPROTO_UDP {
        return crate::mtu::port_unreachable6(ctx, ifindex, port.port_id, &s.key.dst, port.gw_mac);
    }
    tcp_reset(ctx, ifindex, port, &s.key, tcp_flags)
}

/// The TCP segment at hand (tuple `t`) becomes a reset from the
/// ClusterIP (as `service::tcp_reset`, RFC 9293 3.10.7.1), sent back to
/// the client.
#[inline(always)]
fn tcp_reset(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    t: &ServiceFlowKey6,
    tcp_flags: u8,
) -> Verdict {
    if tcp_flags & TCP_RST != 0 {
        // Never answer a reset.
        return Err(drop_reason::SERVICE_NO_BACKEND);
    }
    let ip = hdr::<Ipv6Hdr>(ctx, ETH_LEN)?;
    let payload_len = usize::from(u16::from_be_bytes(ip.payload_len));
    let tcp = hdr::<[u8; TCP_HDR]>(ctx, L4_OFF)?;
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let doff = usize::from(tcp[12] >> 4) * 4;
    let payload = payload_len.saturating_sub(doff) as u32;
    let (r_seq, r_ack, r_flags) = if tcp_flags & TCP_ACK != 0 {
        (ack, 0, TCP_RST)
    } else {
        let mut len = payload;
        if tcp_flags & TCP_SYN != 0 {
            len += 1;
        }
        if tcp_flags & TCP_FIN != 0 {
            len += 1;
        }
        (0, seq.wrapping_add(len), TCP_RST | TCP_ACK)
    };
    // SAFETY: the helper takes only our own skb; no packet pointer is
    // held across it (all are taken again below).
    let rc = unsafe { bpf_skb_change_tail(ctx.skb.skb, (L4_OFF + TCP_HDR) as u32, 0) };
    if rc != 0 {
        return Err(drop_reason::HELPER_FAILED);
    }
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.dst_addr = eth.src_addr;
    eth.src_addr = port.gw_mac;
    let ip = hdr_mut::<Ipv6Hdr>(ctx, ETH_LEN)?;
    ip.vcf = [0x60, 0, 0, 0];
    ip.payload_len = (TCP_HDR as u16).to_be_bytes();
    ip.next_hdr = IPPROTO_TCP;
    ip.hop_limit = RESET_TTL;
    ip.src_addr = t.dst;
    ip.dst_addr = t.src;
    let (sp, dp) = (t.dport.to_be_bytes(), t.sport.to_be_bytes());
    let (s, a) = (r_seq.to_be_bytes(), r_ack.to_be_bytes());
    let h = hdr_mut::<[u8; TCP_HDR]>(ctx, L4_OFF)?;
    *h = [
        sp[0], sp[1], dp[0], dp[1], s[0], s[1], s[2], s[3], a[0], a[1], a[2], a[3], 0x50, r_flags,
        0, 0, 0, 0, 0, 0,
    ];
    let mut sum = csum::sum_addr16(&t.dst)
        + csum::sum_addr16(&t.src)
        + u32::from(IPPROTO_TCP)
        + TCP_HDR as u32;
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
