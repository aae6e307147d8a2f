//! System test: the real guest kernel and base image boot to the agent's readiness line under
//! `airlock-vmm boot`, with one and with two vCPUs, and the VM exits cleanly when init powers off.
//!
//! Each boot takes tens of seconds on the nested-KVM build machines (guest kernel code is
//! emulated there); the deadline below is generous for that reason.

use std::process::{Command, Stdio};

use airlock_system_tests::{ChildGuard, TempDir, binary, kernel, require_kvm, rootfs};

const READY: &str = "airlock: userspace up";
/// Seconds the VMM gives the guest to reach userspace before it ends the VM (exit code 68).
const BOOT_DEADLINE_S: &str = "240";

fn boot_to_userspace(vcpus: u8) {
    require_kvm();
    let (kernel, rootfs) = (kernel(), rootfs());
    let dir = TempDir::new(&format!("boot{vcpus}"));
    let console = dir.0.join("console.txt");
    let log = dir.0.join("vmm.log");
    let child = ChildGuard::spawn(
        Command::new(binary("airlock-vmm"))
            .arg("boot")
            .arg("--kernel")
            .arg(&kernel)
            .arg("--rootfs")
            .arg(&rootfs)
            .args(["--vcpus", &vcpus.to_string(), "--mem-mib", "256"])
            .args(["--boot-timeout", BOOT_DEADLINE_S])
            .arg("--console")
            .arg(&console)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("create log")),
    );
    let status = child.wait();
    let console = std::fs::read_to_string(&console).unwrap_or_default();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        status.code(),
        Some(0),
        "VM with {vcpus} vCPU(s) did not power off cleanly\n--- console ---\n{console}\n--- vmm ---\n{log}"
    );
    assert!(
        console.lines().any(|l| l.trim_end() == READY),
        "console lacks `{READY}`\n--- console ---\n{console}\n--- vmm ---\n{log}"
    );
    assert!(log.contains("guest reached userspace after"), "{log}");
    let expected_cpus = if vcpus == 1 {
        "0".to_string()
    } else {
        format!("0-{}", vcpus - 1)
    };
    assert!(
        console
            .lines()
            .any(|l| l.trim_end() == format!("airlock: cpus online {expected_cpus}")),
        "the guest did not bring up {vcpus} vCPU(s)\n--- console ---\n{console}"
    );
}

#[test]
fn boots_to_userspace_with_one_vcpu() {
    boot_to_userspace(1);
}

#[test]
fn boots_to_userspace_with_two_vcpus() {
    boot_to_userspace(2);
}
