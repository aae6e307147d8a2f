//! Volumes: a tenant's ext4 file systems that outlive sandboxes, daemon restarts and host
//! reboots. Each is a file `DATA_DIR/volumes/<id>.ext4` (made sparse, formatted by
//! `mkfs.ext4`, its root owned by the guest's `user`) and a record in the store. A sandbox
//! mounts it through one of its template's empty disk slots: the daemon opens the file and
//! hands the descriptor to the sandbox's VMM with its restore request (the VMM's jail holds no
//! volume), and the agent mounts it where the request says. A volume has one read-write user
//! or any number of read-only ones; who uses it is known from the live sandboxes (and, after a
//! restart, from the adopted sandboxes' specs).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use airlock_api::v1::{Volume, VolumeAttachment};
use tracing::{info, warn};

use crate::config::Quota;
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::store::Store;

/// The smallest volume (MiB): room for ext4's own structures and a journal.
pub const MIN_VOLUME_MIB: u32 = 16;
/// The guest's `user` (uid and gid), who owns a new volume's root.
const GUEST_USER: u32 = 1000;

/// One volume as the daemon keeps it.
#[derive(Debug, Clone)]
struct Entry {
    tenant: String,
    id: String,
    record: Volume,
}

/// Who has a volume mounted.
#[derive(Debug, Default)]
struct Users {
    read_write: Option<String>,
    read_only: Vec<String>,
}

/// A sandbox's claim on its volumes: the files to hand to its VMM, in attachment order, each
/// with whether it is read-only. Dropping it without [`Claim::keep`] releases them.
#[derive(Debug)]
pub struct Claim {
    volumes: Arc<Volumes>,
    sandbox: String,
    pub media: Vec<(std::fs::File, bool)>,
    kept: bool,
}

impl Claim {
    /// The sandbox runs with them: they stay its until [`Volumes::release`].
    pub fn keep(mut self) -> Vec<(std::fs::File, bool)> {
        self.kept = true;
        std::mem::take(&mut self.media)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.kept {
            self.volumes.release(&self.sandbox);
        }
    }
}

/// The volumes of every tenant.
#[derive(Debug)]
pub struct Volumes {
    dir: PathBuf,
    store: Arc<Store>,
    mkfs: Option<PathBuf>,
    /// Slots a template has: a sandbox mounts at most this many.
    slots: usize,
    max_size_mib: u32,
    all: Mutex<Vec<Entry>>,
    /// Creates under way (tenant, name, size): counted against the quota and the names from
    /// the quota check until their volume is listed or the create fails. Only ever locked
    /// while `all` is held, so the check and the reservation are one step.
    pending: Mutex<Vec<(String, String, u32)>>,
    users: Mutex<HashMap<String, Users>>,
}

/// A create's place in [`Volumes::pending`], given back when dropped.
struct Reserved<'v> {
    volumes: &'v Volumes,
    tenant: String,
    name: String,
    /// Already taken out of `pending` (by [`Volumes::keep`], with the volume listed).
    listed: bool,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if self.listed {
            return;
        }
        let _all = lock(&self.volumes.all);
        lock(&self.volumes.pending).retain(|(t, n, _)| !(*t == self.tenant && *n == self.name));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A volume's name: 1..=63 of `[a-z0-9_-]`, starting with a letter or a digit.
pub fn check_name(name: &str) -> ApiResult<()> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "volume name {name:?}: 1..=63 of [a-z0-9_-], starting with a letter or a digit"
        )))
    }
}

/// Where a volume may be mounted in the guest: absolute, normalised, not `/`, not under the
/// kernel's file systems.
pub fn check_mount_path(path: &str) -> ApiResult<()> {
    let p = Path::new(path);
    let normal = path.len() <= 4096
        && path
            .strip_prefix('/')
            .is_some_and(|rest| rest.split('/').all(|seg| !matches!(seg, "" | "." | "..")));
    let reserved = ["/proc", "/sys", "/dev", "/run"]
        .iter()
        .any(|r| p.starts_with(r));
    if normal && !reserved {
        Ok(())
    } else {
        Err(ApiError::InvalidArgument(format!(
            "mount path {path:?}: an absolute, normalised path below /, not under /proc, /sys, \
             /dev or /run"
        )))
    }
}

