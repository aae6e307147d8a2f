//! Copy-on-write disks: a read-only base image under at most one read-only layer (a
//! template's) and one writable overlay of this VMM's own.
//!
//! A layer holds whole blocks of [`BLOCK_SIZE`] bytes, packed: slot `i` of its data file holds
//! the virtual block that entry `i` of its map names. A read takes each block from the topmost
//! layer that has it, else from the base. The overlay gets a block the first time the guest
//! writes to it (appended: a partial write first copies the rest of the block up from below),
//! and never more blocks than its quota: past it, a write that needs a new block fails (the
//! request ends in `VIRTIO_BLK_S_IOERR`), so the overlay's file never grows past the quota,
//! whatever the guest does, and its size is what `RLIMIT_FSIZE` can bound. A snapshot writes
//! every block of the layer and the overlay into one new layer ([`LayeredDisk::write_layer`]),
//! so a chain is never deeper than base, layer, overlay.
//!
//! The overlay lives as long as its VMM (a sandbox's writes): a flush makes nothing durable,
//! and none is needed. A layer written for a snapshot is synced before the snapshot is
//! complete.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use thiserror::Error;

/// Bytes per block of a layer: the guest filesystem's block size.
pub const BLOCK_SIZE: u64 = 4096;
const BS: usize = BLOCK_SIZE as usize;
/// The map file's first bytes.
const MAP_MAGIC: &[u8; 8] = b"ALYRMAP1";
/// Map header: magic, block size (u32), reserved (u32), count (u64).
const MAP_HEADER: usize = 24;
/// Blocks moved per read or write while a layer is written.
const COPY_BLOCKS: usize = 256;
/// Entries per leaf of a [`BlockIndex`] (a leaf covers 2 MiB of the disk).
const LEAF: usize = 512;

/// Errors opening a layer or an overlay.
#[derive(Debug, Error)]
pub enum LayerError {
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("invalid layer map: {0}")]
    Map(String),
    #[error("the base image's size ({0} bytes) is not a whole number of {BLOCK_SIZE}-byte blocks")]
    BaseSize(u64),
    #[error("the overlay file is not empty ({0} bytes): every VMM starts a new one")]
    OverlayNotEmpty(u64),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> LayerError {
    move |source| LayerError::Io { what, source }
}

/// Why a write failed.
#[derive(Debug, Error)]
pub enum WriteError {
    /// The overlay holds its quota of blocks; this write needed another.
    #[error("the overlay's quota of {0} blocks is used up")]
    Quota(u64),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Which slot of a layer holds each virtual block: a sparse two-level table (leaves of
/// [`LEAF`] entries, made when a block in their range is first stored; an entry is its slot
/// plus one, zero for none).
#[derive(Debug, Default)]
struct BlockIndex {
    leaves: BTreeMap<u64, Box<[u32; LEAF]>>,
}

impl BlockIndex {
    fn get(&self, block: u64) -> Option<u32> {
        let leaf = self.leaves.get(&(block / LEAF as u64))?;
        leaf[(block % LEAF as u64) as usize].checked_sub(1)
    }

    /// Stores `slot` for `block`; false if the block had one already (left as it was).
    fn insert(&mut self, block: u64, slot: u32) -> bool {
        let leaf = self
            .leaves
            .entry(block / LEAF as u64)
            .or_insert_with(|| Box::new([0; LEAF]));
        let e = &mut leaf[(block % LEAF as u64) as usize];
        if *e != 0 {
            return false;
        }
        *e = slot + 1;
        true
    }

    /// Every stored block, in block order.
    fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.leaves.iter().flat_map(|(l, leaf)| {
            leaf.iter()
                .enumerate()
                .filter(|(_, e)| **e != 0)
                .map(move |(i, _)| l * LEAF as u64 + i as u64)
        })
    }
}

/// A read-only layer: its data file and which block each slot holds.
#[derive(Debug)]
pub struct Layer {
    data: File,
    index: BlockIndex,
    blocks: u64,
}

impl Layer {
    /// Opens a layer of a disk of `disk_blocks` blocks from its data file and its map file
    /// (as [`LayeredDisk::write_layer`] wrote them), checking the map: its checksum, that
    /// every block is inside the disk and named once, and that the data file holds them all.
    pub fn open(data: File, map: &File, disk_blocks: u64) -> Result<Self, LayerError> {
        let map_len = map.metadata().map_err(io_err("layer map"))?.len();
        if !(MAP_HEADER as u64 + 4..=MAP_HEADER as u64 + 4 + disk_blocks * 8).contains(&map_len) {
            return Err(LayerError::Map(format!("{map_len} bytes")));
        }
        let mut bytes = vec![0u8; map_len as usize];
        map.read_exact_at(&mut bytes, 0)
            .map_err(io_err("read the layer map"))?;
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        let crc = u32::from_le_bytes(crc.try_into().unwrap_or_default());
        if crc32fast::hash(body) != crc {
            return Err(LayerError::Map("checksum mismatch".into()));
        }
        if &body[..8] != MAP_MAGIC {
            return Err(LayerError::Map("not a layer map".into()));
        }
        let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap_or_default());
        let block_size = word(8) & 0xffff_ffff;
        if block_size != BLOCK_SIZE {
            return Err(LayerError::Map(format!("block size {block_size}")));
        }
        let count = word(16);
        if MAP_HEADER as u64 + count * 8 != body.len() as u64 {
            return Err(LayerError::Map(format!(
                "{count} blocks in {map_len} bytes"
            )));
        }
        let data_len = data.metadata().map_err(io_err("layer data"))?.len();
        if data_len < count * BLOCK_SIZE {
            return Err(LayerError::Map(format!(
                "{count} blocks, but the data file holds {data_len} bytes"
            )));
        }
        let mut index = BlockIndex::default();
        for slot in 0..count as usize {
            let block = word(MAP_HEADER + slot * 8);
            if block >= disk_blocks {
                return Err(LayerError::Map(format!(
                    "block {block} is outside the disk"
                )));
            }
            let slot = u32::try_from(slot).map_err(|_| LayerError::Map("too many".into()))?;
            if !index.insert(block, slot) {
                return Err(LayerError::Map(format!("block {block} named twice")));
            }
        }
        Ok(Self {
            data,
            index,
            blocks: count,
        })
    }

