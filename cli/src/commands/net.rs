//! `net`, `egress`, `expose`: a sandbox's egress policy, its egress log, and its guest ports
//! exposed on the daemon's host.

use airlock_api::v1::{EgressEvent, GetEgressLogRequest};
use serde_json::Value;

use super::log::{self, Log, Page, Range};
use super::{Client, Ctx, fail};
use crate::args::{ExposeArgs, LogArgs, NetArgs};
use crate::output::{
    egress_header, egress_json, egress_line, exposure_json, exposure_text, print_json,
    sandbox_json, sandbox_text,
};
use crate::request::{expose_request, net_request};

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

/// The egress log.
#[derive(Debug)]
struct Egress;

impl Log for Egress {
    type Event = EgressEvent;
    const NAME: &'static str = "egress";

    async fn page(
        client: &mut Client,
        id: &str,
        page: &Page<'_>,
    ) -> Result<(Vec<EgressEvent>, u64), tonic::Status> {
        let req = GetEgressLogRequest {
            sandbox_id: id.to_owned(),
            after_seq: page.after_seq,
            limit: page.limit,
            kinds: page.kinds.to_vec(),
            since_unix_ms: page.since_ms,
            until_unix_ms: page.until_ms,
        };
        let r = client.get_egress_log(req).await?.into_inner();
        Ok((r.events, r.dropped))
    }
    fn seq(e: &EgressEvent) -> u64 {
        e.seq
    }
    fn header() -> String {
        egress_header()
    }
    fn line(e: &EgressEvent) -> String {
        egress_line(e)
    }
    fn json(e: &EgressEvent) -> Value {
        egress_json(e)
    }
}

/// `egress`: the log from `--after` on (all of it, or `--limit` events), as lines or a JSON
/// list; `--follow` then polls for new events until the sandbox ends, printing them as they
/// come (JSON: one record per line).
pub async fn egress(ctx: &mut Ctx, args: &LogArgs) -> Result<u8, String> {
    log::show::<Egress>(ctx, Range::from(args)).await
}
