//! The audit trail's hash chain, shared by the daemon (which writes it) and its clients
//! (which verify it): each event's `hash` is the hex SHA-256 of its `prev_hash`, a newline,
//! and its canonical JSON (the object of seq, time_unix_ms, tenant, kind, sandbox_id,
//! execution_id and the parsed detail; compact, keys sorted at every level).

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::v1::AuditEvent;

pub const ZERO_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The canonical form an event's hash covers.
pub fn canonical(e: &AuditEvent, detail: &Value) -> String {
    // serde_json's maps are sorted by key (no `preserve_order`): the form is canonical.
    json!({
        "seq": e.seq,
        "time_unix_ms": e.time_unix_ms,
        "tenant": e.tenant,
        "kind": e.kind,
        "sandbox_id": e.sandbox_id,
        "execution_id": e.execution_id,
        "detail": detail,
    })
    .to_string()
}

pub fn hash_of(prev_hash: &str, canonical: &str) -> String {
    let mut h = Sha256::new();
    h.update(prev_hash.as_bytes());
    h.update(b"\n");
    h.update(canonical.as_bytes());
    hex(&h.finalize())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What is wrong with a run of events (oldest first, the chain's first kept one anchoring
/// it): each problem with the seq it concerns.
pub fn verify(events: &[AuditEvent]) -> Vec<(u64, String)> {
    let mut problems = Vec::new();
    let mut prev: Option<&AuditEvent> = None;
    for e in events {
        match serde_json::from_str::<Value>(&e.detail_json) {
            Ok(detail) => {
                if hash_of(&e.prev_hash, &canonical(e, &detail)) != e.hash {
                    problems.push((e.seq, "its hash does not match its content (edited)".into()));
                }
            }
            Err(err) => problems.push((e.seq, format!("its detail is not JSON: {err}"))),
        }
        match prev {
            None if e.seq == 1 && e.prev_hash != ZERO_HASH => {
                problems.push((e.seq, "the first event does not start the chain".into()));
            }
            Some(p) if e.seq != p.seq + 1 => problems.push((
                e.seq,
                format!("events {} to {} are missing", p.seq + 1, e.seq - 1),
            )),
            Some(p) if e.prev_hash != p.hash => problems.push((
                e.seq,
                format!("its prev_hash is not the hash of event {}", p.seq),
            )),
            _ => {}
        }
        prev = Some(e);
    }
    problems
}
