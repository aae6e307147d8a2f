//! CPUID for the guest: KVM's supported set, filtered by a CPU template, with per-vCPU topology.
//!
//! Two templates:
//! - [`CpuTemplate::Host`] (bare-metal KVM): pass the host's features as KVM reports them.
//! - [`CpuTemplate::NestedPvm`] (this project's build machines, nested paravirtual KVM): hide every
//!   feature whose instructions the hypervisor's kernel-mode emulator cannot run (see
//!   `shared/guides/nested-kvm.md`): XSAVE, SMAP/SMEP (all of leaf 7), POPCNT, the SSE4/AVX/AES
//!   family, PCID, RDRAND, 1 GiB pages and RDTSCP; and CMPXCHG16B, which SLUB's lockless
//!   fast path uses in the kernel and the emulator stops at (measured: `lock cmpxchg16b` in
//!   `___slab_alloc`).
//!
//! Measured on the nested host: `kvm_pvm` replaces leaves 1, 7 and 0xd with the host's values
//! after `KVM_SET_CPUID2`, so there the masks of those leaves do not reach the guest and the
//! same features are hidden from the guest kernel with `noxsave clearcpuid=...` on its command
//! line (see [`crate::config::NESTED_CMDLINE`]). The masks stay: they are what a hypervisor that
//! honours `KVM_SET_CPUID2` shows, and the other leaves are honoured here too. Leaf 7 also carries `ARCH_CAPABILITIES`, whose
//!   MSR this host refuses.

use kvm_bindings::kvm_cpuid_entry2;

/// Which feature set the guest sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuTemplate {
    /// Everything KVM supports on this host.
    Host,
    /// Only what the nested paravirtual KVM (`kvm_pvm`) can emulate in guest kernel mode.
    NestedPvm,
}

impl CpuTemplate {
    /// Picks the template for the KVM module that is loaded.
    pub fn detect() -> Self {
        if std::path::Path::new("/sys/module/kvm_pvm").exists() {
            CpuTemplate::NestedPvm
        } else {
            CpuTemplate::Host
        }
    }
}

// Leaf 1 ECX bits.
const ECX_PCLMULQDQ: u32 = 1 << 1;
const ECX_SSSE3: u32 = 1 << 9;
const ECX_FMA: u32 = 1 << 12;
const ECX_CX16: u32 = 1 << 13;
const ECX_PCID: u32 = 1 << 17;
const ECX_SSE41: u32 = 1 << 19;
const ECX_SSE42: u32 = 1 << 20;
const ECX_MOVBE: u32 = 1 << 22;
const ECX_POPCNT: u32 = 1 << 23;
const ECX_AES: u32 = 1 << 25;
const ECX_XSAVE: u32 = 1 << 26;
const ECX_OSXSAVE: u32 = 1 << 27;
const ECX_AVX: u32 = 1 << 28;
const ECX_F16C: u32 = 1 << 29;
const ECX_RDRAND: u32 = 1 << 30;
const ECX_HYPERVISOR: u32 = 1 << 31;
// Leaf 1 EDX bits.
const EDX_HTT: u32 = 1 << 28;
// Leaf 0x8000_0001 EDX bits.
const EXT_EDX_PDPE1GB: u32 = 1 << 26;
const EXT_EDX_RDTSCP: u32 = 1 << 27;
// Leaf 0x8000_0008 EBX: XSAVEERPTR. With it the guest kernel skips the AMD "FXSAVE leak"
// workaround, whose x87 instructions the nested emulator cannot run.
const EXT8_EBX_XSAVEERPTR: u32 = 1 << 2;
// KVM paravirtual features (leaf 0x4000_0001 EAX) whose hypercalls stall on the nested host:
// with PV IPIs the second vCPU's first IPI never completes (measured: vcpu1 parked in
// `__send_ipi_mask` at `vmcall`, vcpu0 spinning in `queued_spin_lock_slowpath`).
const KVM_FEATURE_PV_UNHALT: u32 = 1 << 7;
const KVM_FEATURE_PV_SEND_IPI: u32 = 1 << 11;
const KVM_FEATURE_PV_SCHED_YIELD: u32 = 1 << 13;
/// KVM paravirtual features hidden on the nested host: each one is a hypercall.
pub const NESTED_HIDDEN_KVM_FEATURES: u32 =
    KVM_FEATURE_PV_UNHALT | KVM_FEATURE_PV_SEND_IPI | KVM_FEATURE_PV_SCHED_YIELD;

/// Leaf 1 ECX features hidden on the nested host.
pub const NESTED_HIDDEN_LEAF1_ECX: u32 = ECX_PCLMULQDQ
    | ECX_SSSE3
    | ECX_FMA
    | ECX_CX16
    | ECX_PCID
    | ECX_SSE41
    | ECX_SSE42
    | ECX_MOVBE
    | ECX_POPCNT
    | ECX_AES
    | ECX_XSAVE
    | ECX_OSXSAVE
    | ECX_AVX
    | ECX_F16C
    | ECX_RDRAND;

/// Applies `template` and the topology of vCPU `cpu_index` of `cpu_count` to `entries`.
pub fn filter_cpuid(
    entries: &mut [kvm_cpuid_entry2],
    template: CpuTemplate,
    cpu_index: u8,
    cpu_count: u8,
) {
    if template == CpuTemplate::NestedPvm {
        apply_nested_template(entries);
    }
    apply_topology(entries, cpu_index, cpu_count);
}

