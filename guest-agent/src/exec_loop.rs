//! The life of one execution, on its own thread: spawn ([`launch`], with [`crate::spawn`]), then
//! one `poll` loop over the process's stdout and stderr pipes, its stdin pipe, and a waker (exit
//! delivered by the reaper, stdin queued by the connection), until the process has exited and
//! its output is drained ([`Run::pump`]); then the exit record ([`Run::finish`]). The thread
//! itself, and the execution's place in the table, are [`crate::exec`]'s.
//!
//! Output is read in large pieces (the pipes are enlarged) and sent as ≤64 KiB Output frames,
//! all frames of one wake-up in one write, to whichever connection owns the execution (see
//! [`crate::delivery`]). Sending blocks while the host is slow to read, and then the loop stops
//! reading the pipes: backpressure reaches the process, memory stays bounded. While an
//! execution kept on disconnect has no owner, its output goes into a bounded buffer instead
//! (and past it is dropped), so the process keeps running.
//!
//! When the main process exits, whatever it left running is killed (its cgroup or process
//! group), so an execution never outlives its main process; the pipes are then drained until
//! they close, or for [`DRAIN_GRACE`] at most (a process that escaped the process group, where
//! there are no cgroups, may hold them open).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_proto::MAX_OUTPUT_CHUNK;
use airlock_proto::pb::{
    self, ErrorCode, ExecExit, Output, Response, StreamKind, exec_exit, response,
};

use crate::cgroup::CgroupStats;
use crate::conn::ConnWriter;
use crate::delivery::{Delivery, Frame, OrphanLimits};
use crate::error::ReqError;
use crate::exec_spec::ExecSpec;
use crate::execution::{Execution, KillTarget, StdinChunk, StdinQueue};
use crate::spawn::{self, PIPE_BYTES, Spawned, Spawner};
use crate::sys::{self, Reaped};

/// How long output is drained after the main process exited.
pub const DRAIN_GRACE: Duration = Duration::from_secs(2);

fn reply(id: u64, kind: response::Kind) -> Response {
    Response {
        id,
        kind: Some(kind),
    }
}

/// One output stream of the process.
#[derive(Debug)]
struct OutStream {
    kind: StreamKind,
    pipe: Option<File>,
    /// Bytes the process wrote (kept or not).
    total: u64,
    cap: u64,
}

/// One execution's loop: its state from spawn to exit (see [`launch`]).
#[derive(Debug)]
pub struct Run {
    exec: Arc<Execution>,
    out: [OutStream; 2],
    stdin: Option<File>,
    /// The stdin chunk being written and how much of it is written.
    current: Option<(StdinChunk, usize)>,
    started: Instant,
    deadline: Option<Instant>,
    exited: Option<(Reaped, Instant)>,
    drain_until: Option<Instant>,
    truncated: bool,
    buf: Vec<u8>,
}

/// Starts execution `exec_id` of `spec` for request `request_id` of `conn`: spawns the process
/// (see [`Spawner::spawn`]) and builds the loop's state. A kept execution's output window is
/// bounded by `limits`.
pub fn launch(
    spawner: &Spawner,
    limits: &Arc<OrphanLimits>,
    conn: &Arc<ConnWriter>,
    exec_id: u64,
    request_id: u64,
    spec: &ExecSpec,
) -> Result<Run, ReqError> {
    let Spawned {
        pid,
        cgroup,
        waker,
        exit,
        started,
        pipes: (stdin, stdout, stderr),
    } = spawner.spawn(exec_id, spec)?;
    let delivery = Delivery::new(
        exec_id,
        pid,
        spec.keep_on_disconnect,
        Arc::clone(conn),
        request_id,
        Arc::clone(limits),
    );
    let pid = i32::try_from(pid).unwrap_or(i32::MAX);
    let exec = Arc::new(Execution {
        exec_id,
        delivery: Arc::new(delivery),
        pid,
        target: cgroup.map_or(KillTarget::Group(pid), KillTarget::Cgroup),
        waker,
        exit,
        stdin: Mutex::new(initial_stdin(spec)),
        killed: AtomicBool::new(false),
        timed_out: AtomicBool::new(false),
    });
    let stream = |kind, pipe| OutStream {
        kind,
        pipe,
        total: 0,
        cap: spec.max_output_bytes,
    };
    Ok(Run {
        exec,
        out: [
            stream(StreamKind::Stdout, stdout),
            stream(StreamKind::Stderr, stderr),
        ],
        stdin,
        current: None,
        started,
        // A timeout too large to represent is no timeout.
        deadline: spec.timeout.and_then(|t| started.checked_add(t)),
        exited: None,
        drain_until: None,
        truncated: false,
        buf: vec![0u8; PIPE_BYTES],
    })
}

