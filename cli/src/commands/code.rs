//! `run-code` and `code-context create|ls|restart|rm`: the sandbox's code interpreter.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use airlock_api::v1::{
    CodeContext, CodeEnd, CodeResult, CodeState, CreateCodeContextRequest, ListCodeContextsRequest,
    RemoveCodeContextRequest, RestartCodeContextRequest, RunCodeEvent, RunCodeRequest,
    run_code_event,
};
use base64::Engine as _;
use serde_json::{Value, json};

use super::{Ctx, fail};
use crate::args::{CodeContextCommand, RunCodeArgs};
use crate::output::print_json;
use crate::request::{Read, read_local};

/// The MIME types saved to files, with their file name's extension and whether the daemon
/// sends them base64 (as Jupyter does) rather than as text.
pub const SAVED: [(&str, &str, bool); 4] = [
    ("image/png", "png", true),
    ("image/jpeg", "jpg", true),
    ("image/svg+xml", "svg", false),
    ("application/pdf", "pdf", true),
];

/// The request of `run-code`; the source is read from FILE (`-`: our stdin).
pub fn run_code_request(args: &RunCodeArgs, read: Read) -> Result<RunCodeRequest, String> {
    let code = read(&args.file)?;
    let code =
        String::from_utf8(code).map_err(|_| format!("{}: not UTF-8 text", args.file.display()))?;
    Ok(RunCodeRequest {
        sandbox_id: args.id.clone(),
        code,
        language: args.language.clone().unwrap_or_default(),
        context_id: args.context.clone().unwrap_or_default(),
        env: args.env.iter().cloned().collect(),
        timeout_ms: args.timeout.map_or(0, |s| s.saturating_mul(1000)),
    })
}

/// `run-code`: streams the cell's events; exits as the help says (0, 1, 124, 137).
pub async fn run_code(ctx: &mut Ctx, args: &RunCodeArgs) -> Result<u8, String> {
    let req = run_code_request(args, &read_local)?;
    let mut stream = ctx.client.run_code(req).await.map_err(fail)?.into_inner();
    let mut results = 0usize;
    let mut raised = false;
    while let Some(ev) = stream.message().await.map_err(fail)? {
        if ctx.json
            && let Some(v) = event_json(&ev)
        {
            let mut out = std::io::stdout();
            let _ = writeln!(out, "{v}");
            let _ = out.flush();
        }
        match ev.event {
            Some(run_code_event::Event::Stdout(o)) if !ctx.json => {
                // A closed stdout (`| head`) must not end the stream before the end.
                let mut out = std::io::stdout();
                let _ = out.write_all(o.text.as_bytes());
                let _ = out.flush();
            }
            Some(run_code_event::Event::Stderr(o)) if !ctx.json => {
                let _ = std::io::stderr().write_all(o.text.as_bytes());
            }
            Some(run_code_event::Event::Result(r)) => {
                results += 1;
                if !ctx.json {
                    print_result(results, &r, args.out_dir.as_deref())?;
                }
            }
            Some(run_code_event::Event::Error(e)) => {
                raised = true;
                if !ctx.json {
                    eprint!("{}", error_text(&e.name, &e.value, &e.traceback));
                }
            }
            Some(run_code_event::Event::End(end)) => {
                if !ctx.json && !end.error_reason.is_empty() {
                    eprintln!("airlock: {}: {}", end.error_reason, end.error_message);
                }
                return Ok(end_exit_code(&end, raised));
            }
            _ => {}
        }
    }
    Err("the stream ended without an end".into())
}

/// Prints result `n`'s text and saves its files (in `out_dir`, else the current directory),
/// printing their paths.
fn print_result(n: usize, r: &CodeResult, out_dir: Option<&Path>) -> Result<(), String> {
    let files = result_files(n, r)?;
    let mut out = String::new();
    if let Some(t) = result_text(r) {
        out.push_str(t);
        if !t.ends_with('\n') {
            out.push('\n');
        }
    }
    if let Some(dir) = out_dir.filter(|_| !files.is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    for (name, bytes) in files {
        let path = out_dir.map_or_else(|| PathBuf::from(&name), |d| d.join(&name));
        std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = writeln!(out, "{}", path.display());
    }
    if out.is_empty() {
        let mut kinds: Vec<&str> = r.data.keys().map(String::as_str).collect();
        kinds.sort_unstable();
        eprintln!(
            "airlock: result {n} has no text or file ({}); --json shows it",
            kinds.join(", ")
        );
    }
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(out.as_bytes());
    let _ = stdout.flush();
    Ok(())
}

/// The text a result prints: its text/plain, else its text/markdown.
pub fn result_text(r: &CodeResult) -> Option<&str> {
    ["text/plain", "text/markdown"]
        .iter()
        .find_map(|k| r.data.get(*k))
        .map(String::as_str)
        .filter(|t| !t.is_empty())
}

/// The files result `n` is saved as: `result-N.EXT` and their bytes (base64 decoded).
pub fn result_files(n: usize, r: &CodeResult) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut files = Vec::new();
    for (mime, ext, base64) in SAVED {
        let Some(data) = r.data.get(mime) else {
            continue;
        };
        let bytes = if base64 {
            // Jupyter may wrap base64 in lines.
            let compact: String = data.split_whitespace().collect();
            base64::engine::general_purpose::STANDARD
                .decode(compact)
                .map_err(|e| format!("result {n}: its {mime} is not base64: {e}"))?
        } else {
            data.clone().into_bytes()
        };
        files.push((format!("result-{n}.{ext}"), bytes));
    }
    Ok(files)
}

