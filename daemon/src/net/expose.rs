//! Exposed ports (ExposePort): a listener on the daemon's host address forwards connections
//! that present the exposure's token to one TCP port of the guest, until the TTL or the
//! sandbox ends. The daemon reaches the guest from inside the sandbox's namespace (a socket
//! made there, from the gateway address); nothing else in the namespace changes.

use std::io::{self, Read as _};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{EgressEvent, EgressKind};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::proxy::pump;
use super::{NetState, now_ms};

/// The header an HTTP caller presents the token in.
pub const TOKEN_HEADER: &str = "x-airlock-token";
/// The most read before the token must have been seen.
const MAX_PREAMBLE: usize = 16 << 10;
/// How long a caller has to present it.
const PREAMBLE_WAIT: Duration = Duration::from_secs(10);

/// A new token: 32 random bytes, hex.
pub fn new_token() -> io::Result<String> {
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Serves one exposure until `until`; its connections end with it (the `JoinSet` aborts them).
pub(super) async fn serve(
    state: Arc<NetState>,
    netns: Arc<OwnedFd>,
    listener: TcpListener,
    guest_port: u16,
    token: String,
    until: tokio::time::Instant,
) {
    let token = Arc::new(token);
    let mut conns = JoinSet::new();
    let deadline = tokio::time::sleep_until(until);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => return,
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if conns.len() >= state.cfg().max_connections {
                    continue; // dropped: closed
                }
                conns.spawn(handle(
                    state.clone(),
                    netns.clone(),
                    stream,
                    peer,
                    guest_port,
                    token.clone(),
                ));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// What the caller sent before the guest's bytes: the token it presented, and what to
/// forward (an HTTP head without the token's header; nothing of a raw preamble).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Preamble {
    pub token: Option<String>,
    pub forward: Vec<u8>,
}

/// Reads `buf` so far: `None` while more is needed.
pub(super) fn preamble(buf: &[u8]) -> Option<Preamble> {
    let looks_http = buf.first().is_some_and(u8::is_ascii_uppercase);
    if looks_http {
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = &buf[..end];
        let mut token = None;
        let mut forward = Vec::with_capacity(buf.len());
        for line in head.split_inclusive(|b| *b == b'\n') {
            let text = String::from_utf8_lossy(line);
            if let Some((name, value)) = text.split_once(':')
                && name.trim().eq_ignore_ascii_case(TOKEN_HEADER)
            {
                token = Some(value.trim().to_owned());
                continue;
            }
            forward.extend_from_slice(line);
        }
        forward.extend_from_slice(&buf[end..]);
        return Some(Preamble { token, forward });
    }
    let nl = buf.iter().position(|b| *b == b'\n')?;
    let line = String::from_utf8_lossy(&buf[..nl]);
    Some(Preamble {
        token: Some(line.trim_end_matches('\r').to_owned()),
        forward: buf[nl + 1..].to_vec(),
    })
}

/// Reads the connection's first bytes until they state the token (at most
/// [`PREAMBLE_WAIT`] and [`MAX_PREAMBLE`] bytes); the preamble, if they do.
async fn read_preamble(caller: &mut TcpStream) -> Option<Preamble> {
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + PREAMBLE_WAIT;
    loop {
        if let Some(p) = preamble(&buf) {
            return Some(p);
        }
        if buf.len() >= MAX_PREAMBLE {
            return None;
        }
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout_at(deadline, caller.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return None,
        }
    }
}

/// Connects to the guest's `guest_port` from inside the sandbox's network namespace `netns`
/// (5 s at most).
async fn connect_guest(netns: Arc<OwnedFd>, guest_port: u16) -> io::Result<TcpStream> {
    let guest = SocketAddr::new(IpAddr::V4(airlock_proto::GUEST_IPV4), guest_port);
    tokio::task::spawn_blocking(move || {
        airlock_netcfg::in_netns(netns.as_fd(), move || {
            std::net::TcpStream::connect_timeout(&guest, Duration::from_secs(5))
        })
    })
    .await
    .unwrap_or_else(|e| Err(io::Error::other(e)))
    .and_then(|s| {
        s.set_nonblocking(true)?;
        TcpStream::from_std(s)
    })
}

/// One caller of an exposed port: its token checked, then joined to the guest's port; the
/// connection is recorded as an event either way.
async fn handle(
    state: Arc<NetState>,
    netns: Arc<OwnedFd>,
    mut caller: TcpStream,
    peer: SocketAddr,
    guest_port: u16,
    token: Arc<String>,
) {
    let t0 = Instant::now();
    let mut ev = EgressEvent {
        kind: EgressKind::Expose as i32,
        time_unix_ms: now_ms(),
        address: peer.ip().to_string(),
        port: u32::from(guest_port),
        ..Default::default()
    };
    let pre = read_preamble(&mut caller).await;
    let presented = pre
        .as_ref()
        .and_then(|p| p.token.as_deref())
        .is_some_and(|t| bool::from(t.as_bytes().ct_eq(token.as_bytes())));
    let Some(pre) = pre.filter(|_| presented) else {
        ev.verdict = "no valid token".into();
        let _ = caller.set_zero_linger();
        ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
        state.record(ev);
        return;
    };
    let upstream = match connect_guest(netns, guest_port).await {
        Ok(s) => s,
        Err(e) => {
            ev.allowed = true;
            ev.verdict = format!("token accepted; the guest's port: {e}");
            let _ = caller.set_zero_linger();
            ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
            state.record(ev);
            return;
        }
    };
    ev.allowed = true;
    ev.verdict = "token accepted".into();
    let (c_read, c_write) = caller.into_split();
    let (g_read, mut g_write) = upstream.into_split();
    let head = if g_write.write_all(&pre.forward).await.is_ok() {
        pre.forward.len() as u64
    } else {
        0
    };
    let (inn, out) = tokio::join!(pump(c_read, g_write), pump(g_read, c_write));
    // Seen from the guest: what the caller sent came in, what the guest answered went out.
    ev.bytes_in = head + inn;
    ev.bytes_out = out;
    ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
    state.record(ev);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_token_is_read_from_a_raw_line_or_an_http_header_and_removed() {
        assert_eq!(preamble(b"abc"), None, "a raw line needs its newline");
        assert_eq!(
            preamble(b"tok\r\nhello"),
            Some(Preamble {
                token: Some("tok".into()),
                forward: b"hello".to_vec()
            })
        );
        assert_eq!(
            preamble(b"GET / HTTP/1.1\r\nHost: x\r\n"),
            None,
            "an unfinished head"
        );
        let p =
            preamble(b"GET / HTTP/1.1\r\nHost: x\r\nX-Airlock-Token:  tok \r\n\r\nbody").unwrap();
        assert_eq!(p.token.as_deref(), Some("tok"));
        assert_eq!(p.forward, b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody".to_vec());
        let none = preamble(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!(none.token, None);
        assert_eq!(new_token().unwrap().len(), 64);
        assert_ne!(new_token().unwrap(), new_token().unwrap());
    }
}
