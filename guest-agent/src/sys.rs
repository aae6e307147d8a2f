//! The agent's only unsafe code: thin wrappers over libc calls.
//!
//! Each wrapper turns a failed call into `io::Error` (from `errno`) and returns owned types
//! (`OwnedFd`), so the rest of the agent is safe code.
#![allow(
    unsafe_code,
    reason = "the one module of the agent that calls libc directly"
)]

mod fatal;
mod ids;

pub use airlock_netcfg::{add_default_route, configure_interface};
pub use fatal::report_faults;
pub use ids::{Credentials, FsIds};

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

/// One filesystem the agent mounts at start.
#[derive(Debug)]
pub struct MountSpec {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: libc::c_ulong,
    /// Filesystem-specific options (`mode=1777`), if any.
    pub data: Option<&'static str>,
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Turns a `-1`-on-error return value into `io::Result`.
fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Takes ownership of a descriptor a successful call just returned.
fn owned(rc: libc::c_int) -> io::Result<OwnedFd> {
    let fd = check(rc)?;
    // SAFETY: `fd` was just returned by a successful call that creates a new descriptor; nothing
    // else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Mounts `m`; an already mounted target (EBUSY) counts as success.
pub fn mount_fs(m: &MountSpec) -> io::Result<()> {
    let (src, tgt, fst) = (cstr(m.source)?, cstr(m.target)?, cstr(m.fstype)?);
    let data = m.data.map(cstr).transpose()?;
    let data_ptr = data
        .as_ref()
        .map_or(std::ptr::null(), |d| d.as_ptr().cast::<libc::c_void>());
    // SAFETY: all pointers are valid NUL-terminated strings (or null for data) that outlive the
    // call.
    let rc = unsafe { libc::mount(src.as_ptr(), tgt.as_ptr(), fst.as_ptr(), m.flags, data_ptr) };
    match check(rc) {
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
        other => other.map(drop),
    }
}

/// Sets the size limit of the tmpfs at `target` (keeping its mode and flags), in bytes.
pub fn remount_tmpfs_size(target: &str, bytes: u64) -> io::Result<()> {
    let tgt = cstr(target)?;
    let fst = cstr("tmpfs")?;
    let data = std::ffi::CString::new(format!("size={bytes}"))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let flags = libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            fst.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            flags,
            data.as_ptr().cast::<libc::c_void>(),
        )
    };
    check(rc).map(drop)
}

/// Mounts the ext4 file system on `device` at `target`, nosuid and nodev, read-only if asked.
pub fn mount_ext4(device: &str, target: &str, read_only: bool) -> io::Result<()> {
    let (src, tgt, fst) = (cstr(device)?, cstr(target)?, cstr("ext4")?);
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; no data.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    check(rc).map(drop)
}

/// Unmounts `target`.
pub fn unmount(target: &str) -> io::Result<()> {
    let tgt = cstr(target)?;
    // SAFETY: `tgt` is a valid NUL-terminated string that outlives the call.
    check(unsafe { libc::umount2(tgt.as_ptr(), 0) }).map(drop)
}

/// Makes the block device open as `dev` read-only (`BLKROSET`): nothing, the kernel's own
/// journal recovery included, may write to it any more.
pub fn set_block_read_only(dev: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: BLKROSET reads one int through the pointer, which points at a live int; the
    // descriptor is open for the call.
    check(unsafe { libc::ioctl(dev.as_raw_fd(), BLKROSET, &raw const one) }).map(drop)
}

/// `_IO(0x12, 93)`.
const BLKROSET: libc::c_ulong = 0x125d;

/// What `statvfs(path)` says: (block size, free blocks, blocks available to unprivileged
/// users, read-only).
pub fn fs_space(path: &str) -> io::Result<(u64, u64, u64, bool)> {
    let p = cstr(path)?;
    // SAFETY: statvfs is plain old data; all zeroes is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `p` is a valid NUL-terminated string and `st` a valid, writable statvfs, both
    // for the duration of the call.
    check(unsafe { libc::statvfs(p.as_ptr(), &raw mut st) })?;
    Ok((
        st.f_frsize,
        st.f_bfree,
        st.f_bavail,
        st.f_flag & libc::ST_RDONLY != 0,
    ))
}

/// Flushes filesystem buffers.
pub fn sync() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() }
}

/// Ends the VM. Without ACPI the guest kernel resets through the keyboard controller
/// (`reboot=k`), which the VMM treats as the end of the VM.
pub fn reboot() -> io::Result<()> {
    // SAFETY: reboot(2) with a valid command; it only returns on failure.
    check(unsafe { libc::reboot(libc::RB_AUTOBOOT) }).map(drop)
}

