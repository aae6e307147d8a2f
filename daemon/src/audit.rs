//! The audit trail: per tenant, an append-only, hash-chained log of what its sandboxes did
//! (created, ended and how their cleanup went, executions with code as its digest, files
//! written and read, packages, egress, secret uses, policy denials), in the record store.
//!
//! Each event's `hash` is the hex SHA-256 of its `prev_hash` (the hex hash of the event before
//! it, 64 zeroes for the first), a newline, and the event's canonical JSON: the object
//! `{"detail", "execution_id", "kind", "sandbox_id", "seq", "tenant", "time_unix_ms"}`,
//! compact, keys sorted at every level. An edited event no longer matches its hash, a removed
//! one breaks the chain (and the seq's run); `airlock audit verify` checks both.

use std::sync::{Arc, OnceLock};

use airlock_api::v1::{
    AuditEvent, EgressEvent, InstallEvent, InstallOutcome, ListAuditEventsRequest,
    ListAuditEventsResponse,
};
use rusqlite::{OptionalExtension, params};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tracing::warn;

pub use airlock_api::audit::{ZERO_HASH, canonical, hash_of, hex};

use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::store::Store;

/// `[audit]` in the daemon's config.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// Events older than this many days are removed (0: kept for ever). The first kept
    /// event's `prev_hash` then anchors the chain.
    pub retention_days: u32,
    /// Record executions' code itself (not only its SHA-256 and size). Off by default.
    pub record_code: bool,
    /// Events a tenant may write a second, on average (0: no cap); more are dropped and
    /// counted in an `audit.dropped` event before the tenant's next one ([`rate`]).
    pub max_events_per_s: u32,
    /// Events a tenant may write at once above that rate.
    pub burst_events: u32,
    /// An event's detail over this many bytes of JSON is kept as its size and SHA-256 only
    /// (0: no cap).
    pub max_event_bytes: usize,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            retention_days: 90,
            record_code: false,
            max_events_per_s: 50,
            burst_events: 500,
            max_event_bytes: 64 << 10,
        }
    }
}

mod rate;

/// Where events go: the daemon's store, under its config's caps.
#[derive(Debug)]
pub struct Trail {
    store: Arc<Store>,
    cfg: AuditConfig,
    limiter: rate::Limiter,
}

impl Trail {
    pub fn new(store: Arc<Store>, cfg: AuditConfig) -> Self {
        let limiter = rate::Limiter::new(&cfg);
        Self {
            store,
            cfg,
            limiter,
        }
    }

    /// Appends an event to `tenant`'s trail at `now_ms` within the caps ([`rate`]): the
    /// event, after a note of the events dropped before it; none when it is over the rate.
    pub fn record(
        &self,
        tenant: &str,
        kind: Kind,
        ids: (&str, &str),
        detail: Value,
        now_ms: i64,
    ) -> ApiResult<Option<AuditEvent>> {
        let (sandbox_id, execution_id) = ids;
        let dropped = match self.limiter.admit(tenant, kind, now_ms) {
            rate::Admit::Drop => return Ok(None),
            rate::Admit::Write { dropped } => dropped,
        };
        if let Some(note) = dropped {
            append(&self.store, tenant, Kind::AuditDropped, "", "", note)?;
        }
        let detail = rate::capped(detail, self.cfg.max_event_bytes);
        append(&self.store, tenant, kind, sandbox_id, execution_id, detail).map(Some)
    }
}

/// Where events go: the daemon's trail (set once at its start; without it, as in unit tests
/// of other parts, events are not kept).
static SINK: OnceLock<Trail> = OnceLock::new();

pub fn init(store: Arc<Store>, cfg: AuditConfig) {
    let _ = SINK.set(Trail::new(store, cfg));
}

/// Whether executions' code is recorded as is.
pub fn records_code() -> bool {
    SINK.get().is_some_and(|t| t.cfg.record_code)
}

/// SHA-256 (hex) and size of `data`, as events name code and files.
pub fn digest(data: &[u8]) -> Value {
    json!({ "sha256": hex(&Sha256::digest(data)), "bytes": data.len() })
}

