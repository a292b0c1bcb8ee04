use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Result;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use vmpath::{
    agent, api, api::snapshot::Observer, apply::dataplane, apply::node_lock, cli, metrics,
    publish::view, resolve::port_eligibility, slowpath,
};

/// mimalloc rather than glibc's malloc: a round at 10,000 VMs was a
/// quarter malloc and free (BENCHMARKS.md section 14).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's defaults trade memory for speed where the agent does not
/// need it: freed memory is given back to the kernel at once (not after
/// 10 ms: a round frees and allocates again within that, and the agent
/// peaked at 243 MiB at 10,000 VMs rather than 200) and its arenas are
/// committed as they are used. Set before the first allocation (an arena
/// is committed as the option says when it is made): from the ELF's
/// constructors, which run before Rust's runtime allocates anything.
#[used]
#[unsafe(link_section = ".init_array")]
static TUNE_ALLOCATOR: extern "C" fn() = tune_allocator;

extern "C" fn tune_allocator() {
    // The option numbers of mimalloc 3's `mi_option_t` (the crate names
    // only older ones).
    const ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    for (option, value, variable) in [
        (PURGE_DELAY, 0, c"MIMALLOC_PURGE_DELAY"),
        (ARENA_EAGER_COMMIT, 0, c"MIMALLOC_ARENA_EAGER_COMMIT"),
    ] {
        // The operator's own setting wins. getenv allocates nothing.
        // SAFETY: `variable` is a NUL-terminated literal; nothing here
        // changes the environment.
        if unsafe { libc::getenv(variable.as_ptr()) }.is_null() {
            // SAFETY: sets one of mimalloc's integer options; no memory
            // is passed.
            unsafe { libmimalloc_sys::mi_option_set(option, value) };
        }
    }
}

