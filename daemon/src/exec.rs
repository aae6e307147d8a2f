//! Executions: one agent connection and one thread per execution. The thread sends the Exec
//! request, appends output to the execution's files (`output/ID.stdout`, `.stderr`; they are the
//! stored output that StreamExecution and GetExecution read, live or after the fact) and stores
//! the record when the execution ends. The daemon enforces the timeout itself: when it passes,
//! the execution's tree gets SIGKILL through the same connection and, if the guest does not
//! answer within a grace period, the connection is cut and the record ends anyway.

use std::collections::HashMap;
use std::io::{BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_api::v1::{ExecRequest, Execution, ExecutionState, exec_request};
use airlock_proto::frame::{read_frame, write_frame};
use airlock_proto::pb::{self, Request, Response, request, response};
use tracing::{info, warn};

use crate::error::{ApiError, ApiResult};
use crate::state::{Daemon, SandboxRt, new_id, now_ms};

/// How long the guest gets to report a killed execution's exit before the daemon cuts it off.
const KILL_GRACE: Duration = Duration::from_secs(3);

/// A running execution.
#[derive(Debug)]
pub struct ExecRt {
    pub id: String,
    pub sandbox_id: String,
    pub tenant: String,
    record: Mutex<Execution>,
    /// Bytes stored per stream (stdout, stderr).
    stored: Mutex<[u64; 2]>,
    pub changed: tokio::sync::watch::Sender<u64>,
    writer: Mutex<Option<UnixStream>>,
    agent_exec_id: Mutex<Option<u64>>,
    /// A signal asked for before the agent had started the process (sent once it has).
    pending_signal: Mutex<Option<i32>>,
    next_request: AtomicU64,
    finished: AtomicBool,
    /// Why the daemon ended it (timeout, kill, sandbox gone), overriding what the guest says.
    ended_by: Mutex<Option<(ExecutionState, String, String)>>,
    paths: [PathBuf; 2],
    max_output: u64,
}

/// How long an execution whose agent connection broke waits for its sandbox to be reported
/// dead (whose reason it then takes) before it ends as AGENT_UNAVAILABLE.
const LOST_CONNECTION_GRACE: Duration = Duration::from_secs(3);

/// The output files of execution `id`.
pub fn output_paths(daemon: &Daemon, id: &str) -> [PathBuf; 2] {
    [
        daemon.output_dir.join(format!("{id}.stdout")),
        daemon.output_dir.join(format!("{id}.stderr")),
    ]
}

/// Ends a record whose execution was lost (no exit from the guest).
pub fn end_lost(e: &mut Execution, reason: &str, message: &str) {
    e.state = ExecutionState::Failed as i32;
    e.error_reason = reason.to_owned();
    e.error_message = message.to_owned();
    e.exit_code = -1;
    e.ended_unix_ms = now_ms();
}

/// The command line an Exec request runs.
fn command_of(req: &ExecRequest) -> ApiResult<Vec<String>> {
    let argv = match &req.command {
        Some(exec_request::Command::Argv(a)) => a.args.clone(),
        Some(exec_request::Command::Shell(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        Some(exec_request::Command::Code(c)) => match c.language.as_str() {
            "" | "python" | "python3" => vec!["python3".into(), "-c".into(), c.source.clone()],
            "sh" | "bash" | "shell" => vec!["/bin/sh".into(), "-c".into(), c.source.clone()],
            other => {
                return Err(ApiError::InvalidArgument(format!(
                    "language {other:?}: use python or sh"
                )));
            }
        },
        None => return Err(ApiError::InvalidArgument("no command".into())),
    };
    if argv.is_empty() || argv[0].is_empty() {
        return Err(ApiError::InvalidArgument("empty argv".into()));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::InvalidArgument("NUL byte in the command".into()));
    }
    Ok(argv)
}

/// Starts an execution in `sb`; returns its id at once.
pub fn start(daemon: &Arc<Daemon>, sb: &Arc<SandboxRt>, req: ExecRequest) -> ApiResult<String> {
    let argv = command_of(&req)?;
    let timeout_ms = match req.timeout_ms {
        0 => daemon.cfg.default_exec_timeout_ms,
        t => t.min(daemon.cfg.max_exec_timeout_ms),
    };
    let mut env: HashMap<String, String> = sb.env.clone();
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::InvalidArgument(format!(
                "bad environment entry {k:?}"
            )));
        }
        env.insert(k.clone(), v.clone());
    }
    let vmm = sb
        .vmm()
        .ok_or_else(|| ApiError::Internal("sandbox without VMM".into()))?;
    let id = new_id("ex");
    let record = Execution {
        id: id.clone(),
        sandbox_id: sb.id.clone(),
        tenant: sb.tenant.clone(),
        template_id: sb.snapshot().template_id,
        command: argv.clone(),
        cwd: req.cwd.clone(),
        state: ExecutionState::Running as i32,
        started_unix_ms: now_ms(),
        timeout_ms,
        ..Default::default()
    };
    daemon.store.put_execution(&record)?;
    let paths = output_paths(daemon, &id);
    for p in &paths {
        std::fs::File::create(p)?;
    }
    let (changed, _) = tokio::sync::watch::channel(0u64);
    let rt = Arc::new(ExecRt {
        id: id.clone(),
        sandbox_id: sb.id.clone(),
        tenant: sb.tenant.clone(),
        record: Mutex::new(record),
        stored: Mutex::new([0, 0]),
        changed,
        writer: Mutex::new(None),
        agent_exec_id: Mutex::new(None),
        pending_signal: Mutex::new(None),
        next_request: AtomicU64::new(2),
        finished: AtomicBool::new(false),
        ended_by: Mutex::new(None),
        paths,
        max_output: daemon.cfg.max_output_bytes,
    });
    daemon
        .executions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id.clone(), rt.clone());
    let exec = pb::Exec {
        command: Some(pb::exec::Command::Argv(pb::Argv { args: argv })),
        cwd: if req.cwd.is_empty() {
            "/root".into()
        } else {
            req.cwd.clone()
        },
        env,
        stdin: req.stdin.clone(),
        stdin_open: false,
        timeout_ms,
        max_output_bytes: daemon.cfg.max_output_bytes,
        keep_on_disconnect: false,
        memory_max_bytes: u64::from(req.memory_limit_mib) << 20,
    };
    let d = daemon.clone();
    let r = rt.clone();
    let vsock = vmm.vsock.clone();
    std::thread::Builder::new()
        .name(format!("exec-{}", &id[3..11]))
        .spawn(move || r.run(&d, &vsock, exec))
        .map_err(|e| ApiError::Internal(format!("exec thread: {e}")))?;
    // The daemon's own clock: the timeout holds without a client and without the guest.
    let d = daemon.clone();
    let r = rt.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(timeout_ms)).await;
        if r.finished.load(Ordering::SeqCst) {
            return;
        }
        r.end_by(
            &d,
            ExecutionState::TimedOut,
            "EXEC_TIMEOUT",
            &format!("the execution ran past its timeout of {timeout_ms} ms"),
            libc::SIGKILL,
        )
        .await;
    });
    info!(execution = %id, sandbox = %sb.id, "execution started");
    Ok(id)
}

