#![allow(clippy::unwrap_used)]

use std::io::Write;

use super::*;

fn tempfile() -> File {
    vmm_sys_util::tempfile::TempFile::new().unwrap().into_file()
}

/// A base image of `blocks` blocks, each block's bytes naming it.
fn base(blocks: u64) -> (File, Vec<u8>) {
    let mut bytes = vec![0u8; (blocks * BLOCK_SIZE) as usize];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i / BS) as u8 ^ (i as u8).rotate_left(3);
    }
    let mut f = tempfile();
    f.write_all(&bytes).unwrap();
    (f, bytes)
}

fn dup(f: &File) -> File {
    f.try_clone().unwrap()
}

fn read(d: &LayeredDisk, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    d.read_at(&mut buf, offset).unwrap();
    buf
}

#[test]
fn an_untouched_disk_reads_as_its_base_and_writes_leave_the_base_alone() {
    let (b, bytes) = base(8);
    let before = bytes.clone();
    let mut d = LayeredDisk::new(dup(&b), None, tempfile(), 1 << 20).unwrap();
    assert_eq!(d.size_bytes(), 8 * BLOCK_SIZE);
    assert_eq!(read(&d, 0, bytes.len()), bytes);
    d.write_at(&[7u8; BS * 2], BLOCK_SIZE).unwrap();
    assert_eq!(d.overlay_bytes(), 2 * BLOCK_SIZE);
    let mut want = bytes.clone();
    want[BS..3 * BS].fill(7);
    assert_eq!(read(&d, 0, want.len()), want);
    let mut on_disk = vec![0u8; before.len()];
    b.read_exact_at(&mut on_disk, 0).unwrap();
    assert_eq!(on_disk, before, "the base is never written");
}

#[test]
fn a_partial_write_copies_the_rest_of_its_block_up_first() {
    let (b, bytes) = base(4);
    let mut d = LayeredDisk::new(b, None, tempfile(), 1 << 20).unwrap();
    // One sector in the middle of block 2, then one spanning blocks 0 and 1.
    d.write_at(&[0xaa; 512], 2 * BLOCK_SIZE + 1024).unwrap();
    d.write_at(&[0xbb; 1024], BLOCK_SIZE - 512).unwrap();
    let mut want = bytes;
    want[2 * BS + 1024..2 * BS + 1536].fill(0xaa);
    want[BS - 512..BS + 512].fill(0xbb);
    assert_eq!(read(&d, 0, want.len()), want);
    assert_eq!(d.overlay_bytes(), 3 * BLOCK_SIZE);
}

#[test]
fn past_its_quota_a_write_to_a_new_block_fails_and_old_blocks_stay_writable() {
    let (b, _) = base(16);
    let overlay = tempfile();
    let mut d = LayeredDisk::new(b, None, dup(&overlay), 3 * BLOCK_SIZE + 100).unwrap();
    assert_eq!(d.quota_bytes(), 3 * BLOCK_SIZE);
    d.write_at(&[1u8; BS * 3], 0).unwrap();
    assert!(matches!(
        d.write_at(&[2u8; 512], 5 * BLOCK_SIZE),
        Err(WriteError::Quota(3))
    ));
    // A write that runs from held blocks into a new one stops at the quota.
    assert!(matches!(
        d.write_at(&[3u8; BS * 2], 2 * BLOCK_SIZE),
        Err(WriteError::Quota(3))
    ));
    d.write_at(&[4u8; BS], 0).unwrap();
    assert_eq!(read(&d, 0, BS), vec![4u8; BS]);
    assert_eq!(
        overlay.metadata().unwrap().len(),
        3 * BLOCK_SIZE,
        "the file"
    );
}

#[test]
fn a_written_layer_reads_as_the_disk_did_and_takes_a_new_overlay() {
    let (b, bytes) = base(32);
    let (data, map) = (tempfile(), tempfile());
    let mut d = LayeredDisk::new(dup(&b), None, tempfile(), 1 << 20).unwrap();
    d.write_at(&[9u8; BS * 3], 4 * BLOCK_SIZE).unwrap();
    d.write_at(&[8u8; 512], 20 * BLOCK_SIZE + 512).unwrap();
    let seen = read(&d, 0, bytes.len());
    assert_eq!(d.write_layer(&data, &map).unwrap(), 4);
    let layer = Layer::open(dup(&data), &map, 32).unwrap();
    assert_eq!(layer.blocks(), 4);
    let mut clone = LayeredDisk::new(dup(&b), Some(layer), tempfile(), 1 << 20).unwrap();
    assert_eq!(read(&clone, 0, bytes.len()), seen);
    // The clone's writes go to its own overlay; the layer is left as it was.
    let layer_before = std::fs::read(format!("/proc/self/fd/{}", {
        use std::os::fd::AsRawFd;
        data.as_raw_fd()
    }))
    .unwrap();
    clone.write_at(&[5u8; 512], 4 * BLOCK_SIZE).unwrap();
    clone.write_at(&[6u8; BS], 30 * BLOCK_SIZE).unwrap();
    assert_eq!(clone.overlay_bytes(), 2 * BLOCK_SIZE);
    let mut want = seen.clone();
    want[4 * BS..4 * BS + 512].fill(5);
    want[30 * BS..31 * BS].fill(6);
    assert_eq!(read(&clone, 0, want.len()), want);
    let mut layer_after = vec![0u8; layer_before.len()];
    data.read_exact_at(&mut layer_after, 0).unwrap();
    assert_eq!(layer_after, layer_before);
    // A layer of the clone merges both: the clone's blocks over the template's.
    let (data2, map2) = (tempfile(), tempfile());
    assert_eq!(clone.write_layer(&data2, &map2).unwrap(), 5);
    let again = LayeredDisk::new(
        b,
        Some(Layer::open(data2, &map2, 32).unwrap()),
        tempfile(),
        0,
    )
    .unwrap();
    assert_eq!(read(&again, 0, want.len()), want);
}

