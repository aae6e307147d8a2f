//! `cp`: files into and out of a sandbox.

use airlock_api::v1::{ReadFileRequest, WriteFileHeader, WriteFileRequest, write_file_request};
use serde_json::json;

use super::{Ctx, fail};
use crate::args::{CpArgs, sandbox_path};
use crate::output::print_json;

/// Bytes per WriteFile message.
const CHUNK: usize = 1 << 20;

/// `cp LOCAL ID:PATH` or `cp ID:PATH LOCAL`.
pub async fn cp(ctx: &mut Ctx, args: &CpArgs) -> Result<u8, String> {
    let user = args.user.as_deref().unwrap_or("");
    if let Some((id, path)) = sandbox_path(&args.to) {
        let file = Remote { id, path, user };
        upload(ctx, &args.from, &file, args.mode.unwrap_or(0)).await
    } else if let Some((id, path)) = args.from.split_once(':') {
        download(ctx, &Remote { id, path, user }, &args.to).await
    } else {
        Err("cp: one side must be ID:PATH (cp LOCAL ID:PATH | cp ID:PATH LOCAL)".into())
    }
}

/// A file in a sandbox, and the guest account that reads or writes it (empty: the default).
pub struct Remote<'a> {
    pub id: &'a str,
    pub path: &'a str,
    pub user: &'a str,
}

/// The WriteFile messages of a file: the header, then its data in chunks.
pub fn write_messages(file: &Remote<'_>, mode: u32, data: &[u8]) -> Vec<WriteFileRequest> {
    let header = WriteFileRequest {
        part: Some(write_file_request::Part::Header(WriteFileHeader {
            sandbox_id: file.id.into(),
            path: file.path.into(),
            mode,
            user: file.user.into(),
        })),
    };
    let chunks = data.chunks(CHUNK).map(|c| WriteFileRequest {
        part: Some(write_file_request::Part::Data(c.to_vec())),
    });
    std::iter::once(header).chain(chunks).collect()
}

async fn upload(ctx: &mut Ctx, local: &str, file: &Remote<'_>, mode: u32) -> Result<u8, String> {
    let data = std::fs::read(local).map_err(|e| format!("{local}: {e}"))?;
    let msgs = write_messages(file, mode, &data);
    let (id, path) = (file.id, file.path);
    let r = ctx
        .client
        .write_file(tonic::codegen::tokio_stream::iter(msgs))
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&json!({"sandbox_id": id, "path": path, "bytes_written": r.bytes_written}));
    } else {
        eprintln!("{} bytes written", r.bytes_written);
    }
    Ok(0)
}

async fn download(ctx: &mut Ctx, file: &Remote<'_>, local: &str) -> Result<u8, String> {
    let (id, path) = (file.id, file.path);
    let req = ReadFileRequest {
        sandbox_id: id.into(),
        path: path.into(),
        user: file.user.into(),
    };
    let mut s = ctx.client.read_file(req).await.map_err(fail)?.into_inner();
    let mut out = Vec::new();
    while let Some(c) = s.message().await.map_err(fail)? {
        out.extend_from_slice(&c.data);
    }
    std::fs::write(local, &out).map_err(|e| format!("{local}: {e}"))?;
    if ctx.json {
        print_json(
            &json!({"sandbox_id": id, "path": path, "bytes_read": out.len(), "local": local}),
        );
    }
    Ok(0)
}
