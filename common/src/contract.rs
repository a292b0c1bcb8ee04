//! The contracts between the eBPF programs and the agent that are not plain
//! types: every map's shape, the tail-call slots, the address-family tags,
//! and the SNAT flow rules both sides apply. Each is defined here once; the
//! eBPF map definitions size themselves from these shapes and the agent
//! checks pinned maps against them (and a test checks the built object).

use core::{mem::size_of, net::IpAddr};

use crate::*;

/// What kind of BPF map (the kernel's `bpf_map_type`, the subset vmpath uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKind {
    Hash,
    LruHash,
    Array,
    PerCpuArray,
    LpmTrie,
    ProgramArray,
    XskMap,
    /// A ring buffer: no key or value, `max_entries` is its size in bytes.
    RingBuf,
}

/// One map's shape: what the eBPF definition declares, what the agent
/// requires of a pinned map before adopting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDef {
    /// The kernel's (and `bpftool`'s) name; also the pin file name.
    pub name: &'static str,
    pub kind: MapKind,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
}

const fn def<K, V>(name: &'static str, kind: MapKind, max_entries: u32) -> MapDef {
    MapDef {
        name,
        kind,
        key_size: size_of::<K>() as u32,
        value_size: size_of::<V>() as u32,
        max_entries,
    }
}

/// An LPM trie's key: the 4-byte prefix length, then the data; the value
/// is a `u32`.
const fn lpm<D>(name: &'static str, max_entries: u32) -> MapDef {
    MapDef {
        name,
        kind: MapKind::LpmTrie,
        key_size: 4 + size_of::<D>() as u32,
        value_size: 4,
        max_entries,
    }
}

/// Every map of the data path's object, by the name of its eBPF static.
pub mod maps {
    use super::{MapKind::*, *};

    pub const PORTS: MapDef = def::<u32, PortInfo>(map_names::PORTS, Hash, MAX_PORTS);
    pub const ENDPOINTS: MapDef =
        def::<EndpointKey, Endpoint>(map_names::ENDPOINTS, Hash, MAX_ENDPOINTS);
    pub const ADDRESSES: MapDef =
        def::<AddrKey, AddrInfo>(map_names::ADDRESSES, Hash, MAX_ADDRESSES);
    pub const NETWORKS: MapDef = def::<u32, NetworkInfo>(map_names::NETWORKS, Hash, MAX_NETWORKS);
    pub const FLOOD: MapDef = def::<u32, FloodList>(map_names::FLOOD, Hash, MAX_NETWORKS);
    pub const DROPS: MapDef = def::<u32, u64>(map_names::DROPS, PerCpuArray, drop_reason::COUNT);
    pub const PORT_STATS: MapDef =
        def::<u32, PortStats>(map_names::PORT_STATS, PerCpuArray, MAX_PORTS);
    pub const LEARNED_MACS: MapDef =
        def::<u32, LearnedMac>(map_names::LEARNED_MACS, Hash, MAX_PORTS);
    pub const LEARNED_IPS: MapDef =
        def::<AddrKey, LearnedIp>(map_names::LEARNED_IPS, LruHash, MAX_LEARNED_IPS);
    /// (network, IP) -> the port that used an address another port holds.
    pub const LEARN_CONFLICTS: MapDef =
        def::<AddrKey, LearnedIp>(map_names::LEARN_CONFLICTS, LruHash, MAX_LEARN_CONFLICTS);
    pub const PORT_IDS: MapDef = def::<u32, u32>(map_names::PORT_IDS, Hash, MAX_PORTS);
    pub const SLOW: MapDef = def::<u32, SlowPath>(map_names::SLOW, Array, 1);
    /// One AF_XDP socket per queue of `vmp-slow1`.
    pub const XSKS: MapDef = def::<u32, u32>(map_names::XSKS, XskMap, 4);
    pub const SLOW_LIMITS: MapDef =
        def::<u32, SlowLimits>(map_names::SLOW_LIMITS, Array, MAX_PORTS);
    pub const SLOW_METER: MapDef =
        def::<u32, SlowMeter>(map_names::SLOW_METER, PerCpuArray, MAX_PORTS);

