//! Command-line parsing and reporting shared by the subcommands.

use std::path::PathBuf;
use std::time::Duration;

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use vmm::arch::cpuid::CpuTemplate;

use vmm::config::{ConsoleOutput, DEFAULT_MAC, DiskConfig, NetConfig, VmConfig, VsockConfig};
use vmm::exit::VmExit;

pub const USAGE: &str = "\
usage: airlock-vmm boot --kernel PATH --rootfs PATH [options]
       airlock-vmm run  --kernel PATH --rootfs PATH [options] [run options] -- CMD [ARGS...]
       airlock-vmm run  --snapshot DIR [run options] -- CMD [ARGS...]
       airlock-vmm snapshot --kernel PATH --rootfs PATH --out DIR [options]
       airlock-vmm restore --snapshot DIR [--vsock PATH] [--net-fd FD] [--control PATH]
                           [--console PATH] [--root-overlay PATH [--disk-quota-mib N]]
       airlock-vmm pool --control PATH [--vcpus N] [--mem-mib M | --snapshot DIR] [--vsock PATH]
                        [--net-fd FD] [--console PATH] [--cpu-template T]
                        [--root-overlay PATH [--disk-quota-mib N]]
       airlock-vmm control PATH pause|resume|status|stop|snapshot DIR|restore DIR

boot: boots the kernel with the root filesystem image as /dev/vda (read-only) and exits when the
guest powers off. Exit codes: 0 clean power-off, 1 VMM error, 2 usage, 64 guest panic, 65 triple
fault, 66 KVM internal error, 67 KVM entry failure, 68 boot deadline passed, 69 vCPU error.

run: boots, waits for the guest agent, runs CMD in the guest with its stdout and stderr streamed
to ours, powers the guest off and exits with CMD's status (128+N if a signal N ended it). If the
VM ends before CMD does, the exit code is the VM's (above). With --snapshot DIR it restores the
snapshot instead of booting, gives the clone fresh entropy and a sandbox id (hostname), then runs
CMD.

snapshot: boots, waits until the guest agent answers, runs --warmup 'SHELL COMMAND' if given (so
that what it reads is in the snapshot's page cache; its failure fails the snapshot), waits until
the guest is quiet (its vCPUs nearly idle for 200 ms; at most --settle-ms, default 10000, 0 for
no wait: clones would redo what it had pending), pauses the VM, writes a snapshot into DIR
(files `state` and `memory`), prints a JSON summary and ends the VM.

restore: restores the snapshot in DIR into this process and runs the VM until it powers off or
is stopped (SIGTERM, or `stop` on the control socket). Its vsock device needs --vsock PATH, its
network card (if it has one) --net-fd FD.

pool: a warm process for a later restore: creates the KVM VM, its irqchip and N vCPUs now, then
waits on the control socket for `restore DIR` (answered once the clone runs, with the restore
time) and goes on as `restore` would; `status` answers while it waits. Guest memory: with
--snapshot DIR (the snapshot it will restore, as a pool per template knows) its memory file is
mapped and registered in advance; with --mem-mib M (a pool for any snapshot of that size) host
address space is reserved and registered and the memory file is mapped over it in place.

control: sends one command to the control socket PATH and prints the JSON answer.

options:
  --vcpus N                 vCPUs (default 1, at most 32)
  --mem-mib M               guest memory in MiB (default 256)
  --scratch PATH            writable disk image attached as /dev/vdb
  --root-overlay PATH       make the root disk writable, copy-on-write: the --rootfs image
                            stays read-only and the guest's writes go into PATH (an empty file
                            the caller made; restore, pool: for a snapshot with such a disk,
                            whose layer is in the snapshot's directory)
  --disk-slots N            N empty disk slots after the disks (boot, run, snapshot), for media
                            put in when a snapshot of the VM is restored (volumes)
  --slot-fd FD[:ro] | -     restore: the next slot's media, an inherited descriptor (repeat in
                            slot order; `-` leaves one empty); a pool process takes them with
                            `restore slots=rw,ro,- DIR`, sent as SCM_RIGHTS
  --disk-quota-mib N        the most the overlay may hold; a write that needs more fails
                            (default: the disk's size; pool: `restore disk-quota-mib=N DIR`
                            overrides it)
  --console PATH            write the guest console to PATH (boot: default stdout; run: default
                            discarded, its tail is shown if the VM fails)
  --cmdline-extra ARGS      appended to the kernel command line
  --boot-timeout SECS       end the VM if `airlock: userspace up` has not appeared (default 300,
                            0 = no deadline)
  --console-limit-mib N     console bytes kept (default 64 MiB; the rest is dropped)
  --cpu-template T          auto (default), host, or nested
  --vsock PATH              add a virtio-vsock device whose host side is the Unix socket PATH
                            (connect and write `CONNECT <port>\\n` to reach a guest port; guest
                            connections to host port P arrive at PATH_P); run: default a
                            temporary socket
  --vsock-cid N             the guest's vsock CID (default 3)
  --net-fd FD               add a virtio-net device on the TAP descriptor FD, inherited from the
                            parent (IFF_TAP | IFF_NO_PI, no IFF_VNET_HDR); the VMM never opens
                            /dev/net/tun itself
  --mac MAC                 the network card's MAC address (default 02:a1:0c:00:00:02)
  --control PATH            serve the control socket at PATH: one command per connection,
                            `pause`, `resume`, `snapshot DIR`, `status`, `stop`; answers one
                            JSON line (see ARCHITECTURE.md)
