//! `exec`, `logs`, `kill`: executions and their output.

use std::io::Write;

use airlock_api::v1::{
    Execution, ExecutionState, KillExecutionRequest, StreamExecutionRequest, StreamKind,
    execution_event,
};
use serde_json::json;

use super::{Ctx, fail};
use crate::args::{ExecArgs, KillArgs, LogsArgs};
use crate::output::print_json;
use crate::request::{exec_request, read_local};

/// `exec`: starts the command, then streams its output live; exits with its exit code. With
/// `--json` the execution id goes to stderr first (stdout stays the command's).
pub async fn exec(ctx: &mut Ctx, args: &ExecArgs) -> Result<u8, String> {
    let req = exec_request(args, &read_local)?;
    let ex = ctx.client.exec(req).await.map_err(fail)?.into_inner();
    if ctx.json {
        eprintln!("{}", json!({"execution_id": ex.execution_id}));
    }
    follow(
        ctx,
        StreamExecutionRequest {
            execution_id: ex.execution_id,
            ..Default::default()
        },
    )
    .await
}

/// `logs`: streams an execution's stored and live output; exits with its exit code.
pub async fn logs(ctx: &mut Ctx, args: &LogsArgs) -> Result<u8, String> {
    follow(
        ctx,
        StreamExecutionRequest {
            execution_id: args.execution_id.clone(),
            stdout_offset: args.stdout_offset,
            stderr_offset: args.stderr_offset,
        },
    )
    .await
}

/// `kill`: prints nothing (JSON: whether it was signalled, false when it had ended).
pub async fn kill(ctx: &mut Ctx, args: &KillArgs) -> Result<u8, String> {
    let req = KillExecutionRequest {
        execution_id: args.execution_id.clone(),
        signal: args.signal.unwrap_or(0),
    };
    let r = ctx
        .client
        .kill_execution(req)
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&json!({"execution_id": args.execution_id, "signalled": r.signalled}));
    }
    Ok(0)
}

/// Streams an execution's output to ours; returns its exit code.
async fn follow(ctx: &mut Ctx, req: StreamExecutionRequest) -> Result<u8, String> {
    let mut stream = ctx
        .client
        .stream_execution(req)
        .await
        .map_err(fail)?
        .into_inner();
    while let Some(ev) = stream.message().await.map_err(fail)? {
        match ev.event {
            Some(execution_event::Event::Output(o)) => {
                // A closed stdout (`| head`) must not end the stream before the exit.
                if o.stream == StreamKind::Stderr as i32 {
                    let _ = std::io::stderr().write_all(&o.data);
                } else {
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&o.data);
                    let _ = out.flush();
                }
            }
            Some(execution_event::Event::Exit(e)) => {
                if !e.error_reason.is_empty() {
                    eprintln!("airlock: {}: {}", e.error_reason, e.error_message);
                }
                return Ok(exit_code(&e));
            }
            None => {}
        }
    }
    Err("the stream ended without an exit".into())
}

/// Our exit code for an ended execution: its own; 124 for its timeout; 128+N for signal N;
/// else 1.
pub fn exit_code(e: &Execution) -> u8 {
    match ExecutionState::try_from(e.state) {
        Ok(ExecutionState::Exited) if e.exit_code >= 0 => u8::try_from(e.exit_code).unwrap_or(255),
        Ok(ExecutionState::TimedOut) => 124,
        _ if e.signal > 0 => u8::try_from(e.signal.saturating_add(128)).unwrap_or(255),
        _ => 1,
    }
}
