//! `airlockd`: Airlock's host daemon. Serves the gRPC lifecycle service (`proto/airlock.proto`)
//! on a Unix socket (default `/run/airlock/airlockd.sock`) and optionally TCP, keeps templates
//! and records in its data directory, and runs one `airlock-vmm` process per sandbox.
//!
//! Modules: `config` (settings), `service` (gRPC and authentication), `state` (templates, warm
//! pools, sandbox lifecycle, reaping), `exec` (executions and their stored output), `files`
//! (file policy and transfer), `agent` (guest agent connections), `vmm` (VMM processes),
//! `cgroup` (per-sandbox cgroups, v1 and v2), `store` (SQLite records), `metrics` (Prometheus),
//! `error` (the one mapping to gRPC status codes).

mod agent;
mod cgroup;
mod config;
mod error;
mod exec;
mod files;
mod jail;
mod metrics;
mod service;
mod state;
mod store;
mod vmm;

use std::path::PathBuf;
use std::process::ExitCode;

use airlock_api::v1::airlock_server::AirlockServer;
use tracing::{error, info};

const USAGE: &str = "\
usage: airlockd [--config FILE] [--listen ADDR]... [--data-dir DIR]

Serves Airlock's gRPC lifecycle service (package airlock.v1, with reflection).
  --config FILE    TOML settings over the defaults (see README, \"airlockd\")
  --listen ADDR    unix://PATH or tcp://HOST:PORT (repeatable; replaces the configured list;
                   default unix:///run/airlock/airlockd.sock). TCP calls need a tenant token.
  --data-dir DIR   templates, records, output, VMM run directories (default /var/lib/airlock)
Logs go to stderr; RUST_LOG filters them (default info).";

fn parse_args() -> Result<config::Config, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg_path = None;
    let mut listen = Vec::new();
    let mut data_dir = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--config" => cfg_path = Some(PathBuf::from(value()?)),
            "--listen" => listen.push(value()?),
            "--data-dir" => data_dir = Some(PathBuf::from(value()?)),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let mut cfg = match cfg_path {
        Some(p) => config::Config::load(&p)?,
        None => config::Config::default(),
    };
    if !listen.is_empty() {
        cfg.listen = listen;
    }
    if let Some(d) = data_dir {
        cfg.data_dir = d;
    }
    Ok(cfg)
}

/// Binds a TCP listener; an address still in use is tried again for up to 5 s (a daemon
/// that was just killed may not have let go of it yet).
async fn bind_tcp(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

fn main() -> ExitCode {
    let cfg = match parse_args() {
        Ok(c) => c,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("airlockd: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("airlockd: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(serve(cfg));
    // Blocking agent calls still waiting on guests that are gone end with the process.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cfg: config::Config) -> Result<(), String> {
    let daemon = tokio::task::spawn_blocking(move || state::Daemon::open(cfg))
        .await
        .map_err(|e| e.to_string())??;
    let svc = service::Service {
        daemon: daemon.clone(),
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(airlock_api::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| format!("reflection: {e}"))?;
    let mut servers = tokio::task::JoinSet::new();
    for addr in daemon.cfg.listen.clone() {
        let token_required = !addr.starts_with("unix:");
        let auth = service::Auth {
            daemon: daemon.clone(),
            token_required,
        };
        let router = tonic::transport::Server::builder()
            .add_service(AirlockServer::with_interceptor(svc.clone(), auth))
            .add_service(reflection.clone());
        if let Some(path) = addr
            .strip_prefix("unix://")
            .or_else(|| addr.strip_prefix("unix:"))
        {
            let path = PathBuf::from(path);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            }
            let _ = std::fs::remove_file(&path);
            let listener = tokio::net::UnixListener::bind(&path)
                .map_err(|e| format!("listening on {}: {e}", path.display()))?;
            // The socket's permissions are the access control: owner and group only.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            info!("listening on unix://{}", path.display());
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            servers.spawn(async move {
                router
                    .serve_with_incoming(incoming)
                    .await
                    .map_err(|e| e.to_string())
            });
        } else if let Some(hostport) = addr.strip_prefix("tcp://") {
            let listener = bind_tcp(hostport)
                .await
                .map_err(|e| format!("listening on {hostport}: {e}"))?;
            info!(
                "listening on tcp://{} (tokens required)",
                listener.local_addr().map_err(|e| e.to_string())?
            );
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            servers.spawn(async move {
                router
                    .serve_with_incoming(incoming)
                    .await
                    .map_err(|e| e.to_string())
            });
        } else {
            return Err(format!(
                "listen address {addr:?}: use unix://PATH or tcp://HOST:PORT"
            ));
        }
    }
    if !daemon.cfg.metrics_listen.is_empty() {
        let listener = bind_tcp(&daemon.cfg.metrics_listen)
            .await
            .map_err(|e| format!("metrics on {}: {e}", daemon.cfg.metrics_listen))?;
        info!("metrics on http://{}/metrics", daemon.cfg.metrics_listen);
        let d = daemon.clone();
        tokio::spawn(metrics::serve(listener, move || d.metrics_text()));
    }
    tokio::spawn({
        let d = daemon.clone();
        async move { d.enforce_ttls().await }
    });
    daemon.refill_all();
    info!(
        templates = daemon.templates_for(&daemon.cfg.default_tenant).len(),
        pool_size = daemon.cfg.pool_size,
        vmm = %daemon.jailer.binary().display(),
        jail = daemon.jailer.enabled(),
        data_dir = %daemon.data_dir.display(),
        "airlockd ready"
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let result = tokio::select! {
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = term.recv() => Ok(()),
        r = servers.join_next() => match r {
            Some(Ok(Err(e))) => Err(e),
            _ => Ok(()),
        },
    };
    info!("stopping: ending every sandbox");
    daemon.shutdown().await;
    result
}
