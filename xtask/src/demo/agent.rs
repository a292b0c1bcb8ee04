//! Starting the demo's agent in the node namespace and waiting until it has
//! programmed every port.

use std::{
    fs::{self, File},
    os::unix::process::CommandExt as _,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use vmpath_common::{MAP_LAYOUT_VERSION, map_names};

use super::{BPFFS, NODE, topology, work_dir};
use crate::cmd;

const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub fn log_path() -> std::path::PathBuf {
    work_dir().join("agent.log")
}

pub fn pid_path() -> std::path::PathBuf {
    work_dir().join("agent.pid")
}

pub fn map_path(name: &str) -> String {
    format!("{BPFFS}/maps/v{MAP_LAYOUT_VERSION}/{name}")
}

/// Starts the agent with `nsenter --net` (not `ip netns exec`, which
/// remounts /sys so the pins would land in a private bpffs). With `detach`
/// it gets a process group of its own and outlives this process.
pub fn start(bin: &Path, config_dir: &Path, detach: bool) -> Result<Child> {
    let step = "demo: starting the agent";
    let state_dir = work_dir().join("state");
    fs::create_dir_all(&state_dir)
        .with_context(|| format!("{step}: creating {}", state_dir.display()))?;
    let log = File::create(log_path()).with_context(|| format!("{step}: creating the log"))?;
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", topology::NODE_NS))
        .arg(bin)
        .arg("agent")
        .arg("--config-dir")
        .arg(config_dir)
        .args(["--node", NODE, "--bpffs", BPFFS])
        .arg("--state-dir")
        .arg(&state_dir)
        // Keep clear of a real agent's socket on this host.
        .arg("--api-socket")
        .arg(work_dir().join("api.sock"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    if detach {
        c.process_group(0);
    }
    println!("\n$ {}   # log: {}", cmd::display(&c), log_path().display());
    let child = c
        .spawn()
        .with_context(|| format!("{step}: could not start nsenter"))?;
    fs::write(pid_path(), format!("{}\n", child.id()))
        .with_context(|| format!("{step}: writing the pid file"))?;
    Ok(child)
}

/// Waits until the agent has pinned a link per port and written every port
/// into the ports map; fails early if the agent exits.
pub fn wait_ready(agent: &mut Child) -> Result<()> {
    let step = "demo: waiting for the agent";
    let want = topology::VMS.len();
    let start = Instant::now();
    loop {
        if let Some(status) = agent.try_wait()? {
            bail!("{step}: the agent exited ({status}); see its log above");
        }
        let links = fs::read_dir(format!("{BPFFS}/links")).map_or(0, |d| d.count());
        let ports = if links >= want { port_entries() } else { 0 };
        if ports >= want {
            println!(
                "demo: agent ready after {:.1} s: {links} pinned links in {BPFFS}/links, {ports} ports in {}",
                start.elapsed().as_secs_f32(),
                map_names::PORTS
            );
            return Ok(());
        }
        if start.elapsed() > READY_TIMEOUT {
            bail!(
                "{step}: after {} s only {links} links and {ports} ports of {want} are programmed",
                READY_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Number of entries in the pinned ports map (0 while it does not exist).
fn port_entries() -> usize {
    cmd::probe(Command::new("bpftool").args([
        "-j",
        "map",
        "dump",
        "pinned",
        &map_path(map_names::PORTS),
    ]))
    .and_then(|out| serde_json::from_str::<serde_json::Value>(&out).ok())
    .and_then(|v| v.as_array().map(Vec::len))
    .unwrap_or(0)
}

/// Prints the end of the agent's log (after a failure).
pub fn print_log_tail() {
    let Ok(log) = fs::read_to_string(log_path()) else {
        return;
    };
    let lines: Vec<&str> = log.lines().collect();
    let tail = &lines[lines.len().saturating_sub(30)..];
    println!("\ndemo: last lines of {}:", log_path().display());
    for l in tail {
        println!("  {l}");
    }
}
