//! virtio-vsock over queues the guest wrote: the TX queue's packets (headers, payloads,
//! descriptor chains) and the RX queue's buffers all come from the input.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm::devices::virtio::vsock::Vsock;
use vmm::devices::virtio::{VirtioDevice, VirtioInterrupt};
use vmm_sys_util::eventfd::EventFd;

const QUEUE: u16 = 16;

fuzz_target!(|data: &[u8]| {
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]) else {
        return;
    };
    let queues =
        [0x1000, 0x8000, 0xf000].map(|a| MockSplitQueue::create(&mem, GuestAddress(a), QUEUE));
    // The input: for the RX and TX queues a descriptor table and an available ring each, then
    // guest memory.
    let mut rest = data;
    for vq in &queues[..2] {
        let (table, r) = rest.split_at(rest.len().min(16 * usize::from(QUEUE)));
        let (avail, r) = r.split_at(r.len().min(4 + 2 * usize::from(QUEUE)));
        let _ = mem.write_slice(table, vq.desc_table_addr());
        let _ = mem.write_slice(avail, vq.avail_addr());
        rest = r;
    }
    let _ = mem.write_slice(rest, GuestAddress(0x20_000));
    let Ok(qs) = queues
        .iter()
        .map(|q| q.create_queue())
        .collect::<Result<Vec<_>, _>>()
    else {
        return;
    };
    let path = std::env::temp_dir().join(format!("airlock-fuzz-vsock-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let Ok(mut dev) = Vsock::new(3, &path) else {
        return;
    };
    let irq = Arc::new(VirtioInterrupt::new(
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    ));
    if dev.activate(mem.clone(), qs, irq).is_ok() {
        dev.process_tx();
        dev.process_rx();
        dev.process_tx();
    }
});
