#![allow(clippy::unwrap_used)]

use super::*;
use airlock_api::v1::InstallOutcome;

fn packages(tenants: &str) -> Packages {
    packages_with(PackagesConfig::default(), tenants)
}

fn packages_with(cfg: PackagesConfig, tenants: &str) -> Packages {
    // A directory (and database) of its own per call: tests run in parallel.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "airlock-pkg-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("db")).unwrap());
    let ceilings: BTreeMap<String, CeilingConfig> = toml::from_str(tenants).unwrap();
    Packages::new(cfg, &dir, &ceilings, store, Arc::new(Metrics::default())).unwrap()
}

#[test]
fn a_request_beyond_the_ceiling_is_packages_not_allowed() {
    let p = packages("[acme]\nregistries = [\"pypi\"]\nmax_download_mib = 10\n");
    let asked = PackagePolicy {
        registries: vec!["npm".into()],
        ..Default::default()
    };
    let e = p.policy_for("acme", &asked).unwrap_err();
    assert_eq!(e.reason(), "PACKAGES_NOT_ALLOWED");
    // Another tenant has the open default ceiling.
    assert!(p.policy_for("other", &asked).is_ok());
    let shown = to_proto(&p.policy_for("acme", &PackagePolicy::default()).unwrap());
    assert_eq!(shown.registries, vec!["pypi".to_owned()]);
    assert_eq!(shown.max_download_bytes, 10 << 20);
    let bad = PackagePolicy {
        allow: vec!["no spaces".into()],
        ..Default::default()
    };
    assert_eq!(
        p.policy_for("acme", &bad).unwrap_err().reason(),
        "INVALID_ARGUMENT"
    );
}

#[test]
fn blobs_are_addressed_by_well_formed_digests_only() {
    let p = packages("");
    let sha = "ab".repeat(32);
    let path = p.blob_path(&format!("sha256-{sha}")).unwrap();
    assert!(path.ends_with(format!("sha256/ab/{sha}")));
    assert!(
        p.blob_path(&format!("sha512-{}", "cd".repeat(64)))
            .is_some()
    );
    for bad in [
        "sha256-../../etc/passwd".to_owned(),
        format!("sha256-{}", "AB".repeat(32)),
        format!("md5-{sha}"),
        "sha256".to_owned(),
        format!("sha512-{sha}"),
    ] {
        assert!(p.blob_path(&bad).is_none(), "{bad}");
    }
}

#[test]
fn the_cap_is_taken_atomically_and_never_crossed() {
    let p = Arc::new(packages(""));
    let policy = p
        .policy_for(
            "t",
            &PackagePolicy {
                max_download_bytes: 100,
                ..Default::default()
            },
        )
        .unwrap();
    let s = p.session("t", "sb-1", policy, false);
    assert!(s.take(60).is_ok());
    assert_eq!(s.left(), 40);
    assert_eq!(s.take(41), Err(40));
    assert!(s.take(40).is_ok());
    assert_eq!(s.take(1), Err(0));
}

#[test]
fn events_are_logged_in_order_and_counted() {
    let p = Arc::new(packages(""));
    let s = p.session(
        "t",
        "sb-2",
        p.policy_for("t", &PackagePolicy::default()).unwrap(),
        false,
    );
    for outcome in [InstallOutcome::Denied, InstallOutcome::Fetched] {
        s.record(InstallEvent {
            registry: "pypi".into(),
            package: "demo".into(),
            outcome: outcome as i32,
            bytes: 5,
            ..Default::default()
        });
    }
    let (events, dropped) = p.log("sb-2", &Query::default()).unwrap();
    assert_eq!(dropped, 0);
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(events[0].tenant, "t");
    assert_eq!(events[1].outcome, InstallOutcome::Fetched as i32);
    // An adopted sandbox's log goes on.
    let again = p.session(
        "t",
        "sb-2",
        p.policy_for("t", &PackagePolicy::default()).unwrap(),
        true,
    );
    again.record(InstallEvent::default());
    assert_eq!(
        p.log(
            "sb-2",
            &Query {
                after_seq: 2,
                ..Default::default()
            }
        )
        .unwrap()
        .0[0]
            .seq,
        3
    );
    let text = p.metrics.render(&Default::default(), &[]);
    assert!(
        text.contains(
            "airlock_package_requests_total{tenant=\"t\",registry=\"pypi\",outcome=\"denied\"} 1"
        ),
        "{text}"
    );
}

