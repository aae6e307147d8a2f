//! One agent connection shared by every caller. airlockd keeps one per sandbox: executions,
//! file transfers and control calls each take a [`MuxClient`] on it instead of a connection
//! of their own (a vsock handshake and a `Ready` each).
//!
//! A reader thread reads every response and hands it to the caller whose request it answers,
//! through a bounded queue per request ([`ROUTE_QUEUE`] frames). A caller that stops reading
//! stalls the reader (and so, through the agent's blocked writes, the guest's output); after
//! [`ROUTE_STALL`] its request is dropped, its next receive fails, and the others go on.
//! Answers to requests nobody waits for any more (a caller gave up at its deadline, a detached
//! Signal) are dropped; a response to an id never sent, or one with id 0, closes the
//! connection (the guest is untrusted). A closed connection fails every caller's receive with
//! its reason, and [`Mux::is_closed`] tells the owner to connect again.

use std::collections::HashMap;
use std::io::{self, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::client::{
    AgentClient, ClientError, Pending, Requests, is_last, pending_of, read_response,
};
use crate::frame::{FrameError, encode_frame};
use crate::pb::{Ready, Request, Response, request, response};
use crate::vsock::{self, TimedClient, TimedStream};

/// Frames queued per request for its caller (output comes in frames of at most
/// [`crate::MAX_OUTPUT_CHUNK`]).
pub const ROUTE_QUEUE: usize = 32;
/// How long the reader waits for a caller whose queue is full before dropping its request.
pub const ROUTE_STALL: Duration = Duration::from_secs(30);
/// Longest time one write of a request may block (a guest that does not read its socket).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Stack of the reader thread (it decodes frames on the heap).
const READER_STACK: usize = 256 << 10;

/// A shared connection to one agent; clones share it. It closes when the last clone (and
/// every [`MuxClient`] on it) is dropped, when the agent closes it, or on [`Mux::close`].
#[derive(Clone, Debug)]
pub struct Mux {
    shared: Arc<Shared>,
    _owner: Arc<Owner>,
}

/// Shuts the connection down when the last handle goes (the reader thread then ends).
#[derive(Debug)]
struct Owner {
    shared: Arc<Shared>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.shared
            .close("the connection's owner closed it".to_owned());
    }
}

#[derive(Debug)]
struct Shared {
    writer: Mutex<UnixStream>,
    /// Another descriptor of the socket, to shut it down while the reader blocks.
    socket: UnixStream,
    routes: Mutex<Routes>,
    next_id: AtomicU64,
    ready: Ready,
}

#[derive(Debug, Default)]
struct Routes {
    open: HashMap<u64, Route>,
    /// Why the connection closed, once it has.
    closed: Option<String>,
}

/// Where the answers to one request go.
#[derive(Debug)]
struct Route {
    pending: Pending,
    tx: SyncSender<Response>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn timed_out() -> ClientError {
    ClientError::Frame(FrameError::Io(io::Error::new(
        io::ErrorKind::TimedOut,
        "the agent did not answer in time",
    )))
}

/// An error and its sources, in one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

impl Shared {
    fn close(&self, why: String) {
        {
            let mut routes = lock(&self.routes);
            routes.closed.get_or_insert(why);
            // Every caller's queue disconnects (after what it holds).
            routes.open.clear();
        }
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }

    fn closed(&self) -> Option<String> {
        lock(&self.routes).closed.clone()
    }

    fn write(&self, req: &Request) -> Result<(), ClientError> {
        let frame = encode_frame(req)?;
        let mut w = lock(&self.writer);
        let wrote = w.write_all(&frame).and_then(|()| w.flush());
        drop(w);
        wrote.map_err(|e| {
            let e = if e.kind() == io::ErrorKind::WouldBlock {
                io::Error::new(io::ErrorKind::TimedOut, "the agent did not read in time")
            } else {
                e
            };
            self.close(format!("writing to the agent: {e}"));
            ClientError::Frame(FrameError::Io(e))
        })
    }

