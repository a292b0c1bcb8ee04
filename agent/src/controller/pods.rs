//! The claims a round reads from pods' Multus selections, and the
//! IPAMClaims `vmpath controller` makes for plain pods. Pure: the caller
//! reads and writes.
//!
//! KubeVirt's ipam-extensions makes a VM's claims; nobody makes a plain
//! pod's. So that one writer decides every address in a cluster, the
//! controller makes one for each plain pod interface on a vmpath NAD of an
//! IPAM network that references none ([`pod_claim_name`], owned by the pod,
//! labelled with its uid), and deletes it when that pod (that uid) is gone
//! or over: a real cluster's garbage collector may get there first.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::config::kube_objects::{
    NETWORKS_ANNOTATION, Nad, NadConfig, POD_UID_LABEL, Pod, parse_selection, pod_claim_name,
};

/// One claim a pod's selection element names: the one it references
/// (`ipam-claim-reference`), or the one made for a plain pod's interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElementClaim {
    pub namespace: String,
    /// The claim's name.
    pub claim: String,
    /// The element's `ips`: the claim's static request.
    pub ips: Vec<String>,
    /// The pod's name.
    pub pod: String,
    /// Where the request is, for messages.
    pub from: String,
    /// For a claim the controller makes: what it is made of.
    pub made: Option<PodClaim>,
}

impl ElementClaim {
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.claim)
    }
}

/// An IPAMClaim the controller makes for a plain pod's interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    pub pod_uid: String,
    /// `spec.network`: the NAD's CNI config `name` (as ipam-extensions
    /// writes it) when the NAD is in the pod's namespace, else the vmpath
    /// Network's name (a claim's network resolves in its own namespace).
    pub network: String,
    /// `spec.interface`: the pod's interface.
    pub interface: String,
}

/// Every claim the selections of pods not `Succeeded`/`Failed` name.
/// `ipam_networks`: the vmpath Networks with IPAM.
pub fn element_claims(
    pods: &[Pod],
    nads: &[Nad],
    ipam_networks: &BTreeSet<String>,
) -> Vec<ElementClaim> {
    let mut out = Vec::new();
    for pod in pods.iter().filter(|p| !p.finished()) {
        let ns = pod.metadata.namespace();
        let name = &pod.metadata.name;
        let Some(text) = pod.metadata.annotations.get(NETWORKS_ANNOTATION) else {
            continue;
        };
        // A selection that does not read is the agent's to refuse.
        let Ok(selection) = parse_selection(text) else {
            continue;
        };
        for (i, element) in selection.into_iter().enumerate() {
            let from = format!("Pod {ns}/{name}'s {NETWORKS_ANNOTATION}[{i}].ips");
            if let Some(claim) = element.ipam_claim_reference {
                out.push(ElementClaim {
                    namespace: ns.to_string(),
                    claim,
                    ips: element.ips,
                    pod: name.to_string(),
                    from,
                    made: None,
                });
                continue;
            }
            // A VM's interfaces have the claims KubeVirt makes.
            if pod.is_virt_launcher() {
                continue;
            }
            let Some(pod_uid) = pod.metadata.uid.clone() else {
                continue;
            };
            let nad_ns = element.namespace.as_deref().unwrap_or(ns);
            let Some(nad) = nads
                .iter()
                .find(|n| n.metadata.namespace() == nad_ns && n.metadata.name == element.name)
            else {
                continue;
            };
            let Ok(NadConfig::Vmpath { network }) = nad.cni() else {
                continue;
            };
            if !ipam_networks.contains(&network) {
                continue;
            }
            let config_name = serde_json::from_str::<Value>(&nad.spec.config)
                .ok()
                .and_then(|c| c["name"].as_str().map(str::to_string));
            let network = match config_name {
                Some(n) if nad_ns == ns => n,
                _ => network,
            };
            let interface = element.interface_name(i);
            out.push(ElementClaim {
                namespace: ns.to_string(),
                claim: pod_claim_name(name, &interface),
                ips: element.ips,
                pod: name.to_string(),
                from,
                made: Some(PodClaim {
                    pod_uid: pod_uid.to_string(),
                    network,
                    interface,
                }),
            });
        }
    }
    out
}

/// A listed IPAMClaim as [`reconcile`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// [`POD_UID_LABEL`]: made by the controller for the pod of that uid.
    pub pod_uid: Option<String>,
}

