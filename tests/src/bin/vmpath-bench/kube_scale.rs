//! The Kubernetes source at cluster scale: `vmpath agent --source
//! kubernetes` against the test bed's API server (`vmpath_tests::kube_api`,
//! in memory, real HTTP, kube-rs watchers) holding N KubeVirt VMs (VMI,
//! virt-launcher pod, IPAMClaim each) spread over 200 nodes, a few on this
//! node.
//!
//! Memory: the agent's peak and current RSS once it has derived its own
//! node's VMs, against the same agent reading the same objects from files
//! (`--source files`), which holds no watch caches.
//!
//! Latency: a new VM on this node, at N VMs in the cluster: from its
//! objects' creation (IPAMClaim, VMI, pod, as KubeVirt and ipam-extensions
//! create them) to the CNI ADD of its pod returning (the plugin answers once
//! the agent has programmed the port), the ADD started right after the
//! objects, as the kubelet does once the pod is bound. Baseline: the ADD of
//! a VM whose objects the agent already had.
//!
//! Allocation rate: `vmpath controller` (leading, idle) and N IPAMClaims
//! created at once: claims per second from their creation to the last
//! one's `status.ips` written.

use std::{
    fmt::Write as _,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::Value;
use vmpath_tests::{Netns, Node, kube_api::ApiServer, multus, unique_tag, vmpath_bin, wait_for};

use crate::{
    report::{Bar, Section},
    util::{fmt, percentile, rss_kb},
};

pub struct Options {
    /// Cluster sizes for the memory figure.
    pub sizes: Vec<usize>,
    /// The size the latency is measured at, and its samples.
    pub latency_at: usize,
    pub samples: usize,
    /// Batches of new claims for the allocation rate.
    pub claims: Vec<usize>,
}

pub(crate) const NETWORK: &str = include_str!("../../../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../../../agent/src/derive/fixtures/vm.yaml");
/// KubeVirt's pod interface name for network `blue` (a hash of its name).
const POD_IFNAME: &str = "pod16477688c0e";
/// Nodes the VMs are spread over, and how many are on this node ("a"),
/// as issue 34 shapes the cluster: N VMs over 200 nodes, 50 of them here
/// (the latency figure adds two per sample), and 100,000 over 1,000
/// nodes ([`nodes`]).
pub(crate) const NODES: usize = 200;
pub(crate) const LOCAL: usize = 50;
/// From this many VMs on, the cluster has [`NODES_AT_SCALE`] nodes.
const AT_SCALE: usize = 100_000;
pub(crate) const NODES_AT_SCALE: usize = 1_000;

/// How many nodes a cluster of `n` VMs has.
pub(crate) fn nodes(n: usize) -> usize {
    if n >= AT_SCALE { NODES_AT_SCALE } else { NODES }
}

/// The bench's Network: the fixture's, with a /14 for 100,000 VMs, and
/// `nodes` v1 Nodes besides this one.
fn network_objects(nodes: usize) -> Vec<Value> {
    let text = NETWORK
        .replace("10.31.0.0/24", "10.32.0.0/14")
        .replace("10.31.0.1", "10.32.0.1");
    let mut out = vmpath::config::source::parse(text.as_bytes()).expect("network fixture");
    // Every node of the cluster has its v1 Node, as in a real cluster (the
    // fixture's is node-a's): without them every other node's VM is a
    // problem the agent reports, each round, instead of an overlay entry.
    out.retain(|o| o["kind"] != "Node");
    out.extend(
        std::iter::once("a".to_string())
            .chain((0..nodes).map(|k| format!("n{k}")))
            .enumerate()
            .map(|(k, name)| node_object(&name, k)),
    );
    out
}

/// The underlay of the bench's cluster: node k's InternalIP is
/// 192.168.64.0/18's address k + 1 ("a" is k = 0, on one end of a veth
/// pair whose other end is in the same namespace, with no address: this
/// kernel has no dummy links. Nothing sent to another node's address
/// leaves the namespace).
const UNDERLAY: &str = "192.168.64.0/18";

fn underlay_address(k: usize) -> String {
    let k = k + 1;
    format!("192.168.{}.{}", 64 + k / 256, k % 256)
}

fn node_object(name: &str, k: usize) -> Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "status": {"addresses": [
            {"type": "InternalIP", "address": underlay_address(k)},
            {"type": "Hostname", "address": name},
        ]},
    })
}

/// Node "a"'s underlay address (see [`UNDERLAY`]).
pub(crate) fn join_underlay(node: &Node) {
    node.ns.run(&[
        "ip",
        "link",
        "add",
        "underlay",
        "type",
        "veth",
        "peer",
        "name",
        "underlay-end",
    ]);
    node.ns.run(&["ip", "link", "set", "underlay-end", "up"]);
    node.ns.run(&["ip", "link", "set", "underlay", "up"]);
    let prefix = UNDERLAY.split('/').nth(1).expect("a prefix");
    node.ns.run(&[
        "ip",
        "addr",
        "add",
        &format!("{}/{prefix}", underlay_address(0)),
        "dev",
        "underlay",
    ]);
}

