//! `vmpath-bench`: the benchmarks behind `cargo xtask bench`. Writes
//! BENCHMARKS.md and BENCHMARKS.png into `--out` (the repository root).
//!
//! Figure groups, one module each, every figure a ratio against a baseline
//! measured in the same run:
//!   progcost  per-path program cost by BPF_PROG_TEST_RUN (and, for VXLAN
//!             decap, which test_run cannot run, kernel BPF statistics)
//!   e2e       VM-to-VM TCP throughput and 64-byte UDP packet rate
//!   external  VM to external: vmpath SNAT against Linux + nftables masquerade
//!   control   control plane: programming N attachments, config-to-map latency
//!   dhcp      DHCP exchanges per second and latency through the slow path
//!   migration live-migration loss window over the overlay (the migration
//!             test's scenario) against the sender's interval
//!   realmigration  a real QEMU guest's live migration: the gap in a 1 ms
//!             stream against QEMU's own downtime
//!   flood     one VM flooding the slow path: another VM's DHCP latency and
//!             success against no flood, and the agent's CPU
//!   cni       CNI ADD latency: vmpath-cni against bridge + host-local
//!   reactivity port appearing -> first forwarded frame, config write -> map
//!             update, against the same agent on a 200 ms poll
//!   kube      the Kubernetes source at 1,000 and 10,000 VMs: agent memory
//!             against the file source, objects -> programmed latency,
//!             the controller's allocation rate (claims/s)
//!   services  ClusterIP TCP and 64-byte UDP against direct VM to VM
//!   policylatency  NetworkPolicy written -> enforced by the data path
//!   podnet    the pod network: a VM on a Primary network through a
//!             ClusterIP to a cluster-network pod against a cluster-network
//!             pod doing the same; the migration loss window of a Primary
//!             network against a secondary one
//!
//! Needs root; everything runs in network namespaces it creates and
//! removes (guards), and no packet leaves them.

mod churn;
mod cluster_scale;
mod cni;
mod control;
mod dhcp;
mod e2e;
mod external;
mod flood;
mod kube_scale;
mod migration;
mod overlay_cost;
mod podnet;
mod policycost;
mod policylatency;
mod progcost;
mod reactivity;
mod realmigration;
mod report;
mod services;
mod util;

use std::{path::PathBuf, process::ExitCode, time::Instant};

use anyhow::{Result, bail};

use report::{Report, Section};

