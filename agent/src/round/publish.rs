//! Stage 9, **publish**: what the round decided, said to everyone who
//! reads it. Refusals in the log and, with the Kubernetes source, as
//! Events on the objects (with the MACs detected for VMIs); the view the
//! admin API, the CLI and metrics read ([`build_view`]) and
//! `--state-dir/status.json`.

use std::{collections::BTreeSet, fs, path::Path, sync::Arc};

use anyhow::Result;
use tracing::error;

use crate::sys::hash::HashMap;
use crate::{
    config::{self, AttachmentKey, ConfigError, format_mac},
    observe::learned,
    plan::Plan,
    publish::view::{
        AttachmentView, IpView, LearnedRefusalView, NetworkView, ROWS_CHUNK, Row, Rows, View,
        row_elsewhere,
    },
    publish::writeback,
    read::kube_source::KubeSource,
    resolve::resolved::{self, Origin, Resolved},
};

use super::Settings;

/// Logs each refusal once, when it first appears (`last_errors`: the
/// previous round's).
pub fn log_refusals(cfg: &Resolved, last_errors: &mut Vec<ConfigError>) {
    if cfg.errors != *last_errors {
        for e in cfg.errors.iter().filter(|e| !last_errors.contains(e)) {
            error!(file = %e.file.display(), document = %e.document, field = %e.field, "refused: {e}");
        }
        last_errors.clone_from(&cfg.errors);
    }
}

/// Writes back to the API server: an Event for each refusal and wait, and
/// the MACs detected in the traffic of this node's VMs, for their VMIs.
pub fn report(cluster: &KubeSource, cfg: &Resolved, node: &str, mac_refusals: &[ConfigError]) {
    let mut macs = writeback::DetectedMacs::new();
    for a in cfg
        .local_entries()
        .filter(|a| !a.elsewhere && a.active_node() == node && a.source.origin.is_from_vmi())
    {
        if let Some((mac, Origin::Detected)) = a.mac_resolved {
            macs.entry((a.key.namespace.to_string(), a.key.vm.to_string()))
                .or_default()
                .insert(a.key.interface.to_string(), format_mac(&mac));
        }
    }
    let refusals: Vec<ConfigError> = cfg.errors.iter().chain(mac_refusals).cloned().collect();
    cluster.report(&refusals, &cfg.config.warnings, macs);
}

/// Writes `--state-dir/status.json`, the published view as JSON, keeping
/// the text of each VM interface's entry built for this node between
/// rounds: an entry the view shares with the last one is not serialised
/// again. Other nodes' entries (`Row::Elsewhere`) are made and written
/// each time, on the writer's idle thread: kept as text they were about
/// as much memory as the file's size.
#[derive(Default)]
pub struct StatusFile {
    /// The last view's built entries in its order (each held, so that its
    /// address is not another's while it is here) with their JSON.
    entries: Vec<(Arc<AttachmentView>, Box<[u8]>)>,
}

/// Where the top-level `attachments` list opens in a view's JSON with no
/// entries. Unique: inside a JSON string a quote is escaped, so `,"`
/// never appears there, and a network's `attachments` is a number.
const EMPTY_ATTACHMENTS: &[u8] = b",\"attachments\":[]";

