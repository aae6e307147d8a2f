//! Protocol tests of executions that outlive their connection (Exec.keep_on_disconnect) and of
//! Attach, against the real agent in host mode: survival, replay of output lost with the old
//! connection, the exit of an execution that ended unowned, signals and stdin after Attach, the
//! bounded window, errors, ordinary executions still killed, and a reset connection.

mod common;

use airlock_proto::Requests;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use airlock_proto::pb::{self, ErrorCode, StreamKind, response};
use common::*;

/// Output of one Attach, per stream, with the exit.
struct Attached {
    info: pb::Attached,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: pb::ExecExit,
}

impl Attached {
    fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

fn attach_collect(c: &mut Client, exec_id: u64) -> Attached {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let (info, exit) = c
        .attach_collect(exec_id, |stream, _, data| match stream {
            StreamKind::Stdout => stdout.extend_from_slice(data),
            _ => stderr.extend_from_slice(data),
        })
        .expect("attach");
    Attached {
        info,
        stdout,
        stderr,
        exit,
    }
}

fn kept(script: &str) -> pb::Exec {
    pb::Exec::shell(script).with_keep_on_disconnect(true)
}

/// Starts `exec` on a connection of its own, closes that connection, and returns the
/// ExecStarted.
fn start_and_disconnect(agent: &AgentProcess, exec: pb::Exec) -> pb::ExecStarted {
    let mut c = agent.client();
    let (_, started) = c.start_exec(exec).expect("start");
    drop(c);
    started
}

/// Whether process `pid` is alive, asked of the agent with `kill -0` from another execution.
fn alive_per_kill_0(agent: &AgentProcess, pid: u32) -> bool {
    let out = run(&mut agent.client(), shell(&format!("kill -0 {pid}")));
    exit_code(&out.exit) == Some(0)
}

#[test]
fn a_kept_execution_survives_its_connection_and_attach_gets_all_output_in_order() {
    let agent = AgentProcess::start();
    let started = start_and_disconnect(&agent, kept("echo a; sleep 1; echo b"));
    let mut c = agent.client();
    let got = attach_collect(&mut c, started.exec_id);
    // "a" was most likely written to the first connection before it closed: the agent's window
    // gives it again.
    assert_eq!(got.stdout_str(), "a\nb\n");
    assert!(got.stderr.is_empty());
    assert_eq!(exit_code(&got.exit), Some(0));
    assert_eq!(got.exit.exec_id, started.exec_id);
    assert_eq!(got.exit.stdout_bytes, 4);
    assert_eq!(got.exit.orphan_dropped_bytes, 0);
    assert_eq!((got.info.pid, got.info.dropped_bytes), (started.pid, 0));
    assert_eq!((got.info.stdout_offset, got.info.stderr_offset), (0, 0));
    // Its exit was delivered: nothing is left to attach to.
    let err = agent.client().attach(started.exec_id).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn attach_can_skip_the_output_the_host_already_has() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = kept("echo first; read line; echo second");
    exec.stdin_open = true;
    let (id, started) = c.start_exec(exec).expect("start");
    // Read "first\n" (6 bytes) on the first connection, then lose it.
    match next_kind(&mut c, id) {
        response::Kind::Output(o) => assert_eq!(o.data, b"first\n"),
        other => panic!("{other:?}"),
    }
    drop(c);
    let mut c = agent.client();
    let (aid, info) = c.attach_from(started.exec_id, 6, 0).expect("attach");
    assert_eq!((info.stdout_offset, info.exited), (6, false));
    // The process still waits for a line: nothing is replayed, nothing is live yet.
    c.signal(started.exec_id, libc::SIGKILL).expect("signal");
    // So the exit is the next response.
    match next_kind(&mut c, aid) {
        response::Kind::ExecExit(e) => {
            assert!(e.killed);
            assert_eq!(e.stdout_bytes, 6);
        }
        other => panic!("nothing should be replayed: {other:?}"),
    }
}

#[test]
fn an_execution_that_exited_unowned_is_attached_with_its_output_and_exit_at_once() {
    let agent = AgentProcess::start();
    let started = start_and_disconnect(&agent, kept("sleep 0.2; echo late; echo err >&2; exit 7"));
    assert!(
        eventually(Duration::from_secs(20), || !exists(started.pid)),
        "the execution did not end"
    );
    // The process is gone; its execution ends once its (closed) pipes are drained: at once.
    std::thread::sleep(Duration::from_millis(500));
    let mut c = agent.client();
    let got = attach_collect(&mut c, started.exec_id);
    assert!(got.info.exited);
    assert_eq!(got.stdout_str(), "late\n");
    assert_eq!(got.stderr, b"err\n");
    assert_eq!(exit_code(&got.exit), Some(7));
}

#[test]
fn a_process_left_running_is_alive_signalable_after_attach_and_reattachable() {
    let agent = AgentProcess::start();
    let mut first = agent.client();
    let (_, kept_started) = first.start_exec(kept("sleep 600")).expect("start kept");
    // An ordinary execution on the same connection: its death shows that the agent has
    // processed the close.
    let (_, plain) = first.start_exec(shell("sleep 600")).expect("start plain");
    drop(first);
    assert!(
        eventually(Duration::from_secs(10), || group_members(plain.pid)
            .is_empty()),
        "the ordinary execution survived its connection"
    );
    assert!(alive(kept_started.pid));
    assert!(alive_per_kill_0(&agent, kept_started.pid));
    // Unowned: nobody can signal it...
    let mut c = agent.client();
    let err = c.signal(kept_started.exec_id, libc::SIGKILL).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
    // ...until a connection attaches; that one may close again, and another attach.
    let (_, info) = c.attach(kept_started.exec_id).expect("attach");
    assert_eq!(info.pid, kept_started.pid);
    drop(c);
    let mut c = agent.client();
    let (aid, _) = c.attach(kept_started.exec_id).expect("attach again");
    c.signal(kept_started.exec_id, libc::SIGKILL)
        .expect("signal");
    let exit = loop {
        match next_kind(&mut c, aid) {
            response::Kind::ExecExit(e) => break e,
            response::Kind::Output(_) => {}
            other => panic!("{other:?}"),
        }
    };
    assert!(exit.killed, "{exit:?}");
    assert_eq!(exit_signal(&exit), Some(libc::SIGKILL));
    assert!(eventually(Duration::from_secs(10), || !exists(
        kept_started.pid
    )));
}

#[test]
fn stdin_goes_to_an_attached_execution() {
    let agent = AgentProcess::start();
    let mut exec = kept("cat; echo end");
    exec.stdin_open = true;
    let started = start_and_disconnect(&agent, exec);
    let mut c = agent.client();
    let (aid, _) = c.attach(started.exec_id).expect("attach");
    c.stdin(started.exec_id, b"through the new connection\n", true)
        .expect("stdin");
    let mut stdout = Vec::new();
    loop {
        match next_kind(&mut c, aid) {
            response::Kind::Output(o) => stdout.extend(o.data),
            response::Kind::ExecExit(e) => {
                assert_eq!(exit_code(&e), Some(0));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(stdout, b"through the new connection\nend\n");
}

#[test]
fn output_of_an_unowned_execution_past_the_window_is_dropped_and_counted() {
    let agent = AgentProcess::start_with_args(&["--orphan-buffer-bytes", "4096"]);
    let go = agent.dir.join("go");
    let script = format!(
        "while [ ! -e {} ]; do sleep 0.02; done; head -c 100000 /dev/zero | tr '\\0' x",
        go.display()
    );
    let started = start_and_disconnect(&agent, kept(&script));
    // The output starts after the connection is gone: no byte of it reaches any connection
    // before the Attach.
    std::fs::write(&go, b"").unwrap();
    assert!(eventually(Duration::from_secs(20), || !exists(started.pid)));
    let mut c = agent.client();
    let got = attach_collect(&mut c, started.exec_id);
    assert_eq!(got.info.dropped_bytes, 100_000 - 4096);
    assert_eq!(got.info.stdout_offset, 100_000 - 4096);
    assert_eq!(got.stdout, vec![b'x'; 4096]);
    assert_eq!(got.exit.stdout_bytes, 100_000);
    assert_eq!(got.exit.orphan_dropped_bytes, 100_000 - 4096);
    assert!(!got.exit.output_truncated);
}

#[test]
fn attach_errors_unknown_ordinary_and_owned_elsewhere() {
    let agent = AgentProcess::start();
    let mut a = agent.client();
    let mut b = agent.client();
    let code = |r: Result<(u64, pb::Attached), airlock_proto::ClientError>| {
        r.expect_err("attach should fail").agent_code()
    };
    assert_eq!(code(b.attach(999_999)), Some(ErrorCode::NotFound));
    // Kept, but its connection is alive.
    let (_, owned) = a.start_exec(kept("sleep 600")).expect("start");
    assert_eq!(code(b.attach(owned.exec_id)), Some(ErrorCode::NotFound));
    // Already this connection's.
    assert_eq!(
        code(a.attach(owned.exec_id)),
        Some(ErrorCode::InvalidArgument)
    );
    // Not kept.
    let (_, plain) = a.start_exec(shell("sleep 600")).expect("start");
    assert_eq!(code(b.attach(plain.exec_id)), Some(ErrorCode::NotFound));
    // Offsets past what it produced.
    let err = b.attach_from(owned.exec_id, 10, 0).unwrap_err();
    assert!(err.agent_code().is_some());
    a.signal(owned.exec_id, libc::SIGKILL).expect("kill");
    a.signal(plain.exec_id, libc::SIGKILL).expect("kill");
    b.ping().expect("the connection goes on");
}

#[test]
fn ordinary_executions_are_still_killed_when_their_connection_closes() {
    let agent = AgentProcess::start();
    let started = start_and_disconnect(&agent, shell("sleep 600 & sleep 600"));
    assert!(
        eventually(Duration::from_secs(10), || group_members(started.pid)
            .is_empty()),
        "processes of a closed connection survive: {:?}",
        group_members(started.pid)
    );
    let err = agent.client().attach(started.exec_id).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn a_connection_reset_is_a_close_and_the_agent_keeps_serving() {
    let agent = AgentProcess::start();
    let go = agent.dir.join("go");
    // More output than the client's 64 KiB read buffer takes in, so that some of it stays
    // unread in the socket; the end waits for the test.
    let script = format!(
        "echo before; head -c 200000 /dev/zero; while [ ! -e {} ]; do sleep 0.02; done; \
         echo after",
        go.display()
    );
    let mut c = agent.client();
    let (_, started) = c.start_exec(kept(&script)).expect("start");
    // Closing a Unix socket with unread data resets its peer, so the agent's read fails with
    // ECONNRESET (what a vsock transport reset looks like to it).
    assert!(eventually(Duration::from_secs(10), || has_unread_bytes(
        c.reader()
    )));
    drop(c);
    let mut fresh = agent.client();
    fresh.ping().expect("the agent keeps accepting");
    std::fs::write(&go, b"").unwrap();
    let got = attach_collect(&mut fresh, started.exec_id);
    let mut expected = b"before\n".to_vec();
    expected.extend(vec![0u8; 200_000]);
    expected.extend(b"after\n");
    assert_eq!(got.stdout.len(), expected.len());
    assert!(got.stdout == expected, "output differs");
    assert_eq!(exit_code(&got.exit), Some(0));
}

/// Whether data waits unread in `s` (peeked, not consumed).
fn has_unread_bytes(s: &UnixStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte into `byte`, which outlives the call; MSG_PEEK
    // leaves it in the socket and MSG_DONTWAIT keeps the call from blocking.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            (&raw mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n > 0
}
