//! One agent per node: a second agent started beside a running one exits
//! at once naming the holder, before it touches a map, a link or a socket;
//! a deliberate handover (`--lock-wait`) waits for the old agent to exit,
//! then takes its links over without losing a packet.

use std::{
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use vmpath_tests::{AGENT_START_BOUND, Node, Vm, run, vmpath_bin, wait_for};

/// The forwarding maps' contents, as bpftool dumps them.
fn maps(node: &Node) -> Vec<String> {
    [
        "vmp_ports",
        "vmp_endpoints",
        "vmp_addresses",
        "vmp_networks",
        "vmp_flood",
    ]
    .iter()
    .map(|m| node.dump_map(m))
    .collect()
}

fn bed() -> (Node, Vm, Vm) {
    let (mut node, vm1, vm2) = Node::with_two_vms("a", "52:54:00:f0:00");
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    (node, vm1, vm2)
}

/// Waits for a process that must exit by itself; kills it and fails if it
/// keeps running (a second agent that did not refuse).
fn exited(mut child: Child, what: &str) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            return (status, text);
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} kept running beside the first agent:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `vmpath status -o json` through the node's API socket.
fn status(node: &Node) -> Option<Value> {
    let out = std::process::Command::new(vmpath_bin())
        .args(["status", "-o", "json", "--api-socket"])
        .arg(node.api_socket())
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

#[test]
fn a_second_agent_exits_at_once_naming_the_holder_and_changes_nothing() {
    let (node, vm1, vm2) = bed();
    assert!(vm1.ping("10.20.0.12"));
    let pid = node.agent_pid().unwrap();
    let links = node.pinned_links();
    let ports = node.port_programs();
    assert_eq!(
        ports.iter().filter(|l| l.0.starts_with("vm_port-")).count(),
        2,
        "{ports:?}"
    );
    let contents = maps(&node);

    let work = node.state_dir.parent().unwrap().to_path_buf();
    let other_state = work.join("state-2");
    let other_socket = work.join("api-2.sock");
    let seconds = [
        ("the same command", node.agent_command(&[])),
        (
            "another API socket and metrics address",
            node.agent_command_at(
                &node.state_dir,
                &other_socket,
                &["--metrics-addr", "127.0.0.1:19469"],
            ),
        ),
        // Another state dir: the lock on the bpffs root refuses it.
        (
            "another state dir, the same bpffs",
            node.agent_command_at(&other_state, &other_socket, &["--metrics-addr", "off"]),
        ),
    ];
    for (what, mut cmd) in seconds {
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (exit, out) = exited(child, what);
        assert!(!exit.success(), "{what}: exited successfully:\n{out}");
        assert!(
            out.contains("another vmpath agent owns this node")
                && out.contains(&format!("pid {pid}, started "))
                && out.contains("build "),
            "{what}: no message naming the holder:\n{out}"
        );
        assert!(
            !out.contains("adopting pinned map"),
            "{what}: touched the maps:\n{out}"
        );
        // Nothing changed: same links running the same programs, same map
        // contents, the first agent's API still answering, no new socket.
        assert_eq!(node.pinned_links(), links, "{what}: pinned links changed");
        assert_eq!(node.port_programs(), ports, "{what}: port programs changed");
        assert_eq!(maps(&node), contents, "{what}: maps changed");
        assert!(!other_socket.exists(), "{what}: bound a socket");
        assert!(
            status(&node).is_some(),
            "{what}: the first agent's API is gone"
        );
    }
    assert!(vm1.ping("10.20.0.12"));
    assert!(vm2.ping("10.20.0.11"));

    // The links run the running agent's programs, and status says so.
    let s = status(&node).unwrap();
    let programs = &s["programs"];
    assert_eq!(programs["mismatches"], serde_json::json!([]), "{programs}");
    let vm_port = programs["loaded"]["vm_port"].as_u64().unwrap();
    for (port, prog) in ports.iter().filter(|l| l.0.starts_with("vm_port-")) {
        assert_eq!(*prog, vm_port, "{port} runs another program: {programs}");
    }
    assert!(
        programs["build"].as_str().unwrap().starts_with("0."),
        "{programs}"
    );
}

#[test]
fn a_handover_waits_for_the_old_agent_then_takes_its_links_over() {
    let (mut node, vm1, vm2) = bed();
    let old_links = node.pinned_links();
    let old_ports = node.port_programs();
    let old_status = status(&node).unwrap();
    let old_vm_port = old_status["programs"]["loaded"]["vm_port"]
        .as_u64()
        .unwrap();
    let mut old = node.take_agent().unwrap();

    let pinger = vm1
        .ns
        .spawn(&["ping", "-i", "0.01", "-w", "5", "-W", "1", "10.20.0.12"]);
    node.set_agent_args(&["--lock-wait", "30s"]);
    node.start_agent();
    wait_for("the new agent to wait", Duration::from_secs(20), || {
        node.agent_log()
            .contains("waiting for the agent that owns this node to exit")
    });
    assert!(node.agent_running());
    assert_eq!(
        node.pinned_links(),
        old_links,
        "the waiting agent touched a link"
    );
    assert_eq!(
        node.port_programs(),
        old_ports,
        "the waiting agent touched a port"
    );

    // The old agent releases the node on SIGTERM; the new one takes over.
    run(&["kill", "-TERM", &old.id().to_string()]);
    old.wait().unwrap();
    wait_for(
        "the new agent's programs in every link",
        AGENT_START_BOUND,
        || {
            status(&node).is_some_and(|s| {
                let p = &s["programs"];
                let vm_port = p["loaded"]["vm_port"].as_u64();
                vm_port.is_some_and(|id| id != old_vm_port)
                    && p["mismatches"] == serde_json::json!([])
                    && p["links"]
                        .as_array()
                        .is_some_and(|l| l.len() == old_links.len())
                    && p["ports"].as_array().is_some_and(|l| {
                        l.len() == old_ports.len() && l.iter().all(|f| f["current"] == true)
                    })
            })
        },
    );
    let now = node.pinned_links();
    let vm_port = status(&node).unwrap()["programs"]["loaded"]["vm_port"]
        .as_u64()
        .unwrap();
    for ((pin, link, _), (old_pin, old_link, _)) in now.iter().zip(&old_links) {
        assert_eq!(
            (pin, link),
            (old_pin, old_link),
            "links were replaced, not adopted"
        );
    }
    // The ports keep their filters, now running the new agent's programs.
    node.assert_ports_kept_running(&old_ports, vm_port);
    let out = pinger.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(" 0% packet loss"),
        "packets lost in the handover:\n{report}"
    );
    assert!(vm2.ping("10.20.0.11"));
}
