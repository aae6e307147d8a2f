//! A running execution as the rest of the agent sees it: how to signal and kill all of its
//! processes, its queue of stdin, and who gets its responses.
//!
//! The process leads its own session and process group and, where cgroups are available, lives
//! in its own cgroup; [`KillTarget`] is whichever of the two reaches all of its processes.
//! Stdin requests are queued here by the connection and written to the pipe by the execution's
//! loop (see [`crate::exec_loop`]), which answers each one once its data is in the pipe.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use airlock_proto::pb::ErrorCode;

use crate::cgroup::ExecCgroup;
use crate::conn::ConnWriter;
use crate::delivery::Delivery;
use crate::error::ReqError;
use crate::reaper::{ExitSlot, Waker};
use crate::sys;

/// Stdin bytes an execution may have queued (accepted, not yet written to its pipe).
pub const MAX_PENDING_STDIN: usize = 8 << 20;

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
