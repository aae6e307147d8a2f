//! One daemon per data directory, cgroup parent, jail uid range and Unix socket on a host.
//!
//! At start a daemon reaps what it finds under its cgroup parent and run root and hands out the
//! uids of its range, so a second daemon sharing any of them would kill the first one's VMMs or
//! give its uids away. Before it touches anything, [`take`] locks each of them (`flock(2)`,
//! released by the kernel when the process ends, so a crash leaves nothing to clean): the data
//! directory by `airlockd.lock` in it, the others by files in the host-wide `lock_dir`
//! (default `/run/airlock/locks`), one per cgroup parent, per socket and per uid range. A uid
//! range is refused when it overlaps a range another live daemon holds. A socket that still
//! answers is refused even where no lock names it (a daemon older than these locks). Each lock
//! file says who holds it, and the refusal names that daemon.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::StartError;

/// What a daemon holds: the locks, released when it is dropped (or the process ends).
#[derive(Debug)]
pub struct InstanceLock {
    _files: Vec<File>,
}

/// What a daemon claims on this host.
#[derive(Clone, Debug)]
pub struct Claim<'a> {
    pub data_dir: &'a Path,
    pub lock_dir: &'a Path,
    pub cgroup_parent: &'a str,
    /// The jail's uid range (`base`, `count`); `None` when VMMs are not jailed.
    pub uids: Option<(u32, u32)>,
    /// The Unix sockets it will listen on.
    pub sockets: Vec<PathBuf>,
}

/// Locks everything of `claim`, or the error naming the daemon that holds a part of it.
pub fn take(claim: &Claim) -> Result<InstanceLock, StartError> {
    let me = format!(
        "airlockd pid {} with data directory {}",
        std::process::id(),
        claim.data_dir.display()
    );
    let mut files = Vec::new();
    std::fs::create_dir_all(claim.data_dir)
        .map_err(StartError::io(claim.data_dir.display().to_string()))?;
    let what = format!("the data directory {}", claim.data_dir.display());
    files.push(exclusive(
        &claim.data_dir.join("airlockd.lock"),
        &what,
        &me,
    )?);
    create_lock_dir(claim.lock_dir)?;
    // Ranges are compared and claimed under one lock, so two daemons starting at once cannot
    // both find the other's range free.
    let registry = open(&claim.lock_dir.join("registry.lock"))?;
    flock(&registry, libc::LOCK_EX).map_err(StartError::io(format!(
        "locking {}",
        claim.lock_dir.display()
    )))?;
    let parent = format!("the cgroup parent {:?}", claim.cgroup_parent);
    let file = named(claim.lock_dir, "cgroup", claim.cgroup_parent);
    files.push(exclusive(&file, &parent, &me)?);
    for socket in &claim.sockets {
        let what = format!("the socket {}", socket.display());
        let file = named(claim.lock_dir, "socket", &socket.to_string_lossy());
        files.push(exclusive(&file, &what, &me)?);
        refuse_answering(socket)?;
    }
    if let Some((base, count)) = claim.uids {
        files.push(uid_range(claim.lock_dir, base, count, &me)?);
    }
    drop(registry);
    Ok(InstanceLock { _files: files })
}

/// Refuses `socket` when a daemon answers on it (one that started before these locks, or
/// without them): a new daemon replaces only a stale socket.
pub fn refuse_answering(socket: &Path) -> Result<(), StartError> {
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(StartError::Setting(format!(
            "another daemon answers on unix://{}: stop it or listen elsewhere (--listen)",
            socket.display()
        )));
    }
    Ok(())
}

fn create_lock_dir(dir: &Path) -> Result<(), StartError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(StartError::io(format!("lock directory {}", dir.display())))
}

/// The lock file of `kind` `key` (hashed: a cgroup parent or a path may hold any character).
fn named(dir: &Path, kind: &str, key: &str) -> PathBuf {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{kind}-{hex}.lock"))
}

/// `path` locked for this process with `me` written in it, or the refusal naming its holder.
fn exclusive(path: &Path, what: &str, me: &str) -> Result<File, StartError> {
    let mut f = open(path)?;
    if flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err() {
        return Err(held(what, &mut f));
    }
    let written = f
        .set_len(0)
        .and_then(|()| f.rewind())
        .and_then(|()| writeln!(f, "{me}"));
    written.map_err(StartError::io(path.display().to_string()))?;
    Ok(f)
}

