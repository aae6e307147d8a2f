//! The proxy's side towards the registries: bounded reads of index pages and packuments, and
//! files streamed into the cache while their digests are computed, kept only if they match.

use std::io::Write as _;
use std::path::Path;

use sha2::{Digest as _, Sha256, Sha512};

use super::guard::{self, Refused};
use super::{FileRef, Packages};

/// Why a registry's answer was not used.
#[derive(Debug)]
pub enum FetchError {
    /// Unreachable, an error status, a body cut short.
    Upstream(String),
    /// The registry has no such project or package (404).
    NotFound,
    /// Larger than `limit` bytes (`cap`: the limit was what is left of the sandbox's cap).
    TooLarge { limit: u64, cap: bool },
    /// The content's digest is not the one the index stated (what it was is not kept: told
    /// to a sandbox, it would answer guesses of what the URL serves).
    Mismatch { expected: String },
    /// The proxy would not connect there (`guard`): off the registry's hosts, a guarded
    /// address, a redirect to another host.
    Refused(Refused),
}

impl FetchError {
    /// A client's error: the guard's refusal where it was one, else the error and its causes.
    fn of(url: &url::Url, e: &reqwest::Error) -> Self {
        if let Some(r) = guard::refusal(e) {
            return Self::Refused(r);
        }
        let mut text = format!("{url}: {e}");
        let mut cause = std::error::Error::source(e);
        while let Some(c) = cause {
            text.push_str(&format!(": {c}"));
            cause = c.source();
        }
        Self::Upstream(text)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// GETs `url` with `accept` and reads at most `max` bytes of its body; returns the body and
/// its Content-Type.
pub async fn get_bounded(
    pkgs: &Packages,
    url: &url::Url,
    accept: &str,
    max: u64,
) -> Result<(Vec<u8>, String), FetchError> {
    pkgs.guard.check_literal(url).map_err(FetchError::Refused)?;
    let mut resp = pkgs
        .client
        .get(url.clone())
        .header(reqwest::header::ACCEPT, accept)
        .send()
        .await
        .map_err(|e| FetchError::of(url, &e))?;
    if resp.status() == reqwest::StatusCode::NOT_FOUND {
        return Err(FetchError::NotFound);
    }
    if !resp.status().is_success() {
        return Err(FetchError::Upstream(format!(
            "{url}: HTTP {}",
            resp.status()
        )));
    }
    if resp.content_length().is_some_and(|n| n > max) {
        return Err(FetchError::TooLarge {
            limit: max,
            cap: false,
        });
    }
    let ctype = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| FetchError::of(url, &e))? {
        if body.len() as u64 + chunk.len() as u64 > max {
            return Err(FetchError::TooLarge {
                limit: max,
                cap: false,
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, ctype))
}

/// The size and SHA-256 (hex) of the cached file of digest `key`, if it is cached.
pub fn cached(pkgs: &Packages, key: &str) -> Option<(u64, String)> {
    let blob = pkgs.blob_path(key)?;
    let size = std::fs::metadata(&blob).ok()?.len();
    let sha = match key.strip_prefix("sha256-") {
        Some(h) => h.to_owned(),
        None => std::fs::read_to_string(blob.with_extension("sha256")).ok()?,
    };
    Some((size, sha))
}

/// The cached file of digest `key`, fetched first (one fetch per digest at a time) if it is
/// not there. Returns its size and SHA-256, and whether it was fetched now.
pub async fn cached_or_fetch(
    pkgs: &Packages,
    key: &str,
    r: &FileRef,
    limit: u64,
    limit_is_cap: bool,
) -> Result<((u64, String), bool), FetchError> {
    if let Some(f) = cached(pkgs, key) {
        return Ok((f, false));
    }
    let lock = pkgs.fetch_lock(key);
    let _held = lock.lock().await;
    if let Some(f) = cached(pkgs, key) {
        return Ok((f, false));
    }
    fetch_into_cache(pkgs, key, r, limit, limit_is_cap)
        .await
        .map(|f| (f, true))
}

/// Fetches `r` into the cache as `key` (the caller knows it is not there): at most `limit` bytes, verified
/// against the digest `key` names. Returns the blob's size and SHA-256 (hex).
pub async fn fetch_into_cache(
    pkgs: &Packages,
    key: &str,
    r: &FileRef,
    limit: u64,
    limit_is_cap: bool,
) -> Result<(u64, String), FetchError> {
    let blob = pkgs
        .blob_path(key)
        .ok_or_else(|| FetchError::Upstream(format!("not a digest: {key}")))?;
    // One fetch per digest runs at a time (`fetch_lock`); the counter keeps names apart anyway.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = pkgs
        .cache
        .join("tmp")
        .join(format!("{}-{n}", key.get(..24).unwrap_or(key)));
    let result = fetch_to(pkgs, key, r, limit, limit_is_cap, &tmp).await;
    match result {
        Ok((size, sha256)) => {
            let publish = || -> std::io::Result<()> {
                if let Some(dir) = blob.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                if !key.starts_with("sha256-") {
                    std::fs::write(blob.with_extension("sha256"), &sha256)?;
                }
                std::fs::rename(&tmp, &blob)
            };
            publish().map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                FetchError::Upstream(format!("caching {}: {e}", blob.display()))
            })?;
            Ok((size, sha256))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

async fn fetch_to(
    pkgs: &Packages,
    key: &str,
    r: &FileRef,
    limit: u64,
    limit_is_cap: bool,
    tmp: &Path,
) -> Result<(u64, String), FetchError> {
    let too_large = FetchError::TooLarge {
        limit,
        cap: limit_is_cap,
    };
    let hosts = pkgs.registry(&r.registry).map_or(&[][..], |g| &g.hosts[..]);
    guard::check_link(&r.registry, hosts, &r.url).map_err(FetchError::Refused)?;
    pkgs.guard
        .check_literal(&r.url)
        .map_err(FetchError::Refused)?;
    let mut resp = pkgs
        .client
        .get(r.url.clone())
        .send()
        .await
        .map_err(|e| FetchError::of(&r.url, &e))?;
    if !resp.status().is_success() {
        return Err(FetchError::Upstream(format!(
            "{}: HTTP {}",
            r.url,
            resp.status()
        )));
    }
    if resp.content_length().is_some_and(|n| n > limit) {
        return Err(too_large);
    }
    let mut file = std::fs::File::create(tmp)
        .map_err(|e| FetchError::Upstream(format!("{}: {e}", tmp.display())))?;
    let mut s256 = Sha256::new();
    let mut s512 = key.starts_with("sha512-").then(Sha512::new);
    let mut size = 0u64;
    while let Some(chunk) = resp.chunk().await.map_err(|e| FetchError::of(&r.url, &e))? {
        size += chunk.len() as u64;
        if size > limit {
            return Err(too_large);
        }
        s256.update(&chunk);
        if let Some(h) = s512.as_mut() {
            h.update(&chunk);
        }
        file.write_all(&chunk)
            .map_err(|e| FetchError::Upstream(format!("{}: {e}", tmp.display())))?;
    }
    file.sync_all()
        .map_err(|e| FetchError::Upstream(format!("{}: {e}", tmp.display())))?;
    let sha256 = hex(&s256.finalize());
    let got = match s512 {
        Some(h) => format!("sha512-{}", hex(&h.finalize())),
        None => format!("sha256-{sha256}"),
    };
    if got != key {
        // The operator's log has it; the sandbox is not told.
        tracing::warn!("{} ({}): digest {got}, not {key}", r.url, r.registry);
        return Err(FetchError::Mismatch {
            expected: key.to_owned(),
        });
    }
    Ok((size, sha256))
}
