//! The command line: clap's definitions of every command and flag, and the parsers of their
//! values (`K=V`, `LOCAL:/GUEST/PATH[:MODE]`, octal modes, guest paths, egress domains and
//! CIDRs, package patterns and registry names).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{ArgGroup, Args, CommandFactory, Parser, Subcommand, ValueEnum};

pub mod code;

pub use code::{CodeContextCommand, RunCodeArgs};

/// The help heading of the flags every command takes.
const GLOBAL: &str = "Global options";

const AFTER_HELP: &str = "\
Examples:
  airlock template create base
  ID=$(airlock create --label demo=cli)
  airlock exec \"$ID\" -- python3 -c 'print(6*7)'
  airlock cp hello.py \"$ID\":/tmp/hello.py
  airlock net \"$ID\" --allow-domain '*.example.com' --allow-port 443
  airlock egress \"$ID\" --follow
  airlock create --pkg-registry pypi --pkg-allow requests --max-download-mib 50
  airlock installs \"$ID\" --follow
  airlock expose \"$ID\" 8000 --ttl 600
  airlock run-code \"$ID\" cell.py --out-dir figures
  airlock --json ls
  airlock rm \"$ID\"

Exit status: `exec` and `logs` exit with the remote command's code (124 when its timeout ended
it, 128+N when signal N did); `run-code` 1 when the cell raised, 124 when its timeout ended it,
137 when the memory limit killed its kernel; 2 for a usage error; 1 for any other failure, with the daemon's
reason code (SANDBOX_NOT_FOUND, PATH_NOT_ALLOWED, ...) on stderr.";

/// `airlock`: the command-line client of `airlockd`, the microVM sandbox service.
#[derive(Debug, Parser)]
#[command(
    name = "airlock",
    version,
    about = "The command-line client of airlockd, the microVM sandbox service",
    after_help = AFTER_HELP,
    arg_required_else_help = true
)]
pub struct Cli {
    /// Print one JSON value per command (for scripts) instead of text
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub json: bool,

    /// The daemon: unix:///PATH or http://HOST:PORT [default: unix:///run/airlock/airlockd.sock]
    #[arg(
        long,
        global = true,
        env = "AIRLOCK_ADDR",
        hide_env_values = true,
        value_name = "ADDR",
        help_heading = GLOBAL
    )]
    pub addr: Option<String>,

    /// The tenant token, sent as `authorization: Bearer TOKEN` (none: the Unix socket's default
    /// tenant)
    #[arg(
        long,
        global = true,
        env = "AIRLOCK_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN",
        help_heading = GLOBAL
    )]
    pub token: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

/// The checks clap cannot express, as usage errors of the command concerned (exit code 2):
/// `net` needs a policy, `--deny-all` included.
pub fn check(cli: &Cli) -> Result<(), clap::Error> {
    if let Command::Net(a) = &cli.command
        && let Err(msg) = a.check()
    {
        let mut cmd = Cli::command();
        cmd.build();
        let err = match cmd.find_subcommand_mut("net") {
            Some(net) => net.error(ErrorKind::MissingRequiredArgument, msg),
            None => cmd.error(ErrorKind::MissingRequiredArgument, msg),
        };
        return Err(err);
    }
    Ok(())
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Make, list and delete templates (snapshotted VMs that sandboxes start from)
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Start a sandbox from a template and print its id (--json: its record)
    Create(Box<CreateArgs>),
    /// List your sandboxes (--json: a list of records)
    Ls(LsArgs),
    /// Show one sandbox's record
    Get(IdArg),
    /// Run a command in a sandbox: streams its output live and exits with its exit code
    #[command(override_usage = EXEC_USAGE)]
    Exec(Box<ExecArgs>),
    /// Stream an execution's output (stored or live) and exit with its exit code
    Logs(LogsArgs),
    /// Send a signal to an execution's whole process tree
    Kill(KillArgs),
    /// Copy a file into a sandbox (cp LOCAL ID:PATH) or out of it (cp ID:PATH LOCAL)
    Cp(CpArgs),
    /// List, describe, make, remove and rename files in a sandbox (paths as ID:/PATH)
    #[command(subcommand)]
    Fs(FsCommand),
    /// Pause a sandbox: stop its vCPUs, keep its memory and processes
    Pause(IdArg),
    /// Resume a paused sandbox where it stopped
    Resume(IdArg),
    /// Snapshot a running or paused sandbox into a new template
    Snapshot(SnapshotArgs),
    /// Destroy a sandbox and free what it held (idempotent)
    Rm(IdArg),
    /// Replace a running or paused sandbox's egress policy and show its record
    Net(NetArgs),
    /// Show a sandbox's egress log: its DNS queries and connection attempts, allowed or not
    Egress(LogArgs),
    /// Show a sandbox's install log: the package files (and refused index pages) its pip or
    /// npm asked the daemon's package proxy for, with the outcome
    Installs(LogArgs),
    /// Your tenant's audit trail: what its sandboxes did, hash-chained (`audit verify` checks
    /// it; `audit export` writes it as JSON lines)
    Audit(AuditArgs),
    /// Expose a guest TCP port on a host address, for callers presenting a token; prints the
    /// address, the token and the expiry (--json: the record)
    Expose(ExposeArgs),
    /// Make, list and delete volumes (file systems that outlive sandboxes)
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// What your tenant holds (sandboxes, memory, templates, stored output) against its quota
    Usage,
    /// The daemon's nodes (cluster mode: every node of the cluster), their load, capacity and
    /// templates
    Nodes,
    /// Run a cell of code in the sandbox's stateful interpreter (a code-interpreter template):
    /// streams its output, prints text results, saves images to files
    #[command(after_help = code::RUN_CODE_AFTER_HELP)]
    RunCode(Box<RunCodeArgs>),
    /// Make, list, restart and remove the interpreter's contexts (each its own kernel and
    /// variables)
    #[command(subcommand)]
    CodeContext(CodeContextCommand),
    /// Print the completion script of a shell (airlock completions bash > FILE)
    Completions(CompletionsArgs),
}

