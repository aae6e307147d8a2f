//! Puts a vCPU into the state the 64-bit Linux entry expects: CPUID, MSRs, registers, special
//! registers, FPU and local APIC. Every ioctl's result is checked.

use kvm_bindings::{CpuId, Msrs, kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs};
use kvm_ioctls::VcpuFd;
use thiserror::Error;

use super::boot::long_mode_sregs;
use super::cpuid::{CpuTemplate, filter_cpuid};
use super::layout::{BOOT_STACK_POINTER, ZERO_PAGE_ADDR};

/// Errors configuring a vCPU for boot.
#[derive(Debug, Error)]
pub enum RegsError {
    #[error("set CPUID")]
    SetCpuid(#[source] kvm_ioctls::Error),
    #[error("build the MSR list")]
    BuildMsrs,
    #[error("set MSRs")]
    SetMsrs(#[source] kvm_ioctls::Error),
    #[error("KVM accepted only {set} of {wanted} boot MSRs")]
    PartialMsrs { set: usize, wanted: usize },
    #[error("set general registers")]
    SetRegs(#[source] kvm_ioctls::Error),
    #[error("get special registers")]
    GetSregs(#[source] kvm_ioctls::Error),
    #[error("set special registers")]
    SetSregs(#[source] kvm_ioctls::Error),
    #[error("set FPU state")]
    SetFpu(#[source] kvm_ioctls::Error),
    #[error("get local APIC state")]
    GetLapic(#[source] kvm_ioctls::Error),
    #[error("set local APIC state")]
    SetLapic(#[source] kvm_ioctls::Error),
}

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// The MSRs set at boot, restricted to those KVM lists in `KVM_GET_MSR_INDEX_LIST`: setting an
/// MSR this KVM does not know fails the whole ioctl (seen on the nested host with MSR 0x10a).
pub fn boot_msrs(supported: &[u32]) -> Vec<kvm_msr_entry> {
    let wanted = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ];
    wanted
        .iter()
        .filter(|(index, _)| supported.contains(index))
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect()
}

/// Sets this vCPU's CPUID from KVM's supported set.
pub fn configure_cpuid(
    vcpu: &VcpuFd,
    supported: &CpuId,
    template: CpuTemplate,
    index: u8,
    count: u8,
) -> Result<(), RegsError> {
    let mut cpuid = supported.clone();
    filter_cpuid(cpuid.as_mut_slice(), template, index, count);
    vcpu.set_cpuid2(&cpuid).map_err(RegsError::SetCpuid)
}

/// Sets the boot MSRs that this KVM supports.
pub fn configure_msrs(vcpu: &VcpuFd, supported: &[u32]) -> Result<(), RegsError> {
    let entries = boot_msrs(supported);
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::BuildMsrs)?;
    let set = vcpu.set_msrs(&msrs).map_err(RegsError::SetMsrs)?;
    if set != entries.len() {
        return Err(RegsError::PartialMsrs {
            set,
            wanted: entries.len(),
        });
    }
    Ok(())
}

/// General registers for the kernel's 64-bit entry: RIP at the entry, RSI at the zero page.
pub fn configure_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), RegsError> {
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_ADDR,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(RegsError::SetRegs)
}

/// Long mode with the boot GDT and identity page tables (written by `boot::write_*`).
pub fn configure_sregs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let base = vcpu.get_sregs().map_err(RegsError::GetSregs)?;
    vcpu.set_sregs(&long_mode_sregs(&base))
        .map_err(RegsError::SetSregs)
}

/// x87 control word and MXCSR at their architectural reset values.
pub fn configure_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(RegsError::SetFpu)
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn set_apic_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

fn lapic_reg(state: &kvm_lapic_state, offset: usize) -> u32 {
    let b = &state.regs[offset..offset + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(state: &mut kvm_lapic_state, offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        state.regs[offset + i] = *b as _;
    }
}

/// LINT0 delivers ExtINT (the 8259), LINT1 delivers NMI, as the MP table says.
pub fn configure_lapic(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut state = vcpu.get_lapic().map_err(RegsError::GetLapic)?;
    let lvt0 = lapic_reg(&state, APIC_LVT0);
    set_lapic_reg(
        &mut state,
        APIC_LVT0,
        set_apic_delivery_mode(lvt0, APIC_MODE_EXTINT),
    );
    let lvt1 = lapic_reg(&state, APIC_LVT1);
    set_lapic_reg(
        &mut state,
        APIC_LVT1,
        set_apic_delivery_mode(lvt1, APIC_MODE_NMI),
    );
    vcpu.set_lapic(&state).map_err(RegsError::SetLapic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_msrs_only_include_supported_indices() {
        let m = boot_msrs(&[MSR_STAR, MSR_IA32_MISC_ENABLE, 0x10a]);
        let idx: Vec<u32> = m.iter().map(|e| e.index).collect();
        assert_eq!(idx, vec![MSR_STAR, MSR_IA32_MISC_ENABLE]);
        assert_eq!(m[1].data, MISC_ENABLE_FAST_STRING);
    }

    #[test]
    fn lapic_delivery_mode_replaces_only_mode_bits() {
        assert_eq!(
            set_apic_delivery_mode(0x0001_0700, APIC_MODE_NMI),
            0x0001_0400
        );
        let mut s = kvm_lapic_state::default();
        set_lapic_reg(&mut s, APIC_LVT1, 0xdead_beef);
        assert_eq!(lapic_reg(&s, APIC_LVT1), 0xdead_beef);
    }
}
