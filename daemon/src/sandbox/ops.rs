//! Calls on a live sandbox: pause, resume, snapshot into a template, destroy. Each takes the
//! sandbox's operation lock, so they never interleave.

use std::path::Path;

use airlock_api::v1::{Sandbox, SandboxState, Template};

use super::{SandboxRt, Sandboxes};
use crate::error::{ApiError, ApiResult};
use crate::fileinfo::disk_bytes;
use crate::ids;
use crate::reason::{EndReason, state_name};
use crate::templates::TemplateRt;
use crate::vmm::{self, VmmProcess};

use tracing::{info, warn};

/// The longest SnapshotSandbox waits for a running guest to settle before pausing it.
const SETTLE_MAX: std::time::Duration = std::time::Duration::from_secs(3);

fn control_error(what: &str) -> impl Fn(airlock_control::ControlError) -> ApiError + '_ {
    move |e| ApiError::Internal(format!("{what}: {e}"))
}

impl Sandboxes {
    pub async fn pause(&self, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        let rt = self.running(tenant, id)?;
        let _op = rt.ops.lock().await;
        let v = rt.vmm_or_err()?;
        vmm::control::pause(&v.control)
            .await
            .map_err(control_error("pause"))?;
        let r = rt.update(|r| r.state = SandboxState::Paused as i32);
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    pub async fn resume(&self, tenant: &str, id: &str) -> ApiResult<Sandbox> {
        let rt = self.in_state(tenant, id, SandboxState::Paused)?;
        let _op = rt.ops.lock().await;
        let v = rt.vmm_or_err()?;
        vmm::control::resume(&v.control)
            .await
            .map_err(control_error("resume"))?;
        let r = rt.update(|r| r.state = SandboxState::Running as i32);
        self.store.put_sandbox(&r)?;
        Ok(r)
    }

    /// DestroySandbox: idempotent; `false` when there was nothing live to destroy.
    pub async fn destroy(&self, tenant: &str, id: &str) -> ApiResult<bool> {
        if !ids::Kind::Sandbox.names(id) {
            return Err(ApiError::InvalidArgument(format!(
                "{id:?} is not a sandbox id"
            )));
        }
        let Some(rt) = self.live(tenant, id) else {
            return Ok(false);
        };
        let _op = rt.ops.lock().await;
        self.end(&rt, EndReason::Destroyed, "destroyed by a call")
            .await?;
        Ok(true)
    }

    /// SnapshotSandbox: a new template of `tenant` (shared with every tenant when `shared`:
    /// the default tenant's only) from a running or paused sandbox.
    pub async fn snapshot(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
        shared: bool,
    ) -> ApiResult<TemplateRt> {
        let owner = self.templates.snapshot_owner(tenant, shared)?;
        self.snapshot_with(tenant, id, name, None, Some(owner), false)
            .await
    }

    /// [`snapshot`](Self::snapshot), recording `meta` (what it was made from and its defaults)
    /// instead of its source template's: a Dockerfile build's result. Its `owner` (`None`: as
    /// a build's, the default tenant's shared).
    pub async fn snapshot_with(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
        meta: Option<(String, airlock_api::v1::ImageDefaults)>,
        owner: Option<String>,
        replace: bool,
    ) -> ApiResult<TemplateRt> {
        let rt = self
            .live(tenant, id)
            .ok_or_else(|| ApiError::SandboxNotFound(id.to_owned()))?;
        let owner = match owner {
            Some(o) => self.templates.check_new_of(&o, name, replace).map(|()| o)?,
            None => self.templates.check_new(tenant, name, replace)?,
        };
        let quota = self.cfg.quota_of(tenant);
        let worst = rt.memory_mib() << 20;
        self.templates.check_quota(tenant, &owner, &quota, worst)?;
        let _op = rt.ops.lock().await;
        let state = rt.state();
        check_snapshottable(&rt, id, state)?;
        let v = rt.vmm_or_err()?;
        let tid = ids::new_id(ids::Kind::Template)?;
        let dir = self.templates.dir_of(&tid);
        write_snapshot(&v, id, state, &tid, &dir).await?;
        let sb = rt.snapshot();
        let src = self.templates.by_id(&sb.template_id).map(|t| t.record);
        let src = src.as_ref();
        let from_src = |f: fn(&Template) -> &String| src.map(f).cloned().unwrap_or_default();
        let record = Template {
            name: name.to_owned(),
            id: tid,
            tenant: owner,
            vcpus: sb.vcpus,
            memory_mib: sb.memory_mib,
            kernel_path: from_src(|t| &t.kernel_path),
            kernel_version: from_src(|t| &t.kernel_version),
            rootfs_path: from_src(|t| &t.rootfs_path),
            rootfs_version: from_src(|t| &t.rootfs_version),
            source_sandbox_id: id.to_owned(),
            created_unix_ms: ids::now_ms(),
            memory_file_bytes: disk_bytes(&dir.join("memory")),
            image: src.map(|t| t.image.clone()).unwrap_or_default(),
            volume_slots: src.map_or(0, |t| t.volume_slots),
            // Its root filesystem and its agent's boot defaults are its source template's,
            // unless the caller says what it is (a build's).
            source: match &meta {
                Some((source, _)) => source.clone(),
                None => src.map(|t| t.source.clone()).unwrap_or_default(),
            },
            image_defaults: match meta {
                Some((_, defaults)) => Some(defaults),
                None => src.and_then(|t| t.image_defaults.clone()),
            },
            snapshot_format: airlock_control::snapshot_dir::state_version(&dir).unwrap_or(0),
            agent_protocol: src.map_or(0, |t| t.agent_protocol),
            ..Default::default()
        };
        self.templates.add(record, dir, replace)
    }
}

/// Snapshot step: the sandbox, in `state`, can be snapshotted (running or paused, without
/// secrets that refuse it, without volumes).
fn check_snapshottable(rt: &SandboxRt, id: &str, state: SandboxState) -> ApiResult<()> {
    if !matches!(state, SandboxState::Running | SandboxState::Paused) {
        return Err(ApiError::SandboxNotRunning {
            id: id.to_owned(),
            state: state_name(state).into(),
        });
    }
    if let Some(why) = rt.secrets.snapshot_refusal() {
        return Err(ApiError::SecretsPresent {
            id: id.to_owned(),
            why,
        });
    }
    if let Some(vol) = rt.snapshot().volumes.first() {
        return Err(ApiError::VolumeInUse {
            name: vol.name.clone(),
            by: id.to_owned(),
            why: "a sandbox with volumes mounted cannot be snapshotted (its template would \
                  hold them mounted); destroy it and mount them in a sandbox of the template",
        });
    }
    Ok(())
}

/// Snapshot step: the VMM's snapshot, written (the guest settled and paused around it when
/// running) and copied into the template directory `dir` (removed again on failure).
async fn write_snapshot(
    v: &VmmProcess,
    id: &str,
    state: SandboxState,
    tid: &str,
    dir: &Path,
) -> ApiResult<()> {
    if state == SandboxState::Running {
        // Clones redo whatever the guest still had pending: let it finish, within bounds
        // (a sandbox running a busy process never settles).
        match vmm::control::settle(&v.control, SETTLE_MAX).await {
            Ok(s) => info!(
                sandbox = id,
                settled = s.settled,
                waited_ms = s.waited_ms,
                busy_ms = s.busy_ms,
                "settled before the snapshot"
            ),
            Err(e) => warn!(sandbox = id, "settling before the snapshot: {e}"),
        }
        vmm::control::pause(&v.control)
            .await
            .map_err(control_error("pause"))?;
    }
    // The VMM writes into its run directory (the one place its jail can write), into the
    // files prepared here for it (a running VMM creates none); the snapshot then moves to
    // the templates, owned by root.
    let staging = v.run_dir.join(format!("snapshot-{tid}"));
    let vmm_ids = v.uid.map(|uid| (uid, uid));
    let written = match airlock_control::snapshot_dir::prepare(&staging, vmm_ids) {
        Ok(()) => vmm::control::snapshot(&v.control, &staging)
            .await
            .map_err(control_error("snapshot")),
        Err(e) => Err(ApiError::Internal(format!(
            "preparing the snapshot's directory: {e}"
        ))),
    };
    if state == SandboxState::Running {
        let _ = vmm::control::resume(&v.control).await;
    }
    // The VMM runs on and may hold descriptors of what it wrote: the template is a copy.
    let imported = written.and_then(|_| {
        crate::templates::import::import(&staging, dir)
            .map_err(|e| ApiError::Internal(format!("taking the snapshot: {e}")))
    });
    let _ = std::fs::remove_dir_all(&staging);
    if let Err(e) = imported {
        let _ = std::fs::remove_dir_all(dir);
        return Err(e);
    }
    Ok(())
}
