//! The operating system's plumbing, under every stage and service: it
//! knows no stage of the round and no node service, so any module may use
//! it (the layering test in `xtask/src/modgraph.rs` holds it to that).
//!
//! | module | what |
//! |---|---|
//! | [`background`] | housekeeping threads in the idle class |
//! | [`clock`] | the kernel's monotonic clock, wall-clock seconds |
//! | [`drop_later`] | freeing big structures off the reconcile loop's path |
//! | [`events`] | what wakes the reconcile loop (inotify, link notifications) |
//! | [`hash`] | FNV-1a, the stable hash |
//! | [`intern`] | shared names: one copy of each, however many hold it |
//! | [`ip_map`] | maps keyed by an address, IPv4 apart (half the entry) |
//! | [`latest`] | records written off the loop's path, the latest only |
//! | [`limits`] | the bounds every config file and object is read under |
//! | [`netif`] | interface lookups: names, indexes, MTUs, addresses |
//! | [`netlink`] | the agent's one netlink stack |
//! | [`phases`] | where a pass spends its time (debug log) |
//! | [`ring_wait`] | the wait loop of the ring-buffer readers |
//! | [`state_dir`] | the state dir's modes (root's alone) |
//! | [`text`] | values read and written as a string |
//! | [`thin_slice`] | a shared slice behind one word |
//! | [`tc_filters`] | the VM ports' tc filters as the kernel has them |
//! | [`version`] | this build's version and revision |
//! | [`xdp_features`] | a device's XDP features (netdev generic netlink) |

pub mod background;
pub mod clock;
pub mod drop_later;
pub mod events;
pub mod hash;
pub mod intern;
pub mod ip_map;
pub mod latest;
pub mod limits;
pub mod netif;
pub mod netlink;
pub mod phases;
pub mod ring_wait;
pub mod sorted;
pub mod state_dir;
pub mod tc_filters;
pub mod text;
pub mod thin_slice;
pub mod version;
pub mod xdp_features;
