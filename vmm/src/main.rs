//! `airlock-vmm`: one microVM per process.
//!
//! - `boot`: boots a kernel and image and exits when the guest powers off, with a code that
//!   says how the VM ended (see [`vmm::exit`]).
//! - `run`: boots, waits for the guest agent, runs one command in the guest with its output
//!   streamed to ours, powers the guest off and exits with the command's status.

mod cli;
mod run;

use std::process::ExitCode;
use std::time::Instant;

use vmm::VmConfig;
use vmm::exit::code;

fn boot(cfg: &VmConfig, control: Option<&std::path::Path>, started: Instant) -> ExitCode {
    let vmm = match run::start(vmm::build_microvm_for_boot(cfg, started), control) {
        Ok(v) => v,
        Err(code) => return code,
    };
    log::info!(
        "vm built in {:.1} ms; starting {} vcpu(s)",
        started.elapsed().as_secs_f64() * 1e3,
        cfg.vcpus
    );
    finish(vmm.run())
}

fn finish(result: Result<vmm::VmExit, vmm::BuildError>) -> ExitCode {
    match result {
        Ok(exit) => ExitCode::from(cli::log_vm_exit(&exit)),
        Err(e) => {
            log::error!("{}", cli::error_chain(&e));
            ExitCode::from(code::VMM_ERROR)
        }
    }
}

fn restore(opts: &cli::RestoreOptions, started: Instant) -> ExitCode {
    let built = vmm::build_microvm_from_snapshot(&opts.restore, started);
    let vmm = match run::start(built, opts.control.as_deref()) {
        Ok(v) => v,
        Err(code) => return code,
    };
    finish(vmm.run())
}

/// `airlock-vmm control PATH COMMAND...`: one command to a VMM's control socket; prints the
/// JSON answer, exits 0 if it says ok.
fn control(path: &str, command: &str) -> ExitCode {
    match vmm::control::send_command(std::path::Path::new(path), command) {
        Ok(v) => {
            println!("{v}");
            ExitCode::from(if v["ok"] == true {
                code::OK
            } else {
                code::VMM_ERROR
            })
        }
        Err(e) => {
            eprintln!("airlock-vmm: control socket {path}: {e}");
            ExitCode::from(code::VMM_ERROR)
        }
    }
}

/// The pool's KVM VM, with guest memory prepared as its options say.
fn prepare_pool_vm(opts: &cli::PoolOptions) -> Result<vmm::vm::PreparedVm, String> {
    use vmm::vm::{MemoryPlan, PreparedVm};
    match (&opts.snapshot, opts.mem_mib) {
        (Some(dir), _) => {
            let snap = vmm::snapshot::Snapshot::read_state(dir)
                .map_err(|e| format!("snapshot {}: {}", dir.display(), cli::error_chain(&e)))?;
            let memory_file = dir.join(vmm::snapshot::MEMORY_FILE);
            let plan = MemoryPlan::Snapshot {
                memory_file: &memory_file,
                layout: &snap.memory,
            };
            PreparedVm::new(opts.vcpus, plan)
        }
        (None, Some(mib)) => PreparedVm::new(opts.vcpus, MemoryPlan::Reserve(mib << 20)),
        (None, None) => PreparedVm::new(opts.vcpus, MemoryPlan::Later),
    }
    .map_err(|e| cli::error_chain(&e))
}

/// `airlock-vmm pool`: prepare the KVM VM now, restore when asked.
fn pool(opts: &cli::PoolOptions, started: Instant) -> ExitCode {
    let (prepared, ctl) = match start_pool(opts) {
        Ok(p) => p,
        Err(code) => return code,
    };
    log_pool_ready(opts, started);
    let Ok((req, asked)) = ctl.requests.recv() else {
        log::error!("the control thread ended before a restore was asked for");
        return ExitCode::from(code::VMM_ERROR);
    };
    let config = pool_restore_config(opts, req);
    restore_and_run(&config, started, prepared, ctl, asked)
}

/// Pool step: the prepared VM, and its control socket served from now on.
fn start_pool(
    opts: &cli::PoolOptions,
) -> Result<(vmm::vm::PreparedVm, vmm::control::PoolControl), ExitCode> {
    use vmm::control;
    let prepared = match prepare_pool_vm(opts) {
        Ok(p) => p,
        Err(e) => {
            log::error!("{e}");
            return Err(ExitCode::from(code::VMM_ERROR));
        }
    };
    let listener = match control::bind_control_socket(&opts.control) {
        Ok(l) => l,
        Err(e) => {
            log::error!("control socket {}: {e}", opts.control.display());
            return Err(ExitCode::from(code::VMM_ERROR));
        }
    };
    let ctl = match control::serve_pool_control(listener, usize::from(opts.vcpus)) {
        Ok(c) => c,
        Err(e) => {
            log::error!("control thread: {e}");
            return Err(ExitCode::from(code::VMM_ERROR));
        }
    };
    Ok((prepared, ctl))
}

/// Pool step: the log line saying what the pool prepared, and where it waits.
fn log_pool_ready(opts: &cli::PoolOptions, started: Instant) {
    log::info!(
        "pool: {} vCPU(s){} prepared after {} us; waiting for `restore DIR` on {}",
        opts.vcpus,
        match (&opts.snapshot, opts.mem_mib) {
            (Some(dir), _) => format!(" and the memory of {}", dir.display()),
            (None, Some(m)) => format!(" and {m} MiB of guest memory"),
            (None, None) => String::new(),
        },
        started.elapsed().as_micros(),
        opts.control.display()
    );
}