/// What an event records; its `kind` in the trail is [`Kind::as_str`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `sandbox.create`: a sandbox was made (its spec, redacted).
    SandboxCreate,
    /// `sandbox.end`: a sandbox ended (why).
    SandboxEnd,
    /// `exec.start`: an execution started (its command, or its digest).
    ExecStart,
    /// `exec.end`: an execution ended (how).
    ExecEnd,
    /// `file.write`: a file was written into a sandbox (path, digest).
    FileWrite,
    /// `file.read`: a file was read from a sandbox (path, digest).
    FileRead,
    /// `secret.use`: a secret was handed to a sandbox or used by the broker (its name).
    SecretUse,
    /// `secret.remove`: secrets were removed or expired.
    SecretRemove,
    /// `egress`: an allowed connection left a sandbox.
    Egress,
    /// `package`: a package was installed through the proxy.
    Package,
    /// `denial`: a call, connection or package was refused by policy.
    Denial,
    /// `audit.dropped`: events over the tenant's rate were not written (how many, of which
    /// kinds, when).
    AuditDropped,
    /// `code.run`: a code interpreter cell ran (its context, language, how it ended, how long
    /// it took, its code's digest; never the code itself).
    CodeRun,
}

impl Kind {
    #[cfg(test)]
    pub const ALL: [Kind; 13] = [
        Kind::SandboxCreate,
        Kind::SandboxEnd,
        Kind::ExecStart,
        Kind::ExecEnd,
        Kind::FileWrite,
        Kind::FileRead,
        Kind::SecretUse,
        Kind::SecretRemove,
        Kind::Egress,
        Kind::Package,
        Kind::Denial,
        Kind::AuditDropped,
        Kind::CodeRun,
    ];

    /// The kind's name in the trail and in ListAuditEvents' filter.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::SandboxCreate => "sandbox.create",
            Kind::SandboxEnd => "sandbox.end",
            Kind::ExecStart => "exec.start",
            Kind::ExecEnd => "exec.end",
            Kind::FileWrite => "file.write",
            Kind::FileRead => "file.read",
            Kind::SecretUse => "secret.use",
            Kind::SecretRemove => "secret.remove",
            Kind::Egress => "egress",
            Kind::Package => "package",
            Kind::Denial => "denial",
            Kind::AuditDropped => "audit.dropped",
            Kind::CodeRun => "code.run",
        }
    }
}

/// A sandbox's network policy as the trail records it: its fields, by name (`null`: none).
pub fn network(policy: Option<&airlock_api::v1::NetworkPolicy>) -> Value {
    use airlock_api::v1::egress_rule::Target;
    let Some(p) = policy else {
        return Value::Null;
    };
    let rules: Vec<Value> = p
        .allow
        .iter()
        .map(|r| {
            let (key, value) = match &r.target {
                Some(Target::Domain(d)) => ("domain", d.as_str()),
                Some(Target::Cidr(c)) => ("cidr", c.as_str()),
                None => ("domain", ""),
            };
            json!({ key: value, "ports": r.ports })
        })
        .collect();
    json!({ "allow_internet": p.allow_internet, "allow": rules })
}

/// A sandbox's package policy as the trail records it (`null`: none).
pub fn packages(policy: Option<&airlock_api::v1::PackagePolicy>) -> Value {
    let Some(p) = policy else {
        return Value::Null;
    };
    json!({
        "registries": p.registries,
        "allow": p.allow,
        "deny": p.deny,
        "offline": p.offline,
        "max_download_bytes": p.max_download_bytes,
    })
}

/// An event of a sandbox's log (`crate::events`) as the trail records it: its kind (what it
/// was, or `denial`) and its detail.
pub trait Audited {
    fn audit(&self) -> (Kind, Value);
}

