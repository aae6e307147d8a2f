//! What can go wrong building or running a VM on the host's side (guest faults are
//! [`crate::exit::VmExit`]s, not errors): shared by [`crate::builder`], which assembles a VM,
//! and [`crate::vmm`], which runs it.

use thiserror::Error;

use crate::arch::layout::VIRTIO_MMIO_MAX_SLOTS;
use crate::arch::{boot, mptable, regs};
use crate::config::ConfigError;
use crate::devices::bus::BusError;
use crate::devices::virtio::block::BlockError;
use crate::devices::virtio::net::NetError;
use crate::devices::virtio::vsock::VsockError;
use crate::snapshot::SnapshotError;
use crate::vm::VmError;

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
    #[error("attach the network device")]
    Net(#[from] NetError),
    #[error("duplicate the TAP descriptor")]
    DupTap(#[source] std::io::Error),
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
    #[error("disk: {0}")]
    Disk(String),
    #[error("seccomp")]
    Seccomp(#[from] crate::seccomp::SeccompError),
}
