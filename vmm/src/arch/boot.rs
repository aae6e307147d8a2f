//! Boot-time guest memory contents for the 64-bit Linux entry: GDT, identity page tables, the
//! zero page with its e820 map, and the segment/control-register state that goes with them.
//!
//! The VMM enters the `vmlinux` ELF's 64-bit `startup_64` directly, already in long mode, as
//! Firecracker did before PVH: on the nested build machines the 32-bit PVH path would be
//! emulated instruction by instruction.

use kvm_bindings::{kvm_segment, kvm_sregs};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use thiserror::Error;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::layout::{
    CMDLINE_ADDR, EBDA_START, GDT_ADDR, HIMEM_START, IDT_ADDR, PD_ADDR, PDPT_ADDR, PML4_ADDR,
    ZERO_PAGE_ADDR,
};

/// Errors writing boot structures.
#[derive(Debug, Error)]
pub enum BootError {
    #[error("write {0} into guest memory")]
    Write(&'static str, #[source] vm_memory::GuestMemoryError),
    #[error("guest memory has more regions than the zero page's e820 table holds")]
    TooManyE820Entries,
    #[error("guest memory does not cover the boot structures")]
    MemoryTooSmall,
}

const E820_RAM: u32 = 1;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Encodes a GDT descriptor from access/flags bits, base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (flags as u64, base as u64, limit as u64);
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// Decodes a GDT descriptor into the segment register KVM loads for selector `index * 8`.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let bit = |shift: u32| ((entry >> shift) & 1) as u8;
    let present = bit(47);
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: {
            let raw = ((entry & 0xffff) | ((entry >> 32) & 0x000f_0000)) as u32;
            // With the granularity bit the limit counts 4 KiB pages.
            if bit(55) == 1 {
                (raw << 12) | 0xfff
            } else {
                raw
            }
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g: bit(55),
        avl: bit(52),
        unusable: u8::from(present == 0),
        padding: 0,
    }
}

/// The boot GDT: null, 64-bit code, data, TSS.
pub const BOOT_GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

/// Writes the GDT and an empty IDT.
pub fn write_gdt_idt<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_ADDR + 8 * i as u64))
            .map_err(|e| BootError::Write("GDT", e))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_ADDR))
        .map_err(|e| BootError::Write("IDT", e))
}

/// Identity-maps the first GiB with 2 MiB pages: enough for the kernel to reach its own tables.
pub fn write_page_tables<M: GuestMemoryBackend>(mem: &M) -> Result<(), BootError> {
    let w = |what, val: u64, addr: u64| {
        mem.write_obj(val, GuestAddress(addr))
            .map_err(|e| BootError::Write(what, e))
    };
    // Present | writable.
    w("PML4", PDPT_ADDR | 0x3, PML4_ADDR)?;
    w("PDPT", PD_ADDR | 0x3, PDPT_ADDR)?;
    for i in 0..512u64 {
        // Present | writable | page size (2 MiB).
        w("PD", (i << 21) | 0x83, PD_ADDR + i * 8)?;
    }
    Ok(())
}

/// Special registers for long mode with the boot GDT and page tables, based on `base` (KVM's
/// reset state of the vCPU).
pub fn long_mode_sregs(base: &kvm_sregs) -> kvm_sregs {
    let mut s = *base;
    let code = segment_from_gdt(BOOT_GDT[1], 1);
    let data = segment_from_gdt(BOOT_GDT[2], 2);
    let tss = segment_from_gdt(BOOT_GDT[3], 3);
    s.gdt.base = GDT_ADDR;
    s.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    s.idt.base = IDT_ADDR;
    s.idt.limit = 7;
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    s.tr = tss;
    s.cr3 = PML4_ADDR;
    s.cr4 |= X86_CR4_PAE;
    s.cr0 |= X86_CR0_PE | X86_CR0_PG;
    s.efer |= EFER_LME | EFER_LMA;
    s
}

/// The e820 map: conventional memory below the EBDA, then every RAM region above 1 MiB.
pub fn e820_map<M: GuestMemoryBackend>(mem: &M) -> Vec<boot_e820_entry> {
    let mut map = vec![boot_e820_entry {
        addr: 0,
        size: EBDA_START,
        r#type: E820_RAM,
    }];
    for region in mem.iter() {
        let start = region.start_addr().raw_value().max(HIMEM_START);
        let end = region.last_addr().raw_value() + 1;
        if end > start {
            map.push(boot_e820_entry {
                addr: start,
                size: end - start,
                r#type: E820_RAM,
            });
        }
    }
    map
}

