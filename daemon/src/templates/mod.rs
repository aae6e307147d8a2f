//! Templates: the registry of usable snapshots (its records live in the store, its files in
//! `DATA_DIR/templates/ID`), who may see and delete which (a tenant's own, and the shared ones
//! the operator made as the default tenant), and [`build`], which makes new ones.

pub mod build;
pub mod dockerfile;
pub mod import;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use airlock_api::v1::Template;
use airlock_control::snapshot_dir::{STATE_VERSION, state_version};

use crate::config::Quota;
use crate::error::{ApiError, ApiResult};
use crate::fileinfo::{disk_bytes, file_version};
use crate::ids;
use crate::store::Store;
use crate::vmm::PoolSpec;

/// A usable template: its record and snapshot directory.
#[derive(Clone, Debug)]
pub struct TemplateRt {
    pub record: Template,
    pub dir: PathBuf,
}

impl TemplateRt {
    /// What a warm VMM of this template restores; a writable root's overlay may take at most
    /// `max_disk_mib` (the largest `disk_mib`; the restore gives the sandbox's own).
    pub fn pool_spec(&self, max_disk_mib: u32) -> PoolSpec {
        PoolSpec {
            vcpus: self.record.vcpus,
            memory_mib: self.record.memory_mib,
            snapshot_dir: self.dir.clone(),
            rootfs: PathBuf::from(&self.record.rootfs_path),
            writable_root_mib: self.writable_root().then_some(max_disk_mib),
        }
    }

    /// Refuses a template this daemon's VMM or agent client cannot restore: another snapshot
    /// format, another agent protocol (TEMPLATE_OUTDATED, naming the rebuild).
    pub fn check_restorable(&self) -> ApiResult<()> {
        let r = &self.record;
        // 0: a header that could not be read; the VMM's restore then says what is wrong.
        let why = if r.snapshot_format != 0 && r.snapshot_format != STATE_VERSION {
            format!(
                "its snapshot has format {}, this VMM reads format {STATE_VERSION}",
                r.snapshot_format
            )
        } else if r.agent_protocol != 0 && r.agent_protocol != airlock_proto::PROTOCOL_VERSION {
            format!(
                "its guest agent speaks protocol {}, this daemon {}",
                r.agent_protocol,
                airlock_proto::PROTOCOL_VERSION
            )
        } else {
            return Ok(());
        };
        Err(ApiError::TemplateOutdated {
            name: reference(r),
            why,
        })
    }

    /// Whether its snapshot's root disk is copy-on-write: the snapshot has a layer map (a
    /// template built before writable roots has an empty one, or none).
    pub fn writable_root(&self) -> bool {
        std::fs::metadata(self.dir.join(airlock_control::snapshot_dir::LAYER_MAP_FILE))
            .is_ok_and(|m| m.len() > 0)
    }
}

/// The templates.
#[derive(Debug)]
pub struct Templates {
    all: Mutex<Vec<TemplateRt>>,
    store: Arc<Store>,
    default_tenant: String,
    dir: PathBuf,
}

impl Templates {
    /// The templates recorded in `store`, with their files under `dir`.
    pub fn load(store: Arc<Store>, dir: PathBuf, default_tenant: &str) -> ApiResult<Self> {
        let all = store
            .templates()?
            .into_iter()
            .map(|(mut record, dir)| {
                let dir = PathBuf::from(dir);
                if record.snapshot_format == 0 {
                    // A record from before the field: its snapshot's header tells.
                    record.snapshot_format = state_version(&dir).unwrap_or(0);
                }
                TemplateRt { record, dir }
            })
            .collect();
        Ok(Self {
            all: Mutex::new(all),
            store,
            default_tenant: default_tenant.to_owned(),
            dir,
        })
    }

