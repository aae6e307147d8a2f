//! envd's `process.Process` over the daemon's executions: Start (an execution, its output
//! streamed as it is stored), Connect (a running one followed from now), List, SendInput and
//! CloseStdin (its stdin, kept open when asked), SendSignal. A process is named by its pid in
//! the guest, as envd names it. A command's deadline (`Connect-Timeout-Ms`) is the execution's
//! timeout; a client that goes away leaves the process running, as with envd.

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::{ExecRequest, Execution, ExecutionState, execution_event};
use base64::Engine as _;
use connectrpc::{
    ConnectError, ErrorCode, RequestContext, Response, ServiceRequest, ServiceResult, ServiceStream,
};
use tokio_stream::wrappers::ReceiverStream;

use super::pb::process::__buffa::oneof::{process_event, process_input, process_selector};
use super::pb::process::*;
use super::{Gateway, Target};
use crate::error::ApiError;
use crate::exec::ExecRt;

/// How long a start may wait for the guest to report the process's pid.
const START_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct ProcessService {
    gw: Arc<Gateway>,
}

impl ProcessService {
    pub fn new(gw: Arc<Gateway>) -> Self {
        Self { gw }
    }
}

/// The authorised sandbox of a call (put there by the gateway's middleware).
pub fn target(ctx: &RequestContext) -> Result<Target, ConnectError> {
    ctx.extensions()
        .get::<Target>()
        .cloned()
        .ok_or_else(|| ConnectError::unauthenticated("no sandbox"))
}

/// The guest account of a call: `Authorization: Basic base64("NAME:")`, else the default.
pub fn user(ctx: &RequestContext) -> String {
    let Some(b) =
        super::header_str(ctx.headers(), "authorization").and_then(|a| a.strip_prefix("Basic "))
    else {
        return String::new();
    };
    base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()
        .and_then(|d| String::from_utf8(d).ok())
        .map(|s| s.split(':').next().unwrap_or_default().to_owned())
        .unwrap_or_default()
}

/// A daemon error as a Connect error (redacted, a denial audited).
pub fn connect_error(t: &Target, call: &str, e: &ApiError) -> ConnectError {
    use tonic::Code;
    crate::audit::denial(t.tenant(), &t.rt.id, call, e);
    let message = crate::secrets::logs::redact(Some(t.tenant()), &e.to_string());
    let code = match e.code() {
        Code::InvalidArgument => ErrorCode::InvalidArgument,
        Code::Unauthenticated => ErrorCode::Unauthenticated,
        Code::PermissionDenied => ErrorCode::PermissionDenied,
        Code::NotFound => ErrorCode::NotFound,
        Code::AlreadyExists => ErrorCode::AlreadyExists,
        Code::FailedPrecondition => ErrorCode::FailedPrecondition,
        Code::ResourceExhausted => ErrorCode::ResourceExhausted,
        Code::Unavailable => ErrorCode::Unavailable,
        Code::DeadlineExceeded => ErrorCode::DeadlineExceeded,
        Code::OutOfRange => ErrorCode::OutOfRange,
        _ => ErrorCode::Internal,
    };
    ConnectError::new(code, message)
}

fn event(e: process_event::Event) -> ProcessEvent {
    ProcessEvent {
        event: Some(e),
        ..Default::default()
    }
}

fn start_event(pid: u32) -> ProcessEvent {
    event(process_event::Event::Start(Box::new(
        super::pb::process::process_event::StartEvent {
            pid,
            ..Default::default()
        },
    )))
}

/// The end envd reports for an execution's record: the exit code, or -1 for a signal.
fn end_event(r: &Execution) -> ProcessEvent {
    let state = r.state();
    let (code, exited, status) = match state {
        ExecutionState::Exited if r.signal == 0 => {
            (r.exit_code, true, format!("exit status {}", r.exit_code))
        }
        ExecutionState::Exited => (-1, false, format!("signal: {}", r.signal)),
        ExecutionState::Failed => (-1, false, format!("failed: {}", r.error_message)),
        ExecutionState::TimedOut => (-1, false, "signal: killed (timeout)".to_owned()),
        ExecutionState::OomKilled => (-1, false, "signal: killed (out of memory)".to_owned()),
        _ => (-1, false, "signal: killed".to_owned()),
    };
    event(process_event::Event::End(Box::new(
        super::pb::process::process_event::EndEvent {
            exit_code: code,
            exited,
            error: (code != 0).then(|| status.clone()),
            status,
            ..Default::default()
        },
    )))
}

