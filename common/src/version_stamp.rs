//! The version suffix a special build reports (`-rc1`, the upgrade test's
//! `-next`): written into the built binaries' bytes, not compiled in.
//!
//! Each binary that reports its version (`vmpath`, `vmpath-cni`) carries
//! one [`SLOT`]: [`MARKER`] then [`SUFFIX_MAX`] + 1 zero bytes. `cargo
//! xtask image --version-suffix` copies the built binaries and writes the
//! suffix after the marker ([`stamp`]); the binary reads it back at run
//! time ([`suffix`]). A compile-time suffix made every suffixed image a
//! second build of both binaries: on two cores the image tests' successor
//! image was minutes of a cold CI run.

/// What [`stamp`] looks for: it must occur exactly once in a binary.
pub const MARKER: &[u8; 28] = b"vmpath:version-suffix-slot=\0";
/// The longest suffix a slot holds (the image tag's limit too).
pub const SUFFIX_MAX: usize = 40;
/// The slot's length: the marker, the suffix, and the NUL that ends it.
pub const SLOT_LEN: usize = MARKER.len() + SUFFIX_MAX + 1;

/// The slot as built: the marker then zeros (no suffix).
pub static SLOT: [u8; SLOT_LEN] = empty_slot();

const fn empty_slot() -> [u8; SLOT_LEN] {
    let mut slot = [0u8; SLOT_LEN];
    let mut i = 0;
    while i < MARKER.len() {
        slot[i] = MARKER[i];
        i += 1;
    }
    slot
}

/// The suffix this binary was stamped with (empty when none), as bytes
/// and their length. Read with volatile loads: the compiler sees a
/// constant static and would otherwise fold the zeros it was built with.
pub fn suffix() -> ([u8; SUFFIX_MAX], usize) {
    let mut out = [0u8; SUFFIX_MAX];
    let base = SLOT.as_ptr();
    let mut len = 0;
    while len < SUFFIX_MAX {
        // SAFETY: `MARKER.len() + len < SLOT_LEN`: inside the static.
        let b = unsafe { core::ptr::read_volatile(base.add(MARKER.len() + len)) };
        if b == 0 {
            break;
        }
        out[len] = b;
        len += 1;
    }
    (out, len)
}

/// Why a binary could not be stamped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StampError {
    /// The suffix is longer than [`SUFFIX_MAX`] or holds a NUL.
    BadSuffix,
    /// The binary has no slot, or more than one (how many).
    Slots(usize),
    /// The slot already holds a suffix.
    Stamped,
}

/// Writes `suffix` into the one slot of `binary` (a built executable's
/// bytes).
pub fn stamp(binary: &mut [u8], suffix: &[u8]) -> Result<(), StampError> {
    if suffix.len() > SUFFIX_MAX || suffix.contains(&0) {
        return Err(StampError::BadSuffix);
    }
    let mut found = None;
    let mut count = 0;
    let mut at = 0;
    while let Some(i) = binary[at..].windows(MARKER.len()).position(|w| w == MARKER) {
        count += 1;
        found = Some(at + i);
        at += i + 1;
    }
    let (1, Some(start)) = (count, found) else {
        return Err(StampError::Slots(count));
    };
    let value = start + MARKER.len();
    let slot = binary
        .get_mut(value..value + SUFFIX_MAX + 1)
        .ok_or(StampError::Slots(0))?;
    if slot.iter().any(|&b| b != 0) {
        return Err(StampError::Stamped);
    }
    slot[..suffix.len()].copy_from_slice(suffix);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binary_with_slot() -> [u8; 200] {
        let mut b = [7u8; 200];
        b[50..50 + SLOT_LEN].copy_from_slice(&SLOT);
        b
    }

    #[test]
    fn the_slot_takes_one_suffix_once() {
        let mut b = binary_with_slot();
        assert_eq!(stamp(&mut b, b"-next"), Ok(()));
        let value = 50 + MARKER.len();
        assert_eq!(&b[value..value + 6], b"-next\0");
        assert_eq!(stamp(&mut b, b"-again"), Err(StampError::Stamped));
        // Nothing outside the slot moved.
        assert!(b[..50].iter().chain(&b[50 + SLOT_LEN..]).all(|&x| x == 7));
    }

    #[test]
    fn a_binary_without_exactly_one_slot_or_a_bad_suffix_is_refused() {
        assert_eq!(stamp(&mut [0u8; 100], b"-x"), Err(StampError::Slots(0)));
        let mut two = [0u8; 2 * SLOT_LEN];
        two[..SLOT_LEN].copy_from_slice(&SLOT);
        two[SLOT_LEN..].copy_from_slice(&SLOT);
        assert_eq!(stamp(&mut two, b"-x"), Err(StampError::Slots(2)));
        let long = [b'a'; SUFFIX_MAX + 1];
        assert_eq!(
            stamp(&mut binary_with_slot(), &long),
            Err(StampError::BadSuffix)
        );
        assert_eq!(
            stamp(&mut binary_with_slot(), b"a\0b"),
            Err(StampError::BadSuffix)
        );
    }

    #[test]
    fn an_unstamped_binary_reports_no_suffix() {
        assert_eq!(suffix().1, 0);
    }
}
