//! Clocks: the kernel's monotonic clock the data path stamps with
//! (`bpf_ktime_get_ns`), and wall-clock seconds for what people read.

use std::time::SystemTime;

/// Nanoseconds on CLOCK_MONOTONIC, the clock `bpf_ktime_get_ns` reads.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Milliseconds since `ktime_ns`, a data-path timestamp.
pub fn since_ms(ktime_ns: u64) -> f64 {
    monotonic_ns().saturating_sub(ktime_ns) as f64 / 1e6
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_counts_forward_and_never_below_zero() {
        let then = monotonic_ns();
        assert!(monotonic_ns() >= then);
        assert!(since_ms(0) > 0.0);
        // A stamp from the future (another clock) reads as just now.
        assert_eq!(since_ms(u64::MAX), 0.0);
    }
}
