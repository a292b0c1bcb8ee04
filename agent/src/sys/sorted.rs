//! Walking two key-ordered sequences together: what only one side has,
//! and what both have. The difference of two sorted maps in one pass,
//! not a lookup per entry (the incremental stages compare maps of tens of
//! thousands of entries each round).

use std::cmp::Ordering;

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
