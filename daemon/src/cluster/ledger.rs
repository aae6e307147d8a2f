//! What the cluster keeps in etcd, and its transactions: node records under a lease, node tags,
//! a record per live sandbox (counted against its tenant's quota across the cluster), the
//! records of sandboxes whose node was lost.
//!
//! Keys (under `[cluster] prefix`):
//! - `nodes/NAME`: a node's [`NodeInfo`] (JSON) signed with the cluster key
//!   ([`records::seal`]), under its lease; a record without a valid signature is ignored.
//! - `tags/TAG`: the node that claimed the tag (no lease: a tag stays its node's).
//! - `sandboxes/TENANT/ID`: a live sandbox's record (`Sandbox`, protobuf) as created.
//! - `lost/ID`: the record of a sandbox whose node left (state DEAD, end reason NODE_LOST).

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::Sandbox;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use prost::Message as _;
use tracing::warn;

use super::ClusterConfig;
use super::ClusterError;
use super::records::{self, NodeInfo, RecordKey};
use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::reason::EndReason;
use crate::sandbox::Ledger;

/// How often a quota transaction is tried when others change the tenant's records meanwhile.
const TXN_TRIES: usize = 16;

/// The cluster's store.
#[derive(Clone)]
pub struct EtcdLedger {
    client: Client,
    prefix: String,
    /// This node's name.
    node: String,
    cfg: Arc<Config>,
    /// What node records are signed with.
    key: RecordKey,
    /// The node records refused already (key and revision), each logged once.
    refused: Arc<std::sync::Mutex<std::collections::HashSet<(String, i64)>>>,
}

impl std::fmt::Debug for EtcdLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLedger")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: etcd_client::Error) -> ApiError {
    ApiError::ClusterUnavailable(e.to_string())
}

/// How the client reaches etcd: timeouts, keep-alives and, for `https://` endpoints, TLS
/// with `[cluster] etcd_ca` and this node's client certificate (`etcd_cert`, `etcd_key`).
fn connect_options(cluster: &ClusterConfig) -> Result<ConnectOptions, ClusterError> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|source| ClusterError::File {
            what: format!("[cluster] {what} {}", path.display()),
            source,
        })
    };
    let Some(ca) = &cluster.etcd_ca else {
        return Ok(opts);
    };
    let mut tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read("etcd_ca", ca)?));
    if let (Some(cert), Some(key)) = (&cluster.etcd_cert, &cluster.etcd_key) {
        tls = tls.identity(etcd_client::Identity::from_pem(
            read("etcd_cert", cert)?,
            read("etcd_key", key)?,
        ));
    }
    Ok(opts.with_tls(tls))
}

/// A record of a node that left: DEAD, NODE_LOST.
pub fn lost_record(mut s: Sandbox, node: &str, now_ms: i64) -> Sandbox {
    let reason = EndReason::NodeLost;
    s.state = reason.state() as i32;
    s.end_reason = reason.code().to_owned();
    s.end_message = format!("node {node} left the cluster (its lease expired)");
    s.ended_unix_ms = now_ms;
    s.vmm_pid = 0;
    s
}

