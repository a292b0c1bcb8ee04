//! Figure group 3: the control plane.
//!
//! Scale: N attachments through the agent's own library, each size in a
//! fresh child process (so its peak RSS is its own): read + parse the config
//! dir, validate, IPAM (allocate every address, persist the claims in the
//! redb store), plan, and write the maps the way `Dataplane::apply` does
//! (`BPF_MAP_UPDATE_BATCH`, one syscall per map and MiB). Ports are synthetic ifindexes: attaching a tcx
//! link needs a real interface, so link attachment is not in these figures
//! (it is in the latency figure). Baseline: the map writes alone.
//!
//! Batch: the same entries written again into emptied maps, one
//! `bpf(BPF_MAP_UPDATE_ELEM)` per entry against `BPF_MAP_UPDATE_BATCH`
//! (`vmpath::apply::dataplane::batch`; aya 0.14 has no batch map operations, so
//! vmpath issues the command itself).
//!
//! Latency: the real agent process; one Attachment file written per sample
//! for a port that exists, timed until its endpoint entry appears in the
//! pinned map. Baseline: the agent's config poll interval.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    fs,
    path::PathBuf,
    process::Command,
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use aya::{
    Pod,
    maps::{HashMap, IterableMap as _, MapData, PerCpuValues},
};
use serde_json::json;
use vmpath::{
    apply::dataplane::{
        Dataplane, Maps,
        batch::{delete_batch, update_batch, update_batch_per_cpu},
    },
    config, plan,
    resolve::ipam,
    resolve::resolved::Resolved,
    resolve::store::Store,
};
use vmpath_common::{
    AddrInfo, AddrKey, Endpoint, EndpointKey, FloodList, MAX_ADDRESSES, MAX_ENDPOINTS, MAX_PORT_ID,
    MAX_PORTS, NetworkInfo, PortInfo, PortStats,
};
use vmpath_tests::{Node, yaml};

use crate::{
    report::{Bar, Section},
    util::{self, fmt, fmt_summary, percentile, summary},
};

pub struct Options {
    pub runs: usize,
    pub sizes: Vec<usize>,
    pub latency_samples: usize,
    /// Time limit of one size's run (the largest may not finish).
    pub limit: Duration,
}

const PER_NETWORK: usize = 50;
const STAGES: [&str; 7] = [
    "read+parse",
    "validate",
    "ipam",
    "claims store",
    "plan",
    "map writes",
    "total",
];

fn config_text(n: usize) -> String {
    let nets = n.div_ceil(PER_NETWORK);
    let mut s = String::with_capacity(n * 260);
    for j in 0..nets {
        let (a, b) = ((j >> 8) & 255, j & 255);
        let _ = write!(
            s,
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: net{j}}}\nspec:\n  id: {}\n  subnets: [10.{a}.{b}.0/24]\n  defaultGatewayIPs: [10.{a}.{b}.1]\n  ipam: {{mode: Enabled}}\n---\n",
            j + 1
        );
    }
    for i in 0..n {
        let _ = write!(
            s,
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: vm{i}-eth0, namespace: bench}}\nspec:\n  vm: vm{i}\n  interface: eth0\n  network: net{}\n  node: node-a\n  port: p{i}\n  mac: \"02:00:00:{:02x}:{:02x}:{:02x}\"\n---\n",
            i / PER_NETWORK,
            (i >> 16) & 255,
            (i >> 8) & 255,
            i & 255
        );
    }
    s
}

