//! IPAM for what changed: the VM interfaces whose documents changed since
//! the last round are decided ([`ipam::decide`](super::ipam::decide)), the
//! others keep what the last round gave them, and what is taken (claimed
//! addresses, MACs in use) is kept between rounds instead of built again
//! from every claim. At 10,000 VM interfaces building those maps was most
//! of a round's IPAM stage.
//!
//! It must give exactly what the full pass ([`ipam::assign`]) gives, and
//! it only runs where it can be shown to:
//!
//! - the claims are the ones the last round left (the store's generation
//!   is the one it wrote; a detected MAC or another writer: the full
//!   pass), and the networks are the same;
//! - the last round was *settled*: no refusal, no exhausted pool, no MAC
//!   that gave way to another's, no address or MAC held twice. Then each
//!   unchanged VM interface's result depends on its own claim alone, and
//!   a VM leaving frees nothing another was waiting for;
//! - the changed VM interfaces meet nothing held: no static address
//!   another's claim holds, no MAC (given, claimed or first generated)
//!   that anything in use has or a changed one before it took. The full
//!   pass decides those, and here that would depend on order; they fall
//!   back to it.
//!
//! The changed ones are decided in key order, as the full pass decides
//! them, against the same taken addresses: an allocation's probe sees
//! what it would see there. `round::equivalence` compares the two after
//! random sequences of changes.

use crate::{
    config::{AttachmentKey, Network},
    resolve::{
        ipam::{self, ClaimChanges, Macs, Taken},
        resolved::{Attachment, CHANGED, Carry, Resolved},
        store::{Claim, Claims},
    },
    sys::hash::{HashMap, HashSet},
    sys::sorted::{Side, merge},
};

/// What the last settled round left, for the next round's increment.
#[derive(Debug, Default)]
pub struct Memo {
    /// The networks it was decided with.
    networks: Vec<Network>,
    /// The keys the documents named (their claims are live), with the
    /// version of the set it mirrors.
    keys: crate::config::Keys,
    /// The kept claims it was decided with (`Resolved::kept_claims`).
    kept: crate::resolve::resolved::KeptClaims,
    /// Every live claim's addresses on a known network -> its key.
    /// Keys as names: the claims' own, shared with validation's map of them.
    /// The network's index as a `u32`: an entry per address of the
    /// cluster, 32 bytes each (40 with a `usize`).
    held: crate::sys::ip_map::IpMap<u32, crate::sys::intern::Name>,
    /// `held`'s addresses by network.
    taken: Taken,
    /// Every resolved MAC by network.
    macs: Macs,
    /// The claims store's generation with its claims written.
    generation: u64,
    /// The VM interfaces it decided were in key order (the increment
    /// decides in the full pass's order). The next round's list is this
    /// one with entries gone and others come or replaced: in order when
    /// those are in order with their neighbours.
    in_order: bool,
}

impl Memo {
    /// The memo of a settled full pass: `cfg` as [`ipam::assign`] left it
    /// and the claims with its changes written. `None` when an address or
    /// a MAC is held twice (a conflict decides by order there).
    pub fn of(cfg: &Resolved, claims: &Claims, generation: u64) -> Option<Memo> {
        let net_index = ipam::network_index(&cfg.config.networks);
        let mut memo = Memo {
            networks: cfg.config.networks.clone(),
            keys: cfg.config.keys_in_documents.without_log(),
            kept: cfg.kept_claims.clone(),
            generation,
            in_order: cfg.attachments.windows(2).all(|w| w[0].key < w[1].key),
            ..Memo::default()
        };
        for (key, claim) in claims {
            let Some(&n) = net_index.get(claim.network.as_str()) else {
                continue;
            };
            let key = key.clone();
            for ip in &claim.ips {
                if memo.held.insert(n as u32, ip.addr(), key.clone()).is_some() {
                    return None;
                }
                memo.taken.entry(n).or_default().insert(ip.addr());
            }
        }
        for a in &cfg.attachments {
            if let (Some((m, _)), Some(&n)) = (a.mac_resolved, net_index.get(a.network.as_str()))
                && !memo.macs.insert((n, m))
            {
                return None;
            }
        }
        Some(memo)
    }

