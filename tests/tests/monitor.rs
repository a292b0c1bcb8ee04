//! `vmpath monitor`: the data path says why a packet died (reason,
//! endpoint, 5-tuple), only while someone listens, and no faster than the
//! configured rate however many frames die. Real agent, real packets.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::net::UnixStream,
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver},
    thread,
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData};
use vmpath_common::{MonitorConfig, drop_reason, map_names};
use vmpath_tests::{Node, Vm, vmpath_bin, wait_for, yaml};

const VM1_IP: &str = "10.20.0.11/16";
const VM2_IP: &str = "10.20.0.12/16";
/// Events per second per CPU the agent may report.
const RATE: u32 = 20;

fn bed() -> (Node, Vm, Vm) {
    let mut node = Node::new("m");
    let vm1 = node.add_vm("vm1", "52:54:00:00:01:01", &[VM1_IP], Some("10.20.0.1"));
    let vm2 = node.add_vm("vm2", "52:54:00:00:02:01", &[VM2_IP], Some("10.20.0.1"));
    let docs = vec![
        yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
        yaml::attachment("vm1", "blue", "m", &vm1.port, &vm1.mac, &[VM1_IP]),
        yaml::attachment("vm2", "blue", "m", &vm2.port, &vm2.mac, &[VM2_IP]),
    ];
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.set_agent_args(&["--monitor-rate", &RATE.to_string()]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"), "vm1 cannot reach vm2");
    vm1.ns
        .run(&["ip", "addr", "add", "10.20.0.99/16", "dev", "eth0"]);
    (node, vm1, vm2)
}

/// `vmpath monitor ARGS`, its stdout lines on a channel.
fn monitor(node: &Node, args: &[&str]) -> (Child, Receiver<String>) {
    let mut child = Command::new(vmpath_bin())
        .arg("monitor")
        .args(args)
        .arg("--api-socket")
        .arg(node.api_socket())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting vmpath monitor");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn listeners(node: &Node) -> u32 {
    let path = vmpath::apply::dataplane::maps_dir(&node.bpffs).join(map_names::MONITOR_CFG);
    let map: Array<MapData, MonitorConfig> =
        Map::from_map_data(MapData::from_pin(&path).expect("vmp_monitor_cfg pinned"))
            .unwrap()
            .try_into()
            .unwrap();
    map.get(&0, 0).unwrap().listeners
}

fn spoof(vm1: &Vm, count: u32, interval: &str) {
    let c = count.to_string();
    let out = vm1.ns.run_status(&[
        "ping",
        "-c",
        &c,
        "-i",
        interval,
        "-W",
        "1",
        "-I",
        "10.20.0.99",
        "10.20.0.12",
    ]);
    assert!(!out.status.success(), "spoofed source reached vm2");
}

#[test]
fn monitor_names_the_reason_endpoint_and_flow_of_a_drop() {
    let (node, vm1, _vm2) = bed();
    assert_eq!(
        listeners(&node),
        0,
        "nobody listens yet: the data path must report nothing"
    );
    let (mut child, rx) = monitor(&node, &["-o", "json", "--vm", "prod/vm1", "--count", "1"]);
    wait_for(
        "the monitor client to be registered",
        Duration::from_secs(5),
        || listeners(&node) == 1,
    );
    spoof(&vm1, 2, "0.2");
    let line = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("no event; agent log:\n{}", node.agent_log()));
    let e: serde_json::Value = serde_json::from_str(&line).expect("a JSON event");
    assert_eq!(e["type"], "drop", "{e}");
    assert_eq!(e["reason"], "ip_spoof", "{e}");
    assert_eq!(e["endpoint"], "prod/vm1/eth0", "{e}");
    assert_eq!(e["proto"], "icmp", "{e}");
    assert_eq!(e["src"], "10.20.0.99", "{e}");
    assert_eq!(e["dst"], "10.20.0.12", "{e}");
    assert_eq!(e["src_mac"], vm1.mac, "{e}");
    assert!(child.wait().expect("monitor exits").success());
    // The client went: the data path stops reporting.
    wait_for(
        "the data path to be switched off",
        Duration::from_secs(5),
        || listeners(&node) == 0,
    );

    // Another VM's filter sees none of vm1's drops.
    let (mut other, rx) = monitor(&node, &["-o", "json", "--vm", "prod/vm2"]);
    wait_for("the second client", Duration::from_secs(5), || {
        listeners(&node) == 1
    });
    spoof(&vm1, 2, "0.2");
    assert!(
        rx.recv_timeout(Duration::from_millis(1500)).is_err(),
        "vm2's monitor showed vm1's drop"
    );
    let _ = other.kill();
    let _ = other.wait();

    // A bad filter is refused by the agent with what it expects.
    let out = Command::new(vmpath_bin())
        .args(["monitor", "--vm", "prod"])
        .arg("--api-socket")
        .arg(node.api_socket())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NAMESPACE/VM"), "{err}");
}

