//! Host-side tests of the OCI image harness (`images/layout.rs`, `images/registry.rs`), with
//! no VM and no daemon: images built here are pushed with skopeo to a real local registry
//! (docker-registry) and read back over HTTP as a pulling client would: anonymously, with
//! basic credentials and through the bearer-token flow; an image index of two platforms; a
//! blob corrupted in the registry's storage; and layers whose tar names are hostile.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

#[path = "images/layout.rs"]
mod layout;
#[path = "packages/registries.rs"]
#[allow(dead_code)] // the pypiserver part serves here
mod registries;
#[path = "images/registry.rs"]
mod registry;

use airlock_system_tests::TempDir;
use layout::*;
use registry::{Auth, Registry, TOKEN_SERVICE};
use serde_json::Value;

const ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
                      application/vnd.oci.image.index.v1+json";

/// How a request authenticates.
#[derive(Clone, Copy)]
enum Cred<'a> {
    None,
    Basic(&'a str, &'a str),
    Bearer(&'a str),
}

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn get(url: &str, cred: Cred<'_>) -> Answer {
    let client = reqwest::Client::new();
    let mut req = client.get(url).header("Accept", ACCEPT);
    req = match cred {
        Cred::None => req,
        Cred::Basic(user, password) => req.basic_auth(user, Some(password)),
        Cred::Bearer(token) => req.bearer_auth(token),
    };
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    Answer {
        status: resp.status().as_u16(),
        headers: resp.headers().clone(),
        body: resp.bytes().await.unwrap().to_vec(),
    }
}

/// The busybox image in a fresh layout tagged `v1`.
fn busybox_layout() -> (TempDir, ImageDigests) {
    let dir = TempDir::new("oci-layout");
    let digests = write_image(&dir.0, "v1", &busybox_image());
    (dir, digests)
}

/// The manifest `reference` of `repo` and a blob of it, as a client fetches them, checked
/// against what was written.
async fn check_image(reg: &Registry, repo: &str, image: &ImageDigests, cred: Cred<'_>) {
    let m = get(&reg.url(&format!("/v2/{repo}/manifests/v1")), cred).await;
    assert_eq!(
        m.status,
        200,
        "manifest: {}",
        String::from_utf8_lossy(&m.body)
    );
    assert_eq!(m.header("docker-content-digest"), image.manifest.digest);
    assert_eq!(sha256_digest(&m.body), image.manifest.digest);
    assert_eq!(m.header("content-type"), MEDIA_MANIFEST);
    let manifest = m.json();
    assert_eq!(manifest["config"]["digest"], image.config.digest.as_str());
    let media: Vec<_> = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["mediaType"].as_str().unwrap().to_string())
        .collect();
    let expected: Vec<_> = image.layers.iter().map(|l| l.media_type.clone()).collect();
    assert_eq!(media, expected);

    let config = get(
        &reg.url(&format!("/v2/{repo}/blobs/{}", image.config.digest)),
        cred,
    )
    .await;
    assert_eq!(config.status, 200);
    assert_eq!(sha256_digest(&config.body), image.config.digest);
    let diff_ids: Vec<_> = config.json()["rootfs"]["diff_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect();
    assert_eq!(diff_ids, image.diff_ids);

    for (layer, diff_id) in image.layers.iter().zip(&image.diff_ids) {
        let blob = get(
            &reg.url(&format!("/v2/{repo}/blobs/{}", layer.digest)),
            cred,
        )
        .await;
        assert_eq!(blob.status, 200);
        assert_eq!(sha256_digest(&blob.body), layer.digest);
        assert_eq!(blob.body.len() as u64, layer.size);
        let tar = decompress(&layer.media_type, &blob.body);
        assert_eq!(&sha256_digest(&tar), diff_id);
    }
}

/// A Bearer challenge's parameters (`realm`, `service`, `scope`).
fn challenge(header: &str) -> std::collections::HashMap<String, String> {
    let rest = header
        .strip_prefix("Bearer ")
        .unwrap_or_else(|| panic!("not a Bearer challenge: {header:?}"));
    let mut params = std::collections::HashMap::new();
    let mut s = rest;
    while let Some((key, after)) = s.split_once("=\"") {
        let (value, tail) = after.split_once('"').unwrap();
        params.insert(
            key.trim_start_matches(',').trim().to_string(),
            value.to_string(),
        );
        s = tail;
    }
    params
}

