//! The round's first stages chained: what was read (a
//! [`Snapshot`]: vmpath documents, Kubernetes objects, CNI ports) is
//! derived into vmpath's model (`cluster::translate`: Attachments and
//! Nodes from Pods, VMIs, NADs, IPAMClaims) and then validated
//! (`config::validate_documents`). Validation never derives itself, so
//! `config` needs nothing of `cluster`.

use std::collections::BTreeSet;

use crate::{
    cluster::translate,
    config::{AttachmentKey, Config, Held, source::Snapshot, validate_documents},
};

/// Derives and validates every document of `snapshot` for `node_name`.
/// `keep_first`: attachments accepted by the previous round (they win a
/// conflict).
pub fn validate(
    snapshot: &Snapshot,
    node_name: &str,
    keep_first: &BTreeSet<AttachmentKey>,
) -> Config {
    validate_held(snapshot, node_name, keep_first, &Held::default())
}

/// As [`validate`]; an address or MAC `held` records (the claims store)
/// stays with its VM interface whatever order the documents come in.
pub fn validate_held(
    snapshot: &Snapshot,
    node_name: &str,
    keep_first: &BTreeSet<AttachmentKey>,
    held: &Held,
) -> Config {
    let translated = translate::translate(
        &snapshot.documents,
        &snapshot.cluster,
        node_name,
        snapshot.pod_claims,
    );
    validate_documents(&snapshot.errors, translated, node_name, keep_first, held)
}