/// VM `i`'s VMI, virt-launcher pod and IPAMClaim, on `node`.
pub(crate) fn vm_objects(i: usize, node: &str) -> Vec<Value> {
    let (hi, lo) = (i / 250, i % 250 + 2);
    let (b, c) = (32 + hi / 256, hi % 256);
    let text = VM
        .replace("10.31.0.11/24", &format!("10.{b}.{c}.{lo}/14"))
        .replace("02:00:00:31:00:0b", &mac(i))
        .replace("node-a", node)
        .replace("5d1c5a3e", &format!("{i:08x}"))
        .replace("2a7e0c4b", &format!("{:08x}", i + 0x1000_0000))
        .replace("9e8d7c6b", &format!("{:08x}", i + 0x2000_0000))
        .replace("vm1", &format!("vm{i}"));
    let mut objects = vmpath::config::source::parse(text.as_bytes()).expect("vm fixture");
    // The API server gives every object a uid (the fixture's claim, read
    // from a file, needs none): the agent keeps each claim's, and the
    // ledger one per address.
    for o in &mut objects {
        if o["kind"] == "IPAMClaim" {
            o["metadata"]["uid"] = format!("3c9e1f7a-6b2d-4e8c-a5f1-{i:012x}").into();
        }
    }
    objects
}

fn mac(i: usize) -> String {
    format!(
        "02:00:{:02x}:32:{:02x}:{:02x}",
        (i >> 16) & 0xff,
        (i >> 8) & 0xff,
        i & 0xff
    )
}

pub(crate) fn node_of(i: usize, n: usize) -> String {
    let every = (n / LOCAL).max(1);
    if i.is_multiple_of(every) {
        "a".into()
    } else {
        format!("n{}", i % nodes(n))
    }
}

/// The Network and N VMs spread over the nodes.
pub(crate) fn cluster_objects(n: usize) -> Vec<Value> {
    network_objects(nodes(n))
        .into_iter()
        .chain((0..n).flat_map(|i| vm_objects(i, &node_of(i, n))))
        .collect()
}

/// Node "a" with an API server holding `objects`, its agent pointed at it
/// (not started).
pub(crate) fn kube_node(objects: &[Value]) -> (Node, ApiServer) {
    let mut node = Node::new("a");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    join_underlay(&node);
    let server = ApiServer::start(&node.ns.path());
    for o in objects {
        server.put(o.clone());
    }
    // The claims as vmpath controller allocated them, in its ledger.
    server.vouch_for_claims();
    server.serve_agent_of(&mut node);
    (node, server)
}

/// VM `i`'s interface as the agent's status lists it.
pub(crate) fn derived(node: &Node, vm: &str) -> bool {
    node.attachment_view(vm).is_some()
}

