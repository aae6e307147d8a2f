//! virtio-blk over a virtqueue the guest wrote: descriptor table, available ring and guest
//! memory all come from the input. Inputs of odd length drive a copy-on-write disk (a base,
//! and an overlay of two blocks' quota), even ones a raw image.
#![no_main]

use std::io::Write;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::block::Block;
use vmm::devices::virtio::block::layered::{BLOCK_SIZE, LayeredDisk};
use vmm::devices::virtio::{VirtioDevice, VirtioInterrupt};
use vmm_sys_util::eventfd::EventFd;

const QUEUE: u16 = 16;

fuzz_target!(|data: &[u8]| {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]) else {
        return;
    };
    let vq = MockSplitQueue::create(&mem, GuestAddress(0x1000), QUEUE);
    // The input: the descriptor table, then the available ring (flags, idx, entries), then
    // whatever the descriptors point at.
    let (table, rest) = data.split_at(data.len().min(16 * usize::from(QUEUE)));
    let (avail, memory) = rest.split_at(rest.len().min(4 + 2 * usize::from(QUEUE)));
    let _ = mem.write_slice(table, vq.desc_table_addr());
    let _ = mem.write_slice(avail, vq.avail_addr());
    let _ = mem.write_slice(memory, GuestAddress(0x10_000));
    let Ok(queue) = vq.create_queue() else {
        return;
    };
    let mut file = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
    let _ = file.write_all(&[0u8; 8192]);
    let dev = if data.len() % 2 == 1 {
        let overlay = vmm_sys_util::tempfile::TempFile::new().unwrap().into_file();
        match LayeredDisk::new(file, None, overlay, 2 * BLOCK_SIZE) {
            Ok(disk) => Block::layered(disk, "fuzz"),
            Err(_) => return,
        }
    } else {
        Block::from_file(file, 16, false, "fuzz")
    };
    let Ok(mut dev) = dev else {
        return;
    };
    let irq = Arc::new(VirtioInterrupt::new(
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    ));
    if dev.activate(mem.clone(), vec![queue], irq).is_ok() {
        dev.process_queue();
    }
});
