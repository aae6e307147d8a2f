//! Logging: a small stderr logger for the `log` facade, and rate limiting for every line a guest
//! can trigger.
//!
//! Level policy: `error` = a requested action failed; `warn` = abnormal but handled (most guest
//! misbehaviour); `info` = rare lifecycle events (boot, exit); `debug` = per-request detail.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Lines of one call site allowed per window; the rest are counted and reported later.
pub const RATE_LIMIT_BURST: u64 = 10;
/// Window length in seconds.
pub const RATE_LIMIT_WINDOW_SECS: u64 = 5;

/// Per-call-site state for [`crate::warn_ratelimited`].
#[derive(Debug, Default)]
pub struct RateLimiter {
    window_start: AtomicU64,
    in_window: AtomicU64,
    suppressed: AtomicU64,
}

impl RateLimiter {
    /// A limiter with an empty window.
    pub const fn new() -> Self {
        Self {
            window_start: AtomicU64::new(0),
            in_window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be logged at `now_secs`; `Some(n)` also reports `n` lines suppressed
    /// since the last one that was allowed.
    pub fn check(&self, now_secs: u64) -> Option<u64> {
        let start = self.window_start.load(Ordering::Relaxed);
        if now_secs >= start + RATE_LIMIT_WINDOW_SECS {
            self.window_start.store(now_secs, Ordering::Relaxed);
            self.in_window.store(0, Ordering::Relaxed);
        }
        if self.in_window.fetch_add(1, Ordering::Relaxed) < RATE_LIMIT_BURST {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Seconds since the epoch, for rate limiting.
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `log::warn!` limited to [`RATE_LIMIT_BURST`] lines per [`RATE_LIMIT_WINDOW_SECS`] per call
/// site. Use it for everything the guest can cause.
#[macro_export]
macro_rules! warn_ratelimited {
    ($($arg:tt)+) => {{
        static LIMITER: $crate::logger::RateLimiter = $crate::logger::RateLimiter::new();
        if let Some(suppressed) = LIMITER.check($crate::logger::now_secs()) {
            if suppressed > 0 {
                log::warn!("({suppressed} similar lines suppressed)");
            }
            log::warn!($($arg)+);
        }
    }};
}

struct StderrLogger {
    level: log::LevelFilter,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // One write per line so that lines of different threads do not interleave.
        let line = format!(
            "[{}.{:06} {:5} airlock-vmm] {}\n",
            now.as_secs(),
            now.subsec_micros(),
            record.level(),
            record.args()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

/// Installs the stderr logger; the level comes from `AIRLOCK_LOG` (error, warn, info, debug,
/// trace), default `info`.
pub fn init() {
    let level = std::env::var("AIRLOCK_LOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(log::LevelFilter::Info);
    if log::set_boxed_logger(Box::new(StderrLogger { level })).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_allows_a_burst_then_suppresses_and_reports_the_count() {
        let l = RateLimiter::new();
        for _ in 0..RATE_LIMIT_BURST {
            assert_eq!(l.check(100), Some(0));
        }
        assert_eq!(l.check(100), None);
        assert_eq!(l.check(101), None);
        assert_eq!(l.check(100 + RATE_LIMIT_WINDOW_SECS), Some(2));
    }
}
