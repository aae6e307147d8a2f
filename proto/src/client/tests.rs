//! The agent client against scripted agent frames.

use std::io;

use super::*;
use crate::frame::encode_frame;
use crate::pb::{ErrorCode, Output, Pong};

/// A client whose agent side is the given frames.
fn client_with(frames: &[Response]) -> AgentClient<io::Cursor<Vec<u8>>, Vec<u8>> {
    let mut wire = encode_frame(&ready_frame(PROTOCOL_VERSION)).unwrap();
    for f in frames {
        wire.extend(encode_frame(f).unwrap());
    }
    AgentClient::from_stream(io::Cursor::new(wire), Vec::new()).unwrap()
}

fn ready_frame(version: u32) -> Response {
    Response {
        id: 0,
        kind: Some(response::Kind::Ready(Ready {
            protocol_version: version,
            ..Default::default()
        })),
    }
}

fn resp(id: u64, kind: response::Kind) -> Response {
    Response {
        id,
        kind: Some(kind),
    }
}

fn output(exec_id: u64, stream: StreamKind, offset: u64, data: &[u8]) -> response::Kind {
    response::Kind::Output(Output {
        exec_id,
        stream: stream as i32,
        offset,
        data: data.to_vec(),
    })
}

fn sent_requests(client: &AgentClient<io::Cursor<Vec<u8>>, Vec<u8>>) -> Vec<Request> {
    let mut wire = client.writer().as_slice();
    let mut out = Vec::new();
    while let Some(req) = read_frame(&mut wire).unwrap() {
        out.push(req);
    }
    out
}

#[test]
fn from_stream_rejects_other_protocol_version() {
    let wire = encode_frame(&ready_frame(2)).unwrap();
    let err = AgentClient::from_stream(io::Cursor::new(wire), Vec::new()).unwrap_err();
    assert!(matches!(err, ClientError::Version { got: 2 }), "{err:?}");
}

#[test]
fn from_stream_rejects_a_first_frame_that_is_not_ready() {
    let wire = encode_frame(&resp(0, response::Kind::Pong(Pong::default()))).unwrap();
    let err = AgentClient::from_stream(io::Cursor::new(wire), Vec::new()).unwrap_err();
    assert!(matches!(err, ClientError::NotReady(_)), "{err:?}");
}

#[test]
fn from_stream_on_empty_stream_is_closed() {
    let err = AgentClient::from_stream(io::Cursor::new(Vec::new()), Vec::new()).unwrap_err();
    assert!(matches!(err, ClientError::Closed), "{err:?}");
}

#[test]
fn ping_sends_id_one_and_returns_pong() {
    let mut c = client_with(&[resp(1, response::Kind::Pong(Pong { uptime_ms: 5 }))]);
    assert_eq!(c.ping().unwrap().uptime_ms, 5);
    let sent = sent_requests(&c);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].id, 1);
    assert!(matches!(sent[0].kind, Some(request::Kind::Ping(_))));
}

