//! The agent's modules form no import cycle (a test only).
//!
//! Each file under `src/` is read as written: a module's edges are the modules its code names
//! with a `crate::` path (in `use` declarations or inline, grouped `crate::{a, b}` too; comment
//! lines are skipped, so doc links do not count). A `crate::` path to an item that is no module
//! is an edge to the crate root, `main`, which itself uses every module it declares. A file in
//! `src/NAME/` belongs to module `NAME`. The graph must be acyclic, so that the modules can be
//! read, and changed, from the bottom layer up (see the code map in `main.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Spelt in two pieces so that this file's own text holds no reference.
const PREFIX: &str = concat!("crate", "::");
/// The crate root.
const ROOT: &str = "main";
/// This module: test-only, and nothing uses it.
const SELF: &str = "module_graph";

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The source text of every module but this one, by module name.
fn sources() -> BTreeMap<String, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let mut text = String::new();
        if path.is_dir() {
            read_tree(&path, &mut text);
        } else if path.extension().is_some_and(|e| e == "rs") {
            text = fs::read_to_string(&path).unwrap();
        } else {
            continue;
        }
        if name != SELF {
            out.entry(name).or_insert_with(String::new).push_str(&text);
        }
    }
    out
}

/// Appends every `.rs` file under `dir` to `text`.
fn read_tree(dir: &Path, text: &mut String) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_tree(&path, text);
        } else if path.extension().is_some_and(|e| e == "rs") {
            text.push_str(&fs::read_to_string(&path).unwrap());
            text.push('\n');
        }
    }
}

/// The modules the crate root declares (`mod NAME;`).
fn declared(root: &str) -> BTreeSet<String> {
    root.lines()
        .filter_map(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';'))
        .map(str::to_owned)
        .collect()
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first path segment after each `crate::` in `text`, comment lines left out.
fn references(text: &str) -> BTreeSet<String> {
    let code: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect();
    let code = code.join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices(PREFIX) {
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let rest = &code[at + PREFIX.len()..];
        match rest.strip_prefix('{') {
            Some(group) => found.extend(group_heads(group)),
            None => {
                let head: String = rest.chars().take_while(|&c| is_ident(c)).collect();
                if !head.is_empty() {
                    found.insert(head);
                }
            }
        }
    }
    found
}

/// The first segment of each item of a `{a::B, c, d::{e, f}}` group (`group` follows the `{`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut expecting) = (1, true);
    let mut current = String::new();
    for c in group.chars() {
        if depth == 1 && expecting && is_ident(c) {
            current.push(c);
            continue;
        }
        if !current.is_empty() {
            heads.push(std::mem::take(&mut current));
            expecting = false;
        }
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => break,
            '}' => depth -= 1,
            ',' if depth == 1 => expecting = true,
            _ => {}
        }
    }
    heads
}

/// Which module uses which, as read from `sources`.
fn graph(sources: &BTreeMap<String, String>) -> Graph {
    let mut graph = Graph::new();
    for (module, text) in sources {
        let edges = if module == ROOT {
            declared(text)
        } else {
            references(text)
                .into_iter()
                .map(|head| {
                    if sources.contains_key(&head) {
                        head
                    } else {
                        ROOT.to_owned()
                    }
                })
                .collect()
        };
        let edges = edges.into_iter().filter(|m| m != module && m != SELF);
        graph.insert(module.clone(), edges.collect());
    }
    graph
}

/// A cycle of `graph` (its modules in order, the first repeated at the end), if there is one.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    fn visit(
        graph: &Graph,
        module: &str,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(module) {
            Some(Mark::Done) => return None,
            Some(Mark::Visiting) => {
                let start = path.iter().position(|m| m == module).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(module.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(module.to_owned(), Mark::Visiting);
        path.push(module.to_owned());
        for next in graph.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(graph, next, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(module.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut marks, &mut Vec::new()))
}

fn show(graph: &Graph) -> String {
    graph
        .iter()
        .map(|(m, uses)| format!("{m} -> {}", Vec::from_iter(uses.iter().cloned()).join(", ")))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_modules_form_no_import_cycle() {
    let sources = sources();
    let graph = graph(&sources);
    // Every declared module was read, and the reading finds the edges that exist.
    let mut modules: BTreeSet<String> = graph.keys().cloned().collect();
    modules.remove(ROOT);
    let mut declared = declared(&sources[ROOT]);
    declared.remove(SELF);
    assert_eq!(modules, declared);
    assert!(graph["server"].contains("agent"), "{}", show(&graph));
    assert!(graph["exec"].contains("exec_loop"), "{}", show(&graph));
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle: {}\nthe module graph:\n{}",
            cycle.join(" -> "),
            show(&graph)
        );
    }
}

#[test]
fn references_are_read_from_paths_and_groups_but_not_comments() {
    let text = [
        "//! See [`crate::doc`].",
        "use crate::a::{B, C};",
        "use crate::{b, c::{D, E}, d::F};",
        "    let x = crate::e::f(notcrate::g);",
        "    /// crate::h in a doc comment",
    ]
    .join("\n");
    let found: Vec<String> = references(&text).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "d", "e"]);
}

#[test]
fn a_cycle_is_found_and_a_layered_graph_has_none() {
    let edges = |list: &[(&str, &[&str])]| -> Graph {
        list.iter()
            .map(|(m, uses)| {
                let uses = uses.iter().map(|u| (*u).to_owned()).collect();
                ((*m).to_owned(), uses)
            })
            .collect()
    };
    let layered = edges(&[("a", &["b", "c"]), ("b", &["c"]), ("c", &[])]);
    assert_eq!(find_cycle(&layered), None);
    let cyclic = edges(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]);
    assert_eq!(
        find_cycle(&cyclic).map(|c| c.join(" -> ")).as_deref(),
        Some("a -> b -> c -> a")
    );
}
