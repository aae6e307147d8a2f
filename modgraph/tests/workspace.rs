//! Every crate of the workspace keeps its modules in one direction: an import cycle among a
//! crate's top-level modules fails here, naming it (see the crate's documentation for what
//! counts as an import). `airlockd`'s modules are being taken apart: the modules still on a
//! cycle are listed, and the list may only shrink.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::PathBuf;

/// The workspace's directory.
fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("modgraph/ lies in the workspace")
        .to_path_buf()
}

/// The workspace's members, as its manifest lists them.
fn members() -> Vec<String> {
    let manifest = std::fs::read_to_string(workspace().join("Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("a members line");
    line.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The daemon's modules still on an import cycle (issue 36: take them off as the cycles go).
const DAEMON_IN_CYCLES: &[&str] = &[
    "auth",
    "cluster",
    "config",
    "daemon",
    "e2b",
    "exec",
    "host",
    "imagebuild",
    "jail",
    "janitor",
    "metrics",
    "net",
    "pkg",
    "pool",
    "recovery",
    "retention",
    "sandbox",
    "sbom",
    "server",
    "service",
    "stream",
    "supervisor",
    "templates",
    "versions",
    "vmm",
    "volumes",
];

#[test]
fn every_crate_but_the_daemon_has_no_import_cycle() {
    let members = members();
    assert!(members.len() >= 10, "{members:?}");
    for member in members.iter().filter(|m| *m != "daemon") {
        let dir = workspace().join(member);
        if !dir.join("src").is_dir() {
            continue;
        }
        airlock_modgraph::assert_acyclic(dir.to_str().unwrap(), &[]);
    }
}

#[test]
fn the_daemon_has_no_new_import_cycle() {
    let dir = workspace().join("daemon");
    let graph = airlock_modgraph::assert_cycles_within(dir.to_str().unwrap(), DAEMON_IN_CYCLES);
    // The reading finds edges that exist.
    assert!(
        graph["service"].contains("templates") && graph["server"].contains("service"),
        "{}",
        airlock_modgraph::show(&graph)
    );
}

#[test]
fn this_crate_is_members_of_the_workspace() {
    assert!(members().iter().any(|m| m == "modgraph"), "{:?}", members());
}
