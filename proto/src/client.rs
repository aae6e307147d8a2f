//! A small synchronous client for the agent protocol.
//!
//! [`AgentClient`] works over any `Read` + `Write` pair, typically a [`UnixStream`] and its
//! `try_clone()`. It reads and checks the agent's `Ready` frame when it is created, hands out
//! request ids, and keeps track of the requests in flight so that a response to a request it
//! never sent is a protocol error (the guest is untrusted).
//!
//! Responses of other requests that arrive while a helper waits for its own (output of another
//! execution, say) are **buffered**, in order, and returned later by [`AgentClient::recv`] or by
//! the helper waiting for them. The buffer is bounded ([`MAX_STASHED_BYTES`]); past it the
//! client fails with [`ClientError::Backlog`] rather than grow without limit.
//!
//! The client sends one request and then reads; it never pipelines large requests, so it cannot
//! deadlock against an agent that is itself blocked writing output. A caller that sends many
//! requests without reading must read concurrently.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use prost::Message;

use crate::frame::{FrameError, count_field, read_frame, read_frame_bytes, write_frame};
use crate::pb::{
    self, Attached, ExecExit, ExecStarted, FileData, FileStat, Ready, Request, Reseeded, Response,
    StreamKind, exec_exit, request, response,
};
use crate::{MAX_DIR_ENTRIES, MAX_FILE_BYTES, MAX_FILE_CHUNK, PROTOCOL_VERSION};

mod error;
pub use error::ClientError;
pub(crate) use error::agent_error;
use error::{expect_ok, into_kind, protocol};

/// `Response.dir_listing`'s field number (agent.proto).
const DIR_LISTING_FIELD: u32 = 18;

/// Most bytes of responses buffered for requests nobody is waiting for yet.
pub const MAX_STASHED_BYTES: usize = 32 << 20;

/// Request ids from here up belong to a [`Signaller`]; a client that handed one out drops
/// their answers.
pub const SIDE_REQUEST_IDS: u64 = 1 << 62;

/// Sends `Signal` requests on a client's connection from another thread while the client
/// itself waits for output (a blocked reader cannot send). Its requests take ids from
/// [`SIDE_REQUEST_IDS`] up, and the client drops their answers; a failed signal is seen by
/// the execution's outcome, not here.
#[derive(Debug)]
pub struct Signaller<W: Write> {
    writer: std::sync::Mutex<W>,
    next: std::sync::atomic::AtomicU64,
}

impl<W: Write> Signaller<W> {
    /// Sends `signal` to the process tree of execution `exec_id`.
    pub fn signal(&self, exec_id: u64, signal: i32) -> Result<(), ClientError> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let req = Request {
            id,
            kind: Some(request::Kind::Signal(pb::Signal { exec_id, signal })),
        };
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *w, &req)?;
        w.flush().map_err(FrameError::Io)?;
        Ok(())
    }
}

/// What a request in flight still expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pending {
    /// One response.
    Single,
    /// ExecStarted (or Attached), Output..., then ExecExit (or one Error): Exec and Attach.
    Exec,
}

/// A synchronous connection to one agent.
#[derive(Debug)]
pub struct AgentClient<R: Read, W: Write> {
    reader: BufReader<R>,
    writer: W,
    ready: Ready,
    last_id: u64,
    in_flight: HashMap<u64, Pending>,
    stash: VecDeque<Response>,
    stash_bytes: usize,
    /// A [`Signaller`] was handed out: answers with side ids are its own.
    side_requests: bool,
}

impl AgentClient<UnixStream, UnixStream> {
    /// Connects to an agent listening on a Unix socket (`airlock-agent --listen unix:PATH`).
    pub fn connect_unix(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        let stream = connect(path.as_ref())?;
        Self::from_unix_stream(stream)
    }

    /// Connects to the agent inside a VM through the VMM's hybrid-vsock Unix socket: sends
    /// `CONNECT <port>\n`, expects `OK <host port>\n`, then reads `Ready`.
    pub fn connect_vsock(uds_path: impl AsRef<Path>, port: u32) -> Result<Self, ClientError> {
        let mut stream = connect(uds_path.as_ref())?;
        let mut writer = stream.try_clone().map_err(FrameError::Io)?;
        handshake(&mut stream, &mut writer, port)?;
        Self::from_stream(stream, writer)
    }

