//! Reseed: a VM restored from a snapshot gets its own randomness, host name and sandbox id.
//!
//! Everything is validated before anything is done. The kernel's random pool and the host name
//! are touched only by the agent running as PID 1 in a VM: an agent started as an ordinary
//! process on some machine (tests) must never reseed that machine's RNG or rename it, so it
//! skips both and says so in the answer. The sandbox id is written (atomically) under the
//! agent's state directory, if it has one, and exported to later executions.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use airlock_proto::pb::{self, ErrorCode, Reseeded};
use airlock_proto::{
    MAX_HOSTNAME_BYTES, MAX_RESEED_ENTROPY, MAX_SANDBOX_ID_BYTES, MAX_VOLUME_MOUNTS,
    MIN_RESEED_ENTROPY,
};

use crate::error::ReqError;
use crate::sys;

/// The file under the state directory that holds the sandbox id.
pub const SANDBOX_ID_FILE: &str = "sandbox-id";
/// Written first, then renamed to [`SANDBOX_ID_FILE`].
const SANDBOX_ID_TEMP: &str = ".sandbox-id.tmp";
/// Where the kernel's random pool is reached.
const URANDOM: &str = "/dev/urandom";
/// The longest label of a host name.
const MAX_LABEL_BYTES: usize = 63;

/// What Reseed changed about this VM.
#[derive(Debug, Default)]
pub struct Identity {
    /// Set by Reseed (as PID 1); reported in later Ready frames.
    pub hostname: Option<String>,
    /// Set by Reseed: exported to executions, reported in Ready. Empty before any.
    pub sandbox_id: String,
    /// The volumes Reseed mounted (their paths), unmounted before a power-off.
    pub volumes: Vec<String>,
}

/// A validated Reseed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReseedSpec {
    pub entropy: Vec<u8>,
    pub hostname: Option<String>,
    pub sandbox_id: Option<String>,
    /// The sandbox's writable space, if a limit was asked for (see [`crate::disk`]).
    pub disk_bytes: Option<u64>,
    /// Volumes to mount (checked: [`crate::volumes::check`]).
    pub mounts: Vec<pb::VolumeMount>,
}

impl ReseedSpec {
    pub fn validate(req: pb::Reseed) -> Result<Self, ReqError> {
        let len = req.entropy.len();
        if !(MIN_RESEED_ENTROPY..=MAX_RESEED_ENTROPY).contains(&len) {
            return Err(ReqError::invalid(format!(
                "entropy must be {MIN_RESEED_ENTROPY}..={MAX_RESEED_ENTROPY} bytes, got {len}"
            )));
        }
        let hostname = non_empty(req.hostname);
        if let Some(name) = &hostname {
            check_hostname(name).map_err(ReqError::invalid)?;
        }
        let sandbox_id = non_empty(req.sandbox_id);
        if let Some(id) = &sandbox_id {
            check_sandbox_id(id).map_err(ReqError::invalid)?;
        }
        if req.mounts.len() > MAX_VOLUME_MOUNTS {
            return Err(ReqError::invalid(format!(
                "{} volumes, at most {MAX_VOLUME_MOUNTS}",
                req.mounts.len()
            )));
        }
        for (i, m) in req.mounts.iter().enumerate() {
            crate::volumes::check(m)?;
            if req.mounts[..i]
                .iter()
                .any(|o| o.serial == m.serial || o.path == m.path)
            {
                return Err(ReqError::invalid(format!(
                    "volume {} or its path {} given twice",
                    m.serial, m.path
                )));
            }
        }
        Ok(Self {
            entropy: req.entropy,
            hostname,
            sandbox_id,
            disk_bytes: (req.disk_bytes > 0).then_some(req.disk_bytes),
            mounts: req.mounts,
        })
    }
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// A host name of RFC 1123 labels (letters, digits, "-"; 1..=63 bytes; no "-" at either end)
/// separated by ".", at most [`MAX_HOSTNAME_BYTES`] in all.
pub fn check_hostname(name: &str) -> Result<(), String> {
    if name.len() > MAX_HOSTNAME_BYTES {
        return Err(format!(
            "host name of {} bytes, the limit is {MAX_HOSTNAME_BYTES}",
            name.len()
        ));
    }
    let label_ok = |label: &str| {
        (1..=MAX_LABEL_BYTES).contains(&label.len())
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if name.split('.').all(label_ok) {
        Ok(())
    } else {
        Err(format!("invalid host name {name:?}"))
    }
}

/// A sandbox id: 1..=[`MAX_SANDBOX_ID_BYTES`] of `[A-Za-z0-9._-]`.
pub fn check_sandbox_id(id: &str) -> Result<(), String> {
    let ok = (1..=MAX_SANDBOX_ID_BYTES).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid sandbox id {id:?}: 1..={MAX_SANDBOX_ID_BYTES} of [A-Za-z0-9._-]"
        ))
    }
}

