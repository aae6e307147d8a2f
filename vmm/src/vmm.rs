//! One microVM once built (see [`crate::builder`]): the event loop, pause, resume, snapshot,
//! and the end of the VM.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_control::{Reply, SnapshotReply, StateReply, StatusReply, StopReply, VmState};
use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::build_error::BuildError;
use crate::control::{CommandQueue, CommandReply, ControlHandle, VmCommand, command_channel};
use crate::devices::legacy::{ConsoleEvents, SerialDevice};
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mmio::MmioTransport;
use crate::exit::VmExit;
use crate::snapshot::kvm::VmKvmState;
use crate::snapshot::{
    DeviceKind, LAYER_FILE, LAYER_MAP_FILE, MEMORY_FILE, MachineSnapshot, Snapshot, VirtioSnapshot,
    memory,
};
use crate::vcpu::{VcpuEvent, VcpuHandle, VcpuResponse};
use crate::vm::Vm;

pub(crate) type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

/// A booted (or bootable) microVM.
pub struct Vmm {
    vm: Vm,
    vcpus: Vec<VcpuHandle>,
    events: EventManager<Subscriber>,
    control: Arc<Mutex<ControlState>>,
    console: Arc<ConsoleEvents>,
    started: Instant,
    /// Keeps devices alive (and reachable for metrics) for the VM's lifetime.
    blocks: Vec<Arc<Mutex<Block>>>,
    /// Written to stop the VM from another thread.
    stop: EventFd,
    serial: Arc<Mutex<SerialDevice>>,
    /// Virtio transports in slot order, with what each device is (for snapshots).
    virtio: Vec<(Arc<Mutex<MmioTransport>>, DeviceKind)>,
    machine: MachineSnapshot,
    commands: CommandQueue,
    control_handle: ControlHandle,
    paused: bool,
    /// When a restore began, until the vCPUs run (for the restore timing).
    restore_started: Option<Instant>,
    /// When the last vCPU went back to running, as it reported.
    last_resumed: Option<Instant>,
}

impl std::fmt::Debug for Vmm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vmm")
            .field("vcpus", &self.vcpus.len())
            .finish()
    }
}

/// Event fds shared between the devices, the vCPUs and the exit watcher.
pub(crate) struct VmEvents {
    pub(crate) console: Arc<ConsoleEvents>,
    pub(crate) reset: EventFd,
    pub(crate) stop: EventFd,
    pub(crate) vcpu_exit: EventFd,
}

impl VmEvents {
    pub(crate) fn new(started: Instant) -> Result<Self, BuildError> {
        let fd = || EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd);
        Ok(Self {
            console: Arc::new(ConsoleEvents::new(started).map_err(BuildError::EventFd)?),
            reset: fd()?,
            stop: fd()?,
            vcpu_exit: fd()?,
        })
    }
}

/// Everything a VM is made of once devices and vCPUs exist.
pub(crate) struct VmParts {
    pub(crate) vm: Vm,
    pub(crate) vcpus: Vec<VcpuHandle>,
    pub(crate) evts: VmEvents,
    pub(crate) blocks: Vec<Arc<Mutex<Block>>>,
    pub(crate) serial: Option<Arc<Mutex<SerialDevice>>>,
    pub(crate) virtio: Vec<(Arc<Mutex<MmioTransport>>, DeviceKind)>,
    pub(crate) subscribers: Vec<Subscriber>,
    pub(crate) machine: MachineSnapshot,
    pub(crate) boot_timeout: Option<Duration>,
    pub(crate) started: Instant,
    pub(crate) restore_started: Option<Instant>,
}