    /// The store's generation once this round's changes are written.
    pub fn written(&mut self, generation: u64) {
        self.generation = generation;
    }

    /// Decides `cfg`'s VM interfaces that changed since the memo's round
    /// (`carry`: `cfg` carried the others over from it, with their last
    /// results, `Resolved::carrying`); returns the claim changes and
    /// whether the round stays settled. `None`: the full pass must run
    /// (the module's doc says when); `cfg` is then as it came.
    pub fn assign(
        &mut self,
        cfg: &mut Resolved,
        carry: &Carry,
        claims: &Claims,
        generation: u64,
    ) -> Option<(ClaimChanges, bool)> {
        if generation != self.generation
            || cfg.config.networks != self.networks
            || cfg.carried.is_none()
        {
            return None;
        }
        let config = cfg.config.clone();
        let net_index = ipam::network_index(&config.networks);
        // The entries whose documents are new or changed since the last
        // round (the others were carried over with their results).
        let changed: Vec<usize> = cfg
            .carried
            .iter()
            .flatten()
            .enumerate()
            .filter(|(_, mark)| **mark == CHANGED)
            .map(|(j, _)| j)
            .collect();
        // The carried ones keep the order they had: only the changed ones
        // are compared with their neighbours.
        let list = &cfg.attachments;
        let in_order = self.in_order
            && changed.iter().all(|&j| {
                (j == 0 || list[j - 1].key < list[j].key)
                    && list.get(j + 1).is_none_or(|next| list[j].key < next.key)
            });
        if !in_order {
            return None;
        }

        // Which keys went (their claims are released) and came. A key is
        // live while a document names it or CNI keeps its claim.
        let kept = cfg.kept_claims.clone();
        let (gone_keys, new_keys) = {
            let was_live = |k: &AttachmentKey| self.keys.contains(k) || self.kept.contains(k);
            let is_live =
                |k: &AttachmentKey| config.keys_in_documents.contains(k) || kept.contains(k);
            // The same version: the same keys, none compared. Else the
            // keys changed since its version, when the set remembers
            // them; else every key compared.
            let mut candidates: Vec<&AttachmentKey> = Vec::new();
            let touched = (self.keys.version() != config.keys_in_documents.version())
                .then(|| config.keys_in_documents.touched_since(self.keys.version()))
                .flatten();
            if let Some(touched) = touched {
                candidates.extend(touched);
            } else if self.keys.version() != config.keys_in_documents.version() {
                merge(
                    self.keys.iter(),
                    config.keys_in_documents.iter(),
                    |k| k,
                    |k| k,
                    |side| match side {
                        Side::Old(k) | Side::New(k) => candidates.push(k),
                        Side::Both(..) => {}
                    },
                );
            }
            if !std::sync::Arc::ptr_eq(&self.kept, &kept) && *self.kept != *kept {
                candidates.extend(self.kept.symmetric_difference(&kept));
            }
            let mut seen: HashSet<&AttachmentKey> = HashSet::default();
            let (mut gone, mut new): (Vec<AttachmentKey>, Vec<AttachmentKey>) = Default::default();
            for key in candidates.into_iter().filter(|k| seen.insert(*k)) {
                match (was_live(key), is_live(key)) {
                    (true, false) => gone.push(key.clone()),
                    (false, true) => new.push(key.clone()),
                    _ => {}
                }
            }
            (gone, new)
        };
        let gone: HashSet<String> = gone_keys.iter().map(|k| k.to_string()).collect();
        let changed = &changed;

        // What the changed ones would meet: checked before anything moves.
        // The MACs of the entries that went or changed are given up.
        let leaving_macs: HashSet<(usize, [u8; 6])> = carry
            .dropped
            .iter()
            .filter_map(|a| Some((*net_index.get(a.network.as_str())?, a.mac_resolved?.0)))
            .collect();
        let mut meeting: HashSet<(usize, [u8; 6])> = HashSet::default();
        for &j in changed {
            let a = &cfg.attachments[j];
            let Some(&n) = net_index.get(a.network.as_str()) else {
                continue;
            };
            let net = &config.networks[n];
            let own = a.key.to_string();
            if net.ipam
                && a.ips.iter().any(|ip| {
                    self.held
                        .get(&(n as u32), &ip.addr())
                        .is_some_and(|h| *h != own && !gone.contains(h.as_str()))
                })
            {
                return None;
            }
            if let Some(m) = first_mac(a, claims.get::<str>(&own)) {
                let in_use = self.macs.contains(&(n, m)) && !leaving_macs.contains(&(n, m));
                if in_use || !meeting.insert((n, m)) {
                    return None;
                }
            }
        }

        // The unchanged were carried over with their results.
        let mut changes = ClaimChanges::new();
        let mut settled = true;
        // Claims whose documents went are released, their addresses freed.
        for key in &gone {
            if let Some(claim) = claims.get::<str>(key) {
                changes.insert(key.clone(), None);
                self.release(claim, key, &net_index);
            }
        }
        for (n, m) in &leaving_macs {
            self.macs.remove(&(*n, *m));
        }
        // As the full pass: every static request is taken before anything
        // is allocated.
        for &j in changed {
            let a = &cfg.attachments[j];
            if let Some(&n) = net_index.get(a.network.as_str())
                && config.networks[n].ipam
            {
                let taken = self.taken.entry(n).or_default();
                taken.extend(a.ips.iter().map(|ip| ip.addr()));
            }
        }
        let mut rewritten: Vec<(String, Option<&Claim>)> = Vec::new();
        for &j in changed {
            let a = &mut cfg.attachments[j];
            let Some(&n) = net_index.get(a.network.as_str()) else {
                continue;
            };
            let key = a.key.to_string();
            let old = claims
                .get::<str>(&key)
                .filter(|_| config.keys_in_documents.contains(&a.key) || kept.contains(&a.key));
            let mut own = ClaimChanges::new();
            let decided = ipam::decide(
                std::sync::Arc::make_mut(a),
                &config.networks[n],
                n,
                old,
                &mut self.taken,
                &mut self.macs,
                &mut own,
            );
            settled &= decided.settled();
            if let Some(m) = a.mac {
                settled &= self.macs.insert((n, m));
            }
            if let Some(change) = own.remove(&key) {
                rewritten.push((key, old));
                changes.insert(rewritten.last().unwrap().0.clone(), change);
            }
        }
        // What the rewritten claims held stays taken until every changed
        // one is decided, as the full pass reads the claims once.
        for (key, old) in &rewritten {
            if let Some(old) = old {
                self.release(old, key, &net_index);
            }
        }
        for (key, _) in &rewritten {
            if let Some(Some(claim)) = changes.get(key) {
                settled &= self.hold(claim, key, &net_index);
            }
        }
        // A new key with a claim: the store holds claims of live keys
        // only, so this is not the state the memo knows.
        if new_keys.iter().any(|k| {
            claims.contains_key::<str>(&k.to_string()) && !changes.contains_key(&k.to_string())
        }) {
            settled = false;
        }

        // The config's set, shared, and the kept claims as they are now.
        self.keys = config.keys_in_documents.without_log();
        self.kept = kept;
        Some((changes, settled))
    }

