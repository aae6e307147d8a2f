//! System test of the guest's own npm through airlockd's package proxy, in a real VM: the base
//! image's Node.js and npm (configured by its `/etc/npmrc` to use the proxy at
//! 100.96.0.1:3141) install a package from a real `verdaccio` on loopback, to which the test
//! publishes with the host's npm (`packages/registries.rs`). npm's start is the most expensive
//! guest work of the suite (minutes on the nested build machines), so it is a file of its own
//! and runs beside `packages.rs`; the npm protocol's policy matrix is there, driven from the
//! host.
//!
//! Traffic stays on this machine: the registries listen on 127.0.0.1 in the daemon's
//! namespace; the sandbox reaches only the proxy (its egress policy is deny-all).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use airlock_api::v1::InstallOutcome;
use airlock_system_tests::harness::{GuestNet, read_all, run_long};
use registries::registries;

#[path = "packages/common.rs"]
mod common;
#[path = "packages/debrepo.rs"]
mod debrepo;
#[path = "packages/offregistry.rs"]
mod offregistry;
#[path = "packages/registries.rs"]
#[allow(dead_code)] // the pip side is packages.rs's
mod registries;
use common::*;

/// The guest's own `npm install` (the base image's npm, whose `/etc/npmrc` names the proxy):
/// an allowed package from verdaccio installs, as published. A package the policy does not allow
/// gets the answer npm shows (`npm error 403 403 airlock: ...`), asked from the host as npm
/// asks for it, logged once. (npm's start reads ~2,400 files: 1.5 min on the build machines when
/// they are cached in the guest, 4–5 min for a sandbox's first npm; hence the 15-minute timeout
/// and one npm start.)
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
            "mkdir -p /tmp/app && cd /tmp/app && npm install --no-package-lock airlock-right-pad",
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
    // What npm unpacked is the package as published (read from the host: a second Node.js
    // start would cost minutes more here and prove nothing of Airlock's).
    let module = read_all(
        &mut c,
        &sb.id,
        "/tmp/app/node_modules/airlock-right-pad/index.js",
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&module),
        "module.exports = (s, n) => String(s).padEnd(n, '.');\n",
        "{out}{err}"
    );
    let refused = GuestNet::of(sb.vmm_pid).get(
        &format!("{PROXY}/r/npm/left-pad"),
        &[("User-Agent", NPM_UA), ("Accept", NPM_ACCEPT)],
    );
    assert_eq!(
        (refused.status, refused.reason.as_str()),
        (
            403,
            "airlock: package left-pad is not on the allowlist of the sandbox's policy"
        ),
        "{refused:?}"
    );
    let body: serde_json::Value = serde_json::from_slice(&refused.body).unwrap();
    assert_eq!(
        body["error"],
        "package left-pad is not on the allowlist of the sandbox's policy"
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
    assert_eq!(denied.len(), 1, "one refusal: {log:?}");
    destroy(&mut c, &sb.id).await;
}
