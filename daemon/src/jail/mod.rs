//! The jail every `airlock-vmm` process starts in (Firecracker's jailer idea, done by the
//! daemon itself at spawn time).
//!
//! A VMM is host code that parses guest-controlled data; if it is ever compromised it must hold
//! nothing worth having. Each VMM is cloned straight into new mount, PID, IPC, UTS and network
//! namespaces and, before it execs:
//!
//! - its root becomes a fresh, read-only tmpfs (`pivot_root`; the old root is detached) that
//!   holds only: `/dev/kvm` (a device node of its own, owned by its uid), the VMM binary and
//!   the shared libraries it links (read-only), what it runs from (template snapshot, kernel,
//!   disk images: read-only, `noexec`) and its run directory (sockets, console log: the one
//!   writable place, `noexec`). Each sits at the same path as on the host, so the daemon and
//!   the VMM name files alike. No `/proc`, no `/sys`, no host sockets.
//! - it is in its cgroup (placed by the daemon while the child waits);
//! - it has resource limits (open files, processes/threads of its uid, no core dumps),
//!   `no_new_privs`, an empty capability bounding set, no ambient or inheritable capabilities;
//! - it runs as a uid/gid of its own, taken from `[jail] uid_base`/`uid_count` and given back
//!   once the process has been reaped;
//! - its environment is the daemon's explicit list only, its descriptors 0-2 only, in a session
//!   of its own.
//!
//! The mounts live in the VMM's own mount namespace, so they vanish with it, also when it is
//! killed; the host's mount table never changes. Cleanup is then the run directory, the cgroup
//! and the uid, each idempotent. The VMM installs its own seccomp filters (one per thread
//! class, `vmm/src/seccomp.rs`) before the guest runs.
//!
//! The system calls are in [`sys`]; this module decides what goes in.

mod sys;

use std::collections::{BTreeSet, HashSet};
use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tracing::{info, warn};

use crate::cgroup::Cgroup;

/// The jail settings (`[jail]` in the config file).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JailConfig {
    /// Namespaces, chroot and an unprivileged uid for every VMM. Off only for benchmarks that
    /// compare and for hosts without the privileges (the daemon then runs VMMs as itself).
    pub enabled: bool,
    /// The uids (and gids, the same numbers) handed to VMMs: `uid_base ..
    /// uid_base + uid_count`. Nothing else on the host may use them.
    pub uid_base: u32,
    pub uid_count: u32,
    /// `RLIMIT_NOFILE` of a VMM.
    pub max_open_files: u64,
    /// `RLIMIT_NPROC` of a VMM's uid: its threads (vCPUs and a few more).
    pub max_threads: u64,
    /// The VMMs' per-thread seccomp filters (`false` passes `--no-seccomp`: debugging only).
    pub seccomp: bool,
    /// Passes `--test-hooks` (the `probe` control commands) to every VMM: tests only.
    pub test_hooks: bool,
}

impl Default for JailConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            uid_base: 1_900_000_000,
            uid_count: 65_536,
            max_open_files: 1024,
            max_threads: 128,
            seccomp: true,
            test_hooks: false,
        }
    }
}

/// The uids handed to VMMs.
#[derive(Debug)]
struct UidPool {
    base: u32,
    count: u32,
    next: u32,
    used: HashSet<u32>,
    /// Uids in the range found in use by processes the daemon did not start.
    foreign: HashSet<u32>,
}

impl UidPool {
    /// The next free uid after the last one handed out (so a uid is reused as late as possible).
    fn allocate(&mut self) -> Option<u32> {
        for i in 0..self.count {
            let slot = (self.next + i) % self.count;
            let uid = self.base + slot;
            if !self.used.contains(&uid) && !self.foreign.contains(&uid) {
                self.used.insert(uid);
                self.next = (slot + 1) % self.count;
                return Some(uid);
            }
        }
        None
    }

