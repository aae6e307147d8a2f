//! A running execution: its record, the output stored so far, its request on the sandbox's
//! shared agent connection (to cut it off, and to signal through it), and its end, stored once, whoever ends it (the
//! guest's exit, the daemon's timeout, a kill, its sandbox's end, a lost connection).

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_api::v1::Execution;
use airlock_proto::Mux;
use airlock_proto::pb::{self, StreamKind};
use tokio::sync::watch;
use tracing::{info, warn};

use super::record::final_record;
use crate::ids;
use crate::metrics::Metrics;
use crate::reason::{ExecEnd, Outcome};
use crate::secrets::redact::{Patterns, StreamRedactor};
use crate::store::Store;

/// How long the guest gets to report a killed execution's exit before the daemon cuts it off.
pub const KILL_GRACE: Duration = Duration::from_secs(3);

/// What every execution shares: the records, the metrics, and the running ones.
#[derive(Debug)]
pub struct Ledger {
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub live: Mutex<HashMap<String, Arc<ExecRt>>>,
}

impl Ledger {
    pub fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<ExecRt>>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The connection side of a running execution.
#[derive(Debug, Default)]
struct Conn {
    /// The sandbox's agent connection and the id of this execution's request on it (set as
    /// soon as the request is sent): cancelling the request cuts the execution's thread off.
    request: Option<(Mux, u64)>,
    /// The agent's id of the execution, once it has started.
    agent_id: Option<u64>,
    /// A signal asked for before the agent had started the process (sent once it has).
    pending_signal: Option<i32>,
}

/// Output files and what was stored of each stream.
#[derive(Debug)]
pub struct OutputSink {
    files: [std::fs::File; 2],
    pub truncated: bool,
}

/// An execution's redaction: one redactor per stream, and the bytes of each stream the guest
/// sent (redaction changes lengths: the stored bytes no longer count the guest's offsets).
#[derive(Debug)]
struct Redaction {
    streams: [StreamRedactor; 2],
    consumed: [u64; 2],
    patterns: Arc<Patterns>,
}

/// A running execution.
#[derive(Debug)]
pub struct ExecRt {
    pub id: String,
    pub sandbox_id: String,
    pub tenant: String,
    record: Mutex<Execution>,
    /// Bytes stored per stream (stdout, stderr).
    stored: Mutex<[u64; 2]>,
    /// Bumped when output is stored and when the execution ends.
    pub changed: watch::Sender<u64>,
    conn: Mutex<Conn>,
    finished: AtomicBool,
    /// Why the daemon ended it, overriding what the guest says.
    ended_by: Mutex<Option<ExecEnd>>,
    paths: [PathBuf; 2],
    max_output: u64,
    ledger: Arc<Ledger>,
    /// With secrets: their redaction (output is stored redacted, so every stream and replay
    /// shows it redacted).
    redaction: Option<Mutex<Redaction>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ExecRt {
    /// A running execution with `record`, its output in `paths` (each holding `stored` bytes).
    pub fn new(
        record: Execution,
        paths: [PathBuf; 2],
        stored: [u64; 2],
        max_output: u64,
        ledger: Arc<Ledger>,
        patterns: Option<Arc<Patterns>>,
    ) -> Self {
        let redaction = patterns.map(|p| {
            Mutex::new(Redaction {
                streams: [
                    StreamRedactor::new(p.clone()),
                    StreamRedactor::new(p.clone()),
                ],
                consumed: stored,
                patterns: p,
            })
        });
        Self {
            id: record.id.clone(),
            sandbox_id: record.sandbox_id.clone(),
            tenant: record.tenant.clone(),
            record: Mutex::new(record),
            stored: Mutex::new(stored),
            changed: watch::Sender::new(0),
            conn: Mutex::new(Conn::default()),
            finished: AtomicBool::new(false),
            ended_by: Mutex::new(None),
            paths,
            max_output,
            ledger,
            redaction,
        }
    }

    /// `text` with the execution's secret values redacted.
    pub fn redact(&self, text: &str) -> String {
        match &self.redaction {
            Some(r) => lock(r).patterns.redact_str(text).into_owned(),
            None => text.to_owned(),
        }
    }

    pub fn record(&self) -> Execution {
        lock(&self.record).clone()
    }

    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    /// Bytes stored per stream so far.
    pub fn stored(&self) -> [u64; 2] {
        *lock(&self.stored)
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Waits up to `timeout` for the end; whether it came.
    pub async fn wait_finished(&self, timeout: Duration) -> bool {
        let mut rx = self.changed.subscribe();
        let done = rx.wait_for(|_| self.is_finished());
        tokio::time::timeout(timeout, done).await.is_ok()
    }

    /// The execution's request went out as `request` on `mux`.
    pub fn sent(&self, mux: &Mux, request: u64) {
        lock(&self.conn).request = Some((mux.clone(), request));
        if self.is_finished() {
            self.cut();
        }
    }

    /// The agent started the process as `agent_id` (its main process `pid` in the guest);
    /// signals go to it now (one asked for earlier is sent, and so is the kill of a daemon's
    /// end that came first).
    pub fn started(&self, agent_id: u64, pid: u32) {
        if let Err(e) = self.ledger.store.set_execution_agent(&self.id, agent_id) {
            warn!(execution = %self.id, "recording the agent's id: {e}");
        }
        lock(&self.record).pid = pid;
        let pending = {
            let mut c = lock(&self.conn);
            c.agent_id = Some(agent_id);
            c.pending_signal.take()
        };
        if let Some(sig) = pending {
            let _ = self.signal(sig);
        }
        if lock(&self.ended_by).is_some() {
            let _ = self.signal(libc::SIGKILL);
        }
        self.bump();
    }

    /// Whether the agent has started the process (and its id is recorded).
    pub fn is_started(&self) -> bool {
        lock(&self.conn).agent_id.is_some()
    }

    /// Waits up to `timeout` until the process has started or the execution has ended.
    pub async fn settle(&self, timeout: Duration) {
        let mut rx = self.changed.subscribe();
        let settled = rx.wait_for(|_| self.is_started() || self.is_finished());
        let _ = tokio::time::timeout(timeout, settled).await;
    }

    /// Sends `signal` to the execution's process tree; before the agent has started the
    /// process, the signal is sent as soon as it has.
    pub fn signal(&self, signal: i32) -> Result<(), airlock_proto::ClientError> {
        let mut c = lock(&self.conn);
        match (c.agent_id, c.request.as_ref()) {
            (Some(exec_id), Some((mux, _))) => {
                let kind = pb::request::Kind::Signal(pb::Signal { exec_id, signal });
                // Its answer is not waited for: the outcome shows in the execution's exit.
                mux.send_detached(kind).map(|_| ())
            }
            _ => {
                c.pending_signal = Some(signal);
                Ok(())
            }
        }
    }

    /// The connection and the agent's id of the execution, once it has started: where more
    /// stdin goes (only the connection that started or attached it may send it).
    pub fn agent_handle(&self) -> Option<(Mux, u64)> {
        let c = lock(&self.conn);
        match (c.agent_id, c.request.as_ref()) {
            (Some(exec_id), Some((mux, _))) => Some((mux.clone(), exec_id)),
            _ => None,
        }
    }

    /// Opens the output files for appending.
    pub fn open_output(&self) -> std::io::Result<OutputSink> {
        let open = |p: &PathBuf| std::fs::OpenOptions::new().append(true).open(p);
        Ok(OutputSink {
            files: [open(&self.paths[0])?, open(&self.paths[1])?],
            truncated: false,
        })
    }

    /// Stores an output chunk that starts at `offset` of its stream: what this host has
    /// already (a replay after a restart) is skipped, secret values are redacted, what is over
    /// the cap is dropped.
    pub fn store_output(
        &self,
        sink: &mut OutputSink,
        stream: StreamKind,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        let slot = usize::from(stream == StreamKind::Stderr);
        let redacted;
        let data = match &self.redaction {
            None => self.unseen(sink, slot, offset, data, None),
            Some(r) => {
                let mut r = lock(r);
                let fresh = self.unseen(sink, slot, offset, data, Some(&mut r.consumed[slot]));
                redacted = r.streams[slot].push(fresh);
                &redacted[..]
            }
        };
        self.append(sink, slot, data)
    }

    /// The part of a chunk at `offset` not stored yet (`consumed`: the guest's bytes taken so
    /// far when they differ from the stored ones).
    fn unseen<'d>(
        &self,
        sink: &mut OutputSink,
        slot: usize,
        offset: u64,
        data: &'d [u8],
        consumed: Option<&mut u64>,
    ) -> &'d [u8] {
        let stored = lock(&self.stored)[slot];
        let had = consumed.as_deref().copied().unwrap_or(stored);
        let skip = had.saturating_sub(offset).min(data.len() as u64) as usize;
        if offset > had {
            // The agent no longer had what came between (see `Attached`).
            sink.truncated = true;
        }
        let fresh = data.get(skip..).unwrap_or_default();
        if let Some(c) = consumed {
            *c = offset.max(had) + fresh.len() as u64;
        }
        fresh
    }