/// The event loop with the exit watcher and every device's subscriber, and the `Vmm`.
pub(crate) fn assemble(p: VmParts) -> Result<Vmm, BuildError> {
    let serial = p
        .serial
        .ok_or_else(|| BuildError::Restore("no serial device".into()))?;
    let control = Arc::new(Mutex::new(ControlState::default()));
    let (control_handle, commands) = command_channel().map_err(BuildError::EventFd)?;
    let mut events: EventManager<Subscriber> =
        EventManager::new().map_err(BuildError::EventManager)?;
    let deadline = TimerFd::new().map_err(|e| BuildError::EventFd(e.into()))?;
    let grace = TimerFd::new().map_err(|e| BuildError::EventFd(e.into()))?;
    let stop = p.evts.stop.try_clone().map_err(BuildError::EventFd)?;
    let watcher = ExitWatcher {
        reset_evt: p.evts.reset,
        stop_evt: p.evts.stop,
        vcpu_exit_evt: p.evts.vcpu_exit,
        command_evt: commands.wake.try_clone().map_err(BuildError::EventFd)?,
        console: p.evts.console.clone(),
        deadline,
        panic_grace: grace,
        boot_timeout: p.boot_timeout,
        state: control.clone(),
        ready_logged: AtomicBool::new(false),
        guest_ranges: guest_host_ranges(p.vm.memory()),
    };
    events.add_subscriber(Arc::new(Mutex::new(watcher)));
    for s in p.subscribers {
        events.add_subscriber(s);
    }
    Ok(Vmm {
        vm: p.vm,
        vcpus: p.vcpus,
        events,
        control,
        console: p.evts.console,
        started: p.started,
        blocks: p.blocks,
        stop,
        serial,
        virtio: p.virtio,
        machine: p.machine,
        commands,
        control_handle,
        paused: false,
        restore_started: p.restore_started,
        last_resumed: None,
    })
}

impl Vmm {
    /// Resumes every vCPU and runs the event loop until the VM ends; returns why it ended.
    pub fn run(self) -> Result<VmExit, BuildError> {
        self.run_then(|| {})
    }

    /// [`Self::run`], calling `on_running` once the vCPUs run (for work that should not delay
    /// them, such as answering whoever asked for a restore).
    pub fn run_then(mut self, on_running: impl FnOnce()) -> Result<VmExit, BuildError> {
        // From here on this thread runs the devices, i.e. parses what the guest writes: it does
        // so under its filter, installed before any vCPU runs guest code.
        crate::seccomp::apply(crate::seccomp::ThreadClass::Vmm).map_err(BuildError::Seccomp)?;
        if let Err(e) = self.resume() {
            log::error!("start the vCPUs: {e}");
        }
        // Measured to the instant the last vCPU thread reported running, not to when this
        // thread got the CPU back to read the reports.
        let running_us = self.restore_started.take().map(|t| {
            self.last_resumed
                .unwrap_or_else(Instant::now)
                .saturating_duration_since(t)
                .as_micros()
        });
        on_running();
        if let Some(us) = running_us {
            log::info!(
                "restored: vcpus running {us} us after the restore began ({} us after process \
                 start)",
                self.started.elapsed().as_micros()
            );
        }
        let exit = loop {
            if let Err(e) = self.events.run() {
                log::error!("event loop: {e:?}");
            }
            let (vcpu_exited, exit, commands) = {
                let mut st = self.control.lock().unwrap_or_else(|e| e.into_inner());
                (
                    std::mem::take(&mut st.vcpu_exited),
                    st.exit.take(),
                    std::mem::take(&mut st.commands_pending),
                )
            };
            if vcpu_exited && let Some(exit) = self.collect_vcpu_exit() {
                break exit;
            }
            if let Some(exit) = exit {
                break exit;
            }
            if commands {
                self.handle_commands();
                let mut st = self.control.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(exit) = st.exit.take() {
                    break exit;
                }
            }
        };
        if matches!(exit, VmExit::BootTimeout { .. }) {
            self.log_vcpu_states();
        }
        self.shutdown();
        Ok(exit)
    }

    /// A handle that sends [`VmCommand`]s to this VM's event loop from any thread (also what
    /// the control socket uses).
    pub fn control_handle(&self) -> std::io::Result<ControlHandle> {
        self.control_handle.try_clone()
    }

    fn handle_commands(&mut self) {
        while let Ok((cmd, reply)) = self.commands.rx.try_recv() {
            log::info!("control: {cmd:?}");
            let answer = self.execute(cmd);
            if let Err(e) = &answer {
                log::warn!("control: {e}");
            }
            let _ = reply.send(answer);
        }
    }

    fn execute(&mut self, cmd: VmCommand) -> CommandReply {
        let state = |state| Reply::State(StateReply { state });
        match cmd {
            VmCommand::Pause => self.pause().map(|()| state(VmState::Paused)),
            VmCommand::Resume => self.resume().map(|()| state(VmState::Running)),
            VmCommand::Snapshot(dir) => self.snapshot(&dir).map(Reply::Snapshot),
            VmCommand::Status => Ok(Reply::Status(StatusReply {
                state: if self.paused {
                    VmState::Paused
                } else {
                    VmState::Running
                },
                vcpus: u32::from(self.machine.vcpus),
                mem_mib: Some(u32::try_from(self.machine.mem_mib).unwrap_or(u32::MAX)),
                cpu_template: Some(self.machine.cpu_template.clone()),
                uptime_ms: Some(self.started.elapsed().as_millis() as u64),
                userspace_up: Some(self.console.ready_after_us().is_some()),
            })),
            VmCommand::Probe(p) => crate::probe::run(p),
            VmCommand::Settle(_) => Err("settle runs on the caller's thread".into()),
            VmCommand::Stop => {
                let mut st = self.control.lock().unwrap_or_else(|e| e.into_inner());
                st.exit.get_or_insert(VmExit::Stopped);
                Ok(Reply::Stop(StopReply {}))
            }
        }
    }

