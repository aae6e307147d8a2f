//! The agent's modules form no import cycle (a test only; how the graph is read:
//! `airlock-modgraph`, which also checks every other crate of the workspace).

#[test]
fn the_modules_form_no_import_cycle() {
    let graph = airlock_modgraph::assert_acyclic(env!("CARGO_MANIFEST_DIR"), &["module_graph"]);
    // The reading finds the edges that exist.
    let show = || airlock_modgraph::show(&graph);
    assert!(graph["server"].contains("agent"), "{}", show());
    assert!(graph["exec"].contains("exec_loop"), "{}", show());
}
