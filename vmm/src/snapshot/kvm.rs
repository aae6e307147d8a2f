//! What KVM holds of a VM and its vCPUs, read out and written back.
//!
//! The order of the `KVM_SET_*` calls on restore matters and follows what KVM documents and what
//! mature VMMs do: CPUID first (it decides which MSRs and XSAVE components exist), then MSRs,
//! special and general registers, FPU/XSAVE and XCRs, LAPIC, pending events, MP state and debug
//! registers. A vCPU is saved only while parked outside `KVM_RUN`, after a `KVM_RUN` with
//! `immediate_exit` set has completed any PIO/MMIO instruction in flight (see `vcpu.rs`).

use kvm_bindings::{
    CpuId, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data,
    kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// `IA32_TSC_DEADLINE`: the LAPIC timer's deadline in TSC-deadline mode.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// The most MSRs a vCPU snapshot may hold (KVM's index lists have a few hundred at most).
pub const MAX_MSRS: usize = 1024;
/// The most CPUID entries a vCPU snapshot may hold (`KVM_MAX_CPUID_ENTRIES`).
pub const MAX_CPUID_ENTRIES: usize = kvm_bindings::KVM_MAX_CPUID_ENTRIES;

/// A KVM call that failed while saving or restoring state.
#[derive(Debug, Error)]
#[error("{op}")]
pub struct KvmStateError {
    pub op: &'static str,
    #[source]
    pub source: Option<kvm_ioctls::Error>,
}

fn err(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> KvmStateError {
    move |e| KvmStateError {
        op,
        source: Some(e),
    }
}

fn fail(op: &'static str) -> KvmStateError {
    KvmStateError { op, source: None }
}

/// The x87/SSE state in `KVM_GET_FPU`'s layout (kvm-bindings has no serde for `kvm_fpu`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FpuState {
    pub fpr: Vec<[u8; 16]>,
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: Vec<[u8; 16]>,
    pub mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr.to_vec(),
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm.to_vec(),
            mxcsr: f.mxcsr,
        }
    }
}

impl FpuState {
    fn to_kvm(&self) -> Result<kvm_fpu, KvmStateError> {
        let mut f = kvm_fpu {
            fcw: self.fcw,
            fsw: self.fsw,
            ftwx: self.ftwx,
            last_opcode: self.last_opcode,
            last_ip: self.last_ip,
            last_dp: self.last_dp,
            mxcsr: self.mxcsr,
            ..Default::default()
        };
        if self.fpr.len() != f.fpr.len() || self.xmm.len() != f.xmm.len() {
            return Err(fail("FPU state has the wrong number of registers"));
        }
        f.fpr.copy_from_slice(&self.fpr);
        f.xmm.copy_from_slice(&self.xmm);
        Ok(f)
    }
}

/// Everything KVM exposes about one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuKvmState {
    pub index: u8,
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// (index, value) of every MSR from `KVM_GET_MSR_INDEX_LIST` that KVM could read.
    pub msrs: Vec<(u32, u64)>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// `KVM_GET_XSAVE` when KVM has it (it covers the FPU too), else `KVM_GET_FPU`.
    pub xsave: Option<kvm_xsave>,
    pub fpu: Option<FpuState>,
    pub xcrs: Option<kvm_xcrs>,
    pub lapic: kvm_lapic_state,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debugregs: kvm_debugregs,
}

/// Reads the values of `indices`; MSRs KVM refuses to read are left out (the index list holds
/// MSRs that only some CPU models have).
fn get_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<(u32, u64)>, KvmStateError> {
    let mut want: Vec<u32> = indices.iter().copied().take(MAX_MSRS).collect();
    // KVM reads entries in order and stops at the first it cannot read; drop that one and go on.
    for _ in 0..=want.len() {
        let entries: Vec<kvm_msr_entry> = want
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| fail("build the MSR list"))?;
        let n = fd.get_msrs(&mut msrs).map_err(err("KVM_GET_MSRS"))?;
        if n == want.len() {
            return Ok(msrs.as_slice().iter().map(|e| (e.index, e.data)).collect());
        }
        log::debug!("MSR {:#x} cannot be read; not saved", want[n]);
        want.remove(n);
    }
    Err(fail("KVM_GET_MSRS made no progress"))
}

impl VcpuKvmState {
    /// Reads the state of a vCPU that is not in `KVM_RUN`.
    pub fn save(fd: &VcpuFd, index: u8, msr_index_list: &[u32]) -> Result<Self, KvmStateError> {
        let cpuid = fd
            .get_cpuid2(MAX_CPUID_ENTRIES)
            .map_err(err("KVM_GET_CPUID2"))?
            .as_slice()
            .to_vec();
        let msrs = get_msrs(fd, msr_index_list)?;
        let (xsave, fpu) = match fd.get_xsave() {
            Ok(x) => (Some(x), None),
            Err(_) => (
                None,
                Some(FpuState::from(&fd.get_fpu().map_err(err("KVM_GET_FPU"))?)),
            ),
        };
        Ok(Self {
            index,
            cpuid,
            msrs,
            regs: fd.get_regs().map_err(err("KVM_GET_REGS"))?,
            sregs: fd.get_sregs().map_err(err("KVM_GET_SREGS"))?,
            xsave,
            fpu,
            xcrs: fd.get_xcrs().ok(),
            lapic: fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?,
            events: fd.get_vcpu_events().map_err(err("KVM_GET_VCPU_EVENTS"))?,
            mp_state: fd.get_mp_state().map_err(err("KVM_GET_MP_STATE"))?,
            debugregs: fd.get_debug_regs().map_err(err("KVM_GET_DEBUGREGS"))?,
        })
    }

