//! System test of `airlockd` through a real gRPC client, with real VMs: a template made by a
//! cold boot, concurrent sandboxes that each see only their own files, capacity errors with
//! details, a timeout enforced without a client, a killed VMM reported as dead, idempotent
//! destroy, tenant isolation, and a daemon restart that keeps the records and leaves no
//! process, cgroup or run directory behind.
//!
//! One daemon and one template serve every phase (the cold boot costs tens of seconds on
//! nested-KVM machines), so the phases run in order inside one test.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{
    Client, alive, cgroups_left, client, http_get, processes_mentioning, reason,
    remove_parent_cgroups, run, start_daemon, tail,
};
use airlock_system_tests::{require_kvm, step};
use tonic::Code;

const TENANT_TOKEN: &str = "token-of-acme";
/// Sandboxes alive at once, each running an execution.
const CONCURRENT: usize = 20;
const CAPACITY: usize = CONCURRENT + 1;

/// This test's daemon settings (over `start_daemon`'s).
fn daemon_config(metrics_port: u16) -> String {
    format!(
        "pool_size = 2\nmax_sandboxes = {CAPACITY}\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n\
         [tenants.acme]\ntokens = [\"{TENANT_TOKEN}\"]\n"
    )
}

/// Reads a whole file out of a sandbox.
async fn read_all(c: &mut Client, sandbox: &str, path: &str) -> Vec<u8> {
    let mut chunks = c
        .read_file(ReadFileRequest {
            sandbox_id: sandbox.into(),
            path: path.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(ch) = chunks.message().await.unwrap() {
        out.extend(ch.data);
    }
    out
}

/// Executions run at once in the concurrency phase: `AIRLOCK_TEST_EXEC_PARALLEL`, else all of
/// them on bare-metal KVM and 5 on nested KVM (`kvm_pvm`), where 20 emulated guest kernels
/// forking at once on 2 cores take minutes each.
fn exec_parallelism() -> usize {
    if let Some(n) = std::env::var("AIRLOCK_TEST_EXEC_PARALLEL")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
    {
        return n;
    }
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        5
    } else {
        CONCURRENT
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daemon_serves_the_sandbox_lifecycle() {
    require_kvm();
    let dir = std::env::temp_dir().join(format!("airlock-daemon-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cgroup_parent = format!("airlock-test-{}", std::process::id());
    let mut t = Instant::now();
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let mut daemon = start_daemon(&dir, &cgroup_parent, &daemon_config(metrics_port));
    let mut c = client(&daemon, None).await;
    let mut acme = client(&daemon, Some(TENANT_TOKEN)).await;

    // A template: one cold boot and a snapshot, with progress events.
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: "base".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut template = None;
    while let Some(ev) = events
        .message()
        .await
        .unwrap_or_else(|e| panic!("template: {e:?}\n{}", tail(&daemon.log)))
    {
        if let Some(tpl) = ev.template {
            template = Some(tpl);
        }
    }
    let template = template.expect("the last event carries the template");
    assert_eq!(template.name, "base");
    assert!(!template.kernel_version.is_empty());
    step("template built", &mut t);
    let dup = c
        .create_template(CreateTemplateRequest {
            name: "base".into(),
            ..Default::default()
        })
        .await;
    let dup_err = match dup {
        Err(e) => e,
        Ok(s) => s
            .into_inner()
            .message()
            .await
            .expect_err("a second `base` must be refused"),
    };
    assert_eq!(reason(&dup_err).0, "TEMPLATE_EXISTS");

    // 20 concurrent sandboxes, each with its own file, each running an exec. All 20 are created
    // at once and stay alive together; their executions run at most `exec_parallelism()` at a
    // time (all 20 at once on bare-metal KVM; fewer on the nested build machines, where a
    // command costs seconds of emulated guest kernel each).
    let execs = Arc::new(tokio::sync::Semaphore::new(exec_parallelism()));
    let mut tasks = Vec::new();
    for i in 0..CONCURRENT {
        let mut c = c.clone();
        let execs = execs.clone();
        tasks.push(tokio::spawn(async move {
            let s = c
                .create_sandbox(CreateSandboxRequest {
                    files: vec![FileToPlace {
                        path: format!("/tmp/own-{i}"),
                        content: format!("sandbox-{i}").into_bytes(),
                        mode: 0,
                    }],
                    labels: HashMap::from([
                        ("test".into(), "daemon".into()),
                        ("n".into(), i.to_string()),
                    ]),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("create {i}: {e:?}"))
                .into_inner();
            assert_eq!(s.state, SandboxState::Running as i32);
            let listing: Vec<String> = c
                .list_files(ListFilesRequest {
                    sandbox_id: s.id.clone(),
                    path: "/tmp".into(),
                })
                .await
                .unwrap_or_else(|e| panic!("list /tmp of {i}: {e:?}"))
                .into_inner()
                .entries
                .into_iter()
                .map(|e| e.name)
                .collect();
            let permit = execs.acquire().await.unwrap();
            let own = format!("/tmp/own-{i}");
            let (out, _, rec) = run(&mut c, &s.id, &["cat", &own]).await;
            drop(permit);
            (i, s, out, rec, listing)
        }));
    }
    let mut sandboxes = Vec::new();
    let mut first_exec = None;
    for task in tasks {
        let (i, s, out, rec, listing) = task.await.unwrap();
        if i == 0 {
            first_exec = Some((rec.id.clone(), out.clone()));
        }
        assert_eq!(rec.state, ExecutionState::Exited as i32, "{rec:?}");
        assert_eq!(rec.exit_code, 0);
        assert_eq!(out, format!("sandbox-{i}"), "sandbox {i} read {out:?}");
        assert!(
            listing.contains(&format!("own-{i}")),
            "sandbox {i}: {listing:?}"
        );
        for j in (0..CONCURRENT).filter(|j| *j != i) {
            assert!(
                !listing.contains(&format!("own-{j}")),
                "sandbox {i} sees sandbox {j}'s file: {listing:?}"
            );
        }
        sandboxes.push(s);
    }
    let ids: std::collections::HashSet<_> = sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(ids.len(), CONCURRENT);
    step("concurrent sandboxes ran their own execs", &mut t);

    let listed = c
        .list_sandboxes(ListSandboxesRequest {
            labels: HashMap::from([("test".into(), "daemon".into())]),
            states: vec![],
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(listed.len(), CONCURRENT);

    // Capacity: 21 allowed, the 22nd is refused with details (never a hang).
    let extra = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap()
        .into_inner();
    let over = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("over capacity");
    assert_eq!(over.code(), Code::ResourceExhausted);
    let (r, meta) = reason(&over);
    assert_eq!(r, "CAPACITY_EXHAUSTED");
    assert_eq!(meta["limit"], CAPACITY.to_string());
    assert_eq!(meta["current"], CAPACITY.to_string());
    step("capacity + 1 refused with RESOURCE_EXHAUSTED", &mut t);

    // Free all but two.
    let a = sandboxes[0].clone();
    let b = sandboxes[1].clone();
    for s in sandboxes.iter().skip(2).chain([&extra]) {
        let r = c
            .destroy_sandbox(DestroySandboxRequest {
                sandbox_id: s.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.destroyed);
    }

    // Tenants: acme sees nothing of the default tenant's.
    let hidden = acme
        .get_sandbox(GetSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .expect_err("other tenant");
    assert_eq!(hidden.code(), Code::NotFound);
    assert!(
        acme.list_sandboxes(ListSandboxesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .sandboxes
            .is_empty()
    );
    let not_mine = acme
        .destroy_sandbox(DestroySandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!not_mine.destroyed);
    let bad_token = client(&daemon, Some("wrong"))
        .await
        .list_sandboxes(ListSandboxesRequest::default())
        .await;
    assert_eq!(
        bad_token.expect_err("unknown token").code(),
        Code::Unauthenticated
    );
    assert_eq!(
        c.get_sandbox(GetSandboxRequest {
            sandbox_id: a.id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .state,
        SandboxState::Running as i32
    );
    step("tenant isolation", &mut t);

    // Files under the policy, and outside it.
    let data: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut msgs = vec![WriteFileRequest {
        part: Some(write_file_request::Part::Header(WriteFileHeader {
            sandbox_id: a.id.clone(),
            path: "/tmp/work/data.bin".into(),
            mode: 0o600,
        })),
    }];
    msgs.extend(data.chunks(700_000).map(|c| WriteFileRequest {
        part: Some(write_file_request::Part::Data(c.to_vec())),
    }));
    let written = c
        .write_file(tokio_stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(written.bytes_written, data.len() as u64);
    let back = read_all(&mut c, &a.id, "/tmp/work/data.bin").await;
    assert!(
        back == data,
        "read back {} bytes, wrote {}",
        back.len(),
        data.len()
    );
    let listing = c
        .list_files(ListFilesRequest {
            sandbox_id: a.id.clone(),
            path: "/tmp/work".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        listing
            .entries
            .iter()
            .any(|e| e.name == "data.bin" && e.size == data.len() as u64)
    );
    let forbidden = c
        .read_file(ReadFileRequest {
            sandbox_id: a.id.clone(),
            path: "/etc/shadow".into(),
        })
        .await
        .expect_err("outside the policy");
    assert_eq!(forbidden.code(), Code::PermissionDenied);
    assert_eq!(reason(&forbidden).0, "PATH_NOT_ALLOWED");
    step("files", &mut t);

    // Pause and resume; a stream replayed from an offset; a kill.
    let paused = c
        .pause_sandbox(PauseSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.state, SandboxState::Paused as i32);
    let refused = c
        .exec(ExecRequest {
            sandbox_id: a.id.clone(),
            command: Some(exec_request::Command::Shell("true".into())),
            ..Default::default()
        })
        .await
        .expect_err("exec while paused");
    assert_eq!(reason(&refused).0, "SANDBOX_NOT_RUNNING");
    c.resume_sandbox(ResumeSandboxRequest {
        sandbox_id: a.id.clone(),
    })
    .await
    .unwrap();
    let (out, _, rec) = run(&mut c, &a.id, &["sh", "-c", "echo 0123456789"]).await;
    assert_eq!(out, "0123456789\n");
    let mut replay = c
        .stream_execution(StreamExecutionRequest {
            execution_id: rec.id.clone(),
            stdout_offset: 4,
            stderr_offset: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut tail_out = Vec::new();
    while let Some(ev) = replay.message().await.unwrap() {
        if let Some(execution_event::Event::Output(o)) = ev.event {
            assert!(o.offset >= 4);
            tail_out.extend(o.data);
        }
    }
    assert_eq!(String::from_utf8_lossy(&tail_out), "456789\n");
    let long = c
        .exec(ExecRequest {
            sandbox_id: a.id.clone(),
            command: Some(exec_request::Command::Shell("sleep 600".into())),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed = c
        .kill_execution(KillExecutionRequest {
            execution_id: long.execution_id.clone(),
            signal: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(killed.signalled);
    let rec = loop {
        let r = c
            .get_execution(GetExecutionRequest {
                execution_id: long.execution_id.clone(),
                include_output: false,
            })
            .await
            .unwrap()
            .into_inner()
            .execution
            .unwrap();
        if r.state != ExecutionState::Running as i32 {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(rec.state, ExecutionState::Killed as i32, "{rec:?}");
    step("pause/resume, stream replay, kill", &mut t);

    // A snapshot of a sandbox becomes the caller's template; a new sandbox has its file.
    let snap = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: a.id.clone(),
            template_name: "with-data".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(snap.source_sandbox_id, a.id);
    let from_snap = c
        .create_sandbox(CreateSandboxRequest {
            template: "with-data".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(from_snap.template_id, snap.id);
    let copy = read_all(&mut c, &from_snap.id, "/tmp/work/data.bin").await;
    assert!(copy == data, "the snapshot's clone lacks the file");
    assert!(
        c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: from_snap.id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .destroyed
    );
    step("snapshot to a template, clone from it", &mut t);

    // Metrics.
    let text = http_get(metrics_port, "/metrics").await;
    assert!(
        text.contains("airlock_sandboxes{state=\"running\"} 2"),
        "{text}"
    );
    let creates = text
        .lines()
        .find(|l| l.starts_with("airlock_create_seconds_count"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(creates >= CONCURRENT as u64 + 2, "{text}");
    assert!(
        text.contains("airlock_executions_total{outcome=\"killed\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("airlock_sandbox_memory_bytes{sandbox="),
        "{text}"
    );

    // A 2 s timeout holds without any client following the execution.
    let started = Instant::now();
    let ex = c
        .exec(ExecRequest {
            sandbox_id: a.id.clone(),
            command: Some(exec_request::Command::Shell(
                "echo before; sleep 600".into(),
            )),
            timeout_ms: 2000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let timed_out = loop {
        let r = c
            .get_execution(GetExecutionRequest {
                execution_id: ex.execution_id.clone(),
                include_output: true,
            })
            .await
            .unwrap()
            .into_inner();
        let e = r.execution.clone().unwrap();
        if e.state != ExecutionState::Running as i32 {
            break r;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "timeout not enforced"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let rec = timed_out.execution.unwrap();
    assert_eq!(rec.state, ExecutionState::TimedOut as i32, "{rec:?}");
    assert_eq!(rec.error_reason, "EXEC_TIMEOUT");
    let ran = rec.ended_unix_ms - rec.started_unix_ms;
    assert!(
        (2000..2000 + 3000 + 2000).contains(&ran),
        "ended after {ran} ms"
    );
    step("exec timeout enforced without a client", &mut t);

    // kill -9 of a sandbox's VMM: the sandbox is dead with a reason; the daemon goes on.
    let b_now = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: b.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(b_now.vmm_pid > 0);
    // SAFETY: kill(2) on the VMM pid the daemon reported; no memory is involved.
    assert_eq!(unsafe { libc::kill(b_now.vmm_pid as i32, 9) }, 0);
    let dead = loop {
        let s = c
            .get_sandbox(GetSandboxRequest {
                sandbox_id: b.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        if s.state == SandboxState::Dead as i32 {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "death not noticed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.end_reason, "SANDBOX_DEAD");
    assert!(
        dead.end_message.contains("signal 9"),
        "{}",
        dead.end_message
    );
    let on_dead = c
        .exec(ExecRequest {
            sandbox_id: b.id.clone(),
            command: Some(exec_request::Command::Shell("true".into())),
            ..Default::default()
        })
        .await
        .expect_err("exec on a dead sandbox");
    assert_eq!(on_dead.code(), Code::Unavailable);
    assert_eq!(reason(&on_dead).0, "SANDBOX_DEAD");
    step("killed VMM reported dead", &mut t);

    // Destroy is idempotent.
    assert!(
        c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: a.id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .destroyed
    );
    assert!(
        !c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: a.id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .destroyed
    );
    assert!(
        !c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: b.id.clone()
        })
        .await
        .unwrap()
        .into_inner()
        .destroyed
    );
    assert!(
        !c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: "sb-0123456789abcdef".into()
        })
        .await
        .unwrap()
        .into_inner()
        .destroyed
    );

    // The daemon dies mid-way (SIGKILL) with a sandbox and an execution running.
    let d = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("the daemon still serves")
        .into_inner();
    let running = c
        .exec(ExecRequest {
            sandbox_id: d.id.clone(),
            command: Some(exec_request::Command::Shell("sleep 600".into())),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let data_dir = daemon.data_dir.display().to_string();
    let vmms_before = processes_mentioning(&data_dir);
    assert!(
        vmms_before.contains(&d.vmm_pid),
        "{vmms_before:?} lacks {}",
        d.vmm_pid
    );
    daemon.child.0.as_mut().unwrap().kill().unwrap();
    daemon.child.0.take().unwrap().wait().unwrap();
    step("daemon killed", &mut t);

    daemon = start_daemon(&dir, &cgroup_parent, &daemon_config(metrics_port));
    c = client(&daemon, None).await;
    for pid in &vmms_before {
        assert!(
            !alive(*pid),
            "VMM {pid} of the old daemon survived the restart"
        );
    }
    let d_after = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: d.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d_after.state, SandboxState::Dead as i32);
    assert_eq!(d_after.end_reason, "DAEMON_RESTARTED");
    let lost = c
        .get_execution(GetExecutionRequest {
            execution_id: running.execution_id.clone(),
            include_output: false,
        })
        .await
        .unwrap()
        .into_inner()
        .execution
        .unwrap();
    assert_eq!(lost.state, ExecutionState::Failed as i32);
    assert_eq!(lost.error_reason, "DAEMON_RESTARTED");
    let old = c
        .get_execution(GetExecutionRequest {
            execution_id: ex.execution_id.clone(),
            include_output: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        old.execution.unwrap().state,
        ExecutionState::TimedOut as i32
    );
    // Output stored before the restart is still there.
    let (first_id, first_out) = first_exec.expect("sandbox 0 ran an exec");
    let stored = c
        .get_execution(GetExecutionRequest {
            execution_id: first_id,
            include_output: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(String::from_utf8_lossy(&stored.stdout), first_out);
    let records = c
        .list_sandboxes(ListSandboxesRequest {
            labels: HashMap::from([("test".into(), "daemon".into())]),
            states: vec![SandboxState::Destroyed as i32, SandboxState::Dead as i32],
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(
        records.len(),
        CONCURRENT,
        "every record survives the restart"
    );
    // The template survived too, and the restarted daemon creates from it.
    let e = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create after restart")
        .into_inner();
    let (out, _, _) = run(&mut c, &e.id, &["python3", "-c", "print(6 * 7)"]).await;
    assert_eq!(out, "42\n");
    step("restart kept records, reaped old VMMs", &mut t);

    // A clean stop ends every sandbox and warm VMM and leaves nothing behind.
    let daemon_pid = daemon.child.0.as_ref().unwrap().id() as i32;
    // SAFETY: kill(2) on our own child.
    let sent = unsafe { libc::kill(daemon_pid, 15) };
    assert_eq!(sent, 0);
    let status = daemon.child.0.take().unwrap().wait().unwrap();
    assert!(
        status.success(),
        "airlockd exit: {status:?}\n{}",
        tail(&daemon.log)
    );
    assert_eq!(
        processes_mentioning(&data_dir),
        Vec::<u32>::new(),
        "VMM processes left"
    );
    assert_eq!(
        cgroups_left(&cgroup_parent),
        Vec::<PathBuf>::new(),
        "cgroups left"
    );
    let run_left: Vec<_> = std::fs::read_dir(daemon.data_dir.join("run"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(run_left.is_empty(), "run directories left: {run_left:?}");
    remove_parent_cgroups(&cgroup_parent);
    let _ = std::fs::remove_dir_all(&dir);
}
