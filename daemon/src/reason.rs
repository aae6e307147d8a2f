//! Why things end, as types: a sandbox's [`EndReason`] and an execution's [`ExecEnd`] and
//! [`Outcome`]. Records and the API carry their codes (`end_reason`, `error_reason`); nothing
//! else in the daemon spells them.

use airlock_api::v1::{ExecutionState, SandboxState};

/// Why a sandbox ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// DestroySandbox.
    Destroyed,
    /// Idle for longer than its idle TTL.
    IdleTimeout,
    /// Past its lifetime.
    LifetimeExceeded,
    /// The guest kernel panicked, triple-faulted, or KVM could not run it.
    GuestCrashed,
    /// The sandbox's cgroup memory limit killed its VMM.
    OomKilled,
    /// Its VMM made a system call outside its seccomp filter.
    SeccompViolation,
    /// Its VMM ended for another reason (killed, powered off).
    SandboxDead,
    /// The daemon restarted and could not adopt it again.
    DaemonRestarted,
    /// The daemon stopped everything (`on_stop = "stop"`).
    DaemonStopped,
    /// Cluster mode: the node that ran it left the cluster (reported by the others).
    NodeLost,
    /// Its create failed, with the error's reason code.
    CreateFailed(String),
}

impl EndReason {
    /// The record's `end_reason`.
    pub fn code(&self) -> &str {
        match self {
            Self::Destroyed => "DESTROYED",
            Self::IdleTimeout => "IDLE_TIMEOUT",
            Self::LifetimeExceeded => "LIFETIME_EXCEEDED",
            Self::GuestCrashed => "GUEST_CRASHED",
            Self::OomKilled => "OOM_KILLED",
            Self::SeccompViolation => "SECCOMP_VIOLATION",
            Self::SandboxDead => "SANDBOX_DEAD",
            Self::DaemonRestarted => "DAEMON_RESTARTED",
            Self::DaemonStopped => "DAEMON_STOPPED",
            Self::NodeLost => "NODE_LOST",
            Self::CreateFailed(code) => code,
        }
    }

    /// A record's `end_reason` read back.
    pub fn from_code(code: &str) -> Self {
        match code {
            "DESTROYED" => Self::Destroyed,
            "IDLE_TIMEOUT" => Self::IdleTimeout,
            "LIFETIME_EXCEEDED" => Self::LifetimeExceeded,
            "GUEST_CRASHED" => Self::GuestCrashed,
            "OOM_KILLED" => Self::OomKilled,
            "SECCOMP_VIOLATION" => Self::SeccompViolation,
            "SANDBOX_DEAD" | "" => Self::SandboxDead,
            "DAEMON_RESTARTED" => Self::DaemonRestarted,
            "DAEMON_STOPPED" => Self::DaemonStopped,
            "NODE_LOST" => Self::NodeLost,
            other => Self::CreateFailed(other.to_owned()),
        }
    }

    /// The state a sandbox that ended this way is in: destroyed on purpose, or dead.
    pub fn state(&self) -> SandboxState {
        match self {
            Self::Destroyed | Self::IdleTimeout | Self::LifetimeExceeded => SandboxState::Destroyed,
            _ => SandboxState::Dead,
        }
    }

    /// The reason code of a call on a dead sandbox: the guest's own failures keep theirs,
    /// everything else is SANDBOX_DEAD.
    pub fn dead_call_reason(&self) -> &'static str {
        match self {
            Self::GuestCrashed => "GUEST_CRASHED",
            Self::OomKilled => "OOM_KILLED",
            Self::SeccompViolation => "SECCOMP_VIOLATION",
            _ => "SANDBOX_DEAD",
        }
    }
}

/// Why the daemon (not the guest) ended an execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecEnd {
    /// Past its timeout.
    Timeout { timeout_ms: u64 },
    /// KillExecution with SIGKILL.
    Killed,
    /// Its sandbox was destroyed.
    SandboxDestroyed,
    /// Its sandbox died.
    SandboxEnded(EndReason, String),
    /// The agent connection broke and the sandbox lives.
    AgentUnavailable(String),
    /// The daemon restarted and could not follow it again.
    DaemonRestarted(String),
    /// The guest refused to start it: no such program, working directory or account, or the
    /// account may not run it there.
    StartFailed(String),
}

impl ExecEnd {
    /// For an execution whose sandbox ended with `reason`.
    pub fn of_sandbox(reason: &EndReason, message: &str) -> Self {
        if reason.state() == SandboxState::Destroyed {
            Self::SandboxDestroyed
        } else {
            Self::SandboxEnded(reason.clone(), message.to_owned())
        }
    }

