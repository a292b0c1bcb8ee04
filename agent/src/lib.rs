//! vmpath node agent: config -> validation -> plan -> pinned eBPF maps.
//!
//! One folder per part (docs/architecture.md, "The agent's folders"),
//! lowest first, each using only what comes before it (`AGENT_LAYERS` in
//! xtask/src/modgraph.rs, which a test holds the code to):
//!
//! - [`sys`]: the operating system's plumbing;
//! - the round's stages' substance: [`config`] (the documents, validate),
//!   [`derive`](mod@derive), [`resolve`] (and IPAM), [`publish`], [`read`], [`plan`],
//!   [`apply`], [`observe`];
//! - the node services: [`slowpath`], [`monitor`], [`api`], [`metrics`];
//! - [`round`] (the stages' drivers, chained), [`controller`] (a process
//!   of its own), [`agent`] (the main loop), [`cli`].

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
