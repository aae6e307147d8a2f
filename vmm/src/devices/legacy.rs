//! Legacy PC devices: the COM1 UART (the guest console) and the i8042 keyboard controller,
//! whose only job is the CPU reset that ends the VM (`reboot=k`).

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::BusDevice;

/// An [`EventFd`] as a vm-superio interrupt/reset trigger.
#[derive(Debug)]
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// The line `airlock-agent` prints once userspace is up (a stable contract).
pub const READY_LINE: &[u8] = b"airlock: userspace up";
/// The start of the line a panicking Linux kernel prints.
pub const PANIC_MARKER: &[u8] = b"Kernel panic - not syncing";
/// Longest console line the watcher buffers; longer lines are scanned in pieces.
const MAX_LINE: usize = 512;

/// What the console has shown so far, shared with the VMM's event loop.
#[derive(Debug)]
pub struct ConsoleEvents {
    start: Instant,
    ready_at_us: AtomicU64,
    panicked: AtomicBool,
    bytes_dropped: AtomicU64,
    /// Written when the guest reaches userspace or panics, to wake the event loop.
    pub notify: EventFd,
}

impl ConsoleEvents {
    /// Fresh state; times are measured from `start`.
    pub fn new(start: Instant) -> std::io::Result<Self> {
        Ok(Self {
            start,
            ready_at_us: AtomicU64::new(0),
            panicked: AtomicBool::new(false),
            bytes_dropped: AtomicU64::new(0),
            notify: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    /// Microseconds from VMM start to the readiness line, once it has appeared.
    pub fn ready_after_us(&self) -> Option<u64> {
        match self.ready_at_us.load(Ordering::Acquire) {
            0 => None,
            us => Some(us),
        }
    }

    /// Whether the guest kernel printed a panic.
    pub fn panicked(&self) -> bool {
        self.panicked.load(Ordering::Acquire)
    }

    /// Console bytes discarded after the output limit.
    pub fn bytes_dropped(&self) -> u64 {
        self.bytes_dropped.load(Ordering::Relaxed)
    }

    fn mark_ready(&self) {
        let us = (self.start.elapsed().as_micros() as u64).max(1);
        if self
            .ready_at_us
            .compare_exchange(0, us, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _ = self.notify.write(1);
        }
    }

    fn mark_panic(&self) {
        if !self.panicked.swap(true, Ordering::AcqRel) {
            let _ = self.notify.write(1);
        }
    }
}

/// Where guest console output goes: copied to `out` up to `limit` bytes, and scanned line by
/// line for [`READY_LINE`] and [`PANIC_MARKER`].
pub struct ConsoleSink {
    out: Box<dyn Write + Send>,
    line: Vec<u8>,
    written: u64,
    limit: u64,
    events: Arc<ConsoleEvents>,
}

impl std::fmt::Debug for ConsoleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSink")
            .field("written", &self.written)
            .finish()
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

impl ConsoleSink {
    /// A sink writing to `out`, keeping at most `limit` bytes of guest output.
    pub fn new(out: Box<dyn Write + Send>, limit: u64, events: Arc<ConsoleEvents>) -> Self {
        Self {
            out,
            line: Vec::with_capacity(MAX_LINE),
            written: 0,
            limit,
            events,
        }
    }

    fn scan_line(&mut self) {
        if contains(&self.line, READY_LINE) {
            self.events.mark_ready();
        }
        if contains(&self.line, PANIC_MARKER) {
            self.events.mark_panic();
        }
        self.line.clear();
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            if b == b'\n' || self.line.len() >= MAX_LINE {
                self.scan_line();
            }
            if b != b'\n' {
                self.line.push(b);
            }
        }
        let room = self.limit.saturating_sub(self.written) as usize;
        let keep = buf.len().min(room);
        if keep < buf.len() {
            self.events
                .bytes_dropped
                .fetch_add((buf.len() - keep) as u64, Ordering::Relaxed);
        }
        if keep > 0 {
            // The console is best effort: a closed stdout must not stop the guest.
            let _ = self.out.write_all(&buf[..keep]);
            self.written += keep as u64;
            if buf[..keep].contains(&b'\n') {
                let _ = self.out.flush();
            }
        }
        Ok(buf.len())
    }

    /// vm-superio flushes after every byte; only a newline (above) or the end of the VM
    /// flushes for real, so each byte does not cost a system call.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for ConsoleSink {
    fn drop(&mut self) {
        let _ = self.out.flush();
    }
}

/// The guest console: a 16550A UART on COM1.
pub type ConsoleSerial = Serial<EventFdTrigger, vm_superio::serial::NoEvents, ConsoleSink>;

/// COM1 on the PIO bus.
#[derive(Debug)]
pub struct SerialDevice(pub ConsoleSerial);

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(off), [first, rest @ ..]) = (u8::try_from(offset), data) {
            *first = self.0.read(off);
            rest.fill(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), Some(&value)) = (u8::try_from(offset), data.first())
            && let Err(e) = self.0.write(off, value)
        {
            crate::warn_ratelimited!("serial write failed: {e:?}");
        }
    }
}

/// The i8042 controller on the PIO bus; its reset command writes the reset event.
#[derive(Debug)]
pub struct I8042(pub I8042Device<EventFdTrigger>);

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = u8::try_from(offset).map(|o| self.0.read(o)).unwrap_or(0);
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = value;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(off), Some(&value)) = (u8::try_from(offset), data.first())
            && let Err(e) = self.0.write(off, value)
        {
            log::error!("i8042 reset event: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn sink(limit: u64) -> (ConsoleSink, Shared, Arc<ConsoleEvents>) {
        let out = Shared::default();
        let ev = Arc::new(ConsoleEvents::new(Instant::now()).unwrap());
        (
            ConsoleSink::new(Box::new(out.clone()), limit, ev.clone()),
            out,
            ev,
        )
    }

    #[test]
    fn ready_line_is_detected_across_byte_writes() {
        let (mut s, out, ev) = sink(1 << 20);
        for b in b"boot noise\nairlock: userspace up\n" {
            s.write_all(&[*b]).unwrap();
        }
        assert!(ev.ready_after_us().is_some());
        assert!(!ev.panicked());
        assert_eq!(ev.notify.read().unwrap(), 1);
        assert_eq!(out.0.lock().unwrap().len(), 33);
    }

    #[test]
    fn panic_line_is_detected() {
        let (mut s, _, ev) = sink(1 << 20);
        s.write_all(b"[ 1.0] Kernel panic - not syncing: Attempted to kill init!\n")
            .unwrap();
        assert!(ev.panicked());
        assert!(ev.ready_after_us().is_none());
    }

    #[test]
    fn output_beyond_limit_is_dropped_and_counted_but_still_scanned() {
        let (mut s, out, ev) = sink(4);
        let input = b"abcdef\nairlock: userspace up\n";
        s.write_all(input).unwrap();
        assert_eq!(out.0.lock().unwrap().as_slice(), b"abcd");
        assert_eq!(ev.bytes_dropped(), input.len() as u64 - 4);
        assert!(ev.ready_after_us().is_some());
    }

    #[test]
    fn endless_line_does_not_grow_the_buffer() {
        let (mut s, _, _) = sink(0);
        s.write_all(&vec![b'x'; 100_000]).unwrap();
        assert!(s.line.len() <= MAX_LINE);
    }
}
