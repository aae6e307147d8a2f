//! Volumes: disk slots the host put media in when it restored the VM, mounted where Reseed
//! says, and unmounted before a PowerOff syncs.

use std::path::Path;
use std::time::{Duration, Instant};

use airlock_proto::pb;

use crate::error::ReqError;
use crate::sys;

/// How long a slot's capacity may take to appear (the host's configuration-change interrupt
/// is handled by a kernel worker).
const CAPACITY_WAIT: Duration = Duration::from_secs(5);
/// Where nothing is mounted over.
const RESERVED: &[&str] = &["/proc", "/sys", "/dev", "/run"];

/// Checks a mount request before anything is done.
pub fn check(m: &pb::VolumeMount) -> Result<(), ReqError> {
    let ok_serial = m
        .serial
        .strip_prefix("airlock-slot-")
        .is_some_and(|n| !n.is_empty() && n.len() <= 2 && n.bytes().all(|b| b.is_ascii_digit()));
    if !ok_serial {
        return Err(ReqError::invalid(format!(
            "volume serial {:?} is not a disk slot's",
            m.serial
        )));
    }
    let path = Path::new(&m.path);
    let normal = m.path.len() <= 4096
        && m.path
            .strip_prefix('/')
            .is_some_and(|rest| rest.split('/').all(|seg| !matches!(seg, "" | "." | "..")));
    if !normal {
        return Err(ReqError::invalid(format!(
            "volume path {:?} is not an absolute, normalised path below /",
            m.path
        )));
    }
    if RESERVED.iter().any(|r| path.starts_with(r)) {
        return Err(ReqError::invalid(format!(
            "a volume cannot be mounted at {:?} (under /proc, /sys, /dev or /run)",
            m.path
        )));
    }
    Ok(())
}

/// The block device (`/dev/vdX`) whose serial is `serial`, once its capacity is non-zero.
fn device_of(serial: &str) -> Result<String, ReqError> {
    let deadline = Instant::now() + CAPACITY_WAIT;
    loop {
        let mut found = None;
        for e in std::fs::read_dir("/sys/block")
            .map_err(|e| ReqError::io("/sys/block", &e))?
            .flatten()
        {
            let dir = e.path();
            let s = std::fs::read_to_string(dir.join("serial")).unwrap_or_default();
            if s.trim() == serial {
                let size = std::fs::read_to_string(dir.join("size")).unwrap_or_default();
                found = Some((e.file_name(), size.trim().parse::<u64>().unwrap_or(0)));
                break;
            }
        }
        match found {
            Some((name, size)) if size > 0 => {
                return Ok(format!("/dev/{}", name.to_string_lossy()));
            }
            _ if Instant::now() >= deadline => {
                return Err(ReqError::new(
                    pb::ErrorCode::NotFound,
                    format!("disk slot {serial} has no media"),
                ));
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Mounts one volume (see `proto/agent.proto`, VolumeMount).
pub fn mount(m: &pb::VolumeMount) -> Result<(), ReqError> {
    let dev = device_of(&m.serial)?;
    std::fs::create_dir_all(&m.path).map_err(|e| ReqError::io(&m.path, &e))?;
    if m.read_only {
        let f = std::fs::File::open(&dev).map_err(|e| ReqError::io(&dev, &e))?;
        sys::set_block_read_only(&f).map_err(|e| ReqError::io("BLKROSET", &e))?;
    }
    sys::mount_ext4(&dev, &m.path, m.read_only).map_err(|e| {
        let hint = if m.read_only {
            " (a volume that was not detached cleanly must be attached read-write once first)"
        } else {
            ""
        };
        ReqError::io(&format!("mounting the volume at {}{hint}", m.path), &e)
    })
}

/// Unmounts `paths` (the volumes mounted), last first; failures are reported on the console
/// and the rest go on.
pub fn unmount_all(paths: &[String]) {
    for p in paths.iter().rev() {
        if let Err(e) = sys::unmount(p) {
            eprintln!("airlock-agent: unmounting the volume at {p}: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(serial: &str, path: &str) -> pb::VolumeMount {
        pb::VolumeMount {
            serial: serial.into(),
            path: path.into(),
            read_only: false,
        }
    }

    #[test]
    fn a_mount_names_a_slot_and_a_normal_path_outside_the_kernel_filesystems() {
        assert!(check(&m("airlock-slot-0", "/data")).is_ok());
        assert!(check(&m("airlock-slot-7", "/home/user/work")).is_ok());
        for (serial, path) in [
            ("airlock-root", "/data"),
            ("airlock-slot-", "/data"),
            ("airlock-slot-123", "/data"),
            ("airlock-slot-0", "/"),
            ("airlock-slot-0", "data"),
            ("airlock-slot-0", "/data/../etc"),
            ("airlock-slot-0", "/data/"),
            ("airlock-slot-0", "/data/./x"),
            ("airlock-slot-0", "/proc/x"),
            ("airlock-slot-0", "/run"),
            ("airlock-slot-0", "/dev/shm"),
        ] {
            assert!(check(&m(serial, path)).is_err(), "{serial} {path}");
        }
    }
}
