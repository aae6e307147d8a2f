//! Exec requests: validation, spawning, the table of running executions, Signal and Stdin.
//!
//! Each execution runs on its own thread (see [`crate::exec_loop`]), which spawns the process,
//! answers ExecStarted (or the spawn's Error), streams its output and sends ExecExit. The
//! process leads its own session and process group and, where cgroups are available, lives in
//! its own cgroup; [`KillTarget`] is whichever of the two reaches all of its processes.
//!
//! Executions belong to the connection that started them (or adopted them with Attach): Signal
//! and Stdin from another connection do not find them, and they are killed when that connection
//! closes, unless they were started with keep_on_disconnect: those are left unowned (see
//! [`crate::delivery`]). The table also keeps the exits of the most recent executions that
//! ended unowned, for a later Attach.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, ErrorCode, ExecExit, exec};
use airlock_proto::{
    DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_ORPHAN_BUFFER_BYTES, EXITED_ORPHAN_TTL_SECS,
    MAX_ARGV_ENV_BYTES, MAX_CONCURRENT_EXECS, MAX_EXITED_ORPHANS,
};

use crate::agent::Agent;
use crate::cgroup::ExecCgroup;
use crate::delivery::{Delivery, OrphanLimits, Release};
use crate::error::ReqError;
use crate::reaper::{ExitSlot, Waker};
use crate::server::ConnWriter;
use crate::sys;

/// The environment every execution starts from (Exec.env adds to and overrides it).
pub const BASE_ENV: [(&str, &str); 4] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("LANG", "C.UTF-8"),
    ("TERM", "dumb"),
];
/// Stdin bytes an execution may have queued (accepted, not yet written to its pipe).
pub const MAX_PENDING_STDIN: usize = 8 << 20;
/// The variable that carries the sandbox id (Reseed) into executions.
pub const SANDBOX_ID_ENV: &str = "AIRLOCK_SANDBOX_ID";
/// How long the exit of an execution that ended unowned is kept for an Attach.
const EXITED_ORPHAN_TTL: Duration = Duration::from_secs(EXITED_ORPHAN_TTL_SECS);

/// The environment executions start from: [`BASE_ENV`], plus [`SANDBOX_ID_ENV`] once a
/// sandbox id is set.
pub fn base_env(sandbox_id: &str) -> Vec<(String, String)> {
    let mut env: Vec<_> = BASE_ENV
        .iter()
        .map(|&(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if !sandbox_id.is_empty() {
        env.push((SANDBOX_ID_ENV.to_owned(), sandbox_id.to_owned()));
    }
    env
}

/// A validated Exec request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    /// argv\[0\] first.
    pub argv: Vec<String>,
    /// The full environment, sorted by name.
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub stdin: Vec<u8>,
    pub stdin_open: bool,
    pub timeout: Option<Duration>,
    pub max_output_bytes: u64,
    pub keep_on_disconnect: bool,
    /// The cgroup's memory.max, if one was asked for.
    pub memory_max: Option<u64>,
}

impl ExecSpec {
    /// Checks `req`; the environment is `base` (see [`base_env`]) with `req.env` on top.
    pub fn validate(req: pb::Exec, base: Vec<(String, String)>) -> Result<Self, ReqError> {
        let argv = match req.command {
            Some(exec::Command::Argv(a)) => a.args,
            Some(exec::Command::Shell(s)) => vec!["/bin/sh".into(), "-c".into(), s],
            None => return Err(ReqError::invalid("exec needs argv or shell")),
        };
        if argv.first().is_none_or(String::is_empty) {
            return Err(ReqError::invalid("argv is empty"));
        }
        check_size(&argv, &req.env)?;
        let strings = argv.iter().chain(req.env.keys()).chain(req.env.values());
        if strings.chain([&req.cwd]).any(|s| s.contains('\0')) {
            return Err(ReqError::invalid(
                "argv, env and cwd must not contain NUL bytes",
            ));
        }
        if let Some(bad) = req.env.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Err(ReqError::invalid(format!(
                "invalid environment name {bad:?}"
            )));
        }
        let mut env: HashMap<String, String> = base.into_iter().collect();
        env.extend(req.env);
        let mut env: Vec<_> = env.into_iter().collect();
        env.sort();
        Ok(Self {
            argv,
            env,
            cwd: if req.cwd.is_empty() {
                "/".into()
            } else {
                req.cwd
            },
            stdin: req.stdin,
            stdin_open: req.stdin_open,
            timeout: (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms)),
            max_output_bytes: match req.max_output_bytes {
                0 => DEFAULT_MAX_OUTPUT_BYTES,
                n => n,
            },
            keep_on_disconnect: req.keep_on_disconnect,
            memory_max: (req.memory_max_bytes > 0).then_some(req.memory_max_bytes),
        })
    }
}

