//! Dockerfile builds (BuildTemplate): a Dockerfile ([`crate::templates::dockerfile`]) runs in
//! a sandbox and the sandbox becomes the template.
//!
//! `FROM` is an Airlock template of the caller's (or a shared one) or an OCI image, imported as
//! a template of its own (`cache-HEX`, keyed by the manifest's digest). Every step has a key:
//! the hash of its parent's key, its text after substitution (with the environment, user and
//! working directory it runs with) and, for `COPY`/`ADD`, the paths, modes and contents of the
//! files it copies. After a step runs, the build sandbox is snapshotted into the caller's
//! template `cache-HEX` of its key, so a later build whose first N steps are the same starts a
//! sandbox from the Nth step's snapshot and runs only the rest: editing the last line re-runs
//! the last step. (A cache template counts against the tenant's template quota like any; a
//! step whose snapshot the quota refuses is simply not cached.) RUN executes as an execution
//! of the build sandbox, under the request's network and package policy, its output sent as
//! progress; COPY unpacks a tar of the context's files with the guest's own `tar` as root.
//! Then the start command is left running, the ready check passes, and the sandbox is
//! snapshotted as the template, with the Dockerfile's ENV, WORKDIR, USER, ENTRYPOINT and CMD
//! as its defaults; the build sandbox is destroyed whatever happened.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{
    Argv, BuildTemplateRequest, CreateSandboxRequest, CreateTemplateRequest, ExecRequest,
    Execution, ExecutionState, ImageDefaults, OciImage, TemplateEvent, exec_request,
    execution_event,
};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::Sender;

use crate::daemon::Daemon;
use crate::error::{ApiError, ApiResult};
use crate::templates::TemplateRt;
use crate::templates::dockerfile::{self, Dockerfile, Step};

/// The largest build context.
pub const MAX_CONTEXT_BYTES: usize = 3 << 20;
/// How long one RUN may take.
const STEP_TIMEOUT_MS: u64 = 30 * 60 * 1000;
/// The most output of one step kept for its error message.
const TAIL_BYTES: usize = 2048;

/// The build context: regular files (mode, bytes) and directories, by relative path.
#[derive(Debug, Default)]
struct Context {
    files: BTreeMap<String, (u32, Vec<u8>)>,
    dirs: BTreeSet<String>,
}

/// What one source of a COPY brings: (path relative to where it lands, context path).
type Selected = Vec<(String, String)>;

