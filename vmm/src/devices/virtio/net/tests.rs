//! The device against mock queues in guest memory, with a datagram socket pair as its "tap"
//! (one frame per read and write, as a TAP device gives).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::Queue;
use virtio_queue::desc::{RawDescriptor, split::Descriptor};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::devices::virtio::{INT_VRING, VirtioDevice, VirtioInterrupt};

const MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const RXQ_AT: u64 = 0;
const TXQ_AT: u64 = 0x8000;
const BUF: u64 = 0x10_0000;

struct Rig<'a> {
    rx: MockSplitQueue<'a, GuestMemoryMmap>,
    tx: MockSplitQueue<'a, GuestMemoryMmap>,
    dev: Net,
    peer: UnixDatagram,
    irq: Arc<VirtioInterrupt>,
}

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap()
}

fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags as u16, next))
}

fn rig(mem: &GuestMemoryMmap) -> Rig<'_> {
    let (ours, peer) = UnixDatagram::pair().unwrap();
    let dev = Net::new(OwnedFd::from(ours), MAC).unwrap();
    let rx = MockSplitQueue::create(mem, GuestAddress(RXQ_AT), 16);
    let tx = MockSplitQueue::create(mem, GuestAddress(TXQ_AT), 16);
    let irq = Arc::new(VirtioInterrupt::new(
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    ));
    let mut rig = Rig {
        rx,
        tx,
        dev,
        peer,
        irq,
    };
    let queues: Vec<Queue> = vec![
        rig.rx.create_queue().unwrap(),
        rig.tx.create_queue().unwrap(),
    ];
    rig.dev
        .activate(mem.clone(), queues, rig.irq.clone())
        .unwrap();
    rig
}

