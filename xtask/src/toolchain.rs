//! The eBPF crate's pinned nightly, read from `ebpf/rust-toolchain.toml`
//! (agent/build.rs reads the same file).

/// The toolchain file, as built into xtask.
const TOOLCHAIN_FILE: &str = include_str!("../../ebpf/rust-toolchain.toml");

/// The pinned channel, e.g. `nightly-2026-05-20`.
pub fn ebpf_channel() -> &'static str {
    channel_of(TOOLCHAIN_FILE).expect("ebpf/rust-toolchain.toml has no `channel = \"...\"` line")
}

fn channel_of(toml: &str) -> Option<&str> {
    toml.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        (key.trim() == "channel").then(|| value.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pinned_channel_is_a_dated_nightly() {
        let channel = ebpf_channel();
        assert!(channel.starts_with("nightly-"), "{channel}");
        assert_eq!(
            channel_of("[toolchain]\nchannel = \"nightly-2020-01-02\"\n"),
            Some("nightly-2020-01-02")
        );
    }
}
