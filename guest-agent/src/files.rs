//! File requests: WriteFile, ReadFile, Stat, ListDir, Mkdir, Remove, Rename.
//!
//! With `root` set, every path is resolved by `openat2(2)` relative to an `O_PATH` descriptor
//! of the root with `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`: a `..` or a symlink that would
//! lead out of the root fails with EXDEV, answered as PATH_ESCAPE (rather than being silently
//! clamped to the root, as `RESOLVE_IN_ROOT` would do). A leading `/` in `path` means the root.
//! Without `root`, paths must be absolute and are used as given.
//!
//! Operations on a directory entry itself (mkdir, remove, the final component of stat) work on
//! an `O_PATH` descriptor of the parent directory and the entry's name, so the checked
//! resolution is the one that is used.

use std::ffi::CString;
use std::fs::{File, Metadata};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};

use airlock_proto::pb::{
    self, DirListing, ErrorCode, FileData, FileKind, FileStat, request, response,
};
use airlock_proto::{MAX_DIR_ENTRIES, MAX_FILE_BYTES, MAX_FILE_CHUNK};

use crate::error::ReqError;
use crate::sys::{self, Dir};
use crate::users::Users;

/// Mode of a new file when the request says 0.
const DEFAULT_FILE_MODE: u32 = 0o644;
/// Mode of a new directory when the request says 0.
const DEFAULT_DIR_MODE: u32 = 0o755;
/// A DirListing stops growing at this encoded size (well under the 4 MiB frame limit).
const MAX_LISTING_BYTES: usize = 3 << 20;

/// Handles a file request, as the account it names (see [`Users::resolve`]); `None` if `kind`
/// is not one.
pub fn handle(users: &Users, kind: &request::Kind) -> Option<Result<response::Kind, ReqError>> {
    let user = match kind {
        request::Kind::WriteFile(r) => &r.user,
        request::Kind::ReadFile(r) => &r.user,
        request::Kind::Stat(r) => &r.user,
        request::Kind::ListDir(r) => &r.user,
        request::Kind::Mkdir(r) => &r.user,
        request::Kind::Remove(r) => &r.user,
        request::Kind::Rename(r) => &r.user,
        _ => return None,
    };
    Some(as_account(users, user).and_then(|_ids| serve(kind)))
}

/// The file-system ids of `user`'s account for the calling thread, for as long as the guard
/// lives; `None` for root or the agent's own account (no change).
fn as_account(users: &Users, user: &str) -> Result<Option<sys::FsIds>, ReqError> {
    let Some(account) = users.resolve(user)?.filter(|a| !a.is_root()) else {
        return Ok(None);
    };
    let creds = sys::Credentials {
        uid: account.uid,
        gid: account.gid,
        groups: account.groups,
        lock_down: account.lock_down,
    };
    sys::FsIds::assume(&creds)
        .map(Some)
        .map_err(|e| ReqError::io(&format!("acting as {user:?}"), &e))
}

fn serve(kind: &request::Kind) -> Result<response::Kind, ReqError> {
    let ok = |()| response::Kind::Ok(pb::Ok {});
    match kind {
        request::Kind::WriteFile(r) => write_file(r).map(ok),
        request::Kind::ReadFile(r) => read_file(r).map(response::Kind::FileData),
        request::Kind::Stat(r) => stat(r).map(response::Kind::FileStat),
        request::Kind::ListDir(r) => list_dir(r).map(response::Kind::DirListing),
        request::Kind::Mkdir(r) => mkdir(r).map(ok),
        request::Kind::Remove(r) => remove(r).map(ok),
        request::Kind::Rename(r) => rename(r).map(ok),
        _ => Err(ReqError::new(ErrorCode::Unsupported, "not a file request")),
    }
}

/// How paths of one request are resolved.
struct Scope {
    root: Option<OwnedFd>,
}

/// A path split into its components (empty ones and `.` dropped; `..` kept for the kernel to
/// judge).
struct Components<'a>(Vec<&'a str>);

