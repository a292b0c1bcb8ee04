//! Maps keyed by an address, an IPv4 table beside an IPv6 one.
//!
//! The stages keep several maps with an entry per address of the cluster
//! (who holds it, which claims give it, what is taken). Keyed by
//! `IpAddr` (17 bytes, byte-aligned) an entry beside an 8-byte value
//! takes 32 bytes; keyed by `Ipv4Addr` 16. Most addresses are IPv4, and
//! a dual-stack VM's IPv6 address takes no more than before.

use std::{
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::sys::hash::HashMap;

/// A map keyed by (`P`, an address): `P` what the address is scoped by
/// (a network's index or name; `()` for none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpMap<P: Hash + Eq, V> {
    v4: HashMap<(P, Ipv4Addr), V>,
    v6: HashMap<(P, Ipv6Addr), V>,
}

impl<P: Hash + Eq, V> Default for IpMap<P, V> {
    fn default() -> Self {
        IpMap {
            v4: HashMap::default(),
            v6: HashMap::default(),
        }
    }
}

impl<P: Hash + Eq + Clone, V> IpMap<P, V> {
    pub fn get(&self, p: &P, ip: &IpAddr) -> Option<&V> {
        match ip {
            IpAddr::V4(a) => self.v4.get(&(p.clone(), *a)),
            IpAddr::V6(a) => self.v6.get(&(p.clone(), *a)),
        }
    }

    pub fn get_mut(&mut self, p: &P, ip: &IpAddr) -> Option<&mut V> {
        match ip {
            IpAddr::V4(a) => self.v4.get_mut(&(p.clone(), *a)),
            IpAddr::V6(a) => self.v6.get_mut(&(p.clone(), *a)),
        }
    }

    pub fn contains_key(&self, p: &P, ip: &IpAddr) -> bool {
        self.get(p, ip).is_some()
    }

    /// Sets the value at (`p`, `ip`); returns the one it replaced.
    pub fn insert(&mut self, p: P, ip: IpAddr, v: V) -> Option<V> {
        match ip {
            IpAddr::V4(a) => self.v4.insert((p, a), v),
            IpAddr::V6(a) => self.v6.insert((p, a), v),
        }
    }

    /// The value at (`p`, `ip`), made with `default` when there is none.
    pub fn get_or_insert_with(&mut self, p: P, ip: IpAddr, default: impl FnOnce() -> V) -> &mut V {
        match ip {
            IpAddr::V4(a) => self.v4.entry((p, a)).or_insert_with(default),
            IpAddr::V6(a) => self.v6.entry((p, a)).or_insert_with(default),
        }
    }

    pub fn remove(&mut self, p: &P, ip: &IpAddr) -> Option<V> {
        match ip {
            IpAddr::V4(a) => self.v4.remove(&(p.clone(), *a)),
            IpAddr::V6(a) => self.v6.remove(&(p.clone(), *a)),
        }
    }

    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }

    /// Every entry, IPv4 first, each family in no order.
    pub fn iter(&self) -> impl Iterator<Item = (&P, IpAddr, &V)> {
        self.v4
            .iter()
            .map(|((p, a), v)| (p, IpAddr::V4(*a), v))
            .chain(self.v6.iter().map(|((p, a), v)| (p, IpAddr::V6(*a), v)))
    }
}

/// A set of addresses (with nothing to scope them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpSet(IpMap<(), ()>);

impl IpSet {
    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.0.contains_key(&(), ip)
    }

    /// Whether it was not there.
    pub fn insert(&mut self, ip: IpAddr) -> bool {
        self.0.insert((), ip, ()).is_none()
    }

    /// Whether it was there.
    pub fn remove(&mut self, ip: &IpAddr) -> bool {
        self.0.remove(&(), ip).is_some()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.0.iter().map(|(_, ip, _)| ip)
    }
}

impl Extend<IpAddr> for IpSet {
    fn extend<I: IntoIterator<Item = IpAddr>>(&mut self, iter: I) {
        for ip in iter {
            self.insert(ip);
        }
    }
}

impl FromIterator<IpAddr> for IpSet {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(iter: I) -> Self {
        let mut out = IpSet::default();
        out.extend(iter);
        out
    }
}

// What the module is for: an IPv4 entry beside a word is half the size.
const _: () = assert!(std::mem::size_of::<((u32, Ipv4Addr), usize)>() == 16);
const _: () = assert!(std::mem::size_of::<((u32, IpAddr), usize)>() == 32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_found_under_its_scope_in_either_family() {
        let mut m: IpMap<u32, &str> = IpMap::default();
        let (v4, v6): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap());
        // The IPv4-mapped form of v4 is another address.
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(m.insert(1, v4, "a"), None);
        assert_eq!(m.insert(1, v6, "b"), None);
        assert_eq!(m.insert(2, v4, "c"), None);
        assert_eq!(m.insert(1, v4, "d"), Some("a"));
        assert_eq!(m.get(&1, &v4), Some(&"d"));
        assert_eq!(m.get(&1, &v6), Some(&"b"));
        assert_eq!(m.get(&2, &v6), None);
        assert_eq!(m.get(&1, &mapped), None);
        assert_eq!(m.len(), 3);
        let mut all: Vec<(u32, IpAddr, &str)> = m.iter().map(|(p, ip, v)| (*p, ip, *v)).collect();
        all.sort();
        assert_eq!(all, [(1, v4, "d"), (1, v6, "b"), (2, v4, "c")]);
        assert_eq!(m.remove(&1, &v4), Some("d"));
        assert!(!m.contains_key(&1, &v4) && m.contains_key(&2, &v4));
        *m.get_or_insert_with(3, v6, || "e") = "f";
        assert_eq!(m.get(&3, &v6), Some(&"f"));
        let set: IpSet = [v4, v6, v4].into_iter().collect();
        assert_eq!(set.len(), 2);
        assert!(set.contains(&v6) && !set.contains(&mapped));
    }
}
