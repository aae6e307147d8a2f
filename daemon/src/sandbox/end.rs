//! The end of a sandbox, whoever ends it (a call, a TTL, a failed create, its VMM's death, a
//! stopping daemon): its VMM is killed and gone, its cgroup and run directory removed, its
//! executions ended with it, its final record stored. Idempotent.

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::Sandbox;
use tracing::{info, warn};

use super::{SandboxRt, Sandboxes};
use crate::error::ApiResult;
use crate::ids;
use crate::reason::{EndReason, ExecEnd};
use crate::supervisor::VmmExited;
use crate::vmm;

/// How long a killed VMM may take to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);

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
        if let Some(v) = rt.vmm() {
            v.kill();
            if !v.wait_gone(KILL_WAIT).await {
                warn!(sandbox = %rt.id, pid = v.pid, "the VMM did not end within {KILL_WAIT:?}");
            }
            v.remove_leftovers();
        }
        // Its proxy and DNS server stop, their sockets close: with the VMM gone, nothing holds
        // its network namespace any more.
        rt.drop_net();
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
