//! One sandbox's transparent TCP proxy: every TCP connection of its guest arrives here (the
//! namespace's ruleset redirects it), is decided by the policy — on its address alone when
//! that decides it, else on the name it states in its first bytes (TLS SNI, HTTP `Host`) and
//! the daemon's own resolution of that name — and is either reset at once or joined to a
//! connection the daemon opens from its own namespace, to the address the guest asked for.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{EgressEvent, EgressKind};
use airlock_egress::sniff::{MAX_HEAD, Sniff, Sniffed, sniff};
use airlock_egress::{Allowance, Attempt, Denial, Policy, Rule};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::warn;

use super::{NetState, now_ms};

/// Accepts the guest's connections until the sandbox's network is dropped (which aborts this
/// task, and with its `JoinSet` every connection it serves).
pub(super) async fn serve(state: Arc<NetState>, listener: TcpListener) {
    let mut conns = JoinSet::new();
    let max = state.cfg().max_connections;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        warn!(sandbox = %state.sandbox_id, "egress proxy: accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if conns.len() >= max {
                    let mut ev = event(&stream);
                    ev.verdict = format!("more than {max} connections at once");
                    reset(stream);
                    state.record(ev);
                    continue;
                }
                conns.spawn(handle(state.clone(), stream));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// The destination the guest connected to, before the ruleset redirected it here.
fn original_dst(s: &TcpStream) -> io::Result<SocketAddr> {
    // SAFETY: sockaddr_in is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes to `addr`, which is that large, and sets
    // `len`; the descriptor is the stream's, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            (&raw mut addr).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
        u16::from_be(addr.sin_port),
    )))
}

/// A TCP event for `stream`'s destination (unknown: 0.0.0.0:0).
fn event(stream: &TcpStream) -> EgressEvent {
    let dst = original_dst(stream).unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    EgressEvent {
        kind: EgressKind::Tcp as i32,
        time_unix_ms: now_ms(),
        address: dst.ip().to_string(),
        port: u32::from(dst.port()),
        ..Default::default()
    }
}

/// Closes `stream` with a reset, so that the guest's program fails at once.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Whether a name could change the verdict: the policy has domain rules.
fn wants_name(policy: &Policy) -> bool {
    matches!(policy, Policy::Rules(rules) if rules.iter().any(|r| matches!(r, Rule::Domain { .. })))
}

fn allowance_text(a: &Allowance) -> String {
    match a {
        Allowance::Rule(r) => r.clone(),
        Allowance::Internet => "allow-internet".to_owned(),
    }
}

/// One guest connection: decide it, connect upstream, serve it (brokered or relayed), and
/// record what happened.
async fn handle(state: Arc<NetState>, mut guest: TcpStream) {
    let t0 = Instant::now();
    let mut ev = event(&guest);
    let Ok(dst) = original_dst(&guest) else {
        ev.verdict = "no original destination (not redirected by the sandbox's ruleset)".into();
        reset(guest);
        state.record(ev);
        return;
    };
    // The package proxy, whatever the egress policy: its own policy decides there.
    if dst == SocketAddr::from((airlock_proto::GATEWAY_IPV4, crate::pkg::PKG_PORT)) {
        ev.allowed = true;
        ev.verdict = "the package proxy".into();
        state.record(ev);
        crate::pkg::serve(state.packages.clone(), guest).await;
        return;
    }
    let mut head = Head::default();
    let verdict = decide(&state, &mut guest, dst, &mut ev, &mut head).await;
    let allowance = match verdict {
        Ok(a) => a,
        Err(d) => {
            ev.verdict = d.to_string();
            reset(guest);
            finish(&state, ev, t0);
            return;
        }
    };
    ev.allowed = true;
    ev.verdict = allowance_text(&allowance);
    let brokered = is_brokered(&state, &mut guest, &mut ev, &mut head).await;
    let upstream = match connect(&state, dst).await {
        Ok(u) => u,
        Err(e) => {
            ev.verdict = format!("{}; {e}", ev.verdict);
            reset(guest);
            finish(&state, ev, t0);
            return;
        }
    };
    serve_allowed(&state, guest, head, upstream, brokered, &mut ev).await;
    finish(&state, ev, t0);
}

