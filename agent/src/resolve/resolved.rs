//! The enrichment stage between validation and planning. The validated
//! [`Config`] is what the documents say and is never rewritten; a
//! [`Resolved`] config is what this round runs: each attachment with the
//! addresses and MAC it uses (given, claimed, generated or detected) and
//! whether its migration is cut over (signalled in the config, or already
//! carried out by the data path). `ipam::assign` builds the addresses and
//! MACs (refusing what conflicts with a claim), the reconcile loop adds
//! detected MACs, `migration` adds cut-overs; `plan` consumes the result.

use std::ops::Deref;

use ipnet::IpNet;

use crate::config::{self, AttachmentKey, Config, ConfigError, Network};

// Where an address or MAC came from: the claims store records it with
// each claim, so it is defined there.
pub use crate::resolve::store::Origin;

/// A VM interface's addresses with their origins. A boxed slice, not
/// inline: an entry per VM interface of the cluster is kept, and with two
/// addresses inline it took the allocator's 96-byte class (80 with one
/// address beside it, 96 with two, as before).
pub type Addresses = Box<[(IpNet, Origin)]>;

/// One attachment as this round runs it. Derefs to its validated document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// Shared with the validated config: a round copies no document.
    pub spec: std::sync::Arc<config::Attachment>,
    /// The addresses the VM uses, with where each came from: inline for
    /// up to two (every round makes one list per VM interface of the
    /// cluster).
    pub addresses: Addresses,
    /// The MAC in force: given, or from the claim (detected or generated).
    pub mac_resolved: Option<([u8; 6], Origin)>,
    /// The migration is cut over: the VM runs on its target node now.
    pub cut_over: bool,
    /// Neither its node nor a migration's target is the node this round
    /// runs for (`Resolved::for_node`): it has no port here, whatever is
    /// cut over. Read beside the rest of the entry, so the stages that
    /// look for this node's VM interfaces skip the others without reading
    /// their documents. False when unknown (`Resolved::new`).
    pub elsewhere: bool,
    /// Its document names a migration (read beside the entry, as
    /// `elsewhere`: whether any migration is under way is asked every
    /// round).
    pub migrates: bool,
}

/// An entry of a resolved list: shared, so that the view keeps another
/// node's entry as this one (a copy was about 90 bytes per VM interface of
/// the cluster) and a round changes an entry in place only where no one
/// else holds it (`Arc::make_mut`).
pub type Entry = std::sync::Arc<Attachment>;

// With the `Arc`'s counts, the allocator's 56-byte class.
const _: () = assert!(std::mem::size_of::<Attachment>() + 16 <= 56);

impl Attachment {
    /// Only what the document gives: its IPs and MAC, its ready signal.
    pub fn given(spec: std::sync::Arc<config::Attachment>) -> Self {
        Attachment {
            addresses: spec.ips.iter().map(|ip| (*ip, Origin::Given)).collect(),
            mac_resolved: spec.mac.map(|m| (m, Origin::Given)),
            cut_over: spec.migration.as_ref().is_some_and(|m| m.ready),
            elsewhere: false,
            migrates: spec.migration.is_some(),
            spec,
        }
    }

    /// As [`given`](Self::given), for the round of `node`.
    pub fn given_for(spec: std::sync::Arc<config::Attachment>, node: &str) -> Self {
        let elsewhere = spec.node != node
            && spec
                .migration
                .as_ref()
                .is_none_or(|m| m.target_node != node);
        Attachment {
            elsewhere,
            ..Attachment::given(spec)
        }
    }

    /// Carried over into a round whose document for it is `spec` (its
    /// own, or one equal to it, then shared from now on). A cut-over the
    /// data path carried out is found again every round (`observe`): it
    /// starts from its document's signal.
    fn carried_over(entry: &mut Entry, spec: &std::sync::Arc<config::Attachment>) {
        let new_spec = !std::sync::Arc::ptr_eq(&entry.spec, spec);
        let cut_over = if entry.migrates {
            spec.migration.as_ref().is_some_and(|m| m.ready)
        } else {
            entry.cut_over
        };
        // Unchanged entries stay shared (with the view, the last list).
        if new_spec || cut_over != entry.cut_over {
            let a = std::sync::Arc::make_mut(entry);
            if new_spec {
                a.spec = spec.clone();
            }
            a.cut_over = cut_over;
        }
    }

    /// Whether it may have a port on `node` (active there, or a pending
    /// migration's target there): false for sure when `elsewhere`.
    pub fn maybe_on(&self, node: &str) -> bool {
        !self.elsewhere
            && (self.spec.node == node
                || self
                    .spec
                    .migration
                    .as_ref()
                    .is_some_and(|m| m.target_node == node))
    }

    /// The node the VM runs on now: the target once cut over.
    pub fn active_node(&self) -> &str {
        match &self.spec.migration {
            Some(m) if self.cut_over => &m.target_node,
            _ => &self.spec.node,
        }
    }

