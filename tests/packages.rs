//! System tests of package installs through airlockd's package proxy, in real VMs. The guest's
//! own pip (configured by the base image to use the proxy at 100.96.0.1:3141) installs from a
//! real `pypiserver` on loopback serving wheels this test builds, once (`npm.rs` proves the
//! guest's own npm against a real `verdaccio` the same way). The policy matrix (allowlists and
//! denials, hashes and the shared cache, the byte cap, offline mode, a mirror whose index lies
//! about one file's digest, npm's packuments, tarballs, integrities and scoped names) is decided
//! on the host, so it is driven by a host-side HTTP client through the same path the guest's
//! clients take: from inside the sandbox's own network namespace to the proxy's address there
//! (`harness::GuestNet`), as each client presents itself (pip's User-Agent where it changes the
//! answer), with the install log checked after each.
//!
//! Traffic stays on this machine: the registries listen on 127.0.0.1 in the daemon's
//! namespace; the sandboxes reach only the proxy (their egress policy is deny-all).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::{Path, PathBuf};

use sha2::Digest as _;
use sha2::Sha256;

use airlock_api::v1::{CreateSandboxRequest, InstallOutcome, PackagePolicy, Sandbox};
use airlock_system_tests::harness::{GuestNet, HttpReply, run, run_long};
use registries::registries;

#[path = "packages/common.rs"]
mod common;
#[path = "packages/debrepo.rs"]
mod debrepo;
#[path = "packages/offregistry.rs"]
mod offregistry;
#[path = "packages/registries.rs"]
mod registries;
use common::*;

/// What a client sees of a GET through the proxy: `200 SIZE CONTENT-TYPE`, or a refusal's
/// `STATUS REASON` (the reason phrase, which pip and npm show).
fn seen(r: &HttpReply) -> String {
    if r.status == 200 {
        format!(
            "200 {} {}",
            r.body.len(),
            r.header("content-type").unwrap_or("")
        )
    } else {
        format!("{} {}", r.status, r.reason)
    }
}

/// GETs `paths` of the proxy from inside `sb`'s network (as a client with `user_agent`):
/// what each answer looks like ([`seen`]).
fn get(sb: &Sandbox, user_agent: &str, paths: &[&str]) -> Vec<String> {
    let net = GuestNet::of(sb.vmm_pid);
    paths
        .iter()
        .map(|p| seen(&net.get(&format!("{PROXY}{p}"), &[("User-Agent", user_agent)])))
        .collect()
}

/// The proxy's link (`/f/...`) to `file` on its index page of `project` in registry `reg`, as
/// pip reads it, with the digest the page states (`#sha256=`).
fn file_link(net: &GuestNet, reg: &str, project: &str, file: &str) -> (String, String) {
    let page = net.get(
        &format!("{PROXY}/r/{reg}/simple/{project}/"),
        &[("User-Agent", PIP_UA)],
    );
    assert_eq!(page.status, 200, "{page:?}");
    let html = page.text();
    let href = html
        .split("href=\"")
        .skip(1)
        .filter_map(|h| h.split('"').next())
        .find(|h| h.contains(file))
        .unwrap_or_else(|| panic!("no link to {file} on {html}"));
    let (url, digest) = href.split_once("#sha256=").unwrap_or((href, ""));
    (url.to_owned(), digest.to_owned())
}

/// How pip introduces itself (the proxy answers a refused index page in the form pip shows).
const PIP_UA: &str = "pip/23.0.1 {\"installer\":{\"name\":\"pip\"}}";
/// Any other HTTP client.
const PLAIN_UA: &str = "Python-urllib/3.11";

