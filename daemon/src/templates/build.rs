//! Template builds: one cold boot of a kernel and an image in a jailed `airlock-vmm snapshot`,
//! a warm-up command in the guest, a snapshot moved out of the VMM's run directory into the
//! templates (owned by root), progress events all along. The build runs on a task of its own:
//! a client that goes away leaves no VMM, cgroup or run directory behind.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{CreateTemplateRequest, ImageDefaults, OciImage, Template, TemplateEvent};
use tokio::sync::mpsc::Sender;
use tracing::{info, warn};

use super::{TemplateRt, Templates};
use crate::config::Config;
use crate::error::{ApiError, ApiResult};
use crate::fileinfo::{disk_bytes, file_version};
use crate::host::VmmHost;
use crate::ids;
use crate::jail::Launch;
use crate::store::Owner;
use crate::vmm::{self, VmmProcess};

/// The shape and inputs of one build, checked.
#[derive(Clone, Debug)]
struct BuildSpec {
    kernel: PathBuf,
    rootfs: PathBuf,
    /// The registered image's name (empty: host files an operator named).
    image: String,
    /// Whether the caller is an operator (who may see host paths and the VMM's log lines).
    operator: bool,
    vcpus: u32,
    memory_mib: u32,
    warmup: String,
    /// The request named its warm-up (an imported image gets none otherwise).
    explicit_warmup: bool,
    /// An OCI image to import first (its root filesystem then replaces `rootfs`).
    oci: Option<OciImage>,
    /// Kernel arguments beyond the VMM's own (an imported image's init and defaults).
    cmdline_extra: String,
}

/// A CreateTemplate request that passed its checks.
pub struct Checked {
    name: String,
    owner: String,
    /// The new version takes the tag of an existing one (CreateTemplateRequest.replace).
    replace: bool,
    spec: BuildSpec,
    /// What an image pull may connect to besides its registry (the tenant's ceiling); none:
    /// anything.
    pub check_host: Option<crate::oci::pull::HostCheck>,
}

impl std::fmt::Debug for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl Checked {
    /// Guest memory of the build's VM.
    pub fn memory_mib(&self) -> u64 {
        u64::from(self.spec.memory_mib)
    }
}

/// Sends progress events of one build.
#[derive(Clone, Debug)]
struct Progress {
    tx: Sender<TemplateEvent>,
    started: Instant,
}

impl Progress {
    async fn send(&self, phase: &str, message: String, template: Option<Template>) {
        let ev = TemplateEvent {
            phase: phase.into(),
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            message,
            template,
        };
        let _ = self.tx.send(ev).await;
    }
}

/// Builds templates.
#[derive(Debug)]
pub struct Builder {
    cfg: Arc<Config>,
    host: Arc<VmmHost>,
    templates: Arc<Templates>,
}

impl Builder {
    pub fn new(cfg: Arc<Config>, host: Arc<VmmHost>, templates: Arc<Templates>) -> Self {
        Self {
            cfg,
            host,
            templates,
        }
    }

    /// CreateTemplate's checks, before anything runs: the name, the image or files, the
    /// shape (at most the settings' caps) and the tenant's template quota.
    pub fn check(&self, tenant: &str, req: &CreateTemplateRequest) -> ApiResult<Checked> {
        let owner = self.templates.check_new(tenant, &req.name, req.replace)?;
        let spec = self.spec(req, self.cfg.is_operator(tenant))?;
        if spec.vcpus > self.cfg.max_template_vcpus
            || spec.memory_mib > self.cfg.max_template_memory_mib
        {
            return Err(ApiError::InvalidArgument(format!(
                "a template has at most {} vCPUs and {} MiB here",
                self.cfg.max_template_vcpus, self.cfg.max_template_memory_mib
            )));
        }
        let quota = self.cfg.quota_of(tenant);
        let worst = u64::from(spec.memory_mib) << 20;
        self.templates.check_quota(tenant, &owner, &quota, worst)?;
        Ok(Checked {
            name: req.name.clone(),
            replace: req.replace,
            owner,
            spec,
            check_host: None,
        })
    }

