//! Map keys, values and constants shared by the eBPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding so the kernel and
//! userspace agree byte for byte; sizes are asserted at compile time.
//! Enums that cross into the kernel are plain integers.
#![no_std]

use core::mem::size_of;

mod contract;
pub use contract::*;
pub mod version_stamp;

/// Map names as the kernel (and `bpftool`) sees them; also the pin file names.
/// Each map's whole shape is in `maps` (same constant name).
pub mod map_names {
    pub const PORTS: &str = "vmp_ports";
    pub const ENDPOINTS: &str = "vmp_endpoints";
    pub const ADDRESSES: &str = "vmp_addresses";
    pub const NETWORKS: &str = "vmp_networks";
    pub const FLOOD: &str = "vmp_flood";
    pub const DROPS: &str = "vmp_drops";
    pub const PORT_STATS: &str = "vmp_port_stats";
    pub const LEARNED_MACS: &str = "vmp_learned_mac";
    pub const LEARNED_IPS: &str = "vmp_learned_ips";
    pub const LEARN_CONFLICTS: &str = "vmp_learn_conflicts";
    /// North-south: VM addresses reachable un-NATed from the fabric.
    pub const ROUTED: &str = "vmp_routed";
    /// North-south: each network's subnets (LPM), for the egress source check.
    pub const SUBNETS4: &str = "vmp_subnets4";
    pub const SUBNETS6: &str = "vmp_subnets6";
    /// North-south: the node's SNAT settings (one slot).
    pub const SNAT_CONFIG: &str = "vmp_snat_cfg";
    /// North-south: SNAT flows, VM side -> translation and back.
    pub const SNAT_OUT: &str = "vmp_snat_out";
    pub const SNAT_IN: &str = "vmp_snat_in";
    /// North-south: SNAT ports in use per VM address (quota).
    pub const SNAT_QUOTA: &str = "vmp_snat_quota";
    /// Flows opened from outside to VMs on SNAT networks (`InboundFlow`).
    pub const INBOUND: &str = "vmp_inbound";
    /// North-south, IPv6: SNAT flows both ways, ports per VM address, and
    /// flows opened from outside (the IPv4 maps' twins).
    pub const SNAT6_OUT: &str = "vmp_snat6_out";
    pub const SNAT6_IN: &str = "vmp_snat6_in";
    pub const SNAT6_QUOTA: &str = "vmp_snat6_quota";
    pub const INBOUND6: &str = "vmp_inbound6";
    /// Tail-call targets (slots: `tail_call`).
    pub const PROGS: &str = "vmp_progs";
    /// Overlay: per network, the remote nodes (VTEPs) that host it.
    pub const FLOOD_REMOTE: &str = "vmp_flood_remote";
    /// Overlay: the vxlan device and local VTEP address (one slot).
    pub const OVERLAY: &str = "vmp_overlay";
    /// Overlay: frames sent to and received from remote nodes (per CPU).
    pub const OVERLAY_STATS: &str = "vmp_overlay_stats";
    /// Overlay: MACs of remote VMs learned from decapsulated frames (VXLAN
    /// source learning), (network, MAC) -> the node's VTEP.
    pub const REMOTE_LEARNED: &str = "vmp_remote_learned";
    /// Overlay on an IPv6 underlay: a node's VTEP handle -> its IPv6
    /// address (the tunnel key's remote).
    pub const VTEP6: &str = "vmp_vtep6";
    /// Overlay on an IPv6 underlay: a node's IPv6 address -> its VTEP
    /// handle (who sent a decapsulated frame; a miss is not a VTEP).
    pub const VTEP6_IDS: &str = "vmp_vtep6_ids";
    /// Reach: every other node's 4-byte VTEP value, the only senders of
    /// `REACH_VNI` frames this node takes.
    pub const REACH_NODES: &str = "vmp_reach_nodes";
    /// Live migration: target ports whose VM spoke (set by `vm_migrate`),
    /// polled by the agent to finish the cut-over.
    pub const MIGRATED: &str = "vmp_migrated";
    pub const PORT_IDS: &str = "vmp_port_ids";
    pub const SLOW: &str = "vmp_slow";
    pub const XSKS: &str = "vmp_xsks";
    /// Slow-path token bucket settings per port id (`SlowLimits`).
    pub const SLOW_LIMITS: &str = "vmp_slow_limits";
    /// Slow-path token bucket state per port id, per CPU (`SlowMeter`).
    pub const SLOW_METER: &str = "vmp_slow_meter";
    /// Which data-path debug events are on (one slot, `debug_events` bits).
    pub const DEBUG: &str = "vmp_debug";
    /// aya-log's ring buffer of debug events: one per loaded object, read
    /// by the agent that loaded it, never pinned.
    pub const DEBUG_LOG: &str = "AYA_LOGS";
    /// `vmpath monitor`: drop events (`MonitorEvent`), a ring buffer.
    pub const MONITOR: &str = "vmp_monitor";
    /// `vmpath monitor`: listeners and the event rate (`MonitorConfig`).
    pub const MONITOR_CFG: &str = "vmp_monitor_cfg";
    /// `vmpath monitor`: the event rate's token bucket, per CPU.
    pub const MONITOR_METER: &str = "vmp_monitor_meter";
    /// NetworkPolicy: per port id, isolation and identity (`PolicyEndpoint`).
    pub const POLICY_ENDPOINTS: &str = "vmp_pol_ep";
    /// NetworkPolicy: (network, address prefix) -> identity (LPM).
    pub const POLICY_IPCACHE: &str = "vmp_pol_ipcache";
    /// NetworkPolicy: what each endpoint allows (LPM, `PolicyRuleKey`).
    pub const POLICY_RULES: &str = "vmp_pol_rules";
    /// NetworkPolicy: flows allowed, for their later packets and replies.
    pub const POLICY_FLOWS: &str = "vmp_pol_flows";
    /// NetworkPolicy: allowed flows and denied packets per port id.
    pub const POLICY_STATS: &str = "vmp_pol_stats";
    /// NetworkPolicy: flows each policy allowed, per policy index.
    pub const POLICY_HITS: &str = "vmp_pol_hits";
    /// NetworkPolicy: per-CPU scratch space for a packet's flow key.
    pub const POLICY_SCRATCH: &str = "vmp_pol_scratch";
    /// NetworkPolicy: per network, the local ports IP floods may reach
    /// (those not isolated for ingress); absent: all of `vmp_flood`.
    pub const POLICY_FLOOD: &str = "vmp_pol_flood";
    /// Reach: flows other nodes' stacks opened to a local endpoint of a
    /// Primary network, keyed as the endpoint answers (LRU).
    pub const REACH_FLOWS: &str = "vmp_reach_flows";
    /// Services: (network, ClusterIP, port, protocol) -> Service port.
    pub const SERVICES: &str = "vmp_svc";
    /// Services: (Service port id, slot) -> ready backend.
    pub const SERVICE_BACKENDS: &str = "vmp_svc_backends";
    /// Services: translated flows, both directions (LRU).
    pub const SERVICE_FLOWS: &str = "vmp_svc_flows";
    /// Services: `sessionAffinity: ClientIP` clients (LRU).
    pub const SERVICE_AFFINITY: &str = "vmp_svc_affinity";
    /// Services: slot 0 holds how many Service ports there are (0: the
    /// data path looks nothing up).
    pub const SERVICE_CONFIG: &str = "vmp_svc_cfg";
    /// Services: new flows and rejects per port id.
    pub const SERVICE_STATS: &str = "vmp_svc_stats";
    /// Services, IPv6: (network, ClusterIP, port, protocol) -> Service port.
    pub const SERVICES6: &str = "vmp_svc6";
    /// Services, IPv6: (Service port id, slot) -> ready backend.
    pub const SERVICE6_BACKENDS: &str = "vmp_svc6_backend";
    /// Services, IPv6: translated flows, both directions (LRU).
    pub const SERVICE6_FLOWS: &str = "vmp_svc6_flows";
    /// Services, IPv6: `sessionAffinity: ClientIP` clients (LRU).
    pub const SERVICE6_AFFINITY: &str = "vmp_svc6_sticky";
    /// Services, IPv6: per-CPU scratch space for a flow's key and value.
    pub const SERVICE6_SCRATCH: &str = "vmp_svc6_scratch";
    /// Uplink XDP: ifindex of a VM port XDP_REDIRECT delivers to (its
    /// device takes `ndo_xdp_xmit`) -> the port's id.
    pub const XDP_PORTS: &str = "vmp_xdp_ports";
    /// Uplink XDP: frames it delivered and passed on (`xdp_stat` slots).
    pub const UPLINK_XDP_STATS: &str = "vmp_uplink_xdp";
    pub const HOPS4: &str = "vmp_hops4";
    pub const SNAT_FRAGS: &str = "vmp_snat_frags";
    /// SNAT, IPv6: datagrams whose first fragment was translated back to
    /// a VM (the IPv4 `vmp_snat_frags`' twin, one way so far).
    pub const SNAT6_FRAGS: &str = "vmp_snat6_frags";
    /// NetworkPolicy: the ports of datagrams whose first fragment policy
    /// saw, so their later fragments are judged as it was.
    pub const POLICY_FRAGS: &str = "vmp_pol_frags";
    pub const HOPS6: &str = "vmp_hops6";
    /// Neighbour resolution over the overlay: the subnets of this node's
    /// learning ingress networks (LPM, address -> network id).
    pub const RESOLVE_PREFIXES: &str = "vmp_resolve_prefixes";
    /// Neighbour resolution over the overlay: (network, IP) -> the node
    /// and MAC that answered (`ResolvedAddr`).
    pub const RESOLVED: &str = "vmp_resolved";
    /// Neighbour resolution over the overlay: the node's budget of
    /// requests (one token bucket per CPU).
    pub const RESOLVE_METER: &str = "vmp_resolve_meter";
}

/// Slots of `vmp_uplink_xdp` (per CPU): what the uplink's XDP program did.
pub mod xdp_stat {
    /// Routed ingress (IPv4) delivered to a local port by XDP_REDIRECT.
    pub const ROUTED4: u32 = 0;
    /// Routed ingress (IPv6) delivered to a local port by XDP_REDIRECT.
    pub const ROUTED6: u32 = 1;
    /// SNAT return (IPv4) reverse-translated and delivered by XDP_REDIRECT.
    pub const SNAT4: u32 = 2;
    /// IPv4 / IPv6 frames passed to the tc program (not a fast case).
    pub const PASSED: u32 = 3;
    pub const COUNT: u32 = 4;
    pub const NAMES: [&str; COUNT as usize] = ["routed4", "routed6", "snat4", "passed"];
}

/// What a `MonitorEvent` reports.
pub mod monitor_kind {
    /// A dropped frame; `reason` is a `drop_reason`.
    pub const DROP: u8 = 1;
    /// A NetworkPolicy verdict on a new flow (`reason` 0: allowed, else
    /// the `drop_reason`); `direction` and `policy` say which.
    pub const POLICY: u8 = 2;
}

/// Bits of `vmp_debug[0]`: which debug events the data path emits through
/// aya-log. All off by default; `vmpath debug datapath` switches them at
/// run time. Off, each event site costs one array lookup.
pub mod debug_events {
    /// Every drop: its reason and port id.
    pub const DROPS: u32 = 1 << 0;
    /// Data-path decisions worth a line: a migration cut-over, a MAC
    /// learned from a VM's traffic.
    pub const DECISIONS: u32 = 1 << 1;
    pub const ALL: u32 = DROPS | DECISIONS;
}

