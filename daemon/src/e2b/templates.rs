//! E2B's template build API over Airlock's Dockerfile builds, so that the E2B SDK's
//! `Template` builder and `Template.build` work unchanged: `POST /v3/templates` (a build of
//! NAME[:TAG] is requested), `GET /templates/{id}/files/{hash}` (is a COPY's archive here? if
//! not, a signed upload link to this gateway), `PUT` of that link (the tar, gzipped or not),
//! `POST /v2/templates/{id}/builds/{build}` (the steps: translated into a Dockerfile whose
//! context holds the uploaded archives, and built by BuildTemplate), `GET
//! /templates/{id}/builds/{build}/status` (status and log entries from an offset) and `GET
//! /templates/aliases/{alias}`. An E2B template id is the Airlock template's name.
//!
//! What E2B's API has and this does not serve: several tags per build (the first is used),
//! `cpuCount`/`memoryMB` (a build takes its FROM template's shape), cloud registries
//! (`fromImageRegistry` other than user/password), COPY of glob patterns.

use std::collections::{HashMap, VecDeque};
use std::io::Read as _;
use std::sync::{Arc, Mutex};

use airlock_api::v1::template_recipe::How;
use airlock_api::v1::{BuildTemplateRequest, TemplateEvent};
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post, put};
use serde::Deserialize;
use serde_json::{Value, json};

use super::control::JsonBody;
use super::{Gateway, json, json_error};
use crate::templates::TemplateRef;

type Gw = State<Arc<Gateway>>;

/// The most one uploaded archive may hold (a build's whole context is capped the same).
const MAX_UPLOAD_BYTES: usize = 3 << 20;
/// The most all kept uploads hold; the oldest go first.
const MAX_UPLOADS_BYTES: usize = 64 << 20;
/// Why E2B's build steps cannot be built here (what the E2B client is told).
#[derive(Debug, thiserror::Error)]
enum TranslateError {
    /// `fromImageRegistry` of a type other than user/password (its `type`, if a string).
    #[error(
        "fromImageRegistry of type {0:?} is not served here: use a registry with a username \
         and password"
    )]
    RegistryType(Option<String>),
    /// A RUN step's argv as JSON.
    #[error("{0}")]
    Json(serde_json::Error),
    #[error("step {0}: COPY without a files hash")]
    CopyWithoutHash(usize),
    #[error("step {step}: COPY of a pattern ({src}) is not served here")]
    CopyPattern { step: usize, src: String },
    #[error("step {step}: the files of COPY {src} were not uploaded")]
    NotUploaded { step: usize, src: String },
    #[error("step {step}: COPY {src}: {why}")]
    Archive {
        step: usize,
        src: String,
        why: ArchiveError,
    },
    #[error("step {step}: {kind} is not served here")]
    Unsupported { step: usize, kind: String },
    #[error("the build context: {0}")]
    Context(std::io::Error),
    #[error(
        "the COPY steps' files come to {0} bytes; a build here takes at most {max}",
        max = MAX_UPLOAD_BYTES
    )]
    ContextTooLarge(usize),
}

/// Why an uploaded archive cannot go into a build's context.
#[derive(Debug, thiserror::Error)]
enum ArchiveError {
    #[error("its gzip: {0}")]
    Gzip(std::io::Error),
    #[error("more than {max} bytes unpacked", max = MAX_UPLOAD_BYTES)]
    TooLarge,
    #[error("its tar: {0}")]
    Tar(std::io::Error),
    /// An entry whose path is empty, absolute or climbs out.
    #[error("the entry {0:?}")]
    Entry(String),
    /// Neither a regular file nor a directory.
    #[error("{0}: only files and directories are copied here")]
    Kind(String),
    /// Copying an entry into the context.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Builds remembered (the oldest finished ones go first).
const MAX_BUILDS: usize = 256;
/// Log entries one status call returns at most (as E2B's).
const MAX_ENTRIES_PER_CALL: usize = 100;

pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/v3/templates", post(request))
        .route("/templates/{id}/files/{hash}", get(upload_link))
        .route("/airlock/e2b-uploads/{tenant}/{hash}", put(upload))
        .route("/v2/templates/{id}/builds/{build}", post(start))
        .route("/templates/{id}/builds/{build}/status", get(status))
        .route("/templates/aliases/{alias}", get(alias))
}

