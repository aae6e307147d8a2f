//! Shared helpers for the protocol tests: the real `airlock-agent` binary in host mode on a Unix
//! socket, a connected client, and ways to look at processes.
#![allow(
    dead_code,
    reason = "each test binary uses a different subset of these helpers"
)]

use airlock_proto::Requests;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use airlock_proto::AgentClient;
use airlock_proto::pb::{self, Argv, ExecExit, StreamKind, exec, exec_exit, response};

pub type Client = AgentClient<UnixStream, UnixStream>;

/// Generous: the build machines are loaded 2-core VMs.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);
const READY_LINE: &str = "airlock: userspace up";

/// The agent under test: `$AIRLOCK_AGENT_BIN` (e.g. the static release build that goes into the
/// image), else the binary cargo built for these tests.
pub fn agent_binary() -> PathBuf {
    std::env::var_os("AIRLOCK_AGENT_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_airlock-agent")),
        PathBuf::from,
    )
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!(
            "airlock-agent-test-{}-{tag}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// The path as the protocol's `String`.
    pub fn str(&self, name: &str) -> String {
        self.join(name)
            .to_str()
            .expect("utf-8 temp path")
            .to_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running agent, killed (and its cgroup root removed) on drop.
pub struct AgentProcess {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    pub dir: TempDir,
    pub socket: PathBuf,
    pub cgroup_root: Option<PathBuf>,
    /// The agent's --state-dir, if it has one.
    pub state_dir: Option<PathBuf>,
}

impl AgentProcess {
    /// An agent without cgroups (process-group fallback).
    pub fn start() -> Self {
        Self::spawn(None, &[])
    }

    /// An agent without cgroups, with more command-line arguments.
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::spawn(None, args)
    }

    /// An agent without cgroups whose state directory is `state` in its temporary directory
    /// (not created beforehand).
    pub fn start_with_state_dir() -> Self {
        let mut agent = Self::spawn(None, &["--state-dir", "{dir}/state"]);
        agent.state_dir = Some(agent.dir.join("state"));
        agent
    }

    /// An agent whose executions get cgroups under a fresh directory of `cgroup2_mount`.
    pub fn start_with_cgroups(cgroup2_mount: &Path) -> Self {
        Self::start_with_cgroups_and_args(cgroup2_mount, &[])
    }

    /// The same, with more command-line arguments (`{dir}`: its temporary directory).
    pub fn start_with_cgroups_and_args(cgroup2_mount: &Path, args: &[&str]) -> Self {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::SeqCst);
        let root = cgroup2_mount.join(format!("airlock-test-{}-{n}", std::process::id()));
        Self::spawn(Some(root), args)
    }

    /// Starts the agent; `{dir}` in `args` stands for its temporary directory.
    fn spawn(cgroup_root: Option<PathBuf>, args: &[&str]) -> Self {
        let dir = TempDir::new("agent");
        let socket = dir.join("a.sock");
        let mut cmd = Command::new(agent_binary());
        cmd.arg("--listen")
            .arg(format!("unix:{}", socket.display()));
        if let Some(root) = &cgroup_root {
            cmd.arg("--cgroup-root").arg(root);
        }
        let dir_text = dir.path().to_str().expect("utf-8 temp path");
        cmd.args(args.iter().map(|a| a.replace("{dir}", dir_text)));
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .expect("start airlock-agent");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        loop {
            line.clear();
            let n = stdout.read_line(&mut line).expect("read agent stdout");
            assert!(n > 0, "airlock-agent exited before `{READY_LINE}`");
            if line.trim_end() == READY_LINE {
                break;
            }
        }
        Self {
            child,
            _stdout: stdout,
            dir,
            socket,
            cgroup_root,
            state_dir: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A connected client (Ready already read), with generous I/O timeouts.
    pub fn client(&self) -> Client {
        let client = AgentClient::connect_unix(&self.socket).expect("connect to agent");
        client
            .reader()
            .set_read_timeout(Some(IO_TIMEOUT))
            .expect("read timeout");
        client
    }

    /// A raw connection, Ready not yet read.
    pub fn raw(&self) -> UnixStream {
        let s = UnixStream::connect(&self.socket).expect("connect to agent");
        s.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
        s
    }

    /// Waits for the agent to exit on its own.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(root) = &self.cgroup_root {
            remove_cgroup_tree(root);
        }
    }
}

/// Kills and removes a cgroup directory and its children (test cleanup).
fn remove_cgroup_tree(root: &Path) {
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            if e.path().is_dir() {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    let _ = std::fs::write(root.join("cgroup.kill"), "1");
    for _ in 0..100 {
        if std::fs::remove_dir(root).is_ok() || !root.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn argv(args: &[&str]) -> pb::Exec {
    pb::Exec {
        command: Some(exec::Command::Argv(Argv {
            args: args.iter().map(|s| (*s).to_owned()).collect(),
        })),
        ..Default::default()
    }
}

pub fn shell(script: &str) -> pb::Exec {
    pb::Exec {
        command: Some(exec::Command::Shell(script.to_owned())),
        ..Default::default()
    }
}

/// Everything an execution produced.
pub struct Collected {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit: ExecExit,
}

impl Collected {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// The next response to request `id`, which must have a kind.
pub fn next_kind(c: &mut Client, id: u64) -> response::Kind {
    let resp = c.recv_for(id).expect("response");
    resp.kind.expect("response without a kind")
}

/// Runs `exec` to completion and collects its output.
pub fn run(client: &mut Client, exec: pb::Exec) -> Collected {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let exit = client
        .exec_collect(exec, |stream, data| match stream {
            StreamKind::Stdout => stdout.extend_from_slice(data),
            _ => stderr.extend_from_slice(data),
        })
        .expect("exec");
    Collected {
        stdout,
        stderr,
        exit,
    }
}

pub fn exit_code(exit: &ExecExit) -> Option<i32> {
    match exit.status {
        Some(exec_exit::Status::ExitCode(c)) => Some(c),
        _ => None,
    }
}

pub fn exit_signal(exit: &ExecExit) -> Option<i32> {
    match exit.status {
        Some(exec_exit::Status::Signal(s)) => Some(s),
        _ => None,
    }
}

/// Whether `pid` is a live (not zombie) process.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat_fields(&stat)
            .first()
            .is_some_and(|state| *state != "Z"),
        Err(_) => false,
    }
}

/// Whether `pid` exists at all (live or zombie).
pub fn exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The fields of /proc/PID/stat after the command name: state, ppid, pgrp, ...
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default()
}

/// Processes (live or zombie) whose process group is `pgid`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if stat_fields(&stat).get(2) == Some(&pgid.to_string().as_str()) {
            pids.push(pid);
        }
    }
    pids
}

/// Polls `cond` until it holds or `within` passes; returns whether it held.
pub fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The first cgroup v2 mount of this machine that we may create directories in.
pub fn writable_cgroup2() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<_> = l.split_whitespace().collect();
            let dir = f.get(1)?;
            (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(dir))
        })
        .find(|dir| {
            // Tests of one binary run in parallel threads of one process: the probe's name
            // must be unique per call, or one test's probe makes another's creation fail.
            static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let probe = dir.join(format!("airlock-probe-{}-{n}", std::process::id()));
            let ok = std::fs::create_dir(&probe).is_ok();
            let _ = std::fs::remove_dir(&probe);
            ok
        })
}
