//! `vmpath controller`: the one writer of addresses in a cluster. One
//! active replica (a Lease, [`lease`]) allocates into IPAMClaims'
//! `status.ips` with the node agent's IPAM rules, keeping every address it
//! hands out in a ledger ConfigMap written conditionally on its
//! resourceVersion ([`allocate`]): two controllers racing, a leader
//! killed mid-round or an API server restart never give one address to
//! two claims. Plain pods' interfaces get claims made here ([`pods`]).
//! An address is released when its claim is gone (Kubernetes' garbage
//! collector deletes a claim with its owner, the VirtualMachine or the
//! pod; a pod's claim is also deleted here).

pub mod allocate;
pub mod lease;
pub use crate::config::kube_objects::ledger;
pub mod pod_watch;
pub mod pods;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::Duration,
};

use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{ConfigMap, Event, Pod},
};
use kube::{
    Api, Client,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta,
        PostParams, Preconditions,
    },
};
use tracing::{info, warn};

use crate::{
    config::{
        Network,
        kube_objects::{self as objects, Nad, NadConfig},
        source::{RawDocument, Snapshot},
    },
    publish::writeback::{self, Involved},
};

pub use ledger::LEDGER_KEY;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("Kubernetes client config: {0}")]
    Config(String),
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    #[error("ledger ConfigMap {name}: {message}")]
    Ledger { name: String, message: String },
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

