//! Parsing and executing one virtio-blk request from a descriptor chain.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::{Reader, Writer};
use vm_memory::ByteValued;

use super::layered::{LayeredDisk, WriteError};

/// Bytes per virtio-blk sector.
pub const SECTOR_SIZE: u64 = 512;

/// The request header the driver puts first in every chain.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct RequestHeader {
    pub request_type: u32,
    pub reserved: u32,
    pub sector: u64,
}

// SAFETY: plain integers, no padding (4 + 4 + 8 bytes, 8-aligned); any bit pattern is valid.
unsafe impl ByteValued for RequestHeader {}

/// What the driver asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(v: u32) -> Self {
        match v {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            other => RequestType::Unsupported(other),
        }
    }
}

/// Why a chain could not even be answered with a status byte.
#[derive(Debug, PartialEq, Eq)]
pub enum Malformed {
    /// A descriptor points outside guest memory or the chain is inconsistent.
    Descriptors,
    /// Fewer than 16 readable bytes for the header.
    Header,
    /// No writable byte for the status.
    NoStatus,
}

/// Where a disk's bytes are: a raw image file, a copy-on-write chain, or nothing (an empty
/// slot, of no sectors, until media is put in).
#[derive(Debug)]
pub enum Backing {
    Raw(File),
    Layered(LayeredDisk),
    Empty,
}

impl Backing {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Self::Raw(f) => f.read_exact_at(buf, offset),
            Self::Layered(d) => d.read_at(buf, offset),
            Self::Empty => Err(std::io::ErrorKind::NotFound.into()),
        }
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), WriteError> {
        match self {
            Self::Raw(f) => Ok(f.write_all_at(buf, offset)?),
            Self::Layered(d) => d.write_at(buf, offset),
            Self::Empty => Err(WriteError::Io(std::io::ErrorKind::NotFound.into())),
        }
    }

    /// A raw image is synced; a layered disk's overlay lives as long as its VMM, so there
    /// is nothing to make durable (see [`super::layered`]).
    fn flush(&self) -> std::io::Result<()> {
        match self {
            Self::Raw(f) => f.sync_data(),
            Self::Layered(_) | Self::Empty => Ok(()),
        }
    }
}

/// The backing and its geometry, as a request sees them.
#[derive(Debug)]
pub struct Disk<'a> {
    pub backing: &'a mut Backing,
    pub sectors: u64,
    pub read_only: bool,
    pub id: &'a [u8],
}

/// Bytes moved by one request, for metrics.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub status: u8,
    pub kind: Option<RequestType>,
    pub read_bytes: u64,
    pub written_bytes: u64,
    /// A write was refused because a layered disk's overlay holds its quota.
    pub over_quota: bool,
    /// Bytes written into the chain, status included (the used-ring length).
    pub used_len: u32,
}

/// Bounce buffer size for data transfers.
const CHUNK: usize = 128 * 1024;

/// Executes the request in `reader`/`writer` (the readable and writable halves of one chain).
pub fn execute(
    disk: &mut Disk<'_>,
    mut reader: Reader<'_>,
    mut writer: Writer<'_>,
) -> Result<Outcome, Malformed> {
    if reader.available_bytes() < std::mem::size_of::<RequestHeader>() {
        return Err(Malformed::Header);
    }
    let header: RequestHeader = reader.read_obj().map_err(|_| Malformed::Header)?;
    let data_room = writer
        .available_bytes()
        .checked_sub(1)
        .ok_or(Malformed::NoStatus)?;
    let mut status_writer = writer
        .split_at(data_room)
        .map_err(|_| Malformed::NoStatus)?;
    let kind = RequestType::from(header.request_type);
    let mut out = Outcome {
        kind: Some(kind),
        ..Default::default()
    };
    out.status = match kind {
        RequestType::In => read_sectors(disk, header.sector, &mut writer, &mut out),
        RequestType::Out => write_sectors(disk, header.sector, &mut reader, &mut out),
        RequestType::Flush => match disk.backing.flush() {
            Ok(()) => VIRTIO_BLK_S_OK as u8,
            Err(_) => VIRTIO_BLK_S_IOERR as u8,
        },
        RequestType::GetId => write_id(disk, &mut writer),
        RequestType::Unsupported(_) => VIRTIO_BLK_S_UNSUPP as u8,
    };
    status_writer
        .write_all(&[out.status])
        .map_err(|_| Malformed::NoStatus)?;
    out.used_len = (writer.bytes_written() + 1) as u32;
    Ok(out)
}

/// Checks that `len` bytes from `sector` are whole sectors inside the disk.
fn in_range(disk: &Disk<'_>, sector: u64, len: usize) -> Option<u64> {
    if !(len as u64).is_multiple_of(SECTOR_SIZE) {
        return None;
    }
    let end = sector.checked_add(len as u64 / SECTOR_SIZE)?;
    (end <= disk.sectors).then(|| sector * SECTOR_SIZE)
}

fn read_sectors(disk: &Disk<'_>, sector: u64, writer: &mut Writer<'_>, out: &mut Outcome) -> u8 {
    let len = writer.available_bytes();
    let Some(mut offset) = in_range(disk, sector, len) else {
        return VIRTIO_BLK_S_IOERR as u8;
    };
    let mut buf = vec![0u8; len.min(CHUNK)];
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK);
        if disk.backing.read_at(&mut buf[..n], offset).is_err()
            || writer.write_all(&buf[..n]).is_err()
        {
            return VIRTIO_BLK_S_IOERR as u8;
        }
        offset += n as u64;
        left -= n;
        out.read_bytes += n as u64;
    }
    VIRTIO_BLK_S_OK as u8
}

fn write_sectors(
    disk: &mut Disk<'_>,
    sector: u64,
    reader: &mut Reader<'_>,
    out: &mut Outcome,
) -> u8 {
    if disk.read_only {
        return VIRTIO_BLK_S_IOERR as u8;
    }
    let len = reader.available_bytes();
    let Some(mut offset) = in_range(disk, sector, len) else {
        return VIRTIO_BLK_S_IOERR as u8;
    };
    let mut buf = vec![0u8; len.min(CHUNK)];
    let mut left = len;
    while left > 0 {
        let n = left.min(CHUNK);
        if reader.read_exact(&mut buf[..n]).is_err() {
            return VIRTIO_BLK_S_IOERR as u8;
        }
        match disk.backing.write_at(&buf[..n], offset) {
            Ok(()) => {}
            Err(WriteError::Quota(_)) => {
                out.over_quota = true;
                return VIRTIO_BLK_S_IOERR as u8;
            }
            Err(WriteError::Io(_)) => return VIRTIO_BLK_S_IOERR as u8,
        }
        offset += n as u64;
        left -= n;
        out.written_bytes += n as u64;
    }
    VIRTIO_BLK_S_OK as u8
}

fn write_id(disk: &Disk<'_>, writer: &mut Writer<'_>) -> u8 {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
    let n = disk.id.len().min(id.len());
    id[..n].copy_from_slice(&disk.id[..n]);
    let room = writer.available_bytes().min(id.len());
    match writer.write_all(&id[..room]) {
        Ok(()) => VIRTIO_BLK_S_OK as u8,
        Err(_) => VIRTIO_BLK_S_IOERR as u8,
    }
}
