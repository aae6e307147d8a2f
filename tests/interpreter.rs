//! System tests of the code interpreter in real VMs: a `code-interpreter` template built from
//! the image `rootfs/build.sh code-interpreter` makes (its Python kernel started and warmed
//! before the snapshot), then cells through RunCode: state kept between cells, rich results (a
//! DataFrame as HTML, a matplotlib figure as a PNG of the expected size), exceptions, contexts
//! (isolated, restarted), JavaScript and bash, a timeout and an out-of-memory kernel that the
//! context survives, secrets redacted from results, clones that draw different random
//! numbers; the unchanged `e2b-code-interpreter` package from PyPI through the E2B gateway; and
//! Airlock's own SDK and CLI.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use airlock_api::v1::{
    CodeContext, CodeEnd, CodeError, CodeResult, CodeState, CreateCodeContextRequest,
    CreateSandboxRequest, CreateTemplateRequest, DestroySandboxRequest, RestartCodeContextRequest,
    RunCodeRequest, Secret, SecretEnv, run_code_event::Event, secret,
};
use airlock_system_tests::harness::{self, Client};
use airlock_system_tests::shared::{Shared, scenario};
use base64::Engine as _;

/// The E2B tenant's API key, shaped as E2B's SDKs want it (`e2b_` and hex).
const KEY: &str = "e2b_5ca1ab1e0123456789abcdef00c0ffee";
const DOMAIN: &str = "e2b.test";
const TEMPLATE: &str = "code-interpreter";
const MEMORY_MIB: u32 = 1024;
const WARMUP: &str = "/usr/lib/airlock/interpreter-warmup";

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
        "[tenants.acme]\ntokens = [\"{KEY}\"]\n\
         [e2b]\nlisten = \"127.0.0.1:{}\"\ndomain = \"{DOMAIN}\"\n",
        port()
    )
}

/// The shared daemon with the `code-interpreter` template built (once per test process).
async fn shared() -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    static BUILT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    let (guard, s) = scenario(&config()).await;
    harness::wait_tcp_listening(port(), &s.log);
    s.clean(&[KEY]).await;
    BUILT.get_or_init(|| build_template(s)).await;
    (guard, s)
}

/// Builds the template from the code-interpreter image (as an operator names host files).
async fn build_template(s: &Shared) {
    let mut c = s.client(None).await;
    let t0 = Instant::now();
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: TEMPLATE.into(),
            kernel_path: airlock_system_tests::kernel().display().to_string(),
            rootfs_path: airlock_system_tests::interpreter_rootfs()
                .display()
                .to_string(),
            memory_mib: MEMORY_MIB,
            warmup: WARMUP.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("template: {e:?}\n{}", s.log_tail()))
        .into_inner();
    while let Some(ev) = events
        .message()
        .await
        .unwrap_or_else(|e| panic!("template: {e:?}\n{}", s.log_tail()))
    {
        eprintln!("[{:6.1} s] {}", t0.elapsed().as_secs_f64(), ev.message);
    }
}