#[test]
fn a_damaged_map_is_refused_with_its_reason() {
    let (b, _) = base(8);
    let mut d = LayeredDisk::new(dup(&b), None, tempfile(), 1 << 20).unwrap();
    d.write_at(&[1u8; BS], 3 * BLOCK_SIZE).unwrap();
    d.write_at(&[1u8; BS], 5 * BLOCK_SIZE).unwrap();
    let (data, map) = (tempfile(), tempfile());
    d.write_layer(&data, &map).unwrap();
    let good = std::fs::read(format!("/proc/self/fd/{}", {
        use std::os::fd::AsRawFd;
        map.as_raw_fd()
    }))
    .unwrap();
    let with = |bytes: &[u8]| {
        let m = tempfile();
        m.write_all_at(bytes, 0).unwrap();
        Layer::open(dup(&data), &m, 8)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let mut flipped = good.clone();
    flipped[MAP_HEADER] ^= 1;
    assert!(with(&flipped).contains("checksum"), "{}", with(&flipped));
    assert!(with(&good[..10]).contains("bytes"));
    assert!(with(&[]).contains("bytes"));
    // Re-sealed with a valid checksum: a block outside the disk, a block named twice.
    let seal = |mut body: Vec<u8>| {
        body.truncate(body.len() - 4);
        let crc = crc32fast::hash(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        body
    };
    let mut outside = good.clone();
    outside[MAP_HEADER..MAP_HEADER + 8].copy_from_slice(&8u64.to_le_bytes());
    assert!(with(&seal(outside)).contains("outside"));
    let mut twice = good.clone();
    twice[MAP_HEADER + 8..MAP_HEADER + 16].copy_from_slice(&3u64.to_le_bytes());
    assert!(with(&seal(twice)).contains("twice"));
    // A data file shorter than the map says.
    let short = tempfile();
    short.write_all_at(&[0u8; BS], 0).unwrap();
    assert!(
        Layer::open(short, &map, 8)
            .unwrap_err()
            .to_string()
            .contains("data file")
    );
    // An overlay that is not empty, a base that is not whole blocks.
    let used = tempfile();
    used.write_all_at(b"x", 0).unwrap();
    assert!(matches!(
        LayeredDisk::new(dup(&b), None, used, 0),
        Err(LayerError::OverlayNotEmpty(1))
    ));
    let odd = tempfile();
    odd.write_all_at(&[0u8; 1000], 0).unwrap();
    assert!(matches!(
        LayeredDisk::new(odd, None, tempfile(), 0),
        Err(LayerError::BaseSize(1000))
    ));
}

/// A small deterministic generator (xorshift), for the model test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_sector_reads_and_writes_match_a_plain_buffer_across_layers() {
    const BLOCKS: u64 = 64;
    let (b, bytes) = base(BLOCKS);
    let mut model = bytes;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut disk = LayeredDisk::new(dup(&b), None, tempfile(), 1 << 30).unwrap();
    let sectors = BLOCKS * BLOCK_SIZE / 512;
    for round in 0..3 {
        for i in 0..400u64 {
            let start = rng.below(sectors);
            let len = (1 + rng.below(24)).min(sectors - start) as usize * 512;
            let offset = start * 512;
            if rng.below(2) == 0 {
                let data: Vec<u8> = (0..len).map(|k| (k as u64 ^ i ^ round) as u8).collect();
                disk.write_at(&data, offset).unwrap();
                model[offset as usize..offset as usize + len].copy_from_slice(&data);
            } else {
                assert_eq!(
                    read(&disk, offset, len),
                    model[offset as usize..offset as usize + len],
                    "round {round}, op {i}: {len} bytes at {offset}"
                );
            }
        }
        assert_eq!(read(&disk, 0, model.len()), model, "round {round}");
        // Snapshot into a layer and go on over it with a new overlay.
        let (data, map) = (tempfile(), tempfile());
        disk.write_layer(&data, &map).unwrap();
        let layer = Layer::open(data, &map, BLOCKS).unwrap();
        disk = LayeredDisk::new(dup(&b), Some(layer), tempfile(), 1 << 30).unwrap();
        assert_eq!(read(&disk, 0, model.len()), model, "after layer {round}");
    }
}
