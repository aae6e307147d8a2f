//! The network commands' arguments, requests and output: create's allow flags, `net`,
//! `egress`, `expose`.

use super::*;

fn domain(d: &str, ports: &[u32]) -> EgressRule {
    EgressRule {
        target: Some(egress_rule::Target::Domain(d.into())),
        ports: ports.to_vec(),
    }
}

fn cidr(c: &str, ports: &[u32]) -> EgressRule {
    EgressRule {
        target: Some(egress_rule::Target::Cidr(c.into())),
        ports: ports.to_vec(),
    }
}

fn create_network(args: &[&str]) -> Option<NetworkPolicy> {
    let Command::Create(a) = parse(&[&["create"][..], args].concat()).command else {
        panic!("not create")
    };
    create_request(&a, &fake_read).unwrap().network
}

#[test]
fn create_network_flags_build_the_policy() {
    assert_eq!(create_network(&[]), None, "no flag: deny-all");
    assert_eq!(
        create_network(&[
            "--allow-domain",
            "api.example.com",
            "--allow-cidr",
            "203.0.113.0/24",
            "--allow-domain",
            "*.example.com",
            "--allow-port",
            "443",
            "--allow-port",
            "80",
        ]),
        Some(NetworkPolicy {
            allow_internet: false,
            allow: vec![
                domain("api.example.com", &[443, 80]),
                domain("*.example.com", &[443, 80]),
                cidr("203.0.113.0/24", &[443, 80]),
            ],
        })
    );
    assert_eq!(
        create_network(&["--allow-cidr", "2001:db8::1"]),
        Some(NetworkPolicy {
            allow_internet: false,
            allow: vec![cidr("2001:db8::1", &[])],
        })
    );
    assert_eq!(
        create_network(&["--allow-internet"]),
        Some(NetworkPolicy {
            allow_internet: true,
            allow: vec![],
        })
    );
}

#[test]
fn create_network_flags_reject_mixtures_and_bad_values() {
    for conflict in [
        &["create", "--allow-internet", "--allow-domain", "a.example"][..],
        &["create", "--allow-internet", "--allow-cidr", "203.0.113.1"],
        &["create", "--allow-internet", "--allow-port", "443"],
    ] {
        assert_eq!(
            parse_err(conflict),
            ErrorKind::ArgumentConflict,
            "{conflict:?}"
        );
    }
    assert_eq!(
        parse_err(&["create", "--allow-port", "443"]),
        ErrorKind::MissingRequiredArgument,
        "ports need a rule to apply to"
    );
    for bad in [
        &["create", "--allow-domain", "https://a.example"][..],
        &["create", "--allow-domain", "a.example:443"],
        &["create", "--allow-domain", "a.*.example"],
        &["create", "--allow-domain", ""],
        &["create", "--allow-cidr", "10.0.0.0/33"],
        &["create", "--allow-cidr", "example.com"],
        &["create", "--allow-domain", "a.example", "--allow-port", "0"],
        &[
            "create",
            "--allow-domain",
            "a.example",
            "--allow-port",
            "65536",
        ],
    ] {
        assert_eq!(parse_err(bad), ErrorKind::ValueValidation, "{bad:?}");
    }
}

