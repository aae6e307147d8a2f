//! `airlock-create-bench --compare-image`: templates from OCI images. A local registry (Debian's
//! `docker-registry`, `tests/images/registry.rs`) gets two images built here without network
//! (`tests/images/layout.rs`): `bench/base`, about `image_mib` MiB of host files
//! (/usr/lib/x86_64-linux-gnu and /usr/share, trimmed) in two gzip layers and a third with the
//! static busybox (`/bin/sh`) and `/etc/passwd`; and `bench/app`, the same three layers and a
//! small top layer. One airlockd (its own data directory, cgroup parent and jail uid range,
//! `[oci] insecure_registries = ["127.0.0.1"]`, a tenant whose egress ceiling allows
//! 127.0.0.1) builds `base` and then, `runs` times:
//!
//! - cold: `bench/base` with the layer cache and the built root filesystems deleted first;
//! - warm: `bench/app`, its base layers cached (only the top layer is fetched), its root
//!   filesystem deleted first (so it is assembled and packed again).
//!
//! Each import's client time to the "unpacking" event (pull and unpack: the root filesystem is
//! made) and to "ready" (the whole build: boot and snapshot too), and the KiB the daemon says
//! it fetched. Each template is deleted once measured, except the last warm one, whose
//! sandboxes then race `base`'s: `create_runs` creates → ready of each, alternating, one at a
//! time, each template's warm pool (1) full. Restore does not depend on the image, so the
//! ratio imported / base of the p50s should be about 1.
//!
//! Before those creates, `runs` times, a Dockerfile build (BuildTemplate): `FROM base` and
//! four cheap steps (a COPY of `app.py` from a small context, three RUNs of `echo`/`mkdir`; an
//! `ARG` right before the last RUN), its step cache (`cache-HEX` templates) empty; then the
//! same Dockerfile with only the last line changed. The client time to "ready" of each, and
//! how many steps the rebuild took from the cache (all but the last: 3). The run's templates
//! and the cache templates it made are deleted after it.
//!
//! Prints one JSON line per measure (`{"bench":"image","measure":NAME,...percentiles}`) and
//! returns the summary (the last line).

use super::*;

#[path = "../../tests/images/layout.rs"]
mod layout;
#[path = "../../tests/images/registry.rs"]
mod registry;

use layout::{Compression, Image, ImageConfig, ImageDigests, Layer, Layout};
use registry::{Auth, Registry};

/// The tenant that imports: its egress ceiling allows the registry on 127.0.0.1.
const TOKEN: &str = "bench-token-of-the-image-bench";

/// The daemon's settings beyond the bench's common ones; `uid_base` a jail uid range of its own.
fn config(uid_base: u32) -> String {
    format!(
        "pool_size = 1\nmax_sandboxes = 16\n\
         [oci]\ninsecure_registries = [\"127.0.0.1\"]\n\
         [tenants.images]\ntokens = [\"{TOKEN}\"]\n\
         [tenants.images.egress_ceiling]\nallow = [{{ cidr = \"127.0.0.1/32\" }}]\n\
         [jail]\nuid_base = {uid_base}\nuid_count = 10000\n"
    )
}

/// The two images in the registry.
struct Images {
    registry: Registry,
    /// `bench/base:v1` and `bench/app:v1`.
    cold: String,
    warm: String,
    /// `bench/app`'s manifest (its root filesystem's file name starts with its hex).
    warm_manifest: String,
    /// Compressed bytes of `bench/base`'s layers, of `bench/app`'s top layer; file bytes.
    layer_bytes: u64,
    top_bytes: u64,
    file_bytes: u64,
}

