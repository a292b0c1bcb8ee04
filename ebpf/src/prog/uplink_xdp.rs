//! Native XDP on the node's uplink: the common cases of routed ingress and
//! SNAT return, done before the kernel builds an skb. A frame is taken
//! only when this program can finish it exactly as the tc `uplink`
//! program would: IPv4 without options or IPv6, TTL / hop limit above 1,
//! within the network MTU, for a VM hosted on this node whose port
//!
//! - is in `vmp_xdp_ports` (the agent lists only ports whose device
//!   accepts `ndo_xdp_xmit`: a tap, or a veth whose peer runs NAPI; a
//!   redirect to any other device would be dropped by the kernel unseen),
//! - is not isolated by NetworkPolicy (ingress policy runs in tc only),
//!
//! while no Service is programmed (a ClusterIP reply's reverse translation
//! runs in tc only), and not for an address whose inbound flows must be
//! recorded (`ROUTED_F_INBOUND`). SNAT return takes TCP and UDP
//! of a live flow (not ICMP, not fragments). Everything else, and
//! anything it cannot judge, goes on unchanged (XDP_PASS) to the tc
//! program, which handles it in full: this program never drops.

use core::mem::size_of;

use aya_ebpf::{
    bindings::xdp_action::{XDP_PASS, XDP_REDIRECT},
    helpers::generated::bpf_redirect,
    macros::xdp,
    programs::XdpContext,
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};
use vmpath_common::{AddrKey, NatKey, ROUTED_F_INBOUND, ROUTED_PORT_ID, xdp_stat};

use crate::{
    counters::count_tx,
    csum,
    maps::{UPLINK_XDP_STATS, XDP_PORTS},
    parse::{ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, write_mac},
    policy::POLICY_ENDPOINTS,
    route::ROUTED,
    service::SERVICE_CONFIG,
    snat::{
        flow::{expired, refresh_due, tcp_flags, touch},
        maps::{SNAT_CONFIG, SNAT_IN, SNAT_OUT},
    },
};

/// IPv4 header of 20 bytes, version 4.
const IPV4_NO_OPTIONS: u8 = 0x45;
const IPV4_L4_OFF: usize = ETH_LEN + Ipv4Hdr::LEN;

#[xdp]
pub fn uplink_xdp(ctx: XdpContext) -> u32 {
    let Some(ether_type) = at::<EthHdr>(&ctx, 0).map(|e| u16::from_be(e.ether_type)) else {
        return XDP_PASS;
    };
    let taken = match ether_type {
        ETH_P_IP => routed4(&ctx).or_else(|| snat_return4(&ctx)),
        ETH_P_IPV6 => routed6(&ctx),
        _ => return XDP_PASS,
    };
    match taken {
        Some(stat) => {
            count(stat);
            XDP_REDIRECT
        }
        None => {
            count(xdp_stat::PASSED);
            XDP_PASS
        }
    }
}

#[inline(always)]
fn count(slot: u32) {
    if let Some(n) = UPLINK_XDP_STATS.get_ptr_mut(slot) {
        // SAFETY: this CPU's slot of a per-CPU array, valid for this run;
        // no other writer (per-CPU, no preemption in BPF).
        unsafe { *n += 1 };
    }
}

/// The `T` at `offset` bytes into the frame, if the frame holds it.
#[inline(always)]
#[allow(
    clippy::mut_from_ref,
    reason = "the reference is into packet memory, not into `ctx`"
)]
fn at<T>(ctx: &XdpContext, offset: usize) -> Option<&mut T> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: the bytes lie within data..data_end (checked above), valid
    // and writable for this run (no helper here moves packet data); the
    // `T`s are packet headers: alignment 1, every bit pattern valid.
    Some(unsafe { &mut *((start + offset) as *mut T) })
}

