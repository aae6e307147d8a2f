//! KVM micro tests through the whole boot path of the `airlock-vmm` binary, with tiny 64-bit
//! ELF "kernels": a clean power-off, the readiness line, and each guest fault ending the VM with
//! its documented exit code.
#![allow(clippy::unwrap_used, reason = "tests")]

mod common;

use std::process::{Command, Output};

use common::TempDir;
use vmm::exit::code;

/// Boots `code` as the kernel (with an empty root disk) and returns the process output.
fn boot(tag: &str, code: &[u8], extra: &[&str]) -> (Output, String) {
    common::require_kvm();
    let dir = TempDir::new(tag);
    let kernel = common::write_temp(&dir.0, "kernel.elf", &common::elf64(code));
    let rootfs = common::write_temp(&dir.0, "root.img", &[0u8; 4096]);
    let console = dir.0.join("console.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_airlock-vmm"))
        .arg("boot")
        .arg("--kernel")
        .arg(&kernel)
        .arg("--rootfs")
        .arg(&rootfs)
        .arg("--console")
        .arg(&console)
        .args(extra)
        .output()
        .unwrap();
    let console = std::fs::read_to_string(&console).unwrap_or_default();
    (out, console)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn guest_reset_ends_the_vm_cleanly_with_console_output() {
    let (out, console) = boot(
        "reset",
        &common::print_and_reset(b"hello from the guest\n"),
        &[],
    );
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::OK)),
        "{}",
        stderr(&out)
    );
    assert_eq!(console, "hello from the guest\n");
}

#[test]
fn readiness_line_is_detected_and_timed() {
    let (out, _) = boot(
        "ready",
        &common::print_and_reset(b"airlock: userspace up\n"),
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("guest reached userspace after"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn two_vcpus_boot_and_the_boot_vcpu_ends_the_vm() {
    let (out, console) = boot(
        "smp",
        &common::print_and_reset(b"smp ok\n"),
        &["--vcpus", "2", "--mem-mib", "128"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(console, "smp ok\n");
}

#[test]
fn guest_panic_line_gives_the_panic_exit_code() {
    let msg = b"Kernel panic - not syncing: Attempted to kill init!\n";
    let (out, _) = boot("panic", &common::print_and_reset(msg), &[]);
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::GUEST_PANIC)),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("guest kernel panic"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn triple_fault_gives_its_exit_code_and_the_rip() {
    let (out, _) = boot("triple", common::TRIPLE_FAULT, &[]);
    let code_seen = out.status.code();
    // On the nested paravirtual KVM the emulator may report an internal error instead of the
    // shutdown exit; both are guest faults with their own documented codes and the RIP.
    let err = stderr(&out);
    assert!(
        code_seen == Some(i32::from(code::TRIPLE_FAULT))
            || code_seen == Some(i32::from(code::INTERNAL_ERROR)),
        "exit {code_seen:?}: {err}"
    );
    assert!(err.contains("rip=0x100000"), "{err}");
}

#[test]
fn guest_that_never_reaches_userspace_hits_the_boot_deadline() {
    let (out, _) = boot("deadline", common::SPIN, &["--boot-timeout", "1"]);
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::BOOT_TIMEOUT)),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("did not reach userspace"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_arguments_are_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_airlock-vmm"))
        .args(["boot", "--vcpus", "0", "--kernel", "k", "--rootfs", "r"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(i32::from(code::USAGE)));
    assert!(stderr(&out).contains("vcpus"), "{}", stderr(&out));
}

#[test]
fn missing_kernel_is_a_vmm_error_not_a_crash() {
    let dir = TempDir::new("nokernel");
    let rootfs = common::write_temp(&dir.0, "root.img", &[0u8; 4096]);
    let out = Command::new(env!("CARGO_BIN_EXE_airlock-vmm"))
        .args(["boot", "--kernel", "/nonexistent/vmlinux", "--rootfs"])
        .arg(&rootfs)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::VMM_ERROR)),
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("/nonexistent/vmlinux"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn garbage_kernel_image_is_a_vmm_error() {
    let dir = TempDir::new("garbage");
    let kernel = common::write_temp(&dir.0, "kernel", b"definitely not an ELF file");
    let rootfs = common::write_temp(&dir.0, "root.img", &[0u8; 4096]);
    let out = Command::new(env!("CARGO_BIN_EXE_airlock-vmm"))
        .arg("boot")
        .arg("--kernel")
        .arg(&kernel)
        .arg("--rootfs")
        .arg(&rootfs)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::VMM_ERROR)),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("load kernel"), "{}", stderr(&out));
}

/// Boots a spinning guest with a control socket and the test hooks, sends `probe seccomp`
/// (a system call outside the event loop's filter) and returns the process's output and the
/// probe's answer (none if the VMM died first).
fn probe_seccomp(tag: &str, extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    let dir = TempDir::new(tag);
    probe_vmm(&dir, "probe seccomp", extra)
}

/// Boots a spinning guest in `dir` with a control socket and the test hooks, sends `probe`
/// and returns the process's output and the probe's answer (none if the VMM died first).
///
/// The guest spins with no boot deadline, so nothing but this function ends the VMM: it sends
/// `stop` after an answer, and a VMM still running [`VMM_DEADLINE`] after the probe is killed
/// (the test then fails, saying so) instead of leaving the test waiting for ever.
fn probe_vmm(dir: &TempDir, probe: &str, extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    common::require_kvm();
    let kernel = common::write_temp(&dir.0, "kernel.elf", &common::elf64(common::SPIN));
    let rootfs = common::write_temp(&dir.0, "root.img", &[0u8; 4096]);
    let control = dir.0.join("control.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_airlock-vmm"))
        .arg("boot")
        .arg("--kernel")
        .arg(&kernel)
        .arg("--rootfs")
        .arg(&rootfs)
        .args([
            "--boot-timeout",
            "0",
            "--console",
            "/dev/null",
            "--test-hooks",
        ])
        .arg("--control")
        .arg(&control)
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let answer = send_when_listening(&control, probe);
    if answer.is_some() {
        let _ = vmm::control::send_command(&control, "stop");
    }
    let (out, killed) = wait_or_kill(child, VMM_DEADLINE);
    assert!(
        !killed,
        "the VMM was still running {VMM_DEADLINE:?} after `{probe}` (answer: {answer:?}) and was \
         killed; stderr:\n{}",
        stderr(&out)
    );
    (out, answer)
}

/// How long a probed VMM may run on after its probe before it is killed.
const VMM_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// Sends `line` on the control socket at `path` once the VMM listens there: the socket file
/// exists a moment before `listen(2)`, and a connection in between is refused, so a refused or
/// missing socket is tried again for up to 30 s. Any other failure (the VMM died on the
/// command) is no answer.
fn send_when_listening(path: &std::path::Path, line: &str) -> Option<serde_json::Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match vmm::control::send_command(path, line) {
            Ok(answer) => return Some(answer),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(_) => return None,
        }
    }
}

