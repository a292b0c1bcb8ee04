//! The increments against a full recompute: random sequences of changes
//! (VMs added, changed, deleted and migrated, policies and networks
//! edited, nodes moved, ports appearing, restarts) applied to a config
//! dir; after each, the plan the round reaches with what it kept from the
//! rounds before must be the plan every object derived again gives, map
//! by map. The seed is printed; `VMPATH_EQUIVALENCE_SEED=<n>` replays one.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::Arc,
};

use super::{Passes, Round, derive, ipam, plan, publish, resolve, validate};
use crate::{
    config::{
        Config,
        kube_objects::ledger::{Holder, Ledger, Shards},
        source::Reader,
    },
    plan::Plan,
    resolve::store::Store,
};

/// splitmix64: a reproducible stream from one seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

const NETWORKS: &str = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec:\n  id: 7\n  subnets: [10.9.0.0/24]\n  defaultGatewayIPs: [10.9.0.1]\n  ipam: {mode: Enabled}\n  mtu: MTU\n---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: red}\nspec:\n  id: 8\n  subnets: [10.8.0.0/24]\n  defaultGatewayIPs: [10.8.0.1]\n  ipam: {mode: Disabled}\n  egress: SNAT\n  advertise: {perVM: true, learned: true}\n";
const NODES: [&str; 3] = ["a", "b", "c"];
const APPS: [&str; 3] = ["web", "db", "cache"];

/// One VM interface as its Attachment document says.
#[derive(Debug, Clone)]
struct Vm {
    network: &'static str,
    node: &'static str,
    app: &'static str,
    /// A static address on red (may collide with another VM's: the
    /// conflict's winner must be the same either way).
    ip: u8,
    mac: Option<u8>,
    migration: Option<(&'static str, bool)>,
}

impl Vm {
    fn document(&self, name: &str) -> String {
        let mut spec = format!(
            "  vm: {name}\n  interface: eth0\n  network: {}\n  node: {}\n  port: {name}p\n",
            self.network, self.node
        );
        if self.network == "red" {
            spec.push_str(&format!("  ips: [10.8.0.{}/24]\n", self.ip));
        }
        if let Some(m) = self.mac {
            spec.push_str(&format!("  mac: '52:54:00:00:00:{m:02x}'\n"));
        }
        if let Some((target, ready)) = self.migration {
            spec.push_str(&format!(
                "  migration: {{targetNode: {target}, targetPort: {name}t, ready: {ready}}}\n"
            ));
        }
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}-eth0, namespace: prod, labels: {{app: {}}}}}\nspec:\n{spec}",
            self.app
        )
    }
}

fn write(dir: &Path, file: &str, text: &str) {
    // A new inode each time, as an editor or a ConfigMap update does.
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(file)).unwrap();
}

fn remove(dir: &Path, file: &str) {
    let _ = std::fs::remove_file(dir.join(file));
}

/// Writes an object's file and its claim's (removed when it has none).
fn write_with_claim(dir: &Path, file: &str, claim_file: &str, (text, claim): (String, String)) {
    write(dir, file, &text);
    if claim.is_empty() {
        remove(dir, claim_file);
    } else {
        write(dir, claim_file, &claim);
    }
}

/// The plan every object derived and validated again gives, from the
/// same round state as the increments had (who held what, which VM
/// interfaces the last round accepted, the last plan's ids).
fn full(
    round: &Round,
    store: &Store,
    snap: &crate::config::source::Snapshot,
    held: &crate::config::Held,
    ports: &dyn Fn(&str) -> Option<u32>,
) -> (Plan, Config) {
    let node = round.settings.node.as_str();
    let derived = derive::derive(snap, node);
    let validated = validate::validate(snap, derived, node, &round.accepted, held);
    let kept = validated.clone();
    let mut cfg = resolve::resolve(validated, node);
    ipam::assign(&mut cfg, store).unwrap();
    let previous = round
        .last_plan
        .as_ref()
        .map(plan::Previous::of_plan)
        .unwrap_or_default();
    (
        plan::plan(&cfg, node, ports, &previous, &mut Default::default()),
        kept,
    )
}

