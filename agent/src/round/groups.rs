//! Derive and validate by VM: the objects of a snapshot fall into groups,
//! one per VM or pod (`namespace`, name: the VMI with its virt-launcher
//! pods, migrations and IPAMClaims; a plain pod with its claims; a CNI
//! port with its pod; a vmpath Attachment by its `spec.vm`), and the
//! context every group is read against (Networks, NADs, Nodes, policies,
//! Services, namespaces, anything else). When only groups changed, the
//! derive and validate stages run on the context and those groups alone,
//! and their output replaces what the same groups gave before
//! ([`splice`]). Everything else, and every case where one VM's documents
//! could decide another's fate (a conflict over an address, MAC or port,
//! a Service's ClusterIP), takes the full stages: the increments are an
//! optimisation that must give exactly what a full pass gives, which the
//! equivalence test checks (`round::equivalence`).

use std::{collections::BTreeSet, net::IpAddr, path::PathBuf, sync::Arc};

use serde_json::Value;

use crate::config::{
    Config, ConfigError, Held,
    kube_objects::prune::{ClusterObject, group_kind},
    kube_objects::{
        CREATED_BY_LABEL, DEFAULT_NETWORK_ANNOTATION, NETWORKS_ANNOTATION, VM_NAME_LABEL,
        pod_claim_prefix,
    },
    source::{DocOrigin, Snapshot},
};
use crate::sys::hash::{HashMap, HashSet};

/// A VM's or a plain pod's group: (namespace, name). Its Attachments'
/// keys carry the same pair.
pub type GroupKey = (String, String);

/// One object's identity in a snapshot: the `Arc` the source shares
/// between snapshots while the object is unchanged.
#[derive(Debug, Clone)]
enum Member {
    Document(Arc<Value>),
    Cluster(Arc<ClusterObject>),
}

impl Member {
    fn same(&self, other: &Member) -> bool {
        match (self, other) {
            (Member::Document(a), Member::Document(b)) => Arc::ptr_eq(a, b) || a == b,
            (Member::Cluster(a), Member::Cluster(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
    fn ptr(&self) -> usize {
        match self {
            Member::Document(a) => Arc::as_ptr(a) as *const u8 as usize,
            Member::Cluster(a) => Arc::as_ptr(a) as *const u8 as usize,
        }
    }
}

fn same_list(a: &[Member], b: &[Member]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same(y))
}

/// Where each object of a snapshot belongs.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    /// Each group's key and objects, in snapshot order.
    groups: Vec<(GroupKey, Vec<Member>)>,
    /// namespace -> name -> the group's index in `groups`: two levels so
    /// that a lookup by borrowed names copies none (a round looks up a
    /// name or more per IPAMClaim).
    index: HashMap<String, HashMap<String, usize>>,
    /// The objects no group owns, in snapshot order; with the snapshot's
    /// read errors, ledger and given CIDRs (compared as a whole).
    context: Vec<Member>,
    /// namespace -> `pod_claim_prefix` -> the groups (indexes) of the
    /// plain pods with that prefix: the only ones that may read a claim
    /// whose name is hashed as `pod_claim_name` makes it (an interface
    /// that is no DNS label, a long pod name). A claim no group leads to
    /// is read by nobody (translation finds claims by name only), and a
    /// change to it costs nothing until a group that reads it comes.
    claim_prefixes: HashMap<String, HashMap<String, Vec<usize>>>,
    /// Every IPAMClaim with addresses in its status that a group reads:
    /// what a ledger change reaches.
    claim_ips: Vec<Arc<ClusterObject>>,
    read_errors: Vec<ConfigError>,
    /// Held, not only its address: a freed ledger's address may be the
    /// next one's.
    ledger: Option<Arc<crate::config::kube_objects::ledger::Ledger>>,
    /// (kind, namespace, name) of each grouped pod and migration (this
    /// node's, few) -> its groups, to attribute a refusal
    /// (`ConfigError::about`): a VMI's group is its own name, a claim's
    /// is found as it was placed.
    by_object: HashMap<(String, String, String), Vec<GroupKey>>,
    /// namespace -> claim -> the groups (indexes) whose pods reference it.
    references: HashMap<String, HashMap<String, Vec<usize>>>,
    /// A file's groups where every document in it is grouped (a file
    /// also holding context documents is not here): a refusal with no
    /// object (a vmpath document's) is attributed by its file.
    by_file: HashMap<PathBuf, BTreeSet<GroupKey>>,
    context_files: HashSet<PathBuf>,
}

/// The groups an object names, before claims (which are placed once
/// every group is known).
enum Place<'a> {
    Context,
    Group(&'a str, &'a str),
    Claim(&'a str, &'a str),
}

fn cluster_place<'a>(
    object: &'a ClusterObject,
    uids: &HashMap<&'a str, (&'a str, &'a str)>,
) -> Place<'a> {
    match object {
        ClusterObject::Vmi(v) => Place::Group(v.metadata.namespace(), &v.metadata.name),
        ClusterObject::Pod(p) => {
            let ns = p.metadata.namespace();
            let labels = &p.metadata.labels;
            if p.is_virt_launcher() {
                // As translation finds a launcher's VMI: by the uid its
                // created-by label names, else by the VM name label.
                if let Some(uid) = labels.get(CREATED_BY_LABEL)
                    && let Some((ns, name)) = uids.get(uid.as_str())
                {
                    return Place::Group(ns, name);
                }
                if let Some(name) = labels.get(VM_NAME_LABEL) {
                    return Place::Group(ns, name);
                }
            }
            Place::Group(ns, &p.metadata.name)
        }
        ClusterObject::Vmim(m) => Place::Group(m.metadata.namespace(), &m.spec.vmi_name),
        ClusterObject::IpamClaim(c) => Place::Claim(c.metadata.namespace(), &c.metadata.name),
        ClusterObject::Nad(_) | ClusterObject::Node(_) | ClusterObject::Refused(_) => {
            Place::Context
        }
    }
}

