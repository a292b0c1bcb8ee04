use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use vmpath::{agent, dataplane};

#[derive(Parser)]
#[command(
    name = "vmpath",
    about = "Keep-your-address networking for KubeVirt VMs",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent.
    Agent(AgentArgs),
}

#[derive(clap::Args)]
struct AgentArgs {
    #[arg(long, default_value = "/etc/vmpath")]
    config_dir: PathBuf,
    /// This node's name (a DaemonSet passes spec.nodeName as NODE_NAME).
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node: String,
    /// The node's uplink interface (north-south traffic).
    #[arg(long, default_value = "eth0")]
    uplink: String,
    #[arg(long, default_value = "/sys/fs/bpf/vmpath")]
    bpffs: PathBuf,
    #[arg(long, default_value = "/var/lib/vmpath")]
    state_dir: PathBuf,
    #[arg(long, default_value = "/run/vmpath/api.sock")]
    api_socket: PathBuf,
    #[arg(long, default_value = "0.0.0.0:9469")]
    metrics_addr: String,
    /// Remove everything vmpath attached and pinned, then exit.
    #[arg(long)]
    cleanup: bool,
    /// How often the config dir and interfaces are checked.
    #[arg(long, default_value_t = 200)]
    interval_ms: u64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(args) => {
            if args.cleanup {
                dataplane::cleanup(&args.bpffs)?;
                tracing::info!(bpffs = %args.bpffs.display(), "removed every vmpath link and map");
                return Ok(());
            }
            let node = if args.node.is_empty() {
                hostname()
            } else {
                args.node
            };
            let shared = vmpath::view::SharedView::default();
            agent::run(
                &agent::AgentOptions {
                    config_dir: args.config_dir,
                    node,
                    bpffs: args.bpffs,
                    state_dir: args.state_dir,
                    interval: Duration::from_millis(args.interval_ms),
                },
                shared,
            )
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
