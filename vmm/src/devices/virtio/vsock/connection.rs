//! One vsock stream connection between a guest port and a host Unix stream, with the virtio
//! credit accounting in both directions.
//!
//! Guest → host: data goes straight to the host stream; what the stream does not take at once
//! waits in `tx_buf`, whose size is the credit we advertise (`buf_alloc`), so a guest that
//! respects credit can never make it grow past [`TX_BUF_SIZE`] — one that does is reset.
//! Host → guest: we read from the host stream only as much as the guest's advertised free
//! buffer space allows (`peer_buf_alloc - (rx_cnt - peer_fwd_cnt)`).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;

use super::packet::{Header, Packet, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM, op};

/// Bytes of guest data we buffer per connection (our advertised receive buffer).
pub const TX_BUF_SIZE: u32 = 256 * 1024;
/// Tell the guest about freed buffer space once this much has been forwarded since the last
/// packet it saw from us.
const CREDIT_UPDATE_THRESHOLD: u32 = TX_BUF_SIZE / 4;

/// Connection states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    /// The host asked for a guest port; our REQUEST is queued or sent, no RESPONSE yet.
    LocalInit,
    /// Data flows both ways (subject to shutdowns).
    Established,
    /// Finished: remove it (after sending a queued RST, if any).
    Killed,
}

/// What the connection still has to tell the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PendingRx {
    request: bool,
    response: bool,
    rst: bool,
    shutdown_send: bool,
    credit_update: bool,
    credit_request: bool,
    /// The host stream was readable when last polled (data or EOF may be there).
    data: bool,
}

/// One connection.
#[derive(Debug)]
pub struct Connection {
    pub stream: UnixStream,
    pub local_port: u32,
    pub peer_port: u32,
    pub state: ConnState,
    guest_cid: u64,
    host_cid: u64,
    tx_buf: VecDeque<u8>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_to_peer: Wrapping<u32>,
    rx_cnt: Wrapping<u32>,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    pending: PendingRx,
    /// The host stream reached EOF (we told the guest SHUTDOWN/SEND).
    host_eof: bool,
    /// The guest will send no more data / receive no more data.
    peer_shut_send: bool,
    peer_shut_rcv: bool,
    /// For host-initiated connections: "OK <port>\n" must go to the host once established.
    ack_host: bool,
}

/// The outcome of handling one guest packet.
#[derive(Debug, PartialEq, Eq)]
pub enum TxOutcome {
    Ok,
    /// The guest broke the protocol (credit overrun); the connection is reset.
    Violation,
}

impl Connection {
    fn new(
        stream: UnixStream,
        local_port: u32,
        peer_port: u32,
        guest_cid: u64,
        host_cid: u64,
    ) -> Self {
        Self {
            stream,
            local_port,
            peer_port,
            state: ConnState::LocalInit,
            guest_cid,
            host_cid,
            tx_buf: VecDeque::new(),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_to_peer: Wrapping(0),
            rx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            pending: PendingRx::default(),
            host_eof: false,
            peer_shut_send: false,
            peer_shut_rcv: false,
            ack_host: false,
        }
    }

    /// A connection the host asked for: REQUEST goes to the guest first.
    pub fn new_local(
        stream: UnixStream,
        local_port: u32,
        peer_port: u32,
        guest_cid: u64,
        host_cid: u64,
    ) -> Self {
        let mut c = Self::new(stream, local_port, peer_port, guest_cid, host_cid);
        c.pending.request = true;
        c.ack_host = true;
        c
    }

    /// A connection the guest asked for (its REQUEST carried `hdr`): established, RESPONSE
    /// goes to the guest first.
    pub fn new_peer(stream: UnixStream, hdr: &Header, guest_cid: u64, host_cid: u64) -> Self {
        let mut c = Self::new(stream, hdr.dst_port, hdr.src_port, guest_cid, host_cid);
        c.state = ConnState::Established;
        c.update_peer_credit(hdr);
        c.pending.response = true;
        c
    }

    fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
    }

    /// Bytes the guest can still take from us.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Handles a packet the guest sent on this connection.
    pub fn handle_tx(&mut self, pkt: Packet) -> TxOutcome {
        self.update_peer_credit(&pkt.hdr);
        match pkt.hdr.op {
            op::RESPONSE if self.state == ConnState::LocalInit => {
                self.state = ConnState::Established;
                if self.ack_host {
                    self.ack_host = false;
                    let line = format!("OK {}\n", self.local_port);
                    if self.stream.write_all(line.as_bytes()).is_err() {
                        self.reset();
                    }
                }
            }
            op::RW if self.state == ConnState::Established && !self.peer_shut_send => {
                return self.forward_to_host(&pkt.data);
            }
            op::CREDIT_REQUEST => self.pending.credit_update = true,
            op::CREDIT_UPDATE => {}
            op::SHUTDOWN => {
                self.peer_shut_rcv |= pkt.hdr.flags & SHUTDOWN_RCV != 0;
                self.peer_shut_send |= pkt.hdr.flags & SHUTDOWN_SEND != 0;
                if self.peer_shut_send && self.tx_buf.is_empty() {
                    let _ = self.stream.shutdown(std::net::Shutdown::Write);
                }
                if self.peer_shut_send && self.peer_shut_rcv {
                    self.close_when_flushed();
                }
            }
            op::RST => {
                self.pending = PendingRx::default();
                self.state = ConnState::Killed;
            }
            // Anything else in this state is a protocol error by the guest.
            _ => {
                self.reset();
                return TxOutcome::Violation;
            }
        }
        TxOutcome::Ok
    }

    fn close_when_flushed(&mut self) {
        if self.tx_buf.is_empty() {
            self.reset();
        }
    }

    /// Tells the guest the connection is gone and marks it for removal.
    pub fn reset(&mut self) {
        self.pending = PendingRx {
            rst: true,
            ..PendingRx::default()
        };
        self.state = ConnState::Killed;
    }

    fn forward_to_host(&mut self, data: &[u8]) -> TxOutcome {
        if self.tx_buf.len() + data.len() > TX_BUF_SIZE as usize {
            self.reset();
            return TxOutcome::Violation;
        }
        let mut written = 0;
        if self.tx_buf.is_empty() {
            written = match self.stream.write(data) {
                Ok(n) => n,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    0
                }
                Err(_) => {
                    self.reset();
                    return TxOutcome::Ok;
                }
            };
        }
        self.tx_buf.extend(&data[written..]);
        self.account_forwarded(written);
        TxOutcome::Ok
    }

    fn account_forwarded(&mut self, n: usize) {
        self.fwd_cnt += Wrapping(n as u32);
        if (self.fwd_cnt - self.last_fwd_cnt_to_peer).0 >= CREDIT_UPDATE_THRESHOLD {
            self.pending.credit_update = true;
        }
    }

    /// Writes buffered guest data to the host stream (it became writable).
    pub fn flush_tx(&mut self) {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => return self.reset(),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.account_forwarded(n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return self.reset(),
            }
        }
        if self.peer_shut_send {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
            if self.peer_shut_rcv {
                self.reset();
            }
        }
    }

    /// The host stream is readable (or hung up).
    pub fn notify_readable(&mut self) {
        self.pending.data = true;
    }

    /// Whether it has something for the guest right now.
    pub fn has_rx(&self) -> bool {
        let p = &self.pending;
        p.rst
            || p.request
            || p.response
            || p.credit_update
            || p.credit_request
            || p.shutdown_send
            || (p.data && self.can_send_data())
    }

    fn can_send_data(&self) -> bool {
        self.state == ConnState::Established
            && !self.host_eof
            && !self.peer_shut_rcv
            && self.peer_credit() > 0
    }

    /// Whether the host stream should be polled for reading.
    pub fn wants_read(&self) -> bool {
        !self.pending.data && self.can_send_data()
    }

    /// Whether the host stream should be polled for writing.
    pub fn wants_write(&self) -> bool {
        !self.tx_buf.is_empty() && self.state != ConnState::Killed
    }

    fn packet(&mut self, op: u16, flags: u32, data: Vec<u8>) -> Packet {
        self.last_fwd_cnt_to_peer = self.fwd_cnt;
        Packet {
            hdr: Header {
                src_cid: self.host_cid,
                dst_cid: self.guest_cid,
                src_port: self.local_port,
                dst_port: self.peer_port,
                len: data.len() as u32,
                type_: TYPE_STREAM,
                op,
                flags,
                buf_alloc: TX_BUF_SIZE,
                fwd_cnt: self.fwd_cnt.0,
            },
            data,
        }
    }

    /// The next packet for the guest, with at most `max_data` payload bytes.
    pub fn next_rx(&mut self, max_data: usize) -> Option<Packet> {
        let p = &mut self.pending;
        if p.rst {
            *p = PendingRx::default();
            return Some(self.packet(op::RST, 0, Vec::new()));
        }
        if std::mem::take(&mut p.request) {
            return Some(self.packet(op::REQUEST, 0, Vec::new()));
        }
        if std::mem::take(&mut p.response) {
            return Some(self.packet(op::RESPONSE, 0, Vec::new()));
        }
        if self.pending.data && self.can_send_data() {
            if let Some(pkt) = self.read_host_data(max_data) {
                return Some(pkt);
            }
            if self.pending.rst {
                // The host stream failed while reading.
                return self.next_rx(max_data);
            }
        }
        if std::mem::take(&mut self.pending.shutdown_send) {
            return Some(self.packet(op::SHUTDOWN, SHUTDOWN_SEND, Vec::new()));
        }
        if std::mem::take(&mut self.pending.credit_update) {
            return Some(self.packet(op::CREDIT_UPDATE, 0, Vec::new()));
        }
        if std::mem::take(&mut self.pending.credit_request) {
            return Some(self.packet(op::CREDIT_REQUEST, 0, Vec::new()));
        }
        None
    }

    fn read_host_data(&mut self, max_data: usize) -> Option<Packet> {
        let want = max_data.min(self.peer_credit() as usize);
        let mut buf = vec![0u8; want];
        match self.stream.read(&mut buf) {
            Ok(0) => {
                self.pending.data = false;
                self.host_eof = true;
                self.pending.shutdown_send = true;
                None
            }
            Ok(n) => {
                buf.truncate(n);
                self.rx_cnt += Wrapping(n as u32);
                if self.peer_credit() == 0 {
                    self.pending.credit_request = true;
                }
                Some(self.packet(op::RW, 0, buf))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                self.pending.data = false;
                None
            }
            Err(_) => {
                self.reset();
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUEST: u64 = 3;
    const HOST: u64 = 2;

    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn guest_pkt(op: u16, buf_alloc: u32, fwd_cnt: u32, data: &[u8]) -> Packet {
        Packet {
            hdr: Header {
                src_cid: GUEST,
                dst_cid: HOST,
                src_port: 52,
                dst_port: 1 << 30,
                len: data.len() as u32,
                type_: TYPE_STREAM,
                op,
                flags: 0,
                buf_alloc,
                fwd_cnt,
            },
            data: data.to_vec(),
        }
    }

    fn established() -> (Connection, UnixStream) {
        let (ours, host) = pair();
        let mut c = Connection::new_local(ours, 1 << 30, 52, GUEST, HOST);
        assert_eq!(c.next_rx(1024).unwrap().hdr.op, op::REQUEST);
        assert_eq!(
            c.handle_tx(guest_pkt(op::RESPONSE, 4096, 0, &[])),
            TxOutcome::Ok
        );
        assert_eq!(c.state, ConnState::Established);
        (c, host)
    }

    fn read_all(s: &mut UnixStream) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        out
    }

    #[test]
    fn host_initiated_connection_acks_the_host_once_the_guest_responds() {
        let (_c, mut host) = established();
        assert_eq!(read_all(&mut host), b"OK 1073741824\n");
    }

    #[test]
    fn guest_data_reaches_the_host_and_credit_is_returned() {
        let (mut c, mut host) = established();
        read_all(&mut host);
        let chunk = vec![7u8; CREDIT_UPDATE_THRESHOLD as usize];
        assert_eq!(
            c.handle_tx(guest_pkt(op::RW, 4096, 0, &chunk)),
            TxOutcome::Ok
        );
        assert_eq!(read_all(&mut host), chunk);
        let update = c.next_rx(1024).unwrap();
        assert_eq!(update.hdr.op, op::CREDIT_UPDATE);
        assert_eq!(update.hdr.fwd_cnt, CREDIT_UPDATE_THRESHOLD);
        assert_eq!(update.hdr.buf_alloc, TX_BUF_SIZE);
    }

    #[test]
    fn host_data_is_limited_by_guest_credit() {
        let (mut c, mut host) = established();
        host.write_all(&[1u8; 10_000]).unwrap();
        c.notify_readable();
        let p = c.next_rx(65536).unwrap();
        assert_eq!(
            (p.hdr.op, p.data.len()),
            (op::RW, 4096),
            "guest advertised 4096 bytes"
        );
        assert_eq!(c.peer_credit(), 0);
        assert!(!c.wants_read());
        // Out of credit: ask the guest for an update, send no data.
        assert_eq!(c.next_rx(65536).unwrap().hdr.op, op::CREDIT_REQUEST);
        assert!(c.next_rx(65536).is_none());
        // The guest consumed everything.
        c.handle_tx(guest_pkt(op::CREDIT_UPDATE, 4096, 4096, &[]));
        assert_eq!(c.next_rx(65536).unwrap().data.len(), 4096);
    }

    #[test]
    fn credit_overrun_by_the_guest_resets_the_connection() {
        let (mut c, host) = established();
        drop(host); // nothing drains the host side...
        let (ours, _keep) = pair();
        c.stream = ours; // ...and a fresh peer that never reads
        let big = vec![0u8; 64 * 1024];
        let mut outcome = TxOutcome::Ok;
        for _ in 0..(TX_BUF_SIZE as usize / big.len() + 4) {
            outcome = c.handle_tx(guest_pkt(op::RW, 4096, 0, &big));
            if outcome == TxOutcome::Violation {
                break;
            }
        }
        assert_eq!(outcome, TxOutcome::Violation);
        assert_eq!(c.state, ConnState::Killed);
        assert_eq!(c.next_rx(0).unwrap().hdr.op, op::RST);
    }

    #[test]
    fn host_eof_becomes_a_shutdown_for_the_guest() {
        let (mut c, mut host) = established();
        read_all(&mut host);
        drop(host);
        c.notify_readable();
        assert!(c.has_rx());
        let p = c.next_rx(1024).unwrap();
        assert_eq!((p.hdr.op, p.hdr.flags), (op::SHUTDOWN, SHUTDOWN_SEND));
        assert!(!c.wants_read());
    }

    #[test]
    fn host_stream_error_becomes_a_reset() {
        let (mut c, host) = established();
        drop(host); // unread "OK" line: our next read fails with ECONNRESET
        c.notify_readable();
        assert_eq!(c.next_rx(1024).unwrap().hdr.op, op::RST);
        assert_eq!(c.state, ConnState::Killed);
    }

    #[test]
    fn guest_full_shutdown_with_empty_buffer_resets() {
        let (mut c, _host) = established();
        let mut p = guest_pkt(op::SHUTDOWN, 4096, 0, &[]);
        p.hdr.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        c.handle_tx(p);
        assert_eq!(c.state, ConnState::Killed);
        assert_eq!(c.next_rx(0).unwrap().hdr.op, op::RST);
    }

    #[test]
    fn data_before_the_response_is_a_violation() {
        let (ours, _host) = pair();
        let mut c = Connection::new_local(ours, 1 << 30, 52, GUEST, HOST);
        assert_eq!(
            c.handle_tx(guest_pkt(op::RW, 4096, 0, b"x")),
            TxOutcome::Violation
        );
        assert_eq!(c.state, ConnState::Killed);
    }

    #[test]
    fn guest_rst_kills_without_reply() {
        let (mut c, _host) = established();
        c.handle_tx(guest_pkt(op::RST, 0, 0, &[]));
        assert_eq!(c.state, ConnState::Killed);
    }
}
