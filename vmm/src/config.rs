//! User input for one microVM, validated once, and the guest kernel command line built from it.

use std::path::PathBuf;
use std::time::Duration;

use linux_loader::cmdline::Cmdline;
use thiserror::Error;
use vm_memory::GuestAddress;

use crate::arch::cpuid::CpuTemplate;
use crate::arch::layout::{CMDLINE_MAX_LEN, MIN_MEM_BYTES, VIRTIO_MMIO_SLOT_SIZE};
use crate::arch::mptable::MAX_CPUS;

/// Errors in a [`VmConfig`].
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("vcpus must be between 1 and {MAX_CPUS}, got {0}")]
    VcpuCount(u32),
    #[error("memory must be between {min} MiB and 1 TiB, got {0} MiB", min = MIN_MEM_BYTES >> 20)]
    MemorySize(u64),
    #[error("the kernel command line does not fit in {CMDLINE_MAX_LEN} bytes or is invalid: {0}")]
    Cmdline(String),
    #[error("at most {MAX_SLOTS} disk slots, got {0}")]
    Slots(u8),
}

/// Where the guest console goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConsoleOutput {
    Stdout,
    File(PathBuf),
    Discard,
}

/// One disk image attached as a virtio-blk device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
    /// Reported to the guest as the disk's serial (`/sys/block/vdX/serial`).
    pub id: String,
    /// Copy-on-write: the image at `path` stays read-only and the guest's writes go into this
    /// overlay (the disk is writable, whatever `read_only` says).
    pub overlay: Option<OverlayConfig>,
}

/// The most disk slots a VM may have.
pub const MAX_SLOTS: u8 = 8;

/// Media for a disk slot at a restore: a volume's file, opened by whoever hands it over.
#[derive(Clone, Debug)]
pub struct SlotMedia {
    pub file: std::sync::Arc<std::fs::File>,
    pub read_only: bool,
}

/// The writable top of a copy-on-write disk (see `devices::virtio::block::layered`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverlayConfig {
    /// An empty file the caller made (the VMM creates no files); written blocks are appended.
    pub path: PathBuf,
    /// The most bytes it may hold; a write needing more fails.
    pub quota_bytes: u64,
}

impl DiskConfig {
    /// Whether the guest may write to it.
    pub fn writable(&self) -> bool {
        self.overlay.is_some() || !self.read_only
    }
}

/// A virtio-vsock device whose host side is a Unix socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's context id (3 or more).
    pub guest_cid: u64,
    /// Host connections arrive here (`CONNECT <port>\n`); guest connections to host port P go
    /// to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

/// A virtio-net device on a TAP descriptor the process was given (it never opens
/// `/dev/net/tun` itself).
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// The TAP (`IFF_TAP | IFF_NO_PI`); the device works on a duplicate.
    pub tap: std::sync::Arc<std::os::fd::OwnedFd>,
    pub mac: [u8; 6],
}

/// The MAC address guests get unless told otherwise: locally administered, unicast. Every
/// sandbox has a network of its own, so they may all have the same one.
pub const DEFAULT_MAC: [u8; 6] = [0x02, 0xa1, 0x0c, 0x00, 0x00, 0x02];

/// Everything needed to boot one VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub kernel: PathBuf,
    /// The first disk is the root filesystem (`/dev/vda`).
    pub disks: Vec<DiskConfig>,
    /// The vsock device, if any (the guest agent is reached through it).
    pub vsock: Option<VsockConfig>,
    /// The network card, if any.
    pub net: Option<NetConfig>,
    /// Empty disk slots after the disks, for media put in at a restore (volumes).
    pub slots: u8,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Appended to the default command line.
    pub cmdline_extra: String,
    pub console: ConsoleOutput,
    /// Console bytes kept; the rest are counted and dropped (a guest can print forever).
    pub console_limit: u64,
    /// End the VM if the guest has not printed `airlock: userspace up` by then.
    pub boot_timeout: Option<Duration>,
    /// `None` picks the template for the KVM module that is loaded.
    pub cpu_template: Option<CpuTemplate>,
}

