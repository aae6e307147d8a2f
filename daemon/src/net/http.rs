//! The proxy's HTTP/1.1 relay: the connections it serves request by request instead of
//! splicing them — brokered ones (their headers added to the requests for their host, echoes of
//! their values stripped from the answers: [`super::inject`]) and plain-HTTP ones that were allowed on the `Host` they stated (a domain rule), so
//! that a kept-alive connection cannot switch to another host after its first request.
//!
//! Every request is normalised and checked before anything of it goes upstream: `TRACE` and
//! `CONNECT` are refused (405); a request must carry exactly one `Host` (400), and an
//! absolute-form URI must name that same host (400) and goes on in origin form, so the
//! upstream routes by the `Host` the decision was made on and nothing else; on a connection
//! allowed by its name (`pinned`), a request whose `Host` is another name is refused (403).
//! Refusals close the connection. Upgrades (`101 Switching Protocols`, WebSocket) are joined
//! as bytes once the upstream agrees.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HOST, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use super::NetState;
use super::inject::Body;
type Sender = tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>;

/// A connection the relay serves: the name it was decided on, whether the guest speaks TLS
/// (terminated by the broker), and whether every request must be for that name; `refused`
/// gets the refusal that ended it, if one did (for its egress event).
#[derive(Debug, Clone, Default)]
pub(super) struct Conn {
    pub name: String,
    pub tls: bool,
    pub pinned: bool,
    pub refused: Arc<std::sync::OnceLock<String>>,
}

/// Why a relayed connection stopped early.
#[derive(Debug, thiserror::Error)]
pub(super) enum HttpError {
    #[error("HTTP to {name}: {source}")]
    Upstream { name: String, source: hyper::Error },
    #[error("HTTP from the guest: {0}")]
    Guest(hyper::Error),
}