    /// The host-side port on the active node.
    pub fn active_port(&self) -> &str {
        match &self.spec.migration {
            Some(m) if self.cut_over => m.target_port.as_deref().unwrap_or(&self.spec.port),
            _ => &self.spec.port,
        }
    }

    /// A migration is named and not cut over yet.
    pub fn migration_pending(&self) -> bool {
        self.spec.migration.is_some() && !self.cut_over
    }
}

impl Deref for Attachment {
    type Target = config::Attachment;
    fn deref(&self) -> &config::Attachment {
        &self.spec
    }
}

/// The config as this round runs it: the validated config, untouched, and
/// its attachments resolved; an attachment refused here (its static IP is
/// another VM's claim) is left out and its refusal added to `errors`.
#[derive(Debug, Clone, Default)]
pub struct Resolved {
    /// Shared with the round that keeps it for the next partial pass.
    pub config: std::sync::Arc<Config>,
    pub attachments: Vec<Entry>,
    /// The validation's refusals, then this stage's.
    pub errors: Vec<ConfigError>,
    /// Addresses the data path learned from the VMs' traffic on this node
    /// (`vmp_learned_ips`): routed to on networks with routed ingress.
    pub learned_ips: std::collections::BTreeMap<vmpath_common::AddrKey, vmpath_common::LearnedIp>,
    /// For each entry of `attachments`, its index in the list the last
    /// round ended with, while it is that entry unchanged (carried over
    /// by [`carrying`](Self::carrying), and nothing this round changed
    /// it since: a cut-over aside, which `observe` finds again every
    /// round); [`CHANGED`] otherwise. `None`: nothing is known to be
    /// unchanged. IPAM decides the changed ones; the view shares the
    /// unchanged entries' rows.
    pub carried: Option<Vec<u32>>,
    /// How many entries the list carried over from had.
    pub carried_from_len: usize,
    /// The entries that may have a port on this node (not `elsewhere`),
    /// by index, ascending: what the stages that serve this node's ports
    /// walk, rather than every VM interface of the cluster (kept from
    /// round to round by the marks, not found by a look at every entry).
    pub local: Vec<u32>,
    /// The entries whose document names a migration, by index, ascending
    /// (a cut-over is found again every round, outside the marks).
    pub moving: Vec<u32>,
    /// VM interfaces whose claims stay live though no document names
    /// them: the ports vmpath-cni programmed once, with the file source
    /// (a DEL never releases a persistent address). IPAM reads them
    /// beside `config.keys_in_documents`; kept out of the validated
    /// config, whose copy per round to add them cost a pass over the
    /// cluster.
    pub kept_claims: KeptClaims,
}

/// The VM interfaces CNI programmed once whose claims are kept
/// ([`Resolved::kept_claims`]): a node's few.
pub type KeptClaims = std::sync::Arc<std::collections::BTreeSet<crate::config::AttachmentKey>>;

/// Which entries of a list are [`Resolved::local`] and
/// [`Resolved::moving`]: what the next round's marks are read against.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Indexes {
    pub local: Vec<u32>,
    pub moving: Vec<u32>,
    /// The version of the validated config the list is, one for one
    /// (`config::Lineage`; 0: not known, or an entry was refused after
    /// validation).
    pub from_version: u64,
}

impl Indexes {
    /// By a look at every entry.
    pub fn of(attachments: &[Entry]) -> Self {
        let mut out = Indexes::default();
        for (j, a) in attachments.iter().enumerate() {
            if !a.elsewhere {
                out.local.push(j as u32);
            }
            if a.migrates {
                out.moving.push(j as u32);
            }
        }
        out
    }

    /// From `last` (the indexes of the list carried over, `last_len`
    /// entries long) by `marks`: an entry carried over unchanged is what
    /// it was (its document is the same), a changed one is looked at.
    fn carried(attachments: &[Entry], marks: &[u32], last: &Indexes, last_len: usize) -> Self {
        let (mut was_local, mut was_moving) = (vec![false; last_len], vec![false; last_len]);
        for &i in &last.local {
            if let Some(w) = was_local.get_mut(i as usize) {
                *w = true;
            }
        }
        for &i in &last.moving {
            if let Some(w) = was_moving.get_mut(i as usize) {
                *w = true;
            }
        }
        let mut out = Indexes::default();
        for (j, (&mark, a)) in marks.iter().zip(attachments).enumerate() {
            let (local, moving) = match was_local.get(mark as usize) {
                Some(&local) if mark != CHANGED => (local, was_moving[mark as usize]),
                _ => (!a.elsewhere, a.migrates),
            };
            if local {
                out.local.push(j as u32);
            }
            if moving {
                out.moving.push(j as u32);
            }
        }
        out
    }
}

/// In [`Resolved::carried`]: an entry new, or changed, this round.
pub const CHANGED: u32 = u32::MAX;

/// Each entry's document with the addresses and MAC it had before a stage
/// decided them all again ([`Resolved::as_given`]).
pub type Before = Vec<(
    std::sync::Arc<config::Attachment>,
    Addresses,
    Option<([u8; 6], Origin)>,
)>;

