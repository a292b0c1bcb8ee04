//! `vmpath agent --source kubernetes` against the test bed's API server
//! (in memory, over real HTTP; `vmpath_tests::kube_api`): kube-rs
//! watchers list and watch the cluster's objects, the agent derives and
//! programs a KubeVirt VM and a pod from them, picks up a change after its
//! watch was answered 410 Gone (a relist), and keeps forwarding when the
//! API server goes away.

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{Netns, Node, kube_api::ApiServer, multus, unique_tag, wait_for};

const NETWORK: &str = include_str!("../../agent/src/cluster/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/cluster/fixtures/vm.yaml");
const LAUNCHER: &str = "virt-launcher-vm1-x7k2p";
const LAUNCHER_IFNAME: &str = "pod16477688c0e";

/// The fixtures' objects as the API server holds them, on node `node`.
fn objects(node: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for text in [NETWORK, VM] {
        let text = text.replace("node-a", node);
        out.extend(vmpath::config::source::parse(text.as_bytes()).unwrap());
    }
    // The v1 Node's address is not in the test bed: no overlay here.
    out.retain(|o| o["kind"] != "Node");
    out
}

/// A plain pod on the vmpath NAD (Multus's short form, `net1`).
fn web_pod(name: &str, node: &str) -> Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "prod",
                     "annotations": {"k8s.v1.cni.cncf.io/networks": "prod/blue"}},
        "spec": {"nodeName": node, "containers": [{"name": "web", "image": "busybox"}]},
        "status": {"phase": "Running"},
    })
}

fn attachment<'a>(status: &'a Value, vm: &str) -> Option<&'a Value> {
    status["attachments"]
        .as_array()?
        .iter()
        .find(|a| a["vm"] == vm)
}

#[test]
fn the_kubernetes_source_programs_a_vm_relists_on_410_and_outlives_the_api_server() {
    let mut node = Node::new("ks");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    let mut server = ApiServer::start(&node.ns.path());
    for o in objects(&node.name) {
        server.put(o);
    }
    server.put(web_pod("web-0", &node.name));
    server.serve_agent_of(&mut node);
    node.start_agent();
    wait_for(
        "the agent to list the cluster",
        Duration::from_secs(30),
        || {
            node.status().is_some_and(|s| {
                attachment(&s, "vm1").is_some() && attachment(&s, "web-0").is_some()
            })
        },
    );
    for collection in [
        "/api/v1/pods",
        "/apis/kubevirt.io/v1/virtualmachineinstances",
    ] {
        assert!(server.lists(collection) >= 1, "{collection} listed");
    }

    // The runtime creates both pods' interfaces; the agent binds them.
    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let web = Netns::new(format!("vt{tag}-web"));
    let call = |pod: &'static str, ifname: &'static str, netns: &Netns, command: &str| {
        multus::call(
            &node,
            command,
            &multus::Call {
                conf: &conf,
                pod_namespace: "prod",
                pod,
                ifname,
                netns,
                container: &format!("c{tag}{pod}"),
            },
        )
    };
    let (ok, result) = call(LAUNCHER, LAUNCHER_IFNAME, &launcher, "ADD");
    assert!(ok, "ADD of the virt-launcher pod: {result}");
    let (ok, result) = call("web-0", "net1", &web, "ADD");
    assert!(ok, "ADD of web-0: {result}");
    let web_ip = result["ips"][0]["address"].as_str().unwrap().to_string();
    let web_ip = web_ip.split('/').next().unwrap().to_string();

    // The VM, as its VMI and claim say.
    for cmd in [
        vec![
            "ip",
            "link",
            "set",
            LAUNCHER_IFNAME,
            "address",
            "02:00:00:31:00:0b",
        ],
        vec!["ip", "addr", "add", "10.31.0.11/24", "dev", LAUNCHER_IFNAME],
        vec!["ip", "link", "set", LAUNCHER_IFNAME, "up"],
    ] {
        launcher.run(&cmd);
    }
    assert!(launcher.ping(&web_ip, 3), "VM vm1 -> pod web-0");
    assert!(web.ping("10.31.0.11", 3), "pod web-0 -> VM vm1");

    // A pod added, the history compacted past it and the watches ended:
    // the watchers resume from a resourceVersion that is gone, get 410,
    // relist, and the pod shows up.
    let pod_lists = server.lists("/api/v1/pods");
    server.compact_with(vec![web_pod("web-1", &node.name)]);
    wait_for("web-1 after the relist", Duration::from_secs(30), || {
        node.status()
            .is_some_and(|s| attachment(&s, "web-1").is_some())
    });
    assert!(
        server.gone("/api/v1/pods") >= 1,
        "the pods watch got 410 Gone"
    );
    assert!(server.lists("/api/v1/pods") > pod_lists, "and relisted");

    // The API server goes away: nothing is withdrawn, traffic flows, and
    // a known pod's new sandbox is still programmed.
    server.stop();
    wait_for(
        "the watch error in the agent's log",
        Duration::from_secs(30),
        || node.agent_log().contains("keeping what was read"),
    );
    assert!(
        launcher.ping(&web_ip, 2),
        "VM -> pod with the API server gone"
    );
    call("web-0", "net1", &web, "DEL");
    let web2 = Netns::new(format!("vt{tag}-web2"));
    let (ok, result) = multus::call(
        &node,
        "ADD",
        &multus::Call {
            conf: &conf,
            pod_namespace: "prod",
            pod: "web-0",
            ifname: "net1",
            netns: &web2,
            container: &format!("c{tag}web0b"),
        },
    );
    assert!(ok, "ADD with the API server gone: {result}");
    assert!(web2.ping("10.31.0.11", 3), "the new sandbox reaches the VM");
    let status = node.status().unwrap();
    assert!(attachment(&status, "vm1").is_some(), "{status}");
}
