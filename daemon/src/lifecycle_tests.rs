//! The lifecycle without KVM: a daemon built on the [`FakeLauncher`](crate::fake) (VMMs that
//! are threads serving real control and vsock sockets) creates, runs, pauses, snapshots,
//! destroys, loses VMMs, meets hostile guests, and adopts what a previous daemon left.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::*;

use crate::config::Config;
use crate::daemon::Daemon;
use crate::fake::{FakeLauncher, Guest};
use crate::store::{Owner, VmmRecord};

struct TestDaemon {
    daemon: Arc<Daemon>,
    launcher: Arc<FakeLauncher>,
    dir: std::path::PathBuf,
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        for vm in self.launcher.vms.lock().unwrap().values() {
            vm.end(libc::SIGKILL);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(dir: &std::path::Path) -> Config {
    let image = dir.join("image");
    std::fs::write(&image, b"x").unwrap();
    Config {
        data_dir: dir.join("data"),
        kernel: Some(image.clone()),
        rootfs: Some(image),
        pool_size: 1,
        ready_timeout_ms: 2000,
        ..Config::default()
    }
}

/// A started daemon over fake VMMs in a fresh directory, with the template `base`.
async fn daemon(tag: &str) -> TestDaemon {
    daemon_with(tag, |_| {}).await
}

/// [`daemon`] with settings changed by `set`.
async fn daemon_with(tag: &str, set: impl FnOnce(&mut Config)) -> TestDaemon {
    let dir = std::env::temp_dir().join(format!("airlock-lc-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let launcher = Arc::new(FakeLauncher::default());
    let mut cfg = config(&dir);
    set(&mut cfg);
    let t = start(cfg, &dir, launcher).await;
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    let req = CreateTemplateRequest {
        name: "base".into(),
        ..Default::default()
    };
    t.daemon.create_template("default", req, tx).await.unwrap();
    t
}

async fn start(cfg: Config, dir: &std::path::Path, launcher: Arc<FakeLauncher>) -> TestDaemon {
    let (daemon, events) =
        Daemon::build(cfg.clone(), cfg.data_dir.clone(), launcher.clone(), None).unwrap();
    daemon.start(events).await.unwrap();
    TestDaemon {
        daemon,
        launcher,
        dir: dir.to_path_buf(),
    }
}

async fn create(t: &TestDaemon) -> Result<Sandbox, crate::error::ApiError> {
    t.daemon
        .sandboxes
        .create("default", CreateSandboxRequest::default())
        .await
}

async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn exec_req(sandbox: &str, argv: &[&str], timeout_ms: u64) -> ExecRequest {
    ExecRequest {
        sandbox_id: sandbox.into(),
        command: Some(exec_request::Command::Argv(Argv {
            args: argv.iter().map(|s| s.to_string()).collect(),
        })),
        timeout_ms,
        ..Default::default()
    }
}

async fn finished(t: &TestDaemon, id: &str) -> Execution {
    eventually("the execution's end", || {
        let (rec, _) = t.daemon.executions.get("default", id).unwrap();
        (rec.state() != ExecutionState::Running).then_some(rec)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_is_created_runs_pauses_snapshots_and_is_destroyed() {
    let t = daemon("life").await;
    let s = create(&t).await.unwrap();
    assert_eq!(s.state(), SandboxState::Running);
    let sb = t.daemon.sandboxes.running("default", &s.id).unwrap();
    let ex = t
        .daemon
        .executions
        .start(
            &sb.exec_target().unwrap(),
            &exec_req(&s.id, &["echo", "hi"], 5000),
        )
        .unwrap();
    let rec = finished(&t, &ex).await;
    assert_eq!(rec.state(), ExecutionState::Exited, "{rec:?}");
    let mode = |p: &std::path::Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(
        mode(&t.daemon.data_dir),
        0o700,
        "the data directory is the daemon's"
    );
    assert_eq!(mode(&t.daemon.data_dir.join("airlock.db")), 0o600);
    assert_eq!(mode(&t.daemon.executions.output_paths(&ex)[0]), 0o600);
    let out = t
        .daemon
        .executions
        .read_output(&ex, 1 << 20)
        .await
        .unwrap()
        .0;
    assert_eq!(out[0], b"echo hi");
    let paused = t.daemon.sandboxes.pause("default", &s.id).await.unwrap();
    assert_eq!(paused.state(), SandboxState::Paused);
    let refused = t.daemon.sandboxes.running("default", &s.id).unwrap_err();
    assert_eq!(refused.reason(), "SANDBOX_NOT_RUNNING");
    let tpl = t
        .daemon
        .snapshot_sandbox("default", &s.id, "mine", false)
        .await
        .unwrap();
    assert_eq!(tpl.record.source_sandbox_id, s.id);
    // A snapshot holds what ran in the sandbox: shared with every tenant only when asked, and
    // only by the default tenant (the operator).
    assert_eq!(tpl.record.tenant, "default");
    assert!(t.daemon.templates.find("other", "mine").is_err());
    t.daemon.templates.own("default", "mine").unwrap();
    let shared = t.daemon.snapshot_sandbox("default", &s.id, "ours", true);
    assert_eq!(shared.await.unwrap().record.tenant, "");
    t.daemon.templates.find("other", "ours").unwrap();
    let refused = t.daemon.snapshot_sandbox("other", &s.id, "theirs", true);
    assert_eq!(refused.await.unwrap_err().reason(), "INVALID_ARGUMENT");
    t.daemon.sandboxes.resume("default", &s.id).await.unwrap();
    let vm = t.launcher.vms.lock().unwrap()[&s.vmm_pid].clone();
    assert!(t.daemon.sandboxes.destroy("default", &s.id).await.unwrap());
    assert!(vm.is_dead());
    assert!(!t.daemon.sandboxes.destroy("default", &s.id).await.unwrap());
    let ended = t.daemon.sandboxes.get("default", &s.id).unwrap();
    assert_eq!(ended.state(), SandboxState::Destroyed);
    assert_eq!(ended.end_reason, "DESTROYED");
    let run_dirs = std::fs::read_dir(t.daemon.data_dir.join("run"))
        .unwrap()
        .count();
    assert_eq!(run_dirs, 3, "only the three warm pools' VMMs are left");
}

async fn build_as(
    t: &TestDaemon,
    tenant: &str,
    req: CreateTemplateRequest,
) -> Result<Template, String> {
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    t.daemon
        .create_template(tenant, req, tx)
        .await
        .map(|t| t.record)
        .map_err(|e| format!("{} {e}", e.reason()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_name_images_never_host_files_and_see_no_host_paths() {
    let t = daemon("images").await;
    let named = |name: &str, kernel: &str, image: &str| CreateTemplateRequest {
        name: name.into(),
        kernel_path: kernel.into(),
        image: image.into(),
        ..Default::default()
    };
    let err = build_as(&t, "acme", named("a", "/etc/shadow", ""))
        .await
        .unwrap_err();
    assert!(err.starts_with("INVALID_ARGUMENT"), "{err}");
    assert!(!err.contains("/etc/shadow"), "{err}");
    let err = build_as(&t, "acme", named("b", "", "nope"))
        .await
        .unwrap_err();
    assert!(err.contains("no image \"nope\""), "{err}");
    let ok = build_as(&t, "acme", named("c", "", "default"))
        .await
        .unwrap();
    assert_eq!(ok.image, "default");
    let seen = crate::templates::as_seen_by(ok.clone(), false);
    assert!(seen.kernel_path.is_empty() && seen.rootfs_path.is_empty());
    assert!(
        !crate::templates::as_seen_by(ok, true)
            .kernel_path
            .is_empty()
    );
    // An operator may name host files, and is told what is wrong with them.
    let err = build_as(&t, "default", named("d", "/nonexistent/vmlinux", ""))
        .await
        .unwrap_err();
    assert!(err.contains("/nonexistent/vmlinux"), "{err}");
    // A failed build tells a tenant that it failed, not what the guest's console said.
    t.launcher.set_guest(Guest::FailBuilds);
    let err = build_as(&t, "acme", named("e", "", "")).await.unwrap_err();
    assert!(
        err.starts_with("INTERNAL") && !err.contains("secret"),
        "{err}"
    );
    let err = build_as(&t, "default", named("f", "", ""))
        .await
        .unwrap_err();
    assert!(err.contains("secret"), "the operator sees the log: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_builds_are_capped_admitted_timed_out_and_counted() {
    let t = daemon_with("builds", |c| {
        c.max_sandboxes = 1;
        c.template_build_timeout_s = 1;
        let acme = crate::config::TenantConfig {
            tokens: vec!["t".into()],
            quota: Some(crate::config::Quota {
                max_templates: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        c.tenants.insert("acme".into(), acme);
    })
    .await;
    let named = |name: &str| CreateTemplateRequest {
        name: name.into(),
        ..Default::default()
    };
    let huge = CreateTemplateRequest {
        memory_mib: 1 << 20,
        ..named("huge")
    };
    let err = build_as(&t, "acme", huge).await.unwrap_err();
    assert!(err.starts_with("INVALID_ARGUMENT"), "{err}");
    build_as(&t, "acme", named("first")).await.unwrap();
    let err = build_as(&t, "acme", named("second")).await.unwrap_err();
    assert!(err.starts_with("QUOTA_EXCEEDED"), "{err}");
    // A build holds its VM's place like a sandbox while it runs, and ends at its timeout.
    t.launcher.set_guest(Guest::HangBuilds);
    let d = t.daemon.clone();
    let hanging = tokio::spawn(async move {
        let (tx, _rx) = tokio::sync::mpsc::channel(64);
        d.create_template("default", named("slow"), tx).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let full = create(&t).await.unwrap_err();
    assert_eq!(full.reason(), "CAPACITY_EXHAUSTED", "{full}");
    let err = hanging.await.unwrap().unwrap_err();
    assert!(err.to_string().contains("took longer"), "{err}");
    t.launcher.set_guest(Guest::Normal);
    let s = create(&t).await.unwrap();
    assert_eq!(
        s.state(),
        SandboxState::Running,
        "the build's place is free again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_output_then_records_and_caps_a_tenants_output() {
    let t = daemon_with("retention", |c| c.default_quota.max_output_mib = 1).await;
    let s = create(&t).await.unwrap();
    let sb = t.daemon.sandboxes.running("default", &s.id).unwrap();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let req = exec_req(&s.id, &["big", "700000"], 5000);
        let ex = t
            .daemon
            .executions
            .start(&sb.exec_target().unwrap(), &req)
            .unwrap();
        finished(&t, &ex).await;
        ids.push(ex);
    }
    let usage = t.daemon.usage("default").unwrap();
    assert_eq!(usage.output_bytes, 1_400_000);
    assert_eq!(usage.live_sandboxes, 1);
    assert_eq!(usage.execution_records, 2);
    // Over the tenant's 1 MiB: the oldest output goes, the newest stays.
    let now = crate::ids::now_ms();
    let swept = t.daemon.retention.sweep(now).unwrap();
    assert_eq!((swept.outputs, swept.bytes), (1, 700_000));
    let (first, _) = t.daemon.executions.get("default", &ids[0]).unwrap();
    assert!(first.output_deleted);
    let out = t
        .daemon
        .executions
        .read_output(&ids[0], 1 << 20)
        .await
        .unwrap()
        .0;
    assert!(out[0].is_empty(), "deleted output reads as empty");
    assert_eq!(t.daemon.usage("default").unwrap().output_bytes, 700_000);
    // An ended sandbox's output goes after a day, its records after a week.
    t.daemon.sandboxes.destroy("default", &s.id).await.unwrap();
    let day = 24 * 3600 * 1000;
    assert_eq!(
        t.daemon.retention.sweep(now + day / 2).unwrap(),
        Default::default()
    );
    let swept = t.daemon.retention.sweep(now + day + 1000).unwrap();
    assert_eq!((swept.outputs, swept.sandbox_records), (1, 0));
    let swept = t.daemon.retention.sweep(now + 8 * day).unwrap();
    assert_eq!(swept.sandbox_records, 1);
    assert!(t.daemon.store.sandbox(&s.id).unwrap().is_none());
    assert!(t.daemon.store.execution(&ids[1]).unwrap().is_none());
    let usage = t.daemon.usage("default").unwrap();
    assert_eq!((usage.sandbox_records, usage.execution_records), (0, 0));
    assert_eq!(usage.record_retention_s, 7 * 24 * 3600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vmm_that_dies_ends_its_sandbox_with_the_reason() {
    let t = daemon("dies").await;
    let s = create(&t).await.unwrap();
    let vm = t.launcher.vms.lock().unwrap()[&s.vmm_pid].clone();
    vm.end(libc::SIGKILL);
    let dead = eventually("the sandbox's death", || {
        let r = t.daemon.sandboxes.get("default", &s.id).unwrap();
        (r.state() == SandboxState::Dead).then_some(r)
    })
    .await;
    assert_eq!(dead.end_reason, "SANDBOX_DEAD");
    assert!(
        dead.end_message.contains("signal 9"),
        "{}",
        dead.end_message
    );
    let err = t.daemon.sandboxes.running("default", &s.id).unwrap_err();
    assert_eq!(err.reason(), "SANDBOX_DEAD");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_never_says_ready_fails_its_create_in_time() {
    let t = daemon("stall").await;
    t.launcher.set_guest(Guest::StallBeforeReady);
    let began = Instant::now();
    let err = create(&t).await.unwrap_err();
    assert_eq!(err.reason(), "AGENT_UNAVAILABLE", "{err}");
    assert!(
        began.elapsed() < Duration::from_secs(8),
        "{:?}",
        began.elapsed()
    );
    let listed = t
        .daemon
        .sandboxes
        .list("default", &Default::default(), &[SandboxState::Dead as i32])
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].end_reason, "AGENT_UNAVAILABLE");
    assert!(t.daemon.sandboxes.all().is_empty(), "nothing is left live");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_stalled_before_ready_is_cut_by_its_timeout() {
    let t = daemon("cut").await;
    let s = create(&t).await.unwrap();
    t.launcher.set_guest(Guest::StallBeforeReady);
    let sb = t.daemon.sandboxes.running("default", &s.id).unwrap();
    // The create's connection is gone: the execution has to connect again, to a guest that
    // never says Ready.
    sb.vmm().unwrap().agent.close("the test drops it");
    let began = Instant::now();
    let ex = t
        .daemon
        .executions
        .start(&sb.exec_target().unwrap(), &exec_req(&s.id, &["true"], 300))
        .unwrap();
    let rec = finished(&t, &ex).await;
    assert_eq!(rec.state(), ExecutionState::TimedOut, "{rec:?}");
    assert_eq!(rec.error_reason, "EXEC_TIMEOUT");
    assert!(
        began.elapsed() < Duration::from_secs(6),
        "{:?}",
        began.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_directory_entries_is_refused() {
    let t = daemon("flood").await;
    let s = create(&t).await.unwrap();
    t.launcher.set_guest(Guest::FloodListing);
    let sb = t.daemon.sandboxes.running("default", &s.id).unwrap();
    // A new connection, to the flooding guest.
    sb.vmm().unwrap().agent.close("the test drops it");
    let target = sb.file_target(1 << 20).unwrap();
    let err = crate::files::list(target, "/tmp".into(), false, 0)
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "AGENT_UNAVAILABLE");
    assert!(err.to_string().contains("entries"), "{err}");
}

/// What a killed daemon leaves in `cfg`'s data directory: a VMM recorded as a running
/// sandbox's, its records, and an execution running in its guest with 6 of its 12 bytes of
/// output stored. Returns the VM, the sandbox's and the execution's ids.
fn leave_behind(
    cfg: &Config,
    launcher: &FakeLauncher,
) -> (Arc<crate::fake::FakeVm>, String, String) {
    std::fs::create_dir_all(cfg.data_dir.join("output")).unwrap();
    let store = crate::store::Store::open(&cfg.data_dir.join("airlock.db")).unwrap();
    let run_dir = cfg.data_dir.join("run/vm-00000000000000aa");
    let vm = launcher.running_vm(&run_dir);
    vm.start_exec(77, b"before after");
    let (sb, ex) = ("sb-00000000000000aa", "ex-00000000000000aa");
    let vmm = VmmRecord {
        id: "vm-00000000000000aa".into(),
        pid: vm.pid,
        start_ticks: 0,
        uid: None,
        run_dir: run_dir.display().to_string(),
        cgroup: false,
        owner: Owner::Pool("tpl-1".into()),
    };
    store.put_vmm(&vmm).unwrap();
    let sandbox = Sandbox {
        id: sb.into(),
        tenant: "default".into(),
        state: SandboxState::Running as i32,
        max_lifetime_s: 3600,
        idle_ttl_s: 3600,
        created_unix_ms: crate::ids::now_ms(),
        ..Default::default()
    };
    let spec = CreateSandboxRequest {
        env: [("K".to_owned(), "V".to_owned())].into(),
        ..Default::default()
    };
    store.put_running(&sandbox, &spec, None, &vmm.id).unwrap();
    let execution = Execution {
        id: ex.into(),
        sandbox_id: sb.into(),
        tenant: "default".into(),
        state: ExecutionState::Running as i32,
        started_unix_ms: crate::ids::now_ms(),
        timeout_ms: 60_000,
        ..Default::default()
    };
    store.put_execution(&execution).unwrap();
    store.set_execution_agent(ex, 77).unwrap();
    std::fs::write(cfg.data_dir.join(format!("output/{ex}.stdout")), b"before").unwrap();
    std::fs::write(cfg.data_dir.join(format!("output/{ex}.stderr")), b"").unwrap();
    (vm, sb.into(), ex.into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_adopts_a_running_sandbox_and_follows_its_execution() {
    let dir = std::env::temp_dir().join(format!("airlock-lc-adopt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config(&dir);
    let launcher = Arc::new(FakeLauncher::default());
    let (vm, sb, ex) = leave_behind(&cfg, &launcher);
    let t = start(cfg, &dir, launcher).await;
    let rt = t.daemon.sandboxes.running("default", &sb).unwrap();
    assert_eq!(rt.env["K"], "V", "the environment is kept");
    assert_eq!(rt.vmm().unwrap().pid, vm.pid);
    let (_, live) = t.daemon.executions.get("default", &ex).unwrap();
    assert!(live.is_some(), "the execution is followed again");
    assert!(t.daemon.executions.kill("default", &ex, 0).unwrap());
    let rec = finished(&t, &ex).await;
    assert_eq!(rec.state(), ExecutionState::Killed, "{rec:?}");
    let out = t
        .daemon
        .executions
        .read_output(&ex, 1 << 20)
        .await
        .unwrap()
        .0;
    assert_eq!(
        out[0], b"before after",
        "the output continues without a gap"
    );
    assert!(!vm.is_dead(), "the adopted VMM still runs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_at_admission_leaves_no_secret_behind() {
    let t = daemon_with("secret-refused", |c| c.max_sandboxes = 1).await;
    create(&t).await.unwrap();
    let value = "refused-create-canary-8c1f2e";
    let req = CreateSandboxRequest {
        secrets: vec![Secret {
            name: "KEY".into(),
            value: value.into(),
            delivery: Some(secret::Delivery::Env(SecretEnv::default())),
            ttl_s: 0,
        }],
        ..Default::default()
    };
    let err = t.daemon.sandboxes.create("default", req).await.unwrap_err();
    assert_eq!(err.reason(), "CAPACITY_EXHAUSTED", "{err}");
    // The refused sandbox's value is not kept for redaction (nor anywhere else) after the call.
    assert_eq!(crate::secrets::logs::redact(None, value), value);
}

/// Seals secret `K` = "after" for sandbox `sb` (left behind in `cfg`'s data directory) under
/// `sealer`, as a daemon does at create.
fn seal_for(cfg: &Config, sb: &str, sealer: &crate::secrets::seal::Sealer) {
    let store = crate::store::Store::open(&cfg.data_dir.join("airlock.db")).unwrap();
    let secret = Secret {
        name: "K".into(),
        value: "after".into(),
        delivery: None,
        ttl_s: 0,
    };
    let secrets =
        crate::secrets::SandboxSecrets::new(crate::secrets::check(&[secret], false).unwrap());
    store
        .put_sealed_secrets(sb, &secrets.seal(sb, sealer).unwrap())
        .unwrap();
    let mut record = store.sandbox(sb).unwrap().unwrap();
    record.secrets = secrets.info();
    store.put_sandbox(&record).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_adopts_a_sandbox_with_its_sealed_secrets_only_under_its_key() {
    let dir = std::env::temp_dir().join(format!("airlock-lc-sealed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config(&dir);
    let launcher = Arc::new(FakeLauncher::default());
    let (vm, sb, ex) = leave_behind(&cfg, &launcher);
    let sealer = crate::secrets::seal::Sealer::load(&cfg.secrets, &cfg.data_dir)
        .unwrap()
        .unwrap();
    seal_for(&cfg, &sb, &sealer);
    let t = start(cfg.clone(), &dir, launcher.clone()).await;
    let rt = t.daemon.sandboxes.running("default", &sb).unwrap();
    assert_eq!(
        rt.secrets.env().0["K"],
        "after",
        "its variable is given again"
    );
    assert_eq!(rt.vmm().unwrap().pid, vm.pid);
    assert!(t.daemon.executions.kill("default", &ex, 0).unwrap());
    finished(&t, &ex).await;
    let out = t
        .daemon
        .executions
        .read_output(&ex, 1 << 20)
        .await
        .unwrap()
        .0;
    assert_eq!(
        out[0], b"before [REDACTED:K]",
        "what it follows is redacted"
    );
    t.daemon.sandboxes.destroy("default", &sb).await.unwrap();
    assert_eq!(t.daemon.store.sealed_secrets(&sb).unwrap(), None);
    drop(t);

    // Sealed under another key (the daemon's was lost or rotated): not adopted, wiped.
    let dir = std::env::temp_dir().join(format!("airlock-lc-sealed2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config(&dir);
    let (vm, sb, _) = leave_behind(&cfg, &launcher);
    seal_for(
        &cfg,
        &sb,
        &crate::secrets::seal::Sealer::from_key(&[9; 32], "test"),
    );
    let t = start(cfg, &dir, launcher).await;
    assert!(t.daemon.sandboxes.running("default", &sb).is_err());
    let record = t.daemon.store.sandbox(&sb).unwrap().unwrap();
    assert_eq!(record.end_reason, "DAEMON_RESTARTED", "{record:?}");
    assert!(vm.is_dead(), "its VMM was reaped");
    assert_eq!(t.daemon.store.sealed_secrets(&sb).unwrap(), None);
}

/// RunCode through the gRPC service and `/execute` through the E2B gateway reach the fake
/// guest's interpreter over the sandbox's vsock socket; a secret in the cell's output is
/// redacted in both.
#[tokio::test]
async fn a_cell_runs_through_grpc_and_the_e2b_gateway() {
    use airlock_api::v1::airlock_server::Airlock as _;
    use tokio_stream::StreamExt as _;
    use tower::ServiceExt as _;

    let t = daemon("interp").await;
    let secret = "s3cr3t-value-42";
    let req = CreateSandboxRequest {
        secrets: vec![Secret {
            name: "TOKEN".into(),
            value: secret.into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let sb = t.daemon.sandboxes.create("default", req).await.unwrap();
    let service = crate::service::Service {
        daemon: t.daemon.clone(),
        cluster: None,
    };
    let mut req = tonic::Request::new(RunCodeRequest {
        sandbox_id: sb.id.clone(),
        code: format!("print('{secret}')"),
        ..Default::default()
    });
    req.extensions_mut()
        .insert(crate::auth::Tenant("default".into()));
    let events: Vec<_> = service
        .run_code(req)
        .await
        .unwrap()
        .into_inner()
        .collect()
        .await;
    let events: Vec<_> = events
        .into_iter()
        .map(|e| e.unwrap().event.unwrap())
        .collect();
    let run_code_event::Event::Stdout(out) = &events[0] else {
        panic!("{events:?}")
    };
    assert_eq!(out.text, "print('[REDACTED:TOKEN]')");
    let Some(run_code_event::Event::End(end)) = events.last() else {
        panic!("{events:?}")
    };
    assert_eq!((end.state(), end.execution_count), (CodeState::Ok, 1));

    let tokens = Arc::new(crate::auth::Tokens::from_config(&t.daemon.cfg).unwrap());
    let cfg = crate::e2b::E2bConfig::default();
    let gw = Arc::new(crate::e2b::Gateway::new(t.daemon.clone(), cfg, tokens).unwrap());
    let request = axum::http::Request::post("/execute")
        .header("e2b-sandbox-id", &sb.id)
        .header("e2b-sandbox-port", "49999")
        .header("x-access-token", gw.access_token(&sb.id))
        .body(axum::body::Body::from(format!(
            r#"{{"code":"x = '{secret}'"}}"#
        )))
        .unwrap();
    let answer = crate::e2b::router(gw.clone())
        .oneshot(request)
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let body = axum::body::to_bytes(answer.into_body(), 1 << 20)
        .await
        .unwrap();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(!body.contains(secret), "{body}");
    let lines: Vec<serde_json::Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["text"], "x = '[REDACTED:TOKEN]'");
    assert_eq!(lines[1]["text"], "2");
    assert_eq!(lines.last().unwrap()["type"], "end_of_execution");

    // The context calls send the traffic token only (as E2B's SDK does); it opens the
    // interpreter's port, not envd's. Without a token: refused.
    let contexts = |port: &str, traffic: Option<String>| {
        let mut r = axum::http::Request::get("/contexts")
            .header("e2b-sandbox-id", &sb.id)
            .header("e2b-sandbox-port", port);
        if let Some(t) = traffic {
            r = r.header("e2b-traffic-access-token", t);
        }
        r.body(axum::body::Body::empty()).unwrap()
    };
    let traffic = gw.traffic_token(&sb.id);
    let app = crate::e2b::router(gw.clone());
    let answer = app
        .clone()
        .oneshot(contexts("49999", Some(traffic.clone())))
        .await;
    assert_eq!(answer.unwrap().status(), 200);
    let answer = app.clone().oneshot(contexts("49983", Some(traffic))).await;
    assert_eq!(answer.unwrap().status(), 401);
    let answer = app
        .clone()
        .oneshot(contexts("49999", Some(gw.access_token("sb-other"))))
        .await;
    assert_eq!(answer.unwrap().status(), 401);
    let answer = app.oneshot(contexts("49999", None)).await;
    assert_eq!(answer.unwrap().status(), 401);
}