/// argv plus env, each string with its terminating NUL (as the kernel counts them).
fn check_size(argv: &[String], env: &HashMap<String, String>) -> Result<(), ReqError> {
    let args: usize = argv.iter().map(|a| a.len() + 1).sum();
    let vars: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let total = args + vars;
    if total > MAX_ARGV_ENV_BYTES {
        return Err(ReqError::new(
            ErrorCode::TooLarge,
            format!("argv and env take {total} bytes, limit {MAX_ARGV_ENV_BYTES}"),
        ));
    }
    Ok(())
}

/// What reaches every process of an execution.
#[derive(Debug)]
pub enum KillTarget {
    Cgroup(ExecCgroup),
    /// The process group (= session) the child leads.
    Group(i32),
}

impl KillTarget {
    pub fn signal(&self, sig: i32) -> io::Result<()> {
        match self {
            Self::Cgroup(cg) if sig == libc::SIGKILL => cg.kill(),
            Self::Cgroup(cg) => cg.signal_each(sig),
            Self::Group(pgid) => sys::killpg(*pgid, sig),
        }
    }
}

/// A chunk of stdin waiting to be written to the process.
#[derive(Debug)]
pub struct StdinChunk {
    /// The connection and Stdin request to answer once written (`None` for Exec.stdin).
    pub reply_to: Option<(Arc<ConnWriter>, u64)>,
    pub data: Vec<u8>,
    /// Close stdin after this chunk.
    pub eof: bool,
}

/// Stdin state shared between the connection (producer) and the execution's loop.
#[derive(Debug, Default)]
pub struct StdinQueue {
    /// Stdin requests are accepted (stdin_open, and no eof or broken pipe yet).
    pub accepting: bool,
    pub chunks: VecDeque<StdinChunk>,
    /// Bytes accepted and not yet written.
    pub pending_bytes: usize,
}

/// A running execution, shared by its loop, its connection and the agent's table.
#[derive(Debug)]
pub struct Execution {
    pub exec_id: u64,
    /// Who gets its responses.
    pub delivery: Arc<Delivery>,
    pub pid: i32,
    pub target: KillTarget,
    pub waker: Arc<Waker>,
    pub exit: Arc<ExitSlot>,
    pub stdin: Mutex<StdinQueue>,
    pub killed: AtomicBool,
    pub timed_out: AtomicBool,
}

impl Execution {
    /// Handles a Signal request.
    pub fn signal(&self, sig: i32) -> Result<(), ReqError> {
        if !(1..=64).contains(&sig) {
            return Err(ReqError::invalid(format!("invalid signal {sig}")));
        }
        if sig == libc::SIGKILL {
            self.killed.store(true, Ordering::SeqCst);
        }
        self.target.signal(sig).or_else(|e| match e.raw_os_error() {
            // The processes are already gone: nothing left to signal.
            Some(libc::ESRCH) => Ok(()),
            _ => Err(ReqError::io("sending the signal", &e)),
        })
    }

    /// Kills every process of the execution (timeout, closed connection, power-off).
    pub fn kill_all(&self) {
        if let Err(e) = self.target.signal(libc::SIGKILL)
            && e.raw_os_error() != Some(libc::ESRCH)
        {
            eprintln!("airlock-agent: killing exec {}: {e}", self.exec_id);
        }
    }

