//! envd's `filesystem.Filesystem` over the daemon's file calls: Stat, MakeDir, Move, ListDir,
//! Remove, acting as the call's guest account (`Authorization: Basic`, else the default).
//! Relative paths are the account's home's, as with envd. Directory watches are not served.

use std::sync::Arc;

use airlock_api::v1::FileEntry;
use connectrpc::{
    ConnectError, RequestContext, Response, ServiceRequest, ServiceResult, ServiceStream,
};

use super::pb::filesystem::*;
use super::process::{connect_error, target, user};
use super::{Gateway, Target};
use crate::error::ApiError;
use crate::files::{self, FileTarget};

#[derive(Debug)]
pub struct FilesystemService {
    gw: Arc<Gateway>,
}

impl FilesystemService {
    pub fn new(gw: Arc<Gateway>) -> Self {
        Self { gw }
    }
}

/// The home directory of guest account `user` (empty: the default account, `user`).
fn home(user: &str) -> String {
    match user {
        "" => "/home/user".into(),
        "root" => "/root".into(),
        u => format!("/home/{u}"),
    }
}

/// `path` made absolute as envd makes it: `~` and relative paths are under the home directory;
/// `.` and `..` components are resolved (the daemon takes normalised paths only).
pub fn absolute(path: &str, user: &str) -> String {
    let home = home(user);
    let joined = if path == "~" || path.is_empty() {
        home
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// `ls -l`'s mode string (`-rw-r--r--`).
fn permissions(mode: u32, dir: bool, link: bool) -> String {
    let kind = if link {
        'l'
    } else if dir {
        'd'
    } else {
        '-'
    };
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn account(id: u32) -> String {
    match id {
        0 => "root".into(),
        1000 => "user".into(),
        n => n.to_string(),
    }
}

/// envd's `EntryInfo` of an entry at `path`.
pub fn entry_info(e: &FileEntry, path: &str) -> EntryInfo {
    let name = path.rsplit('/').next().unwrap_or_default().to_owned();
    let kind = if e.is_dir {
        FileType::FILE_TYPE_DIRECTORY
    } else {
        FileType::FILE_TYPE_FILE
    };
    EntryInfo {
        name,
        r#type: kind.into(),
        path: path.to_owned(),
        size: i64::try_from(e.size).unwrap_or(i64::MAX),
        mode: e.mode & 0o7777,
        permissions: permissions(e.mode, e.is_dir, e.is_symlink),
        owner: account(e.uid),
        group: account(e.gid),
        modified_time: buffa_types::google::protobuf::Timestamp {
            seconds: e.mtime_unix_ms.div_euclid(1000),
            nanos: (e.mtime_unix_ms.rem_euclid(1000) * 1_000_000) as i32,
            ..Default::default()
        }
        .into(),
        is_symlink: e.is_symlink,
        ..Default::default()
    }
}

impl FilesystemService {
    /// The sandbox's files as the call's account, and `path` made absolute.
    fn files(
        &self,
        ctx: &RequestContext,
        path: &str,
    ) -> Result<(Target, FileTarget, String), ConnectError> {
        let t = target(ctx)?;
        let u = user(ctx);
        let path = absolute(path, &u);
        let ft =
            t.rt.file_target(self.gw.daemon.cfg.max_file_bytes)
                .and_then(|f| f.acting_as(u))
                .map_err(|e| connect_error(&t, "e2b.Files", &e))?;
        Ok((t, ft, path))
    }

    async fn stat_of(
        &self,
        t: &Target,
        ft: FileTarget,
        path: &str,
    ) -> Result<EntryInfo, ConnectError> {
        match files::stat(ft, path.to_owned()).await {
            Ok(e) => Ok(entry_info(&e, path)),
            Err(ApiError::FileNotFound { .. }) => Err(ConnectError::not_found(format!(
                "path '{path}' does not exist"
            ))),
            Err(e) => Err(connect_error(t, "e2b.Stat", &e)),
        }
    }
}

#[allow(refining_impl_trait)]
impl Filesystem for FilesystemService {
    async fn stat(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, StatRequest>,
    ) -> ServiceResult<StatResponse> {
        let (t, ft, path) = self.files(&ctx, &request.to_owned_message().path)?;
        let entry = self.stat_of(&t, ft, &path).await?;
        Response::ok(StatResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn make_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, MakeDirRequest>,
    ) -> ServiceResult<MakeDirResponse> {
        let (t, ft, path) = self.files(&ctx, &request.to_owned_message().path)?;
        if let Ok(e) = self.stat_of(&t, ft.clone(), &path).await {
            let what = if e.r#type.to_i32() == FileType::FILE_TYPE_DIRECTORY as i32 {
                "directory"
            } else {
                "file"
            };
            return Err(ConnectError::already_exists(format!(
                "{what} '{path}' already exists"
            )));
        }
        let op = files::Op::MakeDir {
            parents: true,
            mode: 0o755,
        };
        files::change(ft.clone(), path.clone(), op)
            .await
            .map_err(|e| connect_error(&t, "e2b.MakeDir", &e))?;
        let entry = self.stat_of(&t, ft, &path).await?;
        Response::ok(MakeDirResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn r#move(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, MoveRequest>,
    ) -> ServiceResult<MoveResponse> {
        let r = request.to_owned_message();
        let (t, ft, from) = self.files(&ctx, &r.source)?;
        let to = absolute(&r.destination, &user(&ctx));
        let op = files::Op::Rename { to: to.clone() };
        files::change(ft.clone(), from.clone(), op)
            .await
            .map_err(|e| match e {
                ApiError::FileNotFound { .. } => {
                    ConnectError::not_found(format!("path '{from}' does not exist"))
                }
                e => connect_error(&t, "e2b.Move", &e),
            })?;
        let entry = self.stat_of(&t, ft, &to).await?;
        Response::ok(MoveResponse {
            entry: entry.into(),
            ..Default::default()
        })
    }

    async fn list_dir(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, ListDirRequest>,
    ) -> ServiceResult<ListDirResponse> {
        let r = request.to_owned_message();
        let (t, ft, path) = self.files(&ctx, &r.path)?;
        let depth = r.depth.max(1) as usize;
        let listed = files::list(ft, path.clone(), depth > 1, 0).await;
        let (found, _) = listed.map_err(|e| match e {
            ApiError::FileNotFound { .. } => {
                ConnectError::not_found(format!("path '{path}' does not exist"))
            }
            e => connect_error(&t, "e2b.ListDir", &e),
        })?;
        let base = path.trim_end_matches('/');
        let entries = found
            .iter()
            .filter(|e| e.name.split('/').count() <= depth)
            .map(|e| entry_info(e, &format!("{base}/{}", e.name)))
            .collect();
        Response::ok(ListDirResponse {
            entries,
            ..Default::default()
        })
    }

    async fn remove(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, RemoveRequest>,
    ) -> ServiceResult<RemoveResponse> {
        let (t, ft, path) = self.files(&ctx, &request.to_owned_message().path)?;
        files::change(ft, path.clone(), files::Op::Remove { recursive: true })
            .await
            .map_err(|e| match e {
                ApiError::FileNotFound { .. } => {
                    ConnectError::not_found(format!("path '{path}' does not exist"))
                }
                e => connect_error(&t, "e2b.Remove", &e),
            })?;
        Response::ok(RemoveResponse::default())
    }

    async fn watch_dir(
        &self,
        _: RequestContext,
        _: ServiceRequest<'_, WatchDirRequest>,
    ) -> ServiceResult<ServiceStream<WatchDirResponse>> {
        Err(ConnectError::unimplemented(
            "directory watches are not served by Airlock's E2B gateway",
        ))
    }

    async fn create_watcher(
        &self,
        _: RequestContext,
        _: ServiceRequest<'_, CreateWatcherRequest>,
    ) -> ServiceResult<CreateWatcherResponse> {
        Err(ConnectError::unimplemented(
            "directory watches are not served by Airlock's E2B gateway",
        ))
    }

    async fn get_watcher_events(
        &self,
        _: RequestContext,
        _: ServiceRequest<'_, GetWatcherEventsRequest>,
    ) -> ServiceResult<GetWatcherEventsResponse> {
        Err(ConnectError::unimplemented(
            "directory watches are not served by Airlock's E2B gateway",
        ))
    }

    async fn remove_watcher(
        &self,
        _: RequestContext,
        _: ServiceRequest<'_, RemoveWatcherRequest>,
    ) -> ServiceResult<RemoveWatcherResponse> {
        Err(ConnectError::unimplemented(
            "directory watches are not served by Airlock's E2B gateway",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_made_absolute_as_envd_does() {
        assert_eq!(absolute("a.txt", ""), "/home/user/a.txt");
        assert_eq!(absolute("~/x/../y", ""), "/home/user/y");
        assert_eq!(absolute("rel/b", "root"), "/root/rel/b");
        assert_eq!(absolute("/tmp/./z/", ""), "/tmp/z");
        assert_eq!(absolute("/../../etc", ""), "/etc");
        assert_eq!(absolute("", "alice"), "/home/alice");
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(0o644, false, false), "-rw-r--r--");
        assert_eq!(permissions(0o755, true, false), "drwxr-xr-x");
        assert_eq!(permissions(0o777, false, true), "lrwxrwxrwx");
    }
}
