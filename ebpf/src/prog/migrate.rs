//! `vm_migrate`: tail call from `vm_port` on a live migration's target
//! port, until the VM resumes there (`migrate` has what it shares with
//! `vxlan_rx`).

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_SHOT},
    helpers::generated::bpf_ktime_get_ns,
    macros::classifier,
    programs::TcContext,
};
use network_types::eth::EthHdr;
use vmpath_common::{
    ENDPOINT_LOCAL, Endpoint, EndpointKey, MigrationEvent, NO_PORT_ID, PORT_F_MAC_KNOWN,
    PORT_F_PENDING, PortInfo, drop_reason, tail_call,
};

use crate::{
    counters,
    maps::{ENDPOINTS, PORTS},
    migrate::MIGRATED,
    parse::{
        ETH_LEN, ETH_P_IP, ETH_P_IPV6, IPPROTO_HOPOPTS, IPPROTO_ICMPV6, IPPROTO_UDP, be16, hdr,
        mac_eq, words16,
    },
    verdict::{PROGS, Verdict},
};

#[classifier]
pub fn vm_migrate(ctx: TcContext) -> i32 {
    // SAFETY: the skb pointer is the program's own context, valid for this run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let Some(port) = PORTS.get_ptr_mut(ifindex) else {
        counters::dropped(&ctx, ifindex, NO_PORT_ID, drop_reason::UNKNOWN_PORT);
        return TC_ACT_SHOT;
    };
    match try_vm_migrate(&ctx, ifindex, port) {
        Ok(action) => action,
        Err(reason) => {
            // SAFETY: `port` is from `get_ptr_mut` (bpf_map_lookup_elem) above, valid until
            // the program returns.
            counters::dropped(&ctx, ifindex, unsafe { (*port).port_id }, reason);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn try_vm_migrate(ctx: &TcContext, ifindex: u32, port: *mut PortInfo) -> Verdict {
    // SAFETY: `port` is from `vm_migrate`'s `get_ptr_mut` (bpf_map_lookup_elem),
    // valid until the program returns; plain integer reads.
    let (network, mac, flags, port_id) =
        unsafe { ((*port).network, (*port).mac, (*port).flags, (*port).port_id) };
    let src = hdr::<EthHdr>(ctx, 0)?.src_addr;
    // Only the VM itself resuming counts; anything else on the port waits.
    if flags & PORT_F_MAC_KNOWN == 0 || !mac_eq(&src, &mac) {
        return Err(drop_reason::MIGRATION_PENDING);
    }
    if flags & PORT_F_PENDING != 0 {
        if !resumes(ctx)? {
            return Err(drop_reason::MIGRATION_NOT_RESUMED);
        }
        let key = EndpointKey::new(network, mac);
        let ep = Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex,
            node_ip4: [0; 4],
            migrate_to: [0; 4],
            port_id,
            identity: 0,
        };
        if ENDPOINTS.insert(&key, &ep, 0).is_err() {
            return Err(drop_reason::HELPER_FAILED);
        }
        let event = MigrationEvent {
            network,
            mac,
            _pad: [0; 2],
            // SAFETY: a helper call without arguments; it touches no memory of ours.
            ktime_ns: unsafe { bpf_ktime_get_ns() },
        };
        // The first frame's time is the one the agent reports.
        if MIGRATED
            .insert(&ifindex, &event, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            crate::debug::cut_over(ifindex);
        }
        // Later frames go straight through `vm_port`.
        // SAFETY: `port` is valid until the program returns (see above); a frame on
        // another CPU may store the same value concurrently, a plain u32 store.
        unsafe { (*port).flags = flags & !PORT_F_PENDING };
    }
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return, otherwise execution falls through to the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::VM_PORT) };
    Err(drop_reason::HELPER_FAILED)
}

/// Whether a frame from the VM's MAC on its pending target port can be the
/// VM itself resuming there. Not what a kernel sends from an interface
/// that has just come up with that MAC and has no address of its own
/// (the target pod's, while the VM still runs on the source):
/// - IPv6 from :: (DAD's neighbour solicitation, MLD reports before a
///   link-local address exists); a running guest has its addresses;
/// - MLD queries/reports/done (130-132, 143) and router solicitations
///   (133), also after a hop-by-hop header (MLD's router alert);
/// - IPv4 from 0.0.0.0 other than DHCP to port 67 (a guest renewing its
///   lease right after resuming is the VM).
///
/// Everything else counts: QEMU's RARP, the guest's GARP, unsolicited NA
/// and any ordinary traffic.
#[inline(always)]
fn resumes(ctx: &TcContext) -> Result<bool, u32> {
    let ether_type = u16::from_be(hdr::<EthHdr>(ctx, 0)?.ether_type);
    if ether_type == ETH_P_IP {
        // Version/IHL at 0, protocol at 9, source at 12.
        let ip = hdr::<[u8; 20]>(ctx, ETH_LEN)?;
        if ip[12] | ip[13] | ip[14] | ip[15] != 0 {
            return Ok(true);
        }
        if ip[9] != IPPROTO_UDP {
            return Ok(false);
        }
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let ports = hdr::<[u8; 4]>(ctx, ETH_LEN + ihl)?;
        return Ok(be16([ports[2], ports[3]]) == 67);
    }
    if ether_type != ETH_P_IPV6 {
        return Ok(true);
    }
    // Next header at 6, source at 8.
    if words16(hdr::<[u8; 16]>(ctx, ETH_LEN + 8)?) == [0; 4] {
        return Ok(false);
    }
    let mut next = *hdr::<u8>(ctx, ETH_LEN + 6)?;
    let mut off = ETH_LEN + 40;
    if next == IPPROTO_HOPOPTS {
        let ext = hdr::<[u8; 2]>(ctx, off)?;
        next = ext[0];
        off += (usize::from(ext[1]) + 1) * 8;
    }
    if next != IPPROTO_ICMPV6 {
        return Ok(true);
    }
    // MLD query, report, done (130-132), MLDv2 report (143); RS (133).
    // Type, code and checksum: a 1-byte read at a variable offset
    // compiles to a bounds check the verifier does not follow.
    let icmp = hdr::<[u8; 4]>(ctx, off)?;
    Ok(!matches!(icmp[0], 130..=133 | 143))
}
