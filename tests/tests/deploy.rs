//! The manifests in deploy/: every document is a valid Kubernetes object
//! (deserialized into k8s-openapi types, with no field the API would not
//! know), the DaemonSet has the facts the agent relies on, and the example
//! config passes vmpath's own validation.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use k8s_openapi::{
    api::{
        apps::v1::{DaemonSet, Deployment},
        core::v1::{ConfigMap, Container, Namespace, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    serde::{Serialize, de::DeserializeOwned},
};
use serde_json::Value;
use vmpath_tests::vmpath;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("deploy")
}

const KUSTOMIZATION: &str = "kustomization.yaml";

/// The manifests in deploy/ and deploy/crds/ (every *.yaml but the
/// kustomization), relative to deploy/, sorted.
fn manifest_files() -> Vec<String> {
    let dir = deploy_dir();
    let mut files: Vec<String> = [dir.clone(), dir.join("crds")]
        .iter()
        .flat_map(|d| fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .map(|p| p.strip_prefix(&dir).unwrap().to_string_lossy().to_string())
        .filter(|name| name != KUSTOMIZATION)
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in deploy/");
    files
}

fn read_yaml(name: &str) -> Vec<Value> {
    let text = fs::read_to_string(deploy_dir().join(name))
        .unwrap_or_else(|e| panic!("deploy/{name}: {e}"));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("{name}: not valid YAML: {e}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// Every document of every manifest in deploy/, with its file.
fn documents() -> Vec<(String, Value)> {
    manifest_files()
        .into_iter()
        .flat_map(|name| read_yaml(&name).into_iter().map(move |v| (name.clone(), v)))
        .collect()
}

/// Deserializes `doc` as `T` and checks nothing was dropped on the way: a
/// misspelt or misplaced field, which Kubernetes would reject or ignore,
/// makes the round trip differ.
fn typed<T: DeserializeOwned + Serialize>(file: &str, doc: &Value) -> T {
    let obj: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{file}: {} does not deserialize: {e}", describe(doc)));
    let back = serde_json::to_value(&obj).unwrap();
    let (want, have) = (normalize(doc), normalize(&back));
    assert_eq!(
        want,
        have,
        "{file}: {} has fields Kubernetes does not know (left: as written, right: as understood)",
        describe(doc)
    );
    obj
}

/// Numbers compared by value: a schema's `minimum: 1` comes back as 1.0.
fn normalize(v: &Value) -> Value {
    match v {
        Value::Number(n) => n.as_f64().map(Value::from).unwrap_or(v.clone()),
        Value::Array(a) => Value::Array(a.iter().map(normalize).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, v)| (k.clone(), normalize(v))).collect())
        }
        _ => v.clone(),
    }
}

