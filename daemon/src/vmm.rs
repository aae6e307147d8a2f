//! `airlock-vmm` processes as the daemon drives them: spawned as warm pool processes for one
//! template (`airlock-vmm pool --snapshot DIR`), told to restore over their control socket,
//! paused, snapshotted and stopped the same way, and killed by pid (checked against the
//! process's start time, so a reused pid is never hit).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// One VMM process and its files.
#[derive(Debug)]
pub struct VmmProcess {
    pub pid: u32,
    pub start_ticks: u64,
    pub run_dir: PathBuf,
    pub control: PathBuf,
    pub vsock: PathBuf,
    pub child: Option<tokio::process::Child>,
    /// Its cgroup (made when it is spawned: the template fixes the limits).
    pub cgroup: Option<crate::cgroup::Cgroup>,
}

/// How long a control command may take (a snapshot writes the memory file).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

impl VmmProcess {
    /// Spawns `airlock-vmm pool` for a `vcpus`-vCPU snapshot in `snapshot_dir` (its memory is
    /// mapped and registered in advance), with its sockets in `run_dir`; see
    /// [`wait_ready`](Self::wait_ready).
    pub async fn spawn_pool(
        binary: &Path,
        run_dir: PathBuf,
        vcpus: u32,
        snapshot_dir: &Path,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(&run_dir)?;
        let control = run_dir.join("control.sock");
        let vsock = run_dir.join("vsock.sock");
        let console = run_dir.join("console.log");
        let log = std::fs::File::create(run_dir.join("vmm.log"))?;
        let mut cmd = tokio::process::Command::new(binary);
        cmd.arg("pool")
            .arg("--control")
            .arg(&control)
            .arg("--vsock")
            .arg(&vsock)
            .arg("--console")
            .arg(&console)
            .arg("--vcpus")
            .arg(vcpus.to_string())
            .arg("--snapshot")
            .arg(snapshot_dir)
            .env_clear()
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            // Its own process group: a Ctrl-C meant for the daemon does not reach it.
            .process_group(0)
            .kill_on_drop(false);
        // The guest profiler (`vmm/src/profile.rs`) for debugging: `AIRLOCK_PROFILE=PREFIX` on
        // the daemon profiles every VMM into `PREFIX-<run dir name>.vcpuN`.
        if let Some(prefix) = std::env::var_os("AIRLOCK_PROFILE").filter(|p| !p.is_empty()) {
            let mut path = prefix;
            path.push("-");
            path.push(run_dir.file_name().unwrap_or_default());
            cmd.env("AIRLOCK_PROFILE", path);
        }
        let child = cmd.spawn().map_err(|e| {
            std::io::Error::new(e.kind(), format!("spawning {}: {e}", binary.display()))
        })?;
        let pid = child
            .id()
            .ok_or_else(|| std::io::Error::other("the VMM exited at once"))?;
        let start_ticks = start_ticks(pid).unwrap_or(0);
        Ok(Self {
            pid,
            start_ticks,
            run_dir,
            control,
            vsock,
            child: Some(child),
            cgroup: None,
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
            if let Some(c) = p.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                return Err(std::io::Error::other(format!(
                    "the pool VMM exited ({status}) before it was ready: {}",
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

/// The last lines of a log file, for error messages.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
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
    }
}