    /// Builds what [`check`](Self::check) passed: boots, warms up and snapshots; the new
    /// template is registered and returned. Progress goes to `progress`.
    pub async fn build(
        self: &Arc<Self>,
        checked: Checked,
        progress: Sender<TemplateEvent>,
    ) -> ApiResult<TemplateRt> {
        let Checked {
            name,
            owner,
            replace,
            mut spec,
            check_host,
        } = checked;
        let id = ids::new_id(ids::Kind::Template)?;
        let dir = self.templates.dir_of(&id);
        let progress = Progress {
            tx: progress,
            started: Instant::now(),
        };
        let (source, image_defaults) = match spec.oci.take() {
            Some(oci) => {
                self.use_image(&mut spec, oci, &progress, check_host)
                    .await?
            }
            None => (String::new(), None),
        };
        let (source, what) = source_and_what(&spec, source);
        let message = format!(
            "cold boot of {what} ({} vCPU, {} MiB)",
            spec.vcpus, spec.memory_mib
        );
        progress.send("booting", message, None).await;
        let me = self.clone();
        let (s, d, p, tid) = (spec.clone(), dir.clone(), progress.clone(), id.clone());
        tokio::spawn(async move { me.snapshot(&s, &d, &p, &tid).await })
            .await
            .map_err(|e| ApiError::Internal(format!("template build task: {e}")))??;
        let record = Template {
            name,
            id,
            tenant: owner,
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            kernel_path: spec.kernel.display().to_string(),
            kernel_version: file_version(&spec.kernel),
            rootfs_path: spec.rootfs.display().to_string(),
            rootfs_version: file_version(&spec.rootfs),
            source_sandbox_id: String::new(),
            created_unix_ms: ids::now_ms(),
            memory_file_bytes: disk_bytes(&dir.join("memory")),
            image: spec.image.clone(),
            volume_slots: self.cfg.volume_slots,
            source,
            image_defaults,
            snapshot_format: airlock_control::snapshot_dir::state_version(&dir).unwrap_or(0),
            agent_protocol: airlock_proto::PROTOCOL_VERSION,
            ..Default::default()
        };
        let t = self.templates.add(record, dir, replace)?;
        let secs = progress.started.elapsed().as_secs();
        info!(template = %t.record.name, id = %t.record.id, secs, "template ready");
        let shown = super::as_seen_by(t.record.clone(), spec.operator);
        progress
            .send("ready", format!("ready after {secs} s"), Some(shown))
            .await;
        Ok(t)
    }

    /// Build step: imports `oci` and makes `spec` boot it (its root filesystem, boot
    /// arguments and warm-up); the template's source and the image's defaults.
    async fn use_image(
        &self,
        spec: &mut BuildSpec,
        oci: OciImage,
        progress: &Progress,
        check_host: Option<crate::oci::pull::HostCheck>,
    ) -> ApiResult<(String, Option<ImageDefaults>)> {
        let imported = self.import(&oci, progress, check_host).await?;
        spec.rootfs = imported.rootfs.clone();
        spec.cmdline_extra = boot_args(&oci.reference, &imported.defaults)?;
        if !spec.explicit_warmup {
            spec.warmup.clear();
        } else if !imported.has_shell {
            return Err(ApiError::ImageRefused {
                image: oci.reference.clone(),
                why: "a warm-up runs in /bin/sh, and the image has none".into(),
            });
        }
        let source = format!("oci:{}@{}", oci.reference, imported.manifest_digest);
        let d = imported.defaults;
        let image_defaults = Some(ImageDefaults {
            env: d.env,
            working_dir: d.working_dir,
            user: d.user,
            entrypoint: d.entrypoint,
            cmd: d.cmd,
        });
        Ok((source, image_defaults))
    }

