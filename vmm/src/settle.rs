//! Waiting for a guest to go quiet before it is snapshotted.
//!
//! A guest snapshotted while it still has work pending (kernel work deferred after boot, the
//! aftermath of a warm-up, closing connections) makes every clone redo that work before it
//! answers. So a snapshot waits, within a bound, until the VMM's threads have been nearly idle
//! for a stretch: an idle guest halts its vCPUs, and a halted vCPU thread uses no CPU. The
//! measure is the process's own CPU clock, readable inside the jail (no `/proc` needed).

use std::time::{Duration, Instant};

use airlock_control::SettleReply;

/// One measuring window.
const WINDOW: Duration = Duration::from_millis(50);
/// Quiet windows in a row that make the guest settled.
const QUIET_WINDOWS: u32 = 4;
/// CPU time per window, across all threads, below which a window counts as quiet (4% of one
/// CPU: an idle guest's timer ticks and the host's halt polling stay under it).
const QUIET_CPU: Duration = Duration::from_millis(2);
/// The most a caller may ask to wait.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

/// CPU time used by every thread of this process so far.
fn process_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec into `ts`, a valid, exclusive local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// Waits until the guest is quiet ([`QUIET_WINDOWS`] windows in a row each under
/// [`QUIET_CPU`]) or `max` (at most [`MAX_WAIT`]) has passed. The caller's own thread sleeps
/// meanwhile and adds nothing.
pub fn wait_quiet(max: Duration) -> SettleReply {
    wait_quiet_with(max.min(MAX_WAIT), process_cpu)
}

fn wait_quiet_with(max: Duration, mut cpu: impl FnMut() -> Duration) -> SettleReply {
    let began = Instant::now();
    let first = cpu();
    let mut last = first;
    let mut quiet = 0;
    let settled = loop {
        if began.elapsed() >= max {
            break false;
        }
        std::thread::sleep(WINDOW);
        let now = cpu();
        quiet = if now.saturating_sub(last) < QUIET_CPU {
            quiet + 1
        } else {
            0
        };
        last = now;
        if quiet >= QUIET_WINDOWS {
            break true;
        }
    };
    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    SettleReply {
        settled,
        waited_ms: ms(began.elapsed()),
        busy_ms: ms(last.saturating_sub(first)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_process_settles_after_its_windows() {
        let r = wait_quiet_with(Duration::from_secs(5), || Duration::ZERO);
        assert!(r.settled);
        let least = (WINDOW * QUIET_WINDOWS).as_secs_f64() * 1e3;
        assert!(r.waited_ms >= least && r.waited_ms < 5000.0, "{r:?}");
        assert_eq!(r.busy_ms, 0.0);
    }

    #[test]
    fn a_busy_process_is_given_up_on_at_the_bound() {
        let mut t = Duration::ZERO;
        let r = wait_quiet_with(Duration::from_millis(300), || {
            t += Duration::from_millis(30);
            t
        });
        assert!(!r.settled);
        assert!(r.waited_ms >= 300.0, "{r:?}");
        assert!(r.busy_ms > 0.0);
    }

    #[test]
    fn busy_windows_restart_the_count() {
        // Busy, quiet x3, busy, quiet x4: settled only after the second quiet run.
        let pattern = [30, 0, 0, 0, 30, 0, 0, 0, 0];
        let mut i = 0;
        let mut t = Duration::ZERO;
        let r = wait_quiet_with(Duration::from_secs(5), || {
            if i > 0 {
                t += Duration::from_millis(pattern.get(i - 1).copied().unwrap_or(0));
            }
            i += 1;
            t
        });
        assert!(r.settled);
        assert_eq!(i, pattern.len() + 1, "{r:?}");
        assert_eq!(r.busy_ms, 60.0);
    }

    #[test]
    fn the_process_clock_moves_with_work() {
        let before = process_cpu();
        let mut x = 0u64;
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        assert!(x != 1);
        assert!(process_cpu() > before);
    }
}
