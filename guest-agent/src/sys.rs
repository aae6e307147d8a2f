//! The agent's only unsafe code: thin wrappers over libc calls.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;

/// One filesystem the agent mounts at start.
#[derive(Debug)]
pub struct MountSpec {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: libc::c_ulong,
}

/// Kernel filesystems every process in the guest expects.
pub const BASE_MOUNTS: &[MountSpec] = &[
    MountSpec {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
    },
    MountSpec {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
    },
    MountSpec {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
    },
];

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Mounts `m`; an already mounted target (EBUSY) counts as success.
pub fn mount_fs(m: &MountSpec) -> io::Result<()> {
    let (src, tgt, fst) = (cstr(m.source)?, cstr(m.target)?, cstr(m.fstype)?);
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; data is null.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fst.as_ptr(),
            m.flags,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EBUSY) {
        Ok(())
    } else {
        Err(err)
    }
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
    let rc = unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sleeps until a signal arrives.
pub fn pause() {
    // SAFETY: pause(2) takes no arguments.
    unsafe {
        libc::pause();
    }
}