impl Audited for EgressEvent {
    fn audit(&self) -> (Kind, Value) {
        let kind = match self.allowed {
            true => Kind::Egress,
            false => Kind::Denial,
        };
        let detail = json!({
            "egress_seq": self.seq,
            "type": crate::events::Event::kind(self),
            "name": self.name,
            "address": self.address,
            "port": self.port,
            "allowed": self.allowed,
            "verdict": self.verdict,
            "bytes_out": self.bytes_out,
            "bytes_in": self.bytes_in,
        });
        (kind, detail)
    }
}

impl Audited for InstallEvent {
    fn audit(&self) -> (Kind, Value) {
        let kind = match self.outcome() {
            InstallOutcome::Denied => Kind::Denial,
            _ => Kind::Package,
        };
        let detail = json!({
            "install_seq": self.seq,
            "registry": self.registry,
            "type": self.kind,
            "package": self.package,
            "version": self.version,
            "file": self.file,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "outcome": crate::events::Event::kind(self),
            "message": self.message,
        });
        (kind, detail)
    }
}

/// Records `e`, just kept in sandbox `sandbox_id`'s log, in `tenant`'s trail.
pub fn logged(tenant: &str, sandbox_id: &str, e: &impl Audited) {
    let (kind, detail) = e.audit();
    emit(tenant, kind, sandbox_id, "", detail);
}

/// Appends an event to `tenant`'s trail (a failure is logged: the call it records goes on).
pub fn emit(tenant: &str, kind: Kind, sandbox_id: &str, execution_id: &str, detail: Value) {
    let Some(trail) = SINK.get() else {
        return;
    };
    let ids = (sandbox_id, execution_id);
    if let Err(e) = trail.record(tenant, kind, ids, detail, ids::now_ms()) {
        warn!(tenant, kind = kind.as_str(), "audit event not stored: {e}");
    }
}

/// Appends one event; its seq and prev_hash follow the tenant's last one.
pub fn append(
    store: &Store,
    tenant: &str,
    kind: Kind,
    sandbox_id: &str,
    execution_id: &str,
    detail: Value,
) -> ApiResult<AuditEvent> {
    let db = store.db();
    let last: Option<(i64, String)> = db
        .query_row(
            "SELECT seq, hash FROM audit_events WHERE tenant = ?1 ORDER BY seq DESC LIMIT 1",
            params![tenant],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let (seq, prev_hash) = match last {
        Some((s, h)) => (s as u64 + 1, h),
        None => (1, ZERO_HASH.to_owned()),
    };
    let mut e = AuditEvent {
        seq,
        time_unix_ms: ids::now_ms(),
        tenant: tenant.to_owned(),
        kind: kind.as_str().to_owned(),
        sandbox_id: sandbox_id.to_owned(),
        execution_id: execution_id.to_owned(),
        detail_json: detail.to_string(),
        prev_hash,
        hash: String::new(),
    };
    e.hash = hash_of(&e.prev_hash, &canonical(&e, &detail));
    db.execute(
        "INSERT INTO audit_events (tenant, seq, time_ms, kind, sandbox_id, execution_id, \
         detail, prev_hash, hash) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            e.tenant,
            e.seq as i64,
            e.time_unix_ms,
            e.kind,
            e.sandbox_id,
            e.execution_id,
            e.detail_json,
            e.prev_hash,
            e.hash
        ],
    )?;
    Ok(e)
}

