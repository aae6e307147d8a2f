//! System tests of the code interpreter through a live airlockd, in real VMs of the
//! `code-interpreter` template (the image `rootfs/build.sh code-interpreter`, its kernel warmed
//! before the snapshot): the unchanged `e2b-code-interpreter` package from PyPI through the E2B
//! gateway (`e2b/test_code_interpreter.py`: state across cells, a DataFrame as HTML, a figure
//! as a PNG of its size, exceptions, contexts and restart, a timeout, JavaScript and bash, two
//! sandboxes' random numbers); `RunCode` over gRPC
//! (streamed output, a secret redacted in output and results, the audit event); Airlock's own
//! SDK and CLI.
//!
//! The template is kept across runs and built in the background of `tests/run.sh`
//! (`tests/interp.rs`).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use airlock_api::v1::{
    CodeState, CreateSandboxRequest, DestroySandboxRequest, ListAuditEventsRequest,
    ListSandboxesRequest, RunCodeRequest, Sandbox, SandboxState, Secret, SecretEnv, Template,
    run_code_event, secret,
};
use airlock_system_tests::harness::{Client, tail};
use airlock_system_tests::interp::{self, TEMPLATE};
use airlock_system_tests::shared::Shared;

/// The E2B API key of the tenant `acme` (shaped as E2B's SDKs want one: `e2b_` and hex).
const KEY: &str = "e2b_c0de1e7e0123456789abcdef0123456789abcdef";
/// The pinned clients of the E2B test (tests/e2b/venv.sh).
const E2B_VERSION: &str = "2.63.0";
const CODE_INTERPRETER: &str = "e2b-code-interpreter==2.11.5";

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

/// The shared daemon with the `code-interpreter` template (imported when an earlier run or the
/// background build of `tests/run.sh` kept it, else built and kept), one scenario at a time.
async fn setup() -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    &'static Template,
) {
    let tables = format!(
        "[tenants.acme]\ntokens = [\"{KEY}\"]\n[e2b]\nlisten = \"127.0.0.1:{}\"\n",
        port()
    );
    let (guard, s, t) = interp::shared_with_template("pool_size = 1\n", &tables).await;
    airlock_system_tests::harness::wait_tcp_listening(port(), &s.log);
    s.clean(&[KEY]).await;
    (guard, s, t)
}

/// A sandbox of the template, with `secrets`.
async fn create(c: &mut Client, s: &Shared, secrets: Vec<Secret>) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest {
        template: TEMPLATE.into(),
        secrets,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
    .into_inner()
}

async fn destroy(c: &mut Client, id: &str) {
    let _ = c
        .destroy_sandbox(DestroySandboxRequest {
            sandbox_id: id.into(),
        })
        .await;
}