    /// Blocks it holds.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }
}

/// The writable top of a layered disk.
#[derive(Debug)]
struct Overlay {
    data: File,
    index: BlockIndex,
    /// The next free slot (= blocks held).
    next: u32,
    /// The most blocks it may hold.
    quota: u64,
}

/// Where a block's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Base,
    Layer,
    Overlay,
}

/// A disk of `base`'s size: the base image, read-only; a layer over it, if any; and the
/// overlay that takes every write.
#[derive(Debug)]
pub struct LayeredDisk {
    base: File,
    layer: Option<Layer>,
    top: Overlay,
    blocks: u64,
}

impl LayeredDisk {
    /// A disk over `base` (whose length is the disk's size) and `layer`, writing into
    /// `overlay` (an empty file) at most `quota_bytes` (rounded down to whole blocks).
    pub fn new(
        base: File,
        layer: Option<Layer>,
        overlay: File,
        quota_bytes: u64,
    ) -> Result<Self, LayerError> {
        let len = base.metadata().map_err(io_err("base image"))?.len();
        if len % BLOCK_SIZE != 0 || len == 0 {
            return Err(LayerError::BaseSize(len));
        }
        let used = overlay.metadata().map_err(io_err("overlay"))?.len();
        if used != 0 {
            return Err(LayerError::OverlayNotEmpty(used));
        }
        Ok(Self {
            base,
            layer,
            top: Overlay {
                data: overlay,
                index: BlockIndex::default(),
                next: 0,
                quota: (quota_bytes / BLOCK_SIZE).min(u64::from(u32::MAX)),
            },
            blocks: len / BLOCK_SIZE,
        })
    }

