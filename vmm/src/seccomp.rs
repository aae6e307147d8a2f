//! Seccomp filters, one per thread class, installed by each thread for itself before the guest
//! runs any code.
//!
//! The filters are data: `vmm/seccomp/x86_64.json` (every rule commented with the code path
//! that needs it, ioctl numbers pinned and checked by a test below), compiled to BPF by
//! `build.rs` and embedded here. A system call outside a thread's filter raises `SIGSYS`
//! (`SECCOMP_RET_TRAP`); [`on_violation`] writes the call's number and the thread class to
//! stderr and ends the process with [`code::SECCOMP_VIOLATION`], a code no other failure uses,
//! so whoever started the VMM can report it as such.
//!
//! Filters are off until [`enable`] is called (the `airlock-vmm` binary does, unless
//! `--no-seccomp`): the library is also used in-process by tests, whose threads must stay free.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use seccompiler::{BpfProgram, sock_filter};
use thiserror::Error;

use crate::exit::code;

/// The kinds of threads an `airlock-vmm` process has; each has its own filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadClass {
    /// The main thread: the event loop with the devices and the control commands.
    Vmm,
    /// A vCPU thread.
    Vcpu,
    /// The control-api thread (the control socket).
    Api,
    /// `run`'s agent-client thread and `snapshot`'s snapshot thread.
    Client,
    /// A guest RIP sampler thread (`AIRLOCK_PROFILE`).
    Profiler,
    /// The test-hook thread (`--test-hooks`).
    Probe,
}

impl ThreadClass {
    pub const ALL: [ThreadClass; 6] = [
        Self::Vmm,
        Self::Vcpu,
        Self::Api,
        Self::Client,
        Self::Profiler,
        Self::Probe,
    ];

    /// The filter's key in the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vmm => "vmm",
            Self::Vcpu => "vcpu",
            Self::Api => "api",
            Self::Client => "client",
            Self::Profiler => "profiler",
            Self::Probe => "probe",
        }
    }

    fn bpf(self) -> &'static [u8] {
        macro_rules! bpf {
            ($name:literal) => {
                include_bytes!(concat!(env!("OUT_DIR"), "/seccomp/", $name, ".bpf"))
            };
        }
        match self {
            Self::Vmm => bpf!("vmm"),
            Self::Vcpu => bpf!("vcpu"),
            Self::Api => bpf!("api"),
            Self::Client => bpf!("client"),
            Self::Profiler => bpf!("profiler"),
            Self::Probe => bpf!("probe"),
        }
    }

    /// The compiled filter.
    pub fn program(self) -> BpfProgram {
        self.bpf()
            .chunks_exact(8)
            .map(|b| sock_filter {
                code: u16::from_le_bytes([b[0], b[1]]),
                jt: b[2],
                jf: b[3],
                k: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            })
            .collect()
    }
}

/// Failure to install a filter (the thread must then not go on: it would run unconfined).
#[derive(Debug, Error)]
pub enum SeccompError {
    #[error("install the SIGSYS handler")]
    Handler(#[source] vmm_sys_util::errno::Error),
    #[error("install the {0} seccomp filter")]
    Apply(&'static str, #[source] seccompiler::Error),
}

static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The class whose filter this thread runs under, for the violation report.
    static CLASS: Cell<&'static str> = const { Cell::new("unfiltered") };
}

/// Turns the filters on for this process: installs the `SIGSYS` handler that reports a
/// violation; from now on [`apply`] installs filters. Call it before any thread starts.
pub fn enable() -> Result<(), SeccompError> {
    keep_thread_heaps();
    vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_violation)
        .map_err(SeccompError::Handler)?;
    ENABLED.store(true, Ordering::Release);
    Ok(())
}