run options:
  --timeout SECS            kill CMD (its whole process tree) after SECS (default: none)
  --cwd DIR                 working directory of CMD in the guest (default: the home of its
                            account)
  --user NAME               the guest account CMD runs as (default: the agent's, `user`; `root`
                            for root)
  --env KEY=VALUE           environment for CMD (repeatable)
process options (every VM subcommand):
  --no-seccomp              no per-thread seccomp filters (debugging only; by default every
                            thread installs its filter before the guest runs, and a system call
                            outside it ends the VMM with exit code 70)
  --test-hooks              accept `probe open PATH`, `probe kill PID SIG`, `probe seccomp` and
                            `probe create PATH`
                            on the control socket (tests of the jail; never in production)
environment: AIRLOCK_LOG=error|warn|info|debug (default info)";

/// What `run` needs beyond the VM.
#[derive(Debug)]
pub struct RunOptions {
    pub vm: VmConfig,
    /// Restore this snapshot instead of booting `vm`.
    pub snapshot: Option<PathBuf>,
    pub control: Option<PathBuf>,
    pub argv: Vec<String>,
    pub timeout: Option<Duration>,
    pub cwd: String,
    /// The guest account (empty: the agent's default).
    pub user: String,
    pub env: Vec<(String, String)>,
    /// Whether the user chose where the console goes.
    pub console_given: bool,
}

