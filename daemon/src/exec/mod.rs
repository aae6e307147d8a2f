//! Executions: the registry of running ones (it owns their records, output files and
//! metrics), starting one (a thread per execution, [`runner`]), the daemon's own timeout,
//! kills, the end of every execution of a sandbox that ends, and following executions again
//! after a restart. Stored output lives in `DATA_DIR/output/ID.stdout` / `.stderr`: the same
//! files serve a live stream and a replay after the fact.

mod output;
mod record;
mod rt;
mod runner;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use airlock_api::v1::{ExecRequest, Execution, ExecutionState, exec_request};
use airlock_proto::pb;
use tracing::info;

use output::OutputBudget;
pub use rt::ExecRt;
use rt::Ledger;
pub use runner::Start;

use crate::error::{ApiError, ApiResult};
use crate::metrics::Metrics;
use crate::reason::ExecEnd;
use crate::store::Store;
use crate::{ids, limits};

/// The limits executions run under (from the config).
#[derive(Clone, Debug)]
pub struct ExecLimits {
    pub default_timeout_ms: u64,
    pub max_timeout_ms: u64,
    pub max_output_bytes: u64,
    /// The most stored output all GetExecution calls hold at once ([`output`]).
    pub max_output_read_bytes: u64,
}

/// Where an execution runs.
#[derive(Clone, Debug)]
pub struct ExecTarget {
    pub sandbox_id: String,
    pub tenant: String,
    pub template_id: String,
    /// The sandbox's agent connection.
    pub agent: Arc<crate::agent::AgentLink>,
    /// The sandbox's environment (the request's entries go over it).
    pub env: HashMap<String, String>,
    /// The sandbox's secrets (its variables go over its environment; every value is redacted
    /// from the execution's output and record).
    pub secrets: Arc<crate::secrets::SandboxSecrets>,
    /// Root is out of reach in the sandbox (its no_root policy).
    pub no_root: bool,
}

/// The executions.
#[derive(Debug)]
pub struct Executions {
    limits: ExecLimits,
    output_dir: PathBuf,
    ledger: Arc<Ledger>,
    output_budget: OutputBudget,
}

