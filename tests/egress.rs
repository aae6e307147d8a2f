//! System tests of sandbox egress through airlockd, in real VMs with real TAPs, nftables and
//! the daemon's proxy and DNS server: allowed names over HTTP and HTTPS, refusals (denied
//! names, literal addresses, the metadata address, DNS for denied and tunnel-shaped names,
//! UDP, ICMP), each decided at once and logged, and a policy changed on a running sandbox.
//!
//! Traffic stays on this machine: the upstream is a namespace the test makes
//! (`egress/upstream.rs`). Refused attempts never leave the sandbox's namespace: the test
//! checks that the upstream saw only what was allowed.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use airlock_api::v1::{
    CreateSandboxRequest, EgressKind, EgressRule, FileToPlace, GetEgressLogRequest, NetworkPolicy,
    Sandbox, SetNetworkPolicyRequest, egress_rule,
};
use airlock_system_tests::harness::Client;
use airlock_system_tests::shared::{Shared, scenario};

#[path = "egress/upstream.rs"]
mod upstream;
use upstream::*;

async fn start(
    network: Option<NetworkPolicy>,
) -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    Client,
    Sandbox,
) {
    let up = upstream();
    let (serial, s) = scenario(&config(up)).await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network,
            files: vec![FileToPlace {
                path: "/tmp/ca.pem".into(),
                content: up.ca_pem.clone(),
                mode: 0o644,
            }],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    (serial, s, c, sb)
}

/// Guest helpers: `fetch(url)` prints the body, or the error's class with `fast`/`slow` (a
/// refusal must come at once); `raw` sends bytes on a connection and prints what came back.
const PRELUDE: &str = r#"
import socket, ssl, sys, time, urllib.request
ctx = ssl.create_default_context(cafile='/tmp/ca.pem')
# Untimed: a sandbox's first TCP connection also pays the guest kernel's one-time set-up
# (seconds on nested hosts, where guest kernel code is emulated), which is not what is timed.
try:
    socket.create_connection(('100.96.0.1', 9), timeout=60).recv(1)
except OSError:
    pass
def fetch(url):
    t = time.monotonic()
    try:
        r = urllib.request.urlopen(url, timeout=30, context=ctx).read().decode()
        print(url, r)
        return
    except Exception as e:
        while getattr(e, 'reason', None) is not None and isinstance(e.reason, Exception):
            e = e.reason
        r = type(e).__name__
        print(url, repr(e), file=sys.stderr)
    print(url, r, 'fast' if time.monotonic() - t < 10 else 'slow')
