//! Stage 4, **resolve**: the validated [`Config`] is never rewritten; it
//! goes into a [`Resolved`], which the next stages enrich (addresses and
//! MACs from IPAM, detected MACs, learned addresses, cut-overs). Here an
//! Attachment whose port on this node is not a VM port is refused, before
//! IPAM, so nothing is claimed for it.

use crate::{
    config::Config,
    resolve::resolved::{Carry, Entry, Indexes, Resolved},
};

/// The enrichment stage's start: `validated` as `node` serves it.
pub fn resolve(validated: impl Into<std::sync::Arc<Config>>, node: &str) -> Resolved {
    let mut phases = crate::sys::phases::Phases::start("resolve");
    let mut cfg = Resolved::for_node(validated, node);
    phases.mark("given");
    if let Some(policy) = crate::resolve::port_eligibility::policy() {
        crate::resolve::port_eligibility::refuse_ineligible(&mut cfg, node, policy);
    }
    phases.mark("eligibility");
    phases.log();
    cfg
}

/// As [`resolve`], carrying over the entries the last round ended with
/// and their [`Indexes`] (`Resolved::carrying_with`); returns what was
/// not carried, for IPAM.
pub fn resolve_carrying(
    validated: impl Into<std::sync::Arc<Config>>,
    node: &str,
    last: Vec<Entry>,
    last_indexes: &Indexes,
) -> (Resolved, Carry) {
    let mut phases = crate::sys::phases::Phases::start("resolve");
    let (mut cfg, carry) = Resolved::carrying_with(validated, node, last, last_indexes);
    phases.mark("carried");
    if let Some(policy) = crate::resolve::port_eligibility::policy() {
        crate::resolve::port_eligibility::refuse_ineligible(&mut cfg, node, policy);
    }
    phases.mark("eligibility");
    phases.log();
    (cfg, carry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::tests::{BLUE, attachment, snapshot_of};

    #[test]
    fn every_valid_attachment_is_carried_unresolved() {
        let snap = snapshot_of(&format!("{BLUE}---\n{}", attachment("vm1", "a")));
        let cfg = resolve(
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        assert_eq!(cfg.attachments.len(), 1);
        // IPAM has not run: no address yet.
        assert!(cfg.attachments[0].addresses.is_empty());
    }
}
