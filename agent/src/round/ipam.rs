//! Stage 5, **IPAM**: each attachment gets its addresses and MAC
//! (`ipam::assign` against the claims in `--state-dir/claims.redb`: keep
//! what is claimed, allocate what is missing, release what no Attachment
//! names), written in one transaction; then MACs the data path saw on
//! ports whose MAC was not given are adopted into claims
//! ([`adopt_detected_macs`]).

use std::collections::BTreeSet;

use anyhow::{Context as _, Result};
use tracing::{error, info};

use crate::{
    config::{AttachmentKey, ConfigError, format_mac},
    resolve::ipam,
    resolve::ipam_memo::Memo,
    resolve::resolved::{Carry, Origin, Resolved},
    resolve::store::Store,
};

/// Every claim, by VM interface.
pub use crate::resolve::store::Claims;

/// Assigns addresses and MACs to `cfg`'s attachments and records the
/// claims; returns the claims as they now are.
pub fn assign(cfg: &mut Resolved, store: &Store) -> Result<std::sync::Arc<Claims>> {
    let claims = store.shared().context("reading claims")?;
    let changes = ipam::assign(cfg, &claims);
    // The store's copy alone, so that it is updated in place.
    drop(claims);
    record(store, &changes)
}

/// Writes `changes` (logged) and returns the claims as they now are.
fn record(store: &Store, changes: &ipam::ClaimChanges) -> Result<std::sync::Arc<Claims>> {
    if !changes.is_empty() {
        store.apply(changes).context("writing claims")?;
        log_changes(changes);
    }
    store.shared().context("reading claims")
}

/// As [`assign`], deciding only what changed since the last round when
/// `memo` shows that gives the same (`resolve::ipam_memo`), and keeping
/// `memo` for the next round. Returns the claims as they now are and
/// whether only what changed was decided.
pub fn assign_incremental(
    cfg: &mut Resolved,
    carry: &Carry,
    store: &Store,
    memo: &mut Option<Memo>,
) -> Result<(std::sync::Arc<Claims>, bool)> {
    let claims = store.shared().context("reading claims")?;
    let generation = store.generation();
    let increment = memo
        .as_mut()
        .and_then(|m| m.assign(cfg, carry, &claims, generation));
    let incremental = increment.is_some();
    let (changes, settled) = match increment {
        Some(r) => r,
        None => {
            // Every entry decided again from its document; those that
            // come out as they were still count as carried over.
            let before = cfg.as_given();
            let decided = ipam::assign_settled(cfg, &claims);
            cfg.changed_since(before);
            decided
        }
    };
    tracing::debug!(incremental, settled, changes = changes.len(), "IPAM");
    drop(claims);
    let claims = record(store, &changes).inspect_err(|_| {
        // The memo no longer knows the claims.
        *memo = None;
    })?;
    let generation = store.generation();
    *memo = match (settled, incremental, memo.take()) {
        (false, ..) => None,
        (true, true, Some(mut m)) => {
            m.written(generation);
            Some(m)
        }
        _ => Memo::of(cfg, &claims, generation),
    };
    Ok((claims, incremental))
}

fn log_changes(changes: &ipam::ClaimChanges) {
    for (key, change) in changes {
        match change {
            Some(c) => {
                info!(vm = %key, network = %c.network, ips = ?c.ips.iter().map(|i| i.to_string()).collect::<Vec<_>>(), mac = ?c.mac.as_ref().map(crate::config::format_mac), "claim recorded")
            }
            None => info!(vm = %key, "claim released"),
        }
    }
}

/// Writes claim changes and mirrors them into `claims`.
pub fn commit_claims(
    store: &Store,
    claims: &mut Claims,
    changes: ipam::ClaimChanges,
) -> Result<()> {
    store.apply(&changes)?;
    log_changes(&changes);
    for (key, change) in changes {
        match change {
            Some(c) => {
                claims.insert(key.into(), c);
            }
            None => {
                claims.remove::<str>(&key);
            }
        }
    }
    Ok(())
}

/// A MAC the data path saw on a port (`vmp_learned_mac`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenMac {
    pub ifindex: u32,
    pub mac: [u8; 6],
}