/// glibc gives each thread's arena heap back to the kernel when its top is free, and the first
/// time it shrinks one it reads `/proc/sys/vm/overcommit_memory` (an `openat` that no thread's
/// filter but the event loop's allows: a thread that freed a large buffer, such as a big agent
/// frame, died of it). A trim threshold beyond any heap keeps heaps as they are (freed memory
/// is reused; heaps that become wholly free are still unmapped) and also stops glibc from
/// raising its mmap threshold, so large buffers stay separate mappings.
fn keep_thread_heaps() {
    // SAFETY: mallopt(3) only sets allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

/// Whether [`enable`] was called.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

/// Installs `class`'s filter on the calling thread (nothing when filters are not enabled).
/// Filters only ever narrow: a thread started later by this one inherits this filter too.
pub fn apply(class: ThreadClass) -> Result<(), SeccompError> {
    if !enabled() {
        return Ok(());
    }
    seccompiler::apply_filter(&class.program())
        .map_err(|e| SeccompError::Apply(class.name(), e))?;
    CLASS.with(|c| c.set(class.name()));
    Ok(())
}

/// `SIGSYS` from `SECCOMP_RET_TRAP`: report and end the process. Async-signal-safe: a const
/// thread local, a stack buffer, `write(2)` and `_exit(2)` (both allowed in every filter).
extern "C" fn on_violation(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let syscall = if info.is_null() {
        -1
    } else {
        // SAFETY: the kernel passes a valid siginfo_t (128 bytes) for SA_SIGINFO handlers; for
        // SIGSYS its union holds `_sigsys { void *_call_addr; int _syscall; unsigned _arch; }`
        // from byte 16 on x86_64, so `_syscall` is the i32 at byte 24, inside the struct.
        let at = unsafe { info.cast::<u8>().add(24) };
        // SAFETY: `at` points at 4 readable bytes of the siginfo_t (above).
        unsafe { std::ptr::read_unaligned(at.cast::<i32>()) }
    };
    let mut buf = [0u8; 160];
    let mut n = 0;
    let class = CLASS.with(Cell::get);
    let number = decimal(syscall);
    for part in [
        b"airlock-vmm: seccomp violation: system call ".as_slice(),
        &number.0[..number.1],
        b" on a ",
        class.as_bytes(),
        b" thread; the VMM ends\n",
    ] {
        let take = part.len().min(buf.len() - n);
        buf[n..n + take].copy_from_slice(&part[..take]);
        n += take;
    }
    // SAFETY: write(2) from a live stack buffer of `n` bytes; async-signal-safe.
    unsafe { libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), n) };
    // SAFETY: _exit(2) is async-signal-safe and ends only this process.
    unsafe { libc::_exit(i32::from(code::SECCOMP_VIOLATION)) }
}

