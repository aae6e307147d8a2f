//! System test of `airlockd` through a real gRPC client, with real VMs: one scenario per test,
//! all sharing one daemon and one template per test process (`airlock_system_tests::shared`),
//! run one at a time. What a daemon restart does is in `restart.rs`.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{
    Client, alive, create_sandbox, execution_with_output, http_get, read_all, reason, run, run_as,
    shell,
};
use airlock_system_tests::shared::{Shared, scenario};
use tonic::Code;

const TENANT_TOKEN: &str = "token-of-acme";
/// A token of acme's that may run sandboxes but not make templates.
const RUN_TOKEN: &str = "run-token-of-acme";
/// Sandboxes alive at once, each running an execution.
const CONCURRENT: usize = 20;
const CAPACITY: usize = CONCURRENT + 1;

/// The shared daemon's settings (over the shared defaults).
fn config() -> String {
    format!(
        "pool_size = 2\nmax_sandboxes = {CAPACITY}\n[tenants.acme]\ntokens = [\"{TENANT_TOKEN}\"]\n\
         run_tokens = [\"{RUN_TOKEN}\"]\n"
    )
}

/// The shared daemon, with nothing left live by an earlier scenario that failed.
async fn shared() -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    let (guard, s) = scenario(&config()).await;
    s.clean(&[TENANT_TOKEN]).await;
    (guard, s)
}

async fn destroy(c: &mut Client, id: &str) -> bool {
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .destroyed
}

