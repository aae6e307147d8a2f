//! A node's membership: its lease and record in etcd, kept current every second; the other
//! nodes as last read; what happens when one leaves (its sandboxes are reported lost) and when
//! this one comes back (it reconciles).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::frames::{BUDGET, Budget};
use super::ledger::EtcdLedger;
use super::peers::Peers;
use super::records::{Manifest, NodeInfo, TemplateEntry};
use super::{ClusterConfig, ClusterError, Placement};
use crate::daemon::Daemon;
use crate::ids;

/// How often the node's record is written and the others' read.
const TICK: Duration = Duration::from_secs(1);
/// How long a create this node placed counts towards its node's load (its node's record
/// shows it within a second).
const PLACED_WINDOW: Duration = Duration::from_secs(2);
/// How often, at the latest, records of sandboxes this node no longer runs are dropped and old
/// lost records pruned.
const RECONCILE_EVERY: Duration = Duration::from_secs(30);

/// What this node knows of the others.
#[derive(Debug, Default)]
struct Members {
    /// Present nodes by name (this one included once it registered).
    nodes: BTreeMap<String, NodeInfo>,
    /// Every tag ever claimed, and its node.
    tags: HashMap<String, String>,
    /// When this node placed creates on each node lately (counted for [`PLACED_WINDOW`],
    /// until that node's record shows them).
    placed: HashMap<String, Vec<Instant>>,
    /// When each node's record was last seen to change.
    changed: HashMap<String, Instant>,
}

/// This node in its cluster.
pub struct Cluster {
    pub name: String,
    pub tag: String,
    pub cfg: ClusterConfig,
    pub ledger: Arc<EtcdLedger>,
    pub peers: Peers,
    /// The digest of the node-to-node token (calls that carry it are other nodes').
    pub token_digest: crate::auth::TokenDigest,
    pub(super) daemon: Arc<Daemon>,
    members: Mutex<Members>,
    pub(super) manifests: Mutex<HashMap<String, Manifest>>,
    pub(super) fetching: tokio::sync::Mutex<()>,
    /// What the router may hold of requests at once.
    pub(super) buffers: Budget,
    started_unix_ms: i64,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("name", &self.name)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a call goes.
#[derive(Clone, Debug)]
pub enum Target {
    /// This node.
    Local,
    /// Another present node, at this address.
    Remote { name: String, address: String },
    /// A node that left (its name).
    Lost(String),
    /// No node claimed the id's tag.
    Unknown,
}

impl Cluster {
    /// Registers this node (its tag, lease and record), reconciles what it runs with etcd,
    /// and keeps its membership current from now on.
    pub async fn join(
        daemon: Arc<Daemon>,
        cfg: ClusterConfig,
        ledger: Arc<EtcdLedger>,
        token: String,
    ) -> Result<Arc<Self>, ClusterError> {
        let name = cfg.node_name();
        let tag = ledger.claim_tag(&name).await?;
        if !ids::set_node_tag(&tag) {
            return Err(ClusterError::TagTaken(tag));
        }
        let token_digest = crate::auth::digest(&token);
        let peers = Peers::new(&cfg, token)?;
        let me = Arc::new(Self {
            name: name.clone(),
            tag: tag.clone(),
            cfg,
            ledger,
            peers,
            token_digest,
            daemon,
            members: Mutex::default(),
            manifests: Mutex::default(),
            fetching: tokio::sync::Mutex::new(()),
            buffers: Budget::new(BUDGET),
            started_unix_ms: ids::now_ms(),
        });
        let lease = me.register().await?;
        me.refresh_members().await?;
        me.guard_endpoints().await;
        info!(node = %name, tag = %tag, "joined the cluster");
        tokio::spawn(me.clone().run(lease));
        tokio::spawn(me.clone().keep_manifests());
        Ok(me)
    }

    /// A new lease with this node's record, then its records reconciled.
    async fn register(&self) -> Result<i64, ClusterError> {
        let ttl = i64::try_from(self.cfg.lease_ttl_s).unwrap_or(5);
        let lease = self
            .ledger
            .lease()
            .grant(ttl, None)
            .await
            .map_err(ClusterError::Lease)?
            .id();
        self.ledger.put_node(&self.info(), lease).await?;
        self.reconcile().await?;
        Ok(lease)
    }

    /// Puts back the records of what this node runs and drops those of what it no longer runs.
    async fn reconcile(&self) -> Result<(), etcd_client::Error> {
        let live: Vec<_> = self
            .daemon
            .sandboxes
            .all()
            .iter()
            .map(|s| s.snapshot())
            .collect();
        self.ledger.reconcile(&self.tag, &live).await
    }

