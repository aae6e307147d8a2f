//! Files into and out of a sandbox under its file policy. A path must lie under one of the
//! policy's prefixes; the agent then resolves it *inside* that prefix (its `root`), so neither
//! `..` nor a symlink planted by the user's code can leave it. Transfers run on blocking
//! threads with the agent's synchronous client, every chunk a call with its own deadline;
//! sizes are capped by the daemon (`max_file_bytes`) before the guest sees them.

use std::path::PathBuf;

use airlock_api::v1::{FileChunk, FileEntry, FilePolicy};
use airlock_proto::pb;
use airlock_proto::vsock::TimedClient;
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

/// A sandbox as file transfers see it.
#[derive(Clone, Debug)]
pub struct FileTarget {
    pub sandbox_id: String,
    pub vsock: PathBuf,
    pub policy: FilePolicy,
    /// Its writable space, for DISK_QUOTA_EXCEEDED.
    pub disk_limit: u64,
    /// Largest file moved.
    pub max_file_bytes: u64,
    /// The guest account the transfer acts as (empty: the default, "user").
    pub user: String,
}

impl FileTarget {
    /// The same, acting as the guest account `user` (checked; empty: the default).
    pub fn acting_as(self, user: String) -> ApiResult<Self> {
        limits::check_user(&user)?;
        Ok(Self { user, ..self })
    }

    fn call<'a>(&'a self, path: &'a str) -> AgentCall<'a> {
        AgentCall {
            sandbox: &self.sandbox_id,
            path,
            disk_limit: self.disk_limit,
        }
    }

    fn connect(&self, path: &str) -> ApiResult<TimedClient> {
        agent::client(&self.vsock).map_err(|e| from_agent(e, self.call(path)))
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
    client: &mut TimedClient,
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
    let limit = target.max_file_bytes;
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
        if chunk.size > limit || offset + chunk.data.len() as u64 > limit {
            return Err(ApiError::FileTooLarge {
                size: chunk.size.max(offset + chunk.data.len() as u64),
                limit,
            });
        }
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

/// Lists `path` in the sandbox (at most the protocol's MAX_DIR_ENTRIES entries).
pub async fn list(target: FileTarget, path: String) -> ApiResult<Vec<FileEntry>> {
    let (root, rel) = check_path(&path, &target.policy.exportable, "exportable")?;
    let (root, rel) = (root.to_owned(), rel.to_owned());
    let listing = tokio::task::spawn_blocking(move || {
        let mut client = target.connect(&rel)?;
        let req = pb::ListDir {
            path: rel.clone(),
            root,
            user: target.user.clone(),
        };
        match client.within(CALL_TIMEOUT, |c| c.call(pb::request::Kind::ListDir(req))) {
            Ok(pb::response::Kind::DirListing(l)) => Ok(l),
            Ok(other) => Err(ApiError::AgentUnavailable {
                id: target.sandbox_id.clone(),
                message: format!("the agent answered a listing with {other:?}"),
            }),
            Err(e) => Err(from_agent(e, target.call(&rel))),
        }
    })
    .await
    .map_err(|e| ApiError::Internal(format!("list task: {e}")))??;
    Ok(listing
        .entries
        .into_iter()
        .map(|e| FileEntry {
            name: e.name,
            is_dir: e.kind == pb::FileKind::Dir as i32,
            size: e.size,
            mode: e.mode,
        })
        .collect())
}

/// Writes a whole file at an absolute `path` (parents created): the files a create places.
pub fn write_all(
    client: &mut TimedClient,
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
