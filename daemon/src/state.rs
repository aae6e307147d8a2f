//! The daemon's state and every lifecycle operation: templates, warm pools, sandboxes (create,
//! pause, resume, snapshot, destroy), VMM death, TTLs, and reaping after a restart. The gRPC
//! layer (`service.rs`) only checks tenants and converts messages.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use airlock_api::v1::{
    CreateSandboxRequest, FilePolicy, Sandbox, SandboxState, Template, TemplateEvent,
};
use tracing::{info, warn};

use crate::agent;
use crate::cgroup::{Cgroup, Cgroups, Limits};
use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::exec::ExecRt;
use crate::jail::Jailer;
use crate::metrics::{Metrics, SandboxUsage};
use crate::store::{ProcessRecord, Store};
use crate::vmm::{self, VmmProcess};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `prefix-` and 16 random hex digits.
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 8];
    random_bytes(&mut b);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// Whether `id` looks like an id with `prefix` (checked before touching the disk with it).
pub fn well_formed(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('-'))
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// Fills `buf` from the kernel's CSPRNG.
pub fn random_bytes(buf: &mut [u8]) {
    // SAFETY: getrandom(2) writes at most buf.len() bytes into the live buffer.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert_eq!(n, buf.len() as isize, "getrandom failed");
}

/// Template names: [a-z0-9][a-z0-9._-]{0,62}.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

/// A live sandbox (starting, running or paused).
#[derive(Debug)]
pub struct SandboxRt {
    pub id: String,
    pub tenant: String,
    pub record: Mutex<Sandbox>,
    pub vmm: Mutex<Option<VmmInfo>>,
    pub cgroup: Mutex<Option<Cgroup>>,
    pub env: HashMap<String, String>,
    pub policy: FilePolicy,
    pub last_activity: Mutex<Instant>,
    pub created: Instant,
    /// Serialises pause, resume, snapshot and destroy.
    pub ops: tokio::sync::Mutex<()>,
    /// Set once destroy has begun: the VMM's exit is then not a death.
    pub ending: std::sync::atomic::AtomicBool,
}

/// A sandbox's VMM process and sockets.
#[derive(Clone, Debug)]
pub struct VmmInfo {
    pub pid: u32,
    pub start_ticks: u64,
    pub run_dir: PathBuf,
    pub control: PathBuf,
    pub vsock: PathBuf,
}

impl SandboxRt {
    pub fn snapshot(&self) -> Sandbox {
        let mut r = self
            .record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(cg) = self
            .cgroup
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            r.cpu_usage_us = cg.cpu_usage_us();
            r.memory_peak_bytes = cg.memory_peak_bytes();
        }
        r
    }

    pub fn state(&self) -> SandboxState {
        SandboxState::try_from(self.record.lock().unwrap_or_else(|e| e.into_inner()).state)
            .unwrap_or(SandboxState::Unspecified)
    }

    /// Guest memory committed to it.
    pub fn memory_mib(&self) -> u64 {
        u64::from(
            self.record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .memory_mib,
        )
    }

    pub fn touch(&self) {
        *self.last_activity.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub fn vmm(&self) -> Option<VmmInfo> {
        self.vmm.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut Sandbox)) -> Sandbox {
        let mut r = self.record.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut r);
        r.clone()
    }
}

/// A usable template: its record and snapshot directory.
#[derive(Clone, Debug)]
pub struct TemplateRt {
    pub record: Template,
    pub dir: PathBuf,
}

/// Who a VMM process belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Owner {
    Pool(String),
    Sandbox(String),
}

/// The daemon.
#[derive(Debug)]
pub struct Daemon {
    pub cfg: Config,
    pub store: Store,
    pub metrics: Metrics,
    pub cgroups: Option<Cgroups>,
    /// Starts every VMM process in its jail.
    pub jailer: Arc<Jailer>,
    pub data_dir: PathBuf,
    run_dir: PathBuf,
    templates_dir: PathBuf,
    pub output_dir: PathBuf,
    templates: Mutex<Vec<TemplateRt>>,
    sandboxes: Mutex<HashMap<String, Arc<SandboxRt>>>,
    pub executions: Mutex<HashMap<String, Arc<ExecRt>>>,
    pools: Mutex<HashMap<String, Vec<VmmProcess>>>,
    owners: Mutex<HashMap<u32, Owner>>,
    /// Template ids whose pool is being refilled.
    refilling: Mutex<std::collections::HashSet<String>>,
    /// Set by `shutdown`: no new VMM processes.
    stopping: std::sync::atomic::AtomicBool,
    /// Restores allowed at once, and creates waiting for one.
    starts: Arc<tokio::sync::Semaphore>,
    start_queue: std::sync::atomic::AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Starting => "starting",
        SandboxState::Running => "running",
        SandboxState::Paused => "paused",
        SandboxState::Dead => "dead",
        SandboxState::Destroyed => "destroyed",
        SandboxState::Unspecified => "unknown",
    }
}

