//! System tests of package installs through airlockd's package proxy, in real VMs: the guest's
//! own pip (configured by the base image to use the proxy at 100.96.0.1:3141) installs from a
//! real `pypiserver` on loopback serving wheels this test builds, and from a static mirror
//! (Python's `http.server` over a PEP 503 directory the test writes, whose index lies about
//! one file's digest). Each scenario checks what pip did in the guest and what the install log
//! says: an allowed install and, from a second sandbox, the same file from the cache with
//! `--require-hashes`; a denied package; offline mode; a file that does not match its index;
//! the byte cap. And npm packages from a real `verdaccio` on loopback, to which the test
//! publishes a package with the host's npm: installed by the guest's own npm (the base image's
//! Node.js and npm, configured by its `/etc/npmrc` to use the proxy), and fetched by a small
//! client that checks what npm relies on (tarball URLs, integrities, refusals).
//!
//! Traffic stays on this machine: the registries listen on 127.0.0.1 in the daemon's
//! namespace; the guests reach only the proxy (their egress policy is deny-all).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::{Path, PathBuf};

use airlock_api::v1::{
    CreateSandboxRequest, FileToPlace, GetInstallLogRequest, InstallEvent, InstallOutcome,
    PackagePolicy, Sandbox,
};
use airlock_system_tests::harness::{Client, run, run_long};
use airlock_system_tests::shared::{Shared, scenario};
use registries::registries;

#[path = "packages/registries.rs"]
mod registries;

async fn start(
    packages: PackagePolicy,
    files: Vec<FileToPlace>,
) -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    Client,
    Sandbox,
) {
    let r = registries();
    let (serial, s) = scenario(&r.config()).await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            packages: Some(packages),
            files,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    (serial, s, c, sb)
}