    /// The request's build, with the daemon's defaults: the image's files (host files named
    /// by an operator only), checked without telling a tenant anything about the host.
    fn spec(&self, req: &CreateTemplateRequest, operator: bool) -> ApiResult<BuildSpec> {
        let (kernel, rootfs, image) = self.files(req, operator)?;
        let vcpus = if req.vcpus == 0 { 1 } else { req.vcpus };
        let memory_mib = if req.memory_mib == 0 {
            256
        } else {
            req.memory_mib
        };
        if !(1..=32).contains(&vcpus) || !(64..=1 << 20).contains(&memory_mib) {
            return Err(ApiError::InvalidArgument(
                "vcpus must be 1..32 and memory_mib 64..1048576".into(),
            ));
        }
        let explicit_warmup = !req.no_warmup && !req.warmup.is_empty();
        let warmup = if req.no_warmup {
            String::new()
        } else if req.warmup.is_empty() {
            self.cfg.template_warmup.clone()
        } else {
            req.warmup.clone()
        };
        Ok(BuildSpec {
            kernel,
            rootfs,
            image,
            operator,
            vcpus,
            memory_mib,
            warmup,
            explicit_warmup,
            oci: req.oci.clone(),
            cmdline_extra: String::new(),
        })
    }

    /// The kernel and root filesystem to boot, canonical (the jails of the template's VMMs
    /// hold them at these paths), and the image's name.
    fn files(
        &self,
        req: &CreateTemplateRequest,
        operator: bool,
    ) -> ApiResult<(PathBuf, PathBuf, String)> {
        let host_paths = !req.kernel_path.is_empty() || !req.rootfs_path.is_empty();
        if let Some(oci) = &req.oci {
            if host_paths || !req.image.is_empty() {
                return Err(ApiError::InvalidArgument(
                    "oci names the image to import: not together with image, kernel_path or \
                     rootfs_path"
                        .into(),
                ));
            }
            crate::oci::pull::parse(&oci.reference).map_err(|e| ApiError::ImageRefused {
                image: oci.reference.clone(),
                why: e.to_string(),
            })?;
            let kernel = self
                .cfg
                .default_kernel()
                .and_then(|k| std::fs::canonicalize(k).ok())
                .ok_or_else(|| {
                    ApiError::Internal(
                        "the default kernel is missing on the daemon's host \
                         (kernel-config/build.sh)"
                            .into(),
                    )
                })?;
            // The root filesystem is the import's, made at build time.
            return Ok((kernel, PathBuf::new(), String::new()));
        }
        if host_paths && !operator {
            return Err(ApiError::InvalidArgument(
                "kernel_path and rootfs_path name files on the daemon's host, which only an \
                 operator may; name a registered image in `image` instead"
                    .into(),
            ));
        }
        let name = if req.image.is_empty() {
            "default"
        } else {
            req.image.as_str()
        };
        let (kernel, rootfs) = self.cfg.image(name).ok_or_else(|| {
            ApiError::InvalidArgument(format!(
                "no image {name:?} is registered (the `default` one is built by \
                 kernel-config/build.sh and rootfs/build.sh)"
            ))
        })?;
        let pick = |given: &str, image: PathBuf, what: &str| -> ApiResult<PathBuf> {
            let p = if given.is_empty() {
                image
            } else {
                PathBuf::from(given)
            };
            let found = p
                .is_file()
                .then(|| std::fs::canonicalize(&p).ok())
                .flatten();
            found.ok_or_else(|| {
                ApiError::InvalidArgument(if operator {
                    format!("{what} {} is not a file on the daemon's host", p.display())
                } else {
                    format!("the {what} of image {name:?} is missing on the daemon's host")
                })
            })
        };
        let kernel = pick(&req.kernel_path, kernel, "kernel")?;
        let rootfs = pick(&req.rootfs_path, rootfs, "root filesystem")?;
        let image = if host_paths {
            String::new()
        } else {
            name.to_owned()
        };
        Ok((kernel, rootfs, image))
    }