    /// Uses a connected Unix stream (and a clone of it for writing).
    pub fn from_unix_stream(stream: UnixStream) -> Result<Self, ClientError> {
        let writer = stream.try_clone().map_err(FrameError::Io)?;
        Self::from_stream(stream, writer)
    }
}

/// The Reseed that gives a restored clone its own identity: fresh host entropy
/// ([`crate::identity`]), `sandbox_id` as its id and host name, and `disk_bytes` as the
/// size of its /tmp (0: unchanged).
pub fn clone_identity(sandbox_id: &str, disk_bytes: u64) -> Result<pb::Reseed, ClientError> {
    let mut entropy = [0u8; crate::identity::CLONE_ENTROPY_BYTES];
    crate::identity::random_bytes(&mut entropy).map_err(FrameError::Io)?;
    Ok(pb::Reseed {
        entropy: entropy.to_vec(),
        hostname: sandbox_id.to_owned(),
        sandbox_id: sandbox_id.to_owned(),
        disk_bytes,
        mounts: Vec::new(),
        no_root: false,
        default_user: String::new(),
        workdir: String::new(),
    })
}

/// How the answers to `req` arrive.
pub(crate) fn pending_of(req: &Request) -> Pending {
    match req.kind {
        Some(request::Kind::Exec(_) | request::Kind::Attach(_)) => Pending::Exec,
        _ => Pending::Single,
    }
}

fn connect(path: &Path) -> Result<UnixStream, ClientError> {
    UnixStream::connect(path).map_err(|source| ClientError::Connect {
        path: path.display().to_string(),
        source,
    })
}

impl<R: Read, W: Write> AgentClient<R, W> {
    /// Wraps a connected stream pair and reads the agent's `Ready` frame, which must come
    /// first, carry id 0 and this crate's [`PROTOCOL_VERSION`].
    pub fn from_stream(reader: R, writer: W) -> Result<Self, ClientError> {
        let mut reader = BufReader::with_capacity(64 << 10, reader);
        let first: Response = read_frame(&mut reader)?.ok_or(ClientError::Closed)?;
        let ready = match first.kind {
            Some(response::Kind::Ready(ready)) if first.id == 0 => ready,
            other => return Err(ClientError::NotReady(format!("id {}: {other:?}", first.id))),
        };
        if ready.protocol_version != PROTOCOL_VERSION {
            return Err(ClientError::Version {
                got: ready.protocol_version,
            });
        }
        Ok(Self {
            reader,
            writer,
            ready,
            last_id: 0,
            in_flight: HashMap::new(),
            stash: VecDeque::new(),
            stash_bytes: 0,
            side_requests: false,
        })
    }

    /// Like [`from_stream`](Self::from_stream), with a first request sent before the agent's
    /// `Ready` is read: it travels with the connection's first exchange instead of a round
    /// trip after it (the agent reads it once it has sent Ready). Returns the client and the
    /// request's id; its answer comes with [`recv_for`](Self::recv_for) as usual.
    pub fn from_stream_pipelined(
        reader: R,
        mut writer: W,
        first: request::Kind,
    ) -> Result<(Self, u64), ClientError> {
        const FIRST_ID: u64 = 1;
        let req = Request {
            id: FIRST_ID,
            kind: Some(first),
        };
        let pending = pending_of(&req);
        write_frame(&mut writer, &req)?;
        writer.flush().map_err(FrameError::Io)?;
        let mut client = Self::from_stream(reader, writer)?;
        client.last_id = FIRST_ID;
        client.in_flight.insert(FIRST_ID, pending);
        Ok((client, FIRST_ID))
    }

    /// The agent's `Ready` frame.
    pub fn ready(&self) -> &Ready {
        &self.ready
    }

    /// The read half (e.g. to set a read timeout on a socket).
    pub fn reader(&self) -> &R {
        self.reader.get_ref()
    }

    /// The write half.
    pub fn writer(&self) -> &W {
        &self.writer
    }

    /// A [`Signaller`] writing through `writer` (a second handle on this connection).
    pub fn signaller<W2: Write>(&mut self, writer: W2) -> Signaller<W2> {
        self.side_requests = true;
        Signaller {
            writer: std::sync::Mutex::new(writer),
            next: std::sync::atomic::AtomicU64::new(SIDE_REQUEST_IDS),
        }
    }