/// One round as `Round::run` takes it, without a data path: what the
/// increments reach.
fn incremental(
    round: &mut Round,
    snap: &crate::config::source::Snapshot,
    held: crate::config::Held,
    ports: &dyn Fn(&str) -> Option<u32>,
) -> (Plan, Config) {
    let node = round.settings.node.clone();
    let (validated, _) = round.derive_and_validate(snap, held);
    let kept = (*validated).clone();
    let (mut cfg, _) = round
        .resolve_and_assign(validated, Default::default())
        .unwrap();
    let previous = round
        .last_plan
        .as_ref()
        .map(plan::Previous::of_plan)
        .unwrap_or_default();
    let plan = plan::plan(&cfg, &node, ports, &previous, &mut round.overlay);
    round.accepted = cfg.attachments.iter().map(|a| a.key.clone()).collect();
    round.running = publish::served_here(&cfg, &plan);
    round.last_plan = Some(plan.clone());
    // Carried over into the next round, as `Round::run` does.
    round.last_indexes = cfg.indexes();
    round.last_resolved = std::mem::take(&mut cfg.attachments);
    (plan, kept)
}

/// What of two validated configs differs: the accepted VM interfaces,
/// the keys documents name, the refusals and warnings (as sets: a partial
/// pass appends its VMs' refusals after the others').
fn config_differs(a: &Config, b: &Config) -> Option<String> {
    fn set(errors: &[crate::config::ConfigError]) -> BTreeSet<String> {
        errors.iter().map(|e| format!("{e:?}")).collect()
    }
    if a.attachments != b.attachments {
        let keys = |c: &Config| {
            c.attachments
                .iter()
                .map(|a| a.key.to_string())
                .collect::<BTreeSet<_>>()
        };
        let differ: Vec<String> = a
            .attachments
            .iter()
            .filter(|x| !b.attachments.contains(x))
            .map(|x| format!("{x:?}"))
            .collect();
        let only = |x: &Config, y: &Config| {
            x.errors
                .iter()
                .filter(|e| !y.errors.contains(e))
                .map(|e| format!("{}: {}", e.field, e.message))
                .collect::<Vec<_>>()
        };
        return Some(format!(
            "attachments: only in the increments {:?}, only in the full pass {:?}; refusals only in the increments {:?}, only in the full pass {:?}; differing {differ:?}",
            keys(a).difference(&keys(b)).collect::<Vec<_>>(),
            keys(b).difference(&keys(a)).collect::<Vec<_>>(),
            only(a, b),
            only(b, a),
        ));
    }
    if a.keys_in_documents != b.keys_in_documents {
        return Some("keys in documents".into());
    }
    if set(&a.errors) != set(&b.errors) {
        return Some(format!(
            "refusals: only in the increments {:?}, only in the full pass {:?}",
            set(&a.errors)
                .difference(&set(&b.errors))
                .collect::<Vec<_>>(),
            set(&b.errors)
                .difference(&set(&a.errors))
                .collect::<Vec<_>>()
        ));
    }
    if set(&a.warnings) != set(&b.warnings) {
        return Some(format!(
            "warnings: {:?}",
            set(&a.warnings)
                .symmetric_difference(&set(&b.warnings))
                .collect::<Vec<_>>()
        ));
    }
    None
}