    pub const PROGS: MapDef = def::<u32, u32>(map_names::PROGS, ProgramArray, tail_call::SLOTS);
    pub const ROUTED: MapDef = def::<AddrKey, RoutedAddr>(map_names::ROUTED, Hash, MAX_ROUTED);
    pub const SUBNETS4: MapDef = lpm::<Subnet4>(map_names::SUBNETS4, MAX_SUBNETS);
    pub const SUBNETS6: MapDef = lpm::<Subnet6>(map_names::SUBNETS6, MAX_SUBNETS);
    pub const SNAT_CONFIG: MapDef = def::<u32, SnatConfig>(map_names::SNAT_CONFIG, Array, 1);
    pub const SNAT_OUT: MapDef =
        def::<NatKey, NatEntry>(map_names::SNAT_OUT, LruHash, MAX_SNAT_FLOWS);
    pub const SNAT_IN: MapDef =
        def::<NatKey, NatEntry>(map_names::SNAT_IN, LruHash, MAX_SNAT_FLOWS);
    pub const SNAT_QUOTA: MapDef = def::<u32, u32>(map_names::SNAT_QUOTA, Hash, MAX_SNAT_VMS);
    pub const INBOUND: MapDef =
        def::<NatKey, InboundFlow>(map_names::INBOUND, LruHash, MAX_SNAT_FLOWS);
    pub const SNAT6_OUT: MapDef =
        def::<NatKey6, NatEntry6>(map_names::SNAT6_OUT, LruHash, MAX_SNAT_FLOWS);
    pub const SNAT6_IN: MapDef =
        def::<NatKey6, NatEntry6>(map_names::SNAT6_IN, LruHash, MAX_SNAT_FLOWS);
    /// Keyed by the VM's IPv6 address.
    pub const SNAT6_QUOTA: MapDef =
        def::<[u8; 16], u32>(map_names::SNAT6_QUOTA, Hash, MAX_SNAT_VMS);
    pub const INBOUND6: MapDef =
        def::<NatKey6, InboundFlow>(map_names::INBOUND6, LruHash, MAX_SNAT_FLOWS);

    pub const FLOOD_REMOTE: MapDef =
        def::<u32, RemoteFloodList>(map_names::FLOOD_REMOTE, Hash, MAX_NETWORKS);
    pub const OVERLAY: MapDef = def::<u32, OverlayConfig>(map_names::OVERLAY, Array, 1);
    pub const OVERLAY_STATS: MapDef =
        def::<u32, PortStats>(map_names::OVERLAY_STATS, PerCpuArray, 1);
    /// Written by the data path (`vxlan_rx`); the agent only prunes it.
    pub const REMOTE_LEARNED: MapDef =
        def::<EndpointKey, RemoteLearned>(map_names::REMOTE_LEARNED, LruHash, MAX_REMOTE_LEARNED);
    pub const VTEP6: MapDef = def::<[u8; 4], [u8; 16]>(map_names::VTEP6, Hash, MAX_VTEPS6);
    pub const VTEP6_IDS: MapDef = def::<[u8; 16], [u8; 4]>(map_names::VTEP6_IDS, Hash, MAX_VTEPS6);

    pub const MIGRATED: MapDef = def::<u32, MigrationEvent>(map_names::MIGRATED, Hash, MAX_PORTS);

    pub const DEBUG: MapDef = def::<u32, u32>(map_names::DEBUG, Array, 1);

    /// 256 KiB: about 3,000 events, a second of the default rate.
    pub const MONITOR: MapDef = MapDef {
        name: map_names::MONITOR,
        kind: RingBuf,
        key_size: 0,
        value_size: 0,
        max_entries: 256 * 1024,
    };
    pub const MONITOR_CFG: MapDef = def::<u32, MonitorConfig>(map_names::MONITOR_CFG, Array, 1);
    pub const MONITOR_METER: MapDef =
        def::<u32, MeterBucket>(map_names::MONITOR_METER, PerCpuArray, 1);

    pub const POLICY_ENDPOINTS: MapDef =
        def::<u32, PolicyEndpoint>(map_names::POLICY_ENDPOINTS, Array, MAX_PORTS);
    pub const POLICY_IPCACHE: MapDef =
        lpm::<IdentityPrefix>(map_names::POLICY_IPCACHE, MAX_POLICY_PREFIXES);
    pub const POLICY_RULES: MapDef =
        lpm::<PolicyRuleKey>(map_names::POLICY_RULES, MAX_POLICY_RULES);
    pub const POLICY_FLOWS: MapDef =
        def::<PolicyFlowKey, PolicyFlow>(map_names::POLICY_FLOWS, LruHash, MAX_POLICY_FLOWS);
    pub const REACH_NODES: MapDef = def::<[u8; 4], u32>(map_names::REACH_NODES, Hash, MAX_VTEPS6);
    pub const REACH_FLOWS: MapDef =
        def::<ReachFlowKey, ReachFlow>(map_names::REACH_FLOWS, LruHash, MAX_REACH_FLOWS);
    pub const POLICY_STATS: MapDef =
        def::<u32, PolicyStats>(map_names::POLICY_STATS, PerCpuArray, MAX_PORTS);
    pub const POLICY_HITS: MapDef =
        def::<u32, u64>(map_names::POLICY_HITS, PerCpuArray, MAX_POLICIES);
    /// Per network, its flood list less the ports isolated for ingress.
    pub const POLICY_FLOOD: MapDef =
        def::<u32, FloodList>(map_names::POLICY_FLOOD, Hash, MAX_NETWORKS);
    /// The data path's scratch space for a packet's flow key (no state).
    pub const POLICY_SCRATCH: MapDef =
        def::<u32, PolicyFlowKey>(map_names::POLICY_SCRATCH, PerCpuArray, 1);