    /// A fresh request id (1, 2, 3, ...).
    pub fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// Sends a request; its id must be non-zero and not already in flight.
    pub fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        if req.id == 0 {
            return Err(ClientError::InvalidRequest("request id 0 is reserved"));
        }
        if self.in_flight.contains_key(&req.id) {
            return Err(ClientError::InvalidRequest("request id already in flight"));
        }
        let pending = pending_of(req);
        write_frame(&mut self.writer, req)?;
        self.writer.flush().map_err(FrameError::Io)?;
        self.in_flight.insert(req.id, pending);
        Ok(())
    }

    /// Sends `kind` with a fresh id and returns the id.
    pub fn send_kind(&mut self, kind: request::Kind) -> Result<u64, ClientError> {
        let id = self.next_id();
        self.send(&Request {
            id,
            kind: Some(kind),
        })?;
        Ok(id)
    }

    /// The next response: a buffered one first, else the next frame from the agent.
    pub fn recv(&mut self) -> Result<Response, ClientError> {
        if let Some(resp) = self.stash.pop_front() {
            self.stash_bytes -= resp.encoded_len();
            return Ok(resp);
        }
        self.read_response()
    }

    /// The next response to request `id`; responses to other requests are buffered.
    pub fn recv_for(&mut self, id: u64) -> Result<Response, ClientError> {
        if let Some(pos) = self.stash.iter().position(|r| r.id == id)
            && let Some(resp) = self.stash.remove(pos)
        {
            self.stash_bytes -= resp.encoded_len();
            return Ok(resp);
        }
        loop {
            let resp = self.read_response()?;
            if resp.id == id {
                return Ok(resp);
            }
            self.stash_response(resp)?;
        }
    }
}

impl<R: Read, W: Write> AgentClient<R, W> {
    /// Reads one frame and checks it against the requests in flight.
    fn read_response(&mut self) -> Result<Response, ClientError> {
        loop {
            let resp = self.read_one()?;
            if !(self.side_requests && resp.id >= SIDE_REQUEST_IDS) {
                return self.check_response(resp);
            }
            // A signaller's answer; whatever it says shows in the execution's outcome.
        }
    }

    /// Reads and decodes one frame.
    fn read_one(&mut self) -> Result<Response, ClientError> {
        read_response(&mut self.reader)
    }

    /// Takes the connection apart for [`crate::mux::Mux`]: the buffered read half (it may
    /// hold frames already received), the write half, `Ready` and the last id used. Refused
    /// while requests are in flight or responses are buffered (they would be lost).
    pub fn into_parts(self) -> Result<(BufReader<R>, W, Ready, u64), ClientError> {
        if !self.in_flight.is_empty() || !self.stash.is_empty() || self.side_requests {
            return Err(ClientError::InvalidRequest(
                "requests in flight: the connection cannot be handed over",
            ));
        }
        Ok((self.reader, self.writer, self.ready, self.last_id))
    }

    /// Checks a response against the requests in flight.
    fn check_response(&mut self, resp: Response) -> Result<Response, ClientError> {
        if resp.id == 0 {
            return match resp.kind {
                // The agent could not decode a frame of ours; it closes the connection next.
                Some(response::Kind::Error(e)) => Err(agent_error(e)),
                other => Err(protocol(format!("response with id 0: {other:?}"))),
            };
        }
        let Some(&pending) = self.in_flight.get(&resp.id) else {
            return Err(protocol(format!("response to unknown request {}", resp.id)));
        };
        if is_last(&resp, pending) {
            self.in_flight.remove(&resp.id);
        }
        Ok(resp)
    }

    fn stash_response(&mut self, resp: Response) -> Result<(), ClientError> {
        let len = resp.encoded_len();
        if self.stash_bytes + len > MAX_STASHED_BYTES {
            return Err(ClientError::Backlog);
        }
        self.stash_bytes += len;
        self.stash.push_back(resp);
        Ok(())
    }
}

