//! Counters of one block device.

use std::sync::atomic::AtomicU64;

/// Per-device counters; the daemon exports them.
#[derive(Debug, Default)]
pub struct BlockMetrics {
    /// Requests completed, any status.
    pub requests: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub flushes: AtomicU64,
    /// Requests the guest formed wrongly (bad descriptors, missing header or status).
    pub malformed: AtomicU64,
    /// Requests answered with `VIRTIO_BLK_S_IOERR` (host I/O error, out of range, read-only).
    pub io_errors: AtomicU64,
    /// Writes refused because a copy-on-write disk's overlay holds its quota (also counted in
    /// `io_errors`).
    pub over_quota: AtomicU64,
    /// Requests of a type we do not implement (`VIRTIO_BLK_S_UNSUPP`).
    pub unsupported: AtomicU64,
    /// Times the available ring itself was invalid; the queue stops until the driver resets.
    pub broken_queue: AtomicU64,
}
