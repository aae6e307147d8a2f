#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::os::fd::AsFd;

use super::*;

pub(super) mod loopback;

fn rule(domain: &str, cidr: &str, ports: &[u32]) -> EgressRule {
    EgressRule {
        target: if domain.is_empty() {
            Some(egress_rule::Target::Cidr(cidr.into()))
        } else {
            Some(egress_rule::Target::Domain(domain.into()))
        },
        ports: ports.to_vec(),
    }
}

fn egress(ceilings: &str) -> Egress {
    egress_with(NetworkConfig::default(), ceilings)
}

fn egress_with(cfg: NetworkConfig, ceilings: &str) -> Egress {
    // Tests run at once: each its own store.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "airlock-net-test-{}-{}-{}",
        std::process::id(),
        now_ms(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("db")).unwrap());
    let tenants: BTreeMap<String, PolicyConfig> = toml::from_str(ceilings).unwrap();
    let metrics = Arc::new(Metrics::default());
    let packages = crate::pkg::Packages::new(
        crate::pkg::PackagesConfig::default(),
        &dir,
        &BTreeMap::new(),
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    Egress::new(cfg, &tenants, store, metrics, Arc::new(packages)).unwrap()
}

/// A sandbox's network state for tests that serve connections on loopback: `policy`, and
/// `secrets` (brokered ones among them).
pub(super) fn state(policy: Policy, secrets: Vec<crate::secrets::Spec>) -> Arc<NetState> {
    state_with(NetworkConfig::default(), policy, secrets)
}

/// [`state`] under the settings `cfg`.
pub(super) fn state_with(
    cfg: NetworkConfig,
    policy: Policy,
    secrets: Vec<crate::secrets::Spec>,
) -> Arc<NetState> {
    let egress = Arc::new(egress_with(cfg, ""));
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = format!("sb-test-{}-{n}", now_ms());
    Arc::new(NetState {
        packages: egress.packages.session("t", &id, pkg_policy(), false),
        log: SandboxLog::new(egress.store.clone(), "t", &id, 100),
        sandbox_id: id,
        tenant: "t".into(),
        policy: RwLock::new(Arc::new(policy)),
        resolved: Mutex::new(HashMap::new()),
        egress,
        secrets: Arc::new(crate::secrets::SandboxSecrets::new(secrets)),
    })
}

/// A secret brokered as `Authorization: Bearer VALUE` to `host` (plain HTTP only).
pub(super) fn brokered(name: &str, value: &str, host: &str) -> crate::secrets::Spec {
    crate::secrets::Spec {
        name: name.into(),
        value: value.to_owned().into(),
        delivery: crate::secrets::Delivery::Broker(crate::secrets::Broker {
            hosts: vec![airlock_egress::DomainPattern::parse(host).unwrap()],
            host_names: vec![host.into()],
            header: "authorization".into(),
            format: "Bearer {value}".into(),
            https: false,
        }),
        ttl: None,
    }
}

#[test]
fn requests_become_policies_or_clear_errors() {
    let p = |allow_internet, allow| {
        policy_of(&NetworkPolicy {
            allow_internet,
            allow,
        })
    };
    assert_eq!(p(false, vec![]).unwrap(), Policy::DenyAll);
    assert_eq!(p(true, vec![]).unwrap(), Policy::AllowInternet);
    let rules = p(
        false,
        vec![rule("*.example.com", "", &[443]), rule("", "8.8.8.8", &[])],
    )
    .unwrap();
    assert_eq!(
        rules,
        Policy::Rules(vec![
            Rule::domain("*.example.com", &[443]).unwrap(),
            Rule::cidr("8.8.8.8/32", &[]).unwrap()
        ])
    );
    for (bad, why) in [
        (p(true, vec![rule("a.com", "", &[])]), "not both"),
        (p(false, vec![EgressRule::default()]), "a domain or a cidr"),
        (p(false, vec![rule("a.com", "", &[70000])]), "not a port"),
        (p(false, vec![rule("*.com", "", &[])]), "invalid domain"),
        (p(false, vec![rule("", "10.0.0.0/33", &[])]), "invalid CIDR"),
    ] {
        let e = bad.unwrap_err();
        assert_eq!(e.reason(), "INVALID_ARGUMENT");
        assert!(e.to_string().contains(why), "{e}");
    }
}

#[test]
fn a_tenants_ceiling_bounds_what_it_may_ask_for() {
    let e = egress(
        r#"
        [acme]
        allow = [{ domain = "*.acme.example" }, { cidr = "10.1.0.0/16", ports = [5432] }]
        "#,
    );
    let ask = |allow_internet, allow| NetworkPolicy {
        allow_internet,
        allow,
    };
    // The default ceiling: public addresses only.
    assert!(e.check("other", &ask(true, vec![])).is_ok());
    assert!(
        e.check("other", &ask(false, vec![rule("pypi.org", "", &[])]))
            .is_ok()
    );
    let err = e
        .check("other", &ask(false, vec![rule("", "10.1.2.3", &[])]))
        .unwrap_err();
    assert_eq!(err.reason(), "NETWORK_NOT_ALLOWED");
    assert!(err.to_string().contains("10.1.2.3/32"), "{err}");
    // Acme's: its own names and its database, nothing more.
    assert!(
        e.check(
            "acme",
            &ask(
                false,
                vec![
                    rule("api.acme.example", "", &[443]),
                    rule("", "10.1.0.7", &[5432])
                ]
            )
        )
        .is_ok()
    );
    for beyond in [
        ask(true, vec![]),
        ask(false, vec![rule("pypi.org", "", &[])]),
        ask(false, vec![rule("", "10.1.0.7", &[22])]),
    ] {
        assert_eq!(
            e.check("acme", &beyond).unwrap_err().reason(),
            "NETWORK_NOT_ALLOWED"
        );
    }
    // Deny-all is always within a ceiling.
    assert!(e.check("acme", &ask(false, vec![])).is_ok());
}

