//! Figure group 11: what NetworkPolicy adds to a packet's cost. The same
//! L2 frame between two local endpoints, by BPF_PROG_TEST_RUN of the
//! VM-port program (a new flow's tail calls into `vm_policy_out` and
//! `vm_policy_in` included), with no policy and with 1,000 policies and
//! 10,000 identities, measured alternately in the same run. The policies
//! go through the agent's own pipeline (documents → validate → plan with
//! the policy compiler → `Dataplane::apply`), not hand-written entries.
//! Next to it, the same forward end to end: two agents (release build),
//! one without policy and one with the same 1,000 policies, each serving
//! two VM namespaces; 64-byte UDP from a raw socket in a, counted by b's
//! IP layer, in interleaved short slices as in section 2.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::programs::{TestRun, TestRunOptions};
use vmpath::{apply::dataplane::Dataplane, config, plan, resolve::resolved::Resolved};
use vmpath_tests::{Node, Vm};

use crate::{
    e2e::{Rate, pps, rate_rounds},
    progcost::{
        Root, SKB_CTX_LEN, SKB_IFINDEX, SKB_INGRESS_IFINDEX, TC_ACT_REDIRECT, in_private_netns, ip,
    },
    report::{Bar, Section},
    util::{self, Mac, fmt, fmt_summary, paired_ratio, summary},
};

const A_MAC: Mac = [0x52, 0x54, 0, 0, 0x11, 0x0a];
const B_MAC: Mac = [0x52, 0x54, 0, 0, 0x11, 0x0b];
const A_IP: [u8; 4] = [10, 0, 0, 10];
const B_IP: [u8; 4] = [10, 0, 0, 11];
const POLICIES: usize = 1_000;
/// ipBlocks per policy: one CIDR identity each.
const BLOCKS_PER_POLICY: usize = 10;

pub struct Options {
    pub runs: usize,
    pub repeat: u32,
    pub single_shots: usize,
    /// End to end: rounds of one slice per setup, and a slice's sending time.
    pub pps_rounds: usize,
    pub pps_slice: Duration,
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut section = in_private_netns(|| run_in_netns(opts))?;
    let (md, bar) = end_to_end(opts)?;
    section.markdown.push_str(&md);
    section.bars.push(bar);
    Ok(section)
}

fn mac(m: &Mac) -> String {
    util::mac_str(m)
}

/// The network (IPAM on, so port security is on as in section 1), the
/// namespace and the two endpoints (`a` sends to `b`).
fn base_docs() -> Vec<String> {
    docs_for("node-a", ["vpbpa", "vpbpb"])
}

/// `base_docs` for the node `node` with the ports `ports` (a's, b's).
fn docs_for(node: &str, ports: [&str; 2]) -> Vec<String> {
    let mut docs = vec![
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: pol}\nspec: {id: 100, subnets: [10.0.0.0/8], defaultGatewayIPs: [10.0.0.1], ipam: {mode: Enabled}}\n".to_string(),
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: bench}\n".to_string(),
    ];
    for ((name, m, ipaddr), port) in [("a", A_MAC, A_IP), ("b", B_MAC, B_IP)]
        .into_iter()
        .zip(ports)
    {
        docs.push(format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: bench, labels: {{app: {name}}}}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: pol\n  node: {node}\n  port: {port}\n  mac: \"{}\"\n  ips: [\"{}.{}.{}.{}/8\"]\n",
            mac(&m),
            ipaddr[0],
            ipaddr[1],
            ipaddr[2],
            ipaddr[3]
        ));
    }
    docs
}

/// 1,000 policies selecting `b`, each allowing UDP to one port from ten
/// /32 ipBlocks (10,000 CIDR identities), and the two that let `a`'s
/// frames through: egress from `a` to `b`, ingress to `b` from `a`.
fn policy_docs() -> Vec<String> {
    let mut docs = Vec::new();
    for i in 0..POLICIES {
        let blocks: Vec<String> = (0..BLOCKS_PER_POLICY)
            .map(|j| {
                let n = i * BLOCKS_PER_POLICY + j;
                format!(
                    "{{ipBlock: {{cidr: 10.{}.{}.{}/32}}}}",
                    1 + n / 65536,
                    (n / 256) % 256,
                    n % 256
                )
            })
            .collect();
        docs.push(format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{i}, namespace: bench}}\nspec:\n  podSelector: {{matchLabels: {{app: b}}}}\n  ingress: [{{from: [{}], ports: [{{protocol: UDP, port: {}}}]}}]\n",
            blocks.join(", "),
            10_000 + i
        ));
    }
    docs.push("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: from-a, namespace: bench}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: a}}}], ports: [{protocol: UDP, port: 9}]}]\n".into());
    docs.push("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: a-out, namespace: bench}\nspec:\n  podSelector: {matchLabels: {app: a}}\n  policyTypes: [Egress]\n  egress: [{to: [{podSelector: {matchLabels: {app: b}}}], ports: [{protocol: UDP, port: 9}]}]\n".into());
    docs
}