fn frame(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[test]
fn a_transmitted_frame_reaches_the_tap_without_its_header() {
    let m = mem();
    let mut r = rig(&m);
    let f = frame(200);
    m.write_slice(&[0u8; NET_HDR_LEN], GuestAddress(BUF))
        .unwrap();
    m.write_slice(&f, GuestAddress(BUF + 0x1000)).unwrap();
    r.tx.add_desc_chains(
        &[
            desc(BUF, NET_HDR_LEN as u32, VRING_DESC_F_NEXT, 1),
            desc(BUF + 0x1000, 200, 0, 0),
        ],
        0,
    )
    .unwrap();
    r.dev.process_tx();
    let mut got = [0u8; 2048];
    let n = r.peer.recv(&mut got).unwrap();
    assert_eq!(&got[..n], &f[..]);
    assert_eq!(r.tx.used().idx().load(), 1);
    assert_eq!(r.irq.status(), INT_VRING);
    assert_eq!(r.dev.metrics.tx_frames.load(Ordering::Relaxed), 1);
    assert_eq!(r.dev.metrics.tx_bytes.load(Ordering::Relaxed), 200);
}

#[test]
fn a_received_frame_lands_in_a_guest_buffer_after_a_header() {
    let m = mem();
    let mut r = rig(&m);
    r.rx.add_desc_chains(&[desc(BUF, 1526, VRING_DESC_F_WRITE, 0)], 0)
        .unwrap();
    let f = frame(MAX_FRAME);
    r.peer.send(&f).unwrap();
    assert!(!r.dev.process_rx(), "nothing should wait");
    let used = r.rx.used().ring().ref_at(0).unwrap().load();
    assert_eq!(used.len() as usize, NET_HDR_LEN + f.len());
    let mut hdr = [0u8; NET_HDR_LEN];
    m.read_slice(&mut hdr, GuestAddress(BUF)).unwrap();
    assert_eq!(u16::from_le_bytes([hdr[10], hdr[11]]), 1, "num_buffers");
    let mut back = vec![0u8; f.len()];
    m.read_slice(&mut back, GuestAddress(BUF + NET_HDR_LEN as u64))
        .unwrap();
    assert_eq!(back, f);
    assert_eq!(r.irq.status(), INT_VRING);
}

#[test]
fn a_frame_waits_for_buffers_and_is_delivered_once_they_come() {
    let m = mem();
    let mut r = rig(&m);
    r.peer.send(&frame(60)).unwrap();
    r.peer.send(&frame(61)).unwrap();
    assert!(r.dev.process_rx(), "no buffers: the frame waits");
    assert_eq!(r.rx.used().idx().load(), 0);
    r.rx.add_desc_chains(
        &[
            desc(BUF, 1526, VRING_DESC_F_WRITE, 0),
            desc(BUF + 0x1000, 1526, VRING_DESC_F_WRITE, 0),
        ],
        0,
    )
    .unwrap();
    assert!(!r.dev.process_rx());
    assert_eq!(r.rx.used().idx().load(), 2);
    let lens: Vec<u32> = (0..2)
        .map(|i| r.rx.used().ring().ref_at(i).unwrap().load().len())
        .collect();
    assert_eq!(lens, [(NET_HDR_LEN + 60) as u32, (NET_HDR_LEN + 61) as u32]);
}

#[test]
fn a_buffer_too_small_drops_the_frame_and_goes_back() {
    let m = mem();
    let mut r = rig(&m);
    r.rx.add_desc_chains(&[desc(BUF, 100, VRING_DESC_F_WRITE, 0)], 0)
        .unwrap();
    r.peer.send(&frame(500)).unwrap();
    assert!(!r.dev.process_rx());
    assert_eq!(r.rx.used().ring().ref_at(0).unwrap().load().len(), 0);
    assert_eq!(r.dev.metrics.rx_dropped.load(Ordering::Relaxed), 1);
}

#[test]
fn hostile_transmit_chains_are_dropped_without_reaching_the_tap() {
    let m = mem();
    let mut r = rig(&m);
    r.tx.add_desc_chains(
        &[
            // Shorter than the header.
            desc(BUF, 4, 0, 0),
            // Longer than any frame.
            desc(BUF, 65536, 0, 0),
            // A write-only buffer: nothing to send.
            desc(BUF, 100, VRING_DESC_F_WRITE, 0),
            // Outside guest memory.
            desc(64 << 20, 100, 0, 0),
        ],
        0,
    )
    .unwrap();
    r.dev.process_tx();
    assert_eq!(r.tx.used().idx().load(), 4, "every chain completed");
    assert_eq!(r.dev.metrics.tx_malformed.load(Ordering::Relaxed), 4);
    r.peer.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    assert!(r.peer.recv(&mut buf).is_err(), "nothing was sent");
}

#[test]
fn a_card_that_is_down_drops_what_arrives() {
    let (ours, peer) = UnixDatagram::pair().unwrap();
    let mut dev = Net::new(OwnedFd::from(ours), MAC).unwrap();
    peer.send(&frame(60)).unwrap();
    peer.send(&frame(60)).unwrap();
    assert!(!dev.process_rx());
    assert_eq!(dev.metrics.rx_dropped.load(Ordering::Relaxed), 2);
    dev.process_tx(); // nothing to do, and no panic
}

#[test]
fn config_space_holds_the_mac_and_features_are_minimal() {
    let (ours, _peer) = UnixDatagram::pair().unwrap();
    let dev = Net::new(OwnedFd::from(ours), MAC).unwrap();
    let mut cfg = [0u8; 8];
    dev.read_config(0, &mut cfg);
    assert_eq!(&cfg[..6], &MAC);
    assert_eq!(&cfg[6..], &[0, 0]);
    assert_eq!(dev.device_type(), TYPE_NET);
    assert_eq!(dev.avail_features(), (1 << 32) | (1 << 5));
}

#[test]
fn macs_parse_and_print() {
    assert_eq!(parse_mac("02:00:00:00:00:01"), Some(MAC));
    assert_eq!(format_mac(&MAC), "02:00:00:00:00:01");
    assert_eq!(parse_mac("03:00:00:00:00:01"), None, "multicast");
    assert_eq!(parse_mac("02:00:00:00:00"), None);
    assert_eq!(parse_mac("02:00:00:00:00:01:02"), None);
    assert_eq!(parse_mac("02:00:00:00:00:zz"), None);
}