/// Regular files (and their directories) under the host directory `root`, depth first in name
/// order, at the same paths in `layer`, until `budget` bytes of file data; the bytes taken.
/// Symbolic links, other kinds and names that are not UTF-8 are left out.
fn host_files(mut layer: Layer, root: &str, budget: u64) -> (Layer, u64) {
    use std::os::unix::fs::PermissionsExt;
    let mut prefix = String::new();
    for part in root.trim_matches('/').split('/') {
        prefix.push_str(part);
        layer = layer.dir(&prefix);
        prefix.push('/');
    }
    let mut taken = 0u64;
    let mut stack = vec![std::path::PathBuf::from(root)];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| Some(e.ok()?.path())).collect();
        paths.sort();
        let mut subdirs = Vec::new();
        for p in paths {
            let (Ok(meta), Some(name)) = (std::fs::symlink_metadata(&p), p.to_str()) else {
                continue;
            };
            let mode = meta.permissions().mode() & 0o777;
            if meta.is_dir() {
                layer = layer.dir_with(name, mode | 0o700, 0, 0);
                subdirs.push(p);
            } else if meta.is_file()
                && taken + meta.len() <= budget
                && let Ok(data) = std::fs::read(&p)
            {
                taken += data.len() as u64;
                layer = layer.file_with(name, data, mode, 0, 0);
            }
            if taken + (1 << 20) > budget {
                return (layer, taken);
            }
        }
        // Depth first, in name order.
        stack.extend(subdirs.into_iter().rev());
    }
    (layer, taken)
}

