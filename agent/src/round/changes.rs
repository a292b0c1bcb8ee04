//! The changed set: which objects changed since the last round (keyed by
//! kind, namespace and name), and which VM interfaces that touches through
//! the dependency indexes (a Network -> its endpoints, a NetworkPolicy ->
//! the endpoints it selects, a Node -> the endpoints it hosts, whose
//! tunnels point at it).
//!
//! The round keeps each object's version as the source handed it over: the
//! sources share an unchanged object's value between snapshots (`Arc`), so
//! telling what changed costs a pointer comparison per object, not a
//! re-reading; a value re-parsed with the same content compares equal.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use serde_json::Value;

use crate::{
    config::kube_objects::prune::{ClusterObject, group_kind},
    config::{AttachmentKey, source::Snapshot},
    resolve::resolved::Resolved,
};

/// What identifies an object across rounds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{} {}", self.kind, self.name)
        } else {
            write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// One version of an object, as the source shares it.
#[derive(Debug, Clone)]
enum Version {
    Document(Arc<Value>),
    Cluster(Arc<ClusterObject>),
}

impl Version {
    fn same(&self, other: &Version) -> bool {
        match (self, other) {
            (Version::Document(a), Version::Document(b)) => Arc::ptr_eq(a, b) || a == b,
            // The typed objects are replaced whole by the watchers: a new
            // pointer is a new version.
            (Version::Cluster(a), Version::Cluster(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// Every object of a snapshot with its version (several under one key
/// when the sources hold duplicates: validation refuses all but one).
#[derive(Debug, Clone, Default)]
pub struct Versions(BTreeMap<ObjectKey, Vec<Version>>);

fn document_key(value: &Value) -> ObjectKey {
    let s = |p: &str| {
        value
            .pointer(p)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    ObjectKey {
        kind: group_kind(value)
            .map(|(_, k)| k.to_string())
            .unwrap_or_default(),
        namespace: s("/metadata/namespace"),
        name: s("/metadata/name"),
    }
}

pub(crate) fn cluster_key(object: &ClusterObject) -> ObjectKey {
    let (kind, meta) = match object {
        ClusterObject::Pod(o) => ("Pod", &o.metadata),
        ClusterObject::Vmi(o) => ("VirtualMachineInstance", &o.metadata),
        ClusterObject::Vmim(o) => ("VirtualMachineInstanceMigration", &o.metadata),
        ClusterObject::Nad(o) => ("NetworkAttachmentDefinition", &o.metadata),
        ClusterObject::IpamClaim(o) => ("IPAMClaim", &o.metadata),
        ClusterObject::Node(o) => ("v1 Node", &o.metadata),
        ClusterObject::Refused(r) => {
            return ObjectKey {
                kind: r.kind.to_string(),
                namespace: r.namespace.clone().unwrap_or_default(),
                name: r.name.clone(),
            };
        }
    };
    ObjectKey {
        kind: kind.to_string(),
        namespace: meta.namespace().to_string(),
        name: meta.name.clone(),
    }
}

impl Versions {
    pub fn of(snap: &Snapshot) -> Self {
        let mut out: BTreeMap<ObjectKey, Vec<Version>> = BTreeMap::new();
        for d in &snap.documents {
            out.entry(document_key(&d.value))
                .or_default()
                .push(Version::Document(d.value.clone()));
        }
        for c in &snap.cluster {
            out.entry(cluster_key(&c.object))
                .or_default()
                .push(Version::Cluster(c.object.clone()));
        }
        Versions(out)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What changed between two snapshots, object by object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeSet {
    pub added: BTreeSet<ObjectKey>,
    pub updated: BTreeSet<ObjectKey>,
    pub removed: BTreeSet<ObjectKey>,
}

impl ChangeSet {
    /// The objects of `new` that are not as they were in `old`.
    pub fn between(old: &Versions, new: &Versions) -> Self {
        let mut set = ChangeSet::default();
        for (key, versions) in &new.0 {
            match old.0.get(key) {
                None => {
                    set.added.insert(key.clone());
                }
                Some(before) => {
                    let same = before.len() == versions.len()
                        && before.iter().zip(versions).all(|(a, b)| a.same(b));
                    if !same {
                        set.updated.insert(key.clone());
                    }
                }
            }
        }
        for key in old.0.keys().filter(|k| !new.0.contains_key(*k)) {
            set.removed.insert(key.clone());
        }
        set
    }

    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.updated.is_empty() && self.removed.is_empty()
    }

    pub fn len(&self) -> usize {
        self.added.len() + self.updated.len() + self.removed.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.added.iter().chain(&self.updated).chain(&self.removed)
    }
}

/// Who depends on what, from one round's resolved config: the indexes a
/// change is fanned out through.
#[derive(Debug, Clone, Default)]
pub struct Dependents {
    /// Network name -> its VM interfaces.
    pub by_network: BTreeMap<String, BTreeSet<AttachmentKey>>,
    /// Node name -> the VM interfaces it hosts or is the migration target
    /// of (their tunnels lead to it).
    pub by_node: BTreeMap<String, BTreeSet<AttachmentKey>>,
    /// Namespace -> its VM interfaces (a NetworkPolicy selects within its
    /// namespace).
    pub by_namespace: BTreeMap<String, BTreeSet<AttachmentKey>>,
    /// (namespace, VM or pod name) -> its interfaces: the objects a VM
    /// interface is derived from (VMI, virt-launcher pod, Attachment,
    /// IPAMClaim, migration) are named after its VM.
    pub by_vm: BTreeMap<(String, String), BTreeSet<AttachmentKey>>,
    /// NetworkPolicy (namespace, name) -> the VM interfaces it selects.
    pub by_policy: BTreeMap<(String, String), BTreeSet<AttachmentKey>>,
}

impl Dependents {
    pub fn of(cfg: &Resolved) -> Self {
        let mut d = Dependents::default();
        for a in &cfg.attachments {
            let key = &a.key;
            d.by_network
                .entry(a.network.clone())
                .or_default()
                .insert(key.clone());
            d.by_node
                .entry(a.node.clone())
                .or_default()
                .insert(key.clone());
            if let Some(m) = &a.migration {
                d.by_node
                    .entry(m.target_node.clone())
                    .or_default()
                    .insert(key.clone());
            }
            d.by_namespace
                .entry(key.namespace.clone())
                .or_default()
                .insert(key.clone());
            d.by_vm
                .entry((key.namespace.clone(), key.vm.clone()))
                .or_default()
                .insert(key.clone());
        }
        for p in &cfg.config.policies {
            let selected = cfg
                .attachments
                .iter()
                .filter(|a| a.key.namespace == p.namespace && p.pod_selector.matches(&a.labels))
                .map(|a| a.key.clone())
                .collect();
            d.by_policy
                .insert((p.namespace.clone(), p.name.clone()), selected);
        }
        d
    }
}

/// What a changed set touches.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Affected {
    /// The VM interfaces whose entries may change.
    pub endpoints: BTreeSet<AttachmentKey>,
    /// Something every endpoint depends on changed (a namespace's labels,
    /// which any policy's peers may select; an object of a kind with no
    /// index): everything is recomputed.
    pub everything: bool,
}

/// The VM interfaces `changes` touches, looked up in the indexes of the
/// round before (`old`: what an object's change or removal takes away)
/// and of this round (`new`: what it brings).
pub fn affected(changes: &ChangeSet, old: &Dependents, new: &Dependents) -> Affected {
    let mut out = Affected::default();
    fn take(into: &mut BTreeSet<AttachmentKey>, set: Option<&BTreeSet<AttachmentKey>>) {
        if let Some(set) = set {
            into.extend(set.iter().cloned());
        }
    }
    for key in changes.keys() {
        let ns_name = (key.namespace.clone(), key.name.clone());
        match key.kind.as_str() {
            "Network" => {
                take(&mut out.endpoints, old.by_network.get(&key.name));
                take(&mut out.endpoints, new.by_network.get(&key.name));
            }
            "Node" | "v1 Node" => {
                take(&mut out.endpoints, old.by_node.get(&key.name));
                take(&mut out.endpoints, new.by_node.get(&key.name));
            }
            "NetworkPolicy" => {
                take(&mut out.endpoints, old.by_policy.get(&ns_name));
                take(&mut out.endpoints, new.by_policy.get(&ns_name));
            }
            "Attachment" | "VirtualMachineInstance" | "IPAMClaim" | "Pod" => {
                // An Attachment, a claim or a pod is named after its VM,
                // with a suffix (`vm1-eth0`, `vm1.blue`,
                // `virt-launcher-vm1-x7k2p`): each VM name it could stand
                // for is looked up, never every VM of the namespace.
                for vm in vm_names(&key.name) {
                    let at = (key.namespace.clone(), vm.to_string());
                    take(&mut out.endpoints, old.by_vm.get(&at));
                    take(&mut out.endpoints, new.by_vm.get(&at));
                }
            }
            "VirtualMachineInstanceMigration" => {
                // A migration names its VMI in its spec, not its name.
                out.everything = true;
            }
            _ => out.everything = true,
        }
    }
    out
}

/// The VM names object `name` may belong to: itself, and every prefix
/// of it ending before a `-` or `.` (of what follows `virt-launcher-`
/// too).
fn vm_names(name: &str) -> Vec<&str> {
    fn prefixes(s: &str) -> impl Iterator<Item = &str> {
        s.char_indices()
            .filter(|(_, c)| *c == '-' || *c == '.')
            .map(move |(i, _)| &s[..i])
    }
    let mut out = vec![name];
    out.extend(prefixes(name));
    if let Some(rest) = name.strip_prefix("virt-launcher-") {
        out.extend(prefixes(rest));
    }
    out
}

/// Whether object `name` may be one of VM `vm`'s.
#[cfg(test)]
fn names_vm(name: &str, vm: &str) -> bool {
    vm_names(name).contains(&vm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::{
        resolve::resolve,
        tests::{BLUE, attachment, snapshot_of},
    };

    const POLICY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: web, namespace: prod}\nspec:\n  podSelector: {matchLabels: {app: web}}\n  policyTypes: [Ingress]\n";

    fn labelled(vm: &str, node: &str) -> String {
        attachment(vm, node).replace("metadata: {", "metadata: {labels: {app: web}, ")
    }

    fn cfg(yaml: &str) -> (Versions, Resolved) {
        let snap = snapshot_of(yaml);
        let cfg = resolve(crate::round::validate(&snap, "a", &Default::default()), "a");
        (Versions::of(&snap), cfg)
    }

    #[test]
    fn an_unchanged_snapshot_has_no_changes_and_each_kind_fans_out_to_its_dependents() {
        let base = format!(
            "{BLUE}---\n{POLICY}---\n{}---\n{}---\n{}",
            labelled("vm1", "a"),
            attachment("vm2", "b"),
            attachment("vm3", "a")
        );
        let (v1, c1) = cfg(&base);
        assert!(c1.errors.is_empty(), "{:?}", c1.errors);
        let d1 = Dependents::of(&c1);
        assert!(ChangeSet::between(&v1, &v1).is_empty());
        let key = |vm: &str| AttachmentKey {
            namespace: "prod".into(),
            vm: vm.into(),
            interface: "eth0".into(),
        };

        // One Attachment changed: its own VM interface, nothing else.
        let (v2, c2) = cfg(&base.replace("vm2p", "vm2q"));
        let changes = ChangeSet::between(&v1, &v2);
        assert_eq!(changes.len(), 1, "{changes:?}");
        let hit = affected(&changes, &d1, &Dependents::of(&c2));
        assert_eq!(hit.endpoints, BTreeSet::from([key("vm2")]));
        assert!(!hit.everything);

        // The policy: the VM interfaces it selects.
        let (v3, c3) = cfg(&base.replace("policyTypes: [Ingress]", "policyTypes: [Egress]"));
        let hit = affected(&ChangeSet::between(&v1, &v3), &d1, &Dependents::of(&c3));
        assert_eq!(hit.endpoints, BTreeSet::from([key("vm1")]));

        // The network: every VM interface on it.
        let (v4, c4) = cfg(&base.replace("id: 7", "id: 8"));
        let hit = affected(&ChangeSet::between(&v1, &v4), &d1, &Dependents::of(&c4));
        assert_eq!(hit.endpoints.len(), 3);

        // A node: the VM interfaces it hosts (the tunnels to it).
        let node_b = "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {name: b}\nspec: {address: 192.0.2.2}\n";
        let (v5, c5) = cfg(&format!("{base}---\n{node_b}"));
        let hit = affected(&ChangeSet::between(&v1, &v5), &d1, &Dependents::of(&c5));
        assert_eq!(hit.endpoints, BTreeSet::from([key("vm2")]));

        // A deleted Attachment: the VM interface it gave.
        let (v6, c6) = cfg(&format!(
            "{BLUE}---\n{POLICY}---\n{}---\n{}",
            labelled("vm1", "a"),
            attachment("vm2", "b"),
        ));
        let changes = ChangeSet::between(&v1, &v6);
        assert_eq!(changes.removed.len(), 1, "{changes:?}");
        let hit = affected(&changes, &d1, &Dependents::of(&c6));
        assert_eq!(hit.endpoints, BTreeSet::from([key("vm3")]));
    }

    #[test]
    fn objects_named_after_a_vm_are_its_own() {
        assert!(names_vm("vm1", "vm1"));
        assert!(names_vm("vm1-eth0", "vm1"));
        assert!(names_vm("vm1.blue", "vm1"));
        assert!(names_vm("virt-launcher-vm1-x7k2p", "vm1"));
        assert!(!names_vm("vm10-eth0", "vm1"));
        assert!(!names_vm("virt-launcher-vm10-x7k2p", "vm1"));
    }
}