/// Runs one step's round both ways and compares them (`what`: the step,
/// for the failure).
/// Steps whose plan routed to another node's VM (red's ingress).
static ROUTED_REMOTELY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn check_step(
    round: &mut Round,
    snap: &crate::config::source::Snapshot,
    ports: &dyn Fn(&str) -> Option<u32>,
    seed: u64,
    step: usize,
    what: &str,
) -> Config {
    let held = validate::held(round.store.all().ok().as_ref(), &round.running);
    let want_inputs = (
        held.clone(),
        round.accepted.clone(),
        round.last_plan.clone(),
    );
    // The claims store as the step found it, for the full recompute (the
    // increments' IPAM writes to the round's own).
    let state = &round.settings.state_dir;
    let copy = state.with_extension("full");
    std::fs::create_dir_all(&copy).unwrap();
    // Not while the accepted record's thread writes the file.
    round.flush_records();
    std::fs::copy(state.join("claims.redb"), copy.join("claims.redb")).unwrap();
    let before = round.passes;
    let (got, got_cfg) = incremental(round, snap, held, ports);
    let pass = if round.passes.partial > before.partial {
        "a partial pass"
    } else if round.passes.full > before.full {
        "a full pass"
    } else {
        "no pass (nothing changed)"
    };
    // The full recompute from the state the increments started from.
    let saved = (
        std::mem::replace(&mut round.accepted, want_inputs.1),
        std::mem::replace(&mut round.last_plan, want_inputs.2),
    );
    let store = Store::open(&copy).unwrap();
    let (want, want_cfg) = full(round, &store, snap, &want_inputs.0, ports);
    let (got_claims, want_claims) = (round.store.all().unwrap(), store.all().unwrap());
    drop(store);
    if got_claims != want_claims {
        let differ: Vec<_> = got_claims
            .iter()
            .filter(|(k, c)| want_claims.get(*k) != Some(c))
            .map(|(k, _)| k)
            .chain(want_claims.keys().filter(|k| !got_claims.contains_key(*k)))
            .collect();
        panic!("seed {seed:#x}, step {step} ({what}, {pass}): the claims differ for {differ:?}");
    }
    (round.accepted, round.last_plan) = saved;
    if let Some(d) = config_differs(&got_cfg, &want_cfg) {
        panic!("seed {seed:#x}, step {step} ({what}, {pass}): the validated configs differ in {d}");
    }
    if !got.routed.remote.is_empty() {
        ROUTED_REMOTELY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    // The plans whole in the log only when asked: they are long.
    let show = std::env::var_os("VMPATH_EQUIVALENCE_SHOW").is_some();
    assert!(
        got == want,
        "seed {seed:#x}, step {step} ({what}, {pass}): the increments and a full recompute differ in {:?}{}",
        differing(&got, &want),
        if show {
            format!("\nincrements: {got:#?}\nfull: {want:#?}")
        } else {
            String::new()
        }
    );
    got_cfg
}

/// The maps that differ between two plans, by name (for the failure).
fn differing(a: &Plan, b: &Plan) -> Vec<&'static str> {
    let mut out = Vec::new();
    if a.ports != b.ports {
        out.push("ports");
    }
    if a.endpoints != b.endpoints {
        out.push("endpoints");
    }
    if a.addresses != b.addresses {
        out.push("addresses");
    }
    if a.networks != b.networks {
        out.push("networks");
    }
    if a.flood != b.flood || a.flood_remote != b.flood_remote {
        out.push("flood");
    }
    if a.routed != b.routed || a.ingress_hosted != b.ingress_hosted {
        out.push("routes");
    }
    if a.policy != b.policy {
        out.push("policy");
    }
    if a.services != b.services {
        out.push("services");
    }
    if a != b && out.is_empty() {
        out.push("other fields");
    }
    out
}

/// Writes, rewrites or deletes one of `policies` NetworkPolicies in
/// namespace prod (an app's ingress from another app); says which.
fn policy_step(rng: &mut Rng, config: &Path, policies: u64) -> String {
    let p = rng.below(policies);
    if rng.below(3) == 0 {
        remove(config, &format!("policy{p}.yaml"));
        format!("delete policy{p}")
    } else {
        let (to, from) = (rng.pick(&APPS), rng.pick(&APPS));
        write(
            config,
            &format!("policy{p}.yaml"),
            &format!(
                "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{p}, namespace: prod}}\nspec:\n  podSelector: {{matchLabels: {{app: {to}}}}}\n  policyTypes: [Ingress]\n  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}]}}]\n"
            ),
        );
        format!("policy{p}: {from} -> {to}")
    }
}

