//! `vmpath monitor`: one `MonitorEvent` per dropped frame (and per policy
//! verdict on a new flow) into the
//! `vmp_monitor` ring buffer, only while a monitor client listens, and at
//! most the configured rate per CPU (a token bucket, as the slow path's),
//! so a flood costs the ring nothing and nobody listening costs one array
//! lookup.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr};
use vmpath_common::{MonitorEvent, addr_family, monitor_kind};

use crate::{
    maps::{MONITOR, MONITOR_CFG, MONITOR_METER},
    meter,
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, hdr},
};

/// Reports the frame in `ctx`, dropped on `ifindex` (port `port_id`) for
/// `reason`.
#[inline(always)]
pub fn drop(ctx: &TcContext, ifindex: u32, port_id: u32, reason: u32) {
    emit(ctx, ifindex, port_id, monitor_kind::DROP, reason, 0, 0);
}

/// Reports a policy verdict on a new flow of `ctx`: `reason` 0 allowed
/// by `policy`, else the drop reason; `direction` a `policy_dir`.
#[inline(always)]
pub fn policy(ctx: &TcContext, port_id: u32, direction: u8, reason: u32, policy: u32) {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    emit(
        ctx,
        ifindex,
        port_id,
        monitor_kind::POLICY,
        reason,
        direction,
        policy,
    );
}

#[inline(always)]
fn emit(
    ctx: &TcContext,
    ifindex: u32,
    port_id: u32,
    kind: u8,
    reason: u32,
    direction: u8,
    policy: u32,
) {
    let Some(cfg) = MONITOR_CFG.get(0) else {
        return;
    };
    if cfg.listeners == 0 {
        return;
    }
    let Some(bucket) = MONITOR_METER.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU array, valid for this run, no
    // other writer.
    if !meter::spend(unsafe { &mut *bucket }, &cfg.limit) {
        return;
    }
    let Some(mut entry) = MONITOR.reserve(0) else {
        return;
    };
    let ev = entry.as_mut_ptr();
    let mut event = describe(ctx, ifindex, port_id, reason);
    event.kind = kind;
    event.direction = direction;
    event.policy = policy;
    // SAFETY: `ev` points at a reserved ring-buffer slot sized and aligned
    // for a `MonitorEvent` (8-byte aligned, 80 bytes); it is ours until
    // submitted, and written whole before.
    unsafe { ev.write(event) };
    entry.submit(0);
}

/// The event: where and why, and what the frame's headers say (as far as
/// they can be read).
#[inline(always)]
fn describe(ctx: &TcContext, ifindex: u32, port_id: u32, reason: u32) -> MonitorEvent {
    let mut ev = MonitorEvent {
        // SAFETY: a helper call without arguments; it touches no memory of ours.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        kind: monitor_kind::DROP,
        reason,
        ifindex,
        port_id,
        ..MonitorEvent::default()
    };
    let Ok(eth) = hdr::<EthHdr>(ctx, 0) else {
        return ev;
    };
    ev.src_mac = eth.src_addr;
    ev.dst_mac = eth.dst_addr;
    ev.ether_type = u16::from_be(eth.ether_type);
    let l4_off = match ev.ether_type {
        ETH_P_IP => {
            let Ok(ip) = hdr::<Ipv4Hdr>(ctx, ETH_LEN) else {
                return ev;
            };
            ev.family = addr_family::IPV4;
            ev.proto = ip.proto;
            ev.src[..4].copy_from_slice(&ip.src_addr);
            ev.dst[..4].copy_from_slice(&ip.dst_addr);
            // Later fragments carry no transport header.
            if u16::from_be_bytes(ip.frags) & 0x1fff != 0 {
                return ev;
            }
            ETH_LEN + usize::from(ip.vihl & 0x0f) * 4
        }
        ETH_P_IPV6 => {
            let Ok(ip) = hdr::<Ipv6Hdr>(ctx, ETH_LEN) else {
                return ev;
            };
            ev.family = addr_family::IPV6;
            ev.proto = ip.next_hdr;
            ev.src = ip.src_addr;
            ev.dst = ip.dst_addr;
            // Extension headers are not walked: ports only right after the
            // fixed header.
            ETH_LEN + Ipv6Hdr::LEN
        }
        _ => return ev,
    };
    if ev.proto == IPPROTO_TCP || ev.proto == IPPROTO_UDP {
        if let Ok(ports) = hdr::<[u8; 4]>(ctx, l4_off) {
            ev.sport = u16::from_be_bytes([ports[0], ports[1]]);
            ev.dport = u16::from_be_bytes([ports[2], ports[3]]);
        }
    }
    ev
}
