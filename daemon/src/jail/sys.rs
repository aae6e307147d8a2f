//! The system calls of the jail, in one place: `clone3` into new namespaces, the child's setup
//! until `execve` (mounts, `pivot_root`, limits, capabilities, uid), and reaping through a
//! pidfd.
//!
//! The child runs between `clone3` and `execve` in a copy of a multi-threaded process, so it
//! may only make async-signal-safe calls: it never allocates, locks or panics. Its first steps
//! close every descriptor it inherited but its stdio and two pipes. Everything it
//! needs (paths as C strings, pointer arrays) is prepared by the parent in a [`Plan`]; each
//! step is one system call whose failure is reported to the parent as `(step, errno)` over a
//! close-on-exec pipe, which `execve` closes on success.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// What the child does, prepared by the parent.
#[derive(Debug)]
pub struct Plan {
    /// The jail; `None`: only the descriptors, the session and the exec.
    pub jail: Option<JailPlan>,
    pub binary: CString,
    /// Null-terminated pointer arrays into `_argv`/`_envp`.
    pub argv: Vec<*const libc::c_char>,
    pub envp: Vec<*const libc::c_char>,
    pub _argv: Vec<CString>,
    pub _envp: Vec<CString>,
    /// Descriptors that become 0, 1 and 2, and the files that keep them open.
    pub stdio: [RawFd; 3],
    pub _stdio: [std::fs::File; 3],
    /// The network namespace to enter instead of a new empty one, and the TAP to keep open
    /// (at its number) across exec; `_net` keeps both open until the child has them.
    pub net: Option<NetFds>,
    pub _net: Option<airlock_netcfg::NetnsWithTap>,
}

/// The descriptors of a VMM's network (see [`Plan::net`]).
#[derive(Debug, Clone, Copy)]
pub struct NetFds {
    pub netns: RawFd,
    pub tap: RawFd,
}

/// The jail part of a [`Plan`].
#[derive(Debug)]
pub struct JailPlan {
    /// The (host) directory the jail's tmpfs is mounted on, then made the root.
    pub root: CString,
    pub tmpfs_options: CString,
    /// Directories to create in the tmpfs, parents first.
    pub dirs: Vec<CString>,
    /// Empty files to create in the tmpfs as mount points of file binds.
    pub files: Vec<CString>,
    pub binds: Vec<Bind>,
    /// `root/dev/kvm` and the device number of the host's `/dev/kvm`.
    pub kvm_node: CString,
    pub kvm_rdev: libc::dev_t,
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
    pub rlimits: Vec<(libc::__rlimit_resource_t, libc::rlim_t)>,
}

/// One bind mount of a host path into the jail.
#[derive(Debug)]
pub struct Bind {
    pub source: CString,
    pub target: CString,
    /// The flags the bind is remounted with (`MS_RDONLY`, `MS_NOEXEC`, ...).
    pub flags: libc::c_ulong,
}

/// The child's steps, for the error message (index = step number).
pub const STEPS: &[&str] = &[
    "set up stdin/stdout/stderr",
    "enter the sandbox's network namespace",
    "keep the TAP open across exec",
    "close inherited descriptors",
    "wait for the parent",
    "make the mount tree private",
    "mount the jail's tmpfs",
    "create a directory in the jail",
    "create a mount point in the jail",
    "bind-mount a host path",
    "remount a bind mount",
    "create /dev/kvm",
    "hand /dev/kvm to the jail's uid",
    "enter the jail directory",
    "pivot_root",
    "detach the old root",
    "chdir /",
    "make the jail's root read-only",
    "set a resource limit",
    "set no_new_privs",
    "drop the capability bounding set",
    "clear the ambient capabilities",
    "drop supplementary groups",
    "set the gid",
    "set the uid",
    "clear the capabilities",
    "start a session",
    "exec the VMM",
];

const NAMESPACES: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWNET) as u64;

