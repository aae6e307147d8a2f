//! Kicking a vCPU thread out of `KVM_RUN`: a real-time signal whose handler sets the thread's
//! `kvm_run.immediate_exit`, so a vCPU inside `KVM_RUN` returns at once and one about to enter
//! it does not block. The vCPU loop ([`crate::vcpu`]) arms it; the VMM thread and the profiler
//! ([`crate::profile`]) send it.

use std::cell::Cell;

use vmm_sys_util::signal::{SIGRTMIN, register_signal_handler};

/// The signal that kicks a vCPU out of `KVM_RUN`.
pub fn signal() -> i32 {
    SIGRTMIN()
}

thread_local! {
    /// This thread's `kvm_run.immediate_exit`, for the kick signal handler.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: a const-initialised thread local without destructor and a volatile
    // store.
    let ptr = IMMEDIATE_EXIT.with(Cell::get);
    if !ptr.is_null() {
        // SAFETY: the pointer was set by this thread's vCPU loop ([`arm`]) to a field of its
        // `kvm_run` mapping, which stays mapped until the loop calls [`disarm`] before dropping
        // the fd.
        unsafe { std::ptr::write_volatile(ptr, 1) };
    }
}

/// Makes a kick of the calling thread set `immediate_exit` (its `kvm_run` field), until
/// [`disarm`]; the caller keeps the mapping alive until then.
pub fn arm(immediate_exit: *mut u8) {
    IMMEDIATE_EXIT.with(|c| c.set(immediate_exit));
}

/// Undoes [`arm`]: a later kick of this thread touches nothing.
pub fn disarm() {
    IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
}

/// The calling thread's pthread id.
pub fn current_thread() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() }
}

/// Sends `signal` to thread `t` (a vCPU thread that has installed the kick handler).
pub fn kick_thread(t: libc::pthread_t, signal: i32) {
    // SAFETY: `t` is a thread of this process that outlives the sampler (the vCPU stops the
    // sampler before it exits), and the signal has a handler installed process-wide.
    unsafe {
        libc::pthread_kill(t, signal);
    }
}

/// Installs the kick signal handler (process-wide, once before any vCPU starts).
pub fn register_handler() -> Result<(), vmm_sys_util::errno::Error> {
    register_signal_handler(signal(), handle_kick)
}