#[test]
fn a_sandbox_namespace_gets_the_ruleset_and_the_exits() {
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root && Path::new("/dev/net/tun").exists(),
        "this test needs root and /dev/net/tun (run the tests as root)"
    );
    let nft = find_nft(None).expect("nft (apt-get install nftables)");
    let nft2 = nft.clone();
    let (ns, exits) = airlock_netcfg::new_netns_with_tap(
        c"tap0",
        airlock_proto::GATEWAY_MAC,
        airlock_proto::GATEWAY_IPV4,
        airlock_proto::GUEST_PREFIX,
        move || prepare(&nft2),
    )
    .unwrap();
    let gw = airlock_proto::GATEWAY_IPV4;
    assert_eq!(
        exits.proxy.local_addr().unwrap(),
        SocketAddr::from((gw, PROXY_PORT))
    );
    assert_eq!(
        exits.dns.local_addr().unwrap(),
        SocketAddr::from((gw, DNS_PORT))
    );
    let listed = airlock_netcfg::in_netns(ns.netns.as_fd(), move || {
        std::process::Command::new(&nft)
            .args(["list", "ruleset"])
            .output()
    })
    .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    for line in [
        "iifname \"tap0\" meta l4proto tcp redirect to :15001",
        "iifname \"tap0\" udp dport 53 redirect to :53",
        "type filter hook input priority filter; policy drop;",
        "type filter hook forward priority filter; policy drop;",
    ] {
        assert!(listed.contains(line), "{line:?} missing from\n{listed}");
    }
    // The host's own ruleset is untouched.
    let ours = std::process::Command::new(find_nft(None).unwrap())
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&ours.stdout).contains("airlock"),
        "the sandbox's table is in the host's namespace"
    );
    // Opening the exits again (a restarted daemon) needs the old ones closed first.
    drop(exits);
    let again = reopen(ns.netns.as_fd()).unwrap();
    assert_eq!(
        again.proxy.local_addr().unwrap(),
        SocketAddr::from((gw, PROXY_PORT))
    );
}

#[test]
fn the_hosts_own_addresses_are_known() {
    let addrs = HostAddrs::default();
    // Every host has loopback; the address of a non-loopback interface, where there is one.
    assert!(addrs.contains("127.0.0.1".parse().unwrap()));
    assert!(
        addrs.contains("::ffff:127.0.0.1".parse().unwrap()),
        "IPv4-mapped"
    );
    assert!(!addrs.contains("192.0.2.77".parse().unwrap()));
    for i in if_addrs::get_if_addrs().unwrap() {
        assert!(addrs.contains(i.ip()), "{i:?}");
    }
}

/// A package policy that allows nothing (the proxy's tests install nothing).
fn pkg_policy() -> airlock_packages::policy::Policy {
    let none = airlock_packages::policy::Parts::default();
    airlock_packages::policy::Policy::combine(&none, &none, &[]).unwrap()
}

#[tokio::test]
async fn the_operators_and_the_clusters_addresses_are_never_reachable() {
    let never = NeverReach::new(&["198.51.100.7".into(), "203.0.113.0/24".into()]).unwrap();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert!(never.contains(ip("198.51.100.7")));
    assert!(never.contains(ip("::ffff:203.0.113.9")), "IPv4-mapped");
    assert!(!never.contains(ip("198.51.100.8")));
    assert!(!never.contains(ip("192.0.2.10")));
    never
        .set_cluster(vec![
            "http://192.0.2.10:2379".into(),
            "https://[2001:db8::5]:7443".into(),
            "http://localhost:2379".into(),
            "not a url".into(),
        ])
        .await;
    assert!(never.contains(ip("192.0.2.10")));
    assert!(never.contains(ip("2001:db8::5")));
    assert!(never.contains(ip("127.0.0.1")), "a name, resolved");
    // A new list replaces the old one.
    never
        .set_cluster(vec!["http://192.0.2.11:2379".into()])
        .await;
    assert!(!never.contains(ip("192.0.2.10")));
    assert!(never.contains(ip("192.0.2.11")));
    assert!(NeverReach::new(&["10.0.0.0/33".into()]).is_err());
    let cfg: NetworkConfig = toml::from_str("never_reach = [\"10.9.0.0/16\"]").unwrap();
    assert_eq!(cfg.never_reach, ["10.9.0.0/16"]);
}
