//! Building a microVM: the boot recipe, the restore recipe and the device wiring both share.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvm_ioctls::IoEventAddress;
use linux_loader::loader::{Elf, KernelLoader, load_cmdline};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vm_superio::{I8042Device, Serial};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::cpuid::CpuTemplate;
use crate::arch::layout::{
    CMDLINE_ADDR, HIMEM_START, I8042_PORT_BASE, SERIAL_IRQ, SERIAL_PORT_BASE,
    VIRTIO_MMIO_MAX_SLOTS, VIRTIO_MMIO_SLOT_SIZE, virtio_irq, virtio_mmio_addr,
};
use crate::arch::{boot, mptable, regs};
pub use crate::build_error::BuildError;
use crate::config::{ConsoleOutput, DiskConfig, NetConfig, VmConfig, VsockConfig, build_cmdline};
use crate::devices::bus::Bus;
use crate::devices::legacy::{ConsoleSink, EventFdTrigger, I8042, SerialDevice};
use crate::devices::virtio::block::layered::{self, Layer, LayeredDisk};
use crate::devices::virtio::block::{Block, BlockEventHandler};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::{Net, NetEventHandler};
use crate::devices::virtio::vsock::{Vsock, VsockEventHandler};
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt};
use crate::snapshot::{
    DeviceKind, LAYER_FILE, LAYER_MAP_FILE, MEMORY_FILE, MachineSnapshot, SerialSnapshot, Snapshot,
    SnapshotError, memory,
};
use crate::vcpu::Vcpu;
use crate::vm::Vm;
use crate::vmm::{Subscriber, VmEvents, VmParts, Vmm, assemble};

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
        attach_block_device(&vm, &mut devices, disk, None)?;
    }
    for n in 0..config.slots {
        attach_slot_device(&vm, &mut devices, &slot_id(n), None)?;
    }
    if let Some(vsock) = &config.vsock {
        attach_vsock_device(&vm, &mut devices, vsock)?;
    }
    if let Some(net) = &config.net {
        attach_net_device(&vm, &mut devices, net)?;
    }

    let entry = load_kernel(&vm, config)?;
    let writable_root = config.disks.first().is_some_and(DiskConfig::writable);
    let cmdline = build_cmdline(
        template,
        writable_root,
        &devices.virtio_slots,
        &config.cmdline_extra,
    )?;
    load_cmdline(vm.memory(), GuestAddress(CMDLINE_ADDR), &cmdline)
        .map_err(BuildError::LoadCmdline)?;
    let cmdline_str = cmdline
        .as_cstring()
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    log::info!("kernel command line: {cmdline_str}");
    configure_system_for_boot(vm.memory(), cmdline_str.len(), config.vcpus)?;

    crate::kick::register_handler().map_err(BuildError::Signal)?;
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