async fn log_of(c: &mut Client, id: &str) -> Vec<InstallEvent> {
    c.get_install_log(GetInstallLogRequest {
        sandbox_id: id.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .events
}

/// `pip install ARGS` in the sandbox as its user: (exit code, stdout + stderr).
async fn pip(c: &mut Client, id: &str, args: &[&str]) -> (i32, String) {
    let mut argv = vec!["python3", "-m", "pip", "install", "--no-deps"];
    argv.extend_from_slice(args);
    let (out, err, rec) = run(c, id, &argv).await;
    (rec.exit_code, format!("{out}{err}"))
}

fn policy(allow: &[&str], deny: &[&str]) -> PackagePolicy {
    PackagePolicy {
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

async fn destroy(c: &mut Client, id: &str) {
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn pip_install_of_an_allowed_package_then_from_the_cache_with_require_hashes() {
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &["airlock-evil"]), vec![]).await;
    assert_eq!(
        sb.packages.as_ref().unwrap().allow,
        vec!["airlock-*".to_owned()],
        "the record shows the policy in force"
    );
    let (code, out) = pip(&mut c, &sb.id, &["airlock-demo==1.0"]).await;
    assert_eq!(code, 0, "pip: {out}\n{}", s.log_tail());
    let (value, err, rec) = run(
        &mut c,
        &sb.id,
        &[
            "python3",
            "-c",
            "import airlock_demo; print(airlock_demo.VALUE)",
        ],
    )
    .await;
    assert_eq!(rec.exit_code, 0, "{err}");
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

    // A second sandbox pins the file by its hash; it comes from the cache.
    let req = format!("airlock-demo==1.0 --hash=sha256:{sha}\n");
    let mut c2 = s.client(None).await;
    let sb2 = c2
        .create_sandbox(CreateSandboxRequest {
            packages: Some(PackagePolicy::default()),
            files: vec![FileToPlace {
                path: "/tmp/requirements.txt".into(),
                content: req.into_bytes(),
                mode: 0o644,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (code, out) = pip(
        &mut c2,
        &sb2.id,
        &["--require-hashes", "-r", "/tmp/requirements.txt"],
    )
    .await;
    assert_eq!(code, 0, "pip --require-hashes: {out}");
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

/// Guest helper: `get(url)` prints `STATUS REASON` of a GET through the proxy (200 and the
/// body's size, or the refusal's code and reason) — what any HTTP client sees.
const GET: &str = r#"
import urllib.request, urllib.error
def get(url, ua='Python-urllib'):
    req = urllib.request.Request(url, headers={'User-Agent': ua})
    try:
        with urllib.request.urlopen(req) as r:
            print(r.status, len(r.read()), r.headers.get('Content-Type'))
    except urllib.error.HTTPError as e:
        print(e.code, e.reason)
"#;

/// Runs `GET` + `code` in the sandbox: its stdout lines.
async fn get(c: &mut Client, id: &str, code: &str) -> Vec<String> {
    let script = format!("{GET}\n{code}");
    let (out, err, rec) = run(c, id, &["python3", "-c", &script]).await;
    assert_eq!(rec.exit_code, 0, "{err}");
    out.lines().map(str::to_owned).collect()
}

const PROXY: &str = "http://100.96.0.1:3141";

#[tokio::test(flavor = "multi_thread")]
async fn a_denied_package_fails_at_once_naming_the_rule() {
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &["airlock-evil"]), vec![]).await;
    let (code, out) = pip(&mut c, &sb.id, &["airlock-evil"]).await;
    assert_ne!(code, 0, "pip installed a denied package: {out}");
    assert!(
        out.contains("package airlock-evil is denied by 'airlock-evil' in the sandbox's policy"),
        "pip's output names the rule: {out}\n{}",
        s.log_tail()
    );
    // Any other client gets a 403 naming the rule; a package on no allowlist likewise.
    let lines = get(
        &mut c,
        &sb.id,
        &format!(
            "get('{PROXY}/r/pypi/simple/airlock-evil/')\nget('{PROXY}/r/pypi/simple/requests/')\n\
             get('{PROXY}/r/pypi/simple/airlock-demo/')"
        ),
    )
    .await;
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
    assert!(
        log.iter().any(|e| e.package == "airlock-evil"
            && e.outcome == InstallOutcome::Denied as i32
            && e.message.contains("denied by")),
        "{log:?}"
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
    let lines = get(
        &mut c,
        &sb.id,
        &format!(
            "get('{PROXY}/r/pypi/simple/airlock-demo/', ua='pip/23.0.1')\n\
             get('{PROXY}/r/pypi/simple/airlock-demo/')\nget('{PROXY}/r/mirror/simple/x/')"
        ),
    )
    .await;
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
        log.len() == 3
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
        registries: vec!["mirror".into()],
        ..Default::default()
    };
    let (_serial, s, mut c, sb) = start(only_mirror, vec![]).await;
    let (code, out) = pip(
        &mut c,
        &sb.id,
        &[
            "--index-url",
            "http://100.96.0.1:3141/r/mirror/simple/",
            "airlock-tampered",
        ],
    )
    .await;
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("does not match its index"),
        "{out}\n{}",
        s.log_tail()
    );
    let log = log_of(&mut c, &sb.id).await;
    let e = log
        .iter()
        .find(|e| e.package == "airlock-tampered" && !e.file.is_empty())
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(e.outcome, InstallOutcome::HashMismatch as i32, "{log:?}");
    assert!(
        e.message.contains(&r.sha["airlock-tampered"]),
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
        &mut c,
        &sb.id,
        &format!(
            "get('{PROXY}/r/pypi/simple/airlock-demo/')
get('{PROXY}/r/mirror/simple/airlock-huge/')"
        ),
    )
    .await;
    assert_eq!(
        lines[0],
        "403 airlock: registry pypi is not allowed by the sandbox's package policy"
    );
    assert_eq!(
        lines[1],
        "502 airlock: the registry's answer is larger than the proxy's limit of 2097152 bytes"
    );
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
        ..Default::default()
    };
    let (_serial, _s, mut c, sb) = start(capped, vec![]).await;
    let (code, out) = pip(&mut c, &sb.id, &["airlock-big"]).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("download cap of 1048576 bytes"), "{out}");
    let log = log_of(&mut c, &sb.id).await;
    assert!(
        log.iter()
            .any(|e| e.package == "airlock-big" && e.outcome == InstallOutcome::OverCap as i32),
        "{log:?}"
    );
    // A small file still fits: the index lists it, the proxy serves it.
    let lines = get(
        &mut c,
        &sb.id,
        &format!(
            "import json, re\n\
             page = urllib.request.urlopen('{PROXY}/r/pypi/simple/airlock-demo/').read().decode()\n\
             get('{PROXY}' + re.search(r'href=\"([^\"#]+)', page).group(1))"
        ),
    )
    .await;
    assert!(lines[0].starts_with("200 "), "{lines:?}");
    destroy(&mut c, &sb.id).await;
}

/// The npm registry protocol through the proxy, spoken by the guest as npm speaks it: the
/// packument, the tarball from the URL the proxy wrote into it, the tarball checked against the
/// packument's SHA-512 integrity (Python, which starts in a fraction of npm's time here).
const NPM_CLIENT: &str = r#"
import base64, hashlib, json, urllib.request
doc = json.load(urllib.request.urlopen(PROXY + '/r/npm/airlock-left-pad'))
dist = doc['versions']['1.0.0']['dist']
data = urllib.request.urlopen(dist['tarball']).read()
sri = 'sha512-' + base64.b64encode(hashlib.sha512(data).digest()).decode()
print(dist['tarball'].startswith(PROXY + '/f/sha512-'), sri == dist['integrity'])
print(hashlib.sha256(data).hexdigest())
"#;

#[tokio::test(flavor = "multi_thread")]
async fn npm_packages_through_the_proxy_from_verdaccio() {
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &[]), vec![]).await;
    let lines = get(
        &mut c,
        &sb.id,
        &format!(
            "PROXY = '{PROXY}'\n{NPM_CLIENT}\nget(PROXY + '/r/npm/left-pad')\n\
             get(PROXY + '/r/npm/@acme%2ftool')"
        ),
    )
    .await;
    assert_eq!(lines.len(), 4, "{lines:?}\n{}", s.log_tail());
    assert_eq!(
        lines[0], "True True",
        "the tarball URL is the proxy's, the integrity holds"
    );
    assert_eq!(lines[1], r.sha["airlock-left-pad"]);
    // Packages the policy does not allow: npm's registry API answers 403 with the reason.
    assert_eq!(
        lines[2],
        "403 airlock: package left-pad is not on the allowlist of the sandbox's policy"
    );
    assert_eq!(
        lines[3],
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

/// The guest's own `npm install` (the base image's npm, whose `/etc/npmrc` names the proxy):
/// an allowed package from verdaccio installs and loads; one the policy does not allow fails
/// with the policy's words, asked for once (npm does not retry a refusal); the install log has
/// both. (npm's start reads ~2,400 files: 1.5 min on the build machines when they are cached
/// in the guest, 4–5 min for a sandbox's first npm; hence the 15-minute timeouts.)
#[tokio::test(flavor = "multi_thread")]
async fn npm_install_in_the_sandbox_through_the_proxy() {
    let r = registries();
    let (_serial, s, mut c, sb) = start(policy(&["airlock-*"], &[]), vec![]).await;
    let (out, err, rec) = run_long(
        &mut c,
        &sb.id,
        "",
        &[
            "sh",
            "-c",
            "mkdir -p ~/app && cd ~/app && npm install --no-package-lock airlock-right-pad && \
             node -e 'console.log(require(\"airlock-right-pad\")(\"x\", 3))'",
        ],
        900_000,
    )
    .await;
    assert_eq!(
        rec.exit_code,
        0,
        "npm install: {out}{err}\n{}",
        s.log_tail()
    );
    assert_eq!(out.lines().last(), Some("x.."), "{out}{err}");
    let (out, err, rec) = run_long(
        &mut c,
        &sb.id,
        "",
        &[
            "sh",
            "-c",
            "cd ~/app && npm install --no-package-lock left-pad",
        ],
        900_000,
    )
    .await;
    assert_ne!(
        rec.exit_code, 0,
        "npm installed a package off the allowlist: {out}{err}"
    );
    assert!(
        format!("{out}{err}")
            .contains("package left-pad is not on the allowlist of the sandbox's policy"),
        "npm's error names the policy: {out}{err}"
    );
    let log = log_of(&mut c, &sb.id).await;
    let e = log
        .iter()
        .find(|e| e.file == "airlock-right-pad-1.0.0.tgz")
        .unwrap_or_else(|| panic!("{log:?}"));
    assert_eq!(e.sha256, r.sha["airlock-right-pad"]);
    assert!(
        [
            InstallOutcome::Fetched as i32,
            InstallOutcome::Cached as i32
        ]
        .contains(&e.outcome),
        "{log:?}"
    );
    let denied: Vec<_> = log
        .iter()
        .filter(|e| e.package == "left-pad" && e.outcome == InstallOutcome::Denied as i32)
        .collect();
    assert_eq!(denied.len(), 1, "one refusal, no retries: {log:?}");
    destroy(&mut c, &sb.id).await;
}