    /// Waits for each vCPU's answer to an event it was sent; a vCPU that stops for good meanwhile
    /// ends the VM with its reason.
    fn await_vcpus<T>(
        &self,
        mut pick: impl FnMut(VcpuResponse) -> Option<T>,
    ) -> Result<Vec<T>, String> {
        let mut out = Vec::with_capacity(self.vcpus.len());
        for v in &self.vcpus {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match v.responses.recv_timeout(left) {
                    Ok(VcpuResponse::Exited(exit)) => {
                        self.control
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .exit
                            .get_or_insert(exit);
                        return Err(format!("vcpu{} stopped: the VM is ending", v.index));
                    }
                    Ok(r) => {
                        if let Some(t) = pick(r) {
                            out.push(t);
                            break;
                        }
                    }
                    Err(_) => return Err(format!("vcpu{} did not answer", v.index)),
                }
            }
        }
        Ok(out)
    }

    /// Parks every vCPU outside `KVM_RUN` (idempotent). Devices stay attached; nothing runs in
    /// the guest until [`Self::resume`].
    pub fn pause(&mut self) -> Result<(), String> {
        if self.paused {
            return Ok(());
        }
        for v in &self.vcpus {
            v.send(VcpuEvent::Pause);
        }
        self.await_vcpus(|r| matches!(r, VcpuResponse::Paused).then_some(()))?;
        self.paused = true;
        Ok(())
    }

    /// Lets every vCPU run again (idempotent).
    pub fn resume(&mut self) -> Result<(), String> {
        for v in &self.vcpus {
            v.send(VcpuEvent::Resume);
        }
        let at = self.await_vcpus(|r| match r {
            VcpuResponse::Resumed(at) => Some(at),
            _ => None,
        })?;
        self.last_resumed = at.into_iter().max();
        self.paused = false;
        Ok(())
    }

    /// Writes a snapshot of the paused VM into `dir`, which the caller prepared (see
    /// [`airlock_control::snapshot_dir`]: the VMM creates no files): guest memory first, then
    /// the `state` file (renamed into place last, so a directory with a `state` file is
    /// complete).
    pub fn snapshot(&mut self, dir: &std::path::Path) -> Result<SnapshotReply, String> {
        if !self.paused {
            return Err("pause the VM before taking a snapshot".into());
        }
        let began = Instant::now();
        for v in &self.vcpus {
            v.send(VcpuEvent::SaveState);
        }
        let vcpus = self
            .await_vcpus(|r| match r {
                VcpuResponse::Saved(s) => Some(s),
                _ => None,
            })?
            .into_iter()
            .map(|s| s.map(|b| *b))
            .collect::<Result<Vec<_>, _>>()?;
        let vm = VmKvmState::save(self.vm.fd()).map_err(|e| e.to_string())?;
        let serial = self
            .serial
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .state()
            .into();
        let virtio = self
            .virtio
            .iter()
            .map(|(t, kind)| VirtioSnapshot {
                kind: kind.clone(),
                transport: t.lock().unwrap_or_else(|e| e.into_inner()).snapshot(),
            })
            .collect();
        let snap = Snapshot {
            machine: self.machine.clone(),
            memory: memory::layout(self.vm.memory()),
            vm,
            vcpus,
            serial,
            virtio,
        };
        snap.validate().map_err(|e| error_text(&e))?;
        let mem_at = Instant::now();
        let written =
            memory::save(self.vm.memory(), &dir.join(MEMORY_FILE)).map_err(|e| error_text(&e))?;
        let mem_ms = mem_at.elapsed().as_secs_f64() * 1e3;
        let layer_bytes = self.write_disk_layer(dir)?;
        let state_bytes = snap.write_state(dir).map_err(|e| error_text(&e))?;
        let ms = began.elapsed().as_secs_f64() * 1e3;
        log::info!(
            "snapshot written to {} in {ms:.1} ms ({} MiB of memory in {mem_ms:.1} ms)",
            dir.display(),
            written >> 20
        );
        Ok(SnapshotReply {
            dir: dir.display().to_string(),
            memory_bytes_written: written,
            state_bytes,
            snapshot_ms: ms,
            memory_ms: mem_ms,
            layer_bytes,
            settle: None,
        })
    }

    /// The copy-on-write disk's blocks (at most one such disk: the root) into the snapshot's
    /// prepared layer files; the bytes written.
    fn write_disk_layer(&self, dir: &std::path::Path) -> Result<u64, String> {
        let mut written = None;
        for b in &self.blocks {
            let b = b.lock().unwrap_or_else(|e| e.into_inner());
            let Some(disk) = b.layered_disk() else {
                continue;
            };
            if written.is_some() {
                return Err("a snapshot holds one copy-on-write disk at most".into());
            }
            let open = |name| {
                airlock_control::snapshot_dir::open_prepared(dir, name)
                    .map_err(|e| format!("{name}: {e}"))
            };
            let (data, map) = (open(LAYER_FILE)?, open(LAYER_MAP_FILE)?);
            let blocks = disk
                .write_layer(&data, &map)
                .map_err(|e| format!("writing the disk's layer: {e}"))?;
            written = Some(blocks * crate::devices::virtio::block::layered::BLOCK_SIZE);
        }
        Ok(written.unwrap_or(0))
    }

    /// Logs where every vCPU is, for a VM that is about to be stopped from outside.
    fn log_vcpu_states(&self) {
        for v in &self.vcpus {
            v.send(VcpuEvent::ReportState);
            let deadline = Instant::now() + Duration::from_secs(5);
            // Earlier answers (Resumed) may still be queued; skip to the report.
            let state = std::iter::from_fn(|| {
                v.responses
                    .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .ok()
            })
            .find_map(|r| match r {
                VcpuResponse::State { rip, insn } => Some((rip, insn)),
                _ => None,
            });
            match state {
                Some((rip, insn)) => {
                    log::warn!(
                        "vcpu{} at rip={rip:#x}, instruction bytes {insn:02x?}",
                        v.index
                    )
                }
                None => log::warn!("vcpu{}: no state report", v.index),
            }
        }
    }

    fn collect_vcpu_exit(&self) -> Option<VmExit> {
        self.vcpus.iter().find_map(|v| {
            v.responses.try_iter().find_map(|r| match r {
                VcpuResponse::Exited(exit) => Some(exit),
                _ => None,
            })
        })
    }

    /// Makes SIGTERM and SIGINT stop the VM ([`VmExit::Stopped`]) instead of killing the
    /// process, so that devices flush and vCPU threads end in order. Process-wide; for binaries.
    pub fn stop_on_termination_signals(&self) -> Result<(), vmm_sys_util::errno::Error> {
        STOP_FD.store(self.stop.as_raw_fd(), Ordering::Release);
        for sig in [libc::SIGTERM, libc::SIGINT] {
            vmm_sys_util::signal::register_signal_handler(sig, handle_stop_signal)?;
        }
        Ok(())
    }

    /// A handle that stops the VM ([`VmExit::Stopped`]) when written, from any thread.
    pub fn stop_handle(&self) -> std::io::Result<EventFd> {
        self.stop.try_clone()
    }

    /// Microseconds from start to `airlock: userspace up`, if the guest printed it.
    pub fn ready_after(&self) -> Option<Duration> {
        self.console.ready_after_us().map(Duration::from_micros)
    }

    /// Console bytes dropped past the output limit.
    pub fn console_bytes_dropped(&self) -> u64 {
        self.console.bytes_dropped()
    }

    /// Block device metrics, in attachment order.
    pub fn block_metrics(&self) -> Vec<Arc<crate::devices::virtio::block::BlockMetrics>> {
        self.blocks
            .iter()
            .map(|b| b.lock().unwrap_or_else(|e| e.into_inner()).metrics.clone())
            .collect()
    }

    /// Guest memory (for tests and snapshots).
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.vm.memory()
    }

    /// When this VMM started.
    pub fn started(&self) -> Instant {
        self.started
    }

    fn shutdown(&mut self) {
        for v in &mut self.vcpus {
            v.finish();
        }
        let _ = std::io::stdout().flush();
    }
}

