//! `airlockd`: Airlock's host daemon. Serves the gRPC lifecycle service (`proto/airlock.proto`)
//! on a Unix socket (default `/run/airlock/airlockd.sock`) and optionally TCP, keeps templates
//! and records in its data directory, and runs one jailed `airlock-vmm` process per sandbox.
//!
//! Its parts, each owning one thing (ARCHITECTURE.md has the map): `daemon` (the composition
//! root), `server` and `service` (listeners, the thin gRPC layer), `settings` (the settings
//! file, split among its owners), `config` (the daemon's own settings), `error`,
//! `reason` (why things end, as types), `ids`, `store` (SQLite records), `metrics`; VMM
//! processes: `jail`, `vmm` (the launcher seam, control socket, exit meaning), `host`
//! (starting them), `supervisor` (their exits as events), `cgroup`; `templates` (registry and
//! builds), `pool` (warm VMMs); `sandbox` (spec, admission, create, operations, end);
//! `exec` (executions), `stream` (their output), `files` (transfers), `agent` (connections
//! to the guest agent); `janitor` (TTLs); `recovery` (adopt or reap after a restart).

mod agent;
mod audit;
mod auth;
mod cgroup;
mod cluster;
mod config;
mod daemon;
mod e2b;
mod error;
mod events;
mod exec;
mod fileinfo;
mod files;
mod host;
mod ids;
mod imagebuild;
mod instance;
mod interp;
mod jail;
mod janitor;
mod limits;
mod metrics;
mod net;
mod oci;
mod pkg;
mod pool;
mod reason;
mod recovery;
mod retention;
mod rpc;
mod sandbox;
mod sbom;
mod secrets;
mod server;
mod service;
mod settings;
mod store;
mod stream;
mod supervisor;
mod tcp;
mod templates;
mod transfer;
mod versions;
mod vmm;
mod volumes;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod lifecycle_tests;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracing::{error, info};

/// Serves Airlock's gRPC lifecycle service (package airlock.v1, with reflection). Logs go to
/// stderr; RUST_LOG filters them (default info).
#[derive(Debug, Parser)]
#[command(name = "airlockd", version)]
struct Args {
    /// TOML settings over the defaults (see docs/operations.md).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// unix://PATH or tcp://HOST:PORT (repeatable; replaces the configured list; default
    /// unix:///run/airlock/airlockd.sock). TCP calls need a tenant token.
    #[arg(long, value_name = "ADDR")]
    listen: Vec<String>,
    /// Templates, records, output, VMM run directories (default /var/lib/airlock).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Read a tenant token on stdin, print its SHA-256 for `token_sha256` in the settings, and
    /// exit.
    #[arg(long)]
    hash_token: bool,
}

fn settings(args: Args) -> Result<settings::Settings, error::StartError> {
    let mut s = match &args.config {
        Some(p) => settings::Settings::load(p)?,
        None => settings::Settings::default(),
    };
    if !args.listen.is_empty() {
        s.daemon.listen = args.listen;
    }
    if let Some(d) = args.data_dir {
        s.daemon.data_dir = d;
    }
    s.check_exposure()?;
    Ok(s)
}

/// The daemon holds every tenant's secrets in memory: no core file is written of it, and no
/// process of another uid may ptrace it or read its memory through /proc (also without the
/// unit's `LimitCORE=0`).
fn no_core_dumps() -> std::io::Result<()> {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit(2) reads the struct passed by reference for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: prctl(2) PR_SET_DUMPABLE takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `--hash-token`: the digest of the token on stdin.
fn hash_token() -> ExitCode {
    let mut token = String::new();
    if std::io::stdin().read_line(&mut token).is_err() || token.trim().is_empty() {
        eprintln!("airlockd --hash-token: give the token on stdin");
        return ExitCode::from(2);
    }
    println!("sha256:{}", auth::hex(&auth::digest(token.trim())));
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    // What the daemon creates (records, output, snapshots, logs) is its own unless it says
    // otherwise (the API socket, 0660; the jails' roots, 0755).
    // SAFETY: umask(2) only sets this process's file-creation mask.
    unsafe { libc::umask(0o077) };
    if let Err(e) = no_core_dumps() {
        eprintln!("airlockd: making the process non-dumpable: {e}");
        return ExitCode::FAILURE;
    }
    let args = Args::parse();
    if args.hash_token {
        return hash_token();
    }
    let cfg = match settings(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("airlockd: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(secrets::logs::RedactingStderr)
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
    // Blocking agent calls still waiting on guests end with the process.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(settings: settings::Settings) -> Result<(), error::StartError> {
    let settings::Settings {
        daemon: cfg,
        cluster,
        e2b,
    } = settings;
    // Before anything is reaped: a second daemon sharing a part of this one is refused.
    let _instance = lock_instance(&cfg)?;
    let (daemon, events) = tokio::task::spawn_blocking(move || daemon::Daemon::open(cfg)).await??;
    daemon.start(events).await?;
    // Cluster mode joins after the recovery and before the listeners: what this node still
    // runs is in etcd before any call is routed.
    let cluster = match cluster.enabled() {
        true => Some(
            cluster::join(&daemon, cluster)
                .await
                .map_err(|e| error::StartError::Cluster(Box::new(e)))?,
        ),
        false => None,
    };
    let servers = server::listen(&daemon, cluster, e2b).await?;
    info!(
        templates = daemon.templates.list().len(),
        sandboxes = daemon.sandboxes.all().len(),
        pool_size = daemon.cfg.pool_size,
        vmm = %daemon.host.launcher.binary().display(),
        jail = daemon.host.launcher.jailed(),
        data_dir = %daemon.data_dir.display(),
        "airlockd ready"
    );
    let result = server::until_stopped(servers).await;
    info!("stopping");
    daemon.shutdown().await;
    result
}

/// The locks of this daemon's data directory, cgroup parent, jail uid range and sockets.
fn lock_instance(cfg: &config::Config) -> Result<instance::InstanceLock, error::StartError> {
    let data_dir = std::path::absolute(&cfg.data_dir).map_err(error::StartError::io(format!(
        "data directory {}",
        cfg.data_dir.display()
    )))?;
    instance::take(&instance::Claim {
        data_dir: &data_dir,
        lock_dir: &cfg.lock_dir,
        cgroup_parent: &cfg.cgroup_parent,
        uids: cfg
            .jail
            .enabled
            .then_some((cfg.jail.uid_base, cfg.jail.uid_count)),
        sockets: cfg.unix_sockets(),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_process_dumps_no_core_and_is_not_dumpable() {
        super::no_core_dumps().expect("no_core_dumps");
        let mut core = libc::rlimit {
            rlim_cur: 1,
            rlim_max: 1,
        };
        // SAFETY: getrlimit(2) writes the struct passed by reference.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_CORE, &mut core) }, 0);
        assert_eq!((core.rlim_cur, core.rlim_max), (0, 0));
        // SAFETY: prctl(2) PR_GET_DUMPABLE takes integers only.
        assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) }, 0);
    }
}
