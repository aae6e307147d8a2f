//! Sealing at rest: a live sandbox's secrets are kept in the store encrypted (AES-256-GCM, a
//! random 96-bit nonce per record, the sandbox's id bound as associated data) under a key that
//! never enters the store, so that a restarted daemon can adopt the sandbox with them
//! ([`super::sealed`]). The key is the operator's (`AIRLOCK_SECRETS_KEY`, or the file
//! `[secrets] seal_key_file`) or the daemon's own (`DATA_DIR/secrets.key`, made 0600 on first
//! start). A record that does not open (another key, another sandbox's record, altered) is
//! refused: its sandbox is not adopted.

use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom as _, SystemRandom};
use serde::Deserialize;
use zeroize::Zeroizing;

/// The environment variable an operator may give the key in (64 hex digits); it wins over a
/// key file.
pub const KEY_ENV: &str = "AIRLOCK_SECRETS_KEY";
/// The daemon's own key file, in its data directory, when none is configured.
pub const KEY_FILE: &str = "secrets.key";
const KEY_LEN: usize = 32;
/// What a sealed record begins with (its format's version).
const MAGIC: &[u8; 4] = b"ALS1";
/// The associated data: this, then the sandbox's id.
const AAD_PREFIX: &[u8] = b"airlock sealed secrets v1\0";

/// `[secrets]`: sealing at rest.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecretsConfig {
    /// Seal a sandbox's secrets at rest, so that a restarted daemon adopts it with them.
    /// `false`: they live in memory only, and a restart ends every sandbox that has any.
    pub seal: bool,
    /// The key: a file of 32 bytes, raw or as 64 hex digits, owned by the daemon's user and
    /// readable by it alone. It must exist. Unset: `DATA_DIR/secrets.key`, made (0600) when
    /// absent. `AIRLOCK_SECRETS_KEY` wins over both.
    pub seal_key_file: Option<PathBuf>,
}

impl Default for SecretsConfig {
    fn default() -> Self {
        Self {
            seal: true,
            seal_key_file: None,
        }
    }
}

/// Why secrets were not sealed or not unsealed.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("the seal key {path}: {source}")]
    KeyIo {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the seal key {origin}: {why}")]
    Key { origin: String, why: String },
    #[error("no random bytes for a nonce or key")]
    Random,
    #[error("the record could not be sealed")]
    Seal,
    #[error(
        "the sealed secrets do not open with this daemon's key (another key, another \
         sandbox's record, or altered)"
    )]
    Open,
    #[error("the sealed secrets are not in a format this daemon reads")]
    Format,
    #[error("the sealed secrets' contents: {0}")]
    Contents(String),
}

/// The sealing key, in memory (ring keeps its expanded form; the raw bytes were zeroed).
pub struct Sealer {
    key: LessSafeKey,
    rng: SystemRandom,
    /// Where the key came from (for messages; never the key).
    origin: String,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl Sealer {
    /// A sealer with key `key`, which came from `origin`.
    pub fn from_key(key: &[u8; KEY_LEN], origin: impl Into<String>) -> Self {
        let unbound = UnboundKey::new(&AES_256_GCM, key)
            .unwrap_or_else(|_| unreachable!("AES-256-GCM takes a 32-byte key"));
        Self {
            key: LessSafeKey::new(unbound),
            rng: SystemRandom::new(),
            origin: origin.into(),
        }
    }

    /// The configured sealer: `None` when sealing is off.
    pub fn load(cfg: &SecretsConfig, data_dir: &Path) -> Result<Option<Self>, SealError> {
        if !cfg.seal {
            return Ok(None);
        }
        if let Some(v) = std::env::var_os(KEY_ENV) {
            let text = Zeroizing::new(v.to_string_lossy().into_owned());
            let origin = format!("in ${KEY_ENV}");
            let key = parse_key(text.as_bytes()).ok_or_else(|| SealError::Key {
                origin: origin.clone(),
                why: "not 64 hex digits".into(),
            })?;
            return Ok(Some(Self::from_key(&key, origin)));
        }
        let (path, create) = match &cfg.seal_key_file {
            Some(p) => (p.clone(), false),
            None => (data_dir.join(KEY_FILE), true),
        };
        let key = read_key_file(&path, create)?;
        Ok(Some(Self::from_key(&key, path.display().to_string())))
    }

    /// Where its key came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// `plain` sealed for sandbox `id`: the magic, a fresh nonce, the ciphertext and its tag.
    pub fn seal(&self, id: &str, plain: &[u8]) -> Result<Vec<u8>, SealError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).map_err(|_| SealError::Random)?;
        // Sized so that it never moves (a move would leave a copy of the plaintext behind).
        let mut body = Zeroizing::new(Vec::with_capacity(plain.len() + AES_256_GCM.tag_len()));
        body.extend_from_slice(plain);
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), aad(id), &mut *body)
            .map_err(|_| SealError::Seal)?;
        let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// The plaintext of `sealed`, if it was sealed for sandbox `id` under this key, unaltered.
    pub fn open(&self, id: &str, sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        let rest = sealed.strip_prefix(MAGIC).ok_or(SealError::Format)?;
        if rest.len() < NONCE_LEN {
            return Err(SealError::Format);
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Format)?;
        let mut buf = Zeroizing::new(body.to_vec());
        let len = self
            .key
            .open_in_place(nonce, aad(id), buf.as_mut_slice())
            .map_err(|_| SealError::Open)?
            .len();
        buf.truncate(len);
        Ok(buf)
    }
}

