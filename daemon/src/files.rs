//! Files into and out of a sandbox under its file policy. A path must lie under one of the
//! policy's prefixes; the agent then resolves it *inside* that prefix (its `root`), so neither
//! `..` nor a symlink planted by the user's code can leave it. Transfers run on blocking
//! threads with the agent's synchronous client, every chunk a call with its own deadline;
//! sizes are capped by the daemon (`max_file_bytes`) before the guest sees them.

use airlock_proto::Requests;

use airlock_api::v1::{FileChunk, FileEntry, FilePolicy};
use airlock_proto::MuxClient;
use airlock_proto::pb;
use tokio::sync::mpsc::{Receiver, Sender};

use crate::agent::{self, CALL_TIMEOUT};
use crate::error::{AgentCall, ApiError, ApiResult, from_agent};
use crate::limits;

/// `p` is absolute and has no `.`/`..` components or empty segments.
pub fn check_absolute(p: &str) -> ApiResult<()> {
    let ok = p.starts_with('/')
        && p.len() <= 4096
        && !p.contains('\0')
        && p[1..]
            .split('/')
            .all(|seg| !matches!(seg, "." | "..") && (p == "/" || !seg.is_empty()));
    if ok {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "{p:?} is not a normalised absolute path"
        )))
    }
}

/// The prefix of `prefixes` that `path` lies under, and `path` relative to it.
pub fn check_path<'a>(
    path: &'a str,
    prefixes: &'a [String],
    what: &str,
) -> ApiResult<(&'a str, &'a str)> {
    check_absolute(path)?;
    for prefix in prefixes {
        let p = prefix.trim_end_matches('/');
        if p.is_empty() {
            return Ok(("/", path));
        }
        if let Some(rest) = path.strip_prefix(p)
            && (rest.is_empty() || rest.starts_with('/'))
        {
            return Ok((p, if rest.is_empty() { "/" } else { rest }));
        }
    }
    Err(ApiError::PathNotAllowed {
        path: path.to_owned(),
        why: format!(
            "not under a {what} path of the sandbox's policy ({})",
            prefixes.join(", ")
        ),
    })
}

/// Whether `pattern` (`*`: any run of characters, `?`: one) matches all of `text`.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // The classic two-pointer match with backtracking to the last star.
    let (mut i, mut j) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        match p.get(i) {
            Some('*') => {
                star = Some((i, j));
                i += 1;
            }
            Some(c) if *c == '?' || *c == t[j] => {
                i += 1;
                j += 1;
            }
            _ => match star {
                Some((si, sj)) => {
                    i = si + 1;
                    j = sj + 1;
                    star = Some((si, sj + 1));
                }
                None => return false,
            },
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

/// The pattern of `denied` that refuses exporting `path`: one without `/` matches any of the
/// path's components (a denied directory's files are denied too), one with `/` the whole path.
pub fn denied_by<'a>(denied: &'a [String], path: &str) -> Option<&'a str> {
    denied
        .iter()
        .find(|pat| {
            if pat.contains('/') {
                glob_match(pat, path)
            } else {
                path.split('/')
                    .any(|seg| !seg.is_empty() && glob_match(pat, seg))
            }
        })
        .map(String::as_str)
}

/// Refuses a read whose file, symlinks resolved (`resolved`, as the agent opened it; empty
/// from an agent older than it), matches a denied pattern.
fn denied_resolved(denied: &[String], path: &str, resolved: &str) -> ApiResult<()> {
    if resolved.is_empty() || resolved == path {
        return Ok(());
    }
    match denied_by(denied, resolved) {
        Some(pat) => Err(ApiError::ExportDenied {
            path: path.to_owned(),
            rule: format!("it is {resolved}, which matches the denied pattern {pat:?}"),
        }),
        None => Ok(()),
    }
}

