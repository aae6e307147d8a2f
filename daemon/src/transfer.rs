//! File transfers with their audit events (`file.write`, `file.read`: the path, the bytes and
//! their SHA-256, or the failure), shared by the gRPC service and the E2B gateway.

use airlock_api::v1::FileChunk;
use sha2::Digest as _;
use tokio::sync::mpsc::Receiver;
use tokio_stream::{Stream, StreamExt as _};

use crate::error::{ApiError, ApiResult};
use crate::files::{self, FileTarget};

/// Writes what `data` yields to `path` (mode `mode`) in `target`'s sandbox; the bytes written.
/// A failed `data` ends the write with its error (what arrived before is written).
pub async fn write<S>(
    target: FileTarget,
    tenant: &str,
    path: String,
    mode: u32,
    mut data: S,
) -> ApiResult<u64>
where
    S: Stream<Item = ApiResult<Vec<u8>>> + Unpin,
{
    let sandbox = target.sandbox_id.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
    let writer = tokio::spawn(files::write(target, path.clone(), mode, rx));
    let mut hash = sha2::Sha256::new();
    let mut failed = None;
    while let Some(item) = data.next().await {
        match item {
            Ok(chunk) => {
                hash.update(&chunk);
                if tx.send(chunk).await.is_err() {
                    break; // the writer ended (with an error it returns below)
                }
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let written = writer
        .await
        .map_err(|e| ApiError::Internal(format!("file task: {e}")))?;
    let written = match failed {
        Some(e) => Err(e),
        None => written,
    };
    crate::audit::emit(
        tenant,
        crate::audit::Kind::FileWrite,
        &sandbox,
        "",
        serde_json::json!({
            "path": path,
            "bytes": written.as_ref().ok(),
            "sha256": crate::audit::hex(&hash.finalize()),
            "error": written.as_ref().err().map(|e| e.reason().to_owned()),
        }),
    );
    written
}

/// Reads `path` from `target`'s sandbox: its chunks (or the error that ended the read, as
/// `into` makes it for the caller's protocol) arrive on the returned channel. A refusal before
/// any byte is the error returned (and audited as a denial).
pub fn read<E: Send + 'static>(
    target: FileTarget,
    tenant: &str,
    path: String,
    into: fn(ApiError) -> E,
) -> ApiResult<Receiver<Result<FileChunk, E>>> {
    let sandbox = target.sandbox_id.clone();
    let mut chunks = match files::read(target, path.clone()) {
        Ok(c) => c,
        Err(e) => {
            crate::audit::denial(tenant, &sandbox, "ReadFile", &e);
            return Err(e);
        }
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let tenant = tenant.to_owned();
    tokio::spawn(async move {
        let (mut hash, mut bytes, mut error) = (sha2::Sha256::new(), 0u64, None);
        while let Some(c) = chunks.recv().await {
            match &c {
                Ok(chunk) => {
                    hash.update(&chunk.data);
                    bytes += chunk.data.len() as u64;
                }
                Err(e) => error = Some(e.reason().to_owned()),
            }
            if tx.send(c.map_err(into)).await.is_err() {
                error.get_or_insert_with(|| "the caller went away".into());
                break;
            }
        }
        crate::audit::emit(
            &tenant,
            crate::audit::Kind::FileRead,
            &sandbox,
            "",
            serde_json::json!({
                "path": path,
                "bytes": bytes,
                "sha256": crate::audit::hex(&hash.finalize()),
                "error": error,
            }),
        );
    });
    Ok(rx)
}
