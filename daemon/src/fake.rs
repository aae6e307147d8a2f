//! Test doubles for the daemon's seams (unit tests only): a [`FakeLauncher`] whose "VMMs" are
//! threads of the test process, each serving the typed control protocol on its control socket
//! and a small agent behind a hybrid-vsock socket, with knobs for hostile guests (a stall
//! before Ready, a flood of directory entries). Real sockets, real frames, no KVM.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_control::{
    Reply, Request, RestoreReply, SnapshotReply, StateReply, StatusReply, VmState,
};
use airlock_proto::pb::{self, request, response};
use airlock_proto::{read_frame, write_frame};

use crate::jail::Launch;
use crate::vmm::{Kill, Launched, Launcher};

/// How the fake guests' agents behave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Guest {
    #[default]
    Normal,
    /// Connections get the handshake and then nothing: no Ready, ever.
    StallBeforeReady,
    /// A listing answers far more entries than the protocol allows.
    FloodListing,
    /// Template builds fail: the "VMM" logs a console line and exits with code 64 (a panic).
    FailBuilds,
    /// Template builds never end (until killed).
    HangBuilds,
}

/// One execution in a fake agent.
#[derive(Debug, Default)]
struct FakeExec {
    output: Vec<u8>,
    /// Set once it ended: the signal that ended it (0: exited).
    ended: Option<i32>,
}

/// A fake VM: its sockets, its agent's state, its end.
#[derive(Debug)]
pub struct FakeVm {
    pub pid: u32,
    control: PathBuf,
    vsock: PathBuf,
    dead: AtomicBool,
    state: Mutex<VmState>,
    execs: Mutex<HashMap<u64, FakeExec>>,
    exit: Mutex<Option<tokio::sync::oneshot::Sender<i32>>>,
    guest: Arc<Mutex<Guest>>,
}

impl FakeVm {
    /// Ends the VM as if its process exited with `raw` wait status.
    pub fn end(&self, raw: i32) {
        if self.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(tx) = self.exit.lock().unwrap().take() {
            let _ = tx.send(raw);
        }
        // Wake the accept loops.
        let _ = UnixStream::connect(&self.control);
        let _ = UnixStream::connect(&self.vsock);
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Starts an execution that runs until signalled (as a previous daemon's would be).
    pub fn start_exec(&self, id: u64, output: &[u8]) {
        self.execs.lock().unwrap().insert(
            id,
            FakeExec {
                output: output.to_vec(),
                ended: None,
            },
        );
    }
}

#[derive(Debug)]
struct FakeKill(Arc<FakeVm>);

impl Kill for FakeKill {
    fn kill(&self) {
        self.0.end(libc::SIGKILL);
    }
}

/// Starts fake VMMs.
#[derive(Debug, Default)]
pub struct FakeLauncher {
    pub vms: Mutex<HashMap<u32, Arc<FakeVm>>>,
    next_pid: AtomicU32,
    pub guest: Arc<Mutex<Guest>>,
}

fn arg_after(args: &[OsString], flag: &str) -> Option<PathBuf> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(PathBuf::from)
}

impl FakeLauncher {
    pub fn set_guest(&self, g: Guest) {
        *self.guest.lock().unwrap() = g;
    }

    /// A fake VM that runs as if a previous daemon had started it and restored a guest.
    pub fn running_vm(&self, run_dir: &Path) -> Arc<FakeVm> {
        std::fs::create_dir_all(run_dir).unwrap();
        let vm = self.new_vm(run_dir.join("control.sock"), run_dir.join("vsock.sock"));
        *vm.state.lock().unwrap() = VmState::Running;
        vm
    }

    fn new_vm(&self, control: PathBuf, vsock: PathBuf) -> Arc<FakeVm> {
        let pid = 4_000_000_000 + self.next_pid.fetch_add(1, Ordering::SeqCst);
        let (tx, _rx) = tokio::sync::oneshot::channel();
        let vm = Arc::new(FakeVm {
            pid,
            control,
            vsock,
            dead: AtomicBool::new(false),
            state: Mutex::new(VmState::Prepared),
            execs: Mutex::new(HashMap::new()),
            exit: Mutex::new(Some(tx)),
            guest: self.guest.clone(),
        });
        let control = UnixListener::bind(&vm.control).unwrap();
        let vsock = UnixListener::bind(&vm.vsock).unwrap();
        let v = vm.clone();
        std::thread::spawn(move || serve_control(&v, &control));
        let v = vm.clone();
        std::thread::spawn(move || serve_vsock(&v, &vsock));
        self.vms.lock().unwrap().insert(pid, vm.clone());
        vm
    }

