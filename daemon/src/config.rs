//! The daemon's own settings: sensible defaults, overridden by the settings file (read by
//! `settings.rs`, which gives the sections of the parts above the daemon, `[cluster]` and
//! `[e2b]`, to their owners), then by `--listen` and `--data-dir` on the command line. The
//! sections of the parts below (`[jail]`, `[network]`, `[oci]`, `[packages]`, `[audit]`) are
//! their own types, composed here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The daemon's settings. Every field has a default; see docs/configuration.md.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the gRPC service listens: `unix://PATH` (default
    /// `unix:///run/airlock/airlockd.sock`) or `tcp://HOST:PORT` (every call then needs a
    /// token). Several are allowed.
    pub listen: Vec<String>,
    /// Templates, snapshots, records, execution output, VMM run directories.
    pub data_dir: PathBuf,
    /// The `airlock-vmm` binary (default: next to `airlockd`).
    pub vmm_binary: Option<PathBuf>,
    /// The `default` image's kernel and root filesystem (default: `$AIRLOCK_KERNEL` /
    /// `$AIRLOCK_ROOTFS`, else the newest outputs of `kernel-config/build.sh` and
    /// `rootfs/build.sh` under `/var/cache/airlock`).
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    /// More images CreateTemplate may boot, by name (`[images.NAME] kernel = ..., rootfs =
    /// ...`); tenants name images, never host files.
    pub images: BTreeMap<String, ImageConfig>,
    /// Tenants that may name host files in CreateTemplate (`kernel_path`, `rootfs_path`) and
    /// see them in template records: the operator's (default: the default tenant, which is the
    /// Unix socket's token-less caller).
    pub operators: Vec<String>,
    /// Warm `airlock-vmm` processes kept per template.
    pub pool_size: usize,
    /// Host capacity: sandboxes at once, and guest memory committed to them (MiB; 0: 80% of
    /// the host's memory).
    pub max_sandboxes: usize,
    pub max_committed_mib: u64,
    /// Per-tenant quotas (tenants without an entry in `tenants` get these).
    pub default_quota: Quota,
    /// Tenants and their tokens and quotas, by tenant name.
    pub tenants: BTreeMap<String, TenantConfig>,
    /// The tenant of token-less calls on a Unix socket.
    pub default_tenant: String,
    /// Sandbox idle TTL and lifetime when a request gives none, and their caps.
    pub default_idle_ttl_s: u32,
    pub max_idle_ttl_s: u32,
    pub default_max_lifetime_s: u32,
    pub max_lifetime_s: u32,
    /// Execution timeout when a request gives none, and its cap.
    pub default_exec_timeout_ms: u64,
    pub max_exec_timeout_ms: u64,
    /// Output stored per execution stream; more is dropped (the record says so).
    pub max_output_bytes: u64,
    /// Space the data directory's filesystem must have left for a create or a template
    /// build to start (MiB); below it they fail with CAPACITY_EXHAUSTED (`data_dir`).
    pub min_free_data_mib: u64,
    /// Retention: an ended sandbox's records (its executions' too, and their output) are
    /// deleted this long after it ended; its executions' output sooner. Seconds.
    pub record_retention_s: u64,
    pub output_retention_s: u64,
    /// Largest file WriteFile/ReadFile/CreateSandbox moves.
    pub max_file_bytes: u64,
    /// Default writable disk space of a sandbox (MiB) and its cap: on a writable root, what it
    /// may write there (its copy-on-write overlay's quota on the host); else its /tmp tmpfs.
    pub default_disk_mib: u32,
    pub max_disk_mib: u32,
    /// Templates are built with a writable root: a copy-on-write disk over the read-only base
    /// image, which each sandbox writes into an overlay of its own (false: the root is
    /// read-only and /tmp a tmpfs, as before).
    pub writable_root: bool,
    /// Empty disk slots every template is built with, for volumes (at most 8; a sandbox mounts
    /// at most this many). 0: templates without volumes.
    pub volume_slots: u32,
    /// Exported templates to add at start (each a directory with the record, `template.pb`,
    /// and the snapshot's files: `state`, `memory`, `layer`, `layer.map`), under their names,
    /// when no template has that name yet. One whose kernel or base image is no longer the file it
    /// was booted from is skipped with a warning.
    pub import_templates: Vec<PathBuf>,
    /// The largest volume (MiB).
    pub max_volume_size_mib: u32,
    /// `mkfs.ext4`, which makes volumes (default: found on `$PATH` or in /sbin, /usr/sbin).
    pub mkfs_ext4: Option<PathBuf>,
    /// The largest template a build may make (each of its sandboxes has this shape).
    pub max_template_vcpus: u32,
    pub max_template_memory_mib: u32,
    /// How long a template build (cold boot, warm-up, snapshot) may take, in seconds.
    pub template_build_timeout_s: u64,
    /// The warm-up command of a template build when the request names none (see
    /// `CreateTemplateRequest.warmup`); empty: none.
    pub template_warmup: String,
    /// Default file policy (path prefixes in the guest).
    pub writable_paths: Vec<String>,
    pub exportable_paths: Vec<String>,
    /// The export policy's ceiling: the largest file ReadFile exports, the bytes it exports
    /// from one sandbox in all, and the paths it always refuses (patterns; a request may add
    /// more and lower the caps, never raise them).
    pub export_max_file_bytes: u64,
    pub export_max_total_bytes: u64,
    pub export_denied: Vec<String>,
    /// VMM memory beyond guest memory allowed by the sandbox's cgroup (MiB).
    pub vmm_overhead_mib: u64,
    /// Processes/threads allowed in a sandbox's cgroup (the VMM's threads).
    pub vmm_pids_max: u64,
    /// Parent cgroup name for sandbox cgroups.
    pub cgroup_parent: String,
    /// Where the daemons of this host lock their cgroup parent, jail uid range and sockets
    /// (`instance.rs`): a second daemon sharing one of them is refused at start.
    pub lock_dir: PathBuf,
    /// `required` (the default): the daemon does not start without a usable cgroup hierarchy,
    /// since sandboxes would run without memory, CPU and pid limits. `off`: it starts anyway
    /// and sandboxes run unlimited (development machines only).
    pub cgroups: CgroupMode,
    /// Prometheus endpoint (`HOST:PORT`, HTTP `GET /metrics`); empty: off. It names tenants
    /// and sandboxes: off loopback it needs `metrics_token` (sent as `Authorization: Bearer`).
    pub metrics_listen: String,
    pub metrics_token: String,
    /// TLS for the TCP listeners; a TCP listener without it is refused unless
    /// `allow_insecure_tcp` (tokens would cross the network in clear).
    pub tls: Option<TlsSettings>,
    pub allow_insecure_tcp: bool,
    /// TCP connections at once (more are closed at once), and calls at once per connection.
    pub max_connections: usize,
    pub max_calls_per_connection: usize,
    /// TCP listeners (gRPC and E2B): a TLS handshake must be done within this (ms), or the
    /// connection is closed.
    pub tls_handshake_timeout_ms: u64,
    /// TCP listeners (gRPC and E2B): a connection that moves no byte either way for this long
    /// (ms) is closed (the gRPC listener pings its clients at half of it, so live ones move).
    pub idle_timeout_ms: u64,
    /// An HTTP/1 request's head (E2B), and a metrics request as a whole, must arrive within
    /// this (ms), or the connection is closed.
    pub header_read_timeout_ms: u64,
    /// The most bytes of stored output all GetExecution calls with `include_output` hold at
    /// once; a call that would go over fails with CAPACITY_EXHAUSTED (resource
    /// `get_execution_output_bytes`) and may be retried or use StreamExecution.
    pub max_output_read_bytes: u64,
    /// How long a sandbox may take from restore to the agent's answer.
    pub ready_timeout_ms: u64,
    /// Restores (create → ready) running at once (0: twice the host's CPUs); more creates wait
    /// in a queue of at most `max_start_queue`, beyond which they fail with
    /// CAPACITY_EXHAUSTED (resource `start_queue`).
    pub max_concurrent_starts: usize,
    pub max_start_queue: usize,
    /// A daemon that stops (SIGTERM, an upgrade) or dies leaves running and paused sandboxes
    /// running, and the next one adopts them again, executions included. `false`: a stopping
    /// daemon ends every sandbox (DAEMON_STOPPED) and a starting one reaps whatever it finds
    /// (DAEMON_RESTARTED).
    pub adopt_on_restart: bool,
    /// How every VMM is confined (see `jail.rs`).
    pub jail: crate::jail::JailConfig,
    /// Sandbox networks: the static host map, the default egress ceiling, DNS and proxy limits
    /// (see `net/mod.rs`).
    pub network: crate::net::NetworkConfig,
    /// Templates from OCI images: plain-HTTP registries, caps, timeouts, the guest agent put
    /// into them (`[oci]`, see `oci/mod.rs`).
    pub oci: crate::oci::OciConfig,
    /// The package proxy: its registries, the default package ceiling, the cache, limits
    /// (see `pkg/mod.rs`).
    pub packages: crate::pkg::PackagesConfig,
    /// The audit trail: its retention, whether code is recorded (see `audit.rs`).
    pub audit: crate::audit::AuditConfig,
    /// Secrets sealed at rest for a restarted daemon, and their key (see `secrets/seal.rs`).
    pub secrets: crate::secrets::seal::SecretsConfig,
}