    pub const SERVICES: MapDef =
        def::<ServiceKey, Service>(map_names::SERVICES, Hash, MAX_SERVICES);
    pub const SERVICE_BACKENDS: MapDef = def::<ServiceBackendKey, ServiceBackend>(
        map_names::SERVICE_BACKENDS,
        Hash,
        MAX_SERVICE_BACKENDS,
    );
    pub const SERVICE_FLOWS: MapDef =
        def::<ServiceFlowKey, ServiceFlow>(map_names::SERVICE_FLOWS, LruHash, MAX_SERVICE_FLOWS);
    pub const SERVICE_AFFINITY: MapDef = def::<ServiceAffinityKey, ServiceAffinity>(
        map_names::SERVICE_AFFINITY,
        LruHash,
        MAX_SERVICE_AFFINITY,
    );
    pub const SERVICE_CONFIG: MapDef = def::<u32, u32>(map_names::SERVICE_CONFIG, Array, 1);
    pub const SERVICE_STATS: MapDef =
        def::<u32, ServiceStats>(map_names::SERVICE_STATS, PerCpuArray, MAX_PORTS);
    pub const SERVICES6: MapDef =
        def::<ServiceKey6, Service>(map_names::SERVICES6, Hash, MAX_SERVICES);
    pub const SERVICE6_BACKENDS: MapDef = def::<ServiceBackendKey, ServiceBackend6>(
        map_names::SERVICE6_BACKENDS,
        Hash,
        MAX_SERVICE_BACKENDS,
    );
    pub const SERVICE6_FLOWS: MapDef =
        def::<ServiceFlowKey6, ServiceFlow6>(map_names::SERVICE6_FLOWS, LruHash, MAX_SERVICE_FLOWS);
    pub const SERVICE6_AFFINITY: MapDef = def::<ServiceAffinityKey6, ServiceAffinity6>(
        map_names::SERVICE6_AFFINITY,
        LruHash,
        MAX_SERVICE_AFFINITY,
    );
    pub const SERVICE6_SCRATCH: MapDef =
        def::<u32, ServiceScratch6>(map_names::SERVICE6_SCRATCH, PerCpuArray, 1);
    pub const XDP_PORTS: MapDef = def::<u32, u32>(map_names::XDP_PORTS, Hash, MAX_PORTS);
    pub const UPLINK_XDP_STATS: MapDef =
        def::<u32, u64>(map_names::UPLINK_XDP_STATS, PerCpuArray, xdp_stat::COUNT);
    pub const HOPS4: MapDef = def::<HopKey4, KeptHop>(map_names::HOPS4, LruHash, MAX_KEPT_HOPS);
    pub const HOPS6: MapDef = def::<HopKey6, KeptHop>(map_names::HOPS6, LruHash, MAX_KEPT_HOPS);
    pub const SNAT_FRAGS: MapDef =
        def::<FragKey, NatEntry>(map_names::SNAT_FRAGS, LruHash, MAX_SNAT_FRAGS);
    pub const SNAT6_FRAGS: MapDef =
        def::<DatagramKey, NatEntry6>(map_names::SNAT6_FRAGS, LruHash, MAX_SNAT_FRAGS);
    pub const POLICY_FRAGS: MapDef =
        def::<DatagramKey, PolicyFrag>(map_names::POLICY_FRAGS, LruHash, MAX_POLICY_FRAGS);

    pub const RESOLVE_PREFIXES: MapDef =
        lpm::<ResolvePrefix>(map_names::RESOLVE_PREFIXES, MAX_RESOLVE_PREFIXES);
    pub const RESOLVED: MapDef =
        def::<AddrKey, ResolvedAddr>(map_names::RESOLVED, LruHash, MAX_RESOLVED);
    pub const RESOLVE_METER: MapDef =
        def::<u32, MeterBucket>(map_names::RESOLVE_METER, PerCpuArray, 1);

