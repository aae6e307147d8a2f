//! OCI images as templates: an image reference becomes a root filesystem (ext4) that a
//! template build boots like the base image.
//!
//! [`pull`] fetches the image (its manifest digest, configuration and layers, each verified and
//! capped; layers cached by digest), [`tree`] assembles the layers in memory with whiteouts and
//! opaque directories and refuses hostile entries, and [`import`] writes the tree out, adds
//! Airlock's guest agent beside it as `/.airlock/airlock-agent` (booted as init: the image's
//! own init, if any, is never run), creates the mount points the agent needs where the image
//! has none and the DNS file every sandbox needs (as a container runtime does), and packs it
//! all with `mkfs.ext4 -d`, never mounting anything. The result is keyed by the manifest's
//! digest and the agent's version, so a second template from the same image reuses it.

pub mod pull;
pub mod tree;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;

use crate::error::{ApiError, ApiResult};
use pull::{Compression, PullSpec, Pulled};
use tree::{Limits, Meta, Tree};

/// Where the agent lives in an imported image, and the kernel argument that boots it.
pub const AGENT_PATH: &str = "/.airlock/airlock-agent";
pub const INIT_ARG: &str = "init=/.airlock/airlock-agent";
/// The boot environment variable that names the image's user (the agent's default account).
pub const USER_ENV: &str = "AIRLOCK_USER";
/// The boot environment variable that names the image's working directory.
pub const WORKDIR_ENV: &str = "AIRLOCK_WORKDIR";

/// `[images_oci]` in the daemon's settings.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OciConfig {
    /// Registries spoken to over plain HTTP: `HOST:PORT` as in the reference, or `HOST` for
    /// every port of it.
    pub insecure_registries: Vec<String>,
    /// Caps: one layer and a whole image (compressed), the image unpacked, its entries.
    pub max_layer_mib: u64,
    pub max_image_mib: u64,
    pub max_unpacked_mib: u64,
    pub max_entries: u64,
    /// A registry that sends nothing for this long fails the pull; the whole pull and unpack
    /// may take `pull_timeout_s`.
    pub read_timeout_s: u64,
    pub pull_timeout_s: u64,
    /// The static guest agent put into imported images; default: the one in the `default`
    /// image (read out of its ext4 file with `debugfs`).
    pub guest_agent: Option<PathBuf>,
}

impl Default for OciConfig {
    fn default() -> Self {
        Self {
            insecure_registries: Vec::new(),
            max_layer_mib: 2048,
            max_image_mib: 4096,
            max_unpacked_mib: 16384,
            max_entries: 2_000_000,
            read_timeout_s: 60,
            pull_timeout_s: 900,
            guest_agent: None,
        }
    }
}

/// What the image's configuration says every execution gets by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageDefaults {
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// An imported image.
#[derive(Debug)]
pub struct Imported {
    pub rootfs: PathBuf,
    pub manifest_digest: String,
    pub defaults: ImageDefaults,
    /// Whether the image has an executable /bin/sh (a warm-up needs one).
    pub has_shell: bool,
    pub layers: usize,
    pub fetched_bytes: u64,
    /// The root filesystem was made before (same manifest digest and agent).
    pub reused: bool,
}

fn defaults_of(p: &Pulled) -> ImageDefaults {
    let Some(c) = p.config.config() else {
        return ImageDefaults::default();
    };
    ImageDefaults {
        env: c.env().clone().unwrap_or_default(),
        working_dir: c.working_dir().clone().unwrap_or_default(),
        user: c.user().clone().unwrap_or_default(),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
    }
}

