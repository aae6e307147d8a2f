//! The package proxy: the one path by which packages reach a sandbox.
//!
//! Every sandbox's guest reaches it at the gateway, `100.96.0.1:3141` (the namespace's ruleset
//! sends the guest's TCP to the daemon's transparent proxy, which hands connections for that
//! address here instead of deciding them by the egress policy). The base image's pip, npm and
//! apt are configured to use it (`/etc/pip.conf`, `/etc/npmrc`, `/etc/apt/sources.list`). It
//! speaks PyPI's simple index (PEP 503 HTML and PEP 691 JSON), the npm registry protocol and
//! Debian's repository layout (`debian`: signatures checked here), as a pull-through cache of
//! the operator's registries (`[packages.registries]`): index pages and packuments are fetched
//! for each request and rewritten so that every file URL points here, under the digest the
//! registry states for it (`/f/sha256-HEX/NAME`, `/f/sha512-HEX/NAME`); files are fetched once,
//! verified against that digest and kept under it (`DATA_DIR/packages`), so that every tenant
//! shares the cache safely: a file is only ever served under the digest of its content.
//!
//! Each sandbox's [`Session`] holds its policy ([`airlock_packages::policy::Policy`]: the
//! tenant's ceiling narrowed by the sandbox's request), counts its downloads against its cap
//! and logs every file it asks for (and every refused page) with the outcome (the install log,
//! `GetInstallLog`).
//!
//! Its files, one direction: `serve` (a guest connection, PyPI and npm index pages) over
//! `debian` (Debian's repository layout) over `files` (a verified file by its digest) over
//! `respond` (how a guest is answered) over `http` (the registries' side) over `guard` (where
//! it may connect: a registry's own hosts, past the egress guards).

mod debian;
mod files;
mod guard;
mod http;
mod respond;
mod serve;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_api::v1::{InstallEvent, PackagePolicy};
use airlock_packages::policy::{Parts, Policy, PolicyError};
use serde::Deserialize;
use tracing::warn;
use url::Url;

use crate::error::{ApiError, ApiResult, StartError};
use crate::events::{self, Query, SandboxLog};
use crate::metrics::Metrics;
use crate::store::Store;

pub use serve::serve;

/// The port of the package proxy on the gateway address.
pub const PKG_PORT: u16 = 3141;

/// A registry's protocol.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Pypi,
    Npm,
    Debian,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Pypi => "pypi",
            Kind::Npm => "npm",
            Kind::Debian => "debian",
        }
    }
}

/// `[packages.registries.NAME]`: `kind = "pypi"`, `url = "https://pypi.org/simple/"` (a PyPI
/// registry's simple index; an npm registry's root; a Debian repository's root, the directory
/// with `dists/` and `pool/`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    pub kind: Kind,
    pub url: String,
    /// `debian` only, and required there: the OpenPGP keyring (binary, as `gpg --export`
    /// writes it) whose keys may sign the repository's `InRelease` files.
    #[serde(default)]
    pub keyring: Option<PathBuf>,
    /// Hosts besides the URL's own that the registry's index pages may link files on: `HOST`
    /// (the link's scheme's default port) or `HOST:PORT`. A file anywhere else is refused.
    #[serde(default)]
    pub file_hosts: Vec<String>,
    /// CIDRs in the egress guards' ranges (loopback, private, link-local, CGNAT, ULA, the
    /// host's own addresses) that this registry's hosts may be at: a mirror on loopback or on
    /// the operator's network. Empty: such addresses are refused.
    #[serde(default)]
    pub private_addresses: Vec<String>,
}

/// A package policy in the settings: `[packages.default_ceiling]`, `[tenants.NAME.packages]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CeilingConfig {
    pub registries: Vec<String>,
    pub allow: Vec<String>,
    pub deny: Vec<String>,
    pub offline: bool,
    /// 0: no cap.
    pub max_download_mib: u64,
}

impl CeilingConfig {
    fn to_parts(&self) -> Parts {
        Parts {
            registries: self.registries.clone(),
            allow: self.allow.clone(),
            deny: self.deny.clone(),
            offline: self.offline,
            max_download_bytes: self.max_download_mib << 20,
        }
    }
}

