//! Identities: the ids an execution's child drops to ([`drop_privileges`], in the forked
//! child) and the file-system ids a file request takes on its thread ([`FsIds`]).

use std::io;

use super::check;

/// The ids an unprivileged child takes (built before the fork: the child allocates nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
    pub groups: Vec<libc::gid_t>,
    /// Also empty the bounding set and set no_new_privs, so that nothing gives root back (the
    /// sandbox's no_root). Without it a setuid binary (sudo) may.
    pub lock_down: bool,
}

/// Highest capability number tried when emptying the bounding set (EINVAL past the kernel's
/// last one ends the loop).
const MAX_CAP: libc::c_ulong = 63;

/// Runs in a forked child: see [`super::prepare_child`]. Raw system calls only: libc's set*id
/// wrappers synchronise the ids of every thread, machinery a forked child must not rely on.
pub(super) fn drop_privileges(c: &Credentials) -> io::Result<()> {
    if c.lock_down {
        empty_bounding_set()?;
    }
    let syscall = |rc: libc::c_long| {
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    // SAFETY: the pointer and length describe `c.groups`, a live slice of gid_t.
    syscall(unsafe { libc::syscall(libc::SYS_setgroups, c.groups.len(), c.groups.as_ptr()) })?;
    // SAFETY: setresgid(2)/setresuid(2) take integers only.
    syscall(unsafe { libc::syscall(libc::SYS_setresgid, c.gid, c.gid, c.gid) })?;
    // SAFETY: as above.
    syscall(unsafe { libc::syscall(libc::SYS_setresuid, c.uid, c.uid, c.uid) })?;
    if !c.lock_down {
        return Ok(());
    }
    // SAFETY: prctl(2) with PR_SET_NO_NEW_PRIVS and integer arguments touches no memory.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }).map(drop)
}

/// Drops every capability from the calling process's bounding set (in a forked child).
fn empty_bounding_set() -> io::Result<()> {
    for cap in 0..=MAX_CAP {
        // SAFETY: prctl(2) with PR_CAPBSET_DROP and an integer argument touches no memory.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                break;
            }
            return Err(e);
        }
    }
    Ok(())
}

/// The calling thread's file-system ids and groups, set to an account's for as long as this
/// lives (file requests run as the account they name). The kernel keeps these per thread, so
/// raw system calls change the connection thread alone; as the file-system uid leaves 0 the
/// kernel clears the thread's file capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER, ...) and gives
/// them back when it returns to 0.
#[derive(Debug)]
pub struct FsIds {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

impl FsIds {
    pub fn assume(c: &Credentials) -> io::Result<Self> {
        let saved = Self {
            uid: set_fsuid(u32::MAX),
            gid: set_fsgid(u32::MAX),
            groups: thread_groups()?,
        };
        set_thread_groups(&c.groups)?;
        set_fsgid(c.gid);
        set_fsuid(c.uid);
        // Neither call reports failure: read the ids back.
        if (set_fsuid(u32::MAX), set_fsgid(u32::MAX)) != (c.uid, c.gid) {
            drop(saved);
            return Err(io::Error::from_raw_os_error(libc::EPERM));
        }
        Ok(saved)
    }
}

impl Drop for FsIds {
    fn drop(&mut self) {
        // The uid first, so that the capabilities needed for the rest come back.
        set_fsuid(self.uid);
        set_fsgid(self.gid);
        let _ = set_thread_groups(&self.groups);
    }
}

/// setfsuid(2) for the calling thread; returns the previous id (`u32::MAX`, never valid, only
/// reads it).
fn set_fsuid(uid: libc::uid_t) -> libc::uid_t {
    // SAFETY: setfsuid(2) takes an integer and touches no memory.
    let prev = unsafe { libc::syscall(libc::SYS_setfsuid, uid) };
    libc::uid_t::try_from(prev).unwrap_or(libc::uid_t::MAX)
}

/// setfsgid(2) for the calling thread, as [`set_fsuid`].
fn set_fsgid(gid: libc::gid_t) -> libc::gid_t {
    // SAFETY: setfsgid(2) takes an integer and touches no memory.
    let prev = unsafe { libc::syscall(libc::SYS_setfsgid, gid) };
    libc::gid_t::try_from(prev).unwrap_or(libc::gid_t::MAX)
}

fn thread_groups() -> io::Result<Vec<libc::gid_t>> {
    let mut groups = vec![0 as libc::gid_t; 256];
    // SAFETY: the pointer and length describe `groups`, a writable buffer of gid_t.
    let n = check(unsafe { libc::getgroups(256, groups.as_mut_ptr()) })?;
    groups.truncate(usize::try_from(n).unwrap_or(0));
    Ok(groups)
}

/// setgroups(2) for the calling thread only.
fn set_thread_groups(groups: &[libc::gid_t]) -> io::Result<()> {
    // SAFETY: the pointer and length describe `groups`, a live slice of gid_t.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
