//! Wires a vsock device into the VMM's event loop: its three queue events, the host listener,
//! and every host stream, with poll interest following each connection's state.

use std::collections::HashSet;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vmm_sys_util::eventfd::EventFd;

use super::device::{EVQ, RXQ, TXQ, Vsock};
use super::muxer::FdChange;
use crate::devices::virtio::VirtioDevice;

/// Event-loop subscriber of one vsock device.
#[derive(Debug)]
pub struct VsockEventHandler {
    device: Arc<Mutex<Vsock>>,
    queue_evts: Vec<EventFd>,
    /// Host fds currently registered with the event loop.
    registered: HashSet<RawFd>,
    /// Whether the host listener is watched (not while a transport reset is pending).
    listening: bool,
}

impl VsockEventHandler {
    /// Watches `device`'s queue events (clones of its eventfds) and host sockets.
    pub fn new(device: Arc<Mutex<Vsock>>) -> std::io::Result<Self> {
        let queue_evts = {
            let dev = device.lock().unwrap_or_else(|e| e.into_inner());
            dev.queue_events()
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(Self {
            device,
            queue_evts,
            registered: HashSet::new(),
            listening: false,
        })
    }

    fn watch_listener(&mut self, dev: &Vsock, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(dev.muxer.listener_fd(), EventSet::IN)) {
            log::error!("vsock: cannot watch the host socket: {e:?}");
        }
        self.listening = true;
    }

    fn apply_changes(&mut self, dev: &mut Vsock, ops: &mut EventOps) {
        for change in dev.muxer.take_changes() {
            match change {
                FdChange::Watch(fd, interest) => {
                    let mut set = EventSet::empty();
                    if interest.read {
                        set |= EventSet::IN;
                    }
                    if interest.write {
                        set |= EventSet::OUT;
                    }
                    self.set_interest(fd, set, ops);
                }
                FdChange::Forget(stream) => {
                    self.set_interest(stream.as_raw_fd(), EventSet::empty(), ops);
                    drop(stream); // closed only after epoll stopped watching it
                }
            }
        }
    }

    /// No interest means not registered at all: a hung-up stream would otherwise report
    /// EPOLLHUP forever while we wait for guest credit.
    fn set_interest(&mut self, fd: RawFd, set: EventSet, ops: &mut EventOps) {
        let was = self.registered.contains(&fd);
        let result = match (was, set.is_empty()) {
            (false, true) => Ok(()),
            (true, true) => {
                self.registered.remove(&fd);
                ops.remove(Events::new_raw(fd, EventSet::empty()))
            }
            (false, false) => {
                self.registered.insert(fd);
                ops.add(Events::new_raw(fd, set))
            }
            (true, false) => ops.modify(Events::new_raw(fd, set)),
        };
        if let Err(e) = result {
            log::error!("vsock: update poll interest of fd {fd}: {e:?}");
        }
    }
}

impl MutEventSubscriber for VsockEventHandler {
    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        let set = events.event_set();
        let device = self.device.clone();
        let mut dev = device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(q) = self.queue_evts.iter().position(|e| e.as_raw_fd() == fd) {
            let _ = self.queue_evts[q].read();
            match q {
                RXQ => dev.process_rx(),
                TXQ => dev.process_tx(),
                // The driver put event buffers back: after a transport reset, that means it has
                // reset its sockets, and host connections can come in again.
                EVQ if dev.event_queue_notified() && !self.listening => {
                    log::info!("vsock: the guest handled the transport reset");
                    self.watch_listener(&dev, ops);
                }
                _ => {}
            }
        } else if dev.muxer.owns_fd(fd) {
            let readable = set.intersects(
                EventSet::IN | EventSet::HANG_UP | EventSet::ERROR | EventSet::READ_HANG_UP,
            );
            let writable = set.intersects(EventSet::OUT | EventSet::ERROR);
            dev.muxer.handle_fd_event(fd, readable, writable);
            dev.process_rx();
        }
        self.apply_changes(&mut dev, ops);
    }

    fn init(&mut self, ops: &mut EventOps) {
        for evt in &self.queue_evts {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                log::error!("vsock: cannot watch queue event: {e:?}");
            }
        }
        let device = self.device.clone();
        let dev = device.lock().unwrap_or_else(|e| e.into_inner());
        if !dev.reset_pending() {
            self.watch_listener(&dev, ops);
        }
    }
}
