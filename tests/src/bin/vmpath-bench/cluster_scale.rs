//! Cluster scale (issue 34): one agent (`--source kubernetes`) against the
//! test bed's API server holding N KubeVirt VMs (VMI, virt-launcher pod,
//! IPAMClaim each, each with its uid) over 200 nodes (1,000 at 100,000
//! VMs, as issue 34 asks the memory figure), 50 of them on this agent's
//! node, at each N: how long the agent takes to derive its node's VMs from a cold
//! start, objects -> programmed for a new VM on this node (p50, p99), the
//! CNI ADD of a VM it already knows (p50), and its RSS.
//!
//! Each figure is taken for each agent build or switch given, in the same
//! run, so the growth with N shows side by side: "this build" (the agent
//! as it is) and, when `VMPATH_BENCH_FULL_ROUND_ARGS` names the agent's
//! flags that force a full reconcile round per event (an incremental
//! control plane's fallback), the same agent with them. An agent without
//! such a switch runs a full round per event already: its row is the
//! full-round figure. `VMPATH_BENCH_BASELINE_BIN` (and
//! `VMPATH_BENCH_BASELINE_NAME`) add another build's agent, e.g. an
//! earlier commit's release binary, measured in the same pass.

use std::{
    fmt::Write as _,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use vmpath_tests::{Node, kube_api::ApiServer, multus, wait_for};

use crate::{
    kube_scale::{
        LOCAL, NETWORK, NODES, NODES_AT_SCALE, add, cluster_objects, create_vm, derived,
        files_node, kube_node, node_of, pod_netns, vm_objects,
    },
    report::{Bar, Section},
    util::{fmt, percentile, rss_kb},
};

pub struct Options {
    /// Cluster sizes (VMs), smallest first: the first is the baseline of
    /// the growth ratios.
    pub sizes: Vec<usize>,
    /// Samples of each latency at each size.
    pub samples: usize,
    /// How long the agent may take to derive its node's VMs at one size;
    /// a size that takes longer is reported as such, not measured.
    pub settle_limit: Duration,
}

/// One agent variant: a name, its extra flags, its binary (`None`: this
/// build's).
struct Variant {
    name: String,
    args: Vec<String>,
    bin: Option<std::path::PathBuf>,
    /// Reads the objects from files in its config dir (`--source files`,
    /// the default) instead of from the API server.
    files: bool,
}

fn variants() -> Vec<Variant> {
    let mut out = vec![
        Variant {
            name: "this build".into(),
            args: Vec::new(),
            bin: None,
            files: false,
        },
        // Issue 34 asks the same latency of the file source: the same
        // objects as files (what an operator without an API server, or a
        // GitOps tree, gives the agent).
        Variant {
            name: "this build, files".into(),
            args: Vec::new(),
            bin: None,
            files: true,
        },
    ];
    if std::env::var("VMPATH_BENCH_SCALE_FILES").is_ok_and(|v| v == "0") {
        out.retain(|v| !v.files);
    }
    // Another build (an earlier commit's release agent), measured in the
    // same pass: what a change gained, with the machine's noise the same.
    if let Ok(bin) = std::env::var("VMPATH_BENCH_BASELINE_BIN")
        && !bin.trim().is_empty()
    {
        let name = std::env::var("VMPATH_BENCH_BASELINE_NAME")
            .unwrap_or_else(|_| format!("baseline `{}`", bin.trim()));
        out.push(Variant {
            name,
            args: Vec::new(),
            bin: Some(bin.trim().into()),
            files: false,
        });
    }
    if let Ok(args) = std::env::var("VMPATH_BENCH_FULL_ROUND_ARGS")
        && !args.trim().is_empty()
    {
        out.push(Variant {
            name: format!("full round (`{}`)", args.trim()),
            args: args.split_whitespace().map(str::to_string).collect(),
            bin: None,
            files: false,
        });
    }
    out
}

/// One size's figures for one variant.
struct Figures {
    settle_s: f64,
    fresh: Vec<f64>,
    known: Vec<f64>,
    hwm_mib: f64,
    rss_mib: f64,
}

/// Starts `node`'s agent and waits (at most `limit`) until it has derived
/// every VM of this node among the `n`; returns the seconds it took.
fn settle(node: &mut Node, n: usize, limit: Duration) -> Result<f64> {
    let locals: Vec<String> = (0..n)
        .filter(|&i| node_of(i, n) == "a")
        .map(|i| format!("vm{i}"))
        .collect();
    let started = Instant::now();
    node.start_agent();
    while !locals.iter().all(|vm| derived(node, vm)) {
        if started.elapsed() > limit {
            bail!(
                "the agent had not derived its {} VMs after {} s",
                locals.len(),
                limit.as_secs()
            );
        }
        if !node.agent_running() {
            bail!(
                "the agent exited: {}",
                vmpath_tests::last_lines(&node.agent_log(), 5, " | ")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The agent's (peak, current) RSS once it is at rest: the rounds the
/// samples started have run (at 100,000 VMs a round takes a second, and
/// what it holds while it runs is in the peak, not in what the agent
/// keeps). At rest: under 20 ms of CPU in each of two half seconds in a
/// row; read anyway after a minute.
fn rss_at_rest(pid: &str) -> (u64, u64) {
    let cpu_ticks = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                // Fields after the command's closing parenthesis; utime
                // and stime are the 14th and 15th of the line.
                let rest = s.rsplit_once(')')?.1;
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
            })
            .unwrap_or(0)
    };
    let started = Instant::now();
    let (mut last, mut quiet) = (cpu_ticks(), 0);
    while quiet < 2 && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(500));
        let now = cpu_ticks();
        // Ticks are 10 ms.
        quiet = if now.saturating_sub(last) <= 2 {
            quiet + 1
        } else {
            0
        };
        last = now;
    }
    rss_kb(pid)
}