const EXEC_USAGE: &str = "\
airlock exec [OPTIONS] ID -- CMD [ARGS]...
       airlock exec [OPTIONS] ID --shell SCRIPT
       airlock exec [OPTIONS] ID --code SOURCE [--language python|sh]";

/// `template ...`.
#[derive(Debug, Subcommand)]
pub enum TemplateCommand {
    /// Build a template: boot, warm up and snapshot a VM (progress on stderr); prints its name
    /// and id (--json: its record)
    Create(TemplateCreateArgs),
    /// Build a template from a Dockerfile and a context directory (progress and RUN output on
    /// stderr); prints its name
    Build(Box<TemplateBuildArgs>),
    /// List the templates you can use, every version: yours and the shared ones (--json: a
    /// list of records)
    Ls,
    /// Delete one version of your templates: NAME:TAG, or NAME for its `latest` (refused while
    /// live sandboxes run from it)
    Rm(TemplateRmArgs),
    /// Print the log of a template's build
    Log(TemplateRmArgs),
    /// Print what a template is made of (its packages, kernel and agent) as an SBOM: CycloneDX
    /// or SPDX JSON (--packages: one `ECOSYSTEM NAME VERSION` line each)
    Sbom(TemplateSbomArgs),
    /// Build a template again the way it was made (its recipe), on the base image, kernel and
    /// image tags of now, as a new version; its tag moves to the new version unless --tag
    Rebuild(TemplateRebuildArgs),
}

/// `template sbom`.
#[derive(Debug, Args)]
pub struct TemplateSbomArgs {
    /// The template: NAME or NAME:TAG
    pub name: String,
    /// The document's format
    #[arg(long, value_name = "FORMAT", default_value = "cyclonedx", value_parser = ["cyclonedx", "spdx"])]
    pub format: String,
    /// Print the packages as lines instead of the document
    #[arg(long)]
    pub packages: bool,
}

/// `template rebuild`.
#[derive(Debug, Args)]
pub struct TemplateRebuildArgs {
    /// The version to rebuild: NAME or NAME:TAG
    pub name: String,
    /// The new version's tag [default: the old version's, which moves to the new one; the
    /// old version stays, tagged with its id]
    #[arg(long, value_name = "TAG")]
    pub tag: Option<String>,
    /// The registry account for its image (its password from $AIRLOCK_REGISTRY_PASSWORD)
    #[arg(long, value_name = "USER")]
    pub registry_user: Option<String>,
}

/// `template create`.
#[derive(Debug, Args)]
pub struct TemplateCreateArgs {
    /// Name of the template, NAME or NAME:TAG (NAME [a-z0-9][a-z0-9._-]{0,62}; no tag:
    /// `latest`)
    pub name: String,
    /// If NAME:TAG exists, the new version takes its tag (the old one stays, tagged with its
    /// id, for the sandboxes that run from it)
    #[arg(long)]
    pub replace: bool,
    /// vCPUs of its sandboxes [daemon's default: 1]
    #[arg(long, value_name = "N")]
    pub vcpus: Option<u32>,
    /// Guest memory of its sandboxes in MiB [daemon's default: 256]
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<u32>,
    /// An OCI image to import from its registry (as `docker pull` takes it:
    /// [REGISTRY/]REPO[:TAG|@sha256:DIGEST]); its Env, WorkingDir and User become the
    /// defaults of every execution
    #[arg(long, value_name = "REF", conflicts_with_all = ["from", "kernel", "rootfs"])]
    pub image: Option<String>,
    /// The registry account for --image (its password from $AIRLOCK_REGISTRY_PASSWORD, or
    /// stdin with --registry-password-stdin) [default: anonymous]
    #[arg(long, value_name = "USER", requires = "image")]
    pub registry_user: Option<String>,
    /// Read the registry password for --registry-user from stdin
    #[arg(long, requires = "registry_user")]
    pub registry_password_stdin: bool,
    /// An image the operator registered (kernel and root filesystem) [default: default]
    #[arg(long, value_name = "NAME")]
    pub from: Option<String>,
    /// Guest kernel (vmlinux) on the daemon's host, for operators [default: the image's]
    #[arg(long, value_name = "PATH")]
    pub kernel: Option<String>,
    /// Root filesystem image (ext4) on the daemon's host, for operators [default: the image's]
    #[arg(long, value_name = "PATH")]
    pub rootfs: Option<String>,
    /// A /bin/sh command run in the guest before the snapshot, to warm the page cache
    /// [default: the daemon's, which loads Python]
    #[arg(long, value_name = "SHELL COMMAND", conflicts_with = "no_warmup")]
    pub warmup: Option<String>,
    /// Snapshot as soon as the guest agent is ready, without a warm-up
    #[arg(long)]
    pub no_warmup: bool,
}

