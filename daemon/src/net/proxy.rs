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
    let policy = state.policy();
    let mut head = Vec::new();
    let mut sniffed_tls = false;
    let bare = Attempt {
        addr: dst.ip(),
        port: dst.port(),
        name: None,
        resolved: &[],
        pinned: false,
        host: state.egress.host_addrs.contains(dst.ip()),
    };
    let verdict = match policy.check(&bare) {
        Err(d @ (Denial::NoName | Denial::Guarded(_) | Denial::HostAddress(_)))
            if wants_name(&policy) =>
        {
            let wait = Duration::from_millis(state.cfg().sniff_timeout_ms);
            let sniffed = read_name(&mut guest, &mut head, wait).await;
            sniffed_tls = sniffed.as_ref().is_some_and(|(_, tls)| *tls);
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
                    ev.name = name;
                    v
                }
                None => Err(d),
            }
        }
        other => other,
    };
    let allowance = match verdict {
        Ok(a) => a,
        Err(d) => {
            ev.verdict = d.to_string();
            reset(guest);
            ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
            state.record(ev);
            return;
        }
    };
    ev.allowed = true;
    ev.verdict = allowance_text(&allowance);
    // A sandbox with brokered secrets: every allowed connection's name is learnt (if its
    // policy did not need it), to tell whether the proxy serves it itself.
    if state.secrets.brokers() && head.is_empty() {
        let wait = Duration::from_millis(state.cfg().sniff_timeout_ms);
        if let Some((name, tls)) = read_name(&mut guest, &mut head, wait).await {
            ev.name = name;
            sniffed_tls = tls;
        }
    }
    // (A sandbox without brokered secrets asks nothing more of its secrets.)
    let brokered = state.secrets.brokers()
        && !ev.name.is_empty()
        && !state.secrets.headers_for(&ev.name, sniffed_tls).is_empty();
    let wait = Duration::from_millis(state.cfg().connect_timeout_ms);
    let upstream = match tokio::time::timeout(wait, TcpStream::connect(dst)).await {
        Ok(Ok(u)) => u,
        Ok(Err(e)) => {
            ev.verdict = format!("{}; connecting failed: {e}", ev.verdict);
            reset(guest);
            ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
            state.record(ev);
            return;
        }
        Err(_) => {
            ev.verdict = format!("{}; connecting timed out after {wait:?}", ev.verdict);
            reset(guest);
            ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
            state.record(ev);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    let _ = guest.set_nodelay(true);
    if brokered {
        let counts = Arc::new(super::broker::Counts::default());
        let name = ev.name.clone();
        let served = super::broker::serve(
            state.clone(),
            guest,
            head,
            upstream,
            name,
            sniffed_tls,
            counts.clone(),
        )
        .await;
        ev.verdict = match served {
            Ok(()) => format!("{}; brokered", ev.verdict),
            Err(e) => format!("{}; brokered: {e}", ev.verdict),
        };
        ev.bytes_out = counts.from_guest.load(std::sync::atomic::Ordering::Relaxed);
        ev.bytes_in = counts.to_guest.load(std::sync::atomic::Ordering::Relaxed);
        ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
        state.record(ev);
        return;
    }
    let (g_read, g_write) = guest.into_split();
    let (u_read, mut u_write) = upstream.into_split();
    let sent_head = if u_write.write_all(&head).await.is_ok() {
        head.len() as u64
    } else {
        0
    };
    let (out, inn) = tokio::join!(pump(g_read, u_write), pump(u_read, g_write));
    ev.bytes_out = sent_head + out;
    ev.bytes_in = inn;
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