impl Executions {
    pub fn new(
        limits: ExecLimits,
        output_dir: PathBuf,
        store: Arc<Store>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            output_budget: OutputBudget::new(limits.max_output_read_bytes),
            limits,
            output_dir,
            ledger: Arc::new(Ledger {
                store,
                metrics,
                live: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The output files of execution `id`.
    pub fn output_paths(&self, id: &str) -> [PathBuf; 2] {
        [
            self.output_dir.join(format!("{id}.stdout")),
            self.output_dir.join(format!("{id}.stderr")),
        ]
    }

    /// A running execution.
    pub fn live(&self, id: &str) -> Option<Arc<ExecRt>> {
        self.ledger.live().get(id).cloned()
    }

    /// The stored record of execution `id`.
    pub fn record(&self, id: &str) -> ApiResult<Execution> {
        self.ledger
            .store
            .execution(id)?
            .ok_or_else(|| ApiError::Internal(format!("the record of execution {id} is lost")))
    }

    /// Whether a sandbox has executions running.
    pub fn busy(&self, sandbox_id: &str) -> bool {
        self.ledger
            .live()
            .values()
            .any(|e| e.sandbox_id == sandbox_id)
    }

    /// Execution `id` of `tenant`: its record, and its runtime if it runs.
    pub fn get(&self, tenant: &str, id: &str) -> ApiResult<(Execution, Option<Arc<ExecRt>>)> {
        if !ids::Kind::Execution.names(id) {
            return Err(ApiError::ExecutionNotFound(id.to_owned()));
        }
        if let Some(rt) = self.live(id).filter(|r| r.tenant == tenant) {
            return Ok((rt.record(), Some(rt)));
        }
        match self.ledger.store.execution(id)? {
            Some(e) if e.tenant == tenant => Ok((e, None)),
            _ => Err(ApiError::ExecutionNotFound(id.to_owned())),
        }
    }

    /// Starts an execution in `target`; returns its id at once.
    pub fn start(&self, target: &ExecTarget, req: &ExecRequest) -> ApiResult<String> {
        let argv = command_of(req)?;
        if target.no_root && req.user == "root" {
            // The agent refuses any account with uid 0 too; this is the clear error for the
            // common case, before anything is recorded.
            return Err(ApiError::RootNotAllowed {
                id: target.sandbox_id.clone(),
                what: "an execution as root".into(),
            });
        }
        let timeout_ms = match req.timeout_ms {
            0 => self.limits.default_timeout_ms,
            t => t.min(self.limits.max_timeout_ms),
        };
        let own = crate::secrets::check(&req.secrets, true)?;
        let (env, secret_names) = exec_env(target, req, &own)?;
        let patterns = target.secrets.patterns_with(&own);
        let id = ids::new_id(ids::Kind::Execution)?;
        let record = Execution {
            id: id.clone(),
            sandbox_id: target.sandbox_id.clone(),
            tenant: target.tenant.clone(),
            template_id: target.template_id.clone(),
            // The record keeps the command with secret values redacted (code may quote one).
            command: argv
                .iter()
                .map(|a| patterns.redact_str(a).into_owned())
                .collect(),
            secret_names,
            cwd: req.cwd.clone(),
            user: req.user.clone(),
            state: ExecutionState::Running as i32,
            started_unix_ms: ids::now_ms(),
            timeout_ms,
            ..Default::default()
        };
        let exec = pb::Exec {
            command: Some(pb::exec::Command::Argv(pb::Argv { args: argv })),
            // Empty: the account's home (the agent knows it).
            cwd: req.cwd.clone(),
            user: req.user.clone(),
            env,
            stdin: req.stdin.clone(),
            stdin_open: req.stdin_open,
            timeout_ms,
            max_output_bytes: self.limits.max_output_bytes,
            // The execution outlives a restarting daemon, which attaches to it again.
            keep_on_disconnect: true,
            memory_max_bytes: u64::from(req.memory_limit_mib) << 20,
        };
        self.ledger.store.put_execution(&record)?;
        self.create_outputs(&id)?;
        let patterns_for_audit = patterns.clone();
        let secret_names_for_audit = record.secret_names.clone();
        let patterns = (!patterns.is_empty()).then_some(patterns);
        self.run(
            record,
            [0, 0],
            &target.agent,
            Start::Exec(exec),
            timeout_ms,
            patterns,
        )?;
        audit_start(
            target,
            req,
            &id,
            &patterns_for_audit,
            &secret_names_for_audit,
        );
        info!(execution = %id, sandbox = %target.sandbox_id, "execution started");
        Ok(id)
    }

    /// Start step: execution `id`'s empty output files, the daemon's alone on the host.
    fn create_outputs(&self, id: &str) -> ApiResult<()> {
        for p in &self.output_paths(id) {
            use std::os::unix::fs::OpenOptionsExt;
            // The tenant's output: the daemon's alone on the host.
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(p)?;
        }
        Ok(())
    }

    /// Follows `record` again after a restart: attaches to the agent's execution `agent_id`
    /// through `agent`, with the output stored so far, redacted with `patterns` (its
    /// sandbox's secrets'); its timeout counts from its start.
    pub fn adopt(
        &self,
        record: Execution,
        agent_id: u64,
        agent: &Arc<crate::agent::AgentLink>,
        patterns: Option<Arc<crate::secrets::redact::Patterns>>,
    ) -> ApiResult<()> {
        let paths = self.output_paths(&record.id);
        let len = |p: &PathBuf| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let stored = [len(&paths[0]), len(&paths[1])];
        let ran_ms = u64::try_from(ids::now_ms() - record.started_unix_ms).unwrap_or(0);
        let left_ms = record.timeout_ms.saturating_sub(ran_ms).max(1);
        info!(execution = %record.id, left_ms, "following the execution again");
        self.run(
            record,
            stored,
            agent,
            Start::Attach(agent_id),
            left_ms,
            patterns,
        )
    }

    /// Registers `record` as running and starts its thread and its timeout.
    fn run(
        &self,
        record: Execution,
        stored: [u64; 2],
        agent: &Arc<crate::agent::AgentLink>,
        start: Start,
        timeout_ms: u64,
        patterns: Option<Arc<crate::secrets::redact::Patterns>>,
    ) -> ApiResult<()> {
        let id = record.id.clone();
        let full_timeout = record.timeout_ms;
        let paths = self.output_paths(&id);
        let rt = Arc::new(ExecRt::new(
            record,
            paths,
            stored,
            self.limits.max_output_bytes,
            self.ledger.clone(),
            patterns,
        ));
        self.ledger.live().insert(id.clone(), rt.clone());
        let (r, agent) = (rt.clone(), agent.clone());
        let handle = tokio::runtime::Handle::current();
        let spawned = std::thread::Builder::new()
            .name(format!("exec-{}", id.get(3..11).unwrap_or("x")))
            .spawn(move || runner::run(r, &agent, start, handle));
        if let Err(e) = spawned {
            rt.fail(ExecEnd::AgentUnavailable(format!("no thread: {e}")));
            return Err(ApiError::Internal(format!("exec thread: {e}")));
        }
        // The daemon's own clock: the timeout holds without a client and without the guest.
        tokio::spawn(async move {
            if rt.wait_finished(Duration::from_millis(timeout_ms)).await {
                return;
            }
            let end = ExecEnd::Timeout {
                timeout_ms: full_timeout,
            };
            rt.end_by(end, libc::SIGKILL).await;
        });
        Ok(())
    }

    /// KillExecution: `signal` (0: SIGKILL) to `tenant`'s execution `id`; whether it ran.
    pub fn kill(&self, tenant: &str, id: &str, signal: i32) -> ApiResult<bool> {
        let (_, live) = self.get(tenant, id)?;
        let Some(rt) = live.filter(|l| !l.is_finished()) else {
            return Ok(false);
        };
        let signal = if signal == 0 { libc::SIGKILL } else { signal };
        if !(1..=64).contains(&signal) {
            return Err(ApiError::InvalidArgument(format!("signal {signal}")));
        }
        if signal == libc::SIGKILL {
            tokio::spawn(async move { rt.end_by(ExecEnd::Killed, libc::SIGKILL).await });
        } else {
            rt.signal(signal)
                .map_err(|e| ApiError::Internal(format!("signal: {e}")))?;
        }
        Ok(true)
    }

    /// The running executions of sandbox `sandbox_id`, oldest first.
    pub fn running_in(&self, sandbox_id: &str) -> Vec<Arc<ExecRt>> {
        let mut v: Vec<_> = self
            .ledger
            .live()
            .values()
            .filter(|e| e.sandbox_id == sandbox_id && !e.is_finished())
            .cloned()
            .collect();
        v.sort_by_cached_key(|e| e.record().started_unix_ms);
        v
    }

    /// More stdin for execution `id` of `tenant`, started with `stdin_open` (`eof` closes it);
    /// returns once the guest has written it to the process's pipe.
    pub async fn write_stdin(
        &self,
        tenant: &str,
        id: &str,
        data: Vec<u8>,
        eof: bool,
    ) -> ApiResult<()> {
        if data.len() > limits::MAX_STDIN_CHUNK {
            return Err(ApiError::InvalidArgument(format!(
                "stdin: {} bytes in one call, at most {}",
                data.len(),
                limits::MAX_STDIN_CHUNK
            )));
        }
        let (_, live) = self.get(tenant, id)?;
        let ended = || ApiError::InvalidArgument(format!("execution {id} has ended"));
        let rt = live.filter(|l| !l.is_finished()).ok_or_else(ended)?;
        rt.settle(Duration::from_secs(30)).await;
        let (mux, exec_id) = rt.agent_handle().ok_or_else(ended)?;
        let sandbox = rt.sandbox_id.clone();
        let sent = tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            airlock_proto::Requests::stdin(&mut mux.client(Some(deadline)), exec_id, &data, eof)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("stdin task: {e}")))?;
        sent.map_err(|e| match e {
            airlock_proto::ClientError::Agent { message, .. } if rt.is_finished() => {
                ApiError::InvalidArgument(format!("execution {id} has ended: {message}"))
            }
            airlock_proto::ClientError::Agent { message, .. } => {
                ApiError::InvalidArgument(format!("stdin of execution {id}: {message}"))
            }
            other => crate::error::from_agent(
                other,
                crate::error::AgentCall {
                    sandbox: &sandbox,
                    path: "",
                    disk_limit: 0,
                },
            ),
        })
    }

    /// Waits (at most `timeout` in all) until every execution being started has started in
    /// its agent, so that its id is recorded and the next daemon can follow it (a stop that
    /// keeps sandboxes for the next daemon).
    pub async fn settle(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        let live: Vec<_> = self.ledger.live().values().cloned().collect();
        for rt in live {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            rt.settle(left).await;
        }
    }

    /// Ends every execution of sandbox `sandbox_id` with `end` (the sandbox ended).
    pub fn end_all_of(&self, sandbox_id: &str, end: &ExecEnd) {
        let of_sandbox: Vec<_> = self
            .ledger
            .live()
            .values()
            .filter(|e| e.sandbox_id == sandbox_id)
            .cloned()
            .collect();
        for e in of_sandbox {
            e.fail(end.clone());
        }
    }
}

/// Start step: the execution's environment (the sandbox's, its secrets' variables over it,
/// the request's over both) and the names of the secrets in it.
fn exec_env(
    target: &ExecTarget,
    req: &ExecRequest,
    own: &[crate::secrets::Spec],
) -> ApiResult<(HashMap<String, String>, Vec<String>)> {
    let (mut base, mut secret_names) = target.secrets.env();
    for s in own {
        if let crate::secrets::Delivery::Env { var } = &s.delivery {
            base.insert(var.clone(), s.value.to_string());
            secret_names.push(s.name.clone());
        }
    }
    // The sandbox's environment, its secrets' variables over it, the request's over both.
    let mut sandbox_env = target.env.clone();
    sandbox_env.extend(base);
    let env = merged_env(&sandbox_env, &req.env)?;
    Ok((env, secret_names))
}

/// Start step: the audit events of execution `id` (its start; the secrets its environment has).
fn audit_start(
    target: &ExecTarget,
    req: &ExecRequest,
    id: &str,
    patterns: &crate::secrets::redact::Patterns,
    secret_names: &[String],
) {
    crate::audit::emit(
        &target.tenant,
        crate::audit::Kind::ExecStart,
        &target.sandbox_id,
        id,
        audit_command(req, patterns),
    );
    if !secret_names.is_empty() {
        crate::audit::emit(
            &target.tenant,
            crate::audit::Kind::SecretUse,
            &target.sandbox_id,
            id,
            serde_json::json!({ "names": secret_names, "delivery": "env" }),
        );
    }
}

/// The sandbox's environment with the request's entries over it (checked).
fn merged_env(
    base: &HashMap<String, String>,
    over: &HashMap<String, String>,
) -> ApiResult<HashMap<String, String>> {
    let mut env = base.clone();
    env.extend(over.iter().map(|(k, v)| (k.clone(), v.clone())));
    limits::check_env(&env)?;
    Ok(env)
}

/// Interpreter flags whose next argument is code (`python3 -c CODE`, `node -e CODE`).
const CODE_FLAGS: &[&str] = &["-c", "-e", "--eval", "-E", "--command"];

/// An execution's command as the audit trail keeps it: code and long arguments as their
/// SHA-256 and size, unless the operator records code (then redacted of secret values).
fn audit_command(
    req: &ExecRequest,
    patterns: &crate::secrets::redact::Patterns,
) -> serde_json::Value {
    use crate::audit::digest;
    let raw = crate::audit::records_code();
    let code = |text: &str| {
        let mut d = digest(text.as_bytes());
        if raw {
            d["text"] = patterns.redact_str(text).into_owned().into();
        }
        d
    };
    let command = match &req.command {
        Some(exec_request::Command::Argv(a)) => serde_json::json!({
            "argv": a.args.iter().enumerate().map(|(i, arg)| {
                let after_code_flag = i > 0
                    && a.args.get(i - 1).is_some_and(|f| CODE_FLAGS.contains(&f.as_str()));
                if after_code_flag || arg.len() > 256 || arg.contains('\n') {
                    code(arg)
                } else {
                    patterns.redact_str(arg).into_owned().into()
                }
            }).collect::<Vec<serde_json::Value>>()
        }),
        Some(exec_request::Command::Code(c)) => {
            serde_json::json!({ "language": c.language, "code": code(&c.source) })
        }
        Some(exec_request::Command::Shell(sh)) => serde_json::json!({ "shell": code(sh) }),
        None => serde_json::Value::Null,
    };
    serde_json::json!({
        "command": command,
        "user": req.user,
        "cwd": req.cwd,
        "timeout_ms": req.timeout_ms,
        "stdin": digest(&req.stdin),
    })
}

/// The command line an Exec request runs.
fn command_of(req: &ExecRequest) -> ApiResult<Vec<String>> {
    let argv = match &req.command {
        Some(exec_request::Command::Argv(a)) => a.args.clone(),
        Some(exec_request::Command::Shell(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        Some(exec_request::Command::Code(c)) => match c.language.as_str() {
            "" | "python" | "python3" => vec!["python3".into(), "-c".into(), c.source.clone()],
            "sh" | "bash" | "shell" => vec!["/bin/sh".into(), "-c".into(), c.source.clone()],
            other => {
                return Err(ApiError::InvalidArgument(format!(
                    "language {other:?}: use python or sh"
                )));
            }
        },
        None => return Err(ApiError::InvalidArgument("no command".into())),
    };
    limits::check_command(&argv, &req.stdin, &req.cwd)?;
    limits::check_user(&req.user)?;
    Ok(argv)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::v1::{Argv, Code};

    #[test]
    fn commands_are_built_and_checked() {
        let mut req = ExecRequest {
            command: Some(exec_request::Command::Code(Code {
                language: String::new(),
                source: "print(42)".into(),
            })),
            ..Default::default()
        };
        assert_eq!(command_of(&req).unwrap(), ["python3", "-c", "print(42)"]);
        req.command = Some(exec_request::Command::Code(Code {
            language: "ruby".into(),
            source: String::new(),
        }));
        assert!(command_of(&req).is_err());
        req.command = Some(exec_request::Command::Argv(Argv { args: vec![] }));
        assert!(command_of(&req).is_err());
        req.command = Some(exec_request::Command::Argv(Argv {
            args: vec!["a\0b".into()],
        }));
        assert!(command_of(&req).is_err());
        req.command = None;
        assert!(command_of(&req).is_err());
    }

    #[test]
    fn request_env_goes_over_the_sandboxs_and_is_checked() {
        let base = HashMap::from([("A".to_owned(), "1".to_owned()), ("B".into(), "2".into())]);
        let over = HashMap::from([("B".to_owned(), "3".to_owned())]);
        let env = merged_env(&base, &over).unwrap();
        assert_eq!(env["A"], "1");
        assert_eq!(env["B"], "3");
        for bad in ["", "A=B", "A\0"] {
            let over = HashMap::from([(bad.to_owned(), "x".to_owned())]);
            assert!(merged_env(&base, &over).is_err(), "{bad:?}");
        }
    }
}
