//! A sandbox's secrets as the record sealed at rest ([`super::seal`]): everything the daemon
//! holds for them in memory — each secret's value, delivery, TTL (as a wall-clock time) and
//! whether it was removed, whether a value reached the guest, and the broker CA's key and
//! certificate — so that a restarted daemon redacts, delivers, brokers and expires them as
//! the old one did. The plaintext (JSON) is zeroed when dropped.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, Zeroizing};

use super::seal::{SealError, Sealer};
use super::{Broker, Delivery, Entry, SandboxSecrets, Spec, ca, lock};
use crate::ids;

#[derive(Serialize, Deserialize)]
struct Record {
    entries: Vec<RecordEntry>,
    reached_guest: bool,
    ca: Option<RecordCa>,
}

#[derive(Serialize, Deserialize)]
struct RecordEntry {
    name: String,
    value: String,
    delivery: RecordDelivery,
    /// When its TTL ends (ms since the epoch; 0: no TTL).
    expires_unix_ms: i64,
    removed: bool,
}

impl Drop for RecordEntry {
    fn drop(&mut self) {
        self.value.zeroize();
    }
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum RecordDelivery {
    Env {
        var: String,
    },
    File {
        path: String,
        user: String,
    },
    Broker {
        hosts: Vec<String>,
        header: String,
        format: String,
        https: bool,
    },
}

#[derive(Serialize, Deserialize)]
struct RecordCa {
    /// PKCS#8 DER.
    key: Vec<u8>,
    cert: Vec<u8>,
}

impl Drop for RecordCa {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl From<&Delivery> for RecordDelivery {
    fn from(d: &Delivery) -> Self {
        match d {
            Delivery::Env { var } => Self::Env { var: var.clone() },
            Delivery::File { path, user } => Self::File {
                path: path.clone(),
                user: user.clone(),
            },
            Delivery::Broker(b) => Self::Broker {
                hosts: b.host_names.clone(),
                header: b.header.clone(),
                format: b.format.clone(),
                https: b.https,
            },
        }
    }
}

impl RecordDelivery {
    fn delivery(&self) -> Result<Delivery, SealError> {
        Ok(match self {
            Self::Env { var } => Delivery::Env { var: var.clone() },
            Self::File { path, user } => Delivery::File {
                path: path.clone(),
                user: user.clone(),
            },
            Self::Broker {
                hosts,
                header,
                format,
                https,
            } => Delivery::Broker(Broker {
                hosts: hosts
                    .iter()
                    .map(|h| airlock_egress::DomainPattern::parse(h))
                    .collect::<Result<_, _>>()
                    .map_err(|e| SealError::Contents(format!("a broker host: {e}")))?,
                host_names: hosts.clone(),
                header: header.clone(),
                format: format.clone(),
                https: *https,
            }),
        })
    }
}

impl SandboxSecrets {
    /// Its state, sealed for sandbox `id`.
    pub fn seal(&self, id: &str, sealer: &Sealer) -> Result<Vec<u8>, SealError> {
        let record = {
            let entries = lock(&self.entries);
            Record {
                entries: entries
                    .iter()
                    .map(|e| RecordEntry {
                        name: e.spec.name.clone(),
                        value: e.spec.value.to_string(),
                        delivery: (&e.spec.delivery).into(),
                        expires_unix_ms: e.expires_unix_ms,
                        removed: e.removed,
                    })
                    .collect(),
                reached_guest: self.reached_guest.load(Ordering::SeqCst),
                ca: self.ca.get().map(|ca| RecordCa {
                    key: ca.key_der().to_vec(),
                    cert: ca.cert_der().to_vec(),
                }),
            }
        };
        // Room for the worst case (every byte escaped), so that the buffer never moves and
        // leaves a copy behind.
        let strings: usize = record
            .entries
            .iter()
            .map(|e| e.name.len() + e.value.len() + 64 + delivery_len(&e.delivery))
            .sum();
        let ca = record.ca.as_ref().map_or(0, |c| c.key.len() + c.cert.len());
        let mut plain = Zeroizing::new(Vec::with_capacity(6 * strings + 4 * ca + 256));
        serde_json::to_writer(&mut *plain, &record)
            .map_err(|e| SealError::Contents(e.to_string()))?;
        sealer.seal(id, &plain)
    }