    /// Appends to stream `slot`'s file up to the cap.
    fn append(&self, sink: &mut OutputSink, slot: usize, data: &[u8]) -> std::io::Result<()> {
        let mut stored = lock(&self.stored);
        let room = self.max_output.saturating_sub(stored[slot]) as usize;
        let take = data.len().min(room);
        sink.truncated |= take < data.len();
        if take > 0 {
            sink.files[slot].write_all(data.get(..take).unwrap_or_default())?;
            stored[slot] += take as u64;
        }
        drop(stored);
        self.bump();
        Ok(())
    }

    /// The end of the output: what the redactors held back (it begins no value) is stored.
    pub fn flush_output(&self, sink: &mut OutputSink) -> std::io::Result<()> {
        let Some(r) = &self.redaction else {
            return Ok(());
        };
        let tails = {
            let mut r = lock(r);
            [r.streams[0].finish(), r.streams[1].finish()]
        };
        for (slot, tail) in tails.iter().enumerate() {
            if !tail.is_empty() {
                self.append(sink, slot, tail)?;
            }
        }
        Ok(())
    }

    /// Marks the daemon's reason for the end (the first one counts).
    pub fn set_ended_by(&self, end: ExecEnd) {
        lock(&self.ended_by).get_or_insert(end);
    }

