//! Map keys, values and constants shared by the eBPF programs and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding so the kernel and
//! userspace agree byte for byte; sizes are asserted at compile time.
//! Enums that cross into the kernel are plain integers.
#![no_std]

use core::mem::size_of;

/// Map names as the kernel (and `bpftool`) sees them; also the pin file names.
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
    pub const ALL: [&str; 9] = [
        PORTS,
        ENDPOINTS,
        ADDRESSES,
        NETWORKS,
        FLOOD,
        DROPS,
        PORT_STATS,
        LEARNED_MACS,
        LEARNED_IPS,
    ];
}

/// Program names (the Rust function names in the eBPF crate).
pub mod prog_names {
    pub const VM_PORT: &str = "vm_port";
}

/// Layout version of the pinned maps. Bump when any type below changes size
/// or meaning; pins live under `maps/v{MAP_LAYOUT_VERSION}`.
pub const MAP_LAYOUT_VERSION: u32 = 1;

pub const MAX_PORTS: u32 = 4096;
pub const MAX_ENDPOINTS: u32 = 65536;
pub const MAX_ADDRESSES: u32 = 65536;
pub const MAX_NETWORKS: u32 = 4096;
pub const MAX_LEARNED_IPS: u32 = 65536;
/// Local ports one network can flood to on one node.
pub const MAX_FLOOD_PORTS: usize = 64;

/// Port flags (`PortInfo::flags`).
pub const PORT_F_MAC_FILTER: u16 = 1 << 0;
pub const PORT_F_IP_FILTER: u16 = 1 << 1;
/// The port's MAC is known (given or detected); without it the MAC filter
/// cannot apply yet.
pub const PORT_F_MAC_KNOWN: u16 = 1 << 2;

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
}
const _: () = assert!(size_of::<PortInfo>() == 16);

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
    pub _pad: u32,
}
const _: () = assert!(size_of::<Endpoint>() == 16);

pub const AF_INET: u8 = 4;
pub const AF_INET6: u8 = 6;

/// (network, IP) -> owning attachment. IPv4 addresses use the first 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AddrKey {
    pub network: u32,
    /// `AF_INET` or `AF_INET6`.
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
}
const _: () = assert!(size_of::<AddrInfo>() == 16);

/// Network flags (`NetworkInfo::flags`).
pub const NET_F_GW4: u16 = 1 << 0;
pub const NET_F_GW6: u16 = 1 << 1;

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
    pub _pad: u32,
    pub ifindex: [u32; MAX_FLOOD_PORTS],
}
const _: () = assert!(size_of::<FloodList>() == 8 + 4 * MAX_FLOOD_PORTS);

impl Default for FloodList {
    fn default() -> Self {
        Self {
            count: 0,
            _pad: 0,
            ifindex: [0; MAX_FLOOD_PORTS],
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
/// (network, IP) in an LRU map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedIp {
    pub ifindex: u32,
    pub how: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}
const _: () = assert!(size_of::<LearnedIp>() == 16);

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

/// Why the data path dropped a frame: the index into the `vmp_drops` per-CPU
/// array. Plain integers so they cross into the kernel unchanged.
pub mod drop_reason {
    /// Truncated or malformed header.
    pub const MALFORMED: u32 = 0;
    /// The frame arrived on an interface that is not (or no longer) a port.
    pub const UNKNOWN_PORT: u32 = 1;
    /// Ethernet source MAC is not the port's MAC.
    pub const MAC_SPOOF: u32 = 2;
    /// IPv4/IPv6 source address is not one of the port's addresses.
    pub const IP_SPOOF: u32 = 3;
    /// ARP sender MAC or sender IP is not the port's.
    pub const ARP_SPOOF: u32 = 4;
    /// Ethertype not allowed while IP filtering is on (VLAN tags, ...).
    pub const ETHERTYPE: u32 = 5;
    /// Nowhere to deliver: no other port in the network.
    pub const NO_DESTINATION: u32 = 6;
    /// Sent to the gateway MAC but not something the gateway answers, and
    /// the network has no routed or SNAT egress.
    pub const GATEWAY_UNROUTED: u32 = 7;
    /// The port's network is not programmed.
    pub const NO_NETWORK: u32 = 8;
    /// Source MAC is multicast/broadcast.
    pub const SRC_MULTICAST: u32 = 9;
    /// A kernel helper refused (redirect, resize).
    pub const HELPER_FAILED: u32 = 10;
    pub const COUNT: u32 = 11;

    /// Names as shown in metrics and the CLI, indexed by reason.
    pub const NAMES: [&str; COUNT as usize] = [
        "malformed",
        "unknown_port",
        "mac_spoof",
        "ip_spoof",
        "arp_spoof",
        "ethertype",
        "no_destination",
        "gateway_unrouted",
        "no_network",
        "src_multicast",
        "helper_failed",
    ];
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
}
