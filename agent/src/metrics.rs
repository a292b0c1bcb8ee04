//! Prometheus metrics on `--metrics-addr` (HTTP, `GET /metrics`, text
//! format). [`AgentCollector`] is registered once; at each scrape it turns
//! one [`Snapshot`] (the agent's view, the pinned maps' counters, the slow
//! path's) into metric families, so the numbers are the kernel's own and
//! survive agent restarts (per-CPU counters are summed). The reconcile
//! histogram is the one the loop observes into.

use std::{collections::BTreeSet, sync::Arc, thread::JoinHandle};

use anyhow::{Result, anyhow};
use prometheus::{
    Encoder as _, Registry, TextEncoder,
    core::{Collector, Desc},
    proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType},
};
use tracing::{info, warn};
use vmpath_common::{PortStats, drop_reason};

use crate::{
    api::snapshot::{Observer, Snapshot},
    publish::view::state,
    slowpath::Counters,
};

/// Reads one counter of a port.
type PortCounter = fn(&PortStats) -> u64;

const PORT_LABELS: [&str; 5] = ["network", "namespace", "vm", "interface", "port"];

/// One family's name, help, type and label names.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    labels: &'static [&'static str],
}

const fn family(
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    labels: &'static [&'static str],
) -> Family {
    Family {
        name,
        help,
        kind,
        labels,
    }
}

const GAUGE: MetricType = MetricType::GAUGE;
const COUNTER: MetricType = MetricType::COUNTER;

const LEARNED_REFUSED: Family = family(
    "vmpath_learned_refused",
    "Addresses VMs on this node used that were not learned (IPAM-less networks), by reason (vm show lists them).",
    GAUGE,
    &["reason"],
);

