//! envd's plain-HTTP endpoints: `GET /health`, `GET /files?path=` (a download) and `POST
//! /files` (uploads: a raw body to `?path=`, gzip-encoded or not, or multipart parts named
//! `file` whose file names are their destinations), as the `username` the query names. Errors
//! are envd's JSON (`{"code": STATUS, "message": ...}`).

use std::io::Read as _;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::StreamExt as _;
use serde::Deserialize;

use super::filesystem::absolute;
use super::{Gateway, Target, api_error, json, json_error};
use crate::error::{ApiError, ApiResult};

pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/health", get(health))
        .route("/files", get(download).post(upload))
}

async fn health() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

fn target_of(req: &Request) -> Result<Target, Response> {
    req.extensions()
        .get::<Target>()
        .cloned()
        .ok_or_else(|| json_error(StatusCode::UNAUTHORIZED, "no sandbox"))
}

/// A daemon error as envd answers it (a missing file is a 404 that names the path).
fn file_error(t: &Target, call: &str, path: &str, e: &ApiError) -> Response {
    match e {
        ApiError::FileNotFound { .. } => json_error(
            StatusCode::NOT_FOUND,
            &format!("path '{path}' does not exist"),
        ),
        e => api_error(t.tenant(), &t.rt.id, call, e),
    }
}

async fn download(
    State(gw): State<Arc<Gateway>>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    let t = match target_of(&req) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let user = q.username.unwrap_or_default();
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return json_error(StatusCode::BAD_REQUEST, "path is required");
    };
    let path = absolute(&path, &user);
    let max = gw.daemon.cfg.max_file_bytes;
    let ft = match t.rt.file_target(max).and_then(|f| f.acting_as(user)) {
        Ok(f) => f,
        Err(e) => return file_error(&t, "e2b.ReadFile", &path, &e),
    };
    let mut chunks = match crate::transfer::read(ft, t.tenant(), path.clone(), |e| e) {
        Ok(c) => c,
        Err(e) => return file_error(&t, "e2b.ReadFile", &path, &e),
    };
    // The first chunk tells a missing or refused file from a readable one.
    let first = match chunks.recv().await {
        Some(Ok(c)) => c.data,
        Some(Err(e)) => return file_error(&t, "e2b.ReadFile", &path, &e),
        None => Vec::new(),
    };
    let rest = tokio_stream::wrappers::ReceiverStream::new(chunks).map(|c| {
        c.map(|c| bytes::Bytes::from(c.data))
            .map_err(|e| std::io::Error::other(e.to_string()))
    });
    let body = futures_util::stream::once(async move { Ok(bytes::Bytes::from(first)) }).chain(rest);
    let mut r = Response::new(Body::from_stream(body));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    r
}

/// Decompresses a gzip upload, at most `max` bytes of it.
fn gunzip(data: &[u8], max: u64) -> ApiResult<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| ApiError::InvalidArgument(format!("gzip body: {e}")))?;
    if out.len() as u64 > max {
        return Err(ApiError::FileTooLarge {
            size: out.len() as u64,
            limit: max,
        });
    }
    Ok(out)
}

/// One uploaded file, written; its entry as envd reports it.
async fn put(
    t: &Target,
    max: u64,
    user: &str,
    path: &str,
    data: impl tokio_stream::Stream<Item = ApiResult<Vec<u8>>> + Unpin,
) -> Result<serde_json::Value, Response> {
    let path = absolute(path, user);
    let ft =
        t.rt.file_target(max)
            .and_then(|f| f.acting_as(user.to_owned()))
            .map_err(|e| file_error(t, "e2b.WriteFile", &path, &e))?;
    crate::transfer::write(ft, t.tenant(), path.clone(), 0o644, data)
        .await
        .map_err(|e| file_error(t, "e2b.WriteFile", &path, &e))?;
    let name = path.rsplit('/').next().unwrap_or_default();
    Ok(serde_json::json!({"name": name, "type": "file", "path": path}))
}