/// The stdin queue at start: Exec.stdin as the first chunk, closing stdin after it unless
/// stdin_open.
fn initial_stdin(spec: &ExecSpec) -> StdinQueue {
    let mut queue = StdinQueue {
        accepting: spec.stdin_open,
        ..StdinQueue::default()
    };
    if spawn::wants_stdin(spec) && (!spec.stdin.is_empty() || !spec.stdin_open) {
        queue.pending_bytes = spec.stdin.len();
        queue.chunks.push_back(StdinChunk {
            reply_to: None,
            data: spec.stdin.clone(),
            eof: !spec.stdin_open,
        });
    }
    queue
}

/// What a pollfd in the loop's set stands for.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Waker,
    Out(usize),
    Stdin,
}

impl Run {
    /// The execution, as the table and its connection see it.
    pub fn exec(&self) -> &Arc<Execution> {
        &self.exec
    }

    /// The loop: until the process exited and its output is drained.
    pub fn pump(&mut self) {
        // Exec.stdin (if any) is queued already.
        self.exec.waker.wake();
        loop {
            let now = Instant::now();
            self.check_deadline(now);
            if self.done(now) {
                return;
            }
            let mut batch = Vec::new();
            self.poll_once(now, &mut batch);
            self.exec.delivery.deliver(batch);
        }
    }

    fn check_deadline(&mut self, now: Instant) {
        if self.deadline.is_some_and(|d| now >= d) && self.exited.is_none() {
            self.deadline = None;
            self.exec.timed_out.store(true, Ordering::SeqCst);
            self.exec.kill_all();
        }
    }

    fn done(&self, now: Instant) -> bool {
        let drained = self.out.iter().all(|s| s.pipe.is_none());
        self.exited.is_some() && (drained || self.drain_until.is_some_and(|d| now >= d))
    }

    fn poll_once(&mut self, now: Instant, batch: &mut Vec<Frame>) {
        let mut fds = vec![pollfd(self.exec.waker.as_raw_fd(), libc::POLLIN)];
        let mut slots = vec![Slot::Waker];
        for (i, s) in self.out.iter().enumerate() {
            if let Some(p) = &s.pipe {
                fds.push(pollfd(p.as_raw_fd(), libc::POLLIN));
                slots.push(Slot::Out(i));
            }
        }
        if let (Some(p), Some(_)) = (&self.stdin, &self.current) {
            fds.push(pollfd(p.as_raw_fd(), libc::POLLOUT));
            slots.push(Slot::Stdin);
        }
        let wake_at = [self.deadline, self.drain_until]
            .into_iter()
            .flatten()
            .min();
        if let Err(e) = sys::poll(&mut fds, wake_at.map(|t| t.saturating_duration_since(now))) {
            // Cannot happen with valid descriptors; do not spin on it.
            eprintln!("airlock-agent: exec {}: poll: {e}", self.exec.exec_id);
            std::thread::sleep(Duration::from_millis(10));
            return;
        }
        for (fd, slot) in fds.iter().zip(slots) {
            if fd.revents == 0 {
                continue;
            }
            match slot {
                Slot::Waker => self.on_wake(batch),
                Slot::Out(i) => self.read_output(i, batch),
                Slot::Stdin => self.write_stdin(batch),
            }
        }
    }

    /// The reaper delivered the exit, or the connection queued stdin.
    fn on_wake(&mut self, batch: &mut Vec<Frame>) {
        self.exec.waker.drain();
        if self.exited.is_none()
            && let Some(exit) = self.exec.exit.take()
        {
            self.exited = Some(exit);
            self.drain_until = Some(Instant::now() + DRAIN_GRACE);
            // Whatever the main process left behind ends with it.
            self.exec.kill_all();
            self.close_stdin("the process exited", batch);
            return;
        }
        self.write_stdin(batch);
    }

