//! A daemon that starts finds what the previous one left: VMM processes recorded in the store,
//! cgroups and run directories, records of live sandboxes and running executions. With
//! `adopt_on_restart` (the default) running and paused sandboxes are adopted again: their VMM
//! (the recorded pid, checked by its start time and jail uid, and its control socket answering),
//! cgroup and sockets, and the executions still running in their guests, whose output continues
//! where the stored output ends. A sandbox with secrets is adopted with them when their sealed
//! record opens with this daemon's key (`secrets/seal.rs`); otherwise it is reaped.
//! Whatever cannot be verified is reaped: warm pool processes,
//! template builds and creates that were in flight, VMMs that are gone or not what the record
//! says. Their records end as DAEMON_RESTARTED.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::{Execution, ExecutionState, Sandbox, SandboxState};
use airlock_control::VmState;
use tracing::{info, warn};

use crate::error::{ApiError, ApiResult};
use crate::exec::Executions;
use crate::host::VmmHost;
use crate::ids;
use crate::reason::{EndReason, ExecEnd};
use crate::sandbox::{SandboxRt, Sandboxes};
use crate::store::{Owner, Store, VmmRecord};
use crate::vmm::{self, VmmProcess};

/// How long a reaped VMM may take to be gone.
const REAP_WAIT: Duration = Duration::from_secs(5);

/// What recovery needs.
#[derive(Debug)]
pub struct Recovery<'a> {
    pub store: &'a Arc<Store>,
    pub host: &'a Arc<VmmHost>,
    pub sandboxes: &'a Arc<Sandboxes>,
    pub executions: &'a Arc<Executions>,
    pub adopt: bool,
}

/// What recovery did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    pub adopted: usize,
    pub executions_followed: usize,
    pub reaped: usize,
    pub ended: usize,
}

