//! `airlock`: the command-line client of `airlockd`. It finds the daemon at its default Unix
//! socket, `$AIRLOCK_ADDR` or `--addr`, and sends `$AIRLOCK_TOKEN` (or `--token`) as the tenant
//! token if set. `airlock --help` lists the commands; `airlock COMMAND --help` their flags.
//!
//! Modules: `args` (clap's definitions), `request` (the API requests built from them),
//! `output` (JSON records and text tables), `commands` (the calls, one module per area).

mod args;
mod commands;
mod output;
mod request;
#[cfg(test)]
mod tests;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

use crate::args::{Cli, Command};
use crate::commands::Ctx;

/// Writes the completion script of `shell` for `airlock` to `out`.
fn completions(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    clap_complete::generate(shell, &mut Cli::command(), "airlock", out);
}

/// Connects to the daemon and runs the command.
async fn run(cli: Cli) -> ExitCode {
    let addr = cli
        .addr
        .filter(|a| !a.is_empty())
        .unwrap_or_else(airlock_api::default_address);
    let client = match airlock_api::client(Some(&addr), cli.token.as_deref()).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "airlock: cannot reach airlockd at {addr}: {e} (start it, or set AIRLOCK_ADDR)"
            );
            return ExitCode::from(1);
        }
    };
    let mut ctx = Ctx {
        json: cli.json,
        client,
    };
    match commands::run(&mut ctx, cli.command).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("airlock: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    // Usage errors exit 2, `--help` and `--version` 0 (clap's behaviour).
    let cli = Cli::parse();
    if let Err(e) = args::check(&cli) {
        e.exit();
    }
    if let Command::Completions(a) = &cli.command {
        completions(a.shell, &mut std::io::stdout());
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("airlock: {e}");
            return ExitCode::from(1);
        }
    };
    rt.block_on(run(cli))
}