    /// Boots `spec` once in a jailed `airlock-vmm snapshot`, runs the warm-up, and moves the
    /// snapshot it wrote (in its run directory) to `dir`, owned by root. Sends "still booting"
    /// every 5 s. The VMM, its cgroup and run directory are gone afterwards.
    async fn snapshot(
        &self,
        spec: &BuildSpec,
        dir: &Path,
        progress: &Progress,
        template_id: &str,
    ) -> ApiResult<()> {
        let (vm_id, run_dir) = self.host.new_vmm_id()?;
        std::fs::create_dir_all(&run_dir)?;
        let cgroup = match self.host.cgroup(&vm_id, spec.memory_mib, spec.vcpus) {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(ApiError::Internal(format!("VMM cgroup: {e}")));
            }
        };
        let mut launched = match self.launch(spec, &run_dir, cgroup.clone()).await {
            Ok(l) => l,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.remove();
                }
                let _ = std::fs::remove_dir_all(&run_dir);
                return Err(e);
            }
        };
        let vmm = VmmProcess::new(vm_id, run_dir.clone(), cgroup, &mut launched);
        // A build's guest gets no egress: with the exits closed, its connections are refused
        // by the namespace itself (nothing listens) and its DNS queries unanswered.
        drop(vmm.take_exits());
        let recorded = self
            .host
            .supervisor
            .record(&vmm, &Owner::Build(template_id.to_owned()));
        let limit = Duration::from_secs(self.cfg.template_build_timeout_s);
        let exit = launched.exit;
        tokio::pin!(exit);
        let status =
            match tokio::time::timeout(limit, wait_with_progress(exit.as_mut(), progress)).await {
                Ok(status) => status,
                Err(_) => {
                    vmm.kill();
                    let _ = exit.await;
                    Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the build took longer than {} s (template_build_timeout_s)",
                            limit.as_secs()
                        ),
                    ))
                }
            };
        self.host.supervisor.forget(&vmm);
        let out_dir = run_dir.join("snapshot");
        let result = take_snapshot(spec, status, &out_dir, dir, &vmm, template_id);
        if result.is_err() {
            let _ = std::fs::remove_dir_all(dir);
        }
        vmm.remove_leftovers();
        recorded?;
        result
    }

    /// Starts the build's VMM.
    async fn launch(
        &self,
        spec: &BuildSpec,
        run_dir: &Path,
        cgroup: Option<crate::cgroup::Cgroup>,
    ) -> ApiResult<vmm::Launched> {
        let launcher = &self.host.launcher;
        let mut args = launcher.vmm_flags();
        args.extend(
            [
                "snapshot",
                "--cpu-template",
                vmm::cpu_template(),
                "--vcpus",
                &spec.vcpus.to_string(),
                "--mem-mib",
                &spec.memory_mib.to_string(),
                "--warmup",
                &spec.warmup,
                "--disk-slots",
                &self.cfg.volume_slots.to_string(),
            ]
            .map(OsString::from),
        );
        if !spec.cmdline_extra.is_empty() {
            args.extend(["--cmdline-extra".into(), spec.cmdline_extra.clone().into()]);
        }
        // A writable root: the base image stays read-only, the build's writes (the warm-up's)
        // go into an overlay, and the snapshot keeps them as the template's layer, which
        // every sandbox of the template reads under an overlay of its own.
        for (flag, path) in [
            ("--kernel", spec.kernel.clone()),
            ("--rootfs", spec.rootfs.clone()),
            ("--out", run_dir.join("snapshot")),
        ] {
            args.push(flag.into());
            args.push(path.into());
        }
        let disk_mib = self.cfg.default_disk_mib;
        let mut writable_files = Vec::new();
        let mut max_file_bytes = vmm::max_file_bytes(spec.memory_mib);
        if self.cfg.writable_root {
            let overlay = run_dir.join(vmm::ROOT_OVERLAY_FILE);
            args.extend(["--root-overlay".into(), overlay.clone().into_os_string()]);
            args.extend(["--disk-quota-mib".into(), disk_mib.to_string().into()]);
            writable_files.push(overlay);
            max_file_bytes = vmm::max_file_bytes_with_disk(spec.memory_mib, disk_mib, 0);
        }
        let launch = Launch {
            args,
            env: vmm::vmm_env(run_dir),
            run_dir: run_dir.to_path_buf(),
            read_only: vec![spec.kernel.clone(), spec.rootfs.clone()],
            writable_files,
            cgroup,
            stdout: None,
            stderr: File::create(run_dir.join("vmm.log"))?,
            max_file_bytes,
        };
        vmm::launch(launcher, launch).await.map_err(|e| {
            ApiError::Internal(format!("spawning {}: {e}", launcher.binary().display()))
        })
    }
}

