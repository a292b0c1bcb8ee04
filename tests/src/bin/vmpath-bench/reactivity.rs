//! How fast the agent reacts: from a VM's port appearing to its first
//! forwarded frame, and from a config write to the map update. The agent
//! as shipped (config-dir and link notifications) against the same agent
//! reconciling on a 200 ms timer alone (`--no-events`, the old poll).

use std::{
    fmt::Write as _,
    io::{BufRead as _, BufReader},
    thread::sleep,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result, anyhow, bail};
use vmpath::{apply::dataplane::Maps, config};
use vmpath_common::EndpointKey;
use vmpath_tests::{Netns, Node, yaml};

use crate::{
    report::{Bar, Section},
    util::{fmt, percentile},
};

pub struct Options {
    pub trials: usize,
}

/// The old poll period, the baseline.
const POLL_MS: u64 = 200;
const VM1: &str = "10.20.0.11";
const VM1_MAC: &str = "52:54:00:00:01:01";

struct Mode {
    name: &'static str,
    args: Vec<String>,
    /// Run with the kernel's expedited RCU grace periods
    /// (`/sys/kernel/rcu_expedited` = 1, restored after).
    rcu_expedited: bool,
}

fn modes() -> [Mode; 3] {
    [
        Mode {
            name: "notifications (as shipped)",
            args: vec![],
            rcu_expedited: false,
        },
        Mode {
            name: "200 ms poll (baseline)",
            args: vec![
                "--no-events".into(),
                "--resync-interval-ms".into(),
                POLL_MS.to_string(),
            ],
            rcu_expedited: false,
        },
        Mode {
            name: "notifications, `rcu_expedited=1`",
            args: vec![],
            rcu_expedited: true,
        },
    ]
}

const RCU_EXPEDITED: &str = "/sys/kernel/rcu_expedited";

/// Sets `/sys/kernel/rcu_expedited` while it lives, then puts the old
/// value back.
struct RcuExpedited(Option<String>);

impl RcuExpedited {
    fn set(on: bool) -> Result<Self> {
        if !on {
            return Ok(RcuExpedited(None));
        }
        let old = std::fs::read_to_string(RCU_EXPEDITED).context(RCU_EXPEDITED)?;
        std::fs::write(RCU_EXPEDITED, "1").context(RCU_EXPEDITED)?;
        Ok(RcuExpedited(Some(old.trim().to_string())))
    }
}

impl Drop for RcuExpedited {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(RCU_EXPEDITED, old);
        }
    }
}

