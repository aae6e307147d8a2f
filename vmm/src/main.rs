//! `airlock-vmm`: boots one microVM and exits with a code that says how it ended
//! (see [`vmm::exit`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use vmm::arch::cpuid::CpuTemplate;
use vmm::config::{ConsoleOutput, DiskConfig, VmConfig, VsockConfig};
use vmm::exit::code;

const USAGE: &str = "\
usage: airlock-vmm boot --kernel PATH --rootfs PATH [options]

Boots the kernel with the root filesystem image as /dev/vda (read-only) and exits when the guest
powers off. Exit codes: 0 clean power-off, 1 VMM error, 2 usage, 64 guest panic, 65 triple fault,
66 KVM internal error, 67 KVM entry failure, 68 boot deadline passed, 69 vCPU error.

options:
  --vcpus N                 vCPUs (default 1, at most 32)
  --mem-mib M               guest memory in MiB (default 256)
  --scratch PATH            writable disk image attached as /dev/vdb
  --console PATH            write the guest console to PATH instead of stdout
  --cmdline-extra ARGS      appended to the kernel command line
  --boot-timeout SECS       end the VM if `airlock: userspace up` has not appeared (default 300,
                            0 = no deadline)
  --console-limit-mib N     console bytes kept (default 64 MiB; the rest is dropped)
  --cpu-template T          auto (default), host, or nested
  --vsock PATH              add a virtio-vsock device whose host side is the Unix socket PATH
                            (connect and write `CONNECT <port>\n` to reach a guest port; guest
                            connections to host port P arrive at PATH_P)
  --vsock-cid N             the guest's vsock CID (default 3)
environment: AIRLOCK_LOG=error|warn|info|debug (default info)";

fn parse_boot(args: &[String]) -> Result<VmConfig, String> {
    let mut kernel = None;
    let mut rootfs = None;
    let mut cfg = VmConfig::new(PathBuf::new(), PathBuf::new());
    let mut vsock_cid = 3;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {v}"))
        };
        match flag.as_str() {
            "--kernel" => kernel = Some(PathBuf::from(value()?)),
            "--rootfs" => rootfs = Some(PathBuf::from(value()?)),
            "--scratch" => cfg.disks.push(DiskConfig {
                path: PathBuf::from(value()?),
                read_only: false,
                id: "airlock-scratch".into(),
            }),
            "--vcpus" => {
                cfg.vcpus = u8::try_from(num(value()?)?).map_err(|_| "--vcpus: too many")?;
            }
            "--mem-mib" => cfg.mem_mib = num(value()?)?,
            "--console" => cfg.console = ConsoleOutput::File(PathBuf::from(value()?)),
            "--cmdline-extra" => cfg.cmdline_extra = value()?,
            "--boot-timeout" => {
                let s = num(value()?)?;
                cfg.boot_timeout = (s > 0).then(|| Duration::from_secs(s));
            }
            "--console-limit-mib" => cfg.console_limit = num(value()?)?.saturating_mul(1 << 20),
            "--cpu-template" => {
                cfg.cpu_template = match value()?.as_str() {
                    "auto" => None,
                    "host" => Some(CpuTemplate::Host),
                    "nested" => Some(CpuTemplate::NestedPvm),
                    other => return Err(format!("--cpu-template: unknown template {other}")),
                }
            }
            "--vsock" => {
                cfg.vsock = Some(VsockConfig {
                    guest_cid: 0,
                    uds_path: PathBuf::from(value()?),
                })
            }
            "--vsock-cid" => vsock_cid = num(value()?)?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    cfg.kernel = kernel.ok_or("--kernel is required")?;
    let rootfs = rootfs.ok_or("--rootfs is required")?;
    cfg.disks[0].path = rootfs;
    if let Some(v) = cfg.vsock.as_mut() {
        v.guest_cid = vsock_cid;
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

fn boot(cfg: &VmConfig, started: Instant) -> ExitCode {
    let vmm = match vmm::build_microvm_for_boot(cfg, started) {
        Ok(v) => v,
        Err(e) => {
            log::error!("{}", error_chain(&e));
            return ExitCode::from(code::VMM_ERROR);
        }
    };
    log::info!(
        "vm built in {:.1} ms; starting {} vcpu(s)",
        started.elapsed().as_secs_f64() * 1e3,
        cfg.vcpus
    );
    match vmm.run() {
        Ok(exit) => {
            let c = exit.exit_code();
            if exit.is_clean() {
                log::info!("vm ended: {exit} (exit code {c})");
            } else {
                log::error!("vm ended: {exit} (exit code {c})");
            }
            ExitCode::from(c)
        }
        Err(e) => {
            log::error!("{}", error_chain(&e));
            ExitCode::from(code::VMM_ERROR)
        }
    }
}

/// "outer: inner: innermost", the whole `source()` chain on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

fn main() -> ExitCode {
    let started = Instant::now();
    vmm::logger::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.split_first() {
        Some((cmd, rest)) if cmd == "boot" => match parse_boot(rest) {
            Ok(cfg) => boot(&cfg, started),
            Err(msg) => {
                if !msg.is_empty() {
                    eprintln!("airlock-vmm: {msg}");
                }
                eprintln!("{USAGE}");
                ExitCode::from(code::USAGE)
            }
        },
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(code::USAGE)
        }
    }
}