struct Args {
    out: PathBuf,
    runs: usize,
    only: Vec<String>,
    quick: bool,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        out: PathBuf::from("."),
        runs: 5,
        only: Vec::new(),
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => args.out = PathBuf::from(it.next().unwrap_or_default()),
            "--runs" => args.runs = it.next().unwrap_or_default().parse()?,
            "--only" => args
                .only
                .extend(it.next().unwrap_or_default().split(',').map(String::from)),
            "--quick" => args.quick = true,
            // Internal: one control-plane measurement in a fresh process.
            "control-child" => {
                let n: usize = it.next().unwrap_or_default().parse()?;
                control::child(n)?;
                std::process::exit(0);
            }
            "-h" | "--help" => {
                println!(
                    "vmpath-bench [--out DIR] [--runs N] [--only progcost,e2e,external,control,dhcp,migration,realmigration,flood,reactivity,cni,kube,policy,services,policylatency,scale,churn,podnet] [--quick]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;
    if unsafe { libc::geteuid() } != 0 {
        bail!("the bench needs root (network namespaces, eBPF, bpffs)");
    }
    // The figures are the release agent's: without VMPATH_BIN (which
    // `cargo xtask bench` sets) the test bed would build and run the debug
    // one, several times slower, under a heading that says release. Take
    // the release binaries beside this one.
    for (var, name) in [("VMPATH_BIN", "vmpath"), ("VMPATH_CNI_BIN", "vmpath-cni")] {
        if std::env::var_os(var).is_none() {
            let beside = std::env::current_exe()?.with_file_name(name);
            anyhow::ensure!(
                beside.exists(),
                "{var} is not set and {} does not exist: run `cargo xtask bench`, or build the release binaries first",
                beside.display()
            );
            // SAFETY: no other thread runs yet.
            unsafe { std::env::set_var(var, &beside) };
        }
    }
    let started = Instant::now();
    let want = |g: &str| args.only.is_empty() || args.only.iter().any(|o| o == g);
    let runs = if args.quick { 2 } else { args.runs };
    let mut sections: Vec<Section> = Vec::new();
    let mut step = |name: &str, f: &dyn Fn() -> Result<Section>| {
        let t = Instant::now();
        eprintln!("bench: {name} ...");
        // A failing figure group (an error, or a panic in the test bed, whose
        // guards tear its namespaces down while unwinding) is reported and
        // the others still run.
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                Err(anyhow::anyhow!("{}", msg.lines().next().unwrap_or("panic")))
            });
        let s = match result {
            Ok(s) => s,
            Err(e) => {
                eprintln!("bench: {name} failed: {e:#}");
                Section {
                    title: name.to_string(),
                    markdown: format!("Not measured in this run: `{e:#}`\n"),
                    bars: Vec::new(),
                }
            }
        };
        eprintln!("bench: {name} done in {:.1} s", t.elapsed().as_secs_f64());
        sections.push(s);
    };
    if want("progcost") {
        step("1. Per-path program cost (BPF_PROG_TEST_RUN)", &|| {
            progcost::run(&progcost::Options {
                runs,
                repeat: 1_000_000,
                single_shots: if args.quick { 50_000 } else { 200_000 },
            })
        });
        step("1b. North-south paths (SNAT, routed)", &|| {
            progcost::north_south(&progcost::Options {
                runs,
                repeat: 1_000_000,
                single_shots: if args.quick { 50_000 } else { 200_000 },
            })
        });
        step("1c. Overlay: VXLAN encap and decap", &|| {
            overlay_cost::run(&overlay_cost::Options {
                runs,
                repeat: 1_000_000,
                single_shots: if args.quick { 50_000 } else { 200_000 },
                live_rounds: if args.quick { 2 } else { 8 },
                slice_ms: if args.quick { 300 } else { 400 },
            })
        });
    }
    if want("e2e") {
        step("2. End to end between VM namespaces", &|| {
            e2e::run(&e2e::Options {
                runs,
                tcp_seconds: if args.quick { 2 } else { 3 },
                pps_rounds: if args.quick { 4 } else { 36 },
                pps_slice: std::time::Duration::from_millis(if args.quick { 500 } else { 300 }),
            })
        });
    }
    if want("external") {
        step("2b. VM to external: SNAT", &|| {
            external::run(&external::Options {
                runs,
                tcp_seconds: if args.quick { 2 } else { 3 },
                pps_rounds: if args.quick { 4 } else { 36 },
                pps_slice: std::time::Duration::from_millis(if args.quick { 500 } else { 300 }),
            })
        });
    }
    if want("control") {
        step("3. Control plane", &|| {
            control::run(&control::Options {
                runs: if args.quick { 1 } else { 3.min(runs) },
                sizes: if args.quick {
                    vec![1_000, 10_000]
                } else {
                    vec![1_000, 10_000, 100_000]
                },
                latency_samples: if args.quick { 10 } else { 40 },
                limit: std::time::Duration::from_secs(if args.quick { 30 } else { 420 }),
            })
        });
    }
    if want("dhcp") {
        step("4. DHCP through the slow path", &|| {
            dhcp::run(&dhcp::Options {
                runs,
                seconds: if args.quick { 1 } else { 2 },
            })
        });
    }
    if want("migration") {
        step("5. Live migration loss window", &|| {
            migration::run(&migration::Options {
                runs: if args.quick { 1 } else { args.runs.min(3) },
            })
        });
    }
    if want("flood") {
        step("6. One VM flooding the slow path", &|| {
            flood::run(&flood::Options {
                runs: if args.quick { 2 } else { runs },
                exchanges: if args.quick { 20 } else { 50 },
            })
        });
    }
    if want("reactivity") {
        step("7. Reactivity: port and config changes", &|| {
            reactivity::run(&reactivity::Options {
                trials: if args.quick { 5 } else { 15 },
            })
        });
    }

    if want("realmigration") {
        step("8. Real live migration (QEMU)", &|| {
            realmigration::run(&realmigration::Options {
                runs: if args.quick { 2 } else { args.runs.min(5) },
            })
        });
    }