/// A started child: its pid (in our namespace) and a pidfd.
#[derive(Debug)]
pub struct Child {
    pub pid: u32,
    pub pidfd: OwnedFd,
    /// Written once to let the child go on; dropping it unsent makes the child exit.
    go: OwnedFd,
    /// Where the child reports a failed step.
    errors: OwnedFd,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the 2-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just created and is owned by nobody else.
    let read = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    // SAFETY: as for `read`.
    let write = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    // Above 2, which the child's stdio takes (a daemon started with a closed stdin could get
    // 0 here); try_clone duplicates to 3 or more.
    let above_stdio = |fd: OwnedFd| {
        if fd.as_raw_fd() > 2 {
            Ok(fd)
        } else {
            fd.try_clone()
        }
    };
    Ok((above_stdio(read)?, above_stdio(write)?))
}

/// The namespaces the child is cloned into: none without a jail; with one, all of
/// [`NAMESPACES`] but the network namespace when the plan brings its own.
fn namespaces(plan: &Plan) -> u64 {
    match (&plan.jail, &plan.net) {
        (None, _) => 0,
        (Some(_), None) => NAMESPACES,
        (Some(_), Some(_)) => NAMESPACES & !(libc::CLONE_NEWNET as u64),
    }
}

/// Clones the child (in new namespaces when `plan.jail` is set); it waits until [`Child::go`].
pub fn clone_child(plan: &Plan) -> io::Result<Child> {
    let (go_read, go) = pipe()?;
    let (errors, err_write) = pipe()?;
    let mut pidfd: RawFd = -1;
    let mut args = libc::clone_args {
        flags: libc::CLONE_PIDFD as u64 | namespaces(plan),
        pidfd: std::ptr::addr_of_mut!(pidfd) as u64,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: libc::SIGCHLD as u64,
        stack: 0,
        stack_size: 0,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: 0,
    };
    // SAFETY: clone3(2) without CLONE_VM and without a stack behaves like fork(2): the child
    // gets a copy of this address space and continues here on its copy of this stack. The
    // child only runs `child_main`, which makes async-signal-safe system calls on memory
    // prepared before the call and never returns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            std::ptr::addr_of_mut!(args),
            std::mem::size_of::<libc::clone_args>(),
        )
    };
    if rc == 0 {
        child_main(plan, go_read.as_raw_fd(), err_write.as_raw_fd());
    }
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    drop(go_read);
    drop(err_write);
    // SAFETY: CLONE_PIDFD stored a new descriptor for the child in `pidfd`, owned by us.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok(Child {
        pid: rc as u32,
        pidfd,
        go,
        errors,
    })
}

impl Child {
    /// Lets the child set itself up and exec; returns once it has exec'd, or the step that
    /// failed (the child has then exited; it is reaped here).
    pub fn go(self) -> io::Result<(u32, OwnedFd)> {
        let byte = [1u8];
        // SAFETY: write(2) of one byte from a live buffer to our pipe end.
        let n = unsafe { libc::write(self.go.as_raw_fd(), byte.as_ptr().cast(), 1) };
        if n != 1 {
            let e = io::Error::last_os_error();
            self.kill_and_reap();
            return Err(e);
        }
        let mut report = [0u8; 8];
        let mut got = 0;
        while got < report.len() {
            // SAFETY: read(2) into the unfilled rest of a live 8-byte buffer.
            let n = unsafe {
                libc::read(
                    self.errors.as_raw_fd(),
                    report[got..].as_mut_ptr().cast(),
                    report.len() - got,
                )
            };
            if n == 0 {
                break;
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                self.kill_and_reap();
                return Err(e);
            }
            got += n as usize;
        }
        if got == 0 {
            // execve closed the pipe: the VMM runs.
            return Ok((self.pid, self.pidfd));
        }
        let step = u32::from_ne_bytes([report[0], report[1], report[2], report[3]]) as usize;
        let errno = i32::from_ne_bytes([report[4], report[5], report[6], report[7]]);
        let _ = wait_blocking(&self.pidfd);
        let what = STEPS.get(step).copied().unwrap_or("an unknown step");
        let e = io::Error::from_raw_os_error(errno);
        Err(io::Error::new(e.kind(), format!("jail: {what}: {e}")))
    }

