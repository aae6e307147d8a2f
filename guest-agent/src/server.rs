//! Listening, connections and request dispatch.
//!
//! Each connection is served by its own thread, which reads requests and answers the quick ones
//! itself (files, ping, signal); executions answer from their own threads. All of them write
//! through the connection's [`ConnWriter`], one lock around one write per batch of frames. A
//! malformed or oversized frame is answered with an Error (id 0) and closes the connection;
//! closing a connection kills its executions, except those kept on disconnect, which it leaves
//! unowned (see [`crate::delivery`]). A connection that fails (ECONNRESET after a vsock
//! transport reset, say) is closed like one that ends cleanly. Nothing a host sends can end the
//! agent.

use std::fmt;
use std::fs::File;
use std::io::{self, BufReader};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use airlock_proto::pb::{self, ErrorCode, Pong, Request, Response, request, response};
use airlock_proto::{FrameError, read_frame};

use crate::agent::Agent;
use crate::clock::millis;
use crate::conn::ConnWriter;
use crate::error::ReqError;
use crate::{exec, files, sys};

/// How long PowerOff waits for the host to take its answer before the VM resets.
const POWER_OFF_LINGER: Duration = Duration::from_secs(1);

/// Where the agent listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A Unix socket path (host mode, tests).
    Unix(PathBuf),
    /// An AF_VSOCK port, any CID (in the VM).
    Vsock(u32),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:").filter(|p| !p.is_empty()) {
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        if let Some(port) = s.strip_prefix("vsock:") {
            return port
                .parse()
                .map(Self::Vsock)
                .map_err(|_| format!("invalid vsock port {port:?}"));
        }
        Err(format!("expected unix:PATH or vsock:PORT, got {s:?}"))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
            Self::Vsock(port) => write!(f, "vsock:{port}"),
        }
    }
}

/// A listening socket.
#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener),
    Vsock(OwnedFd),
}

impl Listener {
    pub fn bind(addr: &ListenAddr) -> io::Result<Self> {
        match addr {
            ListenAddr::Unix(path) => {
                // A socket file left by an earlier agent would make bind fail.
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    std::fs::remove_file(path)?;
                }
                UnixListener::bind(path).map(Self::Unix)
            }
            ListenAddr::Vsock(port) => sys::vsock_listen(*port).map(Self::Vsock),
        }
    }

    fn accept(&self) -> io::Result<OwnedFd> {
        match self {
            Self::Unix(l) => l.accept().map(|(s, _)| OwnedFd::from(s)),
            Self::Vsock(fd) => sys::accept(fd.as_fd()),
        }
    }
}

