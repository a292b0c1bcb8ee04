//! `vm_service`, `vm_service6` and `vm_service_in`: ClusterIP translation
//! of what a VM sends to the gateway (IPv4, IPv6), delivered from here,
//! and of the replies on their way to the client's port (`service` and
//! `service6` have the tables, the backend choice and the rewrites).

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use network_types::eth::EthHdr;
use vmpath_common::{
    NO_PORT_ID, PortInfo, SERVICE_CB_DELIVER, ServiceFlow, ServiceFlowKey, ServiceFlowKey6,
    ServiceKey, ServiceKey6, ServiceScratch6, drop_reason, skb_cb, svc_flow,
};

use crate::{
    counters, fwd,
    maps::PORTS,
    parse::{addr16_eq, hdr_mut},
    service::{self, Tuple, service_verdict},
    service6,
};

/// Tail-called from `vm_port`: ClusterIP translation of what a port sends
/// to the gateway, delivered from here. Frames for no Service go back to
/// `vm_port` (marked, so it neither counts them again nor sends them here
/// again).
#[classifier]
pub fn vm_service(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    let verdict = try_vm_service(&ctx, ifindex, port);
    service_verdict(&ctx, ifindex, port.port_id, verdict)
}

#[inline(always)]
fn try_vm_service(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Result<Option<i32>, u32> {
    let Some(t) = service::tuple(ctx)? else {
        return Ok(None);
    };
    let network = port.network;
    let now = crate::clock::flow_now();
    let key = ServiceFlowKey::new(network, t.src, t.dst, t.sport, t.dport, t.proto);
    if let Some(flow) = service::SERVICE_FLOWS.get_ptr_mut(&key) {
        // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above,
        // valid for this run; a racing writer only writes a time.
        let f = unsafe { *flow };
        if f.flags & (svc_flow::FORWARD | svc_flow::HAIRPIN) != 0
            && service::still_open(f.last_seen, t.proto, t.tcp_flags, now)
        {
            // SAFETY: as above.
            unsafe { (*flow).last_seen = now };
            return translate(ctx, ifindex, port, &t, &f);
        }
    }
    let skey = ServiceKey::new(network, t.dst, t.dport, t.proto);
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(svc) = (unsafe { service::SERVICES.get(&skey) }) else {
        return Ok(None);
    };
    let (id, count, flags, affinity_timeout) = (svc.id, svc.count, svc.flags, svc.affinity_timeout);
    if count == 0 {
        service::count_stats(port.port_id, false);
        return service::reject(ctx, ifindex, port, &t).map(Some);
    }
    let Some(backend) = service::pick(id, count, flags, affinity_timeout, t.src, now) else {
        service::count_stats(port.port_id, false);
        return service::reject(ctx, ifindex, port, &t).map(Some);
    };
    let hairpin = backend.addr == t.src;
    // The reply as it will be looked up, and what it becomes: from the
    // ClusterIP. A hairpin goes back into the client's own port from the
    // ClusterIP (a packet from its own address would be a martian); it
    // replies to the ClusterIP, and that reply is turned around on its
    // port too.
    let mut f = ServiceFlow {
        last_seen: now,
        src: t.dst,
        dst: t.src,
        sport: t.dport,
        dport: t.sport,
        mac: port.gw_mac,
        flags: svc_flow::REVERSE,
        _pad: 0,
    };
    let rev_to = if hairpin {
        f.mac = port.mac;
        f.flags = svc_flow::REVERSE | svc_flow::HAIRPIN;
        t.dst
    } else {
        t.src
    };
    let rev_key = ServiceFlowKey::new(
        network,
        backend.addr,
        rev_to,
        backend.port,
        t.sport,
        t.proto,
    );
    // A full table evicts its oldest flows (LRU); should an insert still
    // fail, the next packet of the flow picks again.
    let _ = service::SERVICE_FLOWS.insert(&rev_key, &f, 0);
    f.src = if hairpin { t.dst } else { t.src };
    f.dst = backend.addr;
    f.sport = t.sport;
    f.dport = backend.port;
    if hairpin {
        f.flags = svc_flow::FORWARD | svc_flow::HAIRPIN;
    } else {
        f.mac = backend.mac;
        f.flags = svc_flow::FORWARD;
    }
    let _ = service::SERVICE_FLOWS.insert(&key, &f, 0);
    service::count_stats(port.port_id, true);
    translate(ctx, ifindex, port, &t, &f)
}

/// Rewrites the frame's tuple `t` to `f`'s and sends it on: a hairpin
/// (or its reply) back into the client's own port; anything else to
/// `f.mac` as `vm_port` would send it, whose filters it passed already:
/// the client's egress policy sees the backend (as the backend's own
/// policy will), then the switch delivers it to the backend's port or
/// over the overlay. A flow egress policy has not seen yet goes to
/// `vm_policy_out`, which hands it to `vm_port` past its policy.
#[inline(always)]
fn translate(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    t: &Tuple,
    f: &ServiceFlow,
) -> Result<Option<i32>, u32> {
    service::rewrite(ctx, t, f)?;
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.dst_addr = f.mac;
    if f.flags & svc_flow::HAIRPIN != 0 {
        eth.src_addr = port.gw_mac;
        return fwd::deliver_local(ctx, ifindex, port.port_id).map(Some);
    }
    let parsed = match crate::policy::egress(ctx, port.port_id, None) {
        crate::policy::Egress::Pass(parsed) => parsed,
        crate::policy::Egress::Verdict(verdict) => return verdict.map(Some),
    };
    fwd::switch_parsed(ctx, ifindex, port.network, f.mac, parsed).map(Some)
}

/// Tail-called from `vm_port`: IPv6 ClusterIP translation of what a port
/// sends to the gateway, delivered from here. Frames for no Service go
/// back to `vm_port`, as from `vm_service`.
#[classifier]
pub fn vm_service6(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    let verdict = try_vm_service6(&ctx, ifindex, port);
    service_verdict(&ctx, ifindex, port.port_id, verdict)
}

#[inline(always)]
fn try_vm_service6(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Result<Option<i32>, u32> {
    let s = service6::scratch()?;
    let network = port.network;
    let Some(tcp_flags) = service6::tuple(ctx, network, &mut s.key)? else {
        return Ok(None);
    };
    let t = &s.key;
    let (proto, sport, dport) = (t.proto, t.sport, t.dport);
    let now = crate::clock::flow_now();
    if let Some(flow) = service6::SERVICE6_FLOWS.get_ptr_mut(&s.key) {
        // SAFETY: from `get_ptr_mut` (bpf_map_lookup_elem) just above,
        // valid for this run; a racing writer only writes a time.
        s.flow = unsafe { *flow };
        if s.flow.flags & (svc_flow::FORWARD | svc_flow::HAIRPIN) != 0
            && service::still_open(s.flow.last_seen, proto, tcp_flags, now)
        {
            // SAFETY: as above.
            unsafe { (*flow).last_seen = now };
            return translate6(ctx, ifindex, port, s);
        }
    }
    let skey = ServiceKey6::new(network, s.key.dst, dport, proto);
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(svc) = (unsafe { service6::SERVICES6.get(&skey) }) else {
        return Ok(None);
    };
    let (id, count, flags, affinity_timeout) = (svc.id, svc.count, svc.flags, svc.affinity_timeout);
    let backend = if count == 0 {
        None
    } else {
        service6::pick(id, count, flags, affinity_timeout, &s.key.src, now)
    };
    let Some(backend) = backend else {
        service::count_stats(port.port_id, false);
        return service6::reject(ctx, ifindex, port, s, tcp_flags).map(Some);
    };
    let hairpin = addr16_eq(&backend.addr, &s.key.src);
    // As in `service`: the reply as it will be looked up, and what it
    // becomes (from the ClusterIP); a hairpin's both ways on its port.
    let f = &mut s.flow;
    f.last_seen = now;
    f.src = s.key.dst;
    f.dst = s.key.src;
    f.sport = dport;
    f.dport = sport;
    f.mac = port.gw_mac;
    f.flags = svc_flow::REVERSE;
    if hairpin {
        f.mac = port.mac;
        f.flags = svc_flow::REVERSE | svc_flow::HAIRPIN;
    }
    // The reply comes from the backend to the client (a hairpin's, to
    // the ClusterIP it spoke to); built where the tuple was, which is
    // rebuilt from the flow below.
    let rev_to = if hairpin { s.key.dst } else { s.key.src };
    s.key = ServiceFlowKey6::new(network, &backend.addr, &rev_to, backend.port, sport, proto);
    // A full table evicts its oldest flows (LRU); should an insert still
    // fail, the next packet of the flow picks again.
    let _ = service6::SERVICE6_FLOWS.insert(&s.key, &s.flow, 0);
    // The tuple again: the reverse entry's (src, dst) are (ClusterIP,
    // client) swapped.
    let f = &mut s.flow;
    s.key = ServiceFlowKey6::new(network, &f.dst, &f.src, sport, dport, proto);
    f.src = if hairpin { f.src } else { f.dst };
    f.dst = backend.addr;
    f.sport = sport;
    f.dport = backend.port;
    if hairpin {
        f.flags = svc_flow::FORWARD | svc_flow::HAIRPIN;
    } else {
        f.mac = backend.mac;
        f.flags = svc_flow::FORWARD;
    }
    let _ = service6::SERVICE6_FLOWS.insert(&s.key, &s.flow, 0);
    service::count_stats(port.port_id, true);
    translate6(ctx, ifindex, port, s)
}

/// `service::translate` for IPv6 (the tuple `s.key` becomes `s.flow`'s):
/// a hairpin back into the client's port; anything else through the
/// client's egress policy to the flow's MAC.
#[inline(always)]
fn translate6(
    ctx: &TcContext,
    ifindex: u32,
    port: &PortInfo,
    s: &ServiceScratch6,
) -> Result<Option<i32>, u32> {
    service6::rewrite(ctx, &s.key, &s.flow)?;
    let (mac, flags) = (s.flow.mac, s.flow.flags);
    let eth = hdr_mut::<EthHdr>(ctx, 0)?;
    eth.dst_addr = mac;
    if flags & svc_flow::HAIRPIN != 0 {
        eth.src_addr = port.gw_mac;
        return fwd::deliver_local(ctx, ifindex, port.port_id).map(Some);
    }
    let parsed = match crate::policy::egress(ctx, port.port_id, None) {
        crate::policy::Egress::Pass(parsed) => parsed,
        crate::policy::Egress::Verdict(verdict) => return verdict.map(Some),
    };
    fwd::switch_parsed(ctx, ifindex, port.network, mac, parsed).map(Some)
}

/// Tail-called where a frame is delivered to a local port while Services
/// exist (`cb`: port id, ifindex): a reply of a flow the port's endpoint
/// opened to a ClusterIP comes from the ClusterIP; then the delivery.
#[classifier]
pub fn vm_service_in(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let (magic, port_id, target) = unsafe {
        let cb = &(*ctx.skb.skb).cb;
        (cb[skb_cb::MARKER], cb[skb_cb::PORT], cb[skb_cb::IFINDEX])
    };
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let verdict = if magic == SERVICE_CB_DELIVER {
        service::reverse(&ctx, target)
            .and_then(|()| crate::service6::reverse(&ctx, target))
            .and_then(|()| fwd::deliver_now(&ctx, target, port_id))
    } else {
        Err(drop_reason::HELPER_FAILED)
    };
    match verdict {
        Ok(action) => action,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port_id, reason);
            TC_ACT_SHOT
        }
    }
}
