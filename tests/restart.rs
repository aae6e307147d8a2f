//! System test of a daemon restart: a daemon killed with SIGKILL mid-execution and mid-create,
//! or stopped with SIGTERM for an upgrade, leaves its running and paused sandboxes running, and
//! the next one adopts them (same VMM processes, files, state) and follows their executions
//! with no gap in the output; a create in flight ends as failed and leaves nothing running. With
//! `adopt_on_restart = false` the next daemon reaps them, and a stop leaves nothing behind.
//! A sandbox with secrets is adopted with them (sealed at rest): still delivered, redacted and
//! brokered, their sealed record gone with the sandbox; under another key it is reaped.
//!
//! The scenarios share one data directory with the template `base` (the run's cached one,
//! imported, or built once per test process); each starts its own daemons on it, one scenario
//! at a time.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{
    self, Client, Daemon, alive, cgroups_left, client, create_sandbox, processes_mentioning,
    remove_parent_cgroups, run, shell, start_daemon, tail,
};
use airlock_system_tests::{require_kvm, shared};

#[path = "egress/upstream.rs"]
mod upstream;

/// The data directory with its template, made once.
#[derive(Debug)]
struct Prepared {
    dir: PathBuf,
    cgroup_parent: String,
}

static PREPARED: OnceLock<Prepared> = OnceLock::new();
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const ADOPT: &str = "pool_size = 1\nadopt_on_restart = true\n";
const REAP: &str = "pool_size = 1\nadopt_on_restart = false\n";

