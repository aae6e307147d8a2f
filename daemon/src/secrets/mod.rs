//! Secrets: checked from a request, held in the daemon's memory only (zeroed when dropped;
//! records keep names), delivered as an execution's environment variable, a file in the guest
//! readable by one account, or brokered by the egress proxy (a header on requests to named
//! hosts; the value never enters the guest), removed at their TTL or by RemoveSecrets, and
//! redacted everywhere: output, records, errors and the daemon's log ([`redact`], [`logs`]).
//! A live sandbox's secrets are also sealed at rest ([`seal`], [`sealed`]) so that a restarted
//! daemon adopts it with them; the sealed record goes with the sandbox.

pub mod ca;
pub mod logs;
pub mod redact;
pub mod seal;
mod sealed;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use airlock_api::v1::{Secret, SecretInfo, secret};
use zeroize::Zeroizing;

use crate::error::{ApiError, ApiResult};
use crate::ids;
use redact::Patterns;

pub const MAX_SECRETS: usize = 32;
pub const MIN_VALUE_BYTES: usize = 4;
pub const MAX_VALUE_BYTES: usize = 64 << 10;
/// Where a file secret goes when its request names no path (a tmpfs: RAM only).
pub const DEFAULT_DIR: &str = "/run/secrets";

/// How a secret reaches its use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery {
    Env { var: String },
    File { path: String, user: String },
    Broker(Broker),
}

/// A header the egress proxy adds for the named hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Broker {
    pub hosts: Vec<airlock_egress::DomainPattern>,
    pub host_names: Vec<String>,
    pub header: String,
    pub format: String,
    pub https: bool,
}

/// One checked secret. Its value is zeroed when dropped and never printed.
pub struct Spec {
    pub name: String,
    pub value: Zeroizing<String>,
    pub delivery: Delivery,
    pub ttl: Option<Duration>,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec")
            .field("name", &self.name)
            .field("value", &"[hidden]")
            .field("delivery", &self.delivery)
            .field("ttl", &self.ttl)
            .finish()
    }
}

fn bad(msg: String) -> ApiError {
    ApiError::InvalidArgument(msg)
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && n.len() <= 64
}

/// Checks a request's secrets (`exec`: an execution's, which may only be variables).
pub fn check(secrets: &[Secret], exec: bool) -> ApiResult<Vec<Spec>> {
    if secrets.len() > MAX_SECRETS {
        return Err(bad(format!("at most {MAX_SECRETS} secrets")));
    }
    let mut out: Vec<Spec> = Vec::with_capacity(secrets.len());
    for s in secrets {
        if !valid_name(&s.name) {
            return Err(bad(format!(
                "secret name {:?}: [A-Za-z_][A-Za-z0-9_]{{0,63}}",
                s.name
            )));
        }
        if out.iter().any(|o| o.name == s.name) {
            return Err(bad(format!("secret {} is given twice", s.name)));
        }
        let len = s.value.len();
        if !(MIN_VALUE_BYTES..=MAX_VALUE_BYTES).contains(&len) || s.value.contains('\0') {
            return Err(bad(format!(
                "secret {}: its value must be {MIN_VALUE_BYTES} to {MAX_VALUE_BYTES} bytes \
                 without NUL",
                s.name
            )));
        }
        let delivery = match &s.delivery {
            None => Delivery::Env {
                var: s.name.clone(),
            },
            Some(secret::Delivery::Env(e)) => {
                let var = if e.var.is_empty() {
                    s.name.clone()
                } else {
                    e.var.clone()
                };
                if var.contains('=') || var.contains('\0') || var.len() > 256 {
                    return Err(bad(format!("secret {}: variable {var:?}", s.name)));
                }
                Delivery::Env { var }
            }
            Some(_) if exec => {
                return Err(bad(format!(
                    "secret {}: an execution's secrets are environment variables only (files \
                     and brokered secrets belong to the sandbox)",
                    s.name
                )));
            }
            Some(secret::Delivery::File(f)) => {
                let path = if f.path.is_empty() {
                    format!("{DEFAULT_DIR}/{}", s.name)
                } else {
                    f.path.clone()
                };
                crate::files::check_absolute(&path)?;
                if path == "/" {
                    return Err(bad(format!("secret {}: path /", s.name)));
                }
                crate::limits::check_user(&f.user)?;
                Delivery::File {
                    path,
                    user: f.user.clone(),
                }
            }
            Some(secret::Delivery::Broker(b)) => Delivery::Broker(check_broker(&s.name, b)?),
        };
        if let Delivery::File { path, .. } = &delivery
            && out
                .iter()
                .any(|o| matches!(&o.delivery, Delivery::File { path: p, .. } if p == path))
        {
            return Err(bad(format!("two secrets at {path}")));
        }
        out.push(Spec {
            name: s.name.clone(),
            value: Zeroizing::new(s.value.clone()),
            delivery,
            ttl: (s.ttl_s > 0).then(|| Duration::from_secs(u64::from(s.ttl_s))),
        });
    }
    Ok(out)
}