fn describe(doc: &Value) -> String {
    format!(
        "{} {}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

struct Manifests {
    daemonsets: Vec<DaemonSet>,
    config_maps: Vec<ConfigMap>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    service_accounts: Vec<ServiceAccount>,
    namespaces: Vec<Namespace>,
    crds: Vec<CustomResourceDefinition>,
    deployments: Vec<Deployment>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
}

fn manifests() -> Manifests {
    let mut m = Manifests {
        daemonsets: vec![],
        config_maps: vec![],
        cluster_roles: vec![],
        bindings: vec![],
        service_accounts: vec![],
        namespaces: vec![],
        crds: vec![],
        deployments: vec![],
        roles: vec![],
        role_bindings: vec![],
    };
    for (file, doc) in documents() {
        match doc["kind"].as_str() {
            Some("DaemonSet") => m.daemonsets.push(typed(&file, &doc)),
            Some("ConfigMap") => m.config_maps.push(typed(&file, &doc)),
            Some("ClusterRole") => m.cluster_roles.push(typed(&file, &doc)),
            Some("ClusterRoleBinding") => m.bindings.push(typed(&file, &doc)),
            Some("ServiceAccount") => m.service_accounts.push(typed(&file, &doc)),
            Some("Namespace") => m.namespaces.push(typed(&file, &doc)),
            Some("CustomResourceDefinition") => m.crds.push(typed(&file, &doc)),
            Some("Deployment") => m.deployments.push(typed(&file, &doc)),
            Some("Role") => m.roles.push(typed(&file, &doc)),
            Some("RoleBinding") => m.role_bindings.push(typed(&file, &doc)),
            other => panic!("{file}: unexpected kind {other:?}"),
        }
    }
    m
}

fn container<'a>(containers: &'a [Container], name: &str) -> &'a Container {
    containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

#[test]
fn every_manifest_is_a_valid_kubernetes_object() {
    let m = manifests();
    assert_eq!(m.daemonsets.len(), 1);
    assert_eq!(m.config_maps.len(), 2);
    assert_eq!(m.namespaces.len(), 1);
    assert_eq!(
        m.service_accounts.len(),
        2,
        "the agent's and the controller's"
    );
    assert_eq!(m.cluster_roles.len(), 2);
    assert_eq!(m.bindings.len(), 2);
    // The controller's (Lease, ledger) and the agent's (reading the ledger).
    assert_eq!((m.roles.len(), m.role_bindings.len()), (2, 2));
    assert_eq!(m.deployments.len(), 1);
    let crds: Vec<_> = m.crds.iter().map(|c| c.metadata.name.as_deref()).collect();
    assert_eq!(crds, [Some("networks.vmpath.dev")]);
    let ns = m.namespaces[0].metadata.name.as_deref().unwrap();
    assert_eq!(ns, "vmpath-system");
    for (kind, obj_ns) in [
        ("DaemonSet", &m.daemonsets[0].metadata.namespace),
        ("Deployment", &m.deployments[0].metadata.namespace),
        ("Role", &m.roles[0].metadata.namespace),
        ("RoleBinding", &m.role_bindings[0].metadata.namespace),
    ]
    .into_iter()
    .chain(
        m.service_accounts
            .iter()
            .map(|s| ("ServiceAccount", &s.metadata.namespace)),
    )
    .chain(
        m.config_maps
            .iter()
            .map(|c| ("ConfigMap", &c.metadata.namespace)),
    ) {
        assert_eq!(obj_ns.as_deref(), Some(ns), "{kind} namespace");
    }
}

#[test]
fn daemonset_runs_the_agent_unprivileged_on_the_host_network() {
    let m = manifests();
    let ds = &m.daemonsets[0];
    let spec = ds.spec.as_ref().unwrap();
    let strategy = spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        strategy
            .rolling_update
            .as_ref()
            .unwrap()
            .max_unavailable
            .as_ref(),
        Some(&k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true), "hostNetwork");
    assert_ne!(pod.host_pid, Some(true), "hostPID");
    assert_eq!(pod.service_account_name.as_deref(), Some("vmpath"));
    assert!(
        m.service_accounts
            .iter()
            .any(|s| s.metadata.name.as_deref() == pod.service_account_name.as_deref())
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerates every taint: {tolerations:?}"
    );

    let agent = container(&pod.containers, "vmpath");
    assert_eq!(
        agent.command.as_deref(),
        Some(&["vmpath".to_string(), "agent".to_string()][..])
    );
    let node_name = agent
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME env");
    assert_eq!(
        node_name
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName")
    );

    let sc = agent.security_context.as_ref().unwrap();
    assert_ne!(sc.privileged, Some(true), "the agent is not privileged");
    let caps = sc.capabilities.as_ref().unwrap();
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(
        added,
        BTreeSet::from(["BPF", "NET_ADMIN", "NET_RAW", "PERFMON", "SYS_ADMIN"])
    );
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));

    // Mounts: name -> (path, propagation), and the volumes behind them.
    let mounts: BTreeMap<&str, (&str, Option<&str>)> = agent
        .volume_mounts
        .iter()
        .flatten()
        .map(|v| {
            (
                v.mount_path.as_str(),
                (v.name.as_str(), v.mount_propagation.as_deref()),
            )
        })
        .collect();
    let volumes: BTreeMap<&str, _> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| (v.name.as_str(), v))
        .collect();
    let host_path = |mount: &str| -> (String, Option<String>) {
        let (name, _) = mounts
            .get(mount)
            .unwrap_or_else(|| panic!("{mount} not mounted"));
        let hp = volumes[name]
            .host_path
            .as_ref()
            .unwrap_or_else(|| panic!("{mount} is not a hostPath"));
        (hp.path.clone(), hp.type_.clone())
    };
    assert_eq!(host_path("/sys/fs/bpf").0, "/sys/fs/bpf");
    assert_eq!(
        host_path("/var/lib/vmpath"),
        (
            "/var/lib/vmpath".to_string(),
            Some("DirectoryOrCreate".to_string())
        )
    );
    assert_eq!(host_path("/run/vmpath").0, "/run/vmpath");
    let (config_volume, _) = mounts["/etc/vmpath"];
    let config_map = volumes[config_volume]
        .config_map
        .as_ref()
        .expect("/etc/vmpath is a ConfigMap");
    assert!(
        m.config_maps
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some(config_map.name.as_str())),
        "the config ConfigMap {} is in deploy/",
        config_map.name
    );

    // Pins must reach the host's bpffs: the agent sees it through
    // propagation, and whoever may mount one does so Bidirectionally (which
    // Kubernetes allows only in privileged containers).
    let bpffs = mounts["/sys/fs/bpf"];
    assert_eq!(bpffs.1, Some("HostToContainer"), "agent bpffs propagation");
    let init = container(pod.init_containers.as_deref().unwrap(), "mount-bpffs");
    let init_mount = init
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.mount_path == "/sys/fs/bpf")
        .expect("init container mounts /sys/fs/bpf");
    assert_eq!(init_mount.name, bpffs.0);
    assert_eq!(
        init_mount.mount_propagation.as_deref(),
        Some("Bidirectional")
    );
    for c in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        let privileged = c
            .security_context
            .as_ref()
            .and_then(|s| s.privileged)
            .unwrap_or(false);
        for v in c.volume_mounts.iter().flatten() {
            if v.mount_propagation.as_deref() == Some("Bidirectional") {
                assert!(
                    privileged,
                    "{}: Bidirectional propagation needs privileged",
                    c.name
                );
            }
        }
    }

    // Probes exec the CLI (the API is a unix socket).
    for (what, probe) in [
        ("liveness", agent.liveness_probe.as_ref()),
        ("readiness", agent.readiness_probe.as_ref()),
    ] {
        let command = probe
            .and_then(|p| p.exec.as_ref())
            .and_then(|e| e.command.as_ref())
            .unwrap_or_else(|| panic!("{what} probe is not an exec"));
        assert_eq!(&command[..2], ["vmpath", "status"], "{what} probe");
    }
    let resources = agent.resources.as_ref().unwrap();
    assert!(resources.requests.is_some() && resources.limits.is_some());

    // The BIRD sidecar, configured from the BIRD ConfigMap.
    let bird = container(&pod.containers, "bird");
    assert!(bird.resources.as_ref().unwrap().limits.is_some());
    let bird_mount = bird
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| v.mount_path == "/etc/bird")
        .expect("bird config mount");
    let bird_cm = volumes[bird_mount.name.as_str()]
        .config_map
        .as_ref()
        .unwrap();
    let cm = m
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(bird_cm.name.as_str()))
        .expect("BIRD ConfigMap in deploy/");
    assert!(cm.data.as_ref().unwrap().contains_key("bird.conf"));
}

