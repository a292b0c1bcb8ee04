//! Removing the demo: the agent and anything else running in the demo's
//! namespaces, the agent's pins (`vmpath agent --cleanup`), the namespaces
//! and the work dir. Best effort: every step runs even if one fails.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command},
    thread,
    time::{Duration, Instant},
};

use super::{BPFFS, agent, topology, work_dir};
use crate::cmd;

const STOP_TIMEOUT: Duration = Duration::from_secs(3);

fn netns_exists(ns: &str) -> bool {
    Path::new("/run/netns").join(ns).exists()
}

/// Whether an earlier demo left anything behind.
pub fn leftovers() -> bool {
    topology::namespaces().iter().any(|ns| netns_exists(ns))
        || Path::new(BPFFS).exists()
        || work_dir().exists()
}

pub fn all(bin: Option<&Path>) {
    stop_agent_from_pid_file();
    for ns in topology::namespaces() {
        if netns_exists(&ns) {
            stop_namespace_processes(&ns);
        }
    }
    remove_pins(bin);
    let mut deleted = Vec::new();
    for ns in topology::namespaces() {
        if netns_exists(&ns) {
            let r = cmd::run(
                "teardown: deleting namespace",
                Command::new("ip").args(["netns", "del", &ns]),
            );
            if r.is_ok() {
                deleted.push(ns);
            }
            warn_on_error(r);
        }
    }
    if !deleted.is_empty() {
        println!("teardown: deleted namespaces {}", deleted.join(" "));
    }
    if work_dir().exists() {
        warn_on_error(
            fs::remove_dir_all(work_dir())
                .map_err(|e| anyhow::anyhow!("teardown: removing {}: {e}", work_dir().display())),
        );
    }
}

fn warn_on_error(r: anyhow::Result<()>) {
    if let Err(e) = r {
        println!("warning: {e:#}");
    }
}

/// The agent of an earlier `--keep` run, if its pid file names a process
/// that still is that agent.
fn stop_agent_from_pid_file() {
    let Ok(pid) = fs::read_to_string(agent::pid_path()) else {
        return;
    };
    let Ok(pid) = pid.trim().parse::<i32>() else {
        return;
    };
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let cmdline = String::from_utf8_lossy(&cmdline);
    if cmdline.contains("agent") && cmdline.contains(BPFFS) {
        println!("teardown: stopping the demo agent (pid {pid})");
        terminate(pid);
    }
}

/// Anything still running in one of the demo's namespaces (the agent,
/// iperf3 servers): all started by the demo.
fn stop_namespace_processes(ns: &str) {
    let Some(out) = cmd::probe(Command::new("ip").args(["netns", "pids", ns])) else {
        return;
    };
    for pid in out.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
        println!("teardown: stopping pid {pid} in {ns}");
        terminate(pid);
    }
}

/// SIGTERM, then SIGKILL if it is still there after a few seconds.
fn terminate(pid: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let start = Instant::now();
    while alive(pid) {
        if start.elapsed() > STOP_TIMEOUT {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn alive(pid: i32) -> bool {
    // A zombie has exited; it only waits to be reaped by its parent.
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

fn remove_pins(bin: Option<&Path>) {
    if !Path::new(BPFFS).exists() {
        return;
    }
    match bin {
        // --cleanup also removes vmpath's routes and interfaces in the
        // namespace it runs in: only ever in the demo's node namespace, never
        // the host's. Without it the pins are removed directly below.
        Some(bin) if netns_exists(topology::NODE_NS) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{}", topology::NODE_NS))
                .arg(bin);
            c.args(["agent", "--cleanup", "--bpffs", BPFFS]);
            println!("teardown: {}", cmd::display(&c));
            warn_on_error(cmd::output("teardown: vmpath agent --cleanup", &mut c).map(|_| ()));
        }
        Some(_) => println!("teardown: node namespace gone; removing {BPFFS} directly"),
        None => println!("teardown: no vmpath binary built; removing {BPFFS} directly"),
    }
    // What --cleanup leaves (the root dir itself), or everything without a
    // binary: unpinning a link detaches it once no process holds it.
    warn_on_error(
        fs::remove_dir_all(BPFFS).map_err(|e| anyhow::anyhow!("teardown: removing {BPFFS}: {e}")),
    );
}

/// Tears the demo down when dropped, unless disarmed (`--keep`).
pub struct Guard {
    bin: PathBuf,
    agent: Option<Child>,
    armed: bool,
}

impl Guard {
    pub fn new(bin: PathBuf) -> Self {
        Guard {
            bin,
            agent: None,
            armed: true,
        }
    }

    pub fn set_agent(&mut self, agent: Child) {
        self.agent = Some(agent);
    }

    pub fn agent(&mut self) -> Option<&mut Child> {
        self.agent.as_mut()
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        println!("\ndemo: tearing down");
        if let Some(mut agent) = self.agent.take() {
            println!("teardown: stopping the agent (pid {})", agent.id());
            terminate(agent.id() as i32);
            let _ = agent.kill();
            let _ = agent.wait();
        }
        all(Some(&self.bin));
    }
}
