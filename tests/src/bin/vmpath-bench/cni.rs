//! CNI ADD latency: `vmpath-cni` (veth pair, handover to a running agent,
//! which programs the port before the plugin answers, addresses in the
//! pod) against Debian's `bridge` + `host-local` plugins, in the same
//! node namespace, in the same run: 100 sequential ADDs and 20 at once.
//! The clock runs from spawning the plugin (config on stdin, as a runtime
//! does) to its exit with a result.

use std::{
    fmt::Write as _,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Barrier, OnceLock},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};
use vmpath_tests::{Netns, Node, yaml};

use crate::{
    report::{Bar, Section},
    util::{enter_netns, fmt, percentile},
};

/// One plugin's figures: its name, sequential and concurrent ADD times (ms).
type Figures = (&'static str, Vec<f64>, Vec<f64>);

pub struct Options {
    pub sequential: usize,
    pub concurrent: usize,
}

/// Where Debian's containernetworking-plugins puts `bridge` and `host-local`.
const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";
/// The goal: no single ADD slower than this.
const CEILING_MS: f64 = 100.0;

pub(crate) fn cni_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    vmpath_tests::workspace_bin(&BIN, "VMPATH_CNI_BIN", "vmpath-cni")
}

/// One plugin under test: its binary, its config, its plugin dir.
pub(crate) struct Plugin {
    pub(crate) name: &'static str,
    pub(crate) bin: PathBuf,
    pub(crate) config: String,
    pub(crate) cni_path: String,
}

/// A pod sandbox: its namespace and container id.
struct Sandbox {
    ns: Netns,
    id: String,
}

/// Runs one CNI command in the calling thread's namespace (the node's);
/// returns the wall time in ms and the plugin's stdout.
fn invoke(p: &Plugin, command: &str, s: &Sandbox, pod: &str) -> Result<(f64, String)> {
    invoke_in(p, command, &s.ns, &s.id, pod)
}

/// [`invoke`] with the sandbox's namespace and container id given apart
/// (a namespace that sees several sandboxes in turn).
pub(crate) fn invoke_in(
    p: &Plugin,
    command: &str,
    ns: &Netns,
    id: &str,
    pod: &str,
) -> Result<(f64, String)> {
    let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={pod}");
    let started = Instant::now();
    let mut child = Command::new(&p.bin)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", ns.path())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", &p.cni_path)
        .env("CNI_ARGS", &args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", p.bin.display()))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(p.config.as_bytes())?;
    let out = child.wait_with_output()?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{} {command} for {pod} failed: {stdout} {}",
            p.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((ms, stdout))
}

/// ADD then (untimed) DEL of `n` fresh sandboxes, one after another (a
/// node's pods come and go; vmpath serves at most 64 local ports per
/// network and node, `MAX_FLOOD_PORTS`).
fn sequential(node: &Node, p: &Plugin, n: usize, tag: &str) -> Result<Vec<f64>> {
    let sandboxes: Vec<Sandbox> = (0..n).map(|i| sandbox(node, tag, i)).collect();
    let node_ns = node.ns.path();
    crate::util::in_netns(&node_ns, || -> Result<Vec<f64>> {
        let mut ms = Vec::with_capacity(n);
        for (i, s) in sandboxes.iter().enumerate() {
            let pod = format!("{tag}-{i}");
            let (t, out) = invoke(p, "ADD", s, &pod)?;
            check_result(p, &out)?;
            ms.push(t);
            invoke(p, "DEL", s, &pod)?;
        }
        Ok(ms)
    })?
}

