//! One HTTP/1.1 exchange with the guest's code interpreter: a new connection through the VMM's
//! hybrid-vsock socket (`CONNECT <port>\n`, `OK <host port>\n`), then hyper's client on it.
//! Each request has its own connection, so dropping an [`Answer`] closes it (the guest server
//! interrupts a cell whose client went away). Everything read is bounded.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Longest reply line of the `CONNECT` handshake.
const MAX_HANDSHAKE_LINE: usize = 64;

/// Bound on the answer's status line and headers (hyper's read buffer).
const MAX_HEADER_BYTES: usize = 64 << 10;

/// Why an exchange failed.
#[derive(Debug, PartialEq, Eq)]
pub enum GuestError {
    /// Nothing answered, or the answer broke off or was no HTTP.
    Unavailable(String),
    /// The answer is over its cap.
    TooLarge(String),
}

impl std::fmt::Display for GuestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unavailable(m) | Self::TooLarge(m) => f.write_str(m),
        }
    }
}

/// Aborts a task when dropped (the connection's driver goes with its answer).
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An answer being read; dropping it closes the connection.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    body: Incoming,
    _driver: AbortOnDrop,
}

impl Answer {
    /// The body's next piece of data (`None` at its end).
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, GuestError> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(GuestError::Unavailable(format!(
                        "the interpreter's answer broke off: {e}"
                    )));
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole body, at most `max` bytes.
    pub async fn read_all(mut self, max: usize) -> Result<Vec<u8>, GuestError> {
        let mut out = Vec::new();
        while let Some(data) = self.chunk().await? {
            if out.len() + data.len() > max {
                return Err(GuestError::TooLarge(format!(
                    "the interpreter's answer is over {max} bytes"
                )));
            }
            out.extend_from_slice(&data);
        }
        Ok(out)
    }
}

/// A connection to guest vsock `port` through the hybrid-vsock socket `vsock`.
pub async fn connect(vsock: &Path, port: u32) -> Result<UnixStream, GuestError> {
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        GuestError::Unavailable(format!("{what} (vsock port {port}): {e}"))
    };
    let mut s = UnixStream::connect(vsock)
        .await
        .map_err(|e| unavailable("the sandbox's vsock socket does not answer", &e))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(|e| unavailable("sending CONNECT", &e))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        let n = s
            .read(&mut byte)
            .await
            .map_err(|e| unavailable("CONNECT", &e))?;
        if n == 0 {
            return Err(unavailable(
                "nothing listens in the guest",
                &"the connection was closed",
            ));
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() > MAX_HANDSHAKE_LINE {
            return Err(unavailable("CONNECT", &"the reply line is too long"));
        }
    }
    if !line.starts_with(b"OK ") {
        let got = String::from_utf8_lossy(&line).into_owned();
        return Err(unavailable(
            "CONNECT",
            &format!("expected `OK <port>`, got {got:?}"),
        ));
    }
    Ok(s)
}

/// Sends `method path` with `body` (JSON) on a new connection made within `connect_within`;
/// the answer's head is awaited without a limit of its own (callers bound the whole call).
pub async fn request(
    vsock: &Path,
    port: u32,
    connect_within: Duration,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<Answer, GuestError> {
    let stream = tokio::time::timeout(connect_within, connect(vsock, port))
        .await
        .map_err(|_| {
            GuestError::Unavailable(format!(
                "no connection to the interpreter (vsock port {port}) within {connect_within:?}"
            ))
        })??;
    let broken = |e: hyper::Error| {
        GuestError::Unavailable(format!("the interpreter did not answer in HTTP: {e}"))
    };
    let (mut send, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_HEADER_BYTES)
        .handshake::<_, Full<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(broken)?;
    let driver = AbortOnDrop(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let with_body = body.is_some();
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "localhost");
    if with_body {
        req = req.header(hyper::header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| GuestError::Unavailable(format!("request: {e}")))?;
    let answer = send.send_request(req).await.map_err(broken)?;
    let status = answer.status();
    Ok(Answer {
        status,
        body: answer.into_body(),
        _driver: driver,
    })
}