    /// The disk's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.blocks * BLOCK_SIZE
    }

    /// Bytes the overlay holds (its file's size).
    pub fn overlay_bytes(&self) -> u64 {
        u64::from(self.top.next) * BLOCK_SIZE
    }

    /// The overlay's quota in bytes.
    pub fn quota_bytes(&self) -> u64 {
        self.top.quota * BLOCK_SIZE
    }

    fn locate(&self, block: u64) -> (Source, u64) {
        if let Some(slot) = self.top.index.get(block) {
            return (Source::Overlay, u64::from(slot) * BLOCK_SIZE);
        }
        if let Some(l) = &self.layer
            && let Some(slot) = l.index.get(block)
        {
            return (Source::Layer, u64::from(slot) * BLOCK_SIZE);
        }
        (Source::Base, block * BLOCK_SIZE)
    }

    fn file(&self, source: Source) -> &File {
        match source {
            Source::Base => &self.base,
            Source::Overlay => &self.top.data,
            Source::Layer => self.layer.as_ref().map_or(&self.base, |l| &l.data),
        }
    }

    /// Reads `buf.len()` bytes at `offset` (inside the disk; the caller checked), in as few
    /// reads as the bytes' places allow.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (source, at) = self.locate(pos / BLOCK_SIZE);
            let start = at + pos % BLOCK_SIZE;
            let mut n = (BLOCK_SIZE - pos % BLOCK_SIZE) as usize;
            // Later blocks that follow on in the same file join this read.
            while done + n < buf.len() {
                let next = pos + n as u64;
                if self.locate(next / BLOCK_SIZE) != (source, start + n as u64) {
                    break;
                }
                n += BS;
            }
            let n = n.min(buf.len() - done);
            self.file(source)
                .read_exact_at(&mut buf[done..done + n], start)?;
            done += n;
        }
        Ok(())
    }

    /// Writes `buf` at `offset` (inside the disk; the caller checked) into the overlay.
    pub fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), WriteError> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let block = pos / BLOCK_SIZE;
            let within = (pos % BLOCK_SIZE) as usize;
            let n = (BS - within).min(buf.len() - done);
            let slot = match self.top.index.get(block) {
                Some(slot) => slot,
                None => self.copy_up(block, n)?,
            };
            // Whole blocks written to consecutive new or old slots join this write.
            let mut len = n;
            let mut last = slot;
            while within == 0 && len.is_multiple_of(BS) && done + len < buf.len() {
                let next_block = block + (len / BS) as u64;
                let want = last + 1;
                let m = (buf.len() - done - len).min(BS);
                let next_slot = match self.top.index.get(next_block) {
                    Some(s) if s == want => s,
                    None if m == BS
                        && u64::from(self.top.next) < self.top.quota
                        && self.top.next == want =>
                    {
                        self.top.index.insert(next_block, want);
                        self.top.next += 1;
                        want
                    }
                    _ => break,
                };
                last = next_slot;
                len += m;
            }
            self.top.data.write_all_at(
                &buf[done..done + len],
                u64::from(slot) * BLOCK_SIZE + within as u64,
            )?;
            done += len;
        }
        Ok(())
    }

    /// A new overlay slot for `block`, holding what is below it unless the write about to
    /// happen (`n` bytes of it) covers it all.
    fn copy_up(&mut self, block: u64, n: usize) -> Result<u32, WriteError> {
        if u64::from(self.top.next) >= self.top.quota {
            return Err(WriteError::Quota(self.top.quota));
        }
        let slot = self.top.next;
        if n < BS {
            let mut old = [0u8; BS];
            self.read_at(&mut old, block * BLOCK_SIZE)?;
            self.top
                .data
                .write_all_at(&old, u64::from(slot) * BLOCK_SIZE)?;
        }
        self.top.index.insert(block, slot);
        self.top.next += 1;
        Ok(slot)
    }

    /// Writes every block the layer and the overlay hold (the overlay's where both have one)
    /// into one new layer: `data` and `map` (empty files, truncated first) are synced before
    /// this returns. Returns the blocks written.
    pub fn write_layer(&self, data: &File, map: &File) -> io::Result<u64> {
        let mut blocks: Vec<u64> = self.top.index.blocks().collect();
        if let Some(l) = &self.layer {
            blocks.extend(l.index.blocks());
            blocks.sort_unstable();
            blocks.dedup();
        }
        data.set_len(0)?;
        map.set_len(0)?;
        let mut buf = vec![0u8; COPY_BLOCKS * BS];
        for (i, chunk) in blocks.chunks(COPY_BLOCKS).enumerate() {
            let mut filled = 0usize;
            for &b in chunk {
                let (source, at) = self.locate(b);
                self.file(source)
                    .read_exact_at(&mut buf[filled..filled + BS], at)?;
                filled += BS;
            }
            data.write_all_at(&buf[..filled], (i * COPY_BLOCKS * BS) as u64)?;
        }
        let mut m = Vec::with_capacity(MAP_HEADER + blocks.len() * 8 + 4);
        m.extend_from_slice(MAP_MAGIC);
        m.extend_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        m.extend_from_slice(&0u32.to_le_bytes());
        m.extend_from_slice(&(blocks.len() as u64).to_le_bytes());
        for b in &blocks {
            m.extend_from_slice(&b.to_le_bytes());
        }
        let crc = crc32fast::hash(&m);
        m.extend_from_slice(&crc.to_le_bytes());
        map.write_all_at(&m, 0)?;
        data.sync_data()?;
        map.sync_data()?;
        Ok(blocks.len() as u64)
    }
}

#[cfg(test)]
mod tests;
