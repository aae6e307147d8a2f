//! One microVM: the boot recipe, the event loop, and the end of the VM.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_control::{Reply, SnapshotReply, StateReply, StatusReply, StopReply, VmState};
use event_manager::{EventManager, EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::IoEventAddress;
use linux_loader::loader::{Elf, KernelLoader, load_cmdline};
use thiserror::Error;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vm_superio::{I8042Device, Serial};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use crate::arch::cpuid::CpuTemplate;
use crate::arch::layout::{
    CMDLINE_ADDR, HIMEM_START, I8042_PORT_BASE, SERIAL_IRQ, SERIAL_PORT_BASE,
    VIRTIO_MMIO_MAX_SLOTS, VIRTIO_MMIO_SLOT_SIZE, virtio_irq, virtio_mmio_addr,
};
use crate::arch::{boot, mptable, regs};
use crate::config::{ConfigError, ConsoleOutput, DiskConfig, VmConfig, VsockConfig, build_cmdline};
use crate::control::{CommandQueue, CommandReply, ControlHandle, VmCommand, command_channel};
use crate::devices::bus::{Bus, BusError};
use crate::devices::legacy::{ConsoleEvents, ConsoleSink, EventFdTrigger, I8042, SerialDevice};
use crate::devices::virtio::block::{Block, BlockError, BlockEventHandler};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::vsock::{Vsock, VsockError, VsockEventHandler};
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt};
use crate::exit::VmExit;
use crate::snapshot::kvm::VmKvmState;
use crate::snapshot::{
    DeviceKind, MEMORY_FILE, MachineSnapshot, SerialSnapshot, Snapshot, SnapshotError,
    VirtioSnapshot, memory,
};
use crate::vcpu::{Vcpu, VcpuEvent, VcpuHandle, VcpuResponse, register_kick_handler};
use crate::vm::{Vm, VmError};

