//! KVM micro test of snapshot and restore: a tiny real-mode guest counts in memory and reports
//! every count over PIO; it is paused and snapshotted (vCPU and VM state through the same code
//! the VMM uses, guest memory to a file), then restored in a *new process* (this test binary,
//! re-run as a child), where it must go on counting from exactly where it stopped.
#![allow(clippy::unwrap_used, reason = "tests")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::{Bus, BusDevice};
use vmm::snapshot::kvm::VmKvmState;
use vmm::snapshot::{MEMORY_FILE, MachineSnapshot, SerialSnapshot, Snapshot, memory};
use vmm::vcpu::{Vcpu, VcpuEvent, VcpuHandle, VcpuResponse};
use vmm::vm::Vm;
use vmm_sys_util::eventfd::EventFd;

const CODE_ADDR: u64 = 0x1000;
const COUNTER_ADDR: u64 = 0x2000;
const PORT: u64 = 0x3f0;
const MEM_BYTES: u64 = 2 << 20;
const CHILD_ENV: &str = "AIRLOCK_TEST_SNAPSHOT_DIR";

/// mov dx, 0x3f0
/// l: inc dword [0x2000]; mov eax, [0x2000]; out dx, eax; in al, dx; jmp l
/// (the `in` makes some pauses land right after an IN exit, whose data KVM only consumes on the
/// next KVM_RUN: the pause must complete it before the registers are saved).
const COUNTER: &[u8] = &[
    0xba, 0xf0, 0x03, 0x66, 0xff, 0x06, 0x00, 0x20, 0x66, 0xa1, 0x00, 0x20, 0x66, 0xef, 0xec, 0xeb,
    0xf2,
];

/// Collects the counts the guest reports.
#[derive(Default)]
struct Counts(Vec<u32>);

impl BusDevice for Counts {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0x42);
    }
    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Ok(b) = <[u8; 4]>::try_from(data) {
            self.0.push(u32::from_le_bytes(b));
        }
    }
}

fn recv(h: &VcpuHandle) -> VcpuResponse {
    h.responses
        .recv_timeout(Duration::from_secs(60))
        .expect("vcpu response")
}

