//! The resolve and IPAM stages' substance: what this round runs, the
//! validated config enriched.
//!
//! | module | what |
//! |---|---|
//! | [`resolved`] | the [`Resolved`](resolved::Resolved) config: each attachment with its addresses, MAC and origin |
//! | [`ipam`] | addresses and MACs from the claims, allocated where none |
//! | [`ipam_memo`] | the same for what changed since the last round, when that gives the same |
//! | [`store`] | the claims store (redb under the state dir) |
//! | [`port_eligibility`] | which interfaces may carry the VM-port program |

pub mod ipam;
pub mod ipam_memo;
pub mod port_eligibility;
pub mod resolved;
pub mod store;