/// `n` ADDs released at once (one thread each, a barrier), then DELs.
fn concurrent(node: &Node, p: &Plugin, n: usize, tag: &str) -> Result<Vec<f64>> {
    let sandboxes: Vec<Sandbox> = (0..n).map(|i| sandbox(node, tag, i)).collect();
    let node_ns = node.ns.path();
    let barrier = Barrier::new(n);
    let results: Vec<Result<f64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = sandboxes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (barrier, node_ns) = (&barrier, &node_ns);
                scope.spawn(move || -> Result<f64> {
                    enter_netns(node_ns)?;
                    barrier.wait();
                    let (t, out) = invoke(p, "ADD", s, &format!("{tag}-{i}"))?;
                    check_result(p, &out)?;
                    Ok(t)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let ms = results.into_iter().collect::<Result<Vec<f64>>>()?;
    crate::util::in_netns(&node_ns, || -> Result<()> {
        for (i, s) in sandboxes.iter().enumerate() {
            invoke(p, "DEL", s, &format!("{tag}-{i}"))?;
        }
        Ok(())
    })??;
    Ok(ms)
}

fn sandbox(node: &Node, tag: &str, i: usize) -> Sandbox {
    Sandbox {
        ns: Netns::new(format!("vt{}-{tag}{i}", node.tag)),
        id: format!("{}{tag}{i:04}0123456789abcdef", node.tag),
    }
}

/// Every ADD must have given the pod an address, or the figure is void.
pub(crate) fn check_result(p: &Plugin, out: &str) -> Result<()> {
    let v: Value = serde_json::from_str(out).with_context(|| format!("{} result {out}", p.name))?;
    if v["ips"][0]["address"].as_str().is_none() {
        bail!("{} result without an address: {out}", p.name);
    }
    Ok(())
}

pub fn run(opts: &Options) -> Result<Section> {
    for bin in ["bridge", "host-local"] {
        if !Path::new(DEBIAN_CNI_DIR).join(bin).exists() {
            bail!(
                "{DEBIAN_CNI_DIR}/{bin} missing (`cargo xtask setup` installs containernetworking-plugins)"
            );
        }
    }
    let mut node = Node::new("k");
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
    vmpath_tests::wait_for(
        "the agent to be ready",
        std::time::Duration::from_secs(20),
        || node.status().is_some_and(|s| s["ready"] == true),
    );
    let host_local_dir = std::env::temp_dir().join(format!("vmpath-bench-host-local-{}", node.tag));
    let plugins = [
        Plugin {
            name: "vmpath-cni",
            bin: cni_bin(),
            config: json!({
                "cniVersion": "1.0.0", "name": "blue", "type": "vmpath-cni",
                "network": "blue", "socket": node.api_socket(),
            })
            .to_string(),
            cni_path: String::new(),
        },
        Plugin {
            name: "bridge + host-local",
            bin: Path::new(DEBIAN_CNI_DIR).join("bridge"),
            config: json!({
                "cniVersion": "1.0.0", "name": "br", "type": "bridge",
                "bridge": format!("vbr{}", node.tag), "isGateway": true, "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": "10.99.0.0/16", "gateway": "10.99.0.1"}]],
                    "dataDir": host_local_dir,
                },
            })
            .to_string(),
            cni_path: DEBIAN_CNI_DIR.into(),
        },
    ];
    // One untimed warm-up ADD each (page cache, the bridge's creation).
    let measured = (|| -> Result<Vec<Figures>> {
        let mut figures = Vec::new();
        for (i, p) in plugins.iter().enumerate() {
            sequential(&node, p, 1, &format!("w{i}"))?;
        }
        for (i, p) in plugins.iter().enumerate() {
            let seq = sequential(&node, p, opts.sequential, &format!("s{i}"))?;
            let conc = concurrent(&node, p, opts.concurrent, &format!("c{i}"))?;
            figures.push((p.name, seq, conc));
        }
        Ok(figures)
    })();
    // VMPATH_BENCH_AGENT_LOG=FILE keeps the agent's log (a round's steps
    // and times).
    if let Ok(path) = std::env::var("VMPATH_BENCH_AGENT_LOG") {
        let _ = std::fs::write(path, node.agent_log());
    }
    let figures = measured?;
    let _ = std::fs::remove_dir_all(&host_local_dir);
    // The agent's side of each vmpath ADD (POST received -> port programmed
    // and answered), from its log, in ADD order: warm-up, sequential, then
    // the concurrent ones.
    let waits: Vec<f64> = node
        .agent_log()
        .lines()
        .filter(|l| l.contains("CNI endpoint programmed"))
        .filter_map(|l| {
            l.split("wait_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    if waits.len() != 1 + opts.sequential + opts.concurrent {
        bail!(
            "{} handovers in the agent's log, {} ADDs made",
            waits.len(),
            1 + opts.sequential + opts.concurrent
        );
    }
    let (seq_wait, conc_wait) = waits[1..].split_at(opts.sequential);

    let mut md = format!(
        "One node namespace with a running agent (release build) and a Network `blue` \
         (IPAM); each ADD gets a fresh pod namespace. **vmpath-cni** (release build, \
         cniVersion 1.0.0): asks the agent for the network, creates the veth pair with \
         the pod side directly in the pod's namespace (rtnetlink, in-process), hands the \
         endpoint to the agent over its API socket and waits until the agent has \
         programmed the port (the agent's reconcile round included), then gives the pod \
         its address and default route. **Baseline**: Debian's `bridge` plugin with \
         `host-local` IPAM ({DEBIAN_CNI_DIR}), which creates the veth pair, attaches it \
         to a Linux bridge and gives the pod an address, in the same namespace in the \
         same run. The clock runs from spawning the plugin (config on stdin) to its \
         exit with a result; the plugin runs in the node's namespace as a runtime runs \
         it. {} sequential ADDs (each pod deleted before the next), then {} released at \
         once (a barrier); DELs untimed.\n\n\
         | plugin | sequential p50 ms | p99 ms | max ms | {} concurrent p50 ms | p99 ms | max ms |\n\
         |---|---|---|---|---|---|---|\n",
        opts.sequential, opts.concurrent, opts.concurrent
    );
    for (name, seq, conc) in &figures {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {} | {} | {} |",
            fmt(percentile(seq, 50.0)),
            fmt(percentile(seq, 99.0)),
            fmt(percentile(seq, 100.0)),
            fmt(percentile(conc, 50.0)),
            fmt(percentile(conc, 99.0)),
            fmt(percentile(conc, 100.0)),
        );
    }
    let _ = writeln!(
        md,
        "| of which the agent (handover: request received → port programmed, answered; its log) \
         | {} | {} | {} | {} | {} | {} |",
        fmt(percentile(seq_wait, 50.0)),
        fmt(percentile(seq_wait, 99.0)),
        fmt(percentile(seq_wait, 100.0)),
        fmt(percentile(conc_wait, 50.0)),
        fmt(percentile(conc_wait, 99.0)),
        fmt(percentile(conc_wait, 100.0)),
    );
    let (v, b) = (&figures[0], &figures[1]);
    let seq_ratio = percentile(&v.1, 50.0) / percentile(&b.1, 50.0);
    let conc_ratio = percentile(&v.2, 50.0) / percentile(&b.2, 50.0);
    let worst = percentile(&v.1, 100.0).max(percentile(&v.2, 100.0));
    let _ = writeln!(
        md,
        "\nvmpath-cni median ÷ bridge + host-local median: sequential {}, concurrent {} \
         (goal: at most 1.5). Slowest vmpath-cni ADD: {} ms (goal: none above {CEILING_MS} ms).",
        fmt(seq_ratio),
        fmt(conc_ratio),
        fmt(worst),
    );
    Ok(Section {
        title: "9. CNI ADD latency".into(),
        markdown: md,
        bars: vec![
            Bar {
                label: "CNI ADD p50, sequential".into(),
                ratio: seq_ratio,
                baseline: "bridge + host-local".into(),
            },
            Bar {
                label: format!("CNI ADD p50, {} concurrent", opts.concurrent),
                ratio: conc_ratio,
                baseline: "bridge + host-local".into(),
            },
        ],
    })
}