impl VmConfig {
    /// A configuration with defaults: 1 vCPU, 256 MiB, console on stdout, 300 s boot deadline.
    pub fn new(kernel: PathBuf, rootfs: PathBuf) -> Self {
        Self {
            kernel,
            disks: vec![DiskConfig {
                path: rootfs,
                read_only: true,
                id: "airlock-root".into(),
                overlay: None,
            }],
            vsock: None,
            net: None,
            slots: 0,
            vcpus: 1,
            mem_mib: 256,
            cmdline_extra: String::new(),
            console: ConsoleOutput::Stdout,
            console_limit: 64 << 20,
            boot_timeout: Some(Duration::from_secs(300)),
            cpu_template: None,
        }
    }

    /// Checks limits that do not need the filesystem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.vcpus == 0 || self.vcpus > MAX_CPUS {
            return Err(ConfigError::VcpuCount(u32::from(self.vcpus)));
        }
        let bytes = self.mem_mib.checked_mul(1 << 20);
        if bytes.is_none_or(|b| b < MIN_MEM_BYTES) || self.mem_mib > (1 << 20) {
            return Err(ConfigError::MemorySize(self.mem_mib));
        }
        if self.slots > MAX_SLOTS {
            return Err(ConfigError::Slots(self.slots));
        }
        Ok(())
    }

    /// Guest memory in bytes.
    pub fn mem_bytes(&self) -> u64 {
        self.mem_mib << 20
    }
}

/// The command line every Airlock guest gets, before device declarations:
/// - `console=ttyS0`: the serial console is the only one.
/// - `reboot=k panic=-1`: power-off and panic both end in an i8042 reset, which ends the VM.
/// - `quiet`: each console byte is a VM exit; only warnings and worse are printed.
/// - `tsc=reliable no_timer_check clocksource=kvm-clock`: no timer calibration or watchdog (the
///   nested host emulates guest kernel code and miscalibrates); kvm-clock survives snapshots.
/// - `io_delay=none`: no port-0x80 writes (a VM exit each) as I/O delays.
/// - `root=/dev/vda ro rootfstype=ext4`: the base image, read-only (a writable root, a
///   copy-on-write disk over it, adds [`WRITABLE_ROOT_CMDLINE`]).
/// - `GLIBC_TUNABLES=glibc.pthread.stack_cache_size=0`: an environment variable of init (the
///   kernel passes unknown `name=value` words to it), read by the agent's static glibc: no
///   cache of exited threads' stacks. With the cache, clones of a snapshot crashed now and
///   then (about one in twenty under the daemon's tests): `pthread_create` in the agent's
///   main thread, reusing a stack cached before the snapshot, freed a garbage pointer from
///   that stack's TLS vector (free(0x6); the agent's fault report gave the call chain), and
///   PID 1 died. Without the cache a thread's stack is unmapped when it exits and a new one
///   mapped for each thread. The agent builds every execution's environment itself, so the
///   variable reaches no user process.
pub const BASE_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet tsc=reliable \
    no_timer_check clocksource=kvm-clock io_delay=none root=/dev/vda ro rootfstype=ext4 \
    GLIBC_TUNABLES=glibc.pthread.stack_cache_size=0";

/// Added when the root disk is writable (copy-on-write over the base image): mounted
/// read-write (`rw` after `ro` wins), and no background zeroing of inode tables (the image's
/// are zeroed already; zeroing them again would write gigabytes into the overlay).
pub const WRITABLE_ROOT_CMDLINE: &str = "rw rootflags=noinit_itable";

/// Guest arguments on the nested paravirtual KVM (`kvm_pvm`, the build machines).
///
/// That hypervisor replaces CPUID leaves 1, 7 and 0xd with the host's values whatever the VMM
/// sets (measured: `KVM_SET_CPUID2` then `KVM_GET_CPUID2` and the guest's own `cpuid` both show
/// the host's bits), so the CPU template cannot hide features there. The guest kernel is told
/// instead, and its emulated kernel code then avoids instructions the emulator stops at:
/// - `airlock_nested`: enables our guest-kernel patches (see `kernel-config/`);
/// - `noxsave`: no XSAVE family (`xrstor` in FPU init);
/// - `clearcpuid=`: CX16 (141, SLUB's `cmpxchg16b`), POPCNT (151), RDRAND (158), FSGSBASE
///   (288), SMEP (295), RDSEED (306), SMAP (308, `clac`/`stac` on every kernel entry).
pub const NESTED_CMDLINE: &str = "airlock_nested noxsave clearcpuid=141,151,158,288,295,306,308";