/// An object's (kind, namespace, name), as a refusal's `about` names it.
struct ObjectId {
    kind: String,
    namespace: String,
    name: String,
}

fn object_id(object: &ClusterObject) -> ObjectId {
    let (kind, meta) = match object {
        ClusterObject::Pod(o) => ("Pod", &o.metadata),
        ClusterObject::Vmi(o) => ("VirtualMachineInstance", &o.metadata),
        ClusterObject::Vmim(o) => ("VirtualMachineInstanceMigration", &o.metadata),
        ClusterObject::Nad(o) => ("NetworkAttachmentDefinition", &o.metadata),
        ClusterObject::IpamClaim(o) => ("IPAMClaim", &o.metadata),
        ClusterObject::Node(o) => ("Node", &o.metadata),
        ClusterObject::Refused(r) => {
            return ObjectId {
                kind: r.kind.to_string(),
                namespace: r.namespace.clone().unwrap_or_default(),
                name: r.name.clone(),
            };
        }
    };
    ObjectId {
        kind: kind.to_string(),
        namespace: meta.namespace().to_string(),
        name: meta.name.clone(),
    }
}

/// A vmpath Attachment document's group: its namespace and `spec.vm`
/// (a CNI port's: its pod's group). Anything else is context.
fn document_place<'a>(
    origin: &DocOrigin,
    value: &'a Value,
    pods: &HashMap<(&str, &str), usize>,
    groups: &'a [(GroupKey, Vec<Member>)],
) -> Place<'a> {
    let is_attachment =
        matches!(group_kind(value), Some((g, "Attachment")) if g.starts_with("vmpath"));
    if !is_attachment {
        return Place::Context;
    }
    let (Some(ns), Some(vm)) = (
        value.pointer("/metadata/namespace").and_then(Value::as_str),
        value.pointer("/spec/vm").and_then(Value::as_str),
    ) else {
        return Place::Context;
    };
    if *origin == DocOrigin::CniPort
        && let Some(&g) = pods.get(&(ns, vm))
    {
        let (ns, name) = &groups[g].0;
        return Place::Group(ns, name);
    }
    Place::Group(ns, vm)
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

