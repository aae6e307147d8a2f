//! Where an execution's responses go: its owner, or, while it has none, a bounded window.
//!
//! An execution's Output frames and its ExecExit go to the connection that owns it, with the id
//! of the request that made that connection the owner (its Exec, or a later Attach). When the
//! owner closes, an ordinary execution is killed (by [`crate::exec::ExecTable`]); one started
//! with `keep_on_disconnect` becomes *unowned* instead: its loop goes on reading the process's
//! output, so the process never blocks, and a later connection adopts it with Attach.
//!
//! A kept execution keeps its most recent output in a [`Retained`] window (bounded per
//! execution and for all of them together), whether or not it was sent: a connection that
//! breaks (a vsock transport reset) loses what was in flight, and Attach replays the window
//! from the offsets the host already has. Bytes pushed out of the window that were never
//! written to a connection are counted as dropped.
//!
//! Ordering: every write for an execution (its loop's batches, its exit, an Attach's replay)
//! happens under the execution's *send lock*, so a new owner gets the replay before live
//! output and nothing is interleaved. The *state lock* is never held while writing to a
//! socket: closing a connection takes only the state lock and never waits for a blocked writer.
//! Lock order: send lock, then the execution table, then the state lock.

mod window;

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use airlock_proto::pb::{Attached, ErrorCode, ExecExit, Output, Response, StreamKind, response};

use crate::conn::ConnWriter;
use crate::error::ReqError;

pub use window::OrphanLimits;
use window::{Retained, stream_slot};

/// Something an execution's loop produced for its owner.
#[derive(Debug)]
pub enum Frame {
    /// Output, sent to whichever connection owns the execution when it is sent (with that
    /// owner's request id); also kept in the window of a kept execution.
    Output(Output),
    /// The answer to a request (Stdin) of `conn`; dropped unless `conn` still owns the
    /// execution when it is sent.
    Reply(Arc<ConnWriter>, Response),
}

/// The connection that owns an execution and the request its responses answer.
#[derive(Debug, Clone)]
struct Owner {
    conn: Arc<ConnWriter>,
    request_id: u64,
}

impl Owner {
    fn is(&self, conn: &Arc<ConnWriter>) -> bool {
        Arc::ptr_eq(&self.conn, conn)
    }

    fn response(&self, kind: response::Kind) -> Response {
        Response {
            id: self.request_id,
            kind: Some(kind),
        }
    }
}

#[derive(Debug)]
struct State {
    owner: Option<Owner>,
    /// The output window of a kept execution (`None` for an ordinary one).
    retained: Option<Retained>,
    /// Per stream (stdout, stderr): the offset after the last output produced so far.
    next_offset: [u64; 2],
    /// Set once the execution has ended.
    exit: Option<ExecExit>,
    /// The exit was written to an owner: nothing more to deliver, ever.
    delivered: bool,
}

impl State {
    fn dropped(&self) -> u64 {
        self.retained.as_ref().map_or(0, |r| r.dropped)
    }
}

/// What closing a connection means for one execution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// The connection does not own it.
    NotOwned,
    /// It was owned and must be killed (not kept on disconnect).
    Kill,
    /// It was owned and is unowned now (kept on disconnect).
    Orphaned,
}

/// The delivery side of one execution: see the module documentation.
#[derive(Debug)]
pub struct Delivery {
    exec_id: u64,
    pid: u32,
    keep: bool,
    send: Mutex<()>,
    state: Mutex<State>,
}

impl Delivery {
    /// Owned by `conn`, answering its request `request_id`; `keep`: kept on disconnect, with
    /// an output window within `limits`.
    pub fn new(
        exec_id: u64,
        pid: u32,
        keep: bool,
        conn: Arc<ConnWriter>,
        request_id: u64,
        limits: Arc<OrphanLimits>,
    ) -> Self {
        Self {
            exec_id,
            pid,
            keep,
            send: Mutex::new(()),
            state: Mutex::new(State {
                owner: Some(Owner { conn, request_id }),
                retained: keep.then(|| Retained::new(limits)),
                next_offset: [0; 2],
                exit: None,
                delivered: false,
            }),
        }
    }

    pub fn exec_id(&self) -> u64 {
        self.exec_id
    }

    /// Started with keep_on_disconnect.
    pub fn keep(&self) -> bool {
        self.keep
    }

    pub fn owned_by(&self, conn: &Arc<ConnWriter>) -> bool {
        self.state().owner.as_ref().is_some_and(|o| o.is(conn))
    }

    /// `conn` closed: an execution it owns is killed, or, if kept, becomes unowned.
    pub fn release(&self, conn: &Arc<ConnWriter>) -> Release {
        let mut st = self.state();
        if !st.owner.as_ref().is_some_and(|o| o.is(conn)) {
            return Release::NotOwned;
        }
        if !self.keep {
            return Release::Kill;
        }
        st.owner = None;
        Release::Orphaned
    }

    /// Sends `frames` to the owner with one write (blocking while it does not read); a kept
    /// execution also keeps the output in its window (only there while it has no owner).
    pub fn deliver(&self, frames: Vec<Frame>) {
        if frames.is_empty() {
            return;
        }
        let _sending = self.send_lock();
        let mut st = self.state();
        let owner = st.owner.clone();
        let mut first_seq = None;
        for frame in &frames {
            if let Frame::Output(out) = frame {
                let slot = &mut st.next_offset[stream_slot(out.stream)];
                *slot = (*slot).max(out.offset.saturating_add(out.data.len() as u64));
                if let Some(retained) = &mut st.retained {
                    let seq = retained.push(out.clone(), owner.is_some());
                    first_seq.get_or_insert(seq);
                }
            }
        }
        drop(st);
        let Some(owner) = owner else {
            return;
        };
        let resps: Vec<Response> = frames
            .into_iter()
            .filter_map(|frame| match frame {
                Frame::Output(out) => Some(owner.response(response::Kind::Output(out))),
                Frame::Reply(conn, resp) => owner.is(&conn).then_some(resp),
            })
            .collect();
        if !owner.conn.send_all(&resps) {
            self.lost(&owner, |r| {
                if let Some(seq) = first_seq {
                    r.mark_from(seq, false);
                }
            });
        }
    }

