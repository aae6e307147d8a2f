//! Taking a snapshot a VMM wrote into the templates. The VMM wrote it into its run directory
//! (the one place its jail can write) and may still run (SnapshotSandbox) and hold descriptors
//! of those files: a template's files are therefore copies the daemon makes itself, read
//! through descriptors opened without following links, so no writer of the VMM's can reach a
//! template that other sandboxes (other tenants' too) restore from. Holes stay holes: a memory
//! file is mostly empty.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The files a snapshot has; nothing else is taken. The layer of a copy-on-write root disk
/// (`layer`, `layer.map`) is optional: a VM without one leaves them empty, a snapshot prepared
/// before they existed has none.
const SNAPSHOT_FILES: [(&str, bool); 4] = [
    ("state", true),
    ("memory", true),
    ("layer", false),
    ("layer.map", false),
];
/// Copy buffer.
const CHUNK: usize = 1 << 20;

/// Copies the snapshot in `from` (written by a VMM) to `to` (created: mode 0755, its files
/// 0644, owned by the daemon); returns the bytes copied.
pub fn import(from: &Path, to: &Path) -> io::Result<u64> {
    std::fs::create_dir(to)?;
    std::fs::set_permissions(to, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let mut copied = 0;
    for (name, required) in SNAPSHOT_FILES {
        let src = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(from.join(name))
        {
            Ok(f) => f,
            Err(e) if !required && e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("snapshot file {name}: {e}"),
                ));
            }
        };
        if !src.metadata()?.file_type().is_file() {
            return Err(io::Error::other(format!(
                "snapshot file {name} is not a plain file"
            )));
        }
        let dst = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(to.join(name))?;
        // Readable by the VMMs that restore it (their own uids), whatever the daemon's umask.
        dst.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        copied += copy_sparse(&src, &dst)?;
        dst.sync_all()?;
    }
    Ok(copied)
}

/// Copies `src` into the empty `dst`, its data extents only (`SEEK_DATA`/`SEEK_HOLE`), so
/// holes stay holes; returns the data bytes copied.
fn copy_sparse(src: &File, dst: &File) -> io::Result<u64> {
    let len = src.metadata()?.len();
    dst.set_len(len)?;
    let mut buf = vec![0u8; CHUNK];
    let mut copied = 0;
    let mut pos = 0;
    while pos < len {
        let Some(start) = seek(src, pos, libc::SEEK_DATA)? else {
            break; // only a hole is left
        };
        let end = seek(src, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = start;
        while at < end {
            let n = ((end - at) as usize).min(CHUNK);
            let got = src.read_at(&mut buf[..n], at)?;
            if got == 0 {
                return Err(io::Error::other(
                    "the snapshot file shrank while it was copied",
                ));
            }
            dst.write_all_at(&buf[..got], at)?;
            at += got as u64;
        }
        copied += end - start;
        pos = end;
    }
    Ok(copied)
}

/// `lseek(fd, offset, whence)`; `None` where there is no more data (`ENXIO`).
fn seek(f: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let off = libc::off_t::try_from(offset).map_err(|_| io::Error::other("offset too large"))?;
    // SAFETY: lseek(2) on a descriptor we own; it only moves the file offset.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(r as u64))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn a_template_is_a_copy_no_writer_of_the_vmm_reaches() {
        // The daemon's umask (the test's own would hide a file the VMMs cannot read).
        // SAFETY: umask(2) only sets the process's file-creation mask.
        unsafe { libc::umask(0o077) };
        let dir = std::env::temp_dir().join(format!("airlock-import-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (from, to) = (dir.join("run/snapshot"), dir.join("templates/tpl-1"));
        std::fs::create_dir_all(&from).unwrap();
        std::fs::create_dir_all(dir.join("templates")).unwrap();
        std::fs::write(from.join("state"), b"state").unwrap();
        std::fs::write(from.join("layer.map"), b"map").unwrap();
        // A 64 MiB memory file with 4 KiB of data in its middle.
        let memory = File::create(from.join("memory")).unwrap();
        memory.set_len(64 << 20).unwrap();
        memory.write_all_at(&[7u8; 4096], 32 << 20).unwrap();
        let bytes = import(&from, &to).unwrap();
        assert!(bytes < 1 << 20, "holes stay holes: {bytes} bytes copied");
        let copy = File::open(to.join("memory")).unwrap();
        let meta = copy.metadata().unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(meta.blocks() * 512 < 1 << 20, "sparse on disk");
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        let state = std::fs::metadata(to.join("state")).unwrap();
        assert_eq!(state.permissions().mode() & 0o777, 0o644);
        assert_eq!(std::fs::read(to.join("layer.map")).unwrap(), b"map");
        assert!(
            !to.join("layer").exists(),
            "an absent optional file stays absent"
        );
        let dir_mode = std::fs::metadata(&to).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o755);
        let mut byte = [0u8; 1];
        copy.read_at(&mut byte, (32 << 20) + 10).unwrap();
        assert_eq!(byte[0], 7);
        // The VMM's kept descriptor writes on: the template does not change.
        memory.write_all_at(&[9u8; 4096], 32 << 20).unwrap();
        copy.read_at(&mut byte, (32 << 20) + 10).unwrap();
        assert_eq!(byte[0], 7, "the template is not the VMM's file");
        // A link in place of a snapshot file is refused, its target untouched.
        let secret = dir.join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::remove_file(from.join("state")).unwrap();
        std::os::unix::fs::symlink(&secret, from.join("state")).unwrap();
        assert!(import(&from, &dir.join("templates/tpl-2")).is_err());
        let mode = std::fs::metadata(&secret).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
