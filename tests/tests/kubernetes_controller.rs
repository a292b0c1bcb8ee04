//! `vmpath controller` against the test bed's API server (in memory, over
//! real HTTP; `vmpath_tests::kube_api`): the test API server's writes
//! (409 on a stale resourceVersion), one leader through a Lease, every
//! IPAMClaim allocated once with no address twice, with two controllers
//! racing, two that both believe they lead, the leader killed, a round
//! cut short after the ledger was written, and the API server restarted.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};
use vmpath_tests::{Netns, Node, kube_api::ApiServer, multus, unique_tag, vmpath_bin, wait_for};

const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/derive/fixtures/vm.yaml");
const LAUNCHER: &str = "virt-launcher-vm1-x7k2p";
const LAUNCHER_IFNAME: &str = "pod16477688c0e";
const CLAIMS: &str = "/apis/k8s.cni.cncf.io/v1alpha1/ipamclaims";
const LEASES: &str = "/apis/coordination.k8s.io/v1/leases";
const CONFIGMAPS: &str = "/api/v1/configmaps";
const LEDGER: &str = "vmpath-ipam-ledger";

/// The controller's ledger, its shards (`vmpath-ipam-ledger`,
/// `vmpath-ipam-ledger-<k>`) merged: network -> address -> holder.
fn ledger(server: &ApiServer) -> Value {
    let mut out = serde_json::Map::new();
    for cm in server.objects(CONFIGMAPS) {
        let name = cm["metadata"]["name"].as_str().unwrap_or("");
        if cm["metadata"]["namespace"] != "vmpath-system"
            || !(name == LEDGER || name.starts_with(&format!("{LEDGER}-")))
        {
            continue;
        }
        let shard: Value =
            serde_json::from_str(cm["data"]["allocations"].as_str().unwrap()).unwrap();
        for (network, held) in shard.as_object().unwrap() {
            let into = out.entry(network.clone()).or_insert_with(|| json!({}));
            for (ip, holder) in held.as_object().unwrap() {
                into[ip] = holder.clone();
            }
        }
    }
    Value::Object(out)
}

/// The fixture's Network (10.31.0.0/24, gateway .1, IPAM) and its NAD.
fn network_objects() -> Vec<Value> {
    let mut out = vmpath::config::source::parse(NETWORK.as_bytes()).unwrap();
    out.retain(|o| o["kind"] != "Node");
    out
}

/// An IPAMClaim as KubeVirt makes one for a VM's network (ipam-extensions).
fn claim(name: &str) -> Value {
    json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        "metadata": {"name": format!("{name}.blue"), "namespace": "prod", "uid": format!("uid-{name}"),
                     "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                                          "name": name, "uid": format!("vm-{name}")}]},
        "spec": {"network": "blue", "interface": "pod16477688c0e"},
    })
}

struct Controller {
    child: Child,
    log: PathBuf,
}

impl Controller {
    fn start(
        ns: &Netns,
        kubeconfig: &str,
        identity: &str,
        lease: &str,
        dir: &std::path::Path,
    ) -> Self {
        Self::start_every(ns, kubeconfig, identity, lease, dir, "300ms")
    }