/// Program names (the Rust function names in the eBPF crate).
pub mod prog_names {
    pub const VM_PORT: &str = "vm_port";
    /// tcx egress on a VM port: what the node's stack sends down the port
    /// (kubelet, kube-proxy, routed cluster pods) meets the endpoint's
    /// ingress policy; the data path's own frames pass (`DATA_PATH_MARK`).
    pub const VM_FROM_STACK: &str = "vm_from_stack";
    /// tcx ingress on the node's uplink: routed ingress and SNAT return.
    pub const UPLINK: &str = "uplink";
    /// Tail-called from `vm_port`: routed and SNAT egress.
    pub const VM_EGRESS: &str = "vm_egress";
    /// XDP on `vmp-slow1`: slow-path frames into the AF_XDP socket.
    pub const SLOW_RX: &str = "slow_rx";
    /// tcx ingress on `vmp-slow0`: the agent's tagged replies out to the VM.
    pub const SLOW_RETURN: &str = "slow_return";
    /// Tail-called from `vm_port` on a pending migration target port: marks
    /// the VM local, then re-enters `vm_port`.
    pub const VM_MIGRATE: &str = "vm_migrate";
    /// Tail-called from `vm_port`: unicast to a remote node and the remote
    /// copies of a flood, through the vxlan device.
    pub const VM_REMOTE: &str = "vm_remote";
    /// tcx ingress on the vxlan device: decapsulated frames from remote nodes.
    pub const VXLAN_RX: &str = "vxlan_rx";
    /// Tail-called from `vm_port`: egress NetworkPolicy, then back.
    pub const VM_POLICY_OUT: &str = "vm_policy_out";
    /// Tail-called where a frame is delivered to a local port isolated by
    /// NetworkPolicy: ingress policy, then the delivery.
    pub const VM_POLICY_IN: &str = "vm_policy_in";
    /// Tail-called from `vm_port`: ClusterIP translation, then back.
    pub const VM_SERVICE: &str = "vm_service";
    /// Services: reverse translation of a reply, then the delivery.
    pub const VM_SERVICE_IN: &str = "vm_service_in";
    /// Tail-called from `vm_port`: IPv6 ClusterIP translation, then back.
    pub const VM_SERVICE6: &str = "vm_service6";
    /// Tail-called from `vm_egress`: SNAT of an IPv6 frame from a VM with
    /// extension headers (fragments: first and later), then routed on.
    pub const VM_SNAT6_EXT: &str = "vm_snat6_ext";
    /// Tail-called from `vm_port`: ARP and neighbour solicitation for a
    /// known endpoint answered at the asking port, others switched.
    pub const VM_NEIGH: &str = "vm_neigh";
    /// Tail-called wherever a frame floods (`vm_port`, `vm_neigh`,
    /// `vxlan_rx`): a copy to each member of the network, local ports and
    /// (from a VM port) other nodes, walked with `bpf_loop`.
    pub const VM_FLOOD: &str = "vm_flood";
    /// Native XDP on the node's uplink: the fast cases of routed ingress
    /// and SNAT return; everything else passes to `uplink` (tc).
    pub const UPLINK_XDP: &str = "uplink_xdp";
    /// Tail call from `uplink`: neighbour resolution over the overlay.
    pub const UPLINK_RESOLVE: &str = "uplink_resolve";
    /// Tail call from `vxlan_rx`: resolution requests and answers.
    pub const VXLAN_RESOLVE: &str = "vxlan_resolve";
    /// tcx egress on the vxlan device: what the node's stack routes to a
    /// Primary network's endpoint on another node, over the overlay.
    pub const VXLAN_FROM_STACK: &str = "vxlan_from_stack";
    /// Tail call from `vxlan_rx` for `REACH_VNI`: another node's stack to
    /// a local endpoint, and an endpoint's answers to this node's stack.
    pub const VXLAN_REACH: &str = "vxlan_reach";

    /// The programs every VM port runs, each through its own pinned tcx
    /// link named `<program>-<ifindex>`: `vm_port` at ingress,
    /// `vm_from_stack` at egress.
    pub const PORT_PROGRAMS: [&str; 2] = [VM_PORT, VM_FROM_STACK];

    /// The port's ifindex in a link pin's name (`<program>-<ifindex>` of
    /// `PORT_PROGRAMS`), if it is one.
    pub fn port_pin_ifindex(name: &str) -> Option<u32> {
        PORT_PROGRAMS.iter().find_map(|prog| {
            name.strip_prefix(prog)
                .and_then(|s| s.strip_prefix('-'))
                .and_then(|s| s.parse().ok())
        })
    }
}

/// Layout version of the pinned maps. Bump when any type below changes size
/// or meaning; pins live under `maps/v{MAP_LAYOUT_VERSION}`.
pub const MAP_LAYOUT_VERSION: u32 = 3;
// v2: per-port counters in a per-CPU array indexed by port id (no hash
// lookup per frame); PortInfo caches the gateway MAC and first IPv4/IPv6;
// every entry that delivers to a port carries its port id.
// v3: flood lists sized for clusters (`MAX_FLOOD_PORTS`, `MAX_FLOOD_NODES`),
// allocated per network that has one (`FLOOD_MAP_FLAGS`).

pub const MAX_PORTS: u32 = 4096;
/// Default sizes of the cluster-sized maps (`--max-endpoints`,
/// `--max-addresses`, set at start): 250,000 endpoints and addresses
/// cluster-wide fit without a flag. Preallocated, about 27 MB and 29 MB
/// of kernel memory per node at this size (docs/config.md, Limits).
pub const MAX_ENDPOINTS: u32 = 262_144;
pub const MAX_ADDRESSES: u32 = 262_144;
pub const MAX_NETWORKS: u32 = 4096;
pub const MAX_LEARNED_IPS: u32 = 65536;
/// Local ports one network can flood to on one node. The data path walks
/// a list with `bpf_loop`, so its cost is the members a flood reaches, not
/// this width; the width costs memory only (8 bytes a port in each of
/// `vmp_flood` and `vmp_pol_flood`, per network with local ports).
pub const MAX_FLOOD_PORTS: usize = 1024;
/// Map flags of the flood lists (`vmp_flood`, `vmp_pol_flood`,
/// `vmp_flood_remote`): `BPF_F_NO_PREALLOC`, so an entry's memory is taken
/// when a network gets one, not for every possible network at start.
pub const FLOOD_MAP_FLAGS: usize = 1;

/// Port flags (`PortInfo::flags`).
pub const PORT_F_MAC_FILTER: u16 = 1 << 0;
pub const PORT_F_IP_FILTER: u16 = 1 << 1;
/// The port's MAC is known (given or detected); without it the MAC filter
/// cannot apply yet.
pub const PORT_F_MAC_KNOWN: u16 = 1 << 2;
/// Live migration: this port is the target of a pending migration. The VM
/// is not active here yet; the first frame from its MAC on this port makes
/// it so (`vm_migrate`) without waiting for the agent.
pub const PORT_F_PENDING: u16 = 1 << 3;
/// The port's network is served by vmpath (`NET_F_DHCP`): DHCP, DHCPv6
/// and router solicitations go to the slow path.
pub const PORT_F_DHCP: u16 = 1 << 4;
/// DHCPv4/DHCPv6 server traffic from this port is dropped
/// (`DHCP_SPOOF`): set where vmpath serves DHCP, or where the network's
/// `portSecurity.dhcpGuard` says so.
pub const PORT_F_DHCP_GUARD: u16 = 1 << 5;

/// A VM port: the host side of a VM pod's veth. Keyed by ifindex.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortInfo {
    /// Small per-node id of the port (stable while the attachment exists).
    pub port_id: u32,
    /// Network id (also the VNI).
    pub network: u32,
    pub mac: [u8; 6],
    pub flags: u16,
    /// The network's gateway MAC (as in `NetworkInfo`): switched or routed
    /// is decided without looking the network up.
    pub gw_mac: [u8; 6],
    pub _pad: u16,
    /// The port's first IPv4 address (zero: none). The spoof filter's
    /// common case needs no address lookup; others are in `vmp_addresses`.
    pub ip4: [u8; 4],
    /// The port's first IPv6 address (zero: none), cached the same way.
    pub ip6: [u8; 16],
}
const _: () = assert!(size_of::<PortInfo>() == 44);

/// Port id 0 is never assigned: counters of "no port" are not kept.
pub const NO_PORT_ID: u32 = 0;

/// (network, MAC) -> where that MAC lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    pub network: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<EndpointKey>() == 12);

pub const ENDPOINT_LOCAL: u32 = 1;
pub const ENDPOINT_REMOTE: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    /// `ENDPOINT_LOCAL` or `ENDPOINT_REMOTE`.
    pub kind: u32,
    /// Host-side ifindex of a local port.
    pub ifindex: u32,
    /// VTEP address of the remote node (IPv4, network order).
    pub node_ip4: [u8; 4],
    /// Live migration: the VTEP address of the node the VM is migrating to
    /// (zero: none). A frame from this MAC arriving over the overlay from
    /// that node repoints the entry there at once, before any agent hears
    /// of the cut-over. (Was padding: zero keeps the old meaning.)
    pub migrate_to: [u8; 4],
    /// Port id of a local port (its counters' slot).
    pub port_id: u32,
    /// A remote endpoint's NetworkPolicy identity (`vmp_pol_ipcache`'s
    /// numbers): what a frame from this MAC arriving from `node_ip4` over
    /// the overlay carries, whatever source address it writes (0: none
    /// known, such frames are `identity::WORLD`). Unused for local ports,
    /// whose identity is their port's (`vmp_pol_ep`).
    pub identity: u32,
}
const _: () = assert!(size_of::<Endpoint>() == 24);

/// (network, IP) -> owning attachment. IPv4 addresses use the first 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    pub network: u32,
    /// `addr_family::IPV4` or `addr_family::IPV6` (build keys with
    /// `AddrKey::v4` / `AddrKey::v6`).
    pub family: u8,
    pub _pad: [u8; 3],
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<AddrKey>() == 24);

/// Where an address came from (`AddrInfo::origin`).
pub const ADDR_STATIC: u32 = 1;
pub const ADDR_CLAIMED: u32 = 2;
pub const ADDR_LEARNED: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AddrInfo {
    /// Host-side ifindex of the port that owns the address (0: remote).
    pub ifindex: u32,
    pub origin: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// Port id of that port.
    pub port_id: u32,
    /// An address on another node (`ifindex` 0): that node's 4-byte VTEP
    /// value (as `Endpoint::node_ip4`), where what the node's stack sends
    /// the address goes (`reach`) when its MAC is not known here; zero:
    /// local, or no node known.
    pub node_ip4: [u8; 4],
}
const _: () = assert!(size_of::<AddrInfo>() == 24);

