//! At most N TCP connections at once: a connection accepted past the limit is closed at once,
//! and each one holds its place until it closes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection holding its place.
#[derive(Debug)]
pub struct Counted {
    stream: TcpStream,
    _place: OwnedSemaphorePermit,
}

impl Connected for Counted {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The connections of `listener`, at most `max` at once.
pub fn connections(
    listener: TcpListener,
    max: usize,
) -> impl Stream<Item = std::io::Result<Counted>> {
    let places = Arc::new(Semaphore::new(max.max(1)));
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |accepted| {
        let stream = match accepted {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        match places.clone().try_acquire_owned() {
            Ok(place) => Some(Ok(Counted {
                stream,
                _place: place,
            })),
            Err(_) => {
                tracing::warn!(max, "a TCP connection over the limit was closed");
                None
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_places_come_back() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = Box::pin(connections(listener, 1));
        let first = TcpStream::connect(addr).await.unwrap();
        let held = incoming.next().await.unwrap().unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let next = tokio::time::timeout(std::time::Duration::from_millis(300), incoming.next());
        assert!(next.await.is_err(), "nothing is let in past the limit");
        let mut byte = [0u8; 1];
        assert_eq!(
            second.read(&mut byte).await.unwrap(),
            0,
            "closed by the server"
        );
        drop((held, first));
        let _third = TcpStream::connect(addr).await.unwrap();
        let later = tokio::time::timeout(std::time::Duration::from_secs(2), incoming.next());
        assert!(later.await.unwrap().unwrap().is_ok(), "a place came back");
    }
}
