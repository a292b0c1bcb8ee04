//! The programs' entries: one file per hook or program family, as Cilium
//! keeps `bpf_lxc.c`, `bpf_host.c` and `bpf_overlay.c` apart from its
//! `lib/`. Each holds its programs' `#[classifier]`/`#[xdp]` functions (the
//! names the agent loads them by) and the program's own top-level flow
//! (its `try_*`): what a reader follows from the hook down. Everything two
//! programs share, or a program calls to reach another (the tail calls'
//! `to_*` helpers), is library, in the crate's other modules: they never
//! use these, so a program's file can change without touching another's,
//! and the library's modules layer without cycles (`verdict` at the
//! bottom: the verdict type, redirects and the tail-call array).
//!
//! - `port`: `vm_port`, tcx ingress of a VM port (every frame a VM sends)
//! - `stack`: `vm_from_stack`, tcx egress of a VM port (what the node's
//!   stack sends the VM meets its ingress policy)
//! - `egress`: `vm_egress` (routed and SNAT egress) and `vm_snat6_ext`
//!   (IPv6 through SNAT with extension headers), its tail call
//! - `remote`: `vm_remote`, to other nodes over the overlay
//! - `flood`: `vm_flood`, broadcast, multicast and unknown unicast
//! - `neigh`: `vm_neigh`, ARP and NS answered for known addresses
//! - `policy`: `vm_policy_out`, `vm_policy_in` (NetworkPolicy)
//! - `service`: `vm_service`, `vm_service6`, `vm_service_in` (ClusterIPs)
//! - `migrate`: `vm_migrate`, a live migration's target port
//! - `uplink`: `uplink`, `uplink_resolve` (tcx ingress of the uplink);
//!   `uplink_xdp`: its XDP fast path
//! - `vxlan`: `vxlan_rx`, `vxlan_resolve` (tcx ingress of `vmp-vxlan`)
//! - `reach`: `vxlan_from_stack` (tcx egress of `vmp-vxlan`) and
//!   `vxlan_reach`, its tail call from `vxlan_rx`: a node's stack and the
//!   Primary networks' endpoints on other nodes
//! - `slowpath`: `slow_rx`, `slow_return` (the slow path's interfaces)
//! - `bench.rs` is not a module of this crate: it is the root of the
//!   bench's own object (`vmpath-bench`, ebpf/Cargo.toml), kept here
//!   because it holds nothing but entries.

mod egress;
mod flood;
mod migrate;
mod neigh;
mod policy;
mod port;
mod reach;
mod remote;
mod service;
mod slowpath;
mod stack;
mod uplink;
mod uplink_xdp;
mod vxlan;
