use std::net::IpAddr;

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn attempt<'a>(
    addr: &str,
    port: u16,
    name: Option<&'a str>,
    resolved: &'a [IpAddr],
) -> Attempt<'a> {
    Attempt {
        addr: ip(addr),
        port,
        name,
        resolved,
        pinned: false,
        host: false,
        never: false,
    }
}

fn rules(list: &[Rule]) -> Policy {
    Policy::Rules(list.to_vec())
}

#[test]
fn deny_all_is_the_default_and_denies_everything() {
    let p = Policy::default();
    assert_eq!(p, Policy::DenyAll);
    let r = [ip("93.184.215.14")];
    assert_eq!(
        p.check(&attempt("93.184.215.14", 443, Some("example.com"), &r)),
        Err(Denial::DenyAll)
    );
    assert!(!p.may_resolve("example.com"));
}

#[test]
fn a_domain_rule_needs_the_name_its_port_and_the_proxys_own_resolution() {
    let p = rules(&[Rule::domain("example.com", &[443]).unwrap()]);
    let good = [ip("93.184.215.14")];
    let ok = p.check(&attempt("93.184.215.14", 443, Some("example.com"), &good));
    assert_eq!(ok, Ok(Allowance::Rule("example.com:443".into())));
    // The wrong port.
    assert_eq!(
        p.check(&attempt("93.184.215.14", 80, Some("example.com"), &good)),
        Err(Denial::NoRule)
    );
    // A lie in DNS: the guest connects somewhere the proxy did not resolve the name to.
    assert_eq!(
        p.check(&attempt("8.8.8.8", 443, Some("example.com"), &good)),
        Err(Denial::NotResolvedTo("example.com".into()))
    );
    // A literal address without a name.
    assert_eq!(
        p.check(&attempt("93.184.215.14", 443, None, &[])),
        Err(Denial::NoName)
    );
    // Another name.
    assert_eq!(
        p.check(&attempt("93.184.215.14", 443, Some("example.org"), &good)),
        Err(Denial::NoRule)
    );
    assert!(p.may_resolve("example.com"));
    assert!(!p.may_resolve("example.org"));
}

#[test]
fn wildcards_match_below_the_name_only() {
    let w = DomainPattern::parse("*.githubusercontent.com").unwrap();
    assert!(w.matches("raw.githubusercontent.com"));
    assert!(w.matches("a.b.githubusercontent.com"));
    assert!(!w.matches("githubusercontent.com"));
    assert!(!w.matches("evilgithubusercontent.com"));
    assert!(!w.matches("raw.githubusercontent.com.evil.net"));
    assert_eq!(w.to_string(), "*.githubusercontent.com");
    let e = DomainPattern::parse("Example.COM.").unwrap();
    assert!(e.matches("example.com"));
    assert!(!e.matches("www.example.com"));
}

#[test]
fn bad_patterns_and_ports_are_refused() {
    for bad in [
        "",
        "*",
        "*.com",
        "a..b",
        "exa mple.com",
        "*.*.example.com",
        "ex/ample.com",
    ] {
        assert!(DomainPattern::parse(bad).is_err(), "{bad:?}");
    }
    assert!(DomainPattern::parse(&"a.".repeat(130)).is_err(), "too long");
    assert_eq!(Rule::domain("example.com", &[0]), Err(PolicyError::Port));
    assert!(Rule::cidr("10.0.0.0/33", &[]).is_err());
    assert!(Rule::cidr("not-an-address", &[]).is_err());
    let many = Policy::Rules(vec![Rule::cidr("1.1.1.1", &[]).unwrap(); MAX_RULES + 1]);
    assert_eq!(
        many.validate(),
        Err(PolicyError::TooManyRules(MAX_RULES + 1))
    );
}

#[test]
fn the_metadata_address_and_private_ranges_stay_closed_to_wildcards_domains_and_the_internet() {
    let metadata = [ip("169.254.169.254")];
    let p = rules(&[
        Rule::domain("*.example.com", &[]).unwrap(),
        Rule::cidr("0.0.0.0/0", &[]).unwrap(),
    ]);
    // A name allowed by a wildcard that resolves to the metadata address.
    assert_eq!(
        p.check(&attempt(
            "169.254.169.254",
            80,
            Some("meta.example.com"),
            &metadata
        )),
        Err(Denial::Guarded("169.254.0.0/16".parse().unwrap()))
    );
    for addr in [
        "10.1.2.3",
        "127.0.0.1",
        "192.168.1.1",
        "172.20.0.1",
        "100.96.0.1",
        "::1",
        "fd00::1",
        "fe80::1",
        "::ffff:10.0.0.1",
        "64:ff9b::a00:1",
        "224.0.0.1",
    ] {
        let r = [ip(addr)];
        for policy in [&p, &Policy::AllowInternet] {
            let v = policy.check(&attempt(addr, 443, Some("x.example.com"), &r));
            assert!(
                matches!(v, Err(Denial::Guarded(_))),
                "{addr} under {policy:?}: {v:?}"
            );
        }
    }
    // Public addresses: the /0 rule and allow-internet let them through.
    assert!(p.check(&attempt("1.1.1.1", 443, None, &[])).is_ok());
    assert_eq!(
        Policy::AllowInternet.check(&attempt("2606:4700::1111", 443, None, &[])),
        Ok(Allowance::Internet)
    );
}