/// What a cell streamed: its events in order, as (kind, text) pairs, and its end.
#[derive(Debug, Default)]
struct Cell {
    events: Vec<(&'static str, String)>,
    results: Vec<airlock_api::v1::CodeResult>,
    end: Option<airlock_api::v1::CodeEnd>,
}

async fn run_code(c: &mut Client, req: RunCodeRequest) -> Cell {
    let mut stream = c.run_code(req).await.unwrap().into_inner();
    let mut cell = Cell::default();
    while let Some(ev) = stream.message().await.unwrap() {
        match ev.event.unwrap() {
            run_code_event::Event::Stdout(o) => cell.events.push(("stdout", o.text)),
            run_code_event::Event::Stderr(o) => cell.events.push(("stderr", o.text)),
            run_code_event::Event::Result(r) => {
                cell.events.push(("result", format!("{:?}", r.data)));
                cell.results.push(r);
            }
            run_code_event::Event::Error(e) => cell
                .events
                .push(("error", format!("{}: {}\n{}", e.name, e.value, e.traceback))),
            run_code_event::Event::End(e) => cell.end = Some(e),
        }
    }
    cell
}

fn cell(sandbox: &str, code: &str) -> RunCodeRequest {
    RunCodeRequest {
        sandbox_id: sandbox.into(),
        code: code.into(),
        timeout_ms: 240_000,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_code_interpreter_package_runs_unchanged() {
    let (_guard, s, _) = setup().await;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b");
    let out = Command::new(here.join("venv.sh"))
        .args([E2B_VERSION, CODE_INTERPRETER])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tests/e2b/venv.sh (the pinned e2b and e2b-code-interpreter from PyPI) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let python = String::from_utf8(out.stdout).unwrap();
    let python = python.trim().lines().last().unwrap();
    let url = format!("http://127.0.0.1:{}", port());
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
        .arg(here.join("test_code_interpreter.py"))
        .env("E2B_API_KEY", KEY)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    if let Ok(k) = std::env::var("E2B_SELECT") {
        pytest.args(["-k", &k]);
    }
    let t0 = Instant::now();
    let out = tokio::task::spawn_blocking(move || pytest.output().unwrap())
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("the e2b-code-interpreter tests: {:?}\n{text}", t0.elapsed());
    assert!(
        out.status.success(),
        "the e2b-code-interpreter tests failed:\n{text}\ndaemon log:\n{}",
        s.log_tail()
    );
    // Whatever the client made, it killed.
    let mut c = s.client(Some(KEY)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let live = c
            .list_sandboxes(ListSandboxesRequest {
                states: vec![SandboxState::Running as i32, SandboxState::Starting as i32],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .sandboxes;
        if live.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "sandboxes left behind: {live:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Output streams before the cell ends; a secret's value is replaced in stdout, in a result
/// and in an error; each cell is one `code.run` event in the audit trail, without its code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_code_streams_redacts_secrets_and_is_audited() {
    let (_guard, s, _) = setup().await;
    let mut c = s.client(None).await;
    const VALUE: &str = "interp-secret-9f8e7d6c5b4a";
    let sb = create(
        &mut c,
        s,
        vec![Secret {
            name: "API_TOKEN".into(),
            value: VALUE.into(),
            delivery: Some(secret::Delivery::Env(SecretEnv::default())),
            ttl_s: 0,
        }],
    )
    .await;
    let t0 = Instant::now();
    let got = run_code(
        &mut c,
        cell(
            &sb.id,
            "import os, time\nprint('first', flush=True)\ntime.sleep(3)\n\
             print(os.environ['API_TOKEN'])\nos.environ['API_TOKEN']",
        ),
    )
    .await;
    let end = got.end.clone().expect("an end event");
    assert_eq!(end.state(), CodeState::Ok, "{got:?}\n{}", tail(&s.log));
    let all = format!("{got:?}");
    assert!(!all.contains(VALUE), "the secret came back: {all}");
    let stdout: String = got
        .events
        .iter()
        .filter(|(k, _)| *k == "stdout")
        .map(|(_, t)| t.as_str())
        .collect();
    assert_eq!(stdout, "first\n[REDACTED:API_TOKEN]\n");
    let main = got.results.iter().find(|r| r.is_main_result).unwrap();
    // (The value's quoted repr is one of its encoded forms: the quotes may go with it.)
    let text = &main.data["text/plain"];
    assert!(text.contains("[REDACTED:API_TOKEN]"), "{text}");
    // The first line came as its own event, before the rest (the cell slept between them).
    assert_eq!(got.events[0], ("stdout", "first\n".to_owned()), "{got:?}");

    let err = run_code(
        &mut c,
        cell(&sb.id, "raise ValueError(os.environ['API_TOKEN'])"),
    )
    .await;
    assert_eq!(err.end.as_ref().unwrap().state(), CodeState::Error);
    let shown = format!("{err:?}");
    assert!(
        shown.contains("ValueError: [REDACTED:API_TOKEN]") && !shown.contains(VALUE),
        "{shown}"
    );
    eprintln!("two cells: {:?}", t0.elapsed());

    let events = c
        .list_audit_events(ListAuditEventsRequest {
            kinds: vec!["code.run".into()],
            sandbox_id: sb.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert_eq!(events.len(), 2, "{events:?}");
    let detail: serde_json::Value = serde_json::from_str(&events[0].detail_json).unwrap();
    assert_eq!(detail["language"], "python", "{detail}");
    assert_eq!(detail["state"], "CODE_STATE_OK", "{detail}");
    assert!(
        !events[0].detail_json.contains("time.sleep"),
        "the code itself is not recorded: {detail}"
    );
    destroy(&mut c, &sb.id).await;
}

/// Airlock's Python SDK returns the same rich results (`sandbox.run_code`), and the CLI's
/// `run-code` prints the text results and saves a figure as a PNG file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_and_the_cli_return_rich_results() {
    let (_guard, s, _) = setup().await;
    let mut c = s.client(None).await;
    let sb = create(&mut c, s, vec![]).await;
    let address = format!("unix://{}", s.socket.display());

    let python = std::env::var("AIRLOCK_SDK_PYTHON").unwrap_or_else(|_| {
        panic!("AIRLOCK_SDK_PYTHON is not set: make the SDK's venv with `sdk/python/venv.sh`")
    });
    let script = r#"
import base64, struct, sys
from airlock import Client
client = Client(address=sys.argv[1])
sb = client.sandboxes.get(sys.argv[2])
seen = []
ex = sb.run_code("y = 20\nprint('from the sdk')\ny + 1", on_stdout=seen.append, timeout=240)
assert ex.text == "21", ex
assert [m.line for m in seen] == ["from the sdk\n"], seen
ex = sb.run_code("import pandas as pd\npd.DataFrame({'k': [1]})", timeout=240)
assert "<table" in ex.results[0].html, ex.results
assert "<table" in ex.results[0]._repr_html_()
ex = sb.run_code("import matplotlib.pyplot as plt\nplt.figure(figsize=(2, 1), dpi=100)\nplt.plot([0, 1])\nplt.show()", timeout=240)
png = base64.b64decode(next(r.png for r in ex.results if r.png))
assert struct.unpack(">II", png[16:24]) == (200, 100)
ex = sb.run_code("{}['missing']", timeout=240)
assert ex.error.name == "KeyError", ex
ctx = sb.create_code_context(language="bash")
ex = sb.run_code("echo ${y:-unset} $((6 * 7))", context=ctx, timeout=240)
assert ex.logs.stdout == ["unset 42\n"], ex
sb.remove_code_context(ctx)
print("sdk ok")
"#;
    let out = Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(&address)
        .arg(&sb.id)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("sdk ok"),
        "the SDK's cells:\n{text}\n{}",
        s.log_tail()
    );

    // The CLI: text results on stdout, the figure saved as result-1.png, exit 1 on an error.
    let dir = s.dir.join("run-code");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cell_file = dir.join("plot.py");
    std::fs::write(
        &cell_file,
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(3, 2), dpi=100)\n\
         plt.bar(['a', 'b'], [3, 5])\nplt.show()\n'done'\n",
    )
    .unwrap();
    let cli = |args: &[&str]| {
        Command::new(airlock_system_tests::binary("airlock"))
            .env("AIRLOCK_ADDR", &address)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(&[
        "run-code",
        &sb.id,
        cell_file.to_str().unwrap(),
        "--out-dir",
        dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        // (a string's text comes without its quotes, as E2B's server sends it)
        out.status.success() && stdout.lines().any(|l| l == "done"),
        "airlock run-code: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(dir.join("result-1.png"))
        .unwrap_or_else(|e| panic!("result-1.png: {e}; the CLI printed {stdout}"));
    assert_eq!(&png[1..4], b"PNG");
    assert_eq!(
        (
            u32::from_be_bytes(png[16..20].try_into().unwrap()),
            u32::from_be_bytes(png[20..24].try_into().unwrap())
        ),
        (300, 200)
    );
    std::fs::write(&cell_file, "int('x')\n").unwrap();
    let out = cli(&["run-code", &sb.id, cell_file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ValueError"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    destroy(&mut c, &sb.id).await;
}
