//! The listeners: the gRPC service (with reflection, behind the same authentication) on every
//! configured Unix socket and TCP address (TCP with TLS, at most `max_connections` at once, at
//! most `max_calls_per_connection` calls each, handshakes and idle connections under
//! `tcp::limit`'s timeouts), and the Prometheus endpoint; they serve until a signal or a
//! listener's failure.

mod metrics;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::airlock_server::AirlockServer;
use tokio::task::JoinSet;
use tokio_stream::Stream;
use tracing::info;

use tonic::service::interceptor::InterceptedService;

use crate::auth::{Auth, Tokens, digest};
use crate::cluster::Cluster;
use crate::config::Config;
use crate::daemon::Daemon;
use crate::e2b::E2bConfig;
use crate::error::StartError;
use crate::service::Service;
use crate::tcp::{limit, tls};

type Servers = JoinSet<Result<(), StartError>>;

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
pub async fn listen(
    daemon: &Arc<Daemon>,
    cluster: Option<Arc<Cluster>>,
    e2b: E2bConfig,
) -> Result<Servers, StartError> {
    let svc = Service {
        daemon: daemon.clone(),
        cluster: cluster.clone(),
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(airlock_api::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| StartError::Serve(format!("reflection: {e}")))?;
    let tokens = Arc::new(Tokens::from_config(&daemon.cfg)?);
    let cfg = &daemon.cfg;
    let mut servers = JoinSet::new();
    for addr in &cfg.listen {
        let tcp = !addr.starts_with("unix:");
        let auth = auth_of(&tokens, cfg, tcp, cluster.as_deref());
        // Cluster mode: calls are routed to the node that holds what they name.
        let route = cluster.as_ref().map(|c| crate::cluster::RouteLayer {
            cluster: c.clone(),
            auth: auth.clone(),
        });
        // Live clients answer the pings, so only a dead or stalled one idles out (limit.rs).
        let ping = Duration::from_millis(cfg.idle_timeout_ms.max(2) / 2);
        let builder = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(cfg.max_calls_per_connection)
            .max_concurrent_streams(u32::try_from(cfg.max_calls_per_connection).ok())
            .http2_keepalive_interval(Some(ping))
            .http2_keepalive_timeout(Some(ping));
        // Reflection describes the API to callers the listener authenticates, like the API.
        let router = builder
            .layer(tower::util::option_layer(route))
            .add_service(AirlockServer::with_interceptor(svc.clone(), auth.clone()))
            .add_service(InterceptedService::new(reflection.clone(), auth));
        if let Some(path) = crate::config::unix_path(addr) {
            let incoming = unix_listener(path)?;
            servers.spawn(async move {
                router
                    .serve_with_incoming(incoming)
                    .await
                    .map_err(|e| StartError::Serve(e.to_string()))
            });
        } else if let Some(hostport) = addr.strip_prefix("tcp://") {
            let incoming = tcp_incoming(hostport, cfg).await?;
            servers.spawn(async move {
                router
                    .serve_with_incoming(incoming)
                    .await
                    .map_err(|e| StartError::Serve(e.to_string()))
            });
        } else {
            return Err(StartError::Setting(format!(
                "listen address {addr:?}: use unix://PATH or tcp://HOST:PORT"
            )));
        }
    }
    serve_metrics(daemon).await?;
    if !e2b.listen.is_empty() {
        let listener = bind_tcp(&e2b.listen)
            .await
            .map_err(StartError::io(format!("[e2b] listen {}", e2b.listen)))?;
        servers.spawn(crate::e2b::serve(listener, daemon.clone(), e2b, tokens));
    }
    Ok(servers)
}

/// Listen step: the authentication of a listener (tokens required on TCP; the cluster's
/// token known in cluster mode).
fn auth_of(tokens: &Arc<Tokens>, cfg: &Config, tcp: bool, cluster: Option<&Cluster>) -> Auth {
    Auth {
        tokens: tokens.clone(),
        default_tenant: cfg.default_tenant.clone(),
        token_required: tcp,
        cluster_token: cluster.map(|c| c.token_digest),
    }
}

/// Listen step: the connections of a TCP listener on `hostport`, at most `max_connections` at
/// once, TLS (with `[tls]`) done by [`limit::connections`] under its handshake timeout.
async fn tcp_incoming(
    hostport: &str,
    cfg: &Config,
) -> Result<impl Stream<Item = std::io::Result<limit::Conn>> + use<>, StartError> {
    let acceptor = match &cfg.tls {
        Some(t) => Some(tls::acceptor(t, &[b"h2"], true)?),
        None => None,
    };
    let listener = bind_tcp(hostport)
        .await
        .map_err(StartError::io(format!("listening on {hostport}")))?;
    let local = listener
        .local_addr()
        .map_err(StartError::io(format!("listening on {hostport}")))?;
    let tls = if cfg.tls.is_some() { "TLS" } else { "no TLS" };
    info!("listening on tcp://{local} (tokens required, {tls})");
    Ok(limit::connections(
        listener,
        limit::ConnLimits::of(cfg),
        acceptor,
    ))
}

/// A Unix socket (mode 0660: its permissions are the access control), replacing a stale one
/// (never one that answers: another daemon's).
fn unix_listener(path: PathBuf) -> Result<tokio_stream::wrappers::UnixListenerStream, StartError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(StartError::io(dir.display().to_string()))?;
    }
    crate::instance::refuse_answering(&path)?;
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)
        .map_err(StartError::io(format!("listening on {}", path.display())))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660))
        .map_err(StartError::io(path.display().to_string()))?;
    info!("listening on unix://{}", path.display());
    Ok(tokio_stream::wrappers::UnixListenerStream::new(listener))
}

async fn serve_metrics(daemon: &Arc<Daemon>) -> Result<(), StartError> {
    let addr = &daemon.cfg.metrics_listen;
    if addr.is_empty() {
        return Ok(());
    }
    let listener = bind_tcp(addr)
        .await
        .map_err(StartError::io(format!("metrics on {addr}")))?;
    info!("metrics on http://{addr}/metrics");
    let d = daemon.clone();
    let token = (!daemon.cfg.metrics_token.is_empty()).then(|| digest(&daemon.cfg.metrics_token));
    let deadline = Duration::from_millis(daemon.cfg.header_read_timeout_ms);
    tokio::spawn(metrics::serve(listener, token, deadline, move || {
        d.metrics_text()
    }));
    Ok(())
}

/// Serves until SIGTERM, SIGINT or a listener's failure (its error).
pub async fn until_stopped(mut servers: Servers) -> Result<(), StartError> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(StartError::io("SIGTERM handler"))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = term.recv() => Ok(()),
        r = servers.join_next() => match r {
            Some(Ok(Err(e))) => Err(e),
            _ => Ok(()),
        },
    }
}
