//! Where each object of a snapshot belongs, kept from round to round and
//! updated by what changed (issue 34: a change costs what it touches).
//!
//! The objects of a snapshot fall into groups, one per VM or pod
//! (`namespace`, name): the VMI with its virt-launcher pods, migrations
//! and IPAMClaims; a plain pod with its claims; a CNI port with its pod; a
//! vmpath Attachment by its `spec.vm`. The rest is the context every group
//! is read against (Networks, NADs, Nodes, policies, Services, anything
//! else). [`Membership::update`] takes the next snapshot and says which
//! groups' objects changed; `round::groups` derives and validates those
//! alone.
//!
//! An object is known by its `Arc`: the sources hand every round the same
//! one while it is unchanged, so the update finds the objects that came
//! and went with one lookup each and places only those, and the objects
//! whose place they decide: a VMI's launchers (found by its uid), a pod's
//! CNI ports and the claims its annotations name, the claims a group's
//! coming or going reaches by name. Placing every object of a snapshot
//! into an empty membership ([`Membership::of`]) is the full pass; a test
//! holds the update to it.

#[cfg(test)]
use std::path::PathBuf;
use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use serde_json::Value;

pub use crate::config::GroupKey;

/// A group's key, shared by everything that names the group (one copy of
/// its names however many objects and indexes point at it).
type Key = Arc<GroupKey>;
use crate::config::{
    ConfigError,
    kube_objects::prune::{ClusterObject, group_kind},
    kube_objects::{
        CREATED_BY_LABEL, DEFAULT_NETWORK_ANNOTATION, NETWORKS_ANNOTATION, VM_NAME_LABEL,
        pod_claim_prefix,
    },
    source::{Chunked, ClusterDocument, DocOrigin, RawDocument, Snapshot, SourceFile},
};
use crate::sys::hash::{HashMap, HashSet};
use crate::sys::intern::Name;

/// One object of a snapshot: the `Arc` the source shares between
/// snapshots while the object is unchanged.
#[derive(Debug, Clone)]
enum Member {
    /// Boxed: an entry per object of the cluster is kept, most of them
    /// cluster objects, and the document's file and origin would make
    /// each of those seven times its size.
    Document(Box<(Arc<Value>, SourceFile, DocOrigin)>),
    Cluster(Arc<ClusterObject>),
}

fn ptr_of<T: ?Sized>(a: &Arc<T>) -> usize {
    Arc::as_ptr(a) as *const u8 as usize
}

impl Member {
    fn ptr(&self) -> usize {
        match self {
            Member::Document(d) => ptr_of(&d.0),
            Member::Cluster(a) => ptr_of(a),
        }
    }
    fn cluster(&self) -> Option<&ClusterObject> {
        match self {
            Member::Cluster(c) => Some(c),
            Member::Document(..) => None,
        }
    }
    /// Kind and name, for the log.
    fn describe(&self) -> String {
        match self {
            Member::Cluster(c) => match &**c {
                ClusterObject::Vmi(v) => {
                    format!("VMI {}/{}", v.metadata.namespace(), v.metadata.name)
                }
                ClusterObject::Pod(p) => {
                    format!("Pod {}/{}", p.metadata.namespace(), p.metadata.name)
                }
                ClusterObject::Vmim(m) => {
                    format!("VMIM {}/{}", m.metadata.namespace(), m.metadata.name)
                }
                ClusterObject::IpamClaim(c) => {
                    format!("IPAMClaim {}/{}", c.metadata.namespace(), c.metadata.name)
                }
                ClusterObject::Nad(_) => "a NAD".into(),
                ClusterObject::Node(_) => "a Node".into(),
                ClusterObject::Refused(r) => format!("a refused object ({r:?})"),
            },
            Member::Document(d) => format!(
                "{} {}",
                d.0.get("kind").and_then(Value::as_str).unwrap_or("?"),
                d.0.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("?")
            ),
        }
    }
    /// A cluster object that is not a claim: only groups with one are
    /// groups a claim's name can lead to (translation reads claims for
    /// the VMs and pods it derives from cluster objects).
    fn makes_claimable_group(&self) -> bool {
        matches!(self.cluster(), Some(c) if !matches!(c, ClusterObject::IpamClaim(_)))
    }
}

/// One object and where it is.
#[derive(Debug, Clone)]
struct Entry {
    member: Member,
    /// The groups it is in, sorted; none: the context (then in
    /// [`Membership::context`], the one record of it: an entry is kept
    /// for every object of the cluster), or a claim no group reads.
    groups: Groups,
    /// The part of the snapshot's cluster objects it was last read in
    /// (`part_ptr`; 0 for a document): where `partial` finds it. Its low
    /// bit, free in a part's pointer, says whether it is a placed claim
    /// listed by its addresses ([`Entry::ADDRESSED`]: a set of those was
    /// a word per claim of the cluster, and a lookup).
    tagged_part: usize,
}

impl Entry {
    /// [`tagged_part`](Entry::tagged_part)'s bit: listed in
    /// `claims_by_ip` (or `claims_unread`).
    const ADDRESSED: usize = 1;

    fn new(member: Member, part: usize) -> Entry {
        debug_assert_eq!(part & Self::ADDRESSED, 0, "a part's pointer is aligned");
        Entry {
            member,
            groups: Groups::new(),
            tagged_part: part,
        }
    }

    /// Its object's identity: its key in [`Entries`].
    fn ptr(&self) -> usize {
        self.member.ptr()
    }

    fn part(&self) -> usize {
        self.tagged_part & !Self::ADDRESSED
    }

    fn set_part(&mut self, part: usize) {
        debug_assert_eq!(part & Self::ADDRESSED, 0, "a part's pointer is aligned");
        self.tagged_part = part | (self.tagged_part & Self::ADDRESSED);
    }

    fn addressed(&self) -> bool {
        self.tagged_part & Self::ADDRESSED != 0
    }

    /// Marks it listed by its addresses, or not; returns whether it was.
    fn set_addressed(&mut self, listed: bool) -> bool {
        let was = self.addressed();
        self.tagged_part = self.part() | if listed { Self::ADDRESSED } else { 0 };
        was
    }
}

// One per object of the cluster, each a table's slot.
const _: () = assert!(std::mem::size_of::<Entry>() <= 40);

/// Every object's entry, by identity: a table of entries, each found by
/// its object's pointer ([`Entry::ptr`]), so no slot holds a copy of it
/// (8 bytes of every object of the cluster).
#[derive(Debug, Clone, Default)]
struct Entries {
    table: hashbrown::HashTable<Entry>,
    hasher: ahash::RandomState,
}

impl Entries {
    fn hash(&self, p: usize) -> u64 {
        self.hasher.hash_one(p)
    }

    fn get(&self, p: &usize) -> Option<&Entry> {
        self.table.find(self.hash(*p), |e| e.ptr() == *p)
    }

    fn get_mut(&mut self, p: &usize) -> Option<&mut Entry> {
        let hash = self.hash(*p);
        self.table.find_mut(hash, |e| e.ptr() == *p)
    }

    fn contains_key(&self, p: &usize) -> bool {
        self.get(p).is_some()
    }

    /// Sets the entry of its object (`p`, its pointer).
    fn insert(&mut self, p: usize, e: Entry) {
        debug_assert_eq!(p, e.ptr(), "an entry is found by its object's pointer");
        let hasher = &self.hasher;
        match self.table.entry(
            hasher.hash_one(p),
            |o| o.ptr() == p,
            |o| hasher.hash_one(o.ptr()),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut o) => *o.get_mut() = e,
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(e);
            }
        }
    }

    fn remove(&mut self, p: &usize) -> Option<Entry> {
        let hash = self.hash(*p);
        self.table
            .find_entry(hash, |e| e.ptr() == *p)
            .ok()
            .map(|o| o.remove().0)
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (usize, &Entry)> {
        self.table.iter().map(|e| (e.ptr(), e))
    }

    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &Entry> {
        self.table.iter()
    }
}

/// One group's objects.
#[derive(Debug, Clone)]
struct Group {
    key: Key,
    /// Inline up to two (a VMI and its claim, on another node): most
    /// groups of a cluster allocate none.
    members: smallvec::SmallVec<[usize; 2]>,
    /// How many of them are cluster objects other than claims.
    claimable: usize,
}

/// Two-level maps (namespace, then name), so a lookup by borrowed names
/// copies none.
type ByName<V> = HashMap<Name, HashMap<Name, V>>;

fn get<'a, V>(m: &'a ByName<V>, ns: &str, name: &str) -> Option<&'a V> {
    m.get(ns)?.get(name)
}

/// The value at (`ns`, `name`), made when new (the names copied then
/// only).
fn entry<'a, V: Default>(m: &'a mut ByName<V>, ns: &str, name: &str) -> &'a mut V {
    if !m.contains_key(ns) {
        m.insert(Name::new(ns), HashMap::default());
    }
    let names = m.get_mut(ns).expect("made above");
    if !names.contains_key(name) {
        names.insert(Name::new(name), V::default());
    }
    names.get_mut(name).expect("made above")
}

/// Removes `name` from `m` when `empty` says its value is.
fn prune<V>(m: &mut ByName<V>, ns: &str, name: &str, empty: impl Fn(&V) -> bool) {
    if let Some(names) = m.get_mut(ns) {
        if names.get(name).is_some_and(empty) {
            names.remove(name);
        }
        if names.is_empty() {
            m.remove(ns);
        }
    }
}

/// An index that says only which objects a change may reach: they are
/// marked dirty and placed again from what they are, so a key stands for
/// its names by a hash of them. A collision costs a needless placement,
/// never a wrong one; the names were two copies of every claim's name
/// (and more for its prefixes) per VM of the cluster. The hash is seeded
/// at random per agent: names are a tenant's to choose, and with a
/// known hash a tenant could make its objects collide with another's to
/// ride on every change to them.
///
/// A key lists one object but where names collide or repeat: that one is
/// kept in `one` (16 bytes a slot, not the 32 of a list's), the others'
/// lists in `many`.
#[derive(Debug, Clone, Default)]
struct Reach {
    one: HashMap<u64, usize>,
    many: HashMap<u64, Vec<usize>>,
}