/// What a round does about plain pods' claims.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Actions {
    /// Claims whose pod (that uid) is gone or over: (namespace, name,
    /// uid), deleted on that uid only.
    pub delete: Vec<(String, String, String)>,
    /// Claims to make, by key.
    pub create: Vec<ElementClaim>,
    /// Pod claims whose name another claim holds (one the controller did
    /// not make for that pod): by key, why.
    pub taken: BTreeMap<String, String>,
}

/// Decides deletions and creations. `running`: the uids of pods listed
/// and not `Succeeded`/`Failed` (listed after the claims, so a claim made
/// for a pod created since is never seen without its pod).
pub fn reconcile(
    wanted: &[ElementClaim],
    listed: &[Listed],
    running: &BTreeSet<String>,
) -> Actions {
    let mut out = Actions::default();
    let mut kept: BTreeMap<String, &Listed> = BTreeMap::new();
    for c in listed {
        let key = format!("{}/{}", c.namespace, c.name);
        match &c.pod_uid {
            Some(uid) if !running.contains(uid) => {
                out.delete
                    .push((c.namespace.clone(), c.name.clone(), c.uid.clone()));
            }
            _ => {
                kept.insert(key, c);
            }
        }
    }
    for w in wanted {
        let Some(made) = &w.made else { continue };
        let key = w.key();
        match kept.get(&key) {
            None => {
                if !out.create.iter().any(|c| c.key() == key) {
                    out.create.push(w.clone());
                }
            }
            Some(c) if c.pod_uid.as_ref() == Some(&made.pod_uid) => {}
            Some(_) => {
                out.taken.insert(
                    key.clone(),
                    format!(
                        "IPAMClaim {key} for interface {:?} exists and was not made by vmpath controller for this pod (uid {}): the interface waits until it is gone",
                        made.interface, made.pod_uid
                    ),
                );
            }
        }
    }
    out
}