/// `v` in decimal, without allocating: (digits, length).
fn decimal(v: i32) -> ([u8; 12], usize) {
    let mut out = [0u8; 12];
    let mut digits = [0u8; 11];
    let mut len = 0;
    let mut m = v.unsigned_abs();
    loop {
        digits[len] = b'0' + (m % 10) as u8;
        len += 1;
        m /= 10;
        if m == 0 {
            break;
        }
    }
    let mut n = 0;
    if v < 0 {
        out[0] = b'-';
        n = 1;
    }
    for i in (0..len).rev() {
        out[n] = digits[i];
        n += 1;
    }
    (out, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::*;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

    const KVMIO: u32 = 0xAE;
    ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
    ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
    ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
    ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
    ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);

    const JSON: &str = include_str!("../seccomp/x86_64.json");

    /// Every numeric argument the JSON pins, with the comment that names it.
    fn pinned_values() -> Vec<(String, u64)> {
        let doc: serde_json::Value = serde_json::from_str(JSON).unwrap();
        let mut out = Vec::new();
        for filter in doc.as_object().unwrap().values() {
            for rule in filter["filter"].as_array().unwrap() {
                for arg in rule["args"].as_array().into_iter().flatten() {
                    let name = arg["comment"].as_str().unwrap().to_owned();
                    out.push((name, arg["val"].as_u64().unwrap()));
                }
            }
        }
        out
    }

    #[test]
    fn every_pinned_ioctl_number_matches_the_kernel_abi() {
        let expected: &[(&str, u64)] = &[
            ("KVM_RUN", KVM_RUN()),
            ("KVM_GET_REGS", KVM_GET_REGS()),
            ("KVM_GET_SREGS", KVM_GET_SREGS()),
            ("KVM_GET_MSRS", KVM_GET_MSRS()),
            ("KVM_SET_MSRS", KVM_SET_MSRS()),
            ("KVM_GET_FPU", KVM_GET_FPU()),
            ("KVM_GET_LAPIC", KVM_GET_LAPIC()),
            ("KVM_GET_CPUID2", KVM_GET_CPUID2()),
            ("KVM_GET_MP_STATE", KVM_GET_MP_STATE()),
            ("KVM_GET_VCPU_EVENTS", KVM_GET_VCPU_EVENTS()),
            ("KVM_GET_DEBUGREGS", KVM_GET_DEBUGREGS()),
            ("KVM_GET_XSAVE", KVM_GET_XSAVE()),
            ("KVM_GET_XCRS", KVM_GET_XCRS()),
            ("KVM_GET_IRQCHIP", KVM_GET_IRQCHIP()),
            ("KVM_GET_CLOCK", KVM_GET_CLOCK()),
            ("KVM_GET_PIT2", KVM_GET_PIT2()),
            ("FIONBIO", libc::FIONBIO),
            ("F_DUPFD_CLOEXEC", libc::F_DUPFD_CLOEXEC as u64),
            ("F_GETFD", libc::F_GETFD as u64),
            ("F_GETFL", libc::F_GETFL as u64),
            ("F_SETFD", libc::F_SETFD as u64),
            ("AF_UNIX", libc::AF_UNIX as u64),
            ("SIGABRT", libc::SIGABRT as u64),
            ("SIGRTMIN", crate::kick::signal() as u64),
            ("prot & PROT_EXEC == 0", 0),
            ("flags & (O_CREAT | __O_TMPFILE) == 0", 0),
        ];
        let pinned = pinned_values();
        assert!(pinned.iter().any(|(n, _)| n == "KVM_RUN"));
        for (name, value) in pinned {
            let want = expected
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("no expected value for the pinned argument {name:?}"));
            assert_eq!(value, want.1, "{name}: the JSON pins {value:#x}");
        }
    }

    #[test]
    fn no_thread_of_a_running_vmm_creates_files_or_directories() {
        let doc: serde_json::Value = serde_json::from_str(JSON).unwrap();
        // O_TMPFILE includes O_DIRECTORY, which opening a directory needs: mask its own bit.
        let creating = (libc::O_CREAT | (libc::O_TMPFILE & !libc::O_DIRECTORY)) as u64;
        for class in ["common", "vmm", "vcpu", "api", "client", "probe"] {
            for rule in doc[class]["filter"].as_array().unwrap() {
                let call = rule["syscall"].as_str().unwrap();
                let creates = [
                    "creat",
                    "open",
                    "mkdir",
                    "mkdirat",
                    "mknod",
                    "mknodat",
                    "link",
                    "linkat",
                    "symlink",
                    "symlinkat",
                    "fallocate",
                ];
                assert!(!creates.contains(&call), "{class} allows {call}");
                if call == "openat" {
                    let arg = &rule["args"][0];
                    assert_eq!(arg["index"], 2, "{class}: openat's flags");
                    assert_eq!(arg["op"]["masked_eq"], creating, "{class}: openat's mask");
                    assert_eq!(arg["val"], 0, "{class}: openat's flags");
                }
            }
        }
    }

    #[test]
    fn every_rule_says_which_code_path_needs_it() {
        let doc: serde_json::Value = serde_json::from_str(JSON).unwrap();
        for (class, filter) in doc.as_object().unwrap() {
            assert!(
                filter["comment"].is_string(),
                "filter {class} has no comment"
            );
            for rule in filter["filter"].as_array().unwrap() {
                let comment = rule["comment"].as_str().unwrap_or("");
                assert!(
                    comment.len() > 10,
                    "{class}: rule for {} has no comment",
                    rule["syscall"]
                );
            }
        }
    }

    #[test]
    fn every_class_has_a_compiled_filter_that_traps_by_default() {
        const SECCOMP_RET_TRAP: u32 = 0x0003_0000;
        const BPF_RET_K: u16 = 0x06;
        for class in ThreadClass::ALL {
            let p = class.program();
            assert_eq!(class.bpf().len() % 8, 0);
            assert!(
                !p.is_empty() && p.len() < 4096,
                "{}: {}",
                class.name(),
                p.len()
            );
            assert!(
                p.iter()
                    .any(|i| i.code == BPF_RET_K && i.k == SECCOMP_RET_TRAP),
                "{} never traps",
                class.name()
            );
        }
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        let s = |v| {
            let (b, n) = decimal(v);
            String::from_utf8(b[..n].to_vec()).unwrap()
        };
        assert_eq!(s(0), "0");
        assert_eq!(s(101), "101");
        assert_eq!(s(-1), "-1");
        assert_eq!(s(i32::MIN), "-2147483648");
    }

    /// Run in a child process by the test below: installs the vcpu filter, then makes a call
    /// no vCPU thread needs.
    #[test]
    fn violation_child() {
        if std::env::var_os("AIRLOCK_SECCOMP_CHILD").is_none() {
            return;
        }
        enable().unwrap();
        apply(ThreadClass::Vcpu).unwrap();
        // SAFETY: getppid(2) has no arguments or side effects; the filter traps it.
        unsafe { libc::getppid() };
        unreachable!("the filter let getppid through");
    }

    /// Run in a child process by the test below: under the client filter, frees buffers the
    /// way a thread that reads big agent frames does: several under glibc's mmap threshold
    /// (so from the thread's arena heap), then all at once (so the heap's free top is over the
    /// trim threshold).
    #[test]
    fn heap_child() {
        if std::env::var_os("AIRLOCK_SECCOMP_HEAP_CHILD").is_none() {
            return;
        }
        enable().unwrap();
        std::thread::spawn(|| {
            apply(ThreadClass::Client).unwrap();
            for round in 0..4u8 {
                let bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![round; 100 << 10]).collect();
                assert_eq!(std::hint::black_box(&bufs)[7][7], round);
                drop(bufs);
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn freeing_large_buffers_on_a_filtered_thread_is_no_violation() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "seccomp::tests::heap_child", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("AIRLOCK_SECCOMP_HEAP_CHILD", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {stderr}", out.status.code());
    }

    #[test]
    fn a_call_outside_the_filter_ends_the_process_with_the_violation_code() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "seccomp::tests::violation_child", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("AIRLOCK_SECCOMP_CHILD", "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(i32::from(code::SECCOMP_VIOLATION)),
            "{stderr}"
        );
        let getppid = libc::SYS_getppid.to_string();
        assert!(
            stderr.contains(&format!("system call {getppid} on a vcpu thread")),
            "{stderr}"
        );
    }
}
