//! Shared helpers for the system tests: where the built artifacts are, and how to run the VMM.
//!
//! A system test never skips: when KVM, the guest kernel, the base image or the binaries are
//! missing it fails and names the command that provides them (`./tests/run.sh` does it all).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

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

/// A workspace binary: `$AIRLOCK_BIN_DIR/NAME`, else next to the test executable's profile
/// directory (`target/<profile>/NAME`), where `cargo test --workspace` builds it.
pub fn binary(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("AIRLOCK_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    let exe = std::env::current_exe().expect("current test executable");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
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
