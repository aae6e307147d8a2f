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

mod layout;
mod process;
mod sys;
mod uids;

pub use process::{ExitFuture, ProcessHandle, Spawned, kill_verified, start_ticks};

use layout::{JailLayout, shared_libraries};
use process::wait_exit;
use uids::{UidLease, UidPool, process_uids};

use std::collections::HashSet;
use std::ffi::{CString, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
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
    /// A network card for every VMM: it starts in a network namespace made for it, which holds
    /// `lo` and a TAP (`tap0`, the guest's gateway address 100.96.0.1/30) and no route out,
    /// and gets the TAP's descriptor (`--net-fd`). Needs `/dev/net/tun`. Templates built with
    /// it on have a card, and every sandbox of theirs a network of its own.
    pub network: bool,
    /// nftables' `nft`, which puts each namespace's ruleset in place (default: found on
    /// `$PATH` or in /usr/sbin).
    pub nft: Option<PathBuf>,
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
            network: true,
            nft: None,
        }
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
    /// Files in the run directory the VMM writes (a disk overlay), made here empty (mode 0600,
    /// owned by its uid): it creates none itself.
    pub writable_files: Vec<PathBuf>,
    /// The cgroup the VMM is placed in before it execs.
    pub cgroup: Option<Cgroup>,
    /// Standard output (default `/dev/null`) and standard error.
    pub stdout: Option<File>,
    pub stderr: File,
    /// The largest file the VMM may write (`RLIMIT_FSIZE`): a snapshot's memory file is the
    /// largest it has a reason to write.
    pub max_file_bytes: u64,
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
    /// `nft`, with a network.
    nft: Option<PathBuf>,
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
        let nft = if cfg.network {
            Some(crate::net::find_nft(cfg.nft.as_deref())?)
        } else {
            None
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
            nft,
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
        for f in &launch.writable_files {
            make_owned_file(&launch.run_dir, f, lease.as_ref().map(|l| l.uid))?;
        }
        let (net, exits) = match &self.nft {
            Some(nft) => {
                let nft = nft.clone();
                let (ns, exits) = airlock_netcfg::new_netns_with_tap(
                    c"tap0",
                    airlock_proto::GATEWAY_MAC,
                    airlock_proto::GATEWAY_IPV4,
                    airlock_proto::GUEST_PREFIX,
                    move || crate::net::prepare(&nft),
                )
                .map_err(|e| io::Error::new(e.kind(), format!("the sandbox's network: {e}")))?;
                (Some(ns), Some(exits))
            }
            None => (None, None),
        };
        let plan = self.plan(&launch, lease.as_ref().map(|l| l.uid), net)?;
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
            exits,
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
    ) -> io::Result<Option<(ProcessHandle, ExitFuture, Option<crate::net::NetExits>)>> {
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
        if process::start_ticks(pid) != Some(start_ticks)
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
        // The previous daemon's sockets went with it; the namespace and its ruleset stayed.
        let exits = match self.nft {
            Some(_) => Some(crate::net::reopen(pidfd.as_fd()).map_err(|e| {
                io::Error::new(e.kind(), format!("the sandbox's network exits: {e}"))
            })?),
            None => None,
        };
        let exit = async move {
            let status = wait_exit(pidfd, false).await;
            drop(lease);
            status
        };
        Ok(Some((handle, Box::pin(exit), exits)))
    }

    /// The child's plan; with `net`, the VMM enters that namespace and gets its TAP
    /// (`--net-fd`, the descriptor's number, kept open across exec).
    fn plan(
        &self,
        launch: &Launch,
        uid: Option<u32>,
        net: Option<airlock_netcfg::NetnsWithTap>,
    ) -> io::Result<sys::Plan> {
        let binary = cstring(self.binary.as_os_str().as_bytes())?;
        let mut argv_owned = vec![binary.clone()];
        for a in &launch.args {
            argv_owned.push(cstring(a.as_bytes())?);
        }
        if let Some(n) = &net {
            argv_owned.push(cstring(b"--net-fd")?);
            argv_owned.push(cstring(n.tap.as_raw_fd().to_string().as_bytes())?);
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
            net: net.as_ref().map(|n| sys::NetFds {
                netns: n.netns.as_raw_fd(),
                tap: n.tap.as_raw_fd(),
            }),
            _net: net,
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
                (libc::RLIMIT_FSIZE, launch.max_file_bytes),
            ],
        })
    }
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte"))
}

/// Creates the run directory: mode 0700, owned by the VMM's uid when it has one.
/// An empty file `path` inside `run_dir` (never through a link), mode 0600, owned by `uid`.
fn make_owned_file(run_dir: &Path, path: &Path, uid: Option<u32>) -> io::Result<()> {
    if path.parent() != Some(run_dir) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not in the run directory", path.display()),
        ));
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if let Some(uid) = uid {
        std::os::unix::fs::fchown(&f, Some(uid), Some(uid))?;
    }
    Ok(())
}

fn make_run_dir(dir: &Path, uid: Option<u32>) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    if let Some(uid) = uid {
        std::os::unix::fs::chown(dir, Some(uid), Some(uid))?;
    }
    Ok(())
}
