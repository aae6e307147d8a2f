//! Cluster mode: several `airlockd` nodes behind one API, coordinated through etcd (off unless
//! `[cluster] etcd` names its endpoints; a single host needs nothing of this).
//!
//! - **Membership** (`members.rs`): each node holds an etcd lease and keeps its record under
//!   it (`PREFIX/nodes/NAME`: address, version, capacity, the templates it holds with their
//!   content hashes), refreshed every second; a node that stops renewing it is gone after
//!   `lease_ttl_s`. Each node claims a 4-hex-digit tag once (`PREFIX/tags/TAG`); its sandbox
//!   and execution ids start with it, so any node knows from an id where it lives.
//! - **Records and quotas** (`ledger.rs`): every live sandbox has a record
//!   (`PREFIX/sandboxes/TENANT/ID`), written at admission in an etcd transaction that counts
//!   the tenant's records across the cluster against its quota, removed at its end. The
//!   records of a node that is gone move to `PREFIX/lost/ID` (state DEAD, `NODE_LOST`); a node
//!   that comes back puts back what it still runs (its own records win) and drops what it no
//!   longer runs.
//! - **Routing** (`route.rs`): a tower layer in front of the gRPC service forwards a call on a
//!   sandbox or an execution to its node, places CreateSandbox (spread or pack, the next node
//!   on CAPACITY_EXHAUSTED), gathers ListSandboxes and ListTemplates from every node and sends
//!   DeleteTemplate to each. Node-to-node calls carry the cluster token and the caller's
//!   tenant (`peers.rs`).
//! - **Templates** (`templates.rs`): a node asked for a template it lacks fetches it from a
//!   node that holds it, verifies every file's SHA-256 and the manifest's hash published in
//!   etcd, and imports it.
//! - **Records** (`records.rs`): the data the others exchange, below them all: a node's
//!   record, its template entries, a template's manifest and content hash.

mod frames;
mod ledger;
mod members;
mod peers;
mod records;
mod route;
mod templates;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

pub use ledger::EtcdLedger;
pub use members::Cluster;
pub use records::NodeInfo;
pub use route::RouteLayer;

/// Why this node cannot join or stay in its cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A `[cluster]` setting that cannot work (the message names it).
    #[error("{0}")]
    Setting(String),
    /// The token file or the CA file.
    #[error("{what}: {source}")]
    File {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// etcd cannot be reached at any of its endpoints.
    #[error("etcd {endpoints:?}: {source}")]
    Connect {
        endpoints: Vec<String>,
        #[source]
        source: etcd_client::Error,
    },
    /// etcd refused or failed a request.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd granted no lease.
    #[error("etcd lease: {0}")]
    Lease(#[source] etcd_client::Error),
    /// Every 4-hex-digit tag is taken.
    #[error("no node tag is free")]
    NoFreeTag,
    /// This process took another tag already.
    #[error("node tag {0}: another tag was set already")]
    TagTaken(String),
    /// The sandboxes' ledger was set before (joined twice).
    #[error("the cluster's ledger was set twice")]
    JoinedTwice,
    /// The lease could not be renewed (why the last try failed).
    #[error("{0}")]
    Renewal(String),
}

/// `[cluster]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// etcd's client URLs (`http://HOST:PORT`); empty: cluster mode is off.
    pub etcd: Vec<String>,
    /// This node's name, unique in the cluster (default: the host name).
    pub node: String,
    /// Where the other nodes reach this node's gRPC service: one of its `listen` TCP
    /// addresses, as `http://HOST:PORT` (`https://` with `[tls]`).
    pub advertise: String,
    /// The secret node-to-node calls carry (the same file on every node; at least 32
    /// characters).
    pub token_file: Option<PathBuf>,
    /// Where CreateSandbox goes: `spread` (the least loaded node) or `pack` (the fullest node
    /// that has room).
    pub placement: Placement,
    /// How long a node that stopped renewing its lease counts as present (seconds).
    pub lease_ttl_s: u64,
    /// The key prefix in etcd (one etcd can hold several clusters).
    pub prefix: String,
    /// The CA of the other nodes' TLS certificates (`https://` addresses).
    pub ca: Option<PathBuf>,
    /// The CA of etcd's server certificates (`https://` endpoints).
    pub etcd_ca: Option<PathBuf>,
    /// This node's client certificate for etcd (PEM; etcd's `--client-cert-auth`).
    pub etcd_cert: Option<PathBuf>,
    /// The key of `etcd_cert` (PEM).
    pub etcd_key: Option<PathBuf>,
    /// Allows plain `http://` to etcd and between nodes beyond loopback (both then belong
    /// on a network of their own: the cluster token and etcd's records cross it in clear).
    pub allow_plaintext: bool,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            etcd: Vec::new(),
            node: String::new(),
            advertise: String::new(),
            token_file: None,
            placement: Placement::Spread,
            lease_ttl_s: 5,
            prefix: "/airlock/".into(),
            ca: None,
            etcd_ca: None,
            etcd_cert: None,
            etcd_key: None,
            allow_plaintext: false,
        }
    }
}

