//! Framing: each message is a 4-byte little-endian length, then that many bytes of protobuf.
//!
//! Both sides refuse frames larger than [`MAX_FRAME_BYTES`]; the announced length is checked
//! before anything is allocated for the body.

use std::io::{self, Read, Write};

use prost::Message;

/// Largest frame body, in bytes (4 MiB).
pub const MAX_FRAME_BYTES: usize = 4 << 20;

/// Size of the length prefix.
const HEADER_BYTES: usize = 4;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The underlying stream failed.
    #[error("frame I/O failed")]
    Io(#[source] io::Error),
    /// The stream ended inside the 4-byte length prefix.
    #[error("stream ended inside a frame header ({got} of 4 bytes)")]
    TruncatedHeader { got: usize },
    /// The stream ended inside a frame body.
    #[error("stream ended inside a frame body of {len} bytes")]
    TruncatedBody { len: usize },
    /// A frame (announced or to be sent) is larger than [`MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge { len: usize },
    /// The body is not a valid protobuf encoding of the expected message.
    #[error("frame body does not decode")]
    Decode(#[source] prost::DecodeError),
}

/// Encodes `msg` as one complete frame (length prefix included), ready for a single write.
pub fn encode_frame(msg: &impl Message) -> Result<Vec<u8>, FrameError> {
    let mut buf = Vec::with_capacity(HEADER_BYTES + msg.encoded_len());
    append_frame(&mut buf, msg)?;
    Ok(buf)
}

/// Appends `msg` as one complete frame to `buf` (to send several frames with one write).
/// On error `buf` is unchanged.
pub fn append_frame(buf: &mut Vec<u8>, msg: &impl Message) -> Result<(), FrameError> {
    let len = msg.encoded_len();
    let prefix = u32::try_from(len)
        .ok()
        .filter(|_| len <= MAX_FRAME_BYTES)
        .ok_or(FrameError::TooLarge { len })?;
    buf.reserve(HEADER_BYTES + len);
    buf.extend_from_slice(&prefix.to_le_bytes());
    // Encoding into a Vec cannot run out of space.
    msg.encode_raw(buf);
    Ok(())
}

/// Writes `msg` as one frame with a single `write_all`.
pub fn write_frame<W: Write>(w: &mut W, msg: &impl Message) -> Result<(), FrameError> {
    let buf = encode_frame(msg)?;
    w.write_all(&buf).map_err(FrameError::Io)
}

/// Reads one frame. `Ok(None)` means the stream ended cleanly between frames.
pub fn read_frame<R: Read, M: Message + Default>(r: &mut R) -> Result<Option<M>, FrameError> {
    match read_frame_bytes(r)? {
        Some(body) => M::decode(body.as_slice())
            .map(Some)
            .map_err(FrameError::Decode),
        None => Ok(None),
    }
}

/// Reads one frame's body undecoded (to look at it before decoding: see [`count_field`]).
/// `Ok(None)` means the stream ended cleanly between frames.
pub fn read_frame_bytes<R: Read>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; HEADER_BYTES];
    let got = read_up_to(r, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_BYTES {
        return Err(FrameError::TruncatedHeader { got });
    }
    let len = usize::try_from(u32::from_le_bytes(header)).unwrap_or(usize::MAX);
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len });
    }
    // The buffer grows as bytes arrive: a peer that announces 4 MiB and sends one byte costs
    // one byte (and a little), not 4 MiB.
    let mut body = Vec::with_capacity(len.min(GROWTH_STEP));
    read_body(r, &mut body, len)?;
    Ok(Some(body))
}