/// A registered image: a kernel and a root filesystem on the daemon's host.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
}

/// Whether sandboxes need cgroups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMode {
    #[default]
    Required,
    Off,
}

/// Limits of one tenant. The defaults are finite, so that no tenant takes the whole host by
/// default; 0 means no limit beyond the host's (an operator's explicit choice).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Quota {
    /// Sandboxes at once.
    pub max_sandboxes: usize,
    /// Guest memory at once, MiB.
    pub max_memory_mib: u64,
    /// Templates (builds and snapshots of sandboxes), and the MiB their memory files take.
    pub max_templates: usize,
    pub max_template_mib: u64,
    /// Stored execution output, MiB: past it, the output of the oldest ended executions goes.
    pub max_output_mib: u64,
    /// Volumes, and the MiB of their sizes together.
    pub max_volumes: usize,
    pub max_volume_mib: u64,
}

impl Default for Quota {
    fn default() -> Self {
        Self {
            max_sandboxes: 64,
            max_memory_mib: 32 << 10,
            max_templates: 16,
            max_template_mib: 64 << 10,
            max_output_mib: 8 << 10,
            max_volumes: 32,
            max_volume_mib: 256 << 10,
        }
    }
}

/// One tenant: its tokens (in clear, or as SHA-256 digests in hex) and quota.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantConfig {
    pub tokens: Vec<String>,
    pub token_sha256: Vec<String>,
    /// Tokens (in clear, or as digests) that run sandboxes but lack the right to make
    /// templates: CreateTemplate, BuildTemplate, RebuildTemplate, SnapshotSandbox and
    /// DeleteTemplate are refused with NOT_PERMITTED.
    pub run_tokens: Vec<String>,
    pub run_token_sha256: Vec<String>,
    pub quota: Option<Quota>,
    /// The most a sandbox of this tenant may be allowed to reach (default:
    /// `[network] default_ceiling`, allow-internet: every public address, no internal range).
    pub egress_ceiling: Option<crate::net::PolicyConfig>,
    /// The most a sandbox of this tenant may install (default: `[packages] default_ceiling`:
    /// every registry, any package, no cap).
    pub packages: Option<crate::pkg::CeilingConfig>,
}

