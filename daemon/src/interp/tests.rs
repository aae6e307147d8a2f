//! The interpreter's client against a fake guest on a Unix socket: the hybrid-vsock
//! handshake, then HTTP/1.1 answers, well-formed and hostile.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use super::*;

/// What the fake guest does with a connection.
#[derive(Clone, Debug)]
enum Script {
    /// Closes it after `CONNECT` (nothing listens on the port).
    NoListener,
    /// Answers these bytes, then closes.
    Answer(Vec<u8>),
    /// Answers these bytes, then holds the connection until the client closes it.
    AnswerAndHold(Vec<u8>),
}

/// What the fake saw: each request (head and body), and `"closed"` when a client closed a
/// held connection.
type Seen = mpsc::UnboundedReceiver<String>;

static N: AtomicU64 = AtomicU64::new(0);

fn socket_path() -> PathBuf {
    let n = N.fetch_add(1, Ordering::SeqCst);
    std::env::temp_dir().join(format!("airlock-interp-{}-{n}.sock", std::process::id()))
}

/// A fake guest serving `script` on every connection; its socket and what it saw.
fn fake(script: Script) -> (PathBuf, Seen) {
    let path = socket_path();
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(serve(s, script.clone(), tx.clone()));
        }
    });
    (path, rx)
}

async fn serve(mut s: UnixStream, script: Script, tx: mpsc::UnboundedSender<String>) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\n") {
        if s.read(&mut byte).await.unwrap_or(0) == 0 {
            return;
        }
        buf.push(byte[0]);
    }
    assert_eq!(buf, b"CONNECT 49999\n");
    let hold = matches!(script, Script::AnswerAndHold(_));
    let answer = match script {
        Script::NoListener => return,
        Script::Answer(a) | Script::AnswerAndHold(a) => a,
    };
    s.write_all(b"OK 1234\n").await.unwrap();
    let request = read_request(&mut s).await;
    let _ = tx.send(request);
    let _ = s.write_all(&answer).await;
    if hold {
        let mut sink = [0u8; 1024];
        while s.read(&mut sink).await.unwrap_or(0) > 0 {}
        let _ = tx.send("closed".into());
    }
}

