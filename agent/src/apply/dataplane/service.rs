//! Service maps. Backends are written before the Service port that
//! counts them and removed after it no longer does, so no new flow picks
//! a slot that is not there.

use std::collections::BTreeMap;

use super::Dataplane;
use crate::plan::Plan;
use anyhow::{Context as _, Result};
use aya::maps::{HashMap, MapData};
use vmpath_common::ServiceBackendKey;

impl Dataplane {
    pub(super) fn apply_services(&mut self, plan: &Plan) -> Result<()> {
        let want = &plan.services;
        // Taken: a write that fails leaves `None`, and the next apply reads
        // the maps back.
        let last = self.services_written.take();
        let maps = ServiceMaps {
            services: &mut self.maps.services,
            services6: &mut self.maps.services6,
            backends: &mut self.maps.service_backends,
            backends6: &mut self.maps.service6_backends,
        };
        let written = maps.sync(last, want)?;
        let count = (want.services.len() + want.services6.len()) as u32;
        if self.maps.service_config.get(&0, 0).ok() != Some(count) {
            self.maps
                .service_config
                .set(0, count, 0)
                .context("writing vmp_svc_cfg")?;
        }
        self.services_written = Some(written);
        Ok(())
    }
}

/// What this agent last wrote to the Service maps (only it writes them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct WrittenServices {
    services: BTreeMap<vmpath_common::ServiceKey, vmpath_common::Service>,
    services6: BTreeMap<vmpath_common::ServiceKey6, vmpath_common::Service>,
    backends: BTreeMap<ServiceBackendKey, vmpath_common::ServiceBackend>,
    backends6: BTreeMap<ServiceBackendKey, vmpath_common::ServiceBackend6>,
}

impl WrittenServices {
    fn of(want: &crate::plan::service::Compiled) -> Self {
        WrittenServices {
            services: want.services.clone(),
            services6: want.services6.clone(),
            backends: want.backends.clone(),
            backends6: want.backends6.clone(),
        }
    }

    fn is(&self, want: &crate::plan::service::Compiled) -> bool {
        self.services == want.services
            && self.services6 == want.services6
            && self.backends == want.backends
            && self.backends6 == want.backends6
    }
}

/// The four Service maps, for one sync.
pub(super) struct ServiceMaps<'a> {
    pub services: &'a mut HashMap<MapData, vmpath_common::ServiceKey, vmpath_common::Service>,
    pub services6: &'a mut HashMap<MapData, vmpath_common::ServiceKey6, vmpath_common::Service>,
    pub backends: &'a mut HashMap<MapData, ServiceBackendKey, vmpath_common::ServiceBackend>,
    pub backends6: &'a mut HashMap<MapData, ServiceBackendKey, vmpath_common::ServiceBackend6>,
}

impl ServiceMaps<'_> {
    /// Makes the maps hold `want`: against `last` (what was written, when
    /// every write of the last sync went through) only the difference is
    /// written and nothing is read, else every map is read back. Either
    /// way backends are written before the ports that count them and
    /// removed after. Returns what the maps now hold.
    pub(super) fn sync(
        self,
        last: Option<WrittenServices>,
        want: &crate::plan::service::Compiled,
    ) -> Result<WrittenServices> {
        let Some(last) = last else {
            // A cluster's Services are thousands of entries: read back
            // only here (the first apply, after a failed one, at resync).
            let have4 = written_before(self.backends, &want.backends)
                .context("writing vmp_svc_backends")?;
            let have6 = written_before(self.backends6, &want.backends6)
                .context("writing vmp_svc6_backend")?;
            super::sync(self.services, &want.services).context("writing vmp_svc")?;
            super::sync(self.services6, &want.services6).context("writing vmp_svc6")?;
            pruned_after(self.backends, have4, &want.backends)
                .context("pruning vmp_svc_backends")?;
            pruned_after(self.backends6, have6, &want.backends6)
                .context("pruning vmp_svc6_backend")?;
            return Ok(WrittenServices::of(want));
        };
        if last.is(want) {
            return Ok(last);
        }
        let (gone4, changed4) = super::difference(&last.backends, &want.backends);
        let (gone6, changed6) = super::difference(&last.backends6, &want.backends6);
        super::write_difference(self.backends, &[], &changed4, &want.backends)
            .context("writing vmp_svc_backends")?;
        super::write_difference(self.backends6, &[], &changed6, &want.backends6)
            .context("writing vmp_svc6_backend")?;
        super::sync_since(self.services, Some(&last.services), &want.services)
            .context("writing vmp_svc")?;
        super::sync_since(self.services6, Some(&last.services6), &want.services6)
            .context("writing vmp_svc6")?;
        super::write_difference(self.backends, &gone4, &[], &want.backends)
            .context("pruning vmp_svc_backends")?;
        super::write_difference(self.backends6, &gone6, &[], &want.backends6)
            .context("pruning vmp_svc6_backend")?;
        Ok(WrittenServices::of(want))
    }
}

