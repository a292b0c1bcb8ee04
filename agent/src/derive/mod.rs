//! The derive stage's substance: Kubernetes and KubeVirt objects (read
//! from the config dir beside vmpath's own documents, or from the API
//! server) translated into Attachment and Node documents
//! (docs/kubernetes.md).
//!
//! | module | what |
//! |---|---|
//! | [`translate`] | a VM interface from its virt-launcher pod and VMI, a plain pod's interface, Nodes, NADs |

pub mod translate;