impl Daemon {
    /// Opens the data directory and the record store, finds the cgroup hierarchy, and reaps
    /// whatever a previous daemon left running.
    pub fn open(cfg: Config) -> Result<Arc<Self>, String> {
        // Absolute: the same paths name files in the daemon and in the VMMs' jails.
        let data_dir = std::path::absolute(&cfg.data_dir)
            .map_err(|e| format!("data directory {}: {e}", cfg.data_dir.display()))?;
        let run_dir = data_dir.join("run");
        let templates_dir = data_dir.join("templates");
        let output_dir = data_dir.join("output");
        for d in [&data_dir, &run_dir, &templates_dir, &output_dir] {
            std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))?;
        }
        let store = Store::open(&data_dir.join("airlock.db")).map_err(|e| e.to_string())?;
        let cgroups = match Cgroups::detect(Path::new("/sys/fs/cgroup"), &cfg.cgroup_parent) {
            Ok(c) => {
                info!(version = c.version(), "sandbox cgroups");
                Some(c)
            }
            Err(e) => {
                warn!("no cgroups, sandboxes run without CPU/memory/pid limits: {e}");
                None
            }
        };
        let templates = store
            .templates()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(record, dir)| TemplateRt {
                record,
                dir: PathBuf::from(dir),
            })
            .collect();
        let jailer = Jailer::new(cfg.jail.clone(), &cfg.vmm_binary(), &data_dir.join("jail"))
            .map_err(|e| format!("jail: {e}"))?;
        let starts = cfg.concurrent_starts();
        let d = Arc::new(Self {
            cfg,
            store,
            metrics: Metrics::default(),
            cgroups,
            jailer: Arc::new(jailer),
            data_dir,
            run_dir,
            templates_dir,
            output_dir,
            templates: Mutex::new(templates),
            sandboxes: Mutex::new(HashMap::new()),
            executions: Mutex::new(HashMap::new()),
            pools: Mutex::new(HashMap::new()),
            owners: Mutex::new(HashMap::new()),
            refilling: Mutex::new(Default::default()),
            stopping: Default::default(),
            starts: Arc::new(tokio::sync::Semaphore::new(starts)),
            start_queue: Default::default(),
        });
        d.reap_previous().map_err(|e| e.to_string())?;
        // What still runs under a jail uid now is not ours: never hand that uid out.
        d.jailer.skip_uids_in_use();
        Ok(d)
    }

    /// After a restart: kills every VMM process a previous daemon started, removes their run
    /// directories and cgroups, and ends the records of their sandboxes and executions.
    fn reap_previous(&self) -> ApiResult<()> {
        let killed = self.reap_processes()?;
        self.reap_leftovers();
        self.end_orphaned_records(killed)
    }

    /// Kills every recorded VMM process and removes its cgroup, run directory and record.
    fn reap_processes(&self) -> ApiResult<usize> {
        let mut killed = 0;
        for p in self.store.processes()? {
            if vmm::kill_verified(p.pid, p.start_ticks) {
                killed += 1;
            }
            // Wait for it to go (it is not our child: poll).
            let deadline = Instant::now() + Duration::from_secs(5);
            while vmm::start_ticks(p.pid) == Some(p.start_ticks)
                && !vmm::is_zombie(p.pid)
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            if !p.cgroup.is_empty()
                && let Some(cg) = &self.cgroups
            {
                let _ = cg.cgroup(&p.cgroup).remove();
            }
            let _ = std::fs::remove_dir_all(&p.run_dir);
            self.store.remove_process(p.pid, p.start_ticks)?;
        }
        Ok(killed)
    }

    fn reap_leftovers(&self) {
        // Cgroups and run directories without a process record (a crash between steps).
        if let Some(cg) = &self.cgroups {
            for name in cg.existing() {
                if well_formed(&name, "vm") {
                    let _ = cg.cgroup(&name).remove();
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.run_dir) {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Ends the records of sandboxes and executions that were live when the last daemon went.
    fn end_orphaned_records(&self, killed: usize) -> ApiResult<()> {
        let mut ended = 0;
        for mut s in self.store.sandboxes(None)? {
            let state = SandboxState::try_from(s.state).unwrap_or(SandboxState::Unspecified);
            if matches!(
                state,
                SandboxState::Starting | SandboxState::Running | SandboxState::Paused
            ) {
                s.state = SandboxState::Dead as i32;
                s.end_reason = "DAEMON_RESTARTED".into();
                s.end_message = "the daemon restarted; the sandbox's VMM was reaped".into();
                s.ended_unix_ms = now_ms();
                self.store.put_sandbox(&s)?;
                for mut e in self.store.executions_of(&s.id)? {
                    if e.state == airlock_api::v1::ExecutionState::Running as i32 {
                        crate::exec::end_lost(&mut e, "DAEMON_RESTARTED", "the daemon restarted");
                        self.store.put_execution(&e)?;
                    }
                }
                ended += 1;
            }
        }
        if killed > 0 || ended > 0 {
            info!(killed, ended, "reaped what the previous daemon left");
        }
        Ok(())
    }

    // ---- templates ----

    /// Templates `tenant` can use: its own and the shared ones.
    pub fn templates_for(&self, tenant: &str) -> Vec<TemplateRt> {
        lock(&self.templates)
            .iter()
            .filter(|t| t.record.tenant.is_empty() || t.record.tenant == tenant)
            .cloned()
            .collect()
    }

    /// The template `name` as `tenant` sees it (its own first, then a shared one).
    pub fn find_template(&self, tenant: &str, name: &str) -> ApiResult<TemplateRt> {
        let all = self.templates_for(tenant);
        all.iter()
            .find(|t| t.record.name == name && t.record.tenant == tenant)
            .or_else(|| all.iter().find(|t| t.record.name == name))
            .cloned()
            .ok_or_else(|| ApiError::TemplateNotFound(name.to_owned()))
    }

    /// The tenant a template created by `tenant` belongs to: the default tenant's templates are
    /// shared (the operator's), every other tenant's are its own.
    fn template_owner(&self, tenant: &str) -> String {
        if tenant == self.cfg.default_tenant {
            String::new()
        } else {
            tenant.to_owned()
        }
    }

    fn check_new_template_name(&self, tenant: &str, name: &str) -> ApiResult<String> {
        if !valid_name(name) {
            return Err(ApiError::InvalidArgument(format!(
                "template name {name:?}: use [a-z0-9][a-z0-9._-]{{0,62}}"
            )));
        }
        let owner = self.template_owner(tenant);
        if lock(&self.templates)
            .iter()
            .any(|t| t.record.name == name && t.record.tenant == owner)
        {
            return Err(ApiError::TemplateExists(name.to_owned()));
        }
        Ok(owner)
    }

    /// Builds a template: one cold boot and a snapshot. Progress goes to `progress`.
    pub async fn create_template(
        self: &Arc<Self>,
        tenant: &str,
        req: airlock_api::v1::CreateTemplateRequest,
        progress: tokio::sync::mpsc::Sender<TemplateEvent>,
    ) -> ApiResult<Template> {
        let owner = self.check_new_template_name(tenant, &req.name)?;
        let kernel = non_empty(&req.kernel_path)
            .or_else(|| self.cfg.default_kernel())
            .ok_or_else(|| {
                ApiError::InvalidArgument(
                    "no kernel given and none built: run kernel-config/build.sh".into(),
                )
            })?;
        let rootfs = non_empty(&req.rootfs_path)
            .or_else(|| self.cfg.default_rootfs())
            .ok_or_else(|| {
                ApiError::InvalidArgument(
                    "no root filesystem given and none built: run rootfs/build.sh".into(),
                )
            })?;
        for (what, p) in [("kernel", &kernel), ("root filesystem", &rootfs)] {
            if !p.is_file() {
                return Err(ApiError::InvalidArgument(format!(
                    "{what} {} is not a file on the daemon's host",
                    p.display()
                )));
            }
        }
        // Canonical: the jails of the template's VMMs hold these files at these paths.
        let kernel = std::fs::canonicalize(&kernel)?;
        let rootfs = std::fs::canonicalize(&rootfs)?;
        let vcpus = if req.vcpus == 0 { 1 } else { req.vcpus };
        let memory_mib = if req.memory_mib == 0 {
            256
        } else {
            req.memory_mib
        };
        if !(1..=32).contains(&vcpus) || !(64..=1 << 20).contains(&memory_mib) {
            return Err(ApiError::InvalidArgument(
                "vcpus must be 1..32 and memory_mib 64..1048576".into(),
            ));
        }
        let id = new_id("tpl");
        let dir = self.templates_dir.join(&id);
        let started = Instant::now();
        let send = |phase: &str, message: String, template: Option<Template>| {
            let ev = TemplateEvent {
                phase: phase.into(),
                elapsed_ms: started.elapsed().as_millis() as u64,
                message,
                template,
            };
            let tx = progress.clone();
            async move {
                let _ = tx.send(ev).await;
            }
        };
        send(
            "booting",
            format!(
                "cold boot of {} with {} ({vcpus} vCPU, {memory_mib} MiB)",
                kernel.display(),
                rootfs.display()
            ),
            None,
        )
        .await;
        let warmup = if req.no_warmup {
            String::new()
        } else if req.warmup.is_empty() {
            self.cfg.template_warmup.clone()
        } else {
            req.warmup.clone()
        };
        // The build runs on its own task: a client that goes away does not leave a VMM, a
        // cgroup or a run directory behind (the build finishes, or fails, and cleans up).
        let me = self.clone();
        let (k, r) = (kernel.clone(), rootfs.clone());
        let (build_dir, progress_tx) = (dir.clone(), progress.clone());
        let build = tokio::spawn(async move {
            me.build_template_snapshot(
                &k,
                &r,
                vcpus,
                memory_mib,
                &warmup,
                &build_dir,
                started,
                progress_tx,
            )
            .await
        });
        build
            .await
            .map_err(|e| ApiError::Internal(format!("template build task: {e}")))??;
        let record = Template {
            name: req.name.clone(),
            id: id.clone(),
            tenant: owner,
            vcpus,
            memory_mib,
            kernel_path: kernel.display().to_string(),
            kernel_version: file_version(&kernel),
            rootfs_path: rootfs.display().to_string(),
            rootfs_version: file_version(&rootfs),
            source_sandbox_id: String::new(),
            created_unix_ms: now_ms(),
            memory_file_bytes: disk_bytes(&dir.join("memory")),
        };
        self.add_template(record.clone(), dir)?;
        info!(template = %record.name, id = %record.id, ms = started.elapsed().as_millis() as u64, "template ready");
        send(
            "ready",
            format!("ready after {} s", started.elapsed().as_secs()),
            Some(record.clone()),
        )
        .await;
        Ok(record)
    }

    /// Boots `kernel` with `rootfs` once in a jailed `airlock-vmm snapshot`, runs `warmup`,
    /// and moves the snapshot it wrote (in its run directory) to `dir`, owned by root. Sends
    /// "still booting" every 5 s. The VMM, its cgroup and run directory are gone afterwards.
    #[expect(
        clippy::too_many_arguments,
        reason = "one build's parameters, passed once"
    )]
    async fn build_template_snapshot(
        self: &Arc<Self>,
        kernel: &Path,
        rootfs: &Path,
        vcpus: u32,
        memory_mib: u32,
        warmup: &str,
        dir: &Path,
        started: Instant,
        progress: tokio::sync::mpsc::Sender<TemplateEvent>,
    ) -> ApiResult<()> {
        let vm_id = new_id("vm");
        let run_dir = self.run_dir.join(&vm_id);
        std::fs::create_dir_all(&run_dir)?;
        let log_path = run_dir.join("vmm.log");
        let out_dir = run_dir.join("snapshot");
        let cgroup = self
            .make_cgroup(&vm_id, memory_mib, vcpus)
            .map_err(|e| ApiError::Internal(format!("VMM cgroup: {e}")))?;
        let cleanup = |cgroup: &Option<Cgroup>| {
            if let Some(cg) = cgroup {
                let _ = cg.remove();
            }
            let _ = std::fs::remove_dir_all(&run_dir);
        };
        let mut args = self.jailer.vmm_flags();
        args.extend(
            [
                "snapshot",
                "--cpu-template",
                vmm::cpu_template(),
                "--vcpus",
                &vcpus.to_string(),
                "--mem-mib",
                &memory_mib.to_string(),
                "--warmup",
                warmup,
            ]
            .map(std::ffi::OsString::from),
        );
        for (flag, path) in [
            ("--kernel", kernel),
            ("--rootfs", rootfs),
            ("--out", &out_dir),
        ] {
            args.push(flag.into());
            args.push(path.into());
        }
        let log = match File::create(&log_path) {
            Ok(f) => f,
            Err(e) => {
                cleanup(&cgroup);
                return Err(e.into());
            }
        };
        let launch = crate::jail::Launch {
            args,
            env: vmm::vmm_env(&run_dir),
            run_dir: run_dir.clone(),
            read_only: vec![kernel.to_path_buf(), rootfs.to_path_buf()],
            cgroup: cgroup.clone(),
            stdout: None,
            stderr: log,
        };
        let child = match vmm::spawn(&self.jailer, launch).await {
            Ok(c) => c,
            Err(e) => {
                cleanup(&cgroup);
                return Err(ApiError::Internal(format!(
                    "spawning {}: {e}",
                    self.jailer.binary().display()
                )));
            }
        };
        let (pid, ticks) = (child.pid, vmm::start_ticks(child.pid).unwrap_or(0));
        let recorded = self.store.add_process(&ProcessRecord {
            pid,
            start_ticks: ticks,
            run_dir: run_dir.display().to_string(),
            cgroup: if cgroup.is_some() {
                vm_id.clone()
            } else {
                String::new()
            },
        });
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        tick.tick().await;
        let wait = child.wait();
        tokio::pin!(wait);
        let status = loop {
            tokio::select! {
                st = &mut wait => break st,
                _ = tick.tick() => {
                    let ev = TemplateEvent {
                        phase: "booting".into(),
                        elapsed_ms: started.elapsed().as_millis() as u64,
                        message: format!("still booting ({} s)", started.elapsed().as_secs()),
                        template: None,
                    };
                    let _ = progress.send(ev).await;
                }
            }
        };
        let _ = self.store.remove_process(pid, ticks);
        let result = match status {
            Ok(st) if st.success() => std::fs::rename(&out_dir, dir)
                .and_then(|()| crate::jail::take_ownership(dir))
                .map_err(|e| ApiError::Internal(format!("moving the snapshot: {e}"))),
            Ok(st) => Err(ApiError::Internal(format!(
                "the template boot failed ({st}): {}",
                vmm::log_tail(&log_path)
            ))),
            Err(e) => Err(ApiError::Internal(format!(
                "waiting for the template VMM: {e}"
            ))),
        };
        if result.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        cleanup(&cgroup);
        recorded?;
        result
    }

    fn add_template(self: &Arc<Self>, record: Template, dir: PathBuf) -> ApiResult<()> {
        let mut all = lock(&self.templates);
        if all
            .iter()
            .any(|t| t.record.name == record.name && t.record.tenant == record.tenant)
        {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(ApiError::TemplateExists(record.name));
        }
        self.store
            .put_template(&record, &dir.display().to_string())?;
        all.push(TemplateRt { record, dir });
        Ok(())
    }

    /// Deletes `tenant`'s template `name` (the default tenant deletes shared ones).
    pub fn delete_template(&self, tenant: &str, name: &str) -> ApiResult<()> {
        let owner = self.template_owner(tenant);
        let t = {
            let mut all = lock(&self.templates);
            let i = all
                .iter()
                .position(|t| t.record.name == name && t.record.tenant == owner)
                .ok_or_else(|| ApiError::TemplateNotFound(name.to_owned()))?;
            all.remove(i)
        };
        self.store.delete_template(&t.record.id)?;
        // Its warm pool goes; running sandboxes keep their mappings (the files stay until the
        // last one ends: unlinked files stay mapped).
        for mut p in lock(&self.pools).remove(&t.record.id).unwrap_or_default() {
            p.kill();
            if let Some(cg) = &p.cgroup {
                let _ = cg.remove();
            }
        }
        let _ = std::fs::remove_dir_all(&t.dir);
        Ok(())
    }

    // ---- pools ----

    /// Keeps `pool_size` warm VMM processes for `template`.
    pub fn refill_pool(self: &Arc<Self>, template: &TemplateRt) {
        if self.cfg.pool_size == 0 || !lock(&self.refilling).insert(template.record.id.clone()) {
            return;
        }
        let me = self.clone();
        let t = template.clone();
        tokio::spawn(async move {
            loop {
                let have = lock(&me.pools).get(&t.record.id).map_or(0, Vec::len);
                let exists = lock(&me.templates)
                    .iter()
                    .any(|x| x.record.id == t.record.id);
                if have >= me.cfg.pool_size
                    || !exists
                    || me.stopping.load(std::sync::atomic::Ordering::SeqCst)
                {
                    break;
                }
                match me.spawn_vmm(&t, Owner::Pool(t.record.id.clone())).await {
                    Ok(p) => lock(&me.pools)
                        .entry(t.record.id.clone())
                        .or_default()
                        .push(p),
                    Err(e) => {
                        warn!(template = %t.record.name, "warm pool: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            lock(&me.refilling).remove(&t.record.id);
        });
    }

    /// Fills the pools of every template (at start).
    pub fn refill_all(self: &Arc<Self>) {
        let all = lock(&self.templates).clone();
        for t in &all {
            self.refill_pool(t);
        }
    }

    /// Spawns a pool VMM for `template` in its jail and cgroup, records it for reaping and
    /// watches its exit.
    async fn spawn_vmm(self: &Arc<Self>, t: &TemplateRt, owner: Owner) -> ApiResult<VmmProcess> {
        let vm_id = new_id("vm");
        let run_dir = self.run_dir.join(&vm_id);
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ApiError::Internal("the daemon is stopping".into()));
        }
        // The cgroup is made first (the template fixes the limits), so that the VMM runs in it
        // from its first instruction and a create only restores.
        let cgroup = self
            .make_cgroup(&vm_id, t.record.memory_mib, t.record.vcpus)
            .map_err(|e| ApiError::Internal(format!("VMM cgroup: {e}")))?;
        let t0 = Instant::now();
        let spec = vmm::PoolSpec {
            vcpus: t.record.vcpus,
            snapshot_dir: t.dir.clone(),
            rootfs: PathBuf::from(&t.record.rootfs_path),
        };
        let spawned =
            VmmProcess::spawn_pool(&self.jailer, run_dir.clone(), &spec, cgroup.clone()).await;
        let mut p = match spawned {
            Ok(p) => p,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.remove();
                }
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(ApiError::Internal(format!("starting a VMM: {e}")));
            }
        };
        let spawn_s = t0.elapsed().as_secs_f64();
        // Watched at once: whatever fails from here on, its exit cleans up after it.
        self.watch_exit(&mut p, owner);
        // Recorded, so that a restarted daemon reaps it.
        let recorded = self.store.add_process(&ProcessRecord {
            pid: p.pid,
            start_ticks: p.start_ticks,
            run_dir: p.run_dir.display().to_string(),
            cgroup: if cgroup.is_some() {
                vm_id.clone()
            } else {
                String::new()
            },
        });
        if let Err(e) = recorded {
            p.kill();
            return Err(e);
        }
        if let Err(e) = p.wait_ready().await {
            p.kill();
            return Err(ApiError::Internal(format!("starting a VMM: {e}")));
        }
        self.metrics
            .observe_vmm_start(spawn_s, t0.elapsed().as_secs_f64());
        Ok(p)
    }

    /// The cgroup of a VMM with a guest of `memory_mib` and `vcpus` (none without cgroups).
    fn make_cgroup(
        &self,
        name: &str,
        memory_mib: u32,
        vcpus: u32,
    ) -> std::io::Result<Option<Cgroup>> {
        let Some(cgs) = &self.cgroups else {
            return Ok(None);
        };
        let limits = Limits {
            memory_bytes: (u64::from(memory_mib) + self.cfg.vmm_overhead_mib) << 20,
            cpus: vcpus,
            pids: self.cfg.vmm_pids_max,
        };
        match cgs.create(name, limits) {
            Ok(cg) => Ok(Some(cg)),
            Err(e) => {
                let _ = cgs.cgroup(name).remove();
                Err(e)
            }
        }
    }

    /// Registers `p` with `owner` and starts the task that waits for its exit. The exit
    /// cleans up what the VMM had (record, run directory, cgroup, uid), whoever ended it.
    fn watch_exit(self: &Arc<Self>, p: &mut VmmProcess, owner: Owner) {
        lock(&self.owners).insert(p.pid, owner);
        if let Some(child) = p.child.take() {
            let me = self.clone();
            let (pid, ticks, run_dir) = (p.pid, p.start_ticks, p.run_dir.clone());
            let cgroup = p.cgroup.clone();
            tokio::spawn(async move {
                let status = child.wait().await;
                me.vmm_exited(pid, ticks, &run_dir, cgroup, status.ok())
                    .await;
            });
        }
    }

    /// A VMM process ended (and was reaped: its uid is free again): forget it, and if it was a
    /// live sandbox's, that sandbox is dead. What the VMM had on the host goes, whoever ended
    /// it: a sandbox's through `end_sandbox`, anyone else's here (record, cgroup, run
    /// directory; its jail's mounts were in its own mount namespace and went with it).
    async fn vmm_exited(
        self: &Arc<Self>,
        pid: u32,
        ticks: u64,
        run_dir: &Path,
        cgroup: Option<Cgroup>,
        status: Option<std::process::ExitStatus>,
    ) {
        let owner = lock(&self.owners).remove(&pid);
        let _ = self.store.remove_process(pid, ticks);
        let sandbox = match &owner {
            Some(Owner::Sandbox(id)) => lock(&self.sandboxes).get(id).cloned(),
            _ => None,
        };
        if let Some(sb) = sandbox {
            let id = &sb.id;
            if sb.ending.load(std::sync::atomic::Ordering::SeqCst) {
                return; // end_sandbox is cleaning up
            }
            let oom = sb
                .cgroup
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .is_some_and(Cgroup::oom_killed);
            let (reason, mut message) = match status {
                Some(st) => vmm::describe_exit(st, oom),
                None => ("SANDBOX_DEAD", "the VMM ended".to_owned()),
            };
            if reason == "SECCOMP_VIOLATION"
                && let Some(line) = vmm::log_line(&run_dir.join("vmm.log"), "seccomp violation")
            {
                message = format!("{message} ({line})");
            }
            warn!(sandbox = %id, reason, "{message}");
            let _ = self
                .end_sandbox(&sb, SandboxState::Dead, reason, &message)
                .await;
            return;
        }
        if let Some(Owner::Pool(tid)) = &owner
            && let Some(v) = lock(&self.pools).get_mut(tid)
        {
            v.retain(|p| p.pid != pid);
        }
        if let Some(cg) = cgroup
            && let Err(e) = cg.remove()
        {
            warn!(pid, "cgroup removal: {e}");
        }
        let _ = std::fs::remove_dir_all(run_dir);
    }

    // ---- sandboxes ----

    /// A live sandbox of `tenant` (others' are "not found").
    pub fn live(&self, tenant: &str, id: &str) -> Option<Arc<SandboxRt>> {
        lock(&self.sandboxes)
            .get(id)
            .filter(|s| s.tenant == tenant)
            .cloned()
    }

    /// A sandbox record of `tenant`, live or ended.
    pub fn get_sandbox(&self, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        if let Some(s) = self.live(tenant, id) {
            s.touch();
            return Ok(s.snapshot());
        }
        match self.store.sandbox(id)? {
            Some(s) if s.tenant == tenant => Ok(s),
            _ => Err(ApiError::SandboxNotFound(id.to_owned())),
        }
    }

    /// `tenant`'s sandboxes.
    pub fn list_sandboxes(
        &self,
        tenant: &str,
        labels: &HashMap<String, String>,
        states: &[i32],
    ) -> ApiResult<Vec<Sandbox>> {
        let live: HashMap<String, Sandbox> = lock(&self.sandboxes)
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

    /// Capacity and quota check for a new sandbox of `memory_mib`; counts live sandboxes.
    fn admit(&self, tenant: &str, memory_mib: u64, rt: Arc<SandboxRt>) -> ApiResult<()> {
        let mut all = lock(&self.sandboxes);
        let count = all.len() as u64;
        let committed: u64 = all.values().map(|s| s.memory_mib()).sum();
        if count >= self.cfg.max_sandboxes as u64 {
            return Err(ApiError::Capacity {
                what: "sandboxes",
                limit: self.cfg.max_sandboxes as u64,
                current: count,
            });
        }
        let cap = self.cfg.committed_capacity_mib();
        if committed + memory_mib > cap {
            return Err(ApiError::Capacity {
                what: "memory_mib",
                limit: cap,
                current: committed,
            });
        }
        let quota = self.cfg.quota_of(tenant);
        let mine: Vec<_> = all.values().filter(|s| s.tenant == tenant).collect();
        if quota.max_sandboxes > 0 && mine.len() >= quota.max_sandboxes {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "sandboxes",
                limit: quota.max_sandboxes as u64,
                current: mine.len() as u64,
            });
        }
        let my_mem: u64 = mine.iter().map(|s| s.memory_mib()).sum();
        if quota.max_memory_mib > 0 && my_mem + memory_mib > quota.max_memory_mib {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "memory_mib",
                limit: quota.max_memory_mib,
                current: my_mem,
            });
        }
        all.insert(rt.id.clone(), rt);
        Ok(())
    }

    /// CreateSandbox: restore the template in a warm VMM, wait for the agent, give the clone
    /// its identity and files. Answers the ready sandbox.
    pub async fn create_sandbox(
        self: &Arc<Self>,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        let t0 = Instant::now();
        let name = if req.template.is_empty() {
            "base"
        } else {
            req.template.as_str()
        };
        let template = self.find_template(tenant, name)?;
        let tr = &template.record;
        if req.vcpus != 0 && req.vcpus != tr.vcpus
            || req.memory_mib != 0 && req.memory_mib != tr.memory_mib
        {
            return Err(ApiError::InvalidArgument(format!(
                "template {name} has {} vCPU(s) and {} MiB; a snapshot's shape is fixed (make a \
                 template with CreateTemplate vcpus/memory_mib for another shape)",
                tr.vcpus, tr.memory_mib
            )));
        }
        let disk_mib = if req.disk_mib == 0 {
            self.cfg.default_disk_mib
        } else {
            req.disk_mib
        };
        if disk_mib > self.cfg.max_disk_mib {
            return Err(ApiError::InvalidArgument(format!(
                "disk_mib {disk_mib} is over the limit {}",
                self.cfg.max_disk_mib
            )));
        }
        let idle_ttl_s = clamp_or(
            req.idle_ttl_s,
            self.cfg.default_idle_ttl_s,
            self.cfg.max_idle_ttl_s,
        );
        let max_lifetime_s = clamp_or(
            req.max_lifetime_s,
            self.cfg.default_max_lifetime_s,
            self.cfg.max_lifetime_s,
        );
        let policy = normalise_policy(req.file_policy.clone(), &self.cfg)?;
        let mut placed_bytes = 0u64;
        for f in &req.files {
            crate::files::check_path(&f.path, &policy.writable, "writable")?;
            placed_bytes += f.content.len() as u64;
        }
        if placed_bytes > self.cfg.max_file_bytes {
            return Err(ApiError::FileTooLarge {
                size: placed_bytes,
                limit: self.cfg.max_file_bytes,
            });
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ApiError::InvalidArgument(format!(
                    "bad environment name {k:?}"
                )));
            }
        }
        let id = new_id("sb");
        let record = Sandbox {
            id: id.clone(),
            tenant: tenant.to_owned(),
            template: tr.name.clone(),
            template_id: tr.id.clone(),
            state: SandboxState::Starting as i32,
            vcpus: tr.vcpus,
            memory_mib: tr.memory_mib,
            disk_mib,
            labels: req.labels.clone(),
            idle_ttl_s,
            max_lifetime_s,
            created_unix_ms: now_ms(),
            ..Default::default()
        };
        let rt = Arc::new(SandboxRt {
            id: id.clone(),
            tenant: tenant.to_owned(),
            record: Mutex::new(record.clone()),
            vmm: Mutex::new(None),
            cgroup: Mutex::new(None),
            env: req.env.clone(),
            policy,
            last_activity: Mutex::new(Instant::now()),
            created: Instant::now(),
            ops: tokio::sync::Mutex::new(()),
            ending: Default::default(),
        });
        if let Err(e) = self.admit(tenant, u64::from(tr.memory_mib), rt.clone()) {
            self.metrics.create_failed(e.reason());
            return Err(e);
        }
        self.store.put_sandbox(&record)?;
        // At most `max_concurrent_starts` restores run at once; the rest queue (boundedly).
        // A restore storm otherwise makes every starting guest slow at once.
        let queued = Instant::now();
        let waiting = self
            .start_queue
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let permit = if waiting >= self.cfg.max_start_queue {
            None
        } else {
            self.starts.clone().acquire_owned().await.ok()
        };
        self.start_queue
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        let Some(_permit) = permit else {
            let e = ApiError::Capacity {
                what: "start_queue",
                limit: self.cfg.max_start_queue as u64,
                current: waiting as u64,
            };
            self.metrics.create_failed(e.reason());
            let _ = self
                .end_sandbox(&rt, SandboxState::Dead, e.reason(), &e.to_string())
                .await;
            return Err(e);
        };
        let queue_ms = queued.elapsed().as_secs_f64() * 1000.0;
        rt.update(|r| r.create_queue_ms = queue_ms);
        let started = self.start_sandbox(&rt, &template, &req, t0).await;
        // Refilled after the answer: starting a VMM process competes for the CPU with the
        // restore it would replace.
        self.refill_pool(&template);
        match started {
            Ok(s) => Ok(s),
            Err(e) => {
                self.metrics.create_failed(e.reason());
                let _ = self
                    .end_sandbox(&rt, SandboxState::Dead, e.reason(), &e.to_string())
                    .await;
                Err(e)
            }
        }
    }

    async fn start_sandbox(
        self: &Arc<Self>,
        rt: &Arc<SandboxRt>,
        template: &TemplateRt,
        req: &CreateSandboxRequest,
        t0: Instant,
    ) -> ApiResult<Sandbox> {
        let tr = &template.record;
        let warm = lock(&self.pools).get_mut(&tr.id).and_then(|v| {
            if v.is_empty() {
                None
            } else {
                Some(v.remove(0))
            }
        });
        let p = match warm {
            Some(p) => p,
            None => {
                info!(template = %tr.name, "no warm VMM: starting one for this create");
                self.spawn_vmm(template, Owner::Sandbox(rt.id.clone()))
                    .await?
            }
        };
        lock(&self.owners).insert(p.pid, Owner::Sandbox(rt.id.clone()));
        let info = VmmInfo {
            pid: p.pid,
            start_ticks: p.start_ticks,
            run_dir: p.run_dir.clone(),
            control: p.control.clone(),
            vsock: p.vsock.clone(),
        };
        *rt.vmm.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.clone());
        let t_taken = Instant::now();
        *rt.cgroup.lock().unwrap_or_else(|e| e.into_inner()) = p.cgroup.clone();
        let answer = vmm::command(&p.control, &format!("restore {}", template.dir.display()))
            .await
            .map_err(|e| ApiError::Internal(format!("restore: {e}")))?;
        let t_running = Instant::now();
        let restore_ms = answer["running_after_us"].as_u64().unwrap_or(0) as f64 / 1000.0;
        // The guest's share: from vCPUs running until the agent answers.
        let vsock = p.vsock.clone();
        let deadline = Instant::now() + Duration::from_millis(self.cfg.ready_timeout_ms);
        let id = rt.id.clone();
        let files = req.files.clone();
        // The sandbox's writable space is the guest's /tmp tmpfs: its size is the disk quota.
        let tmp_size_bytes = u64::from(rt.snapshot().disk_mib) << 20;
        let me = rt.clone();
        let (guest_ms, ident_ms) = tokio::task::spawn_blocking(move || -> ApiResult<(f64, f64)> {
            let unavailable = |m: String| ApiError::AgentUnavailable {
                id: id.clone(),
                message: m,
            };
            let (mut client, _ready) =
                agent::wait_ready(&vsock, deadline, &me.ending).map_err(unavailable)?;
            // Many clones starting at once on a loaded host answer slowly; the ready deadline
            // bounds the whole wait.
            let _ = client
                .reader()
                .set_read_timeout(Some(Duration::from_secs(120)));
            let guest_ms = t_running.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let mut entropy = [0u8; 64];
            random_bytes(&mut entropy);
            client
                .reseed_with(airlock_proto::pb::Reseed {
                    entropy: entropy.to_vec(),
                    hostname: id.clone(),
                    sandbox_id: id.clone(),
                    tmp_size_bytes,
                })
                .map_err(|e| unavailable(format!("reseed: {e}")))?;
            for f in &files {
                let mode = if f.mode == 0 { 0o644 } else { f.mode };
                crate::files::write_all(&mut client, &f.path, &f.content, mode)
                    .map_err(|e| unavailable(format!("placing {}: {e}", f.path)))?;
            }
            Ok((guest_ms, t.elapsed().as_secs_f64() * 1000.0))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("agent task: {e}")))??;
        let total_ms = t0.elapsed().as_secs_f64() * 1000.0;
        // Reseeding and placing files wait on the guest too; a queued create waited for others.
        let guest_ms = guest_ms + ident_ms;
        let queue_ms = rt.snapshot().create_queue_ms;
        let host_ms = total_ms - guest_ms - queue_ms;
        let record = rt.update(|r| {
            r.state = SandboxState::Running as i32;
            r.create_ms = total_ms;
            r.create_host_ms = host_ms;
            r.create_guest_ms = guest_ms;
            r.restore_ms = restore_ms;
            r.vmm_pid = p.pid;
        });
        self.store.put_sandbox(&record)?;
        self.metrics
            .observe_create(total_ms / 1000.0, host_ms / 1000.0, restore_ms / 1000.0);
        info!(
            sandbox = %rt.id,
            tenant = %rt.tenant,
            template = %tr.name,
            total_ms,
            host_ms,
            guest_ms,
            restore_ms,
            take_ms = (t_taken - t0).as_secs_f64() * 1000.0,
            control_ms = (t_running - t_taken).as_secs_f64() * 1000.0,
            identity_ms = ident_ms,
            "sandbox ready"
        );
        Ok(record)
    }

    /// Ends a live sandbox: kills its VMM, removes its cgroup and run directory, ends its
    /// executions, and stores the final record. Idempotent.
    pub async fn end_sandbox(
        self: &Arc<Self>,
        rt: &Arc<SandboxRt>,
        state: SandboxState,
        reason: &str,
        message: &str,
    ) -> ApiResult<Sandbox> {
        if rt.ending.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // Someone else is ending it; the record says how.
            return Ok(rt.snapshot());
        }
        if let Some(v) = rt.vmm() {
            vmm::kill_verified(v.pid, v.start_ticks);
            let deadline = Instant::now() + Duration::from_secs(5);
            while vmm::start_ticks(v.pid) == Some(v.start_ticks) && Instant::now() < deadline {
                // A zombie until the watcher reaps it: check its state.
                if vmm::is_zombie(v.pid) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = std::fs::remove_dir_all(&v.run_dir);
        }
        let usage = rt.snapshot();
        let cg = rt.cgroup.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(cg) = cg
            && let Err(e) = cg.remove()
        {
            warn!(sandbox = %rt.id, "cgroup removal: {e}");
        }
        // Its executions end with it.
        let execs: Vec<_> = lock(&self.executions)
            .values()
            .filter(|e| e.sandbox_id == rt.id)
            .cloned()
            .collect();
        for e in execs {
            let why = match state {
                SandboxState::Destroyed => ("SANDBOX_DESTROYED", "the sandbox was destroyed"),
                _ => (reason, message),
            };
            e.fail(self, why.0, why.1);
        }
        let record = rt.update(|r| {
            r.state = state as i32;
            r.vmm_pid = 0;
            r.end_reason = reason.to_owned();
            r.end_message = message.to_owned();
            r.ended_unix_ms = now_ms();
            r.cpu_usage_us = usage.cpu_usage_us;
            r.memory_peak_bytes = usage.memory_peak_bytes;
        });
        self.store.put_sandbox(&record)?;
        lock(&self.sandboxes).remove(&rt.id);
        info!(sandbox = %rt.id, reason, "sandbox ended: {message}");
        Ok(record)
    }

    /// DestroySandbox: idempotent; `false` when there was nothing live to destroy.
    pub async fn destroy_sandbox(self: &Arc<Self>, tenant: &str, id: &str) -> ApiResult<bool> {
        if !well_formed(id, "sb") {
            return Err(ApiError::InvalidArgument(format!(
                "{id:?} is not a sandbox id"
            )));
        }
        let Some(rt) = self.live(tenant, id) else {
            return Ok(false);
        };
        let _op = rt.ops.lock().await;
        self.end_sandbox(
            &rt,
            SandboxState::Destroyed,
            "DESTROYED",
            "destroyed by a call",
        )
        .await?;
        Ok(true)
    }

    /// A live, running sandbox of `tenant` (errors say why not).
    pub fn running(&self, tenant: &str, id: &str) -> ApiResult<Arc<SandboxRt>> {
        match self.live(tenant, id) {
            Some(rt) if rt.state() == SandboxState::Running => {
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

    pub async fn pause(self: &Arc<Self>, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        let rt = self.running(tenant, id)?;
        let _op = rt.ops.lock().await;
        let v = rt
            .vmm()
            .ok_or_else(|| ApiError::Internal("no VMM".into()))?;
        vmm::command(&v.control, "pause")
            .await
            .map_err(|e| ApiError::Internal(format!("pause: {e}")))?;
        let r = rt.update(|r| r.state = SandboxState::Paused as i32);
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    pub async fn resume(self: &Arc<Self>, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        let rt = match self.live(tenant, id) {
            Some(rt) if rt.state() == SandboxState::Paused => rt,
            Some(rt) => {
                return Err(ApiError::SandboxNotRunning {
                    id: id.to_owned(),
                    state: state_name(rt.state()).into(),
                });
            }
            None => return Err(ApiError::SandboxNotFound(id.to_owned())),
        };
        let _op = rt.ops.lock().await;
        rt.touch();
        let v = rt
            .vmm()
            .ok_or_else(|| ApiError::Internal("no VMM".into()))?;
        vmm::command(&v.control, "resume")
            .await
            .map_err(|e| ApiError::Internal(format!("resume: {e}")))?;
        let r = rt.update(|r| r.state = SandboxState::Running as i32);
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    /// SnapshotSandbox: a new template of `tenant` from a running or paused sandbox.
    pub async fn snapshot_sandbox(
        self: &Arc<Self>,
        tenant: &str,
        id: &str,
        name: &str,
    ) -> ApiResult<Template> {
        let rt = self
            .live(tenant, id)
            .ok_or_else(|| ApiError::SandboxNotFound(id.to_owned()))?;
        let owner = self.check_new_template_name(tenant, name)?;
        let _op = rt.ops.lock().await;
        let state = rt.state();
        if !matches!(state, SandboxState::Running | SandboxState::Paused) {
            return Err(ApiError::SandboxNotRunning {
                id: id.to_owned(),
                state: state_name(state).into(),
            });
        }
        let v = rt
            .vmm()
            .ok_or_else(|| ApiError::Internal("no VMM".into()))?;
        let tid = new_id("tpl");
        let dir = self.templates_dir.join(&tid);
        if state == SandboxState::Running {
            vmm::command(&v.control, "pause")
                .await
                .map_err(|e| ApiError::Internal(format!("pause: {e}")))?;
        }
        // The VMM writes into its run directory (the one place its jail can write); the
        // snapshot then moves to the templates, owned by root.
        let staging = v.run_dir.join(format!("snapshot-{tid}"));
        let snap = vmm::command(&v.control, &format!("snapshot {}", staging.display())).await;
        if state == SandboxState::Running {
            let _ = vmm::command(&v.control, "resume").await;
        }
        let moved = snap
            .map_err(|e| ApiError::Internal(format!("snapshot: {e}")))
            .and_then(|_| {
                std::fs::rename(&staging, &dir)
                    .and_then(|()| crate::jail::take_ownership(&dir))
                    .map_err(|e| ApiError::Internal(format!("moving the snapshot: {e}")))
            });
        if let Err(e) = moved {
            let _ = std::fs::remove_dir_all(&staging);
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let src = self
            .templates_for(tenant)
            .into_iter()
            .find(|t| t.record.id == rt.snapshot().template_id);
        let sb = rt.snapshot();
        let record = Template {
            name: name.to_owned(),
            id: tid,
            tenant: owner,
            vcpus: sb.vcpus,
            memory_mib: sb.memory_mib,
            kernel_path: src
                .as_ref()
                .map(|t| t.record.kernel_path.clone())
                .unwrap_or_default(),
            kernel_version: src
                .as_ref()
                .map(|t| t.record.kernel_version.clone())
                .unwrap_or_default(),
            rootfs_path: src
                .as_ref()
                .map(|t| t.record.rootfs_path.clone())
                .unwrap_or_default(),
            rootfs_version: src
                .as_ref()
                .map(|t| t.record.rootfs_version.clone())
                .unwrap_or_default(),
            source_sandbox_id: id.to_owned(),
            created_unix_ms: now_ms(),
            memory_file_bytes: disk_bytes(&dir.join("memory")),
        };
        self.add_template(record.clone(), dir)?;
        Ok(record)
    }

    /// Destroys sandboxes past their lifetime or idle TTL; runs every second.
    pub async fn enforce_ttls(self: &Arc<Self>) {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let all: Vec<_> = lock(&self.sandboxes).values().cloned().collect();
            for rt in all {
                let r = rt.snapshot();
                if r.state == SandboxState::Starting as i32 {
                    continue;
                }
                let busy = lock(&self.executions)
                    .values()
                    .any(|e| e.sandbox_id == rt.id);
                let idle = rt
                    .last_activity
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .elapsed();
                let why = if rt.created.elapsed() >= Duration::from_secs(r.max_lifetime_s.into()) {
                    Some((
                        "LIFETIME_EXCEEDED",
                        format!("its lifetime of {} s ended", r.max_lifetime_s),
                    ))
                } else if !busy && idle >= Duration::from_secs(r.idle_ttl_s.into()) {
                    Some(("IDLE_TIMEOUT", format!("idle for {} s", r.idle_ttl_s)))
                } else {
                    None
                };
                if let Some((reason, message)) = why {
                    let me = self.clone();
                    tokio::spawn(async move {
                        let _op = rt.ops.lock().await;
                        let _ = me
                            .end_sandbox(&rt, SandboxState::Destroyed, reason, &message)
                            .await;
                    });
                }
            }
        }
    }

    /// Sandboxes by state and per-sandbox usage, for the metrics endpoint.
    pub fn metrics_text(&self) -> String {
        let all: Vec<_> = lock(&self.sandboxes).values().cloned().collect();
        let mut by_state = BTreeMap::new();
        for s in ["starting", "running", "paused"] {
            by_state.insert(s.to_owned(), 0);
        }
        let mut usage = Vec::new();
        for rt in &all {
            let r = rt.snapshot();
            let st = SandboxState::try_from(r.state).unwrap_or(SandboxState::Unspecified);
            *by_state.entry(state_name(st).to_owned()).or_default() += 1;
            usage.push(SandboxUsage {
                id: r.id,
                tenant: r.tenant,
                cpu_usage_us: r.cpu_usage_us,
                memory_bytes: r.memory_peak_bytes,
            });
        }
        let warm: usize = lock(&self.pools).values().map(Vec::len).sum();
        by_state.insert("warm_pool".into(), warm as u64);
        let mut text = self.metrics.render(&by_state, &usage);
        text.push_str(&format!(
            "# HELP airlock_jail_uids_in_use Jail uids held by live VMM processes.\n\
             # TYPE airlock_jail_uids_in_use gauge\nairlock_jail_uids_in_use {}\n",
            self.jailer.uids_in_use()
        ));
        text
    }

    /// Kills every VMM (daemon shutdown): warm ones and sandboxes', whose records end as
    /// DAEMON_STOPPED.
    pub async fn shutdown(self: &Arc<Self>) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for (_, v) in lock(&self.pools).drain() {
            for mut p in v {
                p.kill();
                if let Some(cg) = &p.cgroup {
                    let _ = cg.remove();
                }
                let _ = self.store.remove_process(p.pid, p.start_ticks);
                let _ = std::fs::remove_dir_all(&p.run_dir);
            }
        }
        let all: Vec<_> = lock(&self.sandboxes).values().cloned().collect();
        for rt in all {
            let _ = self
                .end_sandbox(
                    &rt,
                    SandboxState::Dead,
                    "DAEMON_STOPPED",
                    "the daemon stopped",
                )
                .await;
            if let Some(v) = rt.vmm() {
                let _ = self.store.remove_process(v.pid, v.start_ticks);
            }
        }
        // Whatever is still recorded (a VMM being started right now): the same as after a
        // restart.
        if let Err(e) = self.reap_processes() {
            warn!("reaping at shutdown: {e}");
        }
    }
}

/// The error for a call on an ended sandbox.
pub fn ended_error(s: &Sandbox) -> ApiError {
    if s.state == SandboxState::Dead as i32 {
        ApiError::Dead {
            id: s.id.clone(),
            reason: if s.end_reason.is_empty() {
                "SANDBOX_DEAD".into()
            } else if matches!(
                s.end_reason.as_str(),
                "GUEST_CRASHED" | "OOM_KILLED" | "SECCOMP_VIOLATION"
            ) {
                s.end_reason.clone()
            } else {
                "SANDBOX_DEAD".into()
            },
            message: s.end_message.clone(),
        }
    } else {
        ApiError::SandboxNotRunning {
            id: s.id.clone(),
            state: "destroyed".into(),
        }
    }
}

fn non_empty(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

fn clamp_or(v: u32, default: u32, max: u32) -> u32 {
    if v == 0 { default } else { v.min(max) }
}

/// Checks a request's file policy (absolute, normal prefixes) or gives the default.
fn normalise_policy(p: Option<FilePolicy>, cfg: &Config) -> ApiResult<FilePolicy> {
    let p = p.unwrap_or_default();
    let pick = |given: Vec<String>, default: &Vec<String>| -> ApiResult<Vec<String>> {
        let list = if given.is_empty() {
            default.clone()
        } else {
            given
        };
        for prefix in &list {
            crate::files::check_absolute(prefix)?;
        }
        Ok(list)
    };
    Ok(FilePolicy {
        writable: pick(p.writable, &cfg.writable_paths)?,
        exportable: pick(p.exportable, &cfg.exportable_paths)?,
    })
}

/// A short version of a file: a hash of its name, size and modification time (hashing a
/// gigabyte image per template would cost seconds; the base image's file name carries the hash
/// of its inputs already).
fn file_version(p: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let meta = std::fs::metadata(p).ok();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.file_name().hash(&mut h);
    meta.as_ref().map(|m| m.len()).hash(&mut h);
    meta.and_then(|m| m.modified().ok()).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Bytes a (sparse) file occupies on disk.
fn disk_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_well_formed_and_distinct() {
        let a = new_id("sb");
        let b = new_id("sb");
        assert_ne!(a, b);
        assert!(well_formed(&a, "sb"));
        assert!(!well_formed(&a, "ex"));
        assert!(!well_formed("sb-../../etc", "sb"));
    }

    #[test]
    fn template_names_are_checked() {
        assert!(valid_name("base"));
        assert!(valid_name("py3.12-data"));
        assert!(!valid_name(""));
        assert!(!valid_name("Base"));
        assert!(!valid_name("../x"));
        assert!(!valid_name(&"a".repeat(64)));
    }
}