impl Membership {
    /// The index of group (`namespace`, `name`), if it has objects.
    fn group(&self, namespace: &str, name: &str) -> Option<usize> {
        self.index.get(namespace)?.get(name).copied()
    }

    /// The index of group (`namespace`, `name`), made when new (the
    /// names copied then only).
    fn group_or_new(&mut self, namespace: &str, name: &str) -> usize {
        if let Some(g) = self.group(namespace, name) {
            return g;
        }
        let g = self.groups.len();
        self.groups
            .push(((namespace.to_string(), name.to_string()), Vec::new()));
        let names = match self.index.get_mut(namespace) {
            Some(names) => names,
            None => self.index.entry(namespace.to_string()).or_default(),
        };
        names.insert(name.to_string(), g);
        g
    }

    pub fn of(snap: &Snapshot) -> Self {
        let mut m = Membership {
            read_errors: snap.errors.clone(),
            ledger: snap.ledger.clone(),
            ..Default::default()
        };
        let uids: HashMap<&str, (&str, &str)> = snap
            .cluster
            .iter()
            .filter_map(|c| match &*c.object {
                ClusterObject::Vmi(v) => v
                    .metadata
                    .uid
                    .as_deref()
                    .map(|u| (u, (v.metadata.namespace(), v.metadata.name.as_str()))),
                _ => None,
            })
            .collect();
        let mut pods: HashMap<(&str, &str), usize> = HashMap::default();
        let mut claims: Vec<(usize, &str, &str)> = Vec::new();
        for (i, c) in snap.cluster.iter().enumerate() {
            match cluster_place(&c.object, &uids) {
                Place::Context => m.context.push(Member::Cluster(c.object.clone())),
                Place::Claim(ns, name) => claims.push((i, ns, name)),
                Place::Group(ns, name) => {
                    let g = m.group_or_new(ns, name);
                    if matches!(&*c.object, ClusterObject::Pod(_) | ClusterObject::Vmim(_)) {
                        let id = object_id(&c.object);
                        if let ClusterObject::Pod(p) = &*c.object {
                            pods.insert((p.metadata.namespace(), p.metadata.name.as_str()), g);
                            if !p.is_virt_launcher() {
                                m.claim_prefixes
                                    .entry(id.namespace.clone())
                                    .or_default()
                                    .entry(pod_claim_prefix(&p.metadata.name))
                                    .or_default()
                                    .push(g);
                            }
                            for r in claim_references(p) {
                                m.references
                                    .entry(id.namespace.clone())
                                    .or_default()
                                    .entry(r)
                                    .or_default()
                                    .push(g);
                            }
                        }
                        let key = m.groups[g].0.clone();
                        m.by_object
                            .entry((id.kind, id.namespace, id.name))
                            .or_default()
                            .push(key);
                    }
                    m.groups[g].1.push(Member::Cluster(c.object.clone()));
                }
            }
        }
        // Claims: in every group their name or a pod's reference leads to.
        let mut into = Vec::new();
        for (i, ns, name) in claims {
            let object = &snap.cluster[i].object;
            m.claim_group_indexes(ns, name, &mut into);
            if into.is_empty() {
                continue;
            }
            if matches!(&**object, ClusterObject::IpamClaim(c) if !c.status.ips.is_empty()) {
                m.claim_ips.push(object.clone());
            }
            for &g in &into {
                m.groups[g].1.push(Member::Cluster(object.clone()));
            }
        }
        let mut file_groups: HashMap<PathBuf, BTreeSet<GroupKey>> = HashMap::default();
        for d in &snap.documents {
            let member = Member::Document(d.value.clone());
            match document_place(&d.origin, &d.value, &pods, &m.groups) {
                Place::Group(ns, name) => {
                    let (ns, name) = (ns.to_string(), name.to_string());
                    let g = m.group_or_new(&ns, &name);
                    file_groups
                        .entry(d.file.clone())
                        .or_default()
                        .insert((ns, name));
                    m.groups[g].1.push(member);
                }
                _ => {
                    m.context_files.insert(d.file.clone());
                    m.context.push(member);
                }
            }
        }
        m.by_file = file_groups
            .into_iter()
            .filter(|(f, _)| !m.context_files.contains(f))
            .collect();
        m
    }

