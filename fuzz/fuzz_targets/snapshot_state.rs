//! A snapshot's state file as a restore reads it: header, size cap, checksum, payload, checks.
//! Half the inputs are taken as a whole file, half as a payload wrapped in a valid header
//! with its checksum, so that the decoding and validation behind the checksum are reached.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::snapshot::{MAGIC, Snapshot, VERSION};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let file = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&VERSION.to_le_bytes());
        f.extend_from_slice(&crc32fast::hash(rest).to_le_bytes());
        f.extend_from_slice(&(rest.len() as u64).to_le_bytes());
        f.extend_from_slice(rest);
        f
    };
    if let Ok(snap) = Snapshot::decode(file.as_slice()) {
        let _ = snap.validate();
    }
});
