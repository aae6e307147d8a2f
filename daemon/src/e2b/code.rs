//! The code interpreter's routes, as `e2b_code_interpreter` and `@e2b/code-interpreter` call
//! them on port 49999 (`E2b-Sandbox-Port: 49999`, or the host `49999-<id>.<domain>`): `POST
//! /execute` (its events streamed back as E2B's NDJSON), `POST`/`GET /contexts`, `POST
//! /contexts/{id}/restart` and `DELETE /contexts/{id}`. They run through the daemon's own
//! interpreter client (`crate::interp`), so redaction, bounds and the `code.run` audit event
//! are RunCode's; the sandbox is authorised as for envd (its access token).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::run_code_event::Event;
use airlock_api::v1::{CodeEnd, CodeResult, CodeState, RunCodeEvent, RunCodeRequest};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{delete, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Gateway, Target, api_error, json as json_response, json_error};
use crate::interp::{Interp, ndjson::MIME};

/// The port E2B's SDKs address the code interpreter on.
pub const PORT: &str = "49999";

/// How long `/execute` waits for an early refusal (an unknown context, a bad language, no
/// interpreter) before it answers 200 and streams.
const REFUSAL_WINDOW: Duration = Duration::from_secs(2);

pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/execute", post(execute))
        .route("/contexts", post(create_context).get(list_contexts))
        .route("/contexts/{id}/restart", post(restart_context))
        .route("/contexts/{id}", delete(remove_context))
}

/// Whether a request is for the interpreter's port: its `E2b-Sandbox-Port`, or its host.
pub fn is_for_interpreter(headers: &HeaderMap, domain: &str) -> bool {
    if let Some(port) = super::header_str(headers, "e2b-sandbox-port") {
        return port.trim() == PORT;
    }
    super::header_str(headers, "host")
        .and_then(|h| super::port_of_host(h, domain))
        .is_some_and(|p| p == PORT)
}

#[derive(Debug, Deserialize)]
struct ExecuteBody {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<HashMap<String, String>>,
}

fn interp(gw: &Gateway, t: &Target) -> Result<Interp, Response> {
    Interp::of(&t.rt, gw.daemon.cfg.max_exec_timeout_ms)
        .map_err(|e| api_error(t.tenant(), &t.rt.id, "e2b.RunCode", &e))
}

