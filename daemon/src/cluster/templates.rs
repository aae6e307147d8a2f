//! Templates everywhere: each node publishes the templates it holds with a content hash (the
//! SHA-256 of its files, its name and owner); a node asked to start a template it lacks fetches
//! it from a node that holds it — the manifest, then each file as its data extents (holes stay
//! holes) — checks every file's SHA-256 and the manifest's hash against the one published in
//! etcd, and imports it as an exported template (the same kernel and base image files are
//! required, as for any import).

use std::io::{Read as _, Seek as _};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use bytes::{Buf as _, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use sha2::{Digest as _, Sha256};
use tonic::body::Body;
use tracing::{info, warn};

use super::members::Cluster;
use super::records::{FileEntry, Manifest, TemplateEntry, content_hash, hex};
use crate::error::{ApiError, ApiResult};
use crate::templates::EXPORT_RECORD;

/// The files a template has (as `templates::import` copies them).
pub const FILES: [&str; 4] = ["state", "memory", "layer", "layer.map"];
/// The path prefix of node-to-node template requests.
pub const PATH: &str = "/airlock.cluster.v1/templates/";
/// Largest extent piece sent at once.
const PIECE: u64 = 1 << 20;
/// The largest manifest accepted.
const MAX_MANIFEST: usize = 1 << 20;

/// Why a template's manifest or file could not be received from a node.
#[derive(Debug, thiserror::Error)]
enum ReceiveError {
    /// The body could not be read (the connection, or past the limit).
    #[error("{0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// A frame of the body could not be read.
    #[error("{0}")]
    Frame(tonic::Status),
    /// The file could not be made.
    #[error("{}: {source}", .path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("an extent {at}+{len} outside a file of {size} bytes")]
    OutsideFile { at: u64, len: u64, size: u64 },
    #[error("the file ended inside an extent")]
    Truncated,
    /// The manifest or its record is not what its holder published.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

/// Block size of a file's digest.
const BLOCK: usize = 4096;

/// A file's digest: SHA-256 over the offset and bytes of each 4 KiB block that is not all
/// zeros (holes and zero blocks alike are skipped), so it names the file's content however
/// its extents lie, and only its data is read (a guest memory file is mostly holes).
fn file_sha256(path: &Path) -> std::io::Result<String> {
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut h = Sha256::new();
    h.update(len.to_be_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0;
    while pos < len {
        let Some(start) = seek(&f, pos, libc::SEEK_DATA)? else {
            break;
        };
        // Whole blocks: extents start and end on block boundaries but at the file's end.
        let start = start - start % BLOCK as u64;
        let end = seek(&f, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = start;
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            f.read_exact_at(&mut buf[..n], at)?;
            for (i, block) in buf[..n].chunks(BLOCK).enumerate() {
                if block.iter().any(|&b| b != 0) {
                    h.update((at + (i * BLOCK) as u64).to_be_bytes());
                    h.update(block);
                }
            }
            at += n as u64;
        }
        pos = end.max(start + 1);
    }
    Ok(hex(&h.finalize()))
}

/// The manifest of the template `record` in `dir` (reads every file: seconds for a large one).
pub fn manifest(record: &airlock_api::v1::Template, dir: &Path) -> std::io::Result<Manifest> {
    use prost::Message as _;
    let mut files = Vec::new();
    for name in FILES {
        let path = dir.join(name);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        files.push(FileEntry {
            name: name.to_owned(),
            size: meta.len(),
            sha256: file_sha256(&path)?,
        });
    }
    Ok(Manifest {
        hash: content_hash(&record.tenant, &record.name, &files),
        record: base64::engine::general_purpose::STANDARD.encode(record.encode_to_vec()),
        files,
    })
}

impl Cluster {
    /// Keeps the manifests of this node's templates (what its record lists) current, off the
    /// membership loop: hashing a large template takes seconds.
    pub(super) async fn keep_manifests(self: std::sync::Arc<Self>) {
        loop {
            self.refresh_manifests().await;
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
    }

    /// Where the manifest of template `id` is kept (computed once per template).
    fn manifest_file(&self, id: &str) -> PathBuf {
        self.daemon
            .data_dir
            .join("cluster")
            .join("manifests")
            .join(format!("{id}.json"))
    }

    /// Remembers `m` as the manifest of template `id` (kept on disk too).
    fn keep_manifest(&self, id: &str, m: Manifest) {
        let file = self.manifest_file(id);
        let written = file
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&file, serde_json::to_vec(&m).unwrap_or_default()));
        if let Err(e) = written {
            warn!(template = %id, "keeping its manifest: {e}");
        }
        self.manifests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_owned(), m);
    }

    /// Computes (or reads back) the manifests of templates that have none yet; forgets those
    /// of templates that are gone.
    async fn refresh_manifests(&self) {
        let templates = self.daemon.templates.list();
        let missing: Vec<_> = {
            let mut known = self.manifests.lock().unwrap_or_else(|e| e.into_inner());
            known.retain(|id, _| templates.iter().any(|t| &t.record.id == id));
            templates
                .into_iter()
                .filter(|t| !known.contains_key(&t.record.id))
                .collect()
        };
        for t in missing {
            let kept = std::fs::read(self.manifest_file(&t.record.id))
                .ok()
                .and_then(|b| serde_json::from_slice::<Manifest>(&b).ok());
            if let Some(m) = kept {
                self.manifests
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(t.record.id.clone(), m);
                continue;
            }
            let (record, dir) = (t.record.clone(), t.dir.clone());
            match tokio::task::spawn_blocking(move || manifest(&record, &dir)).await {
                Ok(Ok(m)) => self.keep_manifest(&t.record.id, m),
                Ok(Err(e)) => warn!(template = %t.record.id, "its manifest: {e}"),
                Err(e) => warn!(template = %t.record.id, "its manifest: {e}"),
            }
        }
    }

    /// Makes sure template `name` as `tenant` sees it is here: fetched from a node that holds
    /// it when this one does not. Without any node holding it the create fails as usual
    /// (TEMPLATE_NOT_FOUND).
    pub async fn ensure_template(&self, tenant: &str, name: &str) -> ApiResult<()> {
        let name = if name.is_empty() { "base" } else { name };
        let templates = &self.daemon.templates;
        if templates.find(tenant, name).is_ok() {
            return Ok(());
        }
        let _one = self.fetching.lock().await;
        if templates.find(tenant, name).is_ok() {
            return Ok(());
        }
        let owner = templates.owner_for(tenant);
        let source = self.nodes().into_iter().find_map(|n| {
            let e = n.template_for(&owner, name)?.clone();
            (n.name != self.name && !e.hash.is_empty()).then_some((n, e))
        });
        let Some((node, entry)) = source else {
            return Ok(());
        };
        let t0 = std::time::Instant::now();
        let dir = self
            .daemon
            .data_dir
            .join("fetch")
            .join(crate::ids::new_id(crate::ids::Kind::Fetch)?);
        let fetched = self.fetch(&node.address, &entry, &dir).await;
        let imported = match fetched {
            Ok(manifest) => {
                let d = dir.clone();
                let t = self.daemon.templates.clone();
                let t1 = std::time::Instant::now();
                let r = tokio::task::spawn_blocking(move || t.import_exported(&d))
                    .await
                    .map_err(|e| ApiError::Internal(format!("import task: {e}")))?;
                tracing::debug!(
                    import_ms = t1.elapsed().as_millis() as u64,
                    "fetched template imported"
                );
                r.map(|t| (t, manifest))
                    .map_err(|e| ApiError::Internal(format!("importing the fetched template: {e}")))
            }
            Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(&dir);
        if let (Some(t), manifest) = imported? {
            info!(template = %name, from = %node.name, ms = t0.elapsed().as_millis() as u64, "template fetched");
            self.keep_manifest(&t.record.id, manifest);
            self.daemon.pool.refill(&t);
        }
        Ok(())
    }

    /// Fetches `entry` from the node at `address` into `dir` (created): its files, checked,
    /// and its record as an export.
    async fn fetch(&self, address: &str, entry: &TemplateEntry, dir: &Path) -> ApiResult<Manifest> {
        let bad =
            |what: String| ApiError::Internal(format!("fetching template {}: {what}", entry.name));
        std::fs::create_dir_all(dir)?;
        let body = self
            .get(address, &format!("{PATH}{}/manifest", entry.id))
            .await?;
        let body = collect_limited(body, MAX_MANIFEST)
            .await
            .map_err(|e| bad(e.to_string()))?;
        let manifest: Manifest =
            serde_json::from_slice(&body).map_err(|e| bad(format!("its manifest: {e}")))?;
        let record = checked_record(entry, &manifest).map_err(|e| bad(e.to_string()))?;
        for f in &manifest.files {
            if !FILES.contains(&f.name.as_str()) {
                return Err(bad(format!("an unknown file {:?}", f.name)));
            }
            let body = self
                .get(address, &format!("{PATH}{}/files/{}", entry.id, f.name))
                .await?;
            let path = dir.join(&f.name);
            let t0 = std::time::Instant::now();
            receive_extents(body, &path, f.size)
                .await
                .map_err(|e| bad(e.to_string()))?;
            let received = t0.elapsed();
            let p = path.clone();
            let sum = tokio::task::spawn_blocking(move || file_sha256(&p))
                .await
                .map_err(|e| bad(e.to_string()))??;
            tracing::debug!(file = %f.name, received_ms = received.as_millis() as u64, digest_ms = (t0.elapsed() - received).as_millis() as u64, "template file fetched");
            if sum != f.sha256 {
                return Err(bad(format!("{}: SHA-256 {sum}, not {}", f.name, f.sha256)));
            }
        }
        std::fs::write(dir.join(EXPORT_RECORD), &record)?;
        Ok(manifest)
    }

    async fn get(&self, address: &str, path: &str) -> ApiResult<Body> {
        let req = http::Request::get(path)
            .body(Body::empty())
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        let resp = self
            .peers
            .send(address, req)
            .await
            .map_err(|s| ApiError::ClusterUnavailable(s.message().to_owned()))?;
        if !resp.status().is_success() {
            return Err(ApiError::Internal(format!(
                "node {address} answered {} for {path}",
                resp.status()
            )));
        }
        Ok(resp.into_body())
    }

    /// Serves a node-to-node template request (`PATH` + `ID/manifest` or `ID/files/NAME`).
    pub(super) fn serve_template(&self, rest: &str) -> http::Response<Body> {
        let status = |code: http::StatusCode, text: String| {
            let mut r =
                http::Response::new(Body::new(http_body_util::Full::new(Bytes::from(text))));
            *r.status_mut() = code;
            r
        };
        let (id, what) = rest.split_once('/').unwrap_or((rest, ""));
        let Some(t) = self.daemon.templates.by_id(id) else {
            return status(http::StatusCode::NOT_FOUND, format!("no template {id}"));
        };
        if what == "manifest" {
            let m = self
                .manifests
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(id)
                .cloned();
            return match m {
                Some(m) => status(
                    http::StatusCode::OK,
                    serde_json::to_string(&m).unwrap_or_default(),
                ),
                None => status(
                    http::StatusCode::SERVICE_UNAVAILABLE,
                    "no manifest yet".into(),
                ),
            };
        }
        let Some(name) = what.strip_prefix("files/").filter(|n| FILES.contains(n)) else {
            return status(http::StatusCode::NOT_FOUND, format!("no {what}"));
        };
        let path = t.dir.join(name);
        let (tx, rx) =
            tokio::sync::mpsc::channel::<Result<http_body::Frame<Bytes>, std::io::Error>>(4);
        tokio::task::spawn_blocking(move || {
            if let Err(e) = send_extents(&path, &tx) {
                let _ = tx.blocking_send(Err(e));
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        http::Response::new(Body::new(http_body_util::StreamBody::new(stream)))
    }
}

/// The record (`Template`, protobuf) of `manifest`, served for `entry`: refused unless it is
/// the template of `entry`'s owner and name and its content hash is the one `entry` publishes.
fn checked_record(entry: &TemplateEntry, manifest: &Manifest) -> Result<Vec<u8>, ReceiveError> {
    let refused = ReceiveError::Refused;
    let record = base64::engine::general_purpose::STANDARD
        .decode(&manifest.record)
        .map_err(|e| refused(format!("its record: {e}")))?;
    let decoded = <airlock_api::v1::Template as prost::Message>::decode(record.as_slice())
        .map_err(|e| refused(format!("its record: {e}")))?;
    // The hash binds the owner and name the record claims; they must be the entry's, the
    // template asked for (else it would be imported as another tenant's, or as shared).
    let reference = crate::templates::reference(&decoded);
    if decoded.tenant != entry.owner || reference != entry.name {
        return Err(refused(format!(
            "its record is {:?}'s {reference:?}, not the template asked for ({:?}'s {:?})",
            decoded.tenant, entry.owner, entry.name
        )));
    }
    let hash = content_hash(&decoded.tenant, &decoded.name, &manifest.files);
    if hash != manifest.hash || hash != entry.hash {
        return Err(refused(format!(
            "its manifest's hash {hash} is not the one published, {}",
            entry.hash
        )));
    }
    Ok(record)
}

/// Reads at most `limit` bytes of `body`.
async fn collect_limited(body: Body, limit: usize) -> Result<Bytes, ReceiveError> {
    let limited = http_body_util::Limited::new(body, limit);
    limited
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(ReceiveError::Body)
}

/// `lseek(2)` with `whence`; `None` past the end.
fn seek(f: &std::fs::File, pos: u64, whence: i32) -> std::io::Result<Option<u64>> {
    let off = libc::off_t::try_from(pos).map_err(std::io::Error::other)?;
    // SAFETY: lseek(2) on a descriptor this function borrows; no memory is passed.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off, whence) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(r as u64))
}

/// Sends the data extents of `path` as `[offset u64][length u64][bytes]` pieces.
fn send_extents(
    path: &Path,
    tx: &tokio::sync::mpsc::Sender<Result<http_body::Frame<Bytes>, std::io::Error>>,
) -> std::io::Result<()> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut pos = 0;
    while pos < len {
        let Some(start) = seek(&f, pos, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(&f, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = start;
        while at < end {
            let n = (end - at).min(PIECE);
            let mut piece = BytesMut::with_capacity(16 + n as usize);
            piece.extend_from_slice(&at.to_be_bytes());
            piece.extend_from_slice(&n.to_be_bytes());
            piece.resize(16 + n as usize, 0);
            f.seek(std::io::SeekFrom::Start(at))?;
            f.read_exact(&mut piece[16..])?;
            if tx
                .blocking_send(Ok(http_body::Frame::data(piece.freeze())))
                .is_err()
            {
                return Ok(()); // the receiver left
            }
            at += n;
        }
        pos = end;
    }
    Ok(())
}

/// Writes the extents of `body` into a new sparse file `path` of `size` bytes; every extent
/// must lie inside it.
async fn receive_extents(body: Body, path: &PathBuf, size: u64) -> Result<(), ReceiveError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|source| ReceiveError::Create {
            path: path.clone(),
            source,
        })?;
    file.set_len(size)?;
    let mut body = body;
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(ReceiveError::Frame)?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
        }
        while buf.len() >= 16 {
            let at = u64::from_be_bytes(buf[..8].try_into().unwrap_or_default());
            let n = u64::from_be_bytes(buf[8..16].try_into().unwrap_or_default());
            if n > PIECE || at.checked_add(n).is_none_or(|end| end > size) {
                return Err(ReceiveError::OutsideFile { at, len: n, size });
            }
            let need = 16 + n as usize;
            if buf.len() < need {
                break;
            }
            file.write_all_at(&buf[16..need], at)?;
            buf.advance(need);
        }
    }
    if !buf.is_empty() {
        return Err(ReceiveError::Truncated);
    }
    // Writes went to the page cache; the flush may wait on the disk: off the runtime.
    tokio::task::spawn_blocking(move || file.sync_all()).await??;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn file(name: &str, len: u64, writes: &[(u64, &[u8])]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("airlock-digest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(len).unwrap();
        for (at, bytes) in writes {
            f.write_all_at(bytes, *at).unwrap();
        }
        p
    }

    fn served(tenant: &str, name: &str, tag: &str) -> Manifest {
        use prost::Message as _;
        let record = airlock_api::v1::Template {
            tenant: tenant.into(),
            name: name.into(),
            tag: tag.into(),
            ..Default::default()
        };
        let files = vec![FileEntry {
            name: "state".into(),
            size: 1,
            sha256: "00".into(),
        }];
        Manifest {
            hash: content_hash(tenant, name, &files),
            record: base64::engine::general_purpose::STANDARD.encode(record.encode_to_vec()),
            files,
        }
    }

    fn wanted(owner: &str, name: &str, hash: &str) -> TemplateEntry {
        TemplateEntry {
            owner: owner.into(),
            name: name.into(),
            id: "tpl-1".into(),
            hash: hash.into(),
            memory_mib: 128,
        }
    }

    /// Issue 37, item 3: a template fetched for tenant alice's `py` must be alice's `py`,
    /// even when the node serving it publishes the hash of another tenant's template under
    /// that entry (its record would be imported as that tenant's, or as a shared one).
    #[test]
    fn a_fetched_template_is_the_owner_and_name_asked_for() {
        let own = served("alice", "py", "");
        assert!(checked_record(&wanted("alice", "py", &own.hash), &own).is_ok());
        let tagged = served("alice", "py", "v2");
        assert!(checked_record(&wanted("alice", "py:v2", &tagged.hash), &tagged).is_ok());
        for (m, entry) in [
            (served("bob", "py", ""), ("alice", "py")),
            (served("", "py", ""), ("alice", "py")),
            (served("alice", "py", ""), ("", "py")),
            (served("alice", "other", ""), ("alice", "py")),
            (served("alice", "py", "v1"), ("alice", "py:v2")),
            (served("alice", "py", "v1"), ("alice", "py")),
        ] {
            let e = wanted(entry.0, entry.1, &m.hash);
            let err = checked_record(&e, &m).unwrap_err().to_string();
            assert!(
                err.contains("not the template asked for"),
                "{entry:?}: {err}"
            );
        }
        // The published hash still binds the files.
        let mut other = served("alice", "py", "");
        let published = other.hash.clone();
        other.files[0].sha256 = "11".into();
        other.hash = content_hash("alice", "py", &other.files);
        assert!(checked_record(&wanted("alice", "py", &published), &other).is_err());
    }

    #[test]
    fn a_digest_names_the_content_whether_zeros_are_holes_or_written() {
        let len = 1 << 20;
        let sparse = file("sparse", len, &[(8192, b"data")]);
        let zeros = vec![0u8; 16384];
        let dense = file("dense", len, &[(0, &zeros), (8192, b"data")]);
        let other = file("other", len, &[(8192, b"dat!")]);
        let longer = file("longer", len + 4096, &[(8192, b"data")]);
        let a = file_sha256(&sparse).unwrap();
        assert_eq!(a, file_sha256(&dense).unwrap());
        assert_ne!(a, file_sha256(&other).unwrap());
        assert_ne!(a, file_sha256(&longer).unwrap());
    }

    #[tokio::test]
    async fn extents_sent_are_written_back_with_the_same_digest_and_bad_ones_refused() {
        let len = 3 << 20;
        let src = file("src", len, &[(4096, b"one"), (2 << 20, b"two")]);
        let (tx, mut rx) = tokio::sync::mpsc::channel(64);
        let s = src.clone();
        tokio::task::spawn_blocking(move || send_extents(&s, &tx).unwrap())
            .await
            .unwrap();
        let mut body = Vec::new();
        while let Some(Ok(frame)) = rx.recv().await {
            body.extend_from_slice(&frame.into_data().unwrap());
        }
        let dst = src.with_file_name("dst");
        let _ = std::fs::remove_file(&dst);
        let full = |b: Vec<u8>| Body::new(http_body_util::Full::new(Bytes::from(b)));
        receive_extents(full(body.clone()), &dst, len)
            .await
            .unwrap();
        assert_eq!(file_sha256(&src).unwrap(), file_sha256(&dst).unwrap());
        // An extent past the declared size, and a cut one, are refused.
        let bad = src.with_file_name("bad");
        let _ = std::fs::remove_file(&bad);
        let err = receive_extents(full(body.clone()), &bad, 4096)
            .await
            .unwrap_err();
        assert!(matches!(err, ReceiveError::OutsideFile { .. }), "{err}");
        let _ = std::fs::remove_file(&bad);
        let cut = body[..body.len() - 1].to_vec();
        let err = receive_extents(full(cut), &bad, len).await.unwrap_err();
        assert!(matches!(err, ReceiveError::Truncated), "{err}");
    }
}
