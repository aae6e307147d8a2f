//! Pulling an image from an OCI or Docker registry (distribution API v2).
//!
//! oci-client parses the reference and does the authentication (anonymous, basic, or the
//! bearer-token flow a registry asks for in its `WWW-Authenticate` challenge); oci-client's and
//! oci-spec's types describe manifests, indexes and the image configuration. The fetches
//! themselves are this module's: each is capped while it streams (a manifest or configuration
//! at a few MiB, a layer at the tenant's cap) and digested on the way, because the crate reads
//! a manifest whole into memory and a registry is as untrusted as the image it serves. A tag is
//! resolved to its manifest's digest once; every later fetch is by digest, and every blob is
//! checked against its digest before it is kept. Layers are cached by digest (never by name),
//! so a moved tag never reuses an old layer, and a second image on the same base fetches only
//! what differs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::manifest::{OciDescriptor, OciImageManifest, OciManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Reference, RegistryOperation};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// Largest manifest, index or image configuration accepted.
pub const MAX_DOCUMENT_BYTES: u64 = 4 << 20;

const MANIFEST_TYPES: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.oci.image.index.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.docker.distribution.manifest.list.v2+json";

/// How a layer is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    fn of(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Self::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Self::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(Self::Zstd),
            _ => None,
        }
    }
}

/// One layer, verified and cached.
#[derive(Clone, Debug)]
pub struct Layer {
    pub digest: String,
    pub compression: Compression,
    pub path: PathBuf,
}

/// What a pull brings.
#[derive(Debug)]
pub struct Pulled {
    /// The reference as given.
    pub reference: String,
    /// The digest of the image's (platform) manifest.
    pub manifest_digest: String,
    pub config: oci_spec::image::ImageConfiguration,
    pub layers: Vec<Layer>,
    /// Bytes fetched now (not from the cache).
    pub fetched_bytes: u64,
}

/// Whether the daemon may connect to `host` port `port` for this pull (the tenant's egress
/// ceiling): `Err` says why not (the refusal the ceiling gives, as for a sandbox's policy).
pub type HostCheck = Arc<dyn Fn(&str, u16) -> crate::error::ApiResult<()> + Send + Sync>;

/// Where and how to pull.
#[derive(Clone)]
pub struct PullSpec {
    pub reference: String,
    pub username: String,
    pub password: String,
    /// Registries spoken to over plain HTTP (the operator's `insecure_registries`: `HOST:PORT`,
    /// or `HOST` for all its ports).
    pub insecure: Vec<String>,
    /// Largest layer and largest image (compressed sums), in bytes.
    pub max_layer_bytes: u64,
    pub max_image_bytes: u64,
    /// Per-request inactivity limit.
    pub read_timeout: Duration,
    /// Every host the pull is sent to besides the registry itself (a redirect's, the token
    /// realm's) must pass this.
    pub check_host: HostCheck,
}

impl std::fmt::Debug for PullSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No credentials in any log line.
        f.debug_struct("PullSpec")
            .field("reference", &self.reference)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// `url`'s host and port (its scheme's default where it names none).
fn host_port(url: &reqwest::Url) -> Option<(String, u16)> {
    Some((url.host_str()?.to_owned(), url.port_or_known_default()?))
}

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{0}")]
    Invalid(String),
    #[error("registry {registry}: {why}")]
    Registry { registry: String, why: String },
    #[error("{what} {digest}: {why}")]
    Blob {
        what: &'static str,
        digest: String,
        why: String,
    },
    #[error("the layer cache: {0}")]
    Io(#[from] std::io::Error),
}

/// The registry host of `reference` (as oci-client resolves it), checked before anything.
pub fn parse(reference: &str) -> Result<Reference, PullError> {
    let r: Reference = reference
        .parse()
        .map_err(|e| PullError::Invalid(format!("image reference {reference:?}: {e}")))?;
    if let Some(d) = r.digest()
        && !is_sha256(d)
    {
        return Err(PullError::Invalid(format!(
            "image reference {reference:?}: only sha256 digests are supported"
        )));
    }
    Ok(r)
}

