//! A package file by its digest key: checked against the sandbox's policy and download cap,
//! taken from the shared cache or fetched and verified, recorded in the install log, and
//! streamed (for PyPI and npm files alike, and Debian's pool files).

use airlock_api::v1::{InstallEvent, InstallOutcome};
use hyper::{Response, StatusCode};

use super::http::{FetchError, cached_or_fetch};
use super::respond::{Body, event, fail, refuse, stream, upstream_failed};
use super::{FileRef, Kind, Session};

/// A package file by its digest key: checked against the policy and the download cap, from
/// the cache or the registry, recorded, and streamed.
pub(super) async fn file(s: &Session, key: &str, npm_client: bool) -> Response<Body> {
    let Some(r) = s.file_ref(key) else {
        return fail(
            StatusCode::NOT_FOUND,
            &format!(
                "no file {key} was listed by an index page of this proxy (fetch the page first)"
            ),
            npm_client,
        );
    };
    listed_file(s, key, r, npm_client).await
}

/// A file an index listed (`r`, under digest key `key`): checked against the policy and the
/// download cap, from the cache or the registry, recorded, and streamed.
pub(super) async fn listed_file(
    s: &Session,
    key: &str,
    r: FileRef,
    npm_client: bool,
) -> Response<Body> {
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
pub(super) async fn fetch_file(
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
pub(super) fn fetch_failed(
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
        FetchError::Mismatch { expected } => {
            let msg = format!(
                "{} from registry {} does not match its index (which states {expected}); \
                 refused, not cached",
                r.filename, r.registry
            );
            let outcome = InstallOutcome::HashMismatch;
            refuse(s, ev, outcome, StatusCode::BAD_GATEWAY, msg, npm_client)
        }
        e => upstream_failed(s, ev, &e, npm_client),
    }
}
