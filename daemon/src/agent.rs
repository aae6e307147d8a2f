//! Connections to a sandbox's guest agent through its VMM's hybrid-vsock Unix socket.
//!
//! The guest is untrusted: every connection has I/O timeouts (except an execution's output
//! stream, which the daemon ends itself), and frames are bounded by the protocol's limit.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use airlock_proto::ClientError;
use airlock_proto::client::AgentClient;
use airlock_proto::pb::Ready;

pub type Client = AgentClient<UnixStream, UnixStream>;

/// Connects to the agent's vsock port: `CONNECT 52`, `OK ...`; `timeout` bounds each read
/// and write on the returned stream.
pub fn connect(vsock: &Path, timeout: Duration) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(vsock)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("CONNECT {}\n", airlock_proto::AGENT_VSOCK_PORT).as_bytes())?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        if s.read(&mut byte)? == 0 {
            return Err(std::io::Error::other("the VMM closed the vsock connection"));
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    if !line.starts_with(b"OK ") {
        return Err(std::io::Error::other(format!(
            "vsock handshake: {:?}",
            String::from_utf8_lossy(&line)
        )));
    }
    Ok(s)
}

/// Attempts at a connection the guest closes before its `Ready` (nothing was asked yet, so
/// trying again loses nothing; the guest may be short of a thread for a moment).
const CLOSED_BEFORE_READY_ATTEMPTS: u32 = 3;

/// A request/response client with `timeout` on every read and write: one attempt.
fn client_once(vsock: &Path, timeout: Duration) -> Result<Client, ClientError> {
    let s = connect(vsock, timeout).map_err(|e| ClientError::Handshake(e.to_string()))?;
    AgentClient::from_unix_stream(s)
}

/// A request/response client with `timeout` on every read and write.
pub fn client(vsock: &Path, timeout: Duration) -> Result<Client, String> {
    let mut attempt = 1;
    loop {
        match client_once(vsock, timeout) {
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
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Connects until the agent answers with `Ready`, `deadline` passes or `cancelled` is set.
pub fn wait_ready(
    vsock: &Path,
    deadline: Instant,
    cancelled: &std::sync::atomic::AtomicBool,
) -> Result<(Client, Ready), String> {
    let mut last = String::new();
    while Instant::now() < deadline {
        if cancelled.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the sandbox is ending".into());
        }
        // While the restored guest comes up, connections fail in every way: just try again.
        match client_once(vsock, Duration::from_secs(10)) {
            Ok(c) => {
                let ready = c.ready().clone();
                return Ok((c, ready));
            }
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err(format!("no Ready from the guest agent: {last}"))
}
