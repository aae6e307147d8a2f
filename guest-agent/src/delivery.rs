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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use airlock_proto::MAX_ORPHAN_BUFFER_TOTAL;
use airlock_proto::pb::{Attached, ErrorCode, ExecExit, Output, Response, StreamKind, response};

use crate::error::ReqError;
use crate::server::ConnWriter;

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

/// How much output kept executions may retain: per execution, and all together.
#[derive(Debug)]
pub struct OrphanLimits {
    per_exec: usize,
    total: usize,
    used: AtomicUsize,
}

impl OrphanLimits {
    /// `per_exec` bytes per execution; [`MAX_ORPHAN_BUFFER_TOTAL`] (at least `per_exec`) for
    /// all together.
    pub fn new(per_exec: usize) -> Self {
        Self::with_total(per_exec, MAX_ORPHAN_BUFFER_TOTAL.max(per_exec))
    }

    fn with_total(per_exec: usize, total: usize) -> Self {
        Self {
            per_exec,
            total,
            used: AtomicUsize::new(0),
        }
    }

    /// Takes up to `want` bytes of the shared budget; returns how many were granted.
    fn reserve(&self, want: usize) -> usize {
        let mut granted = 0;
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                granted = want.min(self.total.saturating_sub(used));
                Some(used + granted)
            });
        granted
    }

    fn release(&self, bytes: usize) {
        let _ = self
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                Some(used.saturating_sub(bytes))
            });
    }

    /// Bytes reserved now by all kept executions.
    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }
}

/// One retained chunk of output.
#[derive(Debug)]
struct Kept {
    out: Output,
    /// Push order, to find the chunks of one send again.
    seq: u64,
    /// Written to a connection (which may still have lost it).
    written: bool,
}

/// The most recent output of a kept execution, both streams in order: as many of the last
/// bytes as the per-execution limit and the shared budget allow.
#[derive(Debug)]
struct Retained {
    chunks: VecDeque<Kept>,
    /// Bytes in `chunks`.
    bytes: usize,
    /// Bytes taken from the shared budget (at least `bytes`), given back on drop.
    reserved: usize,
    next_seq: u64,
    /// Bytes pushed out (or never let in) without having been written to any connection.
    dropped: u64,
    limits: Arc<OrphanLimits>,
}

impl Retained {
    fn new(limits: Arc<OrphanLimits>) -> Self {
        Self {
            chunks: VecDeque::new(),
            bytes: 0,
            reserved: 0,
            next_seq: 0,
            dropped: 0,
            limits,
        }
    }

    /// Keeps `out` (its tail, if all of it cannot be kept), forgetting the oldest output to
    /// make room. Returns the chunk's sequence number.
    fn push(&mut self, mut out: Output, written: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let need = (self.bytes + out.data.len()).min(self.limits.per_exec);
        if need > self.reserved {
            self.reserved += self.limits.reserve(need - self.reserved);
        }
        if out.data.len() > self.reserved {
            let cut = out.data.len() - self.reserved;
            self.count_gone(cut, written);
            trim_front(&mut out, cut);
        }
        while self.bytes + out.data.len() > self.reserved {
            let excess = self.bytes + out.data.len() - self.reserved;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            let (cut, front_written) = (excess.min(front.out.data.len()), front.written);
            if cut == front.out.data.len() {
                self.chunks.pop_front();
            } else {
                trim_front(&mut front.out, cut);
            }
            self.bytes -= cut;
            self.count_gone(cut, front_written);
        }
        if !out.data.is_empty() {
            self.bytes += out.data.len();
            self.chunks.push_back(Kept { out, seq, written });
        }
        seq
    }

    fn count_gone(&mut self, bytes: usize, written: bool) {
        if !written {
            self.dropped += bytes as u64;
        }
    }

    /// Marks the chunks with sequence numbers `from..` as written or not.
    fn mark_from(&mut self, from: u64, written: bool) {
        for k in self.chunks.iter_mut().filter(|k| k.seq >= from) {
            k.written = written;
        }
    }

    /// Marks the chunks that [`replay`](Self::replay) returns for `start` as written or not.
    fn mark_replayed(&mut self, start: [u64; 2], written: bool) {
        for k in &mut self.chunks {
            let end = k.out.offset.saturating_add(k.out.data.len() as u64);
            if end > start[stream_slot(k.out.stream)] {
                k.written = written;
            }
        }
    }

    /// Where the retained output of `stream` begins; `None` if none is retained.
    fn first_offset(&self, stream: StreamKind) -> Option<u64> {
        self.chunks
            .iter()
            .find(|k| k.out.stream == stream as i32)
            .map(|k| k.out.offset)
    }

