//! The host side of virtio-vsock ("hybrid vsock"): guest connections become Unix streams.
//!
//! - Host → guest: a host process connects to the Unix socket at `uds_path` and writes
//!   `CONNECT <port>\n`; once the guest accepts on that port the host reads `OK <host_port>\n`
//!   and then the stream carries the connection's bytes. If the guest refuses, the stream closes.
//! - Guest → host: a guest connection to host CID 2, port P, connects to the Unix socket
//!   `<uds_path>_P`, where a host process must be listening; otherwise the guest gets a reset.
//!
//! Everything is bounded: connections ([`MAX_CONNECTIONS`]), handshakes in progress
//! ([`MAX_PENDING_HOST`], each line at most [`MAX_CONNECT_LINE`] bytes), queued control packets
//! ([`MAX_CONTROL_QUEUE`]), and per-connection buffers (see `connection.rs`).

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::connection::{ConnState, Connection, TxOutcome};
use super::metrics::VsockMetrics;
use super::packet::{Header, Packet, TYPE_STREAM, op};

/// The host's CID.
pub const HOST_CID: u64 = 2;
/// Most live connections per VM.
pub const MAX_CONNECTIONS: usize = 256;
/// Most host connections still sending their `CONNECT` line.
pub const MAX_PENDING_HOST: usize = 32;
/// Longest `CONNECT <port>\n` line accepted.
pub const MAX_CONNECT_LINE: usize = 32;
/// Most control packets (resets for unknown connections) waiting for RX buffers.
pub const MAX_CONTROL_QUEUE: usize = 256;
/// Host-side ports for host-initiated connections start here.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// (host-side port, guest-side port).
type ConnKey = (u32, u32);

/// Poll interest the event loop should hold for one fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interest {
    pub read: bool,
    pub write: bool,
}

/// A host stream that has not finished its `CONNECT` line.
#[derive(Debug)]
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
}

/// Registration changes for the event loop.
#[derive(Debug)]
pub enum FdChange {
    /// Start watching (or update) an fd.
    Watch(RawFd, Interest),
    /// Stop watching; the stream is handed over so that it is closed only after that.
    Forget(UnixStream),
}

/// The connection table and everything waiting to go to the guest.
#[derive(Debug)]
pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    pending_host: HashMap<RawFd, PendingHost>,
    conns: HashMap<ConnKey, Connection>,
    by_fd: HashMap<RawFd, ConnKey>,
    /// Connections that may have something for the guest, in arrival order.
    rx_queue: VecDeque<ConnKey>,
    control: VecDeque<Packet>,
    next_local_port: u32,
    changes: Vec<FdChange>,
    /// Last interest announced per fd, so unchanged interest costs no epoll_ctl.
    interest: HashMap<RawFd, Interest>,
    pub metrics: Arc<VsockMetrics>,
}

/// Errors creating the muxer.
#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    #[error("bind the vsock Unix socket {0}")]
    Bind(String, #[source] std::io::Error),
}