/// The egress rule a pull of `reference` needs: its registry's host (a domain, or an address
/// as a /32) and port (443, or 80 for a plain-HTTP registry in `insecure`), to be checked
/// against the tenant's egress ceiling like a sandbox's.
pub fn registry_rule(
    reference: &str,
    insecure: &[String],
) -> Result<airlock_api::v1::NetworkPolicy, PullError> {
    let r = parse(reference)?;
    let registry = r.resolve_registry();
    let plain = plain_http(insecure, registry);
    let (host, port) = match registry.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (
            h,
            p.parse::<u16>()
                .map_err(|_| PullError::Invalid(format!("registry {registry:?}: a bad port")))?,
        ),
        _ => (registry, if plain { 80 } else { 443 }),
    };
    Ok(host_rule(host, port))
}

/// The egress rule of one connection to `host` (a domain, or an address as a /32 or /128)
/// port `port`.
pub fn host_rule(host: &str, port: u16) -> airlock_api::v1::NetworkPolicy {
    use airlock_api::v1::{EgressRule, NetworkPolicy, egress_rule::Target};
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let target = match bare.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(a)) => Target::Cidr(format!("{a}/32")),
        Ok(std::net::IpAddr::V6(a)) => Target::Cidr(format!("{a}/128")),
        Err(_) => Target::Domain(host.to_owned()),
    };
    NetworkPolicy {
        allow_internet: false,
        allow: vec![EgressRule {
            target: Some(target),
            ports: vec![u32::from(port)],
        }],
    }
}

/// An error and its causes, as one line (reqwest's own text leaves out why a redirect failed).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// The `realm` of a `Bearer` challenge (`Bearer realm="https://auth.example/token",...`).
fn realm_of(challenge: &str) -> Option<String> {
    let rest = challenge.trim().strip_prefix("Bearer")?.trim_start();
    let start = rest.find("realm=\"")? + "realm=\"".len();
    let end = rest[start..].find('"')?;
    Some(rest[start..start + end].to_owned())
}

/// Whether `registry` (`HOST[:PORT]`) is spoken to over plain HTTP: `insecure` names it, or
/// its host without a port (every port of that host).
fn plain_http(insecure: &[String], registry: &str) -> bool {
    let host = registry.rsplit_once(':').map_or(registry, |(h, _)| h);
    insecure.iter().any(|i| i == registry || i == host)
}

fn is_sha256(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    })
}

/// Session step: redirects are followed (5 at most) only to hosts `spec.check_host` allows.
fn redirect_policy(spec: &PullSpec) -> reqwest::redirect::Policy {
    let check = spec.check_host.clone();
    reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= 5 {
            return attempt.error("more than 5 redirects");
        }
        let url = attempt.url().clone();
        match host_port(&url).map(|(h, p)| check(&h, p)) {
            Some(Ok(())) => attempt.follow(),
            Some(Err(why)) => attempt.error(format!("a redirect to {url} is refused: {why}")),
            None => attempt.error(format!("a redirect to {url} names no host")),
        }
    })
}

/// Session step: the token realm the registry names (in its answer to `probe`) is where
/// oci-client would send the credentials: it must be within the ceiling too, checked before
/// anything is sent there.
async fn check_token_realm(
    spec: &PullSpec,
    http: &reqwest::Client,
    probe: &str,
    reg_err: &impl Fn(String) -> PullError,
) -> Result<(), PullError> {
    let answer = http
        .get(probe)
        .send()
        .await
        .map_err(|e| reg_err(format!("GET {probe}: {}", with_causes(&e))))?;
    if let Some(realm) = answer
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .and_then(realm_of)
    {
        let url = reqwest::Url::parse(&realm)
            .map_err(|e| reg_err(format!("its token realm {realm:?}: {e}")))?;
        let (host, port) = host_port(&url)
            .ok_or_else(|| reg_err(format!("its token realm {realm:?} names no host")))?;
        (spec.check_host)(&host, port)
            .map_err(|why| reg_err(format!("its token realm {realm} is refused: {why}")))?;
    }
    Ok(())
}

/// Session step: the `Authorization` header of the fetches: the bearer token if the registry
/// gave one, else the basic credentials if there are any.
fn authorization_of(token: Option<String>, auth: &RegistryAuth) -> Option<String> {
    match (token, auth) {
        (Some(t), _) => Some(format!("Bearer {t}")),
        (None, RegistryAuth::Basic(u, p)) => {
            use base64::Engine;
            let raw = format!("{u}:{p}");
            Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            ))
        }
        _ => None,
    }
}

/// One pull's connection: oci-client for authentication, reqwest for capped fetches.
struct Session {
    reference: Reference,
    base: String,
    http: reqwest::Client,
    authorization: Option<String>,
    registry: String,
}

