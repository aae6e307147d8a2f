//! What the daemon reads about host files: the space a sparse file takes, short versions of a
//! file and of some content (they name a template's inputs), and where `mkfs.ext4` is. A leaf:
//! templates, volumes, the VMM launcher and the OCI importer all use it.

use std::path::{Path, PathBuf};

/// Bytes a (sparse) file occupies on disk.
pub fn disk_bytes(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map(|m| m.blocks() * 512).unwrap_or(0)
}

/// A short version of a file: a hash of its name, size and modification time (hashing a
/// gigabyte image per template would cost seconds; the base image's file name carries the hash
/// of its inputs already).
pub fn file_version(p: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let meta = std::fs::metadata(p).ok();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    p.file_name().hash(&mut h);
    meta.as_ref().map(|m| m.len()).hash(&mut h);
    meta.and_then(|m| m.modified().ok()).hash(&mut h);
    format!("{:016x}", h.finish())
}

/// The version of some content: SHA-256, first 16 hex digits.
pub fn content_version(data: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(data);
    d[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// `mkfs.ext4` as configured, else on `$PATH` or in /sbin or /usr/sbin.
pub fn find_mkfs(configured: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = configured {
        return Some(p.to_owned());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn content_versions_are_sixteen_hex_digits_of_sha256() {
        // SHA-256("abc") = ba7816bf8f01cfea...
        assert_eq!(content_version(b"abc"), "ba7816bf8f01cfea");
    }

    #[test]
    fn a_configured_mkfs_is_taken_as_given() {
        let p = Path::new("/opt/e2fs/mkfs.ext4");
        assert_eq!(find_mkfs(Some(p)).as_deref(), Some(p));
    }
}
