//! `airlock-vmm` processes as the daemon drives them: spawned as warm pool processes for one
//! template (`airlock-vmm pool --snapshot DIR`), told to restore over their control socket,
//! paused, snapshotted and stopped the same way, and killed by pid (checked against the
//! process's start time, so a reused pid is never hit).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::jail::{Jailer, Launch, Spawned};

/// One VMM process and its files.
#[derive(Debug)]
pub struct VmmProcess {
    pub pid: u32,
    pub start_ticks: u64,
    pub run_dir: PathBuf,
    pub control: PathBuf,
    pub vsock: PathBuf,
    /// The process, to wait for (taken by the exit watcher).
    pub child: Option<Spawned>,
    /// Its cgroup (made before it is spawned: the template fixes the limits).
    pub cgroup: Option<crate::cgroup::Cgroup>,
}

/// How long a control command may take (a snapshot writes the memory file).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

/// What a warm pool process restores: the template's snapshot and the disk image it uses.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub vcpus: u32,
    pub snapshot_dir: PathBuf,
    pub rootfs: PathBuf,
}

/// The CPU template of this host, as `airlock-vmm --cpu-template` names it (the jailed VMM
/// cannot look at `/sys` itself).
pub fn cpu_template() -> &'static str {
    if Path::new("/sys/module/kvm_pvm").exists() {
        "nested"
    } else {
        "host"
    }
}

/// The environment of every VMM: log level, temporary files in its run directory, and the
/// guest profiler for debugging (`AIRLOCK_PROFILE=PREFIX` on the daemon profiles every VMM into
/// `PREFIX-<run dir name>.vcpuN`).
pub fn vmm_env(run_dir: &Path) -> Vec<(String, String)> {
    let mut env = vec![
        ("AIRLOCK_LOG".to_owned(), "info".to_owned()),
        ("TMPDIR".to_owned(), run_dir.display().to_string()),
    ];
    if let Some(prefix) = std::env::var_os("AIRLOCK_PROFILE").filter(|p| !p.is_empty()) {
        let name = run_dir.file_name().unwrap_or_default().to_string_lossy();
        env.push((
            "AIRLOCK_PROFILE".to_owned(),
            format!("{}-{name}", prefix.to_string_lossy()),
        ));
    }
    env
}

/// Starts a launch on a blocking thread (the jail's setup blocks for about a millisecond).
pub async fn spawn(jailer: &Arc<Jailer>, launch: Launch) -> std::io::Result<Spawned> {
    let j = jailer.clone();
    tokio::task::spawn_blocking(move || j.spawn(launch))
        .await
        .map_err(std::io::Error::other)?
}

impl VmmProcess {
    /// Spawns `airlock-vmm pool` in its jail for the snapshot in `spec` (its memory is mapped
    /// and registered in advance), with its sockets in `run_dir` and in `cgroup`; see
    /// [`wait_ready`](Self::wait_ready).
    pub async fn spawn_pool(
        jailer: &Arc<Jailer>,
        run_dir: PathBuf,
        spec: &PoolSpec,
        cgroup: Option<crate::cgroup::Cgroup>,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(&run_dir)?;
        let control = run_dir.join("control.sock");
        let vsock = run_dir.join("vsock.sock");
        let console = run_dir.join("console.log");
        let log = std::fs::File::create(run_dir.join("vmm.log"))?;
        let mut args: Vec<OsString> = jailer.vmm_flags();
        args.extend(
            [
                "pool",
                "--cpu-template",
                cpu_template(),
                "--vcpus",
                &spec.vcpus.to_string(),
            ]
            .map(OsString::from),
        );
        for (flag, path) in [
            ("--control", &control),
            ("--vsock", &vsock),
            ("--console", &console),
            ("--snapshot", &spec.snapshot_dir),
        ] {
            args.push(flag.into());
            args.push(path.into());
        }
        let launch = Launch {
            args,
            env: vmm_env(&run_dir),
            run_dir: run_dir.clone(),
            read_only: vec![spec.snapshot_dir.clone(), spec.rootfs.clone()],
            cgroup: cgroup.clone(),
            stdout: None,
            stderr: log,
        };
        let child = spawn(jailer, launch).await.map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("spawning {}: {e}", jailer.binary().display()),
            )
        })?;
        let pid = child.pid;
        let start_ticks = start_ticks(pid).unwrap_or(0);
        Ok(Self {
            pid,
            start_ticks,
            run_dir,
            control,
            vsock,
            child: Some(child),
            cgroup,
        })
    }

    /// Waits until the control socket answers (the pool process has prepared its VM).
    pub async fn wait_ready(&mut self) -> std::io::Result<()> {
        let p = self;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if command(&p.control, "status").await.is_ok() {
                return Ok(());
            }
            if start_ticks(p.pid) != Some(p.start_ticks) || is_zombie(p.pid) {
                return Err(std::io::Error::other(format!(
                    "the pool VMM exited before it was ready: {}",
                    log_tail(&p.run_dir.join("vmm.log"))
                )));
            }
            if tokio::time::Instant::now() > deadline {
                p.kill();
                return Err(std::io::Error::other(
                    "the pool VMM did not come up within 20 s",
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Kills the process (SIGKILL), if it is still the one we started.
    pub fn kill(&mut self) {
        kill_verified(self.pid, self.start_ticks);
    }
}

/// Sends one command line to a VMM control socket; returns its JSON answer, or an error that
/// includes the VMM's own message when it answered `ok: false`.
pub async fn command(path: &Path, line: &str) -> std::io::Result<Value> {
    let fut = async {
        let mut s = UnixStream::connect(path).await?;
        s.write_all(format!("{line}\n").as_bytes()).await?;
        let mut answer = String::new();
        BufReader::new(s.take(1 << 20))
            .read_line(&mut answer)
            .await?;
        let v: Value = serde_json::from_str(&answer).map_err(std::io::Error::other)?;
        if v["ok"] != true {
            return Err(std::io::Error::other(format!(
                "the VMM refused `{line}`: {}",
                v["error"].as_str().unwrap_or(answer.trim())
            )));
        }
        Ok(v)
    };
    tokio::time::timeout(CONTROL_TIMEOUT, fut)
        .await
        .map_err(|_| std::io::Error::other(format!("the VMM did not answer `{line}`")))?
}

/// The start time of `pid` in clock ticks since boot (`/proc/PID/stat` field 22).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain anything.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// SIGKILLs `pid` if it is alive and started at `ticks` (0: unknown, kill anyway). Returns
/// whether a signal was sent.
pub fn kill_verified(pid: u32, ticks: u64) -> bool {
    let Some(actual) = start_ticks(pid) else {
        return false;
    };
    if ticks != 0 && actual != ticks {
        return false;
    }
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) on a pid we started (checked by start time); no memory is involved.
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}

/// Whether `pid` is a zombie (exited, not yet reaped) or gone.
pub fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().next().map(|st| st == "Z")
        })
        .unwrap_or(true)
}

