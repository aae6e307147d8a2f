//! What nodes publish and serve about themselves: a node's record in etcd ([`NodeInfo`]), the
//! templates it lists there ([`TemplateEntry`]), and the manifest it serves of one
//! ([`Manifest`]) with its content hash. Plain data: the ledger stores it, membership reads it,
//! template sharing computes and checks it.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// A node as etcd holds it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub tag: String,
    pub address: String,
    pub version: String,
    pub sandboxes: u32,
    pub max_sandboxes: u32,
    pub committed_mib: u64,
    pub capacity_mib: u64,
    pub templates: Vec<TemplateEntry>,
    pub started_unix_ms: i64,
}

impl NodeInfo {
    /// Whether it holds template `name` as `tenant` sees it (its own or a shared one).
    pub fn template_for(&self, tenant_owner: &str, name: &str) -> Option<&TemplateEntry> {
        // Entries name a version as users do: NAME for its `latest`, else NAME:TAG.
        let name = name.strip_suffix(":latest").unwrap_or(name);
        let mine = |t: &&TemplateEntry| t.name == name && t.owner == tenant_owner;
        let shared = |t: &&TemplateEntry| t.name == name && t.owner.is_empty();
        self.templates
            .iter()
            .find(mine)
            .or_else(|| self.templates.iter().find(shared))
    }

    /// Whether a sandbox of `memory_mib` fits.
    pub(super) fn has_room(&self, memory_mib: u64) -> bool {
        self.sandboxes < self.max_sandboxes
            && self.committed_mib.saturating_add(memory_mib) <= self.capacity_mib
    }
}

/// A template a node holds, as its record in etcd lists it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TemplateEntry {
    /// Its owner (empty: shared).
    pub owner: String,
    pub name: String,
    /// Its id on that node.
    pub id: String,
    /// The content hash ([`Manifest::hash`]).
    pub hash: String,
    pub memory_mib: u32,
}

/// One file of a template.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// What a node serves about one of its templates.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// SHA-256 over the owner, the name and every file's name, size and SHA-256.
    pub hash: String,
    /// Its record (`Template`, protobuf, base64).
    pub record: String,
    pub files: Vec<FileEntry>,
}

pub(super) fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The content hash of a template of `owner` and `name` with `files`.
pub fn content_hash(owner: &str, name: &str, files: &[FileEntry]) -> String {
    let mut h = Sha256::new();
    h.update(format!("airlock-template-v1\n{owner}\n{name}\n"));
    for f in files {
        h.update(format!("{} {} {}\n", f.name, f.size, f.sha256));
    }
    hex(&h.finalize())
}