fn error_text(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// The stop eventfd for [`handle_stop_signal`]; -1 when none.
static STOP_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn handle_stop_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let fd = STOP_FD.load(Ordering::Acquire);
    if fd >= 0 {
        let one = 1u64.to_ne_bytes();
        // SAFETY: write(2) is async-signal-safe; `fd` is the VMM's stop eventfd, which lives as
        // long as the `Vmm` (the process ends right after it), and the buffer is 8 valid bytes.
        unsafe {
            libc::write(fd, one.as_ptr().cast(), one.len());
        }
    }
}

/// What the event loop has decided about the VM's end.
#[derive(Debug, Default)]
struct ControlState {
    exit: Option<VmExit>,
    vcpu_exited: bool,
    commands_pending: bool,
}

/// Watches everything that can end the VM: the i8042 reset, a vCPU that stopped, the console
/// (ready line, kernel panic) and the boot deadline.
struct ExitWatcher {
    reset_evt: EventFd,
    stop_evt: EventFd,
    vcpu_exit_evt: EventFd,
    /// Written by a [`ControlHandle`] when a command is queued.
    command_evt: EventFd,
    console: Arc<ConsoleEvents>,
    deadline: TimerFd,
    panic_grace: TimerFd,
    boot_timeout: Option<Duration>,
    state: Arc<Mutex<ControlState>>,
    ready_logged: AtomicBool,
    /// Host address ranges of guest RAM, excluded from the VMM's own footprint.
    guest_ranges: Vec<(u64, u64)>,
}