/// The calls of the agent protocol, built on two primitives: sending a request and receiving
/// the next response to it. [`AgentClient`] (a connection of its own) and
/// [`crate::mux::MuxClient`] (a caller's share of a connection) implement them.
pub trait Requests {
    /// Sends `kind` with a fresh id and returns the id.
    fn send_kind(&mut self, kind: request::Kind) -> Result<u64, ClientError>;

    /// The next response to request `id`.
    fn recv_for(&mut self, id: u64) -> Result<Response, ClientError>;

    /// Sends `kind` and waits for its single answer; an `Error` answer becomes
    /// [`ClientError::Agent`].
    fn call(&mut self, kind: request::Kind) -> Result<response::Kind, ClientError> {
        let id = self.send_kind(kind)?;
        let resp = self.recv_for(id)?;
        into_kind(resp)
    }

    /// Runs `exec` to completion: output chunks go to `on_output` in order per stream, and the
    /// final `ExecExit` is returned. Responses to other requests are buffered meanwhile.
    fn exec_collect(
        &mut self,
        exec: pb::Exec,
        mut on_output: impl FnMut(StreamKind, &[u8]),
    ) -> Result<ExecExit, ClientError> {
        let (id, started) = self.start_exec(exec)?;
        self.collect_stream(id, started.exec_id, [0, 0], |stream, _, data| {
            on_output(stream, data);
        })
    }

    /// Sends `exec` (set `keep_on_disconnect` on it, e.g. with
    /// [`pb::Exec::with_keep_on_disconnect`], for an execution that survives this connection)
    /// and waits for its `ExecStarted`. Returns the request id, whose `Output` and `ExecExit`
    /// follow (read them with [`recv_for`](Self::recv_for)).
    fn start_exec(&mut self, exec: pb::Exec) -> Result<(u64, ExecStarted), ClientError> {
        let id = self.send_kind(request::Kind::Exec(exec))?;
        let started = self.exec_started(id)?;
        Ok((id, started))
    }

    /// Adopts execution `exec_id`, started with `keep_on_disconnect` on a connection that has
    /// closed since, and waits for the `Attached` answer. Returns the request id, whose
    /// `Output` (all the agent still retains, then live) and `ExecExit` follow (read them with
    /// [`recv_for`](Self::recv_for)); from now on Signal and Stdin for it work here.
    fn attach(&mut self, exec_id: u64) -> Result<(u64, Attached), ClientError> {
        self.attach_from(exec_id, 0, 0)
    }

    /// Like [`attach`](Self::attach), with the retained output replayed only from these
    /// offsets (the output of each stream that this host already has).
    fn attach_from(
        &mut self,
        exec_id: u64,
        stdout_offset: u64,
        stderr_offset: u64,
    ) -> Result<(u64, Attached), ClientError> {
        let req = pb::Attach {
            exec_id,
            stdout_offset,
            stderr_offset,
        };
        let id = self.send_kind(request::Kind::Attach(req))?;
        match into_kind(self.recv_for(id)?)? {
            response::Kind::Attached(attached) if attached.exec_id == exec_id => Ok((id, attached)),
            other => Err(protocol(format!("expected Attached, got {other:?}"))),
        }
    }

    /// Attaches to `exec_id` (see [`attach`](Self::attach)) and follows it to its end: each
    /// output chunk goes to `on_output` with its stream offset (offsets start at the
    /// `Attached` ones and are contiguous), and the `ExecExit` is returned with the `Attached`
    /// answer.
    fn attach_collect(
        &mut self,
        exec_id: u64,
        on_output: impl FnMut(StreamKind, u64, &[u8]),
    ) -> Result<(Attached, ExecExit), ClientError> {
        let (id, attached) = self.attach(exec_id)?;
        let expected = [attached.stdout_offset, attached.stderr_offset];
        let exit = self.collect_stream(id, exec_id, expected, on_output)?;
        Ok((attached, exit))
    }