/// Adopts the MACs `seen` on this node's ports whose MAC was not given:
/// claimed, and the attachment's MAC from now on (`detected`). One that
/// belongs to another VM on the network is refused (returned, for the
/// VM's VMI or pod as an Event; logged once per VM interface and MAC,
/// `refused_macs` remembers which), and nothing else changes.
pub fn adopt_detected_macs(
    cfg: &mut Resolved,
    node: &str,
    store: &Store,
    claims: &mut std::sync::Arc<Claims>,
    seen: impl IntoIterator<Item = SeenMac>,
    ifindex_of: impl Fn(&str) -> Option<u32>,
    refused_macs: &mut BTreeSet<(AttachmentKey, [u8; 6])>,
) -> Vec<ConfigError> {
    let mut mac_refusals: Vec<ConfigError> = Vec::new();
    for learned in seen {
        let ifindex = learned.ifindex;
        let Some(a) = cfg.attachments.iter().find(|a| {
            !a.elsewhere
                && a.active_node() == node
                && a.mac_resolved.is_none()
                && ifindex_of(a.active_port()) == Some(ifindex)
        }) else {
            continue;
        };
        let key = a.key.clone();
        match ipam::detected_mac(cfg, claims, &key, learned.mac) {
            Ok(changes) if !changes.is_empty() => {
                info!(vm = %key, mac = %format_mac(&learned.mac), "MAC detected from the VM's traffic");
                if let Err(e) = commit_claims(store, std::sync::Arc::make_mut(claims), changes) {
                    error!("writing claims: {e}");
                    continue;
                }
                if let Some(a) = cfg.attachment_mut(&key) {
                    a.mac_resolved = Some((learned.mac, Origin::Detected));
                }
            }
            Ok(_) => {}
            Err(msg) => {
                mac_refusals.push(ConfigError {
                    file: a.source.file.to_path_buf(),
                    document: a.source.document(),
                    field: "detected MAC".into(),
                    message: msg.clone(),
                    about: a.source.origin.about(),
                    reason: None,
                });
                if !refused_macs.contains(&(key.clone(), learned.mac)) {
                    error!(vm = %key, "{msg}");
                    refused_macs.insert((key.clone(), learned.mac));
                }
            }
        }
    }
    mac_refusals
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::{
        resolve::resolve,
        tests::{BLUE, attachment, snapshot_of},
    };

    const VM2_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 2];

    #[test]
    fn claims_addresses_and_adopts_a_detected_mac_refusing_another_vms() {
        let dir = std::env::temp_dir().join(format!("vmpath-round-ipam-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = Store::open(&dir).unwrap();
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm1", "a"),
            attachment("vm2", "a")
                .replace("port: vm2p", "port: vm2p\n  mac: \"52:54:00:00:00:02\"")
        ));
        let mut cfg = resolve(
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        let mut claims = assign(&mut cfg, &store).unwrap();
        assert!(cfg.attachments.iter().all(|a| !a.addresses.is_empty()));
        assert_eq!(store.all().unwrap(), *claims);

        // vm1's port (ifindex 1) speaks from vm2's MAC: refused, named.
        let ports = |p: &str| match p {
            "vm1p" => Some(1),
            "vm2p" => Some(2),
            _ => None,
        };
        let mut refused = BTreeSet::new();
        let seen = [SeenMac {
            ifindex: 1,
            mac: VM2_MAC,
        }];
        let refusals = adopt_detected_macs(
            &mut cfg,
            "a",
            &store,
            &mut claims,
            seen,
            ports,
            &mut refused,
        );
        assert_eq!(refusals.len(), 1, "{refusals:?}");
        assert_eq!(refusals[0].field, "detected MAC");
        assert!(
            refusals[0].document.contains("vm1-eth0"),
            "{:?}",
            refusals[0]
        );
        assert!(cfg.attachments[0].mac_resolved.is_none());

        // Its own MAC: adopted and claimed.
        let mine = [0x52, 0x54, 0, 0, 0, 1];
        let seen = [SeenMac {
            ifindex: 1,
            mac: mine,
        }];
        let refusals = adopt_detected_macs(
            &mut cfg,
            "a",
            &store,
            &mut claims,
            seen,
            ports,
            &mut refused,
        );
        assert!(refusals.is_empty(), "{refusals:?}");
        assert_eq!(
            cfg.attachments[0].mac_resolved,
            Some((mine, Origin::Detected))
        );
        assert!(
            store
                .all()
                .unwrap()
                .values()
                .any(|c| c.mac == Some([0x52, 0x54, 0, 0, 0, 1]))
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