/// TLS of the TCP listeners (`[tls]`): the server's certificate chain and key (PEM), and, for
/// mutual TLS, the CA that clients' certificates must chain to.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

impl Default for Config {
    // Long: one line per setting, each with its default; split, the defaults would be
    // scattered over helpers that each fill a few fields.
    fn default() -> Self {
        Self {
            listen: vec![format!("unix://{}", airlock_api::DEFAULT_SOCKET)],
            data_dir: PathBuf::from("/var/lib/airlock"),
            vmm_binary: None,
            kernel: None,
            rootfs: None,
            images: BTreeMap::new(),
            operators: vec!["default".into()],
            pool_size: 2,
            max_sandboxes: 256,
            max_committed_mib: 0,
            default_quota: Quota::default(),
            tenants: BTreeMap::new(),
            default_tenant: "default".into(),
            default_idle_ttl_s: 600,
            max_idle_ttl_s: 24 * 3600,
            default_max_lifetime_s: 4 * 3600,
            max_lifetime_s: 24 * 3600,
            default_exec_timeout_ms: 600_000,
            max_exec_timeout_ms: 24 * 3600 * 1000,
            max_output_bytes: 64 << 20,
            min_free_data_mib: 256,
            record_retention_s: 7 * 24 * 3600,
            output_retention_s: 24 * 3600,
            max_file_bytes: 100 << 20,
            default_disk_mib: 1024,
            // Loads the interpreter sandboxes run most (and the shell) into the page cache of
            // every template, so a sandbox's first Python starts warm, and opens one TCP
            // connection (refused: a build has no egress), so that the guest kernel's one-time
            // set-up of outgoing TCP is in the snapshot, not in every sandbox's first
            // connection (seconds on hosts that emulate guest kernel code). An image without
            // Python still builds.
            template_warmup: "python3 -c 'import socket; s = socket.socket(); s.settimeout(5); \
                              s.connect_ex((\"192.0.2.1\", 80))' 2>/dev/null || true"
                .into(),
            max_template_vcpus: 8,
            max_template_memory_mib: 16 << 10,
            template_build_timeout_s: 900,
            max_disk_mib: 64 << 10,
            writable_root: true,
            volume_slots: 4,
            max_volume_size_mib: 1 << 20,
            mkfs_ext4: None,
            writable_paths: vec!["/tmp".into()],
            exportable_paths: vec!["/tmp".into()],
            export_max_file_bytes: 100 << 20,
            export_max_total_bytes: 1 << 30,
            export_denied: [
                ".env",
                ".env.*",
                "*.pem",
                "*.key",
                "id_rsa",
                "id_dsa",
                "id_ecdsa",
                "id_ed25519",
                ".netrc",
                ".pgpass",
            ]
            .map(String::from)
            .to_vec(),
            vmm_overhead_mib: 128,
            vmm_pids_max: 64,
            cgroup_parent: "airlock".into(),
            lock_dir: PathBuf::from("/run/airlock/locks"),
            cgroups: CgroupMode::Required,
            metrics_listen: String::new(),
            metrics_token: String::new(),
            tls: None,
            allow_insecure_tcp: false,
            max_connections: 1024,
            max_calls_per_connection: 64,
            tls_handshake_timeout_ms: 10_000,
            idle_timeout_ms: 120_000,
            header_read_timeout_ms: 30_000,
            max_output_read_bytes: 512 << 20,
            ready_timeout_ms: 30_000,
            max_concurrent_starts: 0,
            max_start_queue: 1024,
            adopt_on_restart: true,
            jail: crate::jail::JailConfig::default(),
            network: crate::net::NetworkConfig::default(),
            oci: crate::oci::OciConfig::default(),
            packages: crate::pkg::PackagesConfig::default(),
            audit: crate::audit::AuditConfig::default(),
            secrets: crate::secrets::seal::SecretsConfig::default(),
            import_templates: Vec::new(),
        }
    }
}