    /// Every map the agent pins (the whole object but aya-log's ring
    /// buffer, `map_names::DEBUG_LOG`).
    pub const ALL: [MapDef; 70] = [
        DEBUG,
        MONITOR,
        MONITOR_CFG,
        MONITOR_METER,
        SLOW_LIMITS,
        SLOW_METER,
        PORTS,
        ENDPOINTS,
        ADDRESSES,
        NETWORKS,
        FLOOD,
        DROPS,
        PORT_STATS,
        LEARNED_MACS,
        LEARNED_IPS,
        LEARN_CONFLICTS,
        PORT_IDS,
        SLOW,
        XSKS,
        PROGS,
        ROUTED,
        SUBNETS4,
        SUBNETS6,
        SNAT_CONFIG,
        SNAT_OUT,
        SNAT_IN,
        SNAT_QUOTA,
        INBOUND,
        FLOOD_REMOTE,
        OVERLAY,
        OVERLAY_STATS,
        REMOTE_LEARNED,
        MIGRATED,
        SNAT6_OUT,
        SNAT6_IN,
        SNAT6_QUOTA,
        INBOUND6,
        POLICY_ENDPOINTS,
        POLICY_IPCACHE,
        POLICY_RULES,
        POLICY_FLOWS,
        POLICY_STATS,
        POLICY_HITS,
        POLICY_SCRATCH,
        POLICY_FLOOD,
        SERVICES,
        SERVICE_BACKENDS,
        SERVICE_FLOWS,
        SERVICE_AFFINITY,
        SERVICE_CONFIG,
        SERVICE_STATS,
        XDP_PORTS,
        UPLINK_XDP_STATS,
        HOPS4,
        HOPS6,
        SNAT_FRAGS,
        SNAT6_FRAGS,
        POLICY_FRAGS,
        RESOLVE_PREFIXES,
        RESOLVED,
        RESOLVE_METER,
        SERVICES6,
        SERVICE6_BACKENDS,
        SERVICE6_FLOWS,
        SERVICE6_AFFINITY,
        SERVICE6_SCRATCH,
        VTEP6,
        VTEP6_IDS,
        REACH_FLOWS,
        REACH_NODES,
    ];
}

/// Maps whose size the operator sets at the agent's start (`--max-endpoints`,
/// `--max-addresses`): the cluster's endpoints and addresses, which grow with
/// the cluster, not the node. Their `max_entries` in `maps::ALL` is the
/// default; the agent loads the object with the size chosen
/// (`EbpfLoader::set_max_entries`) and checks pinned maps against it.
pub mod sized {
    use super::{MapDef, maps};

    /// The maps, by their shape in `maps::ALL`.
    pub const MAPS: [MapDef; 2] = [maps::ENDPOINTS, maps::ADDRESSES];
    /// The sizes accepted: a hash map's memory is preallocated, about 100
    /// bytes an entry (docs/config.md, Limits), so the top is 400 MiB.
    pub const MIN: u32 = 1024;
    pub const MAX: u32 = 4 * 1024 * 1024;
}

/// Slots of `vmp_progs`: the eBPF side tail-calls them, the agent fills them.
pub mod tail_call {
    /// `vm_egress`: routed and SNAT egress, from `vm_port`.
    pub const VM_EGRESS: u32 = 0;
    /// `vm_remote`: frames for remote nodes, from `vm_port`.
    pub const VM_REMOTE: u32 = 1;
    /// `vm_migrate`: a pending migration target port, from `vm_port`.
    pub const VM_MIGRATE: u32 = 2;
    /// `vm_port` itself, re-entered by `vm_migrate` and `vm_policy_out`.
    pub const VM_PORT: u32 = 3;
    /// `vm_policy_out`: egress policy of a VM port whose endpoint a policy
    /// selects, from `vm_port`; re-enters `vm_port` when allowed.
    pub const POLICY_EGRESS: u32 = 4;
    /// `vm_policy_in`: ingress policy and delivery to such a port, from
    /// every program that delivers to a local port.
    pub const POLICY_DELIVER: u32 = 5;
    /// `vm_service`: ClusterIP translation of a frame a VM port sends to
    /// the gateway, from `vm_port`; re-enters `vm_port` for other frames.
    pub const VM_SERVICE: u32 = 6;
    /// `vm_service_in`: reverse translation of a reply to a ClusterIP
    /// client, then its delivery, from every delivery to a local port
    /// while Services exist.
    pub const SERVICE_DELIVER: u32 = 7;
    /// `uplink_resolve`: routed ingress for an address no entry places,
    /// resolved over the overlay, from `uplink`.
    pub const UPLINK_RESOLVE: u32 = 8;
    /// `vxlan_resolve`: resolution requests and answers between nodes,
    /// from `vxlan_rx`.
    pub const VXLAN_RESOLVE: u32 = 9;
    /// `vm_neigh`: an ARP request or neighbour solicitation a VM port
    /// broadcasts, answered for a known endpoint or switched, from
    /// `vm_port` (its own program: inline it overflowed `vm_port`'s
    /// verifier budget).
    pub const VM_NEIGH: u32 = 10;
    /// `vm_flood`: broadcast, multicast and unknown unicast to every
    /// member of the network, from `vm_port`, `vm_neigh` and `vxlan_rx`
    /// (its own program: the `bpf_loop` over the members needs stack the
    /// callers have no room for).
    pub const VM_FLOOD: u32 = 11;
    /// `vm_service6`: IPv6 ClusterIP translation of a frame a VM port
    /// sends to the gateway, from `vm_port`; re-enters `vm_port` for
    /// other frames (its own program: `vm_service` is IPv4's, and the two
    /// together would not fit one verifier budget).
    pub const VM_SERVICE6: u32 = 12;
    /// `vm_snat6_ext`: SNAT of an IPv6 frame from a VM with extension
    /// headers (fragments among them: a first fragment translated and its
    /// outcome recorded, a later one given its first's source), then
    /// routed on, from `vm_egress` (its own program: the walk of the
    /// chain and the fragments' records took `vm_egress` over the
    /// verifier budget).
    pub const VM_SNAT6_EXT: u32 = 13;
    /// `vxlan_reach`: a frame with `REACH_VNI` (another node's stack to a
    /// local endpoint, or an endpoint's answer to this node's stack), from
    /// `vxlan_rx` (whose stack has no room for it).
    pub const VXLAN_REACH: u32 = 14;
    pub const SLOTS: u32 = 15;

