//! OCI image layouts built by the tests themselves, without network: layers described in Rust
//! (files, directories, links, whiteouts, devices and raw, hostile tar headers), compressed with
//! gzip, zstd or not at all, an image config and manifest, and optionally an image index of
//! several platforms, written as an OCI image layout directory (`oci-layout`, `index.json`,
//! `blobs/sha256/...`) that `skopeo copy oci:DIR:TAG ...` pushes to a registry
//! (`images/registry.rs`). [`busybox_image`] is a small image that runs: the host's static
//! busybox with its applet links, and an unprivileged `app` account (1234:1234).
#![allow(dead_code)] // each test binary uses a part of it

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const MEDIA_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const MEDIA_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// The annotation of `index.json` that names a tag (`oci:DIR:TAG`).
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The modification time of every entry: layers are reproducible.
pub const MTIME: u64 = 1_700_000_000;
/// The host's statically linked busybox (Debian's busybox-static).
pub const HOST_BUSYBOX: &str = "/usr/bin/busybox";
/// The links to busybox in [`busybox_layer`], under `/bin`.
pub const BUSYBOX_APPLETS: &[&str] = &[
    "sh", "ls", "cat", "echo", "id", "env", "pwd", "test", "mkdir", "rm",
];
/// The unprivileged account of [`accounts_layer`].
pub const APP_UID: u64 = 1234;

/// `sha256:HEX` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a layer's tar is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The layer media type.
    pub fn media_type(self) -> &'static str {
        match self {
            Compression::None => MEDIA_LAYER_TAR,
            Compression::Gzip => MEDIA_LAYER_GZIP,
            Compression::Zstd => MEDIA_LAYER_ZSTD,
        }
    }

    /// `data` compressed.
    pub fn compress(self, data: &[u8]) -> Vec<u8> {
        match self {
            Compression::None => data.to_vec(),
            Compression::Gzip => {
                let mut enc =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                enc.write_all(data).expect("gzip");
                enc.finish().expect("gzip")
            }
            Compression::Zstd => zstd::encode_all(data, 3).expect("zstd"),
        }
    }
}

/// One tar entry of a [`Layer`]. Paths are relative to the image's root; a leading `/` is
/// dropped (except in [`Entry::Raw`], written as given).
#[derive(Debug, Clone)]
pub enum Entry {
    File {
        path: String,
        data: Vec<u8>,
        mode: u32,
        uid: u64,
        gid: u64,
    },
    Dir {
        path: String,
        mode: u32,
        uid: u64,
        gid: u64,
    },
    /// `path` → `target` (kept as given: absolute or with `..` too).
    Symlink { path: String, target: String },
    /// A hard link at `path` to the earlier entry `target`.
    Hardlink { path: String, target: String },
    /// Deletes `path` of the lower layers: `DIR/.wh.NAME`.
    Whiteout { path: String },
    /// Hides the lower layers' contents of `dir`: `DIR/.wh..wh..opq`.
    Opaque { dir: String },
    CharDevice {
        path: String,
        major: u32,
        minor: u32,
        mode: u32,
    },
    /// A header written byte for byte: `name` and `link_name` are not checked at all
    /// (`../escape`, `/etc/evil`, `a/../../b`), at most 100 bytes each.
    Raw {
        name: Vec<u8>,
        kind: tar::EntryType,
        link_name: Vec<u8>,
        data: Vec<u8>,
        mode: u32,
    },
}

/// One layer: its entries in order and its compression.
#[derive(Debug, Clone)]
pub struct Layer {
    pub entries: Vec<Entry>,
    pub compression: Compression,
}

fn rel(path: &str) -> String {
    path.trim_start_matches('/').to_string()
}

fn split_parent(path: &str) -> (String, String) {
    let path = rel(path);
    let path = path.trim_end_matches('/');
    match path.rsplit_once('/') {
        Some((dir, name)) => (format!("{dir}/"), name.to_string()),
        None => (String::new(), path.to_string()),
    }
}

