//! Controlling a running VM from other threads and other processes.
//!
//! Commands reach the VMM's event loop through a channel plus an eventfd that wakes it; the loop
//! carries them out between device events, so nothing else touches devices or guest memory while
//! a command runs (that is what makes a snapshot consistent). [`ControlHandle`] is the in-process
//! side; [`serve_control_socket`] puts it on a Unix socket with a line protocol, whose requests
//! ([`airlock_control::Request`]) and replies ([`airlock_control::Reply`]) are the contract
//! with `airlockd`, defined in the `airlock-control` crate:
//!
//! ```text
//! → pause\n              ← {"ok":true,"state":"paused"}\n
//! → resume\n             ← {"ok":true,"state":"running"}\n
//! → snapshot /some/dir\n ← {"ok":true,"memory_bytes_written":…,"snapshot_ms":…}\n  (paused VMs only)
//! → status\n             ← {"ok":true,"state":"running","vcpus":1,"mem_mib":256,…}\n
//! → stop\n               ← {"ok":true}\n  (the VM ends with exit code 0, "stopped")
//! → restore /some/dir\n  ← {"ok":true,"state":"running","running_after_us":…}\n  (pool processes only)
//! → probe open /etc/x\n  ← {"ok":true,"opened":false,"errno":2,…}\n  (only with --test-hooks)
//! ```
//!
//! One command per connection; a failure answers `{"ok":false,"error":"…"}`. Lines are at most
//! [`MAX_LINE`] bytes; a client that sends nothing within 10 s is dropped. The socket file is
//! created with mode 0600 (its directory is the access control).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

use airlock_control::{
    ControlError, Reply, Request, RestoreReply, StatusReply, VmState, reply_line,
};
use serde_json::Value;
use vmm_sys_util::eventfd::EventFd;

pub use airlock_control::MAX_LINE;

/// What a controller can ask of a VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmCommand {
    /// Park every vCPU outside `KVM_RUN`.
    Pause,
    /// Let paused vCPUs run again.
    Resume,
    /// Write a snapshot of the paused VM into the directory (prepared by the caller).
    Snapshot(PathBuf),
    /// Wait until the guest is quiet (see [`crate::settle`]), at most this long. Served on
    /// the caller's thread, never by the event loop (which keeps the devices going meanwhile).
    Settle(Duration),
    /// Report state and shape.
    Status,
    /// End the VM ([`crate::VmExit::Stopped`]).
    Stop,
    /// A test hook (only with `--test-hooks`; see [`crate::probe`]).
    Probe(crate::probe::Probe),
}

/// A command's answer: the typed reply (sent as a JSON object, see
/// [`airlock_control::reply_line`]), or an error message.
pub type CommandReply = Result<Reply, String>;

/// How long a controller waits for the event loop to answer.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// Sends commands to one VM's event loop, from any thread.
#[derive(Debug)]
pub struct ControlHandle {
    tx: Sender<(VmCommand, Sender<CommandReply>)>,
    wake: EventFd,
}

impl ControlHandle {
    /// Another handle on the same VM.
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            tx: self.tx.clone(),
            wake: self.wake.try_clone()?,
        })
    }

    /// Sends `cmd` and waits for the answer.
    pub fn call(&self, cmd: VmCommand) -> CommandReply {
        let (tx, rx) = channel();
        self.tx
            .send((cmd, tx))
            .map_err(|_| "the VM has ended".to_owned())?;
        self.wake
            .write(1)
            .map_err(|e| format!("wake the event loop: {e}"))?;
        match rx.recv_timeout(COMMAND_TIMEOUT) {
            Ok(reply) => reply,
            Err(_) => Err("the VM did not answer (it ended or is stuck)".to_owned()),
        }
    }
}

/// The event loop's side: the receiving end and the eventfd it watches.
#[derive(Debug)]
pub struct CommandQueue {
    pub rx: Receiver<(VmCommand, Sender<CommandReply>)>,
    pub wake: EventFd,
}

