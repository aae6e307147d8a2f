//! Shared helpers for the system tests: where the built artifacts are, and how to run the VMM.
//!
//! A system test never skips: when KVM, the guest kernel, the base image or the binaries are
//! missing it fails and names the command that provides them (`./tests/run.sh` does it all).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, StreamKind, exec_exit};
use airlock_proto::{AGENT_VSOCK_PORT, AgentClient, ClientError, Requests};

pub mod harness;
pub mod interp;
pub mod limits;
pub mod shared;

/// The one command that builds every artifact and runs every test.
pub const RUN_ALL: &str = "./tests/run.sh";

fn artifact(var: &str, script: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "{var} is not set: build the artifact with `{script}` (its last output line is the \
             path) and export {var}=<that path>, or run everything with `{RUN_ALL}`"
        )
    });
    assert!(
        path.is_file(),
        "{var}={} does not exist: rebuild it with `{script}` or run `{RUN_ALL}`",
        path.display()
    );
    path
}

/// The guest kernel (`vmlinux`) built by `kernel-config/build.sh`.
pub fn kernel() -> PathBuf {
    artifact("AIRLOCK_KERNEL", "kernel-config/build.sh")
}

/// The base image built by `rootfs/build.sh`.
pub fn rootfs() -> PathBuf {
    artifact("AIRLOCK_ROOTFS", "rootfs/build.sh")
}

/// The code-interpreter image built by `rootfs/build.sh code-interpreter`.
pub fn interpreter_rootfs() -> PathBuf {
    artifact(
        "AIRLOCK_INTERPRETER_ROOTFS",
        "rootfs/build.sh code-interpreter",
    )
}

/// Fails loudly when `/dev/kvm` is unusable.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        panic!("the system tests need read/write access to /dev/kvm: {e}");
    }
}

