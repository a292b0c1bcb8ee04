//! The integration suite as one test binary (see tests/Cargo.toml). Each
//! module is one file of tests; run one with
//! `cargo xtask test -- <module>::` or, after `cargo build -p vmpath --bin vmpath`,
//! `VMPATH_BIN=$PWD/target/debug/vmpath cargo nextest run -p vmpath-tests -E 'test(/^<module>::/)'`.

mod addresses;
mod cluster_flood;
mod cni;
mod crds;
mod cut_over;
mod deploy;
mod dhcp;
mod fixtures;
mod hostile_config;
mod image;
mod incremental;
mod kubernetes_controller;
mod kubernetes_migration;
mod kubernetes_objects;
mod kubernetes_source;
mod learned_addresses;
mod map_sizes;
mod migration;
mod monitor;
mod node_reach;
mod north_south;
mod north_south_imported;
mod north_south_xdp;
mod one_agent;
mod one_node;
mod operate;
mod overlay;
mod pod_network;
mod pod_network_guest;
mod policy;
mod policy_fixtures;
mod port_eligibility;
mod real_migration;
mod real_vm;
mod rogue_vm;
mod service6_fixtures;
mod service_fixtures;
mod services;
mod services6;
mod snat_fixtures;
mod upgrade;
