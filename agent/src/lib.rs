//! vmpath node agent: config -> validation -> plan -> pinned eBPF maps.

pub mod agent;
pub mod api;
pub mod apply;
pub mod cli;
pub mod config;
pub mod controller;
pub mod derive;
pub mod metrics;
pub mod monitor;
pub mod observe;
pub mod plan;
pub mod publish;
pub mod read;
pub mod resolve;
pub mod round;
pub mod slowpath;
pub mod sys;
pub use vmpath_common as common;
