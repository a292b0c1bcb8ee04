//! Shared names: one copy of each namespace, node, network, interface
//! name and label an agent reads, however many objects and stages hold it.
//!
//! Every VM of the cluster is kept by several stages (its watch copy, its
//! Attachment, its labels for policy), and most of what each holds is a
//! name many VMs share (`prod`, `blue`, `kubevirt.io/vm`) or one the
//! stages share (a VM's labels, in its VMI and in its Attachment). As a
//! `String` each copy was an allocation of its own; a [`Name`] is a
//! pointer to the one copy.
//!
//! The table keeps a name while anything else does: it forgets those only
//! it holds whenever it has doubled since it last looked, so names that
//! come and go (a tenant's namespaces, VMs' labels) cost nothing once gone,
//! and the look is amortized over the names added.

use std::{
    borrow::Borrow,
    fmt,
    hash::{Hash, Hasher},
    ops::Deref,
    sync::Mutex,
};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An immutable string shared through the table: compares, hashes and
/// orders as the `str` it holds.
///
/// One word: the text's length lives beside it in the shared copy, not in
/// every pointer to it (`Arc<str>` was two words, and names are the keys
/// and fields of every per-VM structure the agent keeps: a VM interface's
/// key, its labels, the grouping's and the stores' keys).
#[derive(Clone)]
pub struct Name(triomphe::ThinArc<(), u8>);

const _: () = assert!(std::mem::size_of::<Name>() == 8);

struct Table {
    names: crate::sys::hash::HashSet<Name>,
    /// How many names it held after its last sweep.
    swept_at: usize,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// The table sweeps past this many names at least (a sweep of a small
/// table would run every few names).
const SWEEP_FLOOR: usize = 1024;

impl Name {
    /// The shared copy of `text`.
    pub fn new(text: &str) -> Name {
        let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        let table = table.get_or_insert_with(|| Table {
            names: Default::default(),
            swept_at: 0,
        });
        if let Some(name) = table.names.get(text) {
            return name.clone();
        }
        if table.names.len() >= (2 * table.swept_at).max(SWEEP_FLOOR) {
            // Names no one else holds go.
            table
                .names
                .retain(|n| triomphe::ThinArc::strong_count(&n.0) > 1);
            table.swept_at = table.names.len();
        }
        let name = Name(triomphe::ThinArc::from_header_and_slice(
            (),
            text.as_bytes(),
        ));
        table.names.insert(name.clone());
        name
    }

    pub fn as_str(&self) -> &str {
        // SAFETY: a name's bytes are only ever made from a `&str` (`new`).
        unsafe { std::str::from_utf8_unchecked(&self.0.slice) }
    }

    /// Whether two names are the one copy (equal names always are).
    fn same_copy(&self, other: &Name) -> bool {
        self.0.ptr() == other.0.ptr()
    }
}

/// How many names the table holds (tests).
#[cfg(test)]
fn table_len() -> usize {
    TABLE.lock().unwrap().as_ref().map_or(0, |t| t.names.len())
}

impl Default for Name {
    fn default() -> Self {
        Name::new("")
    }
}

impl Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        // One copy per name: equal names are the same pointer, but a
        // name the table forgot and made again is another.
        self.same_copy(other) || self.as_str() == other.as_str()
    }
}

impl Eq for Name {}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<Name> for str {
    fn eq(&self, other: &Name) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Name> for &str {
    fn eq(&self, other: &Name) -> bool {
        *self == other.as_str()
    }
}

impl PartialEq<Name> for String {
    fn eq(&self, other: &Name) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for Name {
    /// As the `str` (so a map keyed by names is looked up by `&str`).
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        Name::new(text)
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        Name::new(&text)
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Name::new(text)
    }
}

impl From<Name> for String {
    fn from(name: Name) -> Self {
        name.as_str().to_string()
    }
}

impl Serialize for Name {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::sys::text::deserialize(deserializer, Name::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_names_are_one_copy_and_compare_as_their_text() {
        let a = Name::new("intern-test-blue");
        let b: Name = serde_json::from_str("\"intern-test-blue\"").unwrap();
        assert!(a.same_copy(&b));
        assert_eq!(a, "intern-test-blue");
        assert!(Name::new("intern-test-a") < Name::new("intern-test-b"));
        let mut set = std::collections::HashSet::new();
        set.insert(a.clone());
        assert!(set.contains("intern-test-blue"), "looked up by &str");
        assert_eq!(serde_json::to_string(&a).unwrap(), "\"intern-test-blue\"");
    }

    #[test]
    fn names_no_one_holds_are_forgotten_as_the_table_grows() {
        // Names made and dropped, many times the floor: the table stays
        // within a bound of what is held, not what was ever made.
        let held = Name::new("intern-test-held");
        for i in 0..20 * SWEEP_FLOOR {
            drop(Name::new(&format!("intern-test-gone-{i}")));
        }
        assert!(
            table_len() < 4 * SWEEP_FLOOR,
            "the table holds {} names",
            table_len()
        );
        assert!(
            held.same_copy(&Name::new("intern-test-held")),
            "a held name stays"
        );
    }
}