/// The agent's plan for `docs`, with the compile time.
fn plan_of(docs: &[String]) -> Result<(plan::Plan, f64)> {
    let text = docs.join("---\n");
    let values =
        config::source::parse(text.as_bytes()).map_err(|e| anyhow!("bench documents: {e}"))?;
    let snap = config::source::Snapshot {
        documents: values
            .into_iter()
            .enumerate()
            .map(|(i, value)| config::source::RawDocument {
                file: std::path::Path::new("bench.yaml").into(),
                index: i + 1,
                origin: vmpath::config::DocOrigin::Given,
                value: std::sync::Arc::new(value),
            })
            .collect(),
        ..Default::default()
    };
    let t = Instant::now();
    let validated = vmpath::round::validate(&snap, "node-a", &BTreeSet::new());
    if !validated.errors.is_empty() {
        bail!(
            "{} documents refused, first: {}",
            validated.errors.len(),
            validated.errors[0]
        );
    }
    let mut cfg = Resolved::new(validated);
    vmpath::resolve::ipam::assign(&mut cfg, &BTreeMap::new());
    let p = plan::plan(&cfg, "node-a", vmpath::sys::netif::ifindex_of);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !p.problems.is_empty() {
        bail!("plan problems: {:?}", p.problems);
    }
    Ok((p, ms))
}

