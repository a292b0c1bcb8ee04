//! `vmpath agent --source kubernetes` against the test bed's API server
//! (in memory, over real HTTP; `vmpath_tests::kube_api`): kube-rs
//! watchers list and watch the cluster's objects, the agent derives and
//! programs a KubeVirt VM and a pod from them, picks up a change after its
//! watch was answered 410 Gone (a relist), and keeps forwarding when the
//! API server goes away.

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{Netns, Node, kube_api::ApiServer, multus, unique_tag, wait_for};

const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/derive/fixtures/vm.yaml");
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
        "metadata": {"name": name, "namespace": "prod", "uid": format!("uid-{name}"),
                     "annotations": {"k8s.v1.cni.cncf.io/networks": "prod/blue"}},
        "spec": {"nodeName": node, "containers": [{"name": "web", "image": "busybox"}]},
        "status": {"phase": "Running"},
    })
}

/// The IPAMClaim `vmpath controller` makes for a plain pod's interface,
/// as it is once allocated (no controller runs here).
fn web_claim(name: &str, ip: &str) -> Value {
    serde_json::json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        "metadata": {"name": format!("{name}.net1"), "namespace": "prod",
                     "labels": {"vmpath.dev/pod-uid": format!("uid-{name}")},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": name,
                                          "uid": format!("uid-{name}"), "controller": true}]},
        "spec": {"network": "blue", "interface": "net1"},
        "status": {"ips": [ip]},
    })
}

/// A node whose agent reads the test bed's API server, which holds
/// `objects(node name)` with their claims vouched for in the ledger (as
/// vmpath controller allocates them); the agent started.
fn agent_against(name: &str, objects: impl FnOnce(&str) -> Vec<Value>) -> (Node, ApiServer) {
    agent_against_prepared(name, |_| {}, objects)
}

/// [`agent_against`], with `prepare` run on the node's namespace before
/// the API server and the agent start.
fn agent_against_prepared(
    name: &str,
    prepare: impl FnOnce(&Node),
    objects: impl FnOnce(&str) -> Vec<Value>,
) -> (Node, ApiServer) {
    let mut node = Node::new(name);
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    prepare(&node);
    let server = ApiServer::start(&node.ns.path());
    for o in objects(&node.name) {
        server.put(o);
    }
    server.vouch_for_claims();
    server.serve_agent_of(&mut node);
    node.start_agent();
    (node, server)
}

fn attachment<'a>(status: &'a Value, vm: &str) -> Option<&'a Value> {
    status["attachments"]
        .as_array()?
        .iter()
        .find(|a| a["vm"] == vm)
}