/// A sandbox as file transfers see it.
#[derive(Clone, Debug)]
pub struct FileTarget {
    pub sandbox_id: String,
    pub agent: std::sync::Arc<agent::AgentLink>,
    pub policy: FilePolicy,
    /// Its writable space, for DISK_QUOTA_EXCEEDED.
    pub disk_limit: u64,
    /// Largest file moved.
    pub max_file_bytes: u64,
    /// The guest account the transfer acts as (empty: the default, "user").
    pub user: String,
    /// Bytes ReadFile has exported from the sandbox so far (its export cap's count).
    pub exported: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Root is out of reach in the sandbox (its no_root policy).
    pub no_root: bool,
}

impl FileTarget {
    /// The same, acting as the guest account `user` (checked; empty: the default).
    pub fn acting_as(self, user: String) -> ApiResult<Self> {
        limits::check_user(&user)?;
        if self.no_root && user == "root" {
            return Err(ApiError::RootNotAllowed {
                id: self.sandbox_id,
                what: "a file call as root".into(),
            });
        }
        Ok(Self { user, ..self })
    }

    fn call<'a>(&'a self, path: &'a str) -> AgentCall<'a> {
        AgentCall {
            sandbox: &self.sandbox_id,
            path,
            disk_limit: self.disk_limit,
        }
    }

    fn connect(&self, path: &str) -> ApiResult<MuxClient> {
        self.agent
            .client()
            .map_err(|e| from_agent(e, self.call(path)))
    }
}

/// Writes the chunks that arrive on `data` to `path` (mode `mode`) in the sandbox; returns
/// the bytes written. More than `max_file_bytes` fails with FILE_TOO_LARGE (the caller stops
/// sending when `data` closes early).
pub async fn write(
    target: FileTarget,
    path: String,
    mode: u32,
    data: Receiver<Vec<u8>>,
) -> ApiResult<u64> {
    let (root, rel) = check_path(&path, &target.policy.writable, "writable")?;
    let (root, rel) = (root.to_owned(), rel.to_owned());
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    tokio::task::spawn_blocking(move || write_blocking(&target, &root, &rel, mode, data))
        .await
        .map_err(|e| ApiError::Internal(format!("file task: {e}")))?
}

fn write_blocking(
    target: &FileTarget,
    root: &str,
    rel: &str,
    mode: u32,
    mut data: Receiver<Vec<u8>>,
) -> ApiResult<u64> {
    let mut client = target.connect(rel)?;
    // A policy may name a directory the image lacks.
    if root != "/" {
        let _ = client.within(CALL_TIMEOUT, |c| c.mkdir(root, true));
    }
    let mut offset = 0u64;
    let mut pending: Vec<u8> = Vec::new();
    let mut wrote = false;
    loop {
        let next = data.blocking_recv();
        let done = next.is_none();
        if let Some(chunk) = next {
            pending.extend_from_slice(&chunk);
        }
        let size = offset + pending.len() as u64;
        if size > target.max_file_bytes {
            return Err(ApiError::FileTooLarge {
                size,
                limit: target.max_file_bytes,
            });
        }
        // Whole chunks while data comes; the rest (or an empty file) at the end.
        while pending.len() >= airlock_proto::MAX_FILE_CHUNK
            || (done && (!pending.is_empty() || !wrote))
        {
            let n = pending.len().min(airlock_proto::MAX_FILE_CHUNK);
            let chunk: Vec<u8> = pending.drain(..n).collect();
            let at = Chunk {
                offset,
                mode,
                user: &target.user,
            };
            write_chunk(&mut client, root, rel, at, chunk)
                .map_err(|e| from_agent(e, target.call(rel)))?;
            offset += n as u64;
            wrote = true;
        }
        if done {
            return Ok(offset);
        }
    }
}

/// Where a chunk goes in its file, and as whom.
struct Chunk<'a> {
    offset: u64,
    mode: u32,
    user: &'a str,
}

/// Writes one chunk of `path` inside `root` (the first one truncates).
fn write_chunk(
    client: &mut MuxClient,
    root: &str,
    path: &str,
    at: Chunk<'_>,
    data: Vec<u8>,
) -> Result<(), airlock_proto::ClientError> {
    let req = pb::WriteFile {
        path: path.to_owned(),
        offset: at.offset,
        data,
        truncate: at.offset == 0,
        mode: at.mode,
        create_parents: true,
        root: root.to_owned(),
        user: at.user.to_owned(),
    };
    client.within(CALL_TIMEOUT, |c| c.call(pb::request::Kind::WriteFile(req)))?;
    Ok(())
}