/// Network flags (`NetworkInfo::flags`).
pub const NET_F_GW4: u16 = 1 << 0;
pub const NET_F_GW6: u16 = 1 << 1;
/// vmpath serves DHCPv4/DHCPv6/RA on this network (its addresses come from
/// vmpath); otherwise those frames are switched like any other.
pub const NET_F_DHCP: u16 = 1 << 2;
/// `egress: Routed`: un-NATed egress through the node, and routed ingress.
pub const NET_F_ROUTED: u16 = 1 << 3;
/// `egress: SNAT`: egress translated to the node's SNAT address.
pub const NET_F_SNAT: u16 = 1 << 4;
/// The network's ports filter source IPs: frames from its VMs on other
/// nodes get the same neighbour discovery checks when they arrive over
/// the overlay.
pub const NET_F_IP_FILTER: u16 = 1 << 5;
/// `egress: SNAT` with `advertise`: the fabric reaches the VMs by their
/// own addresses (routed ingress), so the SNAT path first asks whether a
/// frame is the reply of a flow opened from outside (`vmp_inbound`); those
/// leave un-NATed.
pub const NET_F_INGRESS: u16 = 1 << 6;
/// `role: Primary`: the node reaches the network's endpoints, so frames
/// from them to the node's own addresses go up the node's stack.
pub const NET_F_HOST_REACH: u16 = 1 << 7;

/// The network key, in `vmp_subnets4` / `vmp_subnets6`, of the cluster's
/// own address spaces: its Service and pod CIDRs and its nodes' addresses.
/// Frames from an endpoint of a `NET_F_HOST_REACH` network to these go up
/// the node's stack (kube-proxy's translation, the node's routes to other
/// nodes' pods) instead of the data path's routed or SNAT egress. Outside
/// the networks' ids (1..=2^24-1), so it never meets a real network.
pub const CLUSTER_NETWORK: u32 = u32::MAX;

/// The slow path's interfaces (`vmp_slow`, one slot).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlowPath {
    /// `vmp-slow0`: VM ports redirect slow-path frames out of it.
    pub ifindex: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<SlowPath>() == 8);

/// The slow path tags frames with the port id in a VLAN header: 12 bits.
pub const MAX_PORT_ID: u32 = 4094;
pub const SLOW0: &str = "vmp-slow0";
pub const SLOW1: &str = "vmp-slow1";

/// What a port may send to the slow path, by protocol class: the frames
/// the data path hands to the agent are metered per port so one VM cannot
/// starve the others' DHCP and RAs.
pub mod slow_class {
    pub const DHCP4: usize = 0;
    pub const DHCP6: usize = 1;
    /// IPv6 router solicitations.
    pub const RS: usize = 2;
    pub const COUNT: usize = 3;
    /// Names as shown in metrics and the CLI, indexed by class.
    pub const NAMES: [&str; COUNT] = ["dhcp4", "dhcp6", "router_solicit"];
}

/// One token bucket's settings, kept in time so the data path needs no
/// division: a frame costs `cost_ns` of credit, credit accrues one per
/// nanosecond up to `cap_ns` (the burst). All zero: unlimited.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeterLimit {
    pub cost_ns: u64,
    pub cap_ns: u64,
}
const _: () = assert!(size_of::<MeterLimit>() == 16);

impl MeterLimit {
    /// `rate` frames per second on average, `burst` at once (both >= 1).
    pub const fn new(rate: u32, burst: u32) -> Self {
        let rate = if rate == 0 { 1 } else { rate };
        let cost_ns = 1_000_000_000 / rate as u64;
        MeterLimit {
            cost_ns,
            cap_ns: cost_ns * burst as u64,
        }
    }
}

/// A port's slow-path limits (`vmp_slow_limits`, indexed by port id),
/// written by the agent from its network's settings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlowLimits {
    pub class: [MeterLimit; slow_class::COUNT],
}
const _: () = assert!(size_of::<SlowLimits>() == 48);

/// One token bucket's state (per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeterBucket {
    /// Credit left, in nanoseconds (at most the limit's `cap_ns`).
    pub credit_ns: u64,
    /// bpf_ktime_get_ns of the last frame metered (0: never, full bucket).
    pub last_ns: u64,
    /// Frames dropped over the rate.
    pub limited: u64,
}
const _: () = assert!(size_of::<MeterBucket>() == 24);

/// A port's slow-path buckets (`vmp_slow_meter`, per CPU, indexed by port
/// id). The agent zeroes a slot when it gives its id to a port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlowMeter {
    pub class: [MeterBucket; slow_class::COUNT],
}
const _: () = assert!(size_of::<SlowMeter>() == 72);

/// `vmp_monitor_cfg[0]`: whether anyone listens and how many events per
/// second the data path may emit (per CPU). Written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorConfig {
    /// Monitor clients connected; 0: the data path emits nothing.
    pub listeners: u32,
    pub _pad: u32,
    pub limit: MeterLimit,
}
const _: () = assert!(size_of::<MonitorConfig>() == 24);

/// One event of `vmpath monitor` (`vmp_monitor`): what died, where, why.
/// Addresses are IPv4 in the first 4 bytes or IPv6; `family` 0 when the
/// frame carried no IP (ARP, other ethertypes, too short to read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonitorEvent {
    pub ktime_ns: u64,
    /// `monitor_kind`.
    pub kind: u8,
    /// `addr_family` tag, or 0.
    pub family: u8,
    /// IP protocol (`ip_proto`), or 0.
    pub proto: u8,
    /// `POLICY` events: `policy_dir`; 0 otherwise.
    pub direction: u8,
    /// `drop_reason`.
    pub reason: u32,
    /// Where the frame was seen (the hook's interface).
    pub ifindex: u32,
    /// The port's id, or `NO_PORT_ID`.
    pub port_id: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// TCP/UDP ports, host order; 0 otherwise.
    pub sport: u16,
    pub dport: u16,
    pub ether_type: u16,
    pub _pad2: u16,
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    /// `POLICY` events: the allowing policy's index (`POLICY_NONE`: none).
    pub policy: u32,
}
const _: () = assert!(size_of::<MonitorEvent>() == 80);

/// Per-network settings the data path needs, keyed by network id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetworkInfo {
    pub gw_mac: [u8; 6],
    pub flags: u16,
    pub gw_ip4: [u8; 4],
    pub mtu: u16,
    pub _pad: u16,
    pub gw_ip6: [u8; 16],
    /// The gateway's link-local address (EUI-64 of `gw_mac`), the same on
    /// every node.
    pub gw_ll6: [u8; 16],
}
const _: () = assert!(size_of::<NetworkInfo>() == 48);

/// The local ports of one network, for broadcast, multicast and unknown
/// unicast. Keyed by network id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloodList {
    pub count: u32,
    /// `vmp_pol_flood` lists: how many of the network's ports, isolated
    /// for ingress, the list leaves out. An IP flood is withheld from
    /// each, and each withholding is a drop counted as
    /// `policy_denied_ingress` (0 in `vmp_flood` lists).
    pub withheld: u32,
    pub ifindex: [u32; MAX_FLOOD_PORTS],
    /// Port id of each port in `ifindex` (its counters' slot).
    pub port_id: [u32; MAX_FLOOD_PORTS],
}
const _: () = assert!(size_of::<FloodList>() == 8 + 8 * MAX_FLOOD_PORTS);

impl Default for FloodList {
    fn default() -> Self {
        Self {
            count: 0,
            withheld: 0,
            ifindex: [0; MAX_FLOOD_PORTS],
            port_id: [0; MAX_FLOOD_PORTS],
        }
    }
}

/// How the data path learned a MAC or an IP (`Learned*::how`).
pub const LEARNED_FROM_ARP: u32 = 1;
pub const LEARNED_FROM_IPV4: u32 = 2;
pub const LEARNED_FROM_IPV6: u32 = 3;
pub const LEARNED_FROM_DHCP: u32 = 4;

/// A VM's MAC seen in its own traffic on a port whose MAC is not known yet.
/// Keyed by the port's ifindex; the agent adopts it and sets the port MAC.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedMac {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// `LEARNED_FROM_*`.
    pub how: u32,
    pub _pad2: u32,
}
const _: () = assert!(size_of::<LearnedMac>() == 16);

/// An address a VM uses on a network without IP filtering, keyed by
/// (network, IP) in an LRU map. A guest's claim, not a fact: the agent
/// decides what of it is routed, advertised or shown (`learned` stage).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedIp {
    pub ifindex: u32,
    pub how: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// When the holder last used it (flow clock, ns since boot), renewed at
    /// most every `LEARN_TOUCH_NS`. Another port cannot take the address
    /// while this is younger than `LEARN_HOLD_NS`.
    pub seen: u64,
}
const _: () = assert!(size_of::<LearnedIp>() == 24);
const _: () = assert!(core::mem::offset_of!(LearnedIp, seen) == 16);

/// A learned entry's `seen` is renewed at most this often.
pub const LEARN_TOUCH_NS: u64 = 1_000_000_000;
/// How long a learned address stays its first holder's after the holder
/// last used it: within it another port's use is a conflict
/// (`vmp_learn_conflicts`), after it the address may move (a VM
/// renumbered, or moved to another port). The agent expires addresses
/// unheard for its `--learned-expiry` (longer), with their routes.
pub const LEARN_HOLD_NS: u64 = 60_000_000_000;
/// Most recent conflicts kept for the agent to report.
pub const MAX_LEARN_CONFLICTS: u32 = 4096;

/// Per-port traffic counters (per CPU). `rx` is what the VM sent into the
/// data path, `tx` what the data path delivered to the VM.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub drops: u64,
    /// ARP/ND/ICMP answered in place by the gateway.
    pub gw_replies: u64,
}
const _: () = assert!(size_of::<PortStats>() == 48);

impl PortStats {
    /// Adds another CPU's counters (userspace sums per-CPU values).
    pub fn add(&mut self, other: &PortStats) {
        self.rx_packets += other.rx_packets;
        self.rx_bytes += other.rx_bytes;
        self.tx_packets += other.tx_packets;
        self.tx_bytes += other.tx_bytes;
        self.drops += other.drops;
        self.gw_replies += other.gw_replies;
    }
}

