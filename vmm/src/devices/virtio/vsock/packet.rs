//! virtio-vsock packets: the 44-byte header and moving packets between descriptor chains and
//! host memory.

use std::io::{Read, Write};

use virtio_queue::{Reader, Writer};

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_SIZE: usize = 44;
/// Largest payload we accept from, or put into, one packet (Linux uses 64 KiB buffers).
pub const MAX_PKT_DATA: usize = 64 * 1024;

/// `type` of a stream socket packet, the only type supported.
pub const TYPE_STREAM: u16 = 1;

/// Packet operations.
pub mod op {
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;
}

/// `flags` of a SHUTDOWN packet.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// The packet header, in host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    /// Decodes the little-endian wire format.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the little-endian wire format.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// A packet in host memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Packet {
    pub hdr: Header,
    pub data: Vec<u8>,
}

/// Why a packet from the guest was dropped.
#[derive(Debug, PartialEq, Eq)]
pub enum BadPacket {
    /// Fewer readable bytes than a header.
    ShortHeader,
    /// `len` larger than [`MAX_PKT_DATA`] or than the bytes the chain holds.
    BadLength(u32),
}

/// Reads one guest-to-host packet from the readable part of a TX chain.
pub fn read_packet(reader: &mut Reader<'_>) -> Result<Packet, BadPacket> {
    let mut raw = [0u8; HDR_SIZE];
    if reader.available_bytes() < HDR_SIZE || reader.read_exact(&mut raw).is_err() {
        return Err(BadPacket::ShortHeader);
    }
    let hdr = Header::from_bytes(&raw);
    let len = hdr.len as usize;
    if len > MAX_PKT_DATA || len > reader.available_bytes() {
        return Err(BadPacket::BadLength(hdr.len));
    }
    let mut data = vec![0u8; len];
    reader
        .read_exact(&mut data)
        .map_err(|_| BadPacket::BadLength(hdr.len))?;
    Ok(Packet { hdr, data })
}

/// Room for payload in an RX chain (its writable bytes minus the header), if it holds a header.
pub fn rx_capacity(writer: &Writer<'_>) -> Option<usize> {
    writer
        .available_bytes()
        .checked_sub(HDR_SIZE)
        .map(|n| n.min(MAX_PKT_DATA))
}

/// Writes `pkt` into an RX chain; returns the bytes written (the used length).
pub fn write_packet(writer: &mut Writer<'_>, pkt: &Packet) -> std::io::Result<u32> {
    let mut hdr = pkt.hdr;
    hdr.len = pkt.data.len() as u32;
    writer.write_all(&hdr.to_bytes())?;
    writer.write_all(&pkt.data)?;
    Ok((HDR_SIZE + pkt.data.len()) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrips_through_the_wire_format() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1234,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: op::RW,
            flags: 3,
            buf_alloc: 1 << 18,
            fwd_cnt: 99,
        };
        let b = h.to_bytes();
        assert_eq!(&b[0..8], &3u64.to_le_bytes());
        assert_eq!(&b[30..32], &op::RW.to_le_bytes());
        assert_eq!(Header::from_bytes(&b), h);
    }
}