impl Layer {
    /// An empty layer.
    pub fn new(compression: Compression) -> Self {
        Self {
            entries: Vec::new(),
            compression,
        }
    }

    /// Adds `entry`.
    pub fn entry(mut self, entry: Entry) -> Self {
        self.entries.push(entry);
        self
    }

    /// A regular file, 0644, root's.
    pub fn file(self, path: &str, data: impl Into<Vec<u8>>) -> Self {
        self.file_with(path, data, 0o644, 0, 0)
    }

    /// A regular file with its mode and owner.
    pub fn file_with(
        self,
        path: &str,
        data: impl Into<Vec<u8>>,
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> Self {
        self.entry(Entry::File {
            path: rel(path),
            data: data.into(),
            mode,
            uid,
            gid,
        })
    }

    /// A directory, 0755, root's.
    pub fn dir(self, path: &str) -> Self {
        self.dir_with(path, 0o755, 0, 0)
    }

    /// A directory with its mode and owner.
    pub fn dir_with(self, path: &str, mode: u32, uid: u64, gid: u64) -> Self {
        self.entry(Entry::Dir {
            path: rel(path),
            mode,
            uid,
            gid,
        })
    }

    /// A symbolic link `path` → `target`.
    pub fn symlink(self, path: &str, target: &str) -> Self {
        self.entry(Entry::Symlink {
            path: rel(path),
            target: target.to_string(),
        })
    }

    /// A hard link `path` to `target` (a path of the image).
    pub fn hardlink(self, path: &str, target: &str) -> Self {
        self.entry(Entry::Hardlink {
            path: rel(path),
            target: rel(target),
        })
    }

    /// A whiteout of `path`.
    pub fn whiteout(self, path: &str) -> Self {
        self.entry(Entry::Whiteout { path: rel(path) })
    }

    /// An opaque marker in `dir`.
    pub fn opaque(self, dir: &str) -> Self {
        self.entry(Entry::Opaque { dir: rel(dir) })
    }

    /// A character device node, 0666.
    pub fn char_device(self, path: &str, major: u32, minor: u32) -> Self {
        self.entry(Entry::CharDevice {
            path: rel(path),
            major,
            minor,
            mode: 0o666,
        })
    }

    /// A regular file whose header name is `name`, byte for byte.
    pub fn raw_file(self, name: &[u8], data: impl Into<Vec<u8>>) -> Self {
        self.entry(Entry::Raw {
            name: name.to_vec(),
            kind: tar::EntryType::Regular,
            link_name: Vec::new(),
            data: data.into(),
            mode: 0o644,
        })
    }

    /// A link (`kind`: `Symlink` or `Link`) whose name and target are written byte for byte.
    pub fn raw_link(self, name: &[u8], kind: tar::EntryType, target: &[u8]) -> Self {
        self.entry(Entry::Raw {
            name: name.to_vec(),
            kind,
            link_name: target.to_vec(),
            data: Vec::new(),
            mode: 0o777,
        })
    }

    /// The uncompressed tar.
    pub fn tar(&self) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for entry in &self.entries {
            append(&mut b, entry);
        }
        b.into_inner().expect("finish tar")
    }
}

fn header(kind: tar::EntryType, mode: u32, uid: u64, gid: u64, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(gid);
    h.set_size(size);
    h.set_mtime(MTIME);
    h
}