async fn create(c: &mut Client, secrets: Vec<Secret>) -> String {
    c.create_sandbox(CreateSandboxRequest {
        template: TEMPLATE.into(),
        secrets,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .id
}

/// What one cell produced.
#[derive(Debug, Default)]
struct Cell {
    stdout: String,
    stderr: String,
    results: Vec<CodeResult>,
    error: Option<CodeError>,
    end: CodeEnd,
}

impl Cell {
    /// The main result's `text/plain`.
    fn text(&self) -> &str {
        self.results
            .iter()
            .find(|r| r.is_main_result)
            .and_then(|r| r.data.get("text/plain"))
            .map_or("", String::as_str)
    }

    fn state(&self) -> CodeState {
        self.end.state()
    }
}

/// Runs `code` in `context` (empty: the default python context) and collects its events.
async fn run_in(c: &mut Client, sandbox: &str, context: &str, code: &str, timeout_ms: u64) -> Cell {
    let mut events = c
        .run_code(RunCodeRequest {
            sandbox_id: sandbox.into(),
            code: code.into(),
            context_id: context.into(),
            timeout_ms,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("RunCode {code:?}: {e:?}"))
        .into_inner();
    let mut cell = Cell::default();
    while let Some(ev) = events.message().await.unwrap() {
        match ev.event {
            Some(Event::Stdout(o)) => cell.stdout.push_str(&o.text),
            Some(Event::Stderr(o)) => cell.stderr.push_str(&o.text),
            Some(Event::Result(r)) => cell.results.push(r),
            Some(Event::Error(e)) => cell.error = Some(e),
            Some(Event::End(e)) => cell.end = e,
            None => {}
        }
    }
    cell
}

async fn run(c: &mut Client, sandbox: &str, code: &str) -> Cell {
    run_in(c, sandbox, "", code, 0).await
}

async fn context(c: &mut Client, sandbox: &str, language: &str) -> CodeContext {
    c.create_code_context(CreateCodeContextRequest {
        sandbox_id: sandbox.into(),
        language: language.into(),
        cwd: String::new(),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn destroy(c: &mut Client, sandbox: &str) {
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: sandbox.into(),
    })
    .await
    .unwrap();
}

/// Width and height of a PNG given as base64.
fn png_size(b64: &str) -> (u32, u32) {
    let png = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cells_keep_their_state_and_return_rich_results() {
    let (_guard, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create(&mut c, vec![]).await;
    let t0 = Instant::now();
    let first = run(&mut c, &sb, "x = 41\nx + 1").await;
    eprintln!("first cell after create: {:?}", t0.elapsed());
    assert_eq!((first.state(), first.text()), (CodeState::Ok, "42"), "{first:?}");
    let second = run(&mut c, &sb, "print('x is', x)\nx * 2").await;
    assert_eq!(second.stdout, "x is 41\n");
    assert_eq!(second.text(), "82");
    assert!(second.end.execution_count > first.end.execution_count, "{second:?}");

    let df = run(&mut c, &sb, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})").await;
    let html = df.results[0].data.get("text/html").expect("an HTML result");
    assert!(html.contains("<table") && html.contains("</table>"), "{html}");

    let fig = "import matplotlib.pyplot as plt\nfig = plt.figure(figsize=(4, 3), dpi=100)\n\
               plt.plot([1, 3, 2])\nplt.show()";
    let chart = run(&mut c, &sb, fig).await;
    let png = chart.results.iter().find_map(|r| r.data.get("image/png"));
    assert_eq!(png_size(png.expect("a PNG result")), (400, 300), "{chart:?}");

    let err = run(&mut c, &sb, "1 / 0").await;
    assert_eq!(err.state(), CodeState::Error);
    let e = err.error.expect("the exception");
    assert_eq!(e.name, "ZeroDivisionError");
    assert!(e.value.contains("division by zero") && e.traceback.contains("1 / 0"), "{e:?}");
    destroy(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contexts_are_isolated_restartable_and_speak_javascript_and_bash() {
    let (_guard, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create(&mut c, vec![]).await;
    let a = context(&mut c, &sb, "python").await;
    let b = context(&mut c, &sb, "python").await;
    assert_ne!(a.id, b.id);
    run_in(&mut c, &sb, &a.id, "secret_of_a = 7", 0).await;
    let seen = run_in(&mut c, &sb, &b.id, "secret_of_a", 0).await;
    assert_eq!(seen.error.expect("a NameError in b").name, "NameError");
    assert_eq!(run_in(&mut c, &sb, &a.id, "secret_of_a", 0).await.text(), "7");
    c.restart_code_context(RestartCodeContextRequest {
        sandbox_id: sb.clone(),
        context_id: a.id.clone(),
    })
    .await
    .unwrap();
    let after = run_in(&mut c, &sb, &a.id, "secret_of_a", 0).await;
    assert_eq!(after.error.expect("state cleared").name, "NameError");

    let js = context(&mut c, &sb, "javascript").await;
    let cell = run_in(&mut c, &sb, &js.id, "let n = 41; console.log('hi'); n + 1", 0).await;
    assert_eq!((cell.stdout.as_str(), cell.text()), ("hi\n", "42"), "{cell:?}");
    let sh = context(&mut c, &sb, "bash").await;
    run_in(&mut c, &sb, &sh.id, "GREETING=hello", 0).await;
    let cell = run_in(&mut c, &sb, &sh.id, "echo $GREETING from $(whoami)", 0).await;
    assert_eq!(cell.stdout, "hello from user\n", "{cell:?}");
    destroy(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_or_an_oom_ends_the_cell_and_the_context_lives_on() {
    let (_guard, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create(&mut c, vec![]).await;
    run(&mut c, &sb, "kept = 'still here'").await;
    let t0 = Instant::now();
    let slow = run_in(&mut c, &sb, "", "import time\ntime.sleep(120)", 2_000).await;
    assert_eq!(slow.state(), CodeState::TimedOut, "{slow:?}");
    assert_eq!(slow.end.error_reason, "EXEC_TIMEOUT");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert_eq!(run(&mut c, &sb, "kept").await.text(), "still here");

    // Touched memory (not a lazy allocation) past the VM's: the guest kills the kernel.
    let hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (32 << 20))";
    let oom = run_in(&mut c, &sb, "", hog, 120_000).await;
    assert_eq!(oom.state(), CodeState::OomKilled, "{oom:?}");
    assert_eq!(oom.end.error_reason, "OOM_KILLED");
    let next = run(&mut c, &sb, "1 + 1").await;
    assert_eq!((next.state(), next.text()), (CodeState::Ok, "2"), "{next:?}");
    destroy(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_redacted_and_clones_draw_different_random_numbers() {
    let (_guard, s) = shared().await;
    let mut c = s.client(None).await;
    let value = "sk-live-5ca1ab1e-not-for-results";
    let secret = Secret {
        name: "API_KEY".into(),
        value: value.into(),
        delivery: Some(secret::Delivery::Env(SecretEnv::default())),
        ttl_s: 0,
    };
    let one = create(&mut c, vec![secret]).await;
    let cell = run(&mut c, &one, "import os\nprint(os.environ['API_KEY'])\nos.environ['API_KEY']").await;
    let all = format!("{cell:?}");
    assert!(!all.contains(value), "the secret leaked: {all}");
    assert!(cell.stdout.contains("[REDACTED:API_KEY]"), "{cell:?}");
    assert!(cell.text().contains("[REDACTED:API_KEY]"), "{cell:?}");

    let two = create(&mut c, vec![]).await;
    let draw = "import random\nrandom.random()";
    let (a, b) = (run(&mut c, &one, draw).await, run(&mut c, &two, draw).await);
    assert_ne!(a.text(), b.text(), "two clones drew the same number");
    assert!(a.text().starts_with("0."), "{a:?}");
    destroy(&mut c, &one).await;
    destroy(&mut c, &two).await;
}

/// The unchanged `e2b-code-interpreter` package (pinned, from PyPI) runs
/// `tests/e2b/test_code_interpreter.py` with only E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL
/// pointing it at the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_code_interpreter_package_runs_unchanged() {
    let (_guard, s) = shared().await;
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2b");
    let venv = Command::new(here.join("interpreter-venv.sh")).output().unwrap();
    assert!(venv.status.success(), "{}", String::from_utf8_lossy(&venv.stderr));
    let python = String::from_utf8(venv.stdout).unwrap();
    let url = format!("http://127.0.0.1:{}", port());
    let mut pytest = Command::new(python.trim().lines().last().unwrap());
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio"])
        .arg(here.join("test_code_interpreter.py"))
        .env("E2B_API_KEY", KEY)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN");
    let out = tokio::task::spawn_blocking(move || pytest.output().unwrap())
        .await
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "{text}\ndaemon log:\n{}", s.log_tail());
    s.clean(&[KEY]).await;
}

/// Airlock's CLI: `airlock run-code` prints the text result and saves the chart as a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_text_results_and_saves_images() {
    let (_guard, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create(&mut c, vec![]).await;
    let dir = s.dir.join("run-code");
    std::fs::create_dir_all(&dir).unwrap();
    let cell = dir.join("cell.py");
    std::fs::write(
        &cell,
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(2, 1), dpi=100)\n\
         plt.plot([1, 2])\nplt.show()\nprint('drawn')\n6 * 7\n",
    )
    .unwrap();
    let out = Command::new(airlock_system_tests::binary("airlock"))
        .env("AIRLOCK_ADDR", format!("unix://{}", s.socket.display()))
        .arg("run-code")
        .arg(&sb)
        .arg(&cell)
        .arg("--out-dir")
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("drawn") && stdout.contains("42"), "{stdout}");
    let png = std::fs::read(dir.join("result-1.png")).expect("the chart saved");
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    assert_eq!(png_size(&b64), (200, 100));
    destroy(&mut c, &sb).await;
}