/// `[packages]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PackagesConfig {
    /// The registries by name. Default: `pypi` (https://pypi.org/simple/), `npm`
    /// (https://registry.npmjs.org/) and `debian` (https://deb.debian.org/debian/, signed by
    /// the keys in the host's `/usr/share/keyrings/debian-archive-keyring.gpg`). Giving any
    /// replaces all three; name an internal PyPI mirror `pypi` (an npm one `npm`, a Debian one
    /// `debian`) to make it what the base image's pip (npm, apt) uses.
    pub registries: BTreeMap<String, RegistryConfig>,
    /// The ceiling of tenants without one of their own: every registry, any package, no cap.
    pub default_ceiling: CeilingConfig,
    /// Where files are cached (default: `DATA_DIR/packages`).
    pub cache_dir: Option<PathBuf>,
    /// The largest index page or packument read from a registry, and the largest file.
    pub max_index_mib: u64,
    pub max_file_mib: u64,
    /// How long a registry may take to accept a connection, and to send a whole answer.
    pub connect_timeout_s: u64,
    pub fetch_timeout_s: u64,
    /// Install log events kept per sandbox; more are counted, not kept.
    pub max_log_events: u64,
}

impl Default for PackagesConfig {
    fn default() -> Self {
        let reg = |kind, url: &str| RegistryConfig {
            kind,
            url: url.to_owned(),
            keyring: None,
            file_hosts: Vec::new(),
            private_addresses: Vec::new(),
        };
        Self {
            registries: BTreeMap::from([
                (
                    "pypi".to_owned(),
                    RegistryConfig {
                        file_hosts: vec!["files.pythonhosted.org".to_owned()],
                        ..reg(Kind::Pypi, "https://pypi.org/simple/")
                    },
                ),
                (
                    "npm".to_owned(),
                    reg(Kind::Npm, "https://registry.npmjs.org/"),
                ),
                (
                    "debian".to_owned(),
                    RegistryConfig {
                        keyring: Some(PathBuf::from(DEBIAN_KEYRING)),
                        ..reg(Kind::Debian, "https://deb.debian.org/debian/")
                    },
                ),
            ]),
            default_ceiling: CeilingConfig::default(),
            cache_dir: None,
            max_index_mib: 64,
            max_file_mib: 2048,
            connect_timeout_s: 10,
            fetch_timeout_s: 600,
            max_log_events: 10_000,
        }
    }
}

/// The keyring of the default `debian` registry: Debian's archive keys as the host's
/// `debian-archive-keyring` package installs them.
pub const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// A registry, parsed.
#[derive(Clone, Debug)]
pub struct Registry {
    pub kind: Kind,
    /// Ends with `/`.
    pub url: Url,
    /// `debian`: the keyring its InRelease files are verified against.
    pub keyring: Option<PathBuf>,
    /// The hosts its files may be on: the URL's own first, then `file_hosts`.
    pub hosts: Vec<guard::FileHost>,
    /// `private_addresses`, parsed.
    pub private: Vec<ipnet::IpNet>,
}

impl Registry {
    /// `[packages.registries.NAME]` checked: a name of letters, digits, `-` and `_`; an http(s)
    /// URL (made to end with `/`); a keyring for a Debian registry and only there.
    fn of(name: &str, r: &RegistryConfig) -> Result<Self, StartError> {
        if name.is_empty()
            || !name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            return Err(StartError::Setting(format!(
                "[packages.registries] {name:?}: names are letters, digits, - and _"
            )));
        }
        let mut url = Url::parse(&r.url).map_err(|e| {
            StartError::Setting(format!("[packages.registries.{name}] url {:?}: {e}", r.url))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(StartError::Setting(format!(
                "[packages.registries.{name}] url: http or https"
            )));
        }
        if !url.path().ends_with('/') {
            url.set_path(&format!("{}/", url.path()));
        }
        match (r.kind, &r.keyring) {
            (Kind::Debian, None) => {
                return Err(StartError::Setting(format!(
                    "[packages.registries.{name}] a debian registry needs `keyring`, the \
                     keys that sign its InRelease files"
                )));
            }
            (Kind::Debian, Some(k)) => {
                if let Err(e) = debian::check_keyring(k) {
                    // Not fatal: a host without Debian's keyring still serves pip and npm;
                    // apt's requests are then refused, naming this.
                    warn!("[packages.registries.{name}] {e}");
                }
            }
            (_, Some(_)) => {
                return Err(StartError::Setting(format!(
                    "[packages.registries.{name}] `keyring` is for debian registries"
                )));
            }
            (_, None) => {}
        }
        let (hosts, private) = Self::hosts_of(name, r, &url)?;
        Ok(Registry {
            kind: r.kind,
            url,
            keyring: r.keyring.clone(),
            hosts,
            private,
        })
    }

