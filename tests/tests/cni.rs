//! The `vmpath-cni` plugin, invoked as a container runtime does (CNI_*
//! environment + config on stdin, in the node's network namespace) against
//! a real agent: pods get ports, addresses and traffic to a namespace VM on
//! the same network; DEL, CHECK, GC, STATUS and VERSION; every error is CNI
//! error JSON with a code and a message.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};
use vmpath_tests::{
    AGENT_START_BOUND, Netns, Node,
    multus::{self, cni_bin},
    run_status, unique_tag, wait_for, yaml,
};

const BLUE: &str = "blue";
/// A network whose namespaceSelector refuses the `default` namespace (where
/// podman's containers are) and admits namespaces labelled `team: tenant`.
const TENANT: &str = "tenant";
const TENANT_NETWORK: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: tenant}
spec:
  id: 301
  subnets: [10.31.0.0/24]
  defaultGatewayIPs: [10.31.0.1]
  namespaceSelector:
    matchLabels: {team: tenant}
    matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [default]}]
---
apiVersion: v1
kind: Namespace
metadata:
  name: tenant-a
  labels: {team: tenant}
---
apiVersion: v1
kind: Namespace
metadata:
  name: default
  labels: {team: tenant}
";

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
    let out = multus::run_plugin(node, command, env, stdin);
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

    /// `CNI_ARGS` as Multus passes them; `extra` may name another
    /// namespace (`;K8S_POD_NAMESPACE=...`).
    fn args(&self, extra: &str) -> String {
        let namespace = if extra.contains("K8S_POD_NAMESPACE=") {
            ""
        } else {
            ";K8S_POD_NAMESPACE=default"
        };
        format!(
            "IgnoreUnknown=1{namespace};K8S_POD_NAME={}{extra}",
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
            yaml::network(BLUE, 300, &["10.30.0.0/24"], &["10.30.0.1"], true)
                + "  dhcp: {dnsServers: [10.30.0.53], searchDomains: [blue.example]}\n",
            yaml::attachment("vm1", BLUE, "c", &vm.port, &vm.mac, &["10.30.0.11/24"]),
            TENANT_NETWORK.to_string(),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    (node, vm)
}

/// Endpoints the agent holds.
fn endpoint_count(node: &Node) -> usize {
    let list: Value = serde_json::from_str(&node.ns.run(&[
        "curl",
        "-s",
        "--unix-socket",
        node.api_socket().to_str().unwrap(),
        "http://vmpath/v1/endpoints",
    ]))
    .unwrap();
    list["endpoints"].as_array().map_or(0, Vec::len)
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
    // The host side carries the mark the agent's port-eligibility rule
    // admits CNI ports by.
    let link = node.ns.run(&["ip", "-d", "link", "show", "dev", &host]);
    assert!(
        link.contains(&format!(
            "alias {}",
            vmpath::resolve::port_eligibility::CNI_MARKER
        )),
        "{link}"
    );
    assert_eq!(ifaces[1]["name"], "eth1");
    assert_eq!(ifaces[1]["sandbox"], pod.ns.path());
    assert_eq!(result["ips"][0]["gateway"], "10.30.0.1");
    assert_eq!(result["ips"][0]["interface"], 1);
    assert_eq!(result["routes"][0]["dst"], "0.0.0.0/0");
    // The network's DNS servers and search domains (its DHCP options).
    assert_eq!(
        result["dns"]["nameservers"],
        json!(["10.30.0.53"]),
        "{result}"
    );
    assert_eq!(result["dns"]["search"], json!(["blue.example"]), "{result}");
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

    // The same pod, a new sandbox: its address, released at DEL, is still
    // free, and allocation starts where that identity's does.
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

/// cniVersion 0.4.0 and 1.0.0 configs, as a runtime of that version calls
/// the plugin: the result in that version's layout, CHECK and DEL with the
/// ADD's result as `prevResult`, and a chained ADD appended to a
/// `prevResult` with its interface indexes shifted.
/// A network with hundreds of VMs: the agent's answer about it is large
/// enough to come chunked (HTTP/1.1), and the plugin still reads it.
#[test]
fn cni_add_works_on_a_network_with_hundreds_of_vms() {
    let mut node = Node::new("h");
    let mut docs = vec![yaml::network(
        "big",
        310,
        &["10.31.0.0/16"],
        &["10.31.0.1"],
        true,
    )];
    // VMs whose ports are not on this node yet: the agent holds them and
    // lists them under the network.
    for i in 0..400u32 {
        docs.push(yaml::attachment(
            &format!("vm{i}"),
            "big",
            "h",
            &format!("vmpwait{i}"),
            &format!("52:54:00:31:{:02x}:{:02x}", i / 256, i % 256),
            &[&format!("10.31.{}.{}/16", 1 + i / 250, 2 + i % 250)],
        ));
    }
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.start_agent();
    wait_for("the agent to read 400 VMs", AGENT_START_BOUND, || {
        node.status()
            .is_some_and(|s| s["attachments"].as_array().is_some_and(|a| a.len() == 400))
    });
    let answer = node.ns.run(&[
        "curl",
        "-si",
        "--unix-socket",
        node.api_socket().to_str().unwrap(),
        "http://vmpath/v1/networks/big",
    ]);
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "the answer is not chunked, so this test shows nothing: {}",
        answer.lines().take(8).collect::<Vec<_>>().join("\n")
    );

    let pod = Pod::new("big");
    let result = pod.call(&node, "ADD", &conf(&node, "big"), "").ok().clone();
    assert!(pod_ip(&result).starts_with("10.31."), "{result}");
    pod.call(&node, "DEL", &conf(&node, "big"), "").ok();
}

#[test]
fn cni_older_versions_get_their_result_layout_and_prev_result() {
    let (node, vm) = blue_node();
    for version in ["0.4.0", "1.0.0"] {
        let mut config: Value = serde_json::from_str(&conf(&node, BLUE)).unwrap();
        config["cniVersion"] = json!(version);
        let pod = Pod::new(&format!("v{}", &version[..1]));
        let result = pod.call(&node, "ADD", &config.to_string(), "").ok().clone();
        assert_eq!(result["cniVersion"], version, "{result}");
        assert_eq!(result["interfaces"][1]["name"], "eth1", "{result}");
        let ip = &result["ips"][0];
        if version == "0.4.0" {
            // 0.4.0: every IP names its family.
            assert_eq!(ip["version"], "4", "{result}");
        } else {
            assert!(ip.get("version").is_none(), "{result}");
        }
        assert!(pod.ns.ping("10.30.0.11", 2), "{version} pod -> VM");

        // CHECK and DEL get the ADD's result as prevResult.
        let mut with_prev = config.clone();
        with_prev["prevResult"] = result.clone();
        pod.call(&node, "CHECK", &with_prev.to_string(), "").ok();
        let mut wrong = with_prev.clone();
        wrong["prevResult"]["interfaces"][1]["name"] = json!("eth9");
        let msg = pod.call(&node, "CHECK", &wrong.to_string(), "").error(102);
        assert!(msg.contains("prevResult does not list eth1"), "{msg}");
        pod.call(&node, "DEL", &with_prev.to_string(), "").ok();
        assert!(plugin_links(&node).is_empty(), "{:?}", plugin_links(&node));
        assert!(
            !vm.ns.ping(&pod_ip(&result), 1),
            "{version}: the pod is gone"
        );
    }

    // Chained after another plugin: its result comes first, ours is
    // appended, our IP points at our sandbox interface (index 2).
    let mut chained: Value = serde_json::from_str(&conf(&node, BLUE)).unwrap();
    chained["prevResult"] = json!({
        "cniVersion": "1.1.0",
        "interfaces": [{"name": "lo0", "mac": "00:00:00:00:00:00"}],
        "ips": [],
    });
    let pod = Pod::new("ch");
    let result = pod
        .call(&node, "ADD", &chained.to_string(), "")
        .ok()
        .clone();
    let names: Vec<&str> = result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(names.len(), 3, "{result}");
    assert_eq!(names[0], "lo0");
    assert_eq!(names[2], "eth1");
    assert_eq!(result["ips"][0]["interface"], 2, "{result}");
    pod.call(&node, "DEL", &chained.to_string(), "").ok();
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

    // A namespace the network's namespaceSelector does not admit: refused
    // with the network, the namespace and the rule; nothing left behind.
    let tenant = conf(&node, TENANT);
    let msg = pod.call(&node, "ADD", &tenant, "").error(100);
    assert!(
        msg.contains("namespace \"default\" may not use network \"tenant\"")
            && msg.contains("namespaceSelector {matchLabels: {team: tenant}"),
        "{msg}"
    );
    assert!(plugin_links(&node).is_empty(), "{:?}", plugin_links(&node));
    assert_eq!(endpoint_count(&node), 0, "the refused endpoint is gone");
    // A namespace it admits (K8S_POD_NAMESPACE, as Multus passes it).
    let admitted = Pod::new("t1");
    let result = admitted
        .call(&node, "ADD", &tenant, ";K8S_POD_NAMESPACE=tenant-a")
        .ok()
        .clone();
    assert!(pod_ip(&result).starts_with("10.31.0."), "{result}");
    admitted.call(&node, "DEL", &tenant, "").ok();

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

/// A node whose only network is `jobs`, a /29 with IPAM: five addresses
/// for pods (network, broadcast and gateway are not given out).
fn jobs_node() -> Node {
    let mut node = Node::new("j");
    node.write_config(
        "config.yaml",
        &yaml::network("jobs", 320, &["10.32.0.0/29"], &["10.32.0.1"], true),
    );
    node.start_agent();
    wait_for("the agent to serve jobs", Duration::from_secs(90), || {
        call(&node, "STATUS", &[], &conf(&node, "jobs")).code == Some(0)
    });
    node
}

#[test]
fn cni_deleted_pods_release_their_addresses_and_an_exhausted_pool_fails_the_add() {
    let node = jobs_node();
    let stdin = conf(&node, "jobs");
    // Jobs come and go: more over time than the pool holds at once.
    let mut names = Vec::new();
    for i in 1..=7 {
        let job = Pod::new(&format!("job{i}"));
        let result = job.call(&node, "ADD", &stdin, "").ok().clone();
        assert!(pod_ip(&result).starts_with("10.32.0."), "{result}");
        job.call(&node, "DEL", &stdin, "").ok();
        names.push(job.name.clone());
    }
    // The agent's state keeps nothing of a deleted plain pod.
    let state = std::fs::read_to_string(node.state_dir.join("cni-endpoints.json")).unwrap();
    for name in &names {
        assert!(!state.contains(name.as_str()), "{name} kept: {state}");
    }

    // Five pods hold the five addresses; a sixth ADD fails, naming the
    // network and the pool, and leaves nothing behind.
    let holders: Vec<Pod> = (1..=5).map(|i| Pod::new(&format!("h{i}"))).collect();
    let mut ips = std::collections::BTreeSet::new();
    for h in &holders {
        ips.insert(pod_ip(h.call(&node, "ADD", &stdin, "").ok()));
    }
    assert_eq!(ips.len(), 5, "{ips:?}");
    let sixth = Pod::new("h6");
    let msg = sixth.call(&node, "ADD", &stdin, "").error(100);
    assert!(
        msg.contains("IPAM pool exhausted")
            && msg.contains("network \"jobs\"")
            && msg.contains("10.32.0.0/29"),
        "{msg}"
    );
    assert_eq!(plugin_links(&node).len(), 5, "{:?}", plugin_links(&node));
    assert_eq!(endpoint_count(&node), 5, "the refused endpoint is gone");
    assert!(
        sixth
            .ns
            .run_status(&["ip", "link", "show", "eth1"])
            .status
            .code()
            != Some(0),
        "eth1 left in the refused pod"
    );
    // One pod goes: the sixth gets its address.
    holders[0].call(&node, "DEL", &stdin, "").ok();
    let result = sixth.call(&node, "ADD", &stdin, "").ok().clone();
    assert!(pod_ip(&result).starts_with("10.32.0."), "{result}");
    for p in holders.iter().skip(1).chain([&sixth]) {
        p.call(&node, "DEL", &stdin, "").ok();
    }
}

#[test]
fn cni_a_second_add_of_an_attached_container_interface_is_refused() {
    let (node, vm) = blue_node();
    let stdin = conf(&node, BLUE);
    let first = Pod::new("s1");
    let result = first.call(&node, "ADD", &stdin, "").ok().clone();
    let host = result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let ip = pod_ip(&result);

    // The same container and interface in another sandbox, no DEL between.
    let second = Pod {
        ns: Netns::new(format!("{}b", first.ns.name)),
        container_id: first.container_id.clone(),
        name: first.name.clone(),
    };
    let msg = second.call(&node, "ADD", &stdin, "").error(100);
    assert!(
        msg.contains(&format!(
            "container {} interface eth1 is attached already",
            first.container_id
        )) && msg.contains(&first.ns.path()),
        "{msg}"
    );
    assert!(
        second
            .ns
            .run_status(&["ip", "link", "show", "eth1"])
            .status
            .code()
            != Some(0),
        "eth1 made in the second sandbox"
    );
    // And again in the first sandbox: refused the same way.
    first.call(&node, "ADD", &stdin, "").error(100);

    // The first sandbox is untouched: its port, its entry, its traffic.
    assert_eq!(plugin_links(&node), vec![host]);
    first.call(&node, "CHECK", &stdin, "").ok();
    assert!(first.ns.ping("10.30.0.11", 2), "pod -> VM");
    assert!(vm.ns.ping(&ip, 2), "VM -> pod");

    // After DEL the container interface may be added anew.
    first.call(&node, "DEL", &stdin, "").ok();
    second.call(&node, "ADD", &stdin, "").ok();
    second.call(&node, "DEL", &stdin, "").ok();
}

#[test]
fn cni_add_while_the_agent_has_no_view_yet_is_try_again_later() {
    // The agent runs and answers on its socket, but has no view of any
    // network yet (here: its config dir is empty, as before a ConfigMap is
    // mounted or the cluster's objects are listed).
    let mut node = Node::new("s");
    node.start_agent();
    wait_for("the agent's socket", Duration::from_secs(20), || {
        node.api_socket().exists()
    });
    node.wait_log("data path left as it is", Duration::from_secs(90));
    let stdin = conf(&node, BLUE);
    let pod = Pod::new("w1");
    let msg = pod.call(&node, "ADD", &stdin, "").error(11);
    assert!(msg.contains("starting"), "{msg}");
    assert!(plugin_links(&node).is_empty(), "{:?}", plugin_links(&node));
    assert_eq!(call(&node, "STATUS", &[], &stdin).code, Some(50));

    // Once it has its networks, the same ADD works.
    node.write_config(
        "config.yaml",
        &yaml::network(BLUE, 300, &["10.30.0.0/24"], &["10.30.0.1"], true),
    );
    wait_for("the agent to serve blue", Duration::from_secs(90), || {
        call(&node, "STATUS", &[], &stdin).code == Some(0)
    });
    let result = pod.call(&node, "ADD", &stdin, "").ok().clone();
    assert!(pod_ip(&result).starts_with("10.30.0."), "{result}");
    pod.call(&node, "DEL", &stdin, "").ok();
}

// ---------------------------------------------------------------------------
// podman's CNI backend: real containers, no image pulled (busybox rootfs)
// ---------------------------------------------------------------------------

/// A private podman: its own storage, CNI config dir and plugin dir, run in
/// the node's namespace so the plugin puts the host sides there.
struct Podman {
    dir: PathBuf,
    node_ns: String,
    names: std::cell::RefCell<Vec<String>>,
}

impl Podman {
    fn new(node: &Node, networks: &[(&str, &str)]) -> Podman {
        let dir = std::env::temp_dir().join(format!("vmpath-podman-{}", unique_tag()));
        let _ = std::fs::remove_dir_all(&dir);
        let rootfs = dir.join("rootfs");
        for d in ["bin", "etc", "proc", "sys", "dev", "tmp", "conf", "plugins"] {
            let path = if d == "conf" || d == "plugins" {
                dir.join(d)
            } else {
                rootfs.join(d)
            };
            std::fs::create_dir_all(path).unwrap();
        }
        std::fs::copy("/bin/busybox", rootfs.join("bin/busybox"))
            .expect("busybox-static (cargo xtask setup installs it)");
        for applet in ["sh", "sleep", "ping", "ip", "nc"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        std::os::unix::fs::symlink(cni_bin(), dir.join("plugins/vmpath-cni")).unwrap();
        for (name, network) in networks {
            let conflist = json!({
                "cniVersion": "1.0.0",
                "name": name,
                "plugins": [{
                    "type": "vmpath-cni",
                    "network": network,
                    "socket": node.api_socket(),
                    "capabilities": {"mac": true, "ips": true},
                }],
            });
            std::fs::write(
                dir.join("conf").join(format!("{name}.conflist")),
                conflist.to_string(),
            )
            .unwrap();
        }
        std::fs::write(
            dir.join("containers.conf"),
            format!(
                "[network]\nnetwork_backend=\"cni\"\nnetwork_config_dir=\"{}\"\ncni_plugin_dirs=[\"{}\"]\n",
                dir.join("conf").display(),
                dir.join("plugins").display()
            ),
        )
        .unwrap();
        Podman {
            dir,
            node_ns: node.ns.path(),
            names: Default::default(),
        }
    }

    fn podman(&self, args: &[&str]) -> std::process::Output {
        let d = |p: &str| self.dir.join(p).display().to_string();
        Command::new("nsenter")
            .arg(format!("--net={}", self.node_ns))
            .arg("podman")
            .env("CONTAINERS_CONF", d("containers.conf"))
            .args(["--root", &d("root"), "--runroot", &d("runroot")])
            // crun refuses this host's hybrid cgroups.
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
            .args(["--network-backend", "cni", "--cni-config-dir", &d("conf")])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running podman (cargo xtask setup installs it)")
    }

    /// Starts a container that sleeps; `Err` carries podman's stderr.
    fn start(&self, name: &str, network: &str) -> Result<(), String> {
        self.names.borrow_mut().push(name.to_string());
        let rootfs = self.dir.join("rootfs").display().to_string();
        let out = self.podman(&[
            "run",
            "-d",
            "--name",
            name,
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            "--cap-add",
            "NET_RAW",
            "--network",
            network,
            "--rootfs",
            &rootfs,
            "/bin/sleep",
            "600",
        ]);
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    fn remove(&self, name: &str) {
        let out = self.podman(&["rm", "-f", "-t", "0", name]);
        assert!(
            out.status.success(),
            "podman rm: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The container's network namespace, as a named netns not to delete.
    fn netns(&self, name: &str) -> std::mem::ManuallyDrop<Netns> {
        let out = self.podman(&["inspect", "-f", "{{.NetworkSettings.SandboxKey}}", name]);
        let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let name = key
            .strip_prefix("/run/netns/")
            .unwrap_or_else(|| panic!("sandbox {key:?} is not a named netns"));
        std::mem::ManuallyDrop::new(Netns {
            name: name.to_string(),
        })
    }

    fn ipv4(&self, name: &str) -> String {
        let out = self
            .netns(name)
            .run(&["ip", "-4", "-j", "addr", "show", "dev", "eth0"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        v[0]["addr_info"][0]["local"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} has no IPv4 address: {out}"))
            .to_string()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for name in self.names.borrow().iter() {
            let _ = self.podman(&["rm", "-f", "-t", "0", name]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn podman_containers_and_a_vm_share_a_vmpath_network() {
    let (node, vm) = blue_node();
    let tag = unique_tag();
    let podman = Podman::new(
        &node,
        &[("vblue", BLUE), ("vgreen", "green"), ("vtenant", TENANT)],
    );
    let (c1, c2) = (format!("c1-{tag}"), format!("c2-{tag}"));
    podman.start(&c1, "vblue").unwrap();
    podman.start(&c2, "vblue").unwrap();
    let ip1 = podman.ipv4(&c1);
    let ip2 = podman.ipv4(&c2);
    assert_ne!(ip1, ip2);
    let ns1 = podman.netns(&c1);
    let ns2 = podman.netns(&c2);

    // Ping between both containers, the VM and the gateway.
    assert!(ns1.ping("10.30.0.11", 2), "c1 -> VM");
    assert!(ns1.ping(&ip2, 2), "c1 -> c2");
    assert!(vm.ns.ping(&ip2, 2), "VM -> c2");
    assert!(ns2.ping("10.30.0.1", 2), "c2 -> gateway");
    // TCP and UDP with iperf3, container <-> VM.
    let tcp = vmpath_tests::iperf3(&vm.ns, &ns1, "10.30.0.11", false, 1);
    assert!(
        tcp["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0) > 0,
        "TCP"
    );
    let udp = vmpath_tests::iperf3(&ns2, &vm.ns, &ip2, true, 1);
    assert!(
        udp["end"]["sum"]["packets"].as_u64().unwrap_or(0) > 0,
        "UDP {udp}"
    );
    assert_eq!(plugin_links(&node).len(), 2, "{:?}", plugin_links(&node));

    // Removing a container removes its port; the other keeps working.
    podman.remove(&c2);
    assert_eq!(plugin_links(&node).len(), 1, "{:?}", plugin_links(&node));
    assert!(!vm.ns.ping(&ip2, 1), "c2 is gone");
    assert!(vm.ns.ping(&ip1, 1), "c1 still reachable");

    // The same pod (container name) again: the same address, still free.
    podman.start(&c2, "vblue").unwrap();
    assert_eq!(podman.ipv4(&c2), ip2, "a restarted container keeps its IP");
    assert!(podman.netns(&c2).ping("10.30.0.11", 2));

    // A network vmpath does not have: the container does not start, and
    // podman shows vmpath's error.
    let err = podman.start(&format!("c3-{tag}"), "vgreen").unwrap_err();
    assert!(err.contains("no network named \"green\""), "{err}");
    assert_eq!(plugin_links(&node).len(), 2, "{:?}", plugin_links(&node));

    // A network whose namespaceSelector does not admit the container's
    // namespace (podman passes none: `default`): the container does not
    // start, podman shows vmpath's refusal, no port is left.
    let err = podman.start(&format!("c4-{tag}"), "vtenant").unwrap_err();
    assert!(
        err.contains("namespace \"default\" may not use network \"tenant\""),
        "{err}"
    );
    assert_eq!(plugin_links(&node).len(), 2, "{:?}", plugin_links(&node));
    assert_eq!(endpoint_count(&node), 2, "only c1's and c2's endpoints");
}

#[test]
fn cni_vm_pod_holds_no_address_and_the_vm_takes_it_by_dhcp() {
    let (node, vm) = blue_node();
    let stdin = conf(&node, BLUE);
    let pod = Pod::new("v1");
    let result = pod
        .call(&node, "ADD", &stdin, ";vmpath.dev/vm=true")
        .ok()
        .clone();
    let ip = pod_ip(&result);
    // The pod namespace holds no IP: the VM behind it asks by DHCP.
    let addrs = pod
        .ns
        .run(&["ip", "-4", "-j", "addr", "show", "dev", "eth1"]);
    assert!(!addrs.contains("10.30.0."), "{addrs}");
    pod.call(&node, "CHECK", &stdin, "").ok();

    let dir = std::env::temp_dir().join(format!("vmpath-cni-dhcp-{}", unique_tag()));
    std::fs::create_dir_all(&dir).unwrap();
    let hook = dir.join("hook.sh");
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nif [ \"$1\" = bound ]; then\n  echo \"$ip\" > {}/lease\n  ip addr add \"$ip/$mask\" dev \"$interface\"\nfi\n",
            dir.display()
        ),
    )
    .unwrap();
    vmpath_tests::run(&["chmod", "+x", hook.to_str().unwrap()]);
    let out = vmpath_tests::udhcpc(&pod.ns, "eth1", hook.to_str().unwrap(), 5);
    assert!(
        out.status.success(),
        "udhcpc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lease = std::fs::read_to_string(dir.join("lease")).unwrap();
    assert_eq!(
        lease.trim(),
        ip,
        "DHCP gives the endpoint's claimed address"
    );
    assert!(
        pod.ns.ping("10.30.0.11", 2),
        "the VM reaches the namespace VM"
    );
    assert!(vm.ns.ping(&ip, 2));
    pod.call(&node, "DEL", &stdin, "").ok();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cni_install_copies_a_working_plugin() {
    let dir = std::env::temp_dir().join(format!("vmpath-cni-install-{}", unique_tag()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(cni_bin())
        .args(["install", dir.to_str().unwrap()])
        .env_remove("CNI_COMMAND")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let installed = Command::new(dir.join("vmpath-cni"))
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let version: Value = serde_json::from_slice(&installed.stdout).unwrap();
    assert_eq!(version["cniVersion"], "1.1.0", "{version}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a pod's coming and going may change on a node, read from where it
/// lives: the data path's maps of ports and endpoints (each entry dumped),
/// the node namespace's links, routes and neighbours, and the agent's
/// endpoints, status and state files.
fn node_footprint(node: &Node) -> Vec<(String, String)> {
    use vmpath_common::map_names as m;
    let mut out: Vec<(String, String)> = [
        m::PORTS,
        m::ENDPOINTS,
        m::ADDRESSES,
        m::FLOOD,
        m::POLICY_FLOOD,
        m::PORT_IDS,
        m::XDP_PORTS,
        m::LEARNED_MACS,
        m::LEARNED_IPS,
        m::ROUTED,
        m::MIGRATED,
    ]
    .iter()
    .map(|name| (format!("map {name}"), node.dump_map(name)))
    .collect();
    for (what, args) in [
        ("links", &["ip", "-o", "link", "show"][..]),
        (
            "IPv4 routes",
            &["ip", "-4", "route", "show", "table", "all"],
        ),
        (
            "IPv6 routes",
            &["ip", "-6", "route", "show", "table", "all"],
        ),
        ("neighbours", &["ip", "neigh", "show", "nud", "permanent"]),
    ] {
        // Link counters and flags move with traffic; names and order
        // are what a leak changes.
        let text = node.ns.run(args);
        let text = if what == "links" {
            text.lines()
                .filter_map(|l| l.split(": ").nth(1))
                .map(|n| n.split('@').next().unwrap_or(n).to_string())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            // A link's own IPv6 link-local address appears when the
            // kernel's DAD finishes, seconds after the link came up (the
            // VM's port): not the churn's doing. A leaked link still
            // shows in the links and in its `fe80::/64 dev` route.
            text.lines()
                .filter(|l| !l.starts_with("local fe80::"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        out.push((what.to_string(), text));
    }
    out.push(("endpoints".into(), endpoint_count(node).to_string()));
    out.push((
        "programmed ports".into(),
        format!("{:?}", node.programmed_ports()),
    ));
    // The agent's state file, as what it holds: none before the first
    // ADD, empty once every endpoint is gone.
    let state: Value = std::fs::read_to_string(node.state_dir.join("cni-endpoints.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    for part in ["endpoints", "kept"] {
        let held = match &state[part] {
            Value::Object(o) => o.keys().cloned().collect::<Vec<_>>(),
            Value::Array(a) => a.iter().map(Value::to_string).collect(),
            _ => Vec::new(),
        };
        out.push((format!("cni-endpoints.json {part}"), held.join("\n")));
    }
    out
}

/// Churn: pods come and go on one node, several alive at once and ADDs
/// overlapping (four threads, as a kubelet's sandboxes start in
/// parallel), 48 ADDs and 48 DELs. Every call is answered with success,
/// every pod gets a distinct address among those alive, and once the last
/// is deleted the node is exactly as before: no port, port id, endpoint,
/// address or flood member left in the maps, no link, route or neighbour
/// in the node, no endpoint in the agent's state; a pod made after the
/// churn reaches the VM that stayed.
#[test]
fn cni_churn_of_adds_and_dels_leaves_nothing_behind() {
    let (node, vm) = blue_node();
    let stdin = conf(&node, BLUE);
    let before = node_footprint(&node);

    const THREADS: usize = 4;
    const ROUNDS: usize = 4;
    const ALIVE: usize = 3;
    // Addresses held by pods alive now: no two at once.
    let alive = std::sync::Mutex::new(std::collections::BTreeMap::<String, String>::new());
    // Every pod's namespace lives until the end: its port can only go by
    // its DEL, not by the namespace's removal taking the veth with it.
    let sandboxes: Vec<Pod> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (node, stdin, alive) = (&node, &stdin, &alive);
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    for r in 0..ROUNDS {
                        // ALIVE pods of this thread at once, deleted in
                        // another order than they came.
                        let pods: Vec<Pod> = (0..ALIVE)
                            .map(|k| Pod::new(&format!("ch{t}{r}{k}")))
                            .collect();
                        for p in &pods {
                            let ip = pod_ip(p.call(node, "ADD", stdin, "").ok());
                            assert!(ip.starts_with("10.30.0."), "{ip}");
                            let holder = alive.lock().unwrap().insert(ip.clone(), p.name.clone());
                            assert_eq!(holder, None, "{ip} given to {} while held", p.name);
                        }
                        for p in pods.iter().rev() {
                            alive.lock().unwrap().retain(|_, pod| *pod != p.name);
                            p.call(node, "DEL", stdin, "").ok();
                        }
                        mine.extend(pods);
                    }
                    mine
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    assert_eq!(sandboxes.len(), THREADS * ROUNDS * ALIVE);

    // The port ids and addresses freed are given again and work: a pod
    // after the churn reaches the VM that stayed.
    let last = Pod::new("chlast");
    let ip = pod_ip(last.call(&node, "ADD", &stdin, "").ok());
    assert!(
        last.ns.ping("10.30.0.11", 3),
        "pod {ip} -> VM after the churn"
    );
    last.call(&node, "DEL", &stdin, "").ok();

    // A DEL is answered once the agent has removed the port; the round
    // that withdraws its routes and entries may still be running.
    let mut after = Vec::new();
    let settled = (0..60).any(|_| {
        after = node_footprint(&node);
        if after == before {
            return true;
        }
        std::thread::sleep(Duration::from_millis(500));
        false
    });
    if !settled {
        let changed: Vec<String> = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| b != a)
            .map(|((what, b), (_, a))| format!("--- {what} before:\n{b}\n--- after:\n{a}"))
            .collect();
        panic!(
            "{THREADS}x{ROUNDS}x{ALIVE} ADD/DEL left the node changed:\n{}",
            changed.join("\n")
        );
    }
    drop((sandboxes, vm));
}
