//! A started (or adopted) VMM process: a pidfd to kill it with (never a recycled pid) and the
//! future of its end, which reaps it and gives its uid back.

use std::io;
use std::os::fd::OwnedFd;
use std::process::ExitStatus;

use tracing::warn;

use super::sys;
use super::uids::UidLease;

/// A started VMM. Its uid is given back only once the process has been reaped: by
/// the exit future of [`Spawned::split`], or, if it is dropped unsplit, by a thread that kills
/// and reaps it.
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    pub(super) pidfd: Option<OwnedFd>,
    pub(super) lease: Option<UidLease>,
    /// The daemon's sockets in the VMM's network namespace (with a network).
    pub exits: Option<crate::net::NetExits>,
}

/// The end of a VMM: resolves when it has exited (and, if it is our child, been reaped, its
/// uid given back); the status is known only for our own children.
pub type ExitFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = io::Result<Option<ExitStatus>>> + Send>>;

/// Kills one process through its pidfd (never a recycled pid).
#[derive(Debug)]
pub struct ProcessHandle {
    pub(super) pidfd: OwnedFd,
}

impl ProcessHandle {
    /// SIGKILL; a process that has already ended is no error.
    pub fn kill(&self) {
        let _ = sys::send_signal(&self.pidfd, libc::SIGKILL);
    }
}

impl Spawned {
    /// The uid it runs as in its jail (`None` unjailed).
    pub fn uid(&self) -> Option<u32> {
        self.lease.as_ref().map(|l| l.uid)
    }

    /// Splits the process into a handle that kills it and the future of its exit, which reaps
    /// it and gives its uid back.
    pub fn split(mut self) -> io::Result<(ProcessHandle, ExitFuture)> {
        let pidfd = self
            .pidfd
            .take()
            .ok_or_else(|| io::Error::other("already reaped"))?;
        let lease = self.lease.take();
        let handle = ProcessHandle {
            pidfd: pidfd.try_clone()?,
        };
        let exit = async move {
            let status = wait_exit(pidfd, true).await;
            drop(lease);
            status
        };
        Ok((handle, Box::pin(exit)))
    }
}

/// Waits until the process behind `pidfd` has exited; reaps it (`child`) and returns its
/// status, or, for a process that is not our child, returns `None` once it is gone.
pub(super) async fn wait_exit(pidfd: OwnedFd, child: bool) -> io::Result<Option<ExitStatus>> {
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;
    // SAFETY: the OwnedFd owns the pidfd, so it stays open and names the same process for as
    // long as the AsyncFd holds it, and its raw value never changes.
    let fd = unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    loop {
        let mut ready = fd.readable().await?;
        if !child {
            // A pidfd polls readable once its process has exited.
            return Ok(None);
        }
        if let Some(status) = sys::wait_pidfd(fd.get_ref(), false)? {
            return Ok(Some(status));
        }
        ready.clear_ready();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let Some(pidfd) = self.pidfd.take() else {
            return;
        };
        let _ = sys::send_signal(&pidfd, libc::SIGKILL);
        let lease = self.lease.take();
        let reaper = std::thread::Builder::new()
            .name("vmm-reaper".into())
            .spawn(move || {
                let _ = sys::wait_blocking(&pidfd);
                drop(lease);
            });
        if let Err(e) = reaper {
            warn!("reaping VMM {}: {e}", self.pid);
        }
    }
}

/// The start time of `pid` in clock ticks since boot (`/proc/PID/stat` field 22).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may contain anything.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// SIGKILLs `pid` if it is alive and started at `ticks` (for records of processes without a
/// handle: an older daemon's). Returns whether a signal was sent.
pub fn kill_verified(pid: u32, ticks: u64) -> bool {
    if start_ticks(pid) != Some(ticks) {
        return false;
    }
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) on a pid checked by its start time; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn start_ticks_of_this_process_is_stable() {
        let me = std::process::id();
        let a = start_ticks(me).expect("own stat");
        assert_eq!(start_ticks(me), Some(a));
        assert_eq!(start_ticks(u32::MAX), None);
    }

    #[test]
    fn kill_verified_spares_a_process_with_another_start_time() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let ticks = start_ticks(pid).unwrap();
        assert!(!kill_verified(pid, ticks + 1));
        assert!(child.try_wait().unwrap().is_none());
        assert!(kill_verified(pid, ticks));
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
    }
}
