//! Sandboxes: the live ones (a [`SandboxRt`] each, with its VMM) and their lifecycle: a
//! request checked ([`spec`]), admitted ([`admission`]), started from a warm VMM ([`create`]),
//! paused, resumed, snapshotted and destroyed ([`ops`]), and ended, whoever ends it ([`end`]).
//! Records of ended sandboxes stay in the store.

pub mod admission;
mod create;
mod end;
mod ops;
mod secrets;
pub mod spec;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_api::v1::{FilePolicy, Sandbox, SandboxState};

use crate::config::Config;
use crate::error::{ApiError, ApiResult, StartError};
use crate::exec::{ExecTarget, Executions};
use crate::files::FileTarget;
use crate::host::VmmHost;
use crate::ids;
use crate::metrics::{Metrics, SandboxUsage};
use crate::pool::WarmPool;
use crate::reason::{EndReason, state_name};
use crate::store::Store;
use crate::templates::Templates;
use crate::vmm::VmmProcess;

/// A live sandbox (starting, running or paused).
#[derive(Debug)]
pub struct SandboxRt {
    pub id: String,
    pub tenant: String,
    record: Mutex<Sandbox>,
    vmm: Mutex<Option<VmmProcess>>,
    pub env: HashMap<String, String>,
    pub policy: FilePolicy,
    last_activity: Mutex<Instant>,
    created: Instant,
    /// Serialises pause, resume, snapshot and destroy.
    pub ops: tokio::sync::Mutex<()>,
    /// Set once its end has begun: its VMM's exit is then not a death.
    ending: AtomicBool,
    /// Its network's proxy and DNS server (with a network); dropped at its end.
    net: Mutex<Option<crate::net::SandboxNet>>,
    /// Bytes ReadFile exported from it (its export cap counts them).
    exported: Arc<std::sync::atomic::AtomicU64>,
    /// Its secrets (in memory only).
    pub secrets: Arc<crate::secrets::SandboxSecrets>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SandboxRt {
    /// A live sandbox with `record`; `age` is how long ago it was created.
    pub fn new(
        record: Sandbox,
        env: HashMap<String, String>,
        policy: FilePolicy,
        age: Duration,
    ) -> Self {
        let now = Instant::now();
        Self {
            id: record.id.clone(),
            tenant: record.tenant.clone(),
            record: Mutex::new(record),
            vmm: Mutex::new(None),
            env,
            policy,
            last_activity: Mutex::new(now),
            created: now.checked_sub(age).unwrap_or(now),
            ops: tokio::sync::Mutex::new(()),
            ending: AtomicBool::new(false),
            net: Mutex::new(None),
            exported: Arc::default(),
            secrets: Arc::default(),
        }
    }

    /// Serves its network from now on.
    pub fn set_net(&self, net: crate::net::SandboxNet) {
        *lock(&self.net) = Some(net);
    }

    /// Stops serving its network (its end).
    fn drop_net(&self) {
        drop(lock(&self.net).take());
    }

    /// Its record, with the CPU and memory its cgroup counted.
    pub fn snapshot(&self) -> Sandbox {
        let mut r = lock(&self.record).clone();
        if let Some(cg) = self.vmm().and_then(|v| v.cgroup) {
            r.cpu_usage_us = cg.cpu_usage_us();
            r.memory_peak_bytes = cg.memory_peak_bytes();
        }
        r
    }

    pub fn state(&self) -> SandboxState {
        lock(&self.record).state()
    }

    /// Guest memory committed to it.
    pub fn memory_mib(&self) -> u64 {
        u64::from(lock(&self.record).memory_mib)
    }

    pub fn touch(&self) {
        *lock(&self.last_activity) = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        lock(&self.last_activity).elapsed()
    }

    pub fn age(&self) -> Duration {
        self.created.elapsed()
    }

    pub fn vmm(&self) -> Option<VmmProcess> {
        lock(&self.vmm).clone()
    }

    pub fn set_vmm(&self, v: VmmProcess) {
        *lock(&self.vmm) = Some(v);
    }

    pub fn is_ending(&self) -> bool {
        self.ending.load(Ordering::SeqCst)
    }

    /// Marks its end as begun; whether it already had.
    fn begin_end(&self) -> bool {
        self.ending.swap(true, Ordering::SeqCst)
    }

    pub fn update(&self, f: impl FnOnce(&mut Sandbox)) -> Sandbox {
        let mut r = lock(&self.record);
        f(&mut r);
        r.clone()
    }

    fn vmm_or_err(&self) -> ApiResult<VmmProcess> {
        self.vmm()
            .ok_or_else(|| ApiError::Internal(format!("sandbox {} has no VMM", self.id)))
    }

    /// Where its executions run.
    pub fn exec_target(&self) -> ApiResult<ExecTarget> {
        // One lock of the record (a second one in the same expression would wait for the
        // first's temporary guard forever).
        let (template_id, no_root) = {
            let r = lock(&self.record);
            (r.template_id.clone(), r.no_root)
        };
        Ok(ExecTarget {
            sandbox_id: self.id.clone(),
            tenant: self.tenant.clone(),
            template_id,
            agent: self.vmm_or_err()?.agent,
            env: self.env.clone(),
            secrets: self.secrets.clone(),
            no_root,
        })
    }

    /// Its files, for transfers of at most `max_file_bytes`.
    pub fn file_target(&self, max_file_bytes: u64) -> ApiResult<FileTarget> {
        let (disk_mib, no_root) = {
            let r = lock(&self.record);
            (r.disk_mib, r.no_root)
        };
        Ok(FileTarget {
            sandbox_id: self.id.clone(),
            agent: self.vmm_or_err()?.agent,
            policy: self.policy.clone(),
            disk_limit: u64::from(disk_mib) << 20,
            max_file_bytes,
            user: String::new(),
            exported: self.exported.clone(),
            no_root,
        })
    }
}

/// The sandboxes and what their lifecycle needs.
#[derive(Debug)]
pub struct Sandboxes {
    cfg: Arc<Config>,
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    templates: Arc<Templates>,
    pool: Arc<WarmPool>,
    host: Arc<VmmHost>,
    executions: Arc<Executions>,
    pub egress: Arc<crate::net::Egress>,
    /// Every tenant's volumes (`DATA_DIR/volumes`).
    pub volumes: Arc<crate::volumes::Volumes>,
    live: Mutex<HashMap<String, Arc<SandboxRt>>>,
    /// Template builds running now: (tenant, guest MiB) by a build's id.
    builds: Mutex<HashMap<u64, (String, u64)>>,
    next_build: std::sync::atomic::AtomicU64,
    slots: admission::StartSlots,
    /// Cluster mode: where sandboxes are counted across the nodes.
    ledger: std::sync::OnceLock<Arc<dyn Ledger>>,
    /// What seals its secrets at rest for a restarted daemon (none: sealing is off, or its
    /// key could not be had).
    pub sealer: Option<Arc<crate::secrets::seal::Sealer>>,
}

/// A template build admitted like a sandbox; it stops counting when dropped.
#[derive(Debug)]
pub struct AdmittedBuild {
    sandboxes: Arc<Sandboxes>,
    id: u64,
}

impl Drop for AdmittedBuild {
    fn drop(&mut self) {
        lock(&self.sandboxes.builds).remove(&self.id);
    }
}

impl Sandboxes {
    pub fn new(
        cfg: Arc<Config>,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
        templates: Arc<Templates>,
        pool: Arc<WarmPool>,
        host: Arc<VmmHost>,
        executions: Arc<Executions>,
    ) -> Result<Self, StartError> {
        let slots = admission::StartSlots::new(cfg.concurrent_starts(), cfg.max_start_queue);
        let packages = Arc::new(crate::pkg::Packages::new(
            cfg.packages.clone(),
            &cfg.data_dir,
            &cfg.package_ceilings(),
            store.clone(),
            metrics.clone(),
        )?);
        let egress = Arc::new(crate::net::Egress::new(
            cfg.network.clone(),
            &cfg.egress_ceilings(),
            store.clone(),
            metrics.clone(),
            packages,
        )?);
        // Next to the run directories, in the data directory.
        let volumes = Arc::new(
            crate::volumes::Volumes::load(
                host.run_root().with_file_name("volumes"),
                store.clone(),
                cfg.mkfs_ext4.as_deref(),
                cfg.volume_slots,
                cfg.max_volume_size_mib,
            )
            .map_err(|source| StartError::Part {
                part: "volumes",
                source,
            })?,
        );
        let sealer = crate::secrets::seal::Sealer::load(&cfg.secrets, &cfg.data_dir)
            .unwrap_or_else(|e| {
                tracing::error!(
                    "secrets will not be sealed at rest: {e}; a sandbox with secrets will not \
                     survive a restart of the daemon"
                );
                None
            })
            .map(Arc::new);
        Ok(Self {
            sealer,
            cfg,
            store,
            metrics,
            templates,
            pool,
            host,
            executions,
            egress,
            volumes,
            live: Mutex::new(HashMap::new()),
            builds: Mutex::new(HashMap::new()),
            next_build: Default::default(),
            slots,
            ledger: std::sync::OnceLock::new(),
        })
    }