fn guest_host_ranges(mem: &GuestMemoryMmap) -> Vec<(u64, u64)> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    mem.iter().map(|r| (r.as_ptr() as u64, r.len())).collect()
}

/// How long the console may keep printing after a panic before the VM is stopped anyway
/// (with `panic=-1` the guest resets itself sooner).
const PANIC_GRACE: Duration = Duration::from_secs(2);

impl ExitWatcher {
    fn set_exit(&self, exit: VmExit) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.exit.get_or_insert(exit);
    }

    fn on_console(&mut self) {
        let _ = self.console.notify.read();
        if let Some(us) = self.console.ready_after_us()
            && !self.ready_logged.swap(true, Ordering::Relaxed)
        {
            log::info!("guest reached userspace after {:.3} s", us as f64 / 1e6);
            let _ = self.deadline.clear();
            if let Some(kib) = crate::memstat::self_rss_excluding_kib(&self.guest_ranges) {
                log::info!("vmm overhead: {kib} KiB resident outside guest memory");
            }
        }
        if self.console.panicked() {
            log::warn!("guest kernel panicked");
            let _ = self.panic_grace.reset(PANIC_GRACE, None);
        }
    }
}

impl MutEventSubscriber for ExitWatcher {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.reset_evt.as_raw_fd() {
            let _ = self.reset_evt.read();
            let exit = if self.console.panicked() {
                VmExit::GuestPanic
            } else {
                VmExit::GuestReset
            };
            self.set_exit(exit);
        } else if fd == self.stop_evt.as_raw_fd() {
            let _ = self.stop_evt.read();
            self.set_exit(VmExit::Stopped);
        } else if fd == self.vcpu_exit_evt.as_raw_fd() {
            let _ = self.vcpu_exit_evt.read();
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .vcpu_exited = true;
        } else if fd == self.command_evt.as_raw_fd() {
            let _ = self.command_evt.read();
            self.state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .commands_pending = true;
        } else if fd == self.console.notify.as_raw_fd() {
            self.on_console();
        } else if fd == self.deadline.as_raw_fd() {
            let _ = self.deadline.wait();
            if self.console.ready_after_us().is_none() {
                let after = self.boot_timeout.unwrap_or_default();
                self.set_exit(VmExit::BootTimeout { after });
            }
        } else if fd == self.panic_grace.as_raw_fd() {
            let _ = self.panic_grace.wait();
            self.set_exit(VmExit::GuestPanic);
        }
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Some(t) = self.boot_timeout
            && let Err(e) = self.deadline.reset(t, None)
        {
            log::error!("arm the boot deadline: {e}");
        }
        let fds = [
            self.reset_evt.as_raw_fd(),
            self.stop_evt.as_raw_fd(),
            self.vcpu_exit_evt.as_raw_fd(),
            self.command_evt.as_raw_fd(),
            self.console.notify.as_raw_fd(),
            self.deadline.as_raw_fd(),
            self.panic_grace.as_raw_fd(),
        ];
        for fd in fds {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                log::error!("event loop: watch fd {fd}: {e:?}");
            }
        }
    }
}