/// `template build`.
#[derive(Debug, Args)]
pub struct TemplateBuildArgs {
    /// Name of the template, NAME or NAME:TAG (no tag: `latest`)
    pub name: String,
    /// If NAME:TAG exists, the new version takes its tag (as `template create --replace`)
    #[arg(long)]
    pub replace: bool,
    /// The build context: a directory whose files COPY and ADD name (at most 3 MiB)
    #[arg(default_value = ".")]
    pub context: std::path::PathBuf,
    /// The Dockerfile [default: CONTEXT/Dockerfile]
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub dockerfile: Option<std::path::PathBuf>,
    /// A value for an ARG (repeatable)
    #[arg(long = "build-arg", value_name = "K=V", value_parser = parse_kv)]
    pub build_args: Vec<(String, String)>,
    /// A command started before the snapshot and left running (a server)
    #[arg(long, value_name = "SHELL COMMAND")]
    pub start: Option<String>,
    /// Wait before the snapshot until this command exits 0
    #[arg(long, value_name = "SHELL COMMAND", conflicts_with = "ready_url")]
    pub ready_command: Option<String>,
    /// Wait before the snapshot until this URL answers 2xx inside the guest
    #[arg(long, value_name = "URL")]
    pub ready_url: Option<String>,
    /// How long the ready check may take [default: 60]
    #[arg(long, value_name = "SECS")]
    pub ready_timeout: Option<u32>,
    /// Run every step, using no cached one
    #[arg(long)]
    pub no_cache: bool,
    /// The registry account for FROM's image (its password from $AIRLOCK_REGISTRY_PASSWORD)
    #[arg(long, value_name = "USER")]
    pub registry_user: Option<String>,
    /// What RUN steps may reach over the network [default: nothing, deny-all]
    #[command(flatten)]
    pub network: NetworkArgs,
    /// What RUN steps may install through the daemon's package proxy [default: what the
    /// tenant's ceiling allows]
    #[command(flatten)]
    pub packages: PackageArgs,
}

/// `template rm` and `template log`.
#[derive(Debug, Args)]
pub struct TemplateRmArgs {
    /// The template: NAME or NAME:TAG
    pub name: String,
}

/// `volume ...`.
#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Make a volume: an ext4 file system that outlives sandboxes, restarts and reboots;
    /// prints its name (--json: its record)
    Create(VolumeCreateArgs),
    /// List your volumes and who has them mounted (--json: a list of records)
    Ls,
    /// Delete a volume and free its space (refused while a sandbox has it mounted)
    Rm(VolumeRmArgs),
}

/// `volume create`.
#[derive(Debug, Args)]
pub struct VolumeCreateArgs {
    /// Name of the volume: [a-z0-9][a-z0-9_-]{0,62}
    pub name: String,
    /// Its size in MiB (16 or more)
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    pub size_mib: u32,
}

/// `volume rm`.
#[derive(Debug, Args)]
pub struct VolumeRmArgs {
    /// The volume's name
    pub name: String,
}

/// `--volume NAME:/GUEST/PATH[:ro]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpec {
    pub name: String,
    pub path: String,
    pub read_only: bool,
}

/// `NAME:/GUEST/PATH` or `NAME:/GUEST/PATH:ro`.
pub fn parse_volume_spec(s: &str) -> Result<VolumeSpec, String> {
    let bad = || format!("{s:?}: expected NAME:/GUEST/PATH[:ro]");
    let (name, rest) = s.split_once(":/").ok_or_else(bad)?;
    if name.is_empty() {
        return Err(bad());
    }
    let path = format!("/{rest}");
    let (path, read_only) = match path.strip_suffix(":ro") {
        Some(p) => (p.to_owned(), true),
        None => (path, false),
    };
    Ok(VolumeSpec {
        name: name.to_owned(),
        path: parse_guest_path(&path)?,
        read_only,
    })
}