fn append(b: &mut tar::Builder<Vec<u8>>, entry: &Entry) {
    use tar::EntryType as T;
    let res = match entry {
        Entry::File {
            path,
            data,
            mode,
            uid,
            gid,
        } => {
            let mut h = header(T::Regular, *mode, *uid, *gid, data.len() as u64);
            b.append_data(&mut h, path, data.as_slice())
        }
        Entry::Dir {
            path,
            mode,
            uid,
            gid,
        } => {
            let mut h = header(T::Directory, *mode, *uid, *gid, 0);
            let path = format!("{}/", path.trim_end_matches('/'));
            b.append_data(&mut h, path, std::io::empty())
        }
        Entry::Symlink { path, target } => {
            let mut h = header(T::Symlink, 0o777, 0, 0, 0);
            b.append_link(&mut h, path, target)
        }
        Entry::Hardlink { path, target } => {
            let mut h = header(T::Link, 0o644, 0, 0, 0);
            b.append_link(&mut h, path, target)
        }
        Entry::Whiteout { path } => {
            let (dir, name) = split_parent(path);
            let mut h = header(T::Regular, 0o644, 0, 0, 0);
            b.append_data(&mut h, format!("{dir}.wh.{name}"), std::io::empty())
        }
        Entry::Opaque { dir } => {
            let dir = dir.trim_end_matches('/');
            let name = if dir.is_empty() {
                ".wh..wh..opq".to_string()
            } else {
                format!("{dir}/.wh..wh..opq")
            };
            let mut h = header(T::Regular, 0o644, 0, 0, 0);
            b.append_data(&mut h, name, std::io::empty())
        }
        Entry::CharDevice {
            path,
            major,
            minor,
            mode,
        } => {
            let mut h = header(T::Char, *mode, 0, 0, 0);
            h.set_device_major(*major).expect("device major");
            h.set_device_minor(*minor).expect("device minor");
            b.append_data(&mut h, path, std::io::empty())
        }
        Entry::Raw {
            name,
            kind,
            link_name,
            data,
            mode,
        } => {
            let mut h = header(*kind, *mode, 0, 0, data.len() as u64);
            let old = h.as_old_mut();
            assert!(name.len() <= old.name.len(), "raw name over 100 bytes");
            assert!(
                link_name.len() <= old.linkname.len(),
                "raw link over 100 bytes"
            );
            old.name = [0; 100];
            old.name[..name.len()].copy_from_slice(name);
            old.linkname = [0; 100];
            old.linkname[..link_name.len()].copy_from_slice(link_name);
            h.set_cksum();
            b.append(&h, data.as_slice())
        }
    };
    res.unwrap_or_else(|e| panic!("tar entry {entry:?}: {e}"));
}

/// The runtime settings of an image config (`config` of the OCI image config).
#[derive(Debug, Clone, Default)]
pub struct ImageConfig {
    pub architecture: String,
    pub os: String,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Option<Vec<String>>,
    pub cmd: Option<Vec<String>>,
}

impl ImageConfig {
    /// linux/amd64 with `PATH` set and nothing else.
    pub fn amd64() -> Self {
        Self {
            architecture: "amd64".into(),
            os: "linux".into(),
            env: vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()],
            ..Self::default()
        }
    }
}

/// An image: its layers, lowest first, and its config.
#[derive(Debug, Clone)]
pub struct Image {
    pub layers: Vec<Layer>,
    pub config: ImageConfig,
}

/// A content descriptor (`mediaType`, `digest`, `size`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
}

impl Descriptor {
    /// The descriptor as JSON.
    pub fn json(&self) -> Value {
        json!({"mediaType": self.media_type, "digest": self.digest, "size": self.size})
    }

    /// The hex of the digest (after `sha256:`).
    pub fn hex(&self) -> &str {
        self.digest.trim_start_matches("sha256:")
    }
}

/// What [`Layout::add_image`] wrote.
#[derive(Debug, Clone)]
pub struct ImageDigests {
    /// The manifest.
    pub manifest: Descriptor,
    /// The config blob.
    pub config: Descriptor,
    /// Each layer's blob, as stored (compressed), lowest first.
    pub layers: Vec<Descriptor>,
    /// Each layer's uncompressed tar digest (`rootfs.diff_ids`).
    pub diff_ids: Vec<String>,
    /// The config's platform.
    pub platform: Platform,
}

/// An image index's platform entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    pub variant: Option<String>,
}

impl Platform {
    pub fn new(os: &str, architecture: &str) -> Self {
        Self {
            architecture: architecture.into(),
            os: os.into(),
            variant: None,
        }
    }

    fn json(&self) -> Value {
        let mut v = json!({"architecture": self.architecture, "os": self.os});
        if let Some(variant) = &self.variant {
            v["variant"] = json!(variant);
        }
        v
    }
}

