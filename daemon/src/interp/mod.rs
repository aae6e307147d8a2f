//! The code interpreter (RunCode and the code contexts, for gRPC and the E2B gateway alike):
//! the guest's interpreter server (vsock port [`PORT`], E2B's code-interpreter wire format over
//! HTTP/1.1, see `docs/interpreter.md`) reached through the sandbox's hybrid-vsock socket
//! ([`guest`]), its NDJSON answer read with bounds ([`ndjson`]) and mapped to
//! [`RunCodeEvent`]s, every text and result redacted of the sandbox's secrets, one `code.run`
//! audit event per cell. A cell's timeout or its client going away drops the connection,
//! which the guest server takes as an interrupt (the context survives).

pub mod guest;
pub mod ndjson;
mod streams;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{
    CodeContext, CodeEnd, CodeState, RunCodeEvent, RunCodeRequest, run_code_event,
};
use hyper::{Method, StatusCode};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use crate::error::{ApiError, ApiResult};
use crate::sandbox::SandboxRt;
use crate::secrets::redact::Patterns;
use guest::GuestError;
use ndjson::{Line, Lines, NdjsonError};

/// The guest's vsock port the interpreter listens on (E2B's Jupyter port).
pub const PORT: u32 = 49999;

/// A cell's timeout when its request names none.
pub const DEFAULT_TIMEOUT_MS: u64 = 300_000;

/// How long a connection to the interpreter may take.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);

/// How long a context call (create, list, restart, remove) may take in all.
const CONTEXT_CALL: Duration = Duration::from_secs(60);

/// The largest answer of a context call.
const MAX_CONTEXT_ANSWER: usize = 1 << 20;

/// The interpreter of one running sandbox.
#[derive(Clone, Debug)]
pub struct Interp {
    pub sandbox_id: String,
    pub tenant: String,
    vsock: PathBuf,
    port: u32,
    patterns: Arc<Patterns>,
    max_timeout_ms: u64,
    /// The sandbox's environment (set at its create): every cell's, under the cell's own
    /// entries, as an execution's is.
    pub env: HashMap<String, String>,
    /// The sandbox, whose activity each call renews and whose secrets' variables each cell
    /// gets (none in unit tests).
    rt: Option<Arc<SandboxRt>>,
}

/// A cell to run, checked.
#[derive(Clone, Debug)]
pub struct Cell {
    pub code: String,
    pub language: String,
    pub context_id: String,
    pub env: HashMap<String, String>,
    pub timeout: Duration,
}

/// Why a cell's answer stopped before its end.
#[derive(Debug)]
enum Stop {
    Guest(GuestError),
    Ndjson(NdjsonError),
    /// The interpreter refused the cell (an unknown context, a bad language).
    Refused(ApiError),
    /// The answer ended without `end_of_execution`.
    NoEnd,
    ClientGone,
    TimedOut,
}

impl From<GuestError> for Stop {
    fn from(e: GuestError) -> Self {
        Self::Guest(e)
    }
}

impl From<NdjsonError> for Stop {
    fn from(e: NdjsonError) -> Self {
        Self::Ndjson(e)
    }
}

/// What a cell's answer said beside its events, and its streams' redaction.
#[derive(Debug)]
struct Seen {
    execution_count: u32,
    error: Option<String>,
    streams: streams::Streams,
}

impl Seen {
    fn new(patterns: &Arc<Patterns>) -> Self {
        Self {
            execution_count: 0,
            error: None,
            streams: streams::Streams::new(patterns),
        }
    }
}

/// A context as the interpreter answers it.
#[derive(Debug, Deserialize)]
struct GuestContext {
    #[serde(default)]
    id: String,
    #[serde(default)]
    language: String,
    #[serde(default)]
    cwd: String,
}

impl From<GuestContext> for CodeContext {
    fn from(c: GuestContext) -> Self {
        Self {
            id: c.id,
            language: c.language,
            cwd: c.cwd,
        }
    }
}