impl Scope {
    fn new(root: &str) -> Result<Self, ReqError> {
        if root.is_empty() {
            return Ok(Self { root: None });
        }
        let c_root = c_path(root)?;
        let flags = libc::O_PATH | libc::O_DIRECTORY;
        let fd = sys::openat2(Dir::Cwd, &c_root, flags, 0, 0)
            .map_err(|e| ReqError::io(&format!("opening root {root}"), &e))?;
        Ok(Self { root: Some(fd) })
    }

    fn dir(&self) -> Dir<'_> {
        self.root
            .as_ref()
            .map_or(Dir::Cwd, |fd| Dir::Fd(fd.as_fd()))
    }

    fn resolve_flags(&self) -> u64 {
        if self.root.is_some() {
            libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS
        } else {
            0
        }
    }

    /// Splits `path`: relative to the root when there is one, else it must be absolute.
    fn components<'a>(&self, path: &'a str) -> Result<Components<'a>, ReqError> {
        if path.contains('\0') {
            return Err(ReqError::invalid("path contains a NUL byte"));
        }
        if self.root.is_none() && !path.starts_with('/') {
            return Err(ReqError::invalid(format!(
                "path {path:?} must be absolute (or set root)"
            )));
        }
        let parts = path
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        Ok(Components(parts))
    }

    /// The string openat2 gets for `parts`.
    fn c_join(&self, parts: &[&str]) -> Result<CString, ReqError> {
        let joined = parts.join("/");
        match (&self.root, joined.is_empty()) {
            (Some(_), true) => c_path("."),
            (Some(_), false) => c_path(&joined),
            (None, _) => c_path(&format!("/{joined}")),
        }
    }

    fn open(&self, parts: &[&str], flags: i32, mode: u32) -> io::Result<OwnedFd> {
        let path = self
            .c_join(parts)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        sys::openat2(self.dir(), &path, flags, mode, self.resolve_flags())
    }

    /// The parent directory (O_PATH) and the final name of `parts`, which must name an entry
    /// (not the root, `.` or `..`).
    fn parent_of(&self, parts: &[&str], what: &str) -> Result<(OwnedFd, CString), ReqError> {
        let Some((&name, parent)) = parts.split_last() else {
            return Err(ReqError::invalid(format!(
                "cannot {what} the root directory"
            )));
        };
        if name == ".." {
            return Err(ReqError::invalid(format!(
                "cannot {what} a path ending in .."
            )));
        }
        let flags = libc::O_PATH | libc::O_DIRECTORY;
        let dir = self
            .open(parent, flags, 0)
            .map_err(|e| ReqError::io("resolving the parent directory", &e))?;
        Ok((dir, c_path(name)?))
    }
}

fn c_path(s: &str) -> Result<CString, ReqError> {
    CString::new(s).map_err(|_| ReqError::invalid("path contains a NUL byte"))
}

fn write_file(req: &pb::WriteFile) -> Result<(), ReqError> {
    if req.data.len() > MAX_FILE_CHUNK {
        return Err(too_large(format!(
            "chunk of {} bytes exceeds {MAX_FILE_CHUNK}",
            req.data.len()
        )));
    }
    let end = req.offset.saturating_add(req.data.len() as u64);
    if end > MAX_FILE_BYTES {
        return Err(too_large(format!(
            "file would reach {end} bytes, limit {MAX_FILE_BYTES}"
        )));
    }
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    if req.create_parents
        && let Some((_, parent)) = parts.0.split_last()
    {
        mkdir_all(&scope, parent, DEFAULT_DIR_MODE)?;
    }
    let mut flags = libc::O_WRONLY | libc::O_CREAT | libc::O_NONBLOCK;
    if req.truncate {
        flags |= libc::O_TRUNC;
    }
    let mode = if req.mode == 0 {
        DEFAULT_FILE_MODE
    } else {
        req.mode & 0o7777
    };
    let file = scope
        .open(&parts.0, flags, mode)
        .map(File::from)
        .map_err(|e| ReqError::io(&format!("opening {}", req.path), &e))?;
    require_regular(&file, &req.path)?;
    file.write_all_at(&req.data, req.offset)
        .map_err(|e| ReqError::io(&format!("writing {}", req.path), &e))
}