    /// Cluster mode: sandboxes are counted in `ledger` from now on.
    pub fn set_ledger(&self, ledger: Arc<dyn Ledger>) -> Result<(), Arc<dyn Ledger>> {
        self.ledger.set(ledger)
    }

    /// The cluster's ledger (cluster mode).
    pub fn ledger(&self) -> Option<&Arc<dyn Ledger>> {
        self.ledger.get()
    }

    fn live_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<SandboxRt>>> {
        lock(&self.live)
    }

    /// Every live sandbox.
    pub fn all(&self) -> Vec<Arc<SandboxRt>> {
        self.live_map().values().cloned().collect()
    }

    /// A live sandbox by id, whoever's.
    pub fn by_id(&self, id: &str) -> Option<Arc<SandboxRt>> {
        self.live_map().get(id).cloned()
    }

    /// A live sandbox of `tenant` (others' are "not found").
    pub fn live(&self, tenant: &str, id: &str) -> Option<Arc<SandboxRt>> {
        self.by_id(id).filter(|s| s.tenant == tenant)
    }

    /// Registers an adopted sandbox (after a restart).
    pub fn insert(&self, rt: Arc<SandboxRt>) {
        self.live_map().insert(rt.id.clone(), rt);
    }

    /// A sandbox record of `tenant`, live or ended.
    pub fn get(&self, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        if let Some(s) = self.live(tenant, id) {
            s.touch();
            return Ok(s.snapshot());
        }
        match self.store.sandbox(id)? {
            Some(s) if s.tenant == tenant => Ok(s),
            _ => Err(ApiError::SandboxNotFound(id.to_owned())),
        }
    }

