//! The directory a `snapshot DIR` request writes into, which its caller prepares.
//!
//! A VMM creates no file and no directory once its guest runs (its seccomp filter refuses
//! `openat` with `O_CREAT` or `O_TMPFILE`, and `mkdir`): everything it may write exists before,
//! and `RLIMIT_FSIZE` bounds each of those files, so what a compromised VMM can put on the
//! host's disk is bounded too. For a snapshot that means the caller makes `DIR` and the empty
//! files [`MEMORY_FILE`], [`LAYER_FILE`], [`LAYER_MAP_FILE`] and [`STATE_TMP_FILE`] in it, with
//! [`prepare`]; the VMM truncates and writes them (the layer files only for a VM with a
//! copy-on-write root disk: its blocks, written since the base image), then renames
//! [`STATE_TMP_FILE`] to [`STATE_FILE`] (a directory with a `state` file is a complete
//! snapshot).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

/// The VM's state (vCPUs, devices, memory layout), written last.
pub const STATE_FILE: &str = "state";
/// First bytes of a `state` file, then its format version (u32, little-endian).
pub const STATE_MAGIC: &[u8; 8] = b"AIRLSNAP";
/// The `state` format the VMM of this build writes and reads. Bump it on any change to the
/// VMM's snapshot shape: the daemon then refuses older templates (TEMPLATE_OUTDATED).
pub const STATE_VERSION: u32 = 2;
/// The state file while it is written.
pub const STATE_TMP_FILE: &str = "state.tmp";
/// Guest memory, a sparse file.
pub const MEMORY_FILE: &str = "memory";
/// The copy-on-write root disk's blocks (over the base image), packed; empty without one.
pub const LAYER_FILE: &str = "layer";
/// Which block each of [`LAYER_FILE`]'s slots holds, with a checksum.
pub const LAYER_MAP_FILE: &str = "layer.map";

/// Makes `dir` (mode 0700, if it does not exist) with empty [`MEMORY_FILE`], [`LAYER_FILE`],
/// [`LAYER_MAP_FILE`] and [`STATE_TMP_FILE`] (mode 0600, kept if they exist), owned by `owner` (uid, gid) when given,
/// as a VMM running under that uid needs. Symlinks are never followed: an existing `dir` or
/// file that is not a plain directory or file is an error. Ownership is changed through the
/// open descriptors, never by path.
pub fn prepare(dir: &Path, owner: Option<(u32, u32)>) -> io::Result<()> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let d = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    for name in [MEMORY_FILE, LAYER_FILE, LAYER_MAP_FILE, STATE_TMP_FILE] {
        let f = open_or_create(&dir.join(name))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        }
    }
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::fchown(&d, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// A regular file at `path`: created (0600), or the existing one, never through a symlink.
fn open_or_create(path: &Path) -> io::Result<File> {
    let created = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path);
    let f = match created {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)?,
        other => other?,
    };
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

/// Opens the prepared file `name` in `dir` for writing, truncated; never creates it (see the
/// module's documentation). A missing file says how to prepare it.
pub fn open_prepared(dir: &Path, name: &str) -> io::Result<File> {
    let path = dir.join(name);
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                io::Error::new(
                    e.kind(),
                    format!(
                        "{} does not exist: a snapshot's directory is prepared by its caller \
                         (airlock_control::snapshot_dir::prepare); the VMM creates no files",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })
}

/// The format version of the `state` file in `dir`, from its header; `None` when it has none
/// (missing, short, another magic).
pub fn state_version(dir: &Path) -> Option<u32> {
    use std::io::Read as _;
    let mut header = [0u8; 12];
    File::open(dir.join(STATE_FILE))
        .and_then(|mut f| f.read_exact(&mut header))
        .ok()?;
    if &header[..8] != STATE_MAGIC {
        return None;
    }
    Some(u32::from_le_bytes([
        header[8], header[9], header[10], header[11],
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn scratch(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("airlock-snapdir-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_state_files_header_gives_its_format_version() {
        let d = scratch("version");
        std::fs::create_dir_all(&d).unwrap();
        assert_eq!(state_version(&d), None, "no state file");
        let mut header = STATE_MAGIC.to_vec();
        header.extend_from_slice(&7u32.to_le_bytes());
        std::fs::write(d.join(STATE_FILE), &header).unwrap();
        assert_eq!(state_version(&d), Some(7));
        std::fs::write(d.join(STATE_FILE), b"NOTSNAP!\x02\0\0\0").unwrap();
        assert_eq!(state_version(&d), None, "another magic");
        std::fs::write(d.join(STATE_FILE), &header[..10]).unwrap();
        assert_eq!(state_version(&d), None, "short");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn prepare_makes_the_directory_and_empty_files_and_keeps_what_exists() {
        let d = scratch("fresh");
        prepare(&d, None).unwrap();
        assert_eq!(
            std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
            0o700
        );
        for name in [MEMORY_FILE, LAYER_FILE, LAYER_MAP_FILE, STATE_TMP_FILE] {
            let m = std::fs::metadata(d.join(name)).unwrap();
            assert_eq!((m.len(), m.permissions().mode() & 0o777), (0, 0o600));
        }
        std::fs::write(d.join(MEMORY_FILE), b"old").unwrap();
        prepare(&d, None).unwrap();
        assert_eq!(std::fs::read(d.join(MEMORY_FILE)).unwrap(), b"old");
        let mut f = open_prepared(&d, MEMORY_FILE).unwrap();
        io::Write::write_all(&mut f, b"x").unwrap();
        assert_eq!(std::fs::read(d.join(MEMORY_FILE)).unwrap(), b"x");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn prepare_changes_ownership_when_asked() {
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        assert_eq!(
            uid, 0,
            "only root may give files away: run the tests as root"
        );
        let d = scratch("owned");
        prepare(&d, Some((12345, 23456))).unwrap();
        for p in [d.clone(), d.join(MEMORY_FILE), d.join(STATE_TMP_FILE)] {
            let m = std::fs::metadata(&p).unwrap();
            assert_eq!((m.uid(), m.gid()), (12345, 23456), "{}", p.display());
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn symlinks_are_refused_and_missing_files_are_explained() {
        let d = scratch("links");
        std::fs::create_dir(&d).unwrap();
        let target = d.join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, d.join(MEMORY_FILE)).unwrap();
        assert!(prepare(&d, None).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        let linked_dir = scratch("linked-dir");
        std::os::unix::fs::symlink(&d, &linked_dir).unwrap();
        assert!(prepare(&linked_dir, None).is_err());
        let err = open_prepared(&d, STATE_TMP_FILE).unwrap_err();
        assert!(err.to_string().contains("prepared by its caller"), "{err}");
        std::fs::remove_file(&linked_dir).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