/// POST /files: the multipart form's `file` parts, or the raw body to `?path=`, written.
async fn upload(
    State(gw): State<Arc<Gateway>>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    let t = match target_of(&req) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let max = gw.daemon.cfg.max_file_bytes;
    let user = q.username.clone().unwrap_or_default();
    let content_type = super::header_str(req.headers(), "content-type").unwrap_or_default();
    let gzip = super::header_str(req.headers(), "content-encoding")
        .is_some_and(|e| e.trim().eq_ignore_ascii_case("gzip"));
    let written = if content_type.starts_with("multipart/form-data") {
        upload_parts(&t, max, &user, q.path.as_deref(), req).await
    } else {
        upload_body(&t, max, &user, q.path.as_deref(), gzip, req)
            .await
            .map(|v| vec![v])
    };
    let written = match written {
        Ok(w) => w,
        Err(r) => return r,
    };
    if written.is_empty() {
        return json_error(StatusCode::BAD_REQUEST, "no file in the request");
    }
    json(StatusCode::OK, &written)
}

/// Upload step: each multipart part named `file` written to its destination, in order.
async fn upload_parts(
    t: &Target,
    max: u64,
    user: &str,
    path: Option<&str>,
    req: Request,
) -> Result<Vec<serde_json::Value>, Response> {
    let mut form = Multipart::from_request(req, &())
        .await
        .map_err(|e| json_error(StatusCode::BAD_REQUEST, &format!("multipart: {e}")))?;
    let mut written = Vec::new();
    let mut parts = 0;
    while let Some(field) = form
        .next_field()
        .await
        .map_err(|e| json_error(StatusCode::BAD_REQUEST, &format!("multipart: {e}")))?
    {
        if field.name() != Some("file") {
            continue;
        }
        parts += 1;
        // One part: the query's path wins; several: each part names its destination.
        let dest = match (path, field.file_name()) {
            (Some(p), _) if parts == 1 && !p.is_empty() => p.to_owned(),
            (_, Some(f)) if !f.is_empty() => f.to_owned(),
            _ => {
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    "a file part without a destination",
                ));
            }
        };
        let data = field.map(|c| {
            c.map(|b| b.to_vec())
                .map_err(|e| ApiError::InvalidArgument(format!("multipart: {e}")))
        });
        written.push(put(t, max, user, &dest, Box::pin(data)).await?);
    }
    Ok(written)
}

/// Upload step: the raw body written to `path` (a gzip one inflated first, whole).
async fn upload_body(
    t: &Target,
    max: u64,
    user: &str,
    path: Option<&str>,
    gzip: bool,
    req: Request,
) -> Result<serde_json::Value, Response> {
    let Some(path) = path.filter(|p| !p.is_empty()) else {
        return Err(json_error(StatusCode::BAD_REQUEST, "path is required"));
    };
    let body = req.into_body().into_data_stream().map(|c| {
        c.map(|b| b.to_vec())
            .map_err(|e| ApiError::InvalidArgument(format!("request body: {e}")))
    });
    if !gzip {
        return put(t, max, user, path, Box::pin(body)).await;
    }
    // A gzip stream is inflated whole (bounded): the writer takes plain bytes.
    let raw = axum::body::to_bytes(
        Body::from_stream(body.map(|c| c.map_err(|e| std::io::Error::other(e.to_string())))),
        usize::try_from(max).unwrap_or(usize::MAX),
    )
    .await
    .map_err(|e| json_error(StatusCode::PAYLOAD_TOO_LARGE, &format!("body: {e}")))?;
    let plain = gunzip(&raw, max).map_err(|e| file_error(t, "e2b.WriteFile", path, &e))?;
    put(
        t,
        max,
        user,
        path,
        Box::pin(tokio_stream::iter([Ok(plain)])),
    )
    .await
}
