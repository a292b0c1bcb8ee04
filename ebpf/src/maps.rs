//! The data path's maps. Each static has the name of its shape in
//! `vmpath_common::maps` (and of its name in `map_names`, which the
//! `btf_map` literal repeats: the macro takes only a literal; a test of the
//! agent checks the built object against the shapes). The agent pins each
//! by that name and `bpftool map dump pinned` prints their BTF fields.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, XskMap},
    macros::btf_map,
};
use vmpath_common::{
    AddrInfo, AddrKey, Endpoint, EndpointKey, FloodList, LearnedIp, LearnedMac, MeterBucket,
    MonitorConfig, MonitorEvent, NetworkInfo, PortInfo, PortStats, SlowLimits, SlowMeter, SlowPath,
    maps,
};

/// `vmpath monitor`'s events (`MonitorEvent`), while someone listens.
#[btf_map(name = "vmp_monitor")]
pub static MONITOR: RingBuf<MonitorEvent, { maps::MONITOR.max_entries as usize }> = RingBuf::new();

/// Slot 0: monitor listeners and event rate (`MonitorConfig`).
#[btf_map(name = "vmp_monitor_cfg")]
pub static MONITOR_CFG: Array<MonitorConfig, { maps::MONITOR_CFG.max_entries as usize }> =
    Array::new();

/// Slot 0: the monitor's event-rate bucket, per CPU.
#[btf_map(name = "vmp_monitor_meter")]
pub static MONITOR_METER: PerCpuArray<MeterBucket, { maps::MONITOR_METER.max_entries as usize }> =
    PerCpuArray::new();

/// Slot 0: which debug events are on (`debug_events` bits).
#[btf_map(name = "vmp_debug")]
pub static DEBUG: Array<u32, { maps::DEBUG.max_entries as usize }> = Array::new();

/// ifindex of a VM port (host side) -> the port.
#[btf_map(name = "vmp_ports")]
pub static PORTS: HashMap<u32, PortInfo, { maps::PORTS.max_entries as usize }> = HashMap::new();

/// (network, MAC) -> local port or remote node.
#[btf_map(name = "vmp_endpoints")]
pub static ENDPOINTS: HashMap<EndpointKey, Endpoint, { maps::ENDPOINTS.max_entries as usize }> =
    HashMap::new();

/// (network, IP) -> owning port; the IP spoof filter's allow list.
#[btf_map(name = "vmp_addresses")]
pub static ADDRESSES: HashMap<AddrKey, AddrInfo, { maps::ADDRESSES.max_entries as usize }> =
    HashMap::new();

/// network id -> gateway addresses and settings.
#[btf_map(name = "vmp_networks")]
pub static NETWORKS: HashMap<u32, NetworkInfo, { maps::NETWORKS.max_entries as usize }> =
    HashMap::new();

/// network id -> its local ports, for broadcast, multicast and unknown unicast.
#[btf_map(name = "vmp_flood")]
pub static FLOOD: HashMap<
    u32,
    FloodList,
    { maps::FLOOD.max_entries as usize },
    { vmpath_common::FLOOD_MAP_FLAGS },
> = HashMap::new();
const _: () = assert!(vmpath_common::FLOOD_MAP_FLAGS == BPF_F_NO_PREALLOC as usize);

/// Drop counters, one slot per `drop_reason`, per CPU.
#[btf_map(name = "vmp_drops")]
pub static DROPS: PerCpuArray<u64, { maps::DROPS.max_entries as usize }> = PerCpuArray::new();

/// Port id -> traffic counters of that port, per CPU. The agent zeroes a
/// slot when it gives its id to a port.
#[btf_map(name = "vmp_port_stats")]
pub static PORT_STATS: PerCpuArray<PortStats, { maps::PORT_STATS.max_entries as usize }> =
    PerCpuArray::new();

/// ifindex -> the MAC a VM was seen using, for ports whose MAC is not
/// given. Written once per port (BPF_NOEXIST); the agent adopts it.
#[btf_map(name = "vmp_learned_mac")]
pub static LEARNED_MACS: HashMap<u32, LearnedMac, { maps::LEARNED_MACS.max_entries as usize }> =
    HashMap::new();

/// (network, IP) -> the port using it, on networks without IP filtering.
#[btf_map(name = "vmp_learned_ips")]
pub static LEARNED_IPS: LruHashMap<AddrKey, LearnedIp, { maps::LEARNED_IPS.max_entries as usize }> =
    LruHashMap::new();

/// (network, IP) -> the last port that used an address another port holds
/// (`learn::ip`): the agent reports the conflict on both.
#[btf_map(name = "vmp_learn_conflicts")]
pub static LEARN_CONFLICTS: LruHashMap<
    AddrKey,
    LearnedIp,
    { maps::LEARN_CONFLICTS.max_entries as usize },
> = LruHashMap::new();

/// Port id (the slow path's VLAN tag) -> host-side ifindex of the port.
#[btf_map(name = "vmp_port_ids")]
pub static PORT_IDS: HashMap<u32, u32, { maps::PORT_IDS.max_entries as usize }> = HashMap::new();

/// Slot 0: the slow path's interfaces; ifindex 0 while it is not set up.
#[btf_map(name = "vmp_slow")]
pub static SLOW: Array<SlowPath, { maps::SLOW.max_entries as usize }> = Array::new();

/// Queue index -> the agent's AF_XDP socket on `vmp-slow1`.
#[btf_map(name = "vmp_xsks")]
pub static XSKS: XskMap<{ maps::XSKS.max_entries as usize }> = XskMap::new();

/// Port id -> the port's slow-path limits per class (set by the agent).
#[btf_map(name = "vmp_slow_limits")]
pub static SLOW_LIMITS: Array<SlowLimits, { maps::SLOW_LIMITS.max_entries as usize }> =
    Array::new();

/// Port id -> the port's slow-path token buckets, per CPU (`meter`).
#[btf_map(name = "vmp_slow_meter")]
pub static SLOW_METER: PerCpuArray<SlowMeter, { maps::SLOW_METER.max_entries as usize }> =
    PerCpuArray::new();

/// Host-side ifindex of a port XDP_REDIRECT can deliver to -> its port id.
#[btf_map(name = "vmp_xdp_ports")]
pub static XDP_PORTS: HashMap<u32, u32, { maps::XDP_PORTS.max_entries as usize }> = HashMap::new();

/// What `uplink_xdp` did, per CPU (`xdp_stat` slots).
#[btf_map(name = "vmp_uplink_xdp")]
pub static UPLINK_XDP_STATS: PerCpuArray<u64, { maps::UPLINK_XDP_STATS.max_entries as usize }> =
    PerCpuArray::new();