impl Recovery<'_> {
    /// Adopts or reaps everything the previous daemon left.
    pub async fn run(&self) -> ApiResult<Recovered> {
        let mut done = Recovered::default();
        self.reap_legacy()?;
        let mut kept = HashSet::new();
        for rec in self.store.vmms()? {
            let adopted = match &rec.owner {
                Owner::Sandbox(id) if self.adopt => self.adopt_sandbox(&rec, id).await,
                _ => Ok(false),
            };
            match adopted {
                Ok(true) => {
                    done.adopted += 1;
                    kept.insert(rec.id.clone());
                }
                Ok(false) => {
                    self.reap(&rec).await;
                    done.reaped += 1;
                }
                Err(e) => {
                    warn!(vmm = %rec.id, pid = rec.pid, "not adopted: {e}");
                    self.reap(&rec).await;
                    done.reaped += 1;
                }
            }
        }
        self.remove_leftovers(&kept);
        done.ended = self.end_orphaned_records()?;
        done.executions_followed = self.follow_executions()?;
        if done != Recovered::default() {
            info!(?done, "recovered what the previous daemon left");
        }
        Ok(done)
    }

    /// Processes recorded by a daemon older than the `vmms` table: killed.
    fn reap_legacy(&self) -> ApiResult<()> {
        for p in self.store.take_legacy_processes()? {
            crate::jail::kill_verified(p.pid, p.start_ticks);
            if let Some(cg) = &self.host.cgroups
                && !p.cgroup.is_empty()
            {
                let _ = cg.cgroup(&p.cgroup).remove();
            }
            let _ = std::fs::remove_dir_all(&p.run_dir);
        }
        Ok(())
    }

    /// The VMM of a running or paused sandbox, taken back: `false` if it is not one to take.
    async fn adopt_sandbox(&self, rec: &VmmRecord, id: &str) -> ApiResult<bool> {
        let Some(record) = self.store.sandbox(id)? else {
            return Ok(false);
        };
        if !matches!(record.state(), SandboxState::Running | SandboxState::Paused) {
            return Ok(false); // a create in flight, or already ended
        }
        // Before its VMM is taken: without them it could be neither served nor redacted.
        let secrets = self.restore_secrets(&record, id)?;
        let spec = self.store.sandbox_spec(id)?.unwrap_or_default();
        let Some(vmm) = self.take_back_vmm(rec).await? else {
            return Ok(false);
        };
        let pid = rec.pid;
        let state = match vmm::control::status(&vmm.control).await {
            Ok(s) if matches!(s.state, VmState::Running | VmState::Paused) => s.state,
            other => {
                vmm.kill();
                return Err(ApiError::Internal(format!(
                    "its control socket did not answer as a VM does: {other:?}"
                )));
            }
        };
        let record = Sandbox {
            state: if state == VmState::Paused {
                SandboxState::Paused
            } else {
                SandboxState::Running
            } as i32,
            vmm_pid: vmm.pid,
            ..record
        };
        let age_ms = u64::try_from(ids::now_ms() - record.created_unix_ms).unwrap_or(0);
        let policy = spec.file_policy.unwrap_or_default();
        let network = record.network.clone().unwrap_or_default();
        let mut rt = SandboxRt::new(record, spec.env, policy, Duration::from_millis(age_ms));
        if let Some(secrets) = secrets {
            rt.secrets = secrets;
        }
        if let Some(exits) = vmm.take_exits() {
            self.serve_network(&rt, exits, &network, spec.packages.as_ref(), id)?;
        }
        rt.set_vmm(vmm);
        // Its volumes stay mounted in its guest: theirs again.
        self.sandboxes
            .volumes
            .adopt(&rt.tenant, &rt.id, &rt.snapshot().volumes);
        self.store.put_sandbox(&rt.snapshot())?;
        let rt = Arc::new(rt);
        crate::secrets::logs::register(id, &rt.tenant, rt.secrets.patterns());
        self.sandboxes.insert(rt.clone());
        if rt.secrets.next_expiry().is_some() {
            self.sandboxes.expire_secrets_later(&rt);
        }
        info!(sandbox = %id, pid, "adopted the sandbox's VMM");
        Ok(true)
    }

    /// Adoption step: the secrets of the sandbox of `record` from their sealed record (`None`:
    /// it has none); an error when they cannot be had (it is then not adopted).
    fn restore_secrets(
        &self,
        record: &Sandbox,
        id: &str,
    ) -> ApiResult<Option<Arc<crate::secrets::SandboxSecrets>>> {
        if record.secrets.is_empty() {
            return Ok(None);
        }
        let refuse = |why: String| {
            Err(ApiError::Internal(format!(
                "it has secrets ({}) and {why}",
                record
                    .secrets
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        };
        let Some(sealer) = self.sandboxes.sealer.as_deref() else {
            return refuse(
                "this daemon does not seal secrets ([secrets] seal, or its key could not be had)"
                    .into(),
            );
        };
        let Some(sealed) = self.store.sealed_secrets(id)? else {
            return refuse(
                "no sealed record of them (the daemon that created it did not seal them)".into(),
            );
        };
        match crate::secrets::SandboxSecrets::unseal(id, sealer, &sealed) {
            Ok(s) => Ok(Some(Arc::new(s))),
            Err(e) => refuse(format!("the key from {}: {e}", sealer.origin())),
        }
    }

    /// Adoption step: the recorded VMM process taken back (if it still is that process) and
    /// watched by the supervisor again.
    async fn take_back_vmm(&self, rec: &VmmRecord) -> ApiResult<Option<VmmProcess>> {
        let launcher = self.host.launcher.clone();
        let (pid, ticks, uid) = (rec.pid, rec.start_ticks, rec.uid);
        let Some(mut launched) =
            tokio::task::spawn_blocking(move || launcher.adopt(pid, ticks, uid))
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))??
        else {
            return Ok(None);
        };
        let cgroup = match (&self.host.cgroups, rec.cgroup) {
            (Some(cgs), true) => Some(cgs.cgroup(&rec.id)),
            _ => None,
        };
        let vmm = VmmProcess::new(
            rec.id.clone(),
            PathBuf::from(&rec.run_dir),
            cgroup,
            &mut launched,
        );
        self.host
            .supervisor
            .watch(&vmm, launched.exit, rec.owner.clone())?;
        Ok(Some(vmm))
    }

    /// Adoption step: the sandbox's network served again on its VMM's `exits`, under its
    /// policies as its tenant's ceilings allow them now.
    fn serve_network(
        &self,
        rt: &SandboxRt,
        exits: crate::net::NetExits,
        network: &airlock_api::v1::NetworkPolicy,
        packages: Option<&airlock_api::v1::PackagePolicy>,
        id: &str,
    ) -> ApiResult<()> {
        // Its policy was within its tenant's ceiling when it was set; a ceiling lowered
        // since then wins (deny-all where it no longer allows the policy).
        let egress = &self.sandboxes.egress;
        let policy = egress.check(&rt.tenant, network).unwrap_or_else(|e| {
            warn!(sandbox = %id, "its network policy: {e}; denying all egress");
            airlock_egress::Policy::DenyAll
        });
        let asked = packages.cloned().unwrap_or_default();
        let pkg = egress.packages.policy_for(&rt.tenant, &asked).or_else(|e| {
            warn!(sandbox = %id, "its package policy: {e}; offline");
            let offline = airlock_api::v1::PackagePolicy {
                offline: true,
                ..Default::default()
            };
            egress.packages.policy_for(&rt.tenant, &offline)
        });
        let Ok(pkg) = pkg else {
            return Err(ApiError::Internal(
                "no package policy for the sandbox".into(),
            ));
        };
        let pkg = egress.packages.session(&rt.tenant, &rt.id, pkg, true);
        match egress.start(
            &rt.id,
            &rt.tenant,
            exits,
            policy,
            true,
            crate::net::Uses {
                packages: pkg,
                secrets: rt.secrets.clone(),
            },
        ) {
            Ok(net) => rt.set_net(net),
            Err(e) => warn!(sandbox = %id, "serving its network: {e}"),
        }
        Ok(())
    }

    /// Kills a recorded VMM (if it still is that process), waits for it, removes what it had.
    async fn reap(&self, rec: &VmmRecord) {
        let launcher = self.host.launcher.clone();
        let (pid, ticks, uid) = (rec.pid, rec.start_ticks, rec.uid);
        let adopted = tokio::task::spawn_blocking(move || launcher.adopt(pid, ticks, uid)).await;
        if let Ok(Ok(Some(l))) = adopted {
            l.handle.kill();
            if tokio::time::timeout(REAP_WAIT, l.exit).await.is_err() {
                warn!(pid, "a reaped VMM did not end within {REAP_WAIT:?}");
            }
        }
        if let Some(cgs) = &self.host.cgroups
            && rec.cgroup
        {
            let _ = cgs.cgroup(&rec.id).remove();
        }
        let _ = std::fs::remove_dir_all(&rec.run_dir);
        let _ = self.store.remove_vmm(&rec.id);
    }

    /// Cgroups and run directories of VMMs without a record (a crash between steps). A VMM's
    /// run directory is made before its cgroup, so a cgroup is this daemon's only when its run
    /// directory is in this daemon's run root: any other under the parent is left alone (it
    /// is not this data directory's to reap).
    fn remove_leftovers(&self, kept: &HashSet<String>) {
        if let Some(cg) = &self.host.cgroups {
            for name in cg.existing() {
                if !ids::Kind::Vmm.names(&name) || kept.contains(&name) {
                    continue;
                }
                if self.host.run_root().join(&name).is_dir() {
                    let _ = cg.cgroup(&name).remove();
                } else {
                    warn!(cgroup = %name, "a VMM cgroup this daemon never made: left alone");
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.host.run_root()) {
            for e in rd.flatten() {
                if !kept.contains(&e.file_name().to_string_lossy().into_owned()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// Records of sandboxes that were live and were not adopted end as DAEMON_RESTARTED, with
    /// their running executions.
    fn end_orphaned_records(&self) -> ApiResult<usize> {
        let mut ended = 0;
        for mut s in self.store.sandboxes(None)? {
            let live = matches!(
                s.state(),
                SandboxState::Starting | SandboxState::Running | SandboxState::Paused
            );
            if !live || self.sandboxes.by_id(&s.id).is_some() {
                continue;
            }
            s.state = SandboxState::Dead as i32;
            s.end_reason = EndReason::DaemonRestarted.code().into();
            s.end_message = "the daemon restarted; the sandbox's VMM was reaped".into();
            s.ended_unix_ms = ids::now_ms();
            self.store.put_sandbox(&s)?;
            let _ = self.store.remove_sandbox_spec(&s.id);
            let end = ExecEnd::DaemonRestarted("the daemon restarted".into());
            self.end_running_executions(&s.id, &end)?;
            ended += 1;
        }
        Ok(ended)
    }

    fn end_running_executions(&self, sandbox_id: &str, end: &ExecEnd) -> ApiResult<()> {
        for mut e in self.store.executions_of(sandbox_id)? {
            if e.state() == ExecutionState::Running {
                self.end_record(&mut e, end)?;
            }
        }
        Ok(())
    }

    /// Stores `e` as ended by `end` (it was lost with the previous daemon).
    fn end_record(&self, e: &mut Execution, end: &ExecEnd) -> ApiResult<()> {
        e.state = end.state() as i32;
        e.error_reason = end.code().to_owned();
        e.error_message = end.message();
        e.exit_code = -1;
        e.ended_unix_ms = ids::now_ms();
        self.store.put_execution(e)?;
        self.store.remove_execution_agent(&e.id)
    }

    /// Executions that were running in adopted sandboxes are followed again, their output
    /// redacted with their sandbox's secrets (those that had not started in the agent yet,
    /// and those with secrets of their own, which were never kept, are ended).
    fn follow_executions(&self) -> ApiResult<usize> {
        let mut followed = 0;
        for rt in self.sandboxes.all() {
            let agent = match rt.vmm() {
                Some(v) => v.agent,
                None => continue,
            };
            let patterns = Some(rt.secrets.patterns()).filter(|p| !p.is_empty());
            for e in self.store.executions_of(&rt.id)? {
                if e.state() != ExecutionState::Running {
                    continue;
                }
                let why = if had_own_secrets(&e, &rt.secrets) {
                    "the daemon restarted, and the execution's own secrets are not kept: its \
                     output could not be redacted"
                } else if let Some(agent_id) = self.store.execution_agent(&e.id)? {
                    self.executions
                        .adopt(e, agent_id, &agent, patterns.clone())?;
                    followed += 1;
                    continue;
                } else {
                    "the daemon restarted before the execution had started"
                };
                let end = ExecEnd::DaemonRestarted(why.into());
                self.end_record(&mut e.clone(), &end)?;
            }
        }
        Ok(followed)
    }
}

/// Whether execution `e` had secrets of its own (beside its sandbox's variables, each named
/// once in its record).
fn had_own_secrets(e: &Execution, secrets: &crate::secrets::SandboxSecrets) -> bool {
    let sandbox: HashSet<String> = secrets.info().into_iter().map(|s| s.name).collect();
    let mut seen = HashSet::new();
    e.secret_names
        .iter()
        .any(|n| !sandbox.contains(n) || !seen.insert(n.as_str()))
}