#[test]
fn a_flood_of_drops_is_reported_no_faster_than_the_rate_and_all_counted() {
    let (node, vm1, _vm2) = bed();
    let (mut child, rx) = monitor(&node, &["-o", "json"]);
    wait_for("the monitor client", Duration::from_secs(5), || {
        listeners(&node) == 1
    });
    let before = node.drops(drop_reason::IP_SPOOF);
    let start = Instant::now();
    // About 1,000 spoofed frames in a second or two.
    spoof(&vm1, 1000, "0.001");
    // Whatever was reported has reached the client a moment later.
    thread::sleep(Duration::from_millis(500));
    let elapsed = start.elapsed().as_secs_f64();
    let _ = child.kill();
    let _ = child.wait();
    let events: Vec<String> = rx.try_iter().filter(|l| l.contains("ip_spoof")).collect();
    let dropped = node.drops(drop_reason::IP_SPOOF) - before;
    assert!(
        dropped >= 1000,
        "every spoofed frame is dropped and counted: {dropped}"
    );
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // Per CPU: the rate over the time taken, plus one burst (a tenth of
    // the rate, at least one).
    let bound = (f64::from(RATE) * elapsed + f64::from(RATE.div_ceil(10))) * cpus;
    assert!(!events.is_empty(), "no event reported for {dropped} drops");
    assert!(
        (events.len() as f64) <= bound,
        "{} events for {dropped} drops in {elapsed:.2} s: more than {bound:.0} ({RATE}/s per CPU)",
        events.len()
    );
}

/// The agent's resident memory in KiB (`VmRSS` of /proc/PID/status).
fn rss_kib(node: &Node) -> u64 {
    let pid = node.agent_pid().expect("the agent runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

#[test]
fn a_crowd_of_clients_costs_a_bounded_amount_and_past_the_maximum_is_refused() {
    use vmpath::monitor::MAX_CLIENTS;
    const CROWD: usize = 220;
    let (node, _vm1, _vm2) = bed();
    let before = rss_kib(&node);
    // What MAX_CLIENTS may hold, generously: 1 MiB each (a queue of
    // pointers, its lines, a thread's stack: well under half of that),
    // plus 32 MiB for the refused ones' moment and the allocator. A
    // crowd served as before took 1.2 MiB a client and kept it.
    let bound = MAX_CLIENTS as u64 * 1024 + 32 * 1024;
    for round in 1..=2 {
        let mut streams = Vec::new();
        for _ in 0..CROWD {
            let mut s = UnixStream::connect(node.api_socket()).expect("connecting to the API");
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s.write_all(b"GET /v1/monitor HTTP/1.0\r\nHost: vmpath\r\n\r\n")
                .unwrap();
            streams.push(s);
        }
        let mut served = Vec::new();
        let mut refused = 0;
        for s in streams {
            let mut reader = BufReader::new(s);
            let mut head = String::new();
            reader.read_line(&mut head).expect("the agent answers");
            if head.contains(" 200 ") {
                served.push(reader);
            } else {
                assert!(head.contains(" 503 "), "round {round}: {head}");
                let mut rest = String::new();
                let _ = reader.read_to_string(&mut rest);
                assert!(rest.contains("too many monitor clients"), "{rest}");
                refused += 1;
            }
        }
        assert_eq!(served.len(), MAX_CLIENTS, "round {round}: clients served");
        assert_eq!(
            refused,
            CROWD - MAX_CLIENTS,
            "round {round}: clients refused"
        );
        wait_for(
            "the served clients to listen",
            Duration::from_secs(5),
            || listeners(&node) == MAX_CLIENTS as u32,
        );
        // The CLI says why to one over the maximum.
        let out = Command::new(vmpath_bin())
            .arg("monitor")
            .arg("--api-socket")
            .arg(node.api_socket())
            .output()
            .unwrap();
        assert!(
            !out.status.success(),
            "a client past the maximum was served"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "too many monitor clients: {MAX_CLIENTS} are connected"
            )),
            "{err}"
        );
        let during = rss_kib(&node);
        assert!(
            during <= before + bound,
            "round {round}: {during} KiB with {MAX_CLIENTS} clients, from {before} KiB (bound +{bound} KiB)"
        );
        drop(served);
        wait_for("every client to be gone", Duration::from_secs(10), || {
            listeners(&node) == 0
        });
    }
    let after = rss_kib(&node);
    assert!(
        after <= before + bound,
        "{after} KiB after the crowds left, from {before} KiB (bound +{bound} KiB)"
    );
    // And the monitor still serves.
    let (mut child, _rx) = monitor(&node, &["-o", "json"]);
    wait_for("a client after the crowds", Duration::from_secs(5), || {
        listeners(&node) == 1
    });
    let _ = child.kill();
    let _ = child.wait();
}
