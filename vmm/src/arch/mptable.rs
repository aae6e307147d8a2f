//! The Intel MultiProcessor Specification 1.4 table, which tells a guest without ACPI how many
//! CPUs it has and how ISA interrupts reach the IOAPIC.
//!
//! Layout at [`EBDA_START`]: the 16-byte floating pointer, then the configuration table (header,
//! one processor entry per vCPU, the ISA bus, the IOAPIC, one interrupt entry per IOAPIC pin, and
//! the two local interrupt entries). Linux finds it by scanning the last KiB of base memory.

use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::{APIC_ADDR, BASE_MEM_END, EBDA_START, IOAPIC_ADDR, IRQ_MAX};

/// Errors writing the MP table.
#[derive(Debug, Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit in the MP table (at most {MAX_CPUS})")]
    TooManyCpus(u8),
    #[error("the guest needs at least one vCPU")]
    NoCpus,
    #[error("write the MP table into guest memory")]
    Write(#[source] vm_memory::GuestMemoryError),
}

/// Most vCPUs whose entries fit between [`EBDA_START`] and [`BASE_MEM_END`].
pub const MAX_CPUS: u8 = 32;

const FLOATING_LEN: usize = 16;
const HEADER_LEN: usize = 44;
const PROCESSOR_LEN: usize = 20;
const SMALL_ENTRY_LEN: usize = 8;

const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;

const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;

const CPU_ENABLED: u8 = 1;
const CPU_BOOT_PROCESSOR: u8 = 2;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
/// Family 6, as Firecracker and QEMU report; Linux only uses it for display.
const CPU_SIGNATURE: u32 = 0x600;
/// FPU and APIC present.
const CPU_FEATURES: u32 = 0x201;
const SPEC_REV: u8 = 4;

/// Size in bytes of the whole structure for `cpus` vCPUs.
pub fn table_size(cpus: u8) -> usize {
    FLOATING_LEN
        + HEADER_LEN
        + PROCESSOR_LEN * usize::from(cpus)
        + SMALL_ENTRY_LEN * (2 + (IRQ_MAX as usize + 1) + 2)
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |acc, b| acc.wrapping_add(*b))
        .wrapping_neg()
}

/// Builds the floating pointer and configuration table as bytes, to live at `base`.
pub fn build_mptable(base: u64, cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 {
        return Err(MpTableError::NoCpus);
    }
    if cpus > MAX_CPUS {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus;
    let mut entries = Vec::new();
    for cpu in 0..cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOT_PROCESSOR } else { 0 };
        entries.extend_from_slice(&[ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        entries.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        entries.extend_from_slice(&[0; 8]);
    }
    entries.extend_from_slice(&[ENTRY_BUS, 0]);
    entries.extend_from_slice(b"ISA   ");
    entries.extend_from_slice(&[ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, CPU_ENABLED]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    // Pin 0 is the 8259 cascade (ExtINT); every other ISA IRQ n goes to IOAPIC pin n, with the
    // bus's default (edge, active high) polarity.
    for irq in 0..=IRQ_MAX as u8 {
        let kind = if irq == 0 {
            INT_TYPE_EXTINT
        } else {
            INT_TYPE_INT
        };
        entries.extend_from_slice(&[ENTRY_IO_INTERRUPT, kind, 0, 0, 0, irq, ioapic_id, irq]);
    }
    // LINT0 of every local APIC is ExtINT, LINT1 is NMI.
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    let entry_count = u16::from(cpus) + 2 + (IRQ_MAX as u16 + 1) + 2;

    let table_addr = base + FLOATING_LEN as u64;
    let table_len = HEADER_LEN + entries.len();
    let mut header = Vec::with_capacity(table_len);
    header.extend_from_slice(b"PCMP");
    header.extend_from_slice(&(table_len as u16).to_le_bytes());
    header.extend_from_slice(&[SPEC_REV, 0]); // checksum patched below
    header.extend_from_slice(b"AIRLOCK ");
    header.extend_from_slice(b"MICROVM     ");
    header.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    header.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    header.extend_from_slice(&entry_count.to_le_bytes());
    header.extend_from_slice(&APIC_ADDR.to_le_bytes());
    header.extend_from_slice(&[0; 4]); // extended table length, checksum, reserved
    header.extend_from_slice(&entries);
    header[7] = checksum(&header);

    let mut floating = Vec::with_capacity(FLOATING_LEN);
    floating.extend_from_slice(b"_MP_");
    floating.extend_from_slice(&(table_addr as u32).to_le_bytes());
    floating.extend_from_slice(&[1, SPEC_REV, 0, 0, 0, 0, 0, 0]);
    floating[10] = checksum(&floating);

    floating.extend_from_slice(&header);
    Ok(floating)
}

/// Writes the MP table for `cpus` vCPUs at [`EBDA_START`].
pub fn setup_mptable<M: GuestMemoryBackend>(mem: &M, cpus: u8) -> Result<(), MpTableError> {
    let bytes = build_mptable(EBDA_START, cpus)?;
    debug_assert!(EBDA_START + bytes.len() as u64 <= BASE_MEM_END);
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(MpTableError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn floating_pointer_and_table_checksums_are_zero() {
        let t = build_mptable(EBDA_START, 2).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(sum(&t[..FLOATING_LEN]), 0);
        let table = &t[FLOATING_LEN..];
        assert_eq!(&table[0..4], b"PCMP");
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        assert_eq!(len, table.len());
        assert_eq!(sum(table), 0);
    }

    #[test]
    fn floating_pointer_points_at_table() {
        let t = build_mptable(EBDA_START, 1).unwrap();
        let ptr = u32::from_le_bytes([t[4], t[5], t[6], t[7]]);
        assert_eq!(u64::from(ptr), EBDA_START + FLOATING_LEN as u64);
    }

    #[test]
    fn one_processor_entry_per_vcpu_and_only_cpu0_boots() {
        let t = build_mptable(EBDA_START, 3).unwrap();
        let entries = &t[FLOATING_LEN + HEADER_LEN..];
        for cpu in 0..3usize {
            let e = &entries[cpu * PROCESSOR_LEN..];
            assert_eq!(e[0], ENTRY_PROCESSOR);
            assert_eq!(e[1] as usize, cpu);
            assert_eq!(e[3] & CPU_BOOT_PROCESSOR != 0, cpu == 0);
        }
        assert_eq!(entries[3 * PROCESSOR_LEN], ENTRY_BUS);
    }

    #[test]
    fn size_matches_and_max_cpus_fit_below_base_memory_end() {
        for cpus in [1, 2, MAX_CPUS] {
            assert_eq!(
                build_mptable(EBDA_START, cpus).unwrap().len(),
                table_size(cpus)
            );
        }
        assert!(EBDA_START + table_size(MAX_CPUS) as u64 <= BASE_MEM_END);
    }

    #[test]
    fn rejects_zero_and_too_many_cpus() {
        assert!(matches!(
            build_mptable(EBDA_START, 0),
            Err(MpTableError::NoCpus)
        ));
        assert!(matches!(
            build_mptable(EBDA_START, MAX_CPUS + 1),
            Err(MpTableError::TooManyCpus(_))
        ));
    }

    #[test]
    fn setup_writes_into_guest_memory() {
        let mem: GuestMemoryMmap =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        setup_mptable(&mem, 2).unwrap();
        let mut sig = [0u8; 4];
        mem.read_slice(&mut sig, GuestAddress(EBDA_START)).unwrap();
        assert_eq!(&sig, b"_MP_");
    }
}
