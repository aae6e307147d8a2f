//! Every sandbox's network, from the host's side.
//!
//! Each VMM lives in a network namespace of its own (the jail makes it, with `lo` and the TAP
//! `tap0` holding the guest's gateway address, 100.96.0.1/30). Nothing routes out of it. The
//! only ways out are two sockets the daemon owns *inside* it ([`NetExits`]): a transparent TCP
//! proxy on 100.96.0.1:[`PROXY_PORT`] and a DNS server on 100.96.0.1:53. A static nftables
//! ruleset ([`RULESET`]) in the namespace redirects every TCP connection from the guest to the
//! proxy (which reads the original destination with `SO_ORIGINAL_DST`) and every DNS query to
//! the server, and drops everything else the guest sends to the host side (UDP, ICMP, other
//! ports); nothing is forwarded. The proxy and the DNS server decide by the sandbox's egress
//! policy ([`airlock_egress::Policy`]) and log every attempt ([`SandboxNet`]); allowed
//! connections leave from the daemon's own namespace.
//!
//! The namespace, its ruleset and its sockets are made when the VMM process starts (warm pool
//! processes: off the create path); a restarted daemon opens the sockets again in the
//! namespaces of the VMMs it adopts (through their pidfds). Every guest has the same address,
//! route and resolver (each in its own namespace), so nothing changes at restore.

mod broker;
mod dns;
mod expose;
mod hosts;
mod http;
mod inject;
mod proxy;

pub use hosts::{HostAddrs, NeverReach};

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use airlock_api::v1::{EgressEvent, EgressRule, NetworkPolicy, egress_rule};
use airlock_egress::{Policy, Rule};
use serde::Deserialize;

use crate::error::{ApiError, ApiResult, StartError};
use crate::events::{self, Query, SandboxLog};
use crate::metrics::Metrics;
use crate::store::Store;

/// The port the transparent proxy listens on, on the gateway address.
pub const PROXY_PORT: u16 = 15001;
/// DNS, on the gateway address.
pub const DNS_PORT: u16 = 53;

/// The firewall of every sandbox namespace (`nft -f`, in the namespace). The guest's TCP goes
/// to the proxy and its DNS to the server, whatever address it used; the input chain takes
/// only those two from the TAP, and the guest's answers on connections the daemon opened to
/// it (exposed ports); nothing is forwarded (there is no route out either).
pub const RULESET: &str = r#"table inet airlock {
  chain prerouting {
    type nat hook prerouting priority dstnat; policy accept;
    iifname "tap0" meta l4proto tcp redirect to :15001
    iifname "tap0" udp dport 53 redirect to :53
  }
  chain input {
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
    iifname "tap0" tcp dport 15001 accept
    iifname "tap0" udp dport 53 accept
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
  }
}
"#;

/// The sockets the daemon owns inside a sandbox's namespace, and the namespace (to open
/// connections to the guest from inside it: exposed ports).
#[derive(Debug)]
pub struct NetExits {
    pub proxy: std::net::TcpListener,
    pub dns: std::net::UdpSocket,
    pub netns: std::os::fd::OwnedFd,
}

/// In a new sandbox namespace (on the thread that made it): the ruleset, then the exits.
pub fn prepare(nft: &Path) -> io::Result<NetExits> {
    apply_ruleset(nft)?;
    open_exits()
}

fn apply_ruleset(nft: &Path) -> io::Result<()> {
    // The child starts from this thread, so it runs in this thread's namespace.
    let mut child = std::process::Command::new(nft)
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", nft.display())))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(RULESET.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "nft -f: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Binds the exits on the gateway address of the calling thread's namespace.
fn open_exits() -> io::Result<NetExits> {
    let gw = airlock_proto::GATEWAY_IPV4;
    let proxy = std::net::TcpListener::bind((gw, PROXY_PORT))?;
    proxy.set_nonblocking(true)?;
    let dns = std::net::UdpSocket::bind((gw, DNS_PORT))?;
    dns.set_nonblocking(true)?;
    let netns = std::fs::File::open("/proc/thread-self/ns/net")?.into();
    Ok(NetExits { proxy, dns, netns })
}

/// The exits again, in the namespace of the process `pidfd` refers to (an adopted VMM's: the
/// previous daemon's sockets went with it; the ruleset stays with the namespace).
pub fn reopen(pidfd: std::os::fd::BorrowedFd<'_>) -> io::Result<NetExits> {
    airlock_netcfg::in_netns(pidfd, open_exits)
}

/// `nft` as configured, else the first on `$PATH`, else `/usr/sbin/nft`.
pub fn find_nft(configured: Option<&Path>) -> io::Result<PathBuf> {
    if let Some(p) = configured {
        return Ok(p.to_owned());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("nft"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "sandbox networks need nftables' `nft` (apt-get install nftables), or [jail] \
                 network = false",
            )
        })
}