impl Context {
    /// Reads an uncompressed tar: regular files and directories only, names checked as an
    /// image layer's are.
    fn read(tar_bytes: &[u8]) -> ApiResult<Self> {
        let bad = |m: String| ApiError::InvalidArgument(format!("build context: {m}"));
        if tar_bytes.len() > MAX_CONTEXT_BYTES {
            return Err(bad(format!(
                "{} bytes, more than {MAX_CONTEXT_BYTES}",
                tar_bytes.len()
            )));
        }
        let mut ctx = Self::default();
        if tar_bytes.is_empty() {
            return Ok(ctx);
        }
        let mut archive = tar::Archive::new(tar_bytes);
        let entries = archive
            .entries()
            .map_err(|e| bad(format!("not a tar: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| bad(format!("not a tar: {e}")))?;
            let raw = entry.path_bytes().into_owned();
            let name = String::from_utf8_lossy(&raw).into_owned();
            let parts = crate::oci::tree::split(&raw).map_err(|e| bad(format!("{name:?}: {e}")))?;
            let path = parts
                .iter()
                .map(|c| String::from_utf8_lossy(c).into_owned())
                .collect::<Vec<_>>()
                .join("/");
            let ty = entry.header().entry_type();
            let mode = entry.header().mode().unwrap_or(0o644) & 0o7777;
            if ty.is_dir() {
                if !path.is_empty() {
                    ctx.dirs.insert(path);
                }
            } else if ty.is_file() {
                let mut data = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut data)
                    .map_err(|e| bad(format!("{name:?}: {e}")))?;
                ctx.files.insert(path, (mode, data));
            } else if ty.is_pax_global_extensions() || ty.is_pax_local_extensions() {
                continue;
            } else {
                return Err(bad(format!(
                    "{name:?}: only regular files and directories (not links or devices)"
                )));
            }
        }
        Ok(ctx)
    }

    /// The files of source `s`: itself if it is a file, else everything under it (`.`: the
    /// whole context), with their paths relative to it.
    fn select(&self, s: &str) -> Option<(bool, Selected)> {
        let parts = crate::oci::tree::split(if s.is_empty() { "." } else { s }.as_bytes()).ok()?;
        let p = parts
            .iter()
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect::<Vec<_>>()
            .join("/");
        if self.files.contains_key(&p) {
            let base = p.rsplit('/').next().unwrap_or(&p).to_owned();
            return Some((false, vec![(base, p)]));
        }
        let prefix = if p.is_empty() {
            String::new()
        } else {
            format!("{p}/")
        };
        let under: Selected = self
            .files
            .keys()
            .filter_map(|f| f.strip_prefix(&prefix).map(|r| (r.to_owned(), f.clone())))
            .collect();
        let is_dir = p.is_empty() || self.dirs.contains(&p) || !under.is_empty();
        is_dir.then_some((true, under))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The name of the cache template of a step key.
fn cache_name(key: &str) -> String {
    format!("cache-{}", &key[..16])
}

/// A step's key: its parent's, its text and what it runs with, the files it copies.
fn step_key(parent: &str, text: &str, step: &Step, ctx: &Context) -> String {
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    h.update(b"\n");
    h.update(text.as_bytes());
    h.update(format!("\n{step:?}\n").as_bytes());
    if let Step::Copy { sources, .. } = step {
        for s in sources {
            for (_, path) in ctx.select(s).map(|(_, f)| f).unwrap_or_default() {
                let (mode, data) = &ctx.files[&path];
                h.update(format!("{path}\0{mode:o}\0").as_bytes());
                h.update(Sha256::digest(data));
            }
        }
    }
    hex(&h.finalize())
}

/// One build's state.
struct Build<'a> {
    d: &'a Arc<Daemon>,
    tenant: &'a str,
    /// Who the build's templates belong to (see [`build`]).
    owner: String,
    tx: Sender<TemplateEvent>,
    started: Instant,
}

impl Build<'_> {
    async fn send(&self, phase: &str, message: String) {
        let ev = TemplateEvent {
            phase: phase.into(),
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            message,
            template: None,
        };
        let _ = self.tx.send(ev).await;
    }

    /// A channel whose events reach the client without a template in them (the FROM image's
    /// own build ends with one, which is not this build's result).
    fn forwarded(&self) -> Sender<TemplateEvent> {
        let (ftx, mut frx) = tokio::sync::mpsc::channel::<TemplateEvent>(16);
        let tx = self.tx.clone();
        tokio::spawn(async move {
            while let Some(mut ev) = frx.recv().await {
                ev.template = None;
                let _ = tx.send(ev).await;
            }
        });
        ftx
    }

    /// FROM: the template to start from, its key and its defaults.
    async fn from(
        &self,
        reference: &str,
        req: &BuildTemplateRequest,
    ) -> ApiResult<(String, String, Option<ImageDefaults>)> {
        if let Ok(t) = self.d.templates.find(self.tenant, reference) {
            let key = hex(&Sha256::digest(format!("template:{}", t.record.id)));
            return Ok((reference.to_owned(), key, t.record.image_defaults.clone()));
        }
        let oci = OciImage {
            reference: reference.to_owned(),
            username: req.registry_username.clone(),
            password: req.registry_password.clone(),
        };
        self.d.check_registry(self.tenant, reference)?;
        let digest = self
            .d
            .builder
            .resolve(&oci, self.forwarded(), self.d.host_check(self.tenant))
            .await?;
        let key = hex(&Sha256::digest(format!("oci:{digest}")));
        let name = cache_name(&key);
        if let Ok(t) = self.d.templates.find(self.tenant, &name)
            && t.record.tenant == self.owner
        {
            self.send("step", format!("FROM {reference}: {name} (cached)"))
                .await;
            return Ok((name, key, t.record.image_defaults.clone()));
        }
        let t = self
            .d
            .create_template(
                self.tenant,
                CreateTemplateRequest {
                    name: name.clone(),
                    oci: Some(oci),
                    ..Default::default()
                },
                self.forwarded(),
            )
            .await?;
        Ok((name, key, t.record.image_defaults.clone()))
    }

    /// Runs `req` in the build sandbox to its end, its output sent as "output" events.
    async fn exec(&self, mut req: ExecRequest) -> ApiResult<(Execution, String)> {
        use execution_event::Event;
        if req.timeout_ms == 0 {
            req.timeout_ms = STEP_TIMEOUT_MS;
        }
        let sb = self.d.sandboxes.running(self.tenant, &req.sandbox_id)?;
        let id = self.d.executions.start(&sb.exec_target()?, &req)?;
        let (_, live) = self.d.executions.get(self.tenant, &id)?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(32);
        tokio::spawn(crate::stream::follow(
            self.d.executions.clone(),
            id.clone(),
            live,
            [0, 0],
            tx,
        ));
        let mut tail = String::new();
        let mut exit = None;
        while let Some(ev) = rx.recv().await {
            match ev.map(|e| e.event) {
                Ok(Some(Event::Output(o))) => {
                    let text = String::from_utf8_lossy(&o.data).into_owned();
                    tail.push_str(&text);
                    if tail.len() > TAIL_BYTES {
                        let cut = tail.len() - TAIL_BYTES;
                        let cut = (cut..tail.len())
                            .find(|i| tail.is_char_boundary(*i))
                            .unwrap_or(0);
                        tail.drain(..cut);
                    }
                    self.send("output", text).await;
                }
                Ok(Some(Event::Exit(e))) => exit = Some(e),
                Ok(None) => {}
                Err(s) => {
                    return Err(ApiError::Internal(format!(
                        "following execution {id}: {}",
                        s.message()
                    )));
                }
            }
        }
        let exit =
            exit.ok_or_else(|| ApiError::Internal(format!("execution {id} ended unseen")))?;
        Ok((exit, tail))
    }

    /// Runs a step's command; a failure names the step.
    async fn step(&self, line: usize, text: &str, req: ExecRequest) -> ApiResult<()> {
        let (e, tail) = self.exec(req).await?;
        let ok = e.state == ExecutionState::Exited as i32 && e.exit_code == 0;
        if ok {
            return Ok(());
        }
        let how = if e.state == ExecutionState::Exited as i32 {
            format!("exited with {}", e.exit_code)
        } else {
            format!("ended: {} {}", e.error_reason, e.error_message)
        };
        Err(ApiError::BuildStepFailed {
            line,
            step: text.to_owned(),
            why: format!("{how}; its last output:\n{}", tail.trim_end()),
        })
    }

    /// COPY/ADD: a tar of what the sources select, unpacked at `/` by the guest's tar as root,
    /// then owned by `chown`.
    #[allow(clippy::too_many_arguments)]
    async fn copy(
        &self,
        sandbox: &str,
        line: usize,
        text: &str,
        ctx: &Context,
        sources: &[String],
        dest: &str,
        chown: Option<&str>,
        chmod: Option<u32>,
    ) -> ApiResult<()> {
        let into_dir = dest.ends_with('/') || sources.len() > 1;
        let dest = dest.trim_end_matches('/');
        let (placed, tops) = place(ctx, sources, dest, into_dir, chmod, line, text)?;
        let tar_bytes = tar_of(&placed)?;
        let argv = |a: &[&str]| {
            Some(exec_request::Command::Argv(Argv {
                args: a.iter().map(|s| s.to_string()).collect(),
            }))
        };
        let mkdir = ExecRequest {
            sandbox_id: sandbox.to_owned(),
            command: argv(&[
                "mkdir",
                "-p",
                "--",
                if into_dir { dest } else { parent(dest) },
            ]),
            user: "root".into(),
            ..Default::default()
        };
        self.step(line, text, mkdir).await?;
        let untar = ExecRequest {
            sandbox_id: sandbox.to_owned(),
            command: argv(&["tar", "-xf", "-", "-C", "/"]),
            stdin: tar_bytes,
            user: "root".into(),
            ..Default::default()
        };
        self.step(line, text, untar).await?;
        if let Some(owner) = chown {
            let mut args = vec!["chown", "-R", owner, "--"];
            args.extend(tops.iter().map(String::as_str));
            let req = ExecRequest {
                sandbox_id: sandbox.to_owned(),
                command: argv(&args),
                user: "root".into(),
                ..Default::default()
            };
            self.step(line, text, req).await?;
        }
        Ok(())
    }
}

/// Where a COPY puts each file: (target path, mode, contents).
type Placed<'c> = Vec<(String, u32, &'c [u8])>;

