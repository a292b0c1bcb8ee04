//! Stage 2, **derive**: Kubernetes objects (Pods, VMIs, VMIMs, NADs,
//! IPAMClaims, Nodes) and CNI ports become vmpath's own documents
//! (Attachments and Nodes), beside the vmpath documents as given
//! (`derive::translate`). Nothing is checked here: that is the next
//! stage's job, and it never derives.

use crate::{
    config::{Translated, source::Snapshot},
    derive::translate,
};

/// Derives `snapshot`'s documents as `node` sees them.
pub fn derive(snapshot: &Snapshot, node: &str) -> Translated {
    let mut translated = translate::translate(
        &snapshot.documents,
        &snapshot.cluster,
        node,
        snapshot.pod_claims,
        snapshot.ledger.as_deref(),
    );
    // The flags' CIDRs first, then those the v1 Nodes report.
    translated
        .cluster_cidrs
        .splice(0..0, snapshot.cluster_cidrs.iter().cloned());
    translated
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::tests::{BLUE, snapshot_of};

    #[test]
    fn vmpath_documents_pass_through_as_given() {
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}",
            crate::round::tests::attachment("vm1", "a")
        ));
        let derived = derive(&snap, "a");
        assert_eq!(derived.documents.len(), 2);
        assert!(derived.errors.is_empty(), "{:?}", derived.errors);
    }
}