    /// Hands `resp` to its caller; `Err` closes the connection for that reason.
    fn dispatch(&self, resp: Response) -> Result<(), String> {
        let id = resp.id;
        if id == 0 {
            return Err(match resp.kind {
                Some(response::Kind::Error(e)) => format!("the agent reported: {}", e.message),
                other => format!("the agent broke the protocol: a response with id 0: {other:?}"),
            });
        }
        let tx = {
            let mut routes = lock(&self.routes);
            let Some(route) = routes.open.get(&id) else {
                if id < self.next_id.load(Ordering::SeqCst) {
                    // Sent, and nobody waits for it any more.
                    return Ok(());
                }
                return Err(format!(
                    "the agent broke the protocol: a response to request {id}, never sent"
                ));
            };
            let tx = route.tx.clone();
            if is_last(&resp, route.pending) {
                routes.open.remove(&id);
            }
            tx
        };
        let since = Instant::now();
        let mut resp = resp;
        loop {
            match tx.try_send(resp) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => {
                    lock(&self.routes).open.remove(&id);
                    return Ok(());
                }
                Err(TrySendError::Full(back)) => {
                    if since.elapsed() > ROUTE_STALL {
                        // The caller stopped reading; the others go on without it.
                        lock(&self.routes).open.remove(&id);
                        return Ok(());
                    }
                    resp = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
}

fn read_loop(shared: &Shared, mut reader: BufReader<TimedStream>) {
    let why = loop {
        match read_response(&mut reader) {
            Ok(resp) => {
                if let Err(why) = shared.dispatch(resp) {
                    break why;
                }
            }
            Err(ClientError::Closed) => break "the agent closed the connection".to_owned(),
            Err(e) => break chain(&e),
        }
    };
    shared.close(why);
}

impl Mux {
    /// Connects to the agent through the VMM's hybrid-vsock socket `uds` (the handshake and
    /// `Ready` before `deadline`) and shares the connection.
    pub fn connect(uds: &Path, port: u32, deadline: Instant) -> Result<Self, ClientError> {
        Self::from_client(vsock::connect(uds, port, deadline, |_| {})?)
    }

    /// Shares the connection of `client`, which must have no request in flight; request ids
    /// continue after the ones it used.
    pub fn from_client(client: TimedClient) -> Result<Self, ClientError> {
        let socket = client.reader().try_clone_socket().map_err(FrameError::Io)?;
        let writer = socket.try_clone().map_err(FrameError::Io)?;
        writer
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .map_err(FrameError::Io)?;
        let (reader, _, ready, last_id) = AgentClient::into_parts(client)?;
        // The reader waits as long as the connection lives; callers have their own deadlines.
        reader.get_ref().set_deadline(None);
        let shared = Arc::new(Shared {
            writer: Mutex::new(writer),
            socket,
            routes: Mutex::new(Routes::default()),
            next_id: AtomicU64::new(last_id + 1),
            ready,
        });
        let for_reader = shared.clone();
        std::thread::Builder::new()
            .name("agent-mux".into())
            .stack_size(READER_STACK)
            .spawn(move || read_loop(&for_reader, reader))
            .map_err(FrameError::Io)?;
        Ok(Self {
            _owner: Arc::new(Owner {
                shared: shared.clone(),
            }),
            shared,
        })
    }

    /// The agent's `Ready` frame.
    pub fn ready(&self) -> &Ready {
        &self.shared.ready
    }

    /// Whether the connection has closed (a new one is needed).
    pub fn is_closed(&self) -> bool {
        self.shared.closed().is_some()
    }

    /// Closes the connection: every caller's receive fails.
    pub fn close(&self, why: &str) {
        self.shared.close(why.to_owned());
    }

    /// A caller's share of the connection, whose receives wait until `deadline` at most.
    pub fn client(&self, deadline: Option<Instant>) -> MuxClient {
        MuxClient {
            mux: self.clone(),
            waiting: HashMap::new(),
            deadline,
        }
    }

    /// Sends `kind` without waiting for its answer (dropped when it comes); returns its id.
    pub fn send_detached(&self, kind: request::Kind) -> Result<u64, ClientError> {
        if let Some(why) = self.shared.closed() {
            return Err(ClientError::Lost(why));
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        self.shared.write(&Request {
            id,
            kind: Some(kind),
        })?;
        Ok(id)
    }

    /// Stops routing the answers of request `id`: the caller waiting for them gets an error
    /// (after what was already queued for it).
    pub fn cancel(&self, id: u64) {
        lock(&self.shared.routes).open.remove(&id);
    }

    fn lost(&self) -> ClientError {
        ClientError::Lost(self.shared.closed().unwrap_or_else(|| {
            "its answers were dropped (not read for too long, or cancelled)".to_owned()
        }))
    }
}

/// One caller's requests on a [`Mux`].
#[derive(Debug)]
pub struct MuxClient {
    mux: Mux,
    waiting: HashMap<u64, (Pending, Receiver<Response>)>,
    deadline: Option<Instant>,
}

impl MuxClient {
    /// The connection it uses.
    pub fn mux(&self) -> &Mux {
        &self.mux
    }

    /// Sets the deadline of the receives that follow (`None`: none).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// Runs `f` with a deadline `timeout` from now, then restores the previous one.
    pub fn within<T>(&mut self, timeout: Duration, f: impl FnOnce(&mut Self) -> T) -> T {
        let before = self.deadline;
        self.deadline = Some(Instant::now() + timeout);
        let out = f(self);
        self.deadline = before;
        out
    }

    /// Gives up on request `id`: its later answers are dropped.
    fn abandon(&mut self, id: u64) {
        self.waiting.remove(&id);
        self.mux.cancel(id);
    }
}

impl Requests for MuxClient {
    fn send_kind(&mut self, kind: request::Kind) -> Result<u64, ClientError> {
        let shared = &self.mux.shared;
        let req = Request {
            id: shared.next_id.fetch_add(1, Ordering::SeqCst),
            kind: Some(kind),
        };
        let pending = pending_of(&req);
        let (tx, rx) = sync_channel(ROUTE_QUEUE);
        {
            let mut routes = lock(&shared.routes);
            if let Some(why) = &routes.closed {
                return Err(ClientError::Lost(why.clone()));
            }
            routes.open.insert(req.id, Route { pending, tx });
        }
        if let Err(e) = shared.write(&req) {
            self.mux.cancel(req.id);
            return Err(e);
        }
        self.waiting.insert(req.id, (pending, rx));
        Ok(req.id)
    }

    fn recv_for(&mut self, id: u64) -> Result<Response, ClientError> {
        let Some((pending, rx)) = self.waiting.get(&id) else {
            return Err(ClientError::InvalidRequest("no such request in flight"));
        };
        let got = match self.deadline {
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        match got {
            Ok(resp) => {
                if is_last(&resp, *pending) {
                    self.waiting.remove(&id);
                }
                Ok(resp)
            }
            Err(RecvTimeoutError::Timeout) => {
                self.abandon(id);
                Err(timed_out())
            }
            Err(RecvTimeoutError::Disconnected) => {
                self.waiting.remove(&id);
                Err(self.mux.lost())
            }
        }
    }
}

impl Drop for MuxClient {
    fn drop(&mut self) {
        let mut routes = lock(&self.mux.shared.routes);
        for id in self.waiting.keys() {
            routes.open.remove(id);
        }
    }
}

#[cfg(test)]
mod tests;