/// A small incompressible file (xorshift), for the top layer.
fn noise(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Builds both images as one OCI layout in `dir` and pushes them to a new local registry.
fn make_images(dir: &std::path::Path, image_mib: usize) -> Images {
    let budget = (image_mib as u64) << 20;
    let t = Instant::now();
    let (libs, lib_bytes) = host_files(
        Layer::new(Compression::Gzip),
        "/usr/lib/x86_64-linux-gnu",
        budget * 3 / 5,
    );
    let (share, share_bytes) = host_files(
        Layer::new(Compression::Gzip),
        "/usr/share",
        budget - lib_bytes,
    );
    let mut tools = layout::busybox_layer(Compression::Gzip);
    tools
        .entries
        .extend(layout::accounts_layer(Compression::Gzip).entries);
    let mut image = Image {
        layers: vec![libs, share, tools],
        config: ImageConfig {
            cmd: Some(vec!["/bin/sh".into()]),
            ..ImageConfig::amd64()
        },
    };
    let mut oci = Layout::create(dir);
    let cold: ImageDigests = oci.add_image(&image);
    oci.tag("base", &cold.manifest);
    image.layers.push(
        Layer::new(Compression::Gzip)
            .dir("opt")
            .dir("opt/app")
            .file("opt/app/VERSION", "2\n")
            .file("opt/app/data.bin", noise(256 << 10)),
    );
    let warm = oci.add_image(&image);
    oci.tag("app", &warm.manifest);
    drop(image);
    let layer_bytes = cold.layers.iter().map(|l| l.size).sum();
    log(&format!(
        "images: {} MiB of files, {} MiB in {} gzip layers, written in {:.1} s",
        (lib_bytes + share_bytes) >> 20,
        layer_bytes >> 20,
        cold.layers.len(),
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let registry = Registry::start(Auth::None);
    registry.push_tag(dir, "base", "bench/base:v1");
    registry.push_tag(dir, "app", "bench/app:v1");
    log(&format!(
        "pushed to {} in {:.1} s",
        registry.host(),
        t.elapsed().as_secs_f64()
    ));
    Images {
        cold: registry.reference("bench/base:v1"),
        warm: registry.reference("bench/app:v1"),
        warm_manifest: warm.manifest.hex().to_owned(),
        layer_bytes,
        top_bytes: warm.layers.last().map_or(0, |l| l.size),
        file_bytes: lib_bytes + share_bytes,
        registry,
    }
}

/// One import's times (the client's, ms from the request), and what the daemon said.
struct Import {
    unpack_ms: f64,
    ready_ms: f64,
    fetched_kib: Option<f64>,
    reused: bool,
}

/// CreateTemplate `name` from the image `reference`, through to "ready".
async fn import(c: &Client, name: &str, reference: &str) -> Result<Import, String> {
    let t = Instant::now();
    let mut events = c
        .clone()
        .create_template(CreateTemplateRequest {
            name: name.into(),
            oci: Some(OciImage {
                reference: reference.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("import {reference}: {}", e.message()))?
        .into_inner();
    let (mut unpack_ms, mut ready_ms) = (None, None);
    let (mut fetched_kib, mut reused) = (None, false);
    while let Some(ev) = events
        .message()
        .await
        .map_err(|e| format!("import {reference}: {}", e.message()))?
    {
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if ev.phase == "unpacking" {
            unpack_ms = Some(ms);
            reused = ev.message.contains("made before");
            // "REF is DIGEST: N layers, K KiB fetched, unpacked"
            fetched_kib = ev
                .message
                .split(", ")
                .find_map(|p| p.strip_suffix(" KiB fetched")?.parse().ok());
            log(&format!("{name}: {} after {ms:.0} ms", ev.message));
        }
        if ev.template.is_some() {
            ready_ms = Some(ms);
        }
    }
    match (unpack_ms, ready_ms) {
        (Some(unpack_ms), Some(ready_ms)) => Ok(Import {
            unpack_ms,
            ready_ms,
            fetched_kib,
            reused,
        }),
        _ => Err(format!("import {reference}: no unpacking or ready event")),
    }
}

async fn delete_template(c: &Client, name: &str) -> Result<(), String> {
    c.clone()
        .delete_template(DeleteTemplateRequest { name: name.into() })
        .await
        .map(|_| ())
        .map_err(|e| format!("delete template {name}: {}", e.message()))
}

/// The Dockerfile of the build measure; `last` is what its last RUN echoes.
fn dockerfile(last: &str) -> String {
    format!(
        "FROM base\n\
         COPY app.py /home/user/app/\n\
         RUN echo one > /tmp/one\n\
         RUN mkdir -p /opt/x && echo two > /opt/x/two\n\
         ARG V=1\n\
         RUN echo \"$V {last}\" > /tmp/last\n"
    )
}

/// One build's client time to "ready" (ms) and the steps it took from the cache.
struct Built {
    ready_ms: f64,
    cached: usize,
}

/// BuildTemplate `name` from `dockerfile` and the context tar `context`, through to "ready".
async fn build(c: &Client, name: &str, dockerfile: &str, context: &[u8]) -> Result<Built, String> {
    let t = Instant::now();
    let mut events = c
        .clone()
        .build_template(BuildTemplateRequest {
            name: name.into(),
            dockerfile: dockerfile.into(),
            context: context.to_vec(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("build {name}: {}", e.message()))?
        .into_inner();
    let (mut ready_ms, mut cached) = (None, 0);
    while let Some(ev) = events
        .message()
        .await
        .map_err(|e| format!("build {name}: {}", e.message()))?
    {
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if ev.phase == "step" {
            // "line L: TEXT (cached)" for a step from the cache (not "FROM ...: ... (cached)").
            if ev.message.starts_with("line ") && ev.message.ends_with("(cached)") {
                cached += 1;
            }
            log(&format!("{name}: {} after {ms:.0} ms", ev.message));
        }
        if ev.template.is_some() {
            ready_ms = Some(ms);
        }
    }
    let ready_ms = ready_ms.ok_or_else(|| format!("build {name}: no ready event"))?;
    Ok(Built { ready_ms, cached })
}

/// The names of the caller's step cache templates (`cache-HEX`).
async fn cache_templates(c: &Client) -> Result<Vec<String>, String> {
    let list = c
        .clone()
        .list_templates(ListTemplatesRequest {})
        .await
        .map_err(|e| format!("list templates: {}", e.message()))?
        .into_inner();
    Ok(list
        .templates
        .into_iter()
        .map(|t| t.name)
        .filter(|n| n.starts_with("cache-"))
        .collect())
}

/// Removes `path` (a file or a directory), if there.
fn remove(path: &std::path::Path) -> Result<(), String> {
    let r = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match r {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("{}: {e}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Prints `{"bench":"image","measure":NAME,...}` with the fields of `s` (a summary) and
/// returns its p50.
fn measure(name: &str, mut s: serde_json::Value) -> serde_json::Value {
    let p50 = s["p50"].clone();
    if let Some(o) = s.as_object_mut() {
        o.insert("bench".into(), "image".into());
        o.insert("measure".into(), name.into());
    }
    println!("{s}");
    p50
}

/// The bench: image imports cold and warm, Dockerfile builds and rebuilds, then creates of
/// the imported template against `base`.
pub async fn compare_image(a: Args) -> Result<serde_json::Value, String> {
    let dir = std::env::temp_dir().join(format!("airlock-image-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // Before the daemon: a failure here (they panic) leaves no daemon behind.
    let (layout_dir, image_mib) = (dir.join("layout"), a.image_mib);
    let images = tokio::task::spawn_blocking(move || make_images(&layout_dir, image_mib))
        .await
        .map_err(|e| format!("making the images: {e}"))?;
    let _ = std::fs::remove_dir_all(dir.join("layout"));
    let uid_base = 1_600_000_000 + (std::process::id() % 4096) * 10_000;
    let (daemon, _operator) =
        start_daemon(&a, &dir.join("daemon"), "image", &config(uid_base)).await?;
    let socket = dir.join("daemon/airlockd.sock");
    let c = airlock_api::client(Some(&format!("unix://{}", socket.display())), Some(TOKEN))
        .await
        .map_err(|e| e.to_string())?;
    make_template(&c).await?;
    let data = dir.join("daemon/data/images");
    let imports = import_runs(&c, a.runs, &data, &images).await?;
    // Dockerfile builds: a full one (no cached step), then only the last line changed.
    let context = build_context(&dir.join("context"))?;
    let builds = build_runs(&c, a.runs, &context).await?;
    let mut out = report(a.runs, &images, &imports, &builds);
    if a.create_runs > 0 && !imports.imported.is_empty() {
        compare_creates(daemon, &c, a.create_runs, &imports.imported, &mut out).await?;
    } else {
        drop(daemon);
    }
    out.insert("host".into(), host_facts());
    drop(images.registry);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(serde_json::Value::Object(out))
}

/// What the import runs measured, cold and warm; the warm template the last run left.
#[derive(Default)]
struct Imports {
    cold_unpack: Vec<f64>,
    cold_ready: Vec<f64>,
    cold_kib: Vec<f64>,
    warm_unpack: Vec<f64>,
    warm_ready: Vec<f64>,
    warm_kib: Vec<f64>,
    /// Imports that found their root filesystem made before.
    reused: usize,
    imported: String,
}

/// Bench step: `runs` rounds of a cold import (no layer, no root filesystem) and a warm one
/// (the base layers cached) of the images, through `c`; `data` is the daemon's image store.
async fn import_runs(
    c: &Client,
    runs: usize,
    data: &std::path::Path,
    images: &Images,
) -> Result<Imports, String> {
    let mut m = Imports::default();
    for run in 0..runs {
        // The last run's warm template stays, for the creates.
        if !m.imported.is_empty() {
            delete_template(c, &m.imported).await?;
        }
        // Cold: no layer, no root filesystem.
        remove(&data.join("layers"))?;
        remove(&data.join("rootfs"))?;
        let name = format!("cold-{run}");
        let x = import(c, &name, &images.cold).await?;
        delete_template(c, &name).await?;
        m.cold_unpack.push(x.unpack_ms);
        m.cold_ready.push(x.ready_ms);
        m.cold_kib.extend(x.fetched_kib);
        m.reused += usize::from(x.reused);
        // Warm: the base layers cached; bench/app's root filesystem made again.
        if let Ok(files) = std::fs::read_dir(data.join("rootfs")) {
            for f in files.flatten() {
                if f.file_name()
                    .to_string_lossy()
                    .starts_with(&images.warm_manifest)
                {
                    remove(&f.path())?;
                }
            }
        }
        let name = format!("warm-{run}");
        let x = import(c, &name, &images.warm).await?;
        m.imported = name;
        m.warm_unpack.push(x.unpack_ms);
        m.warm_ready.push(x.ready_ms);
        m.warm_kib.extend(x.fetched_kib);
        m.reused += usize::from(x.reused);
        log(&format!("import run {}/{}", run + 1, runs));
    }
    if m.reused > 0 {
        log(&format!(
            "{} imports found their root filesystem made before",
            m.reused
        ));
    }
    Ok(m)
}

/// Bench step: the builds' context (one `app.py`) made in `ctx_dir`, as a tar.
fn build_context(ctx_dir: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::create_dir_all(ctx_dir).map_err(|e| e.to_string())?;
    std::fs::write(ctx_dir.join("app.py"), "print('hello from the bench')\n")
        .map_err(|e| e.to_string())?;
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", ctx_dir)
        .and_then(|()| b.into_inner())
        .map_err(|e| format!("context tar: {e}"))
}

/// What the build runs measured: full builds' and one-line rebuilds' times to ready, and the
/// steps each rebuild took from the cache.
struct Builds {
    build_ready: Vec<f64>,
    rebuild_ready: Vec<f64>,
    rebuild_cached: Vec<f64>,
}

/// Bench step: `runs` rounds of a full Dockerfile build and one with its last line changed;
/// what they made (the step cache's templates too) deleted after each round.
async fn build_runs(c: &Client, runs: usize, context: &[u8]) -> Result<Builds, String> {
    let (mut build_ready, mut rebuild_ready, mut rebuild_cached) =
        (Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        let before = cache_templates(c).await?;
        let (full, changed) = (format!("built-{run}"), format!("rebuilt-{run}"));
        let x = build(c, &full, &dockerfile("first"), context).await?;
        if x.cached > 0 {
            log(&format!("{full}: {} steps from the cache", x.cached));
        }
        build_ready.push(x.ready_ms);
        let x = build(c, &changed, &dockerfile("changed"), context).await?;
        rebuild_ready.push(x.ready_ms);
        rebuild_cached.push(x.cached as f64);
        for name in [&full, &changed] {
            delete_template(c, name).await?;
        }
        for name in cache_templates(c).await? {
            if !before.contains(&name) {
                delete_template(c, &name).await?;
            }
        }
        log(&format!("build run {}/{}", run + 1, runs));
    }
    Ok(Builds {
        build_ready,
        rebuild_ready,
        rebuild_cached,
    })
}

/// Bench step: the report of the images, the imports and the builds (each measure printed as
/// it goes in).
fn report(
    runs: usize,
    images: &Images,
    m: &Imports,
    b: &Builds,
) -> serde_json::Map<String, serde_json::Value> {
    let mut out = serde_json::Map::new();
    out.insert("bench".into(), "image".into());
    out.insert("runs".into(), runs.into());
    out.insert(
        "image_files_mib".into(),
        serde_json::json!(images.file_bytes >> 20),
    );
    out.insert(
        "image_layers_mib".into(),
        serde_json::json!(images.layer_bytes >> 20),
    );
    out.insert(
        "top_layer_kib".into(),
        serde_json::json!(images.top_bytes >> 10),
    );
    out.insert("reused_rootfs".into(), m.reused.into());
    out.insert("dockerfile_steps".into(), 4.into());
    for (name, v) in [
        ("cold_unpack_ms", &m.cold_unpack),
        ("cold_ready_ms", &m.cold_ready),
        ("cold_fetched_kib", &m.cold_kib),
        ("warm_unpack_ms", &m.warm_unpack),
        ("warm_ready_ms", &m.warm_ready),
        ("warm_fetched_kib", &m.warm_kib),
        ("dockerfile_build_ms", &b.build_ready),
        ("dockerfile_rebuild_ms", &b.rebuild_ready),
        ("dockerfile_rebuild_cached_steps", &b.rebuild_cached),
    ] {
        out.insert(format!("{name}_p50"), measure(name, summary(v)));
    }
    out
}

/// Bench step: creates of the imported template and of `base` alternating, into `out`; the
/// imported template deleted, then the daemon stopped.
async fn compare_creates(
    daemon: Daemon,
    c: &Client,
    create_runs: usize,
    imported: &str,
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), String> {
    let mut creates = serde_json::Map::new();
    let side = (daemon, c.clone());
    let sides = [("imported", &side), ("base", &side)];
    let p50 = alternate_templates(create_runs, &sides, [imported, "base"], &mut creates).await?;
    for (name, s) in creates {
        let name = format!("create_ms_{name}");
        out.insert(format!("{name}_p50"), measure(&name, s));
    }
    let ratio = match (p50[0][0].as_f64(), p50[1][0].as_f64()) {
        (Some(i), Some(b)) if b > 0.0 => serde_json::json!((i / b * 1000.0).round() / 1000.0),
        _ => serde_json::Value::Null,
    };
    out.insert("create_ratio_imported_base_p50".into(), ratio);
    delete_template(&side.1, imported).await?;
    drop(side);
    Ok(())
}