/// Pulls `spec` and makes its root filesystem under `dir` (`dir/layers`, `dir/rootfs`), with
/// `agent` as its init. `mkfs` is e2fsprogs' mkfs.ext4; `disk_mib` the writable space a
/// sandbox may get on top of the image's content.
pub async fn import(
    cfg: &OciConfig,
    spec: &PullSpec,
    dir: &Path,
    agent: &Path,
    mkfs: &Path,
    disk_mib: u64,
) -> ApiResult<Imported> {
    let pulled = pull_image(spec, dir).await?;
    let agent_bytes = std::fs::read(agent)
        .map_err(|e| ApiError::Internal(format!("the guest agent {}: {e}", agent.display())))?;
    let agent_version = crate::fileinfo::content_version(&agent_bytes);
    let hex = pulled
        .manifest_digest
        .trim_start_matches("sha256:")
        .to_owned();
    let out_dir = dir.join("rootfs");
    std::fs::create_dir_all(&out_dir)?;
    let rootfs = out_dir.join(format!("{hex}-{agent_version}.ext4"));
    let defaults = defaults_of(&pulled);
    let layers = pulled.layers.len();
    let fetched_bytes = pulled.fetched_bytes;
    let manifest_digest = pulled.manifest_digest.clone();
    let has_shell_file = out_dir.join(format!("{hex}-{agent_version}.shell"));
    if rootfs.is_file() {
        return Ok(Imported {
            rootfs,
            manifest_digest,
            defaults,
            has_shell: has_shell_file.exists(),
            layers,
            fetched_bytes,
            reused: true,
        });
    }
    let limits = Limits {
        max_unpacked_bytes: cfg.max_unpacked_mib << 20,
        max_entries: cfg.max_entries,
    };
    let stage = dir.join(format!("build-{}-{}", std::process::id(), next()));
    let (mkfs, rootfs2, stage2) = (mkfs.to_path_buf(), rootfs.clone(), stage.clone());
    let made = tokio::task::spawn_blocking(move || {
        let r = assemble(
            &pulled,
            &stage2,
            limits,
            &agent_bytes,
            &mkfs,
            disk_mib,
            &rootfs2,
        );
        let _ = std::fs::remove_dir_all(&stage2);
        r
    })
    .await
    .map_err(|e| ApiError::Internal(format!("image assembly task: {e}")))??;
    if made {
        std::fs::write(&has_shell_file, b"")?;
    }
    Ok(Imported {
        rootfs,
        manifest_digest,
        defaults,
        has_shell: made,
        layers,
        fetched_bytes,
        reused: false,
    })
}

/// Import step: the image pulled into `dir/layers`; a failure is the cache's (internal), the
/// registry's (unavailable) or the image's (refused).
async fn pull_image(spec: &PullSpec, dir: &Path) -> ApiResult<Pulled> {
    pull::pull(spec, &dir.join("layers"))
        .await
        .map_err(|e| match e {
            pull::PullError::Io(e) => ApiError::Internal(format!("the layer cache: {e}")),
            pull::PullError::Registry { registry, why } => ApiError::RegistryUnavailable {
                why: format!("registry {registry}: {why}"),
                registry,
            },
            e => ApiError::ImageRefused {
                image: spec.reference.clone(),
                why: e.to_string(),
            },
        })
}

pub(crate) fn next() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Builds the tree of `pulled` in `stage` (a new directory only root may enter), adds the
/// agent and runtime files, and packs it into `out`. Returns whether the image has /bin/sh.
fn assemble(
    pulled: &Pulled,
    stage: &Path,
    limits: Limits,
    agent: &[u8],
    mkfs: &Path,
    disk_mib: u64,
    out: &Path,
) -> ApiResult<bool> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().mode(0o700).create(stage)?;
    let mut tree = Tree::new(&stage.join("spool"), limits)?;
    apply_layers(&mut tree, pulled)?;
    let has_shell = tree.is_executable("/bin/sh");
    add_runtime_files(&mut tree, agent)?;
    let root = stage.join("root");
    std::fs::create_dir(&root)?;
    tree.write_to(&root)
        .map_err(|e| ApiError::Internal(format!("writing the image tree: {e}")))?;
    let content_mib = (tree.file_bytes() + tree.entries() * 4096) >> 20;
    let size_mib = (content_mib * 5 / 4 + 64).max(content_mib + disk_mib);
    pack_ext4(&root, mkfs, size_mib, out)?;
    Ok(has_shell)
}

/// Assembly step: the image's layers, in order, applied to `tree` (each decompressed as it
/// is read).
fn apply_layers(tree: &mut Tree, pulled: &Pulled) -> ApiResult<()> {
    for layer in &pulled.layers {
        let file = std::fs::File::open(&layer.path)?;
        let file = std::io::BufReader::new(file);
        let applied = match layer.compression {
            Compression::None => tree.apply_layer(&layer.digest, file),
            Compression::Gzip => {
                tree.apply_layer(&layer.digest, flate2::read::MultiGzDecoder::new(file))
            }
            Compression::Zstd => {
                let z =
                    zstd::stream::read::Decoder::new(file).map_err(|e| ApiError::ImageRefused {
                        image: pulled.reference.clone(),
                        why: format!("layer {}: zstd: {e}", layer.digest),
                    })?;
                tree.apply_layer(&layer.digest, z)
            }
        };
        applied.map_err(|e| match e {
            tree::TreeError::Io(e) => ApiError::Internal(format!("assembling the image: {e}")),
            e => ApiError::ImageRefused {
                image: pulled.reference.clone(),
                why: e.to_string(),
            },
        })?;
    }
    Ok(())
}

