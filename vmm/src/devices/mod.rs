//! Emulated devices: the PIO/MMIO bus, legacy PC devices, and virtio devices.

pub mod bus;
pub mod legacy;
pub mod virtio;
