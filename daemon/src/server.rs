//! The listeners: the gRPC service (with reflection) on every configured Unix socket and TCP
//! address, and the Prometheus endpoint; they serve until a signal or a listener's failure.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::airlock_server::AirlockServer;
use tokio::task::JoinSet;
use tracing::info;

use crate::daemon::Daemon;
use crate::service::{Auth, Service};

type Servers = JoinSet<Result<(), String>>;

/// Binds a TCP listener; an address still in use is tried again for up to 5 s (a daemon
/// that was just killed may not have let go of it yet).
pub async fn bind_tcp(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Starts serving on every configured address.
pub async fn listen(daemon: &Arc<Daemon>) -> Result<Servers, String> {
    let svc = Service {
        daemon: daemon.clone(),
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(airlock_api::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| format!("reflection: {e}"))?;
    let mut servers = JoinSet::new();
    for addr in &daemon.cfg.listen {
        let auth = Auth {
            cfg: daemon.cfg.clone(),
            token_required: !addr.starts_with("unix:"),
        };
        let router = tonic::transport::Server::builder()
            .add_service(AirlockServer::with_interceptor(svc.clone(), auth))
            .add_service(reflection.clone());
        if let Some(path) = addr
            .strip_prefix("unix://")
            .or_else(|| addr.strip_prefix("unix:"))
        {
            let incoming = unix_listener(PathBuf::from(path))?;
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
            let local = listener.local_addr().map_err(|e| e.to_string())?;
            info!("listening on tcp://{local} (tokens required)");
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
    serve_metrics(daemon).await?;
    Ok(servers)
}

/// A Unix socket (mode 0660: its permissions are the access control), replacing a stale one.
fn unix_listener(path: PathBuf) -> Result<tokio_stream::wrappers::UnixListenerStream, String> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)
        .map_err(|e| format!("listening on {}: {e}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    info!("listening on unix://{}", path.display());
    Ok(tokio_stream::wrappers::UnixListenerStream::new(listener))
}

async fn serve_metrics(daemon: &Arc<Daemon>) -> Result<(), String> {
    let addr = &daemon.cfg.metrics_listen;
    if addr.is_empty() {
        return Ok(());
    }
    let listener = bind_tcp(addr)
        .await
        .map_err(|e| format!("metrics on {addr}: {e}"))?;
    info!("metrics on http://{addr}/metrics");
    let d = daemon.clone();
    tokio::spawn(crate::metrics::serve(listener, move || d.metrics_text()));
    Ok(())
}

/// Serves until SIGTERM, SIGINT or a listener's failure (its error).
pub async fn until_stopped(mut servers: Servers) -> Result<(), String> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = term.recv() => Ok(()),
        r = servers.join_next() => match r {
            Some(Ok(Err(e))) => Err(e),
            _ => Ok(()),
        },
    }
}