/// Sleeps until a signal arrives.
pub fn pause() {
    // SAFETY: pause(2) takes no arguments.
    unsafe {
        libc::pause();
    }
}

/// Sets the file mode creation mask of the agent (children get 022, see [`prepare_child`]).
pub fn set_umask(mask: u32) {
    // SAFETY: umask(2) cannot fail.
    unsafe {
        libc::umask(mask);
    }
}

/// Sets the kernel's host name.
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, which outlive the call.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }).map(drop)
}

/// The kernel's host name (uname's nodename).
pub fn hostname() -> io::Result<String> {
    // SAFETY: utsname is plain old data; all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable utsname.
    check(unsafe { libc::uname(&mut uts) })?;
    let bytes: Vec<u8> = uts
        .nodename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Total RAM the kernel manages, in bytes (MemTotal).
pub fn mem_total_bytes() -> io::Result<u64> {
    // SAFETY: sysinfo is plain old data; all-zero is a valid value.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, writable sysinfo struct.
    check(unsafe { libc::sysinfo(&mut info) })?;
    Ok(info.totalram.saturating_mul(u64::from(info.mem_unit)))
}

/// Time since the kernel started (CLOCK_BOOTTIME, which includes suspend).
pub fn boottime() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists on every kernel we run.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u32::try_from(ts.tv_nsec).unwrap_or(0);
    Duration::new(secs, nanos)
}

// ---------------------------------------------------------------------------------------------
// Signals and child processes

/// A signal set holding only SIGCHLD.
fn sigchld_set() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain old data; sigemptyset initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    check(unsafe { libc::sigemptyset(&mut set) })?;
    // SAFETY: `set` is a valid, initialised sigset_t and SIGCHLD a valid signal.
    check(unsafe { libc::sigaddset(&mut set, libc::SIGCHLD) })?;
    Ok(set)
}

/// Blocks SIGCHLD in the calling thread and in every thread it creates afterwards, so that only
/// [`wait_sigchld`] receives it. Call before any other thread starts. (Children must not inherit
/// this mask, and std's `Command` does not reset it: [`prepare_child`] does.)
pub fn block_sigchld() -> io::Result<()> {
    let set = sigchld_set()?;
    // SAFETY: `set` is initialised; the old mask is not requested.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Waits until SIGCHLD is pending (it must be blocked) and consumes it.
pub fn wait_sigchld() -> io::Result<()> {
    let set = sigchld_set()?;
    // SAFETY: `set` is initialised; a null siginfo pointer is allowed.
    check(unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) }).map(drop)
}

/// Resource usage of a reaped child (and the descendants it waited for).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rusage {
    pub user_us: u64,
    pub system_us: u64,
    pub max_rss_bytes: u64,
}

/// A child that was reaped: its pid, raw wait status and resource usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    pub pid: i32,
    pub status: i32,
    pub rusage: Rusage,
}

fn timeval_us(tv: libc::timeval) -> u64 {
    let secs = u64::try_from(tv.tv_sec).unwrap_or(0);
    let usecs = u64::try_from(tv.tv_usec).unwrap_or(0);
    secs.saturating_mul(1_000_000).saturating_add(usecs)
}

/// Reaps any one exited child without blocking; `None` when none is waiting (or none exists).
pub fn reap_any() -> io::Result<Option<Reaped>> {
    let mut status = 0;
    // SAFETY: rusage is plain old data; all-zero is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `status` and `ru` are valid, writable and outlive the call.
    let rc = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
    match check(rc) {
        Ok(0) => Ok(None),
        Ok(pid) => Ok(Some(Reaped {
            pid,
            status,
            rusage: Rusage {
                user_us: timeval_us(ru.ru_utime),
                system_us: timeval_us(ru.ru_stime),
                max_rss_bytes: u64::try_from(ru.ru_maxrss)
                    .unwrap_or(0)
                    .saturating_mul(1024),
            },
        })),
        Err(e) if e.raw_os_error() == Some(libc::ECHILD) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Makes orphaned descendants of this process its children (host mode: as PID 1 is in a VM).
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer argument only.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }).map(drop)
}

/// Sends `sig` to process `pid` (must be positive).
pub fn kill(pid: i32, sig: i32) -> io::Result<()> {
    if pid <= 0 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: kill(2) with a positive pid only signals that process.
    check(unsafe { libc::kill(pid, sig) }).map(drop)
}

/// Sends `sig` to every process in process group `pgid` (must be greater than 1).
pub fn killpg(pgid: i32, sig: i32) -> io::Result<()> {
    if pgid <= 1 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: killpg(2) with a group id > 1 only signals that group.
    check(unsafe { libc::killpg(pgid, sig) }).map(drop)
}