async fn execute(
    State(gw): State<Arc<Gateway>>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    let b: ExecuteBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &format!("request body: {e}")),
    };
    let interp = match interp(&gw, &t) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let req = RunCodeRequest {
        sandbox_id: t.rt.id.clone(),
        code: b.code,
        language: b.language.unwrap_or_default(),
        context_id: b.context_id.unwrap_or_default(),
        env: b.env_vars.unwrap_or_default(),
        timeout_ms: 0,
    };
    let cell = match interp.cell(req) {
        Ok(c) => c,
        Err(e) => return api_error(t.tenant(), &t.rt.id, "e2b.RunCode", &e),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(32);
    tokio::spawn(async move { interp.run(&cell, &tx).await });
    let first = match tokio::time::timeout(REFUSAL_WINDOW, rx.recv()).await {
        Ok(Some(e)) => match refusal(&e) {
            Some(r) => return r,
            None => Some(e),
        },
        Ok(None) => return json_error(StatusCode::BAD_GATEWAY, "the cell ended without an end"),
        Err(_) => None,
    };
    let mut r = Response::new(Body::from_stream(ndjson(first, rx, KEEPALIVE)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

/// How often a quiet cell's answer carries a keepalive line: the gateway's connections are cut
/// after `idle_timeout_ms` (120 s by default) without a byte, and a cell may compute for longer
/// without output (seen: a cell filling the guest's memory was cut after 2 minutes).
const KEEPALIVE: Duration = Duration::from_secs(30);

/// A line E2B's SDKs skip (they act on the types they know and ignore the others).
const KEEPALIVE_LINE: &[u8] = b"{\"type\":\"keepalive\"}\n";

/// A cell's events (`first`, then what `rx` brings) as E2B's NDJSON, with a keepalive line
/// after each `every` without one.
fn ndjson(
    first: Option<RunCodeEvent>,
    rx: tokio::sync::mpsc::Receiver<RunCodeEvent>,
    every: Duration,
) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
    futures_util::stream::unfold(
        (first, rx, false),
        move |(mut pending, mut rx, mut saw_error)| async move {
            let ev = match pending.take() {
                Some(e) => e,
                None => match tokio::time::timeout(every, rx.recv()).await {
                    Ok(e) => e?,
                    Err(_) => {
                        let line = Bytes::from_static(KEEPALIVE_LINE);
                        return Some((Ok(line), (None, rx, saw_error)));
                    }
                },
            };
            let out = e2b_lines(&ev, &mut saw_error);
            Some((Ok(Bytes::from(out)), (None, rx, saw_error)))
        },
    )
}

/// The HTTP error a cell's first event stands for when it is an end refused before any
/// output (as E2B's server answers those: not streamed).
fn refusal(e: &RunCodeEvent) -> Option<Response> {
    let Some(Event::End(end)) = &e.event else {
        return None;
    };
    let status = match end.error_reason.as_str() {
        "CODE_CONTEXT_NOT_FOUND" => StatusCode::NOT_FOUND,
        "INVALID_ARGUMENT" => StatusCode::BAD_REQUEST,
        "INTERPRETER_UNAVAILABLE" => StatusCode::BAD_GATEWAY,
        _ => return None,
    };
    Some(json_error(status, &end.error_message))
}

/// An event as E2B's NDJSON lines; `saw_error` notes an `error` line (an end that failed
/// otherwise adds one, so that the SDK's `execution.error` says why).
pub fn e2b_lines(ev: &RunCodeEvent, saw_error: &mut bool) -> Vec<u8> {
    let values: Vec<Value> = match &ev.event {
        Some(Event::Stdout(o)) => vec![output("stdout", &o.text, o.timestamp_unix_ns)],
        Some(Event::Stderr(o)) => vec![output("stderr", &o.text, o.timestamp_unix_ns)],
        Some(Event::Result(r)) => vec![result(r)],
        Some(Event::Error(e)) => {
            *saw_error = true;
            vec![json!({"type": "error", "name": e.name, "value": e.value,
                        "traceback": e.traceback})]
        }
        Some(Event::End(end)) => end_lines(end, *saw_error),
        None => Vec::new(),
    };
    let mut out = Vec::new();
    for v in values {
        out.extend_from_slice(v.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

fn output(kind: &str, text: &str, timestamp: i64) -> Value {
    json!({"type": kind, "text": text, "timestamp": timestamp})
}

/// A JSON text back as its value (a string when it is none).
fn json_value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

fn result(r: &CodeResult) -> Value {
    let mut v = json!({"type": "result", "is_main_result": r.is_main_result});
    for (key, mime) in MIME {
        if let Some(data) = r.data.get(*mime) {
            v[*key] = match *key {
                "json" => json_value(data),
                _ => Value::String(data.clone()),
            };
        }
    }
    if !r.chart.is_empty() {
        v["chart"] = json_value(&r.chart);
    }
    if !r.extra.is_empty() {
        v["extra"] = json_value(&r.extra);
    }
    v
}

fn end_lines(end: &CodeEnd, saw_error: bool) -> Vec<Value> {
    let mut lines = Vec::new();
    let failed = matches!(end.state(), CodeState::TimedOut | CodeState::Failed);
    if failed && !saw_error {
        let name = match end.state() {
            CodeState::TimedOut => "TimeoutError",
            _ => "InterpreterError",
        };
        lines.push(json!({"type": "error", "name": name,
            "value": format!("{}: {}", end.error_reason, end.error_message), "traceback": ""}));
    }
    if end.execution_count > 0 {
        lines.push(json!({"type": "number_of_executions",
                          "execution_count": end.execution_count}));
    }
    lines.push(json!({"type": "end_of_execution"}));
    lines
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct NewContext {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(
    State(gw): State<Arc<Gateway>>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    let n: NewContext = match body.is_empty() {
        true => NewContext::default(),
        false => match serde_json::from_slice(&body) {
            Ok(n) => n,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, &format!("request body: {e}")),
        },
    };
    let made = match interp(&gw, &t) {
        Ok(i) => {
            let (language, cwd) = (n.language.unwrap_or_default(), n.cwd.unwrap_or_default());
            i.create_context(&language, &cwd).await
        }
        Err(r) => return r,
    };
    match made {
        Ok(c) => json_response(StatusCode::OK, &context_json(&c)),
        Err(e) => api_error(t.tenant(), &t.rt.id, "e2b.CreateCodeContext", &e),
    }
}

fn context_json(c: &airlock_api::v1::CodeContext) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

async fn list_contexts(
    State(gw): State<Arc<Gateway>>,
    Extension(t): Extension<Target>,
) -> Response {
    let listed = match interp(&gw, &t) {
        Ok(i) => i.list_contexts().await,
        Err(r) => return r,
    };
    match listed {
        Ok(list) => {
            let list: Vec<Value> = list.iter().map(context_json).collect();
            json_response(StatusCode::OK, &list)
        }
        Err(e) => api_error(t.tenant(), &t.rt.id, "e2b.ListCodeContexts", &e),
    }
}

async fn restart_context(
    State(gw): State<Arc<Gateway>>,
    Extension(t): Extension<Target>,
    Path(id): Path<String>,
) -> Response {
    let restarted = match interp(&gw, &t) {
        Ok(i) => i.restart_context(&id).await,
        Err(r) => return r,
    };
    match restarted {
        Ok(c) => json_response(StatusCode::OK, &context_json(&c)),
        Err(e) => api_error(t.tenant(), &t.rt.id, "e2b.RestartCodeContext", &e),
    }
}

async fn remove_context(
    State(gw): State<Arc<Gateway>>,
    Extension(t): Extension<Target>,
    Path(id): Path<String>,
) -> Response {
    let removed = match interp(&gw, &t) {
        Ok(i) => i.remove_context(&id).await,
        Err(r) => return r,
    };
    match removed {
        Ok(()) => json_response(StatusCode::OK, &json!({})),
        Err(e) => api_error(t.tenant(), &t.rt.id, "e2b.RemoveCodeContext", &e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::v1::{CodeError, CodeOutput};

    fn lines(events: Vec<Event>) -> Vec<Value> {
        let mut saw = false;
        let mut out = Vec::new();
        for e in events {
            out.extend(e2b_lines(&RunCodeEvent { event: Some(e) }, &mut saw));
        }
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// A quiet cell's stream carries keepalive lines until its next event, then ends with
    /// the cell.
    #[tokio::test]
    async fn a_quiet_cell_keeps_its_stream_alive() {
        use futures_util::StreamExt as _;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut s = Box::pin(ndjson(None, rx, Duration::from_millis(20)));
        let first = s.next().await.unwrap().unwrap();
        assert_eq!(&first[..], KEEPALIVE_LINE);
        let line: Value = serde_json::from_slice(&first).unwrap();
        assert_eq!(line["type"], "keepalive");
        tx.send(RunCodeEvent {
            event: Some(Event::Stdout(CodeOutput {
                text: "late\n".into(),
                timestamp_unix_ns: 5,
            })),
        })
        .await
        .unwrap();
        drop(tx);
        let mut rest = Vec::new();
        while let Some(chunk) = s.next().await {
            rest.extend_from_slice(&chunk.unwrap());
        }
        let text = String::from_utf8(rest).unwrap();
        assert!(text.contains("\"late\\n\""), "{text}");
    }

    #[test]
    fn events_become_e2bs_lines() {
        let mut data = HashMap::new();
        data.insert("text/plain".to_owned(), "1".to_owned());
        data.insert("image/png".to_owned(), "iVBO".to_owned());
        data.insert("application/json".to_owned(), r#"{"a":1}"#.to_owned());
        let got = lines(vec![
            Event::Stdout(CodeOutput {
                text: "hi\n".into(),
                timestamp_unix_ns: 7,
            }),
            Event::Result(CodeResult {
                data,
                is_main_result: true,
                chart: r#"{"type":"line"}"#.into(),
                extra: String::new(),
            }),
            Event::End(CodeEnd {
                state: CodeState::Ok as i32,
                execution_count: 2,
                ..Default::default()
            }),
        ]);
        assert_eq!(
            got[0],
            json!({"type": "stdout", "text": "hi\n", "timestamp": 7})
        );
        assert_eq!(
            got[1],
            json!({"type": "result", "text": "1", "png": "iVBO", "json": {"a": 1},
                   "chart": {"type": "line"}, "is_main_result": true})
        );
        assert_eq!(
            got[2],
            json!({"type": "number_of_executions", "execution_count": 2})
        );
        assert_eq!(got[3], json!({"type": "end_of_execution"}));
    }

    #[test]
    fn a_failed_end_says_why_once() {
        let timed_out = CodeEnd {
            state: CodeState::TimedOut as i32,
            error_reason: "EXEC_TIMEOUT".into(),
            ..Default::default()
        };
        let got = lines(vec![Event::End(timed_out)]);
        assert_eq!(got[0]["name"], "TimeoutError");
        assert_eq!(got[1]["type"], "end_of_execution");
        let oom = CodeEnd {
            state: CodeState::OomKilled as i32,
            ..Default::default()
        };
        let got = lines(vec![
            Event::Error(CodeError {
                name: "OomKilled".into(),
                ..Default::default()
            }),
            Event::End(oom),
        ]);
        assert_eq!(got.len(), 2, "{got:?}");
    }

    #[test]
    fn the_interpreters_port_is_named_by_header_or_host() {
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, HeaderValue::from_static(v));
            }
            m
        };
        let d = "e2b.test";
        assert!(is_for_interpreter(&h(&[("e2b-sandbox-port", "49999")]), d));
        assert!(!is_for_interpreter(&h(&[("e2b-sandbox-port", "49983")]), d));
        assert!(is_for_interpreter(
            &h(&[("host", "49999-sb-1.e2b.test")]),
            d
        ));
        assert!(!is_for_interpreter(
            &h(&[("host", "49983-sb-1.e2b.test")]),
            d
        ));
        assert!(!is_for_interpreter(&h(&[("host", "localhost:3000")]), d));
    }
}
