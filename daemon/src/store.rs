//! Records that survive the daemon: templates, sandboxes, executions (each stored as its
//! protobuf record with the columns it is looked up by) and the VMM processes the daemon
//! started, in one SQLite database (`DATA_DIR/airlock.db`), with the tables of the sandboxes'
//! logs (`crate::events`) and of the audit trail (`crate::audit`), whose statements are their
//! own. Execution output lives in files next to it (`DATA_DIR/output/`). A live sandbox's
//! secrets are kept sealed (`crate::secrets::seal`: ciphertext only, the key elsewhere) next to
//! its spec, and go with it.

use std::path::Path;
use std::sync::Mutex;

use airlock_api::v1::{CreateSandboxRequest, Execution, Sandbox, Template, Volume};
use prost::Message;
use rusqlite::{Connection, OptionalExtension, params};

use crate::error::ApiResult;

/// The record store.
#[derive(Debug)]
pub struct Store {
    db: Mutex<Connection>,
}

/// A VMM process the daemon started, kept so that a restarted daemon can adopt or reap it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmRecord {
    /// Its id (`vm-...`): names its run directory and cgroup.
    pub id: String,
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22): tells a reused pid
    /// apart.
    pub start_ticks: u64,
    /// Its jail uid.
    pub uid: Option<u32>,
    /// Its run directory (sockets, console log).
    pub run_dir: String,
    /// Whether it has a cgroup (named by its id).
    pub cgroup: bool,
    pub owner: Owner,
}

/// Who a VMM process works for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A warm pool process of this template id.
    Pool(String),
    /// The VMM of this sandbox.
    Sandbox(String),
    /// A template build (its cold boot) of this template id.
    Build(String),
}

impl Owner {
    fn kind(&self) -> (&'static str, &str) {
        match self {
            Self::Pool(t) => ("pool", t),
            Self::Sandbox(s) => ("sandbox", s),
            Self::Build(t) => ("build", t),
        }
    }

    fn kind_owned(&self) -> (&'static str, String) {
        let (k, id) = self.kind();
        (k, id.to_owned())
    }

    fn from_kind(kind: &str, id: String) -> Self {
        match kind {
            "sandbox" => Self::Sandbox(id),
            "pool" => Self::Pool(id),
            _ => Self::Build(id),
        }
    }
}

