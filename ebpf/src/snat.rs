//! SNAT for networks with `egress: SNAT` (IPv4).

use aya_ebpf::{
    btf_maps::{Array, HashMap, LruHashMap},
    macros::btf_map,
    programs::TcContext,
};
use vmpath_common::{
    MAX_SNAT_FLOWS, MAX_SNAT_VMS, NatEntry, NatKey, NetworkInfo, PortInfo, SnatConfig, drop_reason,
};

/// Slot 0: the node's SNAT address, port range, quota and timeouts.
#[btf_map(name = "vmp_snat_cfg")]
pub static SNAT_CFG: Array<SnatConfig, 1> = Array::new();

/// The VM's tuple -> the translated source (address, port).
#[btf_map(name = "vmp_snat_out")]
pub static SNAT_OUT: LruHashMap<NatKey, NatEntry, { MAX_SNAT_FLOWS as usize }> = LruHashMap::new();

/// The reply's tuple (as it arrives on the uplink) -> the VM's address,
/// port, ifindex and MAC.
#[btf_map(name = "vmp_snat_in")]
pub static SNAT_IN: LruHashMap<NatKey, NatEntry, { MAX_SNAT_FLOWS as usize }> = LruHashMap::new();

/// VM address (IPv4, as a native u32) -> SNAT flows it holds (quota). The
/// data path counts up; the agent's sweep recounts after expiring flows.
#[btf_map(name = "vmp_snat_quota")]
pub static SNAT_QUOTA: HashMap<u32, u32, { MAX_SNAT_VMS as usize }> = HashMap::new();

/// Translates the VM's frame in place to the node's SNAT address.
#[inline(always)]
pub fn egress4(
    _ctx: &TcContext,
    _ifindex: u32,
    _port: &PortInfo,
    _net: &NetworkInfo,
    _l4_off: usize,
) -> Result<(), u32> {
    Err(drop_reason::SNAT_NO_ADDRESS)
}

/// Reverse translation of return traffic on the uplink: `Ok(None)` when the
/// frame is not SNAT return traffic.
#[inline(always)]
pub fn ingress4(_ctx: &TcContext) -> Result<Option<i32>, u32> {
    Ok(None)
}