struct Figures {
    port_ms: Vec<f64>,
    /// How long the `ip` process that moves the port in took: the port
    /// appears somewhere inside this window, before `port_ms` starts.
    ip_ms: Vec<f64>,
    config_ms: Vec<f64>,
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut results = Vec::new();
    for mode in modes() {
        let _rcu = RcuExpedited::set(mode.rcu_expedited)?;
        let f = measure(&mode, opts.trials).with_context(|| mode.name)?;
        results.push((mode.name, f));
    }
    let mut md = format!(
        "Real agent process (release build) in a node namespace with one VM (vm1) already \
         forwarding; {} trials per figure and mode, medians over them.\n\n\
         **Port appears → first forwarded frame**: a VM namespace is ready (eth0 up, \
         addressed, a permanent neighbour entry for vm1, `ping -D -i 0.001` to vm1 \
         running) with its port parked in a spare namespace, and its Attachment is \
         already in the config. `ip -n PARK link set PORT netns NODE up` moves the port \
         in; the clock starts when that `ip` process has exited (the port is there) and \
         stops at the first echo reply's timestamp. The `ip` process's own run time, \
         within which the port appeared, is given beside it.\n\n\
         **Config write → map update**: the port exists; one new Attachment file is \
         written (write + rename, as a ConfigMap update) and the pinned `vmp_endpoints` \
         map is polled every 0.2 ms until its entry appears.\n\n\
         Baseline: the same agent with `--no-events --resync-interval-ms {POLL_MS}`, which \
         reconciles on the timer alone, as the agent did before it listened to \
         notifications.\n\n\
         Third row: the shipped agent with the kernel's expedited RCU grace periods \
         (`echo 1 > /sys/kernel/rcu_expedited`, restored after). Ports' programs are tc \
         filters since stop 51 (a tcx attach waited two grace periods under the RTNL, most \
         of a new port's time here before).\n\n\
         | mode | port → first frame p50 ms | p90 ms | `ip` process p50 ms | config → map p50 ms | p90 ms |\n\
         |---|---|---|---|---|---|\n",
        opts.trials
    );
    for (name, f) in &results {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {} | {} |",
            fmt(percentile(&f.port_ms, 50.0)),
            fmt(percentile(&f.port_ms, 90.0)),
            fmt(percentile(&f.ip_ms, 50.0)),
            fmt(percentile(&f.config_ms, 50.0)),
            fmt(percentile(&f.config_ms, 90.0)),
        );
    }
    let (events, poll) = (&results[0].1, &results[1].1);
    let port_ratio = percentile(&events.port_ms, 50.0) / percentile(&poll.port_ms, 50.0);
    let config_ratio = percentile(&events.config_ms, 50.0) / percentile(&poll.config_ms, 50.0);
    let _ = writeln!(
        md,
        "\nMedian with notifications ÷ median with the poll: port {}, config {}.",
        fmt(port_ratio),
        fmt(config_ratio)
    );
    Ok(Section {
        title: "7. Reactivity: port and config changes".into(),
        markdown: md,
        bars: vec![
            Bar {
                label: "port appears -> first frame, p50".into(),
                ratio: port_ratio,
                baseline: "200 ms poll".into(),
            },
            Bar {
                label: "config write -> map update, p50".into(),
                ratio: config_ratio,
                baseline: "200 ms poll".into(),
            },
        ],
    })
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn measure(mode: &Mode, trials: usize) -> Result<Figures> {
    let mut node = Node::new("r");
    let vm1 = node.add_vm("vm1", VM1_MAC, &[&format!("{VM1}/16")], None);
    let park = Netns::new(format!("vt{}-park", node.tag));
    let mac = |i: usize| format!("52:54:00:dd:{:02x}:{:02x}", i >> 8, i & 255);
    let ip = |i: usize| format!("10.20.{}.{}", 1 + i / 200, 1 + i % 200);
    // Ports for the config figure (cN) exist from the start; those for the
    // port figure (rN) are attached in the config but not there yet.
    let mut docs = vec![
        yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], false),
        yaml::attachment(
            "vm1",
            "blue",
            "r",
            &vm1.port,
            &vm1.mac,
            &[&format!("{VM1}/16")],
        ),
    ];
    for i in 0..trials {
        let port = format!("rp{i}");
        docs.push(yaml::attachment(
            &format!("r{i}"),
            "blue",
            "r",
            &port,
            &mac(i),
            &[&format!("{}/16", ip(i))],
        ));
        let c = format!("cp{i}");
        node.ns.run(&[
            "ip",
            "link",
            "add",
            &c,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{c}v"),
        ]);
        node.ns.run(&["ip", "link", "set", &c, "up"]);
    }
    node.write_config("config.yaml", &yaml::docs(&docs));
    // The bench's own port names (`rp*`, `cp*`) beside the test bed's (`vp*`).
    let mut args: Vec<&str> = vec!["--port-pattern", "rp*,cp*,vp*"];
    args.extend(mode.args.iter().map(String::as_str));
    node.set_agent_args(&args);
    node.start_agent();
    node.wait_ports(&[&vm1.port]);

    let mut port_ms = Vec::new();
    let mut ip_ms = Vec::new();
    for i in 0..trials {
        let vm = Netns::new(format!("vt{}-rv{i}", node.tag));
        let port = format!("rp{i}");
        vmpath_tests::run(&[
            "ip", "link", "add", &port, "netns", &park.name, "type", "veth", "peer", "name",
            "eth0", "netns", &vm.name,
        ]);
        park.run(&["ip", "link", "set", &port, "up"]);
        vm.run(&["ip", "link", "set", "eth0", "address", &mac(i)]);
        vm.run(&["ip", "addr", "add", &format!("{}/16", ip(i)), "dev", "eth0"]);
        vm.run(&["ip", "link", "set", "eth0", "up"]);
        vm.run(&[
            "ip",
            "neigh",
            "replace",
            VM1,
            "lladdr",
            VM1_MAC,
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        vm1.ns.run(&[
            "ip",
            "neigh",
            "replace",
            &ip(i),
            "lladdr",
            &mac(i),
            "dev",
            "eth0",
            "nud",
            "permanent",
        ]);
        let mut ping = vm.spawn(&["ping", "-D", "-n", "-i", "0.001", "-w", "10", VM1]);
        let stdout = ping.stdout.take();
        sleep(Duration::from_millis(100));
        let before = unix_now();
        // One `ip` process, entering the park namespace itself (`-n`).
        let moved = vmpath_tests::run_status(&[
            "ip",
            "-n",
            &park.name,
            "link",
            "set",
            &port,
            "netns",
            &node.ns.name,
            "up",
        ]);
        // The port is in the node namespace by the time `ip` has exited.
        let t0 = unix_now();
        ip_ms.push((t0 - before) * 1e3);
        let mut first = None;
        if let (Some(stdout), true) = (stdout, moved.status.success()) {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // "[1733012345.123456] 64 bytes from ..."
                let ts = line
                    .trim_start_matches('[')
                    .split(']')
                    .next()
                    .and_then(|t| t.parse::<f64>().ok());
                if line.contains("bytes from") && ts.is_some() {
                    first = ts;
                    break;
                }
            }
        }
        let _ = ping.kill();
        let _ = ping.wait();
        let Some(first) = first else {
            bail!(
                "no reply from vm1 through port {port}; agent log:\n{}",
                node.agent_log()
            );
        };
        port_ms.push((first - t0) * 1e3);
    }

    let maps = Maps::open(&node.bpffs)?;
    let mut config_ms = Vec::new();
    for i in 0..trials {
        let m = mac(1000 + i);
        let key = EndpointKey {
            network: 100,
            mac: config::parse_mac(&m).map_err(|e| anyhow!(e))?,
            _pad: [0; 2],
        };
        sleep(Duration::from_millis(37)); // de-phase from any timer
        let t = Instant::now();
        node.write_config(
            &format!("c{i}.yaml"),
            &yaml::attachment(
                &format!("c{i}"),
                "blue",
                "r",
                &format!("cp{i}"),
                &m,
                &[&format!("10.20.100.{}/16", i + 1)],
            ),
        );
        while maps.endpoints.get(&key, 0).is_err() {
            if t.elapsed() > Duration::from_secs(10) {
                bail!(
                    "attachment c{i} never reached the map; agent log:\n{}",
                    node.agent_log()
                );
            }
            sleep(Duration::from_micros(200));
        }
        config_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // With VMPATH_AGENT_LOG=vmpath=debug the agent's reconcile phases are
    // in its log: kept here for whoever looks into a slow figure.
    if std::env::var_os("VMPATH_AGENT_LOG").is_some() {
        let path = std::env::temp_dir().join(format!("vmpath-reactivity-{}.log", node.tag));
        let _ = std::fs::write(&path, node.agent_log());
        eprintln!(
            "bench: agent log of {} kept in {}",
            mode.name,
            path.display()
        );
    }
    Ok(Figures {
        port_ms,
        ip_ms,
        config_ms,
    })
}
