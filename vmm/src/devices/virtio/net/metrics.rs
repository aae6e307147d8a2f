//! Counters of one network device.

use std::sync::atomic::AtomicU64;

/// Per-device counters.
#[derive(Debug, Default)]
pub struct NetMetrics {
    /// Frames and bytes (without the virtio header) delivered to the guest.
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Frames from the tap that did not fit the guest's buffer.
    pub rx_dropped: AtomicU64,
    /// Frames and bytes the guest sent out through the tap.
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Frames the tap refused (full or failing).
    pub tx_dropped: AtomicU64,
    /// Transmit chains the guest formed wrongly (too short, too long, unreadable).
    pub tx_malformed: AtomicU64,
    /// Read errors on the tap other than "nothing to read".
    pub tap_errors: AtomicU64,
    /// Times a ring itself was invalid; the device stops until the driver resets.
    pub broken_queue: AtomicU64,
}
