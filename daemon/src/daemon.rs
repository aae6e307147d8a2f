//! The composition root: builds the daemon's parts from the settings and wires them (the
//! supervisor's VMM exits reach the pools and sandboxes here), recovers what a previous daemon
//! left, runs the background tasks, and stops.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use airlock_api::v1::{CreateTemplateRequest, SandboxState, TemplateEvent, Usage};
use tokio::sync::mpsc::{Sender, UnboundedReceiver};
use tracing::{info, warn};

use crate::cgroup::Cgroups;
use crate::config::{CgroupMode, Config};
use crate::error::{ApiError, ApiResult, StartError};
use crate::exec::{ExecLimits, Executions};
use crate::host::VmmHost;
use crate::jail::Jailer;
use crate::metrics::Metrics;
use crate::pool::WarmPool;
use crate::reason::{EndReason, state_name};
use crate::recovery::Recovery;
use crate::retention::Retention;
use crate::sandbox::Sandboxes;
use crate::store::{Owner, Store};
use crate::supervisor::{Supervisor, VmmExited};
use crate::templates::build::Builder;
use crate::templates::{TemplateRt, Templates};
use crate::vmm::Launcher;

/// The daemon's parts.
#[derive(Debug)]
pub struct Daemon {
    pub cfg: Arc<Config>,
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub host: Arc<VmmHost>,
    pub templates: Arc<Templates>,
    pub builder: Arc<Builder>,
    pub pool: Arc<WarmPool>,
    pub executions: Arc<Executions>,
    pub sandboxes: Arc<Sandboxes>,
    pub retention: Arc<Retention>,
    pub data_dir: PathBuf,
}

/// Sets `p`'s permission bits to `mode`.
fn private(p: &Path, mode: u32) -> Result<(), StartError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(StartError::io(p.display().to_string()))
}

/// Makes `d` (and its parents) if missing.
fn make_dir(d: &Path) -> Result<(), StartError> {
    std::fs::create_dir_all(d).map_err(StartError::io(format!("creating {}", d.display())))
}

/// The cgroups sandboxes get: a hierarchy that is not usable stops the daemon unless the
/// settings allow sandboxes without limits (fail closed).
fn sandbox_cgroups(
    mode: CgroupMode,
    detected: std::io::Result<Cgroups>,
) -> Result<Option<Cgroups>, StartError> {
    match (detected, mode) {
        (Ok(c), _) => {
            info!(version = c.version(), "sandbox cgroups");
            Ok(Some(c))
        }
        (Err(e), CgroupMode::Off) => {
            warn!(
                "no cgroups (cgroups = \"off\"): sandboxes run without CPU/memory/pid limits: {e}"
            );
            Ok(None)
        }
        (Err(e), CgroupMode::Required) => Err(StartError::Setting(format!(
            "no usable cgroup hierarchy ({e}): sandboxes would run without memory, CPU and pid \
             limits; set cgroups = \"off\" to allow that"
        ))),
    }
}

/// Build step: the data directory and its run, templates and output directories (returned in
/// that order), made if missing; the data directory is the daemon's alone.
fn data_dirs(data_dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf), StartError> {
    let (run_dir, templates_dir, output_dir) = (
        data_dir.join("run"),
        data_dir.join("templates"),
        data_dir.join("output"),
    );
    for d in [data_dir, &*run_dir, &*templates_dir, &*output_dir] {
        make_dir(d)?;
    }
    // Records, output and snapshots are the daemon's: nobody else on the host reads them
    // (a VMM reads its template's files through the bind mounts of its jail).
    private(data_dir, 0o700)?;
    Ok((run_dir, templates_dir, output_dir))
}

/// Build step: the record store under `data_dir`, its events migrated, the audit log on it.
fn open_store(data_dir: &Path, cfg: &Config) -> Result<Arc<Store>, StartError> {
    let db = data_dir.join("airlock.db");
    let store = Arc::new(Store::open(&db)?);
    let moved = crate::events::migrate(&store)?;
    if moved > 0 {
        tracing::info!(events = moved, "sandbox logs moved to the one event table");
    }
    crate::audit::init(store.clone(), cfg.audit.clone());
    private(&db, 0o600)?;
    Ok(store)
}

/// Build step: the exported templates of `dirs` imported (one that is not is logged).
fn import_templates(templates: &Templates, dirs: &[PathBuf]) {
    for dir in dirs {
        match templates.import_exported(dir) {
            Ok(Some(t)) => info!(
                template = %t.record.name,
                id = %t.record.id,
                from = %dir.display(),
                "template imported"
            ),
            Ok(None) => {}
            Err(e) => warn!(from = %dir.display(), "template not imported: {e}"),
        }
    }
}

