//! Values read and written as a string (a shared name, a uid, a claim's
//! `namespace/name`): one home for how serde reads one and how one
//! compares with text.

use serde::Deserializer;

/// Reads a string into a value with `make`.
pub fn deserialize<'de, D: Deserializer<'de>, T>(
    deserializer: D,
    make: fn(&str) -> T,
) -> Result<T, D::Error> {
    struct Visitor<T>(fn(&str) -> T);
    impl<T> serde::de::Visitor<'_> for Visitor<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<T, E> {
            Ok((self.0)(text))
        }
    }
    deserializer.deserialize_str(Visitor(make))
}

/// For `$t`, made from text by `$t::new(&str)` and equal to a text when
/// `$t::is(&str)` says so: `From<&str>`, `From<String>` and `PartialEq`
/// with `str`, `&str` and `String`.
macro_rules! text_value {
    ($t:ty) => {
        impl From<&str> for $t {
            fn from(text: &str) -> Self {
                <$t>::new(text)
            }
        }

        impl From<String> for $t {
            fn from(text: String) -> Self {
                <$t>::new(&text)
            }
        }

        impl PartialEq<str> for $t {
            fn eq(&self, other: &str) -> bool {
                self.is(other)
            }
        }

        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.is(other)
            }
        }

        impl PartialEq<String> for $t {
            fn eq(&self, other: &String) -> bool {
                self.is(other)
            }
        }
    };
}
pub(crate) use text_value;
