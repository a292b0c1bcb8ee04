//! The publish stage's substance: what a round makes known, to the node
//! (the view: API, CLI, metrics, `status.json`) and to the cluster
//! (Events, annotations).
//!
//! | module | what |
//! |---|---|
//! | [`view`] | what the agent knows right now, published after each round |
//! | [`writeback`] | Kubernetes Events for refusals and waits, the MACs learned as a VMI annotation |

pub mod view;
pub mod writeback;