/// `create`: every field of `CreateSandboxRequest`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Template to start from [default: base]
    #[arg(long, value_name = "NAME")]
    pub template: Option<String>,
    /// vCPUs: the template's value (a snapshot's shape is fixed; another value is refused)
    #[arg(long, value_name = "N")]
    pub vcpus: Option<u32>,
    /// Guest memory in MiB: the template's value (as for --vcpus)
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<u32>,
    /// Writable space of the sandbox's root (/tmp included) in MiB [default: the daemon's]
    #[arg(long, value_name = "MIB")]
    pub disk_mib: Option<u32>,
    /// Mount one of your volumes, read-only with `:ro` (repeatable)
    #[arg(long = "volume", value_name = "NAME:/PATH[:ro]", value_parser = parse_volume_spec)]
    pub volumes: Vec<VolumeSpec>,
    /// An environment variable of every execution in the sandbox (repeatable)
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// A label to find the sandbox by (repeatable; see `ls --label`)
    #[arg(long = "label", value_name = "K=V", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Destroy the sandbox after this many seconds without calls [default: the daemon's]
    #[arg(long, value_name = "SECS")]
    pub idle_ttl: Option<u32>,
    /// Destroy the sandbox this many seconds after creation at the latest [default: the
    /// daemon's]
    #[arg(long, visible_alias = "max-lifetime", value_name = "SECS")]
    pub lifetime: Option<u32>,
    /// Upload a local file before the sandbox is ready, with octal permission bits (default
    /// 644); the guest path must be under a writable prefix; about 4 MiB in all, `cp` for
    /// larger files (repeatable)
    #[arg(
        long = "file",
        value_name = "LOCAL:/GUEST/PATH[:MODE]",
        value_parser = parse_file_spec
    )]
    pub files: Vec<FileSpec>,
    /// A guest path prefix that `cp` and --file may write under (repeatable) [default: the
    /// daemon's, /tmp]
    #[arg(long, value_name = "PREFIX", value_parser = parse_guest_path)]
    pub writable: Vec<String>,
    /// A guest path prefix that `cp` may read under (repeatable) [default: the daemon's, /tmp]
    #[arg(long, value_name = "PREFIX", value_parser = parse_guest_path)]
    pub exportable: Vec<String>,
    /// The largest file `cp` may take out of the sandbox [default and ceiling: the daemon's]
    #[arg(long, value_name = "BYTES")]
    pub export_max_file_bytes: Option<u64>,
    /// The bytes `cp` may take out of the sandbox in all [default and ceiling: the daemon's]
    #[arg(long, value_name = "BYTES")]
    pub export_max_total_bytes: Option<u64>,
    /// A path pattern `cp` may not take out, besides the daemon's ('*.sqlite'; one with '/'
    /// matches the whole path) (repeatable)
    #[arg(long = "export-deny", value_name = "PATTERN")]
    pub export_deny: Vec<String>,
    /// What the sandbox may reach over its network [default: nothing, deny-all]
    #[command(flatten)]
    pub network: NetworkArgs,
    /// What the sandbox may install through the daemon's package proxy [default: what the
    /// tenant's ceiling allows]
    #[command(flatten)]
    pub packages: PackageArgs,
    /// A secret for every execution, as the environment variable NAME; its value is this
    /// program's own $NAME (never a command-line argument, which `ps` shows). Redacted from
    /// all output as [REDACTED:NAME] (repeatable)
    #[arg(long = "secret", value_name = "NAME")]
    pub secrets: Vec<String>,
    /// A secret as a file in the guest, /run/secrets/NAME, readable by the default account
    /// only; its value is this program's $NAME (repeatable)
    #[arg(long = "secret-file", value_name = "NAME")]
    pub secret_files: Vec<String>,
    /// A brokered secret: never in the guest; the egress proxy adds it to the sandbox's HTTP
    /// requests to HOST (exact, or '*.example.com'; the egress policy must allow it) as
    /// 'Authorization: Bearer VALUE'; its value is this program's $NAME (repeatable)
    #[arg(long = "secret-broker", value_name = "NAME=HOST[,HOST...]")]
    pub secret_brokers: Vec<String>,
    /// The brokered secrets' header [default: Authorization]
    #[arg(long, value_name = "HEADER")]
    pub broker_header: Option<String>,
    /// The brokered secrets' header value, '{value}' standing for the secret [default:
    /// 'Bearer {value}']
    #[arg(long, value_name = "FORMAT")]
    pub broker_format: Option<String>,
    /// Broker over HTTPS too: the proxy terminates the guest's TLS to those hosts with a
    /// certificate of the sandbox's own CA (which the guest trusts) and sees the requests
    #[arg(long)]
    pub broker_https: bool,
    /// Seconds the secrets live (then they are removed from the sandbox) [default: as long as
    /// the sandbox]
    #[arg(long, value_name = "S")]
    pub secret_ttl: Option<u32>,
    /// Keep root out of reach: `exec --user root` and file calls as root are refused, and
    /// `sudo` in the sandbox gives nothing [default: root allowed, passwordless sudo for the
    /// default account]
    #[arg(long)]
    pub no_root: bool,
}

