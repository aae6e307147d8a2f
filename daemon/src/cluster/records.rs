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

/// The key node records are signed with: derived from the cluster token, so only a node
/// (a holder of the token) can write a record the others believe.
#[derive(Clone)]
pub struct RecordKey([u8; 32]);

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordKey(..)")
    }
}

impl RecordKey {
    /// The key of the cluster whose token is `token`.
    pub fn from_token(token: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"airlock-cluster-record-key-v1\n");
        h.update(token.as_bytes());
        Self(h.finalize().into())
    }
}

/// Why a node record read from etcd is not believed.
#[derive(Debug, thiserror::Error)]
pub enum Unsealed {
    #[error("not a signed node record: {0}")]
    Format(#[from] serde_json::Error),
    #[error("its signature is not the cluster key's")]
    Signature,
    #[error("it names node {0:?}, not the node of its key")]
    Name(String),
}

/// A node's record as etcd holds it: the record's JSON as signed, and the signature.
#[derive(Serialize, Deserialize)]
struct Sealed {
    record: String,
    /// HMAC-SHA256 (hex) with the cluster key over the key's node name and `record`.
    mac: String,
}

type Mac = hmac::Hmac<Sha256>;

/// The MAC of `record` stored for the node `name`, not yet finalized.
fn mac(key: &RecordKey, name: &str, record: &str) -> Mac {
    use hmac::Mac as _;
    let mut m = <Mac as hmac::Mac>::new_from_slice(&key.0).unwrap_or_else(|_| unreachable!());
    m.update(format!("airlock-node-record-v1\n{name}\n").as_bytes());
    m.update(record.as_bytes());
    m
}

/// A node's record as etcd holds it (`nodes/NAME`), signed with the cluster key.
pub fn seal(key: &RecordKey, info: &NodeInfo) -> Vec<u8> {
    use hmac::Mac as _;
    let record = serde_json::to_string(info).unwrap_or_default();
    let mac = hex(&mac(key, &info.name, &record).finalize().into_bytes());
    serde_json::to_vec(&Sealed { record, mac }).unwrap_or_default()
}

/// The record stored under `nodes/NAME` for the node `name`: believed only with the cluster
/// key's signature over it and `name` (compared in constant time), and naming `name`.
pub fn open(key: &RecordKey, name: &str, value: &[u8]) -> Result<NodeInfo, Unsealed> {
    use hmac::Mac as _;
    let sealed: Sealed = serde_json::from_slice(value)?;
    let given = hex::decode(&sealed.mac).map_err(|_| Unsealed::Signature)?;
    mac(key, name, &sealed.record)
        .verify_slice(&given)
        .map_err(|_| Unsealed::Signature)?;
    let info: NodeInfo = serde_json::from_str(&sealed.record)?;
    if info.name != name {
        return Err(Unsealed::Name(info.name));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn node(name: &str) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            tag: "beef".into(),
            address: "https://10.0.0.11:7443".into(),
            version: "1".into(),
            sandboxes: 0,
            max_sandboxes: 10,
            committed_mib: 0,
            capacity_mib: 1024,
            templates: vec![TemplateEntry {
                owner: String::new(),
                name: "base".into(),
                id: "tpl-1".into(),
                hash: "ab".into(),
                memory_mib: 128,
            }],
            started_unix_ms: 1,
        }
    }

    /// Issue 37, item 3: someone who can write etcd but lacks the cluster token cannot make
    /// the nodes send calls (and the cluster token) elsewhere: a node record must carry the
    /// cluster key's signature over its content and its key's name.
    #[test]
    fn only_a_record_signed_with_the_cluster_key_for_its_own_name_is_believed() {
        let key = RecordKey::from_token("the cluster token, 32 characters or more");
        let a = node("node-a");
        let sealed = seal(&key, &a);
        assert_eq!(open(&key, "node-a", &sealed).unwrap(), a);
        // Unsigned (the old format), signed with another key, moved to another name.
        let plain = serde_json::to_vec(&a).unwrap();
        assert!(open(&key, "node-a", &plain).is_err());
        let other = RecordKey::from_token("another cluster's token, 32 characters");
        assert!(open(&key, "node-a", &seal(&other, &a)).is_err());
        assert!(open(&key, "node-b", &sealed).is_err());
        // Any change to a signed record: its address, a template's hash.
        let text = String::from_utf8(sealed.clone()).unwrap();
        assert!(text.contains("10.0.0.11"), "{text}");
        let moved = text.replace("10.0.0.11", "10.6.6.6");
        assert!(open(&key, "node-a", moved.as_bytes()).is_err());
        let mut b = node("node-b");
        b.address = "https://10.6.6.6:7443".into();
        let resigned = String::from_utf8(seal(&other, &b)).unwrap();
        assert!(open(&key, "node-b", resigned.as_bytes()).is_err());
        assert!(open(&key, "node-a", b"").is_err());
    }
}
