//! Every crate of the workspace keeps its modules in one direction: an import cycle among a
//! crate's top-level modules fails here, naming it (see the crate's documentation for what
//! counts as an import). ARCHITECTURE.md's picture of the daemon's layers is checked against
//! the daemon's sources here too.
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

#[test]
fn every_crate_has_no_import_cycle() {
    let members = members();
    assert!(members.len() >= 10, "{members:?}");
    for member in &members {
        let dir = workspace().join(member);
        if !dir.join("src").is_dir() {
            continue;
        }
        airlock_modgraph::assert_acyclic(dir.to_str().unwrap(), &[]);
    }
    // The reading finds edges that exist.
    let graph = airlock_modgraph::read(&workspace().join("daemon"), &[]);
    assert!(
        graph["service"].contains("templates") && graph["server"].contains("service"),
        "{}",
        airlock_modgraph::show(&graph)
    );
}

/// No two files of a module directory import each other (`super::`), in any crate.
#[test]
fn sibling_files_import_in_one_direction() {
    for member in members() {
        let found = airlock_modgraph::sibling_cycles(&workspace().join(&member));
        assert!(found.is_empty(), "{member}: {found:#?}");
    }
}

/// No production function over 80 lines without a reason (a `Long:` comment above it).
#[test]
fn functions_read_as_steps() {
    let mut found = Vec::new();
    for member in members() {
        let dir = workspace().join(&member);
        for (at, len) in airlock_modgraph::long_functions(&dir, 80) {
            let rel = at
                .strip_prefix(&format!("{}/", workspace().display()))
                .unwrap_or(&at)
                .to_owned();
            found.push((rel, len));
        }
    }
    assert!(
        found.is_empty(),
        "functions over 80 lines (split them into named steps, or say why in a `Long:` comment \
         above): {found:#?}"
    );
}

/// The daemon's errors are types: no `Result<_, String>` in its non-test code.
#[test]
fn the_daemon_returns_no_string_errors() {
    let found = airlock_modgraph::string_errors(&workspace().join("daemon"));
    assert!(found.is_empty(), "{found:#?}");
}

const BEGIN: &str = "<!-- daemon layers: written by modgraph/tests/workspace.rs \
                     (AIRLOCK_BLESS=1 cargo test -p airlock-modgraph) -->";
const END: &str = "<!-- end of daemon layers -->";

/// ARCHITECTURE.md shows the daemon's layers as its sources have them: the block between
/// `BEGIN` and `END` is this test's picture (`AIRLOCK_BLESS=1` writes it there).
#[test]
fn architecture_shows_the_daemons_layers_as_they_are() {
    let graph = airlock_modgraph::assert_acyclic(workspace().join("daemon").to_str().unwrap(), &[]);
    let picture = airlock_modgraph::layer_picture(&graph).unwrap();
    let block = format!("{BEGIN}\n```text\n{picture}\n```\n{END}");
    let path = workspace().join("ARCHITECTURE.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let (Some(a), Some(b)) = (text.find(BEGIN), text.find(END)) else {
        panic!("ARCHITECTURE.md has no layer block; put this there:\n{block}");
    };
    let current = &text[a..b + END.len()];
    if current == block {
        return;
    }
    if std::env::var_os("AIRLOCK_BLESS").is_some() {
        std::fs::write(&path, text.replacen(current, &block, 1)).unwrap();
        return;
    }
    panic!(
        "ARCHITECTURE.md's layer picture is not the daemon's (AIRLOCK_BLESS=1 cargo test -p \
         airlock-modgraph writes it):\n{block}"
    );
}

#[test]
fn this_crate_is_members_of_the_workspace() {
    assert!(members().iter().any(|m| m == "modgraph"), "{:?}", members());
}