impl StatusFile {
    /// `view` as `serde_json::to_vec` gives it, from the kept entries
    /// where they are the view's (and keeps only the view's).
    pub fn json(&mut self, view: &View) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.render(view, &mut out)?;
        Ok(out)
    }

    /// Writes `view`'s JSON to `out`: the kept text of each entry that is
    /// still the view's, a new one's serialized.
    fn render(&mut self, view: &View, out: &mut impl std::io::Write) -> Result<()> {
        let head = serde_json::to_vec(&view.clone_without_attachments())?;
        let at = head
            .windows(EMPTY_ATTACHMENTS.len())
            .position(|w| w == EMPTY_ATTACHMENTS)
            .ok_or_else(|| anyhow::anyhow!("the view's JSON has no attachments list"))?
            + EMPTY_ATTACHMENTS.len()
            - 1;
        let mut kept = std::mem::take(&mut self.entries);
        out.write_all(&head[..at])?;
        // Where each kept entry is, built only when an entry is not where
        // it was: most rounds change a few VMs' entries in place.
        let mut index: Option<HashMap<usize, usize>> = None;
        let mut next = Vec::new();
        // A new entry is written here, then kept at its size: a vector
        // shrunk in place (`into_boxed_slice`) keeps the allocator's
        // bigger block, twice the text across a cluster's entries.
        let mut scratch = Vec::new();
        // Built rows seen so far: where the next one was last time.
        let mut built = 0;
        for (i, row) in view.attachments.rows().enumerate() {
            if i > 0 {
                out.write_all(b",")?;
            }
            let entry = match row {
                // Another node's: made and written, not kept (its text
                // would be most of the agent's memory in a large cluster;
                // this runs on the status file's idle thread).
                Row::Elsewhere(a) => {
                    scratch.clear();
                    serde_json::to_writer(&mut scratch, &row_elsewhere(a))?;
                    out.write_all(&scratch)?;
                    continue;
                }
                Row::Built(entry) => entry,
            };
            let at = if kept.get(built).is_some_and(|(e, _)| Arc::ptr_eq(e, entry)) {
                Some(built)
            } else {
                let index = index.get_or_insert_with(|| {
                    kept.iter()
                        .enumerate()
                        .map(|(j, (e, _))| (Arc::as_ptr(e) as usize, j))
                        .collect()
                });
                index.get(&(Arc::as_ptr(entry) as usize)).copied()
            };
            built += 1;
            // A taken entry's text is empty: JSON text never is.
            let json = at
                .map(|j| std::mem::take(&mut kept[j].1))
                .filter(|t| !t.is_empty());
            let json = match json {
                Some(json) => json,
                None => {
                    scratch.clear();
                    serde_json::to_writer(&mut scratch, &**entry)?;
                    Box::from(&scratch[..])
                }
            };
            out.write_all(&json)?;
            next.push((entry.clone(), json));
        }
        out.write_all(&head[at..])?;
        self.entries = next;
        Ok(())
    }

    /// Writes `status.json` in `dir` (whole, by rename), streamed through
    /// a buffer: at 10,000 VMs the file is megabytes, and a buffer of that
    /// size made afresh each round was most of the write's time.
    pub fn write(&mut self, dir: &Path, view: &View) -> Result<()> {
        fs::create_dir_all(dir)?;
        let tmp = dir.join(".status.json.tmp");
        let mut file = std::io::BufWriter::with_capacity(64 << 10, fs::File::create(&tmp)?);
        // Compact: `jq .` shows it indented.
        self.render(view, &mut file)?;
        file.into_inner().map_err(|e| e.into_error())?;
        fs::rename(&tmp, dir.join("status.json"))?;
        Ok(())
    }
}

/// The addresses seen in the traffic of the VM on port `ifindex` that it
/// was not given or claimed (those are its row's already).
fn learned_ips(
    a: &resolved::Attachment,
    cfg: &Resolved,
    ifindex: Option<u32>,
    learned: &learned::Outcome,
) -> Vec<IpView> {
    let (Some(ifindex), Some(net)) = (ifindex, cfg.network(&a.network)) else {
        return Vec::new();
    };
    learned
        .shown()
        .filter(|(key, seen)| key.network == net.id && seen.ifindex == ifindex)
        .map(|(key, _)| key.ip())
        .filter(|ip| !a.addresses.iter().any(|(given, _)| given.addr() == *ip))
        .map(|ip| IpView {
            address: ip.to_string(),
            origin: Origin::Learned,
        })
        .collect()
}