    fn all(&self) -> std::sync::MutexGuard<'_, Vec<TemplateRt>> {
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where template `id`'s files go.
    pub fn dir_of(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Every template.
    pub fn list(&self) -> Vec<TemplateRt> {
        self.all().clone()
    }

    /// Templates `tenant` can use: its own and the shared ones.
    pub fn for_tenant(&self, tenant: &str) -> Vec<TemplateRt> {
        self.all()
            .iter()
            .filter(|t| t.record.tenant.is_empty() || t.record.tenant == tenant)
            .cloned()
            .collect()
    }

    /// The template `reference` (NAME or NAME:TAG) as `tenant` sees it: its own first, then a
    /// shared one; NAME alone is the version tagged `latest`, else the newest version.
    pub fn find(&self, tenant: &str, reference: &str) -> ApiResult<TemplateRt> {
        let r = TemplateRef::parse(reference)?;
        let all = self.for_tenant(tenant);
        let owner = |o: &str| -> Option<TemplateRt> {
            let mine: Vec<_> = all.iter().filter(|t| t.record.tenant == o).collect();
            r.pick(&mine).map(|t| (*t).clone())
        };
        owner(tenant)
            .or_else(|| owner(""))
            .ok_or_else(|| ApiError::TemplateNotFound(reference.to_owned()))
    }

    /// The template with id `id`, if it still exists.
    pub fn by_id(&self, id: &str) -> Option<TemplateRt> {
        self.all().iter().find(|t| t.record.id == id).cloned()
    }

    /// The tenant a template created by `tenant` belongs to: the default tenant's templates are
    /// shared (the operator's), every other tenant's are its own.
    pub fn owner_for(&self, tenant: &str) -> String {
        if tenant == self.default_tenant {
            String::new()
        } else {
            tenant.to_owned()
        }
    }

    /// The owner of a snapshot `tenant` takes: shared (`""`) only when it asks and is the
    /// default tenant (the operator); otherwise the tenant's own, the default tenant's too.
    pub fn snapshot_owner(&self, tenant: &str, shared: bool) -> ApiResult<String> {
        match (shared, tenant == self.default_tenant) {
            (true, true) => Ok(String::new()),
            (true, false) => Err(ApiError::InvalidArgument(
                "shared: only the default tenant's (the operator's) templates are shared".into(),
            )),
            (false, _) => Ok(tenant.to_owned()),
        }
    }

    /// Checks a new template's NAME[:TAG] for `tenant`; returns the owner it will have. With
    /// `replace` an existing version of that tag is fine (the new one takes its tag).
    pub fn check_new(&self, tenant: &str, reference: &str, replace: bool) -> ApiResult<String> {
        let owner = self.owner_for(tenant);
        self.check_new_of(&owner, reference, replace)?;
        Ok(owner)
    }

    /// [`check_new`](Self::check_new) for a template of `owner`.
    pub fn check_new_of(&self, owner: &str, reference: &str, replace: bool) -> ApiResult<()> {
        let r = TemplateRef::parse(reference)?;
        if !replace
            && self
                .all()
                .iter()
                .any(|t| r.is(&t.record) && t.record.tenant == owner)
        {
            return Err(ApiError::TemplateExists(r.to_string()));
        }
        Ok(())
    }

    /// Whether `owner` (a tenant, or "" for the shared templates) may add a template of
    /// `adding_bytes` under `quota`.
    pub fn check_quota(
        &self,
        tenant: &str,
        owner: &str,
        quota: &Quota,
        adding_bytes: u64,
    ) -> ApiResult<()> {
        let all = self.all();
        let mine: Vec<_> = all.iter().filter(|t| t.record.tenant == owner).collect();
        if quota.max_templates > 0 && mine.len() >= quota.max_templates {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "templates",
                limit: quota.max_templates as u64,
                current: mine.len() as u64,
            });
        }
        let mib: u64 = mine.iter().map(|t| t.record.memory_file_bytes >> 20).sum();
        if quota.max_template_mib > 0 && mib + (adding_bytes >> 20) > quota.max_template_mib {
            return Err(ApiError::Quota {
                tenant: tenant.to_owned(),
                what: "template_mib",
                limit: quota.max_template_mib,
                current: mib,
            });
        }
        Ok(())
    }

    /// Adds a built template whose files are in `dir` (removed if the name was taken
    /// meanwhile). Its `name` may carry a tag (NAME:TAG): it is split into `name` and `tag`
    /// (`latest` when none). With `replace`, a version holding that tag gives it up: it is
    /// tagged with its id and stays until deleted.
    pub fn add(&self, mut record: Template, dir: PathBuf, replace: bool) -> ApiResult<TemplateRt> {
        let r = match TemplateRef::parse(&record.name) {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        record.name = r.name.clone();
        if let Some(tag) = &r.tag {
            record.tag = tag.clone();
        } else if record.tag.is_empty() {
            record.tag = LATEST.into();
        }
        record.size_bytes = size_of(&record, &dir);
        if record.snapshot_format == 0 {
            record.snapshot_format = state_version(&dir).unwrap_or(0);
        }
        let mut all = self.all();
        let same = |t: &TemplateRt| {
            t.record.name == record.name
                && tag_of(&t.record) == record.tag
                && t.record.tenant == record.tenant
        };
        if let Some(old) = all.iter_mut().find(|t| same(t)) {
            if !replace {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(ApiError::TemplateExists(reference(&record)));
            }
            let mut moved = old.record.clone();
            moved.tag = moved.id.clone();
            self.store
                .put_template(&moved, &old.dir.display().to_string())?;
            old.record = moved;
        }
        self.store
            .put_template(&record, &dir.display().to_string())?;
        let t = TemplateRt { record, dir };
        all.push(t.clone());
        Ok(t)
    }

    /// `tenant`'s own version `reference` (the default tenant's: a shared one, or a snapshot
    /// it kept its own): NAME:TAG, or NAME for its `latest`, else its only version.
    pub fn own(&self, tenant: &str, reference: &str) -> ApiResult<TemplateRt> {
        let r = TemplateRef::parse(reference)?;
        let owner = self.owner_for(tenant);
        let all = self.all();
        let mine: Vec<_> = all
            .iter()
            .filter(|t| {
                t.record.name == r.name && (t.record.tenant == owner || t.record.tenant == tenant)
            })
            .collect();
        if r.tag.is_none() && mine.len() > 1 && !mine.iter().any(|t| tag_of(&t.record) == LATEST) {
            let tags: Vec<_> = mine.iter().map(|t| tag_of(&t.record)).collect();
            return Err(ApiError::InvalidArgument(format!(
                "template {} has the versions {}: name one as {}:TAG",
                r.name,
                tags.join(", "),
                r.name
            )));
        }
        r.pick(&mine)
            .map(|t| (*t).clone())
            .ok_or_else(|| ApiError::TemplateNotFound(reference.to_owned()))
    }

    /// Takes the template with id `id` out of the registry; the caller removes its pool and
    /// files.
    pub fn remove_id(&self, id: &str) -> ApiResult<TemplateRt> {
        let t = {
            let mut all = self.all();
            let i = all
                .iter()
                .position(|t| t.record.id == id)
                .ok_or_else(|| ApiError::TemplateNotFound(id.to_owned()))?;
            all.remove(i)
        };
        self.store.delete_template(&t.record.id)?;
        Ok(t)
    }
}

