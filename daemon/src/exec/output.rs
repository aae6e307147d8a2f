//! GetExecution's stored output, read whole into memory: every call's bytes together stay
//! within one daemon-wide budget (`max_output_read_bytes`), taken before a byte is read and
//! held until the response is handed over; a call that would go over is refused at once
//! (CAPACITY_EXHAUSTED, resource `get_execution_output_bytes`) rather than queued.

use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Executions;
use crate::error::{ApiError, ApiResult};

/// The budget counts in KiB (a semaphore takes at most `u32::MAX` permits at a time).
const UNIT: u64 = 1024;

/// The bytes of output all calls may hold at once.
#[derive(Debug)]
pub struct OutputBudget {
    places: Arc<Semaphore>,
    max_bytes: u64,
}

/// A call's share of the budget, given back when the last clone is dropped.
#[derive(Clone, Debug)]
pub struct OutputHold {
    _share: Option<Arc<OwnedSemaphorePermit>>,
}

impl OutputBudget {
    pub fn new(max_bytes: u64) -> Self {
        let units = usize::try_from(max_bytes / UNIT)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Self {
            places: Arc::new(Semaphore::new(units)),
            max_bytes,
        }
    }
}

impl OutputBudget {
    /// A share of `bytes`, or CAPACITY_EXHAUSTED at once when the calls under way hold too
    /// much of the budget for it (or it is more than the whole budget).
    fn take(&self, bytes: u64) -> ApiResult<OutputHold> {
        let units = bytes.div_ceil(UNIT);
        if units == 0 {
            return Ok(OutputHold { _share: None });
        }
        let refused = || {
            let free = self.places.available_permits() as u64 * UNIT;
            ApiError::Capacity {
                what: "get_execution_output_bytes",
                limit: self.max_bytes,
                current: self.max_bytes.saturating_sub(free).saturating_add(bytes),
            }
        };
        let n = u32::try_from(units).map_err(|_| refused())?;
        let share = self
            .places
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| refused())?;
        Ok(OutputHold {
            _share: Some(Arc::new(share)),
        })
    }
}

impl Executions {
    /// Execution `id`'s stored output, at most `limit` bytes of each stream, within the
    /// daemon's budget: the share comes back with the bytes.
    pub async fn read_output(&self, id: &str, limit: u64) -> ApiResult<([Vec<u8>; 2], OutputHold)> {
        let paths = self.output_paths(id);
        let mut sizes = [0u64; 2];
        for (p, size) in paths.iter().zip(sizes.iter_mut()) {
            *size = match tokio::fs::metadata(p).await {
                Ok(m) => m.len().min(limit),
                // Deleted by retention (the record says so).
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                Err(e) => return Err(e.into()),
            };
        }
        let hold = self.output_budget.take(sizes[0] + sizes[1])?;
        let mut out = [Vec::new(), Vec::new()];
        for ((p, size), buf) in paths.iter().zip(sizes).zip(out.iter_mut()) {
            let f = match tokio::fs::File::open(p).await {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e.into()),
            };
            // What was counted, not what the file has grown to since.
            buf.reserve_exact(usize::try_from(size).unwrap_or(0));
            f.take(size).read_to_end(buf).await?;
        }
        Ok((out, hold))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::exec::ExecLimits;

    fn executions(tag: &str, budget: u64) -> (Executions, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "airlock-output-{tag}-{}-{}",
            std::process::id(),
            crate::ids::now_ms()
        ));
        std::fs::create_dir_all(dir.join("output")).unwrap();
        let store = Arc::new(crate::store::Store::open(&dir.join("db")).unwrap());
        let limits = ExecLimits {
            default_timeout_ms: 1000,
            max_timeout_ms: 1000,
            max_output_bytes: 1 << 30,
            max_output_read_bytes: budget,
        };
        let e = Executions::new(limits, dir.join("output"), store, Default::default());
        (e, dir)
    }

    #[tokio::test]
    async fn output_reads_together_stay_within_the_budget() {
        let (ex, dir) = executions("budget", 1 << 20);
        for id in ["ex-a", "ex-b"] {
            let [out, err] = ex.output_paths(id);
            std::fs::write(out, vec![b'o'; 400 << 10]).unwrap();
            std::fs::write(err, vec![b'e'; 200 << 10]).unwrap();
        }
        let ([o, e], held) = ex.read_output("ex-a", 1 << 30).await.unwrap();
        assert_eq!((o.len(), e.len()), (400 << 10, 200 << 10));
        // 600 KiB held of 1 MiB: another 600 KiB is refused, clearly and at once.
        let over = ex.read_output("ex-b", 1 << 30).await.err();
        assert!(
            matches!(
                over,
                Some(ApiError::Capacity {
                    what: "get_execution_output_bytes",
                    ..
                })
            ),
            "{over:?}"
        );
        // A smaller read fits beside it (the limit counts, not the file's size).
        let ([o, _], small) = ex.read_output("ex-b", 100 << 10).await.unwrap();
        assert_eq!(o.len(), 100 << 10);
        drop((held, small));
        // Given back: the whole read fits again.
        assert!(ex.read_output("ex-b", 1 << 30).await.is_ok());
        // More than the whole budget can never fit: refused too, not waited for.
        let (tiny, dir2) = executions("tiny", 64 << 10);
        let [out, _] = tiny.output_paths("ex-c");
        std::fs::write(out, vec![b'o'; 100 << 10]).unwrap();
        assert!(tiny.read_output("ex-c", 1 << 30).await.is_err());
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_dir_all(dir2);
    }
}