/// How CreateSandbox picks a node.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    #[default]
    Spread,
    Pack,
}

impl ClusterConfig {
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty()
    }

    /// This node's name: `node`, else the host name.
    pub fn node_name(&self) -> String {
        if !self.node.is_empty() {
            return self.node.clone();
        }
        let mut buf = [0u8; 256];
        // SAFETY: gethostname(2) writes at most `buf.len()` bytes into the live buffer.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        match (rc, std::str::from_utf8(&buf[..end])) {
            (0, Ok(name)) if !name.is_empty() => name.to_owned(),
            _ => "airlockd".into(),
        }
    }

    /// Checks that etcd's traffic and node-to-node calls cross the network only over TLS
    /// (plain `http://` on loopback, or with `allow_plaintext`), and that TLS has its files.
    fn check_transport(&self) -> Result<(), ClusterError> {
        let bad = |m: String| Err(ClusterError::Setting(m));
        let clear = |url: &str| url.starts_with("http://") && !is_loopback(url);
        if !self.allow_plaintext {
            if let Some(url) = self.etcd.iter().find(|u| clear(u)) {
                return bad(format!(
                    "[cluster] etcd {url:?}: plain http beyond loopback carries every record \
                     in clear; use https:// with etcd_ca, etcd_cert and etcd_key (or set \
                     allow_plaintext on a network of etcd's own)"
                ));
            }
            if clear(&self.advertise) {
                return bad(format!(
                    "[cluster] advertise {:?}: node-to-node calls carry the cluster token and \
                     tenants' calls; use https:// with [tls] and [cluster] ca (or set \
                     allow_plaintext on a network of the nodes' own)",
                    self.advertise
                ));
            }
        }
        if self.etcd.iter().any(|u| u.starts_with("https://")) && self.etcd_ca.is_none() {
            return bad("[cluster] etcd_ca: https:// endpoints need etcd's CA".into());
        }
        if self.etcd_cert.is_some() != self.etcd_key.is_some() {
            return bad("[cluster] etcd_cert and etcd_key: both or neither".into());
        }
        if self.advertise.starts_with("https://") && self.ca.is_none() {
            return bad("[cluster] ca: https:// nodes need the CA of their certificates".into());
        }
        Ok(())
    }

    /// Checks the settings and reads the cluster token.
    pub fn check(&self) -> Result<String, ClusterError> {
        let name = self.node_name();
        if !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
            || name.len() > 63
        {
            return Err(ClusterError::Setting(format!(
                "[cluster] node {name:?}: letters, digits, '.', '_' and '-', at most 63"
            )));
        }
        if !(self.advertise.starts_with("http://") || self.advertise.starts_with("https://")) {
            return Err(ClusterError::Setting(
                "[cluster] advertise: where the other nodes reach this one, http(s)://HOST:PORT"
                    .into(),
            ));
        }
        self.check_transport()?;
        if self.lease_ttl_s < 2 {
            return Err(ClusterError::Setting(
                "[cluster] lease_ttl_s: at least 2".into(),
            ));
        }
        if !self.prefix.starts_with('/') || !self.prefix.ends_with('/') {
            return Err(ClusterError::Setting(
                "[cluster] prefix: starts and ends with '/'".into(),
            ));
        }
        let path = self.token_file.as_ref().ok_or_else(|| {
            ClusterError::Setting(
                "[cluster] token_file: the node-to-node secret is required".into(),
            )
        })?;
        let token = std::fs::read_to_string(path)
            .map_err(|source| ClusterError::File {
                what: format!("[cluster] token_file {}", path.display()),
                source,
            })?
            .trim()
            .to_owned();
        if token.len() < 32 {
            return Err(ClusterError::Setting(format!(
                "[cluster] token_file {}: at least 32 characters",
                path.display()
            )));
        }
        Ok(token)
    }
}

