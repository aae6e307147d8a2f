//! The agent's answers as the daemon and `airlock-vmm run` read them: frames (length, body),
//! listings counted before decoding, responses checked against the requests in flight.
#![no_main]

use airlock_proto::pb::{self, request};
use airlock_proto::{AgentClient, count_field};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = count_field(data, &[18, 1]);
    // The agent's side of a connection: whatever it sends, after a Ready it may or may not be.
    let Ok(mut client) = AgentClient::from_stream(data, std::io::sink()) else {
        return;
    };
    // Requests in flight of every shape, so that answers to each are checked.
    let _ = client.send_kind(request::Kind::Ping(pb::Ping {}));
    let _ = client.send_kind(request::Kind::Exec(pb::Exec::shell("true")));
    let _ = client.send_kind(request::Kind::ListDir(pb::ListDir::default()));
    for _ in 0..64 {
        if client.recv().is_err() {
            break;
        }
    }
});
