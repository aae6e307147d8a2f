//! System test of templates from OCI images through a live daemon, against a real registry
//! (docker-registry on loopback) serving images the test builds itself (`images/layout.rs`,
//! pushed with skopeo by `images/registry.rs`; the harness's own host-side tests are in
//! `images/selftest.rs`); and a template's SBOM (the base template's packages).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

#[path = "images/layout.rs"]
mod layout;

#[path = "images/registry.rs"]
mod registry;

#[path = "images/selftest.rs"]
mod selftest;

use airlock_system_tests::TempDir;
use layout::*;
use registry::{Auth, Registry};

use airlock_api::v1::{
    CreateSandboxRequest, CreateTemplateRequest, DeleteTemplateRequest, GetTemplateLogRequest,
    GetTemplateSbomRequest, ListSandboxesRequest, ListTemplatesRequest, OciImage,
    RebuildTemplateRequest, SandboxState, Template,
};
use airlock_system_tests::harness::{self, run_as};
use airlock_system_tests::shared::{Shared, scenario};

/// The shared daemon's settings: registries on this host speak plain HTTP, a registry that
/// sends nothing for 5 s fails the pull, an image unpacks to at most 64 MiB; tenant `images`
/// may reach this host (its egress ceiling), the default tenant may not (its ceiling is the
/// default one: public addresses only).
const CONFIG: &str = r#"
[oci]
insecure_registries = ["127.0.0.1"]
read_timeout_s = 5
max_unpacked_mib = 64
[tenants.images]
tokens = ["images-token"]
[tenants.images.egress_ceiling]
allow = [{ cidr = "127.0.0.1/32" }]
"#;
const TOKEN: &str = "images-token";

/// The shared daemon's settings.
fn config() -> String {
    format!("pool_size = 1\n{CONFIG}")
}

fn oci(reference: &str, creds: Option<(&str, &str)>) -> CreateTemplateRequest {
    let (username, password) = creds.unwrap_or_default();
    CreateTemplateRequest {
        name: String::new(),
        oci: Some(OciImage {
            reference: reference.into(),
            username: username.into(),
            password: password.into(),
        }),
        ..Default::default()
    }
}

/// Builds `req` as `name`: the progress events' phases and the template, or the refusal.
async fn build(
    s: &Shared,
    token: Option<&str>,
    name: &str,
    req: CreateTemplateRequest,
) -> Result<(Vec<String>, Template), tonic::Status> {
    let mut c = s.client(token).await;
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: name.into(),
            ..req
        })
        .await?
        .into_inner();
    let mut phases = Vec::new();
    let mut template = None;
    while let Some(ev) = events.message().await? {
        phases.push(format!("{}: {}", ev.phase, ev.message));
        if let Some(t) = ev.template {
            template = Some(t);
        }
    }
    Ok((
        phases,
        template.expect("the last event carries the template"),
    ))
}

/// `req` is refused with `reason`, and the message has each of `says`.
async fn refused(
    s: &Shared,
    token: Option<&str>,
    req: CreateTemplateRequest,
    reason: &str,
    says: &[&str],
) {
    let what = req
        .oci
        .as_ref()
        .map(|o| o.reference.clone())
        .unwrap_or_default();
    let e = match build(s, token, "refused", req).await {
        Ok((phases, t)) => panic!("{what}: built {t:?} ({phases:?}), expected {reason}"),
        Err(e) => e,
    };
    let (got, _) = harness::reason(&e);
    assert_eq!(got, reason, "{what}: {}", e.message());
    for w in says {
        assert!(
            e.message().contains(w),
            "{what}: {w:?} missing from {:?}",
            e.message()
        );
    }
}

