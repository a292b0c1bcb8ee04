//! A map of this node's entries over other nodes' entries, as
//! `vmp_addresses` and `vmp_endpoints` hold them: a local entry wins its
//! key. The other nodes' layer is shared (`Arc`) between rounds while
//! nothing it came from changed (`overlay::Cache`): a VM's ADD on this
//! node changes the local layer only, so comparing two plans, keeping
//! what was written and diffing it against the next plan cost what the
//! local layer holds, not the cluster's endpoints.

use std::{collections::BTreeMap, sync::Arc};

use crate::sys::sorted::{Side, merge};

#[derive(Debug, Clone)]
pub struct Layered<K, V> {
    /// This node's entries (its ports' VMs).
    pub local: BTreeMap<K, V>,
    /// Other nodes' entries; a key `local` has is hidden.
    pub remote: Arc<BTreeMap<K, V>>,
}

impl<K, V> Default for Layered<K, V> {
    fn default() -> Self {
        Layered {
            local: BTreeMap::new(),
            remote: Arc::new(BTreeMap::new()),
        }
    }
}

impl<K: Ord + Copy, V: Copy> Layered<K, V> {
    /// The entry in force for `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.local.get(key).or_else(|| self.remote.get(key))
    }

    pub fn contains_key(&self, key: &K) -> bool {
        self.local.contains_key(key) || self.remote.contains_key(key)
    }

    /// A local entry (the plan's ports, tests).
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.local.insert(key, value)
    }

    /// Every entry in force, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        let mut out = Vec::with_capacity(self.local.len() + self.remote.len());
        merge(
            self.remote.iter(),
            self.local.iter(),
            |(k, _)| *k,
            |(k, _)| *k,
            |side| match side {
                Side::Old(e) | Side::New(e) | Side::Both(_, e) => out.push(e),
            },
        );
        out.into_iter()
    }

    /// How many entries are in force.
    pub fn len(&self) -> usize {
        self.remote.len() + self.local.len()
            - self
                .local
                .keys()
                .filter(|k| self.remote.contains_key(k))
                .count()
    }

    pub fn is_empty(&self) -> bool {
        self.local.is_empty() && self.remote.is_empty()
    }

    /// Every entry in force as one map.
    pub fn to_map(&self) -> BTreeMap<K, V> {
        self.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// The keys whose entry in force may differ between `self` and
    /// `next`, with both entries: every key when the remote layers differ
    /// (one walk of both), else only the local layers' keys.
    pub fn changes<'a>(&'a self, next: &'a Self) -> Vec<(K, Option<&'a V>, Option<&'a V>)>
    where
        V: PartialEq,
    {
        let mut out = Vec::new();
        if Arc::ptr_eq(&self.remote, &next.remote) {
            merge(
                self.local.keys(),
                next.local.keys(),
                |k| *k,
                |k| *k,
                |side| {
                    let k = match side {
                        Side::Old(k) | Side::New(k) | Side::Both(k, _) => *k,
                    };
                    let (was, now) = (self.get(&k), next.get(&k));
                    if was != now {
                        out.push((k, was, now));
                    }
                },
            );
        } else {
            merge(
                self.iter(),
                next.iter(),
                |(k, _)| *k,
                |(k, _)| *k,
                |side| match side {
                    Side::Old((k, v)) => out.push((*k, Some(v), None)),
                    Side::New((k, v)) => out.push((*k, None, Some(v))),
                    Side::Both((k, was), (_, now)) => {
                        if was != now {
                            out.push((*k, Some(was), Some(now)));
                        }
                    }
                },
            );
        }
        out
    }
}

impl<K: Ord + Copy, V: Copy + PartialEq> PartialEq for Layered<K, V> {
    /// The entries in force: the same remote layer compares its local
    /// layers alone.
    fn eq(&self, other: &Self) -> bool {
        if Arc::ptr_eq(&self.remote, &other.remote) {
            return self.local == other.local;
        }
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl<K: Ord + Copy, V: Copy + Eq> Eq for Layered<K, V> {}

impl<K: Ord + Copy, V: Copy> std::ops::Index<&K> for Layered<K, V> {
    type Output = V;
    fn index(&self, key: &K) -> &V {
        self.get(key).expect("no entry for the key")
    }
}

impl<K: Ord + Copy, V: Copy> FromIterator<(K, V)> for Layered<K, V> {
    /// All local (tests).
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Layered {
            local: iter.into_iter().collect(),
            remote: Arc::new(BTreeMap::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layered(local: &[(u32, u32)], remote: &[(u32, u32)]) -> Layered<u32, u32> {
        Layered {
            local: local.iter().copied().collect(),
            remote: Arc::new(remote.iter().copied().collect()),
        }
    }

    #[test]
    fn a_local_entry_hides_the_remote_one_of_its_key() {
        let l = layered(&[(2, 20), (5, 50)], &[(1, 1), (2, 2), (9, 9)]);
        assert_eq!(l.get(&2), Some(&20));
        assert_eq!(l.get(&9), Some(&9));
        assert_eq!(l.len(), 4);
        assert_eq!(
            l.to_map(),
            BTreeMap::from([(1, 1), (2, 20), (5, 50), (9, 9)])
        );
    }

    /// What changes gives is what a comparison of the two whole maps
    /// gives, whether or not the remote layer is shared.
    #[test]
    fn the_changes_are_the_whole_maps_difference() {
        let mut rng = crate::sys::hash::fnv1a(&[b"layered"]);
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..500 {
            let mut entries = |n: u64| -> Vec<(u32, u32)> {
                (0..n)
                    .map(|_| ((next() % 16) as u32, (next() % 3) as u32))
                    .collect()
            };
            let (la, ra, lb, rb) = (entries(6), entries(10), entries(6), entries(10));
            let a = layered(&la, &ra);
            let shared = next() % 2 == 0;
            let b = Layered {
                local: lb.iter().copied().collect(),
                remote: if shared {
                    a.remote.clone()
                } else {
                    Arc::new(rb.iter().copied().collect())
                },
            };
            let (ma, mb) = (a.to_map(), b.to_map());
            let mut want: Vec<(u32, Option<u32>, Option<u32>)> = ma
                .keys()
                .chain(mb.keys())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .filter(|k| ma.get(k) != mb.get(k))
                .map(|k| (*k, ma.get(k).copied(), mb.get(k).copied()))
                .collect();
            want.sort();
            let got: Vec<(u32, Option<u32>, Option<u32>)> = a
                .changes(&b)
                .into_iter()
                .map(|(k, w, n)| (k, w.copied(), n.copied()))
                .collect();
            assert_eq!(got, want);
            assert_eq!(a == b, ma == mb);
        }
    }
}