def raw(addr, port, data):
    t = time.monotonic()
    try:
        s = socket.create_connection((addr, port), timeout=30)
        s.sendall(data)
        r = s.recv(100).decode() or 'closed'
    except Exception as e:
        r = type(e).__name__
    print(addr, port, r, 'fast' if time.monotonic() - t < 10 else 'slow')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_domain_is_reached_over_http_and_https_and_logged() {
    let (_serial, s, mut c, sb) = start(Some(domains(&["allowed.test"], &[80, 443]))).await;
    let code = format!("{PRELUDE}\nfetch('http://allowed.test/')\nfetch('https://allowed.test/')");
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "http://allowed.test/ hello allowed.test",
            "https://allowed.test/ hello allowed.test"
        ]
    );
    let seen = upstream().seen();
    assert!(seen.contains("http 80 allowed.test"), "{seen}");
    assert!(seen.contains("http 443 allowed.test"), "{seen}");
    let log = log_of(&mut c, &sb.id).await;
    let dns: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Dns as i32)
        .collect();
    assert!(
        dns.iter()
            .any(|e| e.allowed && e.name.starts_with("allowed.test") && e.answers == [UPSTREAM]),
        "{log:#?}"
    );
    let tcp: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Tcp as i32)
        .collect();
    for port in [80, 443] {
        let e = tcp
            .iter()
            .find(|e| e.port == port)
            .unwrap_or_else(|| panic!("no TCP event for port {port}: {log:#?}"));
        assert!(e.allowed, "{e:?}");
        assert_eq!(e.name, "allowed.test");
        assert_eq!(e.address, UPSTREAM);
        assert_eq!(e.verdict, format!("allowed.test:80,443"));
        assert!(e.bytes_out > 0 && e.bytes_in > 0, "{e:?}");
    }
    assert!(
        log.windows(2).all(|w| w[0].seq < w[1].seq),
        "ordered by seq"
    );
    // The log is queried as the audit trail is: by kind and time.
    let first_tcp = tcp.iter().map(|e| e.time_unix_ms).min().unwrap_or(0);
    let filtered = c
        .get_egress_log(GetEgressLogRequest {
            sandbox_id: sb.id.clone(),
            kinds: vec!["tcp".into()],
            since_unix_ms: first_tcp,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    let want: Vec<u64> = tcp.iter().map(|e| e.seq).collect();
    assert_eq!(filtered.iter().map(|e| e.seq).collect::<Vec<_>>(), want);
    let before_all = c
        .get_egress_log(GetEgressLogRequest {
            sandbox_id: sb.id.clone(),
            until_unix_ms: log[0].time_unix_ms,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert!(before_all.is_empty(), "{before_all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_connections_are_reset_at_once_and_logged() {
    let (_serial, s, mut c, sb) =
        start(Some(domains(&["allowed.test", "*.wild.test"], &[80]))).await;
    let before = upstream().seen();
    let code = format!(
        "{PRELUDE}
fetch('http://denied.test/')
raw('{UPSTREAM}', 80, b'GET / HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 80, b'hello\\n')
raw('169.254.169.254', 80, b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 80, b'GET / HTTP/1.1\\r\\nHost: a.wild.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 443, b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')
"
    );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            // The name is refused by DNS: no address, no connection.
            "http://denied.test/ gaierror fast".to_owned(),
            // A name the policy does not allow, at the upstream's literal address.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // No name at all.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // The metadata address, whatever the Host says.
            "169.254.169.254 80 ConnectionResetError fast".to_owned(),
            // A wildcard never opens a guarded (here private) address.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // An allowed name on a port the rule does not list.
            format!("{UPSTREAM} 443 ConnectionResetError fast"),
        ]
    );
    assert_eq!(
        upstream().seen(),
        before,
        "nothing denied reached the upstream"
    );
    let log = log_of(&mut c, &sb.id).await;
    let denied: Vec<_> = log.iter().filter(|e| !e.allowed).collect();
    let verdict_of = |kind: EgressKind, name: &str, addr: &str| {
        denied
            .iter()
            .find(|e| {
                e.kind == kind as i32 && e.name.starts_with(name) && e.address.starts_with(addr)
            })
            .map(|e| e.verdict.clone())
            .unwrap_or_else(|| panic!("no denied {kind:?} event for {name} {addr}: {log:#?}"))
    };
    assert_eq!(
        verdict_of(EgressKind::Dns, "denied.test", ""),
        "no rule allows this name"
    );
    assert!(verdict_of(EgressKind::Tcp, "denied.test", UPSTREAM).contains("10.0.0.0/8"));
    assert!(verdict_of(EgressKind::Tcp, "a.wild.test", UPSTREAM).contains("10.0.0.0/8"));
    assert!(verdict_of(EgressKind::Tcp, "", "169.254.169.254").contains("169.254.0.0/16"));
    assert!(
        denied
            .iter()
            .any(|e| e.port == 443 && e.name == "allowed.test"),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_refuses_denied_and_tunnel_shaped_names_and_udp_and_icmp_are_dropped() {
    let (_serial, s, mut c, sb) =
        start(Some(domains(&["allowed.test", "*.allowed.test"], &[]))).await;
    let before = upstream().seen();
    let tunnel = format!("{}.allowed.test", "a".repeat(60));
    let code = format!(
        r#"
import socket, struct, subprocess
def query(name, qtype=1):
    q = struct.pack('>HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split('.'):
        q += bytes([len(label)]) + label.encode()
    q += b'\0' + struct.pack('>HH', qtype, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, ('100.96.0.1', 53))
    r = s.recv(512)
    print(name[:20], qtype, 'rcode', r[3] & 0xf, 'answers', struct.unpack('>H', r[6:8])[0])
query('allowed.test')
query('denied.test')
query('{tunnel}')
query('allowed.test', 16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b'leak', ('{UPSTREAM}', 9999))
p = subprocess.run(['busybox', 'ping', '-c', '1', '-W', '2', '{UPSTREAM}'], capture_output=True)
print('ping', p.returncode)
"#
    );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "allowed.test 1 rcode 0 answers 1",
            "denied.test 1 rcode 5 answers 0",
            "aaaaaaaaaaaaaaaaaaaa 1 rcode 5 answers 0",
            "allowed.test 16 rcode 5 answers 0",
            "ping 1",
        ]
    );
    // The datagram had a second to arrive, had it been let through.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(upstream().seen(), before, "no UDP reached the upstream");
    let log = log_of(&mut c, &sb.id).await;
    let tunnel_event = log
        .iter()
        .find(|e| e.name.starts_with("aaaa"))
        .unwrap_or_else(|| panic!("the tunnel-shaped query is logged: {log:#?}"));
    assert!(!tunnel_event.allowed);
    assert!(
        tunnel_event.verdict.contains("tunnel-shaped"),
        "{tunnel_event:?}"
    );
    assert!(
        log.iter().any(|e| e.query_type == "TXT" && !e.allowed),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_applies_to_a_running_sandbox_at_once() {
    let (_serial, s, mut c, sb) = start(None).await;
    let url = "http://allowed.test/";
    let refused = |out: &str| {
        out.starts_with("http://allowed.test/ wget: bad address 'allowed.test'")
            && out.ends_with(" fast")
    };
    let out = wget(&mut c, &sb.id, url, s).await;
    assert!(refused(&out), "deny-all by default: {out}");
    let set = |network: NetworkPolicy| SetNetworkPolicyRequest {
        sandbox_id: sb.id.clone(),
        network: Some(network),
    };
    let r = c
        .set_network_policy(set(domains(&["allowed.test"], &[80])))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.network, Some(domains(&["allowed.test"], &[80])));
    assert_eq!(
        wget(&mut c, &sb.id, url, s).await,
        "http://allowed.test/ hello allowed.test"
    );
    c.set_network_policy(set(NetworkPolicy::default()))
        .await
        .unwrap();
    // A resolver that cached the name still has its connection refused.
    let out = wget(&mut c, &sb.id, url, s).await;
    assert!(
        refused(&out) || (out.contains("Connection reset by peer") && out.ends_with(" fast")),
        "{out}"
    );
    // Beyond the default ceiling (public addresses only): refused, the policy unchanged.
    let err = c
        .set_network_policy(set(NetworkPolicy {
            allow_internet: false,
            allow: vec![EgressRule {
                target: Some(egress_rule::Target::Cidr("10.213.0.0/30".into())),
                ports: vec![],
            }],
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("10.213.0.0/30"), "{err:?}");
}

/// A GET through an exposure at `addr`, presenting `token` the HTTP way, the raw way (a first
/// line) or not at all; the answer (empty: closed without one).
fn get_via(addr: &str, token: Option<&str>, raw: bool) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
    let mut req = String::new();
    match (token, raw) {
        (Some(t), true) => req.push_str(&format!("{t}\n")),
        (Some(t), false) => {
            req.push_str(&format!("GET / HTTP/1.0\r\nX-Airlock-Token: {t}\r\n\r\n"));
        }
        (None, _) => {}
    }
    if raw || token.is_none() {
        req.push_str("GET / HTTP/1.0\r\n\r\n");
    }
    s.write_all(req.as_bytes())?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_port_answers_with_the_token_only_and_until_its_ttl() {
    use airlock_api::v1::ExposePortRequest;
    use airlock_system_tests::harness::shell;
    let (_serial, s, mut c, sb) = start(None).await;
    c.exec(shell(
        &sb.id,
        "cd /tmp && echo exposed-content > index.html && exec python3 -m http.server 8000",
        0,
    ))
    .await
    .unwrap();
    let expose = |ttl_s| ExposePortRequest {
        sandbox_id: sb.id.clone(),
        guest_port: 8000,
        ttl_s,
    };
    let e = c.expose_port(expose(600)).await.unwrap().into_inner();
    assert_eq!(e.token.len(), 64);
    let addr = e.address.clone();
    // The guest's server takes a while to start on nested hosts.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let answer = loop {
        let (a, t) = (addr.clone(), e.token.clone());
        let got = tokio::task::spawn_blocking(move || get_via(&a, Some(&t), false))
            .await
            .unwrap();
        if let Ok(body) = &got
            && body.contains("exposed-content")
        {
            break body.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the exposed port never answered: {got:?}\n{}",
            s.log_tail()
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    };
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let (a, t) = (addr.clone(), e.token.clone());
    let raw = tokio::task::spawn_blocking(move || get_via(&a, Some(&t), true))
        .await
        .unwrap()
        .unwrap();
    assert!(
        raw.contains("exposed-content"),
        "raw TCP with the token: {raw}"
    );
    for (token, raw) in [
        (None, false),
        (Some("0".repeat(64)), false),
        (Some("wrong".into()), true),
    ] {
        let a = addr.clone();
        let got = tokio::task::spawn_blocking(move || get_via(&a, token.as_deref(), raw))
            .await
            .unwrap();
        assert!(
            !got.as_deref().unwrap_or("").contains("exposed-content"),
            "answered without the token: {got:?}"
        );
    }
    // A short exposure: gone after its TTL.
    let short = c.expose_port(expose(2)).await.unwrap().into_inner();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let a = short.address.clone();
    let after = tokio::task::spawn_blocking(move || get_via(&a, Some(&short.token), false))
        .await
        .unwrap();
    assert!(after.is_err(), "the exposure outlived its TTL: {after:?}");
    let log = log_of(&mut c, &sb.id).await;
    let exposed: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Expose as i32)
        .collect();
    assert!(
        exposed.iter().any(|e| e.allowed && e.bytes_out > 0),
        "{log:#?}"
    );
    assert!(
        exposed
            .iter()
            .filter(|e| !e.allowed && e.verdict == "no valid token")
            .count()
            >= 3,
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_template_have_working_separate_networks() {
    let (_serial, s, mut c, first) = start(Some(domains(&["allowed.test"], &[80]))).await;
    let mut others = Vec::new();
    for network in [Some(domains(&["allowed.test"], &[80])), None] {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                network,
                files: vec![FileToPlace {
                    path: "/tmp/ca.pem".into(),
                    content: upstream().ca_pem.clone(),
                    mode: 0o644,
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        others.push(sb);
    }
    let before = upstream().seen().lines().count();
    let mut tasks = Vec::new();
    for id in [&first.id, &others[0].id, &others[1].id] {
        let (mut c, id) = (c.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            wget(&mut c, &id, "http://allowed.test/", s).await
        }));
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await.unwrap());
    }
    assert_eq!(outs[0], "http://allowed.test/ hello allowed.test");
    assert_eq!(outs[1], "http://allowed.test/ hello allowed.test");
    // Refused (how fast a refusal comes is the other tests' concern: three guests at once
    // beside another test binary share two cores here, and a starved guest's wget takes its
    // time to fail).
    assert!(
        outs[2].starts_with("http://allowed.test/ wget: bad address"),
        "deny-all: {}",
        outs[2]
    );
    assert_eq!(
        upstream().seen().lines().count(),
        before + 2,
        "one request from each allowed sandbox"
    );
    // Each log holds its own sandbox's attempts only.
    let denied_log = log_of(&mut c, &others[1].id).await;
    assert!(
        !denied_log.is_empty() && denied_log.iter().all(|e| !e.allowed),
        "{denied_log:#?}"
    );
    for sb in [&first, &others[0]] {
        let log = log_of(&mut c, &sb.id).await;
        let allowed = log
            .iter()
            .filter(|e| e.kind == EgressKind::Tcp as i32 && e.allowed)
            .count();
        assert_eq!(allowed, 1, "{log:#?}");
    }
    for sb in &others {
        c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
            sandbox_id: sb.id.clone(),
        })
        .await
        .unwrap();
    }
}