#[test]
fn the_kubernetes_source_programs_a_vm_relists_on_410_and_outlives_the_api_server() {
    let (node, mut server) = agent_against("ks", |node| {
        let mut out = objects(node);
        out.push(web_pod("web-0", node));
        out.push(web_claim("web-0", "10.31.0.20/24"));
        out
    });
    wait_for(
        "the agent to list the cluster",
        // After the data path loads: a minute and more on a busy machine.
        Duration::from_secs(120),
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
    server.compact_with(vec![
        web_pod("web-1", &node.name),
        web_claim("web-1", "10.31.0.21/24"),
    ]);
    server.vouch_for_claims();
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
    node.wait_log("keeping what was read", Duration::from_secs(30));
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

/// An Event with `reason` on the object `kind`/`name`: its message.
fn event_on(server: &ApiServer, kind: &str, name: &str, reason: &str) -> Option<String> {
    server.objects("/api/v1/events").iter().find_map(|e| {
        (e["involvedObject"]["kind"] == kind
            && e["involvedObject"]["name"] == name
            && e["reason"] == reason)
            .then(|| e["message"].as_str().unwrap_or("").to_string())
    })
}

#[test]
fn a_detected_mac_of_another_vm_is_refused_with_an_event_and_disturbs_nothing() {
    let mut node = Node::new("km");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    let server = ApiServer::start(&node.ns.path());
    for o in objects(&node.name) {
        server.put(o);
    }
    // vm2: the fixture's VM renamed, its own claim address, no MAC given
    // anywhere (the agent takes it from the VM's traffic).
    let vm2 = VM
        .replace("node-a", &node.name)
        .replace("vm1", "vm2")
        .replace("5d1c5a3e", "6d1c5a3e")
        .replace("2a7e0c4b", "3a7e0c4b")
        .replace("9e8d7c6b", "ae8d7c6b")
        .replace("10.31.0.11/24", "10.31.0.12/24")
        .replace("        macAddress: \"02:00:00:31:00:0b\"\n", "")
        .replace("\"mac\":\"02:00:00:31:00:0b\",", "");
    assert!(!vm2.contains("macAddress"), "the fixture's MACs");
    for o in vmpath::config::source::parse(vm2.as_bytes()).unwrap() {
        server.put(o);
    }
    server.put(web_pod("web-0", &node.name));
    server.put(web_claim("web-0", "10.31.0.20/24"));
    // The claims as vmpath controller allocated them, in its ledger.
    server.vouch_for_claims();
    server.serve_agent_of(&mut node);
    node.start_agent();
    wait_for(
        "the agent to list the cluster",
        // After the data path loads: a minute and more on a busy machine.
        Duration::from_secs(120),
        || {
            node.status().is_some_and(|s| {
                attachment(&s, "vm1").is_some()
                    && attachment(&s, "vm2").is_some()
                    && attachment(&s, "web-0").is_some()
            })
        },
    );

    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let vm1 = Netns::new(format!("vt{tag}-vm1"));
    let vm2 = Netns::new(format!("vt{tag}-vm2"));
    let web = Netns::new(format!("vt{tag}-web"));
    let add = |pod: &str, ifname: &str, netns: &Netns| {
        let (ok, result) = multus::call(
            &node,
            "ADD",
            &multus::Call {
                conf: &conf,
                pod_namespace: "prod",
                pod,
                ifname,
                netns,
                container: &format!("c{tag}{pod}"),
            },
        );
        assert!(ok, "ADD of {pod}: {result}");
        result
    };
    add(LAUNCHER, LAUNCHER_IFNAME, &vm1);
    add("virt-launcher-vm2-x7k2p", LAUNCHER_IFNAME, &vm2);
    let result = add("web-0", "net1", &web);
    let web_ip = result["ips"][0]["address"].as_str().unwrap().to_string();
    let web_ip = web_ip.split('/').next().unwrap().to_string();
    let up = |ns: &Netns, ip: &str| {
        for cmd in [
            vec![
                "ip",
                "link",
                "set",
                LAUNCHER_IFNAME,
                "address",
                "02:00:00:31:00:0b",
            ],
            vec!["ip", "addr", "add", ip, "dev", LAUNCHER_IFNAME],
            vec!["ip", "link", "set", LAUNCHER_IFNAME, "up"],
        ] {
            ns.run(&cmd);
        }
    };
    up(&vm1, "10.31.0.11/24");
    assert!(vm1.ping(&web_ip, 3), "VM vm1 -> pod web-0");

    // vm2 sends with vm1's MAC: refused, said on vm2's VMI.
    up(&vm2, "10.31.0.12/24");
    let _ = vm2.ping(&web_ip, 2);
    wait_for(
        "an Event on VMI vm2 naming vm1's MAC",
        Duration::from_secs(30),
        || {
            let _ = vm2.ping(&web_ip, 1);
            event_on(&server, "VirtualMachineInstance", "vm2", "Refused").is_some()
        },
    );
    let message = event_on(&server, "VirtualMachineInstance", "vm2", "Refused").unwrap();
    assert!(
        message.contains(
            "VM interface prod/vm2/blue uses MAC 02:00:00:31:00:0b, which belongs to prod/vm1/blue on network \"blue\""
        ),
        "{message}"
    );

    // Nothing else: vm1 keeps its traffic and its VMI is told nothing;
    // vm2's VMI gets no detected MAC; the Event is posted once.
    assert!(vm1.ping(&web_ip, 3), "VM vm1 -> pod web-0, after");
    assert!(web.ping("10.31.0.11", 3), "pod web-0 -> VM vm1, after");
    assert!(event_on(&server, "VirtualMachineInstance", "vm1", "Refused").is_none());
    let vmi2 = server
        .get(
            "/apis/kubevirt.io/v1/virtualmachineinstances",
            "prod",
            "vm2",
        )
        .unwrap();
    assert!(
        vmi2["metadata"]["annotations"]["vmpath.dev/detected-macs"].is_null(),
        "{vmi2}"
    );
    let posted = server
        .objects("/api/v1/events")
        .iter()
        .filter(|e| e["involvedObject"]["name"] == "vm2" && e["reason"] == "Refused")
        .count();
    assert_eq!(posted, 1, "one Event for one refusal");
}

/// The messages of the Events with `reason` on Node `node`.
fn node_events(server: &ApiServer, node: &str, reason: &str) -> Vec<String> {
    server
        .objects("/api/v1/events")
        .iter()
        .filter(|e| {
            e["involvedObject"]["kind"] == "Node"
                && e["involvedObject"]["name"] == node
                && e["reason"] == reason
        })
        .map(|e| e["message"].as_str().unwrap_or("").to_string())
        .collect()
}

#[test]
fn forwarding_off_on_the_node_is_an_event_on_its_node() {
    let (node, server) = agent_against_prepared(
        "kf",
        |node| {
            // The operator forgot IPv4 forwarding (a new namespace may copy
            // the host's: set here).
            node.ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
            node.ns
                .run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        },
        objects,
    );
    let v4 = "net.ipv4.ip_forward=0";
    wait_for(
        "the agent to serve vm1 (its port missing)",
        Duration::from_secs(90),
        || {
            node.status()
                .is_some_and(|s| attachment(&s, "vm1").is_some())
        },
    );
    let told = |server: &ApiServer| !node_events(server, &node.name, "ForwardingOff").is_empty();
    let start = std::time::Instant::now();
    while !told(&server) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no Event on the Node saying forwarding is off; events {:?}; log:\n{}",
            server.objects("/api/v1/events"),
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let events = node_events(&server, &node.name, "ForwardingOff");
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].contains(v4) && events[0].contains("network blue"),
        "{events:?}"
    );
    let event = server
        .objects("/api/v1/events")
        .into_iter()
        .find(|e| e["reason"] == "ForwardingOff")
        .unwrap();
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["metadata"]["namespace"], "default", "{event}");
    // `vmpath status` says the same.
    let cli_says = |node: &Node| {
        vmpath_tests::run(&[
            vmpath_tests::vmpath_bin().to_str().unwrap(),
            "status",
            "--api-socket",
            node.api_socket().to_str().unwrap(),
        ])
        .contains(v4)
    };
    assert!(cli_says(&node));
    // Fixed, then off again: said again, once.
    node.ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    wait_for("the problem to go", Duration::from_secs(10), || {
        !cli_says(&node)
    });
    node.ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
    wait_for("a second Event", Duration::from_secs(10), || {
        node_events(&server, &node.name, "ForwardingOff").len() == 2
    });
}

