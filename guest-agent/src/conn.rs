//! The sending side of a connection, shared by every thread that answers on it.
//!
//! The connection's thread answers quick requests itself and executions answer from their own
//! threads; all of them write through one [`ConnWriter`]: one lock around one write per batch of
//! frames, so frames never interleave. A write that fails marks the connection broken (later
//! sends are dropped) and shuts it down for every thread using it.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use airlock_proto::append_frame;
use airlock_proto::pb::Response;

use crate::sys;

/// The sending side of one connection, shared by every thread that answers on it.
#[derive(Debug)]
pub struct ConnWriter {
    stream: Mutex<File>,
    /// Another descriptor of the socket, to shut it down while a writer blocks in `stream`.
    control: File,
    /// The connection ended: executions must not register on it any more.
    closed: AtomicBool,
    /// A write failed: later sends are dropped.
    broken: AtomicBool,
}

impl ConnWriter {
    /// `stream` for writing, `control` another descriptor of the same socket.
    pub fn new(stream: File, control: File) -> Self {
        Self {
            stream: Mutex::new(stream),
            control,
            closed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        }
    }

    /// Sends one response (dropped if the connection is broken).
    pub fn send(&self, resp: &Response) {
        self.send_all(std::slice::from_ref(resp));
    }

    /// Sends responses with one write, in order. Blocks while the host does not read. Returns
    /// false if they were not (or not all) written because the connection is broken.
    pub fn send_all(&self, resps: &[Response]) -> bool {
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        if resps.is_empty() {
            return true;
        }
        let mut buf = Vec::new();
        for resp in resps {
            if let Err(e) = append_frame(&mut buf, resp) {
                // Responses are built within the frame limit; this is a bug, not input.
                eprintln!("airlock-agent: dropping a response to {}: {e}", resp.id);
            }
        }
        let mut stream = self.stream.lock().unwrap_or_else(PoisonError::into_inner);
        if stream.write_all(&buf).is_err() {
            self.broken.store(true, Ordering::SeqCst);
            sys::shutdown(self.control.as_fd());
            return false;
        }
        true
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    pub fn mark_closed(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// Whether the connection can still reach its host: not closed, no write failed, and the
    /// peer neither reset nor hung up.
    pub fn is_alive(&self) -> bool {
        !self.is_closed()
            && !self.broken.load(Ordering::SeqCst)
            && !sys::peer_gone(self.control.as_fd())
    }

    /// Waits up to `grace` for the host to close the connection or send more, so that the
    /// last answer is on its way before the VM resets (the guest's vsock transmits from a
    /// queue that a reset would drop).
    pub fn linger(&self, grace: Duration) {
        let mut fds = [libc::pollfd {
            fd: self.control.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        let _ = sys::poll(&mut fds, Some(grace));
    }

    /// Ends the connection for every thread using it: blocked reads and writes return.
    pub fn shutdown(&self) {
        self.broken.store(true, Ordering::SeqCst);
        sys::shutdown(self.control.as_fd());
    }
}