/// Whether `url` (`SCHEME://HOST:PORT`) names this host: `localhost` or a loopback address.
fn is_loopback(url: &str) -> bool {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return false;
    };
    let host = uri.host().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub use crate::auth::FORWARDED_TENANT;

/// Joins `daemon` to the cluster `cfg` describes; the returned handle is the routing layer's
/// and the service's.
pub async fn join(
    daemon: &Arc<crate::daemon::Daemon>,
    cfg: ClusterConfig,
) -> Result<Arc<Cluster>, ClusterError> {
    let token = cfg.check()?;
    let key = records::RecordKey::from_token(&token);
    let ledger = Arc::new(EtcdLedger::connect(&cfg, daemon.cfg.clone(), key).await?);
    let cluster = Cluster::join(daemon.clone(), cfg, ledger.clone(), token).await?;
    daemon
        .sandboxes
        .set_ledger(ledger)
        .map_err(|_| ClusterError::JoinedTwice)?;
    Ok(cluster)
}

/// A node's record as the API shows it.
pub fn to_proto(n: NodeInfo) -> airlock_api::v1::Node {
    airlock_api::v1::Node {
        name: n.name,
        address: n.address,
        version: n.version,
        sandboxes: n.sandboxes,
        max_sandboxes: n.max_sandboxes,
        committed_mib: n.committed_mib,
        capacity_mib: n.capacity_mib,
        // Those the other nodes can fetch (their content hash is known).
        templates: n
            .templates
            .into_iter()
            .filter(|t| !t.hash.is_empty())
            .map(|t| format!("{}/{}", t.owner, t.name))
            .collect(),
        started_unix_ms: n.started_unix_ms,
        tag: n.tag,
    }
}

/// This daemon as a node outside cluster mode.
pub fn local_node(d: &crate::daemon::Daemon) -> airlock_api::v1::Node {
    let live = d.sandboxes.all();
    airlock_api::v1::Node {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        sandboxes: u32::try_from(live.len()).unwrap_or(u32::MAX),
        max_sandboxes: u32::try_from(d.cfg.max_sandboxes).unwrap_or(u32::MAX),
        committed_mib: live.iter().map(|s| s.memory_mib()).sum(),
        capacity_mib: d.cfg.committed_capacity_mib(),
        templates: d
            .templates
            .list()
            .into_iter()
            .map(|t| format!("{}/{}", t.record.tenant, t.record.name))
            .collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn settings(dir: &std::path::Path) -> ClusterConfig {
        let token = dir.join("token");
        std::fs::write(&token, "x".repeat(40)).unwrap();
        ClusterConfig {
            etcd: vec!["https://10.0.0.1:2379".into()],
            node: "node-a".into(),
            advertise: "https://10.0.0.11:7443".into(),
            token_file: Some(token),
            ca: Some(dir.join("ca.pem")),
            etcd_ca: Some(dir.join("etcd-ca.pem")),
            etcd_cert: Some(dir.join("node.pem")),
            etcd_key: Some(dir.join("node.key")),
            ..Default::default()
        }
    }

    /// Issue 37, item 3: settings that would put etcd's traffic or the cluster token on the
    /// network in clear (or TLS without what it needs) are refused at start.
    #[test]
    fn settings_that_would_cross_the_network_in_clear_are_refused() {
        let dir = std::env::temp_dir().join(format!("airlock-cluster-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = settings(&dir);
        good.check().unwrap();
        let refused = |c: ClusterConfig, why: &str| {
            let err = c.check().unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        };
        let mut c = settings(&dir);
        c.etcd = vec!["http://10.0.0.1:2379".into()];
        refused(c.clone(), "allow_plaintext");
        c.allow_plaintext = true;
        c.check().unwrap();
        let mut c = settings(&dir);
        c.advertise = "http://10.0.0.11:7443".into();
        refused(c.clone(), "allow_plaintext");
        // Loopback needs no TLS (one host, the tests).
        c.advertise = "http://127.0.0.1:7443".into();
        c.etcd = vec![
            "http://127.0.0.1:2379".into(),
            "http://localhost:2380".into(),
        ];
        c.check().unwrap();
        let mut c = settings(&dir);
        c.etcd_ca = None;
        refused(c, "etcd_ca");
        let mut c = settings(&dir);
        c.etcd_key = None;
        refused(c, "etcd_key");
        let mut c = settings(&dir);
        c.ca = None;
        refused(c, "[cluster] ca");
    }
}
