//! vmpath node agent: config -> validation -> plan -> pinned eBPF maps.

pub mod agent;
pub mod config;
pub mod dataplane;
pub mod plan;
pub mod view;
pub use vmpath_common as common;