/// A request's head and body (by its Content-Length).
async fn read_request(s: &mut UnixStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.unwrap_or(0) == 0 {
            break;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    buf.extend_from_slice(&body);
    String::from_utf8_lossy(&buf).into_owned()
}

/// An HTTP answer of `lines`, chunked, one chunk a line.
fn chunked(lines: &[&str]) -> Vec<u8> {
    let mut out = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n\
                    Transfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    for l in lines {
        let line = format!("{l}\n");
        out.extend_from_slice(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes());
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// An HTTP answer whose body ends when the connection closes.
fn close_delimited(body: &[u8]) -> Vec<u8> {
    let mut out = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_vec();
    out.extend_from_slice(body);
    out
}

const SECRET: &str = "hunter2-secret-value";

fn interp(path: PathBuf) -> Interp {
    let patterns = Arc::new(Patterns::new([("API_KEY", SECRET.as_bytes())]));
    Interp::at("sb-test", "t1", path, patterns)
}

fn cell(code: &str, timeout_ms: u64) -> Cell {
    Cell {
        code: code.into(),
        language: String::new(),
        context_id: String::new(),
        env: HashMap::new(),
        timeout: Duration::from_millis(timeout_ms),
    }
}

/// Runs `c`, collecting every event before the end, and the end.
async fn run(i: &Interp, c: &Cell) -> (Vec<run_code_event::Event>, CodeEnd) {
    let (tx, mut rx) = mpsc::channel(1024);
    let end = i.run(c, &tx).await;
    drop(tx);
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e.event.unwrap());
    }
    match events.pop() {
        Some(run_code_event::Event::End(e)) => assert_eq!(e, end),
        other => panic!("the last event is not the end: {other:?}"),
    }
    (events, end)
}

#[tokio::test]
async fn a_cell_streams_its_events_redacted_and_ends_with_its_count() {
    let (path, mut seen) = fake(Script::Answer(chunked(&[
        &format!(r#"{{"type":"stdout","text":"key={SECRET}\n","timestamp":17}}"#),
        r#"{"type":"stderr","text":"warn\n","timestamp":18}"#,
        &format!(
            r#"{{"type":"result","text":"'{SECRET}'","html":"<b>x</b>","png":"iVBORw0K","is_main_result":true}}"#
        ),
        r#"{"type":"number_of_executions","execution_count":4}"#,
        r#"{"type":"end_of_execution"}"#,
    ])));
    let i = interp(path);
    let mut c = cell("print(1)", 5_000);
    c.context_id = "ctx-1".into();
    c.env.insert("A".into(), "b".into());
    let (events, end) = run(&i, &c).await;
    let request = seen.recv().await.unwrap();
    assert!(
        request.starts_with("POST /execute HTTP/1.1\r\n"),
        "{request}"
    );
    let body = request.split("\r\n\r\n").nth(1).unwrap();
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        body,
        json!({"code": "print(1)", "context_id": "ctx-1", "env_vars": {"A": "b"}})
    );
    assert_eq!(events.len(), 3, "{events:?}");
    let run_code_event::Event::Stdout(o) = &events[0] else {
        panic!()
    };
    assert_eq!(o.text, "key=[REDACTED:API_KEY]\n");
    assert_eq!(o.timestamp_unix_ns, 17);
    let run_code_event::Event::Result(r) = &events[2] else {
        panic!()
    };
    assert_eq!(r.data["text/plain"], "'[REDACTED:API_KEY]'");
    assert_eq!(r.data["text/html"], "<b>x</b>");
    assert_eq!(r.data["image/png"], "iVBORw0K");
    assert!(r.is_main_result);
    assert_eq!(end.state(), CodeState::Ok);
    assert_eq!(end.execution_count, 4);
    assert_eq!(end.context_id, "ctx-1");
}

/// The sandbox's environment goes with every cell, under the cell's own entries (as an
/// execution's does): a kernel started before the snapshot never saw it.
#[tokio::test]
async fn a_cell_gets_the_sandboxs_environment_under_its_own() {
    let (path, mut seen) = fake(Script::Answer(chunked(&[r#"{"type":"end_of_execution"}"#])));
    let mut i = interp(path);
    i.env.insert("REGION".into(), "eu".into());
    i.env.insert("A".into(), "sandbox".into());
    let mut c = cell("1", 5_000);
    c.env.insert("A".into(), "cell".into());
    let (_, end) = run(&i, &c).await;
    assert_eq!(end.state(), CodeState::Ok);
    let request = seen.recv().await.unwrap();
    let body: serde_json::Value =
        serde_json::from_str(request.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(body["env_vars"], json!({"REGION": "eu", "A": "cell"}));

    // A variable the limits refuse fails the cell before it reaches the guest.
    let mut bad = cell("1", 5_000);
    bad.env.insert("BAD=NAME".into(), "x".into());
    let (_, end) = run(&i, &bad).await;
    assert_eq!(end.state(), CodeState::Failed, "{end:?}");
}

#[tokio::test]
async fn an_exception_is_an_error_and_an_oom_kill_is_oom_killed() {
    let (path, _seen) = fake(Script::Answer(chunked(&[
        r#"{"type":"error","name":"ZeroDivisionError","value":"division by zero","traceback":"tb"}"#,
        r#"{"type":"number_of_executions","execution_count":1}"#,
        r#"{"type":"end_of_execution"}"#,
    ])));
    let (events, end) = run(&interp(path), &cell("1/0", 5_000)).await;
    assert!(matches!(&events[0], run_code_event::Event::Error(e) if e.name == "ZeroDivisionError"));
    assert_eq!(end.state(), CodeState::Error);
    assert_eq!(end.error_reason, "");
    let (path, _seen) = fake(Script::Answer(chunked(&[
        r#"{"type":"error","name":"OomKilled","value":"the kernel was killed","traceback":""}"#,
        r#"{"type":"end_of_execution"}"#,
    ])));
    let (_, end) = run(&interp(path), &cell("x = bytearray(1 << 40)", 5_000)).await;
    assert_eq!(end.state(), CodeState::OomKilled);
    assert_eq!(end.error_reason, "OOM_KILLED");
}

#[tokio::test]
async fn nothing_listening_is_interpreter_unavailable() {
    let (path, _seen) = fake(Script::NoListener);
    let (events, end) = run(&interp(path), &cell("1", 5_000)).await;
    assert!(events.is_empty());
    assert_eq!(end.state(), CodeState::Failed);
    assert_eq!(end.error_reason, "INTERPRETER_UNAVAILABLE");
    assert!(
        end.error_message.contains("nothing listens"),
        "{}",
        end.error_message
    );
    // No VMM socket at all.
    let (_, end) = run(&interp(socket_path()), &cell("1", 5_000)).await;
    assert_eq!(end.error_reason, "INTERPRETER_UNAVAILABLE");
    // The context calls say the same, as an error.
    let (path, _seen) = fake(Script::NoListener);
    let e = interp(path).list_contexts().await.unwrap_err();
    assert_eq!(e.reason(), "INTERPRETER_UNAVAILABLE", "{e}");
}

#[tokio::test]
async fn hostile_answers_end_in_structured_errors() {
    let huge = {
        let mut b = br#"{"type":"stdout","text":""#.to_vec();
        b.resize(ndjson::MAX_LINE + 10, b'a');
        b
    };
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (
            close_delimited(b"{not json\n"),
            "INTERPRETER_UNAVAILABLE",
            "malformed",
        ),
        (
            close_delimited(b"[1,2]\n"),
            "INTERPRETER_UNAVAILABLE",
            "malformed",
        ),
        (close_delimited(&huge), "OUTPUT_TOO_LARGE", "over"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\nabc".to_vec(),
            "INTERPRETER_UNAVAILABLE",
            "broke off",
        ),
        (
            close_delimited(b"{\"type\":\"stdout\",\"text\":\"x\",\"timestamp\":1}\n"),
            "INTERPRETER_UNAVAILABLE",
            "before the cell's end",
        ),
        (
            b"SSH-2.0-hello\r\n\r\n".to_vec(),
            "INTERPRETER_UNAVAILABLE",
            "HTTP",
        ),
        (
            [
                b"HTTP/1.1 200 OK\r\nX: ".to_vec(),
                vec![b'a'; 200_000],
                b"\r\n\r\n".to_vec(),
            ]
            .concat(),
            "INTERPRETER_UNAVAILABLE",
            "HTTP",
        ),
        (
            b"HTTP/1.1 500 Internal\r\nContent-Length: 4\r\n\r\nboom".to_vec(),
            "INTERPRETER_UNAVAILABLE",
            "500",
        ),
    ];
    for (answer, reason, says) in cases {
        let (path, _seen) = fake(Script::Answer(answer.clone()));
        let (_, end) = run(&interp(path), &cell("1", 10_000)).await;
        let shown = String::from_utf8_lossy(&answer[..answer.len().min(60)]).into_owned();
        assert_eq!(end.state(), CodeState::Failed, "{shown}");
        assert_eq!(end.error_reason, reason, "{shown}: {}", end.error_message);
        assert!(
            end.error_message.contains(says),
            "{shown}: {}",
            end.error_message
        );
    }
}

#[tokio::test]
async fn a_timeout_drops_the_connection_and_ends_timed_out() {
    let head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
    let line = b"{\"type\":\"stdout\",\"text\":\"tick\\n\",\"timestamp\":1}\n";
    let mut answer = head.to_vec();
    answer.extend_from_slice(format!("{:x}\r\n", line.len()).as_bytes());
    answer.extend_from_slice(line);
    answer.extend_from_slice(b"\r\n");
    let (path, mut seen) = fake(Script::AnswerAndHold(answer.clone()));
    let (events, end) = run(&interp(path), &cell("while True: pass", 300)).await;
    assert_eq!(events.len(), 1);
    assert_eq!(end.state(), CodeState::TimedOut);
    assert_eq!(end.error_reason, "EXEC_TIMEOUT");
    seen.recv().await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), seen.recv()).await;
    assert_eq!(closed.unwrap().as_deref(), Some("closed"));

    // A client that goes away closes it too.
    let (path, mut seen) = fake(Script::AnswerAndHold(answer));
    let i = interp(path);
    let (tx, mut rx) = mpsc::channel(4);
    let c = cell("while True: pass", 60_000);
    let task = tokio::spawn(async move { i.run(&c, &tx).await });
    assert!(rx.recv().await.is_some());
    drop(rx);
    let end = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(end.error_reason, "CANCELLED");
    seen.recv().await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), seen.recv()).await;
    assert_eq!(closed.unwrap().as_deref(), Some("closed"));
}

fn json_answer(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test]
async fn contexts_are_created_listed_restarted_and_removed() {
    let made = r#"{"id":"c-1","language":"python","cwd":"/home/user"}"#;
    let (path, mut seen) = fake(Script::Answer(json_answer("200 OK", made)));
    let c = interp(path).create_context("python", "/tmp").await.unwrap();
    assert_eq!((c.id.as_str(), c.cwd.as_str()), ("c-1", "/home/user"));
    let req = seen.recv().await.unwrap();
    assert!(req.starts_with("POST /contexts HTTP/1.1"), "{req}");
    assert!(
        req.ends_with(r#"{"cwd":"/tmp","language":"python"}"#),
        "{req}"
    );

    let (path, _) = fake(Script::Answer(json_answer("200 OK", &format!("[{made}]"))));
    let list = interp(path).list_contexts().await.unwrap();
    assert_eq!(list.len(), 1);

    let (path, mut seen) = fake(Script::Answer(json_answer("200 OK", made)));
    let c = interp(path).restart_context("c-1").await.unwrap();
    assert_eq!(c.id, "c-1");
    assert!(
        seen.recv()
            .await
            .unwrap()
            .starts_with("POST /contexts/c-1/restart ")
    );

    let (path, mut seen) = fake(Script::Answer(json_answer("200 OK", "")));
    interp(path).remove_context("c-1").await.unwrap();
    assert!(
        seen.recv()
            .await
            .unwrap()
            .starts_with("DELETE /contexts/c-1 ")
    );

    let (path, _) = fake(Script::Answer(json_answer(
        "404 Not Found",
        "no such context",
    )));
    let e = interp(path.clone())
        .remove_context("c-2")
        .await
        .unwrap_err();
    assert_eq!(e.reason(), "CODE_CONTEXT_NOT_FOUND");
    let mut c = cell("1", 5_000);
    c.context_id = "c-2".into();
    let (_, end) = run(&interp(path), &c).await;
    assert_eq!(end.error_reason, "CODE_CONTEXT_NOT_FOUND");

    let (path, _) = fake(Script::Answer(json_answer("400 Bad Request", SECRET)));
    let e = interp(path).create_context("r", "").await.unwrap_err();
    assert_eq!(e.reason(), "INVALID_ARGUMENT");
    assert!(!e.to_string().contains(SECRET), "{e}");

    let (path, _) = fake(Script::Answer(json_answer("200 OK", "{garbage")));
    let e = interp(path).list_contexts().await.unwrap_err();
    assert_eq!(e.reason(), "INTERPRETER_UNAVAILABLE");

    for bad in ["", "../x", "a/b", "..", &"x".repeat(129)] {
        let e = interp(socket_path()).remove_context(bad).await.unwrap_err();
        assert_eq!(e.reason(), "INVALID_ARGUMENT", "{bad:?}");
    }
}

#[test]
fn a_cell_names_a_language_or_a_context_and_its_timeout_is_bounded() {
    let mut i = interp(socket_path());
    i.max_timeout_ms = 1_000;
    let req = |language: &str, context: &str, timeout_ms| RunCodeRequest {
        language: language.into(),
        context_id: context.into(),
        timeout_ms,
        ..Default::default()
    };
    assert!(i.cell(req("python", "c-1", 0)).is_err());
    assert!(i.cell(req("", "a/b", 0)).is_err());
    assert_eq!(
        i.cell(req("", "", 0)).unwrap().timeout,
        Duration::from_secs(1)
    );
    assert_eq!(
        i.cell(req("bash", "", 10)).unwrap().timeout,
        Duration::from_millis(10)
    );
    i.max_timeout_ms = u64::MAX;
    assert_eq!(
        i.cell(req("", "c", 0)).unwrap().timeout,
        Duration::from_secs(300)
    );
}

#[tokio::test]
async fn a_secret_printed_in_two_pieces_is_still_redacted_and_order_is_kept() {
    let (a, b) = SECRET.split_at(7);
    let (path, _seen) = fake(Script::Answer(chunked(&[
        &format!(r#"{{"type":"stdout","text":"x{a}","timestamp":1}}"#),
        &format!(r#"{{"type":"stdout","text":"{b}y\n","timestamp":2}}"#),
        &format!(r#"{{"type":"stdout","text":"tail {a}","timestamp":3}}"#),
        r#"{"type":"result","text":"1","is_main_result":true}"#,
        r#"{"type":"end_of_execution"}"#,
    ])));
    let (events, end) = run(&interp(path), &cell("print()", 5_000)).await;
    assert_eq!(end.state(), CodeState::Ok);
    let mut stdout = String::new();
    let mut result_at = None;
    for (n, e) in events.iter().enumerate() {
        match e {
            run_code_event::Event::Stdout(o) => {
                assert!(result_at.is_none(), "output after the result: {events:?}");
                assert!(!o.text.is_empty());
                stdout += &o.text;
            }
            run_code_event::Event::Result(_) => result_at = Some(n),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(stdout, format!("x[REDACTED:API_KEY]y\ntail {a}"));
    assert!(result_at.is_some());
}
