//! FNV-1a: a small stable hash. Used where every node and every restart must
//! compute the same value from the same input (config fingerprints, IPAM
//! probe seeds, generated MACs), which std's hashers do not promise.

pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for part in parts {
        for b in *part {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
        // Separate parts so ("ab","c") and ("a","bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The control plane's hash maps and sets. Their keys are names and
/// addresses tenants choose, so the hasher is seeded at random per map as
/// std's is (no one can precompute collisions), but it is aHash, not
/// SipHash: SipHash on short names was a sixth of a round's time at
/// 10,000 VMs (BENCHMARKS.md section 14). Built with `default()` or
/// `collect()`, not `new()`.
pub type HashMap<K, V> = std::collections::HashMap<K, V, ahash::RandomState>;
/// See [`HashMap`].
pub type HashSet<K> = std::collections::HashSet<K, ahash::RandomState>;