// ---- settings and policies ----

/// `[network]`: what every sandbox network shares.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// A static host map, consulted before DNS: name → IPv4 addresses. The operator's word:
    /// an exact domain rule for such a name reaches its addresses even in a guarded range.
    pub hosts: BTreeMap<String, Vec<Ipv4Addr>>,
    /// The ceiling of tenants without one of their own (`[tenants.NAME.egress_ceiling]`).
    pub default_ceiling: PolicyConfig,
    /// DNS queries a sandbox may send per second, and in a burst; more are refused.
    pub dns_per_second: u32,
    pub dns_burst: u32,
    /// How long the proxy waits for a connection's first bytes (TLS ClientHello, HTTP
    /// request) when its policy needs the name, and for an upstream to accept.
    pub sniff_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// Connections through the proxy at once, per sandbox; more are reset.
    pub max_connections: usize,
    /// Egress log events kept per sandbox; more are counted, not kept.
    pub max_log_events: u64,
    /// The host address exposed ports listen on (each on a port of its own), and their TTL
    /// when a request gives none, and its cap (seconds).
    pub expose_listen: IpAddr,
    pub expose_default_ttl_s: u32,
    pub expose_max_ttl_s: u32,
    /// CAs (a PEM file) the proxy trusts, besides the public roots, when it speaks TLS to a
    /// host for a secret brokered over HTTPS (an internal API's CA).
    pub broker_upstream_ca: Option<PathBuf>,
    /// Addresses and CIDRs no sandbox may reach whatever its policy (no rule opens them: not
    /// even a CIDR rule of exactly that address), besides the cluster's etcd and peers, which
    /// are never reachable in cluster mode: a control plane, a database, a bastion.
    pub never_reach: Vec<String>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            hosts: BTreeMap::new(),
            default_ceiling: PolicyConfig {
                allow_internet: true,
                allow: Vec::new(),
            },
            dns_per_second: 20,
            dns_burst: 100,
            sniff_timeout_ms: 5_000,
            connect_timeout_ms: 10_000,
            max_connections: 256,
            max_log_events: 10_000,
            expose_listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
            expose_default_ttl_s: 3600,
            expose_max_ttl_s: 24 * 3600,
            broker_upstream_ca: None,
            never_reach: Vec::new(),
        }
    }
}

/// A policy in the settings (a tenant's ceiling).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    pub allow_internet: bool,
    pub allow: Vec<RuleConfig>,
}

/// One rule in the settings: `{ domain = "*.example.com", ports = [443] }` or `{ cidr =
/// "10.1.0.0/16" }`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuleConfig {
    pub domain: Option<String>,
    pub cidr: Option<String>,
    pub ports: Vec<u16>,
}

impl PolicyConfig {
    pub fn to_policy(&self) -> ApiResult<Policy> {
        let p = NetworkPolicy {
            allow_internet: self.allow_internet,
            allow: self
                .allow
                .iter()
                .map(|r| EgressRule {
                    target: match (&r.domain, &r.cidr) {
                        (Some(d), None) => Some(egress_rule::Target::Domain(d.clone())),
                        (None, Some(c)) => Some(egress_rule::Target::Cidr(c.clone())),
                        _ => None,
                    },
                    ports: r.ports.iter().map(|p| u32::from(*p)).collect(),
                })
                .collect(),
        };
        policy_of(&p)
    }
}

/// A request's policy, checked.
pub fn policy_of(p: &NetworkPolicy) -> ApiResult<Policy> {
    let bad = |m: String| ApiError::InvalidArgument(format!("network policy: {m}"));
    if p.allow_internet {
        if !p.allow.is_empty() {
            return Err(bad(
                "allow_internet already allows every public address; give rules or \
                 allow_internet, not both"
                    .into(),
            ));
        }
        return Ok(Policy::AllowInternet);
    }
    if p.allow.is_empty() {
        return Ok(Policy::DenyAll);
    }
    let mut rules = Vec::with_capacity(p.allow.len());
    for r in &p.allow {
        let ports = r
            .ports
            .iter()
            .map(|p| u16::try_from(*p).map_err(|_| bad(format!("port {p} is not a port"))))
            .collect::<ApiResult<Vec<u16>>>()?;
        let rule = match &r.target {
            Some(egress_rule::Target::Domain(d)) => Rule::domain(d, &ports),
            Some(egress_rule::Target::Cidr(c)) => Rule::cidr(c, &ports),
            None => return Err(bad("a rule needs a domain or a cidr".into())),
        }
        .map_err(|e| bad(e.to_string()))?;
        rules.push(rule);
    }
    let policy = Policy::Rules(rules);
    policy.validate().map_err(|e| bad(e.to_string()))?;
    Ok(policy)
}