fn wait_for_counts(dev: &Arc<Mutex<Counts>>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while dev.lock().unwrap().0.len() < n {
        assert!(Instant::now() < deadline, "the guest stopped counting");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn start_vcpu(vm: &Vm, fd: kvm_ioctls::VcpuFd, dev: &Arc<Mutex<Counts>>) -> VcpuHandle {
    vmm::kick::register_handler().unwrap();
    let mut pio = Bus::default();
    pio.insert(dev.clone(), PORT, 4).unwrap();
    let mut vcpu = Vcpu::new(
        fd,
        0,
        Arc::new(pio),
        Arc::new(Bus::default()),
        vm.memory().clone(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    );
    vcpu.set_msr_index_list(vm.msr_index_list().unwrap());
    let h = vcpu.start_paused().unwrap();
    h.send(VcpuEvent::Resume);
    assert!(matches!(recv(&h), VcpuResponse::Resumed(_)));
    h
}

fn snapshot_dir(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("airlock-kvm-snapshot-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    airlock_control::snapshot_dir::prepare(&dir, None).unwrap();
    dir
}

/// Runs the counter, snapshots it into `dir`, and returns the counter value in guest memory
/// at the snapshot.
fn count_and_snapshot(dir: &Path) -> u32 {
    common::require_kvm();
    let vm = Vm::new(MEM_BYTES).unwrap();
    vm.memory()
        .write_slice(COUNTER, GuestAddress(CODE_ADDR))
        .unwrap();
    let fd = vm.create_vcpu(0).unwrap();
    fd.set_cpuid2(vm.supported_cpuid().unwrap()).unwrap();
    let mut sregs = fd.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    fd.set_sregs(&sregs).unwrap();
    fd.set_regs(&kvm_bindings::kvm_regs {
        rip: CODE_ADDR,
        rflags: 2,
        ..Default::default()
    })
    .unwrap();
    let dev = Arc::new(Mutex::new(Counts::default()));
    let mut h = start_vcpu(&vm, fd, &dev);
    wait_for_counts(&dev, 500);
    h.send(VcpuEvent::Pause);
    assert!(matches!(recv(&h), VcpuResponse::Paused));
    h.send(VcpuEvent::SaveState);
    let vcpu = match recv(&h) {
        VcpuResponse::Saved(Ok(state)) => *state,
        other => panic!("no vCPU state: {other:?}"),
    };
    let snap = Snapshot {
        machine: MachineSnapshot {
            vcpus: 1,
            mem_mib: MEM_BYTES >> 20,
            cpu_template: "test".into(),
            cmdline: String::new(),
        },
        memory: memory::layout(vm.memory()),
        vm: VmKvmState::save(vm.fd()).unwrap(),
        vcpus: vec![vcpu],
        serial: SerialSnapshot::default(),
        virtio: Vec::new(),
    };
    memory::save(vm.memory(), &dir.join(MEMORY_FILE)).unwrap();
    snap.write_state(dir).unwrap();
    let at_snapshot: u32 = vm.memory().read_obj(GuestAddress(COUNTER_ADDR)).unwrap();
    // The paused guest reported every count up to the one in memory, or all but that one if
    // the pause fell between the increment and the OUT.
    let reported = *dev.lock().unwrap().0.last().unwrap();
    assert!(
        at_snapshot == reported || at_snapshot == reported + 1,
        "memory {at_snapshot}, last reported {reported}"
    );
    h.finish();
    at_snapshot
}

/// The child half: restores the snapshot in `dir` in this (new) process (the test binary
/// re-run with `AIRLOCK_TEST_SNAPSHOT_DIR` set), lets the guest count
/// a while and prints the counts it reported, one per line, prefixed with `count `.
fn restore_and_count(dir: &Path) {
    let snap = Snapshot::read_state(dir).unwrap();
    let mem = memory::map_private(&dir.join(MEMORY_FILE), &snap.memory).unwrap();
    let vm = Vm::with_memory(mem).unwrap();
    snap.vm.restore(vm.fd()).unwrap();
    let fd = vm.create_vcpu(0).unwrap();
    snap.vcpus[0].restore(&fd).unwrap();
    let dev = Arc::new(Mutex::new(Counts::default()));
    let mut h = start_vcpu(&vm, fd, &dev);
    wait_for_counts(&dev, 200);
    h.finish();
    for c in &dev.lock().unwrap().0 {
        println!("count {c}");
    }
}

#[test]
fn a_counting_guest_continues_in_a_new_process_from_where_it_was_snapshotted() {
    // Re-run as the child (by the parent below): restore instead.
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        restore_and_count(Path::new(&dir));
        return;
    }
    let dir = snapshot_dir("continue");
    let at_snapshot = count_and_snapshot(&dir);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_counting_guest_continues_in_a_new_process_from_where_it_was_snapshotted",
            "--nocapture",
        ])
        .env(CHILD_ENV, &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "restore in a new process failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let counts: Vec<u32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("count "))
        .map(|n| n.trim().parse().unwrap())
        .collect();
    assert!(
        counts.len() >= 200,
        "only {} counts: {stdout}",
        counts.len()
    );
    // The clone's first report is the count in memory at the snapshot (if the pause fell
    // between the increment and its OUT) or the next one; then it counts on by one.
    assert!(
        counts[0] == at_snapshot || counts[0] == at_snapshot + 1,
        "restored guest reported {} first; the snapshot held {at_snapshot}",
        counts[0]
    );
    for w in counts.windows(2) {
        assert_eq!(w[1], w[0] + 1, "counts are not consecutive: {counts:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_snapshot_restores_twice_into_independent_clones() {
    // MAP_PRIVATE: what one clone writes, the memory file and the next clone never see.
    let dir = snapshot_dir("clones");
    let at_snapshot = count_and_snapshot(&dir);
    let snap = Snapshot::read_state(&dir).unwrap();
    let a = memory::map_private(&dir.join(MEMORY_FILE), &snap.memory).unwrap();
    a.write_obj(0u32, GuestAddress(COUNTER_ADDR)).unwrap();
    let b = memory::map_private(&dir.join(MEMORY_FILE), &snap.memory).unwrap();
    assert_eq!(
        b.read_obj::<u32>(GuestAddress(COUNTER_ADDR)).unwrap(),
        at_snapshot
    );
    let _ = std::fs::remove_dir_all(&dir);
}