/// How many times the field at `path` occurs in the encoded message `msg`, without decoding
/// it: every number but the last names a length-delimited field to descend into (its last
/// occurrence, as protobuf merges them), the last one the field to count. `None` if the bytes
/// are not a well-formed message. Decoding a repeated field costs far more than its encoded
/// bytes (an empty directory entry is 2 bytes on the wire and ~80 in memory), so a count is
/// checked against its limit before the message is decoded.
pub fn count_field(msg: &[u8], path: &[u32]) -> Option<usize> {
    let (&field, rest) = path.split_first()?;
    let mut count = 0;
    let mut inner = None;
    let mut buf = msg;
    while !buf.is_empty() {
        let key = take_varint(&mut buf)?;
        let number = u32::try_from(key >> 3).ok()?;
        let bytes = match key & 7 {
            0 => take_varint(&mut buf).map(|_| &[][..])?,
            1 => take(&mut buf, 8)?,
            2 => {
                let len = usize::try_from(take_varint(&mut buf)?).ok()?;
                take(&mut buf, len)?
            }
            5 => take(&mut buf, 4)?,
            _ => return None,
        };
        if number == field {
            count += 1;
            inner = Some(bytes);
        }
    }
    if rest.is_empty() {
        Some(count)
    } else {
        inner.map_or(Some(0), |m| count_field(m, rest))
    }
}

fn take_varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn take<'a>(buf: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if buf.len() < n {
        return None;
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Some(head)
}

/// Most bytes a frame body's buffer grows by before they have arrived.
const GROWTH_STEP: usize = 64 << 10;

/// Reads exactly `len` body bytes into `body`, growing it a step at a time.
fn read_body<R: Read>(r: &mut R, body: &mut Vec<u8>, len: usize) -> Result<(), FrameError> {
    while body.len() < len {
        let start = body.len();
        let step = (len - start).min(GROWTH_STEP);
        body.resize(start + step, 0);
        let got = read_up_to(r, body.get_mut(start..).unwrap_or_default())?;
        if got < step {
            return Err(FrameError::TruncatedBody { len });
        }
    }
    Ok(())
}

