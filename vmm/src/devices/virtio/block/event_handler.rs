//! Wires a block device's queue event into the VMM's event loop.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::EventFd;

use super::Block;
use crate::devices::virtio::VirtioDevice;

/// Event-loop subscriber of one block device.
#[derive(Debug)]
pub struct BlockEventHandler {
    device: Arc<Mutex<Block>>,
    queue_evt: EventFd,
}

impl BlockEventHandler {
    /// Watches `device`'s queue event (a clone of its eventfd).
    pub fn new(device: Arc<Mutex<Block>>) -> std::io::Result<Self> {
        let queue_evt = {
            let dev = device.lock().unwrap_or_else(|e| e.into_inner());
            match dev.queue_events().first() {
                Some(evt) => evt.try_clone()?,
                None => return Err(std::io::Error::other("block device without a queue")),
            }
        };
        Ok(Self { device, queue_evt })
    }
}

impl MutEventSubscriber for BlockEventHandler {
    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() != self.queue_evt.as_raw_fd() || !events.event_set().contains(EventSet::IN) {
            return;
        }
        // Drain the counter first so a notification during processing is not lost.
        let _ = self.queue_evt.read();
        self.device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .process_queue();
    }

    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.queue_evt, EventSet::IN)) {
            log::error!("virtio-blk: cannot watch queue event: {e:?}");
        }
    }
}