fn run_sequence(seed: u64, steps: usize) -> Passes {
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "vmpath-equivalence-{}-{seed:x}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let config = dir.join("config");
    std::fs::create_dir_all(&config).unwrap();
    let mut round = crate::round::tests::round_in(&dir, "a");
    let mut reader = Reader::default();
    let mut rng = Rng(seed);
    let mut mtu = 1450;
    write(&config, "networks.yaml", &NETWORKS.replace("MTU", "1450"));
    for n in NODES {
        let last = 1 + NODES.iter().position(|x| *x == n).unwrap();
        write(
            &config,
            &format!("node-{n}.yaml"),
            &format!(
                "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: {n}}}\nspec: {{address: 192.0.2.{last}}}\n"
            ),
        );
    }
    let mut vms: BTreeMap<u32, Vm> = BTreeMap::new();
    // Host-side ports that exist on node a, by name.
    let mut present: BTreeSet<String> = BTreeSet::new();
    let mut next_vm = 0u32;
    for step in 0..steps {
        let op = rng.below(10);
        let what = match op {
            0 | 1 => {
                let vm = Vm {
                    network: rng.pick(&["blue", "red"]),
                    node: rng.pick(&NODES),
                    app: rng.pick(&APPS),
                    ip: 10 + rng.below(6) as u8,
                    mac: (rng.below(2) == 0).then(|| rng.below(40) as u8),
                    migration: None,
                };
                let name = format!("vm{next_vm}");
                write(&config, &format!("{name}.yaml"), &vm.document(&name));
                if rng.below(3) != 0 {
                    present.insert(format!("{name}p"));
                }
                vms.insert(next_vm, vm);
                next_vm += 1;
                format!("add {name}")
            }
            2 if !vms.is_empty() => {
                let k = rng.pick(&vms.keys().copied().collect::<Vec<_>>());
                vms.remove(&k);
                remove(&config, &format!("vm{k}.yaml"));
                format!("delete vm{k}")
            }
            3 | 4 if !vms.is_empty() => {
                let k = rng.pick(&vms.keys().copied().collect::<Vec<_>>());
                let vm = vms.get_mut(&k).unwrap();
                match rng.below(4) {
                    0 => vm.app = rng.pick(&APPS),
                    1 => vm.node = rng.pick(&NODES),
                    2 => vm.ip = 10 + rng.below(6) as u8,
                    _ => vm.mac = (rng.below(2) == 0).then(|| rng.below(40) as u8),
                }
                write(
                    &config,
                    &format!("vm{k}.yaml"),
                    &vm.document(&format!("vm{k}")),
                );
                format!("update vm{k}")
            }
            5 if !vms.is_empty() => {
                let k = rng.pick(&vms.keys().copied().collect::<Vec<_>>());
                let vm = vms.get_mut(&k).unwrap();
                vm.migration = match vm.migration {
                    None => Some((rng.pick(&NODES), false)),
                    Some((t, false)) => Some((t, true)),
                    Some((t, true)) => {
                        // The migration done: the VM runs on the target.
                        vm.node = t;
                        None
                    }
                };
                if rng.below(2) == 0 {
                    present.insert(format!("vm{k}t"));
                }
                write(
                    &config,
                    &format!("vm{k}.yaml"),
                    &vm.document(&format!("vm{k}")),
                );
                format!("migration step of vm{k}")
            }
            6 => policy_step(&mut rng, &config, 3),
            7 => {
                if rng.below(2) == 0 {
                    mtu = if mtu == 1450 { 1400 } else { 1450 };
                    write(
                        &config,
                        "networks.yaml",
                        &NETWORKS.replace("MTU", &mtu.to_string()),
                    );
                    format!("network blue's mtu {mtu}")
                } else {
                    let n = rng.pick(&["b", "c"]);
                    let last = 20 + rng.below(5);
                    write(
                        &config,
                        &format!("node-{n}.yaml"),
                        &format!(
                            "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: {n}}}\nspec: {{address: 192.0.2.{last}}}\n"
                        ),
                    );
                    format!("node {n} at 192.0.2.{last}")
                }
            }
            8 => {
                // A port appears or goes (no object changes).
                let k = rng.below(u64::from(next_vm.max(1)));
                let name = format!("vm{k}{}", rng.pick(&["p", "t"]));
                if !present.remove(&name) {
                    present.insert(name.clone());
                }
                format!("port {name} toggled")
            }
            _ => {
                // A restart: nothing kept but the claims and the maps.
                round.forget_increments();
                "restart".to_string()
            }
        };
        let snap = reader.read(&config);
        let ifindexes: BTreeMap<String, u32> = present
            .iter()
            .enumerate()
            .map(|(i, name)| (name.clone(), 100 + i as u32))
            .collect();
        let ports = |name: &str| ifindexes.get(name).copied();
        check_step(&mut round, &snap, &ports, seed, step, &what);
    }
    eprintln!("seed {seed}: derive and validate {:?}", round.passes);
    let _ = std::fs::remove_dir_all(&dir);
    round.passes
}

