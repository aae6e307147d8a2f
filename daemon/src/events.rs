//! One event log for what sandboxes do. A sandbox's egress log (its DNS queries and
//! connections, [`EgressEvent`]) and its install log (the package files its pip, npm or apt
//! asked for, [`InstallEvent`]) are each a [`SandboxLog`] of a typed [`SandboxEvent`]:
//! appended with the next sequence number and the time, capped per sandbox (events over the
//! cap are counted as dropped, not stored; kept ones are then copied into the tenant's audit
//! trail by their owner, `crate::audit::logged`), read back
//! by a [`Query`] (after a sequence number, between two times, of some kinds), and removed with
//! the sandbox's record by retention. The audit trail (`crate::audit`) is the third log: its
//! events are hash-chained per tenant, and it is read by the same [`Query`].
//!
//! The sandbox logs share one table of the record store, `sandbox_events` (log, sandbox, seq,
//! time, kind, the event's protobuf record), and `sandbox_events_dropped` for the counts.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use airlock_api::v1::{
    AuditEvent, EgressEvent, EgressKind, GetEgressLogRequest, GetInstallLogRequest, InstallEvent,
    InstallOutcome, ListAuditEventsRequest,
};
use prost::Message;
use rusqlite::{OptionalExtension, params};
use tracing::warn;

use crate::error::ApiResult;
use crate::store::Store;

/// Which of a sandbox's logs an event belongs to; its name in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Log {
    Egress,
    Install,
}

impl Log {
    pub fn as_str(self) -> &'static str {
        match self {
            Log::Egress => "egress",
            Log::Install => "install",
        }
    }
}

/// An event of any of the logs, as a [`Query`] selects it.
pub trait Event {
    /// 1, 2, ... per sandbox (per tenant in the audit trail).
    fn seq(&self) -> u64;
    fn time_ms(&self) -> i64;
    /// What a query's `kinds` match: `dns`, `tcp`, `expose` (egress); the outcome, `cached`,
    /// `fetched`, `denied`, ... (installs); `sandbox.create`, `exec.start`, ... (audit).
    fn kind(&self) -> &str;
}

/// An event of a sandbox's own log.
pub trait SandboxEvent: Event + Message + Default {
    const LOG: Log;
    /// Sets what the log assigns: its sequence number, its time (unless the event has one),
    /// and the tenant and sandbox where the record names them.
    fn stamp(&mut self, seq: u64, now_ms: i64, tenant: &str, sandbox_id: &str);
}

impl Event for EgressEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn time_ms(&self) -> i64 {
        self.time_unix_ms
    }
    fn kind(&self) -> &str {
        egress_kind_label(self.kind())
    }
}

/// An egress event's kind as logs and metrics name it.
pub fn egress_kind_label(k: EgressKind) -> &'static str {
    match k {
        EgressKind::Dns => "dns",
        EgressKind::Tcp => "tcp",
        EgressKind::Expose => "expose",
        EgressKind::Unspecified => "unspecified",
    }
}

impl SandboxEvent for EgressEvent {
    const LOG: Log = Log::Egress;

    fn stamp(&mut self, seq: u64, now_ms: i64, _tenant: &str, _sandbox_id: &str) {
        self.seq = seq;
        if self.time_unix_ms == 0 {
            self.time_unix_ms = now_ms;
        }
    }
}

impl Event for InstallEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn time_ms(&self) -> i64 {
        self.time_unix_ms
    }
    fn kind(&self) -> &str {
        outcome_label(self.outcome())
    }
}

/// An install outcome as logs and metrics name it.
pub fn outcome_label(o: InstallOutcome) -> &'static str {
    match o {
        InstallOutcome::Cached => "cached",
        InstallOutcome::Fetched => "fetched",
        InstallOutcome::Denied => "denied",
        InstallOutcome::HashMismatch => "hash_mismatch",
        InstallOutcome::OverCap => "over_cap",
        InstallOutcome::UpstreamError => "upstream_error",
        InstallOutcome::BadSignature => "bad_signature",
        InstallOutcome::Unspecified => "unspecified",
    }
}