/// What [`Layout::add_index`] wrote.
#[derive(Debug, Clone)]
pub struct IndexDigests {
    /// The image index.
    pub index: Descriptor,
    /// Its images, in its order.
    pub images: Vec<ImageDigests>,
}

/// An OCI image layout directory being written.
#[derive(Debug)]
pub struct Layout {
    dir: PathBuf,
    /// The entries of `index.json`: (descriptor with its annotations).
    tags: Vec<Value>,
}

impl Layout {
    /// Creates the layout in `dir` (made if missing): `oci-layout`, `blobs/sha256`, and an
    /// empty `index.json`.
    pub fn create(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).expect("create layout dir");
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("write oci-layout");
        let layout = Self {
            dir: dir.to_path_buf(),
            tags: Vec::new(),
        };
        layout.write_index_json();
        layout
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of a blob.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// Stores `data` as a blob and describes it.
    pub fn add_blob(&self, media_type: &str, data: &[u8]) -> Descriptor {
        let digest = sha256_digest(data);
        std::fs::write(self.blob_path(&digest), data).expect("write blob");
        Descriptor {
            media_type: media_type.into(),
            digest,
            size: data.len() as u64,
        }
    }

    /// Writes the layers, config and manifest of `image`.
    pub fn add_image(&self, image: &Image) -> ImageDigests {
        let mut layers = Vec::new();
        let mut diff_ids = Vec::new();
        for layer in &image.layers {
            let tar = layer.tar();
            diff_ids.push(sha256_digest(&tar));
            let blob = layer.compression.compress(&tar);
            layers.push(self.add_blob(layer.compression.media_type(), &blob));
        }
        let c = &image.config;
        let mut runtime = json!({"Env": c.env});
        if let Some(v) = &c.working_dir {
            runtime["WorkingDir"] = json!(v);
        }
        if let Some(v) = &c.user {
            runtime["User"] = json!(v);
        }
        if let Some(v) = &c.entrypoint {
            runtime["Entrypoint"] = json!(v);
        }
        if let Some(v) = &c.cmd {
            runtime["Cmd"] = json!(v);
        }
        let config = json!({
            "created": "2023-11-14T22:13:20Z",
            "architecture": c.architecture,
            "os": c.os,
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": image.layers.iter().map(|_| json!({"created_by": "airlock tests"})).collect::<Vec<_>>(),
        });
        let config = self.add_blob(MEDIA_CONFIG, &serde_json::to_vec(&config).expect("json"));
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config.json(),
            "layers": layers.iter().map(Descriptor::json).collect::<Vec<_>>(),
        });
        let manifest = self.add_blob(
            MEDIA_MANIFEST,
            &serde_json::to_vec(&manifest).expect("json"),
        );
        ImageDigests {
            manifest,
            config,
            layers,
            diff_ids,
            platform: Platform {
                architecture: c.architecture.clone(),
                os: c.os.clone(),
                variant: None,
            },
        }
    }

    /// Writes an image index of `images` (each with its config's platform).
    pub fn add_index(&self, images: &[ImageDigests]) -> IndexDigests {
        let index = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": images.iter().map(|i| {
                let mut d = i.manifest.json();
                d["platform"] = i.platform.json();
                d
            }).collect::<Vec<_>>(),
        });
        let index = self.add_blob(MEDIA_INDEX, &serde_json::to_vec(&index).expect("json"));
        IndexDigests {
            index,
            images: images.to_vec(),
        }
    }

    /// Names `descriptor` (a manifest or an index) `tag` in `index.json`: `oci:DIR:TAG`.
    pub fn tag(&mut self, tag: &str, descriptor: &Descriptor) {
        self.tags.retain(|t| t["annotations"][REF_NAME] != tag);
        let mut d = descriptor.json();
        d["annotations"] = json!({ REF_NAME: tag });
        self.tags.push(d);
        self.write_index_json();
    }

    fn write_index_json(&self) {
        let index = json!({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": self.tags});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).expect("json"),
        )
        .expect("write index.json");
    }
}