// ---- the daemon-wide part ----

/// What every sandbox network shares.
#[derive(Debug)]
pub struct Egress {
    pub cfg: NetworkConfig,
    /// Tenants' ceilings, parsed.
    ceilings: HashMap<String, Policy>,
    default_ceiling: Policy,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    /// The host's own addresses, which no policy opens but a CIDR rule of exactly one.
    pub host_addrs: HostAddrs,
    /// Addresses no policy opens: `never_reach`, and the cluster's etcd and peers.
    pub never_reach: NeverReach,
    /// The package proxy, which every sandbox reaches at its gateway whatever its egress
    /// policy (its own policy decides there).
    pub packages: Arc<crate::pkg::Packages>,
    /// The TLS client of secrets brokered over HTTPS.
    broker_tls: Arc<rustls::ClientConfig>,
}

impl Egress {
    pub fn new(
        cfg: NetworkConfig,
        tenant_ceilings: &BTreeMap<String, PolicyConfig>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
        packages: Arc<crate::pkg::Packages>,
    ) -> Result<Self, StartError> {
        let default_ceiling = cfg
            .default_ceiling
            .to_policy()
            .map_err(|e| StartError::Setting(format!("[network] default_ceiling: {e}")))?;
        let mut ceilings = HashMap::new();
        for (tenant, c) in tenant_ceilings {
            let p = c.to_policy().map_err(|e| {
                StartError::Setting(format!("[tenants.{tenant}] egress_ceiling: {e}"))
            })?;
            ceilings.insert(tenant.clone(), p);
        }
        let never_reach = NeverReach::new(&cfg.never_reach)
            .map_err(|e| StartError::Setting(format!("[network] never_reach: {e}")))?;
        let broker_tls = broker::upstream_tls(cfg.broker_upstream_ca.as_deref())
            .map_err(|e| StartError::Setting(format!("[network] broker_upstream_ca: {e}")))?;
        Ok(Self {
            broker_tls: Arc::new(broker_tls),
            cfg,
            ceilings,
            default_ceiling,
            store,
            metrics,
            host_addrs: HostAddrs::default(),
            never_reach,
            packages,
        })
    }

    /// `requested` for `tenant`, if its ceiling allows all of it.
    pub fn check(&self, tenant: &str, requested: &NetworkPolicy) -> ApiResult<Policy> {
        let policy = policy_of(requested)?;
        self.within_ceiling(tenant, &policy)?;
        Ok(policy)
    }

    /// Whether `tenant`'s ceiling allows all of `policy` (already checked by [`policy_of`]).
    pub fn within_ceiling(&self, tenant: &str, policy: &Policy) -> ApiResult<()> {
        let ceiling = self.ceilings.get(tenant).unwrap_or(&self.default_ceiling);
        ceiling
            .covers(policy)
            .map_err(|rule| ApiError::NetworkNotAllowed {
                tenant: tenant.to_owned(),
                rule,
            })
    }

    /// Starts serving a sandbox's exits under `policy`: its proxy and DNS server run until the
    /// returned handle is dropped. An `adopted` sandbox's egress log goes on from what the store
    /// holds (a new one's is empty, and nothing is read for it on the create path).
    pub fn start(
        self: &Arc<Self>,
        sandbox_id: &str,
        tenant: &str,
        exits: NetExits,
        policy: Policy,
        adopted: bool,
        uses: Uses,
    ) -> io::Result<SandboxNet> {
        let Uses { packages, secrets } = uses;
        let (store, cap) = (self.store.clone(), self.cfg.max_log_events);
        let log = match adopted {
            true => SandboxLog::resume(store, tenant, sandbox_id, cap),
            false => SandboxLog::new(store, tenant, sandbox_id, cap),
        };
        let state = Arc::new(NetState {
            sandbox_id: sandbox_id.to_owned(),
            tenant: tenant.to_owned(),
            policy: RwLock::new(Arc::new(policy)),
            resolved: Mutex::new(HashMap::new()),
            log,
            egress: self.clone(),
            packages,
            secrets,
        });
        let proxy = tokio::net::TcpListener::from_std(exits.proxy)?;
        let dns = tokio::net::UdpSocket::from_std(exits.dns)?;
        let tasks = vec![
            tokio::spawn(proxy::serve(state.clone(), proxy)).abort_handle(),
            tokio::spawn(dns::serve(state.clone(), dns)).abort_handle(),
        ];
        Ok(SandboxNet {
            state,
            netns: Arc::new(exits.netns),
            tasks: Mutex::new(tasks),
        })
    }

    /// What `q` selects of a sandbox's stored egress log, and its count of events not kept.
    pub fn log(&self, sandbox_id: &str, q: &Query) -> ApiResult<(Vec<EgressEvent>, u64)> {
        events::read(&self.store, sandbox_id, q)
    }
}