/// Copy step: where each file the sources select lands under `dest` (in it when `into_dir`
/// or the source is a directory), with its mode (`chmod`, else its own), and the top-level
/// paths the copy creates (for `chown`); a source not in the context fails step `line`.
fn place<'c>(
    ctx: &'c Context,
    sources: &[String],
    dest: &str,
    into_dir: bool,
    chmod: Option<u32>,
    line: usize,
    text: &str,
) -> ApiResult<(Placed<'c>, BTreeSet<String>)> {
    let mut placed: Placed<'c> = Vec::new();
    let mut tops = BTreeSet::new();
    for s in sources {
        let Some((is_dir, files)) = ctx.select(s) else {
            return Err(ApiError::BuildStepFailed {
                line,
                step: text.to_owned(),
                why: format!("{s}: not in the build context"),
            });
        };
        for (rel, path) in files {
            let target = if is_dir || into_dir {
                format!("{dest}/{rel}")
            } else {
                dest.to_owned()
            };
            let (mode, data) = &ctx.files[&path];
            let top = if is_dir {
                format!("{dest}/{}", rel.split('/').next().unwrap_or(&rel))
            } else {
                target.clone()
            };
            tops.insert(top);
            placed.push((target, chmod.unwrap_or(*mode), data.as_slice()));
        }
    }
    Ok((placed, tops))
}