fn run_in_netns(opts: &Options) -> Result<Section> {
    for p in ["vpbpa", "vpbpb"] {
        ip(&[
            "link",
            "add",
            p,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{p}-vm"),
        ])?;
        ip(&["link", "set", p, "up"])?;
        ip(&["link", "set", &format!("{p}-vm"), "up"])?;
    }
    let a = vmpath::sys::netif::ifindex_of("vpbpa").ok_or_else(|| anyhow!("no vpbpa"))?;
    let root = Root(PathBuf::from(format!(
        "/sys/fs/bpf/vmpath-bench-pol-{}",
        std::process::id()
    )));
    let mut dp = Dataplane::open(&root.0).context("loading the data path")?;

    let (bare, _) = plan_of(&base_docs())?;
    let mut with_docs = base_docs();
    with_docs.extend(policy_docs());
    let (policed, compile_ms) = plan_of(&with_docs)?;
    let identities: BTreeSet<u32> = policed.policy.ipcache.values().copied().collect();
    let rules = policed.policy.rules.len();
    if identities.len() < POLICIES * BLOCKS_PER_POLICY {
        bail!("only {} identities compiled", identities.len());
    }

    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX..SKB_INGRESS_IFINDEX + 4].copy_from_slice(&a.to_ne_bytes());
    ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&a.to_ne_bytes());
    let frame = util::udp4(B_MAC, A_MAC, A_IP, B_IP, 4000, 9, &[0u8; 18]);
    // New flows: one source port each (the policy maps' first lookup and a
    // conntrack insert per frame). More than the ports of one address go
    // round again once tracked flows age out; none do within a run.
    let new_flows: Vec<Vec<u8>> = (0..opts.single_shots)
        .map(|i| {
            util::udp4(
                B_MAC,
                A_MAC,
                A_IP,
                B_IP,
                1024 + (i % 60_000) as u16,
                9,
                &[0u8; 18],
            )
        })
        .collect();

    let test = |dp: &Dataplane, data: &[u8], repeat: u32| -> Result<f64> {
        let prog = dp
            .program("vm_port")
            .ok_or_else(|| anyhow!("vm_port not loaded"))?;
        let r = prog.test_run(TestRunOptions {
            data_in: Some(data),
            ctx_in: Some(&ctx),
            repeat,
            ..Default::default()
        })?;
        if r.return_value != TC_ACT_REDIRECT {
            bail!(
                "verdict {} (expected a redirect to b: the frame did not pass)",
                r.return_value
            );
        }
        Ok(r.duration.as_nanos() as f64)
    };
    let singles = |dp: &Dataplane| -> Result<f64> {
        let mut total = 0.0;
        for f in &new_flows {
            total += test(dp, f, 1)?;
        }
        Ok(total / new_flows.len() as f64)
    };

    // Per run: (no policy, policy) for the tracked flow (A) and new flows (B).
    let (mut a0, mut a1, mut b0, mut b1, mut apply_ms) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.runs {
        for which in util::rotated(2, round) {
            if which == 0 {
                dp.apply(&bare)?;
                a0.push(test(&dp, &frame, opts.repeat)?);
                b0.push(singles(&dp)?);
            } else {
                let t = Instant::now();
                dp.apply(&policed)?;
                apply_ms.push(t.elapsed().as_secs_f64() * 1e3);
                // The frame's own flow is tracked by its first repetition.
                a1.push(test(&dp, &frame, opts.repeat)?);
                b1.push(singles(&dp)?);
            }
        }
    }
    // The check the figures rest on: the flows really were policed.
    let stats = dp
        .maps()
        .policy_stats(a)?
        .ok_or_else(|| anyhow!("no policy counters for a"))?;
    if stats.allowed_egress == 0 {
        bail!("a's egress policy never ran");
    }

    let (sa0, sa1, sb0, sb1) = (summary(&a0), summary(&a1), summary(&b0), summary(&b1));
    let ra = paired_ratio(&a1, &a0);
    let rb = paired_ratio(&b1, &b0);
    let mut md = format!(
        "The same 60-byte UDP frame from endpoint a to endpoint b on one node, by BPF_PROG_TEST_RUN of \
         `vm_port` on a's port (a tracked flow is looked up in `vm_port` itself, for both ends; a new \
         flow's tail calls into `vm_policy_out` and, before delivery, `vm_policy_in` included; \
         test_run returns the redirect without executing it). **No policy** \
         against **{POLICIES} policies and {} identities** ({} CIDR identities from /32 ipBlocks, {rules} \
         rule entries; a isolated for egress, b for ingress, both allowed), compiled by the agent's \
         own pipeline and written by `Dataplane::apply`; the two alternate within each of {} runs. \
         **Tracked flow**: one test run with repeat = {} (the first repetition opens the flow, the \
         second passes on each end's own flow entry and records the flow's shared entry, the rest \
         pass both ends on that one lookup, no tail call). **New flows**: {} test runs of one \
         repetition each, every one with its own source port (flow-table misses, a rule lookup on \
         both ends and two flow-table inserts per frame). Ratios are \
         the median (min–max) of the per-run paired ratios.\n\n",
        identities.len(),
        POLICIES * BLOCKS_PER_POLICY,
        opts.runs,
        opts.repeat,
        opts.single_shots,
    );
    md.push_str(
        "| path | no policy, ns/pkt | with policy, ns/pkt | policy ÷ none |\n|---|---|---|---|\n",
    );
    md.push_str(&format!(
        "| L2 forward, tracked flow | {} | {} | {} |\n",
        fmt_summary(&sa0),
        fmt_summary(&sa1),
        fmt_summary(&ra)
    ));
    md.push_str(&format!(
        "| L2 forward, a new flow per frame | {} | {} | {} |\n",
        fmt_summary(&sb0),
        fmt_summary(&sb1),
        fmt_summary(&rb)
    ));
    md.push_str(&format!(
        "\nGoal: at most 10% more per packet (÷ none ≤ 1.10). Compiling the {} documents \
         (validate + plan) took {} ms; writing them into empty policy maps (`Dataplane::apply`, \
         from the no-policy plan) {} ms (median of {} runs): policy update to enforcement, less \
         the agent's file or watch latency (section 7).\n",
        with_docs.len(),
        fmt(compile_ms),
        fmt(summary(&apply_ms).median),
        apply_ms.len()
    ));
    Ok(Section {
        title: "11. NetworkPolicy cost".into(),
        markdown: md,
        bars: vec![
            Bar {
                label: "L2 forward under 1,000 policies, tracked flow".into(),
                ratio: ra.median,
                baseline: "no policy".into(),
            },
            Bar {
                label: "L2 forward under 1,000 policies, new flow".into(),
                ratio: rb.median,
                baseline: "no policy".into(),
            },
        ],
    })
}

/// One node of the end-to-end figure: its agent, a and b.
struct Bed {
    name: &'static str,
    a: Vm,
    b: Vm,
    node: Node,
}

fn bed(name: &'static str, tag: &str, policed: bool) -> Result<Bed> {
    let mut node = Node::new(tag);
    let a = node.add_vm("a", &mac(&A_MAC), &[&addr(A_IP)], None);
    let b = node.add_vm("b", &mac(&B_MAC), &[&addr(B_IP)], None);
    let mut docs = docs_for(tag, [&a.port, &b.port]);
    if policed {
        docs.extend(policy_docs());
    }
    node.write_config("bench.yaml", &docs.join("---\n"));
    node.start_agent();
    node.wait_ports(&[&a.port, &b.port]);
    Ok(Bed { name, a, b, node })
}

fn addr(ip: [u8; 4]) -> String {
    format!("{}.{}.{}.{}/8", ip[0], ip[1], ip[2], ip[3])
}