    /// Reads the `Output` frames of request `id` (execution `exec_id`) up to its `ExecExit`.
    /// Each stream's offsets must continue at `expected`, without gaps.
    fn collect_stream(
        &mut self,
        id: u64,
        exec_id: u64,
        mut expected: [u64; 2],
        mut on_output: impl FnMut(StreamKind, u64, &[u8]),
    ) -> Result<ExecExit, ClientError> {
        loop {
            match into_kind(self.recv_for(id)?)? {
                response::Kind::Output(out) => {
                    let (stream, slot) = match StreamKind::try_from(out.stream) {
                        Ok(StreamKind::Stdout) => (StreamKind::Stdout, 0),
                        Ok(StreamKind::Stderr) => (StreamKind::Stderr, 1),
                        _ => return Err(protocol(format!("output stream {}", out.stream))),
                    };
                    if out.exec_id != exec_id || out.offset != expected[slot] {
                        return Err(protocol(format!(
                            "output of exec {} at offset {}, expected exec {exec_id} offset {}",
                            out.exec_id, out.offset, expected[slot]
                        )));
                    }
                    // The starting offsets come from the (untrusted) agent's Attached.
                    expected[slot] = expected[slot]
                        .checked_add(out.data.len() as u64)
                        .ok_or_else(|| {
                            protocol(format!("output offset {} past 2^64", out.offset))
                        })?;
                    on_output(stream, out.offset, &out.data);
                }
                response::Kind::ExecExit(exit) if exit.exec_id == exec_id => {
                    return Ok(exit);
                }
                other => return Err(protocol(format!("unexpected in exec stream: {other:?}"))),
            }
        }
    }

    /// Waits for the `ExecStarted` of the exec request `id` (or its `Error`).
    fn exec_started(&mut self, id: u64) -> Result<ExecStarted, ClientError> {
        match into_kind(self.recv_for(id)?)? {
            response::Kind::ExecStarted(started) => Ok(started),
            other => Err(protocol(format!("expected ExecStarted, got {other:?}"))),
        }
    }

    /// Writes `data` to `path` (created with mode 0644 and missing parents), in chunks of
    /// [`MAX_FILE_CHUNK`]; the first chunk truncates.
    fn write_file(&mut self, path: &str, data: &[u8]) -> Result<(), ClientError> {
        let template = pb::WriteFile {
            path: path.to_owned(),
            create_parents: true,
            ..Default::default()
        };
        self.write_file_with(&template, data)
    }

    /// Like [`write_file`](Self::write_file) with `path`, `mode`, `root` and `create_parents`
    /// taken from `template` (its `data`, `offset` and `truncate` are ignored).
    fn write_file_with(
        &mut self,
        template: &pb::WriteFile,
        data: &[u8],
    ) -> Result<(), ClientError> {
        let mut offset = 0usize;
        loop {
            let end = data.len().min(offset + MAX_FILE_CHUNK);
            let chunk = data.get(offset..end).unwrap_or_default();
            let req = pb::WriteFile {
                offset: offset as u64,
                data: chunk.to_vec(),
                truncate: offset == 0,
                ..template.clone()
            };
            expect_ok(self.call(request::Kind::WriteFile(req))?)?;
            offset = end;
            if offset >= data.len() {
                return Ok(());
            }
        }
    }

    /// Reads the whole file at `path` in chunks of [`MAX_FILE_CHUNK`] (at most
    /// [`MAX_FILE_BYTES`]).
    fn read_file(&mut self, path: &str) -> Result<Vec<u8>, ClientError> {
        self.read_file_in(path, "")
    }