#[derive(Parser)]
#[command(
    name = "vmpath",
    about = "Keep-your-address networking for KubeVirt VMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent.
    Agent(Box<AgentArgs>),
    /// Run the cluster's address allocator: one active replica (a
    /// Lease) writes IPAMClaims' status.ips.
    Controller(ControllerArgs),
    /// Show the agent's status: readiness, counts, config errors, drops.
    Status(cli::StatusArgs),
    /// Networks the agent knows.
    Net {
        #[command(subcommand)]
        command: cli::NetCommand,
    },
    /// VM interfaces: MACs, IPs and where they came from, ports, counters.
    Vm {
        #[command(subcommand)]
        command: cli::VmCommand,
    },
    /// Stream the data path's drop events as they happen (Ctrl-C stops).
    Monitor(cli::MonitorArgs),
    /// Debug aids: the data path's debug events.
    Debug {
        #[command(subcommand)]
        command: cli::DebugCommand,
    },
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Directory of config documents: every `*.yaml`/`*.yml` file in it
    /// (hidden files skipped, ConfigMap `..data` symlinks followed).
    #[arg(long, default_value = "/etc/vmpath")]
    config_dir: PathBuf,
    /// This node's name (a DaemonSet passes spec.nodeName as NODE_NAME);
    /// empty: the host name.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node: String,
    /// The node's uplink interface (north-south traffic).
    #[arg(long, default_value = "eth0")]
    uplink: String,
    /// Native XDP on the uplink for the common cases of routed ingress and
    /// SNAT return: `auto` where its driver has native XDP, `off` never
    /// (the tc program on the uplink handles everything either way).
    #[arg(long, value_enum, default_value_t = vmpath::apply::dataplane::UplinkXdp::Off)]
    uplink_xdp: vmpath::apply::dataplane::UplinkXdp,
    /// bpffs directory holding this agent's pinned maps (`maps/v<N>/`) and
    /// links (`links/`); mounted as a bpffs if it is not one.
    #[arg(long, default_value = "/sys/fs/bpf/vmpath")]
    bpffs: PathBuf,
    /// Directory for the IPAM/MAC claims database (`claims.redb`) and the
    /// last published view (`status.json`); keep it across restarts.
    #[arg(long, default_value = "/var/lib/vmpath")]
    state_dir: PathBuf,
    /// The admin API's unix socket (mode 0600: root only).
    #[arg(long, default_value = cli::DEFAULT_SOCKET)]
    api_socket: PathBuf,
    /// Where Prometheus scrapes /metrics; `off` disables it.
    #[arg(long, default_value = "0.0.0.0:9469")]
    metrics_addr: String,
    /// Remove everything vmpath attached, pinned and created under
    /// --bpffs and on the node (links, maps, its interfaces, exported
    /// routes; not the claims in --state-dir), then exit.
    #[arg(long)]
    cleanup: bool,
    /// Make sure --bpffs is on a bpffs (mounting one if the host has none),
    /// then exit: the DaemonSet's privileged init container runs this so
    /// the agent itself needs no privileged mount propagation.
    #[arg(long, conflicts_with = "cleanup")]
    mount_bpffs: bool,
    /// How long to wait for the agent that owns this node (its lock on the
    /// state dir and the bpffs root) to exit, e.g. `30s`: a rolling update
    /// starts the new agent before the old one has gone. `0` (default):
    /// exit at once, naming the holder.
    #[arg(long, default_value = "0s", value_parser = node_lock::parse_wait)]
    lock_wait: Duration,
    /// Names a VM port may have, comma-separated globs (`*`, `?`). A port
    /// must also be a veth or tap, and not the loopback, the uplink,
    /// vmpath's own devices or an interface with the node's addresses;
    /// ports vmpath's CNI plugin creates need no pattern.
    #[arg(long, default_value = port_eligibility::DEFAULT_PORT_PATTERN)]
    port_pattern: String,
    /// How often the data path's own findings (learned MACs and
    /// addresses, migration cut-overs) are checked; a change triggers a
    /// reconcile. Config and port changes trigger one at once.
    #[arg(long, default_value_t = 200)]
    interval_ms: u64,
    /// Slow-path frames (DHCPv4, DHCPv6, RS) the agent serves per second,
    /// all ports together; ports take turns within it. Bounds the agent's
    /// CPU whatever the VMs send (each port is also limited in the data
    /// path by its network's `slowPathLimits`).
    #[arg(long, default_value_t = vmpath::slowpath::fair::DEFAULT_SERVE_RATE,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    slowpath_serve_rate: u64,
    /// A learned address (IPAM-less networks) unheard this long is
    /// forgotten, with its route and export.
    #[arg(long, default_value_t = vmpath::observe::learned::DEFAULT_EXPIRY.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    learned_expiry_seconds: u64,
    /// Learned addresses one port may hold; more are refused (shown in
    /// `vm show`).
    #[arg(long, default_value_t = vmpath::observe::learned::DEFAULT_PER_PORT,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    learned_per_port: u64,
    /// The safety net: a full reconcile at least this often, whatever the
    /// notifications said (it also paces SNAT and remote-MAC ageing).
    #[arg(long, default_value_t = 5000)]
    resync_interval_ms: u64,
    /// Where the documents come from: `files` (--config-dir) or
    /// `kubernetes` (the API server: in-cluster, or --kubeconfig).
    #[arg(long, value_enum, default_value_t = SourceArg::Files)]
    source: SourceArg,
    /// The kubeconfig for `--source kubernetes` outside a cluster.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// With `--source kubernetes`: the namespace of `vmpath controller`'s
    /// ledger ConfigMaps (an IPAMClaim's `status.ips` counts only where
    /// the ledger vouches for it).
    #[arg(long, default_value = "vmpath-system")]
    ledger_namespace: String,
    /// With `--source kubernetes`: the ledger's name, as the controller's
    /// `--ledger-name`.
    #[arg(long, default_value = "vmpath-ipam-ledger")]
    ledger_name: String,
    /// Ignore config-dir and link notifications and reconcile on the
    /// resync timer alone (the old polling behaviour, kept to compare).
    #[arg(long)]
    no_events: bool,
    /// The data path's debug events at start (aya-log, logged under the
    /// target `vmpath::datapath`); `vmpath debug datapath` switches them
    /// at run time.
    #[arg(long, value_enum, default_value_t = cli::DatapathDebug::Off)]
    datapath_debug: cli::DatapathDebug,
    /// Events per second (per CPU) the data path may report to `vmpath
    /// monitor` clients; more are not reported (they are still counted as
    /// drops). Nothing is reported while no client is connected.
    #[arg(long, default_value_t = vmpath::monitor::DEFAULT_RATE,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    monitor_rate: u32,
    /// Endpoints (MACs of VMs on every node of every network) the data
    /// path holds (`vmp_endpoints`, about 100 bytes each, preallocated);
    /// the DaemonSet takes it from the `vmpath-config` ConfigMap's
    /// `maxEndpoints`.
    #[arg(long, env = "VMPATH_MAX_ENDPOINTS",
          default_value_t = vmpath_common::maps::ENDPOINTS.max_entries,
          value_parser = clap::value_parser!(u32)
              .range(i64::from(vmpath_common::sized::MIN)..=i64::from(vmpath_common::sized::MAX)))]
    max_endpoints: u32,
    /// Addresses (IPv4 and IPv6 of VMs on every node) the data path holds
    /// (`vmp_addresses`, about 110 bytes each, preallocated); the
    /// DaemonSet takes it from the ConfigMap's `maxAddresses`.
    #[arg(long, env = "VMPATH_MAX_ADDRESSES",
          default_value_t = vmpath_common::maps::ADDRESSES.max_entries,
          value_parser = clap::value_parser!(u32)
              .range(i64::from(vmpath_common::sized::MIN)..=i64::from(vmpath_common::sized::MAX)))]
    max_addresses: u32,
    /// The cluster's pod CIDRs, comma-separated (kube-controller-manager's
    /// `--cluster-cidr`): a `role: Primary` network whose subnets overlap
    /// one is refused. The DaemonSet takes it from the `vmpath-config`
    /// ConfigMap's `clusterPodCIDRs`; with `--source kubernetes` every v1
    /// Node's `spec.podCIDRs` count too.
    #[arg(long, env = "VMPATH_CLUSTER_POD_CIDRS", value_delimiter = ',',
          value_parser = parse_cidr)]
    cluster_pod_cidrs: Vec<ipnet::IpNet>,
    /// The cluster's Service CIDRs, comma-separated (the API server's
    /// `--service-cluster-ip-range`): a `role: Primary` network whose
    /// subnets overlap one is refused. From the ConfigMap's
    /// `clusterServiceCIDRs`.
    #[arg(long, env = "VMPATH_CLUSTER_SERVICE_CIDRS", value_delimiter = ',',
          value_parser = parse_cidr)]
    cluster_service_cidrs: Vec<ipnet::IpNet>,
}

