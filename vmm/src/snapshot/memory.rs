//! Guest memory to a file and back.
//!
//! Saving writes each region at its offset in one file and skips pages that were never touched
//! (`mincore(2)` says they are not resident; an untouched anonymous page reads as zeros, which is
//! what a hole in a sparse file reads as too). Restoring maps the file `MAP_PRIVATE`: nothing is
//! read up front, so restore time does not grow with memory size; pages fault in from the page
//! cache on first access, and every clone of one snapshot shares the unmodified ones.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Address, Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap,
    GuestMemoryRegion, GuestRegionMmap,
};

/// Errors saving or mapping guest memory.
#[derive(Debug, Error)]
pub enum MemoryError {
    #[error("create or write the memory file {0}")]
    Write(String, #[source] std::io::Error),
    #[error("open the memory file {0}")]
    Open(String, #[source] std::io::Error),
    #[error("the memory file is {actual} bytes, the snapshot needs {expected}")]
    FileSize { expected: u64, actual: u64 },
    #[error("memory regions in the snapshot are invalid: {0}")]
    BadLayout(&'static str),
    #[error("map the memory file")]
    Map(#[source] vm_memory::mmap::MmapRegionError),
    #[error("assemble guest memory")]
    Assemble(#[source] vm_memory::GuestRegionCollectionError),
}

/// One guest memory region and where it lies in the memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLayout {
    pub guest_addr: u64,
    pub len: u64,
    pub file_offset: u64,
}

/// The layout of guest memory in the memory file.
pub fn layout(mem: &GuestMemoryMmap) -> Vec<RegionLayout> {
    let mut offset = 0;
    mem.iter()
        .map(|r| {
            let l = RegionLayout {
                guest_addr: r.start_addr().raw_value(),
                len: r.len(),
                file_offset: offset,
            };
            offset += r.len();
            l
        })
        .collect()
}

const PAGE: usize = 4096;
/// Pages looked at per `mincore` call.
const CHUNK_PAGES: usize = 4096;

/// Which pages of `[addr, addr + len)` are resident (one bool per 4 KiB page). When `mincore`
/// fails, every page counts as resident (the file is then complete, only larger). `mincore`
/// only reads the page tables of the range; an address outside a mapping makes it fail.
fn resident_pages(addr: *mut u8, len: usize) -> Vec<bool> {
    let pages = len.div_ceil(PAGE);
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has one byte per page of `[addr, addr + len)`, as mincore(2) requires, and
    // is the only memory it writes; it does not access the range itself (a range that is not
    // mapped makes it fail with ENOMEM, handled below).
    let rc = unsafe { libc::mincore(addr.cast(), len, vec.as_mut_ptr()) };
    if rc != 0 {
        return vec![true; pages];
    }
    vec.iter().map(|b| b & 1 == 1).collect()
}

/// Writes guest memory into `path` (created or truncated) as a sparse file laid out by
/// [`layout`]. Returns the number of bytes written (resident pages only).
pub fn save(mem: &GuestMemoryMmap, path: &Path) -> Result<u64, MemoryError> {
    let werr = |e| MemoryError::Write(path.display().to_string(), e);
    let file = File::create(path).map_err(werr)?;
    let mut written = 0u64;
    let mut buf = vec![0u8; CHUNK_PAGES * PAGE];
    for (region, l) in mem.iter().zip(layout(mem)) {
        let len = region.len() as usize;
        let mut start = 0;
        while start < len {
            let n = (len - start).min(CHUNK_PAGES * PAGE);
            let resident = resident_pages(region.as_ptr().wrapping_add(start), n);
            let mut i = 0;
            while i < resident.len() {
                if !resident[i] {
                    i += 1;
                    continue;
                }
                let run = resident[i..].iter().take_while(|r| **r).count();
                let off = start + i * PAGE;
                let bytes = (run * PAGE).min(len - off);
                let data = &mut buf[..bytes];
                // The vCPUs are parked: nothing writes guest memory while it is copied.
                region
                    .read_slice(data, vm_memory::MemoryRegionAddress(off as u64))
                    .map_err(|e| werr(std::io::Error::other(e)))?;
                file.write_all_at(data, l.file_offset + off as u64)
                    .map_err(werr)?;
                written += bytes as u64;
                i += run;
            }
            start += n;
        }
    }
    let total = layout(mem).iter().map(|l| l.len).sum();
    file.set_len(total).map_err(werr)?;
    Ok(written)
}

/// Checks a layout read from a snapshot: page-aligned, non-overlapping, contiguous in the file,
/// and within `max_bytes` in total.
pub fn validate_layout(regions: &[RegionLayout], max_bytes: u64) -> Result<u64, MemoryError> {
    let bad = MemoryError::BadLayout;
    if regions.is_empty() || regions.len() > 8 {
        return Err(bad("between 1 and 8 regions"));
    }
    let mut file_end = 0u64;
    let mut guest_end = 0u64;
    for r in regions {
        let page = PAGE as u64;
        if r.len == 0 || r.len % page != 0 || r.guest_addr % page != 0 {
            return Err(bad("regions must be page-aligned and non-empty"));
        }
        if r.file_offset != file_end || r.guest_addr < guest_end {
            return Err(bad("regions must be in order, contiguous in the file"));
        }
        file_end = file_end.checked_add(r.len).ok_or(bad("size overflow"))?;
        guest_end = r
            .guest_addr
            .checked_add(r.len)
            .ok_or(bad("size overflow"))?;
    }
    if file_end > max_bytes {
        return Err(bad("more memory than allowed"));
    }
    Ok(file_end)
}

/// Maps the memory file `path` privately (copy-on-write) as guest memory laid out by
/// `regions` (checked with [`validate_layout`] first).
pub fn map_private(path: &Path, regions: &[RegionLayout]) -> Result<GuestMemoryMmap, MemoryError> {
    let total = validate_layout(regions, u64::MAX)?;
    let file = File::open(path).map_err(|e| MemoryError::Open(path.display().to_string(), e))?;
    let actual = file
        .metadata()
        .map_err(|e| MemoryError::Open(path.display().to_string(), e))?
        .len();
    if actual != total {
        return Err(MemoryError::FileSize {
            expected: total,
            actual,
        });
    }
    let file = std::sync::Arc::new(file);
    let mut out = Vec::with_capacity(regions.len());
    for r in regions {
        let mapping = MmapRegionBuilder::new(r.len as usize)
            .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(MemoryError::Map)?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr)).ok_or(
            MemoryError::BadLayout("region wraps around the address space"),
        )?;
        out.push(region);
    }
    GuestMemoryMmap::from_regions(out).map_err(MemoryError::Assemble)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("airlock-mem-{}-{name}", std::process::id()))
    }

