//! The thread of one execution: take the sandbox's agent connection (made first if it has
//! none; every step until the process has started bounded by a deadline, the request
//! registered as soon as it is sent so that the timeout can cut it off at any point), start
//! the command or attach to one that outlived the previous daemon, and store its output until
//! it exits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_proto::pb;
use airlock_proto::{ClientError, Mux, MuxClient, Requests};

use super::rt::ExecRt;
use crate::agent::AgentLink;
use crate::error::error_chain;
use crate::reason::ExecEnd;

/// Connecting (when the sandbox has no connection yet), the agent's Ready and the process's
/// start together may take this long (a
/// loaded nested-KVM guest forks slowly).
const START_DEADLINE: Duration = Duration::from_secs(60);
/// How long an execution whose agent connection broke waits for its sandbox to be reported
/// dead (whose reason it then takes) before it ends as AGENT_UNAVAILABLE.
const LOST_CONNECTION_GRACE: Duration = Duration::from_secs(3);

/// How the execution begins on this connection.
#[derive(Debug)]
pub enum Start {
    /// A new process.
    Exec(pb::Exec),
    /// One the agent kept across a lost connection (`keep_on_disconnect`), by its id.
    Attach(u64),
}

/// The thread body: runs the execution to its end and stores the record.
pub fn run(rt: Arc<ExecRt>, agent: &AgentLink, start: Start, runtime: tokio::runtime::Handle) {
    match drive(&rt, agent, start) {
        Ok(exit) => rt.finish(Some(exit), None),
        Err(Failure::Refused(message)) => rt.finish(None, Some(&ExecEnd::StartFailed(message))),
        Err(Failure::Lost(message)) => {
            // A lost connection is often the sandbox dying (a guest kernel panic, a killed
            // VMM): its end then ends this execution with its reason. Give it a moment.
            runtime.block_on(rt.wait_finished(LOST_CONNECTION_GRACE));
            rt.finish(None, Some(&ExecEnd::AgentUnavailable(message)));
        }
    }
}

/// Why an execution has no exit from the guest.
enum Failure {
    /// The agent refused to start it (its answer says why).
    Refused(String),
    /// The connection to the agent failed or broke.
    Lost(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Self::Lost(message)
    }
}

fn drive(rt: &ExecRt, agent: &AgentLink, start: Start) -> Result<pb::ExecExit, Failure> {
    let deadline = Instant::now() + START_DEADLINE;
    let mux = agent
        .get(deadline)
        .map_err(|e| format!("connecting to the agent: {}", error_chain(&e)))?;
    if rt.is_finished() {
        return Err(Failure::Lost("ended before it started".into()));
    }
    let mut client = mux.client(Some(deadline));
    let (request, exec_id, pid, offsets) =
        begin(rt, &mux, &mut client, start).map_err(|e| match e {
            ClientError::Agent { message, .. } => Failure::Refused(message),
            other => Failure::Lost(error_chain(&other)),
        })?;
    // The output may take as long as the execution does; the daemon's timer bounds it.
    client.set_deadline(None);
    rt.started(exec_id, pid);
    let mut sink = rt.open_output().map_err(|e| e.to_string())?;
    let mut failed = None;
    let exit = client
        .collect_stream(request, exec_id, offsets, |stream, offset, data| {
            if failed.is_none()
                && let Err(e) = rt.store_output(&mut sink, stream, offset, data)
            {
                failed = Some(e);
            }
        })
        .map_err(|e| format!("agent connection: {}", error_chain(&e)))?;
    if let Some(e) = failed {
        return Err(Failure::Lost(format!("storing output: {e}")));
    }
    let mut exit = exit;
    exit.output_truncated |= sink.truncated;
    Ok(exit)
}

/// Starts or attaches: the request id, the agent's execution id, the process's pid in the
/// guest and where output continues.
fn begin(
    rt: &ExecRt,
    mux: &Mux,
    client: &mut MuxClient,
    start: Start,
) -> Result<(u64, u64, u32, [u64; 2]), ClientError> {
    match start {
        Start::Exec(exec) => {
            let id = client.send_kind(pb::request::Kind::Exec(exec))?;
            rt.sent(mux, id);
            let started = client.exec_started(id)?;
            Ok((id, started.exec_id, started.pid, [0, 0]))
        }
        Start::Attach(agent_id) => {
            let have = rt.stored();
            let (id, attached) = client.attach_from(agent_id, have[0], have[1])?;
            rt.sent(mux, id);
            Ok((
                id,
                agent_id,
                attached.pid,
                [attached.stdout_offset, attached.stderr_offset],
            ))
        }
    }
}
