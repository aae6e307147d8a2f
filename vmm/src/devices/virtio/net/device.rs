//! The virtio-net device model over a TAP descriptor.
//!
//! The backend is any descriptor that carries one Ethernet frame per `read`/`write`: a TAP
//! device opened with `IFF_TAP | IFF_NO_PI` (without `IFF_VNET_HDR`), inherited from whoever
//! prepared the sandbox's network (the VMM never opens `/dev/net/tun`), or, in tests, a
//! datagram socket pair. No offloads are offered: every frame is at most 1514 bytes plus the
//! 12-byte `virtio_net_hdr_v1`, which the device adds on receive and strips on transmit.
//!
//! Receive (tap → guest): frames are read while the guest has buffers; a frame read while it
//! has none waits in the read buffer (no copy) until the guest adds some (the rx queue
//! notification), and the tap is not read meanwhile (the kernel queues or drops, as for a slow
//! NIC). Transmit (guest →
//! tap): each chain is one frame. A malformed or oversized chain is completed with length 0 and
//! counted; a ring that cannot be read marks the queue broken until the driver resets it.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use thiserror::Error;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::NetMetrics;
use crate::devices::virtio::{
    ActivateError, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt, read_config_bytes,
};

/// Virtio device type of a network card.
pub const TYPE_NET: u32 = 1;
/// `VIRTIO_NET_F_MAC`: the device gives the driver its MAC address in config space.
const VIRTIO_NET_F_MAC: u32 = 5;
/// The size of `virtio_net_hdr_v1` (with `num_buffers`, always present with VERSION_1).
pub const NET_HDR_LEN: usize = 12;
/// The largest Ethernet frame without offloads: 1500 bytes of payload, 14 of header.
pub const MAX_FRAME: usize = 1514;
/// The largest transmit chain taken: a header and the largest frame (a little slack for a
/// VLAN tag the guest may add).
const MAX_TX_CHAIN: usize = NET_HDR_LEN + MAX_FRAME + 4;
/// Queue 0 receives, queue 1 transmits; 256 descriptors each.
const QUEUE_SIZES: &[u16] = &[256, 256];
const RX: usize = 0;
const TX: usize = 1;

