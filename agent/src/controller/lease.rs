//! Leader election over a `coordination.k8s.io/v1` Lease. kube-rs 5 ships
//! no leader election, so this is the small loop client-go's elector runs:
//! read the Lease; take it when it is free, ours, or its holder has not
//! renewed it for `leaseDurationSeconds` (timed by this process's own
//! clock from when it saw the record last change, so clock skew between
//! nodes does not matter); every write carries the resourceVersion read,
//! so of two controllers racing for it the API server lets exactly one
//! win (the other gets 409 Conflict).

use std::time::{Duration, Instant};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api,
    api::{ObjectMeta, PostParams},
};

/// One controller's view of the Lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    /// The record last seen (resourceVersion) and when it was first seen.
    observed: Option<(String, Instant)>,
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_conflict() || s.is_already_exists())
}

impl Elector {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        Elector {
            api,
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
            observed: None,
        }
    }

    fn spec(&self, previous: Option<&LeaseSpec>) -> LeaseSpec {
        let now = MicroTime(Timestamp::now());
        let ours = previous.and_then(|p| p.holder_identity.as_deref()) == Some(&self.identity);
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs().max(1) as i32),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(now.clone())
            },
            renew_time: Some(now),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..Default::default()
        }
    }

    /// Acquires or renews the Lease: `Ok(true)` while this controller
    /// holds it.
    pub async fn tick(&mut self) -> Result<bool, kube::Error> {
        let Some(lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..Default::default()
                },
                spec: Some(self.spec(None)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(l) => {
                    self.observed = l.metadata.resource_version.map(|rv| (rv, Instant::now()));
                    Ok(true)
                }
                Err(e) if conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != rv) {
            self.observed = Some((rv, Instant::now()));
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let their_duration = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.duration);
        let unchanged_for = self.observed.as_ref().map(|(_, at)| at.elapsed());
        let expired = holder.is_empty() || unchanged_for.is_some_and(|d| d >= their_duration);
        if holder != self.identity && !expired {
            return Ok(false);
        }
        let mut next = lease.clone();
        next.spec = Some(self.spec(Some(&spec)));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &next)
            .await
        {
            Ok(l) => {
                if holder != self.identity {
                    tracing::info!(lease = %self.name, previous = %holder, "took the lease");
                }
                self.observed = l.metadata.resource_version.map(|rv| (rv, Instant::now()));
                Ok(true)
            }
            Err(e) if conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
