//! File transfer into and out of a sandbox under its file policy. A path must lie under one of
//! the policy's prefixes; the agent then resolves it *inside* that prefix (its `root`), so
//! neither `..` nor a symlink planted by the user's code can leave it.

use airlock_proto::pb;

use crate::agent::Client;
use crate::error::{ApiError, ApiResult};

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

/// Writes a whole file at an absolute `path` (parents created).
pub fn write_all(client: &mut Client, path: &str, data: &[u8], mode: u32) -> Result<(), String> {
    let template = pb::WriteFile {
        path: path.to_owned(),
        mode,
        create_parents: true,
        ..Default::default()
    };
    client
        .write_file_with(&template, data)
        .map_err(|e| e.to_string())
}

/// Writes one chunk at `offset` of `path` inside `root`.
pub fn write_chunk(
    client: &mut Client,
    root: &str,
    path: &str,
    offset: u64,
    data: Vec<u8>,
    mode: u32,
) -> Result<(), String> {
    let req = pb::WriteFile {
        path: path.to_owned(),
        offset,
        data,
        truncate: offset == 0,
        mode,
        create_parents: true,
        root: root.to_owned(),
    };
    match client.call(pb::request::Kind::WriteFile(req)) {
        Ok(pb::response::Kind::Ok(_)) => Ok(()),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Reads one chunk (at most 1 MiB) at `offset` of `path` inside `root`.
pub fn read_chunk(
    client: &mut Client,
    root: &str,
    path: &str,
    offset: u64,
) -> Result<pb::FileData, String> {
    let req = pb::ReadFile {
        path: path.to_owned(),
        offset,
        length: airlock_proto::MAX_FILE_CHUNK as u64,
        root: root.to_owned(),
    };
    match client.call(pb::request::Kind::ReadFile(req)) {
        Ok(pb::response::Kind::FileData(d)) if d.data.len() <= airlock_proto::MAX_FILE_CHUNK => {
            Ok(d)
        }
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Lists `path` inside `root`.
pub fn list(client: &mut Client, root: &str, path: &str) -> Result<pb::DirListing, String> {
    let req = pb::ListDir {
        path: path.to_owned(),
        root: root.to_owned(),
    };
    match client.call(pb::request::Kind::ListDir(req)) {
        Ok(pb::response::Kind::DirListing(l)) => Ok(l),
        Ok(other) => Err(format!("unexpected answer {other:?}")),
        Err(e) => Err(e.to_string()),
    }
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
