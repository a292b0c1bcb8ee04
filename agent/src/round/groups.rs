//! Derive and validate by VM: the objects of a snapshot fall into groups,
//! one per VM or pod, and the context every group is read against
//! ([`Membership`], which keeps where each object is from round to round).
//! When only groups changed, the derive and validate stages run on the
//! context and those groups alone, and their output replaces what the same
//! groups gave before ([`splice`]). Everything else, and every case where
//! one VM's documents could decide another's fate (a conflict over an
//! address, MAC or port, a Service's ClusterIP), takes the full stages:
//! the increments are an optimisation that must give exactly what a full
//! pass gives, which the equivalence test checks (`round::equivalence`).

use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use crate::config::{Config, ConfigError, Held};
use crate::sys::hash::{HashMap, HashSet};
use crate::sys::intern::Name;
use crate::sys::ip_map::IpMap;

pub use super::membership::{GroupKey, Membership};

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
///
/// Kept between rounds for every VM interface of the cluster: by network
/// (and node) first, so that an entry holds no copy of those names and a
/// lookup makes none, and each interface's group once, shared by its
/// entries.
#[derive(Debug, Clone, Default)]
pub struct Holdings {
    /// network -> address -> its group.
    ips: HashMap<Name, IpMap<(), Arc<GroupKey>>>,
    /// network -> MAC -> its group.
    macs: HashMap<Name, HashMap<[u8; 6], Arc<GroupKey>>>,
    /// node -> port -> its group. Names: KubeVirt names every VM's pod
    /// interface on a network alike, so a port is the Attachment's copy
    /// of that name, not a string of its own per VM.
    ports: HashMap<Name, HashMap<Name, Arc<GroupKey>>>,
    service_ips: HashSet<IpAddr>,
}

fn group_of(a: &crate::config::Attachment) -> GroupKey {
    (a.key.namespace.clone(), a.key.vm.clone())
}

/// The inner map at `outer`, made when new.
fn within<'a, V>(
    m: &'a mut HashMap<Name, HashMap<V, Arc<GroupKey>>>,
    outer: &Name,
) -> &'a mut HashMap<V, Arc<GroupKey>> {
    if !m.contains_key(outer.as_str()) {
        m.insert(outer.clone(), HashMap::default());
    }
    m.get_mut(outer.as_str()).expect("made above")
}

/// Removes `inner` from the map at `outer` if `g` holds it (and the map,
/// once empty).
fn release<V, Q>(
    m: &mut HashMap<Name, HashMap<V, Arc<GroupKey>>>,
    outer: &str,
    inner: &Q,
    g: &GroupKey,
) where
    V: std::hash::Hash + Eq + std::borrow::Borrow<Q>,
    Q: std::hash::Hash + Eq + ?Sized,
{
    if let Some(held) = m.get_mut(outer) {
        if held.get(inner).is_some_and(|h| **h == *g) {
            held.remove(inner);
        }
        if held.is_empty() {
            m.remove(outer);
        }
    }
}

impl Holdings {
    /// `groups`: where each attachment's group key is shared from.
    pub fn of(cfg: &Config, groups: &Membership) -> Self {
        let mut h = Holdings {
            service_ips: cfg
                .services
                .iter()
                .flat_map(|s| s.cluster_ips.iter().copied())
                .collect(),
            ..Default::default()
        };
        for a in &cfg.attachments {
            h.insert(a, groups);
        }
        h
    }
    fn insert(&mut self, a: &crate::config::Attachment, groups: &Membership) {
        // The membership's copy of the group's key (one per VM, not one
        // more per VM interface held here).
        let g = groups
            .group_key(&a.key.namespace, &a.key.vm)
            .unwrap_or_else(|| Arc::new(group_of(a)));
        if !a.ips.is_empty() {
            if !self.ips.contains_key(a.network.as_str()) {
                self.ips.insert(a.network.clone(), IpMap::default());
            }
            let held = self.ips.get_mut(a.network.as_str()).expect("made above");
            for ip in &a.ips {
                held.insert((), ip.addr(), g.clone());
            }
        }
        if let Some(mac) = a.mac {
            within(&mut self.macs, &a.network).insert(mac, g.clone());
        }
        let (node, port) = a.signalled_names();
        within(&mut self.ports, &node).insert(port, g);
    }
    fn remove(&mut self, a: &crate::config::Attachment) {
        let g = group_of(a);
        if let Some(held) = self.ips.get_mut(a.network.as_str()) {
            for ip in &a.ips {
                if held.get(&(), &ip.addr()).is_some_and(|h| **h == g) {
                    held.remove(&(), &ip.addr());
                }
            }
            if held.is_empty() {
                self.ips.remove(a.network.as_str());
            }
        }
        if let Some(mac) = a.mac {
            release(&mut self.macs, &a.network, &mac, &g);
        }
        release(&mut self.ports, a.signalled_node(), a.signalled_port(), &g);
    }
    /// The group holding `ip` on `network`.
    fn ip(&self, network: &str, ip: &IpAddr) -> Option<&GroupKey> {
        self.ips.get(network)?.get(&(), ip).map(|g| &**g)
    }
    /// The group holding `mac` on `network`.
    fn mac(&self, network: &str, mac: &[u8; 6]) -> Option<&GroupKey> {
        self.macs.get(network)?.get(mac).map(|g| &**g)
    }
    /// Whether `a` would meet what a group other than `recomputed` holds,
    /// or a Service's ClusterIP (the recomputed groups meet each other in
    /// their own pass).
    fn meets(&self, a: &crate::config::Attachment, recomputed: &BTreeSet<GroupKey>) -> bool {
        let other = |h: Option<&GroupKey>| h.is_some_and(|h| !recomputed.contains(h));
        a.ips.iter().any(|ip| {
            self.service_ips.contains(&ip.addr()) || other(self.ip(&a.network, &ip.addr()))
        }) || a.mac.is_some_and(|m| other(self.mac(&a.network, &m)))
            || other(
                self.ports
                    .get(a.signalled_node())
                    .and_then(|p| p.get(a.signalled_port()))
                    .map(|g| &**g),
            )
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
            if let Some(h) = self.held.stored_ip(&a.network, ip)
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
            if let Some(h) = self.held.stored_mac(&a.network, mac)
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
                        .any(|ip| other(holdings.ip(&a.network, &ip.addr())))
                {
                    return Some("an address stored for it that another group asks for");
                }
                if a.mac.is_none()
                    && let Some(mac) = c.mac
                    && other(holdings.mac(&a.network, &mac))
                {
                    return Some("a MAC stored for it that another group asks for");
                }
            }
            if let Some(id) = id {
                if a.ips.is_empty()
                    && self.held.port_ips.iter().any(|((n, ip), port)| {
                        *n == id && own_port(port) && other(holdings.ip(&a.network, ip))
                    })
                {
                    return Some("an address its running port has that another group asks for");
                }
                if a.mac.is_none()
                    && self.held.port_macs.iter().any(|((n, mac), port)| {
                        *n == id && own_port(port) && other(holdings.mac(&a.network, mac))
                    })
                {
                    return Some("a MAC its running port has that another group asks for");
                }
            }
        }
        None
    }
}

