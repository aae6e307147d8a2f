//! The code interpreter's commands: `run-code` (a cell in a stateful kernel of the sandbox) and
//! `code-context create|ls|restart|rm` (its contexts).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::parse_kv;

/// What `run-code --help` adds after the flags.
pub const RUN_CODE_AFTER_HELP: &str = "\
Output: the cell's stdout and stderr stream as they come; each result's text (text/plain, else
text/markdown) goes to stdout; its image/png, image/jpeg, image/svg+xml and application/pdf
data are saved in --out-dir as result-N.png, result-N.jpg, result-N.svg, result-N.pdf (N: the
result's number in the cell, from 1) and their paths printed. --json prints every event as one
JSON line instead (results with their MIME bundle as the daemon sent it; nothing is saved).

Exit status: 0 when the cell ran to its end; 1 when it raised (the traceback and NAME: VALUE on
stderr) or the interpreter failed; 124 when its timeout interrupted it (the context lives on);
137 when the memory limit killed its kernel (the context restarts on its next cell); 2 for a
usage error.

Examples:
  airlock run-code \"$ID\" cell.py
  echo '1+1' | airlock run-code \"$ID\" -
  airlock run-code \"$ID\" plot.py --out-dir figures
  CTX=$(airlock code-context create \"$ID\" --language javascript)
  airlock run-code \"$ID\" cell.js --context \"$CTX\"";

/// `run-code`: every field of `RunCodeRequest`.
#[derive(Debug, Args)]
pub struct RunCodeArgs {
    /// The sandbox's id (a sandbox of a template with the interpreter, e.g. code-interpreter)
    pub id: String,
    /// The cell's source: a local file, or '-' for airlock's own stdin
    #[arg(value_name = "FILE|-")]
    pub file: PathBuf,
    /// The language, in its default context: python, javascript, typescript, bash [default:
    /// python]
    #[arg(long, short, value_name = "LANGUAGE", conflicts_with = "context")]
    pub language: Option<String>,
    /// Run in this context (from `airlock code-context create`) [default: the language's
    /// default context]
    #[arg(long, short, value_name = "CONTEXT")]
    pub context: Option<String>,
    /// An environment variable for this cell only (repeatable)
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Wall-clock limit in seconds: past it the cell is interrupted (airlock then exits 124)
    /// [default: the daemon's, 300]
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Where image and PDF results are saved [default: the current directory]
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

/// `code-context ...`.
#[derive(Debug, Subcommand)]
pub enum CodeContextCommand {
    /// Make a context (its own kernel) and print its id (--json: its record)
    Create(CodeContextCreateArgs),
    /// List a sandbox's contexts, the default ones included once used
    Ls(CodeContextIdArg),
    /// Restart a context's kernel: its variables are gone, its id stays
    Restart(CodeContextArgs),
    /// End a context and its kernel
    Rm(CodeContextArgs),
}

/// `code-context create`.
#[derive(Debug, Args)]
pub struct CodeContextCreateArgs {
    /// The sandbox's id
    pub id: String,
    /// Its language: python, javascript, typescript, bash [default: python]
    #[arg(long, short, value_name = "LANGUAGE")]
    pub language: Option<String>,
    /// Its working directory [default: /home/user]
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
}

/// `code-context ls`.
#[derive(Debug, Args)]
pub struct CodeContextIdArg {
    /// The sandbox's id
    pub id: String,
}

/// `code-context restart|rm`.
#[derive(Debug, Args)]
pub struct CodeContextArgs {
    /// The sandbox's id
    pub id: String,
    /// The context's id
    pub context: String,
}