fn held(what: &str, f: &mut File) -> StartError {
    let mut holder = String::new();
    let _ = f.read_to_string(&mut holder);
    let holder = match holder.trim() {
        "" => "another airlockd".to_owned(),
        h => h.to_owned(),
    };
    StartError::Setting(format!(
        "{what} is in use by {holder}: a second daemon on this host needs a data directory, \
         cgroup_parent, [jail] uid range and socket of its own"
    ))
}

/// The uid range `base..base+count`, refused when it overlaps one a live daemon holds; the
/// lock files of ranges whose daemons are gone are removed.
fn uid_range(dir: &Path, base: u32, count: u32, me: &str) -> Result<File, StartError> {
    let mine = u64::from(base)..u64::from(base) + u64::from(count.max(1));
    let entries = std::fs::read_dir(dir).map_err(StartError::io(dir.display().to_string()))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((b, c)) = parse_range(&name) else {
            continue;
        };
        let theirs = u64::from(b)..u64::from(b) + u64::from(c.max(1));
        if theirs.start >= mine.end || mine.start >= theirs.end {
            continue;
        }
        let mut f = open(&e.path())?;
        if flock(&f, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            let what = format!(
                "the [jail] uid range {}..{} (overlapping {}..{})",
                mine.start, mine.end, theirs.start, theirs.end
            );
            return Err(held(&what, &mut f));
        }
        let _ = std::fs::remove_file(e.path());
    }
    let what = format!("the [jail] uid range {}..{}", mine.start, mine.end);
    exclusive(&dir.join(format!("uids-{base}-{count}.lock")), &what, me)
}

fn parse_range(name: &str) -> Option<(u32, u32)> {
    let (b, c) = name
        .strip_prefix("uids-")?
        .strip_suffix(".lock")?
        .split_once('-')?;
    Some((b.parse().ok()?, c.parse().ok()?))
}

fn open(path: &Path) -> Result<File, StartError> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)
        .map_err(StartError::io(path.display().to_string()))
}

fn flock(f: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock(2) on a descriptor `f` owns for the call; no memory is passed.
    match unsafe { libc::flock(f.as_raw_fd(), op) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    struct Dirs(PathBuf);

    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dirs(tag: &str) -> Dirs {
        let d = std::env::temp_dir().join(format!("airlock-instance-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Dirs(d)
    }

    fn claim<'a>(d: &'a Dirs, data: &'a Path, parent: &'a str, uids: (u32, u32)) -> Claim<'a> {
        Claim {
            data_dir: data,
            lock_dir: &d.0,
            cgroup_parent: parent,
            uids: Some(uids),
            sockets: vec![],
        }
    }

    // flock locks belong to the open file description: a second open in this process conflicts
    // as a second daemon's would.
    #[test]
    fn a_second_claim_on_any_shared_part_is_refused_naming_the_first() {
        let d = dirs("shared");
        let (a, b) = (d.0.join("a"), d.0.join("b"));
        let first = take(&claim(&d, &a, "p1", (1000, 100))).unwrap();
        let err = take(&claim(&d, &a, "p2", (5000, 100))).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("data directory"), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        let err = take(&claim(&d, &b, "p1", (5000, 100))).unwrap_err();
        assert!(err.to_string().contains("cgroup parent \"p1\""), "{err}");
        let err = take(&claim(&d, &b, "p2", (1050, 100))).unwrap_err();
        assert!(err.to_string().contains("uid range 1050..1150"), "{err}");
        let err = take(&claim(&d, &b, "p2", (900, 101))).unwrap_err();
        assert!(err.to_string().contains("uid range"), "{err}");
        // Apart in every part: both run.
        let second = take(&claim(&d, &b, "p2", (1100, 100))).unwrap();
        drop((first, second));
        // The first is gone: its parts are free again, its stale range file is cleaned.
        let again = take(&claim(&d, &b, "p1", (1000, 200))).unwrap();
        drop(again);
    }

    #[test]
    fn a_socket_that_answers_is_refused_a_stale_one_is_not() {
        let d = dirs("socket");
        std::fs::create_dir_all(&d.0).unwrap();
        let path = d.0.join("s.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let err = refuse_answering(&path).unwrap_err();
        assert!(err.to_string().contains("answers on"), "{err}");
        drop(listener);
        refuse_answering(&path).unwrap();
        let first_dir = d.0.join("a");
        let mut c = claim(&d, &first_dir, "p", (1, 1));
        c.sockets = vec![path.clone()];
        let first = take(&c).unwrap();
        let other = d.0.join("b");
        c.data_dir = &other;
        c.cgroup_parent = "q";
        c.uids = None;
        let err = take(&c).unwrap_err();
        assert!(err.to_string().contains("the socket"), "{err}");
        drop(first);
    }
}
