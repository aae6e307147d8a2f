//! What the agent does as PID 1 before it serves: kernel filesystems, scratch space, host name;
//! and the console lines that tests and benchmarks wait for.
//!
//! Every system call costs real time on the nested-KVM build machines (the guest kernel is
//! emulated), so this path does as few as it can and nothing it does not need.

use std::io::Write;
use std::path::Path;

use crate::sys::{self, MountSpec};

/// Printed on the console once the agent can serve; tests and benchmarks wait for it.
pub const READY_LINE: &str = "airlock: userspace up";
/// Where the per-execution cgroups go inside the VM.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup/airlock";
/// Where the agent keeps state files inside the VM (on the /run tmpfs).
pub const STATE_DIR: &str = "/run/airlock";

const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// Mounted in this order; a failure is reported and the agent carries on.
const MOUNTS: &[MountSpec] = &[
    MountSpec {
        source: "proc",
        target: "/proc",
        fstype: "proc",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: None,
    },
    MountSpec {
        source: "sysfs",
        target: "/sys",
        fstype: "sysfs",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: None,
    },
    MountSpec {
        source: "devtmpfs",
        target: "/dev",
        fstype: "devtmpfs",
        flags: libc::MS_NOSUID,
        data: None,
    },
    MountSpec {
        source: "cgroup2",
        target: "/sys/fs/cgroup",
        fstype: "cgroup2",
        flags: NOSUID_NODEV | libc::MS_NOEXEC,
        data: None,
    },
    MountSpec {
        source: "tmpfs",
        target: "/tmp",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
    },
    MountSpec {
        source: "tmpfs",
        target: "/run",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=0755"),
    },
    MountSpec {
        source: "tmpfs",
        target: "/dev/shm",
        fstype: "tmpfs",
        flags: NOSUID_NODEV,
        data: Some("mode=1777"),
    },
];

/// Mounts the filesystems every process expects and sets the host name from /etc/hostname. A
/// writable root (a copy-on-write disk, bounded by the sandbox's space) keeps /tmp on itself;
/// a read-only one gets a tmpfs there.
pub fn init_system() {
    let root_writable = crate::disk::root_writable();
    for m in MOUNTS {
        if m.target == "/tmp" && root_writable {
            continue;
        }
        let mut result = sys::mount_fs(m);
        if matches!(&result, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
            // devtmpfs has no /dev/shm, a minimal image may lack /run: create and retry.
            result = std::fs::create_dir(m.target).and_then(|()| sys::mount_fs(m));
        }
        if let Err(e) = result {
            eprintln!("airlock-agent: mount {} on {}: {e}", m.fstype, m.target);
        }
    }
    set_hostname(Path::new("/etc/hostname"));
    init_network(Path::new("/sys/class/net/eth0"));
}

/// Brings up `lo`, and, if the VM has a network card (`eth0`), gives it the guest's address
/// and the default route through the gateway (the same in every sandbox; see
/// `airlock_proto::GUEST_IPV4`).
fn init_network(eth0: &Path) {
    if let Err(e) = sys::configure_interface(c"lo", None) {
        eprintln!("airlock-agent: bringing up lo: {e}");
    }
    if !eth0.exists() {
        return;
    }
    let addr = (airlock_proto::GUEST_IPV4, airlock_proto::GUEST_PREFIX);
    if let Err(e) = sys::configure_interface(c"eth0", Some(addr)) {
        eprintln!("airlock-agent: configuring eth0: {e}");
        return;
    }
    if let Err(e) = sys::add_default_route(airlock_proto::GATEWAY_IPV4) {
        eprintln!("airlock-agent: default route: {e}");
    }
}

fn set_hostname(file: &Path) {
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    let name = text.trim();
    if !name.is_empty()
        && let Err(e) = sys::set_hostname(name)
    {
        eprintln!("airlock-agent: sethostname {name:?}: {e}");
    }
}

/// Whether the VM may have a virtio-vsock device: false only when the kernel says it has no
/// guest-to-host transport (local CID `VMADDR_CID_ANY`); when it cannot be asked (no
/// `/dev/vsock`), listening is tried.
pub fn vsock_device_present() -> bool {
    sys::vsock_local_cid().map_or(true, |cid| cid != libc::VMADDR_CID_ANY)
}

/// Prints `line` on the console (stdout) in one write.
pub fn console(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(format!("{line}\n").as_bytes());
    let _ = out.flush();
}

/// The line after [`READY_LINE`]: which CPUs the kernel brought up.
pub fn cpus_line(cpus_online: &str) -> String {
    format!("airlock: cpus online {}", cpus_online.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_line_is_trimmed() {
        assert_eq!(cpus_line("0-1\n"), "airlock: cpus online 0-1");
    }

    #[test]
    fn mounts_start_with_proc_sys_dev() {
        let targets: Vec<_> = MOUNTS.iter().map(|m| m.target).collect();
        assert_eq!(targets[..3], ["/proc", "/sys", "/dev"]);
        assert!(targets.contains(&"/sys/fs/cgroup"));
        assert!(targets.contains(&"/tmp"));
        assert!(targets.contains(&"/run"));
    }
}