fn read_file(req: &pb::ReadFile) -> Result<FileData, ReqError> {
    let want = match usize::try_from(req.length) {
        Ok(0) => MAX_FILE_CHUNK,
        Ok(n) if n <= MAX_FILE_CHUNK => n,
        _ => {
            return Err(too_large(format!(
                "read of {} bytes exceeds {MAX_FILE_CHUNK}",
                req.length
            )));
        }
    };
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    let file = scope
        .open(&parts.0, libc::O_RDONLY | libc::O_NONBLOCK, 0)
        .map(File::from)
        .map_err(|e| ReqError::io(&format!("opening {}", req.path), &e))?;
    let size = require_regular(&file, &req.path)?.len();
    let mut data = vec![0u8; want];
    let n = read_at_most(&file, &mut data, req.offset)
        .map_err(|e| ReqError::io(&format!("reading {}", req.path), &e))?;
    data.truncate(n);
    // A short read is the end; so is reaching the size (files in /proc report size 0).
    let eof = n < want || (size > 0 && req.offset.saturating_add(n as u64) >= size);
    Ok(FileData {
        data,
        eof,
        size,
        resolved: opened_path(&file),
    })
}

/// Where `file` is, symlinks resolved (empty if the kernel cannot say).
fn opened_path(file: &File) -> String {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Reads until `buf` is full or the file ends.
fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..).filter(|r| !r.is_empty()) {
        match file.read_at(rest, offset.saturating_add(filled as u64)) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// The file's metadata, if it is a regular file.
fn require_regular(file: &File, path: &str) -> Result<Metadata, ReqError> {
    let meta = file
        .metadata()
        .map_err(|e| ReqError::io(&format!("stat {path}"), &e))?;
    if meta.is_dir() {
        return Err(ReqError::invalid(format!("{path} is a directory")));
    }
    if !meta.is_file() {
        return Err(ReqError::invalid(format!("{path} is not a regular file")));
    }
    Ok(meta)
}

fn stat(req: &pb::Stat) -> Result<FileStat, ReqError> {
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    let fd = scope
        .open(&parts.0, libc::O_PATH | libc::O_NOFOLLOW, 0)
        .map_err(|e| ReqError::io(&format!("stat {}", req.path), &e))?;
    let meta = File::from(fd)
        .metadata()
        .map_err(|e| ReqError::io(&format!("stat {}", req.path), &e))?;
    Ok(file_stat(req.path.clone(), &meta))
}

fn file_stat(name: String, meta: &Metadata) -> FileStat {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let mtime_ms = meta
        .mtime()
        .saturating_mul(1000)
        .saturating_add(meta.mtime_nsec() / 1_000_000);
    FileStat {
        name,
        kind: kind as i32,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime_ms,
        uid: meta.uid(),
        gid: meta.gid(),
    }
}

/// How deep a recursive listing goes.
const MAX_LIST_DEPTH: usize = 64;

fn list_dir(req: &pb::ListDir) -> Result<DirListing, ReqError> {
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    let fd = scope
        .open(&parts.0, libc::O_RDONLY | libc::O_DIRECTORY, 0)
        .map_err(|e| ReqError::io(&format!("opening directory {}", req.path), &e))?;
    let max = match req.max_entries as usize {
        0 => MAX_DIR_ENTRIES,
        n => n.min(MAX_DIR_ENTRIES),
    };
    let mut listing = DirListing::default();
    let mut bytes = 0usize;
    let depth = if req.recursive { MAX_LIST_DEPTH } else { 1 };
    list_into(&fd, "", depth, max, &mut bytes, &mut listing)
        .map_err(|e| ReqError::io(&format!("listing {}", req.path), &e))?;
    listing.entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(listing)
}

/// Lists the directory open as `dir` into `listing`, each entry named `prefix` + its name,
/// and (with `depth` above 1) its subdirectories, opened beneath it without following links.
fn list_into(
    dir: &OwnedFd,
    prefix: &str,
    depth: usize,
    max: usize,
    bytes: &mut usize,
    listing: &mut DirListing,
) -> io::Result<()> {
    // Read through the descriptor we resolved, not the path again.
    let entries = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd()))?;
    let mut subdirs = Vec::new();
    for entry in entries {
        let Ok(entry) = entry else { continue };
        // Gone since readdir: skip it.
        let Ok(meta) = entry.metadata() else { continue };
        if listing.entries.len() >= max || *bytes >= MAX_LISTING_BYTES {
            listing.truncated = true;
            return Ok(());
        }
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        *bytes += name.len() + 48;
        if depth > 1 && meta.is_dir() {
            subdirs.push((entry.file_name(), name.clone()));
        }
        listing.entries.push(file_stat(name, &meta));
    }
    for (os_name, name) in subdirs {
        let Ok(c_name) = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(os_name.as_os_str()))
        else {
            continue;
        };
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS;
        // A directory replaced by something else meanwhile is skipped.
        let Ok(sub) = sys::openat2(Dir::Fd(dir.as_fd()), &c_name, flags, 0, resolve) else {
            continue;
        };
        list_into(&sub, &format!("{name}/"), depth - 1, max, bytes, listing)?;
        if listing.truncated {
            break;
        }
    }
    Ok(())
}