#[test]
fn net_needs_a_policy_and_deny_all_says_so() {
    let cli = parse(&["net", "sb-1"]);
    let err = crate::args::check(&cli).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::MissingRequiredArgument);
    assert!(err.to_string().contains("--deny-all"), "{err}");

    let cli = parse(&["net", "sb-1", "--deny-all"]);
    crate::args::check(&cli).unwrap();
    let Command::Net(a) = cli.command else {
        panic!("not net")
    };
    let req = net_request(&a);
    assert_eq!(req.sandbox_id, "sb-1");
    assert_eq!(req.network, Some(NetworkPolicy::default()));

    let cli = parse(&[
        "net",
        "sb-1",
        "--allow-cidr",
        "198.51.100.7",
        "--allow-port",
        "5432",
    ]);
    crate::args::check(&cli).unwrap();
    let Command::Net(a) = cli.command else {
        panic!("not net")
    };
    assert_eq!(
        net_request(&a).network.unwrap().allow,
        [cidr("198.51.100.7", &[5432])]
    );
    let Command::Net(a) = parse(&["net", "sb-1", "--allow-internet"]).command else {
        panic!("not net")
    };
    assert!(net_request(&a).network.unwrap().allow_internet);

    for conflict in [
        &["net", "sb-1", "--deny-all", "--allow-internet"][..],
        &["net", "sb-1", "--deny-all", "--allow-domain", "a.example"],
    ] {
        assert_eq!(
            parse_err(conflict),
            ErrorKind::ArgumentConflict,
            "{conflict:?}"
        );
    }
    assert_eq!(parse_err(&["net"]), ErrorKind::MissingRequiredArgument);
    crate::args::check(&parse(&["ls"])).unwrap();
}