/// Why the data path dropped a frame: the index into the `vmp_drops` per-CPU
/// array. Plain integers so they cross into the kernel unchanged. Each
/// reason is declared once, below: its constant, its number (an index into
/// counters pinned across upgrades, so never reused or moved) and its name
/// as metrics, the API and the CLI show it; `NAMES` and `TABLE` are
/// generated from the same lines.
pub mod drop_reason {
    /// Declares the reasons: `CONSTANT = number => "name"`, numbered from 0
    /// without gaps (checked at compile time).
    macro_rules! reasons {
        ($($(#[$doc:meta])* $constant:ident = $value:literal => $name:literal,)*) => {
            $($(#[$doc])* pub const $constant: u32 = $value;)*
            pub const COUNT: u32 = [$($value),*].len() as u32;
            /// Names as shown in metrics and the CLI, indexed by reason.
            pub const NAMES: [&str; COUNT as usize] = [$($name),*];
            /// Every reason as declared: `(number, constant, name)`.
            pub const TABLE: [(u32, &str, &str); COUNT as usize] =
                [$(($value, stringify!($constant), $name)),*];
        };
    }

    reasons! {
        /// Truncated or malformed header.
        MALFORMED = 0 => "malformed",
        /// The frame arrived on an interface that is not (or no longer) a port.
        UNKNOWN_PORT = 1 => "unknown_port",
        /// Ethernet source MAC is not the port's MAC.
        MAC_SPOOF = 2 => "mac_spoof",
        /// IPv4/IPv6 source address is not one of the port's addresses.
        IP_SPOOF = 3 => "ip_spoof",
        /// ARP sender MAC or sender IP is not the port's.
        ARP_SPOOF = 4 => "arp_spoof",
        /// Ethertype not allowed while IP filtering is on (VLAN tags, ...).
        ETHERTYPE = 5 => "ethertype",
        /// Nowhere to deliver: no other port in the network.
        NO_DESTINATION = 6 => "no_destination",
        /// Sent to the gateway MAC but not something the gateway answers, and
        /// the network has no routed or SNAT egress.
        GATEWAY_UNROUTED = 7 => "gateway_unrouted",
        /// The port's network is not programmed.
        NO_NETWORK = 8 => "no_network",
        /// Source MAC is multicast/broadcast.
        SRC_MULTICAST = 9 => "src_multicast",
        /// A kernel helper refused (redirect, resize).
        HELPER_FAILED = 10 => "helper_failed",
        /// DHCP/RS for the slow path, but no slow path interface is set up.
        SLOWPATH_DOWN = 11 => "slowpath_down",
        /// The slow path's XDP program had no AF_XDP socket to hand a frame to
        /// (the agent is not running).
        SLOWPATH_NO_LISTENER = 12 => "slowpath_no_listener",
        /// A slow path reply tagged with a port id that is not a port.
        SLOWPATH_BAD_TAG = 13 => "slowpath_bad_tag",
        /// Routed egress from a source address outside the network's subnets.
        ROUTE_SRC_OUTSIDE = 14 => "route_src_outside",
        /// Routed: TTL / hop limit would reach zero (answered with ICMP
        /// time-exceeded from the gateway unless the frame is an ICMP error).
        ROUTE_TTL_EXCEEDED = 15 => "route_ttl_exceeded",
        /// Routed: the node has no route (or no forwarding) for the destination.
        ROUTE_NO_ROUTE = 16 => "route_no_route",
        /// Routed or SNAT: larger than the MTU; an ICMP fragmentation-needed /
        /// packet-too-big went back to the sender instead.
        MTU_EXCEEDED = 17 => "mtu_exceeded",
        /// SNAT: no free port / ICMP id in the node's range for this flow.
        SNAT_PORTS_EXHAUSTED = 18 => "snat_ports_exhausted",
        /// SNAT: the VM has used up its port quota.
        SNAT_QUOTA = 19 => "snat_quota",
        /// SNAT: the flow table refused an entry (table pressure).
        SNAT_TABLE_FULL = 20 => "snat_table_full",
        /// SNAT: a protocol SNAT cannot translate.
        SNAT_UNSUPPORTED = 21 => "snat_unsupported",
        /// SNAT: the node has no SNAT address programmed.
        SNAT_NO_ADDRESS = 22 => "snat_no_address",
        /// A VM sent a router advertisement, a redirect, or a neighbour
        /// advertisement for the gateway's address (IP filter on).
        ND_SPOOF = 23 => "nd_spoof",
        /// Routed or SNAT: IPv4 larger than the MTU without DF. The data path
        /// never fragments (a redirected frame skips the kernel's forwarding
        /// path that would); it drops and counts.
        MTU_EXCEEDED_NO_DF = 24 => "mtu_exceeded_no_df",
        /// Overlay: a frame for a remote node, but the vxlan device is not set
        /// up (no Node document for this node, or the agent is starting).
        OVERLAY_DOWN = 25 => "overlay_down",
        /// Overlay: decapsulated frame whose VNI is no network here.
        OVERLAY_UNKNOWN_VNI = 26 => "overlay_unknown_vni",
        /// Overlay: decapsulated frame from a VTEP that hosts none of the
        /// network's attachments (not a node of that network).
        OVERLAY_UNKNOWN_VTEP = 27 => "overlay_unknown_vtep",
        /// Overlay: decapsulated frame for no local port (a MAC on another node,
        /// the gateway MAC, or a flood into a network with no port here).
        OVERLAY_NO_LOCAL_PORT = 28 => "overlay_no_local_port",
        /// Overlay: a frame for a MAC on another node that was relayed once
        /// already, or would go back to the node it came from (loop guard of
        /// the migration relay).
        OVERLAY_NOT_RELAYED = 29 => "overlay_not_relayed",
        /// Live migration: a frame on a pending target port from a MAC other
        /// than the VM's: the VM is not active on this node yet.
        MIGRATION_PENDING = 30 => "migration_pending",
        /// A neighbour advertisement for an address that is not the sender's
        /// own (given, claimed, or the link-local of its MAC): it would move
        /// another VM's traffic to the sender, or answer DAD for another's
        /// address (IP filter on).
        ND_SPOOF_TARGET = 31 => "nd_spoof_target",
        /// A neighbour solicitation or advertisement whose source or target
        /// link-layer address option is not the sender's MAC (IP filter on).
        ND_SPOOF_LLADDR = 32 => "nd_spoof_lladdr",
        /// DHCPv4 or DHCPv6 server traffic (BOOTREPLY 67 -> 68; ADVERTISE,
        /// REPLY or RECONFIGURE 547 -> 546) from a VM on a network vmpath
        /// serves, or whose `portSecurity.dhcpGuard` is on.
        DHCP_SPOOF = 33 => "dhcp_spoof",
        /// An ICMPv4 redirect from a VM (IP filter on): only the gateway may
        /// redirect.
        ICMP_REDIRECT = 34 => "icmp_redirect",
        /// A DHCPv4, DHCPv6 or router solicitation frame over its port's
        /// slow-path rate (`vmp_slow_meter` counts it per port and class).
        SLOWPATH_RATE_LIMITED = 35 => "slowpath_rate_limited",
        /// Routed ingress for a VM hosted elsewhere (or moving) whose place
        /// this node does not know: no endpoint and no learned node for its
        /// MAC. Dropped rather than handed to the host, which would route it
        /// back to the fabric.
        INGRESS_NO_ENDPOINT = 36 => "ingress_no_endpoint",
        /// NetworkPolicy: the destination endpoint is isolated for ingress and
        /// no policy selecting it allows this new flow from the sender.
        POLICY_DENIED_INGRESS = 37 => "policy_denied_ingress",
        /// NetworkPolicy: the sending endpoint is isolated for egress and no
        /// policy selecting it allows this new flow to the destination.
        POLICY_DENIED_EGRESS = 38 => "policy_denied_egress",
        /// Services: a new flow to a ClusterIP port with no ready backend;
        /// the client got a TCP reset or an ICMP port unreachable instead,
        /// as kube-proxy rejects.
        SERVICE_NO_BACKEND = 39 => "service_no_backend",
        /// IPv6 with more extension headers before the transport header than
        /// the data path walks (4): what it carries is not known, so neither
        /// the guards nor SNAT can judge it.
        EXT_HEADER_CHAIN = 40 => "ext_header_chain",
        /// SNAT: a non-first fragment from a VM whose first fragment SNAT
        /// did not see (out of order, or over `FRAG_TIMEOUT_NS` later;
        /// IPv4 or IPv6). It carries no ports, so only the first
        /// fragment's record (`vmp_snat_frags`, `vmp_snat6_frags`) can
        /// place it.
        SNAT_FRAGMENT = 41 => "snat_fragment",
        /// Live migration: a frame from the VM's MAC on a pending target port
        /// that the target pod's own kernel sends when its interface comes up
        /// with that MAC (IPv6 DAD from ::, MLD, router solicitation, IPv4
        /// from 0.0.0.0 other than DHCP): it does not mean the VM resumed
        /// there, so it moves nothing.
        MIGRATION_NOT_RESUMED = 42 => "migration_not_resumed",
        /// Routed ingress for an address inside a learning network's subnet
        /// that no entry places and no node has answered for (yet): the
        /// network's other nodes were asked (ARP or NS over the overlay, at
        /// most once a second per address) and the frame dropped, as a router
        /// drops while it resolves a neighbour.
        INGRESS_UNRESOLVED = 43 => "ingress_unresolved",
        /// Routed ingress that would have started a resolution, but the
        /// node's budget of resolutions (`RESOLVE_RATE` a second per CPU) is
        /// spent: dropped without asking (a scan of a subnet cannot turn
        /// into a flood of requests over the overlay).
        INGRESS_RESOLVE_LIMITED = 44 => "ingress_resolve_limited",
        /// Overlay: another node's resolution request for an address this
        /// node does not serve (every node but the holder drops it), or a
        /// malformed one.
        OVERLAY_RESOLVE_NOT_HERE = 45 => "overlay_resolve_not_here",
        /// Overlay: an answer to a resolution this node did not ask for (or
        /// asked for over `RESOLVE_ANSWER_WINDOW_NS` ago), naming a MAC this
        /// node places elsewhere or an address it routes itself, or naming
        /// another node or MAC than the answer it holds (the first holder
        /// keeps the address until its answer expires).
        OVERLAY_RESOLVE_REFUSED = 46 => "overlay_resolve_refused",
        /// NetworkPolicy: a later fragment (IPv4 or IPv6) to or from an
        /// endpoint isolated in that direction, whose first fragment policy
        /// did not see (it came first, out of order, or over
        /// `FRAG_TIMEOUT_NS` later; `vmp_pol_frags`). It carries no ports,
        /// so nothing else can judge it: denied.
        POLICY_FRAGMENT = 47 => "policy_fragment",
        /// Reach: a frame a node's stack routed to a Primary network's
        /// address that no endpoint holds (or whose endpoint is local but
        /// has no route here yet), or one from another node's stack for
        /// an endpoint no longer here.
        REACH_NO_ENDPOINT = 48 => "reach_no_endpoint",
        /// A VM's UDP datagram to another node's overlay port (VXLAN): it
        /// would arrive there as this node's own overlay frame, any VNI,
        /// any inner source.
        OVERLAY_INJECTION = 49 => "overlay_injection",
    }

    // A number out of place would show a count under another reason's name.
    const _: () = {
        let mut i = 0;
        while i < TABLE.len() {
            assert!(
                TABLE[i].0 as usize == i,
                "drop reasons are numbered in order from 0"
            );
            i += 1;
        }
    };
}

/// Gateway MAC for a network that does not configure one: locally
/// administered, unicast, the same on every node.
pub const fn default_gateway_mac(network_id: u32) -> [u8; 6] {
    let id = network_id.to_be_bytes();
    [0x0a, 0x76, 0x70, id[1], id[2], id[3]]
}

/// The EUI-64 link-local address for a MAC (fe80::/64).
pub const fn link_local_from_mac(mac: [u8; 6]) -> [u8; 16] {
    [
        0xfe,
        0x80,
        0,
        0,
        0,
        0,
        0,
        0,
        mac[0] ^ 0x02,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ]
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY (every impl below): the type is `#[repr(C)]` and `Copy`, made
    // only of integers and byte arrays with its padding spelled out as
    // fields (sizes asserted above), so it has no uninitialised bytes and
    // every bit pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for PortInfo {}
    unsafe impl aya::Pod for EndpointKey {}
    unsafe impl aya::Pod for Endpoint {}
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for AddrInfo {}
    unsafe impl aya::Pod for NetworkInfo {}
    unsafe impl aya::Pod for FloodList {}
    unsafe impl aya::Pod for PortStats {}
    unsafe impl aya::Pod for LearnedMac {}
    unsafe impl aya::Pod for LearnedIp {}
    unsafe impl aya::Pod for SlowPath {}
    unsafe impl aya::Pod for SlowLimits {}
    unsafe impl aya::Pod for SlowMeter {}
    unsafe impl aya::Pod for MonitorConfig {}
    unsafe impl aya::Pod for MonitorEvent {}
    unsafe impl aya::Pod for MeterBucket {}
}

// ---------------------------------------------------------------------------
// North-south: routed networks and SNAT
// ---------------------------------------------------------------------------

pub const MAX_ROUTED: u32 = 65536;
pub const MAX_SUBNETS: u32 = 4096;
pub const MAX_SNAT_FLOWS: u32 = 262144;
/// Routed next hops kept (`vmp_hops4`, `vmp_hops6`): one per VM and
/// destination in use, least recently used first out.
pub const MAX_KEPT_HOPS: u32 = 65536;
/// Fragmented SNAT datagrams in flight (`vmp_snat_frags`), both ways: a
/// record is needed only until its datagram's last fragment, so the LRU
/// turns over a full table before a VM flooding first fragments could
/// push out another's datagram still arriving (65536 records at a
/// million first fragments a second last 65 ms).
pub const MAX_SNAT_FRAGS: u32 = 65536;
/// Fragmented datagrams in flight that NetworkPolicy saw the first
/// fragment of (`vmp_pol_frags`), as `MAX_SNAT_FRAGS`.
pub const MAX_POLICY_FRAGS: u32 = 65536;
pub const MAX_SNAT_VMS: u32 = 65536;

/// A VM address the fabric reaches un-NATed (routed ingress: `egress:
/// Routed`, or `egress: SNAT` with `advertise`). Keyed by `AddrKey` with
/// network 0: the uplink program sees only the destination address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoutedAddr {
    /// Host-side ifindex of the VM's port. 0: the VM is not (only) here
    /// (hosted on another node, or a migration's source): the uplink
    /// follows `vmp_endpoints[(network, vm_mac)]`, delivering to a local
    /// endpoint or relaying over the overlay to a remote one.
    pub ifindex: u32,
    pub network: u32,
    pub vm_mac: [u8; 6],
    pub gw_mac: [u8; 6],
    /// The network's MTU (0: unchecked).
    pub mtu: u16,
    /// Port id of the VM's port (its counters' slot) in the low 12 bits
    /// (`ROUTED_PORT_ID`); `ROUTED_F_*` flags above.
    pub port_id: u16,
}
const _: () = assert!(size_of::<RoutedAddr>() == 24);

/// The port id bits of `RoutedAddr::port_id` (ids fit 12 bits, `MAX_PORT_ID`).
pub const ROUTED_PORT_ID: u16 = 0x0fff;
/// `RoutedAddr::port_id` flag: the VM's network SNATs its egress, so the
/// uplink records each flow it delivers in `vmp_inbound` (its replies
/// must leave un-NATed).
pub const ROUTED_F_INBOUND: u16 = 0x8000;

/// Flows opened from outside to a VM address on a SNAT network with
/// routed ingress, keyed by the tuple the VM's replies carry (`NatKey`:
/// the VM's address and port to the remote's), so the SNAT path sends
/// those replies un-NATed. Idle timeouts as for SNAT flows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InboundFlow {
    /// bpf_ktime_get_ns of a recent packet either way.
    pub last_seen: u64,
    /// `NAT_ST_OPEN` or `NAT_ST_CLOSING` (TCP FIN or RST seen).
    pub state: u8,
    pub _pad: [u8; 7],
}
const _: () = assert!(size_of::<InboundFlow>() == 16);

/// LPM data of `vmp_subnets4`: prefix length is 32 + the subnet's length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Subnet4 {
    /// Network id, big-endian (so the LPM prefix covers it first).
    pub network: [u8; 4],
    pub addr: [u8; 4],
}
const _: () = assert!(size_of::<Subnet4>() == 8);

/// LPM data of `vmp_subnets6`: prefix length is 32 + the subnet's length.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Subnet6 {
    pub network: [u8; 4],
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<Subnet6>() == 20);

