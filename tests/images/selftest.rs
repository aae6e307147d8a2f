//! Host-side tests of the OCI image harness (`layout.rs`, `registry.rs`), with no VM and no
//! daemon: images built here are pushed with skopeo to a real local registry (docker-registry)
//! and read back over HTTP as a pulling client would: anonymously, with basic credentials and
//! through the bearer-token flow; an image index of two platforms; a blob corrupted in the
//! registry's storage; and layers whose tar names are hostile.

use super::layout::*;
use super::registry::{Auth, Registry, TOKEN_SERVICE};
use airlock_system_tests::TempDir;
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
