//! ARP requests and neighbour solicitations a VM broadcasts for an address
//! vmpath knows (configured, claimed, or learned and screened by the agent:
//! whatever `vmp_addresses` holds with its MAC, local or on another node)
//! are answered at the asking VM's port, as the owner would answer: no
//! broadcast leaves the node for them. Others (an unknown address, an owner
//! whose MAC is not known here, the asker's own address) are switched as
//! before. Its own program, tail-called from `vm_port`: inline, it took
//! `vm_port` past the verifier's budget.
//!
//! A local owner still gets the request itself (a clone to its port, not a
//! flood): a guest learns who asks from the request, and without it a
//! guest whose entry for the asker is stale (a pod re-created with the
//! same address and a new MAC) answers the old MAC until its entry
//! expires.

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use network_types::{arp::ArpHdr, eth::EthHdr, ip::Ipv6Hdr};
use vmpath_common::{AddrKey, NO_PORT_ID, PortInfo};

use crate::{
    counters, fwd,
    maps::{ADDRESSES, PORTS},
    nd,
    parse::{ETH_LEN, ETH_P_ARP, ETH_P_IPV6, be16, hdr, hdr_mut, mac_eq},
    verdict::{self, Verdict},
};

const ARP_REQUEST: u16 = 1;
const ARP_REPLY: u16 = 2;

#[classifier]
pub fn vm_neigh(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map lookup; the value stays valid for this program run.
    let Some(port) = (unsafe { PORTS.get(&ifindex) }) else {
        counters::dropped(
            &ctx,
            ifindex,
            NO_PORT_ID,
            vmpath_common::drop_reason::UNKNOWN_PORT,
        );
        return TC_ACT_SHOT;
    };
    match try_vm_neigh(&ctx, ifindex, port) {
        Ok(action) => action,
        Err(reason) => {
            counters::dropped(&ctx, ifindex, port.port_id, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vm_neigh(ctx: &TcContext, ifindex: u32, port: &PortInfo) -> Verdict {
    let eth = hdr::<EthHdr>(ctx, 0)?;
    let (dst, src, ether_type) = (eth.dst_addr, eth.src_addr, u16::from_be(eth.ether_type));
    let answered = match ether_type {
        ETH_P_ARP => answer_arp(ctx, ifindex, port.network, &src)?,
        ETH_P_IPV6 => answer_ns(ctx, ifindex, port.network, &src)?,
        _ => false,
    };
    if answered {
        counters::count_gw_reply(port.port_id);
        return verdict::reply_out(ctx, ifindex);
    }
    fwd::switch(ctx, ifindex, port.network, dst)
}

/// The MAC to answer with for `key`, and the owner's port on this node
/// (0: on another node): known, not the asker's own address (a VM probing
/// or announcing itself hears from its peers, not from us), and not the
/// asker's MAC (a migrated VM asking for its own address).
#[inline(always)]
fn owner_of(key: &AddrKey, ifindex: u32, asker: &[u8; 6]) -> Option<([u8; 6], u32)> {
    // SAFETY: a map lookup; the value stays valid for this program run.
    let owner = unsafe { ADDRESSES.get(key) }?;
    let mac = owner.mac;
    if mac == [0; 6] || (owner.ifindex != 0 && owner.ifindex == ifindex) || mac_eq(&mac, asker) {
        return None;
    }
    Some((mac, owner.ifindex))
}

/// The request as it came, to a local owner's port only (see the module
/// comment). Before the frame is rewritten; packet pointers taken before
/// this are stale after it.
#[inline(always)]
fn tell_owner(ctx: &TcContext, owner_port: u32) {
    if owner_port != 0 {
        // A failed clone only costs the owner a fresher entry.
        let mark = verdict::mark_for_port(ctx.skb.skb);
        let _ = ctx.clone_redirect(owner_port, 0);
        verdict::restore_mark(ctx.skb.skb, mark);
    }
}

/// An ARP request for a known address: rewritten into the owner's reply.
#[inline(always)]
fn answer_arp(ctx: &TcContext, ifindex: u32, network: u32, src: &[u8; 6]) -> Result<bool, u32> {
    let a = hdr::<ArpHdr>(ctx, ETH_LEN)?;
    // `vm_port` checked the header's shape and the sender.
    if be16(a.oper) != ARP_REQUEST || a.tpa == a.spa {
        return Ok(false);
    }
    let tpa = a.tpa;
    let Some((mac, owner_port)) = owner_of(&AddrKey::v4(network, tpa), ifindex, src) else {
        return Ok(false);
    };
    tell_owner(ctx, owner_port);
    let a = hdr_mut::<ArpHdr>(ctx, ETH_LEN)?;
    let (requester_mac, requester_ip) = (a.sha, a.spa);
    a.oper = ARP_REPLY.to_be_bytes();
    a.tha = requester_mac;
    a.tpa = requester_ip;
    a.sha = mac;
    a.spa = tpa;
    let e = hdr_mut::<EthHdr>(ctx, 0)?;
    e.dst_addr = requester_mac;
    e.src_addr = mac;
    Ok(true)
}

/// A neighbour solicitation (from an address, not DAD: `vm_port` sends
/// only those) for a known address: rewritten into the owner's NA.
#[inline(always)]
fn answer_ns(ctx: &TcContext, ifindex: u32, network: u32, src: &[u8; 6]) -> Result<bool, u32> {
    let target = nd::ns_target(ctx)?;
    let Some((mac, owner_port)) = owner_of(&AddrKey::v6(network, &target), ifindex, src) else {
        return Ok(false);
    };
    // The asker's own address is its own business (checked after the
    // lookup: most solicitations ask for someone else).
    if hdr::<Ipv6Hdr>(ctx, ETH_LEN)?.src_addr == target {
        return Ok(false);
    }
    tell_owner(ctx, owner_port);
    nd::neighbor_advert_as(ctx, target, mac, nd::NA_FLAGS_SO)?;
    Ok(true)
}