/// (group, resource, verb) of RBAC rules.
fn grants(rules: &[PolicyRule]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for r in rules {
        assert!(
            r.resource_names.is_none() && r.non_resource_urls.is_none(),
            "{r:?}"
        );
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    out.insert((g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

fn table(rules: &[vmpath::read::rbac::Rule]) -> BTreeSet<(String, String, String)> {
    rules
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect()
}

/// Each ServiceAccount gets exactly what its code uses (the table in
/// agent/src/read/rbac.rs): no verb more, none missing.
#[test]
fn rbac_grants_exactly_what_the_code_uses() {
    use vmpath::read::rbac;
    let m = manifests();
    let cluster_role_of = |sa: &str| -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for b in &m.bindings {
            let bound = b.subjects.iter().flatten().any(|s| {
                s.kind == "ServiceAccount"
                    && s.name == sa
                    && s.namespace.as_deref() == Some("vmpath-system")
            });
            if !bound {
                continue;
            }
            assert_eq!(b.role_ref.kind, "ClusterRole");
            let role = m
                .cluster_roles
                .iter()
                .find(|r| r.metadata.name.as_ref() == Some(&b.role_ref.name))
                .unwrap_or_else(|| panic!("ClusterRole {} is not in deploy/", b.role_ref.name));
            out.extend(grants(role.rules.as_deref().unwrap_or_default()));
        }
        out
    };
    let role_of = |sa: &str| -> BTreeSet<(String, String, String)> {
        let mut out = BTreeSet::new();
        for b in &m.role_bindings {
            if !b
                .subjects
                .iter()
                .flatten()
                .any(|s| s.kind == "ServiceAccount" && s.name == sa)
            {
                continue;
            }
            assert_eq!(b.metadata.namespace.as_deref(), Some("vmpath-system"));
            let role = m
                .roles
                .iter()
                .find(|r| r.metadata.name.as_ref() == Some(&b.role_ref.name))
                .unwrap_or_else(|| panic!("Role {} is not in deploy/", b.role_ref.name));
            assert_eq!(role.metadata.namespace, b.metadata.namespace);
            out.extend(grants(role.rules.as_deref().unwrap_or_default()));
        }
        out
    };
    assert_eq!(
        cluster_role_of("vmpath"),
        table(rbac::AGENT),
        "the agent's ClusterRole"
    );
    assert_eq!(
        role_of("vmpath"),
        table(rbac::AGENT_NAMESPACED),
        "the agent's Role (the ledger's ConfigMaps)"
    );
    assert_eq!(
        cluster_role_of("vmpath-controller"),
        table(rbac::CONTROLLER),
        "the controller's ClusterRole"
    );
    assert_eq!(
        role_of("vmpath-controller"),
        table(rbac::CONTROLLER_NAMESPACED),
        "the controller's Role"
    );
    let sas: BTreeSet<_> = m
        .service_accounts
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    assert_eq!(
        sas,
        ["vmpath".to_string(), "vmpath-controller".to_string()].into()
    );
}

/// The controller runs `vmpath controller` under its own ServiceAccount,
/// with the identity and namespace the Lease needs, unprivileged.
#[test]
fn the_controller_deployment_runs_vmpath_controller_unprivileged() {
    let m = manifests();
    assert_eq!(m.deployments.len(), 1);
    let d = &m.deployments[0];
    let spec = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some("vmpath-controller")
    );
    let c = container(&spec.containers, "controller");
    assert_eq!(
        c.command.as_deref(),
        Some(&["vmpath".to_string(), "controller".to_string()][..])
    );
    let env: BTreeMap<_, _> = c
        .env
        .iter()
        .flatten()
        .map(|e| {
            let field = e
                .value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.clone());
            (e.name.clone(), field)
        })
        .collect();
    assert_eq!(env["POD_NAME"].as_deref(), Some("metadata.name"));
    assert_eq!(env["POD_NAMESPACE"].as_deref(), Some("metadata.namespace"));
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.privileged, None);
    assert_eq!(
        c.image.as_deref(),
        Some("vmpath"),
        "the kustomization's image name"
    );
}