    /// Queues Stdin request `request_id` of `conn`; its Ok is sent once the data is in the pipe.
    pub fn push_stdin(
        &self,
        conn: &Arc<ConnWriter>,
        request_id: u64,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<(), ReqError> {
        let mut q = self.stdin_queue();
        if !q.accepting {
            return Err(ReqError::invalid(format!(
                "stdin of exec {} is closed",
                self.exec_id
            )));
        }
        if q.pending_bytes + data.len() > MAX_PENDING_STDIN {
            return Err(ReqError::new(
                ErrorCode::LimitExceeded,
                format!("more than {MAX_PENDING_STDIN} bytes of stdin waiting; wait for Ok"),
            ));
        }
        q.pending_bytes += data.len();
        q.accepting = !eof;
        q.chunks.push_back(StdinChunk {
            reply_to: Some((Arc::clone(conn), request_id)),
            data,
            eof,
        });
        drop(q);
        self.waker.wake();
        Ok(())
    }

    pub fn stdin_queue(&self) -> MutexGuard<'_, StdinQueue> {
        self.stdin.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every execution running in the agent, the count limit, and the exits kept for Attach.
#[derive(Debug)]
pub struct ExecTable {
    tables: Mutex<Tables>,
    last_id: AtomicU64,
    running: Arc<AtomicUsize>,
    orphan_limits: Arc<OrphanLimits>,
}

#[derive(Debug, Default)]
struct Tables {
    /// Executions whose process runs (or whose exit is being delivered).
    by_id: HashMap<u64, Arc<Execution>>,
    /// Executions kept on disconnect that ended while nobody owned them, oldest first, with
    /// the time they were added: at most [`MAX_EXITED_ORPHANS`], for [`EXITED_ORPHAN_TTL`].
    exited: VecDeque<(Instant, Arc<Delivery>)>,
}

impl Tables {
    fn expire(&mut self, now: Instant) {
        while self.exited.len() > MAX_EXITED_ORPHANS
            || self
                .exited
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= EXITED_ORPHAN_TTL)
        {
            self.exited.pop_front();
        }
    }

    fn forget_exited(&mut self, exec_id: u64) {
        self.exited.retain(|(_, d)| d.exec_id() != exec_id);
    }
}

impl Default for ExecTable {
    fn default() -> Self {
        Self::new(DEFAULT_ORPHAN_BUFFER_BYTES)
    }
}

/// One of the [`MAX_CONCURRENT_EXECS`] places; given back on drop.
#[derive(Debug)]
pub struct ExecPlace(Arc<AtomicUsize>);

impl Drop for ExecPlace {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ExecTable {
    /// A table whose unowned executions buffer at most `orphan_buffer_bytes` of output each.
    pub fn new(orphan_buffer_bytes: usize) -> Self {
        Self {
            tables: Mutex::new(Tables::default()),
            last_id: AtomicU64::new(0),
            running: Arc::new(AtomicUsize::new(0)),
            orphan_limits: Arc::new(OrphanLimits::new(orphan_buffer_bytes)),
        }
    }

    /// The output buffer limits of unowned executions.
    pub fn orphan_limits(&self) -> &Arc<OrphanLimits> {
        &self.orphan_limits
    }