/// The IPAMClaim made for a plain pod's interface: the shape
/// ipam-extensions writes for a VM, owned by the pod (its garbage
/// collector deletes it with the pod) and labelled with its uid.
pub fn claim_object(c: &ElementClaim, made: &PodClaim) -> Value {
    json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1",
        "kind": "IPAMClaim",
        "metadata": {
            "name": c.claim,
            "namespace": c.namespace,
            "labels": {
                POD_UID_LABEL: made.pod_uid,
                "app.kubernetes.io/managed-by": "vmpath-controller",
            },
            "ownerReferences": [{
                "apiVersion": "v1",
                "kind": "Pod",
                "name": c.pod,
                "uid": made.pod_uid,
                "controller": true,
                "blockOwnerDeletion": false,
            }],
        },
        "spec": {"network": made.network, "interface": made.interface},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str, phase: &str, networks: &str, labels: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "prod", "uid": uid, "labels": labels,
                         "annotations": {NETWORKS_ANNOTATION: networks}},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn nad(ns: &str, name: &str, config: &str) -> Nad {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"config": config},
        }))
        .unwrap()
    }

    fn nads() -> Vec<Nad> {
        vec![
            nad(
                "prod",
                "blue",
                r#"{"name":"blue-net","type":"vmpath-cni","network":"blue"}"#,
            ),
            nad(
                "infra",
                "blue",
                r#"{"name":"shared","type":"vmpath-cni","network":"blue"}"#,
            ),
            nad(
                "prod",
                "flat",
                r#"{"name":"flat","type":"vmpath-cni","network":"flat"}"#,
            ),
            nad("prod", "br", r#"{"name":"br","type":"bridge"}"#),
        ]
    }

    fn ipam() -> BTreeSet<String> {
        BTreeSet::from(["blue".to_string()])
    }

    #[test]
    fn a_plain_pods_interfaces_on_ipam_networks_get_claims_a_vms_do_not() {
        let pods = [
            pod(
                "web-0",
                "u1",
                "Running",
                r#"[{"name":"blue","ips":["10.31.0.7/24"]},{"name":"flat"},{"name":"br"},{"name":"blue","namespace":"infra","interface":"eth9"},{"name":"blue","ipam-claim-reference":"mine"}]"#,
                json!({}),
            ),
            // A VM's pod: only what it references.
            pod(
                "virt-launcher-vm1-x",
                "u2",
                "Running",
                r#"[{"name":"blue"},{"name":"blue","ips":["10.31.0.150/24"],"ipam-claim-reference":"vm1.blue"}]"#,
                json!({"kubevirt.io": "virt-launcher"}),
            ),
            // Over: nothing.
            pod("old", "u3", "Succeeded", "prod/blue", json!({})),
            pod("pending", "u4", "Pending", "prod/blue", json!({})),
        ];
        let claims = element_claims(&pods, &nads(), &ipam());
        let keys: Vec<String> = claims.iter().map(ElementClaim::key).collect();
        assert_eq!(
            keys,
            [
                "prod/web-0.net1",
                "prod/web-0.eth9",
                "prod/mine",
                "prod/vm1.blue",
                "prod/pending.net1"
            ],
            "{claims:?}"
        );
        let web = &claims[0];
        assert_eq!(web.ips, ["10.31.0.7/24"]);
        assert_eq!(
            web.from,
            "Pod prod/web-0's k8s.v1.cni.cncf.io/networks[0].ips"
        );
        assert_eq!(
            web.made,
            Some(PodClaim {
                pod_uid: "u1".into(),
                network: "blue-net".into(),
                interface: "net1".into()
            })
        );
        // A NAD of another namespace: the Network's own name.
        assert_eq!(claims[1].made.as_ref().unwrap().network, "blue");
        assert!(claims[2].made.is_none() && claims[3].made.is_none());
        assert_eq!(claims[3].ips, ["10.31.0.150/24"]);

        let object = claim_object(web, web.made.as_ref().unwrap());
        assert_eq!(object["metadata"]["ownerReferences"][0]["uid"], "u1");
        assert_eq!(object["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(object["metadata"]["labels"][POD_UID_LABEL], "u1");
        assert_eq!(
            object["spec"],
            json!({"network": "blue-net", "interface": "net1"})
        );
    }

    fn listed(name: &str, uid: &str, pod_uid: Option<&str>) -> Listed {
        Listed {
            namespace: "prod".into(),
            name: name.into(),
            uid: uid.into(),
            pod_uid: pod_uid.map(str::to_string),
        }
    }

    fn wanted(pod: &str, uid: &str) -> ElementClaim {
        ElementClaim {
            namespace: "prod".into(),
            claim: format!("{pod}.net1"),
            ips: vec![],
            pod: pod.into(),
            from: String::new(),
            made: Some(PodClaim {
                pod_uid: uid.into(),
                network: "blue".into(),
                interface: "net1".into(),
            }),
        }
    }

    #[test]
    fn a_claim_is_made_once_kept_while_its_pod_runs_and_deleted_with_that_uid() {
        let running = BTreeSet::from(["u1".to_string(), "u9".to_string()]);
        let a = reconcile(
            &[wanted("web-0", "u1"), wanted("web-1", "u9")],
            &[
                // Made for web-1's previous pod (same name, uid u8): it
                // goes, and web-1's is made in its place.
                listed("web-1.net1", "c8", Some("u8")),
                // A VM's claim is no pod's: never deleted here.
                listed("vm1.blue", "c2", None),
                // Made for web-0, running: kept, nothing made.
                listed("web-0.net1", "c1", Some("u1")),
                // Its pod gone.
                listed("gone.net1", "c3", Some("u3")),
            ],
            &running,
        );
        assert_eq!(
            a.delete,
            [
                ("prod".into(), "web-1.net1".into(), "c8".into()),
                ("prod".into(), "gone.net1".into(), "c3".into())
            ]
        );
        assert_eq!(a.create, [wanted("web-1", "u9")]);
        assert!(a.taken.is_empty());

        // The pod over (not in `running`): deleted, nothing made.
        let a = reconcile(
            &[],
            &[listed("web-0.net1", "c1", Some("u1"))],
            &BTreeSet::new(),
        );
        assert_eq!(a.delete.len(), 1);
        assert!(a.create.is_empty());

        // A claim of that name the controller did not make for the pod:
        // not touched, said.
        let mut vm = wanted("vm1", "u5");
        vm.claim = "vm1.blue".into();
        let a = reconcile(
            &[vm],
            &[listed("vm1.blue", "c2", None)],
            &BTreeSet::from(["u5".to_string()]),
        );
        assert!(a.delete.is_empty() && a.create.is_empty());
        assert!(
            a.taken["prod/vm1.blue"].contains("was not made by vmpath controller for this pod"),
            "{a:?}"
        );
    }
}