    fn read_output(&mut self, i: usize, batch: &mut Vec<Frame>) {
        let Some(stream) = self.out.get_mut(i) else {
            return;
        };
        let Some(pipe) = &mut stream.pipe else {
            return;
        };
        match pipe.read(&mut self.buf) {
            Ok(0) => stream.pipe = None,
            Ok(n) => {
                let data = self.buf.get(..n).unwrap_or_default();
                if emit(stream, self.exec.exec_id, data, batch) {
                    self.truncated = true;
                }
            }
            Err(e) if is_transient(&e) => {}
            Err(_) => stream.pipe = None,
        }
    }

    /// Writes queued stdin until the pipe is full or the queue empty.
    fn write_stdin(&mut self, batch: &mut Vec<Frame>) {
        loop {
            if self.current.is_none() {
                let next = self.exec.stdin_queue().chunks.pop_front();
                match next {
                    Some(chunk) => self.current = Some((chunk, 0)),
                    None => return,
                }
            }
            let Some((chunk, written)) = &mut self.current else {
                return;
            };
            let Some(pipe) = &mut self.stdin else {
                self.close_stdin("stdin is closed", batch);
                return;
            };
            if let Some(rest) = chunk.data.get(*written..).filter(|r| !r.is_empty()) {
                match pipe.write(rest) {
                    Ok(n) => *written += n,
                    Err(e) if is_transient(&e) => return,
                    Err(e) => {
                        let why = if e.raw_os_error() == Some(libc::EPIPE) {
                            "the process closed its stdin".to_owned()
                        } else {
                            format!("writing stdin: {e}")
                        };
                        self.close_stdin(&why, batch);
                        return;
                    }
                }
                continue;
            }
            self.complete_chunk(batch);
        }
    }

    /// The current chunk is fully written: answer its request, close stdin after an eof.
    fn complete_chunk(&mut self, batch: &mut Vec<Frame>) {
        let Some((chunk, _)) = self.current.take() else {
            return;
        };
        {
            let mut q = self.exec.stdin_queue();
            q.pending_bytes = q.pending_bytes.saturating_sub(chunk.data.len());
        }
        if chunk.eof {
            self.stdin = None;
        }
        if let Some((conn, id)) = chunk.reply_to {
            batch.push(Frame::Reply(conn, reply(id, response::Kind::Ok(pb::Ok {}))));
        }
    }

    /// Closes stdin for good: queued chunks fail with `why`, later Stdin requests are refused.
    fn close_stdin(&mut self, why: &str, batch: &mut Vec<Frame>) {
        self.stdin = None;
        let mut failed: Vec<StdinChunk> = self.current.take().map(|(c, _)| c).into_iter().collect();
        {
            let mut q = self.exec.stdin_queue();
            q.accepting = false;
            q.pending_bytes = 0;
            failed.extend(q.chunks.drain(..));
        }
        for (conn, id) in failed.into_iter().filter_map(|c| c.reply_to) {
            let err = ReqError::new(ErrorCode::Io, why).response(id);
            batch.push(Frame::Reply(conn, err));
        }
    }

    /// Ends the execution: kills what is left, collects accounting, removes the cgroup.
    pub fn finish(self) -> ExecExit {
        let (reaped, exited_at) = self.exited.unwrap_or_else(|| {
            (
                Reaped {
                    pid: self.exec.pid,
                    status: 0,
                    rusage: sys::Rusage::default(),
                },
                Instant::now(),
            )
        });
        let cgroup_stats = match &self.exec.target {
            KillTarget::Cgroup(cg) => {
                let (stats, removed) = cg.kill_and_remove();
                if let Err(e) = removed {
                    eprintln!("airlock-agent: removing {}: {e}", cg.path().display());
                }
                Some(stats)
            }
            KillTarget::Group(_) => {
                self.exec.kill_all();
                None
            }
        };
        exit_record(&self, &reaped, exited_at, cgroup_stats)
    }
}