    /// `tenant`'s sandboxes with all of `labels`, in `states` (default: the live ones).
    pub fn list(
        &self,
        tenant: &str,
        labels: &HashMap<String, String>,
        states: &[i32],
    ) -> ApiResult<Vec<Sandbox>> {
        let live: HashMap<String, Sandbox> = self
            .live_map()
            .values()
            .filter(|s| s.tenant == tenant)
            .map(|s| (s.id.clone(), s.snapshot()))
            .collect();
        let default_states = [
            SandboxState::Starting as i32,
            SandboxState::Running as i32,
            SandboxState::Paused as i32,
        ];
        let states = if states.is_empty() {
            &default_states[..]
        } else {
            states
        };
        Ok(self
            .store
            .sandboxes(Some(tenant))?
            .into_iter()
            .map(|s| live.get(&s.id).cloned().unwrap_or(s))
            .filter(|s| states.contains(&s.state))
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .collect())
    }

    /// A live sandbox of `tenant` in `state` (errors say why not).
    pub fn in_state(
        &self,
        tenant: &str,
        id: &str,
        state: SandboxState,
    ) -> ApiResult<Arc<SandboxRt>> {
        match self.live(tenant, id) {
            Some(rt) if rt.state() == state => {
                rt.touch();
                Ok(rt)
            }
            Some(rt) => Err(ApiError::SandboxNotRunning {
                id: id.to_owned(),
                state: state_name(rt.state()).into(),
            }),
            None => match self.store.sandbox(id)? {
                Some(s) if s.tenant == tenant => Err(ended_error(&s)),
                _ => Err(ApiError::SandboxNotFound(id.to_owned())),
            },
        }
    }