#[test]
fn increments_reach_what_a_full_recompute_reaches() {
    let seeds: Vec<u64> = match std::env::var("VMPATH_EQUIVALENCE_SEED") {
        Ok(s) => vec![s.parse().expect("VMPATH_EQUIVALENCE_SEED: a number")],
        Err(_) => {
            let base = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            (0..4).map(|i| base.wrapping_add(i)).collect()
        }
    };
    let mut partial = 0;
    let mut ipam_increments = 0;
    let mut claimed = (0, 0);
    for seed in seeds {
        // Printed so a failure can be replayed.
        eprintln!("equivalence seed {seed} (VMPATH_EQUIVALENCE_SEED={seed} replays it)");
        let passes = run_sequence(seed, 120);
        partial += passes.partial;
        ipam_increments += passes.ipam_increments;
        let (passes, by_claim) = run_kube_sequence(seed, 120);
        partial += passes.partial;
        ipam_increments += passes.ipam_increments;
        claimed = (claimed.0 + by_claim.0, claimed.1 + by_claim.1);
    }
    // The increments were taken, not only the full passes.
    assert!(partial > 0, "no round derived and validated in part");
    // Other nodes' VMs were routed to (red has ingress), from the kept
    // layer: it was compared, not left empty.
    assert!(
        ROUTED_REMOTELY.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no step routed to another node's VM"
    );
    assert!(
        ipam_increments > 0,
        "no round's IPAM decided only what changed"
    );
    // Plain pods took their addresses from claims, by hashed names too
    // (the first step makes sure of it: this checks the test itself).
    assert!(
        claimed.0 > 0 && claimed.1 > 0,
        "plain pods addressed by hashed and plain claim names: {claimed:?}"
    );
}

const FIXTURE_NETWORK: &str = include_str!("../derive/fixtures/network.yaml");
const FIXTURE_VM: &str = include_str!("../derive/fixtures/vm.yaml");
const KUBE_NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// One KubeVirt VM as its objects say: VMI and virt-launcher pod in one
/// file, its IPAMClaim in another (they come and go on their own).
#[derive(Debug, Clone)]
struct KubeVm {
    node: &'static str,
    app: &'static str,
    /// The claim's address (a small range: VMs collide now and then).
    ip: u8,
    mac: u8,
    /// The pod's own label set (the VMI's labels are merged with it).
    tier: &'static str,
    pod: bool,
    claim: bool,
    migration: Option<(&'static str, &'static str)>,
}

impl KubeVm {
    fn objects(&self, k: u32) -> (String, String) {
        let text = FIXTURE_VM
            .replace("vm1", &format!("vm{k}"))
            .replace("5d1c5a3e", &format!("{k:08x}"))
            .replace("9e8d7c6b", &format!("{:08x}", k + 0x1000_0000))
            .replace("node-a", self.node)
            .replace(
                "02:00:00:31:00:0b",
                &format!("02:00:00:31:00:{:02x}", self.mac),
            )
            .replace("10.31.0.11/24", &format!("10.31.0.{}/24", self.ip))
            .replace(
                "kubevirt.io/vm: vm",
                &format!("app: {}\n    kubevirt.io/vm: vm", self.app),
            )
            .replace(
                "    vm.kubevirt.io/name:",
                &format!("    tier: {}\n    vm.kubevirt.io/name:", self.tier),
            );
        let docs: Vec<&str> = text.split("\n---\n").collect();
        let (vmi, pod, claim) = (docs[0], docs[1], docs[2]);
        let mut vm = vmi.to_string();
        if self.pod {
            vm.push_str("\n---\n");
            vm.push_str(pod);
        }
        if let Some((target, phase)) = self.migration {
            vm.push_str(&format!(
                "\n---\napiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: mig-vm{k}, namespace: prod, uid: {k:08x}-0000-4000-8000-00000000abcd}}\nspec: {{vmiName: vm{k}}}\nstatus:\n  phase: {phase}\n  migrationState: {{targetNode: {target}, sourceNode: {}}}\n",
                self.node
            ));
        }
        let claim = if self.claim {
            claim.to_string()
        } else {
            String::new()
        };
        (vm, claim)
    }
}

/// The ledger entry vouching 10.31.0.`ip` for vm`k`'s claim.
fn holder(k: u32, ip: u8) -> Holder {
    Holder {
        claim: format!("prod/vm{k}.blue").into(),
        uid: Default::default(),
        ip: format!("10.31.0.{ip}/24").parse().unwrap(),
    }
}

/// A plain pod on network blue (a Deployment's), as vmpath controller
/// claims its address: the pod, and its IPAMClaim (named by
/// `pod_claim_name`, which hashes the name of an interface that is no DNS
/// label, `Net_1`, or of a long pod) with `ip`.
#[derive(Clone)]
struct PlainPod {
    node: &'static str,
    interface: &'static str,
    ip: u8,
    claim: bool,
}