    #[test]
    fn saved_memory_maps_back_privately_with_the_same_content() {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 1 << 20),
            (GuestAddress(4 << 20), 1 << 20),
        ])
        .unwrap();
        mem.write_obj(0xdead_beef_u32, GuestAddress(0x1234))
            .unwrap();
        mem.write_obj(0x5555_u16, GuestAddress((4 << 20) + 0xff000))
            .unwrap();
        let path = temp("roundtrip");
        let written = save(&mem, &path).unwrap();
        assert!(
            written < 2 << 20,
            "untouched pages are holes ({written} bytes written)"
        );
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 << 20);

        let a = map_private(&path, &layout(&mem)).unwrap();
        let b = map_private(&path, &layout(&mem)).unwrap();
        assert_eq!(
            a.read_obj::<u32>(GuestAddress(0x1234)).unwrap(),
            0xdead_beef
        );
        assert_eq!(
            a.read_obj::<u16>(GuestAddress((4 << 20) + 0xff000))
                .unwrap(),
            0x5555
        );
        assert_eq!(a.read_obj::<u64>(GuestAddress(0x8000)).unwrap(), 0);
        // Private: a clone's write is its own, neither the file nor another clone sees it.
        a.write_obj(7u32, GuestAddress(0x1234)).unwrap();
        assert_eq!(
            b.read_obj::<u32>(GuestAddress(0x1234)).unwrap(),
            0xdead_beef
        );
        let c = map_private(&path, &layout(&mem)).unwrap();
        assert_eq!(
            c.read_obj::<u32>(GuestAddress(0x1234)).unwrap(),
            0xdead_beef
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_memory_file_of_the_wrong_size_is_refused() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let path = temp("short");
        save(&mem, &path).unwrap();
        let mut l = layout(&mem);
        l[0].len = 2 << 20;
        assert!(matches!(
            map_private(&path, &l),
            Err(MemoryError::FileSize { .. })
        ));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn bad_layouts_are_refused() {
        let ok = RegionLayout {
            guest_addr: 0,
            len: 1 << 20,
            file_offset: 0,
        };
        assert_eq!(validate_layout(&[ok], 1 << 30).unwrap(), 1 << 20);
        assert!(validate_layout(&[], 1 << 30).is_err());
        assert!(validate_layout(&[ok], 1 << 10).is_err());
        let unaligned = RegionLayout { len: 100, ..ok };
        assert!(validate_layout(&[unaligned], 1 << 30).is_err());
        let gap_in_file = RegionLayout {
            guest_addr: 2 << 20,
            len: 1 << 20,
            file_offset: 5 << 20,
        };
        assert!(validate_layout(&[ok, gap_in_file], 1 << 30).is_err());
        let overlapping = RegionLayout {
            guest_addr: 0,
            len: 1 << 20,
            file_offset: 1 << 20,
        };
        assert!(validate_layout(&[ok, overlapping], 1 << 30).is_err());
        let huge = RegionLayout {
            guest_addr: u64::MAX - 4095,
            len: 1 << 20,
            file_offset: 0,
        };
        assert!(validate_layout(&[huge], u64::MAX).is_err());
    }
}