/// What an error prints on stderr: the traceback, then `NAME: VALUE`.
pub fn error_text(name: &str, value: &str, traceback: &str) -> String {
    let mut s = String::new();
    if !traceback.is_empty() {
        s.push_str(traceback);
        if !traceback.ends_with('\n') {
            s.push('\n');
        }
    }
    let _ = writeln!(s, "{name}: {value}");
    s
}

/// Our exit code for a cell's end: 0 (ran, raised nothing); 124 its timeout; 137 its kernel
/// killed by the memory limit (as `exec`'s SIGKILL); 1 an exception or any other failure.
pub fn end_exit_code(end: &CodeEnd, raised: bool) -> u8 {
    match CodeState::try_from(end.state) {
        Ok(CodeState::Ok) if !raised => 0,
        Ok(CodeState::TimedOut) => 124,
        Ok(CodeState::OomKilled) => 137,
        _ => 1,
    }
}

/// The lowercase name of a `CodeState`.
pub fn code_state_name(s: i32) -> &'static str {
    match CodeState::try_from(s) {
        Ok(CodeState::Ok) => "ok",
        Ok(CodeState::Error) => "error",
        Ok(CodeState::TimedOut) => "timed_out",
        Ok(CodeState::OomKilled) => "oom_killed",
        Ok(CodeState::Failed) => "failed",
        _ => "unspecified",
    }
}

/// A JSON text of the API (chart, extra) as a value: empty is null, bad JSON stays a string.
fn json_text(s: &str) -> Value {
    if s.is_empty() {
        return Value::Null;
    }
    serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_owned()))
}

/// One `--json` line of an event (None for an empty event).
pub fn event_json(ev: &RunCodeEvent) -> Option<Value> {
    Some(match ev.event.as_ref()? {
        run_code_event::Event::Stdout(o) => {
            json!({"type": "stdout", "text": o.text, "timestamp_unix_ns": o.timestamp_unix_ns})
        }
        run_code_event::Event::Stderr(o) => {
            json!({"type": "stderr", "text": o.text, "timestamp_unix_ns": o.timestamp_unix_ns})
        }
        run_code_event::Event::Result(r) => json!({
            "type": "result",
            "data": r.data,
            "is_main_result": r.is_main_result,
            "chart": json_text(&r.chart),
            "extra": json_text(&r.extra),
        }),
        run_code_event::Event::Error(e) => json!({
            "type": "error",
            "name": e.name,
            "value": e.value,
            "traceback": e.traceback,
        }),
        run_code_event::Event::End(e) => json!({
            "type": "end",
            "state": code_state_name(e.state),
            "execution_count": e.execution_count,
            "context_id": e.context_id,
            "error_reason": e.error_reason,
            "error_message": e.error_message,
            "duration_ms": e.duration_ms,
        }),
    })
}

/// A context's JSON record.
pub fn context_json(c: &CodeContext) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

/// The text table of contexts.
pub fn context_table(list: &[CodeContext]) -> String {
    let mut out = format!("{:<24} {:<12} {}\n", "CONTEXT", "LANGUAGE", "CWD");
    for c in list {
        let _ = writeln!(out, "{:<24} {:<12} {}", c.id, c.language, c.cwd);
    }
    out
}

/// Runs a `code-context` command.
pub async fn context(ctx: &mut Ctx, command: CodeContextCommand) -> Result<u8, String> {
    match command {
        CodeContextCommand::Create(a) => {
            let req = CreateCodeContextRequest {
                sandbox_id: a.id,
                language: a.language.unwrap_or_default(),
                cwd: a.cwd.unwrap_or_default(),
            };
            let c = ctx
                .client
                .create_code_context(req)
                .await
                .map_err(fail)?
                .into_inner();
            if ctx.json {
                print_json(&context_json(&c));
            } else {
                println!("{}", c.id);
            }
        }
        CodeContextCommand::Ls(a) => {
            let req = ListCodeContextsRequest { sandbox_id: a.id };
            let list = ctx
                .client
                .list_code_contexts(req)
                .await
                .map_err(fail)?
                .into_inner()
                .contexts;
            if ctx.json {
                print_json(&Value::Array(list.iter().map(context_json).collect()));
            } else {
                print!("{}", context_table(&list));
            }
        }
        CodeContextCommand::Restart(a) => {
            let req = RestartCodeContextRequest {
                sandbox_id: a.id,
                context_id: a.context,
            };
            let c = ctx
                .client
                .restart_code_context(req)
                .await
                .map_err(fail)?
                .into_inner();
            if ctx.json {
                print_json(&context_json(&c));
            }
        }
        CodeContextCommand::Rm(a) => {
            let req = RemoveCodeContextRequest {
                sandbox_id: a.id,
                context_id: a.context.clone(),
            };
            ctx.client.remove_code_context(req).await.map_err(fail)?;
            if ctx.json {
                print_json(&json!({"context_id": a.context, "removed": true}));
            }
        }
    }
    Ok(0)
}
