//! The TLS of the TCP listeners (gRPC and the E2B gateway), done by the daemon itself so that
//! its handshakes run under [`super::limit`]'s timeout: the daemon's certificate and key from
//! `[tls]`, and for gRPC the client CA of mutual TLS.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::TlsSettings;
use crate::error::StartError;

/// An acceptor of `[tls]`'s certificate offering `alpn`; with `client_ca` (gRPC's mutual
/// TLS) a client must present a certificate it signed.
pub fn acceptor(
    t: &TlsSettings,
    alpn: &[&[u8]],
    client_ca: bool,
) -> Result<TlsAcceptor, StartError> {
    let certs = CertificateDer::pem_file_iter(&t.cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| StartError::Setting(format!("{}: {e}", t.cert.display())))?;
    let key = PrivateKeyDer::from_pem_file(&t.key)
        .map_err(|e| StartError::Setting(format!("{}: {e}", t.key.display())))?;
    let ca = match (&t.client_ca, client_ca) {
        (Some(p), true) => Some(
            CertificateDer::pem_file_iter(p)
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|e| StartError::Setting(format!("{}: {e}", p.display())))?,
        ),
        _ => None,
    };
    acceptor_of(certs, key, ca, alpn)
}

/// An acceptor of `certs` and `key` (and `client_ca`'s clients only), offering `alpn`.
pub fn acceptor_of(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_ca: Option<Vec<CertificateDer<'static>>>,
    alpn: &[&[u8]],
) -> Result<TlsAcceptor, StartError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| StartError::Tls(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in ca {
                roots
                    .add(c)
                    .map_err(|e| StartError::Tls(format!("client CA: {e}")))?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| StartError::Tls(format!("client CA: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut cfg = builder
        .with_single_cert(certs, key)
        .map_err(|e| StartError::Tls(e.to_string()))?;
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(TlsAcceptor::from(Arc::new(cfg)))
}