    fn launched(vm: &Arc<FakeVm>) -> Launched {
        let (tx, rx) = tokio::sync::oneshot::channel::<i32>();
        if vm.is_dead() {
            let _ = tx.send(libc::SIGKILL);
        } else {
            *vm.exit.lock().unwrap() = Some(tx);
        }
        Launched {
            pid: vm.pid,
            start_ticks: 0,
            uid: None,
            handle: Arc::new(FakeKill(vm.clone())),
            exits: None,
            exit: Box::pin(async move {
                let raw = rx.await.unwrap_or(libc::SIGKILL);
                Ok(Some(ExitStatus::from_raw(raw)))
            }),
        }
    }
}

impl Launcher for FakeLauncher {
    fn launch(&self, launch: Launch) -> std::io::Result<Launched> {
        if let Some(out) = arg_after(&launch.args, "--out") {
            // A template build: a snapshot appears and the "VMM" exits cleanly, or it fails
            // with the guest's console in its log.
            let guest = *self.guest.lock().unwrap();
            if guest == Guest::HangBuilds {
                return Ok(hanging_build(
                    4_100_000_000 + self.next_pid.fetch_add(1, Ordering::SeqCst),
                ));
            }
            let fails = guest == Guest::FailBuilds;
            let code = if fails {
                let mut log = &launch.stderr;
                writeln!(log, "console: the guest said something secret")?;
                64
            } else {
                std::fs::create_dir_all(&out)?;
                std::fs::write(out.join("memory"), b"memory")?;
                std::fs::write(out.join("state"), b"state")?;
                0
            };
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let _ = tx.send(());
            return Ok(Launched {
                pid: 4_100_000_000 + self.next_pid.fetch_add(1, Ordering::SeqCst),
                start_ticks: 0,
                uid: None,
                handle: Arc::new(NoKill),
                exits: None,
                exit: Box::pin(async move {
                    let _ = rx.await;
                    Ok(Some(ExitStatus::from_raw(code << 8)))
                }),
            });
        }
        let control = arg_after(&launch.args, "--control").unwrap();
        let vsock = arg_after(&launch.args, "--vsock").unwrap();
        let vm = self.new_vm(control, vsock);
        Ok(Self::launched(&vm))
    }

    fn adopt(&self, pid: u32, _: u64, _: Option<u32>) -> std::io::Result<Option<Launched>> {
        let vm = self.vms.lock().unwrap().get(&pid).cloned();
        Ok(vm.filter(|v| !v.is_dead()).map(|v| Self::launched(&v)))
    }

    fn binary(&self) -> &Path {
        Path::new("/fake/airlock-vmm")
    }

    fn vmm_flags(&self) -> Vec<OsString> {
        Vec::new()
    }

    fn uids_in_use(&self) -> usize {
        0
    }

    fn skip_uids_in_use(&self) {}

