//! System test of what `airlockd` exposes on the network, through real clients: its TCP
//! listener speaks only TLS (a client certificate required when `client_ca` is set), reflection
//! answers only authenticated callers, and the metrics need their token. No VM is started.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::Path;

use airlock_api::v1::ListTemplatesRequest;
use airlock_system_tests::harness::{self, http_get, remove_parent_cgroups, tail};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

const TOKEN: &str = "token-of-acme";
const METRICS_TOKEN: &str = "token-of-prometheus";

/// A CA, a server certificate for localhost and 127.0.0.1, and a client certificate, as PEM
/// files in `dir`.
fn certificates(dir: &Path) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    for (name, sans) in [
        (
            "server",
            vec!["localhost".to_owned(), "127.0.0.1".to_owned()],
        ),
        ("client", vec!["client".to_owned()]),
    ] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(sans)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

/// Two distinct free ports (both listeners held until both are known: a port released and
/// asked for again can come back).
fn free_ports() -> (u16, u16) {
    let bind = || std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (a, b) = (bind(), bind());
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

async fn list(address: &str, token: Option<&str>) -> Result<usize, String> {
    let mut c = airlock_api::client(Some(address), token)
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    c.list_templates(ListTemplatesRequest {})
        .await
        .map(|r| r.into_inner().templates.len())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

/// Sets the client's TLS environment (this test's process only).
fn tls_env(dir: &Path, with_client_cert: bool) {
    let set = |k: &str, v: Option<std::path::PathBuf>| match v {
        // SAFETY: the test sets these before it makes any client, on its only thread that
        // reads them.
        Some(p) => unsafe { std::env::set_var(k, p) },
        // SAFETY: as above.
        None => unsafe { std::env::remove_var(k) },
    };
    set(airlock_api::CA_CERT_ENV, Some(dir.join("ca.pem")));
    set(
        airlock_api::CLIENT_CERT_ENV,
        with_client_cert.then(|| dir.join("client.pem")),
    );
    set(
        airlock_api::CLIENT_KEY_ENV,
        with_client_cert.then(|| dir.join("client.key")),
    );
}

#[tokio::test(flavor = "current_thread")]
async fn the_tcp_listener_speaks_only_mutual_tls_and_metrics_need_their_token() {
    let dir = std::env::temp_dir().join(format!("airlock-exposure-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let (port, metrics_port) = free_ports();
    let cgroup_parent = format!("airlock-exposure-{}", std::process::id());
    let extra = format!(
        "metrics_listen = \"127.0.0.1:{metrics_port}\"\nmetrics_token = \"{METRICS_TOKEN}\"\n\
         [tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\
         [tenants.acme]\ntokens = [\"{TOKEN}\"]\n",
        dir.join("server.pem").display(),
        dir.join("server.key").display(),
        dir.join("ca.pem").display(),
    );
    let mut setup = harness::daemon_setup(&dir, &cgroup_parent, &extra);
    setup
        .command
        .arg("--listen")
        .arg(format!("tcp://127.0.0.1:{port}"));
    let daemon = airlock_system_tests::ChildGuard::spawn(&mut setup.command);
    harness::wait_listening(&setup.socket, &setup.log);
    harness::wait_tcp_listening(port, &setup.log);
    harness::wait_tcp_listening(metrics_port, &setup.log);
    let tcp = format!("https://localhost:{port}");

    tls_env(&dir, true);
    assert_eq!(list(&tcp, Some(TOKEN)).await, Ok(0), "{}", tail(&setup.log));
    let no_token = list(&tcp, None).await.unwrap_err();
    assert!(no_token.starts_with("Unauthenticated"), "{no_token}");
    // Reflection is behind the same authentication.
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            airlock_api::connect(&tcp).await.unwrap(),
        );
    let ask = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let refused = match reflection
        .server_reflection_info(tokio_stream::iter(vec![ask]))
        .await
    {
        Err(s) => s,
        Ok(r) => r.into_inner().message().await.unwrap_err(),
    };
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    // Without a client certificate, or without TLS, nothing gets through.
    tls_env(&dir, false);
    let no_cert = list(&tcp, Some(TOKEN)).await;
    assert!(no_cert.is_err(), "a client without a certificate got in");
    let plain = list(&format!("http://127.0.0.1:{port}"), Some(TOKEN)).await;
    assert!(plain.is_err(), "a plaintext client got in");
    // The metrics need their token.
    let denied = http_get(metrics_port, "/metrics").await;
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    let allowed = metrics_with_token(metrics_port).await;
    assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
    drop(daemon);
    remove_parent_cgroups(&cgroup_parent);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn metrics_with_token(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let req = format!(
        "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {METRICS_TOKEN}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}