    fn contains(&self, uid: u32) -> bool {
        (self.base..self.base.saturating_add(self.count)).contains(&uid)
    }
}

/// A uid taken from the pool; dropping it gives it back.
#[derive(Debug)]
pub struct UidLease {
    pool: Arc<Mutex<UidPool>>,
    pub uid: u32,
}

impl Drop for UidLease {
    fn drop(&mut self) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .used
            .remove(&self.uid);
    }
}

/// What to start, and what its jail holds.
#[derive(Debug)]
pub struct Launch {
    /// Arguments after the binary.
    pub args: Vec<OsString>,
    /// The whole environment.
    pub env: Vec<(String, String)>,
    /// Created here (mode 0700, owned by the VMM's uid): the one writable place in the jail.
    pub run_dir: PathBuf,
    /// Host files and directories the VMM reads (snapshot, kernel, disk images).
    pub read_only: Vec<PathBuf>,
    /// The cgroup the VMM is placed in before it execs.
    pub cgroup: Option<Cgroup>,
    /// Standard output (default `/dev/null`) and standard error.
    pub stdout: Option<File>,
    pub stderr: File,
}

/// A started VMM. Its uid is given back only once the process has been reaped: by
/// [`Spawned::wait`], or, if it is dropped unwaited, by a thread that kills and reaps it.
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    pidfd: Option<OwnedFd>,
    lease: Option<UidLease>,
}

/// The end of a VMM: resolves when it has exited (and, if it is our child, been reaped, its
/// uid given back); the status is known only for our own children.
pub type ExitFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<Option<ExitStatus>>> + Send>>;

/// Kills one process through its pidfd (never a recycled pid).
#[derive(Debug)]
pub struct ProcessHandle {
    pidfd: OwnedFd,
}

impl ProcessHandle {
    /// SIGKILL; a process that has already ended is no error.
    pub fn kill(&self) {
        let _ = sys::send_signal(&self.pidfd, libc::SIGKILL);
    }
}

impl Spawned {
    /// The uid it runs as in its jail (`None` unjailed).
    pub fn uid(&self) -> Option<u32> {
        self.lease.as_ref().map(|l| l.uid)
    }

    /// Splits the process into a handle that kills it and the future of its exit, which reaps
    /// it and gives its uid back.
    pub fn split(mut self) -> io::Result<(ProcessHandle, ExitFuture)> {
        let pidfd = self
            .pidfd
            .take()
            .ok_or_else(|| io::Error::other("already reaped"))?;
        let lease = self.lease.take();
        let handle = ProcessHandle {
            pidfd: pidfd.try_clone()?,
        };
        let exit = async move {
            let status = wait_exit(pidfd, true).await;
            drop(lease);
            status
        };
        Ok((handle, Box::pin(exit)))
    }
}

/// Waits until the process behind `pidfd` has exited; reaps it (`child`) and returns its
/// status, or, for a process that is not our child, returns `None` once it is gone.
async fn wait_exit(pidfd: OwnedFd, child: bool) -> io::Result<Option<ExitStatus>> {
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;
    // SAFETY: the OwnedFd owns the pidfd, so it stays open and names the same process for as
    // long as the AsyncFd holds it, and its raw value never changes.
    let fd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    loop {
        let mut ready = fd.readable().await?;
        if !child {
            // A pidfd polls readable once its process has exited.
            return Ok(None);
        }
        if let Some(status) = sys::wait_pidfd(fd.get_ref(), false)? {
            return Ok(Some(status));
        }
        ready.clear_ready();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let Some(pidfd) = self.pidfd.take() else {
            return;
        };
        let _ = sys::send_signal(&pidfd, libc::SIGKILL);
        let lease = self.lease.take();
        let reaper = std::thread::Builder::new()
            .name("vmm-reaper".into())
            .spawn(move || {
                let _ = sys::wait_blocking(&pidfd);
                drop(lease);
            });
        if let Err(e) = reaper {
            warn!("reaping VMM {}: {e}", self.pid);
        }
    }
}

