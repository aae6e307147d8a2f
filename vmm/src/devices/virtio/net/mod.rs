//! virtio-net: the guest's network card, on a TAP descriptor the VMM inherits.
//!
//! Both queues and the tap are served on the VMM's event-loop thread: the transmit queue when
//! the guest notifies it (an ioeventfd), the receive side when the tap has frames or the guest
//! adds receive buffers. The device holds no state beyond its queues and MAC address, so a
//! snapshot restores it with the transport's queue state and a new tap (frames in flight at
//! the snapshot are lost, as on a wire).

mod device;
mod event_handler;
mod metrics;

pub use device::{MAX_FRAME, NET_HDR_LEN, Net, NetError, TYPE_NET, format_mac, parse_mac};
pub use event_handler::NetEventHandler;
pub use metrics::NetMetrics;

#[cfg(test)]
mod tests;
