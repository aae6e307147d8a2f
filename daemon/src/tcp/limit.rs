//! What a TCP listener (gRPC, the E2B gateway) lets a connection hold: at most N connections at
//! once (one accepted past the limit is closed at once, and each holds its place until it
//! closes); a TLS handshake done within a deadline, off the accept loop; and no connection
//! that moves no byte either way for the idle timeout (its next read fails, so its server
//! drops it and its place comes back).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A listener's limits on its connections.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections at once.
    pub max: usize,
    /// A TLS handshake's deadline.
    pub handshake: Duration,
    /// The longest a connection may move no byte either way.
    pub idle: Duration,
}

impl ConnLimits {
    /// The limits the settings give the TCP listeners.
    pub fn of(cfg: &crate::config::Config) -> Self {
        Self {
            max: cfg.max_connections,
            handshake: Duration::from_millis(cfg.tls_handshake_timeout_ms.max(1)),
            idle: Duration::from_millis(cfg.idle_timeout_ms.max(1)),
        }
    }
}

/// A TCP connection holding its place, closed when idle too long.
#[derive(Debug)]
pub struct Counted {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
    idle: Duration,
    quiet_until: Pin<Box<Sleep>>,
}

impl Counted {
    /// Bytes moved: the idle timeout starts again.
    fn moved(&mut self) {
        let next = Instant::now() + self.idle;
        self.quiet_until.as_mut().reset(next);
    }

    /// Nothing moved this time: an error once the idle timeout has passed.
    fn check_idle(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Error> {
        match self.quiet_until.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the connection was idle too long",
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut me.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                me.moved();
                Poll::Ready(Ok(()))
            }
            Poll::Pending => me.check_idle(cx).map(Err),
            other => other,
        }
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        match Pin::new(&mut me.stream).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) if n > 0 => {
                me.moved();
                Poll::Ready(Ok(n))
            }
            Poll::Pending => me.check_idle(cx).map(Err),
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// An accepted connection: plain, or TLS with its handshake done.
#[derive(Debug)]
pub enum Conn {
    Plain(Counted),
    Tls(Box<TlsStream<Counted>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Conn::Plain(c) => c.stream.connect_info(),
            Conn::Tls(t) => t.get_ref().0.stream.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(c) => Pin::new(c).poll_read(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(c) => Pin::new(c).poll_write(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(c) => Pin::new(c).poll_flush(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(c) => Pin::new(c).poll_shutdown(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The connections of `listener` within `limits`, TLS ones (with `tls`) once their handshake
/// is done. Accepting stops when the stream is dropped.
pub fn connections(
    listener: TcpListener,
    limits: ConnLimits,
    tls: Option<TlsAcceptor>,
) -> ReceiverStream<std::io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(64);
    let places = Arc::new(Semaphore::new(limits.max.max(1)));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors and the like: not the listener's end.
                    tracing::warn!("accepting a TCP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(place) = places.clone().try_acquire_owned() else {
                tracing::warn!(
                    max = limits.max,
                    "a TCP connection over the limit was closed"
                );
                continue;
            };
            let counted = Counted {
                stream,
                _place: place,
                idle: limits.idle,
                quiet_until: Box::pin(tokio::time::sleep(limits.idle)),
            };
            let tx = tx.clone();
            match &tls {
                None => {
                    let _ = tx.send(Ok(Conn::Plain(counted))).await;
                }
                Some(acceptor) => {
                    let handshake = acceptor.accept(counted);
                    tokio::spawn(async move {
                        match tokio::time::timeout(limits.handshake, handshake).await {
                            Ok(Ok(s)) => {
                                let _ = tx.send(Ok(Conn::Tls(Box::new(s)))).await;
                            }
                            Ok(Err(e)) => tracing::debug!("TLS handshake: {e}"),
                            Err(_) => tracing::debug!("a TLS handshake timed out"),
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
pub mod tests;
