//! Prometheus metrics on `--metrics-addr` (HTTP, `GET /metrics`, text
//! format). Everything but the reconcile histogram is read at scrape time
//! from the agent's [`View`] and the pinned maps, so the numbers are the
//! kernel's own and survive agent restarts (per-CPU counters are summed).

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
    thread::JoinHandle,
};

use anyhow::{Result, anyhow};
use prometheus::{
    Encoder as _, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use tracing::{info, warn};
use vmpath_common::drop_reason;

use crate::{
    api::{self, state},
    dataplane::Maps,
    view::{SharedView, View},
};

fn reconcile_histogram() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| {
        Histogram::with_opts(
            HistogramOpts::new(
                "vmpath_reconcile_duration_seconds",
                "Time to plan and program the data path, per reconcile round that changed it.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )
        .expect("a valid histogram")
    })
}

/// Records one reconcile round's duration.
pub fn observe_reconcile(seconds: f64) {
    reconcile_histogram().observe(seconds);
}

const PORT_LABELS: [&str; 5] = ["network", "namespace", "vm", "interface", "port"];

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn gauge(r: &Registry, name: &str, help: &str) -> Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

/// Renders every metric in the text exposition format. `maps` is `None`
/// when the pinned maps cannot be opened (then only the view's metrics and
/// `vmpath_dataplane_up 0` are shown).
pub fn render(view: &View, maps: Option<&Maps>) -> Result<String> {
    let r = Registry::new();

    gauge(
        &r,
        "vmpath_ready",
        "1 once the data path has been programmed from the config.",
    )?
    .set(view.ready as i64);
    gauge(
        &r,
        "vmpath_dataplane_up",
        "1 when the pinned maps could be read for this scrape.",
    )?
    .set(maps.is_some() as i64);
    gauge(&r, "vmpath_networks", "Valid networks in the config.")?.set(view.networks.len() as i64);

    let attachments = gauge_vec(
        &r,
        "vmpath_attachments",
        "Valid attachments by state as seen from this node: local (port programmed here), remote (on another node), missing_port (belongs here, port absent), migrating (migration pending).",
        &["state"],
    )?;
    for s in state::ALL {
        attachments.with_label_values(&[s]).set(0);
    }
    for a in &view.attachments {
        attachments
            .with_label_values(&[api::state_of(view, a)])
            .inc();
    }

    gauge(
        &r,
        "vmpath_config_errors",
        "Config documents currently refused (see vmpath_config_error_info).",
    )?
    .set(view.config_errors.len() as i64);
    let info = gauge_vec(
        &r,
        "vmpath_config_error_info",
        "One series per refused config document: its file, document and field.",
        &["file", "document", "field"],
    )?;
    for e in &view.config_errors {
        info.with_label_values(&[
            e.file.display().to_string().as_str(),
            e.document.as_str(),
            e.field.as_str(),
        ])
        .set(1);
    }

    let parsed = IntCounter::new(
        "vmpath_config_files_parsed_total",
        "Config files parsed since the agent started; an unchanged file is not parsed again.",
    )?;
    parsed.inc_by(crate::config::source::files_parsed());
    r.register(Box::new(parsed))?;

    let reconciles = IntCounter::new(
        "vmpath_reconciles_total",
        "Reconcile rounds that changed the data path since the agent started.",
    )?;
    reconciles.inc_by(view.reconciles);
    r.register(Box::new(reconciles))?;
    r.register(Box::new(reconcile_histogram().clone()))?;

    let dhcp = counter_vec(
        &r,
        "vmpath_dhcp_messages_total",
        "Slow-path messages (DHCPv4, DHCPv6, router solicitations) by network, kind and outcome (received, replied, dropped).",
        &["network", "kind", "outcome"],
    )?;
    let dhcp_ports = counter_vec(
        &r,
        "vmpath_port_dhcp_messages_total",
        "Slow-path messages per VM interface (namespace/vm/interface), by kind and outcome.",
        &["vm_interface", "kind", "outcome"],
    )?;
    {
        let stats = crate::slowpath::service::stats().lock().unwrap();
        let outcomes = |c: &crate::slowpath::Counters| {
            [
                ("received", c.received.clone()),
                ("replied", c.replied.clone()),
                ("dropped", c.dropped.clone()),
            ]
        };
        for (net, c) in &stats.networks {
            for (outcome, by_kind) in outcomes(c) {
                for (kind, n) in by_kind {
                    dhcp.with_label_values(&[net.as_str(), kind.as_str(), outcome])
                        .inc_by(n);
                }
            }
        }
        for (port, c) in &stats.ports {
            for (outcome, by_kind) in outcomes(c) {
                for (kind, n) in by_kind {
                    dhcp_ports
                        .with_label_values(&[port.as_str(), kind.as_str(), outcome])
                        .inc_by(n);
                }
            }
        }
    }

    if let Some(maps) = maps {
        let drops = counter_vec(
            &r,
            "vmpath_drops_total",
            "Frames the data path dropped, by reason (all ports).",
            &["reason"],
        )?;
        match maps.drop_counts() {
            Ok(counts) => {
                for (name, n) in drop_reason::NAMES.iter().zip(counts) {
                    drops.with_label_values(&[*name]).inc_by(n);
                }
            }
            Err(e) => warn!("reading drop counters: {e:#}"),
        }

        let rx_packets = counter_vec(
            &r,
            "vmpath_port_rx_packets_total",
            "Frames the VM sent into the data path.",
            &PORT_LABELS,
        )?;
        let rx_bytes = counter_vec(
            &r,
            "vmpath_port_rx_bytes_total",
            "Bytes the VM sent into the data path.",
            &PORT_LABELS,
        )?;
        let tx_packets = counter_vec(
            &r,
            "vmpath_port_tx_packets_total",
            "Frames the data path delivered to the VM.",
            &PORT_LABELS,
        )?;
        let tx_bytes = counter_vec(
            &r,
            "vmpath_port_tx_bytes_total",
            "Bytes the data path delivered to the VM.",
            &PORT_LABELS,
        )?;
        let port_drops = counter_vec(
            &r,
            "vmpath_port_drops_total",
            "Frames from the VM the data path dropped.",
            &PORT_LABELS,
        )?;
        let gw_replies = counter_vec(
            &r,
            "vmpath_port_gateway_replies_total",
            "ARP, ND and echo requests the gateway answered in place.",
            &PORT_LABELS,
        )?;
        for a in &view.attachments {
            let Some(ifindex) = a.ifindex else { continue };
            if api::state_of(view, a) != state::LOCAL {
                continue;
            }
            let stats = match maps.port_stats(ifindex) {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    warn!(port = %a.port, "reading port counters: {e:#}");
                    continue;
                }
            };
            let labels = [
                a.network.as_str(),
                a.namespace.as_str(),
                a.vm.as_str(),
                a.interface.as_str(),
                a.port.as_str(),
            ];
            rx_packets
                .with_label_values(&labels)
                .inc_by(stats.rx_packets);
            rx_bytes.with_label_values(&labels).inc_by(stats.rx_bytes);
            tx_packets
                .with_label_values(&labels)
                .inc_by(stats.tx_packets);
            tx_bytes.with_label_values(&labels).inc_by(stats.tx_bytes);
            port_drops.with_label_values(&labels).inc_by(stats.drops);
            gw_replies
                .with_label_values(&labels)
                .inc_by(stats.gw_replies);
        }

        // The overlay: frames to and from other nodes, and its drops.
        if let Ok(o) = maps.overlay_stats() {
            let packets = counter_vec(
                &r,
                "vmpath_overlay_packets_total",
                "Frames sent to (tx) and received from (rx) other nodes over VXLAN.",
                &["direction"],
            )?;
            let bytes = counter_vec(
                &r,
                "vmpath_overlay_bytes_total",
                "Bytes sent to (tx) and received from (rx) other nodes over VXLAN.",
                &["direction"],
            )?;
            packets.with_label_values(&["tx"]).inc_by(o.tx_packets);
            packets.with_label_values(&["rx"]).inc_by(o.rx_packets);
            bytes.with_label_values(&["tx"]).inc_by(o.tx_bytes);
            bytes.with_label_values(&["rx"]).inc_by(o.rx_bytes);
            let drops = IntCounter::new(
                "vmpath_overlay_drops_total",
                "Overlay frames dropped (see vmpath_drops_total for reasons).",
            )?;
            drops.inc_by(o.drops);
            r.register(Box::new(drops))?;
            let learned = gauge(
                &r,
                "vmpath_overlay_learned_macs",
                "Remote VM MACs learned from the overlay (vmp_remote_learned): unicast to them goes to their node only.",
            )?;
            learned.set(maps.remote_learned.keys().filter(|k| k.is_ok()).count() as i64);
        }
    }

    let mut buf = Vec::new();
    TextEncoder::new().encode(&r.gather(), &mut buf)?;
    String::from_utf8(buf).map_err(|e| anyhow!("metrics are not UTF-8: {e}"))
}

fn scrape(shared: &SharedView, bpffs: &Path) -> Result<String> {
    let view = match shared.read() {
        Ok(v) => v.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    let maps = Maps::open(bpffs).ok();
    render(&view, maps.as_ref())
}

/// Serves `/metrics` on `addr` (e.g. `0.0.0.0:9469`) in its own thread.
pub fn serve(addr: &str, shared: SharedView, bpffs: PathBuf) -> Result<JoinHandle<()>> {
    let server = tiny_http::Server::http(addr)
        .map_err(|e| anyhow!("binding the metrics address {addr}: {e}"))?;
    info!(addr, "metrics listening");
    let handle = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let path = request.url().split('?').next().unwrap_or("").to_string();
                let (code, body, content_type) = match (request.method(), path.as_str()) {
                    (tiny_http::Method::Get, "/metrics") => match scrape(&shared, &bpffs) {
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
