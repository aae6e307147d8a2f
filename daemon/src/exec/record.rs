//! An execution's final record, merged from what the guest reported (its `ExecExit`), what the
//! host stored, and why the daemon ended it if it did. Pure, and table-tested.

use airlock_api::v1::{Execution, ExecutionState};
use airlock_proto::pb;

use crate::reason::ExecEnd;

/// The record of an execution that ended: `exit` from the guest if it reported one, `failed`
/// when the host lost it, `ended_by` when the daemon ended it (its reason wins over the
/// guest's). `stored` is the output kept per stream.
pub fn final_record(
    mut r: Execution,
    stored: [u64; 2],
    exit: Option<&pb::ExecExit>,
    failed: Option<&ExecEnd>,
    ended_by: Option<&ExecEnd>,
    now_ms: i64,
) -> Execution {
    r.ended_unix_ms = now_ms;
    r.stdout_bytes = stored[0];
    r.stderr_bytes = stored[1];
    match exit {
        Some(x) => apply_exit(&mut r, x, stored),
        None => {
            r.exit_code = -1;
            r.state = ExecutionState::Failed as i32;
            if let Some(end) = failed {
                r.error_reason = end.code().to_owned();
                r.error_message = end.message();
            }
        }
    }
    if let Some(end) = ended_by {
        r.state = end.state() as i32;
        r.error_reason = end.code().to_owned();
        r.error_message = end.message();
        if r.signal == 0 && exit.is_none() {
            r.signal = libc::SIGKILL;
        }
    }
    r
}

fn apply_exit(r: &mut Execution, x: &pb::ExecExit, stored: [u64; 2]) {
    match x.status {
        Some(pb::exec_exit::Status::ExitCode(c)) => r.exit_code = c,
        Some(pb::exec_exit::Status::Signal(s)) => {
            r.exit_code = -1;
            r.signal = s;
        }
        None => r.exit_code = -1,
    }
    r.cpu_user_us = x.cpu_user_us;
    r.cpu_system_us = x.cpu_system_us;
    r.peak_memory_bytes = x.peak_memory_bytes;
    r.stdout_bytes = x.stdout_bytes.max(stored[0]);
    r.stderr_bytes = x.stderr_bytes.max(stored[1]);
    r.output_truncated =
        x.output_truncated || x.stdout_bytes > stored[0] || x.stderr_bytes > stored[1];
    r.state = if x.timed_out {
        ExecutionState::TimedOut
    } else if x.oom_killed {
        ExecutionState::OomKilled
    } else if x.killed {
        ExecutionState::Killed
    } else {
        ExecutionState::Exited
    } as i32;
    if x.timed_out {
        r.error_reason = "EXEC_TIMEOUT".into();
        r.error_message = format!("the execution ran past its timeout of {} ms", r.timeout_ms);
    } else if x.oom_killed {
        r.error_reason = "OOM_KILLED".into();
        r.error_message = "the execution ran out of memory".into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reason::EndReason;

    fn exit(status: pb::exec_exit::Status) -> pb::ExecExit {
        pb::ExecExit {
            status: Some(status),
            stdout_bytes: 10,
            ..Default::default()
        }
    }

    #[test]
    fn records_merge_the_guests_exit_the_hosts_output_and_the_daemons_reason() {
        use pb::exec_exit::Status::{ExitCode, Signal};
        let base = Execution {
            timeout_ms: 2000,
            state: ExecutionState::Running as i32,
            ..Default::default()
        };
        let oom = pb::ExecExit {
            oom_killed: true,
            ..exit(Signal(9))
        };
        let timeout = ExecEnd::Timeout { timeout_ms: 2000 };
        let lost = ExecEnd::AgentUnavailable("connection reset".into());
        let crashed = ExecEnd::of_sandbox(&EndReason::GuestCrashed, "panic");
        // (exit, failed, ended_by) -> (state, exit_code, signal, error_reason)
        let cases: Vec<(Option<pb::ExecExit>, Option<&ExecEnd>, Option<&ExecEnd>, _)> = vec![
            (
                Some(exit(ExitCode(3))),
                None,
                None,
                (ExecutionState::Exited, 3, 0, ""),
            ),
            (
                Some(exit(Signal(15))),
                None,
                None,
                (ExecutionState::Exited, -1, 15, ""),
            ),
            (
                Some(oom),
                None,
                None,
                (ExecutionState::OomKilled, -1, 9, "OOM_KILLED"),
            ),
            (
                Some(exit(Signal(9))),
                None,
                Some(&timeout),
                (ExecutionState::TimedOut, -1, 9, "EXEC_TIMEOUT"),
            ),
            (
                None,
                Some(&lost),
                None,
                (ExecutionState::Failed, -1, 0, "AGENT_UNAVAILABLE"),
            ),
            (
                None,
                Some(&lost),
                Some(&ExecEnd::Killed),
                (ExecutionState::Killed, -1, 9, "KILLED"),
            ),
            (
                None,
                None,
                Some(&crashed),
                (ExecutionState::Failed, -1, 9, "GUEST_CRASHED"),
            ),
        ];
        for (i, (x, failed, ended_by, (state, code, signal, reason))) in
            cases.into_iter().enumerate()
        {
            let r = final_record(base.clone(), [4, 0], x.as_ref(), failed, ended_by, 77);
            assert_eq!(r.state, state as i32, "case {i}: {r:?}");
            assert_eq!(r.exit_code, code, "case {i}");
            assert_eq!(r.signal, signal, "case {i}");
            assert_eq!(r.error_reason, reason, "case {i}");
            assert_eq!(r.ended_unix_ms, 77);
        }
    }

    #[test]
    fn output_the_guest_made_but_the_host_did_not_keep_is_truncated() {
        let x = exit(pb::exec_exit::Status::ExitCode(0));
        let r = final_record(Execution::default(), [4, 0], Some(&x), None, None, 0);
        assert_eq!(r.stdout_bytes, 10);
        assert!(r.output_truncated);
        let r = final_record(Execution::default(), [10, 0], Some(&x), None, None, 0);
        assert!(!r.output_truncated);
    }
}