impl ExecRt {
    pub fn record(&self) -> Execution {
        self.record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    /// Bytes stored per stream so far.
    pub fn stored(&self) -> [u64; 2] {
        *self.stored.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// The thread body: connect, exec, collect output, finish.
    fn run(self: Arc<Self>, daemon: &Arc<Daemon>, vsock: &std::path::Path, exec: pb::Exec) {
        let result = self.run_inner(vsock, exec);
        match result {
            Ok(exit) => self.finish(daemon, Some(exit), None),
            Err(message) => {
                // A lost connection is often the sandbox dying (a guest kernel panic, a killed
                // VMM): the VMM's watcher then ends this execution with that reason. Give it a
                // moment before calling it a lost agent.
                let deadline = std::time::Instant::now() + LOST_CONNECTION_GRACE;
                while !self.is_finished() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.finish(daemon, None, Some(("AGENT_UNAVAILABLE", message)));
            }
        }
    }

    fn run_inner(&self, vsock: &std::path::Path, exec: pb::Exec) -> Result<pb::ExecExit, String> {
        let stream = crate::agent::connect(vsock, Duration::from_secs(10))
            .map_err(|e| format!("connecting to the agent: {e}"))?;
        let writer = stream.try_clone().map_err(|e| e.to_string())?;
        let mut reader = BufReader::with_capacity(64 << 10, stream);
        let first: Response = read_frame(&mut reader)
            .map_err(|e| e.to_string())?
            .ok_or("the agent closed the connection")?;
        if !matches!(first.kind, Some(response::Kind::Ready(_))) {
            return Err("the agent's first frame was not Ready".into());
        }
        // Output may take as long as the execution does; the daemon's timer bounds it.
        reader
            .get_ref()
            .set_read_timeout(None)
            .map_err(|e| e.to_string())?;
        *self.writer.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(writer.try_clone().map_err(|e| e.to_string())?);
        if self.finished.load(Ordering::SeqCst) {
            return Err("ended before it started".into());
        }
        {
            let mut w = &writer;
            write_frame(
                &mut w,
                &Request {
                    id: 1,
                    kind: Some(request::Kind::Exec(exec)),
                },
            )
            .map_err(|e| e.to_string())?;
            w.flush().map_err(|e| e.to_string())?;
        }
        let mut files = [
            std::fs::OpenOptions::new()
                .append(true)
                .open(&self.paths[0])
                .map_err(|e| e.to_string())?,
            std::fs::OpenOptions::new()
                .append(true)
                .open(&self.paths[1])
                .map_err(|e| e.to_string())?,
        ];
        let mut truncated = false;
        loop {
            let resp: Response = read_frame(&mut reader)
                .map_err(|e| format!("agent connection: {e}"))?
                .ok_or("the agent connection closed")?;
            if resp.id != 1 {
                // Answers to our Signal requests.
                continue;
            }
            match resp.kind {
                Some(response::Kind::ExecStarted(s)) => {
                    let pending = {
                        let mut id = self.agent_exec_id.lock().unwrap_or_else(|e| e.into_inner());
                        *id = Some(s.exec_id);
                        self.pending_signal
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take()
                    };
                    if let Some(sig) = pending {
                        let _ = self.signal(sig);
                    }
                    // A kill that came before the agent's id was known.
                    if let Some((_, _, _)) = self
                        .ended_by
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                    {
                        let _ = self.signal(libc::SIGKILL);
                    }
                }
                Some(response::Kind::Output(o)) => {
                    let slot = if o.stream == pb::StreamKind::Stderr as i32 {
                        1
                    } else {
                        0
                    };
                    let mut stored = self.stored.lock().unwrap_or_else(|e| e.into_inner());
                    let room = self.max_output.saturating_sub(stored[slot]) as usize;
                    let take = o.data.len().min(room);
                    if take < o.data.len() {
                        truncated = true;
                    }
                    if take > 0 {
                        files[slot]
                            .write_all(&o.data[..take])
                            .map_err(|e| format!("storing output: {e}"))?;
                        stored[slot] += take as u64;
                    }
                    drop(stored);
                    self.bump();
                }
                Some(response::Kind::ExecExit(mut x)) => {
                    x.output_truncated |= truncated;
                    return Ok(x);
                }
                Some(response::Kind::Error(e)) => {
                    return Err(format!("the agent refused the execution: {}", e.message));
                }
                other => return Err(format!("unexpected frame from the agent: {other:?}")),
            }
        }
    }

    /// Sends `signal` to the execution's process tree (through its own connection); before the
    /// agent has started the process, the signal is sent as soon as it has.
    pub fn signal(&self, signal: i32) -> Result<(), String> {
        let exec_id = {
            let id = self.agent_exec_id.lock().unwrap_or_else(|e| e.into_inner());
            match *id {
                Some(x) => x,
                None => {
                    *self
                        .pending_signal
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(signal);
                    return Ok(());
                }
            }
        };
        let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut w) = w.as_ref() else {
            return Err("no agent connection".into());
        };
        let id = self.next_request.fetch_add(1, Ordering::SeqCst);
        let req = Request {
            id,
            kind: Some(request::Kind::Signal(pb::Signal { exec_id, signal })),
        };
        write_frame(&mut w, &req).map_err(|e| e.to_string())?;
        w.flush().map_err(|e| e.to_string())
    }

    /// Ends the execution for the daemon's reason: signals it, gives the guest a grace period to
    /// report the exit, then cuts the connection. The record says `state` and `reason` either way.
    pub async fn end_by(
        &self,
        daemon: &Arc<Daemon>,
        state: ExecutionState,
        reason: &str,
        message: &str,
        signal: i32,
    ) {
        {
            let mut e = self.ended_by.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_none() {
                *e = Some((state, reason.to_owned(), message.to_owned()));
            }
        }
        if let Err(e) = self.signal(signal) {
            warn!(execution = %self.id, "signal: {e}");
        }
        let deadline = tokio::time::Instant::now() + KILL_GRACE;
        while !self.is_finished() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !self.is_finished() {
            self.cut();
            self.finish(daemon, None, Some((reason, message.to_owned())));
        }
    }

    /// The sandbox went away: end the record now.
    pub fn fail(&self, daemon: &Arc<Daemon>, reason: &str, message: &str) {
        {
            let mut e = self.ended_by.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_none() {
                let state = if reason == "SANDBOX_DESTROYED" {
                    ExecutionState::Killed
                } else if reason == "OOM_KILLED" {
                    ExecutionState::OomKilled
                } else {
                    ExecutionState::Failed
                };
                *e = Some((state, reason.to_owned(), message.to_owned()));
            }
        }
        self.cut();
        self.finish(daemon, None, Some((reason, message.to_owned())));
    }

    fn cut(&self) {
        if let Some(w) = self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Stores the final record once.
    fn finish(
        &self,
        daemon: &Arc<Daemon>,
        exit: Option<pb::ExecExit>,
        error: Option<(&str, String)>,
    ) {
        if self.finished.swap(true, Ordering::SeqCst) {
            return;
        }
        self.cut();
        let ended_by = self
            .ended_by
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let record = {
            let mut r = self.record.lock().unwrap_or_else(|e| e.into_inner());
            r.ended_unix_ms = now_ms();
            let stored = self.stored();
            r.stdout_bytes = stored[0];
            r.stderr_bytes = stored[1];
            if let Some(x) = &exit {
                match x.status {
                    Some(pb::exec_exit::Status::ExitCode(c)) => r.exit_code = c,
                    Some(pb::exec_exit::Status::Signal(s)) => {
                        r.exit_code = -1;
                        r.signal = s;
                    }
                    None => r.exit_code = -1,
                }
                r.cpu_user_us = x.cpu_user_us;
                r.cpu_system_us = x.cpu_system_us;
                r.peak_memory_bytes = x.peak_memory_bytes;
                r.stdout_bytes = x.stdout_bytes.max(stored[0]);
                r.stderr_bytes = x.stderr_bytes.max(stored[1]);
                r.output_truncated =
                    x.output_truncated || x.stdout_bytes > stored[0] || x.stderr_bytes > stored[1];
                r.state = if x.timed_out {
                    ExecutionState::TimedOut
                } else if x.oom_killed {
                    ExecutionState::OomKilled
                } else if x.killed {
                    ExecutionState::Killed
                } else {
                    ExecutionState::Exited
                } as i32;
                if x.timed_out {
                    r.error_reason = "EXEC_TIMEOUT".into();
                    r.error_message =
                        format!("the execution ran past its timeout of {} ms", r.timeout_ms);
                } else if x.oom_killed {
                    r.error_reason = "OOM_KILLED".into();
                    r.error_message = "the execution ran out of memory".into();
                }
            } else {
                r.exit_code = -1;
                r.state = ExecutionState::Failed as i32;
                if let Some((reason, message)) = &error {
                    r.error_reason = (*reason).to_owned();
                    r.error_message = message.clone();
                }
            }
            if let Some((state, reason, message)) = ended_by {
                r.state = state as i32;
                r.error_reason = reason;
                r.error_message = message;
                if r.signal == 0 && exit.is_none() {
                    r.signal = libc::SIGKILL;
                }
            }
            r.clone()
        };
        if let Err(e) = daemon.store.put_execution(&record) {
            warn!(execution = %self.id, "storing the record: {e}");
        }
        let outcome = match ExecutionState::try_from(record.state) {
            Ok(ExecutionState::Exited) => "exited",
            Ok(ExecutionState::TimedOut) => "timed_out",
            Ok(ExecutionState::Killed) => "killed",
            Ok(ExecutionState::OomKilled) => "oom_killed",
            _ => "failed",
        };
        daemon.metrics.execution_ended(outcome);
        daemon
            .executions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        info!(execution = %self.id, outcome, exit_code = record.exit_code, "execution ended");
        self.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_api::v1::{Argv, Code};

    #[test]
    fn commands_are_built_and_checked() {
        let mut req = ExecRequest {
            command: Some(exec_request::Command::Code(Code {
                language: String::new(),
                source: "print(42)".into(),
            })),
            ..Default::default()
        };
        assert_eq!(command_of(&req).unwrap(), ["python3", "-c", "print(42)"]);
        req.command = Some(exec_request::Command::Code(Code {
            language: "ruby".into(),
            source: String::new(),
        }));
        assert!(command_of(&req).is_err());
        req.command = Some(exec_request::Command::Argv(Argv { args: vec![] }));
        assert!(command_of(&req).is_err());
        req.command = Some(exec_request::Command::Argv(Argv {
            args: vec!["a\0b".into()],
        }));
        assert!(command_of(&req).is_err());
        req.command = None;
        assert!(command_of(&req).is_err());
    }
}
