//! What the BPF_PROG_TEST_RUN fixture tables share: a private network
//! namespace per table, a private bpffs directory for the data path's pins,
//! interface lookups.

use std::{
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use vmpath::apply::dataplane;

/// tc verdicts a program returns.
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;
/// `struct __sk_buff` as BPF_PROG_TEST_RUN takes it: its size and the
/// offsets of the fields the tables set or read.
pub const SKB_CTX_LEN: usize = 192;
pub const SKB_INGRESS_IFINDEX: usize = 36;
pub const SKB_IFINDEX: usize = 40;
pub const SKB_CB: usize = 48;

/// Runs `f` on a new thread inside a new network namespace (unshare only
/// affects the calling thread; `ip` children inherit it). The namespace and
/// its veths go away with the thread.
pub fn in_fresh_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare on this new thread only; no pointers involved.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET): {} (tests must run as root)",
                std::io::Error::last_os_error()
            );
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// The ifindex of `name` in the calling thread's namespace.
pub fn ifindex_of(name: &str) -> u32 {
    vmpath::sys::netif::ifindex_of(name).unwrap_or_else(|| panic!("no interface {name}"))
}

/// A private directory on the shared bpffs (`/sys/fs/bpf/vmpath-<what>-<pid>-<n>`);
/// the data path's pins in it are removed on drop.
pub struct BpffsRoot(pub PathBuf);

impl BpffsRoot {
    pub fn new(what: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        BpffsRoot(PathBuf::from(format!(
            "/sys/fs/bpf/vmpath-{what}-{}-{n}",
            std::process::id()
        )))
    }
}

impl Drop for BpffsRoot {
    fn drop(&mut self) {
        let _ = dataplane::cleanup(&self.0);
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `clock` now in nanoseconds: CLOCK_MONOTONIC is `bpf_ktime_get_ns`'s,
/// CLOCK_MONOTONIC_COARSE `bpf_ktime_get_coarse_ns`'s (the flow clock).
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An `__sk_buff` for BPF_PROG_TEST_RUN: a frame that arrived on `ifindex`.
pub fn skb_ctx(ifindex: u32) -> [u8; SKB_CTX_LEN] {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// BPF_PROG_TEST_RUN of the data path's classifier `prog` on `frame`
/// with the `__sk_buff` `ctx`: its verdict and the frame as it left.
pub fn run_classifier(
    dp: &dataplane::Dataplane,
    prog: &str,
    ctx: &[u8; SKB_CTX_LEN],
    frame: &[u8],
) -> (u32, Vec<u8>) {
    use aya::programs::{TestRun as _, TestRunOptions};
    let mut out = vec![0u8; 8192];
    let r = dp
        .classifier(prog)
        .unwrap()
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(ctx),
            ..Default::default()
        })
        .expect("test_run");
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}
