//! Durations as the protocol carries them: whole milliseconds.

use std::time::Duration;

/// `d` in whole milliseconds, saturating at `u64::MAX`.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_truncates_and_saturates() {
        assert_eq!(millis(Duration::from_micros(1999)), 1);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }
}
