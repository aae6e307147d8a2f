//! `net`, `egress`, `expose`: a sandbox's egress policy, its egress log, and its guest ports
//! exposed on the daemon's host.

use std::time::Duration;

use airlock_api::v1::{EgressEvent, GetEgressLogRequest, GetSandboxRequest, SandboxState};
use serde_json::Value;

use super::{Ctx, fail};
use crate::args::{EgressArgs, ExposeArgs, NetArgs};
use crate::output::{
    egress_header, egress_json, egress_line, exposure_json, exposure_text, print_json,
    sandbox_json, sandbox_text,
};
use crate::request::{expose_request, net_request};

/// The most events one `GetEgressLog` call answers.
const MAX_PAGE: u32 = 10_000;

/// How often `egress --follow` asks for new events.
const POLL: Duration = Duration::from_secs(1);

/// `net`: replaces the policy and prints the sandbox as `get` does.
pub async fn net(ctx: &mut Ctx, args: &NetArgs) -> Result<u8, String> {
    let s = ctx
        .client
        .set_network_policy(net_request(args))
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&sandbox_json(&s));
    } else {
        print!("{}", sandbox_text(&s));
    }
    Ok(0)
}

/// `expose`: prints the address, the token and the expiry, or the record.
pub async fn expose(ctx: &mut Ctx, args: &ExposeArgs) -> Result<u8, String> {
    let e = ctx
        .client
        .expose_port(expose_request(args))
        .await
        .map_err(fail)?
        .into_inner();
    if ctx.json {
        print_json(&exposure_json(&e));
    } else {
        print!("{}", exposure_text(&e));
    }
    Ok(0)
}

/// Where `egress` stands: the last event printed, what is left of `--limit`, and the count of
/// dropped events already reported.
struct Cursor {
    after: u64,
    left: Option<u32>,
    dropped: u64,
}

/// `egress`: the log from `--after` on (all of it, or `--limit` events), as lines or a JSON
/// list; `--follow` then polls for new events until the sandbox ends, printing them as they
/// come (JSON: one record per line).
pub async fn egress(ctx: &mut Ctx, args: &EgressArgs) -> Result<u8, String> {
    let mut cur = Cursor {
        after: args.after,
        left: args.limit,
        dropped: 0,
    };
    let json = ctx.json;
    // Text: the header comes with the first event (or alone at the end of an empty log), so
    // that a failing call prints nothing on stdout.
    let mut header = !json;
    let mut collected = Vec::new();
    let mut print = |e: &EgressEvent| match (json, args.follow) {
        (false, _) => {
            if std::mem::take(&mut header) {
                println!("{}", egress_header());
            }
            println!("{}", egress_line(e));
        }
        (true, true) => print_json(&egress_json(e)),
        (true, false) => collected.push(egress_json(e)),
    };
    let mut ended = false;
    loop {
        catch_up(&mut ctx.client, &args.id, &mut cur, &mut print).await?;
        if !args.follow || ended {
            break;
        }
        // Seen ended before the last catch-up: what it logged until then is printed.
        ended = sandbox_ended(ctx, &args.id).await?;
        if !ended {
            tokio::time::sleep(POLL).await;
        }
    }
    if json && !args.follow {
        print_json(&Value::Array(collected));
    }
    if header {
        println!("{}", egress_header());
    }
    Ok(0)
}

/// Whether the sandbox is dead or destroyed (its log grows no more).
async fn sandbox_ended(ctx: &mut Ctx, id: &str) -> Result<bool, String> {
    let req = GetSandboxRequest {
        sandbox_id: id.to_owned(),
    };
    let s = ctx
        .client
        .get_sandbox(req)
        .await
        .map_err(fail)?
        .into_inner();
    Ok(matches!(
        SandboxState::try_from(s.state),
        Ok(SandboxState::Dead | SandboxState::Destroyed)
    ))
}

/// Fetches and prints the events after `cur.after`, page by page, until there are no more (or
/// the limit is reached).
async fn catch_up(
    client: &mut super::Client,
    id: &str,
    cur: &mut Cursor,
    print: &mut dyn FnMut(&EgressEvent),
) -> Result<(), String> {
    loop {
        if cur.left == Some(0) {
            return Ok(());
        }
        let req = GetEgressLogRequest {
            sandbox_id: id.to_owned(),
            after_seq: cur.after,
            limit: cur.left.map_or(0, |n| n.min(MAX_PAGE)),
        };
        let r = client.get_egress_log(req).await.map_err(fail)?.into_inner();
        if r.dropped > cur.dropped {
            eprintln!(
                "airlock: note: {} egress events of this sandbox were not kept (the log is \
                 full); they are counted, not shown",
                r.dropped
            );
            cur.dropped = r.dropped;
        }
        let before = cur.after;
        let mut n: u32 = 0;
        for e in &r.events {
            if cur.left.is_some_and(|left| n >= left) {
                break;
            }
            print(e);
            cur.after = cur.after.max(e.seq);
            n = n.saturating_add(1);
        }
        if let Some(left) = &mut cur.left {
            *left = left.saturating_sub(n);
        }
        // No events, or none past where we stood (a daemon that would repeat itself): done.
        if cur.after == before {
            return Ok(());
        }
    }
}
