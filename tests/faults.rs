//! The fault matrix, through a real gRPC client with real VMs: each fault ends in its
//! documented state and error, and leaves nothing behind (no VMM process, cgroup or run
//! directory of the sandbox it hit): a VMM killed mid-execution, a guest kernel panic, the OOM
//! killer in a VMM's cgroup, a fork bomb, a flood of output, and the host's data directory
//! running full (creates fail with
//! CAPACITY_EXHAUSTED `data_dir`, nothing is corrupted, and the service resumes when space
//! returns). One daemon and template for all, its data directory on a tmpfs that can fill up.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{
    Client, alive, cgroups_left, create_sandbox, reason, run, shell,
};
use airlock_system_tests::shared::{Shared, scenario_with};

/// Output stored per stream.
const MAX_OUTPUT: u64 = 1 << 20;

async fn shared() -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    let config = format!("pool_size = 1\nmax_output_bytes = {MAX_OUTPUT}\n");
    let (guard, s) = scenario_with(&config, Some(1536)).await;
    s.clean(&[]).await;
    (guard, s)
}

/// Polls `f` every 100 ms until it answers, for at most `secs`.
async fn until<T>(what: &str, secs: u64, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "{what} within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn ended_sandbox(c: &mut Client, id: &str) -> Sandbox {
    until("the sandbox's end", 120, async || {
        let r = c
            .get_sandbox(GetSandboxRequest {
                sandbox_id: id.into(),
            })
            .await
            .unwrap()
            .into_inner();
        (r.state == SandboxState::Dead as i32 || r.state == SandboxState::Destroyed as i32)
            .then_some(r)
    })
    .await
}

async fn ended_execution(c: &mut Client, id: &str, secs: u64) -> GetExecutionResponse {
    until("the execution's end", secs, async || {
        let r = c
            .get_execution(GetExecutionRequest {
                execution_id: id.into(),
                include_output: true,
            })
            .await
            .unwrap()
            .into_inner();
        (r.execution.as_ref().unwrap().state != ExecutionState::Running as i32).then_some(r)
    })
    .await
}

/// Nothing of the sandbox whose VMM was `pid` is left on the host.
fn nothing_left_of(s: &Shared, pid: u32) {
    assert!(!alive(pid), "its VMM {pid} runs on");
    let live_dirs = std::fs::read_dir(s.data_dir.join("run")).unwrap().count();
    // Only the warm pool's (pool_size 1) may be there.
    assert!(live_dirs <= 1, "run directories left: {live_dirs}");
    assert!(
        cgroups_left(&s.cgroup_parent).len() <= 4,
        "cgroups beyond the pool's"
    );
}

/// The daemon's resident memory, KiB.
fn daemon_rss_kib(s: &Shared) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", s.pid))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_vmm_killed_mid_execution_ends_both_with_a_reason() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create_sandbox(&mut c, &s.log).await;
    let ex = c
        .exec(shell(&sb.id, "sleep 600", 0))
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // SAFETY: kill(2) on the VMM pid the daemon reported.
    assert_eq!(unsafe { libc::kill(sb.vmm_pid as i32, libc::SIGKILL) }, 0);
    let dead = ended_sandbox(&mut c, &sb.id).await;
    assert_eq!(dead.state, SandboxState::Dead as i32);
    assert_eq!(dead.end_reason, "SANDBOX_DEAD", "{dead:?}");
    let rec = ended_execution(&mut c, &ex.execution_id, 30)
        .await
        .execution
        .unwrap();
    assert_eq!(rec.state, ExecutionState::Failed as i32, "{rec:?}");
    assert_eq!(rec.error_reason, "SANDBOX_DEAD");
    nothing_left_of(s, sb.vmm_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_guest_kernel_panic_ends_the_sandbox_as_guest_crashed() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create_sandbox(&mut c, &s.log).await;
    // Only root may trigger a panic (an unprivileged execution is refused).
    let panic = ExecRequest {
        user: "root".into(),
        ..shell(&sb.id, "echo c > /proc/sysrq-trigger", 0)
    };
    let ex = c.exec(panic).await.unwrap().into_inner();
    let dead = ended_sandbox(&mut c, &sb.id).await;
    assert_eq!(dead.end_reason, "GUEST_CRASHED", "{dead:?}");
    let rec = ended_execution(&mut c, &ex.execution_id, 30)
        .await
        .execution
        .unwrap();
    assert_eq!(rec.error_reason, "GUEST_CRASHED", "{rec:?}");
    let refused = c
        .exec(shell(&sb.id, "true", 0))
        .await
        .expect_err("a dead sandbox");
    assert_eq!(reason(&refused).0, "GUEST_CRASHED");
    nothing_left_of(s, sb.vmm_pid);
}

