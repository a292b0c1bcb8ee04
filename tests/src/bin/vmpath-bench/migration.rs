//! Figure group 5: the live-migration loss window, the scenario of the
//! migration test (`tests/tests/migration.rs`, bed and cut-over in
//! `vmpath_tests::migration`) with the release agent: three nodes on a veth
//! underlay with the VXLAN overlay, a client VM on node c streaming UDP
//! with sequence numbers 1 ms apart to vm1's IPv4 and IPv6 addresses while
//! vm1 moves from node a to node b. Each run builds a fresh bed. Baseline:
//! the send interval.
//!
//! Beside it, the same cut-over seen from outside (`vmpath_tests::
//! north_south`, the scenario of `tests/tests/north_south_imported.rs`):
//! an external host behind a BIRD top-of-rack router streams to the VM's
//! own address while it moves; the fabric keeps sending to the old node
//! until BGP moves the per-VM route, and the old node relays meanwhile.

use anyhow::{Result, bail};
use vmpath_tests::{
    migration::{
        Announce, Bed, INTERVAL_MS, LossWindow, STREAM_COUNT, loss_window, start_migration,
        three_nodes,
    },
    north_south::{self, ExternalWindow},
};

use crate::{
    report::{Bar, Section},
    util::{fmt_summary, summary},
};

pub struct Options {
    pub runs: usize,
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut runs: Vec<LossWindow> = Vec::new();
    for r in 0..opts.runs {
        runs.push(measure(&format!("run {r}"), three_nodes())?);
    }
    let interval = INTERVAL_MS as f64;
    let col = |f: fn(&LossWindow) -> f64| -> Vec<f64> { runs.iter().map(f).collect() };
    let window = summary(&col(|w| w.ipv4.switch_ms));
    let window6 = summary(&col(|w| w.ipv6.switch_ms));
    let lost = summary(&col(|w| w.ipv4.lost as f64));
    let lost6 = summary(&col(|w| w.ipv6.lost as f64));
    let ready = summary(&col(|w| w.ipv4.ready_gap_ms.max(w.ipv6.ready_gap_ms)));
    let silence = summary(&col(|w| w.ipv4.gap_ms));
    let silence6 = summary(&col(|w| w.ipv6.gap_ms));
    let cmds = summary(&col(|w| w.commands_ms));
    let first = summary(&col(|w| w.ipv4.first_on_target_ms));