    /// SetNetworkPolicy: a running or paused sandbox of `tenant` gets `network` (within its
    /// ceiling) at once.
    pub async fn set_network(
        &self,
        tenant: &str,
        id: &str,
        network: airlock_api::v1::NetworkPolicy,
    ) -> ApiResult<Sandbox> {
        let policy = self.egress.check(tenant, &network)?;
        let rt = match self.running(tenant, id) {
            Err(ApiError::SandboxNotRunning { .. }) => {
                self.in_state(tenant, id, SandboxState::Paused)?
            }
            other => other?,
        };
        let _op = rt.ops.lock().await;
        if let Some(net) = lock(&rt.net).as_ref() {
            net.set_policy(policy);
        }
        // The record keeps it (a restarted daemon serves the adopted sandbox by it).
        let r = rt.update(|r| r.network = Some(network));
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    /// A running or paused sandbox of `tenant` ends `secs` from now (within the lifetime cap),
    /// and not before for being idle: its lifetime and idle TTL both move.
    pub fn set_timeout(&self, tenant: &str, id: &str, secs: u32) -> ApiResult<Sandbox> {
        let rt = match self.running(tenant, id) {
            Err(ApiError::SandboxNotRunning { .. }) => {
                self.in_state(tenant, id, SandboxState::Paused)?
            }
            other => other?,
        };
        rt.touch();
        let age = u32::try_from(rt.age().as_secs()).unwrap_or(u32::MAX);
        let lifetime = age.saturating_add(secs).min(self.cfg.max_lifetime_s);
        // Not `clamp`: it panics on a cap of 0 in the settings.
        let idle = secs.max(1).min(self.cfg.max_idle_ttl_s);
        let r = rt.update(|r| {
            r.max_lifetime_s = lifetime;
            r.idle_ttl_s = idle;
        });
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    /// ExposePort: guest port `port` of a running sandbox of `tenant`, on a host listener.
    pub fn expose(
        &self,
        tenant: &str,
        id: &str,
        port: u32,
        ttl_s: u32,
    ) -> ApiResult<airlock_api::v1::Exposure> {
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| ApiError::InvalidArgument(format!("{port} is not a TCP port")))?;
        let rt = self.running(tenant, id)?;
        let net = lock(&rt.net);
        let net = net.as_ref().ok_or_else(|| {
            ApiError::InvalidArgument(format!(
                "sandbox {id} has no network (the daemon runs with [jail] network = false)"
            ))
        })?;
        let e = net
            .expose(port, ttl_s)
            .map_err(|e| ApiError::Internal(format!("exposing port {port}: {e}")))?;
        tracing::info!(sandbox = %id, port, address = %e.address, "port exposed");
        Ok(airlock_api::v1::Exposure {
            sandbox_id: id.to_owned(),
            guest_port: u32::from(port),
            address: e.address.to_string(),
            token: e.token,
            expires_unix_ms: e.expires_unix_ms,
        })
    }

    /// GetEgressLog: a sandbox of `tenant` (live or ended) and what `q` selects of its egress
    /// log.
    pub fn egress_log(
        &self,
        tenant: &str,
        id: &str,
        q: &crate::events::Query,
    ) -> ApiResult<(Vec<airlock_api::v1::EgressEvent>, u64)> {
        self.get(tenant, id)?;
        self.egress.log(id, q)
    }

    /// GetInstallLog: a sandbox of `tenant` (live or ended) and what `q` selects of its
    /// install log.
    pub fn install_log(
        &self,
        tenant: &str,
        id: &str,
        q: &crate::events::Query,
    ) -> ApiResult<(Vec<airlock_api::v1::InstallEvent>, u64)> {
        self.get(tenant, id)?;
        self.egress.packages.log(id, q)
    }

    /// A live, running sandbox of `tenant` (errors say why not).
    pub fn running(&self, tenant: &str, id: &str) -> ApiResult<Arc<SandboxRt>> {
        self.in_state(tenant, id, SandboxState::Running)
    }

    /// Live sandboxes by state and per-sandbox usage, for the metrics endpoint.
    pub fn usage(&self) -> (Vec<(SandboxState, u64)>, Vec<SandboxUsage>) {
        let mut by_state = vec![
            (SandboxState::Starting, 0),
            (SandboxState::Running, 0),
            (SandboxState::Paused, 0),
        ];
        let mut usage = Vec::new();
        for rt in self.all() {
            let r = rt.snapshot();
            if let Some(n) = by_state.iter_mut().find(|(s, _)| *s == r.state()) {
                n.1 += 1;
            }
            usage.push(SandboxUsage {
                id: r.id,
                tenant: r.tenant,
                cpu_usage_us: r.cpu_usage_us,
                memory_bytes: r.memory_peak_bytes,
            });
        }
        (by_state, usage)
    }
}

/// The error for a call on an ended sandbox.
pub fn ended_error(s: &Sandbox) -> ApiError {
    if s.state() == SandboxState::Dead {
        ApiError::Dead {
            id: s.id.clone(),
            reason: EndReason::from_code(&s.end_reason),
            message: s.end_message.clone(),
        }
    } else {
        ApiError::SandboxNotRunning {
            id: s.id.clone(),
            state: "destroyed".into(),
        }
    }
}

/// Where a cluster counts its sandboxes: each is reserved against its tenant's quota across
/// the nodes when admitted and released at its end (`cluster::EtcdLedger`; a single host has
/// none).
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Counts `record` (a new sandbox) against its tenant's quota cluster-wide.
    fn reserve<'a>(
        &'a self,
        record: &'a Sandbox,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ApiResult<()>> + Send + 'a>>;
    /// The sandbox ended (not waited for).
    fn release(&self, record: &Sandbox);
    /// This node's name.
    fn node(&self) -> String;
}

/// A new sandbox id.
fn new_sandbox_id() -> ApiResult<String> {
    Ok(ids::new_id(ids::Kind::Sandbox)?)
}