/// One measurement in this (fresh) process; prints `RESULT {json}`.
pub fn child(n: usize) -> Result<()> {
    let work = std::env::temp_dir().join(format!("vmpath-bench-cp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    let cfg_dir = work.join("config");
    fs::create_dir_all(&cfg_dir)?;
    fs::write(cfg_dir.join("config.yaml"), config_text(n))?;
    let root = PathBuf::from(format!(
        "/sys/fs/bpf/vmpath-bench-cp-{}",
        std::process::id()
    ));
    let result = (|| -> Result<serde_json::Value> {
        let mut dp = Dataplane::open(&root)?;
        let store = Store::open(&work.join("state"))?;
        let hwm_start = util::rss_kb("self").0;
        let mut t = Vec::new();
        let t0 = Instant::now();
        let snap = config::source::read_dir(&cfg_dir);
        t.push(t0.elapsed());
        stage(&t);
        let t1 = Instant::now();
        let validated = vmpath::round::validate(&snap, "node-a", &BTreeSet::new());
        t.push(t1.elapsed());
        stage(&t);
        if !validated.errors.is_empty() {
            bail!(
                "{} documents refused, first: {}",
                validated.errors.len(),
                validated.errors[0]
            );
        }
        let t2 = Instant::now();
        let mut cfg = Resolved::new(validated);
        let changes = ipam::assign(&mut cfg, &BTreeMap::new());
        t.push(t2.elapsed());
        stage(&t);
        let t3 = Instant::now();
        store.apply(&changes)?;
        t.push(t3.elapsed());
        stage(&t);
        let t4 = Instant::now();
        let p = plan::plan(&cfg, "node-a", |name| {
            name.strip_prefix('p')
                .and_then(|i| i.parse::<u32>().ok())
                .map(|i| i + 1)
        });
        t.push(t4.elapsed());
        stage(&t);
        let t5 = Instant::now();
        let written = write_maps(&mut dp, &p)?;
        t.push(t5.elapsed());
        t.push(t0.elapsed());
        let hwm_end = util::rss_kb("self").0;
        // After the RSS figures: not part of the pipeline.
        let batch = compare_batch(&mut dp)?;
        Ok(json!({
            "n": n,
            "attachments": cfg.attachments.len(),
            "claims": changes.len(),
            "stages_ms": t.iter().map(|d| d.as_secs_f64() * 1e3).collect::<Vec<_>>(),
            "written": written,
            "hwm_start_kb": hwm_start,
            "hwm_end_kb": hwm_end,
            "batch": batch,
        }))
    })();
    let _ = vmpath::apply::dataplane::cleanup(&root);
    let _ = fs::remove_dir(&root);
    let _ = fs::remove_dir_all(&work);
    println!("RESULT {}", result?);
    Ok(())
}

/// Progress for the parent: which stage finished, after how long.
fn stage(t: &[Duration]) {
    use std::io::Write as _;
    println!(
        "STAGE {} {:.1}",
        STAGES[t.len() - 1],
        t.last().unwrap().as_secs_f64() * 1e3
    );
    let _ = std::io::stdout().flush();
}

fn pairs<K: Copy, V: Copy>(m: &std::collections::BTreeMap<K, V>) -> Vec<(K, V)> {
    m.iter().map(|(k, v)| (*k, *v)).collect()
}

/// The plan's entries written as `Dataplane::apply` writes them: one
/// `BPF_MAP_UPDATE_BATCH` per map (and MiB). A full map stops its batch at
/// the first entry it refuses; what it took is counted, not fatal.
fn write_maps(dp: &mut Dataplane, p: &plan::Plan) -> Result<serde_json::Value> {
    let nr_cpus = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
    let maps = dp.maps_mut();
    let mut out = serde_json::Map::new();
    let mut count = |name: &str,
                     written: Result<usize, vmpath::apply::dataplane::batch::BatchError>,
                     want: usize| {
        let ok = written.unwrap_or_else(|e| e.written());
        out.insert(name.into(), json!([ok, want]));
    };
    count(
        "networks",
        update_batch(maps.networks.map(), &pairs(&p.networks), 0),
        p.networks.len(),
    );
    count(
        "flood",
        update_batch(maps.flood.map(), &pairs(&p.flood), 0),
        p.flood.len(),
    );
    count(
        "addresses",
        update_batch(maps.addresses.map(), &pairs(&p.addresses.to_map()), 0),
        p.addresses.len(),
    );
    count(
        "endpoints",
        update_batch(maps.endpoints.map(), &pairs(&p.endpoints.to_map()), 0),
        p.endpoints.len(),
    );
    let zero = vec![PortStats::default(); nr_cpus];
    let slots: Vec<(u32, &[PortStats])> = p
        .ports
        .values()
        .map(|v| (v.info.port_id, &zero[..]))
        .collect();
    count(
        "port_stats",
        update_batch_per_cpu(maps.port_stats.map(), &slots, 0),
        p.ports.len(),
    );
    let ports: Vec<(u32, PortInfo)> = p.ports.iter().map(|(k, v)| (*k, v.info)).collect();
    count(
        "ports",
        update_batch(maps.ports.map(), &ports, 0),
        p.ports.len(),
    );
    let ids: Vec<(u32, u32)> = p.ports.iter().map(|(k, v)| (v.info.port_id, *k)).collect();
    count(
        "port_ids",
        update_batch(maps.port_ids.map(), &ids, 0),
        p.ports.len(),
    );
    Ok(serde_json::Value::Object(out))
}

/// Alternating per-entry and batch passes per size.
const BATCH_REPS: usize = 7;

/// What the pipeline's map writes left in the maps: the planned entries
/// the maps accept.
struct Written {
    networks: Vec<(u32, NetworkInfo)>,
    flood: Vec<(u32, FloodList)>,
    addresses: Vec<(AddrKey, AddrInfo)>,
    endpoints: Vec<(EndpointKey, Endpoint)>,
    port_stats: Vec<u32>,
    ports: Vec<(u32, PortInfo)>,
    port_ids: Vec<(u32, u32)>,
}

impl Written {
    fn len(&self) -> usize {
        self.networks.len()
            + self.flood.len()
            + self.addresses.len()
            + self.endpoints.len()
            + self.port_stats.len()
            + self.ports.len()
            + self.port_ids.len()
    }
}

fn entries<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Result<Vec<(K, V)>> {
    Ok(map.iter().collect::<Result<_, _>>()?)
}

fn clear<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>, entries: &[(K, V)]) -> Result<()> {
    let keys: Vec<K> = entries.iter().map(|(k, _)| *k).collect();
    delete_batch(map.map(), &keys)?;
    Ok(())
}

fn insert_each<K: Pod, V: Pod>(map: &mut HashMap<MapData, K, V>, entries: &[(K, V)]) -> Result<()> {
    for (k, v) in entries {
        map.insert(k, v, 0)?;
    }
    Ok(())
}

fn check_written<K, V>(map: &HashMap<MapData, K, V>, entries: &[(K, V)], name: &str) -> Result<()>
where
    K: Pod,
    V: Pod + PartialEq,
{
    ensure!(
        map.keys().count() == entries.len(),
        "{name}: {} entries after the batch, want {}",
        map.keys().count(),
        entries.len()
    );
    for (k, v) in entries {
        ensure!(
            map.get(k, 0)? == *v,
            "{name}: an entry differs after the batch"
        );
    }
    Ok(())
}

/// Writes the entries the pipeline wrote again into emptied maps, once
/// one `BPF_MAP_UPDATE_ELEM` per entry and
/// once with `update_batch` (one `BPF_MAP_UPDATE_BATCH` per map and MiB),
/// alternately `BATCH_REPS` times; checks the batch's result.
fn compare_batch(dp: &mut Dataplane) -> Result<serde_json::Value> {
    let nr_cpus = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
    let maps = dp.maps_mut();
    let w = Written {
        networks: entries(&maps.networks)?,
        flood: entries(&maps.flood)?,
        addresses: entries(&maps.addresses)?,
        endpoints: entries(&maps.endpoints)?,
        // Indexed by port id (a per-CPU array): the slots of the ports.
        port_stats: entries(&maps.ports)?
            .iter()
            .map(|(_, p)| p.port_id)
            .collect(),
        ports: entries(&maps.ports)?,
        port_ids: entries(&maps.port_ids)?,
    };
    let zero = vec![PortStats::default(); nr_cpus];
    let stats: Vec<(u32, &[PortStats])> = w.port_stats.iter().map(|k| (*k, &zero[..])).collect();
    let clear_all = |maps: &mut Maps| -> Result<()> {
        clear(&maps.networks, &w.networks)?;
        clear(&maps.flood, &w.flood)?;
        clear(&maps.addresses, &w.addresses)?;
        clear(&maps.endpoints, &w.endpoints)?;
        // Array slots cannot be deleted; both ways overwrite them.
        clear(&maps.ports, &w.ports)?;
        clear(&maps.port_ids, &w.port_ids)?;
        Ok(())
    };
    let (mut per_entry, mut batched) = (Vec::new(), Vec::new());
    for _ in 0..BATCH_REPS {
        clear_all(maps)?;
        let t = Instant::now();
        insert_each(&mut maps.networks, &w.networks)?;
        insert_each(&mut maps.flood, &w.flood)?;
        insert_each(&mut maps.addresses, &w.addresses)?;
        insert_each(&mut maps.endpoints, &w.endpoints)?;
        for k in &w.port_stats {
            let zero = PerCpuValues::try_from(vec![PortStats::default(); nr_cpus])?;
            maps.port_stats.set(*k, zero, 0)?;
        }
        insert_each(&mut maps.ports, &w.ports)?;
        insert_each(&mut maps.port_ids, &w.port_ids)?;
        per_entry.push(t.elapsed().as_secs_f64() * 1e3);

        clear_all(maps)?;
        let t = Instant::now();
        update_batch(maps.networks.map(), &w.networks, 0)?;
        update_batch(maps.flood.map(), &w.flood, 0)?;
        update_batch(maps.addresses.map(), &w.addresses, 0)?;
        update_batch(maps.endpoints.map(), &w.endpoints, 0)?;
        update_batch_per_cpu(maps.port_stats.map(), &stats, 0)?;
        update_batch(maps.ports.map(), &w.ports, 0)?;
        update_batch(maps.port_ids.map(), &w.port_ids, 0)?;
        batched.push(t.elapsed().as_secs_f64() * 1e3);
    }
    check_written(&maps.networks, &w.networks, "networks")?;
    check_written(&maps.flood, &w.flood, "flood")?;
    check_written(&maps.addresses, &w.addresses, "addresses")?;
    check_written(&maps.endpoints, &w.endpoints, "endpoints")?;
    check_written(&maps.ports, &w.ports, "ports")?;
    check_written(&maps.port_ids, &w.port_ids, "port_ids")?;
    for k in &w.port_stats {
        let v = maps.port_stats.get(k, 0)?;
        ensure!(
            v.len() == nr_cpus && v.iter().all(|s| s == &PortStats::default()),
            "port_stats: an entry differs after the batch"
        );
    }
    Ok(json!({
        "entries": w.len(),
        "per_entry_ms": per_entry,
        "batch_ms": batched,
    }))
}

/// Runs one size in a fresh process; `Err` names the stage it was in
/// when `limit` ran out.
fn run_child(n: usize, limit: Duration) -> Result<serde_json::Value> {
    use std::io::BufRead as _;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["control-child", &n.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(|l| l.ok())
        {
            let _ = tx.send(line);
        }
    });
    let start = Instant::now();
    let mut done = Vec::new();
    loop {
        while let Ok(line) = rx.try_recv() {
            if let Some(r) = line.strip_prefix("RESULT ") {
                let _ = child.wait();
                let _ = reader.join();
                return Ok(serde_json::from_str(r)?);
            }
            if let Some(st) = line.strip_prefix("STAGE ") {
                done.push(st.to_string());
            }
        }
        if let Some(status) = child.try_wait()? {
            // Drain what is left.
            let _ = reader.join();
            while let Ok(line) = rx.try_recv() {
                if let Some(r) = line.strip_prefix("RESULT ") {
                    return Ok(serde_json::from_str(r)?);
                }
            }
            bail!("control-child {n} exited ({status}) without a result");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let next = STAGES.get(done.len()).copied().unwrap_or("?");
            bail!(
                "stopped after {} s in stage `{next}` (finished: {})",
                limit.as_secs(),
                if done.is_empty() {
                    "none".to_string()
                } else {
                    done.join(" ms, ") + " ms"
                }
            );
        }
        sleep(Duration::from_millis(20));
    }
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut md = String::new();
    let mut bars = Vec::new();
    md.push_str(&format!(
        "**Scale.** N attachments, {PER_NETWORK} per network (a network floods to at \
         most 64 local ports), every address allocated by IPAM, each size in a fresh \
         process ({} runs per size, 1 for 100,000): read + parse the YAML config dir, validate, \
         IPAM, persist the claims (redb), plan, then write every planned map entry \
         the way `Dataplane::apply` does, one `BPF_MAP_UPDATE_BATCH` per map \
         (against one `bpf(BPF_MAP_UPDATE_ELEM)` per entry below). Ports get synthetic \
         ifindexes, so no tcx link is attached here. Baseline: the map writes alone. \
         Memory: the process's peak RSS (`VmHWM`) at the end, and its growth from \
         before the config was read (after loading the data path).\n\n",
        opts.runs
    ));
    md.push_str("| N | ");
    for s in STAGES {
        let _ = write!(md, "{s} ms | ");
    }
    md.push_str("µs per attachment | total ÷ map writes | peak RSS MiB | RSS growth MiB | map entries written / planned |\n|");
    md.push_str(&"---|".repeat(STAGES.len() + 6));
    md.push('\n');
    let mut batch_md = String::new();
    for &n in &opts.sizes {
        let mut stages: Vec<Vec<f64>> = vec![Vec::new(); STAGES.len()];
        let (mut per_entry, mut batched, mut entries) = (Vec::new(), Vec::new(), 0);
        let mut hwm = Vec::new();
        let mut growth = Vec::new();
        let mut written = String::new();
        let mut failed = None;
        // The largest size runs once: it takes minutes.
        let runs = if n >= 100_000 { 1 } else { opts.runs };
        for _ in 0..runs {
            let r = match run_child(n, opts.limit) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("bench:   control plane N={n}: {e:#}");
                    failed = Some(e);
                    break;
                }
            };
            for (i, v) in r["stages_ms"].as_array().unwrap().iter().enumerate() {
                stages[i].push(v.as_f64().unwrap());
            }
            let (s, e) = (
                r["hwm_start_kb"].as_f64().unwrap(),
                r["hwm_end_kb"].as_f64().unwrap(),
            );
            hwm.push(e / 1024.0);
            growth.push((e - s) / 1024.0);
            let b = &r["batch"];
            entries = b["entries"].as_u64().unwrap();
            for (out, k) in [(&mut per_entry, "per_entry_ms"), (&mut batched, "batch_ms")] {
                out.extend(b[k].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()));
            }
            written = r["written"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let (ok, want) = (v[0].as_u64().unwrap(), v[1].as_u64().unwrap());
                    if ok < want {
                        format!("**{k} {ok}/{want}**")
                    } else {
                        format!("{k} {ok}")
                    }
                })
                .collect::<Vec<_>>()
                .join(", ");
            eprintln!("bench:   control plane N={n}: {:?}", r["stages_ms"]);
        }
        if let Some(e) = failed {
            let _ = writeln!(
                md,
                "| {n} | {} |",
                format!("not finished: {e:#}") + &" |".repeat(STAGES.len() + 4)
            );
            let _ = writeln!(batch_md, "| {n} | not finished | | | | | |");
            continue;
        }
        let sums: Vec<_> = stages.iter().map(|v| summary(v)).collect();
        let total = &sums[STAGES.len() - 1];
        let maps_ms = &sums[5];
        let _ = write!(md, "| {n} | ");
        for s in &sums {
            let _ = write!(md, "{} | ", fmt_summary(s));
        }
        let _ = writeln!(
            md,
            "{} | {} | {} | {} | {} |",
            fmt(total.median * 1e3 / n as f64),
            fmt(total.median / maps_ms.median),
            fmt_summary(&summary(&hwm)),
            fmt_summary(&summary(&growth)),
            written
        );
        bars.push(Bar {
            label: format!("program {n} attachments: total"),
            ratio: total.median / maps_ms.median,
            baseline: "map writes alone".into(),
        });
        let (pe, ba) = (summary(&per_entry), summary(&batched));
        let _ = writeln!(
            batch_md,
            "| {n} | {entries} | {} | {} | {} | {} | {} |",
            fmt_summary(&pe),
            fmt_summary(&ba),
            fmt(ba.median / pe.median),
            fmt(pe.median * 1e6 / entries as f64),
            fmt(ba.median * 1e6 / entries as f64),
        );
        bars.push(Bar {
            label: format!("map writes {n} attachments: batch"),
            ratio: ba.median / pe.median,
            baseline: "one bpf() per entry".into(),
        });
    }
    let _ = writeln!(
        md,
        "\nLimits: a node serves at most `MAX_PORT_ID` = {MAX_PORT_ID} VM ports (the slow \
         path's 12-bit tag; `MAX_PORTS` = {MAX_PORTS} sizes the ports, port_stats and \
         port_ids maps), so from 10,000 attachments on one node the plan itself refuses \
         the rest (\"no free port id\", a config problem the agent reports) and only \
         their entries are written; counts the kernel refuses (E2BIG) would show in bold; \
         `MAX_ENDPOINTS` = {MAX_ENDPOINTS} and `MAX_ADDRESSES` = \
         {MAX_ADDRESSES} cap 100,000. One node never hosts that many VM ports; the \
         100,000 figure shows how validation, IPAM and plan scale with the cluster's \
         config, which every agent reads whole.\n"
    );
    let _ = writeln!(
        md,
        "\n**Map writes, per entry vs batch.** aya 0.14 has no batch map operations; \
         vmpath issues `BPF_MAP_UPDATE_BATCH` itself (`vmpath::apply::dataplane::batch`, one \
         syscall per map and MiB of keys and values, per-entry fallback where the kernel \
         lacks it). In the same process after the figures above: the entries the map \
         writes left in the maps (the planned entries the maps accept) written again \
         into emptied maps, alternately one `bpf(BPF_MAP_UPDATE_ELEM)` per entry (as \
         `Dataplane::apply` did before) and one `BPF_MAP_UPDATE_BATCH` per map (as it \
         does now), {BATCH_REPS} \
         times each per run; the batch's result is read back and checked. \
         Baseline: the per-entry writes.\n\n\
         | N | entries | per entry ms | batch ms | batch ÷ per-entry | ns per entry, per entry | ns per entry, batch |\n\
         |---|---|---|---|---|---|---|\n{batch_md}"
    );

    // Latency with the real agent.
    let lat = latency(opts.latency_samples)?;
    let p50 = percentile(&lat.samples, 50.0);
    let p99 = percentile(&lat.samples, 99.0);
    let _ = writeln!(
        md,
        "\n**Config change to map updated** (real agent process, release build, \
         `--interval-ms {}`): {} samples, each writes one new Attachment file (write + \
         rename, as a ConfigMap update) for a port that exists, then polls the pinned \
         `vmp_endpoints` map every 1 ms until its entry appears. The agent is woken by \
         the config dir's notifications (inotify), not a poll (section 6 compares the \
         two). Baseline: the agent's tick interval, which bounded this latency when it \
         polled.\n\n\
         | p50 ms | p99 ms | min–max ms | p50 ÷ interval | p99 ÷ interval | agent peak RSS at the end ({} ports) |\n|---|---|---|---|---|---|\n\
         | {} | {} | {}–{} | {} | {} | {} MiB |\n",
        lat.interval_ms,
        lat.samples.len(),
        lat.samples.len() + 1,
        fmt(p50),
        fmt(p99),
        fmt(summary(&lat.samples).min),
        fmt(summary(&lat.samples).max),
        fmt(p50 / lat.interval_ms),
        fmt(p99 / lat.interval_ms),
        fmt(lat.agent_hwm_kb as f64 / 1024.0),
    );
    bars.push(Bar {
        label: "config change -> map updated, p50".into(),
        ratio: p50 / lat.interval_ms,
        baseline: "agent poll interval".into(),
    });
    bars.push(Bar {
        label: "config change -> map updated, p99".into(),
        ratio: p99 / lat.interval_ms,
        baseline: "agent poll interval".into(),
    });
    Ok(Section {
        title: "3. Control plane".into(),
        markdown: md,
        bars,
    })
}

