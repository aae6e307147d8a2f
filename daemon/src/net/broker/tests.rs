#![allow(clippy::unwrap_used)]

use super::*;
use crate::net::tests::loopback::{Upstream, exchange, pair};
use crate::net::tests::{brokered, state};

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
            tls: false,
            pinned: false,
        },
        counts,
    ));
    (guest, upstream)
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