    /// The record's state.
    pub fn state(&self) -> ExecutionState {
        match self {
            Self::Timeout { .. } => ExecutionState::TimedOut,
            Self::Killed | Self::SandboxDestroyed => ExecutionState::Killed,
            Self::SandboxEnded(EndReason::OomKilled, _) => ExecutionState::OomKilled,
            _ => ExecutionState::Failed,
        }
    }

    /// The record's `error_reason`.
    pub fn code(&self) -> &str {
        match self {
            Self::Timeout { .. } => "EXEC_TIMEOUT",
            Self::Killed => "KILLED",
            Self::SandboxDestroyed => "SANDBOX_DESTROYED",
            Self::SandboxEnded(r, _) => r.code(),
            Self::AgentUnavailable(_) => "AGENT_UNAVAILABLE",
            Self::DaemonRestarted(_) => "DAEMON_RESTARTED",
            Self::StartFailed(_) => "START_FAILED",
        }
    }

    /// The record's `error_message`.
    pub fn message(&self) -> String {
        match self {
            Self::Timeout { timeout_ms } => {
                format!("the execution ran past its timeout of {timeout_ms} ms")
            }
            Self::Killed => "killed by KillExecution".into(),
            Self::SandboxDestroyed => "the sandbox was destroyed".into(),
            Self::SandboxEnded(_, m)
            | Self::AgentUnavailable(m)
            | Self::DaemonRestarted(m)
            | Self::StartFailed(m) => m.clone(),
        }
    }
}

/// How an execution ended, as the metrics count it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Exited,
    TimedOut,
    Killed,
    OomKilled,
    Failed,
}

impl Outcome {
    pub fn of(state: ExecutionState) -> Self {
        match state {
            ExecutionState::Exited => Self::Exited,
            ExecutionState::TimedOut => Self::TimedOut,
            ExecutionState::Killed => Self::Killed,
            ExecutionState::OomKilled => Self::OomKilled,
            _ => Self::Failed,
        }
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Exited => "exited",
            Self::TimedOut => "timed_out",
            Self::Killed => "killed",
            Self::OomKilled => "oom_killed",
            Self::Failed => "failed",
        }
    }
}

/// A sandbox state's name in logs, metrics and errors.
pub fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Starting => "starting",
        SandboxState::Running => "running",
        SandboxState::Paused => "paused",
        SandboxState::Dead => "dead",
        SandboxState::Destroyed => "destroyed",
        SandboxState::Unspecified => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_reasons_round_trip_and_decide_the_state() {
        for r in [
            EndReason::Destroyed,
            EndReason::IdleTimeout,
            EndReason::LifetimeExceeded,
            EndReason::GuestCrashed,
            EndReason::OomKilled,
            EndReason::SeccompViolation,
            EndReason::SandboxDead,
            EndReason::DaemonRestarted,
            EndReason::DaemonStopped,
            EndReason::CreateFailed("CAPACITY_EXHAUSTED".into()),
        ] {
            assert_eq!(EndReason::from_code(r.code()), r);
        }
        assert_eq!(EndReason::IdleTimeout.state(), SandboxState::Destroyed);
        assert_eq!(EndReason::OomKilled.state(), SandboxState::Dead);
        assert_eq!(EndReason::OomKilled.dead_call_reason(), "OOM_KILLED");
        assert_eq!(
            EndReason::DaemonRestarted.dead_call_reason(),
            "SANDBOX_DEAD"
        );
    }

    #[test]
    fn executions_take_their_sandboxs_end() {
        let destroyed = ExecEnd::of_sandbox(&EndReason::Destroyed, "x");
        assert_eq!(destroyed.state(), ExecutionState::Killed);
        assert_eq!(destroyed.code(), "SANDBOX_DESTROYED");
        let oom = ExecEnd::of_sandbox(&EndReason::OomKilled, "memory");
        assert_eq!(oom.state(), ExecutionState::OomKilled);
        assert_eq!(oom.code(), "OOM_KILLED");
        let crashed = ExecEnd::of_sandbox(&EndReason::GuestCrashed, "panic");
        assert_eq!(crashed.state(), ExecutionState::Failed);
        assert_eq!(crashed.message(), "panic");
        assert_eq!(
            ExecEnd::Timeout { timeout_ms: 5 }.state(),
            ExecutionState::TimedOut
        );
        assert_eq!(Outcome::of(ExecutionState::Killed).label(), "killed");
    }
}