/// Reads `path` from the sandbox: its chunks (or the error that ended the read) arrive on the
/// returned channel. A file over `max_file_bytes` fails with FILE_TOO_LARGE.
pub fn read(target: FileTarget, path: String) -> ApiResult<Receiver<ApiResult<FileChunk>>> {
    let (root, rel) = check_path(&path, &target.policy.exportable, "exportable")?;
    if let Some(pat) = denied_by(&target.policy.export_denied, &path) {
        return Err(ApiError::ExportDenied {
            path: path.clone(),
            rule: format!("it matches the denied pattern {pat:?}"),
        });
    }
    let (root, rel) = (root.to_owned(), rel.to_owned());
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = read_blocking(&target, &root, &rel, &tx) {
            let _ = tx.blocking_send(Err(e));
        }
    });
    Ok(rx)
}

fn read_blocking(
    target: &FileTarget,
    root: &str,
    rel: &str,
    tx: &Sender<ApiResult<FileChunk>>,
) -> ApiResult<()> {
    let mut client = target.connect(rel)?;
    let path = format!("{}{}", root.trim_end_matches('/'), rel);
    let mut offset = 0u64;
    loop {
        let req = pb::ReadFile {
            path: rel.to_owned(),
            offset,
            length: airlock_proto::MAX_FILE_CHUNK as u64,
            root: root.to_owned(),
            user: target.user.clone(),
        };
        let chunk = match client.within(CALL_TIMEOUT, |c| c.call(pb::request::Kind::ReadFile(req)))
        {
            Ok(pb::response::Kind::FileData(d))
                if d.data.len() <= airlock_proto::MAX_FILE_CHUNK =>
            {
                d
            }
            Ok(other) => {
                return Err(ApiError::AgentUnavailable {
                    id: target.sandbox_id.clone(),
                    message: format!("the agent answered a read with {other:?}"),
                });
            }
            Err(e) => return Err(from_agent(e, target.call(rel))),
        };
        check_chunk(target, &path, offset, &chunk)?;
        offset += chunk.data.len() as u64;
        let eof = chunk.eof || chunk.data.is_empty();
        let msg = FileChunk {
            data: chunk.data,
            size: chunk.size,
        };
        if tx.blocking_send(Ok(msg)).is_err() || eof {
            return Ok(());
        }
    }
}

/// Read step: `chunk` (at `offset` of `path`) may leave the sandbox under its policy; its bytes
/// are counted against the sandbox's export cap.
fn check_chunk(
    target: &FileTarget,
    path: &str,
    offset: u64,
    chunk: &pb::FileData,
) -> ApiResult<()> {
    let limit = target.max_file_bytes;
    let policy = &target.policy;
    let path = path.to_owned();
    // Each chunk is read from the file the agent opened for it: a symlink inside the root
    // (or one swapped in between chunks) does not carry a denied file out under another
    // name.
    denied_resolved(&policy.export_denied, &path, &chunk.resolved)?;
    if chunk.size > limit || offset + chunk.data.len() as u64 > limit {
        return Err(ApiError::FileTooLarge {
            size: chunk.size.max(offset + chunk.data.len() as u64),
            limit,
        });
    }
    let size = chunk.size.max(offset + chunk.data.len() as u64);
    if policy.max_export_file_bytes > 0 && size > policy.max_export_file_bytes {
        return Err(ApiError::ExportDenied {
            path,
            rule: format!(
                "{size} bytes, over the per-file export cap of {}",
                policy.max_export_file_bytes
            ),
        });
    }
    // Counted before it is sent: what the cap allows is what can leave.
    let n = chunk.data.len() as u64;
    let before = target
        .exported
        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    if policy.max_export_total_bytes > 0 && before + n > policy.max_export_total_bytes {
        target
            .exported
            .fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::ExportDenied {
            path,
            rule: format!(
                "the sandbox's export cap of {} bytes ({before} exported so far)",
                policy.max_export_total_bytes
            ),
        });
    }
    Ok(())
}