/// What a sandbox's proxy serves besides its policy: its use of the package proxy and its
/// brokered secrets.
#[derive(Debug)]
pub struct Uses {
    pub packages: Arc<crate::pkg::Session>,
    pub secrets: Arc<crate::secrets::SandboxSecrets>,
}

/// One sandbox's network as the daemon serves it; dropping it stops the proxy and the DNS
/// server and closes their sockets (the namespace goes with the VMM).
#[derive(Debug)]
pub struct SandboxNet {
    state: Arc<NetState>,
    netns: Arc<std::os::fd::OwnedFd>,
    /// The proxy, the DNS server and the exposures.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

/// An exposed port, as ExposePort answers it.
#[derive(Debug)]
pub struct Exposed {
    pub address: std::net::SocketAddr,
    pub token: String,
    pub expires_unix_ms: i64,
}

impl SandboxNet {
    /// Exposes guest port `port` for `ttl_s` seconds (0: the default; capped) on a new host
    /// listener; callers present the returned token.
    pub fn expose(&self, port: u16, ttl_s: u32) -> io::Result<Exposed> {
        let cfg = &self.state.egress.cfg;
        let ttl_s = if ttl_s == 0 {
            cfg.expose_default_ttl_s
        } else {
            ttl_s
        }
        .min(cfg.expose_max_ttl_s);
        let listener = std::net::TcpListener::bind((cfg.expose_listen, 0))?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let address = listener.local_addr()?;
        let token = expose::new_token()?;
        let ttl = Duration::from_secs(u64::from(ttl_s));
        let task = tokio::spawn(expose::serve(
            self.state.clone(),
            self.netns.clone(),
            listener,
            port,
            token.clone(),
            tokio::time::Instant::now() + ttl,
        ));
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(task.abort_handle());
        Ok(Exposed {
            address,
            token,
            expires_unix_ms: now_ms() + ttl.as_millis() as i64,
        })
    }

    /// Replaces the policy; new connections and queries follow it.
    pub fn set_policy(&self, policy: Policy) {
        *self.state.policy.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(policy);
    }
}

impl Drop for SandboxNet {
    fn drop(&mut self) {
        for t in self
            .tasks
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            t.abort();
        }
    }
}

/// The state a sandbox's proxy and DNS server share.
#[derive(Debug)]
struct NetState {
    sandbox_id: String,
    tenant: String,
    policy: RwLock<Arc<Policy>>,
    /// What this sandbox's DNS answered, by name (the proxy accepts these addresses for the
    /// name besides its own fresh resolution). Bounded by [`MAX_RESOLVED`].
    resolved: Mutex<HashMap<String, Vec<IpAddr>>>,
    /// Its egress log.
    log: SandboxLog<EgressEvent>,
    egress: Arc<Egress>,
    /// Its use of the package proxy (its package policy, downloads, install log).
    packages: Arc<crate::pkg::Session>,
    /// Its secrets: the brokered ones are added to requests by the proxy.
    secrets: Arc<crate::secrets::SandboxSecrets>,
}

/// Names remembered per sandbox.
const MAX_RESOLVED: usize = 4096;

impl NetState {
    fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn cfg(&self) -> &NetworkConfig {
        &self.egress.cfg
    }

    /// What `name` resolves to for this sandbox: the host map's addresses (pinned), else the
    /// system resolver's, plus what this sandbox's DNS answered for it before.
    async fn resolve(&self, name: &str) -> (Vec<IpAddr>, bool) {
        if let Some(addrs) = self.cfg().hosts.get(name) {
            return (addrs.iter().map(|a| IpAddr::V4(*a)).collect(), true);
        }
        let mut addrs: Vec<IpAddr> = self
            .resolved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .unwrap_or_default();
        let lookup = tokio::net::lookup_host((name, 0));
        if let Ok(Ok(found)) = tokio::time::timeout(Duration::from_secs(5), lookup).await {
            for a in found {
                if !addrs.contains(&a.ip()) {
                    addrs.push(a.ip());
                }
            }
        }
        (addrs, false)
    }

    fn remember(&self, name: &str, addrs: &[IpAddr]) {
        let mut m = self.resolved.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() >= MAX_RESOLVED && !m.contains_key(name) {
            m.clear();
        }
        m.insert(name.to_owned(), addrs.to_vec());
    }

    /// Logs one event: counted in the metrics, stored while the sandbox's log has room.
    fn record(&self, e: EgressEvent) {
        let kind = events::egress_kind_label(e.kind());
        self.egress
            .metrics
            .egress_event(&self.tenant, kind, e.allowed, e.bytes_out, e.bytes_in);
        if let Some(e) = self.log.append(e) {
            crate::audit::logged(&self.tenant, &self.sandbox_id, &e);
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests;
