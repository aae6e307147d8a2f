//! The KVM side of one VM: the `/dev/kvm` handle, the VM fd with its memory slots, the in-kernel
//! irqchip and PIT, and what KVM reports it supports (CPUID, MSRs).

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config,
    kvm_userspace_memory_region,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use thiserror::Error;
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::arch::layout::{KVM_IDENTITY_MAP_ADDR, KVM_TSS_ADDR, ram_ranges};
use crate::snapshot::memory::{self, MemoryError, RegionLayout, Reservation};

/// Errors setting up the KVM VM.
#[derive(Debug, Error)]
pub enum VmError {
    #[error("open /dev/kvm (is KVM available and accessible?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("KVM lacks a required capability: {0:?}")]
    MissingCap(Cap),
    #[error("create the KVM VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    #[error("allocate {0} MiB of guest memory")]
    GuestMemory(u64, #[source] vm_memory::mmap::FromRangesError),
    #[error("register guest memory slot {0} with KVM")]
    SetMemoryRegion(u32, #[source] kvm_ioctls::Error),
    #[error("set the TSS address")]
    SetTss(#[source] kvm_ioctls::Error),
    #[error("set the identity map address")]
    SetIdentityMap(#[source] kvm_ioctls::Error),
    #[error("create the in-kernel irqchip")]
    CreateIrqchip(#[source] kvm_ioctls::Error),
    #[error("create the in-kernel PIT")]
    CreatePit(#[source] kvm_ioctls::Error),
    #[error("read the supported CPUID")]
    SupportedCpuid(#[source] kvm_ioctls::Error),
    #[error("read the MSR index list")]
    MsrIndexList(#[source] kvm_ioctls::Error),
    #[error("create vCPU {0}")]
    CreateVcpu(u8, #[source] kvm_ioctls::Error),
    #[error("guest memory from the snapshot")]
    SnapshotMemory(#[source] MemoryError),
}

/// Capabilities the VMM relies on.
const REQUIRED_CAPS: &[Cap] = &[
    Cap::Irqchip,
    Cap::Pit2,
    Cap::Ioeventfd,
    Cap::Irqfd,
    Cap::ImmediateExit,
    Cap::UserMemory,
    Cap::SetTssAddr,
    Cap::ExtCpuid,
];

/// The in-kernel devices every VM has: TSS and identity-map addresses (before any vCPU), the
/// irqchip (PICs, IOAPIC, LAPICs) and the PIT.
fn setup_irqchip(fd: &VmFd) -> Result<(), VmError> {
    fd.set_tss_address(KVM_TSS_ADDR as usize)
        .map_err(VmError::SetTss)?;
    fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDR)
        .map_err(VmError::SetIdentityMap)?;
    fd.create_irq_chip().map_err(VmError::CreateIrqchip)?;
    // The dummy speaker port keeps port 0x61 in the kernel instead of exiting to us.
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    fd.create_pit2(pit).map_err(VmError::CreatePit)
}

/// What a prepared VM does about guest memory before the restore request names a snapshot.
#[derive(Clone, Copy, Debug)]
pub enum MemoryPlan<'a> {
    /// Nothing: memory is mapped and registered during the restore.
    Later,
    /// Reserve and register host address space for this many bytes of guest memory, laid out
    /// as a booted VM's would be; the snapshot's memory file is mapped over it in place.
    Reserve(u64),
    /// Map this snapshot memory file (privately, as a restore would) and register it now: a
    /// pool for one template restores that template.
    Snapshot {
        memory_file: &'a std::path::Path,
        layout: &'a [RegionLayout],
    },
}

/// Guest memory prepared in advance, registered with KVM as slots 0..n.
#[derive(Debug)]
enum PreparedMemory {
    None,
    Reserved(Reservation),
    Mapped {
        memory_file: std::path::PathBuf,
        layout: Vec<RegionLayout>,
        mem: GuestMemoryMmap,
    },
}

/// A KVM VM created before its memory, with its in-kernel devices and vCPU fds: everything of
/// a restore that does not depend on the snapshot, done by a pool process while it waits (see
/// `airlock-vmm pool`). Guest memory can be prepared as well ([`MemoryPlan`]), which takes the
/// memory-size dependent slot registration out of the restore.
#[derive(Debug)]
pub struct PreparedVm {
    kvm: Kvm,
    fd: VmFd,
    vcpus: Vec<VcpuFd>,
    // After `fd`: the slots are gone before their memory is unmapped.
    memory: PreparedMemory,
}

impl PreparedVm {
    /// Opens KVM, checks its capabilities, creates the VM, prepares guest memory as `plan` says,
    /// and creates the irqchip, PIT and `vcpus` vCPU fds (APIC ids 0..vcpus).
    pub fn new(vcpus: u8, plan: MemoryPlan<'_>) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        if let Some(cap) = REQUIRED_CAPS.iter().find(|c| !kvm.check_extension(**c)) {
            return Err(VmError::MissingCap(*cap));
        }
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        // Memory before the irqchip, as in `Vm::with_memory`.
        let memory = match plan {
            MemoryPlan::Later => PreparedMemory::None,
            MemoryPlan::Reserve(bytes) => {
                let r = Reservation::new(&ram_ranges(bytes)).map_err(VmError::SnapshotMemory)?;
                for (slot, range) in r.ranges().iter().enumerate() {
                    // SAFETY: the reservation is a live mapping kept by this `PreparedVm` until
                    // it is mapped over in place (and then never unmapped), or the slot is
                    // deleted (`into_vm`), or the VM fd is closed (it drops first).
                    unsafe {
                        set_slot(
                            &fd,
                            slot as u32,
                            range.guest_addr,
                            range.host_addr,
                            range.len,
                        )
                    }?;
                }
                PreparedMemory::Reserved(r)
            }
            MemoryPlan::Snapshot {
                memory_file,
                layout,
            } => {
                let mem =
                    memory::map_private(memory_file, layout).map_err(VmError::SnapshotMemory)?;
                register_all(&fd, &mem)?;
                PreparedMemory::Mapped {
                    memory_file: memory_file.to_path_buf(),
                    layout: layout.to_vec(),
                    mem,
                }
            }
        };
        setup_irqchip(&fd)?;
        let vcpus = (0..vcpus)
            .map(|i| {
                fd.create_vcpu(u64::from(i))
                    .map_err(|e| VmError::CreateVcpu(i, e))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            kvm,
            fd,
            vcpus,
            memory,
        })
    }

    /// How many vCPU fds were created in advance.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }

    /// Gives the prepared VM the snapshot memory file `memory_file` laid out by `layout`, mapped
    /// `MAP_PRIVATE`: the mapping made in advance if it is this file, in place over the reserved
    /// ranges if they match, else freshly (slots prepared in advance are deleted first). Returns
    /// the VM and the vCPU fds made in advance.
    pub fn into_vm(
        mut self,
        memory_file: &std::path::Path,
        layout: &[RegionLayout],
    ) -> Result<(Vm, Vec<VcpuFd>), VmError> {
        let prepared = std::mem::replace(&mut self.memory, PreparedMemory::None);
        let mem = match prepared {
            PreparedMemory::Mapped {
                memory_file: f,
                layout: l,
                mem,
            } if f == memory_file && l == layout => Some(mem),
            PreparedMemory::Reserved(r) if r.matches(layout) => Some(
                r.map_file(memory_file, layout)
                    .map_err(VmError::SnapshotMemory)?,
            ),
            PreparedMemory::None => None,
            other => {
                log::warn!(
                    "the snapshot's memory differs from the memory prepared in advance; \
                     mapping and registering it during the restore"
                );
                let slots = match &other {
                    PreparedMemory::Reserved(r) => r.ranges().len(),
                    PreparedMemory::Mapped { layout, .. } => layout.len(),
                    PreparedMemory::None => 0,
                };
                for slot in 0..slots {
                    // SAFETY: a zero size deletes the slot; nothing is mapped by it.
                    unsafe { set_slot(&self.fd, slot as u32, 0, 0, 0) }?;
                }
                drop(other);
                None
            }
        };
        let (mem, registered) = match mem {
            Some(mem) => (mem, true),
            None => (
                memory::map_private(memory_file, layout).map_err(VmError::SnapshotMemory)?,
                false,
            ),
        };
        let vm = Vm {
            kvm: self.kvm,
            fd: self.fd,
            mem,
            supported_cpuid: std::sync::OnceLock::new(),
            msr_index_list: std::sync::OnceLock::new(),
        };
        if !registered {
            register_all(&vm.fd, &vm.mem)?;
        }
        Ok((vm, self.vcpus))
    }
}

/// Registers every region of `mem` as KVM slots 0..n.
fn register_all(fd: &VmFd, mem: &GuestMemoryMmap) -> Result<(), VmError> {
    for (slot, region) in mem.iter().enumerate() {
        // SAFETY: the host range is a live mapping owned by `mem`, which the owner of `fd`
        // keeps alive for as long as the VM fd exists; slots do not overlap (distinct regions).
        unsafe {
            set_slot(
                fd,
                slot as u32,
                region.start_addr().raw_value(),
                region.as_ptr() as usize,
                region.len() as usize,
            )
        }?;
    }
    Ok(())
}

/// Sets KVM memory slot `slot` to guest-physical `guest_addr..+len` backed by host `host_addr`
/// (a zero `len` deletes the slot).
///
/// # Safety
/// `host_addr..+len` must stay mapped for as long as the slot exists with that size.
unsafe fn set_slot(
    fd: &VmFd,
    slot: u32,
    guest_addr: u64,
    host_addr: usize,
    len: usize,
) -> Result<(), VmError> {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: guest_addr,
        memory_size: len as u64,
        userspace_addr: host_addr as u64,
    };
    // SAFETY: the caller keeps the host range mapped while the slot exists.
    unsafe { fd.set_user_memory_region(region) }.map_err(|e| VmError::SetMemoryRegion(slot, e))
}

/// A KVM VM with its guest memory.
#[derive(Debug)]
pub struct Vm {
    kvm: Kvm,
    fd: VmFd,
    mem: GuestMemoryMmap,
    /// Queried on first use: a restore takes CPUID from the snapshot and never needs it.
    supported_cpuid: std::sync::OnceLock<CpuId>,
    /// Queried on first use (boot, or the first snapshot).
    msr_index_list: std::sync::OnceLock<Vec<u32>>,
}

impl Vm {
    /// Opens KVM, checks its capabilities and creates a VM with `mem_bytes` of anonymous memory.
    pub fn new(mem_bytes: u64) -> Result<Self, VmError> {
        let mem = GuestMemoryMmap::from_ranges(&ram_ranges(mem_bytes))
            .map_err(|e| VmError::GuestMemory(mem_bytes >> 20, e))?;
        Self::with_memory(mem)
    }

    /// Opens KVM, checks its capabilities and creates a VM over `mem` (for example guest
    /// memory mapped from a snapshot).
    pub fn with_memory(mem: GuestMemoryMmap) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        if let Some(cap) = REQUIRED_CAPS.iter().find(|c| !kvm.check_extension(**c)) {
            return Err(VmError::MissingCap(*cap));
        }
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        let vm = Self {
            kvm,
            fd,
            mem,
            supported_cpuid: std::sync::OnceLock::new(),
            msr_index_list: std::sync::OnceLock::new(),
        };
        // Memory before the irqchip: registering a slot right after the irqchip was created
        // took 5-9 ms instead of 0.3 ms on the nested hosts (KVM waits for grace periods).
        register_all(&vm.fd, &vm.mem)?;
        setup_irqchip(&vm.fd)?;
        Ok(vm)
    }

    /// Creates vCPU `index` (its APIC id).
    pub fn create_vcpu(&self, index: u8) -> Result<VcpuFd, VmError> {
        self.fd
            .create_vcpu(u64::from(index))
            .map_err(|e| VmError::CreateVcpu(index, e))
    }

    /// The VM fd, for irqfd/ioeventfd registration.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// CPUID entries KVM supports on this host.
    pub fn supported_cpuid(&self) -> Result<&CpuId, VmError> {
        if let Some(c) = self.supported_cpuid.get() {
            return Ok(c);
        }
        let c = self
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(VmError::SupportedCpuid)?;
        Ok(self.supported_cpuid.get_or_init(|| c))
    }

    /// MSRs KVM can save and restore on this host.
    pub fn msr_index_list(&self) -> Result<&[u32], VmError> {
        if let Some(l) = self.msr_index_list.get() {
            return Ok(l);
        }
        let l = self
            .kvm
            .get_msr_index_list()
            .map_err(VmError::MsrIndexList)?
            .as_slice()
            .to_vec();
        Ok(self.msr_index_list.get_or_init(|| l))
    }

    /// The `/dev/kvm` handle.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }
}