const READY: Family = family(
    "vmpath_ready",
    "1 once the data path has been programmed from the config.",
    GAUGE,
    &[],
);
const DATAPLANE_UP: Family = family(
    "vmpath_dataplane_up",
    "1 when the pinned maps could be read for this scrape.",
    GAUGE,
    &[],
);
const NETWORKS: Family = family(
    "vmpath_networks",
    "Valid networks in the config.",
    GAUGE,
    &[],
);
const ATTACHMENTS: Family = family(
    "vmpath_attachments",
    "Valid attachments by state as seen from this node: local (port programmed here), remote (on another node), missing_port (belongs here, port absent), migrating (migration pending).",
    GAUGE,
    &["state"],
);
const CONFIG_ERRORS: Family = family(
    "vmpath_config_errors",
    "Config documents currently refused (see vmpath_config_error_info).",
    GAUGE,
    &[],
);
const CONFIG_ERROR_INFO: Family = family(
    "vmpath_config_error_info",
    "One series per refused config document: its file, document and field.",
    GAUGE,
    &["file", "document", "field"],
);
const RECONCILES: Family = family(
    "vmpath_reconciles_total",
    "Reconcile rounds that changed the data path since the agent started.",
    COUNTER,
    &[],
);
const ROUNDS_UNCHANGED: Family = family(
    "vmpath_rounds_unchanged_total",
    "Rounds woken by watched cluster objects alone that stopped after validation: none of the objects is read by a VM interface or the context (a claim made before its VM, say), so nothing after validation could change.",
    COUNTER,
    &[],
);
const FREED_ON_LOOP: Family = family(
    "vmpath_freed_on_loop_total",
    "What a round replaced that it freed itself because the freeing thread (idle class) was its backlog behind: steady growth means the node's CPUs leave the agent's housekeeping no time.",
    COUNTER,
    &[],
);
const DHCP: Family = family(
    "vmpath_dhcp_messages_total",
    "Slow-path messages (DHCPv4, DHCPv6, router solicitations) by network, kind and outcome (received, replied, dropped).",
    COUNTER,
    &["network", "kind", "outcome"],
);
const PORT_DHCP: Family = family(
    "vmpath_port_dhcp_messages_total",
    "Slow-path messages per VM interface (namespace/vm/interface), by kind and outcome.",
    COUNTER,
    &["vm_interface", "kind", "outcome"],
);
const DROPS: Family = family(
    "vmpath_drops_total",
    "Frames the data path dropped, by reason (all ports).",
    COUNTER,
    &["reason"],
);
const PORT_RX_PACKETS: Family = family(
    "vmpath_port_rx_packets_total",
    "Frames the VM sent into the data path.",
    COUNTER,
    &PORT_LABELS,
);
const PORT_RX_BYTES: Family = family(
    "vmpath_port_rx_bytes_total",
    "Bytes the VM sent into the data path.",
    COUNTER,
    &PORT_LABELS,
);
const PORT_TX_PACKETS: Family = family(
    "vmpath_port_tx_packets_total",
    "Frames the data path delivered to the VM.",
    COUNTER,
    &PORT_LABELS,
);
const PORT_TX_BYTES: Family = family(
    "vmpath_port_tx_bytes_total",
    "Bytes the data path delivered to the VM.",
    COUNTER,
    &PORT_LABELS,
);
const PORT_DROPS: Family = family(
    "vmpath_port_drops_total",
    "Frames from the VM the data path dropped.",
    COUNTER,
    &PORT_LABELS,
);
const PORT_GATEWAY_REPLIES: Family = family(
    "vmpath_port_gateway_replies_total",
    "ARP, ND and echo requests the gateway answered in place.",
    COUNTER,
    &PORT_LABELS,
);
const CONFIG_FILES_PARSED: Family = family(
    "vmpath_config_files_parsed_total",
    "Config files parsed since the agent started; an unchanged file is not parsed again.",
    COUNTER,
    &[],
);
const PORT_SLOWPATH_RATE_LIMITED: Family = family(
    "vmpath_port_slowpath_rate_limited_total",
    "DHCPv4, DHCPv6 and router solicitation frames from the VM dropped over its slow-path rate, by class.",
    COUNTER,
    &["network", "namespace", "vm", "interface", "port", "class"],
);
const OVERLAY_PACKETS: Family = family(
    "vmpath_overlay_packets_total",
    "Frames sent to (tx) and received from (rx) other nodes over VXLAN.",
    COUNTER,
    &["direction"],
);
const OVERLAY_BYTES: Family = family(
    "vmpath_overlay_bytes_total",
    "Bytes sent to (tx) and received from (rx) other nodes over VXLAN.",
    COUNTER,
    &["direction"],
);
const OVERLAY_DROPS: Family = family(
    "vmpath_overlay_drops_total",
    "Overlay frames dropped (see vmpath_drops_total for reasons).",
    COUNTER,
    &[],
);
const OVERLAY_LEARNED_MACS: Family = family(
    "vmpath_overlay_learned_macs",
    "Remote VM MACs learned from the overlay (vmp_remote_learned): unicast to them goes to their node only.",
    GAUGE,
    &[],
);
const UPLINK_XDP: Family = family(
    "vmpath_uplink_xdp_frames_total",
    "IP frames the uplink's XDP program (--uplink-xdp auto) delivered itself (routed4, routed6, snat4) or passed to the tc program (passed).",
    COUNTER,
    &["path"],
);

const PORT_POLICY: Family = family(
    "vmpath_port_policy_total",
    "NetworkPolicy verdicts of an endpoint: new flows allowed, packets denied, by direction.",
    COUNTER,
    &[
        "network",
        "namespace",
        "vm",
        "interface",
        "port",
        "direction",
        "verdict",
    ],
);
const POLICY_ALLOWED: Family = family(
    "vmpath_policy_allowed_flows_total",
    "New flows each NetworkPolicy (namespace/name) allowed on this node.",
    COUNTER,
    &["policy"],
);

const PORT_SERVICE: Family = family(
    "vmpath_port_service_flows_total",
    "New flows an endpoint opened to ClusterIP Services: sent to a backend, or rejected (no ready backend).",
    COUNTER,
    &["network", "namespace", "vm", "interface", "port", "verdict"],
);