/// A CIDR as a flag gives it: a prefix without host bits.
fn parse_cidr(text: &str) -> Result<ipnet::IpNet, String> {
    let cidr: ipnet::IpNet = text
        .trim()
        .parse()
        .map_err(|e| format!("{text:?} is not a CIDR: {e}"))?;
    if cidr.trunc() != cidr {
        return Err(format!(
            "{cidr} has host bits set (did you mean {}?)",
            cidr.trunc()
        ));
    }
    Ok(cidr)
}

#[derive(clap::Args)]
struct ControllerArgs {
    /// The kubeconfig outside a cluster; in a cluster, the service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The namespace of the Lease and the ledger ConfigMap (a Deployment
    /// passes metadata.namespace as POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", default_value = "vmpath-system")]
    namespace: String,
    /// This replica's holderIdentity in the Lease (a Deployment passes
    /// metadata.name as POD_NAME); empty: the host name and the pid.
    #[arg(long, env = "POD_NAME", default_value = "")]
    identity: String,
    /// The coordination.k8s.io/v1 Lease that elects the one active replica.
    #[arg(long, default_value = "vmpath-controller")]
    lease_name: String,
    /// The ConfigMap that records every address handed out.
    #[arg(long, default_value = "vmpath-ipam-ledger")]
    ledger_name: String,
    /// How long a leader that stopped renewing keeps the Lease, e.g. `15s`.
    #[arg(long, default_value = "15s", value_parser = node_lock::parse_wait)]
    lease_duration: Duration,
    /// How often the Lease is renewed and, while leading, claims are
    /// allocated, e.g. `2s` (keep it well under --lease-duration).
    #[arg(long, default_value = "2s", value_parser = node_lock::parse_wait)]
    interval: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SourceArg {
    Files,
    Kubernetes,
}

fn main() -> Result<()> {
    // What still allocates with glibc's malloc (C code; the agent's own
    // allocations are mimalloc's, above) does so in one arena: glibc
    // gives a thread that meets a busy arena one of its own, whose freed
    // blocks serve no other thread (before mimalloc, the watchers' pages
    // were held beside the rounds').
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator option, before any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // VMPATH_LOG_FORMAT=json: one JSON object per line, for log pipelines
    // (the DaemonSet sets it); fields name the VM and network.
    if std::env::var("VMPATH_LOG_FORMAT").is_ok_and(|f| f == "json") {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    vmpath::sys::version::init(&version());
    // `--version`: the version and the git revision it was built from.
    let long: &'static str = Box::leak(vmpath::sys::version::long().into_boxed_str());
    let cli = Cli::from_arg_matches(&Cli::command().version(long).get_matches())
        .unwrap_or_else(|e| e.exit());
    let client = match &cli.command {
        Command::Agent(_) | Command::Controller(_) => None,
        Command::Status(args) => Some(cli::status(args)),
        Command::Net { command } => Some(cli::net(command)),
        Command::Vm { command } => Some(cli::vm(command)),
        Command::Debug { command } => Some(cli::debug(command)),
        Command::Monitor(args) => Some(cli::monitor(args)),
    };
    if let Some(result) = client {
        if let Err(e) = result {
            eprintln!("vmpath: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    match cli.command {
        Command::Status(_)
        | Command::Net { .. }
        | Command::Vm { .. }
        | Command::Debug { .. }
        | Command::Monitor(_) => Ok(()),
        Command::Controller(args) => {
            let identity = if args.identity.is_empty() {
                format!("{}-{}", hostname(), std::process::id())
            } else {
                args.identity
            };
            vmpath::controller::run(&vmpath::controller::ControllerOptions {
                kubeconfig: args.kubeconfig,
                namespace: args.namespace,
                identity,
                lease_name: args.lease_name,
                ledger_name: args.ledger_name,
                lease_duration: args.lease_duration,
                interval: args.interval,
            })?;
            Ok(())
        }
        Command::Agent(args) => {
            if args.mount_bpffs {
                dataplane::ensure_bpffs(&args.bpffs)?;
                tracing::info!(bpffs = %args.bpffs.display(), "bpffs ready");
                return Ok(());
            }
            if args.cleanup {
                // Never from under a running agent.
                let lock = args
                    .bpffs
                    .exists()
                    .then(|| node_lock::acquire(None, &args.bpffs, args.lock_wait))
                    .transpose()?;
                dataplane::cleanup(&args.bpffs)?;
                if let Some(lock) = &lock {
                    lock.remove_bpffs_holder();
                }
                vmpath::slowpath::remove_interfaces()?;
                vmpath::apply::overlay::remove_device()?;
                let withdrawn = vmpath::apply::routes::RouteExporter::new(
                    vmpath::apply::routes::DEFAULT_TABLE,
                    vmpath::apply::routes::DEFAULT_PROTOCOL,
                )?
                .withdraw_all()?;
                tracing::info!(
                    withdrawn,
                    table = vmpath::apply::routes::DEFAULT_TABLE,
                    "removed vmpath's exported routes"
                );
                let withdrawn = vmpath::apply::host_reach::withdraw_all()?;
                tracing::info!(withdrawn, "removed the node's routes to its endpoints");
                vmpath::plan::handoff::withdraw_all()?;
                tracing::info!(
                    table = vmpath::plan::handoff::TABLE,
                    "removed the hand-off's nftables table"
                );
                tracing::info!(bpffs = %args.bpffs.display(), "removed every vmpath link and map");
                return Ok(());
            }
            // Whatever the agent writes (state dir, its files) is root's alone.
            vmpath::sys::state_dir::restrict_new_files();
            // The very first act: nothing (map, link, socket, slow path) is
            // touched unless this agent owns the node.
            let _lock = node_lock::acquire(Some(&args.state_dir), &args.bpffs, args.lock_wait)?;
            vmpath::sys::state_dir::tighten(&args.state_dir)?;
            let node = if args.node.is_empty() {
                hostname()
            } else {
                args.node
            };
            port_eligibility::set_policy(port_eligibility::PortPolicy::new(
                &args.port_pattern,
                &args.uplink,
            ));
            let shared = Arc::new(view::Published::new(view::View {
                node: node.clone(),
                bpffs: args.bpffs.display().to_string(),
                config_dir: args.config_dir.display().to_string(),
                ..Default::default()
            }));
            let slow_stats = slowpath::SharedStats::default();
            // The API and metrics read through one observer.
            let observer = Arc::new(Observer::new(
                shared.clone(),
                slow_stats.clone(),
                args.bpffs.clone(),
            ));
            let monitor = vmpath::monitor::Hub::new(&args.bpffs, args.monitor_rate);
            // The API first: it is bound before any other thread exists (it
            // sets the umask around bind).
            api::serve(&args.api_socket, observer.clone(), monitor.clone())?;
            // SNAT and routed egress need the node's forwarding on.
            vmpath::api::forwarding::watch(shared.clone());
            if !args.metrics_addr.is_empty() && args.metrics_addr != "off" {
                metrics::serve(&args.metrics_addr, observer)?;
            }
            let result = agent::run(
                &agent::AgentOptions {
                    config_dir: args.config_dir,
                    node,
                    bpffs: args.bpffs,
                    state_dir: args.state_dir,
                    interval: Duration::from_millis(args.interval_ms),
                    resync: Duration::from_millis(args.resync_interval_ms),
                    events: !args.no_events,
                    uplink: args.uplink,
                    uplink_xdp: args.uplink_xdp,
                    slowpath_serve_rate: args.slowpath_serve_rate,
                    learned: vmpath::observe::learned::Limits {
                        expiry: Duration::from_secs(args.learned_expiry_seconds),
                        per_port: args.learned_per_port as usize,
                    },
                    datapath_debug: args.datapath_debug.switches(),
                    map_sizes: {
                        let mut sizes = vmpath::apply::dataplane::MapSizes::default();
                        sizes.set(vmpath_common::map_names::ENDPOINTS, args.max_endpoints)?;
                        sizes.set(vmpath_common::map_names::ADDRESSES, args.max_addresses)?;
                        sizes
                    },
                    cluster_cidrs: {
                        use vmpath::config::{ClusterCidr, ClusterCidrKind};
                        let given = |cidrs: Vec<ipnet::IpNet>, kind, flag: &'static str| {
                            cidrs.into_iter().map(move |cidr| ClusterCidr {
                                cidr,
                                kind,
                                source: flag.to_string(),
                                node: None,
                            })
                        };
                        given(
                            args.cluster_pod_cidrs,
                            ClusterCidrKind::Pod,
                            "--cluster-pod-cidrs",
                        )
                        .chain(given(
                            args.cluster_service_cidrs,
                            ClusterCidrKind::Service,
                            "--cluster-service-cidrs",
                        ))
                        .collect()
                    },
                    source: match args.source {
                        SourceArg::Files => agent::Source::Files,
                        SourceArg::Kubernetes => agent::Source::Kubernetes {
                            kubeconfig: args.kubeconfig,
                            ledger: vmpath::read::kube_source::LedgerRef {
                                namespace: args.ledger_namespace,
                                name: args.ledger_name,
                            },
                        },
                    },
                },
                shared.clone(),
                slow_stats,
                monitor,
            );
            // Liveness fails from here on, should anything keep the process up.
            shared.loop_exited();
            result
        }
    }
}

/// The crate version plus the suffix a special build was stamped with
/// (e.g. `-rc1`; `cargo xtask image --version-suffix`,
/// `vmpath_common::version_stamp`).
fn version() -> String {
    let (suffix, len) = vmpath_common::version_stamp::suffix();
    format!(
        "{}{}",
        env!("CARGO_PKG_VERSION"),
        String::from_utf8_lossy(&suffix[..len])
    )
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