/// What [`Resolved::carrying`] did not carry over, for IPAM's increment
/// (`resolve::ipam_memo`).
#[derive(Debug, Default)]
pub struct Carry {
    /// The last round's entries whose documents changed or went.
    pub dropped: Vec<Entry>,
}

/// The carry of every entry: `last` against `config`'s VM interfaces, in
/// place where at most a few came or went ([`Edits`]), else a list built
/// again.
fn carry_general(
    config: &Config,
    node: &str,
    last: Vec<Entry>,
    same: &impl Fn(&Attachment, &std::sync::Arc<config::Attachment>) -> bool,
    carry: &mut Carry,
) -> (Vec<Entry>, Vec<u32>) {
    if let Some(edits) = Edits::of(&last, &config.attachments, &same) {
        // The same VM interfaces in the same places, or a few came or
        // went: edited where it is. A list built again is a new
        // allocation of every entry, its pages faulted in anew (5 ms
        // of the round a VM came in at 100,000 VMs).
        let mut attachments = last;
        for &(j, i) in &edits.replaced {
            carry.dropped.push(std::mem::replace(
                &mut attachments[j],
                Entry::new(Attachment::given_for(config.attachments[i].clone(), node)),
            ));
        }
        for &j in edits.dropped.iter().rev() {
            carry.dropped.push(attachments.remove(j));
        }
        // Ascending: every entry before each lies where it ends.
        for &i in &edits.new {
            attachments.insert(
                i,
                Entry::new(Attachment::given_for(config.attachments[i].clone(), node)),
            );
        }
        for ((a, spec), mark) in attachments
            .iter_mut()
            .zip(&config.attachments)
            .zip(&edits.carried)
        {
            if *mark != CHANGED {
                Attachment::carried_over(a, spec);
            }
        }
        (attachments, edits.carried)
    } else {
        let mut attachments = Vec::with_capacity(config.attachments.len());
        let mut carried = Vec::with_capacity(config.attachments.len());
        let mut last = last.into_iter().enumerate().peekable();
        for spec in &config.attachments {
            // The last round's entries before this one went (or were
            // refused); one of the same key has another document now.
            let kept = loop {
                match last.peek() {
                    Some((_, old)) if same(old, spec) => break last.next(),
                    Some((_, old)) if old.key < spec.key => {
                        carry.dropped.extend(last.next().map(|(_, a)| a));
                    }
                    Some((_, old)) if old.key == spec.key => {
                        carry.dropped.extend(last.next().map(|(_, a)| a));
                        break None;
                    }
                    _ => break None,
                }
            };
            match kept {
                Some((i, mut a)) => {
                    Attachment::carried_over(&mut a, spec);
                    carried.push(i as u32);
                    attachments.push(a);
                }
                None => {
                    carried.push(CHANGED);
                    attachments.push(Entry::new(Attachment::given_for(spec.clone(), node)));
                }
            }
        }
        carry.dropped.extend(last.map(|(_, a)| a));
        (attachments, carried)
    }
}

/// The carry of a partial pass's config: `last` is the list resolved one
/// for one from the config it was spliced from, and only the VM
/// interfaces of `groups` were replaced. Each group's entries are matched
/// by key (carried when `same`); every other entry is carried as it is.
/// `None`, and `last` untouched, when the list does not line up.
fn spliced(
    last: &mut Vec<Entry>,
    specs: &[std::sync::Arc<config::Attachment>],
    node: &str,
    groups: &std::collections::BTreeSet<config::GroupKey>,
    same: &impl Fn(&Attachment, &std::sync::Arc<config::Attachment>) -> bool,
    carry: &mut Carry,
) -> Option<Vec<u32>> {
    // Each group's old and new entries, and for each new one the old one
    // it carries (by key, when `same`).
    let mut segments = Vec::new();
    let (mut old_at, mut new_at) = (0, 0);
    let mut marks = Vec::with_capacity(specs.len());
    for g in groups {
        let old = config::group_range_by(last, g, |a| &a.key);
        let new = config::group_range(specs, g);
        if old.start < old_at || new.start < new_at || old.start - old_at != new.start - new_at {
            return None;
        }
        marks.extend((old_at..old.start).map(|i| i as u32));
        let mut matched = Vec::with_capacity(new.len());
        for spec in &specs[new.clone()] {
            let was = last[old.clone()]
                .iter()
                .position(|a| a.key == spec.key)
                .map(|p| old.start + p)
                .filter(|&j| same(&last[j], spec));
            marks.push(was.map_or(CHANGED, |j| j as u32));
            matched.push(was);
        }
        (old_at, new_at) = (old.end, new.end);
        segments.push((old, new, matched));
    }
    if last.len() - old_at != specs.len() - new_at {
        return None;
    }
    marks.extend((old_at..last.len()).map(|i| i as u32));
    // Room for the entries come, a sixteenth past them: a splice that
    // grows the list would double its room, which the list keeps while
    // it lives (72 bytes per VM interface of the cluster, unused).
    let grows = specs.len().saturating_sub(last.len());
    if grows > last.capacity() - last.len() {
        last.reserve_exact(grows + specs.len() / 16);
    }
    // From the last group back, so the ones before stay where they are.
    for (old, new, matched) in segments.into_iter().rev() {
        let replacement: Vec<Entry> = specs[new]
            .iter()
            .zip(&matched)
            .map(|(spec, was)| match was {
                Some(j) => {
                    let mut a = last[*j].clone();
                    Attachment::carried_over(&mut a, spec);
                    a
                }
                None => Entry::new(Attachment::given_for(spec.clone(), node)),
            })
            .collect();
        let start = old.start;
        let gone: Vec<Entry> = last.splice(old, replacement).collect();
        carry.dropped.extend(
            gone.into_iter()
                .enumerate()
                .filter(|(k, _)| !matched.contains(&Some(start + k)))
                .map(|(_, a)| a),
        );
    }
    Some(marks)
}

