//! Controlling a running VM from other threads and other processes.
//!
//! Commands reach the VMM's event loop through a channel plus an eventfd that wakes it; the loop
//! carries them out between device events, so nothing else touches devices or guest memory while
//! a command runs (that is what makes a snapshot consistent). [`ControlHandle`] is the in-process
//! side; [`serve_control_socket`] puts it on a Unix socket with a line protocol:
//!
//! ```text
//! → pause\n              ← {"ok":true,"state":"paused"}\n
//! → resume\n             ← {"ok":true,"state":"running"}\n
//! → snapshot /some/dir\n ← {"ok":true,"memory_bytes_written":…,"snapshot_ms":…}\n  (paused VMs only)
//! → status\n             ← {"ok":true,"state":"running","vcpus":1,"mem_mib":256,…}\n
//! → stop\n               ← {"ok":true}\n  (the VM ends with exit code 0, "stopped")
//! → probe open /etc/x\n  ← {"ok":true,"opened":false,"errno":2,…}\n  (only with --test-hooks)
//! ```
//!
//! One command per connection; a failure answers `{"ok":false,"error":"…"}`. Lines are at most
//! 4 KiB; a client that sends nothing within 10 s is dropped. The socket file is created with
//! mode 0600 (its directory is the access control).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

use serde_json::{Value, json};
use vmm_sys_util::eventfd::EventFd;

/// What a controller can ask of a VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmCommand {
    /// Park every vCPU outside `KVM_RUN`.
    Pause,
    /// Let paused vCPUs run again.
    Resume,
    /// Write a snapshot of the paused VM into the directory (created if missing).
    Snapshot(PathBuf),
    /// Report state and shape.
    Status,
    /// End the VM ([`crate::VmExit::Stopped`]).
    Stop,
    /// A test hook (only with `--test-hooks`; see [`crate::probe`]).
    Probe(crate::probe::Probe),
}

/// A command's answer: a JSON object of results, or an error message.
pub type CommandReply = Result<Value, String>;

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

/// Longest command line accepted on the control socket.
pub const MAX_LINE: usize = 4096;
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Parses one command line of the socket protocol.
pub fn parse_command(line: &str) -> Result<VmCommand, String> {
    let line = line.trim();
    let (word, arg) = line.split_once(' ').unwrap_or((line, ""));
    let arg = arg.trim();
    match (word, arg.is_empty()) {
        ("pause", true) => Ok(VmCommand::Pause),
        ("resume", true) => Ok(VmCommand::Resume),
        ("status", true) => Ok(VmCommand::Status),
        ("stop", true) => Ok(VmCommand::Stop),
        ("snapshot", false) => Ok(VmCommand::Snapshot(PathBuf::from(arg))),
        ("snapshot", true) => Err("snapshot needs a directory".into()),
        ("probe", _) if crate::probe::enabled() => crate::probe::parse(arg).map(VmCommand::Probe),
        ("", _) => Err("empty command".into()),
        (w, _) => Err(format!(
            "unknown command {w:?} (pause, resume, snapshot DIR, status, stop)"
        )),
    }
}

fn reply_line(reply: &CommandReply) -> String {
    let v = match reply {
        Ok(Value::Object(map)) => {
            let mut m = map.clone();
            m.insert("ok".into(), Value::Bool(true));
            Value::Object(m)
        }
        Ok(other) => json!({"ok": true, "result": other}),
        Err(e) => json!({"ok": false, "error": e}),
    };
    format!("{v}\n")
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
        Ok(_) => parse_command(&line).and_then(|cmd| handle.call(cmd)),
        Err(e) => Err(format!("read the command: {e}")),
    };
    let mut w = write_half;
    let _ = w.write_all(reply_line(&reply).as_bytes());
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
    /// The clone runs: its control handle and the answer's fields.
    Running(ControlHandle, Value),
    Failed(String),
}

/// A pool process's control socket, served on the control-api thread from the start (under
/// its seccomp filter): it answers `status` until `restore DIR` arrives, hands the directory
/// and the instant it was asked to the caller, answers the restore with the outcome the caller
/// sends back, then serves the usual commands.
#[derive(Debug)]
pub struct PoolControl {
    pub requests: Receiver<(PathBuf, std::time::Instant)>,
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
            let (requester, dir) = next_restore_request(&listener, vcpus);
            if req_tx.send((dir, std::time::Instant::now())).is_err() {
                return;
            }
            match out_rx.recv() {
                Ok(RestoreOutcome::Running(handle, answer_fields)) => {
                    answer(requester, &Ok(answer_fields));
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

/// Answers one command on the control socket of a pool process, which has no VM yet: `status`
/// says so, `restore DIR` is returned (with its connection, to answer once the VM runs), and
/// anything else is refused.
pub fn next_restore_request(listener: &UnixListener, vcpus: usize) -> (UnixStream, PathBuf) {
    loop {
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
        let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
        let Ok(mut w) = stream.try_clone() else {
            continue;
        };
        let mut line = String::new();
        let read = BufReader::new(stream.take(MAX_LINE as u64 + 1)).read_line(&mut line);
        let reply: CommandReply = match read {
            Ok(n) if n > 0 && line.len() <= MAX_LINE => {
                let line = line.trim();
                match line.split_once(' ') {
                    Some(("restore", dir)) if !dir.trim().is_empty() => {
                        return (w, PathBuf::from(dir.trim()));
                    }
                    _ if line == "status" => Ok(json!({"state": "prepared", "vcpus": vcpus})),
                    _ => Err(format!(
                        "no VM yet: this pool process takes `restore DIR` or `status`, not {line:?}"
                    )),
                }
            }
            Ok(_) => Err(format!("empty command or longer than {MAX_LINE} bytes")),
            Err(e) => Err(format!("read the command: {e}")),
        };
        let _ = w.write_all(reply_line(&reply).as_bytes());
    }
}

/// Writes the answer to a `restore` request.
pub fn answer(mut stream: UnixStream, reply: &CommandReply) {
    let _ = stream.write_all(reply_line(reply).as_bytes());
}

/// Sends one command line to a control socket and returns the JSON answer (for tools and
/// tests).
pub fn send_command(path: &Path, line: &str) -> std::io::Result<Value> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(COMMAND_TIMEOUT + Duration::from_secs(5)))?;
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
    BufReader::new(s.take(1 << 20)).read_line(&mut answer)?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (stream, dir) = next_restore_request(&listener, 2);
        assert_eq!(dir, PathBuf::from("/snap/dir"));
        answer(stream, &Ok(json!({"state": "running"})));
        let (status, bogus, restored) = client.join().unwrap();
        assert_eq!(status["state"], "prepared");
        assert_eq!(status["vcpus"], 2);
        assert_eq!(bogus["ok"], false);
        assert_eq!(restored["ok"], true);
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
                    VmCommand::Status => Ok(json!({"state": "running"})),
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