/// A multi-layer image (gzip and zstd layers; a whiteout and an opaque directory in the top
/// layer; Env, WorkingDir and User in its config) behind a registry with token auth, as the
/// linux/amd64 entry of an index with an arm64 one, becomes a template: the tag is recorded
/// with the digest it had, and a sandbox of it runs the image's busybox `sh` through the
/// agent as the image's user in its working directory with its environment, deleted files
/// really absent, the image's own files as they were and the agent beside them in /.airlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oci_image_becomes_a_template_whose_sandboxes_run_it() {
    let reg = Registry::start(Auth::token("puller", "pull-pw"));
    let dir = TempDir::new("oci-app");
    let image = Image {
        layers: vec![
            busybox_layer(Compression::Gzip),
            accounts_layer(Compression::Zstd)
                .file("etc/removed", "gone\n")
                .dir("opt/data")
                .file("opt/data/old", "old\n")
                .file("opt/data/sub/older", "older\n"),
            Layer::new(Compression::Gzip)
                .whiteout("etc/removed")
                .opaque("opt/data")
                .file("opt/data/new", "new\n")
                .file_with("usr/bin/tool", "#!/bin/sh\necho tool\n", 0o4755, 0, 0),
        ],
        config: ImageConfig {
            env: vec![
                "PATH=/bin:/usr/bin".into(),
                "GREETING=hello from the image".into(),
            ],
            working_dir: Some("/home/app".into()),
            user: Some("app".into()),
            cmd: Some(vec!["/bin/sh".into()]),
            ..ImageConfig::amd64()
        },
    };
    let index = write_index(
        &dir.0,
        "v1",
        &[other_platform_image("linux", "arm64"), image],
    );
    reg.push(&dir.0, "team/app:v1");
    let amd64 = &index.images[1];
    let reference = reg.reference("team/app:v1");

    let (_serial, s) = scenario(&config()).await;
    let (phases, t) = build(
        s,
        Some(TOKEN),
        "app",
        oci(&reference, Some(("puller", "pull-pw"))),
    )
    .await
    .unwrap_or_else(|e| panic!("build: {e:?}\n{}", s.log_tail()));
    assert_eq!(
        t.source,
        format!("oci:{reference}@{}", amd64.manifest.digest),
        "{phases:?}"
    );
    assert!(
        phases.iter().any(|p| p.starts_with("pulling")),
        "{phases:?}"
    );
    let d = t.image_defaults.clone().expect("the image's defaults");
    assert_eq!(
        (d.user.as_str(), d.working_dir.as_str()),
        ("app", "/home/app")
    );
    assert!(
        reg.token_server()
            .unwrap()
            .requests()
            .iter()
            .any(|(granted, scopes)| *granted
                && scopes
                    .iter()
                    .any(|s| s.contains("team/app") && s.contains("pull"))),
        "the daemon pulled with a bearer token"
    );

    let mut c = s.client(Some(TOKEN)).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            template: "app".into(),
            env: [("EXTRA".to_string(), "from the create".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let script = "echo \"$GREETING\"; echo \"$EXTRA\"; pwd; id -u; id -g; \
                  test -e /etc/removed && echo removed-present; ls /opt/data; \
                  stat -c %a /usr/bin/tool; cat /etc/passwd | wc -l; \
                  ls /.airlock; readlink /bin/sh";
    let (out, err, ex) = run_as(&mut c, &sb.id, "", &["sh", "-c", script]).await;
    assert_eq!(ex.exit_code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "hello from the image",
            "from the create",
            "/home/app",
            "1234",
            "1234",
            "new",
            "4755",
            "2",
            "airlock-agent",
            "busybox",
        ],
        "{err}"
    );
    // Root when asked; the image's WorkingDir holds for every account (as in a container).
    let (out, _, _) = run_as(&mut c, &sb.id, "root", &["sh", "-c", "id -u; pwd"]).await;
    assert_eq!(out, "0\n/home/app\n");

    // Its build log is kept; a rebuild (the image pulled again with the rebuild's credentials)
    // is a new version that takes the tag, while the old one stays, tagged with its id, for
    // the sandbox that runs from it.
    let log = c
        .get_template_log(GetTemplateLogRequest { name: "app".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(
        log.log.contains("pulling") && log.log.contains("ready"),
        "{}",
        log.log
    );
    assert!(!log.log.contains("pull-pw"), "{}", log.log);
    let mut events = c
        .rebuild_template(RebuildTemplateRequest {
            name: "app".into(),
            registry_username: "puller".into(),
            registry_password: "pull-pw".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("rebuild: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let mut rebuilt = None;
    while let Some(ev) = events
        .message()
        .await
        .unwrap_or_else(|e| panic!("rebuild: {e:?}\n{}", s.log_tail()))
    {
        rebuilt = ev.template.or(rebuilt);
    }
    let rebuilt = rebuilt.expect("the rebuilt template");
    assert_ne!(rebuilt.id, t.id);
    assert_eq!(
        (rebuilt.tag.as_str(), rebuilt.source.as_str()),
        ("latest", t.source.as_str())
    );
    let listed = c
        .list_templates(ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates;
    let old = listed
        .iter()
        .find(|v| v.id == t.id)
        .expect("the old version");
    assert_eq!(
        (old.name.as_str(), old.tag.as_str(), old.live_sandboxes),
        ("app", t.id.as_str(), 1)
    );
    let busy = c
        .delete_template(DeleteTemplateRequest {
            name: format!("app:{}", t.id),
        })
        .await
        .unwrap_err();
    assert_eq!(harness::reason(&busy).0, "TEMPLATE_IN_USE", "{busy:?}");
    let sb2 = c
        .create_sandbox(CreateSandboxRequest {
            template: "app".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create from the rebuild: {e:?}\n{}", s.log_tail()))
        .into_inner();
    assert_eq!(sb2.template_id, rebuilt.id);
    let (out, _, _) = run_as(&mut c, &sb2.id, "", &["sh", "-c", "echo \"$GREETING\""]).await;
    assert_eq!(out, "hello from the image\n");
    // The rebuild's recipe is kept without the credentials.
    let recipe = std::fs::read(
        s.data_dir
            .join("templates")
            .join(&rebuilt.id)
            .join("recipe.pb"),
    )
    .expect("the kept recipe");
    assert!(
        recipe.windows(8).any(|w| w == b"team/app"),
        "the image's reference"
    );
    assert!(
        !recipe.windows(7).any(|w| w == b"pull-pw"),
        "a password in the recipe"
    );
    s.clean(&[TOKEN]).await;
    // The image's root filesystem goes with the last version booted from it.
    let hex = amd64
        .manifest
        .digest
        .trim_start_matches("sha256:")
        .to_owned();
    let rootfs_of_image = || {
        std::fs::read_dir(s.data_dir.join("images").join("rootfs"))
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().starts_with(&hex))
    };
    assert!(rootfs_of_image());
    for v in [format!("app:{}", t.id), "app".into()] {
        c.delete_template(DeleteTemplateRequest { name: v.clone() })
            .await
            .unwrap();
        assert_eq!(rootfs_of_image(), v != "app", "after deleting {v}");
    }
}

/// What must not become a template is refused before anything boots, with an error that
/// names the layer and the entry, and the host outside the build directory untouched:
/// a registry outside the tenant's egress ceiling, path traversal, absolute names, symlinks
/// out of the root or written through, hard links out of the tree, device nodes, a
/// decompression bomb, a layer whose content does not match its digest, an index without
/// linux/amd64, wrong credentials, a manifest over the cap and a registry that never answers.
/// Images sharing a base layer fetch it once (layers are cached by digest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_broken_images_are_refused_before_anything_boots() {
    let reg = Registry::start(Auth::None);
    let (_serial, s) = scenario(&config()).await;
    // A base layer of this test's own (another test's layers may be in the cache already).
    let base = busybox_layer(Compression::Gzip).file("etc/base", "hostile images' base\n");
    let victim = TempDir::new("oci-victim");
    let victim_path = victim.0.display().to_string();
    let push = |name: &str, top: Layer| {
        let dir = TempDir::new("oci-hostile");
        let image = Image {
            layers: vec![base.clone(), top],
            config: ImageConfig::amd64(),
        };
        let d = write_image(&dir.0, "v1", &image);
        reg.push(&dir.0, &format!("hostile/{name}:v1"));
        (reg.reference(&format!("hostile/{name}:v1")), d)
    };

    // Not within the default tenant's ceiling (public addresses only).
    let (plain, plain_digests) = push("plain", Layer::new(Compression::Gzip).file("ok", "ok"));
    refused(
        s,
        None,
        oci(&plain, None),
        "NETWORK_NOT_ALLOWED",
        &["127.0.0.1/32"],
    )
    .await;

    let bomb = vec![0u8; 100 << 20];
    let cases: Vec<(&str, Layer, &str, &str)> = vec![
        (
            "dotdot",
            Layer::new(Compression::Gzip).raw_file(b"../escape", "x"),
            "../escape",
            "path traversal",
        ),
        (
            "absolute",
            Layer::new(Compression::Gzip).raw_file(b"/etc/evil", "x"),
            "/etc/evil",
            "absolute",
        ),
        (
            "symlink-out",
            Layer::new(Compression::Gzip).symlink("usr/lib/up", "../../../../.."),
            "usr/lib/up",
            "out of the image",
        ),
        (
            "through-symlink",
            Layer::new(Compression::Gzip)
                .symlink("victim", &victim_path)
                .file("victim/pwned", "pwned"),
            "victim/pwned",
            "symlink earlier",
        ),
        (
            "hardlink-out",
            Layer::new(Compression::Gzip).raw_link(b"h", tar::EntryType::Link, b"/etc/shadow"),
            "h",
            "absolute",
        ),
        (
            "device",
            Layer::new(Compression::Gzip).char_device("dev/mem", 1, 1),
            "dev/mem",
            "device node",
        ),
        (
            "reserved",
            Layer::new(Compression::Gzip).file(".airlock/airlock-agent", "fake"),
            ".airlock/airlock-agent",
            "reserved",
        ),
        (
            "bomb",
            Layer::new(Compression::Gzip).file("zeros", bomb),
            "",
            "cap",
        ),
    ];
    for (name, top, entry, why) in cases {
        let (reference, d) = push(name, top);
        let layer = d.layers[1].digest.clone();
        let mut says = vec![layer.as_str(), why];
        if !entry.is_empty() {
            says.push(entry);
        }
        refused(
            s,
            Some(TOKEN),
            oci(&reference, None),
            "IMAGE_REFUSED",
            &says,
        )
        .await;
    }
    assert!(
        !victim.0.join("pwned").exists(),
        "nothing was written through the symlink"
    );
    let base_digest = plain_digests.layers[0].digest.clone();
    let base_fetches = reg
        .log()
        .lines()
        // The access log's lines ("127.0.0.1 - - [...] "GET /v2/.../blobs/sha256:... ").
        .filter(|l| l.contains("\"GET ") && l.contains(&format!("/blobs/{base_digest}")))
        .count();
    assert_eq!(
        base_fetches,
        1,
        "the shared base layer was fetched once:\n{}",
        reg.log()
    );

    // A layer whose content is not what its digest says.
    let (bad, d) = push(
        "corrupt",
        Layer::new(Compression::Gzip).file("f", "content"),
    );
    reg.corrupt_blob(&d.layers[1].digest);
    refused(
        s,
        Some(TOKEN),
        oci(&bad, None),
        "IMAGE_REFUSED",
        &[&d.layers[1].digest, "digest"],
    )
    .await;

    // An index without linux/amd64.
    let dir = TempDir::new("oci-arm");
    write_index(&dir.0, "v1", &[other_platform_image("linux", "arm64")]);
    reg.push(&dir.0, "arm/only:v1");
    refused(
        s,
        Some(TOKEN),
        oci(&reg.reference("arm/only:v1"), None),
        "IMAGE_REFUSED",
        &["linux/arm64"],
    )
    .await;

    // Wrong credentials on a registry with basic auth.
    let locked = Registry::start(Auth::basic("owner", "right"));
    let dir = TempDir::new("oci-locked");
    write_image(&dir.0, "v1", &busybox_image());
    locked.push(&dir.0, "private/app:v1");
    refused(
        s,
        Some(TOKEN),
        oci(
            &locked.reference("private/app:v1"),
            Some(("owner", "wrong")),
        ),
        "REGISTRY_UNAVAILABLE",
        &["401"],
    )
    .await;

    // A registry that sends a 5 MiB manifest, and one that never answers.
    let fake = FakeRegistry::start("plain");
    refused(
        s,
        Some(TOKEN),
        oci(&format!("127.0.0.1:{}/big/app:v1", fake.port), None),
        "IMAGE_REFUSED",
        &["larger than 4 MiB"],
    )
    .await;
    let t0 = std::time::Instant::now();
    refused(
        s,
        Some(TOKEN),
        oci(&format!("127.0.0.1:{}/slow/app:v1", fake.port), None),
        "REGISTRY_UNAVAILABLE",
        &["slow/app"],
    )
    .await;
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(60),
        "read_timeout_s ends the wait"
    );
    // A registry within the ceiling cannot send the daemon elsewhere: not by a redirect, not
    // by its token realm (127.0.0.2 is outside the tenant's ceiling, 127.0.0.1/32).
    refused(
        s,
        Some(TOKEN),
        oci(&format!("127.0.0.1:{}/redirect/app:v1", fake.port), None),
        "REGISTRY_UNAVAILABLE",
        &["127.0.0.2:9/elsewhere", "refused"],
    )
    .await;
    let realm = FakeRegistry::start("realm");
    refused(
        s,
        Some(TOKEN),
        oci(&format!("127.0.0.1:{}/app:v1", realm.port), None),
        "REGISTRY_UNAVAILABLE",
        &["token realm http://127.0.0.2:9/token is refused"],
    )
    .await;
    let mut c = s.client(Some(TOKEN)).await;
    let left = c
        .list_templates(airlock_api::v1::ListTemplatesRequest {})
        .await
        .unwrap()
        .into_inner()
        .templates;
    assert!(
        left.iter().all(|t| t.name != "refused"),
        "no template was made"
    );
}

/// A registry that answers `/v2/` and then either sends a manifest over the daemon's cap
/// (`big/`) or nothing at all (`slow/`).
struct FakeRegistry {
    child: std::process::Child,
    port: u16,
}

const FAKE_REGISTRY: &str = r#"
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == '/v2/' and sys.argv[2] == 'realm':
            self.send_response(401)
            self.send_header('WWW-Authenticate', 'Bearer realm="http://127.0.0.2:9/token",service="x"')
            self.send_header('Content-Length', '0'); self.end_headers(); return
        if self.path == '/v2/':
            self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers(); return
        if '/redirect/' in self.path:
            self.send_response(307); self.send_header('Location', 'http://127.0.0.2:9/elsewhere')
            self.send_header('Content-Length', '0'); self.end_headers(); return
        if '/slow/' in self.path:
            time.sleep(3600); return
        body = b'{"schemaVersion": 2, "pad": "' + b'x' * (5 << 20) + b'"}'
        self.send_response(200)
        self.send_header('Content-Type', 'application/vnd.oci.image.manifest.v1+json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"#;

impl FakeRegistry {
    /// `mode`: "plain", or "realm" (its `/v2/` asks for a token from a realm on 127.0.0.2).
    fn start(mode: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = std::process::Command::new("python3")
            .args(["-c", FAKE_REGISTRY, &port.to_string(), mode])
            .spawn()
            .unwrap();
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Self { child, port }
    }
}

impl Drop for FakeRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The base template's SBOM lists its Debian packages (git among them), its global npm
/// packages and its kernel and agent, in CycloneDX and SPDX; the sandbox that read them is
/// gone afterwards, and a second call gives what was kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_tells_what_it_is_made_of() {
    let (_serial, s) = scenario(&config()).await;
    let mut c = s.client(Some(TOKEN)).await;
    let sbom = |format: &str| GetTemplateSbomRequest {
        name: "base".into(),
        format: format.into(),
    };
    let t0 = std::time::Instant::now();
    let cdx = c
        .get_template_sbom(sbom("cyclonedx"))
        .await
        .unwrap_or_else(|e| panic!("sbom: {e:?}\n{}", s.log_tail()))
        .into_inner();
    eprintln!(
        "sbom: {} packages found in {:?}",
        cdx.packages.len(),
        t0.elapsed()
    );
    let has = |eco: &str, name: &str| {
        cdx.packages
            .iter()
            .any(|p| p.ecosystem == eco && p.name == name && !p.version.is_empty())
    };
    for (eco, name) in [
        ("deb", "git"),
        ("deb", "curl"),
        ("deb", "python3"),
        ("npm", "npm"),
        ("airlock", "guest-kernel"),
        ("airlock", "airlock-agent"),
    ] {
        assert!(has(eco, name), "{eco} {name} missing: {:?}", cdx.packages);
    }
    let doc: serde_json::Value = serde_json::from_str(&cdx.document).unwrap();
    assert_eq!(doc["bomFormat"], "CycloneDX");
    assert_eq!(
        doc["components"].as_array().unwrap().len(),
        cdx.packages.len()
    );
    let git = cdx.packages.iter().find(|p| p.name == "git").unwrap();
    assert!(git.purl.starts_with("pkg:deb/debian/git@"), "{git:?}");
    let spdx = c
        .get_template_sbom(sbom("spdx"))
        .await
        .unwrap()
        .into_inner();
    let doc: serde_json::Value = serde_json::from_str(&spdx.document).unwrap();
    assert_eq!(doc["spdxVersion"], "SPDX-2.3");
    assert_eq!(spdx.packages, cdx.packages, "the kept list");
    let left = c
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert!(
        left.iter().all(|sb| !sb.labels.contains_key("airlock.sbom")
            || sb.state == SandboxState::Destroyed as i32),
        "{left:?}"
    );
    let bad = c.get_template_sbom(sbom("xml")).await.unwrap_err();
    assert_eq!(harness::reason(&bad).0, "INVALID_ARGUMENT");
}
