//! `airlock nodes` against the mock: the table and the JSON records of the cluster's nodes.

use super::*;

#[tokio::test]
async fn nodes_lists_every_node_with_its_load_and_templates() {
    let d = Daemon::start();
    let p = d.airlock(&["nodes"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("NODE"), "{out}");
    assert!(
        lines[1].starts_with("node-a") && lines[1].contains("3/256"),
        "{out}"
    );
    assert!(
        lines[2].contains("3c4d") && lines[2].contains("/base"),
        "{out}"
    );
    let j = json(&d.airlock(&["--json", "nodes"]).await.stdout);
    assert_eq!(j[0]["name"], "node-a");
    assert_eq!(j[1]["tag"], "3c4d");
    assert_eq!(j[1]["address"], "http://node-b:7101");
}
