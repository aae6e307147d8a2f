//! The virtio-vsock device model: RX, TX and event queues around the [`Muxer`].

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use thiserror::Error;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::muxer::{Muxer, MuxerError};
use super::packet::{read_packet, rx_capacity, write_packet};
use crate::devices::virtio::{
    ActivateError, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt, read_config_bytes,
};

/// Virtio device type of vsock.
pub const TYPE_VSOCK: u32 = 19;
/// Queues: RX (device → driver), TX (driver → device), event.
pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const EVQ: usize = 2;
const QUEUE_SIZES: &[u16] = &[256, 256, 256];
/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`.
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Errors creating the device.
#[derive(Debug, Error)]
pub enum VsockError {
    #[error("guest CID {0} is reserved (CIDs 0-2 and u32::MAX are not guest CIDs)")]
    BadCid(u64),
    #[error("set up the host socket")]
    Muxer(#[from] MuxerError),
    #[error("create queue event")]
    EventFd(#[source] std::io::Error),
}

struct Active {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    interrupt: Arc<VirtioInterrupt>,
}

/// A virtio-vsock device whose host side is a Unix socket (see [`Muxer`]).
pub struct Vsock {
    guest_cid: u64,
    pub muxer: Muxer,
    acked_features: u64,
    queue_evts: Vec<EventFd>,
    active: Option<Active>,
    /// A transport reset went to the guest and the driver has not yet answered by refilling
    /// the event queue (this is the event queue's available index when the reset was sent);
    /// until it has, new host connections wait (the guest would reset them).
    reset_pending: Option<u16>,
}

impl std::fmt::Debug for Vsock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vsock")
            .field("guest_cid", &self.guest_cid)
            .finish()
    }
}

impl Vsock {
    /// A device for guest `guest_cid` whose host side listens on `uds_path`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, VsockError> {
        if guest_cid <= 2 || guest_cid >= u64::from(u32::MAX) {
            return Err(VsockError::BadCid(guest_cid));
        }
        let queue_evts = QUEUE_SIZES
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(VsockError::EventFd))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            guest_cid,
            muxer: Muxer::new(guest_cid, uds_path)?,
            acked_features: 0,
            queue_evts,
            active: None,
            reset_pending: None,
        })
    }

    /// Moves every packet the guest queued to the host side, then delivers replies.
    pub fn process_tx(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let metrics = self.muxer.metrics.clone();
        let mut used = 0;
        loop {
            let chain = match active.queues[TXQ].iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
                    crate::warn_ratelimited!("vsock: TX queue unusable: {e}");
                    None
                }
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            match chain
                .reader(&active.mem)
                .map_err(|_| None)
                .and_then(|mut r| read_packet(&mut r).map_err(Some))
            {
                Ok(pkt) => {
                    metrics.tx_packets.fetch_add(1, Ordering::Relaxed);
                    self.muxer.send_to_host(pkt);
                }
                Err(why) => {
                    metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
                    crate::warn_ratelimited!("vsock: dropped malformed TX packet ({why:?})");
                }
            }
            if active.queues[TXQ].add_used(&active.mem, head, 0).is_err() {
                break;
            }
            used += 1;
        }
        if used > 0 {
            active.interrupt.signal_used_queue();
        }
        self.process_rx();
    }

    /// Fills the guest's RX buffers with whatever the host side has for it.
    pub fn process_rx(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let metrics = self.muxer.metrics.clone();
        let mut used = 0;
        while self.muxer.has_rx() {
            let chain = match active.queues[RXQ].iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(_) => None,
            };
            // No buffer: the guest notifies the RX queue when it adds some.
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let mut writer = match chain.writer(&active.mem) {
                Ok(w) => w,
                Err(_) => {
                    metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
                    let _ = active.queues[RXQ].add_used(&active.mem, head, 0);
                    used += 1;
                    continue;
                }
            };
            let Some(cap) = rx_capacity(&writer) else {
                metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
                let _ = active.queues[RXQ].add_used(&active.mem, head, 0);
                used += 1;
                continue;
            };
            let Some(pkt) = self.muxer.next_rx(cap) else {
                active.queues[RXQ].go_to_previous_position();
                break;
            };
            let len = write_packet(&mut writer, &pkt).unwrap_or(0);
            metrics.rx_packets.fetch_add(1, Ordering::Relaxed);
            if active.queues[RXQ].add_used(&active.mem, head, len).is_err() {
                break;
            }
            used += 1;
        }
        if used > 0 {
            active.interrupt.signal_used_queue();
        }
    }

    /// Tells the guest driver that every connection is gone (after a snapshot restore) and
    /// drops the host side of all of them.
    pub fn send_transport_reset(&mut self) -> bool {
        self.muxer.reset_all();
        let Some(active) = self.active.as_mut() else {
            return false;
        };
        let Some(chain) = active.queues[EVQ]
            .iter(&active.mem)
            .ok()
            .and_then(|mut it| it.next())
        else {
            return false;
        };
        let head = chain.head_index();
        let ok = chain.writer(&active.mem).is_ok_and(|mut w| {
            std::io::Write::write_all(&mut w, &EVENT_TRANSPORT_RESET.to_le_bytes()).is_ok()
        });
        let _ = active.queues[EVQ].add_used(&active.mem, head, if ok { 4 } else { 0 });
        active.interrupt.signal_used_queue();
        self.reset_pending = ok.then(|| Self::evq_avail_idx(active)).flatten();
        ok && self.reset_pending.is_some()
    }

    fn evq_avail_idx(active: &Active) -> Option<u16> {
        active.queues[EVQ]
            .avail_idx(&active.mem, std::sync::atomic::Ordering::Acquire)
            .ok()
            .map(|w| w.0)
    }

    /// Whether a transport reset is still waiting for the driver (see [`Self::event_queue_notified`]).
    pub fn reset_pending(&self) -> bool {
        self.reset_pending.is_some()
    }

    /// The event queue was notified. Linux's driver notifies after it handled the events it
    /// found (for a transport reset: after resetting every connected socket), when it puts the
    /// buffer back, so the available index has moved. Returns true if that ends a pending
    /// reset; a notification without a new buffer (a spurious one, or the VMM's own kick after a
    /// restore) does not.
    pub fn event_queue_notified(&mut self) -> bool {
        let (Some(sent_at), Some(active)) = (self.reset_pending, self.active.as_ref()) else {
            return false;
        };
        if Self::evq_avail_idx(active).is_some_and(|now| now != sent_at) {
            self.reset_pending = None;
            return true;
        }
        false
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_vsock_config { le64 guest_cid; }
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::warn_ratelimited!("vsock: ignored config write at {offset:#x}");
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), ActivateError> {
        if self.active.is_some() {
            return Err(ActivateError::AlreadyActive);
        }
        if queues.len() != QUEUE_SIZES.len() {
            return Err(ActivateError::QueueCount {
                got: queues.len(),
                want: QUEUE_SIZES.len(),
            });
        }
        self.active = Some(Active {
            mem,
            queues,
            interrupt,
        });
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.muxer.reset_all();
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn active_queue_states(&self) -> Vec<virtio_queue::QueueState> {
        self.active
            .iter()
            .flat_map(|a| a.queues.iter().map(Queue::state))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::vsock::muxer::HOST_CID;
    use crate::devices::virtio::vsock::packet::{HDR_SIZE, Header, TYPE_STREAM, op};
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{RawDescriptor, split::Descriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const GUEST_CID: u64 = 3;

    fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags as u16, next))
    }

    fn sock_path(tag: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("airlock-vsockdev-{tag}-{}", std::process::id()))
    }

    /// An activated device whose RX queue holds one 4 KiB buffer and whose TX queue holds one
    /// packet at 0x40000 (header) + 0x41000 (payload).
    fn setup<'a>(
        mem: &'a GuestMemoryMmap,
        path: &std::path::Path,
        tx_hdr: Header,
        payload: &[u8],
    ) -> (
        Vsock,
        MockSplitQueue<'a, GuestMemoryMmap>,
        Arc<VirtioInterrupt>,
    ) {
        let mut dev = Vsock::new(GUEST_CID, path).unwrap();
        let rxq = MockSplitQueue::create(mem, GuestAddress(0x1000), 16);
        rxq.add_desc_chains(&[desc(0x20000, 4096, VRING_DESC_F_WRITE, 0)], 0)
            .unwrap();
        let txq = MockSplitQueue::create(mem, GuestAddress(0x8000), 16);
        mem.write_slice(&tx_hdr.to_bytes(), GuestAddress(0x40000))
            .unwrap();
        mem.write_slice(payload, GuestAddress(0x41000)).unwrap();
        let chain: Vec<RawDescriptor> = if payload.is_empty() {
            vec![desc(0x40000, HDR_SIZE as u32, 0, 0)]
        } else {
            vec![
                desc(0x40000, HDR_SIZE as u32, VRING_DESC_F_NEXT, 1),
                desc(0x41000, payload.len() as u32, 0, 0),
            ]
        };
        txq.add_desc_chains(&chain, 0).unwrap();
        let evq = MockSplitQueue::create(mem, GuestAddress(0xf000), 16);
        let irq = Arc::new(VirtioInterrupt::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        ));
        let queues: Vec<Queue> = vec![
            rxq.create_queue().unwrap(),
            txq.create_queue().unwrap(),
            evq.create_queue().unwrap(),
        ];
        dev.activate(mem.clone(), queues, irq.clone()).unwrap();
        (dev, rxq, irq)
    }

    fn guest_hdr(op: u16, dst_port: u32, len: u32) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: 1234,
            dst_port,
            len,
            type_: TYPE_STREAM,
            op,
            buf_alloc: 65536,
            ..Header::default()
        }
    }

    #[test]
    fn guest_request_to_a_listening_host_port_is_answered_through_the_rx_queue() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let path = sock_path("request");
        let listener = UnixListener::bind(format!("{}_7000", path.display())).unwrap();
        let (mut dev, rxq, irq) = setup(&mem, &path, guest_hdr(op::REQUEST, 7000, 0), &[]);
        dev.process_tx();
        let used = rxq.used().ring().ref_at(0).unwrap().load();
        assert_eq!(used.len() as usize, HDR_SIZE);
        let mut raw = [0u8; HDR_SIZE];
        mem.read_slice(&mut raw, GuestAddress(0x20000)).unwrap();
        let reply = Header::from_bytes(&raw);
        assert_eq!(
            (reply.op, reply.dst_port, reply.src_port),
            (op::RESPONSE, 1234, 7000)
        );
        assert_eq!((reply.src_cid, reply.dst_cid), (HOST_CID, GUEST_CID));
        assert_ne!(irq.status(), 0);
        assert!(listener.accept().is_ok());
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(format!("{}_7000", path.display()));
    }

    #[test]
    fn payload_longer_than_its_descriptors_is_dropped_and_counted() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let path = sock_path("badlen");
        // The header claims 4096 bytes; the chain carries 16.
        let (mut dev, rxq, _) = setup(&mem, &path, guest_hdr(op::RW, 7000, 4096), &[0u8; 16]);
        dev.process_tx();
        assert_eq!(dev.muxer.metrics.bad_packets.load(Ordering::Relaxed), 1);
        assert_eq!(
            rxq.used().idx().load(),
            0,
            "nothing is sent back for a dropped packet"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn transport_reset_event_reaches_the_event_queue_and_drops_connections() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let path = sock_path("reset");
        let listener = UnixListener::bind(format!("{}_7000", path.display())).unwrap();
        let mut dev = Vsock::new(GUEST_CID, &path).unwrap();
        let rxq = MockSplitQueue::create(&mem, GuestAddress(0x1000), 16);
        rxq.add_desc_chains(&[desc(0x20000, 4096, VRING_DESC_F_WRITE, 0)], 0)
            .unwrap();
        let txq = MockSplitQueue::create(&mem, GuestAddress(0x8000), 16);
        mem.write_slice(
            &guest_hdr(op::REQUEST, 7000, 0).to_bytes(),
            GuestAddress(0x40000),
        )
        .unwrap();
        txq.add_desc_chains(&[desc(0x40000, HDR_SIZE as u32, 0, 0)], 0)
            .unwrap();
        let evq = MockSplitQueue::create(&mem, GuestAddress(0xf000), 16);
        evq.add_desc_chains(&[desc(0x30000, 4, VRING_DESC_F_WRITE, 0)], 0)
            .unwrap();
        let irq = Arc::new(VirtioInterrupt::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        ));
        let queues = vec![
            rxq.create_queue().unwrap(),
            txq.create_queue().unwrap(),
            evq.create_queue().unwrap(),
        ];
        dev.activate(mem.clone(), queues, irq).unwrap();
        dev.process_tx();
        let (mut host, _) = listener.accept().unwrap();
        assert!(dev.send_transport_reset());
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x30000)).unwrap(),
            EVENT_TRANSPORT_RESET
        );
        assert_eq!(evq.used().idx().load(), 1);
        // The host side of the connection is closed: its stream reaches EOF.
        for change in dev.muxer.take_changes() {
            drop(change);
        }
        let mut buf = [0u8; 1];
        assert_eq!(host.read(&mut buf).unwrap(), 0);
        // New host connections wait until the driver has handled the event: a notification
        // without a new event buffer does not count, the driver putting one back does.
        assert!(dev.reset_pending());
        assert!(!dev.event_queue_notified());
        assert!(dev.reset_pending());
        evq.add_desc_chains(&[desc(0x30000, 4, VRING_DESC_F_WRITE, 0)], 1)
            .unwrap();
        assert!(dev.event_queue_notified());
        assert!(!dev.reset_pending());
        assert!(!dev.event_queue_notified());
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(format!("{}_7000", path.display()));
    }
}
