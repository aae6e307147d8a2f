//! virtio-block: a raw disk image as `/dev/vdX`, read-only or writable, or a copy-on-write
//! disk: a read-only base image under a layer and this VMM's own overlay (`layered`), or an
//! empty slot whose media (a volume) are put in when a VM is restored.
//!
//! Requests are served synchronously on the VMM's event-loop thread when the guest notifies the
//! queue (an ioeventfd, so the notifying vCPU does not wait for the I/O).

mod device;
mod event_handler;
pub mod layered;
mod metrics;
mod request;

pub use device::{Block, BlockError};
pub use event_handler::BlockEventHandler;
pub use metrics::BlockMetrics;
pub use request::{RequestHeader, RequestType, SECTOR_SIZE};
