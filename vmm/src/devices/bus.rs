//! Address-range dispatch of PIO and MMIO exits to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use thiserror::Error;

/// A device on a bus: reads and writes at an offset from its base address. Implementations
/// must tolerate any offset and any access size: both come from the guest.
pub trait BusDevice: Send {
    /// Fills `data` for a guest read at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a guest write of `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors inserting a device.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BusError {
    #[error("device range {base:#x}+{len:#x} overlaps another device")]
    Overlap { base: u64, len: u64 },
    #[error("device range {base:#x}+{len:#x} is empty or wraps around")]
    InvalidRange { base: u64, len: u64 },
}

/// A shared device handle.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// Devices by address range. Built before the vCPUs start, then shared read-only.
#[derive(Default)]
pub struct Bus {
    devices: BTreeMap<u64, (u64, SharedDevice)>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ranges: Vec<(u64, u64)> = self.devices.iter().map(|(b, (l, _))| (*b, *l)).collect();
        f.debug_struct("Bus").field("ranges", &ranges).finish()
    }
}

impl Bus {
    /// Adds `device` at `[base, base + len)`.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0);
        let Some(end) = end else {
            return Err(BusError::InvalidRange { base, len });
        };
        let overlaps_prev = self
            .devices
            .range(..end)
            .next_back()
            .is_some_and(|(b, (l, _))| b + l > base);
        if overlaps_prev {
            return Err(BusError::Overlap { base, len });
        }
        self.devices.insert(base, (len, device));
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let (base, (len, dev)) = self.devices.range(..=addr).next_back()?;
        (addr - base < *len).then_some((addr - base, dev))
    }

    /// Dispatches a read; `false` if no device claims `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((offset, dev)) = self.find(addr) else {
            return false;
        };
        // A device that panicked while holding the lock left it poisoned; its state is still
        // the best we have, and the guest must not be able to turn that into a host panic.
        dev.lock()
            .unwrap_or_else(|e| e.into_inner())
            .read(offset, data);
        true
    }

    /// Dispatches a write; `false` if no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((offset, dev)) = self.find(addr) else {
            return false;
        };
        dev.lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(offset, data);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last_write: Option<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write = Some((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_to_device_with_offset() {
        let dev = Arc::new(Mutex::new(Recorder::default()));
        let mut bus = Bus::default();
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        let mut buf = [0u8; 2];
        assert!(bus.read(0x105, &mut buf));
        assert_eq!(buf, [5, 5]);
        assert!(bus.write(0x10f, &[9]));
        assert_eq!(dev.lock().unwrap().last_write, Some((0xf, vec![9])));
    }

    #[test]
    fn addresses_outside_every_device_are_unclaimed() {
        let mut bus = Bus::default();
        bus.insert(Arc::new(Mutex::new(Recorder::default())), 0x100, 0x10)
            .unwrap();
        assert!(!bus.read(0xff, &mut [0]));
        assert!(!bus.write(0x110, &[0]));
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = Bus::default();
        let d = || Arc::new(Mutex::new(Recorder::default())) as SharedDevice;
        bus.insert(d(), 0x100, 0x10).unwrap();
        assert_eq!(
            bus.insert(d(), 0x10f, 1),
            Err(BusError::Overlap {
                base: 0x10f,
                len: 1
            })
        );
        assert_eq!(
            bus.insert(d(), 0xf8, 0x9),
            Err(BusError::Overlap { base: 0xf8, len: 9 })
        );
        assert!(matches!(
            bus.insert(d(), 0x200, 0),
            Err(BusError::InvalidRange { .. })
        ));
        assert!(matches!(
            bus.insert(d(), u64::MAX, 2),
            Err(BusError::InvalidRange { .. })
        ));
        bus.insert(d(), 0x110, 0x10).unwrap();
    }
}
