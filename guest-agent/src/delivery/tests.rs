//! Tests of [`Delivery`](super::Delivery): ownership, the window, and Attach.

use super::*;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use airlock_proto::pb::exec_exit;
use airlock_proto::read_frame;

/// A connection writer whose peer is the returned stream.
fn conn() -> (Arc<ConnWriter>, UnixStream) {
    let (ours, peer) = UnixStream::pair().unwrap();
    let write = File::from(OwnedFd::from(ours.try_clone().unwrap()));
    let control = File::from(OwnedFd::from(ours));
    (Arc::new(ConnWriter::new(write, control)), peer)
}

fn output(stream: StreamKind, offset: u64, data: &[u8]) -> Frame {
    Frame::Output(Output {
        exec_id: 7,
        stream: stream as i32,
        offset,
        data: data.to_vec(),
    })
}

fn exit() -> ExecExit {
    ExecExit {
        exec_id: 7,
        status: Some(exec_exit::Status::ExitCode(0)),
        ..Default::default()
    }
}

fn delivery(keep: bool, conn: &Arc<ConnWriter>, per_exec: usize) -> Delivery {
    let limits = Arc::new(OrphanLimits::new(per_exec));
    Delivery::new(7, 100, keep, Arc::clone(conn), 1, limits)
}

/// Every frame the peer can read without blocking.
fn frames(peer: &mut UnixStream) -> Vec<Response> {
    peer.set_nonblocking(true).unwrap();
    let mut out = Vec::new();
    while let Ok(Some(resp)) = read_frame::<_, Response>(peer) {
        out.push(resp);
    }
    out
}

/// (request id, stream, offset, data) of every Output.
fn outputs(resps: &[Response]) -> Vec<(u64, i32, u64, Vec<u8>)> {
    resps
        .iter()
        .filter_map(|r| match &r.kind {
            Some(response::Kind::Output(o)) => Some((r.id, o.stream, o.offset, o.data.clone())),
            _ => None,
        })
        .collect()
}

fn attached(resps: &[Response]) -> Attached {
    match resps.first().and_then(|r| r.kind.clone()) {
        Some(response::Kind::Attached(a)) => a,
        other => panic!("expected Attached first, got {other:?}"),
    }
}

fn last_exit(resps: &[Response]) -> Option<ExecExit> {
    match resps.last().and_then(|r| r.kind.clone()) {
        Some(response::Kind::ExecExit(e)) => Some(e),
        _ => None,
    }
}

/// Closes `conn` as the server does: shut down, then released.
fn close(d: &Delivery, conn: &Arc<ConnWriter>) -> Release {
    conn.shutdown();
    d.release(conn)
}

const OUT: StreamKind = StreamKind::Stdout;
const ERR: StreamKind = StreamKind::Stderr;

#[test]
fn an_owned_execution_sends_output_and_exit_with_the_owners_request_id() {
    let (a, mut peer) = conn();
    let d = delivery(false, &a, 1 << 20);
    d.deliver(vec![output(OUT, 0, b"hi")]);
    let mut before = false;
    let mut after = None;
    d.finish(exit(), || before = true, |sent| after = Some(sent));
    assert!(before);
    assert_eq!(after, Some(true));
    let got = frames(&mut peer);
    assert_eq!(outputs(&got), [(1, 1, 0, b"hi".to_vec())]);
    assert!(last_exit(&got).is_some());
}

#[test]
fn closing_the_owner_kills_an_ordinary_execution_and_orphans_a_kept_one() {
    let (a, _peer) = conn();
    let (b, _peer_b) = conn();
    assert_eq!(delivery(false, &a, 10).release(&a), Release::Kill);
    let kept = delivery(true, &a, 10);
    assert_eq!(kept.release(&b), Release::NotOwned);
    assert_eq!(kept.release(&a), Release::Orphaned);
    assert!(!kept.owned_by(&a));
}