/// The guest's own pip: an allowed package installs from pypiserver and imports; then a second
/// sandbox gets the same file from the shared cache, pinned by its hash (as `pip install
/// --require-hashes` asks for it), and the registry is not asked again. (One pip start: each
/// costs minutes in the emulated guest kernels of the build machines.)
#[tokio::test(flavor = "multi_thread")]
async fn pip_installs_an_allowed_package_then_a_second_sandbox_gets_it_from_the_cache_by_hash() {
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &["airlock-evil"]), vec![]).await;
    assert_eq!(
        sb.packages.as_ref().unwrap().allow,
        vec!["airlock-*".to_owned()],
        "the record shows the policy in force"
    );
    let (value, err, rec) = run(
        &mut c,
        &sb.id,
        &[
            "sh",
            "-c",
            "python3 -m pip install --no-deps airlock-demo==1.0 >&2 && \
             python3 -c 'import airlock_demo; print(airlock_demo.VALUE)'",
        ],
    )
    .await;
    assert_eq!(rec.exit_code, 0, "pip: {err}\n{}", s.log_tail());
    assert_eq!(value.trim(), "hello from airlock-demo 1.0");
    let sha = &r.sha["airlock-demo"];
    let log = log_of(&mut c, &sb.id).await;
    let fetched: Vec<_> = log
        .iter()
        .filter(|e| e.file == "airlock_demo-1.0-py3-none-any.whl")
        .collect();
    assert_eq!(fetched.len(), 1, "{log:?}");
    assert_eq!(
        fetched[0].outcome,
        InstallOutcome::Fetched as i32,
        "{log:?}"
    );
    assert_eq!(&fetched[0].sha256, sha);
    assert_eq!(
        (fetched[0].package.as_str(), fetched[0].version.as_str()),
        ("airlock-demo", "1.0")
    );
    assert_eq!(fetched[0].registry, "pypi");
    assert!(fetched[0].bytes > 0);
    destroy(&mut c, &sb.id).await;
    assert_eq!(
        r.served("airlock_demo-1.0"),
        1,
        "pypiserver served the file once"
    );

    // A second sandbox asks for the file pinned by its hash; it comes from the cache.
    let mut c2 = s.client(None).await;
    let sb2 = c2
        .create_sandbox(CreateSandboxRequest {
            packages: Some(PackagePolicy::default()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let net = GuestNet::of(sb2.vmm_pid);
    let (link, digest) = file_link(&net, "pypi", "airlock-demo", "airlock_demo-1.0");
    assert_eq!(&digest, sha, "the index states the file's hash");
    let file = net.get(&format!("{PROXY}{link}"), &[("User-Agent", PIP_UA)]);
    assert_eq!(file.status, 200, "{file:?}");
    assert_eq!(
        &hex(&Sha256::digest(&file.body)),
        sha,
        "the file has that hash"
    );
    let log = log_of(&mut c2, &sb2.id).await;
    let served: Vec<_> = log.iter().filter(|e| !e.file.is_empty()).collect();
    assert_eq!(served.len(), 1, "{log:?}");
    assert_eq!(served[0].outcome, InstallOutcome::Cached as i32, "{log:?}");
    assert_eq!(&served[0].sha256, sha);
    assert_eq!(
        r.served("airlock_demo-1.0"),
        1,
        "the registry was not asked again"
    );
    destroy(&mut c2, &sb2.id).await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_denied_package_fails_at_once_naming_the_rule() {
    let (_serial, _s, mut c, sb) = start(policy(&["airlock-*"], &["airlock-evil"]), vec![]).await;
    // pip's view of the refused index page (the form pip shows: a warning quoting the reason),
    // and any other client's: a 403 naming the rule; a package on no allowlist likewise.
    let lines = get(&sb, PIP_UA, &["/r/pypi/simple/airlock-evil/"]);
    assert_eq!(
        lines[0],
        "200 82 application/x-airlock-refusal; reason=\"package airlock-evil is denied by \
         'airlock-evil' in the sandbox's policy\""
    );
    let lines = get(
        &sb,
        PLAIN_UA,
        &[
            "/r/pypi/simple/airlock-evil/",
            "/r/pypi/simple/requests/",
            "/r/pypi/simple/airlock-demo/",
        ],
    );
    assert_eq!(
        lines[0],
        "403 airlock: package airlock-evil is denied by 'airlock-evil' in the sandbox's policy"
    );
    assert_eq!(
        lines[1],
        "403 airlock: package requests is not on the allowlist of the sandbox's policy"
    );
    assert!(lines[2].starts_with("200 "), "{lines:?}");
    let log = log_of(&mut c, &sb.id).await;
    assert_eq!(
        log.iter()
            .filter(|e| e.package == "airlock-evil"
                && e.outcome == InstallOutcome::Denied as i32
                && e.message.contains("denied by"))
            .count(),
        2,
        "each refusal logged: {log:?}"
    );
    assert!(
        log.iter()
            .any(|e| e.package == "requests" && e.outcome == InstallOutcome::Denied as i32)
    );
    assert_eq!(
        registries().served("airlock_evil"),
        0,
        "nothing of it was fetched"
    );
    destroy(&mut c, &sb.id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn offline_mode_refuses_every_install() {
    let offline = PackagePolicy {
        offline: true,
        ..Default::default()
    };
    let (_serial, _s, mut c, sb) = start(offline, vec![]).await;
    assert!(sb.packages.as_ref().unwrap().offline);
    // pip's view of a refused index page (the form pip shows: a warning quoting the reason)
    // and any other client's.
    let mut lines = get(&sb, PIP_UA, &["/r/pypi/simple/airlock-demo/"]);
    lines.extend(get(
        &sb,
        PLAIN_UA,
        &[
            "/r/pypi/simple/airlock-demo/",
            "/r/mirror/simple/x/",
            "/r/debian/dists/bookworm/Release",
        ],
    ));
    assert_eq!(
        lines[0],
        "200 66 application/x-airlock-refusal; reason=\"offline mode (the sandbox's policy): \
         no package installs\"",
    );
    for l in &lines[1..] {
        assert_eq!(
            l,
            "403 airlock: offline mode (the sandbox's policy): no package installs"
        );
    }
    let log = log_of(&mut c, &sb.id).await;
    assert!(
        log.len() == 4
            && log.iter().all(
                |e| e.outcome == InstallOutcome::Denied as i32 && e.message.contains("offline")
            ),
        "{log:?}"
    );
    destroy(&mut c, &sb.id).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_file_that_does_not_match_its_index_is_refused_and_not_cached() {
    let r = registries();
    let only_mirror = PackagePolicy {
        registries: vec!["mirror".into(), offregistry::NAME.into()],
        ..Default::default()
    };
    let (_serial, s, mut c, sb) = start(only_mirror, vec![]).await;
    // As pip fetches it: the index page, then the file its link names.
    let net = GuestNet::of(sb.vmm_pid);
    let (link, digest) = file_link(&net, "mirror", "airlock-tampered", "airlock_tampered-1.0");
    assert_ne!(digest, r.sha["airlock-tampered"], "the mirror's index lies");
    let file = net.get(&format!("{PROXY}{link}"), &[("User-Agent", PIP_UA)]);
    assert_eq!(file.status, 502, "{file:?}\n{}", s.log_tail());
    assert!(file.reason.contains("does not match its index"), "{file:?}");
    let log = log_of(&mut c, &sb.id).await;
    let e = log
        .iter()
        .find(|e| e.package == "airlock-tampered" && !e.file.is_empty())
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(e.outcome, InstallOutcome::HashMismatch as i32, "{log:?}");
    // The digest the index stated, never the one of what came back (an oracle for guessing
    // what a URL serves).
    let real = &r.sha["airlock-tampered"];
    assert!(e.message.contains(&digest), "{}", e.message);
    assert!(
        !e.message.contains(real) && !file.reason.contains(real),
        "{}",
        e.message
    );
    let blob = s.data_dir.join("packages/sha256");
    let cached: Vec<_> = walk(&blob);
    assert!(
        !cached
            .iter()
            .any(|p| p.ends_with(&r.sha["airlock-tampered"])),
        "a mismatching file was cached: {cached:?}"
    );
    // The default registry is not this sandbox's; an index page over the proxy's limit is an
    // upstream error, not a crash.
    let lines = get(
        &sb,
        PLAIN_UA,
        &[
            "/r/pypi/simple/airlock-demo/",
            "/r/mirror/simple/airlock-huge/",
        ],
    );
    assert_eq!(
        lines[0],
        "403 airlock: registry pypi is not allowed by the sandbox's package policy"
    );
    assert_eq!(
        lines[1],
        "502 airlock: the registry's answer is larger than the proxy's limit of 2097152 bytes"
    );
    // A registry whose links lead off its host (another port, another name, a redirect): the
    // proxy connects to none of them.
    offregistry::off_registry().assert_refused(&sb);
    destroy(&mut c, &sb.id).await;
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_byte_cap_stops_the_download_that_crosses_it() {
    let capped = PackagePolicy {
        max_download_bytes: 1 << 20,
        ..policy(&[], &["airlock-denied"])
    };
    let (_serial, _s, mut c, sb) = start(capped, vec![]).await;
    let net = GuestNet::of(sb.vmm_pid);
    let (link, _) = file_link(&net, "pypi", "airlock-big", "airlock_big-1.0");
    let big = net.get(&format!("{PROXY}{link}"), &[("User-Agent", PIP_UA)]);
    assert_eq!(big.status, 403, "{big:?}");
    assert!(
        big.reason.contains("download cap of 1048576 bytes"),
        "{big:?}"
    );
    let log = log_of(&mut c, &sb.id).await;
    assert!(
        log.iter()
            .any(|e| e.package == "airlock-big" && e.outcome == InstallOutcome::OverCap as i32),
        "{log:?}"
    );
    // A small file still fits: the index lists it, the proxy serves it.
    let (link, _) = file_link(&net, "pypi", "airlock-demo", "airlock_demo-1.0");
    let small = net.get(&format!("{PROXY}{link}"), &[("User-Agent", PIP_UA)]);
    assert_eq!(small.status, 200, "{small:?}");
    destroy(&mut c, &sb.id).await;
}

/// The npm registry protocol through the proxy, as npm speaks it: the packument, the tarball
/// from the URL the proxy wrote into it, checked against the packument's SHA-512 integrity;
/// packages the policy does not allow, scoped ones too, refused with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn npm_packages_through_the_proxy_from_verdaccio() {
    use base64::Engine as _;
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &[]), vec![]).await;
    let net = GuestNet::of(sb.vmm_pid);
    let npm = [("User-Agent", NPM_UA), ("Accept", NPM_ACCEPT)];
    let doc = net.get(&format!("{PROXY}/r/npm/airlock-left-pad"), &npm);
    assert_eq!(doc.status, 200, "{doc:?}\n{}", s.log_tail());
    let doc: serde_json::Value = serde_json::from_slice(&doc.body).unwrap();
    let dist = &doc["versions"]["1.0.0"]["dist"];
    let tarball = dist["tarball"].as_str().unwrap();
    assert!(
        tarball.starts_with(&format!("{PROXY}/f/sha512-")),
        "the tarball URL is the proxy's: {tarball}"
    );
    let data = net.get(tarball, &npm);
    assert_eq!(data.status, 200, "{data:?}");
    let sri = format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(sha2::Sha512::digest(&data.body))
    );
    assert_eq!(
        Some(sri.as_str()),
        dist["integrity"].as_str(),
        "the integrity holds"
    );
    assert_eq!(hex(&Sha256::digest(&data.body)), r.sha["airlock-left-pad"]);
    // Packages the policy does not allow: npm's registry API answers 403 with the reason.
    let lines = get(&sb, NPM_UA, &["/r/npm/left-pad", "/r/npm/@acme%2ftool"]);
    assert_eq!(
        lines[0],
        "403 airlock: package left-pad is not on the allowlist of the sandbox's policy"
    );
    assert_eq!(
        lines[1],
        "403 airlock: package @acme/tool is not on the allowlist of the sandbox's policy"
    );
    let log = log_of(&mut c, &sb.id).await;
    let e = log
        .iter()
        .find(|e| e.file == "airlock-left-pad-1.0.0.tgz")
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(e.outcome, InstallOutcome::Fetched as i32, "{log:?}");
    assert_eq!((e.registry.as_str(), e.kind.as_str()), ("npm", "npm"));
    assert_eq!(e.version, "1.0.0");
    assert_eq!(e.sha256, r.sha["airlock-left-pad"]);
    destroy(&mut c, &sb.id).await;
}

/// How the base image's apt introduces itself.
const APT_UA: &str = "Debian APT-HTTP/1.3 (2.6.1)";

/// The guest's own apt, with sudo, as a sandbox's user runs it: `apt-get update` reads the
/// test's signed repository through the proxy (its InRelease verified on the host against the
/// registry's keyring and served as the suite's Release, the xz index fetched by hash), and an
/// allowed package installs and runs; it is in the install log. (One apt run: each apt-get
/// start costs a minute in the emulated guest kernel of the build machines; the refusals, in
/// the form apt shows them, are tried from the host below.)
#[tokio::test(flavor = "multi_thread")]
async fn apt_with_sudo_installs_a_package_from_a_signed_repository_through_the_proxy() {
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &[]), vec![]).await;
    // One sudo for both apt commands (each sudo start is seconds of emulated guest kernel).
    let script = "sudo -n sh -c 'apt-get update && apt-get install -y airlock-hello' >&2 && \
                  airlock-hello";
    let (out, err, rec) = run_long(&mut c, &sb.id, "", &["sh", "-c", script], 900_000).await;
    assert_eq!(rec.exit_code, 0, "{out}\n{err}\n{}", s.log_tail());
    assert_eq!(out, "hello from airlock-hello 1.0\n", "{err}");
    // The sandbox's own host name resolves (its DNS answers it), so sudo does not complain.
    assert!(!err.contains("unable to resolve host"), "{err}");
    let log = log_of(&mut c, &sb.id).await;
    let hello = log
        .iter()
        .find(|e| e.package == "airlock-hello")
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(
        (
            hello.kind.as_str(),
            hello.version.as_str(),
            hello.file.as_str(),
            hello.outcome,
            hello.sha256.as_str()
        ),
        (
            "debian",
            "1.0",
            "airlock-hello_1.0_all.deb",
            InstallOutcome::Fetched as i32,
            r.deb.sha["airlock-hello"].as_str()
        ),
        "{log:?}"
    );
    destroy(&mut c, &sb.id).await;
}

/// What the proxy serves of a Debian repository goes only as far as the registry's keyring and
/// the digests signed with it vouch for, decided on the host (so driven from the sandbox's
/// network as apt would ask): the good suite's Release as its InRelease signed it (not the
/// InRelease itself: the guest has no key to check it with) and its index by hash, but nothing
/// unlisted; an InRelease signed by a key outside the keyring,
/// altered after signing, or signed for another suite is refused (BAD_SIGNATURE) and nothing it
/// lists is served; an index or a `.deb` that differs from the digest vouching for it is refused
/// (HASH_MISMATCH), a `.deb` past the download cap and a denied one too, each with the reason
/// apt shows after the status (`403  airlock: ...`).
#[tokio::test(flavor = "multi_thread")]
async fn a_debian_repository_is_served_only_as_far_as_its_keyring_and_digests_vouch_for_it() {
    let r = registries();
    let capped = PackagePolicy {
        max_download_bytes: 1 << 20,
        ..policy(&[], &["airlock-denied"])
    };
    let (_serial, _s, mut c, sb) = start(capped, vec![]).await;
    let net = GuestNet::of(sb.vmm_pid);
    let apt = |path: &str| {
        net.get(
            &format!("{PROXY}/r/debian/{path}"),
            &[("User-Agent", APT_UA)],
        )
    };
    let repo = r.dir.join("mirror/debian");
    assert!(repo.join("dists/bookworm/InRelease").is_file());

    let signed = apt("dists/bookworm/Release");
    assert_eq!(signed.status, 200, "{}", signed.reason);
    assert_eq!(signed.text().trim_end(), r.deb.release.trim_end());
    assert_eq!(apt("dists/bookworm/InRelease").status, 404);
    assert_eq!(apt("dists/bookworm/Release.gpg").status, 404);
    let xz = std::fs::read(repo.join("dists/bookworm/main/binary-amd64/Packages.xz")).unwrap();
    let by_hash = apt(&format!(
        "dists/bookworm/main/binary-amd64/by-hash/SHA256/{}",
        hex(&Sha256::digest(&xz))
    ));
    assert_eq!(
        (by_hash.status, by_hash.body == xz),
        (200, true),
        "{}",
        by_hash.reason
    );
    assert_eq!(
        apt("dists/bookworm/main/binary-amd64/Packages.bz2").status,
        404,
        "not listed"
    );

    let seen_of = |path: &str| seen(&apt(path));
    let tampered = seen_of("pool/main/a/airlock-tampered/airlock-tampered_1.0_all.deb");
    assert!(
        tampered.starts_with("502 airlock: airlock-tampered_1.0_all.deb from registry debian does not match its index"),
        "{tampered}"
    );
    let big = seen_of("pool/main/a/airlock-big/airlock-big_1.0_all.deb");
    assert!(
        big.starts_with("403 airlock: airlock-big_1.0_all.deb") && big.contains("download cap"),
        "{big}"
    );
    assert_eq!(
        seen_of("pool/main/a/airlock-denied/airlock-denied_1.0_all.deb"),
        "403 airlock: package airlock-denied is denied by 'airlock-denied' in the sandbox's policy"
    );
    assert_eq!(
        apt("pool/main/a/airlock-nope/airlock-nope_1.0_all.deb").status,
        404
    );

    for (suite, why) in [
        (
            "forged",
            "signed only by keys outside the registry's keyring",
        ),
        ("altered", "a BAD signature"),
        ("other", "it is signed for suite 'bookworm'"),
    ] {
        let refused = seen_of(&format!("dists/{suite}/Release"));
        assert!(
            refused.starts_with(&format!(
                "502 airlock: the InRelease of debian/{suite} is refused: "
            )) && refused.contains(why),
            "{suite}: {refused}"
        );
        assert_eq!(
            apt(&format!("dists/{suite}/main/binary-amd64/Packages")).status,
            404,
            "{suite}: nothing it lists"
        );
    }
    assert_eq!(apt("dists/lying/Release").status, 200);
    let lying = seen_of("dists/lying/main/binary-amd64/Packages");
    assert!(
        lying.starts_with("502 airlock: dists/lying/main/binary-amd64/Packages of registry debian does not match the signed InRelease"),
        "{lying}"
    );

    let log = log_of(&mut c, &sb.id).await;
    let outcomes = |o: InstallOutcome| {
        let mut v: Vec<&str> = log
            .iter()
            .filter(|e| e.outcome == o as i32)
            .map(|e| e.file.as_str())
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(
        outcomes(InstallOutcome::BadSignature),
        [
            "dists/altered/InRelease",
            "dists/forged/InRelease",
            "dists/other/InRelease"
        ],
        "{log:?}"
    );
    assert_eq!(
        outcomes(InstallOutcome::HashMismatch),
        [
            "airlock-tampered_1.0_all.deb",
            "dists/lying/main/binary-amd64/Packages"
        ],
        "{log:?}"
    );
    assert_eq!(
        outcomes(InstallOutcome::OverCap),
        ["airlock-big_1.0_all.deb"],
        "{log:?}"
    );
    assert!(
        log.iter().any(|e| e.package == "airlock-denied"
            && e.kind == "debian"
            && e.outcome == InstallOutcome::Denied as i32),
        "{log:?}"
    );
    destroy(&mut c, &sb.id).await;
}
