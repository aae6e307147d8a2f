#![allow(clippy::unwrap_used)]

use super::*;
use airlock_api::v1::InstallOutcome;

fn packages(tenants: &str) -> Packages {
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
    Packages::new(
        PackagesConfig::default(),
        &dir,
        &ceilings,
        store,
        Arc::new(Metrics::default()),
    )
    .unwrap()
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