    /// Like [`read_file`](Self::read_file), with `path` resolved inside `root`.
    fn read_file_in(&mut self, path: &str, root: &str) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        loop {
            let chunk = self.read_chunk(path, root, out.len() as u64)?;
            if chunk.data.is_empty() && !chunk.eof {
                return Err(protocol("empty FileData before end of file".into()));
            }
            out.extend_from_slice(&chunk.data);
            if out.len() as u64 > MAX_FILE_BYTES {
                return Err(protocol(format!("file larger than {MAX_FILE_BYTES} bytes")));
            }
            if chunk.eof {
                return Ok(out);
            }
        }
    }

    fn read_chunk(&mut self, path: &str, root: &str, offset: u64) -> Result<FileData, ClientError> {
        let req = pb::ReadFile {
            path: path.to_owned(),
            offset,
            length: MAX_FILE_CHUNK as u64,
            root: root.to_owned(),
            ..Default::default()
        };
        match self.call(request::Kind::ReadFile(req))? {
            response::Kind::FileData(data) if data.data.len() <= MAX_FILE_CHUNK => Ok(data),
            other => Err(protocol(format!("expected FileData, got {other:?}"))),
        }
    }

    /// Describes `path` (a symlink itself, not its target).
    fn stat(&mut self, path: &str) -> Result<FileStat, ClientError> {
        let req = pb::Stat {
            path: path.to_owned(),
            ..Default::default()
        };
        match self.call(request::Kind::Stat(req))? {
            response::Kind::FileStat(stat) => Ok(stat),
            other => Err(protocol(format!("expected FileStat, got {other:?}"))),
        }
    }

    /// Lists the directory `path`.
    fn list_dir(&mut self, path: &str) -> Result<pb::DirListing, ClientError> {
        let req = pb::ListDir {
            path: path.to_owned(),
            ..Default::default()
        };
        match self.call(request::Kind::ListDir(req))? {
            response::Kind::DirListing(listing) => Ok(listing),
            other => Err(protocol(format!("expected DirListing, got {other:?}"))),
        }
    }

    /// Creates the directory `path` (and its parents if `parents`), mode 0755.
    fn mkdir(&mut self, path: &str, parents: bool) -> Result<(), ClientError> {
        let req = pb::Mkdir {
            path: path.to_owned(),
            parents,
            ..Default::default()
        };
        expect_ok(self.call(request::Kind::Mkdir(req))?)
    }

    /// Removes `path` (a non-empty directory only if `recursive`).
    fn remove(&mut self, path: &str, recursive: bool) -> Result<(), ClientError> {
        let req = pb::Remove {
            path: path.to_owned(),
            recursive,
            ..Default::default()
        };
        expect_ok(self.call(request::Kind::Remove(req))?)
    }

    /// Sends `signal` to every process of execution `exec_id`.
    fn signal(&mut self, exec_id: u64, signal: i32) -> Result<(), ClientError> {
        let req = pb::Signal { exec_id, signal };
        expect_ok(self.call(request::Kind::Signal(req))?)
    }

    /// Writes `data` to the stdin of execution `exec_id` (closing it after if `eof`); returns
    /// once the agent has written it to the process's pipe.
    fn stdin(&mut self, exec_id: u64, data: &[u8], eof: bool) -> Result<(), ClientError> {
        let req = pb::Stdin {
            exec_id,
            data: data.to_vec(),
            eof,
        };
        expect_ok(self.call(request::Kind::Stdin(req))?)
    }

    /// Gives the VM its own identity after a snapshot restore: `entropy` (16..=512 random
    /// bytes) into the kernel's pool and a CRNG reseed, then the host name and the sandbox id
    /// (either may be empty: left as is). The answer says what the agent did (an agent in host
    /// mode never touches its machine's RNG or host name).
    fn reseed(
        &mut self,
        entropy: &[u8],
        hostname: &str,
        sandbox_id: &str,
    ) -> Result<Reseeded, ClientError> {
        self.reseed_with(pb::Reseed {
            entropy: entropy.to_vec(),
            hostname: hostname.to_owned(),
            sandbox_id: sandbox_id.to_owned(),
            disk_bytes: 0,
            mounts: Vec::new(),
            no_root: false,
            default_user: String::new(),
            workdir: String::new(),
        })
    }

    /// Gives a restored clone fresh host entropy ([`crate::identity`]), `sandbox_id` as its
    /// id and host name, and `disk_bytes` as the size of its /tmp (0: unchanged).
    fn reseed_clone(&mut self, sandbox_id: &str, disk_bytes: u64) -> Result<Reseeded, ClientError> {
        self.reseed_with(clone_identity(sandbox_id, disk_bytes)?)
    }

    /// The answer to a Reseed sent as request `id` (for example pipelined with the
    /// connection, see [`from_stream_pipelined`](Self::from_stream_pipelined)).
    fn reseeded(&mut self, id: u64) -> Result<Reseeded, ClientError> {
        match into_kind(self.recv_for(id)?)? {
            response::Kind::Reseeded(done) => Ok(done),
            other => Err(protocol(format!("expected Reseeded, got {other:?}"))),
        }
    }

    /// [`reseed`](Self::reseed) with every field of the request (for example the size limit
    /// of /tmp).
    fn reseed_with(&mut self, req: pb::Reseed) -> Result<Reseeded, ClientError> {
        match self.call(request::Kind::Reseed(req))? {
            response::Kind::Reseeded(done) => Ok(done),
            other => Err(protocol(format!("expected Reseeded, got {other:?}"))),
        }
    }

    /// Round trip; returns the guest's uptime in milliseconds.
    fn ping(&mut self) -> Result<pb::Pong, ClientError> {
        match self.call(request::Kind::Ping(pb::Ping {}))? {
            response::Kind::Pong(pong) => Ok(pong),
            other => Err(protocol(format!("expected Pong, got {other:?}"))),
        }
    }

    /// Asks the agent to power the VM off (in host mode: to exit); returns once it said Ok.
    fn power_off(&mut self) -> Result<(), ClientError> {
        expect_ok(self.call(request::Kind::PowerOff(pb::PowerOff {}))?)
    }
}