fn data_event(stream: i32, data: Vec<u8>) -> ProcessEvent {
    let out = if stream == airlock_api::v1::StreamKind::Stderr as i32 {
        process_event::data_event::Output::Stderr(data)
    } else {
        process_event::data_event::Output::Stdout(data)
    };
    event(process_event::Event::Data(Box::new(
        super::pb::process::process_event::DataEvent {
            output: Some(out),
            ..Default::default()
        },
    )))
}

/// The keepalive interval a client asks for (`Keepalive-Ping-Interval`, seconds).
fn keepalive(ctx: &RequestContext) -> Duration {
    let secs = super::header_str(ctx.headers(), "keepalive-ping-interval")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(50);
    // At most 60 s: a stream that is quiet longer than the idle timeout (120 s) is cut.
    Duration::from_secs(secs.clamp(1, 60))
}

/// The events of execution `id` from `offsets`, after a start event: output, keepalives in
/// the quiet, the end. A stream dropped by its client stops following; the process runs on.
fn follow<T: Send + 'static>(
    gw: &Gateway,
    id: String,
    live: Arc<ExecRt>,
    offsets: [u64; 2],
    every: Duration,
    wrap: fn(ProcessEvent) -> T,
) -> ServiceStream<T> {
    let executions = gw.daemon.executions.clone();
    let pid = live.record().pid;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<T, ConnectError>>(16);
    let (etx, mut erx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(crate::stream::follow(
        executions,
        id,
        Some(live),
        offsets,
        etx,
    ));
    tokio::spawn(async move {
        if tx.send(Ok(wrap(start_event(pid)))).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                e = erx.recv() => e,
                () = tokio::time::sleep(every) => {
                    let ka = event(process_event::Event::Keepalive(Box::default()));
                    if tx.send(Ok(wrap(ka))).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let out = match next {
                None => return,
                Some(Err(status)) => Err(ConnectError::new(
                    ErrorCode::Unavailable,
                    status.message().to_owned(),
                )),
                Some(Ok(ev)) => match ev.event {
                    Some(execution_event::Event::Output(o)) if !o.data.is_empty() => {
                        Ok(wrap(data_event(o.stream, o.data)))
                    }
                    Some(execution_event::Event::Exit(r)) => {
                        let _ = tx.send(Ok(wrap(end_event(&r)))).await;
                        return;
                    }
                    _ => continue,
                },
            };
            if tx.send(out).await.is_err() {
                return;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

fn start_response(e: ProcessEvent) -> StartResponse {
    StartResponse {
        event: e.into(),
        ..Default::default()
    }
}

fn connect_response(e: ProcessEvent) -> ConnectResponse {
    ConnectResponse {
        event: e.into(),
        ..Default::default()
    }
}

impl ProcessService {
    /// The running execution of pid `pid` in the target sandbox.
    fn by_pid(&self, t: &Target, pid: u32) -> Result<Arc<ExecRt>, ConnectError> {
        self.gw
            .daemon
            .executions
            .running_in(&t.rt.id)
            .into_iter()
            .find(|e| pid != 0 && e.record().pid == pid)
            .ok_or_else(|| ConnectError::not_found(format!("process with pid {pid} not found")))
    }

    fn selected(
        &self,
        t: &Target,
        sel: Option<&process_selector::Selector>,
    ) -> Result<Arc<ExecRt>, ConnectError> {
        match sel {
            Some(process_selector::Selector::Pid(pid)) => self.by_pid(t, *pid),
            Some(process_selector::Selector::Tag(tag)) => Err(ConnectError::not_found(format!(
                "process with tag {tag:?} not found (processes are named by pid here)"
            ))),
            None => Err(ConnectError::invalid_argument("which process? (pid)")),
        }
    }

    async fn stdin(
        &self,
        t: &Target,
        rt: &ExecRt,
        data: Vec<u8>,
        eof: bool,
    ) -> Result<(), ConnectError> {
        self.gw
            .daemon
            .executions
            .write_stdin(t.tenant(), &rt.id, data, eof)
            .await
            .map_err(|e| {
                // A process that ended is gone for envd's clients: NOT_FOUND, as envd says.
                if rt.is_finished() {
                    ConnectError::not_found(format!("process {} has ended", rt.record().pid))
                } else {
                    connect_error(t, "e2b.SendInput", &e)
                }
            })
    }
}

#[allow(refining_impl_trait)]
impl Process for ProcessService {
    async fn list(
        &self,
        ctx: RequestContext,
        _: ServiceRequest<'_, ListRequest>,
    ) -> ServiceResult<ListResponse> {
        let t = target(&ctx)?;
        let processes = self
            .gw
            .daemon
            .executions
            .running_in(&t.rt.id)
            .into_iter()
            .filter_map(|e| {
                let r = e.record();
                let (cmd, args) = r.command.split_first()?;
                Some(ProcessInfo {
                    pid: r.pid,
                    config: ProcessConfig {
                        cmd: cmd.clone(),
                        args: args.to_vec(),
                        cwd: (!r.cwd.is_empty()).then(|| r.cwd.clone()),
                        ..Default::default()
                    }
                    .into(),
                    ..Default::default()
                })
            })
            .filter(|p| p.pid != 0)
            .collect();
        Response::ok(ListResponse {
            processes,
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, ConnectRequest>,
    ) -> ServiceResult<ServiceStream<ConnectResponse>> {
        let t = target(&ctx)?;
        let r = request.to_owned_message();
        let rt = self.selected(&t, r.process.as_option().and_then(|p| p.selector.as_ref()))?;
        let offsets = rt.stored();
        Response::ok(follow(
            &self.gw,
            rt.id.clone(),
            rt,
            offsets,
            keepalive(&ctx),
            connect_response,
        ))
    }

    async fn start(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, StartRequest>,
    ) -> ServiceResult<ServiceStream<StartResponse>> {
        let t = target(&ctx)?;
        let r = request.to_owned_message();
        if r.pty.is_set() {
            return Err(ConnectError::unimplemented(
                "PTY sessions are not served by Airlock's E2B gateway",
            ));
        }
        let p = r.process.as_option().cloned().unwrap_or_default();
        if p.cmd.is_empty() {
            return Err(ConnectError::invalid_argument("process.cmd is empty"));
        }
        let cfg = &self.gw.daemon.cfg;
        // envd kills a process at its call's deadline; without one it runs as long as it may.
        let timeout_ms = ctx
            .deadline()
            .map(|d| {
                d.saturating_duration_since(std::time::Instant::now())
                    .as_millis() as u64
            })
            .map_or(cfg.max_exec_timeout_ms, |ms| {
                ms.clamp(1, cfg.max_exec_timeout_ms)
            });
        let mut argv = vec![p.cmd.clone()];
        argv.extend(p.args.iter().cloned());
        let req = ExecRequest {
            sandbox_id: t.rt.id.clone(),
            command: Some(airlock_api::v1::exec_request::Command::Argv(
                airlock_api::v1::Argv { args: argv },
            )),
            cwd: p.cwd.clone().unwrap_or_default(),
            env: p.envs.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            timeout_ms,
            user: user(&ctx),
            stdin_open: r.stdin.unwrap_or(false),
            ..Default::default()
        };
        let executions = &self.gw.daemon.executions;
        let started =
            t.rt.exec_target()
                .and_then(|target| executions.start(&target, &req));
        let id = started.map_err(|e| connect_error(&t, "e2b.Start", &e))?;
        let (_, live) = executions
            .get(t.tenant(), &id)
            .map_err(|e| connect_error(&t, "e2b.Start", &e))?;
        let Some(live) = live else {
            let (record, _) = executions
                .get(t.tenant(), &id)
                .map_err(|e| connect_error(&t, "e2b.Start", &e))?;
            return Err(ConnectError::invalid_argument(format!(
                "the process did not start: {}",
                record.error_message
            )));
        };
        live.settle(START_WAIT).await;
        if live.record().pid == 0 {
            // Refused by the guest (no such program, directory or account), or lost.
            live.wait_finished(Duration::from_secs(5)).await;
            let record = executions.record(&id).unwrap_or_else(|_| live.record());
            return Err(ConnectError::invalid_argument(format!(
                "the process did not start: {}",
                record.error_message
            )));
        }
        Response::ok(follow(
            &self.gw,
            id,
            live,
            [0, 0],
            keepalive(&ctx),
            start_response,
        ))
    }

    async fn update(
        &self,
        _: RequestContext,
        _: ServiceRequest<'_, UpdateRequest>,
    ) -> ServiceResult<UpdateResponse> {
        Err(ConnectError::unimplemented(
            "PTY sessions are not served here",
        ))
    }

    async fn stream_input(
        &self,
        ctx: RequestContext,
        mut requests: connectrpc::InboundStream<StreamInputRequest>,
    ) -> ServiceResult<StreamInputResponse> {
        use super::pb::process::__buffa::oneof::stream_input_request::Event;
        use process_input::Input;
        use tokio_stream::StreamExt as _;
        let t = target(&ctx)?;
        let mut rt = None;
        while let Some(msg) = requests.next().await {
            let msg = msg?.to_owned_message();
            match msg.event {
                Some(Event::Start(s)) => {
                    let sel = s.process.as_option().and_then(|p| p.selector.as_ref());
                    rt = Some(self.selected(&t, sel)?);
                }
                Some(Event::Data(d)) => {
                    let Some(rt) = rt.as_ref() else {
                        return Err(ConnectError::invalid_argument(
                            "input before the start event",
                        ));
                    };
                    match d.input.as_option().and_then(|i| i.input.clone()) {
                        Some(Input::Stdin(data)) => self.stdin(&t, rt, data, false).await?,
                        Some(Input::Pty(_)) => {
                            return Err(ConnectError::unimplemented("PTY input"));
                        }
                        None => {}
                    }
                }
                _ => {}
            }
        }
        Response::ok(StreamInputResponse::default())
    }

    async fn send_input(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, SendInputRequest>,
    ) -> ServiceResult<SendInputResponse> {
        let t = target(&ctx)?;
        let r = request.to_owned_message();
        let rt = self.selected(&t, r.process.as_option().and_then(|p| p.selector.as_ref()))?;
        match r.input.as_option().and_then(|i| i.input.clone()) {
            Some(process_input::Input::Stdin(data)) => self.stdin(&t, &rt, data, false).await?,
            Some(process_input::Input::Pty(_)) => {
                return Err(ConnectError::unimplemented("PTY input"));
            }
            None => {}
        }
        Response::ok(SendInputResponse::default())
    }

    async fn send_signal(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, SendSignalRequest>,
    ) -> ServiceResult<SendSignalResponse> {
        let t = target(&ctx)?;
        let r = request.to_owned_message();
        let rt = self.selected(&t, r.process.as_option().and_then(|p| p.selector.as_ref()))?;
        let signal = match r.signal.to_i32() {
            15 => libc::SIGTERM,
            _ => libc::SIGKILL,
        };
        self.gw
            .daemon
            .executions
            .kill(t.tenant(), &rt.id, signal)
            .map_err(|e| connect_error(&t, "e2b.SendSignal", &e))?;
        Response::ok(SendSignalResponse::default())
    }

    async fn close_stdin(
        &self,
        ctx: RequestContext,
        request: ServiceRequest<'_, CloseStdinRequest>,
    ) -> ServiceResult<CloseStdinResponse> {
        let t = target(&ctx)?;
        let r = request.to_owned_message();
        let rt = self.selected(&t, r.process.as_option().and_then(|p| p.selector.as_ref()))?;
        self.stdin(&t, &rt, Vec::new(), true).await?;
        Response::ok(CloseStdinResponse::default())
    }
}