/// Starts the agent on `node` and waits until it has derived every local
/// VM; returns (peak, current) RSS in MiB.
pub(crate) fn settle(node: &mut Node, n: usize) -> Result<(f64, f64)> {
    node.start_agent();
    let locals: Vec<String> = (0..n)
        .filter(|&i| node_of(i, n) == "a")
        .map(|i| format!("vm{i}"))
        .collect();
    let started = Instant::now();
    while !locals.iter().all(|vm| derived(node, vm)) {
        if started.elapsed() > Duration::from_secs(300) {
            bail!("the agent did not derive its {} VMs in 300 s", locals.len());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Let the first rounds' garbage go before reading the resident size.
    std::thread::sleep(Duration::from_secs(2));
    let pid = node.agent_pid().context("agent pid")?.to_string();
    let (hwm, rss) = rss_kb(&pid);
    Ok((hwm as f64 / 1024.0, rss as f64 / 1024.0))
}

/// Peak and current RSS (MiB) of an agent holding `n` VMs, from the API
/// server and from files.
fn memory(n: usize) -> Result<[(f64, f64); 2]> {
    let objects = cluster_objects(n);
    let (mut node, server) = kube_node(&objects);
    let kube = settle(&mut node, n)?;
    drop(node);
    drop(server);

    let mut node = files_node(&objects);
    let files = settle(&mut node, n)?;
    Ok([kube, files])
}

/// Node "a" with the cluster's `objects` in files: every object but other
/// nodes' pods (what the watches hold), 300 a file (under the reader's
/// 1 MiB limit).
pub(crate) fn files_node(objects: &[Value]) -> Node {
    let node = Node::new("a");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    join_underlay(&node);
    let text: Vec<String> = objects
        .iter()
        .filter(|o| o["kind"] != "Pod" || o["spec"]["nodeName"] == "a")
        .map(Value::to_string)
        .collect();
    for (k, chunk) in text.chunks(300).enumerate() {
        node.write_config(&format!("cluster-{k:04}.yaml"), &chunk.join("\n---\n"));
    }
    node
}

/// Creates VM `i` on `node`: its IPAMClaim first, allocated (the test
/// API server's ledger vouches for it, as vmpath controller's does before
/// the pod can start), then, with the clock started, its VMI and pod.
/// Returns when the clock started.
pub(crate) fn create_vm(server: &ApiServer, i: usize, node: &str) -> Instant {
    let (claims, rest): (Vec<Value>, Vec<Value>) = vm_objects(i, node)
        .into_iter()
        .partition(|o| o["kind"] == "IPAMClaim");
    for o in claims {
        server.put(o);
    }
    server.vouch_for_claims();
    let started = Instant::now();
    for o in rest.into_iter().rev() {
        server.put(o);
    }
    started
}

/// CNI ADD of VM `i`'s pod on `node`: ms from `since` to its answer.
/// The sandbox of vm`i`'s pod, as the runtime makes it before the ADD
/// (not on the ADD's clock: three processes of its own).
pub(crate) fn pod_netns(i: usize) -> Netns {
    Netns::new(format!("vt{}-l{i}", unique_tag()))
}

/// vm`i`'s ADD into `netns`: the ms from `since` to its answer.
pub(crate) fn add(node: &Node, conf: &str, i: usize, netns: &Netns, since: Instant) -> Result<f64> {
    let (ok, result) = multus::call(
        node,
        "ADD",
        &multus::Call {
            conf,
            pod_namespace: "prod",
            pod: &format!("virt-launcher-vm{i}-x7k2p"),
            ifname: POD_IFNAME,
            netns,
            container: &format!("c{i}"),
        },
    );
    let ms = since.elapsed().as_secs_f64() * 1e3;
    ensure!(ok, "ADD of vm{i}: {result}");
    Ok(ms)
}

/// (objects -> ADD answered, ADD alone) in ms, `samples` of each, at `n`
/// VMs in the cluster.
fn latency(n: usize, samples: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut node, server) = kube_node(&cluster_objects(n));
    settle(&mut node, n)?;
    let conf = multus::nad_conf(NETWORK, &node);
    let (mut fresh, mut known) = (Vec::new(), Vec::new());
    for s in 0..samples {
        // Fresh: objects created, then the ADD at once.
        let i = n + 2 * s;
        let netns = pod_netns(i);
        let started = create_vm(&server, i, "a");
        fresh.push(add(&node, &conf, i, &netns, started)?);

        // Known: the agent has derived the VM before its ADD.
        let j = i + 1;
        create_vm(&server, j, "a");
        let vm = format!("vm{j}");
        wait_for(
            "the agent to derive the VM",
            Duration::from_secs(30),
            || derived(&node, &vm),
        );
        let netns = pod_netns(j);
        known.push(add(&node, &conf, j, &netns, Instant::now())?);
    }
    Ok((fresh, known))
}

const CLAIMS: &str = "/apis/k8s.cni.cncf.io/v1alpha1/ipamclaims";

/// A new IPAMClaim on network blue, as ipam-extensions makes one.
fn new_claim(i: usize) -> Value {
    serde_json::json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        // A UUID as the API server gives (the ledger's size depends on it).
        "metadata": {"name": format!("c{i}.blue"), "namespace": "prod",
                     "uid": format!("5f0c7a3e-9b1d-4e2a-8c6f-{i:012}")},
        "spec": {"network": "blue", "interface": POD_IFNAME},
    })
}