    use crate::prog_names;
    /// Every slot with the program the agent puts in it: the one table
    /// the loader fills `vmp_progs` from.
    pub const PROGRAMS: [(u32, &str); SLOTS as usize] = [
        (VM_EGRESS, prog_names::VM_EGRESS),
        (VM_REMOTE, prog_names::VM_REMOTE),
        (VM_MIGRATE, prog_names::VM_MIGRATE),
        (VM_PORT, prog_names::VM_PORT),
        (POLICY_EGRESS, prog_names::VM_POLICY_OUT),
        (POLICY_DELIVER, prog_names::VM_POLICY_IN),
        (VM_SERVICE, prog_names::VM_SERVICE),
        (SERVICE_DELIVER, prog_names::VM_SERVICE_IN),
        (UPLINK_RESOLVE, prog_names::UPLINK_RESOLVE),
        (VXLAN_RESOLVE, prog_names::VXLAN_RESOLVE),
        (VM_NEIGH, prog_names::VM_NEIGH),
        (VM_FLOOD, prog_names::VM_FLOOD),
        (VM_SERVICE6, prog_names::VM_SERVICE6),
        (VM_SNAT6_EXT, prog_names::VM_SNAT6_EXT),
        (VXLAN_REACH, prog_names::VXLAN_REACH),
    ];
}

/// `skb->cb`: the five 32-bit words (`__sk_buff.cb[5]`) a frame carries
/// from one of vmpath's programs to the next (a tail call, or re-entry
/// into `vm_port`). Which word holds what, in one place; the marker says
/// which hand-over the other words follow (`POLICY_CB_EGRESS_DONE`,
/// `POLICY_CB_DELIVER`, `SERVICE_CB_PASSED`, `FLOOD_CB`, ...).
pub mod skb_cb {
    /// The hand-over's marker (0: none).
    pub const MARKER: usize = 0;
    /// The port id the marker was set for; for `FLOOD_CB`, the network.
    pub const PORT: usize = 1;
    /// The port's ifindex; for `FLOOD_CB`, the port the frame came in by
    /// (0: from the overlay).
    pub const IFINDEX: usize = 2;
    /// `POLICY_CB_UNTRACKED` (the flow table was looked up and missed on
    /// the way); for `FLOOD_CB`, the `FLOOD_F_*` flags.
    pub const FLAGS: usize = 3;
    /// On a frame from `vmp-vxlan`, its sender's identity
    /// (`overlay::mark_sender`); inside `vm_snat6_ext`, its header walk's
    /// result, cleared before it routes on.
    pub const SCRATCH: usize = 4;
}

/// `skb->mark` of a frame the data path sends out of a VM port's host side
/// (`bpf_redirect` or `bpf_clone_redirect` to its egress: the gateway's
/// replies, the slow path's, flood copies), so `vm_from_stack` there tells
/// them from the node stack's frames, which it judges by ingress policy.
/// Set only on frames bound for a port and cleared there (a copy's
/// original gets its own mark back): no other hook sees it. A pod cannot
/// forge it: a frame's mark is scrubbed when it leaves its namespace.
pub const DATA_PATH_MARK: u32 = 0x7670_6d01;