/// Parses the VM options; with `allow_run`, also the run options. Returns the config and the
/// run-only options it saw.
pub fn parse_vm_options(
    args: &[String],
    allow_run: bool,
) -> Result<(VmConfig, RunOptions), String> {
    let mut opts = VmOptions::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        if opts.vm_flag(flag, &mut value)? || (allow_run && opts.run_flag(flag, &mut value)?) {
            continue;
        }
        match flag.as_str() {
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    opts.finish()
}

/// `flag`'s value as a number.
fn num(flag: &str, v: String) -> Result<u64, String> {
    v.parse::<u64>()
        .map_err(|_| format!("{flag}: not a number: {v}"))
}

/// What [`parse_vm_options`] has seen so far, before the checks that need every option.
struct VmOptions {
    kernel: Option<PathBuf>,
    rootfs: Option<PathBuf>,
    cfg: VmConfig,
    run: RunOptions,
    vsock_cid: u64,
    mac: Option<[u8; 6]>,
    root_overlay: Option<PathBuf>,
    disk_quota: Option<u64>,
}

impl VmOptions {
    /// Nothing seen yet: the defaults.
    fn new() -> Self {
        Self {
            kernel: None,
            rootfs: None,
            cfg: VmConfig::new(PathBuf::new(), PathBuf::new()),
            run: RunOptions {
                vm: VmConfig::new(PathBuf::new(), PathBuf::new()),
                snapshot: None,
                control: None,
                argv: Vec::new(),
                timeout: None,
                cwd: String::new(),
                user: String::new(),
                env: Vec::new(),
                console_given: false,
            },
            vsock_cid: 3,
            mac: None,
            root_overlay: None,
            disk_quota: None,
        }
    }

    /// Takes one VM option (`value` gives its value); false: `flag` is not one.
    fn vm_flag(
        &mut self,
        flag: &str,
        value: &mut impl FnMut() -> Result<String, String>,
    ) -> Result<bool, String> {
        let cfg = &mut self.cfg;
        match flag {
            "--kernel" => self.kernel = Some(PathBuf::from(value()?)),
            "--root-overlay" => self.root_overlay = Some(PathBuf::from(value()?)),
            "--disk-quota-mib" => self.disk_quota = Some(num(flag, value()?)?),
            "--disk-slots" => {
                cfg.slots =
                    u8::try_from(num(flag, value()?)?).map_err(|_| "--disk-slots: too many")?
            }
            "--rootfs" => self.rootfs = Some(PathBuf::from(value()?)),
            "--scratch" => cfg.disks.push(DiskConfig {
                path: PathBuf::from(value()?),
                read_only: false,
                id: "airlock-scratch".into(),
                overlay: None,
            }),
            "--vcpus" => {
                cfg.vcpus = u8::try_from(num(flag, value()?)?).map_err(|_| "--vcpus: too many")?;
            }
            "--mem-mib" => cfg.mem_mib = num(flag, value()?)?,
            "--console" => {
                cfg.console = ConsoleOutput::File(PathBuf::from(value()?));
                self.run.console_given = true;
            }
            "--cmdline-extra" => cfg.cmdline_extra = value()?,
            "--boot-timeout" => {
                let s = num(flag, value()?)?;
                cfg.boot_timeout = (s > 0).then(|| Duration::from_secs(s));
            }
            "--console-limit-mib" => {
                cfg.console_limit = num(flag, value()?)?.saturating_mul(1 << 20)
            }
            "--cpu-template" => cfg.cpu_template = parse_template(&value()?)?,
            "--vsock" => {
                cfg.vsock = Some(VsockConfig {
                    guest_cid: 0,
                    uds_path: PathBuf::from(value()?),
                })
            }
            "--vsock-cid" => self.vsock_cid = num(flag, value()?)?,
            "--net-fd" => {
                if cfg.net.is_some() {
                    return Err("--net-fd: one network card at most".into());
                }
                cfg.net = Some(NetConfig {
                    tap: adopt_fd(&value()?)?,
                    mac: DEFAULT_MAC,
                });
            }
            "--mac" => {
                self.mac = Some(
                    vmm::devices::virtio::net::parse_mac(&value()?)
                        .ok_or("--mac: a unicast address like 02:a1:0c:00:00:02")?,
                )
            }
            "--control" => self.run.control = Some(PathBuf::from(value()?)),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Takes one run option (`value` gives its value); false: `flag` is not one.
    fn run_flag(
        &mut self,
        flag: &str,
        value: &mut impl FnMut() -> Result<String, String>,
    ) -> Result<bool, String> {
        let run = &mut self.run;
        match flag {
            "--snapshot" => run.snapshot = Some(PathBuf::from(value()?)),
            "--timeout" => {
                run.timeout =
                    Some(Duration::from_secs(num(flag, value()?)?)).filter(|d| !d.is_zero())
            }
            "--cwd" => run.cwd = value()?,
            "--user" => run.user = value()?,
            "--env" => {
                let kv = value()?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or(format!("--env {kv}: expected KEY=VALUE"))?;
                run.env.push((k.to_owned(), v.to_owned()));
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The checks that need every option, and the config they complete.
    fn finish(self) -> Result<(VmConfig, RunOptions), String> {
        let Self {
            mut kernel,
            mut rootfs,
            mut cfg,
            run,
            vsock_cid,
            mac,
            root_overlay,
            disk_quota,
        } = self;
        if run.snapshot.is_some() {
            // The snapshot says which kernel ran and which disks are attached.
            if kernel.is_some() || rootfs.is_some() {
                return Err("--snapshot replaces --kernel and --rootfs".into());
            }
            kernel = Some(PathBuf::from("(snapshot)"));
            rootfs = Some(PathBuf::from("(snapshot)"));
        }
        cfg.kernel = kernel.ok_or("--kernel is required")?;
        cfg.disks[0].path = rootfs.ok_or("--rootfs is required")?;
        cfg.disks[0].overlay = overlay_config(root_overlay, disk_quota)?;
        if let Some(v) = cfg.vsock.as_mut() {
            v.guest_cid = vsock_cid;
        }
        match (cfg.net.as_mut(), mac) {
            (Some(net), Some(mac)) => net.mac = mac,
            (None, Some(_)) => return Err("--mac needs --net-fd".into()),
            _ => {}
        }
        cfg.validate().map_err(|e| e.to_string())?;
        Ok((cfg, run))
    }
}

/// `--root-overlay PATH` with `--disk-quota-mib N` (default: no bound but the disk's size).
fn overlay_config(
    path: Option<PathBuf>,
    quota_mib: Option<u64>,
) -> Result<Option<vmm::config::OverlayConfig>, String> {
    match (path, quota_mib) {
        (None, Some(_)) => Err("--disk-quota-mib needs --root-overlay".into()),
        (None, None) => Ok(None),
        (Some(path), q) => Ok(Some(vmm::config::OverlayConfig {
            path,
            quota_bytes: q.map_or(u64::MAX, |m| m.saturating_mul(1 << 20)),
        })),
    }
}

fn parse_template(v: &str) -> Result<Option<CpuTemplate>, String> {
    match v {
        "auto" => Ok(None),
        "host" => Ok(Some(CpuTemplate::Host)),
        "nested" => Ok(Some(CpuTemplate::NestedPvm)),
        other => Err(format!("--cpu-template: unknown template {other}")),
    }
}

/// Parses `run`: options, `--`, then the command.
pub fn parse_run(args: &[String]) -> Result<RunOptions, String> {
    let split = args
        .iter()
        .position(|a| a == "--")
        .ok_or("run needs `-- CMD [ARGS...]`")?;
    let (opts, cmd) = (&args[..split], &args[split + 1..]);
    if cmd.is_empty() {
        return Err("run needs a command after `--`".into());
    }
    let (vm, mut run) = parse_vm_options(opts, true)?;
    run.vm = vm;
    run.argv = cmd.to_vec();
    Ok(run)
}

/// Logs how the VM ended and returns its exit code.
/// `airlock-vmm snapshot`: the VM to boot and where its snapshot goes.
#[derive(Debug)]
pub struct SnapshotOptions {
    pub run: RunOptions,
    pub out: PathBuf,
    /// A shell command run in the guest before the snapshot.
    pub warmup: Option<String>,
    /// The longest wait for the guest to settle before the pause (0: none).
    pub settle: std::time::Duration,
}

pub fn parse_snapshot(args: &[String]) -> Result<SnapshotOptions, String> {
    let mut rest = Vec::new();
    let mut out = None;
    let mut warmup = None;
    let mut settle_ms = DEFAULT_SETTLE_MS;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--out" {
            out = Some(PathBuf::from(it.next().ok_or("--out needs a value")?));
        } else if a == "--settle-ms" {
            let v = it.next().ok_or("--settle-ms needs a value")?;
            settle_ms = v
                .parse()
                .map_err(|_| format!("invalid --settle-ms {v:?}"))?;
        } else if a == "--warmup" {
            warmup = Some(it.next().ok_or("--warmup needs a shell command")?.clone());
        } else {
            rest.push(a.clone());
        }
    }
    let (vm, mut run) = parse_vm_options(&rest, false)?;
    run.vm = vm;
    Ok(SnapshotOptions {
        run,
        out: out.ok_or("--out DIR is required")?,
        warmup: warmup.filter(|w| !w.is_empty()),
        settle: std::time::Duration::from_millis(settle_ms),
    })
}

/// How long `snapshot` waits at most for the guest to settle, by default.
pub const DEFAULT_SETTLE_MS: u64 = 10_000;

/// `airlock-vmm restore`.
#[derive(Debug)]
pub struct RestoreOptions {
    pub restore: vmm::RestoreConfig,
    pub control: Option<PathBuf>,
}

pub fn parse_restore(args: &[String]) -> Result<RestoreOptions, String> {
    let mut opts = RestoreOptions {
        restore: vmm::RestoreConfig {
            snapshot_dir: PathBuf::new(),
            vsock_uds: None,
            console: ConsoleOutput::Stdout,
            console_limit: 64 << 20,
            cpu_template: None,
            net_tap: None,
            root_overlay: None,
            slot_media: Vec::new(),
        },
        control: None,
    };
    let mut snapshot = None;
    let (mut root_overlay, mut disk_quota) = (None, None);
    let mut slot_fds = Vec::new();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--snapshot" => snapshot = Some(PathBuf::from(value()?)),
            "--vsock" => opts.restore.vsock_uds = Some(PathBuf::from(value()?)),
            "--net-fd" if opts.restore.net_tap.is_none() => {
                let v = value()?;
                if slot_fds.contains(&v) {
                    return Err(format!("--net-fd {v}: also a --slot-fd"));
                }
                slot_fds.push(v.clone());
                opts.restore.net_tap = Some(adopt_fd(&v)?)
            }
            "--control" => opts.control = Some(PathBuf::from(value()?)),
            "--console" => opts.restore.console = ConsoleOutput::File(PathBuf::from(value()?)),
            "--cpu-template" => opts.restore.cpu_template = parse_template(&value()?)?,
            "--root-overlay" => root_overlay = Some(PathBuf::from(value()?)),
            "--disk-quota-mib" => disk_quota = Some(parse_mib(&value()?)?),
            "--slot-fd" => {
                let media = parse_slot_fd(&value()?, &mut slot_fds)?;
                opts.restore.slot_media.push(media);
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    opts.restore.snapshot_dir = snapshot.ok_or("--snapshot DIR is required")?;
    opts.restore.root_overlay = overlay_config(root_overlay, disk_quota)?;
    Ok(opts)
}

/// `--slot-fd FD`, `FD:ro` or `-`: the next disk slot's media, an inherited descriptor (each
/// at most once: `seen` holds those taken so far).
fn parse_slot_fd(
    v: &str,
    seen: &mut Vec<String>,
) -> Result<Option<vmm::config::SlotMedia>, String> {
    if v == "-" {
        return Ok(None);
    }
    let (fd, read_only) = match v.strip_suffix(":ro") {
        Some(fd) => (fd, true),
        None => (v, false),
    };
    if seen.iter().any(|s| s == fd) {
        return Err(format!("--slot-fd {fd}: given twice"));
    }
    seen.push(fd.to_owned());
    let fd = adopt_fd_for("--slot-fd", fd)?;
    let fd = Arc::try_unwrap(fd).map_err(|_| "--slot-fd: the descriptor is shared")?;
    Ok(Some(vmm::config::SlotMedia {
        file: Arc::new(std::fs::File::from(fd)),
        read_only,
    }))
}

fn parse_mib(v: &str) -> Result<u64, String> {
    v.parse()
        .map_err(|_| format!("--disk-quota-mib: not a number: {v}"))
}

/// Guest memory a pool process may reserve: what a bootable VM may have (see `VmConfig`).
const POOL_MEM_MIB: std::ops::RangeInclusive<u64> =
    (vmm::arch::layout::MIN_MEM_BYTES >> 20)..=(1 << 20);

/// `airlock-vmm pool`.
#[derive(Debug)]
pub struct PoolOptions {
    pub vcpus: u8,
    /// Guest memory to reserve and register in advance (the snapshot's size).
    pub mem_mib: Option<u64>,
    /// The snapshot this pool will restore: its memory is mapped and registered in advance.
    pub snapshot: Option<PathBuf>,
    pub control: PathBuf,
    pub vsock: Option<PathBuf>,
    /// The TAP of the snapshot's network card, if it has one.
    pub net_tap: Option<Arc<OwnedFd>>,
    pub console: ConsoleOutput,
    /// The CPU template the snapshot must have been taken with (default: detected).
    pub cpu_template: Option<CpuTemplate>,
    /// The overlay of the snapshot's copy-on-write root disk, if it has one (its quota may
    /// come with the restore request).
    pub root_overlay: Option<vmm::config::OverlayConfig>,
}

pub fn parse_pool(args: &[String]) -> Result<PoolOptions, String> {
    let mut vcpus = 1u8;
    let mut mem_mib = None;
    let mut snapshot = None;
    let mut control = None;
    let mut vsock = None;
    let mut net_tap = None;
    let mut console = ConsoleOutput::Stdout;
    let mut cpu_template = None;
    let (mut root_overlay, mut disk_quota) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--cpu-template" => cpu_template = parse_template(&value()?)?,
            "--vcpus" => {
                vcpus = value()?
                    .parse()
                    .ok()
                    .filter(|n| (1..=vmm::arch::mptable::MAX_CPUS).contains(n))
                    .ok_or("--vcpus: between 1 and 32")?
            }
            "--mem-mib" => {
                mem_mib = Some(
                    value()?
                        .parse()
                        .ok()
                        .filter(|n| (POOL_MEM_MIB).contains(n))
                        .ok_or(format!(
                            "--mem-mib: between {} and {} MiB",
                            POOL_MEM_MIB.start(),
                            POOL_MEM_MIB.end()
                        ))?,
                )
            }
            "--snapshot" => snapshot = Some(PathBuf::from(value()?)),
            "--control" => control = Some(PathBuf::from(value()?)),
            "--vsock" => vsock = Some(PathBuf::from(value()?)),
            "--net-fd" if net_tap.is_none() => net_tap = Some(adopt_fd(&value()?)?),
            "--console" => console = ConsoleOutput::File(PathBuf::from(value()?)),
            "--root-overlay" => root_overlay = Some(PathBuf::from(value()?)),
            "--disk-quota-mib" => disk_quota = Some(parse_mib(&value()?)?),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if mem_mib.is_some() && snapshot.is_some() {
        return Err("--mem-mib and --snapshot exclude each other".into());
    }
    Ok(PoolOptions {
        vcpus,
        mem_mib,
        snapshot,
        control: control.ok_or("--control PATH is required")?,
        vsock,
        net_tap,
        console,
        cpu_template,
        root_overlay: overlay_config(root_overlay, disk_quota)?,
    })
}

/// Takes ownership of descriptor `value`, which this process inherited (checked open; not 0, 1
/// or 2). Each flag that adopts one may appear once, so no descriptor is owned twice.
fn adopt_fd(value: &str) -> Result<Arc<OwnedFd>, String> {
    adopt_fd_for("--net-fd", value)
}

/// [`adopt_fd`] for `flag`.
fn adopt_fd_for(flag: &str, value: &str) -> Result<Arc<OwnedFd>, String> {
    let fd: i32 = value
        .parse()
        .ok()
        .filter(|fd| *fd > 2)
        .ok_or(format!("{flag}: not a descriptor number above 2: {value}"))?;
    // SAFETY: fcntl(F_GETFD) only asks whether `fd` is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(format!("{flag} {fd}: not an open descriptor"));
    }
    // SAFETY: `fd` is open, was inherited for this device, and is adopted only here, once.
    Ok(Arc::new(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Flags of the whole process, accepted by every VM subcommand (before a `run` command's `--`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ProcessFlags {
    /// `--no-seccomp`: run without the per-thread seccomp filters (debugging only).
    pub no_seccomp: bool,
    /// `--test-hooks`: accept `probe ...` on the control socket (tests of the jail only).
    pub test_hooks: bool,
}

/// Removes the process flags from `args` and returns them.
pub fn take_process_flags(args: &mut Vec<String>) -> ProcessFlags {
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let mut flags = ProcessFlags::default();
    let mut i = 0;
    let mut end = end;
    while i < end {
        let hit = match args[i].as_str() {
            "--no-seccomp" => {
                flags.no_seccomp = true;
                true
            }
            "--test-hooks" => {
                flags.test_hooks = true;
                true
            }
            _ => false,
        };
        if hit {
            args.remove(i);
            end -= 1;
        } else {
            i += 1;
        }
    }
    flags
}

pub fn log_vm_exit(exit: &VmExit) -> u8 {
    let c = exit.exit_code();
    if exit.is_clean() {
        log::info!("vm ended: {exit} (exit code {c})");
    } else {
        log::error!("vm ended: {exit} (exit code {c})");
    }
    c
}

/// "outer: inner: innermost", the whole `source()` chain on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn run_splits_options_from_the_command() {
        let r = parse_run(&args(
            "--kernel k --rootfs r --timeout 2 --env A=b -- sh -c true",
        ))
        .unwrap();
        assert_eq!(r.argv, vec!["sh", "-c", "true"]);
        assert_eq!(r.timeout, Some(Duration::from_secs(2)));
        assert_eq!(r.env, vec![("A".to_owned(), "b".to_owned())]);
        assert_eq!(r.vm.kernel, PathBuf::from("k"));
    }

    #[test]
    fn run_without_a_command_is_an_error() {
        assert!(parse_run(&args("--kernel k --rootfs r")).is_err());
        assert!(parse_run(&args("--kernel k --rootfs r --")).is_err());
    }

    #[test]
    fn boot_rejects_run_options() {
        assert!(parse_vm_options(&args("--kernel k --rootfs r --timeout 3"), false).is_err());
    }

    #[test]
    fn run_from_a_snapshot_needs_no_kernel_and_refuses_one() {
        let r = parse_run(&args("--snapshot /s --timeout 2 -- true")).unwrap();
        assert_eq!(r.snapshot, Some(PathBuf::from("/s")));
        assert!(parse_run(&args("--snapshot /s --kernel k -- true")).is_err());
    }

    #[test]
    fn snapshot_needs_an_output_directory() {
        let s = parse_snapshot(&args("--kernel k --rootfs r --out /o --mem-mib 512")).unwrap();
        assert_eq!(s.out, PathBuf::from("/o"));
        assert_eq!(s.run.vm.mem_mib, 512);
        assert!(parse_snapshot(&args("--kernel k --rootfs r")).is_err());
        let w = parse_snapshot(&args("--kernel k --rootfs r --out /o --warmup true")).unwrap();
        assert_eq!(w.warmup.as_deref(), Some("true"));
        assert_eq!(s.warmup, None);
    }

    #[test]
    fn restore_takes_the_snapshot_vsock_and_control_paths() {
        let r = parse_restore(&args("--snapshot /s --vsock /v --control /c")).unwrap();
        assert_eq!(r.restore.snapshot_dir, PathBuf::from("/s"));
        assert_eq!(r.restore.vsock_uds, Some(PathBuf::from("/v")));
        assert_eq!(r.control, Some(PathBuf::from("/c")));
        assert!(parse_restore(&args("--vsock /v")).is_err());
        assert!(parse_restore(&args("--snapshot /s --bogus")).is_err());
    }

    #[test]
    fn pool_needs_a_control_socket_and_a_sane_vcpu_count() {
        let p = parse_pool(&args("--control /c --vcpus 2 --vsock /v")).unwrap();
        assert_eq!(p.mem_mib, None);
        let m = parse_pool(&args("--control /c --mem-mib 2048")).unwrap();
        assert_eq!(m.mem_mib, Some(2048));
        assert!(parse_pool(&args("--control /c --mem-mib 1")).is_err());
        let s = parse_pool(&args("--control /c --snapshot /s")).unwrap();
        assert_eq!(s.snapshot, Some(PathBuf::from("/s")));
        assert!(parse_pool(&args("--control /c --snapshot /s --mem-mib 256")).is_err());
        assert_eq!(
            (p.vcpus, p.control.as_path()),
            (2, std::path::Path::new("/c"))
        );
        assert!(parse_pool(&args("--vcpus 2")).is_err());
        assert!(parse_pool(&args("--control /c --vcpus 0")).is_err());
        assert!(parse_pool(&args("--control /c --vcpus 99")).is_err());
    }

    #[test]
    fn process_flags_are_taken_out_before_the_command_only() {
        let mut a = args("pool --no-seccomp --control /c --test-hooks");
        let f = take_process_flags(&mut a);
        assert!(f.no_seccomp && f.test_hooks);
        assert_eq!(a, args("pool --control /c"));
        let mut r = args("run --snapshot /s -- prog --no-seccomp");
        assert_eq!(take_process_flags(&mut r), ProcessFlags::default());
        assert_eq!(r, args("run --snapshot /s -- prog --no-seccomp"));
    }

    #[test]
    fn vsock_cid_applies_to_the_vsock_device() {
        let (c, _) = parse_vm_options(
            &args("--kernel k --rootfs r --vsock /s --vsock-cid 9"),
            false,
        )
        .unwrap();
        assert_eq!(c.vsock.unwrap().guest_cid, 9);
    }
}