/// Builds what readers see from the resolved config and the applied plan.
///
/// `viewed`: the VM interfaces `prev`'s entries were built from, one for
/// one. An entry whose interface is unchanged and has no port here (most
/// of a cluster's: other nodes' VMs) depends on nothing else, and is
/// shared with `prev`'s rather than built again.
pub fn build_view(
    settings: &Settings,
    cfg: &Resolved,
    plan: &Plan,
    learned: &learned::Outcome,
    prev: &View,
) -> View {
    let mut shared = 0usize;
    let per_network = per_network(cfg, prev);
    let active_port: HashMap<&AttachmentKey, u32> = plan
        .ports
        .values()
        .filter(|p| !p.pending())
        .map(|p| (&p.attachment, p.ifindex))
        .collect();
    let pending_port: HashMap<&AttachmentKey, (&str, u32)> = plan
        .ports
        .values()
        .filter(|p| p.pending())
        .map(|p| (&p.attachment, (p.ifname.as_str(), p.ifindex)))
        .collect();
    let networks = cfg
        .config
        .networks
        .iter()
        .map(|n| NetworkView {
            name: n.name.clone(),
            id: n.id,
            role: format!("{:?}", n.role),
            subnets: n.subnets.iter().map(|s| s.to_string()).collect(),
            exclude_subnets: n.exclude_subnets.iter().map(|s| s.to_string()).collect(),
            gateway_ips: n.gateway_ips.iter().map(|s| s.to_string()).collect(),
            gateway_mac: format_mac(&n.gateway_mac),
            ipam: n.ipam,
            mac_filter: n.mac_filter,
            ip_filter: n.ip_filter,
            egress: format!("{:?}", n.egress),
            mtu: n.mtu,
            attachments: per_network
                .iter()
                .find(|(name, _)| *name == n.name.as_str())
                .map_or(0, |(_, count)| *count),
            dns_servers: n.dhcp.dns_servers.iter().map(|s| s.to_string()).collect(),
            search_domains: n.dhcp.search_domains.clone(),
        })
        .collect();
    let node = settings.node.as_str();
    // The row of a VM interface that may have a port here: what its
    // entry says (`row_elsewhere`), with its port, its learned addresses
    // and a pending migration's target port.
    let build = |a: &resolved::Attachment| -> Arc<AttachmentView> {
        // A pending migration target's port is not where the VM runs yet.
        let ifindex = active_port.get(&a.key).copied();
        let mut row = row_elsewhere(a);
        row.ifindex = ifindex;
        row.ips.extend(learned_ips(a, cfg, ifindex, learned));
        row.learned_refused = ifindex
            .and_then(|i| learned.refused.get(&i))
            .map(|r| {
                r.iter()
                    .map(|r| LearnedRefusalView {
                        address: r.ip.to_string(),
                        kind: r.kind.to_string(),
                        reason: r.reason.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        row.learned_contested = ifindex
            .and_then(|i| learned.contested.get(&i))
            .map(|c| {
                c.iter()
                    .map(|(ip, by)| LearnedRefusalView {
                        address: ip.to_string(),
                        kind: "contested".into(),
                        reason: format!("kept here; also used by {by} (refused there)"),
                    })
                    .collect()
            })
            .unwrap_or_default();
        row.pending_port = pending_port
            .get(&a.key)
            .map(|(name, ifindex)| (name.to_string(), *ifindex));
        row.into()
    };
    // Carried over unchanged from the list the last view was built from,
    // one for one (`Round`): its last row, unless it has a migration
    // (whose cut-over is found again every round); one with a port here
    // is built and compared (its port, its learned addresses).
    let carried = cfg.carried_for(prev.attachments.len());
    let last_row = |index: usize, a: &resolved::Attachment| {
        let i = *carried?.get(index)?;
        (i != resolved::CHANGED && !a.migrates)
            .then(|| prev.attachments.get(i as usize))
            .flatten()
    };
    // Another node's entry is kept as it is, its row made when read.
    let row = |index: usize, a: &resolved::Entry, here: bool| -> (Row, bool) {
        match (last_row(index, a), here) {
            (Some(last @ Row::Elsewhere(_)), false) => (last.clone(), true),
            // The round's entry itself, shared (not a copy of it).
            (_, false) => (Row::Elsewhere(a.clone()), false),
            (Some(Row::Built(last)), true) => {
                let now = build(a);
                if now == *last {
                    (Row::Built(last.clone()), true)
                } else {
                    (Row::Built(now), false)
                }
            }
            (_, true) => (Row::Built(build(a)), false),
        }
    };
    let mut on_node: Vec<u32> = Vec::new();
    let mut attachments = Rows::default();
    let list = &cfg.attachments;
    // The last view's chunks by where they start: a run of this list's
    // entries carried over one for one from a whole chunk takes that
    // chunk, wherever the run now lies (a VM interface that came or went
    // before it shifts it, and at 100,000 VMs building every row after
    // the shift again was 3.5 ms of that round).
    // Each VM interface that came cuts a chunk in two: past twice the
    // chunks a list built whole has, this one is (amortized: once every
    // so many VMs).
    let fragmented = prev.attachments.chunk_count() > 2 * (prev.attachments.len() / ROWS_CHUNK + 1);
    let prev_chunks: HashMap<u32, &Arc<Vec<Row>>> = match carried {
        Some(_) if !fragmented => prev
            .attachments
            .chunks()
            .map(|(start, chunk)| (start as u32, chunk))
            .collect(),
        _ => HashMap::default(),
    };
    // Which entries may have a port here, and which migrate, from the
    // list's indexes: a look at every entry was most of the view's time.
    fn within(indexes: &[u32], run: std::ops::Range<usize>) -> impl Iterator<Item = usize> + '_ {
        let from = indexes.partition_point(|&x| (x as usize) < run.start);
        let to = indexes.partition_point(|&x| (x as usize) < run.end);
        indexes[from..to].iter().map(|&x| x as usize)
    }
    let here_in =
        |run: std::ops::Range<usize>| within(&cfg.local, run).filter(|&x| list[x].maybe_on(node));
    let mut j = 0;
    while j < list.len() {
        let whole = carried.and_then(|carried| {
            let chunk = prev_chunks.get(&carried[j])?;
            let run = j..j + chunk.len();
            (run.end <= list.len()
                && run
                    .clone()
                    .all(|x| carried[x] == carried[j] + (x - j) as u32)
                && within(&cfg.moving, run.clone()).next().is_none()
                && here_in(run.clone()).all(|x| row(x, &list[x], true).1))
            .then_some((*chunk, run))
        });
        if let Some((chunk, run)) = whole {
            on_node.extend(here_in(run.clone()).map(|x| x as u32));
            shared += chunk.len();
            attachments.push_chunk(chunk.clone());
            j = run.end;
            continue;
        }
        let here = here_in(j..j + 1).next().is_some();
        if here {
            on_node.push(j as u32);
        }
        let (r, was) = row(j, &list[j], here);
        shared += usize::from(was);
        attachments.push(r);
        j += 1;
    }
    tracing::debug!(entries = attachments.len(), shared, "view built");
    View {
        node: settings.node.clone(),
        bpffs: settings.bpffs.display().to_string(),
        config_dir: settings.config_dir.display().to_string(),
        config_errors: cfg.errors.clone(),
        config_warnings: cfg.config.warnings.clone(),
        networks,
        attachments,
        missing_ports: plan
            .missing_ports
            .iter()
            .map(|(k, p)| format!("{k} (port {p})"))
            .collect(),
        problems: plan.problems.clone(),
        policies: plan.policy.policies.clone(),
        reconciles: prev.reconciles,
        last_reconcile_seconds: prev.last_reconcile_seconds,
        last_reconcile_unix: prev.last_reconcile_unix,
        ready: prev.ready,
        generation: prev.generation + 1,
        on_node: Some(on_node),
    }
}

/// How many VM interfaces each network has (a few networks: a list, not
/// a hash). From `prev`'s counts when the list was carried over from the
/// one `prev` was built from: less the entries not carried (read from
/// their rows in `prev`), plus the changed ones; otherwise counted. At
/// 10,000 VM interfaces a count reading every entry's document was a
/// third of the view.
fn per_network<'a>(cfg: &'a Resolved, prev: &'a View) -> Vec<(&'a str, usize)> {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    let add = |counts: &mut Vec<(&'a str, usize)>, network: &'a str, by: isize| match counts
        .iter_mut()
        .find(|(n, _)| *n == network)
    {
        Some((_, count)) => *count = count.saturating_add_signed(by),
        None => counts.push((network, by.max(0) as usize)),
    };
    let Some(carried) = cfg.carried_for(prev.attachments.len()) else {
        for a in &cfg.attachments {
            add(&mut counts, &a.network, 1);
        }
        return counts;
    };
    let mut kept = vec![false; prev.attachments.len()];
    for &i in carried {
        if let Some(k) = kept.get_mut(i as usize) {
            *k = true;
        }
    }
    for n in &prev.networks {
        add(&mut counts, &n.name, n.attachments as isize);
    }
    for (row, _) in prev.attachments.rows().zip(&kept).filter(|(_, k)| !**k) {
        add(&mut counts, row.network(), -1);
    }
    for (a, _) in cfg
        .attachments
        .iter()
        .zip(carried)
        .filter(|(_, i)| **i == resolved::CHANGED)
    {
        add(&mut counts, &a.network, 1);
    }
    counts
}

/// What this round serves on this node's ports: each port's MAC and its
/// given or claimed addresses, by network id and port name (as
/// `read::running_ports` reads them after a restart).
pub fn served_here(cfg: &Resolved, plan: &Plan) -> config::Held {
    let programmed: BTreeSet<&AttachmentKey> = plan.ports.values().map(|p| &p.attachment).collect();
    let mut held = config::Held::default();
    // In key order, as the resolved interfaces are: the ports' few looked
    // up, not every VM interface of the cluster checked against them.
    for a in programmed.into_iter().filter_map(|k| cfg.attachment(k)) {
        let Some(net) = cfg.network(&a.network) else {
            continue;
        };
        let port = a.active_port().to_string();
        if let Some((mac, _)) = a.mac_resolved {
            held.port_macs.insert((net.id, mac), port.clone());
        }
        for (ip, _) in &a.addresses {
            held.port_ips.insert((net.id, ip.addr()), port.clone());
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::round::{
        plan::{Previous, plan},
        resolve::resolve,
        tests::{BLUE, attachment, snapshot_of},
    };

    /// Node a's plan of `cfg`, its ports' ifindexes `ports`.
    fn plan_on_a(cfg: &Resolved, ports: impl Fn(&str) -> Option<u32>) -> Plan {
        plan(
            cfg,
            "a",
            ports,
            &Previous::default(),
            &mut Default::default(),
        )
    }

    /// Node a's view of `cfg` with `plan` applied, after `prev`.
    fn view_on_a(cfg: &Resolved, plan: &Plan, prev: &View) -> View {
        let settings = Settings {
            node: "a".into(),
            ..Default::default()
        };
        build_view(&settings, cfg, plan, &Default::default(), prev)
    }

    /// `attachments` on network blue, resolved for node a, and a's view
    /// of them with vm1's port (ifindex 11) there.
    fn viewed_on_a(attachments: &[String]) -> (Resolved, View) {
        let snap = snapshot_of(&format!("{BLUE}---\n{}", attachments.join("---\n")));
        let cfg = resolve(
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        let view = view_on_a(
            &cfg,
            &plan_on_a(&cfg, |p: &str| (p == "vm1p").then_some(11)),
            &View::default(),
        );
        (cfg, view)
    }

    #[test]
    fn the_view_shows_where_a_vm_runs_and_its_migration() {
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm1", "a"),
            attachment("vm2", "a")
                .replace("port: vm2p", "port: vm2p\n  migration: {targetNode: b}")
        ));
        let cfg = resolve(
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        let ports =
            |p: &str| (p == "vm1p" || p == "vm2p").then_some(if p == "vm1p" { 11 } else { 12 });
        let plan = plan_on_a(&cfg, ports);
        let view = view_on_a(&cfg, &plan, &View::default());
        let row = |vm: &str| view.attachments.iter().find(|a| a.vm == vm).unwrap();
        assert_eq!(
            (row("vm1").migration.as_str(), row("vm1").ifindex),
            ("none", Some(11))
        );
        assert_eq!(row("vm2").migration, "pending");
        assert_eq!(row("vm2").migration_target.as_deref(), Some("b"));
        assert_eq!(view.networks[0].attachments, 2);
        // What the next round holds as served here: vm1's and vm2's ports.
        assert_eq!(
            served_here(&cfg, &plan).port_macs.len(),
            0,
            "no MAC known yet"
        );
    }

    /// Another node's VM interface is in the view as the round's entry
    /// itself (its row made when read), not a copy of it per round.
    #[test]
    fn the_view_keeps_another_nodes_entry_as_the_rounds_own() {
        let (cfg, view) = viewed_on_a(&[attachment("vm1", "a"), attachment("vm2", "b")]);
        let remote = cfg.attachments.iter().find(|a| a.key.vm == "vm2").unwrap();
        let shared = view.attachments.rows().any(|r| match r {
            Row::Elsewhere(a) => Arc::ptr_eq(a, remote),
            Row::Built(_) => false,
        });
        assert!(shared, "vm2's row is the round's entry");
        assert_eq!(
            view.attachments
                .iter()
                .find(|a| a.vm == "vm2")
                .unwrap()
                .node,
            "b"
        );
    }

    #[test]
    fn the_view_lists_the_entries_that_may_have_a_port_here() {
        let (_, view) = viewed_on_a(&[
            attachment("vm1", "a"),
            attachment("vm2", "b"),
            attachment("vm3", "b")
                .replace("port: vm3p", "port: vm3p\n  migration: {targetNode: a}"),
        ]);
        let vms = |v: &View| v.maybe_on_node().map(|a| a.vm.clone()).collect::<Vec<_>>();
        // vm2 runs on b and goes nowhere: not looked at for a port here.
        assert_eq!(vms(&view), ["vm1", "vm3"]);
        assert_eq!(
            view.local_ports()
                .map(|(a, i)| (a.vm.as_str(), i))
                .collect::<Vec<_>>(),
            [("vm1", 11)]
        );
        // A view that does not say (read back from a file): every entry.
        let unindexed: View = serde_json::from_slice(&serde_json::to_vec(&view).unwrap()).unwrap();
        assert!(unindexed.on_node.is_none());
        assert_eq!(vms(&unindexed), ["vm1", "vm2", "vm3"]);
    }

    /// Past a chunk's worth of VM interfaces, a chunk none of whose rows
    /// changed is the last view's, whole; the chunk with a changed row is
    /// built again, sharing its other rows.
    #[test]
    fn the_view_shares_whole_chunks_of_unchanged_rows() {
        let dir = std::env::temp_dir().join(format!("vmpath-view-chunks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let docs = |moved: usize| {
            let vms: Vec<String> = (0..2 * ROWS_CHUNK + 10)
                .map(|i| attachment(&format!("vm{i:04}"), if i == moved { "c" } else { "b" }))
                .collect();
            std::fs::write(
                dir.join("c.yaml"),
                format!("{BLUE}---\n{}", vms.join("---\n")),
            )
            .unwrap();
            crate::round::validate(
                &crate::config::source::read_dir(&dir),
                "a",
                &crate::config::AcceptedKeys::new(),
            )
        };
        let build = |cfg: &Resolved, prev: &View| view_on_a(cfg, &plan_on_a(cfg, |_| None), prev);
        let before = resolve(docs(usize::MAX), "a");
        let first = build(&before, &View::default());
        // One VM in the second chunk moves to node c.
        let (after, _) = Resolved::carrying(docs(ROWS_CHUNK + 3), "a", before.attachments.clone());
        let second = build(&after, &first);
        let same_chunk = |k: usize| {
            Arc::ptr_eq(
                first.attachments.chunk(k).unwrap(),
                second.attachments.chunk(k).unwrap(),
            )
        };
        assert!(
            same_chunk(0) && same_chunk(2),
            "unchanged chunks shared whole"
        );
        assert!(!same_chunk(1), "the chunk with the moved VM built again");
        assert!(first.attachments[ROWS_CHUNK].same(&second.attachments[ROWS_CHUNK]));
        assert_eq!(second.attachments[ROWS_CHUNK + 3].view().node, "c");
        // Other nodes' rows are kept as their entries, made when read:
        // status.json writes them as serde does.
        assert!(matches!(second.attachments[0], Row::Elsewhere(_)));
        assert_eq!(
            StatusFile::default().json(&second).unwrap(),
            serde_json::to_vec(&second).unwrap()
        );
        assert_eq!(
            second.attachments,
            build(&after, &View::default()).attachments
        );
        // Read back from JSON: the same rows, in chunks again.
        let read: View = serde_json::from_slice(&serde_json::to_vec(&second).unwrap()).unwrap();
        assert_eq!(read.attachments, second.attachments);
        assert_eq!(read.attachments.len(), 2 * ROWS_CHUNK + 10);
        // VMs come before the later chunks, one a round: those chunks are
        // the last view's still, wherever they now lie, but in a round that
        // finds the list fragmented (each VM come splits a chunk), which
        // builds it whole; the chunks stay bounded, and every view is the
        // one built from nothing.
        let mut prev = second;
        let mut cfg = after;
        let mut extra: Vec<String> = Vec::new();
        let mut compactions = 0;
        for n in 0..ROWS_CHUNK / 2 {
            extra.push(attachment(&format!("vm0000x{n:03}"), "b"));
            let vms: Vec<String> = (0..2 * ROWS_CHUNK + 10)
                .map(|i| {
                    attachment(
                        &format!("vm{i:04}"),
                        if i == ROWS_CHUNK + 3 { "c" } else { "b" },
                    )
                })
                .chain(extra.iter().cloned())
                .collect();
            std::fs::write(
                dir.join("c.yaml"),
                format!("{BLUE}---\n{}", vms.join("---\n")),
            )
            .unwrap();
            let validated = crate::round::validate(
                &crate::config::source::read_dir(&dir),
                "a",
                &crate::config::AcceptedKeys::new(),
            );
            let (next, _) = Resolved::carrying(validated, "a", cfg.attachments.clone());
            let view = build(&next, &prev);
            let last_chunk = prev
                .attachments
                .chunk(prev.attachments.chunk_count() - 1)
                .unwrap();
            let fragmented =
                prev.attachments.chunk_count() > 2 * (prev.attachments.len() / ROWS_CHUNK + 1);
            compactions += usize::from(fragmented);
            if !fragmented {
                assert!(
                    view.attachments
                        .chunks()
                        .any(|(_, c)| Arc::ptr_eq(c, last_chunk)),
                    "VM {n} came: the last chunk is shared still"
                );
            }
            assert!(
                view.attachments.chunk_count() <= 2 * (view.attachments.len() / ROWS_CHUNK + 1) + 1
            );
            assert_eq!(view.attachments, build(&next, &View::default()).attachments);
            (prev, cfg) = (view, next);
        }
        assert!(
            compactions <= ROWS_CHUNK / 4,
            "{compactions} of {} rounds built the list whole",
            ROWS_CHUNK / 2
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn status_json_is_the_view_as_serde_writes_it_with_its_kept_entries() {
        let entry = |vm: &str, node: &str| {
            Arc::new(AttachmentView {
                name: format!("{vm}-eth0"),
                namespace: "prod".into(),
                vm: vm.into(),
                interface: "eth0".into(),
                network: "blue".into(),
                node: node.into(),
                port: format!("{vm}p"),
                ifindex: None,
                mac: Some("02:00:00:00:00:01".into()),
                mac_origin: Some(Origin::Generated),
                ips: vec![IpView {
                    address: "10.9.0.5/24".into(),
                    origin: Origin::Claimed,
                }],
                learned_refused: Vec::new(),
                learned_contested: Vec::new(),
                migration: "none".into(),
                migration_target: None,
                pending_port: None,
            })
        };
        // A refusal whose text holds what the entries are spliced at, and
        // a network with its own `attachments` (a count).
        let mut first = View {
            node: "a".into(),
            config_errors: vec![ConfigError {
                file: "x,\"attachments\":[]".into(),
                document: "d".into(),
                field: "f".into(),
                message: ",\"attachments\":[] \\\"".into(),
                about: None,
                reason: None,
            }],
            networks: vec![NetworkView {
                name: "blue".into(),
                id: 7,
                role: "secondary".into(),
                subnets: vec![],
                exclude_subnets: vec![],
                gateway_ips: vec![],
                gateway_mac: String::new(),
                ipam: true,
                mac_filter: false,
                ip_filter: false,
                egress: "none".into(),
                mtu: 1500,
                attachments: 2,
                dns_servers: vec![],
                search_domains: vec![],
            }],
            attachments: vec![entry("vm1", "a"), entry("vm2", "b")].into(),
            ..Default::default()
        };
        let mut file = StatusFile::default();
        assert_eq!(
            file.json(&first).unwrap(),
            serde_json::to_vec(&first).unwrap()
        );
        // vm2's entry shared, vm1's built again, vm3 new: the same text as
        // serialising the whole view, and only the view's entries kept.
        let vm2 = first.attachments[1].built().unwrap().clone();
        first.attachments = vec![entry("vm1", "c"), vm2.clone(), entry("vm3", "a")].into();
        first.reconciles = 9;
        first.generation = 10;
        let text = file.json(&first).unwrap();
        assert_eq!(text, serde_json::to_vec(&first).unwrap());
        assert_eq!(file.entries.len(), 3);
        assert!(file.entries.iter().any(|(e, _)| Arc::ptr_eq(e, &vm2)));
        // The same entries again, and one moved: the same text.
        let mut rows: Vec<Row> = first.attachments.rows().cloned().collect();
        rows.swap(0, 2);
        first.attachments = rows.into_iter().collect();
        assert_eq!(
            file.json(&first).unwrap(),
            serde_json::to_vec(&first).unwrap()
        );
        // One entry twice (not a view's shape, but the text must hold).
        first.attachments.push(vm2.clone());
        assert_eq!(
            file.json(&first).unwrap(),
            serde_json::to_vec(&first).unwrap()
        );
        // No entries: an empty list.
        first.attachments = Default::default();
        assert_eq!(
            file.json(&first).unwrap(),
            serde_json::to_vec(&first).unwrap()
        );
        assert!(file.entries.is_empty());
    }

    #[test]
    fn the_view_shares_the_entries_of_unchanged_vms_without_a_port_here() {
        // One config file, edited (its documents keep their source).
        let dir = std::env::temp_dir().join(format!("vmpath-view-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let docs = |vm3_node: &str| {
            let yaml = format!(
                "{BLUE}---\n{}---\n{}---\n{}",
                attachment("vm1", "a"),
                attachment("vm2", "b"),
                attachment("vm3", vm3_node)
            );
            std::fs::write(dir.join("c.yaml"), yaml).unwrap();
            crate::config::source::read_dir(&dir)
        };
        let ports = |p: &str| (p == "vm1p").then_some(11);
        let build = |cfg: &Resolved, prev: &View| view_on_a(cfg, &plan_on_a(cfg, ports), prev);
        let before = resolve(
            crate::round::validate(&docs("b"), "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        let first = build(&before, &View::default());
        // vm3 moves to node c; vm1 (its port here) and vm2 do not change;
        // the round carries the list the first view was built from over.
        let (after, _) = Resolved::carrying(
            crate::round::validate(&docs("c"), "a", &crate::config::AcceptedKeys::new()),
            "a",
            before.attachments.clone(),
        );
        let second = build(&after, &first);
        // Each view published is numbered after the one before (what the
        // API's /healthz gives, and status.json catches up to).
        assert_eq!((first.generation, second.generation), (1, 2));
        let fresh = build(&after, &View::default());
        assert_eq!(
            second.attachments, fresh.attachments,
            "the shared entries are what building them again gives"
        );
        let shared = |vm: &str| {
            let find = |v: &View| {
                v.attachments
                    .rows()
                    .find(|a| a.view().vm == vm)
                    .unwrap()
                    .clone()
            };
            find(&first).same(&find(&second))
        };
        assert_eq!(
            second.networks, fresh.networks,
            "the counts are what counting again gives"
        );
        // vm1 and vm2 go, vm4 comes: the counts follow.
        let yaml = format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm3", "c"),
            attachment("vm4", "b")
        );
        std::fs::write(dir.join("c.yaml"), yaml).unwrap();
        let (third, _) = Resolved::carrying(
            crate::round::validate(
                &crate::config::source::read_dir(&dir),
                "a",
                &crate::config::AcceptedKeys::new(),
            ),
            "a",
            after.attachments.clone(),
        );
        let counted = build(&third, &second);
        assert_eq!(counted.networks[0].attachments, 2);
        assert_eq!(counted.networks, build(&third, &View::default()).networks);
        assert!(shared("vm2"), "vm2 is unchanged and remote: shared");
        assert!(!shared("vm3"), "vm3 moved: built again");
        assert!(
            shared("vm1"),
            "vm1 has its port here, as it was: built, compared, shared"
        );
        // vm1's port is another now: its row is built again.
        let moved_port = view_on_a(
            &after,
            &plan_on_a(&after, |p: &str| (p == "vm1p").then_some(12)),
            &first,
        );
        let vm1 = |v: &View| {
            v.attachments
                .rows()
                .find(|a| a.view().vm == "vm1")
                .unwrap()
                .clone()
        };
        assert_eq!(vm1(&moved_port).view().ifindex, Some(12));
        assert!(!vm1(&first).same(&vm1(&moved_port)));
        assert_eq!(
            second
                .attachments
                .iter()
                .find(|a| a.vm == "vm3")
                .unwrap()
                .node,
            "c"
        );
        // A list not carried over shares nothing.
        let unrelated = resolve(
            crate::round::validate(&docs("c"), "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        let unrelated = build(&unrelated, &first);
        assert_eq!(unrelated.attachments, fresh.attachments);
        assert!(
            unrelated
                .attachments
                .rows()
                .zip(first.attachments.rows())
                .all(|(a, b)| !a.same(b))
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