#[test]
fn attach_replays_output_sent_before_the_close_then_goes_live_with_its_own_id() {
    let (a, _peer_a) = conn();
    let d = delivery(true, &a, 1 << 20);
    // Sent to the first connection, whose host may never have read it.
    d.deliver(vec![output(OUT, 0, b"a\n")]);
    assert_eq!(close(&d, &a), Release::Orphaned);
    d.deliver(vec![output(OUT, 2, b"b\n"), output(ERR, 0, b"e")]);
    let (b, mut peer_b) = conn();
    assert!(!d.attach(&b, 9, [0, 0]).unwrap());
    d.deliver(vec![output(OUT, 4, b"c\n")]);
    let got = frames(&mut peer_b);
    let att = attached(&got);
    assert_eq!((att.exec_id, att.pid, att.exited), (7, 100, false));
    assert_eq!(
        (att.stdout_offset, att.stderr_offset, att.dropped_bytes),
        (0, 0, 0)
    );
    assert_eq!(
        outputs(&got),
        [
            (9, 1, 0, b"a\n".to_vec()),
            (9, 1, 2, b"b\n".to_vec()),
            (9, 2, 0, b"e".to_vec()),
            (9, 1, 4, b"c\n".to_vec())
        ]
    );
    assert!(d.owned_by(&b));
}

#[test]
fn attach_replays_only_from_the_offsets_the_host_has() {
    let (a, _peer_a) = conn();
    let d = delivery(true, &a, 1 << 20);
    d.deliver(vec![output(OUT, 0, b"abcd"), output(ERR, 0, b"xy")]);
    close(&d, &a);
    let (b, mut peer_b) = conn();
    d.attach(&b, 2, [3, 2]).unwrap();
    let got = frames(&mut peer_b);
    let att = attached(&got);
    assert_eq!((att.stdout_offset, att.stderr_offset), (3, 2));
    assert_eq!(outputs(&got), [(2, 1, 3, b"d".to_vec())]);
    // Past what was produced: refused.
    let (c, _peer_c) = conn();
    close(&d, &b);
    let err = d.attach(&c, 1, [5, 0]).unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidArgument);
}

#[test]
fn attach_after_the_exit_delivers_output_and_exit_at_once_and_only_once() {
    let (a, _peer_a) = conn();
    let d = delivery(true, &a, 1 << 20);
    close(&d, &a);
    d.deliver(vec![output(OUT, 0, b"x")]);
    let mut delivered = None;
    d.finish(exit(), || {}, |sent| delivered = Some(sent));
    assert_eq!(delivered, Some(false));
    let (b, mut peer_b) = conn();
    assert!(d.attach(&b, 3, [0, 0]).unwrap());
    let got = frames(&mut peer_b);
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(attached(&got).exited);
    assert_eq!(outputs(&got), [(3, 1, 0, b"x".to_vec())]);
    assert!(last_exit(&got).is_some());
    let (c, _peer_c) = conn();
    close(&d, &b);
    assert_eq!(
        d.attach(&c, 1, [0, 0]).unwrap_err().code,
        ErrorCode::NotFound
    );
}

#[test]
fn the_window_keeps_the_latest_bytes_and_counts_unsent_ones_pushed_out() {
    let (a, _peer_a) = conn();
    let d = delivery(true, &a, 5);
    // Sent while owned: pushed out later, but not dropped (a connection had them).
    d.deliver(vec![output(OUT, 0, b"123")]);
    close(&d, &a);
    d.deliver(vec![output(OUT, 3, b"abc"), output(OUT, 6, b"defg")]);
    d.deliver(vec![output(ERR, 0, b"zz")]);
    d.finish(exit(), || {}, |_| {});
    let (b, mut peer_b) = conn();
    d.attach(&b, 2, [0, 0]).unwrap();
    let got = frames(&mut peer_b);
    let att = attached(&got);
    // Retained: "efg" of stdout and "zz" of stderr; "abcd" was never sent anywhere.
    assert_eq!(att.dropped_bytes, 4);
    assert_eq!((att.stdout_offset, att.stderr_offset), (7, 0));
    assert_eq!(
        outputs(&got),
        [(2, 1, 7, b"efg".to_vec()), (2, 2, 0, b"zz".to_vec())]
    );
    assert_eq!(last_exit(&got).map(|e| e.orphan_dropped_bytes), Some(4));
}

