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
    #[error("reserve {0} MiB of address space for guest memory")]
    Reserve(u64, #[source] std::io::Error),
    #[error("map the memory file over the reserved guest memory")]
    MapFixed(#[source] std::io::Error),
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

/// Writes guest memory into the prepared (existing, see [`airlock_control::snapshot_dir`])
/// file `path`, truncated first, as a sparse file laid out by [`layout`]. Returns the number
/// of bytes written (resident pages only).
pub fn save(mem: &GuestMemoryMmap, path: &Path) -> Result<u64, MemoryError> {
    let werr = |e| MemoryError::Write(path.display().to_string(), e);
    let (dir, name) = match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(d), Some(n)) => (d, n),
        _ => return Err(werr(std::io::Error::from(std::io::ErrorKind::InvalidInput))),
    };
    let file = airlock_control::snapshot_dir::open_prepared(dir, name).map_err(werr)?;
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

/// Opens the memory file `path` after checking `regions` with [`validate_layout`] and the
/// file's size against them.
fn open_memory_file(path: &Path, regions: &[RegionLayout]) -> Result<File, MemoryError> {
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
    Ok(file)
}

/// Maps the memory file `path` privately (copy-on-write) as guest memory laid out by
/// `regions` (checked with [`validate_layout`] first).
pub fn map_private(path: &Path, regions: &[RegionLayout]) -> Result<GuestMemoryMmap, MemoryError> {
    let file = std::sync::Arc::new(open_memory_file(path, regions)?);
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

/// One reserved range: guest-physical start, host address, length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReservedRange {
    pub guest_addr: u64,
    pub host_addr: usize,
    pub len: usize,
}

/// Host address space reserved for guest memory whose content is not known yet (a pool process
/// waiting for the snapshot to restore). The ranges are inaccessible anonymous mappings
/// (`PROT_NONE`, nothing committed) that KVM memory slots can be registered over in advance;
/// [`Reservation::map_file`] later maps a snapshot's memory file over them in place, so the slots
/// stay valid and their registration — which costs time in proportion to the memory size — is
/// not part of the restore.
#[derive(Debug)]
pub struct Reservation {
    ranges: Vec<ReservedRange>,
}

impl Reservation {
    /// Reserves one range per `(guest address, length)` pair.
    pub fn new(ranges: &[(GuestAddress, usize)]) -> Result<Self, MemoryError> {
        let mut out = Reservation { ranges: Vec::new() };
        for &(guest, len) in ranges {
            // SAFETY: a new anonymous mapping at an address the kernel chooses; it replaces
            // nothing, and the pointer is only kept as an address until `map_file`.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if addr == libc::MAP_FAILED {
                // `out` unmaps what was reserved so far.
                return Err(MemoryError::Reserve(
                    (len >> 20) as u64,
                    std::io::Error::last_os_error(),
                ));
            }
            out.ranges.push(ReservedRange {
                guest_addr: guest.raw_value(),
                host_addr: addr as usize,
                len,
            });
        }
        Ok(out)
    }

    /// The reserved ranges.
    pub fn ranges(&self) -> &[ReservedRange] {
        &self.ranges
    }

    /// Whether a snapshot's memory `layout` has exactly the reserved ranges.
    pub fn matches(&self, layout: &[RegionLayout]) -> bool {
        self.ranges.len() == layout.len()
            && self
                .ranges
                .iter()
                .zip(layout)
                .all(|(r, l)| r.guest_addr == l.guest_addr && r.len as u64 == l.len)
    }

    /// Maps the memory file `path`, laid out by `regions` (which must [`match`](Self::matches)),
    /// privately over the reserved ranges and returns it as guest memory at the same host
    /// addresses.
    ///
    /// The mapping is never unmapped afterwards: it lives until the process exits. Guest memory
    /// is cloned into device threads and may outlive any owner we could give it; a pool process
    /// restores one VM and exits with it.
    pub fn map_file(
        mut self,
        path: &Path,
        regions: &[RegionLayout],
    ) -> Result<GuestMemoryMmap, MemoryError> {
        if !self.matches(regions) {
            return Err(MemoryError::BadLayout(
                "the snapshot's memory does not fit the reserved ranges",
            ));
        }
        let file = std::sync::Arc::new(open_memory_file(path, regions)?);
        let mut out = Vec::with_capacity(regions.len());
        for (res, r) in self.ranges.iter().zip(regions) {
            // SAFETY: MAP_FIXED replaces exactly the reserved range, which this `Reservation`
            // owns and nothing else uses (the guest has not run); the file is open and its size
            // was checked against the layout.
            let addr = unsafe {
                libc::mmap(
                    res.host_addr as *mut libc::c_void,
                    res.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    std::os::fd::AsRawFd::as_raw_fd(&*file),
                    r.file_offset as libc::off_t,
                )
            };
            if addr == libc::MAP_FAILED {
                // Dropping `self` unmaps every range, mapped over or not.
                return Err(MemoryError::MapFixed(std::io::Error::last_os_error()));
            }
            // SAFETY: `res.host_addr..+res.len` is the live mapping made above; it is never
            // unmapped (see the doc comment), so the region may use it for the rest of the
            // process's life. The region does not own it and will not unmap it.
            let builder = unsafe {
                MmapRegionBuilder::new(res.len)
                    .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
                    .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                    .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
                    .with_raw_mmap_pointer(res.host_addr as *mut u8)
            };
            let region = GuestRegionMmap::new(
                builder.build().map_err(MemoryError::Map)?,
                GuestAddress(r.guest_addr),
            )
            .ok_or(MemoryError::BadLayout(
                "region wraps around the address space",
            ))?;
            out.push(region);
        }
        let mem = GuestMemoryMmap::from_regions(out).map_err(MemoryError::Assemble)?;
        // From here the mappings belong to `mem` for the life of the process.
        self.ranges.clear();
        Ok(mem)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        for r in &self.ranges {
            // SAFETY: the range is a mapping this reservation made and still owns (ranges handed
            // to guest memory were removed from the list).
            unsafe { libc::munmap(r.host_addr as *mut libc::c_void, r.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty file to save into (`save` writes only files its caller prepared).
    fn temp(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("airlock-mem-{}-{name}", std::process::id()));
        File::create(&p).unwrap();
        p
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
    fn a_memory_file_maps_in_place_over_a_reservation() {
        let ranges = [(GuestAddress(0), 1 << 20), (GuestAddress(4 << 20), 2 << 20)];
        let mem = GuestMemoryMmap::from_ranges(&ranges).unwrap();
        mem.write_obj(0xfeed_u64, GuestAddress(0x1000)).unwrap();
        mem.write_obj(0xbeef_u64, GuestAddress((5 << 20) + 8))
            .unwrap();
        let path = temp("reserve");
        save(&mem, &path).unwrap();
        let l = layout(&mem);

        let small = Reservation::new(&ranges[..1]).unwrap();
        assert!(!small.matches(&l));
        assert!(matches!(
            small.map_file(&path, &l),
            Err(MemoryError::BadLayout(_))
        ));

        let reserved = Reservation::new(&ranges).unwrap();
        assert!(reserved.matches(&l));
        let hosts: Vec<usize> = reserved.ranges().iter().map(|r| r.host_addr).collect();
        let restored = reserved.map_file(&path, &l).unwrap();
        let mapped: Vec<usize> = restored.iter().map(|r| r.as_ptr() as usize).collect();
        assert_eq!(
            mapped, hosts,
            "the file must land on the reserved addresses"
        );
        assert_eq!(
            restored.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0xfeed
        );
        assert_eq!(
            restored
                .read_obj::<u64>(GuestAddress((5 << 20) + 8))
                .unwrap(),
            0xbeef
        );
        // Private: writing to the clone leaves the file alone.
        restored.write_obj(1_u64, GuestAddress(0x1000)).unwrap();
        let again = map_private(&path, &l).unwrap();
        assert_eq!(again.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 0xfeed);
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