/// Writes the backends `want` holds that the map does not, before the
/// Service ports that count them; returns what the map held.
fn written_before<V: aya::Pod + PartialEq>(
    map: &mut HashMap<MapData, ServiceBackendKey, V>,
    want: &BTreeMap<ServiceBackendKey, V>,
) -> Result<BTreeMap<ServiceBackendKey, V>> {
    let have: BTreeMap<ServiceBackendKey, V> = map.iter().filter_map(|r| r.ok()).collect();
    for (k, v) in want {
        if have.get(k) != Some(v) {
            map.insert(k, v, 0)?;
        }
    }
    Ok(have)
}

/// Removes the backends no Service port counts any more (after the
/// ports were written).
fn pruned_after<V: aya::Pod>(
    map: &mut HashMap<MapData, ServiceBackendKey, V>,
    have: BTreeMap<ServiceBackendKey, V>,
    want: &BTreeMap<ServiceBackendKey, V>,
) -> Result<()> {
    for k in have.keys().filter(|k| !want.contains_key(k)) {
        map.remove(k)?;
    }
    Ok(())
}

/// Per-CPU Service counters of one port id, summed.
pub fn service_stats(
    map: &aya::maps::PerCpuArray<aya::maps::MapData, vmpath_common::ServiceStats>,
    port_id: u32,
) -> Result<vmpath_common::ServiceStats> {
    Ok(map
        .get(&port_id, 0)?
        .iter()
        .fold(Default::default(), |mut acc, s| {
            acc.flows += s.flows;
            acc.rejected += s.rejected;
            acc
        }))
}

