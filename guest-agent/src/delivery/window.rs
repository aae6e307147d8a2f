//! The output window of a kept execution: its most recent output, sent or not, bounded per
//! execution and, through [`OrphanLimits`], for all kept executions together.
//!
//! A window grows from the shared budget as output arrives and gives its bytes back when it is
//! dropped. Output pushed out of the window (or never let in) that was never written to a
//! connection is counted as dropped.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use airlock_proto::MAX_ORPHAN_BUFFER_TOTAL;
use airlock_proto::pb::{Output, StreamKind};

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

    pub(super) fn with_total(per_exec: usize, total: usize) -> Self {
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
    pub(super) fn used(&self) -> usize {
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
pub(super) struct Retained {
    chunks: VecDeque<Kept>,
    /// Bytes in `chunks`.
    bytes: usize,
    /// Bytes taken from the shared budget (at least `bytes`), given back on drop.
    reserved: usize,
    next_seq: u64,
    /// Bytes pushed out (or never let in) without having been written to any connection.
    pub(super) dropped: u64,
    limits: Arc<OrphanLimits>,
}

impl Retained {
    pub(super) fn new(limits: Arc<OrphanLimits>) -> Self {
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
    pub(super) fn push(&mut self, mut out: Output, written: bool) -> u64 {
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
    pub(super) fn mark_from(&mut self, from: u64, written: bool) {
        for k in self.chunks.iter_mut().filter(|k| k.seq >= from) {
            k.written = written;
        }
    }

    /// Marks the chunks that [`replay`](Self::replay) returns for `start` as written or not.
    pub(super) fn mark_replayed(&mut self, start: [u64; 2], written: bool) {
        for k in &mut self.chunks {
            let end = k.out.offset.saturating_add(k.out.data.len() as u64);
            if end > start[stream_slot(k.out.stream)] {
                k.written = written;
            }
        }
    }

    /// Where the retained output of `stream` begins; `None` if none is retained.
    pub(super) fn first_offset(&self, stream: StreamKind) -> Option<u64> {
        self.chunks
            .iter()
            .find(|k| k.out.stream == stream as i32)
            .map(|k| k.out.offset)
    }

    /// The retained output at or after `start` (per stream, stdout then stderr), in order.
    pub(super) fn replay(&self, start: [u64; 2]) -> Vec<Output> {
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
pub(super) fn stream_slot(stream: i32) -> usize {
    match StreamKind::try_from(stream) {
        Ok(StreamKind::Stderr) => 1,
        _ => 0,
    }
}
