//! Interface lookups in this network namespace: names to indexes, MTUs,
//! flags and addresses. The lowest layer of the agent: it knows no config
//! and no maps, so any module may ask it.

use std::ffi::CString;

/// The ifindex of `name`, or `None` if no such interface exists here.
pub fn ifindex_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => None,
        i => Some(i),
    }
}