/// Fills `buf` as far as the stream allows; returns how many bytes were read (less than
/// `buf.len()` only at end of stream).
fn read_up_to<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = buf.get_mut(filled..).unwrap_or_default();
        match r.read(rest) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{Ping, Request, request};

    fn ping(id: u64) -> Request {
        Request {
            id,
            kind: Some(request::Kind::Ping(Ping {})),
        }
    }

    fn read(bytes: &[u8]) -> Result<Option<Request>, FrameError> {
        read_frame(&mut &bytes[..])
    }

    #[test]
    fn roundtrip_of_two_frames_then_clean_eof() {
        let mut wire = Vec::new();
        write_frame(&mut wire, &ping(1)).unwrap();
        write_frame(&mut wire, &ping(2)).unwrap();
        let mut r = wire.as_slice();
        assert_eq!(read_frame::<_, Request>(&mut r).unwrap(), Some(ping(1)));
        assert_eq!(read_frame::<_, Request>(&mut r).unwrap(), Some(ping(2)));
        assert!(read_frame::<_, Request>(&mut r).unwrap().is_none());
    }

    #[test]
    fn encode_frame_prefixes_little_endian_length() {
        let buf = encode_frame(&ping(7)).unwrap();
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        assert_eq!(len, buf.len() - 4);
    }

    #[test]
    fn append_frame_concatenates_frames() {
        let mut buf = Vec::new();
        append_frame(&mut buf, &ping(1)).unwrap();
        append_frame(&mut buf, &ping(2)).unwrap();
        let mut expected = encode_frame(&ping(1)).unwrap();
        expected.extend(encode_frame(&ping(2)).unwrap());
        assert_eq!(buf, expected);
    }

    #[test]
    fn empty_stream_is_clean_eof() {
        assert!(read(&[]).unwrap().is_none());
    }

    #[test]
    fn zero_length_frame_decodes_to_default_message() {
        assert_eq!(read(&[0, 0, 0, 0]).unwrap(), Some(Request::default()));
    }

    #[test]
    fn truncated_header_is_an_error() {
        let err = read(&[5, 0]).unwrap_err();
        assert!(
            matches!(err, FrameError::TruncatedHeader { got: 2 }),
            "{err:?}"
        );
    }

    #[test]
    fn truncated_body_is_an_error() {
        let mut wire = encode_frame(&ping(1)).unwrap();
        wire.pop();
        let err = read(&wire).unwrap_err();
        assert!(matches!(err, FrameError::TruncatedBody { .. }), "{err:?}");
    }

    #[test]
    fn oversize_announced_length_is_refused_before_reading_the_body() {
        let announced = (100u32 << 20).to_le_bytes();
        // No body follows: an implementation that allocated and read would report truncation.
        let err = read(&announced).unwrap_err();
        assert!(
            matches!(err, FrameError::TooLarge { len } if len == 100 << 20),
            "{err:?}"
        );
    }

    #[test]
    fn largest_allowed_length_is_accepted() {
        let mut wire = (MAX_FRAME_BYTES as u32).to_le_bytes().to_vec();
        // A single field with a 4 MiB - 5 byte payload would be valid; here only the length
        // check matters, so a body of zeros (field number 0) must fail in decoding, not sizing.
        wire.resize(4 + MAX_FRAME_BYTES, 0);
        let err = read(&wire).unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err:?}");
    }

    #[test]
    fn garbage_body_is_a_decode_error() {
        let wire = [3, 0, 0, 0, 0xff, 0xff, 0xff];
        let err = read(&wire).unwrap_err();
        assert!(matches!(err, FrameError::Decode(_)), "{err:?}");
    }

    #[test]
    fn oversize_message_is_refused_by_the_writer() {
        let req = Request {
            id: 1,
            kind: Some(request::Kind::WriteFile(crate::pb::WriteFile {
                data: vec![0; MAX_FRAME_BYTES],
                ..Default::default()
            })),
        };
        let mut wire = Vec::new();
        let err = write_frame(&mut wire, &req).unwrap_err();
        assert!(matches!(err, FrameError::TooLarge { .. }), "{err:?}");
        assert!(wire.is_empty());
    }

    #[test]
    fn io_error_is_reported_as_io() {
        struct Failing;
        impl Read for Failing {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("boom"))
            }
        }
        let err = read_frame::<_, Request>(&mut Failing).unwrap_err();
        assert!(matches!(err, FrameError::Io(_)), "{err:?}");
    }

    #[test]
    fn a_body_announced_but_not_sent_costs_what_arrived() {
        let mut bytes = (MAX_FRAME_BYTES as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0u8; 10]);
        let mut body = Vec::new();
        let err = read_body(&mut &bytes[4..], &mut body, MAX_FRAME_BYTES).unwrap_err();
        assert!(matches!(err, FrameError::TruncatedBody { .. }), "{err:?}");
        assert!(body.capacity() <= 2 * GROWTH_STEP, "{}", body.capacity());
    }

    #[test]
    fn repeated_fields_are_counted_without_decoding() {
        use crate::pb::{DirListing, FileStat, Response, response};
        let listing = |n: usize| Response {
            id: 7,
            kind: Some(response::Kind::DirListing(DirListing {
                entries: vec![FileStat::default(); n],
                truncated: false,
            })),
        };
        for n in [0, 1, 3, 10_001] {
            let bytes = listing(n).encode_to_vec();
            assert_eq!(count_field(&bytes, &[18, 1]), Some(n));
        }
        let pong = Response {
            id: 1,
            kind: Some(response::Kind::Pong(crate::pb::Pong { uptime_ms: 5 })),
        }
        .encode_to_vec();
        assert_eq!(count_field(&pong, &[18, 1]), Some(0));
        assert_eq!(count_field(&[0x0a, 0x05, 1], &[1]), None, "truncated");
        assert_eq!(count_field(&[0x0b], &[1]), None, "a group");
    }
}