    fn start_every(
        ns: &Netns,
        kubeconfig: &str,
        identity: &str,
        lease: &str,
        dir: &std::path::Path,
        interval: &str,
    ) -> Self {
        let log = dir.join(format!("{identity}.log"));
        let child = Command::new("nsenter")
            .arg(format!("--net={}", ns.path()))
            .arg(vmpath_bin())
            .args([
                "controller",
                "--kubeconfig",
                kubeconfig,
                "--namespace",
                "vmpath-system",
                "--identity",
                identity,
                "--lease-name",
                lease,
                "--lease-duration",
                "3s",
                "--interval",
                interval,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Controller { child, log }
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn allocated(&self) -> usize {
        self.log().matches("allocated").count()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every claim's status.ips, by claim name.
fn addresses(server: &ApiServer) -> BTreeMap<String, Vec<String>> {
    server
        .objects(CLAIMS)
        .iter()
        .map(|c| {
            let ips = c["status"]["ips"]
                .as_array()
                .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            (c["metadata"]["name"].as_str().unwrap().to_string(), ips)
        })
        .collect()
}

/// No address in two claims; each in the subnet, not its network,
/// broadcast or gateway address.
fn assert_unique(server: &ApiServer) {
    let mut holder: BTreeMap<String, String> = BTreeMap::new();
    for (claim, ips) in addresses(server) {
        for ip in ips {
            let addr = ip.split('/').next().unwrap().to_string();
            assert!(
                ip.starts_with("10.31.0.") && ip.ends_with("/24"),
                "{claim}: {ip}"
            );
            assert!(
                !["10.31.0.0", "10.31.0.1", "10.31.0.255"].contains(&addr.as_str()),
                "{claim}: {ip}"
            );
            if let Some(other) = holder.insert(addr.clone(), claim.clone()) {
                panic!("{addr} is in both {other} and {claim}");
            }
        }
    }
}

fn all_allocated(server: &ApiServer, n: usize) -> bool {
    let a = addresses(server);
    a.len() == n && a.values().all(|ips| ips.len() == 1)
}

/// The message of an Event with `reason` on the object `kind`/`name`.
fn event_on(server: &ApiServer, kind: &str, name: &str, reason: &str) -> Option<String> {
    server.objects("/api/v1/events").iter().find_map(|e| {
        (e["involvedObject"]["kind"] == kind
            && e["involvedObject"]["name"] == name
            && e["reason"] == reason)
            .then(|| e["message"].as_str().unwrap_or("").to_string())
    })
}

struct Bed {
    ns: Netns,
    server: ApiServer,
    kubeconfig: String,
    dir: PathBuf,
}

fn bed(name: &str) -> Bed {
    let ns = Netns::new(format!("vc{}{name}", unique_tag()));
    let server = ApiServer::start(&ns.path());
    for o in network_objects() {
        server.put(o);
    }
    let dir = std::env::temp_dir().join(format!("vmpath-{}", ns.name));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    Bed {
        kubeconfig: kubeconfig.to_str().unwrap().to_string(),
        ns,
        server,
        dir,
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_test_api_server_refuses_a_stale_write_with_409() {
    let b = bed("w");
    let path = "/api/v1/namespaces/prod/configmaps";
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "1"}});
    let (code, made) = b.server.request("POST", path, "application/json", &cm);
    assert_eq!(code, 201, "{made}");
    let (code, again) = b.server.request("POST", path, "application/json", &cm);
    assert_eq!(
        (code, again["reason"].as_str()),
        (409, Some("AlreadyExists"))
    );
    let one = format!("{path}/x");
    let mut next = made.clone();
    next["data"]["a"] = "2".into();
    let (code, written) = b.server.request("PUT", &one, "application/json", &next);
    assert_eq!(code, 200, "{written}");
    // The same resourceVersion again is stale now.
    next["data"]["a"] = "3".into();
    let (code, refused) = b.server.request("PUT", &one, "application/json", &next);
    assert_eq!(
        (code, refused["reason"].as_str()),
        (409, Some("Conflict")),
        "{refused}"
    );
    let patch = json!({"data": {"b": "x", "a": null}});
    let (code, patched) = b
        .server
        .request("PATCH", &one, "application/merge-patch+json", &patch);
    assert_eq!(code, 200);
    assert_eq!(patched["data"], json!({"b": "x"}));
    assert_eq!(b.server.conflicts(CONFIGMAPS), 2);
    let (code, _) = b
        .server
        .request("DELETE", &one, "application/json", &Value::Null);
    assert_eq!(code, 200);
    assert!(b.server.get(CONFIGMAPS, "prod", "x").is_none());
    let (code, _) = b
        .server
        .request("GET", &one, "application/json", &Value::Null);
    assert_eq!(code, 404);
}

#[test]
fn two_controllers_one_leader_every_claim_allocated_once() {
    let b = bed("r");
    for i in 0..30 {
        b.server.put(claim(&format!("vm{i}")));
    }
    // A claim that keeps its address (written before by a controller: its
    // ledger entry vouches for it; a status the ledger does not vouch for
    // is not trusted, see a_claims_status_the_ledger_does_not_vouch_for_...).
    let mut kept = claim("kept");
    kept["status"] = json!({"ips": ["10.31.0.77/24"]});
    b.server.put(kept);
    // A static request.
    let mut asks = claim("asks");
    asks["metadata"]["annotations"] = json!({"vmpath.dev/requested-ips": "10.31.0.150/24"});
    b.server.put(asks);
    // A leader that died between writing the ledger and the claim left
    // this: the claim gets that address, nobody else does.
    // (In one ConfigMap, as an unsharded ledger kept everything.)
    let cut_short = json!({"blue": {
        "10.31.0.200": {"claim": "prod/vm7.blue", "uid": "uid-vm7", "ip": "10.31.0.200/24"},
        "10.31.0.77": {"claim": "prod/kept.blue", "uid": "uid-kept", "ip": "10.31.0.77/24"}}});
    b.server.put(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": LEDGER, "namespace": "vmpath-system"},
        "data": {"allocations": cut_short.to_string()}}));

    let c1 = Controller::start(&b.ns, &b.kubeconfig, "c1", "vmpath-controller", &b.dir);
    let c2 = Controller::start(&b.ns, &b.kubeconfig, "c2", "vmpath-controller", &b.dir);
    wait_for("32 claims allocated", Duration::from_secs(60), || {
        all_allocated(&b.server, 32)
    });
    assert_unique(&b.server);
    let a = addresses(&b.server);
    assert_eq!(a["kept.blue"], ["10.31.0.77/24"]);
    assert_eq!(a["vm7.blue"], ["10.31.0.200/24"]);
    assert_eq!(a["asks.blue"], ["10.31.0.150/24"], "the static request");
    let lease = b
        .server
        .get(LEASES, "vmpath-system", "vmpath-controller")
        .expect("the Lease");
    let holder = lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap()
        .to_string();
    let (leader, other) = if holder == "c1" {
        (&c1, &c2)
    } else {
        (&c2, &c1)
    };
    // The log line follows the write.
    wait_for(
        "the leader's 31 allocations logged",
        Duration::from_secs(10),
        || leader.allocated() == 31,
    );
    assert_eq!(
        other.allocated(),
        0,
        "only the leader writes: {}",
        other.log()
    );

    // The Networks' status: Accepted, or not with the agent's reasons.
    b.server.put(json!({
        "apiVersion": "vmpath.dev/v1alpha1", "kind": "Network",
        "metadata": {"name": "bad"},
        "spec": {"id": 312, "subnets": ["10.33.0.0/24"], "defaultGatewayIPs": ["10.99.0.1"]},
    }));
    let accepted = |name: &str| {
        let n = b
            .server
            .get("/apis/vmpath.dev/v1alpha1/networks", "", name)?;
        let c = n["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Accepted")?
            .clone();
        Some((
            c["status"].as_str()?.to_string(),
            c["message"].as_str()?.to_string(),
        ))
    };
    wait_for(
        "the Networks' Accepted conditions",
        Duration::from_secs(20),
        || {
            accepted("blue").is_some_and(|(s, _)| s == "True")
                && accepted("bad").is_some_and(|(s, m)| s == "False" && m.contains("10.99.0.1"))
        },
    );

    // A claim whose status names an address another holds, which the
    // ledger gives to no one but that holder: not trusted (an Event says
    // so), allocated anew; the holder keeps its address.
    let mut thief = claim("thief");
    thief["status"] = json!({"ips": ["10.31.0.77/24"]});
    b.server.put(thief);
    wait_for(
        "the thief's status not trusted",
        Duration::from_secs(20),
        || {
            event_on(&b.server, "IPAMClaim", "thief.blue", "UntrustedStatus").is_some()
                && addresses(&b.server)
                    .get("thief.blue")
                    .is_some_and(|a| !a.is_empty() && a[0] != "10.31.0.77/24")
        },
    );
    assert_eq!(addresses(&b.server)["kept.blue"], ["10.31.0.77/24"]);

    // The leader killed: the other takes over once the Lease expires and
    // allocates what came since.
    let (mut leader, other) = if holder == "c1" { (c1, c2) } else { (c2, c1) };
    leader.child.kill().unwrap();
    leader.child.wait().unwrap();
    for i in 30..40 {
        b.server.put(claim(&format!("vm{i}")));
    }
    wait_for(
        "the other controller to lead",
        Duration::from_secs(30),
        || {
            b.server
                .get(LEASES, "vmpath-system", "vmpath-controller")
                .unwrap()["spec"]["holderIdentity"]
                != holder.as_str()
        },
    );
    wait_for("the new claims allocated", Duration::from_secs(30), || {
        addresses(&b.server)
            .iter()
            .filter(|(n, ips)| n.as_str() != "thief.blue" && ips.len() == 1)
            .count()
            == 42
    });
    wait_for(
        "the new leader's allocations logged",
        Duration::from_secs(10),
        || other.allocated() >= 10,
    );
    let lease = b
        .server
        .get(LEASES, "vmpath-system", "vmpath-controller")
        .unwrap();
    assert!(
        lease["spec"]["leaseTransitions"].as_i64().unwrap() >= 1,
        "{lease}"
    );

    // The API server restarts (objects kept, connections cut, history
    // gone): the controller carries on, no address twice.
    b.server.delete(CLAIMS, "prod", "thief.blue");
    b.server.restart();
    for i in 40..50 {
        b.server.put(claim(&format!("vm{i}")));
    }
    wait_for("claims after the restart", Duration::from_secs(30), || {
        all_allocated(&b.server, 52)
    });
    assert_unique(&b.server);

    // A claim deleted (its VM gone): its address leaves the ledger.
    let gone = addresses(&b.server)["vm3.blue"][0]
        .split('/')
        .next()
        .unwrap()
        .to_string();
    b.server.delete(CLAIMS, "prod", "vm3.blue");
    wait_for("vm3's address released", Duration::from_secs(20), || {
        ledger(&b.server)["blue"].get(&gone).is_none()
    });
}

#[test]
fn a_pods_selection_ips_are_its_claims_static_request_and_a_conflict_is_refused_on_the_pod() {
    let b = bed("s");
    // Each VM's virt-launcher pod names an address in its Multus selection
    // element, which references the VM's claim: a and b the same one, c
    // one outside the network; d asks for nothing.
    for (vm, ip) in [
        ("a", "10.31.0.150/24"),
        ("b", "10.31.0.150/24"),
        ("c", "10.99.0.5/24"),
    ] {
        b.server.put(claim(vm));
        let selection = json!([{"name": "blue", "namespace": "prod", "interface": LAUNCHER_IFNAME,
                                "ips": [ip], "ipam-claim-reference": format!("{vm}.blue")}]);
        b.server.put(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("virt-launcher-{vm}-x"), "namespace": "prod",
                         "labels": {"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": vm},
                         "annotations": {"k8s.v1.cni.cncf.io/networks": selection.to_string()}},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Running"},
        }));
    }
    b.server.put(claim("d"));
    let _c = Controller::start(&b.ns, &b.kubeconfig, "c1", "vmpath-controller", &b.dir);
    wait_for(
        "a and d allocated, b and c refused on their pods",
        Duration::from_secs(30),
        || {
            let a = addresses(&b.server);
            a.get("a.blue").is_some_and(|ips| !ips.is_empty())
                && a.get("d.blue").is_some_and(|ips| !ips.is_empty())
                && event_on(&b.server, "Pod", "virt-launcher-b-x", "Refused").is_some()
                && event_on(&b.server, "Pod", "virt-launcher-c-x", "Refused").is_some()
        },
    );
    let a = addresses(&b.server);
    assert_eq!(a["a.blue"], ["10.31.0.150/24"], "the selection's address");
    assert_ne!(a["d.blue"], ["10.31.0.150/24"]);
    assert!(a["b.blue"].is_empty() && a["c.blue"].is_empty(), "{a:?}");
    assert_unique(&b.server);
    let on_b = event_on(&b.server, "Pod", "virt-launcher-b-x", "Refused").unwrap();
    assert!(
        on_b.contains("IPAMClaim prod/b.blue: IP 10.31.0.150 is claimed by IPAMClaim prod/a.blue")
            && on_b.contains("Pod prod/virt-launcher-b-x's k8s.v1.cni.cncf.io/networks[0].ips"),
        "{on_b}"
    );
    assert!(
        event_on(&b.server, "IPAMClaim", "b.blue", "Refused").is_some_and(|m| m == on_b),
        "the claim is told too"
    );
    let on_c = event_on(&b.server, "Pod", "virt-launcher-c-x", "Refused").unwrap();
    assert!(on_c.contains("IP 10.99.0.5 is not allocatable"), "{on_c}");
    assert!(event_on(&b.server, "Pod", "virt-launcher-a-x", "Refused").is_none());
}