/// Errors creating a network device.
#[derive(Debug, Error)]
pub enum NetError {
    #[error("make the TAP descriptor non-blocking")]
    NonBlocking(#[source] std::io::Error),
    #[error("create queue event")]
    EventFd(#[source] std::io::Error),
}

struct Active {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
    interrupt: Arc<VirtioInterrupt>,
    /// A ring was invalid; nothing more is processed until the driver resets.
    broken: bool,
}

/// A virtio-net device on a TAP descriptor.
pub struct Net {
    tap: File,
    mac: [u8; 6],
    acked_features: u64,
    queue_evts: Vec<EventFd>,
    active: Option<Active>,
    /// The length of a frame in `frame` that waits for a receive buffer (the tap is not read
    /// meanwhile, so the buffer holds it without a copy).
    pending: Option<usize>,
    /// The frame last read from the tap.
    frame: Vec<u8>,
    pub metrics: Arc<NetMetrics>,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("tap", &self.tap.as_raw_fd())
            .field("mac", &format_mac(&self.mac))
            .field("active", &self.active.is_some())
            .finish()
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff` (a unicast address: the lowest bit of the first byte clear).
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    (parts.next().is_none() && mac[0] & 1 == 0).then_some(mac)
}

impl Net {
    /// A device on `tap` (made non-blocking here) with the MAC address `mac`.
    pub fn new(tap: OwnedFd, mac: [u8; 6]) -> Result<Self, NetError> {
        set_nonblocking(tap.as_raw_fd()).map_err(NetError::NonBlocking)?;
        let queue_evts = QUEUE_SIZES
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(NetError::EventFd))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            tap: File::from(tap),
            mac,
            acked_features: 0,
            queue_evts,
            active: None,
            pending: None,
            frame: vec![0u8; 65536],
            metrics: Arc::new(NetMetrics::default()),
        })
    }

    /// The MAC address the guest is given.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The TAP descriptor, for the event loop.
    pub fn tap_fd(&self) -> RawFd {
        self.tap.as_raw_fd()
    }

    /// Moves frames from the tap into the guest's receive buffers until either runs out.
    /// Returns whether a frame waits for buffers.
    pub fn process_rx(&mut self) -> bool {
        let Some(active) = self.active.as_mut().filter(|a| !a.broken) else {
            // A card that is down (not yet activated, reset, or broken) drops what arrives,
            // so that the tap does not stay readable.
            self.drain_tap();
            return false;
        };
        let m = &self.metrics;
        let mut delivered = 0usize;
        loop {
            let len = match self.pending.take() {
                Some(n) => n,
                None => match self.tap.read(&mut self.frame) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        m.tap_errors.fetch_add(1, Ordering::Relaxed);
                        crate::warn_ratelimited!("virtio-net: reading the tap: {e}");
                        break;
                    }
                },
            };
            let chain = match active.rx.iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    mark_broken(active, m, &e.to_string());
                    return false;
                }
            };
            let Some(chain) = chain else {
                // No buffer: keep the frame until the driver adds some (it notifies the rx
                // queue, whose notifications stay enabled).
                self.pending = Some(len);
                break;
            };
            let frame = self.frame.get(..len).unwrap_or_default();
            let head = chain.head_index();
            let used = match chain.writer(&active.mem) {
                Ok(mut w) if w.available_bytes() >= NET_HDR_LEN + frame.len() => {
                    let mut hdr = [0u8; NET_HDR_LEN];
                    // num_buffers = 1 (the last two bytes of virtio_net_hdr_v1).
                    hdr[10] = 1;
                    match w.write_all(&hdr).and_then(|()| w.write_all(frame)) {
                        Ok(()) => {
                            m.rx_frames.fetch_add(1, Ordering::Relaxed);
                            m.rx_bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
                            (NET_HDR_LEN + frame.len()) as u32
                        }
                        Err(_) => {
                            m.rx_dropped.fetch_add(1, Ordering::Relaxed);
                            0
                        }
                    }
                }
                _ => {
                    // Too small or unwritable: the frame is dropped, the buffer goes back.
                    m.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    0
                }
            };
            if active.rx.add_used(&active.mem, head, used).is_err() {
                mark_broken(active, m, "add to the rx used ring");
                return false;
            }
            delivered += 1;
        }
        if delivered > 0 && active.rx.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal_used_queue();
        }
        self.pending.is_some()
    }

    /// Reads and drops every frame waiting on the tap.
    fn drain_tap(&mut self) {
        self.pending = None;
        loop {
            match self.tap.read(&mut self.frame) {
                Ok(0) => break,
                Ok(_) => {
                    self.metrics.rx_dropped.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }

    /// Sends every frame the guest has queued for transmission.
    pub fn process_tx(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        if active.broken {
            return;
        }
        let m = &self.metrics;
        let mut completed = 0usize;
        let mut buf = [0u8; MAX_TX_CHAIN];
        loop {
            if active.tx.disable_notification(&active.mem).is_err() {
                break mark_broken(active, m, "disable tx notification");
            }
            loop {
                let chain = match active.tx.iter(&active.mem) {
                    Ok(mut it) => it.next(),
                    Err(e) => {
                        mark_broken(active, m, &e.to_string());
                        None
                    }
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                match chain.reader(&active.mem) {
                    Ok(mut r) if (NET_HDR_LEN..=MAX_TX_CHAIN).contains(&r.available_bytes()) => {
                        let len = r.available_bytes();
                        match r.read_exact(&mut buf[..len]) {
                            Ok(()) => send_frame(&mut self.tap, &buf[NET_HDR_LEN..len], m),
                            Err(_) => {
                                m.tx_malformed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    _ => {
                        m.tx_malformed.fetch_add(1, Ordering::Relaxed);
                        crate::warn_ratelimited!("virtio-net: malformed tx chain dropped");
                    }
                }
                if active.tx.add_used(&active.mem, head, 0).is_err() {
                    mark_broken(active, m, "add to the tx used ring");
                    break;
                }
                completed += 1;
            }
            if active.broken {
                break;
            }
            match active.tx.enable_notification(&active.mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(_) => break mark_broken(active, m, "enable tx notification"),
            }
        }
        if completed > 0 && active.tx.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal_used_queue();
        }
    }
}

/// Writes one frame to the tap; a full or failing tap drops it (as a wire would).
fn send_frame(tap: &mut File, frame: &[u8], m: &NetMetrics) {
    if frame.is_empty() {
        m.tx_malformed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    // A TAP takes a frame whole or not at all.
    match tap.write(frame) {
        Ok(n) if n == frame.len() => {
            m.tx_frames.fetch_add(1, Ordering::Relaxed);
            m.tx_bytes.fetch_add(frame.len() as u64, Ordering::Relaxed);
        }
        Ok(_) => {
            m.tx_dropped.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            m.tx_dropped.fetch_add(1, Ordering::Relaxed);
            if e.kind() != ErrorKind::WouldBlock {
                crate::warn_ratelimited!("virtio-net: writing to the tap: {e}");
            }
        }
    }
}

fn mark_broken(active: &mut Active, metrics: &NetMetrics, why: &str) {
    active.broken = true;
    metrics.broken_queue.fetch_add(1, Ordering::Relaxed);
    crate::warn_ratelimited!("virtio-net: queue unusable ({why}); waiting for a device reset");
}

fn set_nonblocking(fd: RawFd) -> std::io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: ioctl(FIONBIO) on a descriptor we own reads one c_int from a live local. (FIONBIO,
    // not fcntl(F_SETFL): a pool process builds the device under its seccomp filter, which
    // allows this one.)
    if unsafe { libc::ioctl(fd, libc::FIONBIO, &on) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        (1u64 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_MAC)
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config starts with `u8 mac[6]`; nothing else is offered.
        read_config_bytes(&self.mac, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::warn_ratelimited!("virtio-net: ignored config write at {offset:#x}");
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
        let got = queues.len();
        if got != QUEUE_SIZES.len() {
            return Err(ActivateError::QueueCount {
                got,
                want: QUEUE_SIZES.len(),
            });
        }
        let mut it = queues.into_iter();
        let (Some(rx), Some(tx)) = (it.next(), it.next()) else {
            return Err(ActivateError::QueueCount {
                got,
                want: QUEUE_SIZES.len(),
            });
        };
        self.active = Some(Active {
            mem,
            rx,
            tx,
            interrupt,
            broken: false,
        });
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.pending = None;
        self.acked_features = 0;
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
            .flat_map(|a| [a.rx.state(), a.tx.state()])
            .collect()
    }
}

/// Queue indices, for the event handler.
pub const RX_QUEUE: usize = RX;
pub const TX_QUEUE: usize = TX;