    /// `url`'s host and `file_hosts`, and `private_addresses`, parsed; a URL at a literal
    /// address the guards refuse, and `private_addresses` does not open, is refused here.
    fn hosts_of(
        name: &str,
        r: &RegistryConfig,
        url: &Url,
    ) -> Result<(Vec<guard::FileHost>, Vec<ipnet::IpNet>), StartError> {
        let bad = |what: &str| StartError::Setting(format!("[packages.registries.{name}] {what}"));
        let own = guard::FileHost::of(url).ok_or_else(|| bad("url: no host"))?;
        let mut hosts = vec![own];
        for h in &r.file_hosts {
            hosts.push(
                guard::FileHost::parse(h)
                    .ok_or_else(|| bad(&format!("file_hosts: {h:?} is not HOST or HOST:PORT")))?,
            );
        }
        let mut private = Vec::new();
        for c in &r.private_addresses {
            let net = c
                .parse::<ipnet::IpNet>()
                .or_else(|_| c.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| bad(&format!("private_addresses: {c:?} is not a CIDR")))?;
            private.push(net.trunc());
        }
        let host = url.host_str().unwrap_or("");
        guard::Guard::new([(host, private.as_slice())])
            .check_literal(url)
            .map_err(|e| bad(&format!("url: {e}")))?;
        Ok((hosts, private))
    }
}

/// The package cache's directories, made (`sha256`, `sha512`, `tmp`, gpgv's private home),
/// with a previous daemon's partial downloads removed.
fn prepare_cache(cfg: &PackagesConfig, data_dir: &Path) -> Result<PathBuf, StartError> {
    let cache = cfg
        .cache_dir
        .clone()
        .unwrap_or_else(|| data_dir.join("packages"));
    for sub in ["sha256", "sha512", "tmp", "gnupg"] {
        std::fs::create_dir_all(cache.join(sub))
            .map_err(StartError::io(cache.join(sub).display().to_string()))?;
    }
    // gpgv's home (it keeps nothing there, but wants it private).
    {
        use std::os::unix::fs::PermissionsExt as _;
        let home = cache.join("gnupg");
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700))
            .map_err(StartError::io(home.display().to_string()))?;
    }
    // Partial downloads of a previous daemon.
    if let Ok(rd) = std::fs::read_dir(cache.join("tmp")) {
        for e in rd.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(cache)
}

/// The HTTP client towards the registries: no proxy, the configured timeouts, addresses
/// checked by `guard` as they are resolved, redirects to the same host only.
fn http_client(
    cfg: &PackagesConfig,
    guard: &Arc<guard::Guard>,
) -> Result<reqwest::Client, StartError> {
    reqwest::Client::builder()
        .no_proxy()
        .dns_resolver(Arc::new(guard::Resolver(guard.clone())))
        .redirect(guard::redirects())
        .connect_timeout(Duration::from_secs(cfg.connect_timeout_s))
        .timeout(Duration::from_secs(cfg.fetch_timeout_s))
        .user_agent(concat!(
            "airlockd-package-proxy/",
            env!("CARGO_PKG_VERSION")
        ))
        .build()
        .map_err(|e| StartError::Setting(format!("the package proxy's HTTP client: {e}")))
}

/// A file some index page listed: where it is and what it is. Keyed by its digest.
#[derive(Clone, Debug)]
pub struct FileRef {
    pub registry: String,
    pub kind: Kind,
    pub package: String,
    pub version: String,
    pub filename: String,
    pub url: Url,
}

/// Files remembered from one sandbox's index pages, at most: the older half is forgotten when
/// the newer is full (clients fetch their index page again before a file, as pip and npm do).
pub(crate) const MAX_REFS: usize = 200_000;

/// Files one sandbox's index pages listed, by digest key, in two generations of at most
/// `MAX_REFS / 2` each: one sandbox's pages never make another's files forgotten, and a full
/// memory forgets the older generation, never the files just listed.
#[derive(Debug, Default)]
struct Refs {
    new: HashMap<String, FileRef>,
    old: HashMap<String, FileRef>,
}