#[test]
fn an_explicit_cidr_inside_a_guarded_range_opens_exactly_it() {
    let p = rules(&[
        Rule::cidr("10.1.0.0/16", &[5432]).unwrap(),
        Rule::cidr("169.254.169.254", &[80]).unwrap(),
    ]);
    assert_eq!(
        p.check(&attempt("10.1.2.3", 5432, None, &[])),
        Ok(Allowance::Rule("10.1.0.0/16:5432".into()))
    );
    assert!(matches!(
        p.check(&attempt("10.1.2.3", 22, None, &[])),
        Err(Denial::Guarded(_))
    ));
    assert!(matches!(
        p.check(&attempt("10.2.0.1", 5432, None, &[])),
        Err(Denial::Guarded(_))
    ));
    assert!(p.check(&attempt("169.254.169.254", 80, None, &[])).is_ok());
    // A CIDR wider than the guarded range does not count as listing it.
    let wide = rules(&[Rule::cidr("8.0.0.0/5", &[]).unwrap()]);
    assert!(matches!(
        wide.check(&attempt("10.0.0.1", 80, None, &[])),
        Err(Denial::Guarded(_))
    ));
    assert!(wide.check(&attempt("9.9.9.9", 80, None, &[])).is_ok());
}

#[test]
fn names_are_normalised_and_checked() {
    assert_eq!(
        normalise_name("WWW.Example.com."),
        Some("www.example.com".into())
    );
    assert_eq!(normalise_name(""), None);
    assert_eq!(normalise_name("a..b"), None);
    assert_eq!(normalise_name(&"a".repeat(64)), None);
    assert_eq!(normalise_name("bad name"), None);
    assert_eq!(guarded_range(ip("8.8.8.8")), None);
    assert_eq!(
        guarded_range(ip("169.254.169.254")),
        Some("169.254.0.0/16".parse().unwrap())
    );
}

#[test]
fn a_pinned_guarded_address_needs_an_exact_rule_for_its_name() {
    let r = [ip("10.213.0.2")];
    let pinned = |p: &Policy, name: &str| {
        p.check(&Attempt {
            pinned: true,
            ..attempt("10.213.0.2", 80, Some(name), &r)
        })
    };
    let exact = rules(&[Rule::domain("upstream.test", &[80]).unwrap()]);
    assert!(pinned(&exact, "upstream.test").is_ok());
    // Not from the host map: the guard holds.
    assert!(matches!(
        exact.check(&attempt("10.213.0.2", 80, Some("upstream.test"), &r)),
        Err(Denial::Guarded(_))
    ));
    // Another port, a wildcard, allow-internet: the guard holds.
    let other_port = Policy::Rules(vec![Rule::domain("upstream.test", &[443]).unwrap()]);
    assert!(matches!(
        pinned(&other_port, "upstream.test"),
        Err(Denial::Guarded(_))
    ));
    let wildcard = rules(&[Rule::domain("*.upstream.test", &[]).unwrap()]);
    assert!(matches!(
        pinned(&wildcard, "a.upstream.test"),
        Err(Denial::Guarded(_))
    ));
    assert!(matches!(
        pinned(&Policy::AllowInternet, "upstream.test"),
        Err(Denial::Guarded(_))
    ));
}