/// An execution's record once it has ended.
async fn ended(c: &mut Client, execution: &str, within: Duration) -> GetExecutionResponse {
    let started = Instant::now();
    loop {
        let r = execution_with_output(c, execution).await;
        if r.execution.as_ref().unwrap().state != ExecutionState::Running as i32 {
            return r;
        }
        assert!(
            started.elapsed() < within,
            "{execution} still runs after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Executions run at once in the concurrency scenario: `AIRLOCK_TEST_EXEC_PARALLEL`, else all
/// of them on bare-metal KVM and 2 on nested KVM (`kvm_pvm`), where 20 emulated guest kernels
/// forking at once on 2 cores take minutes each, and where another test binary runs beside
/// this one (tests/run.sh): with 5 at once and a disk test beside them, an agent took longer
/// than the daemon's 30 s to start a `cat`.
fn exec_parallelism() -> usize {
    if let Some(n) = std::env::var("AIRLOCK_TEST_EXEC_PARALLEL")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
    {
        return n;
    }
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        2
    } else {
        CONCURRENT
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn template_names_are_unique() {
    let (_serial, s) = shared().await;
    assert_eq!(s.template.name, "base");
    assert!(!s.template.kernel_version.is_empty());
    let mut c = s.client(None).await;
    let dup = c
        .create_template(CreateTemplateRequest {
            name: "base".into(),
            ..Default::default()
        })
        .await;
    let err = match dup {
        Err(e) => e,
        Ok(st) => st.into_inner().message().await.expect_err("a second base"),
    };
    assert_eq!(reason(&err).0, "TEMPLATE_EXISTS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_sandboxes_each_see_only_their_own_files() {
    let (_serial, s) = shared().await;
    let c = s.client(None).await;
    // All 20 are created at once and stay alive together. The guest work in them (the
    // listing and the execution) starts once all are up, in at most `exec_parallelism()` of
    // them at a time: on a nested host a guest's kernel work is emulated, and one guest working
    // while nineteen others are being restored (beside another test binary) was starved past the
    // daemon's 60 s start deadline.
    let mut creates = Vec::new();
    for i in 0..CONCURRENT {
        let mut c = c.clone();
        creates.push(tokio::spawn(async move {
            c.create_sandbox(CreateSandboxRequest {
                files: vec![FileToPlace {
                    path: format!("/tmp/own-{i}"),
                    content: format!("sandbox-{i}").into_bytes(),
                    mode: 0,
                }],
                labels: HashMap::from([("test".into(), "concurrent".into())]),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create {i}: {e:?}"))
            .into_inner()
        }));
    }
    let mut created = Vec::new();
    for task in creates {
        created.push(task.await.unwrap());
    }
    let execs = Arc::new(tokio::sync::Semaphore::new(exec_parallelism()));
    let mut tasks = Vec::new();
    for (i, sb) in created.into_iter().enumerate() {
        let (mut c, execs) = (c.clone(), execs.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = execs.acquire().await.unwrap();
            let listing: Vec<String> = c
                .list_files(ListFilesRequest {
                    sandbox_id: sb.id.clone(),
                    path: "/tmp".into(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("list /tmp of {i}: {e:?}"))
                .into_inner()
                .entries
                .into_iter()
                .map(|e| e.name)
                .collect();
            let (out, _, rec) = run(&mut c, &sb.id, &["cat", &format!("/tmp/own-{i}")]).await;
            (i, sb, out, rec, listing)
        }));
    }
    let mut ids = Vec::new();
    for task in tasks {
        let (i, sb, out, rec, listing) = task.await.unwrap();
        assert_eq!(sb.state, SandboxState::Running as i32);
        assert_eq!(rec.state, ExecutionState::Exited as i32, "{rec:?}");
        assert_eq!(out, format!("sandbox-{i}"), "sandbox {i} read {out:?}");
        assert!(listing.contains(&format!("own-{i}")), "{i}: {listing:?}");
        for j in (0..CONCURRENT).filter(|j| *j != i) {
            assert!(
                !listing.contains(&format!("own-{j}")),
                "sandbox {i} sees sandbox {j}'s file: {listing:?}"
            );
        }
        ids.push(sb.id);
    }
    let mut c = c;
    let listed = c
        .list_sandboxes(ListSandboxesRequest {
            labels: HashMap::from([("test".into(), "concurrent".into())]),
            states: vec![],
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(listed.len(), CONCURRENT);
    for id in &ids {
        assert!(destroy(&mut c, id).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_over_capacity_is_refused_with_details() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let live = c
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes
        .len();
    let mut made = Vec::new();
    for _ in live..CAPACITY {
        made.push(create_sandbox(&mut c, &s.log).await.id);
    }
    let over = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("over capacity");
    assert_eq!(over.code(), Code::ResourceExhausted);
    let (r, meta) = reason(&over);
    assert_eq!(r, "CAPACITY_EXHAUSTED");
    assert_eq!(meta["resource"], "sandboxes");
    assert_eq!(meta["limit"], CAPACITY.to_string());
    assert_eq!(meta["current"], CAPACITY.to_string());
    for id in &made {
        assert!(destroy(&mut c, id).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tenants_see_nothing_of_each_other() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let mut acme = s.client(Some(TENANT_TOKEN)).await;
    let a = create_sandbox(&mut c, &s.log).await;
    let hidden = acme
        .get_sandbox(GetSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .expect_err("another tenant's sandbox");
    assert_eq!(hidden.code(), Code::NotFound);
    let listed = acme
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert!(listed.is_empty(), "{listed:?}");
    assert!(!destroy(&mut acme, &a.id).await, "acme cannot destroy it");
    let bad = s
        .client(Some("wrong"))
        .await
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .expect_err("an unknown token");
    assert_eq!(bad.code(), Code::Unauthenticated);
    let still = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(still.state, SandboxState::Running as i32);
    assert!(destroy(&mut c, &a.id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn files_move_under_the_policy_and_not_outside_it() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;
    let data: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut msgs = vec![WriteFileRequest {
        part: Some(write_file_request::Part::Header(WriteFileHeader {
            sandbox_id: a.id.clone(),
            path: "/tmp/work/data.bin".into(),
            mode: 0o600,
            ..Default::default()
        })),
    }];
    msgs.extend(data.chunks(700_000).map(|ch| WriteFileRequest {
        part: Some(write_file_request::Part::Data(ch.to_vec())),
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
        "read back {} bytes of {}",
        back.len(),
        data.len()
    );
    let listing = c
        .list_files(ListFilesRequest {
            sandbox_id: a.id.clone(),
            path: "/tmp/work".into(),
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
    let forbidden = c
        .read_file(ReadFileRequest {
            sandbox_id: a.id.clone(),
            path: "/etc/shadow".into(),
            ..Default::default()
        })
        .await
        .expect_err("outside the policy");
    assert_eq!(forbidden.code(), Code::PermissionDenied);
    assert_eq!(reason(&forbidden).0, "PATH_NOT_ALLOWED");
    let missing = c
        .read_file(ReadFileRequest {
            sandbox_id: a.id.clone(),
            path: "/tmp/nothing-here".into(),
            ..Default::default()
        })
        .await;
    let missing = match missing {
        Err(e) => e,
        Ok(st) => st.into_inner().message().await.expect_err("a missing file"),
    };
    assert_eq!(missing.code(), Code::NotFound);
    assert_eq!(reason(&missing).0, "FILE_NOT_FOUND");
    assert!(destroy(&mut c, &a.id).await);
}

/// What an execution tries against the guest it runs in; each line names the outcome.
const ESCAPES: &str = r#"id -u; id -g; pwd; echo "$HOME"
grep -E '^(NoNewPrivs|CapEff|CapBnd):' /proc/self/status | tr -s '\t ' ' '
echo $$ > /sys/fs/cgroup/cgroup.procs 2>/dev/null && echo cgroup-left || echo cgroup-held
mount -o remount,size=64g /tmp 2>/dev/null && echo tmp-remounted || echo mount-refused
cat /proc/1/environ >/dev/null 2>&1 && echo agent-read || echo agent-private
python3 -c 'import ctypes; print("ptrace", ctypes.CDLL(None).ptrace(16, 1, 0, 0))'
"#;

/// Writes `data` to `path` in `sandbox` as the guest account `user` (mode 0600).
async fn write_as(c: &mut Client, sandbox: &str, path: &str, user: &str, data: &[u8]) {
    let msgs = vec![
        WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: sandbox.into(),
                path: path.into(),
                mode: 0o600,
                user: user.into(),
            })),
        },
        WriteFileRequest {
            part: Some(write_file_request::Part::Data(data.to_vec())),
        },
    ];
    c.write_file(tokio_stream::iter(msgs)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn code_runs_unprivileged_unless_it_asks_for_root() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;

    let (out, err, _) = run(&mut c, &a.id, &["/bin/sh", "-c", ESCAPES]).await;
    let lines: Vec<&str> = out.lines().collect();
    // The sandbox allows root (the default): no capabilities, but the bounding set is kept and
    // no_new_privs unset, so that sudo can make the user root when it asks.
    assert_eq!(lines.len(), 11, "{out}\nstderr: {err}");
    assert_eq!(
        [&lines[..5], &lines[6..]].concat(),
        [
            "1000",
            "1000",
            "/home/user",
            "/home/user",
            "CapEff: 0000000000000000",
            "NoNewPrivs: 0",
            "cgroup-held",
            "mount-refused",
            "agent-private",
            "ptrace -1",
        ],
        "stderr: {err}"
    );
    assert_ne!(lines[5], "CapBnd: 0000000000000000", "{out}");
    let (out, _, _) = run_as(&mut c, &a.id, "root", &["/bin/sh", "-c", "id -u; pwd"]).await;
    assert_eq!(out, "0\n/root\n");
    let (out, err, rec) = run(&mut c, &a.id, &["sudo", "-n", "id", "-u"]).await;
    assert_eq!((out.as_str(), rec.exit_code), ("0\n", 0), "sudo: {err}");

    // File calls act as the account too: what it writes is its own, what it may not read stays
    // closed.
    write_as(&mut c, &a.id, "/tmp/mine", "", b"user's").await;
    write_as(&mut c, &a.id, "/tmp/roots", "root", b"root's").await;
    let (out, _, _) = run(
        &mut c,
        &a.id,
        &["stat", "-c", "%u %a", "/tmp/mine", "/tmp/roots"],
    )
    .await;
    assert_eq!(out, "1000 600\n0 600\n");
    let denied = c
        .read_file(ReadFileRequest {
            sandbox_id: a.id.clone(),
            path: "/tmp/roots".into(),
            ..Default::default()
        })
        .await;
    let denied = match denied {
        Err(e) => e,
        Ok(st) => st
            .into_inner()
            .message()
            .await
            .expect_err("root's file, read as user"),
    };
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert_eq!(reason(&denied).0, "GUEST_PERMISSION_DENIED");
    let as_root = c
        .read_file(ReadFileRequest {
            sandbox_id: a.id.clone(),
            path: "/tmp/roots".into(),
            user: "root".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(as_root.data, b"root's");
    let nobody = shell(&a.id, "true", 60_000);
    let nobody = ExecRequest {
        user: "no-such-account".into(),
        ..nobody
    };
    let id = c.exec(nobody).await.unwrap().into_inner().execution_id;
    let record = ended(&mut c, &id, Duration::from_secs(120))
        .await
        .execution
        .unwrap();
    assert_eq!(record.state, ExecutionState::Failed as i32, "{record:?}");
    assert!(
        record.error_message.contains("no-such-account"),
        "{record:?}"
    );
    assert!(destroy(&mut c, &a.id).await);
}

/// A sandbox created with `no_root`: root is refused by name (executions and file calls), and
/// the default user's processes are locked down (empty bounding set, no_new_privs), so that
/// `sudo` says which policy refused and no setuid binary gives root back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_root_keeps_root_out_of_reach() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            no_root: true,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    assert!(sb.no_root);
    let script = "grep -E '^(CapBnd|NoNewPrivs):' /proc/self/status | tr -s '\\t ' ' '; \
                  sudo -n id -u; echo \"sudo $?\"; /usr/bin/sudo -n id -u 2>/dev/null; \
                  echo \"setuid $?\"";
    let (out, err, _) = run(&mut c, &sb.id, &["/bin/sh", "-c", script]).await;
    assert_eq!(
        out, "CapBnd: 0000000000000000\nNoNewPrivs: 1\nsudo 1\nsetuid 1\n",
        "stderr: {err}"
    );
    assert!(err.contains("its policy sets no_root"), "{err}");
    let refused = c
        .exec(ExecRequest {
            user: "root".into(),
            ..shell(&sb.id, "id -u", 60_000)
        })
        .await
        .expect_err("exec as root");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(reason(&refused).0, "ROOT_NOT_ALLOWED");
    let refused = match c
        .read_file(ReadFileRequest {
            sandbox_id: sb.id.clone(),
            path: "/etc/shadow".into(),
            user: "root".into(),
        })
        .await
    {
        Err(e) => e,
        Ok(st) => st.into_inner().message().await.expect_err("read as root"),
    };
    assert_eq!(reason(&refused).0, "ROOT_NOT_ALLOWED", "{refused:?}");
    assert!(destroy(&mut c, &sb.id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_resume_replay_and_kill() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;
    let paused = c
        .pause_sandbox(PauseSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.state, SandboxState::Paused as i32);
    let refused = c
        .exec(shell(&a.id, "true", 0))
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
        .exec(shell(&a.id, "sleep 600", 0))
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
    let rec = ended(&mut c, &long.execution_id, Duration::from_secs(60)).await;
    let rec = rec.execution.unwrap();
    assert_eq!(rec.state, ExecutionState::Killed as i32, "{rec:?}");
    assert!(destroy(&mut c, &a.id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_becomes_a_template_whose_clones_have_its_files() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;
    let msgs = vec![
        WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: a.id.clone(),
                path: "/tmp/kept.txt".into(),
                mode: 0,
                ..Default::default()
            })),
        },
        WriteFileRequest {
            part: Some(write_file_request::Part::Data(
                b"kept in the snapshot".to_vec(),
            )),
        },
    ];
    c.write_file(tokio_stream::iter(msgs)).await.unwrap();
    let snap = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: a.id.clone(),
            template_name: "with-data:v1".into(),
            shared: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(snap.source_sandbox_id, a.id);
    assert_eq!((snap.name.as_str(), snap.tag.as_str()), ("with-data", "v1"));
    assert!(snap.size_bytes > 0 && snap.snapshot_format > 0, "{snap:?}");
    let clone = c
        .create_sandbox(CreateSandboxRequest {
            template: "with-data:v1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(clone.template_id, snap.id);
    assert_eq!(clone.template, "with-data:v1");
    let copy = read_all(&mut c, &clone.id, "/tmp/kept.txt").await;
    assert_eq!(copy, b"kept in the snapshot");
    // A second version while the first one's sandbox runs; the bare name is the newest.
    let v2 = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: a.id.clone(),
            template_name: "with-data:v2".into(),
            shared: false,
        })
        .await
        .unwrap()
        .into_inner();
    let listed = c
        .list_templates(ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates;
    let versions: HashMap<_, _> = listed
        .iter()
        .filter(|t| t.name == "with-data")
        .map(|t| (t.tag.as_str(), t.live_sandboxes))
        .collect();
    assert_eq!(versions, HashMap::from([("v1", 1), ("v2", 0)]));
    // Deleting a version in use is refused, naming its sandbox; the bare name is ambiguous.
    let busy = c
        .delete_template(DeleteTemplateRequest {
            name: "with-data:v1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&busy).0, "TEMPLATE_IN_USE", "{busy:?}");
    assert!(busy.message().contains(&clone.id), "{busy:?}");
    let ambiguous = c
        .delete_template(DeleteTemplateRequest {
            name: "with-data".into(),
        })
        .await
        .unwrap_err();
    assert!(ambiguous.message().contains("v1"), "{ambiguous:?}");
    // A run-only token of the same tenant may use templates but not make or delete them.
    let mut runner = s.client(Some(RUN_TOKEN)).await;
    let denied = runner
        .delete_template(DeleteTemplateRequest {
            name: "base".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&denied).0, "NOT_PERMITTED", "{denied:?}");
    let denied = runner
        .create_template(CreateTemplateRequest {
            name: "mine".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&denied).0, "NOT_PERMITTED", "{denied:?}");
    // A sandbox snapshot has no recipe to rebuild, and no build log.
    let log = c
        .get_template_log(GetTemplateLogRequest {
            name: "with-data:v2".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(log.log.is_empty());
    let norecipe = c
        .rebuild_template(RebuildTemplateRequest {
            name: "with-data:v2".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(norecipe.message().contains("no recipe"), "{norecipe:?}");
    assert!(destroy(&mut c, &clone.id).await);
    assert!(destroy(&mut c, &a.id).await);
    for v in ["with-data:v1", "with-data"] {
        c.delete_template(DeleteTemplateRequest { name: v.into() })
            .await
            .unwrap();
    }
    assert!(
        !c.list_templates(ListTemplatesRequest {})
            .await
            .unwrap()
            .into_inner()
            .templates
            .iter()
            .any(|t| t.id == v2.id || t.id == snap.id)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_sandboxes_creates_and_executions() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let value_in = |text: &str, prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    let before = http_get(s.metrics_port, "/metrics").await;
    let a = create_sandbox(&mut c, &s.log).await;
    // Executions and file transfers share the connection the create opened.
    for argv in [
        &["true"][..],
        &["true"],
        &["sh", "-c", "echo shared > /tmp/mux"],
    ] {
        let (_, _, rec) = run(&mut c, &a.id, argv).await;
        assert_eq!(rec.state, ExecutionState::Exited as i32);
    }
    assert_eq!(read_all(&mut c, &a.id, "/tmp/mux").await, b"shared\n");
    let text = http_get(s.metrics_port, "/metrics").await;
    let value = |prefix: &str| value_in(&text, prefix);
    assert_eq!(
        value("airlock_agent_connections_total"),
        value_in(&before, "airlock_agent_connections_total") + 1,
        "one agent connection for the create, three executions and a file read"
    );
    assert!(value("airlock_sandboxes{state=\"running\"}") >= 1);
    assert!(value("airlock_create_seconds_count") >= 1);
    assert!(value("airlock_executions_total{outcome=\"exited\"}") >= 1);
    assert!(
        text.contains(&format!(
            "airlock_sandbox_memory_bytes{{sandbox=\"{}\"",
            a.id
        )),
        "{text}"
    );
    assert!(destroy(&mut c, &a.id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timeout_holds_without_a_client() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;
    let ex = c
        .exec(shell(&a.id, "echo before; sleep 600", 2000))
        .await
        .unwrap()
        .into_inner();
    let r = ended(&mut c, &ex.execution_id, Duration::from_secs(30)).await;
    let rec = r.execution.unwrap();
    assert_eq!(rec.state, ExecutionState::TimedOut as i32, "{rec:?}");
    assert_eq!(rec.error_reason, "EXEC_TIMEOUT");
    let ran = rec.ended_unix_ms - rec.started_unix_ms;
    assert!(
        (2000..2000 + 3000 + 2000).contains(&ran),
        "ended after {ran} ms"
    );
    assert!(destroy(&mut c, &a.id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_vmm_is_reported_dead() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let b = create_sandbox(&mut c, &s.log).await;
    assert!(b.vmm_pid > 0);
    // SAFETY: kill(2) on the VMM pid the daemon reported; no memory is involved.
    assert_eq!(unsafe { libc::kill(b.vmm_pid as i32, 9) }, 0);
    let started = Instant::now();
    let dead = loop {
        let r = c
            .get_sandbox(GetSandboxRequest {
                sandbox_id: b.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        if r.state == SandboxState::Dead as i32 {
            break r;
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
    assert!(!alive(b.vmm_pid));
    let on_dead = c
        .exec(shell(&b.id, "true", 0))
        .await
        .expect_err("exec on a dead sandbox");
    assert_eq!(on_dead.code(), Code::Unavailable);
    assert_eq!(reason(&on_dead).0, "SANDBOX_DEAD");
    assert!(
        !destroy(&mut c, &b.id).await,
        "a dead sandbox has nothing to destroy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn destroy_is_idempotent() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let a = create_sandbox(&mut c, &s.log).await;
    assert!(destroy(&mut c, &a.id).await);
    assert!(!destroy(&mut c, &a.id).await);
    assert!(!destroy(&mut c, "sb-0123456789abcdef").await);
    let bad = c
        .destroy_sandbox(DestroySandboxRequest {
            sandbox_id: "../etc".into(),
        })
        .await
        .expect_err("not an id");
    assert_eq!(bad.code(), Code::InvalidArgument);
    let rec = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: a.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rec.state, SandboxState::Destroyed as i32);
    assert_eq!(rec.end_reason, "DESTROYED");
}