/// Errors building or running a VM (host-side failures, not guest faults).
#[derive(Debug, Error)]
pub enum BuildError {
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    #[error("set up KVM")]
    Vm(#[from] VmError),
    #[error("open kernel {0}")]
    OpenKernel(String, #[source] std::io::Error),
    #[error("load kernel")]
    LoadKernel(#[source] linux_loader::loader::Error),
    #[error("write the kernel command line")]
    LoadCmdline(#[source] linux_loader::loader::Error),
    #[error("write boot structures")]
    Boot(#[from] boot::BootError),
    #[error("write the MP table")]
    MpTable(#[from] mptable::MpTableError),
    #[error("configure vCPU")]
    Regs(#[from] regs::RegsError),
    #[error("attach a disk")]
    Block(#[from] BlockError),
    #[error("attach the vsock device")]
    Vsock(#[from] VsockError),
    #[error("place a device on the bus")]
    Bus(#[from] BusError),
    #[error("too many virtio devices (at most {VIRTIO_MMIO_MAX_SLOTS})")]
    TooManyDevices,
    #[error("register an irqfd or ioeventfd with KVM")]
    RegisterEvent(#[source] kvm_ioctls::Error),
    #[error("create an eventfd or timerfd")]
    EventFd(#[source] std::io::Error),
    #[error("open the console output {0}")]
    Console(String, #[source] std::io::Error),
    #[error("install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("start a vCPU thread")]
    SpawnVcpu(#[source] std::io::Error),
    #[error("create the event loop")]
    EventManager(#[source] event_manager::Error),
    #[error("snapshot")]
    Snapshot(#[from] SnapshotError),
    #[error("restore: {0}")]
    Restore(String),
    #[error("seccomp")]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

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

/// Devices under construction, before the buses are frozen.
struct DeviceSet {
    pio: Bus,
    mmio: Bus,
    virtio_slots: Vec<(u64, u32)>,
    blocks: Vec<Arc<Mutex<Block>>>,
    vsock: Option<Arc<Mutex<Vsock>>>,
    subscribers: Vec<Subscriber>,
    serial: Option<Arc<Mutex<SerialDevice>>>,
    virtio: Vec<(Arc<Mutex<MmioTransport>>, DeviceKind)>,
}

impl DeviceSet {
    fn new() -> Self {
        Self {
            pio: Bus::default(),
            mmio: Bus::default(),
            virtio_slots: Vec::new(),
            blocks: Vec::new(),
            vsock: None,
            subscribers: Vec::new(),
            serial: None,
            virtio: Vec::new(),
        }
    }
}

/// Event fds shared between the devices, the vCPUs and the exit watcher.
struct VmEvents {
    console: Arc<ConsoleEvents>,
    reset: EventFd,
    stop: EventFd,
    vcpu_exit: EventFd,
}

impl VmEvents {
    fn new(started: Instant) -> Result<Self, BuildError> {
        let fd = || EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd);
        Ok(Self {
            console: Arc::new(ConsoleEvents::new(started).map_err(BuildError::EventFd)?),
            reset: fd()?,
            stop: fd()?,
            vcpu_exit: fd()?,
        })
    }
}

/// Builds a VM from `config` and leaves its vCPUs paused; `started` is when the process (or the
/// request) began, for boot timing. This is the one boot recipe; the order is fixed:
/// memory and KVM → legacy devices → virtio devices → kernel and command line → boot structures
/// → vCPUs → event loop.
pub fn build_microvm_for_boot(config: &VmConfig, started: Instant) -> Result<Vmm, BuildError> {
    config.validate()?;
    let template = config.cpu_template.unwrap_or_else(CpuTemplate::detect);
    let vm = Vm::new(config.mem_bytes())?;
    let evts = VmEvents::new(started)?;

    let mut devices = DeviceSet::new();
    attach_legacy_devices(
        &vm,
        &mut devices,
        &config.console,
        config.console_limit,
        None,
        &evts,
    )?;
    for disk in &config.disks {
        attach_block_device(&vm, &mut devices, disk)?;
    }
    if let Some(vsock) = &config.vsock {
        attach_vsock_device(&vm, &mut devices, vsock)?;
    }

    let entry = load_kernel(&vm, config)?;
    let cmdline = build_cmdline(template, &devices.virtio_slots, &config.cmdline_extra)?;
    load_cmdline(vm.memory(), GuestAddress(CMDLINE_ADDR), &cmdline)
        .map_err(BuildError::LoadCmdline)?;
    let cmdline_str = cmdline
        .as_cstring()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    log::info!("kernel command line: {cmdline_str}");
    configure_system_for_boot(vm.memory(), cmdline_str.len(), config.vcpus)?;

    register_kick_handler().map_err(BuildError::Signal)?;
    let (pio, mmio) = (Arc::new(devices.pio), Arc::new(devices.mmio));
    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for index in 0..config.vcpus {
        let fd = vm.create_vcpu(index)?;
        let vcpu = new_vcpu(&vm, fd, index, &pio, &mmio, &evts, vm.msr_index_list()?)?;
        configure_vcpu_for_boot(&vm, &vcpu, template, index, config.vcpus, entry)?;
        vcpus.push(vcpu.start_paused().map_err(BuildError::SpawnVcpu)?);
    }
    let machine = MachineSnapshot {
        vcpus: config.vcpus,
        mem_mib: config.mem_mib,
        cpu_template: template_name(template).into(),
        cmdline: cmdline_str,
    };
    let parts = VmParts {
        vm,
        vcpus,
        evts,
        blocks: devices.blocks,
        serial: devices.serial,
        virtio: devices.virtio,
        subscribers: devices.subscribers,
        machine,
        boot_timeout: config.boot_timeout,
        started,
        restore_started: None,
    };
    assemble(parts)
}

/// Durations of consecutive steps, for the restore log line.
struct StepTimer {
    last: Instant,
    steps: Vec<(&'static str, u128)>,
}

impl StepTimer {
    fn new(start: Instant) -> Self {
        Self {
            last: start,
            steps: Vec::new(),
        }
    }

    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps
            .push((name, now.duration_since(self.last).as_micros()));
        self.last = now;
    }

    fn report(&self) -> String {
        self.steps
            .iter()
            .map(|(n, us)| format!("{n}={us}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

fn template_name(t: CpuTemplate) -> &'static str {
    match t {
        CpuTemplate::Host => "host",
        CpuTemplate::NestedPvm => "nested",
    }
}

/// A vCPU on the buses; `msrs` are the MSRs its snapshots will save.
fn new_vcpu(
    vm: &Vm,
    fd: kvm_ioctls::VcpuFd,
    index: u8,
    pio: &Arc<Bus>,
    mmio: &Arc<Bus>,
    evts: &VmEvents,
    msrs: &[u32],
) -> Result<Vcpu, BuildError> {
    let exit = evts.vcpu_exit.try_clone().map_err(BuildError::EventFd)?;
    let mut vcpu = Vcpu::new(
        fd,
        index,
        pio.clone(),
        mmio.clone(),
        vm.memory().clone(),
        exit,
    );
    vcpu.set_msr_index_list(msrs);
    Ok(vcpu)
}

/// Everything a VM is made of once devices and vCPUs exist.
struct VmParts {
    vm: Vm,
    vcpus: Vec<VcpuHandle>,
    evts: VmEvents,
    blocks: Vec<Arc<Mutex<Block>>>,
    serial: Option<Arc<Mutex<SerialDevice>>>,
    virtio: Vec<(Arc<Mutex<MmioTransport>>, DeviceKind)>,
    subscribers: Vec<Subscriber>,
    machine: MachineSnapshot,
    boot_timeout: Option<Duration>,
    started: Instant,
    restore_started: Option<Instant>,
}

/// The event loop with the exit watcher and every device's subscriber, and the `Vmm`.
fn assemble(p: VmParts) -> Result<Vmm, BuildError> {
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

/// Where a restored VM's console and vsock go, and which snapshot it comes from.
#[derive(Clone, Debug)]
pub struct RestoreConfig {
    pub snapshot_dir: std::path::PathBuf,
    /// The host side of the vsock device, required when the snapshot has one.
    pub vsock_uds: Option<std::path::PathBuf>,
    pub console: ConsoleOutput,
    pub console_limit: u64,
    pub cpu_template: Option<CpuTemplate>,
}

/// Builds a VM from a snapshot directory and leaves its vCPUs paused; `run` starts them.
/// Guest memory is the snapshot's memory file mapped `MAP_PRIVATE`, so nothing of it is read
/// here. Steps: state file (checked) → memory mapping → KVM VM → legacy devices (serial state)
/// → virtio devices in their slots (transport and queue state; active devices re-activated) →
/// KVM VM state (irqchip, PIT, clock) → vCPUs with their KVM state → a vsock transport reset.
pub fn build_microvm_from_snapshot(
    config: &RestoreConfig,
    started: Instant,
) -> Result<Vmm, BuildError> {
    restore_microvm(config, started, None, Instant::now())
}

/// [`build_microvm_from_snapshot`] into a VM prepared in advance (its KVM VM, irqchip, PIT and
/// vCPU fds already exist; see `PreparedVm`), as a pool process does; `restore_started` is
/// when the restore was asked for.
pub fn restore_microvm(
    config: &RestoreConfig,
    started: Instant,
    prepared: Option<crate::vm::PreparedVm>,
    restore_started: Instant,
) -> Result<Vmm, BuildError> {
    let mut marks = StepTimer::new(restore_started);
    let snap = Snapshot::read_state(&config.snapshot_dir)?;
    marks.mark("state");
    let template = config.cpu_template.unwrap_or_else(CpuTemplate::detect);
    if snap.machine.cpu_template != template_name(template) {
        return Err(BuildError::Restore(format!(
            "the snapshot was taken with CPU template {:?}, this host uses {:?}",
            snap.machine.cpu_template,
            template_name(template)
        )));
    }
    let memory_file = config.snapshot_dir.join(MEMORY_FILE);
    let (vm, vcpu_fds) = match prepared {
        Some(prepared) => {
            if prepared.vcpu_count() != snap.vcpus.len() {
                return Err(BuildError::Restore(format!(
                    "{} vCPUs were prepared, the snapshot has {}",
                    prepared.vcpu_count(),
                    snap.vcpus.len()
                )));
            }
            prepared.into_vm(&memory_file, &snap.memory)?
        }
        None => {
            let mem =
                memory::map_private(&memory_file, &snap.memory).map_err(SnapshotError::from)?;
            marks.mark("map");
            let vm = Vm::with_memory(mem)?;
            let fds = snap
                .vcpus
                .iter()
                .map(|v| vm.create_vcpu(v.index))
                .collect::<Result<_, _>>()?;
            (vm, fds)
        }
    };
    marks.mark("kvm-vm");
    let evts = VmEvents::new(started)?;
    let mut devices = DeviceSet::new();
    attach_legacy_devices(
        &vm,
        &mut devices,
        &config.console,
        config.console_limit,
        Some(&snap.serial),
        &evts,
    )?;
    for v in &snap.virtio {
        let transport = match &v.kind {
            DeviceKind::Block {
                path,
                read_only,
                id,
            } => attach_block_device(
                &vm,
                &mut devices,
                &DiskConfig {
                    path: path.clone(),
                    read_only: *read_only,
                    id: id.clone(),
                },
            )?,
            DeviceKind::Vsock { guest_cid } => {
                let uds_path = config.vsock_uds.clone().ok_or_else(|| {
                    BuildError::Restore("the snapshot has a vsock device: give its socket".into())
                })?;
                let cfg = VsockConfig {
                    guest_cid: *guest_cid,
                    uds_path,
                };
                attach_vsock_device(&vm, &mut devices, &cfg)?
            }
        };
        transport
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restore(&v.transport)
            .map_err(|e| BuildError::Restore(format!("{:?}: {e}", v.kind)))?;
    }
    marks.mark("devices");
    snap.vm
        .restore(vm.fd())
        .map_err(|e| BuildError::Snapshot(e.into()))?;
    marks.mark("vm-state");
    register_kick_handler().map_err(BuildError::Signal)?;
    let (pio, mmio) = (Arc::new(devices.pio), Arc::new(devices.mmio));
    let mut vcpus = Vec::with_capacity(snap.vcpus.len());
    for (state, fd) in snap.vcpus.iter().zip(vcpu_fds) {
        // The MSRs the snapshot holds are the ones KVM could read: save the same ones again
        // (no index-list query on the restore path).
        let msrs: Vec<u32> = state.msrs.iter().map(|(i, _)| *i).collect();
        let vcpu = new_vcpu(&vm, fd, state.index, &pio, &mmio, &evts, &msrs)?;
        state
            .restore(vcpu.fd())
            .map_err(|e| BuildError::Snapshot(e.into()))?;
        vcpus.push(vcpu.start_paused().map_err(BuildError::SpawnVcpu)?);
    }
    marks.mark("vcpus");
    // Host connections from before the snapshot are gone; tell the guest (it resets its
    // sockets), and let every device look at its queues once in case a notification was in
    // flight when the snapshot was taken.
    if let Some(vsock) = &devices.vsock {
        let mut dev = vsock.lock().unwrap_or_else(|e| e.into_inner());
        if !dev.send_transport_reset() {
            log::warn!("vsock: the guest driver had no event buffer for the transport reset");
        }
    }
    for (t, _) in &devices.virtio {
        let t = t.lock().unwrap_or_else(|e| e.into_inner());
        let dev = t.device().lock().unwrap_or_else(|e| e.into_inner());
        for evt in dev.queue_events() {
            let _ = evt.write(1);
        }
    }
    marks.mark("reset");
    log::info!("restore steps (us): {}", marks.report());
    let parts = VmParts {
        vm,
        vcpus,
        evts,
        blocks: devices.blocks,
        serial: devices.serial,
        virtio: devices.virtio,
        subscribers: devices.subscribers,
        machine: snap.machine,
        boot_timeout: None,
        started,
        restore_started: Some(restore_started),
    };
    assemble(parts)
}

fn attach_legacy_devices(
    vm: &Vm,
    devices: &mut DeviceSet,
    console: &ConsoleOutput,
    console_limit: u64,
    serial_state: Option<&SerialSnapshot>,
    evts: &VmEvents,
) -> Result<(), BuildError> {
    let out: Box<dyn Write + Send> = match console {
        ConsoleOutput::Stdout => Box::new(std::io::stdout()),
        ConsoleOutput::Discard => Box::new(std::io::sink()),
        ConsoleOutput::File(p) => {
            Box::new(File::create(p).map_err(|e| BuildError::Console(p.display().to_string(), e))?)
        }
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    vm.fd()
        .register_irqfd(&irq, SERIAL_IRQ)
        .map_err(BuildError::RegisterEvent)?;
    let sink = ConsoleSink::new(out, console_limit, evts.console.clone());
    let uart = match serial_state {
        None => Serial::new(EventFdTrigger(irq), sink),
        Some(state) => Serial::from_state(
            &state.into(),
            EventFdTrigger(irq),
            vm_superio::serial::NoEvents,
            sink,
        )
        .map_err(|e| BuildError::Restore(format!("serial state: {e:?}")))?,
    };
    let serial = Arc::new(Mutex::new(SerialDevice(uart)));
    devices
        .pio
        .insert(serial.clone(), u64::from(SERIAL_PORT_BASE), 8)?;
    devices.serial = Some(serial);
    let reset = evts.reset.try_clone().map_err(BuildError::EventFd)?;
    let i8042 = I8042(I8042Device::new(EventFdTrigger(reset)));
    devices
        .pio
        .insert(Arc::new(Mutex::new(i8042)), u64::from(I8042_PORT_BASE), 5)?;
    Ok(())
}

/// Puts `device` in the next virtio-mmio slot: irqfd on its GSI, an ioeventfd per queue on the
/// queue-notify register, the transport on the MMIO bus, and a command-line declaration.
fn attach_virtio_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    device: Arc<Mutex<dyn VirtioDevice>>,
    kind: DeviceKind,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let slot = devices.virtio_slots.len() as u64;
    if slot >= VIRTIO_MMIO_MAX_SLOTS {
        return Err(BuildError::TooManyDevices);
    }
    let (addr, gsi) = (virtio_mmio_addr(slot), virtio_irq(slot));
    let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    vm.fd()
        .register_irqfd(&irqfd, gsi)
        .map_err(BuildError::RegisterEvent)?;
    {
        let dev = device.lock().unwrap_or_else(|e| e.into_inner());
        let notify = addr + u64::from(virtio_bindings::virtio_mmio::VIRTIO_MMIO_QUEUE_NOTIFY);
        for (i, evt) in dev.queue_events().iter().enumerate() {
            // The queue index written to QueueNotify selects the eventfd.
            vm.fd()
                .register_ioevent(evt, &IoEventAddress::Mmio(notify), i as u32)
                .map_err(BuildError::RegisterEvent)?;
        }
    }
    let interrupt = Arc::new(VirtioInterrupt::new(irqfd));
    let transport = Arc::new(Mutex::new(MmioTransport::new(
        vm.memory().clone(),
        device,
        interrupt,
    )));
    devices
        .mmio
        .insert(transport.clone(), addr, VIRTIO_MMIO_SLOT_SIZE)?;
    devices.virtio_slots.push((addr, gsi));
    devices.virtio.push((transport.clone(), kind));
    Ok(transport)
}

/// Adds a virtio-blk device for `disk`.
fn attach_block_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    disk: &DiskConfig,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let block = Arc::new(Mutex::new(Block::new(
        &disk.path,
        disk.read_only,
        &disk.id,
    )?));
    let kind = DeviceKind::Block {
        path: disk.path.clone(),
        read_only: disk.read_only,
        id: disk.id.clone(),
    };
    let transport = attach_virtio_device(vm, devices, block.clone(), kind)?;
    let handler = BlockEventHandler::new(block.clone()).map_err(BuildError::EventFd)?;
    devices.subscribers.push(Arc::new(Mutex::new(handler)));
    devices.blocks.push(block);
    Ok(transport)
}

/// Adds the virtio-vsock device with its Unix-socket host side.
fn attach_vsock_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    config: &VsockConfig,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let vsock = Arc::new(Mutex::new(Vsock::new(config.guest_cid, &config.uds_path)?));
    let kind = DeviceKind::Vsock {
        guest_cid: config.guest_cid,
    };
    let transport = attach_virtio_device(vm, devices, vsock.clone(), kind)?;
    let handler = VsockEventHandler::new(vsock.clone()).map_err(BuildError::EventFd)?;
    devices.subscribers.push(Arc::new(Mutex::new(handler)));
    devices.vsock = Some(vsock);
    Ok(transport)
}

/// Loads the ELF `vmlinux` and returns its 64-bit entry point.
fn load_kernel(vm: &Vm, config: &VmConfig) -> Result<u64, BuildError> {
    let mut file = File::open(&config.kernel)
        .map_err(|e| BuildError::OpenKernel(config.kernel.display().to_string(), e))?;
    let loaded = Elf::load(
        vm.memory(),
        None,
        &mut file,
        Some(GuestAddress(HIMEM_START)),
    )
    .map_err(BuildError::LoadKernel)?;
    Ok(loaded.kernel_load.0)
}

/// Zero page, MP table, GDT/IDT and the boot page tables.
fn configure_system_for_boot(
    mem: &GuestMemoryMmap,
    cmdline_len: usize,
    vcpus: u8,
) -> Result<(), BuildError> {
    boot::write_zero_page(mem, cmdline_len)?;
    mptable::setup_mptable(mem, vcpus)?;
    boot::write_gdt_idt(mem)?;
    boot::write_page_tables(mem)?;
    Ok(())
}

fn configure_vcpu_for_boot(
    vm: &Vm,
    vcpu: &Vcpu,
    template: CpuTemplate,
    index: u8,
    count: u8,
    entry: u64,
) -> Result<(), BuildError> {
    let fd = vcpu.fd();
    regs::configure_cpuid(fd, vm.supported_cpuid()?, template, index, count)?;
    regs::configure_msrs(fd, vm.msr_index_list()?)?;
    regs::configure_regs(fd, entry)?;
    regs::configure_sregs(fd)?;
    regs::configure_fpu(fd)?;
    regs::configure_lapic(fd)?;
    Ok(())
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

    /// Writes a snapshot of the paused VM into `dir`: guest memory first, then the `state`
    /// file (renamed into place last, so a directory with a `state` file is complete).
    pub fn snapshot(&mut self, dir: &std::path::Path) -> Result<SnapshotReply, String> {
        if !self.paused {
            return Err("pause the VM before taking a snapshot".into());
        }
        let began = Instant::now();
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
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
        })
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
