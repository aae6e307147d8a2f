//! `airlock-vmm` processes as the daemon sees them: how one is started (the [`Launcher`] seam:
//! jailed for real, in-process fakes in unit tests), the handle the daemon keeps
//! ([`VmmProcess`]), its control socket ([`control`]), what its exit means ([`exit`]), and
//! facts about processes read from `/proc`.

pub mod control;
pub mod exit;

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cgroup::Cgroup;
use crate::jail::{ExitFuture, Jailer, Launch, start_ticks};

/// Kills one started VMM.
pub trait Kill: Send + Sync + fmt::Debug {
    /// SIGKILL (or the fake's equivalent); idempotent.
    fn kill(&self);
}

impl Kill for crate::jail::ProcessHandle {
    fn kill(&self) {
        crate::jail::ProcessHandle::kill(self);
    }
}

/// A started (or adopted) VMM process: who it is, how to kill it, and the future of its end.
pub struct Launched {
    pub pid: u32,
    pub start_ticks: u64,
    pub uid: Option<u32>,
    pub handle: Arc<dyn Kill>,
    pub exit: ExitFuture,
    /// The daemon's sockets in its network namespace (with a network).
    pub exits: Option<crate::net::NetExits>,
}

impl fmt::Debug for Launched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Launched")
            .field("pid", &self.pid)
            .field("uid", &self.uid)
            .finish_non_exhaustive()
    }
}

/// How VMM processes come to be: the seam between the daemon's logic and real processes.
pub trait Launcher: Send + Sync + fmt::Debug {
    /// Starts a VMM; blocks for its setup (about a millisecond) and returns once it has
    /// exec'd.
    fn launch(&self, launch: Launch) -> io::Result<Launched>;
    /// Takes back a VMM a previous daemon started, if `pid` is still that process.
    fn adopt(&self, pid: u32, start_ticks: u64, uid: Option<u32>) -> io::Result<Option<Launched>>;
    /// The VMM binary.
    fn binary(&self) -> &Path;
    /// Flags every VMM gets (seccomp, test hooks).
    fn vmm_flags(&self) -> Vec<OsString>;
    /// Jail uids held by live VMMs.
    fn uids_in_use(&self) -> usize;
    /// Marks the jail uids that processes not started by this daemon use.
    fn skip_uids_in_use(&self);
    /// Whether VMMs run jailed.
    fn jailed(&self) -> bool;
}

impl Launcher for Jailer {
    fn launch(&self, launch: Launch) -> io::Result<Launched> {
        let mut spawned = self.spawn(launch)?;
        let exits = spawned.exits.take();
        let pid = spawned.pid;
        let uid = spawned.uid();
        let start_ticks = start_ticks(pid).unwrap_or(0);
        let (handle, exit) = spawned.split()?;
        Ok(Launched {
            pid,
            start_ticks,
            uid,
            handle: Arc::new(handle),
            exit,
            exits,
        })
    }

    fn adopt(&self, pid: u32, start_ticks: u64, uid: Option<u32>) -> io::Result<Option<Launched>> {
        Ok(
            Jailer::adopt(self, pid, start_ticks, uid)?.map(|(handle, exit, exits)| Launched {
                pid,
                start_ticks,
                uid,
                handle: Arc::new(handle),
                exit,
                exits,
            }),
        )
    }

    fn binary(&self) -> &Path {
        Jailer::binary(self)
    }

    fn vmm_flags(&self) -> Vec<OsString> {
        Jailer::vmm_flags(self)
    }

    fn uids_in_use(&self) -> usize {
        Jailer::uids_in_use(self)
    }

    fn skip_uids_in_use(&self) {
        Jailer::skip_uids_in_use(self);
    }

    fn jailed(&self) -> bool {
        self.enabled()
    }
}