#[test]
fn a_debian_registry_needs_a_binary_keyring_and_only_it_takes_one() {
    let dir = std::env::temp_dir().join(format!("airlock-pkg-deb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let new = |registries: &str| {
        let cfg: PackagesConfig = toml::from_str(registries).unwrap();
        Packages::new(
            cfg,
            &dir,
            &BTreeMap::new(),
            Arc::new(Store::open(&dir.join("db")).unwrap()),
            Arc::new(Metrics::default()),
        )
    };
    let e = new("[registries.d]\nkind = \"debian\"\nurl = \"https://deb.example/debian/\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs `keyring`"), "{e}");
    let e = new(
        "[registries.p]\nkind = \"pypi\"\nurl = \"https://pypi.example/simple/\"\n\
         keyring = \"/k.gpg\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`keyring` is for debian registries"), "{e}");
    // A missing keyring does not stop the daemon (pip and npm still work); it is named when
    // apt asks.
    let p = new(
        "[registries.d]\nkind = \"debian\"\nurl = \"https://deb.example/debian\"\n\
         keyring = \"/nonexistent/k.gpg\"\n",
    )
    .unwrap();
    assert_eq!(p.registry("d").unwrap().kind, Kind::Debian);
    assert_eq!(
        p.registry("d").unwrap().url.as_str(),
        "https://deb.example/debian/"
    );
    let armored = dir.join("k.asc");
    std::fs::write(&armored, "-----BEGIN PGP PUBLIC KEY BLOCK-----\n").unwrap();
    let e = debian::check_keyring(&armored).unwrap_err().to_string();
    assert!(
        e.contains("ASCII-armored") && e.contains("gpg --dearmor"),
        "{e}"
    );
    assert!(debian::check_keyring(Path::new("/nonexistent/k.gpg")).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_default_registries_include_debian_with_the_hosts_archive_keyring() {
    let d = PackagesConfig::default();
    let deb = &d.registries["debian"];
    assert_eq!(deb.kind, Kind::Debian);
    assert_eq!(deb.keyring.as_deref(), Some(Path::new(DEBIAN_KEYRING)));
}

// ---- where the proxy connects (real servers on loopback) ----

/// A registry (or any server) on loopback: each path answered as `routes` say (the status
/// line's tail and headers, then the body), every request's path recorded.
struct Upstream {
    port: u16,
    hits: Arc<Mutex<Vec<String>>>,
}

type Route = (String, String, Vec<u8>);

async fn upstream(routes: Vec<Route>) -> Upstream {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let hits = Arc::new(Mutex::new(Vec::new()));
    let (seen, routes) = (hits.clone(), Arc::new(routes));
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let (seen, routes) = (seen.clone(), routes.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 65536 {
                    let mut chunk = [0u8; 4096];
                    match c.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).into_owned();
                let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                seen.lock().unwrap().push(path.clone());
                let (status, body) = routes
                    .iter()
                    .find(|(p, _, _)| *p == path)
                    .map(|(_, h, b)| (h.clone(), b.clone()))
                    .unwrap_or(("404 Not Found".into(), Vec::new()));
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = c.write_all(resp.as_bytes()).await;
                let _ = c.write_all(&body).await;
            });
        }
    });
    Upstream { port, hits }
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// A PEP 691 page listing `files`: (filename, URL, the content whose digest it states).
fn pypi_page(files: &[(&str, String, &[u8])]) -> Route {
    let files: Vec<_> = files
        .iter()
        .map(|(name, url, content)| {
            serde_json::json!({"filename": name, "url": url,
                               "hashes": {"sha256": sha256_hex(content)}})
        })
        .collect();
    let page = serde_json::json!({"meta": {"api-version": "1.0"}, "name": "demo",
                                  "files": files});
    (
        "/simple/demo/".into(),
        format!(
            "200 OK\r\nContent-Type: {}",
            airlock_packages::pypi::JSON_TYPE
        ),
        page.to_string().into_bytes(),
    )
}

/// The proxy with one PyPI registry, `pypi`, configured as `registry` (TOML) says.
fn proxy(registry: &str) -> Arc<Packages> {
    let cfg: PackagesConfig =
        toml::from_str(&format!("[registries.pypi]\nkind = \"pypi\"\n{registry}")).unwrap();
    Arc::new(packages_with(cfg, ""))
}

fn sandbox(p: &Arc<Packages>, id: &str) -> Arc<Session> {
    p.session(
        "t",
        id,
        p.policy_for("t", &PackagePolicy::default()).unwrap(),
        false,
    )
}