#[derive(Debug, Clone)]
pub struct ControllerOptions {
    pub kubeconfig: Option<PathBuf>,
    /// Where the Lease and the ledger live.
    pub namespace: String,
    /// This replica's name in the Lease's holderIdentity.
    pub identity: String,
    pub lease_name: String,
    pub ledger_name: String,
    pub lease_duration: Duration,
    /// How often the Lease is renewed and, while leading, a round runs.
    pub interval: Duration,
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// Runs until the process is stopped.
pub fn run(opts: &ControllerOptions) -> Result<(), ControllerError> {
    let config = crate::read::kube_source::client_config(opts.kubeconfig.as_deref())
        .map_err(|e| ControllerError::Config(format!("{e:#}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = Client::try_from(config).map_err(ControllerError::Api)?;
        let leases: Api<Lease> = Api::namespaced(client.clone(), &opts.namespace);
        let mut elector =
            lease::Elector::new(leases, &opts.lease_name, &opts.identity, opts.lease_duration);
        let mut leading = false;
        let mut reported = BTreeSet::new();
        let pod_view = pod_watch::PodView::start(client.clone());
        info!(identity = %opts.identity, lease = %opts.lease_name, namespace = %opts.namespace, "controller started");
        loop {
            match elector.tick().await {
                Ok(now) => {
                    if now != leading {
                        info!(identity = %opts.identity, leading = now, "{}", if now { "leading" } else { "not leading" });
                    }
                    leading = now;
                }
                Err(e) => warn!("lease: {e}"),
            }
            if leading && let Err(e) = round(&client, opts, &pod_view, &mut reported).await {
                warn!("allocation round: {e}");
            }
            tokio::time::sleep(opts.interval).await;
        }
    })
}

/// The `Accepted` condition for a Network: `True`, or `False` with every
/// refusal of it (as the agent would refuse it).
fn accepted_condition(name: &str, errors: &[crate::config::ConfigError]) -> (bool, String) {
    let label = format!("Network {name}");
    let refusals: Vec<String> = errors
        .iter()
        .filter(|e| e.document == label)
        .map(|e| {
            if e.field.is_empty() {
                e.message.clone()
            } else {
                format!("field {}: {}", e.field, e.message)
            }
        })
        .collect();
    if refusals.is_empty() {
        (true, "valid".to_string())
    } else {
        (false, refusals.join("; "))
    }
}

/// Writes each Network's `status.conditions` (`Accepted`) where it
/// changed, conditionally on the object's resourceVersion (a 409 is
/// written again next round).
async fn write_conditions(
    api: &Api<DynamicObject>,
    objects: &[DynamicObject],
    errors: &[crate::config::ConfigError],
) {
    for o in objects {
        let Some(name) = o.metadata.name.as_deref() else {
            continue;
        };
        let (ok, message) = accepted_condition(name, errors);
        let status = if ok { "True" } else { "False" };
        let current = o.data["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"));
        if current.is_some_and(|c| c["status"] == status && c["message"] == message.as_str()) {
            continue;
        }
        let mut next = o.clone();
        next.data["status"]["conditions"] = serde_json::json!([{
            "type": "Accepted",
            "status": status,
            "reason": if ok { "Valid" } else { "Refused" },
            "message": message,
            "observedGeneration": o.metadata.generation.unwrap_or(0),
            "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
        }]);
        match api
            .replace_status(name, &PostParams::default(), &next)
            .await
        {
            Ok(_) => info!(network = %name, accepted = ok, "Network status written"),
            Err(e) => warn!(network = %name, "writing the Network's status: {e}"),
        }
    }
}

/// The vmpath Networks, validated as the agent validates them, and the
/// refusals.
fn networks(objects: &[DynamicObject]) -> (Vec<Network>, Vec<crate::config::ConfigError>) {
    let documents = objects
        .iter()
        .enumerate()
        .filter_map(|(i, o)| {
            let mut value = serde_json::to_value(o).ok()?;
            value["apiVersion"] = "vmpath.dev/v1alpha1".into();
            value["kind"] = "Network".into();
            Some(RawDocument {
                file: std::path::Path::new("kubernetes:networks").into(),
                index: i + 1,
                origin: crate::config::DocOrigin::Given,
                value: value.into(),
            })
        })
        .collect();
    let snap = Snapshot {
        documents,
        ..Default::default()
    };
    let cfg = crate::round::validate(&snap, "", &crate::config::AcceptedKeys::new());
    (cfg.networks, cfg.errors)
}

/// The vmpath network an IPAMClaim's `spec.network` names: the network of
/// the vmpath NAD in its namespace whose CNI config has that `name` (as
/// ipam-extensions writes it), else a vmpath Network of that name.
fn claim_network(
    namespace: &str,
    spec_network: &str,
    nads: &[Nad],
    networks: &[Network],
) -> Result<String, String> {
    for nad in nads.iter().filter(|n| n.metadata.namespace() == namespace) {
        let name = serde_json::from_str::<serde_json::Value>(&nad.spec.config)
            .ok()
            .and_then(|c| c["name"].as_str().map(str::to_string));
        if name.as_deref() == Some(spec_network)
            && let Ok(NadConfig::Vmpath { network }) = nad.cni()
        {
            return Ok(network);
        }
    }
    if networks.iter().any(|n| n.name == spec_network) {
        return Ok(spec_network.to_string());
    }
    Err(format!(
        "spec.network {spec_network:?} is no vmpath NetworkAttachmentDefinition's network in namespace {namespace:?} nor a vmpath Network"
    ))
}

/// By claim key (`namespace/name`): the first selection element naming
/// the claim with `ips` (its static request).
fn selection_requests(claims: &[pods::ElementClaim]) -> BTreeMap<String, &pods::ElementClaim> {
    let mut out = BTreeMap::new();
    for c in claims.iter().filter(|c| !c.ips.is_empty()) {
        out.entry(c.key()).or_insert(c);
    }
    out
}

/// A listed IPAMClaim as [`pods::reconcile`] reads it.
fn listed_claim(o: &DynamicObject) -> pods::Listed {
    pods::Listed {
        namespace: o.metadata.namespace.clone().unwrap_or_default(),
        name: o.metadata.name.clone().unwrap_or_default(),
        uid: o.metadata.uid.clone().unwrap_or_default(),
        pod_uid: o
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(objects::POD_UID_LABEL))
            .cloned(),
    }
}

/// Whether the pod a claim was made for (its owner, that uid) is there
/// and not over, read now; an error reading it counts as running.
async fn pod_still_runs(client: &Client, ns: &str, claim: &DynamicObject) -> bool {
    let Some(owner) = claim
        .metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.iter().find(|r| r.kind == "Pod"))
    else {
        return false;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    match api.get_opt(&owner.name).await {
        Ok(Some(pod)) => {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            pod.metadata.uid.as_deref() == Some(owner.uid.as_str())
                && !matches!(phase, Some("Succeeded" | "Failed"))
        }
        Ok(None) => false,
        Err(e) => {
            warn!(pod = %format!("{ns}/{}", owner.name), "reading a pod before deleting its claim: {e}");
            true
        }
    }
}

