//! `airlock`: the command-line client of `airlockd`. It finds the daemon at its default Unix
//! socket or `$AIRLOCK_ADDR`, and sends `$AIRLOCK_TOKEN` as the tenant token if set.

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;

use airlock_api::v1::*;
use tokio_stream_shim::next;

const USAGE: &str = "\
usage: airlock [--json] COMMAND
  template create NAME [--vcpus N] [--memory-mib M] [--kernel PATH] [--rootfs PATH]
                       [--warmup 'SHELL COMMAND' | --no-warmup]
  template ls | template rm NAME
  create [--template NAME] [--env K=V]... [--label K=V]... [--idle-ttl S] [--lifetime S]
  ls
  exec ID [--timeout S] [--cwd DIR] [--env K=V]... [--memory-mib M] -- CMD [ARGS...]
                                            (exit code = CMD's)
  logs EXEC_ID
  cp LOCAL ID:PATH | cp ID:PATH LOCAL
  pause ID | resume ID | snapshot ID TEMPLATE | rm ID
The daemon: $AIRLOCK_ADDR (unix:///PATH or http://HOST:PORT), default unix:///run/airlock/airlockd.sock;
a tenant token: $AIRLOCK_TOKEN.";

/// Minimal stream helper (tonic's Streaming has `message()`).
mod tokio_stream_shim {
    pub async fn next<T>(s: &mut tonic::Streaming<T>) -> Result<Option<T>, tonic::Status> {
        s.message().await
    }
}

type Client = airlock_api::v1::airlock_client::AirlockClient<airlock_api::AuthChannel>;

struct Cli {
    json: bool,
    client: Client,
}

fn fail(status: tonic::Status) -> String {
    match airlock_api::error_info(&status) {
        Some((reason, meta)) if !meta.is_empty() => {
            let mut m: Vec<_> = meta.into_iter().collect();
            m.sort();
            let ctx: Vec<String> = m.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{reason}: {} ({})", status.message(), ctx.join(", "))
        }
        Some((reason, _)) => format!("{reason}: {}", status.message()),
        None => format!("{:?}: {}", status.code(), status.message()),
    }
}

fn kv(list: &[String]) -> Result<HashMap<String, String>, String> {
    list.iter()
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("{s:?}: expected K=V"))
        })
        .collect()
}

fn state_name(s: i32) -> &'static str {
    match SandboxState::try_from(s) {
        Ok(SandboxState::Starting) => "starting",
        Ok(SandboxState::Running) => "running",
        Ok(SandboxState::Paused) => "paused",
        Ok(SandboxState::Dead) => "dead",
        Ok(SandboxState::Destroyed) => "destroyed",
        _ => "unknown",
    }
}

fn sandbox_json(s: &Sandbox) -> serde_json::Value {
    serde_json::json!({
        "id": s.id, "tenant": s.tenant, "template": s.template, "template_id": s.template_id,
        "state": state_name(s.state), "end_reason": s.end_reason, "end_message": s.end_message,
        "vcpus": s.vcpus, "memory_mib": s.memory_mib, "labels": s.labels,
        "created_unix_ms": s.created_unix_ms, "create_ms": s.create_ms,
        "create_host_ms": s.create_host_ms, "create_guest_ms": s.create_guest_ms,
        "restore_ms": s.restore_ms,
    })
}

fn template_json(t: &Template) -> serde_json::Value {
    serde_json::json!({
        "name": t.name, "id": t.id, "tenant": t.tenant, "vcpus": t.vcpus,
        "memory_mib": t.memory_mib, "kernel_path": t.kernel_path, "kernel_version": t.kernel_version,
        "rootfs_path": t.rootfs_path, "rootfs_version": t.rootfs_version,
        "source_sandbox_id": t.source_sandbox_id, "created_unix_ms": t.created_unix_ms,
    })
}

/// Takes `--flag VALUE` options from `args` until a non-option (or `--`).
fn options(
    args: &mut Vec<String>,
    multi: &[&str],
    single: &[&str],
) -> Result<HashMap<String, Vec<String>>, String> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let mut rest = Vec::new();
    let mut it = std::mem::take(args).into_iter();
    while let Some(a) = it.next() {
        if a == "--" {
            rest.extend(it.by_ref());
            break;
        }
        if multi.contains(&a.as_str()) || single.contains(&a.as_str()) {
            let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
            out.entry(a).or_default().push(v);
        } else {
            rest.push(a);
        }
    }
    *args = rest;
    Ok(out)
}