/// Pool step: what to restore: the request's directory, disk quota and slot media, with the
/// pool's own console, vsock, TAP and overlay.
fn pool_restore_config(
    opts: &cli::PoolOptions,
    req: vmm::control::PoolRestore,
) -> vmm::RestoreConfig {
    let (req, media) = (req.request, req.media);
    let mut root_overlay = opts.root_overlay.clone();
    if let (Some(o), Some(mib)) = (root_overlay.as_mut(), req.disk_quota_mib) {
        o.quota_bytes = mib.saturating_mul(1 << 20);
    }
    let slot_media = media
        .into_iter()
        .map(|m| {
            m.map(|(file, read_only)| vmm::config::SlotMedia {
                file: std::sync::Arc::new(file),
                read_only,
            })
        })
        .collect();
    vmm::RestoreConfig {
        slot_media,
        snapshot_dir: req.dir,
        vsock_uds: opts.vsock.clone(),
        console: opts.console.clone(),
        console_limit: 64 << 20,
        cpu_template: opts.cpu_template,
        net_tap: opts.net_tap.clone(),
        root_overlay,
    }
}

/// Pool step: the restore into the prepared VM, then the VM's run; the control thread answers
/// the restore request once the vCPUs run, or with why the restore failed.
fn restore_and_run(
    config: &vmm::RestoreConfig,
    started: Instant,
    prepared: vmm::vm::PreparedVm,
    ctl: vmm::control::PoolControl,
    asked: Instant,
) -> ExitCode {
    use vmm::control;
    let built = vmm::restore_microvm(config, started, Some(prepared), asked).and_then(|v| {
        let handle = v.control_handle().map_err(vmm::BuildError::EventFd)?;
        Ok((v, handle))
    });
    let (vmm, handle) = match built {
        Ok(v) => v,
        Err(e) => {
            let msg = cli::error_chain(&e);
            log::error!("{msg}");
            let _ = ctl.outcome.send(control::RestoreOutcome::Failed(msg));
            let _ = ctl.thread.join();
            return ExitCode::from(code::VMM_ERROR);
        }
    };
    if let Err(e) = vmm.stop_on_termination_signals() {
        log::warn!("SIGTERM/SIGINT will kill the VM abruptly: {e}");
    }
    // Everything that does not need to happen before the vCPUs run happens after: the answer
    // goes out on the control thread once they do, and that thread then serves the usual
    // commands on the same listener, so there is no moment without a control socket.
    let outcome = ctl.outcome;
    finish(vmm.run_then(move || {
        let answer = airlock_control::RestoreReply {
            state: airlock_control::VmState::Running,
            running_after_us: asked.elapsed().as_micros() as u64,
        };
        let _ = outcome.send(control::RestoreOutcome::Running(handle, answer));
    }))
}

fn usage_error(msg: &str) -> ExitCode {
    if !msg.is_empty() {
        eprintln!("airlock-vmm: {msg}");
    }
    eprintln!("{}", cli::USAGE);
    ExitCode::from(code::USAGE)
}

/// Seccomp and test hooks for a VM subcommand, before any thread starts.
fn set_up_process(flags: &cli::ProcessFlags) -> Result<(), ExitCode> {
    if flags.no_seccomp {
        log::warn!("--no-seccomp: the VMM's threads run without seccomp filters");
    } else if let Err(e) = vmm::seccomp::enable() {
        log::error!("{}", cli::error_chain(&e));
        return Err(ExitCode::from(code::VMM_ERROR));
    }
    if flags.test_hooks {
        log::warn!("--test-hooks: `probe` commands are accepted on the control socket");
        if let Err(e) = vmm::probe::enable() {
            log::error!("test hooks: {e}");
            return Err(ExitCode::from(code::VMM_ERROR));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let started = Instant::now();
    vmm::logger::init();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let flags = cli::take_process_flags(&mut args);
    if args.first().is_some_and(|c| c != "control")
        && let Err(code) = set_up_process(&flags)
    {
        return code;
    }
    match args.split_first() {
        Some((cmd, rest)) if cmd == "boot" => match cli::parse_vm_options(rest, false) {
            Ok((cfg, run)) => boot(&cfg, run.control.as_deref(), started),
            Err(msg) => usage_error(&msg),
        },
        Some((cmd, rest)) if cmd == "restore" => match cli::parse_restore(rest) {
            Ok(opts) => restore(&opts, started),
            Err(msg) => usage_error(&msg),
        },
        Some((cmd, rest)) if cmd == "control" => match rest {
            [path, words @ ..] if !words.is_empty() => control(path, &words.join(" ")),
            _ => usage_error("control needs PATH and a command"),
        },
        Some((cmd, rest)) if cmd == "pool" => match cli::parse_pool(rest) {
            Ok(opts) => pool(&opts, started),
            Err(msg) => usage_error(&msg),
        },
        Some((cmd, rest)) if cmd == "snapshot" => match cli::parse_snapshot(rest) {
            Ok(opts) => run::snapshot(opts, started),
            Err(msg) => usage_error(&msg),
        },
        Some((cmd, rest)) if cmd == "run" => match cli::parse_run(rest) {
            Ok(opts) => run::run(opts, started),
            Err(msg) => usage_error(&msg),
        },
        _ => usage_error(""),
    }
}