/// One request to the agent about `rel` on a blocking thread; its answer.
async fn ask(
    target: FileTarget,
    rel: String,
    kind: pb::request::Kind,
) -> ApiResult<pb::response::Kind> {
    tokio::task::spawn_blocking(move || {
        let mut client = target.connect(&rel)?;
        client
            .within(CALL_TIMEOUT, |c| c.call(kind))
            .map_err(|e| from_agent(e, target.call(&rel)))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("file task: {e}")))?
}

fn unexpected(target_id: &str, what: &str, got: &pb::response::Kind) -> ApiError {
    ApiError::AgentUnavailable {
        id: target_id.to_owned(),
        message: format!("the agent answered {what} with {got:?}"),
    }
}

fn entry(e: pb::FileStat) -> FileEntry {
    FileEntry {
        name: e.name,
        is_dir: e.kind == pb::FileKind::Dir as i32,
        is_symlink: e.kind == pb::FileKind::Symlink as i32,
        size: e.size,
        mode: e.mode,
        mtime_unix_ms: e.mtime_ms,
        uid: e.uid,
        gid: e.gid,
    }
}

/// Lists `path` in the sandbox (recursively if asked), at most `max_entries` (0: the
/// protocol's MAX_DIR_ENTRIES); the entries and whether there were more.
pub async fn list(
    target: FileTarget,
    path: String,
    recursive: bool,
    max_entries: u32,
) -> ApiResult<(Vec<FileEntry>, bool)> {
    let (root, rel) = check_path(&path, &target.policy.exportable, "exportable")?;
    let req = pb::ListDir {
        path: rel.to_owned(),
        root: root.to_owned(),
        user: target.user.clone(),
        recursive,
        max_entries,
    };
    let (id, rel) = (target.sandbox_id.clone(), rel.to_owned());
    match ask(target, rel, pb::request::Kind::ListDir(req)).await? {
        pb::response::Kind::DirListing(l) => {
            Ok((l.entries.into_iter().map(entry).collect(), l.truncated))
        }
        other => Err(unexpected(&id, "a listing", &other)),
    }
}

/// Describes `path` (a symlink itself).
pub async fn stat(target: FileTarget, path: String) -> ApiResult<FileEntry> {
    let (root, rel) = check_path(&path, &target.policy.exportable, "exportable")?;
    let req = pb::Stat {
        path: rel.to_owned(),
        root: root.to_owned(),
        user: target.user.clone(),
    };
    let (id, rel) = (target.sandbox_id.clone(), rel.to_owned());
    match ask(target, rel, pb::request::Kind::Stat(req)).await? {
        pb::response::Kind::FileStat(s) => Ok(FileEntry {
            name: path,
            ..entry(s)
        }),
        other => Err(unexpected(&id, "a stat", &other)),
    }
}

/// A change to the sandbox's files, under its writable prefixes.
#[derive(Debug)]
pub enum Op {
    MakeDir { parents: bool, mode: u32 },
    Remove { recursive: bool },
    Rename { to: String },
}

/// Makes, removes or renames `path` in the sandbox. A rename's two paths must lie under the
/// same writable prefix (the agent resolves both inside it).
pub async fn change(target: FileTarget, path: String, op: Op) -> ApiResult<()> {
    let (root, rel) = check_path(&path, &target.policy.writable, "writable")?;
    let (root, rel) = (root.to_owned(), rel.to_owned());
    let user = target.user.clone();
    let kind = match op {
        Op::MakeDir { parents, mode } => pb::request::Kind::Mkdir(pb::Mkdir {
            path: rel.clone(),
            parents,
            mode: mode & 0o7777,
            root,
            user,
        }),
        Op::Remove { recursive } => {
            if rel == "/" {
                return Err(ApiError::InvalidArgument(format!(
                    "{path} is a policy prefix itself; remove what is under it"
                )));
            }
            pb::request::Kind::Remove(pb::Remove {
                path: rel.clone(),
                recursive,
                root,
                user,
            })
        }
        Op::Rename { to } => {
            let (to_root, to_rel) = check_path(&to, &target.policy.writable, "writable")?;
            if to_root != root {
                return Err(ApiError::InvalidArgument(format!(
                    "{path} and {to} lie under different writable prefixes ({root}, {to_root})"
                )));
            }
            pb::request::Kind::Rename(pb::Rename {
                from: rel.clone(),
                to: to_rel.to_owned(),
                root,
                user,
            })
        }
    };
    let id = target.sandbox_id.clone();
    match ask(target, rel, kind).await? {
        pb::response::Kind::Ok(_) => Ok(()),
        other => Err(unexpected(&id, "a change", &other)),
    }
}