/// The gateway's template builds and uploaded archives.
#[derive(Debug, Default)]
pub struct Builds {
    builds: Mutex<HashMap<String, Build>>,
    order: Mutex<VecDeque<String>>,
    /// The archives, oldest first.
    uploads: Mutex<VecDeque<Upload>>,
}

/// An uploaded archive: (tenant, files hash) and its bytes.
type Upload = ((String, String), Vec<u8>);

#[derive(Clone, Debug)]
struct Build {
    tenant: String,
    /// NAME:TAG.
    name: String,
    status: &'static str,
    entries: Vec<Value>,
    reason: Option<Value>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Builds {
    fn get(&self, tenant: &str, id: &str) -> Option<Build> {
        lock(&self.builds)
            .get(id)
            .filter(|b| b.tenant == tenant)
            .cloned()
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut Build)) {
        if let Some(b) = lock(&self.builds).get_mut(id) {
            f(b);
        }
    }

    fn add(&self, id: String, b: Build) {
        let mut builds = lock(&self.builds);
        let mut order = lock(&self.order);
        while order.len() >= MAX_BUILDS {
            let Some(old) = order.pop_front() else { break };
            builds.remove(&old);
        }
        order.push_back(id.clone());
        builds.insert(id, b);
    }

    fn upload(&self, tenant: &str, hash: &str) -> Option<Vec<u8>> {
        lock(&self.uploads)
            .iter()
            .find(|((t, h), _)| t == tenant && h == hash)
            .map(|(_, a)| a.clone())
    }

    fn keep_upload(&self, tenant: &str, hash: &str, archive: Vec<u8>) {
        let mut all = lock(&self.uploads);
        all.retain(|((t, h), _)| !(t == tenant && h == hash));
        while all.iter().map(|(_, a)| a.len()).sum::<usize>() + archive.len() > MAX_UPLOADS_BYTES {
            if all.pop_front().is_none() {
                break;
            }
        }
        all.push_back(((tenant.to_owned(), hash.to_owned()), archive));
    }
}

/// The tenant of a call that makes templates (403 for a key that may not).
fn maker(gw: &Gateway, headers: &HeaderMap) -> Result<String, Response> {
    let (tenant, right) = gw.caller(headers)?;
    if !right {
        return Err(json_error(
            StatusCode::FORBIDDEN,
            "this API key may run sandboxes but not build templates (a run_tokens key)",
        ));
    }
    Ok(tenant)
}

fn entry(level: &str, message: &str) -> Value {
    json!({
        "timestamp": airlock_api::utc_time(crate::ids::now_ms()),
        "level": level,
        "message": message,
    })
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct RequestBuild {
    name: String,
    alias: String,
    tags: Vec<String>,
}

/// `POST /v3/templates`: a build of NAME[:TAG] (the tag, else the first of `tags`, else
/// `latest`), to be started with its steps.
async fn request(
    State(gw): Gw,
    headers: HeaderMap,
    JsonBody(r): JsonBody<RequestBuild>,
) -> Response {
    let tenant = match maker(&gw, &headers) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let given = if r.name.is_empty() { &r.alias } else { &r.name };
    let reference = match TemplateRef::parse(given) {
        Ok(mut t) => {
            if t.tag.is_none() {
                t.tag = r.tags.first().cloned();
            }
            t.tag.get_or_insert_with(|| "latest".into());
            t
        }
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let build_id = match crate::ids::new_id(crate::ids::Kind::Build) {
        Ok(id) => id,
        Err(e) => return json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    let tag = reference.tag.clone().unwrap_or_default();
    gw.templates.add(
        build_id.clone(),
        Build {
            tenant,
            name: reference.to_string(),
            status: "waiting",
            entries: Vec::new(),
            reason: None,
        },
    );
    json(
        StatusCode::ACCEPTED,
        &json!({
            "templateID": reference.name,
            "buildID": build_id,
            "public": false,
            "names": [reference.to_string()],
            "tags": [tag],
            "aliases": [reference.name],
        }),
    )
}

/// `GET /templates/{id}/files/{hash}`: whether the archive of a COPY is here, else where to
/// upload it (a link signed for this tenant and hash).
async fn upload_link(
    State(gw): Gw,
    headers: HeaderMap,
    Path((_id, hash)): Path<(String, String)>,
) -> Response {
    let tenant = match maker(&gw, &headers) {
        Ok(t) => t,
        Err(r) => return r,
    };
    if !valid_hash(&hash) {
        return json_error(StatusCode::BAD_REQUEST, "a files hash is 64 hex digits");
    }
    if gw.templates.upload(&tenant, &hash).is_some() {
        return json(StatusCode::CREATED, &json!({"present": true}));
    }
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let scheme = if gw.daemon.cfg.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let token = gw.sign(&format!("upload/{tenant}/{hash}"));
    let url = format!("{scheme}://{host}/airlock/e2b-uploads/{tenant}/{hash}?token={token}");
    json(StatusCode::CREATED, &json!({"present": false, "url": url}))
}

fn valid_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())
}

#[derive(Debug, Default, Deserialize)]
struct Token {
    #[serde(default)]
    token: String,
}

/// `PUT` of an upload link: the archive (at most 3 MiB), kept for the tenant's builds.
async fn upload(
    State(gw): Gw,
    Path((tenant, hash)): Path<(String, String)>,
    Query(t): Query<Token>,
    body: axum::body::Body,
) -> Response {
    if !valid_hash(&hash) || !gw.signed(&format!("upload/{tenant}/{hash}"), &t.token) {
        return json_error(StatusCode::FORBIDDEN, "not a valid upload link");
    }
    let bytes = match axum::body::to_bytes(body, MAX_UPLOAD_BYTES).await {
        Ok(b) => b.to_vec(),
        Err(_) => {
            return json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("a COPY's files may be at most {MAX_UPLOAD_BYTES} bytes here"),
            );
        }
    };
    gw.templates.keep_upload(&tenant, &hash, bytes);
    json(StatusCode::OK, &json!({}))
}