/// The node's SNAT settings, slot 0 of `vmp_snat_cfg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnatConfig {
    /// The node's SNAT address (IPv4, network order); all zero: no SNAT.
    pub addr4: [u8; 4],
    /// The uplink's ifindex (0: unknown).
    pub uplink: u32,
    /// Port (and ICMP id) range, inclusive, reserved on the node.
    pub port_min: u16,
    pub port_max: u16,
    /// Ports one VM address may hold at once.
    pub quota: u32,
    /// Idle timeouts, seconds.
    pub tcp_timeout: u32,
    pub tcp_closing_timeout: u32,
    pub udp_timeout: u32,
    pub icmp_timeout: u32,
    /// The node's IPv6 SNAT address; all zero: no IPv6 SNAT. Same port
    /// range, quota and timeouts.
    pub addr6: [u8; 16],
}
const _: () = assert!(size_of::<SnatConfig>() == 48);

pub const SNAT_DEFAULT_PORT_MIN: u16 = 40000;
pub const SNAT_DEFAULT_PORT_MAX: u16 = 59999;
pub const SNAT_DEFAULT_QUOTA: u32 = 4096;

/// An IPv4 datagram SNAT saw the first fragment of (`vmp_snat_frags`'s
/// key): its addresses, IP ID and protocol as on the wire, and which way
/// it went (`FRAG_OUT`, `FRAG_IN`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragKey {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub id: [u8; 2],
    pub proto: u8,
    pub dir: u8,
}
const _: () = assert!(size_of::<FragKey>() == 12);

impl FragKey {
    pub const fn new(src: [u8; 4], dst: [u8; 4], id: [u8; 2], proto: u8, dir: u8) -> Self {
        FragKey {
            src,
            dst,
            id,
            proto,
            dir,
        }
    }
}

/// `FragKey::dir` (`DatagramKey::dir` in `vmp_snat6_frags`): from a VM,
/// to the uplink (the value's `addr` is the source its later fragments
/// take: the SNAT address, or 0 for the reply of an inbound flow, which
/// leaves un-NATed).
pub const FRAG_OUT: u8 = 0;
/// `FragKey::dir` (and `DatagramKey::dir`): from the uplink to the SNAT
/// address (the value is the flow's `vmp_snat_in` / `vmp_snat6_in`
/// entry: the VM's address, port and hop).
pub const FRAG_IN: u8 = 1;
/// How long after its first fragment a datagram's later ones are
/// translated (Linux's `ipfrag_time` default), or judged by policy.
pub const FRAG_TIMEOUT_NS: u64 = 30_000_000_000;

/// A fragmented datagram of either family, as the kernel's reassembly
/// keys it: IPv4 by (source, destination, IP ID, protocol), IPv6 by
/// (source, destination, fragment identification) (`ipv6_frag`'s key
/// holds no protocol: the Next Header of a later fragment's fragment
/// header plays no part in reassembly, so `proto` is 0). IPv4 addresses
/// fill the first 4 bytes, its 16-bit ID the first 2 of `id`. Keys
/// `vmp_snat6_frags` (`dir`: `FRAG_OUT` or `FRAG_IN`) and `vmp_pol_frags`
/// (`dir` 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatagramKey {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub id: [u8; 4],
    pub proto: u8,
    /// `addr_family`.
    pub family: u8,
    pub dir: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<DatagramKey>() == 40);

/// What NetworkPolicy saw in a datagram's first fragment
/// (`vmp_pol_frags`): its protocol (past IPv6 extension headers) and
/// ports (an ICMP echo's identifier both ways), which its later
/// fragments, carrying none, are judged by.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyFrag {
    /// bpf_ktime_get_coarse_ns of the first fragment.
    pub last_seen: u64,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<PolicyFrag>() == 16);

/// One direction of an IPv4 flow: the tuple as it appears on the wire.
/// For ICMP echo, `sport` and `dport` both hold the identifier.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NatKey {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<NatKey>() == 16);

/// SNAT flow states (`NatEntry::state`).
pub const NAT_ST_OPEN: u8 = 0;
pub const NAT_ST_CLOSING: u8 = 1;

/// Where a frame is sent next: the interface it leaves by and the
/// Ethernet addresses it carries there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Hop {
    pub ifindex: u32,
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
}
const _: () = assert!(size_of::<L2Hop>() == 16);

/// What a flow translates to, both ways: in `vmp_snat_out` keyed by the
/// VM's tuple (the value holds the translated address and port, and the
/// next hop the FIB last gave for the translated frames); in
/// `vmp_snat_in` keyed by the reply tuple (the value holds the VM's
/// address and port, and its port's ifindex and MAC).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatEntry {
    pub addr: [u8; 4],
    pub port: u16,
    pub state: u8,
    pub _pad: u8,
    /// Where the translated frames go. In `vmp_snat_in`: the VM's port
    /// (host-side ifindex), the VM's MAC, the gateway MAC. In
    /// `vmp_snat_out`: the next hop `bpf_fib_lookup` gave at `hop_checked`
    /// (ifindex 0: none kept).
    pub hop: L2Hop,
    /// Port id of the VM's port (its counters' slot).
    pub port_id: u32,
    /// In `vmp_snat_out`: when `hop` was looked up (`hop_stamp`).
    pub hop_checked: u32,
    /// bpf_ktime_get_ns of the last packet.
    pub last_seen: u64,
}
const _: () = assert!(size_of::<NatEntry>() == 40);
// Pinned flow tables outlive an upgrade: the fields keep their offsets.
const _: () = assert!(core::mem::offset_of!(NatEntry, hop) == 8);
const _: () = assert!(core::mem::offset_of!(NatEntry, last_seen) == 32);

/// One direction of an IPv6 flow (`NatKey`'s IPv6 twin): the tuple as it
/// appears on the wire. For ICMPv6 echo, `sport` and `dport` both hold
/// the identifier.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NatKey6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<NatKey6>() == 40);

/// `NatEntry`'s IPv6 twin (`vmp_snat6_out`, `vmp_snat6_in`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatEntry6 {
    pub addr: [u8; 16],
    pub port: u16,
    pub state: u8,
    pub _pad: u8,
    /// As `NatEntry::hop`.
    pub hop: L2Hop,
    /// Port id of the VM's port (its counters' slot).
    pub port_id: u32,
    /// In `vmp_snat6_out`: when `hop` was looked up (`hop_stamp`).
    pub hop_checked: u32,
    pub _pad2: u32,
    /// bpf_ktime_get_ns of the last packet.
    pub last_seen: u64,
}
const _: () = assert!(size_of::<NatEntry6>() == 56);
const _: () = assert!(core::mem::offset_of!(NatEntry6, hop) == 20);
const _: () = assert!(core::mem::offset_of!(NatEntry6, last_seen) == 48);

/// The FIB inputs of a routed IPv4 frame (`vmp_hops4`'s key): the VM
/// port it came in by, its addresses, TOS and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HopKey4 {
    pub ifindex: u32,
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub tos: u8,
    pub proto: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<HopKey4>() == 16);

/// `HopKey4`'s IPv6 twin (`vmp_hops6`; no TOS, as the lookup takes none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HopKey6 {
    pub ifindex: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<HopKey6>() == 40);

/// A next hop kept for routed frames (`vmp_hops4`, `vmp_hops6`): what
/// `bpf_fib_lookup` gave and when (`NatEntry::hop` and `hop_checked` are
/// the same for SNAT flows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeptHop {
    pub hop: L2Hop,
    pub checked: u32,
    pub _pad: u32,
}
const _: () = assert!(size_of::<KeptHop>() == 24);

