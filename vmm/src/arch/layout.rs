//! The guest-physical memory map of an Airlock microVM (x86_64).
//!
//! ```text
//! 0x0000_0500  GDT (4 entries)            0x0000_0520  IDT (empty)
//! 0x0000_7000  zero page (boot_params)    0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4  0x0000_a000 PDPT  0x0000_b000 PD (identity map of the first 1 GiB)
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  MP table (last KiB of base memory, where Linux looks for it)
//! 0x000a_0000 .. 0x0010_0000  legacy VGA/BIOS hole, not RAM
//! 0x0100_0000  kernel (the vmlinux ELF's physical load address)
//! 0xd000_0000 .. 0x1_0000_0000  MMIO: virtio-mmio slots, IOAPIC, LAPIC (never RAM)
//! 0x1_0000_0000 ..  RAM above the MMIO hole, for guests larger than 3.25 GiB
//! ```

use vm_memory::GuestAddress;

/// Global descriptor table.
pub const GDT_ADDR: u64 = 0x500;
/// Interrupt descriptor table (empty; the kernel installs its own).
pub const IDT_ADDR: u64 = 0x520;
/// The Linux zero page (`struct boot_params`).
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer of the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Boot page tables: PML4, one PDPT, one PD of 2 MiB pages.
pub const PML4_ADDR: u64 = 0x9000;
pub const PDPT_ADDR: u64 = 0xa000;
pub const PD_ADDR: u64 = 0xb000;
/// Kernel command line and its maximum length (x86 `COMMAND_LINE_SIZE`).
pub const CMDLINE_ADDR: u64 = 0x20000;
pub const CMDLINE_MAX_LEN: usize = 2048;
/// Start of the extended BIOS data area; the MP table goes here.
pub const EBDA_START: u64 = 0x9fc00;
/// End of conventional ("base") memory.
pub const BASE_MEM_END: u64 = 0xa0000;
/// First byte above the legacy hole.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the MMIO hole below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xd000_0000;
/// End of the MMIO hole (4 GiB).
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Virtio-mmio device slots: one 4 KiB window each, from the start of the MMIO hole.
pub const VIRTIO_MMIO_BASE: u64 = MMIO_GAP_START;
pub const VIRTIO_MMIO_SLOT_SIZE: u64 = 0x1000;
/// First GSI handed to virtio devices (0-4 are timer, keyboard, cascade, COM2, COM1).
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// Highest IOAPIC pin (the KVM IOAPIC has 24).
pub const IRQ_MAX: u32 = 23;
/// At most this many virtio-mmio devices: one IOAPIC pin each.
pub const VIRTIO_MMIO_MAX_SLOTS: u64 = (IRQ_MAX - VIRTIO_IRQ_BASE + 1) as u64;
/// Legacy COM1 and its IRQ.
pub const SERIAL_PORT_BASE: u16 = 0x3f8;
pub const SERIAL_IRQ: u32 = 4;
/// i8042 keyboard controller data/command ports (only the reset command matters).
pub const I8042_PORT_BASE: u16 = 0x60;
/// KVM's TSS needs three pages just below the identity-map page, inside the MMIO hole.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDR: u64 = 0xfffb_c000;
/// IOAPIC and local APIC MMIO windows.
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_ADDR: u32 = 0xfee0_0000;

/// Smallest guest the layout supports: the kernel is loaded at 16 MiB.
pub const MIN_MEM_BYTES: u64 = 64 << 20;

/// Splits `mem_bytes` of guest RAM around the MMIO hole into (start, size) ranges.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(GuestAddress, usize)> {
    let below = mem_bytes.min(MMIO_GAP_START);
    let mut ranges = vec![(GuestAddress(0), below as usize)];
    if mem_bytes > MMIO_GAP_START {
        ranges.push((
            GuestAddress(MMIO_GAP_END),
            (mem_bytes - MMIO_GAP_START) as usize,
        ));
    }
    ranges
}

// Layout invariants, checked at compile time.
const _: () =
    assert!(BOOT_STACK_POINTER < PML4_ADDR && BOOT_STACK_POINTER > ZERO_PAGE_ADDR + 0x1000);
const _: () = assert!(
    VIRTIO_MMIO_BASE + VIRTIO_MMIO_MAX_SLOTS * VIRTIO_MMIO_SLOT_SIZE <= KVM_IDENTITY_MAP_ADDR
);
// KVM's identity-map page and three TSS pages sit in the hole, clear of the APIC windows.
const _: () = assert!(KVM_IDENTITY_MAP_ADDR + 0x1000 == KVM_TSS_ADDR);
const _: () = assert!(KVM_IDENTITY_MAP_ADDR > APIC_ADDR as u64 + 0x1000);

/// Guest-physical address of virtio-mmio slot `slot`.
pub fn virtio_mmio_addr(slot: u64) -> u64 {
    VIRTIO_MMIO_BASE + slot * VIRTIO_MMIO_SLOT_SIZE
}

/// GSI (IOAPIC pin) of virtio-mmio slot `slot`.
pub fn virtio_irq(slot: u64) -> u32 {
    VIRTIO_IRQ_BASE + slot as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_ranges_small_guest_is_one_range_from_zero() {
        let r = ram_ranges(256 << 20);
        assert_eq!(r, vec![(GuestAddress(0), 256 << 20)]);
    }

    #[test]
    fn ram_ranges_large_guest_skips_the_mmio_hole() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], (GuestAddress(0), MMIO_GAP_START as usize));
        assert_eq!(r[1].0, GuestAddress(MMIO_GAP_END));
        assert_eq!(r[0].1 + r[1].1, 4 << 30);
    }

    #[test]
    fn boot_structures_do_not_overlap() {
        let regions = [
            (GDT_ADDR, 4 * 8),
            (IDT_ADDR, 8),
            (ZERO_PAGE_ADDR, 0x1000),
            (PML4_ADDR, 0x1000),
            (PDPT_ADDR, 0x1000),
            (PD_ADDR, 0x1000),
            (CMDLINE_ADDR, CMDLINE_MAX_LEN as u64),
            (EBDA_START, BASE_MEM_END - EBDA_START),
        ];
        for (i, a) in regions.iter().enumerate() {
            for b in &regions[i + 1..] {
                assert!(
                    a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0,
                    "{a:x?} overlaps {b:x?}"
                );
            }
        }
    }

    #[test]
    fn last_virtio_slot_gets_the_last_ioapic_pin() {
        assert_eq!(virtio_irq(VIRTIO_MMIO_MAX_SLOTS - 1), IRQ_MAX);
    }
}