fn aad(id: &str) -> Aad<Vec<u8>> {
    let mut a = AAD_PREFIX.to_vec();
    a.extend_from_slice(id.as_bytes());
    Aad::from(a)
}

/// A key as 64 hex digits (surrounding white space ignored) or 32 raw bytes.
fn parse_key(text: &[u8]) -> Option<Zeroizing<[u8; KEY_LEN]>> {
    let mut key = Zeroizing::new([0u8; KEY_LEN]);
    if text.len() == KEY_LEN {
        key.copy_from_slice(text);
        return Some(key);
    }
    let hex = text.trim_ascii();
    if hex.len() != 2 * KEY_LEN {
        return None;
    }
    for (k, pair) in key.iter_mut().zip(hex.chunks(2)) {
        let digit = |c: u8| (c as char).to_digit(16);
        *k = u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok()?;
    }
    Some(key)
}

/// The key in file `path`, which must be a regular file of the daemon's user that nobody else
/// may read or write; when absent and `create`, a new key written there first.
fn read_key_file(path: &Path, create: bool) -> Result<Zeroizing<[u8; KEY_LEN]>, SealError> {
    let io = |source| SealError::KeyIo {
        path: path.to_owned(),
        source,
    };
    let bad = |why: &str| SealError::Key {
        origin: path.display().to_string(),
        why: why.to_owned(),
    };
    if create && !path.exists() {
        write_new_key(path).map_err(io)?;
    }
    let meta = std::fs::symlink_metadata(path).map_err(io)?;
    if !meta.file_type().is_file() {
        return Err(bad("not a regular file"));
    }
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        return Err(bad(&format!(
            "owned by uid {}, not the daemon's",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(&format!(
            "mode {:o}: others than its owner may use it (chmod 600)",
            meta.mode() & 0o777
        )));
    }
    let text = Zeroizing::new(std::fs::read(path).map_err(io)?);
    parse_key(&text).ok_or_else(|| bad("not 32 bytes nor 64 hex digits"))
}

/// A new random key at `path` (64 hex digits, mode 0600; never over an existing file).
fn write_new_key(path: &Path) -> std::io::Result<()> {
    let mut key = Zeroizing::new([0u8; KEY_LEN]);
    SystemRandom::new()
        .fill(key.as_mut())
        .map_err(|_| std::io::Error::other("no random bytes"))?;
    let mut text = Zeroizing::new(String::with_capacity(2 * KEY_LEN + 1));
    for b in key.iter() {
        text.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
        text.push(char::from_digit(u32::from(b & 15), 16).unwrap_or('0'));
    }
    text.push('\n');
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    tracing::info!(path = %path.display(), "made the key that seals secrets at rest");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_record_opens_only_for_its_sandbox_under_its_key_unaltered() {
        let a = Sealer::from_key(&[7; KEY_LEN], "test");
        let sealed = a.seal("sb-1", b"the secrets").unwrap();
        assert!(!sealed.windows(11).any(|w| w == b"the secrets"));
        assert_eq!(a.open("sb-1", &sealed).unwrap().as_slice(), b"the secrets");
        // A fresh nonce each time.
        assert_ne!(a.seal("sb-1", b"the secrets").unwrap(), sealed);
        // Another key.
        let b = Sealer::from_key(&[8; KEY_LEN], "test");
        assert!(matches!(b.open("sb-1", &sealed), Err(SealError::Open)));
        // Another sandbox's record.
        assert!(matches!(a.open("sb-2", &sealed), Err(SealError::Open)));
        // Altered anywhere: the nonce, the ciphertext, the tag; cut; not a record.
        for i in [MAGIC.len(), MAGIC.len() + NONCE_LEN, sealed.len() - 1] {
            let mut t = sealed.clone();
            t[i] ^= 1;
            assert!(matches!(a.open("sb-1", &t), Err(SealError::Open)), "{i}");
        }
        assert!(a.open("sb-1", &sealed[..sealed.len() - 1]).is_err());
        assert!(matches!(a.open("sb-1", b"ALS1"), Err(SealError::Format)));
        assert!(matches!(a.open("sb-1", b"junk"), Err(SealError::Format)));
    }

    #[test]
    fn the_key_file_is_made_private_and_must_stay_so() {
        let dir = std::env::temp_dir().join(format!("airlock-seal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(KEY_FILE);
        let made = read_key_file(&path, true).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 65);
        // Read again, the same key.
        assert_eq!(*read_key_file(&path, true).unwrap(), *made);
        // Readable by others: refused.
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        assert!(matches!(
            read_key_file(&path, true),
            Err(SealError::Key { .. })
        ));
        // A configured file must exist.
        assert!(matches!(
            read_key_file(&dir.join("absent"), false),
            Err(SealError::KeyIo { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn keys_are_hex_or_raw() {
        let hex = "00".repeat(31) + "ff\n";
        assert_eq!(parse_key(hex.as_bytes()).unwrap()[31], 0xff);
        assert_eq!(parse_key(&[1; KEY_LEN]).unwrap()[0], 1);
        assert!(parse_key(b"short").is_none());
        assert!(parse_key(("zz".repeat(32)).as_bytes()).is_none());
    }
}
