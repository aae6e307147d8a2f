//! How a VM ended, and the process exit code that says so.
//!
//! The exit codes and what each means are part of the contract with `airlockd` and are defined
//! in [`airlock_control::exit`] (the table is there); [`code`] re-exports them, and
//! [`VmExit::exit_code`] picks one for each way a VM ends. A seccomp violation (see
//! [`crate::seccomp`]) ends the process with [`code::SECCOMP_VIOLATION`].

use std::fmt;
use std::time::Duration;

/// Exit codes of `airlock-vmm` (defined in [`airlock_control::exit`]).
pub mod code {
    pub use airlock_control::exit::{
        BOOT_TIMEOUT, FAIL_ENTRY, GUEST_PANIC, INTERNAL_ERROR, OK, SECCOMP_VIOLATION, TRIPLE_FAULT,
        USAGE, VCPU_ERROR, VMM_ERROR,
    };
}

/// Why a VM stopped. Guest faults are results, not VMM errors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmExit {
    /// The guest reset itself through the i8042 controller: its way of powering off.
    GuestReset,
    /// The host asked the VMM to stop the VM (see `Vmm::stop_handle`).
    Stopped,
    /// The guest kernel printed a panic.
    GuestPanic,
    /// A triple fault on `cpu`.
    TripleFault { cpu: u8, rip: u64 },
    /// `KVM_EXIT_INTERNAL_ERROR` on `cpu`, with the faulting RIP and the bytes found there.
    InternalError {
        cpu: u8,
        suberror: u32,
        rip: u64,
        insn: Vec<u8>,
        data: Vec<u64>,
    },
    /// `KVM_EXIT_FAIL_ENTRY` on `cpu`.
    FailEntry { cpu: u8, reason: u64 },
    /// No `airlock: userspace up` within the deadline.
    BootTimeout { after: Duration },
    /// `KVM_RUN` failed or returned an exit this VMM does not handle.
    VcpuError { cpu: u8, detail: String },
}

impl VmExit {
    /// The process exit code (see [`airlock_control::exit`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            VmExit::GuestReset | VmExit::Stopped => code::OK,
            VmExit::GuestPanic => code::GUEST_PANIC,
            VmExit::TripleFault { .. } => code::TRIPLE_FAULT,
            VmExit::InternalError { .. } => code::INTERNAL_ERROR,
            VmExit::FailEntry { .. } => code::FAIL_ENTRY,
            VmExit::BootTimeout { .. } => code::BOOT_TIMEOUT,
            VmExit::VcpuError { .. } => code::VCPU_ERROR,
        }
    }

    /// Whether this is the guest's own, orderly end.
    pub fn is_clean(&self) -> bool {
        matches!(self, VmExit::GuestReset | VmExit::Stopped)
    }
}

fn hex_bytes(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl fmt::Display for VmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmExit::GuestReset => write!(f, "guest powered off (reset)"),
            VmExit::Stopped => write!(f, "stopped by the host"),
            VmExit::GuestPanic => write!(f, "guest kernel panic"),
            VmExit::TripleFault { cpu, rip } => {
                write!(f, "triple fault on vcpu{cpu} at rip={rip:#x}")
            }
            VmExit::InternalError {
                cpu,
                suberror,
                rip,
                insn,
                data,
            } => write!(
                f,
                "KVM internal error (suberror {suberror}) on vcpu{cpu} at rip={rip:#x}, \
                 instruction bytes [{}], data {data:x?}",
                hex_bytes(insn)
            ),
            VmExit::FailEntry { cpu, reason } => {
                write!(
                    f,
                    "KVM entry failure on vcpu{cpu}, hardware reason {reason:#x}"
                )
            }
            VmExit::BootTimeout { after } => {
                write!(
                    f,
                    "guest did not reach userspace within {:.1} s",
                    after.as_secs_f64()
                )
            }
            VmExit::VcpuError { cpu, detail } => write!(f, "vcpu{cpu} failed: {detail}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_guest_fault_has_a_distinct_nonzero_code() {
        let exits = [
            VmExit::GuestPanic,
            VmExit::TripleFault { cpu: 0, rip: 0 },
            VmExit::InternalError {
                cpu: 0,
                suberror: 1,
                rip: 0,
                insn: vec![],
                data: vec![],
            },
            VmExit::FailEntry { cpu: 0, reason: 0 },
            VmExit::BootTimeout {
                after: Duration::from_secs(1),
            },
            VmExit::VcpuError {
                cpu: 0,
                detail: String::new(),
            },
        ];
        let mut codes: Vec<u8> = exits.iter().map(VmExit::exit_code).collect();
        // The daemon reads each of them as the guest's crash.
        for c in &codes {
            assert!(airlock_control::exit::VmmExit::from_code(i32::from(*c)).is_guest_crash());
        }
        assert!(
            codes
                .iter()
                .all(|c| *c != code::OK && *c != code::VMM_ERROR && *c != code::USAGE)
        );
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), exits.len());
        assert_eq!(VmExit::GuestReset.exit_code(), 0);
    }

    #[test]
    fn internal_error_message_shows_rip_and_bytes() {
        let e = VmExit::InternalError {
            cpu: 1,
            suberror: 1,
            rip: 0xffff_ffff_8100_0000,
            insn: vec![0x0f, 0x01, 0xca],
            data: vec![],
        };
        let s = e.to_string();
        assert!(s.contains("rip=0xffffffff81000000"), "{s}");
        assert!(s.contains("0f 01 ca"), "{s}");
    }
}