fn one<'a>(o: &'a HashMap<String, Vec<String>>, k: &str) -> Option<&'a str> {
    o.get(k).and_then(|v| v.last()).map(String::as_str)
}

fn num(o: &HashMap<String, Vec<String>>, k: &str) -> Result<u32, String> {
    one(o, k).map_or(Ok(0), |v| v.parse().map_err(|_| format!("{k}: a number")))
}

impl Cli {
    async fn run(&mut self, mut args: Vec<String>) -> Result<u8, String> {
        if args.is_empty() {
            return Err(String::new());
        }
        let cmd = args.remove(0);
        match cmd.as_str() {
            "template" => self.template(args).await,
            "create" => {
                let o = options(
                    &mut args,
                    &["--env", "--label"],
                    &["--template", "--idle-ttl", "--lifetime"],
                )?;
                let req = CreateSandboxRequest {
                    template: one(&o, "--template").unwrap_or_default().to_owned(),
                    env: kv(o.get("--env").map(Vec::as_slice).unwrap_or_default())?,
                    labels: kv(o.get("--label").map(Vec::as_slice).unwrap_or_default())?,
                    idle_ttl_s: num(&o, "--idle-ttl")?,
                    max_lifetime_s: num(&o, "--lifetime")?,
                    ..Default::default()
                };
                let s = self
                    .client
                    .create_sandbox(req)
                    .await
                    .map_err(fail)?
                    .into_inner();
                if self.json {
                    println!("{}", sandbox_json(&s));
                } else {
                    println!("{}", s.id);
                    eprintln!(
                        "ready in {:.1} ms (host {:.1} ms, guest {:.1} ms, restore {:.2} ms)",
                        s.create_ms, s.create_host_ms, s.create_guest_ms, s.restore_ms
                    );
                }
                Ok(0)
            }
            "ls" => {
                let r = self
                    .client
                    .list_sandboxes(ListSandboxesRequest::default())
                    .await
                    .map_err(fail)?
                    .into_inner();
                if self.json {
                    println!(
                        "{}",
                        serde_json::Value::Array(r.sandboxes.iter().map(sandbox_json).collect())
                    );
                } else {
                    println!(
                        "{:<20} {:<10} {:<12} {:>5} {:>7}",
                        "ID", "STATE", "TEMPLATE", "VCPUS", "MEM_MIB"
                    );
                    for s in &r.sandboxes {
                        println!(
                            "{:<20} {:<10} {:<12} {:>5} {:>7}",
                            s.id,
                            state_name(s.state),
                            s.template,
                            s.vcpus,
                            s.memory_mib
                        );
                    }
                }
                Ok(0)
            }
            "exec" => self.exec(args).await,
            "logs" => {
                let id = args.first().ok_or("logs EXEC_ID")?.clone();
                self.follow(&id).await
            }
            "cp" => self.cp(args).await,
            "pause" | "resume" | "rm" => {
                let id = args.first().ok_or(format!("{cmd} ID"))?.clone();
                match cmd.as_str() {
                    "pause" => {
                        self.client
                            .pause_sandbox(PauseSandboxRequest {
                                sandbox_id: id.clone(),
                            })
                            .await
                            .map_err(fail)?;
                    }
                    "resume" => {
                        self.client
                            .resume_sandbox(ResumeSandboxRequest {
                                sandbox_id: id.clone(),
                            })
                            .await
                            .map_err(fail)?;
                    }
                    _ => {
                        let r = self
                            .client
                            .destroy_sandbox(DestroySandboxRequest {
                                sandbox_id: id.clone(),
                            })
                            .await
                            .map_err(fail)?
                            .into_inner();
                        if self.json {
                            println!(
                                "{}",
                                serde_json::json!({"id": id, "destroyed": r.destroyed})
                            );
                        }
                    }
                }
                Ok(0)
            }
            "snapshot" => {
                let (id, name) = match &args[..] {
                    [id, name] => (id.clone(), name.clone()),
                    _ => return Err("snapshot ID TEMPLATE".into()),
                };
                let t = self
                    .client
                    .snapshot_sandbox(SnapshotSandboxRequest {
                        sandbox_id: id,
                        template_name: name,
                    })
                    .await
                    .map_err(fail)?
                    .into_inner();
                if self.json {
                    println!("{}", template_json(&t));
                } else {
                    println!("{} ({})", t.name, t.id);
                }
                Ok(0)
            }
            other => Err(format!("unknown command {other}")),
        }
    }