/// Makes the child that `cmd` spawns the leader of a new session (and process group), and, if
/// `cgroup_procs` is given (an open `cgroup.procs` of the execution's cgroup), moves it into
/// that cgroup before it execs, so that none of its descendants can start outside it. The
/// child's umask is set to the conventional 022 (the agent itself runs with 0, so that the modes
/// of files it creates are exactly those requested).
///
/// With `drop_to`, the child then gives up root, in this order: it empties its capability
/// bounding set (locked down only), takes the account's groups, gid and uid (real, effective
/// and saved: changing the uid from 0 clears its permitted, effective and ambient capabilities)
/// and, locked down, sets no_new_privs, so that neither a setuid binary nor file capabilities
/// give anything back (not locked down, the sandbox allows root: sudo may make it root). It
/// joins its cgroup while still root, so it can never move itself (or be moved) out. Last, it
/// changes into `cwd`, with the permissions it runs with.
pub fn prepare_child(
    cmd: &mut Command,
    cgroup_procs: Option<RawFd>,
    drop_to: Option<Credentials>,
    cwd: CString,
) {
    let hook = move || -> io::Result<()> {
        // The agent's threads block SIGCHLD; a shell that inherited that mask would never see
        // its children exit (dash's `wait` hangs in sigsuspend).
        // SAFETY: sigset_t is plain old data; sigemptyset initialises it before use.
        let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `empty` is a valid sigset_t; sigemptyset is async-signal-safe.
        check(unsafe { libc::sigemptyset(&mut empty) })?;
        // SAFETY: sigprocmask(2) with an initialised set is async-signal-safe; after fork this
        // process has a single thread.
        check(unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) })?;
        // SAFETY: setsid(2) is async-signal-safe; this runs in the forked child.
        check(unsafe { libc::setsid() })?;
        // SAFETY: umask(2) is async-signal-safe and cannot fail.
        unsafe {
            libc::umask(0o022);
        }
        if let Some(fd) = cgroup_procs {
            // SAFETY: write(2) is async-signal-safe; the buffer is a static byte string and `fd`
            // stays open in the parent until spawn returns, so the child's copy is valid.
            let n = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
            if n != 1 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some(creds) = &drop_to {
            ids::drop_privileges(creds)?;
        }
        // SAFETY: chdir(2) is async-signal-safe; `cwd` is a NUL-terminated string owned by the
        // hook.
        check(unsafe { libc::chdir(cwd.as_ptr()) }).map(drop)
    };
    // SAFETY: the hook runs between fork and exec and only makes async-signal-safe system calls
    // (sigprocmask, setsid, umask, write, chdir and those of `drop_privileges`); it allocates
    // nothing (the credentials and cwd were built before the fork) and touches no state shared
    // with other threads.
    unsafe {
        cmd.pre_exec(hook);
    }
}

// ---------------------------------------------------------------------------------------------
// Descriptors

/// A new non-blocking eventfd (a counter that `poll` reports readable when non-zero).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd(2) with valid flags returns a new descriptor or -1.
    owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
}

/// poll(2) over `fds`; `None` waits forever. EINTR counts as "nothing ready".
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = timeout.map_or(-1, |t| {
        // Round up so that a deadline 0.4 ms away does not spin.
        let ms = t.as_micros().div_ceil(1000);
        libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
    });
    let len = libc::nfds_t::try_from(fds.len()).unwrap_or(0);
    // SAFETY: the pointer and length describe `fds`, a valid, writable slice of pollfd.
    match check(unsafe { libc::poll(fds.as_mut_ptr(), len, ms) }) {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// Sets O_NONBLOCK on `fd`.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL on a valid descriptor reads its flags.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: F_SETFL on a valid descriptor with flags derived from its own.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) }).map(drop)
}

/// Sets the capacity of the pipe `fd` (fewer, larger reads of a busy output).
pub fn set_pipe_size(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
    let size = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: F_SETPIPE_SZ on a valid descriptor takes an integer.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, size) }).map(drop)
}

/// Shuts a socket down both ways: blocked readers and writers on any copy of it return.
pub fn shutdown(fd: BorrowedFd<'_>) {
    // SAFETY: shutdown(2) on a valid descriptor; failure (not a socket, not connected) is
    // harmless and ignored.
    unsafe {
        libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR);
    }
}

