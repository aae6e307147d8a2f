#![allow(clippy::unwrap_used)]

use super::*;
use crate::net::tests::loopback::{Upstream, exchange, pair};
use crate::net::tests::state;

/// A plain-HTTP connection the policy allowed on its first request's `Host` (`a.test`),
/// served by the proxy to an echoing upstream on loopback: the guest's end, the upstream,
/// and the connection's event once it ends.
async fn allowed_by_name() -> (TcpStream, Upstream, tokio::task::JoinHandle<EgressEvent>) {
    let st = state(
        Policy::Rules(vec![Rule::domain("a.test", &[]).unwrap()]),
        vec![],
    );
    let upstream = Upstream::start().await;
    let (guest, ours) = pair().await;
    let up = upstream.connect().await;
    let head = Head {
        bytes: b"GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n".to_vec(),
        tls: false,
        by_name: true,
    };
    let serving = tokio::spawn(async move {
        let mut ev = EgressEvent {
            name: "a.test".into(),
            ..Default::default()
        };
        serve_allowed(&st, ours, head, up, false, &mut ev).await;
        ev
    });
    (guest, upstream, serving)
}

#[tokio::test]
async fn a_kept_alive_connection_allowed_by_its_host_cannot_switch_host() {
    let (mut guest, upstream, serving) = allowed_by_name().await;
    // The first request was read to decide; its answer, then one more for the same host.
    assert!(exchange(&mut guest, "").await.starts_with("HTTP/1.1 200"));
    let again = exchange(&mut guest, "GET /2 HTTP/1.1\r\nHost: a.test\r\n\r\n").await;
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    let other = exchange(&mut guest, "GET /3 HTTP/1.1\r\nHost: b.test\r\n\r\n").await;
    assert!(other.starts_with("HTTP/1.1 403"), "{other}");
    assert!(other.contains("allowed for a.test, not b.test"), "{other}");
    let heads = upstream.heads();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(
        heads
            .iter()
            .all(|h| h.contains("host: a.test") || h.contains("Host: a.test"))
    );
    drop(guest);
    let ev = serving.await.unwrap();
    assert!(ev.bytes_out > 0 && ev.bytes_in > 0, "{ev:?}");
    assert!(
        ev.verdict
            .ends_with("; a request refused: this connection was allowed for a.test, not b.test"),
        "{ev:?}"
    );
}

#[tokio::test]
async fn a_never_reachable_address_is_refused_even_by_a_cidr_rule_of_exactly_it() {
    // 127.0.0.1 stands for an etcd endpoint of the cluster (the host's own address too).
    let st = state(
        Policy::Rules(vec![Rule::cidr("127.0.0.1", &[]).unwrap()]),
        vec![],
    );
    st.egress
        .never_reach
        .set_cluster(vec!["http://127.0.0.1:2379".into()])
        .await;
    let (_guest, mut ours) = pair().await;
    let dst: SocketAddr = "127.0.0.1:2379".parse().unwrap();
    let (mut ev, mut head) = (EgressEvent::default(), Head::default());
    let verdict = decide(&st, &mut ours, dst, &mut ev, &mut head).await;
    assert_eq!(verdict, Err(Denial::Never(dst.ip())));
}

/// An upstream that switches every connection's protocol to a raw echo.
async fn upgrading_upstream() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).await.unwrap() == 1 {
            head.push(b[0]);
        }
        let ok = "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n";
        s.write_all(ok.as_bytes()).await.unwrap();
        let (mut r, mut w) = s.into_split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    });
    addr
}

#[tokio::test]
async fn an_upgrade_on_a_connection_allowed_by_its_host_still_works() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let st = state(
        Policy::Rules(vec![Rule::domain("a.test", &[]).unwrap()]),
        vec![],
    );
    let up = TcpStream::connect(upgrading_upstream().await)
        .await
        .unwrap();
    let (mut guest, ours) = pair().await;
    let head = Head {
        bytes: b"GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n"
            .to_vec(),
        tls: false,
        by_name: true,
    };
    tokio::spawn(async move {
        let mut ev = EgressEvent {
            name: "a.test".into(),
            ..Default::default()
        };
        serve_allowed(&st, ours, head, up, false, &mut ev).await;
    });
    let switched = exchange(&mut guest, "").await;
    assert!(switched.starts_with("HTTP/1.1 101"), "{switched}");
    guest.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    let read = tokio::time::timeout(Duration::from_secs(5), guest.read_exact(&mut back));
    read.await.unwrap().unwrap();
    assert_eq!(&back, b"ping");
}
