//! `airlock-vmm run`: boot, wait for the agent, run one command, stream its output, power off.
//!
//! The VM's event loop runs on the main thread as for `boot`; a client thread talks to the
//! agent through the VM's hybrid-vsock socket, sends the command's result back over a channel,
//! then asks the agent to power the guest off (and stops the VM itself if the guest does not).

use airlock_proto::Requests;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

use airlock_proto::AGENT_VSOCK_PORT;
use airlock_proto::client::describe_exit;
use airlock_proto::identity;
use airlock_proto::pb::{self, StreamKind, exec_exit};
use airlock_proto::vsock::{self, TimedClient, WaitError};
use vmm::config::{ConsoleOutput, VsockConfig};
use vmm::exit::code;
use vmm_sys_util::eventfd::EventFd;

use crate::cli::{self, RunOptions};

/// How long to wait for the agent when there is no boot deadline (`--boot-timeout 0`): in
/// effect for as long as the VM runs.
const NO_BOOT_DEADLINE: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long the guest may take to power off after the command before the VM is stopped.
const POWER_OFF_GRACE: Duration = Duration::from_secs(30);
/// Exit code when the command's timeout killed it (as coreutils `timeout`).
const TIMED_OUT: u8 = 124;

/// What the client thread reports.
enum Outcome {
    Finished(pb::ExecExit),
    Failed(String),
}