impl Volumes {
    /// The volumes recorded in `store`, their files in `dir` (made if missing).
    pub fn load(
        dir: PathBuf,
        store: Arc<Store>,
        mkfs: Option<&Path>,
        slots: u32,
        max_size_mib: u32,
    ) -> ApiResult<Self> {
        std::fs::create_dir_all(&dir)?;
        let all = store
            .volumes()?
            .into_iter()
            .map(|(tenant, id, record)| Entry { tenant, id, record })
            .collect();
        Ok(Self {
            dir,
            store,
            mkfs: crate::fileinfo::find_mkfs(mkfs),
            slots: slots as usize,
            max_size_mib,
            all: Mutex::new(all),
            pending: Mutex::new(Vec::new()),
            users: Mutex::new(HashMap::new()),
        })
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.ext4"))
    }

    fn find(&self, tenant: &str, name: &str) -> Option<Entry> {
        lock(&self.all)
            .iter()
            .find(|e| e.tenant == tenant && e.record.name == name)
            .cloned()
    }

    /// A volume's record as callers see it: its space on disk and who has it mounted.
    fn view(&self, e: &Entry) -> Volume {
        let mut v = e.record.clone();
        v.used_bytes = crate::fileinfo::disk_bytes(&self.file(&e.id));
        if let Some(u) = lock(&self.users).get(&e.id) {
            v.attached_to = u.read_write.iter().chain(&u.read_only).cloned().collect();
        }
        v
    }

