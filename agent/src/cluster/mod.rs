//! Kubernetes and KubeVirt objects as a config source: Pods, VMIs and
//! their migrations, NetworkAttachmentDefinitions, IPAMClaims and Nodes,
//! read from the config dir beside vmpath's own documents, and translated
//! into Attachment and Node documents (docs/kubernetes.md).

pub mod kube_source;
pub mod rbac;
pub mod translate;
pub mod writeback;

// The objects' shapes sit below both the config reader and this module
// (the reader keeps them, translation reads them): `objects` and `prune`
// are their names here too.
pub use crate::config::kube_objects::{self as objects, prune};
