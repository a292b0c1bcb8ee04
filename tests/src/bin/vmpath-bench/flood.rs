//! Figure group 6: one VM cannot starve the slow path. A "loud" VM floods
//! DHCP DISCOVERs from its own MAC at line rate (raw AF_PACKET socket,
//! sendmmsg, no qdisc) while a "quiet" VM on the same node runs DHCP
//! exchanges (DISCOVER -> OFFER -> REQUEST -> ACK, paced as a real client
//! would, well within its port's limit); the same exchanges with no flood
//! are the baseline. Defaults throughout: the network's slow-path limits
//! and the agent's serving budget as shipped. The agent's CPU comes from
//! /proc/<pid>/stat (utime + stime) over each phase.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use vmpath_tests::{Node, Vm, flood::dhcp4_discover, vmpath::common::drop_reason, yaml};

use crate::{
    control::agent_pid,
    dhcp::dhcp_exchange,
    report::{Bar, Section},
    util::{self, Mac, RawSock, fmt, percentile, summary},
};

pub struct Options {
    pub runs: usize,
    /// Exchanges of the quiet VM per phase.
    pub exchanges: usize,
}

const LOUD_MAC: Mac = [0x52, 0x54, 0x00, 0x00, 0xf1, 0x01];
const QUIET_MAC: Mac = [0x52, 0x54, 0x00, 0x00, 0xf1, 0x02];
/// The quiet client starts an exchange every this often (2 DHCP frames
/// per exchange: 10 frames/s, half its port's default dhcp4 rate).
const PACE: Duration = Duration::from_millis(200);

/// One phase: the quiet VM's exchanges, and what the agent and the flood
/// did meanwhile.
struct Phase {
    lat_us: Vec<f64>,
    failures: usize,
    /// The agent's CPU, in cores (1.0: one core busy all the time).
    agent_cores: f64,
    /// Frames the loud VM sent per second (0: no flood).
    flood_pps: f64,
    /// `slowpath_rate_limited` drops per second.
    limited_pps: f64,
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: &str) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The fields after the command name (which may hold spaces): state is
    // field 3, utime 14 and stime 15.
    let rest = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow!("odd /proc/{pid}/stat"))?
        .1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz)
}