#[test]
fn a_chunk_larger_than_the_window_keeps_its_tail() {
    let (a, _peer_a) = conn();
    let d = delivery(true, &a, 4);
    close(&d, &a);
    d.deliver(vec![output(OUT, 0, b"0123456789")]);
    let (b, mut peer_b) = conn();
    d.attach(&b, 1, [0, 0]).unwrap();
    let got = frames(&mut peer_b);
    assert_eq!(attached(&got).dropped_bytes, 6);
    assert_eq!(outputs(&got), [(1, 1, 6, b"6789".to_vec())]);
}

#[test]
fn the_shared_budget_bounds_all_windows_together_and_is_given_back() {
    let limits = Arc::new(OrphanLimits::with_total(8, 10));
    let (a, _peer) = conn();
    a.shutdown();
    let one = Delivery::new(1, 1, true, Arc::clone(&a), 1, Arc::clone(&limits));
    let two = Delivery::new(2, 2, true, Arc::clone(&a), 2, Arc::clone(&limits));
    one.release(&a);
    two.release(&a);
    one.deliver(vec![output(OUT, 0, &[1; 8])]);
    two.deliver(vec![output(OUT, 0, &[2; 8])]);
    assert_eq!(limits.used(), 10);
    // The second window has 2 bytes: the rest of its output was dropped.
    let (b, mut peer_b) = conn();
    two.attach(&b, 5, [0, 0]).unwrap();
    assert_eq!(attached(&frames(&mut peer_b)).dropped_bytes, 6);
    drop(one);
    assert_eq!(limits.used(), 2);
    drop(two);
    assert_eq!(limits.used(), 0);
}

#[test]
fn an_ordinary_execution_keeps_nothing() {
    let limits = Arc::new(OrphanLimits::new(1 << 20));
    let (a, _peer) = conn();
    let d = Delivery::new(1, 1, false, Arc::clone(&a), 1, Arc::clone(&limits));
    d.deliver(vec![output(OUT, 0, b"not kept")]);
    assert_eq!(limits.used(), 0);
}

#[test]
fn attach_refuses_ordinary_live_owned_and_own_executions() {
    let (a, _peer_a) = conn();
    let (b, _peer_b) = conn();
    let plain = delivery(false, &a, 10);
    assert_eq!(
        plain.attach(&b, 1, [0, 0]).unwrap_err().code,
        ErrorCode::NotFound
    );
    let kept = delivery(true, &a, 10);
    assert_eq!(
        kept.attach(&b, 1, [0, 0]).unwrap_err().code,
        ErrorCode::NotFound
    );
    assert_eq!(
        kept.attach(&a, 1, [0, 0]).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
}

#[test]
fn attach_takes_over_from_an_owner_whose_peer_is_gone() {
    let (a, peer_a) = conn();
    let d = delivery(true, &a, 10);
    drop(peer_a);
    let (b, _peer_b) = conn();
    assert!(!d.attach(&b, 4, [0, 0]).unwrap());
    assert!(d.owned_by(&b));
    // The dead connection was shut down, so its reader ends too.
    assert!(!a.is_alive());
}

#[test]
fn a_failed_write_orphans_a_kept_execution_and_counts_its_output_unsent() {
    let (a, peer_a) = conn();
    let d = delivery(true, &a, 1 << 20);
    drop(peer_a);
    d.deliver(vec![output(OUT, 0, b"lost?")]);
    assert!(!d.owned_by(&a));
    let (b, mut peer_b) = conn();
    d.attach(&b, 6, [0, 0]).unwrap();
    assert_eq!(
        outputs(&frames(&mut peer_b)),
        [(6, 1, 0, b"lost?".to_vec())]
    );
}

#[test]
fn replies_go_only_to_the_connection_that_asked() {
    let (a, mut peer_a) = conn();
    let (b, _peer_b) = conn();
    let d = delivery(true, &a, 10);
    let reply = |id| Response {
        id,
        kind: Some(response::Kind::Ok(airlock_proto::pb::Ok {})),
    };
    d.deliver(vec![
        Frame::Reply(Arc::clone(&a), reply(11)),
        Frame::Reply(Arc::clone(&b), reply(12)),
    ]);
    let ids: Vec<_> = frames(&mut peer_a).iter().map(|r| r.id).collect();
    assert_eq!(ids, [11]);
}