    fn jailed(&self) -> bool {
        false
    }
}

/// A build "VMM" that runs until it is killed (then exits by SIGKILL).
fn hanging_build(pid: u32) -> Launched {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    Launched {
        pid,
        start_ticks: 0,
        uid: None,
        handle: Arc::new(KillOnce(Mutex::new(Some(tx)))),
        exits: None,
        exit: Box::pin(async move {
            let _ = rx.await;
            Ok(Some(ExitStatus::from_raw(libc::SIGKILL)))
        }),
    }
}

#[derive(Debug)]
struct KillOnce(Mutex<Option<tokio::sync::oneshot::Sender<()>>>);

impl Kill for KillOnce {
    fn kill(&self) {
        if let Some(tx) = self.0.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Debug)]
struct NoKill;

impl Kill for NoKill {
    fn kill(&self) {}
}

fn serve_control(vm: &Arc<FakeVm>, listener: &UnixListener) {
    for s in listener.incoming() {
        if vm.is_dead() {
            return;
        }
        let Ok(s) = s else { continue };
        let mut line = String::new();
        let Ok(mut w) = s.try_clone() else { continue };
        let _ = BufReader::new(s).read_line(&mut line);
        let reply = control_reply(vm, &line);
        let _ = w.write_all(airlock_control::reply_line(&reply).as_bytes());
        if line.trim() == "stop" {
            vm.end(0);
        }
    }
}

fn control_reply(vm: &FakeVm, line: &str) -> Result<Reply, String> {
    let mut state = vm.state.lock().unwrap();
    match Request::parse(line)? {
        Request::Status => Ok(Reply::Status(StatusReply {
            state: *state,
            vcpus: 1,
            mem_mib: None,
            cpu_template: None,
            uptime_ms: None,
            userspace_up: None,
        })),
        Request::Restore(_) if *state == VmState::Prepared => {
            *state = VmState::Running;
            Ok(Reply::Restore(RestoreReply {
                state: VmState::Running,
                running_after_us: 500,
            }))
        }
        Request::Pause => {
            *state = VmState::Paused;
            Ok(Reply::State(StateReply { state: *state }))
        }
        Request::Resume => {
            *state = VmState::Running;
            Ok(Reply::State(StateReply { state: *state }))
        }
        Request::Snapshot(dir) if *state == VmState::Paused => {
            // Like a real VMM: only into the files its caller prepared.
            let prepared = |name| {
                airlock_control::snapshot_dir::open_prepared(&dir, name).map_err(|e| e.to_string())
            };
            prepared("memory")?
                .write_all(b"m")
                .map_err(|e| e.to_string())?;
            prepared("state.tmp")?
                .write_all(b"s")
                .map_err(|e| e.to_string())?;
            std::fs::rename(dir.join("state.tmp"), dir.join("state")).map_err(|e| e.to_string())?;
            Ok(Reply::Snapshot(SnapshotReply {
                dir: dir.display().to_string(),
                memory_bytes_written: 1,
                state_bytes: 1,
                snapshot_ms: 1.0,
                memory_ms: 1.0,
                layer_bytes: 0,
                settle: None,
            }))
        }
        Request::Settle(_) => Ok(Reply::Settle(airlock_control::SettleReply {
            settled: true,
            waited_ms: 0.0,
            busy_ms: 0.0,
        })),
        Request::Stop => Ok(Reply::Stop(Default::default())),
        other => Err(format!("the fake VM does not take {other} now")),
    }
}

fn serve_vsock(vm: &Arc<FakeVm>, listener: &UnixListener) {
    for s in listener.incoming() {
        if vm.is_dead() {
            return;
        }
        let Ok(s) = s else { continue };
        let v = vm.clone();
        std::thread::spawn(move || {
            let _ = serve_agent(&v, s);
        });
    }
}

type Writer = Arc<Mutex<UnixStream>>;

fn send(w: &Writer, id: u64, kind: response::Kind) -> std::io::Result<()> {
    let resp = pb::Response {
        id,
        kind: Some(kind),
    };
    write_frame(&mut *w.lock().unwrap(), &resp).map_err(std::io::Error::other)
}

fn serve_agent(vm: &Arc<FakeVm>, s: UnixStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    if line.trim() == "CONNECT 49999" {
        return serve_interpreter(reader, s);
    }
    let w: Writer = Arc::new(Mutex::new(s));
    w.lock().unwrap().write_all(b"OK 1073741824\n")?;
    let guest = *vm.guest.lock().unwrap();
    if guest == Guest::StallBeforeReady || vm.is_dead() {
        while !vm.is_dead() {
            std::thread::sleep(Duration::from_millis(20));
        }
        return Ok(());
    }
    let ready = pb::Ready {
        protocol_version: airlock_proto::PROTOCOL_VERSION,
        ..Default::default()
    };
    send(&w, 0, response::Kind::Ready(ready))?;
    while let Ok(Some(req)) = read_frame::<_, pb::Request>(&mut reader) {
        if vm.is_dead() {
            return Ok(());
        }
        answer(vm, &w, req.id, req.kind, guest)?;
    }
    Ok(())
}

/// A code interpreter on guest port 49999 (one HTTP/1.1 request a connection): `POST
/// /execute` prints the cell's code and answers `2`, `GET /contexts` lists none.
fn serve_interpreter(mut reader: BufReader<UnixStream>, mut s: UnixStream) -> std::io::Result<()> {
    use std::io::Read as _;
    s.write_all(b"OK 1073741824\n")?;
    let (mut head, mut line) = (String::new(), String::new());
    while reader.read_line(&mut line)? > 2 {
        head.push_str(&line);
        line.clear();
    }
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(str::to_owned)
        })
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body)?;
    let answer = if head.starts_with("POST /execute ") {
        let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let lines = [
            serde_json::json!({"type": "stdout", "text": req["code"], "timestamp": 1}),
            serde_json::json!({"type": "result", "text": "2", "is_main_result": true}),
            serde_json::json!({"type": "number_of_executions", "execution_count": 1}),
            serde_json::json!({"type": "end_of_execution"}),
        ];
        lines.iter().map(|l| format!("{l}\n")).collect::<String>()
    } else {
        "[]".to_owned()
    };
    write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    )
}