/// May a frame for the port (`ifindex`, `port_id`) be redirected here? The
/// port's device takes XDP frames, no ingress policy guards it, no Service
/// may need to translate what reaches it.
#[inline(always)]
fn fast_port(ifindex: u32, port_id: u32) -> bool {
    // SAFETY: a map lookup; the value stays valid for this program run.
    if unsafe { XDP_PORTS.get(&ifindex) } != Some(&port_id) {
        return false;
    }
    if POLICY_ENDPOINTS
        .get(port_id)
        .is_some_and(|ep| ep.flags != 0)
    {
        return false;
    }
    SERVICE_CONFIG.get(0).is_none_or(|n| *n == 0)
}

/// Sets the redirect to the port; on success the frame is the caller's to
/// rewrite (the helper only records the target). Counts it as the port's.
#[inline(always)]
fn redirect_to(ctx: &XdpContext, ifindex: u32, port_id: u32) -> bool {
    // SAFETY: a helper call with integer arguments; it touches no memory
    // of ours.
    if unsafe { bpf_redirect(ifindex, 0) } != i64::from(XDP_REDIRECT) {
        return false;
    }
    count_tx(port_id, (ctx.data_end() - ctx.data()) as u32);
    true
}

#[inline(always)]
fn set_macs(ctx: &XdpContext, src: [u8; 6], dst: [u8; 6]) -> Option<()> {
    let eth = at::<EthHdr>(ctx, 0)?;
    write_mac(&mut eth.src_addr, src);
    write_mac(&mut eth.dst_addr, dst);
    Some(())
}

#[inline(always)]
fn routed4(ctx: &XdpContext) -> Option<u32> {
    let ip = at::<Ipv4Hdr>(ctx, ETH_LEN)?;
    // SAFETY: a map lookup; the value stays valid for this program run.
    let r = unsafe { ROUTED.get(&AddrKey::v4(0, ip.dst_addr)) }?;
    if ip.vihl != IPV4_NO_OPTIONS || ip.ttl <= 1 || r.ifindex == 0 {
        return None;
    }
    if r.port_id & ROUTED_F_INBOUND != 0 || too_big(r.mtu, u16::from_be_bytes(ip.tot_len)) {
        return None;
    }
    let port_id = u32::from(r.port_id & ROUTED_PORT_ID);
    if !fast_port(r.ifindex, port_id) || !redirect_to(ctx, r.ifindex, port_id) {
        return None;
    }
    ip.check = csum::dec_ttl4(ip, u16::from_be_bytes(ip.check)).to_be_bytes();
    set_macs(ctx, r.gw_mac, r.vm_mac)?;
    Some(xdp_stat::ROUTED4)
}

#[inline(always)]
fn routed6(ctx: &XdpContext) -> Option<u32> {
    let ip = at::<Ipv6Hdr>(ctx, ETH_LEN)?;
    // SAFETY: a map lookup; the value stays valid for this program run.
    let r = unsafe { ROUTED.get(&AddrKey::v6(0, &ip.dst_addr)) }?;
    if ip.hop_limit <= 1 || r.ifindex == 0 || r.port_id & ROUTED_F_INBOUND != 0 {
        return None;
    }
    if too_big(
        r.mtu,
        40u16.saturating_add(u16::from_be_bytes(ip.payload_len)),
    ) {
        return None;
    }
    let port_id = u32::from(r.port_id & ROUTED_PORT_ID);
    if !fast_port(r.ifindex, port_id) || !redirect_to(ctx, r.ifindex, port_id) {
        return None;
    }
    ip.hop_limit -= 1;
    set_macs(ctx, r.gw_mac, r.vm_mac)?;
    Some(xdp_stat::ROUTED6)
}

