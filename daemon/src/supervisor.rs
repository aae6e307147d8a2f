//! The supervisor: every VMM process the daemon holds is recorded (so that a restarted daemon
//! can adopt or reap it) and watched, and its exit arrives as a typed [`VmmExited`] event for
//! whoever owns it (a warm pool, a sandbox). Owners change when a pool process becomes a
//! sandbox's.

use std::collections::HashMap;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tracing::warn;

use crate::error::ApiResult;
use crate::jail::ExitFuture;
use crate::store::{Owner, Store, VmmRecord};
use crate::vmm::VmmProcess;

/// A VMM process ended.
#[derive(Debug)]
pub struct VmmExited {
    pub vmm: VmmProcess,
    /// Who it worked for when it ended.
    pub owner: Option<Owner>,
    /// Its exit status (`None` for an adopted VMM: its status went to its new parent).
    pub status: Option<ExitStatus>,
}

/// Records and watches VMM processes.
#[derive(Debug)]
pub struct Supervisor {
    store: Arc<Store>,
    /// Every watched VMM and its owner, by VMM id.
    watched: Mutex<HashMap<String, (Owner, VmmProcess)>>,
    events: UnboundedSender<VmmExited>,
}

impl Supervisor {
    /// A supervisor and the receiving end of its events.
    pub fn new(store: Arc<Store>) -> (Arc<Self>, UnboundedReceiver<VmmExited>) {
        let (events, rx) = unbounded_channel();
        let me = Self {
            store,
            watched: Mutex::new(HashMap::new()),
            events,
        };
        (Arc::new(me), rx)
    }

    fn watched(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Owner, VmmProcess)>> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `vmm` as `owner`'s, so that a restarted daemon finds it and a stopping one can
    /// kill it.
    pub fn record(&self, vmm: &VmmProcess, owner: &Owner) -> ApiResult<()> {
        self.watched()
            .insert(vmm.id.clone(), (owner.clone(), vmm.clone()));
        self.store.put_vmm(&VmmRecord {
            id: vmm.id.clone(),
            pid: vmm.pid,
            start_ticks: vmm.start_ticks,
            uid: vmm.uid,
            run_dir: vmm.run_dir.display().to_string(),
            cgroup: vmm.cgroup.is_some(),
            owner: owner.clone(),
        })
    }

    /// Forgets a recorded VMM (it is gone).
    pub fn forget(&self, vmm: &VmmProcess) {
        self.watched().remove(&vmm.id);
        if let Err(e) = self.store.remove_vmm(&vmm.id) {
            warn!(vmm = %vmm.id, "forgetting the VMM's record: {e}");
        }
    }

    /// Records `vmm` as `owner`'s and watches it: when `exit` resolves, the VMM is marked
    /// gone, forgotten, and a [`VmmExited`] event goes out. Watched even if recording fails
    /// (it is killed then), so that its exit still cleans up after it.
    pub fn watch(
        self: &Arc<Self>,
        vmm: &VmmProcess,
        exit: ExitFuture,
        owner: Owner,
    ) -> ApiResult<()> {
        let recorded = self.record(vmm, &owner);
        let me = self.clone();
        let v = vmm.clone();
        tokio::spawn(async move {
            let status = match exit.await {
                Ok(s) => s,
                Err(e) => {
                    warn!(vmm = %v.id, "waiting for the VMM: {e}");
                    None
                }
            };
            v.mark_gone();
            let owner = me.watched().remove(&v.id).map(|(o, _)| o);
            if let Err(e) = me.store.remove_vmm(&v.id) {
                warn!(vmm = %v.id, "forgetting the VMM's record: {e}");
            }
            let _ = me.events.send(VmmExited {
                vmm: v,
                owner,
                status,
            });
        });
        recorded.inspect_err(|_| vmm.kill())
    }

    /// Hands a watched VMM to a new owner (a pool process becomes a sandbox's): its exit goes
    /// to the new owner from now on. The store learns of it with the owner's own record
    /// ([`Store::put_running`]): a daemon that dies before then reaps it as a pool process.
    pub fn hand_over(&self, vmm: &VmmProcess, owner: Owner) {
        self.watched().insert(vmm.id.clone(), (owner, vmm.clone()));
    }

    /// Kills every watched VMM whose owner `keep` does not keep; returns them (to wait for).
    pub fn kill_all_but(&self, keep: impl Fn(&Owner) -> bool) -> Vec<VmmProcess> {
        let doomed: Vec<VmmProcess> = self
            .watched()
            .values()
            .filter(|(owner, _)| !keep(owner))
            .map(|(_, v)| v.clone())
            .collect();
        for v in &doomed {
            v.kill();
        }
        doomed
    }
}
