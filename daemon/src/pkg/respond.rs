//! How the package proxy answers a guest: response bodies, refusals in the form each client
//! shows (pip's index pages, npm's JSON, a reason phrase), install events, a registry's
//! failure, and a cached file streamed.

use airlock_api::v1::{InstallEvent, InstallOutcome};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::Frame;
use hyper::{Response, StatusCode};
use tokio::io::AsyncReadExt as _;

use super::http::FetchError;
use super::{Kind, Session};

pub(super) type Body = BoxBody<Bytes, std::io::Error>;

pub(super) fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// A response with status, content type and body.
pub(super) fn respond(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    if let Ok(v) = ctype.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Printable ASCII only (a header value or a reason phrase).
pub(super) fn header_text(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .map(|c| if c == '"' { '\'' } else { c })
        .take(400)
        .collect()
}

/// A refusal or failure: the message as reason phrase and body.
pub(super) fn fail(status: StatusCode, message: &str, npm_client: bool) -> Response<Body> {
    let text = header_text(message);
    let mut r = if npm_client {
        respond(
            status,
            "application/json",
            serde_json::json!({ "error": text }).to_string(),
        )
    } else {
        respond(
            status,
            "text/plain; charset=utf-8",
            format!("airlock: {message}\n"),
        )
    };
    if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(format!("airlock: {text}").into_bytes())
    {
        r.extensions_mut().insert(reason);
    }
    r
}

/// A refused index page, in the form the client will show.
pub(super) fn refuse_index(message: &str, pip: bool) -> Response<Body> {
    if pip {
        let ctype = format!(
            "application/x-airlock-refusal; reason=\"{}\"",
            header_text(message)
        );
        let mut r = respond(
            StatusCode::OK,
            "text/plain",
            format!("airlock: {message}\n"),
        );
        if let Ok(v) = ctype.parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    } else {
        fail(StatusCode::FORBIDDEN, message, true)
    }
}

pub(super) fn event(reg: &str, kind: Kind, package: &str) -> InstallEvent {
    InstallEvent {
        registry: reg.to_owned(),
        kind: kind.as_str().to_owned(),
        package: package.to_owned(),
        ..Default::default()
    }
}

pub(super) fn upstream_failed(
    s: &Session,
    mut ev: InstallEvent,
    e: &FetchError,
    npm: bool,
) -> Response<Body> {
    let msg = match e {
        FetchError::Upstream(m) => format!("the registry failed: {m}"),
        FetchError::NotFound => "the registry has no such file".to_owned(),
        FetchError::TooLarge { limit, .. } => {
            format!("the registry's answer is larger than the proxy's limit of {limit} bytes")
        }
        FetchError::Mismatch { expected } => {
            format!("the registry's answer does not have the digest {expected}")
        }
        FetchError::Refused(r) => format!("the proxy did not connect: {r}"),
    };
    ev.outcome = InstallOutcome::UpstreamError as i32;
    ev.message = msg.clone();
    s.record(ev);
    fail(StatusCode::BAD_GATEWAY, &msg, npm)
}

/// Records `ev` with `outcome` and `msg`, and answers `msg` with `status`.
pub(super) fn refuse(
    s: &Session,
    mut ev: InstallEvent,
    outcome: InstallOutcome,
    status: StatusCode,
    msg: String,
    npm_client: bool,
) -> Response<Body> {
    ev.outcome = outcome as i32;
    ev.message = msg.clone();
    s.record(ev);
    fail(status, &msg, npm_client)
}

/// A cached file's response: its bytes streamed as they are read.
pub(super) fn stream(f: tokio::fs::File, size: u64) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut f = f;
        loop {
            let mut buf = vec![0u8; 256 << 10];
            match f.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send(Ok(Frame::data(Bytes::from(buf)))).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    break;
                }
            }
        }
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed();
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(hyper::header::CONTENT_LENGTH, size.into());
    resp
}