/// The runtime calls ADD as soon as a virt-launcher pod is scheduled, and
/// the agent's watches may deliver the pod before its VMI: the ADD waits
/// for the VMI (`api::endpoints::UNSEEN_VMI_GRACE`) rather than failing
/// the sandbox, and the VM is programmed when it comes.
#[test]
fn a_launchers_add_before_its_vmi_is_seen_waits_for_it() {
    let mut vmi = Vec::new();
    let (node, server) = agent_against("kw", |node| {
        let (vmis, rest): (Vec<Value>, Vec<Value>) = objects(node)
            .into_iter()
            .partition(|o| o["kind"] == "VirtualMachineInstance");
        vmi = vmis;
        rest
    });
    wait_for(
        "the agent to list the cluster",
        Duration::from_secs(120),
        || {
            node.status()
                .is_some_and(|s| s["networks"].as_array().is_some_and(|n| !n.is_empty()))
        },
    );
    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let add = std::thread::scope(|s| {
        let adding = s.spawn(|| {
            multus::call(
                &node,
                "ADD",
                &multus::Call {
                    conf: &conf,
                    pod_namespace: "prod",
                    pod: LAUNCHER,
                    ifname: LAUNCHER_IFNAME,
                    netns: &launcher,
                    container: &format!("c{tag}"),
                },
            )
        });
        // The ADD is with the agent, which has not seen the VMI: its
        // round refuses the pod ("which is not known").
        node.wait_log("CNI endpoint added", Duration::from_secs(30));
        for o in vmi {
            server.put(o);
        }
        adding.join().unwrap()
    });
    let (ok, result) = add;
    assert!(ok, "ADD of the launcher whose VMI came after it: {result}");
    // The agent writes status.json after the pass that answered the ADD
    // (on a thread of its own): the file may still hold the pass before.
    wait_for("vm1 in the status", Duration::from_secs(10), || {
        node.status()
            .is_some_and(|s| attachment(&s, "vm1").is_some())
    });
    let status = node.status().expect("status");
    let a = attachment(&status, "vm1").unwrap_or_else(|| panic!("vm1 derived: {status}"));
    assert_eq!(a["port"], result["interfaces"][0]["name"], "{a}\n{result}");
}