#[test]
fn example_config_passes_vmpath_validation() {
    let m = manifests();
    let cm = m
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("vmpath-config"))
        .expect("vmpath-config ConfigMap");
    let data = cm.data.as_ref().unwrap();
    let dir = std::env::temp_dir().join(format!("vmpath-deploy-test-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for (key, text) in data {
        fs::write(dir.join(key), text).unwrap();
    }
    let snap = vmpath::config::source::read_dir(&dir);
    let _ = fs::remove_dir_all(&dir);
    assert!(!snap.empty);
    let mut nodes = BTreeSet::new();
    for doc in &snap.documents {
        if doc.value["kind"].as_str() == Some("Node") {
            nodes.insert(doc.value["metadata"]["name"].as_str().unwrap().to_string());
        }
    }
    assert!(nodes.len() >= 2, "example Node documents: {nodes:?}");
    for node in &nodes {
        let cfg = vmpath::round::validate(&snap, node, &BTreeSet::new());
        let errors: Vec<String> = cfg.errors.iter().map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "refused on {node}: {errors:#?}");
        assert_eq!(
            cfg.node.as_ref().map(|n| n.name.as_str()),
            Some(node.as_str())
        );
        assert!(cfg.networks.len() >= 2);
        assert!(cfg.attachments.len() >= 3);
    }
}

#[test]
fn bird_config_parses() {
    let m = manifests();
    let cm = m
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("vmpath-bird"))
        .expect("vmpath-bird ConfigMap");
    let conf = &cm.data.as_ref().unwrap()["bird.conf"];
    // As docs/operations.md ("Route export") says: learn table 100,
    // export only protocol 250's routes.
    assert!(conf.contains("kernel table 100"));
    assert!(conf.contains("krt_source = 250"));
    let path = std::env::temp_dir().join(format!("vmpath-bird-{}.conf", std::process::id()));
    fs::write(&path, conf).unwrap();
    let out = Command::new("bird").arg("-p").arg("-c").arg(&path).output();
    let _ = fs::remove_file(&path);
    match out {
        Ok(out) => assert!(
            out.status.success(),
            "bird -p rejects bird.conf: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => eprintln!("bird not installed ({e}): parse check skipped"),
    }
}

#[test]
fn daemonset_installs_the_cni_plugin_into_the_hosts_cni_bin() {
    let m = manifests();
    let pod = m.daemonsets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let init = container(pod.init_containers.as_deref().unwrap(), "install-cni");
    let command = init.command.as_deref().unwrap();
    assert_eq!(&command[..2], ["vmpath-cni", "install"]);
    let target = &command[2];
    let mount = init
        .volume_mounts
        .iter()
        .flatten()
        .find(|v| &v.mount_path == target)
        .expect("install-cni mounts its target directory");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .expect("the install target's volume");
    assert_eq!(
        volume.host_path.as_ref().map(|h| h.path.as_str()),
        Some("/opt/cni/bin"),
        "the plugin lands in the host's /opt/cni/bin"
    );
}

