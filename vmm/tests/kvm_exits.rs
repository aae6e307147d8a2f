//! KVM micro tests at the vCPU level: a real-mode guest's PIO and MMIO accesses reach the right
//! bus device with the right offset and data; a spinning vCPU can be paused, resumed and
//! finished (the kick path). Guest faults are tested through the whole boot path in
//! `boot_exits.rs`.
#![allow(clippy::unwrap_used, reason = "tests")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm::devices::bus::{Bus, BusDevice};
use vmm::vcpu::{Vcpu, VcpuEvent, VcpuHandle, VcpuResponse};
use vmm::vm::Vm;
use vmm_sys_util::eventfd::EventFd;

const CODE_ADDR: u64 = 0x1000;

#[derive(Default)]
struct Recorder {
    writes: Vec<(u64, Vec<u8>)>,
    reads: Vec<u64>,
}

impl BusDevice for Recorder {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        self.reads.push(offset);
        for (i, b) in data.iter_mut().enumerate() {
            *b = 0x40 + i as u8;
        }
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.writes.push((offset, data.to_vec()));
    }
}

struct Guest {
    _vm: Vm,
    handle: VcpuHandle,
}

/// Starts one real-mode vCPU at `CODE_ADDR` running `code` in `mem_bytes` of RAM, with the
/// given buses.
fn start(code: &[u8], mem_bytes: u64, pio: Bus, mmio: Bus) -> Guest {
    common::require_kvm();
    vmm::kick::register_handler().unwrap();
    let vm = Vm::new(mem_bytes).unwrap();
    vm.memory()
        .write_slice(code, GuestAddress(CODE_ADDR))
        .unwrap();
    let fd = vm.create_vcpu(0).unwrap();
    let mut sregs = fd.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    fd.set_sregs(&sregs).unwrap();
    let regs = kvm_bindings::kvm_regs {
        rip: CODE_ADDR,
        rflags: 2,
        ..Default::default()
    };
    fd.set_regs(&regs).unwrap();
    let exit = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let vcpu = Vcpu::new(
        fd,
        0,
        Arc::new(pio),
        Arc::new(mmio),
        vm.memory().clone(),
        exit,
    );
    let handle = vcpu.start_paused().unwrap();
    handle.send(VcpuEvent::Resume);
    assert!(matches!(recv(&handle), VcpuResponse::Resumed(_)));
    Guest { _vm: vm, handle }
}

fn recv(h: &VcpuHandle) -> VcpuResponse {
    h.responses
        .recv_timeout(Duration::from_secs(60))
        .expect("vcpu response")
}

fn wait_for(dev: &Arc<Mutex<Recorder>>, pred: impl Fn(&Recorder) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pred(&dev.lock().unwrap()) {
        assert!(
            Instant::now() < deadline,
            "guest did not make the expected accesses"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn pio_writes_and_reads_reach_the_device_at_their_offset() {
    // mov dx, 0x3fb; mov al, 0x5a; out dx, al; mov dx, 0x3f9; in al, dx; jmp $
    let code = [
        0xba, 0xfb, 0x03, 0xb0, 0x5a, 0xee, 0xba, 0xf9, 0x03, 0xec, 0xeb, 0xfe,
    ];
    let dev = Arc::new(Mutex::new(Recorder::default()));
    let mut pio = Bus::default();
    pio.insert(dev.clone(), 0x3f8, 8).unwrap();
    let mut g = start(&code, 1 << 20, pio, Bus::default());
    wait_for(&dev, |r| !r.reads.is_empty());
    g.handle.finish();
    let r = dev.lock().unwrap();
    assert_eq!(r.writes, vec![(3, vec![0x5a])]);
    assert_eq!(r.reads, vec![1]);
}

#[test]
fn mmio_writes_and_reads_reach_the_device_at_their_offset() {
    // An address above the 1 MiB of RAM exits as MMIO. Real mode: use the 0x8000 segment.
    // mov ax, 0x8000; mov ds, ax; mov word [0x10], 0xbeef; mov ax, [0x24]; jmp $
    // => linear 0x80010 (write) and 0x80024 (read); the device sits at 0x80000.
    let code = [
        0xb8, 0x00, 0x80, 0x8e, 0xd8, 0xc7, 0x06, 0x10, 0x00, 0xef, 0xbe, 0xa1, 0x24, 0x00, 0xeb,
        0xfe,
    ];
    let dev = Arc::new(Mutex::new(Recorder::default()));
    let mut mmio = Bus::default();
    mmio.insert(dev.clone(), 0x80000, 0x1000).unwrap();
    // Guest RAM is only 64 KiB here so that 0x80000 is not RAM.
    let mut g = start(&code, 64 << 10, Bus::default(), mmio);
    wait_for(&dev, |r| !r.reads.is_empty());
    g.handle.finish();
    let r = dev.lock().unwrap();
    assert_eq!(r.writes, vec![(0x10, vec![0xef, 0xbe])]);
    assert_eq!(r.reads, vec![0x24]);
}

#[test]
fn spinning_vcpu_pauses_resumes_and_finishes_on_request() {
    let g = start(common::SPIN, 1 << 20, Bus::default(), Bus::default());
    g.handle.send(VcpuEvent::Pause);
    assert!(matches!(recv(&g.handle), VcpuResponse::Paused));
    g.handle.send(VcpuEvent::Resume);
    assert!(matches!(recv(&g.handle), VcpuResponse::Resumed(_)));
    let started = Instant::now();
    drop(g); // Finish + join; hangs here if the kick does not reach KVM_RUN.
    assert!(started.elapsed() < Duration::from_secs(30));
}
