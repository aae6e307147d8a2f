//! Virtio devices and the virtio-mmio transport (virtio 1.2, "modern" devices only).

pub mod block;
pub mod mmio;
pub mod net;
pub mod vsock;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use thiserror::Error;
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// `VIRTIO_F_VERSION_1`: every device we offer is a modern device.
pub const VIRTIO_F_VERSION_1: u32 = 32;
/// Device types.
pub const TYPE_BLOCK: u32 = 2;

/// Interrupt status bits (virtio-mmio `InterruptStatus`).
pub const INT_VRING: u32 = 0x1;
pub const INT_CONFIG: u32 = 0x2;

/// Errors activating a device.
#[derive(Debug, Error)]
pub enum ActivateError {
    #[error("the driver set up {got} queues, the device needs {want}")]
    QueueCount { got: usize, want: usize },
    #[error("queue {0} is not valid in guest memory")]
    InvalidQueue(usize),
    #[error("the device is already active")]
    AlreadyActive,
}

/// The interrupt line of one virtio-mmio device: a status word the driver reads and acks, and
/// an irqfd that KVM turns into an IOAPIC edge.
#[derive(Debug)]
pub struct VirtioInterrupt {
    status: AtomicU32,
    irqfd: EventFd,
}

impl VirtioInterrupt {
    /// Wraps `irqfd` (registered with KVM for the device's GSI).
    pub fn new(irqfd: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            irqfd,
        }
    }

    /// Tells the driver that used buffers are available.
    pub fn signal_used_queue(&self) {
        self.signal(INT_VRING);
    }

    /// Tells the driver that the configuration space changed.
    pub fn signal_config_change(&self) {
        self.signal(INT_CONFIG);
    }

    fn signal(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            crate::warn_ratelimited!("virtio interrupt: {e}");
        }
    }

    /// Current `InterruptStatus`.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears acknowledged bits (`InterruptACK`).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets the status word from a snapshot and, if any bit is set, raises the line again: the
    /// driver may not have seen the interrupt before the snapshot, and a spurious one is
    /// harmless (it reads the status and acks nothing).
    pub fn restore_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
        if bits != 0
            && let Err(e) = self.irqfd.write(1)
        {
            crate::warn_ratelimited!("virtio interrupt: {e}");
        }
    }

    /// The irqfd, for registration with KVM.
    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }
}

/// A virtio device, independent of its transport.
pub trait VirtioDevice: Send {
    /// Virtio device type (e.g. [`TYPE_BLOCK`]).
    fn device_type(&self) -> u32;
    /// Largest size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers.
    fn avail_features(&self) -> u64;
    /// Records the features the driver accepted (a subset of [`Self::avail_features`]).
    fn set_acked_features(&mut self, features: u64);
    /// Reads device configuration space at `offset`; out-of-range bytes read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device configuration space; most devices ignore it.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Starts the device with the driver's queues.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), ActivateError>;
    /// Returns the device to its pre-activation state (driver wrote status 0).
    fn reset(&mut self);
    /// Whether [`Self::activate`] succeeded and no reset followed.
    fn is_activated(&self) -> bool;
    /// One eventfd per queue, written by KVM when the driver notifies that queue.
    fn queue_events(&self) -> &[EventFd];
    /// The state of the queues the device works on while active (empty when not active), for
    /// snapshots.
    fn active_queue_states(&self) -> Vec<virtio_queue::QueueState>;
}

/// Reads `data.len()` bytes at `offset` of `config` (zero beyond its end).
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if let Some(src) = config.get(start..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_reads_are_bounded_and_zero_filled() {
        let cfg = [1u8, 2, 3, 4];
        let mut buf = [0xffu8; 4];
        read_config_bytes(&cfg, 2, &mut buf);
        assert_eq!(buf, [3, 4, 0, 0]);
        read_config_bytes(&cfg, 100, &mut buf);
        assert_eq!(buf, [0; 4]);
        read_config_bytes(&cfg, u64::MAX, &mut buf);
        assert_eq!(buf, [0; 4]);
    }

    #[test]
    fn interrupt_status_is_set_by_signal_and_cleared_by_ack() {
        let i = VirtioInterrupt::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        i.signal_used_queue();
        i.signal_config_change();
        assert_eq!(i.status(), INT_VRING | INT_CONFIG);
        i.ack(INT_VRING);
        assert_eq!(i.status(), INT_CONFIG);
        assert_eq!(i.irqfd().read().unwrap(), 2);
    }
}
