//! `installs`: a sandbox's install log, the package files (and refused index pages) its pip or
//! npm asked the daemon's package proxy for. (`create` sends the package policy.)

use airlock_api::v1::{GetInstallLogRequest, InstallEvent};
use serde_json::Value;

use super::log::{self, Log, Page, Range};
use super::{Client, Ctx};
use crate::args::LogArgs;
use crate::output::{install_header, install_json, install_line};

/// The install log.
#[derive(Debug)]
struct Installs;

impl Log for Installs {
    type Event = InstallEvent;
    const NAME: &'static str = "install";

    async fn page(
        client: &mut Client,
        id: &str,
        page: &Page<'_>,
    ) -> Result<(Vec<InstallEvent>, u64), tonic::Status> {
        let req = GetInstallLogRequest {
            sandbox_id: id.to_owned(),
            after_seq: page.after_seq,
            limit: page.limit,
            kinds: page.kinds.to_vec(),
            since_unix_ms: page.since_ms,
            until_unix_ms: page.until_ms,
        };
        let r = client.get_install_log(req).await?.into_inner();
        Ok((r.events, r.dropped))
    }
    fn seq(e: &InstallEvent) -> u64 {
        e.seq
    }
    fn header() -> String {
        install_header()
    }
    fn line(e: &InstallEvent) -> String {
        install_line(e)
    }
    fn json(e: &InstallEvent) -> Value {
        install_json(e)
    }
}

/// `installs`: the log from `--after` on (all of it, or `--limit` events), as lines or a JSON
/// list; `--follow` then polls for new events until the sandbox ends, printing them as they
/// come (JSON: one record per line).
pub async fn installs(ctx: &mut Ctx, args: &LogArgs) -> Result<u8, String> {
    log::show::<Installs>(ctx, Range::from(args)).await
}