/// The agent's counter of `name` on its metrics endpoint `addr`.
fn counter(node: &Node, addr: &str, name: &str) -> f64 {
    let url = format!("http://{addr}/metrics");
    let out = node
        .ns
        .run_status(&["curl", "-sfS", "--max-time", "5", &url]);
    assert!(out.status.success(), "scraping {url}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} at {url}"))
}

/// Objects no VM interface reads (a tenant's claims that no pod or VM
/// names) stop their round after validation: the node's agent does not
/// plan and publish the cluster again for them. The claim of a pod that
/// comes later is still read when its pod comes: the pod gets the
/// claim's address.
#[test]
fn objects_no_vm_reads_stop_their_round_after_validation() {
    const METRICS: &str = "127.0.0.1:9471";
    const UNCHANGED: &str = "vmpath_rounds_unchanged_total";
    let mut node = Node::new("kq");
    node.ns.run(&["ip", "link", "set", "lo", "up"]);
    let server = ApiServer::start(&node.ns.path());
    for o in objects(&node.name) {
        server.put(o);
    }
    server.vouch_for_claims();
    let kubeconfig = server.serve_agent_of(&mut node);
    node.set_agent_args(&[
        "--source",
        "kubernetes",
        "--kubeconfig",
        &kubeconfig,
        "--metrics-addr",
        METRICS,
    ]);
    node.start_agent();
    wait_for(
        "the agent to list the cluster",
        Duration::from_secs(120),
        || {
            node.status()
                .is_some_and(|s| attachment(&s, "vm1").is_some())
        },
    );
    // Claims nobody names, one after another: each wakes a round by
    // itself, which stops after validation (one that the agent's own
    // start-up links or the data path also woke runs to the end: a few
    // tries).
    let before = counter(&node, METRICS, UNCHANGED);
    let stopped = (0..20).any(|i| {
        server.put(web_claim(
            &format!("stray-{i}"),
            &format!("10.31.0.{}/24", 100 + i),
        ));
        let asked = std::time::Instant::now();
        while asked.elapsed() < Duration::from_secs(2) {
            if counter(&node, METRICS, UNCHANGED) > before {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    });
    assert!(
        stopped,
        "no round woken by a claim nobody names stopped after validation"
    );
    // A claim made before its pod (as the controller makes a VM's before
    // the VM's pod runs): nobody reads it yet.
    server.put(web_claim("web-1", "10.31.0.21/24"));
    server.vouch_for_claims();
    // Its pod comes: the claim is read, the round runs to the end.
    server.put(web_pod("web-1", &node.name));
    let ip = |s: &Value| {
        attachment(s, "web-1").and_then(|a| a["ips"][0]["address"].as_str().map(str::to_string))
    };
    wait_for(
        "the pod to take its claim's address",
        Duration::from_secs(30),
        || node.status().as_ref().and_then(ip).is_some(),
    );
    let status = node.status().unwrap();
    assert_eq!(
        ip(&status).as_deref(),
        Some("10.31.0.21/24"),
        "web-1: {:?}",
        attachment(&status, "web-1")
    );
}