/// A connected pair.
pub fn command_channel() -> std::io::Result<(ControlHandle, CommandQueue)> {
    let (tx, rx) = channel();
    let wake = EventFd::new(libc::EFD_NONBLOCK)?;
    let handle = ControlHandle {
        tx,
        wake: wake.try_clone()?,
    };
    Ok((handle, CommandQueue { rx, wake }))
}

const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Parses one command line of the socket protocol for a running VM ([`Request::parse`]):
/// `probe` only with the test hooks on (otherwise it is an unknown command), and `restore`,
/// which only a pool process takes ([`next_restore_request`]), is refused.
pub fn parse_command(line: &str) -> Result<VmCommand, String> {
    match Request::parse(line)? {
        Request::Pause => Ok(VmCommand::Pause),
        Request::Resume => Ok(VmCommand::Resume),
        Request::Status => Ok(VmCommand::Status),
        Request::Stop => Ok(VmCommand::Stop),
        Request::Snapshot(dir) => Ok(VmCommand::Snapshot(dir)),
        Request::Settle(ms) => Ok(VmCommand::Settle(Duration::from_millis(ms))),
        Request::Probe(words) if crate::probe::enabled() => {
            crate::probe::parse(&words).map(VmCommand::Probe)
        }
        Request::Probe(_) => {
            Err("unknown command \"probe\" (pause, resume, snapshot DIR, status, stop)".into())
        }
        Request::Restore(_) => {
            Err("`restore DIR` is only for a pool process; this VM already runs".into())
        }
    }
}

fn serve_one(stream: UnixStream, handle: &ControlHandle) {
    let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut line = String::new();
    let read = BufReader::new(stream.take(MAX_LINE as u64 + 1)).read_line(&mut line);
    let reply = match read {
        Ok(_) if line.len() > MAX_LINE => Err(format!("command longer than {MAX_LINE} bytes")),
        Ok(0) => return,
        Ok(_) => parse_command(&line).and_then(|cmd| call_here_or_there(cmd, handle)),
        Err(e) => Err(format!("read the command: {e}")),
    };
    let mut w = write_half;
    let _ = w.write_all(reply_line(&reply).as_bytes());
}

/// Runs `cmd`: `settle` on this thread, everything else in the event loop.
pub fn call_here_or_there(cmd: VmCommand, handle: &ControlHandle) -> CommandReply {
    match cmd {
        VmCommand::Settle(max) => Ok(Reply::Settle(crate::settle::wait_quiet(max))),
        other => handle.call(other),
    }
}

/// Binds `path` (replacing a stale socket file) and serves commands on a `control-api`
/// thread, one connection at a time, until the VM ends.
pub fn serve_control_socket(path: &Path, handle: ControlHandle) -> std::io::Result<()> {
    serve_control_listener(bind_control_socket(path)?, handle)
}

/// Serves the control socket `listener` (see [`serve_control_socket`]) on its own thread.
pub fn serve_control_listener(
    listener: UnixListener,
    handle: ControlHandle,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("control-api".into())
        .spawn(move || {
            if let Err(e) = crate::seccomp::apply(crate::seccomp::ThreadClass::Api) {
                log::error!("control socket: {e}; not serving it");
                return;
            }
            serve_loop(&listener, &handle);
        })?;
    Ok(())
}

fn serve_loop(listener: &UnixListener, handle: &ControlHandle) {
    for stream in listener.incoming() {
        match stream {
            Ok(s) => serve_one(s, handle),
            Err(e) => log::warn!("control socket: accept: {e}"),
        }
    }
}

/// How a pool process's restore went, for the answer to `restore DIR`.
#[derive(Debug)]
pub enum RestoreOutcome {
    /// The clone runs: its control handle and the answer.
    Running(ControlHandle, RestoreReply),
    Failed(String),
}

/// A pool process's control socket, served on the control-api thread from the start (under
/// its seccomp filter): it answers `status` until `restore DIR` arrives, hands the directory
/// and the instant it was asked to the caller, answers the restore with the outcome the caller
/// sends back, then serves the usual commands.
#[derive(Debug)]
pub struct PoolControl {
    pub requests: Receiver<(PoolRestore, std::time::Instant)>,
    pub outcome: Sender<RestoreOutcome>,
    pub thread: std::thread::JoinHandle<()>,
}