#[test]
fn two_controllers_that_both_lead_never_give_one_address_twice() {
    // Each its own Lease: both lead at once, as a deposed leader that has
    // not noticed yet does. The ledger's conditional writes keep them
    // apart.
    let b = bed("s");
    // A small network, so that two planners' probes meet often; rounds
    // every 20 ms each and claims arriving one by one: the two plan from
    // different views of the claims and of each other's writes.
    b.server.put(json!({
        "apiVersion": "vmpath.dev/v1alpha1", "kind": "Network",
        "metadata": {"name": "tiny"},
        "spec": {"id": 311, "subnets": ["10.32.0.0/26"], "defaultGatewayIPs": ["10.32.0.1"]},
    }));
    let _c1 = Controller::start_every(&b.ns, &b.kubeconfig, "s1", "lease-a", &b.dir, "20ms");
    let _c2 = Controller::start_every(&b.ns, &b.kubeconfig, "s2", "lease-b", &b.dir, "20ms");
    for i in 0..60 {
        let mut c = claim(&format!("vm{i}"));
        c["spec"]["network"] = "tiny".into();
        b.server.put(c);
        std::thread::sleep(Duration::from_millis(7));
    }
    wait_for("60 claims allocated", Duration::from_secs(90), || {
        all_allocated(&b.server, 60)
    });
    let mut holder: BTreeMap<String, String> = BTreeMap::new();
    for (claim, ips) in addresses(&b.server) {
        let ip = &ips[0];
        assert!(
            ip.starts_with("10.32.0.") && ip.ends_with("/26"),
            "{claim}: {ip}"
        );
        if let Some(other) = holder.insert(ip.clone(), claim.clone()) {
            panic!("{ip} is in both {other} and {claim}");
        }
    }
    assert_eq!(ledger(&b.server)["tiny"].as_object().unwrap().len(), 60);
    eprintln!(
        "ledger writes refused with 409 (the other leader wrote first): {}",
        b.server.conflicts(CONFIGMAPS)
    );
}

