//! The proxy's side towards a sandbox: one guest connection served as HTTP/1.1 (hyper), each
//! request routed (PyPI and npm index pages here, Debian's layout in `debian`, files in
//! `files`), decided by the sandbox's policy, logged, and answered from the registry or the
//! cache (`respond`).
//!
//! A refusal is answered at once, never by a timeout, and its text names the rule: as the HTTP
//! reason phrase and body (what pip shows for a file, what npm shows), and, for pip's index
//! requests, as a page whose content type pip rejects with a warning that quotes it (pip logs
//! an index page's HTTP errors only at debug level, so a 403 there would surface as a bare "no
//! matching distribution").

use std::convert::Infallible;
use std::sync::Arc;

use airlock_api::v1::InstallOutcome;
use airlock_packages::name::{normalize_pypi, valid_npm, valid_pypi};
use airlock_packages::{npm, pypi};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpStream;

use super::files::file;
use super::http::{FetchError, get_bounded};
use super::respond::{Body, event, fail, refuse_index, respond, upstream_failed};
use super::{FileRef, Kind, Session};

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
        s.remember(
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
        s.remember(
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