/// The package policy flags of `create` (`PackagePolicy`).
#[derive(Debug, Args)]
pub struct PackageArgs {
    /// Install only from this registry, by the operator's name ('pypi', 'npm', a mirror's)
    /// (repeatable) [default: every registry the tenant's ceiling allows]
    #[arg(
        long = "pkg-registry",
        value_name = "NAME",
        value_parser = parse_registry,
        help_heading = PACKAGES
    )]
    pub pkg_registries: Vec<String>,
    /// Install only packages matching this pattern ('requests', 'types-*', '@acme/*')
    /// (repeatable) [default: any package]
    #[arg(
        long = "pkg-allow",
        value_name = "PATTERN",
        value_parser = parse_pkg_pattern,
        help_heading = PACKAGES
    )]
    pub pkg_allow: Vec<String>,
    /// Never install packages matching this pattern; wins over --pkg-allow (repeatable)
    #[arg(
        long = "pkg-deny",
        value_name = "PATTERN",
        value_parser = parse_pkg_pattern,
        help_heading = PACKAGES
    )]
    pub pkg_deny: Vec<String>,
    /// No installs at all: every index page and package file is refused
    #[arg(
        long,
        conflicts_with_all = ["pkg_registries", "pkg_allow", "pkg_deny", "max_download_mib"],
        help_heading = PACKAGES
    )]
    pub offline: bool,
    /// The MiB of package files the sandbox may download in all, cached ones included
    /// [default and ceiling: the tenant's cap]
    #[arg(
        long,
        value_name = "N",
        value_parser = clap::value_parser!(u64).range(1..=u64::MAX >> 20),
        help_heading = PACKAGES
    )]
    pub max_download_mib: Option<u64>,
}

impl PackageArgs {
    /// Whether any package flag is given.
    pub fn any(&self) -> bool {
        self.offline
            || !self.pkg_registries.is_empty()
            || !self.pkg_allow.is_empty()
            || !self.pkg_deny.is_empty()
            || self.max_download_mib.is_some()
    }
}

/// The help heading of the package policy flags.
const PACKAGES: &str = "Packages";

/// The egress policy flags of `create` and `net` (`NetworkPolicy`).
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("allow_rule").multiple(true).args(["allow_domains", "allow_cidrs"])))]
pub struct NetworkArgs {
    /// Let the sandbox reach this host name, or every name below one ('*.example.com')
    /// (repeatable)
    #[arg(
        long = "allow-domain",
        value_name = "NAME",
        value_parser = parse_domain,
        help_heading = NETWORK
    )]
    pub allow_domains: Vec<String>,
    /// Let the sandbox reach this address range ('203.0.113.0/24'; an address alone is one
    /// host); private and other internal ranges open only this way (repeatable)
    #[arg(
        long = "allow-cidr",
        value_name = "CIDR",
        value_parser = parse_cidr,
        help_heading = NETWORK
    )]
    pub allow_cidrs: Vec<String>,
    /// Only this destination port for every --allow-domain and --allow-cidr given (repeatable)
    /// [default: every port]
    #[arg(
        long = "allow-port",
        value_name = "PORT",
        value_parser = clap::value_parser!(u16).range(1..),
        requires = "allow_rule",
        help_heading = NETWORK
    )]
    pub allow_ports: Vec<u16>,
    /// Let the sandbox reach every public address on every port (internal ranges stay closed)
    #[arg(
        long,
        conflicts_with_all = ["allow_domains", "allow_cidrs", "allow_ports"],
        help_heading = NETWORK
    )]
    pub allow_internet: bool,
}

impl NetworkArgs {
    /// Whether any allow flag is given.
    pub fn allows_anything(&self) -> bool {
        self.allow_internet || !self.allow_domains.is_empty() || !self.allow_cidrs.is_empty()
    }
}

/// The help heading of the egress policy flags.
const NETWORK: &str = "Network (egress) policy";

/// `net`: `SetNetworkPolicyRequest`.
#[derive(Debug, Args)]
#[command(after_help = "\
The new policy replaces the old one as a whole: new connections and DNS queries follow it at
once (open connections are not cut). With no --allow-* flag, pass --deny-all to say that the
sandbox is to reach nothing.")]
pub struct NetArgs {
    /// The sandbox's id
    pub id: String,
    #[command(flatten)]
    pub network: NetworkArgs,
    /// Cut the sandbox off the network: allow nothing (needed when no --allow-* flag is given)
    #[arg(
        long,
        conflicts_with_all = ["allow_domains", "allow_cidrs", "allow_ports", "allow_internet"],
        help_heading = NETWORK
    )]
    pub deny_all: bool,
}

