//! The vmpath agent's API, in one place for the three parties that speak
//! it: the agent (server), the `vmpath` CLI and the `vmpath-cni` plugin
//! (clients). JSON over HTTP/1.1 on a unix socket (root-only, mode 0600).
//!
//! - [`types`]: the answers of the admin endpoints (`/v1/status`,
//!   `/v1/networks`, `/v1/vms`, `/v1/monitor`, `/v1/debug/datapath`).
//! - [`cni`]: what the CNI plugin hands over (`/v1/endpoints`) and the
//!   alias that marks a port it made.
//! - [`client`]: the one client of the socket.
//! - [`path`]: the endpoints' paths.
//!
//! The wire format is what these types serialize to; changing a field is
//! changing the API.

pub mod client;
pub mod cni;
pub mod path;
pub mod types;

pub use client::{Answer, Client, ClientError};

/// Where the agent serves the API unless told otherwise (`--api-socket`).
pub const DEFAULT_SOCKET: &str = "/run/vmpath/api.sock";
