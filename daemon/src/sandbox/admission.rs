//! Admission: whether a new sandbox fits the host (sandboxes, committed guest memory) and its
//! tenant's quota, decided over a summary of the live sandboxes (pure, table-tested); and the
//! start slots that let at most `max_concurrent_starts` restores run at once, with a bounded
//! queue behind them (a restore storm otherwise slows every starting guest at once).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, Quota};
use crate::error::{ApiError, ApiResult};

/// A live sandbox as admission counts it.
#[derive(Clone, Debug)]
pub struct Held<'a> {
    pub tenant: &'a str,
    pub memory_mib: u64,
}

/// Whether a sandbox of `memory_mib` for `tenant` may start next to `live`.
pub fn admit(
    cfg: &Config,
    quota: &Quota,
    tenant: &str,
    memory_mib: u64,
    live: &[Held<'_>],
) -> ApiResult<()> {
    let count = live.len() as u64;
    if count >= cfg.max_sandboxes as u64 {
        return Err(ApiError::Capacity {
            what: "sandboxes",
            limit: cfg.max_sandboxes as u64,
            current: count,
        });
    }
    let committed: u64 = live.iter().map(|s| s.memory_mib).sum();
    let cap = cfg.committed_capacity_mib();
    if committed + memory_mib > cap {
        return Err(ApiError::Capacity {
            what: "memory_mib",
            limit: cap,
            current: committed,
        });
    }
    let mine: Vec<_> = live.iter().filter(|s| s.tenant == tenant).collect();
    if quota.max_sandboxes > 0 && mine.len() >= quota.max_sandboxes {
        return Err(ApiError::Quota {
            tenant: tenant.to_owned(),
            what: "sandboxes",
            limit: quota.max_sandboxes as u64,
            current: mine.len() as u64,
        });
    }
    let my_mem: u64 = mine.iter().map(|s| s.memory_mib).sum();
    if quota.max_memory_mib > 0 && my_mem + memory_mib > quota.max_memory_mib {
        return Err(ApiError::Quota {
            tenant: tenant.to_owned(),
            what: "memory_mib",
            limit: quota.max_memory_mib,
            current: my_mem,
        });
    }
    Ok(())
}

/// Whether the filesystem of `dir` (the daemon's data directory) has `min_free_mib` left: a
/// create or a build needs records, output and snapshots written, and is refused before it
/// starts rather than half-written.
pub fn check_space(dir: &std::path::Path, min_free_mib: u64) -> ApiResult<()> {
    let free = free_bytes(dir)?;
    if free < min_free_mib << 20 {
        return Err(ApiError::DataDirFull(format!(
            "{} MiB left, {min_free_mib} MiB needed (min_free_data_mib)",
            free >> 20
        )));
    }
    Ok(())
}

/// Bytes available to the daemon on `dir`'s filesystem (`statvfs(3)`).
fn free_bytes(dir: &std::path::Path) -> ApiResult<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| ApiError::Internal("a NUL in the data directory's path".into()))?;
    // SAFETY: statvfs is plain data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs(3) reads the NUL-terminated path and writes into the live `st`.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Restores running at once, and creates waiting for one.
#[derive(Debug)]
pub struct StartSlots {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_queue: usize,
}

impl StartSlots {
    pub fn new(slots: usize, max_queue: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(slots)),
            waiting: AtomicUsize::new(0),
            max_queue,
        }
    }

    /// A slot, once one is free; CAPACITY_EXHAUSTED (`start_queue`) when the queue is full.
    pub async fn acquire(&self) -> ApiResult<OwnedSemaphorePermit> {
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        let permit = if waiting >= self.max_queue {
            None
        } else {
            self.slots.clone().acquire_owned().await.ok()
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        permit.ok_or(ApiError::Capacity {
            what: "start_queue",
            limit: self.max_queue as u64,
            current: waiting as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn capacity_and_quota_are_decided_in_order_with_their_numbers() {
        let cfg = Config {
            max_sandboxes: 3,
            max_committed_mib: 1000,
            ..Config::default()
        };
        let q = |n, m| Quota {
            max_sandboxes: n,
            max_memory_mib: m,
            ..Quota::default()
        };
        let held = |t, m| Held {
            tenant: t,
            memory_mib: m,
        };
        let two = [held("a", 256), held("b", 256)];
        // (quota, live, memory) -> Ok or (reason, resource, limit, current)
        type Want<'a> = Option<(&'a str, &'a str, &'a str, &'a str)>;
        let table: Vec<(Quota, Vec<Held>, u64, Want)> = vec![
            (q(0, 0), two.to_vec(), 256, None),
            (
                q(0, 0),
                vec![held("a", 1), held("a", 1), held("b", 1)],
                1,
                Some(("CAPACITY_EXHAUSTED", "sandboxes", "3", "3")),
            ),
            (
                q(0, 0),
                two.to_vec(),
                600,
                Some(("CAPACITY_EXHAUSTED", "memory_mib", "1000", "512")),
            ),
            (
                q(1, 0),
                two.to_vec(),
                1,
                Some(("QUOTA_EXCEEDED", "sandboxes", "1", "1")),
            ),
            (
                q(0, 300),
                two.to_vec(),
                100,
                Some(("QUOTA_EXCEEDED", "memory_mib", "300", "256")),
            ),
            (q(2, 600), two.to_vec(), 256, None),
        ];
        for (i, (quota, live, mem, want)) in table.into_iter().enumerate() {
            let got = admit(&cfg, &quota, "a", mem, &live);
            match (got, want) {
                (Ok(()), None) => {}
                (Err(e), Some((reason, what, limit, current))) => {
                    let status: tonic::Status = e.into();
                    let info = tonic_types::StatusExt::get_details_error_info(&status).unwrap();
                    assert_eq!(info.reason, reason, "case {i}");
                    assert_eq!(info.metadata["resource"], what, "case {i}");
                    assert_eq!(info.metadata["limit"], limit, "case {i}");
                    assert_eq!(info.metadata["current"], current, "case {i}");
                }
                (got, want) => panic!("case {i}: {got:?} != {want:?}"),
            }
        }
    }

    #[test]
    fn a_data_directory_without_room_refuses_new_work() {
        let tmp = std::env::temp_dir();
        check_space(&tmp, 0).unwrap();
        let err = check_space(&tmp, u64::MAX >> 21).unwrap_err();
        assert_eq!(err.reason(), "CAPACITY_EXHAUSTED");
        assert!(check_space(std::path::Path::new("/nonexistent/x"), 0).is_err());
    }

    #[tokio::test]
    async fn starts_queue_behind_the_slots_and_a_full_queue_is_refused() {
        let slots = Arc::new(StartSlots::new(1, 1));
        let first = slots.acquire().await.unwrap();
        let s = slots.clone();
        let queued = tokio::spawn(async move { s.acquire().await.map(drop) });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let refused = slots.acquire().await.unwrap_err();
        assert_eq!(refused.reason(), "CAPACITY_EXHAUSTED");
        drop(first);
        queued.await.unwrap().unwrap();
    }
}