/// ListAuditEvents for `tenant`.
pub fn list(
    store: &Store,
    tenant: &str,
    req: &ListAuditEventsRequest,
) -> ApiResult<ListAuditEventsResponse> {
    let q = crate::events::Query::from(req);
    let db = store.db();
    let (head_seq, head_hash, first_seq): (i64, String, i64) = db.query_row(
        "SELECT COALESCE(MAX(seq), 0), \
         COALESCE((SELECT hash FROM audit_events WHERE tenant = ?1 ORDER BY seq DESC LIMIT 1), ''), \
         COALESCE(MIN(seq), 0) FROM audit_events WHERE tenant = ?1",
        params![tenant],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    let mut stmt = db.prepare_cached(
        "SELECT seq, time_ms, kind, sandbox_id, execution_id, detail, prev_hash, hash \
         FROM audit_events WHERE tenant = ?1 AND seq > ?2 \
         AND (?3 = '' OR sandbox_id = ?3) ORDER BY seq",
    )?;
    let rows = stmt.query_map(params![tenant, q.after_seq as i64, req.sandbox_id], |r| {
        Ok(AuditEvent {
            seq: r.get::<_, i64>(0)? as u64,
            time_unix_ms: r.get(1)?,
            tenant: tenant.to_owned(),
            kind: r.get(2)?,
            sandbox_id: r.get(3)?,
            execution_id: r.get(4)?,
            detail_json: r.get(5)?,
            prev_hash: r.get(6)?,
            hash: r.get(7)?,
        })
    })?;
    let (events, next_after_seq) =
        crate::events::select(&q, rows.map(|r| r.map_err(ApiError::from)))?;
    Ok(ListAuditEventsResponse {
        events,
        next_after_seq,
        head_seq: head_seq as u64,
        head_hash,
        first_seq: first_seq as u64,
    })
}

/// Removes events older than the retention (the retention loop calls it); how many.
pub fn prune(store: &Store) -> ApiResult<usize> {
    let Some(cfg) = SINK.get().map(|t| &t.cfg).filter(|c| c.retention_days > 0) else {
        return Ok(0);
    };
    let cutoff = ids::now_ms() - i64::from(cfg.retention_days) * 86_400_000;
    Ok(store.db().execute(
        "DELETE FROM audit_events WHERE time_ms < ?1",
        params![cutoff],
    )?)
}

/// The reasons that are a policy's refusal, recorded in the audit trail.
const DENIALS: &[&str] = &[
    "PATH_NOT_ALLOWED",
    "EXPORT_DENIED",
    "NETWORK_NOT_ALLOWED",
    "PACKAGES_NOT_ALLOWED",
    "QUOTA_EXCEEDED",
    "SECRETS_PRESENT",
    "GUEST_PERMISSION_DENIED",
    "UNAUTHENTICATED",
];

pub fn denial(tenant: &str, sandbox_id: &str, call: &str, e: &crate::error::ApiError) {
    if DENIALS.contains(&e.reason()) {
        let message = crate::secrets::logs::redact(Some(tenant), &e.to_string());
        crate::audit::emit(
            tenant,
            Kind::Denial,
            sandbox_id,
            "",
            serde_json::json!({ "call": call, "reason": e.reason(), "message": message }),
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::audit::verify;

    fn store() -> Store {
        let dir = std::env::temp_dir().join(format!(
            "airlock-audit-test-{}-{}",
            std::process::id(),
            ids::now_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Store::open(&dir.join("airlock.db")).unwrap()
    }

    #[test]
    fn the_chain_verifies_and_edits_and_removals_are_found() {
        let s = store();
        for i in 0..5 {
            append(
                &s,
                "t1",
                Kind::ExecStart,
                "sb-1",
                "ex-1",
                json!({"i": i, "é": "ü"}),
            )
            .unwrap();
        }
        append(&s, "t2", Kind::SandboxCreate, "sb-2", "", json!({})).unwrap();
        let all = list(&s, "t1", &ListAuditEventsRequest::default()).unwrap();
        assert_eq!(all.events.len(), 5);
        assert_eq!(all.head_seq, 5);
        assert_eq!(all.head_hash, all.events[4].hash);
        assert!(verify(&all.events).is_empty());
        // Tenants are apart: t2's chain starts at 1.
        let t2 = list(&s, "t2", &ListAuditEventsRequest::default()).unwrap();
        assert_eq!(t2.events.len(), 1);
        assert_eq!(t2.events[0].seq, 1);
        let mut edited = all.events.clone();
        edited[2].detail_json = r#"{"i":99,"é":"ü"}"#.into();
        assert_eq!(verify(&edited)[0].0, 3);
        let mut removed = all.events.clone();
        removed.remove(2);
        let problems = verify(&removed);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].1.contains("missing"), "{problems:?}");
        // Paging and filters.
        let page = list(
            &s,
            "t1",
            &ListAuditEventsRequest {
                limit: 2,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(page.events.len(), 2);
        assert_eq!(page.next_after_seq, 2);
        let none = list(
            &s,
            "t1",
            &ListAuditEventsRequest {
                kinds: vec!["file.write".into()],
                ..Default::default()
            },
        )
        .unwrap();
        assert!(none.events.is_empty());
    }

    #[test]
    fn policies_are_recorded_by_field_not_as_debug_text() {
        use airlock_api::v1::{EgressRule, NetworkPolicy, PackagePolicy, egress_rule::Target};
        let net = NetworkPolicy {
            allow_internet: false,
            allow: vec![
                EgressRule {
                    target: Some(Target::Domain("pypi.org".into())),
                    ports: vec![443],
                },
                EgressRule {
                    target: Some(Target::Cidr("203.0.113.0/24".into())),
                    ports: vec![],
                },
            ],
        };
        assert_eq!(
            network(Some(&net)),
            json!({"allow_internet": false, "allow": [
                {"domain": "pypi.org", "ports": [443]},
                {"cidr": "203.0.113.0/24", "ports": []},
            ]})
        );
        assert_eq!(network(None), Value::Null);
        let pkg = PackagePolicy {
            allow: vec!["requests".into()],
            offline: true,
            ..Default::default()
        };
        let v = packages(Some(&pkg));
        assert_eq!(v["allow"], json!(["requests"]));
        assert_eq!(v["offline"], json!(true));
        assert!(!v.to_string().contains("PackagePolicy"), "{v}");
    }

    #[test]
    fn events_over_the_rate_are_counted_in_the_chain_and_oversize_details_kept_as_digests() {
        let cfg = AuditConfig {
            max_events_per_s: 10,
            burst_events: 5,
            max_event_bytes: 4096,
            ..Default::default()
        };
        let trail = Trail::new(Arc::new(store()), cfg);
        let t0 = 1_000_000;
        let written = (0..20)
            .filter_map(|i| {
                let kind = if i % 2 == 0 {
                    Kind::FileRead
                } else {
                    Kind::Egress
                };
                trail
                    .record("t", kind, ("sb-1", ""), json!({ "i": i }), t0)
                    .unwrap()
            })
            .count();
        assert_eq!(written, 5, "a burst of 5, the other 15 dropped");
        // A second later there is room again: the drop note first, then the event.
        let big = json!({ "blob": "x".repeat(1 << 20) });
        let e = trail
            .record("t", Kind::FileWrite, ("sb-1", ""), big.clone(), t0 + 1000)
            .unwrap()
            .unwrap();
        let all = list(&trail.store, "t", &ListAuditEventsRequest::default()).unwrap();
        assert_eq!(all.events.len(), 7);
        assert!(verify(&all.events).is_empty(), "the chain is whole");
        let note = &all.events[5];
        assert_eq!(note.kind, "audit.dropped");
        let d: Value = serde_json::from_str(&note.detail_json).unwrap();
        assert_eq!(d["dropped"], 15);
        assert_eq!(d["by_kind"]["file.read"], 7);
        assert_eq!(d["by_kind"]["egress"], 8);
        // The oversize detail: its size and digest, which the original matches.
        assert_eq!(e.seq, 7);
        assert!(e.detail_json.len() < 4096, "{}", e.detail_json.len());
        let d: Value = serde_json::from_str(&e.detail_json).unwrap();
        let text = big.to_string();
        assert_eq!(d["oversize"]["bytes"], text.len());
        assert_eq!(
            d["oversize"]["sha256"],
            hex(&Sha256::digest(text.as_bytes()))
        );
        // Tenants are apart: another has its own allowance.
        assert!(
            trail
                .record("u", Kind::Egress, ("sb-2", ""), json!({}), t0)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn kinds_have_distinct_names() {
        let names: std::collections::BTreeSet<_> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), Kind::ALL.len());
    }
}
