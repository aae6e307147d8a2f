//! Checks of a running daemon's listener limits from outside, for hostile-tenant scenarios:
//! what a socket that never speaks and a huge declared body get from the E2B gateway (issue
//! 37, item 6c). Plain blocking sockets on loopback; no TLS client is needed: a socket that
//! never starts its handshake is what the check sends.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// How long the server took to close `sock` (EOF or a reset), or `None` if it still held it
/// after `within`.
pub fn closed_after(sock: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut b = [0u8; 4096];
    loop {
        let left = within.checked_sub(start.elapsed())?;
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .ok()?;
        match sock.read(&mut b) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                if start.elapsed() >= within {
                    return None;
                }
            }
            Err(_) => return Some(start.elapsed()),
        }
    }
}

/// The gateway at `addr` closes a socket that sends nothing within `within` (with `[tls]`:
/// the daemon's `tls_handshake_timeout_ms`; without: its `idle_timeout_ms`, so give the
/// scenario's daemon short ones), and answers a POST declaring a 1 GiB body with 413 and a
/// closed connection after sending it 64 KiB, without waiting for the rest. Only the second
/// needs a gateway without TLS (`tls = false`); with TLS it is skipped.
pub fn gateway_closes_idle_and_refuses_huge_bodies(
    addr: SocketAddr,
    tls: bool,
    within: Duration,
) -> Result<(), String> {
    let mut idle = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    match closed_after(&mut idle, within) {
        Some(_) => {}
        None => return Err(format!("an idle socket was still open after {within:?}")),
    }
    if tls {
        return Ok(());
    }
    let mut sock = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let head = "POST /files?path=/tmp/huge HTTP/1.1\r\nHost: localhost\r\n\
                Content-Type: application/octet-stream\r\nContent-Length: 1073741824\r\n\r\n";
    sock.write_all(head.as_bytes())
        .map_err(|e| format!("sending the head: {e}"))?;
    // The server may refuse before this is all sent: a failed write is fine.
    let _ = sock.write_all(&vec![0u8; 64 << 10]);
    sock.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut out = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        match sock.read(&mut b) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&b[..n]),
            Err(e) if out.is_empty() => return Err(format!("no answer to a 1 GiB body: {e}")),
            Err(_) => break,
        }
        if start.elapsed() > Duration::from_secs(5) {
            return Err("the connection stayed open after the 413".into());
        }
    }
    let text = String::from_utf8_lossy(&out);
    if !text.starts_with("HTTP/1.1 413") {
        return Err(format!(
            "a 1 GiB body got: {}",
            text.lines().next().unwrap_or("")
        ));
    }
    Ok(())
}
