//! `audit`: the tenant's audit trail, every page: listed, exported as JSON lines, or verified
//! (every event's hash recomputed, the chain unbroken from the first kept event to the head).

use airlock_api::v1::{AuditEvent, ListAuditEventsRequest, ListAuditEventsResponse};
use serde_json::{Value, json};

use super::log::Page;
use super::{Ctx, fail};
use crate::args::{AuditArgs, EventFilter};

/// An event as `export` writes it (and `verify --file` reads it).
fn event_json(e: &AuditEvent) -> Value {
    json!({
        "seq": e.seq, "time_unix_ms": e.time_unix_ms, "tenant": e.tenant, "kind": e.kind,
        "sandbox_id": e.sandbox_id, "execution_id": e.execution_id,
        "detail_json": e.detail_json, "prev_hash": e.prev_hash, "hash": e.hash,
    })
}

fn event_of(v: &Value) -> Option<AuditEvent> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(AuditEvent {
        seq: v.get("seq")?.as_u64()?,
        time_unix_ms: v.get("time_unix_ms")?.as_i64()?,
        tenant: s("tenant")?,
        kind: s("kind")?,
        sandbox_id: s("sandbox_id")?,
        execution_id: s("execution_id")?,
        detail_json: s("detail_json")?,
        prev_hash: s("prev_hash")?,
        hash: s("hash")?,
    })
}

/// Every page of the trail from `--after`, and the last page's answer (its head).
async fn fetch(
    ctx: &mut Ctx,
    args: &AuditArgs,
    filtered: bool,
) -> Result<(Vec<AuditEvent>, ListAuditEventsResponse), String> {
    let mut events = Vec::new();
    let mut after = args.after;
    let none = EventFilter::default();
    let filter = Page::of(if filtered { &args.filter } else { &none });
    loop {
        let req = ListAuditEventsRequest {
            after_seq: after,
            limit: 10_000,
            kinds: filter.kinds.to_vec(),
            sandbox_id: if filtered {
                args.sandbox.clone().unwrap_or_default()
            } else {
                String::new()
            },
            since_unix_ms: filter.since_ms,
            until_unix_ms: filter.until_ms,
        };
        let mut page = ctx
            .client
            .list_audit_events(req)
            .await
            .map_err(fail)?
            .into_inner();
        events.append(&mut page.events);
        if page.next_after_seq == 0 {
            return Ok((events, page));
        }
        after = page.next_after_seq;
    }
}

pub async fn run(ctx: &mut Ctx, args: &AuditArgs) -> Result<u8, String> {
    match args.action.as_str() {
        "verify" => verify(ctx, args).await,
        "export" => {
            let (events, _) = fetch(ctx, args, true).await?;
            for e in &events {
                println!("{}", event_json(e));
            }
            Ok(0)
        }
        _ => {
            let (events, _) = fetch(ctx, args, true).await?;
            if ctx.json {
                let all: Vec<Value> = events.iter().map(event_json).collect();
                println!("{}", Value::Array(all));
            } else {
                println!(
                    "{:>6}  {:<13}  {:<14}  {:<22}  {:<22}  DETAIL",
                    "SEQ", "TIME_MS", "KIND", "SANDBOX", "EXECUTION"
                );
                for e in &events {
                    println!(
                        "{:>6}  {:<13}  {:<14}  {:<22}  {:<22}  {}",
                        e.seq, e.time_unix_ms, e.kind, e.sandbox_id, e.execution_id, e.detail_json
                    );
                }
            }
            Ok(0)
        }
    }
}

/// `audit verify`: the daemon's whole trail (or an export) checked; exit code 1 with each
/// problem when it does not verify.
async fn verify(ctx: &mut Ctx, args: &AuditArgs) -> Result<u8, String> {
    let (events, head) = match &args.file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut events = Vec::new();
            for (n, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let e = serde_json::from_str::<Value>(line)
                    .ok()
                    .as_ref()
                    .and_then(event_of)
                    .ok_or_else(|| format!("{}:{}: not an audit event", path.display(), n + 1))?;
                events.push(e);
            }
            (events, None)
        }
        None => {
            let (events, last) = fetch(ctx, args, false).await?;
            (events, Some((last.head_seq, last.head_hash)))
        }
    };
    let mut problems = airlock_api::audit::verify(&events);
    if let Some((seq, hash)) = &head
        && events.last().map(|e| (e.seq, &e.hash)) != Some((*seq, hash))
        && *seq != 0
    {
        problems.push((*seq, "the trail does not end at the daemon's head".into()));
    }
    let first = events.first().map_or(0, |e| e.seq);
    let last = events.last().map_or(0, |e| e.seq);
    if ctx.json {
        let p: Vec<Value> = problems
            .iter()
            .map(|(s, m)| json!({"seq": s, "problem": m}))
            .collect();
        println!(
            "{}",
            json!({"ok": problems.is_empty(), "events": events.len(), "first_seq": first, "last_seq": last, "problems": p})
        );
    } else if problems.is_empty() {
        println!(
            "ok: {} events, seq {first} to {last}, chain intact",
            events.len()
        );
    } else {
        for (seq, m) in &problems {
            println!("event {seq}: {m}");
        }
        println!(
            "FAILED: {} problems in {} events",
            problems.len(),
            events.len()
        );
    }
    Ok(u8::from(!problems.is_empty()))
}
