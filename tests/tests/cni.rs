//! The `vmpath-cni` plugin, invoked as a container runtime does (CNI_*
//! environment + config on stdin, in the node's network namespace) against
//! a real agent: pods get ports, addresses and traffic to a namespace VM on
//! the same network; DEL, CHECK, GC, STATUS and VERSION; every error is CNI
//! error JSON with a code and a message.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
};

use serde_json::{Value, json};
use vmpath_tests::{Netns, Node, run_status, unique_tag, wait_for, yaml};

const BLUE: &str = "blue";

/// The plugin binary: `VMPATH_CNI_BIN`, else built once.
fn cni_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("VMPATH_CNI_BIN") {
            return PathBuf::from(p);
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf();
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "vmpath-cni"])
            .current_dir(&root)
            .status()
            .expect("running cargo build -p vmpath-cni");
        assert!(status.success(), "cargo build -p vmpath-cni failed");
        root.join("target/debug/vmpath-cni")
    })
    .clone()
}

/// What one plugin call gave back.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    json: Value,
}

impl Outcome {
    fn ok(&self) -> &Value {
        assert_eq!(self.code, Some(0), "plugin failed: {}", self.stdout);
        &self.json
    }

    /// Asserts a CNI error: non-zero exit, JSON with `code` and `msg`.
    fn error(&self, code: u64) -> String {
        assert_ne!(self.code, Some(0), "expected an error, got {}", self.stdout);
        assert_eq!(
            self.json["code"].as_u64(),
            Some(code),
            "error JSON {}",
            self.stdout
        );
        let msg = self.json["msg"].as_str().expect("msg in error JSON");
        assert!(!msg.is_empty());
        format!("{msg}; {}", self.json["details"].as_str().unwrap_or(""))
    }
}

/// Runs the plugin in `node`'s namespace as a runtime would.
fn call(node: &Node, command: &str, env: &[(&str, &str)], stdin: &str) -> Outcome {
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", node.ns.path()))
        .arg(cni_bin())
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("CNI_COMMAND", command)
        .env("CNI_PATH", "/opt/cni/bin")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running vmpath-cni");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Outcome {
        code: out.status.code(),
        json: serde_json::from_str(&stdout).unwrap_or(Value::Null),
        stdout: format!("{stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

fn conf(node: &Node, network: &str) -> String {
    json!({
        "cniVersion": "1.1.0",
        "name": network,
        "type": "vmpath-cni",
        "network": network,
        "socket": node.api_socket(),
    })
    .to_string()
}

/// A pod: its namespace and the CNI identity a runtime gives it.
struct Pod {
    ns: Netns,
    container_id: String,
    name: String,
}

impl Pod {
    fn new(name: &str) -> Pod {
        let tag = unique_tag();
        Pod {
            ns: Netns::new(format!("vt{tag}-{name}")),
            container_id: format!("c{tag}{name}0123456789abcdef"),
            name: format!("{name}-{tag}"),
        }
    }

    fn args(&self, extra: &str) -> String {
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={}{extra}",
            self.name
        )
    }

    fn call(&self, node: &Node, command: &str, stdin: &str, extra_args: &str) -> Outcome {
        let path = self.ns.path();
        let args = self.args(extra_args);
        call(
            node,
            command,
            &[
                ("CNI_CONTAINERID", &self.container_id),
                ("CNI_NETNS", &path),
                ("CNI_IFNAME", "eth1"),
                ("CNI_ARGS", &args),
            ],
            stdin,
        )
    }
}

/// The host-side link names in the node namespace that the plugin made.
fn plugin_links(node: &Node) -> Vec<String> {
    let out = node.ns.run(&["ip", "-j", "link", "show"]);
    let links: Value = serde_json::from_str(&out).unwrap();
    links
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["ifname"].as_str())
        .filter(|n| (n.starts_with("vmp") || n.starts_with("vmt")) && !n.contains('-'))
        .map(str::to_string)
        .collect()
}

