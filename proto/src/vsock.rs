//! Reaching the agent inside a VM: the hybrid-vsock `CONNECT` handshake on the VMM's Unix
//! socket, a stream whose every read and write ends at a wall-clock deadline, and waiting for
//! a (restoring or booting) guest's agent to answer. Shared by `airlock-vmm run` and `airlockd`.
//!
//! The guest is untrusted: a per-read timeout alone lets a guest that sends one byte every few
//! seconds hold a connection for ever. A [`TimedStream`] carries a deadline for the whole call
//! it serves, shared by its read and write halves; each read or write waits at most until then
//! and fails with `TimedOut` after it.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[cfg(test)]
use crate::client::read_line;
use crate::client::{AgentClient, ClientError, handshake};

/// A connection to the agent whose calls end at a deadline.
pub type TimedClient = AgentClient<TimedStream, TimedStream>;

/// Pause between attempts while a guest comes up.
const RETRY: Duration = Duration::from_millis(2);

/// One half of a Unix stream with a shared deadline (see the module docs).
#[derive(Debug)]
pub struct TimedStream {
    stream: UnixStream,
    deadline: Arc<Mutex<Option<Instant>>>,
}

impl TimedStream {
    /// Wraps `stream` and a clone of it (read and write halves) sharing `deadline`.
    pub fn pair(stream: UnixStream, deadline: Option<Instant>) -> io::Result<(Self, Self)> {
        let shared = Arc::new(Mutex::new(deadline));
        let other = stream.try_clone()?;
        Ok((
            Self {
                stream,
                deadline: shared.clone(),
            },
            Self {
                stream: other,
                deadline: shared,
            },
        ))
    }

    /// Sets the deadline of both halves (`None`: reads and writes wait as long as it takes).
    pub fn set_deadline(&self, deadline: Option<Instant>) {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = deadline;
    }

    /// The deadline of both halves.
    pub fn deadline(&self) -> Option<Instant> {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The socket, e.g. to `shutdown` it from another thread (cloned: the caller owns it).
    pub fn try_clone_socket(&self) -> io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Time left until the deadline; `TimedOut` once it has passed.
    fn remaining(&self) -> io::Result<Option<Duration>> {
        match self.deadline() {
            None => Ok(None),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(Some(left)),
                _ => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the agent did not answer in time",
                )),
            },
        }
    }
}

impl Read for TimedStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_read_timeout(left)?;
        self.stream.read(buf).map_err(timed_out)
    }
}

impl Write for TimedStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.remaining()?;
        self.stream.set_write_timeout(left)?;
        self.stream.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// A socket timeout reads as `WouldBlock`; call it what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "the agent did not answer in time")
    } else {
        e
    }
}

impl TimedClient {
    /// Sets the deadline for the calls that follow (`None`: none).
    pub fn set_deadline(&self, deadline: Option<Instant>) {
        self.reader().set_deadline(deadline);
    }

    /// Runs `f` with a deadline `timeout` from now, then restores the previous one.
    pub fn within<T>(&mut self, timeout: Duration, f: impl FnOnce(&mut Self) -> T) -> T {
        let before = self.reader().deadline();
        self.set_deadline(Some(Instant::now() + timeout));
        let out = f(self);
        self.set_deadline(before);
        out
    }
}

/// Connects to guest port `port` through the VMM's hybrid-vsock socket at `uds`: `CONNECT
/// <port>\n`, `OK <host port>\n`, then the agent's `Ready`, all before `deadline`, which stays
/// the connection's deadline. `on_socket` gets a clone of the socket as soon as it is connected,
/// before anything is read from the guest, so that the caller can cut a connection that hangs
/// in the handshake.
pub fn connect(
    uds: &Path,
    port: u32,
    deadline: Instant,
    on_socket: impl FnOnce(&UnixStream),
) -> Result<TimedClient, ClientError> {
    let stream = UnixStream::connect(uds).map_err(|source| ClientError::Connect {
        path: uds.display().to_string(),
        source,
    })?;
    on_socket(&stream);
    let (mut reader, mut writer) =
        TimedStream::pair(stream, Some(deadline)).map_err(crate::FrameError::Io)?;
    handshake(&mut reader, &mut writer, port)?;
    AgentClient::from_stream(reader, writer)
}