    /// The secrets of sandbox `id` from their sealed record. A value that may have reached its
    /// guest (a variable or a file) counts as having reached it.
    pub fn unseal(id: &str, sealer: &Sealer, sealed: &[u8]) -> Result<Self, SealError> {
        let plain = sealer.open(id, sealed)?;
        let mut record: Record =
            serde_json::from_slice(&plain).map_err(|e| SealError::Contents(e.to_string()))?;
        let (now, now_ms) = (Instant::now(), ids::now_ms());
        let entries = record
            .entries
            .iter_mut()
            .map(|e| {
                let left =
                    Duration::from_millis(u64::try_from(e.expires_unix_ms - now_ms).unwrap_or(0));
                let ttl = (e.expires_unix_ms > 0).then_some(left);
                Ok(Entry {
                    spec: Spec {
                        name: e.name.clone(),
                        value: Zeroizing::new(std::mem::take(&mut e.value)),
                        delivery: e.delivery.delivery()?,
                        ttl,
                    },
                    expires: ttl.map(|t| now + t),
                    expires_unix_ms: e.expires_unix_ms,
                    removed: e.removed,
                })
            })
            .collect::<Result<Vec<_>, SealError>>()?;
        // An execution may have had its variables since the record was sealed.
        let reached = record.reached_guest
            || entries
                .iter()
                .any(|e| !matches!(e.spec.delivery, Delivery::Broker(_)));
        let secrets = Self::from_entries(entries, reached);
        if let Some(c) = &record.ca {
            let ca = ca::SandboxCa::restore(id, &c.key, &c.cert)
                .map_err(|e| SealError::Contents(format!("the broker CA: {e}")))?;
            secrets.set_ca(Arc::new(ca));
        }
        Ok(secrets)
    }
}

fn delivery_len(d: &RecordDelivery) -> usize {
    match d {
        RecordDelivery::Env { var } => var.len(),
        RecordDelivery::File { path, user } => path.len() + user.len(),
        RecordDelivery::Broker {
            hosts,
            header,
            format,
            ..
        } => hosts.iter().map(|h| h.len() + 3).sum::<usize>() + header.len() + format.len(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::v1::{Secret, SecretBroker, SecretFile, secret};

    fn secret(name: &str, value: &str, d: Option<secret::Delivery>, ttl_s: u32) -> Secret {
        Secret {
            name: name.into(),
            value: value.into(),
            delivery: d,
            ttl_s,
        }
    }

    #[test]
    fn unsealed_secrets_are_what_was_sealed() {
        let broker = SecretBroker {
            hosts: vec!["*.api.test".into()],
            https: true,
            ..Default::default()
        };
        let specs = super::super::check(
            &[
                secret("K", "key-value", None, 0),
                secret("T", "ttl-value", None, 3600),
                secret(
                    "B",
                    "broker-value",
                    Some(secret::Delivery::Broker(broker)),
                    0,
                ),
                secret(
                    "F",
                    "file-value",
                    Some(secret::Delivery::File(SecretFile::default())),
                    0,
                ),
            ],
            false,
        )
        .unwrap();
        let s = SandboxSecrets::new(specs);
        s.set_ca(Arc::new(ca::SandboxCa::new("sb-1").unwrap()));
        s.remove(&["F".into()]).unwrap();
        let sealer = Sealer::from_key(&[3; 32], "test");
        let sealed = s.seal("sb-1", &sealer).unwrap();
        assert!(!sealed.windows(9).any(|w| w == b"key-value"));
        assert!(SandboxSecrets::unseal("sb-2", &sealer, &sealed).is_err());
        let other = Sealer::from_key(&[4; 32], "test");
        assert!(SandboxSecrets::unseal("sb-1", &other, &sealed).is_err());

        let u = SandboxSecrets::unseal("sb-1", &sealer, &sealed).unwrap();
        assert_eq!(u.info(), s.info());
        assert_eq!(u.env().0, s.env().0);
        let h = u.headers_for("x.api.test", true);
        assert_eq!(h[0].1.as_str(), "Bearer broker-value");
        // The removed file secret stays removed, and redacted.
        assert!(u.files().is_empty());
        assert_eq!(u.patterns().redact_str("file-value"), "[REDACTED:F]");
        // The TTL ends when it would have.
        let left = u.next_expiry().unwrap() - Instant::now();
        assert!(left > Duration::from_secs(3590) && left <= Duration::from_secs(3600));
        // The same CA.
        assert_eq!(u.ca().unwrap().pem(), s.ca().unwrap().pem());
        assert!(u.snapshot_refusal().is_some());
    }

    #[test]
    fn a_ttl_that_ended_while_the_daemon_was_down_ends_at_once() {
        let specs = super::super::check(&[secret("T", "ttl-value", None, 1)], false).unwrap();
        let s = SandboxSecrets::new(specs);
        let sealer = Sealer::from_key(&[3; 32], "test");
        let sealed = s.seal("sb-1", &sealer).unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        let u = SandboxSecrets::unseal("sb-1", &sealer, &sealed).unwrap();
        assert!(u.next_expiry().unwrap() <= Instant::now());
        assert_eq!(u.expire(Instant::now()).0, ["T"]);
    }
}