/// Starts serving a pool process's control socket (see [`PoolControl`]).
pub fn serve_pool_control(listener: UnixListener, vcpus: usize) -> std::io::Result<PoolControl> {
    let (req_tx, requests) = channel();
    let (outcome, out_rx) = channel::<RestoreOutcome>();
    let thread = std::thread::Builder::new()
        .name("control-api".into())
        .spawn(move || {
            if let Err(e) = crate::seccomp::apply(crate::seccomp::ThreadClass::Api) {
                log::error!("control socket: {e}; not serving it");
                return;
            }
            let (requester, req) = next_restore_request(&listener, vcpus);
            if req_tx.send((req, std::time::Instant::now())).is_err() {
                return;
            }
            match out_rx.recv() {
                Ok(RestoreOutcome::Running(handle, restored)) => {
                    answer(requester, &Ok(Reply::Restore(restored)));
                    serve_loop(&listener, &handle);
                }
                Ok(RestoreOutcome::Failed(msg)) => answer(requester, &Err(msg)),
                Err(_) => answer(requester, &Err("the VMM ended during the restore".into())),
            }
        })?;
    Ok(PoolControl {
        requests,
        outcome,
        thread,
    })
}

/// Binds a control socket at `path` (mode 0600, replacing a stale socket file).
pub fn bind_control_socket(path: &Path) -> std::io::Result<UnixListener> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// A pool's `restore` request and the media of its disk slots (the descriptors sent with it,
/// in slot order, each with its mode).
#[derive(Debug)]
pub struct PoolRestore {
    pub request: airlock_control::RestoreRequest,
    pub media: Vec<Option<(std::fs::File, bool)>>,
}

/// Answers one command on the control socket of a pool process, which has no VM yet: `status`
/// says so, `restore DIR` is returned (with its connection, to answer once the VM runs, and
/// the descriptors that came with it), and anything else is refused.
pub fn next_restore_request(listener: &UnixListener, vcpus: usize) -> (UnixStream, PoolRestore) {
    loop {
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
        let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
        let Ok(mut w) = stream.try_clone() else {
            continue;
        };
        let reply: CommandReply = match read_line_with_fds(&stream) {
            Ok((line, fds)) => match Request::parse(&line) {
                Ok(Request::Restore(request)) => match slot_media(&request, fds) {
                    Ok(media) => return (w, PoolRestore { request, media }),
                    Err(e) => Err(e),
                },
                Ok(Request::Status) => Ok(Reply::Status(StatusReply {
                    state: VmState::Prepared,
                    vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
                    mem_mib: None,
                    cpu_template: None,
                    uptime_ms: None,
                    userspace_up: None,
                })),
                _ => Err(format!(
                    "no VM yet: this pool process takes `restore DIR` or `status`, not {:?}",
                    line.trim()
                )),
            },
            Err(e) => Err(e),
        };
        let _ = w.write_all(reply_line(&reply).as_bytes());
    }
}

