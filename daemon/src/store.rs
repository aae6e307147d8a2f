//! Records that survive the daemon: templates, sandboxes, executions (each stored as its
//! protobuf record with the columns it is looked up by) and the VMM processes the daemon
//! started, in one SQLite database (`DATA_DIR/airlock.db`). Execution output lives in files next
//! to it (`DATA_DIR/output/`).

use std::path::Path;
use std::sync::Mutex;

use airlock_api::v1::{Execution, Sandbox, Template};
use prost::Message;
use rusqlite::{Connection, OptionalExtension, params};

use crate::error::ApiResult;

/// The record store.
#[derive(Debug)]
pub struct Store {
    db: Mutex<Connection>,
}

/// A VMM process the daemon started, kept so that a restarted daemon can reap it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessRecord {
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22): tells a reused pid
    /// apart.
    pub start_ticks: u64,
    /// Its run directory (sockets, console log).
    pub run_dir: String,
    /// Its cgroup name, if it has one.
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
        Ok(Self { db: Mutex::new(db) })
    }

    fn db(&self) -> std::sync::MutexGuard<'_, Connection> {
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

    pub fn add_process(&self, p: &ProcessRecord) -> ApiResult<()> {
        self.db().execute(
            "INSERT OR REPLACE INTO processes (pid, start_ticks, run_dir, cgroup)
             VALUES (?1, ?2, ?3, ?4)",
            params![p.pid, p.start_ticks, p.run_dir, p.cgroup],
        )?;
        Ok(())
    }

    pub fn remove_process(&self, pid: u32, start_ticks: u64) -> ApiResult<()> {
        self.db().execute(
            "DELETE FROM processes WHERE pid = ?1 AND start_ticks = ?2",
            params![pid, start_ticks],
        )?;
        Ok(())
    }

    pub fn processes(&self) -> ApiResult<Vec<ProcessRecord>> {
        let db = self.db();
        let mut st = db.prepare("SELECT pid, start_ticks, run_dir, cgroup FROM processes")?;
        let rows = st.query_map([], |r| {
            Ok(ProcessRecord {
                pid: r.get(0)?,
                start_ticks: r.get(1)?,
                run_dir: r.get(2)?,
                cgroup: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
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
            s.add_process(&ProcessRecord {
                pid: 42,
                start_ticks: 7,
                run_dir: "/r".into(),
                cgroup: String::new(),
            })
            .unwrap();
        }
        let s = Store::open(&path).unwrap();
        assert_eq!(s.sandbox("sb-1").unwrap().unwrap().tenant, "a");
        assert!(s.sandbox("sb-9").unwrap().is_none());
        assert_eq!(s.sandboxes(Some("b")).unwrap().len(), 1);
        assert_eq!(s.sandboxes(None).unwrap().len(), 2);
        assert_eq!(s.execution("ex-1").unwrap().unwrap().exit_code, 3);
        assert_eq!(s.executions_of("sb-1").unwrap().len(), 1);
        assert_eq!(s.processes().unwrap()[0].pid, 42);
        s.remove_process(42, 7).unwrap();
        assert!(s.processes().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