#[test]
fn egress_flags() {
    let Command::Egress(a) = parse(&["egress", "sb-1"]).command else {
        panic!("not egress")
    };
    assert_eq!(
        (a.id.as_str(), a.after, a.limit, a.follow),
        ("sb-1", 0, None, false)
    );
    let Command::Egress(a) = parse(&["egress", "sb-1", "--after", "7", "--limit", "3"]).command
    else {
        panic!("not egress")
    };
    assert_eq!((a.after, a.limit), (7, Some(3)));
    assert!(matches!(parse(&["egress", "-f", "sb-1"]).command, Command::Egress(a) if a.follow));
    assert_eq!(
        parse_err(&["egress", "sb-1", "--limit", "3", "--follow"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["egress", "sb-1", "--limit", "0"]),
        ErrorKind::ValueValidation
    );
}

#[test]
fn expose_flags() {
    let Command::Expose(a) = parse(&["expose", "sb-1", "8000"]).command else {
        panic!("not expose")
    };
    assert_eq!((a.id.as_str(), a.port, a.ttl), ("sb-1", 8000, None));
    let req = expose_request(&a);
    assert_eq!(
        (req.sandbox_id.as_str(), req.guest_port, req.ttl_s),
        ("sb-1", 8000, 0),
        "no --ttl: the daemon's default"
    );
    let Command::Expose(a) = parse(&["expose", "--ttl", "600", "sb-1", "65535"]).command else {
        panic!("not expose")
    };
    assert_eq!(
        (expose_request(&a).guest_port, expose_request(&a).ttl_s),
        (65535, 600)
    );
    assert!(parse(&["expose", "sb-1", "80", "--json"]).json);

    assert_eq!(
        parse_err(&["expose", "sb-1"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(parse_err(&["expose"]), ErrorKind::MissingRequiredArgument);
    for bad in [
        &["expose", "sb-1", "0"][..],
        &["expose", "sb-1", "65536"],
        &["expose", "sb-1", "http"],
        &["expose", "sb-1", "80", "--ttl", "0"],
    ] {
        assert_eq!(parse_err(bad), ErrorKind::ValueValidation, "{bad:?}");
    }
    assert_eq!(
        parse_err(&["expose", "sb-1", "80", "81"]),
        ErrorKind::UnknownArgument
    );
}

#[test]
fn network_and_egress_output() {
    assert_eq!(network_text(None), "deny-all");
    assert_eq!(network_text(Some(&NetworkPolicy::default())), "deny-all");
    let internet = NetworkPolicy {
        allow_internet: true,
        allow: vec![],
    };
    assert_eq!(network_text(Some(&internet)), "allow-internet");
    let rules = NetworkPolicy {
        allow_internet: false,
        allow: vec![
            domain("*.example.com", &[443]),
            domain("api.example.com", &[]),
            cidr("203.0.113.0/24", &[80, 443]),
            cidr("2001:db8::/32", &[443]),
        ],
    };
    assert_eq!(
        network_text(Some(&rules)),
        "*.example.com:443 api.example.com 203.0.113.0/24:80,443 [2001:db8::/32]:443"
    );
    let v = network_json(Some(&rules));
    assert_eq!(v["allow_internet"], false);
    assert_eq!(v["allow"][0]["domain"], "*.example.com");
    assert_eq!(v["allow"][2]["cidr"], "203.0.113.0/24");
    assert_eq!(v["allow"][2]["ports"], serde_json::json!([80, 443]));
    assert_eq!(
        network_json(None),
        serde_json::json!({"allow_internet": false, "allow": []})
    );

    assert_eq!(utc_time(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(utc_time(951_827_696_007), "2000-02-29T12:34:56.007Z");
    assert_eq!(utc_time(1_700_000_000_123), "2023-11-14T22:13:20.123Z");

    let dns = EgressEvent {
        seq: 1,
        time_unix_ms: 1_700_000_000_123,
        kind: EgressKind::Dns as i32,
        name: "api.example.com".into(),
        answers: vec!["203.0.113.7".into(), "203.0.113.8".into()],
        duration_ms: 1.25,
        allowed: true,
        verdict: "*.example.com".into(),
        query_type: "A".into(),
        ..Default::default()
    };
    let line = egress_line(&dns);
    for want in [
        "2023-11-14T22:13:20.123Z",
        "dns A",
        "api.example.com",
        "203.0.113.7,203.0.113.8 ",
        "1.2ms",
        "ALLOWED",
        "*.example.com",
    ] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    let tcp = EgressEvent {
        seq: 2,
        kind: EgressKind::Tcp as i32,
        address: "2001:db8::7".into(),
        port: 443,
        bytes_out: 100,
        bytes_in: 2000,
        verdict: "no rule allows 2001:db8::7:443".into(),
        ..Default::default()
    };
    let line = egress_line(&tcp);
    for want in ["tcp", " - ", "[2001:db8::7]:443", "100", "2000", "DENIED"] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    let v = crate::output::egress_json(&tcp);
    assert_eq!(
        (v["kind"].as_str(), v["allowed"].as_bool()),
        (Some("tcp"), Some(false))
    );
    assert_eq!(v.as_object().unwrap().len(), 13, "one key per field");

    let expose = EgressEvent {
        seq: 3,
        kind: EgressKind::Expose as i32,
        address: "192.0.2.10".into(),
        port: 51234,
        bytes_out: 80,
        bytes_in: 512,
        allowed: true,
        ..Default::default()
    };
    let line = egress_line(&expose);
    for want in ["expose", "192.0.2.10:51234", "80", "512", "ALLOWED"] {
        assert!(line.contains(want), "{want:?}: {line}");
    }
    assert_eq!(crate::output::egress_json(&expose)["kind"], "expose");
    assert_eq!(crate::output::egress_kind_name(99), "unknown");
}

#[test]
fn exposure_output() {
    let e = Exposure {
        sandbox_id: "sb-1".into(),
        guest_port: 8000,
        address: "203.0.113.5:40123".into(),
        token: "tok-1".into(),
        expires_unix_ms: 1_700_000_000_123,
    };
    assert_eq!(
        exposure_text(&e),
        "address          203.0.113.5:40123\n\
         token            tok-1\n\
         expires          2023-11-14T22:13:20.123Z\n"
    );
    let v = exposure_json(&e);
    assert_eq!(
        (
            v["address"].as_str(),
            v["token"].as_str(),
            v["guest_port"].as_u64()
        ),
        (Some("203.0.113.5:40123"), Some("tok-1"), Some(8000))
    );
    assert_eq!(v["expires_unix_ms"], 1_700_000_000_123_i64);
    assert_eq!(v.as_object().unwrap().len(), 5);
}