fn check_broker(name: &str, b: &airlock_api::v1::SecretBroker) -> ApiResult<Broker> {
    if b.hosts.is_empty() || b.hosts.len() > 16 {
        return Err(bad(format!("secret {name}: 1 to 16 broker hosts")));
    }
    let hosts = b
        .hosts
        .iter()
        .map(|h| {
            airlock_egress::DomainPattern::parse(h)
                .map_err(|e| bad(format!("secret {name}: broker host {h:?}: {e}")))
        })
        .collect::<ApiResult<Vec<_>>>()?;
    let header = if b.header.is_empty() {
        "Authorization".to_owned()
    } else {
        b.header.clone()
    };
    if hyper::header::HeaderName::from_bytes(header.as_bytes()).is_err() {
        return Err(bad(format!("secret {name}: header {header:?}")));
    }
    let format = if b.format.is_empty() {
        "Bearer {value}".to_owned()
    } else {
        b.format.clone()
    };
    if !format.contains("{value}") || format.len() > 1024 {
        return Err(bad(format!(
            "secret {name}: the header's format must contain {{value}}"
        )));
    }
    Ok(Broker {
        hosts,
        host_names: b.hosts.clone(),
        header,
        format,
        https: b.https,
    })
}

/// A secret of a sandbox, with its state.
#[derive(Debug)]
struct Entry {
    spec: Spec,
    expires: Option<Instant>,
    expires_unix_ms: i64,
    removed: bool,
}

/// A sandbox's secrets.
#[derive(Debug, Default)]
pub struct SandboxSecrets {
    entries: Mutex<Vec<Entry>>,
    /// Every value it ever had, removed ones too: they stay redacted until it ends.
    patterns: Mutex<Arc<Patterns>>,
    /// A value reached its guest (a variable or a file): its memory may keep copies.
    reached_guest: AtomicBool,
    /// Its own CA, when a brokered secret is for HTTPS too.
    ca: std::sync::OnceLock<Arc<ca::SandboxCa>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A removed file secret, to delete in the guest.
#[derive(Debug, Clone)]
pub struct RemovedFile {
    pub name: String,
    pub path: String,
}

impl SandboxSecrets {
    pub fn new(specs: Vec<Spec>) -> Self {
        let now = Instant::now();
        let entries: Vec<Entry> = specs
            .into_iter()
            .map(|spec| Entry {
                expires: spec.ttl.map(|t| now + t),
                expires_unix_ms: spec.ttl.map_or(0, |t| {
                    ids::now_ms() + i64::try_from(t.as_millis()).unwrap_or(i64::MAX / 2)
                }),
                removed: false,
                spec,
            })
            .collect();
        Self::from_entries(entries, false)
    }