    async fn template(&mut self, mut args: Vec<String>) -> Result<u8, String> {
        let sub = if args.is_empty() {
            String::new()
        } else {
            args.remove(0)
        };
        match sub.as_str() {
            "create" => {
                let no_warmup = args.iter().any(|a| a == "--no-warmup");
                args.retain(|a| a != "--no-warmup");
                let o = options(
                    &mut args,
                    &[],
                    &[
                        "--vcpus",
                        "--memory-mib",
                        "--kernel",
                        "--rootfs",
                        "--warmup",
                    ],
                )?;
                let name = args.first().ok_or("template create NAME")?.clone();
                let req = CreateTemplateRequest {
                    name,
                    kernel_path: one(&o, "--kernel").unwrap_or_default().to_owned(),
                    rootfs_path: one(&o, "--rootfs").unwrap_or_default().to_owned(),
                    vcpus: num(&o, "--vcpus")?,
                    memory_mib: num(&o, "--memory-mib")?,
                    warmup: one(&o, "--warmup").unwrap_or_default().to_owned(),
                    no_warmup,
                };
                let mut stream = self
                    .client
                    .create_template(req)
                    .await
                    .map_err(fail)?
                    .into_inner();
                while let Some(ev) = next(&mut stream).await.map_err(fail)? {
                    eprintln!(
                        "[{:>6.1} s] {}: {}",
                        ev.elapsed_ms as f64 / 1000.0,
                        ev.phase,
                        ev.message
                    );
                    if let Some(t) = ev.template {
                        if self.json {
                            println!("{}", template_json(&t));
                        } else {
                            println!("{} ({})", t.name, t.id);
                        }
                    }
                }
                Ok(0)
            }
            "ls" => {
                let r = self
                    .client
                    .list_templates(ListTemplatesRequest {})
                    .await
                    .map_err(fail)?
                    .into_inner();
                if self.json {
                    println!(
                        "{}",
                        serde_json::Value::Array(r.templates.iter().map(template_json).collect())
                    );
                } else {
                    println!(
                        "{:<16} {:<22} {:>5} {:>7} {:<8}",
                        "NAME", "ID", "VCPUS", "MEM_MIB", "OWNER"
                    );
                    for t in &r.templates {
                        let owner = if t.tenant.is_empty() {
                            "shared"
                        } else {
                            &t.tenant
                        };
                        println!(
                            "{:<16} {:<22} {:>5} {:>7} {:<8}",
                            t.name, t.id, t.vcpus, t.memory_mib, owner
                        );
                    }
                }
                Ok(0)
            }
            "rm" => {
                let name = args.first().ok_or("template rm NAME")?.clone();
                self.client
                    .delete_template(DeleteTemplateRequest { name })
                    .await
                    .map_err(fail)?;
                Ok(0)
            }
            _ => Err("template create|ls|rm".into()),
        }
    }

    async fn exec(&mut self, mut args: Vec<String>) -> Result<u8, String> {
        let o = options(
            &mut args,
            &["--env"],
            &["--timeout", "--cwd", "--memory-mib"],
        )?;
        if args.len() < 2 {
            return Err("exec ID [options] -- CMD [ARGS...]".into());
        }
        let id = args.remove(0);
        let req = ExecRequest {
            sandbox_id: id,
            command: Some(exec_request::Command::Argv(Argv { args })),
            cwd: one(&o, "--cwd").unwrap_or_default().to_owned(),
            env: kv(o.get("--env").map(Vec::as_slice).unwrap_or_default())?,
            timeout_ms: u64::from(num(&o, "--timeout")?) * 1000,
            stdin: Vec::new(),
            memory_limit_mib: num(&o, "--memory-mib")?,
        };
        let ex = self.client.exec(req).await.map_err(fail)?.into_inner();
        if self.json {
            eprintln!("{}", serde_json::json!({"execution_id": ex.execution_id}));
        }
        self.follow(&ex.execution_id).await
    }

