//! An image's file tree, assembled from its layers in memory and only then written to disk.
//!
//! Tar parsers keep having path-escape bugs, and those bugs live where an archive is unpacked
//! onto a file system: a name with `..`, a symlink an earlier entry planted and a later entry
//! writes through, a hard link to a host file. Here no archive is ever unpacked onto the host.
//! The tar crate only reads headers and data; every entry's name is split into components and
//! checked (no `..`, no absolute name, no empty or over-long component) and applied to a tree
//! held in memory, where a parent that is a symlink is an error, not something to follow, a
//! hard link must name a regular file already in the tree, and device nodes are refused. A
//! regular file's bytes go to a numbered spool file in the build's own directory. Whiteouts
//! (`.wh.NAME`) and opaque directories (`.wh..wh..opq`) edit the tree as OCI's layer format
//! says. Only the finished tree is written out ([`Tree::write_to`]), by `mkdirat`, `symlinkat`,
//! `linkat` and friends relative to directory descriptors the writer itself created and opened
//! with `O_NOFOLLOW`, so a symlink in the image is created but never followed on the host.
//! Setuid and setgid bits are kept (they mean something in the guest) on files under a build
//! directory only root can enter.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Timespec, Timestamps};
use rustix::fs::{Gid, Uid};

/// Longest name of one path component (ext4's).
const MAX_NAME: usize = 255;
/// Longest path and symlink target.
const MAX_PATH: usize = 4095;
/// Deepest directory nesting accepted.
const MAX_DEPTH: usize = 128;
/// The directory at the image's root that belongs to Airlock (the guest agent).
pub const RESERVED: &[u8] = b".airlock";
/// OCI whiteouts.
const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

/// Caps on one image.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Bytes of all layers, uncompressed (tar headers and data): a decompression bomb stops here.
    pub max_unpacked_bytes: u64,
    /// Entries in all layers.
    pub max_entries: u64,
}

/// Why a layer was refused, naming the layer and entry.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error("layer {layer}: entry {entry:?}: {why}")]
    Entry {
        layer: String,
        entry: String,
        why: EntryError,
    },
    #[error("layer {layer}: {why}")]
    Layer { layer: String, why: LayerError },
    #[error("writing the image tree: {0}")]
    Io(#[from] io::Error),
}

/// What is wrong with a layer as a whole.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("not a tar archive: {0}")]
    NotTar(io::Error),
    /// The archive could not be read on (malformed, or past the unpacked-size cap).
    #[error("reading the archive: {0}")]
    Read(io::Error),
    #[error("the image has more than {0} entries")]
    TooManyEntries(u64),
}

/// Why a name (an entry's, a hard link's target) is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("an empty name")]
    Empty,
    #[error("a name longer than {max} bytes", max = MAX_PATH)]
    TooLong,
    #[error("an absolute name (layers hold names relative to the root)")]
    Absolute,
    #[error("a name with a NUL byte")]
    Nul,
    #[error("a name with `..` (path traversal)")]
    Traversal,
    #[error("a name component longer than {max} bytes", max = MAX_NAME)]
    ComponentTooLong,
    #[error("a path deeper than {max} directories", max = MAX_DEPTH)]
    TooDeep,
}

/// Why the directory an entry goes in cannot be reached (the path shown is the one walked).
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("the image's root is not a directory")]
    RootNotDirectory,
    #[error("{0} does not exist")]
    Missing(String),
    #[error("{0} vanished")]
    Vanished(String),
    #[error(
        "its parent {0} is a symlink earlier in the image (entries are never written through \
         symlinks)"
    )]
    SymlinkParent(String),
    #[error("its parent {0} is not a directory")]
    NotDirectory(String),
}

