//! A CreateSandbox request checked against its template and the daemon's settings, before
//! anything is started: pure, and table-tested.

use std::collections::HashMap;

use airlock_api::v1::{
    CreateSandboxRequest, FilePolicy, FileToPlace, NetworkPolicy, PackagePolicy, Template,
    VolumeAttachment,
};

use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::{files, limits};

/// What a new sandbox gets.
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxSpec {
    pub disk_mib: u32,
    pub idle_ttl_s: u32,
    pub max_lifetime_s: u32,
    pub policy: FilePolicy,
    pub env: HashMap<String, String>,
    pub labels: HashMap<String, String>,
    pub files: Vec<FileToPlace>,
    /// Its egress policy as asked, and as checked (against the tenant's ceiling at create).
    pub network: NetworkPolicy,
    pub egress: airlock_egress::Policy,
    /// The volumes to mount (checked by `Volumes::claim`).
    pub volumes: Vec<VolumeAttachment>,
    /// Its package policy as asked (combined with the tenant's ceiling at create).
    pub packages: PackagePolicy,
    /// Root out of reach (executions and file calls as root refused, sudo gives nothing).
    pub no_root: bool,
    /// The template's default account and working directory (its image's `User` and
    /// `WorkingDir`, a Dockerfile's `USER` and `WORKDIR`), told to the agent at every restore;
    /// empty: the agent's own.
    pub default_user: String,
    pub workdir: String,
}

impl SandboxSpec {
    /// Checks `req` for a sandbox of `template` under `cfg`.
    pub fn check(req: &CreateSandboxRequest, template: &Template, cfg: &Config) -> ApiResult<Self> {
        if req.vcpus != 0 && req.vcpus != template.vcpus
            || req.memory_mib != 0 && req.memory_mib != template.memory_mib
        {
            return Err(ApiError::InvalidArgument(format!(
                "template {} has {} vCPU(s) and {} MiB; a snapshot's shape is fixed (make a \
                 template with CreateTemplate vcpus/memory_mib for another shape)",
                template.name, template.vcpus, template.memory_mib
            )));
        }
        if req.volumes.len() > template.volume_slots as usize {
            return Err(ApiError::InvalidArgument(format!(
                "{} volumes, and template {} has {} disk slots for them{}",
                req.volumes.len(),
                template.name,
                template.volume_slots,
                if template.volume_slots == 0 {
                    " (it was built before volumes: build it again)"
                } else {
                    ""
                }
            )));
        }
        let disk_mib = or_default(req.disk_mib, cfg.default_disk_mib);
        if disk_mib > cfg.max_disk_mib {
            return Err(ApiError::InvalidArgument(format!(
                "disk_mib {disk_mib} is over the limit {}",
                cfg.max_disk_mib
            )));
        }
        let policy = normalise_policy(req.file_policy.clone(), cfg)?;
        let mut placed_bytes = 0u64;
        for f in &req.files {
            files::check_path(&f.path, &policy.writable, "writable")?;
            placed_bytes += f.content.len() as u64;
        }
        if placed_bytes > cfg.max_file_bytes {
            return Err(ApiError::FileTooLarge {
                size: placed_bytes,
                limit: cfg.max_file_bytes,
            });
        }
        limits::check_env(&req.env)?;
        limits::check_labels(&req.labels)?;
        let network = req.network.clone().unwrap_or_default();
        let egress = crate::net::policy_of(&network)?;
        let defaults = template.image_defaults.as_ref();
        Ok(Self {
            disk_mib,
            idle_ttl_s: or_default(req.idle_ttl_s, cfg.default_idle_ttl_s).min(cfg.max_idle_ttl_s),
            max_lifetime_s: or_default(req.max_lifetime_s, cfg.default_max_lifetime_s)
                .min(cfg.max_lifetime_s),
            policy,
            env: image_env(template, &req.env),
            labels: req.labels.clone(),
            files: req.files.clone(),
            network,
            egress,
            volumes: req.volumes.clone(),
            packages: req.packages.clone().unwrap_or_default(),
            no_root: req.no_root,
            default_user: defaults.map(|d| d.user.clone()).unwrap_or_default(),
            workdir: defaults.map(|d| d.working_dir.clone()).unwrap_or_default(),
        })
    }

    /// What a restarted daemon needs to serve the sandbox again (its environment and file
    /// policy), as a request message to store.
    pub fn to_stored(&self) -> CreateSandboxRequest {
        CreateSandboxRequest {
            env: self.env.clone(),
            file_policy: Some(self.policy.clone()),
            network: Some(self.network.clone()),
            volumes: self.volumes.clone(),
            packages: Some(self.packages.clone()),
            no_root: self.no_root,
            ..Default::default()
        }
    }
}

fn or_default(v: u32, default: u32) -> u32 {
    if v == 0 { default } else { v }
}

/// Checks a request's file policy (absolute, normal prefixes) or gives the default.
fn normalise_policy(p: Option<FilePolicy>, cfg: &Config) -> ApiResult<FilePolicy> {
    let p = p.unwrap_or_default();
    let pick = |given: Vec<String>, default: &Vec<String>| -> ApiResult<Vec<String>> {
        let list = if given.is_empty() {
            default.clone()
        } else {
            given
        };
        for prefix in &list {
            files::check_absolute(prefix)?;
        }
        Ok(list)
    };
    // The export limits: the operator's ceiling, narrowed by the request.
    let cap = |asked: u64, ceiling: u64| {
        if asked == 0 {
            ceiling
        } else {
            asked.min(ceiling)
        }
    };
    if p.export_denied.len() > MAX_DENIED_PATTERNS {
        return Err(ApiError::InvalidArgument(format!(
            "{} export_denied patterns, at most {MAX_DENIED_PATTERNS}",
            p.export_denied.len()
        )));
    }
    for pat in &p.export_denied {
        if pat.is_empty() || pat.len() > 256 || pat.contains('\0') {
            return Err(ApiError::InvalidArgument(format!(
                "export_denied pattern {pat:?}: 1..=256 bytes"
            )));
        }
    }
    let mut denied = cfg.export_denied.clone();
    denied.extend(
        p.export_denied
            .into_iter()
            .filter(|d| !cfg.export_denied.contains(d)),
    );
    Ok(FilePolicy {
        writable: pick(p.writable, &cfg.writable_paths)?,
        exportable: pick(p.exportable, &cfg.exportable_paths)?,
        max_export_file_bytes: cap(p.max_export_file_bytes, cfg.export_max_file_bytes),
        max_export_total_bytes: cap(p.max_export_total_bytes, cfg.export_max_total_bytes),
        export_denied: denied,
    })
}

