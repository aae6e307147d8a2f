//! `airlock-create-bench --net-run`: one daemon, one sandbox with a network policy, ARGV run in
//! it (benches/net.py times the guest's TCP through the daemon's egress proxy with it).

use super::*;

/// `--net-run`: ARGV in one sandbox whose policy allows the domains given; its exit code.
pub async fn net_run(a: Args) -> Result<i32, String> {
    let dir = std::env::temp_dir().join(format!("airlock-netrun-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = format!("pool_size = 1\nmax_sandboxes = 4\n{}\n", a.config_extra);
    let r = async {
        let (daemon, mut c) = start_daemon(&a, &dir, "net", &config).await?;
        make_template(&c).await?;
        wait_pool(&daemon, 1).await?;
        let t = Instant::now();
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                network: Some(NetworkPolicy {
                    allow_internet: false,
                    allow: a
                        .allow_domains
                        .iter()
                        .map(|d| EgressRule {
                            target: Some(egress_rule::Target::Domain(d.clone())),
                            ports: Vec::new(),
                        })
                        .collect(),
                }),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("create: {}", e.message()))?
            .into_inner();
        log(&format!(
            "sandbox {} ready after {:.0} ms (network: {})",
            sb.id,
            t.elapsed().as_secs_f64() * 1000.0,
            a.allow_domains.join(",")
        ));
        let code = guest_exec(&mut c, &sb.id, &a.net_argv, |data| {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(data);
            let _ = out.flush();
        })
        .await;
        let _ = c
            .destroy_sandbox(DestroySandboxRequest {
                sandbox_id: sb.id.clone(),
            })
            .await;
        drop(daemon);
        code
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Runs `argv` in the sandbox as root, its stdout to `on_stdout` and its stderr to ours; its
/// exit code.
pub async fn guest_exec(
    c: &mut Client,
    id: &str,
    argv: &[String],
    mut on_stdout: impl FnMut(&[u8]),
) -> Result<i32, String> {
    use std::io::Write as _;
    let ex = c
        .exec(ExecRequest {
            sandbox_id: id.into(),
            command: Some(exec_request::Command::Argv(Argv {
                args: argv.to_vec(),
            })),
            timeout_ms: 3_600_000,
            user: "root".into(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("exec: {}", e.message()))?
        .into_inner();
    let mut s = c
        .stream_execution(StreamExecutionRequest {
            execution_id: ex.execution_id.clone(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("stream: {}", e.message()))?
        .into_inner();
    while let Some(ev) = s.message().await.map_err(|e| e.message().to_owned())? {
        match ev.event {
            Some(execution_event::Event::Output(o)) if o.stream == StreamKind::Stdout as i32 => {
                on_stdout(&o.data);
            }
            Some(execution_event::Event::Output(o)) => {
                let _ = std::io::stderr().write_all(&o.data);
            }
            Some(execution_event::Event::Exit(e)) => {
                log(&format!(
                    "guest command: state {} exit {}",
                    e.state, e.exit_code
                ));
                let exited = e.state == ExecutionState::Exited as i32;
                return Ok(if exited || e.exit_code != 0 {
                    e.exit_code
                } else {
                    1
                });
            }
            None => {}
        }
    }
    Err("the execution's stream ended without an exit".into())
}
