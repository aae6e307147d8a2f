//! `airlock-agent`: PID 1 inside every Airlock microVM, and the host side's only way in.
//!
//! As PID 1 it mounts the kernel filesystems (and cgroup2, /run, and /tmp where the root is
//! read-only; a writable root holds /tmp itself), sets the host name,
//! reaps orphans, listens on vsock port 52 and prints [`init::READY_LINE`] on the console; then it
//! starts the image's services (`/etc/airlock/services/*.json`, see `services`); then it
//! serves the protocol of `proto/agent.proto`: executions with streamed output, stdin, signals
//! and limits (one cgroup per execution), and file operations. Started as an ordinary process
//! with `--listen unix:PATH` (or `vsock:PORT`) it skips the init work and serves the same
//! protocol on that socket; the protocol tests run it that way.
//!
//! Code map, in layers: a module uses only modules of the layers below it (the test in
//! `module_graph` keeps the graph free of cycles).
//!
//! 1. `sys` (all unsafe code), `error` (request errors), `clock` (milliseconds).
//! 2. `conn` (the sending side of a connection), `cgroup`, `reaper` (the only place that reaps
//!    children), `init` (PID 1 work, console lines), `users` (the accounts requests act as),
//!    `exec_spec` (a validated Exec request), `disk` (the sandbox's space on a writable root),
//!    `volumes` (disk slots mounted where Reseed says).
//! 3. `delivery` (who gets an execution's responses: its owner, or a bounded window while it
//!    has none), `spawn` (an execution's process: cgroup, command, pipes, reaper).
//! 4. `execution` (a running execution: kill target, stdin queue, Signal), `services` (the
//!    image's long-running processes, started after Ready and restarted when they exit).
//! 5. `exec_loop` (one execution from spawn to exit: its poll loop and exit record).
//! 6. `exec` (starting executions, the table of executions, Attach), `files`, `reseed` (a
//!    restored clone's own RNG state, host name and sandbox id).
//! 7. `agent` (shared state, Ready).
//! 8. `server` (listening, connections, dispatch), then `main` (options, start-up).
#![deny(unsafe_code)]

mod agent;
mod cgroup;
mod clock;
mod conn;
mod delivery;
mod disk;
mod error;
mod exec;
mod exec_loop;
mod exec_spec;
mod execution;
mod files;
mod init;
#[cfg(test)]
mod module_graph;
mod reaper;
mod reseed;
mod server;
mod services;
mod spawn;
mod sys;
mod users;
mod volumes;

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use agent::{Agent, CPUS_ONLINE, Settings};
use airlock_proto::DEFAULT_ORPHAN_BUFFER_BYTES;
use cgroup::CgroupRoot;
use reaper::Reaper;
use server::{ListenAddr, Listener};