async fn prepared() -> (tokio::sync::MutexGuard<'static, ()>, &'static Prepared) {
    let guard = SERIAL.lock().await;
    if let Some(p) = PREPARED.get() {
        return (guard, p);
    }
    require_kvm();
    let dir = std::env::temp_dir().join(format!("airlock-restart-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cgroup_parent = format!("airlock-restart-{}", std::process::id());
    // The template of this run's shared daemons (tests/shared.rs) when one of them built it
    // already: imported into the data directory, where every later daemon of this test finds
    // it; else built here and kept for them.
    let cache = shared::template_cache_dir();
    let _building = cache.as_deref().map(shared::lock_template_cache);
    let import = shared::import_setting(cache.iter());
    let d = start_daemon(&dir, &cgroup_parent, &format!("{import}{REAP}"));
    let mut c = client(&d, None).await;
    let listed = c
        .list_templates(ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates;
    if !listed.iter().any(|t| t.name == "base") {
        let t = harness::build_template(&mut c, "base", &d.log).await;
        if let Some(to) = &cache {
            shared::export_template(&d.data_dir.join("templates").join(&t.id), &t, to);
        }
    }
    drop(d);
    // SAFETY: registers a plain `extern "C"` function that runs at exit.
    unsafe { libc::atexit(remove_prepared) };
    (
        guard,
        PREPARED.get_or_init(|| Prepared { dir, cgroup_parent }),
    )
}

/// Removes the shared data directory and cgroup parent at exit (every daemon is stopped by
/// then: each scenario's are dropped with it).
extern "C" fn remove_prepared() {
    if let Some(p) = PREPARED.get() {
        let _ = std::fs::remove_dir_all(&p.dir);
        remove_parent_cgroups(&p.cgroup_parent);
    }
}

fn start(p: &Prepared, config: &str) -> Daemon {
    start_daemon(&p.dir, &p.cgroup_parent, config)
}

/// Kills the daemon process itself (SIGKILL), not its VMMs.
fn kill_daemon(d: &mut Daemon) {
    d.child.0.as_mut().unwrap().kill().unwrap();
    d.child.0.take().unwrap().wait().unwrap();
}

/// Stops the daemon with SIGTERM and waits for it.
fn stop_daemon(d: &mut Daemon) {
    let pid = d.child.0.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = d.child.0.take().unwrap().wait().unwrap();
    assert!(
        status.success(),
        "airlockd exit: {status:?}\n{}",
        tail(&d.log)
    );
}

async fn sandbox(c: &mut Client, id: &str) -> Sandbox {
    c.get_sandbox(GetSandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn output(c: &mut Client, execution: &str) -> (Execution, String) {
    let r = harness::execution_with_output(c, execution).await;
    (
        r.execution.unwrap(),
        String::from_utf8_lossy(&r.stdout).into_owned(),
    )
}

/// Follows an execution's stream from the start to its exit: (stdout, record).
async fn follow(c: &mut Client, execution: &str) -> (String, Execution) {
    let mut s = c
        .stream_execution(StreamExecutionRequest {
            execution_id: execution.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    let mut expected = 0;
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(execution_event::Event::Output(o)) if o.stream == StreamKind::Stdout as i32 => {
                assert_eq!(o.offset, expected, "the stream has a gap or an overlap");
                expected += o.data.len() as u64;
                out.extend(o.data);
            }
            Some(execution_event::Event::Exit(e)) => {
                return (String::from_utf8_lossy(&out).into_owned(), e);
            }
            _ => {}
        }
    }
    panic!("the stream of {execution} ended without an exit");
}

/// The VMM processes running from the test's data directory (not the daemon).
fn vmms(p: &Prepared) -> HashSet<u32> {
    let data = p.dir.join("data").display().to_string();
    processes_mentioning(&data)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| !String::from_utf8_lossy(&c).contains("airlockd"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_daemon_mid_execution_and_mid_create_is_adopted_by_the_next() {
    let (_serial, p) = prepared().await;
    let mut d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    let a = create_sandbox(&mut c, &d.log).await;
    let script = "i=0; while [ $i -lt 12 ]; do echo line-$i; i=$((i+1)); sleep 1; done";
    let ex = c
        .exec(shell(&a.id, script, 300_000))
        .await
        .unwrap()
        .into_inner();
    let b = create_sandbox(&mut c, &d.log).await;
    let (_, _, rec) = run(&mut c, &b.id, &["sh", "-c", "echo kept > /tmp/kept.txt"]).await;
    assert_eq!(rec.exit_code, 0);
    c.pause_sandbox(PauseSandboxRequest {
        sandbox_id: b.id.clone(),
    })
    .await
    .unwrap();
    // Some output is stored before the daemon dies.
    let t = Instant::now();
    while !output(&mut c, &ex.execution_id).await.1.contains("line-1") {
        assert!(t.elapsed() < Duration::from_secs(120), "no output");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A create in flight when the daemon dies.
    let mut c2 = c.clone();
    let in_flight = tokio::spawn(async move {
        c2.create_sandbox(CreateSandboxRequest {
            labels: [("in".to_owned(), "flight".to_owned())].into(),
            ..Default::default()
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    kill_daemon(&mut d);
    let _ = in_flight.await;
    assert!(
        alive(a.vmm_pid) && alive(b.vmm_pid),
        "the VMMs outlive their daemon"
    );

    let d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    let a2 = sandbox(&mut c, &a.id).await;
    assert_eq!(
        a2.state,
        SandboxState::Running as i32,
        "{a2:?}\n{}",
        tail(&d.log)
    );
    assert_eq!(a2.vmm_pid, a.vmm_pid, "the same VMM");
    let b2 = sandbox(&mut c, &b.id).await;
    assert_eq!(b2.state, SandboxState::Paused as i32, "{b2:?}");
    assert_eq!(b2.vmm_pid, b.vmm_pid);
    // The execution goes on, its output without a gap.
    let (out, rec) = follow(&mut c, &ex.execution_id).await;
    let want: String = (0..12).map(|i| format!("line-{i}\n")).collect();
    assert_eq!(out, want);
    assert_eq!(rec.state, ExecutionState::Exited as i32, "{rec:?}");
    assert_eq!(rec.exit_code, 0);
    // The paused one resumes with its files.
    c.resume_sandbox(ResumeSandboxRequest {
        sandbox_id: b.id.clone(),
    })
    .await
    .unwrap();
    let (kept, _, _) = run(&mut c, &b.id, &["cat", "/tmp/kept.txt"]).await;
    assert_eq!(kept, "kept\n");
    // The create in flight: either it finished before the kill (and was adopted) or it ended
    // as failed; nothing is left starting, and no VMM runs without a live sandbox or a pool.
    let all = c
        .list_sandboxes(ListSandboxesRequest {
            labels: [("in".to_owned(), "flight".to_owned())].into(),
            states: (1..=5).collect(),
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    for s in &all {
        assert_ne!(s.state, SandboxState::Starting as i32, "{s:?}");
        if s.state == SandboxState::Dead as i32 {
            assert_eq!(s.end_reason, "DAEMON_RESTARTED", "{s:?}");
        }
    }
    let live: Vec<Sandbox> = c
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    let live_pids: HashSet<u32> = live.iter().map(|s| s.vmm_pid).collect();
    let stray: Vec<u32> = vmms(p).difference(&live_pids).copied().collect();
    assert!(
        stray.len() <= 1,
        "VMMs that are neither a sandbox's nor the pool's: {stray:?}"
    );
    // New work goes on as usual.
    let (echo, _, _) = run(&mut c, &a.id, &["echo", "after"]).await;
    assert_eq!(echo, "after\n");
    for s in &live {
        c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: s.id.clone(),
        })
        .await
        .unwrap();
    }
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_keeps_sandboxes_for_the_next_daemon_and_adopt_off_reaps_them() {
    let (_serial, p) = prepared().await;
    let mut d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    let a = create_sandbox(&mut c, &d.log).await;
    let ex = c
        .exec(shell(&a.id, "sleep 600", 300_000))
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_daemon(&mut d);
    assert!(alive(a.vmm_pid), "an upgrade leaves the sandbox running");

    let mut d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    assert_eq!(
        sandbox(&mut c, &a.id).await.state,
        SandboxState::Running as i32
    );
    let (rec, _) = output(&mut c, &ex.execution_id).await;
    assert_eq!(rec.state, ExecutionState::Running as i32, "{rec:?}");
    let killed = c
        .kill_execution(KillExecutionRequest {
            execution_id: ex.execution_id.clone(),
            signal: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(killed.signalled, "the adopted execution takes signals");
    let t = Instant::now();
    let rec = loop {
        let (rec, _) = output(&mut c, &ex.execution_id).await;
        if rec.state != ExecutionState::Running as i32 {
            break rec;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the kill did not end it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(rec.state, ExecutionState::Killed as i32, "{rec:?}");
    stop_daemon(&mut d);
    assert!(alive(a.vmm_pid));

    // With adoption off, the next daemon reaps what it finds, and its stop leaves nothing.
    let mut d = start(p, REAP);
    let mut c = client(&d, None).await;
    let reaped = sandbox(&mut c, &a.id).await;
    assert_eq!(reaped.state, SandboxState::Dead as i32, "{reaped:?}");
    assert_eq!(reaped.end_reason, "DAEMON_RESTARTED");
    assert!(!alive(a.vmm_pid), "the old VMM was reaped");
    let b = create_sandbox(&mut c, &d.log).await;
    assert!(alive(b.vmm_pid));
    stop_daemon(&mut d);
    assert_eq!(vmms(p), HashSet::new(), "VMM processes left");
    assert_eq!(
        cgroups_left(&p.cgroup_parent),
        Vec::<PathBuf>::new(),
        "cgroups left"
    );
    let run_left: Vec<_> = std::fs::read_dir(p.dir.join("data/run"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(run_left.is_empty(), "run directories left: {run_left:?}");
    remove_parent_cgroups(&p.cgroup_parent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_volume_and_the_sandbox_that_mounts_it_survive_a_restart() {
    let (_serial, p) = prepared().await;
    let mut d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    c.create_volume(CreateVolumeRequest {
        name: "kept".into(),
        size_mib: 32,
    })
    .await
    .unwrap();
    let mount = |read_only| CreateSandboxRequest {
        volumes: vec![VolumeAttachment {
            name: "kept".into(),
            mount_path: "/data".into(),
            read_only,
        }],
        ..Default::default()
    };
    let a = c
        .create_sandbox(mount(false))
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", tail(&d.log)))
        .into_inner();
    let (out, _, rec) = run(
        &mut c,
        &a.id,
        &["sh", "-c", "echo before > /data/f && sync"],
    )
    .await;
    assert_eq!(rec.exit_code, 0, "{out}");
    stop_daemon(&mut d);

    // The next daemon finds the volume, and the adopted sandbox still has it, read-write.
    let mut d = start(p, ADOPT);
    let mut c = client(&d, None).await;
    let listed = c
        .list_volumes(ListVolumesRequest {})
        .await
        .unwrap()
        .into_inner()
        .volumes;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].attached_to, std::slice::from_ref(&a.id));
    let err = c
        .create_sandbox(mount(true))
        .await
        .expect_err("the adopted sandbox mounts it read-write");
    assert_eq!(
        airlock_api::error_info(&err).map(|i| i.0).as_deref(),
        Some("VOLUME_IN_USE")
    );
    let (out, _, _) = run(
        &mut c,
        &a.id,
        &["sh", "-c", "echo after >> /data/f; cat /data/f"],
    )
    .await;
    assert_eq!(out, "before\nafter\n");
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: a.id.clone(),
    })
    .await
    .unwrap();
    let b = c.create_sandbox(mount(true)).await.unwrap().into_inner();
    let (out, _, _) = run(&mut c, &b.id, &["cat", "/data/f"]).await;
    assert_eq!(
        out, "before\nafter\n",
        "written across the restart, read after"
    );
    c.destroy_sandbox(DestroySandboxRequest { sandbox_id: b.id })
        .await
        .unwrap();
    assert!(
        c.delete_volume(DeleteVolumeRequest {
            name: "kept".into()
        })
        .await
        .unwrap()
        .into_inner()
        .deleted
    );
    stop_daemon(&mut d);
}

/// A client of `d`, retried for a while (the socket exists a moment before it listens), with
/// the daemon's log if it never answers.
async fn connect(d: &Daemon) -> Client {
    let socket = format!("unix://{}", d.socket.display());
    let t = Instant::now();
    loop {
        match airlock_api::client(Some(&socket), None).await {
            Ok(c) => return c,
            Err(e) if t.elapsed() > Duration::from_secs(20) => {
                panic!("connect to airlockd: {e:?}\n{}", tail(&d.log))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// How many sealed secret records the store in `data_dir` holds for sandbox `id`.
fn sealed_records(data_dir: &std::path::Path, id: &str) -> i64 {
    let db = rusqlite::Connection::open(data_dir.join("airlock.db")).unwrap();
    db.query_row(
        "SELECT COUNT(*) FROM sandbox_secrets WHERE id = ?1",
        [id],
        |r| r.get(0),
    )
    .unwrap()
}

/// Whether `needle` is anywhere in the files of the store (the database and its log).
fn in_store(data_dir: &std::path::Path, needle: &str) -> bool {
    ["airlock.db", "airlock.db-wal"].iter().any(|f| {
        std::fs::read(data_dir.join(f))
            .is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle.as_bytes()))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sandbox_with_secrets_survives_a_killed_daemon_with_them() {
    use upstream::{config, domains, upstream};
    let (_serial, p) = prepared().await;
    let up = upstream();
    let cfg = format!("adopt_on_restart = true\n{}", config(up));
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (env_value, brk_value) = (format!("env-{salt:x}"), format!("brk-{salt:x}"));
    let mut d = start(p, &cfg);
    let mut c = connect(&d).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: Some(domains(&["allowed.test"], &[])),
            secrets: vec![
                Secret {
                    name: "ENVSEC".into(),
                    value: env_value.clone(),
                    delivery: Some(secret::Delivery::Env(SecretEnv::default())),
                    ttl_s: 0,
                },
                Secret {
                    name: "BRK".into(),
                    value: brk_value.clone(),
                    delivery: Some(secret::Delivery::Broker(SecretBroker {
                        hosts: vec!["allowed.test".into()],
                        https: true,
                        ..Default::default()
                    })),
                    ttl_s: 0,
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", tail(&d.log)))
        .into_inner();
    // An execution that prints the value while no daemon runs (killed once it started).
    let script = "echo started; sleep 8; echo late-$ENVSEC";
    let ex = c
        .exec(shell(&sb.id, script, 300_000))
        .await
        .unwrap()
        .into_inner();
    let t = Instant::now();
    while !output(&mut c, &ex.execution_id).await.1.contains("started") {
        assert!(t.elapsed() < Duration::from_secs(120), "no output");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    kill_daemon(&mut d);
    assert!(alive(sb.vmm_pid), "the VMM outlives its daemon");

    let d = start(p, &cfg);
    let mut c = connect(&d).await;
    let again = sandbox(&mut c, &sb.id).await;
    assert_eq!(
        again.state,
        SandboxState::Running as i32,
        "adopted with its secrets: {again:?}\n{}",
        tail(&d.log)
    );
    assert_eq!(again.vmm_pid, sb.vmm_pid, "the same VMM");
    // Sealed: the values are nowhere in clear in the store; the key is the daemon's alone.
    for v in [&env_value, &brk_value] {
        assert!(!in_store(&d.data_dir, v), "a value in clear in the store");
    }
    let key = std::fs::metadata(d.data_dir.join("secrets.key")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&key.permissions()) & 0o777,
        0o600
    );
    assert_eq!(again.secrets.len(), 2, "{again:?}");
    assert_eq!(sealed_records(&d.data_dir, &sb.id), 1);
    // The followed execution's output, and a new one's, are redacted; the variable is given.
    let (out, rec) = follow(&mut c, &ex.execution_id).await;
    assert_eq!(out, "started\nlate-[REDACTED:ENVSEC]\n", "{rec:?}");
    let (out, _, _) = run(&mut c, &sb.id, &["sh", "-c", "echo now-$ENVSEC"]).await;
    assert_eq!(out, "now-[REDACTED:ENVSEC]\n");
    // The broker still adds its header, over HTTP and (the same CA) HTTPS.
    let before = up.seen().lines().count();
    for url in ["http://allowed.test/after", "https://allowed.test/after"] {
        let (_, err, rec) = run(&mut c, &sb.id, &["wget", "-q", "-O", "/dev/null", url]).await;
        assert_eq!(rec.exit_code, 0, "{url}: {err}\n{}", tail(&d.log));
    }
    let seen: Vec<String> = up.seen().lines().skip(before).map(str::to_owned).collect();
    assert_eq!(
        seen,
        [
            format!("http 80 allowed.test auth=Bearer {brk_value} key=None"),
            format!("http 443 allowed.test auth=Bearer {brk_value} key=None"),
        ]
    );
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: sb.id.clone(),
    })
    .await
    .unwrap();
    assert_eq!(
        sealed_records(&d.data_dir, &sb.id),
        0,
        "wiped with the sandbox"
    );
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sandbox_whose_sealed_secrets_do_not_open_is_not_adopted() {
    let (_serial, p) = prepared().await;
    let mut d = start(p, ADOPT);
    let mut c = connect(&d).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            secrets: vec![Secret {
                name: "K".into(),
                value: "value-under-the-old-key".into(),
                delivery: None,
                ttl_s: 0,
            }],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", tail(&d.log)))
        .into_inner();
    kill_daemon(&mut d);
    // The key is lost (or rotated): the next daemon makes another.
    std::fs::remove_file(d.data_dir.join("secrets.key")).unwrap();
    let d = start(p, ADOPT);
    let mut c = connect(&d).await;
    let s = sandbox(&mut c, &sb.id).await;
    assert_eq!(s.state, SandboxState::Dead as i32, "{s:?}");
    assert_eq!(s.end_reason, "DAEMON_RESTARTED");
    assert!(!alive(sb.vmm_pid), "its VMM was reaped");
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert!(
        log.contains("it has secrets (K) and the key from")
            && log.contains("do not open with this daemon's key"),
        "the reason is logged:\n{}",
        tail(&d.log)
    );
    assert_eq!(sealed_records(&d.data_dir, &sb.id), 0, "wiped with it");
    // New sandboxes with secrets work under the new key.
    let b = c
        .create_sandbox(CreateSandboxRequest {
            secrets: vec![Secret {
                name: "K".into(),
                value: "value-under-the-new-key".into(),
                delivery: None,
                ttl_s: 0,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sealed_records(&d.data_dir, &b.id), 1);
    c.destroy_sandbox(DestroySandboxRequest { sandbox_id: b.id })
        .await
        .unwrap();
    drop(d);
}