impl PlainPod {
    fn name(k: u32) -> String {
        // Every third pod's name is long enough that its claim's name is
        // cut and hashed whatever the interface.
        if k.is_multiple_of(3) {
            format!("web{k}-{}", "x".repeat(240))
        } else {
            format!("web{k}")
        }
    }

    fn claim_name(&self, k: u32) -> String {
        crate::config::kube_objects::pod_claim_name(&Self::name(k), self.interface)
    }

    fn objects(&self, k: u32) -> (String, String) {
        let name = Self::name(k);
        let uid = format!("{k:08x}-0000-4000-8000-0000000000ef");
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: prod\n  uid: {uid}\n  labels: {{app: web}}\n  annotations:\n    k8s.v1.cni.cncf.io/networks: '[{{\"name\":\"blue\",\"interface\":\"{}\"}}]'\nspec:\n  nodeName: {}\nstatus:\n  phase: Running\n",
            self.interface, self.node
        );
        let claim = if self.claim {
            format!(
                "apiVersion: k8s.cni.cncf.io/v1alpha1\nkind: IPAMClaim\nmetadata:\n  name: {}\n  namespace: prod\n  labels: {{vmpath.dev/pod-uid: {uid}}}\nspec:\n  network: blue\n  interface: {}\nstatus:\n  ips: [10.31.0.{}/24]\n",
                self.claim_name(k),
                self.interface,
                self.ip
            )
        } else {
            String::new()
        };
        (pod, claim)
    }
}

/// The ledger entry vouching 10.31.0.`ip` for the plain pod's claim
/// `claim`.
fn pod_holder(claim: &str, ip: u8) -> Holder {
    Holder {
        claim: format!("prod/{claim}").into(),
        uid: Default::default(),
        ip: format!("10.31.0.{ip}/24").parse().unwrap(),
    }
}

/// A new ledger (as a write makes one) with 10.31.0.`ip`'s entry on
/// network blue edited.
fn ledger_edit(ledger: &mut Arc<Ledger>, ip: u8, edit: impl FnOnce(&mut Option<Holder>)) {
    let mut next = (**ledger).clone();
    let addr = std::net::IpAddr::from([10, 31, 0, ip]);
    let blue = next.entry("blue".to_string()).or_default();
    let mut held = blue.remove(&addr);
    edit(&mut held);
    if let Some(h) = held {
        blue.insert(addr, h);
    }
    *ledger = Arc::new(next);
}