/// E2B's `TemplateBuildStartV2`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct Start {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<Value>,
    force: bool,
    steps: Vec<E2bStep>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct E2bStep {
    #[serde(rename = "type")]
    kind: String,
    args: Vec<String>,
    force: bool,
    files_hash: Option<String>,
}

/// `POST /v2/templates/{id}/builds/{build}`: the steps, built as a Dockerfile in the
/// background; `status` follows it.
async fn start(
    State(gw): Gw,
    headers: HeaderMap,
    Path((_id, build_id)): Path<(String, String)>,
    JsonBody(s): JsonBody<Start>,
) -> Response {
    let tenant = match maker(&gw, &headers) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let Some(b) = gw.templates.get(&tenant, &build_id) else {
        return json_error(
            StatusCode::NOT_FOUND,
            &format!("build {build_id} not found"),
        );
    };
    if b.status != "waiting" {
        return json_error(
            StatusCode::CONFLICT,
            &format!("build {build_id} was started"),
        );
    }
    let req = match translate(&b.name, &s, |hash| gw.templates.upload(&tenant, hash)) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    gw.templates.update(&build_id, |b| {
        b.status = "building";
        b.entries.push(entry(
            "info",
            &format!("building {} as a Dockerfile:\n{}", b.name, req.dockerfile),
        ));
    });
    let (tx, mut rx) = tokio::sync::mpsc::channel::<TemplateEvent>(16);
    let d = gw.daemon.clone();
    let build = tokio::spawn(crate::versions::make_and_keep(
        d,
        tenant.clone(),
        How::Build(req),
        tx,
    ));
    let g = gw.clone();
    tokio::spawn(async move {
        while let Some(ev) = rx.recv().await {
            let line = format!("{}: {}", ev.phase, ev.message.trim_end());
            g.templates
                .update(&build_id, |b| b.entries.push(entry("info", &line)));
        }
        let failed = match build.await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        g.templates.update(&build_id, |b| match failed {
            None => b.status = "ready",
            Some(e) => {
                b.entries.push(entry("error", &e));
                b.status = "error";
                b.reason = Some(json!({"message": e}));
            }
        });
    });
    json(StatusCode::ACCEPTED, &json!({}))
}