/// Copy step: the tar the guest unpacks at `/` (regular files owned by root, mtime 0).
fn tar_of(placed: &Placed<'_>) -> ApiResult<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for (target, mode, data) in placed {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(*mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, target.trim_start_matches('/'), *data)
            .map_err(|e| ApiError::Internal(format!("the copy's tar: {e}")))?;
    }
    b.into_inner()
        .map_err(|e| ApiError::Internal(format!("the copy's tar: {e}")))
}

fn parent(p: &str) -> &str {
    match p.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &p[..i],
    }
}

/// BuildTemplate: checks everything first (name, Dockerfile, context, COPY sources), then
/// builds; the build sandbox is destroyed whatever happened.
pub async fn build(
    d: &Arc<Daemon>,
    tenant: &str,
    req: BuildTemplateRequest,
    tx: Sender<TemplateEvent>,
) -> ApiResult<TemplateRt> {
    // The owner the build's templates get ("" for an operator's, which are shared): only
    // caches of that same owner are used, never another tenant's (or a shared one, for a
    // tenant).
    let owner = d.templates.check_new(tenant, &req.name, req.replace)?;
    let file = dockerfile::parse(&req.dockerfile, &req.build_args)
        .map_err(|e| ApiError::InvalidArgument(format!("Dockerfile: {e}")))?;
    let ctx = Context::read(&req.context)?;
    for (line, _, step) in &file.steps {
        if let Step::Copy { sources, .. } = step {
            for s in sources {
                if ctx.select(s).is_none() {
                    return Err(ApiError::InvalidArgument(format!(
                        "Dockerfile: line {line}: {s} is not in the build context"
                    )));
                }
            }
        }
    }
    let b = Build {
        d,
        tenant,
        owner: owner.clone(),
        tx,
        started: Instant::now(),
    };
    let (base, base_key, base_defaults) = b.from(&file.from, &req).await?;
    let mut keys = Vec::with_capacity(file.steps.len());
    let mut key = base_key;
    for (_, text, step) in &file.steps {
        key = step_key(&key, text, step, &ctx);
        keys.push(key.clone());
    }
    let mut first = 0;
    let mut start = base;
    if !req.no_cache {
        for (i, k) in keys.iter().enumerate().rev() {
            let name = cache_name(k);
            if d.templates
                .find(tenant, &name)
                .is_ok_and(|t| t.record.tenant == owner)
            {
                first = i + 1;
                start = name;
                break;
            }
        }
    }
    for (line, text, _) in &file.steps[..first] {
        b.send("step", format!("line {line}: {text} (cached)"))
            .await;
    }
    let sb = d
        .sandboxes
        .create(
            tenant,
            CreateSandboxRequest {
                template: start,
                network: req.network.clone(),
                packages: req.packages.clone(),
                labels: HashMap::from([("airlock.build".to_string(), req.name.clone())]),
                ..Default::default()
            },
        )
        .await?;
    let result = run(&b, &sb.id, &file, &ctx, &keys, first, &req, base_defaults).await;
    let _ = d.sandboxes.destroy(tenant, &sb.id).await;
    let t = result?;
    d.pool.refill(&t);
    Ok(t)
}