    /// Streams an execution's output to ours; returns its exit code.
    async fn follow(&mut self, id: &str) -> Result<u8, String> {
        let req = StreamExecutionRequest {
            execution_id: id.to_owned(),
            ..Default::default()
        };
        let mut stream = self
            .client
            .stream_execution(req)
            .await
            .map_err(fail)?
            .into_inner();
        while let Some(ev) = next(&mut stream).await.map_err(fail)? {
            match ev.event {
                Some(execution_event::Event::Output(o)) => {
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
                    return Ok(match ExecutionState::try_from(e.state) {
                        Ok(ExecutionState::Exited) if e.exit_code >= 0 => {
                            e.exit_code.min(255) as u8
                        }
                        Ok(ExecutionState::TimedOut) => 124,
                        _ if e.signal > 0 => (128 + e.signal).min(255) as u8,
                        _ => 1,
                    });
                }
                None => {}
            }
        }
        Err("the stream ended without an exit".into())
    }

    async fn cp(&mut self, args: Vec<String>) -> Result<u8, String> {
        let [from, to] = &args[..] else {
            return Err("cp LOCAL ID:PATH | cp ID:PATH LOCAL".into());
        };
        if let Some((id, path)) = to.split_once(':').filter(|(id, _)| id.starts_with("sb-")) {
            let data = std::fs::read(from).map_err(|e| format!("{from}: {e}"))?;
            let mut msgs = vec![WriteFileRequest {
                part: Some(write_file_request::Part::Header(WriteFileHeader {
                    sandbox_id: id.into(),
                    path: path.into(),
                    mode: 0,
                })),
            }];
            for c in data.chunks(1 << 20) {
                msgs.push(WriteFileRequest {
                    part: Some(write_file_request::Part::Data(c.to_vec())),
                });
            }
            let r = self
                .client
                .write_file(tokio_stream_iter(msgs))
                .await
                .map_err(fail)?
                .into_inner();
            eprintln!("{} bytes written", r.bytes_written);
            Ok(0)
        } else if let Some((id, path)) = from.split_once(':') {
            let mut s = self
                .client
                .read_file(ReadFileRequest {
                    sandbox_id: id.into(),
                    path: path.into(),
                })
                .await
                .map_err(fail)?
                .into_inner();
            let mut out = Vec::new();
            while let Some(c) = next(&mut s).await.map_err(fail)? {
                out.extend_from_slice(&c.data);
            }
            std::fs::write(to, &out).map_err(|e| format!("{to}: {e}"))?;
            Ok(0)
        } else {
            Err("one side must be ID:PATH".into())
        }
    }
}

/// A request stream from a list of messages.
fn tokio_stream_iter<T: Send + 'static>(
    items: Vec<T>,
) -> impl tonic::codegen::tokio_stream::Stream<Item = T> + Send + 'static {
    tonic::codegen::tokio_stream::iter(items)
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--json` counts anywhere before a `--` (after it, it belongs to the remote command).
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let json = args[..end].iter().any(|a| a == "--json");
    if let Some(i) = args[..end].iter().position(|a| a == "--json") {
        args.remove(i);
    }
    if args.first().is_some_and(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("airlock: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(async move {
        let token = std::env::var("AIRLOCK_TOKEN").ok();
        let addr = airlock_api::default_address();
        let client = match airlock_api::client(Some(&addr), token.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "airlock: cannot reach airlockd at {addr}: {e} (start it, or set AIRLOCK_ADDR)"
                );
                return ExitCode::from(1);
            }
        };
        let mut cli = Cli { json, client };
        match cli.run(args).await {
            Ok(code) => ExitCode::from(code),
            Err(e) if e.is_empty() => {
                eprintln!("{USAGE}");
                ExitCode::from(2)
            }
            Err(e) => {
                eprintln!("airlock: {e}");
                ExitCode::from(1)
            }
        }
    })
}