/// A workspace binary: `$AIRLOCK_BIN_DIR/NAME`, else in the running executable's profile
/// directory (`target/<profile>/NAME`), where `cargo test --workspace` builds it (a test runs
/// from `target/<profile>/deps/`, a binary of this crate from the profile directory itself).
pub fn binary(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("AIRLOCK_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    let exe = std::env::current_exe().expect("current test executable");
    let dir = exe.parent().expect("target/<profile>/deps/<test>");
    let profile_dir = if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("target/<profile>/deps/<test>")
    } else {
        dir
    };
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo build -p airlock-vmm` (or run `{RUN_ALL}`)",
        path.display()
    );
    path
}

/// A child process that is killed if the test panics before it exits.
#[derive(Debug)]
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    /// Spawns `cmd`.
    pub fn spawn(cmd: &mut Command) -> Self {
        Self(Some(cmd.spawn().expect("spawn child process")))
    }

    /// Waits for the child and returns its exit status.
    pub fn wait(mut self) -> std::process::ExitStatus {
        let mut child = self.0.take().expect("child already waited for");
        child.wait().expect("wait for child")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A temporary directory removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Creates a fresh directory tagged `tag`.
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let p = std::env::temp_dir().join(format!("airlock-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How long a cold boot may take to reach the agent (guest kernels are emulated on the
/// nested-KVM build machines: tens of seconds).
pub const BOOT_DEADLINE: Duration = Duration::from_secs(300);
/// How long one agent answer may take.
pub const READ_TIMEOUT: Duration = Duration::from_secs(300);

/// The agent protocol client over the VM's hybrid-vsock socket.
pub type Client = AgentClient<UnixStream, UnixStream>;

/// One `airlock-vmm` process with a vsock device and a control socket, in its own temporary
/// directory (`vsock.sock`, `control.sock`, `console.txt`, `vmm.log`); killed on drop.
#[derive(Debug)]
pub struct VmProcess {
    child: ChildGuard,
    pub dir: TempDir,
}

impl VmProcess {
    /// `airlock-vmm boot` of the built kernel and base image with `extra` options.
    pub fn boot(tag: &str, extra: &[&str]) -> Self {
        require_kvm();
        let dir = TempDir::new(tag);
        let mut cmd = Command::new(binary("airlock-vmm"));
        cmd.arg("boot")
            .arg("--kernel")
            .arg(kernel())
            .arg("--rootfs")
            .arg(rootfs())
            .args(extra);
        Self::spawn(cmd, dir)
    }

    /// `airlock-vmm restore` of the snapshot in `snapshot`.
    pub fn restore(tag: &str, snapshot: &Path) -> Self {
        require_kvm();
        let dir = TempDir::new(tag);
        let mut cmd = Command::new(binary("airlock-vmm"));
        cmd.arg("restore").arg("--snapshot").arg(snapshot);
        Self::spawn(cmd, dir)
    }

    fn spawn(mut cmd: Command, dir: TempDir) -> Self {
        cmd.arg("--vsock")
            .arg(dir.0.join("vsock.sock"))
            .arg("--control")
            .arg(dir.0.join("control.sock"))
            .arg("--console")
            .arg(dir.0.join("console.txt"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.0.join("vmm.log")).expect("log file"));
        Self {
            child: ChildGuard::spawn(&mut cmd),
            dir,
        }
    }

    /// The guest console and the VMM's log, for failure messages.
    pub fn diagnostics(&self) -> String {
        let read = |f: &str| std::fs::read_to_string(self.dir.0.join(f)).unwrap_or_default();
        let console = read("console.txt");
        let tail = &console[console.len().saturating_sub(4000)..];
        format!(
            "--- console (tail) ---\n{tail}\n--- vmm ---\n{}",
            read("vmm.log")
        )
    }

    /// Connects to the agent, retrying while the guest is not listening yet.
    pub fn connect(&self) -> Client {
        let deadline = Instant::now() + BOOT_DEADLINE;
        let sock = self.dir.0.join("vsock.sock");
        loop {
            match AgentClient::connect_vsock(&sock, AGENT_VSOCK_PORT) {
                Ok(c) => {
                    c.reader()
                        .set_read_timeout(Some(READ_TIMEOUT))
                        .expect("read timeout");
                    return c;
                }
                Err(ClientError::Handshake(_) | ClientError::Connect { .. })
                    if Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("agent did not answer: {e}\n{}", self.diagnostics()),
            }
        }
    }

    /// Sends one command to the VMM's control socket and returns its JSON answer as text;
    /// panics unless the answer says `"ok":true`.
    pub fn control(&self, command: &str) -> String {
        let path = self.dir.0.join("control.sock");
        let answer = control_command(&path, command)
            .unwrap_or_else(|e| panic!("control {command}: {e}\n{}", self.diagnostics()));
        assert!(
            answer.contains("\"ok\":true"),
            "control {command}: {answer}\n{}",
            self.diagnostics()
        );
        answer
    }

    /// Waits for the VMM to exit.
    pub fn wait(self) -> std::process::ExitStatus {
        self.child.wait()
    }
}

/// Sends one command line to a VMM control socket and returns the answer line (empty if the
/// VMM closed the connection without answering).
pub fn control_command(path: &Path, command: &str) -> std::io::Result<String> {
    let mut s = UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(180)))?;
    s.write_all(format!("{command}\n").as_bytes())?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(line)
}

/// Runs the shell snippet `shell` to its end and returns (stdout, stderr, exit).
pub fn sh(c: &mut Client, shell: &str, timeout: Duration) -> (Vec<u8>, Vec<u8>, pb::ExecExit) {
    let exec = pb::Exec {
        command: Some(pb::exec::Command::Shell(shell.to_owned())),
        timeout_ms: timeout.as_millis() as u64,
        ..Default::default()
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let exit = c
        .exec_collect(exec, |s, d| match s {
            StreamKind::Stderr => err.extend_from_slice(d),
            _ => out.extend_from_slice(d),
        })
        .unwrap_or_else(|e| panic!("exec {shell:?}: {e}"));
    (out, err, exit)
}

/// The exit code, if the process exited (rather than being ended by a signal).
pub fn exit_code(exit: &pb::ExecExit) -> Option<i32> {
    match exit.status {
        Some(exec_exit::Status::ExitCode(c)) => Some(c),
        _ => None,
    }
}

/// Prints how long a step took (guest-side steps are slow on nested KVM; this shows where).
pub fn step(name: &str, t: &mut Instant) {
    eprintln!("step {name}: {:.1} s", t.elapsed().as_secs_f64());
    *t = Instant::now();
}