    if want("cni") {
        step("9. CNI ADD latency", &|| {
            cni::run(&cni::Options {
                sequential: if args.quick { 20 } else { 100 },
                concurrent: 20,
            })
        });
    }
    if want("kube") {
        step("10. Kubernetes source at scale", &|| {
            kube_scale::run(&kube_scale::Options {
                sizes: if args.quick {
                    vec![1_000]
                } else {
                    vec![1_000, 10_000]
                },
                latency_at: 1_000,
                samples: 6,
                claims: if args.quick {
                    vec![100]
                } else {
                    vec![100, 1_000, 10_000]
                },
            })
        });
    }

    if want("policy") {
        step("11. NetworkPolicy cost", &|| {
            policycost::run(&policycost::Options {
                runs,
                repeat: if args.quick { 100_000 } else { 1_000_000 },
                single_shots: if args.quick { 5_000 } else { 20_000 },
                pps_rounds: if args.quick { 6 } else { 36 },
                pps_slice: std::time::Duration::from_millis(if args.quick { 500 } else { 300 }),
            })
        });
    }

    if want("services") {
        step("12. ClusterIP Services against direct VM to VM", &|| {
            services::run(&services::Options {
                runs,
                tcp_seconds: if args.quick { 2 } else { 3 },
                pps_rounds: if args.quick { 6 } else { 36 },
                pps_slice: std::time::Duration::from_millis(if args.quick { 500 } else { 300 }),
            })
        });
    }

    if want("policylatency") {
        step("13. Policy update to enforcement latency", &|| {
            policylatency::run(&policylatency::Options {
                trials: if args.quick { 5 } else { 15 },
            })
        });
    }

    if want("scale") {
        step("14. Cluster scale", &|| {
            cluster_scale::run(&cluster_scale::Options {
                // VMPATH_BENCH_SCALE_SIZES=10,1000 measures other sizes
                // (100,000 takes long on a small machine).
                sizes: std::env::var("VMPATH_BENCH_SCALE_SIZES")
                    .ok()
                    .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
                    .unwrap_or_else(|| {
                        if args.quick {
                            vec![10, 1_000]
                        } else {
                            vec![10, 1_000, 10_000, 100_000]
                        }
                    }),
                // VMPATH_BENCH_SCALE_SAMPLES=N: more samples, for a p50
                // steadier than 8 give (an ADD moves by milliseconds from
                // one to the next on a small machine).
                samples: std::env::var("VMPATH_BENCH_SCALE_SAMPLES")
                    .ok()
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(if args.quick { 3 } else { 8 }),
                settle_limit: std::time::Duration::from_secs(if args.quick { 300 } else { 1_800 }),
            })
        });
    }

    if want("churn") {
        step("15. Churn: pods created and deleted", &|| {
            churn::run(&churn::Options {
                rate: 100.0,
                // VMPATH_BENCH_CHURN_SECONDS=60: a shorter run.
                seconds: std::env::var("VMPATH_BENCH_CHURN_SECONDS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(if args.quick { 30 } else { 600 }),
                workers: 16,
                alive: 32,
                window: if args.quick { 10 } else { 60 },
            })
        });
    }

    if want("podnet") {
        step("16. The pod network", &|| {
            podnet::run(&podnet::Options {
                rounds: if args.quick { 2 } else { runs },
                tcp_seconds: if args.quick { 2 } else { 3 },
                requests: if args.quick { 100 } else { 300 },
                migration_runs: if args.quick { 1 } else { args.runs.min(3) },
            })
        });
    }

    std::fs::create_dir_all(&args.out)?;
    let chart_name = "BENCHMARKS.png";
    report::chart(&args.out.join(chart_name), &sections)?;
    let report = Report {
        command: std::env::var("VMPATH_BENCH_COMMAND").unwrap_or_else(|_| {
            std::iter::once("vmpath-bench".to_string())
                .chain(std::env::args().skip(1))
                .collect::<Vec<_>>()
                .join(" ")
        }),
        machine: util::machine(),
        sections,
        runtime_s: started.elapsed().as_secs_f64(),
        chart: chart_name.into(),
    };
    let path = args.out.join("BENCHMARKS.md");
    std::fs::write(&path, report.markdown())?;
    eprintln!(
        "bench: wrote {} and {} in {:.0} s",
        path.display(),
        args.out.join(chart_name).display(),
        report.runtime_s
    );
    Ok(())
}