    let mut md = format!(
        "The migration test's scenario (`tests/tests/migration.rs`; bed and cut-over \
         shared in `vmpath_tests::migration`) with the release agent, {} run(s), a \
         fresh bed each: three node namespaces on a veth underlay (a bridge), the VXLAN \
         overlay, a client VM on node c sending UDP with sequence numbers {INTERVAL_MS} \
         ms apart ({STREAM_COUNT} datagrams in each family) to vm1's IPv4 and IPv6 \
         addresses at once (a dual-stack network, /32 and /128 per VM) while it moves \
         from node a to node b. \
         The migration is pending in every node's config (`ready: false`) before the \
         stream starts; 1.5 s into the stream the source VM's link goes down, the \
         target's comes up and it announces itself (GARP and RARP, as QEMU does); the \
         config says `ready: true` 1 s later. **Loss window** = the last datagram \
         received on the source to the first received on the target (receive \
         timestamps, CLOCK_MONOTONIC); datagrams lost = sequence numbers no receiver \
         got; each family is measured on its own stream. The window includes the cut-over's own `ip` commands (source down → \
         target up, about 3 ms of process starts, shown separately). The migration \
         test asserts on the longest run of lost datagrams from 200 ms before the \
         cut-over to the ready signal, shown too, on the sender's clock (the first \
         lost one's send time to the last's, plus an interval): a receiver or the \
         sender kept from the CPU cannot stretch it. Baseline: the \
         sender's interval ({INTERVAL_MS} ms).\n\n\
         | run | loss window ms | IPv6 loss window ms | datagrams lost of {STREAM_COUNT} \
         | IPv6 datagrams lost | ÷ send interval | longest gap after `ready: true` ms \
         (either family) | longest loss run around the cut-over ms | IPv6 longest loss \
         run ms | cut-over `ip` commands ms | first datagram on the target after its link \
         came up ms |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        opts.runs
    );
    for (i, w) in runs.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {:.1} | {:.1} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            i + 1,
            w.ipv4.switch_ms,
            w.ipv6.switch_ms,
            w.ipv4.lost,
            w.ipv6.lost,
            w.ipv4.switch_ms / interval,
            w.ipv4.ready_gap_ms.max(w.ipv6.ready_gap_ms),
            w.ipv4.gap_ms,
            w.ipv6.gap_ms,
            w.commands_ms,
            w.ipv4.first_on_target_ms
        ));
    }
    md.push_str(&format!(
        "| median (min–max) | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
        fmt_summary(&window),
        fmt_summary(&window6),
        lost.median,
        lost6.median,
        window.median / interval,
        ready.median,
        silence.median,
        silence6.median,
        cmds.median,
        first.median
    ));
    let external = external_runs(opts.runs)?;
    let ext_window = summary(&external.iter().map(|w| w.gap_ms).collect::<Vec<_>>());
    md.push_str(&format!(
        "\n**From outside (north-south).** The imported-VM test's scenario \
         (`tests/tests/north_south_imported.rs`; bed and cut-over in \
         `vmpath_tests::north_south`), {} run(s): two nodes and a BIRD top-of-rack \
         router on one segment, an external host behind the ToR sending UDP 1 ms apart \
         ({} datagrams) to the VM's own address on an IPAM-less `egress: SNAT` network \
         with `advertise: {{subnet: true, learned: true}}`, while the VM moves from node \
         a to node b (the same cut-over as above, once the stream reaches the VM on \
         node a). The ToR routes by the per-VM /32 over \
         BGP, so it keeps sending to node a until a withdraws and b announces it; node \
         a relays meanwhile. **Loss window** = the longest run of lost datagrams sent \
         from 200 ms before the cut-over until the ToR's kernel route moved, on the \
         sender's clock (the first lost one's send time to the last's, plus 1 ms).\n\n\
         | run | loss window ms | datagrams lost | received on the target | of which \
         before the ToR's route moved | ToR route moved after the cut-over, ms | frames \
         relayed by the source |\n|---|---|---|---|---|---|---|\n",
        external.len(),
        north_south::STREAM_COUNT
    ));
    for (i, w) in external.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {:.1} | {} | {} | {} | {:.0} | {} |\n",
            i + 1,
            w.gap_ms,
            w.lost,
            w.on_target,
            w.on_target_before_converged,
            w.converged_ms,
            w.relayed
        ));
    }
    md.push_str(&format!(
        "| median (min–max) | {} | | | | | |\n\n\
         East-west (above) {:.1} ms (IPv6 {:.1} ms), north-south {:.1} ms (medians).\n",
        fmt_summary(&ext_window),
        window.median,
        window6.median,
        ext_window.median
    ));
    Ok(Section {
        title: "5. Live migration loss window".into(),
        markdown: md,
        bars: vec![
            Bar {
                label: "live migration loss window (lower is better)".into(),
                ratio: window.median / interval,
                baseline: format!("send interval {INTERVAL_MS} ms"),
            },
            Bar {
                label: "live migration loss window, IPv6 (lower is better)".into(),
                ratio: window6.median / interval,
                baseline: format!("send interval {INTERVAL_MS} ms"),
            },
            Bar {
                label: "live migration loss window from outside, BGP ToR (lower is better)".into(),
                ratio: ext_window.median / interval,
                baseline: format!("send interval {INTERVAL_MS} ms"),
            },
        ],
    })
}

/// One cut-over on `bed` (made by `three_nodes` or a variant of it), its
/// figures logged under `label`; an error when the stream did not move.
pub fn measure(label: &str, bed: Bed) -> Result<LossWindow> {
    start_migration(&bed);
    let w = loss_window(&bed, Announce::GarpAndRarp);
    for (family, s) in [("IPv4", &w.ipv4), ("IPv6", &w.ipv6)] {
        eprintln!(
            "bench:   {label} {family}: last on the source -> first on the target {:.1} ms \
             (seq {} -> {}), {} lost, {} on the target; longest loss run {:.1} ms (seq {} -> \
             {} lost); first on the target {:.1} ms after its link came up; longest gap after \
             ready {:.1} ms",
            s.switch_ms,
            s.switch_seqs.0,
            s.switch_seqs.1,
            s.lost,
            s.on_target,
            s.gap_ms,
            s.gap_seqs.0,
            s.gap_seqs.1,
            s.first_on_target_ms,
            s.ready_gap_ms
        );
        // The stream has to have moved, or the window means nothing.
        if s.on_target < 1000 || !s.switch_ms.is_finite() {
            bail!(
                "{label}: the target received only {} {family} datagrams",
                s.on_target
            );
        }
    }
    eprintln!(
        "bench:   {label}: cut-over commands {:.1} ms",
        w.commands_ms
    );
    drop(bed);
    Ok(w)
}

/// The north-south cut-over, `runs` times on a fresh bed each.
fn external_runs(runs: usize) -> Result<Vec<ExternalWindow>> {
    let mut out = Vec::new();
    for r in 0..runs {
        let bed = north_south::bed(2);
        north_south::start_migration(&bed);
        let w = north_south::external_loss_window(&bed);
        eprintln!(
            "bench:   external run {r}: longest loss run {:.1} ms, {} lost, {} on the target \
             ({} before the ToR's route moved {:.0} ms after the cut-over), {} relayed",
            w.gap_ms, w.lost, w.on_target, w.on_target_before_converged, w.converged_ms, w.relayed
        );
        if w.on_target < 1000 {
            bail!(
                "external run {r}: the target received only {} datagrams",
                w.on_target
            );
        }
        out.push(w);
        drop(bed);
    }
    Ok(out)
}
