//! Hostile config files beside a working config: a 100,000-level nested
//! flow sequence, an alias bomb, a 1.5 MB document with 60,000 subnets and
//! binary garbage, alone and together. Forwarding goes on, a new VM written
//! meanwhile is programmed and pings, each hostile file is reported refused
//! (status, /metrics, the log: once), is not parsed again while unchanged,
//! and the agent's CPU falls back to idle. Real agent, real packets.

use std::{
    process::Output,
    thread,
    time::{Duration, Instant},
};

use vmpath_tests::{Node, Vm, vmpath_bin, wait_for, yaml};

const METRICS: &str = "127.0.0.1:9469";

fn deep_nesting() -> Vec<u8> {
    let depth = 100_000;
    format!("x: {}{}\n", "[".repeat(depth), "]".repeat(depth)).into_bytes()
}

/// "Billion laughs": nine levels of ten aliases each.
fn alias_bomb() -> Vec<u8> {
    let mut text = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let prev = format!("*a{}", i - 1);
        text.push_str(&format!("a{i}: &a{i} [{}]\n", vec![prev; 10].join(", ")));
    }
    text.into_bytes()
}

/// A Network document with 60,000 subnets, about 1.5 MB.
fn huge_document() -> Vec<u8> {
    let mut text = String::from(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: huge}\nspec:\n  id: 900\n  subnets:\n",
    );
    for i in 0..60_000u32 {
        text.push_str(&format!(
            "  - 10.{}.{}.0/24 # padding\n",
            i / 256 % 256,
            i % 256
        ));
    }
    text.into_bytes()
}

/// 64 KiB of noise (a fixed LCG: the same bytes every run).
fn binary_garbage() -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..64 * 1024)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 24) as u8
        })
        .collect()
}

/// A hostile file: its name and how to make its bytes.
type Hostile = (&'static str, fn() -> Vec<u8>);

const HOSTILE: [Hostile; 4] = [
    ("deep.yaml", deep_nesting),
    ("bomb.yaml", alias_bomb),
    ("huge.yaml", huge_document),
    ("garbage.yaml", binary_garbage),
];

const BLUE: &str = "10.20.0";

fn network() -> String {
    yaml::network(
        "blue",
        100,
        &["10.20.0.0/16", "fd20::/64"],
        &["10.20.0.1", "fd20::1"],
        false,
    )
}

/// The node with vm1 and vm2 forwarding; a short resync so several pass
/// while the hostile files sit there.
fn bed() -> (Node, Vm, Vm) {
    let mut node = Node::new("a");
    let vm1 = node.add_vm(
        "vm1",
        "52:54:00:00:01:01",
        &[&format!("{BLUE}.11/16")],
        None,
    );
    let vm2 = node.add_vm(
        "vm2",
        "52:54:00:00:02:01",
        &[&format!("{BLUE}.12/16")],
        None,
    );
    let docs = [
        network(),
        yaml::attachment(
            "vm1",
            "blue",
            "a",
            &vm1.port,
            &vm1.mac,
            &[&format!("{BLUE}.11/16")],
        ),
        yaml::attachment(
            "vm2",
            "blue",
            "a",
            &vm2.port,
            &vm2.mac,
            &[&format!("{BLUE}.12/16")],
        ),
    ];
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.set_agent_args(&["--metrics-addr", METRICS, "--resync-interval-ms", "500"]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping(&format!("{BLUE}.12")), "vm1 -> vm2 before");
    (node, vm1, vm2)
}

fn write_raw(node: &Node, file: &str, bytes: &[u8]) {
    let tmp = node.config_dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, node.config_dir.join(file)).unwrap();
}

fn cli(node: &Node, args: &[&str]) -> Output {
    std::process::Command::new(vmpath_bin())
        .args(args)
        .arg("--api-socket")
        .arg(node.api_socket())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running the vmpath CLI")
}