fn rename(req: &pb::Rename) -> Result<(), ReqError> {
    let scope = Scope::new(&req.root)?;
    let from = scope.components(&req.from)?;
    let to = scope.components(&req.to)?;
    let (from_dir, from_name) = scope.parent_of(&from.0, "rename")?;
    let (to_dir, to_name) = scope.parent_of(&to.0, "replace")?;
    sys::renameat(
        Dir::Fd(from_dir.as_fd()),
        &from_name,
        Dir::Fd(to_dir.as_fd()),
        &to_name,
    )
    .map_err(|e| ReqError::io(&format!("renaming {} to {}", req.from, req.to), &e))
}

fn mkdir(req: &pb::Mkdir) -> Result<(), ReqError> {
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    let mode = if req.mode == 0 {
        DEFAULT_DIR_MODE
    } else {
        req.mode & 0o7777
    };
    if req.parents {
        return mkdir_all(&scope, &parts.0, mode);
    }
    let (parent, name) = scope.parent_of(&parts.0, "create")?;
    sys::mkdirat(Dir::Fd(parent.as_fd()), &name, mode)
        .map_err(|e| ReqError::io(&format!("mkdir {}", req.path), &e))
}

/// `mkdir -p`: creates each missing component; existing directories are fine.
fn mkdir_all(scope: &Scope, parts: &[&str], mode: u32) -> Result<(), ReqError> {
    for i in 1..=parts.len() {
        let prefix = parts.get(..i).unwrap_or_default();
        if prefix.last() == Some(&"..") {
            // Resolved (and checked for escape) as part of the next prefix.
            continue;
        }
        let (parent, name) = scope.parent_of(prefix, "create")?;
        match sys::mkdirat(Dir::Fd(parent.as_fd()), &name, mode) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                require_dir(scope, prefix)?;
            }
            Err(e) => return Err(ReqError::io(&format!("mkdir {}", prefix.join("/")), &e)),
        }
    }
    Ok(())
}

fn require_dir(scope: &Scope, parts: &[&str]) -> Result<(), ReqError> {
    scope
        .open(parts, libc::O_PATH | libc::O_DIRECTORY, 0)
        .map(drop)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => ReqError::new(
                ErrorCode::AlreadyExists,
                format!("{} exists and is not a directory", parts.join("/")),
            ),
            _ => ReqError::io(&format!("checking {}", parts.join("/")), &e),
        })
}