/// Deletes the claims of pods gone or over (on their uid: never a newer
/// claim of the name) and makes the claims plain pods lack; `listed`
/// follows, so that this round plans what is there now. A claim already
/// gone (the garbage collector was first) or already made (another
/// replica) is no error.
async fn pod_claims(
    client: &Client,
    claims_res: &ApiResource,
    actions: &pods::Actions,
    listed: &mut Vec<DynamicObject>,
) {
    for (ns, name, uid) in &actions.delete {
        // The pod watch may lag: the pod is read again, and its claim
        // stays while it runs.
        if let Some(o) = listed
            .iter()
            .find(|o| o.metadata.uid.as_deref() == Some(uid.as_str()))
            && pod_still_runs(client, ns, o).await
        {
            info!(claim = %format!("{ns}/{name}"), "its pod still runs (the watch lags): kept");
            continue;
        }
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, claims_res);
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(name, &dp).await {
            Ok(_) => {
                info!(claim = %format!("{ns}/{name}"), uid = %uid, "IPAMClaim of a pod gone or over deleted")
            }
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {}
            Err(e) => {
                warn!(claim = %format!("{ns}/{name}"), "deleting the IPAMClaim of a pod gone or over: {e}");
                continue;
            }
        }
        listed.retain(|o| o.metadata.uid.as_deref() != Some(uid.as_str()));
    }
    for c in &actions.create {
        let Some(made) = &c.made else { continue };
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &c.namespace, claims_res);
        let object: DynamicObject = match serde_json::from_value(pods::claim_object(c, made)) {
            Ok(o) => o,
            Err(e) => {
                warn!(claim = %c.key(), "an IPAMClaim that does not read: {e}");
                continue;
            }
        };
        match api.create(&PostParams::default(), &object).await {
            Ok(o) => {
                info!(claim = %c.key(), pod = %c.pod, uid = %made.pod_uid, "IPAMClaim made for a pod's interface");
                listed.push(o);
            }
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => {
                warn!(claim = %c.key(), pod = %c.pod, "making the IPAMClaim of a pod's interface: {e}")
            }
        }
    }
}