/// Seconds for a leading `vmpath controller` to allocate `n` claims
/// created at once, and the controller's peak RSS (MiB) once it has.
fn allocation(n: usize) -> Result<(f64, f64)> {
    let ns = Netns::new(format!("vb{}a{n}", unique_tag()));
    ns.run(&["ip", "link", "set", "lo", "up"]);
    let server = ApiServer::start(&ns.path());
    for o in network_objects(NODES) {
        server.put(o);
    }
    let dir = std::env::temp_dir().join(format!("vmpath-bench-{}", ns.name));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig())?;
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .arg(vmpath_bin())
        .arg("controller")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--namespace", "vmpath-system", "--identity", "bench"])
        .args(["--lease-duration", "15s", "--interval", "100ms"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting vmpath controller")?;
    let result = (|| {
        // Leading (its ledger written) before the claims come.
        wait_for("the controller to lead", Duration::from_secs(30), || {
            server
                .get("/api/v1/configmaps", "vmpath-system", "vmpath-ipam-ledger")
                .is_some()
        });
        let started = Instant::now();
        for i in 0..n {
            server.put(new_claim(i));
        }
        loop {
            let done = server
                .objects(CLAIMS)
                .iter()
                .filter(|c| c["status"]["ips"].as_array().is_some_and(|a| !a.is_empty()))
                .count();
            if done == n {
                let secs = started.elapsed().as_secs_f64();
                let (hwm, _) = rss_kb(&child.id().to_string());
                return Ok((secs, hwm as f64 / 1024.0));
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("{done} of {n} claims allocated in 600 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut md = format!(
        "`vmpath agent --source kubernetes` against the test bed's API server (in memory, \
         real HTTP; no kube-apiserver can run here), release build. N KubeVirt VMs (VMI, \
         virt-launcher pod, IPAMClaim each, shaped as KubeVirt, Multus and ipam-extensions \
         write them) over {NODES} nodes, {LOCAL} of them on this agent's node; the agent \
         watches every VMI, claim and NAD and its own node's pods.\n\n\
         **Memory** once the agent has derived its node's VMs (2 s after): peak (`VmHWM`) \
         and current (`VmRSS`) RSS. Baseline: the same agent reading the same objects from \
         one file (`--source files`, no watch caches). Goal: under 200 MB at 10,000 VMs.\n\n\
         | VMs in the cluster | peak RSS MiB | RSS MiB | files: peak RSS MiB | RSS MiB | peak ÷ files |\n\
         |---|---|---|---|---|---|\n"
    );
    let mut bars = Vec::new();
    for &n in &opts.sizes {
        let [kube, files] = memory(n).with_context(|| format!("memory at {n} VMs"))?;
        let ratio = kube.0 / files.0;
        let _ = writeln!(
            md,
            "| {n} | {} | {} | {} | {} | {} |",
            fmt(kube.0),
            fmt(kube.1),
            fmt(files.0),
            fmt(files.1),
            fmt(ratio)
        );
        bars.push(Bar {
            label: format!("agent peak RSS, {n} VMs, kube source"),
            ratio,
            baseline: "file source".into(),
        });
    }
    let (fresh, known) = latency(opts.latency_at, opts.samples)?;
    let ratio = percentile(&fresh, 50.0) / percentile(&known, 50.0);
    let _ = write!(
        md,
        "\n**Objects → programmed** at {} VMs, {} samples: a new VM on this node, its \
         IPAMClaim, VMI and pod created, then its pod's CNI ADD at once (as the kubelet \
         does once the pod is bound); the clock runs from the first create to the ADD's \
         answer, which comes once the agent has programmed the port. Baseline: the ADD of a \
         VM the agent had already derived.\n\n\
         | | p50 ms | p99 ms | max ms |\n|---|---|---|---|\n\
         | objects → programmed | {} | {} | {} |\n\
         | ADD alone (baseline) | {} | {} | {} |\n\n\
         Ratio of medians: {}.\n",
        opts.latency_at,
        opts.samples,
        fmt(percentile(&fresh, 50.0)),
        fmt(percentile(&fresh, 99.0)),
        fmt(percentile(&fresh, 100.0)),
        fmt(percentile(&known, 50.0)),
        fmt(percentile(&known, 99.0)),
        fmt(percentile(&known, 100.0)),
        fmt(ratio),
    );
    bars.push(Bar {
        label: format!("objects -> programmed at {} VMs, p50", opts.latency_at),
        ratio,
        baseline: "ADD of a known VM".into(),
    });
    if !opts.claims.is_empty() {
        let _ = write!(
            md,
            "\n**Controller allocation rate**: `vmpath controller` leading (round every \
             100 ms), then N IPAMClaims created at once on a /14 network; from the first \
             create to the last claim's `status.ips` written (one write per ledger shard changed in a round, \
             one status write per claim, each conditional). The controller's peak RSS \
             (`VmHWM`) once the last is written: its own memory at that many claims (the \
             Deployment's limit in deploy/ is 128Mi).\n\n\
             | new claims | seconds | claims/s | controller peak RSS MiB |\n|---|---|---|---|\n"
        );
        let mut rates = Vec::new();
        for &n in &opts.claims {
            let (secs, rss) = allocation(n).with_context(|| format!("allocating {n} claims"))?;
            let rate = n as f64 / secs;
            rates.push(rate);
            let _ = writeln!(md, "| {n} | {} | {} | {} |", fmt(secs), fmt(rate), fmt(rss));
        }
        if let (Some(first), Some(last)) = (rates.first(), rates.last())
            && rates.len() > 1
        {
            bars.push(Bar {
                label: format!(
                    "controller claims/s, {} new claims",
                    opts.claims.last().unwrap()
                ),
                ratio: last / first,
                baseline: format!("claims/s at {} claims", opts.claims[0]),
            });
        }
    }
    Ok(Section {
        title: "10. Kubernetes source at scale".into(),
        markdown: md,
        bars,
    })
}