/// How a list carried over becomes this round's, when only a few entries
/// come or go ([`Edits::MAX`]): by position, without moving anything.
struct Edits {
    /// Each new entry's index in the old list while it is that entry
    /// (`same`), else [`CHANGED`].
    carried: Vec<u32>,
    /// Old entries of a key whose document changed: (old index, new index).
    replaced: Vec<(usize, usize)>,
    /// Old entries gone (ascending).
    dropped: Vec<usize>,
    /// New entries of a new key (ascending new indexes).
    new: Vec<usize>,
}

impl Edits {
    /// Past this many entries come or gone the list is built again (each
    /// edit in place moves the entries after it).
    const MAX: usize = 8;

    /// The edits from `old` to `new` (both in key order), or `None` past
    /// [`MAX`](Self::MAX).
    fn of(
        old: &[Entry],
        new: &[std::sync::Arc<config::Attachment>],
        same: &impl Fn(&Attachment, &std::sync::Arc<config::Attachment>) -> bool,
    ) -> Option<Self> {
        let mut edits = Edits {
            carried: Vec::with_capacity(new.len()),
            replaced: Vec::new(),
            dropped: Vec::new(),
            new: Vec::new(),
        };
        let mut j = 0;
        for (i, spec) in new.iter().enumerate() {
            loop {
                match old.get(j) {
                    Some(a) if same(a, spec) => {
                        edits.carried.push(j as u32);
                        j += 1;
                    }
                    Some(a) if a.key < spec.key => {
                        edits.dropped.push(j);
                        j += 1;
                        continue;
                    }
                    Some(a) if a.key == spec.key => {
                        edits.replaced.push((j, i));
                        edits.carried.push(CHANGED);
                        j += 1;
                    }
                    _ => {
                        edits.new.push(i);
                        edits.carried.push(CHANGED);
                    }
                }
                break;
            }
            if edits.dropped.len() + edits.new.len() > Self::MAX {
                return None;
            }
        }
        edits.dropped.extend(j..old.len());
        (edits.dropped.len() + edits.new.len() <= Self::MAX).then_some(edits)
    }
}

impl Resolved {
    /// `config` run as `attachments` (its own, in its order), with what
    /// was carried over from the last round, if known.
    fn of(
        config: std::sync::Arc<Config>,
        attachments: Vec<Entry>,
        carried: Option<(Vec<u32>, usize)>,
        indexes: Indexes,
    ) -> Self {
        let (carried, carried_from_len) = match carried {
            Some((carried, from)) => (Some(carried), from),
            None => (None, 0),
        };
        Resolved {
            local: indexes.local,
            moving: indexes.moving,
            attachments,
            errors: config.errors.clone(),
            config,
            learned_ips: Default::default(),
            carried,
            carried_from_len,
            kept_claims: Default::default(),
        }
    }

    /// Every attachment with only what its document gives (no IPAM).
    pub fn new(config: impl Into<std::sync::Arc<Config>>) -> Self {
        let config: std::sync::Arc<Config> = config.into();
        let attachments = config
            .attachments
            .iter()
            .cloned()
            .map(|a| Entry::new(Attachment::given(a)))
            .collect::<Vec<_>>();
        let indexes = Indexes::of(&attachments);
        Self::of(config, attachments, None, indexes)
    }

    /// As [`new`](Self::new), for the round of `node`: each VM interface
    /// knows whether it is `elsewhere`.
    pub fn for_node(config: impl Into<std::sync::Arc<Config>>, node: &str) -> Self {
        let config: std::sync::Arc<Config> = config.into();
        let attachments = config
            .attachments
            .iter()
            .map(|a| Entry::new(Attachment::given_for(a.clone(), node)))
            .collect::<Vec<_>>();
        let indexes = Indexes::of(&attachments);
        Self::of(config, attachments, None, indexes)
    }

