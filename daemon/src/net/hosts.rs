//! The addresses the proxy guards beyond the policy's ranges: the host's own
//! ([`HostAddrs`]: only a CIDR rule of exactly the address opens one) and those no sandbox may
//! ever reach ([`NeverReach`]: the operator's `[network] never_reach`, and in cluster mode
//! the cluster's etcd endpoints and its nodes, which the cluster hands over as it learns them).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use airlock_egress::IpNet;
use airlock_egress::policy::canonical;
use tracing::warn;

pub use airlock_egress::host::HostAddrs;

/// Addresses no sandbox may reach, whatever its policy.
#[derive(Debug, Default)]
pub struct NeverReach {
    /// `[network] never_reach`.
    configured: Vec<IpNet>,
    /// The cluster's endpoints: the URLs last handed over, when they were resolved, and the
    /// addresses they resolved to.
    cluster: RwLock<Cluster>,
}

#[derive(Debug, Default)]
struct Cluster {
    urls: Vec<String>,
    resolved: Option<Instant>,
    addrs: Arc<HashSet<IpAddr>>,
}

impl NeverReach {
    /// The cluster's names are resolved again at most this often (an address may move).
    const REFRESH: Duration = Duration::from_secs(60);
    /// How long one name may take to resolve.
    const LOOKUP: Duration = Duration::from_secs(2);

    /// The operator's list: addresses and CIDRs.
    pub fn new(list: &[String]) -> Result<Self, airlock_egress::PolicyError> {
        let configured = list
            .iter()
            .map(|s| airlock_egress::policy::parse_net(s.trim()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            configured,
            cluster: RwLock::default(),
        })
    }

    /// Whether `addr` (IPv4-mapped IPv6 judged as IPv4) is out of every sandbox's reach.
    pub fn contains(&self, addr: IpAddr) -> bool {
        let addr = canonical(addr);
        self.configured.iter().any(|n| n.contains(&addr))
            || self
                .cluster
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .addrs
                .contains(&addr)
    }

    /// The cluster's endpoints (etcd's client URLs and the nodes' addresses, `http(s)://HOST:
    /// PORT`): their hosts' addresses become unreachable. Resolved again when the list
    /// changes or every [`Self::REFRESH`]; a name that does not resolve keeps the addresses it
    /// had (a resolver fault must not open them).
    pub async fn set_cluster(&self, mut urls: Vec<String>) {
        urls.sort();
        urls.dedup();
        let (previous, fresh) = {
            let c = self.cluster.read().unwrap_or_else(|e| e.into_inner());
            let fresh = c.urls == urls && c.resolved.is_some_and(|t| t.elapsed() < Self::REFRESH);
            (c.addrs.clone(), fresh)
        };
        if fresh {
            return;
        }
        let mut addrs = HashSet::new();
        let mut failed = false;
        for u in &urls {
            match Self::resolve(u).await {
                Some(found) => addrs.extend(found),
                None => failed = true,
            }
        }
        if failed {
            addrs.extend(previous.iter().copied());
        }
        let mut c = self.cluster.write().unwrap_or_else(|e| e.into_inner());
        *c = Cluster {
            urls,
            resolved: Some(Instant::now()),
            addrs: Arc::new(addrs),
        };
    }

    /// The addresses of a URL's host; `None` if it names none or it did not resolve.
    async fn resolve(url: &str) -> Option<Vec<IpAddr>> {
        let parsed = url::Url::parse(url).ok();
        let Some((host, port)) = parsed.as_ref().and_then(|u| {
            let host = u.host_str()?.trim_start_matches('[').trim_end_matches(']');
            Some((host.to_owned(), u.port_or_known_default().unwrap_or(0)))
        }) else {
            warn!(url, "a cluster endpoint that names no host: not guarded");
            return None;
        };
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Some(vec![canonical(ip)]);
        }
        let lookup = tokio::net::lookup_host((host.as_str(), port));
        match tokio::time::timeout(Self::LOOKUP, lookup).await {
            Ok(Ok(found)) => Some(found.map(|a| canonical(a.ip())).collect()),
            _ => {
                warn!(
                    url,
                    "resolving a cluster endpoint failed: its last addresses stay guarded"
                );
                None
            }
        }
    }
}