    /// The groups whose objects differ from `old`'s; `None` when the
    /// context did: then only a full pass will do.
    pub fn touched(&self, old: &Membership) -> Option<BTreeSet<GroupKey>> {
        if !same_list(&self.context, &old.context) || self.read_errors != old.read_errors {
            return None;
        }
        let mut out = match (&self.ledger, &old.ledger) {
            (Some(a), Some(b)) if !Arc::ptr_eq(a, b) => self.ledger_readers(&ledger_changes(b, a)),
            (a, b) if a.is_some() != b.is_some() => return None,
            _ => BTreeSet::new(),
        };
        for ((ns, name), members) in &self.groups {
            let same = old
                .group(ns, name)
                .is_some_and(|g| same_list(&old.groups[g].1, members));
            if !same {
                out.insert((ns.clone(), name.clone()));
            }
        }
        out.extend(
            old.groups
                .iter()
                .map(|(key, _)| key)
                .filter(|(ns, name)| self.group(ns, name).is_none())
                .cloned(),
        );
        Some(out)
    }

    /// The groups whose claims' `status.ips` name an address whose ledger
    /// entry changed (translation asks the ledger of those alone).
    fn ledger_readers(&self, changed: &HashSet<IpAddr>) -> BTreeSet<GroupKey> {
        let mut out = BTreeSet::new();
        if changed.is_empty() {
            return out;
        }
        for object in &self.claim_ips {
            let ClusterObject::IpamClaim(c) = &**object else {
                continue;
            };
            let names = c.status.ips.iter().any(|text| {
                text.parse::<ipnet::IpNet>()
                    .map_or(true, |ip| changed.contains(&ip.addr()))
            });
            if names {
                out.extend(self.claim_groups(c.metadata.namespace(), &c.metadata.name));
            }
        }
        out
    }

    /// `snap` cut down to the context and the objects of `groups`, in its
    /// own order.
    pub fn partial(&self, snap: &Snapshot, groups: &BTreeSet<GroupKey>) -> Snapshot {
        let keep: HashSet<usize> = groups
            .iter()
            .filter_map(|(ns, name)| self.group(ns, name))
            .flat_map(|g| &self.groups[g].1)
            .chain(&self.context)
            .map(Member::ptr)
            .collect();
        Snapshot {
            documents: snap
                .documents
                .iter()
                .filter(|d| keep.contains(&(Arc::as_ptr(&d.value) as *const u8 as usize)))
                .cloned()
                .collect(),
            cluster: snap
                .cluster
                .iter()
                .filter(|c| keep.contains(&(Arc::as_ptr(&c.object) as *const u8 as usize)))
                .cloned()
                .collect(),
            errors: snap.errors.clone(),
            empty: snap.empty,
            fingerprint: snap.fingerprint,
            pod_claims: snap.pod_claims,
            ledger: snap.ledger.clone(),
            cluster_cidrs: snap.cluster_cidrs.clone(),
        }
    }

    /// The groups (indexes, into `out`) claim `namespace/name` is read
    /// by: those its name may be a VM's or pod's of (`vm1.blue`), those
    /// whose pods reference it, and, for a hashed name, the plain pods it
    /// may be made from. Copies no name.
    fn claim_group_indexes(&self, namespace: &str, name: &str, out: &mut Vec<usize>) {
        out.clear();
        if let Some(names) = self.index.get(namespace) {
            out.extend(name_prefixes(name).filter_map(|p| names.get(p).copied()));
        }
        if let Some(gs) = self.references.get(namespace).and_then(|r| r.get(name)) {
            out.extend(gs);
        }
        // A hashed name: the plain pods whose names it may be made from.
        if let Some(gs) = hashed_claim_prefix(name)
            .and_then(|prefix| self.claim_prefixes.get(namespace)?.get(prefix))
        {
            out.extend(gs);
        }
        out.sort_unstable();
        out.dedup();
    }

