//! What vmpath asks of the API server, by (API group, resource, verbs): the
//! one list the code follows and deploy/'s RBAC must grant exactly (a test
//! compares them).

/// One rule: API group (`""` for core), resource (`x/status` for a
/// subresource), verbs.
pub type Rule = (&'static str, &'static str, &'static [&'static str]);

/// `vmpath agent --source kubernetes`: its watchers (list, watch), the
/// Events it posts, the detected-MAC annotation it patches onto VMIs.
pub const AGENT: &[Rule] = &[
    ("", "nodes", &["list", "watch"]),
    ("", "pods", &["list", "watch"]),
    ("", "events", &["create"]),
    ("vmpath.dev", "networks", &["list", "watch"]),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        &["list", "watch"],
    ),
    ("k8s.cni.cncf.io", "ipamclaims", &["list", "watch"]),
    (
        "kubevirt.io",
        "virtualmachineinstances",
        &["list", "watch", "patch"],
    ),
    (
        "kubevirt.io",
        "virtualmachineinstancemigrations",
        &["list", "watch"],
    ),
    // NetworkPolicy: the policies and the namespace labels they select by.
    ("networking.k8s.io", "networkpolicies", &["list", "watch"]),
    ("", "namespaces", &["list", "watch"]),
    // Services: ClusterIPs and their endpoints.
    ("", "services", &["list", "watch"]),
    ("discovery.k8s.io", "endpointslices", &["list", "watch"]),
];

/// `vmpath agent --source kubernetes`, in the controller's namespace
/// (`--ledger-namespace`): the ledger's ConfigMaps, read only, so that a
/// claim's `status.ips` counts only where the controller wrote it.
pub const AGENT_NAMESPACED: &[Rule] = &[("", "configmaps", &["list", "watch"])];

/// `vmpath controller`, cluster-wide: it reads the Networks, NADs and
/// claims, reads a claim it no longer lists (is it gone?), lists every
/// pod (their selections' `ips`; plain pods' interfaces), makes the
/// claims of plain pods' interfaces and deletes them when their pod is
/// gone, writes claims' and Networks' status, posts Events on refused
/// claims (and on the pod they are for).
pub const CONTROLLER: &[Rule] = &[
    ("", "events", &["create"]),
    ("vmpath.dev", "networks", &["list"]),
    ("vmpath.dev", "networks/status", &["update"]),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        &["list"],
    ),
    (
        "k8s.cni.cncf.io",
        "ipamclaims",
        &["get", "list", "create", "delete"],
    ),
    ("k8s.cni.cncf.io", "ipamclaims/status", &["update"]),
    // Plain pods' interfaces (their claims made, and deleted with the
    // pod), and the Multus selection's `ips` as a claim's static request:
    // watched; a pod is read again before its claim is deleted.
    ("", "pods", &["get", "list", "watch"]),
];

/// `vmpath controller`, in its own namespace: the Lease and the ledger's
/// ConfigMaps (listed each round).
pub const CONTROLLER_NAMESPACED: &[Rule] = &[
    ("", "configmaps", &["list", "create", "update"]),
    (
        "coordination.k8s.io",
        "leases",
        &["get", "create", "update"],
    ),
];

/// Whether `rules` grant `verb` on `group`/`resource`.
pub fn allows(rules: &[Rule], group: &str, resource: &str, verb: &str) -> bool {
    rules
        .iter()
        .any(|(g, r, verbs)| *g == group && *r == resource && verbs.contains(&verb))
}