    /// This node's record now.
    pub fn info(&self) -> NodeInfo {
        let d = &self.daemon;
        let live = d.sandboxes.all();
        let manifests = lock(&self.manifests);
        let templates = d
            .templates
            .list()
            .into_iter()
            .map(|t| TemplateEntry {
                owner: t.record.tenant.clone(),
                name: crate::templates::reference(&t.record),
                id: t.record.id.clone(),
                // Empty while its manifest is being computed: placed here, not fetched yet.
                hash: manifests
                    .get(&t.record.id)
                    .map(|m| m.hash.clone())
                    .unwrap_or_default(),
                memory_mib: t.record.memory_mib,
            })
            .collect();
        NodeInfo {
            name: self.name.clone(),
            tag: self.tag.clone(),
            address: self.cfg.advertise.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            sandboxes: u32::try_from(live.len()).unwrap_or(u32::MAX),
            max_sandboxes: u32::try_from(d.cfg.max_sandboxes).unwrap_or(u32::MAX),
            committed_mib: live.iter().map(|s| s.memory_mib()).sum(),
            capacity_mib: d.cfg.committed_capacity_mib(),
            templates,
            started_unix_ms: self.started_unix_ms,
        }
    }

    /// Every second: the lease renewed (or a new one after it was lost), the record written
    /// when it changed, the others read, the sandboxes of nodes that left reported lost.
    async fn run(self: Arc<Self>, mut lease: i64) {
        let mut keeper = None;
        let mut written = self.info();
        let mut reconciled = Instant::now();
        loop {
            tokio::time::sleep(TICK).await;
            match self.renew(&mut keeper, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    warn!("this node's lease expired: registering again");
                    keeper = None;
                    match self.register().await {
                        Ok(l) => {
                            lease = l;
                            written = self.info();
                            reconciled = Instant::now();
                        }
                        Err(e) => warn!("registering again: {e}"),
                    }
                    continue;
                }
                Err(e) => {
                    warn!("renewing the lease: {e}");
                    continue;
                }
            }
            let now = self.info();
            // Also when etcd's copy is not what was written (deleted or overwritten: a record
            // that is not signed is read as none).
            if now != written || !self.shows(&written) {
                match self.ledger.put_node(&now, lease).await {
                    Ok(()) => written = now,
                    Err(e) => warn!("writing this node's record: {e}"),
                }
            }
            match self.refresh_members().await {
                Ok(gone) if !gone.is_empty() => {
                    match self.ledger.mark_lost(&gone, ids::now_ms()).await {
                        Ok(n) if n > 0 => {
                            warn!(nodes = ?gone.values().collect::<Vec<_>>(), sandboxes = n, "nodes left the cluster: their sandboxes are reported NODE_LOST")
                        }
                        Ok(_) => {}
                        Err(e) => warn!("reporting lost sandboxes: {e}"),
                    }
                }
                Ok(_) => {}
                Err(e) => warn!("reading the cluster's nodes: {e}"),
            }
            self.guard_endpoints().await;
            if reconciled.elapsed() >= RECONCILE_EVERY {
                reconciled = Instant::now();
                if let Err(e) = self.reconcile().await {
                    warn!("reconciling: {e}");
                }
                let retention = i64::try_from(self.daemon.cfg.record_retention_s)
                    .unwrap_or(i64::MAX / 2000)
                    .saturating_mul(1000);
                if let Err(e) = self.ledger.prune_lost(retention, ids::now_ms()).await {
                    warn!("pruning lost records: {e}");
                }
            }
        }
    }

    /// Reads the present nodes and the tags; answers the tags whose nodes are not present
    /// (by tag, their node's name).
    async fn refresh_members(&self) -> Result<HashMap<String, String>, etcd_client::Error> {
        let nodes = self.ledger.nodes().await?;
        let tags = self.ledger.tags().await?;
        let mut guard = lock(&self.members);
        let m = &mut *guard;
        let fresh: BTreeMap<String, NodeInfo> =
            nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
        let now = Instant::now();
        for (name, n) in &fresh {
            if m.nodes.get(name) != Some(n) {
                m.changed.insert(name.clone(), now);
            }
        }
        m.nodes = fresh;
        m.tags = tags;
        let gone = m
            .tags
            .iter()
            .filter(|(_, node)| !m.nodes.contains_key(*node))
            .map(|(t, n)| (t.clone(), n.clone()))
            .collect();
        Ok(gone)
    }

    /// Whether etcd, as last read, holds `record` as this node's.
    fn shows(&self, record: &NodeInfo) -> bool {
        lock(&self.members).nodes.get(&self.name) == Some(record)
    }

    /// Puts etcd's endpoints and every present node's address out of the sandboxes' reach
    /// (`net::NeverReach`): a guest must not speak to the cluster's control plane.
    async fn guard_endpoints(&self) {
        let mut urls = self.cfg.etcd.clone();
        urls.extend(self.nodes().into_iter().map(|n| n.address));
        let egress = &self.daemon.sandboxes.egress;
        egress.never_reach.set_cluster(urls).await;
    }