    /// As [`Self::claim_group_indexes`], by key.
    fn claim_groups(&self, namespace: &str, name: &str) -> BTreeSet<GroupKey> {
        let mut out = Vec::new();
        self.claim_group_indexes(namespace, name, &mut out);
        out.into_iter().map(|g| self.groups[g].0.clone()).collect()
    }

    /// The groups a refusal or warning is about; `None`: the context's.
    fn groups_of(&self, e: &ConfigError) -> Option<Vec<GroupKey>> {
        if let Some(about) = &e.about {
            match about.kind.as_str() {
                "VirtualMachineInstance" => {
                    return self
                        .group(&about.namespace, &about.name)
                        .map(|g| vec![self.groups[g].0.clone()]);
                }
                "IPAMClaim" => {
                    let gs = self.claim_groups(&about.namespace, &about.name);
                    return (!gs.is_empty()).then(|| gs.into_iter().collect());
                }
                _ => {}
            }
            let id = (
                about.kind.clone(),
                about.namespace.clone(),
                about.name.clone(),
            );
            if let Some(gs) = self.by_object.get(&id) {
                return Some(gs.clone());
            }
            // A CNI port's pod not read (yet): the port's own group.
            if about.kind == "Pod"
                && let Some(g) = self.group(&id.1, &id.2)
            {
                return Some(vec![self.groups[g].0.clone()]);
            }
            return None;
        }
        self.by_file
            .get(&e.file)
            .map(|gs| gs.iter().cloned().collect())
    }
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
/// any network): one walk of both, in order.
fn ledger_changes(
    old: &crate::config::kube_objects::ledger::Ledger,
    new: &crate::config::kube_objects::ledger::Ledger,
) -> HashSet<IpAddr> {
    use crate::sys::sorted::Side;
    let mut out = HashSet::default();
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
    out
}

/// Whether a refusal is one document losing to another (an address, MAC,
/// port or VM interface someone else has): the outcome then depends on
/// documents of other groups, and only a full pass decides it.
fn is_conflict(e: &ConfigError) -> bool {
    let m = &e.message;
    m.contains("is already held by")
        || m.contains(" collides with ")
        || m.contains("is already used by")
        || m.contains("is already attached by")
        || e.field.starts_with("spec.clusterIP")
}

/// Who holds what among accepted VM interfaces, by group: a partial
/// pass's new attachments must not meet another group's.
#[derive(Debug, Clone, Default)]
pub struct Holdings {
    ips: HashMap<(String, IpAddr), GroupKey>,
    macs: HashMap<(String, [u8; 6]), GroupKey>,
    ports: HashMap<(String, String), GroupKey>,
    service_ips: HashSet<IpAddr>,
}

fn group_of(a: &crate::config::Attachment) -> GroupKey {
    (a.key.namespace.clone(), a.key.vm.clone())
}

impl Holdings {
    pub fn of(cfg: &Config) -> Self {
        let mut h = Holdings {
            service_ips: cfg
                .services
                .iter()
                .flat_map(|s| s.cluster_ips.iter().copied())
                .collect(),
            ..Default::default()
        };
        for a in &cfg.attachments {
            h.insert(a);
        }
        h
    }
    fn insert(&mut self, a: &crate::config::Attachment) {
        let g = group_of(a);
        for ip in &a.ips {
            self.ips.insert((a.network.clone(), ip.addr()), g.clone());
        }
        if let Some(mac) = a.mac {
            self.macs.insert((a.network.clone(), mac), g.clone());
        }
        self.ports.insert(
            (
                a.signalled_node().to_string(),
                a.signalled_port().to_string(),
            ),
            g,
        );
    }
    fn remove(&mut self, a: &crate::config::Attachment) {
        let g = group_of(a);
        for ip in &a.ips {
            let k = (a.network.clone(), ip.addr());
            if self.ips.get(&k) == Some(&g) {
                self.ips.remove(&k);
            }
        }
        if let Some(mac) = a.mac {
            let k = (a.network.clone(), mac);
            if self.macs.get(&k) == Some(&g) {
                self.macs.remove(&k);
            }
        }
        let k = (
            a.signalled_node().to_string(),
            a.signalled_port().to_string(),
        );
        if self.ports.get(&k) == Some(&g) {
            self.ports.remove(&k);
        }
    }
    /// Whether `a` would meet what a group other than `recomputed` holds,
    /// or a Service's ClusterIP (the recomputed groups meet each other in
    /// their own pass).
    fn meets(&self, a: &crate::config::Attachment, recomputed: &BTreeSet<GroupKey>) -> bool {
        let other = |h: Option<&GroupKey>| h.is_some_and(|h| !recomputed.contains(h));
        a.ips.iter().any(|ip| {
            self.service_ips.contains(&ip.addr())
                || other(self.ips.get(&(a.network.clone(), ip.addr())))
        }) || a
            .mac
            .is_some_and(|m| other(self.macs.get(&(a.network.clone(), m))))
            || other(self.ports.get(&(
                a.signalled_node().to_string(),
                a.signalled_port().to_string(),
            )))
    }
}

/// What validation weighs besides the documents: who holds what in the
/// claims store and on this node's running ports ([`Held`]), and one VM
/// interface's claim (`stored`, by `namespace/vm/interface`).
pub struct Evidence<'a> {
    pub held: &'a Held,
    pub stored: &'a dyn Fn(&str) -> Option<crate::resolve::store::Claim>,
}