    /// As [`for_node`](Self::for_node), carrying over `last` (the entries
    /// the last round ended with, in key order): an entry whose document
    /// is the one it was resolved from is taken as it is, with what IPAM
    /// gave it (no document is read, nothing copied: at 10,000 VM
    /// interfaces a list made again every round was a millisecond of it);
    /// the others start from their documents. A cut-over the data path
    /// carried out is found again every round (`observe`): an entry whose
    /// document names a migration starts from its document's signal.
    pub fn carrying(
        config: impl Into<std::sync::Arc<Config>>,
        node: &str,
        last: Vec<Entry>,
    ) -> (Self, Carry) {
        let indexes = Indexes::of(&last);
        Self::carrying_with(config, node, last, &indexes)
    }

    /// As [`carrying`](Self::carrying), with `last`'s [`Indexes`] as the
    /// last round left them.
    pub fn carrying_with(
        config: impl Into<std::sync::Arc<Config>>,
        node: &str,
        last: Vec<Entry>,
        last_indexes: &Indexes,
    ) -> (Self, Carry) {
        let config: std::sync::Arc<Config> = config.into();
        let mut carry = Carry::default();
        let carried_from_len = last.len();
        // The same document, or one read again and equal to it (a full
        // pass makes every one anew): carried, and from now on shared.
        let same = |old: &Attachment, spec: &std::sync::Arc<config::Attachment>| {
            std::sync::Arc::ptr_eq(&old.spec, spec) || (old.key == spec.key && *old.spec == **spec)
        };
        // A partial pass's config (or the same config again) against the
        // list resolved from the config it was spliced from, one for one:
        // only the replaced groups' entries are looked at (the general
        // carry below looks at every entry of the cluster: 1.3 ms of each
        // round at 100,000 VMs).
        let lineage = &config.lineage;
        let from = last_indexes.from_version;
        let groups = match &lineage.spliced_from {
            _ if from != 0 && lineage.version == from => Some(Default::default()),
            Some((spliced, groups)) if from != 0 && *spliced == from => Some(groups.clone()),
            _ => None,
        };
        #[cfg(debug_assertions)]
        let original = groups.as_ref().map(|_| last.clone());
        let mut last = last;
        let by_groups = groups.and_then(|groups| {
            spliced(
                &mut last,
                &config.attachments,
                node,
                &groups,
                &same,
                &mut carry,
            )
        });
        let lineal = by_groups.is_some();
        let (mut attachments, carried) = match by_groups {
            Some(marks) => (last, marks),
            None => carry_general(&config, node, last, &same, &mut carry),
        };
        let indexes = Indexes::carried(&attachments, &carried, last_indexes, carried_from_len);
        if lineal {
            // Outside the replaced groups every entry is the last one with
            // its document shared: only a migration's cut-over starts again
            // from its document's signal.
            for &j in &indexes.moving {
                if carried[j as usize] != CHANGED {
                    Attachment::carried_over(
                        &mut attachments[j as usize],
                        &config.attachments[j as usize],
                    );
                }
            }
            #[cfg(debug_assertions)]
            if let Some(original) = original {
                let (whole, marks) =
                    carry_general(&config, node, original, &same, &mut Carry::default());
                debug_assert!(
                    marks == carried && whole == attachments,
                    "the carry by lineage is the carry of every entry"
                );
            }
        }

        debug_assert_eq!(
            indexes,
            Indexes::of(&attachments),
            "the indexes read from the marks are the list's"
        );
        (
            Self::of(
                config,
                attachments,
                Some((carried, carried_from_len)),
                indexes,
            ),
            carry,
        )
    }

    /// Starts every entry again from what its document gives, keeping
    /// note of which then come out of this round as they were: for a
    /// stage that decides them all (IPAM's full pass). Call
    /// [`changed_since`](Self::changed_since) with the result after it.
    pub fn as_given(&mut self) -> Option<Before> {
        self.carried.as_ref()?;
        let mut before = Vec::with_capacity(self.attachments.len());
        for a in &mut self.attachments {
            let given = Attachment::given(a.spec.clone());
            let a = std::sync::Arc::make_mut(a);
            before.push((
                a.spec.clone(),
                std::mem::replace(&mut a.addresses, given.addresses),
                std::mem::replace(&mut a.mac_resolved, given.mac_resolved),
            ));
        }
        Some(before)
    }

    /// Marks as changed every entry whose addresses or MAC are not what
    /// they were `before` ([`as_given`](Self::as_given)'s note). Entries
    /// only go in between (refused), never come or move.
    pub fn changed_since(&mut self, before: Option<Before>) {
        let (Some(before), Some(carried)) = (before, self.carried.as_mut()) else {
            return;
        };
        let mut before = before.into_iter();
        for (a, mark) in self.attachments.iter().zip(carried.iter_mut()) {
            let Some((_, addresses, mac)) =
                before.find(|(spec, ..)| std::sync::Arc::ptr_eq(spec, &a.spec))
            else {
                *mark = CHANGED;
                continue;
            };
            if addresses != a.addresses || mac != a.mac_resolved {
                *mark = CHANGED;
            }
        }
    }

    /// An entry's document names a migration (its cut-over is found
    /// again every round, outside `carried`'s marks).
    pub fn migrating(&self) -> bool {
        !self.moving.is_empty()
    }

