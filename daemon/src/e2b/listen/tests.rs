#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use axum::routing::post;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::tcp::limit::tests::{closed_within, test_tls};

const MAX: u64 = 4 << 20;

/// A gateway-like app on loopback: `POST /upload` streams its body and answers its length.
async fn gateway(
    tls: Option<TlsAcceptor>,
    header_ms: u64,
    idle_ms: u64,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let app = Router::new().route(
        "/upload",
        post(move |body: Body| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move {
                let mut n = 0usize;
                let mut s = body.into_data_stream();
                while let Some(c) = s.next().await {
                    match c {
                        Ok(c) => n += c.len(),
                        Err(_) => return (StatusCode::PAYLOAD_TOO_LARGE, "cut".to_owned()),
                    }
                }
                (StatusCode::OK, n.to_string())
            }
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = ConnLimits {
        max: 8,
        handshake: Duration::from_millis(300),
        idle: Duration::from_millis(idle_ms),
    };
    let header = Duration::from_millis(header_ms);
    tokio::spawn(serve_on(
        listener,
        limit_bodies(app, MAX),
        limits,
        tls,
        header,
    ));
    (addr, calls)
}

async fn response(sock: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), sock.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_declared_1_gib_body_is_refused_before_it_is_read_and_uploads_below_the_limit_stream() {
    let (addr, calls) = gateway(None, 5000, 5000).await;
    let mut sock = TcpStream::connect(addr).await.unwrap();
    let head = "POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n";
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(&[0u8; 64 << 10]).await.unwrap();
    let start = Instant::now();
    let out = response(&mut sock).await;
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "closed, not drained"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
    // A streamed (chunked) body within the limit goes through whole ...
    let chunked = |total: usize| async move {
        let mut sock = TcpStream::connect(addr).await.unwrap();
        let head = "POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
        sock.write_all(head.as_bytes()).await.unwrap();
        let chunk = vec![b'a'; 256 << 10];
        let mut sent = 0;
        while sent < total {
            let n = chunk.len().min(total - sent);
            let frame = format!("{n:x}\r\n");
            if sock.write_all(frame.as_bytes()).await.is_err()
                || sock.write_all(&chunk[..n]).await.is_err()
                || sock.write_all(b"\r\n").await.is_err()
            {
                break;
            }
            sent += n;
        }
        let _ = sock.write_all(b"0\r\n\r\n").await;
        response(&mut sock).await
    };
    let ok = chunked(3 << 20).await;
    assert!(
        ok.starts_with("HTTP/1.1 200") && ok.ends_with(&(3 << 20).to_string()),
        "{ok}"
    );
    // ... and one over it is cut where it passes the limit.
    let cut = chunked(6 << 20).await;
    assert!(cut.starts_with("HTTP/1.1 413"), "{cut}");
}

#[tokio::test]
async fn idle_sockets_stalled_handshakes_and_slow_heads_are_closed() {
    let (acceptor, client) = test_tls(&[b"h2", b"http/1.1"]);
    let (addr, _) = gateway(Some(acceptor), 300, 2000).await;
    // Sockets that never start a TLS handshake: closed at the handshake timeout.
    let mut idle = Vec::new();
    for _ in 0..6 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let start = Instant::now();
    for s in &mut idle {
        assert!(
            closed_within(s, Duration::from_secs(2)).await,
            "no handshake"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(2));
    // After a handshake: a request head that never ends is cut at the header timeout.
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = client.connect(name.clone(), tcp).await.unwrap();
    tls.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    assert!(
        closed_within(&mut tls, Duration::from_secs(3)).await,
        "slow head"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // And a connection that sends nothing after its handshake is closed too.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = client.connect(name, tcp).await.unwrap();
    assert!(
        closed_within(&mut tls, Duration::from_secs(3)).await,
        "idle after handshake"
    );
}