impl Reach {
    fn key(ns: &str, name: &str) -> u64 {
        // One seed for every index and membership of the agent: a
        // membership updated and one made whole key alike.
        static SEED: std::sync::OnceLock<ahash::RandomState> = std::sync::OnceLock::new();
        SEED.get_or_init(ahash::RandomState::new)
            .hash_one((ns, name))
    }

    /// Lists `p`; returns how many its key lists now.
    fn add(&mut self, ns: &str, name: &str, p: usize) -> usize {
        let key = Self::key(ns, name);
        if let Some(list) = self.many.get_mut(&key) {
            list.push(p);
            return list.len();
        }
        match self.one.remove(&key) {
            Some(first) => {
                self.many.insert(key, vec![first, p]);
                2
            }
            None => {
                self.one.insert(key, p);
                1
            }
        }
    }

    /// Takes `p` out; returns how many its key listed before.
    fn remove(&mut self, ns: &str, name: &str, p: usize) -> usize {
        let key = Self::key(ns, name);
        if let Some(list) = self.many.get_mut(&key) {
            let before = list.len();
            remove_one_vec(list, &p);
            if list.len() == 1 {
                let last = list[0];
                self.many.remove(&key);
                self.one.insert(key, last);
            }
            return before;
        }
        match self.one.get(&key) {
            Some(&q) if q == p => {
                self.one.remove(&key);
                1
            }
            Some(_) => 1,
            None => 0,
        }
    }

    /// The objects listed under (`ns`, `name`), and any under a key that
    /// hashes the same.
    fn listed(&self, ns: &str, name: &str) -> impl Iterator<Item = usize> + '_ {
        let key = Self::key(ns, name);
        self.one
            .get(&key)
            .copied()
            .into_iter()
            .chain(self.many.get(&key).into_iter().flatten().copied())
    }
}

/// An object's groups: none allocated for one group (nearly every
/// object), and two words (a `SmallVec` was three: one per object of the
/// cluster).
#[derive(Debug, Clone, Default)]
enum Groups {
    #[default]
    None,
    One(Key),
    Many(crate::sys::thin_slice::ThinSlice<Key>),
}

impl Groups {
    fn new() -> Self {
        Groups::None
    }

    fn as_slice(&self) -> &[Key] {
        match self {
            Groups::None => &[],
            Groups::One(k) => std::slice::from_ref(k),
            Groups::Many(ks) => ks,
        }
    }

    fn iter(&self) -> std::slice::Iter<'_, Key> {
        self.as_slice().iter()
    }

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn is_empty(&self) -> bool {
        matches!(self, Groups::None)
    }

    fn contains(&self, k: &Key) -> bool {
        self.as_slice().contains(k)
    }
}

impl FromIterator<Key> for Groups {
    fn from_iter<I: IntoIterator<Item = Key>>(iter: I) -> Self {
        let mut keys: Vec<Key> = iter.into_iter().collect();
        match keys.len() {
            0 => Groups::None,
            1 => Groups::One(keys.pop().expect("one")),
            _ => Groups::Many(keys.into()),
        }
    }
}

impl<'a> IntoIterator for &'a Groups {
    type Item = &'a Key;
    type IntoIter = std::slice::Iter<'a, Key>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Removes one `item` from the list, if there.
fn remove_one<T: PartialEq, A: smallvec::Array<Item = T>>(
    list: &mut smallvec::SmallVec<A>,
    item: &T,
) {
    if let Some(i) = list.iter().position(|x| x == item) {
        list.swap_remove(i);
    }
}

/// [`remove_one`] for a `Vec`.
fn remove_one_vec<T: PartialEq>(list: &mut Vec<T>, item: &T) {
    if let Some(i) = list.iter().position(|x| x == item) {
        list.swap_remove(i);
    }
}

/// Where each object of a snapshot belongs.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    /// Every object of the last snapshot, by identity.
    entries: Entries,
    groups: ByName<Group>,
    /// The objects no group owns.
    context: HashSet<usize>,
    /// VMI uid -> the VMIs with it (one, but for a duplicate): how a
    /// launcher finds its VMI (each checked for the uid: the key is a
    /// hash; a collision counts as a duplicate, which a full pass decides).
    uids: Reach,
    /// created-by uid -> the launcher pods that name it.
    launchers: Reach,
    /// (namespace, pod name) -> the pods of that name (one, but for a
    /// duplicate): how a CNI port finds its pod's group.
    pods: ByName<Vec<usize>>,
    /// (namespace, `spec.vm`) -> the CNI port documents naming it.
    cni_ports: Reach,
    /// (namespace, name) -> the claims of that name.
    claims: Reach,
    /// (namespace, each prefix of a claim's name its VM may have,
    /// `name_prefixes`, but the whole name, which `claims` lists) ->
    /// those claims: read with `claims` ([`Membership::claims_for`]).
    claims_under: Reach,
    /// (namespace, `pod_claim_prefix`) -> the claims with a name hashed
    /// from it (`hashed_claim_prefix`).
    hashed_claims: Reach,
    /// (namespace, claim) -> the groups of the pods whose annotations
    /// name it (with repeats).
    references: ByName<Vec<Key>>,
    /// (namespace, `pod_claim_prefix`) -> the groups of the plain pods
    /// with that prefix (with repeats): the only ones that may read a
    /// claim hashed as `pod_claim_name` makes it. A claim no group leads
    /// to is read by nobody, and a change to it costs nothing until a
    /// group that reads it comes.
    claim_prefixes: ByName<Vec<Key>>,
    /// Every placed IPAMClaim with addresses in its status (its entry
    /// marked [`Entry::addressed`]: what a ledger change reaches) by each
    /// address its status gives: the claims a
    /// ledger change reaches are looked up by its addresses (walking
    /// every claim was a pass over the cluster on each allocation). Inline:
    /// an address has one claim but where two claim it.
    claims_by_ip: crate::sys::ip_map::IpMap<(), smallvec::SmallVec<[usize; 1]>>,
    /// Of those, the ones with an address that does not read: any
    /// ledger change reaches them.
    claims_unread: HashSet<usize>,
    /// kind -> (namespace, name) of each grouped pod and migration -> its
    /// groups, to attribute a refusal (`ConfigError::about`).
    by_object: HashMap<&'static str, ByName<Vec<Key>>>,
    /// file -> its documents: how many are context, and the groups of the
    /// others (with repeats). A refusal with no object (a vmpath
    /// document's) is attributed by its file, where every document in it
    /// is grouped.
    files: HashMap<SourceFile, (usize, Vec<Key>)>,
    /// Duplicated VMI uids and pod names: a full pass decides those.
    ambiguous: usize,
    read_errors: Vec<ConfigError>,
    /// Held, not only its address: a freed ledger's address may be the
    /// next one's.
    ledger: Option<Arc<crate::config::kube_objects::ledger::Shards>>,
    /// Has read a snapshot.
    started: bool,
    /// The last snapshot's cluster objects, as its parts: held, so no
    /// part or object of theirs is freed and its address taken by a new
    /// one while they are compared by address.
    parts: Vec<Arc<[ClusterDocument]>>,
    /// The last snapshot's documents, in its order.
    order: Vec<usize>,
    /// Where each file's documents lie in `order`.
    segments: Vec<(u64, std::ops::Range<usize>)>,
}

/// The documents' objects by identity, in their order, and the runs of
/// one file each: (the file's name hashed, its run).
fn order_of(documents: &[RawDocument]) -> (Vec<usize>, Vec<(u64, std::ops::Range<usize>)>) {
    let mut order = Vec::with_capacity(documents.len());
    let mut segments: Vec<(u64, std::ops::Range<usize>)> = Vec::new();
    // Compared as bytes: a `Path`'s equality walks its components.
    let mut last_file: Option<&std::ffi::OsStr> = None;
    for (at, d) in documents.iter().enumerate() {
        let file = d.file.as_os_str();
        order.push(ptr_of(&d.value));
        match segments.last_mut() {
            Some((_, run)) if last_file == Some(file) => run.end = at + 1,
            _ => {
                let name = crate::sys::hash::fnv1a(&[file.as_encoded_bytes()]);
                segments.push((name, at..at + 1));
                last_file = Some(file);
            }
        }
    }
    (order, segments)
}

/// What changed between two snapshots' cluster objects, by their parts
/// (`Chunked`): a source hands every round the same part for what it did
/// not read again, so a part shared with the last snapshot is unchanged
/// and costs one comparison, not one per object (at 100,000 VMs the walk
/// of every object's pointer was 2.4 ms of every round). The objects of
/// the old parts gone, and the positions of the new parts come (an
/// object re-read in a new part stays where it was: in both).
fn changed_parts(
    old: &[Arc<[ClusterDocument]>],
    new: &Chunked<ClusterDocument>,
) -> (HashSet<usize>, Vec<(std::ops::Range<usize>, usize)>) {
    let mut old_parts: HashMap<usize, &Arc<[ClusterDocument]>> =
        old.iter().map(|p| (part_ptr(p), p)).collect();
    let mut new_mid: Vec<(std::ops::Range<usize>, usize)> = Vec::new();
    for (start, part) in new.parts() {
        if old_parts.remove(&part_ptr(part)).is_none() {
            new_mid.push((start..start + part.len(), part_ptr(part)));
        }
    }
    let old_mid = old_parts
        .values()
        .flat_map(|p| p.iter())
        .map(|c| ptr_of(&c.object))
        .collect();
    (old_mid, new_mid)
}

/// A part of a snapshot's cluster objects, by identity.
fn part_ptr(p: &Arc<[ClusterDocument]>) -> usize {
    Arc::as_ptr(p) as *const ClusterDocument as usize
}