impl Interp {
    /// The interpreter of running sandbox `rt`, cells bounded by `max_timeout_ms`.
    pub fn of(rt: &Arc<SandboxRt>, max_timeout_ms: u64) -> ApiResult<Self> {
        let vmm = rt
            .vmm()
            .ok_or_else(|| ApiError::Internal(format!("sandbox {} has no VMM", rt.id)))?;
        let mut i = Self::at(&rt.id, &rt.tenant, vmm.vsock, rt.secrets.patterns());
        i.max_timeout_ms = max_timeout_ms;
        i.env = rt.env.clone();
        i.rt = Some(rt.clone());
        Ok(i)
    }

    /// The interpreter behind the hybrid-vsock socket `vsock`.
    pub fn at(sandbox_id: &str, tenant: &str, vsock: PathBuf, patterns: Arc<Patterns>) -> Self {
        Self {
            sandbox_id: sandbox_id.to_owned(),
            tenant: tenant.to_owned(),
            vsock,
            port: PORT,
            patterns,
            max_timeout_ms: u64::MAX,
            env: HashMap::new(),
            rt: None,
        }
    }

    fn touch(&self) {
        if let Some(rt) = &self.rt {
            rt.touch();
        }
    }

    /// `req` checked as a cell: not both a language and a context; its timeout resolved.
    pub fn cell(&self, req: RunCodeRequest) -> ApiResult<Cell> {
        if !req.language.is_empty() && !req.context_id.is_empty() {
            return Err(ApiError::InvalidArgument(
                "a cell names a language or a context, not both (a context has its language)"
                    .into(),
            ));
        }
        if !req.context_id.is_empty() {
            check_context_id(&req.context_id)?;
        }
        let ms = match req.timeout_ms {
            0 => DEFAULT_TIMEOUT_MS.min(self.max_timeout_ms),
            t => t.min(self.max_timeout_ms),
        };
        Ok(Cell {
            code: req.code,
            language: req.language,
            context_id: req.context_id,
            env: req.env,
            timeout: Duration::from_millis(ms.max(1)),
        })
    }

