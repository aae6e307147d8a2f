//! The `code-interpreter` template of the system tests: the image `rootfs/build.sh
//! code-interpreter`, its kernel started and warmed before the snapshot. Its build boots the
//! image and starts the first kernel, tens of minutes on one emulated vCPU of a nested-KVM
//! machine, so runs keep it: under `$AIRLOCK_CACHE_DIR/kept-templates/KEY` ([`kept_dir`]), built
//! by `airlock-test-template --interpreter` in the background of `tests/run.sh` while the other
//! tests run, and imported by `tests/interpreter.rs`, which waits for that build (a lock beside
//! the entry) or makes it itself. `AIRLOCK_TEST_TEMPLATE_CACHE=0` builds it anew each time.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::{Path, PathBuf};
use std::time::Instant;

use airlock_api::v1::{CreateTemplateRequest, ListTemplatesRequest, Template};

use crate::shared::{self, Shared};

pub const TEMPLATE: &str = "code-interpreter";
/// The template's memory: what the image's Python with numpy, pandas and matplotlib needs, and
/// the limit the memory test passes.
pub const MEMORY_MIB: u32 = 1024;
pub const WARMUP: &str = "/usr/lib/airlock/interpreter-warmup";

/// The daemon settings that give the build the time it takes on nested KVM and register the
/// image, with the top-level settings `top` and the tables `tables` of the caller.
pub fn config(top: &str, tables: &str) -> String {
    format!(
        "{top}template_build_timeout_s = 2400\n\
         [images.{TEMPLATE}]\nkernel = {:?}\nrootfs = {:?}\n{tables}",
        crate::kernel().display().to_string(),
        crate::interpreter_rootfs().display().to_string(),
    )
}

/// The shared daemon of this process, started with `config(top, tables)` and the kept
/// template imported, and the template: imported, or else built (and kept). Holds the lock of
/// the kept entry while it looks and builds, so that it waits for a build in another process.
pub async fn shared_with_template(
    top: &str,
    tables: &str,
) -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    &'static Template,
) {
    // A failed build is not tried again by the next test (tens of minutes each): it fails
    // with the same cause.
    static ONE: tokio::sync::OnceCell<Result<Template, String>> =
        tokio::sync::OnceCell::const_new();
    let kept = kept_dir();
    let lock = if ONE.initialized() {
        None
    } else {
        let k = kept.clone();
        tokio::task::spawn_blocking(move || k.as_deref().map(shared::lock_template_cache))
            .await
            .unwrap()
    };
    let (guard, s) = shared::scenario_importing(&config(top, tables), kept.as_slice()).await;
    let t = ONE
        .get_or_init(|| async { imported_or_built(s, kept.as_deref()).await })
        .await;
    drop(lock);
    match t {
        Ok(t) => (guard, s, t),
        Err(e) => panic!("{e}"),
    }
}

/// The template the daemon imported at its start, else one it builds now (kept in `kept`).
async fn imported_or_built(s: &Shared, kept: Option<&Path>) -> Result<Template, String> {
    let mut c = s.client(None).await;
    let imported = c
        .list_templates(ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates
        .into_iter()
        .find(|t| t.name == TEMPLATE);
    if let Some(t) = imported {
        eprintln!("{TEMPLATE}: imported from {}", kept.unwrap().display());
        return Ok(t);
    }
    let t0 = Instant::now();
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: TEMPLATE.into(),
            image: TEMPLATE.into(),
            memory_mib: MEMORY_MIB,
            warmup: WARMUP.into(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("template {TEMPLATE}: {e:?}\n{}", s.log_tail()))?
        .into_inner();
    let mut template = None;
    loop {
        match events.message().await {
            Ok(Some(ev)) => {
                if let Some(t) = ev.template {
                    template = Some(t);
                }
            }
            Ok(None) => break,
            Err(e) => return Err(format!("template {TEMPLATE}: {e:?}\n{}", s.log_tail())),
        }
    }
    let t = template.ok_or("the template build's last event carries no template")?;
    eprintln!("{TEMPLATE}: built in {:?}", t0.elapsed());
    if let Some(to) = kept {
        shared::export_template(&s.data_dir.join("templates").join(&t.id), &t, to);
    }
    Ok(t)
}

/// Where runs keep the template: `$AIRLOCK_CACHE_DIR/kept-templates/KEY`, KEY a digest of the
/// kernel and the image (both named by their contents' hash: the guest agent is in the image),
/// the build's settings, `Cargo.lock`, and the sources of the VMM and of the daemon's code that
/// launches it (a snapshot is the VMM's format, of a VM the daemon configured). A restore that
/// no longer fits fails the tests loudly; `AIRLOCK_TEST_TEMPLATE_CACHE=0` (then `None`) builds
/// it anew.
pub fn kept_dir() -> Option<PathBuf> {
    use sha2::Digest as _;
    if std::env::var("AIRLOCK_TEST_TEMPLATE_CACHE").is_ok_and(|v| v == "0") {
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut h = sha2::Sha256::new();
    h.update(format!(
        "{}\n{}\n{MEMORY_MIB} {WARMUP}\n",
        crate::kernel().display(),
        crate::interpreter_rootfs().display()
    ));
    let mut files = Vec::new();
    for part in ["Cargo.lock", "vmm", "daemon/src/vmm"] {
        source_files(&root.join(part), &mut files);
    }
    files.sort();
    for f in files {
        h.update(f.strip_prefix(root).unwrap().display().to_string());
        h.update(std::fs::read(&f).unwrap());
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let cache = std::env::var_os("AIRLOCK_CACHE_DIR")
        .map_or_else(|| PathBuf::from("/var/cache/airlock"), PathBuf::from);
    Some(cache.join("kept-templates").join(key))
}

/// The files under `p` (or `p` itself), but build products.
fn source_files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_file() {
        out.push(p.to_owned());
        return;
    }
    for e in std::fs::read_dir(p).unwrap().flatten() {
        let path = e.path();
        if path.file_name().is_some_and(|n| n == "target") {
            continue;
        }
        source_files(&path, out);
    }
}