#[tokio::test]
async fn anonymous_push_and_pull() {
    let reg = Registry::start(Auth::None);
    let (dir, image) = busybox_layout();
    assert_eq!(image.layers[0].media_type, MEDIA_LAYER_GZIP);
    assert_eq!(image.layers[1].media_type, MEDIA_LAYER_ZSTD);
    reg.push(&dir.0, "busybox:v1");
    check_image(&reg, "busybox", &image, Cred::None).await;
    assert_eq!(
        reg.reference("busybox:v1"),
        format!("{}/busybox:v1", reg.host())
    );

    // The busybox layer has the host's binary and its links.
    let blob = get(
        &reg.url(&format!("/v2/busybox/blobs/{}", image.layers[0].digest)),
        Cred::None,
    )
    .await;
    let tar = decompress(MEDIA_LAYER_GZIP, &blob.body);
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut seen = Vec::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let path = String::from_utf8(entry.path_bytes().into_owned()).unwrap();
        if path == "bin/busybox" {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            assert_eq!(data, std::fs::read(HOST_BUSYBOX).unwrap());
            assert_eq!(entry.header().mode().unwrap(), 0o755);
        }
        if path == "bin/sh" {
            assert_eq!(entry.header().entry_type(), tar::EntryType::Symlink);
            assert_eq!(&*entry.link_name_bytes().unwrap(), b"busybox");
        }
        seen.push(path);
    }
    for applet in BUSYBOX_APPLETS {
        assert!(
            seen.contains(&format!("bin/{applet}")),
            "{applet} in {seen:?}"
        );
    }
}

#[tokio::test]
async fn basic_auth() {
    let reg = Registry::start(Auth::basic("alice", "s3cret"));
    let (dir, image) = busybox_layout();
    reg.push(&dir.0, "team/busybox:v1");
    check_image(&reg, "team/busybox", &image, Cred::Basic("alice", "s3cret")).await;

    let url = reg.url("/v2/team/busybox/manifests/v1");
    let anonymous = get(&url, Cred::None).await;
    assert_eq!(anonymous.status, 401);
    assert!(anonymous.header("www-authenticate").starts_with("Basic "));
    assert_eq!(get(&url, Cred::Basic("alice", "wrong")).await.status, 401);
    assert_eq!(get(&reg.url("/v2/"), Cred::None).await.status, 401);
}

#[tokio::test]
async fn token_auth() {
    let reg = Registry::start(Auth::token("bob", "t0ken-pass"));
    let (dir, image) = busybox_layout();
    reg.push(&dir.0, "busybox:v1");
    let server = reg.token_server().unwrap();
    assert!(
        server.requests().iter().any(|(granted, scopes)| *granted
            && scopes.iter().any(|s| s == "repository:busybox:pull,push")),
        "skopeo got a push token: {:?}",
        server.requests()
    );

    // 401 with a Bearer challenge ...
    let url = reg.url("/v2/busybox/manifests/v1");
    let refused = get(&url, Cred::None).await;
    assert_eq!(refused.status, 401);
    let params = challenge(&refused.header("www-authenticate"));
    assert_eq!(params["realm"], server.realm());
    assert_eq!(params["service"], TOKEN_SERVICE);
    assert_eq!(params["scope"], "repository:busybox:pull");
    // ... a token from the realm with basic credentials ...
    let token_url = format!(
        "{}?service={}&scope={}",
        params["realm"], params["service"], params["scope"]
    );
    let wrong = get(&token_url, Cred::Basic("bob", "wrong")).await;
    assert_eq!(wrong.status, 401);
    assert!(wrong.json().get("token").is_none());
    assert_eq!(get(&token_url, Cred::None).await.status, 401);
    let answer = get(&token_url, Cred::Basic("bob", "t0ken-pass")).await;
    assert_eq!(answer.status, 200);
    let token = answer.json()["token"].as_str().unwrap().to_string();
    assert_eq!(answer.json()["access_token"], token.as_str());
    // ... and 200 with it.
    check_image(&reg, "busybox", &image, Cred::Bearer(&token)).await;
    // A token for another repository does not open this one.
    let other = server.issue(&["repository:other:pull".to_string()]);
    assert_eq!(get(&url, Cred::Bearer(&other)).await.status, 401);
    assert_eq!(get(&url, Cred::Bearer("not.a.token")).await.status, 401);
}

