//! The uids handed to VMMs: one per live VMM, from `[jail] uid_base`/`uid_count`, given back
//! only once its process has been reaped, never one that a process the daemon did not start
//! uses.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The uids handed to VMMs.
#[derive(Debug)]
pub(super) struct UidPool {
    pub(super) base: u32,
    pub(super) count: u32,
    pub(super) next: u32,
    pub(super) used: HashSet<u32>,
    /// Uids in the range found in use by processes the daemon did not start.
    pub(super) foreign: HashSet<u32>,
}

impl UidPool {
    /// The next free uid after the last one handed out (so a uid is reused as late as possible).
    pub(super) fn allocate(&mut self) -> Option<u32> {
        for i in 0..self.count {
            let slot = (self.next + i) % self.count;
            let uid = self.base + slot;
            if !self.used.contains(&uid) && !self.foreign.contains(&uid) {
                self.used.insert(uid);
                self.next = (slot + 1) % self.count;
                return Some(uid);
            }
        }
        None
    }

    pub(super) fn contains(&self, uid: u32) -> bool {
        (self.base..self.base.saturating_add(self.count)).contains(&uid)
    }
}

/// A uid taken from the pool; dropping it gives it back.
#[derive(Debug)]
pub struct UidLease {
    pub(super) pool: Arc<Mutex<UidPool>>,
    pub uid: u32,
}

impl Drop for UidLease {
    fn drop(&mut self) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .used
            .remove(&self.uid);
    }
}

/// The real uids of all live processes on the host.
pub(super) fn process_uids() -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        // A zombie (a killed VMM not reaped yet) holds nothing.
        .filter(|s| {
            !s.lines()
                .any(|l| l.starts_with("State:") && l.contains("zombie"))
        })
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn pool(base: u32, count: u32) -> Arc<Mutex<UidPool>> {
        Arc::new(Mutex::new(UidPool {
            base,
            count,
            next: 0,
            used: HashSet::new(),
            foreign: HashSet::new(),
        }))
    }

    #[test]
    fn uids_are_handed_out_round_robin_and_come_back_when_the_lease_ends() {
        let p = pool(1000, 3);
        let take = |p: &Arc<Mutex<UidPool>>| p.lock().unwrap().allocate();
        assert_eq!(take(&p), Some(1000));
        assert_eq!(take(&p), Some(1001));
        let lease = UidLease {
            pool: p.clone(),
            uid: 1001,
        };
        drop(lease);
        // 1001 is free again but the cursor moves on first.
        assert_eq!(take(&p), Some(1002));
        assert_eq!(take(&p), Some(1001));
        assert_eq!(take(&p), None, "all three in use");
        p.lock().unwrap().foreign.insert(1000);
        p.lock().unwrap().used.remove(&1000);
        assert_eq!(take(&p), None, "a foreign uid is never handed out");
    }
}
