//! Control-socket requests: one line each, `WORD [ARGUMENT]`.

use std::fmt;
use std::path::PathBuf;

/// Longest request line a VMM accepts.
pub const MAX_LINE: usize = 4096;

/// What a controller can ask of a VMM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Park every vCPU outside `KVM_RUN` ([`crate::StateReply`]).
    Pause,
    /// Let paused vCPUs run again ([`crate::StateReply`]).
    Resume,
    /// Write a snapshot of the paused VM into the directory, which the caller prepared
    /// ([`crate::snapshot_dir::prepare`]; [`crate::SnapshotReply`]).
    Snapshot(PathBuf),
    /// Wait, at most this many milliseconds, until the guest is quiet (the VMM's threads
    /// nearly idle for a stretch), so that a snapshot taken next holds no pending work
    /// ([`crate::SettleReply`]).
    Settle(u64),
    /// State and shape ([`crate::StatusReply`]).
    Status,
    /// End the VM; the VMM exits with code 0 ([`crate::StopReply`]).
    Stop,
    /// A warm pool process restores the snapshot in the directory and answers once the
    /// clone's vCPUs run ([`crate::RestoreReply`]); only a pool process takes it, once.
    Restore(RestoreRequest),
    /// A test hook (`airlock-vmm --test-hooks` only): the words after `probe`.
    Probe(String),
}

/// `restore [disk-quota-mib=N] DIR`: the snapshot, and the most its copy-on-write root disk
/// may take of the host's disk (default: what the pool process was started with).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreRequest {
    pub dir: PathBuf,
    pub disk_quota_mib: Option<u64>,
}

impl RestoreRequest {
    fn parse(arg: &str) -> Result<Self, String> {
        const QUOTA: &str = "disk-quota-mib=";
        let (quota, dir) = match arg.strip_prefix(QUOTA) {
            Some(rest) => {
                let (n, dir) = rest.split_once(' ').unwrap_or((rest, ""));
                let n = n
                    .parse::<u64>()
                    .map_err(|_| format!("{QUOTA} needs a number of MiB, not {n:?}"))?;
                (Some(n), dir.trim())
            }
            None => (None, arg),
        };
        if dir.is_empty() {
            return Err("restore needs a directory".into());
        }
        Ok(Self {
            dir: PathBuf::from(dir),
            disk_quota_mib: quota,
        })
    }
}

impl fmt::Display for RestoreRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(q) = self.disk_quota_mib {
            write!(f, "disk-quota-mib={q} ")?;
        }
        write!(f, "{}", self.dir.display())
    }
}

impl Request {
    /// Parses one request line (surrounding white space ignored).
    pub fn parse(line: &str) -> Result<Self, String> {
        let line = line.trim();
        let (word, arg) = line.split_once(' ').unwrap_or((line, ""));
        let arg = arg.trim();
        let dir = |what: &str| {
            if arg.is_empty() {
                Err(format!("{what} needs a directory"))
            } else {
                Ok(PathBuf::from(arg))
            }
        };
        match (word, arg.is_empty()) {
            ("pause", true) => Ok(Self::Pause),
            ("resume", true) => Ok(Self::Resume),
            ("status", true) => Ok(Self::Status),
            ("stop", true) => Ok(Self::Stop),
            ("snapshot", _) => dir("snapshot").map(Self::Snapshot),
            ("restore", _) => RestoreRequest::parse(arg).map(Self::Restore),
            ("probe", _) => Ok(Self::Probe(arg.to_owned())),
            ("settle", _) => arg
                .parse()
                .map(Self::Settle)
                .map_err(|_| "settle needs a number of milliseconds".to_owned()),
            ("", _) => Err("empty command".into()),
            (w @ ("pause" | "resume" | "status" | "stop"), false) => {
                Err(format!("{w} takes no argument"))
            }
            (w, _) => Err(format!(
                "unknown command {w:?} (pause, resume, settle MS, snapshot DIR, status, stop, \
                 restore DIR)"
            )),
        }
    }

    /// The line that [`parse`](Self::parse) reads back (without the newline).
    pub fn to_line(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pause => f.write_str("pause"),
            Self::Resume => f.write_str("resume"),
            Self::Status => f.write_str("status"),
            Self::Stop => f.write_str("stop"),
            Self::Snapshot(d) => write!(f, "snapshot {}", d.display()),
            Self::Restore(r) => write!(f, "restore {r}"),
            Self::Probe(words) => write!(f, "probe {words}"),
            Self::Settle(ms) => write!(f, "settle {ms}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_reads_back_what_it_writes() {
        for r in [
            Request::Pause,
            Request::Resume,
            Request::Status,
            Request::Stop,
            Request::Snapshot("/var/lib/airlock/run/vm-1/snap shot".into()),
            Request::Restore(RestoreRequest {
                dir: "/t/tpl-1".into(),
                disk_quota_mib: None,
            }),
            Request::Restore(RestoreRequest {
                dir: "/t/tpl 2".into(),
                disk_quota_mib: Some(1024),
            }),
            Request::Probe("kill 1 9".into()),
            Request::Settle(2000),
        ] {
            assert_eq!(Request::parse(&r.to_line()), Ok(r.clone()), "{r}");
        }
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        for bad in [
            "",
            "  ",
            "pause now",
            "snapshot",
            "restore  ",
            "rm -rf /",
            "STATUS",
            "settle",
            "settle soon",
            "restore disk-quota-mib=",
            "restore disk-quota-mib=lots /t",
            "restore disk-quota-mib=5",
        ] {
            assert!(Request::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(Request::parse(" resume \n"), Ok(Request::Resume));
    }
}