#[tokio::test]
async fn image_index_of_two_platforms() {
    let reg = Registry::start(Auth::None);
    let dir = TempDir::new("oci-layout");
    let index = write_index(
        &dir.0,
        "multi",
        &[other_platform_image("linux", "arm64"), busybox_image()],
    );
    reg.push(&dir.0, "multi:multi");

    let got = get(&reg.url("/v2/multi/manifests/multi"), Cred::None).await;
    assert_eq!(got.status, 200);
    assert_eq!(got.header("content-type"), MEDIA_INDEX);
    assert_eq!(sha256_digest(&got.body), index.index.digest);
    let manifests = got.json()["manifests"].as_array().unwrap().clone();
    let platforms: Vec<_> = manifests
        .iter()
        .map(|m| {
            format!(
                "{}/{}",
                m["platform"]["os"].as_str().unwrap(),
                m["platform"]["architecture"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(platforms, ["linux/arm64", "linux/amd64"]);
    for (entry, image) in manifests.iter().zip(&index.images) {
        assert_eq!(entry["digest"], image.manifest.digest.as_str());
        let m = get(
            &reg.url(&format!("/v2/multi/manifests/{}", image.manifest.digest)),
            Cred::None,
        )
        .await;
        assert_eq!(m.status, 200);
        assert_eq!(sha256_digest(&m.body), image.manifest.digest);
        // --all copied every platform's blobs.
        for layer in &image.layers {
            let blob = get(
                &reg.url(&format!("/v2/multi/blobs/{}", layer.digest)),
                Cred::None,
            )
            .await;
            assert_eq!(blob.status, 200);
        }
    }
    assert_ne!(
        index.images[0].manifest.digest,
        index.images[1].manifest.digest
    );
}

#[tokio::test]
async fn corrupted_blob_no_longer_matches_its_digest() {
    let reg = Registry::start(Auth::None);
    let (dir, image) = busybox_layout();
    reg.push(&dir.0, "busybox:v1");
    let layer = &image.layers[1];
    let url = reg.url(&format!("/v2/busybox/blobs/{}", layer.digest));
    assert_eq!(
        sha256_digest(&get(&url, Cred::None).await.body),
        layer.digest
    );

    reg.corrupt_blob(&layer.digest);
    let served = get(&url, Cred::None).await;
    assert_eq!(served.status, 200);
    assert_eq!(served.body.len() as u64, layer.size);
    assert_ne!(sha256_digest(&served.body), layer.digest);
}

#[tokio::test]
async fn hostile_tar_names_are_written_as_given() {
    let layer = Layer::new(Compression::Gzip)
        .raw_file(b"../escape", "out of the root\n")
        .raw_file(b"/etc/evil", "absolute\n")
        .raw_file(b"a/../../twice", "dot-dot inside\n")
        .raw_link(
            b"evil-link",
            tar::EntryType::Symlink,
            b"../../../../etc/shadow",
        )
        .raw_link(b"evil-hard", tar::EntryType::Link, b"/etc/shadow")
        .char_device("dev/mem", 1, 1)
        .whiteout("usr/bin/python3")
        .opaque("var/lib");
    let tar = layer.tar();
    let names = tar_names(&tar);
    let expected: [&[u8]; 8] = [
        b"../escape",
        b"/etc/evil",
        b"a/../../twice",
        b"evil-link",
        b"evil-hard",
        b"dev/mem",
        b"usr/bin/.wh.python3",
        b"var/lib/.wh..wh..opq",
    ];
    assert_eq!(names, expected.map(<[u8]>::to_vec));
    // The header bytes themselves, not the tar crate's reading of them.
    let mut archive = tar::Archive::new(tar.as_slice());
    let headers: Vec<_> = archive
        .entries()
        .unwrap()
        .map(|e| e.unwrap().header().clone())
        .collect();
    let name = |h: &tar::Header| {
        let raw = &h.as_old().name;
        raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())].to_vec()
    };
    assert_eq!(name(&headers[0]), b"../escape");
    assert_eq!(name(&headers[1]), b"/etc/evil");
    assert_eq!(
        &headers[3].link_name_bytes().unwrap()[..],
        b"../../../../etc/shadow"
    );
    assert_eq!(headers[4].entry_type(), tar::EntryType::Link);
    assert_eq!(headers[5].entry_type(), tar::EntryType::Char);
    assert_eq!(headers[5].device_major().unwrap(), Some(1));

    // The registry and skopeo pass the layer through untouched.
    let reg = Registry::start(Auth::None);
    let dir = TempDir::new("oci-layout");
    let image = write_image(
        &dir.0,
        "v1",
        &Image {
            layers: vec![busybox_layer(Compression::Zstd), layer],
            config: ImageConfig::amd64(),
        },
    );
    reg.push(&dir.0, "hostile:v1");
    let blob = get(
        &reg.url(&format!("/v2/hostile/blobs/{}", image.layers[1].digest)),
        Cred::None,
    )
    .await;
    assert_eq!(blob.status, 200);
    assert_eq!(tar_names(&decompress(MEDIA_LAYER_GZIP, &blob.body)), names);
}

#[test]
fn layer_entries_as_described() {
    let layer = accounts_layer(Compression::None)
        .file_with("/opt/tool", "#!/bin/sh\n", 0o4755, 0, 0)
        .hardlink("/opt/tool-again", "/opt/tool")
        .symlink("/usr/bin/sh", "/bin/busybox");
    let tar = layer.tar();
    let mut archive = tar::Archive::new(tar.as_slice());
    let mut by_name = std::collections::HashMap::new();
    for entry in archive.entries().unwrap() {
        let entry = entry.unwrap();
        let name = String::from_utf8(entry.path_bytes().into_owned()).unwrap();
        by_name.insert(name, entry.header().clone());
    }
    let home = &by_name["home/app/"];
    assert_eq!(home.entry_type(), tar::EntryType::Directory);
    assert_eq!(
        (home.uid().unwrap(), home.gid().unwrap()),
        (APP_UID, APP_UID)
    );
    assert_eq!(by_name["tmp/"].mode().unwrap(), 0o1777);
    assert_eq!(by_name["opt/tool"].mode().unwrap(), 0o4755);
    let hard = &by_name["opt/tool-again"];
    assert_eq!(hard.entry_type(), tar::EntryType::Link);
    assert_eq!(&hard.link_name_bytes().unwrap()[..], b"opt/tool");
    assert_eq!(
        &by_name["usr/bin/sh"].link_name_bytes().unwrap()[..],
        b"/bin/busybox"
    );
    assert_eq!(by_name["etc/passwd"].mtime().unwrap(), MTIME);
    // Reproducible: the same description, the same blob.
    for c in [Compression::None, Compression::Gzip, Compression::Zstd] {
        assert_eq!(c.compress(&tar), c.compress(&layer.tar()));
        assert_eq!(decompress(c.media_type(), &c.compress(&tar)), tar);
    }
}

// ---- the daemon: OCI images become templates ----

use airlock_api::v1::{CreateSandboxRequest, CreateTemplateRequest, OciImage, Template};
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

/// The shared daemon's settings: [`CONFIG`] with the package registries of
/// `packages/registries.rs` (a real pypiserver on loopback) for Dockerfile builds' pip.
fn config() -> String {
    format!("{}{CONFIG}", registries::registries().config())
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
    s.clean(&[TOKEN]).await;
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
    let fake = FakeRegistry::start();
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
        if self.path == '/v2/':
            self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers(); return
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
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = std::process::Command::new("python3")
            .args(["-c", FAKE_REGISTRY, &port.to_string()])
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

// ---- Dockerfile builds ----

const DOCKERFILE: &str = r#"# The app's toolchain.
FROM base
ARG GREETING=hello
ENV APP_HOME=/home/user/app
WORKDIR /home/user/app
COPY app.py ./
COPY data/ data/
RUN python3 -m pip install --no-deps airlock-demo==1.0
RUN echo "$GREETING, built" > built.txt
CMD ["python3", "app.py"]
"#;

async fn build_dockerfile(
    s: &Shared,
    name: &str,
    dockerfile: &str,
    context: &std::path::Path,
) -> Result<(Vec<(String, String)>, Template), tonic::Status> {
    let mut c = s.client(None).await;
    let req = airlock_api::v1::BuildTemplateRequest {
        name: name.into(),
        dockerfile: dockerfile.into(),
        context: context_tar(context),
        start: "busybox httpd -f -p 8000".into(),
        ready_url: "http://127.0.0.1:8000/built.txt".into(),
        ..Default::default()
    };
    let mut events = c.build_template(req).await?.into_inner();
    let mut seen = Vec::new();
    let mut template = None;
    while let Some(ev) = events.message().await? {
        if ev.phase != "output" {
            eprintln!(
                "[{:6.1} s] {name}: {}: {}",
                ev.elapsed_ms as f64 / 1e3,
                ev.phase,
                ev.message
            );
        }
        seen.push((ev.phase.clone(), ev.message.clone()));
        if let Some(t) = ev.template {
            template = Some(t);
        }
    }
    Ok((seen, template.expect("the last event carries the template")))
}

/// The context directory as the CLI sends it: an uncompressed tar.
fn context_tar(dir: &std::path::Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// A Dockerfile becomes a template: FROM base, ARG, ENV, WORKDIR, COPY of a file and of a
/// directory from the uploaded context, a RUN whose pip installs through the package proxy
/// (its output streamed), and a server started with a ready check before the snapshot. A
/// sandbox of the template has the files, the package, the environment and the working
/// directory, and the server already answering. A second build that changes only the last
/// line takes every earlier step from the cache and re-runs that one; an unsupported
/// instruction and a failing RUN are refused naming their lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dockerfile_becomes_a_template_and_a_rebuild_reruns_only_the_changed_step() {
    let (_serial, s) = scenario(&config()).await;
    let ctx = TempDir::new("build-ctx");
    std::fs::write(
        ctx.0.join("app.py"),
        "import airlock_demo\nprint(airlock_demo.VALUE)\nprint(open('data/note.txt').read().strip())\n",
    )
    .unwrap();
    std::fs::create_dir_all(ctx.0.join("data")).unwrap();
    std::fs::write(ctx.0.join("data/note.txt"), "a note from the context\n").unwrap();

    let (events, t) = build_dockerfile(s, "app-built", DOCKERFILE, &ctx.0)
        .await
        .unwrap_or_else(|e| panic!("build: {e:?}\n{}", s.log_tail()));
    let output: String = events
        .iter()
        .filter(|(p, _)| p == "output")
        .map(|(_, m)| m.as_str())
        .collect();
    assert!(
        output.contains("Successfully installed airlock-demo-1.0"),
        "{events:?}"
    );
    assert!(t.source.starts_with("dockerfile:sha256:"), "{t:?}");
    let d = t.image_defaults.clone().unwrap();
    assert_eq!(d.working_dir, "/home/user/app");
    assert_eq!(d.cmd, ["python3", "app.py"]);
    assert!(
        d.env.contains(&"APP_HOME=/home/user/app".to_string()),
        "{d:?}"
    );

    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            template: "app-built".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let script = "pwd; echo \"$APP_HOME\"; cat built.txt; python3 app.py; \
                  curl -fsS http://127.0.0.1:8000/built.txt";
    let (out, err, ex) = run_as(&mut c, &sb.id, "", &["sh", "-c", script]).await;
    assert_eq!(ex.exit_code, 0, "{out}{err}");
    assert_eq!(
        out,
        "/home/user/app\n/home/user/app\nhello, built\nhello from airlock-demo 1.0\n\
         a note from the context\nhello, built\n"
    );
    s.clean(&[]).await;

    // Only the last line changes: every step before it comes from the cache.
    let changed = DOCKERFILE.replace("built\" > built.txt", "rebuilt\" > built.txt");
    let (events, _) = build_dockerfile(s, "app-rebuilt", &changed, &ctx.0)
        .await
        .unwrap_or_else(|e| panic!("rebuild: {e:?}\n{}", s.log_tail()));
    let steps: Vec<&str> = events
        .iter()
        .filter(|(p, _)| p == "step")
        .map(|(_, m)| m.as_str())
        .collect();
    for cached in ["COPY app.py", "COPY data/", "RUN python3 -m pip"] {
        assert!(
            steps
                .iter()
                .any(|m| m.contains(cached) && m.ends_with("(cached)")),
            "{cached} from the cache: {steps:?}"
        );
    }
    assert!(
        steps
            .iter()
            .any(|m| m.starts_with("step 4/4") && m.contains("rebuilt")),
        "{steps:?}"
    );
    assert!(
        !events
            .iter()
            .any(|(p, m)| p == "output" && m.contains("pip")),
        "pip did not run again"
    );

    // Refused before anything runs, and a failing step.
    let mut c = s.client(None).await;
    let refused = build_dockerfile(s, "bad", "FROM base\nEXPOSE 80\n", &ctx.0)
        .await
        .unwrap_err();
    assert_eq!(harness::reason(&refused).0, "INVALID_ARGUMENT");
    assert!(
        refused.message().contains("line 2: EXPOSE"),
        "{}",
        refused.message()
    );
    let failed = build_dockerfile(s, "bad", "FROM base\nRUN true\nRUN exit 7\n", &ctx.0)
        .await
        .unwrap_err();
    let (reason, meta) = harness::reason(&failed);
    assert_eq!(
        (reason.as_str(), meta["line"].as_str()),
        ("BUILD_STEP_FAILED", "3")
    );
    assert!(
        failed.message().contains("exited with 7"),
        "{}",
        failed.message()
    );
    let live = c
        .list_sandboxes(airlock_api::v1::ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert!(live.is_empty(), "build sandboxes are destroyed: {live:?}");
}