    /// Ends the execution for the daemon's reason: signals it, gives the guest a grace period
    /// to report the exit, then cuts the connection. The record says `end` either way.
    pub async fn end_by(&self, end: ExecEnd, signal: i32) {
        self.set_ended_by(end.clone());
        if let Err(e) = self.signal(signal) {
            warn!(execution = %self.id, "signal: {e}");
        }
        if !self.wait_finished(KILL_GRACE).await {
            self.cut();
            self.finish(None, Some(&end));
        }
    }

    /// The sandbox went away (or the daemon could not follow the execution): end it now.
    pub fn fail(&self, end: ExecEnd) {
        self.set_ended_by(end.clone());
        self.cut();
        self.finish(None, Some(&end));
    }

    /// Cuts the execution off the agent connection (the sandbox's other calls go on): its
    /// thread, blocked waiting for the guest, returns.
    pub fn cut(&self) {
        if let Some((mux, request)) = lock(&self.conn).request.as_ref() {
            mux.cancel(*request);
        }
    }

    /// Stores the final record once: from the guest's `exit`, or as `failed`.
    pub fn finish(&self, exit: Option<pb::ExecExit>, failed: Option<&ExecEnd>) {
        if self.finished.swap(true, Ordering::SeqCst) {
            return;
        }
        self.cut();
        if self.redaction.is_some() {
            let flushed = self
                .open_output()
                .and_then(|mut sink| self.flush_output(&mut sink));
            if let Err(e) = flushed {
                warn!(execution = %self.id, "storing the output's end: {e}");
            }
        }
        let ended_by = lock(&self.ended_by).clone();
        let record = {
            let mut r = lock(&self.record);
            *r = final_record(
                r.clone(),
                self.stored(),
                exit.as_ref(),
                failed,
                ended_by.as_ref(),
                ids::now_ms(),
            );
            r.error_message = self.redact(&r.error_message);
            r.clone()
        };
        let ledger = &self.ledger;
        if let Err(e) = ledger.store.put_execution(&record) {
            warn!(execution = %self.id, "storing the record: {e}");
        }
        let _ = ledger.store.remove_execution_agent(&self.id);
        let outcome = Outcome::of(record.state()).label();
        ledger.metrics.execution_ended(outcome);
        crate::audit::emit(
            &record.tenant,
            crate::audit::Kind::ExecEnd,
            &record.sandbox_id,
            &record.id,
            serde_json::json!({
                "outcome": outcome,
                "exit_code": record.exit_code,
                "signal": record.signal,
                "error_reason": record.error_reason,
                "stdout_bytes": record.stdout_bytes,
                "stderr_bytes": record.stderr_bytes,
                "duration_ms": record.ended_unix_ms - record.started_unix_ms,
            }),
        );
        ledger.live().remove(&self.id);
        info!(execution = %self.id, outcome, exit_code = record.exit_code, "execution ended");
        self.bump();
    }
}