/// Where a restored VM's console and vsock go, and which snapshot it comes from.
#[derive(Clone, Debug)]
pub struct RestoreConfig {
    pub snapshot_dir: std::path::PathBuf,
    /// The host side of the vsock device, required when the snapshot has one.
    pub vsock_uds: Option<std::path::PathBuf>,
    pub console: ConsoleOutput,
    pub console_limit: u64,
    pub cpu_template: Option<CpuTemplate>,
    /// The TAP of the network card, required when the snapshot has one.
    pub net_tap: Option<Arc<std::os::fd::OwnedFd>>,
    /// The overlay of the copy-on-write root disk, required when the snapshot has one (its
    /// layer is the snapshot's).
    pub root_overlay: Option<crate::config::OverlayConfig>,
    /// Media for the snapshot's disk slots, in slot order (`None`: the slot stays empty).
    pub slot_media: Vec<Option<crate::config::SlotMedia>>,
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
    check_cpu_template(config, &snap)?;
    let (vm, vcpu_fds) = open_restored_vm(config, &snap, prepared, &mut marks)?;
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
    restore_virtio_devices(&vm, &mut devices, config, &snap)?;
    marks.mark("devices");
    snap.vm
        .restore(vm.fd())
        .map_err(|e| BuildError::Snapshot(e.into()))?;
    marks.mark("vm-state");
    crate::kick::register_handler().map_err(BuildError::Signal)?;
    let (pio, mmio) = (Arc::new(devices.pio), Arc::new(devices.mmio));
    let vcpus = restore_vcpus(&vm, &snap, vcpu_fds, &pio, &mmio, &evts)?;
    marks.mark("vcpus");
    reset_after_restore(&devices.vsock, &devices.virtio);
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

/// Restore step: the snapshot's CPU template must be this host's.
fn check_cpu_template(config: &RestoreConfig, snap: &Snapshot) -> Result<(), BuildError> {
    let template = config.cpu_template.unwrap_or_else(CpuTemplate::detect);
    if snap.machine.cpu_template != template_name(template) {
        return Err(BuildError::Restore(format!(
            "the snapshot was taken with CPU template {:?}, this host uses {:?}",
            snap.machine.cpu_template,
            template_name(template)
        )));
    }
    Ok(())
}

/// Restore step: the KVM VM over the snapshot's memory and one vCPU fd per saved vCPU, from
/// the prepared VM when there is one, else mapped and created here (marks "map").
fn open_restored_vm(
    config: &RestoreConfig,
    snap: &Snapshot,
    prepared: Option<crate::vm::PreparedVm>,
    marks: &mut StepTimer,
) -> Result<(Vm, Vec<kvm_ioctls::VcpuFd>), BuildError> {
    let memory_file = config.snapshot_dir.join(MEMORY_FILE);
    Ok(match prepared {
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
    })
}

/// Restore step: every virtio device of the snapshot in its slot, with its transport state;
/// slots that got media are told their capacity changed.
fn restore_virtio_devices(
    vm: &Vm,
    devices: &mut DeviceSet,
    config: &RestoreConfig,
    snap: &Snapshot,
) -> Result<(), BuildError> {
    if config.slot_media.len() > snap.virtio.len() {
        return Err(BuildError::Restore(
            "more slot media than the snapshot has slots".into(),
        ));
    }
    let (mut slots, mut changed) = (0usize, Vec::new());
    for v in &snap.virtio {
        let transport =
            attach_saved_device(vm, devices, config, &v.kind, &mut slots, &mut changed)?;
        transport
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restore(&v.transport)
            .map_err(|e| BuildError::Restore(format!("{:?}: {e}", v.kind)))?;
    }
    if slots < config.slot_media.iter().filter(|m| m.is_some()).count() {
        return Err(BuildError::Restore(format!(
            "media for {} disk slots, the snapshot has {slots}",
            config.slot_media.len()
        )));
    }
    // Slots that got media have a new capacity: the driver reads it after the interrupt.
    for t in changed {
        t.lock().unwrap_or_else(|e| e.into_inner()).config_changed();
    }
    Ok(())
}

/// Restore step: attaches the device a snapshot entry of `kind` describes, with what `config`
/// gives it (overlay, socket, TAP, the next slot's media: `slots` counts the slots so far, and
/// a slot that gets media goes on `changed`).
fn attach_saved_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    config: &RestoreConfig,
    kind: &DeviceKind,
    slots: &mut usize,
    changed: &mut Vec<Arc<Mutex<MmioTransport>>>,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    Ok(match kind {
        DeviceKind::Block {
            path,
            read_only,
            id,
        } => attach_block_device(
            vm,
            devices,
            &DiskConfig {
                path: path.clone(),
                read_only: *read_only,
                id: id.clone(),
                overlay: None,
            },
            None,
        )?,
        DeviceKind::Slot { id } => {
            let media = config.slot_media.get(*slots).cloned().flatten();
            *slots += 1;
            let with_media = media.is_some();
            let t = attach_slot_device(vm, devices, id, media)?;
            if with_media {
                changed.push(t.clone());
            }
            t
        }
        DeviceKind::LayeredBlock { base, id } => {
            let overlay = config.root_overlay.clone().ok_or_else(|| {
                BuildError::Restore(
                    "the snapshot has a copy-on-write disk: give its overlay".into(),
                )
            })?;
            let disk = DiskConfig {
                path: base.clone(),
                read_only: true,
                id: id.clone(),
                overlay: Some(overlay),
            };
            attach_block_device(vm, devices, &disk, Some(&config.snapshot_dir))?
        }
        DeviceKind::Vsock { guest_cid } => {
            let uds_path = config.vsock_uds.clone().ok_or_else(|| {
                BuildError::Restore("the snapshot has a vsock device: give its socket".into())
            })?;
            let cfg = VsockConfig {
                guest_cid: *guest_cid,
                uds_path,
            };
            attach_vsock_device(vm, devices, &cfg)?
        }
        DeviceKind::Net { mac } => {
            let tap = config.net_tap.clone().ok_or_else(|| {
                BuildError::Restore("the snapshot has a network card: give its TAP".into())
            })?;
            attach_net_device(vm, devices, &NetConfig { tap, mac: *mac })?
        }
    })
}

/// Restore step: a vCPU per saved state on its prepared fd, its KVM state restored, started
/// paused.
fn restore_vcpus(
    vm: &Vm,
    snap: &Snapshot,
    vcpu_fds: Vec<kvm_ioctls::VcpuFd>,
    pio: &Arc<Bus>,
    mmio: &Arc<Bus>,
    evts: &VmEvents,
) -> Result<Vec<crate::vcpu::VcpuHandle>, BuildError> {
    let mut vcpus = Vec::with_capacity(snap.vcpus.len());
    for (state, fd) in snap.vcpus.iter().zip(vcpu_fds) {
        // The MSRs the snapshot holds are the ones KVM could read: save the same ones again
        // (no index-list query on the restore path).
        let msrs: Vec<u32> = state.msrs.iter().map(|(i, _)| *i).collect();
        let vcpu = new_vcpu(vm, fd, state.index, pio, mmio, evts, &msrs)?;
        state
            .restore(vcpu.fd())
            .map_err(|e| BuildError::Snapshot(e.into()))?;
        vcpus.push(vcpu.start_paused().map_err(BuildError::SpawnVcpu)?);
    }
    Ok(vcpus)
}