/// The build in its sandbox: the Dockerfile's steps from `first` on (each cached as it
/// completes), the start command, the ready check, and the snapshot as the template.
#[allow(clippy::too_many_arguments)]
async fn run(
    b: &Build<'_>,
    sandbox: &str,
    file: &Dockerfile,
    ctx: &Context,
    keys: &[String],
    first: usize,
    req: &BuildTemplateRequest,
    base: Option<ImageDefaults>,
) -> ApiResult<TemplateRt> {
    run_steps(b, sandbox, file, ctx, keys, first, base.as_ref()).await?;
    let started = start_command(b, sandbox, file, req).await?;
    if let Some(check) = ready_check(req) {
        wait_until_ready(b, sandbox, file, req, &check, started.as_deref()).await?;
    }
    let defaults = template_defaults(file, base.unwrap_or_default());
    snapshot_template(b, sandbox, req, defaults).await
}

/// Build step: the Dockerfile's steps from `first` on, each announced, run and cached.
async fn run_steps(
    b: &Build<'_>,
    sandbox: &str,
    file: &Dockerfile,
    ctx: &Context,
    keys: &[String],
    first: usize,
    base: Option<&ImageDefaults>,
) -> ApiResult<()> {
    let total = file.steps.len();
    // As in Docker, RUN runs as the image's own user until USER says otherwise: an OCI
    // image's User, else root (not the base template's unprivileged default account).
    let base_user = base
        .map(|d| d.user.clone())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "root".into());
    for (i, (line, text, step)) in file.steps.iter().enumerate().skip(first) {
        b.send(
            "step",
            format!("step {}/{total}, line {line}: {text}", i + 1),
        )
        .await;
        run_step(b, sandbox, ctx, *line, text, step, &base_user).await?;
        cache_step(b, sandbox, &keys[i]).await;
    }
    Ok(())
}

