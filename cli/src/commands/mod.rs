//! The commands that talk to the daemon, one module per area. Each returns the exit code of
//! `airlock`, or the message of a failure (printed as `airlock: MESSAGE`, exit code 1).

pub mod audit;
pub mod code;
pub mod exec;
pub mod files;
pub mod fs;
mod log;
pub mod net;
pub mod nodes;
pub mod packages;
pub mod sandbox;
pub mod template;
pub mod volume;

use airlock_api::v1::airlock_client::AirlockClient;

use crate::args::Command;

/// A client of the daemon.
pub type Client = AirlockClient<airlock_api::AuthChannel>;

/// What a command needs: the client and the output mode.
#[derive(Debug)]
pub struct Ctx {
    /// Print JSON instead of text.
    pub json: bool,
    /// The daemon.
    pub client: Client,
}

/// The message of a failed call: the daemon's reason code, its message and its context.
pub fn fail(status: tonic::Status) -> String {
    match airlock_api::error_info(&status) {
        Some((reason, meta)) if !meta.is_empty() => {
            let mut m: Vec<_> = meta.into_iter().collect();
            m.sort();
            let ctx: Vec<String> = m.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{reason}: {} ({})", status.message(), ctx.join(", "))
        }
        Some((reason, _)) => format!("{reason}: {}", status.message()),
        None => format!("{:?}: {}", status.code(), status.message()),
    }
}

/// Runs a command (all but `completions`, which needs no daemon).
pub async fn run(ctx: &mut Ctx, command: Command) -> Result<u8, String> {
    match command {
        Command::Template(t) => template::run(ctx, t).await,
        Command::Create(a) => sandbox::create(ctx, &a).await,
        Command::Ls(a) => sandbox::list(ctx, &a).await,
        Command::Get(a) => sandbox::get(ctx, &a.id).await,
        Command::Exec(a) => exec::exec(ctx, &a).await,
        Command::Logs(a) => exec::logs(ctx, &a).await,
        Command::Kill(a) => exec::kill(ctx, &a).await,
        Command::Cp(a) => files::cp(ctx, &a).await,
        Command::Fs(c) => fs::run(ctx, c).await,
        Command::Pause(a) => sandbox::pause(ctx, &a.id).await,
        Command::Resume(a) => sandbox::resume(ctx, &a.id).await,
        Command::Snapshot(a) => sandbox::snapshot(ctx, &a).await,
        Command::Rm(a) => sandbox::destroy(ctx, &a.id).await,
        Command::Net(a) => net::net(ctx, &a).await,
        Command::Egress(a) => net::egress(ctx, &a).await,
        Command::Expose(a) => net::expose(ctx, &a).await,
        Command::Installs(a) => packages::installs(ctx, &a).await,
        Command::Audit(a) => audit::run(ctx, &a).await,
        Command::Volume(v) => volume::run(ctx, v).await,
        Command::Usage => sandbox::usage(ctx).await,
        Command::Nodes => nodes::list(ctx).await,
        Command::RunCode(a) => code::run_code(ctx, &a).await,
        Command::CodeContext(c) => code::context(ctx, c).await,
        Command::Completions(_) => Err("completions need no daemon".into()),
    }
}