impl NetArgs {
    /// The message of a `net` that names no policy: an empty policy cuts the sandbox off, so
    /// that must be asked for in so many words.
    pub fn check(&self) -> Result<(), String> {
        if self.deny_all || self.network.allows_anything() {
            return Ok(());
        }
        Err(
            "no policy given: name what the sandbox may reach (--allow-domain NAME, \
             --allow-cidr CIDR, --allow-internet), or pass --deny-all to cut it off the network"
                .into(),
        )
    }
}

/// `egress`, `installs`: a sandbox's log (`GetEgressLogRequest`, `GetInstallLogRequest`),
/// paged.
#[derive(Debug, Args)]
pub struct LogArgs {
    /// The sandbox's id
    pub id: String,
    /// Only events after this sequence number (the first column) [default: 0, from the first]
    #[arg(
        long,
        value_name = "SEQ",
        default_value_t = 0,
        hide_default_value = true
    )]
    pub after: u64,
    /// At most this many events [default: all]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "follow")]
    pub limit: Option<u32>,
    /// Keep polling every second for new events until the sandbox ends (or Ctrl-C); --json
    /// then prints one record per line
    #[arg(long, short)]
    pub follow: bool,
    #[command(flatten)]
    pub filter: EventFilter,
}

/// Which events of a log to show, as every log (egress, installs, audit) is queried.
#[derive(Clone, Debug, Default, Args)]
pub struct EventFilter {
    /// Only events of this kind (repeatable): egress dns, tcp or expose; installs their
    /// outcome (cached, fetched, denied, hash_mismatch, over_cap, upstream_error,
    /// bad_signature); audit sandbox.create, exec.start, denial, ...
    #[arg(long = "kind", value_name = "KIND")]
    pub kinds: Vec<String>,
    /// Only events at or after this time: Unix seconds, or an age such as 90s, 10m, 2h, 7d
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub since: Option<When>,
    /// Only events before this time (as --since)
    #[arg(long, value_name = "WHEN", value_parser = parse_when)]
    pub until: Option<When>,
}

/// A point in time as the filters take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Unix time in seconds.
    At(i64),
    /// This many seconds before now.
    Ago(u64),
}

impl When {
    /// Unix time in milliseconds, `now_ms` being now.
    pub fn unix_ms(self, now_ms: i64) -> i64 {
        match self {
            When::At(s) => s.saturating_mul(1000),
            When::Ago(s) => {
                now_ms.saturating_sub(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX))
            }
        }
    }
}

/// `1733560000` (Unix seconds) or an age: a number with `s`, `m`, `h` or `d`.
pub fn parse_when(s: &str) -> Result<When, String> {
    let bad = || format!("{s:?}: expected Unix seconds or an age such as 90s, 10m, 2h, 7d");
    let unit = match s.chars().last() {
        Some('s') => 1,
        Some('m') => 60,
        Some('h') => 3600,
        Some('d') => 86_400,
        _ => {
            return s
                .parse::<i64>()
                .ok()
                .filter(|n| *n > 0)
                .map(When::At)
                .ok_or_else(bad);
        }
    };
    let n: u64 = s[..s.len() - 1].parse().map_err(|_| bad())?;
    n.checked_mul(unit).map(When::Ago).ok_or_else(bad)
}

/// `audit`: `ListAuditEventsRequest`, every page.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// list (default), verify (check the chain: every event's hash, no gaps, the head; exit
    /// code 1 with the problems), export (every field, one JSON object per line)
    #[arg(value_parser = ["list", "verify", "export"], default_value = "list")]
    pub action: String,
    /// verify: check this export (JSON lines) instead of the daemon's trail
    #[arg(long, value_name = "FILE")]
    pub file: Option<std::path::PathBuf>,
    /// Only events after this sequence number [default: from the first kept]
    #[arg(
        long,
        value_name = "SEQ",
        default_value_t = 0,
        hide_default_value = true
    )]
    pub after: u64,
    /// Only this sandbox's events
    #[arg(long, value_name = "ID")]
    pub sandbox: Option<String>,
    #[command(flatten)]
    pub filter: EventFilter,
}

/// `expose`: `ExposePortRequest`.
#[derive(Debug, Args)]
#[command(after_help = "\
Callers of the address present the token at the start of each connection: raw TCP sends the
token and a newline first; HTTP/1 sends the header `X-Airlock-Token: TOKEN` in the first
request (curl -H \"X-Airlock-Token: $TOKEN\" http://ADDRESS/). Without it the connection is
closed. The exposure ends after its TTL or with the sandbox.")]
pub struct ExposeArgs {
    /// The sandbox's id (running)
    pub id: String,
    /// The guest's TCP port
    #[arg(value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Seconds until the exposure ends [default: the daemon's; capped by its maximum]
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u32).range(1..))]
    pub ttl: Option<u32>,
}

/// `ls`: the filters of `ListSandboxesRequest`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only sandboxes with this label (repeatable: all must match)
    #[arg(long = "label", value_name = "K=V", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Only sandboxes in this state (repeatable) [default: starting, running and paused]
    #[arg(long = "state", value_enum, value_name = "STATE")]
    pub states: Vec<StateArg>,
}

