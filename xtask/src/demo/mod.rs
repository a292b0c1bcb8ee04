//! `cargo xtask demo`: one node namespace, three VM namespaces on two
//! networks, the agent in the node namespace, and traffic through the eBPF
//! data path. Everything is torn down at the end (also on failure) unless
//! `--keep`; leftovers of an earlier run are removed first.

mod agent;
mod config;
mod show;
mod teardown;
mod topology;

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::{cargo, cmd, setup};

/// The agent's bpffs root (a directory of its own under the real bpffs).
pub const BPFFS: &str = "/sys/fs/bpf/vmpath-demo";
/// Config dir, state dir, agent log and pid file (root-only tmpfs).
pub const WORK_DIR: &str = "/run/vmpath-demo";
pub const NODE: &str = "demo-node";

#[derive(clap::Args)]
pub struct Options {
    /// Leave the topology and the agent running (tear down with --down).
    #[arg(long, conflicts_with = "down")]
    keep: bool,
    /// Tear down what an earlier `demo --keep` (or an interrupted demo) left.
    #[arg(long)]
    down: bool,
}

pub fn work_dir() -> &'static Path {
    Path::new(WORK_DIR)
}

pub fn run(opts: &Options) -> Result<()> {
    cmd::require_root("cargo xtask demo")?;
    if opts.down {
        let bin = agent_bin();
        teardown::all(bin.as_deref());
        println!("demo: torn down");
        return Ok(());
    }
    setup::run()?;
    let bin = cargo::build_agent()?;
    if teardown::leftovers() {
        println!("demo: removing what an earlier demo left");
        teardown::all(Some(&bin));
    }
    let mut guard = teardown::Guard::new(bin.clone());
    let result = demo(&bin, &mut guard, opts.keep);
    if result.is_err() {
        agent::print_log_tail();
    }
    if opts.keep {
        guard.disarm();
        print_keep_help(result.is_ok());
    }
    result
}

fn demo(bin: &Path, guard: &mut teardown::Guard, keep: bool) -> Result<()> {
    topology::create()?;
    let config_dir = config::write(&work_dir().join("config"))?;
    guard.set_agent(agent::start(bin, &config_dir, keep)?);
    agent::wait_ready(guard.agent().expect("agent just started"))?;
    show::all()?;
    println!("\ndemo: done");
    Ok(())
}

/// The agent binary of an earlier build, for `--down` (which does not build).
fn agent_bin() -> Option<PathBuf> {
    let bin = cargo::target_dir().ok()?.join("debug").join("vmpath");
    bin.is_file().then_some(bin)
}

fn print_keep_help(ok: bool) {
    let state = if ok {
        "running"
    } else {
        "left as it was (the demo failed)"
    };
    println!(
        "\ndemo: topology and agent {state} (--keep). To explore:
  ip netns exec vmpd-vm1 ping 10.20.0.12    # namespaces: vmpd-node vmpd-vm1 vmpd-vm2 vmpd-vm3
  bpftool map dump pinned {BPFFS}/maps/v{v}/vmp_endpoints
  $EDITOR {WORK_DIR}/config/demo.yaml    # the agent reloads on change
  cat {WORK_DIR}/state/status.json    # what the agent applied
  less {WORK_DIR}/agent.log
Tear it down with: cargo xtask demo --down",
        v = vmpath_common::MAP_LAYOUT_VERSION,
    );
}
