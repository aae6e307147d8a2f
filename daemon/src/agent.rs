//! A sandbox's one connection to its guest agent ([`AgentLink`]), shared by its executions,
//! file transfers and control calls: each takes a [`MuxClient`] on it, so that none pays a
//! vsock handshake and a `Ready` of its own. The connection is the one the create's identity
//! exchange opened, or one made when first needed (after a daemon restart) and made again
//! when it broke; it closes with the sandbox. Every call ends at a wall-clock deadline.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use airlock_proto::vsock::{self, TimedClient};
use airlock_proto::{AGENT_VSOCK_PORT, ClientError, Mux, MuxClient};

/// How long one call (a file chunk, a listing) may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts at a connection the guest closes before its `Ready` (nothing was asked yet, so
/// trying again loses nothing; the guest may be short of a thread for a moment).
const CLOSED_BEFORE_READY_ATTEMPTS: u32 = 3;

/// Connections this daemon has opened to guest agents, all sandboxes together (one per
/// sandbox unless one broke; `airlock_agent_connections_total`).
pub static CONNECTIONS: AtomicU64 = AtomicU64::new(0);

/// The shared connection to one VMM's agent.
#[derive(Debug)]
pub struct AgentLink {
    vsock: PathBuf,
    mux: Mutex<Option<Mux>>,
}

impl AgentLink {
    /// The link to the agent behind the hybrid-vsock socket `vsock` (not connected yet).
    pub fn new(vsock: PathBuf) -> Self {
        Self {
            vsock,
            mux: Mutex::new(None),
        }
    }

    fn slot(&self) -> MutexGuard<'_, Option<Mux>> {
        self.mux.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shares `client`'s connection from now on (the create's, with nothing in flight).
    pub fn adopt(&self, client: TimedClient) -> Result<Mux, ClientError> {
        let mux = Mux::from_client(client)?;
        CONNECTIONS.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.slot().replace(mux.clone()) {
            old.close("replaced by a new connection");
        }
        Ok(mux)
    }

    /// The connection, made first if there is none or it broke (connecting, the handshake and
    /// `Ready` before `deadline`). Callers wait for each other here, so a sandbox never has
    /// two connections.
    pub fn get(&self, deadline: Instant) -> Result<Mux, ClientError> {
        let mut slot = self.slot();
        if let Some(mux) = slot.as_ref().filter(|m| !m.is_closed()) {
            return Ok(mux.clone());
        }
        *slot = None;
        let mux = Mux::from_client(connect(&self.vsock, deadline)?)?;
        CONNECTIONS.fetch_add(1, Ordering::Relaxed);
        tracing::info!(vsock = %self.vsock.display(), "connected to the guest agent");
        *slot = Some(mux.clone());
        Ok(mux)
    }

    /// A caller's share of the connection, its calls each bounded by [`CALL_TIMEOUT`] unless
    /// it sets its own deadline.
    pub fn client(&self) -> Result<MuxClient, ClientError> {
        let deadline = Instant::now() + CALL_TIMEOUT;
        Ok(self.get(deadline)?.client(Some(deadline)))
    }

    /// Closes the connection (the sandbox ends): every call on it fails.
    pub fn close(&self, why: &str) {
        if let Some(mux) = self.slot().take() {
            mux.close(why);
        }
    }
}

/// A new connection to the agent behind `vsock`, `Ready` read, before `deadline`.
fn connect(vsock: &Path, deadline: Instant) -> Result<TimedClient, ClientError> {
    let mut attempt = 1;
    loop {
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