/// Every family the collector produces, the reconcile histogram aside.
const FAMILIES: [&Family; 29] = [
    &READY,
    &ROUNDS_UNCHANGED,
    &FREED_ON_LOOP,
    &LEARNED_REFUSED,
    &DATAPLANE_UP,
    &NETWORKS,
    &ATTACHMENTS,
    &CONFIG_ERRORS,
    &CONFIG_ERROR_INFO,
    &RECONCILES,
    &CONFIG_FILES_PARSED,
    &DHCP,
    &PORT_DHCP,
    &DROPS,
    &PORT_RX_PACKETS,
    &PORT_RX_BYTES,
    &PORT_TX_PACKETS,
    &PORT_TX_BYTES,
    &PORT_DROPS,
    &PORT_GATEWAY_REPLIES,
    &PORT_SLOWPATH_RATE_LIMITED,
    &OVERLAY_PACKETS,
    &OVERLAY_BYTES,
    &OVERLAY_DROPS,
    &OVERLAY_LEARNED_MACS,
    &UPLINK_XDP,
    &PORT_POLICY,
    &POLICY_ALLOWED,
    &PORT_SERVICE,
];

/// The samples of one family, built during a scrape.
struct Samples<'f> {
    family: &'f Family,
    metrics: Vec<Metric>,
}

impl<'f> Samples<'f> {
    fn of(family: &'f Family) -> Self {
        Samples {
            family,
            metrics: Vec::new(),
        }
    }

    /// One series; `values` match the family's label names in order.
    fn add(&mut self, values: &[&str], value: f64) {
        debug_assert_eq!(values.len(), self.family.labels.len());
        // The text format shows labels as the crate's own vectors do:
        // sorted by name.
        let mut pairs: Vec<LabelPair> = self
            .family
            .labels
            .iter()
            .zip(values)
            .map(|(name, value)| {
                let mut pair = LabelPair::default();
                pair.set_name(name.to_string());
                pair.set_value(value.to_string());
                pair
            })
            .collect();
        pairs.sort_by(|a, b| a.name().cmp(b.name()));
        let mut m = Metric::default();
        m.set_label(pairs);
        if self.family.kind == MetricType::COUNTER {
            let mut c = Counter::default();
            c.set_value(value);
            m.set_counter(c);
        } else {
            let mut g = Gauge::default();
            g.set_value(value);
            m.set_gauge(g);
        }
        self.metrics.push(m);
    }

    fn one(family: &'f Family, value: f64) -> Self {
        let mut s = Samples::of(family);
        s.add(&[], value);
        s
    }

    fn done(self) -> MetricFamily {
        let mut mf = MetricFamily::default();
        mf.set_name(self.family.name.to_string());
        mf.set_help(self.family.help.to_string());
        mf.set_field_type(self.family.kind);
        mf.set_metric(self.metrics);
        mf
    }
}

/// The agent's metrics, produced from one snapshot per scrape.
pub struct AgentCollector {
    observer: Arc<Observer>,
    descs: Vec<Desc>,
}

impl AgentCollector {
    pub fn new(observer: Arc<Observer>) -> Result<Self> {
        let mut descs = Vec::with_capacity(FAMILIES.len());
        for f in FAMILIES {
            let labels = f.labels.iter().map(|l| l.to_string()).collect();
            descs.push(Desc::new(
                f.name.to_string(),
                f.help.to_string(),
                labels,
                Default::default(),
            )?);
        }
        descs.extend(
            observer
                .published()
                .reconcile_seconds()
                .desc()
                .into_iter()
                .cloned(),
        );
        Ok(AgentCollector { observer, descs })
    }
}

impl Collector for AgentCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut families = families(&self.observer.snapshot());
        families.extend(self.observer.published().reconcile_seconds().collect());
        families
    }
}