/// The descriptors sent with a restore line, one per slot it gives media.
fn slot_media(
    req: &airlock_control::RestoreRequest,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<Vec<Option<(std::fs::File, bool)>>, String> {
    use airlock_control::SlotMode;
    if fds.len() != req.media_count() {
        return Err(format!(
            "the request names media for {} slots and came with {} descriptors",
            req.media_count(),
            fds.len()
        ));
    }
    let mut fds = fds.into_iter();
    Ok(req
        .slots
        .iter()
        .map(|mode| match mode {
            SlotMode::Empty => None,
            SlotMode::ReadWrite => fds.next().map(|f| (std::fs::File::from(f), false)),
            SlotMode::ReadOnly => fds.next().map(|f| (std::fs::File::from(f), true)),
        })
        .collect())
}

/// Reads one command line (at most [`MAX_LINE`] bytes) and the descriptors sent with it
/// (SCM_RIGHTS; at most [`airlock_control::request::MAX_SLOTS`] in each message, more are
/// closed by the kernel's truncation and the line refused).
fn read_line_with_fds(stream: &UnixStream) -> Result<(String, Vec<std::os::fd::OwnedFd>), String> {
    use std::os::fd::FromRawFd;
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let (mut line, mut fds) = (Vec::new(), Vec::new());
    let mut buf = [0u8; 512];
    while !line.contains(&b'\n') && line.len() <= MAX_LINE {
        let mut raw = [-1; airlock_control::request::MAX_SLOTS];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the one iovec points at `buf`, which is live and writable for the call, and
        // any bytes may be written into it.
        let got = unsafe { stream.recv_with_fds(&mut iov, &mut raw) };
        let (n, nfds) = got.map_err(|e| format!("read the command: {e}"))?;
        for fd in &raw[..nfds] {
            // SAFETY: recvmsg just installed these descriptors in this process; nothing else
            // owns them.
            fds.push(unsafe { std::os::fd::OwnedFd::from_raw_fd(*fd) });
        }
        if n == 0 {
            break;
        }
        line.extend_from_slice(&buf[..n]);
    }
    let end = line.iter().position(|b| *b == b'\n').unwrap_or(line.len());
    if end == 0 || end > MAX_LINE {
        return Err(format!("empty command or longer than {MAX_LINE} bytes"));
    }
    Ok((String::from_utf8_lossy(&line[..end]).into_owned(), fds))
}

/// Writes the answer to a `restore` request.
pub fn answer(mut stream: UnixStream, reply: &CommandReply) {
    let _ = stream.write_all(reply_line(reply).as_bytes());
}

/// Sends one command line to a control socket and returns the JSON answer, whatever it says
/// (for tools and tests; [`airlock_control::send_line`]).
pub fn send_command(path: &Path, line: &str) -> std::io::Result<Value> {
    let timeout = COMMAND_TIMEOUT + Duration::from_secs(5);
    let answer = airlock_control::send_line(path, line, timeout).map_err(|e| match e {
        ControlError::Io(e) => e,
        other => std::io::Error::other(other),
    })?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn commands_parse_and_garbage_is_refused() {
        assert_eq!(parse_command("pause\n"), Ok(VmCommand::Pause));
        assert_eq!(parse_command(" resume "), Ok(VmCommand::Resume));
        assert_eq!(
            parse_command("snapshot /tmp/a b"),
            Ok(VmCommand::Snapshot("/tmp/a b".into()))
        );
        assert!(parse_command("snapshot").is_err());
        assert!(parse_command("pause now").is_err());
        assert!(parse_command("").is_err());
        assert!(parse_command("rm -rf /").is_err());
        // Only a pool process restores.
        assert!(parse_command("restore /snap/dir").is_err());
        // The test hooks are off here: `probe` is unknown, as any other word.
        assert_eq!(
            parse_command("probe seccomp"),
            Err("unknown command \"probe\" (pause, resume, snapshot DIR, status, stop)".into())
        );
    }

    /// The typed replies go out as the JSON objects the VMM has always sent (keys sorted:
    /// serde_json's map), so clients that read them as JSON see no change.
    #[test]
    fn typed_replies_keep_the_wire_format() {
        let status = Reply::Status(StatusReply {
            state: VmState::Running,
            vcpus: 2,
            mem_mib: Some(256),
            cpu_template: Some("host".into()),
            uptime_ms: Some(1234),
            userspace_up: Some(true),
        });
        let snapshot = Reply::Snapshot(airlock_control::SnapshotReply {
            dir: "/s/d".into(),
            memory_bytes_written: 1 << 28,
            state_bytes: 4096,
            snapshot_ms: 12.5,
            memory_ms: 10.25,
            layer_bytes: 0,
            settle: None,
        });
        let cases: [(Reply, Value); 7] = [
            (
                Reply::State(airlock_control::StateReply {
                    state: VmState::Paused,
                }),
                json!({"state": "paused"}),
            ),
            (
                Reply::State(airlock_control::StateReply {
                    state: VmState::Running,
                }),
                json!({"state": "running"}),
            ),
            (
                status,
                json!({
                    "state": "running",
                    "vcpus": 2u8,
                    "mem_mib": 256u64,
                    "cpu_template": "host",
                    "uptime_ms": 1234u64,
                    "userspace_up": true,
                }),
            ),
            (
                Reply::Status(StatusReply {
                    state: VmState::Prepared,
                    vcpus: 2,
                    mem_mib: None,
                    cpu_template: None,
                    uptime_ms: None,
                    userspace_up: None,
                }),
                json!({"state": "prepared", "vcpus": 2usize}),
            ),
            (
                snapshot,
                json!({
                    "dir": "/s/d",
                    "memory_bytes_written": 1u64 << 28,
                    "state_bytes": 4096u64,
                    "snapshot_ms": 12.5,
                    "memory_ms": 10.25,
                    "layer_bytes": 0u64,
                }),
            ),
            (
                Reply::Restore(RestoreReply {
                    state: VmState::Running,
                    running_after_us: 812,
                }),
                json!({"state": "running", "running_after_us": 812u64}),
            ),
            (Reply::Stop(airlock_control::StopReply {}), json!({})),
        ];
        for (reply, mut before) in cases {
            if let Value::Object(m) = &mut before {
                m.insert("ok".into(), Value::Bool(true));
            }
            assert_eq!(reply_line(&Ok(reply)), format!("{before}\n"));
        }
        let probe = json!({"opened": false, "errno": 2, "error": "No such file"});
        assert_eq!(
            reply_line(&Ok(Reply::Probe(probe))),
            "{\"errno\":2,\"error\":\"No such file\",\"ok\":true,\"opened\":false}\n"
        );
        assert_eq!(
            reply_line(&Err("no".into())),
            "{\"error\":\"no\",\"ok\":false}\n"
        );
    }

    #[test]
    fn a_pool_process_answers_status_refuses_the_rest_and_returns_the_restore_request() {
        let path = std::env::temp_dir().join(format!("airlock-pool-{}.sock", std::process::id()));
        let listener = bind_control_socket(&path).unwrap();
        let client = {
            let path = path.clone();
            std::thread::spawn(move || {
                let status = send_command(&path, "status").unwrap();
                let bogus = send_command(&path, "pause").unwrap();
                let restored = send_command(&path, "restore /snap/dir").unwrap();
                (status, bogus, restored)
            })
        };
        let (stream, req) = next_restore_request(&listener, 2);
        assert_eq!(req.request.dir, PathBuf::from("/snap/dir"));
        assert_eq!(req.request.disk_quota_mib, None);
        assert!(req.media.is_empty());
        answer(
            stream,
            &Ok(Reply::Restore(RestoreReply {
                state: VmState::Running,
                running_after_us: 7,
            })),
        );
        let (status, bogus, restored) = client.join().unwrap();
        assert_eq!(status["state"], "prepared");
        assert_eq!(status["vcpus"], 2);
        assert_eq!(bogus["ok"], false);
        assert_eq!(restored["ok"], true);
        assert_eq!(restored["running_after_us"], 7);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_socket_answers_each_command_through_the_handle() {
        let (handle, queue) = command_channel().unwrap();
        let path = std::env::temp_dir().join(format!("airlock-ctl-{}.sock", std::process::id()));
        serve_control_socket(&path, handle).unwrap();
        // A fake event loop: answers Status, refuses the rest.
        let lp = std::thread::spawn(move || {
            for _ in 0..2 {
                let (cmd, reply) = queue.rx.recv().unwrap();
                let _ = queue.wake.read();
                let r = match cmd {
                    VmCommand::Status => Ok(Reply::State(airlock_control::StateReply {
                        state: VmState::Running,
                    })),
                    other => Err(format!("no {other:?}")),
                };
                reply.send(r).unwrap();
            }
        });
        let v = send_command(&path, "status").unwrap();
        assert_eq!(v["ok"], true);
        assert_eq!(v["state"], "running");
        let v = send_command(&path, "pause").unwrap();
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains("Pause"));
        let v = send_command(&path, "bogus").unwrap();
        assert_eq!(v["ok"], false);
        let long = "x".repeat(MAX_LINE + 10);
        let v = send_command(&path, &long).unwrap();
        assert!(v["error"].as_str().unwrap().contains("longer"));
        lp.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }
}
