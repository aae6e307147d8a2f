//! What the HTTP relay ([`super::http`]) does for brokered secrets: adds their headers to a
//! request for their host ([`add_headers`]: the guest's own value replaced, the header marked
//! sensitive, the use audited) and strips every form of the sandbox's secret values from the
//! answer ([`strip_echoes`]), so that an upstream that echoes the request does not hand the
//! value to the guest.

use std::borrow::Cow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};

use super::NetState;
use crate::secrets::redact::{Patterns, StreamRedactor};

/// The body of an answer the relay returns to the guest.
pub(super) type Body = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// Adds the brokered headers for `name` to `req` if its `host` is `name` (and audits their
/// use); the patterns to strip from its answer, if it got any.
pub(super) fn add_headers<B>(
    state: &NetState,
    req: &mut Request<B>,
    host: &str,
    name: &str,
    tls: bool,
) -> Option<Arc<Patterns>> {
    if host != name {
        return None;
    }
    let mut used = Vec::new();
    for (header, value, secret) in state.secrets.headers_for(name, tls) {
        let (Ok(h), Ok(mut v)) = (
            HeaderName::from_bytes(header.as_bytes()),
            HeaderValue::from_str(&value),
        ) else {
            continue;
        };
        v.set_sensitive(true);
        // The guest's own value for the header goes: the secret's replaces it.
        req.headers_mut().insert(h, v);
        used.push(secret);
    }
    if used.is_empty() {
        return None;
    }
    // An answer that echoes the request is stripped of the secret below: it must come
    // uncompressed for that.
    req.headers_mut().insert(
        hyper::header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    crate::audit::emit(
        &state.tenant,
        crate::audit::Kind::SecretUse,
        &state.sandbox_id,
        "",
        serde_json::json!({
            "names": used,
            "by": "broker",
            "host": name,
            "https": tls,
            "method": req.method().as_str(),
        }),
    );
    Some(state.secrets.patterns())
}

/// The answer to a request that carried secrets, with every form of the sandbox's secret
/// values replaced in its headers and (as it streams) in its body: an upstream that echoes
/// the request (a debugging endpoint, an error page) must not hand the value to the guest.
/// A body with a `Content-Encoding` the upstream chose in spite of `identity` goes as it is.
pub(super) fn strip_echoes(resp: Response<Incoming>, patterns: Arc<Patterns>) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    for value in parts.headers.values_mut() {
        if let Cow::Owned(clean) = patterns.redact(value.as_bytes()) {
            *value = HeaderValue::from_bytes(&clean)
                .unwrap_or_else(|_| HeaderValue::from_static("[REDACTED]"));
        }
    }
    let encoded = parts
        .headers
        .get(hyper::header::CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return Response::from_parts(parts, body.boxed());
    }
    // The length changes with every replacement: the body goes chunked.
    parts.headers.remove(hyper::header::CONTENT_LENGTH);
    let body = Redacted {
        inner: body,
        redactor: Some(StreamRedactor::new(patterns)),
    };
    Response::from_parts(parts, body.boxed())
}

/// A body with the secrets' forms replaced as it streams.
struct Redacted {
    inner: Incoming,
    /// `None` once the end was released.
    redactor: Option<StreamRedactor>,
}

impl hyper::body::Body for Redacted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        loop {
            let Some(redactor) = this.redactor.as_mut() else {
                return Poll::Ready(None);
            };
            match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                // Trailers (rare in HTTP/1, and they could echo too) are dropped.
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        let out = redactor.push(&data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => {
                    let rest = redactor.finish();
                    this.redactor = None;
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                    }
                }
            }
        }
    }
}
