//! The observe stage's substance: what the data path found, read back
//! into the round (it reads what apply programmed, so it sits above
//! `apply` in the folders' layering though it runs before plan).
//!
//! | module | what |
//! |---|---|
//! | [`learned`] | addresses the data path saw a guest use, which become vmpath's |
//! | [`migration`] | live migration, the agent's half: the cut-over the data path made |

pub mod learned;
pub mod migration;