/// One allocation round: read, plan, write the ledger (conditionally),
/// then the claims' statuses (each conditionally).
async fn round(
    client: &Client,
    opts: &ControllerOptions,
    pod_view: &pod_watch::PodView,
    reported: &mut BTreeSet<(String, String)>,
) -> Result<(), ControllerError> {
    let claims_res = resource("k8s.cni.cncf.io", "v1alpha1", "IPAMClaim", "ipamclaims");
    let claims_api: Api<DynamicObject> = Api::all_with(client.clone(), &claims_res);
    let nets_api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &resource("vmpath.dev", "v1alpha1", "Network", "networks"),
    );
    let nads_api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &resource(
            "k8s.cni.cncf.io",
            "v1",
            "NetworkAttachmentDefinition",
            "network-attachment-definitions",
        ),
    );
    let ledger_api: Api<ConfigMap> = Api::namespaced(client.clone(), &opts.namespace);

    let lp = ListParams::default();
    let network_objects = nets_api.list(&lp).await?.items;
    let (networks, refused) = networks(&network_objects);
    write_conditions(&nets_api, &network_objects, &refused).await;
    let nads: Vec<Nad> = nads_api
        .list(&lp)
        .await?
        .items
        .iter()
        .filter_map(|o| serde_json::from_value(serde_json::to_value(o).ok()?).ok())
        .collect();
    // Claims before the ledger: an entry for a claim made since is kept
    // (it is released only when the claim is confirmed gone).
    let mut listed = claims_api.list(&lp).await?.items;
    let stored =
        ledger::Stored::from_configmaps(&opts.ledger_name, ledger_api.list(&lp).await?.items)
            .map_err(|message| ControllerError::Ledger {
                name: opts.ledger_name.clone(),
                message,
            })?;
    let ledger = stored.ledger();

    // Every pod, from the watch: plain pods' claims are made and deleted
    // here, and selections' `ips` are static requests. Nothing about pods
    // is decided before the watch has listed them all once.
    let Some((running, pods)) = pod_view.snapshot() else {
        info!("waiting for the pod watch's first list");
        return Ok(());
    };
    let ipam_networks: BTreeSet<String> = networks
        .iter()
        .filter(|n| n.ipam)
        .map(|n| n.name.clone())
        .collect();
    let element_claims = pods::element_claims(&pods, &nads, &ipam_networks);
    let actions = pods::reconcile(
        &element_claims,
        &listed.iter().map(listed_claim).collect::<Vec<_>>(),
        &running,
    );
    pod_claims(client, &claims_res, &actions, &mut listed).await;

    let mut claims = Vec::new();
    let mut versions = BTreeMap::new();
    for o in &listed {
        let namespace = o.metadata.namespace.clone().unwrap_or_default();
        let name = o.metadata.name.clone().unwrap_or_default();
        let spec_network = o.data["spec"]["network"].as_str().unwrap_or("");
        let claim = allocate::Claim {
            network: claim_network(&namespace, spec_network, &nads, &networks),
            uid: o.metadata.uid.as_deref().unwrap_or_default().into(),
            ips: o.data["status"]["ips"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            requested: o
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(allocate::REQUESTED_IPS_ANNOTATION))
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default(),
            requested_from: allocate::REQUESTED_IPS_ANNOTATION.to_string(),
            namespace,
            name,
        };
        versions.insert(allocate::ClaimRef::new(&claim.key()), o.clone());
        claims.push(claim);
    }

    // A status the ledger does not vouch for was written by someone else:
    // the claim is read as holding nothing (and its status written again).
    let untrusted =
        allocate::distrust_unvouched(&networks, &mut claims, &ledger, stored.shards.is_empty());
    // A claim not yet allocated that asks for nothing itself: the `ips` of
    // the Multus selection element naming it are its static request.
    let selected = selection_requests(&element_claims);
    for c in claims
        .iter_mut()
        .filter(|c| c.ips.is_empty() && c.requested.is_empty())
    {
        if let Some(r) = selected.get(&c.key()) {
            c.requested = r.ips.clone();
            c.requested_from = r.from.clone();
        }
    }
    // The pod each claim is for, to say a refusal on it too.
    let pod_of: BTreeMap<String, &str> = element_claims
        .iter()
        .filter(|c| c.made.is_some() || !c.ips.is_empty())
        .map(|c| (c.key(), c.pod.as_str()))
        .collect();

    // Holders not listed: confirmed gone only if the claim (that uid) is.
    let mut gone = Vec::new();
    for h in ledger.values().flat_map(|held| held.values()) {
        // Listed under that name with another uid: that claim is gone
        // (a pod or VM made again under the same name).
        let listed_same = versions
            .get(&h.claim)
            .is_some_and(|o: &DynamicObject| h.uid.is(o.metadata.uid.as_deref().unwrap_or("")));
        if listed_same || gone.contains(&(h.claim.clone(), h.uid.clone())) {
            continue;
        }
        let (ns, name) = (h.claim.namespace.as_str(), h.claim.name.as_str());
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &claims_res);
        let current = api.get_opt(name).await?;
        if current.is_none_or(|c| !h.uid.is(c.metadata.uid.as_deref().unwrap_or(""))) {
            gone.push((h.claim.clone(), h.uid.clone()));
        }
    }

    let plan = allocate::plan(&networks, &claims, &ledger, &gone);
    // Each refusal once as an Event on the claim and on the pod it is for
    // (again if it comes back); a pod's claim name taken, on the pod.
    let current: BTreeSet<(String, String)> = plan
        .refusals
        .iter()
        .chain(&actions.taken)
        .chain(&untrusted)
        .map(|(c, w)| (c.clone(), w.clone()))
        .collect();
    for (claim, why) in current.difference(reported) {
        let (ns, name) = claim.split_once('/').unwrap_or(("", claim));
        let events: Api<Event> = Api::namespaced(client.clone(), ns);
        let message = format!("IPAMClaim {claim}: {why}");
        let on_pod = pod_of.get(claim).map(|pod| Involved {
            api_version: "v1",
            kind: "Pod",
            namespace: ns.to_string(),
            name: pod.to_string(),
        });
        let on_claim = Involved {
            api_version: "k8s.cni.cncf.io/v1alpha1",
            kind: "IPAMClaim",
            namespace: ns.to_string(),
            name: name.to_string(),
        };
        let mut reason = writeback::REASON_REFUSED;
        let involved = if actions.taken.get(claim) == Some(why) {
            warn!(claim = %claim, "IPAMClaim not made: {why}");
            on_pod.into_iter().collect::<Vec<_>>()
        } else if untrusted.get(claim) == Some(why) {
            warn!(claim = %claim, "IPAMClaim's status not trusted: {why}");
            reason = writeback::REASON_UNTRUSTED;
            std::iter::once(on_claim).chain(on_pod).collect()
        } else {
            warn!(claim = %claim, "IPAMClaim refused: {why}");
            std::iter::once(on_claim).chain(on_pod).collect()
        };
        for inv in involved {
            let event =
                writeback::event(&inv, reason, &message, "vmpath-controller", &opts.identity);
            if let Err(e) = events.create(&PostParams::default(), &event).await {
                warn!(claim = %claim, "posting an Event on {} {}: {e}", inv.kind, inv.name);
            }
        }
    }
    *reported = current;
    let writes = stored.writes(&plan.ledger);
    if !writes.is_empty() {
        for (k, read, text) in writes {
            let name = ledger::shard_name(&opts.ledger_name, k);
            let mut cm = read.cloned().unwrap_or_else(|| ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..Default::default()
                },
                ..Default::default()
            });
            cm.data = Some(BTreeMap::from([(LEDGER_KEY.to_string(), text)]));
            let written = if read.is_some() {
                ledger_api.replace(&name, &PostParams::default(), &cm).await
            } else {
                ledger_api.create(&PostParams::default(), &cm).await
            };
            match written {
                Ok(_) => {}
                // Another writer got there first: no status of this plan
                // is written; the next round starts from what it wrote
                // (shards this round did write only hold addresses for
                // claims that get them next round, or release them).
                Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => {
                    info!(shard = %name, "the ledger changed under this round; starting over");
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            }
        }
        for (claim, uid) in &gone {
            info!(claim = %claim, uid = %uid, "IPAMClaim gone: its addresses are released");
        }
    }

    for (key, ips) in &plan.statuses {
        let Some(object) = versions.get(&allocate::ClaimRef::new(key)) else {
            continue;
        };
        let mut next = object.clone();
        next.data["status"]["ips"] = ips.clone().into();
        let (ns, name) = key.split_once('/').unwrap_or(("", key));
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &claims_res);
        match api
            .replace_status(name, &PostParams::default(), &next)
            .await
        {
            Ok(_) => info!(claim = %key, ips = ?ips, "allocated"),
            // The claim changed since it was read: the ledger keeps its
            // addresses for it; the next round writes them.
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_not_found() => {
                info!(claim = %key, "IPAMClaim changed under this round; next round")
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, phase: &str, networks: &str) -> objects::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "prod", "uid": format!("u-{name}"),
                         "annotations": {objects::NETWORKS_ANNOTATION: networks}},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn a_selection_elements_ips_are_its_claims_request() {
        let pods = [
            pod(
                "virt-launcher-vm1-x",
                "Running",
                r#"[{"name":"red"},{"name":"blue","ips":["10.31.0.150/24"],"ipam-claim-reference":"vm1.blue"}]"#,
            ),
            // Over: its request is no one's.
            pod(
                "old",
                "Succeeded",
                r#"[{"name":"blue","ips":["10.31.0.9/24"],"ipam-claim-reference":"vm9.blue"}]"#,
            ),
            // No ips, or no claim (and no NAD: no claim made): nothing
            // asked of the controller.
            pod(
                "plain",
                "Running",
                r#"[{"name":"blue","ipam-claim-reference":"vm2.blue"},{"name":"blue","ips":["10.31.0.7/24"]}]"#,
            ),
            pod("short", "Running", "prod/blue"),
        ];
        let claims = pods::element_claims(&pods, &[], &BTreeSet::new());
        let r = selection_requests(&claims);
        assert_eq!(r.keys().collect::<Vec<_>>(), ["prod/vm1.blue"], "{r:?}");
        assert_eq!(r["prod/vm1.blue"].ips, ["10.31.0.150/24"]);
        assert_eq!(r["prod/vm1.blue"].pod, "virt-launcher-vm1-x");
        assert_eq!(
            r["prod/vm1.blue"].from,
            "Pod prod/virt-launcher-vm1-x's k8s.v1.cni.cncf.io/networks[1].ips"
        );
    }
}