/// Build step: one Dockerfile step in the build sandbox: RUN as an execution (as `base_user`
/// unless it has a USER), COPY/ADD as a copy.
async fn run_step(
    b: &Build<'_>,
    sandbox: &str,
    ctx: &Context,
    line: usize,
    text: &str,
    step: &Step,
    base_user: &str,
) -> ApiResult<()> {
    match step {
        Step::Run {
            command,
            user,
            workdir,
            env,
        } => {
            // WORKDIR is made if missing (as Docker makes it), by the step's own shell.
            let args = if workdir.is_empty() {
                command.argv()
            } else {
                let mut a: Vec<String> = [
                    "/bin/sh",
                    "-c",
                    "mkdir -p -- \"$0\" && cd -- \"$0\" && exec \"$@\"",
                    workdir,
                ]
                .map(String::from)
                .to_vec();
                a.extend(command.argv());
                a
            };
            let exec = ExecRequest {
                sandbox_id: sandbox.to_owned(),
                command: Some(exec_request::Command::Argv(Argv { args })),
                user: if user.is_empty() {
                    base_user.to_owned()
                } else {
                    user.clone()
                },
                env: env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                ..Default::default()
            };
            b.step(line, text, exec).await
        }
        Step::Copy {
            sources,
            dest,
            chown,
            chmod,
        } => {
            b.copy(
                sandbox,
                line,
                text,
                ctx,
                sources,
                dest,
                chown.as_deref(),
                *chmod,
            )
            .await
        }
    }
}

/// Build step: the sandbox snapshotted as the cache template of step key `key`, unless it
/// exists (a failure is only reported: the step is then not cached).
async fn cache_step(b: &Build<'_>, sandbox: &str, key: &str) {
    let name = cache_name(key);
    if b.d.templates.find(b.tenant, &name).is_err() {
        // Owned as the build's result will be (the default tenant's: shared), which is what
        // the cache lookup asks for.
        let cached =
            b.d.sandboxes
                .snapshot_with(b.tenant, sandbox, &name, None, None, false);
        match cached.await {
            Ok(_) => b.send("step", format!("cached as {name}")).await,
            Err(e) => b.send("step", format!("not cached: {e}")).await,
        }
    }
}

/// A shell command in the build sandbox, with the Dockerfile's final user, working directory
/// and environment, for at most a minute.
fn shell(sandbox: &str, file: &Dockerfile, s: &str) -> ExecRequest {
    ExecRequest {
        sandbox_id: sandbox.to_owned(),
        command: Some(exec_request::Command::Shell(s.to_owned())),
        user: file.user.clone(),
        cwd: file.workdir.clone(),
        env: file
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        timeout_ms: 60_000,
        ..Default::default()
    }
}

/// Build step: the request's start command, if any, left running; its execution's id.
async fn start_command(
    b: &Build<'_>,
    sandbox: &str,
    file: &Dockerfile,
    req: &BuildTemplateRequest,
) -> ApiResult<Option<String>> {
    if req.start.is_empty() {
        return Ok(None);
    }
    b.send("starting", req.start.clone()).await;
    // An execution of its own that runs on (the agent ends whatever an execution leaves
    // behind when it ends): the snapshot holds it running, and so does every sandbox
    // restored from it, for up to max_exec_timeout_ms.
    let mut start = shell(
        sandbox,
        file,
        &format!("exec {} </dev/null >/tmp/airlock-start.log 2>&1", req.start),
    );
    start.timeout_ms = b.d.cfg.max_exec_timeout_ms;
    let sb = b.d.sandboxes.running(b.tenant, sandbox)?;
    Ok(Some(b.d.executions.start(&sb.exec_target()?, &start)?))
}

/// The request's ready check as a shell command: its command, else a fetch of its URL.
fn ready_check(req: &BuildTemplateRequest) -> Option<String> {
    if !req.ready_command.is_empty() {
        Some(req.ready_command.clone())
    } else if !req.ready_url.is_empty() {
        let url = req.ready_url.replace('\'', "'\\''");
        // wget first: it starts in a fraction of curl's time in an emulated guest kernel.
        Some(format!(
            "wget -q -O /dev/null '{url}' 2>/dev/null || curl -fsS -o /dev/null '{url}'"
        ))
    } else {
        None
    }
}