    /// Kills the waiting child and reaps it (a setup step in the parent failed).
    pub fn kill_and_reap(self) {
        let _ = send_signal(&self.pidfd, libc::SIGKILL);
        let _ = wait_blocking(&self.pidfd);
    }
}

/// Sends `signal` through a pidfd (never hits a recycled pid).
pub fn send_signal(pidfd: &OwnedFd, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal(2) with a pidfd we own, no siginfo and no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A pidfd for `pid`, which need not be our child (`pidfd_open(2)`).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Reaps the child if it has exited (`WNOHANG`) or waits for it (`block`).
pub fn wait_pidfd(pidfd: &OwnedFd, block: bool) -> io::Result<Option<ExitStatus>> {
    // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: waitid(2) on a pidfd we own, writing into a live siginfo_t.
        let rc = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                flags,
            )
        };
        if rc == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    // SAFETY: waitid filled `info` for SIGCHLD, whose union member holds pid and status.
    let pid = unsafe { info.si_pid() };
    // SAFETY: as for `pid`.
    let status = unsafe { info.si_status() };
    if pid == 0 {
        return Ok(None);
    }
    let raw = match info.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    };
    Ok(Some(ExitStatus::from_raw(raw)))
}

/// Waits for the child to exit and reaps it.
pub fn wait_blocking(pidfd: &OwnedFd) -> io::Result<ExitStatus> {
    wait_pidfd(pidfd, true)?.ok_or_else(|| io::Error::other("waitid returned no child"))
}

/// The child: set up, then exec. Never returns.
fn child_main(plan: &Plan, go: RawFd, errors: RawFd) -> ! {
    let mut step = 0usize;
    // Runs one step: a system call returning -1 on failure.
    macro_rules! try_step {
        ($call:expr) => {{
            // SAFETY: each call below is an async-signal-safe system call whose pointer
            // arguments point into `plan`, which the parent built before clone3 and which
            // this copy of its memory keeps alive and unchanged.
            let rc = unsafe { $call };
            if rc == -1 {
                fail(errors, step);
            }
        }};
    }
    for (target, fd) in plan.stdio.iter().enumerate() {
        try_step!(libc::dup2(*fd, target as i32));
    }
    step += 1;
    if let Some(net) = &plan.net {
        try_step!(libc::setns(net.netns, libc::CLONE_NEWNET));
        step += 1;
        try_step!(libc::fcntl(net.tap, libc::F_SETFD, 0));
        step += 1;
    } else {
        step += 2;
    }
    // The daemon's descriptors (its listeners among them) go first: should the daemon die
    // now, none of them outlives it in this child. The two pipes stay (both close-on-exec),
    // and the TAP, if there is one (for the VMM).
    let tap = plan.net.map_or(-1, |n| n.tap);
    let mut keep = [go, errors, tap];
    keep.sort_unstable();
    let mut first: u32 = 3;
    for fd in keep {
        let Ok(fd) = u32::try_from(fd) else { continue };
        if fd < first {
            continue;
        }
        if fd > first {
            try_step!(libc::syscall(libc::SYS_close_range, first, fd - 1, 0u32) as i32);
        }
        first = fd + 1;
    }
    try_step!(libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) as i32);
    step += 1;
    let mut byte = 0u8;
    loop {
        // SAFETY: read(2) of one byte into a live local.
        let n = unsafe { libc::read(go, std::ptr::addr_of_mut!(byte).cast(), 1) };
        match n {
            1 => break,
            -1 if errno() == libc::EINTR => continue,
            // EOF: the parent gave up (a failure there, or it died).
            _ => fail(errors, step),
        }
    }
    step += 1;
    if let Some(j) = &plan.jail {
        enter_jail(j, errors, &mut step);
    }
    step = STEPS.len() - 2;
    try_step!(libc::setsid());
    step += 1;
    try_step!(libc::execve(
        plan.binary.as_ptr(),
        plan.argv.as_ptr(),
        plan.envp.as_ptr()
    ));
    fail(errors, step)
}

