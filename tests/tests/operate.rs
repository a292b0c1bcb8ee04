//! Operating the agent: Prometheus metrics, the admin API and its CLI (root
//! only), `--cleanup`, and a restart that loses no packet. Real agent, real
//! packets, in namespaces.

use std::{
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    process::Output,
    thread,
    time::Duration,
};

use vmpath_tests::{Netns, Node, Vm, vmpath_bin, wait_for, yaml};

const METRICS: &str = "127.0.0.1:9469";

struct Bed {
    node: Node,
    vm1: Vm,
    vm2: Vm,
}

const VM1_IPS: [&str; 2] = ["10.20.0.11/16", "fd20::11/64"];
const VM2_IPS: [&str; 2] = ["10.20.0.12/16", "fd20::12/64"];

fn networks() -> Vec<String> {
    vec![
        yaml::network(
            "blue",
            100,
            &["10.20.0.0/16", "fd20::/64"],
            &["10.20.0.1", "fd20::1"],
            true,
        ),
        yaml::network("red", 200, &["10.30.0.0/16"], &["10.30.0.1"], false),
    ]
}

/// vm1 and vm2 on `blue` (IPAM Enabled, so the IP filter is on); `red`
/// has no VM. The agent serves metrics on 127.0.0.1:9469 in the node's
/// namespace.
fn bed() -> Bed {
    bed_with(&["--metrics-addr", METRICS])
}

/// [`bed`]'s node, VMs and config, the agent started with `args`.
fn bed_with(args: &[&str]) -> Bed {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:00:01:01", &VM1_IPS, Some("10.20.0.1"));
    let vm2 = node.add_vm("vm2", "52:54:00:00:02:01", &VM2_IPS, Some("10.20.0.1"));
    let mut docs = networks();
    docs.push(yaml::attachment(
        "vm1", "blue", "a", &vm1.port, &vm1.mac, &VM1_IPS,
    ));
    docs.push(yaml::attachment(
        "vm2", "blue", "a", &vm2.port, &vm2.mac, &VM2_IPS,
    ));
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.set_agent_args(args);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    Bed { node, vm1, vm2 }
}

/// Scrapes the agent's /metrics from inside the node's namespace.
fn scrape(node: &Node) -> String {
    let url = format!("http://{METRICS}/metrics");
    let mut last = None;
    for _ in 0..50 {
        let out = node
            .ns
            .run_status(&["curl", "-sfS", "--max-time", "5", &url]);
        if out.status.success() {
            return String::from_utf8_lossy(&out.stdout).into_owned();
        }
        last = Some(String::from_utf8_lossy(&out.stderr).into_owned());
        thread::sleep(Duration::from_millis(100));
    }
    panic!("cannot scrape {url}: {last:?}\n{}", node.agent_log());
}

/// The value of the sample `name{labels...}` whose labels include `want`.
fn sample(text: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(rest) = rest.strip_prefix('{') {
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            (labels, value)
        } else if let Some(value) = rest.strip_prefix(' ') {
            ("", value)
        } else {
            continue;
        };
        let matches = want.iter().all(|(k, v)| {
            labels
                .split(',')
                .any(|pair| pair == format!("{k}=\"{v}\"").as_str())
        });
        if matches {
            return value.trim().parse().ok();
        }
    }
    None
}

fn port_sample(text: &str, name: &str, vm: &Vm) -> f64 {
    sample(
        text,
        name,
        &[
            ("network", "blue"),
            ("namespace", "prod"),
            ("interface", "eth0"),
            ("port", &vm.port),
        ],
    )
    .unwrap_or_else(|| panic!("no {name} for port {}:\n{text}", vm.port))
}

/// Runs the CLI against the node's API socket.
fn cli(node: &Node, args: &[&str]) -> Output {
    std::process::Command::new(vmpath_bin())
        .args(args)
        .arg("--api-socket")
        .arg(node.api_socket())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running the vmpath CLI")
}

