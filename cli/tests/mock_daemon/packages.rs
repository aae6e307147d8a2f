//! The package commands against the mock: the policy `create` sends and the record shows, the
//! install log `installs` prints (paged, followed).

use super::*;

#[tokio::test]
async fn create_sends_the_package_policy_and_the_record_shows_it() {
    let d = Daemon::start();
    let p = d
        .airlock(&[
            "--json",
            "create",
            "--pkg-registry",
            "pypi",
            "--pkg-allow",
            "requests",
            "--pkg-allow",
            "types-*",
            "--pkg-deny",
            "evil-*",
            "--max-download-mib",
            "50",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let policy = d.seen().create.clone().unwrap().packages.unwrap();
    assert_eq!(
        policy,
        PackagePolicy {
            registries: vec!["pypi".into()],
            allow: vec!["requests".into(), "types-*".into()],
            deny: vec!["evil-*".into()],
            offline: false,
            max_download_bytes: 50 << 20,
        }
    );
    // The record shows the policy in force, as the daemon answered it.
    let v = json(&p.stdout);
    assert_eq!(
        v["packages"],
        serde_json::json!({
            "registries": ["pypi"], "allow": ["requests", "types-*"], "deny": ["evil-*"],
            "offline": false, "max_download_bytes": 50 << 20,
        })
    );

    let p = d.airlock(&["--json", "create", "--offline"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(
        d.seen().create.clone().unwrap().packages,
        Some(PackagePolicy {
            offline: true,
            ..Default::default()
        })
    );
    assert_eq!(json(&p.stdout)["packages"]["offline"], true);

    // No package flag: no policy sent; the record has the ceiling's.
    let p = d.airlock(&["--json", "create"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(d.seen().create.clone().unwrap().packages, None);
    let v = json(&p.stdout);
    assert_eq!(
        v["packages"]["registries"],
        serde_json::json!(["npm", "pypi"])
    );
    assert_eq!(v["packages"]["max_download_bytes"], 1 << 30);

    // The text record has a `packages` line next to `network`.
    let p = d.airlock(&["get", "sb-1"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    assert!(out.lines().any(|l| l == "packages         any"), "{out}");
    assert!(
        out.lines().any(|l| l == "network          deny-all"),
        "{out}"
    );

    // Beyond the ceiling: the daemon's reason, exit 1, nothing on stdout.
    let p = d.airlock(&["create", "--pkg-registry", "corp"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(p.stdout.is_empty());
    assert!(
        text(&p.stderr).contains("PACKAGES_NOT_ALLOWED"),
        "{}",
        text(&p.stderr)
    );

    // Usage errors: no call.
    d.seen().create = None;
    for bad in [
        &["create", "--offline", "--pkg-allow", "requests"][..],
        &["create", "--pkg-allow", "requests==2"],
        &["create", "--max-download-mib", "0"],
    ] {
        assert_eq!(d.airlock(bad).await.status.code(), Some(2), "{bad:?}");
    }
    assert!(d.seen().create.is_none());
}

#[tokio::test]
async fn installs_prints_the_log() {
    let d = Daemon::start();
    let p = d.airlock(&["installs", "sb-1"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "a header and three events: {out}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "SEQ", "TIME", "(UTC)", "REGISTRY", "PACKAGE", "VERSION", "FILE", "BYTES", "OUTCOME",
            "MESSAGE"
        ],
        "{out}"
    );
    for want in [
        "2023-11-14T22:13:20.001Z",
        "pypi",
        "requests",
        "2.32.3",
        "requests-2.32.3-py3-none-any.whl",
        "64928",
        "fetched",
        "sha256 verified",
    ] {
        assert!(lines[1].contains(want), "{want}: {}", lines[1]);
    }
    for want in ["urllib3", "cached", "served from the cache"] {
        assert!(lines[2].contains(want), "{want}: {}", lines[2]);
    }
    for want in [
        "evil-pkg",
        " - ",
        "denied",
        "denied by the deny list (evil-*)",
    ] {
        assert!(lines[3].contains(want), "{want}: {}", lines[3]);
    }
    assert!(
        text(&p.stderr).contains("2 install events"),
        "{}",
        text(&p.stderr)
    );
    // Paged until an empty answer.
    let reqs = d.seen().installs.clone();
    assert_eq!(
        reqs.iter()
            .map(|r| (r.sandbox_id.as_str(), r.after_seq, r.limit))
            .collect::<Vec<_>>(),
        [("sb-1", 0, 0), ("sb-1", 3, 0)]
    );
    assert!(d.seen().egress.is_empty(), "not the egress log");

    let p = d
        .airlock(&["--json", "installs", "sb-1", "--after", "1"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let v = json(&p.stdout);
    let events = v.as_array().unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(
        events[0],
        serde_json::json!({
            "seq": 2, "time_unix_ms": 1_700_000_000_002_i64, "tenant": "default",
            "sandbox_id": "sb-1", "registry": "pypi", "kind": "pypi", "package": "urllib3",
            "version": "2.2.3", "file": "urllib3-2.2.3-py3-none-any.whl", "bytes": 64_928,
            "sha256": "5e".repeat(32), "outcome": "cached", "message": "served from the cache",
        })
    );
    assert_eq!(
        (events[1]["outcome"].as_str(), events[1]["file"].as_str()),
        (Some("denied"), Some(""))
    );

    d.seen().installs.clear();
    let p = d.airlock(&["installs", "sb-1", "--limit", "2"]).await;
    assert_eq!(text(&p.stdout).lines().count(), 3, "{}", text(&p.stdout));
    let reqs = d.seen().installs.clone();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].limit, 2);

    // --follow: new events as they come, until the sandbox has ended.
    let p = d
        .airlock(&["--json", "installs", "sb-ending", "--follow"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let records: Vec<serde_json::Value> = text(&p.stdout)
        .lines()
        .map(|l| json(l.as_bytes()))
        .collect();
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
    assert_eq!(records[3]["outcome"], "over_cap");
    assert_eq!(d.seen().ending_polls, 2);

    let p = d.airlock(&["installs", "sb-1", "--after", "3"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout).lines().count(), 1, "the header alone");
    let p = d
        .airlock(&["--json", "installs", "sb-1", "--after", "3"])
        .await;
    assert_eq!(json(&p.stdout), serde_json::json!([]));

    let p = d.airlock(&["installs", "sb-0"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(p.stdout.is_empty());
    assert!(text(&p.stderr).contains("SANDBOX_NOT_FOUND"));
    for bad in [
        &["installs", "sb-1", "--limit", "1", "--follow"][..],
        &["installs", "sb-1", "--limit", "0"],
        &["installs"],
    ] {
        assert_eq!(d.airlock(bad).await.status.code(), Some(2), "{bad:?}");
    }
}