impl Evidence<'_> {
    /// Why `a` (a recomputed group's, accepted by its partial pass) might
    /// be decided differently by a full pass: an address or MAC the
    /// evidence gives to a VM interface of another group, which a full
    /// pass would weigh against `a`, or one the evidence gives `a` (its
    /// document asks for none) that another group asks for.
    fn decides(
        &self,
        a: &crate::config::Attachment,
        previous: &Config,
        holdings: &Holdings,
        recomputed: &BTreeSet<GroupKey>,
    ) -> Option<&'static str> {
        let me = a.key.to_string();
        let own_port = |port: &str| {
            port == a.port
                || a.migration.as_ref().and_then(|m| m.target_port.as_deref()) == Some(port)
        };
        // A holder outside the recomputed groups that keeps what it holds
        // (its accepted document asks for it, or for no address or MAC).
        let keeps = |holder: &str, ask: &dyn Fn(&crate::config::Attachment) -> bool| {
            if holder == me {
                return false;
            }
            let Some(k) = crate::config::AttachmentKey::parse(holder) else {
                return true;
            };
            if recomputed.contains(&(k.namespace.clone(), k.vm.clone())) {
                return false;
            }
            let at = previous.attachments.partition_point(|x| x.key < k);
            previous
                .attachments
                .get(at)
                .is_some_and(|o| o.key == k && o.network == a.network && ask(o))
        };
        let id = previous.network(&a.network).map(|n| n.id);
        for ip in &a.ips {
            let ip = ip.addr();
            if let Some(h) = self.held.ips.get(&(a.network.clone(), ip))
                && keeps(h, &|o| {
                    o.ips.is_empty() || o.ips.iter().any(|n| n.addr() == ip)
                })
            {
                return Some("an address the claims store gives another VM interface");
            }
            if let Some(id) = id
                && let Some(port) = self.held.port_ips.get(&(id, ip))
                && !own_port(port)
            {
                return Some("an address a running port of another VM interface has");
            }
        }
        if let Some(mac) = a.mac {
            if let Some(h) = self.held.macs.get(&(a.network.clone(), mac))
                && keeps(h, &|o| o.mac.is_none_or(|m| m == mac))
            {
                return Some("a MAC the claims store gives another VM interface");
            }
            if let Some(id) = id
                && let Some(port) = self.held.port_macs.get(&(id, mac))
                && !own_port(port)
            {
                return Some("a MAC a running port of another VM interface has");
            }
        }
        // What the evidence gives `a` when its document asks for nothing:
        // a full pass would refuse another group asking for it.
        let other = |g: Option<&GroupKey>| g.is_some_and(|g| !recomputed.contains(g));
        if a.ips.is_empty() || a.mac.is_none() {
            if let Some(c) = (self.stored)(&me).filter(|c| c.network == a.network) {
                if a.ips.is_empty()
                    && c.ips
                        .iter()
                        .any(|ip| other(holdings.ips.get(&(a.network.clone(), ip.addr()))))
                {
                    return Some("an address stored for it that another group asks for");
                }
                if a.mac.is_none()
                    && let Some(mac) = c
                        .mac
                        .as_deref()
                        .and_then(|m| crate::config::parse_mac(m).ok())
                    && other(holdings.macs.get(&(a.network.clone(), mac)))
                {
                    return Some("a MAC stored for it that another group asks for");
                }
            }
            if let Some(id) = id {
                if a.ips.is_empty()
                    && self.held.port_ips.iter().any(|((n, ip), port)| {
                        *n == id
                            && own_port(port)
                            && other(holdings.ips.get(&(a.network.clone(), *ip)))
                    })
                {
                    return Some("an address its running port has that another group asks for");
                }
                if a.mac.is_none()
                    && self.held.port_macs.iter().any(|((n, mac), port)| {
                        *n == id
                            && own_port(port)
                            && other(holdings.macs.get(&(a.network.clone(), *mac)))
                    })
                {
                    return Some("a MAC its running port has that another group asks for");
                }
            }
        }
        None
    }
}

