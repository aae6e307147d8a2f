//! System test of cluster mode: three `airlockd` nodes ("a", "b", "c") coordinated through a
//! three-member etcd cluster, all on this host, with real VMs, driven through the real gRPC
//! client over each node's TCP listener with tenant tokens. One cluster per test process
//! (`cluster/nodes.rs`), shared by the scenarios, run one at a time; each scenario starts
//! with the cluster whole and empty, and leaves it whole.
//!
//! Guest commands take seconds on the nested-KVM build machines (process start is emulated):
//! the scenarios run few of them.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

#[path = "cluster/etcd.rs"]
mod etcd;
#[path = "cluster/nodes.rs"]
mod nodes;
#[path = "cluster/procs.rs"]
mod procs;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{Client, execution_with_output, read_all, reason, run, shell};
use airlock_system_tests::step;
use nodes::{CAPPED_MAX, CAPPED_TOKEN, Cluster, LEASE_TTL_S, NAMES, TOKEN, scenario, wait_nodes};
use tonic::Code;

/// Creates a sandbox of the default template through `c`; a failure shows every node's log.
async fn create(k: &Cluster, c: &mut Client, via: &str) -> Sandbox {
    let s = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap_or_else(|e| panic!("create through {via}: {e:?}\n{}", k.logs()))
        .into_inner();
    assert!(
        NAMES.contains(&s.node.as_str()),
        "a sandbox created through {via} names no node of the cluster: {s:?}"
    );
    s
}

async fn destroy(c: &mut Client, id: &str) -> bool {
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("destroy {id}: {e:?}"))
    .into_inner()
    .destroyed
}

async fn get(c: &mut Client, id: &str) -> Sandbox {
    c.get_sandbox(GetSandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("get {id}: {e:?}"))
    .into_inner()
}