/// Assembly step: the agent, the mount points it needs where the image has none, and the
/// DNS and host-name files.
fn add_runtime_files(tree: &mut Tree, agent: &[u8]) -> ApiResult<()> {
    tree.add_file(AGENT_PATH, agent, Meta::root(0o755))?;
    for (p, mode) in [
        ("/proc", 0o555),
        ("/sys", 0o555),
        ("/dev", 0o755),
        ("/run", 0o755),
        ("/tmp", 0o1777),
        ("/etc", 0o755),
    ] {
        tree.add_dir_if_absent(p, Meta::root(mode));
    }
    // As a container runtime does: the sandbox's own DNS (its gateway), a host name.
    tree.add_file(
        "/etc/resolv.conf",
        b"nameserver 100.96.0.1\noptions timeout:2 attempts:2\n",
        Meta::root(0o644),
    )?;
    if !tree.exists("/etc/hosts") {
        tree.add_file(
            "/etc/hosts",
            b"127.0.0.1\tlocalhost\n127.0.1.1\tairlock\n::1\tlocalhost ip6-localhost ip6-loopback\n",
            Meta::root(0o644),
        )?;
    }
    if !tree.exists("/etc/hostname") {
        tree.add_file("/etc/hostname", b"airlock\n", Meta::root(0o644))?;
    }
    Ok(())
}

/// Assembly step: `root` packed by `mkfs` into an ext4 file of `size_mib` at `out` (written
/// beside it, then renamed into place).
fn pack_ext4(root: &Path, mkfs: &Path, size_mib: u64, out: &Path) -> ApiResult<()> {
    let tmp = out.with_extension(format!("part-{}", next()));
    let file = std::fs::File::create(&tmp)?;
    file.set_len(size_mib << 20)?;
    drop(file);
    let st = std::process::Command::new(mkfs)
        .args(["-q", "-F", "-d"])
        .arg(root)
        .args([
            "-L",
            "airlock-image",
            "-b",
            "4096",
            "-I",
            "256",
            "-i",
            "16384",
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0,lazy_itable_init=0",
            "--",
        ])
        .arg(&tmp)
        .arg(format!("{size_mib}M"))
        .output()
        .map_err(|e| ApiError::Internal(format!("{}: {e}", mkfs.display())))?;
    if !st.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(ApiError::Internal(format!(
            "mkfs.ext4 of the image failed ({}): {}",
            st.status,
            String::from_utf8_lossy(&st.stderr).trim()
        )));
    }
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    std::fs::rename(&tmp, out)?;
    Ok(())
}

/// The guest agent to put into imported images: the configured file, else the one inside the
/// `default` image, read out of its ext4 file once (by `debugfs`, without mounting) into
/// `cache`, keyed by the image file's version.
pub fn guest_agent(
    cfg: &OciConfig,
    default_rootfs: Option<&Path>,
    cache: &Path,
) -> ApiResult<PathBuf> {
    if let Some(p) = &cfg.guest_agent {
        return Ok(p.clone());
    }
    let image = default_rootfs.ok_or_else(|| {
        ApiError::Internal(
            "importing images needs a guest agent: set images_oci.guest_agent or register a \
             `default` image (rootfs/build.sh)"
                .into(),
        )
    })?;
    let out = cache.join(format!(
        "airlock-agent-{}",
        crate::fileinfo::file_version(image)
    ));
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(cache)?;
    let tmp = out.with_extension(format!("part-{}", next()));
    let st = std::process::Command::new("debugfs")
        .arg("-R")
        .arg(format!("dump /usr/sbin/airlock-agent {}", tmp.display()))
        .arg(image)
        .output()
        .map_err(|e| ApiError::Internal(format!("debugfs (e2fsprogs): {e}")))?;
    let ok = st.status.success() && std::fs::metadata(&tmp).is_ok_and(|m| m.len() > 0);
    if !ok {
        let _ = std::fs::remove_file(&tmp);
        return Err(ApiError::Internal(format!(
            "reading the guest agent out of {}: {}",
            image.display(),
            String::from_utf8_lossy(&st.stderr).trim()
        )));
    }
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::rename(&tmp, &out)?;
    Ok(out)
}