/// E2B's steps as a Dockerfile, with a context of the uploaded archives (each COPY's under
/// `h<hash>/`).
fn translate(
    name: &str,
    s: &Start,
    upload: impl Fn(&str) -> Option<Vec<u8>>,
) -> Result<BuildTemplateRequest, TranslateError> {
    let from = base_of(s);
    let (username, password) = registry_login(s)?;
    let mut lines = vec![format!("FROM {from}")];
    let mut context = tar::Builder::new(Vec::new());
    let mut added = std::collections::HashSet::new();
    // The user RUN runs as: the last USER step's, else root (as in a Dockerfile).
    let mut user: Option<String> = None;
    for (i, step) in s.steps.iter().enumerate() {
        let n = i + 1;
        let arg = |k: usize| step.args.get(k).map(String::as_str).unwrap_or_default();
        match step.kind.as_str() {
            "RUN" => run_lines(arg(0), arg(1), user.as_deref(), &mut lines)?,
            "COPY" => lines.push(copy_line(n, step, &upload, &mut context, &mut added)?),
            "ENV" => lines.extend(env_line(&step.args)),
            "WORKDIR" => lines.push(format!("WORKDIR {}", arg(0))),
            "USER" => {
                lines.push(format!("USER {}", arg(0)));
                user = Some(arg(0).to_owned());
            }
            other => {
                return Err(TranslateError::Unsupported {
                    step: n,
                    kind: other.to_owned(),
                });
            }
        }
    }
    let context = context.into_inner().map_err(TranslateError::Context)?;
    if context.len() > MAX_UPLOAD_BYTES {
        return Err(TranslateError::ContextTooLarge(context.len()));
    }
    Ok(BuildTemplateRequest {
        name: name.to_owned(),
        dockerfile: lines.join("\n") + "\n",
        context,
        start: s.start_cmd.clone().unwrap_or_default(),
        ready_command: s.ready_cmd.clone().unwrap_or_default(),
        no_cache: s.force || s.steps.iter().any(|st| st.force),
        registry_username: username,
        registry_password: password,
        // E2B rebuilds a name in place: the tag moves to the new build.
        replace: true,
        ..Default::default()
    })
}

/// Translate step: the image the Dockerfile starts FROM (E2B's base image is ours: `base`).
fn base_of(s: &Start) -> String {
    match (&s.from_template, &s.from_image) {
        (Some(t), _) if !t.is_empty() => t.clone(),
        (_, Some(i)) if i == "e2bdev/base" || i.starts_with("e2bdev/base:") => "base".into(),
        (_, Some(i)) if !i.is_empty() => i.clone(),
        _ => "base".into(),
    }
}

/// Translate step: the registry's username and password (empty without a registry).
fn registry_login(s: &Start) -> Result<(String, String), TranslateError> {
    let (mut username, mut password) = (String::new(), String::new());
    if let Some(reg) = &s.from_image_registry {
        match reg["type"].as_str() {
            Some("registry") => {
                username = reg["username"].as_str().unwrap_or_default().to_owned();
                password = reg["password"].as_str().unwrap_or_default().to_owned();
            }
            other => return Err(TranslateError::RegistryType(other.map(str::to_owned))),
        }
    }
    Ok((username, password))
}

/// Translate step: a RUN step's lines, as `as_user` (switching from `user`, the last USER's,
/// and back).
fn run_lines(
    cmd: &str,
    as_user: &str,
    user: Option<&str>,
    lines: &mut Vec<String>,
) -> Result<(), TranslateError> {
    let argv = match (as_user, user) {
        ("", _) => vec!["/bin/sh", "-c", cmd],
        (u, None | Some("root")) if u != "root" => {
            vec!["su", "-s", "/bin/sh", "-c", cmd, u]
        }
        _ => vec!["/bin/sh", "-c", cmd],
    };
    let exec = serde_json::to_string(&argv).map_err(TranslateError::Json)?;
    let switch = !as_user.is_empty() && argv[0] != "su" && user.unwrap_or("root") != as_user;
    if switch {
        lines.push(format!("USER {as_user}"));
    }
    lines.push(format!("RUN {exec}"));
    if switch {
        lines.push(format!("USER {}", user.unwrap_or("root")));
    }
    Ok(())
}