#[cfg(feature = "user")]
mod pod_north_south {
    use super::*;
    // SAFETY (every impl below): the type is `#[repr(C)]` and `Copy`, made
    // only of integers and byte arrays with its padding spelled out as
    // fields (sizes asserted above), so it has no uninitialised bytes and
    // every bit pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for RoutedAddr {}
    unsafe impl aya::Pod for Subnet4 {}
    unsafe impl aya::Pod for Subnet6 {}
    unsafe impl aya::Pod for SnatConfig {}
    unsafe impl aya::Pod for NatKey {}
    unsafe impl aya::Pod for NatEntry {}
    unsafe impl aya::Pod for InboundFlow {}
    unsafe impl aya::Pod for NatKey6 {}
    unsafe impl aya::Pod for NatEntry6 {}
    unsafe impl aya::Pod for HopKey4 {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for DatagramKey {}
    unsafe impl aya::Pod for PolicyFrag {}
    unsafe impl aya::Pod for HopKey6 {}
    unsafe impl aya::Pod for KeptHop {}
}

// ---------------------------------------------------------------------------
// Overlay: VXLAN between nodes
// ---------------------------------------------------------------------------

/// vmpath's collect-metadata vxlan device in the node namespace.
pub const VXLAN_IFNAME: &str = "vmp-vxlan";
/// IANA VXLAN port, what Linux `dstport 4789` devices use.
pub const VXLAN_PORT: u16 = 4789;
/// Outer IPv4 + UDP + VXLAN + inner Ethernet.
pub const VXLAN_OVERHEAD: u32 = 50;
/// Outer IPv6 + UDP + VXLAN + inner Ethernet (an IPv6 underlay).
pub const VXLAN6_OVERHEAD: u32 = 70;
/// Remote nodes one network can flood to (a `bpf_loop` walks the list,
/// as `MAX_FLOOD_PORTS`: 4 bytes a node per network spanning nodes).
pub const MAX_FLOOD_NODES: usize = 4096;
const _: () = assert!(MAX_FLOOD_NODES.is_power_of_two());

/// The remote nodes (VTEP IPv4 addresses, network order) hosting at least
/// one attachment of a network. Keyed by network id. Broadcast, multicast
/// and unknown unicast go once to each; decapsulated frames are accepted
/// only from them. `node_ip4[..count]` is sorted ascending (as big-endian
/// numbers, which is the arrays' order): `vxlan_rx` finds a sender in it
/// by binary search.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteFloodList {
    pub count: u32,
    pub _pad: u32,
    pub node_ip4: [[u8; 4]; MAX_FLOOD_NODES],
}
const _: () = assert!(size_of::<RemoteFloodList>() == 8 + 4 * MAX_FLOOD_NODES);

impl Default for RemoteFloodList {
    fn default() -> Self {
        Self {
            count: 0,
            _pad: 0,
            node_ip4: [[0; 4]; MAX_FLOOD_NODES],
        }
    }
}

/// MACs learned from the overlay one node keeps (LRU: a full table forgets
/// the least recently used, whose frames are then flooded again).
pub const MAX_REMOTE_LEARNED: u32 = 65536;
/// A learned remote MAC not heard from for this long is forgotten by the
/// agent (as a Linux bridge ages its FDB: 300 s).
pub const REMOTE_LEARNED_MAX_AGE_NS: u64 = 300_000_000_000;
/// `vxlan_rx` rewrites a learned entry's `last_seen_ns` at most this often.
pub const REMOTE_LEARNED_TOUCH_NS: u64 = 1_000_000_000;

/// A remote VM's MAC whose node was learned from the frames it sent over
/// the overlay (VXLAN source learning), for MACs the config does not give
/// (detected from traffic on the hosting node). Keyed by `EndpointKey` in
/// the LRU map `vmp_remote_learned`. Never holds a MAC that
/// `vmp_endpoints` has (local or configured remote): those win.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteLearned {
    /// VTEP address of the node the MAC was last seen behind (IPv4,
    /// network order).
    pub node_ip4: [u8; 4],
    pub _pad: u32,
    /// bpf_ktime_get_ns (CLOCK_MONOTONIC) of a recent frame from the MAC,
    /// refreshed at most every `REMOTE_LEARNED_TOUCH_NS`.
    pub last_seen_ns: u64,
}
const _: () = assert!(size_of::<RemoteLearned>() == 16);

/// Slot 0 of `vmp_overlay`: where encapsulated frames go.
///
/// The underlay is one family for the whole cluster (a Node of the other
/// family is refused). On an IPv4 underlay a node's 4-byte VTEP value
/// (`Endpoint::node_ip4`, `RemoteFloodList`, `RemoteLearned`, ...) is its
/// IPv4 address. On an IPv6 underlay it is a handle the agent gives each
/// other node (kept across rounds and restarts): `vmp_vtep6` turns it
/// into the node's IPv6 address for the tunnel key, `vmp_vtep6_ids` turns
/// a received frame's outer source back into it. Everything else in the
/// data path compares and stores the 4-byte value as before.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverlayConfig {
    /// ifindex of `vmp-vxlan`; 0 while it is not set up.
    pub vxlan_ifindex: u32,
    /// This node's VTEP address on an IPv4 underlay (network order);
    /// zero: routing picks.
    pub local_ip4: [u8; 4],
    /// `addr_family::IPV6` on an IPv6 underlay; anything else is IPv4
    /// (0 is what an agent before IPv6 underlays wrote).
    pub underlay: u8,
    pub _pad: [u8; 3],
    /// This node's VTEP address on an IPv6 underlay; zero: routing picks.
    pub local_ip6: [u8; 16],
}
const _: () = assert!(size_of::<OverlayConfig>() == 28);

impl OverlayConfig {
    pub const fn is_ipv6(&self) -> bool {
        self.underlay == addr_family::IPV6
    }
}

/// Other nodes' VTEPs an IPv6-underlay node keeps handles for
/// (`vmp_vtep6`, `vmp_vtep6_ids`).
pub const MAX_VTEPS6: u32 = 16384;

// ---------------------------------------------------------------------------
// Neighbour resolution over the overlay (learned-only endpoints)
// ---------------------------------------------------------------------------

/// Entries of `vmp_resolved` one node keeps (LRU).
pub const MAX_RESOLVED: u32 = 4096;
/// Resolution prefixes (`vmp_resolve_prefixes`): subnets of learning
/// ingress networks.
pub const MAX_RESOLVE_PREFIXES: u32 = 1024;
/// An answer is used for this long after it came.
pub const RESOLVED_TTL_NS: u64 = 60_000_000_000;
/// An answer older than this is asked again (while still used).
pub const RESOLVED_REFRESH_NS: u64 = 30_000_000_000;
/// One address is asked for at most once in this time.
pub const RESOLVE_RETRY_NS: u64 = 1_000_000_000;
/// An answer counts only if its request went out at most this long ago.
pub const RESOLVE_ANSWER_WINDOW_NS: u64 = 3_000_000_000;
/// Requests a node sends, per second and CPU, and at once.
pub const RESOLVE_RATE: u32 = 50;
pub const RESOLVE_BURST: u32 = 10;

/// LPM data of `vmp_resolve_prefixes`: an IPv6 address, or an IPv4 one
/// mapped (`::ffff:a.b.c.d`, prefix length 96 + the subnet's). The value
/// is the network id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ResolvePrefix {
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<ResolvePrefix>() == 16);

impl ResolvePrefix {
    /// The key of `ip` and its LPM prefix length for a subnet of `len` bits.
    pub const fn v4(ip: [u8; 4], len: u32) -> (u32, ResolvePrefix) {
        let mut addr = [0u8; 16];
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12] = ip[0];
        addr[13] = ip[1];
        addr[14] = ip[2];
        addr[15] = ip[3];
        (96 + len, ResolvePrefix { addr })
    }
}

/// `vmp_resolved`: what this node knows of an address another node
/// serves but no config places (a learned address), keyed by `AddrKey`
/// (network, family, IP). Written by the uplink when it asks, and by
/// `vxlan_rx` when the answer comes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResolvedAddr {
    /// When this node last asked (flow clock, ns).
    pub asked_ns: u64,
    /// When the answer came (0: none yet).
    pub answered_ns: u64,
    /// The node that answered (VTEP, network order).
    pub node_ip4: [u8; 4],
    /// The endpoint's MAC it named.
    pub mac: [u8; 6],
    pub _pad: [u8; 6],
}
const _: () = assert!(size_of::<ResolvedAddr>() == 32);

#[cfg(feature = "user")]
mod pod_resolve {
    use super::*;
    // SAFETY: `#[repr(C)]`, `Copy`, integers and byte arrays with padding
    // spelled out (sizes asserted above): every bit pattern is valid.
    unsafe impl aya::Pod for ResolvePrefix {}
    unsafe impl aya::Pod for ResolvedAddr {}
}

#[cfg(feature = "user")]
mod pod_overlay {
    use super::*;
    // SAFETY (every impl below): the type is `#[repr(C)]` and `Copy`, made
    // only of integers and byte arrays with its padding spelled out as
    // fields (sizes asserted above), so it has no uninitialised bytes and
    // every bit pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for RemoteFloodList {}
    unsafe impl aya::Pod for OverlayConfig {}
    unsafe impl aya::Pod for RemoteLearned {}
    unsafe impl aya::Pod for MigrationEvent {}
}

// ---------------------------------------------------------------------------
// Live migration
// ---------------------------------------------------------------------------

/// Outer TTL of a frame the source node relays to a migrated VM's new node.
/// Lower than the normal tunnel TTL (64) by more than any underlay path
/// decrements, so the receiver knows it was relayed once and never relays
/// it again (`OVERLAY_NOT_RELAYED`).
pub const RELAY_TTL: u8 = 32;
/// A decapsulated frame whose outer TTL is at most this was relayed.
pub const RELAYED_TTL_MAX: u8 = 40;

/// A pending migration's VM spoke on the target port: the data path marked
/// it local there. Keyed by the target port's ifindex, written once
/// (BPF_NOEXIST); the agent finishes the cut-over from it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrationEvent {
    pub network: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// bpf_ktime_get_ns when the first frame was seen.
    pub ktime_ns: u64,
}
const _: () = assert!(size_of::<MigrationEvent>() == 24);

// ---------------------------------------------------------------------------
// NetworkPolicy: identities, the address -> identity cache, per-endpoint
// rules and the flows they allowed
// ---------------------------------------------------------------------------

/// Which way a policy rule or a tracked flow goes, seen from the endpoint.
pub mod policy_dir {
    /// Into the endpoint (policy `ingress`, checked before delivery).
    pub const INGRESS: u8 = 0;
    /// Out of the endpoint (policy `egress`, checked on its port).
    pub const EGRESS: u8 = 1;
    /// A flow tracked for both ends of a local delivery at once: its key
    /// holds the network id where the other directions hold a port id,
    /// and its `PolicyFlow` names the two ports (`from_port` sent the
    /// packet that opened it, `to_port` received it).
    pub const PAIR: u8 = 2;
}