/// Handles a Reseed request, serialised with other Reseeds by the `identity` lock. Only `pid1`
/// (the agent runs as PID 1 in a VM) touches the kernel's RNG, the host name and /tmp; the
/// sandbox id is written under `state_dir`, if there is one.
pub fn handle(
    pid1: bool,
    state_dir: Option<&Path>,
    identity: &Mutex<Identity>,
    req: pb::Reseed,
) -> Result<Reseeded, ReqError> {
    let spec = ReseedSpec::validate(req)?;
    let mut identity = identity.lock().unwrap_or_else(PoisonError::into_inner);
    let mut done = Reseeded::default();
    if pid1 {
        reseed_kernel_rng(&spec.entropy)?;
        done.rng_reseeded = true;
        if let Some(name) = &spec.hostname {
            sys::set_hostname(name).map_err(|e| ReqError::io("sethostname", &e))?;
            done.hostname_set = true;
            identity.hostname = Some(name.clone());
        }
        if let Some(bytes) = spec.disk_bytes {
            if crate::disk::root_writable() {
                crate::disk::limit_root_space(bytes)
                    .map_err(|e| ReqError::io("limiting the root filesystem's space", &e))?;
            } else {
                sys::remount_tmpfs_size("/tmp", bytes)
                    .map_err(|e| ReqError::io("remounting /tmp with its size limit", &e))?;
            }
            done.disk_limit_set = true;
        }
        for m in &spec.mounts {
            crate::volumes::mount(m)?;
            identity.volumes.push(m.path.clone());
            done.mounted.push(m.path.clone());
        }
    }
    if let Some(id) = spec.sandbox_id {
        if let Some(dir) = state_dir {
            let path = write_sandbox_id(dir, &id).map_err(|e| {
                ReqError::io(
                    &format!("writing the sandbox id under {}", dir.display()),
                    &e,
                )
            })?;
            done.sandbox_id_file = path.display().to_string();
        }
        identity.sandbox_id = id;
        done.sandbox_id_set = true;
    }
    Ok(done)
}

/// Mixes `entropy` into the kernel's pool (credited in full) and reseeds the CRNG from it.
fn reseed_kernel_rng(entropy: &[u8]) -> Result<(), ReqError> {
    let random = File::open(URANDOM).map_err(|e| ReqError::io(URANDOM, &e))?;
    sys::add_entropy(random.as_fd(), entropy)
        .map_err(|e| ReqError::io("adding entropy (RNDADDENTROPY)", &e))?;
    sys::reseed_crng(random.as_fd()).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENODATA) {
            ReqError::new(
                ErrorCode::Io,
                "the kernel's CRNG is not initialised yet; send at least 32 bytes of entropy",
            )
        } else {
            ReqError::io("reseeding the CRNG (RNDRESEEDCRNG)", &e)
        }
    })
}

/// Writes `id` and a newline to `dir`/[`SANDBOX_ID_FILE`] atomically (a temporary file, then
/// rename), creating `dir` (mode 0755) if needed. Returns the file's path.
pub fn write_sandbox_id(dir: &Path, id: &str) -> io::Result<PathBuf> {
    DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
    let temp = dir.join(SANDBOX_ID_TEMP);
    let path = dir.join(SANDBOX_ID_FILE);
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&temp)?;
    file.write_all(format!("{id}\n").as_bytes())?;
    drop(file);
    std::fs::rename(&temp, &path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(entropy: usize, hostname: &str, sandbox_id: &str) -> pb::Reseed {
        pb::Reseed {
            entropy: vec![0xa5; entropy],
            hostname: hostname.into(),
            sandbox_id: sandbox_id.into(),
            disk_bytes: 0,
            mounts: Vec::new(),
            no_root: false,
            ..Default::default()
        }
    }

    fn code(r: pb::Reseed) -> Option<ErrorCode> {
        ReseedSpec::validate(r).err().map(|e| e.code)
    }

    #[test]
    fn entropy_must_be_16_to_512_bytes() {
        let invalid = Some(ErrorCode::InvalidArgument);
        assert_eq!(code(req(0, "", "")), invalid);
        assert_eq!(code(req(15, "", "")), invalid);
        assert_eq!(code(req(16, "", "")), None);
        assert_eq!(code(req(512, "", "")), None);
        assert_eq!(code(req(513, "", "")), invalid);
    }

    #[test]
    fn empty_hostname_and_sandbox_id_mean_leave_as_is() {
        let spec = ReseedSpec::validate(req(32, "", "")).unwrap();
        assert_eq!((spec.hostname, spec.sandbox_id), (None, None));
        let spec = ReseedSpec::validate(req(32, "vm-1.local", "sb_1.a-b")).unwrap();
        assert_eq!(spec.hostname.as_deref(), Some("vm-1.local"));
        assert_eq!(spec.sandbox_id.as_deref(), Some("sb_1.a-b"));
    }

    #[test]
    fn host_names_follow_rfc_1123_and_the_kernel_limit() {
        for good in [
            "a",
            "sandbox-42",
            "x.y.z",
            "0abc",
            &"a".repeat(63),
            &"a.".repeat(32),
        ] {
            assert!(check_hostname(good.trim_end_matches('.')).is_ok(), "{good}");
        }
        let too_long = format!("{}.{}", "a".repeat(40), "b".repeat(24));
        for bad in [
            "-a",
            "a-",
            "a..b",
            ".a",
            "a.",
            "a_b",
            "a b",
            "a/b",
            "ä",
            "a\0",
            &"a".repeat(64 + 1),
            &"a".repeat(64),
            &too_long,
        ] {
            assert!(check_hostname(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sandbox_ids_are_1_to_64_of_a_small_alphabet() {
        for good in ["a", "Sb-1_2.3", &"x".repeat(64), ".", ".."] {
            assert!(check_sandbox_id(good).is_ok(), "{good}");
        }
        for bad in ["", "a/b", "a b", "a\n", "ü", &"x".repeat(65), "a:b"] {
            assert!(check_sandbox_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_sandbox_id_file_is_replaced_whole_and_its_directory_created() {
        let dir = std::env::temp_dir().join(format!("airlock-reseed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let state = dir.join("state");
        let path = write_sandbox_id(&state, "first").unwrap();
        assert_eq!(path, state.join(SANDBOX_ID_FILE));
        write_sandbox_id(&state, "second").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "second\n");
        assert!(!state.join(SANDBOX_ID_TEMP).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
