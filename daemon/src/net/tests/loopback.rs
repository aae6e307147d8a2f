//! Connections on loopback for the proxy's and the broker's tests: a guest's end and the
//! proxy's end of one connection, and an upstream that records every request head it gets and
//! answers each with an echo of its `Authorization` (as a header and in the body), as some
//! public test services do.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Both ends of one loopback connection: (the guest's, the proxy's).
pub async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (server, _) = l.accept().await.unwrap();
    (client, server)
}

/// An echoing upstream on loopback; `heads` holds every request head it read, in order.
pub struct Upstream {
    pub addr: std::net::SocketAddr,
    pub heads: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// One that speaks TLS with `tls`'s certificate.
    pub async fn start_tls(tls: rustls::ServerConfig) -> Self {
        Self::start_with(Some(tokio_rustls::TlsAcceptor::from(Arc::new(tls)))).await
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let h = heads.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (h, tls) = (h.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        Some(t) => {
                            if let Ok(s) = t.accept(s).await {
                                echo(s, h).await;
                            }
                        }
                        None => echo(s, h).await,
                    }
                });
            }
        });
        Self { addr, heads }
    }

    pub async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.unwrap()
    }

    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }
}

/// Answers each request (bodies are not expected) with its `Authorization` echoed.
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, heads: Arc<Mutex<Vec<String>>>) {
    let mut buf = Vec::new();
    loop {
        let Some(end) = find(&buf, b"\r\n\r\n") else {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
        buf.drain(..end + 4);
        let auth = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("authorization")
                    .then(|| v.trim().to_owned())
            })
            .unwrap_or_default();
        heads.lock().unwrap().push(head);
        let body = format!("you sent: {auth}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Echo: {auth}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Sends `request` on `guest` and reads one whole response (by its `Content-Length`, or
/// chunked to its last chunk, or to the connection's end); "" if none came in 5 s.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(guest: &mut S, request: &str) -> String {
    guest.write_all(request.as_bytes()).await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(5), response(guest));
    read.await.unwrap_or_default()
}

async fn response<S: AsyncRead + Unpin>(guest: &mut S) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length = head.lines().find_map(|l| {
                l.strip_prefix("content-length:")
                    .and_then(|v| v.trim().parse::<usize>().ok())
            });
            let done = match length {
                // Switching protocols: what follows is not this response's.
                _ if head.starts_with("http/1.1 101") => true,
                Some(n) => buf.len() >= end + 4 + n,
                None if head.contains("transfer-encoding: chunked") => {
                    buf.ends_with(b"\r\n0\r\n\r\n") || buf.ends_with(b"\r\n\r\n0\r\n\r\n")
                }
                None => false,
            };
            if done {
                return String::from_utf8_lossy(&buf).into_owned();
            }
        }
        match guest.read(&mut chunk).await {
            Ok(0) | Err(_) => return String::from_utf8_lossy(&buf).into_owned(),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}