impl Muxer {
    /// Listens on `uds_path` (replacing a stale socket file there).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, MuxerError> {
        let _ = std::fs::remove_file(uds_path);
        let bind_err = |e| MuxerError::Bind(uds_path.display().to_string(), e);
        let listener = UnixListener::bind(uds_path).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            pending_host: HashMap::new(),
            conns: HashMap::new(),
            by_fd: HashMap::new(),
            rx_queue: VecDeque::new(),
            control: VecDeque::new(),
            next_local_port: first_local_port(),
            changes: Vec::new(),
            interest: HashMap::new(),
            metrics: Arc::new(VsockMetrics::default()),
        })
    }

    /// The listening socket's fd (watched for new host connections).
    pub fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Whether `fd` is one of ours (listener, handshake or connection).
    pub fn owns_fd(&self, fd: RawFd) -> bool {
        fd == self.listener_fd()
            || self.pending_host.contains_key(&fd)
            || self.by_fd.contains_key(&fd)
    }

    /// Registration changes since the last call.
    pub fn take_changes(&mut self) -> Vec<FdChange> {
        std::mem::take(&mut self.changes)
    }

    /// Handles readiness of one of our fds.
    pub fn handle_fd_event(&mut self, fd: RawFd, readable: bool, writable: bool) {
        if fd == self.listener_fd() {
            self.accept_host_connections();
        } else if self.pending_host.contains_key(&fd) {
            self.read_connect_line(fd);
        } else if let Some(&key) = self.by_fd.get(&fd) {
            if let Some(conn) = self.conns.get_mut(&key) {
                if writable {
                    conn.flush_tx();
                }
                if readable {
                    conn.notify_readable();
                }
            }
            self.after_conn_change(key);
        }
    }

    fn accept_host_connections(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.add_pending_host(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    crate::warn_ratelimited!("vsock: accept on {}: {e}", self.uds_path.display());
                    return;
                }
            }
        }
    }

    fn add_pending_host(&mut self, stream: UnixStream) {
        if self.pending_host.len() >= MAX_PENDING_HOST || stream.set_nonblocking(true).is_err() {
            self.metrics
                .host_connections_refused
                .fetch_add(1, Ordering::Relaxed);
            return; // dropping the stream closes it
        }
        let fd = stream.as_raw_fd();
        self.watch(
            fd,
            Interest {
                read: true,
                write: false,
            },
        );
        self.pending_host.insert(
            fd,
            PendingHost {
                stream,
                line: Vec::new(),
            },
        );
    }

    fn read_connect_line(&mut self, fd: RawFd) {
        let Some(mut p) = self.pending_host.remove(&fd) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let room = MAX_CONNECT_LINE - p.line.len();
        match p.stream.read(&mut buf[..room]) {
            Ok(0) => return self.forget(p.stream),
            Ok(n) => p.line.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return self.forget(p.stream),
        }
        let Some(end) = p.line.iter().position(|b| *b == b'\n') else {
            if p.line.len() >= MAX_CONNECT_LINE {
                self.metrics
                    .host_connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                return self.forget(p.stream);
            }
            self.pending_host.insert(fd, p);
            return;
        };
        // Bytes after the newline would be connection data sent before the guest accepted;
        // the protocol does not allow that.
        let port = parse_connect_line(&p.line[..end]).filter(|_| end + 1 == p.line.len());
        match port {
            Some(port) if self.conns.len() < MAX_CONNECTIONS => {
                self.connect_to_guest(p.stream, port)
            }
            _ => {
                self.metrics
                    .host_connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                self.forget(p.stream);
            }
        }
    }

    fn connect_to_guest(&mut self, stream: UnixStream, peer_port: u32) {
        let local_port = self.allocate_local_port(peer_port);
        let conn = Connection::new_local(stream, local_port, peer_port, self.guest_cid, HOST_CID);
        self.insert_conn(conn);
    }

    fn allocate_local_port(&mut self, peer_port: u32) -> u32 {
        loop {
            let port = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.conns.contains_key(&(port, peer_port)) {
                return port;
            }
        }
    }

    fn insert_conn(&mut self, conn: Connection) {
        let key = (conn.local_port, conn.peer_port);
        let fd = conn.stream.as_raw_fd();
        self.by_fd.insert(fd, key);
        self.conns.insert(key, conn);
        self.metrics
            .connections_opened
            .fetch_add(1, Ordering::Relaxed);
        self.after_conn_change(key);
    }

    fn forget(&mut self, stream: UnixStream) {
        self.interest.remove(&stream.as_raw_fd());
        self.changes.push(FdChange::Forget(stream));
    }

    fn watch(&mut self, fd: RawFd, interest: Interest) {
        if self.interest.insert(fd, interest) != Some(interest) {
            self.changes.push(FdChange::Watch(fd, interest));
        }
    }

    /// Queues the connection for RX if it has something, and updates its poll interest.
    fn after_conn_change(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        if conn.has_rx() && !self.rx_queue.contains(&key) {
            self.rx_queue.push_back(key);
        }
        if conn.state == ConnState::Killed && !conn.has_rx() {
            self.remove_conn(key);
            return;
        }
        let interest = Interest {
            read: conn.wants_read(),
            write: conn.wants_write(),
        };
        let fd = conn.stream.as_raw_fd();
        self.watch(fd, interest);
    }

    fn remove_conn(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.remove(&key) {
            self.by_fd.remove(&conn.stream.as_raw_fd());
            self.metrics
                .connections_closed
                .fetch_add(1, Ordering::Relaxed);
            self.forget(conn.stream);
        }
    }

    /// Handles one packet the guest sent.
    pub fn send_to_host(&mut self, pkt: Packet) {
        let hdr = pkt.hdr;
        if hdr.src_cid != self.guest_cid || hdr.dst_cid != HOST_CID || hdr.type_ != TYPE_STREAM {
            self.metrics.bad_packets.fetch_add(1, Ordering::Relaxed);
            crate::warn_ratelimited!("vsock: dropped packet with bad addressing or type: {hdr:?}");
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        if self.conns.contains_key(&key) {
            let outcome = self.conns.get_mut(&key).map(|c| c.handle_tx(pkt));
            if outcome == Some(TxOutcome::Violation) {
                self.metrics
                    .protocol_violations
                    .fetch_add(1, Ordering::Relaxed);
                crate::warn_ratelimited!(
                    "vsock: guest port {} broke the protocol; reset",
                    hdr.src_port
                );
            }
            self.after_conn_change(key);
        } else if hdr.op == op::REQUEST {
            self.connect_to_host(&hdr);
        } else if hdr.op != op::RST {
            self.queue_control(reset_for(&hdr));
        }
    }

    /// A guest connection to host port P: connect to `<uds_path>_P`.
    fn connect_to_host(&mut self, hdr: &Header) {
        let path = format!("{}_{}", self.uds_path.display(), hdr.dst_port);
        let stream = match UnixStream::connect(&path) {
            Ok(s) if self.conns.len() < MAX_CONNECTIONS && s.set_nonblocking(true).is_ok() => s,
            _ => {
                self.metrics
                    .guest_connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                return self.queue_control(reset_for(hdr));
            }
        };
        self.insert_conn(Connection::new_peer(stream, hdr, self.guest_cid, HOST_CID));
    }

    fn queue_control(&mut self, pkt: Packet) {
        if self.control.len() >= MAX_CONTROL_QUEUE {
            self.metrics.control_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.control.push_back(pkt);
    }

    /// Whether a packet is waiting for the guest.
    pub fn has_rx(&self) -> bool {
        !self.control.is_empty() || !self.rx_queue.is_empty()
    }

    /// The next packet for the guest, with at most `max_data` payload bytes.
    pub fn next_rx(&mut self, max_data: usize) -> Option<Packet> {
        if let Some(p) = self.control.pop_front() {
            return Some(p);
        }
        while let Some(key) = self.rx_queue.pop_front() {
            let pkt = self.conns.get_mut(&key).and_then(|c| c.next_rx(max_data));
            self.after_conn_change(key);
            if pkt.is_some() {
                return pkt;
            }
        }
        None
    }

    /// Resets every connection (the guest's transport was reset, e.g. after a restore).
    pub fn reset_all(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.remove_conn(key);
        }
        self.rx_queue.clear();
        self.control.clear();
        let pending: Vec<RawFd> = self.pending_host.keys().copied().collect();
        for fd in pending {
            if let Some(p) = self.pending_host.remove(&fd) {
                self.forget(p.stream);
            }
        }
    }
}