impl Builder {
    /// The manifest digest `oci` resolves to now (pulling and unpacking it as a build would,
    /// or finding that done before), progress to `tx`.
    pub async fn resolve(
        &self,
        oci: &OciImage,
        tx: Sender<TemplateEvent>,
        check_host: crate::oci::pull::HostCheck,
    ) -> ApiResult<String> {
        let progress = Progress {
            tx,
            started: Instant::now(),
        };
        Ok(self
            .import(oci, &progress, Some(check_host))
            .await?
            .manifest_digest)
    }

    /// Pulls and unpacks `oci` into a root filesystem (or finds it made before).
    async fn import(
        &self,
        oci: &OciImage,
        progress: &Progress,
        check_host: Option<crate::oci::pull::HostCheck>,
    ) -> ApiResult<crate::oci::Imported> {
        let c = &self.cfg.oci;
        progress
            .send("pulling", format!("pulling {}", oci.reference), None)
            .await;
        let images = self.cfg.data_dir.join("images");
        let default_rootfs = self.cfg.image("default").map(|(_, r)| r);
        let agent = crate::oci::guest_agent(c, default_rootfs.as_deref(), &images.join("agent"))?;
        let mkfs = crate::fileinfo::find_mkfs(self.cfg.mkfs_ext4.as_deref()).ok_or_else(|| {
            ApiError::Internal(
                "images need e2fsprogs' mkfs.ext4 on the daemon's host (apt-get install \
                 e2fsprogs)"
                    .into(),
            )
        })?;
        let spec = crate::oci::pull::PullSpec {
            reference: oci.reference.clone(),
            username: oci.username.clone(),
            password: oci.password.clone(),
            insecure: c.insecure_registries.clone(),
            max_layer_bytes: c.max_layer_mib << 20,
            max_image_bytes: c.max_image_mib << 20,
            read_timeout: Duration::from_secs(c.read_timeout_s.max(1)),
            check_host: check_host.unwrap_or_else(|| Arc::new(|_: &str, _: u16| Ok(()))),
        };
        let disk_mib = u64::from(self.cfg.max_disk_mib);
        let imported = tokio::time::timeout(
            Duration::from_secs(c.pull_timeout_s.max(1)),
            crate::oci::import(c, &spec, &images, &agent, &mkfs, disk_mib),
        )
        .await
        .map_err(|_| ApiError::RegistryUnavailable {
            registry: oci.reference.clone(),
            why: format!(
                "pulling and unpacking {} took longer than {} s (oci.pull_timeout_s)",
                oci.reference, c.pull_timeout_s
            ),
        })??;
        let how = if imported.reused {
            "its root filesystem was made before".to_owned()
        } else {
            format!(
                "{} layers, {} KiB fetched, unpacked",
                imported.layers,
                imported.fetched_bytes >> 10
            )
        };
        info!(image = %oci.reference, digest = %imported.manifest_digest, "{how}");
        progress
            .send(
                "unpacking",
                format!("{} is {}: {how}", oci.reference, imported.manifest_digest),
                None,
            )
            .await;
        Ok(imported)
    }
}

