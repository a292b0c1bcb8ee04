//! The resolve and IPAM stages' substance: what this round runs, the
//! validated config enriched.
//!
//! | module | what |
//! |---|---|
//! | [`resolved`] | the [`Resolved`](resolved::Resolved) config: each attachment with its addresses, MAC and origin |
//! | [`ipam`] | addresses and MACs from the claims, allocated where none |
//! | [`store`] | the claims store (redb under the state dir) |
//! | [`port_eligibility`] | which interfaces may carry the VM-port program |

pub mod ipam;
pub mod port_eligibility;
pub mod resolved;
pub mod store;