impl Config {
    /// The paths of the Unix sockets of `listen`.
    pub fn unix_sockets(&self) -> Vec<PathBuf> {
        self.listen.iter().filter_map(|a| unix_path(a)).collect()
    }

    /// Checks what the settings expose: TCP listeners only with TLS (or an explicit
    /// `allow_insecure_tcp`), metrics off loopback only with a token.
    pub fn check_exposure(&self) -> Result<(), crate::error::StartError> {
        for addr in &self.listen {
            if addr.starts_with("tcp://") && self.tls.is_none() && !self.allow_insecure_tcp {
                return Err(crate::error::StartError::Setting(format!(
                    "{addr}: a TCP listener needs [tls] (cert, key): tokens would cross the \
                     network in clear (allow_insecure_tcp = true allows it, for tests)"
                )));
            }
        }
        if !self.metrics_listen.is_empty()
            && !is_loopback(&self.metrics_listen)
            && self.metrics_token.is_empty()
        {
            return Err(crate::error::StartError::Setting(format!(
                "metrics_listen {}: the metrics name tenants and sandboxes; listen on loopback \
                 or set metrics_token",
                self.metrics_listen
            )));
        }
        Ok(())
    }

    /// A tenant's quota.
    pub fn quota_of(&self, tenant: &str) -> Quota {
        self.tenants
            .get(tenant)
            .and_then(|t| t.quota.clone())
            .unwrap_or_else(|| self.default_quota.clone())
    }