/// Translate step: step `n`'s COPY line, its uploaded archive added to `context` once.
fn copy_line(
    n: usize,
    step: &E2bStep,
    upload: &impl Fn(&str) -> Option<Vec<u8>>,
    context: &mut tar::Builder<Vec<u8>>,
    added: &mut std::collections::HashSet<String>,
) -> Result<String, TranslateError> {
    let arg = |k: usize| step.args.get(k).map(String::as_str).unwrap_or_default();
    let hash = step
        .files_hash
        .as_deref()
        .filter(|h| valid_hash(h))
        .ok_or(TranslateError::CopyWithoutHash(n))?;
    let (src, dest, owner, mode) = (arg(0), arg(1), arg(2), arg(3));
    if src.contains(['*', '?', '[']) {
        return Err(TranslateError::CopyPattern {
            step: n,
            src: src.to_owned(),
        });
    }
    if added.insert(hash.to_owned()) {
        let archive = upload(hash).ok_or_else(|| TranslateError::NotUploaded {
            step: n,
            src: src.to_owned(),
        })?;
        add_archive(context, hash, &archive).map_err(|why| TranslateError::Archive {
            step: n,
            src: src.to_owned(),
            why,
        })?;
    }
    let mut line = "COPY".to_owned();
    if !owner.is_empty() {
        line.push_str(&format!(" --chown={owner}"));
    }
    if !mode.is_empty() {
        line.push_str(&format!(" --chmod={mode}"));
    }
    let src = src.trim_start_matches("./").trim_end_matches('/');
    line.push_str(&format!(" h{hash}/{src} {dest}"));
    Ok(line)
}

/// Translate step: an ENV step's line, its values quoted (none without pairs).
fn env_line(args: &[String]) -> Option<String> {
    let quote = |v: &str| serde_json::to_string(v).unwrap_or_default();
    let pairs: Vec<String> = args
        .chunks(2)
        .map(|kv| format!("{}={}", kv[0], quote(kv.get(1).map_or("", |v| v))))
        .collect();
    (!pairs.is_empty()).then(|| format!("ENV {}", pairs.join(" ")))
}

