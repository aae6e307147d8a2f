//! `airlock-vmm`'s process exit codes and what each means. The daemon turns a sandbox VMM's
//! exit into the sandbox's end reason with [`VmmExit::from_code`].
//!
//! | code | meaning |
//! | ---: | --- |
//! | 0 | the guest ended itself (keyboard-controller reset, `reboot=k`): a clean power-off; or the host stopped the VM on request |
//! | 1 | VMM error: the host could not build or run the VM (bad image, KVM refused an ioctl) |
//! | 2 | usage error: bad command line |
//! | 64 | guest kernel panic (seen on the console) |
//! | 65 | triple fault (`KVM_EXIT_SHUTDOWN`) |
//! | 66 | KVM internal error, e.g. an instruction the (nested) emulator cannot run |
//! | 67 | KVM could not enter the guest (`KVM_EXIT_FAIL_ENTRY`) |
//! | 68 | boot deadline passed before the guest printed `airlock: userspace up` |
//! | 69 | unexpected vCPU exit or `KVM_RUN` failure |
//! | 70 | seccomp violation: a VMM thread made a system call outside its filter |

pub const OK: u8 = 0;
pub const VMM_ERROR: u8 = 1;
pub const USAGE: u8 = 2;
pub const GUEST_PANIC: u8 = 64;
pub const TRIPLE_FAULT: u8 = 65;
pub const INTERNAL_ERROR: u8 = 66;
pub const FAIL_ENTRY: u8 = 67;
pub const BOOT_TIMEOUT: u8 = 68;
pub const VCPU_ERROR: u8 = 69;
pub const SECCOMP_VIOLATION: u8 = 70;

/// The meaning of an exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmmExit {
    /// The guest powered off, or the VM was stopped on request.
    PoweredOff,
    VmmError,
    Usage,
    GuestPanic,
    TripleFault,
    KvmInternalError,
    KvmEntryFailed,
    BootTimeout,
    VcpuError,
    SeccompViolation,
    /// A code the VMM does not use.
    Other(i32),
}

impl VmmExit {
    pub fn from_code(code: i32) -> Self {
        match u8::try_from(code) {
            Ok(OK) => Self::PoweredOff,
            Ok(VMM_ERROR) => Self::VmmError,
            Ok(USAGE) => Self::Usage,
            Ok(GUEST_PANIC) => Self::GuestPanic,
            Ok(TRIPLE_FAULT) => Self::TripleFault,
            Ok(INTERNAL_ERROR) => Self::KvmInternalError,
            Ok(FAIL_ENTRY) => Self::KvmEntryFailed,
            Ok(BOOT_TIMEOUT) => Self::BootTimeout,
            Ok(VCPU_ERROR) => Self::VcpuError,
            Ok(SECCOMP_VIOLATION) => Self::SeccompViolation,
            _ => Self::Other(code),
        }
    }

    /// Whether the guest (not the host) ended the VM abnormally.
    pub fn is_guest_crash(self) -> bool {
        matches!(
            self,
            Self::GuestPanic
                | Self::TripleFault
                | Self::KvmInternalError
                | Self::KvmEntryFailed
                | Self::BootTimeout
                | Self::VcpuError
        )
    }

    /// A sentence for records and logs.
    pub fn describe(self) -> String {
        match self {
            Self::PoweredOff => "the guest powered off".into(),
            Self::VmmError => "the VMM failed (exit code 1)".into(),
            Self::Usage => "the VMM was started wrongly (exit code 2)".into(),
            Self::GuestPanic => "the guest kernel panicked".into(),
            Self::TripleFault => "the guest triple-faulted".into(),
            Self::SeccompViolation => {
                "the VMM made a system call outside its seccomp filter and was ended".into()
            }
            Self::Other(c) => format!("the VMM exited with code {c}"),
            other => format!("the VM failed (VMM exit code {})", other.code()),
        }
    }

    /// The exit code.
    pub fn code(self) -> i32 {
        let c = match self {
            Self::PoweredOff => OK,
            Self::VmmError => VMM_ERROR,
            Self::Usage => USAGE,
            Self::GuestPanic => GUEST_PANIC,
            Self::TripleFault => TRIPLE_FAULT,
            Self::KvmInternalError => INTERNAL_ERROR,
            Self::KvmEntryFailed => FAIL_ENTRY,
            Self::BootTimeout => BOOT_TIMEOUT,
            Self::VcpuError => VCPU_ERROR,
            Self::SeccompViolation => SECCOMP_VIOLATION,
            Self::Other(c) => return c,
        };
        i32::from(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_classify() {
        for c in [0, 1, 2, 64, 65, 66, 67, 68, 69, 70, 3, 255, -1] {
            assert_eq!(VmmExit::from_code(c).code(), c);
        }
        assert!(VmmExit::from_code(64).is_guest_crash());
        assert!(VmmExit::from_code(69).is_guest_crash());
        assert!(!VmmExit::from_code(70).is_guest_crash());
        assert!(!VmmExit::from_code(0).is_guest_crash());
        assert_eq!(VmmExit::from_code(70), VmmExit::SeccompViolation);
    }
}
