//! The end of a sandbox, whoever ends it (a call, a TTL, a failed create, its VMM's death, a
//! stopping daemon): its VMM is killed and gone, its cgroup and run directory removed, its
//! executions ended with it, its final record stored. Idempotent.

use airlock_proto::Requests;
use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::{Sandbox, SandboxState};
use tracing::{info, warn};

use super::{SandboxRt, Sandboxes};
use crate::error::ApiResult;
use crate::ids;
use crate::reason::{EndReason, ExecEnd};
use crate::supervisor::VmmExited;
use crate::vmm;

/// How long a killed VMM may take to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How long a sandbox with volumes may take to unmount them and power off before it is killed.
const POWER_OFF_WAIT: Duration = Duration::from_secs(20);

/// Asks the guest to unmount its volumes, sync and power off (PowerOff), and waits for its VMM
/// to end, at most [`POWER_OFF_WAIT`]: what the sandbox wrote to a volume is then on the
/// host's disk and the volume clean. A guest that does not cooperate is killed anyway (its
/// volumes' journals replay at their next read-write mount).
async fn power_off(rt: &SandboxRt, v: &vmm::VmmProcess) {
    let agent = v.agent.clone();
    let asked = tokio::task::spawn_blocking(move || {
        let mut c = agent.client()?;
        c.within(POWER_OFF_WAIT, |c| {
            c.call(airlock_proto::pb::request::Kind::PowerOff(
                airlock_proto::pb::PowerOff {},
            ))
        })
    })
    .await;
    match asked {
        Ok(Ok(_)) => {
            if !v.wait_gone(POWER_OFF_WAIT).await {
                warn!(sandbox = %rt.id, "the guest did not power off within {POWER_OFF_WAIT:?}");
            }
        }
        Ok(Err(e)) => warn!(sandbox = %rt.id, "asking the guest to power off: {e}"),
        Err(e) => warn!(sandbox = %rt.id, "power-off task: {e}"),
    }
}

impl Sandboxes {
    /// Ends a live sandbox for `reason`; the final record.
    pub async fn end(
        &self,
        rt: &Arc<SandboxRt>,
        reason: EndReason,
        message: &str,
    ) -> ApiResult<Sandbox> {
        if rt.begin_end() {
            // Someone else is ending it; the record says how.
            return Ok(rt.snapshot());
        }
        let usage = rt.snapshot();
        let mut vmm_gone = true;
        if let Some(v) = rt.vmm() {
            if !usage.volumes.is_empty() && usage.state == SandboxState::Running as i32 {
                power_off(rt, &v).await;
            }
            v.kill();
            if !v.wait_gone(KILL_WAIT).await {
                vmm_gone = false;
                warn!(sandbox = %rt.id, pid = v.pid, "the VMM did not end within {KILL_WAIT:?}");
            }
            v.remove_leftovers();
        }
        // Its proxy and DNS server stop, their sockets close: with the VMM gone, nothing holds
        // its network namespace any more.
        rt.drop_net();
        self.volumes.release(&rt.id);
        self.executions
            .end_all_of(&rt.id, &ExecEnd::of_sandbox(&reason, message));
        let record = rt.update(|r| {
            r.state = reason.state() as i32;
            r.vmm_pid = 0;
            r.end_reason = reason.code().to_owned();
            r.end_message = message.to_owned();
            r.ended_unix_ms = ids::now_ms();
            r.cpu_usage_us = usage.cpu_usage_us;
            r.memory_peak_bytes = usage.memory_peak_bytes;
        });
        self.store.put_sandbox(&record)?;
        let _ = self.store.remove_sandbox_spec(&rt.id);
        self.live_map().remove(&rt.id);
        if let Some(ledger) = self.ledger() {
            ledger.release(&record);
        }
        // Its values are no longer redacted from the daemon's log: its outputs are stored.
        crate::secrets::logs::unregister(&rt.id);
        let secrets: Vec<&str> = record.secrets.iter().map(|s| s.name.as_str()).collect();
        crate::audit::emit(
            &rt.tenant,
            crate::audit::Kind::SandboxEnd,
            &rt.id,
            "",
            serde_json::json!({
                "reason": reason.code(),
                "message": message,
                "cleanup": {
                    "vmm_ended": vmm_gone,
                    "network_removed": true,
                    "volumes_released": record.volumes.iter().map(|v| &v.name).collect::<Vec<_>>(),
                    "secrets_dropped": secrets,
                },
                "cpu_usage_us": record.cpu_usage_us,
                "memory_peak_bytes": record.memory_peak_bytes,
            }),
        );
        info!(sandbox = %rt.id, reason = reason.code(), "sandbox ended: {message}");
        Ok(record)
    }

    /// A sandbox's VMM ended: unless the sandbox was ending anyway, it is dead, with the
    /// reason its exit tells.
    pub async fn vmm_exited(&self, id: &str, ev: &VmmExited) {
        let Some(rt) = self.by_id(id) else {
            ev.vmm.remove_leftovers();
            return;
        };
        if rt.is_ending() {
            return; // `end` cleans up
        }
        let oom = ev
            .vmm
            .cgroup
            .as_ref()
            .is_some_and(crate::cgroup::Cgroup::oom_killed);
        let (reason, message) = vmm::exit::describe(ev.status, oom, &ev.vmm.log());
        warn!(sandbox = %id, reason = reason.code(), "{message}");
        if reason == EndReason::GuestCrashed {
            // The console is the guest's (a tenant's) text: the operator's log only, never an
            // API error. Read before `end` removes the run directory.
            let console = vmm::last_lines(&ev.vmm.console(), 25);
            warn!(sandbox = %id, "the guest's console ended: {console}");
        }
        let _ = self.end(&rt, reason, &message).await;
    }

    /// Every live sandbox ends with `reason` (a daemon that stops everything).
    pub async fn end_all(&self, reason: EndReason, message: &str) {
        for rt in self.all() {
            let _ = self.end(&rt, reason.clone(), message).await;
        }
    }
}