    /// Takes a place for a new execution, or fails with LIMIT_EXCEEDED.
    pub fn reserve(&self) -> Result<ExecPlace, ReqError> {
        self.running
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_CONCURRENT_EXECS).then_some(n + 1)
            })
            .map(|_| ExecPlace(Arc::clone(&self.running)))
            .map_err(|_| {
                ReqError::new(
                    ErrorCode::LimitExceeded,
                    format!("{MAX_CONCURRENT_EXECS} executions are already running"),
                )
            })
    }

    /// A fresh execution id, unique for the agent's lifetime.
    pub fn next_id(&self) -> u64 {
        self.last_id.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Registers `exec`, started by `conn`; fails (and kills it) if `conn` closed meanwhile
    /// (even if kept on disconnect: its host never learnt its id).
    pub fn insert(&self, exec: Arc<Execution>, conn: &ConnWriter) -> bool {
        let mut t = self.lock();
        t.expire(Instant::now());
        if conn.is_closed() {
            drop(t);
            exec.kill_all();
            return false;
        }
        t.by_id.insert(exec.exec_id, exec);
        true
    }

    /// The execution `exec_id` if it runs and belongs to `conn`.
    pub fn get(&self, conn: &Arc<ConnWriter>, exec_id: u64) -> Result<Arc<Execution>, ReqError> {
        self.lock()
            .by_id
            .get(&exec_id)
            .filter(|e| e.delivery.owned_by(conn))
            .cloned()
            .ok_or_else(|| {
                ReqError::new(
                    ErrorCode::NotFound,
                    format!("no running execution {exec_id} on this connection"),
                )
            })
    }

    /// The execution ended with `exit`: gives back its `place`, sends the exit to its owner
    /// and takes it out of the table; a kept execution whose exit reached nobody moves to the
    /// exits kept for Attach.
    pub fn exited(&self, exec: &Execution, exit: ExecExit, place: ExecPlace) {
        let delivery = &exec.delivery;
        delivery.finish(
            exit,
            // Before the host hears of the exit, so that it may start another at once.
            move || drop(place),
            |delivered| {
                let mut t = self.lock();
                t.by_id.remove(&exec.exec_id);
                if delivery.keep() && !delivered {
                    t.exited.push_back((Instant::now(), Arc::clone(delivery)));
                    t.expire(Instant::now());
                }
            },
        );
    }

    /// Handles Attach request `request_id` of `conn`: see [`Delivery::attach`].
    pub fn attach(
        &self,
        conn: &Arc<ConnWriter>,
        request_id: u64,
        req: &pb::Attach,
    ) -> Result<(), ReqError> {
        let exec_id = req.exec_id;
        let delivery = {
            let mut t = self.lock();
            t.expire(Instant::now());
            let running = t.by_id.get(&exec_id).map(|e| Arc::clone(&e.delivery));
            running.or_else(|| {
                t.exited
                    .iter()
                    .find(|(_, d)| d.exec_id() == exec_id)
                    .map(|(_, d)| Arc::clone(d))
            })
        };
        let delivery = delivery.ok_or_else(|| {
            ReqError::new(
                ErrorCode::NotFound,
                format!("no execution {exec_id} to attach to (unknown, or its exit was forgotten)"),
            )
        })?;
        let from = [req.stdout_offset, req.stderr_offset];
        if delivery.attach(conn, request_id, from)? {
            self.lock().forget_exited(exec_id);
        }
        Ok(())
    }

    /// Marks `conn` closed and kills its executions, except those kept on disconnect, which
    /// become unowned.
    pub fn close_connection(&self, conn: &Arc<ConnWriter>) {
        let doomed: Vec<_> = {
            let t = self.lock();
            conn.mark_closed();
            t.by_id
                .values()
                .filter(|e| e.delivery.release(conn) == Release::Kill)
                .cloned()
                .collect()
        };
        for exec in doomed {
            exec.kill_all();
        }
    }

    /// Kills every execution (power-off).
    pub fn kill_all(&self) {
        let all: Vec<_> = self.lock().by_id.values().cloned().collect();
        for exec in all {
            exec.kill_all();
        }
    }

    /// How many exits of unowned executions are kept.
    #[cfg(test)]
    fn exited_len(&self) -> usize {
        self.lock().exited.len()
    }

    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Handles an Exec request: validates it, takes a place and starts the execution's thread,
/// which answers from then on.
pub fn start(
    agent: &Arc<Agent>,
    conn: &Arc<ConnWriter>,
    request_id: u64,
    req: pb::Exec,
) -> Result<(), ReqError> {
    let spec = ExecSpec::validate(req, agent.base_env())?;
    // Held by the execution's thread until it ends (dropped with the closure if the thread
    // cannot start).
    let place = agent.execs.reserve()?;
    let (agent, conn) = (Arc::clone(agent), Arc::clone(conn));
    std::thread::Builder::new()
        .name(format!("exec-{request_id}"))
        .spawn(move || crate::exec_loop::run(&agent, conn, request_id, spec, place))
        .map(drop)
        .map_err(|e| ReqError::io("starting the execution's thread", &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_proto::pb::Argv;

    fn validate(req: pb::Exec) -> Result<ExecSpec, ReqError> {
        ExecSpec::validate(req, base_env(""))
    }

    fn argv(args: &[&str]) -> pb::Exec {
        pb::Exec {
            command: Some(exec::Command::Argv(Argv {
                args: args.iter().map(|s| (*s).to_owned()).collect(),
            })),
            ..Default::default()
        }
    }

    #[test]
    fn shell_becomes_bin_sh_dash_c() {
        let req = pb::Exec {
            command: Some(exec::Command::Shell("echo hi".into())),
            ..Default::default()
        };
        let spec = validate(req).unwrap();
        assert_eq!(spec.argv, ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(spec.cwd, "/");
        assert_eq!(spec.max_output_bytes, DEFAULT_MAX_OUTPUT_BYTES);
        assert_eq!(spec.timeout, None);
    }

    #[test]
    fn env_overrides_base_and_is_sorted() {
        let mut req = argv(&["env"]);
        req.env.insert("HOME".into(), "/tmp".into());
        req.env.insert("A".into(), "1".into());
        let spec = validate(req).unwrap();
        let names: Vec<_> = spec.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["A", "HOME", "LANG", "PATH", "TERM"]);
        assert!(spec.env.contains(&("HOME".into(), "/tmp".into())));
    }

    #[test]
    fn missing_or_empty_command_is_invalid() {
        let none = validate(pb::Exec::default()).unwrap_err();
        assert_eq!(none.code, ErrorCode::InvalidArgument);
        let empty = validate(argv(&[])).unwrap_err();
        assert_eq!(empty.code, ErrorCode::InvalidArgument);
        let blank = validate(argv(&[""])).unwrap_err();
        assert_eq!(blank.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn nul_bytes_and_bad_env_names_are_invalid() {
        let nul = validate(argv(&["a\0b"])).unwrap_err();
        assert_eq!(nul.code, ErrorCode::InvalidArgument);
        let mut req = argv(&["true"]);
        req.env.insert("A=B".into(), "1".into());
        assert_eq!(validate(req).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn argv_and_env_past_one_mib_is_too_large() {
        let big = "x".repeat(MAX_ARGV_ENV_BYTES / 2);
        let mut req = argv(&["true", &big]);
        req.env.insert("BIG".into(), big.clone());
        assert_eq!(validate(req).unwrap_err().code, ErrorCode::TooLarge);
        let just_fits = "x".repeat(MAX_ARGV_ENV_BYTES - "true".len() - 2);
        assert!(validate(argv(&["true", &just_fits])).is_ok());
    }

    #[test]
    fn timeout_and_output_cap_are_taken() {
        let mut req = argv(&["true"]);
        req.timeout_ms = 1500;
        req.max_output_bytes = 10;
        let spec = validate(req).unwrap();
        assert_eq!(spec.timeout, Some(Duration::from_millis(1500)));
        assert_eq!(spec.max_output_bytes, 10);
    }

    #[test]
    fn reserve_stops_at_the_concurrency_limit_and_frees_on_drop() {
        let table = ExecTable::default();
        let places: Vec<_> = (0..MAX_CONCURRENT_EXECS)
            .map(|_| table.reserve().unwrap())
            .collect();
        assert_eq!(table.reserve().unwrap_err().code, ErrorCode::LimitExceeded);
        drop(places);
        assert!(table.reserve().is_ok());
    }

    #[test]
    fn ids_are_unique_and_start_at_one() {
        let table = ExecTable::default();
        assert_eq!(table.next_id(), 1);
        assert_eq!(table.next_id(), 2);
    }

    #[test]
    fn a_sandbox_id_joins_the_base_environment_and_env_can_override_it() {
        let spec = ExecSpec::validate(argv(&["env"]), base_env("sb-1")).unwrap();
        assert!(spec.env.contains(&(SANDBOX_ID_ENV.into(), "sb-1".into())));
        let mut req = argv(&["env"]);
        req.env.insert(SANDBOX_ID_ENV.into(), "mine".into());
        let spec = ExecSpec::validate(req, base_env("sb-1")).unwrap();
        assert!(spec.env.contains(&(SANDBOX_ID_ENV.into(), "mine".into())));
        let spec = validate(argv(&["env"])).unwrap();
        assert!(!spec.env.iter().any(|(k, _)| k == SANDBOX_ID_ENV));
    }

    #[test]
    fn keep_on_disconnect_is_taken() {
        let spec = validate(argv(&["true"]).with_keep_on_disconnect(true)).unwrap();
        assert!(spec.keep_on_disconnect);
        assert!(!validate(argv(&["true"])).unwrap().keep_on_disconnect);
    }

    fn orphan(exec_id: u64) -> Arc<Delivery> {
        use std::os::unix::net::UnixStream;
        let (ours, _peer) = UnixStream::pair().unwrap();
        let file = |s: UnixStream| std::fs::File::from(std::os::fd::OwnedFd::from(s));
        let conn = Arc::new(ConnWriter::new(file(ours.try_clone().unwrap()), file(ours)));
        let limits = Arc::new(OrphanLimits::new(16));
        Arc::new(Delivery::new(exec_id, 1, true, conn, 1, limits))
    }

    #[test]
    fn exited_orphans_are_kept_for_the_most_recent_and_for_a_while() {
        let table = ExecTable::default();
        let now = Instant::now();
        {
            let mut t = table.lock();
            for id in 1..=(MAX_EXITED_ORPHANS as u64 + 5) {
                t.exited.push_back((now, orphan(id)));
            }
            t.expire(now);
        }
        assert_eq!(table.exited_len(), MAX_EXITED_ORPHANS);
        assert_eq!(
            table.lock().exited.front().map(|(_, d)| d.exec_id()),
            Some(6)
        );
        table.lock().expire(now + EXITED_ORPHAN_TTL);
        assert_eq!(table.exited_len(), 0);
    }

    #[test]
    fn attach_of_an_unknown_execution_is_not_found() {
        let table = ExecTable::default();
        let d = orphan(1);
        let conn = {
            use std::os::unix::net::UnixStream;
            let (ours, _peer) = UnixStream::pair().unwrap();
            let file = |s: UnixStream| std::fs::File::from(std::os::fd::OwnedFd::from(s));
            Arc::new(ConnWriter::new(file(ours.try_clone().unwrap()), file(ours)))
        };
        table.lock().exited.push_back((Instant::now(), d));
        let req = pb::Attach {
            exec_id: 2,
            ..Default::default()
        };
        let err = table.attach(&conn, 1, &req).unwrap_err();
        assert_eq!(err.code, ErrorCode::NotFound);
    }
}
