//! The proxy's side towards a sandbox: one guest connection served as HTTP/1.1 (hyper), each
//! request decided by the sandbox's policy, logged, and answered from the registry or the cache.
//!
//! A refusal is answered at once, never by a timeout, and its text names the rule: as the HTTP
//! reason phrase and body (what pip shows for a file, what npm shows), and, for pip's index
//! requests, as a page whose content type pip rejects with a warning that quotes it (pip logs
//! an index page's HTTP errors only at debug level, so a 403 there would surface as a bare "no
//! matching distribution").

use std::convert::Infallible;
use std::sync::Arc;

use airlock_api::v1::{InstallEvent, InstallOutcome};
use airlock_packages::name::{normalize_pypi, valid_npm, valid_pypi};
use airlock_packages::{npm, pypi};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use super::http::{FetchError, cached_or_fetch, get_bounded};
use super::{FileRef, Kind, Session};

pub(super) type Body = BoxBody<Bytes, std::io::Error>;

/// Serves one guest connection until it closes.
pub async fn serve(session: Arc<Session>, stream: TcpStream) {
    let io = hyper_util::rt::TokioIo::new(stream);
    let svc = hyper::service::service_fn(move |req| {
        let s = session.clone();
        async move { Ok::<_, Infallible>(handle(&s, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .max_buf_size(64 << 10)
        .serve_connection(io, svc)
        .await;
}

pub(super) fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// A response with status, content type and body.
pub(super) fn respond(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    if let Ok(v) = ctype.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Printable ASCII only (a header value or a reason phrase).
fn header_text(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .map(|c| if c == '"' { '\'' } else { c })
        .take(400)
        .collect()
}

/// A refusal or failure: the message as reason phrase and body.
pub(super) fn fail(status: StatusCode, message: &str, npm_client: bool) -> Response<Body> {
    let text = header_text(message);
    let mut r = if npm_client {
        respond(
            status,
            "application/json",
            serde_json::json!({ "error": text }).to_string(),
        )
    } else {
        respond(
            status,
            "text/plain; charset=utf-8",
            format!("airlock: {message}\n"),
        )
    };
    if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(format!("airlock: {text}").into_bytes())
    {
        r.extensions_mut().insert(reason);
    }
    r
}

/// A refused index page, in the form the client will show.
fn refuse_index(message: &str, pip: bool) -> Response<Body> {
    if pip {
        let ctype = format!(
            "application/x-airlock-refusal; reason=\"{}\"",
            header_text(message)
        );
        let mut r = respond(
            StatusCode::OK,
            "text/plain",
            format!("airlock: {message}\n"),
        );
        if let Ok(v) = ctype.parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    } else {
        fail(StatusCode::FORBIDDEN, message, true)
    }
}

pub(super) fn event(reg: &str, kind: Kind, package: &str) -> InstallEvent {
    InstallEvent {
        registry: reg.to_owned(),
        kind: kind.as_str().to_owned(),
        package: package.to_owned(),
        ..Default::default()
    }
}

async fn handle(s: &Session, req: Request<Incoming>) -> Response<Body> {
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        return fail(
            StatusCode::METHOD_NOT_ALLOWED,
            "the package proxy only reads",
            false,
        );
    }
    let pip = req
        .headers()
        .get(hyper::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("pip/"));
    let accept = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let path = req.uri().path().to_owned();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    if let ["r", reg, rest @ ..] = parts.as_slice()
        && s.pkgs.registry(reg).is_some_and(|r| r.kind == Kind::Debian)
    {
        return super::debian::handle(s, reg, rest).await;
    }
    match parts.as_slice() {
        ["r", reg, "simple", project] | ["r", reg, "simple", project, ""] => {
            pypi_index(s, reg, project, pip, &accept).await
        }
        ["r", reg, rest @ ..] if !rest.is_empty() && !rest[0].is_empty() && rest[0] != "-" => {
            let name = percent_decode(&rest.join("/"));
            npm_packument(s, reg, &name).await
        }
        ["f", key, _filename] => file(s, key, !pip).await,
        _ => fail(
            StatusCode::NOT_FOUND,
            &format!(
                "nothing at {path}: PyPI indexes are at /r/REGISTRY/simple/PROJECT/, npm at \
                 /r/REGISTRY/NAME, Debian repositories at /r/REGISTRY/ (registries: {})",
                s.pkgs.registry_names().join(", ")
            ),
            false,
        ),
    }
}

fn percent_decode(s: &str) -> String {
    url::form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// The registry `name` of `kind`, or the answer to give.
fn registry_of<'a>(
    s: &'a Session,
    name: &str,
    kind: Kind,
) -> Result<&'a super::Registry, Box<Response<Body>>> {
    match s.pkgs.registry(name) {
        Some(r) if r.kind == kind => Ok(r),
        Some(r) => Err(Box::new(fail(
            StatusCode::NOT_FOUND,
            &format!("registry {name} is a {} registry", r.kind.as_str()),
            kind == Kind::Npm,
        ))),
        None => Err(Box::new(fail(
            StatusCode::NOT_FOUND,
            &format!(
                "no registry named {name} (configured: {})",
                s.pkgs.registry_names().join(", ")
            ),
            kind == Kind::Npm,
        ))),
    }
}

/// A PyPI project page (PEP 503 HTML or PEP 691 JSON, as `accept` asks), its files pointing
/// at this proxy; a refused project is answered as `refuse_index` does.
async fn pypi_index(
    s: &Session,
    reg: &str,
    project: &str,
    pip: bool,
    accept: &str,
) -> Response<Body> {
    let registry = match registry_of(s, reg, Kind::Pypi) {
        Ok(r) => r.clone(),
        Err(r) => return *r,
    };
    if !valid_pypi(project) {
        return fail(
            StatusCode::NOT_FOUND,
            &format!("{project:?} is not a project name"),
            false,
        );
    }
    let name = normalize_pypi(project);
    let mut ev = event(reg, Kind::Pypi, &name);
    if let Err(refusal) = s.policy.package(reg, true, &name) {
        let msg = refusal.to_string();
        ev.outcome = InstallOutcome::Denied as i32;
        ev.message = msg.clone();
        s.record(ev);
        return refuse_index(&msg, pip);
    }
    let Ok(page) = registry.url.join(&format!("{name}/")) else {
        return fail(StatusCode::NOT_FOUND, "not a project name", false);
    };
    let max = s.pkgs.cfg.max_index_mib << 20;
    let (body, ctype) = match get_bounded(&s.pkgs, &page, pypi::ACCEPT, max).await {
        Ok(b) => b,
        Err(FetchError::NotFound) => {
            return fail(
                StatusCode::NOT_FOUND,
                &format!("registry {reg} has no project {name}"),
                false,
            );
        }
        Err(e) => return upstream_failed(s, ev, &e, false),
    };
    let files = match pypi::parse(&body, &ctype, &page) {
        Ok(f) => f,
        Err(e) => return upstream_failed(s, ev, &FetchError::Upstream(e.to_string()), false),
    };
    let served = serve_pypi_files(s, reg, &name, &files);
    if accept.contains(pypi::JSON_TYPE) {
        respond(
            StatusCode::OK,
            pypi::JSON_TYPE,
            pypi::render_json(&name, &served),
        )
    } else {
        respond(
            StatusCode::OK,
            "text/html; charset=utf-8",
            pypi::render_html(&name, &served),
        )
    }
}

/// Index step: the project's files with a digest, each remembered under its digest key and
/// listed with this proxy's URL for it (files without a digest are left out).
fn serve_pypi_files<'a>(
    s: &Session,
    reg: &str,
    name: &str,
    files: &'a [pypi::IndexFile],
) -> Vec<pypi::Served<'a>> {
    let mut served = Vec::with_capacity(files.len());
    for f in files {
        let Some(sha) = f.sha256.as_deref() else {
            continue;
        };
        let key = format!("sha256-{sha}");
        s.pkgs.remember(
            key.clone(),
            FileRef {
                registry: reg.to_owned(),
                kind: Kind::Pypi,
                package: name.to_owned(),
                version: pypi::version_of(&f.filename),
                filename: f.filename.clone(),
                url: f.url.clone(),
            },
        );
        served.push(pypi::Served {
            file: f,
            sha256: sha,
            url: format!("/f/{key}/{}", url_segment(&f.filename)),
        });
    }
    served
}

/// A file name as one URL path segment.
fn url_segment(name: &str) -> String {
    url::form_urlencoded::byte_serialize(name.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

async fn npm_packument(s: &Session, reg: &str, name: &str) -> Response<Body> {
    let registry = match registry_of(s, reg, Kind::Npm) {
        Ok(r) => r.clone(),
        Err(r) => return *r,
    };
    if !valid_npm(name) {
        return fail(
            StatusCode::NOT_FOUND,
            &format!("{name:?} is not a package name"),
            true,
        );
    }
    let mut ev = event(reg, Kind::Npm, name);
    if let Err(refusal) = s.policy.package(reg, false, name) {
        let msg = refusal.to_string();
        ev.outcome = InstallOutcome::Denied as i32;
        ev.message = msg.clone();
        s.record(ev);
        return fail(StatusCode::FORBIDDEN, &msg, true);
    }
    // Scoped names travel with their slash encoded.
    let Ok(page) = registry.url.join(&name.replace('/', "%2f")) else {
        return fail(StatusCode::NOT_FOUND, "not a package name", true);
    };
    let max = s.pkgs.cfg.max_index_mib << 20;
    let (body, _) = match get_bounded(&s.pkgs, &page, npm::ACCEPT, max).await {
        Ok(b) => b,
        Err(FetchError::NotFound) => {
            return fail(
                StatusCode::NOT_FOUND,
                &format!("registry {reg} has no package {name}"),
                true,
            );
        }
        Err(e) => return upstream_failed(s, ev, &e, true),
    };
    let rewritten = npm::rewrite(&body, name, &page, |t| {
        format!(
            "http://{}:{}/f/sha512-{}/{}",
            airlock_proto::GATEWAY_IPV4,
            super::PKG_PORT,
            t.sha512,
            url_segment(&t.filename)
        )
    });
    let (doc, tarballs) = match rewritten {
        Ok(r) => r,
        Err(e) => return upstream_failed(s, ev, &FetchError::Upstream(e.to_string()), true),
    };
    for t in tarballs {
        s.pkgs.remember(
            format!("sha512-{}", t.sha512),
            FileRef {
                registry: reg.to_owned(),
                kind: Kind::Npm,
                package: name.to_owned(),
                version: t.version,
                filename: t.filename,
                url: t.url,
            },
        );
    }
    respond(StatusCode::OK, "application/json", doc)
}

pub(super) fn upstream_failed(
    s: &Session,
    mut ev: InstallEvent,
    e: &FetchError,
    npm: bool,
) -> Response<Body> {
    let msg = match e {
        FetchError::Upstream(m) => format!("the registry failed: {m}"),
        FetchError::NotFound => "the registry has no such file".to_owned(),
        FetchError::TooLarge { limit, .. } => {
            format!("the registry's answer is larger than the proxy's limit of {limit} bytes")
        }
        FetchError::Mismatch { expected, got } => {
            format!("the registry's answer has digest {got}, not {expected}")
        }
    };
    ev.outcome = InstallOutcome::UpstreamError as i32;
    ev.message = msg.clone();
    s.record(ev);
    fail(StatusCode::BAD_GATEWAY, &msg, npm)
}

/// A package file by its digest key: checked against the policy and the download cap, from
/// the cache or the registry, recorded, and streamed.
pub(super) async fn file(s: &Session, key: &str, npm_client: bool) -> Response<Body> {
    let Some(r) = s.pkgs.file_ref(key) else {
        return fail(
            StatusCode::NOT_FOUND,
            &format!(
                "no file {key} was listed by an index page of this proxy (fetch the page first)"
            ),
            npm_client,
        );
    };
    let Some(blob) = s.pkgs.blob_path(key) else {
        return fail(StatusCode::NOT_FOUND, "not a digest", npm_client);
    };
    let mut ev = event(&r.registry, r.kind, &r.package);
    ev.version = r.version.clone();
    ev.file = r.filename.clone();
    if let Err(refusal) = s
        .policy
        .package(&r.registry, r.kind == Kind::Pypi, &r.package)
    {
        let msg = refusal.to_string();
        return refuse(
            s,
            ev,
            InstallOutcome::Denied,
            StatusCode::FORBIDDEN,
            msg,
            npm_client,
        );
    }
    let (found, outcome) = match fetch_file(s, key, &r).await {
        Ok(f) => f,
        Err(e) => return fetch_failed(s, ev, &r, e, npm_client),
    };
    let (size, sha256) = found;
    ev.bytes = size;
    ev.sha256 = sha256;
    if let Err(left) = s.take(size) {
        let msg = format!(
            "{} ({size} bytes) would cross the sandbox's download cap of {} bytes ({left} left)",
            r.filename, s.policy.max_download_bytes
        );
        return refuse(
            s,
            ev,
            InstallOutcome::OverCap,
            StatusCode::FORBIDDEN,
            msg,
            npm_client,
        );
    }
    let f = match tokio::fs::File::open(&blob).await {
        Ok(f) => f,
        Err(e) => {
            return upstream_failed(
                s,
                ev,
                &FetchError::Upstream(format!("the cache: {e}")),
                npm_client,
            );
        }
    };
    ev.outcome = outcome as i32;
    ev.message = match outcome {
        InstallOutcome::Fetched => format!("fetched from registry {} and verified", r.registry),
        _ => "from the cache".to_owned(),
    };
    s.record(ev);
    stream(f, size)
}

/// File step: the file's size and digest from the cache or the registry, within the smaller
/// of what is left of the sandbox's download cap and the proxy's file limit; whether it was
/// fetched or cached.
async fn fetch_file(
    s: &Session,
    key: &str,
    r: &FileRef,
) -> Result<((u64, String), InstallOutcome), FetchError> {
    let left = s.left();
    let max_file = s.pkgs.cfg.max_file_mib << 20;
    let (limit, is_cap) = if left < max_file {
        (left, true)
    } else {
        (max_file, false)
    };
    match cached_or_fetch(&s.pkgs, key, r, limit, is_cap).await {
        Ok((f, true)) => Ok((f, InstallOutcome::Fetched)),
        Ok((f, false)) => Ok((f, InstallOutcome::Cached)),
        Err(e) => Err(e),
    }
}

/// File step: the answer (and the recorded event) when [`fetch_file`] failed: over the
/// download cap, a digest that does not match the index, or the registry's failure.
fn fetch_failed(
    s: &Session,
    ev: InstallEvent,
    r: &FileRef,
    e: FetchError,
    npm_client: bool,
) -> Response<Body> {
    match e {
        FetchError::TooLarge { limit, cap: true } => {
            let msg = format!(
                "{} is larger than the {limit} bytes left of the sandbox's download cap of {} \
                 bytes",
                r.filename, s.policy.max_download_bytes
            );
            refuse(
                s,
                ev,
                InstallOutcome::OverCap,
                StatusCode::FORBIDDEN,
                msg,
                npm_client,
            )
        }
        FetchError::Mismatch { expected, got } => {
            let msg = format!(
                "{} from registry {} does not match its index: the index states {expected}, \
                 the file has {got}; refused, not cached",
                r.filename, r.registry
            );
            let outcome = InstallOutcome::HashMismatch;
            refuse(s, ev, outcome, StatusCode::BAD_GATEWAY, msg, npm_client)
        }
        e => upstream_failed(s, ev, &e, npm_client),
    }
}

/// Records `ev` with `outcome` and `msg`, and answers `msg` with `status`.
fn refuse(
    s: &Session,
    mut ev: InstallEvent,
    outcome: InstallOutcome,
    status: StatusCode,
    msg: String,
    npm_client: bool,
) -> Response<Body> {
    ev.outcome = outcome as i32;
    ev.message = msg.clone();
    s.record(ev);
    fail(status, &msg, npm_client)
}

/// A cached file's response: its bytes streamed as they are read.
pub(super) fn stream(f: tokio::fs::File, size: u64) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut f = f;
        loop {
            let mut buf = vec![0u8; 256 << 10];
            match f.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.send(Ok(Frame::data(Bytes::from(buf)))).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    break;
                }
            }
        }
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed();
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(hyper::header::CONTENT_LENGTH, size.into());
    resp
}