    /// Runs `cell`: its events to `tx`, then its `end` (also returned), audited. Its timeout
    /// or `tx`'s receiver going away drops the connection (the guest interrupts the cell).
    pub async fn run(&self, cell: &Cell, tx: &mpsc::Sender<RunCodeEvent>) -> CodeEnd {
        let started = Instant::now();
        self.touch();
        let mut seen = Seen::new(&self.patterns);
        // A running cell is activity: the sandbox's idle TTL does not end it mid-cell.
        let keepalive = async {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.touch();
            }
        };
        let stopped = tokio::select! {
            r = tokio::time::timeout(cell.timeout, self.stream(cell, tx, &mut seen)) => {
                r.unwrap_or(Err(Stop::TimedOut))
            }
            _ = tx.closed() => Err(Stop::ClientGone),
            () = keepalive => Err(Stop::ClientGone),
        };
        self.touch();
        let stopped = match (stopped, flush(&mut seen, tx).await) {
            (Ok(()), Err(gone)) => Err(gone),
            (stopped, _) => stopped,
        };
        let mut end = self.end_of(stopped, &seen, cell);
        end.duration_ms = started.elapsed().as_millis() as u64;
        self.audit(cell, &end);
        let _ = tx
            .send(RunCodeEvent {
                event: Some(run_code_event::Event::End(end.clone())),
            })
            .await;
        end
    }

    /// A cell's environment: the sandbox's, its secrets' variables over it (read now: a
    /// secret's TTL or removal counts), the cell's own entries over both (checked as an
    /// execution's are). The kernel keeps it for this cell only.
    fn env_of(&self, cell: &Cell) -> ApiResult<HashMap<String, String>> {
        let mut env = self.env.clone();
        if let Some(rt) = &self.rt {
            env.extend(rt.secrets.env().0);
        }
        env.extend(cell.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        crate::limits::check_env(&env)?;
        Ok(env)
    }

    /// The cell's answer, streamed to `tx` until its end.
    async fn stream(
        &self,
        cell: &Cell,
        tx: &mpsc::Sender<RunCodeEvent>,
        seen: &mut Seen,
    ) -> Result<(), Stop> {
        let mut body = json!({ "code": cell.code });
        if !cell.context_id.is_empty() {
            body["context_id"] = cell.context_id.clone().into();
        }
        if !cell.language.is_empty() {
            body["language"] = cell.language.clone().into();
        }
        let env = self.env_of(cell).map_err(Stop::Refused)?;
        if !env.is_empty() {
            body["env_vars"] = json!(env);
        }
        let mut answer = self.request(Method::POST, "/execute", Some(body)).await?;
        if !answer.status.is_success() {
            let status = answer.status;
            let text = answer
                .read_all(MAX_CONTEXT_ANSWER)
                .await
                .unwrap_or_default();
            return Err(Stop::Refused(self.refusal(status, &text, &cell.context_id)));
        }
        let mut lines = Lines::new(ndjson::MAX_LINE, ndjson::MAX_CELL_BYTES);
        loop {
            let chunk = answer.chunk().await?;
            let batch = match &chunk {
                Some(data) => lines.push(data)?,
                None => lines.finish().into_iter().collect(),
            };
            for line in batch {
                if self.line(&line, tx, seen).await? {
                    return Ok(());
                }
            }
            if chunk.is_none() {
                return Err(Stop::NoEnd);
            }
        }
    }

    /// Handles one line of a cell's answer; whether it was the end.
    async fn line(
        &self,
        line: &[u8],
        tx: &mpsc::Sender<RunCodeEvent>,
        seen: &mut Seen,
    ) -> Result<bool, Stop> {
        match ndjson::parse(line)? {
            Line::Event(mut e) => {
                match &mut e.event {
                    Some(run_code_event::Event::Stdout(o)) => {
                        o.text = seen.streams.push(0, &o.text)
                    }
                    Some(run_code_event::Event::Stderr(o)) => {
                        o.text = seen.streams.push(1, &o.text)
                    }
                    other => {
                        if let Some(run_code_event::Event::Error(err)) = other {
                            seen.error = Some(err.name.clone());
                        }
                        // What the streams hold back comes first.
                        flush(seen, tx).await?;
                        self.redact(&mut e);
                    }
                }
                let empty = matches!(&e.event,
                    Some(run_code_event::Event::Stdout(o) | run_code_event::Event::Stderr(o))
                        if o.text.is_empty());
                if !empty {
                    tx.send(e).await.map_err(|_| Stop::ClientGone)?;
                }
            }
            Line::Count(n) => seen.execution_count = n,
            Line::End => return Ok(true),
            Line::Other => {}
        }
        Ok(false)
    }

    /// `e` with the sandbox's secret values redacted from every text.
    fn redact(&self, e: &mut RunCodeEvent) {
        let p = &self.patterns;
        let r = |s: &mut String| {
            if let std::borrow::Cow::Owned(o) = p.redact_str(s) {
                *s = o;
            }
        };
        match &mut e.event {
            Some(run_code_event::Event::Stdout(o) | run_code_event::Event::Stderr(o)) => {
                r(&mut o.text);
            }
            Some(run_code_event::Event::Result(res)) => {
                res.data.values_mut().for_each(r);
                r(&mut res.chart);
                r(&mut res.extra);
            }
            Some(run_code_event::Event::Error(err)) => {
                r(&mut err.name);
                r(&mut err.value);
                r(&mut err.traceback);
            }
            Some(run_code_event::Event::End(end)) => r(&mut end.error_message),
            None => {}
        }
    }

    /// The cell's `end`, from how its answer stopped.
    fn end_of(&self, stopped: Result<(), Stop>, seen: &Seen, cell: &Cell) -> CodeEnd {
        let (state, reason, message) = match stopped {
            Ok(()) => match seen.error.as_deref() {
                None => (CodeState::Ok, "", String::new()),
                Some("OomKilled") => (
                    CodeState::OomKilled,
                    "OOM_KILLED",
                    "the kernel was killed by the sandbox's memory limit; the context \
                     restarts on its next cell"
                        .to_owned(),
                ),
                Some("KernelDied") => (
                    CodeState::Failed,
                    "KERNEL_DIED",
                    "the kernel died; the context restarts on its next cell".to_owned(),
                ),
                Some(_) => (CodeState::Error, "", String::new()),
            },
            Err(stop) => self.failure(stop, cell),
        };
        let mut end = CodeEnd {
            state: state as i32,
            execution_count: seen.execution_count,
            context_id: cell.context_id.clone(),
            error_reason: reason.to_owned(),
            error_message: message,
            duration_ms: 0,
        };
        end.error_message = self.patterns.redact_str(&end.error_message).into_owned();
        end
    }

    fn failure(&self, stop: Stop, cell: &Cell) -> (CodeState, &'static str, String) {
        let unavailable = "INTERPRETER_UNAVAILABLE";
        match stop {
            Stop::TimedOut => (
                CodeState::TimedOut,
                "EXEC_TIMEOUT",
                format!(
                    "the cell ran past its timeout of {} ms and was interrupted; the context \
                     lives on",
                    cell.timeout.as_millis()
                ),
            ),
            Stop::ClientGone => (
                CodeState::Failed,
                "CANCELLED",
                "the client went away; the cell was interrupted".into(),
            ),
            Stop::Guest(GuestError::TooLarge(m)) | Stop::Ndjson(NdjsonError::TooLarge(m)) => {
                (CodeState::Failed, "OUTPUT_TOO_LARGE", m)
            }
            Stop::Ndjson(NdjsonError::Malformed(m)) => (
                CodeState::Failed,
                unavailable,
                format!("the interpreter's answer is malformed: {m}"),
            ),
            Stop::Guest(GuestError::Unavailable(m)) => (
                CodeState::Failed,
                unavailable,
                format!("{m} (is the sandbox's template `code-interpreter`?)"),
            ),
            Stop::NoEnd => (
                CodeState::Failed,
                unavailable,
                "the interpreter's answer ended before the cell's end".into(),
            ),
            Stop::Refused(e) => (CodeState::Failed, refusal_reason(&e), e.to_string()),
        }
    }

    /// One `code.run` event: the cell's context, language, end, duration and digest.
    fn audit(&self, cell: &Cell, end: &CodeEnd) {
        let detail = json!({
            "context_id": cell.context_id,
            // The language the cell ran in: the request's, or python for a default context's
            // (empty when it named a context, which has its own).
            "language": if cell.language.is_empty() && cell.context_id.is_empty() {
                "python"
            } else {
                cell.language.as_str()
            },
            "state": end.state().as_str_name(),
            "reason": end.error_reason,
            "execution_count": end.execution_count,
            "duration_ms": end.duration_ms,
            "timeout_ms": cell.timeout.as_millis() as u64,
            "code": crate::audit::digest(cell.code.as_bytes()),
            "env": cell.env.keys().collect::<Vec<_>>(),
        });
        let kind = crate::audit::Kind::CodeRun;
        crate::audit::emit(&self.tenant, kind, &self.sandbox_id, "", detail);
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<guest::Answer, GuestError> {
        let body = body.map(|b| b.to_string().into_bytes());
        guest::request(&self.vsock, self.port, CONNECT_WITHIN, method, path, body).await
    }

    /// The error an answer other than 2xx stands for.
    fn refusal(&self, status: StatusCode, body: &[u8], context: &str) -> ApiError {
        let text = String::from_utf8_lossy(&body[..body.len().min(4096)]);
        let text = self.patterns.redact_str(text.trim()).into_owned();
        match status {
            StatusCode::NOT_FOUND if !context.is_empty() => {
                ApiError::CodeContextNotFound(context.to_owned())
            }
            StatusCode::BAD_REQUEST => ApiError::InvalidArgument(format!("interpreter: {text}")),
            _ => self.unavailable(format!("the interpreter answered {status}: {text}")),
        }
    }

    fn unavailable(&self, message: String) -> ApiError {
        ApiError::InterpreterUnavailable {
            id: self.sandbox_id.clone(),
            message,
        }
    }

    /// A context call: `method path` with `body`, its answer's body (2xx) within
    /// [`CONTEXT_CALL`].
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        context: &str,
    ) -> ApiResult<Vec<u8>> {
        self.touch();
        let exchange = async {
            let answer = self.request(method, path, body).await?;
            let status = answer.status;
            Ok::<_, GuestError>((status, answer.read_all(MAX_CONTEXT_ANSWER).await?))
        };
        let (status, text) = tokio::time::timeout(CONTEXT_CALL, exchange)
            .await
            .map_err(|_| self.unavailable(format!("no answer within {CONTEXT_CALL:?}")))?
            .map_err(|e| self.unavailable(e.to_string()))?;
        if !status.is_success() {
            return Err(self.refusal(status, &text, context));
        }
        Ok(text)
    }

    fn parse<T: serde::de::DeserializeOwned>(&self, text: &[u8]) -> ApiResult<T> {
        serde_json::from_slice(text)
            .map_err(|e| self.unavailable(format!("the interpreter's answer is malformed: {e}")))
    }

    /// CreateCodeContext: a new context of `language` (empty: python) in `cwd`.
    pub async fn create_context(&self, language: &str, cwd: &str) -> ApiResult<CodeContext> {
        let mut body = json!({});
        if !language.is_empty() {
            body["language"] = language.into();
        }
        if !cwd.is_empty() {
            body["cwd"] = cwd.into();
        }
        let text = self.call(Method::POST, "/contexts", Some(body), "").await?;
        Ok(self.parse::<GuestContext>(&text)?.into())
    }

    /// ListCodeContexts.
    pub async fn list_contexts(&self) -> ApiResult<Vec<CodeContext>> {
        let text = self.call(Method::GET, "/contexts", None, "").await?;
        let list: Vec<GuestContext> = self.parse(&text)?;
        Ok(list.into_iter().map(Into::into).collect())
    }

    /// RestartCodeContext: its state gone, its id kept.
    pub async fn restart_context(&self, id: &str) -> ApiResult<CodeContext> {
        check_context_id(id)?;
        let path = format!("/contexts/{id}/restart");
        let text = self.call(Method::POST, &path, Some(json!({})), id).await?;
        // The server answers the context, or nothing much: the id is what matters.
        let mut c: CodeContext = self
            .parse::<GuestContext>(&text)
            .map(Into::into)
            .unwrap_or_default();
        if c.id.is_empty() {
            if let Some(found) = self.list_contexts().await?.into_iter().find(|c| c.id == id) {
                c = found;
            } else {
                c.id = id.to_owned();
            }
        }
        Ok(c)
    }

    /// RemoveCodeContext.
    pub async fn remove_context(&self, id: &str) -> ApiResult<()> {
        check_context_id(id)?;
        let path = format!("/contexts/{id}");
        self.call(Method::DELETE, &path, None, id).await?;
        Ok(())
    }
}