/// The families of one snapshot (the reconcile histogram aside). A family
/// without samples is left out.
pub fn families(snap: &Snapshot) -> Vec<MetricFamily> {
    let view = &snap.view;
    let mut out = vec![
        Samples::one(&READY, f64::from(u8::from(view.ready))),
        Samples::one(&DATAPLANE_UP, f64::from(u8::from(snap.dataplane.is_ok()))),
        Samples::one(&NETWORKS, view.networks.len() as f64),
    ];

    let mut attachments = Samples::of(&ATTACHMENTS);
    for s in state::ALL {
        let n = view
            .attachments
            .iter()
            .filter(|a| view.state_of(a) == s)
            .count();
        attachments.add(&[s], n as f64);
    }
    out.push(attachments);

    out.push(Samples::one(
        &CONFIG_ERRORS,
        view.config_errors.len() as f64,
    ));
    let mut info = Samples::of(&CONFIG_ERROR_INFO);
    // One series per file, document and field, however many refusals.
    let refused: BTreeSet<(String, &str, &str)> = view
        .config_errors
        .iter()
        .map(|e| {
            (
                e.file.display().to_string(),
                e.document.as_str(),
                e.field.as_str(),
            )
        })
        .collect();
    for (file, document, field) in &refused {
        info.add(&[file, document, field], 1.0);
    }
    out.push(info);
    // Addresses guests used that vmpath refused to learn, by why.
    let mut learned_refused = Samples::of(&LEARNED_REFUSED);
    for kind in crate::observe::learned::REFUSAL_KINDS {
        // Only rows built here have learned addresses.
        let n = view
            .attachments
            .rows()
            .filter_map(|r| r.built())
            .flat_map(|a| &a.learned_refused)
            .filter(|r| r.kind == kind)
            .count();
        learned_refused.add(&[kind], n as f64);
    }
    out.push(learned_refused);
    out.push(Samples::one(&RECONCILES, view.reconciles as f64));
    out.push(Samples::one(
        &ROUNDS_UNCHANGED,
        crate::publish::view::rounds_unchanged() as f64,
    ));
    out.push(Samples::one(
        &FREED_ON_LOOP,
        crate::sys::drop_later::dropped_here() as f64,
    ));
    out.push(Samples::one(
        &CONFIG_FILES_PARSED,
        crate::config::source::files_parsed() as f64,
    ));

    let outcomes = |c: &Counters| {
        [
            ("received", c.received.clone()),
            ("replied", c.replied.clone()),
            ("dropped", c.dropped.clone()),
        ]
    };
    let mut dhcp = Samples::of(&DHCP);
    for (net, c) in &snap.slow.networks {
        for (outcome, by_kind) in outcomes(c) {
            for (kind, n) in by_kind {
                dhcp.add(&[net.as_str(), kind.as_str(), outcome], n as f64);
            }
        }
    }
    out.push(dhcp);
    let mut dhcp_ports = Samples::of(&PORT_DHCP);
    for (port, c) in &snap.slow.ports {
        for (outcome, by_kind) in outcomes(c) {
            for (kind, n) in by_kind {
                dhcp_ports.add(&[port.as_str(), kind.as_str(), outcome], n as f64);
            }
        }
    }
    out.push(dhcp_ports);

    if let Ok(dp) = &snap.dataplane {
        let mut drops = Samples::of(&DROPS);
        if let Ok(counts) = &dp.drops {
            for (name, n) in drop_reason::NAMES.iter().zip(counts) {
                drops.add(&[name], *n as f64);
            }
        }
        out.push(drops);

        let per_port: [(&Family, PortCounter); 6] = [
            (&PORT_RX_PACKETS, |s| s.rx_packets),
            (&PORT_RX_BYTES, |s| s.rx_bytes),
            (&PORT_TX_PACKETS, |s| s.tx_packets),
            (&PORT_TX_BYTES, |s| s.tx_bytes),
            (&PORT_DROPS, |s| s.drops),
            (&PORT_GATEWAY_REPLIES, |s| s.gw_replies),
        ];
        for (family, value) in per_port {
            let mut samples = Samples::of(family);
            for (a, ifindex) in view.local_ports() {
                let Some(stats) = dp.ports.get(&ifindex) else {
                    continue;
                };
                let labels = [
                    a.network.as_str(),
                    a.namespace.as_str(),
                    a.vm.as_str(),
                    a.interface.as_str(),
                    a.port.as_str(),
                ];
                samples.add(&labels, value(stats) as f64);
            }
            out.push(samples);
        }

        let mut rate_limited = Samples::of(&PORT_SLOWPATH_RATE_LIMITED);
        for (a, ifindex) in view.local_ports() {
            let Some(by_class) = dp.rate_limited.get(&ifindex) else {
                continue;
            };
            for (class, n) in vmpath_common::slow_class::NAMES.iter().zip(by_class) {
                rate_limited.add(
                    &[
                        a.network.as_str(),
                        a.namespace.as_str(),
                        a.vm.as_str(),
                        a.interface.as_str(),
                        a.port.as_str(),
                        class,
                    ],
                    *n as f64,
                );
            }
        }
        out.push(rate_limited);

        let mut policy = Samples::of(&PORT_POLICY);
        for (a, ifindex) in view.local_ports() {
            let Some(p) = dp.policy.get(&ifindex) else {
                continue;
            };
            for (direction, verdict, n) in [
                ("ingress", "allowed", p.allowed_ingress),
                ("egress", "allowed", p.allowed_egress),
                ("ingress", "denied", p.denied_ingress),
                ("egress", "denied", p.denied_egress),
            ] {
                policy.add(
                    &[
                        a.network.as_str(),
                        a.namespace.as_str(),
                        a.vm.as_str(),
                        a.interface.as_str(),
                        a.port.as_str(),
                        direction,
                        verdict,
                    ],
                    n as f64,
                );
            }
        }
        out.push(policy);
        let mut service = Samples::of(&PORT_SERVICE);
        for (a, ifindex) in view.local_ports() {
            let Some(s) = dp.service.get(&ifindex) else {
                continue;
            };
            for (verdict, n) in [("sent", s.flows), ("rejected", s.rejected)] {
                service.add(
                    &[
                        a.network.as_str(),
                        a.namespace.as_str(),
                        a.vm.as_str(),
                        a.interface.as_str(),
                        a.port.as_str(),
                        verdict,
                    ],
                    n as f64,
                );
            }
        }
        out.push(service);
        let mut allowed = Samples::of(&POLICY_ALLOWED);
        for (name, n) in view.policies.iter().zip(&dp.policy_hits) {
            allowed.add(&[name], *n as f64);
        }
        out.push(allowed);

        // The overlay: frames to and from other nodes, and its drops.
        if let Some((o, learned)) = &dp.overlay {
            let mut packets = Samples::of(&OVERLAY_PACKETS);
            packets.add(&["tx"], o.tx_packets as f64);
            packets.add(&["rx"], o.rx_packets as f64);
            out.push(packets);
            let mut bytes = Samples::of(&OVERLAY_BYTES);
            bytes.add(&["tx"], o.tx_bytes as f64);
            bytes.add(&["rx"], o.rx_bytes as f64);
            out.push(bytes);
            out.push(Samples::one(&OVERLAY_DROPS, o.drops as f64));
            out.push(Samples::one(&OVERLAY_LEARNED_MACS, *learned as f64));
        }
        let mut xdp = Samples::of(&UPLINK_XDP);
        for (path, n) in vmpath_common::xdp_stat::NAMES.iter().zip(&dp.uplink_xdp) {
            xdp.add(&[path], *n as f64);
        }
        out.push(xdp);
    }
    out.into_iter()
        .filter(|s| !s.metrics.is_empty())
        .map(Samples::done)
        .collect()
}