/// Writes a whole file at an absolute `path` (parents created): the files a create places.
pub fn write_all(
    client: &mut MuxClient,
    path: &str,
    data: &[u8],
    mode: u32,
) -> Result<(), airlock_proto::ClientError> {
    let template = pb::WriteFile {
        path: path.to_owned(),
        mode,
        create_parents: true,
        ..Default::default()
    };
    client.within(CALL_TIMEOUT, |c| c.write_file_with(&template, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symlink_to_a_denied_file_is_denied_by_what_it_resolves_to() {
        let denied = vec!["id_rsa".to_owned(), "/etc/shadow".to_owned()];
        denied_resolved(&denied, "/home/user/notes", "/home/user/notes").unwrap();
        denied_resolved(&denied, "/home/user/notes", "").unwrap();
        denied_resolved(&denied, "/home/user/notes", "/home/user/other.txt").unwrap();
        for target in ["/home/user/.ssh/id_rsa", "/etc/shadow"] {
            let err = denied_resolved(&denied, "/home/user/notes", target).unwrap_err();
            assert_eq!(err.reason(), "EXPORT_DENIED", "{err}");
            assert!(err.to_string().contains(target), "{err}");
        }
    }

    #[test]
    fn denied_patterns_match_names_anywhere_and_paths_whole() {
        let denied: Vec<String> = [".env", "*.pem", "id_rsa", "/tmp/secret/*", "key?.txt"]
            .map(String::from)
            .to_vec();
        for (path, want) in [
            ("/tmp/.env", Some(".env")),
            ("/tmp/app/.env", Some(".env")),
            ("/tmp/.env.local", None),
            ("/tmp/cert.pem", Some("*.pem")),
            ("/tmp/.ssh/id_rsa", Some("id_rsa")),
            ("/tmp/id_rsa.pub", None),
            ("/tmp/secret/a", Some("/tmp/secret/*")),
            ("/tmp/secretly", None),
            ("/tmp/key1.txt", Some("key?.txt")),
            ("/tmp/key10.txt", None),
            ("/tmp/id_rsa/inside", Some("id_rsa")),
            ("/tmp/report.txt", None),
        ] {
            assert_eq!(denied_by(&denied, path), want, "{path}");
        }
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("**x", "x"));
    }

    #[test]
    fn paths_must_lie_under_a_prefix() {
        let prefixes = vec!["/tmp".to_string(), "/workspace/".to_string()];
        assert_eq!(
            check_path("/tmp/a/b", &prefixes, "writable").unwrap(),
            ("/tmp", "/a/b")
        );
        assert_eq!(
            check_path("/workspace", &prefixes, "writable").unwrap(),
            ("/workspace", "/")
        );
        assert!(matches!(
            check_path("/tmpfoo/x", &prefixes, "writable"),
            Err(ApiError::PathNotAllowed { .. })
        ));
        assert!(matches!(
            check_path("/etc/passwd", &prefixes, "writable"),
            Err(ApiError::PathNotAllowed { .. })
        ));
        assert!(matches!(
            check_path("/tmp/../etc/passwd", &prefixes, "writable"),
            Err(ApiError::InvalidArgument(_))
        ));
        assert!(check_path("relative", &prefixes, "writable").is_err());
        assert!(check_path("/tmp//x", &prefixes, "writable").is_err());
    }
}