/// Restore step: host connections from before the snapshot are gone; tell the guest (it
/// resets its sockets), and let every device look at its queues once in case a notification
/// was in flight when the snapshot was taken.
fn reset_after_restore(
    vsock: &Option<Arc<Mutex<Vsock>>>,
    virtio: &[(Arc<Mutex<MmioTransport>>, DeviceKind)],
) {
    if let Some(vsock) = vsock {
        let mut dev = vsock.lock().unwrap_or_else(|e| e.into_inner());
        if !dev.send_transport_reset() {
            log::warn!("vsock: the guest driver had no event buffer for the transport reset");
        }
    }
    for (t, _) in virtio {
        let t = t.lock().unwrap_or_else(|e| e.into_inner());
        let dev = t.device().lock().unwrap_or_else(|e| e.into_inner());
        for evt in dev.queue_events() {
            let _ = evt.write(1);
        }
    }
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
/// Adds a disk; a copy-on-write one restored from a snapshot takes the layer in
/// `layer_dir` (the snapshot's directory) under its overlay.
fn attach_block_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    disk: &DiskConfig,
    layer_dir: Option<&std::path::Path>,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let (block, kind) = match &disk.overlay {
        None => (
            Block::new(&disk.path, disk.read_only, &disk.id)?,
            DeviceKind::Block {
                path: disk.path.clone(),
                read_only: disk.read_only,
                id: disk.id.clone(),
            },
        ),
        Some(overlay) => (
            Block::layered(open_layered(disk, overlay, layer_dir)?, &disk.id)?,
            DeviceKind::LayeredBlock {
                base: disk.path.clone(),
                id: disk.id.clone(),
            },
        ),
    };
    attach_block(vm, devices, block, kind)
}

/// A block device in the next virtio slot, served on the event loop.
fn attach_block(
    vm: &Vm,
    devices: &mut DeviceSet,
    block: Block,
    kind: DeviceKind,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let block = Arc::new(Mutex::new(block));
    let transport = attach_virtio_device(vm, devices, block.clone(), kind)?;
    let handler = BlockEventHandler::new(block.clone()).map_err(BuildError::EventFd)?;
    devices.subscribers.push(Arc::new(Mutex::new(handler)));
    devices.blocks.push(block);
    Ok(transport)
}

/// The serial of disk slot `n` (`/sys/block/vdX/serial` in the guest: the agent finds a
/// volume's device by it).
pub fn slot_id(n: u8) -> String {
    format!("airlock-slot-{n}")
}

/// Adds an empty disk slot, with `media` put in (a restore's).
fn attach_slot_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    id: &str,
    media: Option<crate::config::SlotMedia>,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let mut block = Block::slot(id)?;
    if let Some(m) = media {
        let file = m
            .file
            .try_clone()
            .map_err(|e| BuildError::Disk(format!("slot {id}: {e}")))?;
        block.insert_media(file, m.read_only)?;
    }
    attach_block(vm, devices, block, DeviceKind::Slot { id: id.to_owned() })
}

/// A copy-on-write chain: the image read-only, the layer in `layer_dir` (if any), the overlay.
fn open_layered(
    disk: &DiskConfig,
    overlay: &crate::config::OverlayConfig,
    layer_dir: Option<&std::path::Path>,
) -> Result<LayeredDisk, BuildError> {
    let open = |path: &std::path::Path, write: bool| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|e| BuildError::Disk(format!("{}: {e}", path.display())))
    };
    let base = open(&disk.path, false)?;
    let blocks = base
        .metadata()
        .map_err(|e| BuildError::Disk(format!("{}: {e}", disk.path.display())))?
        .len()
        / layered::BLOCK_SIZE;
    let layer = match layer_dir {
        Some(dir) => {
            let data = open(&dir.join(LAYER_FILE), false)?;
            let map = open(&dir.join(LAYER_MAP_FILE), false)?;
            Some(
                Layer::open(data, &map, blocks)
                    .map_err(|e| BuildError::Disk(format!("{}: {e}", dir.display())))?,
            )
        }
        None => None,
    };
    let top = open(&overlay.path, true)?;
    LayeredDisk::new(base, layer, top, overlay.quota_bytes)
        .map_err(|e| BuildError::Disk(format!("{}: {e}", disk.path.display())))
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

/// Adds the virtio-net device on (a duplicate of) the configured TAP.
fn attach_net_device(
    vm: &Vm,
    devices: &mut DeviceSet,
    config: &NetConfig,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let tap = config.tap.try_clone().map_err(BuildError::DupTap)?;
    let net = Arc::new(Mutex::new(Net::new(tap, config.mac)?));
    let kind = DeviceKind::Net { mac: config.mac };
    let transport = attach_virtio_device(vm, devices, net.clone(), kind)?;
    let handler = NetEventHandler::new(net).map_err(BuildError::EventFd)?;
    devices.subscribers.push(Arc::new(Mutex::new(handler)));
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
