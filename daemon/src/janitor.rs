//! The janitor: once a second, sandboxes past their lifetime, or idle past their idle TTL
//! with no execution running, are destroyed.

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::SandboxState;

use crate::exec::Executions;
use crate::reason::EndReason;
use crate::sandbox::{SandboxRt, Sandboxes};

/// Why `rt` should end now, if it should.
fn expired(rt: &SandboxRt, busy: bool) -> Option<(EndReason, String)> {
    let r = rt.snapshot();
    if r.state() == SandboxState::Starting {
        return None;
    }
    if rt.age() >= Duration::from_secs(r.max_lifetime_s.into()) {
        return Some((
            EndReason::LifetimeExceeded,
            format!("its lifetime of {} s ended", r.max_lifetime_s),
        ));
    }
    if !busy && rt.idle_for() >= Duration::from_secs(r.idle_ttl_s.into()) {
        return Some((
            EndReason::IdleTimeout,
            format!("idle for {} s", r.idle_ttl_s),
        ));
    }
    None
}

/// Runs for ever.
pub async fn run(sandboxes: Arc<Sandboxes>, executions: Arc<Executions>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        for rt in sandboxes.all() {
            let Some((reason, message)) = expired(&rt, executions.busy(&rt.id)) else {
                continue;
            };
            let s = sandboxes.clone();
            tokio::spawn(async move {
                let _op = rt.ops.lock().await;
                let _ = s.end(&rt, reason, &message).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use airlock_api::v1::{FilePolicy, Sandbox};

    use super::*;

    fn sandbox(state: SandboxState, age_s: u64) -> SandboxRt {
        let record = Sandbox {
            id: "sb-1".into(),
            state: state as i32,
            idle_ttl_s: 0,
            max_lifetime_s: 10,
            ..Default::default()
        };
        SandboxRt::new(
            record,
            HashMap::new(),
            FilePolicy::default(),
            Duration::from_secs(age_s),
        )
    }

    #[test]
    fn lifetime_and_idle_ttl_end_sandboxes_and_work_keeps_them() {
        let old = sandbox(SandboxState::Running, 11);
        assert_eq!(
            expired(&old, true).map(|e| e.0),
            Some(EndReason::LifetimeExceeded)
        );
        let idle = sandbox(SandboxState::Paused, 1);
        assert_eq!(
            expired(&idle, false).map(|e| e.0),
            Some(EndReason::IdleTimeout)
        );
        assert_eq!(expired(&idle, true), None, "an execution keeps it");
        let starting = sandbox(SandboxState::Starting, 100);
        assert_eq!(expired(&starting, false), None);
    }
}
