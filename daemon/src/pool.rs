//! Warm pools: per template, `pool_size` `airlock-vmm pool` processes that have made their KVM
//! VM and mapped the template's memory before anyone asks, so that a create only restores.
//! A create takes one; the pool refills after the create has answered.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::warn;

use crate::host::VmmHost;
use crate::store::Owner;
use crate::templates::{TemplateRt, Templates};
use crate::vmm::VmmProcess;

/// The warm pools of every template.
#[derive(Debug)]
pub struct WarmPool {
    size: usize,
    /// The largest `disk_mib`: what a warm VMM's writable root may take until its restore.
    max_disk_mib: u32,
    host: Arc<VmmHost>,
    templates: Arc<Templates>,
    warm: Mutex<HashMap<String, Vec<VmmProcess>>>,
    /// Template ids whose pool is being refilled.
    refilling: Mutex<HashSet<String>>,
}

impl WarmPool {
    pub fn new(
        size: usize,
        max_disk_mib: u32,
        host: Arc<VmmHost>,
        templates: Arc<Templates>,
    ) -> Self {
        Self {
            size,
            max_disk_mib,
            host,
            templates,
            warm: Mutex::new(HashMap::new()),
            refilling: Mutex::new(HashSet::new()),
        }
    }

    fn warm(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<VmmProcess>>> {
        self.warm.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A warm VMM of template `id`, if one is ready.
    pub fn take(&self, id: &str) -> Option<VmmProcess> {
        let mut warm = self.warm();
        let v = warm.get_mut(id)?;
        (!v.is_empty()).then(|| v.remove(0))
    }

    /// Warm VMMs of every template.
    pub fn len(&self) -> usize {
        self.warm().values().map(Vec::len).sum()
    }

    /// Keeps `pool_size` warm VMM processes for `t` (on a task of its own).
    pub fn refill(self: &Arc<Self>, t: &TemplateRt) {
        let id = t.record.id.clone();
        if self.size == 0
            || !self
                .refilling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id.clone())
        {
            return;
        }
        let me = self.clone();
        let t = t.clone();
        tokio::spawn(async move {
            me.fill(&t).await;
            me.refilling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        });
    }

    async fn fill(&self, t: &TemplateRt) {
        let id = &t.record.id;
        loop {
            let have = self.warm().get(id).map_or(0, Vec::len);
            if have >= self.size || self.templates.by_id(id).is_none() || self.host.stopping() {
                return;
            }
            let started = self
                .host
                .start_pool_vmm(&t.pool_spec(self.max_disk_mib), Owner::Pool(id.clone()))
                .await;
            match started {
                // A daemon that stopped meanwhile has drained the pool already.
                Ok(p) if self.host.stopping() => p.kill(),
                Ok(p) => self.warm().entry(id.clone()).or_default().push(p),
                Err(e) => {
                    warn!(template = %t.record.name, "warm pool: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// Fills the pools of every template (at start).
    pub fn refill_all(self: &Arc<Self>) {
        for t in self.templates.list() {
            self.refill(&t);
        }
    }

    /// A warm VMM of template `template_id` ended: forget it.
    pub fn exited(&self, template_id: &str, vmm: &VmmProcess) {
        if let Some(v) = self.warm().get_mut(template_id) {
            v.retain(|p| p.id != vmm.id);
        }
    }

    /// Kills the warm VMMs of template `id` (deleted); their exits clean up after them.
    pub fn remove_template(&self, id: &str) {
        for p in self.warm().remove(id).unwrap_or_default() {
            p.kill();
        }
    }

    /// Kills every warm VMM (shutdown) and returns them.
    pub fn drain(&self) -> Vec<VmmProcess> {
        let all: Vec<VmmProcess> = self.warm().drain().flat_map(|(_, v)| v).collect();
        for p in &all {
            p.kill();
        }
        all
    }
}