/// Builds the guest command line: the base (with [`WRITABLE_ROOT_CMDLINE`] for a writable
/// root), the nested-KVM flag where needed, one `virtio_mmio.device=` per device slot
/// `(address, irq)`, then the user's extra arguments.
pub fn build_cmdline(
    template: CpuTemplate,
    writable_root: bool,
    virtio_devices: &[(u64, u32)],
    extra: &str,
) -> Result<Cmdline, ConfigError> {
    let err = |e: linux_loader::cmdline::Error| ConfigError::Cmdline(e.to_string());
    let mut cmdline = Cmdline::new(CMDLINE_MAX_LEN).map_err(err)?;
    cmdline.insert_str(BASE_CMDLINE).map_err(err)?;
    if writable_root {
        cmdline.insert_str(WRITABLE_ROOT_CMDLINE).map_err(err)?;
    }
    if template == CpuTemplate::NestedPvm {
        cmdline.insert_str(NESTED_CMDLINE).map_err(err)?;
    }
    for &(addr, irq) in virtio_devices {
        cmdline
            .add_virtio_mmio_device(VIRTIO_MMIO_SLOT_SIZE, GuestAddress(addr), irq, None)
            .map_err(err)?;
    }
    if !extra.trim().is_empty() {
        cmdline.insert_str(extra).map_err(err)?;
    }
    Ok(cmdline)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VmConfig {
        VmConfig::new("k".into(), "r".into())
    }

    fn as_string(c: &Cmdline) -> String {
        c.as_cstring().unwrap().into_string().unwrap()
    }

    #[test]
    fn default_config_is_valid() {
        assert_eq!(cfg().validate(), Ok(()));
    }

    #[test]
    fn rejects_bad_vcpu_counts() {
        let mut c = cfg();
        c.vcpus = 0;
        assert_eq!(c.validate(), Err(ConfigError::VcpuCount(0)));
        c.vcpus = MAX_CPUS + 1;
        assert!(c.validate().is_err());
    }

    #[test]
    fn rejects_tiny_and_absurd_memory() {
        let mut c = cfg();
        c.mem_mib = 16;
        assert_eq!(c.validate(), Err(ConfigError::MemorySize(16)));
        c.mem_mib = u64::MAX;
        assert!(c.validate().is_err());
    }

    #[test]
    fn cmdline_declares_devices_in_order_and_appends_extra() {
        let c = build_cmdline(
            CpuTemplate::Host,
            false,
            &[(0xd000_0000, 5), (0xd000_1000, 6)],
            "foo=1",
        )
        .unwrap();
        let s = as_string(&c);
        assert!(s.starts_with(BASE_CMDLINE));
        assert!(!s.contains(WRITABLE_ROOT_CMDLINE));
        let a = s.find("virtio_mmio.device=4K@0xd0000000:5").unwrap();
        let b = s.find("virtio_mmio.device=4K@0xd0001000:6").unwrap();
        assert!(a < b);
        assert!(s.ends_with(" foo=1"));
        assert!(!s.contains(NESTED_CMDLINE));
    }

    #[test]
    fn a_writable_root_is_mounted_read_write_after_the_base_says_ro() {
        let s = as_string(&build_cmdline(CpuTemplate::Host, true, &[], "").unwrap());
        let ro = s.find(" ro ").unwrap();
        let rw = s.find(" rw rootflags=noinit_itable").unwrap();
        assert!(ro < rw, "{s}");
    }

    #[test]
    fn nested_template_adds_the_workaround_flag() {
        let s = as_string(&build_cmdline(CpuTemplate::NestedPvm, false, &[], "").unwrap());
        assert!(s.contains(" airlock_nested noxsave clearcpuid="));
    }

    #[test]
    fn oversized_cmdline_is_an_error() {
        let extra = "x".repeat(CMDLINE_MAX_LEN);
        assert!(matches!(
            build_cmdline(CpuTemplate::Host, false, &[], &extra),
            Err(ConfigError::Cmdline(_))
        ));
    }
}
