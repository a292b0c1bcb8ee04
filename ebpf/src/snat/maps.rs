//! The SNAT tables of both families, one home for what the translation,
//! the ICMP errors and `uplink_xdp` look up.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LruHashMap},
    macros::btf_map,
};
use vmpath_common::{
    DatagramKey, FragKey, InboundFlow, NatEntry, NatEntry6, NatKey, NatKey6, SnatConfig, maps,
};

/// Slot 0: the node's SNAT address, port range, quota and timeouts.
#[btf_map(name = "vmp_snat_cfg")]
pub static SNAT_CONFIG: Array<SnatConfig, { maps::SNAT_CONFIG.max_entries as usize }> =
    Array::new();

/// The VM's tuple -> the translated source (address, port).
#[btf_map(name = "vmp_snat_out")]
pub static SNAT_OUT: LruHashMap<NatKey, NatEntry, { maps::SNAT_OUT.max_entries as usize }> =
    LruHashMap::new();

/// The reply's tuple (as it arrives on the uplink) -> the VM's address,
/// port, ifindex and MAC.
#[btf_map(name = "vmp_snat_in")]
pub static SNAT_IN: LruHashMap<NatKey, NatEntry, { maps::SNAT_IN.max_entries as usize }> =
    LruHashMap::new();

/// VM address (IPv4, as a native u32) -> SNAT flows it holds (quota). The
/// data path counts up; the agent's sweep recounts after expiring flows.
#[btf_map(name = "vmp_snat_quota")]
pub static SNAT_QUOTA: HashMap<u32, u32, { maps::SNAT_QUOTA.max_entries as usize }> =
    HashMap::new();

/// Flows opened from outside to VMs of SNAT networks with routed ingress,
/// by the tuple the VM's replies carry.
#[btf_map(name = "vmp_inbound")]
pub static INBOUND: LruHashMap<NatKey, InboundFlow, { maps::INBOUND.max_entries as usize }> =
    LruHashMap::new();

/// Fragmented datagrams whose first fragment SNAT translated (or let
/// through un-NATed), so their later fragments, which carry no ports,
/// take the same way. Both directions.
#[btf_map(name = "vmp_snat_frags")]
pub static SNAT_FRAGS: LruHashMap<FragKey, NatEntry, { maps::SNAT_FRAGS.max_entries as usize }> =
    LruHashMap::new();

/// The VM's tuple -> the translated source (address, port).
#[btf_map(name = "vmp_snat6_out")]
pub static SNAT6_OUT: LruHashMap<NatKey6, NatEntry6, { maps::SNAT6_OUT.max_entries as usize }> =
    LruHashMap::new();

/// The reply's tuple (as it arrives on the uplink) -> the VM's address,
/// port, ifindex and MAC.
#[btf_map(name = "vmp_snat6_in")]
pub static SNAT6_IN: LruHashMap<NatKey6, NatEntry6, { maps::SNAT6_IN.max_entries as usize }> =
    LruHashMap::new();

/// VM address -> SNAT flows it holds (quota), as `vmp_snat_quota`.
#[btf_map(name = "vmp_snat6_quota")]
pub static SNAT6_QUOTA: HashMap<[u8; 16], u32, { maps::SNAT6_QUOTA.max_entries as usize }> =
    HashMap::new();

/// Flows opened from outside to VMs' IPv6 addresses on SNAT networks with
/// routed ingress, by the tuple the VM's replies carry.
#[btf_map(name = "vmp_inbound6")]
pub static INBOUND6: LruHashMap<NatKey6, InboundFlow, { maps::INBOUND6.max_entries as usize }> =
    LruHashMap::new();

/// Fragmented datagrams whose first fragment SNAT translated (or let
/// through un-NATed), so their later fragments take the same way; both
/// directions (`vmp_snat_frags`' twin). Keyed with `FRAG_OUT`: the source
/// a VM's later fragments take (the SNAT address, or none); with
/// `FRAG_IN`: the flow's `vmp_snat6_in` entry, back to the VM.
#[btf_map(name = "vmp_snat6_frags")]
pub static SNAT6_FRAGS: LruHashMap<
    DatagramKey,
    NatEntry6,
    { maps::SNAT6_FRAGS.max_entries as usize },
> = LruHashMap::new();