/// Each address a claim's status gives (`None`: one that does not read).
fn claim_addresses(ips: &[Box<str>]) -> impl Iterator<Item = Option<IpAddr>> + '_ {
    ips.iter()
        .map(|text| text.parse::<ipnet::IpNet>().ok().map(|ip| ip.addr()))
}

/// What changed between two orders, run by run (`order_of`): the old
/// objects past each run's common head and tail, and the new positions
/// there; a run only one side has is changed whole. `None` when a file's
/// name comes twice on one side (its runs are not one each).
#[allow(clippy::type_complexity)]
fn changed_runs(
    old: &[usize],
    old_runs: &[(u64, std::ops::Range<usize>)],
    new: &[usize],
    new_runs: &[(u64, std::ops::Range<usize>)],
) -> Option<(HashSet<usize>, Vec<std::ops::Range<usize>>)> {
    let mut old_by_file: HashMap<u64, std::ops::Range<usize>> = HashMap::default();
    for (file, run) in old_runs {
        if old_by_file.insert(*file, run.clone()).is_some() {
            return None;
        }
    }
    let mut seen: HashSet<u64> = HashSet::default();
    let mut old_mid: HashSet<usize> = HashSet::default();
    let mut new_mid: Vec<std::ops::Range<usize>> = Vec::new();
    for (file, run) in new_runs {
        if !seen.insert(*file) {
            return None;
        }
        let Some(was) = old_by_file.get(file) else {
            new_mid.push(run.clone());
            continue;
        };
        let (a, b) = (&old[was.clone()], &new[run.clone()]);
        let head = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let tail = a[head..]
            .iter()
            .rev()
            .zip(b[head..].iter().rev())
            .take_while(|(x, y)| x == y)
            .count();
        old_mid.extend(a[head..a.len() - tail].iter().copied());
        new_mid.push(run.start + head..run.end - tail);
    }
    for (file, run) in old_runs {
        if !seen.contains(file) {
            old_mid.extend(old[run.clone()].iter().copied());
        }
    }
    Some((old_mid, new_mid))
}

/// What placing or removing objects leaves to do.
#[derive(Default)]
struct Work {
    /// Objects whose place may have changed.
    dirty: Vec<usize>,
    /// Groups whose objects changed.
    touched: BTreeSet<GroupKey>,
    /// The context changed.
    context: bool,
}

impl Membership {
    /// Every object of `snap` placed: the full pass.
    pub fn of(snap: &Snapshot) -> Self {
        let mut m = Membership::default();
        m.update(snap);
        m
    }

    /// Reads `snap`, the snapshot after the last one read; returns the
    /// groups whose objects changed, or `None` when only a full pass will
    /// do (the context changed, the first snapshot, an ambiguity).
    pub fn update(&mut self, snap: &Snapshot) -> Option<BTreeSet<GroupKey>> {
        let mut work = Work::default();
        // What came and went: the snapshot's objects in its order (the
        // sources keep one: by kind, then key) against the last one's,
        // kind by kind (file by file). Within a kind, past the common
        // head and tail only what lies between is looked at, so an
        // unchanged object costs a comparison, not a lookup; and a change
        // in two kinds at once (a VM's pod and its VMI) looks at two
        // small runs, not everything between them.
        // The cluster's objects by their parts; the documents (files, CNI
        // ports: few with the cluster source) object by object.
        let (mut old_mid, mut new_mid_ranges) = changed_parts(&self.parts, &snap.cluster);
        let (order, segments) = order_of(&snap.documents);
        let (old_docs, new_docs) =
            match changed_runs(&self.order, &self.segments, &order, &segments) {
                Some(runs) => runs,
                // A file in two places: the whole as one run.
                None => {
                    let whole = [(0u64, 0..self.order.len())];
                    let new_whole = [(0u64, 0..order.len())];
                    changed_runs(&self.order, &whole, &order, &new_whole)
                        .expect("one run each side")
                }
            };
        old_mid.extend(old_docs);
        let documents_at = snap.cluster.len();
        new_mid_ranges.extend(
            new_docs
                .into_iter()
                .map(|r| (r.start + documents_at..r.end + documents_at, 0)),
        );
        let mut new_mid: HashSet<usize> = HashSet::default();
        let mut added: Vec<(Member, usize)> = Vec::new();
        let positions = new_mid_ranges
            .into_iter()
            .flat_map(|(run, part)| run.map(move |i| (i, part)));
        for (i, part) in positions {
            let p = match snap.cluster.get(i) {
                Some(c) => ptr_of(&c.object),
                None => order[i - documents_at],
            };
            if !new_mid.insert(p) {
                return self.rebuild(snap);
            }
            if old_mid.contains(&p) {
                // Read again, unchanged, in another part.
                if let Some(e) = self.entries.get_mut(&p) {
                    e.set_part(part);
                }
                continue;
            }
            // Not among the last snapshot's changed runs: new, unless it
            // is also in an unchanged part (one object twice).
            if self.entries.contains_key(&p) {
                return self.rebuild(snap);
            }
            added.push((
                match snap.cluster.get(i) {
                    Some(c) => Member::Cluster(c.object.clone()),
                    None => {
                        let d = &snap.documents[i - snap.cluster.len()];
                        Member::Document(Box::new((
                            d.value.clone(),
                            d.file.clone(),
                            d.origin.clone(),
                        )))
                    }
                },
                part,
            ));
        }
        let removed: Vec<usize> = old_mid
            .iter()
            .filter(|p| !new_mid.contains(p))
            .copied()
            .collect();
        self.parts = snap.cluster.parts().map(|(_, p)| p.clone()).collect();
        self.order = order;
        self.segments = segments;
        for p in removed {
            self.remove(p, &mut work);
        }
        for (member, part) in added {
            self.insert(member, part, &mut work);
        }
        self.settle(&mut work);

        // Why the whole is derived again, for the log (a full pass over a
        // large cluster is what an operator looks for first).
        let mut whole = if !self.started {
            Some("the first snapshot")
        } else if work.context {
            Some("an object of the context changed")
        } else if self.ambiguous > 0 {
            Some("a VMI uid or pod name is held twice")
        } else {
            None
        };
        self.started = true;
        if self.read_errors != snap.errors {
            self.read_errors.clone_from(&snap.errors);
            whole = Some("the read errors changed");
        }
        let ledger = snap.ledger.clone();
        match (&self.ledger, &ledger) {
            (Some(a), Some(b)) if !Arc::ptr_eq(a, b) => {
                let readers = self.ledger_readers(&ledger_changes(a, b));
                work.touched.extend(readers);
            }
            (a, b) if a.is_some() != b.is_some() => whole = Some("the ledger came or went"),
            _ => {}
        }
        self.ledger = ledger;
        if let Some(why) = whole {
            tracing::debug!("every group derived again: {why}");
        }
        whole.is_none().then_some(work.touched)
    }

    /// Starts again from nothing (a snapshot holding one object twice).
    fn rebuild(&mut self, snap: &Snapshot) -> Option<BTreeSet<GroupKey>> {
        *self = Membership::default();
        // One object twice: each placed once; a full pass decides.
        let mut once = Snapshot {
            documents: Vec::new(),
            cluster: Default::default(),
            errors: snap.errors.clone(),
            empty: snap.empty,
            fingerprint: snap.fingerprint,
            pod_claims: snap.pod_claims,
            ledger: snap.ledger.clone(),
            cluster_cidrs: snap.cluster_cidrs.clone(),
        };
        let mut ptrs: HashSet<usize> = HashSet::default();
        once.cluster = snap
            .cluster
            .iter()
            .filter(|c| ptrs.insert(ptr_of(&c.object)))
            .cloned()
            .collect();
        once.documents = snap
            .documents
            .iter()
            .filter(|d| ptrs.insert(ptr_of(&d.value)))
            .cloned()
            .collect();
        self.update(&once);
        None
    }

    /// Registers a new object and marks it to be placed.
    fn insert(&mut self, member: Member, part: usize, work: &mut Work) {
        let p = member.ptr();
        match &member {
            Member::Cluster(c) => match &**c {
                ClusterObject::Vmi(v) => {
                    if let Some(uid) = v.metadata.uid.as_ref().map(|u| u.text()) {
                        let uid = &*uid;
                        if self.uids.add("", uid, p) > 1 {
                            self.ambiguous += 1;
                        }
                        work.dirty.extend(self.launchers.listed("", uid));
                    }
                }
                ClusterObject::Pod(pod) => {
                    let ns = pod.metadata.namespace();
                    let same = entry(&mut self.pods, ns, &pod.metadata.name);
                    same.push(p);
                    if same.len() > 1 {
                        self.ambiguous += 1;
                    }
                    if pod.is_virt_launcher()
                        && let Some(uid) = pod.metadata.labels.get(CREATED_BY_LABEL)
                    {
                        self.launchers.add("", uid, p);
                    }
                    work.dirty
                        .extend(self.cni_ports.listed(ns, &pod.metadata.name));
                }
                ClusterObject::IpamClaim(claim) => {
                    let (ns, name) = (claim.metadata.namespace(), claim.metadata.name.as_str());
                    self.index_claim(ns, name, p, true);
                }
                _ => {}
            },
            Member::Document(d) => {
                let (value, _, origin) = &**d;
                if *origin == DocOrigin::CniPort
                    && let Some((ns, vm)) = attachment_vm(value)
                {
                    self.cni_ports.add(ns, vm, p);
                }
            }
        }
        self.entries.insert(p, Entry::new(member, part));
        work.dirty.push(p);
    }

    /// Lists claim `p` (`ns`/`name`) in the claim indexes (`add`), or
    /// takes it out: by its name, under each prefix its VM may have, and
    /// under its hashed prefix.
    fn index_claim(&mut self, ns: &str, name: &str, p: usize, add: bool) {
        let one = |index: &mut Reach, key: &str| {
            if add {
                index.add(ns, key, p);
            } else {
                index.remove(ns, key, p);
            }
        };
        one(&mut self.claims, name);
        // The whole name (the first) is in `claims` already.
        for prefix in name_prefixes(name).skip(1) {
            one(&mut self.claims_under, prefix);
        }
        if let Some(prefix) = hashed_claim_prefix(name) {
            one(&mut self.hashed_claims, prefix);
        }
    }

