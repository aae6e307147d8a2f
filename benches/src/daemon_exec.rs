//! Executions and file reads through a live daemon (`create` bench): what a user's call costs
//! end to end, the gRPC API, airlockd and its agent connection included. `exec_true_ms`:
//! Exec of `true` until its exit event on StreamExecution; `read_file_ms`: ReadFile of a small
//! file; `stdout_mib_s`: `head -c M MiB` of /dev/zero streamed to the client.

use std::time::Instant;

use airlock_api::v1::*;

use super::{Client, log, summary};

/// Runs `argv` in sandbox `id` and follows its stream to the exit: stdout bytes, exit code.
async fn run_to_exit(c: &mut Client, id: &str, argv: &[&str]) -> Result<(u64, i32), String> {
    let ex = c
        .exec(ExecRequest {
            sandbox_id: id.into(),
            command: Some(exec_request::Command::Argv(Argv {
                args: argv.iter().map(|s| (*s).to_owned()).collect(),
            })),
            timeout_ms: 600_000,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("exec: {}", e.message()))?
        .into_inner();
    let mut s = c
        .stream_execution(StreamExecutionRequest {
            execution_id: ex.execution_id,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("stream: {}", e.message()))?
        .into_inner();
    let mut stdout = 0u64;
    while let Some(ev) = s.message().await.map_err(|e| e.message().to_owned())? {
        match ev.event {
            Some(execution_event::Event::Output(o)) if o.stream == StreamKind::Stdout as i32 => {
                stdout += o.data.len() as u64;
            }
            Some(execution_event::Event::Exit(e)) => return Ok((stdout, e.exit_code)),
            _ => {}
        }
    }
    Err("the execution's stream ended without an exit".into())
}

async fn read_file(c: &mut Client, id: &str, path: &str) -> Result<usize, String> {
    let mut chunks = c
        .read_file(ReadFileRequest {
            sandbox_id: id.into(),
            path: path.into(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("read: {}", e.message()))?
        .into_inner();
    let mut n = 0;
    while let Some(ch) = chunks.message().await.map_err(|e| e.message().to_owned())? {
        n += ch.data.len();
    }
    Ok(n)
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// The measures, in one fresh sandbox of the default template.
pub async fn measure(c: &Client, runs: usize, mib: usize) -> Result<serde_json::Value, String> {
    let mut c = c.clone();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .map_err(|e| format!("create: {}", e.message()))?
        .into_inner();
    let id = sb.id.clone();
    let result = async {
        let t = Instant::now();
        let (_, code) = run_to_exit(&mut c, &id, &["sh", "-c", "echo bench > /tmp/bench"]).await?;
        if code != 0 {
            return Err(format!("writing /tmp/bench: exit {code}"));
        }
        let first_exec_ms = ms_since(t);
        let mut exec_true = Vec::new();
        for i in 0..runs {
            let t = Instant::now();
            let (_, code) = run_to_exit(&mut c, &id, &["true"]).await?;
            if code != 0 {
                return Err(format!("true: exit {code}"));
            }
            exec_true.push(ms_since(t));
            log(&format!(
                "daemon exec {}/{runs}: {:.1} ms",
                i + 1,
                ms_since(t)
            ));
        }
        let mut reads = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            if read_file(&mut c, &id, "/tmp/bench").await? != 6 {
                return Err("ReadFile of /tmp/bench: not its 6 bytes".into());
            }
            reads.push(ms_since(t));
        }
        let mut rates = Vec::new();
        let arg = format!("{mib}M");
        for _ in 0..runs.clamp(1, 3) {
            let t = Instant::now();
            let (bytes, code) =
                run_to_exit(&mut c, &id, &["head", "-c", &arg, "/dev/zero"]).await?;
            if code != 0 || bytes != (mib as u64) << 20 {
                return Err(format!("head: exit {code}, {bytes} bytes"));
            }
            rates.push(mib as f64 / t.elapsed().as_secs_f64());
            log(&format!(
                "daemon stdout: {:.3} MiB/s",
                rates[rates.len() - 1]
            ));
        }
        Ok(serde_json::json!({
            "first_exec_ms": first_exec_ms,
            "exec_true_ms": summary(&exec_true),
            "read_file_ms": summary(&reads),
            "stdout_mib_s": summary(&rates),
            "stdout_mib": mib,
        }))
    }
    .await;
    let _ = c
        .destroy_sandbox(DestroySandboxRequest { sandbox_id: id })
        .await;
    result
}
