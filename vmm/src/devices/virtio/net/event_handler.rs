//! Wires a network device into the VMM's event loop: its two queue events and its tap.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::EventFd;

use super::Net;
use super::device::{RX_QUEUE, TX_QUEUE};
use crate::devices::virtio::VirtioDevice;

/// Event-loop subscriber of one network device.
#[derive(Debug)]
pub struct NetEventHandler {
    device: Arc<Mutex<Net>>,
    queue_evts: Vec<EventFd>,
    tap: RawFd,
    /// Whether the tap is watched: not while a frame waits for receive buffers (it would stay
    /// readable and spin the loop); the rx queue's notification brings it back.
    tap_watched: bool,
}

impl NetEventHandler {
    /// Watches `device`'s queue events (clones of its eventfds) and its tap.
    pub fn new(device: Arc<Mutex<Net>>) -> std::io::Result<Self> {
        let (queue_evts, tap) = {
            let dev = device.lock().unwrap_or_else(|e| e.into_inner());
            let evts = dev
                .queue_events()
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()?;
            (evts, dev.tap_fd())
        };
        Ok(Self {
            device,
            queue_evts,
            tap,
            tap_watched: false,
        })
    }

    fn watch_tap(&mut self, want: bool, ops: &mut EventOps) {
        if want == self.tap_watched {
            return;
        }
        let events = Events::new_raw(self.tap, EventSet::IN);
        let result = if want {
            ops.add(events)
        } else {
            ops.remove(events)
        };
        match result {
            Ok(()) => self.tap_watched = want,
            Err(e) => log::error!("virtio-net: cannot change the tap's poll interest: {e:?}"),
        }
    }
}

impl MutEventSubscriber for NetEventHandler {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let device = self.device.clone();
        let mut dev = device.lock().unwrap_or_else(|e| e.into_inner());
        let starved = if let Some(q) = self.queue_evts.iter().position(|e| e.as_raw_fd() == fd) {
            let _ = self.queue_evts[q].read();
            match q {
                TX_QUEUE => {
                    dev.process_tx();
                    !self.tap_watched
                }
                RX_QUEUE => dev.process_rx(),
                _ => !self.tap_watched,
            }
        } else if fd == self.tap {
            dev.process_rx()
        } else {
            return;
        };
        drop(dev);
        self.watch_tap(!starved, ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        for evt in &self.queue_evts {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                log::error!("virtio-net: cannot watch queue event: {e:?}");
            }
        }
        self.watch_tap(true, ops);
    }
}