/// A VMM process recorded by a daemon older than the `vmms` table: only reaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegacyProcess {
    pub pid: u32,
    pub start_ticks: u64,
    pub run_dir: String,
    pub cgroup: String,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS templates (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, tenant TEXT NOT NULL, dir TEXT NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state INTEGER NOT NULL, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS executions (
    id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, tenant TEXT NOT NULL, record BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS executions_by_sandbox ON executions (sandbox_id);
CREATE TABLE IF NOT EXISTS processes (
    pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, run_dir TEXT NOT NULL,
    cgroup TEXT NOT NULL, PRIMARY KEY (pid, start_ticks));
CREATE TABLE IF NOT EXISTS vmms (
    id TEXT PRIMARY KEY, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, uid INTEGER,
    run_dir TEXT NOT NULL, cgroup INTEGER NOT NULL, owner_kind TEXT NOT NULL,
    owner_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandbox_specs (id TEXT PRIMARY KEY, spec BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS sandbox_secrets (id TEXT PRIMARY KEY, sealed BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS execution_agents (
    id TEXT PRIMARY KEY, agent_exec_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sandbox_events (
    log TEXT NOT NULL, sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, time_ms INTEGER NOT NULL,
    kind TEXT NOT NULL, event BLOB NOT NULL, PRIMARY KEY (log, sandbox_id, seq));
CREATE TABLE IF NOT EXISTS sandbox_events_dropped (
    log TEXT NOT NULL, sandbox_id TEXT NOT NULL, n INTEGER NOT NULL,
    PRIMARY KEY (log, sandbox_id));
CREATE TABLE IF NOT EXISTS audit_events (
    tenant TEXT NOT NULL, seq INTEGER NOT NULL, time_ms INTEGER NOT NULL, kind TEXT NOT NULL,
    sandbox_id TEXT NOT NULL, execution_id TEXT NOT NULL, detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL, hash TEXT NOT NULL, PRIMARY KEY (tenant, seq));
CREATE TABLE IF NOT EXISTS volumes (
    tenant TEXT NOT NULL, name TEXT NOT NULL, id TEXT NOT NULL, record BLOB NOT NULL,
    PRIMARY KEY (tenant, name));
";

fn decode<M: Message + Default>(bytes: Vec<u8>) -> rusqlite::Result<M> {
    M::decode(bytes.as_slice()).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(e))
    })
}

impl Store {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> ApiResult<Self> {
        let db = Connection::open(path)?;
        db.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;")?;
        db.execute_batch(SCHEMA)?;
        // Sealed secrets live only as long as their sandbox's spec (a crash between the two
        // deletes left them).
        db.execute(
            "DELETE FROM sandbox_secrets WHERE id NOT IN (SELECT id FROM sandbox_specs)",
            [],
        )?;
        Ok(Self { db: Mutex::new(db) })
    }

    /// The connection, for the statements of the logs (`crate::events`, `crate::audit`).
    pub(crate) fn db(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.db.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn put_template(&self, t: &Template, dir: &str) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO templates (id, name, tenant, dir, deleted, record)
             VALUES (?1, ?2, ?3, ?4, 0, ?5)",
            params![t.id, t.name, t.tenant, dir, t.encode_to_vec()],
        )?;
        Ok(())
    }

    /// Live templates: (record, directory).
    pub fn templates(&self) -> ApiResult<Vec<(Template, String)>> {
        let db = self.db();
        let mut st = db.prepare("SELECT record, dir FROM templates WHERE deleted = 0")?;
        let rows = st.query_map([], |r| Ok((decode(r.get(0)?)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records a volume of `tenant`'s (its file is named by `id`).
    pub fn put_volume(&self, tenant: &str, id: &str, v: &Volume) -> ApiResult<()> {
        self.db().execute(
            "INSERT INTO volumes (tenant, name, id, record) VALUES (?1, ?2, ?3, ?4)",
            params![tenant, v.name, id, v.encode_to_vec()],
        )?;
        Ok(())
    }

    /// Every volume: (tenant, id, record).
    pub fn volumes(&self) -> ApiResult<Vec<(String, String, Volume)>> {
        let db = self.db();
        let mut st = db.prepare("SELECT tenant, id, record FROM volumes")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, decode(r.get(2)?)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn delete_volume(&self, tenant: &str, name: &str) -> ApiResult<()> {
        self.db().execute(
            "DELETE FROM volumes WHERE tenant = ?1 AND name = ?2",
            params![tenant, name],
        )?;
        Ok(())
    }

    pub fn delete_template(&self, id: &str) -> ApiResult<()> {
        self.db().execute(
            "UPDATE templates SET deleted = 1 WHERE id = ?1",
            params![id],
        )?;
        Ok(())
    }

    pub fn put_sandbox(&self, s: &Sandbox) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO sandboxes (id, tenant, state, record) VALUES (?1, ?2, ?3, ?4)",
            params![s.id, s.tenant, s.state, s.encode_to_vec()],
        )?;
        Ok(())
    }

    /// A create's end, in one transaction: the sandbox's running record, what a restarted
    /// daemon needs to serve it (`spec`, its `sealed` secrets), and its VMM recorded as its own
    /// (until then the VMM is a warm pool process's, which a restarted daemon reaps).
    pub fn put_running(
        &self,
        s: &Sandbox,
        spec: &CreateSandboxRequest,
        sealed: Option<&[u8]>,
        vmm_id: &str,
    ) -> ApiResult<()> {
        let mut db = self.db();
        let tx = db.transaction()?;
        tx.execute(
            "INSERT OR REPLACE INTO sandboxes (id, tenant, state, record) VALUES (?1, ?2, ?3, ?4)",
            params![s.id, s.tenant, s.state, s.encode_to_vec()],
        )?;
        tx.execute(
            "INSERT OR REPLACE INTO sandbox_specs (id, spec) VALUES (?1, ?2)",
            params![s.id, spec.encode_to_vec()],
        )?;
        if let Some(sealed) = sealed {
            tx.execute(
                "INSERT OR REPLACE INTO sandbox_secrets (id, sealed) VALUES (?1, ?2)",
                params![s.id, sealed],
            )?;
        }
        let (kind, owner) = Owner::Sandbox(s.id.clone()).kind_owned();
        tx.execute(
            "UPDATE vmms SET owner_kind = ?2, owner_id = ?3 WHERE id = ?1",
            params![vmm_id, kind, owner],
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn sandbox(&self, id: &str) -> ApiResult<Option<Sandbox>> {
        let db = self.db();
        let bytes: Option<Vec<u8>> = db
            .query_row(
                "SELECT record FROM sandboxes WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        Ok(bytes.map(decode).transpose()?)
    }

    pub fn sandboxes(&self, tenant: Option<&str>) -> ApiResult<Vec<Sandbox>> {
        let db = self.db();
        let mut st = db.prepare(
            "SELECT record FROM sandboxes WHERE ?1 IS NULL OR tenant = ?1 ORDER BY rowid",
        )?;
        let rows = st.query_map(params![tenant], |r| decode(r.get(0)?))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn put_execution(&self, e: &Execution) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO executions (id, sandbox_id, tenant, record)
             VALUES (?1, ?2, ?3, ?4)",
            params![e.id, e.sandbox_id, e.tenant, e.encode_to_vec()],
        )?;
        Ok(())
    }

    pub fn execution(&self, id: &str) -> ApiResult<Option<Execution>> {
        let db = self.db();
        let bytes: Option<Vec<u8>> = db
            .query_row(
                "SELECT record FROM executions WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        Ok(bytes.map(decode).transpose()?)
    }

    pub fn executions_of(&self, sandbox_id: &str) -> ApiResult<Vec<Execution>> {
        let db = self.db();
        let mut st = db.prepare("SELECT record FROM executions WHERE sandbox_id = ?1")?;
        let rows = st.query_map(params![sandbox_id], |r| decode(r.get(0)?))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// What a restarted daemon needs to serve a live sandbox again (environment, file
    /// policy); removed when the sandbox ends.
    pub fn sandbox_spec(&self, id: &str) -> ApiResult<Option<CreateSandboxRequest>> {
        let db = self.db();
        let bytes: Option<Vec<u8>> = db
            .query_row(
                "SELECT spec FROM sandbox_specs WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        Ok(bytes.map(decode).transpose()?)
    }

    /// Removes what a restarted daemon would need to serve sandbox `id` again: its spec and its
    /// sealed secrets (its end).
    pub fn remove_sandbox_spec(&self, id: &str) -> ApiResult<()> {
        let mut db = self.db();
        let tx = db.transaction()?;
        tx.execute("DELETE FROM sandbox_secrets WHERE id = ?1", params![id])?;
        tx.execute("DELETE FROM sandbox_specs WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(())
    }

    /// Replaces the sealed secrets of live sandbox `id` (one that has its spec: an ended
    /// sandbox's are not written again).
    pub fn put_sealed_secrets(&self, id: &str, sealed: &[u8]) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO sandbox_secrets (id, sealed) SELECT ?1, ?2 \
             WHERE EXISTS (SELECT 1 FROM sandbox_specs WHERE id = ?1)",
            params![id, sealed],
        )?;
        Ok(())
    }

    /// Forgets the sealed secrets of sandbox `id` (it keeps its spec).
    pub fn remove_sealed_secrets(&self, id: &str) -> ApiResult<()> {
        self.db()
            .execute("DELETE FROM sandbox_secrets WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// The sealed secrets of live sandbox `id`.
    pub fn sealed_secrets(&self, id: &str) -> ApiResult<Option<Vec<u8>>> {
        let db = self.db();
        Ok(db
            .query_row(
                "SELECT sealed FROM sandbox_secrets WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Every execution record of `tenant`.
    pub fn executions_of_tenant(&self, tenant: &str) -> ApiResult<Vec<Execution>> {
        let db = self.db();
        let mut st = db.prepare("SELECT record FROM executions WHERE tenant = ?1")?;
        let rows = st.query_map(params![tenant], |r| decode(r.get(0)?))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records of `tenant`: (sandboxes, executions).
    pub fn record_counts(&self, tenant: &str) -> ApiResult<(u64, u64)> {
        let db = self.db();
        let count = |table: &str| -> rusqlite::Result<u64> {
            db.query_row(
                &format!("SELECT COUNT(*) FROM {table} WHERE tenant = ?1"),
                params![tenant],
                |r| r.get(0),
            )
        };
        Ok((count("sandboxes")?, count("executions")?))
    }

    /// Deletes an ended sandbox's records: its own, its spec, its executions'.
    pub fn delete_sandbox(&self, id: &str) -> ApiResult<()> {
        let mut db = self.db();
        let tx = db.transaction()?;
        tx.execute(
            "DELETE FROM execution_agents WHERE id IN \
             (SELECT id FROM executions WHERE sandbox_id = ?1)",
            params![id],
        )?;
        tx.execute("DELETE FROM executions WHERE sandbox_id = ?1", params![id])?;
        tx.execute("DELETE FROM sandbox_specs WHERE id = ?1", params![id])?;
        tx.execute("DELETE FROM sandbox_secrets WHERE id = ?1", params![id])?;
        // Its logs (`crate::events`) go with its record.
        tx.execute(
            "DELETE FROM sandbox_events WHERE sandbox_id = ?1",
            params![id],
        )?;
        tx.execute(
            "DELETE FROM sandbox_events_dropped WHERE sandbox_id = ?1",
            params![id],
        )?;
        tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(())
    }

    pub fn put_vmm(&self, v: &VmmRecord) -> ApiResult<()> {
        let (kind, owner) = v.owner.kind();
        self.db().execute(
            "INSERT OR REPLACE INTO vmms
             (id, pid, start_ticks, uid, run_dir, cgroup, owner_kind, owner_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![
                v.id,
                v.pid,
                v.start_ticks,
                v.uid,
                v.run_dir,
                v.cgroup,
                kind,
                owner
            ],
        )?;
        Ok(())
    }

    pub fn remove_vmm(&self, id: &str) -> ApiResult<()> {
        self.db()
            .execute("DELETE FROM vmms WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn vmms(&self) -> ApiResult<Vec<VmmRecord>> {
        let db = self.db();
        let mut st = db.prepare(
            "SELECT id, pid, start_ticks, uid, run_dir, cgroup, owner_kind, owner_id FROM vmms",
        )?;
        let rows = st.query_map([], |r| {
            let kind: String = r.get(6)?;
            Ok(VmmRecord {
                id: r.get(0)?,
                pid: r.get(1)?,
                start_ticks: r.get(2)?,
                uid: r.get(3)?,
                run_dir: r.get(4)?,
                cgroup: r.get(5)?,
                owner: Owner::from_kind(&kind, r.get(7)?),
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The agent's id of a running execution (to attach to it again after a restart).
    pub fn set_execution_agent(&self, id: &str, agent_exec_id: u64) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO execution_agents (id, agent_exec_id) VALUES (?1, ?2)",
            params![id, agent_exec_id as i64],
        )?;
        Ok(())
    }

    pub fn execution_agent(&self, id: &str) -> ApiResult<Option<u64>> {
        let db = self.db();
        let v: Option<i64> = db
            .query_row(
                "SELECT agent_exec_id FROM execution_agents WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        Ok(v.map(|v| v as u64))
    }

    pub fn remove_execution_agent(&self, id: &str) -> ApiResult<()> {
        self.db()
            .execute("DELETE FROM execution_agents WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Processes recorded by a daemon older than the `vmms` table (only reaped), forgotten
    /// once read.
    pub fn take_legacy_processes(&self) -> ApiResult<Vec<LegacyProcess>> {
        let db = self.db();
        let all = {
            let mut st = db.prepare("SELECT pid, start_ticks, run_dir, cgroup FROM processes")?;
            let rows = st.query_map([], |r| {
                Ok(LegacyProcess {
                    pid: r.get(0)?,
                    start_ticks: r.get(1)?,
                    run_dir: r.get(2)?,
                    cgroup: r.get(3)?,
                })
            })?;
            rows.collect::<Result<Vec<_>, _>>()?
        };
        db.execute("DELETE FROM processes", [])?;
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn records_survive_reopening() {
        let dir = std::env::temp_dir().join(format!("airlock-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("airlock.db");
        {
            let s = Store::open(&path).unwrap();
            s.put_sandbox(&Sandbox {
                id: "sb-1".into(),
                tenant: "a".into(),
                state: 2,
                ..Default::default()
            })
            .unwrap();
            s.put_sandbox(&Sandbox {
                id: "sb-2".into(),
                tenant: "b".into(),
                state: 2,
                ..Default::default()
            })
            .unwrap();
            s.put_execution(&Execution {
                id: "ex-1".into(),
                sandbox_id: "sb-1".into(),
                exit_code: 3,
                ..Default::default()
            })
            .unwrap();
            s.put_vmm(&VmmRecord {
                id: "vm-1".into(),
                pid: 42,
                start_ticks: 7,
                uid: Some(1900000001),
                run_dir: "/r".into(),
                cgroup: true,
                owner: Owner::Pool("tpl-1".into()),
            })
            .unwrap();
            let running = Sandbox {
                id: "sb-1".into(),
                tenant: "a".into(),
                state: 2,
                ..Default::default()
            };
            s.put_running(
                &running,
                &CreateSandboxRequest::default(),
                Some(b"sealed"),
                "vm-1",
            )
            .unwrap();
            assert!(s.sandbox_spec("sb-1").unwrap().is_some());
            // Only a live sandbox's (one with a spec) are written.
            s.put_sealed_secrets("sb-2", b"sealed").unwrap();
            assert_eq!(s.sealed_secrets("sb-2").unwrap(), None);
            s.set_execution_agent("ex-1", 5).unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.sandbox("sb-1").unwrap().unwrap().tenant, "a");
        assert!(s.sandbox("sb-9").unwrap().is_none());
        assert_eq!(s.sandboxes(Some("b")).unwrap().len(), 1);
        assert_eq!(s.sandboxes(None).unwrap().len(), 2);
        assert_eq!(s.execution("ex-1").unwrap().unwrap().exit_code, 3);
        assert_eq!(s.executions_of("sb-1").unwrap().len(), 1);
        let vmms = s.vmms().unwrap();
        assert_eq!(vmms[0].pid, 42);
        assert_eq!(vmms[0].uid, Some(1900000001));
        assert_eq!(vmms[0].owner, Owner::Sandbox("sb-1".into()));
        s.remove_vmm("vm-1").unwrap();
        assert!(s.vmms().unwrap().is_empty());
        assert_eq!(s.execution_agent("ex-1").unwrap(), Some(5));
        s.remove_execution_agent("ex-1").unwrap();
        assert_eq!(s.execution_agent("ex-1").unwrap(), None);
        assert!(s.take_legacy_processes().unwrap().is_empty());
        assert_eq!(s.sealed_secrets("sb-1").unwrap().unwrap(), b"sealed");
        s.remove_sandbox_spec("sb-1").unwrap();
        assert_eq!(s.sealed_secrets("sb-1").unwrap(), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