fn cli_ok(node: &Node, args: &[&str]) -> String {
    let out = cli(node, args);
    assert!(
        out.status.success(),
        "vmpath {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn metrics_count_port_traffic_drops_and_config_errors() {
    let bed = bed();
    let node = &bed.node;
    let before = scrape(node);
    assert_eq!(sample(&before, "vmpath_ready", &[]), Some(1.0));
    assert_eq!(sample(&before, "vmpath_networks", &[]), Some(2.0));
    assert_eq!(
        sample(&before, "vmpath_attachments", &[("state", "local")]),
        Some(2.0)
    );
    for state in ["remote", "missing_port", "migrating"] {
        assert_eq!(
            sample(&before, "vmpath_attachments", &[("state", state)]),
            Some(0.0),
            "{state}"
        );
    }
    assert_eq!(sample(&before, "vmpath_config_errors", &[]), Some(0.0));
    assert!(
        sample(&before, "vmpath_reconcile_duration_seconds_count", &[]).unwrap_or(0.0) >= 1.0,
        "no reconcile observed:\n{before}"
    );
    for reason in vmpath_tests::vmpath::common::drop_reason::NAMES {
        assert!(
            sample(&before, "vmpath_drops_total", &[("reason", reason)]).is_some(),
            "no drop counter for {reason}"
        );
    }

    // Ten pings each way: both ports count them, in both directions.
    assert!(bed.vm1.ns.ping("10.20.0.12", 5));
    assert!(bed.vm2.ns.ping("10.20.0.11", 5));
    let after = scrape(node);
    for vm in [&bed.vm1, &bed.vm2] {
        for name in [
            "vmpath_port_rx_packets_total",
            "vmpath_port_tx_packets_total",
        ] {
            let (b, a) = (
                port_sample(&before, name, vm),
                port_sample(&after, name, vm),
            );
            assert!(a >= b + 10.0, "{name} on {}: {b} -> {a}", vm.port);
        }
        for name in ["vmpath_port_rx_bytes_total", "vmpath_port_tx_bytes_total"] {
            let (b, a) = (
                port_sample(&before, name, vm),
                port_sample(&after, name, vm),
            );
            assert!(a >= b + 10.0 * 98.0, "{name} on {}: {b} -> {a}", vm.port);
        }
        // The labels name the VM.
        assert!(
            sample(
                &after,
                "vmpath_port_rx_packets_total",
                &[
                    ("port", &vm.port),
                    (
                        "vm",
                        if vm.port == bed.vm1.port {
                            "vm1"
                        } else {
                            "vm2"
                        }
                    )
                ]
            )
            .is_some()
        );
    }

    // An IP spoof, after a real ping so vm2's MAC is cached and the IP
    // packet is really sent: counted under its reason and on the port.
    bed.vm1
        .ns
        .run(&["ip", "addr", "add", "10.20.0.99/16", "dev", "eth0"]);
    assert!(
        !bed.vm1.ns.ping_from("10.20.0.99", "10.20.0.12", 3),
        "spoofed source reached vm2"
    );
    let spoofed = scrape(node);
    let reason =
        |text: &str| sample(text, "vmpath_drops_total", &[("reason", "ip_spoof")]).unwrap_or(0.0);
    assert!(
        reason(&spoofed) >= reason(&after) + 3.0,
        "ip_spoof drops {} -> {}",
        reason(&after),
        reason(&spoofed)
    );
    assert!(
        port_sample(&spoofed, "vmpath_port_drops_total", &bed.vm1)
            >= port_sample(&after, "vmpath_port_drops_total", &bed.vm1) + 3.0
    );

    // A refused document shows as a count and as an info series naming it.
    node.write_config(
        "zz-bad.yaml",
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: green}\nspec:\n  id: 300\n  subnets: [10.40.0.0/16]\n  defaultGatewayIPs: [10.40.0.1]\n  colour: green\n",
    );
    let mut text = String::new();
    wait_for(
        "the config error in metrics",
        Duration::from_secs(10),
        || {
            text = scrape(node);
            sample(&text, "vmpath_config_errors", &[]) == Some(1.0)
        },
    );
    let file = node.config_dir.join("zz-bad.yaml").display().to_string();
    assert_eq!(
        sample(&text, "vmpath_config_error_info", &[("file", &file)]),
        Some(1.0),
        "{text}"
    );
    let info = text
        .lines()
        .find(|l| l.starts_with("vmpath_config_error_info{"))
        .unwrap();
    assert!(info.contains("document=\"Network"), "{info}");
    assert!(info.contains("field=\"spec"), "{info}");
    assert_eq!(sample(&text, "vmpath_networks", &[]), Some(2.0));
    // The rest still runs.
    assert!(bed.vm2.ping("10.20.0.11"));
}

