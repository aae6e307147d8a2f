//! What every VMM needs from the host: a run directory, a cgroup sized for its guest, a
//! process started through the [`Launcher`] (jailed), and the supervisor's watch. Warm pool
//! processes start here; template builds use the same pieces.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::cgroup::{Cgroup, Cgroups, Limits};
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::metrics::Metrics;
use crate::store::Owner;
use crate::supervisor::Supervisor;
use crate::vmm::{self, Launcher, PoolSpec, VmmProcess};

/// Starts VMM processes.
#[derive(Debug)]
pub struct VmmHost {
    pub launcher: Arc<dyn Launcher>,
    pub cgroups: Option<Cgroups>,
    pub supervisor: Arc<Supervisor>,
    metrics: Arc<Metrics>,
    run_root: PathBuf,
    /// VMM memory beyond guest memory allowed by a cgroup (MiB), and its pids.
    overhead_mib: u64,
    pids_max: u64,
    /// Set at shutdown: no new VMM processes.
    stopping: AtomicBool,
    /// Warm VMMs being started now.
    starting: tokio::sync::watch::Sender<usize>,
}

impl VmmHost {
    pub fn new(
        launcher: Arc<dyn Launcher>,
        cgroups: Option<Cgroups>,
        supervisor: Arc<Supervisor>,
        metrics: Arc<Metrics>,
        run_root: PathBuf,
        overhead_mib: u64,
        pids_max: u64,
    ) -> Self {
        Self {
            launcher,
            cgroups,
            supervisor,
            metrics,
            run_root,
            overhead_mib,
            pids_max,
            stopping: AtomicBool::new(false),
            starting: tokio::sync::watch::Sender::new(0),
        }
    }

    /// A new VMM id and its run directory (not created yet).
    pub fn new_vmm_id(&self) -> ApiResult<(String, PathBuf)> {
        let id = ids::new_id(ids::Kind::Vmm)?;
        let dir = self.run_root.join(&id);
        // Made before the VMM's cgroup: startup reaps an unrecorded cgroup only where its run
        // directory says it is this daemon's (`recovery::remove_leftovers`).
        std::fs::create_dir_all(&dir)?;
        Ok((id, dir))
    }

    /// The run directories' parent.
    pub fn run_root(&self) -> &std::path::Path {
        &self.run_root
    }

    /// The cgroup of a VMM with a guest of `memory_mib` and `vcpus` (none without cgroups).
    pub fn cgroup(&self, name: &str, memory_mib: u32, vcpus: u32) -> io::Result<Option<Cgroup>> {
        let Some(cgs) = &self.cgroups else {
            return Ok(None);
        };
        let limits = Limits {
            memory_bytes: (u64::from(memory_mib) + self.overhead_mib) << 20,
            cpus: vcpus,
            pids: self.pids_max,
        };
        cgs.create(name, limits)
            .inspect_err(|_| {
                let _ = cgs.cgroup(name).remove();
            })
            .map(Some)
    }

    /// No new VMMs from now on.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Waits (at most `timeout`) until no warm VMM is being started (after [`stop`](Self::stop):
    /// every VMM is then watched, or killed).
    pub async fn wait_starts(&self, timeout: std::time::Duration) {
        let mut rx = self.starting.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|n| *n == 0)).await;
    }

    /// Starts a warm `airlock-vmm pool` process for `spec` as
    /// `owner`'s, in its cgroup from its first instruction, watched and recorded; returns once
    /// its control socket answers (its KVM VM is prepared).
    pub async fn start_pool_vmm(&self, spec: &PoolSpec, owner: Owner) -> ApiResult<VmmProcess> {
        self.starting.send_modify(|n| *n += 1);
        let started = self.start_pool_vmm_counted(spec, owner).await;
        self.starting.send_modify(|n| *n -= 1);
        started
    }

    async fn start_pool_vmm_counted(&self, spec: &PoolSpec, owner: Owner) -> ApiResult<VmmProcess> {
        let stopping = || ApiError::Internal("the daemon is stopping".into());
        if self.stopping() {
            return Err(stopping());
        }
        let (id, run_dir) = self.new_vmm_id()?;
        let cgroup = self.cgroup(&id, spec.memory_mib, spec.vcpus).map_err(|e| {
            let _ = std::fs::remove_dir_all(&run_dir);
            ApiError::Internal(format!("VMM cgroup: {e}"))
        })?;
        let t0 = Instant::now();
        let started = match vmm::pool_launch(self.launcher.as_ref(), &run_dir, spec, cgroup.clone())
        {
            Ok(launch) => vmm::launch(&self.launcher, launch).await,
            Err(e) => Err(e),
        };
        let mut launched = match started {
            Ok(l) => l,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.remove();
                }
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(ApiError::Internal(format!(
                    "starting {}: {e}",
                    self.launcher.binary().display()
                )));
            }
        };
        let spawn_s = t0.elapsed().as_secs_f64();
        let p = VmmProcess::new(id, run_dir, cgroup, &mut launched);
        // Watched at once: whatever fails from here on, its exit cleans up after it.
        self.supervisor.watch(&p, launched.exit, owner)?;
        if self.stopping() {
            p.kill();
            return Err(stopping());
        }
        let log = p.log();
        let ready =
            vmm::control::wait_ready(&p.control, || p.is_gone().then(|| vmm::log_tail(&log))).await;
        if let Err(e) = ready {
            p.kill();
            return Err(ApiError::Internal(format!("starting a VMM: {e}")));
        }
        self.metrics
            .observe_vmm_start(spawn_s, t0.elapsed().as_secs_f64());
        Ok(p)
    }
}
