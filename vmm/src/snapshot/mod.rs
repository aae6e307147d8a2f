//! Snapshots of a paused VM: what is in one, and its file format.
//!
//! A snapshot is a directory with two files:
//!
//! - `state`: a header — the magic `AIRLSNAP`, the format version (u32 LE), the CRC-32 of the
//!   payload (u32 LE) and the payload's length (u64 LE) — then the payload, [`Snapshot`] in
//!   bincode's standard encoding (through serde): the machine's shape, KVM's VM and vCPU
//!   state, and every device's state. (JSON was 4x larger and took half a millisecond to parse,
//!   a quarter of a restore.)
//! - `memory`: guest memory, one region after another (see [`memory`]), sparse.
//!
//! Snapshot files come from disk and may be corrupted or hostile: reading one never allocates
//! more than [`MAX_STATE_BYTES`] for the payload, checks the checksum before parsing, and
//! checks every count and size that KVM or the devices would otherwise trust
//! ([`Snapshot::validate`]).

pub mod kvm;
pub mod memory;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::arch::mptable::MAX_CPUS;
use kvm::{KvmStateError, VcpuKvmState, VmKvmState};
use memory::RegionLayout;

/// First bytes of a `state` file.
pub use airlock_control::snapshot_dir::STATE_MAGIC as MAGIC;
/// The format this build writes and reads (bump it, in `airlock_control::snapshot_dir`, on
/// any change to [`Snapshot`]'s shape): the daemon refuses older templates by it.
pub use airlock_control::snapshot_dir::STATE_VERSION as VERSION;
/// Largest payload a `state` file may announce.
pub const MAX_STATE_BYTES: u64 = 16 << 20;
/// Largest guest memory a snapshot may describe (1 TiB, the limit of `VmConfig`).
pub const MAX_MEMORY_BYTES: u64 = 1 << 40;
const HEADER_LEN: usize = 8 + 4 + 4 + 8;

/// File names inside a snapshot directory (prepared by the caller: see
/// [`airlock_control::snapshot_dir`]).
pub use airlock_control::snapshot_dir::{
    LAYER_FILE, LAYER_MAP_FILE, MEMORY_FILE, STATE_FILE, STATE_TMP_FILE,
};