#[test]
fn agent_error_becomes_client_error_with_code() {
    let err = pb::Error {
        code: ErrorCode::NotFound as i32,
        message: "nope".into(),
    };
    let mut c = client_with(&[resp(1, response::Kind::Error(err))]);
    let e = c.stat("/x").unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn response_to_unknown_request_is_a_protocol_error() {
    let mut c = client_with(&[resp(9, response::Kind::Pong(Pong::default()))]);
    let e = c.ping().unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
}

#[test]
fn exec_collect_streams_output_and_buffers_other_responses() {
    let exit = ExecExit {
        exec_id: 7,
        status: Some(exec_exit::Status::ExitCode(3)),
        ..Default::default()
    };
    let started = ExecStarted { exec_id: 7, pid: 1 };
    // Request 1 is a ping sent first by hand; its Pong arrives in the middle of the exec.
    let mut c = client_with(&[
        resp(2, response::Kind::ExecStarted(started)),
        resp(2, output(7, StreamKind::Stdout, 0, b"ab")),
        resp(1, response::Kind::Pong(Pong { uptime_ms: 1 })),
        resp(2, output(7, StreamKind::Stderr, 0, b"x")),
        resp(2, output(7, StreamKind::Stdout, 2, b"c")),
        resp(2, response::Kind::ExecExit(exit)),
    ]);
    let ping_id = c.send_kind(request::Kind::Ping(pb::Ping {})).unwrap();
    let mut got = Vec::new();
    let result = c
        .exec_collect(pb::Exec::default(), |s, d| got.push((s, d.to_vec())))
        .unwrap();
    assert_eq!(result, exit);
    assert_eq!(
        got,
        vec![
            (StreamKind::Stdout, b"ab".to_vec()),
            (StreamKind::Stderr, b"x".to_vec()),
            (StreamKind::Stdout, b"c".to_vec()),
        ]
    );
    let pong = c.recv().unwrap();
    assert_eq!(pong.id, ping_id);
}

#[test]
fn exec_collect_rejects_a_gap_in_output_offsets() {
    let mut c = client_with(&[
        resp(
            1,
            response::Kind::ExecStarted(ExecStarted { exec_id: 1, pid: 1 }),
        ),
        resp(1, output(1, StreamKind::Stdout, 5, b"late")),
    ]);
    let e = c.exec_collect(pb::Exec::default(), |_, _| {}).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
}

#[test]
fn exec_collect_reports_a_spawn_error() {
    let err = pb::Error {
        code: ErrorCode::NotFound as i32,
        message: "no such program".into(),
    };
    let mut c = client_with(&[resp(1, response::Kind::Error(err))]);
    let e = c.exec_collect(pb::Exec::default(), |_, _| {}).unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn write_file_splits_into_chunks_and_truncates_only_first() {
    let ok = || response::Kind::Ok(pb::Ok {});
    let mut c = client_with(&[resp(1, ok()), resp(2, ok()), resp(3, ok())]);
    let data = vec![7u8; 2 * MAX_FILE_CHUNK + 10];
    c.write_file("/f", &data).unwrap();
    let sent = sent_requests(&c);
    let chunks: Vec<_> = sent
        .iter()
        .map(|r| match &r.kind {
            Some(request::Kind::WriteFile(w)) => (w.offset, w.data.len(), w.truncate),
            other => panic!("{other:?}"),
        })
        .collect();
    let (one, two) = (MAX_FILE_CHUNK as u64, 2 * MAX_FILE_CHUNK as u64);
    assert_eq!(
        chunks,
        vec![
            (0, MAX_FILE_CHUNK, true),
            (one, MAX_FILE_CHUNK, false),
            (two, 10, false)
        ]
    );
}

#[test]
fn write_file_of_empty_data_sends_one_truncating_chunk() {
    let mut c = client_with(&[resp(1, response::Kind::Ok(pb::Ok {}))]);
    c.write_file("/empty", &[]).unwrap();
    let sent = sent_requests(&c);
    assert_eq!(sent.len(), 1);
}

#[test]
fn read_file_loops_until_eof() {
    let data = |d: &[u8], eof| {
        response::Kind::FileData(FileData {
            data: d.to_vec(),
            eof,
            size: 5,
            ..Default::default()
        })
    };
    let mut c = client_with(&[resp(1, data(b"abc", false)), resp(2, data(b"de", true))]);
    assert_eq!(c.read_file("/f").unwrap(), b"abcde");
    let offsets: Vec<_> = sent_requests(&c)
        .iter()
        .map(|r| match &r.kind {
            Some(request::Kind::ReadFile(rf)) => rf.offset,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(offsets, vec![0, 3]);
}

#[test]
fn read_file_rejects_empty_chunk_before_eof() {
    let empty = response::Kind::FileData(FileData::default());
    let mut c = client_with(&[resp(1, empty)]);
    let e = c.read_file("/f").unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
}

#[test]
fn send_refuses_id_zero_and_duplicates() {
    let mut c = client_with(&[]);
    let ping = |id| Request {
        id,
        kind: Some(request::Kind::Ping(pb::Ping {})),
    };
    assert!(matches!(
        c.send(&ping(0)),
        Err(ClientError::InvalidRequest(_))
    ));
    c.send(&ping(4)).unwrap();
    assert!(matches!(
        c.send(&ping(4)),
        Err(ClientError::InvalidRequest(_))
    ));
}

#[test]
fn id_zero_error_is_reported_as_agent_error() {
    let err = pb::Error {
        code: ErrorCode::TooLarge as i32,
        message: "frame".into(),
    };
    let mut c = client_with(&[resp(0, response::Kind::Error(err))]);
    let e = c.ping().unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::TooLarge));
}

#[test]
fn closed_stream_while_waiting_is_closed() {
    let mut c = client_with(&[]);
    assert!(matches!(c.ping().unwrap_err(), ClientError::Closed));
}

/// A fake VMM hybrid-vsock socket: reads the CONNECT line, answers `reply`, then (if the
/// reply was OK) sends Ready. Returns the socket path and the line it received.
fn fake_vmm(
    tag: &str,
    reply: &'static [u8],
) -> (std::path::PathBuf, std::thread::JoinHandle<String>) {
    use std::os::unix::net::UnixListener;
    let path = std::env::temp_dir().join(format!(
        "airlock-proto-test-{}-{tag}.sock",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let line = super::read_line(&mut s).unwrap();
        s.write_all(reply).unwrap();
        if reply.starts_with(b"OK") {
            write_frame(&mut s, &ready_frame(PROTOCOL_VERSION)).unwrap();
        }
        line
    });
    (path, handle)
}

#[test]
fn connect_vsock_sends_connect_and_reads_ready_after_ok() {
    let (path, vmm) = fake_vmm("ok", b"OK 1073741824\n");
    let client = AgentClient::connect_vsock(&path, crate::AGENT_VSOCK_PORT).unwrap();
    assert_eq!(client.ready().protocol_version, PROTOCOL_VERSION);
    assert_eq!(vmm.join().unwrap(), "CONNECT 52");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn connect_vsock_fails_when_the_vmm_does_not_say_ok() {
    let (path, vmm) = fake_vmm("refused", b"ERR no listener\n");
    let err = AgentClient::connect_vsock(&path, 52).unwrap_err();
    assert!(matches!(err, ClientError::Handshake(_)), "{err:?}");
    vmm.join().unwrap();
    let _ = std::fs::remove_file(&path);
}

#[test]
fn connect_unix_to_a_missing_socket_is_a_connect_error() {
    let err = AgentClient::connect_unix("/nonexistent/airlock.sock").unwrap_err();
    assert!(matches!(err, ClientError::Connect { .. }), "{err:?}");
}

#[test]
fn start_exec_sends_keep_on_disconnect_and_returns_the_request_id() {
    let started = ExecStarted { exec_id: 4, pid: 9 };
    let mut c = client_with(&[resp(1, response::Kind::ExecStarted(started))]);
    let exec = pb::Exec::shell("sleep 1").with_keep_on_disconnect(true);
    assert_eq!(c.start_exec(exec).unwrap(), (1, started));
    match &sent_requests(&c)[0].kind {
        Some(request::Kind::Exec(e)) => {
            assert!(e.keep_on_disconnect);
            assert_eq!(e.command, Some(pb::exec::Command::Shell("sleep 1".into())));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn exec_builders_fill_the_command_and_nothing_else() {
    let e = pb::Exec::argv(["echo", "hi"]);
    assert_eq!(
        e.command,
        Some(pb::exec::Command::Argv(pb::Argv {
            args: vec!["echo".into(), "hi".into()]
        }))
    );
    assert!(!e.keep_on_disconnect);
    assert_eq!(e.timeout_ms, 0);
}

#[test]
fn attach_collect_follows_replayed_then_live_output_from_the_attached_offsets() {
    let attached = Attached {
        exec_id: 7,
        pid: 1,
        stdout_offset: 2,
        stderr_offset: 0,
        dropped_bytes: 3,
        exited: false,
    };
    let exit = ExecExit {
        exec_id: 7,
        status: Some(exec_exit::Status::ExitCode(0)),
        orphan_dropped_bytes: 3,
        ..Default::default()
    };
    let mut c = client_with(&[
        resp(1, response::Kind::Attached(attached)),
        // Replayed from offset 2 (the first two bytes are no longer retained), then live.
        resp(1, output(7, StreamKind::Stdout, 2, b"bc")),
        resp(1, output(7, StreamKind::Stdout, 4, b"h")),
        resp(1, response::Kind::ExecExit(exit)),
    ]);
    let mut got = Vec::new();
    let (att, end) = c
        .attach_collect(7, |s, off, d| got.push((s, off, d.to_vec())))
        .unwrap();
    assert_eq!((att, end), (attached, exit));
    assert_eq!(
        got,
        [
            (StreamKind::Stdout, 2, b"bc".to_vec()),
            (StreamKind::Stdout, 4, b"h".to_vec())
        ]
    );
    assert!(matches!(
        sent_requests(&c)[0].kind,
        Some(request::Kind::Attach(pb::Attach {
            exec_id: 7,
            stdout_offset: 0,
            stderr_offset: 0
        }))
    ));
}

#[test]
fn attach_collect_rejects_output_before_the_attached_offset() {
    let attached = Attached {
        exec_id: 7,
        stdout_offset: 5,
        ..Default::default()
    };
    let mut c = client_with(&[
        resp(1, response::Kind::Attached(attached)),
        resp(1, output(7, StreamKind::Stdout, 4, b"x")),
    ]);
    let e = c.attach_collect(7, |_, _, _| {}).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
}

#[test]
fn attach_collect_refuses_offsets_that_overflow() {
    let attached = Attached {
        exec_id: 7,
        stdout_offset: u64::MAX - 1,
        ..Default::default()
    };
    let mut c = client_with(&[
        resp(1, response::Kind::Attached(attached)),
        resp(1, output(7, StreamKind::Stdout, u64::MAX - 1, b"abc")),
    ]);
    let e = c.attach_collect(7, |_, _, _| {}).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
}

#[test]
fn attach_from_sends_the_offsets_the_host_has() {
    let attached = Attached {
        exec_id: 2,
        stdout_offset: 10,
        stderr_offset: 3,
        ..Default::default()
    };
    let mut c = client_with(&[resp(1, response::Kind::Attached(attached))]);
    assert_eq!(c.attach_from(2, 10, 3).unwrap(), (1, attached));
    match &sent_requests(&c)[0].kind {
        Some(request::Kind::Attach(a)) => {
            assert_eq!((a.exec_id, a.stdout_offset, a.stderr_offset), (2, 10, 3));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn attach_of_an_unknown_execution_is_the_agents_not_found() {
    let err = pb::Error {
        code: ErrorCode::NotFound as i32,
        message: "no execution 3".into(),
    };
    let mut c = client_with(&[resp(1, response::Kind::Error(err))]);
    assert_eq!(
        c.attach(3).unwrap_err().agent_code(),
        Some(ErrorCode::NotFound)
    );
}

#[test]
fn reseed_sends_its_fields_and_returns_what_was_done() {
    let done = Reseeded {
        rng_reseeded: true,
        sandbox_id_set: true,
        ..Default::default()
    };
    let mut c = client_with(&[resp(1, response::Kind::Reseeded(done.clone()))]);
    assert_eq!(c.reseed(&[1; 32], "vm-1", "sb-1").unwrap(), done);
    match &sent_requests(&c)[0].kind {
        Some(request::Kind::Reseed(r)) => {
            assert_eq!(r.entropy, vec![1; 32]);
            assert_eq!(
                (r.hostname.as_str(), r.sandbox_id.as_str()),
                ("vm-1", "sb-1")
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn describe_exit_lists_status_and_flags() {
    let exit = ExecExit {
        status: Some(exec_exit::Status::Signal(9)),
        timed_out: true,
        ..Default::default()
    };
    assert_eq!(describe_exit(&exit), "signal 9, timed out");
}