/// Why one entry of a layer is refused.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    #[error(transparent)]
    Name(#[from] NameError),
    #[error(transparent)]
    Path(#[from] PathError),
    /// A header field (`what`: mode, uid, gid) that cannot be read.
    #[error("its {what}: {source}")]
    Header {
        what: &'static str,
        source: io::Error,
    },
    #[error("its {what} {value} is not a valid id")]
    InvalidId { what: &'static str, value: u64 },
    #[error("/{} is reserved for Airlock's guest agent", show(RESERVED))]
    Reserved,
    #[error("a whiteout of nothing")]
    EmptyWhiteout,
    /// Writing the file's data to the spool (the host's side).
    #[error("spooling its data: {0}")]
    Spool(io::Error),
    /// Reading the file's data from the layer (malformed, or past the unpacked-size cap).
    #[error("its data: {0}")]
    Data(io::Error),
    #[error("a symlink without a target")]
    SymlinkWithoutTarget,
    #[error("a symlink with an empty, over-long or NUL-bearing target")]
    SymlinkTarget,
    #[error("a symlink to {0:?}, which points out of the image's root")]
    SymlinkEscapes(String),
    #[error("a hard link without a target")]
    HardLinkWithoutTarget,
    #[error("a hard link to {0}")]
    HardLinkName(NameError),
    #[error(
        "a hard link to {0:?}, which is not a regular file earlier in the image (reached \
         without symlinks)"
    )]
    HardLinkTarget(String),
    #[error("a device node (images may not carry device nodes)")]
    Device,
    #[error("an entry of unsupported type {0:?}")]
    UnsupportedType(char),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Meta {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
}

impl Meta {
    pub const fn root(mode: u32) -> Self {
        Self {
            mode,
            uid: 0,
            gid: 0,
            mtime: 0,
        }
    }
}

#[derive(Debug)]
enum Kind {
    Dir(Entries),
    /// A regular file: its data is spool file number N (hard links share N and its metadata).
    File(u64),
    Symlink(Vec<u8>),
    Fifo,
}

#[derive(Debug)]
struct Node {
    meta: Meta,
    kind: Kind,
    /// The newest layer that wrote this node or anything under it (opaque directories keep
    /// only what their own layer wrote).
    touched: u32,
}

impl Node {
    fn dir(meta: Meta, layer: u32) -> Self {
        Self {
            meta,
            kind: Kind::Dir(BTreeMap::new()),
            touched: layer,
        }
    }
}

/// The tree; file data is spooled under `spool`.
#[derive(Debug)]
pub struct Tree {
    root: Node,
    spool: PathBuf,
    /// Metadata of each spooled file (shared by its hard links).
    files: BTreeMap<u64, Meta>,
    next_file: u64,
    limits: Limits,
    unpacked: u64,
    entries: u64,
    layer: u32,
}

/// Counts what a reader yields, failing past a cap (a decompression bomb's output).
struct Capped<R> {
    inner: R,
    left: u64,
    total: u64,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.total += n as u64;
        if n as u64 > self.left {
            return Err(io::Error::new(
                io::ErrorKind::FileTooLarge,
                "the image unpacks to more than its cap (max_image_unpacked_mib)",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// A directory's entries by name.
type Entries = BTreeMap<Vec<u8>, Node>;

/// A checked path: its components, none of them empty, `.` or `..`.
pub(crate) type Components = Vec<Vec<u8>>;

pub(crate) fn split(raw: &[u8]) -> Result<Components, NameError> {
    if raw.is_empty() {
        return Err(NameError::Empty);
    }
    if raw.len() > MAX_PATH {
        return Err(NameError::TooLong);
    }
    if raw.starts_with(b"/") {
        return Err(NameError::Absolute);
    }
    if raw.contains(&0) {
        return Err(NameError::Nul);
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => continue,
            b".." => return Err(NameError::Traversal),
            c if c.len() > MAX_NAME => return Err(NameError::ComponentTooLong),
            c => out.push(c.to_vec()),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(NameError::TooDeep);
    }
    Ok(out)
}

/// Whether a relative symlink target, resolved from the link's directory (`depth` components
/// below the root), climbs above the root.
fn escapes(depth: usize, target: &[u8]) -> bool {
    if target.starts_with(b"/") {
        return false; // resolved against the guest's own root
    }
    let mut level = depth as i64;
    for c in target.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                level -= 1;
                if level < 0 {
                    return true;
                }
            }
            _ => level += 1,
        }
    }
    false
}

/// Entry step: an entry's mode (permission bits), owner and mtime; an id must fit a `u32`
/// and not be `u32::MAX`.
fn meta_of(header: &tar::Header) -> Result<Meta, EntryError> {
    let id = |v: io::Result<u64>, what: &'static str| -> Result<u32, EntryError> {
        let v = v.map_err(|source| EntryError::Header { what, source })?;
        u32::try_from(v)
            .ok()
            .filter(|v| *v != u32::MAX)
            .ok_or(EntryError::InvalidId { what, value: v })
    };
    Ok(Meta {
        mode: header.mode().map_err(|source| EntryError::Header {
            what: "mode",
            source,
        })? & 0o7777,
        uid: id(header.uid(), "uid")?,
        gid: id(header.gid(), "gid")?,
        mtime: header
            .mtime()
            .map(|t| i64::try_from(t).unwrap_or(0))
            .unwrap_or(0),
    })
}

fn show(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw).into_owned()
}