fn quiet_exchanges(quiet: &Vm, n: usize, xid_base: u32) -> Result<(Vec<f64>, usize)> {
    util::in_netns(&quiet.ns.path(), || -> Result<(Vec<f64>, usize)> {
        let sock = RawSock::open("eth0")?;
        sock.set_rcv_timeout(100);
        let mut lat = Vec::new();
        let mut failures = 0;
        for i in 0..n {
            let t = Instant::now();
            if dhcp_exchange(&sock, QUIET_MAC, xid_base + i as u32)? {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            } else {
                failures += 1;
            }
            if let Some(rest) = PACE.checked_sub(t.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        Ok((lat, failures))
    })?
}

fn phase(node: &Node, loud: &Vm, quiet: &Vm, n: usize, flood: bool, xid: u32) -> Result<Phase> {
    let pid = agent_pid(node).ok_or_else(|| anyhow!("no agent process"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = flood.then(|| {
        let (stop, ns) = (stop.clone(), loud.ns.path());
        std::thread::spawn(move || -> Result<u64> {
            util::enter_netns(&ns)?;
            let sock = RawSock::open("eth0")?;
            sock.qdisc_bypass();
            Ok(sock.blast(&dhcp4_discover(LOUD_MAC, 0x10d), 64, &stop))
        })
    });
    if flood {
        // Let the flood drain the loud port's buckets first.
        std::thread::sleep(Duration::from_millis(500));
    }
    let limited0 = node.drops(drop_reason::SLOWPATH_RATE_LIMITED);
    let cpu0 = cpu_seconds(&pid)?;
    let t0 = Instant::now();
    let (lat_us, failures) = quiet_exchanges(quiet, n, xid)?;
    let wall = t0.elapsed().as_secs_f64();
    let agent_cores = (cpu_seconds(&pid)? - cpu0) / wall;
    let limited_pps = (node.drops(drop_reason::SLOWPATH_RATE_LIMITED) - limited0) as f64 / wall;
    stop.store(true, Ordering::Relaxed);
    let flood_pps = match flooder {
        Some(t) => {
            let sent = t.join().map_err(|_| anyhow!("flood thread panicked"))??;
            sent as f64 / (wall + 0.5)
        }
        None => 0.0,
    };
    Ok(Phase {
        lat_us,
        failures,
        agent_cores,
        flood_pps,
        limited_pps,
    })
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut node = Node::new("f");
    let loud = node.add_vm("loud", &util::mac_str(&LOUD_MAC), &[], None);
    let quiet = node.add_vm("quiet", &util::mac_str(&QUIET_MAC), &[], None);
    node.write_config(
        "config.yaml",
        &yaml::docs(&[
            yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
            yaml::attachment(
                "loud",
                "blue",
                "f",
                &loud.port,
                &util::mac_str(&LOUD_MAC),
                &["10.20.0.60/16"],
            ),
            yaml::attachment(
                "quiet",
                "blue",
                "f",
                &quiet.port,
                &util::mac_str(&QUIET_MAC),
                &["10.20.0.61/16"],
            ),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&loud.port, &quiet.port]);
    let ready = Instant::now();
    while quiet_exchanges(&quiet, 1, 1)?.0.is_empty() {
        if ready.elapsed() > Duration::from_secs(15) {
            bail!("no DHCP answer from the agent; log:\n{}", node.agent_log());
        }
    }
    let mut calm: Vec<Phase> = Vec::new();
    let mut flooded: Vec<Phase> = Vec::new();
    for r in 0..opts.runs {
        let xid = 0xf100_0000 + (r as u32) * 0x10000;
        let c = phase(&node, &loud, &quiet, opts.exchanges, false, xid)?;
        let f = phase(&node, &loud, &quiet, opts.exchanges, true, xid + 0x8000)?;
        eprintln!(
            "bench:   run {r}: median {:.0} µs calm, {:.0} µs flooded ({:.0} frames/s, agent {:.2} cores)",
            percentile(&c.lat_us, 50.0),
            percentile(&f.lat_us, 50.0),
            f.flood_pps,
            f.agent_cores
        );
        calm.push(c);
        flooded.push(f);
    }
    let row = |name: &str, phases: &[Phase]| {
        let lat: Vec<f64> = phases.iter().flat_map(|p| p.lat_us.clone()).collect();
        let total: usize = phases.iter().map(|p| p.lat_us.len() + p.failures).sum();
        let ok: usize = phases.iter().map(|p| p.lat_us.len()).sum();
        let medians: Vec<f64> = phases.iter().map(|p| percentile(&p.lat_us, 50.0)).collect();
        let cores = summary(&phases.iter().map(|p| p.agent_cores).collect::<Vec<_>>());
        let flood = summary(&phases.iter().map(|p| p.flood_pps).collect::<Vec<_>>());
        let limited = summary(&phases.iter().map(|p| p.limited_pps).collect::<Vec<_>>());
        (
            format!(
                "| {name} | {total} | {ok}/{total} ({}%) | {} | {} | {} | {} | {} |\n",
                fmt(100.0 * ok as f64 / total.max(1) as f64),
                fmt(summary(&medians).median),
                fmt(percentile(&lat, 99.0)),
                fmt(cores.median * 100.0),
                fmt(flood.median),
                fmt(limited.median),
            ),
            summary(&medians).median,
            ok == total,
            cores.max,
        )
    };
    let (calm_row, calm_med, _, _) = row("no flood", &calm);
    let (flood_row, flood_med, all_ok, max_cores) = row("loud VM flooding", &flooded);
    let mut md = format!(
        "Two VMs on one node, the network's slow-path limits and the agent's serving \
         budget at their defaults. The loud VM floods DHCP DISCOVERs from its own MAC \
         at line rate (raw AF_PACKET socket, sendmmsg, qdisc bypassed); the quiet VM \
         runs DISCOVER → OFFER → REQUEST → ACK exchanges one every {} ms (a real \
         client's pace, within its port's limit), 500 ms allowed for each answer. \
         Agent CPU: utime + stime of the agent process over the phase ÷ wall time. \
         {} runs of {} exchanges per phase, no-flood and flood phases interleaved.\n\n\
         | quiet VM | exchanges | completed | DISCOVER→ACK median µs (median of runs) | p99 µs (all runs) | agent CPU % of a core (median) | flood frames/s sent | `slowpath_rate_limited` drops/s |\n\
         |---|---|---|---|---|---|---|---|\n",
        PACE.as_millis(),
        opts.runs,
        opts.exchanges
    );
    md.push_str(&calm_row);
    md.push_str(&flood_row);
    md.push_str(&format!(
        "\nQuiet VM's median under the flood ÷ without: {} (goal: at most 2); every \
         exchange completed under the flood: {}; the agent's highest CPU in a flood \
         phase: {}% of a core (goal: under 50%).\n",
        fmt(flood_med / calm_med),
        if all_ok { "yes" } else { "no" },
        fmt(max_cores * 100.0)
    ));
    drop(loud);
    drop(quiet);
    drop(node);
    Ok(Section {
        title: "6. One VM flooding the slow path".into(),
        markdown: md,
        bars: vec![Bar {
            label: "quiet VM's DHCP median under a flood".into(),
            ratio: flood_med / calm_med,
            baseline: "the same exchange with no flood".into(),
        }],
    })
}