/// Waits for `child` to end, killing it if it still runs after `deadline`; its output and
/// whether it had to be killed. Its pipes are read meanwhile, so that a chatty process cannot
/// block on a full pipe.
fn wait_or_kill(mut child: std::process::Child, deadline: std::time::Duration) -> (Output, bool) {
    use std::io::Read;
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        })
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let end = std::time::Instant::now() + deadline;
    let mut killed = false;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() >= end {
            // Not yet reaped (try_wait said it runs), so the kill reaches this process.
            child.kill().unwrap();
            killed = true;
            break child.wait().unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    };
    (out, killed)
}

#[test]
fn a_system_call_outside_the_event_loops_filter_ends_the_vmm_with_the_seccomp_code() {
    let (out, answer) = probe_seccomp("seccomp", &[]);
    assert_eq!(answer, None, "the VMM answered the forbidden call");
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::SECCOMP_VIOLATION)),
        "{}",
        stderr(&out)
    );
    let socket = libc::SYS_socket.to_string();
    assert!(
        stderr(&out).contains(&format!("system call {socket} on a vmm thread")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn without_seccomp_the_same_call_is_made_and_the_vmm_lives_on() {
    let (out, answer) = probe_seccomp("noseccomp", &["--no-seccomp"]);
    let answer = answer.expect("an answer");
    assert_eq!(answer["survived"], true, "{answer}");
    assert_eq!(answer["seccomp"], false, "{answer}");
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::OK)),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_running_vmm_that_creates_a_file_is_ended_with_the_seccomp_code() {
    let dir = TempDir::new("create");
    let target = dir.0.join("planted");
    let (out, answer) = probe_vmm(&dir, &format!("probe create {}", target.display()), &[]);
    assert_eq!(answer, None, "the VMM answered: it created a file");
    assert!(!target.exists(), "the file was created");
    assert_eq!(
        out.status.code(),
        Some(i32::from(code::SECCOMP_VIOLATION)),
        "{}",
        stderr(&out)
    );
    let openat = libc::SYS_openat.to_string();
    assert!(
        stderr(&out).contains(&format!("system call {openat} on a vmm thread")),
        "{}",
        stderr(&out)
    );
    // The probe itself works: without seccomp the file is made.
    let dir = TempDir::new("create-noseccomp");
    let target = dir.0.join("planted");
    let probe = format!("probe create {}", target.display());
    let (_, answer) = probe_vmm(&dir, &probe, &["--no-seccomp"]);
    assert_eq!(answer.expect("an answer")["created"], true);
    assert!(target.exists());
}

#[test]
fn probes_are_refused_without_the_test_hooks_flag() {
    assert!(vmm::control::parse_command("probe seccomp").is_err());
}
