//! The slow path (docs/architecture.md): DHCPv4, DHCPv6 and router solicitations
//! leave the VM port tagged with the port's id in an 802.1Q header and go
//! out of `vmp-slow0`; XDP on its peer `vmp-slow1` hands them to the
//! agent's AF_XDP socket; the agent's replies come back tagged into
//! `vmp-slow0`, lose the tag and leave through the VM's port.

use aya_ebpf::{bindings::bpf_adj_room_mode::BPF_ADJ_ROOM_MAC, programs::TcContext};
use vmpath_common::{PortInfo, drop_reason};

use crate::{
    maps::SLOW,
    meter,
    parse::{ETH_LEN, ETH_P_8021Q, hdr_mut},
    verdict::{self, Verdict},
};

pub const VLAN_LEN: u32 = 4;
pub const VID_MASK: u16 = 0x0fff;

/// Sends a frame from a VM port to the agent, tagged with the port id,
/// if the port is within its rate for the frame's `slow_class`.
#[inline(always)]
pub fn punt(ctx: &TcContext, port: &PortInfo, class: usize) -> Verdict {
    let slow = match SLOW.get(0) {
        Some(s) if s.ifindex != 0 => s.ifindex,
        _ => return Err(drop_reason::SLOWPATH_DOWN),
    };
    meter::admit(port.port_id, class)?;
    // Room for the tag between the MAC header and L3.
    if ctx
        .adjust_room(VLAN_LEN as i32, BPF_ADJ_ROOM_MAC, 0)
        .is_err()
    {
        return Err(drop_reason::HELPER_FAILED);
    }
    // [dst][src][type][room] -> [dst][src][8100][tci][type]
    let h = hdr_mut::<[u8; ETH_LEN + 4]>(ctx, 0)?;
    let (t0, t1) = (h[12], h[13]);
    let tci = (port.port_id as u16 & VID_MASK).to_be_bytes();
    let tpid = ETH_P_8021Q.to_be_bytes();
    h[12] = tpid[0];
    h[13] = tpid[1];
    h[14] = tci[0];
    h[15] = tci[1];
    h[16] = t0;
    h[17] = t1;
    verdict::redirect(slow)
}
