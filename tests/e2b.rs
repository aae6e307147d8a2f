//! System tests of the E2B gateway through a live airlockd, in real VMs. The unchanged `e2b`
//! SDK from PyPI, at two pinned versions (the newest and an older 2.x, each in a venv of its
//! own made by `tests/e2b/venv.sh`; the older one the calls whose requests differ between
//! versions), runs `tests/e2b/test_sdk.py` with only E2B_API_KEY,
//! E2B_API_URL and E2B_SANDBOX_URL set: create, commands (streamed output, background, wait,
//! kill, stdin, exit codes), files, timeouts, list by metadata, kill, the async client; the
//! `e2b` npm package (Node.js) runs the same scenario (`tests/e2b/js/scenario.mjs`). A raw
//! HTTP scenario checks what the SDK never shows: refusals, the host-name route, the errors'
//! JSON shape, and that what the gateway does is the daemon's (the tenant's gRPC client sees
//! its sandboxes, the audit trail its file writes).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use airlock_api::v1::{ListAuditEventsRequest, ListSandboxesRequest, SandboxState};
use airlock_system_tests::harness::http_exchange;
use airlock_system_tests::shared::{Shared, scenario};

/// Shaped as E2B's SDKs want an API key (`e2b_` and hex digits: newer SDKs refuse others).
const KEY: &str = "e2b_7e57ac3e0123456789abcdef0123456789abcdef";
const DOMAIN: &str = "e2b.test";

/// The gateway's port: fixed per test process (the shared daemon's settings are made once).
fn port() -> u16 {
    static PORT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *PORT.get_or_init(|| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port()
    })
}

fn config() -> String {
    format!(
        "pool_size = 2\n[tenants.acme]\ntokens = [\"{KEY}\"]\n\
         [e2b]\nlisten = \"127.0.0.1:{}\"\ndomain = \"{DOMAIN}\"\n",
        port()
    )
}

async fn shared() -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    let (guard, s) = scenario(&config()).await;
    airlock_system_tests::harness::wait_tcp_listening(port(), &s.log);
    s.clean(&[KEY]).await;
    (guard, s)
}

/// The tenant's live sandboxes, by its gRPC client.
async fn live(s: &Shared) -> Vec<airlock_api::v1::Sandbox> {
    let mut c = s.client(Some(KEY)).await;
    c.list_sandboxes(ListSandboxesRequest {
        states: vec![
            SandboxState::Starting as i32,
            SandboxState::Running as i32,
            SandboxState::Paused as i32,
        ],
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .sandboxes
}

/// Runs an installer script; the last line it prints (what it installed).
fn install(script: &Path, args: &[&str], what: &str) -> String {
    let out = Command::new(script).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{} ({what}) failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.trim().lines().last().unwrap().to_owned()
}

/// Runs an E2B client program pointed at the gateway by its settings only; its output, after
/// it succeeded and left no sandbox of the tenant behind.
async fn run_client(s: &Shared, mut cmd: Command, what: &str) -> String {
    let url = format!("http://127.0.0.1:{}", port());
    cmd.env("E2B_API_KEY", KEY)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    let t0 = Instant::now();
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{what}: {:?}\n{text}", t0.elapsed());
    assert!(
        out.status.success(),
        "{what} failed:\n{text}\ndaemon log:\n{}",
        s.log_tail()
    );
    // Whatever the client made, it killed (or its timeout ended).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !live(s).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(live(s).await, vec![], "sandboxes left behind");
    text
}

/// Runs the SDK's tests with `version` of the `e2b` package (only those `select` names, as
/// pytest's `-k`, when given).
async fn run_sdk(version: &str, select: Option<&str>) {
    let (_guard, s) = shared().await;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b");
    let python = install(&here.join("venv.sh"), &[version], "the SDK from PyPI");
    let mut pytest = Command::new(python);
    pytest
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",
        ])
        .arg(here.join("test_sdk.py"));
    if let Some(k) = select {
        pytest.args(["-k", k]);
    }
    run_client(s, pytest, &format!("the e2b {version} SDK's tests")).await;
}

/// Every test of `e2b/test_sdk.py` (`E2B_SELECT=EXPR`: only those pytest's `-k EXPR` selects,
/// for a quicker look at one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newest_python_sdk_runs_unchanged() {
    run_sdk("2.63.0", std::env::var("E2B_SELECT").ok().as_deref()).await;
}

/// The older SDK runs the flow whose requests differ between versions (create and connect, by
/// id and after a pause, where 2.20 presents the access token alone; commands streamed, in the
/// background, followed and killed; files; list, timeout, kill; the async client); the newest
/// runs every test, and the guest work of the rest would be the same commands again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_python_sdk_runs_unchanged() {
    run_sdk("2.20.0", Some(OLDER_SDK_TESTS)).await;
}

/// The tests of `e2b/test_sdk.py` the older SDK runs (a pytest `-k` expression).
const OLDER_SDK_TESTS: &str = "create_returns or streams_stdout or listed_and_killed or \
     connect_follows or files_write_read or connect_by_id or pause_then_connect or \
     list_by_metadata or set_timeout or async_client";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_sdk_runs_unchanged() {
    let (_guard, s) = shared().await;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b/js");
    let modules = install(
        &here.join("install.sh"),
        &[],
        "the e2b npm package; Node.js >= 20.18",
    );
    // ES modules resolve packages next to the script: run it from a directory beside them.
    let dir = s.dir.join("e2b-js");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(&modules, dir.join("node_modules")).unwrap();
    std::fs::copy(here.join("scenario.mjs"), dir.join("scenario.mjs")).unwrap();
    let mut node = Command::new("node");
    node.arg(dir.join("scenario.mjs"));
    let text = run_client(s, node, "the e2b npm package's scenario").await;
    assert!(
        text.contains("\nok"),
        "the scenario did not finish:\n{text}"
    );
}

