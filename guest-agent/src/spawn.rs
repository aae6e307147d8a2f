//! Starting an execution's process: its cgroup (where there are cgroups), the command (argv, a
//! clean environment, cwd, pipes), and its registration with the reaper, which hands its exit
//! to the execution's loop.
//!
//! The process leads its own session and process group (see [`sys::prepare_child`]); with
//! cgroups it writes itself into its cgroup between fork and exec, so every descendant starts
//! inside.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use airlock_proto::pb::ErrorCode;

use crate::cgroup::{CgroupRoot, ExecCgroup};
use crate::error::ReqError;
use crate::exec_spec::ExecSpec;
use crate::reaper::{ExitSlot, Reaper, Waker};
use crate::sys;

/// Capacity asked for each output pipe (the default is 64 KiB).
pub const PIPE_BYTES: usize = 256 << 10;

/// Where executions' processes start: the reaper that waits for them and, where cgroup v2 is
/// available, the root under which each gets its own cgroup.
#[derive(Debug)]
pub struct Spawner {
    pub reaper: Arc<Reaper>,
    /// Per-execution cgroups, where cgroup v2 is available.
    pub cgroups: Option<CgroupRoot>,
}

impl Spawner {
    /// Spawns the process of execution `exec_id`, in its own cgroup where there are cgroups.
    pub fn spawn(&self, exec_id: u64, spec: &ExecSpec) -> Result<Spawned, ReqError> {
        let cgroup = self.cgroup(exec_id, spec.memory_max)?;
        let mut cmd = command(spec)?;
        let cwd = std::ffi::CString::new(spec.cwd.as_str())
            .map_err(|_| ReqError::invalid("cwd contains a NUL byte"))?;
        let drop_to = spec
            .account
            .as_ref()
            .filter(|a| !a.is_root())
            .map(|a| sys::Credentials {
                uid: a.uid,
                gid: a.gid,
                groups: a.groups.clone(),
                lock_down: a.lock_down,
            });
        sys::prepare_child(
            &mut cmd,
            cgroup.as_ref().map(|c| c.procs_fd()),
            drop_to,
            cwd,
        );
        let waker = Arc::new(Waker::new().map_err(|e| ReqError::io("creating an eventfd", &e))?);
        let exit = Arc::new(ExitSlot::new(Arc::clone(&waker)));
        let started = Instant::now();
        let mut child = match self.reaper.spawn(&mut cmd, Arc::clone(&exit)) {
            Ok(child) => child,
            Err(e) => {
                if let Some(cg) = cgroup {
                    let _ = cg.kill_and_remove();
                }
                let program = spec.argv.first().map_or("", String::as_str);
                return Err(ReqError::io(&format!("starting {program}"), &e));
            }
        };
        let pipes = take_pipes(&mut child)?;
        Ok(Spawned {
            pid: child.id(),
            cgroup,
            waker,
            exit,
            started,
            pipes,
        })
    }

    /// The cgroup for execution `exec_id` (none without cgroups); fails if `memory_max` is asked
    /// for and cannot be enforced.
    fn cgroup(
        &self,
        exec_id: u64,
        memory_max: Option<u64>,
    ) -> Result<Option<ExecCgroup>, ReqError> {
        match &self.cgroups {
            Some(root) => {
                if memory_max.is_some() && !root.controllers().memory {
                    return Err(ReqError::new(
                        ErrorCode::Unsupported,
                        "a memory limit needs the cgroup memory controller, which is off",
                    ));
                }
                let cgroup = root.create(exec_id, memory_max).map_err(|e| {
                    ReqError::new(ErrorCode::Internal, format!("creating the cgroup: {e}"))
                })?;
                Ok(Some(cgroup))
            }
            None if memory_max.is_some() => Err(ReqError::new(
                ErrorCode::Unsupported,
                "a memory limit needs per-execution cgroups, which this agent does not have",
            )),
            None => Ok(None),
        }
    }
}

/// A process just started for an execution, and what its loop needs of it.
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    /// Its cgroup, where there are cgroups.
    pub cgroup: Option<ExecCgroup>,
    /// Woken when the reaper puts the exit in `exit`.
    pub waker: Arc<Waker>,
    pub exit: Arc<ExitSlot>,
    /// Just before the process was spawned.
    pub started: Instant,
    pub pipes: Pipes,
}

/// Whether the process gets a stdin pipe (else /dev/null).
pub fn wants_stdin(spec: &ExecSpec) -> bool {
    spec.stdin_open || !spec.stdin.is_empty()
}

/// The command for `spec`: argv, a clean environment and pipes (the child changes into its cwd
/// itself, after dropping privileges: see [`sys::prepare_child`]).
fn command(spec: &ExecSpec) -> Result<Command, ReqError> {
    let (program, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| ReqError::invalid("argv is empty"))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(if wants_stdin(spec) {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Ok(cmd)
}

/// Our ends of a child's stdin, stdout and stderr pipes (`None` where there is none).
pub type Pipes = (Option<File>, Option<File>, Option<File>);

/// Our ends of the child's pipes: stdin non-blocking, stdout and stderr enlarged.
fn take_pipes(child: &mut std::process::Child) -> Result<Pipes, ReqError> {
    let pipe = |fd: Option<OwnedFd>| fd.map(File::from);
    let stdin = pipe(child.stdin.take().map(OwnedFd::from));
    let stdout = pipe(child.stdout.take().map(OwnedFd::from));
    let stderr = pipe(child.stderr.take().map(OwnedFd::from));
    for p in stdout.iter().chain(&stderr) {
        // Fewer, larger reads; the default size works too.
        let _ = sys::set_pipe_size(p.as_fd(), PIPE_BYTES);
    }
    if let Some(p) = &stdin {
        sys::set_nonblocking(p.as_fd()).map_err(|e| ReqError::io("stdin pipe", &e))?;
    }
    Ok((stdin, stdout, stderr))
}