/// A sandbox state, for `ls --state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    // Restoring, not answered yet
    Starting,
    // Running
    Running,
    // Paused
    Paused,
    // Its VMM ended on its own
    Dead,
    // Destroyed by a call, its idle TTL or its lifetime
    Destroyed,
}

/// `exec`: every field of `ExecRequest`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("what").required(true).args(["argv", "shell", "code"])))]
pub struct ExecArgs {
    /// The sandbox's id
    pub id: String,
    /// Wall-clock limit in seconds, enforced by the daemon (airlock then exits 124) [default:
    /// the daemon's]
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Working directory [default: the home of --user]
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// The guest account to run as: 'root' for root [default: user, unprivileged]
    #[arg(long, short, value_name = "NAME")]
    pub user: Option<String>,
    /// An environment variable, over the sandbox's (repeatable)
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Memory limit of this execution in MiB (beyond it: OOM_KILLED; the sandbox lives on)
    #[arg(long, value_name = "MIB")]
    pub memory_mib: Option<u32>,
    /// Feed this file to the command's stdin ('-': airlock's own stdin) [default: empty]
    #[arg(long, value_name = "FILE")]
    pub stdin: Option<PathBuf>,
    /// Run this /bin/sh script instead of a command
    #[arg(long, value_name = "SCRIPT")]
    pub shell: Option<String>,
    /// Run this source code with an interpreter (see --language) instead of a command
    #[arg(long, value_name = "SOURCE")]
    pub code: Option<String>,
    /// The interpreter of --code [default: python]
    // (`requires = "code"` would not fire: clap lets a conflicting member of the group stand in)
    #[arg(long, value_enum, conflicts_with_all = ["argv", "shell"], value_name = "LANGUAGE")]
    pub language: Option<Language>,
    /// The command and its arguments (after `--`); CMD is looked up in the guest's PATH
    #[arg(
        value_name = "CMD",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub argv: Vec<String>,
}

/// The interpreter of `exec --code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Language {
    // python3
    Python,
    // /bin/sh
    Sh,
}

impl Language {
    /// The name the API uses.
    pub fn api_name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Sh => "sh",
        }
    }
}

/// `logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The execution's id (`airlock --json exec` prints it on stderr)
    pub execution_id: String,
    /// Start stdout at this byte offset [default: 0, everything]
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 0,
        hide_default_value = true
    )]
    pub stdout_offset: u64,
    /// Start stderr at this byte offset [default: 0, everything]
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = 0,
        hide_default_value = true
    )]
    pub stderr_offset: u64,
}

/// `kill`.
#[derive(Debug, Args)]
pub struct KillArgs {
    /// The execution's id
    pub execution_id: String,
    /// The signal's number [default: 9, SIGKILL]
    #[arg(long, short, value_name = "N")]
    pub signal: Option<i32>,
}

/// `cp`.
#[derive(Debug, Args)]
#[command(override_usage = "airlock cp [OPTIONS] LOCAL ID:/PATH\n       airlock cp ID:/PATH LOCAL")]
pub struct CpArgs {
    /// The source: a local file, or ID:/PATH in a sandbox (under an exportable prefix)
    pub from: String,
    /// The destination: ID:/PATH in a sandbox (under a writable prefix), or a local file
    pub to: String,
    /// Octal permission bits of an uploaded file [default: 644]
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    pub mode: Option<u32>,
    /// The guest account that writes (and owns) or reads the file: 'root' for root [default:
    /// user]
    #[arg(long, short, value_name = "NAME")]
    pub user: Option<String>,
}

/// `fs ...`: file calls on ID:/PATH (listing and stat need an exportable prefix, the rest a
/// writable one).
#[derive(Debug, Subcommand)]
pub enum FsCommand {
    /// List a directory (--json: a list of entries)
    Ls(FsLsArgs),
    /// Describe a path (a symlink itself)
    Stat(FsPathArgs),
    /// Make a directory
    Mkdir(FsMkdirArgs),
    /// Remove a file, a symlink or a directory
    Rm(FsRmArgs),
    /// Rename (move) ID:/FROM to /TO in the same sandbox
    Mv(FsMvArgs),
}

/// A path in a sandbox and the account that acts on it.
#[derive(Debug, Args)]
pub struct FsPathArgs {
    /// ID:/PATH
    pub target: String,
    /// The guest account that acts: 'root' for root [default: user]
    #[arg(long, short, value_name = "NAME")]
    pub user: Option<String>,
}

/// `fs ls`.
#[derive(Debug, Args)]
pub struct FsLsArgs {
    #[command(flatten)]
    pub path: FsPathArgs,
    /// Subdirectories too (entries named by their path below the directory)
    #[arg(long, short)]
    pub recursive: bool,
    /// At most this many entries [default: 10000]
    #[arg(long, value_name = "N")]
    pub max: Option<u32>,
}