/// New VMs on this node, `samples` of each kind: objects created then
/// the ADD at once (objects -> programmed), and the ADD of a VM the agent
/// has derived (ADD alone).
fn latencies(node: &Node, bed: &Bed, n: usize, samples: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let conf = multus::nad_conf(NETWORK, node);
    let (mut fresh, mut known) = (Vec::new(), Vec::new());
    for s in 0..samples {
        let i = n + 2 * s;
        let netns = pod_netns(i);
        let started = bed.create_vm(node, i);
        fresh.push(add(node, &conf, i, &netns, started)?);

        let j = i + 1;
        bed.create_vm(node, j);
        let vm = format!("vm{j}");
        wait_for(
            "the agent to derive the VM",
            Duration::from_secs(120),
            || derived(node, &vm),
        );
        let netns = pod_netns(j);
        known.push(add(node, &conf, j, &netns, Instant::now())?);
    }
    Ok((fresh, known))
}

/// Where a variant's agent reads the cluster's objects.
enum Bed {
    Api(ApiServer),
    Files,
}

impl Bed {
    /// Creates VM `i` on node "a" as [`create_vm`] does, or as one new
    /// file of its objects (written whole, then renamed into the config
    /// dir): returns when the clock started.
    fn create_vm(&self, node: &Node, i: usize) -> Instant {
        match self {
            Bed::Api(server) => create_vm(server, i, "a"),
            Bed::Files => {
                let text = vm_objects(i, "a")
                    .iter()
                    .map(Value::to_string)
                    .collect::<Vec<_>>()
                    .join("\n---\n");
                let started = Instant::now();
                node.write_config(&format!("vm-{i:07}.yaml"), &text);
                started
            }
        }
    }
}