/// What the proxy read of a connection before deciding it.
#[derive(Debug, Default)]
pub(super) struct Head {
    /// The guest's first bytes (they go upstream first).
    pub bytes: Vec<u8>,
    /// They were a TLS ClientHello (else an HTTP request head, or nothing read).
    pub tls: bool,
    /// The connection was allowed on the name they state (a domain rule), not its address.
    pub by_name: bool,
}

/// Decide step: the policy's verdict on the destination alone, or, when a name could change
/// it, on the name the guest's first bytes state (read into `head`; `ev.name` says what they
/// stated) and the daemon's resolution of that name.
async fn decide(
    state: &NetState,
    guest: &mut TcpStream,
    dst: SocketAddr,
    ev: &mut EgressEvent,
    head: &mut Head,
) -> Result<Allowance, Denial> {
    let policy = state.policy();
    let bare = Attempt {
        addr: dst.ip(),
        port: dst.port(),
        name: None,
        resolved: &[],
        pinned: false,
        host: state.egress.host_addrs.contains(dst.ip()),
        never: state.egress.never_reach.contains(dst.ip()),
    };
    match policy.check(&bare) {
        Err(d @ (Denial::NoName | Denial::Guarded(_) | Denial::HostAddress(_)))
            if wants_name(&policy) =>
        {
            let wait = Duration::from_millis(state.cfg().sniff_timeout_ms);
            let sniffed = read_name(guest, &mut head.bytes, wait).await;
            head.tls = sniffed.as_ref().is_some_and(|(_, tls)| *tls);
            match sniffed.map(|(name, _)| name) {
                // A name no rule allows is never resolved: the guest must not make the
                // daemon's resolver query names of its choosing (a tunnel through `Host`).
                Some(name) if !policy.may_resolve(&name) => {
                    ev.name = name;
                    Err(d)
                }
                Some(name) => {
                    let (resolved, pinned) = state.resolve(&name).await;
                    let v = policy.check(&Attempt {
                        name: Some(&name),
                        resolved: &resolved,
                        pinned,
                        ..bare
                    });
                    head.by_name = v.is_ok();
                    ev.name = name;
                    v
                }
                None => Err(d),
            }
        }
        other => other,
    }
}

/// Broker step: whether the proxy serves this allowed connection itself. A sandbox with
/// brokered secrets learns every allowed connection's name (if its policy did not need it).
async fn is_brokered(
    state: &NetState,
    guest: &mut TcpStream,
    ev: &mut EgressEvent,
    head: &mut Head,
) -> bool {
    if state.secrets.brokers() && head.bytes.is_empty() {
        let wait = Duration::from_millis(state.cfg().sniff_timeout_ms);
        if let Some((name, tls)) = read_name(guest, &mut head.bytes, wait).await {
            ev.name = name;
            head.tls = tls;
        }
    }
    // (A sandbox without brokered secrets asks nothing more of its secrets.)
    state.secrets.brokers()
        && !ev.name.is_empty()
        && !state.secrets.headers_for(&ev.name, head.tls).is_empty()
}

/// Why the daemon's own connection to the guest's destination failed.
#[derive(Debug)]
enum ConnectError {
    Failed(io::Error),
    TimedOut(Duration),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "connecting failed: {e}"),
            Self::TimedOut(wait) => write!(f, "connecting timed out after {wait:?}"),
        }
    }
}

/// Connect step: the daemon's connection to `dst`, from its own namespace, within the
/// configured connect timeout.
async fn connect(state: &NetState, dst: SocketAddr) -> Result<TcpStream, ConnectError> {
    let wait = Duration::from_millis(state.cfg().connect_timeout_ms);
    match tokio::time::timeout(wait, TcpStream::connect(dst)).await {
        Ok(Ok(u)) => Ok(u),
        Ok(Err(e)) => Err(ConnectError::Failed(e)),
        Err(_) => Err(ConnectError::TimedOut(wait)),
    }
}

