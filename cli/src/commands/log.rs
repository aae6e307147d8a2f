//! The logs a sandbox keeps, read the same way (`egress`, `installs`): from `--after` on, all
//! of it or `--limit` events, of `--kind`, `--since` and `--until` (as the audit trail is
//! filtered: [`Page`]), as lines or a JSON list; `--follow` then polls for new events until the
//! sandbox ends, printing them as they come (JSON: one record per line).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use airlock_api::v1::{GetSandboxRequest, SandboxState};
use serde_json::Value;

use super::{Client, Ctx, fail};
use crate::args::{EventFilter, LogArgs};
use crate::output::print_json;

/// The most events one call answers.
const MAX_PAGE: u32 = 10_000;

/// How often `--follow` asks for new events.
const POLL: Duration = Duration::from_secs(1);

/// One of a sandbox's logs: how to fetch a page of it and how to print its events.
pub(super) trait Log {
    /// An entry.
    type Event;
    /// What the note on dropped events calls them ("egress", "install").
    const NAME: &'static str;
    /// The events `page` asks for, and the count of events the log did not keep.
    async fn page(
        client: &mut Client,
        id: &str,
        page: &Page<'_>,
    ) -> Result<(Vec<Self::Event>, u64), tonic::Status>;
    /// An event's sequence number.
    fn seq(e: &Self::Event) -> u64;
    /// The header of the lines.
    fn header() -> String;
    /// An event as a line.
    fn line(e: &Self::Event) -> String;
    /// An event's JSON record.
    fn json(e: &Self::Event) -> Value;
}

/// One call's question to a log: the events after `after_seq`, at most `limit` (0: the
/// daemon's default), of `kinds` (empty: all), at or after `since_ms` and before `until_ms` (0:
/// unbounded), as every log's request takes them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Page<'a> {
    pub after_seq: u64,
    pub limit: u32,
    pub kinds: &'a [String],
    pub since_ms: i64,
    pub until_ms: i64,
}

impl<'a> Page<'a> {
    /// The first page of what `filter` selects, its times read against now.
    pub fn of(filter: &'a EventFilter) -> Self {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        Page {
            after_seq: 0,
            limit: 0,
            kinds: &filter.kinds,
            since_ms: filter.since.map_or(0, |w| w.unix_ms(now_ms)),
            until_ms: filter.until.map_or(0, |w| w.unix_ms(now_ms)),
        }
    }
}

/// What to read of a log: the sandbox, where to start, how many, which, and whether to follow
/// it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Range<'a> {
    pub id: &'a str,
    pub after: u64,
    pub limit: Option<u32>,
    pub follow: bool,
    pub filter: &'a EventFilter,
}

impl<'a> From<&'a LogArgs> for Range<'a> {
    fn from(a: &'a LogArgs) -> Self {
        Range {
            id: &a.id,
            after: a.after,
            limit: a.limit,
            follow: a.follow,
            filter: &a.filter,
        }
    }
}

/// Where the reading stands: the last event printed, what is left of `--limit`, and the count
/// of dropped events already reported.
struct Cursor {
    after: u64,
    left: Option<u32>,
    dropped: u64,
}

/// Prints the log of `range` (see the module's comment).
pub(super) async fn show<L: Log>(ctx: &mut Ctx, range: Range<'_>) -> Result<u8, String> {
    let mut cur = Cursor {
        after: range.after,
        left: range.limit,
        dropped: 0,
    };
    let json = ctx.json;
    // Text: the header comes with the first event (or alone at the end of an empty log), so
    // that a failing call prints nothing on stdout.
    let mut header = !json;
    let mut collected = Vec::new();
    let mut print = |e: &L::Event| match (json, range.follow) {
        (false, _) => {
            if std::mem::take(&mut header) {
                println!("{}", L::header());
            }
            println!("{}", L::line(e));
        }
        (true, true) => print_json(&L::json(e)),
        (true, false) => collected.push(L::json(e)),
    };
    let mut ended = false;
    let filter = Page::of(range.filter);
    loop {
        catch_up::<L>(&mut ctx.client, range.id, &filter, &mut cur, &mut print).await?;
        if !range.follow || ended {
            break;
        }
        // Seen ended before the last catch-up: what it logged until then is printed.
        ended = sandbox_ended(ctx, range.id).await?;
        if !ended {
            tokio::time::sleep(POLL).await;
        }
    }
    if json && !range.follow {
        print_json(&Value::Array(collected));
    }
    if header {
        println!("{}", L::header());
    }
    Ok(0)
}

/// Whether the sandbox is dead or destroyed (its logs grow no more).
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
async fn catch_up<L: Log>(
    client: &mut Client,
    id: &str,
    filter: &Page<'_>,
    cur: &mut Cursor,
    print: &mut dyn FnMut(&L::Event),
) -> Result<(), String> {
    loop {
        if cur.left == Some(0) {
            return Ok(());
        }
        let limit = cur.left.map_or(0, |n| n.min(MAX_PAGE));
        let page = Page {
            after_seq: cur.after,
            limit,
            ..*filter
        };
        let (events, dropped) = L::page(client, id, &page).await.map_err(fail)?;
        if dropped > cur.dropped {
            eprintln!(
                "airlock: note: {dropped} {} events of this sandbox were not kept (the log is \
                 full); they are counted, not shown",
                L::NAME
            );
            cur.dropped = dropped;
        }
        let before = cur.after;
        let mut n: u32 = 0;
        for e in &events {
            if cur.left.is_some_and(|left| n >= left) {
                break;
            }
            print(e);
            cur.after = cur.after.max(L::seq(e));
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