impl Session {
    /// Opens a pull's connection to the registry `spec` names: the HTTP clients, the token
    /// realm checked against the ceiling, and the authorization to send.
    async fn open(spec: &PullSpec) -> Result<Self, PullError> {
        let reference = parse(&spec.reference)?;
        let registry = reference.resolve_registry().to_owned();
        let insecure = plain_http(&spec.insecure, &registry);
        let reg_err = |why: String| PullError::Registry {
            registry: registry.clone(),
            why,
        };
        let client = oci_client::Client::new(oci_client::client::ClientConfig {
            protocol: if insecure {
                oci_client::client::ClientProtocol::Http
            } else {
                oci_client::client::ClientProtocol::Https
            },
            read_timeout: Some(spec.read_timeout),
            connect_timeout: Some(Duration::from_secs(10)),
            ..Default::default()
        });
        let scheme = if insecure { "http" } else { "https" };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(spec.read_timeout)
            .redirect(redirect_policy(spec))
            .build()
            .map_err(|e| reg_err(format!("HTTP client: {e}")))?;
        check_token_realm(spec, &http, &format!("{scheme}://{registry}/v2/"), &reg_err).await?;
        let auth = if spec.username.is_empty() {
            RegistryAuth::Anonymous
        } else {
            RegistryAuth::Basic(spec.username.clone(), spec.password.clone())
        };
        let token = client
            .auth(&reference, &auth, RegistryOperation::Pull)
            .await
            .map_err(|e| reg_err(format!("authentication: {e}")))?;
        let authorization = authorization_of(token, &auth);
        Ok(Self {
            base: format!("{scheme}://{registry}/v2/{}", reference.repository()),
            reference,
            http,
            authorization,
            registry,
        })
    }

    fn err(&self, why: String) -> PullError {
        PullError::Registry {
            registry: self.registry.clone(),
            why,
        }
    }

    async fn get(&self, path: &str, accept: Option<&str>) -> Result<reqwest::Response, PullError> {
        let url = format!("{}/{path}", self.base);
        let mut req = self.http.get(&url);
        if let Some(a) = accept {
            req = req.header(reqwest::header::ACCEPT, a);
        }
        if let Some(a) = &self.authorization {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        let res = req
            .send()
            .await
            .map_err(|e| self.err(format!("GET {url}: {}", with_causes(&e))))?;
        let status = res.status();
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(self.err(format!(
                "GET {url}: {status}: the registry refused the credentials (or their absence)"
            )));
        }
        if !status.is_success() {
            return Err(self.err(format!("GET {url}: {status}")));
        }
        Ok(res)
    }

    /// A manifest or index by tag or digest: its bytes (at most MAX_DOCUMENT_BYTES) and digest.
    async fn manifest(&self, tag_or_digest: &str) -> Result<(Vec<u8>, String), PullError> {
        let res = self
            .get(&format!("manifests/{tag_or_digest}"), Some(MANIFEST_TYPES))
            .await?;
        let header = res
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_capped(res, MAX_DOCUMENT_BYTES)
            .await
            .map_err(|e| match e {
                ReadErr::TooLarge(cap) => PullError::Invalid(format!(
                    "manifest {tag_or_digest}: larger than {} MiB",
                    cap >> 20
                )),
                ReadErr::Io(why) => self.err(format!("manifest {tag_or_digest}: {why}")),
            })?;
        let digest = sha256_of(&body);
        let expected = if is_sha256(tag_or_digest) {
            Some(tag_or_digest.to_owned())
        } else {
            header.filter(|h| h.starts_with("sha256:"))
        };
        if let Some(e) = expected
            && e != digest
        {
            return Err(PullError::Blob {
                what: "manifest",
                digest: e,
                why: format!("its content has digest {digest}"),
            });
        }
        Ok((body, digest))
    }

    /// A small blob (the configuration), verified.
    async fn document(&self, digest: &str) -> Result<Vec<u8>, PullError> {
        let res = self.get(&format!("blobs/{digest}"), None).await?;
        let body = read_capped(res, MAX_DOCUMENT_BYTES)
            .await
            .map_err(|e| match e {
                ReadErr::TooLarge(cap) => PullError::Blob {
                    what: "image configuration",
                    digest: digest.to_owned(),
                    why: format!("larger than {} MiB", cap >> 20),
                },
                ReadErr::Io(why) => self.err(format!("image configuration {digest}: {why}")),
            })?;
        let got = sha256_of(&body);
        if got != digest {
            return Err(PullError::Blob {
                what: "image configuration",
                digest: digest.to_owned(),
                why: format!("its content has digest {got}"),
            });
        }
        Ok(body)
    }