    /// Frees what `claim` (of `key`) holds.
    fn release(&mut self, claim: &Claim, key: &str, net_index: &HashMap<&str, usize>) {
        let Some(&n) = net_index.get(claim.network.as_str()) else {
            return;
        };
        for ip in &claim.ips {
            if self
                .held
                .get(&(n as u32), &ip.addr())
                .is_some_and(|h| h == key)
            {
                self.held.remove(&(n as u32), &ip.addr());
                if let Some(t) = self.taken.get_mut(&n) {
                    t.remove(&ip.addr());
                }
            }
        }
    }

    /// Holds what `claim` (of `key`) claims; false when another holds one
    /// of its addresses.
    fn hold(&mut self, claim: &Claim, key: &str, net_index: &HashMap<&str, usize>) -> bool {
        let Some(&n) = net_index.get(claim.network.as_str()) else {
            return true;
        };
        let mut alone = true;
        for ip in &claim.ips {
            match self.held.insert(n as u32, ip.addr(), key.into()) {
                Some(other) if other != *key => alone = false,
                _ => {}
            }
            self.taken.entry(n).or_default().insert(ip.addr());
        }
        alone
    }
}

/// The MAC a VM interface would take first: given, else its claim's,
/// else its first generated one.
fn first_mac(a: &Attachment, claim: Option<&Claim>) -> Option<[u8; 6]> {
    if let Some(m) = a.mac {
        return Some(m);
    }
    let claimed = claim
        .filter(|c| c.network == a.network && c.mac_origin.is_some())
        .and_then(|c| c.mac);
    match claimed {
        Some(m) => Some(m),
        None if a.mac_policy == crate::config::model::MacPolicy::Generate => {
            Some(ipam::generated_mac(&a.key, 0))
        }
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::tests::{BLUE, attachment};
    use std::collections::BTreeMap;

    /// `vm`'s interface on blue at node a, with `extra` spec lines.
    fn vm(vm: &str, extra: &str) -> String {
        attachment(vm, "a").replace(&format!("port: {vm}p\n"), &format!("port: {vm}p\n{extra}"))
    }

    /// The documents read from one file that stays where it is between
    /// rounds, as a config dir's does (a document's source is part of it).
    fn resolved(vms: &[String]) -> Resolved {
        crate::round::resolve::resolve(validated(vms), "a")
    }

    fn validated(vms: &[String]) -> crate::config::Config {
        let dir = std::env::temp_dir().join(format!(
            "vmpath-ipam-memo-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let yaml = format!("{BLUE}---\n{}", vms.join("---\n"));
        std::fs::write(dir.join("c.yaml"), yaml).unwrap();
        let snap = crate::config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new())
    }

    fn write(claims: &mut Claims, changes: ClaimChanges) {
        for (k, c) in changes {
            match c {
                Some(c) => claims.insert(k.into(), c),
                None => claims.remove::<str>(&k),
            };
        }
    }

    /// IPAM over `before` then `after`, the second round both ways: the
    /// memo's increment (if it takes the round) must equal the full pass.
    /// Returns whether it took it, and the full pass's `after`.
    fn second_round(before: &[String], after: &[String]) -> (bool, Resolved) {
        let mut claims = BTreeMap::new();
        let mut first = resolved(before);
        let (changes, settled) = ipam::assign_settled(&mut first, &claims);
        assert!(settled);
        write(&mut claims, changes);
        let mut memo = Memo::of(&first, &claims, 1).expect("a settled round's memo");

        // The round carries the first round's entries over.
        let mut full = resolved(after);
        let (mut inc, carry) = Resolved::carrying(validated(after), "a", first.attachments.clone());
        let (want, _) = ipam::assign_settled(&mut full, &claims);
        let Some((got, _)) = memo.assign(&mut inc, &carry, &claims, 1) else {
            return (false, full);
        };
        assert_eq!(got, want, "claim changes");
        let results = |r: &Resolved| -> Vec<_> {
            r.attachments
                .iter()
                .map(|a| (a.key.clone(), a.addresses.clone(), a.mac_resolved))
                .collect()
        };
        assert_eq!(results(&inc), results(&full));
        (true, full)
    }

    #[test]
    fn vms_coming_and_going_are_decided_alone_as_the_full_pass_decides_them() {
        let generate = "  macPolicy: Generate\n";
        let (taken, after) = second_round(
            &[vm("vm1", generate), vm("vm2", generate), vm("vm5", "")],
            &[
                vm("vm2", generate),
                vm("vm3", generate),
                vm("vm4", ""),
                vm("vm5", ""),
            ],
        );
        assert!(taken, "the increment took the round");
        assert_eq!(after.attachments.len(), 4);
        assert!(after.attachments.iter().all(|a| !a.addresses.is_empty()));
    }

    #[test]
    fn a_new_vm_that_meets_a_held_mac_or_address_leaves_the_round_to_the_full_pass() {
        let generate = "  macPolicy: Generate\n";
        // vm1's generated MAC, given to a VM before it in key order: the
        // full pass makes vm1 give way (its first generated MAC is taken
        // before its turn).
        let mut claims = BTreeMap::new();
        let mut first = resolved(&[vm("vm1", generate)]);
        let changes = ipam::assign(&mut first, &claims);
        write(&mut claims, changes);
        let (mac, _) = first.attachments[0].mac_resolved.unwrap();
        let ip = first.attachments[0].addresses[0].0;
        let mac_text = crate::config::format_mac(&mac);
        let (taken, full) = second_round(
            &[vm("vm1", generate)],
            &[
                vm("vm0", &format!("  mac: \"{mac_text}\"\n")),
                vm("vm1", generate),
            ],
        );
        assert!(!taken, "a MAC in use: the full pass decides");
        assert_ne!(full.attachments[1].mac_resolved.unwrap().0, mac);

        // vm1's claimed address, asked for by another as a static one: the
        // full pass refuses it.
        let (taken, full) = second_round(
            &[vm("vm1", generate)],
            &[vm("vm1", generate), vm("vm2", &format!("  ips: [{ip}]\n"))],
        );
        assert!(!taken, "an address held: the full pass decides");
        assert_eq!(full.attachments.len(), 1, "vm2 refused");
    }

    #[test]
    fn a_rewritten_claims_address_stays_taken_for_the_rest_of_the_round() {
        // x: where vm2's allocation lands when nothing is taken.
        let mut alone = resolved(&[vm("vm2", "")]);
        ipam::assign(&mut alone, &BTreeMap::new());
        let x = alone.attachments[0].addresses[0].0;
        // vm1 holds x as its static request, then asks for another address
        // as vm2 comes: the full pass reads the claims once, so x is still
        // vm1's when vm2 (after it in key order) is decided.
        let (taken, full) = second_round(
            &[vm("vm1", &format!("  ips: [{x}]\n"))],
            &[vm("vm1", "  ips: [10.9.0.200/24]\n"), vm("vm2", "")],
        );
        assert!(taken, "the increment took the round");
        assert_ne!(full.attachments[1].addresses[0].0, x);
    }

    #[test]
    fn a_claim_cni_keeps_stays_live_without_its_document_until_it_is_kept_no_more() {
        // vm1 allocated, then its document gone while CNI keeps its
        // claim (the file source: a VM's pod deleted, its address kept).
        let mut claims = BTreeMap::new();
        let mut first = resolved(&[vm("vm1", ""), vm("vm2", "")]);
        let (changes, settled) = ipam::assign_settled(&mut first, &claims);
        assert!(settled);
        write(&mut claims, changes);
        let vm1 = first.attachments[0].key.clone();
        let kept: crate::resolve::resolved::KeptClaims = std::sync::Arc::new([vm1.clone()].into());
        first.kept_claims = kept.clone();
        let mut memo = Memo::of(&first, &claims, 1).expect("a settled round's memo");

        // Kept: neither the full pass nor the increment releases it.
        let mut full = resolved(&[vm("vm2", "")]);
        full.kept_claims = kept.clone();
        let (want, _) = ipam::assign_settled(&mut full, &claims);
        assert!(!want.contains_key(&vm1.to_string()), "{want:?}");
        let (mut inc, carry) =
            Resolved::carrying(validated(&[vm("vm2", "")]), "a", first.attachments.clone());
        inc.kept_claims = kept.clone();
        let (got, _) = memo
            .assign(&mut inc, &carry, &claims, 1)
            .expect("the increment");
        assert_eq!(got, want, "a kept claim is not released");

        // Kept no more: both release it.
        let mut full = resolved(&[vm("vm2", "")]);
        let (want, _) = ipam::assign_settled(&mut full, &claims);
        assert_eq!(want.get(&vm1.to_string()), Some(&None), "{want:?}");
        let (mut inc, carry) =
            Resolved::carrying(validated(&[vm("vm2", "")]), "a", inc.attachments);
        let (got, _) = memo
            .assign(&mut inc, &carry, &claims, 1)
            .expect("the increment");
        assert_eq!(got, want, "released once no longer kept");
    }
}