/// Build step: the executions' limits, as the settings have them.
fn exec_limits(cfg: &Config) -> ExecLimits {
    ExecLimits {
        default_timeout_ms: cfg.default_exec_timeout_ms,
        max_timeout_ms: cfg.max_exec_timeout_ms,
        max_output_bytes: cfg.max_output_bytes,
        max_output_read_bytes: cfg.max_output_read_bytes,
    }
}

impl Daemon {
    /// The daemon of `cfg`: its data directory, record store, cgroups and jail.
    pub fn open(cfg: Config) -> Result<(Arc<Self>, UnboundedReceiver<VmmExited>), StartError> {
        // Absolute: the same paths name files in the daemon and in the VMMs' jails.
        let data_dir = std::path::absolute(&cfg.data_dir).map_err(StartError::io(format!(
            "data directory {}",
            cfg.data_dir.display()
        )))?;
        let jailer = Jailer::new(cfg.jail.clone(), &cfg.vmm_binary(), &data_dir.join("jail"))
            .map_err(StartError::io("jail"))?;
        let detected = Cgroups::detect(Path::new("/sys/fs/cgroup"), &cfg.cgroup_parent);
        let cgroups = sandbox_cgroups(cfg.cgroups, detected)?;
        Self::build(cfg, data_dir, Arc::new(jailer), cgroups)
    }

    /// The daemon with `launcher` starting its VMMs (the seam unit tests fill with fakes).
    pub fn build(
        cfg: Config,
        data_dir: PathBuf,
        launcher: Arc<dyn Launcher>,
        cgroups: Option<Cgroups>,
    ) -> Result<(Arc<Self>, UnboundedReceiver<VmmExited>), StartError> {
        let (run_dir, templates_dir, output_dir) = data_dirs(&data_dir)?;
        let cfg = Arc::new(cfg);
        let store = open_store(&data_dir, &cfg)?;
        let metrics = Arc::new(Metrics::default());
        let (supervisor, events) = Supervisor::new(store.clone());
        let host = Arc::new(VmmHost::new(
            launcher,
            cgroups,
            supervisor,
            metrics.clone(),
            run_dir,
            cfg.vmm_overhead_mib,
            cfg.vmm_pids_max,
        ));
        let templates = Arc::new(Templates::load(
            store.clone(),
            templates_dir,
            &cfg.default_tenant,
        )?);
        import_templates(&templates, &cfg.import_templates);
        let builder = Arc::new(Builder::new(cfg.clone(), host.clone(), templates.clone()));
        let pool = Arc::new(WarmPool::new(
            cfg.pool_size,
            cfg.max_disk_mib,
            host.clone(),
            templates.clone(),
        ));
        let executions = Arc::new(Executions::new(
            exec_limits(&cfg),
            output_dir,
            store.clone(),
            metrics.clone(),
        ));
        let sandboxes = Arc::new(Sandboxes::new(
            cfg.clone(),
            store.clone(),
            metrics.clone(),
            templates.clone(),
            pool.clone(),
            host.clone(),
            executions.clone(),
        )?);
        let retention = Arc::new(Retention {
            cfg: cfg.clone(),
            store: store.clone(),
            executions: executions.clone(),
        });
        let d = Self {
            cfg,
            store,
            metrics,
            host,
            templates,
            builder,
            pool,
            executions,
            sandboxes,
            retention,
            data_dir,
        };
        Ok((Arc::new(d), events))
    }

