//! The name a connection states in its first bytes: the server name (SNI) of a TLS
//! ClientHello, or the `Host` of an HTTP/1 request. The proxy calls [`sniff`] with what it has
//! read so far (at most [`MAX_HEAD`] bytes, under a deadline of its own) until it gets an
//! answer; malformed, truncated and hostile input gives an answer or [`Sniff::NeedMore`],
//! never a panic, and nothing here allocates beyond the name it returns.

use std::net::IpAddr;

use crate::policy::normalise_name;

/// The most the proxy reads before deciding: one TLS record (5-byte header, 16 KiB of
/// payload) or an HTTP request head of the same size.
pub const MAX_HEAD: usize = 5 + (16 << 10);
/// Headers of an HTTP request head that are looked at.
const MAX_HEADERS: usize = 64;

/// What the first bytes said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// A TLS ClientHello, with its server name if it sent a valid host name.
    Tls(Option<String>),
    /// An HTTP/1 request head, with its `Host` if that is a valid host name (not an address).
    Http(Option<String>),
    /// Neither (or a malformed one): the connection states no name.
    Other,
}

/// The answer for the bytes read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniff {
    /// Not decided yet: read more (up to [`MAX_HEAD`]).
    NeedMore,
    Done(Sniffed),
    /// [`MAX_HEAD`] bytes did not decide it.
    TooLarge,
}

/// Looks at the first bytes of a connection.
pub fn sniff(buf: &[u8]) -> Sniff {
    let buf = buf.get(..MAX_HEAD).unwrap_or(buf);
    let outcome = match buf.first() {
        None => Sniff::NeedMore,
        Some(0x16) => tls(buf),
        Some(b) if b.is_ascii_uppercase() => http(buf),
        Some(_) => Sniff::Done(Sniffed::Other),
    };
    match outcome {
        Sniff::NeedMore if buf.len() >= MAX_HEAD => Sniff::TooLarge,
        other => other,
    }
}

/// A bounds-checked reader over a byte slice.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| usize::from(b[0]))
    }

    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]))
    }

    /// A vector with a length prefix of `width` bytes.
    fn vec(&mut self, width: usize) -> Option<Cursor<'a>> {
        let len = match width {
            1 => self.u8()?,
            2 => self.u16()?,
            _ => self.u24()?,
        };
        self.take(len).map(Cursor)
    }
}

const HANDSHAKE: u8 = 0x16;
const CLIENT_HELLO: usize = 1;
const EXT_SERVER_NAME: usize = 0;
const HOST_NAME: usize = 0;
/// The largest TLS plaintext record (RFC 8446 5.1).
const MAX_RECORD: usize = 1 << 14;

fn tls(buf: &[u8]) -> Sniff {
    let mut c = Cursor(buf);
    let Some(header) = c.take(5) else {
        return Sniff::NeedMore;
    };
    let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if header[0] != HANDSHAKE || header[1] != 3 || len == 0 || len > MAX_RECORD {
        return Sniff::Done(Sniffed::Other);
    }
    let Some(record) = c.take(len) else {
        return Sniff::NeedMore;
    };
    // A ClientHello split over several records states no name we look for.
    Sniff::Done(Sniffed::Tls(client_hello_sni(record)))
}

/// The host name in a ClientHello's server_name extension, if the whole hello is in `record`.
fn client_hello_sni(record: &[u8]) -> Option<String> {
    let mut c = Cursor(record);
    if c.u8()? != CLIENT_HELLO {
        return None;
    }
    let mut hello = c.vec(3)?;
    hello.take(2 + 32)?; // legacy_version, random
    hello.vec(1)?; // legacy_session_id
    hello.vec(2)?; // cipher_suites
    hello.vec(1)?; // legacy_compression_methods
    let mut exts = hello.vec(2)?;
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let mut body = exts.vec(2)?;
        if kind != EXT_SERVER_NAME {
            continue;
        }
        let mut names = body.vec(2)?;
        while !names.0.is_empty() {
            let name_type = names.u8()?;
            let name = names.vec(2)?;
            if name_type == HOST_NAME {
                let text = std::str::from_utf8(name.0).ok()?;
                return normalise_name(text);
            }
        }
        return None;
    }
    None
}

fn http(buf: &[u8]) -> Sniff {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Sniff::NeedMore,
        Ok(httparse::Status::Complete(_)) => {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .and_then(|h| std::str::from_utf8(h.value).ok())
                .and_then(host_name);
            Sniff::Done(Sniffed::Http(host))
        }
        Err(httparse::Error::TooManyHeaders) => Sniff::Done(Sniffed::Http(None)),
        Err(_) => Sniff::Done(Sniffed::Other),
    }
}

/// The host name of a `Host` value (`name`, `name:port`), or `None` for an address or junk.
fn host_name(value: &str) -> Option<String> {
    let value = value.trim();
    if value.starts_with('[') {
        return None; // an IPv6 literal
    }
    let name = match value.rsplit_once(':') {
        Some((name, port)) if port.parse::<u16>().is_ok() => name,
        Some(_) => return None,
        None => value,
    };
    if name.parse::<IpAddr>().is_ok() {
        return None;
    }
    normalise_name(name)
}

#[cfg(test)]
mod tests;
