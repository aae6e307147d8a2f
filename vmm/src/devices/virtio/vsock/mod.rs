//! virtio-vsock with a Unix-socket host side ("hybrid vsock", as Firecracker documents it).
//!
//! A host process reaches guest port P by connecting to the VM's socket and writing
//! `CONNECT P\n` (answered `OK <host port>\n`); a guest connection to host port P arrives at the
//! socket `<path>_P`. See [`muxer`] for the rules and limits.

mod connection;
mod device;
mod event_handler;
mod metrics;
pub mod muxer;
pub mod packet;

pub use device::{TYPE_VSOCK, Vsock, VsockError};
pub use event_handler::VsockEventHandler;
pub use metrics::VsockMetrics;