/// The family tag of an `AddrKey` (`AddrKey::family`): the IP version.
/// Not the kernel's socket address families (`kernel_af`).
pub mod addr_family {
    pub const IPV4: u8 = 4;
    pub const IPV6: u8 = 6;
}

/// The kernel's socket address families (`AF_INET`, `AF_INET6` of
/// linux/socket.h), as `bpf_fib_lookup` and `bpf_redirect_neigh` take them.
pub mod kernel_af {
    pub const AF_INET: u8 = 2;
    pub const AF_INET6: u8 = 10;
}

/// IP protocol numbers the data path and the agent both branch on
/// (network-types' `IpProto`, as the `u8` the headers carry).
pub mod ip_proto {
    use network_types::ip::IpProto;

    pub const ICMP: u8 = IpProto::Icmp as u8;
    pub const TCP: u8 = IpProto::Tcp as u8;
    pub const UDP: u8 = IpProto::Udp as u8;
    pub const ICMPV6: u8 = IpProto::Ipv6Icmp as u8;
    pub const HOPOPTS: u8 = IpProto::HopOpt as u8;
}

impl EndpointKey {
    /// The key of `mac` in `network`. Built from 32-bit words: as a struct
    /// literal its padding can compile to a `memset` call in eBPF.
    #[inline(always)]
    pub const fn new(network: u32, mac: [u8; 6]) -> Self {
        let words: [u32; 3] = [
            network,
            u32::from_ne_bytes([mac[0], mac[1], mac[2], mac[3]]),
            u32::from_ne_bytes([mac[4], mac[5], 0, 0]),
        ];
        // SAFETY: `EndpointKey` is `#[repr(C)]`, 12 bytes of plain integers
        // (asserted), so every bit pattern of three u32s is a valid value;
        // the words are laid out as its fields are.
        unsafe { core::mem::transmute::<[u32; 3], EndpointKey>(words) }
    }
}

impl AddrKey {
    #[inline(always)]
    const fn from_words(network: u32, family: u8, addr: [u32; 4]) -> Self {
        let words: [u32; 6] = [
            network,
            u32::from_ne_bytes([family, 0, 0, 0]),
            addr[0],
            addr[1],
            addr[2],
            addr[3],
        ];
        // SAFETY: `AddrKey` is `#[repr(C)]`, 24 bytes of plain integers and
        // byte arrays (asserted), so every bit pattern of six u32s is a
        // valid value.
        unsafe { core::mem::transmute::<[u32; 6], AddrKey>(words) }
    }

    /// The key of an IPv4 address (in the first 4 bytes of `addr`).
    #[inline(always)]
    pub const fn v4(network: u32, addr: [u8; 4]) -> Self {
        Self::from_words(
            network,
            addr_family::IPV4,
            [u32::from_ne_bytes(addr), 0, 0, 0],
        )
    }

    /// The key of an IPv6 address.
    #[inline(always)]
    pub fn v6(network: u32, addr: &[u8; 16]) -> Self {
        // SAFETY: same size; every bit pattern is a valid `[u32; 4]`.
        let words = unsafe { core::mem::transmute::<[u8; 16], [u32; 4]>(*addr) };
        Self::from_words(network, addr_family::IPV6, words)
    }

    /// The key of either kind of address.
    pub fn from_ip(network: u32, ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::v4(network, v4.octets()),
            IpAddr::V6(v6) => Self::v6(network, &v6.octets()),
        }
    }

    /// The address the key holds.
    pub fn ip(&self) -> IpAddr {
        if self.family == addr_family::IPV4 {
            let a = &self.addr;
            IpAddr::from([a[0], a[1], a[2], a[3]])
        } else {
            IpAddr::from(self.addr)
        }
    }
}

impl NatKey {
    /// One direction of a flow. Built from 32-bit words: as a struct
    /// literal its 3 bytes of padding compile to a `memset` call in eBPF.
    #[inline(always)]
    pub const fn new(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, proto: u8) -> Self {
        let (s, d) = (sport.to_ne_bytes(), dport.to_ne_bytes());
        let words: [u32; 4] = [
            u32::from_ne_bytes(src),
            u32::from_ne_bytes(dst),
            u32::from_ne_bytes([s[0], s[1], d[0], d[1]]),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ];
        // SAFETY: `NatKey` is `#[repr(C)]`, 16 bytes of plain integers and
        // byte arrays (asserted), so every bit pattern is a valid value.
        unsafe { core::mem::transmute::<[u32; 4], NatKey>(words) }
    }

    /// The key a reply to a translated flow carries on the uplink: from
    /// `remote`:`remote_port` to the node's SNAT address `snat`:`port`.
    /// ICMP echo replies carry the (translated) identifier in both.
    #[inline(always)]
    pub fn reply(remote: [u8; 4], snat: [u8; 4], remote_port: u16, port: u16, proto: u8) -> Self {
        let sport = if proto == ip_proto::ICMP {
            port
        } else {
            remote_port
        };
        Self::new(remote, snat, sport, port, proto)
    }