/// A VMM the daemon holds: its id (which names its run directory and cgroup), process,
/// sockets and cgroup. Cloning it clones the handle, not the process.
#[derive(Clone, Debug)]
pub struct VmmProcess {
    pub id: String,
    pub pid: u32,
    pub start_ticks: u64,
    pub uid: Option<u32>,
    pub run_dir: PathBuf,
    pub control: PathBuf,
    pub vsock: PathBuf,
    /// The one connection to its guest agent, shared by every caller.
    pub agent: Arc<crate::agent::AgentLink>,
    pub cgroup: Option<Cgroup>,
    handle: Arc<dyn Kill>,
    /// Set once the process has ended (by the supervisor).
    gone: Arc<tokio::sync::watch::Sender<bool>>,
    /// The daemon's sockets in its network namespace until its sandbox takes them.
    exits: Arc<std::sync::Mutex<Option<crate::net::NetExits>>>,
}

impl VmmProcess {
    /// The VMM `launched` with its sockets in `run_dir` (it takes `launched`'s network exits).
    pub fn new(
        id: String,
        run_dir: PathBuf,
        cgroup: Option<Cgroup>,
        launched: &mut Launched,
    ) -> Self {
        Self {
            id,
            pid: launched.pid,
            start_ticks: launched.start_ticks,
            uid: launched.uid,
            control: run_dir.join("control.sock"),
            vsock: run_dir.join("vsock.sock"),
            agent: Arc::new(crate::agent::AgentLink::new(run_dir.join("vsock.sock"))),
            run_dir,
            cgroup,
            handle: launched.handle.clone(),
            gone: Arc::new(tokio::sync::watch::Sender::new(false)),
            exits: Arc::new(std::sync::Mutex::new(launched.exits.take())),
        }
    }

    /// The daemon's sockets in its network namespace, for the one that serves them (once).
    pub fn take_exits(&self) -> Option<crate::net::NetExits> {
        self.exits.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether the process has ended.
    pub fn is_gone(&self) -> bool {
        *self.gone.borrow()
    }

    /// Marks the process ended (its exit was seen).
    pub fn mark_gone(&self) {
        self.gone.send_replace(true);
        self.agent.close("its VMM ended");
    }

    /// Waits up to `timeout` for the process to end; whether it did.
    pub async fn wait_gone(&self, timeout: std::time::Duration) -> bool {
        let mut rx = self.gone.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|g| *g))
            .await
            .is_ok()
    }

    /// SIGKILL.
    pub fn kill(&self) {
        self.handle.kill();
    }

    /// Its log (the VMM's stderr).
    pub fn log(&self) -> PathBuf {
        self.run_dir.join("vmm.log")
    }

    /// The guest's serial console, as the VMM writes it.
    pub fn console(&self) -> PathBuf {
        self.run_dir.join(CONSOLE_FILE)
    }

    /// Removes what it had on the host: its cgroup and run directory (call once it is gone).
    pub fn remove_leftovers(&self) {
        if let Some(cg) = &self.cgroup
            && let Err(e) = cg.remove()
        {
            tracing::warn!(vmm = %self.id, "cgroup removal: {e}");
        }
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
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

/// The largest file a VMM with a guest of `memory_mib` may write (its `RLIMIT_FSIZE`): a
/// snapshot's memory file (the guest's size), with room for the state file and logs.
pub fn max_file_bytes(memory_mib: u32) -> u64 {
    (u64::from(memory_mib) + 128) << 20
}

/// What a warm pool process restores: the template's snapshot and the disk image it uses.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub vcpus: u32,
    pub memory_mib: u32,
    pub snapshot_dir: PathBuf,
    pub rootfs: PathBuf,
    /// The snapshot's root disk is copy-on-write (the template has a layer): the VMM gets an
    /// overlay in its run directory, which may grow to at most this many MiB (the daemon's
    /// largest `disk_mib`; a restore gives the sandbox's own).
    pub writable_root_mib: Option<u32>,
}

/// A copy-on-write root disk's overlay, in a VMM's run directory (made empty for it, owned by
/// its uid: the VMM creates no files).
pub const ROOT_OVERLAY_FILE: &str = "root.overlay";

/// The largest file a VMM with a guest of `memory_mib` and a root disk overlay of at most
/// `disk_mib` over a layer of `layer_bytes` may write (its `RLIMIT_FSIZE`): the memory file, or
/// the overlay, or a snapshot's layer (the template's and the overlay's blocks together).
pub fn max_file_bytes_with_disk(memory_mib: u32, disk_mib: u32, layer_bytes: u64) -> u64 {
    max_file_bytes(memory_mib).max(layer_bytes + ((u64::from(disk_mib) + 128) << 20))
}