    /// The execution ended with `exit`: `before_send` runs (the caller gives back the
    /// execution's place), then the exit goes to the owner if there is one, then `after_send`
    /// learns whether it was delivered (if not, a kept execution waits for an Attach). All
    /// under the send lock, so an Attach sees either no exit yet or the whole outcome.
    pub fn finish(
        &self,
        mut exit: ExecExit,
        before_send: impl FnOnce(),
        after_send: impl FnOnce(bool),
    ) {
        let _sending = self.send_lock();
        let owner = {
            let mut st = self.state();
            exit.orphan_dropped_bytes = st.dropped();
            st.exit = Some(exit);
            st.owner.clone()
        };
        before_send();
        let delivered = match owner {
            Some(owner) => {
                let resp = owner.response(response::Kind::ExecExit(exit));
                let sent = owner.conn.send_all(std::slice::from_ref(&resp));
                if sent {
                    self.state().delivered = true;
                } else {
                    self.lost(&owner, |_| {});
                }
                sent
            }
            None => false,
        };
        after_send(delivered);
    }

    /// Makes `conn` the owner (Attach request `request_id`) and sends it Attached, the
    /// retained output from `from` (per stream: what the host has already) and, if the
    /// execution has ended, the exit. Returns whether the exit was delivered (the caller then
    /// forgets the execution).
    pub fn attach(
        &self,
        conn: &Arc<ConnWriter>,
        request_id: u64,
        from: [u64; 2],
    ) -> Result<bool, ReqError> {
        if !self.keep {
            return Err(self.not_found("was not started with keep_on_disconnect"));
        }
        // An owner whose peer is gone cannot answer anyone: end its connection now, so that a
        // write blocked on it fails and lets go of the send lock.
        if let Some(dead) = self.check_attachable(conn, from)? {
            dead.shutdown();
        }
        let _sending = self.send_lock();
        // Checked again: the state may have changed while the send lock was busy.
        self.check_attachable(conn, from)?;
        let owner = Owner {
            conn: Arc::clone(conn),
            request_id,
        };
        let mut st = self.state();
        st.owner = Some(owner.clone());
        let mut start = from;
        let mut replay = Vec::new();
        let next_offset = st.next_offset;
        if let Some(retained) = &mut st.retained {
            for (slot, stream) in [(0, StreamKind::Stdout), (1, StreamKind::Stderr)] {
                let window = retained.first_offset(stream).unwrap_or(next_offset[slot]);
                start[slot] = start[slot].max(window);
            }
            replay = retained.replay(start);
            retained.mark_replayed(start, true);
        }
        let attached = Attached {
            exec_id: self.exec_id,
            pid: self.pid,
            stdout_offset: start[0],
            stderr_offset: start[1],
            dropped_bytes: st.dropped(),
            exited: st.exit.is_some(),
        };
        let exit = st.exit;
        drop(st);
        let mut resps = vec![owner.response(response::Kind::Attached(attached))];
        resps.extend(
            replay
                .into_iter()
                .map(|out| owner.response(response::Kind::Output(out))),
        );
        if let Some(exit) = exit {
            resps.push(owner.response(response::Kind::ExecExit(exit)));
        }
        if !conn.send_all(&resps) {
            self.lost(&owner, |r| r.mark_replayed(start, false));
            return Ok(false);
        }
        if exit.is_some() {
            self.state().delivered = true;
        }
        Ok(exit.is_some())
    }

    /// Whether `conn` may adopt the execution now, resuming at `from`; `Some(owner)` if its
    /// owner's peer is gone.
    fn check_attachable(
        &self,
        conn: &Arc<ConnWriter>,
        from: [u64; 2],
    ) -> Result<Option<Arc<ConnWriter>>, ReqError> {
        let st = self.state();
        if st.delivered {
            return Err(self.not_found("has exited and its exit was delivered"));
        }
        if from[0] > st.next_offset[0] || from[1] > st.next_offset[1] {
            return Err(ReqError::invalid(format!(
                "execution {} has produced {} bytes of stdout and {} of stderr so far",
                self.exec_id, st.next_offset[0], st.next_offset[1]
            )));
        }
        match &st.owner {
            None => Ok(None),
            Some(o) if o.is(conn) => Err(ReqError::invalid(format!(
                "execution {} already belongs to this connection",
                self.exec_id
            ))),
            Some(o) if o.conn.is_alive() => {
                Err(self.not_found("belongs to another connection that is still open"))
            }
            Some(o) => Ok(Some(Arc::clone(&o.conn))),
        }
    }

    /// Writing to `owner` failed: its connection is gone. A kept execution becomes unowned,
    /// and `unwritten` marks the retained chunks of that write as never written.
    fn lost(&self, owner: &Owner, unwritten: impl FnOnce(&mut Retained)) {
        if !self.keep {
            return;
        }
        let mut st = self.state();
        if st.owner.as_ref().is_some_and(|o| o.is(&owner.conn)) {
            st.owner = None;
        }
        if let Some(retained) = &mut st.retained {
            unwritten(retained);
        }
    }

    fn not_found(&self, why: &str) -> ReqError {
        ReqError::new(
            ErrorCode::NotFound,
            format!("execution {} {why}", self.exec_id),
        )
    }

    fn send_lock(&self) -> MutexGuard<'_, ()> {
        self.send.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
