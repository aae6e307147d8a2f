//! The virtio-mmio transport (virtio 1.2 §4.2, version 2 register layout).
//!
//! Every register access comes from the guest: any offset, any size, any order. Accesses that the
//! specification does not allow are ignored, counted and logged (rate-limited); the device status
//! only moves along the driver initialisation sequence.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::{VIRTIO_F_VERSION_1, VirtioDevice, VirtioInterrupt};
use crate::devices::bus::BusDevice;

const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
/// "AIRL", reported as the vendor id.
const VENDOR_ID: u32 = 0x4c52_4941;

/// Guest accesses the transport refused, for the device's metrics.
#[derive(Debug, Default)]
pub struct TransportMetrics {
    pub bad_accesses: AtomicU64,
    pub bad_status_transitions: AtomicU64,
    pub activate_failures: AtomicU64,
}

/// A virtio device behind the mmio register window.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemoryMmap,
    interrupt: Arc<VirtioInterrupt>,
    queues: Vec<Queue>,
    features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    queue_select: u32,
    status: u32,
    config_generation: u32,
    pub metrics: Arc<TransportMetrics>,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("status", &self.status)
            .finish()
    }
}

fn fresh_queues(device: &dyn VirtioDevice) -> Vec<Queue> {
    device
        .queue_max_sizes()
        .iter()
        // Queue sizes are our own constants, powers of two; a bad one is a programming error
        // caught by the device's unit tests, and falls back to the smallest valid queue.
        .map(|&max| Queue::new(max).or_else(|_| Queue::new(1)))
        .collect::<Result<_, _>>()
        .unwrap_or_default()
}

fn lock<'a>(
    dev: &'a Mutex<dyn VirtioDevice + 'static>,
) -> std::sync::MutexGuard<'a, dyn VirtioDevice + 'static> {
    dev.lock().unwrap_or_else(|e| e.into_inner())
}