#[test]
fn cli_shows_vms_and_networks() {
    let bed = bed();
    let node = &bed.node;
    assert!(bed.vm1.ns.ping("10.20.0.12", 3));
    let ifindex = node.ns.ifindex(&bed.vm1.port);

    let text = cli_ok(node, &["vm", "show", "prod/vm1"]);
    for want in [
        "prod/vm1",
        "52:54:00:00:01:01 (given)",
        "10.20.0.11/16 (given)",
        "fd20::11/64 (given)",
        &format!("{} (ifindex {ifindex})", bed.vm1.port),
        "network blue",
        "state:      local",
        "migration:  none",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    let counters = text
        .lines()
        .find(|l| l.trim_start().starts_with("counters:"))
        .unwrap_or_else(|| panic!("no counters in:\n{text}"));
    assert!(
        counters.contains("rx ") && counters.contains("gateway replies"),
        "{counters}"
    );

    let json: serde_json::Value =
        serde_json::from_str(&cli_ok(node, &["vm", "show", "prod/vm1", "-o", "json"])).unwrap();
    assert_eq!(json["namespace"], "prod");
    assert_eq!(json["vm"], "vm1");
    let iface = &json["interfaces"][0];
    assert_eq!(iface["interface"], "eth0");
    assert_eq!(iface["mac"], "52:54:00:00:01:01");
    assert_eq!(iface["mac_origin"], "given");
    assert_eq!(iface["ips"][0]["address"], "10.20.0.11/16");
    assert_eq!(iface["ips"][0]["origin"], "given");
    assert_eq!(iface["ips"][1]["address"], "fd20::11/64");
    assert_eq!(iface["node"], "a");
    assert_eq!(iface["port"], bed.vm1.port.as_str());
    assert_eq!(iface["ifindex"], ifindex);
    assert_eq!(iface["state"], "local");
    assert_eq!(iface["migration"], "none");
    let c = &iface["counters"];
    assert!(c["rx_packets"].as_u64().unwrap() >= 3, "{c}");
    assert!(c["tx_packets"].as_u64().unwrap() >= 3, "{c}");
    assert!(c["rx_bytes"].as_u64().unwrap() >= 3 * 98, "{c}");
    assert!(c["drops"].is_u64() && c["gateway_replies"].is_u64(), "{c}");

    let list = cli_ok(node, &["net", "list"]);
    let names: Vec<&str> = list
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(names, ["blue", "red"], "{list}");
    assert!(list.lines().next().unwrap().starts_with("NAME"), "{list}");
    let json: serde_json::Value =
        serde_json::from_str(&cli_ok(node, &["net", "list", "-o", "json"])).unwrap();
    assert_eq!(json["networks"][0]["name"], "blue");
    assert_eq!(json["networks"][0]["id"], 100);
    assert_eq!(json["networks"][1]["name"], "red");

    let blue = cli_ok(node, &["net", "show", "blue"]);
    assert!(
        blue.contains("10.20.0.0/16") && blue.contains(&bed.vm2.port),
        "{blue}"
    );
    let vms = cli_ok(node, &["vm", "list"]);
    assert!(
        vms.contains("prod/vm1") && vms.contains("prod/vm2"),
        "{vms}"
    );

    let status = cli_ok(node, &["status"]);
    assert!(status.contains("ready:          yes"), "{status}");
    assert!(status.contains("local 2"), "{status}");
    let json: serde_json::Value =
        serde_json::from_str(&cli_ok(node, &["status", "-o", "json"])).unwrap();
    assert_eq!(json["node"], "a");
    assert_eq!(json["ready"], true);
    assert_eq!(json["counts"]["networks"], 2);
    assert!(json["drops"]["ip_spoof"].is_u64(), "{json}");
    cli_ok(node, &["status", "--check", "live"]);
    cli_ok(node, &["status", "--check", "ready"]);

    // Unknown names: a clear error and a non-zero exit.
    for args in [
        &["vm", "show", "prod/nope"][..],
        &["net", "show", "nope"][..],
        &["vm", "show", "not-ns-slash-vm"][..],
    ] {
        let out = cli(node, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.contains("nope") || err.contains("NS/VM"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn the_api_is_root_only() {
    let bed = bed();
    let node = &bed.node;
    let socket = node.api_socket();
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "socket mode");
    assert_eq!(meta.uid(), 0, "socket owner");
    // The state dir holding the socket is root's alone (see
    // the_state_dir_is_root_only); opened to traversal here so that what
    // refuses below is the socket's own mode.
    std::fs::set_permissions(&node.state_dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    let socket = socket.to_str().unwrap();
    // The directory is traversable for nobody: what refuses is the socket.
    assert!(
        as_nobody(&["test", "-S", socket]).status.success(),
        "nobody cannot even see the socket; the test would prove nothing"
    );
    let bin = vmpath_bin();
    let bin = bin.to_str().unwrap();
    let out = as_nobody(&[bin, "status", "--api-socket", socket]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "nobody got the status");
    assert!(
        err.contains("permission denied: the API is root-only"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
    cli_ok(node, &["status"]);

    // With no agent: a clear "not running".
    let mut node = bed.node;
    node.kill_agent();
    let out = cli(&node, &["status"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agent not running"), "{err}");
}

/// The problems `vmpath status -o json` lists, joined.
fn status_problems(node: &Node) -> String {
    let json: serde_json::Value =
        serde_json::from_str(&cli_ok(node, &["status", "-o", "json"])).unwrap();
    json["problems"].to_string()
}

#[test]
fn forwarding_off_is_said_in_the_status_until_it_is_on() {
    // A node whose operator forgot the sysctls. Set here: a new namespace
    // copies IPv4's from the host's (net.core.devconf_inherit_init_net),
    // which podman's tests turn on.
    let mut node = Node::new("w");
    node.ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
    node.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=0"]);
    let vm1 = node.add_vm("vm1", "52:54:00:00:01:01", &VM1_IPS, Some("10.20.0.1"));
    let mut docs = networks();
    docs.push(yaml::attachment(
        "vm1", "blue", "w", &vm1.port, &vm1.mac, &VM1_IPS,
    ));
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.start_agent();
    node.wait_ports(&[&vm1.port]);
    let v4 = "net.ipv4.ip_forward=0";
    let v6 = "net.ipv6.conf.all.forwarding=0";
    wait_for(
        "the status to say forwarding is off",
        Duration::from_secs(10),
        || {
            let p = status_problems(&node);
            p.contains(v4) && p.contains(v6)
        },
    );
    let problems = status_problems(&node);
    // blue has VMs here and gateways of both families; red has no VM here.
    assert!(problems.contains("network blue"), "{problems}");
    assert!(!problems.contains("red"), "{problems}");
    assert!(problems.contains("route_no_route"), "{problems}");
    let text = cli_ok(&node, &["status"]);
    assert!(text.contains("problems:") && text.contains(v4), "{text}");
    assert!(
        node.agent_log().contains(v4),
        "not logged:\n{}",
        node.agent_log()
    );

    // Fixed while the agent runs: the problem goes, family by family.
    node.ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    wait_for("the IPv4 problem to go", Duration::from_secs(10), || {
        !status_problems(&node).contains(v4)
    });
    assert!(status_problems(&node).contains(v6));
    node.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
    wait_for("the IPv6 problem to go", Duration::from_secs(10), || {
        status_problems(&node) == "[]"
    });
}

/// `args` run as nobody (uid and gid 65534, no groups).
fn as_nobody(args: &[&str]) -> Output {
    vmpath_tests::run_status(
        &[
            &[
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
            ][..],
            args,
        ]
        .concat(),
    )
}

#[test]
fn the_state_dir_is_root_only() {
    let mut node = Node::new("s");
    let vm1 = node.add_vm("vm1", "52:54:00:00:01:01", &VM1_IPS, Some("10.20.0.1"));
    let mut docs = networks();
    docs.push(yaml::attachment(
        "vm1", "blue", "s", &vm1.port, &vm1.mac, &VM1_IPS,
    ));
    node.write_config("config.yaml", &yaml::docs(&docs));
    // What an older agent left: the dir 0755, its files 0644.
    let dir = node.state_dir.clone();
    let old = dir.join("cni-endpoints.json");
    std::fs::write(&old, r#"{"endpoints": {}, "kept": []}"#).unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    node.start_agent();
    node.wait_ports(&[&vm1.port]);
    // A file written after the start (status.json again) is created 0600.
    docs.push(yaml::network(
        "green",
        300,
        &["10.40.0.0/16"],
        &["10.40.0.1"],
        false,
    ));
    node.write_config("config.yaml", &yaml::docs(&docs));
    wait_for("the status to list green", Duration::from_secs(20), || {
        node.status()
            .is_some_and(|s| s["networks"].to_string().contains("green"))
    });

    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "state dir {}", dir.display());
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(mode(&path), 0o600, "{name} in the state dir");
        names.push(name);
    }
    for want in [
        "status.json",
        "claims.redb",
        "cni-endpoints.json",
        "agent.lock",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
    // Nobody reads who runs where.
    let status = dir.join("status.json");
    let out = as_nobody(&["cat", status.to_str().unwrap()]);
    assert!(!out.status.success(), "nobody read status.json");
    assert!(out.stdout.is_empty());
}

/// The ids of the tcx links pinned under the node's bpffs, and their programs.
fn pinned_links(node: &Node) -> Vec<(u64, u64)> {
    node.pinned_links()
        .into_iter()
        .map(|(_, link, prog)| (link, prog))
        .collect()
}

#[test]
fn cleanup_leaves_nothing_attached_or_pinned() {
    let bed = bed();
    let mut node = bed.node;
    assert!(bed.vm1.ping("10.20.0.12"));
    let links = pinned_links(&node);
    let ports = node.port_programs();
    for vm in [&bed.vm1, &bed.vm2] {
        let port = format!("vm_port-{}", node.ns.ifindex(&vm.port));
        assert!(
            ports.iter().any(|(p, _)| *p == port),
            "no program on {}: {ports:?}",
            vm.port
        );
    }
    node.kill_agent();
    // Routes as the agent exports them (protocol 250; added once it is
    // stopped, or its sync would withdraw them) beside a foreign route in
    // the same table.
    for route in [
        "route add 192.0.2.99/32 dev lo table 100 proto static",
        "route add 10.20.0.77/32 dev lo table 100 proto 250",
        "-6 route add fd20::77/128 dev lo table 100 proto 250",
    ] {
        let mut args = vec!["ip"];
        args.extend(route.split(' '));
        node.ns.run(&args);
    }
    // The data path outlives the agent...
    assert!(bed.vm1.ping("10.20.0.12"));
    let bpffs = node.bpffs.to_str().unwrap().to_string();
    node.ns.run(&[
        vmpath_bin().to_str().unwrap(),
        "agent",
        "--cleanup",
        "--bpffs",
        &bpffs,
    ]);
    // ...and cleanup removes it: no link, no program, no pin, no port
    // filter. (The kernel frees them once the pins are gone, after a grace
    // period.)
    assert_eq!(node.port_programs(), vec![], "port programs left");
    for (_, prog) in &ports {
        wait_for(
            &format!("port program {prog} to go"),
            Duration::from_secs(10),
            || {
                !vmpath_tests::run_status(&["bpftool", "prog", "show", "id", &prog.to_string()])
                    .status
                    .success()
            },
        );
    }
    for (link, prog) in links {
        wait_for(
            &format!("link {link} and program {prog} to go"),
            Duration::from_secs(10),
            || {
                let l =
                    vmpath_tests::run_status(&["bpftool", "link", "show", "id", &link.to_string()]);
                let p =
                    vmpath_tests::run_status(&["bpftool", "prog", "show", "id", &prog.to_string()]);
                !l.status.success() && !p.status.success()
            },
        );
    }
    let left: Vec<_> = std::fs::read_dir(&node.bpffs)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left under the bpffs root: {left:?}");
    // Nothing on the ports: frames no longer cross between the VMs.
    for port in [&bed.vm1.port, &bed.vm2.port] {
        let tc = node.ns.run(&["bpftool", "net", "show", "dev", port]);
        assert!(!tc.contains("vm_port"), "{port}: {tc}");
    }
    // No XDP program on any interface of the node either.
    let ip = node.ns.run(&["ip", "-d", "link", "show"]);
    assert!(!ip.contains("prog/xdp"), "{ip}");
    // The slow path's interfaces are gone too.
    assert!(
        !ip.contains("vmp-slow0") && !ip.contains("vmp-slow1"),
        "{ip}"
    );
    assert!(!bed.vm1.ns.ping("10.20.0.12", 1), "still forwarded");
    // No exported route is left in table 100 (protocol 250 only: a route
    // of another protocol there is not vmpath's and stays).
    for family in ["-4", "-6"] {
        let routes = node.ns.run(&[
            "ip", family, "route", "show", "table", "100", "proto", "250",
        ]);
        assert!(routes.trim().is_empty(), "left in table 100: {routes}");
    }
    let other = node
        .ns
        .run(&["ip", "route", "show", "table", "100", "proto", "static"]);
    assert!(
        other.contains("192.0.2.99"),
        "a foreign route was removed: {other}"
    );
}

/// A modest UDP stream from `client` to `server_ip` for `seconds`; returns
/// (packets, lost).
/// Datagrams sent and lost on the path: iperf3's losses less those the
/// server's own socket buffer dropped (a receiver starved of CPU on a busy
/// machine, which the kernel counts: not the data path's).
fn udp_stream(server: &Netns, client: &Netns, server_ip: &str, seconds: u32) -> (u64, u64) {
    let rcvbuf_before = server.udp_rcvbuf_errors();
    let port = "5999";
    let mut srv = server.spawn(&["iperf3", "-s", "-1", "-p", port]);
    wait_for("iperf3 server", Duration::from_secs(10), || {
        let ss = server.run_status(&["ss", "-Hltn", "sport = :5999"]);
        !String::from_utf8_lossy(&ss.stdout).trim().is_empty()
    });
    let secs = seconds.to_string();
    let out = client.run_status(&[
        "iperf3", "-c", server_ip, "-p", port, "-u", "-b", "10M", "-t", &secs, "-J",
    ]);
    let _ = srv.kill();
    let _ = srv.wait();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "iperf3 printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(report.get("error").is_none(), "iperf3: {}", report["error"]);
    let end = &report["end"];
    let sum = if end["sum_received"]["lost_packets"].is_u64() {
        &end["sum_received"]
    } else {
        &end["sum"]
    };
    let rcvbuf = server.udp_rcvbuf_errors() - rcvbuf_before;
    let lost = sum["lost_packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("{report}"));
    (
        sum["packets"]
            .as_u64()
            .unwrap_or_else(|| panic!("{report}")),
        lost.saturating_sub(rcvbuf),
    )
}

#[test]
fn agent_restart_loses_no_packet_and_applies_what_changed_meanwhile() {
    let bed = bed();
    let mut node = bed.node;
    let vm3 = node.add_vm("vm3", "52:54:00:00:03:01", &["10.20.0.13/16"], None);
    assert!(bed.vm1.ping("10.20.0.12"));
    let first_log_len = node.agent_log().len();

    let (ping, (packets, lost)) = thread::scope(|s| {
        let ping = s.spawn(|| {
            bed.vm2.ns.run_status(&[
                "ping",
                "-c",
                "500",
                "-i",
                "0.01",
                "-W",
                "2",
                "-q",
                "10.20.0.11",
            ])
        });
        let udp = s.spawn(|| udp_stream(&bed.vm2.ns, &bed.vm1.ns, "10.20.0.12", 5));
        thread::sleep(Duration::from_millis(1500));
        node.kill_agent();
        // While it is down: a third VM is attached.
        let mut cfg = std::fs::read_to_string(node.config_dir.join("config.yaml")).unwrap();
        cfg.push_str("---\n");
        cfg.push_str(&yaml::attachment(
            "vm3",
            "blue",
            "a",
            &vm3.port,
            &vm3.mac,
            &["10.20.0.13/16"],
        ));
        node.write_config("config.yaml", &cfg);
        thread::sleep(Duration::from_millis(500));
        node.start_agent();
        node.wait_ports(&[&bed.vm1.port, &bed.vm2.port, &vm3.port]);
        (ping.join().unwrap(), udp.join().unwrap())
    });
    let summary = String::from_utf8_lossy(&ping.stdout);
    assert!(
        summary.contains("500 packets transmitted, 500 received, 0% packet loss"),
        "ping across the restart: {summary}{}",
        String::from_utf8_lossy(&ping.stderr)
    );
    assert!(packets > 1000, "UDP sent only {packets} datagrams");
    assert_eq!(
        lost, 0,
        "UDP lost {lost} of {packets} on the path across the restart"
    );
    // It really restarted, adopting what the first one pinned.
    let log = node.agent_log();
    assert!(
        log[first_log_len..].contains("adopting pinned map"),
        "second agent log:\n{}",
        &log[first_log_len..]
    );
    // The change made while it was down is applied.
    assert!(vm3.ping("10.20.0.11"), "vm3 -> vm1");
    assert!(bed.vm2.ping("10.20.0.13"), "vm2 -> vm3");
}

/// Pings vm2 from an address vm1 does not own: dropped as `ip_spoof`.
fn spoof_ping(bed: &Bed) {
    assert!(
        !bed.vm1.ns.ping_from("10.20.0.99", "10.20.0.12", 2),
        "spoofed source reached vm2"
    );
}

fn datapath_lines(node: &Node) -> Vec<String> {
    node.agent_log()
        .lines()
        .filter(|l| l.contains(" vmpath::datapath: "))
        .map(str::to_string)
        .collect()
}

#[test]
fn datapath_debug_events_are_off_by_default_and_switch_at_run_time() {
    let bed = bed();
    let node = &bed.node;
    assert!(bed.vm1.ping("10.20.0.12"), "vm1 cannot reach vm2");
    bed.vm1
        .ns
        .run(&["ip", "addr", "add", "10.20.0.99/16", "dev", "eth0"]);

    let shown = cli_ok(node, &["debug", "datapath"]);
    assert!(shown.contains("drops off, decisions off"), "{shown}");
    spoof_ping(&bed);
    assert!(
        datapath_lines(node).is_empty(),
        "debug events while off: {:?}",
        datapath_lines(node)
    );

    let shown = cli_ok(node, &["debug", "datapath", "drops"]);
    assert!(shown.contains("drops on, decisions off"), "{shown}");
    spoof_ping(&bed);
    wait_for(
        "the spoof's drop event in the agent log",
        Duration::from_secs(5),
        || {
            datapath_lines(node)
                .iter()
                .any(|l| l.contains("drop reason=ip_spoof port_id="))
        },
    );

    let shown = cli_ok(node, &["debug", "datapath", "off"]);
    assert!(shown.contains("drops off"), "{shown}");
    let before = datapath_lines(node).len();
    spoof_ping(&bed);
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        datapath_lines(node).len(),
        before,
        "debug events after switching off: {:?}",
        &datapath_lines(node)[before..]
    );

    // A malformed switch is refused with the expected shape named.
    let body = "{\"drop\": true}";
    let mut api = std::os::unix::net::UnixStream::connect(node.api_socket()).expect("API socket");
    std::io::Write::write_all(
        &mut api,
        format!(
            "PUT /v1/debug/datapath HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .expect("sending the request");
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut api, &mut answer).expect("reading the answer");
    assert!(
        answer.starts_with("HTTP/1.1 400") || answer.starts_with("HTTP/1.0 400"),
        "{answer}"
    );
    assert!(answer.contains("body must be"), "{answer}");
    assert!(cli_ok(node, &["debug", "datapath"]).contains("drops off"));
}

/// Entries someone else removed from the data path's maps (an operator's
/// `bpftool`, a tool gone wrong) come back at the next resync, while
/// nothing else changes: the resync reads every map back and repairs it,
/// not only once the next change comes.
#[test]
fn the_resync_repairs_a_map_someone_else_edited_with_nothing_else_changed() {
    // vm2 held: its namespace goes with it.
    let Bed {
        node,
        vm1,
        vm2: _vm2,
    } = bed_with(&["--resync-interval-ms", "300"]);
    assert!(vm1.ping("10.20.0.12"), "vm1 -> vm2");
    for map in ["vmp_endpoints", "vmp_addresses"] {
        let path = node.maps_dir().join(map);
        let path = path.to_str().unwrap();
        let before = node.dump_map(map);
        let entries = vmpath_tests::bpftool_json(&["map", "dump", "pinned", path]);
        let entries = entries.as_array().expect("a dump is a list");
        assert!(!entries.is_empty(), "{map} holds entries");
        for e in entries {
            let key: Vec<String> = e["key"]
                .as_array()
                .expect("raw key bytes")
                .iter()
                .map(|b| b.as_str().unwrap().trim_start_matches("0x").to_string())
                .collect();
            let mut args = vec!["bpftool", "map", "delete", "pinned", path, "key", "hex"];
            args.extend(key.iter().map(String::as_str));
            node.ns.run(&args);
        }
        assert!(
            vmpath_tests::bpftool_json(&["map", "dump", "pinned", path])
                .as_array()
                .is_some_and(|a| a.is_empty()),
            "{map} emptied"
        );
        wait_for(
            &format!("the resync to write {map} again"),
            Duration::from_secs(15),
            || node.dump_map(map) == before,
        );
    }
    assert!(vm1.ping("10.20.0.12"), "vm1 -> vm2 after the repair");
}
