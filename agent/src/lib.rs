//! vmpath node agent: config -> validation -> plan -> pinned eBPF maps.

pub mod agent;
pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dataplane;
pub mod endpoints;
pub mod events;
pub mod hash;
pub mod ipam;
pub mod metrics;
pub mod migration;
pub mod netif;
pub mod netlink;
pub mod node_lock;
pub mod overlay;
pub mod plan;
pub mod port_eligibility;
pub mod resolved;
pub mod routes;
pub mod slowpath;
pub mod snapshot;
pub mod snat;
pub mod store;
pub mod view;
pub use vmpath_common as common;
