//! The virtio-blk device model.

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use thiserror::Error;
use virtio_bindings::virtio_blk::{VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::layered::LayeredDisk;
use super::metrics::BlockMetrics;
use super::request::{Backing, Disk, RequestType, SECTOR_SIZE, execute};
use crate::devices::virtio::{
    ActivateError, TYPE_BLOCK, VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt, read_config_bytes,
};

/// One request queue of 256 descriptors.
const QUEUE_SIZES: &[u16] = &[256];

/// Data segments one request may carry (`seg_max`): the queue's size less the header and
/// status descriptors. Without it the driver sends one segment per request, so a 128 KiB
/// read-ahead of scattered page-cache pages becomes 32 requests, each a VM exit and an
/// interrupt (on hosts that emulate guest kernel code, each costs milliseconds).
const SEG_MAX: u32 = QUEUE_SIZES[0] as u32 - 2;

/// Errors creating a block device.
#[derive(Debug, Error)]
pub enum BlockError {
    #[error("open disk image {path}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("read size of disk image {path}")]
    Metadata {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("create queue event")]
    EventFd(#[source] std::io::Error),
    #[error("media go only into an empty slot")]
    NotAnEmptySlot,
}

struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<VirtioInterrupt>,
    /// The available ring was invalid; nothing more is processed until the driver resets.
    broken: bool,
}

/// A virtio-blk device backed by a raw image file or a copy-on-write chain.
pub struct Block {
    backing: Backing,
    sectors: u64,
    read_only: bool,
    /// A slot: offered writable whatever its media (features are fixed once the driver has
    /// probed it); media put in read-only refuse writes.
    slot: bool,
    id: Vec<u8>,
    acked_features: u64,
    queue_evts: Vec<EventFd>,
    active: Option<Active>,
    pub metrics: Arc<BlockMetrics>,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("sectors", &self.sectors)
            .field("read_only", &self.read_only)
            .field("layered", &matches!(self.backing, Backing::Layered(_)))
            .field("active", &self.active.is_some())
            .finish()
    }
}

