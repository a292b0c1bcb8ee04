//! A shared, immutable slice behind one word: triomphe's `ThinArc`, the
//! length in the shared copy, none allocated when empty. For what every VM
//! interface of the cluster holds a list of, mostly empty or short (an
//! Attachment's named ports, a derived document's sources, an object's
//! groups): a `Box<[T]>` or an `Arc<[T]>` is two words in each holder.

use std::ops::Deref;

pub struct ThinSlice<T>(Option<triomphe::ThinArc<(), T>>);

const _: () = assert!(std::mem::size_of::<ThinSlice<u64>>() == 8);

impl<T> Clone for ThinSlice<T> {
    fn clone(&self) -> Self {
        ThinSlice(self.0.clone())
    }
}

impl<T> Default for ThinSlice<T> {
    fn default() -> Self {
        ThinSlice(None)
    }
}

impl<T> From<Vec<T>> for ThinSlice<T> {
    fn from(items: Vec<T>) -> Self {
        ThinSlice(
            (!items.is_empty())
                .then(|| triomphe::ThinArc::from_header_and_iter((), items.into_iter())),
        )
    }
}

impl<T> Deref for ThinSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.0.as_ref().map_or(&[], |items| &items.slice)
    }
}

impl<T: PartialEq> PartialEq for ThinSlice<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Eq> Eq for ThinSlice<T> {}

impl<T: std::fmt::Debug> std::fmt::Debug for ThinSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: serde::Serialize> serde::Serialize for ThinSlice<T> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        (**self).serialize(serializer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thin_slice_holds_what_it_was_given() {
        let empty: ThinSlice<u32> = Vec::new().into();
        assert!(empty.is_empty() && empty == ThinSlice::default());
        let three: ThinSlice<u32> = vec![1, 2, 3].into();
        assert_eq!(&*three, &[1, 2, 3]);
        assert_eq!(three.clone(), three);
        assert_ne!(three, empty);
        assert_eq!(serde_json::to_string(&three).unwrap(), "[1,2,3]");
    }
}
