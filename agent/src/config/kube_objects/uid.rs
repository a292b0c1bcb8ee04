//! An object's `metadata.uid`, kept as the 16 bytes of the UUID the API
//! server writes: the agent keeps one for every VMI and IPAMClaim of the
//! cluster, and the ledger one per address, and as text each was an
//! allocation of 48 bytes (36 characters) beside the pointer.
//!
//! Any other text (an object written by hand, a test's) is kept as given.
//! Only the canonical form (lowercase, hyphenated, as the API server
//! writes it) is kept as bytes, so two uids are equal exactly when their
//! texts are.

use std::{fmt, ops::Deref};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Uid(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    Uuid(uuid::Uuid),
    Text(Box<str>),
}

// In the objects' metadata beside the names: three words, no allocation
// for an API server's uid.
const _: () = assert!(std::mem::size_of::<Option<Uid>>() == 24);

impl Uid {
    pub fn new(text: &str) -> Uid {
        match uuid::Uuid::try_parse(text) {
            Ok(u) if *UidText::of(&u) == *text => Uid(Repr::Uuid(u)),
            _ => Uid(Repr::Text(text.into())),
        }
    }

    /// The uid as its text (on the stack for a UUID).
    pub fn text(&self) -> UidText<'_> {
        match &self.0 {
            Repr::Uuid(u) => UidText::of(u),
            Repr::Text(t) => UidText::Text(t),
        }
    }

    /// Whether its text is `text`.
    pub fn is(&self, text: &str) -> bool {
        *self.text() == *text
    }
}

/// A uid's text: [`Uid::text`].
pub enum UidText<'a> {
    Uuid([u8; uuid::fmt::Hyphenated::LENGTH]),
    Text(&'a str),
}

impl UidText<'_> {
    fn of(u: &uuid::Uuid) -> UidText<'static> {
        let mut text = [0; uuid::fmt::Hyphenated::LENGTH];
        u.hyphenated().encode_lower(&mut text);
        UidText::Uuid(text)
    }
}

impl Deref for UidText<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        match self {
            UidText::Uuid(text) => std::str::from_utf8(text).expect("a UUID's text is ASCII"),
            UidText::Text(text) => text,
        }
    }
}

crate::sys::text::text_value!(Uid);

impl Default for Uid {
    fn default() -> Self {
        Uid(Repr::Text("".into()))
    }
}

impl fmt::Debug for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.text(), f)
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text())
    }
}

impl Serialize for Uid {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text())
    }
}

impl<'de> Deserialize<'de> for Uid {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::sys::text::deserialize(deserializer, Uid::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_reads_back_as_its_text_and_equals_only_the_same_text() {
        let api = "5d1c5a3e-8f0b-4c1e-9b7a-3f2e1d0c9b8a";
        for text in [
            api,
            // Not the API server's form: kept as text, and not equal to
            // the canonical one.
            "5D1C5A3E-8F0B-4C1E-9B7A-3F2E1D0C9B8A",
            "5d1c5a3e8f0b4c1e9b7a3f2e1d0c9b8a",
            "uid-7-vm1",
            "",
        ] {
            let uid = Uid::new(text);
            assert_eq!(&*uid.text(), text);
            assert_eq!(uid.to_string(), text);
            assert!(uid.is(text));
            assert_eq!(serde_json::to_string(&uid).unwrap(), format!("{text:?}"));
            let read: Uid = serde_json::from_str(&format!("{text:?}")).unwrap();
            assert_eq!(read, uid);
            assert_eq!(read == Uid::new(api), text == api, "{text}");
        }
        assert!(matches!(Uid::new(api).0, Repr::Uuid(_)), "kept as bytes");
    }
}