/// The range of `attachments` (sorted by key) in group `g`: a group's
/// VM interfaces share the key's (namespace, VM) prefix.
fn range_of(
    attachments: &[Arc<crate::config::Attachment>],
    g: &GroupKey,
) -> std::ops::Range<usize> {
    fn at(a: &crate::config::Attachment) -> (&str, &str) {
        (a.key.namespace.as_str(), a.key.vm.as_str())
    }
    let want = (g.0.as_str(), g.1.as_str());
    let start = attachments.partition_point(|a| at(a) < want);
    let end = start + attachments[start..].partition_point(|a| at(a) == want);
    start..end
}

/// `previous` (a full or spliced pass's config, `old` its membership)
/// with the output for `groups` replaced by `partial`'s (the stages run
/// on the context and those groups, `new` the membership now). Refused,
/// with why, when the groups' documents meet another group's or the
/// context's refusals would differ: the caller takes the full pass.
pub fn splice(
    previous: Config,
    holdings: &mut Holdings,
    old: &Membership,
    new: &Membership,
    groups: &BTreeSet<GroupKey>,
    partial: Config,
    evidence: &Evidence,
) -> Result<Config, &'static str> {
    if previous
        .errors
        .iter()
        .chain(&partial.errors)
        .any(is_conflict)
    {
        return Err("a conflict between documents");
    }
    let touches = |gs: &Option<Vec<GroupKey>>| {
        gs.as_ref()
            .is_some_and(|gs| gs.iter().any(|g| groups.contains(g)))
    };
    // The context's refusals as the partial pass gives them must be the
    // ones already said: anything new there came from a group's
    // documents it could not attribute.
    for e in partial.errors.iter().chain(&partial.warnings) {
        let gs = new.groups_of(e);
        if gs.is_none() && !previous.errors.contains(e) && !previous.warnings.contains(e) {
            return Err("a refusal no group owns");
        }
        if gs.is_some() && !touches(&gs) {
            return Err("a refusal of a group not recomputed");
        }
    }
    if partial
        .attachments
        .iter()
        .any(|a| !groups.contains(&group_of(a)))
    {
        return Err("a VM interface outside the recomputed groups");
    }
    if partial
        .attachments
        .iter()
        .any(|a| holdings.meets(a, groups))
    {
        return Err("an address, MAC or port another group holds");
    }
    if let Some(why) = partial
        .attachments
        .iter()
        .find_map(|a| evidence.decides(a, &previous, holdings, groups))
    {
        return Err(why);
    }
    let mut cfg = previous;
    let kept = |e: &ConfigError| !touches(&old.groups_of(e));
    let fresh = |e: &&ConfigError| touches(&new.groups_of(e));
    cfg.errors.retain(kept);
    cfg.errors
        .extend(partial.errors.iter().filter(fresh).cloned());
    cfg.warnings.retain(kept);
    cfg.warnings
        .extend(partial.warnings.iter().filter(fresh).cloned());
    let in_groups =
        |k: &crate::config::AttachmentKey| groups.contains(&(k.namespace.clone(), k.vm.clone()));
    for g in groups {
        let low = crate::config::AttachmentKey {
            namespace: g.0.clone(),
            vm: g.1.clone(),
            interface: String::new(),
        };
        let stale: Vec<_> = cfg
            .keys_in_documents
            .range(low..)
            .take_while(|k| k.namespace == g.0 && k.vm == g.1)
            .cloned()
            .collect();
        for k in stale {
            cfg.keys_in_documents.remove(&k);
        }
    }
    cfg.keys_in_documents.extend(
        partial
            .keys_in_documents
            .iter()
            .filter(|k| in_groups(k))
            .cloned(),
    );
    // Each group's old VM interfaces out (a contiguous range of the
    // sorted list), its new ones in at their place.
    for g in groups.iter().rev() {
        let r = range_of(&cfg.attachments, g);
        for a in &cfg.attachments[r.clone()] {
            holdings.remove(a);
        }
        cfg.attachments.drain(r);
    }
    for a in partial.attachments {
        holdings.insert(&a);
        let at = cfg.attachments.partition_point(|x| x.key < a.key);
        cfg.attachments.insert(at, a);
    }
    Ok(cfg)
}