impl Block {
    /// Opens `path` as a disk; `id` is what `VIRTIO_BLK_T_GET_ID` reports (at most 20 bytes).
    pub fn new(path: &Path, read_only: bool, id: &str) -> Result<Self, BlockError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| BlockError::Open {
                path: path.display().to_string(),
                source,
            })?;
        let len = file
            .metadata()
            .map_err(|source| BlockError::Metadata {
                path: path.display().to_string(),
                source,
            })?
            .len();
        Self::from_file(file, len / SECTOR_SIZE, read_only, id)
    }

    /// A device over an open file of `sectors` sectors.
    pub fn from_file(
        file: File,
        sectors: u64,
        read_only: bool,
        id: &str,
    ) -> Result<Self, BlockError> {
        Self::with_backing(Backing::Raw(file), sectors, read_only, id)
    }

    /// A writable device over a copy-on-write chain, of the chain's size.
    pub fn layered(disk: LayeredDisk, id: &str) -> Result<Self, BlockError> {
        let sectors = disk.size_bytes() / SECTOR_SIZE;
        Self::with_backing(Backing::Layered(disk), sectors, false, id)
    }

    fn with_backing(
        backing: Backing,
        sectors: u64,
        read_only: bool,
        id: &str,
    ) -> Result<Self, BlockError> {
        let queue_evts = QUEUE_SIZES
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).map_err(BlockError::EventFd))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            backing,
            sectors,
            read_only,
            slot: false,
            id: id.as_bytes().to_vec(),
            acked_features: 0,
            queue_evts,
            active: None,
            metrics: Arc::new(BlockMetrics::default()),
        })
    }

    /// An empty slot, for media put in later ([`Block::insert_media`]): a template's guest
    /// probes it as a writable disk of no sectors, and a clone's gets its media at restore.
    pub fn slot(id: &str) -> Result<Self, BlockError> {
        let mut b = Self::with_backing(Backing::Empty, 0, false, id)?;
        b.slot = true;
        Ok(b)
    }

    /// Puts `file` into an empty slot as its media (read-only: writes fail); the caller tells
    /// the driver ([`super::super::mmio::MmioTransport::config_changed`]).
    pub fn insert_media(&mut self, file: File, read_only: bool) -> Result<(), BlockError> {
        if !self.slot || !matches!(self.backing, Backing::Empty) {
            return Err(BlockError::NotAnEmptySlot);
        }
        let len = file.metadata().map_err(|source| BlockError::Metadata {
            path: "(slot media)".into(),
            source,
        })?;
        self.sectors = len.len() / SECTOR_SIZE;
        self.read_only = read_only;
        self.backing = Backing::Raw(file);
        Ok(())
    }

    /// Whether it is a slot for media.
    pub fn is_slot(&self) -> bool {
        self.slot
    }

    /// Capacity in sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// The copy-on-write chain, for a layered disk.
    pub fn layered_disk(&self) -> Option<&LayeredDisk> {
        match &self.backing {
            Backing::Layered(d) => Some(d),
            Backing::Raw(_) | Backing::Empty => None,
        }
    }

    /// Serves every request the driver has made available, then interrupts it once.
    pub fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        if active.broken {
            return;
        }
        let mut disk = Disk {
            backing: &mut self.backing,
            sectors: self.sectors,
            read_only: self.read_only,
            id: &self.id,
        };
        let m = &self.metrics;
        let mut completed = 0usize;
        loop {
            if active.queue.disable_notification(&active.mem).is_err() {
                break mark_broken(active, m, "disable notification");
            }
            while let Some(chain) = match active.queue.iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    mark_broken(active, m, &e.to_string());
                    None
                }
            } {
                let head = chain.head_index();
                let used = serve_chain(&mut disk, &active.mem, chain, m);
                if active.queue.add_used(&active.mem, head, used).is_err() {
                    mark_broken(active, m, "add to used ring");
                    break;
                }
                completed += 1;
            }
            if active.broken {
                break;
            }
            match active.queue.enable_notification(&active.mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(_) => break mark_broken(active, m, "enable notification"),
            }
        }
        if completed > 0 && active.queue.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal_used_queue();
        }
    }
}

fn mark_broken(active: &mut Active, metrics: &BlockMetrics, why: &str) {
    active.broken = true;
    metrics.broken_queue.fetch_add(1, Ordering::Relaxed);
    crate::warn_ratelimited!("virtio-blk: queue unusable ({why}); waiting for a device reset");
}

