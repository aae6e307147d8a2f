#![allow(clippy::unwrap_used)]

use std::time::Instant as StdInstant;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::StreamExt;

use super::*;

/// A self-signed certificate for `localhost`: the server's acceptor and a client that
/// trusts it.
pub fn test_tls(alpn: &[&[u8]]) -> (TlsAcceptor, tokio_rustls::TlsConnector) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let der = CertificateDer::from(ck.cert.der().to_vec());
    let key = PrivateKeyDer::from(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let acceptor = crate::tcp::tls::acceptor_of(vec![der.clone()], key, None, alpn).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (acceptor, tokio_rustls::TlsConnector::from(Arc::new(client)))
}

/// Whether the server closes `sock` (EOF or an error) within `within`.
pub async fn closed_within<S: AsyncRead + Unpin>(sock: &mut S, within: Duration) -> bool {
    let mut b = [0u8; 256];
    let start = StdInstant::now();
    loop {
        match tokio::time::timeout(within.saturating_sub(start.elapsed()), sock.read(&mut b)).await
        {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Serves `incoming` the way a server does: reads every connection until it fails or ends.
fn drain(mut incoming: ReceiverStream<std::io::Result<Conn>>) {
    tokio::spawn(async move {
        while let Some(Ok(mut c)) = incoming.next().await {
            tokio::spawn(async move {
                let mut b = [0u8; 256];
                while let Ok(n) = c.read(&mut b).await {
                    if n == 0 || c.write_all(&b[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
}

#[tokio::test]
async fn connections_over_the_limit_are_closed_and_places_come_back() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = ConnLimits {
        max: 1,
        handshake: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };
    let mut incoming = connections(listener, limits, None);
    let first = TcpStream::connect(addr).await.unwrap();
    let held = incoming.next().await.unwrap().unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    let next = tokio::time::timeout(Duration::from_millis(300), incoming.next());
    assert!(next.await.is_err(), "nothing is let in past the limit");
    assert!(closed_within(&mut second, Duration::from_secs(2)).await);
    drop((held, first));
    let _third = TcpStream::connect(addr).await.unwrap();
    let later = tokio::time::timeout(Duration::from_secs(2), incoming.next());
    assert!(later.await.unwrap().unwrap().is_ok(), "a place came back");
}

#[tokio::test]
async fn stalled_handshakes_and_idle_connections_are_closed_and_free_their_places() {
    let (acceptor, client) = test_tls(&[b"h2"]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = ConnLimits {
        max: 4,
        handshake: Duration::from_millis(300),
        idle: Duration::from_millis(600),
    };
    drain(connections(listener, limits, Some(acceptor)));
    // Every place taken by a socket that never starts its handshake.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut over = TcpStream::connect(addr).await.unwrap();
    assert!(
        closed_within(&mut over, Duration::from_secs(1)).await,
        "over the limit"
    );
    for s in &mut idle {
        assert!(
            closed_within(s, Duration::from_secs(2)).await,
            "a socket without a handshake is closed at the handshake timeout"
        );
    }
    // The places came back: a real client gets through, is served, then idles and is cut.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = client.connect(name, tcp).await.unwrap();
    tls.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    tls.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");
    let start = StdInstant::now();
    assert!(
        closed_within(&mut tls, Duration::from_secs(3)).await,
        "idle: closed"
    );
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
}