impl SandboxEvent for InstallEvent {
    const LOG: Log = Log::Install;

    fn stamp(&mut self, seq: u64, now_ms: i64, tenant: &str, sandbox_id: &str) {
        self.seq = seq;
        self.time_unix_ms = now_ms;
        self.tenant = tenant.to_owned();
        self.sandbox_id = sandbox_id.to_owned();
    }
}

impl Event for AuditEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn time_ms(&self) -> i64 {
        self.time_unix_ms
    }
    fn kind(&self) -> &str {
        &self.kind
    }
}

/// What to read of a log: the events after `after_seq`, at or after `since_ms` and before
/// `until_ms` (0: unbounded), of `kinds` (empty: all), at most a page of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Query {
    pub after_seq: u64,
    /// 0: the default page ([`DEFAULT_PAGE`]); capped at [`MAX_PAGE`].
    pub limit: u32,
    pub kinds: Vec<String>,
    pub since_ms: i64,
    pub until_ms: i64,
}

/// The events a query answers when it names no limit, and the most it answers.
pub const DEFAULT_PAGE: u32 = 1000;
pub const MAX_PAGE: u32 = 10_000;

impl Query {
    /// How many events the query answers at most.
    pub fn page(&self) -> usize {
        match self.limit {
            0 => DEFAULT_PAGE as usize,
            n => n.min(MAX_PAGE) as usize,
        }
    }

    /// Whether `e` is one the query selects (its seq aside: the store's statement orders by it).
    pub fn wants(&self, e: &impl Event) -> bool {
        (self.kinds.is_empty() || self.kinds.iter().any(|k| k == e.kind()))
            && (self.since_ms == 0 || e.time_ms() >= self.since_ms)
            && (self.until_ms == 0 || e.time_ms() < self.until_ms)
    }
}

/// Every log's request names its query with the same fields.
macro_rules! query_from {
    ($($req:ty),*) => {$(
        impl From<&$req> for Query {
            fn from(r: &$req) -> Self {
                Query {
                    after_seq: r.after_seq,
                    limit: r.limit,
                    kinds: r.kinds.clone(),
                    since_ms: r.since_unix_ms,
                    until_ms: r.until_unix_ms,
                }
            }
        }
    )*};
}

query_from!(
    GetEgressLogRequest,
    GetInstallLogRequest,
    ListAuditEventsRequest
);

/// Takes the events `q` selects from `events` (ordered by seq, past `q.after_seq`), at most a
/// page; and the seq to go on after when the page is full and more may follow (0: no more).
pub fn select<E: Event>(
    q: &Query,
    events: impl IntoIterator<Item = ApiResult<E>>,
) -> ApiResult<(Vec<E>, u64)> {
    let page = q.page();
    let mut out = Vec::new();
    for e in events {
        let e = e?;
        if !q.wants(&e) {
            continue;
        }
        if out.len() == page {
            let next = out.last().map_or(0, |l: &E| l.seq());
            return Ok((out, next));
        }
        out.push(e);
    }
    Ok((out, 0))
}

/// A sandbox's log of `E`s while it runs: appends them, up to `cap` kept (the rest counted).
#[derive(Debug)]
pub struct SandboxLog<E> {
    store: Arc<Store>,
    log: Log,
    tenant: String,
    sandbox_id: String,
    cap: u64,
    seq: AtomicU64,
    kept: AtomicU64,
    dropped: AtomicU64,
    _event: PhantomData<fn(E)>,
}

/// The dropped count is written to the store at the first drop, every this many after, and
/// when the log closes (a live sandbox's reads may lag behind by less than this).
const DROPPED_EVERY: u64 = 64;

impl<E: SandboxEvent> SandboxLog<E> {
    /// A new sandbox's log: empty (nothing is read for it on the create path).
    pub fn new(store: Arc<Store>, tenant: &str, sandbox_id: &str, cap: u64) -> Self {
        Self::at(store, tenant, sandbox_id, cap, Tail::default())
    }