/// The kernel arguments that boot an imported image: its init (the agent, from /.airlock) and
/// its user and working directory as the agent's defaults (in init's environment). The kernel
/// command line has no quoting for these, so they may hold only plain characters.
fn boot_args(reference: &str, d: &crate::oci::ImageDefaults) -> ApiResult<String> {
    let plain = |v: &str| {
        v.len() <= 256
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-:/@+".contains(&b))
    };
    let user = if d.user.is_empty() { "root" } else { &d.user };
    let mut args = format!("{} {}={user}", crate::oci::INIT_ARG, crate::oci::USER_ENV);
    if !d.working_dir.is_empty() {
        args.push_str(&format!(" {}={}", crate::oci::WORKDIR_ENV, d.working_dir));
    }
    if !plain(user) || !plain(&d.working_dir) {
        return Err(ApiError::ImageRefused {
            image: reference.to_owned(),
            why: format!(
                "its User {:?} or WorkingDir {:?} has characters other than letters, digits and \
                 ._-:/@+",
                d.user, d.working_dir
            ),
        });
    }
    Ok(args)
}

/// Waits for the build VMM's exit, sending "still booting" every 5 s.
/// Build step: the template's source (for a built image or host files, their root
/// filesystem's version of now) and how the boot message names what boots.
fn source_and_what(spec: &BuildSpec, mut source: String) -> (String, String) {
    let what = if !source.is_empty() {
        source.clone()
    } else if spec.image.is_empty() {
        format!("{} with {}", spec.kernel.display(), spec.rootfs.display())
    } else {
        format!("image {}", spec.image)
    };
    if source.is_empty() {
        // What the next build of the same request would take anew: the registered image's
        // (or the host's) root filesystem of now, recorded by its version.
        source = match spec.image.as_str() {
            "" => format!("rootfs:{}", file_version(&spec.rootfs)),
            image => format!("image:{image}@{}", file_version(&spec.rootfs)),
        };
    }
    (source, what)
}

/// Snapshot step: what the build VMM's end means: after a clean exit, the snapshot it wrote
/// in `out_dir` imported into `dir`; else the boot's failure (its log tail for an operator
/// only).
fn take_snapshot(
    spec: &BuildSpec,
    status: std::io::Result<Option<std::process::ExitStatus>>,
    out_dir: &Path,
    dir: &Path,
    vmm: &VmmProcess,
    template_id: &str,
) -> ApiResult<()> {
    match status {
        Ok(Some(st)) if st.success() => super::import::import(out_dir, dir)
            .map(drop)
            .map_err(|e| ApiError::Internal(format!("taking the snapshot: {e}"))),
        Ok(st) => {
            let status = st.map_or("no status".into(), |s| s.to_string());
            let tail = failure_tail(&vmm.log());
            warn!(
                template = template_id,
                "the template boot failed ({status}): {tail}"
            );
            // The VMM's log holds the guest's console: an operator's, not a tenant's.
            Err(ApiError::Internal(if spec.operator {
                format!("the template boot failed ({status}): {tail}")
            } else {
                format!(
                    "the template boot failed ({status}); the operator finds why in the daemon's log"
                )
            }))
        }
        Err(e) => Err(ApiError::Internal(format!(
            "the template build failed: {e}"
        ))),
    }
}

/// The end of a failed build VMM's log, led by its last error line when that is not in the
/// end already (the VMM logs why the snapshot failed, then the guest's console).
pub(super) fn failure_tail(log: &Path) -> String {
    let tail = vmm::log_tail(log);
    match vmm::log_line(log, " ERROR ") {
        Some(error) if !tail.contains(&error) => format!("{error} | {tail}"),
        _ => tail,
    }
}

async fn wait_with_progress(
    mut exit: std::pin::Pin<&mut crate::jail::ExitFuture>,
    progress: &Progress,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        tokio::select! {
            st = exit.as_mut() => return st,
            _ = tick.tick() => {
                let secs = progress.started.elapsed().as_secs();
                progress.send("booting", format!("still booting ({secs} s)"), None).await;
            }
        }
    }
}