/// Runs one jail step: a system call returning -1 on failure, reported as step `*$step`
/// through `$errors` (the child then exits).
macro_rules! jail_step {
    ($errors:expr, $step:expr, $call:expr) => {{
        // SAFETY: as in `child_main`: async-signal-safe system calls on `plan` memory.
        let rc = unsafe { $call };
        if rc == -1 {
            fail($errors, *$step);
        }
    }};
}

/// The jail steps of [`child_main`]: the mount tree, then limits and credentials.
///
/// One ordered list of system calls, each numbered for the error report, run in the cloned
/// child where nothing may allocate: each helper below takes the step counter and advances
/// it past its own steps (in [`STEPS`] order), and none of them allocates.
fn enter_jail(j: &JailPlan, errors: RawFd, step: &mut usize) {
    mount_jail_tmpfs(j, errors, step);
    bind_host_paths(j, errors, step);
    make_kvm_node(j, errors, step);
    pivot_into_jail(j, errors, step);
    drop_privileges(j, errors, step);
}

/// Jail steps: a private mount tree, the jail's tmpfs on its root, and the directories and
/// empty mount-point files in it.
fn mount_jail_tmpfs(j: &JailPlan, errors: RawFd, step: &mut usize) {
    let none = std::ptr::null::<libc::c_char>();
    let root = c"/".as_ptr();
    // The jail's directories get the modes asked for here, whatever the daemon's own umask
    // (0077) is: the VMM's uid must traverse them. umask(2) cannot fail.
    // SAFETY: async-signal-safe; only sets this process's file-creation mask.
    unsafe { libc::umask(0o022) };
    jail_step!(
        errors,
        step,
        libc::mount(
            none,
            root,
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null()
        )
    );
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::mount(
            c"airlock-jail".as_ptr(),
            j.root.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID,
            j.tmpfs_options.as_ptr().cast()
        )
    );
    *step += 1;
    for d in &j.dirs {
        // SAFETY: as in `child_main`: an async-signal-safe system call on `plan` memory.
        let rc = unsafe { libc::mkdir(d.as_ptr(), 0o755) };
        if rc == -1 && errno() != libc::EEXIST {
            fail(errors, *step);
        }
    }
    *step += 1;
    for f in &j.files {
        let flags = libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC;
        // SAFETY: as for mkdir above; the descriptor is closed right away.
        let fd = unsafe { libc::open(f.as_ptr(), flags, 0o600) };
        if fd == -1 {
            fail(errors, *step);
        }
        // SAFETY: `fd` was just opened by this child.
        unsafe { libc::close(fd) };
    }
    *step += 1;
}

/// Jail steps: each host path bind-mounted into the jail, then each bind remounted with its
/// flags.
fn bind_host_paths(j: &JailPlan, errors: RawFd, step: &mut usize) {
    let none = std::ptr::null::<libc::c_char>();
    for b in &j.binds {
        jail_step!(
            errors,
            step,
            libc::mount(
                b.source.as_ptr(),
                b.target.as_ptr(),
                none,
                libc::MS_BIND,
                std::ptr::null()
            )
        );
    }
    *step += 1;
    for b in &j.binds {
        jail_step!(
            errors,
            step,
            libc::mount(
                none,
                b.target.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REMOUNT | b.flags,
                std::ptr::null()
            )
        );
    }
    *step += 1;
}