fn apply_nested_template(entries: &mut [kvm_cpuid_entry2]) {
    for e in entries.iter_mut() {
        match (e.function, e.index) {
            (0x1, _) => e.ecx &= !NESTED_HIDDEN_LEAF1_ECX,
            (0x7, _) => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            // XSAVE state enumeration is meaningless without XSAVE.
            (0xd, _) => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            (0x8000_0001, _) => e.edx &= !(EXT_EDX_PDPE1GB | EXT_EDX_RDTSCP),
            (0x8000_0008, _) => e.ebx |= EXT8_EBX_XSAVEERPTR,
            (0x4000_0001, _) => e.eax &= !NESTED_HIDDEN_KVM_FEATURES,
            _ => {}
        }
    }
}

/// Every vCPU is one core of one socket (no SMT); the APIC id is the vCPU index.
fn apply_topology(entries: &mut [kvm_cpuid_entry2], cpu_index: u8, cpu_count: u8) {
    let apic_id = u32::from(cpu_index);
    let count = u32::from(cpu_count.max(1));
    // Bits needed to number `count` cores (the x2APIC id shift of the core level).
    let core_shift = u32::BITS - (count - 1).leading_zeros();
    for e in entries.iter_mut() {
        match e.function {
            0x1 => {
                // EBX: [31:24] initial APIC id, [23:16] logical processors, [15:8] CLFLUSH 8 qwords.
                e.ebx = (apic_id << 24) | (count << 16) | (8 << 8);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            0xb => {
                // Extended topology: subleaf 0 = SMT level (1 thread), 1 = core level.
                let (eax, ebx, ecx_level) = match e.index {
                    0 => (0, 1, 1u32),
                    1 => (core_shift, count, 2u32),
                    _ => (0, 0, 0),
                };
                e.eax = eax;
                e.ebx = ebx;
                e.ecx = (ecx_level << 8) | (e.index & 0xff);
                e.edx = apic_id;
            }
            // AMD: [7:0] number of cores - 1, [15:12] APIC id size.
            0x8000_0008 => e.ecx = (e.ecx & !0xf0ff) | (count - 1) | (core_shift << 12),
            // AMD TOPOEXT: extended APIC id, core id (one thread per core), node 0.
            0x8000_001e => {
                e.eax = apic_id;
                e.ebx = apic_id & 0xff;
                e.ecx = 0;
                e.edx = 0;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, v: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: v,
            ebx: v,
            ecx: v,
            edx: v,
            ..Default::default()
        }
    }

    fn sample() -> Vec<kvm_cpuid_entry2> {
        vec![
            entry(0x1, 0, u32::MAX),
            entry(0x7, 0, u32::MAX),
            entry(0x7, 1, u32::MAX),
            entry(0xb, 0, 0),
            entry(0xb, 1, 0),
            entry(0xd, 0, 0x207),
            entry(0x8000_0001, 0, u32::MAX),
            entry(0x8000_0008, 0, 0),
            entry(0x4000_0001, 0, u32::MAX),
        ]
    }

    fn find(e: &[kvm_cpuid_entry2], f: u32, i: u32) -> kvm_cpuid_entry2 {
        *e.iter().find(|x| x.function == f && x.index == i).unwrap()
    }

    #[test]
    fn nested_template_hides_emulator_unsafe_features() {
        let mut e = sample();
        filter_cpuid(&mut e, CpuTemplate::NestedPvm, 0, 1);
        let l1 = find(&e, 1, 0);
        assert_eq!(
            l1.ecx & (ECX_XSAVE | ECX_POPCNT | ECX_OSXSAVE | ECX_AVX | ECX_CX16),
            0
        );
        for sub in [0, 1] {
            let l7 = find(&e, 7, sub);
            assert_eq!(
                (l7.eax, l7.ebx, l7.ecx, l7.edx),
                (0, 0, 0, 0),
                "leaf 7.{sub}"
            );
        }
        let ext1 = find(&e, 0x8000_0001, 0);
        assert_eq!(ext1.edx & (EXT_EDX_PDPE1GB | EXT_EDX_RDTSCP), 0);
        assert_ne!(find(&e, 0x8000_0008, 0).ebx & EXT8_EBX_XSAVEERPTR, 0);
        assert_eq!(find(&e, 0xd, 0).eax, 0);
        assert_eq!(find(&e, 0x4000_0001, 0).eax & NESTED_HIDDEN_KVM_FEATURES, 0);
    }

    #[test]
    fn host_template_keeps_host_features() {
        let mut e = sample();
        filter_cpuid(&mut e, CpuTemplate::Host, 0, 1);
        let l1 = find(&e, 1, 0);
        assert_ne!(l1.ecx & ECX_XSAVE, 0);
        assert_eq!(find(&e, 7, 0).ebx, u32::MAX);
    }

    #[test]
    fn topology_gives_each_vcpu_its_apic_id() {
        for cpu in 0..4u8 {
            let mut e = sample();
            filter_cpuid(&mut e, CpuTemplate::Host, cpu, 4);
            let l1 = find(&e, 1, 0);
            assert_eq!(l1.ebx >> 24, u32::from(cpu));
            assert_eq!((l1.ebx >> 16) & 0xff, 4);
            assert_ne!(l1.edx & EDX_HTT, 0);
            assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
            assert_eq!(find(&e, 0xb, 0).edx, u32::from(cpu));
            let core = find(&e, 0xb, 1);
            assert_eq!((core.eax, core.ebx, (core.ecx >> 8) & 0xff), (2, 4, 2));
            assert_eq!(find(&e, 0x8000_0008, 0).ecx & 0xff, 3);
        }
    }

    #[test]
    fn single_vcpu_has_no_htt_and_zero_core_shift() {
        let mut e = sample();
        filter_cpuid(&mut e, CpuTemplate::Host, 0, 1);
        assert_eq!(find(&e, 1, 0).edx & EDX_HTT, 0);
        assert_eq!(find(&e, 0xb, 1).eax, 0);
    }
}
