//! A live sandbox's secrets after its create: sealed at rest for a restarted daemon, removed
//! by RemoveSecrets or at their TTL (their files deleted in the guest, their variables no
//! longer given, their headers no longer added, the sealed record saying so too), its record
//! showing which.

use std::sync::Arc;

use airlock_api::v1::Sandbox;
use airlock_proto::{ClientError, Requests};
use tracing::{info, warn};

use super::{SandboxRt, Sandboxes};
use crate::agent::CALL_TIMEOUT;
use crate::error::ApiResult;
use crate::secrets::seal::Sealer;
use crate::secrets::{RemovedFile, SandboxSecrets};
use crate::store::Store;

/// `secrets` of sandbox `id` sealed, if it has any and sealing is on (a failure is logged: the
/// sandbox then does not survive a restart of the daemon).
pub(crate) fn seal(sealer: Option<&Sealer>, id: &str, secrets: &SandboxSecrets) -> Option<Vec<u8>> {
    if secrets.is_empty() {
        return None;
    }
    let Some(sealer) = sealer else {
        warn!(sandbox = %id, "its secrets are not sealed at rest: a restart of the daemon ends it");
        return None;
    };
    secrets
        .seal(id, sealer)
        .inspect_err(|e| warn!(sandbox = %id, "sealing its secrets: {e}"))
        .ok()
}

impl Sandboxes {
    /// RemoveSecrets: `names` (empty: all) of `tenant`'s sandbox `id`.
    pub async fn remove_secrets(
        &self,
        tenant: &str,
        id: &str,
        names: &[String],
    ) -> ApiResult<Sandbox> {
        let rt = self.running(tenant, id)?;
        let files = rt.secrets.remove(names)?;
        let record = settle_removal(&rt, &self.store, self.sealer.as_deref(), files).await;
        info!(sandbox = %id, names = ?names, "secrets removed");
        crate::audit::emit(
            tenant,
            crate::audit::Kind::SecretRemove,
            id,
            "",
            serde_json::json!({ "names": names, "by": "RemoveSecrets" }),
        );
        Ok(record)
    }

    /// Removes `rt`'s secrets as their TTLs end, until it ends (at once those that ended
    /// while the daemon was down).
    pub(crate) fn expire_secrets_later(&self, rt: &Arc<SandboxRt>) {
        let (weak, store) = (Arc::downgrade(rt), self.store.clone());
        let sealer = self.sealer.clone();
        tokio::spawn(async move {
            loop {
                let Some(next) = weak.upgrade().and_then(|rt| rt.secrets.next_expiry()) else {
                    return;
                };
                tokio::time::sleep_until(next.into()).await;
                let Some(rt) = weak.upgrade().filter(|rt| !rt.is_ending()) else {
                    return;
                };
                let (names, files) = rt.secrets.expire(std::time::Instant::now());
                if !names.is_empty() {
                    info!(sandbox = %rt.id, names = ?names, "secrets expired");
                    crate::audit::emit(
                        &rt.tenant,
                        crate::audit::Kind::SecretRemove,
                        &rt.id,
                        "",
                        serde_json::json!({ "names": names, "by": "ttl" }),
                    );
                    settle_removal(&rt, &store, sealer.as_deref(), files).await;
                }
            }
        });
    }
}

/// After secrets of `rt` were marked removed: seals them again (a restarted daemon must not
/// bring them back), deletes their files in its guest, updates its record.
async fn settle_removal(
    rt: &Arc<SandboxRt>,
    store: &Store,
    sealer: Option<&Sealer>,
    files: Vec<RemovedFile>,
) -> Sandbox {
    let stored = match seal(sealer, &rt.id, &rt.secrets) {
        Some(sealed) => store.put_sealed_secrets(&rt.id, &sealed),
        None => Err(crate::error::ApiError::Internal("not sealed".into())),
    };
    if let Err(e) = stored {
        // Better not adopted after a restart than with the removed secrets back.
        warn!(sandbox = %rt.id, "sealing its secrets again: {e}; the old record is removed");
        if let Err(e) = store.remove_sealed_secrets(&rt.id) {
            warn!(sandbox = %rt.id, "removing its sealed secrets: {e}");
        }
    }
    if !files.is_empty()
        && let Some(vmm) = rt.vmm()
    {
        let agent = vmm.agent.clone();
        let removed = tokio::task::spawn_blocking(move || remove_files(&agent, &files)).await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(sandbox = %rt.id, "deleting secret files in the guest: {e}"),
            Err(e) => warn!(sandbox = %rt.id, "deleting secret files in the guest: {e}"),
        }
    }
    let info = rt.secrets.info();
    let record = rt.update(|r| r.secrets = info);
    if let Err(e) = store.put_sandbox(&record) {
        warn!(sandbox = %rt.id, "storing the record: {e}");
    }
    record
}

/// Why a removed secret's file could not be deleted in the guest.
#[derive(Debug, thiserror::Error)]
enum RemoveError {
    /// The guest agent could not be reached.
    #[error(transparent)]
    Agent(#[from] ClientError),
    #[error("{path} ({name}): {source}")]
    File {
        path: String,
        name: String,
        source: ClientError,
    },
}

fn remove_files(agent: &crate::agent::AgentLink, files: &[RemovedFile]) -> Result<(), RemoveError> {
    let deadline = std::time::Instant::now() + CALL_TIMEOUT;
    let mux = agent.get(deadline)?;
    let mut client = mux.client(Some(deadline));
    for f in files {
        let req = airlock_proto::pb::Remove {
            path: f.path.clone(),
            ..Default::default()
        };
        client
            .call(airlock_proto::pb::request::Kind::Remove(req))
            .map_err(|source| RemoveError::File {
                path: f.path.clone(),
                name: f.name.clone(),
                source,
            })?;
    }
    Ok(())
}