/// The groups each refusal and warning of a config was attributed to by
/// the membership it was validated with: taken before the membership
/// reads the next snapshot, for [`splice`].
pub struct Attribution {
    errors: Vec<Option<Vec<GroupKey>>>,
    warnings: Vec<Option<Vec<GroupKey>>>,
}

impl Attribution {
    pub fn of(cfg: &Config, membership: &Membership) -> Self {
        Attribution {
            errors: cfg.errors.iter().map(|e| membership.groups_of(e)).collect(),
            warnings: cfg
                .warnings
                .iter()
                .map(|e| membership.groups_of(e))
                .collect(),
        }
    }
}

/// `previous` (a full or spliced pass's config, `old` where its refusals
/// were attributed) with the output for `groups` replaced by `partial`'s
/// (the stages run on the context and those groups, `new` the membership
/// now). Refused, with why, when the groups' documents meet another
/// group's or the context's refusals would differ: the caller takes the
/// full pass.
pub fn splice(
    previous: Config,
    holdings: &mut Holdings,
    old: &Attribution,
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
    let from = previous.lineage.version;
    let mut cfg = previous;
    if old.errors.len() != cfg.errors.len() || old.warnings.len() != cfg.warnings.len() {
        return Err("refusals attributed by another membership");
    }
    let fresh = |e: &&ConfigError| touches(&new.groups_of(e));
    let mut kept = old.errors.iter().map(|gs| !touches(gs));
    cfg.errors.retain(|_| kept.next().unwrap_or(true));
    cfg.errors
        .extend(partial.errors.iter().filter(fresh).cloned());
    let mut kept = old.warnings.iter().map(|gs| !touches(gs));
    cfg.warnings.retain(|_| kept.next().unwrap_or(true));
    cfg.warnings
        .extend(partial.warnings.iter().filter(fresh).cloned());
    let in_groups =
        |k: &crate::config::AttachmentKey| groups.contains(&(k.namespace.clone(), k.vm.clone()));
    for g in groups {
        let low = crate::config::AttachmentKey::new(
            g.0.as_str().into(),
            g.1.as_str().into(),
            crate::sys::intern::Name::default(),
        );
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
        let r = crate::config::group_range(&cfg.attachments, g);
        for a in &cfg.attachments[r.clone()] {
            holdings.remove(a);
        }
        cfg.attachments.drain(r);
    }
    // Room by a sixteenth when it must grow, not the double a push takes.
    let grows = partial.attachments.len();
    if grows > cfg.attachments.capacity() - cfg.attachments.len() {
        cfg.attachments
            .reserve_exact(grows + cfg.attachments.len() / 16);
    }
    for a in partial.attachments {
        holdings.insert(&a, new);
        let at = cfg.attachments.partition_point(|x| x.key < a.key);
        cfg.attachments.insert(at, a);
    }
    cfg.lineage = crate::config::Lineage::spliced(from, groups);
    Ok(cfg)
}

/// The VM interface keys of `groups` (for the log).
pub fn count_keys(cfg: &Config, groups: &BTreeSet<GroupKey>) -> usize {
    cfg.attachments
        .iter()
        .filter(|a| groups.contains(&group_of(a)))
        .count()
}