/// Why a request is answered by the proxy instead of going upstream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refusal {
    #[error("{0} is not relayed")]
    Method(Method),
    #[error("a request needs exactly one Host header; this one has {0}")]
    HostCount(usize),
    #[error("the Host header is not a host name")]
    BadHost,
    #[error("the URI names {uri}, the Host header {host}")]
    Authority { uri: String, host: String },
    #[error("this connection was allowed for {name}, not {host}")]
    OtherHost { name: String, host: String },
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Self::Method(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::OtherHost { .. } => StatusCode::FORBIDDEN,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// HTTP/1.1 from the guest to the upstream, one request at a time, each checked and (for a
/// brokered name) given its headers.
pub(super) async fn relay<G, U>(
    state: Arc<NetState>,
    guest: G,
    upstream: U,
    conn: Conn,
) -> Result<(), HttpError>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, upstream_conn) =
        hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(upstream))
            .await
            .map_err(|source| HttpError::Upstream {
                name: conn.name.clone(),
                source,
            })?;
    let upstream_conn = tokio::spawn(upstream_conn.with_upgrades());
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let conn = Arc::new(conn);
    let svc = hyper::service::service_fn(move |req| {
        let (state, sender, conn) = (state.clone(), sender.clone(), conn.clone());
        async move { Ok::<_, Infallible>(answer(&state, &sender, req, &conn).await) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .max_buf_size(64 << 10)
        .serve_connection(TokioIo::new(guest), svc)
        .with_upgrades()
        .await;
    upstream_conn.abort();
    served.map_err(HttpError::Guest)
}

/// One request: refused, or forwarded (with the brokered headers) and its answer returned.
async fn answer(
    state: &NetState,
    sender: &Sender,
    mut req: Request<Incoming>,
    conn: &Conn,
) -> Response<Body> {
    let host = match normalise(&mut req, &conn.name, conn.pinned) {
        Ok(h) => h,
        Err(refusal) => {
            let _ = conn.refused.set(refusal.to_string());
            return refused(&refusal);
        }
    };
    let used = super::inject::add_headers(state, &mut req, &host, &conn.name, conn.tls);
    let guest_upgrade = hyper::upgrade::on(&mut req);
    let mut resp = match send(sender, req).await {
        Ok(resp) => resp,
        Err(e) => {
            return text(
                StatusCode::BAD_GATEWAY,
                &format!("the upstream {}: {e}", conn.name),
            );
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        join_upgrades(guest_upgrade, hyper::upgrade::on(&mut resp));
    }
    match used {
        Some(patterns) => super::inject::strip_echoes(resp, patterns),
        None => resp.map(BodyExt::boxed),
    }
}

async fn send(sender: &Sender, req: Request<Incoming>) -> Result<Response<Incoming>, hyper::Error> {
    let mut sender = sender.lock().await;
    sender.ready().await?;
    sender.send_request(req).await
}

/// Once both sides have switched protocols, their bytes are copied as they come.
fn join_upgrades(guest: hyper::upgrade::OnUpgrade, upstream: hyper::upgrade::OnUpgrade) {
    tokio::spawn(async move {
        if let (Ok(g), Ok(u)) = tokio::join!(guest, upstream) {
            let (mut g, mut u) = (TokioIo::new(g), TokioIo::new(u));
            let _ = tokio::io::copy_bidirectional(&mut g, &mut u).await;
        }
    });
}

/// Checks `req` and puts it in the form it goes upstream in (origin-form URI, its one `Host`);
/// its host name (lowercase, without a port).
pub(super) fn normalise<B>(
    req: &mut Request<B>,
    name: &str,
    pinned: bool,
) -> Result<String, Refusal> {
    if matches!(*req.method(), Method::TRACE | Method::CONNECT) {
        return Err(Refusal::Method(req.method().clone()));
    }
    let uri_host = match req.uri().authority() {
        Some(a) => Some(host_name(a.as_str()).ok_or(Refusal::BadHost)?),
        None => None,
    };
    let count = req.headers().get_all(HOST).iter().count();
    let host = match (count, &uri_host) {
        (1, _) => req
            .headers()
            .get(HOST)
            .and_then(|v| v.to_str().ok())
            .and_then(host_name)
            .ok_or(Refusal::BadHost)?,
        // An HTTP/1.0 request may name its host in its URI alone.
        (0, Some(h)) => {
            let value = req.uri().authority().map(|a| a.as_str().to_owned());
            let value = value.and_then(|v| HeaderValue::from_str(&v).ok());
            req.headers_mut()
                .insert(HOST, value.ok_or(Refusal::BadHost)?);
            h.clone()
        }
        (n, _) => return Err(Refusal::HostCount(n)),
    };
    if let Some(uri) = uri_host {
        if uri != host {
            return Err(Refusal::Authority { uri, host });
        }
        *req.uri_mut() = origin_form(req.uri());
    }
    if pinned && host != name {
        return Err(Refusal::OtherHost {
            name: name.to_owned(),
            host,
        });
    }
    Ok(host)
}

/// `uri`'s path and query alone (`/` without a path).
fn origin_form(uri: &Uri) -> Uri {
    let pq = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let pq = if pq.starts_with('/') { pq } else { "/" };
    pq.parse().unwrap_or_else(|_| Uri::from_static("/"))
}

/// The host name of a `Host` value or a URI's authority (`name`, `name:port`, no user
/// info), lowercase, without its port; `None` for anything else.
pub(super) fn host_name(value: &str) -> Option<String> {
    if value.contains('@') {
        return None;
    }
    let host = match value.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        Some(_) => return None,
        None => value,
    };
    airlock_egress::policy::normalise_name(host)
}

/// The proxy's own answer to a refused request; the connection closes after it.
fn refused(refusal: &Refusal) -> Response<Body> {
    let mut r = text(refusal.status(), &refusal.to_string());
    r.headers_mut()
        .insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A short text answer from the proxy.
pub(super) fn text(status: StatusCode, msg: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("airlock: {msg}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

#[cfg(test)]
mod tests;
