//! A last word before the agent dies of a fault.
//!
//! As PID 1 the agent's death panics the guest kernel ("Attempted to kill init"), and the
//! console then shows only the signal number. A handler for the fault signals prints what an
//! operator needs to find the cause — the signal, the faulting address, the instruction and
//! stack pointers, the image's load address (the agent is a static PIE) and the thread's name —
//! in one write to stderr (the console), then lets the fault take its course: it hands over to
//! the handler that was there before (Rust's own, which tells a stack overflow), or to the
//! default action, which ends the process as before.

use std::fmt::Write as _;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The signals a fault raises.
const FAULTS: [libc::c_int; 4] = [libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE];

/// The actions that were installed before ours, by signal number (0: the default).
static PREVIOUS: [AtomicUsize; 32] = [const { AtomicUsize::new(0) }; 32];
/// The flags of those actions (`SA_SIGINFO` decides how to call them).
static PREVIOUS_FLAGS: [AtomicUsize; 32] = [const { AtomicUsize::new(0) }; 32];

/// Installs the handler for every fault signal. Call once, early, before other threads start
/// (threads Rust starts get their own alternate signal stacks; the handler runs on them).
pub fn report_faults() -> io::Result<()> {
    for sig in FAULTS {
        // SAFETY: a zeroed sigaction is a valid value; every field we rely on is set below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_fault as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `action.sa_mask` is a live sigset_t.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: a zeroed sigaction is a valid out-parameter.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: both pointers are to live sigaction values; `on_fault` has the signature
        // SA_SIGINFO requires.
        if unsafe { libc::sigaction(sig, &action, &mut old) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let slot = usize::try_from(sig).unwrap_or(0) % PREVIOUS.len();
        PREVIOUS[slot].store(old.sa_sigaction, Ordering::SeqCst);
        PREVIOUS_FLAGS[slot].store(usize::try_from(old.sa_flags).unwrap_or(0), Ordering::SeqCst);
    }
    Ok(())
}

/// A line built in place, without allocating (signal handlers must not).
struct Line {
    buf: [u8; 320],
    len: usize,
}

impl std::fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.buf.len() - self.len;
        let n = s.len().min(room);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let mut line = Line {
        buf: [0; 320],
        len: 0,
    };
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let info_ref = unsafe { &*info };
    // SAFETY: every fault signal fills in si_addr.
    let addr = unsafe { info_ref.si_addr() } as usize;
    let (ip, sp) = registers(ctx);
    // SAFETY: getauxval(3) reads the auxiliary vector; it is async-signal-safe.
    let phdr = unsafe { libc::getauxval(libc::AT_PHDR) } as usize;
    // The program headers follow the 64-byte ELF header at the start of the image.
    let base = phdr.saturating_sub(64);
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into `name`.
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    let end = name.iter().position(|b| *b == 0).unwrap_or(16);
    let thread = std::str::from_utf8(&name[..end]).unwrap_or("?");
    let _ = writeln!(
        line,
        "airlock-agent: fatal signal {sig} in thread {thread:?}: address {addr:#x}, ip {ip:#x} \
         (image offset {:#x}), sp {sp:#x}, image at {base:#x}",
        ip.wrapping_sub(base)
    );
    // SAFETY: write(2) is async-signal-safe; the buffer is live for `len` bytes.
    unsafe { libc::write(2, line.buf.as_ptr().cast(), line.len) };
    report_return_addresses(sp, base);
    hand_over(sig, info, ctx);
}

