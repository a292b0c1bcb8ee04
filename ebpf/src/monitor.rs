//! `vmpath monitor`: one `MonitorEvent` per dropped frame (and per policy
//! verdict on a new flow) into the
//! `vmp_monitor` ring buffer, only while a monitor client listens, and at
//! most the configured rate per CPU (a token bucket, as the slow path's),
//! so a flood costs the ring nothing and nobody listening costs one array
//! lookup.

use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use network_types::{eth::EthHdr, ip::Ipv4Hdr, ip::Ipv6Hdr};
use vmpath_common::{MonitorEvent, PolicyFlowKey, addr_family, monitor_kind};

use crate::{
    maps::{MONITOR, MONITOR_CFG, MONITOR_METER},
    meter,
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, hdr},
};

/// Reports the frame in `ctx`, dropped on `ifindex` (port `port_id`) for
/// `reason`.
#[inline(always)]
pub fn drop(ctx: &TcContext, ifindex: u32, port_id: u32, reason: u32) {
    let Some(mut entry) = reserve() else {
        return;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points at a reserved ring-buffer slot sized and aligned
    // for a `MonitorEvent` (8-byte aligned, 80 bytes); it is ours until
    // submitted, and written whole before.
    unsafe { ev.write(describe(ctx, ifindex, port_id, reason)) };
    entry.submit(0);
}

/// Reports a policy verdict on a new flow of the endpoint on the port
/// `ifindex`, whose key `k` policy read:
/// `reason` 0 allowed by `policy`, else the drop reason. Written straight
/// into the ring (the policy check has little stack to spare).
#[inline(always)]
pub fn policy(ctx: &TcContext, ifindex: u32, k: &PolicyFlowKey, reason: u32, policy: u32) {
    let Some(mut entry) = reserve() else {
        return;
    };
    let ev = entry.as_mut_ptr();
    let (src_mac, dst_mac) = match hdr::<EthHdr>(ctx, 0) {
        Ok(eth) => (eth.src_addr, eth.dst_addr),
        Err(_) => ([0; 6], [0; 6]),
    };
    // SAFETY: `ev` points at a reserved ring-buffer slot sized and aligned
    // for a `MonitorEvent`; it is ours until submitted, and every field is
    // written before.
    unsafe {
        (*ev).ktime_ns = bpf_ktime_get_ns();
        (*ev).kind = monitor_kind::POLICY;
        (*ev).family = k.family;
        (*ev).proto = k.proto;
        (*ev).direction = k.direction;
        (*ev).reason = reason;
        (*ev).ifindex = ifindex;
        (*ev).port_id = k.port_id;
        (*ev).src = k.src;
        (*ev).dst = k.dst;
        (*ev).sport = k.sport;
        (*ev).dport = k.dport;
        (*ev).ether_type = if k.family == addr_family::IPV4 {
            ETH_P_IP
        } else {
            ETH_P_IPV6
        };
        (*ev)._pad2 = 0;
        (*ev).src_mac = src_mac;
        (*ev).dst_mac = dst_mac;
        (*ev).policy = policy;
    }
    entry.submit(0);
}

/// A ring-buffer slot for one event, if someone listens and the rate
/// allows one more.
#[inline(always)]
fn reserve() -> Option<aya_ebpf::maps::ring_buf::RingBufEntry<MonitorEvent>> {
    let cfg = MONITOR_CFG.get(0)?;
    if cfg.listeners == 0 {
        return None;
    }
    let bucket = MONITOR_METER.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, valid for this run, no
    // other writer.
    if !meter::spend(unsafe { &mut *bucket }, &cfg.limit) {
        return None;
    }
    MONITOR.reserve(0)
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
    if (ev.proto == IPPROTO_TCP || ev.proto == IPPROTO_UDP)
        && let Ok(ports) = hdr::<[u8; 4]>(ctx, l4_off)
    {
        ev.sport = u16::from_be_bytes([ports[0], ports[1]]);
        ev.dport = u16::from_be_bytes([ports[2], ports[3]]);
    }
    ev
}