/// Jail steps: `/dev/kvm` made in the jail and handed to the jail's uid.
fn make_kvm_node(j: &JailPlan, errors: RawFd, step: &mut usize) {
    jail_step!(
        errors,
        step,
        libc::mknod(j.kvm_node.as_ptr(), libc::S_IFCHR | 0o600, j.kvm_rdev)
    );
    *step += 1;
    jail_step!(errors, step, libc::chown(j.kvm_node.as_ptr(), j.uid, j.gid));
    *step += 1;
}

/// Jail steps: the jail's directory becomes the root (the old one detached), read-only.
fn pivot_into_jail(j: &JailPlan, errors: RawFd, step: &mut usize) {
    let none = std::ptr::null::<libc::c_char>();
    let root = c"/".as_ptr();
    let dot = c".".as_ptr();
    jail_step!(errors, step, libc::chdir(j.root.as_ptr()));
    *step += 1;
    // pivot_root(".", "."): the old root ends up stacked on the new one and is detached next,
    // so the jail needs no directory for it.
    jail_step!(
        errors,
        step,
        libc::syscall(libc::SYS_pivot_root, dot, dot) as i32
    );
    *step += 1;
    jail_step!(errors, step, libc::umount2(dot, libc::MNT_DETACH));
    *step += 1;
    jail_step!(errors, step, libc::chdir(root));
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::mount(
            none,
            root,
            none,
            // Not nodev: /dev/kvm lives on this tmpfs (the uid cannot make device nodes).
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID,
            std::ptr::null()
        )
    );
    *step += 1;
}

/// Jail steps: resource limits, no_new_privs, no capabilities left, and the jail's gid and
/// uid.
fn drop_privileges(j: &JailPlan, errors: RawFd, step: &mut usize) {
    for (resource, value) in &j.rlimits {
        let limit = libc::rlimit {
            rlim_cur: *value,
            rlim_max: *value,
        };
        jail_step!(errors, step, libc::setrlimit(*resource, &limit));
    }
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    );
    *step += 1;
    for cap in 0..64 {
        // SAFETY: as in `child_main`: an async-signal-safe system call. EINVAL past the
        // kernel's last capability ends the loop.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } == -1 {
            if errno() == libc::EINVAL {
                break;
            }
            fail(errors, *step);
        }
    }
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0
        )
    );
    *step += 1;
    // Raw system calls, not glibc's wrappers: those would try to change the credentials of
    // every thread glibc remembers from the parent (threads this child does not have).
    jail_step!(
        errors,
        step,
        libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) as i32
    );
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::syscall(libc::SYS_setresgid, j.gid, j.gid, j.gid) as i32
    );
    *step += 1;
    jail_step!(
        errors,
        step,
        libc::syscall(libc::SYS_setresuid, j.uid, j.uid, j.uid) as i32
    );
    *step += 1;
    // Leaving uid 0 cleared the permitted and effective sets; clear the inheritable one too.
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    jail_step!(
        errors,
        step,
        libc::syscall(libc::SYS_capset, &header, data.as_ptr()) as i32
    );
    *step += 1;
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn errno() -> i32 {
    // SAFETY: __errno_location has no preconditions.
    let slot = unsafe { libc::__errno_location() };
    // SAFETY: it points at this thread's errno, always readable.
    unsafe { *slot }
}

/// Reports `(step, errno)` to the parent and exits.
fn fail(errors: RawFd, step: usize) -> ! {
    let e = errno();
    let mut report = [0u8; 8];
    report[..4].copy_from_slice(&(step as u32).to_ne_bytes());
    report[4..].copy_from_slice(&e.to_ne_bytes());
    // SAFETY: write(2) of a live 8-byte buffer, then _exit(2); both async-signal-safe.
    unsafe { libc::write(errors, report.as_ptr().cast(), report.len()) };
    // SAFETY: _exit(2) ends only this child.
    unsafe { libc::_exit(127) }
}
