//! `airlock-agent`: PID 1 inside every Airlock microVM.
//!
//! Today it is the base image's init: it mounts the kernel filesystems, prints the stable
//! readiness line [`READY_LINE`] on the console and ends the VM. The guest-agent issue grows it
//! into the vsock agent that runs user code; the readiness line stays the same.
//!
//! Every system call costs real time on the nested-KVM build machines (the guest kernel is
//! emulated), so the start-up path does as few as it can.
#![deny(unsafe_code)]

mod sys;

use std::io::Write;

/// Printed on the console once userspace is up; tests and benchmarks wait for it.
pub const READY_LINE: &str = "airlock: userspace up";

fn main() {
    for m in sys::BASE_MOUNTS {
        if let Err(e) = sys::mount_fs(m) {
            // Not fatal: a missing /sys must not stop the agent from reporting.
            eprintln!("airlock-agent: mount {} on {}: {e}", m.fstype, m.target);
        }
    }
    let mut out = std::io::stdout().lock();
    // One write for the whole line so that it reaches the console in one piece.
    let _ = out.write_all(format!("{READY_LINE}\n").as_bytes());
    let _ = out.flush();
    // After the readiness line, so it costs the boot nothing: which CPUs the kernel brought up.
    if let Ok(cpus) = std::fs::read_to_string("/sys/devices/system/cpu/online") {
        let _ = out.write_all(format!("airlock: cpus online {}\n", cpus.trim()).as_bytes());
        let _ = out.flush();
    }
    drop(out);
    sys::sync();
    match sys::reboot() {
        Ok(()) => {}
        Err(e) => eprintln!("airlock-agent: reboot: {e}"),
    }
    // PID 1 must never exit: that panics the kernel. Park until the VM is torn down.
    loop {
        sys::pause();
    }
}