/// Errors writing or reading a snapshot.
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("{0}: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("not a snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {0}, this build reads version {VERSION}")]
    Version(u32),
    #[error("the state payload announces {0} bytes (at most {MAX_STATE_BYTES})")]
    TooLarge(u64),
    #[error("the state file is truncated")]
    Truncated,
    #[error("checksum mismatch: the state file is corrupted")]
    Checksum,
    #[error("decode the state")]
    Decode(#[source] bincode::error::DecodeError),
    #[error("encode the state")]
    Encode(#[source] bincode::error::EncodeError),
    #[error("invalid snapshot: {0}")]
    Invalid(String),
    #[error("KVM state")]
    Kvm(#[from] KvmStateError),
    #[error("guest memory")]
    Memory(#[from] memory::MemoryError),
}

/// The machine a snapshot was taken of.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MachineSnapshot {
    pub vcpus: u8,
    pub mem_mib: u64,
    /// The CPU template's name (`host` or `nested`); a restore on another kind of host is
    /// refused, since the guest was booted for the CPUID it saw.
    pub cpu_template: String,
    /// The kernel command line the guest booted with (informational).
    pub cmdline: String,
}

/// A 16550A UART's registers (mirrors `vm_superio::serial::SerialState`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

impl From<vm_superio::serial::SerialState> for SerialSnapshot {
    fn from(s: vm_superio::serial::SerialState) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialSnapshot> for vm_superio::serial::SerialState {
    fn from(s: &SerialSnapshot) -> Self {
        Self {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// One virtqueue (mirrors `virtio_queue::QueueState`; checked by `Queue::try_from`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl From<virtio_queue::QueueState> for QueueSnapshot {
    fn from(q: virtio_queue::QueueState) -> Self {
        Self {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

impl From<&QueueSnapshot> for virtio_queue::QueueState {
    fn from(q: &QueueSnapshot) -> Self {
        Self {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx_enabled,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

/// A virtio-mmio transport's registers and its device's queues.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TransportSnapshot {
    pub status: u32,
    pub driver_features: u64,
    pub features_select: u32,
    pub driver_features_select: u32,
    pub queue_select: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
    pub queues: Vec<QueueSnapshot>,
}

/// Which device sits behind a transport, with what the device itself needs on restore.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum DeviceKind {
    /// A read-only disk (the base image): restored from the same path.
    Block {
        path: PathBuf,
        read_only: bool,
        id: String,
    },
    /// The vsock device; host-side connections do not survive a restore (the guest is told by
    /// a transport-reset event).
    Vsock { guest_cid: u64 },
    /// The network card: restored on the TAP the restoring process is given, with the same
    /// MAC address.
    Net { mac: [u8; 6] },
    /// A copy-on-write disk (the writable root): the base image at `base`, read-only, under
    /// the layer in the snapshot's directory ([`LAYER_FILE`], [`LAYER_MAP_FILE`]: what the
    /// guest had written), under an overlay the restoring process is given. (Last, so that
    /// snapshots from before it decode as they did.)
    LayeredBlock { base: PathBuf, id: String },
    /// An empty disk slot (for a volume): restored empty, or with the media the restoring
    /// process is given for it, in slot order.
    Slot { id: String },
}

/// One virtio device in its mmio slot (slots are restored in the same order).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VirtioSnapshot {
    pub kind: DeviceKind,
    pub transport: TransportSnapshot,
}

/// Everything needed to continue a paused VM in another process.
#[derive(Debug, Serialize, Deserialize)]
pub struct Snapshot {
    pub machine: MachineSnapshot,
    pub memory: Vec<RegionLayout>,
    pub vm: VmKvmState,
    pub vcpus: Vec<VcpuKvmState>,
    pub serial: SerialSnapshot,
    pub virtio: Vec<VirtioSnapshot>,
}

/// The payload's encoding; the limit caps what decoding may allocate, whatever lengths the
/// bytes claim.
fn codec() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ MAX_STATE_BYTES as usize }>()
}

fn invalid(msg: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid(msg.into())
}

impl Snapshot {
    /// Checks every count and size a restore relies on.
    pub fn validate(&self) -> Result<(), SnapshotError> {
        let m = &self.machine;
        if m.vcpus == 0 || m.vcpus > MAX_CPUS || usize::from(m.vcpus) != self.vcpus.len() {
            return Err(invalid("vCPU count does not match the vCPU states"));
        }
        for (i, v) in self.vcpus.iter().enumerate() {
            if usize::from(v.index) != i {
                return Err(invalid("vCPU states out of order"));
            }
            v.validate()?;
        }
        let total = memory::validate_layout(&self.memory, MAX_MEMORY_BYTES)?;
        if m.mem_mib.checked_mul(1 << 20) != Some(total) {
            return Err(invalid("memory size does not match the regions"));
        }
        if self.serial.in_buffer.len() > 64 {
            return Err(invalid("serial FIFO too long"));
        }
        if self.virtio.len() > crate::arch::layout::VIRTIO_MMIO_MAX_SLOTS as usize {
            return Err(invalid("too many virtio devices"));
        }
        for v in &self.virtio {
            if v.transport.queues.len() > 16 {
                return Err(invalid("too many queues"));
            }
            if let DeviceKind::Block {
                read_only: false, ..
            } = v.kind
            {
                return Err(invalid("writable disks are not part of snapshots yet"));
            }
        }
        Ok(())
    }

    /// Writes the `state` file into `dir` (atomically: the prepared temporary file, renamed
    /// into place).
    pub fn write_state(&self, dir: &Path) -> Result<u64, SnapshotError> {
        let payload =
            bincode::serde::encode_to_vec(self, codec()).map_err(SnapshotError::Encode)?;
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&payload);
        let path = dir.join(STATE_FILE);
        let tmp = dir.join(STATE_TMP_FILE);
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| SnapshotError::Io(p, e)
        };
        let mut f =
            airlock_control::snapshot_dir::open_prepared(dir, STATE_TMP_FILE).map_err(io(&tmp))?;
        f.write_all(&out).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        Ok(out.len() as u64)
    }

    /// Reads and checks the `state` file in `dir`.
    pub fn read_state(dir: &Path) -> Result<Self, SnapshotError> {
        let path = dir.join(STATE_FILE);
        let f = std::fs::File::open(&path).map_err(|e| SnapshotError::Io(path.clone(), e))?;
        Self::decode(f)
    }

    /// Decodes a `state` stream: header, bounded payload, checksum, JSON, [`Self::validate`].
    pub fn decode(mut r: impl Read) -> Result<Self, SnapshotError> {
        let mut header = [0u8; HEADER_LEN];
        r.read_exact(&mut header)
            .map_err(|_| SnapshotError::Truncated)?;
        if &header[..8] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let word = |at: usize| {
            u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        let version = word(8);
        if version != VERSION {
            return Err(SnapshotError::Version(version));
        }
        let crc = word(12);
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&header[16..24]);
        let len = u64::from_le_bytes(len_bytes);
        if len > MAX_STATE_BYTES {
            return Err(SnapshotError::TooLarge(len));
        }
        // Read at most `len` bytes: the allocation follows what is actually there, never the
        // announced size alone.
        let mut payload = Vec::new();
        r.take(len)
            .read_to_end(&mut payload)
            .map_err(|_| SnapshotError::Truncated)?;
        if payload.len() as u64 != len {
            return Err(SnapshotError::Truncated);
        }
        if crc32fast::hash(&payload) != crc {
            return Err(SnapshotError::Checksum);
        }
        let (snap, used): (Self, usize) =
            bincode::serde::decode_from_slice(&payload, codec()).map_err(SnapshotError::Decode)?;
        if used != payload.len() {
            return Err(invalid("trailing bytes after the state"));
        }
        snap.validate()?;
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal but valid snapshot, without KVM.
    pub fn sample() -> Snapshot {
        let vcpu = VcpuKvmState {
            index: 0,
            cpuid: vec![kvm_bindings::kvm_cpuid_entry2::default()],
            msrs: vec![(0x10, 12345)],
            regs: kvm_bindings::kvm_regs {
                rip: 0x1000,
                ..Default::default()
            },
            sregs: Default::default(),
            xsave: Some(Default::default()),
            fpu: None,
            xcrs: None,
            lapic: Default::default(),
            events: Default::default(),
            mp_state: Default::default(),
            debugregs: Default::default(),
        };
        let chip = |chip_id| kvm_bindings::kvm_irqchip {
            chip_id,
            ..Default::default()
        };
        Snapshot {
            machine: MachineSnapshot {
                vcpus: 1,
                mem_mib: 1,
                cpu_template: "host".into(),
                cmdline: "console=ttyS0".into(),
            },
            memory: vec![RegionLayout {
                guest_addr: 0,
                len: 1 << 20,
                file_offset: 0,
            }],
            vm: VmKvmState {
                pic_master: chip(0),
                pic_slave: chip(1),
                ioapic: chip(2),
                pit: Default::default(),
                clock: Default::default(),
            },
            vcpus: vec![vcpu],
            serial: SerialSnapshot::default(),
            virtio: vec![VirtioSnapshot {
                kind: DeviceKind::Vsock { guest_cid: 3 },
                transport: TransportSnapshot {
                    status: 15,
                    queues: vec![QueueSnapshot::default(); 3],
                    ..Default::default()
                },
            }],
        }
    }

    fn encoded(s: &Snapshot) -> Vec<u8> {
        let dir = std::env::temp_dir().join(format!(
            "airlock-snap-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        airlock_control::snapshot_dir::prepare(&dir, None).unwrap();
        s.write_state(&dir).unwrap();
        let bytes = std::fs::read(dir.join(STATE_FILE)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        bytes
    }

    #[test]
    fn state_round_trips() {
        let s = sample();
        let back = Snapshot::decode(&encoded(&s)[..]).unwrap();
        assert_eq!(back.machine, s.machine);
        assert_eq!(back.vcpus[0].regs.rip, 0x1000);
        assert_eq!(back.vcpus[0].msrs, vec![(0x10, 12345)]);
        assert_eq!(back.virtio, s.virtio);
    }

    #[test]
    fn corruption_is_detected_by_the_checksum() {
        let mut bytes = encoded(&sample());
        let last = bytes.len() - 2;
        bytes[last] ^= 0x20;
        assert!(matches!(
            Snapshot::decode(&bytes[..]),
            Err(SnapshotError::Checksum)
        ));
    }

    #[test]
    fn bad_magic_version_and_truncation_are_errors() {
        let good = encoded(&sample());
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(
            Snapshot::decode(&b[..]),
            Err(SnapshotError::BadMagic)
        ));
        let mut b = good.clone();
        b[8] = 99;
        assert!(matches!(
            Snapshot::decode(&b[..]),
            Err(SnapshotError::Version(99))
        ));
        assert!(matches!(
            Snapshot::decode(&good[..good.len() - 10]),
            Err(SnapshotError::Truncated)
        ));
        assert!(matches!(
            Snapshot::decode(&good[..5]),
            Err(SnapshotError::Truncated)
        ));
    }

    #[test]
    fn a_huge_announced_length_is_refused_before_allocating() {
        let mut b = encoded(&sample());
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Snapshot::decode(&b[..]),
            Err(SnapshotError::TooLarge(_))
        ));
    }

    #[test]
    fn a_well_formed_but_inconsistent_snapshot_is_invalid() {
        let mut s = sample();
        s.machine.vcpus = 2;
        assert!(matches!(
            Snapshot::decode(&encoded(&s)[..]),
            Err(SnapshotError::Invalid(_))
        ));
        let mut s = sample();
        s.machine.mem_mib = 4096;
        assert!(Snapshot::decode(&encoded(&s)[..]).is_err());
        let mut s = sample();
        s.vcpus[0].cpuid.clear();
        assert!(Snapshot::decode(&encoded(&s)[..]).is_err());
        let mut s = sample();
        s.virtio[0].kind = DeviceKind::Block {
            path: "/x".into(),
            read_only: false,
            id: "d".into(),
        };
        assert!(Snapshot::decode(&encoded(&s)[..]).is_err());
    }

    #[test]
    fn garbage_payload_with_a_valid_checksum_is_a_decode_error() {
        // A vector length of about 2^60 elements: refused by the decoder's limit, not
        // allocated.
        let payload = b"\x01\xfe\xff\xff\xff\xff\xff\xff\xff\x0f";
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
        b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        b.extend_from_slice(payload);
        assert!(matches!(
            Snapshot::decode(&b[..]),
            Err(SnapshotError::Decode(_))
        ));
    }
}