/// A reply of a live IPv4 SNAT flow (TCP or UDP): destination back to the
/// VM's address and port, as `snat::ipv4::ingress4` does.
#[inline(always)]
fn snat_return4(ctx: &XdpContext) -> Option<u32> {
    let cfg = SNAT_CONFIG.get(0)?;
    let ip = at::<Ipv4Hdr>(ctx, ETH_LEN)?;
    let (src, dst, proto, ttl) = (ip.src_addr, ip.dst_addr, ip.proto, ip.ttl);
    if dst != cfg.addr4 || cfg.addr4 == [0; 4] || ip.vihl != IPV4_NO_OPTIONS {
        return None;
    }
    if u16::from_be_bytes(ip.frags) & 0x3fff != 0 || ttl <= 1 {
        return None;
    }
    let (sport, dport, flags, csum_off) = match proto {
        IPPROTO_TCP => {
            let t = at::<TcpHdr>(ctx, IPV4_L4_OFF)?;
            let off = IPV4_L4_OFF + core::mem::offset_of!(TcpHdr, check);
            (
                u16::from_be_bytes(t.source),
                u16::from_be_bytes(t.dest),
                tcp_flags(t),
                off,
            )
        }
        IPPROTO_UDP => {
            let u = at::<UdpHdr>(ctx, IPV4_L4_OFF)?;
            let off = IPV4_L4_OFF + core::mem::offset_of!(UdpHdr, check);
            (u16::from_be_bytes(u.src), u16::from_be_bytes(u.dst), 0, off)
        }
        _ => return None,
    };
    let back = SNAT_IN.get_ptr_mut(&NatKey::new(src, dst, sport, dport, proto))?;
    // SAFETY: `back` is from `get_ptr_mut` just above, valid until the
    // program returns; `NatEntry` is `Copy` plain integers.
    let e = unsafe { *back };
    let now = crate::clock::flow_now();
    if expired(cfg, &e, proto, now) || !fast_port(e.hop.ifindex, e.port_id) {
        return None;
    }
    if !redirect_to(ctx, e.hop.ifindex, e.port_id) {
        return None;
    }
    touch(back, now, flags);
    if refresh_due(e.last_seen, now, flags)
        && let Some(out) = SNAT_OUT.get_ptr_mut(&NatKey::new(e.addr, src, e.port, sport, proto))
    {
        touch(out, now, flags);
    }

    // Destination address and port back to the VM's, checksums patched
    // (the address is in the transport checksum's pseudo header).
    let (old_a, new_a) = (words(dst), words(e.addr));
    let ip = at::<Ipv4Hdr>(ctx, ETH_LEN)?;
    ip.dst_addr = e.addr;
    let mut check = u16::from_be_bytes(ip.check);
    check = csum::replace16(check, old_a[0], new_a[0]);
    check = csum::replace16(check, old_a[1], new_a[1]);
    ip.check = check.to_be_bytes();
    ip.check = csum::dec_ttl4(ip, u16::from_be_bytes(ip.check)).to_be_bytes();

    let l4_check = at::<[u8; 2]>(ctx, csum_off)?;
    let old = u16::from_be_bytes(*l4_check);
    // UDP over IPv4 may carry no checksum (0): it stays without one.
    if !(proto == IPPROTO_UDP && old == 0) {
        let mut c = csum::replace16(old, old_a[0], new_a[0]);
        c = csum::replace16(c, old_a[1], new_a[1]);
        c = csum::replace16(c, dport, e.port);
        if proto == IPPROTO_UDP && c == 0 {
            // A computed UDP checksum of 0 is sent as all ones.
            c = 0xffff;
        }
        *l4_check = c.to_be_bytes();
    }
    // The destination port: the same offset in TCP and UDP headers.
    let port = at::<[u8; 2]>(ctx, IPV4_L4_OFF + 2)?;
    *port = e.port.to_be_bytes();
    set_macs(ctx, e.hop.src_mac, e.hop.dst_mac)?;
    Some(xdp_stat::SNAT4)
}

/// Larger than the network's MTU (0: none)? tc answers those (an XDP
/// frame is never GSO: its IP length is the one to judge).
#[inline(always)]
fn too_big(mtu: u16, ip_len: u16) -> bool {
    mtu != 0 && ip_len > mtu
}

/// The two 16-bit big-endian words of an IPv4 address.
#[inline(always)]
fn words(a: [u8; 4]) -> [u16; 2] {
    [
        u16::from_be_bytes([a[0], a[1]]),
        u16::from_be_bytes([a[2], a[3]]),
    ]
}