/// Whether the peer of the connected socket `fd` is gone for good: the socket reports an error
/// (a reset, as every vsock connection gets on a transport reset) or a hang-up in both
/// directions (the peer closed, or we shut it down). Never blocks.
pub fn peer_gone(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [libc::pollfd {
        fd: fd.as_raw_fd(),
        events: 0,
        revents: 0,
    }];
    let gone = libc::POLLHUP | libc::POLLERR | libc::POLLNVAL;
    matches!(poll(&mut fds, Some(Duration::ZERO)), Ok(n) if n > 0 && fds[0].revents & gone != 0)
}

// ---------------------------------------------------------------------------------------------
// The kernel's random number generator

/// `_IOW('R', 0x03, int[2])` of linux/random.h (the generic ioctl encoding: x86-64, arm64).
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)` of linux/random.h.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Mixes `data` into the kernel's input pool and credits 8 bits of entropy per byte
/// (RNDADDENTROPY on a descriptor of /dev/urandom or /dev/random; needs CAP_SYS_ADMIN).
pub fn add_entropy(random: BorrowedFd<'_>, data: &[u8]) -> io::Result<()> {
    let too_large = || io::Error::from(io::ErrorKind::InvalidInput);
    let len = libc::c_int::try_from(data.len()).map_err(|_| too_large())?;
    let bits = len.checked_mul(8).ok_or_else(too_large)?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }: the kernel copies
    // the two ints and then buf_size bytes, so a byte buffer laid out that way is what it reads.
    let mut info = Vec::with_capacity(2 * std::mem::size_of::<libc::c_int>() + data.len());
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(data);
    // SAFETY: the kernel reads a rand_pool_info through the pointer: two ints and then `len`
    // bytes, all inside `info`, which outlives the call; it writes nothing.
    check(unsafe { libc::ioctl(random.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) }).map(drop)
}

/// Reseeds the kernel's CRNG from its input pool now (RNDRESEEDCRNG; needs CAP_SYS_ADMIN; fails
/// with ENODATA while the CRNG has never been initialised).
pub fn reseed_crng(random: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: this ioctl takes no argument and touches no user memory.
    check(unsafe { libc::ioctl(random.as_raw_fd(), RNDRESEEDCRNG) }).map(drop)
}

// ---------------------------------------------------------------------------------------------
// vsock

/// `_IO(7, 0xb9)` from linux/vm_sockets.h.
const IOCTL_VM_SOCKETS_GET_LOCAL_CID: libc::c_ulong = 0x7b9;

/// This machine's vsock context id as a guest; `VMADDR_CID_ANY` (u32::MAX) when no
/// guest-to-host transport (no virtio-vsock device) is present.
pub fn vsock_local_cid() -> io::Result<u32> {
    let dev = std::fs::File::open("/dev/vsock")?;
    let mut cid: libc::c_uint = libc::VMADDR_CID_ANY;
    // SAFETY: this ioctl writes one unsigned int through the pointer, which is valid.
    check(unsafe { libc::ioctl(dev.as_raw_fd(), IOCTL_VM_SOCKETS_GET_LOCAL_CID, &mut cid) })?;
    Ok(cid)
}

/// A listening AF_VSOCK stream socket on `port` for any CID.
pub fn vsock_listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments returns a new descriptor or -1.
    let fd =
        owned(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    let addr = libc::sockaddr_vm {
        svm_family: libc::AF_VSOCK as libc::sa_family_t,
        svm_reserved1: 0,
        svm_port: port,
        svm_cid: libc::VMADDR_CID_ANY,
        svm_zero: [0; 4],
    };
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    let addr_ptr = (&raw const addr).cast::<libc::sockaddr>();
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes and outlives the call.
    check(unsafe { libc::bind(fd.as_raw_fd(), addr_ptr, len) })?;
    // SAFETY: listen(2) on our own bound socket.
    check(unsafe { libc::listen(fd.as_raw_fd(), 16) })?;
    Ok(fd)
}

/// Accepts one connection on a listening socket.
pub fn accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let fd = listener.as_raw_fd();
    // SAFETY: accept4(2) on a valid socket; the peer address is not requested.
    owned(unsafe {
        libc::accept4(
            fd,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Files

/// `struct open_how` of linux/openat2.h (libc's is non-exhaustive).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// A directory to resolve relative paths from: an open descriptor or the working directory.
#[derive(Debug, Clone, Copy)]
pub enum Dir<'a> {
    Fd(BorrowedFd<'a>),
    Cwd,
}

impl Dir<'_> {
    fn raw(self) -> RawFd {
        match self {
            Dir::Fd(fd) => fd.as_raw_fd(),
            Dir::Cwd => libc::AT_FDCWD,
        }
    }
}

/// openat2(2): opens `path` relative to `dir` with `flags` (O_CLOEXEC is added), `mode` for
/// created files, and RESOLVE_* flags in `resolve`.
pub fn openat2(
    dir: Dir<'_>,
    path: &CStr,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let how = OpenHow {
        flags: u64::from((flags | libc::O_CLOEXEC).cast_unsigned()),
        mode: u64::from(mode),
        resolve,
    };
    let size = std::mem::size_of::<OpenHow>();
    // SAFETY: `path` is NUL-terminated and `how` a valid open_how of `size` bytes; both outlive
    // the call, which returns a new descriptor or -1.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.raw(),
            path.as_ptr(),
            &raw const how,
            size,
        )
    };
    owned(libc::c_int::try_from(rc).unwrap_or(-1))
}

/// mkdirat(2).
pub fn mkdirat(dir: Dir<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and outlives the call.
    check(unsafe { libc::mkdirat(dir.raw(), name.as_ptr(), mode) }).map(drop)
}

/// renameat(2).
pub fn renameat(from_dir: Dir<'_>, from: &CStr, to_dir: Dir<'_>, to: &CStr) -> io::Result<()> {
    // SAFETY: both names are NUL-terminated and outlive the call; the directories are
    // descriptors open for it (or AT_FDCWD).
    check(unsafe { libc::renameat(from_dir.raw(), from.as_ptr(), to_dir.raw(), to.as_ptr()) })
        .map(drop)
}

/// unlinkat(2); `remove_dir` adds AT_REMOVEDIR.
pub fn unlinkat(dir: Dir<'_>, name: &CStr, remove_dir: bool) -> io::Result<()> {
    let flags = if remove_dir { libc::AT_REMOVEDIR } else { 0 };
    // SAFETY: `name` is NUL-terminated and outlives the call.
    check(unsafe { libc::unlinkat(dir.raw(), name.as_ptr(), flags) }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn boottime_is_positive_and_monotonic() {
        let a = boottime();
        let b = boottime();
        assert!(a > Duration::ZERO);
        assert!(b >= a);
    }

    #[test]
    fn hostname_matches_proc() {
        let proc = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(hostname().unwrap(), proc.trim());
    }

    #[test]
    fn mem_total_matches_proc_meminfo() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        assert_eq!(mem_total_bytes().unwrap(), kib * 1024);
    }

    #[test]
    fn eventfd_polls_readable_only_after_a_write() {
        use std::io::Write;
        let fd = eventfd().unwrap();
        let mut fds = [libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(poll(&mut fds, Some(Duration::ZERO)).unwrap(), 0);
        std::fs::File::from(fd.try_clone().unwrap())
            .write_all(&1u64.to_ne_bytes())
            .unwrap();
        assert_eq!(poll(&mut fds, Some(Duration::ZERO)).unwrap(), 1);
    }

    #[test]
    fn peer_gone_sees_a_closed_peer_and_a_shutdown_but_not_a_live_peer() {
        use std::os::unix::net::UnixStream;
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!peer_gone(a.as_fd()));
        drop(b);
        assert!(peer_gone(a.as_fd()));
        let (c, _d) = UnixStream::pair().unwrap();
        shutdown(c.as_fd());
        assert!(peer_gone(c.as_fd()));
    }

    #[test]
    fn peer_gone_sees_a_reset() {
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;
        // Closing a Unix socket with unread data resets its peer (ECONNRESET), as a vsock
        // transport reset does.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"unread").unwrap();
        drop(b);
        assert!(peer_gone(a.as_fd()));
        let err = a.read(&mut [0u8; 8]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNRESET));
    }

    #[test]
    fn random_ioctls_reach_the_kernel_without_touching_its_pool() {
        // /dev/null has no ioctls: the calls are made (and refused) without any effect on this
        // machine's random pool, which tests must not touch.
        let null = std::fs::File::open("/dev/null").unwrap();
        let err = add_entropy(null.as_fd(), &[7u8; 32]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTTY));
        let err = reseed_crng(null.as_fd()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOTTY));
    }

    #[test]
    fn kill_refuses_nonpositive_pids_and_groups() {
        assert!(kill(0, 0).is_err());
        assert!(kill(-5, 0).is_err());
        assert!(killpg(1, 0).is_err());
        assert!(killpg(0, 0).is_err());
    }

    #[test]
    fn openat2_beneath_refuses_dotdot_escape_with_exdev() {
        let root = std::fs::File::open("/proc").unwrap();
        let root: OwnedFd = root.into();
        let path = CString::new("../etc").unwrap();
        let err = openat2(
            Dir::Fd(root.as_fd()),
            &path,
            libc::O_PATH,
            0,
            libc::RESOLVE_BENEATH,
        )
        .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
    }
}