#[test]
fn a_ceiling_covers_only_what_is_inside_it() {
    let internet = Policy::AllowInternet;
    let list = |l: &[Rule]| Policy::Rules(l.to_vec());
    assert_eq!(internet.covers(&Policy::DenyAll), Ok(()));
    assert_eq!(internet.covers(&Policy::AllowInternet), Ok(()));
    assert_eq!(
        internet.covers(&list(&[Rule::domain("*.example.com", &[]).unwrap()])),
        Ok(())
    );
    assert_eq!(
        internet.covers(&list(&[Rule::cidr("8.8.8.0/24", &[53]).unwrap()])),
        Ok(())
    );
    // A guarded range, or one that contains one, is the operator's to open.
    assert_eq!(
        internet.covers(&list(&[Rule::cidr("10.1.0.0/16", &[]).unwrap()])),
        Err("10.1.0.0/16".to_owned())
    );
    assert!(
        internet
            .covers(&list(&[Rule::cidr("0.0.0.0/0", &[]).unwrap()]))
            .is_err()
    );
    assert!(
        Policy::DenyAll
            .covers(&list(&[Rule::domain("a.com", &[]).unwrap()]))
            .is_err()
    );
    let ceiling = list(&[
        Rule::domain("*.example.com", &[443]).unwrap(),
        Rule::domain("pypi.org", &[]).unwrap(),
        Rule::cidr("10.1.0.0/16", &[]).unwrap(),
    ]);
    assert_eq!(
        ceiling.covers(&list(&[Rule::domain("api.example.com", &[443]).unwrap()])),
        Ok(())
    );
    assert_eq!(
        ceiling.covers(&list(&[Rule::domain("*.a.example.com", &[443]).unwrap()])),
        Ok(())
    );
    assert_eq!(
        ceiling.covers(&list(&[Rule::domain("*.example.com", &[443]).unwrap()])),
        Ok(())
    );
    assert_eq!(
        ceiling.covers(&list(&[Rule::domain("pypi.org", &[80, 443]).unwrap()])),
        Ok(())
    );
    assert_eq!(
        ceiling.covers(&list(&[Rule::cidr("10.1.2.3", &[22]).unwrap()])),
        Ok(())
    );
    for wider in [
        Rule::domain("api.example.com", &[]).unwrap(), // every port: wider than 443
        Rule::domain("example.com", &[443]).unwrap(),  // not below *.example.com
        Rule::domain("*.pypi.org", &[]).unwrap(),
        Rule::cidr("10.0.0.0/8", &[]).unwrap(),
    ] {
        let s = wider.to_string();
        assert_eq!(ceiling.covers(&list(&[wider])), Err(s));
    }
    assert_eq!(
        ceiling.covers(&Policy::AllowInternet),
        Err("allow-internet".to_owned())
    );
}

#[test]
fn the_hosts_own_public_address_is_opened_only_by_a_cidr_rule_of_that_address() {
    // 198.51.200.7 stands for a public address the host has on one of its interfaces.
    let r = [ip("198.51.200.7")];
    let own = |p: &Policy, name: Option<&str>| {
        p.check(&Attempt {
            host: true,
            ..attempt("198.51.200.7", 443, name, &r)
        })
    };
    let denied = Err(Denial::HostAddress(ip("198.51.200.7")));
    assert_eq!(own(&Policy::AllowInternet, None), denied);
    let by_name = rules(&[Rule::domain("host.example", &[]).unwrap()]);
    assert_eq!(
        own(&by_name, Some("host.example")),
        denied,
        "a name resolving there"
    );
    let wide = rules(&[Rule::cidr("198.51.0.0/16", &[]).unwrap()]);
    assert_eq!(own(&wide, None), denied, "a CIDR rule around it");
    let exact = rules(&[Rule::cidr("198.51.200.7/32", &[443]).unwrap()]);
    assert_eq!(
        own(&exact, None),
        Ok(Allowance::Rule("198.51.200.7/32:443".into()))
    );
    // The same address, not the host's: allow-internet reaches it.
    assert_eq!(
        Policy::AllowInternet.check(&attempt("198.51.200.7", 443, None, &r)),
        Ok(Allowance::Internet)
    );
    assert!(
        Denial::HostAddress(ip("198.51.200.7"))
            .to_string()
            .contains("the host itself")
    );
}

#[test]
fn a_never_reachable_address_is_refused_whatever_the_policy() {
    // 198.51.200.9 stands for an etcd endpoint or a cluster peer (or an operator-listed one).
    let r = [ip("198.51.200.9")];
    let never = |p: &Policy, name: Option<&str>, pinned: bool| {
        p.check(&Attempt {
            never: true,
            pinned,
            ..attempt("198.51.200.9", 2379, name, &r)
        })
    };
    let denied = Err(Denial::Never(ip("198.51.200.9")));
    assert_eq!(never(&Policy::AllowInternet, None, false), denied);
    let exact = rules(&[Rule::cidr("198.51.200.9/32", &[]).unwrap()]);
    assert_eq!(never(&exact, None, false), denied, "an exact CIDR rule");
    let by_name = rules(&[Rule::domain("etcd.example", &[]).unwrap()]);
    assert_eq!(
        never(&by_name, Some("etcd.example"), true),
        denied,
        "an exact domain rule for a pinned name"
    );
    assert_eq!(never(&Policy::DenyAll, None, false), Err(Denial::DenyAll));
}