    /// An adopted sandbox's log: it goes on from what the store holds.
    pub fn resume(store: Arc<Store>, tenant: &str, sandbox_id: &str, cap: u64) -> Self {
        let tail = tail(&store, E::LOG, sandbox_id).unwrap_or_else(|e| {
            warn!(sandbox = sandbox_id, log = E::LOG.as_str(), "log tail: {e}");
            Tail::default()
        });
        Self::at(store, tenant, sandbox_id, cap, tail)
    }

    fn at(store: Arc<Store>, tenant: &str, sandbox_id: &str, cap: u64, t: Tail) -> Self {
        Self {
            store,
            log: E::LOG,
            tenant: tenant.to_owned(),
            sandbox_id: sandbox_id.to_owned(),
            cap,
            seq: AtomicU64::new(t.last_seq),
            kept: AtomicU64::new(t.kept),
            dropped: AtomicU64::new(t.dropped),
            _event: PhantomData,
        }
    }

    /// Appends `e` (its seq and time assigned) and answers it as kept, or counts it as
    /// dropped when the log is full (`None`). A store failure is logged: the sandbox goes on.
    pub fn append(&self, mut e: E) -> Option<E> {
        if self.kept.fetch_add(1, Ordering::Relaxed) >= self.cap {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n == 1 || n.is_multiple_of(DROPPED_EVERY) {
                self.save_dropped(n);
            }
            return None;
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        e.stamp(seq, crate::ids::now_ms(), &self.tenant, &self.sandbox_id);
        if let Err(err) = put(&self.store, &self.sandbox_id, &e) {
            warn!(sandbox = %self.sandbox_id, log = E::LOG.as_str(), "event not stored: {err}");
        }
        Some(e)
    }
}

impl<E> SandboxLog<E> {
    fn save_dropped(&self, n: u64) {
        if let Err(err) = set_dropped(&self.store, self.log, &self.sandbox_id, n) {
            warn!(sandbox = %self.sandbox_id, log = self.log.as_str(), "dropped count: {err}");
        }
    }
}

impl<E> Drop for SandboxLog<E> {
    fn drop(&mut self) {
        let n = *self.dropped.get_mut();
        if n > 0 {
            self.save_dropped(n);
        }
    }
}

/// Where a sandbox's stored log stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tail {
    last_seq: u64,
    kept: u64,
    dropped: u64,
}

fn tail(store: &Store, log: Log, sandbox_id: &str) -> ApiResult<Tail> {
    let db = store.db();
    let (last, kept): (i64, i64) = db.query_row(
        "SELECT COALESCE(MAX(seq), 0), COUNT(*) FROM sandbox_events \
         WHERE log = ?1 AND sandbox_id = ?2",
        params![log.as_str(), sandbox_id],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    drop(db);
    Ok(Tail {
        last_seq: last as u64,
        kept: kept as u64,
        dropped: dropped(store, log, sandbox_id)?,
    })
}

fn put<E: SandboxEvent>(store: &Store, sandbox_id: &str, e: &E) -> ApiResult<()> {
    store.db().execute(
        "INSERT OR REPLACE INTO sandbox_events (log, sandbox_id, seq, time_ms, kind, event) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            E::LOG.as_str(),
            sandbox_id,
            e.seq() as i64,
            e.time_ms(),
            e.kind(),
            e.encode_to_vec()
        ],
    )?;
    Ok(())
}

fn set_dropped(store: &Store, log: Log, sandbox_id: &str, n: u64) -> ApiResult<()> {
    store.db().execute(
        "INSERT OR REPLACE INTO sandbox_events_dropped (log, sandbox_id, n) VALUES (?1, ?2, ?3)",
        params![log.as_str(), sandbox_id, n as i64],
    )?;
    Ok(())
}