impl Refs {
    fn locked(m: &Mutex<Self>) -> std::sync::MutexGuard<'_, Self> {
        m.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&mut self, key: String, r: FileRef) {
        if self.new.len() >= MAX_REFS / 2 && !self.new.contains_key(&key) {
            self.old = std::mem::take(&mut self.new);
        }
        self.old.remove(&key);
        self.new.insert(key, r);
    }

    fn get(&self, key: &str) -> Option<&FileRef> {
        self.new.get(key).or_else(|| self.old.get(key))
    }
}

/// The daemon-wide part: registries, ceilings, the cache and its index of listed files.
#[derive(Debug)]
pub struct Packages {
    pub cfg: PackagesConfig,
    registries: BTreeMap<String, Registry>,
    names: Vec<String>,
    ceilings: HashMap<String, Parts>,
    default_ceiling: Parts,
    pub(crate) cache: PathBuf,
    pub(crate) client: reqwest::Client,
    /// Where `client` may connect.
    pub(crate) guard: Arc<guard::Guard>,
    /// Every sandbox's listed files too, for a sandbox that asks for a file another listed
    /// (a lockfile written in another sandbox): its policy still decides. Bounded like one
    /// sandbox's; what a sandbox listed itself never depends on it.
    shared: Mutex<Refs>,
    /// One fetch per digest at a time (others wait for it and then find it cached).
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// What the Debian registries' verified indexes list.
    debian: Mutex<debian::State>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
}

impl Packages {
    pub fn new(
        cfg: PackagesConfig,
        data_dir: &Path,
        tenant_ceilings: &BTreeMap<String, CeilingConfig>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, StartError> {
        let mut registries = BTreeMap::new();
        for (name, r) in &cfg.registries {
            registries.insert(name.clone(), Registry::of(name, r)?);
        }
        let names: Vec<String> = registries.keys().cloned().collect();
        let check = |what: &str, p: &Parts| {
            Policy::combine(p, &Parts::default(), &names)
                .map(|_| ())
                .map_err(|e| StartError::Setting(format!("{what}: {e}")))
        };
        let default_ceiling = cfg.default_ceiling.to_parts();
        check("[packages] default_ceiling", &default_ceiling)?;
        let mut ceilings = HashMap::new();
        for (tenant, c) in tenant_ceilings {
            let p = c.to_parts();
            check(&format!("[tenants.{tenant}] packages"), &p)?;
            ceilings.insert(tenant.clone(), p);
        }
        let cache = prepare_cache(&cfg, data_dir)?;
        let guard = Arc::new(guard::Guard::new(registries.values().flat_map(|r| {
            r.hosts
                .iter()
                .map(|h| (h.host.as_str(), r.private.as_slice()))
        })));
        let client = http_client(&cfg, &guard)?;
        Ok(Self {
            cfg,
            registries,
            names,
            ceilings,
            default_ceiling,
            cache,
            client,
            guard,
            shared: Mutex::default(),
            fetching: Mutex::new(HashMap::new()),
            debian: Mutex::new(debian::State::default()),
            store,
            metrics,
        })
    }

    /// The policy in force for a sandbox of `tenant` that asked for `asked`.
    pub fn policy_for(&self, tenant: &str, asked: &PackagePolicy) -> ApiResult<Policy> {
        let ceiling = self.ceilings.get(tenant).unwrap_or(&self.default_ceiling);
        let asked = Parts {
            registries: asked.registries.clone(),
            allow: asked.allow.clone(),
            deny: asked.deny.clone(),
            offline: asked.offline,
            max_download_bytes: asked.max_download_bytes,
        };
        Policy::combine(ceiling, &asked, &self.names).map_err(|e| match e {
            PolicyError::BeyondCeiling(_) => ApiError::PackagesNotAllowed {
                tenant: tenant.to_owned(),
                message: e.to_string(),
            },
            _ => ApiError::InvalidArgument(format!("package policy: {e}")),
        })
    }

    pub fn registry(&self, name: &str) -> Option<&Registry> {
        self.registries.get(name)
    }

    pub fn registry_names(&self) -> &[String] {
        &self.names
    }

    pub(crate) fn fetch_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.fetching.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() > 1024 {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        m.entry(key.to_owned()).or_default().clone()
    }

    /// Where a verified file of digest `key` (`sha256-HEX`, `sha512-HEX`) lives.
    pub(crate) fn blob_path(&self, key: &str) -> Option<PathBuf> {
        let (algo, hex) = key.split_once('-')?;
        let len = match algo {
            "sha256" => 64,
            "sha512" => 128,
            _ => return None,
        };
        (hex.len() == len && hex.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| self.cache.join(algo).join(&hex[..2]).join(hex))
    }

    /// What `q` selects of a sandbox's install log, and its count of events not kept.
    pub fn log(&self, sandbox_id: &str, q: &Query) -> ApiResult<(Vec<InstallEvent>, u64)> {
        events::read(&self.store, sandbox_id, q)
    }

    /// A session for a sandbox; an adopted sandbox's log goes on from its stored tail.
    pub fn session(
        self: &Arc<Self>,
        tenant: &str,
        sandbox_id: &str,
        policy: Policy,
        adopted: bool,
    ) -> Arc<Session> {
        let (store, cap) = (self.store.clone(), self.cfg.max_log_events);
        let log = match adopted {
            true => SandboxLog::resume(store, tenant, sandbox_id, cap),
            false => SandboxLog::new(store, tenant, sandbox_id, cap),
        };
        Arc::new(Session {
            pkgs: self.clone(),
            tenant: tenant.to_owned(),
            policy,
            downloaded: AtomicU64::new(0),
            refs: Mutex::default(),
            debian_reads: Mutex::default(),
            log,
        })
    }
}

/// One sandbox's use of the proxy.
#[derive(Debug)]
pub struct Session {
    pub(crate) pkgs: Arc<Packages>,
    pub tenant: String,
    pub policy: Policy,
    /// Bytes of files served to it (counted against `policy.max_download_bytes`).
    pub(crate) downloaded: AtomicU64,
    /// The files its index pages listed (PyPI's and npm's; Debian's are the registry's).
    refs: Mutex<Refs>,
    /// The Debian `Packages` indexes it read: the `.deb`s it may fetch.
    debian_reads: Mutex<Vec<debian::IndexRead>>,
    /// Its install log.
    log: SandboxLog<InstallEvent>,
}

impl Session {
    /// Remembers a file an index page listed for this sandbox.
    pub(crate) fn remember(&self, key: String, r: FileRef) {
        Refs::locked(&self.pkgs.shared).insert(key.clone(), r.clone());
        Refs::locked(&self.refs).insert(key, r);
    }