fn exit_record(
    run: &Run,
    reaped: &Reaped,
    exited_at: Instant,
    cgroup: Option<CgroupStats>,
) -> ExecExit {
    let status = if libc::WIFSIGNALED(reaped.status) {
        exec_exit::Status::Signal(libc::WTERMSIG(reaped.status))
    } else {
        exec_exit::Status::ExitCode(libc::WEXITSTATUS(reaped.status))
    };
    let ru = reaped.rusage;
    let (user, system, peak, oom) = match cgroup {
        Some(c) => (
            c.user_us,
            c.system_us,
            c.peak_memory_bytes.unwrap_or(ru.max_rss_bytes),
            c.oom_kills > 0,
        ),
        None => (ru.user_us, ru.system_us, ru.max_rss_bytes, false),
    };
    let wall = exited_at.saturating_duration_since(run.started);
    ExecExit {
        exec_id: run.exec.exec_id,
        status: Some(status),
        timed_out: run.exec.timed_out.load(Ordering::SeqCst),
        killed: run.exec.killed.load(Ordering::SeqCst),
        oom_killed: oom,
        cpu_user_us: user,
        cpu_system_us: system,
        peak_memory_bytes: peak,
        wall_us: u64::try_from(wall.as_micros()).unwrap_or(u64::MAX),
        stdout_bytes: run.out[0].total,
        stderr_bytes: run.out[1].total,
        output_truncated: run.truncated,
        // Known to the delivery, which fills it in.
        orphan_dropped_bytes: 0,
    }
}

/// Queues `data` from `stream` as Output frames, up to the stream's cap. Returns whether
/// anything was cut off.
fn emit(stream: &mut OutStream, exec_id: u64, data: &[u8], batch: &mut Vec<Frame>) -> bool {
    let offset = stream.total;
    stream.total += data.len() as u64;
    let room = usize::try_from(stream.cap.saturating_sub(offset)).unwrap_or(usize::MAX);
    let kept = data.get(..room.min(data.len())).unwrap_or_default();
    let mut chunk_offset = offset;
    for chunk in kept.chunks(MAX_OUTPUT_CHUNK) {
        let out = Output {
            exec_id,
            stream: stream.kind as i32,
            offset: chunk_offset,
            data: chunk.to_vec(),
        };
        batch.push(Frame::Output(out));
        chunk_offset += chunk.len() as u64;
    }
    kept.len() < data.len()
}

fn pollfd(fd: i32, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(cap: u64) -> OutStream {
        OutStream {
            kind: StreamKind::Stderr,
            pipe: None,
            total: 0,
            cap,
        }
    }

    fn outputs(batch: &[Frame]) -> Vec<(u64, usize)> {
        batch
            .iter()
            .map(|f| match f {
                Frame::Output(o) => (o.offset, o.data.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn emit_splits_into_64_kib_chunks_with_offsets() {
        let mut s = stream(u64::MAX);
        let mut batch = Vec::new();
        let data = vec![1u8; 2 * MAX_OUTPUT_CHUNK + 5];
        assert!(!emit(&mut s, 3, &data, &mut batch));
        let k = MAX_OUTPUT_CHUNK;
        assert_eq!(outputs(&batch), [(0, k), (k as u64, k), (2 * k as u64, 5)]);
        assert!(
            batch
                .iter()
                .all(|f| matches!(f, Frame::Output(o) if o.exec_id == 3))
        );
        assert_eq!(s.total, data.len() as u64);
    }

    #[test]
    fn emit_continues_offsets_across_calls() {
        let mut s = stream(u64::MAX);
        let mut batch = Vec::new();
        emit(&mut s, 1, b"abc", &mut batch);
        emit(&mut s, 1, b"de", &mut batch);
        assert_eq!(outputs(&batch), [(0, 3), (3, 2)]);
    }

    #[test]
    fn emit_cuts_at_the_cap_and_keeps_counting() {
        let mut s = stream(4);
        let mut batch = Vec::new();
        assert!(emit(&mut s, 1, b"abcdef", &mut batch));
        assert!(emit(&mut s, 1, b"gh", &mut batch));
        assert_eq!(outputs(&batch), [(0, 4)]);
        assert_eq!(s.total, 8);
    }

    #[test]
    fn emit_of_nothing_past_the_cap_sends_nothing() {
        let mut s = stream(0);
        let mut batch = Vec::new();
        assert!(emit(&mut s, 1, b"x", &mut batch));
        assert!(batch.is_empty());
    }
}
