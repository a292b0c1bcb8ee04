//! Figure group 6: real live migration. A QEMU guest (TCG unless KVM works)
//! in a virt-launcher pod moves between nodes a and b over the overlay,
//! back and forth on one bed, by QEMU's own migration (`-incoming`, QMP
//! `migrate`, QEMU's RARP self-announce) as KubeVirt drives it (VMIM,
//! target pod by vmpath-cni, `migrationState`), while a peer on node c
//! pings it every millisecond in each family and holds a TCP echo
//! connection to it in each. Scenario in
//! `vmpath_tests::qemu::migration` (the test `tests/tests/real_migration.rs`).
//! Baseline: the guest's own pause (STOP on the source to RESUME on the
//! target); QEMU's reported downtime is shown beside it.

use anyhow::{Result, bail};
use vmpath_tests::qemu::migration::{RealBed, RealMigration, migrate};

use crate::{
    report::{Bar, Section},
    util::{fmt_summary, summary},
};

pub struct Options {
    pub runs: usize,
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut bed = RealBed::boot();
    let accel = bed.vm1.accel;
    let mut runs: Vec<RealMigration> = Vec::new();
    for r in 0..opts.runs {
        let m = migrate(&mut bed);
        eprintln!(
            "bench:   run {r} ({} -> {}): gap {:.1} ms, QEMU downtime {:.1} ms, paused {:.1} ms, \
             RESUME -> RARP {:.1} ms, RARP -> first ping on the target {:.1} ms, ping -> reply \
             {:.1} ms, {}/{} answered, TCP {:?} ({} echoes, {} after)",
            m.from,
            m.to,
            m.gap_ms,
            m.downtime_ms,
            m.pause_ms,
            m.resume_to_rarp_ms,
            m.rarp_to_request_ms,
            m.request_to_reply_ms,
            m.answered,
            m.sent,
            m.tcp_error,
            m.echoes,
            m.echoes_after
        );
        if m.echoes_after == 0
            || m.tcp_error.is_some()
            || m.tcp6.echoes_after == 0
            || m.tcp6.error.is_some()
        {
            bail!("run {r}: a TCP connection did not survive: {m:?}");
        }
        runs.push(m);
    }
    let col = |f: fn(&RealMigration) -> f64| -> Vec<f64> { runs.iter().map(f).collect() };
    let gap = summary(&col(|m| m.gap_ms));
    let gap6 = summary(&col(|m| m.ipv6.gap_ms));
    let downtime = summary(&col(|m| m.downtime_ms));
    let pause = summary(&col(|m| m.pause_ms));
    let added = summary(&col(|m| m.added_ms()));
    let added_pause = summary(&col(|m| m.added_to_pause_ms()));
    let rarp = summary(&col(|m| m.resume_to_rarp_ms));
    let cut = summary(&col(|m| m.rarp_to_request_ms));
    let reply = summary(&col(|m| m.request_to_reply_ms));

    let mode = if runs.iter().all(|m| m.stop_and_copy) {
        "stop-and-copy: the source paused before the copy, because QEMU 7.2's TCG precopy \
         corrupts a running guest's memory now and then (see docs/real-guests.md)"
    } else {
        "live precopy"
    };
    let mut md = format!(
        "A real guest (Debian cloud kernel, busybox initramfs, virtio-net, 128 MB, QEMU \
         {accel:?}) in KubeVirt's bridge-binding pod layout (pod NIC, bridge, tap) \
         migrates {} time(s) between nodes a and b (back and forth, one bed) over the VXLAN \
         overlay, as KubeVirt drives it (agents on `--source kubernetes`; a VMIM and a target \
         pod made by vmpath-cni each time, then `migrationState`): target QEMU `-incoming`, \
         QMP `migrate` on the source ({mode}), the target's `announce-*` parameters set \
         (50/550/5/100 ms), QEMU's RARP the only announcement. A peer on node c pings the \
         guest every 1 ms in each family, IPv4 and IPv6 (busybox has no UDP server; the guest \
         kernel answers) and holds one TCP echo connection to it in each (every run: alive, \
         no reconnect, echoes after the migration). **Gap** = the longest silence in the ping \
         replies at the peer; **QEMU downtime** = `query-migrate`'s `downtime`; **paused** \
         = the source's STOP to the target's RESUME (QMP event times). On the target pod's \
         NIC (tcpdump): RESUME to QEMU's first RARP, that RARP to the first ping arriving \
         (the data path's cut-over as the stream sees it), that ping to the guest's reply (a \
         TCG guest just resumed).\n\n\
         | run | move | gap ms | IPv6 gap ms | QEMU downtime ms | gap − downtime ms | paused ms | gap − \
         paused ms | RESUME → RARP ms | RARP → first ping on target ms | ping → reply ms | \
         pings answered | IPv6 pings answered |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        opts.runs
    );
    for (i, m) in runs.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} → {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {}/{} | {}/{} |\n",
            i + 1,
            m.from,
            m.to,
            m.gap_ms,
            m.ipv6.gap_ms,
            m.downtime_ms,
            m.added_ms(),
            m.pause_ms,
            m.added_to_pause_ms(),
            m.resume_to_rarp_ms,
            m.rarp_to_request_ms,
            m.request_to_reply_ms,
            m.answered,
            m.sent,
            m.ipv6.answered,
            m.ipv6.sent
        ));
    }
    md.push_str(&format!(
        "| median (min–max) | | {} | {} | {} | {} | {} | {} | {} | {} | {} | | |\n",
        fmt_summary(&gap),
        fmt_summary(&gap6),
        fmt_summary(&downtime),
        fmt_summary(&added),
        fmt_summary(&pause),
        fmt_summary(&added_pause),
        fmt_summary(&rarp),
        fmt_summary(&cut),
        fmt_summary(&reply),
    ));
    Ok(Section {
        title: "6. Real live migration (QEMU)".into(),
        markdown: md,
        bars: vec![Bar {
            label: "real migration: ping gap ÷ guest pause (lower is better)".into(),
            ratio: gap.median / pause.median,
            baseline: "the guest's pause, STOP to RESUME".into(),
        }],
    })
}