    /// A file an index page listed for this sandbox.
    pub(crate) fn file_ref(&self, key: &str) -> Option<FileRef> {
        let own = Refs::locked(&self.refs).get(key).cloned();
        own.or_else(|| Refs::locked(&self.pkgs.shared).get(key).cloned())
    }

    /// Takes `bytes` from the sandbox's download cap, or says how much is left.
    pub(crate) fn take(&self, bytes: u64) -> Result<(), u64> {
        let cap = self.policy.max_download_bytes;
        if cap == 0 {
            self.downloaded.fetch_add(bytes, Ordering::Relaxed);
            return Ok(());
        }
        self.downloaded
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
                (d.saturating_add(bytes) <= cap).then_some(d + bytes)
            })
            .map(|_| ())
            .map_err(|d| cap.saturating_sub(d))
    }

    /// What is left of the cap (`u64::MAX`: no cap).
    pub(crate) fn left(&self) -> u64 {
        match self.policy.max_download_bytes {
            0 => u64::MAX,
            cap => cap.saturating_sub(self.downloaded.load(Ordering::Acquire)),
        }
    }

    /// Logs one event: counted in the metrics, stored while the log has room.
    pub(crate) fn record(&self, e: InstallEvent) {
        let outcome = events::outcome_label(e.outcome());
        self.pkgs
            .metrics
            .package_event(&self.tenant, &e.registry, outcome, e.bytes);
        if let Some(e) = self.log.append(e) {
            crate::audit::logged(&self.tenant, &e.sandbox_id, &e);
        }
    }
}

/// A policy in force, as the API shows it.
pub fn to_proto(p: &Policy) -> PackagePolicy {
    let parts = p.to_parts();
    PackagePolicy {
        registries: parts.registries,
        allow: parts.allow,
        deny: parts.deny,
        offline: parts.offline,
        max_download_bytes: parts.max_download_bytes,
    }
}

#[cfg(test)]
mod tests;