    /// The retained output at or after `start` (per stream, stdout then stderr), in order.
    fn replay(&self, start: [u64; 2]) -> Vec<Output> {
        let mut outs = Vec::new();
        for k in &self.chunks {
            let from = start[stream_slot(k.out.stream)];
            let end = k.out.offset.saturating_add(k.out.data.len() as u64);
            if end <= from {
                continue;
            }
            let mut out = k.out.clone();
            if out.offset < from {
                let cut = usize::try_from(from - out.offset).unwrap_or(usize::MAX);
                trim_front(&mut out, cut);
            }
            outs.push(out);
        }
        outs
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        self.limits.release(self.reserved);
    }
}

/// Drops the first `n` bytes of `out` (its offset moves with them).
fn trim_front(out: &mut Output, n: usize) {
    let n = n.min(out.data.len());
    out.data.drain(..n);
    out.offset = out.offset.saturating_add(n as u64);
}

/// 0 for stdout, 1 for stderr (anything else counts as stdout: the agent sends nothing else).
fn stream_slot(stream: i32) -> usize {
    match StreamKind::try_from(stream) {
        Ok(StreamKind::Stderr) => 1,
        _ => 0,
    }
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
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use airlock_proto::pb::exec_exit;
    use airlock_proto::read_frame;

    /// A connection writer whose peer is the returned stream.
    fn conn() -> (Arc<ConnWriter>, UnixStream) {
        let (ours, peer) = UnixStream::pair().unwrap();
        let write = File::from(OwnedFd::from(ours.try_clone().unwrap()));
        let control = File::from(OwnedFd::from(ours));
        (Arc::new(ConnWriter::new(write, control)), peer)
    }

    fn output(stream: StreamKind, offset: u64, data: &[u8]) -> Frame {
        Frame::Output(Output {
            exec_id: 7,
            stream: stream as i32,
            offset,
            data: data.to_vec(),
        })
    }

    fn exit() -> ExecExit {
        ExecExit {
            exec_id: 7,
            status: Some(exec_exit::Status::ExitCode(0)),
            ..Default::default()
        }
    }

    fn delivery(keep: bool, conn: &Arc<ConnWriter>, per_exec: usize) -> Delivery {
        let limits = Arc::new(OrphanLimits::new(per_exec));
        Delivery::new(7, 100, keep, Arc::clone(conn), 1, limits)
    }

    /// Every frame the peer can read without blocking.
    fn frames(peer: &mut UnixStream) -> Vec<Response> {
        peer.set_nonblocking(true).unwrap();
        let mut out = Vec::new();
        while let Ok(Some(resp)) = read_frame::<_, Response>(peer) {
            out.push(resp);
        }
        out
    }

    /// (request id, stream, offset, data) of every Output.
    fn outputs(resps: &[Response]) -> Vec<(u64, i32, u64, Vec<u8>)> {
        resps
            .iter()
            .filter_map(|r| match &r.kind {
                Some(response::Kind::Output(o)) => Some((r.id, o.stream, o.offset, o.data.clone())),
                _ => None,
            })
            .collect()
    }

    fn attached(resps: &[Response]) -> Attached {
        match resps.first().and_then(|r| r.kind.clone()) {
            Some(response::Kind::Attached(a)) => a,
            other => panic!("expected Attached first, got {other:?}"),
        }
    }

    fn last_exit(resps: &[Response]) -> Option<ExecExit> {
        match resps.last().and_then(|r| r.kind.clone()) {
            Some(response::Kind::ExecExit(e)) => Some(e),
            _ => None,
        }
    }

    /// Closes `conn` as the server does: shut down, then released.
    fn close(d: &Delivery, conn: &Arc<ConnWriter>) -> Release {
        conn.shutdown();
        d.release(conn)
    }

    const OUT: StreamKind = StreamKind::Stdout;
    const ERR: StreamKind = StreamKind::Stderr;

    #[test]
    fn an_owned_execution_sends_output_and_exit_with_the_owners_request_id() {
        let (a, mut peer) = conn();
        let d = delivery(false, &a, 1 << 20);
        d.deliver(vec![output(OUT, 0, b"hi")]);
        let mut before = false;
        let mut after = None;
        d.finish(exit(), || before = true, |sent| after = Some(sent));
        assert!(before);
        assert_eq!(after, Some(true));
        let got = frames(&mut peer);
        assert_eq!(outputs(&got), [(1, 1, 0, b"hi".to_vec())]);
        assert!(last_exit(&got).is_some());
    }

    #[test]
    fn closing_the_owner_kills_an_ordinary_execution_and_orphans_a_kept_one() {
        let (a, _peer) = conn();
        let (b, _peer_b) = conn();
        assert_eq!(delivery(false, &a, 10).release(&a), Release::Kill);
        let kept = delivery(true, &a, 10);
        assert_eq!(kept.release(&b), Release::NotOwned);
        assert_eq!(kept.release(&a), Release::Orphaned);
        assert!(!kept.owned_by(&a));
    }

    #[test]
    fn attach_replays_output_sent_before_the_close_then_goes_live_with_its_own_id() {
        let (a, _peer_a) = conn();
        let d = delivery(true, &a, 1 << 20);
        // Sent to the first connection, whose host may never have read it.
        d.deliver(vec![output(OUT, 0, b"a\n")]);
        assert_eq!(close(&d, &a), Release::Orphaned);
        d.deliver(vec![output(OUT, 2, b"b\n"), output(ERR, 0, b"e")]);
        let (b, mut peer_b) = conn();
        assert!(!d.attach(&b, 9, [0, 0]).unwrap());
        d.deliver(vec![output(OUT, 4, b"c\n")]);
        let got = frames(&mut peer_b);
        let att = attached(&got);
        assert_eq!((att.exec_id, att.pid, att.exited), (7, 100, false));
        assert_eq!(
            (att.stdout_offset, att.stderr_offset, att.dropped_bytes),
            (0, 0, 0)
        );
        assert_eq!(
            outputs(&got),
            [
                (9, 1, 0, b"a\n".to_vec()),
                (9, 1, 2, b"b\n".to_vec()),
                (9, 2, 0, b"e".to_vec()),
                (9, 1, 4, b"c\n".to_vec())
            ]
        );
        assert!(d.owned_by(&b));
    }

    #[test]
    fn attach_replays_only_from_the_offsets_the_host_has() {
        let (a, _peer_a) = conn();
        let d = delivery(true, &a, 1 << 20);
        d.deliver(vec![output(OUT, 0, b"abcd"), output(ERR, 0, b"xy")]);
        close(&d, &a);
        let (b, mut peer_b) = conn();
        d.attach(&b, 2, [3, 2]).unwrap();
        let got = frames(&mut peer_b);
        let att = attached(&got);
        assert_eq!((att.stdout_offset, att.stderr_offset), (3, 2));
        assert_eq!(outputs(&got), [(2, 1, 3, b"d".to_vec())]);
        // Past what was produced: refused.
        let (c, _peer_c) = conn();
        close(&d, &b);
        let err = d.attach(&c, 1, [5, 0]).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn attach_after_the_exit_delivers_output_and_exit_at_once_and_only_once() {
        let (a, _peer_a) = conn();
        let d = delivery(true, &a, 1 << 20);
        close(&d, &a);
        d.deliver(vec![output(OUT, 0, b"x")]);
        let mut delivered = None;
        d.finish(exit(), || {}, |sent| delivered = Some(sent));
        assert_eq!(delivered, Some(false));
        let (b, mut peer_b) = conn();
        assert!(d.attach(&b, 3, [0, 0]).unwrap());
        let got = frames(&mut peer_b);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(attached(&got).exited);
        assert_eq!(outputs(&got), [(3, 1, 0, b"x".to_vec())]);
        assert!(last_exit(&got).is_some());
        let (c, _peer_c) = conn();
        close(&d, &b);
        assert_eq!(
            d.attach(&c, 1, [0, 0]).unwrap_err().code,
            ErrorCode::NotFound
        );
    }

    #[test]
    fn the_window_keeps_the_latest_bytes_and_counts_unsent_ones_pushed_out() {
        let (a, _peer_a) = conn();
        let d = delivery(true, &a, 5);
        // Sent while owned: pushed out later, but not dropped (a connection had them).
        d.deliver(vec![output(OUT, 0, b"123")]);
        close(&d, &a);
        d.deliver(vec![output(OUT, 3, b"abc"), output(OUT, 6, b"defg")]);
        d.deliver(vec![output(ERR, 0, b"zz")]);
        d.finish(exit(), || {}, |_| {});
        let (b, mut peer_b) = conn();
        d.attach(&b, 2, [0, 0]).unwrap();
        let got = frames(&mut peer_b);
        let att = attached(&got);
        // Retained: "efg" of stdout and "zz" of stderr; "abcd" was never sent anywhere.
        assert_eq!(att.dropped_bytes, 4);
        assert_eq!((att.stdout_offset, att.stderr_offset), (7, 0));
        assert_eq!(
            outputs(&got),
            [(2, 1, 7, b"efg".to_vec()), (2, 2, 0, b"zz".to_vec())]
        );
        assert_eq!(last_exit(&got).map(|e| e.orphan_dropped_bytes), Some(4));
    }

    #[test]
    fn a_chunk_larger_than_the_window_keeps_its_tail() {
        let (a, _peer_a) = conn();
        let d = delivery(true, &a, 4);
        close(&d, &a);
        d.deliver(vec![output(OUT, 0, b"0123456789")]);
        let (b, mut peer_b) = conn();
        d.attach(&b, 1, [0, 0]).unwrap();
        let got = frames(&mut peer_b);
        assert_eq!(attached(&got).dropped_bytes, 6);
        assert_eq!(outputs(&got), [(1, 1, 6, b"6789".to_vec())]);
    }

    #[test]
    fn the_shared_budget_bounds_all_windows_together_and_is_given_back() {
        let limits = Arc::new(OrphanLimits::with_total(8, 10));
        let (a, _peer) = conn();
        a.shutdown();
        let one = Delivery::new(1, 1, true, Arc::clone(&a), 1, Arc::clone(&limits));
        let two = Delivery::new(2, 2, true, Arc::clone(&a), 2, Arc::clone(&limits));
        one.release(&a);
        two.release(&a);
        one.deliver(vec![output(OUT, 0, &[1; 8])]);
        two.deliver(vec![output(OUT, 0, &[2; 8])]);
        assert_eq!(limits.used(), 10);
        // The second window has 2 bytes: the rest of its output was dropped.
        let (b, mut peer_b) = conn();
        two.attach(&b, 5, [0, 0]).unwrap();
        assert_eq!(attached(&frames(&mut peer_b)).dropped_bytes, 6);
        drop(one);
        assert_eq!(limits.used(), 2);
        drop(two);
        assert_eq!(limits.used(), 0);
    }

    #[test]
    fn an_ordinary_execution_keeps_nothing() {
        let limits = Arc::new(OrphanLimits::new(1 << 20));
        let (a, _peer) = conn();
        let d = Delivery::new(1, 1, false, Arc::clone(&a), 1, Arc::clone(&limits));
        d.deliver(vec![output(OUT, 0, b"not kept")]);
        assert_eq!(limits.used(), 0);
    }

    #[test]
    fn attach_refuses_ordinary_live_owned_and_own_executions() {
        let (a, _peer_a) = conn();
        let (b, _peer_b) = conn();
        let plain = delivery(false, &a, 10);
        assert_eq!(
            plain.attach(&b, 1, [0, 0]).unwrap_err().code,
            ErrorCode::NotFound
        );
        let kept = delivery(true, &a, 10);
        assert_eq!(
            kept.attach(&b, 1, [0, 0]).unwrap_err().code,
            ErrorCode::NotFound
        );
        assert_eq!(
            kept.attach(&a, 1, [0, 0]).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn attach_takes_over_from_an_owner_whose_peer_is_gone() {
        let (a, peer_a) = conn();
        let d = delivery(true, &a, 10);
        drop(peer_a);
        let (b, _peer_b) = conn();
        assert!(!d.attach(&b, 4, [0, 0]).unwrap());
        assert!(d.owned_by(&b));
        // The dead connection was shut down, so its reader ends too.
        assert!(!a.is_alive());
    }

    #[test]
    fn a_failed_write_orphans_a_kept_execution_and_counts_its_output_unsent() {
        let (a, peer_a) = conn();
        let d = delivery(true, &a, 1 << 20);
        drop(peer_a);
        d.deliver(vec![output(OUT, 0, b"lost?")]);
        assert!(!d.owned_by(&a));
        let (b, mut peer_b) = conn();
        d.attach(&b, 6, [0, 0]).unwrap();
        assert_eq!(
            outputs(&frames(&mut peer_b)),
            [(6, 1, 0, b"lost?".to_vec())]
        );
    }

    #[test]
    fn replies_go_only_to_the_connection_that_asked() {
        let (a, mut peer_a) = conn();
        let (b, _peer_b) = conn();
        let d = delivery(true, &a, 10);
        let reply = |id| Response {
            id,
            kind: Some(response::Kind::Ok(airlock_proto::pb::Ok {})),
        };
        d.deliver(vec![
            Frame::Reply(Arc::clone(&a), reply(11)),
            Frame::Reply(Arc::clone(&b), reply(12)),
        ]);
        let ids: Vec<_> = frames(&mut peer_a).iter().map(|r| r.id).collect();
        assert_eq!(ids, [11]);
    }
}