impl Tree {
    /// An empty tree (a root directory 0755 owned by root) spooling file data into `spool`
    /// (created; the caller's build directory).
    pub fn new(spool: &Path, limits: Limits) -> io::Result<Self> {
        std::fs::create_dir_all(spool)?;
        Ok(Self {
            root: Node::dir(Meta::root(0o755), 0),
            spool: spool.to_path_buf(),
            files: BTreeMap::new(),
            next_file: 0,
            limits,
            unpacked: 0,
            entries: 0,
            layer: 0,
        })
    }

    /// Bytes of regular-file data the tree holds (hard links counted once).
    pub fn file_bytes(&self) -> u64 {
        self.files
            .keys()
            .filter_map(|n| std::fs::metadata(self.spool.join(n.to_string())).ok())
            .map(|m| m.len())
            .sum()
    }

    /// Entries applied so far.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Applies one uncompressed layer (a tar stream) on top of the tree. `name` names it in
    /// errors (its digest).
    pub fn apply_layer(&mut self, name: &str, tar: impl Read) -> Result<(), TreeError> {
        self.layer += 1;
        let left = self.limits.max_unpacked_bytes.saturating_sub(self.unpacked);
        let mut capped = Capped {
            inner: tar,
            left,
            total: 0,
        };
        let result = self.apply_entries(name, &mut capped);
        self.unpacked += capped.total;
        result
    }

    fn apply_entries<R: Read>(&mut self, layer: &str, tar: &mut R) -> Result<(), TreeError> {
        let layer_err = |why: LayerError| TreeError::Layer {
            layer: layer.to_owned(),
            why,
        };
        let mut archive = tar::Archive::new(tar);
        let entries = archive
            .entries()
            .map_err(|e| layer_err(LayerError::NotTar(e)))?;
        for entry in entries {
            let entry = entry.map_err(|e| layer_err(LayerError::Read(e)))?;
            self.entries += 1;
            if self.entries > self.limits.max_entries {
                return Err(layer_err(LayerError::TooManyEntries(
                    self.limits.max_entries,
                )));
            }
            let raw = entry.path_bytes().into_owned();
            self.apply_entry(entry).map_err(|why| TreeError::Entry {
                layer: layer.to_owned(),
                entry: show(&raw),
                why,
            })?;
        }
        Ok(())
    }

