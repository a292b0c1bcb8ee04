//! Walking two key-ordered sequences together: what only one side has,
//! and what both have. The difference of two sorted maps in one pass,
//! not a lookup per entry (the incremental stages compare maps of tens of
//! thousands of entries each round).

use std::{cmp::Ordering, collections::BTreeMap};

/// `map` with its nodes full. A B-tree grown by inserts in key order (a
/// watch's list from the API server, a parsed JSON object, a first
/// round's claims) splits each full node in two and leaves it a little
/// over half full, for as long as the map is kept; built in one sorted
/// run, every node but the last ones is full (a map of claims or objects
/// of every VM of the cluster takes about half the room it did). The
/// entries are moved, not copied.
pub fn packed<K: Ord, V>(map: BTreeMap<K, V>) -> BTreeMap<K, V> {
    // `FromIterator` sorts (one run: linear) and builds in bulk.
    map.into_iter().collect()
}

/// One side of a merge, or both.
pub enum Side<A, B> {
    Old(A),
    New(B),
    Both(A, B),
}

/// Walks `old` and `new`, each ordered by its key (`old_key`, `new_key`),
/// calling `each` once per key in order.
pub fn merge<A, B, K: Ord + ?Sized>(
    old: impl Iterator<Item = A>,
    new: impl Iterator<Item = B>,
    old_key: impl Fn(&A) -> &K,
    new_key: impl Fn(&B) -> &K,
    mut each: impl FnMut(Side<A, B>),
) {
    let (mut old, mut new) = (old.peekable(), new.peekable());
    loop {
        let order = match (old.peek(), new.peek()) {
            (None, None) => return,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(a), Some(b)) => old_key(a).cmp(new_key(b)),
        };
        match order {
            Ordering::Less => each(Side::Old(old.next().unwrap())),
            Ordering::Greater => each(Side::New(new.next().unwrap())),
            Ordering::Equal => {
                let a = old.next().unwrap();
                each(Side::Both(a, new.next().unwrap()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_map_holds_what_it_held() {
        let grown: BTreeMap<u32, String> = (0..5000).map(|k| (k, k.to_string())).collect();
        let mut one_by_one = BTreeMap::new();
        for (k, v) in &grown {
            one_by_one.insert(*k, v.clone());
        }
        let packed = packed(one_by_one);
        assert!(packed.iter().eq(grown.iter()));
        assert!(super::packed(BTreeMap::<u32, u32>::new()).is_empty());
    }

    #[test]
    fn every_key_once_in_order_with_its_sides() {
        let mut seen = Vec::new();
        merge(
            [1, 3, 5, 7].into_iter(),
            [2, 3, 7, 8].into_iter(),
            |k| k,
            |k| k,
            |side| {
                seen.push(match side {
                    Side::Old(k) => (k, "old"),
                    Side::New(k) => (k, "new"),
                    Side::Both(k, _) => (k, "both"),
                })
            },
        );
        assert_eq!(
            seen,
            [
                (1, "old"),
                (2, "new"),
                (3, "both"),
                (5, "old"),
                (7, "both"),
                (8, "new")
            ]
        );
    }
}