/// Why waiting for an agent ended without one.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("no Ready from the guest agent before the deadline (last: {last})")]
    Deadline { last: String },
    #[error("stopped waiting for the guest agent: {0}")]
    Cancelled(String),
    #[error("the guest agent answered but cannot be used")]
    Agent(#[source] ClientError),
}

/// Connects until the agent answers with `Ready` or `deadline` passes. `gone` is asked between
/// attempts: `Some(why)` stops the wait (the VM ended, the sandbox is being destroyed). While a
/// guest comes up, connections fail in every way; each is simply tried again.
pub fn wait_ready(
    uds: &Path,
    port: u32,
    deadline: Instant,
    gone: impl Fn() -> Option<String>,
) -> Result<TimedClient, WaitError> {
    retry_until_ready(deadline, gone, || connect(uds, port, deadline, |_| {}))
}

/// [`wait_ready`] with a first request that goes out with the connection, before the agent's
/// Ready is read (see [`AgentClient::from_stream_pipelined`]): returns the client and the
/// request's id. Nothing is sent on an attempt that the VMM or the agent refused.
pub fn wait_ready_pipelined(
    uds: &Path,
    port: u32,
    deadline: Instant,
    gone: impl Fn() -> Option<String>,
    first: &crate::pb::request::Kind,
) -> Result<(TimedClient, u64), WaitError> {
    retry_until_ready(deadline, gone, || {
        let stream = UnixStream::connect(uds).map_err(|source| ClientError::Connect {
            path: uds.display().to_string(),
            source,
        })?;
        let (mut reader, mut writer) =
            TimedStream::pair(stream, Some(deadline)).map_err(crate::FrameError::Io)?;
        handshake(&mut reader, &mut writer, port)?;
        AgentClient::from_stream_pipelined(reader, writer, first.clone())
    })
}