    /// With `entries` (removed ones too), whose values all stay redacted.
    fn from_entries(entries: Vec<Entry>, reached_guest: bool) -> Self {
        let patterns = Arc::new(Patterns::new(
            entries
                .iter()
                .map(|e| (e.spec.name.as_str(), e.spec.value.as_bytes())),
        ));
        Self {
            entries: Mutex::new(entries),
            patterns: Mutex::new(patterns),
            reached_guest: AtomicBool::new(reached_guest),
            ca: std::sync::OnceLock::new(),
        }
    }

    /// Whether it never had a secret.
    pub fn is_empty(&self) -> bool {
        lock(&self.entries).is_empty()
    }

    /// Whether a brokered secret asks for HTTPS (the sandbox needs a CA of its own).
    pub fn needs_ca(&self) -> bool {
        lock(&self.entries)
            .iter()
            .any(|e| matches!(&e.spec.delivery, Delivery::Broker(b) if b.https))
    }

    /// Gives the sandbox its CA (once).
    pub fn set_ca(&self, ca: Arc<ca::SandboxCa>) {
        let _ = self.ca.set(ca);
    }

    /// Its CA, if it has one.
    pub fn ca(&self) -> Option<&Arc<ca::SandboxCa>> {
        self.ca.get()
    }

    /// Whether a live secret is brokered (the proxy must learn every connection's name).
    pub fn brokers(&self) -> bool {
        lock(&self.entries)
            .iter()
            .any(|e| !e.removed && matches!(e.spec.delivery, Delivery::Broker(_)))
    }

    /// The redaction patterns of every value it had.
    pub fn patterns(&self) -> Arc<Patterns> {
        lock(&self.patterns).clone()
    }

    /// Patterns of its values and `extra` (an execution's own secrets).
    pub fn patterns_with(&self, extra: &[Spec]) -> Arc<Patterns> {
        if extra.is_empty() {
            return self.patterns();
        }
        let entries = lock(&self.entries);
        let all = entries
            .iter()
            .map(|e| &e.spec)
            .chain(extra)
            .map(|s| (s.name.as_str(), s.value.as_bytes()));
        Arc::new(Patterns::new(all))
    }

    /// The variables of its live env secrets, and their names.
    pub fn env(&self) -> (HashMap<String, String>, Vec<String>) {
        let entries = lock(&self.entries);
        let mut env = HashMap::new();
        let mut names = Vec::new();
        for e in entries.iter().filter(|e| !e.removed) {
            if let Delivery::Env { var } = &e.spec.delivery {
                env.insert(var.clone(), e.spec.value.to_string());
                names.push(e.spec.name.clone());
            }
        }
        if !env.is_empty() {
            self.reached_guest.store(true, Ordering::SeqCst);
        }
        (env, names)
    }

    /// Its live file secrets: (name, path, user, value).
    pub fn files(&self) -> Vec<(String, String, String, Zeroizing<String>)> {
        let entries = lock(&self.entries);
        let files: Vec<_> = entries
            .iter()
            .filter(|e| !e.removed)
            .filter_map(|e| match &e.spec.delivery {
                Delivery::File { path, user } => Some((
                    e.spec.name.clone(),
                    path.clone(),
                    user.clone(),
                    e.spec.value.clone(),
                )),
                _ => None,
            })
            .collect();
        if !files.is_empty() {
            self.reached_guest.store(true, Ordering::SeqCst);
        }
        files
    }