impl<R: Read, W: Write> Requests for AgentClient<R, W> {
    fn send_kind(&mut self, kind: request::Kind) -> Result<u64, ClientError> {
        AgentClient::send_kind(self, kind)
    }

    fn recv_for(&mut self, id: u64) -> Result<Response, ClientError> {
        AgentClient::recv_for(self, id)
    }
}

/// Reads and decodes one response frame (a listing's entries are counted before decoding).
pub(crate) fn read_response(reader: &mut impl Read) -> Result<Response, ClientError> {
    let body = read_frame_bytes(reader)?.ok_or(ClientError::Closed)?;
    // A malformed frame fails to decode below.
    let entries = count_field(&body, &[DIR_LISTING_FIELD, 1]).unwrap_or(0);
    if entries > MAX_DIR_ENTRIES {
        return Err(protocol(format!(
            "a directory listing of {entries} entries (at most {MAX_DIR_ENTRIES})"
        )));
    }
    Ok(Response::decode(body.as_slice()).map_err(FrameError::Decode)?)
}

/// Whether `resp` is the last answer to a request that expects `pending`.
pub(crate) fn is_last(resp: &Response, pending: Pending) -> bool {
    match (&resp.kind, pending) {
        (_, Pending::Single) => true,
        (Some(response::Kind::ExecExit(_) | response::Kind::Error(_)), Pending::Exec) => true,
        (_, Pending::Exec) => false,
    }
}

/// How an execution ended, in words (for logs and CLIs): `exit 3`, `signal 9`, or `unknown`.
pub fn describe_exit(exit: &ExecExit) -> String {
    let mut s = match exit.status {
        Some(exec_exit::Status::ExitCode(code)) => format!("exit {code}"),
        Some(exec_exit::Status::Signal(sig)) => format!("signal {sig}"),
        None => "unknown".to_owned(),
    };
    for (flag, word) in [
        (exit.timed_out, "timed out"),
        (exit.killed, "killed"),
        (exit.oom_killed, "out of memory"),
        (exit.output_truncated, "output truncated"),
        (
            exit.orphan_dropped_bytes > 0,
            "output dropped while unowned",
        ),
    ] {
        if flag {
            s.push_str(", ");
            s.push_str(word);
        }
    }
    s
}

/// Longest reply line of the `CONNECT` handshake.
const MAX_HANDSHAKE_LINE: usize = 64;

/// The hybrid-vsock handshake: `CONNECT <port>\n` out, `OK <host port>\n` back (nothing after
/// the line is consumed).
pub fn handshake(r: &mut impl Read, w: &mut impl Write, port: u32) -> Result<(), ClientError> {
    w.write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(|e| ClientError::Handshake(format!("sending CONNECT: {e}")))?;
    let line = read_line(r)?;
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(ClientError::Handshake(format!(
            "expected `OK <port>`, got {line:?}"
        )))
    }
}

/// Reads one `\n`-terminated line byte by byte, so nothing after it is consumed.
pub(crate) fn read_line(r: &mut impl Read) -> Result<String, ClientError> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_HANDSHAKE_LINE {
        match r.read(&mut byte) {
            Ok(0) => return Err(ClientError::Handshake("connection closed".into())),
            Ok(_) if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ClientError::Handshake(format!("reading reply: {e}"))),
        }
    }
    Err(ClientError::Handshake("reply line too long".into()))
}

#[cfg(test)]
mod tests;