/// What a guest gets for `path`: its status and body.
async fn guest_get(s: &Arc<Session>, path: &str) -> (u16, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let s = s.clone();
    tokio::spawn(async move {
        let (c, _) = l.accept().await.unwrap();
        serve(s, c).await;
    });
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn messages(p: &Packages, id: &str) -> Vec<String> {
    let (events, _) = p.log(id, &Query::default()).unwrap();
    events.into_iter().map(|e| e.message).collect()
}

#[tokio::test]
async fn a_file_linked_off_the_registrys_hosts_is_never_fetched() {
    // The "internal service": nothing of the proxy's may reach it.
    let inner = upstream(vec![(
        "/secret".into(),
        "200 OK".into(),
        b"secret".to_vec(),
    )])
    .await;
    let secret = |host: &str| format!("http://{host}:{}/secret", inner.port);
    let files: Vec<(&str, String, &[u8])> = vec![
        // The registry's address, another port.
        ("demo-1.0-py3-none-any.whl", secret("127.0.0.1"), b"one"),
        // Another name for loopback.
        ("demo-2.0-py3-none-any.whl", secret("localhost"), b"two"),
        // On the registry's host, redirected to another.
        ("demo-3.0-py3-none-any.whl", "/moved".into(), b"three"),
    ];
    let reg = upstream(vec![
        pypi_page(&files),
        (
            "/moved".into(),
            format!("302 Found\r\nLocation: {}", secret("localhost")),
            Vec::new(),
        ),
    ])
    .await;
    let p = proxy(&format!(
        "url = \"http://127.0.0.1:{}/simple/\"\nprivate_addresses = [\"127.0.0.1/32\"]\n",
        reg.port
    ));
    let s = sandbox(&p, "sb-ssrf");
    let (status, page) = guest_get(&s, "/r/pypi/simple/demo/").await;
    assert_eq!(status, 200, "{page}");
    for (name, _, stated) in &files {
        let key = format!("sha256-{}", sha256_hex(stated));
        let (status, body) = guest_get(&s, &format!("/f/{key}/{name}")).await;
        assert_eq!(status, 502, "{name}: {body}");
    }
    assert!(inner.hits.lock().unwrap().is_empty(), "{:?}", inner.hits);
    let msgs = messages(&p, "sb-ssrf");
    assert!(
        msgs.iter()
            .any(|m| m.contains("is not on a host of registry pypi")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("to another host")),
        "{msgs:?}"
    );
}

#[tokio::test]
async fn a_registry_at_a_guarded_address_needs_private_addresses() {
    let wheel = b"a wheel".to_vec();
    let files: Vec<(&str, String, &[u8])> = vec![(
        "demo-1.0-py3-none-any.whl",
        "/files/demo.whl".into(),
        &wheel,
    )];
    let reg = upstream(vec![
        pypi_page(&files),
        ("/files/demo.whl".into(), "200 OK".into(), wheel.clone()),
    ])
    .await;
    // A literal address in a guarded range is refused at start without private_addresses.
    let cfg: PackagesConfig = toml::from_str(&format!(
        "[registries.pypi]\nkind = \"pypi\"\nurl = \"http://127.0.0.1:{}/simple/\"\n",
        reg.port
    ))
    .unwrap();
    let dir = std::env::temp_dir().join(format!("airlock-pkg-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("db")).unwrap());
    let e = Packages::new(cfg, &dir, &BTreeMap::new(), store, Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("guarded range 127.0.0.0/8") && e.contains("private_addresses"),
        "{e}"
    );
    // A name that resolves there is refused when it is connected to.
    let p = proxy(&format!(
        "url = \"http://localhost:{}/simple/\"\n",
        reg.port
    ));
    let s = sandbox(&p, "sb-guarded");
    let (status, body) = guest_get(&s, "/r/pypi/simple/demo/").await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("private_addresses"), "{body}");
    assert!(reg.hits.lock().unwrap().is_empty(), "{:?}", reg.hits);
    // Opened by private_addresses, the registry serves.
    let p = proxy(&format!(
        "url = \"http://localhost:{}/simple/\"\nprivate_addresses = [\"127.0.0.0/8\", \"::1\"]\n",
        reg.port
    ));
    let s = sandbox(&p, "sb-opened");
    let (status, body) = guest_get(&s, "/r/pypi/simple/demo/").await;
    assert_eq!(status, 200, "{body}");
    let key = format!("sha256-{}", sha256_hex(&wheel));
    let (status, body) = guest_get(&s, &format!("/f/{key}/demo-1.0-py3-none-any.whl")).await;
    assert_eq!((status, body.as_bytes()), (200, wheel.as_slice()));
}

#[tokio::test]
async fn a_mismatched_file_is_refused_without_its_digest() {
    let files: Vec<(&str, String, &[u8])> = vec![(
        "demo-1.0-py3-none-any.whl",
        "/files/demo.whl".into(),
        b"genuine",
    )];
    let reg = upstream(vec![
        pypi_page(&files),
        (
            "/files/demo.whl".into(),
            "200 OK".into(),
            b"tampered".to_vec(),
        ),
    ])
    .await;
    let p = proxy(&format!(
        "url = \"http://127.0.0.1:{}/simple/\"\nprivate_addresses = [\"127.0.0.1\"]\n",
        reg.port
    ));
    let s = sandbox(&p, "sb-mismatch");
    assert_eq!(guest_get(&s, "/r/pypi/simple/demo/").await.0, 200);
    let key = format!("sha256-{}", sha256_hex(b"genuine"));
    let (status, body) = guest_get(&s, &format!("/f/{key}/demo-1.0-py3-none-any.whl")).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("does not match"), "{body}");
    // What the response was is not told: a digest would let a sandbox test guesses of content.
    let got = sha256_hex(b"tampered");
    assert!(!body.contains(&got), "{body}");
    let msgs = messages(&p, "sb-mismatch");
    assert!(msgs.iter().all(|m| !m.contains(&got)), "{msgs:?}");
    assert!(p.blob_path(&key).is_some_and(|b| !b.exists()), "not cached");
}

#[test]
fn one_sandboxs_index_pages_never_evict_anothers_files() {
    let p = Arc::new(packages(""));
    let (a, b) = (sandbox(&p, "sb-a"), sandbox(&p, "sb-b"));
    let r = |i: usize| FileRef {
        registry: "pypi".into(),
        kind: Kind::Pypi,
        package: "demo".into(),
        version: "1.0".into(),
        filename: format!("demo-{i}.whl"),
        url: Url::parse("https://files.example/demo.whl").unwrap(),
    };
    let key = |i: usize| format!("sha256-{i:064x}");
    a.remember(key(0), r(0));
    // Sandbox b lists more files than are remembered for one sandbox.
    for i in 1..=MAX_REFS + 1 {
        b.remember(key(i), r(i));
    }
    assert!(
        a.file_ref(&key(0)).is_some(),
        "a's file was forgotten for b"
    );
    // b's latest are kept; its oldest went.
    assert!(b.file_ref(&key(MAX_REFS + 1)).is_some());
    assert!(b.file_ref(&key(1)).is_none());
    // What one sandbox listed, another may ask for (a lockfile made there): its policy decides.
    let c = sandbox(&p, "sb-c");
    assert!(c.file_ref(&key(MAX_REFS)).is_some());
}

#[tokio::test]
async fn one_sandboxs_debian_indexes_never_make_anothers_debs_unlisted() {
    let cfg: PackagesConfig = toml::from_str(
        "[registries.debian]\nkind = \"debian\"\nurl = \"https://deb.example/debian/\"\n\
         keyring = \"/nonexistent/k.gpg\"\n",
    )
    .unwrap();
    let p = Arc::new(packages_with(cfg, ""));
    let registry = p.registry("debian").unwrap().clone();
    let (a, b) = (sandbox(&p, "sb-da"), sandbox(&p, "sb-db"));
    let deb = "pool/main/h/hello/hello_1.0_all.deb";
    let index = format!(
        "Package: hello\nVersion: 1.0\nFilename: {deb}\nSize: 5\nSHA256: {}\n\n",
        "ab".repeat(32)
    );
    // The verified index, cached as a's apt-get update leaves it.
    let key = format!("sha256-{}", sha256_hex(index.as_bytes()));
    let blob = p.blob_path(&key).unwrap();
    std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
    std::fs::write(&blob, &index).unwrap();
    let read = debian::IndexRead {
        reg: "debian".into(),
        key: key.clone(),
        path: "main/binary-amd64/Packages".into(),
    };
    debian::note_read(&a, &registry, read).await.unwrap();
    assert!(debian::listed(&a, "debian", &registry, deb).await.is_some());
    // b's indexes list more than the proxy keeps in memory: a's is forgotten there...
    let r = debian::listed(&a, "debian", &registry, deb)
        .await
        .unwrap()
        .1;
    let big: debian::Listing = (0..=MAX_REFS)
        .map(|i| {
            (
                format!("pool/x/{i}.deb"),
                (format!("sha256-{i:064x}"), r.clone()),
            )
        })
        .collect();
    p.debian()
        .keep(("debian".into(), "sha256-big".into()), Arc::new(big));
    assert!(!p.debian().holds("debian", &key));
    // ...and a's .deb is still a's (read again from the cache); b never read that index.
    let (found, _) = debian::listed(&a, "debian", &registry, deb).await.unwrap();
    assert_eq!(found, format!("sha256-{}", "ab".repeat(32)));
    assert!(debian::listed(&b, "debian", &registry, deb).await.is_none());
}