    /// The reply key of the VM-side key `self` translated to `out`.
    #[inline(always)]
    pub fn reply_to(&self, out: &NatEntry) -> Self {
        Self::reply(self.dst, out.addr, self.dport, out.port, self.proto)
    }
}

impl NatKey6 {
    /// One direction of a flow. Built from 32-bit words: as a struct
    /// literal its padding compiles to a `memset` call in eBPF.
    #[inline(always)]
    pub fn new(src: &[u8; 16], dst: &[u8; 16], sport: u16, dport: u16, proto: u8) -> Self {
        // SAFETY: same size; every bit pattern is a valid `[u32; 4]`.
        let (s, d) = unsafe {
            (
                core::mem::transmute::<[u8; 16], [u32; 4]>(*src),
                core::mem::transmute::<[u8; 16], [u32; 4]>(*dst),
            )
        };
        let (sp, dp) = (sport.to_ne_bytes(), dport.to_ne_bytes());
        let words: [u32; 10] = [
            s[0],
            s[1],
            s[2],
            s[3],
            d[0],
            d[1],
            d[2],
            d[3],
            u32::from_ne_bytes([sp[0], sp[1], dp[0], dp[1]]),
            u32::from_ne_bytes([proto, 0, 0, 0]),
        ];
        // SAFETY: `NatKey6` is `#[repr(C)]`, 40 bytes of plain integers and
        // byte arrays (asserted), so every bit pattern is a valid value.
        unsafe { core::mem::transmute::<[u32; 10], NatKey6>(words) }
    }

    /// The key a reply to a translated flow carries on the uplink (see
    /// `NatKey::reply`; ICMPv6 echo replies carry the identifier in both).
    #[inline(always)]
    pub fn reply(
        remote: &[u8; 16],
        snat: &[u8; 16],
        remote_port: u16,
        port: u16,
        proto: u8,
    ) -> Self {
        let sport = if proto == ip_proto::ICMPV6 {
            port
        } else {
            remote_port
        };
        Self::new(remote, snat, sport, port, proto)
    }

    /// The reply key of the VM-side key `self` translated to `out`.
    #[inline(always)]
    pub fn reply_to(&self, out: &NatEntry6) -> Self {
        Self::reply(&self.dst, &out.addr, self.dport, out.port, self.proto)
    }
}