/// Accepts connections forever, each served on its own thread.
pub fn serve_forever(agent: &Arc<Agent>, listener: &Listener) -> ! {
    loop {
        match listener.accept() {
            Ok(fd) => {
                let agent = Arc::clone(agent);
                let spawned = std::thread::Builder::new()
                    .name("conn".into())
                    .spawn(move || serve_connection(&agent, fd));
                if let Err(e) = spawned {
                    eprintln!("airlock-agent: cannot start a connection thread: {e}");
                }
            }
            // A connection that was reset or aborted while it waited to be accepted (every
            // connection is reset on a vsock transport reset): the next one may be fine, and
            // after a snapshot restore the host is waiting for it.
            Err(e) if accept_error_is_transient(&e) => {}
            Err(e) => {
                // EMFILE and friends: wait a little instead of spinning.
                eprintln!("airlock-agent: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Errors of `accept` that concern one connection rather than the listener or the system.
fn accept_error_is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ECONNABORTED | libc::ECONNRESET | libc::EPROTO | libc::EINTR)
    )
}

/// Serves one connection until it ends.
fn serve_connection(agent: &Arc<Agent>, fd: OwnedFd) {
    let read_half = File::from(fd);
    let halves = read_half
        .try_clone()
        .and_then(|w| Ok((w, read_half.try_clone()?)));
    let (write_half, control) = match halves {
        Ok(h) => h,
        Err(e) => {
            eprintln!("airlock-agent: connection: {e}");
            return;
        }
    };
    let conn = Arc::new(ConnWriter::new(write_half, control));
    conn.send(&Response {
        id: 0,
        kind: Some(response::Kind::Ready(agent.ready())),
    });
    let mut reader = BufReader::with_capacity(64 << 10, read_half);
    loop {
        match read_frame::<_, Request>(&mut reader) {
            Ok(Some(req)) => {
                if dispatch(agent, &conn, req) == Flow::Close {
                    break;
                }
            }
            Ok(None) => break,
            // ECONNRESET (a vsock transport reset) or any other failure: closed, like EOF.
            Err(e) => {
                if let Some(err) = frame_error_reply(&e) {
                    conn.send(&err.response(0));
                }
                break;
            }
        }
    }
    // Shut down first: a writer blocked on this connection returns, and an execution kept on
    // disconnect that was writing keeps what it could not send.
    conn.shutdown();
    agent.execs.close_connection(&conn);
}

/// The Error a bad frame is answered with; `None` when the stream just ended or failed.
fn frame_error_reply(e: &FrameError) -> Option<ReqError> {
    match e {
        FrameError::TooLarge { .. } => Some(ReqError::new(ErrorCode::TooLarge, e.to_string())),
        FrameError::Decode(d) => Some(ReqError::invalid(format!("malformed frame: {d}"))),
        FrameError::TruncatedHeader { .. } | FrameError::TruncatedBody { .. } => None,
        FrameError::Io(_) => None,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    Close,
}

/// Handles one request; answers everything but Exec, Stdin and Attach here.
fn dispatch(agent: &Arc<Agent>, conn: &Arc<ConnWriter>, req: Request) -> Flow {
    let id = req.id;
    if id == 0 {
        conn.send(&ReqError::invalid("request id 0 is reserved").response(0));
        return Flow::Continue;
    }
    let Some(kind) = req.kind else {
        let err = ReqError::new(ErrorCode::Unsupported, "unknown request kind");
        conn.send(&err.response(id));
        return Flow::Continue;
    };
    let answer = match kind {
        request::Kind::Exec(mut e) => agent.users.resolve(&e.user).and_then(|account| {
            if e.cwd.is_empty()
                && let Some(w) = agent.users.workdir()
                && std::path::Path::new(&w).is_dir()
            {
                e.cwd = w;
            }
            let base_env = agent.base_env();
            exec::start(&agent.execs, &agent.spawner, base_env, account, conn, id, e).map(|()| None)
        }),
        request::Kind::Stdin(s) => agent
            .execs
            .get(conn, s.exec_id)
            .and_then(|e| e.push_stdin(conn, id, s.data, s.eof))
            .map(|()| None),
        request::Kind::Attach(a) => agent.execs.attach(conn, id, &a).map(|()| None),
        request::Kind::Reseed(r) => agent
            .reseed(r)
            .map(|done| Some(response::Kind::Reseeded(done))),
        request::Kind::Signal(s) => agent
            .execs
            .get(conn, s.exec_id)
            .and_then(|e| e.signal(s.signal))
            .map(|()| Some(response::Kind::Ok(pb::Ok {}))),
        request::Kind::Ping(_) => Ok(Some(response::Kind::Pong(Pong {
            uptime_ms: millis(sys::boottime()),
        }))),
        request::Kind::PowerOff(_) => {
            conn.send(&ok(id));
            conn.linger(POWER_OFF_LINGER);
            agent.power_off();
        }
        other => files::handle(&agent.users, &other)
            .unwrap_or_else(|| Err(ReqError::new(ErrorCode::Unsupported, "unknown request")))
            .map(Some),
    };
    match answer {
        Ok(Some(kind)) => conn.send(&Response {
            id,
            kind: Some(kind),
        }),
        Ok(None) => {}
        Err(e) => conn.send(&e.response(id)),
    }
    Flow::Continue
}

fn ok(id: u64) -> Response {
    Response {
        id,
        kind: Some(response::Kind::Ok(pb::Ok {})),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addr_parses_unix_and_vsock() {
        assert_eq!(
            "unix:/tmp/a.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/tmp/a.sock".into())
        );
        assert_eq!(
            "vsock:52".parse::<ListenAddr>().unwrap(),
            ListenAddr::Vsock(52)
        );
    }

    #[test]
    fn listen_addr_rejects_other_forms() {
        for bad in ["", "unix:", "vsock:", "vsock:x", "tcp:1", "/tmp/a.sock"] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn listen_addr_displays_as_parsed() {
        for s in ["unix:/run/a.sock", "vsock:52"] {
            assert_eq!(s.parse::<ListenAddr>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn per_connection_accept_errors_are_transient_resource_errors_are_not() {
        for errno in [
            libc::ECONNABORTED,
            libc::ECONNRESET,
            libc::EPROTO,
            libc::EINTR,
        ] {
            assert!(accept_error_is_transient(&io::Error::from_raw_os_error(
                errno
            )));
        }
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOMEM, libc::ENOBUFS] {
            assert!(!accept_error_is_transient(&io::Error::from_raw_os_error(
                errno
            )));
        }
    }

    #[test]
    fn oversize_and_malformed_frames_get_an_error_truncation_does_not() {
        let too_large = frame_error_reply(&FrameError::TooLarge { len: 1 << 30 }).unwrap();
        assert_eq!(too_large.code, ErrorCode::TooLarge);
        let bad = <Request as prost::Message>::decode(&[0xff, 0xff, 0xff][..]).unwrap_err();
        let malformed = frame_error_reply(&FrameError::Decode(bad)).unwrap();
        assert_eq!(malformed.code, ErrorCode::InvalidArgument);
        assert!(frame_error_reply(&FrameError::TruncatedBody { len: 3 }).is_none());
    }
}