/// Events of a sandbox's log that were counted but not kept.
fn dropped(store: &Store, log: Log, sandbox_id: &str) -> ApiResult<u64> {
    let n: Option<i64> = store
        .db()
        .query_row(
            "SELECT n FROM sandbox_events_dropped WHERE log = ?1 AND sandbox_id = ?2",
            params![log.as_str(), sandbox_id],
            |r| r.get(0),
        )
        .optional()?;
    Ok(n.unwrap_or(0) as u64)
}

/// What `q` selects of a sandbox's log of `E`s, oldest first, and its count of dropped events.
pub fn read<E: SandboxEvent>(
    store: &Store,
    sandbox_id: &str,
    q: &Query,
) -> ApiResult<(Vec<E>, u64)> {
    let mut kept: Vec<Vec<u8>> = Vec::new();
    {
        let db = store.db();
        let mut stmt = db.prepare_cached(
            "SELECT kind, event FROM sandbox_events WHERE log = ?1 AND sandbox_id = ?2 \
             AND seq > ?3 AND (?4 = 0 OR time_ms >= ?4) AND (?5 = 0 OR time_ms < ?5) \
             ORDER BY seq",
        )?;
        let params = params![
            E::LOG.as_str(),
            sandbox_id,
            q.after_seq as i64,
            q.since_ms,
            q.until_ms
        ];
        let mut rows = stmt.query(params)?;
        while let Some(row) = rows.next()? {
            let kind: String = row.get(0)?;
            if q.kinds.is_empty() || q.kinds.contains(&kind) {
                kept.push(row.get(1)?);
                if kept.len() == q.page() {
                    break;
                }
            }
        }
    }
    let events = kept
        .iter()
        .map(|bytes| {
            E::decode(bytes.as_slice())
                .map_err(|e| crate::error::ApiError::Internal(format!("stored event: {e}")))
        })
        .collect::<ApiResult<Vec<E>>>()?;
    Ok((events, dropped(store, E::LOG, sandbox_id)?))
}

/// Moves what a daemon older than `sandbox_events` logged (its `egress_events` and
/// `install_events` tables, and their dropped counts) into it; how many events.
pub fn migrate(store: &Store) -> ApiResult<usize> {
    let mut moved = migrate_table::<EgressEvent>(store, "egress")?;
    moved += migrate_table::<InstallEvent>(store, "install")?;
    Ok(moved)
}

fn migrate_table<E: SandboxEvent>(store: &Store, old: &str) -> ApiResult<usize> {
    let mut db = store.db();
    let exists: Option<String> = db
        .query_row(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?1",
            params![format!("{old}_events")],
            |r| r.get(0),
        )
        .optional()?;
    if exists.is_none() {
        return Ok(0);
    }
    let tx = db.transaction()?;
    let rows: Vec<(String, Vec<u8>)> = {
        let mut q = tx.prepare(&format!("SELECT sandbox_id, event FROM {old}_events"))?;
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?
    };
    for (sandbox_id, bytes) in &rows {
        let Ok(e) = E::decode(bytes.as_slice()) else {
            warn!(sandbox = %sandbox_id, "an unreadable {old} event was not migrated");
            continue;
        };
        tx.execute(
            "INSERT OR REPLACE INTO sandbox_events (log, sandbox_id, seq, time_ms, kind, event) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![
                E::LOG.as_str(),
                sandbox_id,
                e.seq() as i64,
                e.time_ms(),
                e.kind(),
                bytes
            ],
        )?;
    }
    let dropped = match old {
        "install" => "install_dropped",
        _ => "egress_dropped",
    };
    tx.execute(
        &format!(
            "INSERT OR REPLACE INTO sandbox_events_dropped (log, sandbox_id, n) \
             SELECT ?1, sandbox_id, n FROM {dropped}"
        ),
        params![E::LOG.as_str()],
    )?;
    tx.execute_batch(&format!(
        "DROP TABLE {old}_events; DROP TABLE IF EXISTS {dropped};"
    ))?;
    tx.commit()?;
    Ok(rows.len())
}

#[cfg(test)]
mod tests;
