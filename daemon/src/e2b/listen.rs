//! The gateway's listener: connections within the daemon's TCP limits (`tcp::limit`: at
//! most `max_connections`, TLS handshakes under `tls_handshake_timeout_ms`, idle connections
//! closed after `idle_timeout_ms`), HTTP/1 request heads within `header_read_timeout_ms`, and
//! request bodies of at most `[e2b] max_body_bytes`: a larger declared `Content-Length` is
//! answered 413 at once, before its body is read, and the connection closed; a streamed body
//! fails where it passes the limit.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use tokio_rustls::TlsAcceptor;
use tokio_stream::StreamExt;

use crate::error::StartError;
use crate::tcp::limit::{self, ConnLimits};

/// `router` with request bodies of at most `max` bytes.
pub fn limit_bodies(router: Router, max: u64) -> Router {
    router.layer(axum::middleware::from_fn_with_state(max, body_limit))
}

/// A request whose declared body is over `max` is refused (413, the connection closed) before
/// its body is read; any other body is cut off where it passes `max`.
async fn body_limit(State(max): State<u64>, req: Request, next: Next) -> Response {
    let declared = super::header_str(req.headers(), "content-length")
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > max) {
        let mut r = super::json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the request body is over the gateway's limit of {max} bytes"),
        );
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    let cap = usize::try_from(max).unwrap_or(usize::MAX);
    next.run(req.map(|b| Body::new(http_body_util::Limited::new(b, cap))))
        .await
}

/// Serves `app` on `listener` within `limits` (TLS with `tls`), HTTP/1 heads within
/// `header_timeout`; returns only if accepting stops.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnLimits,
    tls: Option<TlsAcceptor>,
    header_timeout: Duration,
) -> Result<(), StartError> {
    let mut incoming = limit::connections(listener, limits, tls);
    while let Some(conn) = incoming.next().await {
        let Ok(conn) = conn else {
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            let svc = hyper_util::service::TowerToHyperService::new(app);
            let mut builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            builder.http2().timer(hyper_util::rt::TokioTimer::new());
            let io = hyper_util::rt::TokioIo::new(conn);
            if let Err(e) = builder.serve_connection(io, svc).await {
                tracing::debug!("e2b connection: {e}");
            }
        });
    }
    Err(StartError::Serve(
        "[e2b] the listener stopped accepting".into(),
    ))
}

#[cfg(test)]
mod tests;