/// The launch of `airlock-vmm pool` for `spec` with its sockets in `run_dir` (created), its
/// stderr in `run_dir/vmm.log`.
pub fn pool_launch(
    launcher: &dyn Launcher,
    run_dir: &Path,
    spec: &PoolSpec,
    cgroup: Option<Cgroup>,
) -> io::Result<Launch> {
    std::fs::create_dir_all(run_dir)?;
    let log = std::fs::File::create(run_dir.join("vmm.log"))?;
    let mut args: Vec<OsString> = launcher.vmm_flags();
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
        ("--control", run_dir.join("control.sock")),
        ("--vsock", run_dir.join("vsock.sock")),
        ("--console", run_dir.join(CONSOLE_FILE)),
        ("--snapshot", spec.snapshot_dir.clone()),
    ] {
        args.push(flag.into());
        args.push(path.into());
    }
    let mut writable_files = Vec::new();
    let mut max_bytes = max_file_bytes(spec.memory_mib);
    if let Some(mib) = spec.writable_root_mib {
        let overlay = run_dir.join(ROOT_OVERLAY_FILE);
        args.extend(["--root-overlay".into(), overlay.clone().into_os_string()]);
        args.extend(["--disk-quota-mib".into(), mib.to_string().into()]);
        writable_files.push(overlay);
        let layer = crate::fileinfo::disk_bytes(
            &spec
                .snapshot_dir
                .join(airlock_control::snapshot_dir::LAYER_FILE),
        );
        max_bytes = max_file_bytes_with_disk(spec.memory_mib, mib, layer);
    }
    Ok(Launch {
        args,
        env: vmm_env(run_dir),
        run_dir: run_dir.to_path_buf(),
        read_only: vec![spec.snapshot_dir.clone(), spec.rootfs.clone()],
        writable_files,
        cgroup,
        stdout: None,
        stderr: log,
        max_file_bytes: max_bytes,
    })
}

/// Starts a launch on a blocking thread.
pub async fn launch(launcher: &Arc<dyn Launcher>, launch: Launch) -> io::Result<Launched> {
    let l = launcher.clone();
    tokio::task::spawn_blocking(move || l.launch(launch))
        .await
        .map_err(io::Error::other)?
}

/// The guest's console in a VMM's run directory.
const CONSOLE_FILE: &str = "console.log";

/// How much of the end of a log file is read (a VMM's log is the VMM's to write: it may be
/// large, and it is never read whole).
const LOG_TAIL_BYTES: u64 = 64 << 10;

/// The last `LOG_TAIL_BYTES` of a log file, as text.
fn read_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if f.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))
        .is_err()
    {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.take(LOG_TAIL_BYTES).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last lines of a log file, for error messages.
pub fn log_tail(path: &Path) -> String {
    last_lines(path, 5)
}

/// The last `n` lines of a log file's tail, joined with " | ".
pub fn last_lines(path: &Path, n: usize) -> String {
    let text = read_tail(path);
    let lines: Vec<&str> = text.lines().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// The last line of a log file's tail that contains `needle`.
pub fn log_line(path: &Path, needle: &str) -> Option<String> {
    read_tail(path)
        .lines()
        .rev()
        .find(|l| l.contains(needle))
        .map(|l| l.trim().to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_the_tail_of_a_huge_log_is_read() {
        let dir = std::env::temp_dir().join(format!("airlock-logtail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("vmm.log");
        let mut text = "early seccomp violation\n".to_owned();
        text.push_str(&"x".repeat(4 << 20));
        text.push_str("\nlast line\n");
        std::fs::write(&log, text).unwrap();
        assert!(read_tail(&log).len() as u64 <= LOG_TAIL_BYTES);
        assert!(log_tail(&log).ends_with("last line"));
        assert_eq!(log_line(&log, "seccomp violation"), None, "beyond the tail");
        assert_eq!(max_file_bytes(256), 384 << 20);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