/// Sends what `seen`'s streams hold back.
async fn flush(seen: &mut Seen, tx: &mpsc::Sender<RunCodeEvent>) -> Result<(), Stop> {
    for (i, text) in seen.streams.flush() {
        let out = airlock_api::v1::CodeOutput {
            text,
            timestamp_unix_ns: crate::ids::now_ms().saturating_mul(1_000_000),
        };
        let event = match i {
            0 => run_code_event::Event::Stdout(out),
            _ => run_code_event::Event::Stderr(out),
        };
        let e = RunCodeEvent { event: Some(event) };
        tx.send(e).await.map_err(|_| Stop::ClientGone)?;
    }
    Ok(())
}

/// The reason of an end a refusal made.
fn refusal_reason(e: &ApiError) -> &'static str {
    match e {
        ApiError::CodeContextNotFound(_) => "CODE_CONTEXT_NOT_FOUND",
        ApiError::InvalidArgument(_) => "INVALID_ARGUMENT",
        _ => "INTERPRETER_UNAVAILABLE",
    }
}

/// A context id goes into a URL path: letters, digits, `-`, `_`, `.`, at most 128.
pub fn check_context_id(id: &str) -> ApiResult<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && id != "."
        && id != "..";
    if ok {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "{id:?} is no code context id (letters, digits, `-`, `_`, `.`; at most 128)"
        )))
    }
}

#[cfg(test)]
mod tests;