/// Removes the temporary directory (socket, console) on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir() -> std::io::Result<TempDir> {
    let dir = std::env::temp_dir().join(format!("airlock-vmm-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(TempDir(dir))
}

/// The temporary directory of one `run` or `snapshot`, with the console file (used unless
/// `--console` was given) and the vsock socket (a temporary one unless `--vsock` was given);
/// `None` (logged) if the directory cannot be created.
fn session_files(opts: &mut RunOptions) -> Option<(TempDir, PathBuf, PathBuf)> {
    let tmp = temp_dir()
        .map_err(|e| log::error!("create a temporary directory: {e}"))
        .ok()?;
    let console_path = tmp.0.join("console.log");
    if !opts.console_given {
        opts.vm.console = ConsoleOutput::File(console_path.clone());
    }
    let uds = match &opts.vm.vsock {
        Some(v) => v.uds_path.clone(),
        None => {
            let path = tmp.0.join("vsock.sock");
            opts.vm.vsock = Some(VsockConfig {
                guest_cid: 3,
                uds_path: path.clone(),
            });
            path
        }
    };
    Some((tmp, console_path, uds))
}

pub fn run(mut opts: RunOptions, started: Instant) -> ExitCode {
    let Some((_tmp, console_path, uds)) = session_files(&mut opts) else {
        return ExitCode::from(code::VMM_ERROR);
    };
    let built = match &opts.snapshot {
        None => vmm::build_microvm_for_boot(&opts.vm, started),
        Some(dir) => vmm::build_microvm_from_snapshot(
            &vmm::RestoreConfig {
                snapshot_dir: dir.clone(),
                vsock_uds: Some(uds.clone()),
                console: opts.vm.console.clone(),
                console_limit: opts.vm.console_limit,
                cpu_template: opts.vm.cpu_template,
                net_tap: opts.vm.net.as_ref().map(|n| n.tap.clone()),
                root_overlay: opts.vm.disks.first().and_then(|d| d.overlay.clone()),
                slot_media: Vec::new(),
            },
            started,
        ),
    };
    let vmm = match start(built, opts.control.as_deref()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let stop = match vmm.stop_handle() {
        Ok(s) => s,
        Err(e) => {
            log::error!("stop handle: {e}");
            return ExitCode::from(code::VMM_ERROR);
        }
    };
    let vm_gone = Arc::new(AtomicBool::new(false));
    let (tx, rx) = channel();
    let exec = build_exec(&opts);
    let connect_deadline = opts.vm.boot_timeout.map(|t| Instant::now() + t);
    let gone = vm_gone.clone();
    let reseed = opts.snapshot.is_some();
    let client = std::thread::Builder::new()
        .name("agent-client".into())
        .spawn(move || client_thread(&uds, exec, reseed, connect_deadline, &gone, &tx, &stop));
    if let Err(e) = client {
        log::error!("start the agent client thread: {e}");
        return ExitCode::from(code::VMM_ERROR);
    }
    let vm_exit = vmm.run();
    vm_gone.store(true, Ordering::Release);
    let outcome = rx.recv_timeout(Duration::from_secs(1)).ok();
    finish(vm_exit, outcome, &console_path, opts.console_given)
}

fn build_exec(opts: &RunOptions) -> pb::Exec {
    pb::Exec {
        command: Some(pb::exec::Command::Argv(pb::Argv {
            args: opts.argv.clone(),
        })),
        cwd: opts.cwd.clone(),
        user: opts.user.clone(),
        env: opts.env.iter().cloned().collect(),
        timeout_ms: opts.timeout.map_or(0, |t| t.as_millis() as u64),
        ..Default::default()
    }
}

fn client_thread(
    uds: &Path,
    exec: pb::Exec,
    reseed: bool,
    deadline: Option<Instant>,
    vm_gone: &AtomicBool,
    tx: &Sender<Outcome>,
    stop: &EventFd,
) {
    if let Err(e) = vmm::seccomp::apply(vmm::seccomp::ThreadClass::Client) {
        let _ = tx.send(Outcome::Failed(cli::error_chain(&e)));
        let _ = stop.write(1);
        return;
    }
    let mut client = match connect(uds, deadline, vm_gone) {
        Ok(c) => c,
        Err(e) => {
            let _ = tx.send(Outcome::Failed(e));
            let _ = stop.write(1);
            return;
        }
    };
    log::info!(
        "agent ready (boot {} ms); running the command",
        client.ready().boot_time_ms
    );
    if reseed && let Err(e) = give_identity(&mut client) {
        let _ = tx.send(Outcome::Failed(e));
        let _ = stop.write(1);
        return;
    }
    let result = client.exec_collect(exec, forward_output);
    let outcome = match result {
        Ok(exit) => Outcome::Finished(exit),
        Err(e) => Outcome::Failed(format!("command failed: {}", cli::error_chain(&e))),
    };
    let _ = tx.send(outcome);
    if let Err(e) = client.power_off() {
        log::warn!("power off through the agent: {e}; stopping the VM");
        let _ = stop.write(1);
        return;
    }
    // Closing our end lets the agent reset the VM at once (it waits for that, briefly).
    drop(client);
    std::thread::sleep(POWER_OFF_GRACE);
    if !vm_gone.load(Ordering::Acquire) {
        log::warn!("the guest did not power off within {POWER_OFF_GRACE:?}; stopping the VM");
        let _ = stop.write(1);
    }
}

/// A clone restored from a snapshot shares its RNG state and host name with every sibling:
/// give it fresh entropy from the host and its own sandbox id (`sb-` and 16 hex digits, also
/// its host name).
fn give_identity(client: &mut TimedClient) -> Result<(), String> {
    let id = identity::new_id("sb").map_err(|e| format!("host entropy: {e}"))?;
    let done = client
        .reseed_clone(&id, 0)
        .map_err(|e| format!("reseed the clone: {}", cli::error_chain(&e)))?;
    log::info!("clone identity: sandbox id {id} ({done:?})");
    Ok(())
}

/// A built VM made ready to run: build errors logged, SIGTERM/SIGINT stopping it cleanly, and
/// its control socket served if one was asked for. Every subcommand starts a VM this way.
pub fn start(
    built: Result<vmm::Vmm, vmm::BuildError>,
    control: Option<&Path>,
) -> Result<vmm::Vmm, ExitCode> {
    let vmm = built.map_err(|e| {
        log::error!("{}", cli::error_chain(&e));
        ExitCode::from(code::VMM_ERROR)
    })?;
    if let Err(e) = vmm.stop_on_termination_signals() {
        log::warn!("SIGTERM/SIGINT will kill the VM abruptly: {e}");
    }
    serve_control(&vmm, control)?;
    Ok(vmm)
}

/// Serves the control socket at `path`, if one was asked for.
pub fn serve_control(vmm: &vmm::Vmm, path: Option<&Path>) -> Result<(), ExitCode> {
    let Some(path) = path else { return Ok(()) };
    let served = vmm
        .control_handle()
        .and_then(|h| vmm::control::serve_control_socket(path, h));
    served.map_err(|e| {
        log::error!("control socket {}: {e}", path.display());
        ExitCode::from(code::VMM_ERROR)
    })
}

/// `airlock-vmm snapshot`: boot, wait for the agent, pause, write the snapshot, end the VM.
pub fn snapshot(opts: cli::SnapshotOptions, started: Instant) -> ExitCode {
    // Before the VM runs: once it does, this process creates no files.
    if let Err(e) = airlock_control::snapshot_dir::prepare(&opts.out, None) {
        log::error!("snapshot directory {}: {e}", opts.out.display());
        return ExitCode::from(code::VMM_ERROR);
    }
    let mut run = opts.run;
    let Some((_tmp, console_path, uds)) = session_files(&mut run) else {
        return ExitCode::from(code::VMM_ERROR);
    };
    let built = vmm::build_microvm_for_boot(&run.vm, started);
    let vmm = match start(built, run.control.as_deref()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let handle = match vmm.control_handle() {
        Ok(h) => h,
        Err(e) => {
            log::error!("control handle: {e}");
            return ExitCode::from(code::VMM_ERROR);
        }
    };
    let deadline = run.vm.boot_timeout.map(|t| Instant::now() + t);
    let vm_gone = Arc::new(AtomicBool::new(false));
    let gone = vm_gone.clone();
    let out = opts.out.clone();
    let (warmup, settle) = (opts.warmup.clone(), opts.settle);
    let taker = std::thread::Builder::new()
        .name("snapshot".into())
        .spawn(move || take_snapshot(&uds, &out, (warmup, settle), deadline, &gone, &handle));
    let taker = match taker {
        Ok(t) => t,
        Err(e) => {
            log::error!("start the snapshot thread: {e}");
            return ExitCode::from(code::VMM_ERROR);
        }
    };
    let vm_exit = vmm.run();
    vm_gone.store(true, Ordering::Release);
    let result = taker
        .join()
        .unwrap_or_else(|_| Err("the snapshot thread panicked".into()));
    match (result, vm_exit) {
        (Ok(summary), Ok(_)) => {
            // As a JSON value: its keys sorted, as they always were.
            match serde_json::to_value(&summary) {
                Ok(v) => println!("{v}"),
                Err(e) => log::warn!("the snapshot is written; its summary is not: {e}"),
            }
            ExitCode::from(code::OK)
        }
        (Err(e), exit) => {
            log::error!("snapshot failed: {e}");
            if let Ok(exit) = &exit {
                cli::log_vm_exit(exit);
            }
            if !run.console_given {
                show_console_tail(&console_path);
            }
            ExitCode::from(code::VMM_ERROR)
        }
        (Ok(_), Err(e)) => {
            log::error!("{}", cli::error_chain(&e));
            ExitCode::from(code::VMM_ERROR)
        }
    }
}

fn take_snapshot(
    uds: &Path,
    out: &Path,
    (warmup, settle): (Option<String>, Duration),
    deadline: Option<Instant>,
    vm_gone: &AtomicBool,
    handle: &vmm::control::ControlHandle,
) -> Result<airlock_control::SnapshotReply, String> {
    use airlock_control::Reply;
    use vmm::control::VmCommand;
    let result = (|| {
        vmm::seccomp::apply(vmm::seccomp::ThreadClass::Client).map_err(|e| cli::error_chain(&e))?;
        let mut client = connect(uds, deadline, vm_gone)?;
        log::info!(
            "agent ready (boot {} ms); taking the snapshot",
            client.ready().boot_time_ms
        );
        if let Some(cmd) = warmup {
            warm_up(&mut client, &cmd)?;
        }
        drop(client);
        // Clones redo whatever the guest still had pending: let it finish first.
        let settled = vmm::settle::wait_quiet(settle);
        log::info!(
            "guest {} after {} ms ({} ms of CPU meanwhile)",
            if settled.settled {
                "settled"
            } else {
                "still busy"
            },
            settled.waited_ms,
            settled.busy_ms
        );
        handle.call(VmCommand::Pause)?;
        match handle.call(VmCommand::Snapshot(out.to_path_buf()))? {
            Reply::Snapshot(summary) => Ok(airlock_control::SnapshotReply {
                settle: Some(settled),
                ..summary
            }),
            other => Err(format!("the VM answered the snapshot with {other:?}")),
        }
    })();
    if let Err(e) = handle.call(VmCommand::Stop) {
        log::debug!("stop after the snapshot: {e}");
    }
    result
}

/// How much of the warm-up's output (its end) a failure shows.
const WARMUP_OUTPUT_TAIL: usize = 2048;

/// Runs the warm-up command; a failure fails the snapshot, with the end of the command's
/// output (stdout and stderr as they came), so that a template build says why.
fn warm_up(client: &mut TimedClient, cmd: &str) -> Result<(), String> {
    let t = Instant::now();
    let exec = airlock_proto::pb::Exec {
        command: Some(airlock_proto::pb::exec::Command::Shell(cmd.to_owned())),
        cwd: "/".into(),
        ..Default::default()
    };
    let mut tail: Vec<u8> = Vec::new();
    let exit = client
        .exec_collect(exec, |_, data| {
            tail.extend_from_slice(data);
            let excess = tail.len().saturating_sub(WARMUP_OUTPUT_TAIL);
            tail.drain(..excess);
        })
        .map_err(|e| format!("warm-up: {}", cli::error_chain(&e)))?;
    match exit.status {
        Some(airlock_proto::pb::exec_exit::Status::ExitCode(0)) => {
            log::info!("warm-up done in {} ms: {cmd}", t.elapsed().as_millis());
            Ok(())
        }
        other => Err(format!(
            "warm-up {cmd:?} failed after {} ms: {other:?}; its output ends: {:?}",
            t.elapsed().as_millis(),
            String::from_utf8_lossy(&tail)
        )),
    }
}

/// Connects to the agent, retrying while the guest boots ([`vsock::wait_ready`]) until the boot
/// `deadline` (none: until the VM ends). The connection then has no deadline: the command's
/// output may take as long as the command does (`--timeout` is the agent's to enforce).
fn connect(
    uds: &Path,
    deadline: Option<Instant>,
    vm_gone: &AtomicBool,
) -> Result<TimedClient, String> {
    let deadline = deadline.unwrap_or_else(|| Instant::now() + NO_BOOT_DEADLINE);
    let gone = || {
        vm_gone
            .load(Ordering::Acquire)
            .then(|| "the VM ended before the agent answered".to_owned())
    };
    let client = vsock::wait_ready(uds, AGENT_VSOCK_PORT, deadline, gone).map_err(|e| match e {
        WaitError::Cancelled(why) => why,
        WaitError::Deadline { last } => {
            format!("the agent did not answer before the boot deadline (last attempt: {last})")
        }
        WaitError::Agent(e) => format!("connect to the agent: {}", cli::error_chain(&e)),
    })?;
    client.set_deadline(None);
    Ok(client)
}

fn forward_output(stream: StreamKind, data: &[u8]) {
    // Our own stdout/stderr going away must not abort the command in the guest.
    let _ = match stream {
        StreamKind::Stderr => {
            let mut e = std::io::stderr().lock();
            e.write_all(data).and_then(|()| e.flush())
        }
        _ => {
            let mut o = std::io::stdout().lock();
            o.write_all(data).and_then(|()| o.flush())
        }
    };
}

/// The process exit code for a finished command.
fn command_exit_code(exit: &pb::ExecExit) -> u8 {
    if exit.timed_out {
        return TIMED_OUT;
    }
    match exit.status {
        Some(exec_exit::Status::ExitCode(c)) => (c & 0xff) as u8,
        Some(exec_exit::Status::Signal(s)) => 128u8.wrapping_add((s & 0x7f) as u8),
        None => code::VMM_ERROR,
    }
}

fn finish(
    vm_exit: Result<vmm::VmExit, vmm::BuildError>,
    outcome: Option<Outcome>,
    console: &Path,
    console_given: bool,
) -> ExitCode {
    let vm_code = match &vm_exit {
        Ok(exit) => cli::log_vm_exit(exit),
        Err(e) => {
            log::error!("{}", cli::error_chain(e));
            code::VMM_ERROR
        }
    };
    match outcome {
        Some(Outcome::Finished(exit)) => {
            log::info!(
                "command ended: {} (wall {} ms, cpu {} ms)",
                describe_exit(&exit),
                exit.wall_us / 1000,
                (exit.cpu_user_us + exit.cpu_system_us) / 1000
            );
            ExitCode::from(command_exit_code(&exit))
        }
        other => {
            if let Some(Outcome::Failed(msg)) = other {
                log::error!("{msg}");
            }
            if !console_given {
                show_console_tail(console);
            }
            ExitCode::from(if vm_code == code::OK {
                code::VMM_ERROR
            } else {
                vm_code
            })
        }
    }
}

fn show_console_tail(console: &Path) {
    let Ok(text) = std::fs::read(console) else {
        return;
    };
    let tail = &text[text.len().saturating_sub(4096)..];
    eprintln!("--- guest console (last {} bytes) ---", tail.len());
    eprintln!("{}", String::from_utf8_lossy(tail));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        let with = |status| pb::ExecExit {
            status: Some(status),
            ..Default::default()
        };
        assert_eq!(command_exit_code(&with(exec_exit::Status::ExitCode(3))), 3);
        assert_eq!(command_exit_code(&with(exec_exit::Status::Signal(9))), 137);
        let mut t = with(exec_exit::Status::Signal(9));
        t.timed_out = true;
        assert_eq!(command_exit_code(&t), TIMED_OUT);
    }
}

/// The `client` seccomp filter against what the agent-client thread does with the shared
/// `airlock_proto` code (no VM: a fake agent on a Unix socket stands in for the guest).
#[cfg(test)]
mod client_filter_tests {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};

    use airlock_proto::frame::{read_frame, write_frame};
    use airlock_proto::pb::{Ready, Request, Reseeded, Response, request, response};

    use super::*;

    const CHILD_ENV: &str = "AIRLOCK_CLIENT_FILTER_CHILD";

    /// Reads the `CONNECT 52\n` line byte by byte.
    fn read_connect_line(s: &mut UnixStream) -> String {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        String::from_utf8(line).unwrap()
    }

    /// A guest agent: the first connection is reset (a guest that is not listening yet), the
    /// second answers the handshake, sends Ready and answers Reseed and PowerOff. Returns the
    /// Reseed it was sent.
    fn fake_agent(listener: &UnixListener) -> airlock_proto::pb::Reseed {
        drop(listener.accept().unwrap());
        let (mut s, _) = listener.accept().unwrap();
        assert_eq!(read_connect_line(&mut s), "CONNECT 52");
        s.write_all(b"OK 1024\n").unwrap();
        let ready = Response {
            id: 0,
            kind: Some(response::Kind::Ready(Ready {
                protocol_version: airlock_proto::PROTOCOL_VERSION,
                ..Default::default()
            })),
        };
        write_frame(&mut s, &ready).unwrap();
        let mut reseed = None;
        while let Some(req) = read_frame::<_, Request>(&mut s).unwrap() {
            let kind = match req.kind {
                Some(request::Kind::Reseed(r)) => {
                    reseed = Some(r);
                    response::Kind::Reseeded(Reseeded::default())
                }
                Some(request::Kind::PowerOff(_)) => response::Kind::Ok(airlock_proto::pb::Ok {}),
                other => panic!("unexpected request {other:?}"),
            };
            let answer = Response {
                id: req.id,
                kind: Some(kind),
            };
            write_frame(&mut s, &answer).unwrap();
        }
        reseed.expect("a Reseed")
    }

    /// Run in a child process by the test below: the client thread's steps under the `client`
    /// filter (a call outside it ends the process with the seccomp violation code).
    #[test]
    fn client_filter_child() {
        let Some(uds) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        vmm::seccomp::enable().unwrap();
        let uds = PathBuf::from(uds);
        std::thread::spawn(move || {
            vmm::seccomp::apply(vmm::seccomp::ThreadClass::Client).unwrap();
            let gone = AtomicBool::new(false);
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut client = connect(&uds, Some(deadline), &gone).unwrap();
            assert_eq!(client.reader().deadline(), None);
            give_identity(&mut client).unwrap();
            client.power_off().unwrap();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_client_filter_allows_connecting_and_reseeding_through_the_shared_code() {
        let dir =
            std::env::temp_dir().join(format!("airlock-client-filter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let uds = dir.join("vsock.sock");
        let listener = UnixListener::bind(&uds).unwrap();
        let agent = std::thread::spawn(move || fake_agent(&listener));
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "run::client_filter_tests::client_filter_child"])
            .args(["--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, &uds)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {stderr}", out.status.code());
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("1 passed"),
            "the child ran no test: {stdout}"
        );
        let reseed = agent.join().unwrap();
        assert!(
            identity::well_formed(&reseed.sandbox_id, "sb"),
            "{reseed:?}"
        );
        assert_eq!(reseed.hostname, reseed.sandbox_id);
        assert_eq!(reseed.entropy.len(), identity::CLONE_ENTROPY_BYTES);
        assert_eq!(reseed.disk_bytes, 0);
    }
}