/// Adds the entries of an uploaded archive (tar, gzipped or not) under `h<hash>/`: regular
/// files and directories only.
fn add_archive(
    out: &mut tar::Builder<Vec<u8>>,
    hash: &str,
    archive: &[u8],
) -> Result<(), ArchiveError> {
    let mut raw = Vec::new();
    if archive.starts_with(&[0x1f, 0x8b]) {
        flate2::read::GzDecoder::new(archive)
            .take(MAX_UPLOAD_BYTES as u64 + 1)
            .read_to_end(&mut raw)
            .map_err(ArchiveError::Gzip)?;
        if raw.len() > MAX_UPLOAD_BYTES {
            return Err(ArchiveError::TooLarge);
        }
    } else {
        raw = archive.to_vec();
    }
    let mut a = tar::Archive::new(raw.as_slice());
    for e in a.entries().map_err(ArchiveError::Tar)? {
        let mut e = e.map_err(ArchiveError::Tar)?;
        let path = e.path().map_err(ArchiveError::Tar)?.into_owned();
        let rel = path.to_string_lossy().trim_start_matches("./").to_owned();
        if rel.is_empty() || rel.split('/').any(|c| c == "..") || rel.starts_with('/') {
            return Err(ArchiveError::Entry(rel));
        }
        let kind = e.header().entry_type();
        let mut h = tar::Header::new_gnu();
        h.set_mode(e.header().mode().unwrap_or(0o644));
        let name = format!("h{hash}/{rel}");
        if kind.is_dir() {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            h.set_cksum();
            out.append_data(&mut h, &name, std::io::empty())?;
        } else if kind.is_file() {
            let mut data = Vec::new();
            e.read_to_end(&mut data)?;
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(data.len() as u64);
            h.set_cksum();
            out.append_data(&mut h, &name, data.as_slice())?;
        } else {
            return Err(ArchiveError::Kind(rel));
        }
    }
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct StatusQuery {
    logs_offset: usize,
}

/// `GET /templates/{id}/builds/{build}/status`: the status and the log entries from
/// `logsOffset` (at most 100).
async fn status(
    State(gw): Gw,
    headers: HeaderMap,
    Path((id, build_id)): Path<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> Response {
    let tenant = match gw.caller(&headers) {
        Ok((t, _)) => t,
        Err(r) => return r,
    };
    let Some(b) = gw.templates.get(&tenant, &build_id) else {
        return json_error(
            StatusCode::NOT_FOUND,
            &format!("build {build_id} not found"),
        );
    };
    let entries: Vec<Value> = b
        .entries
        .iter()
        .skip(q.logs_offset)
        .take(MAX_ENTRIES_PER_CALL)
        .cloned()
        .collect();
    let logs: Vec<Value> = entries.iter().map(|e| e["message"].clone()).collect();
    let mut body = json!({
        "templateID": id,
        "buildID": build_id,
        "status": b.status,
        "logEntries": entries,
        "logs": logs,
    });
    if let Some(r) = b.reason {
        body["reason"] = r;
    }
    json(StatusCode::OK, &body)
}

/// `GET /templates/aliases/{alias}`: the template of that name, if the caller has it.
async fn alias(State(gw): Gw, headers: HeaderMap, Path(alias): Path<String>) -> Response {
    let tenant = match gw.caller(&headers) {
        Ok((t, _)) => t,
        Err(r) => return r,
    };
    match gw.daemon.templates.find(&tenant, &alias) {
        Ok(t) => json(
            StatusCode::OK,
            &json!({"templateID": t.record.name, "public": t.record.tenant.is_empty()}),
        ),
        Err(_) => json_error(
            StatusCode::NOT_FOUND,
            &format!("template {alias} not found"),
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn step(kind: &str, args: &[&str]) -> E2bStep {
        E2bStep {
            kind: kind.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn e2b_steps_become_a_dockerfile() {
        let hash = "a".repeat(64);
        let mut files = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_cksum();
        files.append_data(&mut h, "app/x", &b"hi"[..]).unwrap();
        let archive = files.into_inner().unwrap();
        let copy = E2bStep {
            files_hash: Some(hash.clone()),
            ..step("COPY", &["app", "/opt/app/", "user", "0755"])
        };
        let start = Start {
            from_image: Some("e2bdev/base".into()),
            steps: vec![
                copy,
                step("ENV", &["A", "1 2", "B", "x\"y"]),
                step("RUN", &["make\ninstall"]),
                step("RUN", &["whoami", "user"]),
                step("USER", &["user"]),
                step("RUN", &["id", "root"]),
                step("WORKDIR", &["/opt/app"]),
            ],
            start_cmd: Some("serve".into()),
            ..Default::default()
        };
        let req = translate("app:v1", &start, |h| (h == hash).then(|| archive.clone())).unwrap();
        let want = format!(
            "FROM base\nCOPY --chown=user --chmod=0755 h{hash}/app /opt/app/\n\
             ENV A=\"1 2\" B=\"x\\\"y\"\nRUN [\"/bin/sh\",\"-c\",\"make\\ninstall\"]\n\
             RUN [\"su\",\"-s\",\"/bin/sh\",\"-c\",\"whoami\",\"user\"]\nUSER user\n\
             USER root\nRUN [\"/bin/sh\",\"-c\",\"id\"]\nUSER user\nWORKDIR /opt/app\n"
        );
        assert_eq!(req.dockerfile, want);
        assert!(req.replace && req.start == "serve");
        crate::templates::dockerfile::parse(&req.dockerfile, &Default::default()).unwrap();
        let missing = translate("app", &start, |_| None).unwrap_err().to_string();
        assert!(missing.contains("not uploaded"), "{missing}");
        let glob = Start {
            steps: vec![E2bStep {
                files_hash: Some(hash.clone()),
                ..step("COPY", &["*.py", "/app/"])
            }],
            ..Default::default()
        };
        assert!(translate("app", &glob, |_| Some(archive.clone())).is_err());
    }

    #[test]
    fn an_archive_goes_under_its_hash_and_escapes_are_refused() {
        let mut src = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_cksum();
        src.append_data(&mut h, "app/a.txt", &b"abc"[..]).unwrap();
        let archive = src.into_inner().unwrap();
        let mut out = tar::Builder::new(Vec::new());
        add_archive(&mut out, "ab", &archive).unwrap();
        let bytes = out.into_inner().unwrap();
        let mut a = tar::Archive::new(bytes.as_slice());
        let names: Vec<String> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["hab/app/a.txt"]);
        let mut evil = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_cksum();
        // `append_data` refuses `..`; write the name into the header by hand.
        h.as_old_mut().name[..7].copy_from_slice(b"../x.sh");
        h.set_cksum();
        evil.append(&h, &b"x"[..]).unwrap();
        let evil = evil.into_inner().unwrap();
        let mut out = tar::Builder::new(Vec::new());
        assert!(add_archive(&mut out, "ab", &evil).is_err());
    }
}
