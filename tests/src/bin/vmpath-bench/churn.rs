//! Churn (issue 34): pods created and deleted on one node at a steady
//! rate through `vmpath-cni` against a running agent (release builds),
//! as a node running batch jobs sees them: every ADD and DEL timed and
//! checked, the agent's RSS sampled every second, and once the churn
//! stops and the last pod is deleted, the node's ports, endpoints,
//! addresses, links and routes compared with before.
//!
//! Workers share one schedule (ticket k is due at k / rate seconds); each
//! owns a few pod namespaces and, at its ticket, deletes the pod its next
//! namespace holds (if any) and adds a new one there. A worker that is
//! late takes its next ticket at once: the rate reached is what the node
//! sustained.

use std::{
    fmt::Write as _,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use serde_json::json;
use vmpath_tests::{Netns, Node, bpftool_json, wait_for, yaml};

use crate::{
    cni::{Plugin, check_result, cni_bin, invoke_in},
    report::{Bar, Section},
    util::{enter_netns, fmt, percentile, rss_kb},
};

pub struct Options {
    /// ADDs per second asked (as many DELs once the namespaces are full).
    pub rate: f64,
    pub seconds: u64,
    /// Plugin calls in flight at most, and pods alive at most.
    pub workers: usize,
    pub alive: usize,
    /// Rows of the report: one per window of this many seconds.
    pub window: u64,
}

/// One plugin call.
struct Call {
    /// Seconds since the churn started, at the call's start.
    at: f64,
    add: bool,
    ms: f64,
    /// Seconds the call started behind its schedule.
    late: f64,
    error: Option<String>,
}

/// What a pod's coming and going may leave behind, counted.
fn footprint(node: &Node) -> Vec<(&'static str, usize)> {
    use vmpath_common::map_names as m;
    let entries = |name: &str| {
        let path = node.maps_dir().join(name);
        bpftool_json(&["map", "dump", "pinned", path.to_str().unwrap_or_default()])
            .as_array()
            .map_or(0, Vec::len)
    };
    let lines = |args: &[&str]| node.ns.run(args).lines().count();
    // `{"endpoints": {...}, "kept": [...]}`; none before the first ADD.
    let cni_endpoints = std::fs::read_to_string(node.state_dir.join("cni-endpoints.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .map_or(0, |v| {
            v["endpoints"].as_object().map_or(0, |o| o.len())
                + v["kept"].as_array().map_or(0, Vec::len)
        });
    vec![
        ("`vmp_ports` entries", entries(m::PORTS)),
        ("`vmp_port_ids` entries", entries(m::PORT_IDS)),
        ("`vmp_endpoints` entries", entries(m::ENDPOINTS)),
        ("`vmp_addresses` entries", entries(m::ADDRESSES)),
        ("links in the node", lines(&["ip", "-o", "link", "show"])),
        (
            "IPv4 routes (all tables)",
            lines(&["ip", "-4", "route", "show", "table", "all"]),
        ),
        (
            "IPv6 routes (all tables)",
            lines(&["ip", "-6", "route", "show", "table", "all"]),
        ),
        ("agent's CNI endpoints (state file)", cni_endpoints),
    ]
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut node = Node::new("h");
    node.write_config(
        "config.yaml",
        &yaml::docs(&[yaml::network(
            "blue",
            100,
            &["10.20.0.0/16"],
            &["10.20.0.1"],
            true,
        )]),
    );
    node.start_agent();
    wait_for("the agent to be ready", Duration::from_secs(120), || {
        node.status().is_some_and(|s| s["ready"] == true)
    });
    let pid = node.agent_pid().unwrap_or_default().to_string();
    let plugin = Plugin {
        name: "vmpath-cni",
        bin: cni_bin(),
        config: json!({
            "cniVersion": "1.0.0", "name": "blue", "type": "vmpath-cni",
            "network": "blue", "socket": node.api_socket(),
        })
        .to_string(),
        cni_path: String::new(),
    };
    let namespaces: Vec<Netns> = (0..opts.alive)
        .map(|i| Netns::new(format!("vt{}-ch{i}", node.tag)))
        .collect();
    let before = footprint(&node);
    let (_, rss0) = rss_kb(&pid);

    let calls = Mutex::new(Vec::<Call>::new());
    let rss = Mutex::new(vec![(0.0, rss0 as f64 / 1024.0)]);
    let ticket = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let node_ns = node.ns.path();
    let started = Instant::now();
    let deadline = Duration::from_secs(opts.seconds);
    let per_worker = opts.alive.div_ceil(opts.workers);
    let leftovers: Vec<(usize, String, String)> = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(1));
                let (_, now) = rss_kb(&pid);
                rss.lock()
                    .unwrap()
                    .push((started.elapsed().as_secs_f64(), now as f64 / 1024.0));
            }
        });
        let workers: Vec<_> = (0..opts.workers)
            .map(|w| {
                let (calls, ticket, plugin, node_ns, namespaces) =
                    (&calls, &ticket, &plugin, &node_ns, &namespaces);
                let tag = node.tag.clone();
                scope.spawn(move || -> Vec<(usize, String, String)> {
                    if let Err(e) = enter_netns(node_ns) {
                        panic!("entering the node's namespace: {e:#}");
                    }
                    let mine: Vec<usize> =
                        (w * per_worker..((w + 1) * per_worker).min(namespaces.len())).collect();
                    // The pod (container id, name) each of my namespaces holds.
                    let mut held: Vec<Option<(String, String)>> = vec![None; mine.len()];
                    let mut next = 0;
                    loop {
                        let k = ticket.fetch_add(1, Ordering::Relaxed);
                        let due = Duration::from_secs_f64(k as f64 / opts.rate);
                        // The run ends at its deadline, however far the
                        // node fell behind the schedule.
                        if due >= deadline || started.elapsed() >= deadline || mine.is_empty() {
                            break;
                        }
                        if let Some(wait) = due.checked_sub(started.elapsed()) {
                            std::thread::sleep(wait);
                        }
                        let late = (started.elapsed().saturating_sub(due)).as_secs_f64();
                        let slot = next % mine.len();
                        next += 1;
                        let ns = &namespaces[mine[slot]];
                        let record = |add: bool, at: f64, r: Result<(f64, String)>| {
                            let (ms, error) = match r {
                                Ok((ms, out)) if add => {
                                    let checked = check_result(plugin, &out);
                                    (ms, checked.err().map(|e| format!("{e:#}")))
                                }
                                Ok((ms, _)) => (ms, None),
                                Err(e) => (0.0, Some(format!("{e:#}"))),
                            };
                            calls.lock().unwrap().push(Call {
                                at,
                                add,
                                ms,
                                late,
                                error,
                            });
                        };
                        if let Some((id, pod)) = held[slot].take() {
                            let at = started.elapsed().as_secs_f64();
                            record(false, at, invoke_in(plugin, "DEL", ns, &id, &pod));
                        }
                        let id = format!("{tag}ch{k:08}0123456789abcdef");
                        let pod = format!("churn-{k}");
                        let at = started.elapsed().as_secs_f64();
                        let r = invoke_in(plugin, "ADD", ns, &id, &pod);
                        // A failed ADD is deleted too, as a runtime does.
                        record(true, at, r);
                        held[slot] = Some((id, pod));
                    }
                    held.into_iter()
                        .enumerate()
                        .filter_map(|(slot, h)| h.map(|(id, pod)| (mine[slot], id, pod)))
                        .collect()
                })
            })
            .collect();
        let left = workers
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect();
        done.store(true, Ordering::Relaxed);
        let _ = sampler.join();
        left
    });
    let churn_s = started.elapsed().as_secs_f64();
    let mut del_errors = 0;
    crate::util::in_netns(&node_ns, || {
        for (i, id, pod) in &leftovers {
            if invoke_in(&plugin, "DEL", &namespaces[*i], id, pod).is_err() {
                del_errors += 1;
            }
        }
    })?;
    // The last DELs' rounds may still run: the footprint settles.
    let settle = Instant::now();
    let mut after = footprint(&node);
    while after != before && settle.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(500));
        after = footprint(&node);
    }
    let calls = calls.into_inner().unwrap();
    let rss = rss.into_inner().unwrap();
    if calls.is_empty() {
        bail!("no plugin call was made");
    }
    // With VMPATH_AGENT_LOG set, the agent's log (each ADD's wait in the
    // agent, and at debug its round phases) is kept for whoever looks into
    // a slow window.
    if std::env::var_os("VMPATH_AGENT_LOG").is_some() {
        let path = std::env::temp_dir().join("vmpath-churn.log");
        let _ = std::fs::write(&path, node.agent_log());
        eprintln!("bench: churn: agent log kept in {}", path.display());
    }
    let errors: Vec<&Call> = calls.iter().filter(|c| c.error.is_some()).collect();
    let adds = calls.iter().filter(|c| c.add).count();
    let dels = calls.len() - adds;

    let mut md = format!(
        "`vmpath agent` and `vmpath-cni` (release builds), one node, one Network with IPAM \
         (a /16); {workers} workers share one schedule of {rate} ADDs per second for {secs} s, \
         each deleting the pod its next namespace holds before adding a new one there \
         ({alive} pods alive at most); every ADD checked for an address. A late worker takes its \
         next ticket at once: the rate reached is what this node sustained. RSS: the agent's \
         `VmRSS`, sampled every second.\n\n\
         Reached: **{adds} ADDs and {dels} DELs in {churn:.0} s ({ar} ADDs/s, {dr} DELs/s)**, \
         asked {rate}/s; {e} failed{first}.\n\n\
         | seconds | ADDs | DELs | ADD p50 ms | ADD p99 ms | DEL p50 ms | behind schedule max s | agent RSS MiB |\n\
         |---|---|---|---|---|---|---|---|\n",
        workers = opts.workers,
        rate = opts.rate,
        secs = opts.seconds,
        alive = opts.alive,
        churn = churn_s,
        ar = fmt(adds as f64 / churn_s),
        dr = fmt(dels as f64 / churn_s),
        e = errors.len() + del_errors,
        first = errors
            .first()
            .and_then(|c| c.error.as_deref())
            .map(|m| format!(
                " (first: `{}`)",
                m.lines().next().unwrap_or(m).replace('|', "/")
            ))
            .unwrap_or_default(),
    );
    let windows = churn_s.ceil() as u64 / opts.window.max(1) + 1;
    let mut window_p50 = Vec::new();
    for w in 0..windows {
        let (from, to) = ((w * opts.window) as f64, ((w + 1) * opts.window) as f64);
        let inside: Vec<&Call> = calls.iter().filter(|c| c.at >= from && c.at < to).collect();
        if inside.is_empty() {
            continue;
        }
        let add_ms: Vec<f64> = inside
            .iter()
            .filter(|c| c.add && c.error.is_none())
            .map(|c| c.ms)
            .collect();
        let del_ms: Vec<f64> = inside
            .iter()
            .filter(|c| !c.add && c.error.is_none())
            .map(|c| c.ms)
            .collect();
        let late = inside.iter().map(|c| c.late).fold(0.0, f64::max);
        let rss_at = rss.iter().rfind(|(t, _)| *t < to).map_or(0.0, |(_, m)| *m);
        let p = |v: &[f64], q| {
            if v.is_empty() {
                "-".to_string()
            } else {
                fmt(percentile(v, q))
            }
        };
        let _ = writeln!(
            md,
            "| {from:.0}–{to:.0} | {} | {} | {} | {} | {} | {} | {} |",
            inside.iter().filter(|c| c.add).count(),
            inside.iter().filter(|c| !c.add).count(),
            p(&add_ms, 50.0),
            p(&add_ms, 99.0),
            p(&del_ms, 50.0),
            fmt(late),
            fmt(rss_at)
        );
        if !add_ms.is_empty() {
            window_p50.push(percentile(&add_ms, 50.0));
        }
    }
    let _ = write!(
        md,
        "\n**Left behind** once the churn stopped and its last {} pods were deleted \
         (compared until equal, at most 60 s: {:.1} s):\n\n| | before | after |\n|---|---|---|\n",
        leftovers.len(),
        settle.elapsed().as_secs_f64()
    );
    for ((what, b), (_, a)) in before.iter().zip(&after) {
        let mark = if a != b { " **(leak)**" } else { "" };
        let _ = writeln!(md, "| {what} | {b} | {a}{mark} |");
    }
    let mut bars = Vec::new();
    if let (Some(first), Some(last)) = (window_p50.first(), window_p50.last()) {
        bars.push(Bar {
            label: "churn: ADD p50, last window".into(),
            ratio: last / first,
            baseline: "first window".into(),
        });
    }
    let rss_first = rss.get(1).map_or(rss0 as f64 / 1024.0, |(_, m)| *m);
    if let Some((_, last)) = rss.last() {
        bars.push(Bar {
            label: "churn: agent RSS at the end".into(),
            ratio: last / rss_first,
            baseline: "RSS after 1 s".into(),
        });
    }
    Ok(Section {
        title: "15. Churn: pods created and deleted".into(),
        markdown: md,
        bars,
    })
}