/// The memory cgroup directory of process `pid` (cgroup v2, else the v1 memory hierarchy).
fn memory_cgroup_of(pid: u32) -> std::path::PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let line = |pred: &dyn Fn(&str) -> bool| {
        text.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
            pred(ctl).then(|| path.trim_start_matches('/').to_owned())
        })
    };
    match line(&|c| c.split(',').any(|x| x == "memory")) {
        Some(p) => std::path::Path::new("/sys/fs/cgroup/memory").join(p),
        None => std::path::Path::new("/sys/fs/cgroup").join(line(&|c| c.is_empty()).unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_oom_killer_in_a_vmms_cgroup_ends_it_as_oom_killed() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create_sandbox(&mut c, &s.log).await;
    let neighbour = create_sandbox(&mut c, &s.log).await;
    // The host's memory runs short for this VMM alone: its cgroup's limit drops to what it
    // uses now plus 16 MiB, and the guest then touches 160 MiB it has never used.
    let cg = memory_cgroup_of(sb.vmm_pid);
    let (usage, limit) = if cg.join("memory.limit_in_bytes").exists() {
        ("memory.usage_in_bytes", "memory.limit_in_bytes")
    } else {
        ("memory.current", "memory.max")
    };
    let now: u64 = std::fs::read_to_string(cg.join(usage))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    std::fs::write(cg.join(limit), ((now >> 20) + 16).to_string() + "M")
        .unwrap_or_else(|e| panic!("lowering {}: {e}", cg.join(limit).display()));
    let hog = "python3 -c \"a = b'x' * (160 << 20); print(len(a))\"";
    let ex = c.exec(shell(&sb.id, hog, 0)).await.unwrap().into_inner();
    let dead = ended_sandbox(&mut c, &sb.id).await;
    assert_eq!(dead.state, SandboxState::Dead as i32, "{dead:?}");
    assert_eq!(dead.end_reason, "OOM_KILLED", "{dead:?}");
    let rec = ended_execution(&mut c, &ex.execution_id, 60)
        .await
        .execution
        .unwrap();
    assert_eq!(rec.state, ExecutionState::OomKilled as i32, "{rec:?}");
    assert_eq!(rec.error_reason, "OOM_KILLED", "{rec:?}");
    let (out, _, _) = run(&mut c, &neighbour.id, &["echo", "unharmed"]).await;
    assert_eq!(out, "unharmed\n");
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: neighbour.id.clone(),
    })
    .await
    .unwrap();
    nothing_left_of(s, sb.vmm_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_bomb_ends_with_its_execution_and_harms_nobody_else() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let bomb = create_sandbox(&mut c, &s.log).await;
    let neighbour = create_sandbox(&mut c, &s.log).await;
    let ex = c
        .exec(shell(&bomb.id, "f() { f | f & }; f", 20_000))
        .await
        .unwrap()
        .into_inner();
    let rec = ended_execution(&mut c, &ex.execution_id, 120)
        .await
        .execution
        .unwrap();
    assert_ne!(rec.state, ExecutionState::Running as i32);
    // The bomb's sandbox goes on (or ended with a reason), the neighbour does not notice.
    let after = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: bomb.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    if after.state == SandboxState::Running as i32 {
        let (out, _, _) = run(&mut c, &bomb.id, &["echo", "alive"]).await;
        assert_eq!(out, "alive\n");
    } else {
        assert!(!after.end_reason.is_empty(), "{after:?}");
    }
    let (out, _, _) = run(&mut c, &neighbour.id, &["echo", "unharmed"]).await;
    assert_eq!(out, "unharmed\n");
    for id in [&bomb.id, &neighbour.id] {
        c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_output_is_capped_and_the_record_says_so() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let sb = create_sandbox(&mut c, &s.log).await;
    // 1 GiB on bare metal; the nested build machines' emulated guest kernels write far less
    // in the time a test has (the cap is what is tested).
    let mib: u64 = std::env::var("AIRLOCK_TEST_FLOOD_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            16
        } else {
            1024
        });
    let rss_before = daemon_rss_kib(s);
    let ex = c
        .exec(shell(&sb.id, &format!("head -c {mib}M /dev/zero"), 600_000))
        .await
        .unwrap()
        .into_inner();
    let r = ended_execution(&mut c, &ex.execution_id, 600).await;
    let rec = r.execution.unwrap();
    assert_eq!(rec.exit_code, 0, "{rec:?}");
    assert!(rec.output_truncated, "{rec:?}");
    assert_eq!(
        rec.stdout_bytes,
        mib << 20,
        "what the program wrote is counted"
    );
    assert_eq!(
        r.stdout.len() as u64,
        MAX_OUTPUT,
        "what is stored is capped"
    );
    let grew = daemon_rss_kib(s).saturating_sub(rss_before);
    assert!(grew < 64 << 10, "the daemon grew by {grew} KiB");
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: sb.id.clone(),
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_data_directory_fails_creates_clearly_and_service_resumes() {
    let (_serial, s) = shared().await;
    let mut c = s.client(None).await;
    let before = create_sandbox(&mut c, &s.log).await;
    // Everything left on the data directory's filesystem, taken.
    let filler = s.data_dir.join("filler");
    let filled = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "fallocate -l $(( $(df --output=avail -B1 {d} | tail -n1) )) {f} || \
             dd if=/dev/zero of={f} bs=1M status=none",
            d = s.data_dir.display(),
            f = filler.display()
        ))
        .status()
        .unwrap();
    let _ = filled;
    let full = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect_err("a create with no space left");
    let (r, meta) = reason(&full);
    assert_eq!(
        (r.as_str(), meta.get("resource").map(String::as_str)),
        ("CAPACITY_EXHAUSTED", Some("data_dir")),
        "{full:?}"
    );
    // Nothing is corrupted: records read back, the live sandbox answers.
    let got = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: before.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.state, SandboxState::Running as i32);
    std::fs::remove_file(&filler).unwrap();
    let after = until("a create once space is back", 60, async || {
        c.create_sandbox(CreateSandboxRequest::default())
            .await
            .ok()
            .map(|r| r.into_inner())
    })
    .await;
    let (out, _, _) = run(&mut c, &after.id, &["echo", "resumed"]).await;
    assert_eq!(out, "resumed\n");
    for id in [&before.id, &after.id] {
        c.destroy_sandbox(DestroySandboxRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    }
}
