//! The live sandboxes' secret values, for what is not one sandbox's own: the daemon's log
//! (every value of every sandbox) and a call's error message (the caller's tenant's values
//! only: redacting another tenant's value would tell the caller it guessed one).

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, RwLock};

use super::redact::Patterns;

#[derive(Default)]
struct Registry {
    by_sandbox: HashMap<String, (String, Arc<Patterns>)>,
}

static REGISTRY: RwLock<Option<Registry>> = RwLock::new(None);

/// Sandbox `id` of `tenant` has these values (replacing what it had).
pub fn register(id: &str, tenant: &str, patterns: Arc<Patterns>) {
    if patterns.is_empty() {
        return;
    }
    let mut r = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    r.get_or_insert_with(Registry::default)
        .by_sandbox
        .insert(id.to_owned(), (tenant.to_owned(), patterns));
}

/// Sandbox `id` ended: its values are forgotten.
pub fn unregister(id: &str) {
    let mut r = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    if let Some(r) = r.as_mut() {
        r.by_sandbox.remove(id);
    }
}

/// `text` with the values of `tenant`'s sandboxes (every tenant's: `None`) redacted.
pub fn redact(tenant: Option<&str>, text: &str) -> String {
    let r = REGISTRY.read().unwrap_or_else(|e| e.into_inner());
    let mut out = text.to_owned();
    if let Some(r) = r.as_ref() {
        for (t, p) in r.by_sandbox.values() {
            if tenant.is_none_or(|want| want == t) {
                out = p.redact_str(&out).into_owned();
            }
        }
    }
    out
}

/// `status` with the caller's secret values redacted from its message.
pub fn redact_status(tenant: &str, status: tonic::Status) -> tonic::Status {
    let message = crate::secrets::logs::redact(Some(tenant), status.message());
    if message == status.message() {
        return status;
    }
    tonic::Status::with_details_and_metadata(
        status.code(),
        message,
        status.details().to_vec().into(),
        status.metadata().clone(),
    )
}

fn redact_bytes(data: &[u8]) -> Vec<u8> {
    let r = REGISTRY.read().unwrap_or_else(|e| e.into_inner());
    let mut out = data.to_vec();
    if let Some(r) = r.as_ref() {
        for (_, p) in r.by_sandbox.values() {
            out = p.redact(&out).into_owned();
        }
    }
    out
}

/// The daemon's log writer: standard error, every line redacted (tracing writes each event
/// whole).
#[derive(Clone, Copy, Debug, Default)]
pub struct RedactingStderr;

impl Write for RedactingStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().write_all(&redact_bytes(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactingStderr {
    type Writer = Self;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_redacted_for_their_tenant_and_in_logs_until_unregistered() {
        let p = Arc::new(Patterns::new([("K", b"log-secret-1".as_slice())]));
        register("sb-logs-test", "t1", p);
        assert_eq!(redact(Some("t1"), "x log-secret-1"), "x [REDACTED:K]");
        assert_eq!(redact(Some("t2"), "x log-secret-1"), "x log-secret-1");
        assert_eq!(redact(None, "log-secret-1"), "[REDACTED:K]");
        assert_eq!(redact_bytes(b"log-secret-1"), b"[REDACTED:K]");
        unregister("sb-logs-test");
        assert_eq!(redact(None, "log-secret-1"), "log-secret-1");
    }
}