/// A plain pod on a vmpath NAD (Multus's short form: interface `net1`),
/// as the API server holds it.
fn web_pod(name: &str, uid: &str, node: &str, selection: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "prod", "uid": uid,
                     "annotations": {"k8s.v1.cni.cncf.io/networks": selection}},
        "spec": {"nodeName": node},
        "status": {"phase": "Running"},
    })
}

/// The addresses the ledger holds, with their claim and its uid.
fn ledger_holders(server: &ApiServer) -> BTreeMap<String, (String, String)> {
    ledger(server)["blue"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(ip, h)| {
            (
                ip.clone(),
                (
                    h["claim"].as_str().unwrap().to_string(),
                    h["uid"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect()
}

#[test]
fn a_vm_and_a_plain_pod_wait_for_their_claims_from_the_controller_then_have_traffic() {
    let mut node = Node::new("kc");
    let server = ApiServer::start(&node.ns.path());
    // The fixtures on this node, the claim without status: KubeVirt made
    // it, nobody has allocated it yet. One subnet for VMs and pods alike.
    let text = format!("{NETWORK}\n---\n{VM}").replace("node-a", &node.name);
    let text = text.replace("status:\n  ips: [10.31.0.11/24]", "");
    // No MAC given anywhere: the agent detects it from the VM's traffic
    // and writes it back to the VMI.
    let text = text
        .replace("        macAddress: \"02:00:00:31:00:0b\"\n", "")
        .replace("\"mac\":\"02:00:00:31:00:0b\",", "");
    assert!(!text.contains("macAddress"), "the fixture's MACs");
    for o in vmpath::config::source::parse(text.as_bytes()).unwrap() {
        if o["kind"] != "Node" {
            server.put(o);
        }
    }
    server.put(web_pod("web-0", "uid-web-0", &node.name, "prod/blue"));
    // A virt-launcher pod whose VMI is not there: refused, and said so on
    // the pod.
    server.put(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "virt-launcher-ghost-abcde", "namespace": "prod",
                     "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": "no-such-uid",
                                "vm.kubevirt.io/name": "ghost"},
                     "annotations": {"k8s.v1.cni.cncf.io/networks": "prod/blue"}},
        "spec": {"nodeName": node.name},
        "status": {"phase": "Running"},
    }));
    let kubeconfig = server.serve_agent_of(&mut node);
    node.start_agent();
    // No controller yet: the pod waits for the claim made for it, and
    // says so on the pod.
    wait_for(
        "the agent's WaitingForIPAMClaim Event on web-0",
        // Its first round: after the data path loads (a minute and more
        // on a busy machine).
        Duration::from_secs(120),
        || {
            event_on(&server, "Pod", "web-0", "WaitingForIPAMClaim").is_some_and(|m| {
                m.contains("waits for IPAMClaim prod/web-0.net1's status.ips: addresses on network \"blue\" are allocated by vmpath controller")
            })
        },
    );

    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let web = Netns::new(format!("vt{tag}-web"));
    let call = |pod: &str, ifname: &str, netns: &Netns, container: &str| {
        multus::call(
            &node,
            "ADD",
            &multus::Call {
                conf: &conf,
                pod_namespace: "prod",
                pod,
                ifname,
                netns,
                container,
            },
        )
    };

    // Both ADDs fail after their bound, naming the claim each waits for;
    // the agent gave neither an address of its own.
    let (vm_add, web_add) = std::thread::scope(|s| {
        let vm = s.spawn(|| call(LAUNCHER, LAUNCHER_IFNAME, &launcher, &format!("c{tag}l1")));
        let web_add = call("web-0", "net1", &web, &format!("c{tag}w1"));
        (vm.join().unwrap(), web_add)
    });
    for ((ok, result), claim) in [(vm_add, "prod/vm1.blue"), (web_add, "prod/web-0.net1")] {
        assert!(!ok, "ADD without the claim's addresses: {result}");
        assert!(
            result
                .to_string()
                .contains(&format!("waits for IPAMClaim {claim}'s status.ips")),
            "{result}"
        );
    }
    let status = node.status().unwrap();
    assert!(
        !status["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["vm"] == "vm1" || a["vm"] == "web-0"),
        "{status}"
    );

    // The controller makes the pod's claim (owned by the pod) and
    // allocates both; the runtime retries the ADDs, which now succeed.
    let _controller = Controller::start(
        &node.ns,
        &kubeconfig,
        "c1",
        "vmpath-controller",
        &node.state_dir,
    );
    wait_for("both claims' addresses", Duration::from_secs(30), || {
        let a = addresses(&server);
        ["vm1.blue", "web-0.net1"]
            .iter()
            .all(|c| a.get(*c).is_some_and(|ips| !ips.is_empty()))
    });
    assert_unique(&server);
    let made = server.get(CLAIMS, "prod", "web-0.net1").unwrap();
    assert_eq!(
        made["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Pod", "name": "web-0", "uid": "uid-web-0",
                "controller": true, "blockOwnerDeletion": false}]),
        "{made}"
    );
    assert_eq!(
        made["metadata"]["labels"]["vmpath.dev/pod-uid"],
        "uid-web-0"
    );
    assert_eq!(
        made["spec"],
        json!({"network": "blue", "interface": "net1"})
    );
    let vm_ip = addresses(&server)["vm1.blue"][0].clone();
    let web_ip = addresses(&server)["web-0.net1"][0].clone();
    let (ok, result) = call("web-0", "net1", &web, &format!("c{tag}w2"));
    assert!(ok, "ADD of web-0 once its claim has addresses: {result}");
    assert_eq!(
        result["ips"][0]["address"], web_ip,
        "the claim's address: {result}"
    );
    let (ok, result) = call(LAUNCHER, LAUNCHER_IFNAME, &launcher, &format!("c{tag}l2"));
    assert!(ok, "ADD once the claim has addresses: {result}");
    for cmd in [
        vec![
            "ip",
            "link",
            "set",
            LAUNCHER_IFNAME,
            "address",
            "02:00:00:31:00:0b",
        ],
        vec!["ip", "addr", "add", &vm_ip, "dev", LAUNCHER_IFNAME],
        vec!["ip", "link", "set", LAUNCHER_IFNAME, "up"],
    ] {
        launcher.run(&cmd);
    }
    let web_addr = web_ip.split('/').next().unwrap().to_string();
    let vm_addr = vm_ip.split('/').next().unwrap();
    assert!(
        launcher.ping(&web_addr, 3),
        "VM vm1 ({vm_ip}) -> pod web-0 ({web_ip})"
    );
    assert!(web.ping(vm_addr, 3), "pod web-0 -> VM vm1");
    wait_for(
        "the detected MAC on the VMI",
        Duration::from_secs(20),
        || {
            let vmi = server
                .get(
                    "/apis/kubevirt.io/v1/virtualmachineinstances",
                    "prod",
                    "vm1",
                )
                .unwrap();
            vmi["metadata"]["annotations"]["vmpath.dev/detected-macs"].as_str()
                == Some(r#"{"blue":"02:00:00:31:00:0b"}"#)
        },
    );
    let status = node.status().unwrap();
    let vm1 = status["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["vm"] == "vm1")
        .cloned();
    assert!(
        vm1.is_some_and(|a| a.to_string().contains(vm_addr)),
        "{status}"
    );

    // The pod deleted (no garbage collector here; the runtime's DEL of
    // its interface): the controller deletes its claim, and the address
    // leaves the ledger.
    server.delete("/api/v1/pods", "prod", "web-0");
    let (ok, result) = multus::call(
        &node,
        "DEL",
        &multus::Call {
            conf: &conf,
            pod_namespace: "prod",
            pod: "web-0",
            ifname: "net1",
            netns: &web,
            container: &format!("c{tag}w2"),
        },
    );
    assert!(ok, "DEL of web-0: {result}");
    wait_for(
        "web-0's claim deleted and its address released",
        Duration::from_secs(20),
        || {
            server.get(CLAIMS, "prod", "web-0.net1").is_none()
                && !ledger_holders(&server).contains_key(&web_addr)
        },
    );
    // Free again: another pod asking for it gets it.
    let asks = format!(r#"[{{"name":"blue","ips":["{web_ip}"]}}]"#);
    server.put(web_pod("web-1", "uid-web-1-a", &node.name, &asks));
    wait_for("web-1 given the address", Duration::from_secs(20), || {
        addresses(&server).get("web-1.net1") == Some(&vec![web_ip.clone()])
    });
    let first = server.get(CLAIMS, "prod", "web-1.net1").unwrap();

    // web-1 deleted and made again at once under its name (a new uid):
    // the new pod does not take the old claim; the old claim goes, then
    // the address it held is the new claim's, never both's.
    server.delete("/api/v1/pods", "prod", "web-1");
    server.put(web_pod("web-1", "uid-web-1-b", &node.name, &asks));
    wait_for(
        "web-1's new claim allocated",
        Duration::from_secs(20),
        || {
            server.get(CLAIMS, "prod", "web-1.net1").is_some_and(|c| {
                c["metadata"]["labels"]["vmpath.dev/pod-uid"] == "uid-web-1-b"
                    && c["status"]["ips"] == json!([web_ip])
            })
        },
    );
    let second = server.get(CLAIMS, "prod", "web-1.net1").unwrap();
    assert_ne!(second["metadata"]["uid"], first["metadata"]["uid"]);
    assert_eq!(
        second["metadata"]["ownerReferences"][0]["uid"],
        "uid-web-1-b"
    );
    assert_eq!(
        ledger_holders(&server)[&web_addr],
        (
            "prod/web-1.net1".to_string(),
            second["metadata"]["uid"].as_str().unwrap().to_string()
        )
    );
    assert_unique(&server);
    // The new pod's interface has it, and reaches the VM.
    let web1 = Netns::new(format!("vt{tag}-web1"));
    let (ok, result) = call("web-1", "net1", &web1, &format!("c{tag}w3"));
    assert!(ok, "ADD of the new web-1: {result}");
    assert_eq!(result["ips"][0]["address"], web_ip, "{result}");
    assert!(web1.ping(vm_addr, 3), "pod web-1 -> VM vm1");
    // All that from one watch of the pods: the controller does not list
    // every pod in the cluster each round (one every 300 ms here; the
    // agent's own watch lists its node's pods once, more on a relist).
    let pod_lists = server.lists("/api/v1/pods");
    assert!(pod_lists <= 4, "pods listed {pod_lists} times");
}

#[test]
fn a_ledger_write_that_lost_the_race_writes_no_address() {
    let b = bed("l");
    let _c = Controller::start(&b.ns, &b.kubeconfig, "c1", "vmpath-controller", &b.dir);
    wait_for("the ledger", Duration::from_secs(20), || {
        b.server.get(CONFIGMAPS, "vmpath-system", LEDGER).is_some()
    });
    // Another writer gets in just before the controller's next ledger
    // write: it gives the address the controller planned for x.blue to
    // its own claim, ledger and claim status both. The controller's write
    // is stale (409) and nothing of its plan may be written.
    b.server.race_next_write(
        CONFIGMAPS,
        Box::new(|body: &Value| {
            let mut ledger: Value =
                serde_json::from_str(body["data"]["allocations"].as_str().unwrap()).unwrap();
            let mut taken = Vec::new();
            for h in ledger["blue"].as_object_mut().unwrap().values_mut() {
                if h["claim"] == "prod/x.blue" {
                    h["claim"] = "prod/other.blue".into();
                    h["uid"] = "uid-other".into();
                    taken.push(h["ip"].clone());
                }
            }
            let mut cm = body.clone();
            cm["data"]["allocations"] = ledger.to_string().into();
            cm["metadata"]["namespace"] = "vmpath-system".into();
            let mut other = claim("other");
            other["status"] = json!({ "ips": taken });
            vec![cm, other]
        }),
    );
    b.server.put(claim("x"));
    wait_for("x.blue allocated", Duration::from_secs(20), || {
        addresses(&b.server)
            .get("x.blue")
            .is_some_and(|ips| !ips.is_empty())
    });
    assert!(b.server.raced(), "the other writer got in");
    assert!(
        b.server.conflicts(CONFIGMAPS) >= 1,
        "the stale ledger write got 409"
    );
    let a = addresses(&b.server);
    assert_eq!(a["other.blue"].len(), 1, "{a:?}");
    assert_ne!(a["x.blue"], a["other.blue"], "{a:?}");
    assert_unique(&b.server);
}

#[test]
fn a_claims_status_the_ledger_does_not_vouch_for_is_not_trusted_and_written_again() {
    let b = bed("u");
    b.server.put(claim("a"));
    let _c = Controller::start(&b.ns, &b.kubeconfig, "c1", "vmpath-controller", &b.dir);
    wait_for("a allocated", Duration::from_secs(30), || {
        all_allocated(&b.server, 1)
    });
    let a_ip = addresses(&b.server)["a.blue"][0].clone();
    // A tenant that may write its claims' status: t copies a's address,
    // u writes itself a free one.
    let mut t = claim("t");
    t["status"] = json!({"ips": [a_ip]});
    b.server.put(t);
    let mut u = claim("u");
    u["status"] = json!({"ips": ["10.31.0.200/24"]});
    b.server.put(u);
    wait_for(
        "t and u told, and given addresses of their own",
        Duration::from_secs(30),
        || {
            let a = addresses(&b.server);
            event_on(&b.server, "IPAMClaim", "t.blue", "UntrustedStatus").is_some()
                && event_on(&b.server, "IPAMClaim", "u.blue", "UntrustedStatus").is_some()
                && a["t.blue"].len() == 1
                && a["t.blue"] != [a_ip.clone()]
                && a["u.blue"].len() == 1
                && a["u.blue"] != ["10.31.0.200/24"]
        },
    );
    assert_unique(&b.server);
    assert_eq!(
        addresses(&b.server)["a.blue"],
        std::slice::from_ref(&a_ip),
        "a keeps its address"
    );
    let on_t = event_on(&b.server, "IPAMClaim", "t.blue", "UntrustedStatus").unwrap();
    assert_eq!(
        on_t,
        format!(
            "IPAMClaim prod/t.blue: status.ips [\"{a_ip}\"] was not written by vmpath controller ({a_ip} is held by IPAMClaim prod/a.blue in the ledger on network \"blue\"): not trusted; the claim is allocated again"
        )
    );
    let on_u = event_on(&b.server, "IPAMClaim", "u.blue", "UntrustedStatus").unwrap();
    assert!(
        on_u.contains("10.31.0.200/24 is given to no claim in the ledger"),
        "{on_u}"
    );
    // The ledger holds what the statuses say, nothing the tenant wrote.
    let held = ledger(&b.server);
    let holders: BTreeMap<String, String> = held["blue"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(ip, h)| (ip.clone(), h["claim"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(holders.len(), 3, "{holders:?}");
    assert!(!holders.contains_key("10.31.0.200"), "{holders:?}");
    assert_eq!(holders[a_ip.split('/').next().unwrap()], "prod/a.blue");
}

/// A tenant that may write its IPAMClaim's status picks itself a free
/// address: until vmpath controller writes the claim, the agent does not
/// take it (the ledger, which the controller writes before any status,
/// does not vouch for it); the VM waits, said on its VMI and in the CNI
/// ADD's error; once the controller has written the claim, the VM has the
/// ledger's address, never the forged one.
#[test]
fn the_agent_takes_no_address_from_a_claims_status_the_ledger_does_not_vouch_for() {
    const FORGED: &str = "10.31.0.200/24";
    let mut node = Node::new("kf");
    let server = ApiServer::start(&node.ns.path());
    for o in network_objects() {
        server.put(o);
    }
    // Another claim, allocated by the controller before (in its ledger).
    let mut a = claim("a");
    a["status"] = json!({"ips": ["10.31.0.2/24"]});
    server.put(a);
    server.vouch_for_claims();
    // vm1 on this node, its claim's status written by the tenant.
    let text = VM
        .replace("node-a", &node.name)
        .replace("ips: [10.31.0.11/24]", &format!("ips: [{FORGED}]"));
    assert!(text.contains(FORGED), "the fixture's claim status");
    for o in vmpath::config::source::parse(text.as_bytes()).unwrap() {
        if o["kind"] != "Node" {
            server.put(o);
        }
    }
    let kubeconfig = server.serve_agent_of(&mut node);
    node.start_agent();
    let said = format!(
        "waits for IPAMClaim prod/vm1.blue's status.ips: [\"{FORGED}\"] was not written by vmpath controller ({FORGED} is given to no claim in the ledger on network \"blue\"): not trusted until vmpath controller writes it"
    );
    wait_for(
        "the agent's WaitingForIPAMClaim Event on the VMI",
        Duration::from_secs(120),
        || {
            event_on(
                &server,
                "VirtualMachineInstance",
                "vm1",
                "WaitingForIPAMClaim",
            )
            .is_some_and(|m| m.contains(&said))
                && node.status().is_some()
        },
    );
    let status = node.status().unwrap();
    assert!(
        !status["attachments"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a["vm"] == "vm1"),
        "vm1 served with a forged address: {status}"
    );
    // The runtime's ADD is refused with the same words.
    let conf = multus::nad_conf(NETWORK, &node);
    let tag = unique_tag();
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let add = |container: &str| {
        multus::call(
            &node,
            "ADD",
            &multus::Call {
                conf: &conf,
                pod_namespace: "prod",
                pod: LAUNCHER,
                ifname: LAUNCHER_IFNAME,
                netns: &launcher,
                container,
            },
        )
    };
    let (ok, result) = add(&format!("c{tag}l1"));
    assert!(!ok, "ADD with a forged claim status: {result}");
    assert!(result.to_string().contains("not trusted"), "{result}");

    // The controller does not trust it either: it allocates the claim
    // anew; the agent then serves vm1 with the ledger's address.
    let _controller = Controller::start(
        &node.ns,
        &kubeconfig,
        "c1",
        "vmpath-controller",
        &node.state_dir,
    );
    wait_for(
        "vm1's claim written by the controller",
        Duration::from_secs(30),
        || {
            addresses(&server)
                .get("vm1.blue")
                .is_some_and(|ips| ips.len() == 1 && ips[0] != FORGED)
        },
    );
    assert_unique(&server);
    let vm_ip = addresses(&server)["vm1.blue"][0].clone();
    let (ok, result) = add(&format!("c{tag}l2"));
    assert!(ok, "ADD once the controller wrote the claim: {result}");
    assert_eq!(result["ips"][0]["address"], vm_ip, "{result}");
    let vm1 = node.attachment_view("vm1").expect("vm1 served");
    let shown = vm1.to_string();
    assert!(
        shown.contains(vm_ip.split('/').next().unwrap()) && !shown.contains("10.31.0.200"),
        "{vm1}"
    );
}
