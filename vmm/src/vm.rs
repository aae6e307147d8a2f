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

/// A KVM VM created before its memory, with its in-kernel devices and vCPU fds: everything of
/// a restore that does not depend on the snapshot, done by a pool process while it waits (see
/// `airlock-vmm pool`).
#[derive(Debug)]
pub struct PreparedVm {
    kvm: Kvm,
    fd: VmFd,
    vcpus: Vec<VcpuFd>,
}

impl PreparedVm {
    /// Opens KVM, checks its capabilities, creates the VM, its irqchip and PIT, and `vcpus`
    /// vCPU fds (APIC ids 0..vcpus).
    pub fn new(vcpus: u8) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        if let Some(cap) = REQUIRED_CAPS.iter().find(|c| !kvm.check_extension(**c)) {
            return Err(VmError::MissingCap(*cap));
        }
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        setup_irqchip(&fd)?;
        let vcpus = (0..vcpus)
            .map(|i| {
                fd.create_vcpu(u64::from(i))
                    .map_err(|e| VmError::CreateVcpu(i, e))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { kvm, fd, vcpus })
    }

    /// How many vCPU fds were created in advance.
    pub fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }
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
        vm.register_memory()?;
        setup_irqchip(&vm.fd)?;
        Ok(vm)
    }

    /// Gives a prepared VM its memory; returns the VM and the vCPU fds created in advance.
    pub fn from_prepared(
        prepared: PreparedVm,
        mem: GuestMemoryMmap,
    ) -> Result<(Self, Vec<VcpuFd>), VmError> {
        let vm = Self {
            kvm: prepared.kvm,
            fd: prepared.fd,
            mem,
            supported_cpuid: std::sync::OnceLock::new(),
            msr_index_list: std::sync::OnceLock::new(),
        };
        vm.register_memory()?;
        Ok((vm, prepared.vcpus))
    }

    fn register_memory(&self) -> Result<(), VmError> {
        for (slot, region) in self.mem.iter().enumerate() {
            let slot = slot as u32;
            let region_desc = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the host range is a live mapping owned by `self.mem`, which the `Vm` keeps
            // alive for as long as the VM fd exists; slots do not overlap (distinct regions).
            unsafe { self.fd.set_user_memory_region(region_desc) }
                .map_err(|e| VmError::SetMemoryRegion(slot, e))?;
        }
        Ok(())
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