fn answer(
    vm: &Arc<FakeVm>,
    w: &Writer,
    id: u64,
    kind: Option<request::Kind>,
    guest: Guest,
) -> std::io::Result<()> {
    let ok = response::Kind::Ok(pb::Ok {});
    match kind {
        Some(request::Kind::Reseed(_)) => {
            send(w, id, response::Kind::Reseeded(pb::Reseeded::default()))
        }
        Some(request::Kind::WriteFile(_) | request::Kind::Mkdir(_)) => send(w, id, ok),
        Some(request::Kind::ListDir(_)) => {
            let n = if guest == Guest::FloodListing {
                20_000
            } else {
                1
            };
            let listing = pb::DirListing {
                entries: vec![pb::FileStat::default(); n],
                truncated: false,
            };
            send(w, id, response::Kind::DirListing(listing))
        }
        Some(request::Kind::Exec(e)) => {
            let argv = match e.command {
                Some(pb::exec::Command::Argv(a)) => a.args,
                _ => vec![],
            };
            let exec_id = u64::from(vm.pid) * 1000 + id;
            let sleeps = argv.first().is_some_and(|a| a == "sleep");
            let out = match (argv.first().map(String::as_str), argv.get(1)) {
                (Some("sleep"), _) => Vec::new(),
                // `big N`: N bytes of output.
                (Some("big"), Some(n)) => vec![b'x'; n.parse().unwrap_or(0)],
                _ => argv.join(" ").into_bytes(),
            };
            vm.start_exec(exec_id, &out);
            let started = pb::ExecStarted { exec_id, pid: 2 };
            send(w, id, response::Kind::ExecStarted(started))?;
            follow(vm.clone(), w.clone(), id, exec_id, 0, !sleeps);
            Ok(())
        }
        Some(request::Kind::Attach(a)) => {
            let attached = pb::Attached {
                exec_id: a.exec_id,
                stdout_offset: a.stdout_offset,
                ..Default::default()
            };
            send(w, id, response::Kind::Attached(attached))?;
            follow(vm.clone(), w.clone(), id, a.exec_id, a.stdout_offset, false);
            Ok(())
        }
        Some(request::Kind::Signal(sig)) => {
            if let Some(e) = vm.execs.lock().unwrap().get_mut(&sig.exec_id) {
                e.ended.get_or_insert(sig.signal);
            }
            send(w, id, ok)
        }
        _ => send(w, id, ok),
    }
}

/// Sends an execution's output from `offset` and, once it ends (at once when `exit`), its exit.
fn follow(vm: Arc<FakeVm>, w: Writer, id: u64, exec_id: u64, offset: u64, exit: bool) {
    std::thread::spawn(move || {
        let (data, _) = {
            let execs = vm.execs.lock().unwrap();
            let e = &execs[&exec_id];
            (
                e.output.get(offset as usize..).unwrap_or_default().to_vec(),
                (),
            )
        };
        if !data.is_empty() {
            let out = pb::Output {
                exec_id,
                stream: pb::StreamKind::Stdout as i32,
                offset,
                data,
            };
            if send(&w, id, response::Kind::Output(out)).is_err() {
                return;
            }
        }
        let signal = loop {
            if exit {
                break 0;
            }
            if let Some(sig) = vm.execs.lock().unwrap()[&exec_id].ended {
                break sig;
            }
            if vm.is_dead() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let status = if signal == 0 {
            pb::exec_exit::Status::ExitCode(0)
        } else {
            pb::exec_exit::Status::Signal(signal)
        };
        let stdout_bytes = vm.execs.lock().unwrap()[&exec_id].output.len() as u64;
        let exit = pb::ExecExit {
            exec_id,
            status: Some(status),
            killed: signal != 0,
            stdout_bytes,
            ..Default::default()
        };
        let _ = send(&w, id, response::Kind::ExecExit(exit));
    });
}