fn remove(req: &pb::Remove) -> Result<(), ReqError> {
    let scope = Scope::new(&req.root)?;
    let parts = scope.components(&req.path)?;
    let (parent, name) = scope.parent_of(&parts.0, "remove")?;
    let what = |e: &io::Error| ReqError::io(&format!("removing {}", req.path), e);
    let entry = sys::openat2(
        Dir::Fd(parent.as_fd()),
        &name,
        libc::O_PATH | libc::O_NOFOLLOW,
        0,
        0,
    )
    .map_err(|e| what(&e))?;
    let is_dir = File::from(entry).metadata().map_err(|e| what(&e))?.is_dir();
    if !is_dir {
        return sys::unlinkat(Dir::Fd(parent.as_fd()), &name, false).map_err(|e| what(&e));
    }
    if !req.recursive {
        return sys::unlinkat(Dir::Fd(parent.as_fd()), &name, true).map_err(|e| {
            match e.raw_os_error() {
                Some(libc::ENOTEMPTY) => ReqError::invalid(format!(
                    "directory {} is not empty (set recursive)",
                    req.path
                )),
                _ => what(&e),
            }
        });
    }
    // std's remove_dir_all works descriptor-relative and never follows symlinks; it is pointed
    // at the entry through the parent descriptor we resolved.
    let name = name.to_string_lossy();
    std::fs::remove_dir_all(format!("/proc/self/fd/{}/{name}", parent.as_raw_fd()))
        .map_err(|e| what(&e))
}

fn too_large(message: String) -> ReqError {
    ReqError::new(ErrorCode::TooLarge, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(scope: &Scope, path: &str) -> Vec<String> {
        let c = scope.components(path).unwrap();
        c.0.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn components_drop_empty_and_dot_but_keep_dotdot() {
        let scope = Scope { root: None };
        assert_eq!(parts(&scope, "/a//./b/../c/"), ["a", "b", "..", "c"]);
    }

    #[test]
    fn without_root_a_relative_path_is_refused() {
        let scope = Scope { root: None };
        let err = scope.components("a/b").err().unwrap();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn with_root_the_root_itself_is_dot() {
        let scope = Scope::new("/").unwrap();
        assert_eq!(scope.c_join(&[]).unwrap().to_str().unwrap(), ".");
        assert_eq!(scope.c_join(&["a", "b"]).unwrap().to_str().unwrap(), "a/b");
    }

    #[test]
    fn without_root_components_join_to_an_absolute_path() {
        let scope = Scope { root: None };
        assert_eq!(scope.c_join(&[]).unwrap().to_str().unwrap(), "/");
        assert_eq!(scope.c_join(&["tmp"]).unwrap().to_str().unwrap(), "/tmp");
    }

    #[test]
    fn nul_in_path_is_invalid() {
        let scope = Scope { root: None };
        let err = scope.components("/a\0b").err().unwrap();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn parent_of_the_root_or_dotdot_is_invalid() {
        let scope = Scope::new("/").unwrap();
        assert_eq!(
            scope.parent_of(&[], "remove").err().unwrap().code,
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            scope.parent_of(&["a", ".."], "remove").err().unwrap().code,
            ErrorCode::InvalidArgument
        );
    }

    #[test]
    fn read_of_more_than_a_chunk_is_too_large() {
        let req = pb::ReadFile {
            path: "/etc/hostname".into(),
            length: MAX_FILE_CHUNK as u64 + 1,
            ..Default::default()
        };
        assert_eq!(read_file(&req).unwrap_err().code, ErrorCode::TooLarge);
    }

    #[test]
    fn write_past_the_file_size_limit_is_too_large() {
        let req = pb::WriteFile {
            path: "/nonexistent/x".into(),
            offset: MAX_FILE_BYTES,
            data: vec![1],
            ..Default::default()
        };
        assert_eq!(write_file(&req).unwrap_err().code, ErrorCode::TooLarge);
    }
}
