//! The contract between `airlockd` and `airlock-vmm`, shared by both so that neither side
//! spells it out as text:
//!
//! - [`Request`]: what a VMM's control socket takes (one line per connection, human-typable:
//!   `airlock-vmm control PATH pause` works as well as the daemon's typed calls);
//! - the replies ([`StateReply`], [`StatusReply`], [`SnapshotReply`], [`RestoreReply`],
//!   [`StopReply`]): one JSON object per answer, `{"ok":true,...}` or
//!   `{"ok":false,"error":"..."}`, read with [`parse_reply`] into the type the request expects;
//! - [`exit`]: the VMM's process exit codes and what each one means;
//! - [`snapshot_dir`]: the directory a snapshot is written into, which its caller prepares.
//!
//! The I/O stays with each side (the VMM serves the socket on a thread under its seccomp filter,
//! the daemon talks to it from its async runtime); [`call`] is a small blocking client for tools
//! and tests.
#![forbid(unsafe_code)]

pub mod exit;
mod reply;
pub mod request;
pub mod snapshot_dir;

pub use reply::{
    ControlError, Reply, RestoreReply, SettleReply, SnapshotReply, StateReply, StatusReply,
    StopReply, VmState, parse_reply, reply_line,
};
pub use request::{MAX_LINE, Request, RestoreRequest, SlotMode};

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Longest reply a client reads.
pub const MAX_REPLY: u64 = 1 << 20;

/// Sends `request` to the control socket at `path` and reads the reply as `T` (blocking; for
/// tools and tests). `timeout` bounds each read and write.
pub fn call<T: serde::de::DeserializeOwned>(
    path: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<T, ControlError> {
    let line = send_line(path, &request.to_line(), timeout)?;
    parse_reply(&line)
}

/// Sends one raw command line and returns the reply line (for `airlock-vmm control`, which
/// passes whatever the user typed, and for tests of malformed input).
pub fn send_line(path: &Path, line: &str, timeout: Duration) -> Result<String, ControlError> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let sent = s
        .write_all(line.as_bytes())
        .and_then(|()| s.write_all(b"\n"));
    // A VMM that refuses an overlong line answers and closes before it was all written: the
    // answer is still there to read.
    match sent {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    let mut answer = String::new();
    BufReader::new(s.take(MAX_REPLY)).read_line(&mut answer)?;
    if answer.is_empty() {
        return Err(ControlError::Closed);
    }
    Ok(answer)
}