/// Writes the zero page: boot protocol header, command line location and the e820 map.
pub fn write_zero_page<M: GuestMemoryBackend>(
    mem: &M,
    cmdline_len: usize,
) -> Result<(), BootError> {
    if mem.last_addr().raw_value() < HIMEM_START {
        return Err(BootError::MemoryTooSmall);
    }
    let mut params = boot_params::default();
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    let map = e820_map(mem);
    if map.len() > params.e820_table.len() {
        return Err(BootError::TooManyE820Entries);
    }
    params.e820_entries = map.len() as u8;
    params.e820_table[..map.len()].copy_from_slice(&map);
    mem.write_obj(params, GuestAddress(ZERO_PAGE_ADDR))
        .map_err(|e| BootError::Write("zero page", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::layout::{MMIO_GAP_END, MMIO_GAP_START, ram_ranges};
    use vm_memory::GuestMemoryMmap;

    fn mem(bytes: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&ram_ranges(bytes)).unwrap()
    }

    #[test]
    fn gdt_code_segment_decodes_as_64bit_ring0_code() {
        let cs = segment_from_gdt(BOOT_GDT[1], 1);
        assert_eq!(
            (cs.selector, cs.type_, cs.l, cs.db, cs.dpl),
            (8, 0xb, 1, 0, 0)
        );
        assert_eq!((cs.present, cs.s, cs.g, cs.unusable), (1, 1, 1, 0));
        assert_eq!(cs.limit, 0xffff_ffff);
    }

    #[test]
    fn gdt_data_and_tss_segments_decode() {
        let ds = segment_from_gdt(BOOT_GDT[2], 2);
        assert_eq!((ds.selector, ds.type_, ds.db, ds.l), (0x10, 3, 1, 0));
        let tr = segment_from_gdt(BOOT_GDT[3], 3);
        assert_eq!((tr.selector, tr.type_, tr.s), (0x18, 0xb, 0));
        let null = segment_from_gdt(BOOT_GDT[0], 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn long_mode_sregs_enable_paging_pae_and_lma() {
        let s = long_mode_sregs(&kvm_sregs::default());
        assert_eq!(s.cr0 & (X86_CR0_PE | X86_CR0_PG), X86_CR0_PE | X86_CR0_PG);
        assert_ne!(s.cr4 & X86_CR4_PAE, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!((s.cr3, s.gdt.base, s.gdt.limit), (PML4_ADDR, GDT_ADDR, 31));
    }

    #[test]
    fn page_tables_identity_map_first_gib() {
        let m = mem(64 << 20);
        write_page_tables(&m).unwrap();
        assert_eq!(
            m.read_obj::<u64>(GuestAddress(PML4_ADDR)).unwrap(),
            PDPT_ADDR | 3
        );
        assert_eq!(
            m.read_obj::<u64>(GuestAddress(PDPT_ADDR)).unwrap(),
            PD_ADDR | 3
        );
        let last = m.read_obj::<u64>(GuestAddress(PD_ADDR + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
    }

    #[test]
    fn zero_page_has_magic_cmdline_and_e820() {
        let m = mem(128 << 20);
        write_zero_page(&m, 42).unwrap();
        let p: boot_params = m.read_obj(GuestAddress(ZERO_PAGE_ADDR)).unwrap();
        let hdr = p.hdr;
        assert_eq!({ hdr.boot_flag }, KERNEL_BOOT_FLAG_MAGIC);
        assert_eq!({ hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ hdr.cmd_line_ptr }, CMDLINE_ADDR as u32);
        assert_eq!({ hdr.cmdline_size }, 42);
        assert_eq!(p.e820_entries, 2);
        let high = p.e820_table[1];
        assert_eq!(
            ({ high.addr }, { high.size }),
            (HIMEM_START, (128 << 20) - HIMEM_START)
        );
    }

    #[test]
    fn e820_covers_ram_above_the_mmio_hole() {
        let m = mem(4 << 30);
        let map = e820_map(&m);
        assert_eq!(map.len(), 3);
        assert_eq!({ map[1].size }, MMIO_GAP_START - HIMEM_START);
        assert_eq!(
            ({ map[2].addr }, { map[2].size }),
            (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
        );
    }
}
