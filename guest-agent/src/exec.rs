//! Exec requests: starting an execution, and the table of running executions, where Signal,
//! Stdin and Attach find them.
//!
//! An Exec is validated first (see [`crate::exec_spec`]); then each execution runs on its own
//! thread, which spawns the process, answers ExecStarted (or the spawn's Error), streams its
//! output and sends ExecExit (see [`crate::exec_loop`]). What a running execution is, and how
//! its processes are signalled, is in [`crate::execution`].
//!
//! Executions belong to the connection that started them (or adopted them with Attach): Signal
//! and Stdin from another connection do not find them, and they are killed when that connection
//! closes, unless they were started with keep_on_disconnect: those are left unowned (see
//! [`crate::delivery`]). The table also keeps the exits of the most recent executions that
//! ended unowned, for a later Attach.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, ErrorCode, ExecExit, ExecStarted, Response, response};
use airlock_proto::{
    DEFAULT_ORPHAN_BUFFER_BYTES, EXITED_ORPHAN_TTL_SECS, MAX_CONCURRENT_EXECS, MAX_EXITED_ORPHANS,
};

use crate::conn::ConnWriter;
use crate::delivery::{Delivery, OrphanLimits, Release};
use crate::error::ReqError;
use crate::exec_loop;
use crate::exec_spec::ExecSpec;
use crate::execution::Execution;
use crate::spawn::Spawner;
use crate::users::Account;

/// How long the exit of an execution that ended unowned is kept for an Attach.
const EXITED_ORPHAN_TTL: Duration = Duration::from_secs(EXITED_ORPHAN_TTL_SECS);

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

/// Handles an Exec request, to run as `account`: validates it (its environment on top of `base_env`, see
/// [`crate::exec_spec::base_env`]), takes a place in `execs` and starts the execution's thread,
/// which spawns the process with `spawner` and answers from then on.
pub fn start(
    execs: &Arc<ExecTable>,
    spawner: &Arc<Spawner>,
    base_env: Vec<(String, String)>,
    account: Option<Account>,
    conn: &Arc<ConnWriter>,
    request_id: u64,
    req: pb::Exec,
) -> Result<(), ReqError> {
    let spec = ExecSpec::validate(req, base_env, account)?;
    // Held by the execution's thread until it ends (dropped with the closure if the thread
    // cannot start).
    let place = execs.reserve()?;
    let (execs, spawner, conn) = (Arc::clone(execs), Arc::clone(spawner), Arc::clone(conn));
    std::thread::Builder::new()
        .name(format!("exec-{request_id}"))
        .spawn(move || run(&execs, &spawner, conn, request_id, spec, place))
        .map(drop)
        .map_err(|e| ReqError::io("starting the execution's thread", &e))
}

/// Runs the execution `spec` answering request `request_id` on `conn`, from spawn to ExecExit.
fn run(
    execs: &ExecTable,
    spawner: &Spawner,
    conn: Arc<ConnWriter>,
    request_id: u64,
    spec: ExecSpec,
    place: ExecPlace,
) {
    let exec_id = execs.next_id();
    let limits = execs.orphan_limits();
    let mut run = match exec_loop::launch(spawner, limits, &conn, exec_id, request_id, &spec) {
        Ok(run) => run,
        Err(e) => {
            conn.send(&e.response(request_id));
            return;
        }
    };
    let exec = Arc::clone(run.exec());
    execs.insert(Arc::clone(&exec), &conn);
    let started = ExecStarted {
        exec_id,
        pid: u32::try_from(exec.pid).unwrap_or(0),
    };
    // Nothing else is sent for this execution before the loop starts, so this comes first.
    conn.send(&Response {
        id: request_id,
        kind: Some(response::Kind::ExecStarted(started)),
    });
    run.pump();
    let exit = run.finish();
    execs.exited(&exec, exit, place);
}

#[cfg(test)]
mod tests {
    use super::*;

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