/// `fs mkdir`.
#[derive(Debug, Args)]
pub struct FsMkdirArgs {
    #[command(flatten)]
    pub path: FsPathArgs,
    /// Make parents too; an existing directory is fine
    #[arg(long, short)]
    pub parents: bool,
}

/// `fs rm`.
#[derive(Debug, Args)]
pub struct FsRmArgs {
    #[command(flatten)]
    pub path: FsPathArgs,
    /// A non-empty directory too
    #[arg(long, short)]
    pub recursive: bool,
}

/// `fs mv`.
#[derive(Debug, Args)]
pub struct FsMvArgs {
    #[command(flatten)]
    pub path: FsPathArgs,
    /// The new path in the same sandbox
    #[arg(value_parser = parse_guest_path)]
    pub to: String,
}

/// A command that takes a sandbox's id.
#[derive(Debug, Args)]
pub struct IdArg {
    /// The sandbox's id
    pub id: String,
}

/// `snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The sandbox's id
    pub id: String,
    /// Name of the new template
    pub template: String,
    /// Share it with every tenant (the default tenant, the operator, only): a snapshot holds
    /// what ran in the sandbox
    #[arg(long)]
    pub shared: bool,
}

/// `completions`.
#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// A file `create --file` uploads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSpec {
    /// Here.
    pub local: PathBuf,
    /// In the guest (absolute).
    pub guest: String,
    /// Permission bits (0: the daemon's 0644).
    pub mode: u32,
}

/// `K=V` (V may hold `=`; K may not be empty).
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?}: expected K=V")),
    }
}

/// Octal permission bits, `644` or `0755`.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let bad = || format!("{s:?}: expected octal permission bits such as 644 or 0755");
    if s.is_empty() || !s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return Err(bad());
    }
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(bad)
}

/// An absolute path in the guest.
pub fn parse_guest_path(s: &str) -> Result<String, String> {
    if s.starts_with('/') {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?}: expected an absolute guest path (/...)"))
    }
}

/// `LOCAL:/GUEST/PATH` or `LOCAL:/GUEST/PATH:MODE`: the guest path starts at the first `:/`
/// (so LOCAL may not hold `:/`); a last `:` followed only by digits gives the mode, in octal.
pub fn parse_file_spec(s: &str) -> Result<FileSpec, String> {
    let bad = || format!("{s:?}: expected LOCAL:/GUEST/PATH[:MODE]");
    let (local, rest) = s.split_once(":/").ok_or_else(bad)?;
    if local.is_empty() {
        return Err(bad());
    }
    let guest = format!("/{rest}");
    let (guest, mode) = match guest.rsplit_once(':') {
        Some((path, m))
            if path.len() > 1 && !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()) =>
        {
            (path.to_owned(), parse_mode(m)?)
        }
        _ => (guest, 0),
    };
    Ok(FileSpec {
        local: PathBuf::from(local),
        guest,
        mode,
    })
}

/// An egress domain rule: a host name (`api.example.com`) or every name below one
/// (`*.example.com`); the daemon checks it further.
pub fn parse_domain(s: &str) -> Result<String, String> {
    let name = s.strip_prefix("*.").unwrap_or(s);
    let name = name.strip_suffix('.').unwrap_or(name);
    let ok = !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?}: expected a host name (api.example.com) or a wildcard (*.example.com)"
        ))
    }
}

/// An egress address range: `ADDRESS/PREFIX` or an address alone (IPv4 or IPv6).
pub fn parse_cidr(s: &str) -> Result<String, String> {
    let bad = || format!("{s:?}: expected an address range (203.0.113.0/24) or an address");
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let addr: IpAddr = addr.parse().map_err(|_| bad())?;
    if let Some(p) = prefix {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let ok = !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u8>().is_ok_and(|n| n <= max);
        if !ok {
            return Err(bad());
        }
    }
    Ok(s.to_owned())
}

/// A package pattern of `--pkg-allow` and `--pkg-deny`: a name with `*` for any run of
/// characters (`requests`, `types-*`, `@acme/*`): letters, digits, `-_.~@/` and `*`, at most
/// 214 bytes (the daemon normalises and checks it further).
pub fn parse_pkg_pattern(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 214
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'@' | b'/' | b'*')
        });
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?}: expected a package name or pattern (requests, types-*, @acme/*): letters, \
             digits, `-_.~@/` and `*`"
        ))
    }
}

/// A registry's name, as the operator configured it (`pypi`, `npm`, `pypi-mirror`): letters,
/// digits, `-` and `_`.
pub fn parse_registry(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?}: expected a registry's name (pypi, npm, a mirror's): letters, digits, - and _"
        ))
    }
}

/// `ID:/PATH`, a path in a sandbox (ids start with `sb-`): `(id, path)`.
pub fn sandbox_path(s: &str) -> Option<(&str, &str)> {
    s.split_once(':').filter(|(id, _)| id.starts_with("sb-"))
}
