//! System tests of the guest agent in a real VM, through virtio-vsock:
//! - `airlock-vmm run` streams both output streams and exits with the command's status;
//! - one booted VM, driven with the real protocol client, runs Python, enforces a timeout on
//!   `sleep 600` and leaves no process behind, returns 10 MB of output intact, and reads back a
//!   written file byte for byte.
//!
//! Cold boots cost tens of seconds on the nested-KVM build machines, so every agent check
//! shares one VM. Timeouts are in minutes for the same reason.

use airlock_proto::Requests;
use std::process::Command;
use std::time::{Duration, Instant};

use airlock_system_tests::{
    Client, VmProcess, binary, exit_code, kernel, require_kvm, rootfs, sh, step,
};

#[test]
fn run_streams_stdout_and_stderr_and_exits_with_the_command_status() {
    require_kvm();
    let out = Command::new(binary("airlock-vmm"))
        .arg("run")
        .arg("--kernel")
        .arg(kernel())
        .arg("--rootfs")
        .arg(rootfs())
        .args(["--", "sh", "-c", "echo out; echo err >&2; exit 3"])
        .output()
        .expect("run airlock-vmm");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert_eq!(stdout, "out\n");
    assert!(stderr.lines().any(|l| l == "err"), "stderr: {stderr}");
}

/// Names (`comm`) of every process in the guest, listed with shell builtins only, after
/// running `before` in the same shell.
fn running_commands(c: &mut Client, before: &str) -> Vec<String> {
    let script = format!(
        "{before} for f in /proc/[0-9]*/comm; do read -r n < \"$f\" 2>/dev/null && echo \"$n\"; done"
    );
    let (out, _, exit) = sh(c, &script, Duration::from_secs(120));
    assert_eq!(exit_code(&exit), Some(0), "{exit:?}");
    String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Deterministic, incompressible-looking bytes (xorshift), so no test data file is needed.
fn pseudo_random(len: usize, mut seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.extend_from_slice(&seed.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[test]
fn agent_in_a_vm_runs_python_enforces_timeouts_and_moves_data_intact() {
    let mut t = Instant::now();
    let vm = VmProcess::boot("agent-vm", &["--mem-mib", "512"]);
    let mut c = vm.connect();
    step("boot to agent ready", &mut t);
    assert_eq!(c.ready().protocol_version, airlock_proto::PROTOCOL_VERSION);
    assert!(
        c.ready().capabilities.iter().any(|cap| cap == "cgroups"),
        "{:?}",
        c.ready()
    );

    // Python, the runtime most user code needs.
    let (out, err, exit) = sh(&mut c, "python3 -c 'print(6*7)'", Duration::from_secs(600));
    assert_eq!(
        exit_code(&exit),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&err)
    );
    assert_eq!(out, b"42\n");
    step("python", &mut t);

    // A timeout ends the whole tree at about the deadline and leaves nothing running.
    let started = Instant::now();
    let (_, _, exit) = sh(&mut c, "sleep 600 & sleep 600", Duration::from_secs(2));
    let took = started.elapsed();
    assert!(exit.timed_out, "{exit:?}");
    assert!(took < Duration::from_secs(30), "timeout took {took:?}");
    let left = running_commands(&mut c, "");
    assert!(
        !left.iter().any(|p| p == "sleep"),
        "sleep survived the timeout: {left:?}"
    );
    // The check sees a sleep that is running (so it can fail).
    let control = running_commands(&mut c, "sleep 30 &");
    assert!(control.iter().any(|p| p == "sleep"), "control: {control:?}");
    step("timeout", &mut t);

    // A file written in is read back byte for byte, and 10 MB of output arrive intact.
    let data = pseudo_random(10 << 20, 0x5eed);
    c.write_file("/tmp/ten-mb.bin", &data).expect("write file");
    step("write 10 MB", &mut t);
    assert!(
        c.read_file("/tmp/ten-mb.bin").expect("read file") == data,
        "file differs"
    );
    step("read 10 MB", &mut t);
    let (out, _, exit) = sh(&mut c, "cat /tmp/ten-mb.bin", Duration::ZERO);
    assert_eq!(exit_code(&exit), Some(0));
    assert_eq!(out.len(), data.len());
    assert!(out == data, "10 MB stdout differs from the file");
    step("cat 10 MB", &mut t);

    c.power_off().expect("power off");
}