/// Serve step: brokered connections, and plain-HTTP ones allowed on their `Host`, request by
/// request (so that a kept-alive connection cannot switch host after its first request); the
/// others spliced. (TLS allowed on its SNI is spliced: what it carries inside is not seen.)
pub(super) async fn serve_allowed(
    state: &Arc<NetState>,
    guest: TcpStream,
    head: Head,
    upstream: TcpStream,
    brokered: bool,
    ev: &mut EgressEvent,
) {
    let _ = upstream.set_nodelay(true);
    let _ = guest.set_nodelay(true);
    if brokered || (head.by_name && !head.tls) {
        serve_http(state, guest, head, upstream, brokered, ev).await;
    } else {
        relay(guest, &head.bytes, upstream, ev).await;
    }
}

/// Serve step (request by request): the HTTP relay serves the connection (the broker's,
/// which adds its headers for the connection's name if it is `brokered`); `ev` gets its
/// outcome and byte counts.
async fn serve_http(
    state: &Arc<NetState>,
    guest: TcpStream,
    head: Head,
    upstream: TcpStream,
    brokered: bool,
    ev: &mut EgressEvent,
) {
    let counts = Arc::new(super::broker::Counts::default());
    let conn = super::http::Conn {
        name: ev.name.clone(),
        tls: head.tls,
        pinned: head.by_name,
        ..Default::default()
    };
    let refused = conn.refused.clone();
    let served = super::broker::serve(
        state.clone(),
        guest,
        head.bytes,
        upstream,
        conn,
        counts.clone(),
    )
    .await;
    // (A connection relayed per request without a secret keeps its verdict: the rule.)
    let how = if brokered { "; brokered" } else { "" };
    ev.verdict = match (served, refused.get()) {
        (Err(e), _) => format!("{}{how}; stopped: {e}", ev.verdict),
        (Ok(()), Some(r)) => format!("{}{how}; a request refused: {r}", ev.verdict),
        (Ok(()), None) => format!("{}{how}", ev.verdict),
    };
    ev.bytes_out = counts.from_guest.load(std::sync::atomic::Ordering::Relaxed);
    ev.bytes_in = counts.to_guest.load(std::sync::atomic::Ordering::Relaxed);
}

/// Serve step (relayed): the bytes already read from the guest go upstream first, then both
/// directions are copied until they end; `ev` gets the byte counts.
async fn relay(guest: TcpStream, head: &[u8], upstream: TcpStream, ev: &mut EgressEvent) {
    let (g_read, g_write) = guest.into_split();
    let (u_read, mut u_write) = upstream.into_split();
    let sent_head = if u_write.write_all(head).await.is_ok() {
        head.len() as u64
    } else {
        0
    };
    let (out, inn) = tokio::join!(pump(g_read, u_write), pump(u_read, g_write));
    ev.bytes_out = sent_head + out;
    ev.bytes_in = inn;
}

/// Finish step: the event gets the connection's duration and is recorded.
fn finish(state: &NetState, mut ev: EgressEvent, t0: Instant) {
    ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
    state.record(ev);
}

/// Reads the connection's first bytes into `head` until they state a name (or cannot), for at
/// most `wait` and [`MAX_HEAD`] bytes; the name, and whether it came from a TLS ClientHello.
async fn read_name(
    guest: &mut TcpStream,
    head: &mut Vec<u8>,
    wait: Duration,
) -> Option<(String, bool)> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut buf = [0u8; 4096];
    loop {
        let room = MAX_HEAD.saturating_sub(head.len()).min(buf.len());
        if room == 0 {
            return None;
        }
        let n = match tokio::time::timeout_at(deadline, guest.read(&mut buf[..room])).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return None,
        };
        head.extend_from_slice(&buf[..n]);
        match sniff(head) {
            Sniff::NeedMore => {}
            Sniff::Done(Sniffed::Tls(name)) => return name.map(|n| (n, true)),
            Sniff::Done(Sniffed::Http(name)) => return name.map(|n| (n, false)),
            Sniff::Done(Sniffed::Other) | Sniff::TooLarge => return None,
        }
    }
}

/// Copies one direction until its end (or an error), then shuts the other side's writing
/// down; returns the bytes copied.
pub(super) async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf) -> u64 {
    let mut buf = vec![0u8; 32 << 10];
    let mut n = 0u64;
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(k) => {
                if to.write_all(&buf[..k]).await.is_err() {
                    break;
                }
                n += k as u64;
            }
        }
    }
    let _ = to.shutdown().await;
    n
}

#[cfg(test)]
mod tests;