fn blue_node() -> (Node, vmpath_tests::Vm) {
    let mut node = Node::new("c");
    let vm = node.add_vm(
        "vm1",
        "52:54:00:00:0c:01",
        &["10.30.0.11/24"],
        Some("10.30.0.1"),
    );
    node.write_config(
        "config.yaml",
        &yaml::docs(&[
            yaml::network(BLUE, 300, &["10.30.0.0/24"], &["10.30.0.1"], true),
            yaml::attachment("vm1", BLUE, "c", &vm.port, &vm.mac, &["10.30.0.11/24"]),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    (node, vm)
}

fn pod_ip(result: &Value) -> String {
    let ip = result["ips"][0]["address"]
        .as_str()
        .expect("an IP in the result");
    ip.split('/').next().unwrap().to_string()
}

#[test]
fn cni_add_gives_a_pod_a_port_that_reaches_a_vm_and_del_removes_it() {
    let (node, vm) = blue_node();
    let stdin = conf(&node, BLUE);

    let version = call(&node, "VERSION", &[], &stdin);
    let versions = version.ok()["supportedVersions"].clone();
    for v in ["0.4.0", "1.0.0", "1.1.0"] {
        assert!(
            versions.as_array().unwrap().iter().any(|x| x == v),
            "VERSION lists {v}: {versions}"
        );
    }

    let pod = Pod::new("p1");
    let add = pod.call(&node, "ADD", &stdin, "");
    let result = add.ok().clone();
    assert_eq!(result["cniVersion"], "1.1.0");
    let ifaces = result["interfaces"].as_array().unwrap();
    assert_eq!(ifaces.len(), 2, "host and sandbox interfaces: {result}");
    let host = ifaces[0]["name"].as_str().unwrap().to_string();
    assert!(host.starts_with("vmp") && host.len() <= 15, "{host}");
    assert_eq!(ifaces[1]["name"], "eth1");
    assert_eq!(ifaces[1]["sandbox"], pod.ns.path());
    assert_eq!(result["ips"][0]["gateway"], "10.30.0.1");
    assert_eq!(result["ips"][0]["interface"], 1);
    assert_eq!(result["routes"][0]["dst"], "0.0.0.0/0");
    let ip = pod_ip(&result);
    assert!(ip.starts_with("10.30.0."), "{ip}");
    // The plugin configured the pod: address and default route.
    let addrs = pod.ns.run(&["ip", "-4", "addr", "show", "dev", "eth1"]);
    assert!(addrs.contains(&ip), "{addrs}");

    // Real traffic through vmpath: pod <-> VM, pod -> gateway, TCP.
    assert!(pod.ns.ping("10.30.0.11", 3), "pod -> VM");
    assert!(vm.ns.ping(&ip, 3), "VM -> pod");
    assert!(pod.ns.ping("10.30.0.1", 2), "pod -> gateway");
    let report = vmpath_tests::iperf3(&vm.ns, &pod.ns, "10.30.0.11", false, 1);
    assert!(
        report["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0) > 0,
        "TCP pod -> VM moved no bytes"
    );

    // The agent lists it with the VMs.
    let vms: Value = serde_json::from_str(&node.ns.run(&[
        "curl",
        "-s",
        "--unix-socket",
        node.api_socket().to_str().unwrap(),
        "http://vmpath/v1/vms",
    ]))
    .unwrap();
    assert!(
        vms["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["vm"] == pod.name.as_str() && a["state"] == "local"),
        "{vms}"
    );

    // CHECK agrees; CHECK with a prevResult that names another MAC does not.
    pod.call(&node, "CHECK", &stdin, "").ok();
    let mut with_prev: Value = serde_json::from_str(&stdin).unwrap();
    let mut prev = result.clone();
    prev["interfaces"][1]["mac"] = json!("02:00:00:00:00:99");
    with_prev["prevResult"] = prev;
    let msg = pod
        .call(&node, "CHECK", &with_prev.to_string(), "")
        .error(102);
    assert!(msg.contains("MAC"), "{msg}");

    // DEL removes the port, twice is fine; the traffic stops.
    pod.call(&node, "DEL", &stdin, "").ok();
    assert!(plugin_links(&node).is_empty(), "{:?}", plugin_links(&node));
    pod.call(&node, "DEL", &stdin, "").ok();
    assert!(!vm.ns.ping(&ip, 1), "the pod is gone");
    // CHECK after DEL fails with the agent's word.
    pod.call(&node, "CHECK", &stdin, "").error(102);

    // The same pod, a new sandbox: the persistent claim gives the same IP.
    let again = Pod {
        ns: Netns::new(format!("{}r", pod.ns.name)),
        container_id: format!("{}r", pod.container_id),
        name: pod.name.clone(),
    };
    let result = again.call(&node, "ADD", &stdin, "").ok().clone();
    assert_eq!(pod_ip(&result), ip, "a restarted pod keeps its address");
    assert!(again.ns.ping("10.30.0.11", 2));
    again.call(&node, "DEL", &stdin, "").ok();
}

#[test]
fn cni_errors_are_json_with_code_and_message_and_leave_nothing_behind() {
    let (mut node, vm) = blue_node();
    let stdin = conf(&node, BLUE);
    let pod = Pod::new("e1");

    // DEL without ADD (and with a netns that is gone) succeeds.
    let gone = Pod {
        ns: Netns::new(format!("vt{}-gone", unique_tag())),
        container_id: "nosuchcontainer".into(),
        name: "nosuch".into(),
    };
    let _ = run_status(&["ip", "netns", "del", &gone.ns.name]);
    gone.call(&node, "DEL", &stdin, "").ok();

    // Bad JSON.
    let msg = pod.call(&node, "ADD", "{not json", "").error(6);
    assert!(!msg.is_empty());
    // No network in the config.
    let no_net = json!({"cniVersion": "1.1.0", "name": "x", "type": "vmpath-cni"}).to_string();
    let msg = pod.call(&node, "ADD", &no_net, "").error(7);
    assert!(msg.contains("network"), "{msg}");
    // A network vmpath does not have.
    let msg = pod.call(&node, "ADD", &conf(&node, "green"), "").error(7);
    assert!(msg.contains("green"), "{msg}");
    // The VM's MAC requested for a pod: refused, and no link is left.
    let msg = pod
        .call(&node, "ADD", &stdin, &format!(";MAC={}", vm.mac))
        .error(100);
    assert!(msg.contains("52:54:00:00:0c:01"), "{msg}");
    assert!(plugin_links(&node).is_empty(), "{:?}", plugin_links(&node));
    assert!(
        pod.ns
            .run_status(&["ip", "link", "show", "eth1"])
            .status
            .code()
            != Some(0),
        "eth1 left in the pod"
    );

    // GC: two pods, one listed as valid: the other's port goes.
    let keep = Pod::new("g1");
    let drop = Pod::new("g2");
    let kept = keep.call(&node, "ADD", &stdin, "").ok().clone();
    let dropped = drop.call(&node, "ADD", &stdin, "").ok().clone();
    let mut gc: Value = serde_json::from_str(&stdin).unwrap();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": keep.container_id, "ifname": "eth1"}]);
    call(&node, "GC", &[], &gc.to_string()).ok();
    let links = plugin_links(&node);
    let kept_host = kept["interfaces"][0]["name"].as_str().unwrap();
    let dropped_host = dropped["interfaces"][0]["name"].as_str().unwrap();
    assert!(links.iter().any(|l| l == kept_host), "{links:?}");
    assert!(!links.iter().any(|l| l == dropped_host), "{links:?}");
    keep.call(&node, "CHECK", &stdin, "").ok();
    drop.call(&node, "CHECK", &stdin, "").error(102);

    // STATUS: ready with the agent, 50 without; ADD then fails clearly.
    call(&node, "STATUS", &[], &stdin).ok();
    node.kill_agent();
    let status = call(&node, "STATUS", &[], &stdin);
    assert_eq!(status.code, Some(50), "{}", status.stdout);
    status.error(50);
    let msg = pod.call(&node, "ADD", &stdin, "").error(11);
    assert!(msg.contains("not reachable"), "{msg}");
    assert_eq!(plugin_links(&node), vec![kept_host.to_string()]);

    // A restarted agent still has the endpoint (state dir).
    node.start_agent();
    wait_for(
        "the agent to serve the kept endpoint",
        std::time::Duration::from_secs(20),
        || keep.call(&node, "CHECK", &stdin, "").code == Some(0),
    );
    keep.call(&node, "DEL", &stdin, "").ok();
}
