//! SNAT for networks with `egress: SNAT`: TCP, UDP and ICMP echo
//! leave with the node's SNAT address and a port (or ICMP identifier) from
//! the node's reserved range; return traffic on the uplink is translated
//! back. Per-flow state lives in two LRU maps, one per direction, each
//! entry refreshed by traffic either way and judged against a
//! protocol-appropriate idle timeout; the agent sweeps expired flows and
//! recounts each VM's ports (the quota).
//!
//! On a SNAT network with routed ingress (`NET_F_INGRESS`), flows opened
//! from outside to a VM's own address are recorded where they are
//! delivered (`track_inbound4`, from `uplink` and `vxlan_rx`) in
//! `vmp_inbound`, keyed by the tuple the VM's replies carry; the egress
//! path sends a frame that matches one un-NATed, unless the tuple is an
//! outbound SNAT flow already (that one keeps its translation).
//!
//! The transport checksum is fixed with `bpf_l4_csum_replace` (the IPv4
//! header's in place, `csum::replace_addr4`); address changes use
//! `BPF_F_PSEUDO_HDR`, so a frame a veth hands over
//! with CHECKSUM_PARTIAL (only the pseudo-header sum filled in) stays
//! right, and a full checksum is updated incrementally.
//!
//! Layered bottom up, no module using one above it: `maps` (both
//! families' tables), `flow` (what a flow of either family is and how it
//! lives: the transport fields read, timeouts, refreshes, inbound records,
//! an established flow's check, a new flow's port allocation, the port
//! rewrite, the delivery to the VM), `icmp` (ICMP errors for SNAT flows,
//! both families), then `ipv4` and `ipv6` (each family's way out and back,
//! which hands ICMP errors to `icmp`).
//!
//! What the families share is written once, generic over `flow::Family`
//! (`ipv4::V4`, `ipv6::V6`: key, entry, tables) and `flow::FlowEntry`, and
//! monomorphised per family: each program still inlines its own family's
//! code, as before. What differs stays apart: the headers (IPv4's
//! checksum and fragments, IPv6's extension headers), and the return
//! path, whose IPv6 side reads its entry in place to save stack.

pub mod flow;
pub mod icmp;
pub mod ipv4;
pub mod ipv6;
pub mod maps;
