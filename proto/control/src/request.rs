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

/// `restore [disk-quota-mib=N] [slots=M,M,...] DIR`: the snapshot, the most its copy-on-write
/// root disk may take of the host's disk (default: what the pool process was started with),
/// and media for its disk slots, in slot order: `rw` or `ro` for a slot that gets the next of
/// the descriptors sent with the line (SCM_RIGHTS), `-` for one left empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreRequest {
    pub dir: PathBuf,
    pub disk_quota_mib: Option<u64>,
    pub slots: Vec<SlotMode>,
}

/// What a disk slot gets at a restore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotMode {
    Empty,
    ReadWrite,
    ReadOnly,
}

impl SlotMode {
    fn word(self) -> &'static str {
        match self {
            Self::Empty => "-",
            Self::ReadWrite => "rw",
            Self::ReadOnly => "ro",
        }
    }
}

/// The most disk slots a restore names.
pub const MAX_SLOTS: usize = 8;

impl RestoreRequest {
    /// Descriptors the line says come with it.
    pub fn media_count(&self) -> usize {
        self.slots.iter().filter(|m| **m != SlotMode::Empty).count()
    }

    fn parse(arg: &str) -> Result<Self, String> {
        let mut req = Self {
            dir: PathBuf::new(),
            disk_quota_mib: None,
            slots: Vec::new(),
        };
        let mut rest = arg;
        loop {
            let (word, after) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(n) = word.strip_prefix("disk-quota-mib=") {
                let n = n
                    .parse::<u64>()
                    .map_err(|_| format!("disk-quota-mib= needs a number of MiB, not {n:?}"))?;
                req.disk_quota_mib = Some(n);
            } else if let Some(list) = word.strip_prefix("slots=") {
                req.slots = list
                    .split(',')
                    .map(|m| match m {
                        "-" => Ok(SlotMode::Empty),
                        "rw" => Ok(SlotMode::ReadWrite),
                        "ro" => Ok(SlotMode::ReadOnly),
                        other => Err(format!("slots=: rw, ro or -, not {other:?}")),
                    })
                    .collect::<Result<_, _>>()?;
                if req.slots.len() > MAX_SLOTS {
                    return Err(format!("slots=: at most {MAX_SLOTS}"));
                }
            } else {
                break;
            }
            rest = after.trim_start();
        }
        if rest.is_empty() {
            return Err("restore needs a directory".into());
        }
        req.dir = PathBuf::from(rest);
        Ok(req)
    }
}

impl fmt::Display for RestoreRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(q) = self.disk_quota_mib {
            write!(f, "disk-quota-mib={q} ")?;
        }
        if !self.slots.is_empty() {
            let words: Vec<_> = self.slots.iter().map(|m| m.word()).collect();
            write!(f, "slots={} ", words.join(","))?;
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
                slots: vec![],
            }),
            Request::Restore(RestoreRequest {
                dir: "/t/tpl 2".into(),
                disk_quota_mib: Some(1024),
                slots: vec![SlotMode::ReadWrite, SlotMode::Empty, SlotMode::ReadOnly],
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
            "restore slots=rx /t",
            "restore slots=rw,rw,rw,rw,rw,rw,rw,rw,rw /t",
            "restore slots=rw",
        ] {
            assert!(Request::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert_eq!(Request::parse(" resume \n"), Ok(Request::Resume));
    }
}
