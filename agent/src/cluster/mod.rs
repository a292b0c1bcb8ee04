//! Kubernetes and KubeVirt objects as a config source: Pods, VMIs and
//! their migrations, NetworkAttachmentDefinitions, IPAMClaims and Nodes,
//! read from the config dir beside vmpath's own documents, and translated
//! into Attachment and Node documents (docs/kubernetes.md).

pub mod kube_source;
pub mod objects;
pub mod prune;
pub mod rbac;
pub mod translate;
pub mod writeback;
