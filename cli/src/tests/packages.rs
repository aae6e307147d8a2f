//! The package commands' arguments, requests and output: create's package flags, the policy
//! in a sandbox's record, `installs`.

use airlock_api::v1::{InstallEvent, InstallOutcome, PackagePolicy, Sandbox};

use super::*;
use crate::args::{parse_pkg_pattern, parse_registry};
use crate::output::{
    install_header, install_json, install_line, install_outcome_name, packages_json, packages_text,
    sandbox_json, sandbox_text,
};

fn create_packages(args: &[&str]) -> Option<PackagePolicy> {
    let Command::Create(a) = parse(&[&["create"][..], args].concat()).command else {
        panic!("not create")
    };
    create_request(&a, &fake_read).unwrap().packages
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn create_package_flags_build_the_policy() {
    assert_eq!(create_packages(&[]), None, "no flag: the ceiling's policy");
    assert_eq!(
        create_packages(&[
            "--pkg-registry",
            "pypi",
            "--pkg-allow",
            "requests",
            "--pkg-registry",
            "npm-mirror",
            "--pkg-allow",
            "types-*",
            "--pkg-deny",
            "evil_pkg",
            "--pkg-deny",
            "@acme/*",
            "--max-download-mib",
            "50",
        ]),
        Some(PackagePolicy {
            registries: strings(&["pypi", "npm-mirror"]),
            allow: strings(&["requests", "types-*"]),
            deny: strings(&["evil_pkg", "@acme/*"]),
            offline: false,
            max_download_bytes: 50 << 20,
        })
    );
    assert_eq!(
        create_packages(&["--offline"]),
        Some(PackagePolicy {
            offline: true,
            ..Default::default()
        })
    );
    // Any one flag sends the policy, the rest left empty.
    assert_eq!(
        create_packages(&["--max-download-mib", "1"]),
        Some(PackagePolicy {
            max_download_bytes: 1 << 20,
            ..Default::default()
        })
    );
    assert_eq!(
        create_packages(&["--pkg-deny", "leftpad"]).unwrap().deny,
        ["leftpad"]
    );
    // The largest cap that fits in bytes.
    let max = (u64::MAX >> 20).to_string();
    assert_eq!(
        create_packages(&["--max-download-mib", &max])
            .unwrap()
            .max_download_bytes,
        (u64::MAX >> 20) << 20
    );
    // The network flags do not touch the package policy, nor these the network's.
    assert_eq!(create_packages(&["--allow-internet"]), None);
    let Command::Create(a) = parse(&["create", "--offline"]).command else {
        panic!("not create")
    };
    assert_eq!(create_request(&a, &fake_read).unwrap().network, None);
}

#[test]
fn create_package_flags_reject_mixtures_and_bad_values() {
    for conflict in [
        &["create", "--offline", "--pkg-allow", "requests"][..],
        &["create", "--offline", "--pkg-deny", "requests"],
        &["create", "--offline", "--pkg-registry", "pypi"],
        &["create", "--offline", "--max-download-mib", "5"],
    ] {
        assert_eq!(
            parse_err(conflict),
            ErrorKind::ArgumentConflict,
            "{conflict:?}"
        );
    }
    let too_big = ((u64::MAX >> 20) + 1).to_string();
    for bad in [
        &["create", "--pkg-allow", ""][..],
        &["create", "--pkg-allow", "two words"],
        &["create", "--pkg-allow", "requests==2.0"],
        &["create", "--pkg-deny", "a,b"],
        &["create", "--pkg-registry", ""],
        &["create", "--pkg-registry", "https://pypi.org/simple"],
        &["create", "--max-download-mib", "0"],
        &["create", "--max-download-mib", "lots"],
        &["create", "--max-download-mib", &too_big],
    ] {
        assert_eq!(parse_err(bad), ErrorKind::ValueValidation, "{bad:?}");
    }
    assert_eq!(
        parse_err(&["create", "--max-download-mib", "-1"]),
        ErrorKind::UnknownArgument
    );
    assert_eq!(
        parse_err(&["create", "--max-download-mib"]),
        ErrorKind::InvalidValue
    );
}

#[test]
fn package_value_parsers() {
    for ok in [
        "requests",
        "types-*",
        "@acme/*",
        "*",
        "Foo_Bar.baz",
        "left~pad",
    ] {
        assert_eq!(parse_pkg_pattern(ok).unwrap(), ok);
    }
    for bad in [
        "",
        " requests",
        "a b",
        "pkg>=1",
        "a,b",
        "ü",
        &"x".repeat(215),
    ] {
        assert!(parse_pkg_pattern(bad).is_err(), "{bad:?}");
    }
    for ok in ["pypi", "npm", "pypi-mirror", "corp_npm2"] {
        assert_eq!(parse_registry(ok).unwrap(), ok);
    }
    for bad in ["", "py pi", "pypi.org", "a/b", "pypi:"] {
        assert!(parse_registry(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn installs_flags() {
    let Command::Installs(a) = parse(&["installs", "sb-1"]).command else {
        panic!("not installs")
    };
    assert_eq!(
        (a.id.as_str(), a.after, a.limit, a.follow),
        ("sb-1", 0, None, false)
    );
    let Command::Installs(a) = parse(&["installs", "sb-1", "--after", "7", "--limit", "3"]).command
    else {
        panic!("not installs")
    };
    assert_eq!((a.after, a.limit), (7, Some(3)));
    assert!(matches!(parse(&["installs", "-f", "sb-1"]).command, Command::Installs(a) if a.follow));
    assert!(parse(&["installs", "sb-1", "--json"]).json);
    assert_eq!(
        parse_err(&["installs", "sb-1", "--limit", "3", "--follow"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["installs", "sb-1", "--limit", "0"]),
        ErrorKind::ValueValidation
    );
    assert_eq!(parse_err(&["installs"]), ErrorKind::MissingRequiredArgument);
}

#[test]
fn package_policy_output() {
    assert_eq!(packages_text(None), "any");
    assert_eq!(packages_text(Some(&PackagePolicy::default())), "any");
    let offline = PackagePolicy {
        offline: true,
        registries: strings(&["pypi"]),
        ..Default::default()
    };
    assert_eq!(packages_text(Some(&offline)), "offline");
    let policy = PackagePolicy {
        registries: strings(&["pypi", "npm"]),
        allow: strings(&["requests", "types-*"]),
        deny: strings(&["evil-*"]),
        offline: false,
        max_download_bytes: 50 << 20,
    };
    assert_eq!(
        packages_text(Some(&policy)),
        "registries=pypi,npm allow=requests,types-* deny=evil-* max-download=50MiB"
    );
    let odd_cap = PackagePolicy {
        max_download_bytes: 1000,
        ..Default::default()
    };
    assert_eq!(packages_text(Some(&odd_cap)), "max-download=1000B");

    assert_eq!(
        packages_json(Some(&policy)),
        serde_json::json!({
            "registries": ["pypi", "npm"], "allow": ["requests", "types-*"],
            "deny": ["evil-*"], "offline": false, "max_download_bytes": 50 << 20,
        })
    );
    assert_eq!(
        packages_json(None),
        serde_json::json!({
            "registries": [], "allow": [], "deny": [], "offline": false,
            "max_download_bytes": 0,
        })
    );

    // In the sandbox's record, next to the network policy.
    let s = Sandbox {
        id: "sb-1".into(),
        packages: Some(policy.clone()),
        ..Default::default()
    };
    assert_eq!(sandbox_json(&s)["packages"], packages_json(Some(&policy)));
    let text = sandbox_text(&s);
    assert!(
        text.lines().any(|l| l
            == "packages         registries=pypi,npm allow=requests,types-* deny=evil-* \
                max-download=50MiB"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "network          deny-all"),
        "{text}"
    );
}

#[test]
fn install_log_output() {
    let names: Vec<&str> = [
        InstallOutcome::Cached,
        InstallOutcome::Fetched,
        InstallOutcome::Denied,
        InstallOutcome::HashMismatch,
        InstallOutcome::OverCap,
        InstallOutcome::UpstreamError,
        InstallOutcome::Unspecified,
    ]
    .into_iter()
    .map(|o| install_outcome_name(o as i32))
    .collect();
    assert_eq!(
        names,
        [
            "cached",
            "fetched",
            "denied",
            "hash_mismatch",
            "over_cap",
            "upstream_error",
            "unknown"
        ]
    );
    assert_eq!(install_outcome_name(99), "unknown");

    let header = install_header();
    let columns: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(
        columns,
        [
            "SEQ", "TIME", "(UTC)", "REGISTRY", "PACKAGE", "VERSION", "FILE", "BYTES", "OUTCOME",
            "MESSAGE"
        ]
    );

    let fetched = InstallEvent {
        seq: 1,
        time_unix_ms: 1_700_000_000_123,
        tenant: "default".into(),
        sandbox_id: "sb-1".into(),
        registry: "pypi".into(),
        kind: "pypi".into(),
        package: "requests".into(),
        version: "2.32.3".into(),
        file: "requests-2.32.3-py3-none-any.whl".into(),
        bytes: 64_928,
        sha256: "ab".repeat(32),
        outcome: InstallOutcome::Fetched as i32,
        message: "fetched and verified".into(),
    };
    let line = install_line(&fetched);
    for want in [
        "2023-11-14T22:13:20.123Z",
        "pypi",
        "requests",
        "2.32.3",
        "requests-2.32.3-py3-none-any.whl",
        "64928",
        "fetched",
        "fetched and verified",
    ] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    assert!(line.trim_start().starts_with("1 "), "{line}");
    // The columns line up with the header's.
    assert_eq!(
        line.find("2023-11-14"),
        header.find("TIME (UTC)"),
        "{header}\n{line}"
    );
    assert_eq!(line.find("requests"), header.find("PACKAGE"));

    // A refused index page: no version, no file.
    let denied = InstallEvent {
        seq: 2,
        registry: "pypi".into(),
        kind: "pypi".into(),
        package: "anything-at-all".into(),
        outcome: InstallOutcome::Denied as i32,
        message: "the sandbox is offline".into(),
        ..Default::default()
    };
    let line = install_line(&denied);
    assert_eq!(line.matches(" - ").count(), 2, "version and file: {line}");
    for want in ["anything-at-all", "denied", "the sandbox is offline"] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    assert!(!line.ends_with(' '));

    let v = install_json(&fetched);
    assert_eq!(
        v,
        serde_json::json!({
            "seq": 1, "time_unix_ms": 1_700_000_000_123_i64, "tenant": "default",
            "sandbox_id": "sb-1", "registry": "pypi", "kind": "pypi", "package": "requests",
            "version": "2.32.3", "file": "requests-2.32.3-py3-none-any.whl", "bytes": 64_928,
            "sha256": "ab".repeat(32), "outcome": "fetched", "message": "fetched and verified",
        })
    );
    assert_eq!(v.as_object().unwrap().len(), 13, "one key per field");
    assert_eq!(install_json(&denied)["outcome"], "denied");
    let over = InstallEvent {
        outcome: InstallOutcome::OverCap as i32,
        ..Default::default()
    };
    assert_eq!(install_json(&over)["outcome"], "over_cap");
}
