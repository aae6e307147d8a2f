//! `GET /metrics`: a minimal HTTP/1.1 responder for scrapers on the host, with an optional
//! bearer token (compared by digest, in constant time).

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::auth::{TokenDigest, digest, same};

/// Serves `GET /metrics` on `listener`; `render` makes the body.
pub async fn serve(
    listener: tokio::net::TcpListener,
    token: Option<TokenDigest>,
    render: impl Fn() -> String + Send + Sync + 'static,
) {
    let render = std::sync::Arc::new(render);
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut n = 0;
            // Read the request head (bounded), then answer.
            while n < buf.len() {
                match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf[n..]),
                )
                .await
                {
                    Ok(Ok(0)) | Err(_) | Ok(Err(_)) => return,
                    Ok(Ok(k)) => n += k,
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
        });
    }
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
}
