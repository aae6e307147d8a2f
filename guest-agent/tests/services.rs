//! The image's services (`--services-dir`, `/etc/airlock/services` as PID 1), against the real
//! agent in host mode: a service starts after Ready, its output goes to its log under the state
//! directory, it is started again after `kill -9` (and what it left running is killed first),
//! and an execution's cleanup never touches it.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// A service that appends its pid to `starts`, leaves a background child whose pid goes to
/// `children`, prints a line and waits.
fn write_service(dir: &Path, starts: &Path, children: &Path) {
    let script = format!(
        "sleep 120 & echo $! >> {children}; echo $$ >> {starts}; echo service-up; exec sleep 120",
        children = children.display(),
        starts = starts.display()
    );
    let file = serde_json::json!({
        "argv": ["/bin/sh", "-c", script],
        "env": {"SERVICE_TEST": "1"},
    });
    std::fs::create_dir_all(dir).expect("services dir");
    std::fs::write(dir.join("probe.json"), file.to_string()).expect("write probe.json");
    // Not a service: reported and skipped, the agent carries on.
    std::fs::write(dir.join("broken.json"), "{").expect("write broken.json");
}

fn pids(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Kills what the service left behind when the test ends (the agent is killed with SIGKILL,
/// which orphans its service).
struct Cleanup<'a>(&'a Path, &'a Path);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        for pid in pids(self.0).into_iter().chain(pids(self.1)) {
            // SAFETY: kill(2) of a positive pid this test's service started.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    }
}

fn restarted_after_kill_9(agent: &AgentProcess, scratch: &TempDir) {
    let starts = scratch.join("starts");
    let children = scratch.join("children");
    let _cleanup = Cleanup(&starts, &children);
    assert!(
        eventually(IO_TIMEOUT, || pids(&starts).len() == 1),
        "the service did not start"
    );
    let first = pids(&starts)[0];
    let log = agent.dir.join("state/services/probe.log");
    assert!(
        eventually(IO_TIMEOUT, || std::fs::read_to_string(&log)
            .is_ok_and(|l| l.contains("service-up"))),
        "no output in {}",
        log.display()
    );

    // An execution (and its cleanup: it kills its own cgroup or process group) leaves the
    // service alone.
    let mut client = agent.client();
    let done = run(&mut client, shell("sleep 0.2 & echo ok"));
    assert_eq!(done.stdout_str(), "ok\n");
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(first), "an execution's cleanup killed the service");
    assert_eq!(pids(&starts).len(), 1);

    // SAFETY: kill(2) of the service's pid.
    assert_eq!(unsafe { libc::kill(first as i32, libc::SIGKILL) }, 0);
    assert!(
        eventually(IO_TIMEOUT, || pids(&starts).len() == 2),
        "the service was not started again after kill -9"
    );
    let second = pids(&starts)[1];
    assert_ne!(first, second);
    assert!(alive(second));
    // The first run's background child went with it.
    let old_child = pids(&children)[0];
    assert!(
        eventually(IO_TIMEOUT, || !alive(old_child)),
        "the first run's child {old_child} outlived it"
    );
    let text = std::fs::read_to_string(&log).expect("read the log");
    assert_eq!(text.matches("service-up").count(), 2, "{text}");
}

#[test]
fn a_service_runs_after_ready_and_comes_back_after_kill_9() {
    let scratch = TempDir::new("services");
    write_service(
        &scratch.join("services"),
        &scratch.join("starts"),
        &scratch.join("children"),
    );
    let services = scratch.str("services");
    let agent =
        AgentProcess::start_with_args(&["--services-dir", &services, "--state-dir", "{dir}/state"]);
    restarted_after_kill_9(&agent, &scratch);
}

#[test]
fn a_service_in_its_own_cgroup_comes_back_after_kill_9() {
    let Some(mount) = writable_cgroup2() else {
        panic!("this test needs a writable cgroup v2 hierarchy (as root), as tests/cgroups.rs");
    };
    let scratch = TempDir::new("services-cg");
    write_service(
        &scratch.join("services"),
        &scratch.join("starts"),
        &scratch.join("children"),
    );
    let services = scratch.str("services");
    let agent = AgentProcess::start_with_cgroups_and_args(
        &mount,
        &["--services-dir", &services, "--state-dir", "{dir}/state"],
    );
    let cgroup = agent.cgroup_root.clone().unwrap().join("service-probe");
    let starts = scratch.join("starts");
    assert!(eventually(IO_TIMEOUT, || pids(&starts).len() == 1));
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap();
    assert!(
        procs
            .lines()
            .any(|l| l.trim() == pids(&starts)[0].to_string()),
        "the service is not in {}: {procs}",
        cgroup.display()
    );
    restarted_after_kill_9(&agent, &scratch);
}
