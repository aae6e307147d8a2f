//! Guest-virtual to guest-physical translation through the guest's own 4-level page tables,
//! used to show the instruction bytes at a faulting RIP.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

const PRESENT: u64 = 1;
const PAGE_SIZE_BIT: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const X86_CR0_PG: u64 = 0x8000_0000;
const EFER_LMA: u64 = 0x400;

/// Translates `gva` for a vCPU with the given control registers. Without paging, the address
/// is physical already. Returns `None` for an unmapped address or a table outside guest memory.
pub fn translate<M: GuestMemoryBackend>(
    mem: &M,
    cr0: u64,
    cr3: u64,
    efer: u64,
    gva: u64,
) -> Option<u64> {
    if cr0 & X86_CR0_PG == 0 {
        return Some(gva);
    }
    if efer & EFER_LMA == 0 {
        // 32-bit paging is never used by the guests we boot; do not guess.
        return None;
    }
    let mut table = cr3 & ADDR_MASK;
    // Levels PML4 (shift 39), PDPT (30), PD (21), PT (12).
    for shift in [39u32, 30, 21, 12] {
        let index = (gva >> shift) & 0x1ff;
        let entry: u64 = mem.read_obj(GuestAddress(table + index * 8)).ok()?;
        if entry & PRESENT == 0 {
            return None;
        }
        let huge = shift != 12 && shift != 39 && entry & PAGE_SIZE_BIT != 0;
        if shift == 12 || huge {
            let offset_mask = (1u64 << shift) - 1;
            return Some((entry & ADDR_MASK & !offset_mask) | (gva & offset_mask));
        }
        table = entry & ADDR_MASK;
    }
    None
}

/// Reads up to `N` bytes at `gva`, stopping at the first unmapped byte.
pub fn read_virt<M: GuestMemoryBackend, const N: usize>(
    mem: &M,
    cr0: u64,
    cr3: u64,
    efer: u64,
    gva: u64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(N);
    for i in 0..N as u64 {
        let Some(gpa) = translate(mem, cr0, cr3, efer, gva.wrapping_add(i)) else {
            break;
        };
        match mem.read_obj::<u8>(GuestAddress(gpa)) {
            Ok(b) => out.push(b),
            Err(_) => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const CR0: u64 = X86_CR0_PG | 1;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap()
    }

    #[test]
    fn unpaged_address_is_physical() {
        assert_eq!(translate(&mem(), 0, 0, 0, 0x1234), Some(0x1234));
    }

    #[test]
    fn walks_4k_and_2m_pages() {
        let m = mem();
        // PML4 at 0x1000 -> PDPT 0x2000 -> PD 0x3000; PD[0] -> PT 0x4000, PD[1] is a 2 MiB page.
        m.write_obj(0x2000u64 | 1, GuestAddress(0x1000)).unwrap();
        m.write_obj(0x3000u64 | 1, GuestAddress(0x2000)).unwrap();
        m.write_obj(0x4000u64 | 1, GuestAddress(0x3000)).unwrap();
        m.write_obj(0x20_0000u64 | 1 | PAGE_SIZE_BIT, GuestAddress(0x3008))
            .unwrap();
        m.write_obj(0x9000u64 | 1, GuestAddress(0x4000 + 5 * 8))
            .unwrap();
        assert_eq!(translate(&m, CR0, 0x1000, EFER_LMA, 0x5abc), Some(0x9abc));
        assert_eq!(
            translate(&m, CR0, 0x1000, EFER_LMA, 0x20_1234),
            Some(0x20_1234)
        );
        assert_eq!(translate(&m, CR0, 0x1000, EFER_LMA, 0x6000), None);
    }

    #[test]
    fn table_outside_memory_is_none_not_a_panic() {
        let m = mem();
        m.write_obj(0xdead_0000u64 | 1, GuestAddress(0x1000))
            .unwrap();
        assert_eq!(translate(&m, CR0, 0x1000, EFER_LMA, 0), None);
        assert!(read_virt::<_, 16>(&m, CR0, 0x1000, EFER_LMA, 0).is_empty());
    }
}
