//! Stage 3, **validate**: every document checked
//! (`config::validate_documents`, [config.md](../../../docs/config.md)
//! lists each check) into the validated [`Config`]: the valid documents,
//! and the refused ones with file, document, field and message. Who holds
//! which address and MAC ([`held`]) decides conflicts, so that after a
//! restart document order does not.

use crate::{
    config::{Config, Held, KeepFirst, Translated, source::Snapshot, validate_documents},
    resolve::store::Claims,
};

/// Who holds which address and MAC: the claims store's `claims`, then the
/// ports served here (an IPAM-less address, a given MAC: no claim records
/// them), as the last round served them or, after a restart, as the data
/// path holds them from the previous agent (`running`).
pub fn held(claims: Option<&Claims>, running: &Held) -> Held {
    let mut held = claims.map(Held::from_claims).unwrap_or_default();
    held.port_ips.clone_from(&running.port_ips);
    held.port_macs.clone_from(&running.port_macs);
    held
}

/// Validates the `derived` documents of `snapshot` for `node`.
/// `keep_first`: attachments accepted by the previous round (they win a
/// conflict).
pub fn validate(
    snapshot: &Snapshot,
    derived: Translated,
    node: &str,
    keep_first: &dyn KeepFirst,
    held: &Held,
) -> Config {
    documents(snapshot, derived, node, keep_first, held)
}

/// The documents' part of [`validate`]: what they alone decide.
pub fn documents(
    snapshot: &Snapshot,
    derived: Translated,
    node: &str,
    keep_first: &dyn KeepFirst,
    held: &Held,
) -> Config {
    validate_documents(&snapshot.errors, derived, node, keep_first, held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::{
        derive::derive,
        tests::{BLUE, attachment, snapshot_of},
    };

    #[test]
    fn a_bad_document_is_refused_alone_naming_its_field() {
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm1", "a"),
            attachment("vm2", "a").replace("network: blue", "network: red")
        ));
        let cfg = validate(
            &snap,
            derive(&snap, "a"),
            "a",
            &crate::config::AcceptedKeys::new(),
            &Held::default(),
        );
        assert_eq!(cfg.attachments.len(), 1);
        assert_eq!(cfg.errors.len(), 1, "{:?}", cfg.errors);
        assert_eq!(cfg.errors[0].field, "spec.network");
    }

    #[test]
    fn held_takes_the_claims_then_the_running_ports() {
        let mut running = Held::default();
        running
            .port_macs
            .insert((7, [2, 0, 0, 0, 0, 1]), "vm1p".into());
        let held = held(None, &running);
        assert_eq!(
            held.port_macs
                .get(&(7, [2, 0, 0, 0, 0, 1]))
                .map(String::as_str),
            Some("vm1p")
        );
    }
}