/// Starts VMM processes in their jails.
#[derive(Debug)]
pub struct Jailer {
    cfg: JailConfig,
    /// The host directory each jail's tmpfs is mounted on (in the VMM's own mount namespace:
    /// on the host it stays an empty directory).
    root: PathBuf,
    binary: PathBuf,
    /// The binary's shared libraries (ld.so and what `ldd` lists).
    libs: Vec<PathBuf>,
    kvm_rdev: Option<libc::dev_t>,
    uids: Arc<Mutex<UidPool>>,
}

impl Jailer {
    /// A jailer for `binary`, mounting jails on `root` (created if missing).
    pub fn new(cfg: JailConfig, binary: &Path, root: &Path) -> io::Result<Self> {
        let binary = std::path::absolute(binary)?;
        if cfg.enabled {
            std::fs::create_dir_all(root)?;
            std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755))?;
        }
        let kvm_rdev = std::fs::metadata("/dev/kvm").ok().map(|m| m.rdev());
        if cfg.enabled && kvm_rdev.is_none() {
            warn!("no /dev/kvm: VMMs will not start");
        }
        let libs = if cfg.enabled {
            shared_libraries(&binary)
        } else {
            Vec::new()
        };
        let uids = UidPool {
            base: cfg.uid_base,
            count: cfg.uid_count.max(1),
            next: 0,
            used: HashSet::new(),
            foreign: HashSet::new(),
        };
        if cfg.enabled {
            info!(
                uids = format!(
                    "{}..{}",
                    cfg.uid_base,
                    cfg.uid_base.saturating_add(cfg.uid_count)
                ),
                libs = libs.len(),
                seccomp = cfg.seccomp,
                "VMMs run jailed"
            );
        } else {
            warn!("the jail is off: VMMs run as the daemon's user, in its namespaces");
        }
        Ok(Self {
            cfg,
            root: std::path::absolute(root)?,
            binary,
            libs,
            kvm_rdev,
            uids: Arc::new(Mutex::new(uids)),
        })
    }

    /// Marks the uids of the range that processes already use (not ours: call it after the
    /// previous daemon's VMMs were adopted or reaped) so that no VMM shares a uid with them.
    pub fn skip_uids_in_use(&self) {
        let mut pool = self.uids.lock().unwrap_or_else(|e| e.into_inner());
        // Adopted VMMs hold their uids already.
        let found: Vec<u32> = process_uids()
            .into_iter()
            .filter(|u| pool.contains(*u) && !pool.used.contains(u))
            .collect();
        for uid in found {
            warn!(
                uid,
                "a process the daemon did not start uses a jail uid; skipping it"
            );
            pool.foreign.insert(uid);
        }
    }

    pub fn enabled(&self) -> bool {
        self.cfg.enabled
    }

    /// The VMM binary.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// Uids handed out now (one per live VMM).
    pub fn uids_in_use(&self) -> usize {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .used
            .len()
    }

    /// The flags every VMM gets from the settings (seccomp, test hooks).
    pub fn vmm_flags(&self) -> Vec<OsString> {
        let mut v = Vec::new();
        if !self.cfg.seccomp {
            v.push("--no-seccomp".into());
        }
        if self.cfg.test_hooks {
            v.push("--test-hooks".into());
        }
        v
    }

    /// Starts the VMM: clone into the namespaces, place in the cgroup, set up the jail, exec.
    /// Blocks for the setup (about a millisecond); returns once the VMM has exec'd.
    pub fn spawn(&self, launch: Launch) -> io::Result<Spawned> {
        let lease = if self.cfg.enabled {
            let uid = self
                .uids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .allocate()
                .ok_or_else(|| io::Error::other("every jail uid is in use"))?;
            Some(UidLease {
                pool: self.uids.clone(),
                uid,
            })
        } else {
            None
        };
        make_run_dir(&launch.run_dir, lease.as_ref().map(|l| l.uid))?;
        let plan = self.plan(&launch, lease.as_ref().map(|l| l.uid))?;
        let child = sys::clone_child(&plan)?;
        if let Some(cg) = &launch.cgroup
            && let Err(e) = cg.add(child.pid)
        {
            child.kill_and_reap();
            return Err(e);
        }
        let (pid, pidfd) = child.go()?;
        tracing::debug!(pid, uid = ?lease.as_ref().map(|l| l.uid), "VMM started");
        Ok(Spawned {
            pid,
            pidfd: Some(pidfd),
            lease,
        })
    }

    /// Takes back a VMM a previous daemon started: `pid`, if it still is the process that
    /// started at `start_ticks` (checked after its pidfd is open, so a recycled pid is never
    /// taken) and runs as `uid` (jailed VMMs), with its uid leased again until it exits.
    /// `None` if it is gone or is another process.
    pub fn adopt(
        &self,
        pid: u32,
        start_ticks: u64,
        uid: Option<u32>,
    ) -> io::Result<Option<(ProcessHandle, ExitFuture)>> {
        let pidfd = match sys::pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
            Err(e) => return Err(e),
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let running_uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok());
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains("zombie"));
        if crate::vmm::start_ticks(pid) != Some(start_ticks)
            || zombie
            || uid.is_some_and(|u| running_uid != Some(u))
        {
            return Ok(None);
        }
        let lease = match uid {
            Some(u)
                if self
                    .uids
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains(u) =>
            {
                self.uids
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .used
                    .insert(u);
                Some(UidLease {
                    pool: self.uids.clone(),
                    uid: u,
                })
            }
            _ => None,
        };
        let handle = ProcessHandle {
            pidfd: pidfd.try_clone()?,
        };
        let exit = async move {
            let status = wait_exit(pidfd, false).await;
            drop(lease);
            status
        };
        Ok(Some((handle, Box::pin(exit))))
    }

    fn plan(&self, launch: &Launch, uid: Option<u32>) -> io::Result<sys::Plan> {
        let binary = cstring(self.binary.as_os_str().as_bytes())?;
        let mut argv_owned = vec![binary.clone()];
        for a in &launch.args {
            argv_owned.push(cstring(a.as_bytes())?);
        }
        let env_owned = launch
            .env
            .iter()
            .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
            .collect::<io::Result<Vec<_>>>()?;
        let null = || File::open("/dev/null");
        // try_clone gives descriptors >= 3, so dup2 onto 0-2 never meets itself.
        let stdin = null()?;
        let stdout = match &launch.stdout {
            Some(f) => f.try_clone()?,
            None => null()?,
        };
        let stderr = launch.stderr.try_clone()?;
        let jail = match uid {
            Some(uid) => Some(self.jail_plan(launch, uid)?),
            None => None,
        };
        let pointers = |v: &[CString]| {
            let mut p: Vec<*const libc::c_char> = v.iter().map(|c| c.as_ptr()).collect();
            p.push(std::ptr::null());
            p
        };
        let plan = sys::Plan {
            jail,
            binary,
            argv: pointers(&argv_owned),
            envp: pointers(&env_owned),
            _argv: argv_owned,
            _envp: env_owned,
            stdio: [stdin.as_raw_fd(), stdout.as_raw_fd(), stderr.as_raw_fd()],
            _stdio: [stdin, stdout, stderr],
        };
        Ok(plan)
    }

    fn jail_plan(&self, launch: &Launch, uid: u32) -> io::Result<sys::JailPlan> {
        let kvm_rdev = self
            .kvm_rdev
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no /dev/kvm on this host"))?;
        const RO: libc::c_ulong = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
        let mut mounts: Vec<(&Path, libc::c_ulong)> = Vec::new();
        mounts.push((
            &launch.run_dir,
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        ));
        for p in &launch.read_only {
            mounts.push((p, RO | libc::MS_NOEXEC));
        }
        mounts.push((&self.binary, RO));
        for lib in &self.libs {
            mounts.push((lib, RO));
        }
        let layout = JailLayout::new(&self.root, &mounts)?;
        let c = |p: &Path| cstring(p.as_os_str().as_bytes());
        let dev = self.root.join("dev");
        let mut dirs: Vec<CString> = layout.dirs.iter().map(|d| c(d)).collect::<Result<_, _>>()?;
        dirs.insert(0, c(&dev)?);
        let binds = layout
            .binds
            .iter()
            .map(|(src, dst, flags)| {
                Ok(sys::Bind {
                    source: c(src)?,
                    target: c(dst)?,
                    flags: *flags,
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(sys::JailPlan {
            root: c(&self.root)?,
            tmpfs_options: c(Path::new("size=1m,nr_inodes=4096,mode=755"))?,
            dirs,
            files: layout
                .files
                .iter()
                .map(|f| c(f))
                .collect::<Result<_, _>>()?,
            binds,
            kvm_node: c(&dev.join("kvm"))?,
            kvm_rdev,
            uid,
            gid: uid,
            rlimits: vec![
                (libc::RLIMIT_NOFILE, self.cfg.max_open_files),
                (libc::RLIMIT_NPROC, self.cfg.max_threads),
                (libc::RLIMIT_CORE, 0),
            ],
        })
    }
}

/// Where each host path goes in the jail: the directories and mount-point files to create in
/// the tmpfs, and the bind mounts (source, target, remount flags).
#[derive(Debug, Default)]
struct JailLayout {
    dirs: BTreeSet<PathBuf>,
    files: BTreeSet<PathBuf>,
    binds: Vec<(PathBuf, PathBuf, libc::c_ulong)>,
}

impl JailLayout {
    fn new(root: &Path, mounts: &[(&Path, libc::c_ulong)]) -> io::Result<Self> {
        let mut layout = Self::default();
        let mut targets: Vec<PathBuf> = Vec::new();
        for (host, flags) in mounts {
            let rel = jail_relative(host)?;
            let target = root.join(&rel);
            if targets.contains(&target) {
                continue;
            }
            let source = std::fs::canonicalize(host)
                .map_err(|e| io::Error::new(e.kind(), format!("jail: {}: {e}", host.display())))?;
            let mut parent = target.parent();
            while let Some(p) = parent.filter(|p| *p != root) {
                layout.dirs.insert(p.to_path_buf());
                parent = p.parent();
            }
            if source.is_dir() {
                layout.dirs.insert(target.clone());
            } else {
                layout.files.insert(target.clone());
            }
            layout.binds.push((source, target.clone(), *flags));
            targets.push(target);
        }
        // A mount point inside another bind would be created in the host's directory.
        for a in &targets {
            if let Some(b) = targets.iter().find(|b| *b != a && b.starts_with(a)) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "jail: {} lies inside {}; give the VMM paths that do not nest",
                        b.display(),
                        a.display()
                    ),
                ));
            }
        }
        Ok(layout)
    }
}