fn measure(n: usize, variant: &Variant, opts: &Options) -> Result<Figures> {
    let t = Instant::now();
    let objects = cluster_objects(n);
    let (mut node, bed) = if variant.files {
        (files_node(&objects), Bed::Files)
    } else {
        let (node, server) = kube_node(&objects);
        (node, Bed::Api(server))
    };
    drop(objects);
    eprintln!(
        "bench: cluster scale: {n} VMs in the {} in {:.1} s",
        if variant.files {
            "config dir"
        } else {
            "API server"
        },
        t.elapsed().as_secs_f64()
    );
    let mut args = Vec::new();
    if !variant.files {
        let kubeconfig = node.state_dir.join("kubeconfig");
        args.extend([
            "--source".to_string(),
            "kubernetes".into(),
            "--kubeconfig".into(),
            kubeconfig.to_string_lossy().into_owned(),
        ]);
    }
    args.extend(variant.args.iter().cloned());
    if let Some(bin) = &variant.bin {
        node.set_agent_bin(bin);
    }
    node.set_agent_args(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let settle_s = settle(&mut node, n, opts.settle_limit)?;
    // The first rounds' garbage gone before the resident size is read.
    std::thread::sleep(Duration::from_secs(2));
    let pid = node.agent_pid().context("agent pid")?.to_string();
    // VMPATH_BENCH_PERF=DIR: the agent's CPU samples over the latency
    // samples (`perf record`, call graphs from DWARF) in
    // DIR/perf-N-VARIANT.data, for whoever looks into where a round's time
    // goes. VMPATH_BENCH_PERF_FREQ: samples a second (499 unless given;
    // a round is milliseconds, so a closer look wants thousands).
    let freq = std::env::var("VMPATH_BENCH_PERF_FREQ").unwrap_or_else(|_| "499".into());
    let perf = std::env::var_os("VMPATH_BENCH_PERF").map(|dir| {
        let variant: String = variant
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let out = std::path::Path::new(&dir).join(format!("perf-{n}-{variant}.data"));
        std::process::Command::new("perf")
            .args([
                "record",
                "-q",
                "-F",
                &freq,
                "--call-graph",
                "dwarf,16384",
                "-p",
                &pid,
                "-o",
            ])
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .spawn()
    });
    let (fresh, known) = latencies(&node, &bed, n, opts.samples)?;
    if let Some(Ok(mut perf)) = perf {
        // SIGINT: perf writes its file and exits.
        let _ = std::process::Command::new("kill")
            .args(["-INT", &perf.id().to_string()])
            .status();
        let _ = perf.wait();
    }
    let (hwm, rss) = rss_at_rest(&pid);
    // With VMPATH_AGENT_LOG=vmpath=debug the agent's round phases are in
    // its log: kept for whoever looks into a slow figure.
    if std::env::var_os("VMPATH_AGENT_LOG").is_some() {
        let path = std::env::temp_dir().join(format!("vmpath-cluster-scale-{n}.log"));
        let _ = std::fs::write(&path, node.agent_log());
        eprintln!("bench: agent log at {n} VMs kept in {}", path.display());
    }
    Ok(Figures {
        settle_s,
        fresh,
        known,
        hwm_mib: hwm as f64 / 1024.0,
        rss_mib: rss as f64 / 1024.0,
    })
}

pub fn run(opts: &Options) -> Result<Section> {
    let variants = variants();
    let mut md = format!(
        "`vmpath agent --source kubernetes` (release build) against the test bed's API \
         server (in memory, real HTTP, paged lists, watches) holding N KubeVirt VMs (VMI, \
         virt-launcher pod and IPAMClaim each, as KubeVirt, Multus and ipam-extensions write \
         them, each with its uid) over {NODES} nodes ({NODES_AT_SCALE} at 100,000 VMs, as issue 34 \
         asks the memory figure), {LOCAL} of them on this agent's node (all N when N is \
         smaller), one Network. For each N and each agent, a fresh API server and agent:\n\n\
         - **derive s**: from the agent's start to its status listing every VM of its node \
           (lists, watches, the first rounds);\n\
         - **objects → programmed**: a new VM on this node, its IPAMClaim created and \
           allocated and its pod's network namespace made (the runtime's sandbox), then (the \
           clock started) its VMI and pod created and its pod's CNI ADD at once; the clock \
           stops at the ADD's answer, which comes once \
           the port is programmed ({} samples, p50 and p99: with few samples p99 is the worst);\n\
         - **ADD p50**: the CNI ADD (the plugin's run, as Multus calls it) of a VM the agent \
           had already derived, into a network namespace made before;\n\
         - **peak RSS / RSS**: the agent's `VmHWM`, and its `VmRSS` at rest after the samples \
           (once the rounds they started have run: what the agent keeps between events; what \
           a round holds while it runs is in the peak). The maps' kernel memory is in neither \
           (docs/config.md, Limits).\n\n\
         **this build, files** is the same agent with the file source (`--source files`, issue \
         34 asks it the same latency): the same objects in its config dir, 300 to a file \
         (every object but other nodes' pods, what the watches hold), and a new VM's objects \
         as one new file, written whole and renamed in (its clock starts at the rename).\n\n\
         Agents: {}.{}\n\n\
         | VMs | agent | derive s | objects → programmed p50 ms | p99 ms | ADD p50 ms | peak RSS MiB | RSS MiB |\n\
         |---|---|---|---|---|---|---|---|\n",
        opts.samples,
        variants
            .iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if variants
            .iter()
            .all(|v| v.bin.is_none() && v.args.is_empty())
        {
            " No switch forcing full rounds (`VMPATH_BENCH_FULL_ROUND_ARGS`) and no \
             earlier build (`VMPATH_BENCH_BASELINE_BIN`) was given: the rows are this \
             build's alone. Each size's agents run one after the other in the same pass."
        } else {
            " Each size's agents run one after the other in the same pass."
        },
    );
    let mut bars = Vec::new();
    // Per variant: (N, objects -> programmed p50, ADD p50, peak RSS) of
    // the smallest size measured, the baseline of the growth bars.
    let mut first: Vec<Option<(usize, f64, f64)>> = vec![None; variants.len()];
    for &n in &opts.sizes {
        for (k, v) in variants.iter().enumerate() {
            let t = Instant::now();
            match measure(n, v, opts) {
                Ok(f) => {
                    let (p50, add50) = (percentile(&f.fresh, 50.0), percentile(&f.known, 50.0));
                    let _ = writeln!(
                        md,
                        "| {n} | {} | {} | {} | {} | {} | {} | {} |",
                        v.name,
                        fmt(f.settle_s),
                        fmt(p50),
                        fmt(percentile(&f.fresh, 99.0)),
                        fmt(add50),
                        fmt(f.hwm_mib),
                        fmt(f.rss_mib)
                    );
                    match first[k] {
                        None => first[k] = Some((n, p50, add50)),
                        Some((n0, p0, a0)) => {
                            bars.push(Bar {
                                label: format!("{}: objects -> programmed p50, {n} VMs", v.name),
                                ratio: p50 / p0,
                                baseline: format!("{n0} VMs"),
                            });
                            bars.push(Bar {
                                label: format!("{}: CNI ADD p50, {n} VMs", v.name),
                                ratio: add50 / a0,
                                baseline: format!("{n0} VMs"),
                            });
                        }
                    }
                }
                Err(e) => {
                    let _ = writeln!(
                        md,
                        "| {n} | {} | not measured: {} (after {:.0} s) | | | | | |",
                        v.name,
                        format!("{e:#}").replace('|', "/"),
                        t.elapsed().as_secs_f64()
                    );
                }
            }
            eprintln!(
                "bench: cluster scale: {n} VMs, {}: {:.0} s",
                v.name,
                t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(Section {
        title: "14. Cluster scale".into(),
        markdown: md,
        bars,
    })
}
