//! The demo's walk through the data path. Each command is printed before
//! its output. Traffic stays inside the demo's namespaces.

use std::{
    process::{Command, ExitStatus},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use vmpath_common::{drop_reason, map_names};

use super::agent::map_path;
use crate::cmd;

const STEP: &str = "demo";

fn in_vm(vm: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &format!("vmpd-{vm}")]).args(args);
    c
}

fn show(c: &mut Command) -> Result<ExitStatus> {
    println!("\n$ {}", cmd::display(c));
    cmd::status(STEP, c)
}

fn expect_ok(c: &mut Command) -> Result<()> {
    let status = show(c)?;
    if !status.success() {
        bail!("{STEP}: `{}` failed ({status})", cmd::display(c));
    }
    Ok(())
}

pub fn all() -> Result<()> {
    println!("\n=== vm1 -> vm2 (network blue, both on this node: bpf_redirect_peer)");
    expect_ok(&mut in_vm(
        "vm1",
        &["ping", "-c3", "-i0.2", "-W2", "10.20.0.12"],
    ))?;
    expect_ok(&mut in_vm(
        "vm1",
        &["ping", "-c3", "-i0.2", "-W2", "fd20::12"],
    ))?;

    println!("\n=== vm1 -> its gateway (ARP/ND and echo answered by the eBPF program)");
    expect_ok(&mut in_vm(
        "vm1",
        &["ping", "-c3", "-i0.2", "-W2", "10.20.0.1"],
    ))?;
    expect_ok(&mut in_vm(
        "vm1",
        &["ping", "-c3", "-i0.2", "-W2", "fd20::1"],
    ))?;
    expect_ok(&mut in_vm("vm1", &["ip", "neigh"]))?;

    println!("\n=== TCP vm1 -> vm2 for 3 s");
    iperf3()?;

    println!("\n=== vm1 -> vm3 (network red): expected to fail, the networks are separate");
    let status = show(&mut in_vm(
        "vm1",
        &["ping", "-c2", "-i0.2", "-W1", "10.30.0.13"],
    ))?;
    if status.success() {
        bail!("{STEP}: vm1 reached vm3 on another network; the networks are not isolated");
    }
    println!(
        "(no reply, as expected: vm1 sends it to its gateway's MAC and the data path drops it, \
         counted as gateway_unrouted below; routed and SNAT egress are not built yet)"
    );

    println!("\n=== the data path's maps");
    expect_ok(Command::new("bpftool").args([
        "map",
        "dump",
        "pinned",
        &map_path(map_names::PORTS),
    ]))?;
    drop_counters()
}

fn iperf3() -> Result<()> {
    expect_ok(&mut in_vm(
        "vm2",
        &["iperf3", "-s", "-1", "-D", "-B", "10.20.0.12"],
    ))?;
    wait_listening("vm2", 5201)?;
    expect_ok(&mut in_vm(
        "vm1",
        &["iperf3", "-c", "10.20.0.12", "-t", "3"],
    ))
}

fn wait_listening(vm: &str, port: u16) -> Result<()> {
    let filter = format!("sport = :{port}");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        let out = cmd::probe(&mut in_vm(vm, &["ss", "-Hltn", &filter])).unwrap_or_default();
        if !out.trim().is_empty() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!("{STEP}: iperf3 server in {vm} is not listening on port {port}")
}

/// The per-CPU drop counters, summed per reason.
fn drop_counters() -> Result<()> {
    let mut c = Command::new("bpftool");
    c.args(["-j", "map", "dump", "pinned", &map_path(map_names::DROPS)]);
    println!("\n$ {}   # summed over CPUs", cmd::display(&c));
    let out = cmd::output(STEP, &mut c)?;
    let entries: serde_json::Value =
        serde_json::from_str(&out).context("demo: parsing bpftool's JSON")?;
    let entries = entries
        .as_array()
        .context("demo: bpftool's JSON is not a list")?;
    let mut totals = vec![0u64; drop_reason::COUNT as usize];
    for e in entries {
        // With BTF, bpftool puts the typed view under "formatted".
        let e = e.get("formatted").unwrap_or(e);
        let (Some(key), Some(values)) = (number(&e["key"]), e["values"].as_array()) else {
            continue;
        };
        if let Some(total) = totals.get_mut(key as usize) {
            *total += values
                .iter()
                .filter_map(|v| number(&v["value"]))
                .sum::<u64>();
        }
    }
    for (name, total) in drop_reason::NAMES.iter().zip(&totals) {
        println!("  {name:<18} {total}");
    }
    Ok(())
}

/// A number as bpftool prints it: a JSON number, or little-endian bytes
/// as hex strings ("0x2a") when the map has no BTF.
fn number(v: &serde_json::Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let bytes = v.as_array()?;
    let mut n = 0u64;
    for (i, b) in bytes.iter().enumerate().take(8) {
        let b = u64::from_str_radix(b.as_str()?.trim_start_matches("0x"), 16).ok()?;
        n |= b << (8 * i);
    }
    Some(n)
}