    /// CreateVolume: a new, formatted volume of `tenant`'s.
    pub async fn create(
        &self,
        tenant: &str,
        quota: &Quota,
        name: &str,
        size_mib: u32,
    ) -> ApiResult<Volume> {
        check_name(name)?;
        if !(MIN_VOLUME_MIB..=self.max_size_mib).contains(&size_mib) {
            return Err(ApiError::InvalidArgument(format!(
                "size_mib {size_mib}: between {MIN_VOLUME_MIB} and {}",
                self.max_size_mib
            )));
        }
        let mkfs = self.mkfs.clone().ok_or_else(|| {
            ApiError::Internal(
                "volumes need e2fsprogs' mkfs.ext4 on the daemon's host (apt-get install \
                 e2fsprogs)"
                    .into(),
            )
        })?;
        let (id, reserved) = self.new_id(tenant, quota, name, size_mib)?;
        let file = self.file(&id);
        format(&mkfs, &file, name, size_mib)
            .await
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&file);
            })?;
        let record = Volume {
            name: name.to_owned(),
            size_mib,
            created_unix_ms: ids::now_ms(),
            ..Default::default()
        };
        let entry = Entry {
            tenant: tenant.to_owned(),
            id: id.clone(),
            record,
        };
        self.keep(tenant, &file, &entry, reserved)?;
        info!(tenant, volume = name, size_mib, "volume created");
        Ok(self.view(&entry))
    }

    /// Create step: the new volume's id, once `tenant` has no volume `name` and room for
    /// `size_mib` more within its quota, counting the creates under way; its place among them
    /// is reserved until the returned guard is dropped (after [`Volumes::keep`]).
    fn new_id(
        &self,
        tenant: &str,
        quota: &Quota,
        name: &str,
        size_mib: u32,
    ) -> ApiResult<(String, Reserved<'_>)> {
        let all = lock(&self.all);
        let mut pending = lock(&self.pending);
        let mine: Vec<(&str, u32)> = all
            .iter()
            .filter(|e| e.tenant == tenant)
            .map(|e| (e.record.name.as_str(), e.record.size_mib))
            .chain(
                pending
                    .iter()
                    .filter(|(t, _, _)| t == tenant)
                    .map(|(_, n, s)| (n.as_str(), *s)),
            )
            .collect();
        if mine.iter().any(|(n, _)| *n == name) {
            return Err(ApiError::VolumeExists(name.to_owned()));
        }
        if quota.max_volumes > 0 && mine.len() >= quota.max_volumes {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "volumes",
                limit: quota.max_volumes as u64,
                current: mine.len() as u64,
            });
        }
        let used: u64 = mine.iter().map(|(_, s)| u64::from(*s)).sum();
        if quota.max_volume_mib > 0 && used + u64::from(size_mib) > quota.max_volume_mib {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "volume_mib",
                limit: quota.max_volume_mib,
                current: used,
            });
        }
        let id = ids::new_id(ids::Kind::Volume)?;
        pending.push((tenant.to_owned(), name.to_owned(), size_mib));
        let reserved = Reserved {
            volumes: self,
            tenant: tenant.to_owned(),
            name: name.to_owned(),
            listed: false,
        };
        Ok((id, reserved))
    }

    /// Create step: the formatted volume `entry` recorded and listed in place of its
    /// reservation (its `file` removed when it cannot be).
    fn keep(
        &self,
        tenant: &str,
        file: &Path,
        entry: &Entry,
        mut reserved: Reserved<'_>,
    ) -> ApiResult<()> {
        // The name and the quota were reserved by `new_id`: no other create can have taken them.
        // (On an error `all` goes before `reserved`, whose drop takes it again.)
        let mut all = lock(&self.all);
        if let Err(e) = self.store.put_volume(tenant, &entry.id, &entry.record) {
            let _ = std::fs::remove_file(file);
            return Err(e);
        }
        all.push(entry.clone());
        lock(&self.pending).retain(|(t, n, _)| !(t == tenant && *n == entry.record.name));
        reserved.listed = true;
        Ok(())
    }

    /// ListVolumes: `tenant`'s volumes, by name.
    pub fn list(&self, tenant: &str) -> Vec<Volume> {
        let mine: Vec<Entry> = lock(&self.all)
            .iter()
            .filter(|e| e.tenant == tenant)
            .cloned()
            .collect();
        let mut out: Vec<Volume> = mine.iter().map(|e| self.view(e)).collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// DeleteVolume: refused while a live sandbox has it mounted; its file goes.
    pub fn delete(&self, tenant: &str, name: &str) -> ApiResult<bool> {
        check_name(name)?;
        let mut all = lock(&self.all);
        let Some(i) = all
            .iter()
            .position(|e| e.tenant == tenant && e.record.name == name)
        else {
            return Ok(false);
        };
        if let Some(u) = lock(&self.users).get(&all[i].id)
            && let Some(by) = u.read_write.iter().chain(&u.read_only).next()
        {
            return Err(ApiError::VolumeInUse {
                name: name.to_owned(),
                by: by.clone(),
                why: "a mounted volume cannot be deleted",
            });
        }
        self.store.delete_volume(tenant, name)?;
        let e = all.remove(i);
        if let Err(err) = std::fs::remove_file(self.file(&e.id)) {
            warn!(volume = name, "removing the volume's file: {err}");
        }
        info!(tenant, volume = name, "volume deleted");
        Ok(true)
    }

    /// Checks a create's attachments (names, paths, count) before anything is claimed.
    pub fn check_attachments(&self, wanted: &[VolumeAttachment]) -> ApiResult<()> {
        if wanted.len() > self.slots {
            return Err(ApiError::InvalidArgument(format!(
                "{} volumes; a sandbox mounts at most {}",
                wanted.len(),
                self.slots
            )));
        }
        for (i, a) in wanted.iter().enumerate() {
            check_name(&a.name)?;
            check_mount_path(&a.mount_path)?;
            if wanted[..i]
                .iter()
                .any(|o| o.name == a.name || o.mount_path == a.mount_path)
            {
                return Err(ApiError::InvalidArgument(format!(
                    "volume {} or mount path {} given twice",
                    a.name, a.mount_path
                )));
            }
        }
        Ok(())
    }

    /// Checks a create's attachments and that `tenant` has each volume (a quick answer before
    /// a VMM is taken; [`Volumes::claim`] checks again).
    pub fn check_known(&self, tenant: &str, wanted: &[VolumeAttachment]) -> ApiResult<()> {
        self.check_attachments(wanted)?;
        for a in wanted {
            if self.find(tenant, &a.name).is_none() {
                return Err(ApiError::VolumeNotFound(a.name.clone()));
            }
        }
        Ok(())
    }

    /// Claims `wanted` for `sandbox` of `tenant` and opens their files: all or none.
    pub fn claim(
        self: &Arc<Self>,
        tenant: &str,
        sandbox: &str,
        wanted: &[VolumeAttachment],
    ) -> ApiResult<Claim> {
        self.check_attachments(wanted)?;
        let entries = wanted
            .iter()
            .map(|a| {
                self.find(tenant, &a.name)
                    .ok_or_else(|| ApiError::VolumeNotFound(a.name.clone()))
            })
            .collect::<ApiResult<Vec<_>>>()?;
        let mut media = Vec::with_capacity(wanted.len());
        for (a, e) in wanted.iter().zip(&entries) {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(!a.read_only)
                .open(self.file(&e.id))
                .map_err(|err| ApiError::Internal(format!("volume {}: {err}", a.name)))?;
            media.push((f, a.read_only));
        }
        {
            let mut users = lock(&self.users);
            for (a, e) in wanted.iter().zip(&entries) {
                let u = users.get(&e.id);
                let busy = match (a.read_only, u) {
                    (_, None) => None,
                    (true, Some(u)) => u
                        .read_write
                        .clone()
                        .map(|by| (by, "it is mounted read-write")),
                    (false, Some(u)) => u
                        .read_write
                        .iter()
                        .chain(&u.read_only)
                        .next()
                        .cloned()
                        .map(|by| (by, "a read-write mount needs it unmounted everywhere")),
                };
                if let Some((by, why)) = busy {
                    return Err(ApiError::VolumeInUse {
                        name: a.name.clone(),
                        by,
                        why,
                    });
                }
            }
            for (a, e) in wanted.iter().zip(&entries) {
                let u = users.entry(e.id.clone()).or_default();
                if a.read_only {
                    u.read_only.push(sandbox.to_owned());
                } else {
                    u.read_write = Some(sandbox.to_owned());
                }
            }
        }
        Ok(Claim {
            volumes: self.clone(),
            sandbox: sandbox.to_owned(),
            media,
            kept: false,
        })
    }

    /// A sandbox adopted after a restart keeps what it had mounted.
    pub fn adopt(&self, tenant: &str, sandbox: &str, had: &[VolumeAttachment]) {
        // The records first: the list's lock is never taken while the users' is held.
        let found: Vec<_> = had
            .iter()
            .filter_map(|a| match self.find(tenant, &a.name) {
                Some(e) => Some((a, e)),
                None => {
                    warn!(sandbox, volume = %a.name, "an adopted sandbox's volume has no record");
                    None
                }
            })
            .collect();
        let mut users = lock(&self.users);
        for (a, e) in found {
            let u = users.entry(e.id).or_default();
            if a.read_only {
                u.read_only.push(sandbox.to_owned());
            } else {
                u.read_write = Some(sandbox.to_owned());
            }
        }
    }

    /// The sandbox ended: its volumes are free of it.
    pub fn release(&self, sandbox: &str) {
        let mut users = lock(&self.users);
        for u in users.values_mut() {
            if u.read_write.as_deref() == Some(sandbox) {
                u.read_write = None;
            }
            u.read_only.retain(|s| s != sandbox);
        }
        users.retain(|_, u| u.read_write.is_some() || !u.read_only.is_empty());
    }
}

/// Makes `file` a sparse file of `size_mib` and formats it: ext4 with a journal (a volume
/// outlives its sandboxes and the host), no blocks reserved for root, its root directory the
/// guest user's.
async fn format(mkfs: &Path, file: &Path, name: &str, size_mib: u32) -> ApiResult<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(file)?;
    f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    f.set_len(u64::from(size_mib) << 20)?;
    drop(f);
    let label: String = name.chars().take(16).collect();
    let out = tokio::process::Command::new(mkfs)
        .args(["-q", "-F", "-m", "0", "-L", &label])
        .arg("-E")
        .arg(format!("root_owner={GUEST_USER}:{GUEST_USER}"))
        .arg(file)
        .output()
        .await
        .map_err(|e| ApiError::Internal(format!("{}: {e}", mkfs.display())))?;
    if !out.status.success() {
        return Err(ApiError::Internal(format!(
            "mkfs.ext4 of the volume failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
