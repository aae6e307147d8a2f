//! Counters of one vsock device.

use std::sync::atomic::AtomicU64;

/// Per-device counters; the daemon exports them.
#[derive(Debug, Default)]
pub struct VsockMetrics {
    pub connections_opened: AtomicU64,
    pub connections_closed: AtomicU64,
    /// Host connections closed before reaching the guest (bad `CONNECT` line, limits).
    pub host_connections_refused: AtomicU64,
    /// Guest connections to host ports nobody listens on (or over the limit).
    pub guest_connections_refused: AtomicU64,
    /// Packets from the guest that were malformed or wrongly addressed, and dropped.
    pub bad_packets: AtomicU64,
    /// Connections reset because the guest broke the protocol (credit overrun, bad state).
    pub protocol_violations: AtomicU64,
    /// Control packets dropped because the queue for the guest was full.
    pub control_dropped: AtomicU64,
    pub tx_packets: AtomicU64,
    pub rx_packets: AtomicU64,
}