struct Latency {
    samples: Vec<f64>,
    interval_ms: f64,
    agent_hwm_kb: u64,
}

/// The agent's pid: the process whose command line names this bpffs root.
pub(crate) fn agent_pid(node: &Node) -> Option<String> {
    let needle = node.bpffs.to_string_lossy().to_string();
    fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok())
        .find_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            if !name.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            let cmd = fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("vmpath")
                && cmd.contains(" agent ")
                && cmd.contains(&needle)
                && !cmd.starts_with("nsenter"))
            .then_some(name)
        })
}

fn latency(samples: usize) -> Result<Latency> {
    let mut node = Node::new("c");
    for i in 0..=samples {
        let p = format!("cp{i}");
        node.ns.run(&[
            "ip",
            "link",
            "add",
            &p,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{p}v"),
        ]);
        node.ns.run(&["ip", "link", "set", &p, "up"]);
    }
    let mac = |i: usize| format!("52:54:00:cc:{:02x}:{:02x}", i >> 8, i & 255);
    let ip = |i: usize| format!("10.20.{}.{}/16", 1 + i / 200, 1 + i % 200);
    node.write_config(
        "network.yaml",
        &yaml::docs(&[
            yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
            yaml::attachment("vm0", "blue", "c", "cp0", &mac(0), &[&ip(0)]),
        ]),
    );
    // Its ports are named outside the default port pattern.
    node.set_agent_args(&["--port-pattern", "cp*"]);
    node.start_agent();
    node.wait_ports(&["cp0"]);
    let maps = Maps::open(&node.bpffs)?;
    let mut out = Vec::new();
    for i in 1..=samples {
        let m = config::parse_mac(&mac(i)).map_err(|e| anyhow!(e))?;
        let key = EndpointKey {
            network: 100,
            mac: m,
            _pad: [0; 2],
        };
        sleep(Duration::from_millis(37)); // de-phase from the poll loop
        let t = Instant::now();
        node.write_config(
            &format!("vm{i}.yaml"),
            &yaml::attachment(
                &format!("vm{i}"),
                "blue",
                "c",
                &format!("cp{i}"),
                &mac(i),
                &[&ip(i)],
            ),
        );
        loop {
            if maps.endpoints.get(&key, 0).is_ok() {
                break;
            }
            if t.elapsed() > Duration::from_secs(10) {
                bail!(
                    "attachment vm{i} never reached the map; agent log:\n{}",
                    node.agent_log()
                );
            }
            sleep(Duration::from_millis(1));
        }
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let pid = agent_pid(&node).context("finding the agent process")?;
    let hwm = util::rss_kb(&pid).0;
    Ok(Latency {
        samples: out,
        interval_ms: 100.0,
        agent_hwm_kb: hwm,
    })
}
