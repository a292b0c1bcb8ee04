//! The read stage's sources beside the config dir (whose reader is
//! `crate::config::source`): Kubernetes and KubeVirt objects from the API
//! server (Pods, VMIs and their migrations, NetworkAttachmentDefinitions,
//! IPAMClaims and Nodes; docs/kubernetes.md). The CNI plugin's ports come
//! through the API's endpoint hand-off (`crate::api::endpoints`).
//!
//! | module | what |
//! |---|---|
//! | [`kube_source`] | `--source kubernetes`: one watcher per kind, the copies each round reads |
//! | [`rbac`] | what vmpath asks of the API server (deploy/'s RBAC grants exactly that) |

pub mod kube_source;
pub mod rbac;