    /// Applies one tar entry: the root's metadata, an opaque-directory marker, a whiteout, or
    /// a node put (or, for an existing directory, updated) at its path.
    fn apply_entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), EntryError> {
        let header = entry.header();
        let ty = header.entry_type();
        if ty.is_pax_global_extensions() || ty.is_pax_local_extensions() {
            return Ok(()); // the crate applies local ones to the next entry
        }
        let raw = entry.path_bytes().into_owned();
        let path = split(&raw)?;
        let meta = meta_of(header)?;
        let Some((name, parents)) = path.split_last() else {
            // The root itself ("./"): its metadata.
            if ty.is_dir() {
                self.root.meta = meta;
            }
            return Ok(());
        };
        if path.first().is_some_and(|c| c.as_slice() == RESERVED) {
            return Err(EntryError::Reserved);
        }
        let layer = self.layer;
        if name.as_slice() == OPAQUE {
            clear_lower(self.dir_at(parents, true)?, layer);
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(EntryError::EmptyWhiteout);
            }
            if let Ok(dir) = self.dir_at(parents, false) {
                dir.remove(hidden);
            }
            return Ok(());
        }
        let Some(kind) = self.node_kind(&mut entry, ty, name, parents, meta)? else {
            return Ok(());
        };
        self.dir_at(parents, true)?.insert(
            name.clone(),
            Node {
                meta,
                kind,
                touched: layer,
            },
        );
        Ok(())
    }

    /// Entry step: what the entry of type `ty` at `parents/name` makes: a directory, a file
    /// (its data spooled), a symlink (checked), a hard link to a file, a FIFO; `None` when an
    /// existing directory there took `meta` instead.
    fn node_kind<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        ty: tar::EntryType,
        name: &Vec<u8>,
        parents: &[Vec<u8>],
        meta: Meta,
    ) -> Result<Option<Kind>, EntryError> {
        let layer = self.layer;
        Ok(Some(if ty.is_dir() {
            let children = self.dir_at(parents, true)?;
            if let Some(existing) = children.get_mut(name)
                && matches!(existing.kind, Kind::Dir(_))
            {
                existing.meta = meta;
                existing.touched = layer;
                return Ok(None);
            }
            Kind::Dir(BTreeMap::new())
        } else if ty.is_file() || ty == tar::EntryType::Continuous {
            let n = self.next_file;
            self.next_file += 1;
            let mut out =
                File::create(self.spool.join(n.to_string())).map_err(EntryError::Spool)?;
            io::copy(entry, &mut out).map_err(EntryError::Data)?;
            self.files.insert(n, meta);
            Kind::File(n)
        } else if ty.is_symlink() {
            let target = entry
                .link_name_bytes()
                .ok_or(EntryError::SymlinkWithoutTarget)?
                .into_owned();
            if target.is_empty() || target.len() > MAX_PATH || target.contains(&0) {
                return Err(EntryError::SymlinkTarget);
            }
            if escapes(parents.len(), &target) {
                return Err(EntryError::SymlinkEscapes(show(&target)));
            }
            Kind::Symlink(target)
        } else if ty.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .ok_or(EntryError::HardLinkWithoutTarget)?
                .into_owned();
            let to = split(&target).map_err(EntryError::HardLinkName)?;
            let n = self
                .file_at(&to)
                .ok_or_else(|| EntryError::HardLinkTarget(show(&target)))?;
            Kind::File(n)
        } else if ty.is_fifo() {
            Kind::Fifo
        } else if ty.is_character_special() || ty.is_block_special() {
            return Err(EntryError::Device);
        } else {
            return Err(EntryError::UnsupportedType(ty.as_byte() as char));
        }))
    }

    /// The entries of the directory at `path`, walking only directories: a symlink or file on
    /// the way is an error; missing directories are made (0755, root) when `create`. Marks the
    /// way touched by the current layer.
    fn dir_at(&mut self, path: &[Vec<u8>], create: bool) -> Result<&mut Entries, PathError> {
        let layer = self.layer;
        self.root.touched = self.root.touched.max(layer);
        let Kind::Dir(children) = &mut self.root.kind else {
            return Err(PathError::RootNotDirectory);
        };
        let mut children = children;
        for (i, c) in path.iter().enumerate() {
            let here = || show(&path[..=i].join(&b'/'));
            if !children.contains_key(c) {
                if !create {
                    return Err(PathError::Missing(here()));
                }
                children.insert(c.clone(), Node::dir(Meta::root(0o755), layer));
            }
            let Some(next) = children.get_mut(c) else {
                return Err(PathError::Vanished(here()));
            };
            next.touched = next.touched.max(layer);
            children = match &mut next.kind {
                Kind::Dir(m) => m,
                Kind::Symlink(_) => return Err(PathError::SymlinkParent(here())),
                _ => return Err(PathError::NotDirectory(here())),
            };
        }
        Ok(children)
    }

    /// The spool number of the regular file at `path`, reached through directories only.
    fn file_at(&self, path: &[Vec<u8>]) -> Option<u64> {
        let mut node = &self.root;
        for c in path {
            let Kind::Dir(children) = &node.kind else {
                return None;
            };
            node = children.get(c)?;
        }
        match node.kind {
            Kind::File(n) => Some(n),
            _ => None,
        }
    }

    /// Whether `path` exists (as anything).
    pub fn exists(&self, path: &str) -> bool {
        let Ok(parts) = split(path.trim_start_matches('/').as_bytes()) else {
            return false;
        };
        let mut node = &self.root;
        for c in &parts {
            let Kind::Dir(children) = &node.kind else {
                return false;
            };
            let Some(next) = children.get(c) else {
                return false;
            };
            node = next;
        }
        true
    }

    /// Whether `path` is an executable regular file, following symlinks inside the tree (as
    /// the guest would; a few hops at most).
    pub fn is_executable(&self, path: &str) -> bool {
        let mut path = path.as_bytes().to_vec();
        for _ in 0..8 {
            let Ok(parts) = split(trim_slashes(&path)) else {
                return false;
            };
            let mut node = &self.root;
            let mut at = Vec::new();
            let mut hop = None;
            for (i, c) in parts.iter().enumerate() {
                let Kind::Dir(children) = &node.kind else {
                    return false;
                };
                let Some(next) = children.get(c) else {
                    return false;
                };
                if let Kind::Symlink(t) = &next.kind {
                    hop = Some(resolve(&at, t, &parts[i + 1..]));
                    break;
                }
                at.push(c.clone());
                node = next;
            }
            match hop {
                Some(p) => path = p,
                None => {
                    return matches!(node.kind, Kind::File(_)) && node.meta.mode & 0o111 != 0;
                }
            }
        }
        false
    }

    /// Adds (or replaces) a file of Airlock's at `path` with `data`; its parents are made as
    /// needed unless one is not a directory (then nothing is added and false returned).
    pub fn add_file(&mut self, path: &str, data: &[u8], meta: Meta) -> io::Result<bool> {
        let parts = split(path.trim_start_matches('/').as_bytes())
            .map_err(|e| io::Error::other(format!("{path}: {e}")))?;
        let Some((name, parents)) = parts.split_last() else {
            return Ok(false);
        };
        if self.dir_at(parents, true).is_err() {
            return Ok(false);
        }
        let n = self.next_file;
        self.next_file += 1;
        std::fs::write(self.spool.join(n.to_string()), data)?;
        self.files.insert(n, meta);
        let layer = self.layer;
        if let Ok(dir) = self.dir_at(parents, true) {
            dir.insert(
                name.clone(),
                Node {
                    meta,
                    kind: Kind::File(n),
                    touched: layer,
                },
            );
        }
        Ok(true)
    }

    /// Adds a directory at `path` if nothing is there (a mount point the agent needs).
    pub fn add_dir_if_absent(&mut self, path: &str, meta: Meta) {
        let Ok(parts) = split(path.trim_start_matches('/').as_bytes()) else {
            return;
        };
        let Some((name, parents)) = parts.split_last() else {
            return;
        };
        let layer = self.layer;
        if let Ok(dir) = self.dir_at(parents, true) {
            dir.entry(name.clone())
                .or_insert_with(|| Node::dir(meta, layer));
        }
    }

    /// Writes the tree into `root` (a directory the caller created, empty) and empties the
    /// spool. Nothing outside `root` and the spool is touched: every call is relative to a
    /// directory descriptor this function opened itself without following links.
    pub fn write_to(&self, root: &Path) -> io::Result<()> {
        let spool = rustix::fs::open(
            &self.spool,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        // A file's metadata once, on its spool file (hard links share the inode). chown
        // before chmod: chown clears setuid and setgid bits.
        for (n, m) in &self.files {
            let name = n.to_string();
            let fd = rustix::fs::openat(
                &spool,
                &name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            rustix::fs::fchown(&fd, Some(uid(m.uid)), Some(gid(m.gid)))?;
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(m.mode))?;
            rustix::fs::futimens(&fd, &times(m.mtime))?;
        }
        let top = rustix::fs::open(
            root,
            OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        self.write_dir(&self.root, &top, &spool)?;
        set_dir_meta(&top, self.root.meta)?;
        for n in self.files.keys() {
            rustix::fs::unlinkat(&spool, n.to_string(), AtFlags::empty())?;
        }
        Ok(())
    }

    fn write_dir(&self, node: &Node, fd: &OwnedFd, spool: &OwnedFd) -> io::Result<()> {
        let Kind::Dir(children) = &node.kind else {
            return Ok(());
        };
        for (name, child) in children {
            let name = name.as_slice();
            let m = child.meta;
            match &child.kind {
                Kind::Dir(_) => {
                    rustix::fs::mkdirat(fd, name, Mode::from_raw_mode(0o700))?;
                    let sub = rustix::fs::openat(
                        fd,
                        name,
                        OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC,
                        Mode::empty(),
                    )?;
                    self.write_dir(child, &sub, spool)?;
                    set_dir_meta(&sub, m)?;
                }
                Kind::File(n) => {
                    rustix::fs::linkat(spool, n.to_string(), fd, name, AtFlags::empty())?;
                }
                Kind::Symlink(target) => {
                    rustix::fs::symlinkat(target.as_slice(), fd, name)?;
                    rustix::fs::chownat(
                        fd,
                        name,
                        Some(uid(m.uid)),
                        Some(gid(m.gid)),
                        AtFlags::SYMLINK_NOFOLLOW,
                    )?;
                    rustix::fs::utimensat(fd, name, &times(m.mtime), AtFlags::SYMLINK_NOFOLLOW)?;
                }
                Kind::Fifo => {
                    rustix::fs::mknodat(fd, name, FileType::Fifo, Mode::from_raw_mode(0o600), 0)?;
                    // The name is ours (just made, in a directory only this writer writes),
                    // so the *at calls reach the FIFO itself.
                    rustix::fs::chownat(
                        fd,
                        name,
                        Some(uid(m.uid)),
                        Some(gid(m.gid)),
                        AtFlags::SYMLINK_NOFOLLOW,
                    )?;
                    rustix::fs::chmodat(fd, name, Mode::from_raw_mode(m.mode), AtFlags::empty())?;
                }
            }
        }
        Ok(())
    }
}

fn set_dir_meta(fd: &OwnedFd, m: Meta) -> io::Result<()> {
    rustix::fs::fchown(fd.as_fd(), Some(uid(m.uid)), Some(gid(m.gid)))?;
    rustix::fs::fchmod(fd.as_fd(), Mode::from_raw_mode(m.mode))?;
    rustix::fs::futimens(fd.as_fd(), &times(m.mtime))?;
    Ok(())
}

fn uid(raw: u32) -> Uid {
    Uid::from_raw_unchecked(raw)
}

fn gid(raw: u32) -> Gid {
    Gid::from_raw_unchecked(raw)
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

fn trim_slashes(p: &[u8]) -> &[u8] {
    let mut p = p;
    while let Some(rest) = p.strip_prefix(b"/") {
        p = rest;
    }
    p
}

/// A symlink's target `t` found in directory `at`, with `rest` after it, as a path from the
/// root (lexically, `..` stopping at the root as in the guest).
fn resolve(at: &[Vec<u8>], t: &[u8], rest: &[Vec<u8>]) -> Vec<u8> {
    let mut parts: Vec<Vec<u8>> = if t.starts_with(b"/") {
        Vec::new()
    } else {
        at.to_vec()
    };
    for c in t.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            c => parts.push(c.to_vec()),
        }
    }
    parts.extend(rest.iter().cloned());
    parts.join(&b'/')
}

/// Removes what layers below `layer` put under an opaque directory; what `layer` itself wrote
/// there (before or after the marker) stays.
fn clear_lower(children: &mut Entries, layer: u32) {
    children.retain(|_, c| c.touched >= layer);
    for c in children.values_mut() {
        if let Kind::Dir(sub) = &mut c.kind {
            clear_lower(sub, layer);
        }
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
