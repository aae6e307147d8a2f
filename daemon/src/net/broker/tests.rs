#![allow(clippy::unwrap_used)]

use super::*;
use crate::net::tests::loopback::{Upstream, exchange, pair};
use crate::net::tests::{brokered, state, state_with};

const SECRET: &str = "s3cr3t-token-4711";

/// A brokered plain-HTTP connection for `api.test` (the secret's host) through the broker, to
/// an echoing upstream on loopback: the guest's end, and the upstream.
async fn brokered_connection() -> (TcpStream, Upstream) {
    let st = state(
        airlock_egress::Policy::AllowInternet,
        vec![brokered("API_KEY", SECRET, "api.test")],
    );
    let upstream = Upstream::start().await;
    let (guest, ours) = pair().await;
    let up = upstream.connect().await;
    let counts = Arc::new(Counts::default());
    tokio::spawn(serve(
        st,
        ours,
        Vec::new(),
        up,
        crate::net::http::Conn {
            name: "api.test".into(),
            ..Default::default()
        },
        counts,
    ));
    (guest, upstream)
}

/// A brokered HTTPS connection for `api.test`, allowed by that name (`pinned`), through the
/// broker (the guest trusting the sandbox's CA) to an echoing TLS upstream on loopback whose
/// certificate the broker trusts through `broker_upstream_ca`: the guest's TLS session, and
/// the upstream.
async fn brokered_https_connection() -> (tokio_rustls::client::TlsStream<TcpStream>, Upstream) {
    let dir = std::env::temp_dir().join(format!("airlock-broker-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let upstream_ca = crate::secrets::ca::SandboxCa::new("upstream").unwrap();
    let ca_file = dir.join(format!("upstream-{}.pem", crate::net::now_ms()));
    std::fs::write(&ca_file, upstream_ca.pem()).unwrap();
    let cfg = crate::net::NetworkConfig {
        broker_upstream_ca: Some(ca_file),
        ..Default::default()
    };
    let mut secret = brokered("API_KEY", SECRET, "api.test");
    if let crate::secrets::Delivery::Broker(b) = &mut secret.delivery {
        b.https = true;
    }
    let st = state_with(cfg, airlock_egress::Policy::AllowInternet, vec![secret]);
    let sandbox_ca = Arc::new(crate::secrets::ca::SandboxCa::new("sb").unwrap());
    st.secrets.set_ca(sandbox_ca.clone());
    let upstream = Upstream::start_tls(tls_server(&upstream_ca)).await;
    let (guest, ours) = pair().await;
    let up = upstream.connect().await;
    let conn = crate::net::http::Conn {
        name: "api.test".into(),
        tls: true,
        pinned: true,
        ..Default::default()
    };
    tokio::spawn(serve(
        st,
        ours,
        Vec::new(),
        up,
        conn,
        Arc::new(Counts::default()),
    ));
    (tls_client(&sandbox_ca, guest).await, upstream)
}

fn tls_server(ca: &crate::secrets::ca::SandboxCa) -> rustls::ServerConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(OneCert(ca.leaf("api.test").unwrap())))
}

/// The guest's TLS session to `api.test`, trusting `ca` alone.
async fn tls_client(
    ca: &crate::secrets::ca::SandboxCa,
    s: TcpStream,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("api.test").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, s)
        .await
        .unwrap()
}

#[tokio::test]
async fn https_inside_a_terminated_connection_is_checked_per_request() {
    let (mut guest, upstream) = brokered_https_connection().await;
    let resp = exchange(&mut guest, "GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n").await;
    assert!(status(&resp).contains("200"), "{resp}");
    assert!(!resp.contains(SECRET), "{resp}");
    assert!(upstream.heads()[0].contains(&format!("Bearer {SECRET}")));
    // Domain fronting inside the terminated session: refused, nothing sent.
    let other = exchange(&mut guest, "GET /y HTTP/1.1\r\nHost: other.test\r\n\r\n").await;
    assert!(status(&other).contains("403"), "{other}");
    assert_eq!(upstream.heads().len(), 1, "{:?}", upstream.heads());
}

fn status(resp: &str) -> &str {
    resp.lines().next().unwrap_or_default()
}

#[tokio::test]
async fn a_request_for_its_host_gets_the_secret_header() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(&mut guest, "GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n").await;
    assert!(status(&resp).contains("200"), "{resp}");
    let heads = upstream.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert!(heads[0].contains(&format!("Bearer {SECRET}")), "{heads:?}");
}

#[tokio::test]
async fn an_absolute_form_uri_for_another_host_is_refused_without_the_secret() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(
        &mut guest,
        "GET http://other.test/x HTTP/1.1\r\nHost: api.test\r\n\r\n",
    )
    .await;
    assert!(status(&resp).contains("400"), "{resp}");
    assert!(upstream.heads().is_empty(), "{:?}", upstream.heads());
}

#[tokio::test]
async fn an_absolute_form_uri_for_its_host_goes_on_in_origin_form() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(
        &mut guest,
        "GET http://api.test/x?q=1 HTTP/1.1\r\nHost: api.test\r\n\r\n",
    )
    .await;
    assert!(status(&resp).contains("200"), "{resp}");
    let heads = upstream.heads();
    assert!(heads[0].starts_with("GET /x?q=1 HTTP/1.1\r\n"), "{heads:?}");
}

#[tokio::test]
async fn a_request_with_two_host_headers_is_refused_without_the_secret() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(
        &mut guest,
        "GET /x HTTP/1.1\r\nHost: api.test\r\nHost: other.test\r\n\r\n",
    )
    .await;
    assert!(status(&resp).contains("400"), "{resp}");
    assert!(upstream.heads().is_empty(), "{:?}", upstream.heads());
}

#[tokio::test]
async fn an_upstream_echo_of_the_secret_never_reaches_the_guest() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(&mut guest, "GET /x HTTP/1.1\r\nHost: api.test\r\n\r\n").await;
    assert!(status(&resp).contains("200"), "{resp}");
    assert!(upstream.heads()[0].contains(SECRET));
    assert!(!resp.contains(SECRET), "the echo reached the guest: {resp}");
    assert!(resp.contains("[REDACTED:API_KEY]"), "{resp}");
}

#[tokio::test]
async fn trace_is_refused() {
    let (mut guest, upstream) = brokered_connection().await;
    let resp = exchange(&mut guest, "TRACE /x HTTP/1.1\r\nHost: api.test\r\n\r\n").await;
    assert!(status(&resp).contains("405"), "{resp}");
    assert!(upstream.heads().is_empty(), "{:?}", upstream.heads());
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