    /// The list's [`Indexes`], for the next round.
    pub fn indexes(&self) -> Indexes {
        Indexes {
            local: self.local.clone(),
            moving: self.moving.clone(),
            from_version: if self.attachments.len() == self.config.attachments.len() {
                self.config.lineage.version
            } else {
                0
            },
        }
    }

    /// The indexes found again by a look at every entry: after a test
    /// put entries in by hand.
    #[cfg(test)]
    pub fn reindex(&mut self) {
        let indexes = Indexes::of(&self.attachments);
        (self.local, self.moving) = (indexes.local, indexes.moving);
    }

    /// The entries that may have a port on this node.
    pub fn local_entries(&self) -> impl Iterator<Item = &Attachment> {
        self.local.iter().map(|&j| &*self.attachments[j as usize])
    }

    /// Whether every entry was carried over, unchanged and in its place:
    /// the list is the last round's.
    pub fn carried_whole(&self) -> bool {
        self.carried.as_ref().is_some_and(|carried| {
            carried.len() == self.carried_from_len
                && carried.iter().enumerate().all(|(j, &i)| i as usize == j)
        })
    }

    /// [`carried`](Self::carried), for a list of `len` entries built from
    /// the list carried over from (a view's rows): `None` for any other.
    pub fn carried_for(&self, len: usize) -> Option<&[u32]> {
        self.carried
            .as_deref()
            .filter(|_| len == self.carried_from_len)
    }

    /// The network called `name`.
    pub fn network(&self, name: &str) -> Option<&Network> {
        self.config.network(name)
    }

    /// The VM interface `key`. Validation leaves them in key order: a
    /// binary search, with a scan should an order have been broken.
    pub fn attachment(&self, key: &AttachmentKey) -> Option<&Attachment> {
        match self.attachments.binary_search_by(|a| a.key.cmp(key)) {
            Ok(i) => Some(&self.attachments[i]),
            Err(_) => self
                .attachments
                .iter()
                .find(|a| &a.key == key)
                .map(|a| &**a),
        }
    }

    /// The VM interface `key`, to change: it no longer counts as
    /// carried over unchanged.
    pub fn attachment_mut(&mut self, key: &AttachmentKey) -> Option<&mut Attachment> {
        let i = match self.attachments.binary_search_by(|a| a.key.cmp(key)) {
            Ok(i) => i,
            Err(_) => self.attachments.iter().position(|a| &a.key == key)?,
        };
        if let Some(mark) = self.carried.as_mut().and_then(|c| c.get_mut(i)) {
            *mark = CHANGED;
        }
        Some(std::sync::Arc::make_mut(&mut self.attachments[i]))
    }