/// Words on the stack just above `sp` that point into the agent's code: the return addresses
/// of the calls in progress (and a few stale ones), as image offsets, so that the caller chain
/// of a fault can be read off with `addr2line` (the agent has no frame pointers to walk).
fn report_return_addresses(sp: usize, base: usize) {
    /// Words of stack looked at, and offsets printed at most.
    const WORDS: usize = 512;
    const MAX: usize = 24;
    // SAFETY: getauxval(3) is async-signal-safe.
    let entry = unsafe { libc::getauxval(libc::AT_ENTRY) } as usize;
    if sp == 0 || !sp.is_multiple_of(8) || entry <= base {
        return;
    }
    // The code runs from the image start to well past the entry point; a generous bound keeps
    // data words out while admitting every function of a 7 MiB static binary.
    let code_end = base.saturating_add(16 << 20);
    let mut line = Line {
        buf: [0; 320],
        len: 0,
    };
    let _ = write!(line, "airlock-agent: return addresses (image offsets):");
    let mut found = 0;
    for i in 0..WORDS {
        let at = sp + i * 8;
        // Stay on the stack's own page range: stop at the first word whose page is not mapped
        // readable (mincore says whether it is mapped at all).
        if at.is_multiple_of(4096) && !mapped(at) {
            break;
        }
        // SAFETY: `at` is 8-aligned and on a page that mincore reported mapped; the stack is
        // readable wherever it is mapped.
        let word = unsafe { std::ptr::read_volatile(at as *const usize) };
        if (base..code_end).contains(&word) {
            let _ = write!(line, " {:#x}", word - base);
            found += 1;
            if found == MAX || line.len + 20 > line.buf.len() {
                break;
            }
        }
    }
    let _ = writeln!(line);
    // SAFETY: write(2) is async-signal-safe; the buffer is live for `len` bytes.
    unsafe { libc::write(2, line.buf.as_ptr().cast(), line.len) };
}

/// Whether the page holding `addr` is mapped (mincore fails with ENOMEM where it is not).
fn mapped(addr: usize) -> bool {
    let mut vec = 0u8;
    let page = addr & !4095;
    // SAFETY: mincore(2) only writes one byte into `vec` for a one-page range.
    unsafe { libc::mincore(page as *mut libc::c_void, 4096, &mut vec) == 0 }
}

/// The instruction and stack pointers at the fault.
fn registers(ctx: *mut libc::c_void) -> (usize, usize) {
    if ctx.is_null() {
        return (0, 0);
    }
    let uc = ctx.cast::<libc::ucontext_t>();
    // SAFETY: the kernel passes a valid ucontext_t as the third argument of a SA_SIGINFO
    // handler; the registers are plain integers.
    let gregs = unsafe { (*uc).uc_mcontext.gregs };
    let reg = |i: libc::c_int| {
        usize::try_from(i)
            .ok()
            .and_then(|i| gregs.get(i))
            .map_or(0, |v| *v as usize)
    };
    (reg(libc::REG_RIP), reg(libc::REG_RSP))
}

/// Calls the handler that was installed before ours, or restores the default action: the
/// faulting instruction then runs again and the fault ends the process as it would have.
fn hand_over(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let slot = usize::try_from(sig).unwrap_or(0) % PREVIOUS.len();
    let previous = PREVIOUS[slot].load(Ordering::SeqCst);
    let flags = PREVIOUS_FLAGS[slot].load(Ordering::SeqCst);
    if previous == libc::SIG_DFL || previous == libc::SIG_IGN {
        // SAFETY: signal(2) with SIG_DFL is async-signal-safe.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
        return;
    }
    if flags & usize::try_from(libc::SA_SIGINFO).unwrap_or(0) != 0 {
        // SAFETY: `previous` was installed as a SA_SIGINFO handler with this signature.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(previous) };
        f(sig, info, ctx);
    } else {
        // SAFETY: `previous` was installed as a plain handler with this signature.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(previous) };
        f(sig);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::FromRawFd;

    use super::*;

    #[test]
    fn a_fault_is_described_on_stderr_and_still_kills() {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe(2) returns.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only calls async-signal-safe functions (dup2, sigaction through
        // report_faults, write in the handler) and then faults.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: as above; fds[1] is the pipe's write end.
            unsafe { libc::dup2(fds[1], 2) };
            let _ = report_faults();
            let bad = std::ptr::without_provenance_mut::<u64>(0x80);
            // SAFETY: not safe at all: the fault is the point of this child.
            unsafe { bad.write_volatile(1) };
            // SAFETY: _exit(2) ends the child; reached only if the write did not fault.
            unsafe { libc::_exit(0) };
        }
        // SAFETY: fds[1] is ours to close; fds[0] becomes an owned File.
        unsafe { libc::close(fds[1]) };
        // SAFETY: as above.
        let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let mut text = String::new();
        reader.read_to_string(&mut text).unwrap();
        assert!(
            libc::WIFSIGNALED(status),
            "status {status:#x}, stderr {text:?}"
        );
        assert_eq!(libc::WTERMSIG(status), libc::SIGSEGV);
        assert!(
            text.contains("fatal signal 11")
                && text.contains("address 0x80")
                && text.contains("return addresses (image offsets): 0x"),
            "{text:?}"
        );
    }
}