/// The tag of a version named without one.
pub const LATEST: &str = "latest";

/// A version's tag (`latest` for a record from before tags).
pub fn tag_of(r: &Template) -> &str {
    if r.tag.is_empty() { LATEST } else { &r.tag }
}

/// How a version is named to users: NAME for its `latest`, else NAME:TAG.
pub fn reference(r: &Template) -> String {
    match tag_of(r) {
        LATEST => r.name.clone(),
        tag => format!("{}:{tag}", r.name),
    }
}

/// Bytes a template's files take: its snapshot directory and, for an imported image, the root
/// filesystem under the images directory that only imported images have.
fn size_of(r: &Template, dir: &Path) -> u64 {
    let snapshot: u64 = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| disk_bytes(&e.path()))
                .sum()
        })
        .unwrap_or(0);
    let rootfs = if r.source.starts_with("oci:") {
        disk_bytes(Path::new(&r.rootfs_path))
    } else {
        0
    };
    snapshot + rootfs
}

/// A template as a call names it: NAME[:TAG].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateRef {
    pub name: String,
    pub tag: Option<String>,
}

impl TemplateRef {
    /// Parses NAME or NAME:TAG (NAME `[a-z0-9][a-z0-9._-]{0,62}`, TAG
    /// `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`).
    pub fn parse(s: &str) -> ApiResult<Self> {
        let (name, tag) = match s.split_once(':') {
            Some((n, t)) => (n, Some(t)),
            None => (s, None),
        };
        if !ids::valid_name(name) {
            return Err(ApiError::InvalidArgument(format!(
                "template name {name:?}: use [a-z0-9][a-z0-9._-]{{0,62}}"
            )));
        }
        if let Some(t) = tag {
            let b = t.as_bytes();
            let ok = !b.is_empty()
                && b.len() <= 128
                && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c));
            if !ok {
                return Err(ApiError::InvalidArgument(format!(
                    "template tag {t:?}: use [A-Za-z0-9_][A-Za-z0-9._-]{{0,127}}"
                )));
            }
        }
        Ok(Self {
            name: name.to_owned(),
            tag: tag.map(str::to_owned),
        })
    }

    /// Whether `r` is the version this names exactly (NAME alone: its `latest`).
    pub fn is(&self, r: &Template) -> bool {
        r.name == self.name && tag_of(r) == self.tag.as_deref().unwrap_or(LATEST)
    }

    /// The version this names among `versions` (one owner's): the tagged one; for NAME alone
    /// `latest`, else the newest.
    fn pick<'a, T: std::borrow::Borrow<TemplateRt>>(&self, versions: &'a [T]) -> Option<&'a T> {
        let named = versions
            .iter()
            .filter(|t| t.borrow().record.name == self.name);
        match &self.tag {
            Some(_) => named.clone().find(|t| self.is(&t.borrow().record)),
            None => named
                .clone()
                .find(|t| tag_of(&t.borrow().record) == LATEST)
                .or_else(|| named.max_by_key(|t| t.borrow().record.created_unix_ms)),
        }
    }
}