/// Build step: runs `check` once a second until it succeeds; fails if the start command
/// (execution `started`) ends first, or after the request's ready timeout.
async fn wait_until_ready(
    b: &Build<'_>,
    sandbox: &str,
    file: &Dockerfile,
    req: &BuildTemplateRequest,
    check: &str,
    started: Option<&str>,
) -> ApiResult<()> {
    let limit = Duration::from_secs(u64::from(if req.ready_timeout_s == 0 {
        60
    } else {
        req.ready_timeout_s
    }));
    b.send("waiting", format!("until `{check}` succeeds")).await;
    let t0 = Instant::now();
    loop {
        let (e, tail) = b.exec(shell(sandbox, file, check)).await?;
        if e.state == ExecutionState::Exited as i32 && e.exit_code == 0 {
            return Ok(());
        }
        if let Some(id) = started
            && let Ok((e, None)) = b.d.executions.get(b.tenant, id)
        {
            return Err(ApiError::BuildStepFailed {
                line: 0,
                step: "start".into(),
                why: format!(
                    "`{}` ended (exit {}, signal {}) before the ready check passed; its \
                     output is in /tmp/airlock-start.log",
                    req.start, e.exit_code, e.signal
                ),
            });
        }
        if t0.elapsed() > limit {
            return Err(ApiError::BuildStepFailed {
                line: 0,
                step: "ready check".into(),
                why: format!(
                    "`{check}` did not succeed within {} s; its last output:\n{}",
                    limit.as_secs(),
                    tail.trim_end()
                ),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The template's defaults: the Dockerfile's ENV over the base image's, and its WORKDIR,
/// USER, ENTRYPOINT and CMD where it has them, else the base's.
fn template_defaults(file: &Dockerfile, base: ImageDefaults) -> ImageDefaults {
    let mut env: BTreeMap<String, String> = base
        .env
        .iter()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    env.extend(file.env.clone());
    let or = |mine: &str, theirs: &str| if mine.is_empty() { theirs } else { mine }.to_owned();
    let or_list = |mine: &Vec<String>, theirs: &Vec<String>| {
        if mine.is_empty() { theirs } else { mine }.clone()
    };
    ImageDefaults {
        env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
        working_dir: or(&file.workdir, &base.working_dir),
        user: or(&file.user, &base.user),
        entrypoint: or_list(&file.entrypoint, &base.entrypoint),
        cmd: or_list(&file.cmd, &base.cmd),
    }
}

/// Build step: the sandbox snapshotted as the requested template (its source: the
/// Dockerfile's and context's digest), and the `ready` event.
async fn snapshot_template(
    b: &Build<'_>,
    sandbox: &str,
    req: &BuildTemplateRequest,
    defaults: ImageDefaults,
) -> ApiResult<TemplateRt> {
    let mut h = Sha256::new();
    h.update(req.dockerfile.as_bytes());
    h.update(&req.context);
    let source = format!("dockerfile:sha256:{}", hex(&h.finalize()));
    b.send("snapshotting", format!("template {}", req.name))
        .await;
    let t =
        b.d.sandboxes
            .snapshot_with(
                b.tenant,
                sandbox,
                &req.name,
                Some((source, defaults)),
                None,
                req.replace,
            )
            .await?;
    let secs = b.started.elapsed().as_secs();
    let shown = crate::templates::as_seen_by(t.record.clone(), b.d.cfg.is_operator(b.tenant));
    let ev = TemplateEvent {
        phase: "ready".into(),
        elapsed_ms: b.started.elapsed().as_millis() as u64,
        message: format!("ready after {secs} s"),
        template: Some(shown),
    };
    let _ = b.tx.send(ev).await;
    Ok(t)
}