    /// The VMM binary: configured, else `airlock-vmm` next to this executable.
    pub fn vmm_binary(&self) -> PathBuf {
        self.vmm_binary.clone().unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("airlock-vmm")))
                .unwrap_or_else(|| PathBuf::from("airlock-vmm"))
        })
    }

    /// Tenants' package ceilings, where set.
    pub fn package_ceilings(&self) -> BTreeMap<String, crate::pkg::CeilingConfig> {
        self.tenants
            .iter()
            .filter_map(|(t, c)| Some((t.clone(), c.packages.clone()?)))
            .collect()
    }

    /// Tenants' egress ceilings, where set.
    pub fn egress_ceilings(&self) -> BTreeMap<String, crate::net::PolicyConfig> {
        self.tenants
            .iter()
            .filter_map(|(t, c)| Some((t.clone(), c.egress_ceiling.clone()?)))
            .collect()
    }

    /// Whether `tenant` is the operator's (may name host files).
    pub fn is_operator(&self, tenant: &str) -> bool {
        self.operators.iter().any(|o| o == tenant)
    }

    /// The kernel and root filesystem of image `name` (`default`: the built ones, unless
    /// `[images.default]` says otherwise); `None` if no such image is registered or built.
    pub fn image(&self, name: &str) -> Option<(PathBuf, PathBuf)> {
        if let Some(i) = self.images.get(name) {
            return Some((i.kernel.clone(), i.rootfs.clone()));
        }
        (name == "default").then(|| self.default_kernel().zip(self.default_rootfs()))?
    }

    /// The default kernel for templates.
    pub fn default_kernel(&self) -> Option<PathBuf> {
        self.kernel
            .clone()
            .or_else(|| std::env::var_os("AIRLOCK_KERNEL").map(PathBuf::from))
            .or_else(|| newest(&cache_dir().join("kernel"), |p| Some(p.join("vmlinux"))))
    }

    /// The default root filesystem for templates.
    pub fn default_rootfs(&self) -> Option<PathBuf> {
        self.rootfs
            .clone()
            .or_else(|| std::env::var_os("AIRLOCK_ROOTFS").map(PathBuf::from))
            .or_else(|| {
                newest(&cache_dir().join("rootfs"), |p| {
                    p.extension()
                        .is_some_and(|e| e == "ext4")
                        .then(|| p.to_path_buf())
                })
            })
    }

    /// Restores allowed at once.
    pub fn concurrent_starts(&self) -> usize {
        if self.max_concurrent_starts > 0 {
            return self.max_concurrent_starts;
        }
        std::thread::available_parallelism()
            .map_or(2, |n| n.get() * 2)
            .max(2)
    }

    /// Committed-memory capacity in MiB.
    pub fn committed_capacity_mib(&self) -> u64 {
        if self.max_committed_mib > 0 {
            return self.max_committed_mib;
        }
        host_memory_mib() * 8 / 10
    }
}

fn cache_dir() -> PathBuf {
    std::env::var_os("AIRLOCK_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/airlock"))
}