    /// A layer into `to` (a new file), at most `cap` bytes, verified; returns its size.
    async fn layer(&self, d: &OciDescriptor, to: &Path, cap: u64) -> Result<u64, PullError> {
        let blob_err = |why: String| PullError::Blob {
            what: "layer",
            digest: d.digest.clone(),
            why,
        };
        let res = self.get(&format!("blobs/{}", d.digest), None).await?;
        let mut out = tokio::fs::File::create(to).await?;
        let mut hash = Sha256::new();
        let mut n = 0u64;
        let mut body = res.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| blob_err(format!("reading it: {e}")))?;
            n += chunk.len() as u64;
            if n > cap {
                return Err(blob_err(format!(
                    "larger than {} MiB (the cap on one layer)",
                    cap >> 20
                )));
            }
            hash.update(&chunk);
            out.write_all(&chunk).await?;
        }
        out.sync_all().await?;
        let got = format!("sha256:{}", hex(&hash.finalize()));
        if got != d.digest {
            return Err(blob_err(format!(
                "its content has digest {got}: the registry sent something else"
            )));
        }
        Ok(n)
    }
}

/// Why a capped read stopped.
enum ReadErr {
    /// The content is over the cap: the image's fault.
    TooLarge(u64),
    /// The connection failed or timed out: the registry's.
    Io(String),
}

async fn read_capped(res: reqwest::Response, cap: u64) -> Result<Vec<u8>, ReadErr> {
    if res.content_length().is_some_and(|l| l > cap) {
        return Err(ReadErr::TooLarge(cap));
    }
    let mut body = res.bytes_stream();
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ReadErr::Io(format!("reading it: {e}")))?;
        if (out.len() + chunk.len()) as u64 > cap {
            return Err(ReadErr::TooLarge(cap));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn sha256_of(b: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(b)))
}

/// Pulls `spec` into `cache` (layers as `cache/sha256/HEX`): resolves a tag to its manifest's
/// digest, an index to its linux/amd64 manifest, and fetches the configuration and every layer
/// not cached yet, each verified against its digest.
pub async fn pull(spec: &PullSpec, cache: &Path) -> Result<Pulled, PullError> {
    let s = Session::open(spec).await?;
    let (manifest, digest) = image_manifest(&s).await?;
    let config = image_config(&s, spec, &manifest).await?;
    let (layers, fetched) = fetch_layers(&s, spec, cache, &manifest).await?;
    Ok(Pulled {
        reference: spec.reference.clone(),
        manifest_digest: digest,
        config,
        layers,
        fetched_bytes: fetched,
    })
}

/// Pull step: the image manifest the reference names (through an index, its linux/amd64
/// entry) and its digest.
async fn image_manifest(s: &Session) -> Result<(OciImageManifest, String), PullError> {
    let first = s
        .reference
        .digest()
        .or(s.reference.tag())
        .unwrap_or("latest")
        .to_owned();
    let (body, digest) = s.manifest(&first).await?;
    let parsed: OciManifest = serde_json::from_slice(&body).map_err(|e| {
        PullError::Invalid(format!("manifest {first}: not a manifest or index: {e}"))
    })?;
    let index = match parsed {
        OciManifest::Image(m) => return Ok((m, digest)),
        OciManifest::ImageIndex(index) => index,
    };
    let entry = index
        .manifests
        .iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .ok_or_else(|| {
            let have: Vec<String> = index
                .manifests
                .iter()
                .filter_map(|m| m.platform.as_ref())
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .collect();
            PullError::Invalid(format!(
                "{first} is an index without a linux/amd64 image (it has {})",
                have.join(", ")
            ))
        })?;
    if !is_sha256(&entry.digest) {
        return Err(PullError::Invalid(format!(
            "index entry {:?}: not a sha256 digest",
            entry.digest
        )));
    }
    let (body, digest) = s.manifest(&entry.digest).await?;
    match serde_json::from_slice(&body) {
        Ok(OciManifest::Image(m)) => Ok((m, digest)),
        Ok(OciManifest::ImageIndex(_)) => Err(PullError::Invalid(format!(
            "{digest}: an index inside an index"
        ))),
        Err(e) => Err(PullError::Invalid(format!("manifest {digest}: {e}"))),
    }
}