/// The registry `/metrics` serves: the agent's collector, registered once.
pub fn registry(observer: Arc<Observer>) -> Result<Registry> {
    let registry = Registry::new();
    registry.register(Box::new(AgentCollector::new(observer)?))?;
    Ok(registry)
}

/// Renders a registry in the text exposition format.
pub fn render(registry: &Registry) -> Result<String> {
    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf)?;
    String::from_utf8(buf).map_err(|e| anyhow!("metrics are not UTF-8: {e}"))
}

/// Serves `/metrics` on `addr` (e.g. `0.0.0.0:9469`) in its own thread.
pub fn serve(addr: &str, observer: Arc<Observer>) -> Result<JoinHandle<()>> {
    let registry = registry(observer)?;
    let server = tiny_http::Server::http(addr)
        .map_err(|e| anyhow!("binding the metrics address {addr}: {e}"))?;
    info!(addr, "metrics listening");
    let handle = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let path = request.url().split('?').next().unwrap_or("").to_string();
                let (code, body, content_type) = match (request.method(), path.as_str()) {
                    (tiny_http::Method::Get, "/metrics") => match render(&registry) {
                        Ok(body) => (200, body, "text/plain; version=0.0.4; charset=utf-8"),
                        Err(e) => (500, format!("{e:#}\n"), "text/plain"),
                    },
                    (tiny_http::Method::Get, "/") => (
                        200,
                        "vmpath agent: metrics at /metrics\n".to_string(),
                        "text/plain",
                    ),
                    _ => (404, "not found: try /metrics\n".to_string(), "text/plain"),
                };
                let header =
                    tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
                        .expect("a valid header");
                let response = tiny_http::Response::from_string(body)
                    .with_status_code(code)
                    .with_header(header);
                if let Err(e) = request.respond(response) {
                    warn!("answering a metrics request: {e}");
                }
            }
        })?;
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{api::snapshot::DataplaneCounters, publish::view::sample, slowpath::SlowStats};

    fn text(snap: &Snapshot) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&families(snap), &mut buf)
            .unwrap();
        String::from_utf8(buf).unwrap()
    }

    fn port(rx_packets: u64) -> PortStats {
        PortStats {
            rx_packets,
            rx_bytes: rx_packets * 100,
            ..Default::default()
        }
    }

    #[test]
    fn the_view_and_counters_become_labelled_series() {
        let mut drops = vec![0; drop_reason::COUNT as usize];
        drops[1] = 7;
        let snap = Snapshot {
            view: sample::view().into(),
            dataplane: Ok(DataplaneCounters {
                drops: Ok(drops),
                // vm4 (ifindex 14) is a pending migration target: not counted.
                ports: BTreeMap::from([(11, port(5)), (14, port(9))]),
                rate_limited: BTreeMap::from([(11, [2, 0, 0]), (14, [4, 0, 0])]),
                overlay: None,
                policy: BTreeMap::new(),
                policy_hits: Vec::new(),
                service: BTreeMap::new(),
                uplink_xdp: vec![5, 0, 2, 9],
            }),
            slow: SlowStats::default(),
        };
        let t = text(&snap);
        for line in [
            "vmpath_ready 1",
            "vmpath_dataplane_up 1",
            "vmpath_networks 1",
            "vmpath_attachments{state=\"local\"} 1",
            "vmpath_attachments{state=\"migrating\"} 1",
            "vmpath_config_errors 1",
            "vmpath_config_error_info{document=\"Attachment prod/vm9\",field=\"spec.mac\",file=\"/etc/vmpath/bad.yaml\"} 1",
            "vmpath_reconciles_total 3",
            "# TYPE vmpath_port_rx_packets_total counter",
            "vmpath_port_rx_packets_total{interface=\"eth0\",namespace=\"prod\",network=\"blue\",port=\"p-vm1\",vm=\"vm1\"} 5",
            "vmpath_port_rx_bytes_total{interface=\"eth0\",namespace=\"prod\",network=\"blue\",port=\"p-vm1\",vm=\"vm1\"} 500",
            "vmpath_port_slowpath_rate_limited_total{class=\"dhcp4\",interface=\"eth0\",namespace=\"prod\",network=\"blue\",port=\"p-vm1\",vm=\"vm1\"} 2",
            "vmpath_uplink_xdp_frames_total{path=\"routed4\"} 5",
            "vmpath_uplink_xdp_frames_total{path=\"snat4\"} 2",
            "vmpath_uplink_xdp_frames_total{path=\"passed\"} 9",
        ] {
            assert!(t.lines().any(|l| l == line), "no line {line:?} in\n{t}");
        }
        let reason = drop_reason::NAMES[1];
        assert!(t.contains(&format!("vmpath_drops_total{{reason=\"{reason}\"}} 7")));
        assert!(!t.contains("vm4"), "{t}");
        assert!(!t.contains("vmpath_overlay"), "{t}");
    }

    #[test]
    fn policy_and_service_counters_per_endpoint_and_per_policy() {
        let mut view = sample::view();
        view.policies = vec!["prod/web".into(), "prod/db".into()];
        let snap = Snapshot {
            view: view.into(),
            dataplane: Ok(DataplaneCounters {
                drops: Ok(vec![0; drop_reason::COUNT as usize]),
                ports: BTreeMap::new(),
                rate_limited: BTreeMap::new(),
                overlay: None,
                policy: BTreeMap::from([(
                    11,
                    vmpath_common::PolicyStats {
                        allowed_ingress: 4,
                        allowed_egress: 1,
                        denied_ingress: 9,
                        denied_egress: 0,
                    },
                )]),
                policy_hits: vec![3, 2],
                service: BTreeMap::from([(
                    11,
                    vmpath_common::ServiceStats {
                        flows: 7,
                        rejected: 2,
                    },
                )]),
                uplink_xdp: Vec::new(),
            }),
            slow: SlowStats::default(),
        };
        let t = text(&snap);
        let port = "interface=\"eth0\",namespace=\"prod\",network=\"blue\",port=\"p-vm1\"";
        for line in [
            format!(
                "vmpath_port_policy_total{{direction=\"ingress\",{port},verdict=\"allowed\",vm=\"vm1\"}} 4"
            ),
            format!(
                "vmpath_port_policy_total{{direction=\"ingress\",{port},verdict=\"denied\",vm=\"vm1\"}} 9"
            ),
            format!(
                "vmpath_port_policy_total{{direction=\"egress\",{port},verdict=\"allowed\",vm=\"vm1\"}} 1"
            ),
            "vmpath_policy_allowed_flows_total{policy=\"prod/web\"} 3".to_string(),
            "vmpath_policy_allowed_flows_total{policy=\"prod/db\"} 2".to_string(),
            format!("vmpath_port_service_flows_total{{{port},verdict=\"sent\",vm=\"vm1\"}} 7"),
            format!("vmpath_port_service_flows_total{{{port},verdict=\"rejected\",vm=\"vm1\"}} 2"),
        ] {
            assert!(t.lines().any(|l| l == line), "no line {line:?} in\n{t}");
        }
    }

    #[test]
    fn without_the_pinned_maps_only_the_view_is_shown() {
        let snap = Snapshot {
            view: sample::view().into(),
            dataplane: Err("no maps".into()),
            slow: SlowStats::default(),
        };
        let t = text(&snap);
        assert!(t.lines().any(|l| l == "vmpath_dataplane_up 0"), "{t}");
        assert!(t.contains("vmpath_attachments{state=\"remote\"} 1"));
        assert!(!t.contains("vmpath_drops_total"), "{t}");
        assert!(!t.contains("vmpath_port_"), "{t}");
    }

    #[test]
    fn the_registered_collector_adds_the_reconcile_histogram() {
        let view = sample::view();
        let bpffs = view.bpffs.clone().into();
        let published = Arc::new(crate::publish::view::Published::new(view));
        published.observe_reconcile(0.003);
        let observer = Arc::new(Observer::new(published, Default::default(), bpffs));
        let r = registry(observer).unwrap();
        let first = render(&r).unwrap();
        assert!(
            first.contains("vmpath_reconcile_duration_seconds_count 1"),
            "{first}"
        );
        assert!(first.contains("vmpath_dataplane_up 0"), "{first}");
        // Scraped again: the same families, not registered twice.
        assert_eq!(render(&r).unwrap(), first);
    }
}