/// The most recently modified entry `e` of `dir` for which `pick(e)` names an existing file.
fn newest(dir: &Path, pick: impl Fn(&Path) -> Option<PathBuf>) -> Option<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let Some(candidate) = pick(&entry.path()) else {
            continue;
        };
        let Ok(meta) = std::fs::metadata(&candidate) else {
            continue;
        };
        let Ok(modified) = meta.modified() else {
            continue;
        };
        if meta.is_file() && best.as_ref().is_none_or(|(t, _)| modified > *t) {
            best = Some((modified, candidate));
        }
    }
    best.map(|(_, p)| p)
}

/// Whether `HOST:PORT` names a loopback address.
pub fn is_loopback(hostport: &str) -> bool {
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// MemTotal in MiB (0 if unknown).
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(0)
}

/// The path of a `unix://PATH` (or `unix:PATH`) listen address.
pub fn unix_path(addr: &str) -> Option<PathBuf> {
    addr.strip_prefix("unix://")
        .or_else(|| addr.strip_prefix("unix:"))
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn toml_overrides_defaults_and_rejects_unknown_keys() {
        let c: Config = toml::from_str(
            r#"
            pool_size = 5
            max_sandboxes = 3
            [tenants.acme]
            tokens = ["t1"]
            quota = { max_sandboxes = 2 }
            "#,
        )
        .expect("valid config");
        assert_eq!(c.pool_size, 5);
        assert_eq!(c.max_sandboxes, 3);
        assert_eq!(c.default_tenant, "default");
        assert_eq!(c.tenants["acme"].tokens, ["t1"]);
        assert_eq!(c.quota_of("acme").max_sandboxes, 2);
        assert_eq!(
            c.quota_of("acme").max_memory_mib,
            32 << 10,
            "unset fields keep defaults"
        );
        let other = c.quota_of("other");
        assert!(
            other.max_sandboxes > 0 && other.max_sandboxes < Config::default().max_sandboxes,
            "a tenant without a quota cannot take every sandbox: {other:?}"
        );
        assert!(other.max_memory_mib > 0);
        assert_eq!(c.cgroups, CgroupMode::Required);
        assert!(c.is_operator("default") && !c.is_operator("acme"));
        let imgs: Config = toml::from_str(
            "kernel = \"/k\"\nrootfs = \"/r\"\n[images.py]\nkernel = \"/k2\"\nrootfs = \"/r2\"\n",
        )
        .unwrap();
        assert_eq!(imgs.image("py"), Some(("/k2".into(), "/r2".into())));
        assert_eq!(imgs.image("default"), Some(("/k".into(), "/r".into())));
        assert_eq!(imgs.image("other"), None);
        let exposed = |text: &str| toml::from_str::<Config>(text).unwrap().check_exposure();
        assert!(
            exposed("listen = [\"tcp://0.0.0.0:7000\"]").is_err(),
            "TCP without TLS"
        );
        assert!(exposed("listen = [\"tcp://0.0.0.0:7000\"]\nallow_insecure_tcp = true").is_ok());
        assert!(
            exposed("listen = [\"tcp://0.0.0.0:7000\"]\n[tls]\ncert = \"/c\"\nkey = \"/k\"")
                .is_ok()
        );
        assert!(
            exposed("metrics_listen = \"0.0.0.0:9464\"").is_err(),
            "open metrics"
        );
        assert!(exposed("metrics_listen = \"127.0.0.1:9464\"").is_ok());
        assert!(exposed("metrics_listen = \"[::1]:9464\"").is_ok());
        assert!(exposed("metrics_listen = \"0.0.0.0:9464\"\nmetrics_token = \"m\"").is_ok());
        let off: Config = toml::from_str("cgroups = \"off\"").unwrap();
        assert_eq!(off.cgroups, CgroupMode::Off);
        assert!(toml::from_str::<Config>("cgroups = \"maybe\"").is_err());
        assert!(toml::from_str::<Config>("pool_sise = 1").is_err());
    }
}