/// The end-to-end figure: the same forward with real packets, no policy
/// against 1,000 policies; markdown and its bar.
fn end_to_end(opts: &Options) -> Result<(String, Bar)> {
    let beds = [
        bed("no policy", "pn", false)?,
        bed("1000 policies", "pp", true)?,
    ];
    // Policy is in before the ports are attached (the agent writes it
    // first); a's egress allows UDP 9 to b only, so a's ping must fail
    // where the policies are and pass where they are not.
    let b_ip = format!("{}.{}.{}.{}", B_IP[0], B_IP[1], B_IP[2], B_IP[3]);
    for (bed, pings) in beds.iter().zip([true, false]) {
        if bed.a.ns.ping(&b_ip, 1) != pings {
            bail!(
                "{}: a's ping to b {}",
                bed.name,
                if pings { "failed" } else { "passed: no policy" }
            );
        }
    }
    let policy_drops = |bed: &Bed| -> u64 {
        [
            vmpath_common::drop_reason::POLICY_DENIED_INGRESS,
            vmpath_common::drop_reason::POLICY_DENIED_EGRESS,
        ]
        .iter()
        .map(|r| bed.node.drops(*r))
        .sum()
    };
    // The ping above is denied: counted from here.
    let denied_before = policy_drops(&beds[1]);
    let frame = util::udp4_min(B_MAC, A_MAC, A_IP, B_IP);
    let names: Vec<&str> = beds.iter().map(|b| b.name).collect();
    let rates = rate_rounds(&names, opts.pps_rounds, |i| {
        pps(&beds[i].a.ns, &frame, opts.pps_slice, &[&beds[i].b.ns])
    })?;
    // The check the figure rests on: b's ingress policy let the flow in.
    let b_port = beds[1].node.ns.ifindex(&beds[1].b.port);
    let policed = beds[1]
        .node
        .maps()
        .policy_stats(b_port)?
        .ok_or_else(|| anyhow!("b's port is not programmed"))?;
    if policed.allowed_ingress == 0 {
        bail!("b's ingress policy never ran");
    }
    let denied = policy_drops(&beds[1]) - denied_before;
    let pick = |f: fn(&Rate) -> f64, i: usize| -> Vec<f64> { rates[i].iter().map(f).collect() };
    let rx = |r: &Rate| r.received_pps / 1e6;
    let sent = |r: &Rate| r.sent_pps / 1e6;
    let per_cpu = |r: &Rate| r.received_per_cpu_s / 1e6;
    // Per-packet cost, policy ÷ none: the rate without policy over the
    // rate with it, per round.
    let cost = paired_ratio(&pick(rx, 0), &pick(rx, 1));
    let cost_cpu = paired_ratio(&pick(per_cpu, 0), &pick(per_cpu, 1));
    let mut md = format!(
        "\n**End to end.** The same forward with real packets: two agents (release build) \
         side by side, each serving a and b on one node namespace as above, one without \
         policy and one with the same {POLICIES} policies and {} CIDR identities (ipBlocks \
         outside the VMs' addresses; a isolated for egress, b for ingress, both allowing the \
         flow). A raw AF_PACKET socket in a sends the same 60-byte UDP frame (64 bytes on the \
         wire, one flow: tracked after its first frame) with `sendmmsg`; received = IPv4 \
         packets b's stack took in. Section 2's method: {} rounds of {} ms slices, one slice \
         of each setup per round, the order rotated; rates are medians (min–max) over the \
         rounds; **per-packet cost policy ÷ none** is the median (min–max) of the per-round \
         paired ratios of the rate without policy to the rate with it (1.10: a packet costs \
         10% more end to end), by wall clock and per CPU-second (packets received per \
         second of CPU the machine ran, time the host stole excluded). What this includes \
         that the program cost above does not: the sender's system call, the veth transmit, \
         the receiver's IP stack.\n\n\
         | setup | UDP 64 B received Mpps | per CPU-second, M | sent Mpps |\n|---|---|---|---|\n",
        POLICIES * BLOCKS_PER_POLICY,
        opts.pps_rounds,
        opts.pps_slice.as_millis(),
    );
    for (i, b) in beds.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            b.name,
            fmt_summary(&summary(&pick(rx, i))),
            fmt_summary(&summary(&pick(per_cpu, i))),
            fmt_summary(&summary(&pick(sent, i))),
        ));
    }
    md.push_str(&format!(
        "\nPer-packet cost with the policies ÷ without, end to end: {} by wall clock, {} \
         per CPU-second (program cost alone: the tracked-flow row above). Policy drops \
         on the policed node during the runs: {denied}.\n",
        fmt_summary(&cost),
        fmt_summary(&cost_cpu),
    ));
    let bar = Bar {
        label: "UDP 64 B end to end under 1,000 policies, per-packet cost".into(),
        ratio: cost.median,
        baseline: "no policy".into(),
    };
    Ok((md, bar))
}