    /// The present nodes.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        lock(&self.members).nodes.values().cloned().collect()
    }

    /// Where a call on the sandbox or execution `id` goes.
    pub fn target_of(&self, id: &str) -> Target {
        let Some(tag) = ids::tag_of(id) else {
            return Target::Unknown;
        };
        if tag == self.tag {
            return Target::Local;
        }
        let m = lock(&self.members);
        let Some(node) = m.tags.get(tag) else {
            return Target::Unknown;
        };
        match m.nodes.get(node) {
            Some(n) => Target::Remote {
                name: n.name.clone(),
                address: n.address.clone(),
            },
            None => Target::Lost(node.clone()),
        }
    }

    /// The nodes a create of `template` for `owner` (the tenant as a template owner) tries,
    /// in order: those with room, by the placement policy; a node holding the template before
    /// one that would fetch it when the load is equal.
    pub fn placement(&self, owner: &str, template: &str) -> Vec<Target> {
        let m = lock(&self.members);
        let memory = m
            .nodes
            .values()
            .find_map(|n| n.template_for(owner, template))
            .map_or(0, |t| u64::from(t.memory_mib));
        let mut candidates: Vec<(u32, bool, &NodeInfo)> = m
            .nodes
            .values()
            .map(|n| {
                // Placed since its record last changed (a record that changed shows them).
                let seen = m.changed.get(&n.name).copied();
                let recent = m.placed.get(&n.name).map_or(0, |at| {
                    at.iter()
                        .filter(|t| t.elapsed() < PLACED_WINDOW && seen.is_none_or(|c| **t > c))
                        .count()
                });
                let load = n.sandboxes + u32::try_from(recent).unwrap_or(u32::MAX);
                (load, n.template_for(owner, template).is_some(), n)
            })
            .filter(|(load, _, n)| {
                let mut n = (*n).clone();
                n.sandboxes = *load;
                n.has_room(memory)
            })
            .collect();
        match self.cfg.placement {
            Placement::Spread => {
                candidates.sort_by_key(|(load, has, n)| (*load, !*has, n.name.clone()))
            }
            Placement::Pack => {
                candidates.sort_by_key(|(load, has, n)| (!*has, u32::MAX - *load, n.name.clone()))
            }
        }
        candidates
            .into_iter()
            .map(|(_, _, n)| self.target_named(&n.name, &n.address))
            .collect()
    }

    /// Notes a create placed on `node`, counted until its next record is read.
    pub fn placed_on(&self, node: &str) {
        let mut m = lock(&self.members);
        let at = m.placed.entry(node.to_owned()).or_default();
        at.retain(|t| t.elapsed() < PLACED_WINDOW);
        at.push(Instant::now());
    }

    fn target_named(&self, name: &str, address: &str) -> Target {
        if name == self.name {
            Target::Local
        } else {
            Target::Remote {
                name: name.to_owned(),
                address: address.to_owned(),
            }
        }
    }

    /// Every present node as a target (this one first).
    pub fn everyone(&self) -> Vec<Target> {
        let m = lock(&self.members);
        let mut all = vec![Target::Local];
        all.extend(
            m.nodes
                .values()
                .filter(|n| n.name != self.name)
                .map(|n| self.target_named(&n.name, &n.address)),
        );
        all
    }
}

impl Cluster {
    /// Renews `lease`, trying again at once with a new keep-alive stream when one fails (the
    /// etcd member it went to may be gone): true while it lives, false once it expired.
    async fn renew(
        &self,
        keeper: &mut Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
        lease: i64,
    ) -> Result<bool, ClusterError> {
        let mut last = String::new();
        for _ in 0..4 {
            if keeper.is_none() {
                let opened =
                    tokio::time::timeout(RENEW_TIMEOUT, self.ledger.lease().keep_alive(lease))
                        .await;
                match opened {
                    Ok(Ok(k)) => *keeper = Some(k),
                    Ok(Err(e)) => last = e.to_string(),
                    Err(_) => last = "no keep-alive stream within 1 s".into(),
                }
            }
            if let Some((k, stream)) = keeper.as_mut() {
                match renew_once(k, stream).await {
                    Ok(alive) => return Ok(alive),
                    Err(e) => {
                        last = e.to_string();
                        *keeper = None;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        Err(ClusterError::Renewal(last))
    }
}

/// How long one renewal may take before another stream is tried.
const RENEW_TIMEOUT: Duration = Duration::from_secs(1);

/// One lease renewal on `stream`: true while it lives, false once it expired.
async fn renew_once(
    keeper: &mut etcd_client::LeaseKeeper,
    stream: &mut etcd_client::LeaseKeepAliveStream,
) -> Result<bool, ClusterError> {
    keeper.keep_alive().await?;
    match tokio::time::timeout(RENEW_TIMEOUT, stream.message()).await {
        Ok(Ok(Some(resp))) => Ok(resp.ttl() > 0),
        Ok(Ok(None)) => Err(ClusterError::Renewal("the keep-alive stream ended".into())),
        Ok(Err(e)) => Err(ClusterError::Etcd(e)),
        Err(_) => Err(ClusterError::Renewal(
            "no keep-alive answer within 1 s".into(),
        )),
    }
}
