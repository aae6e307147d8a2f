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
//! of every form of the sandbox's secret values ([`super::inject`]).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use rustls::pki_types::ServerName;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::NetState;
use super::http::{Conn, HttpError};

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