/// The Service maps' sync on real maps (needs root).
#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::service::Compiled;
    use vmpath_common::{Service, ServiceBackend, ServiceBackend6, ServiceKey, ServiceKey6};

    struct Maps {
        services: HashMap<MapData, ServiceKey, Service>,
        services6: HashMap<MapData, ServiceKey6, Service>,
        backends: HashMap<MapData, ServiceBackendKey, ServiceBackend>,
        backends6: HashMap<MapData, ServiceBackendKey, ServiceBackend6>,
    }

    impl Maps {
        fn new() -> Self {
            Maps {
                services: HashMap::create(64, 0).expect("creating a hash map (root?)"),
                services6: HashMap::create(64, 0).expect("creating a hash map (root?)"),
                backends: HashMap::create(64, 0).expect("creating a hash map (root?)"),
                backends6: HashMap::create(64, 0).expect("creating a hash map (root?)"),
            }
        }

        fn sync(&mut self, last: Option<WrittenServices>, want: &Compiled) -> WrittenServices {
            ServiceMaps {
                services: &mut self.services,
                services6: &mut self.services6,
                backends: &mut self.backends,
                backends6: &mut self.backends6,
            }
            .sync(last, want)
            .unwrap()
        }

        /// What the maps hold, as a plan's Services would say it.
        fn held(&self) -> Compiled {
            Compiled {
                services: self.services.iter().map(|r| r.unwrap()).collect(),
                services6: self.services6.iter().map(|r| r.unwrap()).collect(),
                backends: self.backends.iter().map(|r| r.unwrap()).collect(),
                backends6: self.backends6.iter().map(|r| r.unwrap()).collect(),
                ..Default::default()
            }
        }
    }

    /// A Service port with `count` backends at 10.0.0.`first`...
    fn port(want: &mut Compiled, id: u32, count: u32, first: u8) {
        want.services.insert(
            ServiceKey::new(7, [10, 96, 0, id as u8], 80, 6),
            Service {
                id,
                count,
                ..Default::default()
            },
        );
        for slot in 0..count {
            want.backends.insert(
                ServiceBackendKey { service: id, slot },
                ServiceBackend {
                    addr: [10, 0, 0, first + slot as u8],
                    port: 8080,
                    mac: [0x52, 0x54, 0, 0, 0, first + slot as u8],
                },
            );
        }
    }

    fn equal(a: &Compiled, b: &Compiled) -> bool {
        a.services == b.services
            && a.services6 == b.services6
            && a.backends == b.backends
            && a.backends6 == b.backends6
    }

    /// Between resyncs only the difference is written and nothing is
    /// read: an entry edited behind the agent's back stays until a sync
    /// with nothing to trust (the periodic resync) reads the maps and
    /// repairs it; every sync leaves exactly what the plan wants.
    #[test]
    fn only_the_difference_is_written_and_a_resync_repairs_what_others_edited() {
        let mut maps = Maps::new();
        // A stale port and backend from a previous agent.
        maps.services
            .insert(
                ServiceKey::new(7, [10, 96, 0, 9], 53, 17),
                Service::default(),
                0,
            )
            .unwrap();
        maps.backends
            .insert(
                ServiceBackendKey {
                    service: 9,
                    slot: 0,
                },
                ServiceBackend::default(),
                0,
            )
            .unwrap();
        let mut want = Compiled::default();
        port(&mut want, 1, 2, 10);
        port(&mut want, 2, 3, 20);
        want.services6.insert(
            ServiceKey6::new(7, [0xfd; 16], 80, 6),
            Service {
                id: 3,
                count: 1,
                ..Default::default()
            },
        );
        want.backends6.insert(
            ServiceBackendKey {
                service: 3,
                slot: 0,
            },
            ServiceBackend6 {
                addr: [0xfd; 16],
                port: 80,
                mac: [2; 6],
            },
        );
        let written = maps.sync(None, &want);
        assert!(
            equal(&maps.held(), &want),
            "the first sync reads back and prunes"
        );

        // Someone edits a backend; the plan then drops port 1, shrinks
        // port 2 and adds port 4.
        let edited = ServiceBackendKey {
            service: 2,
            slot: 0,
        };
        maps.backends
            .insert(edited, ServiceBackend::default(), 0)
            .unwrap();
        let mut next = Compiled::default();
        port(&mut next, 2, 2, 20);
        port(&mut next, 4, 1, 40);
        next.services6.clone_from(&want.services6);
        next.backends6.clone_from(&want.backends6);
        let written = maps.sync(Some(written), &next);
        let held = maps.held();
        assert_eq!(held.services, next.services);
        assert_eq!(held.backends6, next.backends6);
        assert_eq!(
            held.backends[&edited],
            ServiceBackend::default(),
            "an unchanged entry is not rewritten: nothing was read"
        );
        let mut others = held.backends.clone();
        others.insert(edited, next.backends[&edited]);
        assert_eq!(
            others, next.backends,
            "every change written, every dropped entry gone"
        );

        // Nothing changed: nothing written.
        let written = maps.sync(Some(written), &next);
        assert_eq!(maps.held().backends[&edited], ServiceBackend::default());
        assert!(written.is(&next));

        // The resync trusts nothing it wrote: the edit is repaired.
        maps.sync(None, &next);
        assert!(equal(&maps.held(), &next));
    }
}
