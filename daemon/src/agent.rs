//! Request/response connections to a sandbox's guest agent (file transfer, identity at
//! create): the shared hybrid-vsock client of `airlock_proto::vsock`, every call ending at a
//! wall-clock deadline. Executions have their own connections (`exec::runner`).

use std::path::Path;
use std::time::{Duration, Instant};

use airlock_proto::vsock::{self, TimedClient};
use airlock_proto::{AGENT_VSOCK_PORT, ClientError};

/// How long one call (a file chunk, a listing) may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts at a connection the guest closes before its `Ready` (nothing was asked yet, so
/// trying again loses nothing; the guest may be short of a thread for a moment).
const CLOSED_BEFORE_READY_ATTEMPTS: u32 = 3;

/// A client whose calls each get [`CALL_TIMEOUT`] (use [`TimedClient::within`] for each).
pub fn client(vsock: &Path) -> Result<TimedClient, ClientError> {
    let mut attempt = 1;
    loop {
        let deadline = Instant::now() + CALL_TIMEOUT;
        match vsock::connect(vsock, AGENT_VSOCK_PORT, deadline, |_| {}) {
            Ok(c) => return Ok(c),
            Err(ClientError::Closed) if attempt < CLOSED_BEFORE_READY_ATTEMPTS => {
                tracing::warn!(
                    vsock = %vsock.display(),
                    attempt,
                    "the guest agent closed a new connection before Ready; connecting again"
                );
                attempt += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}
