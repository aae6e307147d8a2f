//! Retention: nothing a tenant leaves behind is kept for ever. Once a minute, ended sandboxes
//! whose `record_retention_s` has passed lose their records (with their executions' records and
//! output); executions of sandboxes that ended `output_retention_s` ago lose their stored output
//! (their records say `output_deleted`); and a tenant whose stored output is over its
//! `max_output_mib` loses the output of its oldest ended executions first. Running executions
//! keep theirs.

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::{Execution, ExecutionState, SandboxState};
use tracing::{info, warn};

use crate::config::Config;
use crate::error::ApiResult;
use crate::exec::Executions;
use crate::ids;
use crate::store::Store;

/// What a sweep deleted.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub sandbox_records: usize,
    pub outputs: usize,
    pub bytes: u64,
}

/// Deletes what retention says is due.
#[derive(Debug)]
pub struct Retention {
    pub cfg: Arc<Config>,
    pub store: Arc<Store>,
    pub executions: Arc<Executions>,
}

impl Retention {
    /// Runs a sweep once a minute, for ever.
    pub async fn run(self: Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_secs(60)).await;
            let store = self.store.clone();
            match tokio::task::spawn_blocking(move || crate::audit::prune(&store)).await {
                Ok(Ok(n)) if n > 0 => info!(events = n, "audit retention"),
                Ok(Err(e)) => warn!("audit retention: {e}"),
                _ => {}
            }
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.sweep(ids::now_ms())).await {
                Ok(Ok(s)) if s != Swept::default() => info!(?s, "retention"),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => warn!("retention: {e}"),
                Err(e) => warn!("retention task: {e}"),
            }
        }
    }

    /// One sweep at `now_ms`.
    pub fn sweep(&self, now_ms: i64) -> ApiResult<Swept> {
        let mut swept = Swept::default();
        let age_ms = |s: u64| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let (records_after, output_after) = (
            age_ms(self.cfg.record_retention_s),
            age_ms(self.cfg.output_retention_s),
        );
        let mut tenants = std::collections::BTreeSet::new();
        for s in self.store.sandboxes(None)? {
            tenants.insert(s.tenant.clone());
            let ended = matches!(s.state(), SandboxState::Dead | SandboxState::Destroyed);
            if !ended {
                continue;
            }
            let age = now_ms.saturating_sub(s.ended_unix_ms);
            if age >= records_after {
                for e in self.store.executions_of(&s.id)? {
                    swept.bytes += self.delete_output(&e);
                }
                self.store.delete_sandbox(&s.id)?;
                swept.sandbox_records += 1;
            } else if age >= output_after {
                for e in self.store.executions_of(&s.id)? {
                    if !e.output_deleted {
                        swept.bytes += self.forget_output(e)?;
                        swept.outputs += 1;
                    }
                }
            }
        }
        for tenant in tenants {
            self.cap_tenant(&tenant, &mut swept)?;
        }
        Ok(swept)
    }

    /// Deletes the output of `tenant`'s oldest ended executions while its stored output is
    /// over its `max_output_mib`.
    fn cap_tenant(&self, tenant: &str, swept: &mut Swept) -> ApiResult<()> {
        let cap = self.cfg.quota_of(tenant).max_output_mib << 20;
        if cap == 0 {
            return Ok(());
        }
        let mut kept: Vec<(Execution, u64)> = self
            .store
            .executions_of_tenant(tenant)?
            .into_iter()
            .filter(|e| !e.output_deleted)
            .map(|e| {
                let bytes = self.output_bytes(&e.id);
                (e, bytes)
            })
            .collect();
        let mut total: u64 = kept.iter().map(|(_, b)| b).sum();
        kept.retain(|(e, _)| e.state() != ExecutionState::Running);
        kept.sort_by_key(|(e, _)| e.ended_unix_ms);
        for (e, _) in kept {
            if total <= cap {
                break;
            }
            let freed = self.forget_output(e)?;
            total = total.saturating_sub(freed);
            swept.bytes += freed;
            swept.outputs += 1;
        }
        Ok(())
    }

    /// Bytes of execution `id`'s stored output.
    pub fn output_bytes(&self, id: &str) -> u64 {
        self.executions
            .output_paths(id)
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum()
    }

    /// Deletes `e`'s output files; the bytes freed.
    fn delete_output(&self, e: &Execution) -> u64 {
        let bytes = self.output_bytes(&e.id);
        for p in self.executions.output_paths(&e.id) {
            let _ = std::fs::remove_file(p);
        }
        bytes
    }

    /// Deletes `e`'s output and records that it did.
    fn forget_output(&self, mut e: Execution) -> ApiResult<u64> {
        let bytes = self.delete_output(&e);
        e.output_deleted = true;
        self.store.put_execution(&e)?;
        Ok(bytes)
    }
}