    /// Refuses an attachment that passed validation but conflicts here
    /// (with a claim), naming its document.
    pub fn refuse(&mut self, key: &AttachmentKey, field: &str, message: String) {
        if let Some(i) = self.attachments.iter().position(|a| &a.key == key) {
            let a = self.attachments.remove(i);
            if let Some(carried) = self.carried.as_mut()
                && i < carried.len()
            {
                carried.remove(i);
            }
            for list in [&mut self.local, &mut self.moving] {
                list.retain(|&j| j as usize != i);
                for j in list.iter_mut().filter(|j| **j as usize > i) {
                    *j -= 1;
                }
            }
            debug_assert_eq!(self.indexes(), Indexes::of(&self.attachments));
            self.errors.push(ConfigError {
                file: a.spec.source.file.to_path_buf(),
                document: a.spec.source.document(),
                field: field.to_string(),
                message,
                about: a.spec.source.origin.about(),
                reason: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{config, resolve::ipam, resolve::store::Claim};

    const DOCS: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: blue}
spec: {id: 100, subnets: [10.20.0.0/16]}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm1, namespace: prod}
spec: {vm: vm1, interface: eth0, network: blue, node: a, port: p1, macPolicy: Generate}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm2, namespace: prod}
spec: {vm: vm2, interface: eth0, network: blue, node: a, port: p2, mac: '52:54:00:00:00:02', ips: [10.20.0.9/16]}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {name: vm3, namespace: prod}
spec: {vm: vm3, interface: eth0, network: blue, node: a, port: p3, mac: '52:54:00:00:00:03', migration: {targetNode: b}}
";

    fn validated() -> Config {
        let dir = std::env::temp_dir().join(format!("vmpath-resolved-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), DOCS).unwrap();
        let snap = config::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new());
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        cfg
    }

    fn key(vm: &str) -> AttachmentKey {
        AttachmentKey::new("prod".into(), vm.into(), "eth0".into())
    }

    /// A list of many VM interfaces where a few came, went or changed:
    /// edited in place (its buffer kept), with the same entries, marks and
    /// dropped entries as the list built again when more changed.
    #[test]
    fn a_few_entries_come_and_go_in_place_as_a_rebuilt_list_would() {
        let base = validated();
        let template = (*base.attachments[0]).clone();
        let doc = |n: usize| {
            let mut a = template.clone();
            a.key = a.key.with_vm(&format!("vm{n:03}"));
            std::sync::Arc::new(a)
        };
        let mut first = base.clone();
        first.attachments = (0..200).map(|n| doc(n * 2)).collect();
        let first = Resolved::for_node(first, "a");
        // Even numbers before; now vm004 gone, vm010 changed, vm007 and
        // vm301 new (odd: none before).
        let mut next = (*first.config).clone();
        next.attachments.retain(|a| a.key.vm != "vm004");
        let at = next
            .attachments
            .iter()
            .position(|a| a.key.vm == "vm010")
            .unwrap();
        let mut changed = (*next.attachments[at]).clone();
        changed.port = "p-new".into();
        next.attachments[at] = std::sync::Arc::new(changed);
        for n in [7, 301] {
            let spec = doc(n);
            let at = next.attachments.partition_point(|a| a.key < spec.key);
            next.attachments.insert(at, spec);
        }
        let mut last = first.attachments.clone();
        last.reserve(4);
        let buffer = last.as_ptr();
        let (edited, carry) = Resolved::carrying(next.clone(), "a", last);
        assert_eq!(edited.attachments.as_ptr(), buffer, "edited in place");
        let vms = |list: &[Entry]| list.iter().map(|a| a.key.vm.clone()).collect::<Vec<_>>();
        let mut gone = vms(&carry.dropped);
        gone.sort();
        assert_eq!(gone, ["vm004", "vm010"]);
        // Past `Edits::MAX` changes in length: built again, the same.
        let mut many = next.clone();
        for n in 0..Edits::MAX {
            let spec = doc(2 * n + 101);
            let at = many.attachments.partition_point(|a| a.key < spec.key);
            many.attachments.insert(at, spec);
        }
        let (rebuilt, _) = Resolved::carrying(many.clone(), "a", first.attachments.clone());
        assert_ne!(rebuilt.attachments.as_ptr(), first.attachments.as_ptr());
        let (edited_many, _) = Resolved::carrying(many, "a", edited.attachments.clone());
        for list in [&edited, &rebuilt, &edited_many] {
            assert_eq!(list.attachments.len(), list.config.attachments.len());
            for (a, spec) in list.attachments.iter().zip(&list.config.attachments) {
                assert!(std::sync::Arc::ptr_eq(&a.spec, spec), "{}", a.key);
            }
        }
        let marks = |r: &Resolved| -> Vec<(String, bool)> {
            r.attachments
                .iter()
                .zip(r.carried.as_ref().unwrap())
                .map(|(a, m)| (a.key.vm.to_string(), *m == CHANGED))
                .collect()
        };
        let changed: Vec<String> = marks(&edited)
            .into_iter()
            .filter(|(_, c)| *c)
            .map(|(vm, _)| vm)
            .collect();
        assert_eq!(changed, ["vm007", "vm010", "vm301"]);
        let rebuilt_changed: Vec<String> = marks(&rebuilt)
            .into_iter()
            .filter(|(_, c)| *c)
            .map(|(vm, _)| vm)
            .collect();
        assert_eq!(rebuilt_changed.len(), 3 + Edits::MAX, "{rebuilt_changed:?}");
        assert!(changed.iter().all(|vm| rebuilt_changed.contains(vm)));
    }

    /// IPAM, a refusal and a cut-over land in the resolved stage; the
    /// validated config it was built from stays as the documents say.
    #[test]
    fn enrichment_leaves_the_validated_config_as_it_was() {
        let cfg = validated();
        let before = serde_json::to_value(&cfg).unwrap();
        // vm3 holds the address vm2 asks for statically.
        let claims = BTreeMap::from([(
            crate::sys::intern::Name::new(&key("vm3").to_string()),
            Claim {
                network: "blue".into(),
                ips: vec!["10.20.0.9/16".parse().unwrap()],
                mac: None,
                mac_origin: None,
            },
        )]);
        let mut resolved = Resolved::new(cfg);
        ipam::assign(&mut resolved, &claims);
        resolved.attachment_mut(&key("vm3")).unwrap().cut_over = true;

        let vm1 = resolved.attachment(&key("vm1")).unwrap();
        assert_eq!(vm1.addresses.len(), 1);
        assert_eq!(vm1.addresses[0].1, Origin::Claimed);
        assert_eq!(vm1.mac_resolved.map(|(_, o)| o), Some(Origin::Generated));
        assert!(resolved.attachment(&key("vm2")).is_none(), "vm2 refused");
        assert_eq!(resolved.errors.len(), 1);
        assert_eq!(resolved.errors[0].field, "spec.ips");
        let vm3 = resolved.attachment(&key("vm3")).unwrap();
        assert_eq!(
            &vm3.addresses[..],
            &[("10.20.0.9/16".parse().unwrap(), Origin::Claimed)][..]
        );
        assert_eq!(vm3.active_node(), "b");
        assert_eq!(vm3.signalled_node(), "a");

        assert_eq!(serde_json::to_value(&*resolved.config).unwrap(), before);
        assert!(resolved.config.errors.is_empty());
        assert_eq!(resolved.config.attachments.len(), 3);
    }

    /// Built for a node, each VM interface knows whether it is elsewhere:
    /// neither on that node nor migrating to it, cut over or not.
    #[test]
    fn a_vm_interface_with_no_port_on_the_node_is_elsewhere() {
        let elsewhere = |node: &str| -> Vec<(String, bool, bool)> {
            Resolved::for_node(validated(), node)
                .attachments
                .iter()
                .map(|a| (a.key.vm.to_string(), a.elsewhere, a.maybe_on(node)))
                .collect()
        };
        // vm3 runs on a and migrates to b.
        assert_eq!(
            elsewhere("a"),
            [
                ("vm1".into(), false, true),
                ("vm2".into(), false, true),
                ("vm3".into(), false, true)
            ]
        );
        assert_eq!(
            elsewhere("b"),
            [
                ("vm1".into(), true, false),
                ("vm2".into(), true, false),
                ("vm3".into(), false, true)
            ]
        );
        assert!(elsewhere("c").iter().all(|(_, e, m)| *e && !m));
        // Unknown without a node: never skipped.
        assert!(
            Resolved::new(validated())
                .attachments
                .iter()
                .all(|a| !a.elsewhere)
        );
    }

    /// The last round's entries are carried over as they ended (IPAM's
    /// results, in their places) while their documents are the same; a
    /// changed or new document starts from what it gives; a migration's
    /// cut-over starts from its signal again.
    #[test]
    fn a_round_carries_over_the_entries_whose_documents_are_the_same() {
        let first = Resolved::for_node(validated(), "a");
        let mut last = first.attachments.clone();
        // As IPAM and the data path left them.
        std::sync::Arc::make_mut(&mut last[0]).addresses =
            Box::new([("10.20.0.5/16".parse().unwrap(), Origin::Claimed)]);
        std::sync::Arc::make_mut(&mut last[2]).cut_over = true;
        let mut config = (*first.config).clone();
        // vm2's document changes; vm0 is new; the others are the same
        // documents (vm1's read again: equal, not shared).
        let mut vm2 = (*config.attachments[1]).clone();
        vm2.port = "p2b".into();
        config.attachments[1] = std::sync::Arc::new(vm2);
        config.attachments[0] = std::sync::Arc::new((*config.attachments[0]).clone());
        let mut vm0 = (*config.attachments[0]).clone();
        vm0.key = vm0.key.with_vm("vm0");
        config.attachments.insert(0, std::sync::Arc::new(vm0));
        let (now, carry) = Resolved::carrying(config, "a", last);
        let vms = |list: &[Entry]| list.iter().map(|a| a.key.vm.clone()).collect::<Vec<_>>();
        assert_eq!(vms(&now.attachments), ["vm0", "vm1", "vm2", "vm3"]);
        assert_eq!(now.carried, Some(vec![CHANGED, 0, CHANGED, 2]));
        assert_eq!(vms(&carry.dropped), ["vm2"]);
        assert_eq!(
            now.attachments[1].addresses[0].1,
            Origin::Claimed,
            "vm1 kept IPAM's address"
        );
        assert!(std::sync::Arc::ptr_eq(
            &now.attachments[1].spec,
            &now.config.attachments[1]
        ));
        assert_eq!(now.attachments[2].port, "p2b");
        assert!(
            !now.attachments[3].cut_over,
            "vm3's cut-over is found again"
        );
        assert!(!now.carried_whole());
        assert_eq!(now.carried_for(3).map(<[u32]>::len), Some(4));
        assert_eq!(now.carried_for(4), None);
        // A refusal takes its mark along; a change through attachment_mut
        // marks it.
        let mut now = now;
        now.refuse(&key("vm0"), "spec.port", "no".into());
        now.attachment_mut(&key("vm3")).unwrap().cut_over = true;
        assert_eq!(now.carried, Some(vec![0, CHANGED, CHANGED]));

        // The same documents again: the refused one starts anew, the
        // others are carried over; once more, the whole list is.
        let (again, carry) = Resolved::carrying(now.config.clone(), "a", now.attachments.clone());
        assert!(carry.dropped.is_empty());
        assert_eq!(again.carried, Some(vec![CHANGED, 0, 1, 2]));
        let (whole, _) = Resolved::carrying(again.config.clone(), "a", again.attachments.clone());
        assert!(whole.carried_whole());
    }

    #[test]
    fn without_ipam_only_what_the_document_gives() {
        let resolved = Resolved::new(validated());
        let vm2 = resolved.attachment(&key("vm2")).unwrap();
        assert_eq!(
            &vm2.addresses[..],
            &[("10.20.0.9/16".parse().unwrap(), Origin::Given)][..]
        );
        assert_eq!(
            vm2.mac_resolved,
            Some(([0x52, 0x54, 0, 0, 0, 2], Origin::Given))
        );
        assert!(!vm2.cut_over);
        let vm1 = resolved.attachment(&key("vm1")).unwrap();
        assert!(vm1.addresses.is_empty() && vm1.mac_resolved.is_none());
    }
}