    /// The headers the proxy adds to a request for `host` (`https`: a TLS connection), with
    /// the names of the secrets they carry: (header, value, secret name).
    pub fn headers_for(&self, host: &str, https: bool) -> Vec<(String, Zeroizing<String>, String)> {
        let entries = lock(&self.entries);
        entries
            .iter()
            .filter(|e| !e.removed)
            .filter_map(|e| match &e.spec.delivery {
                Delivery::Broker(b)
                    if (!https || b.https)
                        && b.hosts.iter().any(|p| {
                            p.matches(
                                &airlock_egress::policy::normalise_name(host).unwrap_or_default(),
                            )
                        }) =>
                {
                    let value = Zeroizing::new(b.format.replace("{value}", &e.spec.value));
                    Some((b.header.clone(), value, e.spec.name.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Why it may not be snapshotted, if it may not.
    pub fn snapshot_refusal(&self) -> Option<String> {
        let entries = lock(&self.entries);
        let live: Vec<&str> = entries
            .iter()
            .filter(|e| !e.removed)
            .map(|e| e.spec.name.as_str())
            .collect();
        if !live.is_empty() {
            return Some(format!(
                "it holds secrets ({}); remove them first (RemoveSecrets)",
                live.join(", ")
            ));
        }
        if self.reached_guest.load(Ordering::SeqCst) {
            return Some(
                "secret values reached its guest (variables or files), whose memory may keep \
                 copies; snapshot a sandbox that never had them"
                    .into(),
            );
        }
        None
    }

    /// Marks `names` (empty: all) removed; the file secrets among them, to delete in the
    /// guest. An unknown name is an error.
    pub fn remove(&self, names: &[String]) -> ApiResult<Vec<RemovedFile>> {
        let mut entries = lock(&self.entries);
        for n in names {
            if !entries.iter().any(|e| &e.spec.name == n) {
                return Err(bad(format!("no secret {n:?} in the sandbox")));
            }
        }
        let chosen = |e: &Entry| names.is_empty() || names.contains(&e.spec.name);
        Ok(take_removed(entries.iter_mut().filter(|e| chosen(e))))
    }

    /// Marks the secrets whose TTL ended by `now` removed: their names and files.
    pub fn expire(&self, now: Instant) -> (Vec<String>, Vec<RemovedFile>) {
        let mut entries = lock(&self.entries);
        let due: Vec<&mut Entry> = entries
            .iter_mut()
            .filter(|e| !e.removed && e.expires.is_some_and(|t| t <= now))
            .collect();
        let names = due.iter().map(|e| e.spec.name.clone()).collect();
        (names, take_removed(due.into_iter()))
    }

    /// When the next live secret's TTL ends.
    pub fn next_expiry(&self) -> Option<Instant> {
        lock(&self.entries)
            .iter()
            .filter(|e| !e.removed)
            .filter_map(|e| e.expires)
            .min()
    }

    /// As the API shows them.
    pub fn info(&self) -> Vec<SecretInfo> {
        lock(&self.entries)
            .iter()
            .map(|e| {
                let (delivery, targets) = match &e.spec.delivery {
                    Delivery::Env { var } => ("env", vec![var.clone()]),
                    Delivery::File { path, .. } => ("file", vec![path.clone()]),
                    Delivery::Broker(b) => ("broker", b.host_names.clone()),
                };
                SecretInfo {
                    name: e.spec.name.clone(),
                    delivery: delivery.into(),
                    targets,
                    expires_unix_ms: e.expires_unix_ms,
                    removed: e.removed,
                }
            })
            .collect()
    }
}

fn take_removed<'a>(entries: impl Iterator<Item = &'a mut Entry>) -> Vec<RemovedFile> {
    let mut files = Vec::new();
    for e in entries {
        if e.removed {
            continue;
        }
        e.removed = true;
        if let Delivery::File { path, .. } = &e.spec.delivery {
            files.push(RemovedFile {
                name: e.spec.name.clone(),
                path: path.clone(),
            });
        }
    }
    files
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::v1::{SecretBroker, SecretEnv, SecretFile};

    fn secret(name: &str, value: &str, d: Option<secret::Delivery>) -> Secret {
        Secret {
            name: name.into(),
            value: value.into(),
            delivery: d,
            ttl_s: 0,
        }
    }

    #[test]
    fn requests_are_checked() {
        assert!(check(&[secret("A", "abcd", None)], false).is_ok());
        for bad in [
            vec![secret("1A", "abcd", None)],
            vec![secret("A-B", "abcd", None)],
            vec![secret("A", "abc", None)],
            vec![secret("A", "ab\0cd", None)],
            vec![secret("A", "abcd", None), secret("A", "efgh", None)],
            vec![secret(
                "A",
                "abcd",
                Some(secret::Delivery::File(SecretFile {
                    path: "rel".into(),
                    user: String::new(),
                })),
            )],
            vec![secret(
                "A",
                "abcd",
                Some(secret::Delivery::Broker(SecretBroker::default())),
            )],
            vec![secret(
                "A",
                "abcd",
                Some(secret::Delivery::Broker(SecretBroker {
                    hosts: vec!["api.test".into()],
                    format: "no placeholder".into(),
                    ..Default::default()
                })),
            )],
        ] {
            assert!(check(&bad, false).is_err(), "{bad:?}");
        }
        let file = secret(
            "F",
            "abcd",
            Some(secret::Delivery::File(SecretFile::default())),
        );
        assert!(check(std::slice::from_ref(&file), true).is_err());
        let specs = check(&[file], false).unwrap();
        assert_eq!(
            specs[0].delivery,
            Delivery::File {
                path: "/run/secrets/F".into(),
                user: String::new()
            }
        );
        assert!(!format!("{specs:?}").contains("abcd"));
    }

    #[test]
    fn deliveries_removal_expiry_and_snapshots() {
        let mut ttl = secret(
            "T",
            "ttl-value",
            Some(secret::Delivery::Env(SecretEnv { var: "TV".into() })),
        );
        ttl.ttl_s = 1;
        let specs = check(
            &[
                secret("K", "key-value", None),
                ttl,
                secret(
                    "B",
                    "broker-value",
                    Some(secret::Delivery::Broker(SecretBroker {
                        hosts: vec!["*.api.test".into()],
                        ..Default::default()
                    })),
                ),
                secret(
                    "F",
                    "file-value",
                    Some(secret::Delivery::File(SecretFile::default())),
                ),
            ],
            false,
        )
        .unwrap();
        let s = SandboxSecrets::new(specs);
        assert!(s.snapshot_refusal().is_some());
        let h = s.headers_for("x.api.test", false);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].0, "Authorization");
        assert_eq!(h[0].1.as_str(), "Bearer broker-value");
        assert!(s.headers_for("x.api.test", true).is_empty());
        assert!(s.headers_for("other.test", false).is_empty());
        let (env, names) = s.env();
        assert_eq!(env["K"], "key-value");
        assert_eq!(env["TV"], "ttl-value");
        assert_eq!(names.len(), 2);
        let (expired, _) = s.expire(Instant::now() + Duration::from_secs(2));
        assert_eq!(expired, ["T"]);
        assert!(!s.env().0.contains_key("TV"));
        // Still redacted after its removal.
        assert_eq!(s.patterns().redact_str("ttl-value"), "[REDACTED:T]");
        let files = s.remove(&[]).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].path, "/run/secrets/F");
        assert!(s.remove(&["nope".into()]).is_err());
        // Every secret removed, but values reached the guest.
        assert!(s.snapshot_refusal().unwrap().contains("reached its guest"));
        assert!(s.info().iter().all(|i| i.removed));
        // Brokered only, removed: it may be snapshotted.
        let b = SandboxSecrets::new(
            check(
                &[secret(
                    "B",
                    "broker-value",
                    Some(secret::Delivery::Broker(SecretBroker {
                        hosts: vec!["api.test".into()],
                        ..Default::default()
                    })),
                )],
                false,
            )
            .unwrap(),
        );
        assert!(b.snapshot_refusal().is_some());
        b.remove(&["B".into()]).unwrap();
        assert!(b.snapshot_refusal().is_none());
    }
}