impl MmioTransport {
    /// Puts `device` behind a transport raising `interrupt`.
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Self {
        let queues = fresh_queues(&*lock(&device));
        Self {
            device,
            mem,
            interrupt,
            queues,
            features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            queue_select: 0,
            status: 0,
            config_generation: 0,
            metrics: Arc::new(TransportMetrics::default()),
        }
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    fn bad_access(&self, what: &str, offset: u64) {
        self.metrics.bad_accesses.fetch_add(1, Ordering::Relaxed);
        crate::warn_ratelimited!("virtio-mmio: ignored {what} at offset {offset:#x}");
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// Queue registers may change only while the driver sets up, before DRIVER_OK.
    fn queue_config_allowed(&self) -> bool {
        self.status & (VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK)
            == VIRTIO_CONFIG_S_FEATURES_OK
    }

    fn read_register(&self, offset: u32) -> u32 {
        let dev = lock(&self.device);
        let queue = self.queues.get(self.queue_select as usize);
        match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MMIO_MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => dev.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.features_select {
                0 => dev.avail_features() as u32,
                1 => (dev.avail_features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => queue.map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => queue.map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt.status(),
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.config_generation,
            _ => {
                drop(dev);
                self.bad_access("register read", u64::from(offset));
                0
            }
        }
    }

    fn write_register(&mut self, offset: u32, v: u32) {
        let queue_ok = self.queue_config_allowed();
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.features_select = v,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_select = v,
            VIRTIO_MMIO_DRIVER_FEATURES => self.write_driver_features(v),
            VIRTIO_MMIO_QUEUE_SEL => self.queue_select = v,
            VIRTIO_MMIO_QUEUE_NUM if queue_ok => self.with_queue(|q| q.set_size(v as u16)),
            VIRTIO_MMIO_QUEUE_READY if queue_ok => self.with_queue(|q| q.set_ready(v == 1)),
            VIRTIO_MMIO_QUEUE_DESC_LOW if queue_ok => {
                self.with_queue(|q| q.set_desc_table_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH if queue_ok => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW if queue_ok => {
                self.with_queue(|q| q.set_avail_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH if queue_ok => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW if queue_ok => {
                self.with_queue(|q| q.set_used_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH if queue_ok => {
                self.with_queue(|q| q.set_used_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify_queue(v),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt.ack(v),
            VIRTIO_MMIO_STATUS => self.write_status(v),
            _ => self.bad_access("register write", u64::from(offset)),
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        match self.selected_queue() {
            Some(q) => f(q),
            None => self.bad_access("write to an absent queue", u64::from(self.queue_select)),
        }
    }

    fn write_driver_features(&mut self, v: u32) {
        let allowed = self.status & (VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK)
            == VIRTIO_CONFIG_S_DRIVER;
        if !allowed {
            return self.bad_access("feature write outside negotiation", 0x20);
        }
        match self.driver_features_select {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v),
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32),
            _ => self.bad_access(
                "feature word select",
                u64::from(self.driver_features_select),
            ),
        }
    }

    /// Only reached when no ioeventfd is registered for the notify address (KVM handles it
    /// otherwise): forward to the device's queue event.
    fn notify_queue(&mut self, index: u32) {
        let dev = lock(&self.device);
        match dev.queue_events().get(index as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    crate::warn_ratelimited!("virtio-mmio: queue notify: {e}");
                }
            }
            None => {
                drop(dev);
                self.bad_access("notify of an absent queue", u64::from(index));
            }
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            return self.reset();
        }
        let old = self.status;
        // The driver may only add bits, one initialisation step at a time (virtio 1.2 §3.1.1).
        let ok = v & old == old
            && match v & !old {
                VIRTIO_CONFIG_S_ACKNOWLEDGE => old == 0,
                VIRTIO_CONFIG_S_DRIVER => old == VIRTIO_CONFIG_S_ACKNOWLEDGE,
                VIRTIO_CONFIG_S_FEATURES_OK => {
                    old == VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER
                }
                VIRTIO_CONFIG_S_DRIVER_OK => old & VIRTIO_CONFIG_S_FEATURES_OK != 0,
                VIRTIO_CONFIG_S_FAILED => true,
                _ => false,
            };
        if !ok {
            self.metrics
                .bad_status_transitions
                .fetch_add(1, Ordering::Relaxed);
            crate::warn_ratelimited!("virtio-mmio: refused status change {old:#x} -> {v:#x}");
            return;
        }
        let added = v & !old;
        if added == VIRTIO_CONFIG_S_FEATURES_OK && !self.features_acceptable() {
            // Leave FEATURES_OK clear: the driver reads it back and gives up (§3.1.1 step 6).
            return;
        }
        self.status = v;
        if added == VIRTIO_CONFIG_S_FEATURES_OK {
            lock(&self.device).set_acked_features(self.driver_features);
        }
        if added == VIRTIO_CONFIG_S_DRIVER_OK {
            self.activate();
        }
    }

    fn features_acceptable(&self) -> bool {
        let offered = lock(&self.device).avail_features();
        self.driver_features & !offered == 0
            && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0
    }

    fn activate(&mut self) {
        let queues = std::mem::take(&mut self.queues);
        let invalid = queues.iter().position(|q| !q.is_valid(&self.mem));
        let mut dev = lock(&self.device);
        let result = match invalid {
            Some(i) => Err(super::ActivateError::InvalidQueue(i)),
            None => dev.activate(self.mem.clone(), queues, self.interrupt.clone()),
        };
        if let Err(e) = result {
            self.metrics
                .activate_failures
                .fetch_add(1, Ordering::Relaxed);
            crate::warn_ratelimited!(
                "virtio-mmio: activation of device type {} failed: {e}",
                dev.device_type()
            );
            self.queues = fresh_queues(&*dev);
            drop(dev);
            self.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
            self.interrupt.signal_config_change();
        }
    }

    fn reset(&mut self) {
        let mut dev = lock(&self.device);
        dev.reset();
        self.queues = fresh_queues(&*dev);
        drop(dev);
        self.status = 0;
        self.driver_features = 0;
        self.features_select = 0;
        self.driver_features_select = 0;
        self.queue_select = 0;
        self.interrupt.ack(u32::MAX);
    }
}

/// Why a transport's saved state cannot be restored.
#[derive(Debug, thiserror::Error)]
pub enum TransportRestoreError {
    #[error("{got} queue states for a device with {want} queues")]
    QueueCount { got: usize, want: usize },
    #[error("queue {0}: {1}")]
    BadQueue(usize, String),
    #[error("activate the device: {0}")]
    Activate(#[from] super::ActivateError),
}

impl MmioTransport {
    /// The transport's registers and the queues (the device's while it is active).
    pub fn snapshot(&self) -> crate::snapshot::TransportSnapshot {
        let dev = lock(&self.device);
        let queues = if dev.is_activated() {
            dev.active_queue_states()
        } else {
            self.queues.iter().map(Queue::state).collect()
        };
        crate::snapshot::TransportSnapshot {
            status: self.status,
            driver_features: self.driver_features,
            features_select: self.features_select,
            driver_features_select: self.driver_features_select,
            queue_select: self.queue_select,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            queues: queues.into_iter().map(Into::into).collect(),
        }
    }

    /// Puts a fresh transport (and its fresh device) into the saved state: registers, acked
    /// features, queues, and — if the driver had finished initialisation — the device
    /// activated on the saved queues. The queue states come from a file and are checked like
    /// driver writes are (sizes, and ring addresses inside guest memory on activation).
    pub fn restore(
        &mut self,
        state: &crate::snapshot::TransportSnapshot,
    ) -> Result<(), TransportRestoreError> {
        let mut dev = lock(&self.device);
        let want = dev.queue_max_sizes().len();
        if state.queues.len() != want {
            return Err(TransportRestoreError::QueueCount {
                got: state.queues.len(),
                want,
            });
        }
        let mut queues = Vec::with_capacity(want);
        for (i, (q, &max)) in state.queues.iter().zip(dev.queue_max_sizes()).enumerate() {
            if q.max_size != max {
                return Err(TransportRestoreError::BadQueue(
                    i,
                    format!("max size {} (the device has {max})", q.max_size),
                ));
            }
            let queue = Queue::try_from(virtio_queue::QueueState::from(q))
                .map_err(|e| TransportRestoreError::BadQueue(i, e.to_string()))?;
            queues.push(queue);
        }
        if state.status & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = dev.avail_features();
            dev.set_acked_features(state.driver_features & offered);
        }
        let live = state.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && state.status & (VIRTIO_CONFIG_S_NEEDS_RESET | VIRTIO_CONFIG_S_FAILED) == 0;
        if live {
            if let Some(i) = queues.iter().position(|q| !q.is_valid(&self.mem)) {
                return Err(super::ActivateError::InvalidQueue(i).into());
            }
            dev.activate(self.mem.clone(), queues, self.interrupt.clone())?;
            self.queues = Vec::new();
        } else {
            self.queues = queues;
        }
        drop(dev);
        self.status = state.status;
        self.driver_features = state.driver_features;
        self.features_select = state.features_select;
        self.driver_features_select = state.driver_features_select;
        self.queue_select = state.queue_select;
        self.config_generation = state.config_generation;
        self.interrupt.restore_status(state.interrupt_status);
        Ok(())
    }

    /// The device behind this transport.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The transport's interrupt line.
    pub fn interrupt(&self) -> &Arc<VirtioInterrupt> {
        &self.interrupt
    }

    /// Tells the driver that the device's configuration changed (a disk slot got its media):
    /// a new configuration generation and a configuration-change interrupt.
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.signal_config_change();
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            return lock(&self.device).read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return self.bad_access("unaligned register read", offset);
        }
        data.copy_from_slice(&self.read_register(offset as u32).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            return lock(&self.device).write_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return self.bad_access("register write of wrong size", offset);
        };
        if !offset.is_multiple_of(4) {
            return self.bad_access("unaligned register write", offset);
        }
        self.write_register(offset as u32, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::ActivateError;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    struct Dummy {
        active: bool,
        acked: u64,
        evts: Vec<EventFd>,
        resets: u32,
    }

    impl VirtioDevice for Dummy {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn avail_features(&self) -> u64 {
            (1 << VIRTIO_F_VERSION_1) | 0b10
        }
        fn set_acked_features(&mut self, f: u64) {
            self.acked = f;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            super::super::read_config_bytes(&[7, 8], offset, data);
        }
        fn write_config(&mut self, _: u64, _: &[u8]) {}
        fn activate(
            &mut self,
            _: GuestMemoryMmap,
            q: Vec<Queue>,
            _: Arc<VirtioInterrupt>,
        ) -> Result<(), ActivateError> {
            assert_eq!(q.len(), 1);
            self.active = true;
            Ok(())
        }
        fn reset(&mut self) {
            self.active = false;
            self.resets += 1;
        }
        fn is_activated(&self) -> bool {
            self.active
        }
        fn queue_events(&self) -> &[EventFd] {
            &self.evts
        }
        fn active_queue_states(&self) -> Vec<virtio_queue::QueueState> {
            Vec::new()
        }
    }

    fn setup() -> (MmioTransport, Arc<Mutex<Dummy>>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let dev = Arc::new(Mutex::new(Dummy {
            active: false,
            acked: 0,
            evts: vec![EventFd::new(libc::EFD_NONBLOCK).unwrap()],
            resets: 0,
        }));
        let irq = Arc::new(VirtioInterrupt::new(
            EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        ));
        (MmioTransport::new(mem, dev.clone(), irq), dev)
    }

    fn rd(t: &mut MmioTransport, off: u32) -> u32 {
        let mut b = [0u8; 4];
        t.read(u64::from(off), &mut b);
        u32::from_le_bytes(b)
    }

    fn wr(t: &mut MmioTransport, off: u32, v: u32) {
        t.write(u64::from(off), &v.to_le_bytes());
    }

    /// The Linux driver's sequence, with a valid queue at 0x1000.
    fn init(t: &mut MmioTransport, features_hi: u32) {
        wr(t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        wr(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        wr(t, VIRTIO_MMIO_DRIVER_FEATURES, features_hi);
        wr(t, VIRTIO_MMIO_STATUS, 0b1011);
    }

    fn setup_queue(t: &mut MmioTransport) {
        wr(t, VIRTIO_MMIO_QUEUE_SEL, 0);
        wr(t, VIRTIO_MMIO_QUEUE_NUM, 16);
        wr(t, VIRTIO_MMIO_QUEUE_DESC_LOW, 0x1000);
        wr(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, 0x2000);
        wr(t, VIRTIO_MMIO_QUEUE_USED_LOW, 0x3000);
        wr(t, VIRTIO_MMIO_QUEUE_READY, 1);
    }

    #[test]
    fn identification_registers() {
        let (mut t, _) = setup();
        assert_eq!(rd(&mut t, VIRTIO_MMIO_MAGIC_VALUE), MMIO_MAGIC);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_VERSION), 2);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_ID), 42);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 16);
        wr(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1);
    }

    #[test]
    fn full_initialisation_activates_the_device() {
        let (mut t, dev) = setup();
        init(&mut t, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_STATUS), 0b1011);
        assert_eq!(dev.lock().unwrap().acked, 1 << 32);
        setup_queue(&mut t);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0b1111);
        assert!(dev.lock().unwrap().active);
        assert_eq!(t.status(), 0b1111);
    }

    #[test]
    fn features_without_version_1_are_refused() {
        let (mut t, _) = setup();
        init(&mut t, 0);
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
            0
        );
    }

    #[test]
    fn unoffered_features_are_refused() {
        let (mut t, _) = setup();
        init(&mut t, 0b11);
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK,
            0
        );
    }