const USAGE: &str = "usage: airlock-agent --listen unix:PATH|vsock:PORT [--cgroup-root DIR]
                     [--state-dir DIR] [--orphan-buffer-bytes N] [--default-user NAME]
                     [--services-dir DIR]
  (as PID 1 it takes no options: it initialises the VM, listens on vsock port 52, keeps its
  state in /run/airlock, buffers 1 MiB per unowned execution and runs requests that name no
  account as \"user\"; it keeps the services of /etc/airlock/services/*.json running)
  --listen ADDR        serve the agent protocol on this socket
  --cgroup-root DIR    run each execution in a cgroup under DIR (created; its parent must be a
                       cgroup v2 directory); without it, process groups are used
  --state-dir DIR      write state files (the sandbox id of Reseed) in DIR (created); without
                       it, none are written
  --orphan-buffer-bytes N
                       output kept per execution while no connection owns it (default 1 MiB)
  --default-user NAME  the account of requests that name none (default: the agent's own)
  --services-dir DIR   start the services of DIR/*.json and keep them running (default: none)";

/// Exit code for bad command-line arguments (host mode only).
const EXIT_USAGE: i32 = 2;
/// Exit code when the agent cannot start serving (host mode only).
const EXIT_START: i32 = 1;

/// How the agent runs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Options {
    listen: ListenAddr,
    cgroup_root: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    orphan_buffer_bytes: usize,
    default_user: Option<String>,
    workdir: Option<String>,
    /// Where the service files are; none: no services.
    services_dir: Option<PathBuf>,
}

impl Options {
    /// PID 1's options. `boot_env` reads the environment the kernel gave init: an image
    /// imported from a registry names its `User` and `WorkingDir` there (`AIRLOCK_USER`,
    /// `AIRLOCK_WORKDIR` on the kernel command line).
    fn pid1(boot_env: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| boot_env(k).filter(|v| !v.is_empty());
        Self {
            listen: ListenAddr::Vsock(airlock_proto::AGENT_VSOCK_PORT),
            cgroup_root: Some(PathBuf::from(init::CGROUP_ROOT)),
            state_dir: Some(PathBuf::from(init::STATE_DIR)),
            orphan_buffer_bytes: DEFAULT_ORPHAN_BUFFER_BYTES,
            default_user: Some(set("AIRLOCK_USER").unwrap_or(users::DEFAULT_VM_USER.to_owned())),
            workdir: set("AIRLOCK_WORKDIR"),
            services_dir: Some(PathBuf::from(services::SERVICES_DIR)),
        }
    }

    fn parse(args: &[String]) -> Result<Self, String> {
        let mut listen = None;
        let mut cgroup_root = None;
        let mut state_dir = None;
        let mut orphan_buffer_bytes = DEFAULT_ORPHAN_BUFFER_BYTES;
        let mut default_user = None;
        let mut services_dir = None;
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = || it.next().ok_or_else(|| format!("{arg} needs a value"));
            match arg.as_str() {
                "--listen" => listen = Some(value()?.parse()?),
                "--cgroup-root" => cgroup_root = Some(PathBuf::from(value()?)),
                "--state-dir" => state_dir = Some(PathBuf::from(value()?)),
                "--default-user" => default_user = Some(value()?.clone()),
                "--services-dir" => services_dir = Some(PathBuf::from(value()?)),
                "--orphan-buffer-bytes" => {
                    let v = value()?;
                    orphan_buffer_bytes = v
                        .parse()
                        .map_err(|_| format!("invalid --orphan-buffer-bytes {v:?}"))?;
                }
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        let listen = listen.ok_or("--listen is required")?;
        Ok(Self {
            listen,
            cgroup_root,
            state_dir,
            orphan_buffer_bytes,
            default_user,
            workdir: None,
            services_dir,
        })
    }
}

/// Why the agent could not start serving.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("blocking SIGCHLD")]
    Signals(#[source] io::Error),
    #[error("starting the reaper")]
    Reaper(#[source] io::Error),
    #[error("listening on {addr}")]
    Listen {
        addr: ListenAddr,
        #[source]
        source: io::Error,
    },
}

fn main() {
    let pid1 = std::process::id() == 1;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !pid1 && args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return;
    }
    let options = if pid1 {
        // The kernel may pass command-line words to init; there are no options as PID 1.
        Options::pid1(|k| std::env::var(k).ok())
    } else {
        Options::parse(&args).unwrap_or_else(|e| {
            eprintln!("airlock-agent: {e}\n{USAGE}");
            std::process::exit(EXIT_USAGE);
        })
    };
    let err = run(pid1, &options);
    eprintln!("airlock-agent: {err}: {}", source_text(&err));
    if !pid1 {
        std::process::exit(EXIT_START);
    }
    park()
}

/// Starts everything and serves; returns only if serving cannot start.
fn run(pid1: bool, options: &Options) -> StartError {
    // A fault in PID 1 panics the guest kernel; the console should say where it was.
    if let Err(e) = sys::report_faults() {
        eprintln!("airlock-agent: no fault reports: {e}");
    }
    // Before any thread exists, so that every thread inherits the mask.
    if let Err(e) = sys::block_sigchld() {
        return StartError::Signals(e);
    }
    // Files the agent creates get exactly the requested modes; children get 022.
    sys::set_umask(0);
    if pid1 {
        init::init_system();
    } else if let Err(e) = sys::set_child_subreaper() {
        eprintln!("airlock-agent: cannot become a subreaper (orphans go elsewhere): {e}");
    }
    let cgroups = options.cgroup_root.as_deref().and_then(|dir| {
        CgroupRoot::setup(dir)
            .inspect_err(|e| {
                eprintln!("airlock-agent: no per-execution cgroups, using process groups: {e}");
            })
            .ok()
    });
    let reaper = match Reaper::start() {
        Ok(r) => r,
        Err(e) => return StartError::Reaper(e),
    };
    if pid1 && !init::vsock_device_present() {
        power_off_without_vsock();
    }
    let listener = match Listener::bind(&options.listen) {
        Ok(l) => l,
        Err(e) if pid1 => {
            eprintln!("airlock-agent: listening on {}: {e}", options.listen);
            power_off_without_vsock();
        }
        Err(source) => {
            let addr = options.listen.clone();
            return StartError::Listen { addr, source };
        }
    };
    let boot_time = sys::boottime();
    init::console(init::READY_LINE);
    let cpus_online = std::fs::read_to_string(CPUS_ONLINE).unwrap_or_default();
    let ready = agent::build_ready(boot_time, &cpus_online, cgroups.as_ref());
    let settings = Settings {
        pid1,
        state_dir: options.state_dir.clone(),
        orphan_buffer_bytes: options.orphan_buffer_bytes,
        default_user: options.default_user.clone(),
        workdir: options.workdir.clone(),
    };
    let agent = Arc::new(Agent::new(settings, reaper, cgroups, ready));
    // After the readiness line, so it costs the boot nothing.
    init::console(&init::cpus_line(&cpus_online));
    if let Some(dir) = &options.services_dir {
        let supervisor = services::Supervisor {
            spawner: Arc::clone(&agent.spawner),
            users: agent.users.clone(),
            state_dir: options.state_dir.clone(),
        };
        supervisor.start_all(dir);
    }
    server::serve_forever(&agent, &listener)
}

/// A VM without a vsock device (or whose vsock cannot listen) has nobody to serve, as in a
/// plain boot test: report that userspace came up, then power off as the base image's init
/// always did.
fn power_off_without_vsock() -> ! {
    init::console(init::READY_LINE);
    if let Ok(cpus) = std::fs::read_to_string(CPUS_ONLINE) {
        init::console(&init::cpus_line(&cpus));
    }
    eprintln!("airlock-agent: no usable virtio-vsock: nothing to serve, powering off");
    sys::sync();
    if let Err(e) = sys::reboot() {
        eprintln!("airlock-agent: reboot: {e}");
    }
    park()
}

/// PID 1 must never exit (that panics the kernel): wait until the VM is torn down.
fn park() -> ! {
    loop {
        sys::pause();
    }
}

fn source_text(err: &StartError) -> String {
    std::error::Error::source(err).map_or_else(String::new, ToString::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn parse_takes_listen_and_cgroup_root() {
        let o = Options::parse(&args(&["--listen", "unix:/a", "--cgroup-root", "/cg"])).unwrap();
        assert_eq!(o.listen, ListenAddr::Unix("/a".into()));
        assert_eq!(o.cgroup_root, Some(PathBuf::from("/cg")));
    }

    #[test]
    fn parse_requires_listen_and_rejects_unknown_arguments() {
        assert!(Options::parse(&[]).is_err());
        assert!(Options::parse(&args(&["--listen"])).is_err());
        assert!(Options::parse(&args(&["--listen", "unix:/a", "--bogus"])).is_err());
    }

    #[test]
    fn host_mode_has_no_state_dir_unless_given_and_takes_an_orphan_buffer_size() {
        let o = Options::parse(&args(&["--listen", "unix:/a"])).unwrap();
        assert_eq!(o.state_dir, None);
        assert_eq!(o.orphan_buffer_bytes, DEFAULT_ORPHAN_BUFFER_BYTES);
        let o = Options::parse(&args(&[
            "--listen",
            "unix:/a",
            "--state-dir",
            "/s",
            "--orphan-buffer-bytes",
            "4096",
        ]))
        .unwrap();
        assert_eq!(o.state_dir, Some(PathBuf::from("/s")));
        assert_eq!(o.orphan_buffer_bytes, 4096);
        let bad = ["--listen", "unix:/a", "--orphan-buffer-bytes", "lots"];
        assert!(Options::parse(&args(&bad)).is_err());
    }

    #[test]
    fn pid1_listens_on_vsock_52_with_cgroups_and_state_in_run() {
        let o = Options::pid1(|_| None);
        assert_eq!(o.listen, ListenAddr::Vsock(52));
        assert_eq!(o.cgroup_root, Some(PathBuf::from(init::CGROUP_ROOT)));
        assert_eq!(o.state_dir, Some(PathBuf::from("/run/airlock")));
        assert_eq!(o.default_user.as_deref(), Some("user"));
        assert_eq!(o.workdir, None);
        assert_eq!(o.services_dir, Some(PathBuf::from("/etc/airlock/services")));
        let image = Options::pid1(|k| match k {
            "AIRLOCK_USER" => Some("1000:1000".into()),
            "AIRLOCK_WORKDIR" => Some("/app".into()),
            _ => None,
        });
        assert_eq!(image.default_user.as_deref(), Some("1000:1000"));
        assert_eq!(image.workdir.as_deref(), Some("/app"));
    }

    #[test]
    fn host_mode_runs_as_itself_unless_given_a_default_user() {
        let o = Options::parse(&args(&["--listen", "unix:/a"])).unwrap();
        assert_eq!(o.default_user, None);
        assert_eq!(o.services_dir, None);
        let o = Options::parse(&args(&["--listen", "unix:/a", "--services-dir", "/s"])).unwrap();
        assert_eq!(o.services_dir, Some(PathBuf::from("/s")));
        let o = Options::parse(&args(&["--listen", "unix:/a", "--default-user", "nobody"]));
        assert_eq!(o.unwrap().default_user.as_deref(), Some("nobody"));
    }
}