    /// The claims a group of (`ns`, `name`) may read: those named after
    /// it, whole or up to a `-` or `.` (`name_prefixes`).
    fn claims_for<'a>(&'a self, ns: &str, name: &str) -> impl Iterator<Item = usize> + 'a {
        let (under, whole) = (
            self.claims_under.listed(ns, name),
            self.claims.listed(ns, name),
        );
        under.chain(whole)
    }

    /// Takes a gone object out of its groups and the indexes.
    fn remove(&mut self, p: usize, work: &mut Work) {
        self.place(p, Vec::new(), false, work);
        let Some(e) = self.entries.remove(&p) else {
            return;
        };
        match &e.member {
            Member::Cluster(c) => match &**c {
                ClusterObject::Vmi(v) => {
                    if let Some(uid) = v.metadata.uid.as_ref().map(|u| u.text()) {
                        let uid = &*uid;
                        if self.uids.remove("", uid, p) > 1 {
                            self.ambiguous -= 1;
                        }
                        work.dirty.extend(self.launchers.listed("", uid));
                    }
                }
                ClusterObject::Pod(pod) => {
                    let ns = pod.metadata.namespace();
                    if let Some(names) = self.pods.get_mut(ns)
                        && let Some(same) = names.get_mut(pod.metadata.name.as_str())
                    {
                        if same.len() > 1 {
                            self.ambiguous -= 1;
                        }
                        remove_one_vec(same, &p);
                    }
                    prune(&mut self.pods, ns, &pod.metadata.name, Vec::is_empty);
                    if let Some(uid) = pod.metadata.labels.get(CREATED_BY_LABEL) {
                        self.launchers.remove("", uid, p);
                    }
                    work.dirty
                        .extend(self.cni_ports.listed(ns, &pod.metadata.name));
                }
                ClusterObject::IpamClaim(claim) => {
                    let (ns, name) = (claim.metadata.namespace(), claim.metadata.name.as_str());
                    self.index_claim(ns, name, p, false);
                }
                _ => {}
            },
            Member::Document(d) => {
                let (value, _, origin) = &**d;
                if *origin == DocOrigin::CniPort
                    && let Some((ns, vm)) = attachment_vm(value)
                {
                    self.cni_ports.remove(ns, vm, p);
                }
            }
        }
    }

    /// Places every object whose place may have changed, and those their
    /// new places reach, until none moves.
    fn settle(&mut self, work: &mut Work) {
        while let Some(p) = work.dirty.pop() {
            let Some(e) = self.entries.get(&p) else {
                continue;
            };
            let (groups, context) = self.place_of(&e.member);
            let same = groups.len() == e.groups.len()
                && groups.iter().zip(&e.groups).all(|(a, b)| a == &**b);
            if !same || context != self.context.contains(&p) {
                self.place(p, groups, context, work);
            }
        }
    }

    /// Where `member` belongs now: its groups (sorted), and whether it is
    /// context.
    fn place_of(&self, member: &Member) -> (Vec<GroupKey>, bool) {
        // The objects' own names where they hold them: a full pass places
        // every object of the cluster, and a look in the names' table
        // takes its lock.
        let one = |ns: Name, name: Name| (vec![(ns, name)], false);
        match member {
            Member::Cluster(c) => match &**c {
                ClusterObject::Vmi(v) => one(v.metadata.namespace_name(), v.metadata.name.clone()),
                ClusterObject::Pod(pod) => {
                    let ns = pod.metadata.namespace();
                    let labels = &pod.metadata.labels;
                    if pod.is_virt_launcher() {
                        // As translation finds a launcher's VMI: by the
                        // uid its created-by label names, else by the VM
                        // name label.
                        if let Some(uid) = labels.get(CREATED_BY_LABEL) {
                            // A VMI of the pod's own namespace, as
                            // translation reads the label.
                            let mut gs: Vec<GroupKey> = self
                                .uids
                                .listed("", uid)
                                .filter_map(|p| match self.entries.get(&p)?.member.cluster()? {
                                    ClusterObject::Vmi(v)
                                        if v.metadata.namespace() == ns
                                            && v.metadata.uid_is(Some(uid.as_str())) =>
                                    {
                                        Some((v.metadata.namespace_name(), v.metadata.name.clone()))
                                    }
                                    _ => None,
                                })
                                .collect();
                            gs.sort();
                            gs.dedup();
                            if !gs.is_empty() {
                                return (gs, false);
                            }
                        }
                        if let Some(name) = labels.get(VM_NAME_LABEL) {
                            return one(pod.metadata.namespace_name(), name.clone());
                        }
                    }
                    one(pod.metadata.namespace_name(), pod.metadata.name.clone())
                }
                ClusterObject::Vmim(m) => {
                    one(m.metadata.namespace_name(), Name::new(&m.spec.vmi_name))
                }
                ClusterObject::IpamClaim(c) => (
                    self.claim_groups(c.metadata.namespace(), &c.metadata.name),
                    false,
                ),
                ClusterObject::Nad(_) | ClusterObject::Node(_) | ClusterObject::Refused(_) => {
                    (Vec::new(), true)
                }
            },
            Member::Document(d) => {
                let (value, _, origin) = &**d;
                let is_attachment =
                    matches!(group_kind(value), Some((g, "Attachment")) if g.starts_with("vmpath"));
                let Some((ns, vm)) = attachment_vm(value).filter(|_| is_attachment) else {
                    return (Vec::new(), true);
                };
                if *origin == DocOrigin::CniPort
                    && let Some(pods) = get(&self.pods, ns, vm)
                {
                    let mut gs: Vec<GroupKey> = pods
                        .iter()
                        .filter_map(|p| self.entries.get(p))
                        .flat_map(|e| e.groups.iter().map(|k| (**k).clone()))
                        .collect();
                    gs.sort();
                    gs.dedup();
                    if !gs.is_empty() {
                        return (gs, false);
                    }
                }
                one(Name::new(ns), Name::new(vm))
            }
        }
    }

    /// The shared key of group `g`, the group made when new.
    /// The shared key of group (`ns`, `name`), when there is one.
    pub fn group_key(&self, ns: &str, name: &str) -> Option<Key> {
        get(&self.groups, ns, name).map(|g| g.key.clone())
    }

    fn intern(&mut self, g: GroupKey) -> Key {
        if let Some(group) = get(&self.groups, &g.0, &g.1) {
            return group.key.clone();
        }
        let key = Arc::new(g);
        let group = Group {
            key: key.clone(),
            members: Default::default(),
            claimable: 0,
        };
        if !self.groups.contains_key(&key.0) {
            self.groups.insert(key.0.clone(), HashMap::default());
        }
        let names = self.groups.get_mut(&key.0).expect("made above");
        names.insert(key.1.clone(), group);
        key
    }

    /// Moves object `p` to `groups` (or the context), keeping the indexes
    /// its place feeds, and marks what its move reaches.
    fn place(&mut self, p: usize, groups: Vec<GroupKey>, context: bool, work: &mut Work) {
        if !self.entries.contains_key(&p) {
            return;
        }
        let groups: Groups = groups.into_iter().map(|g| self.intern(g)).collect();
        let Some(e) = self.entries.get_mut(&p) else {
            return;
        };
        let old = std::mem::replace(&mut e.groups, groups.clone());
        let member = e.member.clone();
        let was_context = self.context.contains(&p);
        if was_context != context {
            tracing::debug!(object = %member.describe(), context, "an object moved to or from the context");
            work.context = true;
            if context {
                self.context.insert(p);
            } else {
                self.context.remove(&p);
            }
        }
        let claimable = member.makes_claimable_group();
        for g in old.iter().filter(|g| !groups.contains(g)) {
            work.touched.insert((**g).clone());
            let Some(group) = self.groups.get_mut(&g.0).and_then(|n| n.get_mut(&g.1)) else {
                continue;
            };
            remove_one(&mut group.members, &p);
            if claimable {
                group.claimable -= 1;
                if group.claimable == 0 {
                    work.dirty.extend(self.claims_for(&g.0, &g.1));
                }
            }
            prune(&mut self.groups, &g.0, &g.1, |g| g.members.is_empty());
        }
        for g in groups.iter().filter(|g| !old.contains(g)) {
            work.touched.insert((**g).clone());
            let group = self
                .groups
                .get_mut(&g.0)
                .and_then(|n| n.get_mut(&g.1))
                .expect("interned above");
            group.members.push(p);
            if claimable {
                group.claimable += 1;
                if group.claimable == 1 {
                    work.dirty.extend(self.claims_for(&g.0, &g.1));
                }
            }
        }
        // What the object's groups feed.
        let moved = |list: &mut Vec<Key>| {
            old.iter().for_each(|g| remove_one_vec(list, g));
            list.extend(groups.iter().cloned());
        };
        match &member {
            Member::Cluster(c) => match &**c {
                ClusterObject::Pod(pod) => {
                    let ns = pod.metadata.namespace();
                    let name = pod.metadata.name.as_str();
                    self.object_groups("Pod", ns, name, old.as_slice(), groups.as_slice());
                    for r in claim_references(pod) {
                        moved(entry(&mut self.references, ns, &r));
                        prune(&mut self.references, ns, &r, Vec::is_empty);
                        work.dirty.extend(self.claims.listed(ns, &r));
                    }
                    if !pod.is_virt_launcher() {
                        let prefix = pod_claim_prefix(name);
                        moved(entry(&mut self.claim_prefixes, ns, &prefix));
                        prune(&mut self.claim_prefixes, ns, &prefix, Vec::is_empty);
                        work.dirty.extend(self.hashed_claims.listed(ns, &prefix));
                    }
                    work.dirty.extend(self.cni_ports.listed(ns, name));
                }
                ClusterObject::Vmim(m) => {
                    self.object_groups(
                        "VirtualMachineInstanceMigration",
                        m.metadata.namespace(),
                        &m.metadata.name,
                        old.as_slice(),
                        groups.as_slice(),
                    );
                }
                ClusterObject::IpamClaim(claim) => {
                    if !groups.is_empty() && !claim.status.ips.is_empty() {
                        let was = self
                            .entries
                            .get_mut(&p)
                            .is_some_and(|e| e.set_addressed(true));
                        if !was {
                            for ip in claim_addresses(&claim.status.ips) {
                                match ip {
                                    Some(ip) => self
                                        .claims_by_ip
                                        .get_or_insert_with((), ip, Default::default)
                                        .push(p),
                                    None => {
                                        self.claims_unread.insert(p);
                                    }
                                }
                            }
                        }
                    } else if self
                        .entries
                        .get_mut(&p)
                        .is_some_and(|e| e.set_addressed(false))
                    {
                        for ip in claim_addresses(&claim.status.ips).flatten() {
                            if let Some(holders) = self.claims_by_ip.get_mut(&(), &ip) {
                                remove_one(holders, &p);
                                if holders.is_empty() {
                                    self.claims_by_ip.remove(&(), &ip);
                                }
                            }
                        }
                        self.claims_unread.remove(&p);
                    }
                }
                _ => {}
            },
            Member::Document(d) => {
                let file = &d.1;
                let (contexts, gs) = self.files.entry(file.clone()).or_default();
                if was_context {
                    *contexts -= 1;
                }
                if context {
                    *contexts += 1;
                }
                moved(gs);
                if *contexts == 0 && gs.is_empty() {
                    self.files.remove(&**file);
                }
            }
        }
    }

    /// Keeps `by_object` for a pod or migration that moved from `old` to
    /// `new` groups.
    fn object_groups(
        &mut self,
        kind: &'static str,
        ns: &str,
        name: &str,
        old: &[Key],
        new: &[Key],
    ) {
        let names = self.by_object.entry(kind).or_default();
        let list = entry(names, ns, name);
        old.iter().for_each(|g| remove_one_vec(list, g));
        list.extend(new.iter().cloned());
        prune(names, ns, name, Vec::is_empty);
        if names.is_empty() {
            self.by_object.remove(kind);
        }
    }

    /// Group `ns/name` if a claim's name can lead to it.
    fn claimable_group(&self, ns: &str, name: &str) -> Option<&Group> {
        get(&self.groups, ns, name).filter(|g| g.claimable > 0)
    }

    /// The groups claim `namespace/name` is read by (sorted): those its
    /// name may be a VM's or pod's of (`vm1.blue`), those whose pods
    /// reference it, and, for a hashed name, the plain pods it may be
    /// made from.
    fn claim_groups(&self, namespace: &str, name: &str) -> Vec<GroupKey> {
        let mut out: Vec<GroupKey> = name_prefixes(name)
            .filter_map(|p| self.claimable_group(namespace, p))
            .map(|g| (*g.key).clone())
            .collect();
        if let Some(gs) = get(&self.references, namespace, name) {
            out.extend(gs.iter().map(|k| (**k).clone()));
        }
        if let Some(gs) = hashed_claim_prefix(name)
            .and_then(|prefix| get(&self.claim_prefixes, namespace, prefix))
        {
            out.extend(gs.iter().map(|k| (**k).clone()));
        }
        out.sort();
        out.dedup();
        out
    }

    /// The groups whose claims' `status.ips` name an address whose ledger
    /// entry changed (translation asks the ledger of those alone).
    fn ledger_readers(&self, changed: &HashSet<IpAddr>) -> BTreeSet<GroupKey> {
        let mut out = BTreeSet::new();
        if changed.is_empty() {
            return out;
        }
        let readers: HashSet<usize> = changed
            .iter()
            .filter_map(|ip| self.claims_by_ip.get(&(), ip))
            .flatten()
            .chain(&self.claims_unread)
            .copied()
            .collect();
        for e in readers.iter().filter_map(|p| self.entries.get(p)) {
            out.extend(e.groups.iter().map(|k| (**k).clone()));
        }
        out
    }

    /// `snap` cut down to the context and the objects of `groups`, in its
    /// own order. Not the Nodes (v1 Nodes and vmpath Node documents): no
    /// VM's documents are validated against them, so a partial pass
    /// leaves them to the last full one rather than derive and validate
    /// every node of the cluster again for each event (a cost that grew
    /// with the nodes, not with what changed); the caller weighs the
    /// networks against the pod CIDRs that pass found.
    pub fn partial(&self, snap: &Snapshot, groups: &BTreeSet<GroupKey>) -> Snapshot {
        let is_node = |p: &usize| {
            self.entries.get(p).is_some_and(|e| match &e.member {
                Member::Cluster(c) => matches!(**c, ClusterObject::Node(_)),
                Member::Document(d) => d.0.get("kind").and_then(Value::as_str) == Some("Node"),
            })
        };
        let keep: HashSet<usize> = groups
            .iter()
            .filter_map(|(ns, name)| get(&self.groups, ns, name))
            .flat_map(|g| g.members.iter().copied())
            .chain(self.context.iter().copied().filter(|p| !is_node(p)))
            .collect();
        let filtered = || -> Chunked<ClusterDocument> {
            snap.cluster
                .iter()
                .filter(|c| keep.contains(&ptr_of(&c.object)))
                .cloned()
                .collect()
        };
        let cluster = self.kept_cluster(snap, &keep).unwrap_or_else(filtered);
        debug_assert!(
            cluster
                .iter()
                .map(|c| ptr_of(&c.object))
                .eq(filtered().iter().map(|c| ptr_of(&c.object))),
            "the kept objects found through their parts are the filter's, in order"
        );
        Snapshot {
            documents: snap
                .documents
                .iter()
                .filter(|d| keep.contains(&ptr_of(&d.value)))
                .cloned()
                .collect(),
            cluster,
            errors: snap.errors.clone(),
            empty: snap.empty,
            fingerprint: snap.fingerprint,
            pod_claims: snap.pod_claims,
            ledger: snap.ledger.clone(),
            cluster_cidrs: snap.cluster_cidrs.clone(),
        }
    }

    /// `keep`'s cluster objects of `snap`, in its order, found through
    /// the parts they were read in: only those parts are looked into (a
    /// filter over every object of the cluster was 1.3 ms of each partial
    /// pass at 100,000 VMs). `None` when one is not where its entry says
    /// (a snapshot placed object by object after a duplicate).
    fn kept_cluster(
        &self,
        snap: &Snapshot,
        keep: &HashSet<usize>,
    ) -> Option<Chunked<ClusterDocument>> {
        let mut parts: Vec<usize> = keep
            .iter()
            .filter_map(|p| self.entries.get(p))
            .filter(|e| matches!(e.member, Member::Cluster(_)))
            .map(Entry::part)
            .collect();
        // Each kept cluster object's part: as many as objects to find.
        let wanted = parts.len();
        parts.sort_unstable();
        parts.dedup();
        let by_ptr: HashMap<usize, (usize, &Arc<[ClusterDocument]>)> = snap
            .cluster
            .parts()
            .map(|(start, part)| (part_ptr(part), (start, part)))
            .collect();
        let mut found: Vec<(usize, &ClusterDocument)> = Vec::new();
        for part in parts {
            let &(start, items) = by_ptr.get(&part)?;
            found.extend(
                items
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| keep.contains(&ptr_of(&c.object)))
                    .map(|(i, c)| (start + i, c)),
            );
        }
        found.sort_unstable_by_key(|(at, _)| *at);
        (found.len() == wanted).then(|| found.into_iter().map(|(_, c)| c.clone()).collect())
    }

    /// The groups a refusal or warning is about; `None`: the context's.
    pub fn groups_of(&self, e: &ConfigError) -> Option<Vec<GroupKey>> {
        let exists = |ns: &str, name: &str| get(&self.groups, ns, name).is_some();
        if let Some(about) = &e.about {
            match about.kind.as_str() {
                "VirtualMachineInstance" => {
                    return exists(&about.namespace, &about.name)
                        .then(|| vec![(Name::new(&about.namespace), Name::new(&about.name))]);
                }
                "IPAMClaim" => {
                    let gs = self.claim_groups(&about.namespace, &about.name);
                    return (!gs.is_empty()).then_some(gs);
                }
                _ => {}
            }
            if let Some(gs) = self
                .by_object
                .get(about.kind.as_str())
                .and_then(|names| get(names, &about.namespace, &about.name))
            {
                return Some(gs.iter().map(|k| (**k).clone()).collect());
            }
            // A CNI port's pod not read (yet): the port's own group.
            if about.kind == "Pod" && exists(&about.namespace, &about.name) {
                return Some(vec![(Name::new(&about.namespace), Name::new(&about.name))]);
            }
            return None;
        }
        match self.files.get(e.file.as_path()) {
            Some((0, gs)) if !gs.is_empty() => {
                let mut gs: Vec<GroupKey> = gs.iter().map(|k| (**k).clone()).collect();
                gs.sort();
                gs.dedup();
                Some(gs)
            }
            _ => None,
        }
    }

    /// Every group with its objects (sorted by identity), the context's
    /// objects and what refusals are attributed by: what the full pass
    /// and the updates must agree on (tests).
    #[cfg(test)]
    fn canonical(&self) -> String {
        use std::collections::BTreeMap;
        let mut groups: BTreeMap<&GroupKey, Vec<usize>> = BTreeMap::new();
        let mut lines = Vec::new();
        for (p, e) in self.entries.iter() {
            for g in &e.groups {
                groups.entry(&**g).or_default().push(p);
            }
        }
        for (g, mut ps) in groups {
            ps.sort();
            let claimable = ps
                .iter()
                .filter(|p| {
                    self.entries
                        .get(p)
                        .is_some_and(|e| e.member.makes_claimable_group())
                })
                .count();
            let group = get(&self.groups, &g.0, &g.1).expect("a group of its members");
            let mut held = group.members.to_vec();
            held.sort();
            assert_eq!(held, ps, "group {g:?}'s members");
            assert_eq!(group.claimable, claimable, "group {g:?}'s claimable count");
            lines.push(format!("{g:?}: {ps:?}"));
        }
        let count: usize = self.groups.values().map(|n| n.len()).sum();
        assert_eq!(count, lines.len(), "no empty group is kept");
        let mut context: Vec<_> = self.context.iter().collect();
        context.sort();
        lines.push(format!("context: {context:?}"));
        let mut claim_ips: Vec<_> = self
            .entries
            .iter()
            .filter(|(_, e)| e.addressed())
            .map(|(p, _)| p)
            .collect();
        claim_ips.sort();
        lines.push(format!("claim ips: {claim_ips:?}"));
        let mut by_ip: Vec<(IpAddr, Vec<usize>)> = self
            .claims_by_ip
            .iter()
            .map(|(_, ip, ps)| {
                let mut ps = ps.to_vec();
                ps.sort();
                (ip, ps)
            })
            .collect();
        by_ip.sort();
        lines.push(format!("claims by ip: {by_ip:?}"));
        let mut unread: Vec<_> = self.claims_unread.iter().collect();
        unread.sort();
        lines.push(format!("claims unread: {unread:?}"));
        let mut by_object: Vec<_> = self
            .by_object
            .iter()
            .flat_map(|(kind, names)| {
                names.iter().flat_map(move |(ns, names)| {
                    names.iter().map(move |(name, gs)| {
                        let mut gs = gs.clone();
                        gs.sort();
                        format!("{kind} {ns} {name} {gs:?}")
                    })
                })
            })
            .collect();
        by_object.sort();
        lines.extend(by_object);
        let mut files: Vec<_> = self
            .files
            .iter()
            .map(|(f, (c, gs))| {
                let mut gs = gs.clone();
                gs.sort();
                format!("{} {c} {gs:?}", f.display())
            })
            .collect();
        files.sort();
        lines.extend(files);
        for (name, reach) in [
            ("uids", &self.uids),
            ("launchers", &self.launchers),
            ("cni ports", &self.cni_ports),
            ("claims", &self.claims),
            ("claims under", &self.claims_under),
            ("hashed claims", &self.hashed_claims),
        ] {
            // Where each key's objects are kept is part of the form: one
            // listed alone in `many` would be a list the update left.
            let mut listed: Vec<(u64, Vec<usize>, bool)> = reach
                .one
                .iter()
                .map(|(k, p)| (*k, vec![*p], false))
                .chain(reach.many.iter().map(|(k, ps)| {
                    let mut ps = ps.clone();
                    ps.sort();
                    (*k, ps, true)
                }))
                .collect();
            listed.sort();
            lines.push(format!("{name}: {listed:?}"));
        }
        lines.push(format!("ambiguous {}", self.ambiguous));
        lines.join("\n")
    }

    /// The groups whose objects differ between `self` and `other` (tests).
    #[cfg(test)]
    fn differing(&self, other: &Membership) -> BTreeSet<GroupKey> {
        use std::collections::BTreeMap;
        let members = |m: &Membership| {
            let mut out: BTreeMap<GroupKey, Vec<usize>> = BTreeMap::new();
            for (p, e) in m.entries.iter() {
                for g in &e.groups {
                    out.entry((**g).clone()).or_default().push(p);
                }
            }
            out.values_mut().for_each(|v| v.sort());
            out
        };
        let (a, b) = (members(self), members(other));
        a.keys()
            .chain(b.keys())
            .filter(|g| a.get(*g) != b.get(*g))
            .cloned()
            .collect()
    }
}

