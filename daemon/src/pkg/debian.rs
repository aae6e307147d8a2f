//! Debian repositories through the proxy (`kind = "debian"`): apt in the guest reads
//! `/r/REGISTRY/dists/SUITE/Release`, the index files it lists and `/r/REGISTRY/pool/...`.
//!
//! The trust anchor is the registry's keyring on the host. A suite's upstream `InRelease` is
//! fetched for each request for its Release and verified by `gpgv` against that keyring (one
//! clearsigned message, a good signature with SHA-224 or stronger, signed for the suite asked
//! for); only what gpgv verified is parsed, and that verified text is what the guest gets as
//! the suite's `Release` (its `InRelease` and `Release.gpg` are not served: the guest has no key
//! to check them with, and its apt would start `apt-key` and `gpgv` for nothing, which costs
//! minutes in an emulated guest kernel). Every index file served must be listed in that verified Release (by path or by
//! apt's `by-hash`) and is cached under, and checked against, the digest listed there; every
//! `.deb` served must be listed in a `Packages` index read that way and is checked against the
//! digest the index states. A `.deb` is a package like pip's and npm's files: the sandbox's
//! policy decides by its Debian package name, its bytes count against the download cap, and it
//! goes into the install log. The guest's apt therefore trusts the proxy (the base image's
//! source is `[trusted=yes]`): the signature check that matters happens here, against keys
//! the operator chose, and the guest cannot reach another source.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::InstallOutcome;
use airlock_packages::debian::{self as deb, Release};
use hyper::{Response, StatusCode};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use super::files::listed_file;
use super::http::{FetchError, cached_or_fetch, get_bounded};
use super::respond::{Body, event, fail, respond, stream, upstream_failed};
use super::{FileRef, Kind, MAX_REFS, Packages, Registry, Session};

/// What the Debian registries' verified indexes list (all registries, all sandboxes).
#[derive(Debug, Default)]
pub(super) struct State {
    /// The last verified Release of each (registry, suite).
    releases: HashMap<(String, String), Arc<Release>>,
    /// Verified InRelease bodies by (registry, SHA-256), with their signed text: not verified
    /// twice.
    verified: HashMap<(String, String), (Arc<Release>, Arc<str>)>,
    /// What the `Packages` indexes read list, by (registry, digest key); past [`MAX_REFS`]
    /// files in all, the least recently read are forgotten first (and read again from the
    /// cache when a sandbox that read one asks for a file of it).
    listings: HashMap<(String, String), Arc<Listing>>,
    order: VecDeque<(String, String)>,
    listed: usize,
}

impl State {
    /// Whether the listing of index `key` of `reg` is in memory.
    #[cfg(test)]
    pub(super) fn holds(&self, reg: &str, key: &str) -> bool {
        self.listings
            .contains_key(&(reg.to_owned(), key.to_owned()))
    }

    fn listing(&mut self, id: &(String, String)) -> Option<Arc<Listing>> {
        let l = self.listings.get(id)?.clone();
        if let Some(at) = self.order.iter().position(|o| o == id) {
            self.order.remove(at);
        }
        self.order.push_back(id.clone());
        Some(l)
    }

    pub(super) fn keep(&mut self, id: (String, String), l: Arc<Listing>) {
        if self.listings.contains_key(&id) {
            return;
        }
        self.listed += l.len();
        self.listings.insert(id.clone(), l);
        self.order.push_back(id);
        while self.listed > MAX_REFS && self.order.len() > 1 {
            if let Some(old) = self.order.pop_front()
                && let Some(l) = self.listings.remove(&old)
            {
                self.listed -= l.len();
            }
        }
    }
}

/// The `.deb`s one verified `Packages` index lists, by `pool/...` path: the digest key it
/// states and the file.
pub(super) type Listing = HashMap<String, (String, FileRef)>;

/// A `Packages` index one sandbox read (its `apt-get update`): whose `.deb`s it may fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct IndexRead {
    pub reg: String,
    /// Its digest key, and its path as the Release lists it (which says how it is packed).
    pub key: String,
    pub path: String,
}

/// Indexes remembered per sandbox, the latest (apt reads one per suite, component and
/// architecture).
const MAX_READ: usize = 64;