/// An HTTP/1.1 exchange with the gateway: the status, the headers (lowercase names) and the body.
fn http(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String, String) {
    let s = std::net::TcpStream::connect(("127.0.0.1", port())).unwrap();
    let r = http_exchange(s, method, path, headers, body);
    let text = r.text();
    (r.status, r.head, text)
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_authenticates_routes_by_host_and_is_the_daemon_underneath() {
    let (_guard, s) = shared().await;
    let key = [("X-API-Key", KEY)];
    // No key, a wrong key: 401 in E2B's error shape, never retried.
    let (st, head, body) = http("POST", "/v2/sandboxes", &[], b"{}");
    assert_eq!(st, 401, "{body}");
    assert_eq!(json(&body)["code"], 401);
    assert!(head.contains("should-retry: false"), "{head}");
    let (st, _, _) = http("GET", "/v2/sandboxes", &[("X-API-Key", "nope")], b"");
    assert_eq!(st, 401);
    // A template that does not exist: 404 naming it.
    let body_missing = br#"{"templateID":"no-such-template"}"#;
    let (st, _, body) = http("POST", "/v2/sandboxes", &key, body_missing);
    assert_eq!(st, 404, "{body}");
    assert!(
        json(&body)["message"]
            .as_str()
            .unwrap()
            .contains("no-such-template")
    );
    // A malformed body: 400, JSON.
    let (st, _, body) = http("POST", "/v2/sandboxes", &key, b"{not json");
    assert_eq!((st, json(&body)["code"].as_u64()), (400, Some(400)));

    // Create: 201, the sandbox the tenant's gRPC client sees, its metadata as labels.
    let create = br#"{"templateID":"base","timeout":300,"metadata":{"owner":"raw-http"},"envVars":{"X":"1"}}"#;
    let (st, _, body) = http("POST", "/v2/sandboxes", &key, create);
    assert_eq!(st, 201, "{body}");
    let made = json(&body);
    let id = made["sandboxID"].as_str().unwrap().to_owned();
    let token = made["envdAccessToken"].as_str().unwrap().to_owned();
    assert_eq!(made["domain"], DOMAIN);
    let seen = live(s).await;
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].id, id);
    assert_eq!(
        seen[0].labels.get("owner").map(String::as_str),
        Some("raw-http")
    );
    // Another tenant (the default one) does not see it through its key... it has none: the
    // gateway refuses, and the default tenant's gRPC list does not show it.
    let mut def = s.client(None).await;
    let others = def
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert!(others.iter().all(|o| o.id != id));

    // envd: by the E2b-Sandbox-Id header, by the host name, by the token alone.
    let by_header = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", token.as_str()),
    ];
    assert_eq!(http("GET", "/health", &by_header, b"").0, 204);
    let host = format!("49983-{id}.{DOMAIN}:{}", port());
    let by_host = [("Host", host.as_str()), ("X-Access-Token", token.as_str())];
    assert_eq!(http("GET", "/health", &by_host, b"").0, 204);
    assert_eq!(
        http("GET", "/health", &[("X-Access-Token", token.as_str())], b"").0,
        204
    );
    // A wrong token, no token, no sandbox named: refused.
    let wrong = [("E2b-Sandbox-Id", id.as_str()), ("X-Access-Token", "00ff")];
    assert_eq!(http("GET", "/health", &wrong, b"").0, 401);
    assert_eq!(
        http("GET", "/health", &[("E2b-Sandbox-Id", id.as_str())], b"").0,
        401
    );
    assert_eq!(http("GET", "/health", &[], b"").0, 400);

    // An upload (raw body) and a download; the audit trail has the write, by the tenant.
    let up = "/files?path=%2Fhome%2Fuser%2Fraw.txt";
    let (st, _, body) = http("POST", up, &by_header, b"raw upload");
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        json(&body),
        serde_json::json!([{"name": "raw.txt", "type": "file", "path": "/home/user/raw.txt"}])
    );
    let (st, _, body) = http("GET", up, &by_host, b"");
    assert_eq!((st, body.as_str()), (200, "raw upload"));
    let (st, _, body) = http("GET", "/files?path=/home/user/missing", &by_header, b"");
    assert_eq!(st, 404, "{body}");
    assert!(
        json(&body)["message"]
            .as_str()
            .unwrap()
            .contains("does not exist")
    );
    let mut c = s.client(Some(KEY)).await;
    let events = c
        .list_audit_events(ListAuditEventsRequest {
            sandbox_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert!(
        events
            .iter()
            .any(|e| e.kind == "file.write" && e.detail_json.contains("/home/user/raw.txt")),
        "{events:?}"
    );
    // An unserved envd method answers 501 (unimplemented), not 404 (which SDKs read as "no
    // such file").
    let (st, _, _) = http(
        "POST",
        "/filesystem.Filesystem/CreateWatcher",
        &[
            by_header[0],
            by_header[1],
            ("Content-Type", "application/json"),
        ],
        br#"{"path":"/tmp"}"#,
    );
    assert_eq!(st, 501);

    // Kill: 204; then envd says the sandbox is gone, and a second kill is a 404 in E2B's shape.
    assert_eq!(
        http("DELETE", &format!("/sandboxes/{id}"), &key, b"").0,
        204
    );
    let (st, _, body) = http("GET", "/health", &by_header, b"");
    assert_eq!(st, 502);
    assert!(body.contains("was not found"), "{body}");
    let (st, _, body) = http("DELETE", &format!("/sandboxes/{id}"), &key, b"");
    assert_eq!((st, json(&body)["code"].as_u64()), (404, Some(404)));
    assert!(live(s).await.is_empty());
}