/// The VM interface keys of `groups` (for the log).
pub fn count_keys(cfg: &Config, groups: &BTreeSet<GroupKey>) -> usize {
    cfg.attachments
        .iter()
        .filter(|a| groups.contains(&group_of(a)))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let dir = std::env::temp_dir().join(format!("vmpath-groups-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut reader = crate::config::source::Reader::default();
        let write = |file: &str, text: &str| {
            let path = dir.join(file);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(text) {
                std::fs::write(path, text).unwrap();
            }
        };
        let mut membership = |ips: [&str; 3]| {
            write("pod.yaml", &POD.replace("NAME", &long_name()));
            write("theirs.yaml", &claim("prod", &theirs, ips[0]));
            write("stray.yaml", &claim("prod", stray, ips[1]));
            write("other.yaml", &claim("other", &theirs, ips[2]));
            Membership::of(&reader.read(&dir))
        };
        let before = membership(["10.9.0.5/24", "10.9.0.6/24", "10.9.0.9/24"]);
        let group = ("prod".to_string(), long_name());
        let after = membership(["10.9.0.7/24", "10.9.0.6/24", "10.9.0.9/24"]);
        assert_eq!(
            after.touched(&before),
            Some(BTreeSet::from([group])),
            "the pod's claim changed: its group alone"
        );
        assert_eq!(
            membership(["10.9.0.7/24", "10.9.0.8/24", "10.9.0.9/24"]).touched(&after),
            Some(BTreeSet::new()),
            "a claim nobody reads changed: nothing to do"
        );
        let last = membership(["10.9.0.7/24", "10.9.0.8/24", "10.9.0.9/24"]);
        assert_eq!(
            membership(["10.9.0.7/24", "10.9.0.8/24", "10.9.0.7/24"]).touched(&last),
            Some(BTreeSet::new()),
            "another namespace's claim of the same name reaches no pod here"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