    /// Adopts or reaps what a previous daemon left, then starts the background work: VMM exits
    /// reach their owners, TTLs are enforced, warm pools fill.
    pub async fn start(
        self: &Arc<Self>,
        mut events: UnboundedReceiver<VmmExited>,
    ) -> ApiResult<()> {
        let me = self.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                let d = me.clone();
                tokio::spawn(async move { d.on_vmm_exit(ev).await });
            }
        });
        Recovery {
            store: &self.store,
            host: &self.host,
            sandboxes: &self.sandboxes,
            executions: &self.executions,
            adopt: self.cfg.adopt_on_restart,
        }
        .run()
        .await?;
        // What still runs under a jail uid now is not ours: never hand that uid out.
        self.host.launcher.skip_uids_in_use();
        tokio::spawn(crate::janitor::run(
            self.sandboxes.clone(),
            self.executions.clone(),
        ));
        tokio::spawn(self.retention.clone().run());
        self.pool.refill_all();
        Ok(())
    }

    /// A VMM ended: its owner learns of it; what it had on the host goes.
    async fn on_vmm_exit(&self, ev: VmmExited) {
        match &ev.owner {
            Some(Owner::Sandbox(id)) => self.sandboxes.vmm_exited(id, &ev).await,
            Some(Owner::Pool(tid)) => {
                self.pool.exited(tid, &ev.vmm);
                ev.vmm.remove_leftovers();
            }
            _ => ev.vmm.remove_leftovers(),
        }
    }

    /// CreateTemplate; its warm pool starts filling once it is ready.
    pub async fn create_template(
        &self,
        tenant: &str,
        req: CreateTemplateRequest,
        progress: Sender<TemplateEvent>,
    ) -> ApiResult<TemplateRt> {
        if let Some(oci) = &req.oci {
            self.check_registry(tenant, &oci.reference)?;
        }
        let mut checked = self.builder.check(tenant, &req)?;
        checked.check_host = Some(self.host_check(tenant));
        // A build's VM counts against the host and the tenant like a sandbox while it runs.
        let _admitted = self.sandboxes.admit_build(tenant, checked.memory_mib())?;
        let t = self.builder.build(checked, progress).await?;
        self.pool.refill(&t);
        Ok(t)
    }

    /// An image pull is egress like a sandbox's: `reference`'s registry must be within the
    /// tenant's ceiling.
    pub fn check_registry(&self, tenant: &str, reference: &str) -> ApiResult<()> {
        let rule = crate::oci::pull::registry_rule(reference, &self.cfg.oci.insecure_registries)
            .map_err(|e| ApiError::ImageRefused {
                image: reference.to_owned(),
                why: e.to_string(),
            })?;
        let policy = crate::net::policy_of(&rule)?;
        self.sandboxes.egress.within_ceiling(tenant, &policy)
    }

    /// The check of every other host an image pull of `tenant`'s is sent to (a redirect's, the
    /// token realm's): within the tenant's egress ceiling, as the registry's own host.
    pub fn host_check(&self, tenant: &str) -> crate::oci::pull::HostCheck {
        let (egress, tenant) = (self.sandboxes.egress.clone(), tenant.to_owned());
        Arc::new(move |host: &str, port: u16| {
            let rule = crate::oci::pull::host_rule(host, port);
            let policy = crate::net::policy_of(&rule)?;
            egress.within_ceiling(&tenant, &policy)
        })
    }

    /// SnapshotSandbox; the new template's warm pool starts filling.
    pub async fn snapshot_sandbox(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
        shared: bool,
    ) -> ApiResult<TemplateRt> {
        let t = self.sandboxes.snapshot(tenant, id, name, shared).await?;
        self.pool.refill(&t);
        Ok(t)
    }

    /// Deletes `tenant`'s template version `reference` (NAME:TAG, or NAME for its `latest` or
    /// only version): refused while live sandboxes were restored from it; its warm pool goes.
    pub fn delete_template(&self, tenant: &str, reference: &str) -> ApiResult<()> {
        let t = self.templates.own(tenant, reference)?;
        let users = self.template_users(&t.record.id);
        if !users.is_empty() {
            return Err(ApiError::TemplateInUse {
                name: crate::templates::reference(&t.record),
                count: users.len(),
                by: users.iter().take(5).cloned().collect::<Vec<_>>().join(","),
            });
        }
        let t = self.templates.remove_id(&t.record.id)?;
        self.pool.remove_template(&t.record.id);
        let _ = std::fs::remove_dir_all(&t.dir);
        self.release_image_rootfs(&t.record.rootfs_path);
        Ok(())
    }

    /// Removes an imported image's root filesystem (under `DATA_DIR/images/rootfs`) once no
    /// template is booted from it any more (the last version, step cache or build of it went);
    /// a later import of the same image makes it again from the cached layers.
    fn release_image_rootfs(&self, rootfs: &str) {
        let images = self.cfg.data_dir.join("images").join("rootfs");
        let path = Path::new(rootfs);
        if !path.starts_with(&images)
            || self
                .templates
                .list()
                .iter()
                .any(|t| t.record.rootfs_path == rootfs)
        {
            return;
        }
        // With its marker (`.shell`: the image has a /bin/sh).
        let _ = std::fs::remove_file(path.with_extension("shell"));
        match std::fs::remove_file(path) {
            Ok(()) => info!(rootfs, "image root filesystem removed: no template uses it"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(rootfs, "removing an unused image root filesystem: {e}"),
        }
    }

    /// The live sandboxes (starting, running or paused) restored from template `id`.
    pub fn template_users(&self, id: &str) -> Vec<String> {
        let mut users: Vec<String> = self
            .sandboxes
            .all()
            .into_iter()
            .map(|s| s.snapshot())
            .filter(|s| {
                s.template_id == id
                    && matches!(
                        SandboxState::try_from(s.state),
                        Ok(SandboxState::Starting | SandboxState::Running | SandboxState::Paused)
                    )
            })
            .map(|s| s.id)
            .collect();
        users.sort();
        users
    }

    /// GetUsage: what `tenant` holds now against its quota, and the retention.
    pub fn usage(&self, tenant: &str) -> ApiResult<Usage> {
        let quota = self.cfg.quota_of(tenant);
        let live: Vec<_> = self
            .sandboxes
            .all()
            .into_iter()
            .filter(|s| s.tenant == tenant)
            .collect();
        let owner = self.templates.owner_for(tenant);
        let templates: Vec<_> = self
            .templates
            .list()
            .into_iter()
            .filter(|t| t.record.tenant == owner)
            .collect();
        let output_bytes = self
            .store
            .executions_of_tenant(tenant)?
            .iter()
            .filter(|e| !e.output_deleted)
            .map(|e| self.retention.output_bytes(&e.id))
            .sum();
        let (sandbox_records, execution_records) = self.store.record_counts(tenant)?;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Ok(Usage {
            tenant: tenant.to_owned(),
            live_sandboxes: count(live.len()),
            max_sandboxes: count(quota.max_sandboxes),
            memory_mib: live.iter().map(|s| s.memory_mib()).sum(),
            max_memory_mib: quota.max_memory_mib,
            templates: count(templates.len()),
            max_templates: count(quota.max_templates),
            template_mib: templates
                .iter()
                .map(|t| t.record.memory_file_bytes >> 20)
                .sum(),
            max_template_mib: quota.max_template_mib,
            output_bytes,
            max_output_mib: quota.max_output_mib,
            sandbox_records,
            execution_records,
            record_retention_s: self.cfg.record_retention_s,
            output_retention_s: self.cfg.output_retention_s,
        })
    }

    /// The Prometheus exposition text.
    pub fn metrics_text(&self) -> String {
        let (states, usage) = self.sandboxes.usage();
        let mut by_state = std::collections::BTreeMap::new();
        for (s, n) in states {
            by_state.insert(state_name(s).to_owned(), n);
        }
        by_state.insert("warm_pool".into(), self.pool.len() as u64);
        let mut text = self.metrics.render(&by_state, &usage);
        text.push_str(&format!(
            "# HELP airlock_jail_uids_in_use Jail uids held by live VMM processes.\n\
             # TYPE airlock_jail_uids_in_use gauge\nairlock_jail_uids_in_use {}\n",
            self.host.launcher.uids_in_use()
        ));
        text
    }

    /// Stops: no new VMMs, warm ones killed; live sandboxes keep running for the next daemon
    /// (`adopt_on_restart`) or end as DAEMON_STOPPED. Creates in flight end either way.
    pub async fn shutdown(&self) {
        let wait = std::time::Duration::from_secs(5);
        self.host.stop();
        self.host.wait_starts(wait).await;
        for p in self.pool.drain() {
            p.wait_gone(wait).await;
            p.remove_leftovers();
        }
        if self.cfg.adopt_on_restart {
            // Executions being started get their agent ids recorded, so the next daemon
            // follows them.
            self.executions
                .settle(std::time::Duration::from_secs(10))
                .await;
            for rt in self.sandboxes.all() {
                if rt.state() == airlock_api::v1::SandboxState::Starting {
                    let _ = self
                        .sandboxes
                        .end(&rt, EndReason::DaemonStopped, "the daemon stopped")
                        .await;
                }
            }
            info!(
                sandboxes = self.sandboxes.all().len(),
                "stopping; live sandboxes keep running for the next daemon"
            );
        } else {
            self.sandboxes
                .end_all(EndReason::DaemonStopped, "the daemon stopped")
                .await;
        }
        // What is left but kept sandboxes' VMMs: warm VMMs that were starting.
        let kept = |o: &Owner| {
            self.cfg.adopt_on_restart
                && matches!(o, Owner::Sandbox(id) if self.sandboxes.by_id(id).is_some())
        };
        for v in self.host.supervisor.kill_all_but(kept) {
            v.wait_gone(wait).await;
            v.remove_leftovers();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_usable_cgroups_the_daemon_fails_closed() {
        let missing = || Err(std::io::Error::other("no hierarchy"));
        let err = sandbox_cgroups(CgroupMode::Required, missing())
            .unwrap_err()
            .to_string();
        assert!(err.contains("cgroups = \"off\""), "{err}");
        assert!(matches!(
            sandbox_cgroups(CgroupMode::Off, missing()),
            Ok(None)
        ));
    }
}