    /// Checks what deserialisation cannot: sizes that KVM would reject or misread.
    pub fn validate(&self) -> Result<(), KvmStateError> {
        if self.cpuid.is_empty() || self.cpuid.len() > MAX_CPUID_ENTRIES {
            return Err(fail("CPUID entry count out of range"));
        }
        if self.msrs.len() > MAX_MSRS {
            return Err(fail("too many MSRs"));
        }
        if self.xsave.is_none() && self.fpu.is_none() {
            return Err(fail("neither XSAVE nor FPU state"));
        }
        Ok(())
    }

    /// Writes the state into a freshly created vCPU.
    pub fn restore(&self, fd: &VcpuFd) -> Result<(), KvmStateError> {
        self.validate()?;
        let cpuid = CpuId::from_entries(&self.cpuid).map_err(|_| fail("build the CPUID"))?;
        fd.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
        let entries: Vec<kvm_msr_entry> = self
            .msrs
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        let msrs = Msrs::from_entries(&entries).map_err(|_| fail("build the MSR list"))?;
        let n = fd.set_msrs(&msrs).map_err(err("KVM_SET_MSRS"))?;
        if n != entries.len() {
            log::warn!(
                "KVM refused MSR {:#x} ({n} of {} restored)",
                entries[n].index,
                entries.len()
            );
            return Err(fail("KVM_SET_MSRS refused an MSR"));
        }
        fd.set_sregs(&self.sregs).map_err(err("KVM_SET_SREGS"))?;
        fd.set_regs(&self.regs).map_err(err("KVM_SET_REGS"))?;
        match (&self.xsave, &self.fpu) {
            (Some(x), _) => {
                // SAFETY: `x` is a `kvm_xsave` of the legacy 4 KiB size, which is what
                // KVM_SET_XSAVE reads; no XSAVE component beyond it (AMX) is ever enabled by us.
                unsafe { fd.set_xsave(x) }.map_err(err("KVM_SET_XSAVE"))?
            }
            (None, Some(f)) => fd.set_fpu(&f.to_kvm()?).map_err(err("KVM_SET_FPU"))?,
            (None, None) => return Err(fail("neither XSAVE nor FPU state")),
        }
        if let Some(x) = &self.xcrs {
            fd.set_xcrs(x).map_err(err("KVM_SET_XCRS"))?;
        }
        fd.set_lapic(&self.lapic).map_err(err("KVM_SET_LAPIC"))?;
        // KVM ignores a TSC-deadline write while the LAPIC timer is not in TSC-deadline mode,
        // which a fresh vCPU's is not: written with the other MSRs above it was dropped, and a
        // guest waiting for its next tick would sleep forever. Now that the LAPIC is restored
        // (and the TSC, which the deadline is relative to), write it again.
        if let Some(&(index, data)) = self.msrs.iter().find(|(i, _)| *i == MSR_IA32_TSC_DEADLINE) {
            let one = Msrs::from_entries(&[kvm_msr_entry {
                index,
                data,
                ..Default::default()
            }])
            .map_err(|_| fail("build the MSR list"))?;
            if fd
                .set_msrs(&one)
                .map_err(err("KVM_SET_MSRS (TSC deadline)"))?
                != 1
            {
                return Err(fail("KVM refused the TSC deadline"));
            }
        }
        fd.set_vcpu_events(&self.events)
            .map_err(err("KVM_SET_VCPU_EVENTS"))?;
        fd.set_mp_state(self.mp_state)
            .map_err(err("KVM_SET_MP_STATE"))?;
        fd.set_debug_regs(&self.debugregs)
            .map_err(err("KVM_SET_DEBUGREGS"))?;
        Ok(())
    }
}

/// The VM-wide state KVM holds: the two PICs, the IOAPIC, the PIT and the kvmclock.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmKvmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

fn get_irqchip(fd: &VmFd, chip_id: u32) -> Result<kvm_irqchip, KvmStateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    fd.get_irqchip(&mut chip).map_err(err("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

impl VmKvmState {
    /// Reads the VM's state; its vCPUs must be parked.
    pub fn save(fd: &VmFd) -> Result<Self, KvmStateError> {
        Ok(Self {
            pic_master: get_irqchip(fd, KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: get_irqchip(fd, KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: get_irqchip(fd, KVM_IRQCHIP_IOAPIC)?,
            pit: fd.get_pit2().map_err(err("KVM_GET_PIT2"))?,
            clock: fd.get_clock().map_err(err("KVM_GET_CLOCK"))?,
        })
    }

    /// Writes the state into a fresh VM with an irqchip and a PIT.
    pub fn restore(&self, fd: &VmFd) -> Result<(), KvmStateError> {
        let chips = [
            (&self.pic_master, KVM_IRQCHIP_PIC_MASTER),
            (&self.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
            (&self.ioapic, KVM_IRQCHIP_IOAPIC),
        ];
        for (chip, id) in chips {
            if chip.chip_id != id {
                return Err(fail("irqchip state for the wrong chip"));
            }
            fd.set_irqchip(chip).map_err(err("KVM_SET_IRQCHIP"))?;
        }
        fd.set_pit2(&self.pit).map_err(err("KVM_SET_PIT2"))?;
        // The guest's clock continues from the value it had when the snapshot was taken (no
        // jump over the time the snapshot sat on disk). No flags: older KVMs refuse any, and
        // KVM_CLOCK_REALTIME would advance the clock by the wall time that passed.
        let clock = kvm_clock_data {
            clock: self.clock.clock,
            ..Default::default()
        };
        fd.set_clock(&clock).map_err(err("KVM_SET_CLOCK"))?;
        Ok(())
    }
}
