#![allow(clippy::unwrap_used)]

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::*;
use crate::frame::{read_frame, write_frame};
use crate::pb::{self, Pong};

/// A mux over a socket pair and the fake agent's end (Ready already sent).
fn pair() -> (Mux, UnixStream) {
    let (host, mut agent) = UnixStream::pair().unwrap();
    let ready = Response {
        id: 0,
        kind: Some(response::Kind::Ready(Ready {
            protocol_version: crate::PROTOCOL_VERSION,
            ..Default::default()
        })),
    };
    write_frame(&mut agent, &ready).unwrap();
    let (r, w) = TimedStream::pair(host, None).unwrap();
    let client = AgentClient::from_stream(r, w).unwrap();
    (Mux::from_client(client).unwrap(), agent)
}

fn pong(id: u64, uptime_ms: u64) -> Response {
    Response {
        id,
        kind: Some(response::Kind::Pong(Pong { uptime_ms })),
    }
}

fn ping() -> request::Kind {
    request::Kind::Ping(pb::Ping {})
}

#[test]
fn each_caller_gets_its_own_answers_in_any_order() {
    let (mux, agent) = pair();
    let mut a = mux.client(Some(Instant::now() + Duration::from_secs(10)));
    let mut b = mux.client(Some(Instant::now() + Duration::from_secs(10)));
    let ia = a.send_kind(ping()).unwrap();
    let ib = b.send_kind(ping()).unwrap();
    let mut rd = BufReader::new(agent.try_clone().unwrap());
    let first: Request = read_frame(&mut rd).unwrap().unwrap();
    let second: Request = read_frame(&mut rd).unwrap().unwrap();
    assert_eq!((first.id, second.id), (ia, ib));
    // Answered the other way round.
    let mut w = agent;
    write_frame(&mut w, &pong(ib, 2)).unwrap();
    write_frame(&mut w, &pong(ia, 1)).unwrap();
    let got_a = a.recv_for(ia).unwrap();
    let got_b = b.recv_for(ib).unwrap();
    assert_eq!(got_a, pong(ia, 1));
    assert_eq!(got_b, pong(ib, 2));
    assert!(!mux.is_closed());
}

#[test]
fn a_caller_that_gives_up_leaves_the_connection_working() {
    let (mux, mut agent) = pair();
    let mut a = mux.client(Some(Instant::now() + Duration::from_millis(50)));
    let id = a.send_kind(ping()).unwrap();
    let err = a.recv_for(id).unwrap_err();
    assert!(err.to_string().contains("agent connection failed"), "{err}");
    // The late answer is dropped; the next caller is served.
    write_frame(&mut agent, &pong(id, 1)).unwrap();
    let mut b = mux.client(Some(Instant::now() + Duration::from_secs(10)));
    let next = b.send_kind(ping()).unwrap();
    write_frame(&mut agent, &pong(next, 7)).unwrap();
    assert_eq!(b.recv_for(next).unwrap(), pong(next, 7));
}

#[test]
fn an_answer_to_a_request_never_sent_closes_the_connection() {
    let (mux, mut agent) = pair();
    let mut a = mux.client(Some(Instant::now() + Duration::from_secs(10)));
    let id = a.send_kind(ping()).unwrap();
    write_frame(&mut agent, &pong(id + 1000, 1)).unwrap();
    match a.recv_for(id) {
        Err(ClientError::Lost(why)) => assert!(why.contains("never sent"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(mux.is_closed());
    assert!(matches!(
        mux.client(None).send_kind(ping()),
        Err(ClientError::Lost(_))
    ));
}

#[test]
fn the_agent_closing_fails_every_caller_and_dropping_the_mux_closes_it() {
    let (mux, agent) = pair();
    let mut a = mux.client(None);
    let id = a.send_kind(ping()).unwrap();
    drop(agent);
    match a.recv_for(id) {
        // End of stream, or a reset where the agent's end went with a request unread.
        Err(ClientError::Lost(why)) => {
            assert!(why.contains("closed") || why.contains("reset"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    let (mux, agent) = pair();
    drop(mux);
    let mut rd = BufReader::new(agent);
    // End of stream or a reset: either way the host's side is gone.
    let got: Result<Option<Request>, _> = read_frame(&mut rd);
    assert!(
        matches!(got, Ok(None) | Err(_)),
        "the socket is shut down once the last handle is gone: {got:?}"
    );
}

#[test]
fn a_caller_that_stops_reading_is_bounded_by_its_queue() {
    let (mux, mut agent) = pair();
    let mut a = mux.client(None);
    let exec = a
        .send_kind(request::Kind::Exec(pb::Exec::argv(["true"])))
        .unwrap();
    let mut b = mux.client(Some(Instant::now() + Duration::from_secs(10)));
    let p = b.send_kind(ping()).unwrap();
    // Fewer frames than the queue holds: the other caller is not held up.
    for offset in 0..(ROUTE_QUEUE as u64 - 1) {
        let out = Response {
            id: exec,
            kind: Some(response::Kind::Output(pb::Output {
                exec_id: 1,
                stream: pb::StreamKind::Stdout as i32,
                offset,
                data: vec![b'x'],
            })),
        };
        write_frame(&mut agent, &out).unwrap();
    }
    write_frame(&mut agent, &pong(p, 3)).unwrap();
    assert_eq!(b.recv_for(p).unwrap(), pong(p, 3));
    assert!(matches!(
        a.recv_for(exec).unwrap().kind,
        Some(response::Kind::Output(_))
    ));
}