/// `host` (absolute, without `.` or `..`) relative to `/`.
fn jail_relative(host: &Path) -> io::Result<PathBuf> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("jail: {} is not a plain absolute path", host.display()),
        )
    };
    let mut rel = PathBuf::new();
    let mut comps = host.components();
    if comps.next() != Some(Component::RootDir) {
        return Err(bad());
    }
    for c in comps {
        match c {
            Component::Normal(n) => rel.push(n),
            _ => return Err(bad()),
        }
    }
    if rel.as_os_str().is_empty() {
        return Err(bad());
    }
    Ok(rel)
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"))
}

/// Creates the run directory: mode 0700, owned by the VMM's uid when it has one.
fn make_run_dir(dir: &Path, uid: Option<u32>) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    if let Some(uid) = uid {
        std::os::unix::fs::chown(dir, Some(uid), Some(uid))?;
    }
    Ok(())
}

/// Hands a directory tree the VMM wrote (a snapshot) over to root, read-only for others.
pub fn take_ownership(dir: &Path) -> io::Result<()> {
    std::os::unix::fs::lchown(dir, Some(0), Some(0))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.is_dir() {
            take_ownership(&path)?;
        } else if meta.is_file() {
            std::os::unix::fs::lchown(&path, Some(0), Some(0))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        } else {
            // Only plain files belong in a snapshot.
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// The shared libraries `binary` loads (with the dynamic loader), from `ldd`; none for a static
/// binary.
fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = match std::process::Command::new("ldd").arg(binary).output() {
        Ok(o) if o.status.success() => o,
        Ok(_) => return Vec::new(), // "not a dynamic executable"
        Err(e) => {
            warn!(
                "ldd {}: {e}; the jail holds no shared libraries",
                binary.display()
            );
            return Vec::new();
        }
    };
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

/// The real uids of all live processes on the host.
fn process_uids() -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        // A zombie (a killed VMM not reaped yet) holds nothing.
        .filter(|s| {
            !s.lines()
                .any(|l| l.starts_with("State:") && l.contains("zombie"))
        })
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(base: u32, count: u32) -> Arc<Mutex<UidPool>> {
        Arc::new(Mutex::new(UidPool {
            base,
            count,
            next: 0,
            used: HashSet::new(),
            foreign: HashSet::new(),
        }))
    }

    #[test]
    fn uids_are_handed_out_round_robin_and_come_back_when_the_lease_ends() {
        let p = pool(1000, 3);
        let take = |p: &Arc<Mutex<UidPool>>| p.lock().unwrap().allocate();
        assert_eq!(take(&p), Some(1000));
        assert_eq!(take(&p), Some(1001));
        let lease = UidLease {
            pool: p.clone(),
            uid: 1001,
        };
        drop(lease);
        // 1001 is free again but the cursor moves on first.
        assert_eq!(take(&p), Some(1002));
        assert_eq!(take(&p), Some(1001));
        assert_eq!(take(&p), None, "all three in use");
        p.lock().unwrap().foreign.insert(1000);
        p.lock().unwrap().used.remove(&1000);
        assert_eq!(take(&p), None, "a foreign uid is never handed out");
    }

    #[test]
    fn ldd_output_gives_the_library_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007ffc)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n\
                    \tlibmissing.so => not found\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn paths_in_the_jail_mirror_the_host_and_must_not_nest() {
        let dir = std::env::temp_dir().join(format!("airlock-jail-layout-{}", std::process::id()));
        let run = dir.join("run/vm-1");
        let tpl = dir.join("templates/tpl-1");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&tpl).unwrap();
        std::fs::write(dir.join("image.ext4"), b"x").unwrap();
        let root = Path::new("/jail");
        let img = dir.join("image.ext4");
        let layout =
            JailLayout::new(root, &[(&run, 0), (&tpl, libc::MS_RDONLY), (&img, 0)]).unwrap();
        let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
        assert!(layout.dirs.contains(&inside(&run)));
        assert!(layout.dirs.contains(&inside(&dir.join("run"))));
        assert!(layout.files.contains(&inside(&img)));
        assert_eq!(layout.binds.len(), 3);
        assert_eq!(layout.binds[1].1, inside(&tpl));
        assert_eq!(layout.binds[1].2, libc::MS_RDONLY);
        let nested = JailLayout::new(root, &[(&dir, 0), (&run, 0)]);
        assert!(nested.is_err(), "a bind inside another bind is refused");
        assert!(jail_relative(Path::new("relative/path")).is_err());
        assert!(jail_relative(Path::new("/a/../etc")).is_err());
        assert!(jail_relative(Path::new("/")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
