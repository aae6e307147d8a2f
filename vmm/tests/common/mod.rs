//! Helpers for the KVM micro tests: tiny hand-assembled guests.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::io::Write;
use std::path::{Path, PathBuf};

/// Fails loudly (never skips) when KVM is not usable.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        panic!(
            "these tests need read/write access to /dev/kvm ({e}); run them on a host with KVM \
             enabled (load kvm_intel/kvm_amd, or run as a user in the kvm group)"
        );
    }
}

/// Physical (and entry) address of the tiny test kernels, as linux-loader requires (>= 1 MiB).
pub const LOAD_ADDR: u64 = 0x10_0000;

/// Wraps 64-bit `code` into a minimal ELF64 executable with one PT_LOAD at [`LOAD_ADDR`].
pub fn elf64(code: &[u8]) -> Vec<u8> {
    const EHDR: u64 = 64;
    const PHDR: u64 = 56;
    let mut f = Vec::new();
    f.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
    f.extend_from_slice(&[0; 8]);
    f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    f.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // e_entry
    f.extend_from_slice(&EHDR.to_le_bytes()); // e_phoff
    f.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    f.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    f.extend_from_slice(&(EHDR as u16).to_le_bytes());
    f.extend_from_slice(&(PHDR as u16).to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    f.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
    let offset = EHDR + PHDR;
    f.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    f.extend_from_slice(&5u32.to_le_bytes()); // R+X
    f.extend_from_slice(&offset.to_le_bytes());
    f.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // vaddr
    f.extend_from_slice(&LOAD_ADDR.to_le_bytes()); // paddr
    f.extend_from_slice(&(code.len() as u64).to_le_bytes());
    f.extend_from_slice(&(code.len() as u64).to_le_bytes());
    f.extend_from_slice(&0x1000u64.to_le_bytes());
    f.extend_from_slice(code);
    f
}

/// 64-bit code that prints `msg` on COM1, then resets through the i8042 (`out 0x64, 0xfe`).
pub fn print_and_reset(msg: &[u8]) -> Vec<u8> {
    let mut c = vec![0x66, 0xba, 0xf8, 0x03]; // mov dx, 0x3f8
    c.extend_from_slice(&[0x48, 0x8d, 0x35]); // lea rsi, [rip + rel32]
    c.extend_from_slice(&15i32.to_le_bytes()); // msg starts 15 bytes after this instruction
    c.push(0xb9); // mov ecx, imm32
    c.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    c.extend_from_slice(&[0xac, 0xee, 0xe2, 0xfc]); // 1: lodsb; out dx, al; loop 1b
    c.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64]); // mov al, 0xfe; out 0x64, al
    c.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    assert_eq!(c.len(), 26);
    c.extend_from_slice(msg);
    c
}

/// `ud2` with the boot IDT (which has no valid 64-bit gate): #UD → #GP → #DF → triple fault.
pub const TRIPLE_FAULT: &[u8] = &[0x0f, 0x0b];
/// `jmp $`: never reaches userspace.
pub const SPIN: &[u8] = &[0xeb, 0xfe];

/// Writes `bytes` to a fresh file in a per-test temporary directory and returns its path.
pub fn write_temp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    let mut f = std::fs::File::create(&p).expect("create temp file");
    f.write_all(bytes).expect("write temp file");
    p
}

/// A fresh temporary directory, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "airlock-test-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        ));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