impl SnatConfig {
    /// How long a flow of `proto` in `state` (`NAT_ST_*`) may stay idle.
    #[inline(always)]
    pub fn timeout_ns(&self, proto: u8, state: u8) -> u64 {
        let s = match proto {
            ip_proto::TCP if state == NAT_ST_CLOSING => self.tcp_closing_timeout,
            ip_proto::TCP => self.tcp_timeout,
            ip_proto::UDP => self.udp_timeout,
            _ => self.icmp_timeout,
        };
        u64::from(s) * 1_000_000_000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adoption, cleanup and the start-up repair find a port's links by
    /// their pins' names: both programs', never another link's.
    #[test]
    fn a_port_link_pin_names_its_port_and_nothing_else_does() {
        assert_eq!(prog_names::port_pin_ifindex("vm_port-12"), Some(12));
        assert_eq!(prog_names::port_pin_ifindex("vm_from_stack-7"), Some(7));
        for other in [
            "uplink-12",
            "vxlan_rx-3",
            "vxlan_from_stack-3",
            "vm_port",
            "vm_port-x",
        ] {
            assert_eq!(prog_names::port_pin_ifindex(other), None, "{other}");
        }
    }

    /// Metrics, the API and the monitor name a counter by `NAMES[reason]`:
    /// each name must sit at its reason's index, be the constant's own name
    /// in lower case (what docs/operations.md lists) and be one reason's.
    #[test]
    fn each_drop_reason_is_named_at_its_index_once() {
        assert_eq!(drop_reason::TABLE.len(), drop_reason::COUNT as usize);
        for (value, constant, name) in drop_reason::TABLE {
            assert_eq!(drop_reason::NAMES[value as usize], name, "{constant}");
            assert!(
                constant.eq_ignore_ascii_case(name),
                "{constant} = {value} is named {name:?}"
            );
        }
        for (i, a) in drop_reason::NAMES.iter().enumerate() {
            for b in &drop_reason::NAMES[i + 1..] {
                assert_ne!(a, b, "two reasons named {a}");
            }
        }
        assert_eq!(
            drop_reason::NAMES[drop_reason::MAC_SPOOF as usize],
            "mac_spoof"
        );
        assert_eq!(
            drop_reason::NAMES[drop_reason::MIGRATION_NOT_RESUMED as usize],
            "migration_not_resumed"
        );
    }

    #[test]
    fn key_constructors_lay_out_the_fields_as_the_struct_literals_do() {
        let mac = [2, 0, 0, 0, 0, 9];
        assert_eq!(
            EndpointKey::new(7, mac),
            EndpointKey {
                network: 7,
                mac,
                _pad: [0; 2]
            }
        );
        let mut a = [0u8; 16];
        a[..4].copy_from_slice(&[10, 0, 0, 5]);
        assert_eq!(
            AddrKey::v4(7, [10, 0, 0, 5]),
            AddrKey {
                network: 7,
                family: addr_family::IPV4,
                _pad: [0; 3],
                addr: a
            }
        );
        let v6 = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert_eq!(
            AddrKey::v6(7, &v6),
            AddrKey {
                network: 7,
                family: addr_family::IPV6,
                _pad: [0; 3],
                addr: v6
            }
        );
        assert_eq!(
            NatKey::new([10, 0, 0, 5], [198, 51, 100, 1], 5555, 53, ip_proto::UDP),
            NatKey {
                src: [10, 0, 0, 5],
                dst: [198, 51, 100, 1],
                sport: 5555,
                dport: 53,
                proto: ip_proto::UDP,
                _pad: [0; 3]
            }
        );
    }

    #[test]
    fn a_reply_key_swaps_the_ends_onto_the_translation() {
        let vm = NatKey::new([10, 0, 0, 5], [198, 51, 100, 1], 5555, 53, ip_proto::UDP);
        let out = NatEntry {
            addr: [192, 0, 2, 1],
            port: 40001,
            ..Default::default()
        };
        assert_eq!(
            vm.reply_to(&out),
            NatKey::new([198, 51, 100, 1], [192, 0, 2, 1], 53, 40001, ip_proto::UDP)
        );
        // ICMP echo: the reply carries the translated identifier both ways.
        let ping = NatKey::new([10, 0, 0, 5], [198, 51, 100, 1], 77, 77, ip_proto::ICMP);
        assert_eq!(
            ping.reply_to(&out),
            NatKey::new(
                [198, 51, 100, 1],
                [192, 0, 2, 1],
                40001,
                40001,
                ip_proto::ICMP
            )
        );
    }

    #[test]
    fn ipv6_nat_keys_lay_out_and_reply_as_the_ipv4_ones() {
        let vm = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5];
        let remote = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let node = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x11];
        let k = NatKey6::new(&vm, &remote, 5555, 53, ip_proto::UDP);
        assert_eq!(
            k,
            NatKey6 {
                src: vm,
                dst: remote,
                sport: 5555,
                dport: 53,
                proto: ip_proto::UDP,
                _pad: [0; 3]
            }
        );
        let out = NatEntry6 {
            addr: node,
            port: 40001,
            ..Default::default()
        };
        assert_eq!(
            k.reply_to(&out),
            NatKey6::new(&remote, &node, 53, 40001, ip_proto::UDP)
        );
        let ping = NatKey6::new(&vm, &remote, 77, 77, ip_proto::ICMPV6);
        assert_eq!(
            ping.reply_to(&out),
            NatKey6::new(&remote, &node, 40001, 40001, ip_proto::ICMPV6)
        );
    }

    #[test]
    fn snat_timeouts_follow_protocol_and_state() {
        let cfg = SnatConfig {
            tcp_timeout: 7440,
            tcp_closing_timeout: 240,
            udp_timeout: 300,
            icmp_timeout: 60,
            ..Default::default()
        };
        let s = 1_000_000_000;
        assert_eq!(cfg.timeout_ns(ip_proto::TCP, NAT_ST_OPEN), 7440 * s);
        assert_eq!(cfg.timeout_ns(ip_proto::TCP, NAT_ST_CLOSING), 240 * s);
        assert_eq!(cfg.timeout_ns(ip_proto::UDP, NAT_ST_OPEN), 300 * s);
        assert_eq!(cfg.timeout_ns(ip_proto::ICMP, NAT_ST_OPEN), 60 * s);
    }

    #[test]
    fn map_names_stay_distinct_as_bpftool_shows_them() {
        // The kernel keeps 15 bytes of a map's name (BPF_OBJ_NAME_LEN 16
        // with the NUL); pin files keep the whole name.
        let shown = |n: &'static str| &n[..n.len().min(15)];
        for (i, a) in maps::ALL.iter().enumerate() {
            for b in &maps::ALL[i + 1..] {
                assert_ne!(shown(a.name), shown(b.name), "{} and {}", a.name, b.name);
            }
        }
    }
}