    #[test]
    fn skipping_a_status_step_is_refused_and_counted() {
        let (mut t, dev) = setup();
        wr(&mut t, VIRTIO_MMIO_STATUS, 0b1111);
        assert_eq!(t.status(), 0);
        assert!(!dev.lock().unwrap().active);
        assert_eq!(t.metrics.bad_status_transitions.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn driver_ok_with_an_invalid_queue_sets_needs_reset() {
        let (mut t, dev) = setup();
        init(&mut t, 1);
        wr(&mut t, VIRTIO_MMIO_QUEUE_NUM, 16);
        wr(&mut t, VIRTIO_MMIO_QUEUE_DESC_LOW, 0xfff0_0000); // outside guest memory
        wr(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0b1111);
        assert!(!dev.lock().unwrap().active);
        assert_ne!(t.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
        assert_eq!(t.metrics.activate_failures.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn writing_zero_status_resets() {
        let (mut t, dev) = setup();
        init(&mut t, 1);
        setup_queue(&mut t);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0b1111);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(t.status(), 0);
        assert_eq!(dev.lock().unwrap().resets, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_READY), 0);
    }

    #[test]
    fn queue_registers_are_frozen_after_driver_ok() {
        let (mut t, _) = setup();
        init(&mut t, 1);
        setup_queue(&mut t);
        wr(&mut t, VIRTIO_MMIO_STATUS, 0b1111);
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(
            rd(&mut t, VIRTIO_MMIO_QUEUE_READY),
            0,
            "queues moved into the device"
        );
        wr(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_READY), 0);
    }

    #[test]
    fn hostile_accesses_do_not_panic() {
        let (mut t, _) = setup();
        let mut one = [0u8; 1];
        t.read(0x3, &mut one);
        t.write(0x1, &[1, 2, 3]);
        t.write(0x0, &[1]);
        wr(&mut t, VIRTIO_MMIO_QUEUE_SEL, 999);
        assert_eq!(rd(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        wr(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 999);
        wr(&mut t, 0xabc, 1);
        let mut big = [0u8; 8];
        t.read(u64::MAX, &mut big);
        assert!(t.metrics.bad_accesses.load(Ordering::Relaxed) >= 4);
    }

    #[test]
    fn queue_notify_without_ioeventfd_reaches_the_queue_event() {
        let (mut t, dev) = setup();
        wr(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(dev.lock().unwrap().evts[0].read().unwrap(), 1);
    }

    #[test]
    fn config_space_reads_go_to_the_device() {
        let (mut t, _) = setup();
        let mut b = [0u8; 2];
        t.read(u64::from(VIRTIO_MMIO_CONFIG), &mut b);
        assert_eq!(b, [7, 8]);
    }
}