impl EtcdLedger {
    /// Connects to etcd (any of the endpoints; the client moves between them).
    pub async fn connect(
        cluster: &ClusterConfig,
        cfg: Arc<Config>,
        key: RecordKey,
    ) -> Result<Self, ClusterError> {
        let opts = connect_options(cluster)?;
        let client = Client::connect(&cluster.etcd, Some(opts))
            .await
            .map_err(|source| ClusterError::Connect {
                endpoints: cluster.etcd.clone(),
                source,
            })?;
        Ok(Self {
            client,
            prefix: cluster.prefix.clone(),
            node: cluster.node_name(),
            cfg,
            key,
            refused: Arc::default(),
        })
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.prefix)
    }

    fn kv(&self) -> etcd_client::KvClient {
        self.client.kv_client()
    }

    /// A range read, tried again on a transient failure (a member down, a leader change).
    async fn get(
        &self,
        key: String,
        prefix: bool,
    ) -> Result<etcd_client::GetResponse, etcd_client::Error> {
        let opts = prefix.then(|| GetOptions::new().with_prefix());
        retry(|| {
            let (mut kv, key, opts) = (self.kv(), key.clone(), opts.clone());
            async move { kv.get(key, opts).await }
        })
        .await
    }

    /// A transaction, tried again on a transient failure (each of ours is idempotent or
    /// guarded by its comparisons).
    async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, etcd_client::Error> {
        retry(|| {
            let (mut kv, txn) = (self.kv(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
    }

    /// Deletes `key`, tried again on a transient failure.
    async fn delete(&self, key: String) -> Result<(), etcd_client::Error> {
        retry(|| {
            let (mut kv, key) = (self.kv(), key.clone());
            async move { kv.delete(key, None).await }
        })
        .await
        .map(drop)
    }

    pub fn lease(&self) -> etcd_client::LeaseClient {
        self.client.lease_client()
    }

    /// The tag `node` holds, claiming a free one the first time: derived from its name,
    /// the next one on a clash.
    pub async fn claim_tag(&self, node: &str) -> Result<String, ClusterError> {
        let tags = self.tags().await?;
        if let Some((tag, _)) = tags.iter().find(|(_, n)| n.as_str() == node) {
            return Ok(tag.clone());
        }
        let seed = {
            use sha2::Digest as _;
            let d = sha2::Sha256::digest(node.as_bytes());
            u16::from_be_bytes([d[0], d[1]])
        };
        for i in 0..=u16::MAX {
            let tag = format!("{:04x}", seed.wrapping_add(i));
            if tags.contains_key(&tag) {
                continue;
            }
            let key = self.key(&format!("tags/{tag}"));
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, node, None)]);
            if self.txn(txn).await?.succeeded() {
                return Ok(tag);
            }
        }
        Err(ClusterError::NoFreeTag)
    }

    /// Every claimed tag and its node.
    pub async fn tags(
        &self,
    ) -> Result<std::collections::HashMap<String, String>, etcd_client::Error> {
        let prefix = self.key("tags/");
        let resp = self.get(prefix.clone(), true).await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let tag = kv.key_str().ok()?.strip_prefix(&prefix)?.to_owned();
                Some((tag, kv.value_str().ok()?.to_owned()))
            })
            .collect())
    }

    /// Writes this node's record under `lease`.
    pub async fn put_node(&self, info: &NodeInfo, lease: i64) -> Result<(), etcd_client::Error> {
        let value = records::seal(&self.key, info);
        let key = self.key(&format!("nodes/{}", info.name));
        retry(|| {
            let (mut kv, key, value) = (self.kv(), key.clone(), value.clone());
            async move {
                kv.put(key, value, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await
        .map(drop)
    }

    /// The nodes present now: those whose record carries the cluster key's signature (the
    /// others are logged, once per revision, and ignored).
    pub async fn nodes(&self) -> Result<Vec<NodeInfo>, etcd_client::Error> {
        let prefix = self.key("nodes/");
        let resp = self.get(prefix.clone(), true).await?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                let name = key.strip_prefix(&prefix).unwrap_or_default();
                match records::open(&self.key, name, kv.value()) {
                    Ok(n) => Some(n),
                    Err(e) => {
                        let first = self
                            .refused
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert((key.clone(), kv.mod_revision()));
                        if first {
                            warn!(key = %key, "a node record that is not believed (ignored): {e}");
                        }
                        None
                    }
                }
            })
            .collect())
    }

    /// The live sandboxes' records of `tenant` (all tenants: empty), with their keys and
    /// revisions, and the store's revision they were read at.
    async fn records(
        &self,
        tenant: &str,
    ) -> Result<(Vec<(String, i64, Sandbox)>, i64), etcd_client::Error> {
        let prefix = if tenant.is_empty() {
            self.key("sandboxes/")
        } else {
            self.key(&format!("sandboxes/{tenant}/"))
        };
        let resp = self.get(prefix, true).await?;
        let rev = resp.header().map_or(0, |h| h.revision());
        let records = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let s = Sandbox::decode(kv.value()).ok()?;
                // The prefix of tenant "acme" also covers "acme/x"'s keys: count only its own.
                if !tenant.is_empty() && s.tenant != tenant {
                    return None;
                }
                Some((kv.key_str().ok()?.to_owned(), kv.mod_revision(), s))
            })
            .collect();
        Ok((records, rev))
    }

    /// `tenant`'s live sandboxes across the cluster and their guest memory.
    pub async fn usage(&self, tenant: &str) -> ApiResult<(u32, u64)> {
        let (records, _) = self.records(tenant).await.map_err(unavailable)?;
        let memory = records
            .iter()
            .map(|(_, _, s)| u64::from(s.memory_mib))
            .sum();
        Ok((u32::try_from(records.len()).unwrap_or(u32::MAX), memory))
    }

    /// Counts `record` against its tenant's quota across the cluster and records it: the
    /// transaction holds only if none of the tenant's records changed since they were counted.
    async fn reserve_record(&self, record: &Sandbox) -> ApiResult<()> {
        let tenant = &record.tenant;
        let quota = self.cfg.quota_of(tenant);
        let prefix = self.key(&format!("sandboxes/{tenant}/"));
        for _ in 0..TXN_TRIES {
            let (records, rev) = self.records(tenant).await.map_err(unavailable)?;
            let count = records.len() as u64;
            if quota.max_sandboxes > 0 && count >= quota.max_sandboxes as u64 {
                return Err(ApiError::Quota {
                    tenant: tenant.clone(),
                    what: "sandboxes",
                    limit: quota.max_sandboxes as u64,
                    current: count,
                });
            }
            let memory: u64 = records
                .iter()
                .map(|(_, _, s)| u64::from(s.memory_mib))
                .sum();
            if quota.max_memory_mib > 0
                && memory + u64::from(record.memory_mib) > quota.max_memory_mib
            {
                return Err(ApiError::Quota {
                    tenant: tenant.clone(),
                    what: "memory_mib",
                    limit: quota.max_memory_mib,
                    current: memory,
                });
            }
            // Every key under the tenant's prefix is older than what was counted (an empty
            // range compares as revision 0): nobody added one meanwhile.
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(prefix.clone(), CompareOp::Less, rev + 1).with_prefix(),
                ])
                .and_then([TxnOp::put(
                    format!("{prefix}{}", record.id),
                    record.encode_to_vec(),
                    None,
                )]);
            if self.txn(txn).await.map_err(unavailable)?.succeeded() {
                return Ok(());
            }
        }
        Err(ApiError::ClusterUnavailable(format!(
            "tenant {tenant}'s sandboxes changed {TXN_TRIES} times while they were counted"
        )))
    }

    /// Removes the record of `id`.
    async fn remove_record(&self, tenant: &str, id: &str) -> Result<(), etcd_client::Error> {
        self.delete(self.key(&format!("sandboxes/{tenant}/{id}")))
            .await
    }

    /// Moves the records of the sandboxes of the nodes `gone` (by tag) to `lost/`; each move
    /// holds only if the record did not change meanwhile (several nodes may do it at once).
    pub async fn mark_lost(
        &self,
        gone: &std::collections::HashMap<String, String>,
        now_ms: i64,
    ) -> Result<usize, etcd_client::Error> {
        let (records, _) = self.records("").await?;
        let mut moved = 0;
        for (key, rev, s) in records {
            let Some(node) = crate::ids::tag_of(&s.id).and_then(|t| gone.get(t)) else {
                continue;
            };
            let lost = lost_record(s, node, now_ms);
            let txn = Txn::new()
                .when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)])
                .and_then([
                    TxnOp::delete(key, None),
                    TxnOp::put(
                        self.key(&format!("lost/{}", lost.id)),
                        lost.encode_to_vec(),
                        None,
                    ),
                ]);
            if self.txn(txn).await?.succeeded() {
                moved += 1;
            }
        }
        Ok(moved)
    }

    /// The record of `id` if its node left: from `lost/`, or its live record still waiting to
    /// be moved there (reported lost the same way).
    pub async fn lost(&self, id: &str, node: &str) -> ApiResult<Option<Sandbox>> {
        let resp = self
            .get(self.key(&format!("lost/{id}")), false)
            .await
            .map_err(unavailable)?;
        if let Some(kv) = resp.kvs().first() {
            return Ok(Sandbox::decode(kv.value()).ok());
        }
        let (records, _) = self.records("").await.map_err(unavailable)?;
        Ok(records
            .into_iter()
            .find(|(_, _, s)| s.id == id)
            .map(|(_, _, s)| lost_record(s, node, crate::ids::now_ms())))
    }

    /// The lost records of `tenant`.
    pub async fn lost_of(&self, tenant: &str) -> ApiResult<Vec<Sandbox>> {
        let resp = self
            .get(self.key("lost/"), true)
            .await
            .map_err(unavailable)?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| Sandbox::decode(kv.value()).ok())
            .filter(|s| s.tenant == tenant)
            .collect())
    }

    /// Deletes lost records older than `max_age_ms`.
    pub async fn prune_lost(&self, max_age_ms: i64, now_ms: i64) -> Result<(), etcd_client::Error> {
        let resp = self.get(self.key("lost/"), true).await?;
        for kv in resp.kvs() {
            let old =
                Sandbox::decode(kv.value()).map_or(true, |s| now_ms - s.ended_unix_ms > max_age_ms);
            if old {
                self.delete(kv.key_str().unwrap_or_default().to_owned())
                    .await?;
            }
        }
        Ok(())
    }

    /// A node (tag `tag`) that runs `live` now: its records are put back (and out of
    /// `lost/`), and its records of sandboxes it no longer runs go. Its own records win.
    pub async fn reconcile(&self, tag: &str, live: &[Sandbox]) -> Result<(), etcd_client::Error> {
        for s in live {
            let txn = Txn::new().and_then([
                TxnOp::put(
                    self.key(&format!("sandboxes/{}/{}", s.tenant, s.id)),
                    s.encode_to_vec(),
                    None,
                ),
                TxnOp::delete(self.key(&format!("lost/{}", s.id)), None),
            ]);
            self.txn(txn).await?;
        }
        let (records, _) = self.records("").await?;
        for (key, _, s) in records {
            let mine = crate::ids::tag_of(&s.id) == Some(tag);
            if mine && !live.iter().any(|l| l.id == s.id) {
                self.delete(key).await?;
            }
        }
        Ok(())
    }
}

impl Ledger for EtcdLedger {
    fn reserve<'a>(
        &'a self,
        record: &'a Sandbox,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ApiResult<()>> + Send + 'a>> {
        Box::pin(self.reserve_record(record))
    }

    fn release(&self, record: &Sandbox) {
        let (me, tenant, id) = (self.clone(), record.tenant.clone(), record.id.clone());
        tokio::spawn(async move {
            // A record left behind (etcd away now) goes at the next reconciliation.
            if let Err(e) = me.remove_record(&tenant, &id).await {
                warn!(sandbox = %id, "its cluster record stays until the next reconciliation: {e}");
            }
        });
    }

    fn node(&self) -> String {
        self.node.clone()
    }
}

/// Runs `op` until it succeeds, at most 5 times over about 1.5 s: etcd answers a client whose
/// member went away or whose leader changed with an error the next try does not meet.
async fn retry<T, F, Fut>(mut op: F) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut wait = Duration::from_millis(100);
    for _ in 0..4 {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                tracing::debug!("etcd: {e}; trying again in {wait:?}");
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        }
    }
    op().await
}

#[cfg(test)]
#[path = "ledger_tests.rs"]
mod tests;
