//! What the end of a sandbox's VMM means for the sandbox: its [`EndReason`] and a sentence,
//! from the exit status (the codes of `airlock_control::exit`), the cgroup's OOM count and
//! the VMM's log.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use airlock_control::exit::VmmExit;

use crate::reason::EndReason;

/// Why the VMM ended: `status` is `None` for a VMM this daemon adopted (not its child: the
/// status went to its new parent), where the log still tells a seccomp violation.
pub fn describe(status: Option<ExitStatus>, oom: bool, log: &Path) -> (EndReason, String) {
    let (reason, message) = classify(status, oom);
    if (reason == EndReason::SeccompViolation || status.is_none())
        && let Some(line) = super::log_line(log, "seccomp violation")
    {
        let message = if reason == EndReason::SeccompViolation {
            format!("{message} ({line})")
        } else {
            format!("{} ({line})", VmmExit::SeccompViolation.describe())
        };
        return (EndReason::SeccompViolation, message);
    }
    (reason, message)
}

fn classify(status: Option<ExitStatus>, oom: bool) -> (EndReason, String) {
    if oom {
        return (
            EndReason::OomKilled,
            "the sandbox exceeded its memory limit and its VMM was killed".into(),
        );
    }
    let Some(status) = status else {
        return (EndReason::SandboxDead, "the VMM ended".into());
    };
    if status.signal() == Some(libc::SIGSYS) {
        return (
            EndReason::SeccompViolation,
            VmmExit::SeccompViolation.describe(),
        );
    }
    if let Some(sig) = status.signal() {
        return (
            EndReason::SandboxDead,
            format!("the VMM was killed by signal {sig}"),
        );
    }
    let Some(code) = status.code() else {
        return (EndReason::SandboxDead, "the VMM ended".into());
    };
    let exit = VmmExit::from_code(code);
    let reason = match exit {
        VmmExit::SeccompViolation => EndReason::SeccompViolation,
        e if e.is_guest_crash() => EndReason::GuestCrashed,
        _ => EndReason::SandboxDead,
    };
    (reason, exit.describe())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_map_to_reasons() {
        let st = |raw| Some(ExitStatus::from_raw(raw));
        let none = Path::new("/nonexistent/vmm.log");
        let reason = |s, oom| describe(s, oom, none).0;
        assert_eq!(reason(st(9), false), EndReason::SandboxDead);
        assert!(describe(st(9), false, none).1.contains("signal 9"));
        assert_eq!(reason(st(9), true), EndReason::OomKilled);
        assert_eq!(reason(st(64 << 8), false), EndReason::GuestCrashed);
        assert_eq!(reason(st(68 << 8), false), EndReason::GuestCrashed);
        assert_eq!(reason(st(70 << 8), false), EndReason::SeccompViolation);
        assert_eq!(reason(st(libc::SIGSYS), false), EndReason::SeccompViolation);
        assert_eq!(reason(st(0), false), EndReason::SandboxDead);
        assert_eq!(reason(None, false), EndReason::SandboxDead);
    }

    #[test]
    fn an_adopted_vmm_that_died_of_seccomp_is_told_by_its_log() {
        let dir = std::env::temp_dir().join(format!("airlock-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_default();
        let log = dir.join("vmm.log");
        std::fs::write(&log, "x\nERROR seccomp violation: syscall 41 on vcpu\n")
            .unwrap_or_default();
        let (reason, message) = describe(None, false, &log);
        assert_eq!(reason, EndReason::SeccompViolation);
        assert!(message.contains("syscall 41"), "{message}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