fn scrape(node: &Node) -> String {
    let url = format!("http://{METRICS}/metrics");
    let out = node
        .ns
        .run_status(&["curl", "-sfS", "--max-time", "5", &url]);
    assert!(out.status.success(), "scraping {url}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// CPU seconds (user + system) the agent has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (u64, u64) = (fields[11].parse().unwrap(), fields[12].parse().unwrap());
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (utime + stime) as f64 / hz
}

/// Resident memory of the agent, in bytes.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// Writes `hostile` beside the working config, then a new VM (`name`,
/// address `.host`); checks what the issue asks for.
fn hostile_beside_a_good_change(
    node: &mut Node,
    vm1: &Vm,
    hostile: &[Hostile],
    name: &str,
    host: u8,
) {
    for (file, make) in hostile {
        write_raw(node, file, &make());
    }
    // A good change written a moment later, in a file of its own.
    let mac = format!("52:54:00:00:{host:02x}:01");
    let addr = format!("{BLUE}.{host}/16");
    let vm = node.add_vm(name, &mac, &[&addr], None);
    node.write_config(
        &format!("{name}.yaml"),
        &yaml::attachment(name, "blue", "a", &vm.port, &vm.mac, &[&addr]),
    );
    // Forwarding went on, and the new VM is programmed and pings.
    assert!(
        vm1.ping(&format!("{BLUE}.12")),
        "vm1 -> vm2 beside hostile files"
    );
    wait_for("the new VM to forward", Duration::from_secs(20), || {
        vm.ns.ping(&format!("{BLUE}.11"), 1)
    });

    // Each hostile file is reported refused: status, /metrics, the log.
    let out = cli(node, &["status"]);
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "`vmpath status` failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        vmpath_tests::last_lines(&node.agent_log(), 30, "\n")
    );
    let metrics = scrape(node);
    for (file, _) in hostile {
        assert!(
            status
                .lines()
                .any(|l| l.contains(file) && l.contains("refused whole")),
            "{file} not reported refused by `vmpath status`:\n{status}"
        );
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("vmpath_config_error_info{") && l.contains(file)),
            "{file} not in /metrics"
        );
    }

    // Several resyncs later: nothing parsed again, each refusal logged
    // once, the CPU back to idle, memory bounded.
    let pid = node.agent_pid().expect("agent running");
    let parsed = metric(&scrape(node), "vmpath_config_files_parsed_total");
    let (cpu0, t0) = (cpu_seconds(pid), Instant::now());
    thread::sleep(Duration::from_secs(3));
    let busy = (cpu_seconds(pid) - cpu0) / t0.elapsed().as_secs_f64();
    assert!(
        busy < 0.2,
        "agent uses {:.0}% of a core with hostile files present",
        busy * 100.0
    );
    assert_eq!(
        metric(&scrape(node), "vmpath_config_files_parsed_total"),
        parsed,
        "unchanged files were parsed again"
    );
    let rss = rss_bytes(pid);
    assert!(rss < 200 << 20, "agent RSS {} MiB", rss >> 20);
    let log = node.agent_log();
    for (file, _) in hostile {
        let n = log
            .lines()
            .filter(|l| l.contains("refused") && l.contains(file))
            .count();
        assert_eq!(n, 1, "{file}: refusal logged {n} times:\n{log}");
    }
    for (file, _) in hostile {
        node.remove_config(file);
    }
}

#[test]
fn each_hostile_file_alone_never_blocks_a_good_change() {
    let (mut node, vm1, _vm2) = bed();
    for (i, hostile) in HOSTILE.iter().enumerate() {
        let host = 21 + i as u8;
        hostile_beside_a_good_change(
            &mut node,
            &vm1,
            std::slice::from_ref(hostile),
            &format!("vm{host}"),
            host,
        );
    }
    // Once removed, they are no longer reported.
    wait_for("the refusals to clear", Duration::from_secs(10), || {
        node.status()
            .is_some_and(|s| s["config_errors"].as_array().is_some_and(|e| e.is_empty()))
    });
}

#[test]
fn all_hostile_files_together_never_block_a_good_change() {
    let (mut node, vm1, _vm2) = bed();
    hostile_beside_a_good_change(&mut node, &vm1, &HOSTILE, "vm31", 31);
}