/// Serves one chain; returns the used length. Malformed chains are counted and completed with
/// length 0 so that the ring moves on.
fn serve_chain(
    disk: &mut Disk<'_>,
    mem: &GuestMemoryMmap,
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    m: &BlockMetrics,
) -> u32 {
    let halves = chain
        .clone()
        .reader(mem)
        .and_then(|r| chain.writer(mem).map(|w| (r, w)));
    let result = match halves {
        Ok((reader, writer)) => execute(disk, reader, writer),
        Err(_) => Err(super::request::Malformed::Descriptors),
    };
    match result {
        Ok(out) => {
            m.requests.fetch_add(1, Ordering::Relaxed);
            m.read_bytes.fetch_add(out.read_bytes, Ordering::Relaxed);
            m.write_bytes
                .fetch_add(out.written_bytes, Ordering::Relaxed);
            match out.kind {
                Some(RequestType::Flush) => {
                    m.flushes.fetch_add(1, Ordering::Relaxed);
                }
                Some(RequestType::Unsupported(t)) => {
                    m.unsupported.fetch_add(1, Ordering::Relaxed);
                    crate::warn_ratelimited!("virtio-blk: unsupported request type {t}");
                }
                _ => {}
            }
            if out.status == virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8 {
                m.io_errors.fetch_add(1, Ordering::Relaxed);
            }
            if out.over_quota {
                m.over_quota.fetch_add(1, Ordering::Relaxed);
                crate::warn_ratelimited!("virtio-blk: a write past the disk's quota refused");
            }
            out.used_len
        }
        Err(why) => {
            m.malformed.fetch_add(1, Ordering::Relaxed);
            crate::warn_ratelimited!("virtio-blk: malformed request ({why:?}) dropped");
            0
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn avail_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_BLK_F_SEG_MAX);
        if self.read_only && !self.slot {
            f |= 1 << VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << VIRTIO_BLK_F_FLUSH;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config: `le64 capacity`, `le32 size_max` (not offered), `le32
        // seg_max`; nothing after it is offered.
        let mut config = [0u8; 16];
        config[..8].copy_from_slice(&self.sectors.to_le_bytes());
        config[12..].copy_from_slice(&SEG_MAX.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        crate::warn_ratelimited!("virtio-blk: ignored config write at {offset:#x}");
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
        let Some(queue) = queues
            .into_iter()
            .next()
            .filter(|_| got == QUEUE_SIZES.len())
        else {
            return Err(ActivateError::QueueCount {
                got,
                want: QUEUE_SIZES.len(),
            });
        };
        self.active = Some(Active {
            mem,
            queue,
            interrupt,
            broken: false,
        });
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn active_queue_states(&self) -> Vec<virtio_queue::QueueState> {
        self.active.iter().map(|a| a.queue.state()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::block::RequestHeader;
    use std::io::{Seek, Write};
    use virtio_bindings::virtio_blk::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{RawDescriptor, split::Descriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};

    const HDR: u64 = 0x10_000;
    const DATA: u64 = 0x20_000;
    const STATUS: u64 = 0x30_000;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn disk_file(bytes: &[u8]) -> File {
        let mut f = tempfile();
        f.write_all(bytes).unwrap();
        f.rewind().unwrap();
        f
    }

    fn tempfile() -> File {
        vmm_sys_util::tempfile::TempFile::new().unwrap().into_file()
    }

    fn desc(addr: u64, len: u32, flags: u32, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags as u16, next))
    }

    /// Builds a block device activated on `m` with one chain made of `descs`.
    fn run(
        m: &GuestMemoryMmap,
        dev: &mut Block,
        descs: &[RawDescriptor],
    ) -> (u32, Arc<VirtioInterrupt>) {
        let vq = MockSplitQueue::new(m, 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let q: Queue = vq.create_queue().unwrap();
        let irq = Arc::new(VirtioInterrupt::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        ));
        dev.activate(m.clone(), vec![q], irq.clone()).unwrap();
        dev.process_queue();
        let used_len = vq.used().ring().ref_at(0).unwrap().load().len();
        (used_len, irq)
    }

    fn header(m: &GuestMemoryMmap, t: u32, sector: u64) {
        m.write_obj(
            RequestHeader {
                request_type: t,
                reserved: 0,
                sector,
            },
            GuestAddress(HDR),
        )
        .unwrap();
    }

    fn status(m: &GuestMemoryMmap) -> u32 {
        u32::from(m.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
    }

    #[test]
    fn read_request_copies_sectors_into_guest_memory() {
        let m = mem();
        let mut image = vec![0u8; 2048];
        image[512..1024].fill(0xab);
        let mut dev = Block::from_file(disk_file(&image), 4, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 1);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        let (used, irq) = run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_OK);
        assert_eq!(used, 513);
        let mut buf = [0u8; 512];
        m.read_slice(&mut buf, GuestAddress(DATA)).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        assert_eq!(irq.status(), crate::devices::virtio::INT_VRING);
        assert_eq!(dev.metrics.read_bytes.load(Ordering::Relaxed), 512);
    }

    /// With `seg_max` offered, one request carries several scattered data buffers: a read
    /// fills them in chain order, whatever their addresses.
    #[test]
    fn a_request_of_several_segments_moves_them_in_order() {
        let m = mem();
        let mut image = vec![0u8; 4096];
        for (i, sector) in image.chunks_mut(512).enumerate() {
            sector.fill(i as u8 + 1);
        }
        let mut dev = Block::from_file(disk_file(&image), 8, false, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 2);
        // Sectors 2..5 into three buffers out of address order: 512 + 1024 + 512 bytes.
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(
                DATA + 0x8000,
                512,
                VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                2,
            ),
            desc(DATA, 1024, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 3),
            desc(
                DATA + 0x4000,
                512,
                VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                4,
            ),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        let (used, _) = run(&m, &mut dev, &chain);
        assert_eq!((status(&m), used), (VIRTIO_BLK_S_OK, 2049));
        let mut seg = vec![0u8; 1024];
        m.read_slice(&mut seg[..512], GuestAddress(DATA + 0x8000))
            .unwrap();
        assert!(seg[..512].iter().all(|b| *b == 3));
        m.read_slice(&mut seg, GuestAddress(DATA)).unwrap();
        assert!(seg[..512].iter().all(|b| *b == 4) && seg[512..].iter().all(|b| *b == 5));
        m.read_slice(&mut seg[..512], GuestAddress(DATA + 0x4000))
            .unwrap();
        assert!(seg[..512].iter().all(|b| *b == 6));
    }

    #[test]
    fn write_request_reaches_the_file() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 2048]), 4, false, "vdb").unwrap();
        header(&m, VIRTIO_BLK_T_OUT, 2);
        m.write_slice(&[0x5a; 512], GuestAddress(DATA)).unwrap();
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 512, VRING_DESC_F_NEXT, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_OK);
        let mut buf = [0u8; 512];
        let Backing::Raw(file) = &dev.backing else {
            panic!("a raw disk")
        };
        std::os::unix::fs::FileExt::read_exact_at(file, &mut buf, 1024).unwrap();
        assert!(buf.iter().all(|b| *b == 0x5a));
    }

    #[test]
    fn a_layered_disk_takes_writes_into_its_overlay_until_its_quota() {
        use crate::devices::virtio::block::layered::{BLOCK_SIZE, LayeredDisk};
        let m = mem();
        let base = disk_file(&[0x11u8; 4 * BLOCK_SIZE as usize]);
        let overlay = tempfile();
        let disk = LayeredDisk::new(
            base.try_clone().unwrap(),
            None,
            overlay.try_clone().unwrap(),
            BLOCK_SIZE,
        )
        .unwrap();
        let mut dev = Block::layered(disk, "vda").unwrap();
        assert_eq!(dev.sectors(), 4 * BLOCK_SIZE / SECTOR_SIZE);
        assert_eq!(dev.avail_features() & (1 << VIRTIO_BLK_F_RO), 0, "writable");
        let write = |dev: &mut Block, sector: u64, byte: u8| {
            header(&m, VIRTIO_BLK_T_OUT, sector);
            m.write_slice(&[byte; 512], GuestAddress(DATA)).unwrap();
            let chain = [
                desc(HDR, 16, VRING_DESC_F_NEXT, 1),
                desc(DATA, 512, VRING_DESC_F_NEXT, 2),
                desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
            ];
            dev.reset();
            run(&m, dev, &chain);
            status(&m)
        };
        // One block fits the quota (the sector's block is copied up, then written).
        assert_eq!(write(&mut dev, 1, 0x22), VIRTIO_BLK_S_OK);
        assert_eq!(
            write(&mut dev, 2, 0x23),
            VIRTIO_BLK_S_OK,
            "the same block again"
        );
        // A second block does not: an I/O error, counted.
        assert_eq!(write(&mut dev, 9, 0x33), VIRTIO_BLK_S_IOERR);
        assert_eq!(dev.metrics.over_quota.load(Ordering::Relaxed), 1);
        assert_eq!(overlay.metadata().unwrap().len(), BLOCK_SIZE);
        // Reads see the write over the base; the base is untouched.
        header(&m, VIRTIO_BLK_T_IN, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 2048, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        dev.reset();
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_OK);
        let mut got = [0u8; 2048];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got[..512].iter().all(|b| *b == 0x11));
        assert!(got[512..1024].iter().all(|b| *b == 0x22));
        assert!(got[1024..1536].iter().all(|b| *b == 0x23));
        let mut first = [0u8; 1536];
        std::os::unix::fs::FileExt::read_exact_at(&base, &mut first, 0).unwrap();
        assert!(
            first.iter().all(|b| *b == 0x11),
            "the base is never written"
        );
    }

    #[test]
    fn write_to_read_only_disk_is_an_io_error() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 2048]), 4, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_OUT, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 512, VRING_DESC_F_NEXT, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_IOERR);
        assert_eq!(dev.metrics.io_errors.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn read_past_the_end_is_an_io_error() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 2048]), 4, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 4);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn huge_sector_number_does_not_overflow() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 2048]), 4, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, u64::MAX);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 512, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn unknown_type_is_unsupported() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 512]), 1, true, "vda").unwrap();
        header(&m, 0x7777, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_UNSUPP);
        assert_eq!(dev.metrics.unsupported.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn get_id_writes_the_serial() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 512]), 1, true, "airlock-root").unwrap();
        header(&m, VIRTIO_BLK_T_GET_ID, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 20, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        let mut id = [0u8; 12];
        m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"airlock-root");
    }

    #[test]
    fn chain_without_status_byte_is_malformed_and_completed_empty() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 512]), 1, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let (used, _) = run(&m, &mut dev, &[desc(HDR, 16, 0, 0)]);
        assert_eq!(used, 0);
        assert_eq!(dev.metrics.malformed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn short_header_is_malformed() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 512]), 1, true, "vda").unwrap();
        let chain = [
            desc(HDR, 8, VRING_DESC_F_NEXT, 1),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(dev.metrics.malformed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn descriptor_outside_guest_memory_is_malformed_not_a_panic() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 512]), 1, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(
                0xffff_0000_0000,
                512,
                VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                2,
            ),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        let (used, _) = run(&m, &mut dev, &chain);
        assert_eq!(used, 0);
        assert_eq!(dev.metrics.malformed.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn unaligned_data_length_is_an_io_error() {
        let m = mem();
        let mut dev = Block::from_file(disk_file(&[0u8; 2048]), 4, true, "vda").unwrap();
        header(&m, VIRTIO_BLK_T_IN, 0);
        let chain = [
            desc(HDR, 16, VRING_DESC_F_NEXT, 1),
            desc(DATA, 100, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE, 2),
            desc(STATUS, 1, VRING_DESC_F_WRITE, 0),
        ];
        run(&m, &mut dev, &chain);
        assert_eq!(status(&m), VIRTIO_BLK_S_IOERR);
    }

    #[test]
    fn features_reflect_read_only() {
        let ro = Block::from_file(tempfile(), 0, true, "a").unwrap();
        let rw = Block::from_file(tempfile(), 0, false, "b").unwrap();
        assert_ne!(ro.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(rw.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_ne!(rw.avail_features() & (1 << VIRTIO_BLK_F_FLUSH), 0);
    }

    #[test]
    fn config_reports_capacity() {
        let dev = Block::from_file(tempfile(), 0x1234, true, "a").unwrap();
        let mut b = [0u8; 8];
        dev.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 0x1234);
    }

    #[test]
    fn config_offers_seg_max_and_nothing_past_it() {
        let dev = Block::from_file(tempfile(), 8, true, "a").unwrap();
        assert_ne!(dev.avail_features() & (1 << VIRTIO_BLK_F_SEG_MAX), 0);
        let mut b = [0xffu8; 4];
        dev.read_config(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), u32::from(QUEUE_SIZES[0]) - 2);
        // size_max (offset 8) is not offered, and the geometry after seg_max reads as zero.
        dev.read_config(8, &mut b);
        assert_eq!(b, [0; 4]);
        dev.read_config(16, &mut b);
        assert_eq!(b, [0; 4]);
    }

    #[test]
    fn inactive_device_ignores_notifications() {
        let mut dev = Block::from_file(tempfile(), 0, true, "a").unwrap();
        dev.process_queue();
        assert_eq!(dev.metrics.requests.load(Ordering::Relaxed), 0);
    }
}