impl std::fmt::Display for TemplateRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tag {
            Some(t) => write!(f, "{}:{t}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The record's file in an exported template's directory (the `Template` message, protobuf),
/// beside the snapshot's files (`state`, `memory`, and a writable root's `layer`, `layer.map`).
pub const EXPORT_RECORD: &str = "template.pb";

/// Why an exported template was not imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{EXPORT_RECORD}: {0}")]
    Read(#[source] std::io::Error),
    #[error("{EXPORT_RECORD}: {0}")]
    Decode(#[source] prost::DecodeError),
    #[error("the name {0:?} is not valid")]
    Name(String),
    /// The kernel or base image it names changed since it was booted.
    #[error("its {what} {path} is not the file it was booted from (version {now}, not {version})")]
    Stale {
        what: &'static str,
        path: String,
        now: String,
        version: String,
    },
    #[error("its files: {0}")]
    Files(#[source] std::io::Error),
    #[error("{0}")]
    Id(#[source] std::io::Error),
    #[error("{0}")]
    Registry(#[source] ApiError),
}

impl Templates {
    /// Adds the template exported in `from` under its name and tenant, with a new id and a copy
    /// of its files; `None` when a template of that name is there already. Refused when the
    /// kernel or base image it names is not the file it was booted from (their versions).
    pub fn import_exported(&self, from: &Path) -> Result<Option<TemplateRt>, ImportError> {
        use prost::Message as _;
        let bytes = std::fs::read(from.join(EXPORT_RECORD)).map_err(ImportError::Read)?;
        let mut record = Template::decode(bytes.as_slice()).map_err(ImportError::Decode)?;
        if !ids::valid_name(&record.name) {
            return Err(ImportError::Name(record.name));
        }
        if self.all().iter().any(|t| {
            t.record.name == record.name
                && tag_of(&t.record) == tag_of(&record)
                && t.record.tenant == record.tenant
        }) {
            return Ok(None);
        }
        for (what, path, version) in [
            ("kernel", &record.kernel_path, &record.kernel_version),
            ("base image", &record.rootfs_path, &record.rootfs_version),
        ] {
            let now = file_version(Path::new(path));
            if &now != version {
                return Err(ImportError::Stale {
                    what,
                    path: path.clone(),
                    now,
                    version: version.clone(),
                });
            }
        }
        record.id = ids::new_id(ids::Kind::Template).map_err(ImportError::Id)?;
        record.created_unix_ms = ids::now_ms();
        let dir = self.dir_of(&record.id);
        if let Err(e) = import::import(from, &dir) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(ImportError::Files(e));
        }
        record.memory_file_bytes = disk_bytes(&dir.join("memory"));
        match self.add(record, dir, false) {
            Ok(t) => Ok(Some(t)),
            Err(ApiError::TemplateExists(_)) => Ok(None),
            Err(e) => Err(ImportError::Registry(e)),
        }
    }
}

/// A template's record as a caller sees it: host paths only for an operator.
pub fn as_seen_by(mut record: Template, operator: bool) -> Template {
    if !operator {
        record.kernel_path.clear();
        record.rootfs_path.clear();
    }
    record
}

#[cfg(test)]
mod tests;