/// The subset of `kubevirt.io/v1` and `k8s.cni.cncf.io/v1` that the
/// deploy/cni/ examples use, as typed mirrors: no Rust crate carries the
/// KubeVirt or NetworkAttachmentDefinition API types (k8s-openapi has the
/// core API only), so these follow KubeVirt's and the NAD CRD's published
/// field names, refuse every field they do not know, and take `metadata`
/// and quantities from k8s-openapi. A misspelt or misplaced field fails
/// to deserialize, as the API server would refuse it. Fields are there to
/// be checked while deserializing, not all to be read.
#[allow(dead_code)]
mod upstream {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta};
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct NetworkAttachmentDefinition {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: NetworkAttachmentDefinitionSpec,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct NetworkAttachmentDefinitionSpec {
        /// A CNI network configuration, as JSON text.
        pub config: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct VirtualMachine {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: VirtualMachineSpec,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct VirtualMachineSpec {
        pub run_strategy: Option<RunStrategy>,
        pub running: Option<bool>,
        pub template: VirtualMachineInstanceTemplateSpec,
    }

    #[derive(Deserialize, Debug, PartialEq, Eq)]
    pub enum RunStrategy {
        Always,
        RerunOnFailure,
        Manual,
        Halted,
        Once,
        WaitAsReceiver,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct VirtualMachineInstanceTemplateSpec {
        pub metadata: Option<ObjectMeta>,
        pub spec: VirtualMachineInstanceSpec,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct VirtualMachineInstanceSpec {
        pub domain: DomainSpec,
        #[serde(default)]
        pub networks: Vec<Network>,
        #[serde(default)]
        pub volumes: Vec<Volume>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct DomainSpec {
        pub devices: Devices,
        pub resources: Option<ResourceRequirements>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ResourceRequirements {
        #[serde(default)]
        pub requests: BTreeMap<String, Quantity>,
        #[serde(default)]
        pub limits: BTreeMap<String, Quantity>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Devices {
        #[serde(default)]
        pub interfaces: Vec<Interface>,
        #[serde(default)]
        pub disks: Vec<Disk>,
    }

    /// One binding method per interface (`bridge`, `masquerade`, or a
    /// binding plugin by name).
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Interface {
        pub name: String,
        pub bridge: Option<Empty>,
        pub masquerade: Option<Empty>,
        pub binding: Option<PluginBinding>,
        pub mac_address: Option<String>,
        pub model: Option<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Empty {}

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct PluginBinding {
        pub name: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Network {
        pub name: String,
        pub pod: Option<PodNetwork>,
        pub multus: Option<MultusNetwork>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct PodNetwork {
        pub vm_network_cidr: Option<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct MultusNetwork {
        pub network_name: String,
        #[serde(default)]
        pub default: bool,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Disk {
        pub name: String,
        pub disk: Option<DiskTarget>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct DiskTarget {
        pub bus: Option<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Volume {
        pub name: String,
        pub container_disk: Option<ContainerDisk>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct ContainerDisk {
        pub image: String,
    }
}

/// The CNI examples (deploy/cni/): the NetworkAttachmentDefinition carries a
/// vmpath-cni config (a valid CNI network configuration) for a network the
/// example ConfigMap defines, and the KubeVirt VM puts a bridge-bound
/// interface with a fixed MAC on it; each deserializes into its API types.
#[test]
fn cni_examples_name_a_vmpath_network() {
    let read = |f: &str| -> serde_json::Value {
        let text = fs::read_to_string(deploy_dir().join("cni").join(f)).unwrap();
        serde_saphyr::from_str::<serde_json::Value>(&text)
            .unwrap_or_else(|e| panic!("deploy/cni/{f}: {e}"))
    };
    let nad: upstream::NetworkAttachmentDefinition =
        serde_json::from_value(read("network-attachment-definition.yaml"))
            .unwrap_or_else(|e| panic!("deploy/cni/network-attachment-definition.yaml: {e}"));
    assert_eq!(nad.api_version, "k8s.cni.cncf.io/v1");
    assert_eq!(nad.kind, "NetworkAttachmentDefinition");
    // The config is a CNI network configuration as the CNI types read it.
    let config: rscni_types::types::NetConf = serde_json::from_str(&nad.spec.config)
        .unwrap_or_else(|e| panic!("the NAD's spec.config is not a CNI config: {e}"));
    assert_eq!(config.r#type, "vmpath-cni");
    assert_eq!(config.cni_version, "1.1.0");
    assert_eq!(
        config.capabilities.as_ref().and_then(|c| c.get("mac")),
        Some(&true),
        "the runtime may pass the VM's MAC"
    );
    let network = config.custom["network"].as_str().unwrap().to_string();
    let configmap = fs::read_to_string(deploy_dir().join("configmap.yaml")).unwrap();
    assert!(
        configmap.contains(&format!("kind: Network\n    metadata: {{name: {network}}}")),
        "the NAD's network {network} is in the example config"
    );

    let vm: upstream::VirtualMachine = serde_json::from_value(read("virtualmachine.yaml"))
        .unwrap_or_else(|e| panic!("deploy/cni/virtualmachine.yaml: {e}"));
    assert_eq!(vm.api_version, "kubevirt.io/v1");
    assert_eq!(vm.kind, "VirtualMachine");
    assert_eq!(vm.spec.run_strategy, Some(upstream::RunStrategy::Always));
    let spec = &vm.spec.template.spec;
    let nad_ref = format!(
        "{}/{}",
        nad.metadata.namespace.as_deref().unwrap(),
        nad.metadata.name.as_deref().unwrap()
    );
    let net = spec
        .networks
        .iter()
        .find(|n| n.multus.as_ref().is_some_and(|m| m.network_name == nad_ref))
        .expect("a Multus network using the NAD");
    let iface = spec
        .domain
        .devices
        .interfaces
        .iter()
        .find(|i| i.name == net.name)
        .expect("the interface on that network");
    assert!(iface.bridge.is_some(), "bridge binding");
    assert!(
        iface.binding.is_none() && iface.masquerade.is_none(),
        "one binding"
    );
    let mac = iface.mac_address.as_deref().expect("MAC kept");
    assert!(vmpath::config::parse_mac(mac).is_ok(), "{mac}");
    for i in &spec.domain.devices.interfaces {
        assert!(
            spec.networks.iter().any(|n| n.name == i.name),
            "interface {} has a network",
            i.name
        );
    }
    for d in &spec.domain.devices.disks {
        assert!(
            spec.volumes
                .iter()
                .any(|v| v.name == d.name && v.container_disk.is_some()),
            "disk {} has a volume",
            d.name
        );
    }
}

/// deploy/kustomization.yaml (`kubectl apply -k deploy/`): it lists every
/// manifest of deploy/ and nothing else, names the two images `cargo xtask
/// image` builds (vmpath's, for every container that runs it, and the BIRD
/// sidecar's) and no other, with one tag of this version that the BIRD
/// image takes from vmpath's.
#[test]
fn kustomization_lists_every_manifest_and_names_the_images_once() {
    let docs = read_yaml(KUSTOMIZATION);
    assert_eq!(docs.len(), 1, "one Kustomization document");
    let k = &docs[0];
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    let mut resources: Vec<String> = k["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("a resource is a path").to_string())
        .collect();
    for r in &resources {
        assert!(
            deploy_dir().join(r).is_file(),
            "kustomization lists {r}, which is not in deploy/"
        );
        // Each parses (and, through `manifests()`, is a valid object).
        assert!(!read_yaml(r).is_empty(), "{r} holds no document");
    }
    resources.sort();
    assert_eq!(
        resources,
        manifest_files(),
        "the kustomization's resources are deploy/'s manifests"
    );
    let _ = manifests();

    // `images:`: vmpath with the one tag, the BIRD image with none of its
    // own.
    let images: BTreeMap<&str, &Value> = k["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|i| (i["name"].as_str().expect("an image's name"), i))
        .collect();
    assert_eq!(
        images.keys().copied().collect::<Vec<_>>(),
        ["vmpath", "vmpath-bird"],
        "the images cargo xtask image builds"
    );
    for (name, image) in &images {
        assert!(
            image["newName"]
                .as_str()
                .is_some_and(|n| n.ends_with(&format!("/{name}"))),
            "{name}: newName {}",
            image["newName"]
        );
    }
    let tag = images["vmpath"]["newTag"]
        .as_str()
        .expect("newTag is a string");
    assert!(
        tag.starts_with(env!("CARGO_PKG_VERSION")),
        "newTag {tag} is not of version {}",
        env!("CARGO_PKG_VERSION")
    );
    assert!(
        images["vmpath-bird"].get("newTag").is_none(),
        "the BIRD image's tag is vmpath's, set once"
    );
    // `replacements:` copies the tag (after the ':') of the agent
    // container's image to the bird container's.
    let replacements = k["replacements"].as_array().expect("replacements");
    assert_eq!(replacements.len(), 1, "{replacements:?}");
    let r = &replacements[0];
    let by_tag = serde_json::json!({"delimiter": ":", "index": 1});
    assert_eq!(r["source"]["kind"], "DaemonSet");
    assert_eq!(r["source"]["name"], "vmpath");
    assert_eq!(
        r["source"]["fieldPath"],
        "spec.template.spec.containers.[name=vmpath].image"
    );
    assert_eq!(normalize(&r["source"]["options"]), normalize(&by_tag));
    let targets = r["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0]["select"]["kind"], "DaemonSet");
    assert_eq!(targets[0]["select"]["name"], "vmpath");
    assert_eq!(
        targets[0]["fieldPaths"],
        serde_json::json!(["spec.template.spec.containers.[name=bird].image"])
    );
    assert_eq!(normalize(&targets[0]["options"]), normalize(&by_tag));

    // Every container of every workload runs one of these images, by the
    // name `images:` replaces: no placeholder, nothing built elsewhere.
    let m = manifests();
    let pod = m.daemonsets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let controller = m.deployments[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let every: Vec<&Container> = [pod, controller]
        .into_iter()
        .flat_map(|p| {
            p.containers
                .iter()
                .chain(p.init_containers.iter().flatten())
        })
        .collect();
    for c in &every {
        let image = c.image.as_deref().unwrap_or_default();
        assert!(
            images.contains_key(image),
            "{}: image {image:?} is not one the kustomization names",
            c.name
        );
        assert_eq!(
            c.image_pull_policy.as_deref(),
            Some("IfNotPresent"),
            "{}",
            c.name
        );
    }
    // vmpath's containers use its name, so the one newTag sets them all.
    let ours: Vec<&&Container> = every
        .iter()
        .filter(|c| {
            c.command
                .as_ref()
                .and_then(|c| c.first())
                .is_some_and(|p| p == "vmpath" || p == "vmpath-cni")
        })
        .collect();
    assert_eq!(
        ours.len(),
        4,
        "agent, mount-bpffs, install-cni, the controller"
    );
    for c in ours {
        assert_eq!(c.image.as_deref(), Some("vmpath"), "{}'s image", c.name);
    }
    assert_eq!(
        container(&pod.containers, "bird").image.as_deref(),
        Some("vmpath-bird")
    );

    // What `kubectl apply -k` applies: kustomize itself (in kubectl) renders
    // every container with a built image and the one tag.
    let rendered = match Command::new("kubectl")
        .args(["kustomize"])
        .arg(deploy_dir())
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "kubectl kustomize deploy/: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        }
        Err(e) => {
            eprintln!("kubectl not installed ({e}): the rendering check is skipped");
            return;
        }
    };
    let rendered: Vec<Value> = serde_saphyr::from_multiple(&rendered).unwrap();
    let mut seen = BTreeMap::new();
    for doc in &rendered {
        let spec = &doc["spec"]["template"]["spec"];
        for list in ["containers", "initContainers"] {
            for c in spec[list].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap().to_string();
                seen.insert(name, c["image"].as_str().unwrap().to_string());
            }
        }
    }
    let want = |image: &str| format!("{}:{tag}", images[image]["newName"].as_str().unwrap());
    assert_eq!(seen.len(), every.len(), "{seen:?}");
    for c in &every {
        let image = c.image.as_deref().unwrap();
        assert_eq!(seen[&c.name], want(image), "{} as rendered", c.name);
    }
}

/// The data path's map sizes reach the agent from the `vmpath-config`
/// ConfigMap: each env var the DaemonSet takes from it names a key the
/// ConfigMap has, with a size the agent accepts, and the agent reads that
/// variable as its flag (a size out of range is refused naming the flag).
#[test]
fn map_sizes_come_from_the_configmap_as_agent_flags() {
    let m = manifests();
    let pod = m.daemonsets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let agent = container(&pod.containers, "vmpath");
    let config = m
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("vmpath-config"))
        .expect("the vmpath-config ConfigMap");
    let data = config.data.as_ref().unwrap();
    for (var, key, flag) in [
        ("VMPATH_MAX_ENDPOINTS", "maxEndpoints", "--max-endpoints"),
        ("VMPATH_MAX_ADDRESSES", "maxAddresses", "--max-addresses"),
    ] {
        let env = agent
            .env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == var)
            .unwrap_or_else(|| panic!("{var} env"));
        let r = env
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{var} from a ConfigMap key"));
        assert_eq!((r.name.as_str(), r.key.as_str()), ("vmpath-config", key));
        let size: u32 = data[key].parse().unwrap_or_else(|e| panic!("{key}: {e}"));
        assert!(
            (vmpath_common::sized::MIN..=vmpath_common::sized::MAX).contains(&size),
            "{key}: {size}"
        );
        let out = Command::new(vmpath_tests::vmpath_bin())
            .arg("agent")
            .env(var, "12")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains(&format!("invalid value '12' for '{flag} <"))
                && err.contains("1024..=4194304"),
            "{err}"
        );
    }
}

/// The cluster's pod and Service CIDRs reach the agent from the
/// `vmpath-config` ConfigMap as its flags: each env var names a key the
/// ConfigMap has; the example's values are CIDRs the example networks do
/// not overlap, and a Primary network that does overlap one is refused
/// naming both; a value that is not a CIDR stops the agent naming the flag.
#[test]
fn cluster_cidrs_come_from_the_configmap_as_agent_flags() {
    use vmpath::config::{ClusterCidr, ClusterCidrKind};
    let m = manifests();
    let pod = m.daemonsets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let agent = container(&pod.containers, "vmpath");
    let config = m
        .config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("vmpath-config"))
        .expect("the vmpath-config ConfigMap");
    let data = config.data.as_ref().unwrap();
    let mut cidrs = Vec::new();
    for (var, key, flag, kind) in [
        (
            "VMPATH_CLUSTER_POD_CIDRS",
            "clusterPodCIDRs",
            "--cluster-pod-cidrs",
            ClusterCidrKind::Pod,
        ),
        (
            "VMPATH_CLUSTER_SERVICE_CIDRS",
            "clusterServiceCIDRs",
            "--cluster-service-cidrs",
            ClusterCidrKind::Service,
        ),
    ] {
        let env = agent
            .env
            .as_ref()
            .unwrap()
            .iter()
            .find(|e| e.name == var)
            .unwrap_or_else(|| panic!("{var} env"));
        let r = env
            .value_from
            .as_ref()
            .and_then(|v| v.config_map_key_ref.as_ref())
            .unwrap_or_else(|| panic!("{var} from a ConfigMap key"));
        assert_eq!((r.name.as_str(), r.key.as_str()), ("vmpath-config", key));
        for text in data[key].split(',') {
            let cidr: ipnet::IpNet = text.parse().unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(cidr.trunc(), cidr, "{key}: host bits");
            cidrs.push(ClusterCidr {
                cidr,
                kind,
                source: flag.into(),
                node: None,
            });
        }
        let out = Command::new(vmpath_tests::vmpath_bin())
            .arg("agent")
            .env(var, "10.244.0.0/16,10.96.0.1/12")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains(&format!("invalid value '10.96.0.1/12' for '{flag} <"))
                && err.contains("10.96.0.1/12 has host bits set (did you mean 10.96.0.0/12?)"),
            "{err}"
        );
    }
    assert!(cidrs.iter().any(|c| c.cidr.addr().is_ipv6()));

    // The example config under the example CIDRs: accepted.
    let dir = std::env::temp_dir().join(format!("vmpath-deploy-cidrs-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    for (key, text) in data {
        fs::write(dir.join(key), text).unwrap();
    }
    let mut snap = vmpath::config::source::read_dir(&dir);
    let _ = fs::remove_dir_all(&dir);
    snap.cluster_cidrs.clone_from(&cidrs);
    let cfg = vmpath::round::validate(&snap, "node-a", &BTreeSet::new());
    assert!(cfg.errors.is_empty(), "{:#?}", cfg.errors);
    // A cluster whose pods are where the example's Primary network is.
    snap.cluster_cidrs.push(ClusterCidr {
        cidr: "10.20.128.0/17".parse().unwrap(),
        kind: ClusterCidrKind::Pod,
        source: "--cluster-pod-cidrs".into(),
        node: None,
    });
    let cfg = vmpath::round::validate(&snap, "node-a", &BTreeSet::new());
    assert!(cfg.networks.iter().all(|n| n.name != "blue"));
    assert!(
        cfg.errors.iter().any(|e| e.to_string().contains(
            "10.20.0.0/16 of Primary network \"blue\" overlaps the cluster's pod CIDR 10.20.128.0/17 (--cluster-pod-cidrs)"
        )),
        "{:#?}",
        cfg.errors
    );
}