/// As [`run_sequence`], with KubeVirt's objects read from files (typed,
/// as the Kubernetes source keeps them): VMIs, virt-launcher pods,
/// IPAMClaims and migrations coming and going on their own, labels,
/// addresses and nodes changing, policies, the network, restarts.
fn run_kube_sequence(seed: u64, steps: usize) -> (Passes, (usize, usize)) {
    let mut claimed = (0, 0);
    let dir: PathBuf = std::env::temp_dir().join(format!(
        "vmpath-equivalence-kube-{}-{seed:x}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let config = dir.join("config");
    std::fs::create_dir_all(&config).unwrap();
    let mut round = crate::round::tests::round_in(&dir, "node-a");
    let mut reader = Reader::default();
    let mut rng = Rng(seed ^ 0x5eed);
    let nodes = |mtu: u32| {
        let mut out = FIXTURE_NETWORK.replace(
            "ipam: {mode: Enabled}",
            &format!("ipam: {{mode: Enabled}}\n  mtu: {mtu}"),
        );
        for (i, n) in KUBE_NODES.iter().enumerate().skip(1) {
            out.push_str(&format!(
                "\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: {n}}}\nstatus:\n  addresses:\n  - {{type: InternalIP, address: 192.0.2.{}}}\n",
                11 + i
            ));
        }
        out
    };
    let mut mtu = 1450;
    write(&config, "network.yaml", &nodes(mtu));
    let mut vms: BTreeMap<u32, KubeVm> = BTreeMap::new();
    let mut next_vm = 0u32;
    let mut pods: BTreeMap<u32, PlainPod> = BTreeMap::new();
    let mut next_pod = 0u32;
    let save_pod = |pods: &BTreeMap<u32, PlainPod>, k: u32| {
        let (file, claim) = (format!("web{k}.yaml"), format!("webclaim{k}.yaml"));
        write_with_claim(&config, &file, &claim, pods[&k].objects(k));
    };
    let mut ledger: Arc<Ledger> = Arc::default();
    let mut shards: Option<(Arc<Ledger>, Arc<Shards>)> = None;
    let save = |vms: &BTreeMap<u32, KubeVm>, k: u32| {
        let (file, claim) = (format!("vm{k}.yaml"), format!("claim{k}.yaml"));
        write_with_claim(&config, &file, &claim, vms[&k].objects(k));
    };
    for step in 0..steps {
        let pick = |rng: &mut Rng, vms: &BTreeMap<u32, KubeVm>| {
            rng.pick(&vms.keys().copied().collect::<Vec<_>>())
        };
        let what = match if step == 0 { 13 } else { rng.below(13) } {
            13 => {
                // First, whatever the seed: two plain pods addressed by
                // their claims, one by a hashed name (web0's is long) and
                // one by a plain name.
                for (k, ip) in [(0, 70), (1, 71)] {
                    let pod = PlainPod {
                        node: "node-a",
                        interface: "net1",
                        ip,
                        claim: true,
                    };
                    let claim = pod.claim_name(k);
                    ledger_edit(&mut ledger, ip, |held| *held = Some(pod_holder(&claim, ip)));
                    pods.insert(k, pod);
                    save_pod(&pods, k);
                }
                next_pod = 2;
                "add plain pods web0 and web1".to_string()
            }
            11 => {
                // A plain pod comes, its claim (most often) with it and
                // vouched for by the controller (most often).
                let pod = PlainPod {
                    node: rng.pick(&KUBE_NODES),
                    interface: rng.pick(&["net1", "Net_1"]),
                    ip: 10 + rng.below(60) as u8,
                    claim: rng.below(5) != 0,
                };
                let k = next_pod;
                if pod.claim && rng.below(4) != 0 {
                    let (ip, claim) = (pod.ip, pod.claim_name(k));
                    ledger_edit(&mut ledger, ip, |held| {
                        held.get_or_insert_with(|| pod_holder(&claim, ip));
                    });
                }
                pods.insert(k, pod);
                save_pod(&pods, k);
                next_pod += 1;
                format!("add plain pod web{k}")
            }
            12 if !pods.is_empty() => {
                let k = rng.pick(&pods.keys().copied().collect::<Vec<_>>());
                let what = match rng.below(5) {
                    0 => {
                        pods.remove(&k);
                        remove(&config, &format!("web{k}.yaml"));
                        "deleted, its claim left"
                    }
                    1 => {
                        let pod = pods.get_mut(&k).unwrap();
                        pod.ip = 10 + rng.below(60) as u8;
                        save_pod(&pods, k);
                        "claim address"
                    }
                    2 => {
                        let pod = pods.get_mut(&k).unwrap();
                        pod.claim = !pod.claim;
                        save_pod(&pods, k);
                        "claim"
                    }
                    3 => {
                        let pod = pods.get_mut(&k).unwrap();
                        pod.node = rng.pick(&KUBE_NODES);
                        save_pod(&pods, k);
                        "node"
                    }
                    _ => {
                        let (ip, claim) = (pods[&k].ip, pods[&k].claim_name(k));
                        ledger_edit(&mut ledger, ip, |held| *held = Some(pod_holder(&claim, ip)));
                        "address vouched"
                    }
                };
                format!("plain pod web{k}: {what}")
            }
            0..=2 => {
                let vm = KubeVm {
                    node: rng.pick(&KUBE_NODES),
                    app: rng.pick(&APPS),
                    ip: 10 + rng.below(60) as u8,
                    mac: 10 + rng.below(200) as u8,
                    tier: rng.pick(&["front", "back"]),
                    pod: rng.below(4) != 0,
                    claim: rng.below(5) != 0,
                    migration: None,
                };
                // The controller vouches for most new claims' addresses
                // (not for one another claim holds).
                if vm.claim && rng.below(4) != 0 {
                    let ip = vm.ip;
                    ledger_edit(&mut ledger, ip, |held| {
                        held.get_or_insert_with(|| holder(next_vm, ip));
                    });
                }
                vms.insert(next_vm, vm);
                save(&vms, next_vm);
                next_vm += 1;
                format!("add vm{}", next_vm - 1)
            }
            3 if !vms.is_empty() => {
                let k = pick(&mut rng, &vms);
                vms.remove(&k);
                remove(&config, &format!("vm{k}.yaml"));
                if rng.below(2) == 0 {
                    remove(&config, &format!("claim{k}.yaml"));
                    format!("delete vm{k} and its claim")
                } else {
                    format!("delete vm{k}, its claim left")
                }
            }
            4 | 5 if !vms.is_empty() => {
                let k = pick(&mut rng, &vms);
                let vm = vms.get_mut(&k).unwrap();
                let what = match rng.below(7) {
                    0 => {
                        vm.app = rng.pick(&APPS);
                        "app label"
                    }
                    1 => {
                        vm.tier = rng.pick(&["front", "back"]);
                        "pod label"
                    }
                    2 => {
                        vm.node = rng.pick(&KUBE_NODES);
                        "node"
                    }
                    3 => {
                        vm.ip = 10 + rng.below(60) as u8;
                        "claim address"
                    }
                    4 => {
                        vm.mac = 10 + rng.below(200) as u8;
                        "mac"
                    }
                    5 => {
                        vm.pod = !vm.pod;
                        "pod"
                    }
                    _ => {
                        vm.claim = !vm.claim;
                        "claim"
                    }
                };
                save(&vms, k);
                format!("vm{k}'s {what}")
            }
            6 if !vms.is_empty() => {
                let k = pick(&mut rng, &vms);
                let vm = vms.get_mut(&k).unwrap();
                vm.migration = match vm.migration {
                    None => Some((rng.pick(&KUBE_NODES), "Running")),
                    Some((t, "Running")) => Some((t, "Succeeded")),
                    Some(_) => None,
                };
                let now = vm.migration;
                save(&vms, k);
                format!("vm{k}'s migration {now:?}")
            }
            7 => policy_step(&mut rng, &config, 2),
            8 => {
                mtu = if mtu == 1450 { 1400 } else { 1450 };
                write(&config, "network.yaml", &nodes(mtu));
                format!("network mtu {mtu}")
            }
            9 if !vms.is_empty() => {
                // The controller's ledger: an address vouched for a VM's
                // claim, taken from it, or a write that changed nothing.
                let k = pick(&mut rng, &vms);
                let ip = vms[&k].ip;
                match rng.below(3) {
                    0 => {
                        ledger_edit(&mut ledger, ip, |held| *held = Some(holder(k, ip)));
                        format!("ledger: 10.31.0.{ip} vouched for vm{k}")
                    }
                    1 => {
                        ledger_edit(&mut ledger, ip, |held| *held = None);
                        format!("ledger: 10.31.0.{ip} given to no claim")
                    }
                    _ => {
                        ledger = Arc::new((*ledger).clone());
                        "ledger written unchanged".to_string()
                    }
                }
            }
            _ => {
                round.forget_increments();
                "restart".to_string()
            }
        };
        let mut snap = reader.read(&config);
        // As the Kubernetes source reads: claims made for plain pods, and
        // the ledger (shared between reads until it is written).
        snap.pod_claims = true;
        // Split as the watch reads it, again only after a write.
        if !shards
            .as_ref()
            .is_some_and(|(l, _)| Arc::ptr_eq(l, &ledger))
        {
            shards = Some((ledger.clone(), Arc::new(Shards::of(&ledger))));
        }
        snap.ledger = shards.as_ref().map(|(_, s)| s.clone());
        let ports = |_: &str| None;
        let cfg = check_step(&mut round, &snap, &ports, seed, step, &what);
        // Plain pods' interfaces with the address of a claim read by a
        // hashed name, and by a plain one.
        for a in cfg
            .attachments
            .iter()
            .filter(|a| a.key.vm.starts_with("web"))
        {
            if !a.ips.is_empty() {
                let plain = format!("{}.{}", a.key.vm, a.key.interface);
                let name = crate::config::kube_objects::pod_claim_name(&a.key.vm, &a.key.interface);
                *if name == plain {
                    &mut claimed.1
                } else {
                    &mut claimed.0
                } += 1;
            }
        }
    }
    eprintln!(
        "seed {seed} (KubeVirt objects): derive and validate {:?}; plain pods' interfaces addressed by hashed and plain claim names, over the steps: {claimed:?}",
        round.passes
    );
    let _ = std::fs::remove_dir_all(&dir);
    (round.passes, claimed)
}