/// GetSandbox through `c` until `done` holds for the answer (calls that fail UNAVAILABLE, as
/// those forwarded to a node that is down, count as not yet); `None` after `within`, with the
/// last answer printed.
async fn get_until(
    c: &mut Client,
    id: &str,
    within: Duration,
    done: impl Fn(&Sandbox) -> bool,
) -> Option<Sandbox> {
    let deadline = Instant::now() + within;
    loop {
        let got = c
            .get_sandbox(GetSandboxRequest {
                sandbox_id: id.into(),
            })
            .await
            .map(tonic::Response::into_inner);
        match &got {
            Ok(s) if done(s) => return Some(s.clone()),
            Ok(_) => {}
            Err(e) => assert_eq!(e.code(), Code::Unavailable, "GetSandbox {id}: {e:?}"),
        }
        if Instant::now() >= deadline {
            eprintln!("GetSandbox {id}, the last answer: {got:?}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn live_ids(c: &mut Client) -> Vec<String> {
    c.list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .into_iter()
        .map(|s| s.id)
        .collect()
}

async fn list_nodes(c: &mut Client) -> Vec<Node> {
    c.list_nodes(ListNodesRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes
}

/// Runs `echo WORD` in `sandbox` through `c` and checks its output and exit.
async fn echo(k: &Cluster, c: &mut Client, sandbox: &str, word: &str) {
    let (out, err, rec) = run(c, sandbox, &["echo", word]).await;
    assert_eq!(
        (out.as_str(), rec.exit_code),
        (format!("{word}\n").as_str(), 0),
        "echo in {sandbox}: stderr {err:?}, {rec:?}\n{}",
        k.logs()
    );
}

/// Whether the template `base` is among a node's templates ("OWNER/NAME").
fn holds_base(n: &Node) -> bool {
    n.templates
        .iter()
        .any(|t| t == "base" || t.ends_with("/base"))
}

/// Creates through `c` until a sandbox lands on `node` (spread: three creates cover the three
/// nodes), destroys the others, and returns it.
async fn create_on(k: &Cluster, c: &mut Client, via: &str, node: &str) -> Sandbox {
    let mut others = Vec::new();
    let mut found = None;
    for _ in 0..NAMES.len() + 1 {
        let s = create(k, c, via).await;
        if s.node == node {
            found = Some(s);
            break;
        }
        others.push(s);
    }
    for s in &others {
        destroy(c, &s.id).await;
    }
    found.unwrap_or_else(|| {
        panic!(
            "{} creates through {via} (spread), none on node {node}: {:?}",
            others.len(),
            others.iter().map(|s| &s.node).collect::<Vec<_>>()
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn creates_spread_across_nodes_and_templates_are_fetched() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let mut ca = k.node("a").client(TOKEN).await;
    // Node a has the template from its start; b and c fetch it on their first create (in the
    // first scenario that places a sandbox on them).
    let at_start = list_nodes(&mut ca).await;
    assert_eq!(at_start.len(), 3, "{at_start:?}");
    let mut created = Vec::new();
    for _ in 0..3 {
        created.push(create(k, &mut ca, "a").await);
    }
    step("3 creates through a", &mut t);
    let on: BTreeSet<&str> = created.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(
        on,
        NAMES.into_iter().collect(),
        "spread: three creates on three nodes: {:?}\n{}",
        created.iter().map(|s| (&s.id, &s.node)).collect::<Vec<_>>(),
        k.logs()
    );
    // Each id carries its node's tag.
    let tags: HashMap<String, String> = at_start
        .iter()
        .map(|n| (n.name.clone(), n.tag.clone()))
        .collect();
    for s in &created {
        let tag = &tags[&s.node];
        assert_eq!(tag.len(), 4, "a node's tag is 4 hex digits: {at_start:?}");
        assert!(
            s.id.starts_with(&format!("sb-{tag}")),
            "{} runs on {} (tag {tag})",
            s.id,
            s.node
        );
        assert_eq!(s.state, SandboxState::Running as i32, "{s:?}");
        // A node that fetched the template holds it under an id of its own.
        assert_eq!(s.template, k.template().name, "{s:?}");
        if s.node == "a" {
            assert_eq!(s.template_id, k.template().id, "{s:?}");
        }
    }
    for s in &created {
        echo(k, &mut ca, &s.id, &format!("hello-from-{}", s.node)).await;
    }
    step("an echo in each (through a)", &mut t);
    // Every node lists the three nodes; b and c hold the template now.
    for n in &k.nodes {
        let mut c = n.client(TOKEN).await;
        let listed = list_nodes(&mut c).await;
        let names: BTreeSet<&str> = listed.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, NAMES.into_iter().collect(), "through {}", n.name);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = list_nodes(&mut ca).await;
        if listed.iter().all(holds_base) {
            for n in &listed {
                assert_eq!(n.sandboxes, 1, "{n:?}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "b and c do not list the template 10 s after their creates: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for s in &created {
        assert!(destroy(&mut ca, &s.id).await);
    }
    step("listed and destroyed", &mut t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_call_works_through_any_node() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let mut ca = k.node("a").client(TOKEN).await;
    let mut cb = k.node("b").client(TOKEN).await;
    let mut cc = k.node("c").client(TOKEN).await;
    let s = create_on(k, &mut ca, "a", "b").await;
    step("a sandbox on b", &mut t);
    // Everything below goes through node c.
    let got = get(&mut cc, &s.id).await;
    assert_eq!(
        (got.node.as_str(), got.state),
        ("b", SandboxState::Running as i32),
        "{got:?}"
    );
    let (out, _, rec) = run(
        &mut cc,
        &s.id,
        &["sh", "-c", "echo out-$((6*7)); echo err >&2"],
    )
    .await;
    assert_eq!((out.as_str(), rec.exit_code), ("out-42\n", 0), "{rec:?}");
    let stored = execution_with_output(&mut cc, &rec.id).await;
    assert_eq!(String::from_utf8_lossy(&stored.stdout), "out-42\n");
    assert_eq!(String::from_utf8_lossy(&stored.stderr), "err\n");
    let stored = stored.execution.unwrap();
    assert_eq!(
        (stored.state, stored.sandbox_id.as_str()),
        (ExecutionState::Exited as i32, s.id.as_str()),
        "{stored:?}"
    );
    step("exec, stream and get through c", &mut t);
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let msgs = vec![
        WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: s.id.clone(),
                path: "/tmp/cluster/data.bin".into(),
                mode: 0o600,
                ..Default::default()
            })),
        },
        WriteFileRequest {
            part: Some(write_file_request::Part::Data(data[..100_000].to_vec())),
        },
        WriteFileRequest {
            part: Some(write_file_request::Part::Data(data[100_000..].to_vec())),
        },
    ];
    let written = cc
        .write_file(tokio_stream::iter(msgs))
        .await
        .unwrap_or_else(|e| panic!("write through c: {e:?}\n{}", k.logs()))
        .into_inner();
    assert_eq!(written.bytes_written, data.len() as u64);
    let back = read_all(&mut cc, &s.id, "/tmp/cluster/data.bin").await;
    assert!(
        back == data,
        "read back {} bytes of {}",
        back.len(),
        data.len()
    );
    let listing = cc
        .list_files(ListFilesRequest {
            sandbox_id: s.id.clone(),
            path: "/tmp/cluster".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        listing
            .entries
            .iter()
            .any(|e| e.name == "data.bin" && e.size == data.len() as u64),
        "{listing:?}"
    );
    step("write, read and list files through c", &mut t);
    let paused = cc
        .pause_sandbox(PauseSandboxRequest {
            sandbox_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.state, SandboxState::Paused as i32);
    assert_eq!(get(&mut ca, &s.id).await.state, SandboxState::Paused as i32);
    let resumed = cc
        .resume_sandbox(ResumeSandboxRequest {
            sandbox_id: s.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resumed.state, SandboxState::Running as i32);
    let long = cc
        .exec(shell(&s.id, "sleep 60", 0))
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed = cc
        .kill_execution(KillExecutionRequest {
            execution_id: long.execution_id.clone(),
            signal: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(killed.signalled);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = execution_with_output(&mut cc, &long.execution_id).await;
        let rec = r.execution.unwrap();
        if rec.state != ExecutionState::Running as i32 {
            assert_eq!(rec.state, ExecutionState::Killed as i32, "{rec:?}");
            break;
        }
        assert!(Instant::now() < deadline, "sleep 60 still runs: {rec:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    step("pause, resume, kill through c", &mut t);
    // Lists gather from every node: the sandbox once, the template from b.
    let ids = live_ids(&mut ca).await;
    assert_eq!(
        ids.iter().filter(|i| **i == s.id).count(),
        1,
        "ListSandboxes through a: {ids:?}"
    );
    let templates = cb
        .list_templates(ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates;
    assert!(
        templates.iter().any(|t| t.name == "base"),
        "ListTemplates through b: {templates:?}"
    );
    assert!(destroy(&mut cc, &s.id).await);
    assert_eq!(
        get(&mut ca, &s.id).await.state,
        SandboxState::Destroyed as i32
    );
    assert!(!live_ids(&mut ca).await.contains(&s.id));
    step("listed and destroyed through c", &mut t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_quota_holds_across_nodes() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let mut clients = Vec::new();
    for n in &k.nodes {
        clients.push(n.client(CAPPED_TOKEN).await);
    }
    // Both through node a, whose placement counts the first at once (another node would
    // see it in a's record within a second).
    let first = create(k, &mut clients[0], "a").await;
    let second = create(k, &mut clients[0], "a").await;
    assert_ne!(
        first.node, second.node,
        "spread: the second create on another node"
    );
    assert_eq!(CAPPED_MAX, 2);
    let third = NAMES
        .iter()
        .position(|n| *n != first.node && *n != second.node)
        .unwrap();
    let refused = clients[third]
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("a third sandbox over a quota of 2");
    assert_eq!(
        reason(&refused).0,
        "QUOTA_EXCEEDED",
        "through {}: {refused:?}",
        NAMES[third]
    );
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    step("2 creates, the third refused", &mut t);
    assert!(destroy(&mut clients[third], &first.id).await);
    let again = create(k, &mut clients[third], NAMES[third]).await;
    assert!(destroy(&mut clients[0], &second.id).await);
    assert!(destroy(&mut clients[1], &again.id).await);
    step("one destroyed, a create again", &mut t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_one_etcd_member_changes_nothing() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    // The first member: every node's first endpoint.
    k.etcd.kill(0);
    step("etcd member m0 killed", &mut t);
    for n in &k.nodes {
        let mut c = n.client(TOKEN).await;
        let s = create(k, &mut c, n.name).await;
        echo(k, &mut c, &s.id, &format!("via-{}", n.name)).await;
        let ids = live_ids(&mut c).await;
        assert_eq!(ids, vec![s.id.clone()], "ListSandboxes through {}", n.name);
        assert!(destroy(&mut c, &s.id).await);
        step(
            &format!("create, exec, list, destroy through {}", n.name),
            &mut t,
        );
    }
    let mut c = k.node("a").client(TOKEN).await;
    assert_eq!(list_nodes(&mut c).await.len(), 3);
    tokio::task::block_in_place(|| k.etcd.restart(0));
    k.etcd.put_get(0, "/airlock-test/back", "again");
    step("etcd member m0 back", &mut t);
}

/// Issue 37, item 3: someone who can write etcd (here etcdctl with a client certificate) but
/// lacks the cluster token puts node records of theirs there — one in place of node b's, one
/// of a node "mallory" — naming an address of theirs: the nodes ignore both (b writes its own
/// record again), and no call reaches that address.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_records_without_the_cluster_key_are_ignored() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let evil = format!("http://{}", trap.local_addr().unwrap());
    let mut c = k.node("a").client(TOKEN).await;
    let b = list_nodes(&mut c)
        .await
        .into_iter()
        .find(|n| n.name == "b")
        .unwrap();
    // Records as the nodes wrote them before they were signed.
    let forged = |name: &str, tag: &str| {
        serde_json::json!({
            "name": name, "tag": tag, "address": evil, "version": b.version,
            "sandboxes": 0, "max_sandboxes": 64, "committed_mib": 0,
            "capacity_mib": 1u64 << 30, "templates": [], "started_unix_ms": 1,
        })
        .to_string()
    };
    k.etcd
        .ctl_ok(0, &["put", "/airlock/nodes/b", &forged("b", &b.tag)]);
    k.etcd.ctl_ok(
        0,
        &["put", "/airlock/nodes/mallory", &forged("mallory", "0bad")],
    );
    step("forged records of b and mallory put in etcd", &mut t);
    // Four membership rounds: the forged b (started at 1 ms) is never listed, mallory never
    // at all (ListNodes shows tenants no addresses).
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let nodes = list_nodes(&mut c).await;
        assert!(
            nodes
                .iter()
                .all(|n| n.started_unix_ms != 1 && n.name != "mallory"),
            "{nodes:?}"
        );
        // Gathered from every node the caller's node believes in.
        live_ids(&mut c).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let names = wait_nodes(&mut c, 3, Duration::from_secs(10)).await;
    assert_eq!(names, ["a", "b", "c"], "b wrote its record again");
    let called = trap.accept();
    assert!(called.is_err(), "a node called the forged address");
    k.etcd.ctl_ok(0, &["del", "/airlock/nodes/mallory"]);
    step(
        "ignored; b's own record back; nothing called the forged address",
        &mut t,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_node_is_reported_and_reconciles_when_it_returns() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let mut ca = k.node("a").client(TOKEN).await;
    let mut cc = k.node("c").client(TOKEN).await;
    let s = create_on(k, &mut cc, "c", "c").await;
    let vmm = s.vmm_pid;
    step("a sandbox on c", &mut t);
    k.node("c").kill();
    let killed = Instant::now();
    // Within the lease's TTL (and some slack for a slow host), the others report it lost.
    let within = Duration::from_secs(LEASE_TTL_S + 12);
    // Until the lease expires, calls forwarded to c fail (UNAVAILABLE).
    let lost = get_until(&mut ca, &s.id, within, |g| {
        g.state == SandboxState::Dead as i32
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "{} is not reported lost {within:?} after its node died\n{}",
            s.id,
            k.logs()
        )
    });
    eprintln!(
        "reported lost {:.1} s after the kill",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(
        (lost.end_reason.as_str(), lost.node.as_str()),
        ("NODE_LOST", "c"),
        "{lost:?}"
    );
    assert!(
        airlock_system_tests::harness::alive(vmm),
        "its VMM runs on: only the daemon died"
    );
    let refused = ca
        .exec(shell(&s.id, "true", 0))
        .await
        .expect_err("exec on a lost node's sandbox");
    assert_eq!(reason(&refused).0, "NODE_LOST", "{refused:?}");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    let names = wait_nodes(&mut ca, 2, Duration::from_secs(5)).await;
    assert_eq!(names, ["a", "b"], "ListNodes through a");
    step("reported lost through a", &mut t);
    let mut placed = Vec::new();
    for _ in 0..3 {
        placed.push(create(k, &mut ca, "a").await);
    }
    for p in &placed {
        assert!(
            p.node == "a" || p.node == "b",
            "a create placed on a lost node: {p:?}"
        );
        destroy(&mut ca, &p.id).await;
    }
    step("3 creates on a and b", &mut t);
    tokio::task::block_in_place(|| k.node("c").start());
    step("node c started again", &mut t);
    let back = get_until(&mut ca, &s.id, Duration::from_secs(60), |g| {
        g.state == SandboxState::Running as i32 && g.node == "c"
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "{} is not RUNNING on c 60 s after c came back\n{}",
            s.id,
            k.logs()
        )
    });
    assert_eq!(back.vmm_pid, vmm, "the same VMM, adopted");
    step("RUNNING on c again, through a", &mut t);
    echo(k, &mut ca, &s.id, "back").await;
    let mut cb = k.node("b").client(TOKEN).await;
    let ids = live_ids(&mut cb).await;
    assert_eq!(
        ids.iter().filter(|i| **i == s.id).count(),
        1,
        "ListSandboxes through b: {ids:?}"
    );
    let names = wait_nodes(&mut cb, 3, Duration::from_secs(10)).await;
    assert_eq!(names, NAMES, "ListNodes through b");
    assert!(destroy(&mut cb, &s.id).await);
    step("exec, list and destroy after the return", &mut t);
}

/// The Python SDK of this checkout (its cached venv, made by `sdk/python/venv.sh`).
fn sdk_python() -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../sdk/python/venv.sh");
    let out = std::process::Command::new(script)
        .output()
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned()
}

/// What the Python SDK does through three nodes: the script below, as a user writes it.
const SDK_SCRIPT: &str = r#"
import sys, airlock
a, c, token = sys.argv[1], sys.argv[2], sys.argv[3]
names = set(sys.argv[4].split(","))
ca, cc = airlock.Client(a, token), airlock.Client(c, token)
assert {n.name for n in cc.nodes()} == names, cc.nodes()
sb = ca.sandboxes.create(labels={"via": "sdk"})
assert sb.node in names, sb.node
seen = cc.sandboxes.get(sb.id)
assert (seen.node, seen.state) == (sb.node, "running"), (seen.node, seen.state)
r = seen.exec(["echo", "through-" + sb.node])
assert (r.stdout, r.exit_code) == ("through-" + sb.node + "\n", 0), r
assert [s.id for s in cc.sandboxes.list(labels={"via": "sdk"})] == [sb.id]
assert cc.sandboxes.get(sb.id).destroy()
try:
    ca.sandboxes.get("sb-" + "f" * 16).exec(["true"])
    raise SystemExit("an unknown sandbox was found")
except airlock.SandboxNotFound:
    pass
print("sdk ok", sb.node)
"#;

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_and_the_python_sdk_see_one_service() {
    let (_serial, k) = scenario().await;
    let mut t = Instant::now();
    let names = NAMES.join(",");
    // The CLI, pointed at node b, creates; pointed at c, lists the nodes, runs and removes.
    let cli = |node: &str, args: &[&str]| {
        let out = std::process::Command::new(airlock_system_tests::binary("airlock"))
            .args(args)
            .env("AIRLOCK_ADDR", k.node(node).address())
            .env("AIRLOCK_TOKEN", TOKEN)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(
            out.status.success(),
            "airlock {args:?} through {node}: {}",
            text(&out.stderr)
        );
        text(&out.stdout)
    };
    let created: serde_json::Value =
        serde_json::from_str(&cli("b", &["--json", "create"])).unwrap();
    let (id, node) = (
        created["id"].as_str().unwrap().to_owned(),
        created["node"].as_str().unwrap().to_owned(),
    );
    assert!(NAMES.contains(&node.as_str()), "{created}");
    let listed: serde_json::Value = serde_json::from_str(&cli("c", &["--json", "nodes"])).unwrap();
    let listed: BTreeSet<_> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, NAMES.iter().map(|n| n.to_string()).collect());
    assert_eq!(cli("c", &["exec", &id, "--", "echo", "cli"]), "cli\n");
    assert!(cli("a", &["ls"]).contains(&id));
    cli("c", &["rm", &id]);
    step("the CLI through b, c and a", &mut t);
    let python = sdk_python();
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            SDK_SCRIPT,
            &k.node("a").address(),
            &k.node("c").address(),
            TOKEN,
            &names,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the SDK's script: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        k.logs()
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("sdk ok"));
    step("the Python SDK through a and c", &mut t);
}
