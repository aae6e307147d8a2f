//! Brokered secrets: a guest connection to a host that one of its sandbox's brokered secrets
//! names is not spliced through but served as HTTP/1.1 by the proxy (hyper on both sides),
//! which adds the secret's header to each request for that host on its way out. The value
//! never enters the guest.
//!
//! Plain HTTP is brokered for every brokered secret. HTTPS only for secrets that opt in: the
//! proxy then terminates the guest's TLS with a certificate for the name from the sandbox's
//! own CA ([`crate::secrets::ca`]; the guest trusts it, its key stays here) and speaks TLS to
//! the host itself, verifying it against the public roots and the operator's
//! `[network] broker_upstream_ca`. Requests are checked and normalised by the relay
//! ([`super::http`]: one `Host`, no absolute-form URI for another host, no `TRACE`); one whose
//! `Host` is not the name the connection was decided on gets no header, and on a connection
//! allowed by that name it is refused. The answer to a request that got a header is stripped
//! of every form of the sandbox's secret values ([`strip_echoes`]).

use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response};
use rustls::pki_types::ServerName;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::NetState;
use super::http::{Body, Conn, HttpError};
use crate::secrets::redact::{Patterns, StreamRedactor};

/// Why a brokered connection stopped early (the proxy's event shows it).
#[derive(Debug, thiserror::Error)]
pub(super) enum BrokerError {
    #[error("the sandbox has no CA for brokering HTTPS")]
    NoCa,
    /// The sandbox's CA could not make a certificate for the name.
    #[error(transparent)]
    Leaf(#[from] crate::secrets::ca::LeafError),
    #[error(transparent)]
    Tls(#[from] rustls::Error),
    #[error("the guest's TLS: {0}")]
    GuestTls(io::Error),
    #[error("name {name:?}: {source}")]
    Name {
        name: String,
        source: rustls::pki_types::InvalidDnsNameError,
    },
    #[error("TLS to {name}: {source}")]
    UpstreamTls { name: String, source: io::Error },
    #[error(transparent)]
    Http(#[from] HttpError),
}

/// Why the broker's TLS client could not be made.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamTlsError {
    /// The operator's extra CA file could not be read as PEM.
    #[error("{}: {source}", .path.display())]
    Pem {
        path: std::path::PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    /// A certificate in it was refused.
    #[error("{}: {source}", .path.display())]
    Certificate {
        path: std::path::PathBuf,
        source: rustls::Error,
    },
    #[error(transparent)]
    Tls(#[from] rustls::Error),
}

/// Bytes moved on a brokered connection: from the guest, to the guest.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub from_guest: AtomicU64,
    pub to_guest: AtomicU64,
}

/// Serves the guest's connection `guest` (whose first bytes, `head`, were read to learn its
/// name) to `upstream` through the HTTP relay, which adds the brokered headers for
/// `conn.name`; `conn.tls`: the guest speaks TLS, terminated here. Also serves the plain-HTTP
/// connections that are relayed request by request without a secret (`conn.pinned`).
/// Returns why it stopped early.
pub(super) async fn serve(
    state: Arc<NetState>,
    guest: TcpStream,
    head: Vec<u8>,
    upstream: TcpStream,
    mut conn: Conn,
    counts: Arc<Counts>,
) -> Result<(), BrokerError> {
    if let Some(n) = airlock_egress::policy::normalise_name(&conn.name) {
        conn.name = n;
    }
    let guest = Prefixed {
        head,
        pos: 0,
        inner: guest,
        counts: counts.clone(),
    };
    if !conn.tls {
        return Ok(super::http::relay(state, guest, upstream, conn).await?);
    }
    let name = conn.name.clone();
    let ca = state.secrets.ca().cloned().ok_or(BrokerError::NoCa)?;
    let leaf = ca.leaf(&name).map_err(BrokerError::Leaf)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(OneCert(leaf)));
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    let guest = tokio_rustls::TlsAcceptor::from(Arc::new(server))
        .accept(guest)
        .await
        .map_err(BrokerError::GuestTls)?;
    let server_name = ServerName::try_from(name.clone()).map_err(|source| BrokerError::Name {
        name: name.clone(),
        source,
    })?;
    let upstream = tokio_rustls::TlsConnector::from(state.egress.broker_tls.clone())
        .connect(server_name, upstream)
        .await
        .map_err(|source| BrokerError::UpstreamTls {
            name: name.clone(),
            source,
        })?;
    Ok(super::http::relay(state, guest, upstream, conn).await?)
}

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
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        let out = redactor.push(&data);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                    // Trailers end the body: what is held back goes before them (dropped).
                    Err(_) => {}
                },
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

/// The one certificate of a brokered connection (its name's, from the sandbox's CA).
#[derive(Debug)]
struct OneCert(Arc<CertifiedKey>);

impl ResolvesServerCert for OneCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The guest's connection with the bytes already read from it in front, counted.
struct Prefixed {
    head: Vec<u8>,
    pos: usize,
    inner: TcpStream,
    counts: Arc<Counts>,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos < this.head.len() {
            let n = (this.head.len() - this.pos).min(buf.remaining());
            buf.put_slice(&this.head[this.pos..this.pos + n]);
            this.pos += n;
            this.counts
                .from_guest
                .fetch_add(n as u64, Ordering::Relaxed);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        this.counts
            .from_guest
            .fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.counts.to_guest.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The TLS client the broker speaks to upstreams with: the public roots, and the operator's
/// extra CAs (`[network] broker_upstream_ca`, PEM).
pub fn upstream_tls(
    extra_ca: Option<&std::path::Path>,
) -> Result<rustls::ClientConfig, UpstreamTlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        use rustls::pki_types::pem::PemObject as _;
        let pem = |source| UpstreamTlsError::Pem {
            path: path.to_owned(),
            source,
        };
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(path).map_err(pem)?;
        for c in certs {
            let c = c.map_err(pem)?;
            roots
                .add(c)
                .map_err(|source| UpstreamTlsError::Certificate {
                    path: path.to_owned(),
                    source,
                })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

#[cfg(test)]
mod tests;
