//! Brokered secrets: a guest connection to a host that one of its sandbox's brokered secrets
//! names is not spliced through but served as HTTP/1.1 by the proxy (hyper on both sides),
//! which adds the secret's header to each request for that host on its way out. The value
//! never enters the guest.
//!
//! Plain HTTP is brokered for every brokered secret. HTTPS only for secrets that opt in: the
//! proxy then terminates the guest's TLS with a certificate for the name from the sandbox's
//! own CA ([`crate::secrets::ca`]; the guest trusts it, its key stays here) and speaks TLS to
//! the host itself, verifying it against the public roots and the operator's
//! `[network] broker_upstream_ca`. A request whose `Host` is not the name the connection was
//! decided on gets no header (it goes on as it came).

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::NetState;

type Body = BoxBody<Bytes, hyper::Error>;

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
    #[error("HTTP to {name}: {source}")]
    UpstreamHttp { name: String, source: hyper::Error },
    #[error("HTTP from the guest: {0}")]
    GuestHttp(hyper::Error),
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
/// name) to `upstream`, adding the brokered headers for `name`; `tls`: the guest speaks TLS.
/// Returns the secrets' names used, or why it stopped early.
pub(super) async fn serve(
    state: Arc<NetState>,
    guest: TcpStream,
    head: Vec<u8>,
    upstream: TcpStream,
    name: String,
    tls: bool,
    counts: Arc<Counts>,
) -> Result<(), BrokerError> {
    let name = airlock_egress::policy::normalise_name(&name).unwrap_or(name);
    let guest = Prefixed {
        head,
        pos: 0,
        inner: guest,
        counts: counts.clone(),
    };
    if !tls {
        return relay(state, guest, upstream, name, false).await;
    }
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
    relay(state, guest, upstream, name, true).await
}

/// HTTP/1.1 from the guest to the upstream, one request at a time, with the headers added.
async fn relay<G, U>(
    state: Arc<NetState>,
    guest: G,
    upstream: U,
    name: String,
    tls: bool,
) -> Result<(), BrokerError>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) =
        hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(upstream))
            .await
            .map_err(|source| BrokerError::UpstreamHttp {
                name: name.clone(),
                source,
            })?;
    let conn = tokio::spawn(conn);
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let name = Arc::new(name);
    let svc = hyper::service::service_fn(move |req| {
        let (state, sender, name) = (state.clone(), sender.clone(), name.clone());
        async move { Ok::<_, Infallible>(forward(&state, &sender, req, &name, tls).await) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .max_buf_size(64 << 10)
        .serve_connection(TokioIo::new(guest), svc)
        .await;
    conn.abort();
    served.map_err(BrokerError::GuestHttp)
}

/// The request's host name (its `Host` header, else its URI's), lowercase, without a port.
fn request_host<B>(req: &Request<B>) -> Option<String> {
    let raw = req
        .headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().host().map(str::to_owned))?;
    let host = match raw.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => raw.as_str(),
    };
    airlock_egress::policy::normalise_name(host)
}

/// Adds the brokered headers for `name` to `req` (if it is for `name`); the secrets' names.
fn add_headers<B>(state: &NetState, req: &mut Request<B>, name: &str, tls: bool) -> Vec<String> {
    let mut used = Vec::new();
    if request_host(req).as_deref() != Some(name) {
        return used;
    }
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
    used
}

async fn forward(
    state: &NetState,
    sender: &tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<Incoming>>,
    mut req: Request<Incoming>,
    name: &str,
    tls: bool,
) -> Response<Body> {
    let used = add_headers(state, &mut req, name, tls);
    if !used.is_empty() {
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
    }
    let mut sender = sender.lock().await;
    let sent = match sender.ready().await {
        Ok(()) => sender.send_request(req).await,
        Err(e) => Err(e),
    };
    match sent {
        Ok(resp) => resp.map(BodyExt::boxed),
        Err(e) => {
            let mut r = Response::new(
                Full::new(Bytes::from(format!("airlock: the upstream {name}: {e}\n")))
                    .map_err(|never| match never {})
                    .boxed(),
            );
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
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
mod tests {
    use super::*;

    fn req(host: &str) -> Request<()> {
        Request::builder()
            .uri("/x")
            .header(hyper::header::HOST, host)
            .body(())
            .unwrap()
    }

    #[test]
    fn the_host_is_lowercase_without_its_port() {
        assert_eq!(
            request_host(&req("API.Example.com:8080")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(
            request_host(&req("api.example.com")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(request_host(&req("")), None);
    }

    #[test]
    fn the_upstream_client_takes_the_public_roots_and_an_extra_ca() {
        assert!(upstream_tls(None).is_ok());
        let dir = std::env::temp_dir().join(format!("airlock-broker-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = crate::secrets::ca::SandboxCa::new("sb-x").unwrap();
        let pem = dir.join("ca.pem");
        std::fs::write(&pem, ca.pem()).unwrap();
        assert!(upstream_tls(Some(&pem)).is_ok());
        std::fs::write(&pem, "not a certificate").unwrap();
        // No PEM section at all: nothing added, nothing wrong.
        assert!(upstream_tls(Some(&pem)).is_ok());
        assert!(upstream_tls(Some(&dir.join("missing.pem"))).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