/// A RST answering `hdr`.
fn reset_for(hdr: &Header) -> Packet {
    Packet {
        hdr: Header {
            src_cid: hdr.dst_cid,
            dst_cid: hdr.src_cid,
            src_port: hdr.dst_port,
            dst_port: hdr.src_port,
            len: 0,
            type_: TYPE_STREAM,
            op: op::RST,
            ..Header::default()
        },
        data: Vec::new(),
    }
}

/// Where this VMM's host-side ports start: at a random place above [`FIRST_LOCAL_PORT`]. A
/// clone's guest may still hold a closing connection of the VM it was snapshotted from, on a
/// port that VM's muxer handed out; a clone whose muxer counted from the same start would ask
/// for that port pair again and be refused (seen: a ReadFile right after a SnapshotSandbox of a
/// sandbox that had just written a file got `connection closed` in the handshake).
fn first_local_port() -> u32 {
    FIRST_LOCAL_PORT + vmm_sys_util::rand::xor_pseudo_rng_u32() % FIRST_LOCAL_PORT
}

/// Parses `CONNECT <port>`.
fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?;
    let port = s.strip_prefix("CONNECT ")?.trim_end_matches('\r');
    port.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const GUEST: u64 = 3;

    fn tmp_sock(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!("airlock-vsock-{tag}-{}", std::process::id()))
    }

    fn guest_hdr(op: u16, src_port: u32, dst_port: u32) -> Header {
        Header {
            src_cid: GUEST,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            type_: TYPE_STREAM,
            op,
            buf_alloc: 65536,
            ..Header::default()
        }
    }

    #[test]
    fn connect_line_parsing() {
        assert_eq!(parse_connect_line(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT x"), None);
        assert_eq!(parse_connect_line(b"connect 52"), None);
        assert_eq!(parse_connect_line(&[0xff, 0xfe]), None);
    }

    #[test]
    fn host_connect_becomes_a_guest_request_and_ok_line() {
        let path = tmp_sock("hostconn");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        let mut host = UnixStream::connect(&path).unwrap();
        host.write_all(b"CONNECT 52\n").unwrap();
        let lfd = m.listener_fd();
        m.handle_fd_event(lfd, true, false);
        let fd = *m.pending_host.keys().next().unwrap();
        m.handle_fd_event(fd, true, false);
        let req = m.next_rx(4096).unwrap();
        assert_eq!(
            (req.hdr.op, req.hdr.dst_port, req.hdr.dst_cid),
            (op::REQUEST, 52, GUEST)
        );
        let mut resp = guest_hdr(op::RESPONSE, 52, req.hdr.src_port);
        resp.buf_alloc = 65536;
        m.send_to_host(Packet {
            hdr: resp,
            data: vec![],
        });
        let mut line = [0u8; 32];
        let n = host.read(&mut line).unwrap();
        assert_eq!(&line[..n], format!("OK {}\n", req.hdr.src_port).as_bytes());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn bad_connect_line_closes_the_stream() {
        let path = tmp_sock("badline");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        let mut host = UnixStream::connect(&path).unwrap();
        host.write_all(&[b'A'; 40]).unwrap();
        let lfd = m.listener_fd();
        m.handle_fd_event(lfd, true, false);
        let fd = *m.pending_host.keys().next().unwrap();
        m.handle_fd_event(fd, true, false);
        assert!(m.pending_host.is_empty());
        assert!(
            m.take_changes()
                .iter()
                .any(|c| matches!(c, FdChange::Forget(_)))
        );
        assert_eq!(
            m.metrics.host_connections_refused.load(Ordering::Relaxed),
            1
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn guest_connect_to_a_missing_host_port_is_reset() {
        let path = tmp_sock("noport");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        m.send_to_host(Packet {
            hdr: guest_hdr(op::REQUEST, 1000, 9999),
            data: vec![],
        });
        let rst = m.next_rx(4096).unwrap();
        assert_eq!(
            (rst.hdr.op, rst.hdr.dst_port, rst.hdr.src_port),
            (op::RST, 1000, 9999)
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn guest_connect_to_a_listening_host_port_is_accepted() {
        let path = tmp_sock("hostport");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        let host_listener = UnixListener::bind(format!("{}_7000", path.display())).unwrap();
        m.send_to_host(Packet {
            hdr: guest_hdr(op::REQUEST, 1000, 7000),
            data: vec![],
        });
        assert_eq!(m.next_rx(4096).unwrap().hdr.op, op::RESPONSE);
        let (mut s, _) = host_listener.accept().unwrap();
        m.send_to_host(Packet {
            hdr: guest_hdr(op::RW, 1000, 7000),
            data: b"hi".to_vec(),
        });
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(format!("{}_7000", path.display()));
    }

    #[test]
    fn packets_for_unknown_connections_get_a_reset_and_bad_addresses_are_dropped() {
        let path = tmp_sock("unknown");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        m.send_to_host(Packet {
            hdr: guest_hdr(op::RW, 1, 2),
            data: b"x".to_vec(),
        });
        assert_eq!(m.next_rx(4096).unwrap().hdr.op, op::RST);
        let mut spoofed = guest_hdr(op::REQUEST, 1, 2);
        spoofed.src_cid = 99;
        m.send_to_host(Packet {
            hdr: spoofed,
            data: vec![],
        });
        assert!(!m.has_rx());
        assert_eq!(m.metrics.bad_packets.load(Ordering::Relaxed), 1);
        // A RST for an unknown connection is not answered.
        m.send_to_host(Packet {
            hdr: guest_hdr(op::RST, 1, 2),
            data: vec![],
        });
        assert!(!m.has_rx());
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn control_queue_is_bounded() {
        let path = tmp_sock("flood");
        let mut m = Muxer::new(GUEST, &path).unwrap();
        for i in 0..(MAX_CONTROL_QUEUE as u32 + 10) {
            m.send_to_host(Packet {
                hdr: guest_hdr(op::RW, i, 2),
                data: vec![],
            });
        }
        assert_eq!(m.control.len(), MAX_CONTROL_QUEUE);
        assert_eq!(m.metrics.control_dropped.load(Ordering::Relaxed), 10);
        let _ = std::fs::remove_file(&path);
    }
}
