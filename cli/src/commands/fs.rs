//! `fs ls|stat|mkdir|rm|mv`: file calls on a sandbox's paths (`ID:/PATH`).

use airlock_api::v1::{
    FileEntry, ListFilesRequest, MakeDirRequest, RemoveFileRequest, RenameFileRequest,
    StatFileRequest,
};
use serde_json::{Value, json};

use super::{Ctx, fail};
use crate::args::{FsCommand, FsLsArgs, FsPathArgs, sandbox_path};
use crate::output::{file_entry_json, file_table, print_json};

/// The sandbox and path of `ID:/PATH`, and the account.
fn split(p: &FsPathArgs) -> Result<(String, String, String), String> {
    let (id, path) =
        sandbox_path(&p.target).ok_or_else(|| format!("{}: expected ID:/PATH", p.target))?;
    Ok((
        id.to_owned(),
        path.to_owned(),
        p.user.clone().unwrap_or_default(),
    ))
}

/// Runs an `fs` command; text mode prints nothing for the changes.
pub async fn run(ctx: &mut Ctx, command: FsCommand) -> Result<u8, String> {
    let done = |ctx: &Ctx, what: &str, path: &str| {
        if ctx.json {
            print_json(&json!({"path": path, what: true}));
        }
    };
    match command {
        FsCommand::Ls(a) => ls(ctx, &a).await?,
        FsCommand::Stat(a) => stat(ctx, &a).await?,
        FsCommand::Mkdir(a) => {
            let (sandbox_id, path, user) = split(&a.path)?;
            let req = MakeDirRequest {
                sandbox_id,
                path: path.clone(),
                parents: a.parents,
                mode: 0,
                user,
            };
            ctx.client.make_dir(req).await.map_err(fail)?;
            done(ctx, "made", &path);
        }
        FsCommand::Rm(a) => {
            let (sandbox_id, path, user) = split(&a.path)?;
            let req = RemoveFileRequest {
                sandbox_id,
                path: path.clone(),
                recursive: a.recursive,
                user,
            };
            ctx.client.remove_file(req).await.map_err(fail)?;
            done(ctx, "removed", &path);
        }
        FsCommand::Mv(a) => {
            let (sandbox_id, from, user) = split(&a.path)?;
            let req = RenameFileRequest {
                sandbox_id,
                from: from.clone(),
                to: a.to.clone(),
                user,
            };
            ctx.client.rename_file(req).await.map_err(fail)?;
            if ctx.json {
                print_json(&json!({"from": from, "to": a.to}));
            }
        }
    }
    Ok(0)
}

/// `fs ls`: the directory's entries, a list (JSON) or a table with a note when truncated.
async fn ls(ctx: &mut Ctx, a: &FsLsArgs) -> Result<(), String> {
    let (sandbox_id, path, user) = split(&a.path)?;
    let r = ctx
        .client
        .list_files(ListFilesRequest {
            sandbox_id,
            path,
            user,
            recursive: a.recursive,
            max_entries: a.max.unwrap_or(0),
        })
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&Value::Array(
            r.entries.iter().map(file_entry_json).collect(),
        ));
    } else {
        print!("{}", file_table(&r.entries));
        if r.truncated {
            eprintln!("airlock: more entries than shown (--max)");
        }
    }
    Ok(())
}

/// `fs stat`: the path's entry, as JSON or a one-row table.
async fn stat(ctx: &mut Ctx, a: &FsPathArgs) -> Result<(), String> {
    let (sandbox_id, path, user) = split(a)?;
    let req = StatFileRequest {
        sandbox_id,
        path,
        user,
    };
    let e: FileEntry = ctx.client.stat_file(req).await.map_err(fail)?.into_inner();
    if ctx.json {
        print_json(&file_entry_json(&e));
    } else {
        print!("{}", file_table(std::slice::from_ref(&e)));
    }
    Ok(())
}
