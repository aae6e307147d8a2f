//! `GET /metrics`: a minimal HTTP/1.1 responder for scrapers on the host, with an optional
//! bearer token (compared by digest, in constant time), each request under one deadline.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::auth::{TokenDigest, digest, same};

/// Scrapes served at once; more connections are closed at once.
const MAX_SCRAPES: usize = 16;

/// Serves `GET /metrics` on `listener`; `render` makes the body. A request must arrive and be
/// answered within `deadline` as a whole (a client trickling its head byte by byte is cut
/// there), and at most [`MAX_SCRAPES`] are served at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    token: Option<TokenDigest>,
    deadline: std::time::Duration,
    render: impl Fn() -> String + Send + Sync + 'static,
) {
    let render = std::sync::Arc::new(render);
    let places = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        let Ok(place) = places.clone().try_acquire_owned() else {
            continue; // over the limit: closed at once
        };
        let render = render.clone();
        tokio::spawn(async move {
            let _place = place;
            let _ = tokio::time::timeout(deadline, answer(sock, token, &*render)).await;
        });
    }
}

/// Reads one request head (at most 4 KiB) from `sock` and answers it.
async fn answer(
    mut sock: tokio::net::TcpStream,
    token: Option<TokenDigest>,
    render: &(dyn Fn() -> String + Send + Sync),
) {
    let mut buf = vec![0u8; 4096];
    let mut n = 0;
    while n < buf.len() {
        match sock.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => return,
            Ok(k) => n += k,
        }
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let (status, body) = if !authorized(&head, token.as_ref()) {
        (
            "401 Unauthorized",
            "send Authorization: Bearer METRICS_TOKEN\n".to_owned(),
        )
    } else if head.starts_with("GET /metrics") {
        ("200 OK", render())
    } else {
        ("404 Not Found", "not found: GET /metrics\n".to_owned())
    };
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = sock.write_all(resp.as_bytes()).await;
}

/// Whether a request head carries `Authorization: Bearer T` with `T`'s digest `token` (any
/// request is authorized when there is no token).
fn authorized(head: &str, token: Option<&TokenDigest>) -> bool {
    let Some(want) = token else {
        return true;
    };
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .filter_map(|(_, v)| v.trim().strip_prefix("Bearer "))
        .any(|t| same(&digest(t.trim()), want))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn metrics_with_a_token_need_it() {
        let want = digest("m");
        let ask = |auth: &str| format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n");
        assert!(authorized(&ask(""), None));
        assert!(!authorized(&ask(""), Some(&want)));
        assert!(!authorized(&ask("Authorization: Bearer n"), Some(&want)));
        assert!(authorized(&ask("authorization: Bearer m"), Some(&want)));
    }

    #[tokio::test]
    async fn a_request_trickled_byte_by_byte_is_cut_at_the_deadline() {
        use std::time::{Duration, Instant};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Duration::from_millis(500);
        tokio::spawn(serve(listener, None, deadline, || "x 1\n".to_owned()));
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        let start = Instant::now();
        // One byte every 100 ms (each read well within a per-read timeout), never a full head.
        let closed = loop {
            if sock.write_all(b"G").await.is_err() {
                break true;
            }
            let mut b = [0u8; 64];
            match tokio::time::timeout(Duration::from_millis(100), sock.read(&mut b)).await {
                Ok(Ok(_) | Err(_)) => break true,
                Err(_) if start.elapsed() > Duration::from_secs(4) => break false,
                Err(_) => {}
            }
        };
        assert!(closed, "still open after {:?}", start.elapsed());
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        // A prompt request is answered.
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        sock.read_to_string(&mut out).await.unwrap();
        assert!(
            out.starts_with("HTTP/1.1 200") && out.ends_with("x 1\n"),
            "{out}"
        );
    }
}
