//! `vmpath status`, `vmpath net ...`, `vmpath vm ...`: the CLI on the admin
//! API (see `api`), through `vmpath_api`'s client.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{self, Write as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow};
use serde::de::DeserializeOwned;
use vmpath_api::{
    Client, path,
    types::{
        InterfaceDetail, IpView, MonitorEvent, NetworkDetail, NetworkList, Origin,
        SlowPathCounters, Status, Switches, VmDetail, VmList, VmRow,
    },
};

use crate::sys::clock::unix_now;

pub use vmpath_api::DEFAULT_SOCKET;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// Readable tables and text.
    #[default]
    Text,
    /// The API's JSON.
    Json,
}

/// Flags every CLI command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
    pub output: Format,
    /// The agent's admin API socket.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub api_socket: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Check {
    /// Exit 0 while the agent loop is alive (GET /healthz).
    Live,
    /// Exit 0 once the data path is programmed (GET /readyz).
    Ready,
}

#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Only check liveness or readiness (for probes): print one line, exit
    /// non-zero when the check fails.
    #[arg(long, value_enum)]
    pub check: Option<Check>,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum NetCommand {
    /// List the networks.
    List(ClientArgs),
    /// Show one network and its interfaces.
    Show {
        /// The Network document's `metadata.name`.
        name: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum VmCommand {
    /// List every VM interface.
    List(ClientArgs),
    /// Show every interface of one VM (NS/VM: the Attachment's namespace and spec.vm).
    Show {
        /// The VM as `namespace/vm` (e.g. `prod/web-1`).
        #[arg(value_name = "NS/VM")]
        vm: String,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// What `vmpath debug datapath` switches to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatapathDebug {
    /// No debug events (the default).
    Off,
    /// Every drop, with its reason and port id.
    Drops,
    /// Migration cut-overs and MACs learned.
    Decisions,
    /// Both.
    All,
}

impl DatapathDebug {
    pub fn switches(self) -> Switches {
        Switches {
            drops: matches!(self, DatapathDebug::Drops | DatapathDebug::All),
            decisions: matches!(self, DatapathDebug::Decisions | DatapathDebug::All),
        }
    }
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum DebugCommand {
    /// Show, or switch, the data path's debug events. They go to the
    /// agent's log under the target `vmpath::datapath`.
    Datapath {
        /// Switch to this; without it, show what is on.
        #[arg(value_enum)]
        to: Option<DatapathDebug>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

/// `vmpath debug ...`.
pub fn debug(cmd: &DebugCommand) -> Result<()> {
    let DebugCommand::Datapath { to, client } = cmd;
    let body = match to {
        Some(to) => Client::new(&client.api_socket)
            .request(
                "PUT",
                path::DEBUG_DATAPATH,
                Some(&serde_json::to_string(&to.switches())?),
            )?
            .success()?,
        None => fetch(&client.api_socket, path::DEBUG_DATAPATH)?,
    };
    if client.output == Format::Json {
        return print_json(&body);
    }
    let s: Switches = serde_json::from_str(&body)
        .context("the agent's answer to /v1/debug/datapath is not what this CLI expects")?;
    let on_off = |b: bool| if b { "on" } else { "off" };
    println!(
        "data path debug events: drops {}, decisions {}",
        on_off(s.drops),
        on_off(s.decisions)
    );
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct MonitorArgs {
    /// Only events of this type (`policy`: none until NetworkPolicy exists).
    #[arg(long = "type", value_parser = ["drop", "policy"])]
    pub kind: Option<String>,
    /// Only events of this VM's interfaces (`namespace/vm`).
    #[arg(long, value_name = "NS/VM")]
    pub vm: Option<String>,
    /// Stop after this many events (default: run until interrupted).
    #[arg(long)]
    pub count: Option<u64>,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// `vmpath monitor`: prints each event the agent streams.
pub fn monitor(args: &MonitorArgs) -> Result<()> {
    use std::io::BufRead as _;
    let mut query = Vec::new();
    if let Some(k) = &args.kind {
        query.push(format!("type={k}"));
    }
    if let Some(vm) = &args.vm {
        query.push(format!("vm={}", vm.replace('%', "%25").replace('&', "%26")));
    }
    let path = format!("{}?{}", path::MONITOR, query.join("&"));
    let reader = Client::new(&args.client.api_socket).stream(&path)?;
    let mut seen = 0;
    let stdout = io::stdout();
    for line in reader.lines() {
        let line = line.context("reading the agent's events")?;
        if line.trim().is_empty() {
            continue;
        }
        let mut out = stdout.lock();
        if args.client.output == Format::Json {
            writeln!(out, "{line}")?;
        } else {
            let e: MonitorEvent = serde_json::from_str(&line)
                .context("an event from the agent is not what this CLI expects")?;
            writeln!(out, "{}", format_event(&e))?;
        }
        out.flush()?;
        seen += 1;
        if args.count.is_some_and(|n| seen >= n) {
            break;
        }
    }
    Ok(())
}

/// One event on one line: type, reason, endpoint, protocol and flow.
pub fn format_event(e: &MonitorEvent) -> String {
    let at = e
        .endpoint
        .clone()
        .unwrap_or_else(|| format!("ifindex {}", e.ifindex));
    let flow = match (&e.src, &e.dst) {
        (Some(s), Some(d)) => {
            let port = |p: Option<u16>| p.map(|p| format!(":{p}")).unwrap_or_default();
            format!(
                "{} {}{} -> {}{}",
                e.proto.as_deref().unwrap_or("?"),
                s,
                port(e.sport),
                d,
                port(e.dport)
            )
        }
        _ => format!("ethertype {} {} -> {}", e.ether_type, e.src_mac, e.dst_mac),
    };
    let policy = match (&e.direction, &e.policy) {
        (Some(d), Some(p)) => format!(" ({d}, policy {p})"),
        (Some(d), None) => format!(" ({d})"),
        _ => String::new(),
    };
    format!("{} {} at {at}: {flow}{policy}", e.kind, e.reason)
}

/// `GET path`, failing with the API's own message on any non-200 answer.
fn fetch(socket: &Path, path: &str) -> Result<String> {
    Ok(Client::new(socket).get(path)?.success()?)
}

fn fetch_as<T: DeserializeOwned>(socket: &Path, path: &str) -> Result<(String, T)> {
    let body = fetch(socket, path)?;
    let value = serde_json::from_str(&body)
        .with_context(|| format!("the agent's answer to {path} is not what this CLI expects"))?;
    Ok((body, value))
}

fn print_json(body: &str) -> Result<()> {
    let value: serde_json::Value = serde_json::from_str(body)?;
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

pub fn status(args: &StatusArgs) -> Result<()> {
    let socket = &args.client.api_socket;
    if let Some(check) = args.check {
        let path = match check {
            Check::Live => path::HEALTHZ,
            Check::Ready => path::READYZ,
        };
        fetch(socket, path)?;
        println!(
            "{}",
            match check {
                Check::Live => "alive",
                Check::Ready => "ready",
            }
        );
        return Ok(());
    }
    let (body, s) = fetch_as::<Status>(socket, path::STATUS)?;
    if args.client.output == Format::Json {
        return print_json(&body);
    }
    print!("{}", format_status(&s));
    Ok(())
}

pub fn net(cmd: &NetCommand) -> Result<()> {
    match cmd {
        NetCommand::List(client) => {
            let (body, list) = fetch_as::<NetworkList>(&client.api_socket, path::NETWORKS)?;
            if client.output == Format::Json {
                return print_json(&body);
            }
            print!("{}", net_table(&list));
            Ok(())
        }
        NetCommand::Show { name, client } => {
            let (body, n) = fetch_as::<NetworkDetail>(&client.api_socket, &path::network(name))?;
            if client.output == Format::Json {
                return print_json(&body);
            }
            let net = &n.network;
            let mut out = String::new();
            let _ = writeln!(out, "network {}", net.name);
            for (k, v) in [
                ("id (VNI)", net.id.to_string()),
                ("role", net.role.clone()),
                ("subnets", join(&net.subnets)),
                ("exclude subnets", join(&net.exclude_subnets)),
                ("gateway IPs", join(&net.gateway_ips)),
                ("gateway MAC", net.gateway_mac.clone()),
                ("IPAM", on_off(net.ipam).into()),
                (
                    "port security",
                    format!(
                        "mac {}, ip {}",
                        on_off(net.mac_filter),
                        on_off(net.ip_filter)
                    ),
                ),
                ("egress", egress(&net.egress).to_string()),
                ("MTU", net.mtu.to_string()),
            ] {
                let _ = writeln!(out, "  {:<16} {}", format!("{k}:"), or_dash(&v));
            }
            let _ = writeln!(out);
            out.push_str(&vm_table(&n.interfaces));
            print!("{out}");
            Ok(())
        }
    }
}

pub fn vm(cmd: &VmCommand) -> Result<()> {
    match cmd {
        VmCommand::List(client) => {
            let (body, list) = fetch_as::<VmList>(&client.api_socket, path::VMS)?;
            if client.output == Format::Json {
                return print_json(&body);
            }
            print!("{}", vm_table(&list.interfaces));
            Ok(())
        }
        VmCommand::Show { vm, client } => {
            let (namespace, name) = vm
                .split_once('/')
                .filter(|(ns, vm)| !ns.is_empty() && !vm.is_empty() && !vm.contains('/'))
                .ok_or_else(|| anyhow!("{vm:?} is not NS/VM (e.g. prod/web-1)"))?;
            let (body, detail) =
                fetch_as::<VmDetail>(&client.api_socket, &path::vm(namespace, name))?;
            if client.output == Format::Json {
                return print_json(&body);
            }
            print!("{}", format_vm(&detail));
            Ok(())
        }
    }
}

// --- text output --------------------------------------------------------------

fn format_status(s: &Status) -> String {
    let mut out = String::new();
    let c = &s.counts;
    let last = if s.reconciles == 0 {
        "never".to_string()
    } else {
        format!(
            "last took {}, {} ago",
            seconds(s.last_reconcile_seconds),
            ago(s.last_reconcile_unix)
        )
    };
    for (k, v) in [
        ("node", s.node.clone()),
        ("ready", yes_no(s.ready).to_string()),
        ("config dir", s.config_dir.clone()),
        ("bpffs", s.bpffs.clone()),
        ("networks", c.networks.to_string()),
        (
            "interfaces",
            format!(
                "{} (local {}, remote {}, missing port {}, migrating {})",
                c.attachments, c.local, c.remote, c.missing_ports, c.migrating
            ),
        ),
        ("reconciles", format!("{} ({last})", s.reconciles)),
    ] {
        let _ = writeln!(out, "{:<15} {}", format!("{k}:"), or_dash(&v));
    }
    if s.config_errors.is_empty() {
        let _ = writeln!(out, "{:<15} none", "config errors:");
    } else {
        let _ = writeln!(out, "config errors:  {}", s.config_errors.len());
        for e in &s.config_errors {
            let _ = writeln!(out, "  {e}");
        }
    }
    if !s.config_warnings.is_empty() {
        let _ = writeln!(out, "config warnings: {}", s.config_warnings.len());
        for w in &s.config_warnings {
            let _ = writeln!(out, "  {w}");
        }
    }
    if s.ineligible_ports > 0 {
        let _ = writeln!(
            out,
            "{:<15} {} (refused: not VM ports, see config errors)",
            "ineligible ports:", s.ineligible_ports
        );
    }
    if !s.missing_ports.is_empty() {
        let _ = writeln!(out, "missing ports:");
        for p in &s.missing_ports {
            let _ = writeln!(out, "  {p}");
        }
    }
    if !s.problems.is_empty() {
        let _ = writeln!(out, "problems:");
        for p in &s.problems {
            let _ = writeln!(out, "  {p}");
        }
    }
    let p = &s.programs;
    let _ = writeln!(out, "{:<15} {}", "build:", or_dash(&p.build));
    let loaded: Vec<String> = p.loaded.iter().map(|(n, id)| format!("{n} {id}")).collect();
    let _ = writeln!(out, "{:<15} {}", "programs:", or_dash(&loaded.join(", ")));
    if p.mismatches.is_empty() {
        let _ = writeln!(
            out,
            "{:<15} {} pinned, all running this agent's programs",
            "links:",
            p.links.len()
        );
    } else {
        let _ = writeln!(
            out,
            "links:          {} pinned, {} NOT running this agent's programs:",
            p.links.len(),
            p.mismatches.len()
        );
        for m in &p.mismatches {
            let _ = writeln!(out, "  {m}");
        }
    }
    for l in &p.links {
        let _ = writeln!(
            out,
            "  {:<20} link {:<6} program {:<6} build {}",
            l.pin,
            l.link_id,
            l.program_id,
            l.build.as_deref().unwrap_or("unknown")
        );
    }
    let current = p.ports.iter().filter(|f| f.current).count();
    let _ = writeln!(
        out,
        "{:<15} {} port filters, {} running this agent's programs",
        "ports:",
        p.ports.len(),
        current
    );
    match (&s.drops, &s.dataplane_error) {
        (Some(drops), _) => {
            let nonzero: Vec<_> = drops.iter().filter(|(_, n)| **n > 0).collect();
            if nonzero.is_empty() {
                let _ = writeln!(out, "{:<15} none", "drops:");
            } else {
                let _ = writeln!(out, "drops:");
                let width = nonzero.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
                for (reason, n) in nonzero {
                    let _ = writeln!(out, "  {reason:<width$}  {n}");
                }
            }
        }
        (None, Some(e)) => {
            let _ = writeln!(out, "{:<15} unreadable: {e}", "drops:");
        }
        (None, None) => {}
    }
    out
}

fn net_table(list: &NetworkList) -> String {
    let rows: Vec<Vec<String>> = list
        .networks
        .iter()
        .map(|n| {
            vec![
                n.name.clone(),
                n.id.to_string(),
                n.role.clone(),
                on_off(n.ipam).into(),
                join(&n.subnets),
                join(&n.gateway_ips),
                egress(&n.egress).to_string(),
                n.attachments.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "ID",
            "ROLE",
            "IPAM",
            "SUBNETS",
            "GATEWAYS",
            "EGRESS",
            "INTERFACES",
        ],
        &rows,
    )
}

/// A network's egress as its config takes it (`SNAT`, `Routed`): the API
/// carries the model's variant name, `Snat`.
fn egress(api: &str) -> &str {
    if api.eq_ignore_ascii_case("snat") {
        "SNAT"
    } else {
        api
    }
}

fn vm_table(rows: &[VmRow]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let r = &row.attachment;
            vec![
                format!("{}/{}", r.namespace, r.vm),
                r.interface.clone(),
                r.network.clone(),
                r.mac.clone().unwrap_or_default(),
                r.ips
                    .iter()
                    .map(|ip| ip.address.clone())
                    .collect::<Vec<_>>()
                    .join(","),
                r.node.clone(),
                r.port.clone(),
                row.state.clone(),
                r.migration.clone(),
            ]
        })
        .collect();
    table(
        &[
            "VM",
            "INTERFACE",
            "NETWORK",
            "MAC",
            "IPS",
            "NODE",
            "PORT",
            "STATE",
            "MIGRATION",
        ],
        &rows,
    )
}

fn format_vm(d: &VmDetail) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "VM {}/{}", d.namespace, d.vm);
    for i in &d.interfaces {
        out.push_str(&format_interface(i));
    }
    out
}

fn origin(o: Option<Origin>) -> String {
    match o {
        Some(o) => serde_json::to_value(o)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_else(|| format!("{o:?}")),
        None => "unknown".into(),
    }
}

fn format_ips(ips: &[IpView]) -> String {
    ips.iter()
        .map(|ip| format!("{} ({})", ip.address, origin(Some(ip.origin))))
        .collect::<Vec<_>>()
        .join(", ")
}

fn format_interface(i: &InterfaceDetail) -> String {
    let a = &i.attachment;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  interface {} (network {}, attachment {})",
        a.interface, a.network, a.name
    );
    let mac = match &a.mac {
        Some(m) => format!("{m} ({})", origin(a.mac_origin)),
        None => "not known yet".into(),
    };
    let port = match a.ifindex {
        Some(idx) => format!("{} (ifindex {idx})", a.port),
        None => a.port.clone(),
    };
    let migration = match &a.migration_target {
        Some(t) => format!("{} (target {t})", a.migration),
        None => a.migration.clone(),
    };
    let counters = match &i.counters {
        Some(c) => format!(
            "rx {} packets / {} bytes, tx {} packets / {} bytes, drops {}, gateway replies {}",
            c.rx_packets, c.rx_bytes, c.tx_packets, c.tx_bytes, c.drops, c.gateway_replies
        ),
        None => "none (port not programmed on this node)".into(),
    };
    let rate_limited = match &i.slowpath_rate_limited {
        Some(by_class) => format!(
            "slow-path frames dropped: {}",
            by_class
                .iter()
                .map(|(class, n)| format!("{class} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => String::new(),
    };
    let dhcp = match &i.dhcp {
        Some(c) => format_dhcp(c),
        None => "none received on this node".into(),
    };
    for (k, v) in [
        ("mac", mac),
        ("ips", format_ips(&a.ips)),
        ("node", a.node.clone()),
        ("port", port),
        ("state", i.state.clone()),
        ("migration", migration),
        ("counters", counters),
        ("dhcp", dhcp),
        ("rate-limit", rate_limited),
    ] {
        let _ = writeln!(out, "    {:<11} {}", format!("{k}:"), or_dash(&v));
    }
    // What the VM used that vmpath did not take as its address, and why.
    for (label, list) in [
        ("refused:", &a.learned_refused),
        ("contested:", &a.learned_contested),
    ] {
        for r in list {
            let _ = writeln!(out, "    {label:<11} {} ({})", r.address, r.reason);
        }
    }
    out
}

/// The slow path's messages for one interface: received, replied and
/// dropped, each with its total and its kinds (`discover 2, request 1`).
fn format_dhcp(c: &SlowPathCounters) -> String {
    let part = |what: &str, by_kind: &BTreeMap<String, u64>| {
        let total: u64 = by_kind.values().sum();
        if total == 0 {
            return format!("{what} 0");
        }
        let kinds: Vec<String> = by_kind
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(kind, n)| format!("{kind} {n}"))
            .collect();
        format!("{what} {total} ({})", kinds.join(", "))
    };
    [
        part("received", &c.received),
        part("replied", &c.replied),
        part("dropped", &c.dropped),
    ]
    .join("; ")
}

/// A left-aligned table with a header row.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<&str>| {
        let mut l = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                let _ = write!(l, "{cell:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(|s| or_dash(s)).collect());
    }
    out
}

fn or_dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

fn join(items: &[String]) -> String {
    items.join(",")
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.1} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

fn ago(unix: u64) -> String {
    let d = unix_now().saturating_sub(unix);
    match d {
        0..60 => format!("{d}s"),
        60..3600 => format!("{}m{}s", d / 60, d % 60),
        _ => format!("{}h{}m", d / 3600, d % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, sync::Arc};

    use super::*;

    #[test]
    fn a_monitor_event_reads_as_one_line() {
        let mut e = MonitorEvent {
            kind: "drop".into(),
            reason: "ip_spoof".into(),
            endpoint: Some("prod/vm1/eth0".into()),
            ifindex: 11,
            port_id: Some(3),
            proto: Some("tcp".into()),
            src: Some("10.20.0.99".into()),
            dst: Some("10.20.0.12".into()),
            sport: Some(40000),
            dport: Some(80),
            src_mac: "52:54:00:00:01:01".into(),
            dst_mac: "02:00:00:00:00:01".into(),
            ether_type: "0x0800".into(),
            direction: None,
            policy: None,
        };
        assert_eq!(
            format_event(&e),
            "drop ip_spoof at prod/vm1/eth0: tcp 10.20.0.99:40000 -> 10.20.0.12:80"
        );
        (e.src, e.dst, e.endpoint) = (None, None, None);
        e.ether_type = "0x0806".into();
        assert_eq!(
            format_event(&e),
            "drop ip_spoof at ifindex 11: ethertype 0x0806 52:54:00:00:01:01 -> 02:00:00:00:00:01"
        );
    }
    use crate::{
        api::snapshot::Observer,
        api::{self, PortCounters},
        publish::view::{Published, sample},
    };

    /// What the API answers at `path` over the sample view (no pinned maps).
    fn answer<T: DeserializeOwned>(path: &str) -> T {
        let view = sample::view();
        let bpffs = view.bpffs.clone().into();
        let observer = Observer::new(Arc::new(Published::new(view)), Default::default(), bpffs);
        let reply = api::route(&observer, path);
        assert_eq!(reply.code, 200, "{}", reply.body);
        serde_json::from_str(&reply.body).unwrap()
    }

    #[test]
    fn status_text_shows_counts_refusals_missing_ports_and_why_no_drops() {
        let text = format_status(&answer("/v1/status"));
        for line in [
            "node:           a",
            "ready:          yes",
            "networks:       1",
            "interfaces:     4 (local 1, remote 1, missing port 1, migrating 1)",
            "config errors:  1",
            "  /etc/vmpath/bad.yaml: Attachment prod/vm9: field spec.mac: \"zz\" is not a MAC address (six hex bytes)",
            "missing ports:",
            "  prod/vm3/eth0 (port p-vm3)",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in\n{text}"
            );
        }
        assert!(
            text.contains("reconciles:     3 (last took 2.0 ms, "),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("drops:          unreadable: ")),
            "{text}"
        );
    }

    #[test]
    fn drops_list_only_reasons_that_happened_aligned() {
        let mut status: Status = answer("/v1/status");
        status.dataplane_error = None;
        status.drops = Some(BTreeMap::from([
            ("mac_spoof".to_string(), 3),
            ("no_port".to_string(), 0),
            ("ip_spoof_v6".to_string(), 12),
        ]));
        let text = format_status(&status);
        assert!(
            text.ends_with("drops:\n  ip_spoof_v6  12\n  mac_spoof    3\n"),
            "{text}"
        );
        status.drops = Some(BTreeMap::from([("no_port".to_string(), 0)]));
        assert!(format_status(&status).ends_with("drops:          none\n"));
    }

    #[test]
    fn vm_table_has_one_aligned_row_per_interface() {
        let list: VmList = answer("/v1/vms");
        let text = vm_table(&list.interfaces);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(
            lines[0].starts_with("VM        INTERFACE  NETWORK  MAC"),
            "{text}"
        );
        assert!(
            lines[1].starts_with(
                "prod/vm1  eth0       blue     52:54:00:00:00:01  10.20.0.5/16  a     p-vm1  local"
            ),
            "{text}"
        );
        assert!(lines[4].ends_with("migrating     pending"), "{text}");
    }

    #[test]
    fn interface_text_says_what_is_not_known() {
        let mut vm: VmDetail = answer("/v1/vms/prod/vm1");
        let text = format_vm(&vm);
        assert!(
            text.starts_with("VM prod/vm1\n  interface eth0 (network blue, attachment vm1)\n"),
            "{text}"
        );
        assert!(
            text.contains("    mac:        52:54:00:00:00:01 (given)\n"),
            "{text}"
        );
        assert!(
            text.contains("    ips:        10.20.0.5/16 (claimed)\n"),
            "{text}"
        );
        assert!(
            text.contains("    port:       p-vm1 (ifindex 11)\n"),
            "{text}"
        );
        assert!(
            text.contains("    counters:   none (port not programmed on this node)\n"),
            "{text}"
        );
        let i = &mut vm.interfaces[0];
        i.attachment.mac = None;
        i.counters = Some(PortCounters {
            rx_packets: 1,
            rx_bytes: 60,
            tx_packets: 2,
            tx_bytes: 120,
            drops: 0,
            gateway_replies: 1,
        });
        let text = format_vm(&vm);
        assert!(text.contains("    mac:        not known yet\n"), "{text}");
        assert!(
            text.contains("    dhcp:       none received on this node\n"),
            "{text}"
        );
        vm.interfaces[0].dhcp = Some(SlowPathCounters {
            received: BTreeMap::from([("discover".into(), 2), ("request".into(), 1)]),
            replied: BTreeMap::from([("discover".into(), 2), ("request".into(), 0)]),
            dropped: BTreeMap::new(),
        });
        let text = format_vm(&vm);
        assert!(
            text.contains(
                "    dhcp:       received 3 (discover 2, request 1); replied 2 (discover 2); dropped 0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("    counters:   rx 1 packets / 60 bytes, tx 2 packets / 120 bytes, drops 0, gateway replies 1\n"),
            "{text}"
        );
    }

    #[test]
    fn net_list_prints_egress_as_config_takes_it() {
        let mut list: NetworkList = answer("/v1/networks");
        list.networks[0].egress = "Snat".into();
        let text = net_table(&list);
        assert!(
            text.lines().nth(1).is_some_and(|l| l.contains("  SNAT  ")),
            "{text}"
        );
        list.networks[0].egress = "Routed".into();
        assert!(net_table(&list).contains("  Routed  "));
    }

    #[test]
    fn small_formats() {
        assert_eq!(seconds(0.0025), "2.5 ms");
        assert_eq!(seconds(1.5), "1.50 s");
        assert_eq!(
            table(&["A", "BB"], &[vec!["xyz".into(), String::new()]]),
            "A    BB\nxyz  -\n"
        );
    }
}