/// How long gpgv may take over one InRelease.
const GPGV_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a registry's keyring is not one gpgv reads.
#[derive(Debug, thiserror::Error)]
pub(super) enum KeyringError {
    #[error("keyring {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "keyring {} is ASCII-armored; gpgv reads binary keyrings (`gpg --dearmor`)",
        .0.display()
    )]
    Armored(PathBuf),
    #[error("keyring {} is empty", .0.display())]
    Empty(PathBuf),
}

/// Why an InRelease is refused (its shape, its signature, or gpgv).
#[derive(Debug, thiserror::Error)]
enum VerifyError {
    /// Not one clearsigned message (`airlock_packages`' words).
    #[error("{0}")]
    Shape(String),
    #[error("the registry has no keyring")]
    NoKeyring,
    #[error(transparent)]
    Keyring(#[from] KeyringError),
    #[error("gpgv could not run ({0}; the host needs Debian's gpgv package)")]
    Spawn(std::io::Error),
    #[error("gpgv: no stdin")]
    NoStdin,
    #[error("gpgv took over {} s", GPGV_TIMEOUT.as_secs())]
    Timeout,
    #[error("gpgv: {0}")]
    Wait(std::io::Error),
    /// gpgv's status lines give no good signature, or a bad one (`airlock_packages`' words).
    #[error("{0}")]
    Signature(String),
    #[error("gpgv failed ({0})")]
    Failed(std::process::ExitStatus),
    #[error("the signed text is not UTF-8")]
    NotUtf8,
    #[error(transparent)]
    Release(#[from] airlock_packages::ParseError),
}

/// Why a verified `Packages` index could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum IndexError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Parse(#[from] airlock_packages::ParseError),
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

/// Checks that `path` is a keyring gpgv reads: a readable, binary OpenPGP keyring.
pub(super) fn check_keyring(path: &Path) -> Result<(), KeyringError> {
    let head = std::fs::read(path)
        .map(|b| b.get(..32).unwrap_or(&b).to_vec())
        .map_err(|source| KeyringError::Read {
            path: path.to_owned(),
            source,
        })?;
    if head.starts_with(b"-----BEGIN PGP") {
        return Err(KeyringError::Armored(path.to_owned()));
    }
    if head.is_empty() {
        return Err(KeyringError::Empty(path.to_owned()));
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Packages {
    pub(super) fn debian(&self) -> std::sync::MutexGuard<'_, State> {
        self.debian.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A request under `/r/REG/` of a Debian registry.
pub(super) async fn handle(s: &Session, reg: &str, rest: &[&str]) -> Response<Body> {
    let Some(registry) = s.pkgs.registry(reg).cloned() else {
        return fail(StatusCode::NOT_FOUND, "no such registry", false);
    };
    // Offline, or a registry beyond the sandbox's policy: nothing of it, whatever the path.
    if let Err(r) = s.policy.registry(reg) {
        return refuse(
            s,
            repo_event(reg, rest.join("/")),
            InstallOutcome::Denied,
            StatusCode::FORBIDDEN,
            &r.to_string(),
        );
    }
    match rest {
        ["dists", suite, "Release"] => release(s, reg, &registry, suite).await,
        ["dists", _, "InRelease" | "Release.gpg"] => fail(
            StatusCode::NOT_FOUND,
            "the proxy serves dists/SUITE/Release: the text of the upstream InRelease whose \
             signature it verified against the registry's keyring",
            false,
        ),
        ["dists", suite, path @ ..] if !path.is_empty() => {
            index(s, reg, &registry, suite, &path.join("/")).await
        }
        ["pool", ..] => pool(s, reg, &registry, &rest.join("/")).await,
        _ => fail(
            StatusCode::NOT_FOUND,
            &format!(
                "nothing at /r/{reg}/{}: a Debian registry serves dists/SUITE/Release (verified), \
                 the files it lists, and pool/",
                rest.join("/")
            ),
            false,
        ),
    }
}

/// The event of a request for `file` of the repository (no package yet).
fn repo_event(reg: &str, file: String) -> airlock_api::v1::InstallEvent {
    let mut ev = event(reg, Kind::Debian, "");
    ev.file = file;
    ev
}

/// Refuses with `outcome`, logging `message`.
fn refuse(
    s: &Session,
    mut ev: airlock_api::v1::InstallEvent,
    outcome: InstallOutcome,
    status: StatusCode,
    message: &str,
) -> Response<Body> {
    ev.outcome = outcome as i32;
    ev.message = message.to_owned();
    s.record(ev);
    fail(status, message, false)
}

/// A suite's Release: the verified text of its upstream InRelease.
async fn release(s: &Session, reg: &str, registry: &Registry, suite: &str) -> Response<Body> {
    let ev = repo_event(reg, format!("dists/{suite}/InRelease"));
    if !deb::valid_segment(suite) {
        return fail(StatusCode::NOT_FOUND, "not a suite name", false);
    }
    let Ok(url) = registry.url.join(&format!("dists/{suite}/InRelease")) else {
        return fail(StatusCode::NOT_FOUND, "not a suite name", false);
    };
    let max = s.pkgs.cfg.max_index_mib << 20;
    let body = match get_bounded(&s.pkgs, &url, "*/*", max).await {
        Ok((b, _)) => b,
        Err(FetchError::NotFound) => {
            return fail(
                StatusCode::NOT_FOUND,
                &format!("registry {reg} has no suite {suite} (no InRelease)"),
                false,
            );
        }
        Err(e) => return upstream_failed(s, ev, &e, false),
    };
    let (release, text) = match verified(&s.pkgs, reg, registry, &body).await {
        Ok(r) => r,
        Err(why) => {
            let msg = format!("the InRelease of {reg}/{suite} is refused: {why}");
            return refuse(
                s,
                ev,
                InstallOutcome::BadSignature,
                StatusCode::BAD_GATEWAY,
                &msg,
            );
        }
    };
    if !release.is_of(suite) {
        let msg = format!(
            "the InRelease of {reg}/{suite} is refused: it is signed for suite {:?} (codename \
             {:?}), not {suite}",
            release.suite, release.codename
        );
        return refuse(
            s,
            ev,
            InstallOutcome::BadSignature,
            StatusCode::BAD_GATEWAY,
            &msg,
        );
    }
    s.pkgs
        .debian()
        .releases
        .insert((reg.to_owned(), suite.to_owned()), release);
    respond(
        StatusCode::OK,
        "text/plain; charset=utf-8",
        bytes::Bytes::from(text.as_bytes().to_vec()),
    )
}

/// The Release an InRelease body holds, parsed and as text, once its signature is verified
/// against the registry's keyring (a body verified before is not verified again).
async fn verified(
    pkgs: &Packages,
    reg: &str,
    registry: &Registry,
    body: &[u8],
) -> Result<(Arc<Release>, Arc<str>), VerifyError> {
    deb::check_clearsigned(body).map_err(VerifyError::Shape)?;
    let id = (reg.to_owned(), hex(&Sha256::digest(body)));
    if let Some(r) = pkgs.debian().verified.get(&id) {
        return Ok(r.clone());
    }
    let keyring = registry.keyring.as_deref().ok_or(VerifyError::NoKeyring)?;
    check_keyring(keyring)?;
    let text = gpgv(&pkgs.cache.join("gnupg"), keyring, body).await?;
    let release = Arc::new(deb::parse_release(&text)?);
    let both = (release, Arc::<str>::from(text));
    let mut st = pkgs.debian();
    if st.verified.len() >= 256 {
        st.verified.clear();
    }
    st.verified.insert(id, both.clone());
    Ok(both)
}

/// Runs gpgv over a clearsigned `body`: the text it verified, if the signature is good.
async fn gpgv(home: &Path, keyring: &Path, body: &[u8]) -> Result<String, VerifyError> {
    let mut child = tokio::process::Command::new("gpgv")
        .arg("--homedir")
        .arg(home)
        .arg("--keyring")
        .arg(keyring)
        .args(["--status-fd", "2", "--output", "-", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(VerifyError::Spawn)?;
    let mut stdin = child.stdin.take().ok_or(VerifyError::NoStdin)?;
    let input = body.to_vec();
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&input).await;
        // Dropping stdin closes it: gpgv sees the end of the message.
    });
    let out = tokio::time::timeout(GPGV_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| VerifyError::Timeout)?
        .map_err(VerifyError::Wait)?;
    let _ = writer.await;
    let status = String::from_utf8_lossy(&out.stderr);
    deb::signature_verdict(&status).map_err(VerifyError::Signature)?;
    if !out.status.success() {
        // A good signature beside one by a key outside the keyring exits 2; anything else is
        // a failure the status lines did not explain.
        let unexplained = !status.contains("[GNUPG:] NO_PUBKEY");
        if unexplained {
            return Err(VerifyError::Failed(out.status));
        }
    }
    String::from_utf8(out.stdout).map_err(|_| VerifyError::NotUtf8)
}

/// An index of a suite (`dists/SUITE/PATH`: `Packages`, `Packages.gz`, ...): served only as
/// the suite's verified InRelease lists it (its SHA-256 checked), from the cache or the
/// registry; a `Packages` index read makes the `.deb`s it lists servable.
async fn index(
    s: &Session,
    reg: &str,
    registry: &Registry,
    suite: &str,
    path: &str,
) -> Response<Body> {
    let ev = repo_event(reg, format!("dists/{suite}/{path}"));
    let (key, r) = match listed_index(s, reg, registry, suite, path) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
    // Indexes are bounded by the index limit, not counted against the sandbox's cap.
    let max = s.pkgs.cfg.max_index_mib << 20;
    let (size, _) = match cached_or_fetch(&s.pkgs, &key, &r, max, false).await {
        Ok((f, _)) => f,
        Err(FetchError::Mismatch { expected }) => {
            let msg = format!(
                "dists/{suite}/{path} of registry {reg} does not match the signed InRelease \
                 (which states {expected}); refused, not cached"
            );
            return refuse(
                s,
                ev,
                InstallOutcome::HashMismatch,
                StatusCode::BAD_GATEWAY,
                &msg,
            );
        }
        Err(e) => return upstream_failed(s, ev, &e, false),
    };
    let Some(blob) = s.pkgs.blob_path(&key) else {
        return fail(StatusCode::NOT_FOUND, "not a digest", false);
    };
    let listed_path = r.filename.as_str();
    if deb::is_packages_index(listed_path) {
        let read = IndexRead {
            reg: reg.to_owned(),
            key: key.clone(),
            path: listed_path.to_owned(),
        };
        if let Err(e) = note_read(s, registry, read).await {
            return upstream_failed(
                s,
                ev,
                &FetchError::Upstream(format!("its index dists/{suite}/{listed_path}: {e}")),
                false,
            );
        }
    }
    match tokio::fs::File::open(&blob).await {
        Ok(f) => stream(f, size),
        Err(e) => upstream_failed(
            s,
            ev,
            &FetchError::Upstream(format!("the cache: {e}")),
            false,
        ),
    }
}

/// Index step: `dists/SUITE/PATH` as the suite's verified InRelease lists it (read by an
/// earlier Release request): its digest key and where to fetch it, or the answer when it is
/// not a listed path.
fn listed_index(
    s: &Session,
    reg: &str,
    registry: &Registry,
    suite: &str,
    path: &str,
) -> Result<(String, FileRef), Box<Response<Body>>> {
    let not_found = |msg: &str| Box::new(fail(StatusCode::NOT_FOUND, msg, false));
    if !deb::valid_segment(suite) || !deb::valid_path(path) {
        return Err(not_found("not a repository path"));
    }
    let release = s
        .pkgs
        .debian()
        .releases
        .get(&(reg.to_owned(), suite.to_owned()))
        .cloned();
    let Some(release) = release else {
        return Err(not_found(&format!(
            "read dists/{suite}/Release first (apt-get update does)"
        )));
    };
    let Some((listed_path, listed)) = release.lookup(path) else {
        return Err(not_found(&format!(
            "dists/{suite}/{path} is not listed in the suite's verified InRelease"
        )));
    };
    let Ok(url) = registry.url.join(&format!("dists/{suite}/{path}")) else {
        return Err(not_found("not a repository path"));
    };
    let r = FileRef {
        registry: reg.to_owned(),
        kind: Kind::Debian,
        package: String::new(),
        version: String::new(),
        filename: listed_path.to_owned(),
        url,
    };
    Ok((format!("sha256-{}", listed.sha256), r))
}

/// What a verified `Packages` index lists: from memory, or read from the cache (once, and
/// again if it was forgotten): every `.deb` with the digest, package and version it states.
async fn listing(
    pkgs: &Arc<Packages>,
    registry: &Registry,
    read: &IndexRead,
) -> Result<Arc<Listing>, IndexError> {
    let id = (read.reg.clone(), read.key.clone());
    if let Some(l) = pkgs.debian().listing(&id) {
        return Ok(l);
    }
    let blob = pkgs.blob_path(&read.key).ok_or_else(|| {
        IndexError::Io(std::io::Error::other(format!("not a digest: {}", read.key)))
    })?;
    // A compressed index may unpack to eight times the index limit (Debian's main index for
    // amd64: 9 MiB of xz, 45 MiB of text).
    let max = (pkgs.cfg.max_index_mib << 20).saturating_mul(8);
    let path = read.path.clone();
    let debs = tokio::task::spawn_blocking(move || -> Result<Vec<deb::Deb>, IndexError> {
        let packed = std::fs::read(&blob)?;
        let text = deb::decompress(&path, &packed, max)?;
        Ok(deb::parse_packages(&String::from_utf8_lossy(&text))?)
    })
    .await??;
    let mut listing = Listing::with_capacity(debs.len());
    for d in debs {
        let Ok(url) = registry.url.join(&d.filename) else {
            continue;
        };
        let filename = d.filename.rsplit('/').next().unwrap_or("").to_owned();
        let r = FileRef {
            registry: read.reg.clone(),
            kind: Kind::Debian,
            package: d.package,
            version: d.version,
            filename,
            url,
        };
        listing.insert(d.filename, (format!("sha256-{}", d.sha256), r));
    }
    let listing = Arc::new(listing);
    pkgs.debian().keep(id, listing.clone());
    Ok(listing)
}

/// Notes that `s` read index `read` (listing it first): its `.deb`s are the sandbox's to
/// fetch. The latest [`MAX_READ`] are kept.
pub(super) async fn note_read(
    s: &Session,
    registry: &Registry,
    read: IndexRead,
) -> Result<(), IndexError> {
    listing(&s.pkgs, registry, &read).await?;
    let mut reads = s.debian_reads.lock().unwrap_or_else(|e| e.into_inner());
    reads.retain(|r| *r != read);
    if reads.len() >= MAX_READ {
        reads.remove(0);
    }
    reads.push(read);
    Ok(())
}

/// The digest key and file of `pool/...` `path` of registry `reg`, if an index `s` read
/// lists it (the latest read first).
pub(super) async fn listed(
    s: &Session,
    reg: &str,
    registry: &Registry,
    path: &str,
) -> Option<(String, FileRef)> {
    let reads: Vec<IndexRead> = {
        let reads = s.debian_reads.lock().unwrap_or_else(|e| e.into_inner());
        reads
            .iter()
            .rev()
            .filter(|r| r.reg == reg)
            .cloned()
            .collect()
    };
    for read in reads {
        let Ok(listing) = listing(&s.pkgs, registry, &read).await else {
            continue;
        };
        if let Some(found) = listing.get(path) {
            return Some(found.clone());
        }
    }
    None
}

/// A `.deb` that an index this sandbox read lists.
async fn pool(s: &Session, reg: &str, registry: &Registry, path: &str) -> Response<Body> {
    if !deb::valid_path(path) {
        return fail(StatusCode::NOT_FOUND, "not a repository path", false);
    }
    if let Some((key, r)) = listed(s, reg, registry, path).await {
        return listed_file(s, &key, r, false).await;
    }
    fail(
        StatusCode::NOT_FOUND,
        &format!(
            "{path} is not listed by a Packages index this sandbox has read from registry {reg} \
             (apt-get update reads them)"
        ),
        false,
    )
}
