//! Protocol tests of per-execution cgroups: the agent runs with `--cgroup-root` on this
//! machine's cgroup v2 hierarchy. On the build machines that is the hybrid-mode
//! `/sys/fs/cgroup/unified`, which has no controllers (they are bound to cgroup v1), so these
//! tests cover joining the cgroup before exec, `cgroup.kill`, `cpu.stat` accounting and
//! removal, but not `pids.max` or the memory controller (see guest-agent/README.md).

mod common;

use airlock_proto::Requests;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use airlock_proto::pb::request;
use common::*;

/// This machine's writable cgroup v2 mount; the tests fail (not skip) without one.
fn cgroup2() -> PathBuf {
    writable_cgroup2().unwrap_or_else(|| {
        panic!(
            "these tests need a writable cgroup v2 hierarchy (as root): none is mounted. \
             Mount one with `mkdir -p /sys/fs/cgroup/unified && \
             mount -t cgroup2 none /sys/fs/cgroup/unified`"
        )
    })
}

fn exec_cgroup(agent: &AgentProcess, exec_id: u64) -> PathBuf {
    agent
        .cgroup_root
        .as_ref()
        .expect("agent with cgroups")
        .join(format!("exec-{exec_id}"))
}

/// The cgroup v2 path of a process, relative to the hierarchy's root.
fn cgroup_of(pid: u32) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_default()
        .to_owned()
}

fn relative(path: &Path, mount: &Path) -> String {
    format!(
        "/{}",
        path.strip_prefix(mount)
            .expect("path under mount")
            .display()
    )
}

#[test]
fn ready_advertises_cgroups() {
    let agent = AgentProcess::start_with_cgroups(&cgroup2());
    let c = agent.client();
    assert!(c.ready().capabilities.iter().any(|c| c == "cgroups"));
    assert!(!c.ready().capabilities.iter().any(|c| c == "process-groups"));
}

#[test]
fn the_process_runs_in_its_own_cgroup_which_is_removed_after() {
    let mount = cgroup2();
    let agent = AgentProcess::start_with_cgroups(&mount);
    let mut c = agent.client();
    let out = run(&mut c, shell("cat /proc/self/cgroup"));
    let dir = exec_cgroup(&agent, out.exit.exec_id);
    let expected = format!("0::{}", relative(&dir, &mount));
    assert!(
        out.stdout_str().lines().any(|l| l == expected),
        "{expected} not in\n{}",
        out.stdout_str()
    );
    assert!(!dir.exists(), "{} was not removed", dir.display());
}

#[test]
fn sigkill_kills_a_daemon_that_left_the_process_group() {
    let mount = cgroup2();
    let agent = AgentProcess::start_with_cgroups(&mount);
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(shell(
            "setsid sleep 600 & echo $!; sleep 600",
        )))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let daemon = first_line(&mut c, id).parse::<u32>().unwrap();
    assert!(
        eventually(Duration::from_secs(5), || !group_members(started.pid)
            .contains(&daemon)),
        "the daemon did not leave the process group"
    );
    let dir = exec_cgroup(&agent, started.exec_id);
    assert_eq!(cgroup_of(daemon), relative(&dir, &mount));
    c.signal(started.exec_id, libc::SIGKILL).unwrap();
    let exit = wait_exit(&mut c, id);
    assert!(exit.killed);
    assert!(
        eventually(Duration::from_secs(10), || !exists(daemon)),
        "daemon {daemon} survived cgroup.kill"
    );
    assert!(!dir.exists());
}

#[test]
fn timeout_kills_a_daemon_that_left_the_process_group() {
    let agent = AgentProcess::start_with_cgroups(&cgroup2());
    let mut c = agent.client();
    let mut exec = shell("setsid sleep 600 & echo $!; sleep 600");
    exec.timeout_ms = 1000;
    let began = Instant::now();
    let out = run(&mut c, exec);
    assert!(out.exit.timed_out);
    assert!(began.elapsed() < Duration::from_secs(15));
    let daemon: u32 = out.stdout_str().trim().parse().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !exists(daemon)),
        "daemon {daemon} survived the timeout"
    );
}

#[test]
fn a_daemon_left_behind_dies_with_the_main_process() {
    let agent = AgentProcess::start_with_cgroups(&cgroup2());
    let mut c = agent.client();
    let out = run(&mut c, shell("setsid sleep 600 & echo $!"));
    assert_eq!(exit_code(&out.exit), Some(0));
    let daemon: u32 = out.stdout_str().trim().parse().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !exists(daemon)),
        "daemon {daemon} outlived its execution"
    );
    assert!(!exec_cgroup(&agent, out.exit.exec_id).exists());
}

#[test]
fn cpu_time_of_the_whole_tree_comes_from_cpu_stat() {
    let agent = AgentProcess::start_with_cgroups(&cgroup2());
    let mut c = agent.client();
    // The busy work runs in a grandchild the shell never waits for: only the cgroup sees it.
    let script = "(i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo busy-done) & \
                  wait";
    let out = run(&mut c, shell(script));
    assert_eq!(out.stdout, b"busy-done\n");
    assert!(
        out.exit.cpu_user_us + out.exit.cpu_system_us > 10_000,
        "{:?}",
        out.exit
    );
}

#[test]
fn sigterm_reaches_every_process_of_the_cgroup() {
    let agent = AgentProcess::start_with_cgroups(&cgroup2());
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(shell(
            // The trap comes first: the test signals as soon as it reads the pid.
            "trap 'exit 5' TERM; setsid sleep 600 & echo $!; while :; do sleep 0.05; done",
        )))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let daemon = first_line(&mut c, id).parse::<u32>().unwrap();
    c.signal(started.exec_id, libc::SIGTERM).unwrap();
    let exit = wait_exit(&mut c, id);
    assert_eq!(exit_code(&exit), Some(5));
    assert!(!exit.killed);
    assert!(eventually(Duration::from_secs(10), || !exists(daemon)));
}

fn first_line(c: &mut Client, id: u64) -> String {
    let mut buf = Vec::new();
    while !buf.contains(&b'\n') {
        if let airlock_proto::pb::response::Kind::Output(o) = next_kind(c, id) {
            buf.extend(o.data);
        }
    }
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    String::from_utf8_lossy(line).into_owned()
}

fn wait_exit(c: &mut Client, id: u64) -> airlock_proto::pb::ExecExit {
    loop {
        if let airlock_proto::pb::response::Kind::ExecExit(e) = next_kind(c, id) {
            return e;
        }
    }
}