/// Identities the agent does not allocate from label sets.
pub mod identity {
    /// In a rule key: any peer (a rule with no `from` / `to`).
    pub const ANY: u32 = 0;
    /// An address no endpoint and no ipBlock covers (`vmp_pol_ipcache` miss).
    pub const WORLD: u32 = 1;
    /// The first identity the agent allocates.
    pub const FIRST: u32 = 256;
}

/// `skb->cb[0]` of a frame `vm_policy_out` allowed, when it re-enters
/// `vm_port` (`cb[1]` holds the port id it was checked for), and of a
/// frame handed to `vm_policy_in` (`cb[1]` the port id, `cb[2]` the
/// port's ifindex).
pub const POLICY_CB_EGRESS_DONE: u32 = 0x766d_7045;
pub const POLICY_CB_DELIVER: u32 = 0x766d_7049;
/// `skb->cb[3]` of a frame handed to `vm_policy_out` or `vm_policy_in`
/// after the flow table was looked up for it (and missed) on the way: the
/// tail-called program goes straight to the policy lookup.
pub const POLICY_CB_UNTRACKED: u32 = 0x766d_7055;

/// `skb->cb[0]` of a frame handed to `vm_flood`: `cb[1]` holds the
/// network, `cb[2]` the ifindex of the port it came in by (0: from the
/// overlay), `cb[3]` the `FLOOD_F_*` flags.
pub const FLOOD_CB: u32 = 0x766d_7046;
/// Unknown unicast: only to ports that may hold an unknown MAC.
pub const FLOOD_F_UNKNOWN_UNICAST: u32 = 1 << 0;
/// From a VM port: to the network's other nodes as well.
pub const FLOOD_F_FROM_PORT: u32 = 1 << 1;

/// `PolicyFlow::policy` / `MonitorEvent::policy` when no policy applies.
pub const POLICY_NONE: u32 = u32::MAX;
/// Endpoint policy flags (`PolicyEndpoint::flags`).
pub const POL_F_INGRESS: u32 = 1 << 0;
pub const POL_F_EGRESS: u32 = 1 << 1;
/// Address prefixes (endpoint addresses and ipBlock CIDRs) with an identity.
pub const MAX_POLICY_PREFIXES: u32 = 65536;
/// Rule entries (`vmp_pol_rules`), all endpoints of the node together.
pub const MAX_POLICY_RULES: u32 = 65536;
/// Flows tracked for policy (LRU: a full table forgets the oldest, whose
/// next packet is checked against policy again).
pub const MAX_POLICY_FLOWS: u32 = 262144;

/// The VNI of overlay frames between a node's own stack and a Primary
/// network's endpoint on another node (`reach`): no network has id 0, so
/// they never meet a network's frames, and only vmpath's programs set a
/// tunnel key: a VM cannot send one.
pub const REACH_VNI: u32 = 0;
/// The network id under which `vmp_subnets4`/`vmp_subnets6` hold every
/// Primary network's subnets, each with its network's id as the value
/// (`reach`: an address's network without knowing it). Outside the
/// networks' ids, as `CLUSTER_NETWORK`.
pub const PRIMARY_SUBNETS: u32 = u32::MAX - 1;
/// Flows other nodes' stacks keep open to local endpoints (`vmp_reach_flows`).
pub const MAX_REACH_FLOWS: u32 = 65536;
/// A reach flow unused this long is forgotten (an endpoint's later frame
/// to that peer takes the hand-off again).
pub const REACH_FLOW_TIMEOUT_NS: u64 = 7_200_000_000_000;

/// A flow another node's stack opened to a local endpoint, keyed as the
/// endpoint answers it: from the endpoint's address and port to the
/// peer's (`family`: `addr_family`; IPv4 in the first 4 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReachFlowKey {
    pub family: u8,
    pub proto: u8,
    pub _pad: [u8; 2],
    pub sport: u16,
    pub dport: u16,
    pub src: [u8; 16],
    pub dst: [u8; 16],
}
const _: () = assert!(size_of::<ReachFlowKey>() == 40);

/// Where a reach flow's answers go: the node (4-byte VTEP value) whose
/// stack opened it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReachFlow {
    pub node: [u8; 4],
    pub _pad: u32,
    /// Flow clock (ns since boot) of the flow's last frame from that node.
    pub last_seen: u64,
}
const _: () = assert!(size_of::<ReachFlow>() == 16);
/// Policies counted per index (`vmp_pol_hits`).
pub const MAX_POLICIES: u32 = 4096;
/// A tracked flow idle this long is checked against policy again.
pub const POLICY_FLOW_TCP_TIMEOUT_NS: u64 = 7440 * 1_000_000_000;
pub const POLICY_FLOW_OTHER_TIMEOUT_NS: u64 = 300 * 1_000_000_000;
/// A tracked flow's `last_seen` is rewritten only once it is this old: most
/// packets read the entry without dirtying it (the idle timeouts are
/// minutes, a second more or less is nothing to them).
pub const POLICY_FLOW_REFRESH_NS: u64 = 1_000_000_000;

/// Per port id (`vmp_pol_ep`): which directions policy isolates and the
/// endpoint's own identity. Flags 0: no policy selects it, nothing checked.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyEndpoint {
    /// `POL_F_*`.
    pub flags: u32,
    pub identity: u32,
}
const _: () = assert!(size_of::<PolicyEndpoint>() == 8);

/// LPM data of `vmp_pol_ipcache`: (network, address) -> identity. IPv4
/// addresses are IPv4-mapped (::ffff:a.b.c.d), so one trie holds both;
/// the prefix length counts the 32 bits of the network first.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct IdentityPrefix {
    /// Network id, big-endian (the prefix covers it first).
    pub network: [u8; 4],
    pub addr: [u8; 16],
}
const _: () = assert!(size_of::<IdentityPrefix>() == 20);

impl IdentityPrefix {
    /// An IPv4 address as the trie keeps it (IPv4-mapped).
    #[inline(always)]
    pub const fn v4(network: u32, a: [u8; 4]) -> Self {
        IdentityPrefix {
            network: network.to_be_bytes(),
            addr: [
                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
            ],
        }
    }
    #[inline(always)]
    pub const fn v6(network: u32, addr: [u8; 16]) -> Self {
        IdentityPrefix {
            network: network.to_be_bytes(),
            addr,
        }
    }
    /// The LPM prefix length of an IPv4 prefix of `len` bits.
    pub const fn v4_len(len: u8) -> u32 {
        32 + 96 + len as u32
    }
    pub const fn v6_len(len: u8) -> u32 {
        32 + len as u32
    }
}

/// LPM data of `vmp_pol_rules`: (endpoint, direction, peer identity,
/// protocol, port). A rule for any port of a protocol stops after the
/// protocol (`POLICY_LEN_PROTO`), one for any protocol after the identity
/// (`POLICY_LEN_IDENTITY`); a port range is a few prefixes of the port.
/// Rules for any peer carry `identity::ANY`. The value is the index of the
/// policy that allows it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyRuleKey {
    /// Port id, big-endian.
    pub port_id: [u8; 4],
    /// `policy_dir`.
    pub direction: u8,
    /// Peer identity, big-endian.
    pub identity: [u8; 4],
    pub proto: u8,
    /// Destination port, big-endian (ICMP and others: 0).
    pub port: [u8; 2],
}
const _: () = assert!(size_of::<PolicyRuleKey>() == 12);

/// LPM lengths of a `PolicyRuleKey`: the whole key, any port, any protocol.
pub const POLICY_LEN_FULL: u32 = 96;
pub const POLICY_LEN_PROTO: u32 = 80;
pub const POLICY_LEN_IDENTITY: u32 = 72;

impl PolicyRuleKey {
    #[inline(always)]
    pub const fn new(port_id: u32, direction: u8, identity: u32, proto: u8, port: u16) -> Self {
        PolicyRuleKey {
            port_id: port_id.to_be_bytes(),
            direction,
            identity: identity.to_be_bytes(),
            proto,
            port: port.to_be_bytes(),
        }
    }
}

/// A flow policy allowed, keyed as the endpoint first saw it
/// (`vmp_pol_flows`, LRU). Replies match it with the ends swapped.
/// Addresses are IPv4 in the first 4 bytes or IPv6; for ICMP echo both
/// ports hold the identifier.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct PolicyFlowKey {
    pub port_id: u32,
    pub sport: u16,
    pub dport: u16,
    /// `addr_family`.
    pub family: u8,
    pub proto: u8,
    /// `policy_dir` of the packet that opened it.
    pub direction: u8,
    pub _pad: u8,
    pub src: [u8; 16],
    pub dst: [u8; 16],
}
const _: () = assert!(size_of::<PolicyFlowKey>() == 44);

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyFlow {
    /// bpf_ktime_get_coarse_ns of a recent packet either way (at most
    /// `POLICY_FLOW_REFRESH_NS` behind the latest).
    pub last_seen: u64,
    /// Index of the policy that allowed it (`POLICY_NONE`: the direction
    /// was not isolated, or a `policy_dir::PAIR` entry).
    pub policy: u32,
    /// `policy_dir::PAIR` entries: the port ids of the sender of the
    /// packet that opened the flow and of its receiver, both of which
    /// allowed it; 0 in the others.
    pub from_port: u16,
    pub to_port: u16,
    /// `policy_dir::INGRESS` and `policy_dir::EGRESS` entries: who the
    /// flow's other end is, the one whose packets may use the entry on
    /// this endpoint's ingress (the sender of an admitted flow, the
    /// destination of one the endpoint opened). A packet with the flow's
    /// tuple from anyone else is checked as a new flow, so copying an
    /// admitted flow's tuple borrows nothing. The sending endpoint's
    /// identity (its port's, or by MAC and node over the overlay, what it
    /// carries whatever address it writes; by address from no endpoint),
    /// unless `peer_by_address`. 0 in `PAIR` entries.
    pub peer: u32,
    /// The local port id `peer`'s packets come from, once one was checked
    /// (0: none yet, or the peer is not on this node): a frame from that
    /// port passes on the entry without its identity worked out again,
    /// one from any other local port is checked.
    pub peer_port: u16,
    /// 1: `peer` is the identity of the address a flow the endpoint
    /// opened was routed to (through the gateway, to no endpoint its MAC
    /// names); its replies are judged by their source address, a local
    /// port's only when it holds that address (else its own identity).
    pub peer_by_address: u16,
}
const _: () = assert!(size_of::<PolicyFlow>() == 24);
// Port ids fit `PolicyFlow::from_port` / `to_port`.
const _: () = assert!(MAX_PORTS <= 1 << 16);

/// Per port id, per CPU (`vmp_pol_stats`): new flows allowed and packets
/// denied, by direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyStats {
    pub allowed_ingress: u64,
    pub allowed_egress: u64,
    pub denied_ingress: u64,
    pub denied_egress: u64,
}
const _: () = assert!(size_of::<PolicyStats>() == 32);

impl PolicyStats {
    pub fn add(&mut self, o: &PolicyStats) {
        self.allowed_ingress += o.allowed_ingress;
        self.allowed_egress += o.allowed_egress;
        self.denied_ingress += o.denied_ingress;
        self.denied_egress += o.denied_egress;
    }
}

