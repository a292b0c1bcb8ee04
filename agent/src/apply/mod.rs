//! The apply stage's substance: the data path and the node's own state
//! programmed to a [`Plan`](crate::plan::Plan), the only stage that writes
//! them; and the lock that makes this agent the node's one writer.
//!
//! | module | what |
//! |---|---|
//! | [`dataplane`] | the eBPF object loaded, its maps pinned and written, the VM-port program attached |
//! | [`routes`] | routes for the node's BGP speaker, the hand-off's routes and rules |
//! | [`host_reach`] | the node reaches the endpoints of its Primary networks |
//! | [`overlay`] | the node's vxlan device and its program |
//! | [`snat`] | the SNAT port range reserved, expired flows swept |
//! | [`node_lock`] | one agent per node: the lock taken before anything is opened |

pub mod dataplane;
pub mod host_reach;
pub mod node_lock;
pub mod overlay;
pub mod routes;
pub mod snat;