/// Pull step: the image configuration the manifest names, which must be linux/amd64.
async fn image_config(
    s: &Session,
    spec: &PullSpec,
    manifest: &OciImageManifest,
) -> Result<oci_spec::image::ImageConfiguration, PullError> {
    if !is_sha256(&manifest.config.digest) {
        return Err(PullError::Invalid(
            "the manifest's config is not named by a sha256 digest".into(),
        ));
    }
    let config_bytes = s.document(&manifest.config.digest).await?;
    let config: oci_spec::image::ImageConfiguration = serde_json::from_slice(&config_bytes)
        .map_err(|e| PullError::Blob {
            what: "image configuration",
            digest: manifest.config.digest.clone(),
            why: format!("not an image configuration: {e}"),
        })?;
    let (os, arch) = (config.os().to_string(), config.architecture().to_string());
    if os != "linux" || arch != "amd64" {
        return Err(PullError::Invalid(format!(
            "{} is a {os}/{arch} image; sandboxes run linux/amd64",
            spec.reference
        )));
    }
    Ok(config)
}

/// Pull step: every layer of the manifest in `cache/sha256`, fetched unless cached, within
/// the caps on a layer and on the image; the layers and the bytes fetched.
async fn fetch_layers(
    s: &Session,
    spec: &PullSpec,
    cache: &Path,
    manifest: &OciImageManifest,
) -> Result<(Vec<Layer>, u64), PullError> {
    let dir = cache.join("sha256");
    tokio::fs::create_dir_all(&dir).await?;
    let mut layers = Vec::new();
    let (mut total, mut fetched) = (0u64, 0u64);
    for d in &manifest.layers {
        let (compression, hex) = check_layer(spec, d)?;
        let path = dir.join(hex);
        let size = match tokio::fs::metadata(&path).await {
            Ok(m) if m.is_file() => m.len(),
            _ => {
                let tmp = dir.join(format!("{hex}.part-{}", super::next()));
                let got = s.layer(d, &tmp, spec.max_layer_bytes).await;
                match got {
                    Ok(n) => {
                        tokio::fs::rename(&tmp, &path).await?;
                        fetched += n;
                        n
                    }
                    Err(e) => {
                        let _ = tokio::fs::remove_file(&tmp).await;
                        return Err(e);
                    }
                }
            }
        };
        total += size;
        if total > spec.max_image_bytes {
            return Err(PullError::Invalid(format!(
                "{} is larger than {} MiB compressed (the cap on one image)",
                spec.reference,
                spec.max_image_bytes >> 20
            )));
        }
        layers.push(Layer {
            digest: d.digest.clone(),
            compression,
            path,
        });
    }
    Ok((layers, fetched))
}

/// Layer step: what the manifest says of layer `d` before it is fetched: a tar layer this
/// daemon reads, named by a sha256 digest (its hex returned), within the cap on one layer.
fn check_layer<'d>(
    spec: &PullSpec,
    d: &'d OciDescriptor,
) -> Result<(Compression, &'d str), PullError> {
    let compression = Compression::of(&d.media_type).ok_or_else(|| PullError::Blob {
        what: "layer",
        digest: d.digest.clone(),
        why: format!(
            "media type {:?} is not a tar layer this daemon reads (tar, tar+gzip, tar+zstd)",
            d.media_type
        ),
    })?;
    let hex = d
        .digest
        .strip_prefix("sha256:")
        .filter(|_| is_sha256(&d.digest))
        .ok_or_else(|| PullError::Blob {
            what: "layer",
            digest: d.digest.clone(),
            why: "not a sha256 digest".into(),
        })?;
    let declared = u64::try_from(d.size).unwrap_or(u64::MAX);
    if declared > spec.max_layer_bytes {
        return Err(PullError::Blob {
            what: "layer",
            digest: d.digest.clone(),
            why: format!(
                "{declared} bytes, larger than {} MiB (the cap on one layer)",
                spec.max_layer_bytes >> 20
            ),
        });
    }
    Ok((compression, hex))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_realm_of_a_bearer_challenge() {
        let c = r#"Bearer realm="https://auth.example.com/token",service="registry",scope="repository:a:pull""#;
        assert_eq!(
            realm_of(c).as_deref(),
            Some("https://auth.example.com/token")
        );
        assert_eq!(realm_of(r#"Basic realm="x""#), None);
        assert_eq!(realm_of("Bearer service=\"x\""), None);
    }
}
