//! A VMM's control socket: request lines as the VMM parses them, replies as the daemon reads
//! them.
#![no_main]

use airlock_control::{
    Request, RestoreReply, SnapshotReply, StateReply, StatusReply, StopReply, parse_reply,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = Request::parse(line) {
        // What parses prints back to the same request.
        assert_eq!(Request::parse(&r.to_line()).ok(), Some(r));
    }
    let _ = parse_reply::<StatusReply>(line);
    let _ = parse_reply::<StateReply>(line);
    let _ = parse_reply::<SnapshotReply>(line);
    let _ = parse_reply::<RestoreReply>(line);
    let _ = parse_reply::<StopReply>(line);
});