/// A sandbox's environment: its template image's `Env` (an imported image's), then the
/// request's own entries over it.
fn image_env(template: &Template, asked: &HashMap<String, String>) -> HashMap<String, String> {
    let mut env: HashMap<String, String> = template
        .image_defaults
        .iter()
        .flat_map(|d| &d.env)
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    env.extend(asked.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// Denied patterns a request may add.
const MAX_DENIED_PATTERNS: usize = 64;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn template() -> Template {
        Template {
            name: "base".into(),
            vcpus: 1,
            memory_mib: 256,
            ..Default::default()
        }
    }

    fn file(path: &str, bytes: usize) -> FileToPlace {
        FileToPlace {
            path: path.into(),
            content: vec![0; bytes],
            mode: 0,
        }
    }

    #[test]
    fn requests_are_checked_against_the_template_and_the_settings() {
        let cfg = Config {
            max_file_bytes: 100,
            max_disk_mib: 2048,
            max_idle_ttl_s: 60,
            ..Config::default()
        };
        let ok = |r: CreateSandboxRequest| SandboxSpec::check(&r, &template(), &cfg);
        let reason = |r: CreateSandboxRequest| ok(r).unwrap_err().reason().to_owned();
        let base = CreateSandboxRequest::default();
        let spec = ok(base.clone()).unwrap();
        assert_eq!(spec.disk_mib, cfg.default_disk_mib);
        assert_eq!(spec.idle_ttl_s, 60, "the default is capped");
        assert_eq!(spec.policy.writable, vec!["/tmp".to_owned()]);
        let table: Vec<(CreateSandboxRequest, &str)> = vec![
            (
                CreateSandboxRequest {
                    vcpus: 2,
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
            (
                CreateSandboxRequest {
                    memory_mib: 512,
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
            (
                CreateSandboxRequest {
                    disk_mib: 4096,
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
            (
                CreateSandboxRequest {
                    files: vec![file("/etc/x", 1)],
                    ..base.clone()
                },
                "PATH_NOT_ALLOWED",
            ),
            (
                CreateSandboxRequest {
                    files: vec![file("/tmp/a", 60), file("/tmp/b", 60)],
                    ..base.clone()
                },
                "FILE_TOO_LARGE",
            ),
            (
                CreateSandboxRequest {
                    env: HashMap::from([("A=B".to_owned(), String::new())]),
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
            (
                CreateSandboxRequest {
                    file_policy: Some(FilePolicy {
                        writable: vec!["relative".into()],
                        ..Default::default()
                    }),
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
            (
                CreateSandboxRequest {
                    file_policy: Some(FilePolicy {
                        export_denied: vec![String::new()],
                        ..Default::default()
                    }),
                    ..base.clone()
                },
                "INVALID_ARGUMENT",
            ),
        ];
        for (req, want) in table {
            assert_eq!(reason(req.clone()), want, "{req:?}");
        }
        let placed = ok(CreateSandboxRequest {
            vcpus: 1,
            files: vec![file("/tmp/a", 100)],
            idle_ttl_s: 5,
            ..base
        })
        .unwrap();
        assert_eq!(placed.idle_ttl_s, 5);
        assert_eq!(placed.files.len(), 1);
        assert_eq!(placed.to_stored().file_policy.unwrap(), placed.policy);
        assert!(!placed.no_root, "root is allowed by default");
        let without_root = ok(CreateSandboxRequest {
            no_root: true,
            ..Default::default()
        })
        .unwrap();
        assert!(without_root.no_root);
        assert!(
            without_root.to_stored().no_root,
            "a restarted daemon keeps refusing root"
        );
    }

    #[test]
    fn a_request_narrows_the_export_policy_and_never_widens_it() {
        let cfg = Config {
            export_max_file_bytes: 1000,
            export_max_total_bytes: 5000,
            export_denied: vec!["*.pem".into()],
            ..Config::default()
        };
        let policy = |p: FilePolicy| {
            let req = CreateSandboxRequest {
                file_policy: Some(p),
                ..Default::default()
            };
            SandboxSpec::check(&req, &template(), &cfg).unwrap().policy
        };
        let default = policy(FilePolicy::default());
        assert_eq!(
            (
                default.max_export_file_bytes,
                default.max_export_total_bytes
            ),
            (1000, 5000)
        );
        assert_eq!(default.export_denied, ["*.pem"]);
        let narrowed = policy(FilePolicy {
            max_export_file_bytes: 10,
            max_export_total_bytes: 1 << 40,
            export_denied: vec!["*.pem".into(), "*.sqlite".into()],
            ..Default::default()
        });
        assert_eq!(narrowed.max_export_file_bytes, 10, "lowered");
        assert_eq!(narrowed.max_export_total_bytes, 5000, "never raised");
        assert_eq!(
            narrowed.export_denied,
            ["*.pem", "*.sqlite"],
            "added, once each"
        );
    }
}