/// A vmpath Attachment document's (namespace, `spec.vm`).
fn attachment_vm(value: &Value) -> Option<(&str, &str)> {
    Some((
        value.pointer("/metadata/namespace")?.as_str()?,
        value.pointer("/spec/vm")?.as_str()?,
    ))
}

/// Every `ipam-claim-reference` a pod's Multus annotations name.
fn claim_references(pod: &crate::config::kube_objects::Pod) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            Value::Object(map) => {
                if let Some(Value::String(s)) = map.get("ipam-claim-reference") {
                    out.push(s.clone());
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for a in [NETWORKS_ANNOTATION, DEFAULT_NETWORK_ANNOTATION] {
        if let Some(text) = pod.metadata.annotations.get(a)
            && text.contains("ipam-claim-reference")
            && let Ok(v) = serde_json::from_str::<Value>(text)
        {
            walk(&v, &mut out);
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The names an object called `name` may be the VM of: itself and every
/// prefix before a `-` or `.` (`vm1.blue`, `vm1-eth0`).
fn name_prefixes(name: &str) -> impl Iterator<Item = &str> {
    std::iter::once(name).chain(
        name.char_indices()
            .filter(|(_, c)| *c == '-' || *c == '.')
            .map(move |(i, _)| &name[..i]),
    )
}

/// The prefix of `name` if it is one `pod_claim_name` hashed
/// (`<prefix>.<16 hex digits>`): its pod's name cannot be read from it,
/// only its `pod_claim_prefix`.
fn hashed_claim_prefix(name: &str) -> Option<&str> {
    name.rsplit_once('.')
        .filter(|(_, h)| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(|(prefix, _)| prefix)
}

/// The addresses whose ledger entry differs between `old` and `new` (on
/// any network): one walk of each shard that was read again, in order
/// (a shard's address found in another shard too counts as changed, which
/// only derives its readers again).
fn ledger_changes(
    old: &crate::config::kube_objects::ledger::Shards,
    new: &crate::config::kube_objects::ledger::Shards,
) -> HashSet<IpAddr> {
    let mut out = HashSet::default();
    for (a, b) in old.differing(new) {
        shard_changes(a, b, &mut out);
    }
    out
}

fn shard_changes(
    old: &crate::config::kube_objects::ledger::Ledger,
    new: &crate::config::kube_objects::ledger::Ledger,
    out: &mut HashSet<IpAddr>,
) {
    use crate::sys::sorted::Side;
    let empty = Default::default();
    let networks: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for n in networks {
        let a = old.get(n).unwrap_or(&empty);
        let b = new.get(n).unwrap_or(&empty);
        crate::sys::sorted::merge(
            a.iter(),
            b.iter(),
            |(ip, _)| *ip,
            |(ip, _)| *ip,
            |side| match side {
                Side::Old((ip, _)) | Side::New((ip, _)) => {
                    out.insert(*ip);
                }
                Side::Both((ip, h), (_, k)) => {
                    if h != k {
                        out.insert(*ip);
                    }
                }
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty directory of this test run's own, `name` telling whose.
    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vmpath-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes `text` to `dir/file` unless it holds it already: an
    /// unchanged file's objects stay the same (`Arc`) from read to read.
    fn write_if_changed(dir: &std::path::Path, file: &str, text: &str) {
        let path = dir.join(file);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text) {
            std::fs::write(path, text).unwrap();
        }
    }

    /// A pod whose name is too long for its claim's: the claim's name is
    /// the name cut, and hashed, and leads to no group by itself.
    fn long_name() -> String {
        format!("web-0-{}", "x".repeat(240))
    }

    const POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: NAME\n  namespace: prod\n  uid: 0000000a-0000-4000-8000-0000000000ef\n  annotations:\n    k8s.v1.cni.cncf.io/networks: '[{\"name\":\"blue\",\"interface\":\"Net_1\"}]'\nspec: {nodeName: node-a}\nstatus: {phase: Running}\n";

    fn claim(namespace: &str, name: &str, ip: &str) -> String {
        format!(
            "apiVersion: k8s.cni.cncf.io/v1alpha1\nkind: IPAMClaim\nmetadata: {{name: {name}, namespace: {namespace}}}\nspec: {{network: blue, interface: Net_1}}\nstatus:\n  ips: [{ip}]\n"
        )
    }

    /// A tenant's claim with a hashed name costs only the groups that may
    /// read it: its pod's, or none; never the full pass.
    #[test]
    fn a_hashed_claim_touches_the_plain_pods_it_may_be_made_for_and_no_more() {
        let theirs = crate::config::kube_objects::pod_claim_name(&long_name(), "Net_1");
        assert!(hashed_claim_prefix(&theirs).is_some(), "{theirs} is hashed");
        // One no pod's name makes: a tenant's, named to look hashed.
        let stray = "db-7.0123456789abcdef";
        // And another tenant's, in its own namespace, with the very name
        // of the pod's claim.
        // Each object in a file of its own, read as the agent reads: an
        // unchanged file's objects are the same (`Arc`) from read to read.
        let dir = fresh_dir("groups");
        let mut reader = crate::config::source::Reader::default();
        let write = |file: &str, text: &str| write_if_changed(&dir, file, text);
        let mut kept = Membership::default();
        let mut membership = |ips: [&str; 3]| {
            write("pod.yaml", &POD.replace("NAME", &long_name()));
            write("theirs.yaml", &claim("prod", &theirs, ips[0]));
            write("stray.yaml", &claim("prod", stray, ips[1]));
            write("other.yaml", &claim("other", &theirs, ips[2]));
            kept.update(&reader.read(&dir))
        };
        assert_eq!(
            membership(["10.9.0.5/24", "10.9.0.6/24", "10.9.0.9/24"]),
            None,
            "the first snapshot: the full pass"
        );
        let group = (Name::new("prod"), Name::new(&long_name()));
        assert_eq!(
            membership(["10.9.0.7/24", "10.9.0.6/24", "10.9.0.9/24"]),
            Some(BTreeSet::from([group])),
            "the pod's claim changed: its group alone"
        );
        assert_eq!(
            membership(["10.9.0.7/24", "10.9.0.8/24", "10.9.0.9/24"]),
            Some(BTreeSet::new()),
            "a claim nobody reads changed: nothing to do"
        );
        assert_eq!(
            membership(["10.9.0.7/24", "10.9.0.8/24", "10.9.0.7/24"]),
            Some(BTreeSet::new()),
            "another namespace's claim of the same name reaches no pod here"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_reach_key_lists_each_object_it_was_given_until_taken_out() {
        let mut reach = Reach::default();
        let listed = |r: &Reach| {
            let mut ps: Vec<usize> = r.listed("prod", "vm1").collect();
            ps.sort();
            ps
        };
        assert_eq!(reach.add("prod", "vm1", 10), 1);
        assert_eq!(reach.add("prod", "vm1", 20), 2);
        assert_eq!(reach.add("prod", "vm1", 30), 3);
        assert_eq!(reach.add("prod", "vm2", 40), 1);
        assert_eq!(listed(&reach), vec![10, 20, 30]);
        assert_eq!(
            reach.remove("prod", "vm1", 99),
            3,
            "not listed: nothing taken"
        );
        assert_eq!(reach.remove("prod", "vm1", 20), 3);
        assert_eq!(reach.remove("prod", "vm1", 10), 2);
        assert_eq!(listed(&reach), vec![30]);
        assert!(reach.many.is_empty(), "one object left: kept alone");
        assert_eq!(reach.remove("prod", "vm1", 40), 1, "another's object stays");
        assert_eq!(reach.remove("prod", "vm1", 30), 1);
        assert_eq!(listed(&reach), Vec::<usize>::new());
        assert_eq!(reach.remove("prod", "vm1", 30), 0);
        assert_eq!(reach.listed("prod", "vm2").collect::<Vec<_>>(), vec![40]);
    }

    /// The uid index is keyed by a hash: a VMI listed under a launcher's
    /// uid key without that uid (a collision, or a tenant's VMI made to
    /// collide) is never taken as the launcher's VMI.
    #[test]
    fn a_vmi_under_a_launchers_uid_key_without_its_uid_is_not_its_vmi() {
        let dir = fresh_dir("uid-collision");
        std::fs::write(dir.join("a.yaml"), vmi("vm1", "u1")).unwrap();
        std::fs::write(dir.join("b.yaml"), vmi("intruder", "u2")).unwrap();
        std::fs::write(
            dir.join("c.yaml"),
            pod("virt-launcher-vm1", "kubevirt.io/created-by: u1", &[]),
        )
        .unwrap();
        let mut m = Membership::of(&crate::config::source::read_dir(&dir));
        let _ = std::fs::remove_dir_all(&dir);
        let ptr_of_vmi = |m: &Membership, name: &str| {
            m.entries
                .iter()
                .find(|(_, e)| matches!(e.member.cluster(), Some(ClusterObject::Vmi(v)) if v.metadata.name == name))
                .map(|(p, _)| p)
                .expect("the VMI")
        };
        let intruder = ptr_of_vmi(&m, "intruder");
        // As a collision leaves it: the intruder under u1's key too.
        m.uids.add("", "u1", intruder);
        let launcher = m
            .entries
            .values()
            .find(|e| matches!(e.member.cluster(), Some(ClusterObject::Pod(_))))
            .map(|e| e.member.clone())
            .expect("the launcher");
        let (groups, context) = m.place_of(&launcher);
        assert!(!context);
        assert_eq!(
            groups,
            vec![(Name::new("prod"), Name::new("vm1"))],
            "the launcher's VMI is the one with its uid"
        );
    }

    /// A ledger write reaches the groups whose claims name a changed
    /// address, found by the address (not by reading every claim), and a
    /// claim with an address that does not read is reached by any write;
    /// a claim's addresses leave the index with it.
    #[test]
    fn a_ledger_write_reaches_the_claims_of_its_addresses_and_those_that_do_not_read() {
        use crate::config::kube_objects::ledger::{Holder, Ledger, Shards};
        let dir = fresh_dir("ledger-readers");
        let mut reader = crate::config::source::Reader::default();
        let write = |file: &str, text: &str| write_if_changed(&dir, file, text);
        let web = |name: &str| {
            let claim = crate::config::kube_objects::pod_claim_name(name, "Net_1");
            (POD.replace("NAME", name), claim)
        };
        let (pod_a, claim_a) = web("web-a");
        let (pod_b, claim_b) = web("web-b");
        write("a.yaml", &pod_a);
        write("b.yaml", &pod_b);
        write("claim-a.yaml", &claim("prod", &claim_a, "10.9.0.5/24"));
        write("claim-b.yaml", &claim("prod", &claim_b, "10.9.0.6/24"));
        let vouch = |ips: &[&str]| {
            let mut ledger = Ledger::new();
            for ip in ips {
                let net: ipnet::IpNet = ip.parse().unwrap();
                ledger.entry("blue".into()).or_default().insert(
                    net.addr(),
                    Holder {
                        claim: "prod/x".into(),
                        uid: Default::default(),
                        ip: net,
                    },
                );
            }
            Some(Arc::new(Shards::of(&ledger)))
        };
        let group = |name: &str| (Name::new("prod"), Name::new(name));
        let mut kept = Membership::default();
        let mut update = |ledger: Option<Arc<Shards>>| {
            let mut snap = reader.read(&dir);
            snap.ledger = ledger;
            kept.update(&snap)
        };
        assert_eq!(
            update(vouch(&[])),
            None,
            "the first snapshot: the full pass"
        );
        assert_eq!(
            update(vouch(&["10.9.0.6/24"])),
            Some(BTreeSet::from([group("web-b")])),
            "10.9.0.6 vouched: web-b's claim names it"
        );
        assert_eq!(
            update(vouch(&["10.9.0.6/24", "10.9.0.77/24"])),
            Some(BTreeSet::new()),
            "an address no claim names reaches nobody"
        );
        write("claim-a.yaml", &claim("prod", &claim_a, "not-an-address"));
        assert_eq!(
            update(vouch(&["10.9.0.6/24", "10.9.0.77/24"])),
            Some(BTreeSet::from([group("web-a")])),
            "the claim itself changed"
        );
        assert_eq!(
            update(vouch(&["10.9.0.6/24"])),
            Some(BTreeSet::from([group("web-a")])),
            "a claim that does not read is reached by any write"
        );
        write("claim-b.yaml", &claim("prod", &claim_b, "10.9.0.8/24"));
        update(vouch(&["10.9.0.6/24"]));
        assert_eq!(
            update(vouch(&[])),
            Some(BTreeSet::from([group("web-a")])),
            "web-b's claim no longer names 10.9.0.6"
        );
        assert!(
            !kept
                .claims_by_ip
                .contains_key(&(), &"10.9.0.6".parse().unwrap())
        );
        assert!(
            kept.claims_by_ip
                .contains_key(&(), &"10.9.0.8".parse().unwrap())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A small random source (the tests replay a seed).
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
        fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
            from[self.below(from.len() as u64) as usize]
        }
    }

    const UIDS: [&str; 5] = ["u0", "u1", "u2", "u3", "gone"];
    const VMS: [&str; 4] = ["vm0", "vm1", "vm2", "vm3"];
    const CLAIMS: [&str; 8] = [
        "vm0.blue",
        "vm1",
        "vm2-net1",
        "web-0-net1",
        "ref1",
        "vm3.blue.x",
        "stray",
        "web",
    ];

    fn vmi(name: &str, uid: &str) -> String {
        format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: {name}, namespace: prod, uid: {uid}}}\nspec: {{}}\nstatus: {{nodeName: node-a}}\n"
        )
    }

    fn pod(name: &str, labels: &str, references: &[&str]) -> String {
        let networks: Vec<String> = references
            .iter()
            .map(|r| {
                format!(
                    "{{\"name\":\"blue\",\"interface\":\"net1\",\"ipam-claim-reference\":\"{r}\"}}"
                )
            })
            .collect();
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: prod\n  labels: {{{labels}}}\n  annotations:\n    k8s.v1.cni.cncf.io/networks: '[{}]'\nspec: {{nodeName: node-a}}\nstatus: {{phase: Running}}\n",
            networks.join(",")
        )
    }

    fn vmim(name: &str, vmi: &str) -> String {
        format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: {name}, namespace: prod}}\nspec: {{vmiName: {vmi}}}\n"
        )
    }

    fn attachment(vm: &str) -> String {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}-a, namespace: prod}}\nspec: {{vm: {vm}, interface: eth0, network: blue, node: a, port: p-{vm}}}\n"
        )
    }

    const NETWORK: &str = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec: {id: 7, subnets: [10.9.0.0/24], ipam: {mode: Disabled}}\n";

    /// One random object for file `slot`'s kind.
    fn object(rng: &mut Rng, slot: usize) -> String {
        let some_refs =
            |rng: &mut Rng| -> Vec<&str> { (0..rng.below(3)).map(|_| rng.pick(&CLAIMS)).collect() };
        match slot % 8 {
            0 => vmi(rng.pick(&VMS), rng.pick(&UIDS)),
            1 => {
                let uid = rng.pick(&UIDS);
                let labels = match rng.below(3) {
                    0 => format!("kubevirt.io/created-by: {uid}"),
                    _ => format!(
                        "kubevirt.io/created-by: {uid}, vm.kubevirt.io/name: {}",
                        rng.pick(&VMS)
                    ),
                };
                let refs = some_refs(rng);
                pod(&format!("virt-launcher-{slot}"), &labels, &refs)
            }
            2 => {
                let refs = some_refs(rng);
                let name = match rng.below(3) {
                    0 => long_name(),
                    1 => "web-0".to_string(),
                    _ => rng.pick(&VMS).to_string(),
                };
                pod(&name, "", &refs)
            }
            3 | 4 => {
                let name = match rng.below(4) {
                    0 => crate::config::kube_objects::pod_claim_name(&long_name(), "net1"),
                    _ => rng.pick(&CLAIMS).to_string(),
                };
                let ips = if rng.below(2) == 0 {
                    "[]"
                } else {
                    "[10.9.0.5/24]"
                };
                format!(
                    "apiVersion: k8s.cni.cncf.io/v1alpha1\nkind: IPAMClaim\nmetadata: {{name: {name}, namespace: prod}}\nspec: {{network: blue, interface: net1}}\nstatus: {{ips: {ips}}}\n"
                )
            }
            5 => vmim(&format!("m{slot}"), rng.pick(&VMS)),
            6 => attachment(rng.pick(&VMS)),
            _ => match rng.below(4) {
                // A file with a context document and a grouped one.
                0 => format!("{NETWORK}---\n{}", attachment(rng.pick(&VMS))),
                _ => attachment(rng.pick(&["vm0", "web-0", "virt-launcher-1"])),
            },
        }
    }

    /// A CNI port's Attachment document, as `api::endpoints` makes it.
    fn cni_port(vm: &str) -> Arc<Value> {
        Arc::new(serde_json::json!({
            "apiVersion": crate::config::model::API_VERSION,
            "kind": "Attachment",
            "metadata": {"name": format!("cni-{vm}"), "namespace": "prod"},
            "spec": {"vm": vm, "interface": "net1", "network": "blue", "node": "a", "port": format!("c-{vm}")},
        }))
    }

    /// `snap`'s cluster objects as the Kubernetes source hands them: a
    /// part per file (kind), the last snapshot's own part where the file's
    /// objects are the same ones (`parts` keeps them).
    fn share_parts(snap: &mut Snapshot, parts: &mut HashMap<PathBuf, Arc<[ClusterDocument]>>) {
        let mut by_file: Vec<(PathBuf, Vec<ClusterDocument>)> = Vec::new();
        for c in snap.cluster.iter() {
            match by_file.last_mut() {
                Some((file, items)) if **file == *c.file => items.push(c.clone()),
                _ => by_file.push((c.file.to_path_buf(), vec![c.clone()])),
            }
        }
        let mut shared = Chunked::default();
        let mut kept = HashMap::default();
        for (file, items) in by_file {
            let part = match parts.get(&file) {
                Some(old)
                    if old.len() == items.len()
                        && old
                            .iter()
                            .zip(&items)
                            .all(|(a, b)| Arc::ptr_eq(&a.object, &b.object)) =>
                {
                    old.clone()
                }
                _ => Arc::from(items),
            };
            shared.push_part(part.clone());
            kept.insert(file, part);
        }
        snap.cluster = shared;
        *parts = kept;
    }

    fn run(seed: u64, steps: usize) -> (usize, usize) {
        let dir = fresh_dir(&format!("membership-{seed}"));
        std::fs::write(dir.join("network.yaml"), NETWORK).unwrap();
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut reader = crate::config::source::Reader::default();
        let mut kept = Membership::default();
        let mut last: Option<Membership> = None;
        let mut ports: std::collections::BTreeMap<usize, Arc<Value>> = Default::default();
        let mut parts = HashMap::default();
        let (mut partial, mut whole) = (0, 0);
        for step in 0..steps {
            // Two changes at once, now and then: a VMI and its launcher in
            // one snapshot, as a watch may deliver them.
            for _ in 0..1 + rng.below(3) / 2 {
                let slot = rng.below(24) as usize;
                let path = dir.join(format!("o{slot}.yaml"));
                match rng.below(10) {
                    0..=2 => {
                        let _ = std::fs::remove_file(&path);
                    }
                    3 => {
                        let port = rng.below(4) as usize;
                        if ports.remove(&port).is_none() {
                            let vm =
                                rng.pick(&["vm0", "web-0", "virt-launcher-1", "virt-launcher-9"]);
                            ports.insert(port, cni_port(vm));
                        }
                    }
                    _ => std::fs::write(&path, object(&mut rng, slot)).unwrap(),
                }
            }
            let mut snap = reader.read(&dir);
            share_parts(&mut snap, &mut parts);
            for (i, value) in &ports {
                snap.documents.push(crate::config::source::RawDocument {
                    file: PathBuf::from(format!("cni:{i}")).into(),
                    index: 1,
                    origin: DocOrigin::CniPort,
                    value: value.clone(),
                });
            }
            let touched = kept.update(&snap);
            // The partial snapshot finds its objects through their parts
            // (checked against a filter over every object, in debug).
            if let Some(touched) = &touched {
                let part = kept.partial(&snap, touched);
                assert!(part.cluster.len() <= snap.cluster.len());
            }
            let full = Membership::of(&snap);
            assert_eq!(
                kept.canonical(),
                full.canonical(),
                "seed {seed} step {step}: the update and the full pass differ"
            );
            match (touched, &last) {
                (Some(touched), Some(last)) => {
                    partial += 1;
                    assert_eq!(
                        touched,
                        last.differing(&full),
                        "seed {seed} step {step}: the groups said changed"
                    );
                }
                _ => whole += 1,
            }
            last = Some(full);
        }
        let _ = std::fs::remove_dir_all(&dir);
        (partial, whole)
    }

    /// Random changes (VMIs with shared or missing uids, launchers found
    /// by uid or name, plain pods, claims by name, reference or hash,
    /// migrations, Attachments in files alone or with context, CNI ports):
    /// after each, the kept membership is the full pass's of the same
    /// snapshot, and the groups it says changed are exactly those whose
    /// objects differ.
    #[test]
    fn an_updated_membership_is_the_full_pass_of_its_snapshot() {
        let (mut partial, mut whole) = (0, 0);
        for seed in 1..=12 {
            let (p, w) = run(seed, 120);
            partial += p;
            whole += w;
        }
        assert!(
            partial > whole,
            "the updates were taken: {partial} partial, {whole} whole"
        );
    }

    /// One object twice in a snapshot (no source does this; a bug could):
    /// placed once, and the round takes the full pass.
    #[test]
    fn an_object_twice_in_a_snapshot_is_placed_once_and_asks_for_the_full_pass() {
        let dir = fresh_dir("membership-twice");
        std::fs::write(dir.join("a.yaml"), vmi("vm0", "u0")).unwrap();
        std::fs::write(dir.join("b.yaml"), vmi("vm1", "u1")).unwrap();
        let mut reader = crate::config::source::Reader::default();
        let snap = reader.read(&dir);
        let mut kept = Membership::of(&snap);
        assert_eq!(kept.update(&snap), Some(BTreeSet::new()), "nothing changed");
        let mut twice = reader.read(&dir);
        let first = twice.cluster[0].clone();
        twice.cluster.push(first);
        assert_eq!(kept.update(&twice), None);
        assert_eq!(kept.canonical(), Membership::of(&snap).canonical());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Parts shared with the last snapshot are not looked into: only the
    /// objects of the parts gone, and the positions of the parts come.
    #[test]
    fn a_part_shared_with_the_last_snapshot_is_not_looked_into() {
        let dir = fresh_dir("membership-parts");
        for (i, vm) in VMS.iter().enumerate() {
            std::fs::write(dir.join(format!("o{i}.yaml")), vmi(vm, UIDS[i])).unwrap();
        }
        let mut reader = crate::config::source::Reader::default();
        let snap = reader.read(&dir);
        let docs: Vec<ClusterDocument> = snap.cluster.iter().cloned().collect();
        let part =
            |items: &[ClusterDocument]| -> Arc<[ClusterDocument]> { Arc::from(items.to_vec()) };
        let (a, b) = (part(&docs[..2]), part(&docs[2..]));
        let old = vec![a.clone(), b.clone()];
        let mut new = Chunked::default();
        new.push_part(a.clone());
        new.push_part(b.clone());
        let (old_mid, new_mid) = changed_parts(&old, &new);
        assert!(old_mid.is_empty() && new_mid.is_empty(), "nothing changed");
        // The second part read again, one object in it replaced.
        let mut again = docs[2..].to_vec();
        again[1] = docs[0].clone();
        let mut new = Chunked::default();
        new.push_part(a.clone());
        new.push_part(Arc::from(again));
        let (old_mid, new_mid) = changed_parts(&old, &new);
        assert_eq!(
            old_mid,
            docs[2..]
                .iter()
                .map(|c| ptr_of(&c.object))
                .collect::<HashSet<_>>()
        );
        let runs: Vec<_> = new_mid.iter().map(|(run, _)| run.clone()).collect();
        assert_eq!(runs, vec![2..4]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A change at the start of one kind and at the end of another (a
    /// VM's pod and its VMI, say) is looked at as two runs of one object
    /// each, not as everything between them; a kind that came or went is
    /// looked at whole.
    #[test]
    fn changes_in_two_kinds_are_two_small_runs_not_the_span_between() {
        let pods: Vec<usize> = (1000..2000).collect();
        let vmis: Vec<usize> = (5000..6000).collect();
        let old: Vec<usize> = pods.iter().chain(&vmis).copied().collect();
        let old_runs = vec![(1, 0..1000), (2, 1000..2000)];
        // A new pod first, the last VMI replaced.
        let mut new = vec![999];
        new.extend(&pods);
        new.extend(&vmis[..999]);
        new.push(7777);
        let new_runs = vec![(1, 0..1001), (2, 1001..2001)];
        let (old_mid, new_mid) = changed_runs(&old, &old_runs, &new, &new_runs).unwrap();
        assert_eq!(old_mid, HashSet::from_iter([5999]));
        let looked: Vec<usize> = new_mid.into_iter().flatten().map(|i| new[i]).collect();
        assert_eq!(looked, vec![999, 7777]);

        // The VMIs gone, a third kind come.
        let new: Vec<usize> = pods.iter().copied().chain([8000, 8001]).collect();
        let new_runs = vec![(1, 0..1000), (3, 1000..1002)];
        let (old_mid, new_mid) = changed_runs(&old, &old_runs, &new, &new_runs).unwrap();
        assert_eq!(old_mid, vmis.iter().copied().collect::<HashSet<_>>());
        let looked: Vec<usize> = new_mid.into_iter().flatten().map(|i| new[i]).collect();
        assert_eq!(looked, vec![8000, 8001]);

        // A kind in two places on one side: not run by run.
        let twice = vec![(1, 0..500), (2, 500..1000), (1, 1000..2000)];
        assert!(changed_runs(&old, &twice, &old, &old_runs).is_none());
        assert!(changed_runs(&old, &old_runs, &old, &twice).is_none());
    }
}