/// The last lines of a log file, for error messages.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// `airlock-vmm`'s exit code for a seccomp violation (`vmm::exit::code::SECCOMP_VIOLATION`).
pub const SECCOMP_EXIT_CODE: i32 = 70;

/// The last line of a log file that contains `needle`.
pub fn log_line(path: &Path, needle: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .rev()
        .find(|l| l.contains(needle))
        .map(|l| l.trim().to_owned())
}

/// What the exit of a sandbox's VMM means: (reason code, sentence).
pub fn describe_exit(status: std::process::ExitStatus, oom: bool) -> (&'static str, String) {
    use std::os::unix::process::ExitStatusExt;
    if oom {
        return (
            "OOM_KILLED",
            "the sandbox exceeded its memory limit and its VMM was killed".into(),
        );
    }
    if status.signal() == Some(libc::SIGSYS) || status.code() == Some(SECCOMP_EXIT_CODE) {
        return (
            "SECCOMP_VIOLATION",
            "the VMM made a system call outside its seccomp filter and was ended".into(),
        );
    }
    if let Some(sig) = status.signal() {
        return (
            "SANDBOX_DEAD",
            format!("the VMM was killed by signal {sig}"),
        );
    }
    match status.code() {
        Some(0) => ("SANDBOX_DEAD", "the guest powered off".into()),
        Some(64) => ("GUEST_CRASHED", "the guest kernel panicked".into()),
        Some(65) => ("GUEST_CRASHED", "the guest triple-faulted".into()),
        Some(c @ 66..=69) => (
            "GUEST_CRASHED",
            format!("the VM failed (VMM exit code {c})"),
        ),
        Some(c) => ("SANDBOX_DEAD", format!("the VMM exited with code {c}")),
        None => ("SANDBOX_DEAD", "the VMM ended".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_ticks_of_this_process_is_stable() {
        let me = std::process::id();
        let a = start_ticks(me).expect("own stat");
        assert_eq!(start_ticks(me), Some(a));
        assert_eq!(start_ticks(u32::MAX), None);
    }

    #[test]
    fn kill_verified_spares_a_process_with_another_start_time() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let ticks = start_ticks(pid).unwrap();
        assert!(!kill_verified(pid, ticks + 1));
        assert!(child.try_wait().unwrap().is_none());
        assert!(kill_verified(pid, ticks));
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
    }

    #[test]
    fn exits_map_to_reasons() {
        use std::os::unix::process::ExitStatusExt;
        let st = |raw| std::process::ExitStatus::from_raw(raw);
        assert_eq!(describe_exit(st(9), false).0, "SANDBOX_DEAD");
        assert_eq!(describe_exit(st(9), true).0, "OOM_KILLED");
        assert_eq!(describe_exit(st(64 << 8), false).0, "GUEST_CRASHED");
        assert_eq!(describe_exit(st(70 << 8), false).0, "SECCOMP_VIOLATION");
        assert_eq!(
            describe_exit(st(libc::SIGSYS), false).0,
            "SECCOMP_VIOLATION"
        );
    }
}