/// Tries `attempt` every [`RETRY`] until it succeeds, `deadline` passes or `gone` says why
/// to stop.
fn retry_until_ready<T>(
    deadline: Instant,
    gone: impl Fn() -> Option<String>,
    mut attempt: impl FnMut() -> Result<T, ClientError>,
) -> Result<T, WaitError> {
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        if let Some(why) = gone() {
            return Err(WaitError::Cancelled(why));
        }
        match attempt() {
            Ok(c) => return Ok(c),
            // An agent that answered and speaks another protocol will not change its mind.
            Err(e @ ClientError::Version { .. }) => return Err(WaitError::Agent(e)),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(RETRY);
    }
    Err(WaitError::Deadline { last })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::net::UnixListener;

    use super::*;
    use crate::Requests;
    use crate::frame::write_frame;
    use crate::pb::{DirListing, FileStat, Ready, Response, response};

    /// A listening socket at a fresh path for test `tag`.
    fn listen(tag: &str) -> (std::path::PathBuf, UnixListener) {
        let path = std::env::temp_dir().join(format!(
            "airlock-vsock-test-{}-{tag}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        (path, listener)
    }

    /// The agent's first frame.
    fn ready_frame() -> Response {
        Response {
            id: 0,
            kind: Some(response::Kind::Ready(Ready {
                protocol_version: crate::PROTOCOL_VERSION,
                ..Default::default()
            })),
        }
    }

    /// A fake VMM socket with an agent behind it that answers `CONNECT`, sends Ready, then
    /// hands the connection to `then`.
    fn fake(tag: &str, then: impl FnOnce(UnixStream) + Send + 'static) -> std::path::PathBuf {
        let (path, listener) = listen(tag);
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_line(&mut s).unwrap();
            s.write_all(b"OK 1\n").unwrap();
            write_frame(&mut s, &ready_frame()).unwrap();
            then(s);
        });
        path
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[test]
    fn a_pipelined_first_request_arrives_before_ready_is_read() {
        // This agent reads the first request before it sends Ready: a client that waited for
        // Ready first would wait until its deadline.
        let (path, listener) = listen("pipelined");
        let agent = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            read_line(&mut s).unwrap();
            s.write_all(b"OK 1\n").unwrap();
            let first: crate::pb::Request = crate::frame::read_frame(&mut s).unwrap().unwrap();
            write_frame(&mut s, &ready_frame()).unwrap();
            let done = Response {
                id: first.id,
                kind: Some(response::Kind::Reseeded(crate::pb::Reseeded::default())),
            };
            write_frame(&mut s, &done).unwrap();
            first
        });
        let identity = crate::client::clone_identity("sb-1", 0).unwrap();
        let first = crate::pb::request::Kind::Reseed(identity.clone());
        let deadline = Instant::now() + Duration::from_secs(5);
        let (mut c, id) = wait_ready_pipelined(&path, 52, deadline, || None, &first).unwrap();
        c.within(Duration::from_secs(5), |c| c.reseeded(id))
            .unwrap();
        let sent = agent.join().unwrap();
        assert_eq!(sent.id, id);
        assert_eq!(sent.kind, Some(crate::pb::request::Kind::Reseed(identity)));
        // Later requests take later ids.
        assert_eq!(c.next_id(), id + 1);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_guest_that_trickles_is_cut_at_the_deadline() {
        // One byte of a Pong frame every 100 ms: each read succeeds, the call never ends.
        let path = fake("trickle", |mut s| {
            let mut drain = [0u8; 64];
            let _ = s.read(&mut drain);
            for _ in 0..100 {
                if s.write_all(&[1]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let mut c = connect(&path, 52, far(), |_| {}).unwrap();
        let t = Instant::now();
        let err = c
            .within(Duration::from_millis(500), |c| c.ping())
            .unwrap_err();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(err.to_string().contains("connection"), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_guest_that_never_answers_the_handshake_is_cut_at_the_deadline() {
        let (path, listener) = listen("stall");
        let holder = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
        let t = Instant::now();
        let mut seen = None;
        let err = connect(
            &path,
            52,
            Instant::now() + Duration::from_millis(300),
            |s| {
                seen = s.try_clone().ok();
            },
        )
        .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(3));
        assert!(matches!(err, ClientError::Handshake(_)), "{err:?}");
        assert!(
            seen.is_some(),
            "the socket is handed out before the handshake"
        );
        drop(holder.join());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_flood_of_directory_entries_is_refused_before_it_is_decoded() {
        let path = fake("flood", |mut s| {
            let mut drain = [0u8; 256];
            let _ = s.read(&mut drain);
            let listing = Response {
                id: 1,
                kind: Some(response::Kind::DirListing(DirListing {
                    entries: vec![FileStat::default(); crate::MAX_DIR_ENTRIES + 1],
                    truncated: false,
                })),
            };
            let _ = write_frame(&mut s, &listing);
        });
        let mut c = connect(&path, 52, far(), |_| {}).unwrap();
        let err = c.list_dir("/tmp").unwrap_err();
        assert!(matches!(err, ClientError::Protocol(_)), "{err:?}");
        assert!(err.to_string().contains("entries"), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn waiting_stops_when_the_vm_is_gone_or_the_deadline_passes() {
        let nowhere = std::path::Path::new("/nonexistent/airlock.sock");
        let gone = wait_ready(nowhere, 52, far(), || Some("the VM ended".into())).unwrap_err();
        assert!(matches!(gone, WaitError::Cancelled(_)), "{gone:?}");
        let t = Instant::now();
        let late = wait_ready(
            nowhere,
            52,
            Instant::now() + Duration::from_millis(50),
            || None,
        )
        .unwrap_err();
        assert!(matches!(late, WaitError::Deadline { .. }), "{late:?}");
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_signallers_answers_are_dropped_and_others_are_errors() {
        use crate::client::SIDE_REQUEST_IDS;
        let answer_side_then_pong = |mut s: UnixStream| {
            let mut drain = [0u8; 256];
            let _ = s.read(&mut drain);
            let side = Response {
                id: SIDE_REQUEST_IDS,
                kind: Some(response::Kind::Ok(crate::pb::Ok {})),
            };
            let pong = Response {
                id: 1,
                kind: Some(response::Kind::Pong(crate::pb::Pong { uptime_ms: 9 })),
            };
            let _ = write_frame(&mut s, &side);
            let _ = write_frame(&mut s, &pong);
            std::thread::sleep(Duration::from_millis(200));
        };
        let path = fake("side", answer_side_then_pong);
        let mut c = connect(&path, 52, far(), |_| {}).unwrap();
        let socket = c.reader().try_clone_socket().unwrap();
        let signaller = c.signaller(socket);
        assert_eq!(c.ping().unwrap().uptime_ms, 9);
        drop(signaller);
        let _ = std::fs::remove_file(&path);
        let path = fake("noside", answer_side_then_pong);
        let mut c = connect(&path, 52, far(), |_| {}).unwrap();
        assert!(matches!(c.ping().unwrap_err(), ClientError::Protocol(_)));
        let _ = std::fs::remove_file(&path);
    }
}
