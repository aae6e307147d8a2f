//! The sandbox's writable space on a writable root.
//!
//! A writable root is a copy-on-write disk: the host keeps the sandbox's writes in an overlay
//! that may hold `Reseed.disk_bytes` and no more (a write past it fails on the host). The
//! filesystem on it is far larger (the base image is made large and sparse, so that any
//! sandbox's space fits), so the agent holds the rest of its free space back with ext4's
//! reserved clusters, which bind every writer, root included: programs get ENOSPC where the
//! sandbox's space ends, before the host would refuse a write. Part of the space is left for
//! what ext4 writes beside file data (bitmaps, inode tables, directories; the image has no
//! journal), see [`metadata_slack`].

use std::io;

use crate::sys;

/// The root filesystem's ext4 directory in sysfs (the root is `/dev/vda`).
const ROOT_EXT4_SYSFS: &str = "/sys/fs/ext4/vda";
/// ext4's own reserve at mount, at most this many clusters; never less is held back.
const MIN_RESERVE_CLUSTERS: u64 = 4096;

/// Of a sandbox's `bytes`, what ext4's metadata may take: 4 % and 2 MiB (inode tables and
/// directories of ~100,000 small files in a GiB take about 3 %).
pub fn metadata_slack(bytes: u64) -> u64 {
    bytes / 25 + (2 << 20)
}

/// Whether `/` is mounted read-write (a copy-on-write root).
pub fn root_writable() -> bool {
    sys::fs_space("/").is_ok_and(|(_, _, _, read_only)| !read_only)
}

/// The clusters to hold back so that `allowed` more can be allocated of `free`.
pub fn reserve_for(free: u64, allowed: u64) -> u64 {
    free.saturating_sub(allowed)
        .max(MIN_RESERVE_CLUSTERS.min(free))
}

/// Lets at most `bytes` (less [`metadata_slack`]) more be written to `/`; returns the bytes
/// available to programs afterwards.
pub fn limit_root_space(bytes: u64) -> io::Result<u64> {
    let (block, free, _, read_only) = sys::fs_space("/")?;
    if read_only || block == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the root filesystem is read-only",
        ));
    }
    let allowed = bytes.saturating_sub(metadata_slack(bytes)) / block;
    let reserve = reserve_for(free, allowed);
    std::fs::write(
        format!("{ROOT_EXT4_SYSFS}/reserved_clusters"),
        reserve.to_string(),
    )?;
    let (_, _, available, _) = sys::fs_space("/")?;
    Ok(available * block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_leaves_the_sandbox_its_space_and_ext4_its_own_minimum() {
        // 80 GiB free in 4 KiB blocks, a sandbox of 1 GiB less slack.
        let free = 80 << 18;
        let allowed = ((1u64 << 30) - metadata_slack(1 << 30)) / 4096;
        assert_eq!(free - reserve_for(free, allowed), allowed);
        // More asked than is free: ext4 keeps its minimum, the sandbox gets the rest.
        assert_eq!(reserve_for(10_000, 50_000), MIN_RESERVE_CLUSTERS);
        assert_eq!(reserve_for(100, 50_000), 100, "never more than is free");
        assert_eq!(metadata_slack(1 << 30), (1 << 30) / 25 + (2 << 20));
    }
}