/// Writes `image` to a new layout in `dir`, tagged `tag`.
pub fn write_image(dir: &Path, tag: &str, image: &Image) -> ImageDigests {
    let mut layout = Layout::create(dir);
    let digests = layout.add_image(image);
    layout.tag(tag, &digests.manifest);
    digests
}

/// Writes `images` and an index of them to a new layout in `dir`, the index tagged `tag`.
pub fn write_index(dir: &Path, tag: &str, images: &[Image]) -> IndexDigests {
    let mut layout = Layout::create(dir);
    let written: Vec<_> = images.iter().map(|i| layout.add_image(i)).collect();
    let index = layout.add_index(&written);
    layout.tag(tag, &index.index);
    index
}

/// `/bin/busybox` (the host's static busybox) and `/bin/APPLET` → `busybox` for each of
/// [`BUSYBOX_APPLETS`].
pub fn busybox_layer(compression: Compression) -> Layer {
    let busybox = std::fs::read(HOST_BUSYBOX).unwrap_or_else(|e| {
        panic!("{HOST_BUSYBOX}: {e} (the static busybox: scripts/install-deps.sh installs busybox-static)")
    });
    let mut layer =
        Layer::new(compression)
            .dir("bin")
            .file_with("bin/busybox", busybox, 0o755, 0, 0);
    for applet in BUSYBOX_APPLETS {
        layer = layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    layer
}

/// `/etc/passwd` and `/etc/group` with root and `app` (1234:1234, home `/home/app`, its own),
/// and `/tmp`.
pub fn accounts_layer(compression: Compression) -> Layer {
    Layer::new(compression)
        .dir("etc")
        .file(
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\napp:x:1234:1234::/home/app:/bin/sh\n",
        )
        .file("etc/group", "root:x:0:\napp:x:1234:\n")
        .dir("home")
        .dir_with("home/app", 0o755, APP_UID, APP_UID)
        .dir_with("tmp", 0o1777, 0, 0)
        .dir_with("root", 0o700, 0, 0)
}

/// The busybox image: [`busybox_layer`] (gzip) and [`accounts_layer`] (zstd), linux/amd64,
/// `PATH` set, `Cmd` `["/bin/sh"]`.
pub fn busybox_image() -> Image {
    Image {
        layers: vec![
            busybox_layer(Compression::Gzip),
            accounts_layer(Compression::Zstd),
        ],
        config: ImageConfig {
            cmd: Some(vec!["/bin/sh".into()]),
            ..ImageConfig::amd64()
        },
    }
}

/// A small image for another platform (one file, `/platform`, naming it), for indexes where
/// a client must pick the right entry.
pub fn other_platform_image(os: &str, architecture: &str) -> Image {
    Image {
        layers: vec![
            Layer::new(Compression::Gzip).file("platform", format!("{os}/{architecture}\n")),
        ],
        config: ImageConfig {
            architecture: architecture.into(),
            os: os.into(),
            cmd: Some(vec!["/bin/sh".into()]),
            ..ImageConfig::default()
        },
    }
}

/// Each entry's raw header name (as stored, a GNU long name included) of an uncompressed tar.
pub fn tar_names(tar: &[u8]) -> Vec<Vec<u8>> {
    let mut archive = tar::Archive::new(tar);
    archive
        .entries()
        .expect("tar entries")
        .map(|e| e.expect("tar entry").path_bytes().into_owned())
        .collect()
}

/// An uncompressed tar of a layer blob of `media_type`.
pub fn decompress(media_type: &str, blob: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    match media_type {
        MEDIA_LAYER_TAR => out = blob.to_vec(),
        MEDIA_LAYER_GZIP => {
            flate2::read::GzDecoder::new(blob)
                .read_to_end(&mut out)
                .expect("gunzip");
        }
        MEDIA_LAYER_ZSTD => out = zstd::decode_all(blob).expect("unzstd"),
        other => panic!("not a layer media type: {other}"),
    }
    out
}