#[cfg(feature = "user")]
mod pod_policy {
    use super::*;
    // SAFETY (every impl below): the type is `#[repr(C)]` and `Copy`, made
    // only of integers and byte arrays with its padding spelled out as
    // fields (sizes asserted above), so it has no uninitialised bytes and
    // every bit pattern the kernel hands back is a valid value.
    unsafe impl aya::Pod for PolicyEndpoint {}
    unsafe impl aya::Pod for IdentityPrefix {}
    unsafe impl aya::Pod for PolicyRuleKey {}
    unsafe impl aya::Pod for PolicyFlowKey {}
    unsafe impl aya::Pod for PolicyFlow {}
    unsafe impl aya::Pod for PolicyStats {}
}

// ---------------------------------------------------------------------------
// Services: ClusterIP load balancing at the client's port
// ---------------------------------------------------------------------------

/// `skb->cb[0]` of a frame `vm_service` found no Service for, when it
/// re-enters `vm_port` (`cb[1]` holds the port id).
pub const SERVICE_CB_PASSED: u32 = 0x766d_7053;
/// `skb->cb[0]` of a frame handed to `vm_service_in` for delivery
/// (`cb[1]` the port id, `cb[2]` the port's ifindex).
pub const SERVICE_CB_DELIVER: u32 = 0x766d_7052;

/// Service ports (ClusterIP, port, protocol) per network.
pub const MAX_SERVICES: u32 = 16384;
/// Backend slots of all Service ports together.
pub const MAX_SERVICE_BACKENDS: u32 = 65536;
/// Translated flows, both directions (LRU).
pub const MAX_SERVICE_FLOWS: u32 = 262144;
/// Clients remembered for `sessionAffinity: ClientIP` (LRU).
pub const MAX_SERVICE_AFFINITY: u32 = 65536;
/// A UDP (or other non-TCP) flow idle this long picks a backend anew.
pub const SERVICE_FLOW_UDP_TIMEOUT_NS: u64 = 60 * 1_000_000_000;

/// `Service::flags`.
pub const SVC_F_AFFINITY: u8 = 1 << 0;

/// `ServiceFlow::flags`: what a tracked translation is for.
pub mod svc_flow {
    /// Client -> ClusterIP, looked up on the client's port: to the backend.
    pub const FORWARD: u8 = 1 << 0;
    /// Backend -> client, looked up right before delivery to the client:
    /// from the ClusterIP.
    pub const REVERSE: u8 = 1 << 1;
    /// The client is its own backend: both directions are looked up on
    /// its port and go back into it.
    pub const HAIRPIN: u8 = 1 << 2;
}

/// `vmp_svc` key: one Service port on one network (IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub network: u32,
    pub addr: [u8; 4],
    /// The Service port (host order).
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<ServiceKey>() == 12);

impl ServiceKey {
    /// Built from 32-bit words: as a struct literal its padding can
    /// compile to a `memset` call in eBPF.
    #[inline(always)]
    pub const fn new(network: u32, addr: [u8; 4], port: u16, proto: u8) -> Self {
        let p = port.to_ne_bytes();
        let words: [u32; 3] = [
            network,
            u32::from_ne_bytes(addr),
            u32::from_ne_bytes([p[0], p[1], proto, 0]),
        ];
        // SAFETY: `ServiceKey` is `#[repr(C)]`, 12 bytes of plain integers
        // and byte arrays (asserted), so every bit pattern is a valid value.
        unsafe { core::mem::transmute::<[u32; 3], ServiceKey>(words) }
    }
}

/// `vmp_svc` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    /// The Service port's id: its backends are `(id, 0..count)` in
    /// `vmp_svc_backends`, its affinity entries carry it.
    pub id: u32,
    /// Backends taking new flows (0: the client gets a reject).
    pub count: u32,
    /// `sessionAffinity: ClientIP`: how long a client sticks (seconds).
    pub affinity_timeout: u32,
    /// `SVC_F_*`.
    pub flags: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<Service>() == 16);

/// `vmp_svc_backends` key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceBackendKey {
    pub service: u32,
    pub slot: u32,
}
const _: () = assert!(size_of::<ServiceBackendKey>() == 8);

/// `vmp_svc_backends` value: one ready endpoint of a Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceBackend {
    pub addr: [u8; 4],
    /// The endpoint's port (host order).
    pub port: u16,
    pub mac: [u8; 6],
}
const _: () = assert!(size_of::<ServiceBackend>() == 12);

/// `vmp_svc_flows` key: a packet's tuple as it is looked up (IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlowKey {
    pub network: u32,
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<ServiceFlowKey>() == 20);

impl ServiceFlowKey {
    /// Built from 32-bit words (see `ServiceKey::new`).
    #[inline(always)]
    pub const fn new(
        network: u32,
        src: [u8; 4],
        dst: [u8; 4],
        sport: u16,
        dport: u16,
        proto: u8,
    ) -> Self {
        let (s, d) = (sport.to_ne_bytes(), dport.to_ne_bytes());
        let words: [u32; 5] = [
            network,
            u32::from_ne_bytes(src),
            u32::from_ne_bytes(dst),
            u32::from_ne_bytes([s[0], s[1], d[0], d[1]]),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ];
        // SAFETY: `ServiceFlowKey` is `#[repr(C)]`, 20 bytes of plain
        // integers and byte arrays (asserted), so every bit pattern is a
        // valid value.
        unsafe { core::mem::transmute::<[u32; 5], ServiceFlowKey>(words) }
    }
}

/// `vmp_svc_flows` value: the tuple the packet leaves with, and the
/// Ethernet address to send it to (forward: the backend's MAC).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceFlow {
    /// bpf_ktime_get_ns of the last packet.
    pub last_seen: u64,
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: u16,
    pub dport: u16,
    pub mac: [u8; 6],
    /// `svc_flow`.
    pub flags: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<ServiceFlow>() == 32);

/// `vmp_svc_affinity` key: a client of one Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAffinityKey {
    pub service: u32,
    pub client: [u8; 4],
}
const _: () = assert!(size_of::<ServiceAffinityKey>() == 8);

/// `vmp_svc_affinity` value: the backend slot the client was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceAffinity {
    pub last_seen: u64,
    pub slot: u32,
    /// The backend's address then: a slot refilled with another backend
    /// does not keep the client.
    pub addr: [u8; 4],
}
const _: () = assert!(size_of::<ServiceAffinity>() == 16);

/// Per port id, per CPU (`vmp_svc_stats`): what the port's clients did
/// with Services.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// New flows sent to a backend.
    pub flows: u64,
    /// New flows rejected (no ready backend).
    pub rejected: u64,
}
const _: () = assert!(size_of::<ServiceStats>() == 16);

/// `vmp_svc6` key: one IPv6 Service port on one network.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    pub network: u32,
    pub addr: [u8; 16],
    /// The Service port (host order).
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(size_of::<ServiceKey6>() == 24);

impl ServiceKey6 {
    /// Built from 32-bit words (see `ServiceKey::new`).
    #[inline(always)]
    pub const fn new(network: u32, addr: [u8; 16], port: u16, proto: u8) -> Self {
        let p = port.to_ne_bytes();
        let a = words16(&addr);
        let words: [u32; 6] = [
            network,
            a[0],
            a[1],
            a[2],
            a[3],
            u32::from_ne_bytes([p[0], p[1], proto, 0]),
        ];
        // SAFETY: `ServiceKey6` is `#[repr(C)]`, 24 bytes of plain integers
        // and byte arrays (asserted), so every bit pattern is a valid value.
        unsafe { core::mem::transmute::<[u32; 6], ServiceKey6>(words) }
    }
}

/// An IPv6 address as four 32-bit words in memory order.
#[inline(always)]
const fn words16(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// `vmp_svc6_backend` value: one ready IPv6 endpoint of a Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceBackend6 {
    pub addr: [u8; 16],
    /// The endpoint's port (host order).
    pub port: u16,
    pub mac: [u8; 6],
}
const _: () = assert!(size_of::<ServiceBackend6>() == 24);

/// `vmp_svc6_flows` key: a packet's tuple as it is looked up (IPv6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceFlowKey6 {
    pub network: u32,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(size_of::<ServiceFlowKey6>() == 44);

impl ServiceFlowKey6 {
    /// Built from 32-bit words (see `ServiceKey::new`).
    #[inline(always)]
    pub const fn new(
        network: u32,
        src: &[u8; 16],
        dst: &[u8; 16],
        sport: u16,
        dport: u16,
        proto: u8,
    ) -> Self {
        let (s, d) = (sport.to_ne_bytes(), dport.to_ne_bytes());
        let (a, b) = (words16(src), words16(dst));
        let words: [u32; 11] = [
            network,
            a[0],
            a[1],
            a[2],
            a[3],
            b[0],
            b[1],
            b[2],
            b[3],
            u32::from_ne_bytes([s[0], s[1], d[0], d[1]]),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ];
        // SAFETY: `ServiceFlowKey6` is `#[repr(C)]`, 44 bytes of plain
        // integers and byte arrays (asserted), so every bit pattern is a
        // valid value.
        unsafe { core::mem::transmute::<[u32; 11], ServiceFlowKey6>(words) }
    }
}

/// `vmp_svc6_flows` value (`ServiceFlow`'s IPv6 twin).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceFlow6 {
    /// bpf_ktime_get_ns of the last packet.
    pub last_seen: u64,
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub mac: [u8; 6],
    /// `svc_flow`.
    pub flags: u8,
    pub _pad: [u8; 5],
}
const _: () = assert!(size_of::<ServiceFlow6>() == 56);

/// `vmp_svc6_sticky` key: an IPv6 client of one Service port.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAffinityKey6 {
    pub service: u32,
    pub client: [u8; 16],
}
const _: () = assert!(size_of::<ServiceAffinityKey6>() == 20);

/// `vmp_svc6_sticky` value: the backend slot the client was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceAffinity6 {
    pub last_seen: u64,
    pub slot: u32,
    /// The backend's address then (see `ServiceAffinity::addr`).
    pub addr: [u8; 16],
    pub _pad: u32,
}
const _: () = assert!(size_of::<ServiceAffinity6>() == 32);

/// `vmp_svc6_scratch`: a flow's key and value, built here rather than on
/// the stack (16-byte addresses leave `vm_service6` too little of it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceScratch6 {
    pub key: ServiceFlowKey6,
    pub _pad: u32,
    pub flow: ServiceFlow6,
}
const _: () = assert!(size_of::<ServiceScratch6>() == 104);

#[cfg(feature = "user")]
mod pod_service {
    use super::*;
    // SAFETY (every impl below): as for the types above: `#[repr(C)]`,
    // `Copy`, integers and byte arrays with padding spelled out (sizes
    // asserted), every bit pattern valid.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for Service {}
    unsafe impl aya::Pod for ServiceBackendKey {}
    unsafe impl aya::Pod for ServiceBackend {}
    unsafe impl aya::Pod for ServiceFlowKey {}
    unsafe impl aya::Pod for ServiceFlow {}
    unsafe impl aya::Pod for ServiceAffinityKey {}
    unsafe impl aya::Pod for ServiceAffinity {}
    unsafe impl aya::Pod for ServiceStats {}
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for ServiceBackend6 {}
    unsafe impl aya::Pod for ServiceFlowKey6 {}
    unsafe impl aya::Pod for ServiceFlow6 {}
    unsafe impl aya::Pod for ServiceAffinityKey6 {}
    unsafe impl aya::Pod for ServiceAffinity6 {}
    unsafe impl aya::Pod for ServiceScratch6 {}
}
