//! What one tenant may write to the trail: at most `max_events_per_s` events a second on
//! average (bursts of `burst_events`), each of at most `max_event_bytes` of detail. The caps
//! keep the chain honest rather than thin it silently:
//! - an event over the rate is not written, but counted; the tenant's next event that is
//!   admitted is preceded by one `audit.dropped` event, in the chain like any other, that says
//!   how many events of which kinds were dropped and between which times. A reader thus sees
//!   every gap, and the seq's run has none (nothing dropped ever took a seq);
//! - an event over the size keeps its place, kind and ids, its detail replaced by
//!   `{"oversize": {"bytes", "sha256"}}` of the detail's JSON, which the original matches.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{AuditConfig, Kind, hex};

/// A tenant's allowance and what it has lost since its last admitted event.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at_ms: i64,
    dropped: BTreeMap<&'static str, u64>,
    dropped_from_ms: i64,
    dropped_to_ms: i64,
}

/// The tenants' allowances.
#[derive(Debug)]
pub struct Limiter {
    per_s: f64,
    burst: f64,
    tenants: Mutex<HashMap<String, Bucket>>,
}

/// Whether an event is written, and the drop note to write before it.
#[derive(Debug, PartialEq)]
pub enum Admit {
    Write { dropped: Option<Value> },
    Drop,
}

impl Limiter {
    pub fn new(cfg: &AuditConfig) -> Self {
        Self {
            per_s: f64::from(cfg.max_events_per_s),
            burst: f64::from(cfg.burst_events.max(1)),
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `tenant` may write an event of `kind` at `now_ms` (no rate: always).
    pub fn admit(&self, tenant: &str, kind: Kind, now_ms: i64) -> Admit {
        if self.per_s <= 0.0 {
            return Admit::Write { dropped: None };
        }
        let mut all = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let b = all.entry(tenant.to_owned()).or_insert_with(|| Bucket {
            tokens: self.burst,
            at_ms: now_ms,
            dropped: BTreeMap::new(),
            dropped_from_ms: 0,
            dropped_to_ms: 0,
        });
        let elapsed = (now_ms - b.at_ms).max(0) as f64 / 1000.0;
        b.tokens = (b.tokens + elapsed * self.per_s).min(self.burst);
        b.at_ms = now_ms;
        if b.tokens < 1.0 {
            if b.dropped.is_empty() {
                b.dropped_from_ms = now_ms;
            }
            *b.dropped.entry(kind.as_str()).or_default() += 1;
            b.dropped_to_ms = now_ms;
            return Admit::Drop;
        }
        b.tokens -= 1.0;
        if b.dropped.is_empty() {
            return Admit::Write { dropped: None };
        }
        let by_kind = std::mem::take(&mut b.dropped);
        let note = json!({
            "dropped": by_kind.values().sum::<u64>(),
            "by_kind": by_kind,
            "from_unix_ms": b.dropped_from_ms,
            "to_unix_ms": b.dropped_to_ms,
            "max_events_per_s": self.per_s,
            "burst_events": self.burst,
        });
        Admit::Write {
            dropped: Some(note),
        }
    }
}

/// `detail`, or its size and digest when its JSON is over `max` bytes (0: no cap).
pub fn capped(detail: Value, max: usize) -> Value {
    let text = detail.to_string();
    if max == 0 || text.len() <= max {
        return detail;
    }
    json!({ "oversize": { "bytes": text.len(), "sha256": hex(&Sha256::digest(text.as_bytes())) } })
}
