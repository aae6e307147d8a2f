//! Test hooks (`airlock-vmm --test-hooks`): control-socket commands that make the VMM try what
//! a compromised VMM would try, so that tests can watch its confinement refuse it.
//!
//! - `probe open PATH`: open a file read-only (a host file outside the jail must not open);
//! - `probe kill PID SIG`: send a signal (another sandbox's VMM must be out of reach);
//! - `probe seccomp`: make a system call outside the main thread's filter (`socket(AF_INET)`:
//!   the filter allows only Unix sockets); the VMM must die with the violation exit code;
//! - `probe create PATH`: create a file from the event loop (a running VMM creates none, so
//!   that what it can write to disk stays bounded); it must die the same way.
//!
//! `open` and `kill` run on their own thread under the `probe` filter, which allows exactly
//! those calls, so what refuses them is the jail (mount namespace, pivot_root, uid, PID
//! namespace), not seccomp. `seccomp` and `create` run on the event-loop thread. Nothing here is reachable
//! without `--test-hooks`, which only tests pass.

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::mpsc::{Sender, channel};

use airlock_control::Reply;
use serde_json::json;

/// A probe's answer: what the control socket sends back (the control module's
/// `CommandReply`; the control module calls this one, so it is spelt out here).
pub type ProbeReply = Result<Reply, String>;

/// One probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    Open(PathBuf),
    Kill { pid: i32, signal: i32 },
    Seccomp,
    Create(PathBuf),
}

type Request = (Probe, Sender<ProbeReply>);

static PROBE_THREAD: OnceLock<Mutex<Sender<Request>>> = OnceLock::new();

/// Turns the hooks on: starts the probe thread (call it before the VM runs, so that the thread
/// does not inherit the main thread's filter).
pub fn enable() -> std::io::Result<()> {
    let (tx, rx) = channel::<Request>();
    std::thread::Builder::new()
        .name("probe".into())
        .spawn(move || {
            if let Err(e) = crate::seccomp::apply(crate::seccomp::ThreadClass::Probe) {
                log::error!("probe thread: {e}");
                return;
            }
            for (probe, reply) in rx {
                let _ = reply.send(run_here(&probe));
            }
        })?;
    let _ = PROBE_THREAD.set(Mutex::new(tx));
    Ok(())
}

/// Whether the hooks are on.
pub fn enabled() -> bool {
    PROBE_THREAD.get().is_some()
}

/// Parses the words after `probe`.
pub fn parse(arg: &str) -> Result<Probe, String> {
    let words: Vec<&str> = arg.split_whitespace().collect();
    match words.as_slice() {
        ["open", path] => Ok(Probe::Open(PathBuf::from(path))),
        ["kill", pid, sig] => match (pid.parse(), sig.parse()) {
            (Ok(pid), Ok(signal)) => Ok(Probe::Kill { pid, signal }),
            _ => Err("probe kill PID SIG: numbers".into()),
        },
        ["seccomp"] => Ok(Probe::Seccomp),
        ["create", path] => Ok(Probe::Create(PathBuf::from(path))),
        _ => Err("probe open PATH | probe kill PID SIG | probe seccomp | probe create PATH".into()),
    }
}

/// Runs `probe` (called by the event loop).
pub fn run(probe: Probe) -> ProbeReply {
    match probe {
        Probe::Seccomp => Ok(Reply::Probe(forbidden_call())),
        Probe::Create(path) => Ok(Reply::Probe(create_file(&path))),
        other => {
            let thread = PROBE_THREAD.get().ok_or("test hooks are off")?;
            let (tx, rx) = channel();
            thread
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send((other, tx))
                .map_err(|_| "the probe thread has ended".to_owned())?;
            rx.recv()
                .map_err(|_| "the probe thread did not answer".to_owned())?
        }
    }
}

fn run_here(probe: &Probe) -> ProbeReply {
    match probe {
        Probe::Open(path) => Ok(Reply::Probe(match std::fs::File::open(path) {
            Ok(_) => json!({"opened": true}),
            Err(e) => json!({"opened": false, "errno": e.raw_os_error(), "error": e.to_string()}),
        })),
        Probe::Kill { pid, signal } => {
            // SAFETY: kill(2) takes plain integers and touches no memory of ours.
            let rc = unsafe { libc::kill(*pid, *signal) };
            let err = std::io::Error::last_os_error();
            Ok(Reply::Probe(if rc == 0 {
                json!({"sent": true})
            } else {
                json!({"sent": false, "errno": err.raw_os_error(), "error": err.to_string()})
            }))
        }
        Probe::Seccomp | Probe::Create(_) => Err("this probe runs on the event loop".into()),
    }
}

/// Creates `path` on the calling thread (`openat` with `O_CREAT`, which the main thread's
/// filter refuses).
fn create_file(path: &std::path::Path) -> serde_json::Value {
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
    {
        Ok(_) => json!({"created": true, "seccomp": crate::seccomp::enabled()}),
        Err(e) => json!({"created": false, "errno": e.raw_os_error(), "error": e.to_string()}),
    }
}

/// `socket(AF_INET, SOCK_STREAM)` on the calling thread: outside the main thread's filter, so
/// with seccomp on the process ends here.
fn forbidden_call() -> serde_json::Value {
    // SAFETY: socket(2) takes integers; a descriptor it returns is closed right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
        unsafe { libc::close(fd) };
    }
    json!({"survived": true, "seccomp": crate::seccomp::enabled()})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_parse_and_garbage_is_refused() {
        assert_eq!(
            parse("open /etc/passwd"),
            Ok(Probe::Open("/etc/passwd".into()))
        );
        assert_eq!(parse("kill 1 0"), Ok(Probe::Kill { pid: 1, signal: 0 }));
        assert_eq!(parse("seccomp"), Ok(Probe::Seccomp));
        assert!(parse("kill x 0").is_err());
        assert!(parse("exec /bin/sh").is_err());
        assert!(parse("").is_err());
    }
}
